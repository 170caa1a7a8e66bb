#!/usr/bin/env python3
"""The chat page's own work, without a model competing for the cores: Chromium's CPU time per
answer while the page reads and draws a recorded stream.

It records real streams first (one `flylocal serve`, the page's request: streamed, usage,
logprobs with one alternative, fly + prompt lookup, greedy), with the time each event came.
Then, with the model idle, the page in headless Chromium answers messages whose stream is
replayed in the page at those times (its `fetch` answers from the recording), and the CPU time
of Chromium's processes is read from /proc around each answer. `--idle` measures the page open
and doing nothing for as long, the floor every reader pays; `--one-conversation` keeps every
answer in one conversation, which soon outgrows the window, so the page scrolls to follow. Less
CPU here is less taken from llama.cpp's threads when the browser and the server share a machine
(scripts/experiments/page.py measures that directly, with more noise).

    .venv/bin/python scripts/experiments/page_cpu.py [--answers 6] [--max-tokens 256] [--idle] [--one-conversation]

Answered (docs/benchmarks.md, "What does the chat page cost?", 2026-12-02): Chromium spent
5.5% of a core per answer with a new conversation each time, 6.6-7.1% in one scrolling
conversation, 1.8% idle.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import questions

REPLAY = """
const streams = arguments[0];
let n = 0;
const real = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).includes('/v1/chat/completions')) return real(url, options);
  const events = streams[n++ % streams.length], encoder = new TextEncoder(), start = performance.now();
  let i = 0;
  const body = new ReadableStream({ start(out) {
    const next = () => {
      let text = '';
      while (i < events.length && events[i][0] <= performance.now() - start) text += events[i++][1];
      if (text) out.enqueue(encoder.encode(text));
      if (i < events.length) setTimeout(next, Math.max(0, events[i][0] - (performance.now() - start)));
      else out.close();
    };
    next();
  }});
  return Promise.resolve(new Response(body, { status: 200, headers: { 'Content-Type': 'text/event-stream' } }));
};
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--idle", action="store_true", help="the page open, doing nothing, as long as an answer")
    ap.add_argument("--one-conversation", action="store_true",
                    help="every answer in the same conversation, so that the list scrolls to follow them")
    args = ap.parse_args()

    from page import ask_page, page_on_server

    firsts = questions(1)
    asked = [firsts[0], firsts[2]]                  # two that run to max_tokens
    with page_on_server() as (driver, url):
        streams = [_record(url, q, args.max_tokens) for q in asked]
        print("recorded:", ", ".join(f"{len(s)} events in {s[-1][0] / 1000:.1f} s" for s in streams))
        driver.execute_script(REPLAY, streams)
        driver.set_script_timeout(300)
        cpu, walls = collections.Counter(), []
        for i in range(args.answers):
            if not args.one_conversation or i == 0:
                driver.find_element("id", "new-chat").click()
            before, start = _ticks(), time.perf_counter()
            if args.idle:
                time.sleep(streams[i % len(streams)][-1][0] / 1000)
            else:
                ask_page(driver, f"message {i}")
            after = _ticks()
            walls.append(time.perf_counter() - start)
            for kind in after:
                cpu[kind] += after[kind] - before.get(kind, 0)
            time.sleep(0.3)
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(cpu.values()) / hz / args.answers
    parts = ", ".join(f"{kind} {ticks / hz / args.answers:.3f}" for kind, ticks in cpu.most_common())
    wall = statistics.mean(walls)
    print(f"Chromium CPU per answer: {total:.3f} s ({parts}); mean wall {wall:.2f} s, {total / wall:.1%} of a core")
    return 0


def _record(url: str, question: str, max_tokens: int) -> list:
    body = {"messages": [{"role": "user", "content": question}], "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0, "verifier": "fly", "drafter": "pld"}
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    res = conn.getresponse()
    start, events = time.perf_counter(), []
    while line := res.fp.readline():
        if line.startswith(b"data: "):
            events.append([round((time.perf_counter() - start) * 1000, 1), line.decode() + "\n"])
    conn.close()
    return events


def _ticks() -> collections.Counter:
    """CPU ticks (user + system) of each kind of Chromium process now running."""
    out = collections.Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if not stat[stat.index("(") + 1:].startswith("chrom"):
                continue
            words = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").split()
            kind = next((w[7:] for w in words if w.startswith("--type=")), "browser")
            fields = stat[stat.rindex(")") + 2:].split()
            out[kind] += int(fields[11]) + int(fields[12])
        except (OSError, ValueError):
            continue                            # a process that ended meanwhile
    return out


if __name__ == "__main__":
    os.environ.setdefault("SE_OFFLINE", "true")
    sys.exit(main())
