"""OpenAI's Responses API in `flylocal serve`: POST /v1/responses, GET and DELETE
/v1/responses/{id} (docs/serving.md, "Server").

The same generation path as chat completions: the request's `input` items become a
conversation (messages, earlier function calls and their outputs), `instructions` its system
turn (kept by `truncation: "auto"`), `tools` the functions offered and `text.format` the
output's format, in the one request body (Body); the Server's `ask` and `start` do the rest. The answer is one output item: a `message` with its
`output_text`, or one `function_call`.

Responses are kept in memory for the server's life, the last MAX_STORED of them (`store`,
true by default as on OpenAI's), so a request can go on from one (`previous_response_id`: its
conversation, without its instructions, then the new input). Streams carry OpenAI's event
sequence (response.created ... response.completed). Built-in tools and reasoning settings are
refused by name; fields at their do-nothing values are accepted.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flylocal.errors import FlylocalError
from flylocal.front.serve.answer import Whole, logprob_entries, stats_report
from flylocal.front.serve import tools
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.events import Done, Text
from flylocal.front.serve.openai_requests import CHECKED, EFFORTS, Own, checked_identifier, checked_metadata, options_of
from flylocal.front.serve.request import Body, JsonOutput, TopLogprobs

MAX_STORED = 256           # responses kept for previous_response_id, the newest


# ----- requests -----

class Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None                # flylocal's output always follows the schema

    @model_validator(mode="after")
    def fields_of_its_type(self):
        """A schema, its name and description belong to json_schema, which needs a name and a
        schema; given to another type they would be ignored, so they are refused."""
        if self.type == "json_schema":
            missing = [f for f, v in (("name", self.name), ("schema", self.schema_)) if v is None]
            if missing:
                raise ValueError(f"type json_schema needs {' and '.join(missing)}")
        else:
            given = [f for f, v in (("schema", self.schema_), ("name", self.name), ("description", self.description),
                                    ("strict", self.strict)) if v is not None]
            if given:
                raise ValueError(f"{given[0]}: type {self.type} takes none (a schema goes with type json_schema)")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: Format | None = None
    verbosity: Literal["medium"] | None = None


# What `include` may ask for: no reasoning to include; the answer's logprobs.
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs")


class Reasoning(BaseModel):
    """Reasoning settings. flylocal's models run no reasoning mode: any effort is honoured by
    reasoning not at all (0 reasoning tokens), and there is no reasoning to summarize."""
    model_config = ConfigDict(extra="forbid", strict=True)
    effort: Literal[EFFORTS] | None = None
    summary: None = None
    generate_summary: None = None


def check_include(item: str, where: str) -> None:
    if item not in INCLUDABLE:
        raise ApiError(400, f"{where}: {json.dumps(item)}; flylocal can include {' and '.join(INCLUDABLE)}",
                       param="include")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = None    # padding against length side channels: nothing to hide on loopback


class ResponsesRequest(Own):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # an answer makes at most one call here
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: TopLogprobs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None       # the cache is reused by prefix, whatever the key
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    background: Literal[False] | None = None

    @field_validator("input")
    @classmethod
    def some(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v

    @field_validator("metadata")
    @classmethod
    def bounded_metadata(cls, v):
        return checked_metadata(v)

    @field_validator("user", "safety_identifier", "prompt_cache_key")
    @classmethod
    def bounded_identifier(cls, v):
        return checked_identifier(v)

    @field_validator("max_tool_calls")
    @classmethod
    def at_least_one(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"{v}; at least 1")
        return v

    @field_validator("service_tier")
    @classmethod
    def one_tier(cls, v):
        if v not in (None, "auto", "default"):
            raise ValueError(f"{json.dumps(v)}; flylocal has one service tier (auto, default)")
        return v

    def logprobs(self) -> bool:
        """Whether the answer carries logprobs: included, or asked for by a count of tokens."""
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)

    def output(self) -> JsonOutput | None:
        """text.format in the body's terms, or None for free text."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        return JsonOutput(None, "text.format") if fmt.type == "json_object" else \
            JsonOutput(fmt.schema_, f"text.format {fmt.name!r}")


# ----- input items -> a conversation -----

BOOKKEEPING = {"id", "status", "phase", "annotations", "logprobs"}    # item fields that change nothing here
BUILT_IN = {"web_search", "web_search_preview", "file_search", "computer_use_preview", "computer_use",
            "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch"}


TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content, where: str) -> str:
    """A message's content (or a function's output, `where` naming it): a string, or text parts
    (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FlylocalError(f"{where}: a string or a list of text parts, not {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise FlylocalError(f"{where}[{j}]: flylocal takes text parts only "
                                f"(input_text, output_text), not {json.dumps(kind)}")
        extra = sorted(set(part) - {"type", "text", "annotations", "logprobs"})
        if extra:
            raise FlylocalError(f"{where}[{j}].{extra[0]}: flylocal does not support this field")
        if not isinstance(part.get("text"), str):
            raise FlylocalError(f"{where}[{j}].text: a {kind} part's text must be a string")
        out.append(part["text"])
    return "".join(out)


def _fields(item: dict, where: str, allowed: set[str]) -> None:
    extra = set(item) - allowed - BOOKKEEPING - {"type"}
    if extra:
        raise FlylocalError(f"{where}.{sorted(extra)[0]}: flylocal does not support this field")


def turns_of(items: str | list, where: str = "input", landed: list[int] | None = None) -> list[dict]:
    """Input items as a conversation in chat completions' shapes (flylocal.front.serve.tools):
    consecutive function calls become one assistant turn that makes them. `landed`, where
    given, gets the turn each item went into."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        _add_turn(out, item, f"{where}[{i}]")
        if landed is not None:
            landed.append(len(out) - 1)
    return out


def _add_turn(out: list[dict], item: dict, at: str) -> None:
    """One input item onto the conversation `out`."""
    kind = item.get("type", "message")
    if kind == "message":
        _fields(item, at, {"role", "content"})
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise FlylocalError(f"{at}.role: {json.dumps(role)}; user, system, developer or assistant")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _text(item.get("content", ""), f"{at}.content")})
    elif kind == "function_call":
        _fields(item, at, {"call_id", "name", "arguments", "caller", "namespace"})
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise FlylocalError(f"{at}: a function_call has call_id, name and arguments (JSON text)")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
            out[-1]["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        _fields(item, at, {"call_id", "output"})
        if not isinstance(item.get("call_id"), str):
            raise FlylocalError(f"{at}.call_id: the call this output answers")
        out.append({"role": "tool", "tool_call_id": item["call_id"],
                    "content": _text(item.get("output", ""), f"{at}.output")})
    else:
        raise FlylocalError(f"{at}.type: flylocal takes message, function_call and function_call_output "
                            f"items, not {json.dumps(kind)}")


def chat_tools(tools: list | None) -> list[dict]:
    """Function tools in chat completions' shape; a built-in tool is a 400 naming it."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind in BUILT_IN or (kind != "function" and kind is not None):
            raise ApiError(400, f"tools[{i}].type: flylocal runs no built-in tools ({json.dumps(kind)}); "
                                "offer functions (type function)", param=f"tools[{i}].type")
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise ApiError(400, f"tools[{i}].{sorted(extra)[0]}: flylocal does not support this field",
                           param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def chat_choice(choice):
    """tool_choice in chat completions' shape."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise ApiError(400, f"tool_choice: {json.dumps(choice)[:80]}; auto, none, required or "
                                '{"type": "function", "name": ...}', param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ----- responses -----

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
            if status != "in_progress" else []}


def call_item(item_id: str, call: dict) -> dict:
    """A call's output item; one cut short by the token limit is "incomplete"."""
    return {"id": item_id, "type": "function_call", "call_id": "call_" + uuid.uuid4().hex[:24],
            "name": call["name"], "arguments": tools.call_arguments(call),
            "status": "incomplete" if isinstance(call["arguments"], str) else "completed"}


def output_turns(output: list[dict]) -> list[dict]:
    """A response's output items as the conversation's next turns."""
    items = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in output]
    return turns_of(items, "output")


def input_items(given: str | list[dict]) -> list[dict]:
    """A request's `input` as the items GET /v1/responses/{id}/input_items lists: each with an
    id (its own, or a new one) and a status, a message's content as parts."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    out = []
    for item in given:
        kind = item.get("type", "message")
        item = {"type": kind} | {k: v for k, v in item.items() if k != "type"}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}
                               | ({"annotations": []} if part == "output_text" else {})]
        prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
        out.append({"id": item.get("id") or new_id(prefix)} | item | {"status": item.get("status") or "completed"})
    return out


@dataclass
class Stored:
    """A kept response: its body, the conversation it ends (for previous_response_id), its
    request's input items, and the id of the API key it was made with (no other key finds it)."""
    body: dict
    turns: list[dict]
    inputs: list[dict]
    key: str | None = None


