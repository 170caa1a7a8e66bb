"""ASD: approximate speculative decoding with a regret budget (docs/verifiers.md, "ASD").

A mismatch ("exception") is accepted when its local regret r_j = z_j(a[j]) - z_j(d[j]), the
target's raw-logit preference for its own token, is small for the suffix it unlocks, and
when the request can still afford it:
- gate:   r_j / (k - j) <= g        (an early exception can unlock a longer reused suffix);
- cap:    at most M exceptions in d[0..j];
- budget: the cumulative regret C_j <= B - s, where the ledger s is the regret this request
          (in chat: this conversation, until reset) has already spent.
L is the longest prefix of feasible positions. The native matches after an accepted exception
come along with it: the target scored them under the realised prefix ("suffix reuse").
Exceptions need a positive remaining budget, so B = 0 is exactly strict decoding.

ASD changes the output relative to the target's greedy decoding, by design.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from flylocal.decoding.contracts import Decision, Verifier, Window
from flylocal.decoding.verifiers.base import regrets


@dataclass(frozen=True)
class AsdParams:
    gate: float = 0.1       # g: most regret per remaining draft position (logits)
    cap: int = 2            # M: most exceptions in one round
    budget: float = 4.0     # B: most regret a request may spend in all (logits)


def asd(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray, params: AsdParams,
        spent: float) -> tuple[Decision, np.ndarray]:
    """draft [k] int32, target_argmax [k+1] int32, logits [k+1, n_vocab] float32, `spent` the
    ledger s. Returns the decision and the cumulative regret C_j of its accepted prefix
    ([L] float64): committing the first n draft tokens costs C_{n-1}."""
    k = len(draft)
    native = draft == target_argmax[:k]                          # [k] bool
    r = regrets(draft, target_argmax, logits)                    # [k] float64, 0 at native matches
    remaining = params.budget - spent
    gate = native | (r / (k - np.arange(k)) <= params.gate)     # [k]
    cap = np.cumsum(~native) <= params.cap                       # [k]
    cost = np.cumsum(r)                                          # [k] C_j
    budget = (cost <= remaining) & (native | (remaining > 0))    # [k]
    accepted = int(np.cumprod(gate & cap & budget).sum())
    loose = tuple(int(j) for j in np.flatnonzero(~native[:accepted]))
    return Decision(accepted=accepted, loose=loose), cost[:accepted]


class Asd(Verifier):
    """ASD with its ledger: one object per request (or conversation); `reset()` empties it.
    `commit(decision, n)` charges the regret of the n draft tokens really committed (an
    end-of-generation token or max_tokens may cut the accepted prefix)."""

    name = "asd"

    def __init__(self, params: AsdParams = AsdParams()):
        self.params = params
        self.spent = 0.0
        self._cost = np.zeros(0)

    def decide(self, draft, target_argmax, logits, window=None, start=0) -> tuple[Decision, Window | None]:
        decision, self._cost = asd(draft, target_argmax, logits, self.params, self.spent)
        return decision, window

    def commit(self, decision: Decision, n: int) -> Decision:
        """Charge the regret of the first n committed draft tokens; the decision, carrying the
        ledger after the charge."""
        if n > 0:
            self.spent += float(self._cost[n - 1])
        return dataclasses.replace(decision, budget_spent=self.spent, budget_left=self.params.budget - self.spent)

    def reset(self) -> None:
        self.spent = 0.0
