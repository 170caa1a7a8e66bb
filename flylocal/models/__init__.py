"""Model files: the registry of models flylocal fetches and derives (models.txt;
flylocal.models.registry) and the models other tools keep (flylocal.models.library), read with
the GGUF header reader (flylocal.gguf_info). `resolve` turns any model's name or path
into a local file.

The registry's calls are this package's (`from flylocal import models; models.fetch(...)`).
The registry imports nothing above it; the library imports the registry; this module imports
both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from flylocal.errors import FlylocalError
from flylocal.models import library
from flylocal.gguf_info import Layout, check_gguf_file, read_layout
from flylocal.models.registry import (
    Entry,
    cache_dir,
    check_cached,
    check_compatible,
    fetch,
    fetched_or_derivable,
    load_registry,
    local_path,
    registry_path,
    sha256_file,
    stamp_path,
    status,
)

__all__ = ["Entry", "Layout", "cache_dir", "check_compatible", "fetch", "load_registry", "local_path", "read_layout",
           "registry_path", "resolve", "sha256_file", "stamp_path", "status"]


def resolve(spec: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """A model's name or path -> the local GGUF path, trying in turn: a registry name (derived
    offline where it can be), a file's path, and the name of a model another tool keeps
    (flylocal.models.library: LM Studio, ollama, the Hugging Face cache, llama.cpp's cache,
    FLYLOCAL_MODEL_PATH). An `hf:` name not in the Hugging Face cache is fetched from the hub.

    A cached registry model is checked against its verification record (no hashing when the
    record matches); see `flylocal.models.registry.check_cached`."""
    registry = load_registry()
    if spec in registry:
        path = local_path(spec)
        if path.exists():
            check_cached(registry[spec], path, log)
            return path
        entry = registry[spec]
        if entry.kind == "derived" and fetched_or_derivable(entry, registry):
            return fetch(spec, log=log)
        raise FlylocalError(f"model {spec} is not fetched yet: run `flylocal models fetch {spec}`")
    path = Path(spec).expanduser()
    if not path.exists():
        local = _local_model(spec, log)
        if local is not None:
            return local
    if path.exists() or os.sep in spec or spec.endswith(".gguf"):
        check_gguf_file(path)
        return path
    raise FlylocalError(f"unknown model {spec!r}: not a file, not in models.txt and no local model of that name "
                        "(see `flylocal models list`)")


def _local_model(spec: str, log: Callable[[str], None]) -> Path | None:
    """The file of the model another tool keeps under name `spec` (flylocal.models.library), an `hf:`
    file fetched from the hub when the Hugging Face cache lacks it, or None."""
    for warning in library.model_path_warnings():
        log(warning)
    found = library.find(spec)
    if found is None:
        return library.fetch_from_hub(spec, log) if spec.startswith("hf:") else None
    if found.problem:
        raise FlylocalError(found.problem)
    check_gguf_file(found.path)
    return found.path
