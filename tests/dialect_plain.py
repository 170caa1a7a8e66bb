"""A test-only API dialect, written as docs/design.md "Adding an API dialect" says: POST /plain
with {"prompt", "max_tokens"} is answered as plain text, streamed as it is generated, and a last
line "[FINISH, N tokens]". A request model and a renderer: everything else is the server's."""

from __future__ import annotations

import dataclasses

from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from flylocal.front.serve.app import ApiError, Ask, Server, check_fields, parse_request
from flylocal.front.serve.events import Done, Text


class PlainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    max_tokens: int | None = None


def routes(app, server: Server) -> None:
    @app.post("/plain")
    async def plain(request: Request):
        try:
            server.authorize(request)
            req = parse_request(PlainRequest, await server.body(request))
            check_fields(req, {"max_tokens": "max_tokens"})
            session = server.session()
            ids = session.target.tokenize(req.prompt)
            server.check_fits(ids, session, "prompt")
            settings = dataclasses.replace(server.settings, max_tokens=req.max_tokens or server.settings.max_tokens)
            answer = server.start(Ask(settings, ids))
        except ApiError as e:
            return PlainTextResponse(e.message + "\n", status_code=e.status)

        async def text():
            try:
                async for event in answer.events():
                    if isinstance(event, Text):
                        yield event.text
                    elif isinstance(event, Done):
                        yield f"\n[{event.finish}, {event.n_tokens} tokens]\n"
                    else:
                        yield f"\n[error: {event.message}]\n"
            finally:
                answer.close()

        return StreamingResponse(text(), media_type="text/plain; charset=utf-8")
