"""The server's worker (flylocal/front/serve/worker.py) on the in-memory fake target, without
llama.cpp: random company of generations that fail, are cancelled or are seeded, and calls
(embeddings) a step at a time between rounds. Every surviving request's text is its run alone,
every failure is its own request's, the queue counts right, and the worker answers afterwards;
a failure of the worker itself fails its requests, says so, and stops the server.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import numpy as np
import pytest

pytest.importorskip("prometheus_client", reason="the server extra: pip install -e '.[serve]'")

from fake_backend import FakeLM, FakeSequences, NoisyOracle, fixed_costs, greedy  # noqa: E402
from flylocal.decoding.engine import Engine, EngineConfig  # noqa: E402
from flylocal.decoding.sampling import SamplingParams  # noqa: E402
from flylocal.decoding.verifiers.strict import Strict  # noqa: E402
from flylocal.front.serve.events import Computed, Done, Failed, Text  # noqa: E402
from flylocal.front.serve.worker import Call, Job, Metrics, Refused, Worker  # noqa: E402
from flylocal.settings import Settings  # noqa: E402

LM = FakeLM(seed=5, n_vocab=32, eog=(0,), p_eog=0.04)


class Broken(Exception):
    pass


class Pieces(FakeSequences):
    """FakeSequences with text: token t reads "<t>". `log` records each decode as "round"."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.log: list[str] = []
        self.gate: tuple[int, threading.Event] | None = None    # (decodes, event): the decode after that many waits

    def piece(self, token: int, special: bool = False) -> bytes:
        return f"<{int(token)}>".encode()

    def decode_batch(self, parts):
        if self.gate is not None and self.log.count("round") == self.gate[0]:
            self.gate[1].wait(30)
        self.log.append("round")
        return super().decode_batch(parts)


class Breaking(NoisyOracle):
    """An oracle drafter whose proposal number `at` raises."""

    def __init__(self, at: int, **kw):
        super().__init__(LM, **kw)
        self.at = at

    def propose(self, context, k):
        self.at -= 1
        if self.at < 0:
            raise Broken("the drafter broke")
        return super().propose(context, k)


class Models:
    """What the worker asks of a session's models. A job's settings carry its plan in
    `sampling.seed`: (index, round at which its drafter breaks or -1)."""

    def __init__(self, target: Pieces, plans: dict):
        self.target, self.plans = target, plans

    def engine(self, settings: Settings, private: bool = False, seq: int | None = None) -> Engine:
        index = settings.sampling.seed
        breaks = self.plans[index]
        view = self.target.sequence(seq)
        drafter = (Breaking(breaks, seed=index) if breaks >= 0 else NoisyOracle(LM, seed=index))
        return Engine(view, drafter, Strict(), EngineConfig(max_tokens=settings.max_tokens, k=4, pin_costs=True))

    def reconnect(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class FakeSession:
    def __init__(self, target: Pieces, plans: dict):
        self.target, self.models, self.lock = target, Models(target, plans), threading.Lock()


class Client:
    """A request's side: the events the worker emits for it."""

    def __init__(self):
        self.events: list = []
        self.ended = threading.Event()

    def emit(self, event) -> None:
        self.events.append(event)
        if isinstance(event, (Done, Failed, Computed)):
            self.ended.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Text))


def job_of(i: int, prompt, max_tokens: int) -> tuple[Job, Client]:
    client = Client()
    settings = dataclasses.replace(Settings(), max_tokens=max_tokens, sampling=SamplingParams(seed=i))
    return Job(settings, np.asarray(prompt, dtype=np.int32), [], client.emit), client


def start_worker(n_seq: int, plans: dict, max_queue: int = 64, on_failure=lambda e: None):
    target = Pieces(LM, n_seq, 120, 32, fixed_costs(0.1, rows=32))
    session = FakeSession(target, plans)
    worker = Worker(lambda: session, Metrics(), max_queue, on_failure)
    deadline = time.monotonic() + 10
    while worker.session is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return worker, target


def steps(n: int, value, log: list, broken: int | None = None, budgets: list | None = None):
    """A call's work: primed, then n steps (each logged as "step"), then `value`; step `broken`
    raises. Each step is sent a token budget (None while no generation runs): kept in `budgets`."""
    def work(session):
        budget = yield                   # primed: nothing done yet
        for i in range(n):
            if i == broken:
                raise Broken("the call broke")
            log.append("step")
            if budgets is not None:
                budgets.append(budget)
            if i < n - 1:
                budget = yield
        return value
    return work


def expected_text(prompt, max_tokens: int) -> str:
    tokens, _ = greedy(LM, list(prompt), max_tokens, 120)
    return "".join(f"<{t}>" for t in tokens)


