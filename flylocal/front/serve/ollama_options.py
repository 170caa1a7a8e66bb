"""Ollama's `options`, and its other values that name no text (keep_alive), as flylocal reads
them (docs/serving.md, "Server"): a sampling option by the command line's declaration, a count,
a hint that changes nothing (what tunes how a model is loaded or run: flylocal sets that at
start), an option fixed at flylocal's one value, or a 400 naming it. The Ollama dialect reads
them in `options`; the OpenAI dialect takes the same names where Open WebUI passes its users'
Ollama settings along beside OpenAI's fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import click

from flylocal.front.serve.app import LOADING_OPTIONS
from flylocal.front.serve.fields import ApiError, checked_option, checked_stops
from flylocal.front.serve.keys import checked_salt
from flylocal.front.serve.request import CONTEXT
from flylocal.settings import OPTIONS

# option -> the declared option that checks it (and the sampling field it sets)
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "seed": "seed", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty"}
# Options that tune how a model is loaded or run: a request's value is a hint (flylocal.front.serve.app).
HINTS = LOADING_OPTIONS
# Options that change the text at any value but one, which is flylocal's: another is a 400.
FIXED = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "rope_frequency_base": 0, "rope_frequency_scale": 0}
# Options that change nothing here at any value: mirostat's rates (mirostat is 0), and
# penalize_newline, which ollama itself no longer reads.
IDLE = frozenset({"mirostat_eta", "mirostat_tau", "penalize_newline"})
FLAGS = frozenset({"use_mmap", "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all",
                   "penalize_newline"})
# keep_alive: a Go duration ("5m", "1h30m", "-1s"), or seconds (a number, or a string of one)
DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+|[-+]?\d+")


UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def keep_seconds(value) -> float | None:
    """A checked keep_alive (`checked_keep_alive`) in seconds: a negative one as -1 (for good),
    None as None (the model's own)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        seconds = sign * (float(body) if PART.match(body) is None else
                          sum(float(n) * UNIT_SECONDS[u] for n, u in PART.findall(body)))
    return -1.0 if seconds < 0 else seconds


def whole(value) -> int:
    """A JSON number that is an integer (2, or 2.0) as an int; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):          # 1.5, Infinity, NaN
        raise ValueError(f"{json.dumps(value)[:80]} is not a whole number")
    return int(value)


def checked_keep_alive(value):
    """keep_alive as ollama takes it: a duration ("5m", "1h30m", "-1" for ever) or a number of
    seconds, or None; ValueError naming it otherwise."""
    number = (isinstance(value, int) and not isinstance(value, bool)) or \
        (isinstance(value, float) and math.isfinite(value))
    if value is None or number or (isinstance(value, str) and DURATION.fullmatch(value.strip())):
        return value
    raise ValueError(f"{json.dumps(value)[:80]}; a duration (\"5m\", \"1h\", \"-1\" for ever) or a number of "
                     "seconds")


def sampling_option(name: str, value):
    """An option of SAMPLING_OPTIONS checked by its declaration (a JSON number, a whole one for
    an integer option); ValueError naming the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{json.dumps(value)[:80]} is not a number")
    option = SAMPLING_OPTIONS[name]
    if isinstance(OPTIONS[option].type, click.types.IntParamType):
        value = whole(value)
        if name == "seed" and value == -1:
            return None                         # ollama's (and llama.cpp's) "a random seed"
    return checked_option(value, option)


@dataclasses.dataclass(frozen=True)
class Options:
    """Ollama's `options` as flylocal reads them (read_options)."""
    params: dict                        # declared option -> value (CONTEXT: the context's end)
    stops: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()         # options given that change nothing here (HINTS)
    num_ctx: int | None = None          # the context the client wished for


def read_options(options: dict | None, where: str | None = "options") -> Options:
    """`options` checked as ollama's documentation types them: a sampling option by its
    declaration, num_predict and repeat_last_n as counts, a hint (HINTS) or an idle option by
    its type alone, a FIXED one at its value; ApiError 400 naming the first that is not, or
    that ollama does not document (named `where.name`, or `name` alone for fields at the top
    level: where=None). An option given as null is one left unset (LangChain sends them all)."""
    params: dict[str, Any] = {}
    stops: list[str] = []
    hints, num_ctx = [], None
    for name, value in (options or {}).items():
        if value is None:
            continue
        try:
            if name in SAMPLING_OPTIONS:
                params[SAMPLING_OPTIONS[name]] = sampling_option(name, value)
            elif name == "num_predict":
                value = whole(value)
                if value < -2 or value == 0:
                    raise ValueError(f"{value}; a positive count, or -1 (to the context's end)")
                params["max_tokens"] = CONTEXT if value < 0 else value
            elif name == "stop":
                stops = checked_stops(value)
            elif name == "repeat_last_n":
                value = whole(value)
                if value < -1:
                    raise ValueError(f"{value}; a count of tokens, -1 (the context) or 0 (no penalties)")
                params["repeat_last_n"] = CONTEXT if value == -1 else value
            elif name in HINTS or name in IDLE:
                if name in FLAGS:
                    if not isinstance(value, bool):
                        raise ValueError(f"{json.dumps(value)[:80]} is not true or false")
                elif name in ("mirostat_eta", "mirostat_tau"):
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise ValueError(f"{json.dumps(value)[:80]} is not a number")
                else:
                    value = whole(value)
                    if name == "num_ctx":
                        if value < 1:
                            raise ValueError(f"{value}; a positive count of tokens")
                        num_ctx = value
                if name in HINTS:
                    hints.append(name)
            elif name == "cache_salt":                # whose prompt cache it shares (Generation.salt_given)
                checked_salt(value)
            elif name in FIXED:
                if isinstance(value, bool) or value != FIXED[name]:
                    raise ValueError(f"{json.dumps(value)[:80]}; flylocal does not offer it (only {FIXED[name]!r})")
            else:
                raise ValueError("no option of ollama's that flylocal knows")
        except (ValueError, OverflowError) as e:      # OverflowError: an integer no float holds
            raise ApiError(400, f"{where}.{name}: {e}" if where else f"{name}: {e}", param=where or name) from None
    if params.get("repeat_last_n") == 0:    # ollama's repeat_last_n 0: the penalties look at no tokens
        del params["repeat_last_n"]
        params.update(repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    return Options(params, tuple(stops), tuple(hints), num_ctx)
