"""The `flylocal` command's entry point: llama.cpp's library is loaded before numpy.

With a CUDA build of llama.cpp, a process that imported numpy before loading the library
crashed inside `llama_model_load_from_file` with every layer offloaded (an H200, CUDA 12,
numpy 2; `scripts/device_check.sh`): the same load in the same process ran when the library
came first. The command line imports numpy on its way to parsing the options, so the library
is loaded here, before that, whenever the run will use the fast build: the exact build is a CPU
build (flylocal.llama.kernels), chosen by `--exact` or FLYLOCAL_EXACT, and is left to be loaded
when the options have been read.
"""

from __future__ import annotations

import os
import sys


def _exact_wanted(argv: list[str]) -> bool:
    """Whether this run may ask for the exact build: `--exact` among the arguments (before a
    `--`), or FLYLOCAL_EXACT set. A doubtful case counts as exact: then nothing is loaded early."""
    if os.environ.get("FLYLOCAL_EXACT", "").strip() not in ("", "0"):
        return True
    words = argv[: argv.index("--")] if "--" in argv else argv
    return any(w == "--exact" or w.startswith("--exact=") for w in words)


def load_llama_first(argv: list[str]) -> None:
    """Load the fast build's library now, unless the exact build may be wanted or numpy is in
    already. A library that cannot load says so later, where a command needs it, in one line."""
    if "numpy" in sys.modules or _exact_wanted(argv):
        return
    try:
        import flylocal.llama.binding  # noqa: F401 - loads llama.cpp
    except Exception:       # noqa: BLE001 - the import fails again, and is reported, where a command needs it
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        load_llama_first(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        return 130
    from flylocal.front.cli import main as cli_main

    return cli_main(argv)
