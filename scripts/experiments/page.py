#!/usr/bin/env python3
"""The chat page's cost to decoding: the same streamed request read by the page in headless
Chromium, and sent with curl, taking turns on one server.

Both send what the page sends (stream with usage, logprobs with one alternative, the settings
given here); each request is a new conversation, so the prompt is the question alone. The figure
is the server's decode tokens/s (usage.flylocal.tokens_per_s): what the model did while the
reader read, the browser's layout and painting included, since they share the machine's cores.

A question's two turns should do the same work, or the ratio measures their answers rather
than their readers. So before every turn a one-token request on another prompt leaves the
server's cache holding no part of the question: both turns prefill the same tokens from the same
state, and greedy decoding gives the same answer unless the draft-length control, which learns
from every request, chose differently at a near-tie. The script counts the questions whose two
answers matched. `--k N` fixes the draft length (the page's k field): the turns then match
exactly, at a speed that is not the page's default.
Printed: medians over the questions and their ratio, and the median of each question's own
ratio (its turns ran back to back, so a machine drifting between questions moves it less).

    .venv/bin/python scripts/experiments/page.py [--questions 8] [--max-tokens 128] [--drafter pld] [--k N]

Answered (docs/benchmarks.md, "What does the chat page cost?", 2026-12-02): read through the
page, the server decoded at 0.984x of its speed for curl (per question 0.960x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
import time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
from harness import ROOT, flylocal_serve, questions, servers

sys.path.insert(0, str(ROOT / "tests"))          # the tests' headless Chromium


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="pld")
    ap.add_argument("--verifier", default="fly")
    ap.add_argument("--k", type=int, default=None, help="a fixed draft length (default: adaptive, as the page sends)")
    args = ap.parse_args()

    asked = questions(1)
    asked = (asked * (args.questions // max(len(asked), 1) + 1))[: args.questions]
    if not (shutil.which("chromium") and shutil.which("chromedriver") and shutil.which("curl")):
        print("needs chromium, chromedriver and curl", file=sys.stderr)
        return 1

    with page_on_server() as (driver, url):
        _settings(driver, args)
        page, curl, same = [], [], 0
        for i, q in enumerate(asked):
            answers = {}
            for reader in (("page", "curl") if i % 2 == 0 else ("curl", "page")):
                _clear_cache(url)
                speed, answers[reader] = _by_page(driver, q) if reader == "page" else _by_curl(url, q, args)
                (page if reader == "page" else curl).append(speed)
                print(f"{i:2d} {reader}: {speed:.1f} tok/s", flush=True)
                time.sleep(0.5)
            same += answers["page"] == answers["curl"]
    p, c = statistics.median(page), statistics.median(curl)
    print(f"\n{same} of {len(asked)} questions got the same answer from both turns")
    print(f"decode tok/s, median of {len(asked)}: page {p:.1f}, curl {c:.1f}, page / curl {p / c:.3f}")
    print(f"mean: page {statistics.mean(page):.1f}, curl {statistics.mean(curl):.1f}, "
          f"page / curl {statistics.mean(page) / statistics.mean(curl):.3f}")
    pairs = sorted(a / b for a, b in zip(page, curl))
    q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
    print(f"page / curl per question: median {statistics.median(pairs):.3f}, quartiles {q1:.3f}-{q3:.3f}, "
          f"{sum(r >= 0.95 for r in pairs)} of {len(pairs)} at 0.95 or more")
    return 0


@contextlib.contextmanager
def page_on_server():
    """A `flylocal serve` (default model and settings) on a free loopback port, and headless
    Chromium on its page with nothing stored: (driver, url). Both are stopped on the way out."""
    env = dict(os.environ)
    from test_page import chrome, quit_chrome      # the tests' browser (their conftest sets test-only
                                                   # variables: undone below)

    os.environ.clear()
    os.environ.update(env)

    driver = None
    try:
        with servers({"page": flylocal_serve()}) as urls:
            url = urls["page"]
            driver = chrome()
            driver.get(url + "/")
            driver.execute_script("localStorage.clear();")
            driver.get(url + "/")
            yield driver, url
    finally:
        if driver is not None:
            quit_chrome(driver)


def _settings(driver, args) -> None:
    from selenium.webdriver.support.ui import Select

    driver.find_element("id", "toggle-settings").click()
    Select(driver.find_element("id", "verifier")).select_by_value(args.verifier)
    Select(driver.find_element("id", "drafter")).select_by_value(args.drafter)
    for name, value in (("max-tokens", args.max_tokens), ("k", args.k)):
        field = driver.find_element("id", name)
        field.clear()
        if value is not None:
            field.send_keys(str(value))


def _clear_cache(url: str) -> None:
    """One token on another prompt: the server's cache keeps only what that prompt shares with
    every question (the chat template's opening)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    subprocess.run(["curl", "-s", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                    "-d", json.dumps(body)], capture_output=True, timeout=300, check=True)


def _by_page(driver, question: str) -> tuple[float, str]:
    driver.find_element("id", "new-chat").click()
    answer = ask_page(driver, question)
    return float(answer["usage"]["flylocal"]["tokens_per_s"]), answer["text"]


def ask_page(driver, message: str) -> dict:
    """One message sent, as the Send button sends it; the answer as the page keeps it, once it
    has ended. One WebDriver call, no keystrokes, and nothing polled while the answer streams:
    a MutationObserver answers the call when the answer's `streaming` mark goes (polling, from
    here or in the page, is work the page itself does not do)."""
    driver.set_script_timeout(300)
    answer = driver.execute_async_script("""
        const message = arguments[0], done = arguments[arguments.length - 1];
        const box = document.getElementById('messages');
        const ended = () => box.querySelector('.answer') && !box.querySelector('.answer.streaming');
        let tries = 0;
        const kept = () => {                 // the page stores the turn just after the answer ends
          const all = JSON.parse(localStorage.getItem('flylocal.conversations') || '[]');
          const last = all.length ? all[0].messages : [];
          const turn = last.length >= 2 && last[last.length - 2].content === message ? last[last.length - 1].answer : null;
          if (turn || ++tries > 40) done(turn); else setTimeout(kept, 50);
        };
        const watch = new MutationObserver(() => { if (ended()) { watch.disconnect(); kept(); } });
        watch.observe(box, { subtree: true, childList: true, attributes: true, attributeFilter: ['class'] });
        document.getElementById('input').value = message;
        document.getElementById('send').click();""", message)
    if not answer or not answer.get("usage"):
        raise SystemExit(f"the page kept no answer with usage: {(answer or {}).get('error') or (driver.find_element('id', 'status').text)}")
    return answer


def _by_curl(url: str, question: str, args) -> tuple[float, str]:
    body = {"messages": [{"role": "user", "content": question}], "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1,
            "max_tokens": args.max_tokens, "temperature": 0, "verifier": args.verifier, "drafter": args.drafter}
    if args.k is not None:
        body["k"] = args.k
    out = subprocess.run(["curl", "-sN", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=300, check=True).stdout
    text, usage = "", None
    for line in out.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage") or usage
    if not usage:
        raise SystemExit("curl's stream had no usage")
    return float(usage["flylocal"]["tokens_per_s"]), text


if __name__ == "__main__":
    os.environ.setdefault("SE_OFFLINE", "true")
    sys.exit(main())
