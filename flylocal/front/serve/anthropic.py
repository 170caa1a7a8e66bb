"""Anthropic's Messages API in `flylocal serve`: POST /v1/messages and
/v1/messages/count_tokens (docs/serving.md, "Anthropic's Messages"), for Claude Code
(`ANTHROPIC_BASE_URL`), the Anthropic SDKs and the providers built on them.

A parser and a renderer on the one pipeline: `system` (a string or text blocks, and a turn
inside `messages`, as Claude Code sends it), content blocks (text, tool_use, tool_result,
earlier thinking) become the one request body's conversation; `tools` with `input_schema` and
`tool_choice` (auto, any, tool, none) its tools. The answer is Anthropic's message (text, or a
tool_use block), streamed as its events. Headers and fields that change nothing here are
accepted (`anthropic-version`, `anthropic-beta`, `?beta=true`, `cache_control`, `metadata`,
`thinking`: no model here thinks); an image or a document is a 400 naming the block.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flylocal.front.serve.answer import Whole, stats_report
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.fields import checked_stops
from flylocal.front.serve.events import Done, Text
from flylocal.front.serve.openai_requests import CHECKED, Own, checked_identifier, options_of
from flylocal.front.serve.request import Body, JsonOutput

# An error's type, by status, as Anthropic names them.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


# ----- requests -----

class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant", "system"]      # "system": Claude Code's turn inside messages
    content: str | list[dict[str, Any]]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None    # an answer makes one call here at most


class Thinking(BaseModel):
    """Extended thinking: accepted, and honoured by none (no model here thinks)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    user_id: str | None = None

    @field_validator("user_id")
    @classmethod
    def bounded(cls, v):
        return checked_identifier(v)


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured output (`format`) and effort: no model here reasons, so any effort is honoured."""
    model_config = ConfigDict(extra="forbid", strict=True)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


class MessagesRequest(Own):
    """What /v1/messages and its count_tokens take (count_tokens: no max_tokens)."""
    model: str | None = None
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # What changes nothing here: clearing old tool results (Claude Code's), the cache marker (the
    # prompt cache keeps every prefix), cache-miss diagnostics, where and how fast it runs, whose.
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("inference_geo", "user_profile_id", "workspace_id")
    @classmethod
    def bounded_identifier(cls, v):
        return checked_identifier(v)

    @field_validator("stop_sequences")
    @classmethod
    def stops(cls, v):
        if v:
            checked_stops(v)
        return v

    @field_validator("messages")
    @classmethod
    def some(cls, v):
        if not v:
            raise ValueError("messages: at least one message")
        return v


class Refused(ValueError):
    """A block the conversation cannot take: its message names where it is."""


def text_of(content: str | list, where: str, inside: tuple[str, ...] = ("text",)) -> str:
    """The text of a content (a string, or blocks of the kinds `inside`); Refused otherwise."""
    if isinstance(content, str):
        return content
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in inside or not isinstance(block.get("text"), str):
            refuse(block, f"{where}[{i}]")
        out.append(block["text"])
    return "".join(out)


def refuse(block, at: str):
    """Refused, naming a block there is no place for at `at`."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document", "search_result"):
        raise Refused(f"{at}: an {kind} block; flylocal's models read text only")
    raise Refused(f"{at}: {json.dumps(kind)}; a text block ({{\"type\": \"text\", \"text\": ...}}) goes here")


def turns_of(messages: list[Message]) -> list[dict]:
    """The messages as a conversation in chat completions' shapes (flylocal.front.serve.tools):
    a user's tool_result blocks become tool turns, an assistant's tool_use blocks its calls,
    earlier thinking is left out; Refused for a block there is no place for."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if m.role == "system" or isinstance(m.content, str):
            out.append({"role": m.role, "content": text_of(m.content, where)})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise Refused(f"{at}: a tool_use block has an id and a name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m.role == "user":
                out.append(tool_turn(block, at))
            else:
                refuse(block, at)
        if text or calls or m.role == "assistant":
            out.append({"role": m.role, "content": "".join(text)} | ({"tool_calls": calls} if calls else {}))
    return out


def tool_turn(block: dict, at: str) -> dict:
    """A tool_result block as a tool turn: its content (a string or text blocks), marked as an
    error where `is_error` says so."""
    if not isinstance(block.get("tool_use_id"), str):
        raise Refused(f"{at}.tool_use_id: the tool_use this result answers")
    text = text_of(block.get("content", ""), f"{at}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def chat_tools(tools: list[dict] | None) -> list[dict]:
    """Client tools in chat completions' shape; a server tool (web search, code execution, ...)
    is a 400 naming it."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ApiError(400, f"tools[{i}].type: {json.dumps(kind)}; flylocal runs no server tools (give "
                                "name, description and input_schema)", param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools[{i}]: a tool has a name and an input_schema", param=f"tools[{i}]")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                     "parameters": tool["input_schema"]}})
    return out


def chat_choice(choice: ToolChoice | None):
    """tool_choice in chat completions' terms."""
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice.name: type tool names the tool", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if choice.type == "any" else "none"


def placed(head: list[dict], turns: list[dict]) -> list[dict]:
    """A conversation whose `system` turns any chat template renders: those before any other
    turn join the system prompt; a later one (Claude Code's reminders) is the user's words, joined
    to a user turn beside it, so that turns still alternate (templates that take one system
    prompt and alternating turns refuse anything else)."""
    out = list(head)
    for turn in turns:
        if turn["role"] == "system" and all(t["role"] == "system" for t in out):
            if out:
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + turn["content"]}
            else:
                out.append(turn)
            continue
        if turn["role"] == "system":
            turn = {"role": "user", "content": turn["content"]}
        if turn["role"] == "user" and out and out[-1]["role"] == "user" and not out[-1].get("tool_calls"):
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + turn["content"]}
        else:
            out.append(turn)
    return out


