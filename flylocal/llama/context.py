"""A model's llama.cpp context: one sequence (0), or `n_seq` of them each in a cache of its own
(a server's slots), decoded in batches that ask for logits only on the rows wanted, and rolled
back (docs/design.md, "The round"; docs/serving.md, "Several requests in one decode").

- `decode(tokens, logits_from)`: one batched decode; the logits of the rows from `logits_from`
  on come back as a zero-copy numpy view;
- `truncate(n_keep)`: the one way the cache rolls back (llama_memory_seq_rm, checked, with a
  re-evaluating fallback where partial removal is refused);
- `reuse_prefix(tokens)`: keeps the longest cached prefix of a token sequence (drafters' catch-up,
  chat's prompt reuse);
- `decode_batch(parts)`: one decode appending to several sequences (flylocal.decoding.batch).
  Each sequence has cells of its own (llama.cpp's per-sequence streams, kv_unified off): in the
  exact build a sequence's logits are then the same whatever shares its decode (measured). With
  `kv_unified` they share one cache instead, where an uneven decode is one computation.

Every operation takes a sequence (`seq`, 0 by default); `sequence(s)` is a Target bound to one.

The context keeps the token ids its cache holds (`tokens`), so the cache can always be rebuilt
and compared. With --threads auto, decodes of up to CONTROL_ROWS rows also steer its thread
count (flylocal.llama.threads), measured against the cost curve's shape for their row count.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import mmap
import time

import numpy as np

from flylocal.decoding.contracts import cost_curve, equal_split, reusable_prefix
from flylocal.errors import FlylocalError, ModelError
from flylocal.llama import kernels
from flylocal.llama.binding import KERNELS, interrupts_deferred, last_error, llama_cpp, logits_address
from flylocal.llama.config import RuntimeConfig, cell_types
from flylocal.llama.devices import gpu_offload, system_info
from flylocal.llama.model import Model, flash_attn_type, footprint
from flylocal.host import MIN_WALL, CpuLoad, usable_cores
from flylocal.llama.threads import auto

CONTROL_ROWS = 32     # decodes up to this many rows steer --threads auto (a round, a draft step)
LOAD_PERIOD = 1.0     # seconds over which --threads auto reads how busy other processes keep the cores


def held(model: Model, config: RuntimeConfig, flash: bool, n_vocab: int, n_seq: int) -> tuple[int, int]:
    """What a context of `n_seq` sequences for `model` will hold, checked first: refused in one
    line where this machine has no memory for it (Model.check_memory); (bytes held, of them on a
    GPU). A model on rpc servers is theirs to judge, and holds nothing here."""
    if config.rpc:
        return 0, 0
    model.check_memory(flash, n_vocab, n_seq)
    return footprint(model, config, flash, n_vocab, n_seq)


def cost_key(model: Model, config: RuntimeConfig, threads: int, n_batch: int) -> dict:
    """What a decode's cost depends on: the key of the model's cost curve (docs/design.md,
    "Cost model")."""
    st = model.path.stat()
    return {
        "model": str(model.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "kernels": KERNELS, "llama_cpp_python": llama_cpp.__version__,
        "build": kernels.exact_stamp() if KERNELS == kernels.EXACT else kernels.fast_stamp(),
        "system": hashlib.sha256(system_info().encode()).hexdigest()[:16],
        "gpu_layers": config.n_gpu_layers if gpu_offload() else 0,
        "flash_attn": int(flash_attn_type(config.flash_attn, remote=bool(config.rpc))),
        "threads": threads, "batch": n_batch,
    } | ({"rpc": list(config.rpc), "tensor_split": list(config.tensor_split),
          "rpc_output": config.rpc_output} if config.rpc else {})


class Context:
    """The context of `model`, its batch buffers, its KV bookkeeping and its thread control.
    `costs` is the cost curve of its decodes (flylocal.decoding.contracts.cost_curve)."""

    def __init__(self, model: Model, config: RuntimeConfig, n_vocab: int, load: CpuLoad | None = None):
        """`load`: a meter of other processes' load, started before the model was loaded
        (--threads auto; one is started here otherwise)."""
        self.model = model
        self.name = model.name
        self.config = config
        self.n_vocab = n_vocab
        threads = config.n_threads or usable_cores()
        cparams = llama_cpp.llama_context_default_params()
        cparams.flash_attn_type = flash_attn_type(config.flash_attn, remote=bool(config.rpc))
        flash = cparams.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        n_seq = self.n_seq = config.n_seq
        if n_seq < 1:
            raise ValueError(f"a context of {n_seq} sequences")
        cparams.n_ctx = config.n_ctx * n_seq
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_seq_max = n_seq
        # Several sequences: a stream of cells each (a sequence's logits are then bit for bit the
        # same whatever shares its decode, and no row attends over another's cells), or, asked
        # for, one unified cache (a decode is one computation however uneven its rows).
        self.unified = n_seq > 1 and config.kv_unified
        cparams.kv_unified = self.unified
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        # A full-size sliding-window cache keeps every position a rollback may need (Gemma 3).
        cparams.swa_full = True
        cparams.no_perf = True
        cparams.type_k, cparams.type_v = cell_types(config, flash, exact=KERNELS == kernels.EXACT)
        self.footprint = held(model, config, flash, n_vocab, n_seq)    # (bytes held, of them on a GPU)
        with interrupts_deferred():
            self._ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
        if not self._ctx:
            model.free()
            raise ModelError(f"cannot create a context for {model.path}: {last_error()}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        # llama.cpp may round the context up (padding); the user's size is the limit.
        self.n_ctx = min(config.n_ctx, llama_cpp.llama_n_ctx(self._ctx) // n_seq)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)
        self.n_threads = threads

        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        n = self.n_batch
        self._b_token = np.ctypeslib.as_array(self._batch.token, shape=(n,))     # [n_batch] int32
        self._b_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n,))         # [n_batch] int32
        self._b_logits = np.ctypeslib.as_array(self._batch.logits, shape=(n,))   # [n_batch] int8
        np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))[:] = 1
        for i in range(n):
            self._batch.seq_id[i][0] = 0
        self._b_seq = np.zeros(n, dtype=np.int32)     # [n_batch] the sequence each row was last given

        self._seq_tokens = np.zeros((n_seq, self.n_ctx), dtype=np.int32)  # [n_seq, n_ctx] ids held per sequence
        # A sequence's `past` never exceeds what the cache holds. Where an exception (Ctrl-C) can
        # land between a change to the cache and the record of it, the sequence goes in
        # `_unsynced` first, and its next cache operation drops every cell past `past`.
        self.past = [0] * n_seq
        self._unsynced: set[int] = set()
        self._view = (None, None)                   # (the logits buffer's address, a view of it)
        self.decoded_on = threads          # the thread count of the last decode
        self._start_threads(threads, load)
        self._steady = 0       # > 0: thread count held (calibration measures one count)
        self.calibration_threads = threads
        # What a decode of n rows costs here, shared by everything that drafts for this model;
        # keyed for the disk cache by what it depends on.
        self.costs = cost_curve(cost_key(model, config, threads, self.n_batch))
        self.costs.on_key = self.n_threads == self.calibration_threads

    def _start_threads(self, threads: int, load: CpuLoad | None) -> None:
        """--threads auto (flylocal.llama.threads.auto): its controller and the meter of other
        processes' load (`load`, or one started here); each count measured before the first
        prompt (_probe_threads) unless the last process's count is recent."""
        self._gap = False      # the last reading spanned an idle gap: read again after MIN_WALL
        self._decoded_at = time.monotonic()    # when the last decode ended
        self.thread_control, self._probed, self._load = (None, True, None) if self.config.n_threads is not None \
            else auto(threads, load)

    def cost_key(self) -> dict:
        return cost_key(self.model, self.config, self.calibration_threads, self.n_batch)

    def state_key(self) -> dict:
        """What a sequence's state (`state`) depends on: the model file, the build and backend, and
        the cache's shape. A kept state under another key is never put back (docs/serving.md,
        "Prompt cache")."""
        key = cost_key(self.model, self.config, 0, 0)
        for name in ("threads", "batch"):           # a state's cells do not follow either
            del key[name]
        return key | {"n_ctx": self.n_ctx, "kv_unified": self.unified, "swa_full": True,
                      "type_k": self.config.type_k, "type_v": self.config.type_v}

    @property
    def devices(self) -> list:
        return self.model.devices             # the rpc servers' devices holding its layers, if any

    def description(self) -> str:
        return self.model.description()

    lost = None                               # a local context is never lost

    def reconnect(self) -> bool:
        return False

    def close(self) -> None:
        """Free the context; any later use raises instead of touching freed memory."""
        if self._ctx:
            ctx, self._ctx = self._ctx, None
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(ctx)

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def _check_open(self) -> None:
        if self._ctx is None:
            raise FlylocalError(f"{self.name} was already closed")

    @property
    def n_past(self) -> int:         # of sequence 0
        return self.past[0]

    @property
    def tokens(self) -> np.ndarray:  # [n_past] int32, a view (sequence 0)
        return self._seq_tokens[0, : self.past[0]]

    def cached(self, seq: int) -> np.ndarray:  # [past[seq]] int32, a view
        return self._seq_tokens[seq, : self.past[seq]]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq}: this context holds sequences 0..{self.n_seq - 1}")

    def decode(self, tokens, logits_from: int | None = None, *, seq: int = 0) -> np.ndarray | None:
        """Append `tokens` to the cache. Return the logits of rows `logits_from:` as a
        zero-copy view `[n_rows, n_vocab] float32`, valid until the next decode.

        Only the requested rows ever reach the output buffer. The rows before `logits_from` go
        in chunks of n_batch without logits until the rest fits one decode, which holds them
        and the requested rows together: a prompt's tail and the first round cost one decode
        (docs/design.md, "The round"). `logits_from=None` asks for none.
        """
        self._check_seq(seq)
        self._check_open()
        self._sync(seq)
        tokens, start, rows = decode_args(tokens, logits_from, self.past[seq], self.n_ctx, self.n_batch)
        n = len(tokens)
        control = self.thread_control is not None and not self._steady
        steer = control and start == 0 and 0 < rows <= CONTROL_ROWS
        if control and not steer:
            self._read_load()
        if start and control:
            self._read_load(force=True)
            if not self._probed:
                self._probe_threads(int(tokens[0]), seq)
            self._use_threads(self.thread_control.home)     # a prompt never runs on a count on trial
        i = 0
        while i < start and (n - i > self.n_batch or start >= n):
            j = min(start, i + self.n_batch)
            self._decode_chunk(tokens[i:j], logits_from=j - i, seq=seq)
            i = j
        if start >= n:
            return None
        if not steer:
            self._decode_chunk(tokens[i:], logits_from=start - i, seq=seq)
        else:
            self._read_load()
            self._use_threads(self.thread_control.current)
            t0 = time.perf_counter()
            self._decode_chunk(tokens, logits_from=0, seq=seq)
            self._steer(rows, time.perf_counter() - t0)
        return self._logits(rows)

    def _read_load(self, force: bool = False) -> None:
        """--threads auto: every LOAD_PERIOD (or now, before a prompt), tell the controller how
        many cores other processes kept busy since the last reading.

        A reading taken after more than a period without decoding spans an idle gap (between two
        requests, two turns of a chat), and what other work did then may be over: it counts no
        more cores than other processes have threads runnable now (a busy machine's prompt never
        runs on every core; one that was busy does), and the next reading comes after MIN_WALL
        of decoding instead of a period (docs/operations.md, "Threads")."""
        meter = self._load
        elapsed = meter.elapsed() if meter is not None else None
        if elapsed is None or (not force and elapsed < (MIN_WALL if self._gap else LOAD_PERIOD)):
            return
        if elapsed < MIN_WALL:
            if self.thread_control.busy is not None:
                return                     # too soon to tell: the last reading stands
            time.sleep(MIN_WALL - elapsed + 0.01)     # the first prompt: a reading, even if it costs a moment
        busy = meter.stop()
        if busy is not None:
            meter.start()
            self._gap = time.monotonic() - self._decoded_at > LOAD_PERIOD
            if self._gap and (now := CpuLoad.running_now()) is not None:
                busy = min(busy, float(now))
            self._use_threads(self.thread_control.load(busy))

    def _logits(self, rows: int) -> np.ndarray:
        """The output buffer's first `rows` rows as a view [rows, n_vocab] float32. A view is made
        when the buffer moves or more rows are asked for than it covers, and sliced otherwise (a
        ctypes array type and a numpy array every decode cost a round tens of microseconds)."""
        address = logits_address(self._ctx)
        at, view = self._view
        if at != address or len(view) < rows:
            pointer = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
            view = np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))
            self._view = address, view
        return view[:rows]

    def _decode_chunk(self, chunk: np.ndarray, logits_from: int, *, seq: int) -> None:
        """One llama_decode of `chunk` (at most n_batch tokens) on sequence `seq` (always named:
        a decode that lands on another sequence than its caller's corrupts both), with logits
        for rows `logits_from:`."""
        m = len(chunk)
        p0 = self.past[seq]
        self._b_token[:m] = chunk
        self._b_pos[:m] = np.arange(p0, p0 + m, dtype=np.int32)
        self._b_logits[:logits_from] = 0
        self._b_logits[logits_from:m] = 1
        self._set_seqs(0, m, seq)
        self._seq_tokens[seq, p0 : p0 + m] = chunk   # past `past`: not yet claimed as cached
        self._run(m, (seq,))
        self.past[seq] = p0 + m
        self._unsynced.discard(seq)                  # ... until here (`_run`)

    def _set_seqs(self, i: int, j: int, seq: int) -> None:
        """Rows i..j-1 of the batch belong to sequence `seq`."""
        rows = np.flatnonzero(self._b_seq[i:j] != seq)
        if rows.size:
            for r in (rows + i).tolist():
                self._batch.seq_id[r][0] = seq
            self._b_seq[i:j] = seq

    def _run(self, m: int, seqs) -> None:
        """llama_decode of the batch's first m rows, which append to `seqs`."""
        self._batch.n_tokens = m
        self.decoded_on = self.n_threads
        self._unsynced.update(seqs)            # their caches may hold more than `past` from here ...
        with interrupts_deferred():            # llama.cpp logs from inside a decode now and then
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
        self._decoded_at = time.monotonic()
        if rc != 0:
            # llama.cpp keeps the cells it wrote for earlier ubatches; _sync drops them.
            for seq in seqs:
                self._sync(seq)
            reason = {1: "no KV cache slot (context full)", 2: "aborted"}.get(rc, f"error {rc}")
            raise FlylocalError(f"llama_decode failed on {self.name}: {reason}")

    def split(self, rows: dict[int, int]) -> list[int]:
        """The row counts of the computations llama.cpp runs a decode of `rows` (sequence ->
        tokens) as: one per n_batch rows with a unified cache, `equal_split` with streams."""
        if self.unified:
            total = sum(rows.values())
            return [min(self.n_batch, total - i) for i in range(0, total, self.n_batch)]
        return equal_split(rows)

    def decode_batch(self, parts: list[tuple[int, np.ndarray, int | None]]) -> list[np.ndarray | None]:
        """One llama_decode appending each part's tokens to its sequence: part (seq, tokens,
        logits_from); each part's logits (rows logits_from:) as views [rows, n_vocab] float32
        valid until the next decode, None where logits_from is None (flylocal.decoding.contracts.Sequences)."""
        self._check_open()
        seqs = [seq for seq, _, _ in parts]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"sequences {seqs}: each at most once in a decode")
        i = 0
        wanted = []
        prepared = []
        for seq, tokens, logits_from in parts:
            self._check_seq(seq)
            self._sync(seq)
            tokens, start, rows = decode_args(tokens, logits_from, self.past[seq], self.n_ctx, self.n_batch)
            prepared.append((seq, tokens, start, rows))
            i += len(tokens)
        if i > self.n_batch:
            raise ValueError(f"{i} tokens in one decode; at most n_batch={self.n_batch}")
        # --threads auto steers on a shared decode run as one computation of every row's logits
        # (a round of several requests), as on a request's own round
        steer = (self.thread_control is not None and not self._steady and i <= CONTROL_ROWS
                 and all(start == 0 for _, _, start, _ in prepared)
                 and len(self.split({seq: len(t) for seq, t, _, _ in prepared})) == 1)
        if self.thread_control is not None and not self._steady:
            self._read_load()
            if steer:
                self._use_threads(self.thread_control.current)
        total_rows = i
        i = 0
        for seq, tokens, start, rows in prepared:
            m, p0 = len(tokens), self.past[seq]
            self._b_token[i : i + m] = tokens
            self._b_pos[i : i + m] = np.arange(p0, p0 + m, dtype=np.int32)
            self._b_logits[i : i + start] = 0
            self._b_logits[i + start : i + m] = 1
            self._set_seqs(i, i + m, seq)
            self._seq_tokens[seq, p0 : p0 + m] = tokens
            wanted.append(rows)
            i += m
        if not i:
            return [None] * len(parts)
        t0 = time.perf_counter()
        self._run(i, seqs)
        if steer:
            self._steer(total_rows, time.perf_counter() - t0)
        for seq, tokens, _, _ in prepared:
            self.past[seq] += len(tokens)
            self._unsynced.discard(seq)
        total = sum(wanted)
        view = self._logits(total) if total else None
        out, at = [], 0
        for (_, _, logits_from), rows in zip(parts, wanted):
            out.append(None if logits_from is None else view[at : at + rows])
            at += rows
        return out

    def _probe_threads(self, token: int, seq: int, passes: int = 2) -> None:
        """--threads auto in a process that knows nothing yet: time a single-row decode at each
        candidate count (after one warm-up, `passes` times each, the least counting; rolled back)
        and start on the fastest, so that the first prompt already runs on it. Tens of
        milliseconds on an idle machine, against seconds a prompt on every core of a busy one
        can lose."""
        self._probed = True
        control, n_past = self.thread_control, self.past[seq]
        if n_past + 1 > self.n_ctx:
            return
        one = np.array([token], dtype=np.int32)
        best: dict[int, float] = {}
        counts = control.allowed()             # never a count the load leaves no cores for
        if len(counts) < 2:
            return
        try:
            for i in range(passes + 1):
                for count in counts if i else counts[-1:]:
                    self._use_threads(count)
                    t0 = time.perf_counter()
                    self._decode_chunk(one, logits_from=1, seq=seq)
                    seconds = time.perf_counter() - t0
                    self.truncate(n_past, seq=seq)
                    if i:                                  # the first decode is a warm-up
                        best[count] = min(best.get(count, math.inf), seconds)
        finally:
            self.truncate(n_past, seq=seq)
        control.seed(best)

    def _steer(self, rows: int, seconds: float) -> None:
        """--threads auto: feed the decode's time to the controller, relative to the cost
        curve's shape for `rows`, and take the thread count it chooses."""
        self._use_threads(self.thread_control.observe(seconds / self.costs.shape(rows) if rows > 1 else seconds,
                                                      seconds))

    def _use_threads(self, n: int) -> None:
        if n != self.n_threads:
            self.set_threads(n)

    def set_threads(self, n: int) -> None:
        """Decode on `n` CPU threads from the next decode on (llama_set_n_threads)."""
        self._check_open()
        with interrupts_deferred():          # llama.cpp logs the change
            llama_cpp.llama_set_n_threads(self._ctx, n, n)
        self.n_threads = n
        self.costs.on_key = n == self.calibration_threads     # rounds at another count refine, unsaved

    @contextlib.contextmanager
    def steady(self):
        """Hold the thread count at the one the cost curve is keyed by (a calibration)."""
        held = self.n_threads
        self._steady += 1
        try:
            if held != self.calibration_threads:
                self.set_threads(self.calibration_threads)
            yield
        finally:
            self._steady -= 1
            if not self._steady and self.n_threads != held and not self.closed:
                self.set_threads(held)

    def _sync(self, seq: int = 0) -> None:
        """Drop cache cells of `seq` past `past[seq]` left by an operation an exception cut short."""
        if seq in self._unsynced:
            self._check_open()
            if not self._seq_rm(seq, self.past[seq]):
                self._rebuild(seq, self.past[seq])
            self._unsynced.discard(seq)

    def truncate(self, n_keep: int, *, seq: int = 0) -> None:
        """Roll sequence `seq` back to its first `n_keep` tokens: the one way flylocal rolls back."""
        self._check_seq(seq)
        self._sync(seq)
        if n_keep >= self.past[seq]:
            return
        if n_keep < 0:
            raise ValueError("n_keep must be >= 0")
        self._check_open()
        self._unsynced.add(seq)
        self.past[seq] = n_keep
        if not self._seq_rm(seq, n_keep):
            # Partial removal refused (recurrent or otherwise unrollable memory): start the
            # sequence again and re-evaluate the kept tokens, so the state stays consistent.
            self._rebuild(seq, n_keep)
        self._unsynced.discard(seq)

    def drop(self, start: int, count: int, *, seq: int = 0) -> bool:
        """Remove cells start..start+count-1 of sequence `seq` and move the later ones `count`
        positions back (llama_memory_seq_add: their keys are rotated in place, nothing is
        evaluated again): the cache then holds the kept tokens, as decoding them alone would
        have left it up to rounding. A draft model's bounded context (docs/design.md, "The
        draft window"). Where this memory cannot move positions, the sequence is rolled back to
        `start` instead, and False says so."""
        self._check_seq(seq)
        self._sync(seq)
        end = self.past[seq]
        count = min(count, end - start)
        if count <= 0:
            return True
        self._check_open()
        if not llama_cpp.llama_memory_can_shift(self._mem):
            self.truncate(start, seq=seq)
            return False
        self._unsynced.add(seq)
        self.past[seq] = start                      # cut short, the cells past `start` go (`_sync`)
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq, start, start + count):
            return False
        llama_cpp.llama_memory_seq_add(self._mem, seq, start + count, -1, -count)
        held = self._seq_tokens[seq]
        held[start : end - count] = held[start + count : end].copy()
        if llama_cpp.llama_memory_seq_pos_max(self._mem, seq) + 1 != end - count:
            self._rebuild(seq, end - count)         # positions not where they belong: evaluated again
            return False
        self.past[seq] = end - count
        self._unsynced.discard(seq)
        return True

    def _rebuild(self, seq: int, n_keep: int) -> None:
        kept = self._seq_tokens[seq, :n_keep].copy()
        self.past[seq] = 0
        llama_cpp.llama_memory_seq_rm(self._mem, seq, 0, -1)
        self._unsynced.discard(seq)
        self.decode(kept, seq=seq)

    def _seq_rm(self, seq: int, n_keep: int) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, n_keep, -1))

    def reset(self) -> None:
        self._check_open()
        self.past = [0] * self.n_seq
        llama_cpp.llama_memory_clear(self._mem, True)
        self._unsynced.clear()

    # ----- a sequence's state, kept and put back (the prompt cache: docs/serving.md, "Prompt cache") -----
    def state(self, seq: int) -> mmap.mmap:
        """Sequence `seq`'s cells as llama.cpp writes them (llama_state_seq_get_data): the bytes
        `restore` puts back, into this sequence or another. They live in an anonymous memory
        map of their own, whose memory goes back to the system as soon as it is dropped (heap
        blocks of this size would stay with the process: measured, 118 MiB more RSS over a
        soak of 200 entries of 8 MiB)."""
        self._check_seq(seq)
        self._check_open()
        self._sync(seq)
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = mmap.mmap(-1, max(size, 1))
        view = (ctypes.c_uint8 * size).from_buffer(data)
        with interrupts_deferred():
            n = llama_cpp.llama_state_seq_get_data(self._ctx, view, size, seq)
        del view                                   # (a live export would keep the map from closing)
        if n != size:
            raise FlylocalError(f"cannot read the cache of {self.name}: {n} of {size} bytes")
        return data

    def restore(self, seq: int, tokens: np.ndarray, data) -> bool:
        """Replace sequence `seq`'s cells with `data` (`state`: bytes or a memory map), which holds
        `tokens`: True when llama.cpp took it and its positions are those of `tokens`; False
        otherwise, the sequence then empty (a damaged or foreign state is never half-loaded)."""
        self._check_seq(seq)
        self._check_open()
        tokens = np.asarray(tokens, dtype=np.int32)
        self._unsynced.add(seq)
        self.past[seq] = 0
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        ok = 0 < len(tokens) <= self.n_ctx and len(data) > 0
        if ok:
            if isinstance(data, bytes):
                pointer = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
            else:
                pointer = (ctypes.c_uint8 * len(data)).from_buffer(data)
            with interrupts_deferred():            # llama.cpp logs what it refuses
                ok = llama_cpp.llama_state_seq_set_data(self._ctx, pointer, len(data), seq) == len(data)
            del pointer
            ok = ok and llama_cpp.llama_memory_seq_pos_max(self._mem, seq) + 1 == len(tokens)
        if ok:
            self._seq_tokens[seq, : len(tokens)] = tokens
            self.past[seq] = len(tokens)
        else:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._unsynced.discard(seq)
        return bool(ok)

    def reuse_prefix(self, tokens: np.ndarray, *, seq: int = 0) -> int:
        """Keep the longest cached prefix of `tokens` in sequence `seq`, leaving at least the
        last token out of the cache, and return how many tokens were kept. tokens[kept:] still
        need decoding."""
        self._check_seq(seq)
        self._sync(seq)
        keep = reusable_prefix(self.cached(seq), tokens)
        self.truncate(keep, seq=seq)
        return keep


def decode_args(tokens, logits_from: int | None, n_past: int, n_ctx: int, n_batch: int) -> tuple[np.ndarray, int, int]:
    """A decode's (tokens as int32, the first row with logits, the rows with logits), checked
    against the room the cache has and the rows a batch gives."""
    tokens = np.asarray(tokens, dtype=np.int32)
    n = len(tokens)
    if n_past + n > n_ctx:
        raise FlylocalError(f"context full: {n_past} + {n} tokens exceed --ctx {n_ctx}")
    start = n if logits_from is None else logits_from
    if n - start > n_batch:
        raise ValueError(f"logits requested for {n - start} rows; at most n_batch={n_batch}")
    return tokens, start, n - start


def one_sequence(seq: int) -> None:
    if seq != 0:
        raise ValueError(f"sequence {seq}: this context holds one sequence (0)")

