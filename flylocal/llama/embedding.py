"""Embeddings of texts by a loaded model (docs/serving.md, "Embeddings").

A context of its own, in llama.cpp's embedding mode: the model's hidden states at every
position of an input, averaged (mean pooling) and scaled to unit length (L2), so that a dot
product of two vectors is their cosine similarity. Generation's context, its cache and its
cost curve are never touched. Each input is decoded on a cleared cache: an input's vector is
the same whatever else a request or its neighbours embed (inputs packed into one decode came
out differently, by a cosine of up to 5e-4; packing was worth a quarter of short inputs'
throughput at most: docs/serving.md, "Embeddings").

A causal model (every generating model) reads an input in pieces of at most PIECE tokens, each
a decode on the cache the earlier ones left: a position's hidden state depends only on the
positions before it, so the pieces give the states one decode would, and the mean is taken
here. Between two pieces a server runs other work, or stops when the client has left, however
long the input. A model whose attention looks both ways (an encoder, such as BERT) needs an
input whole, in one decode, pooled by llama.cpp, which asks the job's cancel flag between the
graph's nodes, so that it stops there when the client has left.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from flylocal.errors import FlylocalError, ModelError
from flylocal.llama.binding import interrupts_deferred, last_error, llama_cpp
from flylocal.llama.config import RuntimeConfig
from flylocal.llama.context import flash_attn_type
from flylocal.llama.model import Model
from flylocal.llama.vocab import Vocabulary

PIECE = 256             # tokens of an input decoded at a time by a causal model (about 1 s on 2 cores)


class TooLong(FlylocalError):
    """An input longer than the embedding context: `index` is its place in the request."""

    def __init__(self, index: int, n_tokens: int, n_ctx: int):
        super().__init__(f"input {index} is {n_tokens} tokens; the embedding context holds {n_ctx} (--ctx)")
        self.index, self.n_tokens, self.n_ctx = index, n_tokens, n_ctx


class Embedder:
    """Mean-pooled, L2-normalized embeddings from `model` (its `vocab` reads text), inputs of
    at most `n_ctx` tokens. `owned`: the model is the embedder's own, freed with it."""

    def __init__(self, model: Model, vocab: Vocabulary, n_ctx: int, threads: int, owned: bool = False,
                 piece: int = PIECE, whole: bool = False):
        self.model, self.vocab, self.owned = model, vocab, owned
        self.name = model.name
        self.n_vocab = vocab.n_vocab
        n_ctx = max(16, min(n_ctx, model.n_ctx_train or n_ctx))
        arch = model.meta("general.architecture") or ""
        # llama.cpp's converters write attention.causal false for models that look both ways;
        # `whole` reads any model's inputs whole, as an encoder's are read
        self.causal = not whole and model.meta(f"{arch}.attention.causal") != "false"
        # a causal model's pieces; otherwise an input is one ubatch, which pooling sees whole
        self.piece = max(1, min(piece, n_ctx)) if self.causal else n_ctx
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = self.piece
        cparams.n_ubatch = self.piece
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = flash_attn_type("auto")     # off in the exact build: pieces then agree
        cparams.embeddings = True
        cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE if self.causal else llama_cpp.LLAMA_POOLING_TYPE_MEAN
        cparams.no_perf = True
        with interrupts_deferred():
            self._ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
        if not self._ctx:
            if owned:
                model.free()
            raise ModelError(f"cannot create an embedding context for {model.path}: {last_error()}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        # An encoder's input is one decode, however long: the running job's cancel flag is read
        # within it (llama.cpp asks between the graph's nodes), so that a client that leaves stops
        # it there. A causal model's pieces stop between two instead, at no cost in the decode.
        self._cancel: threading.Event | None = None
        if not self.causal:
            self._abort = llama_cpp.ggml_abort_callback(lambda _: self._cancel is not None and self._cancel.is_set())
            llama_cpp.llama_set_abort_callback(self._ctx, self._abort, None)
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx(self._ctx))
        self.n_embd = int(llama_cpp.llama_model_n_embd(model.handle))
        n = self.piece
        self._batch = llama_cpp.llama_batch_init(n, 0, 1)
        self._b_token = np.ctypeslib.as_array(self._batch.token, shape=(n,))     # [piece] int32
        self._b_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n,))         # [piece] int32
        self._b_out = np.ctypeslib.as_array(self._batch.logits, shape=(n,))      # [piece] int8
        self._b_nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))   # [piece] int32
        for row in range(n):                                                      # every input: sequence 0
            self._batch.seq_id[row][0] = 0

    @classmethod
    def open(cls, path, n_ctx: int, threads: int, n_gpu_layers: int = 0) -> Embedder:
        """An embedder of the model at `path`, loaded for embeddings alone."""
        model = Model(path, RuntimeConfig(n_ctx=n_ctx, n_threads=threads, n_gpu_layers=n_gpu_layers))
        try:
            vocab = Vocabulary(model)
        except BaseException:
            model.free()
            raise
        return cls(model, vocab, n_ctx, threads, owned=True)

    def tokenize(self, text: str) -> np.ndarray:
        """A text as this model reads it for embedding: plain text, its own special tokens
        (a beginning of sequence) added."""
        return self.vocab.tokenize(text, add_special=True, parse_special=False)

    def check(self, inputs: list[np.ndarray]) -> None:
        """TooLong for the first input the context cannot hold; FlylocalError for an empty one."""
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise FlylocalError(f"input {i} is empty")
            if len(ids) > self.n_ctx:
                raise TooLong(i, len(ids), self.n_ctx)

    def embed(self, inputs: list[np.ndarray]) -> np.ndarray:
        """[len(inputs), n_embd] float32 unit vectors of token-id inputs, a decode each (`steps`,
        run to its end)."""
        steps = self.steps(inputs)
        try:
            next(steps)
            while True:
                steps.send(None)
        except StopIteration as done:
            return done.value

    def steps(self, inputs: list[np.ndarray], cancel: threading.Event | None = None):
        """`embed` as a generator of decodes, for a server to run other work between two, or to
        stop there: a causal model's input a piece at a time, of at most the token budget sent
        to the step (None: PIECE), an encoder's input whole, stopped within its decode once
        `cancel` is set. It returns the vectors. Primed with next() (nothing is decoded), then
        driven by send()."""
        self.check(inputs)
        if self._ctx is None:
            raise FlylocalError(f"{self.name} was already closed")
        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        budget = yield
        self._cancel = cancel
        try:
            yield from self._vectors(inputs, out, budget)
        finally:
            self._cancel = None
        return out

    def _vectors(self, inputs: list[np.ndarray], out: np.ndarray, budget: int | None):
        """steps' decodes, each input's unit vector into its row of `out` ([len(inputs), n_embd])."""
        for j, ids in enumerate(inputs):
            if self.causal:
                total = np.zeros(self.n_embd, dtype=np.float64)    # [n_embd] the states summed
                start = 0
                while start < len(ids):
                    end = start + max(1, min(budget or self.piece, self.piece))
                    total += self._decode(ids[start:end], start).sum(axis=0, dtype=np.float64)
                    start = end
                    if start < len(ids):
                        budget = yield
                vector = (total / len(ids)).astype(np.float32)
            else:
                self._decode(ids, 0)
                pointer = llama_cpp.llama_get_embeddings_seq(self._ctx, 0)
                if not pointer:
                    raise FlylocalError(f"llama.cpp gave no pooled embedding for input {j}")
                vector = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                               shape=(self.n_embd,))
            norm = float(np.linalg.norm(vector))
            out[j] = vector / norm if norm > 0 else vector
            if j + 1 < len(inputs):
                budget = yield

    def _decode(self, ids: np.ndarray, start: int) -> np.ndarray | None:
        """Decode `ids` at positions from `start` (a new input's first piece on a cleared
        cache); a causal model's hidden states of them ([len(ids), n_embd] float32, a view
        valid until the next decode)."""
        n = len(ids)
        self._b_token[:n] = ids
        self._b_pos[:n] = np.arange(start, start + n, dtype=np.int32)
        self._b_nseq[:n] = 1
        self._b_out[:n] = 1
        self._batch.n_tokens = n
        with interrupts_deferred():
            if start == 0:
                llama_cpp.llama_memory_clear(self._mem, True)
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc == 2 and self._cancel is not None and self._cancel.is_set():
            raise FlylocalError("the request was cancelled")
        if rc != 0:
            raise FlylocalError(f"llama_decode failed on {self.name} (embeddings): error {rc}")
        if not self.causal:
            return None
        pointer = llama_cpp.llama_get_embeddings(self._ctx)
        if not pointer:
            raise FlylocalError(f"llama.cpp gave no hidden states for {self.name} (embeddings)")
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n, self.n_embd))

    def close(self) -> None:
        if self._ctx:
            ctx, self._ctx = self._ctx, None
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(ctx)
        if self.owned:
            self.model.free()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
