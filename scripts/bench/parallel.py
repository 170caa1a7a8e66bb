#!/usr/bin/env python3
"""Several clients at once: flylocal serve with slots (--parallel N) against the serial server
(--parallel 1) and llama.cpp's llama-server -np N, on the same model and CPU build.

For each client count C (1, 2, 4, 8 by default) and each configuration, C clients stream
Spec-Bench questions (first turns, the first of each group, in turn) at --max-tokens tokens
each, greedy, the model's end-of-generation tokens banned (logit_bias -100) so every answer has
the same length everywhere. Client i starts i x --stagger seconds after the first and sends
--questions questions back to back. The configurations take turns, a different one first each
repeat (interleaved), and every repeat is a wave of its own.

Per configuration and count: aggregate tokens/s (all completion tokens over the wave's wall
time), each client's tokens/s (its tokens over its own time), p50/p95 time to first token; the
ratio of each to the serial server's in the same repeat, as a median over repeats with a 95%
bootstrap interval. `--copy` asks the summarization and RAG questions (the copy-heavy groups).
`--together` starts every configuration's server at once for a client count, so that the
waves of a repeat follow each other without a server's start between them (the machine's
speed drifts). `--solo` sends each serial wave's questions again, alone, client by client: the
sum of every client's time over the longest client's is the most slots could gain over the
one-slot server.

Configurations: `serial` (flylocal --parallel 1), `slots` (flylocal --parallel C), `slots-plain`
(the same without drafts), `slots-unified` (with --kv-unified; only when asked for) and, with
--llama-server PATH, `llama-server` (-np C, plain) and `llama-server-ngram` (-np C with its
`--spec-type ngram-mod`, its speculation that needs no draft model). flylocal's method is
--method (fly-pld, the default method, by default). After the table: `slots` against
`slots-plain` and against llama-server's better mode at each count, repeat by repeat.

A base model (the stand-in) answers raw completions, `Question: ...\nAnswer:` (`--raw`).

    .venv/bin/python scripts/bench/parallel.py [--target gemma-3-270m-f32 --raw] [--clients 1,2,4,8]
        [--repeat 3] [--llama-server PATH] [--copy] [--together] [--solo] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time

import numpy as np

from harness import ROOT, end_tokens, interval, servers, stream_chat

METHODS = {"strict-pld": ["--verifier", "strict", "--drafter", "pld"],
           "fly-pld": ["--verifier", "fly", "--drafter", "pld"],
           "plain": ["--verifier", "strict", "--drafter", "none"]}


def spec_questions(copy: bool) -> list[str]:
    from flylocal.front.bench import load_prompts

    prompts = load_prompts(str(ROOT / "data" / "spec_bench"))
    groups: dict[str, list[str]] = {}
    for p in prompts:
        if copy and p.group not in ("summarization", "rag"):
            continue
        groups.setdefault(p.group, []).append(p.text)
    # the groups in turn: the first question of each, then the second of each, ...
    order = []
    for i in range(max(len(v) for v in groups.values())):
        order += [v[i] for v in groups.values() if i < len(v)]
    return order


def stream(url: str, question: str, max_tokens: int, banned: list[int], raw: bool = False) -> dict:
    r = stream_chat(url, question, max_tokens, banned, raw=raw)
    end = r["last"] or time.perf_counter()
    return {"tokens": r["tokens"], "ttft": (r["first"] or end) - r["start"], "start": r["start"], "end": end}


def wave(url: str, clients: int, questions: list[str], offset: int, args, banned) -> dict:
    """C clients, each sending --questions questions back to back, client i starting i x stagger
    seconds late: aggregate tokens/s, each client's tokens/s, times to first token."""
    done: list[list[dict]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(i: int) -> None:
        time.sleep(i * args.stagger)
        try:
            for j in range(args.questions):
                q = questions[(offset + i * args.questions + j) % len(questions)]
                done[i].append(stream(url, q, args.max_tokens, banned, args.raw))
        except Exception as e:  # noqa: BLE001 - counted, the wave goes on
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{url}: {len(errors)} clients failed: {errors[0]}")
    all_ = [r for rs in done for r in rs]
    wall = max(r["end"] for r in all_) - min(r["start"] for r in all_)
    per_client = [sum(r["tokens"] for r in rs) / (rs[-1]["end"] - rs[0]["start"]) for rs in done]
    ttft = [r["ttft"] for r in all_]
    return {"aggregate": sum(r["tokens"] for r in all_) / wall, "client": statistics.median(per_client),
            "client_min": min(per_client), "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p95": float(np.percentile(ttft, 95)), "tokens": sum(r["tokens"] for r in all_)}


def solo_bound(url: str, clients: int, questions: list[str], offset: int, args, banned) -> float:
    """The wave's questions sent alone, client by client: the sum of every client's time over
    the longest client's, the most slots could gain on the one-slot server if company cost
    nothing (a client's questions still go one after another)."""
    times = []
    for i in range(clients):
        t = 0.0
        for j in range(args.questions):
            r = stream(url, questions[(offset + i * args.questions + j) % len(questions)], args.max_tokens, banned,
                       args.raw)
            t += r["end"] - r["start"]
        times.append(t)
    return sum(times) / max(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--method", default="fly-pld", choices=sorted(METHODS))
    ap.add_argument("--raw", action="store_true", help="raw completions 'Question: ...\\nAnswer:' (a base model)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2, help="questions each client sends per wave")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=2048, help="cells per slot")
    ap.add_argument("--threads", default=None, help="threads for every server (default: flylocal's auto, "
                                                   "llama-server's own)")
    ap.add_argument("--stagger", type=float, default=0.3, help="seconds between clients' starts")
    ap.add_argument("--copy", action="store_true", help="only the copy-heavy groups (summarization, rag)")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--configs", default=None,
                    help="comma-separated: serial, slots, slots-plain, slots-unified, llama-server, "
                         "llama-server-ngram")
    ap.add_argument("--together", action="store_true",
                    help="every configuration's server up at once for a client count, the waves taking turns "
                         "(pairs them closer in time on a machine whose speed drifts)")
    ap.add_argument("--solo", action="store_true",
                    help="after each serial wave, its questions alone, client by client: what slots could gain at most")
    ap.add_argument("--json", default=None, help="write every wave's figures here")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from flylocal import models

    path = str(models.resolve(args.target))
    banned = end_tokens(path)
    from flylocal.front.bench.prompts import BASE_FORM

    qs = [BASE_FORM.format(q) if args.raw else q for q in spec_questions(args.copy)]
    threads = ["--threads", args.threads] if args.threads else []
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else \
        ["serial", "slots", "slots-plain"] + (["llama-server", "llama-server-ngram"] if args.llama_server else [])
    method = METHODS[args.method]
    results: dict[tuple[str, int], list[dict]] = {}

    def command(config: str, clients: int) -> list[str]:
        fly = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--quiet", "--target", args.target,
               "--ctx", str(args.ctx), "--max-queue", "64", *threads]
        if config == "serial":
            return fly + ["--parallel", "1", *method]
        if config == "slots":
            return fly + ["--parallel", str(clients), *method]
        if config == "slots-plain":
            return fly + ["--parallel", str(clients), *METHODS["plain"]]
        if config == "slots-unified":
            return fly + ["--parallel", str(clients), "--kv-unified", *method]
        spec = ["--spec-type", "ngram-mod"] if config == "llama-server-ngram" else []
        return [args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1", "-np", str(clients),
                "-c", str(args.ctx * clients), "--no-webui", *spec,
                *(["-t", args.threads, "-tb", args.threads] if args.threads else [])]

    def measure(url: str, config: str, clients: int, repeat: int) -> None:
        r = wave(url, clients, qs, repeat * clients * args.questions, args, banned)
        if args.solo and config == "serial" and clients > 1:
            r["bound"] = solo_bound(url, clients, qs, repeat * clients * args.questions, args, banned)
        results.setdefault((config, clients), []).append(r)
        print(f"C={clients} repeat {repeat + 1} {config}: {r['aggregate']:.1f} tok/s aggregate, "
              f"{r['client']:.1f} per client, TTFT p50 {r['ttft_p50']:.2f} s p95 {r['ttft_p95']:.2f} s",
              file=sys.stderr, flush=True)

    def warm(url: str) -> None:
        stream(url, BASE_FORM.format("Hello!") if args.raw else "Hello!", 8, banned, args.raw)

    for clients in counts:
        if args.together:
            with servers({config: command(config, clients) for config in configs}) as urls:
                for url in urls.values():
                    warm(url)
                for repeat in range(args.repeat):
                    for config in configs[repeat % len(configs):] + configs[: repeat % len(configs)]:
                        measure(urls[config], config, clients, repeat)
            continue
        for repeat in range(args.repeat):
            for config in configs[repeat % len(configs):] + configs[: repeat % len(configs)]:
                with servers({config: command(config, clients)}) as urls:
                    warm(urls[config])
                    measure(urls[config], config, clients, repeat)
    print(f"{args.target}, {args.method} (plain for slots-plain and llama-server, ngram-mod for llama-server-ngram), {args.max_tokens} tokens, "
          f"{args.questions} questions per client per wave{' (copy-heavy groups)' if args.copy else ''}, "
          f"clients {args.stagger:g} s apart, {args.repeat} repeats, {os.cpu_count()} cores; medians over "
          f"repeats; ratios to the serial server in the same repeat (95% interval)")
    print("| clients | config | aggregate tok/s | / serial | per client tok/s | slowest client | TTFT p50 s | "
          "TTFT p95 s |")
    print("|---|---|---|---|---|---|---|---|")
    for clients in counts:
        base = results.get(("serial", clients))
        for config in configs:
            rs = results[(config, clients)]
            agg = statistics.median(r["aggregate"] for r in rs)
            ratio = ""
            if base:
                ratios = [r["aggregate"] / b["aggregate"] for r, b in zip(rs, base)]
                lo, hi = interval(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
                ratio = f"{statistics.median(ratios):.2f} ({lo:.2f}-{hi:.2f})"
            print(f"| {clients} | {config} | {agg:.1f} | {ratio} | {statistics.median(r['client'] for r in rs):.1f} | "
                  f"{statistics.median(r['client_min'] for r in rs):.1f} | "
                  f"{statistics.median(r['ttft_p50'] for r in rs):.2f} | {statistics.median(r['ttft_p95'] for r in rs):.2f} |")
    for clients in counts:
        bounds = [r["bound"] for r in results.get(("serial", clients), []) if "bound" in r]
        if bounds:
            print(f"C={clients}: the waves' questions sent alone, client by client, to the one-slot server: "
                  f"slots could run at most {', '.join(f'{b:.2f}' for b in bounds)}x it (every client's time "
                  f"over the longest client's)")
    for clients in counts:                       # slots against plain slots and llama-server's better mode
        slots = results.get(("slots", clients))
        if not slots:
            continue
        others = [c for c in ("slots-plain", "llama-server", "llama-server-ngram") if (c, clients) in results]
        best_llama = max((c for c in others if c.startswith("llama")), default=None,
                         key=lambda c: statistics.median(r["aggregate"] for r in results[(c, clients)]))
        for other in [c for c in others if c == "slots-plain" or c == best_llama]:
            ratios = [r["aggregate"] / b["aggregate"] for r, b in zip(slots, results[(other, clients)])]
            lo, hi = interval(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
            print(f"C={clients}: slots / {other}{' (llama-server better mode)' if other == best_llama else ''}: "
                  f"{statistics.median(ratios):.2f} ({lo:.2f}-{hi:.2f}), lowest repeat {min(ratios):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{c}@{n}": rs for (c, n), rs in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
