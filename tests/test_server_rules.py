"""The server's pure parts, without a model: stop strings, request validation, settings."""

import json
import math

import pytest

pytest.importorskip("fastapi", reason="the server extra: pip install -e '.[serve]'")

from flylocal.front.serve.app import ApiError
from flylocal.front.serve.openai_requests import ChatRequest, CompletionRequest, parse
from flylocal.front.serve.worker import StopStrings
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


def request_settings(base: Settings, req, n_vocab: int | None = None) -> Settings:
    """An OpenAI request's settings, as Server.ask makes them of its body (a Refusal as the
    ApiError the server makes of it)."""
    from flylocal.front.serve.openai import body_of
    from flylocal.front.serve.request import Refusal, grammar_for, settings_for

    try:
        body = body_of(req, chat=isinstance(req, ChatRequest))
        grammar_for(body)
        return settings_for(body, base, n_vocab=n_vocab)
    except Refusal as e:
        raise ApiError(400, e.message, param=e.param) from None


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


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields,param,words", [
    ({"n": 2}, "n", "2"),
    ({"temperature": -1}, "temperature", ""), ({"top_p": 0}, "top_p", ""), ({"seed": -1}, "seed", ""),
    ({"verifier": "loose"}, "verifier", "loose"), ({"k": -1}, "k", ""), ({"asd_budget": "nan"}, "asd_budget", ""),
    ({"fly_entropy": -0.1}, "fly_entropy", ""), ({"max_tokens": 0}, "max_tokens", ""),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "65 stop strings; at most 64"), ({"frequency_penalty": 2.5}, "frequency_penalty", ""),
    ({"presence_penalty": -3}, "presence_penalty", ""), ({"temperature": True}, "temperature", ""),
    ({"max_tokens": "5"}, "max_tokens", ""), ({"logprobs": 3}, "logprobs", ""),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "21"), ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL]}, "response_format", "one of them"),
    ({"store": True}, "store", "keeps no completions"),
    ({"logit_bias": {"12": 101}}, "logit_bias", "101"), ({"logit_bias": {"x": 1}}, "logit_bias", "x"),
    ({"service_tier": "flex"}, "service_tier", "flex"), ({"functions": []}, "functions", "functions"),
    ({"stream_options": {"include_usage": True}}, None, "stream: true"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", ""),
    ({"repeat_penalty": 1e-320}, "repeat_penalty", ""),          # was accepted: garbage, and logprob null
    ({"repeat_penalty": 1e9}, "repeat_penalty", ""),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "64 characters"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"user": "u" * 100_000}, "user", "at most 512"),
    ({"reasoning_effort": "maximal"}, "reasoning_effort", ""),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "type json_object takes none"),
])
def test_fields_flylocal_cannot_honour_are_400_naming_the_field_and_value(fields, param, words):
    with pytest.raises(ApiError) as e:
        request_settings(Settings(), parse(ChatRequest, body(**fields)))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert words in e.value.message


def test_what_real_clients_send_at_do_nothing_values_is_accepted():
    """Front-ends with sliders send both penalties at 0; SDKs send tools: [], logprobs: false,
    response_format text, n: 1, store: false, metadata, a user id, a message's name."""
    req = parse(ChatRequest, body(
        messages=[{"role": "user", "content": "hi", "name": "ann"}], frequency_penalty=0, presence_penalty=0.0,
        logprobs=False, response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False,
        logit_bias={}, store=False, metadata={}, n=1, user="u1", service_tier="auto",
        stream_options={"include_usage": False}, top_logprobs=0))
    assert request_settings(Settings(), req) == Settings()
    completion = parse(CompletionRequest, json_bytes(prompt="x", logprobs=None, echo=False, best_of=1, suffix=None,
                                                      n=1, user="u"))
    assert request_settings(Settings(), completion) == Settings()


def json_bytes(**fields):
    import json

    return json.dumps(fields).encode()


