"""The per-round trace (docs/verifiers.md, "Trace and stats"): one JSON object per round, from
which every decision can be re-checked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flylocal.decoding.verifiers.base import regrets

if TYPE_CHECKING:
    from flylocal.decoding.round import Round


def trace_row(r: Round, grammar: bool = False, held: int = 0) -> dict:
    """The trace row of a finished round; `grammar`: the round ran under one (its forced
    tokens are recorded); `held`: output tokens held back after it (a window across rounds
    is open)."""
    k, decision = len(r.draft), r.decision
    entropy = decision.entropy
    row = {
        "round": r.index,
        "n_past": int(r.n_past),
        "draft": [int(t) for t in r.draft],
        "target_argmax": [int(t) for t in r.target],
        "entropy": [None if entropy is None or np.isnan(e) else float(e) for e in
                    (entropy if entropy is not None else [np.nan] * k)],
        "regret": [float(x) for x in regrets(r.draft, r.target, r.logits)],
        "accepted": int(decision.accepted),
        "loose": [int(j) for j in decision.loose],
        "emitted": [int(t) for t in r.emitted],
    }
    if decision.provisional is not None:
        row["provisional"] = int(decision.provisional)   # accepted provisionally: its window is open
    if decision.closed:
        row["closed"] = decision.closed                  # the window open before: kept or retracted
    if decision.window is not None and held:               # (the end may have taken the window back)
        row["window"] = list(decision.window)              # (native matches, empty rounds) since its token
    if r.retracted:
        row["retracted"] = r.retracted                     # tokens taken back, the provisional one first,
        row["recovered"] = r.recovered[0]              # and the target's token put in its place
    if held:
        row["held"] = held
    if decision.budget_spent is not None:
        row["budget_spent"], row["budget_left"] = decision.budget_spent, decision.budget_left
    if grammar:
        row["forced"] = r.forced               # the draft's first tokens the grammar forced
    if r.proposal.text is not None:
        row["draft_text"] = r.proposal.text    # a draft through text: the text it came from
    if r.threads is not None:
        row["threads"] = r.threads             # the CPU threads the target's decode ran on
    return row
