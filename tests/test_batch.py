"""Several requests in one decode (flylocal/decoding/batch.py, docs/serving.md "Several requests
in one decode"), on the in-memory fake target: random requests arriving at random rounds, with random
lengths, drafters, verifiers and cancellations, share decodes; each one's output must be what
it gives alone. Strict is compared with plain greedy decoding; FLy and ASD, whose output
follows the drafts, with a run alone that verifies the same drafts the shared run verified.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fake_backend import FakeLM, FakeSequences, FakeTarget, Machine, fixed_costs, greedy
from flylocal.decoding.contracts import equal_split
from flylocal.decoding.costs import CostCurve
from flylocal.decoding.batch import FRESH_LAYOUTS, Batch, allot, split_cost, weigh_layouts
from flylocal.decoding.contracts import NO_DRAFT, Draft, Drafter
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from test_engine_properties import LMS, make_drafter, make_verifier, random_case

N_BATCHES = 150


class Recording(Drafter):
    """A drafter that keeps, round by round, the draft the target verified (`observe`)."""

    def __init__(self, inner: Drafter):
        self.inner, self.name, self.drafts = inner, inner.name, []

    def propose(self, context, k):
        return self.inner.propose(context, k)

    def observe(self, draft, accepted):
        self.drafts.append(draft.tokens.copy())
        self.inner.observe(draft, accepted)

    def reach(self, draft):
        return self.inner.reach(draft)

    def share(self, shared):
        self.inner.share(shared)

    def begin(self, budget=None):
        self.inner.begin(budget)

    def end(self, output):
        self.inner.end(output)

    def controllers(self):
        return self.inner.controllers()


class Replay(Drafter):
    """Proposes recorded drafts, one per round."""

    name = "replay"

    def __init__(self, drafts):
        self.drafts, self.i = drafts, 0

    def propose(self, context, k):
        d = self.drafts[self.i] if self.i < len(self.drafts) else NO_DRAFT.tokens
        return Draft(np.asarray(d[:k], dtype=np.int32))

    def observe(self, draft, accepted):
        self.i += 1


class Broken(Exception):
    """What a member made to fail raises."""


class FailingDrafter(Recording):
    """A Recording drafter whose proposal number `at` raises (its drafter breaking mid-request)."""

    def __init__(self, inner: Drafter, at: int):
        super().__init__(inner)
        self.at, self.calls = at, 0

    def propose(self, context, k):
        self.calls += 1
        if self.calls > self.at:
            raise Broken("the drafter broke")
        return super().propose(context, k)


class AnyGrammar:
    """A grammar that allows every token and forces none, whose constraint raises at its
    restriction number `at` (a grammar failing mid-request, as a self-referencing schema does)."""

    def __init__(self, at: int):
        self.at = at

    def start(self):
        return self

    def forced(self, limit):
        return np.zeros(0, dtype=np.int32)

    def allowed(self, draft):
        return len(draft)

    def restrict(self, logits, draft):
        self.at -= 1
        if self.at < 0:
            raise Broken("the grammar failed")

    def commit(self, tokens):
        pass

    def truncate(self, n):
        pass


FAULTS = ("drafter", "grammar", "decode")


def run_batch(seed: int, n_seq: int | None = None, p_fault: float = 0.0):
    """One random batch: [(Generation, case, Recording drafter, cancelled, fault)] of its
    requests, and the target. With `p_fault`, that share of the requests fail at a random
    round: their drafter, their grammar or their part of a decode (`FakeSequences.faulty`);
    `fault` says which (None: none). Every failure must come back as that request's event, its
    sequence cleared, and no other request may fail."""
    rng = np.random.default_rng(10_000 + seed)
    lm_index = int(rng.integers(len(LMS)))
    lm = LMS[lm_index]
    n_seq = n_seq or int(rng.integers(1, 5))
    n_ctx = int(rng.integers(30, 70))
    n_batch = int(rng.integers(24, 64))
    row_cost = float(rng.choice([0.02, 0.1, 0.4]))
    machine = Machine(row_cost=row_cost)
    target = FakeSequences(lm, n_seq, n_ctx, n_batch, fixed_costs(row_cost, rows=n_batch), machine)
    batch = Batch(target, clock=machine)
    requests = []
    for i in range(int(rng.integers(1, 9))):
        case = random_case(seed * 100 + i, lms=[lm_index], room=(1, 40))
        case = replace(case, n_ctx=n_ctx, k=min(case.k, n_batch - 1), prompt=case.prompt[: n_ctx - 1])
        arrive = int(rng.integers(0, 30))
        cancel = int(rng.integers(1, 20)) if rng.random() < 0.2 else None
        fault = (str(rng.choice(FAULTS)), int(rng.integers(0, 8))) if rng.random() < p_fault else None
        seeded = bool(rng.random() < 0.25)
        requests.append((arrive, cancel, fault, seeded, case))
    requests.sort(key=lambda x: x[0])
    waiting = list(requests)
    running = {}            # gen -> [case, cancel round, recording, rounds seen, fault, seq]
    done = []
    now = 0
    while waiting or batch.members:
        while waiting and waiting[0][0] <= now:
            seq = batch.place(np.asarray(waiting[0][-1].prompt))
            if seq is None:
                break
            _, cancel, fault, seeded, case = waiting.pop(0)
            view = target.sequence(seq)
            drafter = make_drafter(case, view)
            rec = FailingDrafter(drafter, fault[1]) if fault and fault[0] == "drafter" else Recording(drafter)
            grammar = AnyGrammar(fault[1]) if fault and fault[0] == "grammar" else None
            engine = Engine(view, rec, make_verifier(case),
                            EngineConfig(max_tokens=case.max_tokens, k=case.k, pin_costs=seeded), clock=machine)
            gen = batch.join(seq, engine, np.asarray(case.prompt, dtype=np.int32), grammar=grammar)
            running[gen] = [case, cancel, rec, 0, fault, seq]
        if not batch.members:
            now = waiting[0][0] if waiting else now + 1
            continue
        for gen, entry in running.items():              # a member whose decode is to fail
            fault, rounds, seq = entry[4], entry[3], entry[5]
            if fault and fault[0] == "decode" and rounds >= fault[1] and not gen.stats.stop:
                target.faulty.add(seq)
        for gen, event in batch.round():
            entry = running[gen]
            if isinstance(event, Exception):
                fault, seq = entry[4], entry[5]
                assert fault is not None, f"batch seed {seed}: {entry[0]} failed without a fault: {event!r}"
                assert gen.stats.stop == "error" and gen not in [m.gen for m in batch.members.values()]
                assert not len(target.cached(seq)), "a failed member's sequence is cleared"
                target.faulty.discard(seq)
                entry.append(event)
            else:
                entry[3] += 1
        for gen, entry in list(running.items()):
            case, cancel, rec, rounds, fault = entry[:5]
            if cancel is not None and rounds >= cancel and not gen.stats.stop:
                batch.leave(gen)
            if gen.stats.stop:
                if gen.stats.stop == "error":
                    assert len(entry) == 7, f"batch seed {seed}: a member ended in error with no event for it"
                done.append((gen, case, rec, cancel is not None and gen.stats.stop == "interrupted", fault))
                del running[gen]
        now += 1
    return done, target


def alone(case, rec):
    """What the request of `case` gives alone: plain greedy decoding for strict; for a loose
    verifier, whose output follows its drafts, the drafts it was verified on, replayed."""
    lm = LMS[case.lm]
    if case.verifier == "strict":
        return greedy(lm, case.prompt, case.max_tokens, case.n_ctx)
    target = FakeTarget(lm, case.n_ctx, costs=fixed_costs(case.row_cost))
    engine = Engine(target, Replay(rec.drafts), make_verifier(case), EngineConfig(max_tokens=case.max_tokens, k=case.k))
    expected, stats, _ = generate_all(engine, np.asarray(case.prompt, dtype=np.int32))
    return expected, stats.stop


@pytest.mark.parametrize("chunk", range(3))
def test_each_request_equals_its_run_alone(chunk):
    for seed in range(chunk, N_BATCHES, 3):
        done, target = run_batch(seed)
        for gen, case, rec, cancelled, _ in done:
            where = f"batch seed {seed}: {case}"
            expected, stop = alone(case, rec)
            if cancelled:
                assert gen.tokens == expected[: len(gen.tokens)], where
            else:
                assert gen.tokens == expected, where
                assert gen.stats.stop == stop, where


@pytest.mark.parametrize("chunk", range(3))
def test_a_members_failure_is_its_own(chunk):
    """A third of the requests fail at a random round (their drafter, their grammar, their part
    of the decode): each failure comes back as its own request's event, its sequence cleared,
    and every other request's output is its run alone, as if nothing had failed."""
    failed = 0
    for seed in range(chunk, N_BATCHES, 3):
        done, target = run_batch(seed, p_fault=0.35)
        for gen, case, rec, cancelled, fault in done:
            where = f"batch seed {seed}: {case}"
            if gen.stats.stop == "error":
                failed += 1
                continue
            expected, stop = alone(case, rec)
            if cancelled or fault:        # a fault past its request's end never struck
                assert gen.tokens == expected[: len(gen.tokens)], where
            else:
                assert gen.tokens == expected, where
                assert gen.stats.stop == stop, where
    assert failed > 10


