"""Several requests in one decode (docs/design.md, "Several requests at once").

Each member of a Batch is a request with an Engine of its own (its drafter, verifier, grammar
state, seed, stop) on a sequence of its own in one shared cache (contracts.Sequences). A round:

    members' drafts -> allot(rows by expected gain per cost) -> one decode_batch
                    -> each member decides, commits and accounts its rows -> events

- Every decoding member gets its one row (its last token) every round; draft rows go where they
  are expected to commit the most tokens per second of the whole decode (`allot`).
- A newcomer's prompt goes in chunks beside the others' rounds (`chunk_rows`): a round carries
  prompt tokens costing about three times the others' rows, or a quarter of a second if that
  is more, so a prompt goes in at about three quarters of its speed alone and the others keep
  advancing every round meanwhile.
- A member's rollbacks are its own sequence's (Target.truncate through `Sequences.sequence`).

The Batch prints nothing and knows the target only through its contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from flylocal.decoding.adaptive import timed_decode
from flylocal.decoding.contracts import Sequences, reusable_prefix
from flylocal.decoding.engine import Engine, Generation, Request, RoundEvent
from flylocal.decoding.round import Round

REUSE_MIN = 32          # a cached prefix worth taking a higher sequence for
CHUNK_MIN = 128         # the fewest prompt tokens a round carries for newcomers beside others' rows: below
                        # about 128 a prompt token costs a quarter to a third more (measured, 2 cores)
PREFILL_SHARE = 3.0     # newcomers' prompt tokens in a round cost about this many times the others' rows,
STALL_S = 0.25          # or this many seconds, if that is more


@dataclass(eq=False)
class Member:
    seq: int
    engine: Engine
    gen: Generation
    req: Request
    joined: float                 # the clock when it joined
    shared: bool = True           # its drafts are cut by the allotment (not a seeded request's)
    plan: Round | None = None     # this round's
    reach: np.ndarray | None = None    # [draft] float64: P(first j+1 draft tokens accepted)


def split_cost(cost: np.ndarray, sizes: list[int]) -> float:
    """Seconds of a decode run as computations of `sizes` rows, from `cost` [n] (cost[i]: i+1 rows)."""
    return float(sum(cost[min(s, len(cost)) - 1] for s in sizes if s > 0))


def allot(target: Sequences, cost: np.ndarray, fixed: dict[int, int], drafts: dict[int, np.ndarray],
          limit: int) -> dict[int, int]:
    """How many draft rows each sequence's draft gets this round: n[s] <= len(drafts[s]), the
    choice that maximises the expected tokens committed per second of the decode,

        E(n) = sum over members of (1 + sum_{j < n[s]} reach_s[j]),   T(n) = sum_u cost(u)

    with `fixed[s]` rows each sequence decodes anyway (its last token, a prompt's tail, a chunk)
    and u the computations the decode runs as (`Sequences.split`). `drafts[s]`: reach_s, for
    the sequences that decode a round. At most `limit` rows in all.

    Rows come in the order of their gain: every draft capped at a common length L, the drafts
    weakest at that length left out one by one (the best of these), then single rows added or
    taken away while that raises E/T. Uneven drafts cost more than their rows (`split`), so
    the search moves whole levels before single rows. A row that costs more than
    the average token it is expected to give is not decoded."""
    n = {s: 0 for s in drafts}
    base = sum(fixed.values())
    gains = {s: np.concatenate([[0.0], np.cumsum(r)]) for s, r in drafts.items()}     # [d+1]: expected extra tokens
    members = len(drafts)

    def rate(n: dict[int, int]) -> float:
        if base + sum(n.values()) > limit:
            return -1.0
        rows = dict(fixed)
        for s, k in n.items():
            rows[s] = rows.get(s, 0) + k
        expected = members + sum(gains[s][k] for s, k in n.items())
        return expected / max(split_cost(cost, target.split(rows)), 1e-12)

    longest = max((len(r) for r in drafts.values()), default=0)
    if not longest:
        return n
    best, best_rate = n, rate(n)
    for cap in range(1, longest + 1):
        trial = {s: min(cap, len(r)) for s, r in drafts.items()}
        # the weakest drafts at this length left out, one more at a time
        weakest = sorted(drafts, key=lambda s: gains[s][trial[s]] / max(trial[s], 1))
        for s in [None, *weakest[:-1]]:
            if s is not None:
                trial = dict(trial)
                trial[s] = 0
            value = rate(trial)
            if value > best_rate:
                best, best_rate = trial, value
    for _ in range(2 * members):
        moved = False
        for s, r in drafts.items():
            for step in (1, -1):
                k = best[s] + step
                if 0 <= k <= len(r):
                    trial = dict(best)
                    trial[s] = k
                    value = rate(trial)
                    if value > best_rate * (1 + 1e-9):
                        best, best_rate, moved = trial, value, True
        if not moved:
            break
    return best


class Batch:
    """The members decoding together on `target`'s sequences; `round()` advances every one of them."""

    def __init__(self, target: Sequences, clock: Callable[[], float] = time.perf_counter):
        self.target = target
        self.clock = clock
        self.members: dict[int, Member] = {}        # by sequence
        self.decodes = 0
        self.rows = 0                               # rows decoded, over every decode

    # ----- membership -----
    def free(self) -> list[int]:
        return [s for s in range(self.target.n_seq) if s not in self.members]

    def place(self, prompt: np.ndarray) -> int | None:
        """The free sequence for a prompt: the one whose cache keeps most of it, else the lowest
        (decodes of neighbouring sequences run together: `Sequences.split`); None when all are taken."""
        free = self.free()
        if not free:
            return None
        prompt = np.asarray(prompt, dtype=np.int32)
        kept = {s: reusable_prefix(self.target.cached(s), prompt) for s in free}
        return max(free, key=lambda s: (kept[s] if kept[s] >= REUSE_MIN else 0, -s))

    def join(self, seq: int, engine: Engine, prompt: np.ndarray, on_end=None, grammar=None) -> Generation:
        """Start a request on sequence `seq` (free) with `engine`, built on `target.sequence(seq)`.
        Its prompt goes in over the next rounds; its Generation collects its output as rounds run
        (not to be iterated: its events come from `round`)."""
        if seq in self.members:
            raise ValueError(f"sequence {seq} is taken")
        # A seeded request's output must not follow what else runs (a loose verifier's follows its
        # drafts): its drafter cuts its own drafts as alone, and they are verified whole.
        shared = not engine.config.pin_costs
        engine.drafter.share(shared)
        gen = engine.generate(prompt, on_end=on_end, grammar=grammar)
        req = engine.start(np.asarray(prompt, dtype=np.int32), gen)
        try:
            engine.prefill(req)
            self._calibrate(engine, req)
        except BaseException:
            engine.stop(req, "error")
            engine.drafter.share(False)
            raise
        self.members[seq] = Member(seq, engine, gen, req, self.clock(), shared)
        return gen

    def _calibrate(self, engine: Engine, req: Request) -> None:
        """The target's cost curve known up to the decodes a full batch makes (measured once per
        curve, on this member's sequence, its prompt in first; cached on disk like any)."""
        target, seq = self.target, engine.target
        rows = min(target.n_batch, target.n_seq * (engine.config.k + 1))

        def probe(n: int) -> float:
            if len(req.head):
                seq.decode(req.head)
                req.head = req.head[:0]
            return timed_decode(seq, int(req.prompt[-1]), n, self.clock)

        target.costs.ensure(probe, max_rows=rows, limit=target.n_batch, recalibrate=engine.config.recalibrate)

    def leave(self, gen: Generation, why: str = "interrupted") -> None:
        """Stop a member now (its client went away): its sequence is free from the next round."""
        for seq, m in list(self.members.items()):
            if m.gen is gen:
                self._end(m, why)

    def _end(self, m: Member, why: str | None = None) -> None:
        del self.members[m.seq]
        m.engine.drafter.share(False)
        m.engine.stop(m.req, why)

    def close(self, why: str = "interrupted") -> None:
        for m in list(self.members.values()):
            self._end(m, why)

    # ----- a round -----
    def round(self) -> list[tuple[Generation, RoundEvent]]:
        """One decode for every member: each decoding member's round, and a chunk of a newcomer's
        prompt. Returns the events of the members that decided a round (a finished member has
        left by then: its Generation's stats say why)."""
        members = sorted(self.members.values(), key=lambda m: m.seq)
        if not members:
            return []
        try:
            parts, chunks = self._plan(members)
            t0 = self.clock()
            logits = self.target.decode_batch(parts)
            seconds = self.clock() - t0
        except BaseException:
            self.close("error")
            raise
        rows = sum(len(tokens) for _, tokens, _ in parts)
        self.decodes += 1
        self.rows += rows
        shared = len(parts) > 1
        for seq, c in chunks.items():
            req = self.members[seq].req
            req.head = req.head[c:]
        out = []
        decided = []
        for (seq, tokens, first), out_logits in zip(parts, logits):
            m = self.members[seq]
            if first is None:
                continue
            r, m.plan = m.plan, None
            r.shared = shared
            try:
                m.engine.scored(m.req, r, out_logits, seconds)
                event = m.engine.settle(m.req, r)
            except BaseException:
                self._end(m, "error")
                raise
            out.append((m.gen, event))
            decided.append(r)
            if m.req.stats.stop:
                self._end(m)
        costs = self.target.costs
        if shared and not chunks and len(self.target.split({s: len(t) for s, t, _ in parts})) == 1:
            costs.update(rows, seconds, emitted=sum(max(r.net, 0) for r in decided))
        return out

    def _plan(self, members: list[Member]) -> tuple[list, dict[int, int]]:
        """This round's parts (seq, tokens, logits_from) and the prompt chunks among them (seq ->
        tokens). Members past their first round plan a round; newcomers, oldest first, join
        with their first round while their prompt's tail fits this round's share for prompts,
        and the first that does not gets a chunk of what is left of that share."""
        target = self.target
        limit = target.n_batch
        running = [m for m in members if m.req.stats.rounds]
        newcomers = sorted((m for m in members if not m.req.stats.rounds), key=lambda m: m.joined)
        share = (self.chunk_rows(len(running)) if running
                 else limit - 1 - max((m.engine.config.k for m in newcomers), default=0))
        joining, chunks = [], {}
        for m in newcomers:
            tail = len(m.req.head)
            if tail + 1 <= share:
                joining.append(m)
                share -= tail + 1
            else:
                if share > 0:
                    chunks[m.seq] = min(tail, share)
                break
        plans = {}
        for m in running + joining:
            r = m.engine.plan(m.req)
            if r is None:                  # stopped before a round (max_tokens 0, a full context)
                self._end(m)
                continue
            m.plan = r
            d = len(r.draft)
            own = m.engine.drafter.reach(r.proposal) if d > r.forced else np.zeros(0)
            if own is None or not m.shared:    # a length given (--k), a seeded request: verified whole
                m.reach = np.zeros(0)
            else:
                m.reach = np.zeros(d)
                m.reach[: r.forced] = 1.0          # the grammar's forced tokens are the target's too
                own = np.clip(own[: d - r.forced], 0.0, 1.0)
                m.reach[r.forced : r.forced + len(own)] = own
            plans[m.seq] = m
        fixed = {s: len(m.req.head) + 1 + (len(m.plan.draft) if not len(m.reach) else 0)
                 for s, m in plans.items()} | chunks
        drafts = {s: m.reach for s, m in plans.items() if len(m.reach)}
        n = {}
        given = [s for s, m in plans.items() if not len(m.reach) and len(m.plan.draft)]
        while sum(fixed.values()) > limit:     # drafts of a given length beyond the batch: cut, longest first
            s = max(given, key=lambda s: fixed[s] - len(plans[s].req.head))
            fixed[s] -= 1
            n[s] = fixed[s] - len(plans[s].req.head) - 1
        if drafts:
            n |= allot(target, target.costs.cost(limit), fixed, drafts, limit)
        parts = []
        for m in members:
            s = m.seq
            if s in plans:
                r = m.plan
                k = n.get(s, len(r.draft))
                if k < len(r.draft):
                    r.draft = r.draft[:k]
                    r.forced = min(r.forced, k)
                parts.append((s, m.engine.rows(m.req, r), r.head))
            elif s in chunks:
                parts.append((s, m.req.head[: chunks[s]], None))
        return parts, chunks

    def chunk_rows(self, others: int) -> int:
        """Prompt tokens a round carries beside `others` rows: as many as cost PREFILL_SHARE times
        those rows, or STALL_S seconds if that is more (the cost curve's slope past its calibrated
        sizes gives a prompt token's cost); within the batch."""
        target = self.target
        cost = target.costs.cost(target.n_batch)
        top = len(cost)
        half = max(top // 2, 1)
        per_token = max((cost[top - 1] - cost[half - 1]) / max(top - half, 1), 1e-12)
        rows = cost[min(max(others, 1), top) - 1]
        want = max(PREFILL_SHARE * rows, STALL_S) / per_token
        return int(max(min(max(CHUNK_MIN, want), target.n_batch - others), 1))
