"""The generations behind `flylocal serve`: a bounded FIFO queue of jobs, one worker thread that
loads the models and then runs the jobs (one at a time, or up to --parallel of them in shared
decodes), stop strings cut across tokens, and the Prometheus metrics.

A job's output goes to its request handler through `emit`, as typed events
(flylocal.front.serve.events): Text events, then Done, or Failed when the job raised. A
request's handler sets the job's cancel flag when its client goes away; the worker reads it
after every round, so its slot is free within one round and the caches stay consistent.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flylocal.front.serve.events import Computed, Done, Failed, OutToken, Text
from flylocal.session import Session, TextStream
from flylocal.settings import Settings

SEND_EVERY = 0.1            # seconds between a stream's text events after the first


class Refused(Exception):
    """A request the worker cannot take now (the queue is full): status, message, code, headers."""

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class StopStrings:
    """Cuts text at the first occurrence of any stop string, even one that spans tokens. Text
    that could still turn out to be the start of a stop string is held back, nothing more."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text that may go out now, whether a stop string was found)."""
        text = self.held + text
        self.held = ""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
        if final:
            return text, False
        keep = 0
        for n in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                keep = n
                break
        if keep:
            self.held = text[-keep:]
            text = text[:-keep]
        return text, False


@dataclass
class Job:
    settings: Settings
    ids: Any                                  # [n] int32 prompt ids
    stops: list[str]
    emit: Callable[[Any], None]               # thread-safe: puts an event on the handler's queue
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    tokens: bool = False                      # emit OutTokens (logprobs, kinds) with the text
    grammar: tuple[str, str] | None = None    # (what it is, its llguidance grammar): the output under it


