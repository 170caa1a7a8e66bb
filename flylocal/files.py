"""Files flylocal reads and writes: text a user gives, read as UTF-8 with one-line errors, and
files written so that a reader never sees half of one."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from flylocal.errors import FlylocalError


def read_text(path: str | os.PathLike, what: str, limit: int | None = None, regular: bool = False) -> str:
    """The text of file `path` (UTF-8; a byte-order mark is dropped), named `what` in the
    one-line FlylocalError when it cannot be read, is larger than `limit` bytes or is not text.
    `regular`: only a regular file is read (`open_regular`), never a pipe a reader would wait on."""
    try:
        with (open_regular(path) if regular else open(path, "rb")) as f:
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


class NotRegular(OSError):
    """A path that names a pipe, a device, a socket or a link where a regular file was wanted."""


def open_regular(path: str | os.PathLike):
    """`path` open for reading in binary, if it is a regular file: a FIFO (whose open would wait
    for a writer for ever), a device, a socket or a symbolic link raises NotRegular, checked
    before the open (lstat) and on what was opened (O_NOFOLLOW | O_NONBLOCK, then fstat).
    Raises OSError."""
    kind = stat.S_IFMT(os.lstat(path).st_mode)
    if kind != stat.S_IFREG:
        raise NotRegular(errno.EINVAL, f"not a regular file ({_KINDS.get(kind, 'a special file')})")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):          # replaced between the two looks
            raise NotRegular(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket",
          stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory"}


def new_temp(directory: Path, prefix: str, suffix: str, mode: int = 0o666) -> tuple[int, Path]:
    """A new file PREFIX + random + SUFFIX in `directory`, open for writing: tempfile.mkstemp,
    but with the permissions of any new file (`mode`, 0666, less the umask), not always 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = directory / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return os.open(path, flags, mode), path
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


def usable_folder(folder: str | os.PathLike, what: str) -> Path:
    """`folder`, made if need be and writable; FlylocalError naming `what` otherwise."""
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = new_temp(path, ".probe.", ".tmp")
        os.close(fd)
        tmp.unlink()
    except OSError as e:
        raise FlylocalError(f"{what} {folder}: {e.strerror or e}") from None
    return path
