"""FLy: entropy gate + deferred window, training-free loose verification (docs/verifiers.md, "FLy").

A draft token the target would not have chosen is still accepted ("loose") when
1. the target was unsure at that position: its top-m entropy h_j >= theta, the draft's token is
   one of those m, the target's own token does not end the generation, and the draft's token
   does not repeat the answer (the n-gram it ends is not already in the output) (the gate;
   `candidates=False` lets any token through, at any position, as the reference does),
2. the target did not "self-correct" afterwards: W-1 draft tokens after it match natively
   before any mismatch.
Looseness is decided from native matches only, so a mismatch inside a window spoils it.

The window may close in a later round (`fly_across`, the default): a gated-open mismatch is
accepted pending its window (a `Window`, the request's, which the engine passes in and keeps),
the engine holds the output back from it, and a later round accepts it (W-1 native matches) or
rejects it (a mismatch, or W-1 rounds that drafted nothing). Within a round (`fly`, the
reference implementation's): the window must end before the draft's last position, j + W < k,
or the mismatch is rejected.

Entropy costs one log-sum-exp over the vocabulary, and is computed only at mismatches that
can still decide the outcome: the window is checked first, and scanning stops at the first
rejected mismatch. Nothing is computed over all k x V logits.

FLy changes the output relative to the target's greedy decoding, by design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from flylocal.decoding.contracts import ACCEPT, REJECT, Decision, Verifier, Window


@dataclass(frozen=True)
class FlyParams:
    window: int = 6            # W: the mismatch plus W-1 native matches after it
    entropy: float = 0.3       # theta: gate threshold on the top-m entropy (nats)
    topk: int = 3              # m: how many of the largest probabilities the entropy sums
    use_window: bool = True    # False: the no-window ablation, accept a gated-open mismatch at once
    across: bool = True        # the window may close in a later round; False: within the round (j + W < k)
    candidates: bool = True    # the gate opens only for a draft token among the target's top m, never over the
                               # target's end of generation, nor for a token that repeats the answer; False: for
                               # any token anywhere (the reference's)
    echo: int = 4              # n: a draft token ending an n-gram the output already holds repeats the answer


def topk_entropy(z: np.ndarray, m: int) -> float:
    """-sum over the m largest p of p log p, with p = softmax(z) over the full vocabulary.
    z [n_vocab] float32: raw logits of one position."""
    zmax = float(z.max())
    lse = zmax + math.log(float(np.exp(z - zmax, dtype=np.float32).sum(dtype=np.float64)))
    m = min(m, len(z))
    top = np.partition(z, len(z) - m)[len(z) - m:].astype(np.float64)   # [m]
    logp = top[top > -np.inf] - lse                                      # a grammar may forbid all but a few
    return float(-(np.exp(logp) * logp).sum())


NO_ENDS = np.zeros(0, dtype=bool)
NO_OUTPUT = np.zeros(0, dtype=np.int32)


def repeats(output: np.ndarray, draft: np.ndarray, j: int, n: int) -> bool:
    """Whether draft token j ends an n-gram that already occurs in the answer: the output so far
    (output [m] int32) followed by draft[:j+1] (draft [k] int32)."""
    text = np.concatenate([output, draft[: j + 1]])                 # [m + j + 1]
    if n <= 0 or len(text) <= n:
        return False
    earlier = np.lib.stride_tricks.sliding_window_view(text[:-1], n)   # [m + j + 1 - n, n]
    return bool((earlier == text[-n:]).all(axis=1).any())


def gate_open(z: np.ndarray, token: int, target: int, params: FlyParams, ends: np.ndarray = NO_ENDS,
              echo: bool = False) -> tuple[float, bool]:
    """(top-m entropy, whether the gate opens) for a mismatch with draft token `token` where the
    target chose `target`, at a position with raw logits z [n_vocab]. With `candidates`, the
    target's token must not end the generation (`ends` [n_vocab] bool), the draft's token must
    not repeat the answer (`echo`, from `repeats`; no entropy is computed in either case: nan),
    and it must be one of the m the entropy counts (ties included): one of the target's own
    plausible choices."""
    if params.candidates and ((target < len(ends) and ends[target]) or echo):
        return math.nan, False
    h = topk_entropy(z, params.topk)
    if h < params.entropy:
        return h, False
    return h, not params.candidates or int((z > z[token]).sum()) < params.topk


def fly(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray, params: FlyParams = FlyParams(),
        ends: np.ndarray = NO_ENDS, output: np.ndarray = NO_OUTPUT) -> Decision:
    """draft [k] int32, target_argmax [k+1] int32, logits [k+1, n_vocab] float32; ends [n_vocab]
    bool: the target's end-of-generation ids (none by default); output [m] int32: the answer so
    far (none by default)."""
    k = len(draft)
    native = draft == target_argmax[:k]                    # [k] bool
    entropy = np.full(k, np.nan)                           # [k] float64
    loose = []
    W = params.window
    j = 0
    while True:
        rest = np.flatnonzero(~native[j:])
        if not rest.size:
            accepted = k
            break
        j += int(rest[0])                                  # the next native mismatch
        if params.use_window and (j + W >= k or not native[j + 1 : j + W].all()):
            accepted = j                                   # window unobservable, or spoiled
            break
        entropy[j], open_ = gate_open(logits[j], int(draft[j]), int(target_argmax[j]), params, ends,
                                      repeats(output, draft, j, params.echo))
        if not open_:
            accepted = j                                   # the target is confident: keep its token
            break
        loose.append(j)
        j += 1
    return Decision(accepted=accepted, loose=tuple(loose), entropy=entropy)


def fly_across(draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray, params: FlyParams = FlyParams(),
               window: Window | None = None, start: int = 0, ends: np.ndarray = NO_ENDS,
               output: np.ndarray = NO_OUTPUT) -> tuple[Decision, Window | None]:
    """FLy with a window that may close in a later round. `window`: the one open before the round
    (its pending token committed in an earlier one, before `start`, the context position of
    draft token 0), or None. Arrays as in `fly`. Returns the decision, whose `verdict` says what
    became of `window`, and the window open after the round: `window` counted on, or one this
    round opened at draft position j (`at` = start + j), or None. A window that closes within the
    round it opened in is an ordinary loose position; one spoiled there is a rejection at its
    position."""
    k = len(draft)
    native = draft == target_argmax[:k]                    # [k] bool
    entropy = np.full(k, np.nan)                           # [k] float64
    need = params.window - 1                               # native matches that close a window
    loose: list[int] = []
    verdict = ""

    def done(accepted: int, verdict: str, after: Window | None = None) -> tuple[Decision, Window | None]:
        return Decision(accepted=accepted, loose=tuple(loose), entropy=entropy, verdict=verdict), after

    j = 0
    while j < k:
        rest = np.flatnonzero(~native[j:])
        run = int(rest[0]) if rest.size else k - j         # native matches from j on
        if window is not None:
            if window.matches + run >= need:               # the window closes: its token is accepted
                j += need - window.matches
                if window.at < start:
                    verdict = ACCEPT
                else:
                    loose.append(window.at - start)
                window = None
                continue
            window = replace(window, matches=window.matches + run)
            j += run
            if j == k:
                break
            # a mismatch inside the window: the target corrects a real error
            return done(j, REJECT) if window.at < start else done(window.at - start, verdict)
        j += run
        if j == k:
            break
        entropy[j], open_ = gate_open(logits[j], int(draft[j]), int(target_argmax[j]), params, ends,
                                      repeats(output, draft, j, params.echo))
        if not open_:
            return done(j, verdict)                        # the target is confident: keep its token
        if need == 0:
            loose.append(j)                                # a window of the mismatch alone
        else:
            window = Window(at=start + j, recovered=int(target_argmax[j]))
        j += 1
    if window is not None and not k:
        window = replace(window, idle=window.idle + 1)     # a round that drafted nothing: no evidence
        if window.idle >= need:
            return done(0, REJECT)
    return done(k, verdict, window)


class Fly(Verifier):
    """FLy with its parameters. It carries nothing across rounds: the window is the request's
    (`Window`), passed in to `decide` and returned by it."""

    name = "fly"

    def __init__(self, params: FlyParams = FlyParams()):
        self.params = params
        self.ends = NO_ENDS
        self.output = NO_OUTPUT

    def bind(self, eog_mask: np.ndarray) -> None:
        self.ends = eog_mask

    def see(self, output: np.ndarray) -> None:
        self.output = output

    def decide(self, draft, target_argmax, logits, window=None, start=0) -> tuple[Decision, Window | None]:
        p = self.params
        if p.across and p.use_window:
            return fly_across(draft, target_argmax, logits, p, window, start, self.ends, self.output)
        return fly(draft, target_argmax, logits, p, self.ends, self.output), None
