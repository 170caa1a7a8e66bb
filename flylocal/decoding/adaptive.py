"""Draft length from measured cost and acceptance.

Verifying k drafted tokens costs one target decode of k+1 rows. On a GPU that is nearly flat
in k; on a 2-core CPU 8 rows cost 3-4 single steps (docs/design.md, "Cost model"), so a long, poorly grounded draft
is slower than no draft at all. Each round this controller picks the draft length that
maximises expected committed tokens per second:

    E(k) = 1 + sum_{j<k} prod_{i<=j} alpha[level, i]        (tokens emitted by the round)
    rate(k) = E(k) / t(k+1)                                   (t: measured decode seconds)

`alpha[level, i]` is the measured probability that draft position i is accepted given that
positions before it were, per confidence level (for prompt lookup: the n-gram size that
matched). k = 0 (a plain step) wins whenever no draft is expected to pay for itself.

t(n) comes from a CostCurve (flylocal.decoding.costs): its shape t(n)/t(1), calibrated once per model
file, build, device, thread count and batch size and cached on disk, times the speed of the
moment, measured from the rounds; shared by everything that drafts for that model in one
process. Now and then a length whose cost has no fresh evidence is tried (`CostCurve.explore`),
within a budget, so that a wrong curve cannot keep drafting switched off.
"""

from __future__ import annotations

import time

import numpy as np

from flylocal.decoding.contracts import Target
from flylocal.decoding.costs import STALE, CostCurve
from flylocal.statistics import middle

# A drafter's prior acceptance per confidence level is worth PRIOR_WEIGHT observations;
# measurements replace it within a few rounds.
PRIOR_WEIGHT = 2.0
STREAK_PRIOR = 0.85
DECAY = 0.98             # per round, every level drifts back toward its prior: old evidence fades
STEPS = 5                # a draft model's cost per token: the median of its last 5 drafts
MARGIN = 0.03            # a draft must be expected to beat a plain step by 3%: the length chosen
                         # is the one whose estimate is highest, so its estimate errs high (on 2
                         # cores, where 2 rows cost 1.8 steps, drafting within that margin lost)


def pick(rates: np.ndarray) -> int:
    """The length of the highest expected rate [k+1], a draft's counted MARGIN lower."""
    if len(rates) < 2 or rates[0] * (1 + MARGIN) >= rates[1:].max():
        return 0
    return 1 + int(np.argmax(rates[1:]))


class DraftLength:
    def __init__(self, k_max: int, prior: np.ndarray, curve: CostCurve | None = None):
        """prior [levels] float64: the drafter's prior per-position acceptance by level.
        `curve`: the target's cost curve (shared; a private one when None)."""
        self.k_max = k_max
        levels = len(prior)
        # Rows [levels:] are the same levels right after a round that accepted its whole draft:
        # a copy in progress, which is far more reliable than the n-gram size alone says. That is
        # a request's own state, so the drafter keeps it and names the row (`row`):
        # requests in one batch share a controller, each with its own streak.
        self.levels = levels
        prior = np.concatenate([prior, np.maximum(prior, STREAK_PRIOR)])
        self.hits = np.repeat(prior[:, None] * PRIOR_WEIGHT, k_max, axis=1)   # [2*levels, k_max]
        self.tries = np.full((2 * levels, k_max), PRIOR_WEIGHT)                    # [2*levels, k_max]
        self._prior_hits = self.hits.copy()
        self.curve = curve if curve is not None else CostCurve()

    def curves(self) -> tuple[CostCurve, ...]:
        return (self.curve,)

    def fits(self, other: DraftLength) -> bool:
        """Whether `other`'s statistics are about the same choices (to be kept in its place)."""
        return isinstance(other, DraftLength) and other.hits.shape == self.hits.shape and other.curve is self.curve

    def row(self, level: int, streak: bool) -> int:
        """The statistics' row of a proposal at confidence `level`, `streak` when the round
        before accepted its whole draft: what `rates`, `reach`, `best`, `choose` and `update` take."""
        return level + self.levels * bool(streak)

    def rates(self, row: int, available: int) -> np.ndarray:
        """Expected committed tokens per second for verifying 0..k of the `available` proposed
        tokens at `row`: [k+1] float64."""
        k = max(min(available, self.k_max), 0)
        alpha = self.hits[row, :k] / self.tries[row, :k]
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])   # [k+1]: E(0..k)
        return expected / self.curve.cost(k + 1)

    def reach(self, row: int, k: int) -> np.ndarray:
        """[k] float64: the chance that the first j+1 of k proposed tokens at `row` are all accepted."""
        k = max(min(k, self.k_max), 0)
        return np.cumprod(self.hits[row, :k] / self.tries[row, :k])

    def best(self, row: int, available: int) -> int:
        """The draft length, of `available` proposed tokens, expected to commit the most tokens
        per second. Acceptance is measured as committed, so a loose verifier's extra acceptance
        on long drafts counts in favour of long drafts."""
        if min(available, self.k_max) <= 0:
            return 0
        return pick(self.rates(row, available))

    def choose(self, row: int, available: int) -> int:
        """How many of `available` proposed tokens to verify this round: the best length, or
        now and then one whose cost has no fresh evidence (CostCurve.explore)."""
        if min(available, self.k_max) <= 0:
            return 0
        rates = self.rates(row, available)
        return self.curve.explore(rates, pick(rates))

    def update(self, row: int, k: int, accepted: int, seconds: float | None = None) -> None:
        """Record a round that verified k tokens and accepted `accepted` of them, and (when
        given) its `seconds`, into the cost curve (a round emits `accepted` + 1 tokens)."""
        self.hits = self._prior_hits + DECAY * (self.hits - self._prior_hits)
        self.tries = PRIOR_WEIGHT + DECAY * (self.tries - PRIOR_WEIGHT)
        if k > 0:
            reached = min(accepted + 1, k)          # positions that were actually decided
            self.tries[row, :reached] += 1.0
            self.hits[row, :accepted] += 1.0
        if seconds is not None:
            self.curve.update(k + 1, seconds, emitted=accepted + 1)


