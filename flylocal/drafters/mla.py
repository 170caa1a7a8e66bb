"""MLA (multi-level acceleration): the draft model sped up by prompt lookup.

Prompt lookup proposes up to P tokens; the draft model checks them in one batched forward
with strict matching against its own greedy choice, and contributes its own next token at the
first disagreement. This repeats until k tokens exist. The draft equals the draft model's
greedy continuation, obtained with fewer draft forwards (SPEC.md, "MLA").
"""

from __future__ import annotations

import numpy as np

from flylocal.drafters import Draft, stop_at_eog
from flylocal.drafters.pld import prompt_lookup
from flylocal.verifiers import native_prefix


class MLADrafter:
    name = "mla"
    adaptive = False

    def __init__(self, model, target_vocab: int, eog: np.ndarray, max_ngram: int = 4, max_tokens: int = 6):
        self.model = model
        self.target_vocab = target_vocab
        self.eog = eog                    # [n_vocab] bool
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens      # P
        self.forwards = 0                 # draft-model forwards, for stats

    def propose(self, context: np.ndarray, k: int) -> Draft:
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return Draft(np.zeros(0, dtype=np.int32))
        draft = np.zeros(0, dtype=np.int32)
        feed = context[self.model.reuse_prefix(context):]
        while len(draft) < k:
            room = min(self.max_tokens, k - len(draft) - 1)   # one slot for the model's own token
            guess, _ = prompt_lookup(np.concatenate([context, draft]), self.max_ngram, room)
            guess = stop_at_eog(guess, self.eog)
            if len(guess) and self.eog[guess[-1]]:
                guess = guess[:-1]                              # let the model choose EOG itself
            logits = self.model.decode(np.concatenate([feed, guess]), logits_from=len(feed) - 1)
            self.forwards += 1
            choice = logits.argmax(axis=1).astype(np.int32)    # [len(guess)+1]
            m = native_prefix(guess, choice)
            self.model.truncate(self.model.n_past - (len(guess) - m))
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
