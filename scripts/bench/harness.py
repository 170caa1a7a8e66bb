"""What flylocal's benchmark scripts share: servers started on free loopback ports and stopped on
the way out, waiting until they answer, held-out Spec-Bench questions, and the statistics every
comparison reports (medians, per-question ratios with a bootstrap interval, timing a call).
Servers are started as `flylocal bench serve` starts its fleet (flylocal.front.bench.serve),
whose port finder these scripts share.

Each script in this folder runs as `.venv/bin/python scripts/bench/NAME.py`; its folder is then
the first place Python imports from, so `import harness` finds this file."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flylocal.front.bench.serve import Server, fleet, free_port  # noqa: E402,F401 - the scripts' too
from flylocal.statistics import median, median_interval as interval  # noqa: E402,F401 - the scripts' too


@contextlib.contextmanager
def servers(commands: dict[str, list[str]], env: dict | None = None, startup: float = 300):
    """Start one server per name, each with its command (`{port}` in it is filled with a free
    port), as `flylocal bench serve` starts its fleet (flylocal.front.bench.serve.fleet), wait
    until all answer, and yield {name: url}; every one is stopped on the way out. A server that
    does not come up ends the script, saying why. `env`: variables added to this one's."""
    fleet_of = [Server(name, command=command, env=env or {}) for name, command in commands.items()]
    failed: list[str] = []
    with fleet(fleet_of, clients=1, ctx=0, startup=startup, say=failed.append) as urls:
        if failed:
            raise SystemExit("; ".join(failed))
        yield urls


def flylocal_serve(*options: str) -> list[str]:
    """The command of a `flylocal serve` on `{port}`, quiet, with these options."""
    return [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--quiet", *options]


def questions(per_category: int) -> list[str]:
    """The first turn of the first `per_category` Spec-Bench questions of each group."""
    return [text for _, text in spec_bench_questions(per_category)]


def spec_bench_questions(per_category: int, skip: int = 0, spec_bench: str | None = None) -> list[tuple[str, str]]:
    """(group, first turn) of Spec-Bench questions, `per_category` of each group after its first
    `skip` (those tuning has seen: held out with `skip`), from `spec_bench` (a folder with
    question.jsonl) or the project's copy."""
    from flylocal.front.bench import load_prompts, per_group

    prompts = load_prompts(spec_bench or str(ROOT / "data" / "spec_bench"))
    seen = {id(p) for p in per_group(prompts, skip)} if skip else set()
    chosen = {id(p) for p in per_group(prompts, skip + per_category)} - seen
    return [(p.group, p.text) for p in prompts if id(p) in chosen]


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="What the benchmark scripts in this folder share: servers, questions, "
                            "statistics.", epilog="A module they import; run by itself it does nothing.").parse_args()
