#!/usr/bin/env python3
"""The target on an rpc server over loopback, against the same target here, and what a LAN
would add (docs/scale-out.md).

One `flylocal rpc-server` is started on a free loopback port (and killed at the end), pinned to
one half of the cores, with as many threads; this process (the draft, the target when it runs
here, the worker of the placed target) is pinned to the other half: two small machines on one,
joined by loopback. Then, in one run:

1. a decode of 1, 2, 5 and 9 rows after 256 tokens, here and through the server (median of 15):
   the loopback overhead per round;
2. generation of a set of prompts, autoregressive and speculative (strict with prompt lookup,
   strict and FLy with MLA, the draft local), here and through the server: decode tokens/s;
3. the same generations once more through a counting proxy between the client and the server,
   which counts the network round trips (a request answered by the server) and the bytes each
   way: per token, for each method;

2 and 3 with the output layer here (--rpc-output here: hidden states cross) and on the server
(--rpc-output server: logits cross).

The LAN projection is per token: the loopback time, plus round trips x the network's
round-trip latency, plus bytes / its bandwidth, for the latencies and bandwidths given. Both
halves are the same CPU, so compute is the same on both sides; a real target box changes the
compute, not the network terms.

    .venv/bin/python scripts/bench/rpc.py [--target NAME] [--draft NAME] [--max-tokens 96] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


from flylocal.decoding.engine import generate_all  # noqa: E402
from flylocal.llama import rpc  # noqa: E402
from flylocal.loader import build_engine, encode_prompt, open_model, runtime_config  # noqa: E402
from flylocal.models import resolve  # noqa: E402
from flylocal.settings import Settings  # noqa: E402

from harness import ROOT, free_port

PROMPT_IDS = ("copy-edit-keeper", "code-edit-rename", "chat-focus", "summarise-report", "story-robot")
METHODS = {"autoregressive": ("none", "strict"), "strict-pld": ("pld", "strict"),
           "strict-mla": ("mla", "strict"), "fly-mla": ("mla", "fly")}
ROWS = (1, 2, 5, 9)
OUTPUTS = ("here", "server")     # --rpc-output
LATENCIES_MS = (0.2, 1.0, 5.0)   # a wired LAN; Wi-Fi or a slow switch; a VPN across town
BANDWIDTHS = {"1 GbE": 117e6, "10 GbE": 1170e6}    # bytes per second of payload


def halves() -> tuple[set[int], set[int]]:
    """This process's cores split in two: (client's, server's)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("two cores at least: one half plays this machine, the other the server")
    return set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])


@contextlib.contextmanager
def rpc_server(cores: set[int]):
    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, sorted(cores))), sys.executable, "-m", "flylocal",
                             "rpc-server", "--port", endpoint.split(":")[1], "--threads", str(len(cores))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.hello(endpoint, timeout=1)
                break
            except rpc.FlylocalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the rpc server did not start")
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


class CountingProxy:
    """Forwards one TCP client at a time to `upstream`, counting the bytes each way and the
    round trips: each time the server starts answering after the client has sent."""

    def __init__(self, upstream: str):
        self.upstream = rpc.split(upstream)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.reset()
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self):
        with self.lock:
            self.up = self.down = self.trips = 0
            self.last = "down"

    def _accept(self):
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src, dst, way):
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with self.lock:
                    if way == "up":
                        self.up += len(data)
                    else:
                        self.down += len(data)
                        if self.last == "up":
                            self.trips += 1
                    self.last = way
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def counts(self):
        with self.lock:
            return self.trips, self.up, self.down


def decode_times(rt, ids, repeat=15) -> dict[int, float]:
    from flylocal.decoding.adaptive import timed_decode

    rt.reset()
    rt.decode(ids[:255])
    out = {n: float(np.median([timed_decode(rt, int(ids[255]), n) for _ in range(repeat)])) for n in ROWS}
    rt.reset()
    return out


def generate(settings: Settings, target, draft, prompts) -> dict:
    tokens = decode_s = rounds = 0
    for ids in prompts:
        engine = build_engine(settings, target, draft)
        out, stats, _ = generate_all(engine, ids)
        tokens += len(out)
        decode_s += stats.decode_s
        rounds += stats.rounds
    return {"tokens": tokens, "decode_s": decode_s, "rounds": rounds, "tok_s": tokens / decode_s}


