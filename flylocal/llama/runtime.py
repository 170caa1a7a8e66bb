"""One GGUF model ready to decode: the Target of the decoding core (flylocal.decoding.contracts),
made of the model's load (flylocal.llama.model), its vocabulary (flylocal.llama.vocab) and its
context (flylocal.llama.context), or, for a model placed on llama.cpp rpc servers, a context in
a worker process (flylocal.llama.remote).

    Runtime(path, config)                   the model here (its layers on rpc servers when
                                            `config.rpc` names them: a worker runs that)
    Runtime(path, config, remote=True)      this process keeps the vocabulary; the worker the rest

The Runtime is also the decoding core's `Sequences` (flylocal.decoding.contracts): `sequence(s)`
is sequence s as a Target of its own, `decode_batch` appends to several in one decode. With
`config.n_seq` > 1 (a local model only) the context holds that many; a model on rpc servers
holds one.
"""

from __future__ import annotations

import os

import numpy as np

from flylocal.decoding import contracts
from flylocal.decoding.contracts import Target
from flylocal.llama.config import RuntimeConfig
from flylocal.llama.context import Context
from flylocal.llama.model import Model
from flylocal.llama.vocab import Vocabulary


class Runtime(Target, contracts.Vocabulary):
    """A loaded model with one context: its text, its decodes, its rollback. As a Target it is
    sequence 0 of the context; `sequence(s)` is any one of them."""

    def __init__(self, path: str | os.PathLike, config: RuntimeConfig = RuntimeConfig(), *, remote: bool = False):
        self.model = self.context = None
        if remote:
            from flylocal.llama import rpc
            from flylocal.llama.remote import RemoteContext

            rpc.check_servers(config.rpc)   # one line naming a server that does not answer, in seconds
        load = None
        if not remote and config.n_threads is None:    # --threads auto reads the load from here on
            from flylocal.host import CpuLoad

            load = CpuLoad()
            load.start()
        self.model = Model(path, config, vocab_only=remote)
        self.path, self.name, self.config, self.n_ctx_train = self.model.path, self.model.name, config, self.model.n_ctx_train
        try:
            self.vocab = Vocabulary(self.model)
            self.context = (RemoteContext(self.model, config, self.vocab.n_vocab) if remote else
                            Context(self.model, config, self.vocab.n_vocab, load=load))
        except BaseException:
            self.model.free()
            raise
        vocab, context = self.vocab, self.context
        self.n_vocab, self.bos, self.eos, self.add_bos = vocab.n_vocab, vocab.bos, vocab.eos, vocab.add_bos
        self.vocab_type, self.fim = vocab.vocab_type, vocab.fim      # fim: FimTokens
        self.n_ctx, self.n_batch, self.devices = context.n_ctx, context.n_batch, context.devices
        self.n_seq = context.n_seq
        self.footprint = context.footprint      # (bytes held, of them on a GPU)
        self.thread_control, self.calibration_threads = context.thread_control, context.calibration_threads

    # ----- the cache (the context's) -----
    @property
    def n_past(self) -> int:
        return self.context.n_past

    @property
    def tokens(self) -> np.ndarray:  # [n_past] int32, a view
        return self.context.tokens

    @property
    def costs(self):
        return self.context.costs

    @costs.setter
    def costs(self, curve) -> None:
        self.context.costs = curve

    @property
    def n_threads(self) -> int:
        return self.context.n_threads

    @property
    def decoded_on(self) -> int | None:
        """The thread count of the last decode (None: on rpc servers)."""
        return self.context.decoded_on

    def thread_report(self) -> dict:
        """--threads auto: the count now, decodes at each count, other processes' load and each
        move with its reason (ThreadControl.report); a fixed count: just that."""
        control = self.thread_control
        if control is None:
            return {"count": self.n_threads, "decodes": None, "busy_cores": None,
                    "moves": [{"at_s": 0.0, "count": self.n_threads, "why": "as given"}]}
        return control.report()

    def decode(self, tokens, logits_from: int | None = None) -> np.ndarray | None:
        return self.context.decode(tokens, logits_from)

    def truncate(self, n_keep: int) -> None:
        self.context.truncate(n_keep)

    def drop(self, start: int, count: int) -> bool:
        return self.context.drop(start, count)

    def reuse_prefix(self, tokens: np.ndarray) -> int:
        return self.context.reuse_prefix(tokens)

    def reset(self) -> None:
        self.context.reset()

    # ----- several sequences (flylocal.decoding.batch) -----
    def sequence(self, seq: int) -> Sequence:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq}: {self.name} holds sequences 0..{self.n_seq - 1}")
        return Sequence(self, seq)

    def cached(self, seq: int) -> np.ndarray:
        return self.context.cached(seq)

    def decode_batch(self, parts) -> list:
        return self.context.decode_batch(parts)

    def split(self, rows: dict[int, int]) -> list[int]:
        return self.context.split(rows)

    def state(self, seq: int) -> bytes:
        return self.context.state(seq)

    def restore(self, seq: int, tokens: np.ndarray, data: bytes) -> bool:
        return self.context.restore(seq, tokens, data)

    def state_key(self) -> dict:
        return self.context.state_key()

    def cost_key(self) -> dict:
        return self.context.cost_key()

    def steady(self):
        return self.context.steady()

    def set_threads(self, n: int) -> None:
        self.context.set_threads(n)

    def reconnect(self) -> bool:
        """Start a worker again for a model whose rpc servers were lost, once they answer (True);
        False when nothing was lost."""
        return self.context.reconnect()

    @property
    def lost(self) -> str | None:
        return self.context.lost

    # ----- text (the vocabulary's) -----
    @property
    def eog_mask(self) -> np.ndarray:  # [n_vocab] bool
        return self.vocab.eog_mask

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        return self.vocab.tokenize(text, add_special, parse_special)

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray | None:
        return self.vocab.tokenize_chat(messages, tools)

    def format_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        return self.vocab.format_chat(messages, tools)

    def chat_template(self) -> str | None:
        return self.vocab.chat_template()

    def tools_template(self) -> str | None:
        return self.vocab.tools_template()

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.vocab.piece(token, special)

    def detokenize(self, tokens, special: bool = False) -> str:
        return self.vocab.detokenize(tokens, special)

    def token_text(self, token: int) -> bytes:
        return self.vocab.token_text(token)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def is_control(self, token: int) -> bool:
        return self.vocab.is_control(token)

    def control_ids(self) -> dict[bytes, int]:
        return self.vocab.control_ids()

    def description(self) -> str:
        return self.context.description()

    # ----- lifetime -----
    def close(self) -> None:
        """Free the context and the model; any later use raises instead of touching freed
        memory. A cost curve refined by the rounds run is then written to the disk cache."""
        context = self.context
        if context is not None:
            context.close()
        if self.model is not None:
            self.model.free()
        if context is not None and context.costs.dirty:      # after freeing: a Ctrl-C here leaks nothing
            context.costs.save()

    @property
    def closed(self) -> bool:
        return self.context.closed

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Sequence(Target, contracts.Vocabulary):
    """Sequence `seq` of a Runtime's context as a Target of its own: its cells, its n_past, its
    rollback and prefix reuse; the model, vocabulary and cost curve are the Runtime's."""

    def __init__(self, runtime: Runtime, seq: int):
        self.runtime, self.seq = runtime, seq
        self.n_ctx, self.n_batch, self.n_vocab = runtime.n_ctx, runtime.n_batch, runtime.n_vocab
        self.name = runtime.name
        self.bos, self.add_bos = runtime.bos, runtime.add_bos

    @property
    def n_past(self) -> int:
        return self.runtime.context.past[self.seq]

    @property
    def tokens(self) -> np.ndarray:
        return self.runtime.context.cached(self.seq)

    @property
    def costs(self):
        return self.runtime.costs

    @property
    def eog_mask(self) -> np.ndarray:
        return self.runtime.eog_mask

    @property
    def decoded_on(self) -> int | None:
        return self.runtime.decoded_on

    def decode(self, tokens, logits_from: int | None = None) -> np.ndarray | None:
        return self.runtime.context.decode(tokens, logits_from, seq=self.seq)

    def truncate(self, n_keep: int) -> None:
        self.runtime.context.truncate(n_keep, seq=self.seq)

    def drop(self, start: int, count: int) -> bool:
        return self.runtime.context.drop(start, count, seq=self.seq)

    def reuse_prefix(self, tokens: np.ndarray) -> int:
        return self.runtime.context.reuse_prefix(tokens, seq=self.seq)

    def cost_key(self) -> dict:
        return self.runtime.cost_key()

    def steady(self):
        return self.runtime.steady()

    def thread_report(self) -> dict:
        return self.runtime.thread_report()

    # ----- text (the Runtime's) -----
    def tokenize(self, text, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        return self.runtime.tokenize(text, add_special, parse_special)

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.runtime.piece(token, special)

    def is_control(self, token: int) -> bool:
        return self.runtime.is_control(token)

    def control_ids(self) -> dict[bytes, int]:
        return self.runtime.control_ids()
