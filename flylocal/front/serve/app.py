"""What every dialect of `flylocal serve` shares (docs/design.md, "Server"): the refused
request (ApiError), the checks of a request's fields against the command line's declarations,
and the Server whose calls a dialect translates its requests onto:

    authorize -> body -> parse (the dialect's request model) -> Ask -> start -> Answer
              -> the dialect renders Answer.events() or Answer.whole()

A dialect is a request model and a renderer (docs/design.md, "Adding an API dialect")."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from pathlib import Path

import click
import numpy as np
from fastapi import Request
from fastapi.responses import PlainTextResponse
from starlette.requests import ClientDisconnect

from flylocal.errors import FlylocalError, OptionError
from flylocal.front.serve import tools
from flylocal.front.serve.answer import Answer
from flylocal.front.serve.events import Computed, Failed
from flylocal.front.serve.worker import Call, Job, Metrics, Refused, Worker
from flylocal.loader import check
from flylocal.session import Session
from flylocal.settings import OPTIONS, Settings

MAX_BODY = 4 << 20          # bytes of a request body
MAX_STOPS = 4


class ApiError(Exception):
    """A refused request: its status, message, the field it names and a machine-readable code.
    Each dialect renders it in its own shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----- a request's fields, checked as the command line checks them -----

def checked_option(value, option: str):
    """`value` converted by the declared option `option` (its type and range); ValueError with
    the option's own words when it is out of range. A bool is no number."""
    if isinstance(value, bool) and option not in ("verifier", "drafter"):
        raise ValueError(f"{value!r} is not a number")
    try:
        return OPTIONS[option].type.convert(value, None, None)
    except click.BadParameter as e:
        raise ValueError(e.message) from None


def checked_stops(value) -> list[str]:
    """Stop strings: one string, or a list of at most MAX_STOPS non-empty ones; ValueError."""
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if stops is None or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"{json.dumps(value)[:80]}; a string, or a list of at most {MAX_STOPS} non-empty strings")
    return stops


def read_json(raw: bytes) -> dict:
    """A request body as a JSON object, or ApiError 400."""
    try:
        data = json.loads(raw) if raw else {}
    except RecursionError:
        raise ApiError(400, "the request body is nested too deep") from None
    except ValueError:                           # not JSON, not UTF-8, a huge number
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def parse_request(model, raw: bytes, forbidden: str = "flylocal does not support the field {param!r}"):
    """A request body as the pydantic `model`, or ApiError 400 naming the first bad field (and
    its value); `forbidden` words a field the model does not take."""
    from pydantic import ValidationError

    data = read_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # A union's branch shows in the location as its type (`stop.str`); the field is named alone.
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and (x in TYPE_TAGS or "[" in x))) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, forbidden.format(param=param), param=param, code="unsupported_field") from None
        message = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None


def check_fields(req, checked: dict[str, str]) -> None:
    """Each field of `req` named in `checked` (field -> declared option), where it is given,
    within the option's type and range; ApiError 400 naming the field otherwise."""
    for name, option in checked.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        try:
            checked_option(value, option)
        except ValueError as e:
            raise ApiError(400, f"{name}: {e}", param=name) from None


@dataclass(frozen=True)
class Ask:
    """What a request of any dialect asks the worker for, checked."""
    settings: Settings
    ids: np.ndarray                           # [n] int32 prompt ids
    stops: tuple[str, ...] = ()
    grammar: tuple[str, str] | None = None    # (what it is, its llguidance grammar): the output under it
    calls: tuple[str, ...] = ()               # how an answer that is a tool call begins (held back)
    tokens: bool = False                      # per-token details with the text (kinds, logprobs)