@pytest.mark.parametrize("seed", range(12))
def test_random_company_each_survivor_is_its_run_alone_and_each_failure_its_own(seed):
    rng = random.Random(seed)
    n_seq = rng.randint(1, 4)
    plans, cases = {}, []
    for i in range(rng.randint(4, 14)):
        prompt = [rng.randrange(1, 32) for _ in range(rng.randint(2, 30))]
        plans[i] = rng.randint(0, 6) if rng.random() < 0.3 else -1
        cases.append((i, prompt, rng.randint(1, 30), rng.random() < 0.2, rng.random() < 0.3))
    worker, target = start_worker(n_seq, plans)
    clients = {}
    calls = []
    try:
        for i, prompt, max_tokens, cancel, call in cases:
            job, client = job_of(i, prompt, max_tokens)
            clients[i] = (job, client)
            worker.submit(job)
            if cancel:
                job.cancel.set() if rng.random() < 0.5 else threading.Timer(rng.uniform(0, 0.01), job.cancel.set).start()
            if call:
                c = Client()
                n = rng.randint(1, 6)
                broken = rng.randrange(n) if rng.random() < 0.3 else None
                work = Call(steps(n, ("vectors", i), target.log, broken), c.emit)
                calls.append((work, c, broken))
                worker.submit(work)
            time.sleep(rng.uniform(0, 0.003))
        for job, client in clients.values():
            assert job.cancel.is_set() or client.ended.wait(30), "a request was never answered"
        for work, c, broken in calls:
            assert c.ended.wait(30)
        for i, prompt, max_tokens, cancel, _ in cases:
            job, client = clients[i]
            end = client.events[-1] if client.events else None
            if cancel:                                        # gone: what it got is a beginning of its answer
                assert expected_text(prompt, max_tokens).startswith(client.text)
                continue
            if plans[i] >= 0 and isinstance(end, Failed):
                assert isinstance(end.error, Broken)          # its own failure, nobody else's
                continue
            assert isinstance(end, Done), (i, end)
            assert client.text == expected_text(prompt, max_tokens), f"request {i}"
        for work, c, broken in calls:
            end = c.events[-1]
            if broken is not None:
                assert isinstance(end, Failed) and isinstance(end.error, Broken)
            else:
                assert isinstance(end, Computed) and end.value[0] == "vectors"
        # afterwards: idle, and a new request is answered
        job, client = job_of(99, [3, 4, 5], 5)
        plans[99] = -1
        worker.submit(job)
        assert client.ended.wait(30) and client.text == expected_text([3, 4, 5], 5)
        assert worker.state() == {"slots": n_seq, "slots_busy": 0, "queued": 0}
    finally:
        worker.stop()
        worker.thread.join(10)


def test_a_call_waits_at_most_a_round_and_generations_keep_going():
    """A call of many steps, sent while every slot runs a long generation: its first step comes
    within a round or two of its arrival, and a round of the generations runs between any two of
    its steps."""
    plans = {0: -1, 1: -1}
    worker, target = start_worker(2, plans)
    log = target.log
    go = threading.Event()
    target.gate = (5, go)                # the sixth decode waits until the call is in
    try:
        long = [p for p in ([a, b, 7] for a in range(1, 32) for b in range(1, 32))
                if greedy(LM, p, 100, 120)[1] == "max_tokens"][:2]     # answers that run 100 tokens
        gens = [job_of(i, p, 100) for i, p in enumerate(long)]
        for job, client in gens:
            def emit(event, client=client):
                if isinstance(event, (Done, Failed)):
                    log.append("end")
                client.emit(event)
            job.emit = emit
            worker.submit(job)
        while log.count("round") < 5:
            time.sleep(0.001)
        c = Client()
        at = len(log)
        budgets: list = []
        worker.submit(Call(steps(30, "done", log, budgets=budgets), c.emit))
        go.set()
        assert c.ended.wait(30)
        first = log.index("step", at)
        assert log[at:first].count("round") <= 2
        while not all(client.ended.is_set() for _, client in gens):
            time.sleep(0.01)
        first_end = log.index("end")
        mine = [i for i, what in enumerate(log) if what == "step" and i < first_end]
        rounds_between = [log[a:b].count("round") for a, b in zip(mine, mine[1:])]
        assert len(mine) >= 3 and all(r >= 1 for r in rounds_between), rounds_between
        assert all(b is not None and b >= 1 for b in budgets[: len(mine)])     # bounded while others decode
    finally:
        worker.stop()
        worker.thread.join(10)


def test_a_cancelled_call_stops_before_its_next_step():
    worker, target = start_worker(1, {})
    try:
        c = Client()
        log: list[str] = []

        def slow_work(session):
            yield
            for _ in range(10_000):
                log.append("step")
                time.sleep(0.001)
                yield
            return "done"

        call = Call(slow_work, c.emit)
        worker.submit(call)
        while len(log) < 5:
            time.sleep(0.001)
        call.cancel.set()
        assert c.ended.wait(10)
        assert isinstance(c.events[-1], Failed) and len(log) < 200
        job, client = job_of(0, [4, 5], 3)
        worker.session.models.plans[0] = -1
        worker.submit(job)
        assert client.ended.wait(10) and isinstance(client.events[-1], Done)
    finally:
        worker.stop()
        worker.thread.join(10)


