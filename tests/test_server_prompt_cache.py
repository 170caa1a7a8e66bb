"""The prompt cache through `flylocal serve` (docs/serving.md "Prompt cache", docs/serving.md):
conversations taking turns on one slot keep what they had, through every dialect; the cache is
visible in /metrics and /api/ps; a restarted server with --prompt-cache DIR continues where it
was, and skips a damaged or foreign entry there in one line with a right answer; the same
request gives the same answer whatever the slot held before (exact mode)."""

from __future__ import annotations

import httpx
import pytest

from conftest import SMOL, SMOL_Q4_0
from test_server import free_port, log, start, stop, wait_ready

pytestmark = pytest.mark.slow

SYSTEM = ("You are the help desk of a small public library. The library opens at nine and closes at six, "
          "lends books for three weeks, and charges no fines. Answer briefly. ") * 6
QUESTIONS = ["When do you open?", "How long can I keep a book?", "Do you charge fines?"]


def chat(url, messages, dialect="openai", **extra):
    """(answer text, prompt tokens, cached prompt tokens) of a greedy chat request."""
    if dialect == "ollama":
        body = {"model": SMOL, "messages": messages, "stream": False,
                "options": {"temperature": 0, "num_predict": 24}, **extra}
        r = httpx.post(url + "/api/chat", json=body, timeout=300).json()
        reused = r["flylocal"]["prompt_reused"]            # prompt_eval_count: the tokens evaluated, as ollama's
        return r["message"]["content"], r["prompt_eval_count"] + reused, reused
    if dialect == "responses":
        body = {"model": SMOL, "input": messages, "max_output_tokens": 24, "temperature": 0, **extra}
        r = httpx.post(url + "/v1/responses", json=body, timeout=300).json()
        usage = r["usage"]
        return r["output"][0]["content"][0]["text"], usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    body = {"model": SMOL, "messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    usage = r["usage"]
    return r["choices"][0]["message"]["content"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def server(*args):
    port = free_port()
    proc = start("--target", SMOL, "--ctx", "2048", "--parallel", "1", "--verifier", "strict", *args, port=port)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def take_turns(url, dialects, rounds=2):
    """Three conversations, A B C A B C ..., each in its dialect: per turn (conversation, answer,
    prompt tokens, cached)."""
    history = [[{"role": "system", "content": SYSTEM}] for _ in dialects]
    out = []
    for r in range(rounds):
        for c, dialect in enumerate(dialects):
            history[c].append({"role": "user", "content": QUESTIONS[(c + r) % 3]})
            text, n, cached = chat(url, history[c], dialect)
            history[c].append({"role": "assistant", "content": text})
            out.append((c, text, n, cached))
    return out


def test_conversations_taking_turns_on_one_slot_keep_what_they_had_in_every_dialect():
    """A B C A B C on one slot, through OpenAI's chat, the Responses API and Ollama's chat: each
    turn after a conversation's first has its previous prompt cached, its answer is the one
    the server gives with no cache (--cache-ram 0, where it is not), and /metrics and /api/ps
    count the hits and the bytes held."""
    dialects = ["openai", "responses", "ollama"]
    proc, url = server()
    try:
        turns = take_turns(url, dialects)
        metrics = httpx.get(url + "/metrics").text
        ps = httpx.get(url + "/api/ps").json()["models"][0]
    finally:
        stop(proc)
    proc, url = server("--cache-ram", "0")
    try:
        without = take_turns(url, dialects)
    finally:
        stop(proc)
    for i, ((c, text, n, cached), (_, text0, n0, cached0)) in enumerate(zip(turns, without)):
        assert text == text0
        if i < 3:
            continue
        before = turns[i - 3][2]                       # the conversation's previous prompt: all kept
        assert cached >= before, (c, cached, before)
        assert cached0 < before                        # without the cache, only the system prompt
    hits = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("flylocal_prompt_cache_hits"))
    assert hits >= 3
    cache = ps["flylocal"]["prompt_cache"]
    assert cache["hits"] >= 3 and 0 < cache["bytes"] <= cache["limit_bytes"]
    assert ps["size"] >= cache["bytes"]


def test_a_restarted_server_continues_from_its_prompt_cache_dir(tmp_path):
    """--prompt-cache DIR: a conversation continued on a restarted server has all its first turn
    cached and the same answer; a damaged entry and a foreign one there are skipped, each said
    in one line, and the answer is still right."""
    folder = str(tmp_path / "cache")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    proc, url = server("--prompt-cache", folder)
    try:
        text, first, _ = chat(url, history)
    finally:
        stop(proc)
    files = list((tmp_path / "cache").glob("*.prompt"))
    assert len(files) == 1
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
    proc, url = server("--prompt-cache", folder)
    try:
        again, n, cached = chat(url, history)
    finally:
        stop(proc)
    assert cached >= first                         # the whole first turn's prompt, and its answer but the last token
    assert "entries on disk" in log(proc)
    proc, url = server("--cache-ram", "0")
    try:
        fresh, _, _ = chat(url, history)
    finally:
        stop(proc)
    assert again == fresh

    files = list((tmp_path / "cache").glob("*.prompt"))     # the longer entry took the first one's place
    assert len(files) == 1
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) - 1000] + bytes(1000))          # damaged: same size, wrong bytes
    proc, url = server("--prompt-cache", folder)
    try:
        damaged, n, cached = chat(url, history)
    finally:
        stop(proc)
    assert damaged == fresh and cached < first
    said = [line for line in log(proc).splitlines() if "not loaded" in line]
    assert len(said) == 1 and "digest" in said[0]

    proc, url = server("--prompt-cache", folder)                           # made again, then foreign
    try:
        chat(url, history)
    finally:
        stop(proc)
    proc, url = server("--prompt-cache", folder, "--ctx", "1024")
    try:
        foreign, n, cached = chat(url, history)
    finally:
        stop(proc)
    assert cached < first and foreign == fresh
    assert sum("another model, build or context" in line for line in log(proc).splitlines()) == 1


