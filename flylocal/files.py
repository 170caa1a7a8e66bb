"""Model files: what flylocal tells about a GGUF file without llama.cpp."""

from __future__ import annotations

from pathlib import Path

from flylocal.errors import ModelError

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Raise ModelError unless `path` is a readable file that starts like a GGUF file (before
    llama.cpp is asked to load it; llama.cpp itself names what is wrong inside one)."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file: {path}")