def timed_decode(runtime: Target, token: int, rows: int, clock=time.perf_counter) -> float:
    """Seconds for one decode of `rows` copies of `token` with logits on every row, rolled back
    after: a calibration probe for CostCurve. NaN when the context has no room."""
    n_past = runtime.n_past
    if n_past + rows > runtime.n_ctx:
        return float("nan")
    # Measured at the thread count the curve is keyed by, whatever --threads auto chose now.
    with runtime.steady():
        t0 = clock()
        logits = runtime.decode(np.full(rows, token, dtype=np.int32), logits_from=0)
        logits.argmax(axis=1)
        runtime.truncate(n_past)
        return clock() - t0


# A draft model's prefill (docs/design.md, "Cost model"): it must see the context before its
# first draft, and that is paid before the target sees anything.
PREFILL_PRIOR = 0.3      # seconds per context token evaluated in a batch, in the draft's single steps, before
                         # one is measured (2 cores: 0.08-0.10 for Gemma-3-270M Q2_K, 0.28 for SmolLM2-135M)
PAYBACK = 2.0            # the prefill must be expected to be paid back twice over by the answer's rounds
ANSWERS = 5              # an answer's expected length: the median of the last 5 (at most the budget left)
MIN_PREFILL = 16         # a catch-up of fewer tokens says little of the prefill's cost per token
PREFILLS = 3             # the draft's prefill per token: the median of its last 3 (relative to the target's step)
LOOKUPS = 64             # what prompt lookup alone offers: its speed-up over a plain step in the last 64 rounds

# Confidence levels of a draft model's token: buckets of its own top-1 probability.
P_EDGES = np.array([0.3, 0.5, 0.7, 0.85, 0.95])                  # level = searchsorted(P_EDGES, p)
P_PRIOR = np.array([0.15, 0.4, 0.6, 0.78, 0.9, 0.97])            # prior acceptance per level


def top_probability(logits: np.ndarray) -> np.ndarray:
    """The softmax probability of each row's argmax: [rows] float64 from logits [rows, V]."""
    z = logits - logits.max(axis=1, keepdims=True)
    return 1.0 / np.exp(z, dtype=np.float64).sum(axis=1)