def test_rounds_share_decodes_and_every_member_advances():
    """Four requests together: every decode carries each member that is past its prompt, and
    there are fewer decodes than rounds (the point of sharing)."""
    lm = FakeLM(seed=7, n_vocab=32, eog=(), p_eog=0.0)
    target = FakeSequences(lm, 4, 80, 64, fixed_costs(0.02, rows=64))
    batch = Batch(target)
    gens = []
    for i in range(4):
        seq = batch.place(np.arange(3) + i)
        engine = Engine(target.sequence(seq), make_drafter_none(), make_verifier_strict(), EngineConfig(max_tokens=20))
        gens.append(batch.join(seq, engine, np.arange(3, dtype=np.int32) + i))
    rounds = 0
    while batch.members:
        members = len(batch.members)
        events = batch.round()
        assert len(events) == members        # nobody waits for anybody
        rounds += len(events)
    assert all(len(g.tokens) == 20 for g in gens)
    assert target.decodes == 20 and rounds == 80
    for g, i in zip(gens, range(4)):
        assert g.tokens == greedy(lm, list(np.arange(3) + i), 20, 80)[0]


def test_a_shared_decode_leaves_the_cost_curve_alone():
    """The curve is one sequence's rounds, timed with their host work, against single steps
    timed the same way. A shared decode is several sequences' rows timed bare; taken into the
    curve it priced 8 rows at 2.9 single steps where 7 cost 4.5, and drafts in company went in
    at a quarter of their cost. `uneven` weighs shared decodes against the curve instead."""
    lm = FakeLM(seed=7, n_vocab=32, eog=(), p_eog=0.0)
    curve = CostCurve()
    curve.calibrate(lambda rows: 0.01 * (1 + 0.5 * (rows - 1)), max_rows=9)
    target = FakeSequences(lm, 4, 80, 64, curve)
    batch = Batch(target)
    for i in range(4):
        seq = batch.place(np.arange(3) + i)
        engine = Engine(target.sequence(seq), make_drafter_none(), make_verifier_strict(), EngineConfig(max_tokens=12))
        batch.join(seq, engine, np.arange(3, dtype=np.int32) + i)
    while batch.members:
        batch.round()
    assert target.decodes == 12
    assert curve.decoded_s == 0 and not curve.samples and not curve.anchors
    assert len(batch._one) == 12                  # each decode weighed against it instead


