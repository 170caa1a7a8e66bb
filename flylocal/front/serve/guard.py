"""What keeps web pages and slow clients out of `flylocal serve` (docs/serving.md, "Server").

A browser lets any page send a "simple" cross-site request without asking first (a POST with
`Content-Type: text/plain`), and a page can reach a server on loopback through DNS rebinding
(its own name, resolved to 127.0.0.1) and read the answers. So, before any work:

- the `Host` header must name this server: 127.0.0.1, localhost or [::1] when it listens on
  loopback, the address it listens on otherwise (any address literal when that is a wildcard:
  rebinding needs a name), and the names given with --allowed-host; otherwise 403;
- a request that carries an `Origin` must come from the server's own origin (http:// and the
  Host it named) or one given with --cors-origin; otherwise 403, on every endpoint;
- a POST must carry `Content-Type: application/json`; otherwise 415. A POST with no
  Content-Type and no Origin at all is read as JSON: it comes from a program (litellm's Ollama
  provider, curl --data-binary), since a browser sends Origin with every POST.

Refusals are in the error shape of the API asked: ollama's `{"error": "..."}` under /api/,
OpenAI's elsewhere.

A client must send its request line, headers and body within REQUEST_TIMEOUT seconds of
connecting (or of the previous response on a kept-alive connection); a slower one is closed.
"""

from __future__ import annotations

import ipaddress
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = 10.0      # seconds for a request's line, headers and body to arrive


def _address(name: str):
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header's name (lower case, an IPv6 literal in brackets) and port (None if none)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value.partition("]")
        name += "]"
        port = rest[1:] if rest.startswith(":") else None
    else:
        name, sep, port = value.rpartition(":")
        if not sep or not port.isdigit():
            name, port = value, None
    if port is not None and not port.isdigit():
        return "", None
    return name, int(port) if port is not None else None


class HostRule:
    """Which Host header values name this server, listening on `host`:`port`."""

    def __init__(self, host: str, port: int, allowed: tuple[str, ...] = ()):
        self.port = port
        bound = host.strip("[]").lower()
        address = _address(bound)
        self.any_address = address is not None and address.is_unspecified
        if bound == "localhost" or (address is not None and address.is_loopback):
            names = {"127.0.0.1", "localhost", "[::1]"}
        elif address is not None and address.version == 6:
            names = {f"[{address.compressed}]", "localhost"} if self.any_address else {f"[{address.compressed}]"}
        else:
            names = {bound, "localhost"} if self.any_address else {bound}
        self.names = names | {name.lower() for name in allowed}

    def __call__(self, value: str | None) -> bool:
        if not value:
            return False
        name, port = split_host(value)
        if port is not None and port != self.port:
            return False
        if name in self.names:
            return True
        return self.any_address and _address(name) is not None


def _refuse(path: str, status: int, message: str, code: str):
    if path.startswith("/api/"):          # the Ollama dialect's shape
        body = json.dumps({"error": message}).encode()
    else:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the Host, Origin and Content-Type rules, answered before the app sees
    the request. `refused(method, path, status, code)` hears of each refusal (the metrics, the
    log)."""

    def __init__(self, app, hosts: HostRule, origins: tuple[str, ...] = (), refused=lambda *refusal: None):
        self.app = app
        self.hosts = hosts
        self.origins = {o.rstrip("/").lower() for o in origins}
        self.refused = refused

    def check(self, scope) -> tuple[int, str, str] | None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.hosts(host):
            return 403, f"the Host header {host!r} does not name this server (--allowed-host adds a name)", "bad_host"
        origin = headers.get(b"origin")
        if origin is not None:
            origin = origin.decode("latin-1").rstrip("/").lower()
            if origin != f"{scope.get('scheme', 'http')}://{host.strip().lower()}" and origin not in self.origins:
                return 403, f"requests from the origin {origin!r} are not allowed (--cors-origin allows one)", \
                    "bad_origin"
        media = headers.get(b"content-type")
        # A POST with neither Content-Type nor Origin is no browser's (a browser sends Origin with
        # every POST) but a program's: its body is read as JSON, as ollama reads it (litellm sends none).
        if scope["method"] == "POST" and (media is not None or origin is not None):
            if (media or b"").decode("latin-1").split(";")[0].strip().lower() != "application/json":
                return 415, "a POST must carry Content-Type: application/json", "unsupported_media_type"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.check(scope)
            if refusal is not None:
                status, message, code = refusal
                self.refused(scope["method"], scope["path"], status, code)
                for event in _refuse(scope["path"], status, message, code):
                    await send(event)
                return
        await self.app(scope, receive, send)


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline: a request whose line, headers and body have not
    all arrived REQUEST_TIMEOUT seconds after the connection opened (or the last response went
    out) has its connection closed."""

    request_timeout = REQUEST_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.request_timeout, self._too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._deadline.cancel()
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.request_timeout, self._too_slow)

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and not self.transport.is_closing():
            self.transport.close()
