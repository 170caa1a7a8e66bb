"""A model whose layers live on llama.cpp rpc servers, run through a worker process
(docs/scale-out.md).

ggml's RPC client aborts its whole process when a server goes away, and waits without limit
for one that stops answering. So such a model's context lives in a worker process, and
the Runtime in this process (flylocal.llama.runtime, with `remote`) holds the model's
vocabulary only (tokenizing, chat templates, control tokens, end-of-generation ids), and its
context is a `RemoteContext`, which sends decodes to the worker:

    RemoteContext.decode(tokens, logits_from)  --("decode", keep, tokens, logits_from)-->  worker
        logits rows  <--  shared memory ([rows, n_vocab] float32, read in place)  <--  Context.decode

A roll-back only lowers `n_past` here; the next decode carries it (`keep`), so a round costs
one message each way. A worker that dies, or a call that outlasts --rpc-timeout (per
n_batch chunk of tokens), ends in one FlylocalError naming the server that is gone; the model
then holds nothing, and `reconnect()` (chat's /reset) starts a new worker once the servers
answer again. Whatever else was loaded (a local draft) is untouched.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, Pipe

import numpy as np

from flylocal.decoding.contracts import cost_curve, reusable_prefix
from flylocal.errors import FlylocalError
from flylocal.llama import kernels, rpc
from flylocal.llama.binding import interrupts_deferred
from flylocal.llama.config import RuntimeConfig
from flylocal.llama.context import cost_key, decode_args, one_sequence
from flylocal.llama.devices import Device
from flylocal.llama.model import Model

FIRST_ROWS = 16        # logits rows the shared buffer holds at first; it doubles as needed
POLL = 0.2             # seconds between checks that the worker is alive, while waiting
CLOSE_WAIT = 3.0       # seconds a closing worker has to leave before it is killed


class RemoteContext:
    """A model's context on rpc servers, in a worker process: what `Context` does, by message.
    `model` is this process's vocabulary-only load of it."""

    thread_control = None               # compute runs on the servers' own threads (rpc-server --threads)
    footprint = (0, 0)                  # (bytes held here, on a GPU here): the model lives in its worker

    def __init__(self, model: Model, config: RuntimeConfig, n_vocab: int):
        self.model, self.name, self.path, self.config, self.n_vocab = model, model.name, model.path, config, n_vocab
        self._worker = None
        self._lost: str | None = None       # why the worker is gone, until reconnect()
        self._start()
        self.n_threads = self.calibration_threads = 0
        self._tokens = np.zeros(self.n_ctx, dtype=np.int32)  # [n_ctx] ids held in the worker's cache
        self.n_past = 0
        self.costs = cost_curve(self.cost_key())

    def cost_key(self) -> dict:
        return cost_key(self.model, self.config, self.calibration_threads, self.n_batch)

    def steady(self):
        return contextlib.nullcontext()       # the servers' thread count is theirs

    # ----- the worker -----
    def _start(self) -> None:
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._shm = tempfile.TemporaryFile(dir=shm_dir)
        self._cap = 0
        self._log = tempfile.TemporaryFile()
        ours, theirs = Pipe()
        env = dict(os.environ, GGML_NO_BACKTRACE="1",
                   FLYLOCAL_EXACT="1" if kernels.loaded() == kernels.EXACT else "0")
        try:
            self._worker = subprocess.Popen(
                [sys.executable, "-m", "flylocal.llama.worker", str(theirs.fileno()), str(self._shm.fileno())],
                pass_fds=(theirs.fileno(), self._shm.fileno()), stdin=subprocess.DEVNULL, stdout=self._log,
                stderr=self._log, env=env, start_new_session=True)    # Ctrl-C reaches this process only
        except OSError as e:
            raise FlylocalError(f"cannot start a worker for {self.name}: {e.strerror}") from None
        finally:
            theirs.close()
        self._conn: Connection = ours
        self._pending = 0                    # replies owed by calls an interrupt cut short
        self._conn.send((str(self.path), self.config))
        reply = self._reply(None)            # loading sends the weights: no time limit, but a dying worker is seen
        if reply[0] == "error":
            self._stop()
            raise FlylocalError(reply[1])
        _, self.n_ctx, self.n_batch, devices, self._description = reply
        self.devices = [Device(*d) for d in devices]
        self._grow(FIRST_ROWS)

    def _grow(self, rows: int) -> None:
        """Room for `rows` logits rows in the shared buffer."""
        cap = max(rows, 2 * self._cap, FIRST_ROWS)
        size = cap * self.n_vocab * 4
        os.ftruncate(self._shm.fileno(), size)
        self._map = mmap.mmap(self._shm.fileno(), size)     # earlier views keep the old map alive
        self._rows = np.frombuffer(self._map, dtype=np.float32).reshape(cap, self.n_vocab)
        self._cap = cap

    def _reply(self, limit: float | None):
        """The worker's next reply, within `limit` seconds (None: as long as it lives)."""
        start = time.monotonic()
        while True:
            try:
                if self._conn.poll(POLL):
                    return self._conn.recv()
            except (EOFError, OSError):
                self._lose("its worker ended")
            if self._worker.poll() is not None and not self._conn.poll(0):
                self._lose("its worker ended")
            if limit is not None and time.monotonic() - start > limit:
                self._lose(f"no answer within --rpc-timeout {limit:g} s")

    def _call(self, message, limit: float | None):
        if self._lost:
            raise FlylocalError(self._lost)
        if self._worker is None:
            raise FlylocalError(f"{self.name} was already closed")
        while self._pending:                 # a reply owed to a call Ctrl-C cut short
            self._reply(limit)
            self._pending -= 1
        with interrupts_deferred():          # a message is sent whole, and counted
            self._conn.send(message)
            self._pending += 1
        reply = self._reply(limit)
        self._pending -= 1
        if reply[0] == "error":
            raise FlylocalError(reply[1])
        return reply

    def _lose(self, what: str):
        """The worker is gone: stop it, say which server went away, hold nothing."""
        log = self._log_tail()
        self._stop()
        silent = rpc.silent_servers(self.config.rpc)
        if silent:
            gone = ", ".join(f"{e.endpoint} ({e.reason})" for e in silent)
            what = f"lost rpc server{'s' * (len(silent) > 1)} {gone}, which held {self.name}"
        else:
            what = f"lost {self.name} on rpc servers {', '.join(self.config.rpc)} ({log or what})"
        self._lost = (f"{what}: its context is gone; once the server answers again, /reset in chat, the next "
                      "request to flylocal serve or a new run reconnects")
        self.n_past = 0
        raise FlylocalError(self._lost)

    def _log_tail(self) -> str:
        try:
            self._log.seek(0)
            lines = [line.strip() for line in self._log.read().decode("utf-8", "replace").splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1] if lines else ""

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            self._conn.close()
        except OSError:
            pass
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        for f in (self._shm, self._log):
            f.close()

    def reconnect(self) -> bool:
        """Start a new worker when the last one was lost (True), once every server answers."""
        if self._lost is None:
            return False
        rpc.check_servers(self.config.rpc)
        self._start()
        self._lost = None
        self.n_past = 0
        return True

    @property
    def lost(self) -> str | None:
        return self._lost

    # ----- the context's interface, by message -----
    def _check_open(self) -> None:
        if self.model.handle is None:
            raise FlylocalError(f"{self.name} was already closed")

    @property
    def closed(self) -> bool:
        return self.model.handle is None

    def description(self) -> str:
        return self._description

    @property
    def tokens(self) -> np.ndarray:  # [n_past] int32, a view
        return self._tokens[: self.n_past]

    # ----- one sequence, as the decoding core's Sequences (a server's one slot) -----
    n_seq = 1
    decoded_on = None           # the servers decode on their own threads (contracts.Target.decoded_on)

    @property
    def past(self) -> list[int]:
        return [self.n_past]

    def cached(self, seq: int) -> np.ndarray:  # [n_past] int32, a view
        if seq:
            one_sequence(seq)
        return self.tokens

    def split(self, rows: dict[int, int]) -> list[int]:
        return [n for n in rows.values() if n > 0]

    def decode_batch(self, parts) -> list:
        """A shared decode of one sequence's part: its decode."""
        return [self.decode(tokens, logits_from, seq=seq) for seq, tokens, logits_from in parts]

    def decode(self, tokens, logits_from: int | None = None, *, seq: int = 0) -> np.ndarray | None:
        if seq:
            one_sequence(seq)
        self._check_open()
        tokens, _, rows = decode_args(tokens, logits_from, self.n_past, self.n_ctx, self.n_batch)
        n = len(tokens)
        if rows > self._cap:
            self._grow(rows)
        if n == 0:
            return None
        chunks = -(-n // self.n_batch)
        self._call(("decode", self.n_past, tokens, logits_from, self._cap), self.config.rpc_timeout * chunks)
        self._tokens[self.n_past : self.n_past + n] = tokens
        self.n_past += n
        return self._rows[:rows] if rows else None

    def truncate(self, n_keep: int, *, seq: int = 0) -> None:
        """Lower `n_past`: the worker's cache is rolled back to it by the next decode."""
        if seq:
            one_sequence(seq)
        if n_keep < 0:
            raise ValueError("n_keep must be >= 0")
        self.n_past = min(self.n_past, n_keep)

    def drop(self, start: int, count: int, *, seq: int = 0) -> bool:
        """The worker's cache cannot move positions: rolled back to `start` (Context.drop)."""
        self.truncate(start, seq=seq)
        return False

    def reuse_prefix(self, tokens: np.ndarray, *, seq: int = 0) -> int:
        keep = reusable_prefix(self._tokens[: self.n_past], tokens)
        self.truncate(keep, seq=seq)
        return keep

    def reset(self) -> None:
        self.n_past = 0

    def set_threads(self, n: int) -> None:
        self.n_threads = n          # the servers decode on their own threads (rpc-server --threads)

    def close(self) -> None:
        if self._worker is not None:
            try:
                if not self._pending:
                    self._conn.send(("close",))
                    self._worker.wait(CLOSE_WAIT)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop()
        self._lost = None
