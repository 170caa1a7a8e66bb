"""The GGUF files people already have, found where other tools keep them, and what each one is
(docs/design.md, "Local models").

Every file gets a name, SOURCE:NAME:

- `lmstudio:PUBLISHER/REPO/FILE.gguf`: LM Studio's folders, ~/.lmstudio/models and
  ~/.cache/lm-studio/models;
- `ollama:NAME:TAG` (`ollama:USER/NAME:TAG`, `ollama:HOST/NAMESPACE/NAME:TAG`): ollama's store,
  `$OLLAMA_MODELS` or ~/.ollama/models, where a manifest names the model's blob by its digest
  (NAME alone means NAME:latest);
- `hf:ORG/REPO/FILE.gguf`: the Hugging Face hub cache, `$HF_HUB_CACHE` (or `$HF_HOME/hub`) or
  ~/.cache/huggingface/hub, whose snapshots link into blobs/;
- `llama.cpp:FILE.gguf`: llama.cpp's download cache, `$LLAMA_CACHE` or ~/.cache/llama.cpp;
- `local:FILE.gguf`: the folders in `$FLYLOCAL_MODEL_PATH` (os.pathsep-separated), and the
  GGUF files it names directly.

`find` matches a name, or a short form of one (the name without its source, the file name, the
file stem) when only one file answers to it. Finding files reads no GGUF header; `describe`
does, through flylocal.gguf_info, and keeps what it read in a small JSON cache keyed by path,
size and mtime (`$FLYLOCAL_METADATA` or ~/.cache/flylocal/gguf-metadata.json), so a second
listing parses nothing. `draft_pairs` ranks the files that can draft for a target.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from flylocal.errors import FlylocalError, ModelError
from flylocal.models import registry
from flylocal.files import write_atomically
from flylocal.gguf_info import FORMAT, Info, UnreadableFile, read_info

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_LIBRARY = "library"
DRAFT_QTYPE = "Q4_0"     # the requantization suggested as a same-vocabulary draft


@dataclass(frozen=True)
class LocalModel:
    """One GGUF file found on this machine, or a model whose file is missing (`problem`)."""
    name: str              # "ollama:llama3.2:1b"
    path: Path
    problem: str = ""      # why there is no file to read (a manifest that cannot be used)

    @property
    def short_names(self) -> set[str]:
        """The forms that name this file when no other file answers to them (casefolded)."""
        source, _, rest = self.name.partition(":")
        names = {rest}
        if source == "ollama":
            if rest.endswith(":latest"):
                names |= {rest.removesuffix(":latest"), self.name.removesuffix(":latest")}
        else:
            names |= {self.path.name, self.path.stem}
        return {n.casefold() for n in names}


# ---- where tools keep their models

def _home() -> Path:
    """The user's home; without one (no HOME and no passwd entry), a path where nothing is."""
    try:
        return Path.home()
    except RuntimeError:
        return Path(os.devnull) / "no-home"


def lmstudio_dirs() -> list[Path]:
    return [_home() / ".lmstudio" / "models", _home() / ".cache" / "lm-studio" / "models"]


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or _home() / ".ollama" / "models")


def hub_cache() -> Path:
    """The Hugging Face hub cache, found the way huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return _home() / ".cache" / "huggingface" / "hub"


def llama_cache() -> Path:
    return Path(os.environ.get("LLAMA_CACHE") or _home() / ".cache" / "llama.cpp")


def _model_path() -> list[tuple[str, Path | None]]:
    """$FLYLOCAL_MODEL_PATH's entries in order: (the text, its path; None for ~user of no user)."""
    entries = []
    for d in os.environ.get("FLYLOCAL_MODEL_PATH", "").split(os.pathsep):
        if d:
            try:
                entries.append((d, Path(d).expanduser()))
            except RuntimeError:       # ~user of no user: nothing is there
                entries.append((d, None))
    return entries


def model_path_entries() -> tuple[list[Path], list[Path], list[str]]:
    """$FLYLOCAL_MODEL_PATH's entries: (folders, GGUF files named directly, entries that name
    nothing there). A folder that does not exist yet counts as missing, but stays a folder a
    download may go to (model_path_dirs)."""
    folders, files, missing = [], [], []
    for d, path in _model_path():
        if path is not None and path.is_file():
            files.append(path)
        elif path is not None and path.is_dir():
            folders.append(path)
        else:
            missing.append(d)
    return folders, files, missing


def model_path_dirs() -> list[Path]:
    """The folders in $FLYLOCAL_MODEL_PATH, existing or not (not the files it names)."""
    return [path for _, path in _model_path() if path is not None and not path.is_file()]


