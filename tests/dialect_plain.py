"""A test-only API dialect, written as docs/design.md "Adding an API dialect" says: POST /plain
with {"prompt", "max_tokens"} is answered as plain text, streamed as it is generated, and a last
line "[FINISH, N tokens]". A parser and a renderer: everything else is the server's."""

from __future__ import annotations

import dataclasses

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from flylocal.front.serve.app import ApiError, Ask, Endpoint, Exchange
from flylocal.front.serve.events import Done, Text


class PlainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    max_tokens: int | None = None


class Plain(Endpoint):
    name, body, checked, role = "plain", PlainRequest, {"max_tokens": "max_tokens"}, "target"
    media_type, stream_headers = "text/plain; charset=utf-8", {}

    def model(self, body) -> None:
        return None                     # the server's target, always

    def streams(self, body) -> bool:
        return True

    def job(self, x: Exchange) -> Ask:
        ids = x.session.target.tokenize(x.body.prompt)
        self.server.check_fits(ids, x.session, "prompt")
        settings = self.server.settings
        return Ask(dataclasses.replace(settings, max_tokens=x.body.max_tokens or settings.max_tokens), ids)

    async def chunks(self, x: Exchange, events):
        async for event in events:
            if isinstance(event, Text):
                yield event.text
            elif isinstance(event, Done):
                yield f"\n[{event.finish}, {event.n_tokens} tokens]\n"
            else:
                yield f"\n[error: {event.message}]\n"

    def error(self, e: ApiError) -> PlainTextResponse:
        return PlainTextResponse(e.message + "\n", status_code=e.status)


def routes(app, server) -> None:
    server.route(app, ["POST"], "/plain", Plain(server))
