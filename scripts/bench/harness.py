"""What flylocal's benchmark scripts share: servers started on free loopback ports and stopped on
the way out, waiting until they answer, held-out Spec-Bench questions, and the statistics every
comparison reports (medians, per-question ratios with a bootstrap interval, timing a call).
Servers side by side are `flylocal bench serve`'s (flylocal.front.bench.servers), whose port
finder and interval these scripts share.

Each script in this folder runs as `.venv/bin/python scripts/bench/NAME.py`; its folder is then
the first place Python imports from, so `import harness` finds this file."""

from __future__ import annotations

import contextlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flylocal.front.bench.servers import free_port  # noqa: E402,F401 - the scripts' too
from flylocal.statistics import median, median_interval as interval  # noqa: E402,F401 - the scripts' too


def wait_ready(proc: subprocess.Popen, url: str, log, health: str = "/health", timeout: float = 300,
               name: str = "server") -> None:
    """Wait until `url + health` answers 200; SystemExit with the end of the server's `log` (a
    file) when it exits first or takes longer than `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:]
            raise SystemExit(f"{name} exited: {tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not become ready in {timeout:g} s")
        time.sleep(0.25)


def stop(procs) -> None:
    """SIGTERM every process, then wait for each (a minute at most, then kill)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


@contextlib.contextmanager
def servers(commands: dict[str, list[str]], health: str = "/health", env: dict | None = None):
    """Start one server per name, each with its command (`{port}` in it is filled with a free
    port), wait until all answer, and yield {name: url}; every one is stopped on the way out."""
    procs, urls, logs = [], {}, []
    try:
        for name, command in commands.items():
            port = free_port()
            log = tempfile.TemporaryFile()           # a pipe nobody reads would stall the server
            procs.append(subprocess.Popen([part.replace("{port}", str(port)) for part in command], stdout=log,
                                          stderr=log, env=env))
            urls[name] = f"http://127.0.0.1:{port}"
            logs.append(log)
        for (name, url), proc, log in zip(urls.items(), procs, logs):
            wait_ready(proc, url, log, health, name=name)
        yield urls
    finally:
        stop(procs)
        for log in logs:
            log.close()


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
