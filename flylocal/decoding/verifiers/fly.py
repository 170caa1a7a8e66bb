"""FLy: entropy gate + deferred window, training-free loose verification (docs/design.md, "FLy").

A draft token the target would not have chosen is still accepted ("loose") when
1. the target was unsure at that position: its top-m entropy h_j >= theta (the gate), and
2. the target did not "self-correct" afterwards: the W-1 draft tokens after it all match
   natively, and j + W < k: the window j .. j+W-1 ends before the draft's last position.
Looseness is decided from native matches only, so a mismatch inside a window spoils it.

Entropy costs one log-sum-exp over the vocabulary, and is computed only at mismatches that
can still decide the outcome: the window is checked first, and scanning stops at the first
rejected mismatch. Nothing is computed over all k x V logits.

FLy changes the output relative to the target's greedy decoding, by design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flylocal.decoding.contracts import Decision, Verifier


@dataclass(frozen=True)
class FlyParams:
    window: int = 6            # W: the mismatch plus W-1 native matches after it
    entropy: float = 0.3       # theta: gate threshold on the top-m entropy (nats)
    topk: int = 3              # m: how many of the largest probabilities the entropy sums
    use_window: bool = True    # False: the no-window ablation, accept a gated-open mismatch at once


def topk_entropy(z: np.ndarray, m: int) -> float:
    """-sum over the m largest p of p log p, with p = softmax(z) over the full vocabulary.
    z [n_vocab] float32: raw logits of one position."""
    zmax = float(z.max())
    lse = zmax + math.log(float(np.exp(z - zmax, dtype=np.float32).sum(dtype=np.float64)))
    m = min(m, len(z))
    top = np.partition(z, len(z) - m)[len(z) - m:].astype(np.float64)   # [m]
    logp = top[top > -np.inf] - lse                                      # a grammar may forbid all but a few
    return float(-(np.exp(logp) * logp).sum())


def fly(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray, params: FlyParams = FlyParams()) -> Decision:
    """draft [k] int32, target_argmax [k+1] int32, logits [k+1, n_vocab] float32."""
    k = len(draft)
    native = draft == target_argmax[:k]                    # [k] bool
    entropy = np.full(k, np.nan)                           # [k] float64
    loose = []
    W = params.window
    j = 0
    while True:
        rest = np.flatnonzero(~native[j:])
        if not rest.size:
            accepted = k
            break
        j += int(rest[0])                                  # the next native mismatch
        if params.use_window and (j + W >= k or not native[j + 1 : j + W].all()):
            accepted = j                                   # window unobservable, or spoiled
            break
        entropy[j] = topk_entropy(logits[j], params.topk)
        if entropy[j] < params.entropy:
            accepted = j                                   # the target is confident: keep its token
            break
        loose.append(j)
        j += 1
    return Decision(accepted=accepted, loose=tuple(loose), entropy=entropy)


class Fly(Verifier):
    """FLy with its parameters (no state across rounds)."""

    name = "fly"

    def __init__(self, params: FlyParams = FlyParams()):
        self.params = params

    def decide(self, draft, target_argmax, logits) -> Decision:
        return fly(draft, target_argmax, logits, self.params)
