"""Prompt lookup (PLD): propose the continuation of the most recent earlier occurrence of the
context's final n-gram, trying n from `max_ngram` down to 1. No model, no training.

A drafter keeps a `ContextIndex`: where each token of the context occurs, brought up to date
each round with the tokens that changed, so a lookup reads the last token's occurrences rather
than scanning the whole context (`find_matches` is the scan; the index answers the same).

Beyond the context, lookup also searches a `Corpus`: a file the user names (--lookup-corpus)
and what was generated earlier in the session (chat turns, server requests). A longer match
wins; at equal length the context's, which is more recent.
"""

from __future__ import annotations

import numpy as np

from flylocal.decoding.contracts import EMPTY, NO_DRAFT, Draft, Drafter


def stop_at_eog(tokens: np.ndarray, eog: np.ndarray) -> np.ndarray:
    """Cut a draft after its first end-of-generation token (kept: it can be accepted)."""
    hits = np.flatnonzero(eog[tokens])
    return tokens[: hits[0] + 1] if hits.size else tokens


NO_ENDS = np.zeros(0, dtype=np.int64)


def find_matches(tokens: np.ndarray, max_ngram: int) -> tuple[np.ndarray, int]:
    """(ends, n): every earlier occurrence of the longest suffix n-gram of `tokens` (n <=
    max_ngram) ends at an index in `ends`, ascending; (empty, 0) when even the last token never
    occurred.

    Candidates are the earlier positions of the last token; each step keeps those whose
    preceding token also matches, so the cost is one pass over the context plus a few tiny
    arrays, whatever max_ngram is.
    """
    n_tok = len(tokens)
    if n_tok < 2 or max_ngram < 1:
        return NO_ENDS, 0
    ends = np.flatnonzero(tokens[: n_tok - 1] == tokens[n_tok - 1])   # [c] ends of 1-gram matches
    if not ends.size:
        return NO_ENDS, 0
    return lengthen(tokens, ends, tokens, max_ngram)


def lengthen(source: np.ndarray, ends: np.ndarray, context: np.ndarray, max_ngram: int) -> tuple[np.ndarray, int]:
    """(ends, n): of `ends` (ascending positions in `source` whose token is the context's last),
    those that end the longest suffix n-gram of `context` found (n <= max_ngram). Each step keeps
    the candidates whose preceding token also matches."""
    return extend(source.__getitem__, ends, context[max(len(context) - max_ngram, 0):])


