"""The generations behind `flylocal serve`: a bounded FIFO queue of jobs, one worker thread that
loads the models and then runs them in one loop (docs/serving.md, "Several requests in one decode"):
up to --parallel generations in shared decodes (a single request is a batch of one), and work
that is not a generation (embeddings) a step at a time between their rounds; stop strings cut
across tokens; the Prometheus metrics.

A job's output goes to its request handler through `emit`, as typed events
(flylocal.front.serve.events): Text events, then Done, or Failed when the job raised. A
request's handler sets the job's cancel flag when its client goes away; the worker reads it
before every round and every step, so its slot is free within one round and the caches stay
consistent. One request's failure is its own: the batch ends that member alone. A failure of
the worker itself fails every request it holds, says so on /health, and stops the server
(`on_failure`): it never stays "ready" while nothing runs.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator

from flylocal.errors import FlylocalError
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
    that could still turn out to be the start of a stop string is held back, nothing more.
    After a hit, `end` is where the stop string ends, in characters of all the text fed."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""
        self.fed = 0               # characters fed so far
        self.end: int | None = None
        self.hit: str | None = None    # the stop string found

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text that may go out now, whether a stop string was found)."""
        base = self.fed - len(self.held)      # where `held + text` begins in all the text fed
        self.fed += len(text)
        text = self.held + text
        self.held = ""
        hits = [(i, len(s), s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, size, self.hit = min(hits)    # the earliest, and the shortest there: the first to end
            self.end = base + at + size
            return text[:at], True
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
    partition: str | None = ""                # whose prompt-cache cells it may reuse (None: no one's)


@dataclass
class Call:
    """A job that is not a generation (embeddings): `work(session)` runs on the worker thread as
    a generator, one step (a decode) at a time between the generations' rounds, and returns
    its value, which goes to `emit` as Computed. It is primed with next() (what it does before
    its first yield), and then each step is sent the tokens it may decode: about what a round's
    prompt chunk takes beside the generations running (Batch.chunk_rows), None when none runs.
    A cancelled call stops before its next step."""
    work: Callable[[Session], Generator[None, None, Any]]
    emit: Callable[[Any], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


class Worker:
    """One thread loads the models, then serves: generations, first come first served, in up
    to `slots` sequences of one Batch (flylocal.decoding.batch), every one advancing in each
    shared decode; calls (embeddings), first come first served, a step between two rounds."""

    def __init__(self, load: Callable[[], Session], metrics: Metrics, max_queue: int,
                 on_failure: Callable[[BaseException], None] = lambda e: None,
                 open_cache: Callable[[Session], Any] = lambda session: None):
        """`open_cache`: the prompt cache of the loaded models (flylocal.front.serve.cache.open_cache),
        or None for one that keeps nothing."""
        self.metrics, self.max_queue = metrics, max_queue
        self.open_cache = open_cache
        self.cache = None                                           # the prompt cache, once loaded (None: none)
        self.seats = None                                           # what seats requests: the cache, or one
                                                                    # that keeps nothing (Batch.place)
        self.session: Session | None = None         # None while the models load
        self.failed: BaseException | None = None    # why loading, or the worker, failed
        self.jobs: collections.deque[Job] = collections.deque()     # generations waiting, oldest first
        self.calls: collections.deque[Call] = collections.deque()   # calls waiting, oldest first
        self.busy = 0                                               # generations in slots
        self.calling = False                                        # a call is running
        self.slots = 1                                              # generations at once, once loaded
        self.ready = threading.Condition()
        self.stopping = False
        self.finish_s = 0.0                                         # seconds of measuring as it stops (`stop`)
        self.on_failure = on_failure
        self._streams: dict = {}                                    # the running generations' streams
        self._call: Call | None = None                              # the running call
        self.started = threading.Event()            # set once loading has ended, loaded or failed
        self.thread = threading.Thread(target=self._run, args=(load,), name="flylocal-worker", daemon=True)
        self.thread.start()

    # ----- what the request handlers see -----
    def submit(self, job: Job | Call) -> None:
        """Queue a job, or Refused: 503 when the worker failed, or when the slots and the queue
        (--max-queue waiting beyond the free slots) are both full."""
        with self.ready:
            if self.failed is not None:
                raise Refused(503, f"the server stopped: {self.failed}", "server_failed")
            self._drop_cancelled()
            if isinstance(job, Call):
                waiting = len(self.calls) - (not self.calling)          # a call that runs next waits for nothing
                queue = self.calls
            else:
                waiting = len(self.jobs) - max(self.slots - self.busy, 0)   # those a free slot takes are not waiting
                queue = self.jobs
            if waiting >= self.max_queue:
                raise Refused(503, f"the server is busy: {max(waiting, 0)} requests are waiting (--max-queue)",
                              "queue_full", {"Retry-After": "1"})
            queue.append(job)
            self._queued()
            self.ready.notify()

    def state(self) -> dict:
        """Slots, the busy ones and the requests waiting (/health, /api/ps)."""
        with self.ready:
            return {"slots": self.slots, "slots_busy": min(self.busy, self.slots),
                    "queued": len(self.jobs) + len(self.calls)}

    def stop(self, finish_s: float = 0.0) -> None:
        """End once the jobs held have ended; with `finish_s`, a slice of at most that many
        seconds of the cost curves' measuring first (a model unloading: a reload finds them
        cached), none when the server stops."""
        with self.ready:
            self.finish_s = finish_s
            self.stopping = True
            self.ready.notify()

    # ----- the thread -----
    def _run(self, load) -> None:
        try:
            self._serve_loaded(load)
        finally:
            self.started.set()

    def _serve_loaded(self, load) -> None:
        try:
            session = load()
        except BaseException as e:  # noqa: BLE001 - the server reports it and exits
            self.failed = e
            self.on_failure(e)
            return
        if session is None:          # nothing was loaded (a loader that gave up): nothing to run
            return
        self.slots = session.target.n_seq
        self.metrics.slots.set(self.slots)
        try:
            self.cache = self.open_cache(session)
        except BaseException as e:  # noqa: BLE001 - a disk tier that cannot be opened: said, and the server stops
            session.models.close()
            self.failed = e
            self.on_failure(e)
            return
        if self.cache is not None and not self.cache.keeps:
            self.seats, self.cache = self.cache, None              # it seats requests, and keeps nothing
        else:
            self.seats = self.cache
        self.metrics.watch(self.cache)
        self.session = session
        self.started.set()
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a failure of the loop itself: said, and the server stops
            self._die(e)
        finally:
            with self.session.lock:  # the slots kept on disk, and the refined cost curves saved, as the models close
                try:
                    if self.failed is None and self.finish_s:     # a model unloading: its curves, whole
                        self.session.models.finish_costs(self.finish_s)
                    if self.cache is not None:
                        self.metrics.unwatch(self.cache)
                        self.cache.close(self.slots)
                finally:
                    self.session.models.close()

    def _drop_cancelled(self) -> None:
        """Jobs whose clients went away while they waited leave the queue (their handlers hear so)."""
        for queue in (self.jobs, self.calls):
            if any(j.cancel.is_set() for j in queue):
                gone = [j for j in queue if j.cancel.is_set()]
                kept = [j for j in queue if not j.cancel.is_set()]
                queue.clear()
                queue.extend(kept)
                for j in gone:
                    j.emit(Failed(FlylocalError("the request was cancelled before it started")))

    def _queued(self) -> None:
        self.metrics.queue.set(len(self.jobs) + len(self.calls))

    def _take(self, streams: dict, call) -> tuple[list[Job], Call | None] | None:
        """The jobs to start now: generations for the free slots, and the next call when none
        runs (waiting for work when there is none); None when stopping with nothing left."""
        with self.ready:
            while True:
                self._drop_cancelled()
                if streams or call is not None or self.jobs or self.calls:
                    break
                if self.stopping:
                    return None
                self.ready.wait()
            new = []
            while self.jobs and self.busy < self.slots:
                job = self.jobs.popleft()
                self.metrics.queue_wait.observe(time.perf_counter() - job.queued_at)
                self.busy += 1
                new.append(job)
            if call is None and self.calls:
                call = self.calls.popleft()
                self.metrics.queue_wait.observe(time.perf_counter() - call.queued_at)
                self.calling = True
            self._queued()
            self.metrics.busy.set(self.busy + self.calling)
            return new, call

    def _free(self, slots: int = 0, call: bool = False) -> None:
        with self.ready:
            self.busy -= slots
            if call:
                self.calling = False
            self.metrics.busy.set(self.busy + self.calling)

    def _serve(self) -> None:
        """The loop: start the jobs that can start, a step of the running call, a round of the
        generations; until stopped with nothing left."""
        from flylocal.decoding.batch import Batch

        session = self.session
        batch = Batch(session.target, cache=self.seats)
        streams = self._streams                   # Generation -> its Stream
        running: tuple[Call, Generator] | None = None
        while (taken := self._take(streams, running[0] if running else None)) is not None:
            new, call = taken
            self._call = call
            for job in new:
                try:
                    with session.lock:
                        gen = self._join(batch, job)
                except Exception as e:  # noqa: BLE001 - a request no engine can run: its own failure
                    job.emit(Failed(e))
                    self._free(slots=1)
                    continue
                streams[gen] = Stream(job, session.target, self.metrics)
            if call is not None:
                running = self._step(call, running, batch.chunk_rows(len(streams)) if streams else None)
            if streams:
                self._round(batch, streams)

    def _step(self, call: Call, running, budget: int | None):
        """One step of `call`, of at most `budget` tokens (started and primed on its first);
        None once it has ended."""
        try:
            if call.cancel.is_set():
                raise FlylocalError("the request was cancelled")
            with self.session.lock:
                if running is None:
                    steps = call.work(self.session)
                    next(steps)
                else:
                    steps = running[1]
                steps.send(budget)
            return call, steps
        except StopIteration as done:
            call.emit(Computed(done.value))
        except Exception as e:  # noqa: BLE001 - reported to its request; the server goes on
            if running is not None:
                running[1].close()
            call.emit(Failed(e))
        self._free(call=True)
        return None

    def _round(self, batch, streams: dict) -> None:
        """A round of every generation: its events to its stream; the ended ones finished."""
        for gen, stream in list(streams.items()):          # clients that went away
            if stream.job.cancel.is_set():
                batch.leave(gen)
        with self.session.lock:
            events = batch.round()
        for gen, event in events:
            stream = streams.get(gen)
            if stream is None:
                continue
            if isinstance(event, BaseException):            # the member failed, alone
                del streams[gen]
                stream.job.emit(Failed(event))
                self._free(slots=1)
            elif stream.feed(event):                        # a stop string, or its client went away
                batch.leave(gen)
        for gen, stream in list(streams.items()):
            if gen.stats.stop:
                del streams[gen]
                if self.cache is not None:
                    self.cache.prefilled(gen.stats.prompt_evaluated, gen.stats.prefill_s)
                try:
                    stream.finish(gen)
                finally:
                    self._free(slots=1)

    def _die(self, e: BaseException) -> None:
        """The loop itself failed: every request it holds or has queued fails, /health says so,
        and the server stops (on_failure)."""
        failure = FlylocalError(f"the worker failed ({type(e).__name__}: {e})" if str(e) else
                                f"the worker failed ({type(e).__name__})")
        with self.ready:
            self.failed = failure
            waiting = list(self.jobs) + list(self.calls)
            self.jobs.clear()
            self.calls.clear()
        held = [stream.job for stream in self._streams.values()] + ([self._call] if self._call is not None else [])
        for job in held + waiting:
            job.emit(Failed(failure))
        self.on_failure(failure)

    def _join(self, batch, job: Job):
        """`job`'s generation, started in a free sequence of `batch` (FlylocalError for a request
        no engine can run)."""
        session = self.session
        session.models.reconnect()       # a model whose rpc servers were lost: once they answer again
        seq = batch.place(job.ids, job.partition)
        if seq is None:                  # (the worker takes no more generations than it has slots)
            raise FlylocalError("no free slot for the request")
        grammar = None
        if job.grammar is not None:      # the vocabulary is read once per model, on the first
            from flylocal.decoding.grammar import Grammar

            grammar = Grammar(session.target, job.grammar[1], job.grammar[0])
        engine = session.models.engine(job.settings, private=True, seq=seq)
        return batch.join(seq, engine, job.ids, grammar=grammar)


class Stream:
    """A generation's events to its request: text in pieces (at once at first, then at most every
    SEND_EVERY seconds), cut at stop strings, tokens aligned with their text; then Done.

    A stop string ends the answer (docs/serving.md, "Server"): its text is cut where the stop
    string begins, and its tokens end with the one that completes the stop string (the token
    boundary at or after its end, where llama-server stops too): usage, logprobs, the streamed
    `chars` and Ollama's `context` count exactly those, and the last one's characters are the
    ones the text shows."""

    def __init__(self, job: Job, target, metrics: Metrics):
        self.job, self.target, self.metrics = job, target, metrics
        self.text = TextStream(target)
        self.stops = StopStrings(job.stops)
        self.tokens = Aligned() if job.tokens else None
        self.ends: list[int] = []        # per output token so far: the characters of text through it
        self.kept: int | None = None     # after a stop string: the answer's tokens
        self.stopped, self.first, self.sent, self.pending, self.shown = False, None, 0.0, "", 0

    def feed(self, event) -> bool:
        """A round's event; True when the generation should stop here (a stop string, or the
        client went away)."""
        tokens = self.tokens
        parts = self.text.each(event.tokens)        # each token's own characters
        made = self.ends[-1] if self.ends else 0
        for _, text in parts:
            made += len(text)
            self.ends.append(made)
        if tokens is not None:
            tokens.add(self.target, event, parts)
        piece, self.stopped = self.stops.feed("".join(p for _, p in parts))
        self.pending += piece
        if self.stopped:
            self._cut()
        now = time.perf_counter()
        # Text goes out at once at first, then at most every SEND_EVERY seconds: each send
        # wakes the event loop, which on a small machine takes a core from llama.cpp, and
        # is an event for the client to read (a browser on the same cores: design.md).
        if self.pending and (self.first is None or now - self.sent >= SEND_EVERY):
            self._send(final=False)
            self.pending, self.sent = "", now
        return self.stopped or self.job.cancel.is_set()

    def _cut(self) -> None:
        """A stop string was found: the answer's tokens end with the one that completes it."""
        end = self.stops.end
        self.kept = next((i + 1 for i, e in enumerate(self.ends) if e >= end), len(self.ends))
        if self.tokens is not None:
            self.tokens.cut(self.kept, self.shown + len(self.pending))

    def _send(self, final: bool) -> None:
        tokens = self.tokens
        self.first = self.first or time.perf_counter()
        self.shown += len(self.pending)
        self.job.emit(Text(self.pending, tokens.release(len(self.pending), final=final) if tokens else ()))

    def finish(self, gen) -> None:
        """The generation ended: what text is left, then Done with its stats."""
        job, tokens = self.job, self.tokens
        if not self.stopped and not job.cancel.is_set():
            piece, _ = self.stops.feed("", final=True)      # text held as a possible stop string (none is one)
            self.pending += piece
        if self.pending or (tokens is not None and tokens.waiting(len(self.pending))):
            self._send(final=True)
            self.pending = ""
        stats = gen.stats
        reason = "stop_string" if self.stopped else stats.stop
        if job.cancel.is_set() and reason == "interrupted":
            self.metrics.cancelled.inc()
        n_tokens = self.kept if self.kept is not None else len(gen.tokens)
        self.metrics.observe(stats, n_tokens, self.first - job.queued_at if self.first is not None else None)
        job.emit(Done(reason, stats, n_tokens, stop=self.stops.hit if self.stopped else None))


class Aligned:
    """Output tokens, released as the text they make goes out: a token goes with the text piece
    that completes it; after a stop string (`cut`), the tokens up to the one completing it, the
    last of them with the characters the text shows."""

    def __init__(self):
        self.queue: collections.deque[tuple[int, OutToken]] = collections.deque()   # (end in chars, token)
        self.made = 0          # characters of text the tokens so far have made
        self.sent = 0          # characters released
        self.ended = 0         # where the last token released ends, in characters
        self.count = 0         # tokens added

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
        self.count += len(event.tokens)

    def cut(self, kept: int, shown: int) -> None:
        """Only the first `kept` tokens of the answer stay; the text ends at `shown` characters:
        each token's characters are then those of the text that it ends, at most."""
        drop = self.count - kept
        for _ in range(min(drop, len(self.queue))):
            self.queue.pop()
        self.count = kept
        start = self.ended
        out = collections.deque()
        for end, token in self.queue:
            end = min(end, shown)
            out.append((end, replace(token, chars=max(end - start, 0))))
            start = max(start, end)
        self.queue = out
        self.made = shown

    def waiting(self, chars: int) -> bool:
        return bool(self.queue) and self.queue[0][0] <= self.sent + chars

    def release(self, chars: int, final: bool = False) -> tuple[OutToken, ...]:
        self.sent += chars
        out = []
        while self.queue and (final or self.queue[0][0] <= self.sent):
            self.ended, token = self.queue.popleft()
            out.append(token)
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
        self.cache_figures = CacheFigures()
        r.register(self.cache_figures)

    def watch(self, cache) -> None:
        """The prompt cache's figures (PromptCache.report), read at each scrape: of every loaded
        model's cache, summed."""
        if cache is not None:
            self.cache_figures.caches.append(cache)

    def unwatch(self, cache) -> None:
        if cache in self.cache_figures.caches:
            self.cache_figures.caches.remove(cache)

    def observe(self, stats, output_tokens: int, ttft: float | None) -> None:
        self.generations.inc()
        self.tokens.inc(output_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.loose.inc(stats.loose)
        self.rounds.inc(stats.rounds)
        self._emitted += stats.emitted_in_rounds
        self._rounds += stats.rounds
        if self._rounds:
            self.mean_accepted.set(self._emitted / self._rounds)
        if ttft is not None:
            self.ttft.observe(ttft)
        if stats.tokens_per_s > 0:
            self.tps.observe(stats.tokens_per_s)


class CacheFigures:
    """The prompt caches' figures as Prometheus metrics, summed (a collector: read when scraped;
    nothing without a cache)."""

    GAUGES = {"entries": "Prompt cache entries in memory.", "bytes": "Bytes the prompt cache's entries in memory hold.",
              "limit_bytes": "The prompt cache's bound in memory (--cache-ram).",
              "disk_entries": "Prompt cache entries on disk (--prompt-cache).",
              "disk_bytes": "Bytes of the prompt cache's entries on disk."}
    COUNTERS = {"hits": "Requests that took a prompt cache entry.",
                "restored_tokens": "Prompt tokens restored from the prompt cache instead of evaluated.",
                "prefill_seconds_saved": "Prefill seconds the prompt cache saved, at the measured prefill rate.",
                "evicted": "Prompt cache entries evicted from memory for room."}

    def __init__(self):
        self.caches: list = []

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not self.caches:
            return
        reports = [c.report() for c in list(self.caches)]
        report = {name: sum(r[name] for r in reports) for name in (*self.GAUGES, *self.COUNTERS)}
        for name, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"flylocal_prompt_cache_{name}", doc, value=report[name])
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"flylocal_prompt_cache_{name}", doc, value=report[name])