_warned: set[str] = set()


def model_path_warnings() -> list[str]:
    """One line for each $FLYLOCAL_MODEL_PATH entry that names nothing, the first time it is
    seen in this process."""
    lines = []
    for d in model_path_entries()[2]:
        if d not in _warned:
            _warned.add(d)
            lines.append(f"FLYLOCAL_MODEL_PATH names {d}, which does not exist")
    return lines


# ---- finding files

def places() -> list[tuple[str, Path]]:
    """Where local models are looked for, as (source, folder), in the order names are taken."""
    return [*(("lmstudio", d) for d in lmstudio_dirs()), ("ollama", ollama_dir()), ("hf", hub_cache()),
            ("llama.cpp", llama_cache()), *(("local", d) for d in model_path_dirs())]


def discover() -> list[LocalModel]:
    """Every local model, in the order of `places`; a name found twice (two LM Studio folders,
    two FLYLOCAL_MODEL_PATH folders) keeps its first file."""
    found: dict[str, LocalModel] = {}
    for source, root in places():
        scan = {"ollama": _ollama, "hf": _hub}.get(source)
        for model in scan(root) if scan else _in_folder(root, source):
            found.setdefault(model.name, model)
    for path in model_path_entries()[1]:          # files FLYLOCAL_MODEL_PATH names directly
        found.setdefault(f"local:{path.name}", LocalModel(f"local:{path.name}", path))
    return list(found.values())


def _gguf_files(root: Path) -> Iterator[Path]:
    """The .gguf files under `root`, in a stable order. Hidden folders (tools' locks and partial
    downloads) are skipped; linked folders are not followed, linked files are."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".gguf") and not name.startswith("."):
                yield Path(folder) / name


def _in_folder(root: Path, source: str) -> Iterator[LocalModel]:
    for path in _gguf_files(root):
        yield LocalModel(f"{source}:{path.relative_to(root).as_posix()}", path)


def _ollama(root: Path) -> Iterator[LocalModel]:
    """ollama's models: manifests/HOST/NAMESPACE/NAME/TAG, each a JSON manifest whose model layer
    names its blob, blobs/sha256-HEX, by digest."""
    manifests = root / "manifests"
    for folder, dirs, files in os.walk(manifests):
        dirs.sort()
        for tag in sorted(files):
            manifest = Path(folder) / tag
            parts = manifest.relative_to(manifests).parts
            if len(parts) != 4:
                continue
            name = "ollama:" + _ollama_name(*parts)
            try:
                blob = _ollama_blob(root, manifest)
            except ModelError as e:
                yield LocalModel(name, manifest, str(e))
                continue
            if blob is not None:
                yield LocalModel(name, blob)


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host != OLLAMA_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace != OLLAMA_LIBRARY:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def _ollama_blob(root: Path, manifest: Path) -> Path | None:
    """The blob holding the manifest's GGUF file; None for a manifest without a model layer (an
    adapter or a projector alone)."""
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
        digest = next((layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        raise ModelError(f"ollama manifest {manifest} cannot be read as JSON with layers") from None
    if digest is None:
        return None
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise ModelError(f"ollama manifest {manifest} names the blob {digest!r}")
    return root / "blobs" / f"{algorithm}-{hexdigest}"


def _hub(root: Path) -> Iterator[LocalModel]:
    """The hub cache's GGUF files: models--ORG--REPO/snapshots/REVISION/FILE. A file in several
    snapshots is named after the one refs/main points to, else the newest."""
    if not root.is_dir():
        return
    for repo_dir in sorted(root.glob("models--*--*")):
        repo_id = "/".join(repo_dir.name.split("--")[1:])
        for snapshot in _snapshots(repo_dir):
            for path in _gguf_files(snapshot):
                yield LocalModel(f"hf:{repo_id}/{path.relative_to(snapshot).as_posix()}", path)


def _snapshots(repo_dir: Path) -> list[Path]:
    try:
        snapshots = sorted((p for p in (repo_dir / "snapshots").iterdir() if p.is_dir()),
                           key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    try:
        main = (repo_dir / "refs" / "main").read_text().strip()
    except (OSError, ValueError):       # missing, unreadable, or not text
        return snapshots
    return sorted(snapshots, key=lambda p: p.name != main)


def find(spec: str) -> LocalModel | None:
    """The local model `spec` names: its full name, or a short form only one file answers to.
    Raises FlylocalError, listing the candidates, when several files do."""
    models = discover()
    for model in models:
        if model.name == spec:
            return model
    key = spec.casefold()
    matches: dict[object, LocalModel] = {}
    for model in models:
        if key in model.short_names:
            matches.setdefault(identity(model.path), model)
    if len(matches) > 1:
        names = ", ".join(sorted(m.name for m in matches.values()))
        raise FlylocalError(f"model name {spec!r} is ambiguous: it names {names} (give the whole name)")
    return next(iter(matches.values()), None)


def identity(path: Path) -> object:
    """What makes two paths one file: hard links and links into a blob store name one file."""
    try:
        st = os.stat(path)
    except OSError:
        return path
    return st.st_dev, st.st_ino


# ---- what each file is

def metadata_path() -> Path:
    return Path(os.environ.get("FLYLOCAL_METADATA") or _home() / ".cache" / "flylocal" / "gguf-metadata.json")


def describe(paths: list[Path]) -> list[Info | ModelError]:
    """Each file's Info, or the ModelError that says why it cannot be read: from the metadata
    cache where the file's size and mtime are those cached, else parsed and cached (a cache that
    cannot be written only means parsing again next time)."""
    cache_file = metadata_path()
    cache = _load_cache(cache_file)
    parsed: dict[str, dict] = {}
    results = [_describe_one(Path(p), cache, parsed) for p in paths]
    if parsed:
        _save_cache(cache_file, {**cache, **parsed})
    return results


def _describe_one(path: Path, cache: dict, parsed: dict) -> Info | ModelError:
    """One file's Info or ModelError; what had to be parsed is added to `parsed` for the cache."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ModelError(f"model file not found: {path}")
    except OSError as e:
        return ModelError(f"cannot read model file {path}: {e.strerror}")
    if not stat.S_ISREG(st.st_mode):
        return ModelError(f"model path is not a file: {path}")
    key = str(path.absolute())
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cached = _from_entry(parsed.get(key) or cache.get(key), stamp)
    if cached is not None:
        return cached
    try:
        info = read_info(path)
    except UnreadableFile as e:          # permissions or I/O: may change without a new mtime
        return e
    except ModelError as e:
        parsed[key] = {**stamp, "error": str(e)}
        return e
    parsed[key] = {**stamp, "info": info.to_dict()}
    return info


