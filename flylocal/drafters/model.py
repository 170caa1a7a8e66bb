"""Draft model: the draft model's own greedy continuation, one draft forward per token.

The draft keeps its own KV cache. Before each draft it rolls back to the longest prefix it
shares with the committed context and evaluates what it has not seen (the correction or
bonus token of the last round, or a new chat turn).
"""

from __future__ import annotations

import numpy as np

from flylocal.drafters import Draft


class ModelDrafter:
    name = "model"
    adaptive = False

    def __init__(self, model, target_vocab: int, eog: np.ndarray):
        self.model = model                # Runtime of the draft model
        self.target_vocab = target_vocab
        self.eog = eog                    # [n_vocab] bool, the target's end-of-generation ids

    def propose(self, context: np.ndarray, k: int) -> Draft:
        k = min(k, self.model.n_ctx - len(context))
        out = []
        if k <= 0:
            return Draft(np.zeros(0, dtype=np.int32))
        feed = context[self.model.reuse_prefix(context):]
        while True:
            logits = self.model.decode(feed, logits_from=len(feed) - 1)   # [1, n_vocab_draft]
            token = int(logits[0].argmax())
            if token >= self.target_vocab:
                break
            out.append(token)
            if len(out) == k or self.eog[token]:
                break
            feed = out[-1:]
        return Draft(np.asarray(out, dtype=np.int32))
