"""The front-ends people run, as they run them: the request bodies Continue (its Ollama provider,
core/llm/llms/Ollama.ts) and Open WebUI (its Ollama router and its OpenAI path, 0.12) send by
default, replayed against `flylocal serve` on SmolLM2, and the answers read the way those
clients read them; LangChain's ChatOllama, the ollama client and the openai client driven for
real where the same shapes go through them. One server for the module (strict, so an answer is
the target's greedy one); every request is bounded in tokens (the server's context at most) and
time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from conftest import SMOL
from test_server import log, start, stop, free_port, wait_ready

pytestmark = pytest.mark.slow      # a real model behind a real server

CTX = 1024
JSON = {"Content-Type": "application/json"}     # what every one of these clients sends with a POST
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start("--target", SMOL, "--ctx", str(CTX), "--verifier", "strict", port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        procs[url] = proc
        yield url
    finally:
        stop(proc)


procs: dict = {}


def post(server: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server + path, headers=JSON, content=json.dumps(body).encode(), timeout=timeout)


def ndjson(r: httpx.Response) -> list[dict]:
    """An NDJSON answer as Continue and Open WebUI split it: a JSON object a line, none blank."""
    assert r.status_code == 200, r.text
    lines = r.text.split("\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1]), r.text
    return [json.loads(line) for line in lines[:-1]]


def continue_reads(lines: list[dict]) -> dict:
    """What Continue's _streamChat makes of an /api/chat stream: every line an error (thrown)
    or one with a `message`, whose content and tool calls it collects."""
    content, calls = "", []
    for j in lines:
        assert "error" not in j, j
        message = j["message"]
        content += message.get("content") or ""
        calls += message.get("tool_calls") or []
    for call in calls:
        assert isinstance(call["function"]["arguments"], dict)      # Continue reads an object
    return {"content": content, "tool_calls": calls, "done": lines[-1]["done"]}


def continue_num_ctx(parameters: str) -> int | None:
    """Continue's reading of /api/show's `parameters`: a line a parameter, split as its regex
    splits it, num_ctx by parseInt."""
    for line in parameters.split("\n"):
        parts = re.match(r'^(\S+)\s+((?:".*")|\S+)$', line)
        if parts and parts.group(1) == "num_ctx":
            return int(parts.group(2))
    return None


# ----- Continue -----

def test_continue_reads_the_context_from_show_and_chats_with_it(server):
    """Continue's first request for a model is /api/show by its older `name`; the num_ctx it
    reads there it sends with every chat. Where it reads none it sends 32768, once a 400 here
    (the server's context made at start): now a wish, as in Ollama."""
    shown = post(server, "/api/show", {"name": SMOL}).json()
    assert continue_num_ctx(shown["parameters"]) == CTX
    assert shown["modelfile"].startswith("#") and "\nPARAMETER num_ctx 1024\n" in shown["modelfile"]
    assert shown["template"] and shown["details"]["format"] == "gguf"
    answers = []
    for num_ctx in (CTX, 32768):
        body = {"model": SMOL, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                            {"role": "user", "content": QUESTION}],
                "options": {"num_predict": 4096, "num_ctx": num_ctx}, "keep_alive": 1800}
        read = continue_reads(ndjson(post(server, "/api/chat", body)))
        assert read["done"] and read["content"].strip(), read
        answers.append(read["content"])
    assert answers[0] == answers[1]                     # the wish changes nothing
    hints = [line for line in log(procs[server]).splitlines() if "taken as hints" in line]
    assert sum(" num_ctx" in line for line in hints) == 1, hints        # said once, for the server's life


def test_continue_sends_a_tool_result_back_with_its_settings(server):
    """After a tool call Continue sends the conversation back without `tools`: the assistant's
    call (content a space, arguments an object, no id), the tool's result with no id or name,
    an earlier answer's reasoning as a `thinking` turn, and the options a user may set
    (num_thread, num_gpu, use_mmap, mirostat 0)."""
    body = {"model": SMOL, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "thinking", "content": "I should call get_weather."},
        {"role": "assistant", "content": " ", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 24 degrees."}],
        "options": {"temperature": 0, "num_predict": 48, "stop": ["<|im_start|>", "<|im_end|>"], "num_ctx": CTX,
                    "mirostat": 0, "num_thread": 4, "use_mmap": True, "num_gpu": 99}, "keep_alive": 1800}
    read = continue_reads(ndjson(post(server, "/api/chat", body)))
    assert read["done"] and read["content"].strip() and not read["tool_calls"], read


