"""The server's pure parts, without a model: stop strings, request validation, settings."""

import math

import pytest

pytest.importorskip("fastapi", reason="the server extra: pip install -e '.[serve]'")

from flylocal.server import ApiError, ChatRequest, CompletionRequest, StopStrings, parse, request_settings
from flylocal.settings import Settings


def run(stops, pieces):
    s = StopStrings(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = s.feed(p)
        out.append(text)
        if hit:
            break
    if not hit:
        text, hit = s.feed("", final=True)
        out.append(text)
    return out, hit


def test_a_stop_string_spanning_pieces_is_cut_and_not_sent():
    out, hit = run(["END"], ["Hello E", "N", "D and more"])
    assert hit and "".join(out) == "Hello "
    assert out[0] == "Hello "          # "E" could start the stop string: held back, nothing more


def test_text_that_cannot_start_a_stop_string_is_not_held():
    out, hit = run(["</s>"], ["abc", "de<", "x>", "fin"])
    assert not hit and out == ["abc", "de", "<x>", "fin", ""]


def test_a_false_start_is_released_and_the_earliest_stop_wins():
    out, hit = run(["ab", "cd"], ["xa", "ycd", "ab"])
    assert hit and "".join(out) == "xay"


def test_held_text_comes_out_at_the_end():
    out, hit = run(["STOP"], ["ST"])
    assert not hit and "".join(out) == "ST"


def body(**fields):
    import json

    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize("fields,param", [
    ({"n": 2}, "n"), ({"tools": []}, "tools"), ({"logprobs": True}, "logprobs"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"seed": -1}, "seed"), ({"verifier": "loose"}, "verifier"), ({"k": -1}, "k"),
    ({"asd_budget": "nan"}, "asd_budget"), ({"fly_entropy": -0.1}, "fly_entropy"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"user": "u1"}, "user"), ({"temperature": True}, "temperature"), ({"max_tokens": "5"}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, body(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_message_parts_and_options_reach_the_settings():
    req = parse(ChatRequest, body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                                  max_completion_tokens=9, temperature=0.5, seed=3, verifier="asd", asd_budget=float("inf"),
                                  fly_window=3, stream=True, stream_options={"include_usage": True}))
    assert req.messages[0].text() == "ab"
    s = request_settings(Settings(), req)
    assert (s.max_tokens, s.verifier, s.sampling.temperature, s.sampling.seed) == (9, "asd", 0.5, 3)
    assert math.isinf(s.verifiers.asd.budget) and s.verifiers.fly.window == 3
    assert request_settings(Settings(), parse(CompletionRequest, b'{"prompt": "x"}')) == Settings()


def test_not_json_is_400():
    for raw in (b"{", b"[1]", b"\xff", b"[" * 100000, b'{"seed": ' + b"9" * 10000 + b"}"):
        with pytest.raises(ApiError) as e:
            parse(ChatRequest, raw)
        assert e.value.status == 400


def app_loading(**kw):
    """The application while its models are still loading (they never finish here)."""
    import threading

    from flylocal.server import create_app

    never = threading.Event()

    def load():
        never.wait()

    app = create_app(load, Settings(), **kw)
    return app, never


def test_health_says_loading_and_requests_wait_with_503():
    from fastapi.testclient import TestClient

    app, never = app_loading()
    try:
        client = TestClient(app)
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
    finally:
        never.set()


def test_cors_is_off_unless_an_origin_is_given():
    from fastapi.testclient import TestClient

    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    for origins, allowed in (((), False), (("http://ui.example",), True)):
        app, never = app_loading(cors_origins=origins)
        try:
            r = TestClient(app).options("/v1/chat/completions", headers=preflight)
            assert (r.headers.get("access-control-allow-origin") == "http://ui.example") == allowed
        finally:
            never.set()


def test_an_api_key_is_required_where_given():
    from fastapi.testclient import TestClient

    app, never = app_loading(api_key="k1")
    try:
        client = TestClient(app)
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/health").status_code == 503             # open, and still loading
    finally:
        never.set()
