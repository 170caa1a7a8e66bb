"""The OpenAI dialect of `flylocal serve`: /v1/chat/completions, /v1/completions, /v1/models.

Requests are pydantic models. A field real clients send at its do-nothing value is accepted
(`n: 1`, `tools: []`, `logprobs: false`, `response_format: {"type": "text"}`, `store: false`,
`user`, a message's `name`, ...); a field whose value flylocal cannot honour is a 400 naming
the field and the value; a field it does not know is a 400 naming it: nothing is silently
ignored. flylocal's own fields (openai's `extra_body`) are checked by the command line's
declarations.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal

import click
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator,
                      model_serializer, model_validator)

from flylocal.decoding.engine import KIND_LETTERS
from flylocal.errors import FlylocalError, GrammarError
from flylocal.front.serve import tools
from flylocal.front.serve.app import ApiError, Server, collect, failure_message, json_body
from flylocal.front.serve.worker import END
from flylocal.settings import OPTIONS, Settings

FINISH = {"eog": "stop", "stop_string": "stop", "max_tokens": "length", "context": "length"}

# Request field -> the declared option whose type and range it must satisfy.
CHECKED = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "top_k": "top_k", "min_p": "min_p",
           "repeat_penalty": "repeat_penalty", "frequency_penalty": "frequency_penalty",
           "presence_penalty": "presence_penalty", "k": "k", "fly_entropy": "fly_entropy",
           "fly_window": "fly_window", "asd_gate": "asd_gate", "asd_cap": "asd_cap", "asd_budget": "asd_budget",
           "verifier": "verifier", "drafter": "drafter", "max_tokens": "max_tokens",
           "max_completion_tokens": "max_tokens"}


# ----- requests -----

class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str                            # JSON text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None                   # who spoke: the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None           # a tool's result: the call it answers
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict:
        """The message as the session renders it."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None                # flylocal's output always follows the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {\"name\", \"schema\"}")
        return self

    def grammar(self) -> tuple[str, str] | None:
        """(what it is, its grammar) of the output, or None for free text."""
        from flylocal.decoding import grammar as G

        if self.type == "json_object":
            return "the JSON object", G.json_object()
        if self.type == "json_schema":
            source = f"response_format.json_schema {self.json_schema.name!r}"
            return source, G.checked(G.json_schema(self.json_schema.schema_ or {}, source), source)
        return None


def refuse(value, why: str):
    raise ValueError(f"{json.dumps(value)}; {why}")


