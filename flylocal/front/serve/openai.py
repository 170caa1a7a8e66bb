"""The OpenAI dialect of `flylocal serve`: /v1/chat/completions, /v1/completions, /v1/models
(docs/serving.md, "Server").

Its requests are pydantic models (flylocal.front.serve.openai_requests); answers
(flylocal.front.serve.answer) are rendered here in OpenAI's shapes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, field_serializer, model_serializer

from flylocal.decoding.engine import KIND_LETTERS
from flylocal.front.serve import tools
from flylocal.front.serve.answer import Whole, logprob_entries, stats_report
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.events import Done, Text
from flylocal.front.serve.openai_requests import CHECKED, ChatRequest, CompletionRequest, options_of
from flylocal.front.serve.request import Body, Infill
from flylocal.settings import Settings

# ----- responses: OpenAI's shapes -----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    completion_tokens_details: dict[str, int]
    flylocal: dict[str, Any]                  # verifier, drafter, rounds, drafted, accepted, loose, ...


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None

    @model_serializer(mode="wrap")
    def calls_when_made(self, handler) -> dict:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: dict | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def only_what_is_set(self, delta: Delta) -> dict:
        return delta.model_dump(exclude_none=True)


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None


class Response(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChunkChoice] | list[TextChoice]
    usage: Usage | None = None
    flylocal: dict[str, Any] | None = None    # a chunk's tokens: stream_kinds

    @model_serializer(mode="wrap")
    def extension_when_set(self, handler) -> dict:
        """flylocal's field is left out where it says nothing (never a top-level null)."""
        out = handler(self)
        if out.get("flylocal") is None:
            out.pop("flylocal", None)
        return out


def stream_kinds(tokens) -> dict:
    """flylocal's extension on a streamed chunk: how each token it completes came, one letter
    each (A accepted, L loose, T from the target: flylocal.decoding.engine.KIND_LETTERS), and
    the characters of the answer's text each ends, counted on from the previous token's end
    (the answer's text is the chunks' text joined, so a reader keeps one cursor over it)."""
    return {"kinds": "".join(KIND_LETTERS[t.kind] for t in tokens), "chars": [t.chars for t in tokens]}


def usage(prompt_tokens: int, done: Done, settings: Settings) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=done.n_tokens,
                 total_tokens=prompt_tokens + done.n_tokens,
                 prompt_tokens_details={"cached_tokens": done.stats.prompt_reused},
                 completion_tokens_details={"reasoning_tokens": 0},
                 flylocal=stats_report(done, settings))


def chat_logprobs(tokens) -> dict:
    """OpenAI's chat logprobs of output tokens (answer.logprob_entries)."""
    return {"content": logprob_entries(tokens), "refusal": None}


def completion_logprobs(tokens, offset: int) -> tuple[dict, int]:
    """The completions endpoint's logprobs of output tokens, text offsets from `offset`; and the
    offset after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "flylocal_kinds": []}
    for t in tokens:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({p.decode("utf-8", "replace"): v for _, p, v in t.top})
        out["text_offset"].append(offset)
        out["flylocal_kinds"].append(t.kind)
        offset += len(t.text)
    return out, offset


def openai_call(call: dict) -> dict:
    """A call read from an answer in OpenAI's shape, with a fresh id."""
    return {"id": tools.call_id(), "type": "function",
            "function": {"name": call["name"], "arguments": tools.call_arguments(call)}}


def body_of(req, chat: bool) -> Body:
    """A chat or completions request as the one request body."""
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    # A stream always carries how each token came (stream_kinds); logprobs only when asked.
    common = dict(options=options_of(req), logit_bias=req.logit_bias, stops=stops, tokens=req.stream,
                  hints=req.ollama_hints, salt=req.cache_salt, names={"options": None})
    if not chat:
        if req.logprobs is not None:
            common.update(logprobs=True, top_logprobs=req.logprobs)
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        if req.suffix:                  # fill in the middle
            return Body(infill=Infill(text, req.suffix), **common)
        return Body(text=text, **common)
    fmt = req.response_format.output() if req.response_format is not None else None
    return Body(messages=[m.turn() for m in req.messages], tools=tuple(req.tools or ()),
                tool_choice=req.tool_choice if req.tool_choice is not None else "auto", format=fmt,
                logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs,
                **common | {"names": {"options": None, "prompt": "messages", "format": "response_format"}})


