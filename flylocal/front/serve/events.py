"""What a generation behind `flylocal serve` says to the request that asked for it: typed
events, the same under every API dialect (docs/serving.md, "Server").

    Text*  then  Done | Failed          (a generation)
    Computed | Failed                  (any other job: embeddings)

A `Text` is text that may go out now and the output tokens it completes; `Done` ends an answer
(why it stopped, its stats, and the call it made when it was a tool call); `Failed` ends a job
that raised. Each dialect renders these in its own shapes (flylocal.front.serve.openai,
flylocal.front.serve.ollama).
"""

from __future__ import annotations

from dataclasses import dataclass

from flylocal.decoding.stats import Stats

# Why an answer stopped -> the finish reason every dialect reports.
FINISH = {"eog": "stop", "stop_string": "stop", "max_tokens": "length", "context": "length"}


@dataclass(frozen=True)
class OutToken:
    id: int
    piece: bytes                  # its own bytes (a token may hold part of a character)
    kind: str                     # "accepted", "loose" or "target" (flylocal.decoding.engine)
    logprob: float | None = None  # under the target's distribution, when asked for
    top: tuple = ()               # ((id, bytes, logprob), ...) most likely first, when asked for
    chars: int = 0                # characters of the answer's text it ends, after the previous token's
                                  # (0 for a token that only begins a character; the one completing it has it)

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", "replace")


@dataclass(frozen=True)
class Text:
    text: str
    tokens: tuple[OutToken, ...] = ()     # the output tokens this text completes (when asked for)


@dataclass(frozen=True)
class Done:
    reason: str                    # "eog", "max_tokens", "context", "stop_string", "interrupted", ...
    stats: Stats
    n_tokens: int                  # output tokens
    # the tool call the answer was ({"name", "arguments"}), if it was one; cut short by the token
    # limit, its arguments are their JSON text so far (flylocal.front.serve.tools.cut_call)
    call: dict | None = None
    call_tokens: tuple[OutToken, ...] = ()    # the tokens of that call
    stop: str | None = None                   # the stop string that ended it (reason "stop_string")

    @property
    def cut(self) -> bool:
        """A call cut short: it has a name, and arguments that are not whole."""
        return self.call is not None and isinstance(self.call["arguments"], str)

    @property
    def finish(self) -> str:
        """The finish reason: stop, length, or tool_calls (a call cut short is "length", as
        llama-server reports it)."""
        return "tool_calls" if self.call is not None and not self.cut else FINISH.get(self.reason, "stop")


@dataclass(frozen=True)
class Failed:
    error: BaseException

    @property
    def message(self) -> str:
        from flylocal.errors import FlylocalError

        return str(self.error) if isinstance(self.error, FlylocalError) else f"internal error: {type(self.error).__name__}"


@dataclass(frozen=True)
class Computed:
    value: object                  # what a job that is not a generation returned


Event = Text | Done | Failed | Computed