class Common(BaseModel):
    """The fields both endpoints take. Anything else is refused (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                   # an end user's id, for the provider's abuse checks
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None    # tags for stored completions: nothing is stored
    # flylocal's own (openai's extra_body)
    verifier: str | None = None
    drafter: str | None = None
    k: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    fly_entropy: float | None = None
    fly_window: int | None = None
    asd_gate: float | None = None
    asd_cap: int | None = None
    asd_budget: float | None = None

    @field_validator("n")
    @classmethod
    def one_choice(cls, v):
        if v is not None and v != 1:
            refuse(v, "flylocal generates one choice per request: n must be 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def stops(cls, v):
        stops = [v] if isinstance(v, str) else v if isinstance(v, list) else None
        if v is not None and (stops is None or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops)):
            raise ValueError(f"{json.dumps(v)[:80]}; a string, or a list of at most 4 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def biases(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                refuse(key, "a logit_bias key is a token id")
            if not -100 <= bias <= 100:
                refuse(bias, "a logit bias lies between -100 and 100")
        return v

    @field_validator("service_tier")
    @classmethod
    def one_tier(cls, v):
        if v not in (None, "auto", "default"):
            refuse(v, "flylocal has one service tier (auto, default)")
        return v

    @field_validator("store")
    @classmethod
    def nothing_stored(cls, v):
        if v:
            refuse(v, "flylocal keeps no completions")
        return v

    @model_validator(mode="after")
    def usage_needs_a_stream(self):
        if self.stream_options is not None and self.stream_options.include_usage and not self.stream:
            raise ValueError("stream_options.include_usage is only allowed with stream: true")
        return self


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def some(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def top_range(cls, v):
        if v is not None and not 0 <= v <= 20:
            refuse(v, "top_logprobs lies between 0 and 20")
        return v

    @model_validator(mode="after")
    def one_constraint(self):
        if self.tools and self.tool_choice != "none" and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format and tools: flylocal constrains an answer to one of them")
        return self

    @model_validator(mode="after")
    def top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class CompletionRequest(Common):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            refuse(len(v), "prompts; flylocal takes one prompt per request")
        return v

    @field_validator("logprobs")
    @classmethod
    def logprob_range(cls, v):
        if v is not None and not 0 <= v <= 5:
            refuse(v, "logprobs lies between 0 and 5")
        return v

    @field_validator("echo")
    @classmethod
    def no_echo(cls, v):
        if v:
            refuse(v, "flylocal does not echo the prompt")
        return v

    @field_validator("best_of")
    @classmethod
    def one_best(cls, v):
        if v not in (None, 1):
            refuse(v, "flylocal generates one completion per request: best_of must be 1")
        return v

    @field_validator("suffix")
    @classmethod
    def no_suffix(cls, v):
        if v:
            refuse(v, "flylocal does not fill in the middle")
        return v


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """A request body as `model`, or ApiError 400 naming the first bad field (and its value)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):         # not JSON, not UTF-8, nested too deep, a huge number
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # A union's branch shows in the location as its type (`stop.str`); the field is named alone.
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and (x in TYPE_TAGS or "[" in x))) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"flylocal does not support the field {param!r}", param=param,
                           code="unsupported_field") from None
        message = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None
    for name, option in CHECKED.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        try:
            OPTIONS[option].type.convert(value, None, None)
        except click.BadParameter as e:
            raise ApiError(400, f"{name}: {e.message}", param=name) from None
    return req


def request_settings(base: Settings, req: Common, n_vocab: int | None = None) -> Settings:
    """The server's settings with a request's fields applied (the request owns its ledger)."""
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    bias = ()
    if req.logit_bias:
        bias = tuple(sorted((int(k), float(v)) for k, v in req.logit_bias.items()))
        if n_vocab is not None and bias[-1][0] >= n_vocab:
            raise ApiError(400, f"logit_bias: token id {bias[-1][0]} is not in the vocabulary (0..{n_vocab - 1})",
                           param="logit_bias")
    sampling = {k: v for k, v in dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k,
                                      min_p=req.min_p, repeat_penalty=req.repeat_penalty,
                                      frequency_penalty=req.frequency_penalty,
                                      presence_penalty=req.presence_penalty).items() if v is not None}
    if bias:
        sampling["logit_bias"] = bias
    fly = {k: v for k, v in dict(entropy=req.fly_entropy, window=req.fly_window).items() if v is not None}
    asd = {k: v for k, v in dict(gate=req.asd_gate, cap=req.asd_cap, budget=req.asd_budget).items() if v is not None}
    top = {k: v for k, v in dict(verifier=req.verifier, drafter=req.drafter, k=req.k,
                                 max_tokens=max_tokens).items() if v is not None}
    verifiers = dataclasses.replace(base.verifiers, fly=dataclasses.replace(base.verifiers.fly, **fly),
                                    asd=dataclasses.replace(base.verifiers.asd, **asd))
    return dataclasses.replace(base, **top, sampling=dataclasses.replace(base.sampling, **sampling),
                               verifiers=verifiers, trace=False)


