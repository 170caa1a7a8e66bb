"""The prompt cache: what a slot computed is kept when the slot takes another prompt, so that no
turn prefills again what the server already computed (docs/serving.md, "Prompt cache").

    a request's prompt -> seat(free slots, prompt, partition):
        the free slot whose cells keep most of it, or an entry that keeps more (restored
        into the free slot that loses least); whatever the chosen slot held beyond what the
        request keeps becomes an entry first
    engine's prefill      -> only what neither kept

Cells are shared only within a partition (docs/serving.md, "Who shares the prompt cache"):
each slot's cells and each entry belong to the partition of the request that computed them,
and a request reuses only its own partition's. A slot of another partition that it takes is
emptied in every model first, so that neither the count of reused tokens nor the time to
the first token says anything of what another partition sent. The partition None shares with
no one: its cells are never reused or kept.

An entry is every model's cells of one slot (the target's, and the draft model's: `models`),
taken with `Sequences.state` and keyed by the target's token ids. Entries live in memory up to
`limit` bytes; past it the one that saves the least prefill per byte, weighed by how long ago it
was used, goes (to the disk tier `shelf` when there is one, which keeps its own bound). A state
is put back only into a free slot, and only under the key it was taken with (the shelf checks
the key and the bytes of what it reads): a foreign or damaged entry is dropped with one line,
and the request is prefilled as if there had been none.

The cache prints nothing: each change is one line to `log`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from flylocal.decoding.contracts import Sequences, reusable_prefix

REUSE_MIN = 32          # a cached prefix worth taking a higher slot for (tokens)
RESTORE_MIN = 16        # tokens a slot must lose to be kept as an entry, and an entry must save to be
                        # restored before a prefill rate is measured;
RESTORE_RATE = 2e9      # then what it saves must outweigh copying its bytes back, at about this many a second
MiB = 1 << 20


@dataclass(eq=False)
class Entry:
    tokens: list[np.ndarray]           # per model: the ids its cells hold (the target's first: the key)
    data: list[bytes | None] | None    # per model: its state (None: it held nothing); None while on the shelf only
    size: int                          # bytes of the states
    used: int                          # the cache's clock when it was kept or last restored
    hits: int = 0
    path: object = None                # where the shelf keeps it, once it does
    partition: str = ""                # whose requests may use it

    @property
    def key(self) -> np.ndarray:
        return self.tokens[0]


class Shelf(Protocol):
    """Where entries go past the memory bound and across restarts (flylocal.decoding.prompt_files.Shelf)."""
    limit: int

    def entries(self) -> list[Entry]:
        """The entries kept there under this cache's key, read at start (their data not loaded)."""
        ...

    held: int                          # bytes of the folder that are no entry of this cache (counted in `limit`)

    def put(self, entry: Entry) -> str | None:
        """Write `entry` (its data in memory) and set `entry.path`; or why it could not."""
        ...

    def load(self, entry: Entry) -> list[bytes | None] | None:
        """`entry`'s states, checked; None (said in one line) when its file is gone or damaged."""
        ...

    def remove(self, entry: Entry) -> None:
        ...


@dataclass
class Counts:
    hits: int = 0              # requests that took an entry
    restored_tokens: int = 0   # tokens those requests did not prefill
    saved_s: float = 0.0       # prefill seconds that saved, at the measured prefill rate
    kept: int = 0              # entries made
    evicted: int = 0           # entries dropped for room (from memory; to the shelf where one is)
    failed: int = 0            # entries that would not load (damaged, foreign): dropped