@dataclass
class Call:
    """A job that is not a generation (embeddings): `work(session, cancel)` runs on the worker
    thread, in turn with the generations; what it returns goes to `emit` as Computed."""
    work: Callable[[Session, threading.Event], Any]
    emit: Callable[[Any], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


class Worker:
    """One thread loads the models, then runs the jobs, first come first served: one at a time,
    or, where the models hold several sequences (--parallel), up to that many generations at
    once, every one advancing in each shared decode (flylocal.decoding.batch)."""

    def __init__(self, load: Callable[[], Session], metrics: Metrics, max_queue: int,
                 on_failure: Callable[[BaseException], None] = lambda e: None):
        self.metrics, self.max_queue = metrics, max_queue
        self.session: Session | None = None         # None while the models load
        self.failed: BaseException | None = None
        self.jobs: collections.deque[Job | Call] = collections.deque()     # waiting, oldest first
        self.busy = 0                                               # jobs running
        self.slots = 1                                              # generations at once, once loaded
        self.ready = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, args=(load, on_failure), name="flylocal-worker",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job | Call) -> None:
        with self.ready:
            if any(j.cancel.is_set() for j in self.jobs):       # their clients went away
                self.jobs = collections.deque(j for j in self.jobs if not j.cancel.is_set())
            if len(self.jobs) >= self.max_queue and (self.busy >= self.slots or self.jobs):
                raise Refused(503, f"the server is busy: {len(self.jobs)} requests are waiting (--max-queue)",
                              "queue_full", {"Retry-After": "1"})
            self.jobs.append(job)
            self.metrics.queue.set(len(self.jobs))
            self.ready.notify()

    def stop(self) -> None:
        with self.ready:
            self.stopping = True
            self.ready.notify()

    def _run(self, load, on_failure) -> None:
        try:
            session = load()
        except BaseException as e:  # noqa: BLE001 - the server reports it and exits
            self.failed = e
            on_failure(e)
            return
        if session is None:          # nothing was loaded (a loader that gave up): nothing to run
            return
        self.slots = getattr(session.target, "n_seq", 1)
        self.metrics.slots.set(self.slots)
        self.session = session
        if self.slots > 1:
            self._run_together()
        else:
            self._run_serially()
        with self.session.lock:      # the refined cost curves are saved as the models close
            self.session.models.close()

    def _next(self, wait: bool) -> Job | Call | None:
        """The oldest job whose client is still there (waiting for one when `wait`); None when
        there is none, or when the worker is stopping and none is left."""
        with self.ready:
            while True:
                while wait and not self.jobs and not self.stopping:
                    self.ready.wait()
                if not self.jobs:
                    return None
                job = self.jobs.popleft()
                self.metrics.queue.set(len(self.jobs))
                if not job.cancel.is_set():
                    self.metrics.queue_wait.observe(time.perf_counter() - job.queued_at)
                    self.busy += 1
                    self.metrics.busy.set(self.busy)
                    return job

    def _done(self) -> None:
        with self.ready:
            self.busy -= 1
            self.metrics.busy.set(self.busy)

    def _run_serially(self) -> None:
        while (job := self._next(wait=True)) is not None:
            try:
                with self.session.lock:
                    if isinstance(job, Call):
                        job.emit(Computed(job.work(self.session, job.cancel)))
                    else:
                        self._generate(job)
            except BaseException as e:  # noqa: BLE001 - reported to its request; the server goes on
                job.emit(Failed(e))
            finally:
                self._done()

    def _run_together(self) -> None:
        """Up to `slots` generations in one Batch: between rounds, new jobs take free sequences
        and work that is not a generation (embeddings) runs; each round advances every member."""
        from flylocal.decoding.batch import Batch

        session = self.session
        batch = Batch(session.target)
        streams: dict = {}                        # Generation -> its Stream
        while True:
            while len(streams) < self.slots:
                job = self._next(wait=not streams)
                if job is None:
                    break
                try:
                    with session.lock:
                        if isinstance(job, Call):
                            job.emit(Computed(job.work(session, job.cancel)))
                            self._done()
                            continue
                        stream = Stream(job, session.target, self.metrics)
                        gen = self._join(batch, job)
                except BaseException as e:  # noqa: BLE001 - reported to its request; the server goes on
                    job.emit(Failed(e))
                    self._done()
                    continue
                streams[gen] = stream
            if not streams:
                if self.stopping:
                    break
                continue
            for gen, stream in list(streams.items()):         # clients that went away
                if stream.job.cancel.is_set():
                    batch.leave(gen)
            try:
                with session.lock:
                    events = batch.round()
            except BaseException as e:  # noqa: BLE001 - a failed decode fails the requests in it
                for gen, stream in streams.items():
                    stream.job.emit(Failed(e))
                    self._done()
                streams.clear()
                continue
            for gen, event in events:
                if streams[gen].feed(event):                  # a stop string, or its client went away
                    batch.leave(gen)
            for gen, stream in list(streams.items()):
                if gen.stats.stop:
                    del streams[gen]
                    try:
                        stream.finish(gen)
                    finally:
                        self._done()

    def _join(self, batch, job: Job):
        """`job`'s generation, started in a free sequence of `batch` (FlylocalError for a request
        no engine can run)."""
        session = self.session
        session.models.reconnect()
        seq = batch.place(job.ids)
        grammar = None
        if job.grammar is not None:
            from flylocal.decoding.grammar import Grammar

            grammar = Grammar(session.target, job.grammar[1], job.grammar[0])
        engine = session.models.engine(job.settings, private=True, seq=seq)
        return batch.join(seq, engine, job.ids, grammar=grammar)

    def _generate(self, job: Job) -> None:
        session = self.session
        session.models.reconnect()       # a model whose rpc servers were lost: once they answer again
        grammar = None
        if job.grammar is not None:      # the vocabulary is read once per model, on the first
            from flylocal.decoding.grammar import Grammar

            grammar = Grammar(session.target, job.grammar[1], job.grammar[0])
        gen = session.request(job.ids, job.settings, grammar=grammar)
        stream = Stream(job, session.target, self.metrics)
        try:
            for event in gen:
                if stream.feed(event):
                    break
        finally:
            gen.close()
        stream.finish(gen)


class Stream:
    """A generation's events to its request: text in pieces (at once at first, then at most every
    SEND_EVERY seconds), cut at stop strings, tokens aligned with their text; then Done."""

    def __init__(self, job: Job, target, metrics: Metrics):
        self.job, self.target, self.metrics = job, target, metrics
        self.text = TextStream(target)
        self.stops = StopStrings(job.stops)
        self.tokens = Aligned() if job.tokens else None
        self.stopped, self.first, self.sent, self.pending = False, None, 0.0, ""

    def feed(self, event) -> bool:
        """A round's event; True when the generation should stop here (a stop string, or the
        client went away)."""
        tokens = self.tokens
        if tokens is None:
            piece = self.text.feed(event.tokens)
        else:                            # each token's own characters: its colour, its logprob
            parts = self.text.each(event.tokens)
            piece = "".join(p for _, p in parts)
            tokens.add(self.target, event, parts)
        piece, self.stopped = self.stops.feed(piece)
        self.pending += piece
        now = time.perf_counter()
        # Text goes out at once at first, then at most every SEND_EVERY seconds: each send
        # wakes the event loop, which on a small machine takes a core from llama.cpp, and
        # is an event for the client to read (a browser on the same cores: design.md).
        if self.pending and (self.first is None or now - self.sent >= SEND_EVERY):
            self.first = self.first or now
            self.job.emit(Text(self.pending, tokens.release(len(self.pending)) if tokens else ()))
            self.pending, self.sent = "", now
        return self.stopped or self.job.cancel.is_set()

    def finish(self, gen) -> None:
        """The generation ended: what text is left, then Done with its stats."""
        job, tokens = self.job, self.tokens
        if not self.stopped and not job.cancel.is_set():
            piece, self.stopped = self.stops.feed("", final=True)      # text held as a possible stop string
            self.pending += piece
        if self.pending or (tokens is not None and tokens.waiting(len(self.pending))):
            job.emit(Text(self.pending, tokens.release(len(self.pending), final=True) if tokens else ()))
        stats = gen.stats
        reason = "stop_string" if self.stopped else stats.stop
        if job.cancel.is_set() and reason == "interrupted":
            self.metrics.cancelled.inc()
        self.metrics.observe(stats, len(gen.tokens), self.first - job.queued_at if self.first is not None else None)
        job.emit(Done(reason, stats, len(gen.tokens)))


