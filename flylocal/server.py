"""`flylocal serve`: an OpenAI-compatible HTTP front-end over one Session (docs/design.md,
"Server").

Requests are translated into session calls and the rounds' text is rendered out; nothing here
imports llama.cpp. One generation runs at a time on the loaded pair: a single worker thread
takes jobs from a bounded FIFO queue (full: 503 with Retry-After), and a request handler reads
its job's output from an asyncio queue. A client that goes away sets its job's cancel flag,
which the worker reads after every round, so its slot is free within one round and the caches
stay consistent for the next request.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import click
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ConfigDict, ValidationError, field_serializer, field_validator

from flylocal.errors import FlylocalError
from flylocal.loader import check
from flylocal.net import check_port, is_loopback
from flylocal.session import Session, TextStream
from flylocal.settings import OPTIONS, Settings

MAX_BODY = 4 << 20          # bytes of a request body
SEND_EVERY = 0.025          # seconds between a stream's text events after the first
FINISH = {"eog": "stop", "stop_string": "stop", "max_tokens": "length", "context": "length"}


# ----- errors -----

class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----- requests: pydantic models; flylocal's own fields are checked by the CLI's declarations -----

# Request field -> the declared option whose type and range it must satisfy.
CHECKED = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "top_k": "top_k", "min_p": "min_p",
           "repeat_penalty": "repeat_penalty", "k": "k", "fly_entropy": "fly_entropy", "fly_window": "fly_window",
           "asd_gate": "asd_gate", "asd_cap": "asd_cap", "asd_budget": "asd_budget", "verifier": "verifier",
           "drafter": "drafter", "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Common(BaseModel):
    """The fields both endpoints take. Anything else is refused (extra="forbid"): a field
    flylocal does not honour is never silently ignored."""

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
            raise ValueError("flylocal generates one choice per request: n must be 1")
        return v

    @field_validator("stream_options")
    @classmethod
    def only_with_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator("stop")
    @classmethod
    def stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return v


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None

    @field_validator("messages")
    @classmethod
    def some(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v


class CompletionRequest(Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("flylocal takes one prompt per request")
        return v


# ----- responses: OpenAI's shapes -----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    flylocal: dict[str, Any]                  # verifier, drafter, rounds, drafted, accepted, loose, ...


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None

    @field_serializer("delta")
    def only_what_is_set(self, delta: Delta) -> dict:
        return delta.model_dump(exclude_none=True)


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Response(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChunkChoice] | list[TextChoice]
    usage: Usage | None = None


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """A request body as `model`, or ApiError 400 naming the first bad field."""
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
        param = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"flylocal does not support the field {param!r}", param=param,
                           code="unsupported_field") from None
        raise ApiError(400, f"{param}: {err['msg'].removeprefix('Value error, ')}", param=param) from None
    for name, option in CHECKED.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        try:
            OPTIONS[option].type.convert(value, None, None)
        except click.BadParameter as e:
            raise ApiError(400, f"{name}: {e.message}", param=name) from None
    return req


def request_settings(base: Settings, req: Common) -> Settings:
    """The server's settings with a request's fields applied (the request owns its ledger)."""
    import dataclasses

    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    sampling = {k: v for k, v in dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k,
                                      min_p=req.min_p, repeat_penalty=req.repeat_penalty).items() if v is not None}
    fly = {k: v for k, v in dict(entropy=req.fly_entropy, window=req.fly_window).items() if v is not None}
    asd = {k: v for k, v in dict(gate=req.asd_gate, cap=req.asd_cap, budget=req.asd_budget).items() if v is not None}
    top = {k: v for k, v in dict(verifier=req.verifier, drafter=req.drafter, k=req.k,
                                 max_tokens=max_tokens).items() if v is not None}
    verifiers = dataclasses.replace(base.verifiers, fly=dataclasses.replace(base.verifiers.fly, **fly),
                                    asd=dataclasses.replace(base.verifiers.asd, **asd))
    return dataclasses.replace(base, **top, sampling=dataclasses.replace(base.sampling, **sampling),
                               verifiers=verifiers, trace=False)


# ----- stop strings -----

class StopStrings:
    """Cuts text at the first occurrence of any stop string, even one that spans tokens. Text
    that could still turn out to be the start of a stop string is held back, nothing more."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text that may go out now, whether a stop string was found)."""
        text = self.held + text
        self.held = ""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
        if final:
            return text, False
        keep = 0
        for n in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                keep = n
                break
        if keep:
            self.held = text[-keep:]
            text = text[:-keep]
        return text, False


