"""The Ollama dialect of `flylocal serve`, on the same port: /api/version, /api/tags, /api/show,
/api/ps, /api/chat and /api/generate, so that tools written for ollama get speculative
decoding (`flylocal serve --port 11434` stands in for it).

Requests are pydantic models, checked as the OpenAI dialect's are (flylocal.front.serve.app):
`options` map onto flylocal's settings through the command line's declarations; an option at
its do-nothing value is accepted, a field or option flylocal cannot honour is a 400 naming it.
`keep_alive` is checked (a duration or seconds) and asks nothing more: the models stay loaded
for the server's life, which /api/ps reports as ollama reports keep_alive -1. /api/generate
answers with its `context` (the prompt's ids and the answer's) and continues it when a request
sends it back. Chat and generate stream NDJSON by default (`"stream": false` for one object);
the last object carries ollama's counts and durations (nanoseconds) and flylocal's stats.
Errors are `{"error": "..."}`. flylocal does not manage models here: pull, push, create, copy and
delete say so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import click
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, field_validator

from flylocal.errors import FlylocalError
from flylocal.front.serve.answer import stats_report
from flylocal.front.serve.app import (ApiError, Ask, Server, check_fields, checked_option, checked_stops, failure,
                                      parse_request, read_json)
from flylocal.front.serve.events import Done, Text
from flylocal.settings import OPTIONS, Settings

VERSION = "0.6.0"              # the Ollama API this dialect follows

# option -> the declared option that checks it (and the sampling field it sets)
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "seed": "seed", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty"}
# options whose value here changes nothing
IDLE = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "num_keep": None, "penalize_newline": None,
        "use_mmap": None, "use_mlock": None, "numa": False, "low_vram": False, "f16_kv": True,
        "vocab_only": False, "main_gpu": 0}
AT_START = {"num_gpu": "--gpu-layers", "num_thread": "--threads", "num_batch": "--batch-size"}
# keep_alive: a Go duration ("5m", "1h30m", "-1s"), or seconds (a number, or a string of one)
DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+|[-+]?\d+")
# How long /api/ps says a model stays loaded: for the server's life, which ollama reports (for
# keep_alive -1) as now plus the longest Go duration, about 292 years ("Forever" in `ollama ps`).
KEPT_LOADED = timedelta(microseconds=(2**63 - 1) // 1000)


# ----- requests -----

def whole(value) -> int:
    """A JSON number that is an integer (2, or 2.0) as an int; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):          # 1.5, Infinity, NaN
        raise ValueError(f"{json.dumps(value)[:80]} is not a whole number")
    return int(value)


def checked_keep_alive(value):
    """keep_alive as ollama takes it: a duration ("5m", "1h30m", "-1" for ever) or a number of
    seconds, or None; ValueError naming it otherwise."""
    number = (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, float) and math.isfinite(value))
    if value is None or number or (isinstance(value, str) and DURATION.fullmatch(value.strip())):
        return value
    raise ValueError(f"{json.dumps(value)[:80]}; a duration (\"5m\", \"1h\", \"-1\" for ever) or a number of "
                     "seconds")


