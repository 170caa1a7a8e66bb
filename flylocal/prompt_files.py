"""Kept KV states on disk: the prompt cache's disk tier (`serve --prompt-cache DIR`) and chat's
saved conversations (docs/serving.md, "Prompt cache").

A file holds one entry: each model's cells of one sequence (llama.cpp's per-sequence state) and
the token ids they hold, under the key they were taken with (`Sequences.state_key`: the model
file, the build, the backend, the cache's shape) and a SHA-256 of the states:

    MAGIC | header length (8 bytes, little-endian) | header (JSON) | the states, one after another

A file whose key is not the reader's is never loaded; one that is cut short or whose bytes do
not match its digest is deleted. Files are written whole and renamed, so that two processes
sharing the folder never read half of one.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from flylocal.decoding.prompt_cache import Entry, PromptCache
from flylocal.errors import FlylocalError
from flylocal.files import new_temp

MAGIC = b"FLYLOCAL-PROMPT 1\n"
SUFFIX = ".prompt"
MAX_HEADER = 64 << 20


class Unusable(Exception):
    """A file that cannot be loaded: `foreign` (another model, build or context) or damaged."""

    def __init__(self, why: str, foreign: bool = False):
        super().__init__(why)
        self.foreign = foreign


def key_text(keys: list[dict]) -> str:
    return json.dumps(keys, sort_keys=True)


def write(path: Path, keys: list[dict], tokens: list[np.ndarray], data: list[bytes | None]) -> int:
    """Write an entry to `path` (whole, then renamed); its size in bytes. Raises OSError."""
    digest = hashlib.sha256()
    for d in data:
        if d is not None:
            digest.update(d)
    header = json.dumps({"key": json.loads(key_text(keys)), "tokens": [np.asarray(t).tolist() for t in tokens],
                         "sizes": [-1 if d is None else len(d) for d in data],
                         "sha256": digest.hexdigest()}).encode()
    fd, tmp = new_temp(path.parent, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for d in data:
                if d is not None:
                    f.write(d)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(MAGIC) + 8 + len(header) + sum(len(d) for d in data if d is not None)


def read_header(f, keys: list[dict] | None) -> dict:
    """The header of the open file `f`; Unusable when it is damaged, or of another key than `keys`."""
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
        raise Unusable("not a prompt cache file, or cut short")
    (n,) = struct.unpack("<Q", head[len(MAGIC):])
    raw = f.read(n) if n <= MAX_HEADER else b""
    try:
        header = json.loads(raw)
        header["sizes"] = sizes = [int(n) for n in header["sizes"]]
        header["tokens"] = tokens = [np.asarray(t, dtype=np.int32).reshape(-1) for t in header["tokens"]]
        if len(sizes) != len(tokens) or not isinstance(header["sha256"], str):
            raise ValueError
    except (ValueError, KeyError, TypeError, OverflowError):
        raise Unusable("its header is damaged") from None
    if keys is not None and key_text(header["key"]) != key_text(keys):
        raise Unusable("it was made by another model, build or context size", foreign=True)
    return header


def read(path: Path, keys: list[dict]) -> tuple[list[np.ndarray], list[bytes | None]]:
    """(each model's token ids, each model's state) of the entry at `path`; Unusable when it
    is missing, damaged or foreign."""
    try:
        with open(path, "rb") as f:
            header = read_header(f, keys)
            data = [None if n < 0 else read_into_map(f, n) for n in header["sizes"]]
    except OSError as e:
        raise Unusable(f"cannot read it: {e.strerror}") from None
    digest = hashlib.sha256()
    for d, n in zip(data, header["sizes"]):
        if d is not None:
            if len(d) != n:
                raise Unusable("it is cut short")
            digest.update(d)
    if digest.hexdigest() != header["sha256"]:
        raise Unusable("its bytes do not match its digest")
    return header["tokens"], data


def read_into_map(f, n: int):
    """The next `n` bytes of `f` in an anonymous memory map (Context.state's reason), or what
    there was of them, as bytes, when the file ends first."""
    if n == 0:
        return b""
    data = mmap.mmap(-1, n)
    got = f.readinto(data)
    return data if got == n else data[:got]


class Shelf:
    """The prompt cache's disk tier: entries in `folder` under `keys`, at most `limit` bytes of them."""

    def __init__(self, folder: Path, limit: int, keys: list[dict], log: Callable[[str], None] = lambda s: None):
        self.folder, self.limit, self.keys, self.log = Path(folder), limit, keys, log
        self.folder.mkdir(parents=True, exist_ok=True)

    def entries(self) -> list[Entry]:
        found, foreign, damaged = [], 0, 0
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                with open(path, "rb") as f:
                    header = read_header(f, self.keys)
                    if os.fstat(f.fileno()).st_size != f.tell() + sum(max(n, 0) for n in header["sizes"]):
                        raise Unusable("its size is not what its header says")
            except OSError:
                continue                                   # gone meanwhile (another process)
            except Unusable as e:
                if e.foreign:
                    foreign += 1
                else:
                    damaged += 1
                    path.unlink(missing_ok=True)
                continue
            tokens = header["tokens"]
            found.append(Entry(tokens, None, sum(max(n, 0) for n in header["sizes"]), 0, path=path))
        if foreign:
            self.log(f"prompt cache: {foreign} entries in {self.folder} are of another model, build or context: "
                     "not loaded")
        if damaged:
            self.log(f"prompt cache: deleted {damaged} damaged entries in {self.folder}")
        return found

    def put(self, entry: Entry) -> None:
        name = hashlib.sha256(np.asarray(entry.key, dtype=np.int32).tobytes()).hexdigest()[:32]
        path = self.folder / (name + SUFFIX)
        try:
            write(path, self.keys, entry.tokens, entry.data)
        except OSError as e:
            self.log(f"prompt cache: cannot write {path}: {e.strerror}")
            return
        entry.path = path

    def load(self, entry: Entry) -> list[bytes | None] | None:
        try:
            tokens, data = read(entry.path, self.keys)
        except Unusable as e:
            self.log(f"prompt cache: {entry.path} is not loaded: {e}")
            if not e.foreign:
                Path(entry.path).unlink(missing_ok=True)
            return None
        if len(tokens) != len(entry.tokens) or not all(np.array_equal(a, b) for a, b in zip(tokens, entry.tokens)):
            self.log(f"prompt cache: {entry.path} changed on disk: not loaded")
            return None
        return data

    def remove(self, entry: Entry) -> None:
        Path(entry.path).unlink(missing_ok=True)


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


# ----- the server's prompt cache, as its options ask -----

DEFAULT_RAM_SHARE = 0.25       # --cache-ram auto: a quarter of the memory available at start,
DEFAULT_RAM_MOST = 8 << 30     # at most 8 GiB (llama-server's default bound)


@dataclass(frozen=True)
class CacheOptions:
    ram_mib: int | None = None          # --cache-ram; None: auto; 0: no cache
    folder: Path | None = None          # --prompt-cache DIR: the disk tier
    disk_mib: int = 4096                # --prompt-cache-size


def open_cache(target, draft, options: CacheOptions, log: Callable[[str], None]) -> PromptCache | None:
    """The prompt cache of a server's models (`draft` may be None), or None when --cache-ram is
    0 or the target runs on rpc servers (its cells are theirs)."""
    from flylocal.llama.memory import available_bytes

    if options.ram_mib == 0 or target.config.rpc:
        return None
    if options.ram_mib is None:
        available = available_bytes()
        ram = int(min(DEFAULT_RAM_MOST, DEFAULT_RAM_SHARE * available)) if available else 1 << 30
    else:
        ram = options.ram_mib << 20
    models = [target] + ([draft] if draft is not None and not draft.config.rpc and draft.n_seq == target.n_seq else [])
    shelf = None
    if options.folder is not None:
        shelf = Shelf(Path(options.folder), options.disk_mib << 20, [m.state_key() for m in models], log)
    return PromptCache(models, ram, shelf, log)