def test_penalties_and_logit_bias_reach_the_sampling():
    req = parse(ChatRequest, body(frequency_penalty=0.5, presence_penalty=-0.25, logit_bias={"7": -100, "3": 2.5}))
    s = request_settings(Settings(), req, n_vocab=10)
    assert (s.sampling.frequency_penalty, s.sampling.presence_penalty) == (0.5, -0.25)
    assert s.sampling.logit_bias == ((3, 2.5), (7, -100.0))
    with pytest.raises(ApiError) as e:
        request_settings(Settings(), parse(ChatRequest, body(logit_bias={"10": 1})), n_vocab=10)
    assert e.value.param == "logit_bias" and "10" in e.value.message


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

    from flylocal.front.serve import create_app

    never = threading.Event()

    def load():
        never.wait()

    app = create_app(load, Settings(), **kw)
    return app, never


BASE = "http://127.0.0.1:8080"        # where app_loading's application listens (its Host rule)


def test_health_says_loading_and_requests_wait_with_503():
    from fastapi.testclient import TestClient

    app, never = app_loading()
    try:
        client = TestClient(app, base_url=BASE)
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
    finally:
        never.set()


def test_cors_is_off_unless_an_origin_is_given():
    from fastapi.testclient import TestClient

    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    for origins, status in (((), 403), (("http://ui.example",), 200)):
        app, never = app_loading(cors_origins=origins)
        try:
            r = TestClient(app, base_url=BASE).options("/v1/chat/completions", headers=preflight)
            assert r.status_code == status
            assert (r.headers.get("access-control-allow-origin") == "http://ui.example") == (status == 200)
        finally:
            never.set()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("headers,path,status,code", [
    # a web page's "simple" request: text/plain, cross-site, no preflight
    ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, "/v1/chat/completions", 403, "bad_origin"),
    ({"Content-Type": "text/plain"}, "/v1/chat/completions", 415, "unsupported_media_type"),
    ({"Content-Type": "text/plain"}, "/api/chat", 415, "unsupported_media_type"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "/api/chat", 415, "unsupported_media_type"),
    ({"Host": "evil.example:8080", "Content-Type": "application/json"}, "/v1/chat/completions", 403, "bad_host"),
    ({"Host": "evil.example:8080", "Content-Type": "application/json"}, "/api/chat", 403, "bad_host"),
    ({"Origin": "null", "Content-Type": "application/json"}, "/api/generate", 403, "bad_origin"),
    ({"Host": "127.0.0.1:9999", "Content-Type": "application/json"}, "/v1/completions", 403, "bad_host"),
    # a cross-site POST with no Content-Type (fetch with a Blob body): a browser sends its Origin
    ({"Origin": "http://evil.example"}, "/api/chat", 403, "bad_origin"),
    ({"Origin": "http://evil.example"}, "/v1/chat/completions", 403, "bad_origin"),
    # a page of the server's own origin still says what it sends
    ({"Origin": BASE}, "/api/generate", 415, "unsupported_media_type"),
    ({"Origin": BASE}, "/v1/chat/completions", 415, "unsupported_media_type"),
])
def test_requests_a_web_page_could_make_are_refused_before_any_work(headers, path, status, code):
    """...in the error shape of the API asked: ollama's under /api/, OpenAI's under /v1/."""
    from fastapi.testclient import TestClient

    app, never = app_loading()
    try:
        r = TestClient(app, base_url=BASE).post(path, content=b'{"messages": [], "prompt": "x"}', headers=headers)
        assert r.status_code == status
        if path.startswith("/api/"):
            error = r.json()
            assert set(error) == {"error"} and isinstance(error["error"], str), error
            assert ("Content-Type" in error["error"]) == (code == "unsupported_media_type")
        else:
            assert r.json()["error"]["code"] == code
    finally:
        never.set()


def test_a_post_with_neither_content_type_nor_origin_is_read_as_json():
    """A program's POST (litellm's Ollama provider sends no Content-Type): it passes the guard,
    and meets the models still loading; it is counted as no refusal."""
    from fastapi.testclient import TestClient

    app, never = app_loading()
    try:
        client = TestClient(app, base_url=BASE)
        chat = client.post("/api/chat", content=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
        assert "content-type" not in chat.request.headers
        assert (chat.status_code, chat.json()) == (503, {"error": "the models are still loading"})
        generate = client.post("/api/generate", content=b'{"model": "m", "prompt": "hi", "keep_alive": {"a": 1}}')
        assert generate.status_code == 400 and generate.json()["error"].startswith("keep_alive: ")   # read as JSON
        v1 = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}')
        assert v1.status_code == 503 and v1.json()["error"]["code"] == "loading"
        page = client.get("/metrics").text
        assert 'endpoint="refused"' not in page
    finally:
        never.set()


