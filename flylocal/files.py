"""Files flylocal reads and writes: text a user gives, read as UTF-8 with one-line errors, and
files written so that a reader never sees half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from flylocal.errors import FlylocalError


def read_text(path: str | os.PathLike, what: str, limit: int | None = None) -> str:
    """The text of file `path` (UTF-8; a byte-order mark is dropped), named `what` in the
    one-line FlylocalError when it cannot be read, is larger than `limit` bytes or is not text."""
    try:
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise FlylocalError(f"cannot read {what}: {e.strerror}") from None
    if limit is not None and len(data) > limit:
        raise FlylocalError(f"{what} is larger than {limit >> 20} MiB")
    return decode_text(data, what)


def decode_text(data: bytes, what: str) -> str:
    """`data` as UTF-8 text; FlylocalError naming `what` where it is not."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FlylocalError(f"{what} is not valid UTF-8 text (bad byte at offset {e.start})") from None


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
