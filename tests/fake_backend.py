"""An in-memory stand-in for the target Runtime, for property tests of the round loop.

No llama.cpp: this module imports only numpy and the pure parts of flylocal (never
flylocal.llama.runtime, flylocal.loader or llama_cpp).

- `FakeLM`: a deterministic "language model". Its logits after a prefix are one row of a
  seeded random table [n_states, n_vocab], picked by a rolling hash of the WHOLE prefix, so
  the logits at a position depend on every earlier token: a stale token left in the cache by
  a wrong rollback changes everything after it. Each row is flat (high entropy), middling or
  peaked, and a share of rows have an end-of-generation (EOG) token as their argmax.
- `FakeTarget`: a Target (flylocal.decoding.contracts) over a FakeLM, with `tokens` and
  `reset` besides.
- `Machine`: a simulated machine's clock. A decode of n tokens after c cached cells takes
  `step * (1 + row_cost * (n - 1) + attend * c * sqrt(n - 1))` seconds, times `stall` in a share `p_stall`
  of decodes, times `slow` while a load lasts. Given to a FakeTarget and to the Engine as its
  clock, it makes timings deterministic.
- `greedy`: the reference, plain greedy decoding one token at a time on a fresh FakeTarget.
- `NoisyOracle`: a test drafter proposing the LM's greedy continuation with random
  corruptions, random lengths and EOG tokens inside.
"""

from __future__ import annotations

import math

import numpy as np

from flylocal.decoding.contracts import Draft, Drafter, Target, equal_split, reusable_prefix
from flylocal.decoding.costs import CostCurve
from flylocal.errors import FlylocalError

_MASK = (1 << 64) - 1
FLAT, MIDDLING, PEAKED = 0, 1, 2
BOOST = {FLAT: 0.02, MIDDLING: 1.0, PEAKED: 8.0}    # how far a row's argmax stands above the rest


