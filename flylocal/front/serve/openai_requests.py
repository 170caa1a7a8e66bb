"""The OpenAI dialect's requests (flylocal.front.serve.openai): pydantic models of
/v1/chat/completions and /v1/completions bodies, checked field by field, and the settings a
request runs with.

A field real clients send at its do-nothing value is accepted (`n: 1`, `tools: []`,
`logprobs: false`, `response_format: {"type": "text"}`, `store: false`, `user`, a message's
`name`, ...); a field whose value flylocal cannot honour is a 400 naming the field and the
value; a field it does not know is a 400 naming it: nothing is silently ignored. flylocal's own
fields (openai's `extra_body`) are checked by the command line's declarations (CHECKED).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flylocal.front.serve.fields import ApiError, check_fields, checked_stops, parse_request
from flylocal.front.serve.keys import checked_salt
from flylocal.front.serve.ollama_options import FIXED, HINTS, IDLE, checked_keep_alive, read_options
from flylocal.front.serve.request import JsonOutput, TopLogprobs

# Request field -> the declared option whose type and range it must satisfy.
CHECKED = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "top_k": "top_k", "min_p": "min_p",
           "repeat_penalty": "repeat_penalty", "frequency_penalty": "frequency_penalty",
           "presence_penalty": "presence_penalty", "k": "k", "fly_entropy": "fly_entropy",
           "fly_window": "fly_window", "asd_gate": "asd_gate", "asd_cap": "asd_cap", "asd_budget": "asd_budget",
           "verifier": "verifier", "drafter": "drafter", "max_tokens": "max_tokens",
           "max_completion_tokens": "max_tokens", "max_output_tokens": "max_tokens"}


# ----- requests -----

class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str                            # JSON text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None                  # a streamed call's place, which clients echo back


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None                   # who spoke: the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None           # a tool's result: the call it answers
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict:
        """The message as the session renders it."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude={"index"}) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None                # flylocal's output always follows the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {\"name\", \"schema\"}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: type {self.type} takes none (a schema goes with type json_schema)")
        return self

    def output(self) -> JsonOutput | None:
        """The output's format in the body's terms, or None for free text."""
        if self.type == "json_object":
            return JsonOutput(None, "response_format")
        if self.type == "json_schema":
            return JsonOutput(self.json_schema.schema_ or {}, f"response_format.json_schema {self.json_schema.name!r}")
        return None


def refuse(value, why: str):
    raise ValueError(f"{json.dumps(value)[:80]}; {why}")


# A reasoning effort, as OpenAI names them (Responses' `reasoning.effort`, chat's `reasoning_effort`).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# OpenAI's bounds on metadata, and on an identifier (`user`) held as one of its values.
METADATA_KEYS, KEY_CHARS, VALUE_CHARS = 16, 64, 512


