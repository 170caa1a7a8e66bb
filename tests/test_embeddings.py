"""Embeddings: the embedding context on real models (flylocal.llama.embedding), and
/v1/embeddings, /api/embed and /api/embeddings on `flylocal serve`, driven by the clients that
use them (openai, LangChain's OpenAIEmbeddings and OllamaEmbeddings, the ollama package).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from conftest import GEMMA, SMOL, model_path
from test_server import free_port, served, start, stop, wait_ready

pytestmark = pytest.mark.slow      # real models

KEY = "embeddings-key"
CTX = 256
NEAR = ("The cat sat on the mat.", "A cat was sitting on the rug.")
FAR = "Quarterly tax filings are due in April."


@pytest.fixture(scope="module")
def embedder():
    from flylocal.llama.config import RuntimeConfig
    from flylocal.llama.embedding import Embedder
    from flylocal.llama.runtime import Runtime

    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=CTX, n_threads=1))
    e = Embedder(rt.model, rt.vocab, CTX, threads=1)
    yield rt, e
    e.close()
    rt.close()


def test_vectors_are_unit_length_and_similar_texts_score_closer(embedder):
    _, e = embedder
    v = e.embed([e.tokenize(t) for t in (*NEAR, FAR)])
    assert v.shape == (3, e.n_embd)
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] and v[0] @ v[1] > v[1] @ v[2]


def test_an_input_embeds_the_same_whatever_shares_its_request(embedder):
    _, e = embedder
    first = [e.tokenize(t) for t in NEAR]
    long = e.tokenize("The committee met on Tuesday to discuss the budget for the coming year. " * 8)
    assert len(long) > 90
    alone = np.stack([e.embed([ids])[0] for ids in first])
    # Bit for bit: beside a long input (packed into one decode, the cosine was 0.9995), beside
    # others of the same lengths, and in the other order.
    assert np.array_equal(e.embed([*first, long])[:2], alone)
    assert np.array_equal(e.embed([long, *first])[1:], alone)
    assert np.array_equal(e.embed([*first, e.tokenize("x " * 40)])[:2], e.embed([*first, e.tokenize("y " * 40)])[:2])


def test_a_long_input_goes_in_pieces_that_give_the_vector_one_decode_gives(embedder):
    """A causal model reads an input in pieces of the token budget each step is sent, so that a
    server runs other work between two or stops there when the client leaves, however long
    the input; in the exact build the pieces' vector is bit for bit one decode's. A job stopped
    between two pieces leaves nothing behind: the next embedding is a fresh one's."""
    from flylocal.llama.embedding import Embedder

    rt, e = embedder
    assert e.causal
    whole = Embedder(rt.model, rt.vocab, CTX, threads=1, piece=CTX)
    try:
        ids = e.tokenize("The committee met on Tuesday to discuss the budget for the coming year. " * 20)[:CTX]
        assert len(ids) == CTX
        steps, sends = e.steps([ids]), 0
        next(steps)
        try:
            while True:
                steps.send(32)              # what a round's prompt chunk takes beside generations
                sends += 1
        except StopIteration as done:
            pieces = done.value
        assert sends == CTX // 32 - 1       # 8 pieces of 32, a step each: a yield between every two
        one = whole.embed([ids])
        assert np.array_equal(pieces, one)
        stopped = e.steps([ids])
        next(stopped)
        stopped.send(32)
        stopped.close()                     # the client left: no more pieces
        assert np.array_equal(e.embed([ids]), one)
    finally:
        whole.close()


