"""llama-cpp-python's own high-level generation, as the benchmark's point of comparison
(`flylocal bench`'s llama-cpp-python methods). Its models load through llama-cpp-python's
`Llama`, in the build flylocal loaded (flylocal.llama.binding)."""

from __future__ import annotations

import time
from pathlib import Path

from flylocal.llama.binding import llama_cpp, take_log
from flylocal.llama.config import RuntimeConfig
from flylocal.host import usable_cores


class LlamaCppPythonBaseline:
    """llama-cpp-python's own high-level generation, greedy, as a point of comparison: its
    `create_completion` on the prompt token ids flylocal rendered (so the format is the same),
    optionally with its own prompt-lookup drafter (which needs an n_ctx x n_vocab logits buffer).

    With a draft model, llama-cpp-python keeps logits for every position but sizes their buffer
    from the `logits_all` argument (n_batch rows unless it is True), so past n_batch tokens of
    prompt plus output its `eval` fails to broadcast into an empty slice; asking for
    `logits_all=True` gives the buffer the n_ctx rows it uses."""

    def __init__(self, path: Path, config: RuntimeConfig, prompt_lookup: bool = False):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = config.n_threads or usable_cores()
        self._llama = llama_cpp.Llama(
            model_path=str(path), n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=config.n_gpu_layers, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4) if prompt_lookup else None,
            logits_all=prompt_lookup,
        )
        take_log()                 # Llama set its own log: llama.cpp's goes to flylocal's ring again

    def generate(self, prompt_ids, max_tokens: int, sampling=None, reuse: bool = False) -> tuple[str, int, float, float]:
        """(text, completion tokens, wall seconds, decode seconds after the first token).
        With `reuse`, llama-cpp-python keeps the prefix its cache shares with the prompt (a
        later turn of a conversation), as flylocal does."""
        if not reuse:
            self._llama.reset()
        t0 = time.perf_counter()
        first = None
        pieces = []
        if sampling is None or sampling.greedy:
            options = dict(temperature=0.0, top_k=1)
        else:
            options = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                           min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty, seed=sampling.seed)
        for chunk in self._llama.create_completion([int(t) for t in prompt_ids], max_tokens=max_tokens,
                                                   stream=True, **options):
            if first is None:
                first = time.perf_counter()
            pieces.append(chunk["choices"][0]["text"])
        end = time.perf_counter()
        text = "".join(pieces)
        n = len(self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)) if text else 0
        return text, n, end - t0, end - (first or end)

    def close(self) -> None:
        self._llama.close()
