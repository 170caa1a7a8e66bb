"""The bench's pictures: matplotlib without a display, and a figure saved where an error names
the file (speedup.png, quality.png)."""

from __future__ import annotations

from pathlib import Path

from flylocal.errors import FlylocalError


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path: Path) -> Path:
    """Write `fig` to `path` and close it; an error names the file."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise FlylocalError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