class Server:
    """What the dialects share: the settings, the worker and its metrics, the key, the log."""

    def __init__(self, load: Callable[[], Session], settings: Settings, api_key: str | None, max_queue: int,
                 on_failure: Callable[[BaseException], None], log: Callable[[str], None] | None,
                 embedding_model: tuple[str, Path] | None = None):
        self.settings = settings
        # --embedding-model: (the name given, its file); None: the target computes embeddings
        self.embedding_name, self.embedding_model = embedding_model or (None, None)
        self.api_key = api_key
        self.metrics = Metrics()
        self.worker = Worker(load, self.metrics, max_queue, on_failure)
        self.log = log

    # ----- checks, in the order a request meets them -----
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

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

    def session(self) -> Session:
        if self.worker.failed is not None:
            raise ApiError(503, f"the server stopped: {self.worker.failed}", type_="server_error",
                           code="server_failed")
        if self.worker.session is None:
            raise ApiError(503, "the models are still loading", type_="server_error", code="loading",
                           headers={"Retry-After": "1"})
        return self.worker.session

    def names(self, session: Session) -> set[str]:
        """The names a request may give the target by."""
        return {self.settings.target, session.target.name, session.target.name.removesuffix(".gguf")}

    def check_settings(self, settings: Settings, param: str | None = None) -> None:
        """Settings a request asked for that no engine can run: a 400 naming the field at fault
        (`param`: the object it sits in, for the Ollama dialect's options)."""
        try:
            check(settings, self.worker.slots)     # a draft longer than a slot holds, a drafter with no model
        except OptionError as e:
            raise ApiError(400, e.api, param=param or e.option) from None

    def check_fits(self, ids, session: Session, param: str) -> None:
        if len(ids) >= session.target.n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds {session.target.n_ctx} "
                                "(--ctx), with room for at least one generated token",
                           param=param, code="context_length_exceeded")

    # ----- prompts -----
    def chat_prompt(self, session: Session, turns: list[dict], offered: list, choice) -> Ask:
        """The ids of a conversation (OpenAI's message shapes) that offers `offered` tools, and,
        when they can be called, the tools' grammar and how a call begins: an Ask without its
        settings (FlylocalError for a conversation or tools the template cannot take)."""
        plan = tools.plan(turns, offered, choice, session.target.tools_template())
        ids = session.encode(plan.messages, plan.tools)
        if plan.grammar is None:
            return Ask(self.settings, ids)
        return Ask(self.settings, ids, grammar=("the tools' grammar", plan.grammar), calls=plan.call_starts)

    # ----- running a job -----
    def start(self, ask: Ask) -> Answer:
        """Queue a generation; its events arrive in the Answer (ApiError 503 when the queue is full)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        job = Job(ask.settings, ask.ids, list(ask.stops), emit, tokens=ask.tokens, grammar=ask.grammar)
        try:
            self.worker.submit(job)
        except Refused as e:
            raise ApiError(e.status, e.message, type_="server_error", code=e.code, headers=e.headers) from None
        return Answer(job, queue, ask.calls)

    async def compute(self, work: Callable[[Session], Any], request: Request) -> Any:
        """Run `work(session)`, a generator of steps (flylocal.front.serve.worker.Call), on the
        worker thread between the generations' rounds, and return what it returns (ApiError 503
        when the queue is full; an ApiError it raises passes through; another failure is a
        500). A client that goes away meanwhile stops it before its next step."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()

        def emit(event):
            def settle():
                if not result.done():
                    result.set_result(event)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        call = Call(work, emit)
        try:
            self.worker.submit(call)
        except Refused as e:
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

    def answered(self, request: Request, endpoint: str, status: int, started: float, stats=None,
                 prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count a response, and log it: method, path, status, tokens, speed, time."""
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if self.log is None:
            return
        line = f"{request.method} {request.url.path} {status}"
        if stats is not None:
            line += (f" prompt {prompt_tokens} completion {completion_tokens} {stats.tokens_per_s:.1f} tok/s"
                     f" mean accepted length {stats.mean_accepted_length:.2f}")
        self.log(line + f" {time.perf_counter() - started:.2f} s")


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


def json_body(model: Any) -> PlainTextResponse:
    """A pydantic model as JSON (pydantic writes a non-finite number, an infinite ASD budget, as
    null: JSON has none)."""
    return PlainTextResponse(model.model_dump_json(), media_type="application/json")
