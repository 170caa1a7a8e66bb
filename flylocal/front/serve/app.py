"""What every dialect of `flylocal serve` shares (docs/serving.md, "Server"): the refused
request (ApiError), the checks of a request's fields against the command line's declarations,
the Endpoint a dialect writes, and the Server, whose `handle` takes every request through
one pipeline:

    authorize -> body -> parse (the endpoint's request model) -> model check
              -> job: an Ask (a generation: the parser's Body, through Server.ask), a Compute
                 (embeddings) or the reply itself
              -> start -> whole or stream (the endpoint renders) -> failure -> log line

A dialect is a parser and a renderer (docs/serving.md, "Adding an API dialect")."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from flylocal.errors import FlylocalError, OptionError
from flylocal.front.serve.answer import Answer
from flylocal.front.serve.events import Computed, Done, Event, Failed, Text
from flylocal.front.serve.fields import ApiError, check_fields, parse_request
from flylocal.front.serve.keys import Keys
from flylocal.front.serve.request import Body, Refusal, grammar_for, prompt_for, settings_for
from flylocal.front.serve.roster import CannotLoad, Member, names_of
from flylocal.front.serve.served import Served
from flylocal.front.serve.worker import Call, Job, Metrics, Refused, Worker
from flylocal.loader import check
from flylocal.session import Session
from flylocal.settings import Settings

MAX_BODY = 4 << 20          # bytes of a request body
# Options that tune how a model is loaded or run (context, threads, batches, memory, devices), as
# Ollama names them: flylocal sets them when the server starts, so a request's value is a hint
# that changes nothing (the log says so once per option: Server.hint). The command line's option
# for it, where it has one.
LOADING_OPTIONS = {"num_ctx": "--ctx", "num_gpu": "--gpu-layers", "main_gpu": None, "num_thread": "--threads",
                   "num_batch": "--batch-size", "num_keep": None, "use_mmap": None, "use_mlock": None, "numa": None,
                   "low_vram": None, "f16_kv": None, "vocab_only": None, "logits_all": None, "num_gqa": None}
@dataclass(frozen=True)
class Ask:
    """What a request of any dialect asks the worker for, checked."""
    settings: Settings
    ids: np.ndarray                           # [n] int32 prompt ids
    stops: tuple[str, ...] = ()
    grammar: tuple[str, str] | None = None    # (what it is, its llguidance grammar): the output under it
    calls: tuple[str, ...] = ()               # how an answer that is a tool call begins (held back)
    tokens: bool = False                      # per-token details with the text (kinds, logprobs)
    partition: str | None = ""                # whose prompt-cache cells it may reuse (Keys.partition)
    dropped: int = 0                          # messages truncation left out (Prompt.dropped)


@dataclass(frozen=True)
class Compute:
    """A job that is not a generation: `work(session)`, a generator of steps run on the worker
    thread between the generations' rounds (flylocal.front.serve.worker.Call). `cancel` is set
    when its client goes away: the worker stops it before its next step, and work that runs
    long within one step reads it too."""
    work: Callable
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Exchange:
    """One request on its way through Server.handle: what an endpoint's job and renderer read."""
    request: Request
    started: float
    body: Any = None                # the parsed request (the endpoint's model); None without one
    session: Session | None = None  # set for an endpoint that names a model
    ask: Ask | None = None          # the generation it asked for
    kept: Any = None                # what the endpoint's job keeps for its renderer
    key: str | None = None          # the id of the API key it came with (Keys.identify)
    member: Member | None = None    # the model it runs on, held until `release()` (Server.hold)
    worker: Worker | None = None    # ... and that model's worker
    release: Callable[[], None] | None = None

    @property
    def path(self) -> dict:
        return self.request.path_params


