"""The round arithmetic every verifier shares (docs/design.md, "Words")."""

from __future__ import annotations

import numpy as np


def native_prefix(draft: np.ndarray, target_argmax: np.ndarray) -> int:
    """Length of the longest prefix with d[j] == a[j]."""
    k = len(draft)
    if not k:
        return 0
    mismatch = np.flatnonzero(draft != target_argmax[:k])
    return int(mismatch[0]) if mismatch.size else k


def regrets(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """r [k] float64: the target's raw-logit gap between its greedy choice and the draft token,
    r_j = max z_j - z_j(d[j]) (= z_j(a[j]) - z_j(d[j]) at temperature 0); 0 at native matches.
    Defined on raw logits at every temperature."""
    k = len(draft)
    rows = np.arange(k)
    gap = logits[:k].max(axis=1).astype(np.float64) - logits[rows, draft].astype(np.float64)
    return np.where(draft == target_argmax[:k], 0.0, gap)


def emitted_tokens(draft: np.ndarray, target_argmax: np.ndarray, accepted: int) -> np.ndarray:
    """d[0:L] + [a[L]]: the committed draft prefix (loose tokens included, as drafted) and the
    target's correction (L < k) or bonus (L == k) token. [L+1] int32."""
    out = np.empty(accepted + 1, dtype=np.int32)
    out[:accepted] = draft[:accepted]
    out[accepted] = target_argmax[accepted]
    return out