def logprobs_wanted(req: Common, chat: bool) -> int | None:
    """How many most likely tokens each output token carries (None: no logprobs)."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


# ----- responses: OpenAI's shapes -----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
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


def stream_kinds(tokens) -> dict:
    """flylocal's extension on a streamed chunk: how each token it completes came, one letter
    each (A accepted, L loose, T from the target: flylocal.decoding.engine.KIND_LETTERS), and
    the characters of the answer's text each ends, counted on from the previous token's end
    (the answer's text is the chunks' text joined, so a reader keeps one cursor over it)."""
    return {"kinds": "".join(KIND_LETTERS[t.kind] for t in tokens), "chars": [t.chars for t in tokens]}


def usage(prompt_tokens: int, completion_tokens: int, stats, settings: Settings, reason: str) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": stats.prompt_reused},
        flylocal={
            "verifier": settings.verifier, "drafter": settings.drafter_name, "rounds": stats.rounds,
            "drafted": stats.drafted, "accepted": stats.accepted, "loose": stats.loose, "forced": stats.forced,
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "tokens_per_s": round(stats.tokens_per_s, 3),
            "budget_left": stats.budget_left, "stop": reason,
        },
    )


def chat_logprobs(tokens) -> dict:
    """OpenAI's chat logprobs of output tokens (flylocal.front.serve.worker.OutToken): each with its
    most likely alternatives, and flylocal's word for how it came (`kind`: a loose token is a
    draft token the verifier accepted where the target would have chosen another)."""
    def entry(piece: bytes, logprob: float) -> dict:
        return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}

    return {"content": [entry(t.piece, t.logprob) | {"top_logprobs": [entry(p, v) for _, p, v in t.top],
                                                    "flylocal": {"kind": t.kind}} for t in tokens],
            "refusal": None}


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
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}


def e_param(message: str, chat: bool) -> str:
    """The request field an encoding error is about."""
    for field, param in (("tools", "tools"), ("the tools'", "tools"), ("tool_choice", "tool_choice"),
                         ("tool_calls", "messages"), ("response_format", "response_format")):
        if message.startswith(field):
            return param
    return "messages" if chat else "prompt"


def routes(app, server: Server) -> None:
    settings = server.settings

    def error_response(e: ApiError, request: Request, endpoint: str, started: float) -> JSONResponse:
        server.answered(request, endpoint, e.status, started)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/v1/models")
    async def list_models(request: Request):
        try:
            server.authorize(request)
        except ApiError as e:
            return error_response(e, request, "models", time.perf_counter())
        created = int(time.time())
        data = [{"id": settings.target, "object": "model", "created": created, "owned_by": "flylocal"}]
        if settings.draft:
            data.append({"id": settings.draft, "object": "model", "created": created, "owned_by": "flylocal",
                         "flylocal": {"role": "draft"}})
        return {"object": "list", "data": data}

    async def run(request: Request, endpoint: str, chat: bool):
        started = time.perf_counter()
        try:
            server.authorize(request)
            req = parse(ChatRequest if chat else CompletionRequest, await server.body(request))
            session = server.session()
            if req.model is not None and req.model not in server.names(session):
                raise ApiError(404, f"the model {req.model!r} is not loaded here; GET /v1/models lists the one "
                                    "that is", param="model", code="model_not_found")
            run_settings = request_settings(settings, req, session.target.n_vocab)
            server.check_settings(run_settings, session)
            grammar = None
            calls = ()                   # how an answer that is a tool call begins (none: it is not one)
            try:
                if chat:
                    turns = [m.turn() for m in req.messages]
                    tool_plan = tools.plan(turns, req.tools or [], req.tool_choice, session.target.tools_template())
                    ids = session.encode(tool_plan.messages, tool_plan.tools)
                    if tool_plan.grammar is not None:
                        grammar, calls = ("the tools' grammar", tool_plan.grammar), tool_plan.call_starts
                    elif req.response_format is not None:
                        grammar = req.response_format.grammar()
                else:
                    text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
                    if not text:
                        raise ApiError(400, "the prompt is empty", param="prompt")
                    ids = session.target.tokenize(text, add_special=True, parse_special=False)
            except FlylocalError as e:
                raise ApiError(400, str(e), param=e_param(str(e), chat)) from None
            server.check_fits(ids, session, "messages" if chat else "prompt")
            top = logprobs_wanted(req, chat)
            if top is not None:
                run_settings = dataclasses.replace(run_settings, logprobs=top)
            stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
            # A stream always carries how each token came (stream_kinds); logprobs only when asked.
            job, queue = server.submit(run_settings, ids, stops, tokens=top is not None or req.stream, grammar=grammar)
        except ApiError as e:
            return error_response(e, request, endpoint, started)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = req.model or settings.target
        kind = "chat.completion" if chat else "text_completion"
        offset = 0

        def logprobs(tokens):
            nonlocal offset
            if top is None:
                return None
            if chat:
                return chat_logprobs(tokens)
            out, offset = completion_logprobs(tokens, offset)
            return out

        if not req.stream:
            answer = await collect(request, job, queue)
            if isinstance(answer.failed, GrammarError):        # a grammar the vocabulary cannot serve
                return error_response(ApiError(400, str(answer.failed)), request, endpoint, started)
            if answer.failed is not None:
                return error_response(ApiError(500, failure_message(answer.failed), type_="server_error"), request,
                                      endpoint, started)
            if answer.done is None:
                return error_response(ApiError(503, "the server is shutting down", type_="server_error"), request,
                                      endpoint, started)
            done, tokens, parts = answer.done, answer.tokens, answer.parts
            _, reason, stats, n_out = done
            finish = FINISH.get(reason, "stop")
            text = "".join(parts)
            call = tools.read_call(text) if calls and reason == "eog" else None
            if call is not None:
                choice = ChatChoice(message=AssistantMessage(content=None, tool_calls=[openai_call(call)]),
                                    logprobs=logprobs(tokens), finish_reason="tool_calls")
            elif chat:
                choice = ChatChoice(message=AssistantMessage(content=text), logprobs=logprobs(tokens),
                                    finish_reason=finish)
            else:
                choice = TextChoice(text=text, logprobs=logprobs(tokens), finish_reason=finish)
            answer = Response(id=rid, object=kind, created=created, model=model, choices=[choice],
                              usage=usage(len(ids), n_out, stats, run_settings, reason))
            server.answered(request, endpoint, 200, started, stats, len(ids), n_out)
            return json_body(answer)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choices: list, usage: Usage | None = None, tokens=()) -> str:
                body = Response(id=rid, object=chunk_kind, created=created, model=model, choices=choices, usage=usage,
                                flylocal=stream_kinds(tokens) if tokens else None)
                absent = {name for name in ("usage", "flylocal") if getattr(body, name) is None}
                return "data: " + body.model_dump_json(exclude=absent or None) + "\n\n"

            def piece(text: str | None, finish: str | None, tokens=()):
                lp = logprobs(tokens) if tokens and top is not None else None
                if chat:
                    return ChunkChoice(delta=Delta(content=text), logprobs=lp, finish_reason=finish)
                return TextChoice(text=text or "", logprobs=lp, finish_reason=finish)

            stats, n_out, status = None, 0, 200
            # With tools, an answer that begins with "{" is a call: held back, and sent as
            # OpenAI's tool-call delta once it is complete.
            held, holding = [], None
            try:
                if chat:
                    yield chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
                while True:
                    item = await queue.get()
                    if item is END:
                        break
                    if item[0] == "text":
                        if calls and holding is None and item[1]:
                            holding = item[1].startswith(calls)
                        if holding:
                            held.append(item)
                            continue
                        yield chunk([piece(item[1], None, item[2])], tokens=item[2])
                    elif item[0] == "done":
                        _, reason, stats, n_out = item
                        finish = FINISH.get(reason, "stop")
                        if holding:
                            text = "".join(h[1] for h in held)
                            made = tuple(t for h in held for t in h[2])
                            call = tools.read_call(text) if reason == "eog" else None
                            if call is None:          # cut short: the text as it is
                                yield chunk([piece(text, None, made)], tokens=made)
                            else:
                                lp = logprobs(made) if made and top is not None else None
                                yield chunk([ChunkChoice(delta=Delta(tool_calls=[openai_call(call) | {"index": 0}]),
                                                         logprobs=lp)], tokens=made)
                                finish = "tool_calls"
                        yield chunk([piece(None if chat else "", finish)])
                        if include_usage:
                            yield chunk([], usage=usage(len(ids), n_out, stats, run_settings, reason))
                    elif item[0] == "error":
                        status = 500
                        error = ApiError(500, failure_message(item[1]), type_="server_error")
                        yield "data: " + json.dumps(error.body()) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()         # a client that went away frees the model within a round
                server.answered(request, endpoint, status, started, stats, len(ids), n_out)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, "chat", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "completions", chat=False)
