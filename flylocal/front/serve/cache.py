"""The server's prompt cache, as its options ask (docs/serving.md, "Conversations taking turns:
the prompt cache"): memory for entries (--cache-ram), a disk tier (--prompt-cache DIR, whose
file format is flylocal.decoding.prompt_files) and the models whose cells it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flylocal.decoding.prompt_cache import PromptCache
from flylocal.decoding.prompt_files import Shelf

DEFAULT_RAM_SHARE = 0.25       # --cache-ram auto: a quarter of the memory available at start,
DEFAULT_RAM_MOST = 8 << 30     # at most 8 GiB (llama-server's default bound)


@dataclass(frozen=True)
class CacheOptions:
    ram_mib: int | None = None          # --cache-ram; None: auto; 0: no cache
    folder: Path | None = None          # --prompt-cache DIR: the disk tier
    disk_mib: int = 4096                # --prompt-cache-size


def open_cache(target, draft, options: CacheOptions, log: Callable[[str], None]) -> PromptCache:
    """The prompt cache of a server's models (`draft` may be None). With --cache-ram 0, or a
    target on rpc servers (whose cells are theirs), it keeps nothing (`PromptCache.keeps`), and
    still seats each request and keeps partitions apart."""
    from flylocal.llama.memory import available_bytes

    models = [target] + ([draft] if draft is not None and not draft.config.rpc and draft.n_seq == target.n_seq else [])
    if options.ram_mib == 0 or target.config.rpc:
        return PromptCache(models, 0, None, log)
    if options.ram_mib is None:
        available = available_bytes()
        ram = int(min(DEFAULT_RAM_MOST, DEFAULT_RAM_SHARE * available)) if available else 1 << 30
    else:
        ram = options.ram_mib << 20
    shelf = None
    if options.folder is not None:
        shelf = Shelf(Path(options.folder), options.disk_mib << 20, [m.state_key() for m in models], log)
    return PromptCache(models, ram, shelf, log)
