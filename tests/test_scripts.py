"""Every tracked Python script answers `--help` (exit 0, a usage line) without llama.cpp's native
build: the fast suite runs this under `PYTHONPATH=.ci/no-native`, so a script that imports
llama_cpp, or model code that does, before it parses its arguments fails here.

The scripts are found with `git ls-files scripts`, so a new one is tested as soon as it is added,
and one that cannot answer `--help` fails the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_scripts() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "scripts"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:        # not a git checkout (an unpacked sdist): read the folder
        return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.py"))
    return sorted(p for p in listed.stdout.split() if p.endswith(".py"))


SCRIPTS = tracked_scripts()


def test_scripts_are_found():
    assert "scripts/bench/memory.py" in SCRIPTS and "scripts/random_gguf.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    # The environment is inherited whole: under .ci/no-native the script cannot import llama_cpp either.
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert done.returncode == 0, f"{script} --help exited {done.returncode}:\n{done.stderr[-2000:]}"
    assert done.stdout.lstrip().startswith("usage:"), f"{script} --help printed no usage line:\n{done.stdout[:500]}"