def _from_entry(entry, stamp: dict) -> Info | ModelError | None:
    """A cache entry's result, or None when there is none for the file as it is now."""
    if not isinstance(entry, dict) or {k: entry.get(k) for k in stamp} != stamp:
        return None
    if "error" in entry:
        return ModelError(str(entry["error"]))
    try:
        return Info.from_dict(entry["info"])
    except (KeyError, TypeError):
        return None


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _save_cache(path: Path, files: dict) -> None:
    """Write the cache atomically, keeping only files that still exist."""
    kept = {key: entry for key, entry in files.items() if os.path.exists(key)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"format": FORMAT, "files": kept}))
    except OSError:
        pass


# ---- drafts for a target

@dataclass(frozen=True)
class Candidate:
    """A readable model file under the name it is offered by."""
    name: str
    path: Path
    info: Info


@dataclass(frozen=True)
class Pair:
    """A draft for one target."""
    draft: Candidate
    ratio: float           # draft parameters / target parameters
    same_vocab: bool       # same tokenizer fingerprint: llama.cpp's rule holds


def candidates() -> list[Candidate]:
    """Every readable local model: the registry's fetched files under their registry names, then
    the files `discover` finds. A file reached under several names is listed once."""
    named = [(name, registry.local_path(name)) for name in registry.load_registry()]
    named = [(name, path) for name, path in named if path.exists()]
    named += [(m.name, m.path) for m in discover() if not m.problem]
    seen, out = set(), []
    for (name, path), info in zip(named, describe([path for _, path in named])):
        key = identity(path)
        if key in seen or isinstance(info, Exception):
            continue
        seen.add(key)
        out.append(Candidate(name, path, info))
    return out


def draft_pairs(target: Candidate, pool: list[Candidate]) -> list[Pair]:
    """The files in `pool` that can draft for `target`: those with a tokenizer, smaller than
    the target (a file as large is the target itself, or a copy), ranked by parameter ratio,
    smaller first; same-vocabulary drafts before those that draft through text."""
    size = target.info.file_size
    pairs = []
    for c in pool:
        if (not c.info.fingerprint or not c.info.parameters or c.info.file_size >= size
                or identity(c.path) == identity(target.path)):      # no weights (a vocabulary alone), or no smaller
            continue
        ratio = c.info.parameters / target.info.parameters if target.info.parameters else 0.0
        pairs.append(Pair(c, ratio, c.info.fingerprint == target.info.fingerprint))
    return sorted(pairs, key=lambda p: (not p.same_vocab, p.ratio, p.draft.info.file_size, p.draft.name))