def checked_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata` within OpenAI's bounds (16 keys, 64-character keys, 512-character values):
    a server that keeps responses keeps it with them; ValueError otherwise."""
    if v is None:
        return v
    if len(v) > METADATA_KEYS:
        raise ValueError(f"{len(v)} keys; at most {METADATA_KEYS}")
    for key, value in v.items():
        if len(key) > KEY_CHARS:
            refuse(key, f"a metadata key has at most {KEY_CHARS} characters")
        if len(value) > VALUE_CHARS:
            raise ValueError(f"the value of {json.dumps(key)} has {len(value)} characters; at most {VALUE_CHARS}")
    return v


def checked_identifier(v: str | None) -> str | None:
    if v is not None and len(v) > VALUE_CHARS:
        raise ValueError(f"{len(v)} characters; at most {VALUE_CHARS}")
    return v


class Own(BaseModel):
    """flylocal's own fields (openai's extra_body), the same on every OpenAI endpoint."""

    model_config = ConfigDict(extra="forbid", strict=True)
    seed: int | None = None
    verifier: str | None = None
    drafter: str | None = None
    k: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    fly_entropy: float | None = None
    fly_window: int | None = None
    asd_gate: float | None = None
    asd_cap: int | None = None
    asd_budget: float | None = None
    cache_salt: str | None = None          # vLLM's: the prompt cache is shared only with the same salt

    @field_validator("cache_salt")
    @classmethod
    def salt(cls, v):
        return checked_salt(v)


# Ollama's names that Open WebUI passes along beside OpenAI's fields when its users set them
# (its OpenAI path sends every advanced parameter at the top level): none changes the text here.
OLLAMA_ONLY = frozenset(HINTS) | IDLE | frozenset(FIXED) | {"keep_alive", "think"}


class Common(Own):
    """The fields both endpoints take. Anything else is refused (extra="forbid")."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                   # an end user's id, for the provider's abuse checks
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None    # tags for stored completions: nothing is stored
    ollama_hints: tuple[str, ...] = Field(default=(), exclude=True)    # (ollama_settings) to log once

    @model_validator(mode="before")
    @classmethod
    def ollama_settings(cls, data):
        """Ollama's settings Open WebUI passes along (num_ctx, num_gpu, mirostat, keep_alive,
        think, ...), each checked as the Ollama dialect checks it (a hint changes nothing; a
        value that would change the text and cannot be served is a 400 naming it), then set
        aside: the loading hints among them are logged once."""
        if not isinstance(data, dict) or not OLLAMA_ONLY & data.keys():
            return data
        given = {name: value for name, value in data.items() if name in OLLAMA_ONLY}
        try:
            checked_keep_alive(given.pop("keep_alive", None))
        except ValueError as e:
            raise ApiError(400, f"keep_alive: {e}", param="keep_alive") from None
        if given.pop("think", None) not in (None, False):
            raise ApiError(400, f"think: {json.dumps(data['think'])[:80]}; flylocal runs no thinking mode", param="think")
        hints = read_options(given, where=None).hints
        return {k: v for k, v in data.items() if k not in OLLAMA_ONLY} | {"ollama_hints": hints}

    @field_validator("metadata")
    @classmethod
    def bounded_metadata(cls, v):
        return checked_metadata(v)

    @field_validator("user")
    @classmethod
    def bounded_user(cls, v):
        return checked_identifier(v)

    @field_validator("n")
    @classmethod
    def one_choice(cls, v):
        if v is not None and v != 1:
            refuse(v, "flylocal generates one choice per request: n must be 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def stops(cls, v):
        if v is not None:
            checked_stops(v)
        return v

    @field_validator("logit_bias")
    @classmethod
    def biases(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                refuse(key, "a logit_bias key is a token id")
            if not -100 <= bias <= 100:
                refuse(bias, "a logit bias lies between -100 and 100")
        return v

    @field_validator("service_tier")
    @classmethod
    def one_tier(cls, v):
        if v not in (None, "auto", "default"):
            refuse(v, "flylocal has one service tier (auto, default)")
        return v

    @field_validator("store")
    @classmethod
    def nothing_stored(cls, v):
        if v:
            refuse(v, "flylocal keeps no completions")
        return v

    @model_validator(mode="after")
    def usage_needs_a_stream(self):
        if self.stream_options is not None and self.stream_options.include_usage and not self.stream:
            raise ValueError("stream_options.include_usage is only allowed with stream: true")
        return self


class ChatRequest(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # flylocal's models run no reasoning mode: any effort is honoured by none (0 reasoning tokens)
    reasoning_effort: Literal[EFFORTS] | None = None

    @field_validator("messages")
    @classmethod
    def some(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v



class CompletionRequest(Common):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None                 # the text after the middle to fill in (a FIM model's)

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            refuse(len(v), "prompts; flylocal takes one prompt per request")
        return v

    @field_validator("logprobs")
    @classmethod
    def logprob_range(cls, v):
        if v is not None and not 0 <= v <= 5:
            refuse(v, "logprobs lies between 0 and 5")
        return v

    @field_validator("echo")
    @classmethod
    def no_echo(cls, v):
        if v:
            refuse(v, "flylocal does not echo the prompt")
        return v

    @field_validator("best_of")
    @classmethod
    def one_best(cls, v):
        if v not in (None, 1):
            refuse(v, "flylocal generates one completion per request: best_of must be 1")
        return v



def parse(model: type[BaseModel], raw: bytes) -> Any:
    """A request body as `model`, every field within its declared range, or ApiError 400."""
    req = parse_request(model, raw)
    check_fields(req, CHECKED)
    return req


def options_of(req: Own) -> dict:
    """A request's fields as the command line's options (CHECKED names the option each field
    sets; a later field wins: max_completion_tokens over max_tokens)."""
    given = type(req).model_fields
    return {option: getattr(req, name) for name, option in CHECKED.items()
            if name in given and getattr(req, name) is not None}
