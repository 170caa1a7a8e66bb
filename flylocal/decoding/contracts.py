"""The contracts of the decoding core (docs/design.md, "Contracts"): what the round loop
(flylocal.decoding.engine) asks of the model it verifies on (`Target`), of where drafts come
from (`Drafter`) and of what decides how much of a draft to keep (`Verifier`), and the records
they pass: `Draft`, `Decision` and FLy's `Window`; what a batch asks of a cache of several sequences
(`Sequences`), and what text drafting and grammars read of a model's tokens (`Vocabulary`).

A round, in these words:

    drafter.propose(context, k) -> Draft                          draft
    target.decode([last, *draft], logits for its k+1 rows)        score
    verifier.decide(draft, target_argmax, logits, window, start)  decide
        -> Decision, Window
    target.truncate(n_past + m); verifier.commit(decision, n)     commit
    (a REJECT verdict: target.truncate(P), the window's recovered token at P)
    drafter.observe(draft as verified, accepted)                  account

A hook a part has nothing to say in has a no-op default here: a class that subclasses the
Protocol implements what it needs and inherits the rest. The engine calls every hook, always:
it never asks an object what it happens to have.

This module imports numpy and the standard library (and the cost model where a curve is made):
the llama.cpp edge (flylocal.llama) reaches the core through it alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Protocol

import numpy as np

if TYPE_CHECKING:
    from flylocal.decoding.costs import CostCurve

EMPTY = np.zeros(0, dtype=np.int32)


def cost_curve(key: dict) -> CostCurve:
    """The cost curve a Target keeps as its `costs`: the core's model of what its decodes cost
    (flylocal.decoding.costs), cached on disk under `key` (`Target.cost_key()`). The edge gets
    it here; of it, the edge reads `shape(rows)`, sets `on_key` when its decodes leave the
    conditions the key names (another thread count) and calls `save()` when it closes."""
    from flylocal.decoding.costs import CostCurve

    return CostCurve(key=key)


# ----- the target -----

def reusable_prefix(cached: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading `tokens` [n] a cache holding `cached` [n_past] can keep: their common
    prefix, leaving at least the last of `tokens` to be decoded (its logits are needed). What
    `Target.reuse_prefix` keeps."""
    limit = min(len(cached), len(tokens) - 1)
    if limit <= 0:
        return 0
    diff = np.flatnonzero(cached[:limit] != tokens[:limit])
    return int(diff[0]) if diff.size else limit


def equal_split(rows: dict[int, int]) -> list[int]:
    """The row counts of the computations llama.cpp runs a decode of `rows` (sequence -> tokens)
    as, with a cache of its own per sequence: a run of consecutive sequence ids at a time, as
    many tokens from each as the one with fewest has left (measured: 4 sequences of 1 row cost
    what 4 rows of one do; 5+1+1+1 rows what 4 and 4 do; sequences 0 and 2 what two single rows do)."""
    left = {s: n for s, n in rows.items() if n > 0}
    out = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        step = min(left[s] for s in run)
        out.append(step * len(run))
        for s in run:
            left[s] -= step
            if not left[s]:
                del left[s]
    return out


