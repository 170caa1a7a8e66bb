"""The contracts written down (docs/design.md, "Contracts") hold for parts written against them
alone: a drafter in one small file (tests/drafter_repeat.py) and an API dialect in another
(tests/dialect_plain.py), each plugged in with nothing else changed."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_repeat import RepeatLast
from fake_backend import FakeLM, FakeTarget, greedy
from flylocal.decoding.drafters import NoDraft
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.strict import Strict

LM = FakeLM(seed=11, n_vocab=12, eog=(0,), p_eog=0.02, p_peaked=0.7)    # few tokens, peaked: repeats happen


def test_a_drafter_written_against_the_contract_alone_is_exact_under_strict():
    """On 300 random prompts, strict with RepeatLast gives plain greedy decoding's tokens and stop,
    and the engine called every hook as the contract says: begin once a request, observe with
    counts that add up to the stats, end with the output."""
    rng = np.random.default_rng(0)
    accepted = 0
    for seed in range(300):
        prompt = rng.integers(1, LM.n_vocab, size=int(rng.integers(1, 12))).astype(np.int32)
        n_ctx, max_tokens, k = len(prompt) + int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(0, 9))
        drafter = RepeatLast()
        gen = Engine(FakeTarget(LM, n_ctx), drafter, Strict(), EngineConfig(max_tokens=max_tokens, k=k)).generate(prompt)
        gen.run()
        expected, stop = greedy(LM, prompt, max_tokens, n_ctx)
        assert (gen.tokens, gen.stats.stop) == (expected, stop), f"seed {seed}"
        assert drafter.requests == 1 and drafter.outputs == [expected]
        assert (drafter.verified, drafter.accepted) == (gen.stats.drafted, gen.stats.accepted), f"seed {seed}"
        accepted += drafter.accepted
    assert accepted > 100               # the drafter was right often enough to test rollback and commit


@pytest.mark.slow
def test_the_drafter_is_exact_on_a_real_model(smol):
    """In the exact build, strict with RepeatLast is plain greedy decoding on SmolLM2."""
    ids = smol.tokenize("Count down: 9 9 9 9 8 8 8 8 7 7 7 7 6 6 6 6", add_special=True)
    smol.reset()
    plain = generate_all(Engine(smol, NoDraft(), Strict(), EngineConfig(max_tokens=40, k=0)), ids)[0]
    smol.reset()
    drafter = RepeatLast()
    tokens, stats, _ = generate_all(Engine(smol, drafter, Strict(), EngineConfig(max_tokens=40, k=3)), ids)
    assert tokens == plain
    assert stats.drafted > 0 and drafter.accepted == stats.accepted


BASE = "http://127.0.0.1:8080"        # where the application listens (its Host rule)


@pytest.mark.slow
def test_a_dialect_written_against_the_server_alone_answers_as_the_others_do():
    """The plain-text dialect, added beside OpenAI's and Ollama's, answers with the same text as
    /v1/completions for the same prompt (strict, so the text is the target's own), ends with
    the same finish reason and token count, and refuses bad requests in its own shape."""
    import dialect_plain
    from fastapi.testclient import TestClient

    from conftest import SMOL
    from flylocal.front.serve import DIALECTS, create_app
    from flylocal.loader import load
    from flylocal.session import Session
    from flylocal.settings import Settings

    settings = Settings(target=SMOL, drafter="pld", verifier="strict", k=4, threads=1, ctx=512)
    app = create_app(lambda: Session(load(settings)), settings, dialects=DIALECTS + (dialect_plain,))
    prompt = "The days of the week are Monday, Tuesday,"
    with TestClient(app, base_url=BASE) as client:
        for _ in range(600):                              # the models load on the worker thread
            if client.get("/health").status_code == 200:
                break
            __import__("time").sleep(0.1)
        plain = client.post("/plain", json={"prompt": prompt, "max_tokens": 24})
        openai = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
        assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/plain")
        text, _, last = plain.text.rstrip("\n").rpartition("\n")
        assert text == openai["choices"][0]["text"] and text
        finish, tokens = openai["choices"][0]["finish_reason"], openai["usage"]["completion_tokens"]
        assert last == f"[{finish}, {tokens} tokens]"
        unknown = client.post("/plain", json={"prompt": prompt, "temperature": 2})
        assert unknown.status_code == 400 and "temperature" in unknown.text
        zero = client.post("/plain", json={"prompt": prompt, "max_tokens": 0})
        assert zero.status_code == 400 and "max_tokens" in zero.text


def strict_json(text: str):
    """JSON as the standard has it: no Infinity, -Infinity or NaN (Python's reader takes them)."""
    import json

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_a_non_finite_stat_is_valid_json_in_every_dialect():
    """ASD with an unbounded budget leaves an infinite budget: every dialect's answer, whole and
    streamed, is still JSON (the budget left is null), in the same report."""
    import dataclasses

    from fastapi.testclient import TestClient

    from conftest import SMOL
    from flylocal.decoding.verifiers.asd import AsdParams
    from flylocal.front.serve import create_app
    from flylocal.loader import load
    from flylocal.session import Session
    from flylocal.settings import Settings

    base = Settings(target=SMOL, drafter="pld", verifier="asd", k=4, threads=1, ctx=512, max_tokens=8)
    settings = dataclasses.replace(base, verifiers=dataclasses.replace(base.verifiers, asd=AsdParams(budget=float("inf"))))
    app = create_app(lambda: Session(load(settings)), settings)
    chat = {"messages": [{"role": "user", "content": "Count to five."}]}
    with TestClient(app, base_url=BASE) as client:
        for _ in range(600):                              # the models load on the worker thread
            if client.get("/health").status_code == 200:
                break
            __import__("time").sleep(0.1)
        reports = []
        for path, body, report in (
                ("/v1/chat/completions", chat, lambda r: r["usage"]["flylocal"]),
                ("/v1/completions", {"prompt": "Count to five:"}, lambda r: r["usage"]["flylocal"]),
                ("/v1/responses", {"input": "Count to five."}, lambda r: r["usage"]["flylocal"]),
                ("/api/chat", chat | {"model": SMOL}, lambda r: r["flylocal"]),
                ("/api/generate", {"model": SMOL, "prompt": "Count to five:"}, lambda r: r["flylocal"])):
            whole = client.post(path, json=body | {"stream": False})
            assert whole.status_code == 200, (path, whole.text)
            reports.append(report(strict_json(whole.text)))
            with client.stream("POST", path, json=body | {"stream": True} |
                               ({"stream_options": {"include_usage": True}} if path.startswith("/v1/c") else {})) as s:
                assert s.status_code == 200
                lines = [line for line in s.iter_lines() if line.strip()]
            payloads = [line.removeprefix("data: ") for line in lines if not line.startswith("event:")]
            parsed = [strict_json(p) for p in payloads if p != "[DONE]"]
            last = [p for p in parsed if report_of(p) is not None][-1]
            reports.append(report_of(last))
        assert len(reports) == 10
        assert all(r["verifier"] == "asd" and r["budget_left"] is None for r in reports), reports


def report_of(payload: dict) -> dict | None:
    """flylocal's report in a streamed payload of any dialect, where it has one."""
    if isinstance(payload.get("usage"), dict):
        return payload["usage"].get("flylocal")
    response = payload.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        return response["usage"]["flylocal"]
    return payload.get("flylocal") if isinstance(payload.get("flylocal"), dict) and "verifier" in payload["flylocal"] \
        else None
