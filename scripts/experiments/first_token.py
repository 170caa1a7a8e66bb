"""The first token through each server, streamed: flylocal plain, fly-pld and fly-mla, and
llama-server, on the same long prompts, the servers' order turning with each prompt so that no
server always goes first. Measures whether a mode's first token waits on more than plain's
prefill, and whether flylocal's prefill keeps up with llama-server's.

    .venv/bin/python scripts/experiments/first_token.py --context 4000 --prompts 6
        [--target gemma-3-270m-f32] [--draft gemma-3-270m-q2_k] [--llama-server PATH]
        [--ggml-cpu DIR]

--ggml-cpu DIR: also run llama-server with the libggml-cpu.so* in DIR in place of its own
(flylocal's, from the llama_cpp package: the same kernels on both sides, so that what differs
is the server, not the build). Prompts are Spec-Bench questions padded with other questions'
whole texts (as `bench serve --context`); the first is a warm-up. Prints each prompt's seconds
and, per server, the median and the range of its ratio to flylocal plain's, prompt by prompt.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import harness  # noqa: F401 - puts the project on the import path

from flylocal import models
from flylocal.errors import FlylocalError
from flylocal.front.bench.prompts import data_dir
from flylocal.front.bench.questions import padded, token_counter


def servers(args, ctx: int, path: str) -> dict[str, tuple[list[str], dict]]:
    fly = [sys.executable, "-m", "flylocal", "serve", "--quiet", "--target", args.target, "--ctx", str(ctx),
           "--parallel", "1", "--threads", str(args.threads)]
    out = {"plain": (fly + ["--drafter", "none", "--verifier", "strict"], {}),
           "fly-pld": (fly + ["--drafter", "pld", "--verifier", "fly"], {}),
           "fly-mla": (fly + ["--drafter", "mla", "--verifier", "fly", "--draft", args.draft], {})}
    if args.llama_server:
        own = [args.llama_server, "-m", path, "-np", "1", "-c", str(ctx), "-t", str(args.threads), "--no-webui"]
        out["llama-server"] = (own, {})
        if args.ggml_cpu:
            if not list(Path(args.ggml_cpu).glob("libggml-cpu.so*")):
                raise SystemExit(f"--ggml-cpu {args.ggml_cpu}: no libggml-cpu.so there")
            lib = tempfile.mkdtemp(prefix="first-token-")
            args.made.append(lib)
            for f in Path(args.llama_server).resolve().parent.glob("*.so*"):
                os.symlink(f, Path(lib) / f.name)
            for f in Path(args.ggml_cpu).glob("libggml-cpu.so*"):
                (Path(lib) / f.name).unlink(missing_ok=True)
                os.symlink(f.resolve(), Path(lib) / f.name)
            out["llama-server, flylocal's ggml-cpu"] = (own, {"LD_LIBRARY_PATH": lib})
    return out


def first_token(port: int, model: str, text: str) -> float:
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 8, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    first = None
    for line in c.getresponse():
        if first is None and line.startswith(b"data:") and b'"text"' in line:
            first = time.perf_counter() - t0
    if first is None:
        raise SystemExit(f"port {port}: no token came back")
    return first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(port: int, proc: subprocess.Popen) -> None:
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"port {port}: the server exited ({proc.returncode}) before it answered")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"port {port}: the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--target", default="gemma-3-270m-f32")
    ap.add_argument("--draft", default="gemma-3-270m-q2_k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--ggml-cpu", default="")
    args = ap.parse_args()
    args.made = []
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"--llama-server {args.llama_server}: no such program")
    try:
        path = str(models.resolve(args.target))
    except FlylocalError as e:
        raise SystemExit(f"--target {args.target}: {e}") from None
    texts = [json.loads(line)["turns"][0] for line in open(data_dir() / "spec_bench" / "question.jsonl")]
    count = token_counter(path)
    prompts = [padded(texts[i], texts, i * 41 + 11, args.context, count) for i in range(20, 21 + args.prompts)]
    specs = servers(args, args.context + 600, path)
    procs, ports = [], {}
    try:
        for name, (command, env) in specs.items():
            ports[name] = free_port()
            procs.append(subprocess.Popen(command + ["--port", str(ports[name])], env={**os.environ, **env},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port, proc in zip(ports.values(), procs):
            ready(port, proc)
        names, got = list(specs), {name: [] for name in specs}
        for i, text in enumerate(prompts):
            turn = names[i % len(names):] + names[: i % len(names)]
            seconds = {name: first_token(ports[name], args.target, text) for name in turn}
            print(i, ", ".join(f"{name} {seconds[name]:.2f} s" for name in names), flush=True)
            if i:
                for name in names:
                    got[name].append(seconds[name])
        for name in names:
            r = [a / b for a, b in zip(got[name], got["plain"])]
            print(f"{name}: median {statistics.median(got[name]):.2f} s, over plain {statistics.median(r):.3f} "
                  f"({min(r):.3f}-{max(r):.3f})")
    finally:
        for p in procs:
            p.terminate()
        for lib in args.made:
            shutil.rmtree(lib, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