def test_an_input_read_whole_stops_within_its_decode_once_cancelled(embedder):
    """A model that looks both ways (an encoder) reads an input whole, one decode however long;
    llama.cpp asks the job's cancel flag between the graph's nodes, so a client that leaves
    stops it within that decode, and the embedder serves the next job as a fresh one. SmolLM2
    read as an encoder is read (`whole`) stands in for one: none is to be had offline."""
    import threading

    from flylocal.errors import FlylocalError
    from flylocal.llama.embedding import Embedder

    rt, e = embedder
    encoder = Embedder(rt.model, rt.vocab, CTX, threads=1, whole=True)
    try:
        assert not encoder.causal and encoder.piece == CTX
        ids = e.tokenize("The committee met on Tuesday to discuss the budget for the coming year. " * 20)[:CTX]
        vector = encoder.embed([ids])
        assert float(vector[0] @ e.embed([ids])[0]) > 0.9999        # llama.cpp's pooling, the same mean
        cancel = threading.Event()
        cancel.set()
        steps = encoder.steps([ids], cancel)
        next(steps)
        with pytest.raises(FlylocalError, match="cancelled"):
            steps.send(None)
        assert np.array_equal(encoder.embed([ids]), vector)
    finally:
        encoder.close()


def test_embeddings_leave_the_generation_context_as_it_was(embedder):
    rt, e = embedder
    ids = rt.tokenize("The capital of France is")
    rt.reset()
    before = rt.decode(ids, logits_from=len(ids) - 1).copy()
    cached = rt.tokens.copy()
    e.embed([e.tokenize("something else entirely")] * 3)
    assert np.array_equal(rt.tokens, cached)
    rt.truncate(len(ids) - 1)
    after = rt.decode(ids[-1:], logits_from=0)
    assert np.array_equal(before[0], after[0])


def test_an_input_longer_than_the_context_names_its_place(embedder):
    from flylocal.llama.embedding import TooLong

    _, e = embedder
    with pytest.raises(TooLong) as caught:
        e.embed([e.tokenize("short"), np.ones(e.n_ctx + 1, dtype=np.int32)])
    assert caught.value.index == 1 and "input 1" in str(caught.value)


@pytest.fixture(scope="module")
def server():
    yield from served("--target", SMOL, "--api-key", KEY, "--ctx", str(CTX))


