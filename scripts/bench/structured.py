"""Validity of constrained output over the whole matrix (docs/benchmarks.md, "Structured output"):
every prompt of data/structured/prompts.jsonl under every schema there, for strict, fly and
asd with pld, model and mla drafters, at temperature 0 and 0.8. Each answer that ended by
itself must parse and validate against its schema (jsonschema); an answer cut at
--max-tokens is counted apart (a schema whose every string is bounded leaves none).

    .venv/bin/python scripts/bench/structured.py [--max-tokens 192] [--prompts N] [--k 6] [--out FILE]
        [--schemas flat,nested] [--verifiers strict,fly] [--temperatures 0,0.8]

Prints one line per (schema, method, temperature) and exits 1 if any finished answer is invalid.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jsonschema

from flylocal.decoding import grammar as G
from flylocal.decoding.engine import generate_all
from flylocal.decoding.sampling import SamplingParams
from flylocal.loader import load
from flylocal.settings import Settings

from harness import ROOT

DATA = ROOT / "data" / "structured"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--schemas", default=None, help="comma-separated: only these schemas")
    ap.add_argument("--verifiers", default="strict,fly,asd")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--k", type=int, default=6, help="draft length, fixed: the draft model drafts every round")
    args = ap.parse_args()
    prompts = [json.loads(line) for line in (DATA / "prompts.jsonl").read_text().splitlines()][: args.prompts]
    schemas = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))
               if args.schemas is None or p.stem in args.schemas.split(",")}
    settings = Settings(draft="smollm2-135m-instruct-q4_0", max_tokens=args.max_tokens, k=args.k)
    models = load(settings)
    target = models.target
    rows, bad = [], 0
    try:
        for name, schema in schemas.items():
            grammar = G.Grammar(target, G.json_schema(schema), f"the schema {name}")
            for verifier in args.verifiers.split(","):
                for drafter in ("pld", "model", "mla"):
                    for temperature in map(float, args.temperatures.split(",")):
                        s = dataclasses.replace(settings, verifier=verifier, drafter=drafter,
                                                sampling=SamplingParams(temperature=temperature, seed=7))
                        valid = invalid = cut = tokens = forced = rounds = 0
                        cut_ids = []
                        t0 = time.perf_counter()
                        for p in prompts:
                            ids = target.tokenize_chat([{"role": "user", "content": p["prompt"]}])
                            out, stats, _ = generate_all(models.engine(s, private=True), ids, grammar)
                            tokens, forced, rounds = tokens + stats.emitted, forced + stats.forced, rounds + stats.rounds
                            if stats.stop != "eog":
                                cut += 1
                                cut_ids.append(p["id"])
                                continue
                            try:
                                jsonschema.validate(json.loads(target.detokenize(out)), schema)
                                valid += 1
                            except (ValueError, jsonschema.ValidationError):
                                invalid += 1
                        bad += invalid
                        row = dict(schema=name, verifier=verifier, drafter=drafter, temperature=temperature,
                                   valid=valid, invalid=invalid, cut=cut, cut_ids=cut_ids, tokens=tokens, forced=forced, rounds=rounds,
                                   seconds=round(time.perf_counter() - t0, 2))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        models.close()
    total = sum(r["valid"] + r["invalid"] + r["cut"] for r in rows)
    print(f"{total} answers: {sum(r['valid'] for r in rows)} valid, {bad} invalid, "
          f"{sum(r['cut'] for r in rows)} cut at --max-tokens", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
