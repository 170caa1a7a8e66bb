"""Tool calls (docs/design.md, "Tool calls"): the functions a client offers, how the prompt
shows them, the grammar an answer is generated under, and the call read back from it.

An answer is either plain text or one call, the JSON object

    {"name": "<one of the functions>", "arguments": {<valid under its parameters' schema>}}

generated under a grammar, so whatever the model writes is a valid call or plain text, never
broken JSON. Plain text may not begin with "{" (nor "<", where the template has calls
wrapped in <tool_call> tags, which the grammar then allows around a call): the first
character tells the two apart.

- A chat template that reads a `tools` variable renders the functions itself.
- Otherwise a system preamble lists them with their schemas, and says how to call one; the
  conversation's tool results and earlier calls become text the template can render
  (a call as its JSON object in the assistant's turn, a result as a user turn).

`tool_choice`: "auto" (text or a call), "required" (a call), a named function (a call of it),
"none" (text; the functions are not shown).

A call's arguments are one JSON object: a function whose `parameters` describe something else
(`{"type": "string"}`) is refused, naming it; one without `parameters` is called with `{}`.
Each call's schema is a document of its own, so that references into the parameters' `$defs`
resolve, with its numbers bounded as every JSON schema's are (grammar.bounded).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from flylocal.decoding import grammar as G
from flylocal.errors import FlylocalError

WRAP = ("<tool_call>", "</tool_call>")   # the tags some templates (Qwen, Hermes) put around a call
PREAMBLE = ("You can call functions. To call one, answer with only a JSON object "
            '{"name": <the function\'s name>, "arguments": <an object of its arguments>} and nothing else. '
            "Otherwise answer in plain text. The functions:")


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict          # a JSON schema of the arguments object


@dataclass(frozen=True)
class Plan:
    messages: list[dict]      # what the template renders
    tools: list[dict] | None  # given to a template that reads them
    grammar: str | None       # the answer's llguidance grammar (None: free text)
    call_starts: tuple[str, ...] = ()   # how an answer that is a call begins ("{", and "<" with tags)


def functions(tools: list, where: str = "tools") -> list[Function]:
    """The offered functions, checked: FlylocalError naming the first that is not one."""
    out = []
    for i, tool in enumerate(tools):
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(spec, dict):
            raise FlylocalError(f"{where}[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise FlylocalError(f"{where}[{i}].function.name: a function needs a name")
        params = spec.get("parameters")
        if params is None:                      # no parameters: the arguments are {}
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise FlylocalError(f"{where}[{i}].function.parameters: a JSON schema is an object")
        kind = params.get("type", "object")
        if "object" not in ([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []):
            raise FlylocalError(f"{where}[{i}].function.parameters: a call of {name!r} passes its arguments as "
                                f"one JSON object; a schema of type {json.dumps(kind)} cannot describe them")
        G.check_depth(params, f"{where}[{i}].function.parameters")
        if any(f.name == name for f in out):
            raise FlylocalError(f"{where}[{i}].function.name: {name!r} is offered twice")
        out.append(Function(name, str(spec.get("description") or ""), params))
    return out


def chosen(choice, offered: list[Function]) -> tuple[str, list[Function]]:
    """(mode: "none", "auto" or "required"; the functions a call may name) for a tool_choice."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", offered
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [f for f in offered if f.name == name]
        if not named:
            raise FlylocalError(f"tool_choice: {json.dumps(name)} is not among the tools offered")
        return "required", named
    raise FlylocalError(f"tool_choice: {json.dumps(choice)[:80]}; auto, none, required or "
                        '{"type": "function", "function": {"name": ...}}')


def call_grammar(functions: list[Function], required: bool, wrapped: bool = False) -> str:
    """The llguidance grammar of an answer: one call of one of `functions` (with `wrapped`,
    also inside <tool_call> tags), or (unless `required`) plain text that does not begin with
    "{" (nor "<" when wrapped)."""
    first = "{<" if wrapped else "{"
    text = "" if required else f" | /([^{first}][\\s\\S]*)?/"
    tagged = f' | "{WRAP[0]}" /\\n?/ object /\\n?/ "{WRAP[1]}"' if wrapped else ""
    calls = "".join(f"call_{i}: %json {json.dumps(call_schema(f))}\n" for i, f in enumerate(functions))
    lark = (f"start: call{text}\ncall: object{tagged}\n"
            f"object: {' | '.join(f'call_{i}' for i in range(len(functions)))}\n{calls}")
    return G.checked(G.grammar_text(lark, "the tools' grammar"), "the tools' schemas")


