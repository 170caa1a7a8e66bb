"""MLA (multi-level acceleration): the draft model sped up by prompt lookup.

Prompt lookup proposes up to P tokens; the draft model checks them in one batched forward
with strict matching against its own greedy choice, and contributes its own next token at the
first disagreement. This repeats until k tokens exist. The draft equals the draft model's
greedy continuation, obtained with fewer draft forwards (docs/design.md, "Drafters").

This inner loop is speculative decoding of the draft model, so the same draft-length control
applies (flylocal.decoding.adaptive), on the draft model's cost curve: on a CPU, where checking 2 rows
costs about 2 single steps, a lookup proposal is only checked at a length its measured
acceptance pays for; elsewhere the loop takes ordinary draft-model steps. Around it, the round
chooses between this draft, prompt lookup alone and a plain step as `model` does.
"""

from __future__ import annotations

import time

import numpy as np

from flylocal.decoding.adaptive import DraftLength, Learned, ModelDraftLength, streak_after, top_probability
from flylocal.decoding.contracts import Draft
from flylocal.decoding.drafters.model import ModelBased
from flylocal.decoding.drafters.pld import ContextIndex, joined_level, level_prior, span, stop_at_eog
from flylocal.decoding.verifiers.base import native_prefix


class MLADrafter(ModelBased):
    name = "mla"

    def __init__(self, model, target_vocab: int, eog: np.ndarray, max_ngram: int = 4, max_tokens: int = 6,
                 adaptive_lookup: bool = True, learned: Learned | None = None, **kw):
        learned = learned if learned is not None else Learned()
        super().__init__(model, target_vocab, eog, max_ngram=max_ngram, learned=learned, **kw)
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens      # P
        # How much of a lookup guess the draft model checks, on the draft model's cost curve.
        self.guess_length = (learned.keep("guess", DraftLength(max_tokens, level_prior(max_ngram), model.costs))
                             if adaptive_lookup else None)
        self.guess_streak = False         # the draft model accepted the whole last guess (this request's)
        self.index = ContextIndex()       # the context's token positions, kept across rounds

    def controllers(self) -> tuple:
        return super().controllers() + ((self.guess_length,) if self.guess_length is not None else ())

    def begin(self, budget: int | None = None) -> None:
        super().begin(budget)
        self.guess_streak = False

    def _lookup(self, context: np.ndarray, draft: np.ndarray, room: int) -> tuple[np.ndarray, int]:
        """(guess, level): prompt lookup after context + draft (the draft so far), up to `room`
        tokens; the context is looked up in the index, not copied."""
        if room <= 0:
            return draft[:0], 0
        end, n = self.index.match(context, self.max_ngram, extra=draft)
        if n == 0:
            return draft[:0], 0
        guess = stop_at_eog(span(context, draft, end + 1, end + 1 + room), self.eog)
        if len(guess) and self.eog[guess[-1]]:
            guess = guess[:-1]                                  # let the model choose EOG itself
        return guess, joined_level(context, draft, end, n, self.max_ngram)

    def _draft(self, context: np.ndarray, k: int, keep) -> Draft:
        draft = np.zeros(0, dtype=np.int32)
        levels: list[int] = []
        if self.guess_length is not None:
            self._ensure_costs(context)
        feed = self._catch_up(context)
        while len(draft) < k:
            room = min(self.max_tokens, k - len(draft) - 1)   # one slot for the model's own token
            guess, level = self._lookup(context, draft, room)
            if self.guess_length is not None and len(guess):
                guess = guess[: self.guess_length.choose(self.guess_length.row(level, self.guess_streak), len(guess))]
            t0 = time.perf_counter()
            logits = self.model.decode(np.concatenate([feed, guess]), logits_from=len(feed) - 1)
            choice = logits.argmax(axis=1).astype(np.int32)    # [len(guess)+1]
            m = native_prefix(guess, choice)
            self.model.truncate(self.model.n_past - (len(guess) - m))
            if self.guess_length is not None:
                self.guess_length.update(self.guess_length.row(level, self.guess_streak), len(guess), m,
                                         time.perf_counter() - t0)
                self.guess_streak = streak_after(len(guess), m)
            new = np.append(guess[:m], choice[m]).astype(np.int32)
            # [m+1] the draft's confidence in each
            p = top_probability(logits[: m + 1]) if keep is not None else np.ones(m + 1)
            stop = len(new)
            for i in range(len(new)):
                if new[i] >= self.target_vocab or (keep is not None and not keep(levels, float(p[i]))):
                    stop = i
                    break
                levels.append(ModelDraftLength.level(float(p[i])))
            if stop < len(new):           # tokens the draft's cache holds past it are caught up later
                draft = np.concatenate([draft, new[:stop]])
                break
            draft = np.concatenate([draft, new])
            if self.eog[new].any():
                break
            feed = new[-1:]
        draft = stop_at_eog(draft[:k], self.eog)
        return Draft(draft, levels=levels[: len(draft)])

