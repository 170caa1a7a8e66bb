"""Embeddings behind `flylocal serve` (docs/serving.md, "Embeddings"): OpenAI's /v1/embeddings,
and Ollama's /api/embed and its older /api/embeddings.

Vectors come from the target, in an embedding context of its own (flylocal.llama.embedding),
or from the model `--embedding-model` names; the job runs on the worker thread in turn with
the generations (flylocal.front.serve.worker.Call), so the queue's bound holds for it too.
An input longer than the embedding context is a 400 naming it (Ollama's `truncate`, its
default, cuts it instead).
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from flylocal.errors import FlylocalError
from flylocal.front.serve.app import ApiError, Compute, Endpoint, Exchange, Server
from flylocal.front.serve.ollama import Ollama
from flylocal.front.serve.ollama_options import checked_keep_alive, read_options

MAX_INPUTS = 2048          # inputs in one request (OpenAI's own bound)


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def some(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and len(v) > MAX_INPUTS:
            raise ValueError(f"{len(v)} inputs; at most {MAX_INPUTS} a request")
        return v


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None          # checked as on /api/chat: the model stays loaded for the server's life

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, v):
        return checked_keep_alive(v)

    @field_validator("input")
    @classmethod
    def bounded(cls, v):
        if isinstance(v, list) and len(v) > MAX_INPUTS:
            raise ValueError(f"{len(v)} inputs; at most {MAX_INPUTS} a request")
        return v


class OllamaEmbeddingsRequest(BaseModel):          # /api/embeddings, ollama's older endpoint
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: Any = None

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, v):
        return checked_keep_alive(v)


def check_options(server: Server, options: dict | None) -> int | None:
    """Ollama's options on an embedding request, checked as a generation's are (a vector is
    not sampled, so the sampling options change nothing here); the num_ctx wished for, if
    any: inputs are cut to it, within the embedding context, when truncating."""
    given = read_options(options, server.settings.ctx)
    server.hint(given.hints)
    return given.num_ctx


def vectors(server: Server, texts: list, truncate_to: int | None, param: str) -> Compute:
    """The job computing the unit vectors of `texts` (strings, or token-id lists): it returns
    them, the tokens they took and the seconds it ran; inputs longer than the context cut to
    `truncate_to` when given, refused (400 naming the input) otherwise. It runs a decode at a
    time between the generations' rounds, and stops when the client goes away."""
    for i, t in enumerate(texts):
        if isinstance(t, str):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:         # JSON's "\ud800": a lone surrogate no text holds
                raise ApiError(400, f"{param}[{i}]: the text is not valid Unicode (a lone surrogate at character "
                                    f"{e.start})", param=param) from None

    cancel = threading.Event()

    def work(session):
        e = session.models.embeddings(server.embedding_model)
        started = time.perf_counter()
        inputs = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):          # checked as Python ints: one past int64 is no OverflowError
                bad = next((v for v in t if not 0 <= v < e.n_vocab), None)
                if bad is not None:
                    raise ApiError(400, f"{param}[{i}]: the token id {bad} is outside the vocabulary "
                                        f"(0..{e.n_vocab - 1})", param=param)
            ids = e.tokenize(t) if isinstance(t, str) else np.asarray(t, dtype=np.int64)
            if truncate_to is not None:
                ids = ids[:min(truncate_to, e.n_ctx)]
            inputs.append(ids.astype(np.int32))
        try:
            out = yield from e.steps(inputs, cancel)
        except FlylocalError as err:
            index = getattr(err, "index", None)
            raise ApiError(400, f"{param}: {err}" if index is None else f"{param}[{index}]: {err}",
                           param=param, code="context_length_exceeded" if index is not None else None) from None
        return out, sum(len(i) for i in inputs), time.perf_counter() - started

    return Compute(work, cancel)


def checked_dimensions(dimensions: int | None, out: np.ndarray) -> None:
    if dimensions is not None and dimensions != out.shape[1]:
        raise ApiError(400, f"dimensions: {dimensions}; this model's vectors have {out.shape[1]} (flylocal does not "
                            "shorten them)", param="dimensions")


class OpenAIEmbeddings(Endpoint):
    name, body, role = "embeddings", OpenAIEmbeddingRequest, "embedding"

    def streams(self, body) -> bool:
        return False

    def job(self, x: Exchange) -> Compute:
        req = x.body
        texts = [req.input] if isinstance(req.input, str) else req.input
        if texts and isinstance(texts[0], int):
            texts = [texts]                         # one input of token ids
        if any(isinstance(t, str) and not t for t in texts) or any(isinstance(t, list) and not t for t in texts):
            raise ApiError(400, "input: an input is empty", param="input")
        return vectors(self.server, texts, None, "input")

    def whole(self, x: Exchange, result) -> dict:
        req, (out, n_tokens, _) = x.body, result
        checked_dimensions(req.dimensions, out)
        if req.encoding_format == "base64":
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in out]
        else:
            data = [v.tolist() for v in out]
        return {"object": "list", "model": req.model or embedder_name(self.server),
                "data": [{"object": "embedding", "index": i, "embedding": d} for i, d in enumerate(data)],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


class OllamaEmbed(Ollama):
    name, body, role = "ollama_embed", OllamaEmbedRequest, "embedding"

    def streams(self, body) -> bool:
        return False

    def job(self, x: Exchange) -> Compute:
        req, ctx = x.body, self.server.settings.ctx
        num_ctx = min(check_options(self.server, req.options) or ctx, ctx)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts or any(not t for t in texts):
            raise ApiError(400, "input: an input is empty", param="input")
        return vectors(self.server, texts, num_ctx if req.truncate else None, "input")

    def whole(self, x: Exchange, result) -> dict:
        req, (out, n_tokens, seconds) = x.body, result
        checked_dimensions(req.dimensions, out)
        return {"model": req.model or embedder_name(self.server), "embeddings": [v.tolist() for v in out],
                "total_duration": int(seconds * 1e9), "load_duration": 0, "prompt_eval_count": n_tokens}


class OllamaEmbeddings(Ollama):
    """/api/embeddings, ollama's older endpoint."""
    name, body, role = "ollama_embeddings", OllamaEmbeddingsRequest, "embedding"

    def streams(self, body) -> bool:
        return False

    def job(self, x: Exchange):
        req = x.body
        num_ctx = check_options(self.server, req.options)
        if not req.prompt:
            return {"embedding": []}                # what ollama answers
        return vectors(self.server, [req.prompt], num_ctx, "prompt")

    def whole(self, x: Exchange, result) -> dict:
        return {"embedding": result[0][0].tolist()}


def embedder_name(server: Server) -> str:
    return server.embedding_name or server.home.name


def routes(app, server: Server) -> None:
    server.route(app, ["POST"], "/v1/embeddings", OpenAIEmbeddings(server))
    server.route(app, ["POST"], "/api/embed", OllamaEmbed(server))
    server.route(app, ["POST"], "/api/embeddings", OllamaEmbeddings(server))
