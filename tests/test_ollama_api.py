"""The Ollama dialect of `flylocal serve` on SmolLM2, over loopback, driven by the clients people
point at ollama: litellm's Ollama providers, the ollama client, and httpx for what no client
sends. One server runs for the module (strict, so that an answer is the target's greedy one);
every request is bounded in tokens and time.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from conftest import SMOL, prompt
from test_server import KEY, free_port, log, start, stop, wait_ready

pytestmark = pytest.mark.slow      # a real model behind a real server

CTX = 1024
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"num_predict": 24, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start("--target", SMOL, "--api-key", KEY, "--ctx", str(CTX), "--verifier", "strict", port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        server_proc[url] = proc
        yield url
    finally:
        stop(proc)


server_proc: dict = {}              # the running server's process, by its URL (its log)


@pytest.fixture(scope="module")
def client(server):
    import ollama

    return ollama.Client(host=server, headers=AUTH, timeout=120)


def test_litellm_ollama_chat_gets_answers_plain_and_streamed(server):
    """litellm's `ollama_chat/` provider posts to /api/chat with no Content-Type, as ollama allows."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"     # no fetch of litellm's price list
    import litellm

    question = [{"role": "user", "content": prompt("qa-capital")}]
    kw = {"model": f"ollama_chat/{SMOL}", "api_base": server, "api_key": KEY, "messages": question,
          "max_tokens": 16, "temperature": 0, "timeout": 120}
    whole = litellm.completion(**kw)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert streamed == text
    direct = httpx.post(server + "/api/chat", headers=AUTH, timeout=120, json={
        "model": SMOL, "messages": question, "stream": False, "options": {"num_predict": 16, "temperature": 0}})
    assert direct.json()["message"]["content"] == text


def test_litellm_ollama_generate_gets_an_answer(server):
    """litellm's `ollama/` provider: /api/generate, with no Content-Type either."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    done = litellm.completion(model=f"ollama/{SMOL}", api_base=server, api_key=KEY, max_tokens=16, temperature=0,
                              messages=[{"role": "user", "content": prompt("qa-capital")}], timeout=120)
    assert done.choices[0].message.content and done.usage.completion_tokens > 0


def refused(r: httpx.Response, start: str) -> str:
    """A 400 in ollama's shape whose message starts with `start` (the field it names)."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"].startswith(start), body
    return body["error"]


def test_values_flylocal_cannot_honour_are_400_in_ollamas_shape_naming_the_field(server):
    def generate(raw: str):
        return httpx.post(server + "/api/generate", headers={**AUTH, "Content-Type": "application/json"},
                          content=('{"model": "%s", "prompt": "hi", "stream": false, %s}' % (SMOL, raw)).encode(),
                          timeout=120)

    refused(generate('"options": {"seed": -Infinity}'), "options.seed: -Infinity")     # was a 500
    refused(generate('"options": {"seed": 1.5}'), "options.seed: 1.5")
    refused(generate('"options": {"num_ctx": -5}'), "options.num_ctx: -5")
    refused(generate('"keep_alive": {"a": 1}'), 'keep_alive: {"a": 1}; a duration')
    refused(generate('"template": "{{ .Prompt }}"'), "template: ")
    refused(generate('"context": [1, 2, 99999999]'), "context: 99999999 is no token of this model")
    refused(generate('"context": [1, 2], "system": "Be brief."'), "system: ")
    assert "Traceback" not in log(server_proc[server])
    ok = generate('"options": {"num_ctx": 512, "seed": 3, "num_predict": 4}, "keep_alive": "5m", "template": ""')
    assert ok.status_code == 200 and ok.json()["done"]


def test_generate_answers_with_its_context_and_continues_it(client):
    """The `context` /api/generate gives is the prompt's ids and the answer's; sent back, the
    next prompt is the user's next turn: the same answer /api/chat gives for the conversation."""
    first = client.generate(model=SMOL, prompt=prompt("qa-capital"), options=GREEDY)
    history = list(first.context)
    assert first.response and len(history) > first.eval_count > 0
    follow_up = "And what is the capital of Italy?"
    second = client.generate(model=SMOL, prompt=follow_up, context=history, options=GREEDY)
    assert list(second.context)[: len(history)] == history
    chat = client.chat(model=SMOL, options=GREEDY, messages=[
        {"role": "user", "content": prompt("qa-capital")}, {"role": "assistant", "content": first.response},
        {"role": "user", "content": follow_up}])
    assert second.response and second.response == chat.message.content
    streamed = list(client.generate(model=SMOL, prompt=follow_up, context=history, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == second.response
    assert list(streamed[-1].context) == list(second.context)


def test_a_raw_context_is_continued_by_the_text_that_follows(server):
    def generate(**body):
        r = httpx.post(server + "/api/generate", headers=AUTH, timeout=120,
                       json={"model": SMOL, "raw": True, "stream": False, "options": {"num_predict": 8}, **body})
        assert r.status_code == 200, r.text
        return r.json()

    first = generate(prompt="The capital of France is")
    second = generate(prompt=" The capital of Italy is", context=first["context"])
    assert len(first["context"]) > first["eval_count"] > 0
    assert second["context"][: len(first["context"])] == first["context"]
    assert second["flylocal"]["prompt_reused"] >= len(first["context"]) - 1        # the cache the first left
    whole = generate(prompt="The capital of France is" + first["response"] + " The capital of Italy is")
    assert second["response"] and second["response"] == whole["response"]


def test_ps_says_the_model_stays_loaded(client, server):
    """Models stay loaded for the server's life: ollama's keep_alive -1, whose expires_at is far
    off (`ollama ps` shows more than 20 years ahead as "Forever")."""
    shown = client.ps().models[0]
    assert shown.model == SMOL and shown.expires_at > datetime.now(timezone.utc) + timedelta(days=365 * 100)
    raw = httpx.get(server + "/api/ps", headers=AUTH).json()["models"][0]["expires_at"]
    assert raw.endswith("Z") and datetime.fromisoformat(raw.removesuffix("Z") + "+00:00").year > 2100
