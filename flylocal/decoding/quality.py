"""How the target itself judges a generated text: mean negative log-likelihood per token.

Loose verifiers change the output by design; this is the target's own measure of how much
they cost. The text is teacher-forced through the target once, with logits only for the rows
that predict generated tokens, a chunk of n_batch rows at a time.
"""

from __future__ import annotations

import numpy as np


def target_nll(target, prompt: np.ndarray, output) -> float:
    """Mean -log p_target(output[i] | prompt, output[:i]) over the output tokens (nats).
    `target` is a Runtime; its cache is reused where it shares a prefix and left holding the text."""
    output = np.asarray(output, dtype=np.int32)
    if len(output) == 0:
        return 0.0
    seq = np.concatenate([np.asarray(prompt, dtype=np.int32), output])
    first = len(prompt) - 1                      # row predicting output[0]
    kept = target.reuse_prefix(seq[: first + 1])
    target.decode(seq[kept:first])
    total = 0.0
    for start in range(first, len(seq) - 1, target.n_batch):
        stop = min(start + target.n_batch, len(seq) - 1)
        z = target.decode(seq[start:stop], logits_from=0)           # [rows, n_vocab] float32
        zmax = z.max(axis=1, keepdims=True)
        lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1, dtype=np.float64))
        total += float((lse - z[np.arange(stop - start), seq[start + 1 : stop + 1]]).sum())
    return total / len(output)
