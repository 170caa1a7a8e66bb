"""Conversations taking turns on one server: what the prompt cache saves (docs/benchmarks.md,
"Conversations taking turns: the prompt cache").

Three conversations, each with a system prompt of about --system-tokens tokens of its own (Spec-Bench
text), take turns A B C A B C ... for --rounds rounds, each turn a held-out Spec-Bench question,
streamed, greedy, --max-tokens tokens. For every configuration:

- per turn after a conversation's first: the share of its prompt cached (`cached_tokens`), its
  time to first token and its time to the end;
- the same conversations run one after another on a fresh server (A A A ..., B B B ...): each
  turn after the first continues a warm slot, the bound a cache can reach. The ratio of each
  interleaved turn to the same turn continued warm is reported per turn, median and 95% interval.

Configurations: flylocal serve as given (`cache`), with --cache-ram 0 (`no-cache`), and with
--llama-server PATH, llama.cpp's llama-server with its default cache (`llama-server`), whose
answers are compared with flylocal's strict ones turn by turn.

    .venv/bin/python scripts/bench/conversations.py [--target NAME] [--rounds 4] [--system-tokens 1400]
        [--configs cache,no-cache] [--llama-server PATH] [-- extra flylocal serve options]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from harness import interval, median, servers, spec_bench_questions

SYSTEM_HEAD = "You are a helpful assistant. The notes below are background; answer the user's question briefly.\n\n"


def system_prompts(tokenize, n_tokens: int, count: int) -> list[str]:
    """`count` different system prompts of about `n_tokens` tokens each, from Spec-Bench text."""
    texts = [t for _, t in spec_bench_questions(60, skip=20)]
    out, i = [], 0
    for _ in range(count):
        text = SYSTEM_HEAD
        while len(tokenize(text)) < n_tokens:
            text += texts[i % len(texts)].strip() + "\n\n"
            i += 1
        out.append(text)
    return out


def turn(url: str, messages: list[dict], max_tokens: int, model: str, extra: dict) -> dict:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    first, text, usage = None, "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            piece = data["choices"][0].get("delta", {}).get("content") if data.get("choices") else None
            if piece:
                first = first or time.perf_counter()
                text += piece
    end = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"text": text, "prompt": (usage or {}).get("prompt_tokens", 0), "cached": details.get("cached_tokens", 0),
            "ttft": (first or end) - start, "total": end - start}


def run(url: str, order: list[int], systems: list[str], questions: list[str], args, extra: dict) -> dict:
    """The turns in `order` (conversation ids): {(conversation, turn index): figures}."""
    history = {c: [{"role": "system", "content": systems[c]}] for c in set(order)}
    count = {c: 0 for c in set(order)}
    out = {}
    for c in order:
        i = count[c]
        history[c].append({"role": "user", "content": questions[(c * args.rounds + i) % len(questions)]})
        r = turn(url, history[c], args.max_tokens, args.model, extra)
        history[c].append({"role": "assistant", "content": r["text"]})
        out[(c, i)] = r
        count[c] += 1
        print(f"  {'ABC'[c]}{i + 1}: prompt {r['prompt']}, cached {r['cached']}, TTFT {r['ttft']:.2f} s, "
              f"total {r['total']:.2f} s", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1400)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--configs", default="cache,no-cache")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-server-args", default="", help="more options for llama-server (e.g. '-fa off' "
                                                             "beside an exact build of it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("serve", nargs="*", help="extra flylocal serve options (after --)")
    args = ap.parse_args()
    from flylocal import models
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    path = str(models.resolve(args.target))
    args.model = args.target
    rt = Runtime(path, RuntimeConfig(n_ctx=256, n_threads=1))
    try:
        systems = system_prompts(lambda t: rt.tokenize(t), args.system_tokens, 3)
    finally:
        rt.close()
    questions = [t for _, t in spec_bench_questions(10, skip=20) if len(t) < 400]     # a chat's turns, not documents
    fly = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--target", args.target, "--ctx",
           str(args.ctx), "--verifier", "strict", *args.serve]
    commands = {"cache": fly, "no-cache": fly + ["--cache-ram", "0"]}
    if args.llama_server:
        commands["llama-server"] = [args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1",
                                    "-c", str(args.ctx), "--no-webui", *args.llama_server_args.split()]
    interleaved = [c for _ in range(args.rounds) for c in range(3)]
    grouped = [c for c in range(3) for _ in range(args.rounds)]
    results = {}
    for name in [c.strip() for c in args.configs.split(",")] + (["llama-server"] if args.llama_server else []):
        extra = {"cache_prompt": True} if name == "llama-server" else {}
        with servers({"warm": commands[name]}) as urls:
            print(f"{name}, warm (one conversation after another):", file=sys.stderr)
            warm = run(urls["warm"], grouped, systems, questions, args, extra)
        with servers({"turns": commands[name]}) as urls:
            print(f"{name}, taking turns:", file=sys.stderr)
            turns = run(urls["turns"], interleaved, systems, questions, args, extra)
        later = [k for k in turns if k[1] > 0]
        ratios = {what: [turns[k][what] / warm[k][what] for k in later] for what in ("ttft", "total")}
        shares = [turns[k]["cached"] / turns[k]["prompt"] for k in later if turns[k]["prompt"]]
        results[name] = {"turns": {f"{'ABC'[c]}{i + 1}": v for (c, i), v in turns.items()},
                         "warm": {f"{'ABC'[c]}{i + 1}": v for (c, i), v in warm.items()},
                         "ttft_ratio": ratios["ttft"], "total_ratio": ratios["total"], "cached_share": shares}
        for what in ("ttft", "total"):
            lo, hi = interval(ratios[what])
            print(f"{name}: {what} taking turns / warm slot: median {median(ratios[what]):.2f} "
                  f"(95% interval {lo:.2f}-{hi:.2f}), worst {max(ratios[what]):.2f}; "
                  f"median {what} {statistics.median(turns[k][what] for k in later):.2f} s", flush=True)
        print(f"{name}: cached share of later turns: min {min(shares):.3f}, median {median(shares):.3f}", flush=True)
    if "llama-server" in results and "cache" in results:
        a, b = results["cache"]["turns"], results["llama-server"]["turns"]
        same = sum(a[k]["text"] == b[k]["text"] for k in a)
        print(f"strict answers equal to llama-server's: {same} of {len(a)}", flush=True)
        ttft = [a[k]["ttft"] / b[k]["ttft"] for k in a if k[1:] != "1"]
        lo, hi = interval(ttft)
        print(f"TTFT flylocal / llama-server, later turns: median {median(ttft):.2f} (95% interval {lo:.2f}-{hi:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
