"""The cost curves' disk cache (docs/design.md, "Cost model"): one JSON file per key under
flylocal.host.costs_dir(), written whole and renamed, so that concurrent processes never
leave a torn file.

    {"format": 2, "key": {...}, "calibration": {"seconds": [t(1..m), null where not
     measured], "measured", "passes", "spread", "busy_cores", "cores", "switch"},
     "refined": [shape at 1..m, null where none]}

Format 1 (before shape and speed were apart) kept the calibration as "base" and a refined curve
in seconds as "seconds"; it is read and rewritten as format 2."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from flylocal.decoding.costs.shape import distortion, interpolate, plausible
from flylocal.host import costs_dir

COST_FORMAT = 2


def path_for(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return costs_dir() / f"{digest}.json"


def read(key: dict) -> dict | None:
    """The checked record (read_record) cached for `key`, or None: none, unreadable, another
    key's."""
    try:
        data = json.loads(path_for(key).read_text())
    except (OSError, ValueError):
        return None
    record = read_record(data)
    return record if record is not None and record["key"] == key else None


def write(key: dict, meta: dict, base: np.ndarray, refined: np.ndarray) -> bool:
    """Write a curve (atomically); False when the cache cannot be written (the next process
    measures again), and an error or a Ctrl-C leaves no temporary file behind."""
    path = path_for(key)
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
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _json_list(values: np.ndarray) -> list:
    return [None if np.isnan(v) else float(v) for v in values]


def _floats(raw) -> np.ndarray | None:
    if not isinstance(raw, list):
        return None
    try:
        values = np.array([np.nan if v is None else float(v) for v in raw], dtype=np.float64)
    except (TypeError, ValueError):
        return None
    seen = values[~np.isnan(values)]
    if not np.isfinite(seen).all() or (seen <= 0).any():
        return None
    return values


def read_record(data) -> dict | None:
    """A cache file's contents, checked: {"format", "key", "base" [m] seconds, "refined" [m]
    shape, "meta", "calibration_problem" (why the calibration is not a curve, or None),
    "problem" (what was dropped from the refinement, or None)}; None when it is not a cost
    file at all."""
    if not isinstance(data, dict) or data.get("format") not in (1, COST_FORMAT) or not isinstance(data.get("key"), dict):
        return None
    if data["format"] == 1:
        base = _floats(data.get("base", data.get("seconds")))
        seconds = _floats(data.get("seconds"))
        if base is None or seconds is None or np.isnan(seconds[0]):
            return None
        refined, meta = seconds / seconds[0], {}
    else:
        calibration = data.get("calibration")
        if not isinstance(calibration, dict):
            return None
        base, refined = _floats(calibration.get("seconds")), _floats(data.get("refined", []))
        if base is None or refined is None:
            return None
        meta = {k: v for k, v in calibration.items() if k != "seconds"}
    record = {"format": data["format"], "key": data["key"], "base": base, "meta": meta,
              "calibration_problem": distortion(base), "problem": None}
    refined = refined.copy()
    if record["calibration_problem"] is None:
        cost = interpolate(base, max(len(base), len(refined)))
        dropped = []
        for i in np.flatnonzero(~np.isnan(refined)):
            n = i + 1
            if n == 1 or not plausible(n, float(refined[i]), float(cost[i] / cost[0])):
                if n > 1:
                    dropped.append(f"{n}: {refined[i]:.1f}")
                refined[i] = np.nan
        if dropped:
            record["problem"] = ("refined shape distorted (single steps at " + ", ".join(dropped)
                                 + "), dropped; the calibration stands")
    record["refined"] = refined
    return record