class Responses:
    """The responses kept for previous_response_id, by id."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self.kept: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def keep(self, stored: Stored) -> None:
        self.kept[stored.body["id"]] = stored
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def find(self, rid: str, key: str | None, param: str | None = None) -> Stored:
        """The response `rid` kept for the API key whose id is `key`; ApiError 404 otherwise."""
        if rid not in self.kept or self.kept[rid].key != key:
            raise ApiError(404, f"no response with id {rid!r} is kept here (responses are kept in memory, the last "
                                f"{self.limit}, for the server's life)", param=param, code="not_found")
        return self.kept[rid]


@dataclass
class Kept:
    """What a request's job keeps for its renderer: the response's id and time, the
    conversation the request makes (without instructions) and its input items, each with the
    turn it went into (`landed`), until truncation says which are left (`left`)."""
    id: str
    created: float
    turns: list[dict]
    items: list[dict]
    landed: list[int]           # the turn of `turns` each item went into
    inputs: list[dict] | None = None

    def left(self, dropped: int) -> None:
        """The conversation without its first `dropped` turns, and the items left in it."""
        self.turns = self.turns[dropped:]
        self.inputs = input_items([item for item, turn in zip(self.items, self.landed) if turn >= dropped])


class Create(Endpoint):
    name, body, checked, role = "responses", ResponsesRequest, CHECKED, "target"

    def __init__(self, server: Server, kept: Responses):
        super().__init__(server)
        self.kept = kept

    def read(self, x: Exchange) -> Body:
        """The request as the one request body: its earlier responses' conversation, then its
        input items, after its instructions; and what its renderer keeps."""
        req = x.body
        for i, item in enumerate(req.include or ()):
            check_include(item, f"include[{i}]")
        history = self.kept.find(req.previous_response_id, x.key, "previous_response_id").turns \
            if req.previous_response_id is not None else []
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        landed: list[int] = []
        try:
            turns = history + turns_of(items, landed=landed)
        except FlylocalError as e:
            raise ApiError(400, str(e), param="input") from None
        x.kept = Kept(new_id("resp"), time.time(), turns, items, [len(history) + t for t in landed])
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        return Body(messages=system + turns, keep=len(system), truncate=req.truncation == "auto",
                    options=options_of(req), logprobs=req.logprobs(), top_logprobs=req.top_logprobs,
                    format=req.output(), tools=tuple(chat_tools(req.tools)), tool_choice=chat_choice(req.tool_choice),
                    salt=req.cache_salt, names={"options": None, "prompt": "input", "format": "text.format"})

    def job(self, x: Exchange):
        ask = super().job(x)
        x.kept.left(ask.dropped)
        return ask

    def body_of(self, x: Exchange, status: str, output: list[dict], done: Done | None = None,
                error: dict | None = None) -> dict:
        req, ask = x.body, x.ask
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        out = {"id": x.kept.id, "object": "response", "created_at": x.kept.created, "status": status, "error": error,
               "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "model": req.model or x.member.name, "output": output,
               "parallel_tool_calls": bool(req.parallel_tool_calls if req.parallel_tool_calls is not None else True),
               "previous_response_id": req.previous_response_id,
               "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
               "store": req.store is not False, "temperature": ask.settings.sampling.temperature,
               "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
               "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
               "tools": req.tools or [], "top_p": ask.settings.sampling.top_p, "truncation": req.truncation or "disabled",
               "top_logprobs": req.top_logprobs,
               "usage": None, "user": req.user, "metadata": req.metadata or {}}
        if done is not None:
            if done.finish == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            n_in = len(ask.ids)
            out["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": done.stats.prompt_reused},
                            "output_tokens": done.n_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": n_in + done.n_tokens, "flylocal": stats_report(done, ask.settings)}
        return out

    def finish(self, x: Exchange, done: Done, output: list[dict]) -> dict:
        whole = self.body_of(x, "completed", output, done)
        if x.body.store is not False:
            self.kept.keep(Stored(whole, x.kept.turns + output_turns(output), x.kept.inputs, x.key))
        return whole

    def whole(self, x: Exchange, whole: Whole) -> dict:
        done = whole.end
        status = "incomplete" if done.finish == "length" else "completed"
        item = call_item(new_id("fc"), done.call) if done.call is not None \
            else message_item(new_id("msg"), whole.text, status, self.logprobs(x, whole.tokens))
        return self.finish(x, done, [item])

    def logprobs(self, x: Exchange, tokens) -> list[dict]:
        return logprob_entries(tokens) if x.ask.settings.logprobs is not None else []

    async def chunks(self, x: Exchange, events):
        sequence = 0

        def event(kind: str, **fields) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence} | fields
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        msg_id, text, lps, opened = new_id("msg"), [], [], False

        def open_message():
            yield event("response.output_item.added", output_index=0, item=message_item(msg_id, "", "in_progress"))
            yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

        yield event("response.created", response=self.body_of(x, "in_progress", []))
        yield event("response.in_progress", response=self.body_of(x, "in_progress", []))
        async for ev in events:
            if isinstance(ev, Text):
                if not opened:
                    opened = True
                    for line in open_message():
                        yield line
                text.append(ev.text)
                lp = self.logprobs(x, ev.tokens)
                lps += lp
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=ev.text, logprobs=lp)
            elif isinstance(ev, Done):
                if ev.call is not None:
                    item = call_item(new_id("fc"), ev.call)
                    yield event("response.output_item.added", output_index=0, item=item | {"arguments": "",
                                                                                          "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=0,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=0,
                                name=item["name"], arguments=item["arguments"])
                    yield event("response.output_item.done", output_index=0, item=item)
                else:
                    if not opened:
                        opened = True
                        for line in open_message():
                            yield line
                    status = "incomplete" if ev.finish == "length" else "completed"
                    item = message_item(msg_id, "".join(text), status, lps)
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                                text=part["text"], logprobs=lps)
                    yield event("response.content_part.done", item_id=msg_id, output_index=0,
                                content_index=0, part=part)
                    yield event("response.output_item.done", output_index=0, item=item)
                whole = self.finish(x, ev, [item])
                kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
                yield event(kind, response=whole)
            else:
                yield event("response.failed", response=self.body_of(x, "failed", [], error={
                    "code": "server_error", "message": ev.message}))


class Retrieve(Endpoint):
    name = "responses"

    def __init__(self, server: Server, kept: Responses):
        super().__init__(server)
        self.kept = kept

    def job(self, x: Exchange) -> dict:
        return self.kept.find(x.path["rid"], x.key).body


class InputItems(Retrieve):
    """GET /v1/responses/{id}/input_items: the request's input items, in OpenAI's list shape,
    paged by `order` (desc by default), `after` (an item's id) and `limit` (1 to 100, 20)."""
    QUERY = {"order", "after", "limit", "include"}

    def job(self, x: Exchange) -> dict:
        items, query = self.kept.find(x.path["rid"], x.key).inputs, x.request.query_params
        unknown = sorted(set(query) - self.QUERY)
        if unknown:
            raise ApiError(400, f"{unknown[0]}: flylocal does not support this parameter", param=unknown[0])
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order: {order!r}; asc or desc", param="order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ApiError(400, f"limit: {limit!r}; a whole number from 1 to 100", param="limit")
        for value in query.getlist("include"):
            check_include(value, "include")
        items = items if order == "asc" else items[::-1]
        if "after" in query:
            at = next((i for i, item in enumerate(items) if item["id"] == query["after"]), None)
            if at is None:
                raise ApiError(400, f"after: no input item of this response has the id {query['after']!r}",
                               param="after")
            items = items[at + 1:]
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


class Delete(Retrieve):
    def job(self, x: Exchange) -> dict:
        rid = x.path["rid"]
        self.kept.find(rid, x.key)
        del self.kept.kept[rid]
        return {"id": rid, "object": "response.deleted", "deleted": True}


def routes(app, server: Server) -> None:
    kept = Responses()
    server.route(app, ["POST"], "/v1/responses", Create(server, kept))
    server.route(app, ["GET"], "/v1/responses/{rid}", Retrieve(server, kept))
    server.route(app, ["DELETE"], "/v1/responses/{rid}", Delete(server, kept))
    server.route(app, ["GET"], "/v1/responses/{rid}/input_items", InputItems(server, kept))
