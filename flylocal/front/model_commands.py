"""`flylocal models`: the registry (models.txt) and the GGUF files other tools keep, listed,
shown, paired with drafts, fetched and located."""

from __future__ import annotations

import click

from flylocal.errors import FlylocalError
from flylocal.front.terminal import note, row


@click.group()
def models():
    """Models: the registry (models.txt) and the GGUF files other tools keep (LM Studio, ollama,
    the Hugging Face cache, llama.cpp's cache, FLYLOCAL_MODEL_PATH): list, show, pairs, fetch, path."""


def human_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n}B"


LOCAL_COLUMNS = (("ARCH", "<10"), ("PARAMS", ">7"), ("TYPE", "<8"), ("SIZE", ">9"), ("CONTEXT", ">7"),
                 ("VOCAB", ">7"), ("TEMPLATE", ""))


def local_row(info) -> tuple[str, ...]:
    """One model's LOCAL_COLUMNS from its gguf_info.Info."""
    return (info.architecture or "?", human_count(info.parameters), info.file_type, human_bytes(info.file_size),
            str(info.context_length or "?"), str(info.vocab_size), "yes" if info.chat_template else "no")


def columns(values) -> str:
    """`values` laid out in LOCAL_COLUMNS (the first ones, for fewer values)."""
    return " ".join(f"{v:{spec}}" for v, (_, spec) in zip(values, LOCAL_COLUMNS))


@models.command("list")
def models_list():
    """List registry models and the state of each file on disk (its sha256 is checked), then
    every GGUF file found in the places other tools keep them, with what its header says (read
    without llama.cpp, and cached). A file that cannot be read is listed as unreadable."""
    from flylocal import models as registry
    from flylocal.models import library

    for entry in registry.load_registry().values():
        state = registry.status(entry.name)
        row(f"{entry.name:30} {entry.kind:8} {state:24} {entry.note}")
    for warning in library.model_path_warnings():
        note(warning)
    found = library.discover()
    if not found:
        note("no local GGUF files in " + ", ".join(str(root) for _, root in library.places()))
        return
    width = max(len("LOCAL MODEL"), *(len(m.name) for m in found))
    row(f"{'LOCAL MODEL':{width}}  " + columns(title for title, _ in LOCAL_COLUMNS))
    infos = iter(library.describe([m.path for m in found if not m.problem]))
    for m in found:
        info = m.problem or next(infos)
        if isinstance(info, (str, FlylocalError)):
            row(f"{m.name:{width}}  unreadable: {info}")
        else:
            row(f"{m.name:{width}}  " + columns(local_row(info)))


def describe_one(path):
    """gguf_info.Info of model file `path`; FlylocalError (one line) if it cannot be read."""
    from flylocal.models import library

    info = library.describe([path])[0]
    if isinstance(info, Exception):
        raise info
    return info


@models.command("show")
@click.argument("name")
def models_show(name):
    """Print what model NAME (a registry name, a path or a local model's name) says about itself
    in its GGUF header, without loading it."""
    from flylocal import models as registry

    path = registry.resolve(name, note)
    info = describe_one(path)
    rows = [
        ("name", name), ("path", str(path)), ("architecture", info.architecture or "?"),
        ("model name", info.name or "?"), ("parameters", f"{info.parameters:,} ({human_count(info.parameters)})"),
        ("file type", info.file_type), ("file size", f"{info.file_size:,} bytes ({human_bytes(info.file_size)})"),
        ("context length", str(info.context_length or "?")),
        ("vocabulary", f"{info.vocab_size} tokens ({info.tokenizer or 'no'} tokenizer)"),
        ("tokenizer", info.fingerprint or "none"), ("chat template", "yes" if info.chat_template else "no"),
    ]
    for label, value in rows:
        row(f"{label + ':':16}{value}")


@models.command("pairs")
@click.argument("target", required=False)
def models_pairs(target):
    """List the local models that can draft for TARGET (default: the default target), smaller
    first: those with the same tokenizer (llama.cpp's rule, checked from the GGUF headers), then
    those with another vocabulary, which draft through text. Files as large as the target are left
    out. Suggests the target requantized to Q4_0 as a draft where none is here."""
    from flylocal import models as registry
    from flylocal.models import library
    from flylocal.settings import DEFAULT_TARGET

    target = target or DEFAULT_TARGET
    path = registry.resolve(target, note)
    me = library.Candidate(target, path, describe_one(path))
    pairs = library.draft_pairs(me, library.candidates())
    row(f"drafts for {target} ({', '.join(local_row(me.info)[:4])}):")
    width = max([len(p.draft.name) for p in pairs] + [20])
    for same, title in ((True, "same vocabulary"), (False, "through text (another vocabulary)")):
        group = [p for p in pairs if p.same_vocab == same]
        row(f"{title}:")
        for p in group:
            row(f"  {p.draft.name:{width}}  {p.ratio:5.2f}x  " + columns(local_row(p.draft.info)[:4]))
        if not group:
            row("  none")
    hint = library.requantize_hint(me, pairs)
    if hint:
        row(f"requantized: {hint}")


@models.command("fetch")
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="Fetch again even if present.")
def models_fetch(names, force):
    """Fetch NAMES (default: every model that needs no URL) and check their sha256."""
    from flylocal import models as registry

    entries = registry.load_registry()
    for name in names or [e.name for e in entries.values() if e.kind != "url"]:
        path = registry.fetch(name, force=force, log=note)
        row(f"{name}: {path}")


@models.command("path")
@click.argument("name")
def models_path(name):
    """Print the local path of model NAME (a registry name or a local model's name)."""
    from flylocal import models as registry

    row(str(registry.resolve(name)))
