"""`flylocal bench` in the regime users live in (docs/benchmarks.md, "The bandwidth-bound
stand-in"): the F32 stand-in target, whose decode is bound by memory bandwidth, with its Q2_K
draft, on prompts rendered for a base model.

    .venv/bin/python scripts/bench/standin.py --out DIR [--per-category 2] [--target NAME]
        [--draft NAME] [-- more flylocal bench options]

The prompts: the first turn of the first `per-category` Spec-Bench questions of each group,
and one copy-heavy edit of each kind from data/prompts.jsonl (copy-edit, code-edit,
data-edit), each as "Question: ...\\nAnswer:" (a base model continues that as an answer; a
bare question it continues as more question). They are written to DIR/prompts.jsonl, and the
bench's report to DIR. Options after `--` go to `flylocal bench` as they are (its defaults
otherwise: all methods that the draft allows, 128 tokens, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness import ROOT

from flylocal.front.bench import load_prompts, per_group
from flylocal.settings import STANDIN_DRAFT, STANDIN_TARGET

COPY_HEAVY = ("copy-edit", "code-edit", "data-edit")
FORM = "Question: {}\nAnswer:"


def prompts(per_category: int) -> list[dict]:
    rows = [{"id": f"sb-{p.id}", "prompt": FORM.format(p.text), "category": p.category}
            for p in per_group(load_prompts(str(ROOT / "data" / "spec_bench")), per_category)]
    kinds = set()
    for p in load_prompts(str(ROOT / "data" / "prompts.jsonl")):
        if p.category in COPY_HEAVY and p.category not in kinds:
            kinds.add(p.category)
            rows.append({"id": p.id, "prompt": FORM.format(p.text), "category": p.category})
    return rows


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--target", default=STANDIN_TARGET)
    ap.add_argument("--draft", default=STANDIN_DRAFT)
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = prompts(args.per_category)
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    defaults = {"--max-tokens": "128", "--threads": "2",
                "--methods": "autoregressive,strict-pld,fly-pld,strict-mla,fly-mla"}
    command = [sys.executable, "-m", "flylocal", "bench", "--target", args.target, "--draft", args.draft,
               "--prompts", str(out / "prompts.jsonl"), "--out", str(out), *extra]
    command += [arg for key, value in defaults.items() if key not in extra for arg in (key, value)]
    print(f"{len(rows)} prompts in {out / 'prompts.jsonl'}; {' '.join(command[1:])}", file=sys.stderr)
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
