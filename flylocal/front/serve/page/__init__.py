"""The chat page at `flylocal serve`'s address (docs/serving.md, "The chat page, inside"): three static
files written for this project (index.html, style.css, app.js), package data, read once and
served with a Content-Security-Policy that lets the page load nothing but them and talk to
nothing but this server. The page speaks the server's own OpenAI API, so the Host and Origin
guards, the API key and the queue apply to it as to any client."""

from __future__ import annotations

from importlib import resources

from fastapi import Request
from fastapi.responses import Response

FILES = {"index.html": "text/html; charset=utf-8", "style.css": "text/css; charset=utf-8",
         "app.js": "text/javascript; charset=utf-8"}

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def routes(app) -> None:
    here = resources.files(__name__)
    files = {name: (here.joinpath(name).read_bytes(), media) for name, media in FILES.items()}

    def send(name: str) -> Response:
        body, media = files[name]
        return Response(body, media_type=media, headers=HEADERS)

    @app.api_route("/", methods=["GET", "HEAD"])     # HEAD: a client's check that the server is up (Claude Code's)
    async def index(request: Request):
        return send("index.html")

    @app.get("/page/{name}")
    async def asset(name: str, request: Request):
        if name not in files or name == "index.html":
            return Response(status_code=404, headers=HEADERS)
        return send(name)

    @app.get("/favicon.ico")
    async def favicon(request: Request):
        return Response(status_code=204)
