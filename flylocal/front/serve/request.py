"""One request body (docs/serving.md, "Adding an API dialect"): what every dialect's parser makes of
its request (a `Body`, chat-shaped), and the steps by which `Server.ask` alone turns it into
the worker's `Ask`: its settings (`settings_for`), its output's grammar (`grammar_for`) and its
prompt, encoded and truncated (`prompt_for`). Each rule a request meets in every dialect is
here once: the range of `top_logprobs` (TopLogprobs, a pydantic constraint the dialects'
models share), `top_logprobs` without `logprobs`, a format together with tools, a count that
reaches the context's end, a logit bias outside the vocabulary, a continued context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping

import numpy as np
from pydantic import AfterValidator

from flylocal.errors import FlylocalError
from flylocal.front.serve import tools
from flylocal.settings import Settings, settings_from

CONTEXT = "context"     # an option's value that reaches the context's end (Ollama's num_predict -1)


def _top_range(v: int) -> int:
    if not 0 <= v <= 20:
        raise ValueError(f"{v}; between 0 and 20")
    return v


# How many most likely tokens each output token carries, as every dialect bounds it.
TopLogprobs = Annotated[int, AfterValidator(_top_range)]


@dataclass(frozen=True)
class JsonOutput:
    """An output that must be JSON: valid under `schema`, or any JSON object (None); `label`
    is how its errors name it (the request's field, and the schema's name)."""
    schema: Any = None
    label: str = "format"


@dataclass(frozen=True)
class Infill:
    """A fill-in-the-middle prompt: the text before the cursor and after it, and what follows
    the prefix (llama-server's `prompt`). `extra`: other files' (name, text), for a model that
    reads a repository (llama-server's /infill: its markers go in even with no file); None for
    none at all (a `suffix` on a completion)."""
    prefix: str
    suffix: str
    prompt: str = ""
    extra: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class Body:
    """A request of any dialect, chat-shaped, as its parser reads it: nothing in it is checked
    beyond its fields' types and ranges. `names` maps a field here to the request's own, for
    errors (`prompt`: where the prompt came in; `options`: where a setting's error points,
    else the option's own field)."""
    # the prompt: a conversation (OpenAI's message shapes) or a text (plain text, after BOS)
    messages: list[dict] | None = None
    text: str | None = None
    context: tuple[int, ...] = ()   # ids of an earlier answer's context, which the prompt continues
    infill: Infill | None = None    # ... or the middle to fill in
    keep: int = 0                   # leading messages (instructions) that truncation keeps
    truncate: bool = False          # drop the oldest turns, as few as leave room to answer
    load: bool = False              # an empty prompt asks only that the model be loaded
    # how to answer
    options: Mapping[str, Any] = field(default_factory=dict)    # declared option -> value (or CONTEXT)
    logit_bias: Mapping[str, float] | None = None               # token id (as text) -> bias
    logprobs: bool = False
    top_logprobs: int | None = None
    format: JsonOutput | None = None
    tools: tuple = ()
    tool_choice: Any = "auto"
    stops: tuple[str, ...] = ()
    tokens: bool = False            # per-token details with the text (a stream's kinds, a context)
    hints: tuple[str, ...] = ()     # Ollama's loading options given, which change nothing: logged once
    salt: str | None = None         # cache_salt: shares the prompt cache only with the same salt
    names: Mapping[str, str | None] = field(default_factory=dict)

    def name(self, key: str) -> str | None:
        return self.names.get(key, key)

    def empty(self) -> bool:
        if self.infill is not None:
            return False
        return not self.messages if self.messages is not None else not self.text


class Refusal(Exception):
    """A request the body's rules refuse: its message and the request's field it names
    (Server.ask makes it the dialect's 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Prompt:
    """A prompt's ids; for a conversation that can call tools, the tools' grammar and how a
    call begins; `dropped`: the messages truncation left out after the kept ones."""
    ids: np.ndarray                           # [n] int32
    grammar: tuple[str, str] | None = None
    calls: tuple[str, ...] = ()
    dropped: int = 0


# ----- settings -----

def settings_for(body: Body, base: Settings, n_ctx: int | None = None, n_vocab: int | None = None) -> Settings:
    """The settings `base` with the body's applied: its options (CONTEXT: `n_ctx`, or the
    base's --ctx), its logit bias (each id in a vocabulary of `n_vocab`) and its logprobs."""
    reach = n_ctx if n_ctx is not None else base.ctx
    options = {k: reach if v == CONTEXT else v for k, v in body.options.items()}
    if body.logit_bias:
        bias = tuple(sorted((int(k), float(v)) for k, v in body.logit_bias.items()))
        if n_vocab is not None and bias[-1][0] >= n_vocab:
            raise Refusal(f"{body.name('logit_bias')}: token id {bias[-1][0]} is not in the vocabulary "
                          f"(0..{n_vocab - 1})", body.name("logit_bias"))
        options["logit_bias"] = bias
    top = logprobs_wanted(body)
    return settings_from(options | ({"logprobs": top} if top is not None else {}), base)


def logprobs_wanted(body: Body) -> int | None:
    """How many most likely tokens each output token carries (None: no logprobs)."""
    name = body.name("top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise Refusal(f"{name} needs logprobs: true", name)
    try:
        _top_range(body.top_logprobs or 0)
    except ValueError as e:
        raise Refusal(f"{name}: {e}", name) from None
    return (body.top_logprobs or 0) if body.logprobs else None


# ----- the output's grammar -----

def grammar_for(body: Body) -> tuple[str, str] | None:
    """(what it is, its grammar) of the body's format, or None for free text; a format
    beside tools that may be called is refused (an answer is constrained by one of them)."""
    from flylocal.decoding.grammar import json_output

    fmt = body.format
    if fmt is None:
        return None
    if body.tools and body.tool_choice != "none":
        raise Refusal(f"{body.name('format')} and tools: flylocal constrains an answer to one of them",
                      body.name("format"))
    try:
        return json_output() if fmt.schema is None else json_output(fmt.schema, fmt.label)
    except FlylocalError as e:
        raise Refusal(str(e), body.name("format")) from None


# ----- the prompt -----

def prompt_for(session, body: Body, room: int) -> Prompt:
    """The body's prompt encoded: a text, a conversation (truncated to leave `room` tokens
    free when the body asks for it), or either after the context it continues."""
    if body.empty():
        raise Refusal(f"the {body.name('prompt') or 'prompt'} is empty", body.name("prompt"))
    try:
        if body.infill is not None:
            return Prompt(infilled(session.target, body))
        if body.context:
            return Prompt(continued(session, body))
        if body.messages is None:
            return Prompt(session.target.tokenize(body.text, add_special=True, parse_special=False))
        prompt = conversation(session, body.messages, body.tools, body.tool_choice)
        if body.truncate and len(prompt.ids) > room:
            return truncated(session, body, room)
        return prompt
    except FlylocalError as e:
        raise Refusal(str(e), blame(body, str(e))) from None


def conversation(session, messages: list[dict], offered, choice) -> Prompt:
    """A conversation that offers `offered` tools, encoded (FlylocalError for a conversation
    or tools the template cannot take)."""
    plan = tools.plan(messages, list(offered), choice, session.target.tools_template())
    ids = session.encode(plan.messages, plan.tools)
    if plan.grammar is None:
        return Prompt(ids)
    return Prompt(ids, ("the tools' grammar", plan.grammar), plan.call_starts)


def truncated(session, body: Body, room: int) -> Prompt:
    """The conversation without its oldest messages after the first `keep`, as few as leave
    `room` tokens to answer (a binary search, as `flylocal chat` drops turns): the last message
    stays, and a tool's result whose call went goes with it."""
    head, rest = body.messages[:body.keep], body.messages[body.keep:]

    def without(n: int) -> Prompt:
        while n < len(rest) - 1 and rest[n]["role"] == "tool":
            n += 1
        p = conversation(session, head + rest[n:], body.tools, body.tool_choice)
        return Prompt(p.ids, p.grammar, p.calls, n)

    low, high = 1, len(rest) - 1                # the fewest that may fit; the most that may go
    best = without(high)
    while low < high:
        mid = (low + high) // 2
        found = without(mid)
        if len(found.ids) <= room:
            high, best = mid, found
        else:
            low = mid + 1
    return best


def continued(session, body: Body) -> np.ndarray:
    """The ids of a prompt after the context it continues ([n] int32): a text (or any prompt
    for a model with no chat template) follows on; a conversation's last message is the user's
    next turn, as the chat template renders one."""
    target = session.target
    bad = next((t for t in body.context if not 0 <= t < target.n_vocab), None)
    if bad is not None:
        raise Refusal(f"{body.name('context')}: {bad} is no token of this model (0 to {target.n_vocab - 1}); send "
                      "back the context an answer gave", body.name("context"))
    history = np.array(body.context, dtype=np.int32)
    if body.messages is None or not session.has_template:
        text = body.text if body.messages is None else body.messages[-1]["content"]
        return np.concatenate([history, target.tokenize(text, add_special=False, parse_special=False)]).astype(np.int32)
    if any(m["role"] == "system" for m in body.messages):
        raise Refusal(f"{body.name('system')}: the context a request continues holds its system prompt (give it "
                      "with the first request)", body.name("system"))
    turn = next_turn(target, body.messages[-1]["content"])
    if turn is None:
        raise Refusal(f"{body.name('context')}: the chat template of {target.name} does not render a conversation "
                      "turn after turn, so a context cannot be continued (a conversation can be sent whole)",
                      body.name("context"))
    return np.concatenate([history, turn]).astype(np.int32)


def infilled(target, body: Body) -> np.ndarray:
    """The ids of a fill-in-the-middle prompt ([n] int32), built as llama-server builds /infill's:
    other files' text (its tail: what fits beside a batch), the BOS, the prefix marker and the
    prefix's last 3/4 of a batch, the prompt, the suffix marker and the suffix's first quarter
    of a batch less the prompt, the middle marker. Every text is plain text, the prompt too."""
    fim, name = target.fim, body.name("suffix")
    if not fim.usable:
        raise Refusal(f"{name}: {target.name} has no fill-in-the-middle tokens (a model for code completion has "
                      "them: tokenizer.ggml.fim_pre/suf/mid_token_id)", name)
    infill, batch = body.infill, target.n_batch

    def ids(text: str) -> list[int]:
        return target.tokenize(text, add_special=False, parse_special=False).tolist()

    prompt = ids(infill.prompt)
    prefix = ids(infill.prefix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (batch // 4)):]
    suffix = ids(infill.suffix)[:max(0, batch // 4 - (2 + len(prompt)))]
    extra: list[int] = []
    if infill.extra is not None:
        if fim.rep is not None:
            extra += [fim.rep] + ids("myproject\n")
        for filename, text in infill.extra:
            extra += [fim.sep] + ids(f"{filename}\n") if fim.sep is not None else ids("\n\n--- snippet ---\n\n")
            extra += ids(text)
        if fim.sep is not None:
            extra += [fim.sep] + ids("filename\n")
        room = max(0, target.n_ctx - batch + 2)
        extra = extra[len(extra) - min(room, len(extra)):]
    head = [target.bos] if target.add_bos else []
    return np.array(extra + head + [fim.pre] + prefix + prompt + [fim.suf] + suffix + [fim.mid], dtype=np.int32)


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


def blame(body: Body, message: str) -> str | None:
    """The request's field an encoding error is about, read off the error's first words."""
    for prefix, key in (("tools", "tools"), ("the tools'", "tools"), ("tool_choice", "tool_choice"),
                        ("tool_calls", "prompt")):
        if message.startswith(prefix):
            return body.name(key)
    fmt = body.name("format")
    return fmt if fmt and message.startswith(fmt) else body.name("prompt")
