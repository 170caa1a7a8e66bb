"""Anthropic's Messages API on `flylocal serve`, driven by the clients that speak it on their
default paths: the `anthropic` SDK (create, stream, tools, count_tokens, errors, its API key
header), litellm's and LangChain's Anthropic providers, and Claude Code's own request shapes
(a system turn inside `messages`, `?beta=true`, the beta headers, `cache_control`, tool
results of each form). One SmolLM2 server for the module; every request bounded."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import SMOL, prompt
from test_server import served

pytestmark = pytest.mark.slow      # a real model behind a real server

anthropic = pytest.importorskip("anthropic", reason="the test extra: pip install -e '.[test]'")

KEY = "messages-key"
STRICT = {"verifier": "strict"}
WEATHER = {"name": "get_weather", "description": "The weather now in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# long enough that its prompt is worth keeping in a slot (prompt_cache.REUSE_MIN tokens)
SYSTEM = ("Answer briefly, in one plain sentence, as a patient teacher answers a curious student who asked "
          "a question in class, without lists, headings or anything but the answer itself.")
CLAUDE_CODE = {"anthropic-version": "2023-06-01", "x-api-key": KEY, "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
               "user-agent": "claude-cli/2.1.154 (external, cli)"}


@pytest.fixture(scope="module")
def server():
    yield from served("--target", SMOL, "--api-key", KEY, "--ctx", "1024")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, timeout=120, max_retries=0)


def chat(server, messages, **fields) -> dict:
    """The same conversation through OpenAI's chat: what /v1/messages must answer."""
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"messages": messages, "temperature": 0, **STRICT, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_completion_of_the_same_conversation(client, server):
    question = prompt("qa-capital")
    same = chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=24)
    made = client.messages.create(model=SMOL, system=SYSTEM, max_tokens=24,
                                  messages=[{"role": "user", "content": question}], extra_body=STRICT)
    assert made.type == "message" and made.role == "assistant" and made.id.startswith("msg_")
    assert [b.type for b in made.content] == ["text"] and made.content[0].text == same["choices"][0]["message"]["content"]
    assert made.stop_reason == ("max_tokens" if same["choices"][0]["finish_reason"] == "length" else "end_turn")
    assert made.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert made.usage.output_tokens == same["usage"]["completion_tokens"]
    assert made.usage.cache_read_input_tokens > 0               # the same prompt again: the cache kept it


