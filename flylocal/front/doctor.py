"""`flylocal doctor`: both llama.cpp builds (fast and exact), and what a model does in each:
whether it is batch-invariant, and what a decode of n rows costs.

Strict verification equals plain greedy decoding token for token only when the target gives
the same logits for a position whether it is decoded alone or inside a batch (docs/design.md, "Batch invariance"). This
is measured, not assumed: the same tokens are teacher-forced one at a time and then as one
batch, and the logits compared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from flylocal import models
from flylocal.decoding.adaptive import timed_decode
from flylocal.decoding.costs import CALIBRATION_SIZES, CostCurve, costs_dir, read_file
from flylocal.llama import kernels
from flylocal.llama.config import RuntimeConfig
from flylocal.llama.devices import build_info
from flylocal.llama.runtime import Runtime
from flylocal.loader import gpu_layers, open_model
from flylocal.settings import DEFAULT_TARGET, STANDIN_TARGET, Settings

PROBE_TEXT = (
    "The committee met on Tuesday to review the budget. After a long discussion, the members "
    "agreed to postpone the vote until the next meeting, when the final figures would be ready."
)
PROBE_ROWS = 16


def build_report() -> list[str]:
    info = build_info()
    stamp = kernels.exact_stamp() if info["kernels"] == kernels.EXACT else kernels.fast_stamp()
    flags = stamp or "unknown (not built by scripts/setup.sh)"
    given = os.environ.get("LLAMA_CPP_LIB_PATH")
    if info["kernels"] != kernels.EXACT and given:      # a library of the user's own, not setup's
        flags = f"unknown: the library in {given} (LLAMA_CPP_LIB_PATH)"
    system = info["system_info"]
    lines = [
        f"build: {info['kernels']} ("
        + ("batch-invariant CPU kernels: strict equals plain greedy decoding bit for bit"
           if info["kernels"] == kernels.EXACT else
           "llama.cpp's default kernels: strict equals greedy decoding up to numerical near-ties") + ")",
        f"llama-cpp-python {info['llama_cpp_python']}",
        f"backend: {'GPU offload available' if info['gpu_offload'] else 'CPU only'}",
        f"system: {system}",
        f"build flags: {flags}",
    ]
    from flylocal.llama.binding import CUDA_LOADED

    if CUDA_LOADED:                  # CUDA's runtime and cuBLAS from NVIDIA's wheels (flylocal.llama.cuda)
        lines.append(f"cuda: {', '.join(p.name for p in CUDA_LOADED)} from {CUDA_LOADED[0].parent}")
    hints = []
    if "LLAMAFILE=1" in system.replace(" ", ""):
        hints.append("llamafile kernels are on: batched logits may differ from single-token logits")
    if "REPACK=1" in system.replace(" ", ""):
        hints.append("CPU weight repacking is on: batched logits may differ from single-token logits")
    lines += [f"note: {h}" for h in hints]
    return lines


def batch_invariance(rt: Runtime, rows: int = PROBE_ROWS, contexts=(24, 320)) -> tuple[float, int, int]:
    """(max |delta logit|, argmax flips, rows compared) between decoding `rows` tokens one at a
    time and as one batch, after a short and after a long context (past 256 cache cells, where
    llama.cpp's attention kernels change blocking)."""
    ids = rt.tokenize(PROBE_TEXT * 12)
    worst, flips, compared = 0.0, 0, 0
    for n_prefix in contexts:
        if n_prefix + rows > min(len(ids), rt.n_ctx):
            continue
        prefix, probe = ids[:n_prefix], ids[n_prefix : n_prefix + rows]
        rt.reset()
        rt.decode(prefix)
        single = np.stack([rt.decode(probe[i : i + 1], logits_from=0)[0].copy() for i in range(rows)])  # [rows, V]
        rt.truncate(n_prefix)
        batched = rt.decode(probe, logits_from=0).copy()                                               # [rows, V]
        worst = max(worst, float(np.abs(single - batched).max()))
        flips += int((single.argmax(axis=1) != batched.argmax(axis=1)).sum())
        compared += rows
    rt.reset()
    return worst, flips, compared


def cost_curve(rt: Runtime, recalibrate: bool = False, context: int = 256) -> CostCurve:
    """The model's decode cost curve up to 17 rows as the engine uses it (cached on disk;
    measured after `context` tokens when not cached, when the cache was distorted or with
    `recalibrate`)."""
    ids = rt.tokenize(PROBE_TEXT * 12)[:context]
    rt.reset()
    rt.decode(ids[:-1])
    rt.costs.ensure(lambda n: timed_decode(rt, int(ids[-1]), n), max_rows=max(CALIBRATION_SIZES),
                    limit=rt.n_batch, recalibrate=recalibrate)
    rt.reset()
    return rt.costs


def calibration_words(meta: dict) -> str:
    """When, in how many passes and under what load a calibration was measured."""
    if not meta.get("measured"):
        return "measured by an older flylocal (best of two, load unknown)"
    busy = meta.get("busy_cores")
    load = ("load unknown" if busy is None else
            f"{busy:.2f} of {meta.get('cores', '?')} cores busy with other work")
    return (f"measured {meta['measured']} in {meta.get('passes', '?')} passes agreeing within "
            f"{meta.get('spread', 0):.0%}, {load}")


def curve_line(curve: CostCurve) -> str:
    """The doctor's line on a model's cost curve: where it came from, its state, its shape,
    the single step and how it was measured."""
    report = curve.report()
    where = {"cache": "cached", "measured": "measured now"}.get(report["source"], report["source"])
    shape = ", ".join(f"{n}: {s:.1f}" for n, s in report["shape"].items())
    line = (f"decode cost curve ({where}, {report['state']}): t(n)/t(1) by rows {shape}; a single step "
            f"{report['calibrated_step_ms']:.1f} ms; {calibration_words(curve.meta)}")
    if report["state"] == "provisional":
        line += f"; cached as provisional and measured again later: {report['problem']}"
    elif report.get("problem"):
        line += f"; the cached curve was distorted and is repaired: {report['problem']}"
    return line


def kept_threads_line(clock=time.time) -> str:
    """What --threads auto's last process on these cores settled on, and when."""
    from flylocal.llama.threads import KEEP, known_record

    record = known_record()
    if record is None:
        return "--threads auto: no count kept yet (a process measures before its first prompt)"
    count, at = record
    ago = max(clock() - at, 0.0)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    words = f"{ago / 60:.0f} min ago" if ago >= 60 else f"{ago:.0f} s ago"
    start = ("the next process starts there" if ago <= KEEP else
             f"older than {KEEP / 60:.0f} min: the next process measures before its first prompt")
    return f"--threads auto: the last process on these cores settled on {count} at {when} ({words}); {start}"


def cache_report() -> list[str]:
    """Every cost curve in the disk cache, one line each; a distorted one is flagged (it is
    repaired when its model is next used)."""
    folder = costs_dir()
    files = sorted(p for p in folder.glob("*.json") if p.name != "threads.json") if folder.is_dir() else []
    lines = [kept_threads_line(), f"cost curves cached in {folder}: {len(files)}"]
    names = {p.name for p in files if not p.name.endswith(".provisional.json")}
    for path in files:
        record, _ = read_file(path)             # bounded in size and depth, as a run reads it
        if record is None:
            lines.append(f"  {path.name}: not a cost curve (measured over when its model is next used)")
            continue
        key = record["key"]
        name = os.path.basename(str(key.get("model", "?")))
        role = {f"{DEFAULT_TARGET}.gguf": " (the default target)",
                f"{STANDIN_TARGET}.gguf": " (the bandwidth-bound stand-in)"}.get(name, "")
        what = (f"{name}{role}, {key.get('kernels', '?')} build, "
                f"{key.get('threads', '?')} threads, batch {key.get('batch', '?')}")
        if record["calibration_problem"]:
            lines.append(f"  {what}: DISTORTED ({record['calibration_problem']}); measured again when next used")
            continue
        base = record["base"]
        shape = ", ".join(f"{n}: {base[n - 1] / base[0]:.1f}" for n in CALIBRATION_SIZES
                          if n <= len(base) and not np.isnan(base[n - 1]))
        line = f"  {what}: t(n)/t(1) {shape}; {calibration_words(record['meta'])}"
        if record["meta"].get("provisional") and path.name.replace(".provisional", "") in names:
            line += f"; PROVISIONAL ({record['meta']['provisional']}), unused: a settled curve is cached beside it"
        elif record["meta"].get("provisional"):
            line += (f"; PROVISIONAL ({record['meta']['provisional']}): a start for the next process, "
                     "which measures it again")
        if record["problem"]:
            line += f"; DISTORTED refinement, dropped when next used: {record['problem']}"
        lines.append(line)
    if not any(STANDIN_TARGET in line for line in lines):
        lines.append(f"  (the bandwidth-bound stand-in, whose curve shows where drafts pay: `flylocal doctor "
                     f"--model {STANDIN_TARGET}` measures it)")
    return lines


def thread_choice(rt: Runtime, steps: int = 64) -> str:
    """What --threads auto chooses on this machine now: decode `steps` tokens one at a time, as
    generation does, and report the count chosen and the speed measured at each count tried."""
    control = rt.thread_control
    if rt.config.rpc:
        return "threads: the rpc servers' own (flylocal rpc-server --threads)"
    if control is None:
        return f"threads: {rt.n_threads} (as given)"
    ids = rt.tokenize(PROBE_TEXT)
    rt.reset()
    rt.decode(ids[:-1])
    token = int(ids[-1])
    for _ in range(min(steps, rt.n_ctx - len(ids))):
        token = int(rt.decode([token], logits_from=0)[0].argmax())
    rt.reset()
    rates = ", ".join(f"{c}: {r:.0f}" for c, r in control.rates().items())
    return (f"threads: auto chose {control.home} (candidates {', '.join(map(str, control.counts))}; "
            f"single-token decodes per second at each count tried: {rates}; cost curve measured at "
            f"{rt.calibration_threads})")


def rpc_report(rt: Runtime) -> list[str]:
    """The devices of the rpc servers holding the model's layers, and what a decode of 1, 2, 5
    and 9 rows costs through them, network included (the median of 9 after 256 tokens)."""
    lines = [f"rpc servers: {', '.join(rt.config.rpc)} (output layer {rt.config.rpc_output}); devices: "
             + "; ".join(f"{d.name} ({d.description}, {d.free >> 20} MiB free of {d.total >> 20})" for d in rt.devices)]
    ids = rt.tokenize(PROBE_TEXT * 12)[:256]
    rt.reset()
    rt.decode(ids[:-1])
    times = {n: float(np.median([timed_decode(rt, int(ids[-1]), n) for _ in range(9)])) for n in RPC_ROWS}
    rt.reset()
    lines.append("round trip of a decode through the rpc servers by rows (ms, median of 9): "
                 + ", ".join(f"{n}: {1000 * t:.1f}" for n, t in times.items()))
    return lines


RPC_ROWS = (1, 2, 5, 9)


def model_report(spec: str, threads: int | None = None, flash_attn: str = "auto",
                 recalibrate: bool = False, rpc: tuple[str, ...] = (), tensor_split: tuple[float, ...] = (),
                 rpc_timeout: float = 60.0, rpc_output: str = "here") -> list[str]:
    path = models.resolve(spec)
    default = Settings()
    layers = gpu_layers(default, path, None)        # what --gpu-layers auto gives it at the default --ctx
    config = RuntimeConfig(n_ctx=1024, n_threads=threads, flash_attn=flash_attn, rpc=rpc, tensor_split=tensor_split,
                           rpc_timeout=rpc_timeout, rpc_output=rpc_output, n_gpu_layers=layers.target)
    with open_model(path, config) as rt:
        remote = rpc_report(rt) if rpc else []
        delta, flips, rows = batch_invariance(rt)
        curve = cost_curve(rt, recalibrate)
        choice = thread_choice(rt)
        off = " (off in the exact build)" if kernels.mode() == kernels.EXACT else ""
        if rpc:
            off = " (off on rpc servers)"
        lines = [f"model: {path} ({rt.description()}, vocab {rt.n_vocab}), flash attention {flash_attn}"
                 f"{off if flash_attn == 'auto' else ''}",
                 f"gpu layers (--gpu-layers auto, --ctx {default.ctx}): "
                 + ("every layer on the rpc servers" if rpc else layers.reason)] + remote
    if delta == 0.0:
        lines.append(f"batch-invariant: yes ({rows} positions, single vs batched logits bitwise equal); "
                     "strict output equals plain greedy output token for token")
    else:
        lines.append(f"batch-invariant: no (max |delta logit| {delta:.4g}, argmax flips {flips}/{rows}); "
                     "strict output can leave plain greedy output at numerical near-ties")
    lines.append(curve_line(curve))
    lines.append(choice)
    return lines


def report(model: str | None, threads: int | None = None, flash_attn: str = "auto", recalibrate: bool = False,
           this_build_only: bool = False, rpc: tuple[str, ...] = (), tensor_split: tuple[float, ...] = (),
           rpc_timeout: float = 60.0, rpc_output: str = "here") -> list[str]:
    """This process's build (and the model in it), then the other build's, from a child
    process: one process can load only one llama.cpp library. With `rpc`, the model is on those
    servers, which run one build: the other is not checked."""
    lines = build_report()
    if model or rpc:
        lines += model_report(model or DEFAULT_TARGET, threads, flash_attn, recalibrate, rpc, tensor_split,
                              rpc_timeout, rpc_output)
    if this_build_only or rpc:
        return lines
    other_exact = kernels.mode() != kernels.EXACT
    argv = [sys.executable, "-m", "flylocal", "doctor", "--this-build-only",
            "--threads", "auto" if threads is None else str(threads), "--flash-attn", flash_attn] + (["--model", model] if model else []) \
        + (["--recalibrate"] if recalibrate else []) + (["--exact"] if other_exact else [])
    env = dict(os.environ, FLYLOCAL_EXACT="1" if other_exact else "0")
    env.pop("LLAMA_CPP_LIB_PATH", None)
    lines.append("")
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        lines.append(f"the {'exact' if other_exact else 'fast'} build could not be checked: {e}")
    else:
        if out.returncode != 0:
            reason = (out.stderr.strip().splitlines() or ["no message"])[-1].removeprefix("flylocal: error: ")
            lines.append(f"the {'exact' if other_exact else 'fast'} build could not be checked: {reason}")
        else:
            lines += out.stdout.rstrip("\n").splitlines()
    return lines + [""] + cache_report() + serve_report()


def serve_report() -> list[str]:
    """What `flylocal serve` without --target would serve: the models found, the memory bound
    and what fits together (docs/serving.md, "Every model from one server")."""
    try:
        from flylocal.front.serve import catalog
    except ImportError:              # without the serve extra
        return []
    import dataclasses

    from flylocal.settings import Settings

    try:
        found = catalog.found_models((), lambda s: None)
        members = catalog.members(dataclasses.replace(Settings(), parallel=0), found, {}, catalog.DEFAULT_KEEP,
                                  lambda s: None)
    except Exception as e:  # noqa: BLE001 - a report, never a failure
        return ["", f"flylocal serve: the models found could not be read: {e}"]
    if not members:
        return ["", "flylocal serve: no models found"]
    return ["", "flylocal serve without --target: " + catalog.serving_line(members, catalog.models_budget(None))]
