"""`flylocal bench --preset standin` as docs/benchmarks.md ("The bandwidth-bound stand-in")
runs it: on 2 threads, the prompts written to DIR/prompts.jsonl beside the report, so that a
run can be repeated on exactly its prompts with `flylocal bench --prompts DIR/prompts.jsonl`.

    .venv/bin/python scripts/bench/standin.py --out DIR [--per-category 2] [-- more bench options]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import harness  # noqa: F401 - puts the project on the import path

from flylocal.front.bench.prompts import standin_prompts


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-category", type=int, default=2)
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"id": p.id, "prompt": p.text, "category": p.category} for p in standin_prompts(args.per_category)]
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = [sys.executable, "-m", "flylocal", "bench", "--preset", "standin", "--per-category",
               str(args.per_category), "--out", str(out), *extra]
    if "--threads" not in extra:
        command += ["--threads", "2"]
    print(f"{len(rows)} prompts in {out / 'prompts.jsonl'}; {' '.join(command[1:])}", file=sys.stderr)
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
