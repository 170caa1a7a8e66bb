"""Sampling at temperature > 0, lossless under speculation (docs/verifiers.md, "Temperature > 0").

The target's distribution at a draft position is the *processed* one, in the order of
llama.cpp's own sampler chain: logit bias, then the penalties (repeat, frequency, presence)
over the tokens committed before that position, then top-k, top-p and min-p on the untempered
distribution, then temperature over the tokens that are left. Bias and penalties apply at
temperature 0 too: the target's greedy token is the argmax of the adjusted logits. With the same settings flylocal and llama.cpp sample from the same q. Drafts stay greedy (deterministic): a greedy draft is the most
likely proposal under the draft model, and a deterministic draft needs no draft
probabilities. The target's token at each position, a[j], is drawn from q_j by inverse CDF at
that position's own noise u = position_noise(seed, position), and a draft token is accepted
when it equals a[j]: with probability q_j(d[j]), as speculative sampling requires, and the
committed text is exactly plain sampling's, with the same seed token for token, whatever was
drafted and however long the drafts were. Every verifier then runs unchanged on the a[j]
(strict: L is the first j with d[j] != a[j]). FLy decides its native matches on them; ASD
keeps its regrets on raw logits. FLy and ASD remain lossy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


# A temperature below this is greedy decoding (docs/verifiers.md, "Temperature > 0"). Two float32
# logits of magnitude 1 or more that differ at all differ by at least 1.19e-7, so below 1e-10
# the runner-up's weight is under e**-1190 of the top token's, which float64 holds as 0: the
# sample is the argmax whatever the noise, and the division no longer overflows (1e-320 did).
GREEDY_BELOW = 1e-10


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 (below GREEDY_BELOW): greedy
    top_k: int = 40               # 0: off
    top_p: float = 0.95           # 1: off
    min_p: float = 0.05           # 0: off
    repeat_penalty: float = 1.0   # 1: off
    frequency_penalty: float = 0.0   # subtracted once per occurrence in the last repeat_last_n ids
    presence_penalty: float = 0.0    # subtracted once from each id among them
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), first of all
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """Whether a penalty changes the logits of the ids seen before a position."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts(self) -> bool:
        """Whether logit bias or a penalty changes the logits before anything is chosen."""
        return bool(self.logit_bias) or self.penalizes

    @functools.cached_property
    def lowered_only(self) -> frozenset[int] | None:
        """The ids a bias lowers, when a bias only lowers and no penalty applies; None otherwise.
        Read every round at temperature 0, so made once."""
        if self.penalizes or any(bias > 0 for _, bias in self.logit_bias):
            return None
        return frozenset(token for token, _ in self.logit_bias)