def through(endpoint: str, output: str, base: Settings, target_path, draft, prompts, probe) -> dict:
    """Decode times, generations and their network counts with the target on the server."""
    placed = Settings(**{**base.__dict__, "target_rpc": (endpoint,), "rpc_output": output})
    r: dict = {}
    with open_model(target_path, runtime_config(placed, (endpoint,))) as target:
        r["decode"] = decode_times(target, probe)
        r["runs"] = {}
        for name, (drafter, verifier) in METHODS.items():
            s = Settings(**{**base.__dict__, "drafter": drafter, "verifier": verifier})
            generate(s, target, draft, prompts[:1])
            r["runs"][name] = generate(s, target, draft, prompts)
    proxy = CountingProxy(endpoint)
    with open_model(target_path, runtime_config(placed, (proxy.endpoint,))) as target:
        target.reset()
        target.decode(probe[:255])
        r["decode_counts"] = {}
        for n in ROWS:
            proxy.reset()
            for _ in range(10):
                target.decode(np.full(n, probe[255], dtype=np.int32), logits_from=0)
                target.truncate(255)
            trips, up, down = proxy.counts()
            r["decode_counts"][n] = {"trips": trips / 10, "up": up / 10, "down": down / 10}
        r["counts"] = {}
        for name, (drafter, verifier) in METHODS.items():
            s = Settings(**{**base.__dict__, "drafter": drafter, "verifier": verifier})
            proxy.reset()
            run = generate(s, target, draft, prompts)
            trips, up, down = proxy.counts()
            r["counts"][name] = {"tokens": run["tokens"], "rounds": run["rounds"],
                                 "trips_per_token": trips / run["tokens"], "bytes_per_token": (up + down) / run["tokens"]}
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct-q4_0")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    # Two machines on one: this process (the draft, the local target, the worker) on one half of
    # the cores, the server on the other, so that neither takes the other's cores.
    mine, theirs = halves()
    os.sched_setaffinity(0, mine)
    base = Settings(target=args.target, draft=args.draft, max_tokens=args.max_tokens, ctx=2048, threads=len(mine))
    target_path, draft_path = resolve(args.target), resolve(args.draft)
    rows = {json.loads(line)["id"]: json.loads(line) for line in open(ROOT / "data" / "prompts.jsonl")}
    results: dict = {"target": args.target, "draft": args.draft, "max_tokens": args.max_tokens}

    local_target = open_model(target_path, runtime_config(base))
    draft = open_model(draft_path, runtime_config(base))
    prompts = [encode_prompt(local_target, rows[p]["prompt"], raw=False)[0] for p in PROMPT_IDS]
    probe = local_target.tokenize(" ".join(rows[p]["prompt"] for p in PROMPT_IDS) * 4)
    results["decode_local"] = decode_times(local_target, probe)
    results["local"] = {}
    for name, (drafter, verifier) in METHODS.items():
        s = Settings(**{**base.__dict__, "drafter": drafter, "verifier": verifier})
        generate(s, local_target, draft, prompts[:1])                 # warm-up, uncounted
        results["local"][name] = generate(s, local_target, draft, prompts)
    local_target.close()

    with rpc_server(theirs) as endpoint:
        for output in OUTPUTS:
            results[output] = through(endpoint, output, base, target_path, draft, prompts, probe)
    draft.close()

    print(f"target {args.target}, draft {args.draft} (local), {len(prompts)} prompts, {args.max_tokens} tokens each")
    for output in OUTPUTS:
        r = results[output]
        print(f"\n--rpc-output {output}\n")
        print("decode of n rows after 255 tokens, ms (median of 15): here | through the rpc server on loopback | "
              "overhead | network round trips | KiB up/down per decode")
        for n in ROWS:
            here, there, c = results["decode_local"][n], r["decode"][n], r["decode_counts"][n]
            print(f"  {n}: {1000 * here:.2f} | {1000 * there:.2f} | {1000 * (there - here):+.2f} | {c['trips']:.1f} | "
                  f"{c['up'] / 1024:.1f} / {c['down'] / 1024:.1f}")
        print("generation, decode tok/s: here | rpc on loopback | ratio; per token: rounds, network round trips, KiB")
        for name in METHODS:
            here, there, c = results["local"][name], r["runs"][name], r["counts"][name]
            print(f"  {name}: {here['tok_s']:.1f} | {there['tok_s']:.1f} | {there['tok_s'] / here['tok_s']:.2f}; "
                  f"{c['rounds'] / c['tokens']:.2f}, {c['trips_per_token']:.1f}, {c['bytes_per_token'] / 1024:.1f}")
        print("projected on a LAN, tok/s (loopback time per token + round trips x latency + bytes / bandwidth):")
        print("  method: " + " | ".join(f"{lat:g} ms, {bw}" for lat in LATENCIES_MS for bw in BANDWIDTHS))
        r["projection"] = {}
        for name in METHODS:
            there, c = r["runs"][name], r["counts"][name]
            per_token = there["decode_s"] / there["tokens"]
            cells = {}
            for lat in LATENCIES_MS:
                for bw, rate in BANDWIDTHS.items():
                    t = per_token + c["trips_per_token"] * lat / 1000 + c["bytes_per_token"] / rate
                    cells[f"{lat:g} ms, {bw}"] = 1 / t
            r["projection"][name] = cells
            print(f"  {name}: " + " | ".join(f"{v:.1f}" for v in cells.values()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rpc.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
