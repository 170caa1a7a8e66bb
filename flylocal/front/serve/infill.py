"""llama-server's /infill in `flylocal serve` (docs/serving.md, "Fill in the middle"), as
llama.vscode and Continue's llama.cpp provider call it: `input_prefix`, `input_suffix`,
`input_extra` (other files' chunks) and `prompt`, with llama-server's /completion fields that
set how it answers. A parser and a renderer on the one pipeline: the prompt is built by the
server (flylocal.front.serve.request.infilled), the answer is llama-server's /completion shape,
whole or streamed."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from flylocal.front.serve.answer import Whole, stats_report
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.fields import checked_stops
from flylocal.front.serve.events import Done, Text
from flylocal.front.serve.request import Body, Infill

# Request field -> the declared option whose type and range it must satisfy.
CHECKED = {"n_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "seed": "seed", "repeat_penalty": "repeat_penalty", "verifier": "verifier",
           "drafter": "drafter", "k": "k"}
STOP_TYPES = {"eog": "eos", "stop_string": "word", "max_tokens": "limit", "context": "limit"}


class Chunk(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    filename: str = "tmp"


class InfillRequest(BaseModel):
    """What /infill takes. llama.vscode's timing and field-selection hints are taken; the
    samplers' order is flylocal's own (its list is accepted and changes nothing)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    input_prefix: str
    input_suffix: str
    input_extra: list[Chunk] = []
    prompt: str = ""
    model: str | None = None
    stream: bool = False
    n_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    stop: list[str] | None = None
    verifier: str | None = None              # flylocal's own, beside llama-server's fields
    drafter: str | None = None
    k: int | None = None
    cache_prompt: bool | None = None         # flylocal's prompt cache always keeps what it can
    samplers: list[str] | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: list[str] | None = None  # only these fields of the answer ("timings/predicted_n")

    @field_validator("stop")
    @classmethod
    def stops(cls, v):
        if v:
            checked_stops(v)
        return v

    @field_validator("n_predict")
    @classmethod
    def count(cls, v):
        return None if v is not None and v < 0 else v      # -1: llama-server's "no limit" (ours: --max-tokens)


def body_of(req: InfillRequest) -> Body:
    options = {option: getattr(req, name) for name, option in CHECKED.items() if getattr(req, name) is not None}
    infill = Infill(req.input_prefix, req.input_suffix, req.prompt,
                    tuple((c.filename, c.text) for c in req.input_extra))
    return Body(infill=infill, options=options, stops=tuple(req.stop or ()), tokens=True,
                names={"options": None, "prompt": "input_prefix", "suffix": "input_suffix"})


def selected(out: dict, fields: list[str] | None) -> dict:
    """llama-server's `response_fields`: only these, a nested one named by its path ("a/b")."""
    if not fields:
        return out
    picked = {}
    for path in fields:
        value: Any = out
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked


class Fill(Endpoint):
    name, body, checked, role = "infill", InfillRequest, CHECKED, "target"

    def error(self, e: ApiError):
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"code": e.status, "message": e.message,
                                       "type": "server_error" if e.status >= 500 else "invalid_request_error"}},
                            status_code=e.status, headers=e.headers)

    def read(self, x: Exchange) -> Body:
        return body_of(x.body)

    def final(self, x: Exchange, done: Done, text: str, tokens: list[int]) -> dict:
        stats = done.stats
        out = {"index": 0, "content": text, "tokens": tokens, "id_slot": 0, "stop": True,
               "model": x.body.model or x.member.name, "tokens_predicted": done.n_tokens,
               "tokens_evaluated": len(x.ask.ids), "has_new_line": "\n" in text, "truncated": False,
               "stop_type": STOP_TYPES.get(done.reason, "none"), "stopping_word": done.stop or "",
               "tokens_cached": stats.prompt_reused,
               "timings": {"prompt_n": stats.prompt_evaluated, "prompt_ms": stats.prefill_s * 1e3,
                           "predicted_n": done.n_tokens, "predicted_ms": stats.decode_s * 1e3,
                           "predicted_per_second": stats.tokens_per_s},
               "flylocal": stats_report(done, x.ask.settings)}
        return selected(out, x.body.response_fields)

    def whole(self, x: Exchange, whole: Whole) -> dict:
        return self.final(x, whole.end, whole.text, [t.id for t in whole.tokens])

    async def chunks(self, x: Exchange, events):
        made = 0
        async for event in events:
            if isinstance(event, Text):
                made += len(event.tokens)
                piece = {"index": 0, "content": event.text, "tokens": [t.id for t in event.tokens], "stop": False,
                         "id_slot": 0, "tokens_predicted": made, "tokens_evaluated": len(x.ask.ids)}
                yield f"data: {json.dumps(selected(piece, x.body.response_fields))}\n\n"
            elif isinstance(event, Done):
                yield f"data: {json.dumps(self.final(x, event, '', []))}\n\n"
            else:
                yield f"data: {json.dumps({'error': {'code': 500, 'message': event.message, 'type': 'server_error'}})}\n\n"


def routes(app, server: Server) -> None:
    server.route(app, ["POST"], "/infill", Fill(server))
