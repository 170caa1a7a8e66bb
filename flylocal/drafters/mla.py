"""MLA (multi-level acceleration): the draft model sped up by prompt lookup.

Prompt lookup proposes up to P tokens; the draft model checks them in one batched forward
with strict matching against its own greedy choice, and contributes its own next token at the
first disagreement. This repeats until k tokens exist. The draft equals the draft model's
greedy continuation, obtained with fewer draft forwards (docs/design.md, "Drafters").

This inner loop is speculative decoding of the draft model, so the same draft-length control
applies (flylocal.adaptive): on a CPU, where checking 2 rows costs about 2 single steps, a
lookup proposal is only checked at a length its measured acceptance pays for; elsewhere the
loop takes ordinary draft-model steps.
"""

from __future__ import annotations

import time

import numpy as np

from flylocal.adaptive import DraftLength, timed_decode
from flylocal.drafters import Draft, stop_at_eog
from flylocal.drafters.pld import confidence_level, find_match, level_prior
from flylocal.verifiers import native_prefix


class MLADrafter:
    name = "mla"
    adaptive = False            # the target-side draft length is fixed; the lookup length adapts inside

    def __init__(self, model, target_vocab: int, eog: np.ndarray, max_ngram: int = 4, max_tokens: int = 6,
                 adaptive_lookup: bool = True):
        self.model = model
        self.target_vocab = target_vocab
        self.eog = eog                    # [n_vocab] bool
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens      # P
        self.length = DraftLength(max_tokens, level_prior(max_ngram)) if adaptive_lookup else None

    def _lookup(self, seq: np.ndarray, room: int) -> tuple[np.ndarray, int]:
        end, n = find_match(seq, self.max_ngram)
        if n == 0 or room <= 0:
            return seq[:0], 0
        guess = stop_at_eog(seq[end + 1 : end + 1 + room], self.eog)
        if len(guess) and self.eog[guess[-1]]:
            guess = guess[:-1]                                  # let the model choose EOG itself
        return guess, confidence_level(seq, end, n, self.max_ngram)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return Draft(np.zeros(0, dtype=np.int32))
        draft = np.zeros(0, dtype=np.int32)
        feed = context[self.model.reuse_prefix(context):]
        if self.length is not None and not self.length.calibrated:
            self.model.decode(feed[:-1])
            self.length.calibrate(lambda rows: timed_decode(self.model, int(feed[-1]), rows))
            feed = feed[-1:]
        while len(draft) < k:
            room = min(self.max_tokens, k - len(draft) - 1)   # one slot for the model's own token
            guess, level = self._lookup(np.concatenate([context, draft]), room)
            if self.length is not None and len(guess):
                guess = guess[: self.length.choose(level, len(guess))]
            t0 = time.perf_counter()
            logits = self.model.decode(np.concatenate([feed, guess]), logits_from=len(feed) - 1)
            choice = logits.argmax(axis=1).astype(np.int32)    # [len(guess)+1]
            m = native_prefix(guess, choice)
            self.model.truncate(self.model.n_past - (len(guess) - m))
            if self.length is not None:
                self.length.update(level, len(guess), m, time.perf_counter() - t0)
            new = np.append(guess[:m], choice[m]).astype(np.int32)
            bad = np.flatnonzero(new >= self.target_vocab)
            if bad.size:
                draft = np.concatenate([draft, new[: bad[0]]])
                break
            draft = np.concatenate([draft, new])
            if self.eog[new].any():
                break
            feed = new[-1:]
        return Draft(stop_at_eog(draft[:k], self.eog))