def test_continue_autocomplete_is_a_raw_generate_with_many_stops(server):
    """Continue's first completion for a model: a raw prompt, temperature 0.01, a dozen stop
    strings (more than OpenAI's four) and its num_ctx; its reader takes `response` a line."""
    stops = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
             "<|file_sep|>", "<|im_start|>", "<|im_end|>", "/src/", "#- coding: utf-8", "```"]
    body = {"model": SMOL, "prompt": "def add(a, b):\n    ", "raw": True,
            "options": {"temperature": 0.01, "num_predict": 64, "stop": stops, "num_ctx": 8192}, "keep_alive": 1800}
    lines = ndjson(post(server, "/api/generate", body))
    assert all("error" not in j for j in lines) and lines[-1]["done"]
    assert "".join(j.get("response") or "" for j in lines).strip()


# ----- Open WebUI -----

def webui_reads(lines: list[dict]) -> dict:
    """Open WebUI's reading of an Ollama stream (utils/response.py): content, the tool calls by
    index (ollama's `function.index`), finish_reason tool_calls or done_reason."""
    content, calls = "", {}
    for j in lines:
        message = j.get("message") or {}
        content += message.get("content") or ""
        for tc in message.get("tool_calls") or []:
            index = tc.get("index", tc["function"].get("index", 0))
            calls[index] = {"id": tc.get("id"), "name": tc["function"]["name"],
                            "arguments": json.dumps(tc["function"]["arguments"])}
    finish = "tool_calls" if calls else lines[-1].get("done_reason")
    return {"content": content, "tool_calls": list(calls.values()), "finish_reason": finish}


def test_open_webui_native_tool_calling_round_trip(server):
    """Open WebUI's native function calling: the first request offers the tools; the second sends
    the call back with `index` and `id` (null where the model gave none) and the result by
    `tool_call_id`, which was a 400 naming messages.1.tool_calls.0.index."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = webui_reads(ndjson(post(server, "/api/chat", {"model": SMOL, "messages": [question], "stream": True,
                                                          "options": {"num_predict": 64}, "tools": [WEATHER]})))
    assert first["finish_reason"] in ("tool_calls", "stop", "length"), first
    for call_id in ("call_1", None):
        body = {"model": SMOL, "messages": [
            question,
            {"role": "assistant", "content": "", "tool_calls": [
                {"index": 0, "id": call_id, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": call_id}],
            "stream": True, "options": {"num_predict": 64}, "tools": [WEATHER]}
        second = webui_reads(ndjson(post(server, "/api/chat", body)))
        assert second["content"].strip() or second["tool_calls"], second


@pytest.mark.parametrize("option,value,refused", [
    (None, None, False),
    ("mirostat", 2, True),              # mirostat sampling: not served
    ("tfs_z", 0.5, True),               # tail-free sampling: not served
    ("typical_p", 0.7, True),
])
def test_open_webui_advanced_params_answer_or_name_a_text_changing_option(server, option, value, refused):
    """Every option Open WebUI's advanced parameters map to (its defaults where a user enables
    them): 200, the loading ones taken as hints; one that would change the text and cannot be
    served is a 400 naming it, in ollama's shape, which Open WebUI shows."""
    options = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "num_predict": 16,
               "stop": ["</s>"], "mirostat": 0, "mirostat_eta": 0.1, "mirostat_tau": 5.0, "repeat_last_n": 64,
               "repeat_penalty": 1.1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "tfs_z": 1, "num_ctx": 2048,
               "num_batch": 512, "num_keep": 24, "num_thread": 2, "num_gpu": 0, "use_mmap": True, "use_mlock": False}
    if option is not None:
        options[option] = value
    r = post(server, "/api/chat", {"model": SMOL, "messages": [{"role": "user", "content": QUESTION}],
                                   "options": options, "stream": False, "keep_alive": "5m"})
    if refused:
        assert r.status_code == 400 and r.json() == {"error": r.json()["error"]}
        assert r.json()["error"].startswith(f"options.{option}: "), r.text
    else:
        assert r.status_code == 200 and r.json()["done"] and r.json()["message"]["role"] == "assistant", r.text


