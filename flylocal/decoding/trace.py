"""The per-round trace (docs/verifiers.md, "Trace and stats"): one JSON object per round, from
which every decision can be re-checked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flylocal.decoding.verifiers.base import regrets

if TYPE_CHECKING:
    from flylocal.decoding.contracts import Window
    from flylocal.decoding.round import Round


def trace_row(r: Round, grammar: bool = False, window: Window | None = None) -> dict:
    """The trace row of a finished round; `grammar`: the round ran under one (its forced
    tokens are recorded); `window`: the request's window across rounds open after it (FLy's)."""
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
    start = r.n_past + 1                                   # the context position of draft token 0
    if r.window is not None and r.window.at >= start:
        row["provisional"] = r.window.at - start           # a pending token this round's decision accepted
    if decision.verdict:
        row["closed"] = decision.verdict                   # the window open before: kept or retracted
    pending = len(window.pending) if window is not None else 0
    if pending:                                            # (the end may have taken the window back)
        row["window"] = [window.matches, window.idle]      # (native matches, empty rounds) since its token
    if r.rejected is not None:
        row["retracted"] = r.retracted                     # tokens taken back, the pending one first,
        row["recovered"] = r.rejected.recovered            # and the target's token put in its place
    if pending:
        row["held"] = pending                              # output tokens pending after the round
    if decision.budget_spent is not None:
        row["budget_spent"], row["budget_left"] = decision.budget_spent, decision.budget_left
    if grammar:
        row["forced"] = r.forced               # the draft's first tokens the grammar forced
    if r.proposal.text is not None:
        row["draft_text"] = r.proposal.text    # a draft through text: the text it came from
    if r.threads is not None:
        row["threads"] = r.threads             # the CPU threads the target's decode ran on
    return row
