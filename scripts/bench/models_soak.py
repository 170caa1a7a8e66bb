"""Soak of one `flylocal serve` of three models under random model switches: concurrent clients,
random keep_alive values, a --models-memory that holds about two of the models, the server's
RSS sampled throughout.

1. Sizes: a server of the three models starts with no memory bound (--models-memory 0) only to
   print its start line, `serving 3 models: NAME N MiB ...`, each model's expected size (its
   draft's included); it is stopped at once. The budget (unless --budget MIB) is halfway between
   the two largest sums of those sizes: the two largest models together and all three, so that
   any two fit together and the three never do.
2. The soak: a server with that --models-memory (first model loaded at start). Its RSS (VmRSS
   of the server and every process under it, /proc/PID/status) is sampled every 0.2 s; once it
   is up, the RSS with only the first model loaded is read. Then --clients threads send, for
   --duration seconds, back to back, a short request each (/api/chat or /api/generate, stream
   false, num_predict 8) to a random model with a random keep_alive among (none, "0", "2s", -1).
   Every request must be answered 200; any other answer is printed with its body.
3. The end: every other model /api/ps lists as loaded unloaded (empty /api/generate,
   keep_alive 0), /api/ps polled
   until they are gone, the first model kept for good (empty /api/generate, keep_alive -1: loaded
   again where it is not), 3 s of waiting, and the RSS then set against the RSS with only the first
   model loaded at start: the memory given back.

Loads and unloads are counted from the server's log (stderr); a model whose `loading` line comes
while it is loading or loaded is reported as loaded twice at once. Loopback only; the server is
stopped on the way out, even on an error.

    .venv/bin/python scripts/bench/models_soak.py                 # 120 s, 3 clients
    .venv/bin/python scripts/bench/models_soak.py --duration 30 --budget 900 --seed 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from flylocal.front.bench.serve import stop_all

MODELS = ["smollm2-135m-instruct", "gemma-3-270m", "smollm2-135m-instruct-q4_0"]
KEEPS = [None, "0", "2s", -1]
HTTP = httpx.Client(trust_env=False, timeout=600)    # loopback only: no proxy from the environment
MiB = 1 << 20


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(options: list[str], log, wait_for: str = "health"):
    """`flylocal serve` with `options` on a free loopback port, in a process group of its own;
    yields (url, proc) once GET /health answers 200 (or once its log holds the `serving` line,
    with wait_for="serving"); the group gets SIGTERM (SIGKILL after 30 s) on the way out."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *options], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if wait_for == "serving":
                if any(x.startswith("serving ") for x in log_lines(log.name)):
                    break
            else:
                with contextlib.suppress(httpx.HTTPError):
                    if HTTP.get(url + "/health", timeout=2).status_code == 200:
                        break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up (exit {proc.poll()}): "
                                 f"{Path(log.name).read_text()[-500:]}")
            time.sleep(0.2)
        yield url, proc
    finally:
        stop_all([proc])            # SIGTERM to its group; SIGKILL after a minute


def log_lines(path) -> list[str]:
    """The server's log lines, without their "flylocal: " prefix."""
    return [x.removeprefix("flylocal: ") for x in Path(path).read_text(errors="replace").splitlines()]