def adjust(z: np.ndarray, history: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The logits of one position [n_vocab] float64 (a copy) after logit bias, then the
    penalties over the last repeat_last_n ids of `history` (the committed ids before it), as
    llama.cpp's penalties sampler applies them to an id seen c times: the repeat penalty divides
    a positive logit and multiplies a negative one, then c * frequency + presence is subtracted."""
    z = z.astype(np.float64)
    for token, bias in p.logit_bias:
        z[token] += bias
    if len(history) and p.repeat_last_n > 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                                 or p.presence_penalty != 0.0):
        seen, counts = np.unique(history[-p.repeat_last_n:], return_counts=True)
        vals = z[seen]
        if p.repeat_penalty != 1.0:
            vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        z[seen] = vals - counts * p.frequency_penalty - p.presence_penalty
    return z


def target_argmax(draft: np.ndarray, logits: np.ndarray, committed: np.ndarray, p: SamplingParams) -> np.ndarray:
    """a [k+1] int32 at temperature 0: each row's argmax, of its adjusted logits when a bias or a
    penalty applies (row j's history is the committed ids and the draft before it)."""
    a = logits.argmax(axis=1).astype(np.int32)
    if not p.adjusts:
        return a
    # A bias that only lowers tokens none of the rows chose changes no argmax. (A set, not
    # np.isin: right after a decode np.isin took 128 µs, against 14 µs called again.)
    lowered = p.lowered_only
    if lowered is not None and lowered.isdisjoint(a.tolist()):
        return a
    return np.array([int(adjust(logits[j], np.concatenate([committed, draft[:j]]), p).argmax())
                     for j in range(len(draft) + 1)], dtype=np.int32)


def token_logprobs(tokens: np.ndarray, logits: np.ndarray, committed: np.ndarray, p: SamplingParams,
                   top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For each token [m] that row j of `logits` [>= m, n_vocab] chose (row j follows `committed`
    and tokens[:j]): its log-probability under the target's distribution there (the softmax of
    the adjusted logits over the whole vocabulary, untempered), and the `top` most likely ids
    with theirs, most likely first."""
    out = []
    for j, token in enumerate(tokens):
        z = adjust(logits[j], np.concatenate([committed, tokens[:j]]), p) if p.adjusts \
            else logits[j].astype(np.float64)
        peak = z.max()
        lse = peak + np.log(np.exp(z - peak).sum())
        best = ()
        if top > 0:
            ids = np.argpartition(-z, top - 1)[:top] if top < len(z) else np.arange(len(z))
            ids = ids[np.argsort(-z[ids], kind="stable")]
            best = tuple((int(i), float(z[i] - lse)) for i in ids if z[i] > -np.inf)   # none a grammar forbids
        out.append((float(z[int(token)] - lse), best))
    return out


TOP_P_FIRST = 1024      # without top-k, top-p's set is looked for among this many first


def _top(z: np.ndarray, m: int) -> np.ndarray:
    """The ids of the m largest of z, in id order (whichever of a tie at the m-th value are
    the lowest ids, as a stable sort of the whole would take them)."""
    n = len(z)
    if m >= n:
        return np.arange(n)
    cut = np.partition(z, n - m)[n - m]                   # the m-th largest value
    above = np.flatnonzero(z > cut)
    tied = np.flatnonzero(z == cut)[: m - len(above)]
    return np.sort(np.concatenate([above, tied]))


def processed_probs(z: np.ndarray, history: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids [c] int64, their probabilities [c] float64), most likely first, after
    logit bias -> penalties -> top-k -> top-p -> min-p -> temperature (llama.cpp's order).
    z [n_vocab] float32: raw logits of one position; history: the committed ids before it."""
    z = adjust(z, history, p) if p.adjusts else z.astype(np.float64)
    n = len(z)
    mass = None                     # top-p's normaliser: all of the vocabulary's (None: the candidates')
    if 0 < p.top_k < n:
        ids = np.argpartition(z, n - p.top_k)[n - p.top_k:]
    elif p.min_p > 0.0 or p.top_p < 1.0:
        # No top-k: sorting the whole vocabulary costs milliseconds a row (tens on 262,144
        # tokens). What min-p keeps, and top-p's share of the whole mass, are both a prefix of
        # the sorted order: only that prefix is sorted.
        peak = z.max()
        ids = np.flatnonzero(z >= peak + np.log(p.min_p)) if p.min_p > 0.0 else np.arange(n)
        if p.top_p < 1.0:
            weights = np.exp(z - peak)
            mass = weights.sum()
            if len(ids) > TOP_P_FIRST:                    # one try, then the whole sort
                top = _top(z, TOP_P_FIRST)
                if weights[top].sum() >= p.top_p * mass * (1 + 1e-9):  # clear of rounding
                    ids = top
    else:
        ids = np.arange(n)
    ids = ids[np.argsort(-z[ids], kind="stable")]
    logits = z[ids]                                       # [c] untempered, descending
    if logits[-1] == -np.inf:                             # tokens a grammar forbids are no candidates
        keep = logits > -np.inf
        ids, logits = ids[keep], logits[keep]
    if p.top_p < 1.0:
        probs = np.exp(logits - logits[0])
        probs /= probs.sum() if mass is None else mass
        keep = min(int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1, len(ids))
        ids, logits = ids[:keep], logits[:keep]
    if p.min_p > 0.0:
        keep = logits >= logits[0] + np.log(p.min_p)      # p >= min_p * p_max
        ids, logits = ids[keep], logits[keep]
    tempered = logits / p.temperature
    probs = np.exp(tempered - tempered[0])
    return ids, probs / probs.sum()


# SplitMix64: a counter-based generator. The noise of a position is the generator's output at
# that position's counter, in a stream that the seed picks: it depends on (seed, position) only.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def position_noise(seed: int, positions: np.ndarray) -> np.ndarray:
    """u [m] float64 in [0, 1): the noise of each absolute context position, a function of the
    seed and the position alone, never of the round that decides the position."""
    pos = np.asarray(positions, dtype=np.uint64)                        # [m]
    stream = _mix(np.full(pos.shape, seed & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64) + _GAMMA)
    z = _mix(stream + (pos + np.uint64(1)) * _GAMMA)                    # uint64 arithmetic wraps
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_targets(draft: np.ndarray, logits: np.ndarray, committed: np.ndarray, p: SamplingParams,
                   noise: np.ndarray) -> np.ndarray:
    """a [k+1] int32: at each position j the token of q_j at the position's noise u_j
    ([k+1] in [0, 1), `position_noise`), by inverse CDF over q_j's candidates, most likely
    first. Each a[j] is an exact sample from q_j given the draft prefix before it; a draft token
    is accepted when it equals a[j], which happens with probability q_j(d[j]). Plain sampling
    with the same seed draws the same a[j] at the same position, so strict's output is plain
    sampling's, token for token, whatever was drafted."""
    k = len(draft)
    out = np.empty(k + 1, dtype=np.int32)
    unfiltered = not 0 < p.top_k < logits.shape[1] and p.top_p >= 1.0 and p.min_p <= 0.0
    for j in range(k + 1):
        history = np.concatenate([committed, draft[:j]])
        if unfiltered:        # q is the whole vocabulary: look among its most likely first
            token = _sample_among_top(adjust(logits[j], history, p) if p.adjusts else logits[j].astype(np.float64),
                                      p.temperature, float(noise[j]))
            if token is not None:
                out[j] = token
                continue
        ids, probs = processed_probs(logits[j], history, p)
        cdf = np.cumsum(probs)                                          # [c], cdf[-1] == 1 up to rounding
        out[j] = ids[min(int(np.searchsorted(cdf, noise[j] * cdf[-1], side="right")), len(ids) - 1)]
    return out


CLEAR = 1e-9            # of the whole mass: how far u must lie from a boundary of the CDF


def _sample_among_top(z: np.ndarray, temperature: float, u: float) -> int | None:
    """The inverse-CDF sample at u of softmax(z / temperature) over the whole vocabulary, most
    likely first (ties by id), found among the TOP_P_FIRST most likely ids without sorting the
    rest: the same token as the whole sort gives, or None where u falls past those ids or
    within CLEAR of a boundary (where the two sums' rounding could part)."""
    if len(z) <= TOP_P_FIRST:
        return None
    t = z / temperature
    weights = np.exp(t - t.max())
    mass = weights.sum()
    target = u * mass
    top = _top(z, TOP_P_FIRST)
    top = top[np.argsort(-z[top], kind="stable")]
    cum = np.cumsum(weights[top])
    i = int(np.searchsorted(cum, target, side="right"))
    clear = CLEAR * mass
    if i >= len(top) or cum[i] - target <= clear or (i > 0 and target - cum[i - 1] <= clear):
        return None
    return int(top[i])
