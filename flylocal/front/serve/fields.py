"""A request's fields as `flylocal serve` reads them (docs/serving.md, "Server"): the refused
request (ApiError, which each dialect renders in its own shape), the body parsed as a pydantic
model with the first bad field named, and the fields checked as the command line checks its
options."""

from __future__ import annotations

import json

import click

from flylocal.settings import OPTIONS

MAX_STOPS = 64           # stop strings in one request (local servers take any number; a bound keeps a
                         # request's cost per token bounded)


class ApiError(Exception):
    """A refused request: its status, message, the field it names and a machine-readable code.
    Each dialect renders it in its own shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----- a request's fields, checked as the command line checks them -----

def checked_option(value, option: str):
    """`value` converted by the declared option `option` (its type and range); ValueError with
    the option's own words when it is out of range. A bool is no number."""
    if isinstance(value, bool) and option not in ("verifier", "drafter"):
        raise ValueError(f"{value!r} is not a number")
    try:
        return OPTIONS[option].type.convert(value, None, None)
    except click.BadParameter as e:
        raise ValueError(e.message) from None


def checked_stops(value) -> list[str]:
    """Stop strings: one string, or a list of at most MAX_STOPS non-empty ones; ValueError."""
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if stops is not None and len(stops) > MAX_STOPS:
        raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOPS}")
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"{json.dumps(value)[:80]}; a string, or a list of at most {MAX_STOPS} non-empty strings")
    return stops


def read_json(raw: bytes) -> dict:
    """A request body as a JSON object, or ApiError 400."""
    try:
        data = json.loads(raw) if raw else {}
    except RecursionError:
        raise ApiError(400, "the request body is nested too deep") from None
    except ValueError:                           # not JSON, not UTF-8, a huge number
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def parse_request(model, raw: bytes, forbidden: str = "flylocal does not support the field {param!r}"):
    """A request body as the pydantic `model`, or ApiError 400 naming the first bad field (and
    its value); `forbidden` words a field the model does not take."""
    from pydantic import ValidationError

    data = read_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # A union's branch shows in the location as its type (`stop.str`); the field is named alone.
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and (x in TYPE_TAGS or "[" in x))) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, forbidden.format(param=param), param=param, code="unsupported_field") from None
        message = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None


def check_fields(req, checked: dict[str, str]) -> None:
    """Each field of `req` named in `checked` (field -> declared option), where it is given,
    within the option's type and range; ApiError 400 naming the field otherwise."""
    for name, option in checked.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        try:
            checked_option(value, option)
        except ValueError as e:
            raise ApiError(400, f"{name}: {e}", param=name) from None