def requantize_hint(target: Candidate, pairs: list[Pair]) -> str | None:
    """How to get the target requantized to Q4_0, the cheapest same-vocabulary draft that still
    follows it closely: the registry's entry for it, a file already here, or the command that
    derives it with llama.cpp's quantizer. None when the target is Q4_0 already."""
    if target.info.file_type == DRAFT_QTYPE:
        return None
    for entry in registry.load_registry().values():
        if entry.source == f"derive:{target.name}:{DRAFT_QTYPE}":
            if registry.local_path(entry.name).exists():
                return f"registry model {entry.name} is this target requantized to {DRAFT_QTYPE} (fetched)"
            return (f"registry model {entry.name} is this target requantized to {DRAFT_QTYPE}: "
                    f"`flylocal models fetch {entry.name}` derives it")
    for p in pairs:
        if p.same_vocab and p.draft.info.file_type == DRAFT_QTYPE and p.draft.info.parameters == target.info.parameters:
            return f"{p.draft.name} is this target's model in {DRAFT_QTYPE}"
    dest, name = derived_file(target)
    args = ", ".join(json.dumps(str(a)) for a in (target.path, dest, DRAFT_QTYPE))   # JSON strings are Python's too
    code = f"from flylocal.llama.model import quantize; quantize({args})"
    return f"derive a {DRAFT_QTYPE} draft, found afterwards as {name}: {shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def derived_file(target: Candidate) -> tuple[Path, str]:
    """Where a draft derived from `target` goes so that discovery finds it, and the name it is
    found under: the first FLYLOCAL_MODEL_PATH folder, else llama.cpp's cache."""
    filename = f"{_stem(target)}-{DRAFT_QTYPE}.gguf"
    dirs = model_path_dirs()
    if dirs:
        return dirs[0] / filename, f"local:{filename}"
    return llama_cache() / filename, f"llama.cpp:{filename}"


def _stem(target: Candidate) -> str:
    """A file stem for something derived from `target`; ollama's blobs are named by digest, so
    their model name serves instead."""
    stem = target.path.stem
    if target.path.name.startswith("sha256-"):
        stem = target.name.partition(":")[2]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem)


# ---- from the hub

def fetch_from_hub(spec: str, log: Callable[[str], None]) -> Path:
    """Download `hf:ORG/REPO/FILE.gguf` into the Hugging Face cache and check its sha256 against
    the hub's LFS record. A file that does not match is removed from the cache again."""
    repo_id, filename = _hub_parts(spec)
    try:
        import huggingface_hub
    except ImportError:
        raise FlylocalError(f"{spec} is not in the Hugging Face cache ({hub_cache()}); fetching it needs "
                            "huggingface_hub: pip install 'flylocal[hf]'") from None
    log(f"fetching {filename} from {repo_id} on the Hugging Face hub into {hub_cache()}")
    try:
        info = huggingface_hub.HfApi().model_info(repo_id, files_metadata=True)
    except Exception as e:       # requests' or httpx's errors, by huggingface_hub's version
        raise _hub_error(spec, e) from None
    sibling = next((s for s in info.siblings or () if s.rfilename == filename), None)
    if sibling is None:
        raise FlylocalError(f"{repo_id} on the Hugging Face hub has no file {filename}")
    if sibling.lfs is None:
        raise FlylocalError(f"{repo_id}/{filename} on the Hugging Face hub has no LFS sha256 to check it by")
    try:
        path = Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=info.sha, cache_dir=hub_cache()))
    except Exception as e:
        raise _hub_error(spec, e) from None
    _check_hub_sha(path, sibling.lfs.sha256)
    return path


def _hub_error(spec: str, e: Exception) -> FlylocalError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return FlylocalError(f"cannot fetch {spec} from the Hugging Face hub: {first}")


def _hub_parts(spec: str) -> tuple[str, str]:
    parts = spec.removeprefix("hf:").split("/")
    if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
        raise FlylocalError(f"{spec!r} is not a Hugging Face file: write hf:ORG/REPO/FILE.gguf")
    return "/".join(parts[:2]), "/".join(parts[2:])


def _check_hub_sha(path: Path, expected: str) -> None:
    digest = registry.sha256_file(path)
    if digest == expected.lower():
        return
    blob = Path(os.path.realpath(path))
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise FlylocalError(f"{path} does not match the hub's sha256 (got {digest}, expected {expected}); "
                        "removed it: fetch it again")
