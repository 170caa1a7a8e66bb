"""`flylocal bench serve`: servers side by side, as their clients see them (docs/bench.md,
"Servers side by side").

Any OpenAI-compatible server takes part: one already running (a URL: ollama, LM Studio, a
llama-server of the user's), or one this command starts on a free loopback port and stops on
the way out (flylocal's configurations, llama-server's modes, any command with `{port}`).

The unit is a *wave*: C clients at once, each sending Q conversations back to back (client i
starting i x stagger seconds late), every conversation of T turns a request each. The servers
answer the same waves, taking turns (a different one first each wave), so a machine whose
speed drifts moves every server alike. A wave's rate is all its completion tokens over its
wall time; with one client and one conversation a wave is one question and its rate the
question's end-to-end tokens/s. Each server's rate is set against the base server's, wave by
wave, and reported as the median of those ratios with a 95% bootstrap interval (waves
resampled) and the worst question (the median of its waves, where --repeat asked it again).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace

from flylocal.errors import FlylocalError
from flylocal.front.bench.questions import conversations, token_counter
from flylocal.front.bench.serve_report import report
from flylocal.statistics import median

# flylocal's configurations by name: its methods (`flylocal bench`'s names) through `flylocal serve`.
FLYLOCAL = {"autoregressive": "--drafter none --verifier strict",
            **{f"{v}-{d}": f"--drafter {d} --verifier {v}" + (" --draft {draft}" if d in ("model", "mla") else "")
               for v in ("strict", "fly", "asd") for d in ("pld", "model", "mla") if (v, d) != ("asd", "pld")}}
# llama.cpp's own server: plain, its speculation without a draft model, and with one.
LLAMA_SERVER = {"llama-server": "", "llama-server-ngram": "--spec-type ngram-mod",
                "llama-server-draft": "-md {draft} --spec-type draft-simple"}
WARM_S = 120.0          # seconds of warm-up requests a server measuring its cost curves is given
WARM_TOKENS = 8         # tokens a warm-up answer
RAW_FORM = "Question: {}\nAnswer:"     # a base model's form of a question (the bench's BASE_FORM)


@dataclass
class Server:
    """One server of the comparison: `url` when it runs already, else `command` starts it (its
    `{port}` filled), in `cwd` with `env` added."""
    name: str
    url: str | None = None
    command: list[str] | None = None
    cwd: str | None = None
    env: dict = field(default_factory=dict)
    model: str | None = None        # the request's "model" field
    flylocal: bool = False          # one of flylocal's configurations
    own_model: bool = True          # answers with --target: its end-of-generation ids can be banned


@dataclass
class Plan:
    """What to measure, from the command line."""
    servers: list[Server]
    conversations: list[tuple[str, list[str]]]     # (label, user turns)
    clients: list[int] = field(default_factory=lambda: [1])
    per_client: int = 1             # conversations each client sends in a wave
    max_tokens: int = 128
    ctx: int = 4096                 # cells per client (llama-server gets ctx x clients for its slots)
    raw: bool = False
    banned: tuple[int, ...] = ()    # end-of-generation ids, at logit_bias -100, for servers of --target
    base: str = ""
    pause: float = 0.5
    stagger: float = 0.3
    taking_turns: bool = True
    timeout: float = 600.0
    startup: float = 300.0
    api_key: str | None = None


@dataclass
class Reply:
    """One request: its completion tokens and the perf_counter times of its start, first and
    last text and end; `error` when it failed."""
    tokens: int = 0
    start: float = 0.0
    first: float | None = None
    last: float | None = None
    end: float = 0.0
    text: str = ""
    error: str | None = None
    counted: bool = True            # tokens from the server's usage (else chunks of text)
    calibrating: bool = False       # a flylocal server still measuring its cost curves, a slice a request


# -- servers ------------------------------------------------------------------------------------

def parse_server(spec: str, *, target: str, target_path: str, draft_path: str | None, ctx: int,
                 threads: int | None, llama_server: str | None, model: str | None) -> Server:
    """A server from `--server`: a configuration's name (FLYLOCAL, LLAMA_SERVER), or
    NAME=URL[#MODEL], NAME=flylocal[@CHECKOUT] [SERVE OPTIONS], NAME=llama-server [OPTIONS], or
    NAME=COMMAND with {port} in it. {target}, {draft}, {ctx}, {clients} and {threads} are filled
    in commands."""
    name, sep, value = spec.partition("=")
    name, value = name.strip(), value.strip()
    if not sep:
        if name in FLYLOCAL:
            value = f"flylocal {FLYLOCAL[name]}"
        elif name in LLAMA_SERVER:
            value = f"llama-server {LLAMA_SERVER[name]}"
        else:
            raise FlylocalError(f"--server: unknown configuration {name!r}; known: "
                                f"{', '.join([*FLYLOCAL, *LLAMA_SERVER])}, or NAME=URL, NAME=flylocal OPTIONS, "
                                "NAME=llama-server OPTIONS, NAME=COMMAND with {port}")
    if not name or not value:
        raise FlylocalError(f"--server {spec!r}: give NAME=URL, NAME=flylocal OPTIONS, NAME=llama-server OPTIONS "
                            "or NAME=COMMAND with {port}")
    if value.startswith(("http://", "https://")):
        url, _, wanted = value.partition("#")
        url = url.rstrip("/").removesuffix("/v1")
        return Server(name, url=url, model=wanted or model, own_model=False)
    try:
        words = shlex.split(value)
    except ValueError as e:                     # an unclosed quotation
        raise FlylocalError(f"--server {name}: {e}") from None
    if any("{draft}" in w for w in words) and not draft_path:
        raise FlylocalError(f"--server {name}: needs a draft model (--draft)")
    fill = {"{target}": target_path, "{draft}": draft_path or "", "{ctx}": str(ctx), "{threads}": str(threads or "")}

    def filled(parts):
        return [_fill(part, fill) for part in parts]

    head = words[0]
    if head == "flylocal" or head.startswith("flylocal@"):
        checkout = head.partition("@")[2] or None
        rest = filled(words[1:])
        command = [sys.executable, "-m", "flylocal", "serve", "--port", "{port}", "--quiet", "--target", target,
                   "--ctx", str(ctx), *(["--threads", str(threads)] if threads else []),
                   *([] if "--parallel" in rest else ["--parallel", "{clients}"]), "--max-queue", "256", *rest]
        env = {"PYTHONPATH": os.path.abspath(checkout)} if checkout else {}
        if checkout and not os.path.isdir(checkout):
            raise FlylocalError(f"--server {name}: no checkout at {checkout}")
        return Server(name, command=command, cwd=checkout, env=env, model=model or target, flylocal=True)
    if head == "llama-server":
        if not llama_server:
            raise FlylocalError(f"--server {name}: llama-server not found on the PATH; give --llama-server PATH")
        own = [f for flag in ("-t", "-tb", "-td", "-tbd") for f in (flag, str(threads))] if threads else []
        command = [llama_server, "-m", target_path, "--port", "{port}", "--host", "127.0.0.1", "-np", "{clients}",
                   "-c", "{ctx_all}", "--no-webui", *own, *filled(words[1:])]
        return Server(name, command=command, model=model or target)
    if not any("{port}" in w for w in words):
        raise FlylocalError(f"--server {name}: a command needs {{port}} where its port goes")
    return Server(name, command=["sh", "-c", " ".join(filled([value]))], model=model or target,
                  own_model="{target}" in value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at `url` is ready: /health answers 200, or, where there is no /health
    (404: llama-cpp-python's server, ollama), /v1/models does."""
    for path in ("/health", "/v1/models"):
        try:
            conn = _connect(url, timeout)
            conn.request("GET", path)
            status = conn.getresponse().status
        except (OSError, http.client.HTTPException):
            return False
        if status != 404:
            return status == 200
    return False


@contextlib.contextmanager
def fleet(servers: list[Server], clients: int, ctx: int, startup: float, say):
    """Start every server that has a command, for `clients` clients, one after another, each
    answering before the next starts;
    yield {name: url} of those that came up (a server that fails is left out, said in one line);
    every started one is stopped on the way out."""
    procs, logs, urls = {}, {}, {}
    try:
        for s in servers:
            if s.url:
                urls[s.name] = s.url
                continue
            port = free_port()
            fill = {"{port}": str(port), "{clients}": str(clients), "{ctx_all}": str(ctx * clients)}
            command = [_fill(part, fill) for part in s.command]
            logs[s.name] = tempfile.TemporaryFile()    # a pipe nobody reads would stall the server
            procs[s.name] = proc = subprocess.Popen(command, stdout=logs[s.name], stderr=logs[s.name],
                                                    stdin=subprocess.DEVNULL, cwd=s.cwd,
                                                    env={**os.environ, **s.env}, start_new_session=True)
            urls[s.name] = f"http://127.0.0.1:{port}"
            # One at a time: a server that measures its cost curves as it starts does so on a
            # quiet machine, not beside the others loading (a curve measured under load is
            # measured again before its requests, which then wait for it).
            deadline = time.monotonic() + startup
            while not answers(urls[s.name]):
                if proc.poll() is not None or time.monotonic() > deadline:
                    logs[s.name].seek(0)
                    tail = logs[s.name].read().decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                    why = f"exited ({proc.returncode})" if proc.poll() is not None else f"not ready in {startup:g} s"
                    say(f"{s.name}: {why}, left out: {tail[0][:200]}")
                    del urls[s.name]
                    break
                time.sleep(0.25)
        yield urls
    finally:
        stop_all(list(procs.values()))
        for log in logs.values():
            log.close()


def _fill(part: str, fill: dict) -> str:
    for key, val in fill.items():
        part = part.replace(key, val)
    return part


def stop_all(procs) -> None:
    """SIGTERM each process's group, then wait (a minute at most, then SIGKILL)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# -- requests -----------------------------------------------------------------------------------

def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return kind(u.hostname, u.port, timeout=timeout)


def body_of(plan: Plan, server: Server, history: list[str], turn: str) -> tuple[str, dict]:
    """The path and body of one turn's request: earlier turns and answers alternate in
    `history`. A raw request puts them all in one prompt."""
    body: dict = {"max_tokens": plan.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if server.model:
        body["model"] = server.model
    if plan.banned and server.own_model:
        body["logit_bias"] = {str(t): -100 for t in plan.banned}
    if plan.raw:
        said = "".join(RAW_FORM.format(q) + a + "\n" for q, a in zip(history[::2], history[1::2]))
        return "/v1/completions", {**body, "prompt": said + RAW_FORM.format(turn)}
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(history)]
    return "/v1/chat/completions", {**body, "messages": [*messages, {"role": "user", "content": turn}]}


def request(url: str, path: str, body: dict, timeout: float, api_key: str | None = None) -> Reply:
    """Stream one request; its text's times and completion tokens. Never raises: a failure is
    the reply's `error`."""
    r = Reply(start=time.perf_counter())
    usage = None
    chunks = 0
    try:
        conn = _connect(url, timeout)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace').strip()}"
            return r
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            data = json.loads(line[5:])
            usage = data.get("usage") or usage
            choice = (data.get("choices") or [{}])[0]
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                r.last = time.perf_counter()
                r.first = r.first or r.last
                r.text += text
                chunks += 1
        conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    finally:
        r.end = time.perf_counter()
    r.counted = bool(usage and "completion_tokens" in usage)
    r.calibrating = bool(usage and (usage.get("flylocal") or {}).get("calibrating"))
    r.tokens = usage["completion_tokens"] if r.counted else chunks
    return r


def converse(plan: Plan, server: Server, url: str, turns: list[str]) -> list[Reply]:
    """One conversation, a request a turn, each turn after the answers before it. Stops at the
    first failed turn."""
    history: list[str] = []
    replies = []
    for turn in turns:
        path, body = body_of(plan, server, history, turn)
        reply = request(url, path, body, plan.timeout, plan.api_key)
        replies.append(reply)
        if reply.error:
            break
        history += [turn, reply.text]
    return replies


def warm_up(plan: Plan, server: Server, url: str, say) -> int:
    """Short requests, uncounted, before the waves: one, or, while a flylocal server says it is
    still measuring its cost curves (a slice before each request's first token, until they
    settle and are cached: docs/design.md, "Cost model"), more, for at most WARM_S seconds, so
    that no timed request waits for a slice. Returns how many were sent."""
    short = replace(plan, max_tokens=WARM_TOKENS)
    deadline = time.monotonic() + WARM_S
    sent = 0
    while True:
        replies = converse(short, server, url, ["Hello!"])
        sent += 1
        if not any(r.calibrating for r in replies):
            return sent
        if time.monotonic() > deadline:
            say(f"{server.name}: still measuring its cost curves after {sent} warm-up request{'s' * (sent != 1)} "
                f"({WARM_S:g} s): its first timed requests wait up to 0.1 s each for a slice")
            return sent


def wave(plan: Plan, server: Server, url: str, clients: int, convs: list[list[str]]) -> list[Reply]:
    """`clients` clients at once, client i taking every clients-th conversation of `convs`
    and starting i x stagger seconds late; every request's reply."""
    done: list[list[Reply]] = [[] for _ in range(clients)]

    def client(i: int) -> None:
        time.sleep(i * plan.stagger)
        for turns in convs[i::clients]:
            done[i] += converse(plan, server, url, turns)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in done for r in rs]