def sampling_option(name: str, value):
    """An option of SAMPLING_OPTIONS checked by its declaration (a JSON number, a whole one for
    an integer option); ValueError naming the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{json.dumps(value)[:80]} is not a number")
    option = SAMPLING_OPTIONS[name]
    if isinstance(OPTIONS[option].type, click.types.IntParamType):
        value = whole(value)
        if name == "seed" and value == -1:
            return None                         # ollama's (and llama.cpp's) "a random seed"
    return checked_option(value, option)


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: dict[str, Any] | str | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    function: Function


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None

    @field_validator("images")
    @classmethod
    def no_images(cls, v):
        if v:
            raise ValueError("flylocal takes text only (no images)")
        return v

    def turn(self) -> dict:
        """The message as the session renders it."""
        out = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_name:
            out["name"] = self.tool_name
        return out


class Generation(BaseModel):
    """What /api/chat and /api/generate share."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    keep_alive: Any = None          # how long ollama keeps a model loaded: flylocal keeps it for good
    verifier: str | None = None     # flylocal's own, beside ollama's fields
    drafter: str | None = None

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, v):
        return checked_keep_alive(v)

    @field_validator("think")
    @classmethod
    def no_thinking(cls, v):
        if v not in (None, False):
            raise ValueError(f"{json.dumps(v)}; flylocal runs no thinking mode")
        return v

    @field_validator("format")
    @classmethod
    def json_or_schema(cls, v):
        if v not in (None, "", "json") and not isinstance(v, dict):
            raise ValueError(f"{json.dumps(v)[:80]}; \"json\" or a JSON schema")
        return v

    def grammar(self) -> tuple[str, str] | None:
        """`format`: "json" (any JSON object) or a JSON schema; (what it is, its grammar)."""
        from flylocal.decoding.grammar import json_output

        if self.format in (None, ""):
            return None
        return json_output() if self.format == "json" else json_output(self.format, "format")

    def settings(self, base: Settings, n_ctx: int) -> tuple[Settings, tuple[str, ...]]:
        """The server's settings with the request's options applied, and its stop strings."""
        check_fields(self, {"verifier": "verifier", "drafter": "drafter"})
        sampling: dict[str, Any] = {}
        top = {k: v for k, v in (("verifier", self.verifier), ("drafter", self.drafter)) if v is not None}
        stops: list[str] = []
        no_penalties = False
        for name, value in (self.options or {}).items():
            try:
                if name in SAMPLING_OPTIONS:
                    sampling[name] = sampling_option(name, value)
                elif name == "num_predict":
                    value = whole(value)
                    if value < -2 or value == 0:
                        raise ValueError(f"{value}; a positive count, or -1 (to the context's end)")
                    top["max_tokens"] = n_ctx if value < 0 else value
                elif name == "stop":
                    stops = checked_stops(value)
                elif name == "num_ctx":
                    # The context is made once, at start: a request that needs at most that much has it.
                    value = whole(value)
                    if value < 1:
                        raise ValueError(f"{value}; a positive count of tokens")
                    if value > n_ctx:
                        raise ValueError(f"{value}; this server's context holds {n_ctx} tokens (flylocal serve --ctx)")
                elif name == "repeat_last_n":
                    value = whole(value)
                    if value < -1:
                        raise ValueError(f"{value}; a count of tokens, -1 (the context) or 0 (no penalties)")
                    if value == 0:
                        no_penalties = True
                    else:
                        sampling["repeat_last_n"] = n_ctx if value == -1 else value
                elif name in IDLE:
                    if IDLE[name] is not None and value != IDLE[name]:
                        raise ValueError(f"{value!r}; flylocal does not offer it (only {IDLE[name]!r})")
                elif name in AT_START:
                    raise ValueError(f"set when the server starts (flylocal serve {AT_START[name]})")
                else:
                    raise ValueError("flylocal does not support this option")
            except (ValueError, OverflowError) as e:      # OverflowError: an integer no float holds
                raise ApiError(400, f"options.{name}: {e}", param="options") from None
        if no_penalties:                # ollama's repeat_last_n 0: the penalties look at no tokens
            sampling.update(repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        settings = dataclasses.replace(base, **top, sampling=dataclasses.replace(base.sampling, **sampling),
                                       trace=False)
        return settings, tuple(stops)


class ChatRequest(Generation):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list | None = None
    suffix: str | None = None
    tools: list | None = None
    template: str | None = None
    context: list[int] | None = None     # an earlier answer's `context`: the ids it continues

    @field_validator("template")
    @classmethod
    def own_template(cls, v):
        if v:
            raise ValueError("flylocal renders a prompt with the model's own chat template (\"raw\": true sends "
                             "a prompt as it is)")
        return v

    @field_validator("images", "suffix")
    @classmethod
    def text_only(cls, v):
        if v:
            raise ValueError("flylocal takes a text prompt only (no images, no suffix)")
        return v

    @field_validator("tools")
    @classmethod
    def no_tools(cls, v):
        if v:
            raise ValueError("/api/generate calls no tools (/api/chat does)")
        return v

    def history(self, n_vocab: int) -> np.ndarray:
        """`context` as ids ([n] int32), each one of the vocabulary's; ApiError 400 otherwise."""
        bad = next((t for t in self.context or () if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"context: {bad} is no token of this model (0 to {n_vocab - 1}); send back the "
                                "context an answer gave", param="context")
        return np.array(self.context or (), dtype=np.int32)


def next_turn(target, prompt: str) -> np.ndarray | None:
    """The chat template's ids after an assistant's answer: the end of that turn, the user's
    `prompt` and the start of the next answer ([n] int32), read off a conversation rendered with
    and without them; None for a template whose earlier turns are not a prefix of the later ones."""
    ask = [{"role": "user", "content": "a"}]
    first = target.tokenize_chat(ask)
    answer = target.tokenize("b", add_special=False)
    full = target.tokenize_chat(ask + [{"role": "assistant", "content": "b"}, {"role": "user", "content": prompt}])
    end = len(first) + len(answer)
    if len(full) <= end or not np.array_equal(full[:end], np.concatenate([first, answer])):
        return None
    return full[end:]


def generate_ids(session, req: GenerateRequest) -> np.ndarray:
    """The ids ([n] int32) of a /api/generate prompt, after the `context` it continues: raw (or
    for a model with no template) the prompt's text follows on; otherwise it is the user's next
    turn, as the chat template renders a conversation."""
    target = session.target
    history = req.history(target.n_vocab)
    if req.raw or not session.has_template:
        return np.concatenate([history, target.tokenize(req.prompt, add_special=not len(history),
                                                        parse_special=False)]).astype(np.int32)
    if not len(history):
        return target.tokenize_chat(([{"role": "system", "content": req.system}] if req.system else [])
                                    + [{"role": "user", "content": req.prompt}])
    if req.system:
        raise ApiError(400, "system: the context a request continues holds its system prompt (give system with "
                            "the first request)", param="system")
    turn = next_turn(target, req.prompt)
    if turn is None:
        raise ApiError(400, f"context: the chat template of {target.name} does not render a conversation turn "
                            "after turn, so a context cannot be continued (/api/chat takes the conversation)",
                       param="context")
    return np.concatenate([history, turn]).astype(np.int32)


# ----- answers -----

def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def details(info) -> dict:
    family = info.architecture or "unknown"
    params = info.parameters
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family],
            "parameter_size": size, "quantization_level": info.file_type}