def test_503_only_when_the_free_slots_and_the_queue_are_full():
    """Two slots, no queue: two requests sent before the worker takes either both get in; a
    third waits for nobody's slot and is refused."""
    plans = {i: -1 for i in range(3)}
    worker, _ = start_worker(2, plans, max_queue=0)
    try:
        jobs = [job_of(i, [4, 5, 6], 40) for i in range(3)]
        with worker.ready:                       # the worker cannot take a job meanwhile
            worker.submit(jobs[0][0])
            worker.submit(jobs[1][0])
            with pytest.raises(Refused) as refused:
                worker.submit(jobs[2][0])
        assert refused.value.status == 503
        for _, client in jobs[:2]:
            assert client.ended.wait(30) and isinstance(client.events[-1], Done)
    finally:
        worker.stop()
        worker.thread.join(10)


def test_a_failing_worker_fails_its_requests_says_so_and_stops_the_server():
    """The loop itself failing (here: text that cannot be read) fails every request it holds and
    has queued, refuses new ones, and tells the server to stop."""
    stopped = []
    worker, target = start_worker(2, {0: -1, 1: -1, 2: -1}, on_failure=stopped.append)

    def broken_piece(token, special=False):
        raise RuntimeError("the vocabulary is gone")

    target.piece = broken_piece
    try:
        clients = []
        for i in range(3):
            job, client = job_of(i, [4, 5, 6], 40)
            worker.submit(job)
            clients.append(client)
        for client in clients:
            assert client.ended.wait(10) and isinstance(client.events[-1], Failed)
        worker.thread.join(10)
        assert not worker.thread.is_alive()
        assert stopped and "the worker failed" in str(stopped[0])
        assert worker.failed is not None
        with pytest.raises(Refused) as refused:
            worker.submit(job_of(3, [4], 3)[0])
        assert refused.value.status == 503
    finally:
        worker.stop()


# ----- stop strings inside tokens (Stream) -----

class Words:
    """A vocabulary of pieces of text: token t reads PIECES[t]."""

    PIECES = ["a", "b", "ab", "ba", " ", "an", "na", " B", "ana", "e", "ea", " s", "sea", "."]

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.PIECES[int(token)].encode()


@pytest.mark.parametrize("seed", range(300))
def test_a_stop_string_ends_text_and_tokens_together(seed, monkeypatch):
    """Random answers from pieces of text, random rounds, random stop strings, text sent at once
    or held by the 100 ms rule: the text is cut where the first stop string begins; the tokens
    sent are exactly those up to the one completing it (all of them without a stop), each with
    at most its own characters, their characters summing to the text's length, and Done counts
    them."""
    from types import SimpleNamespace

    from flylocal.decoding.engine import RoundEvent
    from flylocal.decoding.stats import Stats
    from flylocal.front.serve import worker as w
    from flylocal.front.serve.worker import Stream

    rng = random.Random(seed)
    monkeypatch.setattr(w, "SEND_EVERY", rng.choice([0.0, 1000.0]))
    tokens = [rng.randrange(len(Words.PIECES)) for _ in range(rng.randint(1, 25))]
    pieces = [Words.PIECES[t] for t in tokens]
    text = "".join(pieces)
    stops = [rng.choice(["an", "ana", "ea", "ab", "b a", "nan", "zz", "a."]) for _ in range(rng.randint(1, 3))]
    hits = [(text.find(s), len(s)) for s in stops if text.find(s) >= 0]
    if hits:
        at, size = min(hits)
        ends = np.cumsum([len(p) for p in pieces])
        kept = next(i + 1 for i, e in enumerate(ends) if e >= at + size)
        shown = text[:at]
    else:
        kept, shown = len(tokens), text
    events: list = []
    job = Job(Settings(), np.zeros(1, dtype=np.int32), stops, events.append, tokens=True)
    stream = Stream(job, Words(), Metrics())
    i, rounds, stopped = 0, 0, False
    while i < len(tokens) and not stopped:
        n = rng.randint(1, 4)
        chunk = tokens[i:i + n]
        stopped = stream.feed(RoundEvent(rounds, tuple(chunk), ("target",) * len(chunk)))
        i += n
        rounds += 1
    gen = SimpleNamespace(stats=Stats(prompt_tokens=1, stop="eog"), tokens=tokens[:i])
    stream.finish(gen)
    texts = [e for e in events if isinstance(e, Text)]
    sent = [t for e in texts for t in e.tokens]
    assert "".join(e.text for e in texts) == shown
    assert [t.id for t in sent] == tokens[:kept]
    assert sum(t.chars for t in sent) == len(shown)
    assert all(0 <= t.chars <= len(t.text) for t in sent)
    assert events[-1].n_tokens == kept
