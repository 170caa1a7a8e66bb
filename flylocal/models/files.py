"""Writing model files so that a reader never sees half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def new_temp(directory: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new file PREFIX + random + SUFFIX in `directory`, open for writing: tempfile.mkstemp,
    but with the permissions of any new file (0666 less the umask), not 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = directory / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` through a temporary file and a rename, so that a reader sees
    the old file or the new one, never a part. Raises OSError; leaves no temporary file."""
    fd, tmp = new_temp(path.parent, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
