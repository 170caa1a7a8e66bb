"""The Ollama dialect of `flylocal serve`, on the same port: /api/version, /api/tags, /api/show,
/api/ps, /api/chat and /api/generate, so that tools written for ollama get speculative
decoding (`flylocal serve --port 11434` stands in for it).

Requests are pydantic models, checked as the OpenAI dialect's are (flylocal.front.serve.app):
`options` map onto flylocal's settings through the command line's declarations
(flylocal.front.serve.ollama_options): num_ctx is a wish and the options that tune loading are
hints, as in ollama; a field or option flylocal cannot honour is a 400 naming it.
`keep_alive` (a duration or seconds) is how long the model stays loaded after the answer, as in
ollama (flylocal.front.serve.roster); /api/ps reports when each loaded model expires. /api/generate
answers with its `context` (the prompt's ids and the answer's) and continues it when a request
sends it back. Chat and generate stream NDJSON by default (`"stream": false` for one object);
the last object carries ollama's counts and durations (nanoseconds) and flylocal's stats.
Errors are `{"error": "..."}`. /api/pull and /api/delete manage flylocal's own models
(flylocal.front.serve.manage); push, create and copy say flylocal does not do them.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from flylocal.front.serve import tools
from flylocal.front.serve.answer import Whole, logprob_entries, stats_report
from flylocal.front.serve.app import ApiError, Endpoint, Exchange, Server
from flylocal.front.serve.served import held
from flylocal.front.serve.events import Done, Text
from flylocal.front.serve.keys import checked_salt
from flylocal.front.serve.ollama_options import SAMPLING_OPTIONS, checked_keep_alive, keep_seconds, read_options
from flylocal.front.serve.request import Body, Infill, JsonOutput, TopLogprobs
from flylocal.settings import Settings

VERSION = "0.6.0"              # the Ollama API this dialect follows

# How long /api/ps says a model stays loaded: for the server's life, which ollama reports (for
# keep_alive -1) as now plus the longest Go duration, about 292 years ("Forever" in `ollama ps`).
KEPT_LOADED = timedelta(microseconds=(2**63 - 1) // 1000)


# ----- requests -----

class Function(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: dict[str, Any] | str | None = None
    index: int | None = None            # its place among an answer's calls, as ollama numbers them


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    function: Function
    id: str | None = None               # OpenAI-shaped calls (LangChain, Open WebUI send them)
    type: Literal["function"] | None = None
    index: int | None = None            # its place among the calls, where Open WebUI writes it

    def turn(self) -> dict:
        return {"function": self.function.model_dump(exclude_none=True)} | ({"id": self.id} if self.id else {})


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # "thinking": an earlier answer's reasoning, as Continue sends it back; these models have
    # none to render, so it is left out of the conversation
    role: Literal["system", "user", "assistant", "tool", "thinking"]
    content: str | None = None
    images: list | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None     # the call a tool's result answers
    thinking: str | None = None         # an earlier answer's thinking: these models have none to render

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
            out["tool_calls"] = [c.turn() for c in self.tool_calls]
        if self.tool_name:
            out["name"] = self.tool_name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Generation(BaseModel):
    """What /api/chat and /api/generate share. A field it does not know is refused by name (a
    misspelt `optoins` would otherwise change nothing unseen)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    keep_alive: Any = None          # how long ollama keeps a model loaded: flylocal keeps it for good
    # What ollama does with a conversation past the context: flylocal refuses such a prompt in
    # one line (truncate's false) and ends an answer at the context's end (shift's false), as
    # it says, whatever they ask.
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    verifier: str | None = None     # flylocal's own, beside ollama's fields
    drafter: str | None = None
    cache_salt: str | None = None   # vLLM's, here or in options: the prompt cache is shared only with the same salt

    @model_validator(mode="before")
    @classmethod
    def options_inside(cls, data):
        """An option given beside the fields (`"temperature": 0`) is one ollama reads in
        `options` only: refused, saying where it goes."""
        if isinstance(data, dict):
            misplaced = sorted(set(data) & (set(SAMPLING_OPTIONS) | {"num_predict", "num_ctx", "stop"}))
            if misplaced:
                raise ValueError(f"{misplaced[0]}: an option; ollama takes it in \"options\"")
        return data

    @field_validator("keep_alive")
    @classmethod
    def duration(cls, v):
        return checked_keep_alive(v)

    @field_validator("cache_salt")
    @classmethod
    def salt(cls, v):
        return checked_salt(v)

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

    def output(self) -> JsonOutput | None:
        """`format`: "json" (any JSON object) or a JSON schema, in the body's terms."""
        if self.format in (None, ""):
            return None
        return JsonOutput(None if self.format == "json" else self.format, "format")

    def salt_given(self) -> str | None:
        """cache_salt, beside the fields or in `options` (where Open WebUI's custom options go)."""
        inside = (self.options or {}).get("cache_salt")
        if inside is not None and self.cache_salt is not None and inside != self.cache_salt:
            raise ApiError(400, "cache_salt and options.cache_salt differ: give one", param="cache_salt")
        return self.cache_salt if self.cache_salt is not None else inside

    def body(self, **prompt) -> Body:
        """The request as the one request body, with its prompt (`prompt`: Body's fields)."""
        given = read_options(self.options)
        options = {k: v for k, v in (("verifier", self.verifier), ("drafter", self.drafter)) if v is not None}
        return Body(**prompt, load=True, options=options | given.params, logprobs=bool(self.logprobs),
                    top_logprobs=self.top_logprobs, format=self.output(), stops=given.stops, hints=given.hints,
                    salt=self.salt_given(), names={"options": "options", "prompt": "prompt"})


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

    @field_validator("images")
    @classmethod
    def text_only(cls, v):
        if v:
            raise ValueError("flylocal takes a text prompt only (no images)")
        return v

    @field_validator("tools")
    @classmethod
    def no_tools(cls, v):
        if v:
            raise ValueError("/api/generate calls no tools (/api/chat does)")
        return v

    def prompt_fields(self) -> dict:
        """The prompt in the body's terms: with a `suffix`, the middle to fill in; raw, the text
        as it is; else the user's turn (after its system prompt); either after the `context` it
        continues."""
        context = tuple(self.context or ())
        if self.suffix:                 # fill in the middle: the prompt is the text before it
            if context:
                raise ApiError(400, "context: a fill-in-the-middle request (suffix) continues no context",
                               param="context")
            return {"infill": Infill(self.prompt, self.suffix)}
        if not self.prompt:
            return {"messages": []}
        if self.raw:
            return {"text": self.prompt, "context": context}
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"messages": system + [{"role": "user", "content": self.prompt}], "context": context}


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


