"""Drafters: where the k proposed tokens of a round come from (docs/design.md, "Drafters").

A drafter satisfies `Drafter` (flylocal.decoding.contracts): `propose(context, k) -> Draft`,
and the hooks it needs of `observe`, `begin`, `end`, `controllers`. A drafter that holds a model
keeps its own KV cache and catches up on whatever it has not seen (`Target.reuse_prefix`), so
no separate accept step is needed.

- `none`: no draft; every round is a plain step.
- `pld` (flylocal.decoding.drafters.pld): prompt lookup, under draft-length control
  (flylocal.decoding.drafters.length) unless --k is given.
- `model` and `mla` (flylocal.decoding.drafters.model, .mla): a draft model, MLA sped up by
  prompt lookup; they choose their own lengths. Through text (flylocal.decoding.drafters.text)
  when the draft's vocabulary is not the target's.
"""

from __future__ import annotations

import numpy as np

from flylocal.decoding.adaptive import Learned
from flylocal.decoding.contracts import NO_DRAFT, Draft, Drafter, Target


class NoDraft(Drafter):
    """Every round is a plain autoregressive step."""

    name = "none"
    drafts = False

    def propose(self, context: np.ndarray, k: int) -> Draft:
        return NO_DRAFT


def make_drafter(name: str, target: Target, draft_model: Target | None = None, *, pld_ngram: int = 4,
                 pld_tokens: int | None = None, k_max: int = 8, adaptive: bool = False, p_min: float = 0.0,
                 corpus=None, recalibrate: bool = False, through_text: bool = False,
                 learned: Learned | None = None, calibration_wait: float | None = None,
                 window: int | None = None) -> Drafter:
    """Build a drafter by name. With `adaptive`, draft lengths follow measured cost and
    acceptance on the target's cost curve: prompt lookup's under LengthControl, and the model
    drafters weigh the draft model against prompt lookup alone each round
    (flylocal.decoding.drafters.model). `learned` holds the controllers of earlier engines with
    the same settings, to take over. With `through_text` a model drafter drafts in the draft
    model's own vocabulary and its drafts reach the target through their text
    (flylocal.decoding.drafters.text). `calibration_wait`: a draft model's cost curve is measured
    in slices of at most this many seconds, one before each request, as the target's is. `window`:
    a draft model reads the context's first tokens and its last `window` (None: all of it)."""
    from flylocal.decoding.drafters.length import LengthControl
    from flylocal.decoding.drafters.mla import MLADrafter
    from flylocal.decoding.drafters.model import ModelDrafter
    from flylocal.decoding.drafters.pld import PromptLookup, level_prior
    from flylocal.decoding.drafters.text import TextBridge, ThroughText

    learned = learned if learned is not None else Learned()
    if name == "none":
        return NoDraft()
    if name == "pld":
        lookup = PromptLookup(target.eog_mask, max_ngram=pld_ngram, max_tokens=pld_tokens, corpus=corpus)
        if not adaptive:
            return lookup
        return LengthControl(lookup, level_prior(pld_ngram), k_max, target.costs, learned)
    if draft_model is None:
        raise ValueError(f"drafter {name} needs a draft model (--draft)")
    if name not in ("model", "mla"):
        raise ValueError(f"unknown drafter {name}")
    # Through text the drafter lives in the draft's vocabulary: its own end-of-generation ids,
    # every id it has, and no lookup corpus (that holds target ids).
    vocab = (draft_model.n_vocab, draft_model.eog_mask) if through_text else (target.n_vocab, target.eog_mask)
    common = dict(k_max=k_max, p_min=p_min, target_costs=target.costs if adaptive else None,
                  corpus=None if through_text else corpus, recalibrate=recalibrate, max_ngram=pld_ngram,
                  learned=learned, wait=calibration_wait, window=window)
    if name == "model":
        drafter = ModelDrafter(draft_model, *vocab, **common)
    else:
        drafter = MLADrafter(draft_model, *vocab, max_tokens=pld_tokens or 6, adaptive_lookup=pld_tokens is None,
                             **common)
    return ThroughText(drafter, TextBridge(target, draft_model)) if through_text else drafter


DRAFTERS = ("none", "pld", "model", "mla")
