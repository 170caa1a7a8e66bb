"""OpenAI's Responses API and /v1/models/{id} on `flylocal serve`, driven by the clients that
use them on their default paths: the `openai` package, the OpenAI Agents SDK, pydantic-ai's
Responses model and LangChain with `use_responses_api=True`. One SmolLM2 server for the
module; every request bounded in tokens and time.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import SMOL, prompt
from test_server import served

pytestmark = pytest.mark.slow      # a real model behind a real server

KEY = "responses-key"
STRICT = {"verifier": "strict"}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    yield from served("--target", SMOL, "--api-key", KEY, "--ctx", "1024")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    question = prompt("qa-capital")
    made = client.responses.create(model=SMOL, instructions="Answer briefly.", input=question,
                                   max_output_tokens=24, temperature=0, extra_body=STRICT)
    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "system", "content": "Answer briefly."},
                                                                {"role": "user", "content": question}],
                                          max_tokens=24, temperature=0, extra_body=STRICT)
    assert made.output_text == chat.choices[0].message.content and made.output_text
    assert made.object == "response" and made.output[0].type == "message" and made.output[0].role == "assistant"
    assert made.usage.input_tokens == chat.usage.prompt_tokens
    assert made.usage.output_tokens == chat.usage.completion_tokens
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    stopped_early = chat.choices[0].finish_reason == "length"
    assert made.status == ("incomplete" if stopped_early else "completed")
    assert (made.incomplete_details is not None and made.incomplete_details.reason == "max_output_tokens") \
        == stopped_early
    assert made.usage.model_extra["flylocal"]["verifier"] == "strict"


def test_a_streamed_response_has_the_event_sequence_and_the_same_text(client):
    question = prompt("qa-capital")
    whole = client.responses.create(model=SMOL, input=question, max_output_tokens=24, temperature=0, extra_body=STRICT)
    events = list(client.responses.create(model=SMOL, input=question, max_output_tokens=24, temperature=0,
                                          stream=True, extra_body=STRICT))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with client.responses.stream(model=SMOL, input=question, max_output_tokens=24, temperature=0,
                                 extra_body=STRICT) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


def test_a_tool_round_trip_continues_from_the_stored_response(client):
    from openai import NotFoundError

    called = client.responses.create(model=SMOL, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", max_output_tokens=64)
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert client.responses.retrieve(called.id).output[0].call_id == call.call_id
    answer = client.responses.create(model=SMOL, previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 degrees"}],
                                     max_output_tokens=32)
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.previous_response_id == called.id
    # The whole conversation given again, as a client that keeps no ids sends it, is the same prompt.
    again = client.responses.create(model=SMOL, tools=[WEATHER], tool_choice="none", max_output_tokens=32,
                                    input=[{"role": "user", "content": "What is the weather in Paris?"},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments},
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": "Sunny, 21 degrees"}])
    assert again.usage.input_tokens == answer.usage.input_tokens
    with pytest.raises(NotFoundError) as e:
        client.responses.create(model=SMOL, previous_response_id="resp_unknown", input="hi", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(called.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(called.id)


def test_a_json_schema_output_parses(client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    for seed in range(3):
        parsed = client.responses.parse(model=SMOL, input="Give a city and its population as JSON.", text_format=City,
                                        max_output_tokens=64, temperature=0.8, extra_body={"seed": seed})
        assert isinstance(parsed.output_parsed, City)


def test_built_in_tools_and_reasoning_are_refused_by_name(client, server):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=SMOL, input="hi", tools=[{"type": "web_search"}], max_output_tokens=4)
    assert "tools[0].type" in e.value.message
    with pytest.raises(BadRequestError) as e:     # no reasoning to summarize
        client.responses.create(model=SMOL, input="hi", reasoning={"effort": "high", "summary": "auto"},
                                max_output_tokens=4)
    assert "reasoning.summary" in e.value.message
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=SMOL, input="hi", include=["file_search_call.results"], max_output_tokens=4)
    assert "include[0]" in e.value.message
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=SMOL, input=[{"type": "input_image", "image_url": "x"}], max_output_tokens=4)
    assert "input[0]" in e.value.message
    # Fields at their do-nothing values are accepted.
    quiet = client.responses.create(model=SMOL, input="hi", max_output_tokens=4, store=False, truncation="disabled",
                                    parallel_tool_calls=True, metadata={"a": "b"}, reasoning={"effort": None},
                                    include=["reasoning.encrypted_content"], service_tier="auto")
    assert quiet.status in ("completed", "incomplete")
    missing = httpx.get(server + f"/v1/responses/{quiet.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"   # store: false


def test_an_effort_is_honoured_by_no_reasoning_and_logprobs_are_included(client):
    question = prompt("qa-capital")
    made = client.responses.create(model=SMOL, input=question, max_output_tokens=12, temperature=0,
                                   reasoning={"effort": "low"}, include=["message.output_text.logprobs"],
                                   top_logprobs=2, extra_body=STRICT)
    assert made.reasoning.effort == "low" and made.usage.output_tokens_details.reasoning_tokens == 0
    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": question}], max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2, reasoning_effort="low",
                                          extra_body=STRICT)
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    logprobs = made.output[0].content[0].logprobs
    assert [(p.token, p.logprob) for p in logprobs] == [(c.token, c.logprob) for c in chat.choices[0].logprobs.content]
    assert all(len(p.top_logprobs) == 2 and p.top_logprobs[0].logprob >= p.logprob for p in logprobs)
    events = list(client.responses.create(model=SMOL, input=question, max_output_tokens=12, temperature=0, stream=True,
                                          include=["message.output_text.logprobs"], extra_body=STRICT))
    streamed = [p.token for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    assert streamed == [p.token for p in logprobs]
    plain = client.responses.create(model=SMOL, input=question, max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_items_to_fit(client):
    from openai import BadRequestError

    items = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"Note {i}: " + "the river runs past the old mill and the bridge. " * 6} for i in range(30)]
    items.append({"role": "user", "content": "Say hi."})
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=SMOL, input=items, max_output_tokens=8)
    assert e.value.code == "context_length_exceeded"
    made = client.responses.create(model=SMOL, input=items, max_output_tokens=8, truncation="auto")
    assert made.truncation == "auto" and made.usage.input_tokens <= 1024 - 8
    assert made.usage.input_tokens > 1024 // 2        # the oldest went; as many as fit stayed


def test_input_items_are_listed_in_pages(client, server):
    from openai import NotFoundError

    items = [{"role": "user", "content": f"Item {i}."} for i in range(5)]
    made = client.responses.create(model=SMOL, input=items, max_output_tokens=2)
    listed = client.responses.input_items.list(made.id)
    assert [i.content[0].text for i in listed.data] == [f"Item {i}." for i in reversed(range(5))]   # desc
    assert listed.data[0].type == "message" and listed.data[0].role == "user" and listed.data[0].id
    ascending = client.responses.input_items.list(made.id, order="asc", limit=2)
    assert [i.content[0].text for i in ascending.data] == ["Item 0.", "Item 1."] and ascending.has_more
    texts = [i.content[0].text for i in client.responses.input_items.list(made.id, order="asc", limit=2)]   # pages on
    assert texts == [f"Item {i}." for i in range(5)]
    after = client.responses.input_items.list(made.id, order="asc", after=ascending.last_id)
    assert [i.content[0].text for i in after.data] == ["Item 2.", "Item 3.", "Item 4."] and not after.has_more
    one = client.responses.create(model=SMOL, input="Just this.", max_output_tokens=2)
    assert [i.content[0].text for i in client.responses.input_items.list(one.id)] == ["Just this."]
    with pytest.raises(NotFoundError):
        client.responses.input_items.list("resp_unknown")
    bad = httpx.get(server + f"/v1/responses/{made.id}/input_items?limit=500", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_the_agents_sdk_runs_on_its_default_model_path(server):
    from openai import AsyncOpenAI
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    async def run():
        set_default_openai_client(AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0),
                                  use_for_tracing=False)
        plain = Agent(name="plain", instructions="Answer briefly.", model=SMOL,
                      model_settings=ModelSettings(max_tokens=24, reasoning=Reasoning(effort="low")))
        said = await Runner.run(plain, prompt("qa-capital"))
        tooled = Agent(name="tooled", instructions="Use the tools.", model=SMOL, tools=[get_weather],
                       tool_use_behavior="stop_on_first_tool",
                       model_settings=ModelSettings(max_tokens=64, tool_choice="required"))
        told = await Runner.run(tooled, "What is the weather in Paris?", max_turns=2)
        streamed = Runner.run_streamed(plain, prompt("qa-capital"))
        async for _ in streamed.stream_events():
            pass
        return said.final_output, told.final_output, streamed.final_output

    said, told, streamed = asyncio.run(run())
    assert said and streamed == said
    assert len(calls) == 1 and told == f"Sunny in {calls[0]}"


def test_pydantic_ai_and_langchain_responses_models_answer(server):
    from langchain_openai import ChatOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(SMOL, provider=OpenAIProvider(base_url=server + "/v1", api_key=KEY))
    said = Agent(model, model_settings={"max_tokens": 24, "temperature": 0}).run_sync(prompt("qa-capital")).output
    assert said
    chat = ChatOpenAI(model=SMOL, base_url=server + "/v1", api_key=KEY, use_responses_api=True, max_tokens=24,
                      temperature=0, max_retries=0, timeout=120)
    answer = chat.invoke(prompt("qa-capital")).text
    assert answer == said
    assert "".join(c.text for c in chat.stream(prompt("qa-capital"))) == answer


def test_every_listed_model_is_retrieved_and_can_be_named(client):
    from openai import NotFoundError

    listed = [m.id for m in client.models.list()]
    assert listed == [SMOL]
    for name in listed:
        assert client.models.retrieve(name).id == name
        assert client.responses.create(model=name, input="hi", max_output_tokens=2).model == name
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4o")