@functools.lru_cache(maxsize=4)
def model_info(path) -> Any:
    """The GGUF facts of a served model, read once."""
    from flylocal.gguf_info import read_info

    return read_info(path)


class Ollama(Endpoint):
    """An endpoint of the Ollama dialect: its refusals are {"error": "..."}, its models listed
    at /api/tags, named with or without ":latest"."""
    listed, latest = "/api/tags", True
    forbidden = "flylocal does not take the field {param!r}"

    def error(self, e: ApiError) -> JSONResponse:
        return error(e.status, e.message, e.headers)

    def keep_alive(self, body) -> float | None:
        return keep_seconds(getattr(body, "keep_alive", None))

    def entry(self, name: str, path, role: str) -> dict:
        info = model_info(path)
        return {"name": name, "model": name,
                "modified_at": datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(),
                "size": info.file_size, "digest": "", "details": details(info), "flylocal": {"role": role}}


class Version(Ollama):
    name = "ollama_version"

    def job(self, x: Exchange) -> dict:
        return {"version": VERSION}


class Tags(Ollama):
    """/api/tags: every model the server serves, loaded or not."""
    name = "ollama_tags"

    def job(self, x: Exchange) -> dict:
        served = self.server.models.served()
        if any(path is None for _, path, _, _ in served):
            self.server.session()           # 503 while the model that names its file loads
        return {"models": [self.entry(name, path, role) for name, path, role, _ in self.server.models.served()]}


def expires(server: Server, m) -> str:
    """When member `m` unloads if no request comes, as ollama writes it: for good is now plus
    the longest Go duration, about 292 years ("Forever" in `ollama ps`)."""
    at = server.roster.expires_at(m)
    left = KEPT_LOADED if at is None else timedelta(seconds=max(at - server.roster.clock(), 0.0))
    return (datetime.now(timezone.utc) + left).isoformat().replace("+00:00", "Z")