def routes(app, server: Server) -> None:
    settings = server.settings
    info_cache: dict = {}

    def model_info(session) -> Any:
        if "info" not in info_cache:
            from flylocal.gguf_info import read_info

            info_cache["info"] = read_info(session.target.path)
        return info_cache["info"]

    def entry(session) -> dict:
        info = model_info(session)
        path = session.target.path
        return {"name": settings.target, "model": settings.target,
                "modified_at": datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(),
                "size": info.file_size, "digest": "", "details": details(info)}

    def find(session, name) -> None:
        if name is None:
            raise ApiError(400, "model is required")
        given = str(name).removesuffix(":latest")
        if given not in server.names(session):
            raise ApiError(404, f"model '{name}' not found: this server runs {settings.target}")

    async def guarded(request: Request, endpoint: str, work):
        started = time.perf_counter()
        try:
            server.authorize(request)
            return await work(started)
        except ApiError as e:
            server.answered(request, endpoint, e.status, started)
            return error(e.status, e.message, e.headers)

    @app.get("/api/version")
    async def version(request: Request):
        async def work(started):
            return {"version": VERSION}
        return await guarded(request, "ollama_version", work)

    @app.get("/api/tags")
    async def tags(request: Request):
        async def work(started):
            return {"models": [entry(server.session())]}
        return await guarded(request, "ollama_tags", work)

    @app.get("/api/ps")
    async def ps(request: Request):
        async def work(started):
            session = server.session()
            expires = (datetime.now(timezone.utc) + KEPT_LOADED).isoformat().replace("+00:00", "Z")
            return {"models": [entry(session) | {"expires_at": expires, "size_vram": 0,
                                                 "context_length": session.target.n_ctx,
                                                 "flylocal": server.worker.state()}]}
        return await guarded(request, "ollama_ps", work)

    @app.post("/api/show")
    async def show(request: Request):
        async def work(started):
            data = read_json(await server.body(request))
            session = server.session()
            find(session, data.get("model", data.get("name")))
            info = model_info(session)
            arch = info.architecture or "unknown"
            return {"modelfile": "", "parameters": "", "template": session.target.chat_template() or "",
                    "details": details(info),
                    "model_info": {"general.architecture": arch, "general.parameter_count": info.parameters,
                                   f"{arch}.context_length": info.context_length or session.target.n_ctx},
                    "capabilities": ["completion", "tools"], "modified_at": entry(session)["modified_at"]}
        return await guarded(request, "ollama_show", work)

    for path in ("pull", "push", "create", "copy", "delete", "blobs/{digest}"):
        def refuse(request: Request, path=path):
            return error(501, f"flylocal does not manage models (/api/{path.split('/')[0]}): it serves the models "
                              f"it was started with; see `flylocal models`")
        app.add_api_route(f"/api/{path}", refuse, methods=["POST", "DELETE", "HEAD"] if path != "blobs/{digest}"
                          else ["POST", "HEAD"])

    def ask_of(req: Generation, chat: bool) -> Ask | None:
        """The request, checked, as the worker's job; None when it has no prompt (ollama's way
        to load a model, which is loaded already)."""
        session = server.session()
        find(session, req.model)
        run, stops = req.settings(settings, session.target.n_ctx)
        server.check_settings(run, param="options")
        grammar = req.grammar()
        if chat:
            if req.messages is None:
                raise ApiError(400, "messages must be a list")
            if not req.messages:
                return None
            if req.tools and grammar is not None:
                raise ApiError(400, "format and tools: flylocal constrains an answer to one of them")
            ask = server.chat_prompt(session, [m.turn() for m in req.messages], req.tools or [], "auto")
            if ask.grammar is None:
                ask = dataclasses.replace(ask, grammar=grammar)
        else:
            if not req.prompt:
                return None
            # the answer's tokens too: its `context` holds them
            ask = Ask(settings, generate_ids(session, req), grammar=grammar, tokens=True)
        server.check_fits(ask.ids, session, "prompt")
        return dataclasses.replace(ask, settings=run, stops=stops)

    async def generation(request: Request, endpoint: str, chat: bool):
        started = time.perf_counter()
        try:
            server.authorize(request)
            req = parse_request(ChatRequest if chat else GenerateRequest, await server.body(request))
            ask = ask_of(req, chat)
            if ask is None:
                return load_only(chat)
            answer = server.start(ask)
        except FlylocalError as e:
            server.answered(request, endpoint, 400, started)
            return error(400, str(e))
        except ApiError as e:
            server.answered(request, endpoint, e.status, started)
            return error(e.status, e.message, e.headers)

        def piece(text: str) -> dict:
            head = {"model": req.model, "created_at": now()}
            if chat:
                return head | {"message": {"role": "assistant", "content": text}, "done": False}
            return head | {"response": text, "done": False}

        def final(done: Done, text: str = "", made: tuple[int, ...] | list[int] = ()) -> dict:
            stats = done.stats
            last = piece(text) | {
                "done": True, "done_reason": "stop" if done.call is not None else done.finish,
                "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                "prompt_eval_count": stats.prompt_evaluated, "prompt_eval_duration": int(stats.prefill_s * 1e9),
                "eval_count": done.n_tokens, "eval_duration": int(stats.decode_s * 1e9),
                "flylocal": stats_report(done, ask.settings)}
            if not chat:            # what a request sends back to continue from here
                last["context"] = ask.ids.tolist() + list(made)
            if done.call is not None:
                last["message"]["tool_calls"] = [{"function": {"name": done.call["name"],
                                                               "arguments": done.call["arguments"]}}]
            return last

        if not req.stream:
            whole = await answer.whole(request)
            done = whole.end
            if not isinstance(done, Done) or whole.gone:
                e = ApiError(499, "the client went away") if whole.gone else \
                    failure(done.error if done is not None else None)
                server.answered(request, endpoint, e.status, started)
                return error(e.status, e.message)
            server.answered(request, endpoint, 200, started, done.stats, len(ask.ids), done.n_tokens)
            return JSONResponse(final(done, whole.text, [t.id for t in whole.tokens]))

        async def lines():
            done, status, made = None, 200, []
            try:
                async for event in answer.events():
                    if isinstance(event, Text):
                        made += [t.id for t in event.tokens]
                        yield json.dumps(piece(event.text)) + "\n"
                    elif isinstance(event, Done):
                        done = event
                        yield json.dumps(final(event, made=made)) + "\n"
                    else:
                        status = 500
                        yield json.dumps({"error": event.message}) + "\n"
            finally:
                answer.close()
                if done is None and status == 200:
                    status = 499       # the client went away first
                server.answered(request, endpoint, status, started, done and done.stats, len(ask.ids),
                                done.n_tokens if done else 0)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def load_only(chat: bool) -> JSONResponse:
        """No prompt: ollama's way to load a model; here it is loaded already."""
        head = {"model": settings.target, "created_at": now(), "done": True, "done_reason": "load"}
        return JSONResponse(head | ({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}))

    @app.post("/api/chat")
    async def chat(request: Request):
        return await generation(request, "ollama_chat", chat=True)

    @app.post("/api/generate")
    async def generate(request: Request):
        return await generation(request, "ollama_generate", chat=False)