def test_dns_rebinding_cannot_read_answers_and_the_servers_own_origin_works():
    from fastapi.testclient import TestClient

    app, never = app_loading(cors_origins=("http://ui.example",), allowed_hosts=("box.lan",))
    try:
        client = TestClient(app, base_url=BASE)
        assert client.get("/v1/models", headers={"Host": "evil.example:8080"}).status_code == 403
        assert client.get("/api/tags", headers={"Host": "evil.example"}).status_code == 403
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models", headers={"Origin": BASE}).status_code == 200          # same origin
        assert client.get("/v1/models", headers={"Host": "localhost:8080", "Origin": "http://localhost:8080"}
                          ).status_code == 200
        assert client.get("/v1/models", headers={"Host": "[::1]:8080"}).status_code == 200
        assert client.get("/v1/models", headers={"Host": "box.lan:8080"}).status_code == 200   # --allowed-host
        assert client.get("/v1/models", headers={"Origin": "http://ui.example"}).status_code == 200
        assert client.get("/v1/models", headers={"Origin": "http://evil.example"}).status_code == 403
        r = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": BASE})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"   # through the guard
    finally:
        never.set()


def test_the_host_rule_follows_the_address_listened_on():
    from flylocal.front.serve.guard import HostRule

    loop = HostRule("127.0.0.1", 8080)
    assert all(loop(h) for h in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST", "127.0.0.1"))
    assert not any(loop(h) for h in ("evil.example:8080", "127.0.0.2:8080", "10.0.0.5:8080", "localhost:80",
                                     "", None, "127.0.0.1:80x", "localhost.:8080"))
    lan = HostRule("192.168.1.20", 8080, ("box.lan",))
    assert lan("192.168.1.20:8080") and lan("box.lan:8080") and not lan("127.0.0.1:8080") and not lan("evil:8080")
    wild = HostRule("0.0.0.0", 8080)
    assert wild("10.1.2.3:8080") and wild("localhost:8080") and not wild("evil.example:8080")
    six = HostRule("::", 8080)
    assert six("[fe80::1]:8080") and six("192.168.1.2:8080") and not six("rebind.example:8080")


def test_a_client_too_slow_to_send_its_request_is_closed():
    """Six slow-loris connections, each sending a header line now and then: all are closed once
    the request deadline passes, and the server still answers."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from flylocal.front.serve.guard import BoundedH11

    class Quick(BoundedH11):
        request_timeout = 1.5

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app, never = app_loading(port=port)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=Quick, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed, start = set(), time.monotonic()
        while len(closed) < len(slow) and time.monotonic() - start < 8:
            for i, s in enumerate(slow):
                if i in closed:
                    continue
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                    s.settimeout(0.05)
                    if s.recv(1) == b"":
                        closed.add(i)
                except (BrokenPipeError, ConnectionResetError):
                    closed.add(i)
                except socket.timeout:
                    pass
            time.sleep(0.2)
        assert len(closed) == len(slow) and time.monotonic() - start < 8
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503    # still serving
    finally:
        for s in slow:
            s.close()
        server.should_exit = True
        thread.join(timeout=10)
        never.set()


def test_an_api_key_is_required_where_given():
    from fastapi.testclient import TestClient

    app, never = app_loading(api_key="k1")
    try:
        client = TestClient(app, base_url=BASE)
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/health").status_code == 503             # open, and still loading
    finally:
        never.set()


def test_several_keys_each_a_partition_of_the_prompt_cache(tmp_path):
    """--api-key-file: any of its keys opens the server; each key (and each cache_salt within it)
    draws a partition of its own; --cache-share all or none, and the bad files and choices, one
    line each."""
    from fastapi.testclient import TestClient

    from flylocal.errors import FlylocalError
    from flylocal.front.serve.keys import Keys, read_key_file

    path = tmp_path / "keys"
    path.write_text("# the team\nk-ada\n\n  k-bob  \n")
    keys = read_key_file(path)
    assert keys == ["k-ada", "k-bob"]
    app, never = app_loading(api_keys=tuple(keys))
    try:
        client = TestClient(app, base_url=BASE)
        for given, status in (("k-ada", 200), ("k-bob", 200), ("k-eve", 401), ("", 401)):
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {given}"}).status_code == status
    finally:
        never.set()
    share = Keys(tuple(keys))
    ada, bob = (share.identify(f"Bearer {k}") for k in keys)
    assert share.share == "key" and ada != bob
    parts = {share.partition(ada, None), share.partition(bob, None), share.partition(ada, "t1"),
             share.partition(ada, "t2")}
    assert len(parts) == 4 and "" not in parts and None not in parts
    assert share.partition(ada, "t1") == Keys(tuple(keys)).partition(ada, "t1")     # stable across restarts
    one = Keys()
    assert one.share == "all" and one.partition(None, None) == "" and one.partition(None, "t1") not in ("", None)
    assert Keys(("k",), "all").partition("x", None) == "" and Keys(("k",), "none").partition("x", "t") is None
    with pytest.raises(FlylocalError, match="needs --api-key or --api-key-file"):
        Keys((), "key")
    (tmp_path / "empty").write_text("# nobody\n")
    for bad, said in ((tmp_path / "empty", "holds no key"), (tmp_path / "missing", "cannot read --api-key-file")):
        with pytest.raises(FlylocalError, match=said):
            read_key_file(bad)


@pytest.mark.parametrize("body,param", [
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
    ({"cache_salt": "x" * 2000}, "cache_salt"),
])
def test_a_bad_cache_salt_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("fields,param,start", [
    ({"drafter": "model"}, "drafter", "drafter model needs a draft model: start the server with --draft"),
    ({"drafter": "mla"}, "drafter", "drafter mla needs a draft model"),
    ({"k": 40}, "k", "k 40 verifies 41 rows per round; the server's --batch-size is 32"),
    # a server started with --fly-within-round: the window must fit one round's draft
    ({"fly_window": 1000000000}, "fly_window", "fly_window 1000000000 needs drafts of 1000000004 tokens"),
])
def test_settings_no_engine_can_run_name_their_own_field(fields, param, start):
    """A request's settings that cannot run are a 400 naming the field at fault once, in the
    request's terms: not `k` for a window too wide, nor a CLI flag with its dashes stripped."""
    from flylocal.decoding.verifiers import VerifierConfig
    from flylocal.decoding.verifiers.fly import FlyParams
    from flylocal.front.serve.app import Server

    within = VerifierConfig(fly=FlyParams(across=False))
    settings = request_settings(Settings(batch_size=32, verifiers=within), parse(ChatRequest, body(**fields)))
    with pytest.raises(ApiError) as e:
        Server.check_settings(one_slot(1), settings, 1)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(start) and e.value.message.count(param) == 1, e.value.message


def one_slot(slots: int):
    """A stand-in Server for check_settings (it reads nothing of it but the slot count given)."""
    from types import SimpleNamespace

    return SimpleNamespace(worker=SimpleNamespace(slots=slots))


@pytest.mark.parametrize("slots,k,refused", [(1, 511, False), (4, 511, True), (4, 128, True), (4, 127, False),
                                             (2, 255, False), (2, 256, True)])
def test_a_draft_verified_whole_must_fit_a_slots_share(slots, k, refused):
    """With N slots a round of each fits one decode only when k + 1 <= --batch-size / N: a longer
    given draft would be cut by company (or wait for ever to join), so it is a 400 naming k."""
    from flylocal.front.serve.app import Server

    settings = request_settings(Settings(batch_size=512), parse(ChatRequest, body(k=k)))
    if not refused:
        Server.check_settings(one_slot(slots), settings, slots)
        return
    with pytest.raises(ApiError) as e:
        Server.check_settings(one_slot(slots), settings, slots)
    bound = 512 // slots - 1
    assert e.value.status == 400 and e.value.param == "k" and f"at most {bound}" in e.value.message


@pytest.mark.parametrize("slots,window,refused", [(1, 31, False), (1, 32, True), (4, 127, False), (4, 128, True),
                                                  (4, 1000000000, True)])
def test_a_window_across_rounds_is_held_to_a_slots_share_like_k(slots, window, refused):
    """Across rounds (the default) a window needs no long draft (the request runs with the usual
    draft length), but it is held to what a round of a slot verifies, as k is: W + 1 rows of
    --batch-size / N, past which it is a 400 naming fly_window and its bound."""
    from flylocal.front.serve.app import Server

    batch = 32 if slots == 1 else 512
    settings = request_settings(Settings(batch_size=batch), parse(ChatRequest, body(fly_window=window)))
    assert settings.verifiers.fly.window == window and settings.draft_length == 8
    if not refused:
        Server.check_settings(one_slot(slots), settings, slots)
        return
    with pytest.raises(ApiError) as e:
        Server.check_settings(one_slot(slots), settings, slots)
    bound = batch // slots - 1
    assert e.value.status == 400 and e.value.param == "fly_window" and e.value.message.endswith(f"at most {bound}")
    # the same window under another verifier asks nothing of a round
    for other in (body(fly_window=window, verifier="strict"), body(fly_window=window, verifier="asd")):
        Server.check_settings(one_slot(slots), request_settings(Settings(batch_size=batch), parse(ChatRequest, other)),
                              slots)


@pytest.mark.parametrize("fields,refused", [
    ({"num_ctx": 8192, "num_gpu": 99, "num_thread": 4, "num_batch": 512, "num_keep": 24, "use_mmap": True,
      "use_mlock": False, "mirostat": 0, "mirostat_eta": 0.1, "mirostat_tau": 5.0, "tfs_z": 1, "keep_alive": "5m",
      "think": False}, None),
    ({"mirostat": 2}, "mirostat: 2; flylocal does not offer it"),
    ({"num_gpu": "all"}, "num_gpu: \"all\" is not a whole number"),
    ({"keep_alive": "soon"}, "keep_alive: \"soon\"; a duration"),
    ({"think": "high"}, "think: \"high\"; flylocal runs no thinking mode"),
    ({"num_gqa": 8, "nmu_ctx": 8192}, "flylocal does not support the field 'nmu_ctx'"),
])
def test_ollama_settings_open_webui_passes_to_an_openai_server_change_nothing_or_are_named(fields, refused):
    """Open WebUI's OpenAI path sends its users' advanced parameters at the top level, Ollama's
    among them: each is read as the Ollama dialect reads it in `options`, the loading hints kept
    to be logged once; one that would change the text is a 400 naming it."""
    if refused is None:
        req = parse(ChatRequest, body(**fields))
        assert req.ollama_hints == ("num_ctx", "num_gpu", "num_thread", "num_batch", "num_keep", "use_mmap",
                                    "use_mlock")
        assert request_settings(Settings(), req) == request_settings(Settings(), parse(ChatRequest, body()))
        return
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, body(**fields))
    assert e.value.status == 400 and e.value.message.startswith(refused), e.value.message