# ----- jobs and the worker -----

END = object()


@dataclass
class Job:
    settings: Settings
    ids: Any                                  # [n] int32 prompt ids
    stops: list[str]
    emit: Callable[[Any], None]               # thread-safe: puts an item on the handler's queue
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


class Worker:
    """One thread loads the models, then runs the jobs, first come first served, one at a time."""

    def __init__(self, load: Callable[[], Session], metrics: Metrics, max_queue: int,
                 on_failure: Callable[[BaseException], None] = lambda e: None):
        self.metrics, self.max_queue = metrics, max_queue
        self.session: Session | None = None         # None while the models load
        self.failed: BaseException | None = None
        self.jobs: collections.deque[Job] = collections.deque()     # waiting, oldest first
        self.busy = False                                           # a job is running
        self.ready = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, args=(load, on_failure), name="flylocal-worker",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.ready:
            if any(j.cancel.is_set() for j in self.jobs):       # their clients went away
                self.jobs = collections.deque(j for j in self.jobs if not j.cancel.is_set())
            if len(self.jobs) >= self.max_queue and (self.busy or self.jobs):
                raise ApiError(503, f"the server is busy: {len(self.jobs)} requests are waiting (--max-queue)",
                               type_="server_error", code="queue_full", headers={"Retry-After": "1"})
            self.jobs.append(job)
            self.metrics.queue.set(len(self.jobs))
            self.ready.notify()

    def stop(self) -> None:
        with self.ready:
            self.stopping = True
            self.ready.notify()

    def _run(self, load, on_failure) -> None:
        try:
            self.session = load()
        except BaseException as e:  # noqa: BLE001 - the server reports it and exits
            self.failed = e
            on_failure(e)
            return
        while True:
            with self.ready:
                while not self.jobs and not self.stopping:
                    self.ready.wait()
                if self.stopping and not self.jobs:
                    break
                job = self.jobs.popleft()
                self.metrics.queue.set(len(self.jobs))
                if job.cancel.is_set():
                    continue
                self.busy = True
            try:
                with self.session.lock:
                    self._generate(job)
            except BaseException as e:  # noqa: BLE001 - reported to its request; the server goes on
                job.emit(("error", e))
            finally:
                with self.ready:
                    self.busy = False
                job.emit(END)
        if self.session is not None:
            with self.session.lock:      # the refined cost curves are saved as the models close
                self.session.models.close()

    def _generate(self, job: Job) -> None:
        session = self.session
        session.models.reconnect()       # a model whose rpc servers were lost: once they answer again
        gen = session.request(job.ids, job.settings)
        text = TextStream(session.target)
        stops = StopStrings(job.stops)
        stopped, first, sent, pending = False, None, 0.0, ""
        try:
            for event in gen:
                piece, stopped = stops.feed(text.feed(event.tokens))
                pending += piece
                now = time.perf_counter()
                # Text goes out at once at first, then at most every SEND_EVERY seconds: each send
                # wakes the event loop, which on a small machine takes a core from llama.cpp.
                if pending and (first is None or now - sent >= SEND_EVERY):
                    first = first or now
                    job.emit(("text", pending))
                    pending, sent = "", now
                if stopped or job.cancel.is_set():
                    break
            else:
                piece, stopped = stops.feed(text.flush(), final=True)
                pending += piece
            if pending:
                job.emit(("text", pending))
        finally:
            gen.close()
        stats = gen.stats
        reason = "stop_string" if stopped else stats.stop
        self.metrics.observe(stats, len(gen.tokens), first - job.queued_at if first is not None else None)
        job.emit(("done", FINISH.get(reason, "stop"), stats, len(gen.tokens), reason))


# ----- metrics -----

