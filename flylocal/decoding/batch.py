"""Several requests in one decode (docs/serving.md, "Several requests in one decode").

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

from flylocal.decoding.contracts import Sequences
from flylocal.decoding.engine import Engine, Generation, Request, RoundEvent
from flylocal.decoding.prompt_cache import PromptCache
from flylocal.decoding.round import Round

CHUNK_MIN = 128         # the fewest prompt tokens a round carries for newcomers beside others' rows: below
                        # about 128 a prompt token costs a quarter to a third more (measured, 2 cores)
PREFILL_SHARE = 3.0     # newcomers' prompt tokens in a round cost about this many times the others' rows,
STALL_S = 0.25          # or this many seconds, if that is more
LAYOUTS = 15            # shared decodes of each layout (one computation, several) kept to weigh `uneven`
FRESH_LAYOUTS = 5       # of each, before the measured ratio replaces 1
UNEVEN = (1.0, 3.0)     # the ratio believed: several computations cost at least what the curve says of
                        # each, at most thrice (beyond: a stall, or the curve is wrong)


@dataclass(eq=False)
class Member:
    seq: int
    engine: Engine
    gen: Generation
    req: Request
    joined: float                 # the clock when it joined
    shared: bool = True           # its drafts may be cut by the allotment (not a seeded request's)
    sharing: bool = False         # its drafter is told they are (it has company: `_plan_one`)
    plan: Round | None = None     # this round's
    reach: np.ndarray | None = None    # [draft] float64: P(first j+1 draft tokens accepted)


def split_cost(cost: np.ndarray, sizes: list[int]) -> float:
    """Seconds of a decode run as computations of `sizes` rows, from `cost` [n] (cost[i]: i+1 rows)."""
    return float(sum(cost[min(s, len(cost)) - 1] for s in sizes if s > 0))


def weigh_layouts(one: list[float], several: list[float]) -> float:
    """`allot`'s `uneven` from the seconds of shared decodes over what the cost curve says of
    them, `one` for decodes run as one computation and `several` for the others: the ratio of
    their medians (the load cancels), within UNEVEN; 1 before FRESH_LAYOUTS of each.

    Never below 1: a decode is at least the sum of its computations, and a ratio under 1 says
    that the curve overprices the small ones (its single step, taken between large decodes,
    carries the graph's rebuild), not that a second computation is cheap. Believed, it made a
    draft row beside seven single rows look like a quarter of what it cost."""
    if min(len(one), len(several)) < FRESH_LAYOUTS:
        return 1.0
    return float(np.clip(np.median(several) / np.median(one), *UNEVEN))


def allot(target: Sequences, cost: np.ndarray, fixed: dict[int, int], drafts: dict[int, np.ndarray],
          limit: int, decoding: int | None = None, uneven: float = 1.0,
          own: dict[int, int] | None = None) -> dict[int, int]:
    """How many draft rows each sequence's draft gets this round: n[s] <= len(drafts[s]), the
    choice that maximises the expected tokens committed per second of the decode,

        E(n) = sum over members of (1 + sum_{j < n[s]} reach_s[j]),   T(n) = sum_u cost(u)

    with `fixed[s]` rows each sequence decodes anyway (its last token, a prompt's tail, a chunk)
    and u the computations the decode runs as (`Sequences.split`). `drafts[s]`: reach_s, for
    the sequences that decode a round with a draft to cut; `decoding`: how many sequences
    decode a round, drafting or not (each commits a token; default: every one in `fixed`), so
    that a draft row must pay at the rate of the whole decode. `uneven`: what a decode run as
    several computations costs over what the curve says of them (`Batch.uneven`, measured).
    `own[s]`: the rows of `fixed` that are the members' own rounds (their last token, a draft
    verified whole), the rest being prompt rows: what those cost is paid whatever the drafts, so
    it is left out of T, and a draft row must pay at the rate of the members' rounds, not at the
    lower one of a decode that also carries a prompt. At most `limit` rows in all.

    Rows come in the order of their gain: every draft capped at a common length L, the drafts
    weakest at that length left out one by one (the best of these), then single rows added or
    taken away while that raises E/T. Uneven drafts cost more than their rows (`split`), so
    the search moves whole levels before single rows. A row that costs more than
    the average token it is expected to give is not decoded."""
    n = {s: 0 for s in drafts}
    base = sum(fixed.values())
    gains = {s: np.concatenate([[0.0], np.cumsum(r)]) for s, r in drafts.items()}     # [d+1]: expected extra tokens
    members = len(fixed) if decoding is None else decoding

    def seconds(rows: dict[int, int]) -> float:
        sizes = target.split(rows)
        return split_cost(cost, sizes) * (uneven if len(sizes) > 1 else 1.0)

    prompt = max(seconds(fixed) - seconds(own), 0.0) if own is not None else 0.0

    def rate(n: dict[int, int]) -> float:
        if base + sum(n.values()) > limit:
            return -1.0
        rows = dict(fixed)
        for s, k in n.items():
            rows[s] = rows.get(s, 0) + k
        expected = members + sum(gains[s][k] for s, k in n.items())
        return expected / max(seconds(rows) - prompt, 1e-12)

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

    def __init__(self, target: Sequences, clock: Callable[[], float] = time.perf_counter,
                 cache: PromptCache | None = None):
        """`cache`: where slots' cells are kept when they take another prompt, and restored
        from (flylocal.decoding.prompt_cache); None: a slot keeps only what it holds (a cache
        that keeps nothing, which still seats each request and keeps partitions apart)."""
        self.target = target
        self.clock = clock
        self.cache = cache if cache is not None else PromptCache([target], 0)
        self.members: dict[int, Member] = {}        # by sequence
        self.decodes = 0
        self.rows = 0                               # rows decoded, over every decode
        # Shared decodes' seconds over what the cost curve says of them, the last few of each
        # layout: run as one computation, or as several (`uneven`).
        self._one: list[float] = []
        self._several: list[float] = []

    # ----- membership -----
    def free(self) -> list[int]:
        return [s for s in range(self.target.n_seq) if s not in self.members]

    def place(self, prompt: np.ndarray, partition: str | None = "") -> int | None:
        """The free sequence for a prompt of `partition` (whose cells it may reuse): the prompt
        cache's choice (`PromptCache.seat`). None when all are taken."""
        free = self.free()
        if not free:
            return None
        return self.cache.seat(free, prompt, partition)

    def join(self, seq: int, engine: Engine, prompt: np.ndarray, on_end=None, grammar=None) -> Generation:
        """Start a request on sequence `seq` (free) with `engine`, built on `target.sequence(seq)`.
        Its prompt goes in over the next rounds; its Generation collects its output as rounds run
        (not to be iterated: its events come from `round`). What the request's start raises
        (its grammar, a calibration's decode) is raised here, its sequence cleared."""
        if seq in self.members:
            raise ValueError(f"sequence {seq} is taken")
        # A seeded request's output must not follow what else runs (a loose verifier's follows its
        # drafts): its drafter cuts its own drafts as alone, and they are verified whole.
        shared = not engine.config.pin_costs
        prompt = engine.checked(prompt)
        gen = Generation(prompt, on_end, grammar)
        req = engine.start(prompt, gen)
        try:
            # the target's cost curve known up to the decodes a full batch makes (measured once
            # per curve, on this member's sequence)
            target = self.target
            engine.prefill(req, rows=min(target.n_batch, target.n_seq * (engine.config.k + 1)))
        except BaseException:
            engine.stop(req, "error")
            engine.drafter.share(False)
            _clear(engine)
            raise
        self.members[seq] = Member(seq, engine, gen, req, self.clock(), shared)
        return gen

    def leave(self, gen: Generation, why: str = "interrupted") -> None:
        """Stop a member now (its client went away): its sequence is free from the next round."""
        for seq, m in list(self.members.items()):
            if m.gen is gen:
                self._end(m, why)

    def _end(self, m: Member, why: str | None = None) -> None:
        del self.members[m.seq]
        m.engine.drafter.share(False)
        m.engine.stop(m.req, why)

    def _fail(self, m: Member, error: Exception, out: list) -> None:
        """`m` raised: it ends alone, as "error", its sequence cleared (whatever the failure left
        in its cells goes), and `error` goes out as its event."""
        try:
            self._end(m, "error")
        except Exception:  # noqa: BLE001 - its end's own hooks failing too changes nothing for the others
            self.members.pop(m.seq, None)
        _clear(m.engine)
        out.append((m.gen, error))

    def close(self, why: str = "interrupted") -> None:
        for m in list(self.members.values()):
            self._end(m, why)

    # ----- a round -----
    def round(self) -> list[tuple[Generation, RoundEvent | Exception]]:
        """One decode for every member: each decoding member's round, and a chunk of a newcomer's
        prompt. Returns the event of each member that decided a round (a finished member has
        left by then: its Generation's stats say why), and for a member that failed, what it
        raised: its drafter, its grammar or its part of the decode failing ends it alone, and
        the others go on (a decode that fails is run again part by part, so that only the
        parts that fail alone fail). A KeyboardInterrupt ends every member and is raised."""
        members = sorted(self.members.values(), key=lambda m: m.seq)
        out: list = []
        try:
            parts, chunks = self._plan(members, out)
            if not parts:
                return out
            try:
                t0 = self.clock()
                logits = self.target.decode_batch(parts)
                seconds = self.clock() - t0
            except Exception as e:  # noqa: BLE001 - whose part failed is found part by part
                if len(parts) == 1:
                    self._fail(self.members[parts[0][0]], e, out)
                    return out
                for part in parts:
                    try:
                        t0 = self.clock()
                        alone = self.target.decode_batch([part])
                        seconds = self.clock() - t0
                    except Exception as e:  # noqa: BLE001 - this member's own failure
                        self._fail(self.members[part[0]], e, out)
                        continue
                    self._settle([part], alone, seconds, chunks, out)
                return out
            self._settle(parts, logits, seconds, chunks, out)
        except BaseException:
            self.close("error")
            raise
        return out

    def _settle(self, parts: list, logits: list, seconds: float, chunks: dict[int, int], out: list) -> None:
        """The decode of `parts` gave `logits` in `seconds`: prompt chunks move on, each member
        with a round decides, commits and accounts it (`out` gets its event, or its failure)."""
        rows = sum(len(tokens) for _, tokens, _ in parts)
        self.decodes += 1
        self.rows += rows
        shared = len(parts) > 1
        for (seq, tokens, first), out_logits in zip(parts, logits):
            m = self.members[seq]
            if first is None:                     # a chunk of a newcomer's prompt
                m.req.head = m.req.head[chunks[seq]:]
                continue
            r, m.plan = m.plan, None
            r.shared = shared
            try:
                m.engine.score(m.req, r, out_logits, seconds)
                event = m.engine.verify(m.req, r)
            except Exception as e:  # noqa: BLE001 - its grammar, its verifier: its own failure
                self._fail(m, e, out)
                continue
            out.append((m.gen, event))
            if m.req.stats.stop:
                self._end(m)
        # A shared decode is not a round of the cost curve (its rows are several sequences',
        # timed without host work): it is weighed against the curve, for `uneven`.
        costs = self.target.costs
        if shared and costs.calibrated:
            sizes = self.target.split({s: len(t) for s, t, _ in parts})
            said = split_cost(costs.cost(max(sizes)), sizes)
            kept = self._one if len(sizes) == 1 else self._several
            kept.append(seconds / said)
            del kept[:-LAYOUTS]

    def uneven(self) -> float:
        """What a shared decode run as several computations costs over what the cost curve says
        of them, relative to one run as a single computation (`weigh_layouts`)."""
        return weigh_layouts(self._one, self._several)

    def _plan(self, members: list[Member], out: list) -> tuple[list, dict[int, int]]:
        """This round's parts (seq, tokens, logits_from) and the prompt chunks among them (seq ->
        tokens); a member whose planning fails ends (`out` gets its failure).

        Members past their first round plan a round first: each its last token and a draft of
        a given length (verified whole), the other drafts to be cut by `allot`. Newcomers,
        oldest first, then join with their first round while their prompt's tail and that
        round fit this round's share for prompts (and the batch); the first that does not gets
        a chunk of what is left of that share. With no one decoding, the share is the whole
        batch: a newcomer always gets in, whatever its draft length."""
        limit = self.target.n_batch
        running = [m for m in members if m.req.stats.rounds]
        newcomers = sorted((m for m in members if not m.req.stats.rounds), key=lambda m: m.joined)
        plans: dict[int, Member] = {}
        for m in running:
            if self._plan_one(m, out):
                plans[m.seq] = m
        used = sum(self._fixed(m) for m in plans.values())
        # (the cost curve, refined every round, is read only when a newcomer needs a share)
        share = (min(self.chunk_rows(used), limit - used) if plans else limit) if newcomers else 0
        chunks: dict[int, int] = {}
        for m in newcomers:
            tail = len(m.req.head)
            whole = m.engine.config.k          # room for a draft verified whole, whatever it turns out to be
            need = tail + 1 + whole
            if need <= max(share, 1 + whole if not tail else 0) and used + need <= limit:
                if self._plan_one(m, out):
                    plans[m.seq] = m
                    used += self._fixed(m)
                share -= need
                continue
            room = min(share, limit - used)
            if tail and room > 0:
                chunks[m.seq] = min(tail, room)
                used += chunks[m.seq]
            break
        fixed = {s: self._fixed(m) for s, m in plans.items()} | chunks
        drafts = {s: m.reach for s, m in plans.items() if len(m.reach)}
        n = {}
        # Drafts verified whole that together pass the batch (a k past what a slot holds, which a
        # server refuses): cut, the longest first.
        given = {s: len(m.plan.draft) for s, m in plans.items() if not len(m.reach) and len(m.plan.draft)}
        while sum(fixed.values()) > limit and any(given.values()):
            s = max(given, key=given.get)
            given[s] -= 1
            fixed[s] -= 1
            n[s] = given[s]
        if drafts:
            own = {s: self._fixed(m) - len(m.req.head) for s, m in plans.items()}
            self.target.costs.at(max(m.req.n for m in plans.values()))    # the longest context's rows cost most
            n |= allot(self.target, self.target.costs.cost(limit), fixed, drafts, limit, decoding=len(plans),
                       uneven=self.uneven(), own=own)
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

    def _plan_one(self, m: Member, out: list) -> bool:
        """Plan `m`'s round (its draft and the chance of each draft token): True when it has one;
        a member that stopped before a round (max_tokens 0, a full context) ends, one whose
        planning failed ends with its failure in `out`."""
        # Alone, a request drafts as it does outside a batch (its drafter cuts its own drafts); in
        # company its drafter proposes what is worth verifying and the allotment cuts.
        company = m.shared and len(self.members) > 1
        if company != m.sharing:
            m.engine.drafter.share(company)
            m.sharing = company
        try:
            r = m.engine.plan(m.req)
        except Exception as e:  # noqa: BLE001 - its drafter, its grammar: its own failure
            self._fail(m, e, out)
            return False
        if r is None:
            self._end(m)
            return False
        m.plan = r
        d = len(r.draft)
        own = m.engine.drafter.reach(r.proposal) if d > r.forced else np.zeros(0)
        if own is None or not m.sharing:   # a length given (--k), a seeded request, alone: verified whole
            m.reach = np.zeros(0)
        else:
            m.reach = np.zeros(d)
            m.reach[: r.forced] = 1.0          # the grammar's forced tokens are the target's too
            own = np.clip(own[: d - r.forced], 0.0, 1.0)
            m.reach[r.forced : r.forced + len(own)] = own
        return True

    @staticmethod
    def _fixed(m: Member) -> int:
        """The rows `m`'s planned round decodes whatever the allotment: its prompt's tail, its
        last token, and a draft verified whole."""
        return len(m.req.head) + 1 + (len(m.plan.draft) if not len(m.reach) else 0)

    def chunk_rows(self, others: int) -> int:
        """Prompt tokens a round carries beside `others` rows: as many as cost PREFILL_SHARE times
        those rows, or STALL_S seconds if that is more (the cost curve's slope past its calibrated
        sizes gives a prompt token's cost); within what the batch has left."""
        target = self.target
        cost = target.costs.cost(target.n_batch)
        top = len(cost)
        half = max(top // 2, 1)
        per_token = max((cost[top - 1] - cost[half - 1]) / max(top - half, 1), 1e-12)
        rows = cost[min(max(others, 1), top) - 1]
        want = max(PREFILL_SHARE * rows, STALL_S) / per_token
        return int(max(min(max(CHUNK_MIN, want), target.n_batch - others), 1))


def _clear(engine: Engine) -> None:
    """A failed request's sequence emptied: nothing a failure left half done stays in its cells."""
    try:
        engine.target.truncate(0)
    except Exception:  # noqa: BLE001 - a context that cannot even roll back is rebuilt by its next use
        pass
