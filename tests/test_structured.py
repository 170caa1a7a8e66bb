"""Structured output and tool calls (docs/design.md, "Grammars", "Tool calls") on SmolLM2:
through `flylocal generate`, and through `flylocal serve` with the real `openai` and `ollama`
clients. A 135M model calls tools badly; the mechanism must still be right: every answer is a
valid call or plain text, and every constrained answer parses and validates.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from conftest import SMOL, SMOL_Q4_0
from test_server import served

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["python", "rust", "c", "go"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 30}}}}}


def flylocal(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flylocal", *args, "--threads", "1"], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_under_a_json_schema_gives_valid_json_and_strict_is_plain(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    plain = flylocal("generate", "Describe a programmer called Ada as JSON.", "--json-schema", "-", "--json",
                     "--exact", "--drafter", "none", "--max-tokens", "96", stdin=json.dumps(PERSON))
    assert plain.returncode == 0, plain.stderr
    reference = json.loads(plain.stdout)
    assert reference["stats"]["forced"] == 0
    jsonschema.validate(json.loads(reference["text"]), PERSON)
    for drafter in ("pld", "model", "mla"):
        out = flylocal("generate", "Describe a programmer called Ada as JSON.", "--json-schema", str(schema), "--json",
                       "--exact", "--verifier", "strict", "--drafter", drafter, "--draft", SMOL_Q4_0,
                       "--max-tokens", "96")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["tokens"] == reference["tokens"] and result["stats"]["forced"] > 0, drafter


def nested(depth: int, key: str = "items") -> dict:
    """A schema `depth` arrays (key "items") or objects (key "properties") deep."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema} if key == "items" else {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_constraints_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    deep = tmp_path / "deep.json"           # 500 objects deep: too deep for Python's own json reader
    deep.write_text('{"type": "object", "properties": {"a": ' * 500 + "{}" + "}}" * 500)
    pattern = tmp_path / "pattern.json"
    pattern.write_text('{"type": "string", "pattern": "a("}')
    for args, words in [(["--json-schema", str(bad)], "cannot be used"),
                        (["--json-schema", str(deep)], "nested too deep"),
                        (["--json-schema", str(pattern)], 'invalid regex "a(": unclosed group'),
                        (["--json-schema", str(tmp_path / "none.json")], "cannot read the JSON schema"),
                        (["--json-object", "--grammar", str(bad)], "not several")]:
        out = flylocal("generate", "hi", *args)
        assert out.returncode != 0 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def server():
    yield from served("--target", SMOL, "--draft", SMOL_Q4_0, "--ctx", "2048")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)


class Person(BaseModel):
    name: str
    age: int


def test_openai_response_format_json_schema_and_its_parse_helper(client):
    for verifier in ("strict", "fly", "asd"):
        r = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Describe a programmer called Ada."}], max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            extra_body={"verifier": verifier, "drafter": "mla"})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    parsed = client.beta.chat.completions.parse(
        model=SMOL, messages=[{"role": "user", "content": "Who is Ada? Give her name and age."}], max_tokens=64,
        response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    obj = client.chat.completions.create(model=SMOL, max_tokens=96, response_format={"type": "json_object"},
                                         messages=[{"role": "user", "content": "A JSON object about a cat."}])
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


class Town(BaseModel):
    population: int
    founded: int
    area: int


TOWNS = ["Lyon", "Osaka", "Quito", "Perth", "Bergen", "Tucson", "Gdansk", "Mysore", "Cusco", "Dakar"]


def test_openai_parse_of_integer_fields_ends_before_the_token_limit(client):
    # Unbounded, an integer ran to the token limit one run in two ("population": 1111...).
    # Bounded at 16 digits, three of them fit in 63 tokens: every run ends, with every method.
    from openai import LengthFinishReasonError

    methods = [(v, d) for v in ("strict", "fly", "asd") for d in ("mla", "model", "pld", "none")]
    cut = []
    for i in range(20):
        verifier, drafter = methods[i % len(methods)]
        try:
            r = client.chat.completions.parse(
                model=SMOL, messages=[{"role": "user", "content": f"Facts about {TOWNS[i % len(TOWNS)]}, in numbers."}],
                response_format=Town, max_tokens=96, temperature=0.9, seed=i,
                extra_body={"verifier": verifier, "drafter": drafter})
        except LengthFinishReasonError:
            cut.append((i, verifier, drafter))
            continue
        town = r.choices[0].message.parsed
        assert all(abs(n) < 10**16 for n in (town.population, town.founded, town.area))
    assert cut == []


def test_openai_tools_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=SMOL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    answer = client.chat.completions.create(model=SMOL, messages=messages, tools=[WEATHER, TIME], max_tokens=48)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A named function is called; "auto" answers with a call or with text, never broken JSON.
    named = client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Time in Tokyo?"}], tools=[WEATHER, TIME], max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    for question in ("Hello! How are you?", "Weather in Rome, in celsius?"):
        auto = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": question}],
                                              tools=[WEATHER, TIME], max_tokens=96)
        m = auto.choices[0].message
        if m.tool_calls:
            assert auto.choices[0].finish_reason == "tool_calls"
            json.loads(m.tool_calls[0].function.arguments)
        else:
            assert not m.content.startswith("{")


