"""Drafters: where the k proposed tokens of a round come from (docs/design.md, "Drafters").

Every drafter has one method,

    propose(context, k) -> Draft

where `context` [n] int32 is the prompt plus everything committed so far (its last token is
not yet in the target's cache) and `k` is the most tokens the round may verify. A drafter
that holds a model keeps its own KV cache and catches up on whatever it has not seen
(`Runtime.reuse_prefix`), so no separate accept step is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray      # [k'] int32, k' <= k
    level: int = 0          # confidence bucket for draft-length control (PLD: n-gram size)
    source: str = ""        # "pld" or "model" where a drafter chose between them this round
    levels: list | None = None    # a model draft: each token's confidence level
    seconds: float | None = None  # a model draft: the time it took
    text: str | None = None       # a draft through text: the draft model's text it came from


class Drafter(Protocol):
    name: str
    adaptive: bool          # whether the engine may shorten its drafts from measured cost

    def propose(self, context: np.ndarray, k: int) -> Draft: ...


def stop_at_eog(tokens: np.ndarray, eog: np.ndarray) -> np.ndarray:
    """Cut a draft after its first end-of-generation token (kept: it can be accepted)."""
    hits = np.flatnonzero(eog[tokens])
    return tokens[: hits[0] + 1] if hits.size else tokens


class NoDraft:
    """Every round is a plain autoregressive step."""

    name = "none"
    adaptive = False

    def propose(self, context: np.ndarray, k: int) -> Draft:
        return Draft(EMPTY)


def make_drafter(name: str, target, draft_model=None, *, pld_ngram: int = 4, pld_tokens: int | None = None,
                 k_max: int = 8, adaptive: bool = False, p_min: float = 0.0, corpus=None,
                 recalibrate: bool = False, through_text: bool = False):
    """Build a drafter by name. `target` and `draft_model` are Runtimes. With `adaptive`, the
    model drafters weigh the draft model against prompt lookup alone each round, on the
    target's cost curve (flylocal.decoding.drafters.model). With `through_text` a model drafter drafts
    in the draft model's own vocabulary and its drafts reach the target through their text
    (flylocal.decoding.drafters.text)."""
    from flylocal.decoding.drafters.mla import MLADrafter
    from flylocal.decoding.drafters.model import ModelDrafter
    from flylocal.decoding.drafters.pld import PromptLookup
    from flylocal.decoding.drafters.text import TextBridge, ThroughText

    if name == "none":
        return NoDraft()
    if name == "pld":
        return PromptLookup(target.eog_mask, max_ngram=pld_ngram, max_tokens=pld_tokens, corpus=corpus)
    if draft_model is None:
        raise ValueError(f"drafter {name} needs a draft model (--draft)")
    if name not in ("model", "mla"):
        raise ValueError(f"unknown drafter {name}")
    # Through text the drafter lives in the draft's vocabulary: its own end-of-generation ids,
    # every id it has, and no lookup corpus (that holds target ids).
    vocab = (draft_model.n_vocab, draft_model.eog_mask) if through_text else (target.n_vocab, target.eog_mask)
    common = dict(k_max=k_max, p_min=p_min, target_costs=target.costs if adaptive else None,
                  corpus=None if through_text else corpus, recalibrate=recalibrate, max_ngram=pld_ngram)
    if name == "model":
        drafter = ModelDrafter(draft_model, *vocab, **common)
    else:
        drafter = MLADrafter(draft_model, *vocab, max_tokens=pld_tokens or 6, adaptive_lookup=pld_tokens is None,
                             **common)
    return ThroughText(drafter, TextBridge(target, draft_model)) if through_text else drafter


DRAFTERS = ("none", "pld", "model", "mla")