def call_schema(f: Function) -> dict:
    """The JSON schema of a call of `f`: a document of its own, so that the parameters' $defs
    (pydantic's nested models) sit at its root, where their "#/$defs/..." references point."""
    defs = {key: f.parameters[key] for key in ("$defs", "definitions") if key in f.parameters}
    arguments = {key: v for key, v in f.parameters.items() if key not in defs}
    arguments["type"] = "object"                # a call's arguments, where the schema allows more
    schema = {"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False, **defs}
    # lenient: a keyword the grammar cannot enforce (propertyNames, ...) is left unenforced, as
    # agents' tool schemas carry them (Claude Code's do); a response format's schema stays strict
    return {**G.bounded(schema), "x-guidance": G.JSON_LAYOUT | {"lenient": True}}


def plan(messages: list[dict], tools: list, choice, template: str | None) -> Plan:
    """How to render a conversation that offers `tools` (OpenAI's shapes) and what to generate,
    for a chat template that reads a `tools` variable (`template`, its text) or not (None)."""
    offered = functions(tools)
    if not offered and choice not in (None, "auto", "none"):
        raise FlylocalError(f"tool_choice: {json.dumps(choice)[:80]} needs tools")
    mode, callable_ = chosen(choice, offered)
    if mode == "none" or not offered:
        return Plan(plain_messages(messages), None, None)
    wrapped = template is not None and WRAP[0] in template
    grammar = call_grammar(callable_, required=mode == "required", wrapped=wrapped)
    starts = ("{", "<") if wrapped else ("{",)
    if template is not None:
        return Plan(template_messages(messages), [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                                  "parameters": f.parameters}} for f in offered],
                    grammar, starts)
    listing = "\n".join(json.dumps({"name": f.name, "description": f.description, "parameters": f.parameters})
                        for f in offered)
    preamble = f"{PREAMBLE}\n{listing}"
    rest = plain_messages(messages)
    if rest and rest[0]["role"] == "system":
        rest = [{"role": "system", "content": f"{rest[0]['content']}\n\n{preamble}"}] + rest[1:]
    else:
        rest = [{"role": "system", "content": preamble}] + rest
    return Plan(rest, None, grammar, starts)


def template_messages(messages: list[dict]) -> list[dict]:
    """A conversation for a template that knows tools: calls' arguments as objects (templates
    write them with `tojson`), no content as ""."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"], "arguments": arguments(c)}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def plain_messages(messages: list[dict]) -> list[dict]:
    """A conversation any template renders: an earlier call becomes its JSON object in the
    assistant's turn, a tool's result a user turn saying what it answers."""
    names = {}                                  # call id -> the function it called
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            text = m.get("content") or ""
            for call in calls:
                if call.get("id"):
                    names[call["id"]] = call["function"]["name"]
                text += json.dumps({"name": call["function"]["name"], "arguments": arguments(call)})
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "") or "the function"
            out.append({"role": "user", "content": f"The result of {name}: {m.get('content') or ''}"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def arguments(call: dict) -> dict:
    """A call's arguments as an object (OpenAI sends them as JSON text, ollama as an object)."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise FlylocalError(f"tool_calls: the arguments of {call['function']['name']} are not JSON") from None
    if not isinstance(args, dict):
        raise FlylocalError(f"tool_calls: the arguments of {call['function']['name']} are not an object")
    return args


def read_call(text: str) -> dict | None:
    """The call an answer made ({"name", "arguments"}), bare or in <tool_call> tags, or None
    when it is plain text (or a call cut short by max_tokens)."""
    if text.startswith(WRAP[0]) and text.endswith(WRAP[1]):
        text = text[len(WRAP[0]) : -len(WRAP[1])].strip()
    if not text.startswith("{"):
        return None
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and "name" in call and isinstance(call.get("arguments"), dict) else None


# How a call begins: its name (a JSON string, whole), then its arguments' key.
CALL_NAME = re.compile(r'\s*(?:<tool_call>\s*)?\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(.*)', re.S)


def cut_call(text: str) -> dict | None:
    """The call an answer cut short by its token limit had begun, as llama-server gives one:
    {"name", "arguments": the arguments' JSON text so far (not whole; "" before they begin)},
    once the name is whole (the grammar made it one of the functions'); a call that happens to
    be whole as it stands, as read_call reads it; None before the name is whole: then there is
    no call to give, nor text, since what was written is half a JSON object, never an answer's
    content."""
    whole = read_call(text)
    if whole is not None:
        return whole
    name = CALL_NAME.match(text)
    if name is None:
        return None
    arguments = ARGUMENTS.match(text, name.end())
    return {"name": json.loads(name.group(1)), "arguments": arguments.group(1).rstrip() if arguments else ""}


def call_arguments(call: dict) -> str:
    """A call's arguments as JSON text: an object's, or for a call cut short (cut_call), the text
    it had."""
    arguments = call["arguments"]
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
