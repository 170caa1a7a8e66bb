"""Sampling at temperature > 0, lossless under speculation (docs/design.md, "Temperature > 0").

The target's distribution at a draft position is the *processed* one, in the order of
llama.cpp's own sampler chain: repeat penalty over the tokens committed before that position,
then top-k, top-p and min-p on the untempered distribution, then temperature over the tokens
that are left. With the same settings flylocal and llama.cpp sample from the same q. Drafts stay greedy (deterministic): a greedy draft is the most
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

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0: greedy
    top_k: int = 40               # 0: off
    top_p: float = 0.95           # 1: off
    min_p: float = 0.05           # 0: off
    repeat_penalty: float = 1.0   # 1: off
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def processed_probs(z: np.ndarray, history: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids [c] int64, their probabilities [c] float64), most likely first, after
    repeat penalty -> top-k -> top-p -> min-p -> temperature (llama.cpp's order).
    z [n_vocab] float32: raw logits of one position; history: the committed ids before it."""
    z = z.astype(np.float64)
    if p.repeat_penalty != 1.0 and len(history):
        seen = np.unique(history[-p.repeat_last_n:])
        vals = z[seen]
        z[seen] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    if 0 < p.top_k < len(z):
        ids = np.argpartition(z, len(z) - p.top_k)[len(z) - p.top_k:]
    else:
        ids = np.arange(len(z))
    ids = ids[np.argsort(-z[ids], kind="stable")]
    logits = z[ids]                                       # [c] untempered, descending
    if p.top_p < 1.0:
        probs = np.exp(logits - logits[0])
        probs /= probs.sum()
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
    for j in range(k + 1):
        ids, probs = processed_probs(logits[j], np.concatenate([committed, draft[:j]]), p)
        cdf = np.cumsum(probs)                                          # [c], cdf[-1] == 1 up to rounding
        out[j] = ids[min(int(np.searchsorted(cdf, noise[j] * cdf[-1], side="right")), len(ids) - 1)]
    return out
