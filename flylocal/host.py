"""Facts of this machine every layer reads: the cores this process may run on, and where
flylocal keeps what it measured of the machine (the decode cost curves,
flylocal.decoding.costs, and the thread count --threads auto settled on, flylocal.llama.threads)."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def costs_dir() -> Path:
    """$FLYLOCAL_COSTS, or ~/.cache/flylocal/costs."""
    return Path(os.environ.get("FLYLOCAL_COSTS") or Path.home() / ".cache" / "flylocal" / "costs")