def make_drafter_none():
    from flylocal.decoding.drafters import NoDraft

    return NoDraft()


def make_verifier_strict():
    from flylocal.decoding.verifiers.strict import Strict

    return Strict()


def test_a_long_prompt_goes_in_chunks_beside_the_others():
    """A newcomer with a long prompt: the decoding member advances every round meanwhile, and
    the prompt goes in pieces no larger than a round's share for prompts."""
    lm = FakeLM(seed=8, n_vocab=32, eog=(), p_eog=0.0)
    target = FakeSequences(lm, 2, 400, 64, fixed_costs(0.1, rows=64))
    batch = Batch(target)
    first = batch.join(0, Engine(target.sequence(0), make_drafter_none(), make_verifier_strict(),
                                 EngineConfig(max_tokens=60)), np.arange(4, dtype=np.int32))
    batch.round()
    prompt = (np.arange(300) % 31).astype(np.int32)
    second = batch.join(1, Engine(target.sequence(1), make_drafter_none(), make_verifier_strict(),
                                  EngineConfig(max_tokens=5)), prompt)
    before = len(first.tokens)
    rounds = 0
    while not second.tokens:
        batch.round()
        rounds += 1
        chunk = dict(target.parts[-1]).get(1, 0)
        assert chunk <= batch.chunk_rows(1) + 1
    assert len(first.tokens) - before == rounds          # one token a round meanwhile
    assert rounds > 1                                    # the prompt went in pieces
    assert second.tokens[:1] == greedy(lm, prompt.tolist(), 1, 400)[0]