class Endpoint:
    """One endpoint of a dialect: a parser and a renderer; Server.handle does the rest.

    - `name`: its label in the metrics; `body`: the pydantic model of its request (None: no body
      is read), refused fields worded by `forbidden`; `checked`: request field -> the declared
      option whose type and range it must satisfy;
    - `role`: the model a request may name ("target", "embedding", a tuple of both; None:
      names none), required
      when `model_required`, looked up without ollama's ":latest" when `latest`, and `listed`
      where the models are listed;
    - `read(x)`: a generation's request as the one request body (Body: its parser), which the
      server turns into an Ask, or the reply itself; `loaded(x)`: the reply to a body that asks
      only that the model be loaded (Body.load);
    - `job(x)`: what isn't a generation: a Compute, or the reply itself (a dict, a pydantic model, a
      Response); an ApiError refuses it;
    - `whole(x, result)`: the reply to a whole answer (a Whole) or to a Compute (its value);
    - `chunks(x, events)`: a streamed answer's text pieces, from its events (Text ... Done |
      Failed); a request streams when `streams(body)`;
    - `error(e)`: a refusal in the dialect's shape."""

    name = ""
    body: type[BaseModel] | None = None
    forbidden = "flylocal does not support the field {param!r}"
    checked: dict[str, str] = {}
    role: str | tuple[str, ...] | None = None
    loads = True                        # the model it names is loaded for it (False: only named)
    model_required = False
    latest = False
    listed = "/v1/models"
    media_type = "text/event-stream"
    stream_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    def __init__(self, server: "Server"):
        self.server = server

    def model(self, body) -> str | None:
        return body.model

    def streams(self, body) -> bool:
        return bool(body is not None and body.stream)

    def holds(self, x: Exchange) -> bool:
        """Whether the model the request names (x.member) is loaded and held for it."""
        return self.loads

    def keep_alive(self, body) -> float | None:
        """How long the model stays loaded after this request, in seconds (negative: for good;
        None: its own keep-alive). Ollama's requests say it; the others do not."""
        return None

    def read(self, x: Exchange) -> Any:
        raise NotImplementedError

    def job(self, x: Exchange) -> Any:
        """A generation's request as the worker's Ask, the same way for every dialect."""
        body = self.read(x)
        if not isinstance(body, Body):
            return body
        ask = self.server.ask(x.session, body, x.key)
        return ask if ask is not None else self.loaded(x)

    def loaded(self, x: Exchange) -> Any:
        raise NotImplementedError

    def whole(self, x: Exchange, result) -> Any:
        raise NotImplementedError

    def chunks(self, x: Exchange, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        raise NotImplementedError

    def error(self, e: ApiError) -> Response:
        """OpenAI's shape."""
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def reply(value: Any) -> Response:
    """A reply as a response: as it is, a pydantic model as JSON (which writes a non-finite
    number as null), anything else through json (which refuses one)."""
    if isinstance(value, Response):
        return value
    if isinstance(value, BaseModel):
        return PlainTextResponse(value.model_dump_json(), media_type="application/json")
    return JSONResponse(value)


class Server:
    """What the dialects share: the settings, the models (a Roster of them, each loaded in a
    worker of its own), the metrics, the keys, the log."""

    def __init__(self, load: Callable[[], Session] | None, settings: Settings, keys: Keys, max_queue: int,
                 on_failure: Callable[[BaseException], None], log: Callable[[str], None] | None,
                 embedding_model: tuple[str, Path] | None = None, open_cache=lambda session: None,
                 slots_endpoint: bool = True, members: list[Member] | None = None, budget: int | None = None,
                 manage: bool = True, say: Callable[[str], None] | None = None):
        """`load` builds the one model's Session (a one-model server, as --target: loaded now,
        kept for the server's life unless a request unloads it, its failure the server's); or
        `members`, every model it serves (the first loaded now, the others when named; each
        one's failure its own), within `budget` bytes (None: no bound). `say` takes the
        loads' and unloads' lines (default: `log`); `manage`: /api/pull and /api/delete answer."""
        self.settings = settings
        # --embedding-model: (the name given, its file); None: the target computes embeddings
        self.embedding_name, self.embedding_model = embedding_model or (None, None)
        self.keys = keys
        self.metrics = Metrics()
        self.log = log
        self.hinted: set[str] = set()       # ollama's loading options a request gave, logged once each
        self.slots_endpoint = slots_endpoint    # GET /slots answers (--slots)
        self.manage = manage
        self.models = Served(load, settings, members, budget, self.metrics, max_queue, on_failure, open_cache,
                             say or log or (lambda s: None), embedding_model, log)
        self.roster = self.models.roster

    @property
    def home(self) -> Member:
        """The model a request that names none gets: the one loaded at start."""
        return self.models.home

    @property
    def single(self) -> bool:
        return self.models.single

    @property
    def worker(self) -> Worker | None:
        return self.models.home.runner

    # ----- checks, in the order a request meets them -----
    def authorize(self, request: Request) -> str | None:
        """The id of the request's key (None where the server has none), from `Authorization:
        Bearer KEY` or Anthropic's `x-api-key: KEY`; ApiError 401 without one."""
        given = request.headers.get("authorization") or \
            ("Bearer " + request.headers["x-api-key"] if "x-api-key" in request.headers else "")    # Anthropic's
        try:
            return self.keys.identify(given)
        except ValueError:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key") from None

    async def body(self, request: Request) -> bytes:
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

    def session(self, worker: Worker | None = None) -> Session:
        """The loaded session of `worker` (default: the first model's); ApiError 503 while it
        loads, or after it failed."""
        worker = worker or self.worker
        if worker is None:
            raise ApiError(503, "the model is not loaded", type_="server_error", code="loading",
                           headers={"Retry-After": "1"})
        if worker.failed is not None:
            raise ApiError(503, f"the server stopped: {worker.failed}", type_="server_error",
                           code="server_failed")
        if worker.session is None:
            raise ApiError(503, "the models are still loading", type_="server_error", code="loading",
                           headers={"Retry-After": "1"})
        return worker.session

    def find(self, name: str, latest: bool = False) -> tuple[Member, set[str]] | None:
        """The member a request's model name names and what it does here: a target generates;
        it computes embeddings too without --embedding-model, whose own name computes them on
        the first member. None where no served model has that name."""
        name = str(name)
        if self.embedding_model is not None:
            path = self.embedding_model
            if name in (self.embedding_name, path.name, path.name.removesuffix(".gguf")):
                return self.home, {"embedding"}
        m = self.roster.find(name.removesuffix(":latest") if latest else name)
        if m is None:                   # the loaded file's own name (a one-model server's)
            m = next((m for m in self.roster.loaded() if m.runner.session is not None and
                      name in names_of(m.runner.session.target.name)), None)
        if m is None:
            return None
        return m, {"target"} | (set() if self.embedding_model is not None else {"embedding"})

    def check_model(self, endpoint: Endpoint, x: Exchange) -> Member:
        """The member a request names (the first without a name) when it runs in the endpoint's
        role; ApiError 400 when a required name is missing or names the model of another role,
        404 when it is no model of this server. A one-model server answers 503 while it loads,
        before it knows its model's file names."""
        if self.single and self.home.runner is not None and self.home.runner.session is None:
            self.session(self.home.runner)
        name = endpoint.model(x.body)
        if name is None:
            if endpoint.model_required:
                raise ApiError(400, "model is required", param="model")
            return self.home
        found = self.find(name, endpoint.latest)
        if found is None:
            served = ("this server runs " + self.settings.target
                      + (f" and {self.embedding_name} (embeddings)" if self.embedding_name else "")) if self.single \
                else f"this server has {len(self.roster.members)} models"
            raise ApiError(404, f"model {name!r} not found: {served}; GET {endpoint.listed} lists its models",
                           param="model", code="model_not_found")
        member, roles = found
        wanted = endpoint.role if isinstance(endpoint.role, tuple) else (endpoint.role,)
        if not roles & set(wanted):
            does = "computes embeddings" if "embedding" in roles else "generates text"
            raise ApiError(400 if "embedding" in roles else 404,
                           f"the model {name!r} {does} here, not what {x.request.url.path} asks for; "
                           f"GET {endpoint.listed} lists the models of this server", param="model",
                           code="model_not_supported" if "embedding" in roles else "model_not_found")
        return member

    async def hold(self, endpoint: Endpoint, x: Exchange) -> None:
        """The member the request names (x.member), loaded and held for it (x.worker, x.session)
        until `x.release()`; ApiError 500 naming the file when it cannot load."""
        member = x.member
        keep = endpoint.keep_alive(x.body)
        try:
            worker = await self.roster.acquire(member, keep)
        except CannotLoad as e:
            raise ApiError(500, str(e), type_="server_error", code="model_load_failed") from None
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.roster.release(member)

        x.member, x.worker, x.release = member, worker, release
        if worker.failed is not None and not self.single:      # it died since: the next request loads it again
            self.roster.unload(member)
        x.session = self.session(worker)

    # ----- the pipeline -----
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        """A request through authorize, body, parse, model check and hold, job, start, whole or
        stream, failure and the log line. The model held is released when the request ends: by
        its job's last event where it has one (the worker's), here otherwise."""
        x = Exchange(request, time.perf_counter())
        try:
            x.key = self.authorize(request)
            if endpoint.body is not None:
                x.body = parse_request(endpoint.body, await self.body(request), endpoint.forbidden)
                check_fields(x.body, endpoint.checked)
            if endpoint.role is not None:
                x.member = self.check_model(endpoint, x)
                if endpoint.holds(x):
                    await self.hold(endpoint, x)
            job = endpoint.job(x)
            if inspect.isawaitable(job):        # a job that waits (a load, a pull)
                job = await job
            if isinstance(job, Compute):
                out = reply(endpoint.whole(x, await self.compute(job, request, x)))
            elif not isinstance(job, Ask):
                out = reply(job)
            else:
                x.ask = job
                answer = self.start(job, x)
                if endpoint.streams(x.body):
                    return StreamingResponse(self._stream(x, endpoint, answer), media_type=endpoint.media_type,
                                             headers=endpoint.stream_headers)
                whole = await answer.whole(request)
                if whole.gone:
                    raise ApiError(499, "the client went away", code="client_closed")
                if not isinstance(whole.end, Done):
                    raise failure(whole.end.error if whole.end is not None else None)
                out = reply(endpoint.whole(x, whole))
                self.answered(x, endpoint.name, 200, whole.end)
                return out
        except FlylocalError as e:          # a request no engine can run, found late
            return self._refuse(x, endpoint, ApiError(400, str(e)))
        except ApiError as e:
            return self._refuse(x, endpoint, e)
        finally:
            if x.release is not None:       # no job took the model over
                x.release()
        self.answered(x, endpoint.name, 200)
        return out

    async def _stream(self, x: Exchange, endpoint: Endpoint, answer: Answer) -> AsyncIterator[str]:
        end: list[Event] = []

        async def events():
            async for event in answer.events():
                if not isinstance(event, Text):
                    end.append(event)
                yield event

        try:
            async for piece in endpoint.chunks(x, events()):
                yield piece
        finally:
            answer.close()          # a client that went away frees the model within a round
            last = end[0] if end else None
            # no end: the client went away first (499, what nginx logs for it)
            self.answered(x, endpoint.name, 499 if last is None else 200 if isinstance(last, Done) else 500,
                          last if isinstance(last, Done) else None)

    def _refuse(self, x: Exchange, endpoint: Endpoint, e: ApiError) -> Response:
        self.answered(x, endpoint.name, e.status)
        return endpoint.error(e)

    def route(self, app, methods: list[str], path: str, endpoint: Endpoint) -> None:
        """Serve `endpoint` at `path`."""
        async def handler(request: Request):
            return await self.handle(request, endpoint)

        app.add_api_route(path, handler, methods=methods)

    def check_settings(self, settings: Settings, slots: int, param: str | None = None) -> None:
        """Settings a request asked for that no engine can run on `slots` slots: a 400 naming
        the field at fault (`param`: the object it sits in, for the Ollama dialect's options)."""
        try:
            check(settings, slots)     # a draft longer than a slot holds, a drafter with no model
        except OptionError as e:
            raise ApiError(400, e.api, param=param or e.option) from None

    def check_fits(self, ids, session: Session, param: str) -> None:
        if len(ids) >= session.target.n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds {session.target.n_ctx} "
                                "(--ctx), with room for at least one generated token",
                           param=param, code="context_length_exceeded")

    # ----- requests -----
    def hint(self, names: tuple[str, ...]) -> None:
        """Log, once per option for the server's life, that a request's loading option
        (LOADING_OPTIONS) changes nothing."""
        new = [name for name in names if name not in self.hinted]
        if not new:
            return
        self.hinted.update(new)
        if self.log is not None:
            flags = sorted({LOADING_OPTIONS[n] for n in new if LOADING_OPTIONS.get(n)})
            self.log(f"options {', '.join(new)}: taken as hints, which change nothing here: flylocal sets how its "
                     "models are loaded and run when it starts" + (f" ({', '.join(flags)})" if flags else ""))

    def ask(self, session: Session, body: Body, key: str | None = None) -> Ask | None:
        """A request's body, checked, as the worker's job (docs/serving.md, "Adding an API dialect"):
        its settings, checked to run; its output's grammar; its prompt encoded (with the tools'
        grammar where a tool may be called), truncated where it asks, checked to fit. `key`: the
        id of its API key, which with its salt draws its prompt-cache partition. None for a body
        that asks only that the model be loaded (its settings checked)."""
        target = session.target
        try:
            settings = settings_for(body, session.models.settings, target.n_ctx, target.n_vocab)
            self.check_settings(settings, target.n_seq, param=body.names.get("options"))
            self.hint(body.hints)
            if body.load and body.empty():
                return None
            grammar = grammar_for(body)
            prompt = prompt_for(session, body, target.n_ctx - min(settings.max_tokens, target.n_ctx // 2))
        except Refusal as e:
            raise ApiError(400, e.message, param=e.param) from None
        self.check_fits(prompt.ids, session, body.name("prompt"))
        return Ask(settings, prompt.ids, body.stops, prompt.grammar or grammar, prompt.calls,
                   tokens=body.tokens or settings.logprobs is not None, partition=self.keys.partition(key, body.salt),
                   dropped=prompt.dropped)

    def count(self, session: Session, body: Body) -> int:
        """The tokens of a body's prompt, encoded as `ask` would (Anthropic's count_tokens)."""
        try:
            return len(prompt_for(session, body, session.target.n_ctx).ids)
        except Refusal as e:
            raise ApiError(400, e.message, param=e.param) from None

    # ----- running a job -----
    def start(self, ask: Ask, x: Exchange) -> Answer:
        """Queue a generation on the model `x` holds, which it releases with its last event; its
        events arrive in the Answer (ApiError 503 when the queue is full)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        release = self._handed(x)

        def emit(event):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
                if isinstance(event, (Done, Failed)):
                    loop.call_soon_threadsafe(release)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        job = Job(ask.settings, ask.ids, list(ask.stops), emit, tokens=ask.tokens, grammar=ask.grammar,
                  partition=ask.partition)
        try:
            x.worker.submit(job)
        except Refused as e:
            release()
            raise ApiError(e.status, e.message, type_="server_error", code=e.code, headers=e.headers) from None
        return Answer(job, queue, ask.calls)

    @staticmethod
    def _handed(x: Exchange) -> Callable[[], None]:
        """`x`'s release, handed over to its job (the handler no longer releases)."""
        release, x.release = x.release or (lambda: None), None
        return release

    async def compute(self, job: Compute, request: Request, x: Exchange) -> Any:
        """Run `job.work(session)`, a generator of steps (flylocal.front.serve.worker.Call), on the
        worker thread between the generations' rounds, and return what it returns (ApiError 503
        when the queue is full; an ApiError it raises passes through; another failure is a
        500). A client that goes away meanwhile sets `job.cancel`: the work stops before its
        next step."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        release = self._handed(x)

        def emit(event):
            def settle():
                release()
                if not result.done():
                    result.set_result(event)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        call = Call(job.work, emit, job.cancel)
        try:
            x.worker.submit(call)
        except Refused as e:
            release()
            raise ApiError(e.status, e.message, type_="server_error", code=e.code, headers=e.headers) from None

        gone = []

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.append(True)
            call.cancel.set()

        watcher = asyncio.create_task(watch())
        try:
            event = await result
        finally:
            watcher.cancel()
            call.cancel.set()            # a handler cancelled (shutdown): the work stops before its next step
        if gone:
            raise ApiError(499, "the client went away", code="client_closed")
        if isinstance(event, Failed):
            if isinstance(event.error, ApiError):
                raise event.error
            raise failure(event.error)
        assert isinstance(event, Computed)
        return event.value

    def answered(self, x: Exchange, endpoint: str, status: int, done: Done | None = None) -> None:
        """Count a response, and log it: method, path, status, tokens, speed, time."""
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if self.log is None:
            return
        line = f"{x.request.method} {x.request.url.path} {status}"
        if done is not None:
            stats = done.stats
            line += (f" prompt {len(x.ask.ids)} completion {done.n_tokens} {stats.tokens_per_s:.1f} tok/s"
                     f" mean accepted length {stats.mean_accepted_length:.2f}")
        self.log(line + f" {time.perf_counter() - x.started:.2f} s")


def failure(e: BaseException | None) -> ApiError:
    """How an answer that did not end is refused: a grammar the vocabulary cannot serve (400),
    a failure (500), the server shutting down first (503)."""
    from flylocal.errors import GrammarError

    if e is None:
        return ApiError(503, "the server is shutting down", type_="server_error")
    if isinstance(e, GrammarError):
        return ApiError(400, str(e))
    return ApiError(500, str(e) if isinstance(e, FlylocalError) else f"internal error: {type(e).__name__}",
                    type_="server_error")
