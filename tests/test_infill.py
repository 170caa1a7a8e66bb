"""Fill in the middle through the three doors an editor uses (Ollama's `suffix` on
/api/generate, OpenAI's `suffix` on /v1/completions, llama-server's /infill with and without
`input_extra`), and llama-server's small endpoints (/tokenize, /detokenize, /apply-template,
/props, /slots).

No model of the registry has FIM tokens, so the FIM model here is SmolLM2 with FIM ids in its
GGUF (tests/fim_model.py). SmolLM2 itself has none, and gets the 400 that says so."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import SMOL, model_path
from fim_model import MID, PRE, REP, SUF, with_fim
from test_server import served

pytestmark = pytest.mark.slow      # real models behind real servers

BEFORE = "def area(width, height):\n    \"\"\"The area of a width by height rectangle.\"\"\"\n    return "
AFTER = "\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"


@pytest.fixture(scope="module")
def fim_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    with_fim(model_path(SMOL), out)
    return out


@pytest.fixture(scope="module")
def server(fim_path):
    yield from served("--target", str(fim_path), "--ctx", "1024", "--verifier", "strict", "--batch-size", "64")


@pytest.fixture(scope="module")
def plain():
    yield from served("--target", SMOL, "--ctx", "1024")


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def ids_of(url: str, text: str) -> list[int]:
    return post(url, "/tokenize", {"content": text, "parse_special": False})["tokens"]


def test_the_fim_tokens_are_found_as_llama_cpp_finds_them(fim_path):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(fim_path, RuntimeConfig(n_ctx=256))
    try:
        assert (rt.fim.pre, rt.fim.suf, rt.fim.mid, rt.fim.rep, rt.fim.sep) == (PRE, SUF, MID, REP, None)
        assert rt.fim.usable
    finally:
        rt.close()


def test_infill_builds_the_prompt_as_llama_server_does(server, fim_path):
    """PSM order, with a batch of 64: input_extra first (the repository marker, each file after
    a snippet line, this model having no file separator), no BOS (SmolLM2 adds none), the
    prefix's last 48 tokens, the prompt, the suffix's first 16 less the prompt and two."""
    from flylocal.front.serve.request import Body, Infill, infilled
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(fim_path, RuntimeConfig(n_ctx=1024, n_batch=64))
    try:
        def ids(text):
            return rt.tokenize(text, add_special=False).tolist()

        fill = Infill(BEFORE * 3, AFTER * 3, "width", (("shapes.py", "SIDE = 3\n"),))
        prompt = ids("width")
        want = ([REP] + ids("myproject\n") + ids("\n\n--- snippet ---\n\n") + ids("SIDE = 3\n") + [PRE]
                + ids(BEFORE * 3)[-48:] + prompt + [SUF] + ids(AFTER * 3)[:16 - 2 - len(prompt)] + [MID])
        assert infilled(rt, Body(infill=fill)).tolist() == want
        assert infilled(rt, Body(infill=Infill("a", "b"))).tolist() == [PRE] + ids("a") + [SUF] + ids("b") + [MID]
    finally:
        rt.close()
    out = post(server, "/infill", {"input_prefix": BEFORE * 3, "input_suffix": AFTER * 3, "prompt": "width",
                                   "n_predict": 4, "input_extra": [{"filename": "shapes.py", "text": "SIDE = 3\n"}]})
    assert out["tokens_evaluated"] == len(want)
    # the prompt the server evaluated, handed back by Ollama's context: the same ids
    generate = post(server, "/api/generate", {"model": "smollm2-fim", "prompt": BEFORE, "suffix": AFTER,
                                              "stream": False, "options": {"num_predict": 4}})
    n_prompt = len(generate["context"]) - generate["eval_count"]
    assert generate["context"][:n_prompt] == [PRE] + ids_of(server, BEFORE) + [SUF] + ids_of(server, AFTER)[:14] + [MID]


def test_three_doors_give_the_same_middle(server):
    """Ollama's suffix, OpenAI's suffix and /infill (no extra) fill the same middle, greedy."""
    ollama = post(server, "/api/generate", {"model": "smollm2-fim", "prompt": BEFORE, "suffix": AFTER,
                                            "stream": False, "options": {"num_predict": 12}})
    openai = post(server, "/v1/completions", {"prompt": BEFORE, "suffix": AFTER, "max_tokens": 12})
    infill = post(server, "/infill", {"input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 12})
    assert ollama["response"] == openai["choices"][0]["text"]
    assert openai["usage"]["prompt_tokens"] == len(ollama["context"]) - ollama["eval_count"]
    # /infill adds llama-server's repository marker: a longer prompt, its own middle
    assert infill["tokens_evaluated"] == openai["usage"]["prompt_tokens"] + 1 + len(ids_of(server, "myproject\n"))
    assert infill["stop"] is True and infill["stop_type"] in ("eos", "limit") and infill["tokens_predicted"] <= 12


def test_infill_streams_and_selects_fields(server):
    r = httpx.post(server + "/infill", timeout=120, json={
        "input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 8, "stream": True,
        "response_fields": ["content", "timings/predicted_n"], "samplers": ["top_k", "temperature"],
        "cache_prompt": True, "t_max_predict_ms": 1000})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert all(set(c) <= {"content", "timings/predicted_n"} for c in chunks)
    whole = post(server, "/infill", {"input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 8})
    assert "".join(c.get("content", "") for c in chunks) == whole["content"]
    assert chunks[-1]["timings/predicted_n"] == whole["tokens_predicted"]


def test_a_model_without_fim_tokens_says_so(plain):
    for path, body, param in (("/infill", {"input_prefix": "a", "input_suffix": "b"}, "input_suffix"),
                              ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix")):
        r = httpx.post(plain + path, json=body, timeout=60)
        assert r.status_code == 400 and "has no fill-in-the-middle tokens" in r.text, r.text
        if path == "/v1/completions":
            assert r.json()["error"]["param"] == param
    r = httpx.post(plain + "/api/generate", json={"model": SMOL, "prompt": "a", "suffix": "b", "stream": False})
    assert r.status_code == 400 and "has no fill-in-the-middle tokens" in r.json()["error"]


def test_the_small_endpoints_answer_in_llama_servers_shapes(plain):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=256))
    try:
        text = "Hello <|im_end|> wörld"
        assert post(plain, "/tokenize", {"content": text})["tokens"] == \
            rt.tokenize(text, add_special=False, parse_special=True).tolist()          # specials parsed, as llama-server
        assert post(plain, "/tokenize", {"content": text, "parse_special": False})["tokens"] == \
            rt.tokenize(text, add_special=False, parse_special=False).tolist()
        pieces = post(plain, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
        joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
        assert joined == text.encode()             # a piece that is part of a character comes as its bytes
        ids = [p["id"] for p in pieces]
        assert post(plain, "/detokenize", {"tokens": ids})["content"] == text
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert post(plain, "/apply-template", {"messages": messages})["prompt"] == rt.format_chat(messages)
        assert post(plain, "/detokenize", {"tokens": [10 ** 9]}, 400)["error"]["type"] == "invalid_request_error"
    finally:
        rt.close()
    props = httpx.get(plain + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 1024 and props["total_slots"] >= 1
    assert props["chat_template"] and props["model_alias"] == SMOL
    assert httpx.post(plain + "/props", json={}).status_code == 501
    slots = httpx.get(plain + "/slots").json()
    assert len(slots) == props["total_slots"] and {"id", "n_ctx", "is_processing"} <= set(slots[0])


def test_slots_can_be_switched_off():
    gen = served("--target", SMOL, "--ctx", "256", "--no-slots")
    url = next(gen)
    try:
        r = httpx.get(url + "/slots")
        assert r.status_code == 501 and "--slots" in r.json()["error"]["message"]
    finally:
        gen.close()