def test_openai_embeddings_float_and_base64_agree(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)
    made = client.embeddings.create(model=SMOL, input=[*NEAR, FAR])      # the client asks for base64
    v = np.array([d.embedding for d in made.data])
    assert [d.index for d in made.data] == [0, 1, 2] and made.usage.prompt_tokens > 0
    assert v[0] @ v[1] > v[0] @ v[2]
    one = np.array(client.embeddings.create(model=SMOL, input=NEAR[0]).data[0].embedding, dtype=np.float32)
    assert np.abs(one - v[0]).max() < 1e-5
    raw = httpx.post(server + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": SMOL, "input": NEAR[0], "encoding_format": "float"}).json()
    assert np.array_equal(np.array(raw["data"][0]["embedding"], dtype=np.float32), one)     # the same text, the same vector
    packed = httpx.post(server + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                        json={"input": NEAR[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), one)


def test_openai_embeddings_refusals_name_the_field(server):
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model=SMOL, input=["short", "word " * (CTX + 10)])
    assert "input[1]" in e.value.message and e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model=SMOL, input="hi", dimensions=8)
    assert "dimensions" in e.value.message
    lone = httpx.post(server + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}",
                                                          "Content-Type": "application/json"},
                      content=b'{"input": ["fine", "a lone \\ud800 surrogate"]}')    # was a 500
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "input"
    assert lone.json()["error"]["message"].startswith("input[1]: the text is not valid Unicode")
    ollama = httpx.post(server + "/api/embed", headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                        content=b'{"model": "%s", "input": "\\udc00"}' % SMOL.encode())
    assert ollama.status_code == 400 and ollama.json()["error"].startswith("input[0]: the text is not valid Unicode")
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model=SMOL, input=[[1, 2, 10 ** 9]])
    assert "vocabulary" in e.value.message
    huge = httpx.post(server + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                      json={"input": [[99999999999999999999]]})          # was a 500: OverflowError
    assert huge.status_code == 400 and "99999999999999999999" in huge.json()["error"]["message"]
    with pytest.raises(NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_token_arrays_embed_as_their_text(server, embedder):
    _, e = embedder
    ids = e.tokenize(NEAR[0]).tolist()
    auth = {"Authorization": f"Bearer {KEY}"}
    by_ids = httpx.post(server + "/v1/embeddings", headers=auth, json={"input": [ids, ids]}).json()["data"]
    by_text = httpx.post(server + "/v1/embeddings", headers=auth, json={"input": NEAR[0]}).json()["data"]
    assert np.abs(np.array(by_ids[0]["embedding"]) - np.array(by_text[0]["embedding"])).max() < 1e-5


def test_ollama_and_langchain_clients_embed(server):
    import ollama
    from langchain_ollama import OllamaEmbeddings
    from langchain_openai import OpenAIEmbeddings

    auth = {"Authorization": f"Bearer {KEY}"}
    client = ollama.Client(host=server, headers=auth, timeout=120)
    made = client.embed(model=SMOL, input=[*NEAR, FAR])
    v = np.array(made.embeddings)
    assert v.shape[0] == 3 and v[0] @ v[1] > v[0] @ v[2] and made.prompt_eval_count > 0
    old = client.embeddings(model=f"{SMOL}:latest", prompt=NEAR[0]).embedding
    assert np.abs(np.array(old) - v[0]).max() < 1e-5
    long = "word " * (CTX + 10)
    assert len(client.embed(model=SMOL, input=long).embeddings) == 1            # truncate: ollama's default
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=SMOL, input=long, truncate=False)
    assert e.value.status_code == 400 and "input[0]" in e.value.error
    assert len(client.embed(model=SMOL, input=NEAR[0], keep_alive="5m").embeddings) == 1
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=SMOL, input=NEAR[0], keep_alive="soon")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error
    lc_ollama = OllamaEmbeddings(model=SMOL, base_url=server, client_kwargs={"headers": auth})
    assert np.abs(np.array(lc_ollama.embed_query(NEAR[0])) - v[0]).max() < 1e-5
    lc_openai = OpenAIEmbeddings(model=SMOL, base_url=server + "/v1", api_key=KEY, check_embedding_ctx_length=False,
                                 max_retries=0)
    docs = np.array(lc_openai.embed_documents(list(NEAR)))
    assert np.abs(docs - v[:2]).max() < 1e-5


def test_embedding_model_names_another_model(tmp_path):
    from openai import NotFoundError, OpenAI

    port = free_port()
    proc = start("--target", SMOL, "--embedding-model", GEMMA, "--ctx", str(CTX), port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        client = OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
        models = client.models.list().data
        assert [(m.id, m.model_extra["flylocal"]["role"]) for m in models] == [(SMOL, "target"), (GEMMA, "embedding")]
        assert client.models.retrieve(GEMMA).model_extra["flylocal"]["role"] == "embedding"
        # Ollama's lists say the same, and show either model.
        import ollama

        local = ollama.Client(host=url, timeout=120)
        assert [m.model for m in local.list().models] == [SMOL, GEMMA]
        tags = httpx.get(url + "/api/tags").json()["models"]
        assert [(m["name"], m["flylocal"]["role"]) for m in tags] == [(SMOL, "target"), (GEMMA, "embedding")]
        assert [m.model for m in local.ps().models] == [SMOL, GEMMA]
        shown = local.show(GEMMA)
        assert shown.capabilities == ["embedding"] and shown.modelinfo["general.architecture"].startswith("gemma")
        assert local.show(f"{SMOL}:latest").capabilities == ["completion", "tools"]
        with pytest.raises(ollama.ResponseError) as e:
            local.chat(model=GEMMA, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 400 and "computes embeddings" in e.value.error
        made = client.embeddings.create(model=GEMMA, input=list(NEAR))
        assert len(made.data[0].embedding) == 640                    # Gemma-3-270M's width, not SmolLM2's 576
        with pytest.raises(NotFoundError):
            client.embeddings.create(model=SMOL, input="hi")
    finally:
        stop(proc)