class Target(Protocol):
    """A loaded model with a KV cache: the target, and a draft model too. `Runtime`
    (flylocal.llama.runtime), the rpc-placed model (flylocal.llama.remote) and the tests'
    in-memory target satisfy it.

    The cache holds the first `n_past` tokens of one sequence. A cache of several
    (`Sequences`) hands out each as a Target of its own (`Sequences.sequence(s)`), so a
    Target's calls never name a sequence."""

    n_ctx: int                 # cells of the cache: prompt and output together
    n_batch: int               # most rows with logits one decode gives
    n_vocab: int
    eog_mask: np.ndarray       # [n_vocab] bool: the end-of-generation ids
    n_past: int                # tokens the cache holds
    costs: CostCurve           # what a decode of n rows costs here (flylocal.decoding.costs), keyed
                               # by cost_key(); shared by everything that drafts for this model
    decoded_on: int | None = None   # the CPU threads its last decode ran on, for the trace (None: not
                                    # a CPU context, such as a model on rpc servers)

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids [n] int32 of `text`. Special-token text is plain text unless
        `parse_special`: text from a user never becomes control tokens."""
        ...

    def decode(self, tokens, logits_from: int | None = None) -> np.ndarray | None:
        """Append `tokens` [n] to the cache in one decode (chunked past n_batch); the logits of
        rows `logits_from:` as [rows, n_vocab] float32, valid until the next decode; None when
        `logits_from` is None. Only the requested rows are computed."""
        ...

    def truncate(self, n_keep: int) -> None:
        """Roll the cache back to its first `n_keep` tokens: the one way a round rolls back."""
        ...

    def reuse_prefix(self, tokens: np.ndarray) -> int:
        """Keep the longest cached prefix of `tokens` (`reusable_prefix`); return its length.
        tokens[kept:] still need decoding."""
        ...

    def drop(self, start: int, count: int) -> bool:
        """Remove the cells of tokens start..start+count-1, the later ones moved back to follow
        the first `start` (a draft model's bounded context): True. A cache that cannot move
        positions rolls back to `start` instead: False."""
        self.truncate(start)
        return False

    def cost_key(self) -> dict:
        """What the cost of a decode depends on (model file, build, device, threads, batch):
        the key its cost curve is cached under."""
        ...

    def steady(self) -> ContextManager:
        """Hold the decodes in the block to the conditions `cost_key` names (the thread count
        a calibration is keyed by)."""
        return contextlib.nullcontext()

    def thread_report(self) -> dict | None:
        """How its CPU threads were used (--threads auto: the count now, decodes at each count,
        other processes' load, each move and its reason; a fixed count: just that). None: a
        target with no threads of its own to report."""
        return None


class Sequences(Protocol):
    """One cache holding several sequences, each its own Target (`sequence(s)`: its own cells,
    n_past, rollback and prefix reuse), and a decode that appends to several of them at once
    (flylocal.decoding.batch). Every `Runtime` (one sequence on rpc servers) and the tests'
    in-memory target satisfy it. No cell of one sequence is visible to another."""

    n_seq: int
    n_batch: int
    costs: CostCurve           # one decode's cost by rows (`split` says how a shared decode is run)

    def sequence(self, seq: int) -> Target:
        """Sequence `seq` (0 <= seq < n_seq) as a Target of its own."""
        ...

    def cached(self, seq: int) -> np.ndarray:
        """The token ids sequence `seq`'s cells hold [n_past] int32."""
        ...

    def decode_batch(self, parts: list[tuple[int, np.ndarray, int | None]]) -> list[np.ndarray | None]:
        """One decode of every part (seq, tokens [n] int32, logits_from), each part appended to
        its own sequence: a part's logits (rows logits_from:, [rows, n_vocab] float32, valid until
        the next decode; None when logits_from is None). At most n_batch tokens in all; a
        sequence appears in one part at most."""
        ...

    def split(self, rows: dict[int, int]) -> list[int]:
        """The row counts of the computations a decode of `rows` (sequence -> tokens) runs as:
        what it costs is the sum of the cost curve at each."""
        ...

    def state(self, seq: int) -> bytes:
        """Sequence `seq`'s cells as a buffer (bytes, or a memory map whose memory goes back to
        the system when it is dropped): what `restore` puts back (the prompt cache,
        flylocal.decoding.prompt_cache)."""
        ...

    def restore(self, seq: int, tokens: np.ndarray, data: bytes) -> bool:
        """Replace sequence `seq`'s cells with `data` (`state`), which holds `tokens`: True when
        it took; False, the sequence then empty, when `data` is not a state it can load."""
        ...

    def state_key(self) -> dict:
        """What a state depends on (model file, build, backend, the cache's shape): a state kept
        under another key is never restored."""
        ...


# ----- a model's tokens as text -----

class Vocabulary(Protocol):
    """A model's tokens as text: what drafting through text reads of the target's and of the
    draft's (flylocal.decoding.drafters.text), and what a grammar reads of the target's
    (flylocal.decoding.grammar). A `Runtime`, its vocabulary and its sequences (flylocal.llama)
    satisfy it, and so do the tests' literal vocabularies."""

    n_vocab: int
    eog_mask: np.ndarray       # [n_vocab] bool: the end-of-generation ids
    bos: int | None            # the beginning-of-sequence id (-1 or None: none)
    add_bos: bool              # tokenize(add_special=True) puts `bos` first

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids [n] int32 of `text` (Target.tokenize)."""
        ...

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of `token`'s text; a control token's text only with `special` (else b"")."""
        ...

    def is_control(self, token: int) -> bool:
        """Whether `token` is a control token (end of generation, a template's markers)."""
        ...

    def control_ids(self) -> dict[bytes, int]:
        """Every control token by its text."""
        ...


# ----- drafters -----

@dataclass(frozen=True)
class Draft:
    """A proposal: the tokens, and what the drafter wants back with them in `observe`."""

    tokens: np.ndarray      # [k'] int32, k' <= k
    level: int = 0          # confidence bucket for draft-length control (prompt lookup: n-gram size)
    source: str = ""        # "pld" or "model" where a drafter chose between them this round
    levels: list | None = None    # a model draft: each token's confidence level
    seconds: float | None = None  # a model draft: the time it took
    text: str | None = None       # a draft through text: the draft model's text it came from

    def cut(self, n: int) -> Draft:
        """This draft with its first n tokens only (and their levels)."""
        levels = self.levels[:n] if self.levels is not None else None
        return Draft(self.tokens[:n], self.level, self.source, levels, self.seconds, self.text)


NO_DRAFT = Draft(EMPTY)


class Drafter(Protocol):
    """Where a round's draft comes from (docs/design.md, "Adding a drafter"). `propose` is the
    one method a drafter must write; the hooks default to doing nothing.

    The engine calls, per request: `begin(budget)`; per round: `propose`, then `observe` once
    the target has reached the drafter's tokens; at the end: `end(output)`, then `report()`."""

    name: str
    drafts: bool = True         # False: a drafter that never proposes (plain decoding)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        """At most k tokens to verify after `context` [n] int32 (the prompt and every committed
        token; the last is not yet in the target's cache)."""
        ...

    def observe(self, draft: Draft, accepted: int) -> None:
        """Feedback after the round: `draft` as verified (its tokens cut to those the target
        scored; empty when nothing was proposed) and how many of them were committed."""

    def begin(self, budget: int | None = None) -> None:
        """A new request, which may emit up to `budget` tokens: its first round follows no other
        (what is the request's own, such as a streak, starts again; controllers hold none)."""

    def report(self) -> dict | None:
        """What the drafter chose for the request that ended, for its stats (`draft_context`: what
        a draft model was given of the context); None: nothing to say."""
        return None

    def end(self, output: list[int]) -> None:
        """The request ended with these output ids (prompt lookup remembers them)."""

    def reach(self, draft: Draft) -> np.ndarray | None:
        """[k] float64: for each j, the chance that the first j+1 tokens of `draft` (one of its own
        proposals) are all accepted, as its draft-length control has measured it. A decode
        shared by several requests hands out its rows by it (flylocal.decoding.batch). None (a
        drafter whose length was given, --k): the whole draft is verified."""
        return None

    def share(self, shared: bool) -> None:
        """Whether this drafter's rounds share their decode with other requests' (flylocal.decoding.batch).
        There the rows are handed out across requests by `reach`, so a drafter under draft-length
        control proposes everything worth verifying and leaves the cut to that allotment."""

    def controllers(self) -> tuple:
        """The draft-length controllers this drafter decides with (flylocal.decoding.adaptive),
        taken over from earlier engines where they fit (`Learned`)."""
        return ()

    def cost_curves(self) -> tuple:
        """Every cost curve its decisions read: pinned for a run whose output must not follow
        this run's timings, and the target's calibrated before the first round."""
        return tuple(curve for controller in self.controllers() for curve in controller.curves())


# ----- verifiers -----

@dataclass(frozen=True)
class Decision:
    accepted: int                              # L: committed draft prefix, 0 <= L <= k
    loose: tuple[int, ...] = ()                # positions j < L with d[j] != a[j], accepted anyway
    entropy: np.ndarray | None = None          # [k] float64, NaN where not computed
    budget_spent: float | None = None          # ASD's ledger s after this round's charge
    budget_left: float | None = None           # B - s
    verdict: str = ""                          # on the Window open before the round: ACCEPT, REJECT, or ""
                                               # (none was open, or it is still open)


# A verdict on a window open before the round (FLy's; docs/verifiers.md, "FLy"). ACCEPT: its
# pending token stays for good and its pending output is shown. REJECT: its pending token is
# taken back, the caches roll back to it and its recovered token takes its place; nothing of the
# round stays. (The values are the trace's words for them: docs/verifiers.md, "Trace and stats".)
ACCEPT, REJECT = "kept", "retracted"


@dataclass(frozen=True)
class Window:
    """FLy's deferred window across rounds, one request's (docs/verifiers.md, "FLy"): a draft token
    accepted while its window is open (the *pending* token, at context position `at`), and what
    the window has seen since. It is the one record of the window: the verifier's `decide` takes
    the window open before a round and returns the one open after it, and the engine keeps that
    between rounds, adding what the round committed from `at` on (`accepted`, `pending`)."""

    at: int                        # P: the context position of the pending token
    recovered: int                 # the target's own token at P: what takes its place if it is rejected
    matches: int = 0               # native matches since it (W-1 accept it)
    idle: int = 0                  # rounds since it that drafted nothing (W-1 reject it)
    accepted: int = 0              # draft tokens committed from P on, the pending token included
    pending: tuple = ()            # (token, kind, logprobs entry) of the output committed from P on, held
                                   # back until the verdict
    recovered_logprobs: tuple | None = None   # the recovered token's logprobs entry (EngineConfig.logprobs)


class Verifier(Protocol):
    """How much of a draft to commit (docs/verifiers.md). `decide` is a function of the round's
    arrays and of what is carried across rounds: the request's open Window, passed in and
    returned (FLy), or a ledger the verifier keeps (ASD: `commit` charges it, `reset` empties it)."""

    name: str

    def decide(self, draft: np.ndarray, target_argmax: np.ndarray, logits: np.ndarray,
               window: Window | None = None, start: int = 0) -> tuple[Decision, Window | None]:
        """draft [k] int32, target_argmax [k+1] int32 (the target's token at each draft position
        and at the bonus position), logits [k+1, n_vocab] float32 (the target's raw logits for
        exactly those rows); `window`: the request's window open before the round (None: none);
        `start`: the context position of draft token 0. Returns the decision and the window open
        after it, before the commit (a verifier with no window returns `window` as it came)."""
        ...

    def commit(self, decision: Decision, n: int) -> Decision:
        """The first n draft tokens of `decision` were committed (an end-of-generation token or
        the token limit may cut its accepted prefix); the decision as it stands after."""
        return decision

    def bind(self, eog_mask: np.ndarray) -> None:
        """The target's end-of-generation ids ([n_vocab] bool), given once by the engine before
        any round: a lossy verifier never overrides the target's choice to end."""

    def see(self, output: np.ndarray) -> None:
        """The answer so far (output [m] int32, the committed tokens after the prompt; a view,
        valid until the round commits), given by the engine before each `decide`."""

    def reset(self) -> None:
        """A new conversation."""