def model_entries(server: Server) -> list[dict]:
    """The models a request may name: every target (with the draft that speeds it up, and
    whether it is loaded: llama-server's router's `status`), and the model that computes
    embeddings when it is another (the roles /api/tags gives them)."""
    created, out = int(time.time()), []
    for name, path, role, m in server.models.served():
        extra = {}
        if m is not None:
            draft = m.settings.draft
            extra = {"status": {"value": m.state}, "flylocal": {"role": role} | ({"draft": draft} if draft else {})}
        else:
            extra = {"status": {"value": server.home.state}, "flylocal": {"role": role}}
        out.append({"id": name, "object": "model", "created": created, "owned_by": "flylocal"} | extra)
    return out


class Models(Endpoint):
    name = "models"

    def job(self, x: Exchange):
        return {"object": "list", "data": model_entries(self.server)}


class OneModel(Endpoint):
    name = "models"

    def job(self, x: Exchange):
        for entry in model_entries(self.server):
            if entry["id"] == x.path["model_id"]:
                return entry
        raise ApiError(404, f"the model {x.path['model_id']!r} is not served here; GET /v1/models lists those that "
                            "are", param="model", code="model_not_found")


class Generate(Endpoint):
    """/v1/chat/completions (`chat`) and /v1/completions."""
    role = "target"
    checked = CHECKED
    chat = True

    def read(self, x: Exchange) -> Body:
        return body_of(x.body, self.chat)

    def head(self, x: Exchange) -> dict:
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": x.body.model or x.member.name}

    def logprobs(self, x: Exchange, tokens, offset: list[int]):
        """The logprobs of `tokens` in the endpoint's shape, or None when not asked for;
        `offset`: the completions endpoint's text offset, carried on."""
        if x.ask.settings.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        out, offset[0] = completion_logprobs(tokens, offset[0])
        return out

    def whole(self, x: Exchange, whole: Whole) -> Response:
        done, lp = whole.end, self.logprobs(x, whole.tokens, [0])
        if done.call is not None:
            choice = ChatChoice(message=AssistantMessage(content=None, tool_calls=[openai_call(done.call)]),
                                logprobs=lp, finish_reason=done.finish)
        elif self.chat:
            choice = ChatChoice(message=AssistantMessage(content=whole.text), logprobs=lp, finish_reason=done.finish)
        else:
            choice = TextChoice(text=whole.text, logprobs=lp, finish_reason=done.finish)
        return Response(**self.head(x), object="chat.completion" if self.chat else "text_completion", choices=[choice],
                        usage=usage(len(x.ask.ids), done, x.ask.settings))

    async def chunks(self, x: Exchange, events):
        chat, head, offset = self.chat, self.head(x), [0]
        include_usage = bool(x.body.stream_options and x.body.stream_options.include_usage)

        def chunk(choices: list, usage: Usage | None = None, tokens=()) -> str:
            body = Response(**head, object="chat.completion.chunk" if chat else "text_completion", choices=choices,
                            usage=usage, flylocal=stream_kinds(tokens) if tokens else None)
            return "data: " + body.model_dump_json(exclude={"usage"} if usage is None else None) + "\n\n"

        def piece(text: str | None, finish: str | None, tokens=()):
            lp = self.logprobs(x, tokens, offset) if tokens else None
            if chat:
                return ChunkChoice(delta=Delta(content=text), logprobs=lp, finish_reason=finish)
            return TextChoice(text=text or "", logprobs=lp, finish_reason=finish)

        if chat:
            yield chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
        async for event in events:
            if isinstance(event, Text):
                yield chunk([piece(event.text, None, event.tokens)], tokens=event.tokens)
            elif isinstance(event, Done):
                if event.call is not None:
                    made = event.call_tokens
                    yield chunk([ChunkChoice(delta=Delta(tool_calls=[openai_call(event.call) | {"index": 0}]),
                                             logprobs=self.logprobs(x, made, offset) if made else None)],
                            tokens=made)
                yield chunk([piece(None if chat else "", event.finish)])
                if include_usage:
                    yield chunk([], usage=usage(len(x.ask.ids), event, x.ask.settings))
            else:
                yield "data: " + json.dumps(ApiError(500, event.message, type_="server_error").body()) + "\n\n"
        yield "data: [DONE]\n\n"


class Chat(Generate):
    name, body, chat = "chat", ChatRequest, True


class Completion(Generate):
    name, body, chat = "completions", CompletionRequest, False


def routes(app, server: Server) -> None:
    server.route(app, ["GET"], "/v1/models", Models(server))
    server.route(app, ["GET"], "/v1/models/{model_id:path}", OneModel(server))
    server.route(app, ["POST"], "/v1/chat/completions", Chat(server))
    server.route(app, ["POST"], "/v1/completions", Completion(server))