def mix(h: int, token: int) -> int:
    """The hash of a prefix (hashed `h`) extended by `token`: splitmix64's finaliser, a
    bijection of h ^ (token + c), so one prefix never maps two tokens to one hash."""
    z = ((h ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 29)


def prefix_hash(tokens, h: int = 0) -> int:
    for t in tokens:
        h = mix(h, int(t))
    return h


class FakeLM:
    """Logits after a prefix hashed h: `table[h % n_states]` [n_vocab] float32.

    `p_flat` / `p_peaked` of the rows are near-flat (top-3 entropy about 3 ln(V) / V nats) /
    peaked (one token ahead by 8 logits, entropy near 0); the rest are middling. In a share
    `p_eog` of the rows the argmax is one of the `eog` ids; elsewhere it is not an EOG id."""

    def __init__(self, seed: int = 0, n_vocab: int = 32, n_states: int = 4096, eog=(0,),
                 p_flat: float = 0.3, p_peaked: float = 0.4, p_eog: float = 0.03):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.n_vocab = n_vocab
        self.n_states = n_states
        self.eog_ids = np.array(sorted(set(int(t) for t in eog)), dtype=np.int32)
        self.eog_mask = np.zeros(n_vocab, dtype=bool)                   # [n_vocab]
        self.eog_mask[self.eog_ids] = True
        u = rng.random(n_states)
        self.kind = np.where(u < p_flat, FLAT, np.where(u < p_flat + p_peaked, PEAKED, MIDDLING))
        table = rng.normal(size=(n_states, n_vocab))
        table[self.kind == FLAT] *= 0.05
        others = np.flatnonzero(~self.eog_mask)
        top = others[rng.integers(len(others), size=n_states)]          # [n_states]
        if len(self.eog_ids):
            to_eog = rng.random(n_states) < p_eog
            top[to_eog] = self.eog_ids[rng.integers(len(self.eog_ids), size=int(to_eog.sum()))]
        rows = np.arange(n_states)
        table[rows, top] = table.max(axis=1) + np.vectorize(BOOST.get)(self.kind)
        self.table = table.astype(np.float32)                          # [n_states, n_vocab]
        self.argmax = self.table.argmax(axis=1).astype(np.int32)        # [n_states] == top

    def logits(self, h: int) -> np.ndarray:
        return self.table[h % self.n_states]

    def next_token(self, h: int) -> int:
        """The greedy token after a prefix hashed h."""
        return int(self.argmax[h % self.n_states])

    def is_eog(self, token: int) -> bool:
        return bool(self.eog_mask[token])


def fixed_costs(row_cost: float = 0.1, rows: int = 17, single: float = 0.01) -> CostCurve:
    """A fixed cost curve t(n) = single * (1 + row_cost * (n - 1)): 0.4 is CPU-like, 0.02 GPU-like."""
    n = np.arange(1, rows + 1)
    return CostCurve(seconds=single * (1 + row_cost * (n - 1)), fixed=True)


class Machine:
    """A simulated machine: calling it reads its clock (seconds); `decode(n)` advances it by what
    a decode of n tokens takes. Deterministic given `seed`."""

    def __init__(self, step: float = 0.01, row_cost: float = 0.4, p_stall: float = 0.0, stall: float = 100.0,
                 noise: float = 0.0, seed: int = 0, attend: float = 0.0):
        self.step, self.row_cost = step, row_cost
        self.attend = attend                  # single steps per cached cell, times sqrt(n - 1): attention
        self.p_stall, self.stall, self.noise = p_stall, stall, noise
        self.slow = 1.0                       # a load: every decode this many times slower
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        self.decode_s = 0.0                   # seconds spent decoding
        self.stalls = 0

    def __call__(self) -> float:
        return self.now

    def shape(self, n: int, cells: int = 0) -> float:
        return 1 + self.row_cost * (n - 1) + self.attend * math.sqrt(n - 1) * cells

    def decode(self, n: int, cells: int = 0) -> None:
        t = self.step * self.shape(n, cells) * self.slow * (1 + self.noise * self.rng.uniform(-1, 1))
        if self.p_stall and self.rng.random() < self.p_stall:
            t *= self.stall
            self.stalls += 1
        self.now += t
        self.decode_s += t


class FakeTarget(Target):
    """The Target contract over a FakeLM. The cache is the token ids of cells
    0..n_past-1 and, per cell, the hash of the prefix up to and including it; the logits of
    a decoded row come from that cell's hash. `high_water` is the most cells ever held."""

    def __init__(self, lm: FakeLM | None = None, n_ctx: int = 64, n_batch: int | None = None,
                 costs: CostCurve | None = None, machine: Machine | None = None):
        self.lm = lm = lm if lm is not None else FakeLM()
        self.machine = machine
        self.n_ctx = n_ctx
        self.n_batch = n_batch or n_ctx
        self.n_vocab = lm.n_vocab
        self.n_past = 0
        self.costs = costs if costs is not None else fixed_costs()
        self._tokens = np.zeros(n_ctx, dtype=np.int32)
        self._hash = [0] * n_ctx
        self.high_water = 0
        self.decodes = 0
        self.can_shift = True
        self.dropped = 0                             # cells removed by `drop`
        self.evaluated = 0                           # tokens decoded, all told

    @property
    def eog_mask(self) -> np.ndarray:  # [n_vocab] bool
        return self.lm.eog_mask

    @property
    def tokens(self) -> np.ndarray:  # [n_past] int32, a copy
        return self._tokens[: self.n_past].copy()

    def tokenize(self, text, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """A byte per token, folded into the vocabulary (the fake has no text of its own)."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) % self.n_vocab

    def cost_key(self) -> dict:
        return {"fake_lm": self.lm.seed, "n_vocab": self.n_vocab}

    def decode(self, tokens, logits_from: int | None = None) -> np.ndarray | None:
        """Append `tokens` at n_past; the logits of rows logits_from.. [rows, n_vocab] float32
        (None when logits_from is None or no row is asked for)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise FlylocalError(f"context full: {self.n_past} + {n} tokens exceed --ctx {self.n_ctx}")
        start = n if logits_from is None else logits_from
        if start < 0:
            raise ValueError(f"logits_from {logits_from} < 0")
        if n - start > self.n_batch:
            raise ValueError(f"logits requested for {n - start} rows; at most n_batch={self.n_batch}")
        if n and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise ValueError(f"token id out of range 0..{self.n_vocab - 1}: {tokens.tolist()}")
        p0 = self.n_past
        h = self._hash[p0 - 1] if p0 else 0
        for i, t in enumerate(tokens.tolist()):
            h = mix(h, t)
            self._hash[p0 + i] = h
        self._tokens[p0 : p0 + n] = tokens
        self.n_past = p0 + n
        self.high_water = max(self.high_water, self.n_past)
        self.decodes += 1
        self.evaluated += n
        if self.machine is not None and n:
            self.machine.decode(n, p0)
        if start >= n:
            return None
        states = [self._hash[p] % self.lm.n_states for p in range(p0 + start, p0 + n)]
        return self.lm.table[states]                 # fancy indexing: a fresh [rows, n_vocab] array

    def truncate(self, n_keep: int) -> None:
        """Roll back to the first n_keep cells (a no-op when n_keep >= n_past)."""
        if n_keep >= self.n_past:
            return
        if n_keep < 0:
            raise ValueError("n_keep must be >= 0")
        self.n_past = n_keep

    def drop(self, start: int, count: int) -> bool:
        """Remove cells start..start+count-1, the later ones moved back; their hashes are those
        of the kept tokens alone (as a decode of them alone would give). With `can_shift` off,
        the Target contract's fallback: a rollback to `start`."""
        if not self.can_shift:
            return Target.drop(self, start, count)
        end = self.n_past
        count = min(count, end - start)
        if count <= 0:
            return True
        kept = self._tokens[start + count : end].copy()
        h = self._hash[start - 1] if start else 0
        for i, t in enumerate(kept.tolist()):
            h = mix(h, t)
            self._hash[start + i] = h
        self._tokens[start : start + len(kept)] = kept
        self.n_past = start + len(kept)
        self.dropped += count
        return True

    def reset(self) -> None:
        self.n_past = 0

    def reuse_prefix(self, tokens) -> int:
        """Keep the longest cached prefix of `tokens`, leaving at least the last token out of
        the cache; return how many were kept."""
        keep = reusable_prefix(self._tokens[: self.n_past], np.asarray(tokens, dtype=np.int32))
        self.truncate(keep)
        return keep


def greedy(lm: FakeLM, prompt, max_tokens: int, n_ctx: int) -> tuple[list[int], str]:
    """Plain greedy decoding, one token at a time on a fresh FakeTarget: (output ids, stop).
    Stops, like the engine, at max_tokens output tokens, at a full context, or at the first EOG
    token (committed, so it fills a cell of the context, but not output)."""
    target = FakeTarget(lm, n_ctx)
    prompt = [int(t) for t in prompt]
    target.decode(prompt[:-1])
    last, n, out = prompt[-1], len(prompt), []
    while True:
        if len(out) >= max_tokens:
            return out, "max_tokens"
        if n >= n_ctx:
            return out, "context"
        token = int(target.decode([last], logits_from=0)[0].argmax())
        n += 1
        if lm.is_eog(token):
            return out, "eog"
        out.append(token)
        last = token


class NoisyOracle(Drafter):
    """A drafter that knows the LM: it proposes the greedy continuation of the context (each
    token greedy after the draft so far, so native matches follow a corruption), with each
    token replaced by a random id with probability `p_corrupt` or by an EOG id with
    probability `p_eog`, and a random length 0..k in a share `p_short` of rounds (else k).
    Deterministic given `seed`. Its proposals carry a random level, so that it can run under
    draft-length control (`controlled`)."""

    name = "oracle"

    def __init__(self, lm: FakeLM, seed: int = 0, p_corrupt: float = 0.15, p_eog: float = 0.03,
                 p_short: float = 0.3, levels: int = 3):
        self.lm = lm
        self.rng = np.random.default_rng(seed)
        self.p_corrupt, self.p_eog, self.p_short = p_corrupt, p_eog, p_short
        self.level_prior = np.linspace(0.3, 0.9, levels)       # [levels], for LengthControl

    def propose(self, context: np.ndarray, k: int) -> Draft:
        rng, lm = self.rng, self.lm
        length = int(rng.integers(0, k + 1)) if rng.random() < self.p_short else k
        h = prefix_hash(context.tolist())
        draft = []
        for _ in range(length):
            u = rng.random()
            if u < self.p_eog and len(lm.eog_ids):
                t = int(rng.choice(lm.eog_ids))
            elif u < self.p_eog + self.p_corrupt:
                t = int(rng.integers(lm.n_vocab))
            else:
                t = lm.next_token(h)
            draft.append(t)
            h = mix(h, t)
        return Draft(np.array(draft, dtype=np.int32), level=int(rng.integers(len(self.level_prior))))


class QuietLoad:
    """A load meter (flylocal.host.CpuLoad) that says nothing else ran."""

    def start(self):
        pass

    def stop(self):
        return 0.0


def controlled(oracle: NoisyOracle, k: int, target: FakeTarget, learned=None):
    """`oracle` under draft-length control on `target`'s cost curve, as prompt lookup runs."""
    from flylocal.decoding.drafters.length import LengthControl

    return LengthControl(oracle, oracle.level_prior, k, target.costs, learned)


class FakeSequences:
    """The Sequences contract (flylocal.decoding.contracts) over `n_seq` FakeTargets of one
    FakeLM, one cost curve and one Machine: a shared decode costs the sum of the curve over
    its computations (`equal_split`). `decodes` counts shared decodes, `parts` each one's
    (seq, rows) for the tests to read. A decode is all or nothing, as llama.cpp's is to its
    caller: one that fails leaves every sequence as it was. A decode that carries a part of a
    sequence in `faulty` fails (the tests' way to make one member's decode fail)."""

    def __init__(self, lm: FakeLM, n_seq: int, n_ctx: int = 64, n_batch: int = 64,
                 costs: CostCurve | None = None, machine: Machine | None = None):
        self.lm, self.n_seq, self.n_ctx, self.n_batch = lm, n_seq, n_ctx, n_batch
        self.n_vocab, self.eog_mask = lm.n_vocab, lm.eog_mask
        self.costs = costs if costs is not None else fixed_costs(rows=n_batch)
        self.machine = machine
        self.seqs = [FakeTarget(lm, n_ctx, n_batch, self.costs, machine) for _ in range(n_seq)]
        self.decodes = 0
        self.parts: list[list[tuple[int, int]]] = []
        self.faulty: set[int] = set()
        self.restores = 0                  # states put back (`restore`)
        self.corrupt_restores = False      # every restore fails, as a damaged state's would

    def sequence(self, seq: int) -> FakeTarget:
        return self.seqs[seq]

    def cached(self, seq: int) -> np.ndarray:
        return self.seqs[seq].tokens

    def split(self, rows: dict[int, int]) -> list[int]:
        return equal_split(rows)

    def state(self, seq: int) -> bytes:
        """A sequence's cells as bytes: its tokens and each cell's prefix hash."""
        target = self.seqs[seq]
        n = target.n_past
        return target._tokens[:n].tobytes() + np.array(target._hash[:n], dtype=np.uint64).tobytes()

    def restore(self, seq: int, tokens, data: bytes) -> bool:
        target, tokens = self.seqs[seq], np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        target.n_past = 0
        if not 0 < n <= self.n_ctx or len(data) != 12 * n or self.corrupt_restores:
            return False
        held = np.frombuffer(data[: 4 * n], dtype=np.int32)
        if not np.array_equal(held, tokens):
            return False
        target._tokens[:n] = held
        target._hash[:n] = np.frombuffer(data[4 * n:], dtype=np.uint64).tolist()
        target.n_past = n
        self.restores += 1
        return True

    def state_key(self) -> dict:
        return {"fake_lm": self.lm.seed, "n_ctx": self.n_ctx}

    def decode_batch(self, parts):
        seqs = [s for s, _, _ in parts]
        if len(set(seqs)) != len(seqs) or any(not 0 <= s < self.n_seq for s in seqs):
            raise ValueError(f"sequences {seqs}: each once, in 0..{self.n_seq - 1}")
        total = sum(len(t) for _, t, _ in parts)
        if total > self.n_batch:
            raise ValueError(f"{total} tokens in one decode; at most n_batch={self.n_batch}")
        bad = self.faulty.intersection(seqs)
        if bad:
            raise FlylocalError(f"llama_decode failed on the fake: sequence {min(bad)}")
        out = []
        before = [(self.seqs[s], self.seqs[s].n_past) for s in seqs]
        try:
            for s, tokens, first in parts:
                target = self.seqs[s]
                target.machine = None               # the shared decode is charged once, below
                try:
                    out.append(target.decode(tokens, first))
                finally:
                    target.machine = self.machine
        except BaseException:
            for target, n_past in before:
                target.truncate(n_past)
            raise
        if self.machine is not None:
            single = self.machine.step
            self.machine.now += sum(single * self.machine.shape(n) for n in equal_split(
                {s: len(t) for s, t, _ in parts}))
        self.decodes += 1
        self.parts.append([(s, len(t)) for s, t, _ in parts])
        return out