# ----- the Ollama dialect's fields and options -----

def ollama_request(raw: bytes, n_ctx: int = 1024):
    """An /api/generate body, parsed and turned into settings as the server does."""
    from flylocal.front.serve.fields import check_fields, parse_request
    from flylocal.front.serve.ollama import GenerateText, GenerateRequest
    from flylocal.front.serve.request import Refusal, settings_for

    req = parse_request(GenerateRequest, raw)
    check_fields(req, GenerateText.checked)
    try:
        return req, settings_for(req.body(), Settings(), n_ctx=n_ctx)
    except Refusal as e:
        raise ApiError(400, e.message, param=e.param) from None


@pytest.mark.parametrize("raw,field", [
    (b'{"options": {"seed": -Infinity}}', "options.seed: -Infinity"),    # was an OverflowError, a 500
    (b'{"options": {"seed": Infinity}}', "options.seed: Infinity"),
    (b'{"options": {"top_k": -Infinity}}', "options.top_k: -Infinity"),
    (b'{"options": {"seed": 1.5}}', "options.seed: 1.5"),                # was seed 1
    (b'{"options": {"seed": "3"}}', "options.seed"),                     # was seed 3
    (b'{"options": {"top_k": 2.5}}', "options.top_k: 2.5"),
    (b'{"options": {"temperature": "0.5"}}', "options.temperature"),
    (b'{"options": {"num_ctx": -5}}', "options.num_ctx: -5"),            # was accepted
    (b'{"options": {"num_ctx": 0}}', "options.num_ctx: 0"),
    (b'{"options": {"num_ctx": 512.5}}', "options.num_ctx: 512.5"),
    (b'{"options": {"num_gpu": "all"}}', "options.num_gpu: \"all\" is not a whole number"),   # a hint, typed
    (b'{"options": {"use_mmap": 1}}', "options.use_mmap: 1 is not true or false"),
    (b'{"options": {"mirostat": 2}}', "options.mirostat: 2; flylocal does not offer it (only 0)"),
    (b'{"options": {"mirostat": true}}', "options.mirostat: true"),
    (b'{"options": {"typical_p": 0.5}}', "options.typical_p: 0.5"),
    (b'{"options": {"tfs_z": 2}}', "options.tfs_z: 2"),
    (b'{"options": {"mirostat_eta": "fast"}}', "options.mirostat_eta: \"fast\" is not a number"),
    (b'{"options": {"temprature": 0}}', "options.temprature: no option of ollama's"),         # misspelt: named
    (b'{"options": {"num_predict": 1.5}}', "options.num_predict: 1.5"),
    (b'{"options": {"repeat_last_n": -2}}', "options.repeat_last_n: -2"),
    (b'{"keep_alive": {"a": 1}}', "keep_alive: {\"a\": 1}; a duration"),  # was "Input should be a valid string"
    (b'{"keep_alive": "soon"}', "keep_alive: \"soon\"; a duration"),
    (b'{"keep_alive": true}', "keep_alive: true; a duration"),
    (b'{"template": "{{ .Prompt }}"}', "template: "),                      # was ignored
    (b'{"context": [1, "x"]}', "context.1"),
    (b'{"context": [1, true]}', "context.1"),
    (b'{"optoins": {"temperature": 0}}', "flylocal does not support the field 'optoins'"),    # were ignored
    (b'{"temperature": 0}', "temperature: an option; ollama takes it in \"options\""),
    (b'{"seed": 3}', "seed: an option"),
    (b'{"k": 3}', "flylocal does not support the field 'k'"),      # no option of ollama's: not pointed there
    (b'{"width": 512}', "flylocal does not support the field 'width'"),
    (b'{"top_logprobs": 21, "logprobs": true}', "top_logprobs: 21"),
])
def test_ollama_fields_flylocal_cannot_honour_are_400_naming_them(raw, field):
    with pytest.raises(ApiError) as e:
        ollama_request(raw)
    assert e.value.status == 400 and e.value.message.startswith(field), e.value.message


