"""Kept KV states on disk: the prompt cache's disk tier (`serve --prompt-cache DIR`) and chat's
saved conversations (docs/serving.md, "Prompt cache").

A file holds one entry: each model's cells of one sequence (llama.cpp's per-sequence state) and
the token ids they hold, under the key they were taken with (`Sequences.state_key`: the model
file, the build, the backend, the cache's shape), in the partition of requests that may use it
(docs/serving.md, "Who shares the prompt cache"), and a SHA-256 of all of that:

    MAGIC | header length (8 bytes, little-endian) | header (JSON: key, partition, tokens,
    sizes) | SHA-256 of everything before it and the states (32 bytes) | the states, one after another

Reading checks, in order: a regular file (never a FIFO, device, socket or link: `open_regular`),
the key, the tokens a caller expects, and only then reads the states, whose digest must match
over the header, the tokens and the states together. A file whose key is not the reader's is
never loaded; one that is cut short or whose bytes do not match its digest is deleted. Files are
written whole and renamed, so that two processes sharing the folder never read half of one, and
readable by their owner alone. The digest finds damage and mixed files, not a forger: whoever can
write the folder can write a file with a digest of its own, so the folder is as private as the
conversations it keeps.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import struct
import time
from pathlib import Path
from typing import Callable

import numpy as np

from flylocal.decoding.prompt_cache import Entry
from flylocal.files import NotRegular as NotRegularError, new_temp, open_regular

MAGIC = b"FLYLOCAL-PROMPT 2\n"
OLD_MAGIC = b"FLYLOCAL-PROMPT "       # an earlier version's files: their digest covered the states only
SUFFIX = ".prompt"
MAX_HEADER = 64 << 20
DIGEST = 32
STALE_S = 60.0          # a temporary file left this long unchanged is a dead writer's: removed at start


class Unusable(Exception):
    """A file that cannot be loaded: `foreign` (another model, build or context) or damaged;
    `special` when it is no regular file (left alone)."""

    def __init__(self, why: str, foreign: bool = False, special: bool = False):
        super().__init__(why)
        self.foreign, self.special = foreign, special


def key_text(keys: list[dict]) -> str:
    return json.dumps(keys, sort_keys=True)


def write(path: Path, keys: list[dict], tokens: list[np.ndarray], data: list[bytes | None],
          partition: str = "") -> int:
    """Write an entry to `path` (whole, then renamed); its size in bytes. Raises OSError."""
    header = json.dumps({"key": json.loads(key_text(keys)), "partition": partition,
                         "tokens": [np.asarray(t).tolist() for t in tokens],
                         "sizes": [-1 if d is None else len(d) for d in data]}).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    digest = hashlib.sha256(head)
    for d in data:
        if d is not None:
            digest.update(d)
    fd, tmp = new_temp(path.parent, f".{path.name}.", ".tmp", mode=0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head + digest.digest())
            for d in data:
                if d is not None:
                    f.write(d)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(head) + DIGEST + sum(len(d) for d in data if d is not None)


def read_header(f, keys: list[dict] | None) -> dict:
    """The header of the open file `f`, with "raw" (the bytes the digest covers before the
    states) and "sha256" (the digest); Unusable when it is damaged, or of another key than
    `keys`. Reads nothing past the digest."""
    head = f.read(len(MAGIC) + 8)
    if not head.startswith(MAGIC):
        why = "made by another version of flylocal" if head.startswith(OLD_MAGIC) else \
            "not a prompt cache file, or cut short"
        raise Unusable(why)
    if len(head) < len(MAGIC) + 8:
        raise Unusable("cut short")
    (n,) = struct.unpack("<Q", head[len(MAGIC):])
    raw = f.read(n) if n <= MAX_HEADER else b""
    try:
        header = json.loads(raw)
        header["sizes"] = sizes = [int(n) for n in header["sizes"]]
        header["tokens"] = tokens = [np.asarray(t, dtype=np.int32).reshape(-1) for t in header["tokens"]]
        if len(sizes) != len(tokens) or not isinstance(header.get("partition", ""), str):
            raise ValueError
    except (ValueError, KeyError, TypeError, OverflowError):
        raise Unusable("its header is damaged") from None
    if keys is not None and key_text(header["key"]) != key_text(keys):
        raise Unusable("it was made by another model, build or context size", foreign=True)
    header["partition"] = header.get("partition", "")
    header["raw"] = head + raw
    header["sha256"] = f.read(DIGEST)
    if len(header["sha256"]) != DIGEST:
        raise Unusable("cut short")
    return header


def read(path: Path, keys: list[dict], tokens: list[np.ndarray] | None = None,
         partition: str | None = None) -> tuple[list[np.ndarray], list[bytes | None]]:
    """(each model's token ids, each model's state) of the entry at `path`; Unusable when it is
    missing, no regular file, damaged, foreign, or holds other `tokens` or another `partition`
    than the caller expects (checked before any state is read)."""
    try:
        with open_regular(path) as f:
            header = read_header(f, keys)
            if tokens is not None and (len(tokens) != len(header["tokens"]) or not all(
                    np.array_equal(a, b) for a, b in zip(tokens, header["tokens"]))):
                raise Unusable("it holds other tokens than its entry", foreign=True)
            if partition is not None and header["partition"] != partition:
                raise Unusable("it belongs to another partition", foreign=True)
            data = [None if n < 0 else read_into_map(f, n) for n in header["sizes"]]
            extra = f.read(1)
    except NotRegularError as e:
        raise Unusable(e.strerror, special=True) from None
    except OSError as e:
        raise Unusable(f"cannot read it: {e.strerror}") from None
    digest = hashlib.sha256(header["raw"])
    for d, n in zip(data, header["sizes"]):
        if d is not None:
            if len(d) != n:
                raise Unusable("it is cut short")
            digest.update(d)
    if extra or digest.digest() != header["sha256"]:
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
    """The prompt cache's disk tier: entries in `folder` under `keys`, at most `limit` bytes of
    them. What it cannot read or write is said in one line, never raised: the cache then
    prefills, or keeps the entry out of the tier."""

    def __init__(self, folder: Path, limit: int, keys: list[dict], log: Callable[[str], None] = lambda s: None):
        self.folder, self.limit, self.keys, self.log = Path(folder), limit, keys, log
        self.folder.mkdir(parents=True, exist_ok=True)
        self.held = 0           # bytes of other writers' temporary files found at start (counted in the bound)

    def entries(self) -> list[Entry]:
        found, foreign, damaged, special = [], 0, 0, []
        self._sweep()
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                with open_regular(path) as f:
                    header = read_header(f, self.keys)
                    if os.fstat(f.fileno()).st_size != f.tell() + sum(max(n, 0) for n in header["sizes"]):
                        raise Unusable("its size is not what its header says")
            except NotRegularError as e:
                special.append(f"{path.name} ({e.strerror})")
                continue
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
            found.append(Entry(tokens, None, sum(max(n, 0) for n in header["sizes"]), 0, path=path,
                               partition=header["partition"]))
        if special:
            self.log(f"prompt cache: skipped {len(special)} entries in {self.folder} that are no regular files: "
                     + ", ".join(special[:3]) + (" ..." if len(special) > 3 else ""))
        if foreign:
            self.log(f"prompt cache: {foreign} entries in {self.folder} are of another model, build or context: "
                     "not loaded")
        if damaged:
            self.log(f"prompt cache: deleted {damaged} damaged entries in {self.folder}")
        return found

    def _sweep(self) -> None:
        """Temporary files of writers that died (unchanged for STALE_S) are removed; those of
        writers that may still be at work count against the bound (`held`)."""
        now, removed = time.time(), 0
        for path in self.folder.glob(f".*{SUFFIX}.*.tmp"):
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if now - st.st_mtime > STALE_S:
                    path.unlink()
                    removed += 1
                else:
                    self.held += st.st_size
            except OSError:
                continue
        if removed:
            self.log(f"prompt cache: removed {removed} unfinished files in {self.folder}")

    def put(self, entry: Entry) -> str | None:
        """Write `entry` (its data in memory) and set `entry.path`; why not, when it could not be
        written (nothing is left of the attempt)."""
        name = hashlib.sha256(entry.partition.encode() + np.asarray(entry.key, dtype=np.int32).tobytes()).hexdigest()
        path = self.folder / (name[:32] + SUFFIX)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)        # removed meanwhile: made again
            write(path, self.keys, entry.tokens, entry.data, entry.partition)
        except OSError as e:
            return f"cannot write {path}: {e.strerror or e}"
        entry.path = path
        return None

    def load(self, entry: Entry) -> list[bytes | None] | None:
        if entry.path is None:
            return None
        try:
            _, data = read(entry.path, self.keys, entry.tokens, entry.partition)
        except Unusable as e:
            self.log(f"prompt cache: {entry.path} is not loaded: {e}")
            if not (e.foreign or e.special):
                self.remove(entry)
            return None
        return data

    def remove(self, entry: Entry) -> None:
        try:
            Path(entry.path).unlink(missing_ok=True)
        except OSError:
            pass
