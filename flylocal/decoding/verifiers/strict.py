"""Strict verification (exact match): the lossless baseline (docs/verifiers.md, "Strict").

L is the longest prefix where the draft equals the target's greedy choice. With a
batch-invariant build the output is token for token the target's plain greedy decoding.
"""

from __future__ import annotations

import numpy as np

from flylocal.decoding.contracts import Decision, Verifier, Window
from flylocal.decoding.verifiers.base import native_prefix


def strict(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray) -> Decision:
    """draft [k] int32, target_argmax [k+1] int32, logits [k+1, n_vocab] float32 (unused)."""
    return Decision(accepted=native_prefix(draft, target_argmax))


class Strict(Verifier):
    name = "strict"

    def decide(self, draft, target_argmax, logits, window=None, start=0) -> tuple[Decision, Window | None]:
        return Decision(accepted=native_prefix(draft, target_argmax)), window
