"""One round's record, filled in step by step by the engine (flylocal.decoding.engine) and read
by its accounts: the stats (flylocal.decoding.stats) and the trace (flylocal.decoding.trace);
and what a committed round makes output while FLy's window holds the rest pending
(`split_output`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flylocal.decoding.contracts import Decision, Draft, Window


@dataclass(slots=True)
class Round:
    """Positions j index the draft; `forced` of its first tokens came from the grammar, the rest
    from the drafter (`proposal`)."""

    index: int
    proposal: Draft                   # the drafter's proposal, as it came
    draft: np.ndarray                 # [k] int32: the tokens the target scores after `last`
    forced: int = 0                   # f: the draft's first tokens the grammar forced
    head: int = 0                     # rows of the prompt's tail decoded ahead of the round's own
    n_past: int = 0                   # the target's committed length before the round's rows
    logits: np.ndarray | None = None  # [k+1, n_vocab] float32: the target's rows, valid until the next decode
    target: np.ndarray | None = None  # [k+1] int32: a, the target's token at each position
    decision: Decision | None = None
    window: Window | None = None      # the window the decision left open (FLy's), before the commit's cut
    emitted: np.ndarray | None = None     # [L+1] int32
    committed: int = 0                # m: of `emitted`, what the cache keeps (cut at the first
                                      # end-of-generation token, max_tokens and the context's end)
    accepted: int = 0                 # draft tokens committed: min(L, m)
    ended: bool = False               # an end-of-generation token was committed (the recovered token, after a retraction)
    rejected: Window | None = None    # the window whose pending token the round took back (FLy's window across
                                      # rounds), its recovered token put in its place
    retracted: int = 0                # the tokens taken back with it, the pending one first
    shared: bool = False              # the decode carried other requests' rows too (flylocal.decoding.batch)
    threads: int | None = None        # the CPU threads the target's decode ran on (None: not a CPU context)
    draft_s: float = 0.0              # seconds drafting,
    score_s: float = 0.0              # in the target's decode,
    mask_s: float = 0.0               # applying a grammar to its rows,
    decide_s: float = 0.0             # deciding,
    commit_s: float = 0.0             # rolling the cache back

    @property
    def added(self) -> int:
        """Tokens the round added to the committed sequence: what it committed, less what it
        took back, plus the recovered token of a rejected window."""
        return self.committed - self.retracted + (self.rejected is not None)


def split_output(window: Window | None, pending: tuple, start: int, n: int, accepted: int,
                 new: list[tuple]) -> tuple[list[tuple], Window | None]:
    """A committed round's output and the request's window after it. `window`: the one the
    round's decision left open, or None; `pending`: the pending output of the window its
    verdict accepted, now output; the round committed context[start:n], `accepted` of them
    draft tokens, and `new` holds (token, kind, logprobs entry) of its output tokens. The output
    is that `pending`, then `new` up to the window's pending token; the window keeps the rest
    pending. A commit cut short before the pending token (an end-of-generation token,
    max_tokens, the context's end) leaves no window."""
    if window is None or window.at >= n:
        return [*pending, *new], None
    before = max(window.at - start, 0)        # the round's output tokens before the pending one
    return [*pending, *new[:before]], replace(window, accepted=window.accepted + accepted - before,
                                               pending=window.pending + tuple(new[before:]))