class Ps(Ollama):
    """/api/ps: the loaded models. A target's `size` is the memory it holds with its draft
    (weights, KV cache, compute buffers: what the memory check counts, flylocal.llama.memory)
    and its prompt cache's entries in memory, `size_vram` the part of it on a GPU; `expires_at`
    when its keep-alive ends (far off for good)."""
    name = "ollama_ps"

    def job(self, x: Exchange) -> dict:
        server, out = self.server, []
        if server.single and server.worker is not None and server.worker.session is None:
            server.session()            # 503 while the one model loads at start
        for name, path, role, m in server.models.served():
            if m is None:               # the embedding model: loaded with the first model
                if server.home.runner is not None and out:
                    out.append(self.entry(name, path, role) | {"expires_at": out[0]["expires_at"], "size_vram": 0})
                continue
            worker = m.runner
            if worker is None or worker.session is None or m.closing is not None:
                continue
            size, vram = held(worker)
            cache = worker.cache
            out.append(self.entry(name, path, role) | {
                "expires_at": expires(server, m), "size": size, "size_vram": vram,
                "context_length": worker.session.target.n_ctx,
                "flylocal": {"role": role} | worker.state()
                | {"prompt_cache": cache.report() if cache is not None else None}})
        return {"models": out}


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None         # the older name of `model`
    verbose: bool | None = None


class Show(Ollama):
    """/api/show of any served model, loaded or not (it loads none): a target (completion,
    tools; embedding too where it computes them) or the embedding model (embedding)."""
    name, body, role, model_required, loads = "ollama_show", ShowRequest, ("target", "embedding"), True, False

    def model(self, body: ShowRequest) -> str | None:
        return body.model if body.model is not None else body.name

    def job(self, x: Exchange) -> dict:
        from flylocal.gguf_info import read_chat_template

        server, m = self.server, x.member
        _, roles = server.find(self.model(x.body), latest=True)
        owner = None if roles == {"embedding"} else m
        name, path, role, _ = next(s for s in server.models.served() if s[3] is owner)
        if path is None:
            server.session()            # 503 while the model that names its file loads
        info = model_info(path)
        arch = info.architecture or "unknown"
        if role == "target":
            session = m.runner.session if m.state == "loaded" else None
            if session is not None:
                template, n_ctx = session.target.chat_template() or "", session.target.n_ctx
            else:
                template, n_ctx = read_chat_template(path), m.settings.ctx
            capabilities = ["completion", "tools"] + (["embedding"] if "embedding" in roles else [])
            params = parameters(m.settings, n_ctx)
        else:
            template, n_ctx, capabilities = "", server.settings.ctx, ["embedding"]
            params = {"num_ctx": n_ctx}
        return {"modelfile": modelfile(path, template, params), "parameters": parameter_lines(params),
                "template": template, "details": details(info),
                "model_info": {"general.architecture": arch, "general.parameter_count": info.parameters,
                               f"{arch}.context_length": info.context_length or n_ctx},
                "capabilities": capabilities, "modified_at": self.entry(name, path, role)["modified_at"],
                "flylocal": {"role": role}}