def rates(replies: list[Reply]) -> dict:
    """A wave's figures: tokens/s over its wall time (first start to last text), the median
    request's decode tokens/s (tokens after the first over the time after the first), times to
    first token, and its failures."""
    ok = [r for r in replies if not r.error and r.last is not None]
    tokens = sum(r.tokens for r in ok)
    wall = max((r.last for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    decode = [(r.tokens - 1) / (r.last - r.first) for r in ok if r.tokens > 1 and r.last > r.first]
    whole = ok and len(ok) == len(replies) and wall > 0        # a wave with a failure has no rate
    return {"tokens": tokens, "wall": wall, "rate": tokens / wall if whole else float("nan"),
            "decode": median(decode), "ttft": [r.first - r.start for r in ok],
            "first": median(r.first - r.start for r in ok) if ok else float("nan"),
            "errors": [r.error or "no text" for r in replies if r.error or r.last is None],
            "requests": len(replies), "counted": all(r.counted for r in ok)}


# -- the run ------------------------------------------------------------------------------------

def run(plan: Plan, say) -> dict:
    """Every client count's waves on every server: {clients: {"labels": [...], name: [wave
    figures]}}. A Ctrl-C ends it early; what was measured by then is returned under
    "interrupted"."""
    results: dict = {}
    by_name = {s.name: s for s in plan.servers}

    def stopped(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stopped)      # stopped as by a Ctrl-C: its servers with it
    try:
        for clients in plan.clients:
            size = clients * plan.per_client
            waves = [plan.conversations[i:i + size] for i in range(0, len(plan.conversations), size)]
            waves = [w for w in waves if len(w) == size] or waves[:1]
            got = results[clients] = {"labels": [w[0][0] for w in waves]}
            with fleet(plan.servers, clients, plan.ctx, plan.startup, say) as urls:
                if plan.base not in urls:
                    raise FlylocalError(f"the base server {plan.base!r} did not come up")
                for name, url in urls.items():
                    warm_up(plan, by_name[name], url, say)
                names = list(urls)
                for i, w in enumerate(waves):
                    order = names[i % len(names):] + names[:i % len(names)] if plan.taking_turns else names
                    for name in order:
                        got.setdefault(name, []).append(rates(wave(plan, by_name[name], urls[name], clients,
                                                                   [turns for _, turns in w])))
                        time.sleep(plan.pause)
                    say(f"{clients} client{'s' * (clients > 1)}, wave {i + 1}/{len(waves)} ({w[0][0]}): "
                        + ", ".join(f"{n} {got[n][-1]['rate']:.1f}" for n in names) + " tok/s")
    except KeyboardInterrupt:
        results["interrupted"] = True
    return results


# -- from the command line ----------------------------------------------------------------------

def default_servers(draft: bool, llama_server: str | None) -> list[str]:
    mine = ["autoregressive", "strict-pld", "fly-pld", *(["strict-mla", "fly-mla"] if draft else [])]
    return mine + (["llama-server", "llama-server-ngram", *(["llama-server-draft"] if draft else [])]
                   if llama_server else [])


def default_base(servers: list[Server]) -> str:
    """llama-server plain; else the first server not flylocal's; else flylocal's plain one; else the first."""
    names = [s.name for s in servers]
    if "llama-server" in names:
        return "llama-server"
    fallback = "autoregressive" if "autoregressive" in names else names[0]
    return next((s.name for s in servers if not s.flylocal), fallback)


def past_training(longest: int, max_tokens: int, trained: int | None, target: str) -> str | None:
    """A line when the longest request runs past the context `target` was trained on:
    llama-server refuses such a request (its context is at most that), and answers may fall
    apart past it."""
    if not trained or longest + max_tokens <= trained:
        return None
    return (f"--context: the longest request reaches {longest + max_tokens:,} tokens with --max-tokens {max_tokens}, "
            f"past the {trained:,} {target} was trained on: llama-server refuses such requests, and answers may "
            f"fall apart (--context {trained - max_tokens - 64} or less keeps within it)")


def end_tokens(path: str) -> tuple[int, ...]:
    """The end-of-generation ids of the model at `path` (banned: every answer full length)."""
    import numpy as np

    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(path, RuntimeConfig(n_ctx=256, n_threads=1))
    try:
        return tuple(int(t) for t in np.flatnonzero(rt.eog_mask))
    finally:
        rt.close()


def main(*, server_specs, base, target, draft, llama_server, model, prompts, category, per_category, skip, turns,
         prompt_words, context, clients, per_client, max_tokens, repeat, raw, natural, ctx, threads, pause,
         stagger, fixed_order, api_key, timeout, json_out, say) -> str:
    """`flylocal bench serve`: the plan from the options, the run, the report (and the JSON)."""
    import shutil

    from flylocal import models

    if llama_server and not (os.path.isfile(llama_server) and os.access(llama_server, os.X_OK)):
        raise FlylocalError(f"--llama-server {llama_server}: no such program")
    llama_server = llama_server or shutil.which("llama-server")
    where = json_out if json_out and os.path.exists(json_out) else os.path.dirname(json_out or "") or "."
    if json_out and not (os.path.isdir(where) == (where != json_out) and os.access(where, os.W_OK)):
        raise FlylocalError(f"--json {json_out}: cannot write there")     # found now, not after the run
    specs = list(server_specs) or default_servers(bool(draft), llama_server)
    servers = [parse_server(spec, target=target, target_path="{target}", draft_path=draft and "{draft}", ctx=ctx,
                            threads=threads, llama_server=llama_server, model=model) for spec in specs]
    target_path = str(models.resolve(target)) if any(s.own_model for s in servers) else ""
    paths = {"{target}": target_path, "{draft}": str(models.resolve(draft)) if draft else ""}
    for s in servers:
        s.command = s.command and [_fill(part, paths) for part in s.command]
    names = [s.name for s in servers]
    if len(set(names)) < len(names):
        raise FlylocalError(f"--server: the name {next(n for n in names if names.count(n) > 1)!r} is used twice")
    base = base or default_base(servers)
    if base not in names:
        raise FlylocalError(f"--base {base!r} is none of the servers: {', '.join(names)}")
    if context and prompt_words:
        raise FlylocalError("--context pads prompts to a length in tokens, --prompt-words in words: give one")
    count = token_counter(str(models.resolve(target))) if context else None
    convs = conversations(prompts, category, per_category, skip, turns, prompt_words, repeat, context, count)
    if context:
        lengths = sorted(count(turns[0]) for _, turns in convs)
        if lengths[-1] + max_tokens > ctx:
            raise FlylocalError(f"--context {context}: the longest prompt is {lengths[-1]:,} tokens, and with "
                                f"--max-tokens {max_tokens} it needs --ctx {lengths[-1] + max_tokens + 64} or more")
        say(f"--context {context}: first turns of {lengths[0]:,} to {lengths[-1]:,} tokens ({target}'s tokenizer)")
        from flylocal.gguf_info import read_info

        line = past_training(lengths[-1], max_tokens, read_info(models.resolve(target)).context_length, target)
        if line:
            say(line)
    banned = () if natural or not any(s.own_model for s in servers) else end_tokens(target_path)
    plan = Plan(servers, convs, clients=clients, per_client=per_client, max_tokens=max_tokens, ctx=ctx, raw=raw,
                banned=banned, base=base, pause=pause, stagger=stagger, taking_turns=not fixed_order,
                timeout=timeout, api_key=api_key)
    results = run(plan, say)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({str(c): got for c, got in results.items() if c != "interrupted"}, f, indent=1)
    text = report(plan, results, turns)
    if results.get("interrupted"):
        sys.stdout.write(text)
        raise KeyboardInterrupt
    return text
