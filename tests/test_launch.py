"""The `flylocal` command loads llama.cpp's library before numpy (flylocal/launch.py: a CUDA
build crashed loading a model in a process that had imported numpy first), and leaves the
exact build to be chosen by the options."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest


def import_order(*args: str, exact: bool = False) -> list[str]:
    """The modules `python -X importtime -m flylocal ARGS` imported, in order."""
    env = {k: v for k, v in os.environ.items() if k != "FLYLOCAL_EXACT"}
    if exact:
        env["FLYLOCAL_EXACT"] = "1"
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flylocal", *args], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
            and not line.rstrip().endswith("package")]


@pytest.mark.slow      # loads llama.cpp
def test_the_command_loads_llama_cpp_before_numpy():
    order = import_order("--version")
    assert "llama_cpp.llama_cpp" in order and "numpy" in order
    assert order.index("llama_cpp.llama_cpp") < order.index("numpy")


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_run_that_may_want_the_exact_build_loads_nothing_early(how):
    order = import_order(*(["generate", "--exact", "--help"] if how == "option" else ["generate", "--help"]), exact=how == "environment")
    assert "llama_cpp.llama_cpp" not in order


def test_the_installed_command_is_the_launcher():
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "flylocal"]
    assert script.value == "flylocal.launch:main"
