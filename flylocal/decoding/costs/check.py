"""Whether the rounds contradict a trusted cost curve (docs/design.md, "Cost model"): a cached
file can pass every check of its own and still be wrong (copied from another machine, poisoned
within physics, calibrated under a load its meter missed). Whatever it says, rounds that
disagree with it beyond noise drop it, and it is measured again.

Each round's single step as the curve has it (its seconds over the calibrated shape at its
size), over the median of the last RECENT rounds' (the load of the moment), is 1 at every size
but for noise. So:

- two sizes whose medians (of CONTRADICT rounds each, within STALE seconds of decoding) lie
  DISTRUST times apart say the shape is wrong;
- rounds SLOWER times faster than the calibrated step say it was measured under a load (or on
  another machine). Rounds slower than it are the load of the moment, and say nothing.

On an idle 2-core machine a size's rounds vary by 10-15%, and their single step lies within 20%
of the calibrated one; a load that comes and goes moves every size alike within a few rounds."""

from __future__ import annotations

from flylocal.decoding.costs.calibration import SLOWER
from flylocal.decoding.costs.shape import median

CONTRADICT = 5           # rounds of a size (and in all) before they may contradict the curve
DISTRUST = 1.5           # two sizes this far apart, relative to the curve, contradict its shape
RECENT = 7               # rounds that give the load of the moment
KEPT = 9                 # rounds kept per size
STALE = 3.0              # seconds of decoding after which a round is old evidence (here and in refinement)


class Check:
    """The rounds of one trusted curve, as evidence against it."""

    def __init__(self):
        self.by_size: dict[int, list[tuple[float, float]]] = {}   # rows -> (decoded_s, step / steps now)
        self.steps: list[float] = []                              # the last rounds' single steps

    def clear(self) -> None:
        self.by_size, self.steps = {}, []

    def round(self, rows: int, seconds: float, shape: float, step: float, decoded_s: float) -> str | None:
        """Fold in a round of `rows` rows that took `seconds`, the curve saying `shape` single
        steps of `step` seconds for it (`decoded_s`: the seconds of decoding so far, this one
        included). Why the rounds contradict the curve, or None."""
        one = seconds / shape
        self.steps = (self.steps + [one])[-RECENT:]
        pairs = self.by_size.get(rows, []) + [(decoded_s, one / median(self.steps))]
        self.by_size[rows] = pairs[-KEPT:]
        now = {n: median(fresh) for n, pairs in self.by_size.items()
               if len(fresh := [r for c, r in pairs if decoded_s - c <= STALE]) >= CONTRADICT}
        if len(now) >= 2:
            fast, slow = min(now, key=now.get), max(now, key=now.get)
            if now[slow] > DISTRUST * now[fast]:
                return f"{slow} rows take {now[slow] / now[fast]:.1f}x what the curve gives them against {fast}"
        if len(self.steps) >= CONTRADICT and SLOWER * median(self.steps) < step:
            return f"they ran {step / median(self.steps):.1f}x as fast as the curve says"
        return None
