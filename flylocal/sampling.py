"""Sampling at temperature > 0, lossless under speculation (docs/design.md, "Temperature > 0").

The target's distribution at a draft position is the *processed* one, in the order of
llama.cpp's own sampler chain: repeat penalty over the tokens committed before that position,
then top-k, top-p and min-p on the untempered distribution, then temperature over the tokens
that are left. With the same settings flylocal and llama.cpp sample from the same q. Drafts stay greedy (deterministic): a greedy draft is the most
likely proposal under the draft model, and a deterministic draft needs no draft
probabilities, so the rule is the simple one:

    accept d[j] with probability q_j(d[j]); otherwise sample from q_j with d[j] removed,
    renormalised.

That makes the token at each position, a[j], an exact sample from q_j, so the committed text
has exactly the distribution of plain sampling. `sample_targets` produces these a[j]; every
verifier then runs unchanged on them (strict: L is the first j with d[j] != a[j]). FLy decides
its native matches on them; ASD keeps its regrets on raw logits. FLy and ASD remain lossy.
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


def sample_targets(draft: np.ndarray, logits: np.ndarray, committed: np.ndarray, p: SamplingParams,
                   rng: np.random.Generator) -> np.ndarray:
    """a [k+1] int32: at each draft position, d[j] with probability q_j(d[j]), otherwise a
    sample from q_j without d[j]; at the bonus position a plain sample. Each a[j] is an exact
    sample from q_j given the draft prefix before it."""
    k = len(draft)
    out = np.full(k + 1, -1, dtype=np.int32)
    for j in range(k + 1):
        ids, probs = processed_probs(logits[j], np.concatenate([committed, draft[:j]]), p)
        if j < k:
            hit = np.flatnonzero(ids == draft[j])
            q_d = float(probs[hit[0]]) if hit.size else 0.0
            if rng.random() < q_d:
                out[j] = draft[j]
                continue
            if hit.size:
                probs = probs.copy()
                probs[hit[0]] = 0.0
                probs /= probs.sum()
        out[j] = ids[rng.choice(len(ids), p=probs)]
    return out
