"""Whether the rounds contradict a trusted cost curve (docs/design.md, "Cost model"): a cached
file can pass every check of its own and still be wrong (copied from another machine, poisoned
within physics, calibrated under a load its meter missed). Whatever it says, rounds that
disagree with it beyond noise drop it, and it is measured again.

Each round's single step as the curve has it is its seconds over the calibrated shape at its
size. If the curve is right, two rounds of different sizes one after the other (so under the
same load) give the same step but for noise. Each round is in one such pair at most, so a stall
spoils one pair, and a load that starts or ends spoils the one pair across it. So:

- two sizes whose steps' ratio lies beyond DISTRUST the same way in the middle half of their
  pairs (CONTRADICT or more, within STALE seconds of decoding) say the shape is wrong: a stall
  spoils one now and then, a wrong curve nearly all of them;
- rounds SLOWER times faster than the calibrated step (the median of the last RECENT) say it
  was measured under a load, or on another machine. Rounds slower than it are the load of the
  moment, and say nothing.

On an idle 2-core machine a size's rounds vary by 10-15%, and their single step lies within 20%
of the calibrated one; a load that starts or ends between the two rounds of a pair moves that
pair alone."""

from __future__ import annotations

import math

from flylocal.decoding.costs.calibration import SLOWER
from flylocal.statistics import middle

CONTRADICT = 5           # pairs of two sizes (and rounds in all) before they may contradict the curve
DISTRUST = 1.5           # two sizes' steps this far apart contradict the curve's shape
RECENT = 7               # rounds whose median step is the step now
KEPT = 9                 # pairs kept per two sizes
STALE = 3.0              # seconds of decoding after which a round is old evidence (here and in refinement)


class Check:
    """The rounds of one trusted curve, as evidence against it."""

    def __init__(self):
        self.pairs: dict[tuple[int, int], list[tuple[float, float]]] = {}   # (a, b), a < b -> (decoded_s,
                                                                           # log(step at b / step at a))
        self.recent: list[tuple[int, float]] = []       # the last RECENT rounds: (rows, step)
        self.free: tuple[int, float] | None = None      # the last round, if in no pair yet

    def clear(self) -> None:
        self.pairs, self.recent, self.free = {}, [], None

    def round(self, rows: int, seconds: float, shape: float, step: float, decoded_s: float) -> str | None:
        """Fold in a round of `rows` rows that took `seconds`, the curve saying `shape` single
        steps of `step` seconds for it (`decoded_s`: the seconds of decoding so far, this one
        included). Why the rounds contradict the curve, or None."""
        one = seconds / shape
        before, self.free = self.free, (rows, one)
        self.recent = (self.recent + [(rows, one)])[-RECENT:]
        if before is not None and before[0] != rows:
            self.free = None                   # each round in one pair at most: a stall spoils one
            other, theirs = before
            a, b = min(rows, other), max(rows, other)
            ratio = math.log(one / theirs) * (1 if rows == b else -1)
            pairs = self.pairs[(a, b)] = (self.pairs.get((a, b), []) + [(decoded_s, ratio)])[-KEPT:]
            fresh = sorted(r for c, r in pairs if decoded_s - c <= STALE)
            if len(fresh) >= CONTRADICT:
                low, high = fresh[len(fresh) // 4], fresh[-1 - len(fresh) // 4]     # the middle half
                if low > math.log(DISTRUST) or high < -math.log(DISTRUST):
                    dearer, cheaper = (b, a) if low > 0 else (a, b)
                    return (f"{dearer} rows take {math.exp(abs(middle(fresh))):.1f}x what the curve gives them "
                            f"against {cheaper}")
        steps = [theirs for _, theirs in self.recent]
        if len(steps) >= CONTRADICT and SLOWER * middle(steps) < step:
            return f"they ran {step / middle(steps):.1f}x as fast as the curve says"
        return None
