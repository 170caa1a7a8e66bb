"""Prompt lookup (PLD): propose the continuation of the most recent earlier occurrence of the
context's final n-gram, trying n from `max_ngram` down to 1. No model, no training.

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
    n = 1
    while n < max_ngram and n < len(context):
        room = ends[ends >= n]
        longer = room[source[room - n] == context[-1 - n]]
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

    def end(self, output: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(output)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        cap = k if self.max_tokens is None else min(k, self.max_tokens)
        if cap <= 0:
            return NO_DRAFT
        end, n = find_match(context, self.max_ngram)
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
