"""One request body: each dialect's parser reads its request into a `Body`, and
`Server.ask` alone turns that into the worker's `Ask` (docs/serving.md, "Adding an API dialect"). The same conversation with the same options, asked in OpenAI's chat, Ollama's chat
and OpenAI's Responses, becomes the same Ask: the same prompt ids, the same settings, the same
grammar; the test-only plain dialect (tests/dialect_plain.py) is a parser and a renderer too."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from flylocal.front.serve.app import ApiError, Endpoint, Exchange
from flylocal.front.serve.request import Body, JsonOutput

BASE = "http://127.0.0.1:8080"
SYSTEM, USER = "You answer in one short sentence.", "Name a colour of the sky."


APP, REQUEST = "flylocal.front.serve.app", "flylocal.front.serve.request"
DIALECT_MODULES = ("flylocal.front.serve.openai", "flylocal.front.serve.openai_requests", "flylocal.front.serve.ollama",
                   "flylocal.front.serve.ollama_options", "flylocal.front.serve.responses", "flylocal.front.serve.anthropic",
                   "flylocal.front.serve.infill", "dialect_plain")
# The steps from a body to an Ask: settings, grammar, encoding, truncation, the fit. Server.ask's alone.
STEPS = {(REQUEST, f) for f in ("settings_for", "logprobs_wanted", "grammar_for", "prompt_for", "conversation",
                                "truncated", "continued", "next_turn")} | {
    ("flylocal.settings", "settings_from"), ("flylocal.front.serve.tools", "plan"),
    ("flylocal.decoding.grammar", "json_output"), ("flylocal.decoding.grammar", "grammar_text"),
    (APP, "Server.check_settings"), (APP, "Server.check_fits"), (APP, "Server.hint"),
    ("flylocal.session", "Session.encode"), ("flylocal.llama.runtime", "Runtime.tokenize"),
    ("flylocal.llama.runtime", "Runtime.tokenize_chat")} | {
    ("?", name) for name in ("settings_for", "settings_from", "grammar_for", "json_output", "prompt_for", "encode",
                             "tokenize", "tokenize_chat", "check_settings", "check_fits", "truncated")}
PIPELINE = {(APP, "Server.ask"), (APP, "Endpoint.job"), (APP, "Server.count")}


def steps_reached(module: str, extra=None) -> list[str]:
    from call_graph import Graph

    graph = Graph({"dialect_plain": Path(__file__).parent / "dialect_plain.py"} | (extra or {}))
    return [" -> ".join(f"{m}:{f}" for m, f in path) for path in graph.reaching(module, STEPS, PIPELINE)]


@pytest.mark.parametrize("module", DIALECT_MODULES)
def test_no_dialect_reaches_a_step_but_through_server_ask(module):
    """On the call graph: from no function of a dialect module is any step from settings to a
    fitting prompt reached, except through Server.ask (the pipeline's Endpoint.job)."""
    assert steps_reached(module) == []


def test_the_call_graph_sees_a_dialect_that_runs_a_step_itself(tmp_path):
    """The check above can fail: a dialect that reaches the steps through a helper, a
    session's target or its server is caught, each path named."""
    path = tmp_path / "sneaky_dialect.py"
    path.write_text(
        "from flylocal.front.serve import request\n"
        "from flylocal.front.serve.app import Endpoint\n\n"
        "def helper(session, body):\n    return request.prompt_for(session, body, 10)\n\n"
        "class Sneaky(Endpoint):\n"
        "    def read(self, x):\n        return helper(x.session, None)\n"
        "    def whole(self, x, result):\n        return x.session.target.tokenize('hi')\n"
        "    def chunks(self, x, events):\n        return self.server.check_settings(None)\n"
        "    def job(self, x):\n        return super().job(x)\n")
    found = steps_reached("sneaky_dialect", {"sneaky_dialect": path})
    assert sorted(found) == [
        "sneaky_dialect:Sneaky.chunks -> flylocal.front.serve.app:Server.check_settings",
        "sneaky_dialect:Sneaky.read -> sneaky_dialect:helper -> flylocal.front.serve.request:prompt_for",
        "sneaky_dialect:Sneaky.whole -> flylocal.llama.runtime:Runtime.tokenize",
        "sneaky_dialect:helper -> flylocal.front.serve.request:prompt_for"]


# ----- a dialect written here, a parser and a renderer only -----

class MemoRequest(BaseModel):
    """POST /memo: {"note": a system prompt, "lines": the user's and the assistant's turns,
    alternating, "json": the answer is a JSON object, "length": at most that many tokens}."""
    model_config = ConfigDict(extra="forbid", strict=True)
    note: str | None = None
    lines: list[str]
    json_: bool = Field(False, alias="json")
    length: int | None = None
    sure: int | None = None             # top_logprobs, in this dialect's words


class Memo(Endpoint):
    name, body, checked, role = "memo", MemoRequest, {"length": "max_tokens"}, "target"

    def model(self, body) -> None:
        return None                     # the server's target, always

    def streams(self, body) -> bool:
        return False

    def read(self, x: Exchange) -> Body:
        req = x.body
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": line} for i, line in enumerate(req.lines)]
        system = [{"role": "system", "content": req.note}] if req.note else []
        return Body(messages=system + turns, options={"max_tokens": req.length} if req.length else {},
                    format=JsonOutput(None, "json") if req.json_ else None, logprobs=req.sure is not None,
                    top_logprobs=req.sure, names={"prompt": "lines", "top_logprobs": "sure", "format": "json"})

    def whole(self, x: Exchange, whole) -> dict:
        return {"memo": whole.text, "tokens": whole.end.n_tokens, "ids": len(x.ask.ids),
                "sure": [t.logprob for t in whole.tokens] if x.ask.settings.logprobs is not None else None}

    def error(self, e: ApiError) -> JSONResponse:
        return JSONResponse({"memo_error": e.message, "field": e.param}, status_code=e.status)


def routes(app, server) -> None:
    server.route(app, ["POST"], "/memo", Memo(server))


@pytest.fixture(scope="module")
def served():
    """A real server on SmolLM2 whose Server.ask records each Body and the Ask it made."""
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
    this = sys.modules[__name__]                        # the Memo dialect below
    app = create_app(lambda: Session(load(settings)), settings, dialects=DIALECTS + (dialect_plain, this))
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
    # each parser read its own request into one body: a conversation, options, a format ...
    assert chat_n.name("prompt") == "messages" and chat_n.names.get("options") is None
    assert ollama_n.name("prompt") == "prompt" and ollama_n.names["options"] == "options"
    assert ollama_n.hints == ("num_gpu",) and resp_n.name("prompt") == "input"
    for n in (chat_n, ollama_n, resp_n):
        assert n.messages == messages and n.format is not None and n.format.schema is None
        assert (n.logprobs, n.top_logprobs) == (True, 2)
        assert {k: n.options[k] for k in ("max_tokens", "temperature", "seed", "top_k", "top_p")} == \
            {"max_tokens": 6, "temperature": 0.5, "seed": 7, "top_k": 5, "top_p": 0.9}
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
    assert completion_n.text == plain_n.text == generate_n.text == prompt
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


@pytest.mark.slow
def test_a_dialect_written_here_answers_through_the_whole_pipeline(served):
    """Memo, above, is a parser and a renderer: the settings, the grammar, the prompt, its fit
    and the rules (in its own words) all come from the server; it answers what the same
    conversation asked in OpenAI's chat answers."""
    client, made = served
    memo_body, memo = asked(served, "/memo", {"note": SYSTEM, "lines": [USER], "json": True, "length": 8, "sure": 1})
    made.clear()
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], "max_tokens": 8,
        "logprobs": True, "top_logprobs": 1, "response_format": {"type": "json_object"}})
    assert chat.status_code == 200, chat.text
    (_, chat_ask), = made
    assert memo.ids.tolist() == chat_ask.ids.tolist() and memo.grammar == chat_ask.grammar is not None
    assert memo.settings == chat_ask.settings and memo.settings.logprobs == 1
    made.clear()
    out = client.post("/memo", json={"note": SYSTEM, "lines": [USER], "json": True, "length": 8, "sure": 1}).json()
    choice = chat.json()["choices"][0]
    assert out["memo"] == choice["message"]["content"] and out["tokens"] == chat.json()["usage"]["completion_tokens"]
    assert out["sure"] == [e["logprob"] for e in choice["logprobs"]["content"]]
    # refusals come from the server's rules, named in the dialect's words and shape
    for body, field in (({"lines": [USER], "sure": 30}, "sure"), ({"lines": [USER], "length": 0}, "length"),
                        ({"lines": ["word " * 2000]}, "lines"), ({"lines": []}, "lines")):
        r = client.post("/memo", json=body)
        assert r.status_code == 400 and r.json()["field"] == field, (body, r.text)