class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("flylocal_requests", "Requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("flylocal_completion_tokens", "Tokens generated (usage.completion_tokens).", registry=r)
        self.drafted = Counter("flylocal_drafted_tokens", "Draft tokens sent to the target.", registry=r)
        self.accepted = Counter("flylocal_accepted_tokens", "Draft tokens committed, loose ones included.",
                                registry=r)
        self.loose = Counter("flylocal_loose_tokens", "Committed draft tokens that did not match natively.",
                             registry=r)
        self.rounds = Counter("flylocal_rounds", "Verification rounds.", registry=r)
        self.mean_accepted = Gauge("flylocal_mean_accepted_length",
                                   "Tokens committed per round, over every request so far.", registry=r)
        self.queue = Gauge("flylocal_queue_depth", "Requests waiting for the model.", registry=r)
        self.ttft = Histogram("flylocal_time_to_first_token_seconds", "From a request's arrival to its first text.",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.tps = Histogram("flylocal_tokens_per_second", "Decode tokens/s of a request.",
                             buckets=(5, 10, 25, 50, 100, 150, 200, 300, 500, 1000), registry=r)
        self._emitted = self._rounds = 0

    def observe(self, stats, output_tokens: int, ttft: float | None) -> None:
        self.tokens.inc(output_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.loose.inc(stats.loose)
        self.rounds.inc(stats.rounds)
        self._emitted += stats.emitted
        self._rounds += stats.rounds
        if self._rounds:
            self.mean_accepted.set(self._emitted / self._rounds)
        if ttft is not None:
            self.ttft.observe(ttft)
        if stats.tokens_per_s > 0:
            self.tps.observe(stats.tokens_per_s)


# ----- the application -----

def usage(prompt_tokens: int, completion_tokens: int, stats, settings: Settings, reason: str) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": stats.prompt_reused},
        flylocal={
            "verifier": settings.verifier, "drafter": settings.drafter_name, "rounds": stats.rounds,
            "drafted": stats.drafted, "accepted": stats.accepted, "loose": stats.loose,
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "tokens_per_s": round(stats.tokens_per_s, 3),
            "budget_left": stats.budget_left, "stop": reason,
        },
    )


def create_app(load: Callable[[], Session], settings: Settings, *, api_key: str | None = None,
               max_queue: int = 16, cors_origins: tuple[str, ...] = (),
               on_failure: Callable[[BaseException], None] = lambda e: None):
    """The application. `load` builds the Session, on the worker thread, while the server
    already answers /health ("loading"); `on_failure` hears if it fails."""
    metrics = Metrics()
    worker = Worker(load, metrics, max_queue, on_failure)
    app = FastAPI(title="flylocal", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def error_response(e: ApiError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):      # 404, 405 ... in OpenAI's shape
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=None).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):      # never a traceback on the wire
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", type_="server_error").body(),
                            status_code=500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", code="body_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB",
                                   code="body_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client went away before its request was read") from None
        return b"".join(chunks)

    def loaded() -> Session:
        if worker.session is None:
            raise ApiError(503, "the models are still loading", type_="server_error", code="loading",
                           headers={"Retry-After": "1"})
        return worker.session

    def check_model(req: Common, session: Session) -> None:
        names = {settings.target, session.target.name, session.target.name.removesuffix(".gguf")}
        if req.model is not None and req.model not in names:
            raise ApiError(404, f"the model {req.model!r} is not loaded here; GET /v1/models lists the one that is",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if worker.session is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_page(request: Request):
        try:
            authorize(request)
        except ApiError as e:
            return error_response(e, "metrics")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request):
        try:
            authorize(request)
        except ApiError as e:
            return error_response(e, "models")
        created = int(time.time())
        data = [{"id": settings.target, "object": "model", "created": created, "owned_by": "flylocal"}]
        if settings.draft:
            data.append({"id": settings.draft, "object": "model", "created": created, "owned_by": "flylocal",
                         "flylocal": {"role": "draft"}})
        return {"object": "list", "data": data}

    async def run(request: Request, endpoint: str, chat: bool):
        try:
            authorize(request)
            req = parse(ChatRequest if chat else CompletionRequest, await body(request))
            session = loaded()
            check_model(req, session)
            run_settings = request_settings(settings, req)
            try:
                check(run_settings)              # a draft longer than a batch holds, for one
            except FlylocalError as e:
                raise ApiError(400, str(e).replace("--", ""), param="k") from None
            if run_settings.drafter_name in ("model", "mla") and session.models.draft is None:
                raise ApiError(400, f"drafter {run_settings.drafter_name} needs a draft model: start the server "
                                    "with --draft", param="drafter")
            try:
                if chat:
                    ids = session.encode([{"role": "system" if m.role == "developer" else m.role,
                                           "content": m.text()} for m in req.messages])
                else:
                    text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
                    if not text:
                        raise ApiError(400, "the prompt is empty", param="prompt")
                    ids = session.target.tokenize(text, add_special=True, parse_special=False)
            except FlylocalError as e:
                raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
            if len(ids) >= session.target.n_ctx:
                raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds {session.target.n_ctx} "
                                    "(--ctx), with room for at least one generated token",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        except ApiError as e:
            return error_response(e, endpoint)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        job = Job(run_settings, ids, stops, emit)
        try:
            worker.submit(job)
        except ApiError as e:
            return error_response(e, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = req.model or settings.target
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool):
            if not chat:
                return TextChoice(text=text or "", finish_reason=finish)
            if delta:
                return ChunkChoice(delta=Delta(content=text), finish_reason=finish)
            return ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)

        if not req.stream:
            async def watch() -> None:        # a client that goes away frees the model within a round
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                job.cancel.set()

            watcher = asyncio.create_task(watch())
            parts, done, failed = [], None, None
            try:
                while True:
                    item = await queue.get()
                    if item is END:
                        break
                    if item[0] == "text":
                        parts.append(item[1])
                    elif item[0] == "done":
                        done = item
                    elif item[0] == "error":
                        failed = item[1]
            finally:
                watcher.cancel()
                job.cancel.set()
            if failed is not None:
                message = str(failed) if isinstance(failed, FlylocalError) else f"internal error: {type(failed).__name__}"
                return error_response(ApiError(500, message, type_="server_error"), endpoint)
            if done is None:
                return error_response(ApiError(503, "the server is shutting down", type_="server_error"), endpoint)
            _, finish, stats, n_out, reason = done
            metrics.requests.labels(endpoint, "200").inc()
            answer = Response(id=rid, object=kind, created=created, model=model,
                              choices=[choice("".join(parts), finish, delta=False)],
                              usage=usage(len(ids), n_out, stats, run_settings, reason))
            # pydantic writes a non-finite number (an infinite ASD budget) as null, JSON has none
            return PlainTextResponse(answer.model_dump_json(), media_type="application/json")

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choices: list, usage: Usage | None = None) -> str:
                body = Response(id=rid, object=chunk_kind, created=created, model=model, choices=choices, usage=usage)
                return "data: " + body.model_dump_json(exclude={"usage"} if usage is None else None) + "\n\n"

            try:
                if chat:
                    yield chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
                while True:
                    item = await queue.get()
                    if item is END:
                        break
                    if item[0] == "text":
                        yield chunk([choice(item[1], None, delta=True)])
                    elif item[0] == "done":
                        _, finish, stats, n_out, reason = item
                        yield chunk([choice(None if chat else "", finish, delta=True)])
                        if include_usage:
                            yield chunk([], usage=usage(len(ids), n_out, stats, run_settings, reason))
                    elif item[0] == "error":
                        e = item[1]
                        message = str(e) if isinstance(e, FlylocalError) else f"internal error: {type(e).__name__}"
                        yield "data: " + json.dumps(ApiError(500, message, type_="server_error").body()) + "\n\n"
                yield "data: [DONE]\n\n"
                metrics.requests.labels(endpoint, "200").inc()
            finally:
                job.cancel.set()         # a client that went away frees the model within a round

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, "chat", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "completions", chat=False)

    return app