def rss(pid: int) -> int:
    """Bytes resident in `pid` and every process under it."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, total = {pid}, 0
    while True:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        if not more:
            break
        tree |= more
    for p in tree:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def sizes_of(line: str) -> dict[str, int]:
    """{name: expected MiB} from the `serving N models: NAME N MiB (draft X), ...; ...` line."""
    listed = line.split(": ", 1)[1].split(";")[0]
    return {m: int(n.replace(",", "")) for m, n in re.findall(r"(\S+) ([\d,]+) MiB", listed)}


def ask(url: str, model: str, keep, rng: random.Random) -> tuple[int, str]:
    body: dict = {"model": model, "stream": False, "options": {"num_predict": 8, "temperature": 0}}
    if keep is not None:
        body["keep_alive"] = keep
    if rng.random() < 0.5:
        path, body["messages"] = "/api/chat", [{"role": "user", "content": rng.choice(["Hi!", "Name a fruit.", "2+2?"])}]
    else:
        path, body["prompt"] = "/api/generate", rng.choice(["The sky is", "Once upon a time", "1, 2, 3,"])
    r = HTTP.post(url + path, json=body)
    return r.status_code, r.text


def log_events(lines: list[str]) -> dict:
    """Loads, unloads and loads of a model already loading or loaded, from the server's log."""
    state: dict[str, str] = {}
    out = {"loads": 0, "unloads": 0, "twice": [], "failed": [], "held": 0, "most_loaded": 0}
    for line in lines:
        if m := re.match(r"loading (\S+) \(", line):
            if state.get(m[1]) in ("loading", "loaded"):
                out["twice"].append(line)
            state[m[1]] = "loading"
        elif m := re.match(r"loaded (\S+) in .*; ([\d,]+) MiB held by (\d+) model", line):
            out["loads"] += 1
            state[m[1]] = "loaded"
            out["held"] = max(out["held"], int(m[2].replace(",", "")))
            out["most_loaded"] = max(out["most_loaded"], int(m[3]))
        elif m := re.match(r"unloading (\S+)", line):
            out["unloads"] += 1
            state[m[1]] = "unloaded"
        elif re.search(r"cannot load|Traceback|Error", line):
            out["failed"].append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of requests")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="--models-memory MiB (default: from the sizes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    common = ["--ctx", str(args.ctx), "--parallel", "1", "--threads", str(args.threads), "--quiet",
              *[w for m in MODELS for w in ("--model", m)]]

    with tempfile.TemporaryDirectory(prefix="models_soak.") as tmp:
        with open(Path(tmp, "sizes.log"), "w+") as log, server([*common, "--models-memory", "0"], log, "serving"):
            line = next(x for x in log_lines(log.name) if x.startswith("serving "))
        sizes = sizes_of(line)
        a, b, c = sorted(sizes.values())
        budget = args.budget or (b + c + a + b + c) // 2
        how = "given" if args.budget else f"halfway between the two largest together ({b + c}) and all three ({a + b + c})"
        print(f"start line: {line}\nbudget: --models-memory {budget} MiB ({how})", file=sys.stderr, flush=True)

        log = open(Path(tmp, "soak.log"), "w+")
        with log, server([*common, "--models-memory", str(budget)], log) as (url, proc):
            samples: list[tuple[float, int]] = []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append((time.monotonic(), rss(proc.pid)))
                    stop.wait(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            time.sleep(2)
            first_only = rss(proc.pid)
            loaded_at_start = [m["name"] for m in HTTP.get(url + "/api/ps").json()["models"]]
            results: list[tuple[str, object, int, str, float]] = []    # model, keep_alive, status, body, seconds
            deadline = time.monotonic() + args.duration

            def client(i: int) -> None:
                rng = random.Random(args.seed * 100 + i)
                while time.monotonic() < deadline:
                    model, keep = rng.choice(MODELS), rng.choice(KEEPS)
                    t0 = time.monotonic()
                    try:
                        status, body = ask(url, model, keep, rng)
                    except httpx.HTTPError as e:
                        status, body = 0, f"{type(e).__name__}: {e}"
                    results.append((model, keep, status, body, time.monotonic() - t0))

            clients = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            started = time.monotonic()
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            soak_s = time.monotonic() - started
            soak_max = max(r for _, r in samples)
            quarters = [max((r for t, r in samples if started + q * soak_s / 4 <= t < started + (q + 1) * soak_s / 4),
                            default=0) for q in range(4)]

            mark = len(log_lines(log.name))

            def loaded() -> list[str]:
                return [m["name"] for m in HTTP.get(url + "/api/ps").json()["models"]]

            loaded_at_end = loaded()
            ends = [HTTP.post(url + "/api/generate", json={"model": m, "prompt": "", "keep_alive": 0})
                    for m in MODELS[1:] if m in loaded_at_end]
            deadline = time.monotonic() + 60
            while set(loaded()) - {MODELS[0]} and time.monotonic() < deadline:
                time.sleep(0.1)
            reloaded = MODELS[0] not in loaded()     # kept for good from now on, loaded again where it is not
            ends.append(HTTP.post(url + "/api/generate", json={"model": MODELS[0], "prompt": "", "keep_alive": -1}))
            time.sleep(3)
            after = rss(proc.pid)
            loaded_after = loaded()
            stop.set()
            sampler.join()
            events = log_events(log_lines(log.name))
            end_log = log_lines(log.name)[mark:]

    bad = [r for r in results if r[2] != 200] + [(e.request.url.path, None, e.status_code, e.text, 0.0)
                                                   for e in ends if e.status_code != 200]
    mib = lambda n: f"{n / MiB:,.0f} MiB"    # noqa: E731
    print(f"\n## models soak: {args.clients} clients, {soak_s:.0f} s, seed {args.seed}\n")
    print(f"- models (expected MiB, draft included): {', '.join(f'{m} {n}' for m, n in sizes.items())}")
    print(f"- budget: --models-memory {budget} MiB ({how})")
    print(f"- requests: {len(results)} sent, {sum(r[2] == 200 for r in results)} answered 200, "
          f"{len(results) - sum(r[2] == 200 for r in results)} failed")
    for model, keep, status, body, _ in bad:
        print(f"  - NOT 200: {model} keep_alive={keep!r}: {status} {body[:400]}")
    for keep in KEEPS:
        took = sorted(r[4] for r in results if r[1] == keep)
        if took:
            print(f"  - keep_alive {keep!r}: {len(took)} requests, median {took[len(took) // 2]:.2f} s, "
                  f"max {took[-1]:.2f} s")
    print(f"- RSS with only the first model loaded at start ({', '.join(loaded_at_start)}): {mib(first_only)}")
    print(f"- max RSS during the soak: {mib(soak_max)} ({len(samples)} samples every 0.2 s); "
          f"max RSS - budget: {(soak_max - budget * MiB) / MiB:+,.0f} MiB; max RSS in each quarter of the soak: "
          f"{', '.join(mib(q) for q in quarters)}")
    print(f"- log: {events['loads']} loads (the load at start not counted), {events['unloads']} unloads; most models loaded at once "
          f"{events['most_loaded']}, most held {events['held']} MiB (the server's own count); "
          f"loaded twice at once: {len(events['twice'])}; load failures/errors: {len(events['failed'])}")
    for line in events["twice"][:5] + events["failed"][:5]:
        print(f"  - {line[:300]}")
    print(f"- end: loaded when the clients stopped: {', '.join(loaded_at_end) or 'none'}; the others unloaded "
          f"(keep_alive 0), the first loaded again: {'yes' if reloaded else 'no'}; "
          f"3 s later loaded: {', '.join(loaded_after) or 'none'}; "
          f"RSS {mib(after)} vs {mib(first_only)} with only the first at start "
          f"({(after - first_only) / MiB:+,.0f} MiB; {(soak_max - after) / MiB:,.0f} MiB given back from the max)")
    print(f"- end requests: {'; '.join(f'{e.status_code} {e.text[:120]}' for e in ends)}")
    for line in end_log:
        print(f"  - log: {line[:200]}")


if __name__ == "__main__":
    main()
