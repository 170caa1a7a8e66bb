"""llama-server's small endpoints in `flylocal serve` (docs/serving.md, "llama-server's small
endpoints"), in its request and answer shapes: /tokenize, /detokenize, /apply-template,
/props and /slots. None generates: they read the target's vocabulary and chat template, and
the server's state."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from flylocal import __version__
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str = ""
    add_special: bool = False
    parse_special: bool = True     # llama-server's default: a special token's text is that token
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int] = []


class TemplateRequest(BaseModel):
    """A chat completion's messages and tools; the other fields of one are taken and unused."""
    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class Small(Endpoint):
    """An endpoint of llama-server's: its refusals in its shape, the target's model."""
    role = "target"

    def model(self, body) -> None:
        return None

    def streams(self, body) -> bool:
        return False

    def error(self, e: ApiError):
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"code": e.status, "message": e.message,
                                       "type": "not_supported_error" if e.status == 501 else
                                       "server_error" if e.status >= 500 else "invalid_request_error"}},
                            status_code=e.status, headers=e.headers)


class Tokenize(Small):
    name, body = "tokenize", TokenizeRequest

    def job(self, x: Exchange) -> dict:
        req, target = x.body, x.session.target
        ids = target.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special).tolist()
        if not req.with_pieces:
            return {"tokens": ids}
        out = []
        for t in ids:
            raw = target.piece(t, special=True)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:              # part of a character: its bytes
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return {"tokens": out}


class Detokenize(Small):
    name, body = "detokenize", DetokenizeRequest

    def job(self, x: Exchange) -> dict:
        target = x.session.target
        bad = next((t for t in x.body.tokens if not 0 <= t < target.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: {bad} is no token of this model (0 to {target.n_vocab - 1})", param="tokens")
        text = b"".join(target.piece(t, special=True) for t in x.body.tokens)
        return {"content": text.decode("utf-8", "replace")}


class ApplyTemplate(Small):
    name, body = "apply_template", TemplateRequest

    def job(self, x: Exchange) -> dict:
        target = x.session.target
        try:
            text = target.format_chat(x.body.messages, x.body.tools)
        except Exception as e:          # noqa: BLE001 - a template's own error, about these messages
            raise ApiError(400, f"messages: the chat template cannot render them: {e}", param="messages") from None
        if text is None:
            raise ApiError(400, f"{target.name} has no chat template", param="messages")
        return {"prompt": text}


class Props(Small):
    """GET /props; POST /props changes nothing, as llama-server without --props."""
    name = "props"

    def job(self, x: Exchange) -> dict:
        if x.request.method == "POST":
            raise ApiError(501, "This server does not support changing global properties")
        target, settings = x.session.target, x.session.models.settings
        p = settings.sampling
        params = {"n_predict": settings.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
                  "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repeat_penalty,
                  "repeat_last_n": p.repeat_last_n, "seed": p.seed if p.seed is not None else -1}
        return {"default_generation_settings": {"params": params, "n_ctx": target.n_ctx},
                "total_slots": x.worker.slots, "model_alias": x.member.name,
                "model_path": str(target.path), "chat_template": target.chat_template() or "",
                "bos_token": target.piece(target.bos, special=True).decode("utf-8", "replace") if target.bos >= 0 else "",
                "eos_token": target.piece(target.eos, special=True).decode("utf-8", "replace") if target.eos >= 0 else "",
                "modalities": {"vision": False, "audio": False}, "endpoint_slots": True, "endpoint_props": False,
                "endpoint_metrics": True, "is_sleeping": False, "build_info": f"flylocal {__version__}",
                "flylocal": {"verifier": settings.verifier, "drafter": settings.drafter_name,
                             "draft": settings.draft}}


class Slots(Small):
    """GET /slots: each slot's size, and as many marked `is_processing` as are generating, the
    lowest first (the worker counts its busy slots, not which they are); never what one holds."""
    name = "slots"

    def job(self, x: Exchange) -> list:
        if not self.server.slots_endpoint:
            raise ApiError(501, "This server does not support slots endpoint. Start it with --slots")
        state, n_ctx = x.worker.state(), x.session.target.n_ctx
        return [{"id": i, "n_ctx": n_ctx, "speculative": True, "is_processing": i < state["slots_busy"]}
                for i in range(state["slots"])]


def routes(app, server: Server) -> None:
    server.route(app, ["POST"], "/tokenize", Tokenize(server))
    server.route(app, ["POST"], "/detokenize", Detokenize(server))
    server.route(app, ["POST"], "/apply-template", ApplyTemplate(server))
    server.route(app, ["GET", "POST"], "/props", Props(server))
    server.route(app, ["GET"], "/slots", Slots(server))