def test_a_streamed_tool_call_arrives_as_openai_deltas(client):
    stream = client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], max_tokens=96,
        tool_choice="required", stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


class Country(BaseModel):
    """A plain pydantic model: its schema says nothing of other keys, as clients send it."""
    name: str
    population: int
    area_km2: float


def test_a_schema_that_omits_additional_properties_gets_its_keys_alone(client, server):
    # Read openly, 9 answers in 10 added keys until the token limit; read as llama.cpp reads it,
    # each answer has the schema's keys alone and ends (its number's fraction bounded too).
    import ollama

    schema = Country.model_json_schema()
    assert "additionalProperties" not in schema
    for seed in range(10):
        r = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Describe France as JSON."}], max_tokens=96,
            temperature=0.8, seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "country",
                                                                                                "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert set(json.loads(r.choices[0].message.content)) == set(Country.model_fields)
    parsed = client.chat.completions.parse(model=SMOL, messages=[{"role": "user", "content": "Describe France."}],
                                           response_format=Country, max_tokens=96, temperature=0.8, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Country)
    said = ollama.Client(host=server).chat(model=SMOL, messages=[{"role": "user", "content": "Describe France."}],
                                           format=schema, options={"num_predict": 96, "temperature": 0.8, "seed": 2})
    assert set(json.loads(said.message.content)) == set(Country.model_fields) and said.done_reason == "stop"


def test_instructor_gets_its_model_by_its_schema_and_tool_modes(server):
    import instructor
    from openai import OpenAI

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):      # its default; a schema as the format
        extract = instructor.from_openai(OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120),
                                         mode=mode)
        got = extract.chat.completions.create(
            model=SMOL, response_model=Country, max_tokens=96, max_retries=0,
            messages=[{"role": "user", "content": "Extract: France has 68 million people and 551695 km2."}])
        assert isinstance(got, Country), mode


def test_a_smolagents_tool_calling_agent_calls_its_tool(server):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.utils import AgentGenerationError, AgentParsingError, AgentToolCallError

    calls = []

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city.

        Args:
            city: the city's name
        """
        calls.append(city)
        return f"Sunny in {city}"

    model = OpenAIServerModel(model_id=SMOL, api_base=server + "/v1", api_key="none", max_tokens=96, temperature=0)
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
    agent.run("What is the weather in Paris?")
    steps = [step for step in agent.memory.steps if hasattr(step, "tool_calls")]
    # Every answer is a call of a tool it offered, with its arguments ("model output does not
    # contain any JSON blob" before); which tool the model picks, and whether it ends within two
    # steps (smolagents then adds a step of its own), is the model's business.
    broken = (AgentParsingError, AgentGenerationError, AgentToolCallError)
    assert not any(isinstance(step.error, broken) for step in steps), [step.error for step in steps]
    called = [call for step in steps for call in step.tool_calls or ()]
    assert called and all(call.name in ("get_weather", "final_answer") for call in called)
    assert all(isinstance(city, str) and city for city in calls)


def test_the_ollama_client_with_a_format_schema_and_tools(server):
    import ollama

    c = ollama.Client(host=server)
    r = c.chat(model=SMOL, messages=[{"role": "user", "content": "Describe a programmer called Ada."}],
               format=PERSON, options={"num_predict": 96})
    jsonschema.validate(json.loads(r.message.content), PERSON)
    g = c.generate(model=SMOL, prompt="A JSON object about a dog.", format="json", options={"num_predict": 96})
    if g.done_reason == "stop":
        assert isinstance(json.loads(g.response), dict)
    t = c.chat(model=SMOL, messages=[{"role": "user", "content": "Weather in Lima, in celsius?"}], tools=[WEATHER],
               options={"num_predict": 96})
    if t.message.tool_calls:
        call = t.message.tool_calls[0].function
        assert call.name == "get_weather" and isinstance(call.arguments, dict)
    else:
        assert not t.message.content.startswith("{")


def test_bad_formats_and_tools_are_400s(server):
    url = server + "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    for body, words in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": {"$ref": "#/no"}}}},
                         "cannot be used"),
                        ({"response_format": {"type": "yaml"}}, "response_format"),
                        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "needs a name"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "not among the tools"),
                        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "one of them"),
                        ({"tools": [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}],
                          "tool_choice": "required"}, "tools[0].function.parameters: a call of 'say'"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep",
                                                                                     "schema": nested(300)}}},
                         "nested too deep")]:
        r = httpx.post(url, json={"messages": msg, **body}, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(server + "/api/chat", json={"model": SMOL, "messages": msg, "format": "yaml"}, timeout=30)
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_bench_under_a_json_schema_reports_validity_and_forced_tokens(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Describe a programmer called Ada. Answer in JSON."}) + "\n")
    out = subprocess.run([sys.executable, "-m", "flylocal", "bench", "--prompts", str(prompts), "--json-schema", "-",
                          "--methods", "autoregressive,strict-pld", "--max-tokens", "96", "--threads", "1",
                          "--out", str(tmp_path / "out")], input=json.dumps(PERSON), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["methods"]}
    assert rows["autoregressive"]["valid"] == rows["strict-pld"]["valid"] == 1.0
    assert rows["autoregressive"]["forced_per_round"] == 0 and rows["strict-pld"]["forced_per_round"] > 0
    assert rows["strict-pld"]["agreement"] == 1.0
