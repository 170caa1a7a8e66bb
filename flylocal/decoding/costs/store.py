"""The cost curves' disk cache (docs/design.md, "Cost model"): one JSON file per key under
flylocal.host.costs_dir(), written whole and renamed, so that concurrent processes never
leave a torn file; a curve the load kept from settling goes to a file of its own beside it
(`.provisional.json`), read only where no settled one is, so that a process writing one can
never replace the settled curve another process wrote meanwhile.

    {"format": 2, "key": {...}, "calibration": {"seconds": [t(1..m), null where not
     measured], "measured", "passes", "spread", "busy_cores", "cores", "switch", and for a
     curve the load kept from settling, "provisional": why},
     "refined": [shape at 1..m, null where none]}

Format 1 (before shape and speed were apart) kept the calibration as "base" and a refined curve
in seconds as "seconds"; it is read and rewritten as format 2.

Whatever a file holds, reading it is cheap and nothing absurd in it is used: a file over
MAX_BYTES, not JSON, not a cost curve or another key's is not read; a size past MAX_ROWS or a
time that is not a positive number makes it no curve; a calibration outside physics is reported
(the curve is measured again), and what else is absurd (a refined shape, or a refined size
cheaper than a smaller one, the row switch's cost, a field of the wrong type) is dropped."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from flylocal.decoding.costs.shape import SWITCH_MAX, distortion, interpolate, plausible
from flylocal.host import costs_dir

COST_FORMAT = 2
MAX_BYTES = 1 << 20      # a curve of MAX_ROWS sizes, calibrated and refined, takes about 200 KB
MAX_ROWS = 4096          # sizes a curve can hold: no round verifies a longer draft
META = {"measured": str, "extended": str, "passes": int, "cores": int, "spread": float, "busy_cores": float,
        "switch": float, "provisional": str}  # what a calibration's record may say beside its times, and of which type


def path_for(key: dict, provisional: bool = False) -> Path:
    """The file of `key`'s curve; `provisional`: of a curve the load kept from settling, a file
    of its own, so that no process writing one can ever replace a settled curve."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return costs_dir() / f"{digest}{'.provisional' if provisional else ''}.json"


def read(key: dict) -> tuple[dict | None, str | None]:
    """The checked record (read_record) cached for `key`, and None; or None and what makes the
    file no curve for it ("is empty", "is not JSON", ...), None when there is no file. A
    settled curve comes first; a provisional one only where the cache holds no usable other."""
    record, problem = _read_key(path_for(key), key)
    if record is None:
        start, _ = _read_key(path_for(key, provisional=True), key)
        if start is not None and start["calibration_problem"] is None and start["meta"].get("provisional"):
            return start, None
    return record, problem


def _read_key(path: Path, key: dict) -> tuple[dict | None, str | None]:
    record, problem = read_file(path)
    if record is not None and record["key"] != key:
        return None, "holds another curve (its key differs)"
    return record, problem


SIBLING_FILES = 64       # cache files read when looking for a curve of the same model (`sibling`)
SIBLING_FIELDS = ("threads", "batch")    # what a sibling's key may differ in


def sibling(key: dict) -> dict | None:
    """A settled curve of the same model, build and device cached at another thread count or
    batch size (the closest in threads), as a start for `key`'s: its record, or None."""
    folder = costs_dir()
    same = {k: v for k, v in key.items() if k not in SIBLING_FIELDS}
    found = []
    try:
        paths = sorted(p for p in folder.glob("*.json") if p.name != "threads.json")[:SIBLING_FILES]
    except OSError:
        return None
    for path in paths:
        record, _ = read_file(path)
        if record is None or record["calibration_problem"] is not None or record["meta"].get("provisional"):
            continue
        other = record["key"]
        if other == key or {k: v for k, v in other.items() if k not in SIBLING_FIELDS} != same:
            continue
        found.append((abs(int(other.get("threads", 0) or 0) - int(key.get("threads", 0) or 0)), path.name, record))
    return min(found, key=lambda f: f[:2])[2] if found else None


def settings(key: dict) -> str:
    """What a sibling's key differs in, in words."""
    return f"{key.get('threads')} threads, batch {key.get('batch')}"


