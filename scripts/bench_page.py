#!/usr/bin/env python3
"""The chat page's cost to decoding: the same streamed request read by the page in headless
Chromium, and sent with curl, taking turns on one server.

Both send what the page sends (stream with usage, logprobs with one alternative, the settings
given here); each request is a new conversation, so the prompt is the question alone. The figure
is the server's decode tokens/s (usage.flylocal.tokens_per_s): what the model did while the
reader read, the browser's layout and painting included, since they share the machine's cores.
Medians over the questions, and their ratio.

    .venv/bin/python scripts/bench_page.py [--questions 8] [--max-tokens 128] [--drafter pld]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="pld")
    ap.add_argument("--verifier", default="fly")
    args = ap.parse_args()

    from flylocal.front.bench import load_prompts, per_group

    questions = [p.text for p in per_group(load_prompts(str(ROOT / "data" / "spec_bench")), 1)]
    questions = (questions * (args.questions // max(len(questions), 1) + 1))[: args.questions]
    if not (shutil.which("chromium") and shutil.which("chromedriver") and shutil.which("curl")):
        print("needs chromium, chromedriver and curl", file=sys.stderr)
        return 1

    with page_on_server() as (driver, url):
        _settings(driver, args)
        page, curl = [], []
        for i, q in enumerate(questions):
            for reader in (("page", "curl") if i % 2 == 0 else ("curl", "page")):
                speed = _by_page(driver, q) if reader == "page" else _by_curl(url, q, args)
                (page if reader == "page" else curl).append(speed)
                print(f"{i:2d} {reader}: {speed:.1f} tok/s", flush=True)
                time.sleep(0.5)
    p, c = statistics.median(page), statistics.median(curl)
    print(f"\ndecode tok/s, median of {len(questions)}: page {p:.1f}, curl {c:.1f}, page / curl {p / c:.3f}")
    print(f"mean: page {statistics.mean(page):.1f}, curl {statistics.mean(curl):.1f}, "
          f"page / curl {statistics.mean(page) / statistics.mean(curl):.3f}")
    return 0


@contextlib.contextmanager
def page_on_server():
    """A `flylocal serve` (default model and settings) on a free loopback port, and headless
    Chromium on its page with nothing stored: (driver, url). Both are stopped on the way out."""
    env = dict(os.environ)
    from test_page import chrome, quit_chrome      # the tests' browser and server helpers (their
    from test_server import free_port, wait_ready  # conftest sets test-only variables: undone below)

    os.environ.clear()
    os.environ.update(env)

    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")       # the server's stderr: wait_ready shows it if it exits
    server = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=log)
    server.log_file = log
    url = f"http://127.0.0.1:{port}"
    driver = None
    try:
        wait_ready(server, url)
        driver = chrome()
        driver.get(url + "/")
        driver.execute_script("localStorage.clear();")
        driver.get(url + "/")
        yield driver, url
    finally:
        if driver is not None:
            quit_chrome(driver)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


def _settings(driver, args) -> None:
    from selenium.webdriver.support.ui import Select

    driver.find_element("id", "toggle-settings").click()
    Select(driver.find_element("id", "verifier")).select_by_value(args.verifier)
    Select(driver.find_element("id", "drafter")).select_by_value(args.drafter)
    field = driver.find_element("id", "max-tokens")
    field.clear()
    field.send_keys(str(args.max_tokens))


def _by_page(driver, question: str) -> float:
    from selenium.webdriver.common.keys import Keys

    driver.find_element("id", "new-chat").click()
    before = len(json.loads(driver.execute_script("return localStorage.getItem('flylocal.conversations')") or "[]"))
    box = driver.find_element("id", "input")
    driver.execute_script("arguments[0].value = arguments[1];", box, question)
    box.send_keys(Keys.END, Keys.ENTER)
    # One call that the page answers when the answer has its usage: polling from here would
    # be a WebDriver round trip (chromedriver, DevTools, the renderer) every few milliseconds,
    # work the page itself does not do.
    driver.set_script_timeout(300)
    usage = driver.execute_async_script("""
        const before = arguments[0], done = arguments[arguments.length - 1];
        const check = () => {
          const all = JSON.parse(localStorage.getItem('flylocal.conversations') || '[]');
          const turn = all.length > before ? all[0].messages : [];
          if (turn.length === 2 && turn[1].answer.usage) done(turn[1].answer.usage);
          else setTimeout(check, 250);
        };
        check();""", before)
    return float(usage["flylocal"]["tokens_per_s"])


def _by_curl(url: str, question: str, args) -> float:
    body = {"messages": [{"role": "user", "content": question}], "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1,
            "max_tokens": args.max_tokens, "temperature": 0, "verifier": args.verifier, "drafter": args.drafter}
    out = subprocess.run(["curl", "-sN", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=300, check=True).stdout
    for line in reversed(out.splitlines()):
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return float(usage["flylocal"]["tokens_per_s"])
    raise SystemExit("curl's stream had no usage")


if __name__ == "__main__":
    os.environ.setdefault("SE_OFFLINE", "true")
    sys.exit(main())
