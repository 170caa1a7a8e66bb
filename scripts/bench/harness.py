"""What flylocal's benchmark scripts share: servers started on free loopback ports and stopped on
the way out, waiting until they answer, held-out Spec-Bench questions, and the statistics every
comparison reports (medians, per-question ratios with a bootstrap interval, timing a call).

Each script in this folder runs as `.venv/bin/python scripts/bench/NAME.py`; its folder is then
the first place Python imports from, so `import harness` finds this file."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def stream_chat(url: str, question: str, max_tokens: int, banned=(), model: str | None = None,
                extra: dict | None = None, raw: bool = False) -> dict:
    """One streamed, greedy chat request of `max_tokens` tokens (the `banned` ids at logit_bias
    -100; `model` and the `extra` body fields when given): its completion tokens, the stream's
    usage object (None when it sent none) and the perf_counter times of its start, first and last
    text and its end. `raw`: the question is a completion's prompt, as is (/v1/completions, for
    a base model). A status other than 200 raises httpx.HTTPStatusError."""
    import json

    import httpx

    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **({"prompt": question} if raw else {"messages": [{"role": "user", "content": question}]}), **(extra or {})}
    if model is not None:
        body["model"] = model
    if banned:
        body["logit_bias"] = {str(t): -100 for t in banned}
    start = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    with httpx.stream("POST", url + ("/v1/completions" if raw else "/v1/chat/completions"), json=body,
                      timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            choice = data["choices"][0] if data.get("choices") else {}
            if choice.get("text") if raw else choice.get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    return {"tokens": usage["completion_tokens"] if usage else chunks, "usage": usage, "start": start,
            "first": first, "last": last, "end": time.perf_counter()}


def end_tokens(path: str) -> list[int]:
    """The end-of-generation ids of the model at `path` (to ban them: every answer full length)."""
    import numpy as np

    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(path, RuntimeConfig(n_ctx=256, n_threads=1))
    try:
        return [int(t) for t in np.flatnonzero(rt.eog_mask)]
    finally:
        rt.close()


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


def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def interval(ratios: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval for the median of per-question ratios (questions resampled)."""
    import numpy as np

    r = np.asarray(ratios)
    picks = np.random.default_rng(seed).integers(0, len(r), size=(draws, len(r)))
    lo, hi = np.percentile(np.median(r[picks], axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def ratio_line(name: str, ratios: list[float]) -> str:
    """'NAME: median M (95% interval LO-HI), N questions'."""
    lo, hi = interval(ratios)
    return f"{name}: median {median(ratios):.3f} (95% interval {lo:.3f}-{hi:.3f}), {len(ratios)} questions"


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="What the benchmark scripts in this folder share: servers, questions, "
                            "statistics.", epilog="A module they import; run by itself it does nothing.").parse_args()
