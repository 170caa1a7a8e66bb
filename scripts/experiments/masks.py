"""What a grammar costs per round (docs/benchmarks.md, "Structured output"): for each model, a
constrained answer is generated once, then rounds of k draft tokens along it are replayed
through the constraint: masks computed along the draft and applied to k+1 rows of logits
(Constraint.restrict), the draft checked (allowed) and the round committed.

    .venv/bin/python scripts/experiments/masks.py [--schema data/structured/long_keys.json] [--k 8]

Prints, per model: its vocabulary, the tokenizer's build time, and the median per round and
per row of restrict and of allowed.

Answered (docs/benchmarks.md, "Structured output", 2026-12-02): masks of 9 rows took 1.6 ms on
SmolLM2 and 3.9 ms on Gemma 3 (a busy machine), small beside a round.
"""

from __future__ import annotations

import sys

import argparse
import json
import statistics
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import ROOT     # first: puts this checkout on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schema", default=str(ROOT / "data/structured/long_keys.json"))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import flylocal.llama.binding  # noqa: F401 - llama.cpp before numpy (flylocal/launch.py says why)
    import numpy as np

    from flylocal import models as registry
    from flylocal.decoding import grammar as G
    from flylocal.decoding.engine import generate_all
    from flylocal.llama.runtime import Runtime, RuntimeConfig
    from flylocal.loader import build_engine
    from flylocal.settings import Settings

    schema = json.loads(Path(args.schema).read_text())
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        rt = Runtime(registry.local_path(name), RuntimeConfig(n_ctx=1024))
        t0 = time.perf_counter()
        grammar = G.Grammar(rt, G.json_schema(schema), "the schema")
        built = time.perf_counter() - t0
        prompt = "Describe the planet Mars. Answer in JSON."
        ids = rt.tokenize_chat([{"role": "user", "content": prompt}])
        ids = ids if ids is not None else rt.tokenize(prompt)
        answer, _, _ = generate_all(build_engine(Settings(target=name, drafter="none", max_tokens=192), rt, None),
                                    ids, grammar)
        answer = np.array(answer, dtype=np.int32)
        restrict, allowed = [], []
        logits = np.zeros((args.k + 1, rt.n_vocab), dtype=np.float32)
        for _ in range(args.repeat):
            c = grammar.start()
            for start in range(0, len(answer) - args.k, args.k):
                draft = answer[start : start + args.k]
                t0 = time.perf_counter()
                n = c.allowed(draft)
                t1 = time.perf_counter()
                c.restrict(logits, draft[:n])
                t2 = time.perf_counter()
                c.commit(draft)
                allowed.append(t1 - t0)
                restrict.append(t2 - t1)
        per_round = statistics.median(restrict)
        print(json.dumps({"model": name, "n_vocab": rt.n_vocab, "tokenizer_s": round(built, 2),
                          "answer_tokens": len(answer), "k": args.k,
                          "restrict_ms_per_round": round(per_round * 1e3, 3),
                          "restrict_us_per_row": round(per_round / (args.k + 1) * 1e6, 1),
                          "allowed_us_per_round": round(statistics.median(allowed) * 1e6, 1)}), flush=True)
        rt.close()


if __name__ == "__main__":
    main()
