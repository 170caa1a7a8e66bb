"""The Ollama dialect of `flylocal serve`, on the same port: /api/version, /api/tags, /api/show,
/api/ps, /api/chat and /api/generate, so that tools written for ollama get speculative
decoding (`flylocal serve --port 11434` stands in for it).

Chat and generate stream NDJSON by default (`"stream": false` for one object); the last object
carries ollama's counts and durations (nanoseconds) and flylocal's stats. `options` map onto
flylocal's settings; an option at its do-nothing value is accepted, one flylocal cannot honour
is an error naming it. Errors are `{"error": "..."}`. flylocal does not manage models here:
pull, push, create, copy and delete say so.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from flylocal.errors import FlylocalError, GrammarError
from flylocal.front.serve import tools
from flylocal.front.serve.app import ApiError, Server, collect, failure_message
from flylocal.front.serve.worker import END
from flylocal.settings import OPTIONS, Settings

VERSION = "0.6.0"              # the Ollama API this dialect follows
DONE = {"eog": "stop", "stop_string": "stop", "max_tokens": "length", "context": "length"}

# option -> (the declared option that checks it, where it goes)
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "seed": "seed", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty"}
# options whose value here changes nothing
IDLE = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "num_keep": None, "penalize_newline": None,
        "use_mmap": None, "use_mlock": None, "numa": False, "low_vram": False, "f16_kv": True,
        "vocab_only": False, "main_gpu": 0}
AT_START = {"num_gpu": "--gpu-layers", "num_thread": "--threads", "num_batch": "--batch-size"}


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def body_of(raw: bytes) -> dict:
    try:
        data = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def checked(name: str, value, option: str):
    import click

    if isinstance(value, bool):
        raise ApiError(400, f"options.{name}: {value!r} is not a number")
    try:
        return OPTIONS[option].type.convert(value, None, None)
    except click.BadParameter as e:
        raise ApiError(400, f"options.{name}: {e.message}") from None


def run_settings(base: Settings, data: dict, n_ctx: int) -> tuple[Settings, list[str]]:
    """The server's settings with a request's `options` applied, and its stop strings."""
    options = data.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    sampling: dict[str, Any] = {}
    top: dict[str, Any] = {}
    stops: list[str] = []
    for name, value in options.items():
        if name in SAMPLING_OPTIONS:
            sampling[SAMPLING_OPTIONS[name]] = checked(name, value, SAMPLING_OPTIONS[name])
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value < -2 or value == 0:
                raise ApiError(400, f"options.num_predict: {value!r}; a positive count, or -1 (to the context's end)")
            top["max_tokens"] = n_ctx if value < 0 else value
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
                raise ApiError(400, f"options.stop: {json.dumps(value)}; at most 4 non-empty strings")
        elif name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool) or value > n_ctx:
                raise ApiError(400, f"options.num_ctx: {value!r}; this server's context holds {n_ctx} tokens "
                                    "(flylocal serve --ctx)")
        elif name == "repeat_last_n":
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ApiError(400, f"options.repeat_last_n: {value!r}")
            sampling["repeat_last_n"] = n_ctx if value == -1 else value
        elif name in IDLE:
            if IDLE[name] is not None and value != IDLE[name]:
                raise ApiError(400, f"options.{name}: {value!r}; flylocal does not offer it (only {IDLE[name]!r})")
        elif name in AT_START:
            raise ApiError(400, f"options.{name}: set when the server starts (flylocal serve {AT_START[name]})")
        else:
            raise ApiError(400, f"options.{name}: flylocal does not support this option")
    if data.get("think") not in (None, False):
        raise ApiError(400, f"think: {json.dumps(data['think'])}; flylocal runs no thinking mode")
    for own in ("verifier", "drafter"):              # flylocal's own, beside ollama's fields
        if own in data:
            top[own] = checked(own, data[own], own)
    settings = dataclasses.replace(base, **top, sampling=dataclasses.replace(base.sampling, **sampling), trace=False)
    return settings, stops


def output_grammar(data: dict) -> tuple[str, str] | None:
    """`format`: "json" (any JSON object) or a JSON schema; (what it is, its grammar)."""
    from flylocal.decoding import grammar as G

    fmt = data.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return "the JSON object", G.json_object()
    if isinstance(fmt, dict):
        return "format", G.checked(G.json_schema(fmt, "format"), "format")
    raise ApiError(400, f"format: {json.dumps(fmt)[:80]}; \"json\" or a JSON schema")


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
            return {"models": [entry(session) | {"expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                                                 "context_length": session.target.n_ctx}]}
        return await guarded(request, "ollama_ps", work)

    @app.post("/api/show")
    async def show(request: Request):
        async def work(started):
            data = body_of(await server.body(request))
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

    for path in ("pull", "push", "create", "copy", "delete", "embed", "embeddings", "blobs/{digest}"):
        def refuse(request: Request, path=path):
            what = "compute embeddings" if path.startswith("embed") else "manage models"
            return error(501, f"flylocal does not {what} (/api/{path.split('/')[0]}): it serves the models it was "
                              f"started with; see `flylocal models`")
        app.add_api_route(f"/api/{path}", refuse, methods=["POST", "DELETE", "HEAD"] if path != "blobs/{digest}"
                          else ["POST", "HEAD"])

    async def generation(request: Request, endpoint: str, chat: bool):
        started = time.perf_counter()
        try:
            server.authorize(request)
            data = body_of(await server.body(request))
            session = server.session()
            find(session, data.get("model"))
            n_ctx = session.target.n_ctx
            run, stops = run_settings(settings, data, n_ctx)
            grammar, calls = output_grammar(data), ()     # calls: how an answer that is a tool call begins
            server.check_settings(run, session, param="options")
            stream = data.get("stream", True)
            if not isinstance(stream, bool):
                raise ApiError(400, f"stream: {json.dumps(stream)} is not true or false")
            if chat:
                messages = data.get("messages")
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list")
                turns = []
                for m in messages:
                    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                            or not isinstance(m.get("content") or "", str):
                        raise ApiError(400, f"messages: {json.dumps(m)[:80]}; a message has a role (system, user, "
                                            "assistant, tool) and text content")
                    if m.get("images"):
                        raise ApiError(400, "messages: flylocal takes text only (no images)")
                    turn = {"role": m["role"], "content": m.get("content") or ""}
                    made = m.get("tool_calls")
                    if made:
                        if not isinstance(made, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                                 and isinstance(c["function"].get("name"), str)
                                                                 for c in made):
                            raise ApiError(400, "messages: tool_calls is a list of {\"function\": {\"name\", \"arguments\"}}")
                        turn["tool_calls"] = made
                    if m.get("tool_name"):
                        turn["name"] = m["tool_name"]
                    turns.append(turn)
                if not turns:
                    return load_only(started, chat)
                if data.get("tools") and grammar is not None:
                    raise ApiError(400, "format and tools: flylocal constrains an answer to one of them")
                offered = data.get("tools") or []
                if not isinstance(offered, list):
                    raise ApiError(400, "tools must be a list")
                tool_plan = tools.plan(turns, offered, "auto", session.target.tools_template())
                ids = session.encode(tool_plan.messages, tool_plan.tools)
                if tool_plan.grammar is not None:
                    grammar, calls = ("the tools' grammar", tool_plan.grammar), tool_plan.call_starts
            else:
                if data.get("tools"):
                    raise ApiError(400, "tools: /api/generate calls no tools (/api/chat does)")
                prompt = data.get("prompt", "")
                if not isinstance(prompt, str):
                    raise ApiError(400, "prompt must be a string")
                if data.get("images") or data.get("suffix"):
                    raise ApiError(400, "flylocal takes a text prompt only (no images, no suffix)")
                if not prompt:
                    return load_only(started, chat)
                system = data.get("system")
                if data.get("raw") or not session.has_template:
                    ids = session.target.tokenize(prompt, add_special=True, parse_special=False)
                else:
                    ids = session.target.tokenize_chat(([{"role": "system", "content": system}] if system else [])
                                                       + [{"role": "user", "content": prompt}])
            server.check_fits(ids, session, "prompt")
            job, queue = server.submit(run, ids, stops, grammar=grammar)
        except FlylocalError as e:
            server.answered(request, endpoint, 400, started)
            return error(400, str(e))
        except ApiError as e:
            server.answered(request, endpoint, e.status, started)
            return error(e.status, e.message, e.headers)

        model = data.get("model")

        def piece(text: str) -> dict:
            head = {"model": model, "created_at": now()}
            if chat:
                return head | {"message": {"role": "assistant", "content": text}, "done": False}
            return head | {"response": text, "done": False}

        def final(reason: str, stats, n_out: int, text: str = "", call: dict | None = None) -> dict:
            last = piece(text) | {
                "done": True, "done_reason": DONE.get(reason, "stop"),
                "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                "prompt_eval_count": stats.prompt_evaluated, "prompt_eval_duration": int(stats.prefill_s * 1e9),
                "eval_count": n_out, "eval_duration": int(stats.decode_s * 1e9),
                "flylocal": {"verifier": run.verifier, "drafter": run.drafter_name, "rounds": stats.rounds,
                             "drafted": stats.drafted, "accepted": stats.accepted, "loose": stats.loose,
                             "mean_accepted_length": round(stats.mean_accepted_length, 4),
                             "tokens_per_s": round(stats.tokens_per_s, 3), "prompt_reused": stats.prompt_reused,
                             "stop": reason}}
            if not chat:
                last["context"] = []
            if call is not None:
                last["message"]["tool_calls"] = [{"function": {"name": call["name"], "arguments": call["arguments"]}}]
            return last

        if not stream:
            answer = await collect(request, job, queue)
            failed, done, parts = answer.failed, answer.done, answer.parts
            if failed is not None or done is None:
                status = (400 if isinstance(failed, GrammarError) else 500) if failed is not None else 503
                server.answered(request, endpoint, status, started)
                return error(status, failure_message(failed) if failed else "the server is shutting down")
            _, reason, stats, n_out = done
            server.answered(request, endpoint, 200, started, stats, len(ids), n_out)
            text = "".join(parts)
            call = tools.read_call(text) if calls and reason == "eog" else None
            return JSONResponse(final(reason, stats, n_out, "" if call else text, call))

        async def lines():
            stats, n_out, status = None, 0, 200
            held, holding = [], None          # an answer that begins with "{" may be a call: held back
            try:
                while (item := await queue.get()) is not END:
                    if item[0] == "text":
                        if calls and holding is None and item[1]:
                            holding = item[1].startswith(calls)
                        if holding:
                            held.append(item[1])
                            continue
                        yield json.dumps(piece(item[1])) + "\n"
                    elif item[0] == "done":
                        _, reason, stats, n_out = item
                        call = tools.read_call("".join(held)) if holding and reason == "eog" else None
                        yield json.dumps(final(reason, stats, n_out, "" if call or not holding else "".join(held),
                                               call)) + "\n"
                    elif item[0] == "error":
                        status = 500
                        yield json.dumps({"error": failure_message(item[1])}) + "\n"
            finally:
                job.cancel.set()
                server.answered(request, endpoint, status, started, stats, len(ids), n_out)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def load_only(started: float, chat: bool) -> JSONResponse:
        """No prompt: ollama's way to load a model; here it is loaded already."""
        head = {"model": settings.target, "created_at": now(), "done": True, "done_reason": "load"}
        return JSONResponse(head | ({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}))

    @app.post("/api/chat")
    async def chat(request: Request):
        return await generation(request, "ollama_chat", chat=True)

    @app.post("/api/generate")
    async def generate(request: Request):
        return await generation(request, "ollama_generate", chat=False)
