#!/usr/bin/env python3
"""Verifiers side by side (strict, FLy, ASD) with the draft model and with MLA: a preset of
`flylocal bench`, which reports for each method the mean accepted length, decode and end-to-end
speedups over autoregressive decoding, agreement with the autoregressive output and where the
others first diverge, the target's own NLL of the text, ASD's regret spent and the verifier's
share of decoding. A second run measures that share on Gemma-3-270M at k = 16.

    .venv/bin/python scripts/bench_verifiers.py [--repeat 2] [--max-tokens 128] [--k 10] [--out DIR]
                                               [--temperature T --seed S] [--no-verify-share]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
METHODS = "autoregressive,strict-model,fly-model,asd-model,strict-mla,fly-mla,asd-mla"


def bench(*args: str) -> int:
    return subprocess.run([sys.executable, "-m", "flylocal", "bench", "--prompts", str(PROMPTS), *args]).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", default="2")
    ap.add_argument("--max-tokens", default="128")
    ap.add_argument("--k", default="10")
    ap.add_argument("--threads", default="0")
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--seed", default="1")
    ap.add_argument("--out", default=None, help="where the reports go (default: a temporary directory)")
    ap.add_argument("--no-verify-share", action="store_true", help="skip the Gemma verify-share run")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="flylocal-verifiers-"))
    common = ["--k", args.k, "--threads", args.threads, "--repeat", args.repeat]
    rc = bench("--draft", "smollm2-135m-instruct-q4_0", "--category", "summarization,reply,chat", "--methods", METHODS,
               "--max-tokens", args.max_tokens, "--temperature", args.temperature, "--seed", args.seed,
               "--out", str(out / "smollm2"), *common)
    if rc == 0 and not args.no_verify_share:
        rc = bench("--target", "gemma-3-270m", "--draft", "gemma-3-270m-q8_0", "--category", "copy-edit",
                   "--methods", "strict-model,fly-model,asd-model", "--max-tokens", "96", "--out", str(out / "gemma"),
                   *common[:4], "--k", "16")
    print(f"reports in {out}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
