"""Counters and derived figures of a generation, in the words of docs/design.md ("Words", "Trace and stats")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from flylocal.decoding.contracts import ACCEPT

if TYPE_CHECKING:
    from flylocal.decoding.round import Round


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_reused: int = 0       # prompt tokens already in the target's cache
    prompt_evaluated: int = 0    # prompt tokens decoded by this request
    rounds: int = 0
    drafted: int = 0             # draft tokens sent to the target
    accepted: int = 0            # draft tokens committed (native matches and loose) that stayed
    loose: int = 0               # committed draft tokens that did not match natively
    mismatches: int = 0          # native mismatches seen: loose ones plus each round's rejected one
                                 # (and pending ones, kept or not)
    retractions: int = 0         # FLy across rounds: pending tokens taken back (a window's REJECT)
    retracted: int = 0           # tokens taken back with them (each pending one and what followed it)
    emitted: int = 0             # committed tokens: accepted + one correction/bonus per round, less
                                 # those taken back, plus each retracted token's recovered token
    emitted_in_rounds: int = 0   # each round's emitted tokens where it emitted them: its committed
                                 # ones and a retracted token's recovered token, whatever a later round
                                 # took back (at least 1 a round: tau's numerator)
    first_tokens: int = 0        # of those, the first round's: its decode also evaluated the prompt's tail
    forced: int = 0              # under a grammar: accepted draft tokens the grammar forced
    budget_spent: float | None = None   # ASD: the ledger s after this request
    budget_left: float | None = None    # ASD: B - s
    prefill_s: float = 0.0       # from the start to the end of the first round's decode (the first token)
    wall_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    mask_s: float = 0.0          # under a grammar: computing and applying its masks (part of verify_s)
    stop: str = ""               # "eog", "max_tokens", "context" or "interrupted"
    cost_curve: dict | None = None   # the target's cost curve (CostCurve.report): its "source" ("cache",
                                     # read from disk; "measured" now; "reused", known in this process),
                                     # "state", shape, single step and exploration; None when not used
    draft_context: dict | None = None   # what a draft model was given of the context (its prefill):
                                        # "chosen" ("full", "window" or "lookup": prompt lookup alone),
                                        # "tokens" it held, "evaluated", "pays_for", "seconds"; None: no model
    calibrating: bool = False    # a cost curve of its models was still being measured, a slice before
                                 # each request (docs/design.md, "Cost model"), when it ended

    def add(self, r: Round) -> None:
        """Count a finished round."""
        decision, m, k = r.decision, r.committed, len(r.draft)
        self.rounds += 1
        self.drafted += k
        self.accepted += r.accepted - (r.rejected.accepted if r.rejected is not None else 0)   # and those taken back
        self.forced += min(r.forced, r.accepted)
        loose = sum(1 for j in decision.loose if j < m)
        self.loose += loose + (decision.verdict == ACCEPT)     # a window's pending token, kept
        seen = min(decision.accepted + 1, k)                  # the positions the decision judged
        self.mismatches += int(np.count_nonzero(r.draft[:seen] != r.target[:seen])) if seen else 0
        if decision.budget_spent is not None:
            self.budget_spent, self.budget_left = decision.budget_spent, decision.budget_left
        self.retractions += r.rejected is not None
        self.retracted += r.retracted
        self.emitted += r.added
        self.emitted_in_rounds += r.committed + (r.rejected is not None)
        if self.rounds == 1:
            self.first_tokens = r.added
        self.draft_s += r.draft_s
        self.target_s += r.score_s + r.commit_s
        self.verify_s += r.mask_s + r.decide_s
        self.mask_s += r.mask_s

    @property
    def mean_accepted_length(self) -> float:
        """tau: emitted tokens per round, correction/bonus included, each round's counted as it
        emitted them: at least 1. (A window FLy takes back later takes tokens from the answer,
        `emitted`, not from the rounds that emitted them.)"""
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.wall_s - self.prefill_s, 0.0)

    @property
    def decode_tokens(self) -> int:
        """The tokens committed after the prefill: those of every round but the first."""
        return self.emitted - self.first_tokens

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of decoding: the rounds after the first, over their time."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_length"] = round(self.mean_accepted_length, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
        for key in ("prefill_s", "wall_s", "target_s", "draft_s", "verify_s", "mask_s"):
            d[key] = round(d[key], 6)
        if self.draft_context is None:
            del d["draft_context"]
        if not self.calibrating:
            del d["calibrating"]
        if self.budget_spent is None:
            del d["budget_spent"], d["budget_left"]
        else:
            d["exceptions"] = self.loose      # ASD's name for its loose acceptances
        return d

    def summary(self) -> str:
        return (
            f"{self.emitted} tokens, {self.tokens_per_s:.1f} tok/s, "
            f"mean accepted length {self.mean_accepted_length:.2f} "
            f"({self.rounds} rounds, {self.drafted} drafted, {self.accepted} accepted, {self.loose} loose "
            f"of {self.mismatches} mismatches"
            + (f", {self.retractions} pending taken back with {self.retracted} tokens" if self.retractions else "")
            + "), "
            + (f"ASD budget spent {self.budget_spent:.2f}, left {self.budget_left:.2f}, "
               if self.budget_spent is not None else "")
            + (f"{self.forced} forced by the grammar, " if self.forced else "")
            + f"prompt {self.prompt_tokens} (reused {self.prompt_reused}, evaluated {self.prompt_evaluated}), "
            f"prefill {self.prefill_s:.2f} s, stop: {self.stop}"
        )
