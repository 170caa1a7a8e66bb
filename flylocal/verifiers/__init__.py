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


def regrets(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """r [k] float64: the target's raw-logit gap between its own choice and the draft token,
    r_j = z_j(a[j]) - z_j(d[j]); 0 at native matches."""
    k = len(draft)
    rows = np.arange(k)
    return logits[rows, target_argmax[:k]].astype(np.float64) - logits[rows, draft].astype(np.float64)


def emitted_tokens(draft: np.ndarray, target_argmax: np.ndarray, accepted: int) -> np.ndarray:
    """d[0:L] + [a[L]]: the committed draft prefix (loose tokens included, as drafted) and the
    target's correction (L < k) or bonus (L == k) token. [L+1] int32."""
    return np.append(draft[:accepted], target_argmax[accepted]).astype(np.int32)


@dataclass(frozen=True)
class VerifierConfig:
    fly_window: int = 6
    fly_entropy: float = 0.3
    fly_topk: int = 3
    fly_use_window: bool = True
    asd_gate: float = 0.5
    asd_cap: int = 2
    asd_budget: float = 16.0


def make_verifier(name: str, config: VerifierConfig = VerifierConfig()) -> Verifier:
    from flylocal.verifiers.asd import Asd, AsdParams
    from flylocal.verifiers.fly import Fly, FlyParams
    from flylocal.verifiers.strict import strict

    if name == "strict":
        return strict
    if name == "fly":
        return Fly(FlyParams(window=config.fly_window, entropy=config.fly_entropy,
                             topk=config.fly_topk, use_window=config.fly_use_window))
    if name == "asd":
        return Asd(AsdParams(gate=config.asd_gate, cap=config.asd_cap, budget=config.asd_budget))
    raise ValueError(f"unknown verifier {name}")


VERIFIERS = ("fly", "strict", "asd")
LOSSLESS = ("strict",)