def test_a_stream_has_anthropics_events_in_order_and_the_same_message(client):
    question = prompt("qa-capital")
    whole = client.messages.create(model=SMOL, max_tokens=24, extra_body=STRICT,
                                   messages=[{"role": "user", "content": question}])
    with client.messages.stream(model=SMOL, max_tokens=24, extra_body=STRICT,
                                messages=[{"role": "user", "content": question}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(str(client.base_url).rstrip("/") + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                     json={"model": SMOL, "max_tokens": 24, "stream": True, "messages": [
                         {"role": "user", "content": question}]} | STRICT)
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_is_named(client):
    made = client.messages.create(model=SMOL, max_tokens=40, stop_sequences=["\n", "."],
                                  messages=[{"role": "user", "content": "Write three sentences about the sea."}],
                                  extra_body=STRICT)
    # three sentences: a "." or a line's end comes within 40 tokens
    assert made.stop_reason == "stop_sequence" and made.stop_sequence in ("\n", ".")
    assert made.stop_sequence not in made.content[0].text
    plain = client.messages.create(model=SMOL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                   extra_body=STRICT)
    assert plain.stop_sequence is None           # no stop sequence given: none is named


def test_a_tool_round_trip(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    made = client.messages.create(model=SMOL, max_tokens=64, tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"}, messages=asked)
    call = made.content[-1]
    assert made.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input, dict) and call.id.startswith("toolu_")
    then = client.messages.create(model=SMOL, max_tokens=24, tools=[WEATHER], messages=asked + [
        {"role": "assistant", "content": [b.model_dump() for b in made.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert then.content and then.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model=SMOL, max_tokens=64, tools=[WEATHER], messages=asked,
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert isinstance(final.content[-1].input, dict)       # the SDK parsed the input_json_delta


def test_count_tokens_is_the_prompt_a_message_reads(client):
    messages = [{"role": "user", "content": prompt("qa-capital")}]
    counted = client.messages.count_tokens(model=SMOL, system="Answer briefly.", messages=messages)
    made = client.messages.create(model=SMOL, system="Answer briefly.", max_tokens=1, messages=messages)
    assert counted.input_tokens == made.usage.input_tokens > 0


def test_errors_are_anthropics_shape_and_the_key_is_checked(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=SMOL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=SMOL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": -1})
    assert "temperature" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server + "/v1/messages", headers=CLAUDE_CODE, json={"model": SMOL, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(server + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]})
    assert r.status_code == 400 and "messages[0].content[1]: an image block" in r.json()["error"]["message"]


def test_claude_codes_request_shapes(server):
    """Claude Code's shapes, as it sends them: ?beta=true, its headers, the system prompt as
    blocks with cache_control, a system turn inside messages, thinking, metadata, context
    management, and tool results as a string, as text blocks and as an error."""
    tools = [WEATHER | {"cache_control": {"type": "ephemeral"}}]
    body = {"model": SMOL, "max_tokens": 16, "stream": False, "temperature": 0,
            "system": [{"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "user_abc_account__session_123"}, "thinking": {"type": "disabled"},
            "context_management": {"edits": []}, "tools": tools, "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "system", "content": "The user's working directory is /tmp."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?",
                                              "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                    {"type": "tool_use", "id": "toolu_3", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "Rain"},
                                                                                   {"type": "text", "text": ", 12 C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_3", "content": "no such city", "is_error": True},
                    {"type": "text", "text": "Summarize."}]}]}
    r = httpx.post(server + "/v1/messages?beta=true", headers=CLAUDE_CODE, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["content"]
    counted = httpx.post(server + "/v1/messages/count_tokens?beta=true", headers=CLAUDE_CODE, timeout=60,
                         json={k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature")})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == r.json()["usage"]["input_tokens"]
    streamed = httpx.post(server + "/v1/messages?beta=true", headers=CLAUDE_CODE, json=body | {"stream": True},
                          timeout=120)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"


def test_litellm_and_langchain_anthropic_providers_answer(server):
    import litellm
    from langchain_anthropic import ChatAnthropic

    done = litellm.completion(model=f"anthropic/{SMOL}", api_base=server, api_key=KEY, max_tokens=16, temperature=0,
                              messages=[{"role": "user", "content": prompt("qa-capital")}])
    assert done.choices[0].message.content
    llm = ChatAnthropic(model=SMOL, base_url=server, api_key=KEY, max_tokens=16, temperature=0, max_retries=0)
    assert llm.invoke(prompt("qa-capital")).content


def test_structured_output_follows_its_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    made = client.messages.create(model=SMOL, max_tokens=48, messages=[
        {"role": "user", "content": "Name the capital of France as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    if made.stop_reason == "end_turn":
        assert set(json.loads(made.content[0].text)) == {"city"}
    with pytest.raises(anthropic.BadRequestError) as e:      # a format beside a tool that may be called
        client.messages.create(model=SMOL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert "output_config.format and tools" in str(e.value)


def replayed(name: str) -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "claude_code" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["bare", "read_tool"])
def test_claude_codes_recorded_requests_are_answered(server, name):
    """Requests Claude Code itself sent (`claude -p`, tests/data/claude_code: streamed, with its
    beta headers, adaptive thinking, effort, context management, cache_control blocks, its
    metadata), replayed: Anthropic's events, in order, with a message."""
    r = replayed(name)
    assert httpx.head(server + "/").status_code == 200        # its check that the server is up
    got = httpx.post(server + r["path"], headers=r["headers"] | {"x-api-key": KEY}, timeout=120,
                     json=r["body"] | {"max_tokens": 24})
    assert got.status_code == 200, got.text
    names = [line[7:] for line in got.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    counted = httpx.post(server + r["path"].replace("/v1/messages", "/v1/messages/count_tokens"), timeout=60,
                         headers=r["headers"] | {"x-api-key": KEY},
                         json={k: v for k, v in r["body"].items() if k not in ("max_tokens", "stream")})
    start = json.loads(got.text.split("data: ", 1)[1].split("\n", 1)[0])
    assert counted.json()["input_tokens"] == start["message"]["usage"]["input_tokens"]


def test_claude_codes_whole_request_is_read_and_refused_only_for_its_length(server):
    """Claude Code's default request (its 24 tools, their schemas with keywords the grammar does
    not enforce, such as propertyNames) is read whole: count_tokens counts it; a 1,024-token
    context cannot hold it, said in one line."""
    r = replayed("default")
    counted = httpx.post(server + "/v1/messages/count_tokens?beta=true", headers=r["headers"] | {"x-api-key": KEY},
                         json={k: v for k, v in r["body"].items() if k not in ("max_tokens", "stream")}, timeout=120)
    assert counted.status_code == 200, counted.text
    n = counted.json()["input_tokens"]
    assert n > 10000
    got = httpx.post(server + r["path"], headers=r["headers"] | {"x-api-key": KEY}, json=r["body"], timeout=120)
    assert got.status_code == 400 and got.json()["error"] == {
        "type": "invalid_request_error",
        "message": f"the prompt is {n} tokens; the context holds 1024 (--ctx), with room for at least one generated token"}


def test_system_turns_inside_messages_are_placed_where_every_template_takes_them():
    from flylocal.front.serve.anthropic import placed

    head = [{"role": "system", "content": "S"}]
    assert placed(head, [{"role": "system", "content": "A"}, {"role": "user", "content": "u"}]) == [
        {"role": "system", "content": "S\n\nA"}, {"role": "user", "content": "u"}]
    assert placed([], [{"role": "user", "content": "u"}, {"role": "system", "content": "R"},
                       {"role": "assistant", "content": "a"}, {"role": "system", "content": "R2"},
                       {"role": "user", "content": "v"}]) == [
        {"role": "user", "content": "u\n\nR"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "R2\n\nv"}]


# A template that takes one system prompt and turns that alternate (as Gemma's and Mistral's do).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% if not loop.first %}"
    "{{ raise_exception('a system message only first') }}{% endif %}{{ m['content'] }}\n"
    "{% else %}{% set n = loop.index0 - (1 if messages[0]['role'] == 'system' else 0) %}"
    "{% if (m['role'] == 'user') != (n % 2 == 0) %}{{ raise_exception('turns must alternate') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}assistant:")


def test_claude_codes_conversation_renders_on_a_template_that_takes_one_system_prompt():
    """Claude Code's request (a system turn after the user's) renders on a template that takes
    one system prompt and alternating turns: as sent, it would not."""
    from flylocal.front.serve.anthropic import MessagesRequest, body_of
    from flylocal.llama.binding import llama_cpp  # noqa: F401 - llama_cpp as flylocal loads it (exact or fast)
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    render = Jinja2ChatFormatter(template=STRICT_TEMPLATE, eos_token="", bos_token="")
    body = MessagesRequest.model_validate(replayed("default")["body"])
    made = body_of(body)
    assert [m["role"] for m in made.messages] == ["system", "user"]
    assert render(messages=made.messages).prompt.endswith("assistant:")
    as_sent = [{"role": "system", "content": "s"}] + [
        {"role": m.role, "content": "x"} for m in body.messages]          # user, then system
    with pytest.raises(Exception, match="system message only first"):
        render(messages=as_sent)