class Aligned:
    """Output tokens, released as the text they make goes out: a token goes with the text piece
    that completes it; tokens whose text a stop string cut are never released."""

    def __init__(self):
        self.queue: collections.deque[tuple[int, OutToken]] = collections.deque()   # (end in chars, token)
        self.made = 0          # characters of text the tokens so far have made
        self.sent = 0          # characters released

    def add(self, target, event, parts: list[tuple[bytes, str]]) -> None:
        """A round's tokens, with each one's bytes and the text the decoder gave out at it
        (TextStream.each)."""
        logprobs = event.logprobs or [None] * len(event.tokens)
        for i, (tid, kind) in enumerate(zip(event.tokens, event.kinds)):
            lp = logprobs[i]
            top = tuple((t, target.piece(t), v) for t, v in lp[1]) if lp else ()
            piece, text = parts[i]
            token = OutToken(int(tid), piece, kind, lp[0] if lp else None, top, len(text))
            self.made += len(text)
            self.queue.append((self.made, token))

    def waiting(self, chars: int) -> bool:
        return bool(self.queue) and self.queue[0][0] <= self.sent + chars

    def release(self, chars: int, final: bool = False) -> tuple[OutToken, ...]:
        self.sent += chars
        out = []
        while self.queue and self.queue[0][0] <= self.sent:
            out.append(self.queue.popleft()[1])
        if final:
            self.queue.clear()
        return tuple(out)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("flylocal_requests", "Requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("flylocal_generations", "Generations run by the worker.", registry=r)
        self.cancelled = Counter("flylocal_cancelled_generations",
                                 "Generations stopped within a round because their client went away or stopped them.",
                                 registry=r)
        self.tokens = Counter("flylocal_completion_tokens", "Tokens generated (usage.completion_tokens).", registry=r)
        self.drafted = Counter("flylocal_drafted_tokens", "Draft tokens sent to the target.", registry=r)
        self.accepted = Counter("flylocal_accepted_tokens", "Draft tokens committed, loose ones included.",
                                registry=r)
        self.loose = Counter("flylocal_loose_tokens", "Committed draft tokens that did not match natively.",
                             registry=r)
        self.rounds = Counter("flylocal_rounds", "Verification rounds.", registry=r)
        self.mean_accepted = Gauge("flylocal_mean_accepted_length",
                                   "Tokens committed per round, over every request so far.", registry=r)
        self.queue = Gauge("flylocal_queue_depth", "Requests waiting for the model.", registry=r)
        self.slots = Gauge("flylocal_slots", "Generations the server runs at once (--parallel).", registry=r)
        self.busy = Gauge("flylocal_slots_busy", "Jobs running now (generations in slots, or other work).",
                          registry=r)
        self.queue_wait = Histogram("flylocal_queue_wait_seconds", "From a request's arrival to its start.",
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.ttft = Histogram("flylocal_time_to_first_token_seconds", "From a request's arrival to its first text.",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.tps = Histogram("flylocal_tokens_per_second", "Decode tokens/s of a request.",
                             buckets=(5, 10, 25, 50, 100, 150, 200, 300, 500, 1000), registry=r)
        self._emitted = self._rounds = 0

    def observe(self, stats, output_tokens: int, ttft: float | None) -> None:
        self.generations.inc()
        self.tokens.inc(output_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.loose.inc(stats.loose)
        self.rounds.inc(stats.rounds)
        self._emitted += stats.emitted
        self._rounds += stats.rounds
        if self._rounds:
            self.mean_accepted.set(self._emitted / self._rounds)
        if ttft is not None:
            self.ttft.observe(ttft)
        if stats.tokens_per_s > 0:
            self.tps.observe(stats.tokens_per_s)
