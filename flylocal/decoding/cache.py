"""The KV-cache bookkeeping that needs no llama.cpp: which cached prefix a new request keeps
(docs/design.md, "The round"). The runtime and the tests' in-memory target share it."""

from __future__ import annotations

import numpy as np


def reusable_prefix(cached: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading `tokens` [n] the cache, holding `cached` [n_past], can keep: their
    common prefix, leaving at least the last of `tokens` to be decoded (its logits are needed)."""
    limit = min(len(cached), len(tokens) - 1)
    if limit <= 0:
        return 0
    diff = np.flatnonzero(cached[:limit] != tokens[:limit])
    return int(diff[0]) if diff.size else limit
