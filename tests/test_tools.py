"""Tool calls without a model (flylocal/front/serve/tools.py; docs/design.md, "Tool calls"):
which functions a choice allows, how a conversation is shown to a template that does or does
not read `tools`, and which answers are calls."""

from __future__ import annotations

import json

import pytest

from flylocal.decoding import grammar as grammars
from flylocal.errors import FlylocalError
from flylocal.front.serve import tools

F = {"type": "function", "function": {"name": "f", "description": "does f",
                                      "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 3}'}}
TALK = [{"role": "user", "content": "do f"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "9"}]


def test_the_fallback_lists_the_functions_and_turns_calls_and_results_into_text():
    plan = tools.plan([{"role": "system", "content": "Be brief."}] + TALK, [F, G], "auto", template=None)
    assert plan.tools is None and plan.grammar is not None
    system = plan.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n" + tools.PREAMBLE)
    assert plan.messages[-1] == {"role": "user", "content": "The result of f: 9"}
    assert json.loads(system["content"].splitlines()[-1])["name"] == "g"
    assert plan.messages[2] == {"role": "assistant", "content": '{"name": "f", "arguments": {"x": 3}}'}
    assert plan.messages[3] == {"role": "user", "content": "The result of f: 9"}


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_objects():
    from jinja2.sandbox import ImmutableSandboxedEnvironment      # what renders GGUF chat templates

    plan = tools.plan(TALK, [F], "required", template="{{ tools }}")
    assert plan.tools[0]["function"]["name"] == "f"
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 3}
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    text = ImmutableSandboxedEnvironment().from_string(template).render(messages=plan.messages, tools=plan.tools)
    assert text == '[f]<user>do f<assistant>{"x": 3}<tool>9'


def test_none_neither_shows_nor_constrains():
    plan = tools.plan(TALK, [F], "none", template="{{ tools }}")
    assert plan.tools is None and plan.grammar is None and plan.messages[-1]["role"] == "user"


def test_a_named_function_must_be_offered_and_tools_must_be_functions():
    with pytest.raises(FlylocalError, match="not among the tools"):
        tools.plan(TALK, [F], {"type": "function", "function": {"name": "h"}}, None)
    with pytest.raises(FlylocalError, match=r"tools\[1\]"):
        tools.plan(TALK, [F, {"type": "retrieval"}], "auto", None)
    with pytest.raises(FlylocalError, match="offered twice"):
        tools.plan(TALK, [F, F], "auto", None)
    with pytest.raises(FlylocalError, match="tool_choice"):
        tools.plan(TALK, [F], "sometimes", None)
    with pytest.raises(FlylocalError, match="needs tools"):
        tools.plan(TALK, [], "required", None)


def test_a_template_with_tagged_calls_gets_a_grammar_for_them():
    tagged, bare = tools.plan(TALK, [F], "auto", "{{ tools }} <tool_call>"), tools.plan(TALK, [F], "auto", "{{ tools }}")
    assert "<tool_call>" in tagged.grammar and tagged.call_starts == ("{", "<")
    assert "<tool_call>" not in bare.grammar and bare.call_starts == ("{",)   # text that begins with "<" streams


@pytest.mark.parametrize("text,call", [
    ('{"name": "f", "arguments": {"x": 1}}', {"name": "f", "arguments": {"x": 1}}),
    ('{"name": "f", "arguments": {"x": 1', None),          # cut at the token limit
    ("Hello {there}", None),
    ('{"name": "f"}', None),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', {"name": "f", "arguments": {}}),
])
def test_which_answers_are_calls(text, call):
    assert tools.read_call(text) == call


@pytest.mark.parametrize("text,cut", [
    ('{"na', None),                                                 # no name yet: nothing to give
    ('{"name": "final_an', None),
    ('{"name": "final_answer"', {"name": "final_answer", "arguments": ""}),
    ('{"name": "final_answer", "argum', {"name": "final_answer", "arguments": ""}),
    ('{"name": "final_answer", "arguments": {"', {"name": "final_answer", "arguments": '{"'}),
    ('<tool_call>\n{"name": "a\\"b", "arguments": {"x": [1', {"name": 'a"b', "arguments": '{"x": [1'}),
    ('{"name": "f", "arguments": {"x": 1}}', {"name": "f", "arguments": {"x": 1}}),   # whole as it stands
])
def test_a_call_cut_by_the_token_limit_is_its_name_and_the_arguments_so_far(text, cut):
    """As llama-server gives a call the token limit cut: its name once whole, its arguments as
    the text written so far; never the half object as text."""
    assert tools.cut_call(text) == cut


class Bytes:
    """A vocabulary of the 256 bytes and an end of generation: what a Grammar reads of a model."""

    n_vocab = 257
    bos = None
    eog_mask = [False] * 256 + [True]

    def piece(self, token: int, special: bool = False) -> bytes:
        return bytes([token]) if token < 256 else b"</s>"

    def is_control(self, token: int) -> bool:
        return token == 256

    def tokenize(self, data: bytes, add_special: bool = False) -> list[int]:
        return list(data)


BYTES = Bytes()


def calls(plan: tools.Plan, text: str) -> bool:
    """Whether the answer `text` is whole under the plan's grammar."""
    import llguidance

    grammar = grammars.Grammar(BYTES, plan.grammar, "the tools' grammar")
    m = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
    return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                    {"type": ["string", "null"]}])
def test_a_function_whose_arguments_are_not_an_object_is_refused(params):
    say = {"type": "function", "function": {"name": "say", "parameters": params}}
    with pytest.raises(FlylocalError, match=r"^tools\[1\]\.function\.parameters: a call of 'say' passes its "
                                            r"arguments as one JSON object"):
        tools.plan(TALK, [F, say], "required", None)


def test_a_function_without_parameters_is_called_with_no_arguments():
    plan = tools.plan(TALK, [G], "required", None)
    assert calls(plan, '{"name": "g", "arguments": {}}')
    assert not calls(plan, '{"name": "g", "arguments": {"x": 1}}')


def test_a_call_is_an_object_and_its_numbers_are_bounded():
    untyped = {"type": "function", "function": {"name": "h", "parameters": {"properties": {"n": {"type": "integer"}}}}}
    plan = tools.plan(TALK, [F, untyped], "required", None)
    assert calls(plan, '{"name": "f", "arguments": {"x": ' + "9" * 16 + "}}")
    assert not calls(plan, '{"name": "f", "arguments": {"x": ' + "9" * 17 + "}}")
    assert calls(plan, '{"name": "h", "arguments": {"n": 3}}') and not calls(plan, '{"name": "h", "arguments": 3}')


def test_a_function_with_nested_models_can_be_called():
    # pydantic writes a nested model as a $ref into the parameters' own $defs.
    from pydantic import BaseModel

    class Place(BaseModel):
        city: str

    class Trip(BaseModel):
        start: Place
        days: int

    trip = {"type": "function", "function": {"name": "trip", "parameters": Trip.model_json_schema()}}
    plan = tools.plan(TALK, [F, trip], "auto", None)
    assert calls(plan, '{"name": "trip", "arguments": {"start": {"city": "Oslo"}, "days": 3}}')
    assert not calls(plan, '{"name": "trip", "arguments": {"start": {"town": "Oslo"}, "days": 3}}')
    assert calls(plan, "Where to?")