def read_file(path: Path) -> tuple[dict | None, str | None]:
    """The checked record in the file at `path`, whatever its key, as read() reads it."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"is unreadable ({e.strerror})"
    if len(raw) > MAX_BYTES:
        return None, f"is over {MAX_BYTES >> 20} MB, more than a cost curve can take"
    if not raw.strip():
        return None, "is empty"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):        # RecursionError: nested past what the parser follows
        return None, "is not JSON"
    record = _check(data)
    if isinstance(record, str):
        return None, record
    return record, None


def write(key: dict, meta: dict, base: np.ndarray, refined: np.ndarray) -> bool:
    """Write a curve (atomically): a provisional one (`meta["provisional"]`) to a file of its
    own, a settled one over the key's file (and the provisional file goes: it is superseded).
    False when the cache cannot be written (the next process measures again), and an error or
    a Ctrl-C leaves no temporary file behind."""
    provisional = bool(meta.get("provisional"))
    path = path_for(key, provisional)
    data = {"format": COST_FORMAT, "key": key, "calibration": dict(meta, seconds=_json_list(base)),
            "refined": _json_list(refined)}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-", suffix=".part")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        tmp = None
        if not provisional:
            with contextlib.suppress(OSError):
                path_for(key, provisional=True).unlink(missing_ok=True)
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _json_list(values: np.ndarray) -> list:
    return [None if np.isnan(v) else float(v) for v in values]


def _floats(raw) -> np.ndarray | str:
    """[m] float64 from a JSON list of positive numbers and nulls (NaN), m <= MAX_ROWS; else
    what the list is instead."""
    if not isinstance(raw, list):
        return "is not a cost curve"
    if len(raw) > MAX_ROWS:
        return f"holds {len(raw)} sizes (a curve has at most {MAX_ROWS})"
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in raw):
        return "holds times that are not numbers"
    try:
        values = np.array([np.nan if v is None else float(v) for v in raw], dtype=np.float64)
    except OverflowError:                       # an integer past what a float holds
        return "holds times that are not positive and finite"
    seen = values[~np.isnan(values)]
    if not np.isfinite(seen).all() or (seen <= 0).any():
        return "holds times that are not positive and finite"
    return values


def _meta(raw: dict, step: float) -> tuple[dict, str | None]:
    """The fields of META in `raw` that are of their type (a number finite, not negative and
    not huge, a string short), and what was dropped of the row switch's cost as absurd, or
    None. `step`: the calibrated single step, NaN when there is none."""
    meta = {}
    for name, kind in META.items():
        v = raw.get(name)
        if kind is str:
            ok = isinstance(v, str) and len(v) <= (200 if name == "provisional" else 32)
        else:
            ok = (isinstance(v, int if kind is int else (int, float)) and not isinstance(v, bool)
                  and 0 <= v <= 1e6) or (name == "busy_cores" and name in raw and v is None)   # NaN fails too
        if ok:
            meta[name] = v
    if "switch" in raw and not meta.get("switch", math.inf) <= SWITCH_MAX * step:
        meta.pop("switch", None)
        return meta, (f"a switch back to one row of {repr(raw['switch'])[:24]} s dropped (at most "
                      f"{SWITCH_MAX:g} single steps can be real)")
    return meta, None


def read_record(data) -> dict | None:
    """A cache file's contents, checked: {"format", "key", "base" [m] seconds, "refined" [m]
    shape, "meta", "calibration_problem" (why the calibration is not a curve, or None),
    "problem" (what was dropped as absurd, or None)}; None when it is not a cost file at all."""
    record = _check(data)
    return None if isinstance(record, str) else record


def _check(data) -> dict | str:
    """read_record's record, or what makes `data` no cost curve."""
    if not isinstance(data, dict) or data.get("format") not in (1, COST_FORMAT) or not isinstance(data.get("key"), dict):
        return "is not a cost curve"
    if data["format"] == 1:
        base = _floats(data.get("base", data.get("seconds")))
        seconds = _floats(data.get("seconds"))
        for values in (base, seconds):
            if isinstance(values, str):
                return values
        if not len(seconds) or np.isnan(seconds[0]):
            return "holds no single-row time"
        refined, raw_meta = seconds / seconds[0], {}
    else:
        calibration = data.get("calibration")
        if not isinstance(calibration, dict):
            return "is not a cost curve"
        base, refined = _floats(calibration.get("seconds")), _floats(data.get("refined", []))
        for values in (base, refined):
            if isinstance(values, str):
                return values
        raw_meta = calibration
    meta, dropped_switch = _meta(raw_meta, float(base[0]) if len(base) else math.nan)
    record = {"format": data["format"], "key": data["key"], "base": base, "meta": meta,
              "calibration_problem": distortion(base), "problem": None}
    refined = refined.copy()
    if record["calibration_problem"] is None:
        problems = []
        cost = interpolate(base, max(len(base), len(refined)))
        dropped = []
        below = 0.0                  # the dearest refined size so far: more rows never cost less
        for i in np.flatnonzero(~np.isnan(refined)):
            n = i + 1
            if n == 1 or not plausible(n, float(refined[i]), float(cost[i] / cost[0])) or refined[i] < below:
                if n > 1:
                    dropped.append(f"{n}: {refined[i]:.1f}")
                refined[i] = np.nan
            else:
                below = float(refined[i])
        if dropped:
            problems.append("refined shape distorted (single steps at " + ", ".join(dropped)
                            + "), dropped; the calibration stands")
        if dropped_switch:
            problems.append(dropped_switch)
        record["problem"] = "; ".join(problems) or None
    record["refined"] = refined
    return record
