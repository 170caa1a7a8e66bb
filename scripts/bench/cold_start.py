"""Cold start: seconds from sending a streamed chat request that names a model not loaded to its
first content token, on `flylocal serve` (several models; default per-model draft, and
--drafter pld) and on llama-server's router mode (--models-dir) over the same GGUF files.

Every server starts once, on a free loopback port, with smollm2-135m-instruct loaded (flylocal's
first --model; llama-server's POST /models/load) and stays up. Each repetition then times, on
every server in turn (a different one first each repetition), for each measured model: a cold
request (the model unloaded), a warm one (the same request again, the model loaded: the prompt
may come from the server's cache), and an unload (POST /models/unload, then GET /models polled
until it says "unloaded"). Requests: max_tokens 8, temperature 0, the same short prompt. One
untimed round first loads and unloads every model on every server (files in the page cache,
flylocal's cost curves measured). Every server is stopped on the way out, even on an error.

    .venv/bin/python scripts/bench/cold_start.py                       # 5 repetitions
    .venv/bin/python scripts/bench/cold_start.py --repeat 3 --models gemma-3-270m
    .venv/bin/python scripts/bench/cold_start.py --llama-server /path/to/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from flylocal.front.bench.serve import stop_all
from flylocal.models import local_path

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "/tmp/lcppsrc/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
PROMPT = "Name one color of the sky."
FIRST = "smollm2-135m-instruct"
HTTP = httpx.Client(trust_env=False, timeout=600)    # loopback only: no proxy from the environment


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(command: list[str], env: dict, log, startup: float = 300):
    """Run `command` ({port} filled) in a process group of its own, wait for GET /health 200,
    yield its URL; the group is sent SIGTERM (SIGKILL after 30 s) on the way out."""
    port = free_port()
    proc = subprocess.Popen([c.replace("{port}", str(port)) for c in command], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, env={**os.environ, **env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if HTTP.get(url + "/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not come up (exit {proc.poll()}); see {log.name}")
            time.sleep(0.25)
        yield url
    finally:
        stop_all([proc])            # SIGTERM to its group; SIGKILL after a minute
        with contextlib.suppress(ProcessLookupError):       # a child left behind in the group
            os.killpg(proc.pid, signal.SIGKILL)


def first_token(url: str, model: str) -> float:
    """Seconds from sending the streamed request to its first chunk with content."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with HTTP.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url} {model}: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    return time.perf_counter() - t0
    raise SystemExit(f"{url} {model}: no content in the answer")


def status(url: str, model: str) -> str:
    for m in HTTP.get(url + "/models").json()["data"]:
        if m["id"] == model:
            return m.get("status", {}).get("value", "?")
    raise SystemExit(f"{url}: GET /models does not list {model}")


def set_loaded(url: str, model: str, loaded: bool) -> None:
    """POST /models/load or /models/unload, then wait until GET /models agrees."""
    want = "loaded" if loaded else "unloaded"
    if status(url, model) != want:
        r = HTTP.post(url + ("/models/load" if loaded else "/models/unload"), json={"model": model})
        if r.status_code != 200:
            raise SystemExit(f"{url} {want} {model}: {r.status_code} {r.text[:300]}")
    deadline = time.monotonic() + 300
    while status(url, model) != want:
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: {model} not {want} after 300 s")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gemma-3-270m", "gemma-3-270m-f32"], help="the models timed")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed load/unload rounds first")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=LLAMA)
    args = ap.parse_args()

    common = ["--ctx", str(args.ctx), "--parallel", "1", "--threads", str(args.threads), "--quiet"]
    flylocal = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--host", "127.0.0.1", *common,
                *[w for m in [FIRST, *args.models] for w in ("--model", m)]]
    with tempfile.TemporaryDirectory(prefix="cold_start.") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp, "models")
        folder.mkdir()
        for m in [FIRST, *args.models]:
            (folder / f"{m}.gguf").symlink_to(local_path(m))
        llama = [args.llama_server, "--host", "127.0.0.1", "--port", "{port}", "--models-dir", str(folder),
                 "--models-max", str(1 + len(args.models)), "-c", str(args.ctx), "-np", "1", "-t", str(args.threads),
                 "--no-webui"]
        commands = {"flylocal": (flylocal, {}),
                    "flylocal --drafter pld": (flylocal + ["--drafter", "pld"], {}),
                    "llama-server router": (llama, {"LD_LIBRARY_PATH": str(Path(args.llama_server).parent)})}
        urls = {}
        for name, (command, env) in commands.items():
            log = stack.enter_context(open(Path(tmp, name.replace(" ", "_") + ".log"), "w+"))
            urls[name] = stack.enter_context(started(command, env, log))
            set_loaded(urls[name], FIRST, True)
            print(f"{name}: up at {urls[name]}", file=sys.stderr, flush=True)
        cold = {(s, m): [] for s in urls for m in args.models}
        warm = {(s, m): [] for s in urls for m in args.models}
        names = list(urls)
        for rep in range(args.warmup + args.repeat):
            for name in names[rep % len(names):] + names[:rep % len(names)]:     # alternate who goes first
                for m in args.models:
                    url = urls[name]
                    set_loaded(url, m, False)
                    c = first_token(url, m)
                    w = first_token(url, m)
                    set_loaded(url, m, False)
                    if rep >= args.warmup:
                        cold[name, m].append(c)
                        warm[name, m].append(w)
                    print(f"{'warm-up' if rep < args.warmup else f'rep {rep - args.warmup + 1}'} {name} {m}: "
                          f"cold {c:.3f} s, warm {w:.3f} s", file=sys.stderr, flush=True)
        starts = {name: x.removeprefix("flylocal: ") for name in names      # each flylocal's models and drafts
                  for x in Path(tmp, name.replace(" ", "_") + ".log").read_text().splitlines()
                  if x.startswith("flylocal: serving ")}

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    print(f"\nTime to first token, s: median (min-max) of {args.repeat}; --ctx {args.ctx}, 1 slot, "
          f"{args.threads} threads, max_tokens 8, temperature 0\n")
    print("| server | model | cold (model not loaded) | warm (model loaded) | cold - warm |")
    print("|---|---|---|---|---|")
    for (name, m), xs in cold.items():
        print(f"| {name} | {m} | {cell(xs)} | {cell(warm[name, m])} | "
              f"{statistics.median(xs) - statistics.median(warm[name, m]):.3f} |")
    print()
    for name, line in starts.items():
        print(f"- {name}: {line}")


if __name__ == "__main__":
    main()