def parameters(settings: Settings, n_ctx: int) -> dict[str, Any]:
    """What a request gets when its options say nothing, in ollama's names: the context each
    request has (what Continue and Open WebUI read as the model's num_ctx), and the server's
    sampling defaults."""
    p = settings.sampling
    out = {"num_ctx": n_ctx, "num_predict": settings.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
           "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repeat_penalty, "repeat_last_n": p.repeat_last_n}
    return out | ({"seed": p.seed} if p.seed is not None else {})


def parameter_lines(params: dict[str, Any]) -> str:
    """/api/show's `parameters`: a line a parameter, its name padded to 30 characters, as ollama
    writes them (and its clients split them on white space)."""
    return "\n".join(f"{name:<30} {json.dumps(value)}" for name, value in params.items())


def modelfile(path, template: str, params: dict[str, Any]) -> str:
    """/api/show's `modelfile`: what ollama would build the served model from."""
    lines = ["# Modelfile of the model flylocal serves (flylocal renders prompts with the model's own chat "
             "template, below)", f"FROM {path}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {name} {json.dumps(value)}" for name, value in params.items()]
    return "\n".join(lines) + "\n"


class Unmanaged(Ollama):
    """push, create, copy: flylocal makes no models of its own."""
    name = "ollama_manage"

    def job(self, x: Exchange):
        what = x.request.url.path.split("/")[2]
        raise ApiError(501, f"flylocal does not make models (/api/{what}): it serves the models it finds, and "
                            "/api/pull fetches those of its models.txt; see `flylocal models`")


class Generate(Ollama):
    """/api/chat (`chat`) and /api/generate."""
    role, model_required, media_type, stream_headers = "target", True, "application/x-ndjson", {}
    checked = {"verifier": "verifier", "drafter": "drafter"}
    chat = True

    def read(self, x: Exchange) -> Body:
        """The request as the one request body; one with no prompt asks only that the model be
        loaded (ollama's way to load a model, which is loaded already)."""
        req = x.body
        if not self.chat:        # the answer's tokens too: its `context` holds them
            return replace(req.body(**req.prompt_fields()), tokens=True)
        if req.messages is None:
            raise ApiError(400, "messages must be a list")
        turns = [m.turn() for m in req.messages if m.role != "thinking"] if req.messages else []
        return req.body(messages=turns, tools=tuple(req.tools or ()))

    def holds(self, x: Exchange) -> bool:
        """An empty request that unloads a model not loaded does not load it first (as ollama)."""
        req = x.body
        empty = not req.messages if self.chat else not (req.prompt or req.suffix or req.context)
        return not (empty and self.keep_alive(req) == 0 and x.member.state in ("unloaded", "unloading"))

    def job(self, x: Exchange):
        return super().job(x) if x.worker is not None else self.loaded(x)

    def loaded(self, x: Exchange) -> JSONResponse:
        """An empty request: the model is loaded (it was, to get here), or with keep_alive 0
        unloaded once no request holds it."""
        unload = self.keep_alive(x.body) == 0
        if unload:
            self.server.roster.unload(x.member)
        head = {"model": x.body.model, "created_at": now(), "done": True, "done_reason": "unload" if unload else "load"}
        return JSONResponse(head | ({"message": {"role": "assistant", "content": ""}} if self.chat
                                    else {"response": ""}))

    def piece(self, x: Exchange, text: str, tokens=()) -> dict:
        head = {"model": x.body.model, "created_at": now()}
        out = head | ({"message": {"role": "assistant", "content": text}} if self.chat else {"response": text})
        if x.ask.settings.logprobs is not None:
            out["logprobs"] = logprob_entries(tokens)
        return out | {"done": False}

    def final(self, x: Exchange, done: Done, text: str = "", made: list[int] = (), tokens=()) -> dict:
        stats = done.stats
        last = self.piece(x, text, tokens) | {
            "done": True, "done_reason": "stop" if done.finish == "tool_calls" else done.finish,
            "total_duration": int((time.perf_counter() - x.started) * 1e9), "load_duration": 0,
            "prompt_eval_count": stats.prompt_evaluated, "prompt_eval_duration": int(stats.prefill_s * 1e9),
            "eval_count": done.n_tokens, "eval_duration": int(stats.decode_s * 1e9),
            "flylocal": stats_report(done, x.ask.settings)}
        if not self.chat:            # what a request sends back to continue from here
            last["context"] = x.ask.ids.tolist() + list(made)
        if done.call is not None and not done.cut:      # a call cut short has no arguments object to give
            last["message"]["tool_calls"] = [{"id": tools.call_id(),
                                              "function": {"index": 0, "name": done.call["name"],
                                                           "arguments": done.call["arguments"]}}]
        return last

    def whole(self, x: Exchange, whole: Whole) -> dict:
        return self.final(x, whole.end, whole.text, [t.id for t in whole.tokens], whole.tokens)

    async def chunks(self, x: Exchange, events):
        made: list[int] = []
        async for event in events:
            if isinstance(event, Text):
                made += [t.id for t in event.tokens]
                yield json.dumps(self.piece(x, event.text, event.tokens)) + "\n"
            elif isinstance(event, Done):
                yield json.dumps(self.final(x, event, made=made)) + "\n"
            else:
                yield json.dumps({"error": event.message}) + "\n"


class Chat(Generate):
    name, body, chat = "ollama_chat", ChatRequest, True


class GenerateText(Generate):
    name, body, chat = "ollama_generate", GenerateRequest, False


def routes(app, server: Server) -> None:
    server.route(app, ["GET"], "/api/version", Version(server))
    server.route(app, ["GET"], "/api/tags", Tags(server))
    server.route(app, ["GET"], "/api/ps", Ps(server))
    server.route(app, ["POST"], "/api/show", Show(server))
    unmanaged = Unmanaged(server)
    for path in ("push", "create", "copy"):
        server.route(app, ["POST", "DELETE", "HEAD"], f"/api/{path}", unmanaged)
    server.route(app, ["POST", "HEAD"], "/api/blobs/{digest}", unmanaged)
    server.route(app, ["POST"], "/api/chat", Chat(server))
    server.route(app, ["POST"], "/api/generate", GenerateText(server))
