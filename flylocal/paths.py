"""Where flylocal keeps what it measured of this machine: the decode cost curves
(flylocal.decoding.costs) and the thread count --threads auto settled on (flylocal.llama.threads)."""

from __future__ import annotations

import os
from pathlib import Path


def costs_dir() -> Path:
    """$FLYLOCAL_COSTS, or ~/.cache/flylocal/costs."""
    return Path(os.environ.get("FLYLOCAL_COSTS") or Path.home() / ".cache" / "flylocal" / "costs")
