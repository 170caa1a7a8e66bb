"""A test-only API dialect, written as docs/serving.md "Adding an API dialect" says: POST /plain
with {"prompt", "max_tokens"} is answered as plain text, streamed as it is generated, and a last
line "[FINISH, N tokens]". A parser (`read`: the request in the server's terms) and a renderer:
everything else, settings, checks, the prompt and its fit included, is the server's."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from flylocal.front.serve.app import ApiError, Endpoint, Exchange
from flylocal.front.serve.request import Body
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

    def read(self, x: Exchange) -> Body:
        given = {"max_tokens": x.body.max_tokens} if x.body.max_tokens is not None else {}
        return Body(text=x.body.prompt, options=given, names={"prompt": None})

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
