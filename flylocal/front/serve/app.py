"""What the two dialects of `flylocal serve` share (flylocal.front.serve.openai,
flylocal.front.serve.ollama): the refused request (ApiError) and the Server, whose calls they
translate requests onto: the API key, request bodies, the checks of settings and prompts,
submitting a job to the worker and the per-request log line."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import PlainTextResponse
from starlette.requests import ClientDisconnect

from flylocal.errors import FlylocalError, OptionError
from flylocal.front.serve.worker import END, Job, Metrics, Refused, Worker
from flylocal.loader import check
from flylocal.session import Session
from flylocal.settings import Settings

MAX_BODY = 4 << 20          # bytes of a request body


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


def failure_message(e: BaseException) -> str:
    return str(e) if isinstance(e, FlylocalError) else f"internal error: {type(e).__name__}"


class Server:
    """What the dialects share: the settings, the worker and its metrics, the key, the log."""

    def __init__(self, load: Callable[[], Session], settings: Settings, api_key: str | None, max_queue: int,
                 on_failure: Callable[[BaseException], None], log: Callable[[str], None] | None):
        self.settings = settings
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
        if self.worker.session is None:
            raise ApiError(503, "the models are still loading", type_="server_error", code="loading",
                           headers={"Retry-After": "1"})
        return self.worker.session

    def names(self, session: Session) -> set[str]:
        """The names a request may give the target by."""
        return {self.settings.target, session.target.name, session.target.name.removesuffix(".gguf")}

    def check_settings(self, settings: Settings, session: Session, param: str | None = None) -> None:
        """Settings a request asked for that no engine can run: a 400 naming the field at fault
        (`param`: the object it sits in, for the Ollama dialect's options)."""
        try:
            check(settings)              # a draft longer than a batch holds, a drafter with no model
        except OptionError as e:
            raise ApiError(400, e.api, param=param or e.option) from None

    def check_fits(self, ids, session: Session, param: str) -> None:
        if len(ids) >= session.target.n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context holds {session.target.n_ctx} "
                                "(--ctx), with room for at least one generated token",
                           param=param, code="context_length_exceeded")

    # ----- running a job -----
    def submit(self, settings: Settings, ids, stops: list[str], tokens: bool = False,
               grammar: tuple[str, str] | None = None) -> tuple[Job, asyncio.Queue]:
        """Queue a generation; its items (flylocal.front.serve.worker) arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:         # the loop is gone (shutdown)
                pass

        job = Job(settings, ids, stops, emit, tokens=tokens, grammar=grammar)
        try:
            self.worker.submit(job)
        except Refused as e:
            raise ApiError(e.status, e.message, type_="server_error", code=e.code, headers=e.headers) from None
        return job, queue

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


@dataclasses.dataclass
class Answer:
    """A whole generation's items, collected for a response that is not streamed."""
    parts: list[str] = dataclasses.field(default_factory=list)     # text pieces
    tokens: list = dataclasses.field(default_factory=list)         # OutTokens, when asked for
    done: tuple | None = None          # ("done", reason, stats, output tokens); None: shut down
    failed: BaseException | None = None


async def collect(request: Request, job: Job, queue: asyncio.Queue) -> Answer:
    """Every item of `job` until its end; a client that goes away meanwhile frees the model
    within a round."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()

    watcher = asyncio.create_task(watch())
    answer = Answer()
    try:
        while (item := await queue.get()) is not END:
            if item[0] == "text":
                answer.parts.append(item[1])
                answer.tokens.extend(item[2])
            elif item[0] == "done":
                answer.done = item
            elif item[0] == "error":
                answer.failed = item[1]
    finally:
        watcher.cancel()
        job.cancel.set()
    return answer


def json_body(model: Any) -> PlainTextResponse:
    """A pydantic model as JSON (pydantic writes a non-finite number, an infinite ASD budget, as
    null: JSON has none)."""
    return PlainTextResponse(model.model_dump_json(), media_type="application/json")