def test_the_same_request_gives_the_same_answer_whatever_the_slot_held():
    """The red team's case: "List three colors." (strict, 32 tokens) alone, again, and after an
    abandoned long chat and after other conversations were kept and restored: one answer."""
    proc, url = server("--draft", SMOL_Q4_0, "--drafter", "mla", "--cache-ram", "8")
    try:
        ask = [{"role": "user", "content": "List three colors."}]
        answers = [chat(url, ask, max_tokens=32)[0] for _ in range(2)]
        long = [{"role": "user", "content": "Tell me about libraries. " * 200}]
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                          json={"model": SMOL, "messages": long, "max_tokens": 200, "stream": True}) as r:
            for _ in r.iter_lines():
                break                                               # abandoned after its first event
        answers.append(chat(url, ask, max_tokens=32)[0])
        take_turns(url, ["openai", "openai", "openai"], rounds=1)     # kept, and evicted past 8 MiB
        answers.append(chat(url, ask, max_tokens=32)[0])
    finally:
        stop(proc)
    assert len(set(answers)) == 1, answers


def test_a_stored_response_continued_after_other_conversations_is_restored():
    """Responses' previous_response_id: the stored conversation's cells were kept when another
    conversation took the slot, and its continuation has all of the first turn cached."""
    proc, url = server()
    try:
        first = httpx.post(url + "/v1/responses", timeout=300, json={
            "model": SMOL, "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
            "max_output_tokens": 24, "temperature": 0, "store": True}).json()
        chat(url, [{"role": "system", "content": SYSTEM[::-1]}, {"role": "user", "content": QUESTIONS[1]}])
        then = httpx.post(url + "/v1/responses", timeout=300, json={
            "model": SMOL, "previous_response_id": first["id"], "input": QUESTIONS[2], "max_output_tokens": 24,
            "temperature": 0}).json()
    finally:
        stop(proc)
    assert then["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]
