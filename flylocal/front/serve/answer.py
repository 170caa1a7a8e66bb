"""One answer as every dialect takes it (docs/serving.md, "Server"): the worker's events for a
job, with the text of an answer that may be a tool call held back until it is known to be one
(then `Done.call` carries it) or not (then the text goes out as it is), and the stats every
dialect reports. A dialect renders `events()` as a stream, or `whole()` as one response."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from flylocal.front.serve import tools
from flylocal.front.serve.events import Done, Event, Failed, OutToken, Text
from flylocal.front.serve.worker import Job
from flylocal.settings import Settings

CUT = ("max_tokens", "context")         # why an answer ends before it is whole


@dataclass
class Whole:
    """A whole answer: its text (none for a tool call), its tokens, and how it ended (None: the
    server shut down first); `gone` when its client left first (logged as 499, what nginx
    logs a request its client closed as)."""
    text: str = ""
    tokens: list[OutToken] = field(default_factory=list)
    end: Done | Failed | None = None
    gone: bool = False          # the client went away before the end: nobody reads the answer


class Answer:
    def __init__(self, job: Job, queue: asyncio.Queue, calls: tuple[str, ...] = ()):
        self.job, self.queue = job, queue
        self.calls = calls          # how an answer that is a tool call begins ("{", and "<" with tags)

    async def events(self) -> AsyncIterator[Event]:
        """Text events, then Done or Failed. An answer whose first text begins a tool call is
        held back to its end: a call read from it goes out in Done; a call the token limit or
        the context cut goes out as llama-server gives one (tools.cut_call: its name and the
        arguments' text so far, the finish reason "length"), or as nothing where its name was
        not whole yet; anything else (a stop string within it) as one Text."""
        held: list[Text] = []
        holding = None
        while True:
            event = await self.queue.get()
            if isinstance(event, Text):
                if self.calls and holding is None and event.text:
                    holding = event.text.startswith(self.calls)
                if holding:
                    held.append(event)
                    continue
                yield event
                continue
            if isinstance(event, Done) and holding:
                text = "".join(h.text for h in held)
                made = tuple(t for h in held for t in h.tokens)
                if event.reason in CUT:
                    call = tools.cut_call(text)
                    event = dataclasses.replace(event, call=call, call_tokens=made)
                else:
                    call = tools.read_call(text) if event.reason == "eog" else None
                    if call is None:
                        yield Text(text, made)
                    else:
                        event = dataclasses.replace(event, call=call, call_tokens=made)
            yield event
            return

    async def whole(self, request: Request) -> Whole:
        """Every event until the end; a client that goes away meanwhile frees the model within
        a round."""
        out, parts = Whole(), []

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            out.gone = True
            self.job.cancel.set()

        watcher = asyncio.create_task(watch())
        try:
            async for event in self.events():
                if isinstance(event, Text):
                    parts.append(event.text)
                    out.tokens.extend(event.tokens)
                else:
                    out.end = event
                    if isinstance(event, Done):
                        out.tokens.extend(event.call_tokens)
        finally:
            watcher.cancel()
            self.close()
        out.text = "".join(parts)
        return out

    def close(self) -> None:
        """The client has what it wanted, or went away: the model is freed within a round."""
        self.job.cancel.set()


def logprob_entries(tokens) -> list[dict]:
    """Output tokens' logprobs (flylocal.front.serve.events.OutToken) in the entry every dialect
    uses: token, logprob, bytes and the most likely alternatives, and flylocal's word for how it
    came (`kind`: a loose token is a draft token the verifier accepted where the target would have
    chosen another)."""
    def entry(piece: bytes, logprob: float) -> dict:
        return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}

    return [entry(t.piece, t.logprob) | {"top_logprobs": [entry(p, v) for _, p, v in t.top],
                                         "flylocal": {"kind": t.kind}} for t in tokens]


def stats_report(done: Done, settings: Settings) -> dict:
    """flylocal's own report on an answer, the same under every dialect. Valid JSON whatever the
    run: a number that is not finite (an unbounded ASD budget) is null, as JSON has no infinity."""
    stats = done.stats
    report = {"verifier": settings.verifier, "drafter": settings.drafter_name, "rounds": stats.rounds,
              "drafted": stats.drafted, "accepted": stats.accepted, "loose": stats.loose, "forced": stats.forced,
              "mean_accepted_length": round(stats.mean_accepted_length, 4),
              "tokens_per_s": round(stats.tokens_per_s, 3), "prompt_reused": stats.prompt_reused,
              "budget_left": stats.budget_left, "stop": done.reason}
    if stats.draft_context is not None:
        report["draft_context"] = stats.draft_context
    if stats.calibrating:         # its cost curves still measured in slices: a first token waits for one
        report["calibrating"] = True
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in report.items()}
