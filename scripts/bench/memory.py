#!/usr/bin/env python3
"""Peak resident memory of one `flylocal generate` run, measured from a parent process.

    .venv/bin/python scripts/bench/memory.py [--target gemma-3-270m] [--ctx 8192] [--drafter pld]

Prints the child's peak RSS (ru_maxrss). A full n_ctx x n_vocab float32 logits buffer alone
would be 8 GiB for Gemma 3 at 8k context; flylocal asks llama.cpp for logits only on the rows
it verifies.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

TEXT = ("The river runs through the valley and past the mill. The miller grinds the grain each morning, "
        "and the baker buys the flour each afternoon. ") * 40


def peak_rss_mib(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """Run `python -m flylocal ARGS` in a fresh child and return its peak RSS in MiB."""
    probe = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run([sys.executable, '-m', 'flylocal', *sys.argv[1:]], capture_output=True, text=True)\n"
        "sys.stderr.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(done.returncode)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
    kib = int(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else 0
    return kib / 1024, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma-3-270m")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--drafter", default="pld")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    mib, done = peak_rss_mib(["generate", TEXT, "--raw", "--target", a.target, "--ctx", str(a.ctx),
                              "--drafter", a.drafter, "--max-tokens", str(a.max_tokens), "--json"])
    if done.returncode != 0:
        print(done.stderr.strip(), file=sys.stderr)
        return 1
    print(f"{a.target} --ctx {a.ctx} --drafter {a.drafter}: peak RSS {mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
