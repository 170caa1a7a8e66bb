"""Draft-length control over a drafter (docs/design.md, "Cost model"): each round the drafter's
proposal is cut to the length expected to commit the most tokens per second, from the target's
cost curve and the acceptance measured per confidence level (flylocal.decoding.adaptive).
Prompt lookup runs under it unless --k is given; any drafter whose proposals carry a `level`
can."""

from __future__ import annotations

import numpy as np

from flylocal.decoding.adaptive import DraftLength, Learned, streak_after
from flylocal.decoding.contracts import Draft, Drafter
from flylocal.decoding.costs import CostCurve


class LengthControl(Drafter):
    def __init__(self, drafter: Drafter, prior: np.ndarray, k_max: int, curve: CostCurve,
                 learned: Learned | None = None):
        """`prior` [levels] float64: the drafter's prior per-position acceptance by level;
        `curve`: the target's cost curve; `learned`: controllers to take over (role "length")."""
        self.drafter = drafter
        self.name = drafter.name
        fresh = DraftLength(k_max, prior, curve)
        self.length = learned.keep("length", fresh) if learned is not None else fresh
        self.shared = False
        self.streak = False            # the last round accepted its whole draft (this request's own)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        proposal = self.drafter.propose(context, k)
        n = len(proposal.tokens)
        if not n or self.shared:           # shared: the batch's allotment cuts it
            return proposal
        keep = self.length.choose(self.length.row(proposal.level, self.streak), n)
        return proposal if keep == n else proposal.cut(keep)

    def reach(self, draft: Draft) -> np.ndarray:
        r = self.length.reach(self.length.row(draft.level, self.streak), len(draft.tokens))
        return np.concatenate([r, np.zeros(len(draft.tokens) - len(r))])

    def share(self, shared: bool) -> None:
        self.shared = shared
        self.drafter.share(shared)

    def observe(self, draft: Draft, accepted: int) -> None:
        self.length.update(self.length.row(draft.level, self.streak), len(draft.tokens), accepted)
        self.streak = streak_after(len(draft.tokens), accepted)
        self.drafter.observe(draft, accepted)

    def begin(self, budget: int | None = None) -> None:
        self.streak = False
        self.drafter.begin(budget)

    def end(self, output: list[int]) -> None:
        self.drafter.end(output)

    def controllers(self) -> tuple:
        return (self.length, *self.drafter.controllers())
