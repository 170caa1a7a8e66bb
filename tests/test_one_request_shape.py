"""One request shape: each dialect's parser reads its request into a `Neutral`, and
`Server.ask` alone turns that into the worker's `Ask` (docs/design.md, "Adding an API
dialect"). The same conversation with the same options, asked in OpenAI's chat, Ollama's chat
and OpenAI's Responses, becomes the same Ask: the same prompt ids, the same settings, the same
grammar; the test-only plain dialect (tests/dialect_plain.py) is a parser and a renderer too."""

from __future__ import annotations

import inspect
import time

import pytest

BASE = "http://127.0.0.1:8080"
SYSTEM, USER = "You answer in one short sentence.", "Name a colour of the sky."


def test_no_dialect_runs_the_steps_itself():
    """The steps from settings to a fitting prompt are Server.ask's: no dialect calls them."""
    from flylocal.front.serve import ollama, openai, responses

    for module in (openai, ollama, responses):
        source = inspect.getsource(module)
        for step in ("check_settings(", "check_fits(", "settings_from(", "hinted(", ".hint(", "Ask("):
            assert step not in source, (module.__name__, step)


@pytest.fixture(scope="module")
def served():
    """A real server on SmolLM2 whose Server.ask records each Neutral and the Ask it made."""
    from fastapi.testclient import TestClient

    import dialect_plain
    from conftest import SMOL
    from flylocal.front.serve import DIALECTS, create_app
    from flylocal.front.serve.app import Server
    from flylocal.loader import load
    from flylocal.session import Session
    from flylocal.settings import Settings

    made: list = []
    real = Server.ask

    def recorded(self, session, n, key=None):
        ask = real(self, session, n, key)
        made.append((n, ask))
        return ask

    Server.ask = recorded
    settings = Settings(target=SMOL, drafter="pld", verifier="strict", threads=1, ctx=512)
    app = create_app(lambda: Session(load(settings)), settings, dialects=DIALECTS + (dialect_plain,))
    try:
        with TestClient(app, base_url=BASE) as client:
            for _ in range(600):                        # the models load on the worker thread
                if client.get("/health").status_code == 200:
                    break
                time.sleep(0.1)
            yield client, made
    finally:
        Server.ask = real


def asked(served, path: str, body: dict):
    client, made = served
    made.clear()
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(made) == 1
    return made[0]


@pytest.mark.slow
def test_one_conversation_in_three_dialects_is_one_ask(served):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    chat_n, chat = asked(served, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 6, "temperature": 0.5, "seed": 7, "top_k": 5, "top_p": 0.9,
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}})
    ollama_n, ollama = asked(served, "/api/chat", {
        "model": "smollm2-135m-instruct", "messages": messages, "stream": False, "format": "json", "logprobs": True, "top_logprobs": 2,
        "options": {"num_predict": 6, "temperature": 0.5, "seed": 7, "top_k": 5, "top_p": 0.9, "num_gpu": 0}})
    resp_n, resp = asked(served, "/v1/responses", {
        "instructions": SYSTEM, "input": USER, "max_output_tokens": 6, "temperature": 0.5, "seed": 7, "top_k": 5,
        "top_p": 0.9, "top_logprobs": 2, "text": {"format": {"type": "json_object"}}})
    # each parser read its own request ...
    assert chat_n.where == "messages" and chat_n.messages == messages and chat_n.options is None
    assert ollama_n.where == "prompt" and ollama_n.options == "options" and ollama_n.hints == ("num_gpu",)
    assert resp_n.where == "input" and resp_n.prompt is not None       # encoded, to truncate if need be
    for n in (chat_n, ollama_n, resp_n):
        assert {k: n.params[k] for k in ("max_tokens", "temperature", "seed", "top_k", "top_p", "logprobs")} == \
            {"max_tokens": 6, "temperature": 0.5, "seed": 7, "top_k": 5, "top_p": 0.9, "logprobs": 2}
    # ... and the server made one Ask of all three
    assert chat.ids.tolist() == ollama.ids.tolist() == resp.ids.tolist()
    assert chat.settings == ollama.settings == resp.settings and chat.settings.logprobs == 2
    assert chat.settings.sampling.seed == 7 and chat.settings.max_tokens == 6
    assert chat.grammar == ollama.grammar == resp.grammar and chat.grammar is not None
    assert chat.tokens and ollama.tokens and resp.tokens                 # logprobs asked: per-token details


@pytest.mark.slow
def test_a_prompt_in_three_dialects_is_one_ask(served):
    prompt = "The days of the week are Monday, Tuesday,"
    completion_n, completion = asked(served, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "stop": ["\n"]})
    plain_n, plain = asked(served, "/plain", {"prompt": prompt, "max_tokens": 4})
    generate_n, generate = asked(served, "/api/generate", {"model": "smollm2-135m-instruct", "prompt": prompt, "raw": True,
                                                           "stream": False, "options": {"num_predict": 4, "stop": ["\n"]}})
    assert completion_n.text == plain_n.text == prompt and generate_n.prompt is not None   # a context continues ids
    assert completion.ids.tolist() == plain.ids.tolist() == generate.ids.tolist()
    assert completion.settings == plain.settings == generate.settings
    assert completion.stops == generate.stops == ("\n",) and plain.stops == ()
    assert generate.tokens and not plain.tokens       # Ollama's `context` holds the answer's ids


@pytest.mark.slow
def test_the_server_refuses_for_every_dialect_in_its_terms(served):
    client, _ = served
    empty = client.post("/v1/completions", json={"prompt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
    long = "word " * 2000
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
                              ("/v1/responses", {"input": long}, "input"),
                              ("/plain", {"prompt": long}, None)):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "the context holds 512" in r.text, (path, r.text)
        if param:
            assert r.json()["error"]["param"] == param
    options = client.post("/api/generate", json={"model": "smollm2-135m-instruct", "prompt": "hi", "stream": False,
                                                 "options": {"temperature": -1}})
    assert options.status_code == 400 and "temperature" in options.text