def test_open_webui_background_tasks_and_model_lists(server):
    """Title generation (stream false, num_predict 1000) and the other tasks (no options), the
    unload request, and what it reads of /api/version, /api/tags and /api/ps."""
    task = [{"role": "user", "content": "### Task:\nGenerate a concise, 3-5 word title for the chat.\n"
                                        "<chat_history>\nUSER: hi\nASSISTANT: Hello!\n</chat_history>"}]
    for body in ({"model": SMOL, "messages": task, "options": {"num_predict": 1000}, "stream": False},
                 {"model": SMOL, "messages": task, "stream": False}):
        r = post(server, "/api/chat", body, timeout=180)
        assert r.status_code == 200 and r.json()["done"] and r.json()["message"]["role"] == "assistant", r.text
    unloaded = post(server, "/api/generate", {"model": SMOL, "keep_alive": 0, "prompt": ""})
    assert unloaded.status_code == 200 and unloaded.json()["done"] and unloaded.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 60          # unloaded once idle, as ollama does: /api/ps lists it no more
    while httpx.get(server + "/api/ps").json()["models"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.get(server + "/api/tags").json()["models"][0]["name"] == SMOL      # still listed
    loaded = post(server, "/api/generate", {"model": SMOL, "prompt": ""})       # what the next chat does: loads it
    assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"
    version = httpx.get(server + "/api/version").json()["version"]
    assert all(part.isdigit() for part in re.sub(r"^v|-.*", "", version).split("."))
    tags = httpx.get(server + "/api/tags").json()["models"]
    assert tags[0]["name"] == SMOL and tags[0]["model"] == SMOL and tags[0]["details"]["parameter_size"]
    ps = httpx.get(server + "/api/ps").json()["models"][0]
    datetime.fromisoformat(ps["expires_at"].replace("Z", "+00:00"))
    # its size is the memory the model holds (weights, cache, buffers), none of it on a GPU here
    assert ps["size"] > tags[0]["size"] and ps["size_vram"] == 0 and ps["context_length"] == CTX


def test_open_webui_openai_path_tool_round_trip(server):
    """Open WebUI's OpenAI path: a stream with tools and no tool_choice; the call sent back with
    string arguments and no index; its reader merges streamed calls by `index`."""
    question = {"role": "user", "content": "What is the weather in Paris?"}

    def stream(messages) -> dict:
        r = post(server, "/v1/chat/completions", {"model": SMOL, "messages": messages, "stream": True,
                                                  "temperature": 0.7, "max_tokens": 64, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        content, calls, finish = "", {}, None
        for line in r.text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    merged = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    merged["name"] += tc["function"].get("name") or ""
                    merged["arguments"] += tc["function"].get("arguments") or ""
                finish = choice["finish_reason"] or finish
        return {"content": content, "calls": list(calls.values()), "finish": finish}

    first = stream([question])
    assert first["content"].strip() or first["calls"], first
    second = stream([question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}])
    assert second["finish"] in ("stop", "length", "tool_calls") and (second["content"].strip() or second["calls"])
    # the Ollama settings its users set travel along at the top level: hints, or a 400 naming one
    settings = {"num_ctx": 8192, "num_gpu": 99, "use_mmap": True, "mirostat": 0, "keep_alive": "5m"}
    tuned = post(server, "/v1/chat/completions", {"model": SMOL, "messages": [question], "max_tokens": 16, **settings})
    assert tuned.status_code == 200 and tuned.json()["choices"][0]["message"]["content"], tuned.text
    refused = post(server, "/v1/chat/completions", {"model": SMOL, "messages": [question], **settings, "mirostat": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mirostat"


# ----- the clients themselves -----

def test_langchain_chat_ollama_calls_a_tool_and_reads_its_result(server):
    """LangChain's ChatOllama (every option it knows sent, unset ones as null), bound to a tool;
    the call and its result sent back as LangChain writes them (with ids)."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    llm = ChatOllama(model=SMOL, base_url=server, temperature=0, num_predict=48, num_ctx=8192)
    question = HumanMessage("What is the weather in Paris?")
    first = llm.bind_tools([get_weather]).invoke([question])
    assert first.content.strip() or first.tool_calls
    # the call as LangChain keeps it (the model's, or one written here where it answered instead)
    called = first if first.tool_calls else AIMessage("", tool_calls=[
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}])
    call = called.tool_calls[0]
    answer = llm.invoke([question, called, ToolMessage("sunny", tool_call_id=call["id"])])
    assert answer.content.strip()


def test_the_ollama_client_sends_a_call_back_with_its_result(server):
    import ollama

    client = ollama.Client(host=server, timeout=120)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    answer = client.chat(model=SMOL, tools=[WEATHER], options={"num_predict": 48, "num_ctx": 65536, "num_gpu": 99},
                         messages=[question, {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "content": "sunny", "tool_name": "get_weather"}])
    assert answer.done and (answer.message.content or answer.message.tool_calls)


JS_MODULES = Path(__file__).resolve().parents[1] / ".venv" / "js" / "node_modules"


def test_ollama_js_chats_streams_calls_and_is_refused_by_name(server):
    """ollama's JavaScript client (npm `ollama`, installed by scripts/setup.sh into .venv/js where
    Node.js is), driven for real: chat whole and streamed, a tool's result sent back, a raw
    generate, show, ps, and a text-changing option refused by name in its error."""
    node = shutil.which("node")
    if node is None or not (JS_MODULES / "ollama").is_dir():
        pytest.skip("Node.js or ollama's JavaScript client is missing (scripts/setup.sh installs the client where "
                    "Node.js is)")
    done = subprocess.run([node, str(Path(__file__).with_name("ollama_js_client.cjs")), server, SMOL],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NODE_PATH": str(JS_MODULES)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["whole"] and out["streamed"] == out["whole"] and out["done"] in ("stop", "length")
    assert out["called"]["content"] or out["called"]["tool_calls"]
    assert out["generated"] and continue_num_ctx(out["parameters"]) == CTX and out["ps"][0]["model"] == SMOL
    assert out["refused"]["status"] == 400 and out["refused"]["error"].startswith("options.mirostat: 2")


def test_a_call_cut_by_the_token_limit_is_a_call_or_nothing_never_half_json(server):
    """tool_choice required and max_tokens 12 (smolagents' case): as llama-server answers, a call
    whose name is whole, with the arguments' text so far and finish_reason "length" (streamed
    the same); cut before its name is whole, nothing. Never the JSON in `content`. The Ollama
    dialect, whose arguments are an object, gives no call: an empty answer, done_reason length."""
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
    final = {"type": "function", "function": {"name": "final_answer", "description": "The final answer.",
                                              "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                                                             "required": ["answer"]}}}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    cut = client.chat.completions.create(model=SMOL, messages=messages, tools=[final], tool_choice="required",
                                         max_tokens=12)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "final_answer"
    arguments = choice.message.tool_calls[0].function.arguments
    assert '"answer"'.startswith(arguments) or arguments.startswith("{")
    streamed = list(client.chat.completions.create(model=SMOL, messages=messages, tools=[final], tool_choice="required",
                                                   max_tokens=12, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["final_answer"]
    assert streamed[-1].choices[0].finish_reason == "length"
    early = client.chat.completions.create(model=SMOL, messages=messages, tools=[final], tool_choice="required",
                                           max_tokens=3)
    assert early.choices[0].message.tool_calls is None and not early.choices[0].message.content
    ollama = post(server, "/api/chat", {"model": SMOL, "messages": messages, "tools": [final], "stream": False,
                                        "options": {"num_predict": 12}}).json()
    assert "{" not in ollama["message"]["content"] and ollama["done_reason"] in ("length", "stop"), ollama


def test_lm_eval_harness_stops_and_no_null_extension(server):
    """lm-evaluation-harness's HumanEval task sends five stop strings through local-completions;
    a whole chat.completion carries no top-level "flylocal": null."""
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    r = post(server, "/v1/completions", {"model": SMOL, "prompt": "def add(a, b):\n", "max_tokens": 48, "stop": stops,
                                         "temperature": 0})
    assert r.status_code == 200 and not any(s in r.json()["choices"][0]["text"] for s in stops), r.text
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8})
    assert chat.status_code == 200 and "flylocal" not in chat.json() and "flylocal" in chat.json()["usage"]
    assert "Traceback" not in log(procs[server])