def test_equal_split_follows_llama_cpp():
    # measured shapes (docs/serving.md, "Several requests in one decode"): a run of neighbouring
    # sequences, as many tokens each as the fewest
    assert equal_split({0: 1, 1: 1, 2: 1, 3: 1}) == [4]
    assert equal_split({0: 5, 1: 1, 2: 1, 3: 1}) == [4, 4]
    assert equal_split({0: 8, 1: 2, 2: 1, 3: 1}) == [4, 2, 6]
    assert equal_split({0: 1, 2: 1}) == [1, 1]
    assert equal_split({0: 1, 1: 1, 3: 1}) == [2, 1]


def test_allot_pays_for_rows_only_where_they_give_more_than_they_cost():
    target = FakeSequences(FakeLM(seed=1), 4, 64, 64)
    flat = 1 + 0.02 * np.arange(64)          # GPU-like: rows nearly free
    steep = 1 + 0.9 * np.arange(64)          # every row nearly a step
    sure = {s: np.full(6, 0.95) ** np.arange(1, 7) for s in range(4)}
    fixed = {s: 1 for s in range(4)}
    assert allot(target, flat, fixed, sure, 64) == {s: 6 for s in range(4)}
    assert allot(target, steep, fixed, sure, 64) == {s: 0 for s in range(4)}
    # a good draft beside a hopeless one: the good one gets its rows; the hopeless one too where
    # rows are nearly free, since uneven rows run as two computations (equal_split), and not
    # where rows are dear
    mixed = {0: np.full(6, 0.99) ** np.arange(1, 7), 1: np.full(6, 0.01) ** np.arange(1, 7)}
    assert allot(target, flat, {0: 1, 1: 1}, mixed, 64) == {0: 6, 1: 6}
    n = allot(target, 1 + 0.3 * np.arange(64), {0: 1, 1: 1}, mixed, 64)
    assert n[0] >= 3 and n[1] == 0
    # the limit holds
    n = allot(target, flat, fixed, sure, 12)
    assert sum(n.values()) + 4 <= 12
    # the objective: no other choice of rows does better (brute force on two members)
    two = {0: np.array([0.9, 0.7, 0.4]), 1: np.array([0.8, 0.3])}
    curve = 1 + 0.3 * np.arange(64)
    best = allot(target, curve, {0: 1, 1: 1}, two, 64)

    def rate(a, b, others=0):
        e = 2 + others + two[0][:a].sum() + two[1][:b].sum()
        rows = {0: 1 + a, 1: 1 + b} | {s: 1 for s in range(2, 2 + others)}
        return e / split_cost(curve, equal_split(rows))
    assert rate(best[0], best[1]) >= max(rate(a, b) for a in range(4) for b in range(3)) - 1e-12
    # the same two beside two members with no draft: their tokens count in the decode's rate too
    best = allot(target, curve, {0: 1, 1: 1, 2: 1, 3: 1}, two, 64)
    assert rate(best[0], best[1], 2) >= max(rate(a, b, 2) for a in range(4) for b in range(3)) - 1e-12


def test_a_draft_row_must_pay_at_the_rate_of_the_whole_decode():
    """Eight members, two with middling drafts, on a CPU-like curve where a separate computation
    for their extra rows costs more than they give: no rows. Counting only the drafting members'
    tokens against the whole decode's cost (as the allotment once did) gave them rows."""
    target = FakeSequences(FakeLM(seed=1), 8, 64, 64)
    curve = 1 + 0.4 * np.arange(64)
    fixed = {s: 1 for s in range(8)}
    drafts = {0: np.array([0.7, 0.5, 0.35, 0.25]), 3: np.array([0.6, 0.4])}
    assert allot(target, curve, fixed, drafts, 64) == {0: 0, 3: 0}
    # alone, the same drafts pay: one member's single row is a dear decode to begin with
    assert allot(target, curve, {0: 1}, {0: drafts[0]}, 64)[0] > 0


