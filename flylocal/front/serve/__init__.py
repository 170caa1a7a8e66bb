"""`flylocal serve`: the door local tools come through (docs/serving.md, "Server").

The models it serves (every model found, or the one --target names: flylocal.front.serve.catalog)
behind API dialects on one port: OpenAI's chat and completions (flylocal.front.serve.openai), its
Responses API (flylocal.front.serve.responses), Ollama's (flylocal.front.serve.ollama), Anthropic's
Messages (flylocal.front.serve.anthropic), and llama-server's /infill, small endpoints and model
management (flylocal.front.serve.infill, .tokens, .manage); embeddings for both
(flylocal.front.serve.embeddings). A dialect is a request model and a renderer: it translates
requests onto the Server's calls (flylocal.front.serve.app) and renders the typed events of one
answer stream (flylocal.front.serve.answer, .events); its `routes(app, server)` is all the
application knows of it. Nothing here imports llama.cpp. Each loaded model has a worker thread
(flylocal.front.serve.worker) that runs up to --parallel generations at once in shared decodes,
taking jobs from a bounded FIFO queue; which models are loaded, within --models-memory, is the
Roster's (flylocal.front.serve.roster, .served). Web pages and slow clients are kept out before
any work (flylocal.front.serve.guard).
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flylocal.errors import FlylocalError
from flylocal.front.serve import anthropic, embeddings, infill, ollama, openai, page, responses, tokens
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve import catalog
from flylocal.front.serve.manage import routes as manage_routes
from flylocal.front.serve.roster import Member
from flylocal.front.serve.guard import Guard, HostRule
from flylocal.front.serve.keys import Keys
from flylocal.llama.net import check_port, is_loopback
from flylocal.front.serve.cache import CacheOptions, open_cache
from flylocal.session import Session
from flylocal.settings import Settings

__all__ = ["DIALECTS", "create_app", "serve"]

DIALECTS = (openai, responses, ollama, anthropic, infill, tokens)


class MetricsPage(Endpoint):
    """/metrics: Prometheus's text format."""
    name = "metrics"

    def job(self, x: Exchange) -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(self.server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(load: Callable[[], Session] | list[Member], settings: Settings, *, api_key: str | None = None,
               api_keys: tuple[str, ...] = (), cache_share: str | None = None, max_queue: int = 16, cors_origins: tuple[str, ...] = (), host: str = "127.0.0.1", port: int = 8080,
               allowed_hosts: tuple[str, ...] = (), on_failure: Callable[[BaseException], None] = lambda e: None,
               log: Callable[[str], None] | None = None, dialects=DIALECTS,
               embedding_model: tuple[str, Path] | None = None, prompt_cache: CacheOptions = CacheOptions(),
               slots: bool = True, budget: int | None = None, manage: bool = True, say=None, adopt=None):
    """The application. `load` builds the Session, on the worker thread, while the server
    already answers /health ("loading"); `on_failure` hears if it fails. Or `load` is the
    members of a server of several models (flylocal.front.serve.catalog), the first loaded so,
    within `budget` bytes; `say` takes the lines of their loads and unloads (default: `log`);
    `manage`: /api/pull and /api/delete answer; `adopt(name, file)` makes the member of a model
    /api/pull fetched (None: a pulled model is not served until a restart). `host` and `port` are
    where it listens (the Host rule), `log` takes a line per request (None: quiet), `dialects`
    the APIs it speaks (modules with `routes(app, server)`), `embedding_model` the model that
    computes embeddings (its name and file; None: the target), `prompt_cache` where the slots'
    cells are kept when they take other prompts (flylocal.front.serve.cache). `api_key` and
    `api_keys` are the keys a request must carry one of, `cache_share` who shares the prompt
    cache (flylocal.front.serve.keys); `slots` whether GET /slots answers (--slots)."""
    said = log or (lambda line: None)
    keys = Keys(((api_key,) if api_key else ()) + tuple(api_keys), cache_share)
    several = isinstance(load, list)
    server = Server(None if several else load, settings, keys, max_queue, on_failure, log, embedding_model,
                    lambda session: open_cache(session.models.target, session.models.draft, prompt_cache, said),
                    slots_endpoint=slots, members=load if several else None, budget=budget, manage=manage,
                    say=say)
    server.models.adopter = adopt
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await server.roster.stop()      # every model unloaded, its slots kept on disk (--prompt-cache)

    app = FastAPI(title="flylocal", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    # Outermost: nothing runs, not even CORS, for a request a web page could have made.
    def refused(method: str, path: str, status: int, code: str) -> None:
        server.metrics.requests.labels("refused", str(status)).inc()
        if log is not None:
            log(f"{method} {path} {status} refused ({code})")

    app.add_middleware(Guard, hosts=HostRule(host, port, allowed_hosts), origins=cors_origins, refused=refused)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):      # 404, 405 ... in OpenAI's shape
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": str(e.detail)}, status_code=e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=None).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):      # never a traceback on the wire
        message = f"internal error: {type(e).__name__}"
        if request.url.path.startswith("/api/"):               # ollama's shape where its clients read
            return JSONResponse({"error": message}, status_code=500)
        return JSONResponse(ApiError(500, message, type_="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        worker = server.worker
        if worker is None:                  # the first model was unloaded: the server still serves
            return {"status": "ready"} | server.models.state()
        if worker.failed is not None and server.single:
            return JSONResponse({"status": "failed", "error": str(worker.failed)}, status_code=503)
        if worker.session is None and worker.failed is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready"} | (worker.state() if worker.session is not None else {}) | server.models.state()

    server.route(app, ["GET"], "/metrics", MetricsPage(server))
    for dialect in dialects:
        dialect.routes(app, server)
    manage_routes(app, server)
    embeddings.routes(app, server)
    page.routes(app)
    return app


def serve(load: Callable[[], Session] | list[Member], settings: Settings, host: str, port: int, api_key: str | None,
          max_queue: int, cors_origins: tuple[str, ...], log: Callable[[str], None],
          allowed_hosts: tuple[str, ...] = (), quiet: bool = False,
          embedding_model: tuple[str, Path] | None = None, prompt_cache: CacheOptions = CacheOptions(),
          api_keys: tuple[str, ...] = (), cache_share: str | None = None, slots: bool = True,
          budget: int | None = None, manage: bool = True, adopt=None) -> None:
    """Listen at once, load the model (or the first of `load`'s members, the others when
    named), and serve until SIGTERM or Ctrl-C: then stop accepting, let the requests in flight
    end, and return."""
    import uvicorn

    from flylocal.front.serve.guard import BoundedH11

    if not is_loopback(host) and not (api_key or api_keys):
        raise FlylocalError(f"--host {host} is reachable from other machines: give --api-key (or FLYLOCAL_API_KEY) "
                            "or --api-key-file to serve there")
    Keys(((api_key,) if api_key else ()) + tuple(api_keys), cache_share)     # a bad --cache-share before listening
    check_port(host, port)
    failure: list[BaseException] = []
    servers: list = []                   # the uvicorn server, once built: loading may fail before

    def failed(e: BaseException) -> None:
        failure.append(e)
        for s in servers:
            s.should_exit = True

    shown = f"[{host}]" if ":" in host else host

    said: list[bool] = []

    def ready(session: Session, name: str, settings: Settings) -> Session:
        if said:                         # a reload after an unload: the Roster logs it
            return session
        said.append(True)
        slots = session.target.n_seq
        how = ("--parallel auto: memory for that many contexts of --ctx " f"{settings.ctx}, up to 4"
               if settings.parallel == 0 else "--parallel")
        log(f"ready: {name} on http://{shown}:{port}/v1 and the Ollama API at http://{shown}:{port}/api "
            f"(drafter {settings.drafter_name}, verifier {settings.verifier}; "
            f"{slots} request{'s' if slots > 1 else ''} at once, {how})")
        return session

    if isinstance(load, list):
        first = load[0]
        first.load = (lambda opener: lambda: ready(opener(), first.name, first.settings))(first.load)
        log(catalog.serving_line(load, budget))
        opened = load
    else:
        opened = lambda: ready(load(), settings.target, settings)      # noqa: E731

    app = create_app(opened, settings, api_key=api_key, api_keys=api_keys, cache_share=cache_share,
                     max_queue=max_queue, cors_origins=cors_origins, host=host, port=port, allowed_hosts=allowed_hosts,
                     on_failure=failed, log=None if quiet else log, embedding_model=embedding_model,
                     prompt_cache=prompt_cache, slots=slots, budget=budget, manage=manage, say=log, adopt=adopt)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           http=BoundedH11, timeout_graceful_shutdown=30))
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
        app.state.server.models.stop()
    if failure:
        e = failure[0]
        raise e if isinstance(e, FlylocalError) else FlylocalError(f"cannot load the models: {e}")