@dataclass(eq=False)
class PromptCache:
    models: list[Sequences]            # the target, then the draft model when there is one
    limit: int                         # bytes the entries in memory may take
    shelf: Shelf | None = None
    log: Callable[[str], None] = lambda line: None
    entries: list[Entry] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    rate: float | None = None          # prefill seconds per token, as measured (`prefilled`)
    clock: int = 0                     # requests seated so far
    seated: dict[int, int] = field(default_factory=dict)    # slot -> the clock when it last took a request
    owners: dict[int, str | None] = field(default_factory=dict)    # slot -> the partition its cells belong to

    def __post_init__(self):
        if self.shelf is not None:
            self.entries.extend(self.shelf.entries())
            if self.entries:
                self.log(f"prompt cache: {len(self.entries)} entries on disk, {self._bytes(True) / MiB:.0f} MiB")

    @property
    def keeps(self) -> bool:
        """Whether it keeps anything (a cache of no bytes and no shelf only seats requests)."""
        return self.limit > 0 or self.shelf is not None

    # ----- what the server asks -----
    def seat(self, free: list[int], prompt: np.ndarray, partition: str | None = "") -> int:
        """The free slot for `prompt`, a request of `partition`: the one whose cells keep most
        of it (REUSE_MIN tokens at least, or all it holds; else the spare one: empty, else
        used longest ago), unless an entry keeps enough more to pay for its copy (`_pays`),
        which is then restored into the spare slot. Only the partition's own slots and entries
        count. What the slot held that the request will not keep is kept as an entry first;
        a slot of another partition is then emptied."""
        self.clock += 1
        prompt = np.asarray(prompt, dtype=np.int32)
        target = self.models[0]
        own = {s for s in free if partition is not None and self.owners.get(s, "") == partition}
        kept = {s: reusable_prefix(target.cached(s), prompt) if s in own else 0 for s in free}
        # A slot worth taking keeps REUSE_MIN tokens, or all it holds (the prompt continues it).
        # Where none is, the slot that loses least: an empty one (the lowest: neighbouring slots
        # decode together), else the one used longest ago.
        spare = min(free, key=lambda s: (len(target.cached(s)) > 0, self.seated.get(s, 0), s))
        worth = [s for s in own if kept[s] >= REUSE_MIN or 0 < kept[s] == len(target.cached(s))]
        seq = max(worth, key=lambda s: (kept[s], -s)) if worth else spare
        best, reach = None, 0
        for e in self.entries:
            n = reusable_prefix(e.key, prompt) if partition is not None and e.partition == partition else 0
            if n > reach:
                best, reach = e, n
        if best is None or not self._pays(best, reach - kept[seq]):
            self._add(self._take(seq, beyond=kept[seq]))
            if seq not in own:
                self._empty(seq)
        else:
            gain = reach - kept[seq]
            seq = spare
            held = self._take(seq)                 # taken before the restore, kept after it (whose
            self._restore(best, seq, gain)         # room must not push out the entry being restored)
            self._add(held)
        self.seated[seq] = self.clock
        self.owners[seq] = partition
        return seq

    def keep(self, seq: int) -> None:
        """Keep slot `seq`'s cells as an entry (a server that stops; chat's /save)."""
        self._add(self._take(seq))

    def _take(self, seq: int, beyond: int = 0) -> Entry | None:
        """Slot `seq`'s cells as an entry, unless it holds under `beyond` + RESTORE_MIN tokens
        (what it will keep itself, and hardly more) or an entry already holds all of them."""
        partition = self.owners.get(seq, "")
        tokens = [np.array(m.cached(seq)) for m in self.models]
        key = tokens[0]
        if len(key) < beyond + RESTORE_MIN or self.limit <= 0 or partition is None:
            return None
        for e in self.entries:
            if e.partition == partition and len(e.key) >= len(key) and np.array_equal(e.key[: len(key)], key):
                e.used = self.clock                   # already kept, whole
                return None
        data = [m.state(seq) if len(t) else None for m, t in zip(self.models, tokens)]
        entry = Entry(tokens, data, sum(len(d) for d in data if d is not None), self.clock, partition=partition)
        return entry if entry.size <= self.limit else None

    def _add(self, entry: Entry | None) -> None:
        if entry is None:
            return
        key = entry.key
        covered = [e for e in self.entries if e.partition == entry.partition and len(e.key) < len(key)
                   and np.array_equal(key[: len(e.key)], e.key)]
        for e in covered:                             # a prefix of the new one: it saves no more
            self._drop(e)
        self.entries.append(entry)
        self.counts.kept += 1
        self.log(f"prompt cache: kept {len(key)} tokens ({entry.size / MiB:.1f} MiB); {self._summary()}")
        self._bound()

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A request prefilled `tokens` in `seconds`: the rate an entry's saving is counted at."""
        if tokens >= REUSE_MIN and seconds > 0:
            rate = seconds / tokens
            self.rate = rate if self.rate is None else 0.8 * self.rate + 0.2 * rate

    def close(self, slots: int) -> None:
        """The server stops: with a shelf, every slot's cells and every entry in memory go there,
        for the next server to continue from."""
        if self.shelf is None:
            return
        for seq in range(slots):
            self.keep(seq)
        for e in self.entries:
            if e.path is None and e.data is not None:
                why = self.shelf.put(e)
                if why:
                    self.log(f"prompt cache: {len(e.key)} tokens are not kept on disk ({why})")
        self._bound()

    def report(self) -> dict:
        """What /metrics and /api/ps show."""
        c = self.counts
        return {"entries": sum(e.data is not None for e in self.entries), "bytes": self._bytes(False),
                "limit_bytes": self.limit, "disk_entries": sum(e.path is not None for e in self.entries),
                "disk_bytes": self._bytes(True), "disk_limit_bytes": self.shelf.limit if self.shelf else 0,
                "hits": c.hits, "restored_tokens": c.restored_tokens, "prefill_seconds_saved": round(c.saved_s, 3),
                "kept": c.kept, "evicted": c.evicted, "failed": c.failed}

    # ----- inside -----
    def _restore(self, e: Entry, seq: int, gain: int) -> None:
        data = e.data if e.data is not None else self.shelf.load(e)
        ok = data is not None
        if ok:
            for m, tokens, d in zip(self.models, e.tokens, data):
                if d is None:
                    m.sequence(seq).truncate(0)       # it held nothing: nor does it now
                elif not m.restore(seq, tokens, d):
                    ok = False
                    break
        if not ok:                                    # the request is prefilled as if there were no entry
            self._empty(seq)                          # nothing half-loaded, nor what the slot held, stays
            self.counts.failed += 1
            self._drop(e)
            self.log(f"prompt cache: an entry of {len(e.key)} tokens would not load; dropped, the prompt is "
                     "evaluated instead")
            return
        if e.data is None:                            # back from the shelf: in memory again
            e.data = data
        e.used, e.hits = self.clock, e.hits + 1
        c = self.counts
        c.hits += 1
        c.restored_tokens += gain
        c.saved_s += gain * (self.rate or 0.0)
        self.log(f"prompt cache: restored {len(e.key)} tokens into slot {seq} ({gain} not prefilled); "
                 f"{self._summary()}")
        self._bound()

    def _empty(self, seq: int) -> None:
        for m in self.models:
            if len(m.cached(seq)):
                m.sequence(seq).truncate(0)

    def _pays(self, e: Entry, gain: int) -> bool:
        """Whether restoring `e` to keep `gain` more tokens costs less than prefilling them."""
        if self.rate is None:
            return gain >= RESTORE_MIN
        return gain > 0 and gain * self.rate > e.size / RESTORE_RATE

    def _drop(self, e: Entry) -> None:
        self.entries.remove(e)
        if e.path is not None and self.shelf is not None:
            self.shelf.remove(e)

    def _value(self, e: Entry) -> float:
        """Prefill saved per byte (the tokens an entry holds; a draft's cells cost bytes and save
        the draft's prefill too), less for every request since it was last used."""
        return len(e.key) / max(e.size, 1) / (1 + self.clock - e.used)

    def _bound(self) -> None:
        """Entries in memory past `limit` go (to the shelf, where there is one); entries on the
        shelf past its limit are deleted."""
        while self._bytes(False) > self.limit:
            e = min((e for e in self.entries if e.data is not None), key=self._value)
            self.counts.evicted += 1
            why = None
            if self.shelf is not None and e.path is None:
                why = self.shelf.put(e)
            e.data = None
            if e.path is not None:
                self.log(f"prompt cache: moved {len(e.key)} tokens to disk; {self._summary()}")
            else:
                self.entries.remove(e)
                self.log(f"prompt cache: evicted {len(e.key)} tokens" + (f" ({why})" if why else "")
                         + f"; {self._summary()}")
        while self.shelf is not None and self._bytes(True) + self.shelf.held > self.shelf.limit and \
                any(e.path is not None for e in self.entries):
            e = min((e for e in self.entries if e.path is not None), key=self._value)
            self.shelf.remove(e)
            e.path = None
            if e.data is None:
                self.entries.remove(e)
            self.log(f"prompt cache: deleted {len(e.key)} tokens from disk; {self._summary()}")

    def _bytes(self, disk: bool) -> int:
        return sum(e.size for e in self.entries if (e.path is not None if disk else e.data is not None))

    def _summary(self) -> str:
        line = f"{sum(e.data is not None for e in self.entries)} entries, {self._bytes(False) / MiB:.0f} of " \
               f"{self.limit / MiB:.0f} MiB"
        if self.shelf is not None:
            line += f", {self._bytes(True) / MiB:.0f} MiB on disk"
        return line
