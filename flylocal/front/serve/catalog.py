"""Which models `flylocal serve` serves, and how each is run (docs/serving.md, "Every model from
one server"): the members of its Roster (flylocal.front.serve.roster).

- Without --target, every model `flylocal models list` finds (the registry's files, and those
  of LM Studio, ollama, the Hugging Face cache, llama.cpp's cache and FLYLOCAL_MODEL_PATH), by
  the names it prints; a repeated --model chooses some of them. The first is the default
  target where it is found (or the first --model): loaded at start, named by requests that
  name none.
- Each target gets the draft `flylocal models pairs` ranks first for it among the same
  vocabulary's, unless its settings name one or its drafter needs none. Where the command
  line's --drafter mla or model finds none for one of many models, that one drafts by prompt
  lookup, said in one line, rather than keep the others from being served.
- --models-config FILE (TOML) gives a model its own settings, by the command line's option
  names, the command line's values being the defaults:

      [models."gemma-3-270m-f32"]
      draft = "gemma-3-270m-q2_k"
      verifier = "strict"
      ctx = 8192
      keep_alive = "30m"

  An unknown model or key, or a bad value, is one line naming the model and the key, before
  anything loads.
- A member's expected size is what the memory check counts for it and its draft
  (flylocal.llama.memory): weights, KV cells, compute buffers.

Nothing here imports llama.cpp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click

from flylocal.errors import FlylocalError, OptionError
from flylocal.front.serve.ollama_options import checked_keep_alive, keep_seconds
from flylocal.front.serve.roster import FOREVER, Member
from flylocal.settings import GENERATION, OPTIONS, Settings, settings_from

# What --models-config may set for a model: the generation options but the target, and its keep-alive.
CONFIG_KEYS = tuple(k for k in GENERATION if k not in ("target", "target_rpc", "draft_rpc", "tensor_split")) \
    + ("keep_alive",)
NO_DRAFT = ("", "none")          # a draft named so: none
DEFAULT_KEEP = 300.0             # seconds a model loaded on demand stays after its last request (ollama's 5m)


@dataclass(frozen=True)
class Found:
    """A model file served by name: the name `models list` prints, the other names it answers
    to, its header facts (flylocal.gguf_info.Info)."""
    name: str
    path: Path
    info: object
    names: frozenset[str] = frozenset()


def found_models(chosen: tuple[str, ...], log: Callable[[str], None]) -> list[Found]:
    """The models to serve: every local model with weights, or the `chosen` ones (any name or
    path `--target` takes). FlylocalError, one line, for a chosen one that is no model."""
    from flylocal import models
    from flylocal.models import library

    pool = [c for c in library.candidates() if c.info.parameters]
    seen = {library.identity(c.path): c for c in pool}
    if chosen:
        out = []
        for spec in chosen:
            path = models.resolve(spec, log)
            c = seen.get(library.identity(path))
            if c is None:
                info = library.describe([path])[0]
                if isinstance(info, Exception):
                    raise FlylocalError(str(info))
                c = library.Candidate(spec, path, info)
            out.append(dataclasses.replace(c, name=spec) if spec != c.name and "/" not in spec else c)
        pool = out
    counts: dict[str, int] = {}
    named = []
    for c in pool:
        source, _, rest = c.name.partition(":")
        names = {c.name, c.path.name, c.path.stem} | ({rest} if rest and source in SOURCES else set())
        if source == "ollama" and rest.endswith(":latest"):
            names |= {rest.removesuffix(":latest"), c.name.removesuffix(":latest")}
        names = {n.casefold() for n in names}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        named.append((c, names))
    return [Found(c.name, c.path, c.info, frozenset(n for n in names if counts[n] == 1 or n == c.name.casefold()))
            for c, names in named]


SOURCES = ("lmstudio", "ollama", "hf", "llama.cpp", "local")


def read_config(path: str | None, served: list[Found]) -> dict[str, dict]:
    """--models-config FILE: per model name, its settings (option name -> checked value).
    FlylocalError naming the file, the model and the key for anything wrong."""
    if path is None:
        return {}
    import tomllib

    from flylocal.files import read_text

    where = f"--models-config {path}"
    try:
        data = tomllib.loads(read_text(path, where, limit=1 << 20))
    except tomllib.TOMLDecodeError as e:
        raise FlylocalError(f"{where}: not TOML ({e})") from None
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise FlylocalError(f"{where}: unknown table {unknown[0]!r}; models are set in [models.\"NAME\"] tables")
    tables = data.get("models", {})
    out = {}
    for name, table in tables.items():
        member = find(served, name)
        if member is None:
            raise FlylocalError(f"{where}: model {name!r} is not one this server serves (see `flylocal models list`)")
        if not isinstance(table, dict):
            raise FlylocalError(f"{where}: model {name!r}: a table of settings, not {table!r}")
        out[member.name] = {key: checked(where, name, key, value) for key, value in table.items()}
    return out


def checked(where: str, model: str, key: str, value):
    if key not in CONFIG_KEYS:
        raise FlylocalError(f"{where}: model {model!r}: unknown key {key!r} (the keys are the command line's "
                            f"option names: {', '.join(CONFIG_KEYS[:6])}, ...)")
    try:
        if key == "keep_alive":
            return keep_seconds(checked_keep_alive(value))
        option = OPTIONS[key]
        if option.is_flag:
            if not isinstance(value, bool):
                raise ValueError(f"{value!r} is not true or false")
            return value
        if option.type is None:
            if not isinstance(value, str):
                raise ValueError(f"{value!r} is not a string")
            return value
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        return option.type.convert(value, None, None)
    except click.BadParameter as e:
        raise FlylocalError(f"{where}: model {model!r}: {key}: {e.message}") from None
    except ValueError as e:
        raise FlylocalError(f"{where}: model {model!r}: {key}: {e}") from None


def keep_alive_option(value: str | None) -> float | None:
    """--keep-alive in seconds (negative: for good); None when not given. OptionError naming it."""
    if value is None:
        return None
    try:
        return keep_seconds(checked_keep_alive(value))
    except ValueError as e:
        raise OptionError(f"--keep-alive {e}", "keep_alive") from None


def find(served: list[Found], name: str) -> Found | None:
    key = name.casefold()
    return next((f for f in served if key == f.name.casefold() or key in f.names
                 or key.removesuffix(":latest") in f.names), None)


def members(settings: Settings, served: list[Found], config: dict[str, dict], keep: float, load,
            first_keep: float = FOREVER, draft_given: bool = False, drafts: list[Found] | None = None,
            lookup_instead: Callable[[str], None] | None = None) -> list[Member]:
    """The Roster's members: each found model with its settings (the command line's, its
    draft, its --models-config table), checked, and its expected size. `load(settings)` builds
    a member's Session; the first member is kept for good unless its table says otherwise
    (`first_keep`); the others for `keep` seconds. `draft_given`: the command line's --draft is
    every member's draft where it shares its vocabulary; `drafts`: the models drafts are
    chosen among (default: `served`). With `lookup_instead`, a member that the command line's
    --drafter model or mla finds no draft for drafts by prompt lookup, said through it (one
    model of many, not the one the user named); without, it is refused."""
    from flylocal.loader import check
    from flylocal.models import library

    pool = [library.Candidate(f.name, f.path, f.info) for f in (drafts if drafts is not None else served)]
    out = []
    for i, f in enumerate(served):
        own = dict(config.get(f.name, {}))
        keep_alive = own.pop("keep_alive", None)
        mine = settings_from(own, dataclasses.replace(settings, target=str(f.path)))
        if "draft" in own:                                          # its own: as named, or none
            mine = dataclasses.replace(mine, draft=None if own["draft"].casefold() in NO_DRAFT else own["draft"])
        elif mine.drafter in (None, "mla", "model"):                # one that a draft speeds up
            mine = dataclasses.replace(mine, draft=pick_draft(f, pool, settings.draft if draft_given else None))
            if mine.drafter in ("mla", "model") and not mine.draft and "drafter" not in own and lookup_instead:
                lookup_instead(f"{f.name}: no draft model shares its vocabulary: it drafts by prompt lookup "
                               f"instead of --drafter {mine.drafter}")
                mine = dataclasses.replace(mine, drafter="pld")
        else:
            mine = dataclasses.replace(mine, draft=None)
        try:
            check(mine)
        except (OptionError, FlylocalError) as e:
            raise FlylocalError(f"model {f.name}: {e}") from None
        out.append(Member(f.name, f.path, mine, expected_bytes(mine, f.path), f.names,
                          keep_alive if keep_alive is not None else first_keep if i == 0 else keep,
                          load=lambda s=mine: load(s)))
    return out


def pick_draft(target: Found, pool, given: str | None) -> str | None:
    """The draft for `target`: `given` where it shares its vocabulary, else the first
    same-vocabulary draft `flylocal models pairs` ranks for it; None without one."""
    from flylocal import models
    from flylocal.models import library

    if given:
        path = models.resolve(given)
        info = library.describe([path])[0]
        if not isinstance(info, Exception) and info.fingerprint == target.info.fingerprint:
            return str(path)
    me = library.Candidate(target.name, target.path, target.info)
    same = [p for p in library.draft_pairs(me, pool) if p.same_vocab]
    return str(same[0].draft.path) if same else None


def expected_bytes(settings: Settings, path: Path) -> int:
    """What a member is expected to hold loaded: the target's and its draft's weights, KV cells
    and compute buffers for --ctx cells in each slot (--parallel auto: as many as it may
    take; what it holds once loaded is counted then)."""
    from flylocal.loader import AUTO_SLOTS
    from flylocal.llama.memory import CELL_BYTES, held
    from flylocal.llama.placement import shape
    from flylocal.models import read_layout

    total = 0
    for p in (path, settings.draft):
        if p is None:
            continue
        s = dataclasses.replace(shape(read_layout(Path(p))), key_bytes=CELL_BYTES.get(settings.cache_type_k, 2.0),
                                value_bytes=CELL_BYTES.get(settings.cache_type_v, 2.0))
        total += held(s, settings.ctx, settings.batch_size, settings.flash_attn != "off", slots=settings.parallel or AUTO_SLOTS)[0]
    return total


def serving_line(members: list[Member], budget: int | None) -> str:
    """The start line of a server of several models: what was found, the budget, and which
    fit in it together."""
    mib = MIB
    sizes = ", ".join(f"{m.name} {m.estimate / mib:,.0f} MiB" + (f" (draft {Path(m.settings.draft).name})"
                                                                if m.settings.draft else "") for m in members)
    if budget is None:
        room = "no memory bound (--models-memory)"
    else:
        fit, used = [], 0
        for m in sorted(members, key=lambda m: m.estimate):
            if used + m.estimate <= budget:
                fit.append(m)
                used += m.estimate
        room = (f"--models-memory {budget / mib:,.0f} MiB holds {len(fit)} of them at once, the smallest first"
                if len(fit) < len(members) else f"--models-memory {budget / mib:,.0f} MiB holds them all at once")
    return f"serving {len(members)} model{'s' if len(members) != 1 else ''}: {sizes}; {room}; {members[0].name} loads now"


MODELS_SHARE = 0.7      # --models-memory auto: this share of the memory available at start
MIB = 1 << 20


def models_budget(mib: int | None) -> int | None:
    """--models-memory in bytes: auto (None) is MODELS_SHARE of what is available now (None
    where that cannot be read: no bound); 0 is no bound."""
    from flylocal.llama.memory import available_bytes

    if mib is not None:
        return (mib << 20) or None
    available = available_bytes()
    return int(MODELS_SHARE * available) if available else None