def test_a_seeded_request_drafts_as_alone_whatever_else_runs():
    """A seeded request (pinned costs) keeps its own drafter's drafts in a shared decode, so a loose
    verifier's output, which follows the drafts, is its output alone."""
    from fake_backend import NoisyOracle, controlled
    from flylocal.decoding.verifiers.fly import Fly, FlyParams

    lm = LMS[0]
    checked = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        target = FakeSequences(lm, 3, 80, 64, fixed_costs(0.4, rows=64))
        batch = Batch(target)
        prompts = [rng.integers(lm.n_vocab, size=int(rng.integers(2, 12))).astype(np.int32) for _ in range(3)]
        config = EngineConfig(max_tokens=30, k=6, pin_costs=True)

        def engine(view, i):
            return Engine(view, controlled(NoisyOracle(lm, seed=seed * 10 + i), 6, view),
                          Fly(FlyParams(entropy=0.6, window=2)), config)

        gens = [batch.join(i, engine(target.sequence(i), i), p) for i, p in enumerate(prompts)]
        while batch.members:
            batch.round()
        for i, (gen, p) in enumerate(zip(gens, prompts)):
            alone = FakeTarget(lm, 80, 64, fixed_costs(0.4, rows=64))
            expected, _, _ = generate_all(engine(alone, i), p)
            assert gen.tokens == expected, f"seed {seed}, request {i}"
            checked += gen.stats.drafted > 0
    assert checked > 10


class Counting(Recording):
    """A Recording drafter that also keeps the length of each proposal it made."""

    def __init__(self, inner):
        super().__init__(inner)
        self.proposed = []

    def propose(self, context, k):
        draft = super().propose(context, k)
        self.proposed.append(len(draft.tokens))
        return draft


@pytest.mark.parametrize("n_seq,k", [(1, 63), (2, 31), (4, 15)])
def test_drafts_of_a_given_length_as_long_as_a_slot_holds_get_in_and_stay_whole(n_seq, k):
    """Drafts of a given length (verified whole) of k + 1 = n_batch / n_seq rows, every slot
    busy, prompts longer than what is left of a decode: every request gets in (none waits for
    ever for a share the others' drafts never leave), each equals plain greedy decoding, and
    no draft is ever cut."""
    from fake_backend import NoisyOracle

    lm = FakeLM(seed=9, n_vocab=32, eog=(), p_eog=0.0)
    target = FakeSequences(lm, n_seq, 300, 64, fixed_costs(0.1, rows=64))
    batch = Batch(target)
    rng = np.random.default_rng(n_seq)
    prompts = [rng.integers(32, size=60).astype(np.int32) for _ in range(2 * n_seq)]
    waiting, gens = list(prompts), []
    rounds = 0
    while (waiting or batch.members) and rounds < 400:
        while waiting and batch.free():
            p = waiting.pop(0)
            seq = batch.place(p)
            drafter = Counting(NoisyOracle(lm, seed=len(gens), p_corrupt=0.3, p_eog=0.0, p_short=0.0))
            engine = Engine(target.sequence(seq), drafter, make_verifier_strict(), EngineConfig(max_tokens=40, k=k))
            gens.append((batch.join(seq, engine, p), p, drafter))
        batch.round()
        rounds += 1
    assert not waiting and not batch.members, f"requests still waiting after {rounds} rounds"
    for gen, p, drafter in gens:
        assert gen.tokens == greedy(lm, p.tolist(), 40, 300)[0]
        assert [len(d) for d in drafter.drafts if len(d)] == [n for n in drafter.proposed if n]


@pytest.mark.parametrize("seed", range(6))
def test_a_request_alone_in_a_batch_drafts_as_outside_one(seed):
    """A batch of one (the server's every request when it has no company) proposes, verifies
    and accounts every round as the engine's own loop does: the same drafts under draft-length
    control, the same rounds, the same output."""
    from fake_backend import NoisyOracle, controlled

    lm = LMS[0]
    rng = np.random.default_rng(seed)
    prompt = rng.integers(lm.n_vocab, size=8).astype(np.int32)

    def run(target, view, machine, step):
        drafter = Recording(controlled(NoisyOracle(lm, seed=seed), 6, view))
        engine = Engine(view, drafter, make_verifier_strict(), EngineConfig(max_tokens=40, k=6), clock=machine)
        return step(engine), drafter

    machine = Machine(row_cost=0.1)
    alone = FakeTarget(lm, 80, 64, fixed_costs(0.1, rows=64), machine)
    (tokens, stats, _), own = run(alone, alone, machine, lambda e: generate_all(e, prompt))
    machine = Machine(row_cost=0.1)
    shared = FakeSequences(lm, 1, 80, 64, fixed_costs(0.1, rows=64), machine)
    batch = Batch(shared, clock=machine)

    def in_batch(engine):
        gen = batch.join(0, engine, prompt)
        while batch.members:
            batch.round()
        return gen

    gen, mine = run(shared, shared.sequence(0), machine, in_batch)
    assert [d.tolist() for d in mine.drafts] == [d.tolist() for d in own.drafts]
    assert gen.tokens == tokens and gen.stats.rounds == stats.rounds and gen.stats.drafted == stats.drafted
    assert stats.drafted > 0


