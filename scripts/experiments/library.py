#!/usr/bin/env python3
"""How long `flylocal models list` takes over 50 local GGUF files, cold and warm.

    .venv/bin/python scripts/experiments/library.py [--files 50] [--repeat 3]

Links (hard links where it can, never copies) the four registry models into a temporary folder
on FLYLOCAL_MODEL_PATH, 50 names in turn, and times `flylocal models list` in a fresh process:
cold, with no metadata cache (every header parsed), and warm, with the cache the cold run wrote.
The registry's own rows are left out (FLYLOCAL_MODELS points at an empty folder): `models list`
hashes registry files by design, which is a separate cost. HOME is a temporary folder too, so no
other tool's models join in. Also times reading one header in process, Gemma's 262k vocabulary
being the slowest. The aim: a listing reads metadata only, 50 files in under a second.

Answered (docs/benchmarks.md, "Memory, and listing local models", 2026-11-30): 50 files listed
in 0.935 s cold and 0.251 s warm; one header 8 ms (SmolLM2) to 20 ms (Gemma 3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from flylocal import models
from flylocal import gguf_info  # noqa: E402

NAMES = ("smollm2-135m-instruct", "smollm2-135m-instruct-q4_0", "gemma-3-270m", "gemma-3-270m-q8_0")


def link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src, dst)


def timed_list(env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flylocal", "models", "list"], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"models list failed: {done.stderr.strip()}")
    return seconds


def header_seconds(path: Path, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        gguf_info.read_info(path)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3, help="Runs of each measurement (the median is reported).")
    args = ap.parse_args()
    sources = [models.local_path(name) for name in NAMES]
    missing = [str(p) for p in sources if not p.exists()]
    if missing:
        sys.exit(f"missing registry models (run scripts/setup.sh): {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="flylocal-bench-library-") as tmp:
        root = Path(tmp)
        folder, home, empty = root / "models", root / "home", root / "registry"
        for d in (folder, home, empty):
            d.mkdir()
        for i in range(args.files):
            src = sources[i % len(sources)]
            link(src, folder / f"{src.stem}-{i:02d}.gguf")
        metadata = root / "metadata.json"
        env = {k: v for k, v in os.environ.items()
               if k not in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE")}
        env.update(HOME=str(home), FLYLOCAL_MODELS=str(empty), FLYLOCAL_MODEL_PATH=str(folder),
                   FLYLOCAL_METADATA=str(metadata))
        cold, warm = [], []
        for _ in range(args.repeat):
            metadata.unlink(missing_ok=True)
            cold.append(timed_list(env))
            warm.append(timed_list(env))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import flylocal.front.cli, flylocal.models.library"], env=env, check=True)
        startup = time.perf_counter() - start
    print(f"models list, {args.files} files: cold {statistics.median(cold):.3f} s, warm {statistics.median(warm):.3f} s "
          f"(median of {args.repeat}; a fresh process, of which {startup:.3f} s is starting Python and importing)")
    for name, path in zip(NAMES, sources):
        print(f"header of {name}: {header_seconds(path, 5) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