def serve(load: Callable[[], Session], settings: Settings, host: str, port: int, api_key: str | None,
          max_queue: int, cors_origins: tuple[str, ...], log: Callable[[str], None]) -> None:
    """Listen at once, load the models, and serve until SIGTERM or Ctrl-C: then stop accepting,
    let the requests in flight end, and return."""
    import uvicorn

    if not is_loopback(host) and not api_key:
        raise FlylocalError(f"--host {host} is reachable from other machines: give --api-key (or FLYLOCAL_API_KEY) "
                            "to serve there")
    check_port(host, port)
    failure: list[BaseException] = []
    servers: list = []                   # the uvicorn server, once built: loading may fail before

    def failed(e: BaseException) -> None:
        failure.append(e)
        for s in servers:
            s.should_exit = True

    def ready() -> Session:
        session = load()
        log(f"ready: {settings.target} on http://{host}:{port}/v1 (drafter {settings.drafter_name}, "
            f"verifier {settings.verifier})")
        return session

    app = create_app(ready, settings, api_key=api_key, max_queue=max_queue, cors_origins=cors_origins,
                     on_failure=failed)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=30))
    servers.append(server)
    if failure:
        server.should_exit = True
    # uvicorn re-raises the signal that stopped it once it has shut down: SIGTERM is a normal
    # end here (exit 0); Ctrl-C stays KeyboardInterrupt.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except SystemExit:
        raise FlylocalError(f"cannot listen on {host}:{port}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.state.worker.stop()
        app.state.worker.thread.join(timeout=60)
    if failure:
        e = failure[0]
        raise e if isinstance(e, FlylocalError) else FlylocalError(f"cannot load the models: {e}")