def test_each_requests_counts_are_its_own():
    """In company, a request's rounds, drafted, accepted, loose and emitted are those of its run
    alone on the drafts it was verified on, and its mean accepted length is each of its rounds'
    L + 1 over its rounds: at least 1, whatever FLy's windows took back (the answer's length,
    `emitted`, may then be lower)."""
    retracted = 0
    for seed in range(N_BATCHES):
        done, _ = run_batch(seed)
        for gen, case, rec, cancelled, _ in done:
            if cancelled:
                continue
            where = f"batch seed {seed}: {case}"
            target = FakeTarget(LMS[case.lm], case.n_ctx, costs=fixed_costs(case.row_cost))
            engine = Engine(target, Replay(rec.drafts), make_verifier(case),
                            EngineConfig(max_tokens=case.max_tokens, k=case.k))
            _, own, _ = generate_all(engine, np.asarray(case.prompt, dtype=np.int32))
            s = gen.stats
            counts = ("rounds", "drafted", "accepted", "loose", "emitted", "emitted_in_rounds", "retractions")
            assert [getattr(s, c) for c in counts] == [getattr(own, c) for c in counts], where
            if s.rounds:
                assert s.mean_accepted_length == s.emitted_in_rounds / s.rounds >= 1, where
                assert s.emitted_in_rounds >= s.emitted + s.retracted - s.retractions, where
            retracted += s.retractions
    assert retracted > 0          # windows were taken back: the case the old count got below 1


def test_a_prompt_in_the_decode_does_not_make_draft_rows_look_cheap():
    """Two members decode beside a newcomer's 128-token chunk. The chunk is paid whatever the
    drafts do, so a middling draft must pay at the members' own rate: no rows. Counted in T, the
    chunk's cost made the decode's rate so low that the rows went in."""
    target = FakeSequences(FakeLM(seed=1), 4, 256, 256)
    curve = 1 + 0.4 * np.arange(256)
    fixed, own = {0: 1, 1: 1, 2: 128}, {0: 1, 1: 1}
    drafts = {0: np.array([0.5, 0.3, 0.2])}
    assert allot(target, curve, fixed, drafts, 256, decoding=2)[0] > 0
    assert allot(target, curve, fixed, drafts, 256, decoding=2, own=own) == {0: 0}


def test_decodes_of_several_computations_are_weighed_at_what_they_measured():
    """Where rows are nearly free a sure draft on one of two sequences pays, though it runs as a
    second computation; where such decodes measured three times what the curve says, not."""
    target = FakeSequences(FakeLM(seed=1), 2, 64, 64)
    flat = 1 + 0.02 * np.arange(64)
    fixed = {0: 1, 1: 1}
    drafts = {0: np.array([0.95, 0.9, 0.86])}
    assert allot(target, flat, fixed, drafts, 64)[0] > 0
    assert allot(target, flat, fixed, drafts, 64, uneven=3.0) == {0: 0}


def test_a_second_computation_is_never_believed_cheaper_than_the_curve_says():
    """Several computations measured at 0.65 of the curve beside single ones at 1.0 (what the
    default target gave: the curve's small sizes overpriced) weigh 1, not 0.65; dearer ones
    weigh what they measured, up to 3; too few of either weigh 1."""
    assert weigh_layouts([1.0] * 6, [0.65] * 6) == 1.0
    assert weigh_layouts([1.0] * 6, [1.3] * 6) == pytest.approx(1.3)
    assert weigh_layouts([0.5] * 6, [4.0] * 6) == 3.0
    assert weigh_layouts([1.0] * (FRESH_LAYOUTS - 1), [2.0] * 6) == 1.0
    # what it decides: a middling draft beside seven single rows on a compute-bound curve
    target = FakeSequences(FakeLM(seed=1), 8, 64, 64)
    curve = 1 + 0.5 * np.arange(64)
    fixed, drafts = {s: 1 for s in range(8)}, {0: np.array([0.6, 0.4])}
    assert allot(target, curve, fixed, drafts, 64, uneven=weigh_layouts([1.0] * 6, [0.65] * 6)) == {0: 0}

