"""One round's record, filled in step by step by the engine (flylocal.decoding.engine) and read
by its accounts: the stats (flylocal.decoding.stats) and the trace (flylocal.decoding.trace)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flylocal.decoding.contracts import Decision, Draft


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
    emitted: np.ndarray | None = None     # [L+1] int32
    committed: int = 0                # m: of `emitted`, what the cache keeps (cut at the first
                                      # end-of-generation token, max_tokens and the context's end)
    accepted: int = 0                 # draft tokens committed: min(L, m)
    shown: int = 0                    # committed tokens that are output: all but an end-of-generation one
    ended: bool = False               # an end-of-generation token was committed (the recovered token, after a retraction)
    retracted: int = 0                # tokens taken back from a provisional one on (FLy's window across rounds),
    retracted_accepted: int = 0       # of which draft tokens that earlier rounds (and this one) accepted
    recovered: tuple | None = None    # then (the target's token put in its place, its logprobs entry)
    shared: bool = False              # the decode carried other requests' rows too (flylocal.decoding.batch)
    threads: int | None = None        # the CPU threads the target's decode ran on (None: not a CPU context)
    draft_s: float = 0.0              # seconds drafting,
    score_s: float = 0.0              # in the target's decode,
    mask_s: float = 0.0               # applying a grammar to its rows,
    decide_s: float = 0.0             # deciding,
    commit_s: float = 0.0             # rolling the cache back

    @property
    def net(self) -> int:
        """Tokens the round added to the committed sequence: what it committed, less what it
        took back, plus the recovered token of a retracted one."""
        return self.committed - self.retracted + (self.retracted > 0)


class Window:
    """FLy's window across rounds, for one request (docs/verifiers.md, "FLy"): the token accepted
    provisionally at position `at` of the context, the target's own token there (`recovered`,
    with its logprobs entry: what goes in its place if the window is taken back), the output
    held back from `at` on, and the draft tokens accepted from `at` on. The verifier decides
    (Decision.provisional, Decision.closed); the engine records the decision here, and its
    commit, retraction and accounts read it."""

    __slots__ = ("at", "recovered", "held", "accepted")

    def __init__(self):
        self.at: int | None = None
        self.recovered: tuple | None = None       # (token, logprobs entry)
        self.held: list[tuple] = []               # (token, kind, logprobs entry) committed from `at` on
        self.accepted = 0

    @property
    def open(self) -> bool:
        return self.at is not None

    def opens(self, at: int, recovered: tuple, accepted: int) -> None:
        """A token accepted provisionally at `at`; `accepted` draft tokens from there on."""
        self.at, self.recovered, self.accepted = at, recovered, accepted

    def close(self) -> None:
        """The window's token is kept for good (its held output is released by `release`)."""
        self.at = self.recovered = None

    def release(self) -> list[tuple]:
        """What the window held back, now output."""
        out, self.held = self.held, []
        return out

    def taken_back(self) -> tuple[int, int, tuple]:
        """The window closed with its token taken back: (its position, the draft tokens it had
        accepted, the recovered token and its logprobs entry); what it held is dropped."""
        gone = (self.at, self.accepted, self.recovered)
        self.at = self.recovered = None
        self.held, self.accepted = [], 0
        return gone