class ModelDraftLength:
    """Whether a draft model drafts this round, and for how long (docs/design.md, "Cost model").

    A draft model spends c seconds per drafted token before the target sees anything, so

        rate(k) = E(k) / (k*c + t(k+1))

    with t the target's cost curve and acceptance measured per confidence level (the draft's
    own top-1 probability, bucketed). Before a round, `best` gives the rate the model is
    expected to reach, to be weighed against prompt lookup alone and a plain step. While
    drafting, `keep_going` keeps each further token only while it is expected to raise the
    round's rate, and a token the draft gives less than `p_min` ends the draft. On a CPU where
    the draft costs as much as a target step it never pays, and rounds fall back to lookup or
    plain steps; on a flat (GPU-like) curve with a cheap draft it drafts long."""

    def __init__(self, k_max: int, target_costs: CostCurve, draft_costs: CostCurve, p_min: float = 0.0):
        self.k_max = k_max
        self.target_costs = target_costs
        self.draft_costs = draft_costs
        self.p_min = p_min
        self.hits = P_PRIOR * PRIOR_WEIGHT          # [levels]
        self.tries = np.full(len(P_PRIOR), PRIOR_WEIGHT)
        self.all_hits, self.all_tries = 0.6 * PRIOR_WEIGHT, PRIOR_WEIGHT   # any level, for planning
        # Measured drafts: (target clock, seconds per drafted token / the target's single step
        # then). Load slows both models alike, so the ratio outlives the load it was measured
        # under; it is the median of the last few, and expires with the target's evidence.
        self._steps: list[tuple[float, float]] = []
        # Measured prefills (seconds per token / the target's single step then), and the
        # lengths of the last answers: what a request's prefill is weighed against (`window`).
        self._prefills: list[float] = []
        self.answers: list[int] = []
        # What prompt lookup alone offered in the last rounds (its best rate over a plain
        # step's, at least 1): the model saves only where it beats that.
        self.lookups: list[float] = []

    @staticmethod
    def level(p: float) -> int:
        return int(np.searchsorted(P_EDGES, p))

    def fits(self, other: ModelDraftLength) -> bool:
        return (isinstance(other, ModelDraftLength) and other.k_max == self.k_max and other.p_min == self.p_min
                and other.target_costs is self.target_costs and other.draft_costs is self.draft_costs)

    def curves(self) -> tuple[CostCurve, ...]:
        return self.target_costs, self.draft_costs

    def step_s(self) -> float:
        """c: seconds per drafted token now. The draft's measured cost per token relative to
        the target's single step (the median of its last drafts within STALE seconds of
        decoding), times the target's speed now; before that, or once those drafts are old,
        the two calibrations' ratio; a draft curve not measured yet (its first slice to come)
        costs a target step. A fixed or pinned draft curve gives its single step as is."""
        if self.draft_costs.fixed or self.draft_costs.pinned:
            return float(self.draft_costs.cost(1)[0])
        fresh = [r for c, r in self._steps if self.target_costs.decoded_s - c <= STALE]
        if fresh:
            return middle(fresh) * self.target_costs.speed()
        if not (self.draft_costs.calibrated and self.target_costs.calibrated):
            return self.target_costs.speed()
        return self.draft_costs.calibrated_step() / self.target_costs.calibrated_step() * self.target_costs.speed()

    def best(self, k: int) -> tuple[float, int]:
        """(expected tokens per second, draft length) of the best model draft of at most k
        tokens, at the mean measured acceptance; length 0 is a plain step."""
        k = min(k, self.k_max)
        a = self.all_hits / self.all_tries
        j = np.arange(k + 1)
        expected = (1 - a ** (j + 1)) / (1 - a) if a < 1 else j + 1.0
        rate = expected / (j * self.step_s() + self.target_costs.cost(k + 1))
        best = int(np.argmax(rate))
        return float(rate[best]), best

    def prefill_s(self) -> float:
        """Seconds the draft model spends per context token it evaluates in one decode: its
        measured prefills' (the median of the last few, relative to the target's speed as
        `step_s` is), else PREFILL_PRIOR of its single step. A fixed or pinned curve: the prior."""
        if self._prefills and not (self.draft_costs.fixed or self.draft_costs.pinned):
            return middle(self._prefills) * self.target_costs.speed()
        return PREFILL_PRIOR * float(self.draft_costs.cost(1)[0])

    def prefilled(self, tokens: int, seconds: float) -> None:
        """Record a catch-up of the draft that evaluated `tokens` context tokens in `seconds`."""
        if tokens >= MIN_PREFILL and seconds > 0:
            ratio = seconds / tokens / self.target_costs.speed()
            self._prefills = (self._prefills + [ratio])[-PREFILLS:]

    def answered(self, tokens: int) -> None:
        """A request ended with an answer of `tokens` tokens."""
        self.answers = (self.answers + [tokens])[-ANSWERS:]

    def looked(self, rates: np.ndarray) -> float:
        """Record a round's rates for prompt lookup alone ([0]: a plain step's); its speed-up."""
        if not (len(rates) and rates[0] > 0):
            return 1.0
        speedup = max(float(rates.max() / rates[0]), 1.0)
        self.lookups = (self.lookups + [speedup])[-LOOKUPS:]
        return speedup

    def window(self, k: int, remaining: int, lookups: list[float] | None = None) -> int:
        """How many context tokens the draft model's prefill may evaluate for a request that
        may still emit `remaining` tokens: what drafting with it is expected to save across the
        answer (the median of the last answers' lengths, at most `remaining`) pays for PAYBACK
        times over at `prefill_s` a token. It saves only where it beats what a round would do
        without it, prompt lookup alone or a plain step (`lookups`, the request's own rounds'
        speed-ups, else the last rounds'; a plain step before any): 0 when its drafts are not
        expected to beat that at all."""
        rate, length = self.best(k)
        plain = 1.0 / float(self.target_costs.cost(1)[0])
        if length == 0 or not rate > plain:
            return 0
        answer = min(remaining, middle(self.answers)) if self.answers else remaining
        without = np.asarray(lookups or self.lookups or [1.0])         # speed-ups over a plain step
        per_token = np.maximum(1.0 / without - plain / rate, 0.0).mean() / plain
        return int(max(answer, 0) * per_token / (PAYBACK * self.prefill_s()))

    def reach(self, levels: list[int]) -> np.ndarray:
        """[k] float64: the chance that the first j+1 tokens of a model draft with these levels are accepted."""
        return np.cumprod(self.hits[levels] / self.tries[levels]) if len(levels) else np.zeros(0)

    def keep_going(self, levels: list[int], p: float) -> bool:
        """Whether to keep the draft's next token (confidence `p`) after `levels` kept ones, and
        draft on: it must clear p_min and raise the round's expected rate."""
        if p < self.p_min:
            return False
        j = len(levels)
        if j == 0:
            return True
        alpha = self.hits[levels] / self.tries[levels]
        reach = np.cumprod(alpha)                                   # P(first i+1 accepted)
        a_next = self.hits[self.level(p)] / self.tries[self.level(p)]
        t, c = self.target_costs.cost(j + 2), self.step_s()
        now = (1 + reach.sum()) / (j * c + t[j])
        more = (1 + reach.sum() + reach[-1] * a_next) / ((j + 1) * c + t[j + 1])
        return more > now

    def observe(self, levels, accepted: int, seconds: float | None = None) -> None:
        """Record a model draft with these per-token `levels`, of which `accepted` were
        committed, that took `seconds` of drafting."""
        self.hits = P_PRIOR * PRIOR_WEIGHT + DECAY * (self.hits - P_PRIOR * PRIOR_WEIGHT)
        self.tries = PRIOR_WEIGHT + DECAY * (self.tries - PRIOR_WEIGHT)
        k = len(levels)
        if k:
            reached = min(accepted + 1, k)
            np.add.at(self.tries, np.asarray(levels[:reached], dtype=np.intp), 1.0)
            np.add.at(self.hits, np.asarray(levels[:accepted], dtype=np.intp), 1.0)
            self.all_tries = PRIOR_WEIGHT + DECAY * (self.all_tries - PRIOR_WEIGHT) + reached
            self.all_hits = 0.6 * PRIOR_WEIGHT + DECAY * (self.all_hits - 0.6 * PRIOR_WEIGHT) + min(accepted, k)
            if seconds is not None and seconds > 0:
                ratio = seconds / k / self.target_costs.speed()
                self._steps = (self._steps + [(self.target_costs.decoded_s, ratio)])[-STEPS:]


def streak_after(k: int, accepted: int) -> bool:
    """Whether a round that verified k proposed tokens and accepted `accepted` of them starts a
    streak (its whole draft accepted): the next proposal's row (`DraftLength.row`)."""
    return k > 0 and accepted >= k


class Learned:
    """The draft-length controllers of earlier engines with the same models and settings, by
    role: what they measured of acceptance (numbers, never text) outlives a request and chat's
    /reset. A drafter takes a controller over when it decides the same choices on the same
    curves (`fits`), and leaves its own for the next one otherwise."""

    def __init__(self):
        self._kept: dict[str, DraftLength | ModelDraftLength] = {}

    def keep(self, role: str, fresh):
        """The controller to use for `role`: the kept one if `fresh` fits it, else `fresh`."""
        kept = self._kept.get(role)
        if kept is not None and fresh.fits(kept):
            return kept
        self._kept[role] = fresh
        return fresh