def extend(read, ends: np.ndarray, suffix: np.ndarray) -> tuple[np.ndarray, int]:
    """`lengthen` over a source read through `read(positions) -> tokens` (ascending positions),
    given the context's last min(max_ngram, len(context)) tokens `suffix`."""
    n = 1
    while n < len(suffix):
        room = ends if ends[0] >= n else ends[ends >= n]      # ascending: only the first can be < n
        longer = room[read(room - n) == suffix[-1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    return ends, n


def find_match(tokens: np.ndarray, max_ngram: int) -> tuple[int, int]:
    """(end, n): the most recent of `find_matches`; (-1, 0) when there is none."""
    ends, n = find_matches(tokens, max_ngram)
    return (int(ends[-1]), n) if n else (-1, 0)


def match_length(tokens: np.ndarray, end: int, limit: int) -> int:
    """How many tokens ending at `end` equal those ending at the last token (at most `limit`)."""
    last = len(tokens) - 1
    n = 0
    while n < limit and end - n >= 0 and tokens[end - n] == tokens[last - n]:
        n += 1
    return n


def span(context: np.ndarray, extra: np.ndarray, start: int, stop: int) -> np.ndarray:
    """(context + extra)[start:stop], 0 <= start: a view, or a copy of the span alone where it
    crosses from the context into `extra`."""
    n = len(context)
    if stop <= n:
        return context[start:stop]
    if start >= n:
        return extra[start - n : stop - n]
    return np.concatenate([context[start:], extra[: stop - n]])


def read_joined(context: np.ndarray, extra: np.ndarray, at: np.ndarray) -> np.ndarray:
    """(context + extra)[at] for ascending positions `at`, without copying the context."""
    n = len(context)
    if not len(at) or at[-1] < n:
        return context[at]
    cut = int(np.searchsorted(at, n))
    return np.concatenate([context[at[:cut]], extra[at[cut:] - n]])


class ContextIndex:
    """Where each token of a context occurs, kept up to date across calls: `find` and `match`
    answer as `find_matches` and `find_match` on context + extra, reading the last token's
    occurrences instead of scanning the context.

    Each round's context is usually the last one plus a few tokens; after a rollback or a new
    request it shares a prefix with it. The index keeps a copy of the tokens it holds and finds
    that prefix with one memcmp (`bytearray.startswith`, a few times cheaper than a scan, and
    right for any context, a different one of the same length included), drops the positions
    past it and adds the new ones. A change of more than a quarter of the context is indexed
    anew in bulk (an argsort). Per round: the memcmp, O(1) per changed token, and numpy work on
    the last token's occurrences (`extend`)."""

    SMALL = 64      # a change of up to SMALL + n // 4 tokens is applied token by token

    def __init__(self):
        self.raw = bytearray()          # the indexed tokens' bytes, in `dtype`
        self.dtype: np.dtype | None = None
        self.size = 0                   # tokens indexed
        # token -> [positions [capacity] int64 ascending, how many are in use]
        self.where: dict[int, list] = {}

    def find(self, context: np.ndarray, max_ngram: int, extra: np.ndarray = EMPTY) -> tuple[np.ndarray, int]:
        """`find_matches(context + extra, max_ngram)`, the context indexed (and `extra`, a few
        tokens such as a draft so far, scanned), neither copied."""
        ends, n = self._find(context, max_ngram, extra)
        return ends.copy(), n           # not a view of the index, which the next call changes

    def match(self, context: np.ndarray, max_ngram: int, extra: np.ndarray = EMPTY) -> tuple[int, int]:
        """`find_match(context + extra, max_ngram)`: (end, n) of the most recent of `find`."""
        ends, n = self._find(context, max_ngram, extra)
        return (int(ends[-1]), n) if n else (-1, 0)

    def _find(self, context: np.ndarray, max_ngram: int, extra: np.ndarray) -> tuple[np.ndarray, int]:
        context = self.sync(context)
        n_ctx = len(context)
        total = n_ctx + len(extra)
        if total < 2 or max_ngram < 1:
            return NO_ENDS, 0
        if len(extra):
            last = extra[-1]
            slot = self.where.get(last.item())
            mine = slot[0][: slot[1]] if slot is not None else NO_ENDS          # [c] in the context
            hits = np.flatnonzero(extra[:-1] == last) + n_ctx                   # [h] in extra
            ends = np.concatenate([mine, hits]) if hits.size else mine
            suffix = span(context, extra, max(total - max_ngram, 0), total)
            read = lambda at: read_joined(context, extra, at)                   # noqa: E731
        else:
            positions, count = self.where[context[-1].item()]
            ends = positions[: count - 1]         # [c] before the last token, which is the last of them
            suffix = context[max(n_ctx - max_ngram, 0):]
            read = context.__getitem__
        if not ends.size:
            return NO_ENDS, 0
        return extend(read, ends, suffix)

    def sync(self, context: np.ndarray) -> np.ndarray:
        """Index `context` [n]; return it C-contiguous (what `_find` reads)."""
        context = np.ascontiguousarray(context)
        n = len(context)
        if context.dtype != self.dtype:
            self._build(context)
            return context
        same = min(self.size, n)
        if not self.raw.startswith(context if same == n else context[:same]):      # memcmp
            same = self._common(context, same)
        elif same == n == self.size:                                # unchanged (MLA's inner steps)
            return context
        if (self.size - same) + (n - same) > self.SMALL + n // 4:
            self._build(context)
        else:
            self._drop(same)
            self._add(context, same)
        return context

    def _common(self, context: np.ndarray, m: int) -> int:
        """How long a prefix `context` shares with the indexed tokens, which differ within m."""
        held = np.frombuffer(self.raw[: m * self.dtype.itemsize], dtype=self.dtype)   # [m] a copy
        return int(np.argmax(held != context[:m]))

    def _drop(self, keep: int) -> None:
        """Forget positions keep.. (each token's last ones)."""
        if keep >= self.size:
            return
        cut = keep * self.dtype.itemsize
        for t in np.frombuffer(self.raw[cut:], dtype=self.dtype).tolist():
            self.where[t][1] -= 1
        del self.raw[cut:]
        self.size = keep

    def _add(self, context: np.ndarray, start: int) -> None:
        """Index context[start:], appended to the indexed tokens."""
        new = context[start:]
        for p, t in enumerate(new.tolist(), start):
            slot = self.where.get(t)
            if slot is None:
                self.where[t] = [np.array([p, 0, 0, 0], dtype=np.int64), 1]
                continue
            positions, count = slot
            if count == len(positions):      # full: double it
                positions = slot[0] = np.concatenate([positions, np.empty(len(positions), dtype=np.int64)])
            positions[count] = p
            slot[1] = count + 1
        self.raw.extend(new)
        self.size = len(context)

    def _build(self, context: np.ndarray) -> None:
        """Index `context` from scratch: each token's positions are a slice of one stable argsort."""
        order = np.argsort(context, kind="stable")                  # [n] positions by token, ascending within one
        keys = context[order]                                       # [n] sorted tokens
        starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) if len(keys) else NO_ENDS
        stops = np.append(starts[1:], len(keys))
        self.where = {t: [order[a:b], b - a] for t, a, b in zip(keys[starts].tolist(), starts.tolist(), stops.tolist())}
        self.raw = bytearray(context)
        self.dtype, self.size = context.dtype, len(context)


class Corpus:
    """Token ids searched after the context, indexed by token: `order` [m] sorts positions
    0..m-1 by their token (stable, so each token's positions stay ascending)."""

    LIMIT = 1 << 20        # tokens kept; the oldest generated text goes first

    def __init__(self, tokens=None):
        self.tokens = EMPTY if tokens is None else np.asarray(tokens, dtype=np.int32)
        self._index()

    def _index(self) -> None:
        body = self.tokens[:-1]                     # a match needs a token after it
        self.order = np.argsort(body, kind="stable").astype(np.int64)
        self.sorted = body[self.order]

    def copy(self) -> Corpus:
        """A corpus that starts with these tokens and grows on its own (the arrays are shared
        until either side adds)."""
        twin = Corpus.__new__(Corpus)
        twin.tokens, twin.order, twin.sorted = self.tokens, self.order, self.sorted
        return twin

    def add(self, tokens) -> None:
        """Remember generated text (it is searched from the next round on)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens):
            return
        self.tokens = np.concatenate([self.tokens, tokens])[-self.LIMIT:]
        self._index()

    def find(self, context: np.ndarray, max_ngram: int) -> tuple[int, int]:
        """(end, n) of the most recent occurrence in the corpus of the longest suffix n-gram of
        `context` (n <= max_ngram); (-1, 0) when its last token never occurs."""
        if not len(self.sorted) or not len(context):
            return -1, 0
        last = context[-1]
        lo, hi = np.searchsorted(self.sorted, last), np.searchsorted(self.sorted, last, side="right")
        ends = self.order[lo:hi]
        if not ends.size:
            return -1, 0
        ends, n = lengthen(self.tokens, ends, context, max_ngram)
        return int(ends[-1]), n


# Confidence levels for draft-length control: the n-gram size up to max_ngram, then one level
# more for each bucket of how far back the chosen match really extends. A long match means the
# text is being copied, and its continuation is far more likely to be accepted.
LONG_MATCH = (8, 16)


def confidence_level(tokens: np.ndarray, end: int, n: int, max_ngram: int) -> int:
    if n < max_ngram:
        return n
    extent = match_length(tokens, end, LONG_MATCH[-1])
    return max_ngram + sum(extent >= b for b in LONG_MATCH)


def joined_level(context: np.ndarray, extra: np.ndarray, end: int, n: int, max_ngram: int) -> int:
    """`confidence_level(context + extra, end, n, max_ngram)` without copying the context:
    `match_length` reads at most LONG_MATCH[-1] tokens back from `end` and from the last."""
    if n < max_ngram:
        return n
    reach, total = LONG_MATCH[-1], len(context) + len(extra)
    back = span(context, extra, max(end + 1 - reach, 0), end + 1)     # [<= reach] ending at `end`
    tail = span(context, extra, max(total - reach, 0), total)          # [<= reach] ending at the last
    return confidence_level(np.concatenate([back, tail]), len(back) - 1, n, max_ngram)


def level_prior(max_ngram: int) -> np.ndarray:
    """Prior per-position acceptance for each confidence level [max_ngram + len(LONG_MATCH) + 1]:
    short n-grams are weak evidence, long matches strong. Measurements take over within rounds."""
    short = np.linspace(0.3, 0.55, max(max_ngram - 1, 1))[: max_ngram - 1]
    return np.concatenate([[0.2], short, [0.75, 0.85, 0.92]])


class PromptLookup(Drafter):
    """Lookup in the context, then in the corpus. Its `level` is `confidence_level`'s, for
    draft-length control (flylocal.decoding.drafters.length)."""

    name = "pld"

    def __init__(self, eog: np.ndarray, max_ngram: int = 4, max_tokens: int | None = None,
                 corpus: Corpus | None = None):
        self.eog = eog                  # [n_vocab] bool
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens    # None: up to the round's k
        self.corpus = corpus
        self.index = ContextIndex()     # the context's token positions, kept across rounds

    def end(self, output: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(output)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        cap = k if self.max_tokens is None else min(k, self.max_tokens)
        if cap <= 0:
            return NO_DRAFT
        end, n = self.index.match(context, self.max_ngram)
        if n < self.max_ngram and self.corpus is not None:
            c_end, c_n = self.corpus.find(context, self.max_ngram)
            if c_n > n:
                tokens = self.corpus.tokens[c_end + 1 : c_end + 1 + cap]
                return Draft(stop_at_eog(tokens, self.eog), level=min(c_n, self.max_ngram))
        if n == 0:
            return NO_DRAFT
        tokens = context[end + 1 : end + 1 + cap]
        level = confidence_level(context, end, n, self.max_ngram)
        return Draft(stop_at_eog(tokens, self.eog), level=level)
