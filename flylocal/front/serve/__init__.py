"""`flylocal serve`: the door local tools come through (docs/design.md, "Server").

One Session behind two dialects on one port: OpenAI's API (flylocal.front.serve.openai) and Ollama's
(flylocal.front.serve.ollama). Each only translates requests onto the same calls of the application
(flylocal.front.serve.app); nothing here imports llama.cpp. One generation runs at a time on the
loaded pair: a worker thread takes jobs from a bounded FIFO queue (flylocal.front.serve.worker). Web
pages and slow clients are kept out before any work (flylocal.front.serve.guard).
"""

from __future__ import annotations

import signal
from typing import Callable

from flylocal.errors import FlylocalError
from flylocal.front.serve.app import create_app
from flylocal.llama.net import check_port, is_loopback
from flylocal.session import Session
from flylocal.settings import Settings

__all__ = ["create_app", "serve"]


def serve(load: Callable[[], Session], settings: Settings, host: str, port: int, api_key: str | None,
          max_queue: int, cors_origins: tuple[str, ...], log: Callable[[str], None],
          allowed_hosts: tuple[str, ...] = (), quiet: bool = False) -> None:
    """Listen at once, load the models, and serve until SIGTERM or Ctrl-C: then stop accepting,
    let the requests in flight end, and return."""
    import uvicorn

    from flylocal.front.serve.guard import BoundedH11

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
        shown = f"[{host}]" if ":" in host else host
        log(f"ready: {settings.target} on http://{shown}:{port}/v1 and the Ollama API at http://{shown}:{port}/api "
            f"(drafter {settings.drafter_name}, verifier {settings.verifier})")
        return session

    app = create_app(ready, settings, api_key=api_key, max_queue=max_queue, cors_origins=cors_origins, host=host,
                     port=port, allowed_hosts=allowed_hosts, on_failure=failed, log=None if quiet else log)
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
        app.state.worker.stop()
        app.state.worker.thread.join(timeout=60)
    if failure:
        e = failure[0]
        raise e if isinstance(e, FlylocalError) else FlylocalError(f"cannot load the models: {e}")