def body_of(req: MessagesRequest, sampling: bool = True) -> Body:
    """A request as the one request body (`sampling`: with its options; count_tokens has none)."""
    system = req.system if req.system is not None else ""
    try:
        head = text_of(system, "system")
        turns = turns_of(req.messages)
    except Refused as e:
        raise ApiError(400, str(e), param=str(e).split(":")[0]) from None
    fmt = req.output_config.format if req.output_config is not None else None
    return Body(messages=placed([{"role": "system", "content": head}] if head else [], turns),
                tools=tuple(chat_tools(req.tools)), tool_choice=chat_choice(req.tool_choice),
                format=JsonOutput(fmt.schema_, "output_config.format") if fmt is not None else None,
                options=options_of(req) if sampling else {}, stops=tuple(req.stop_sequences or ()),
                tokens=req.stream, salt=req.cache_salt,
                names={"options": None, "prompt": "messages", "format": "output_config.format"})


# ----- answers -----

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_of(done: Done) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer."""
    if done.reason == "stop_string":
        return "stop_sequence", done.stop
    return STOP_REASONS.get(done.finish, "end_turn"), None


def usage(x: Exchange, done: Done | None) -> dict:
    out = {"input_tokens": len(x.ask.ids), "output_tokens": done.n_tokens if done else 0,
           "cache_read_input_tokens": done.stats.prompt_reused if done else 0, "cache_creation_input_tokens": 0}
    return out | ({"flylocal": stats_report(done, x.ask.settings)} if done else {})


def tool_block(call: dict) -> dict:
    arguments = call["arguments"]
    return {"type": "tool_use", "id": new_id("toolu"), "name": call["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


class Anthropic(Endpoint):
    """An endpoint of this dialect: its refusals in Anthropic's shape."""
    role, checked, body = "target", CHECKED, MessagesRequest
    listed = "/v1/models"

    def error(self, e: ApiError) -> JSONResponse:
        kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                            headers=e.headers)


class Messages(Anthropic):
    name = "messages"

    def read(self, x: Exchange) -> Body:
        if x.body.max_tokens is None:
            raise ApiError(400, "max_tokens: Field required", param="max_tokens")
        return body_of(x.body)

    def head(self, x: Exchange) -> dict:
        return {"id": x.kept or new_id("msg"), "type": "message", "role": "assistant",
                "model": x.body.model or x.member.name}

    def whole(self, x: Exchange, whole: Whole) -> dict:
        done = whole.end
        reason, sequence = stop_of(done)
        content = [tool_block(done.call)] if done.call is not None and not done.cut else \
            [{"type": "text", "text": whole.text}]
        return self.head(x) | {"content": content, "stop_reason": reason, "stop_sequence": sequence,
                               "usage": usage(x, done)}

    async def chunks(self, x: Exchange, events):
        x.kept = new_id("msg")

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind} | fields)}\n\n"

        yield event("message_start", message=self.head(x) | {"content": [], "stop_reason": None,
                                                             "stop_sequence": None, "usage": usage(x, None)})
        index, opened = 0, False
        async for ev in events:
            if isinstance(ev, Text):
                if not opened:
                    opened = True
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield event("ping")
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
            elif isinstance(ev, Done):
                if opened:
                    yield event("content_block_stop", index=index)
                    index += 1
                if ev.call is not None and not ev.cut:
                    block = tool_block(ev.call)
                    yield event("content_block_start", index=index, content_block=block | {"input": {}})
                    yield event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                    yield event("content_block_stop", index=index)
                elif not opened:
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield event("content_block_stop", index=index)
                reason, sequence = stop_of(ev)
                yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage=usage(x, ev))
                yield event("message_stop")
            else:
                yield event("error", error={"type": "api_error", "message": ev.message})


class CountTokens(Anthropic):
    """/v1/messages/count_tokens: the prompt's tokens, as the server would encode it."""
    name = "messages_count_tokens"

    def job(self, x: Exchange) -> dict:
        return {"input_tokens": self.server.count(x.session, body_of(x.body, sampling=False))}


def routes(app, server: Server) -> None:
    server.route(app, ["POST"], "/v1/messages", Messages(server))
    server.route(app, ["POST"], "/v1/messages/count_tokens", CountTokens(server))