@pytest.mark.parametrize("message,field", [
    ({"role": "user", "content": "hi", "nmae": "x"}, "messages.0.nmae"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}, "extra": 1}]},
     "messages.0.tool_calls.0.extra"),
])
def test_an_ollama_message_with_a_key_it_does_not_know_is_refused_by_name(message, field):
    import json

    from flylocal.front.serve.fields import parse_request
    from flylocal.front.serve.ollama import ChatRequest as OllamaChat

    with pytest.raises(ApiError) as e:
        parse_request(OllamaChat, json.dumps({"messages": [message]}).encode())
    assert e.value.status == 400 and e.value.param == field, e.value.message
    # What ollama's and LangChain's clients send in a conversation is taken.
    sent = [{"role": "assistant", "content": "", "thinking": "", "images": [],
             "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "f", "arguments": {}, "index": 0}}]},
            {"role": "tool", "content": "4", "tool_name": "f", "tool_call_id": "c1"}]
    turns = [m.turn() for m in parse_request(OllamaChat, json.dumps({"messages": sent}).encode()).messages]
    assert turns[1]["tool_call_id"] == "c1" and turns[0]["tool_calls"][0]["function"]["name"] == "f"


def test_ollama_values_clients_send_are_honoured():
    """keep_alive as a duration or seconds; num_ctx within the server's context (whole, even as
    2048.0); seed -1 (ollama's random seed); repeat_last_n 0 (ollama's "no penalties")."""
    for keep_alive in (b'"5m"', b'"1h30m"', b'"-1"', b'"0"', b'"300"', b"-1", b"0", b"300", b"2.5", b"null"):
        ollama_request(b'{"keep_alive": ' + keep_alive + b'}')
    ollama_request(b'{"truncate": true, "shift": false, "logprobs": false}')        # ollama's own fields
    req, s = ollama_request(b'{"template": "", "context": [], "options": {"num_ctx": 1024.0, "seed": 7.0}}')
    assert s.sampling.seed == 7 and type(s.sampling.seed) is int and req.context == []
    assert ollama_request(b'{"options": {"seed": -1}}', 1024)[1].sampling.seed is None
    _, s = ollama_request(b'{"options": {"repeat_last_n": 0, "repeat_penalty": 1.3, "presence_penalty": 0.5}}')
    assert not s.sampling.penalizes
    _, s = ollama_request(b'{"options": {"repeat_last_n": -1, "repeat_penalty": 1.3}}')
    assert s.sampling.repeat_last_n == 1024 and s.sampling.penalizes



def test_serve_refuses_its_own_k_past_a_slots_share_before_loading():
    """`flylocal serve --parallel 4 --k 200`: one line at start naming the bound, the slots and
    the way out; --parallel auto instead takes no more slots than the draft length leaves room
    for (flylocal.loader.load)."""
    from flylocal.errors import OptionError
    from flylocal.loader import check

    with pytest.raises(OptionError) as e:
        check(Settings(k=200, parallel=4))
    assert str(e.value) == ("--k 200 verifies 201 rows per round; --batch-size 512 shared by 4 slots (--parallel) "
                            "gives each 128: give --k at most 127, or a larger --batch-size")
    check(Settings(k=200, parallel=0))          # auto: fitted when loading
    check(Settings(k=127, parallel=4))


# ----- the Responses API's fields -----

@pytest.mark.parametrize("fields,words", [
    ({"text": {"format": {"type": "json_object", "schema": {"type": "object"}}}}, "text.format: schema: type json_object takes none"),
    ({"text": {"format": {"type": "text", "schema": {"type": "object"}}}}, "text.format: schema: type text takes none"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format: type json_schema needs schema"),
    ({"metadata": {f"k{i}": "v" * 250_000 for i in range(15)}}, "metadata: the value of \"k0\" has 250000 characters"),
    ({"user": "u" * 100_000}, "user: 100000 characters; at most 512"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary"),
    ({"top_logprobs": 21}, "top_logprobs: 21"),
])
def test_responses_fields_that_would_be_ignored_or_kept_unbounded_are_refused_by_name(fields, words):
    import json

    from flylocal.front.serve.fields import parse_request
    from flylocal.front.serve.responses import ResponsesRequest

    with pytest.raises(ApiError) as e:
        parse_request(ResponsesRequest, json.dumps({"input": "hi", **fields}).encode())
    assert e.value.status == 400 and e.value.message.startswith(words), e.value.message


@pytest.mark.parametrize("item,words", [
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0].text: a input_text part's text must be a string"),
    ({"role": "user", "content": [{"type": "input_text", "text": 3}]}, "input[0].content[0].text"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0]: flylocal takes text"),
    ({"role": "user", "content": [{"type": "input_text", "text": "a", "cache": 1}]}, "input[0].content[0].cache"),
    ({"type": "function_call_output", "call_id": "c", "output": {"a": 1}}, "input[0].output: a string or a list"),
    ({"role": "user", "content": "hi", "nmae": "x"}, "input[0].nmae"),
])
def test_an_input_item_refusal_names_what_is_wrong_where_it_is(item, words):
    from flylocal.errors import FlylocalError
    from flylocal.front.serve.responses import turns_of

    with pytest.raises(FlylocalError) as e:
        turns_of([item])
    assert str(e.value).startswith(words), str(e.value)
