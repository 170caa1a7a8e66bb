"""A test-only drafter, written as docs/design.md "Adding a drafter" says: it proposes the last
token of the context again, k times (right where the text repeats itself, wrong elsewhere), and
keeps count of what the engine tells it. `propose` is all a drafter must write; the hooks it
does not need keep their defaults."""

from __future__ import annotations

import numpy as np

from flylocal.decoding.contracts import Draft, Drafter


class RepeatLast(Drafter):
    name = "repeat-last"

    def __init__(self):
        self.requests = 0            # begin(): requests started
        self.verified = 0            # observe(): draft tokens the target scored ...
        self.accepted = 0            # ... and committed
        self.outputs: list[list[int]] = []      # end(): each request's output

    def propose(self, context: np.ndarray, k: int) -> Draft:
        return Draft(np.full(k, context[-1], dtype=np.int32))

    def begin(self, budget=None) -> None:
        self.requests += 1

    def observe(self, draft: Draft, accepted: int) -> None:
        assert 0 <= accepted <= len(draft.tokens)
        self.verified += len(draft.tokens)
        self.accepted += accepted

    def end(self, output: list[int]) -> None:
        self.outputs.append(list(output))
