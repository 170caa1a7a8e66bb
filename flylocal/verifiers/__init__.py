"""Verifiers: pure numpy functions that decide how much of a draft to commit.

A verifier is called once per round as

    decision = verifier(draft, target_argmax, logits)

with `draft` [k] int32, `target_argmax` [k+1] int32 (the target's greedy choice at each draft
position and at the bonus position) and `logits` [k+1, n_vocab] float32 (the target's raw
logits for exactly those rows). It returns a Decision. Verifiers know nothing of llama.cpp;
a verifier with state across rounds (a ledger) is a small object with `__call__` and `reset()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Decision:
    accepted: int                              # L: committed draft prefix, 0 <= L <= k
    loose: tuple[int, ...] = ()                # positions j < L with d[j] != a[j], accepted anyway
    entropy: np.ndarray | None = None          # [k] float64, NaN where not computed
    trace: dict = field(default_factory=dict)  # verifier-specific trace fields (SPEC.md)


Verifier = Callable[[np.ndarray, np.ndarray, np.ndarray], Decision]


def native_prefix(draft: np.ndarray, target_argmax: np.ndarray) -> int:
    """Length of the longest prefix with d[j] == a[j]."""
    k = len(draft)
    mismatch = np.flatnonzero(draft != target_argmax[:k])
    return int(mismatch[0]) if mismatch.size else k


def make_verifier(name: str) -> Verifier:
    from flylocal.verifiers.strict import strict

    verifiers = {"strict": lambda: strict}
    return verifiers[name]()


VERIFIERS = ("strict",)
