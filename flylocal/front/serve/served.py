"""The models a server serves, each loaded in a worker of its own (flylocal.front.serve.worker),
loaded and unloaded by a Roster (flylocal.front.serve.roster): what a request may name, what
each holds, the lines /health and /api/ps read (docs/serving.md, "Every model from one
server")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

from flylocal.errors import FlylocalError
from flylocal.front.serve.roster import FOREVER, CannotLoad, Member, Roster, names_of
from flylocal.front.serve.worker import Metrics, Worker
from flylocal.session import Session
from flylocal.settings import Settings


FINISH_S = 2.0      # seconds a model unloading may spend measuring what its cost curves lack


class Served:
    """The members and their workers. A one-model server (`load`: the Session of --target)
    has one member, loaded now and kept unless a request unloads it, whose failure stops the
    server; a server of several (`members`) loads the first now and the others when named,
    each one's failure its own, within `budget` bytes."""

    def __init__(self, load: Callable[[], Session] | None, settings: Settings, members: list[Member] | None,
                 budget: int | None, metrics: Metrics, max_queue: int, on_failure: Callable[[BaseException], None],
                 open_cache, say: Callable[[str], None], embedding_model: tuple[str, Path] | None = None,
                 log: Callable[[str], None] | None = None):
        self.metrics, self.max_queue, self.on_failure, self.open_cache = metrics, max_queue, on_failure, open_cache
        self.log = log
        # --embedding-model: (the name given, its file); None: the target computes embeddings
        self.embedding_name, self.embedding_model = embedding_model or (None, None)
        self.single = members is None
        if members is None:
            members = [Member(settings.target, None, settings, 0, frozenset(names_of(settings.target)), FOREVER,
                              load=load)]
        self.home = members[0]                  # the model a request that names none gets
        # a model just fetched (/api/pull) as a member: (name, file) -> Member; None: not served
        self.adopter: Callable[[str, Path], Member] | None = None
        self.roster = Roster(members, budget, self._open, self._close, self._size, say)
        self.home.runner = self._worker(self.home)      # loading starts now
        self.home.last_used = self.roster.clock()

    def served(self) -> list[tuple[str, Path | None, str, Member | None]]:
        """Every model a request may name, as (name, file, role, member): the members, which
        generate, and the model --embedding-model names (member None). The file is None for a
        one-model server's model until it has loaded (given by name, it is resolved then)."""
        out = []
        for m in self.roster.members:
            path = m.path
            if path is None and m.runner is not None and m.runner.session is not None:
                path = m.runner.session.target.path
            out.append((m.name, Path(path) if path is not None else None, "target", m))
        if self.embedding_model is not None:
            out.append((self.embedding_name, self.embedding_model, "embedding", None))
        return out

    def adopt(self, name: str, path: Path) -> None:
        """Serve a model /api/pull fetched, when this server serves several."""
        if self.roster.find(name) is not None:
            return
        if self.adopter is None:
            if self.log is not None:
                self.log(f"fetched {name}: this server serves one model (--target); start one without --target to "
                         "serve it too")
            return
        self.roster.members.append(self.adopter(name, path))

    def state(self) -> dict:
        """/health's line on the models of a server of several: how many, which are loaded, the
        memory they hold and the bound ({} for a one-model server)."""
        if self.single:
            return {}
        r = self.roster
        return {"models": len(r.members), "loaded": [m.name for m in r.loaded()], "models_bytes": r.used(),
                "models_memory": r.budget}

    # ----- the models' workers (the Roster's open, close and size) -----
    def _worker(self, m: Member) -> Worker:
        failed = self.on_failure if self.single else (lambda e: None)   # a model's failure is its own

        def load():                 # on the worker's thread; a model given by name learns its file
            session = m.load()
            if session is not None and m.path is None:
                m.path = Path(session.target.path)
            return session

        return Worker(load, self.metrics, self.max_queue, failed, self.open_cache)

    async def _open(self, m: Member) -> Worker:
        worker = self._worker(m)
        await asyncio.to_thread(worker.started.wait)
        if worker.session is None:
            await asyncio.to_thread(worker.thread.join)
            e = worker.failed
            raise CannotLoad(str(e) if isinstance(e, FlylocalError) else f"cannot load {m.name} ({m.path}): {e}")
        return worker

    async def _close(self, m: Member, worker: Worker) -> None:
        worker.stop(finish_s=0.0 if self.roster.stopping else FINISH_S)
        await asyncio.to_thread(worker.thread.join)
        give_back()

    def _size(self, m: Member) -> int:
        return held(m.runner)[0] if m.runner is not None and m.runner.session is not None else m.estimate

    def stop(self) -> None:
        """Stop every model's worker (the server has stopped): their requests end first, their
        slots go to the disk tier, their models close."""
        workers = [m.runner for m in self.roster.members if m.runner is not None]
        for w in workers:
            w.stop()
        for w in workers:
            w.thread.join(timeout=60)


def held(worker: Worker) -> tuple[int, int]:
    """(bytes a loaded model holds, the part of them on a GPU): its weights, KV cells and
    compute buffers with its draft's (what the memory check counts, flylocal.llama.memory),
    and its prompt cache's entries in memory."""
    models = worker.session.models
    footprints = [m.footprint for m in (models.target, models.draft) if m is not None]
    cache = worker.cache
    return (sum(f[0] for f in footprints) + (cache.report()["bytes"] if cache is not None else 0),
            sum(f[1] for f in footprints))


def give_back() -> None:
    """Hand the memory an unloaded model's buffers left free in the C heap back to the system
    (glibc keeps it for later: 100-180 MiB stayed after each unload of Gemma-3-270M here);
    nothing where the C library has no malloc_trim."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
