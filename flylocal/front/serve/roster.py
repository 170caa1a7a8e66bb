"""The models one server serves, by name, and which of them are loaded (docs/serving.md, "Every
model from one server").

A `Member` is one target the server may run: its names, its file, its own settings (its draft
among them) and what it is expected to hold in memory. The `Roster` decides when members load
and unload, on the server's event loop; what loading and unloading do is given to it (`open`,
`close`: a worker thread of the models, flylocal.front.serve.worker; a fake in the tests):

- a request `acquire`s the member it names, and `release`s it when its answer ends. A member
  with a request in flight (`users`) is never unloaded;
- the first request for an unloaded member starts its load; the others wait for that load,
  which is started once and never cancelled, even when every client waiting for it leaves;
- before a load, idle members are unloaded, least recently used first, until the loaded ones
  and the new one fit `budget` bytes together. Members that fit together never unload each
  other; a member larger than the budget alone is refused with its sizes;
- a released member unloads when its keep-alive has passed since its last request ended
  (ollama's keep_alive: 0 at once, a negative value never); `unload` asks it now, or when its
  requests end.

Nothing here imports llama.cpp.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

MiB = 1 << 20
FOREVER = -1.0          # a keep-alive that never ends (ollama's negative keep_alive)


def names_of(name: str) -> set[str]:
    """The names a model given as `name` (a name, a file or its path) answers to: as given, its
    file name, and that without ".gguf"."""
    path = Path(name)
    return {name, path.name, path.name.removesuffix(".gguf")}


class CannotLoad(Exception):
    """A member that could not be loaded: the one line saying why (its file and sizes)."""


@dataclass(eq=False)
class Member:
    """One model the server may run, and its state. `settings` are its own (a Settings, its
    target its file); `estimate` the bytes it will hold loaded (weights, KV cells, compute
    buffers, its draft's too); `keep` its keep-alive in seconds when a request gives none."""
    name: str
    path: Path
    settings: Any
    estimate: int
    names: frozenset[str] = frozenset()     # the other names a request may give it by (any case)
    keep: float = 300.0
    # ----- state, the roster's -----
    runner: Any = None                      # what `open` returned, while loaded
    loading: asyncio.Task | None = None     # the load under way
    closing: asyncio.Task | None = None     # the unload under way
    users: int = 0                          # requests holding it (waiting for its load, or running)
    expires: float | None = None            # when it unloads once idle (the roster's clock); None: never
    kept: float = 0.0                       # the keep-alive of the last request to acquire it
    last_used: float = 0.0
    loads: int = 0                          # loads finished, over the server's life
    load_s: list[float] = field(default_factory=list)
    failed: str | None = None               # why its last load failed
    load: Callable[[], Any] | None = None   # builds what it runs (a Session), on the worker's thread

    @property
    def state(self) -> str:
        return "loading" if self.loading else "unloading" if self.closing else "loaded" if self.runner else "unloaded"


class Roster:
    """Loads and unloads members within a memory budget (see the module's docstring). Every
    method runs on the event loop; `open(member)` and `close(member, runner)` are awaited there
    and do their work elsewhere (a thread); `size(member)` is what a loaded member holds now."""

    def __init__(self, members: list[Member], budget: int | None,
                 open: Callable[[Member], Awaitable[Any]], close: Callable[[Member, Any], Awaitable[None]],
                 size: Callable[[Member], int] = lambda m: m.estimate, log: Callable[[str], None] = lambda s: None,
                 clock: Callable[[], float] = time.monotonic):
        self.members, self.budget = list(members), budget
        self._open, self._close, self._size, self.log, self.clock = open, close, size, log, clock
        self._changed = asyncio.Event()     # set (and replaced) whenever memory may have been freed
        self._timer: asyncio.TimerHandle | None = None
        self.stopping = False

    # ----- names -----
    def find(self, name: str) -> Member | None:
        """The member a request's `model` names: by a listed name or another of its names
        (casefolded, ollama's ":latest" optional). Only ever a lookup: a name is never a path."""
        wanted = str(name).casefold()
        for key in (wanted, wanted.removesuffix(":latest")):
            for m in self.members:
                if key == m.name.casefold() or key in {n.casefold() for n in m.names}:
                    return m
        return None

    def loaded(self) -> list[Member]:
        return [m for m in self.members if m.runner is not None and m.closing is None]

    def used(self) -> int:
        """Bytes the loaded members hold, with those loading or unloading counted as expected."""
        return sum(self._size(m) if m.runner is not None and not m.closing else m.estimate
                   for m in self.members if m.runner is not None or m.loading or m.closing)

    def expires_at(self, m: Member) -> float | None:
        """When `m` unloads if nothing else asks for it (the roster's clock); None: never."""
        if m.users:
            return None if m.kept < 0 else self.clock() + m.kept
        return m.expires

    # ----- requests -----
    async def acquire(self, m: Member, keep: float | None = None) -> Any:
        """`m`'s runner, loaded first where it is not (waiting for room, or for the load under
        way); held until `release`. CannotLoad when its load fails."""
        m.users += 1
        m.kept = m.keep if keep is None else keep
        try:
            while True:
                if m.closing is not None:
                    await asyncio.shield(m.closing)
                elif m.loading is not None:
                    await asyncio.shield(m.loading)
                    if m.runner is None:
                        raise CannotLoad(m.failed or f"{m.name} did not load")
                elif m.runner is not None:
                    m.last_used = self.clock()
                    return m.runner
                else:
                    await self._room_for(m)
                    if m.runner is None and m.loading is None and m.closing is None:
                        m.loading = asyncio.ensure_future(self._load(m))
        except BaseException:
            self.release(m)
            raise

    def release(self, m: Member, keep: float | None = None) -> None:
        """A request holding `m` ended: once it is idle, it unloads after its keep-alive."""
        m.users -= 1
        m.last_used = self.clock()
        if keep is not None:
            m.kept = keep
        if m.users == 0:
            m.expires = None if m.kept < 0 else m.last_used + m.kept
            self._wake()
        self._schedule()

    async def load(self, m: Member, keep: float | None = None) -> None:
        """Load `m` for no request (POST /models/load, an empty ollama request): it then stays
        for its keep-alive."""
        await self.acquire(m, keep)
        self.release(m)

    def unload(self, m: Member) -> None:
        """Unload `m` now, or as soon as its requests end."""
        m.kept = 0.0
        if m.users == 0:
            m.expires = self.clock()
        self._schedule()

    async def remove(self, m: Member) -> None:
        """Stop serving `m` (its file is deleted): unloaded first where it is loaded."""
        if m.loading is not None:
            await asyncio.shield(m.loading)
        if m.runner is not None or m.closing is not None:
            await self._unload(m)
        if m in self.members:
            self.members.remove(m)

    # ----- inside -----
    async def _room_for(self, m: Member) -> None:
        """Unload idle members, least recently used first, until `m` fits beside the rest;
        wait while the members in the way are busy. CannotLoad when it cannot fit alone."""
        if self.budget is not None and m.estimate > self.budget:
            raise CannotLoad(f"{m.name} ({m.path}) needs about {m.estimate / MiB:,.0f} MiB loaded, more than the "
                             f"whole --models-memory of {self.budget / MiB:,.0f} MiB")
        while self.budget is not None and self.used() + m.estimate > self.budget:
            closing = [o for o in self.members if o.closing is not None]
            idle = [o for o in self.loaded() if o.users == 0 and o is not m]
            if closing and self.used() - sum(o.estimate for o in closing) + m.estimate <= self.budget:
                await asyncio.shield(closing[0].closing)        # room is being made: no other unload
            elif idle:
                victim = min(idle, key=lambda o: o.last_used)
                self.log(f"unloading {victim.name} to make room for {m.name} "
                         f"({self.used() / MiB:,.0f} MiB held, {m.estimate / MiB:,.0f} MiB wanted, "
                         f"--models-memory {self.budget / MiB:,.0f} MiB)")
                await self._unload(victim)
            else:
                changed = self._changed
                await changed.wait()
            if m.runner is not None or m.loading is not None or m.closing is not None:
                return          # another request got it going meanwhile

    async def _load(self, m: Member) -> None:
        started = self.clock()
        self.log(f"loading {m.name} ({m.path})")
        try:
            runner = await self._open(m)
        except Exception as e:  # noqa: BLE001 - the member's own failure: its requests hear it
            m.failed = str(e) if isinstance(e, CannotLoad) else f"cannot load {m.name} ({m.path}): {e}"
            self.log(m.failed)
            m.loading = None
            self._wake()
            return
        m.runner, m.failed, m.loading = runner, None, None
        m.loads += 1
        m.load_s.append(self.clock() - started)
        m.last_used = self.clock()
        self._wake()                # an idle member now (its requests left), or smaller than expected: room
        self.log(f"loaded {m.name} in {m.load_s[-1]:.2f} s ({self._size(m) / MiB:,.0f} MiB; "
                 f"{self.used() / MiB:,.0f} MiB held by {len(self.loaded())} model"
                 f"{'s' if len(self.loaded()) != 1 else ''})")
        if m.users == 0:            # its requests left while it loaded: it stays for its keep-alive
            m.expires = None if m.kept < 0 else m.last_used + m.kept
            self._schedule()
        await self._trim(keep=m)

    async def _trim(self, keep: Member) -> None:
        """After a load that holds more than expected: idle members unloaded, least recently
        used first, until the budget holds again (never `keep`)."""
        while self.budget is not None and self.used() > self.budget:
            idle = [o for o in self.loaded() if o.users == 0 and o is not keep]
            if not idle:
                return
            victim = min(idle, key=lambda o: o.last_used)
            self.log(f"unloading {victim.name}: {keep.name} holds more than expected ({self.used() / MiB:,.0f} MiB "
                     f"held, --models-memory {self.budget / MiB:,.0f} MiB)")
            await self._unload(victim)

    async def _unload(self, m: Member) -> None:
        if m.closing is not None:
            await asyncio.shield(m.closing)
            return
        runner = m.runner
        if runner is None:          # unloaded meanwhile (a task made before another unload ended)
            return

        async def close():
            try:
                await self._close(m, runner)
            finally:
                m.runner, m.closing, m.expires = None, None, None
                self._wake()

        m.closing = asyncio.ensure_future(close())
        await asyncio.shield(m.closing)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _schedule(self) -> None:
        """Unload the idle members whose keep-alive has passed, and set a timer for the next."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.stopping:
            return
        now, due = self.clock(), []
        for m in self.loaded():
            if m.users == 0 and m.expires is not None:
                due.append(m.expires)
                if m.expires <= now:
                    asyncio.ensure_future(self._expire(m))
        later = [t for t in due if t > now]
        if later:
            self._timer = asyncio.get_running_loop().call_later(min(later) - now + 0.01, self._schedule)

    async def _expire(self, m: Member) -> None:
        """`m`'s keep-alive ended (_schedule): unloaded, unless a request took it or it began to
        unload since (this runs a turn of the loop later)."""
        if m.users == 0 and m.runner is not None and m.closing is None and m.expires is not None \
                and m.expires <= self.clock():
            self.log(f"unloading {m.name} (its keep-alive ended)")
            await self._unload(m)

    async def stop(self) -> None:
        """Unload every member (the server stops): their slots kept on disk as they close."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        for m in self.members:
            if m.loading is not None:
                await asyncio.shield(m.loading)
        await asyncio.gather(*(self._unload(m) for m in self.members if m.runner is not None or m.closing))
