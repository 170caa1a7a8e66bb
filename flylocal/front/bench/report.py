"""The bench's results: the metrics of every method (speed as ratios to autoregressive
decoding, overall, per prompt and per category; acceptance; agreement, accuracy and the
target's own likelihood), results.json, report.md and the plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from flylocal.errors import FlylocalError
from flylocal.front.bench.prompts import GROUP_ORDER, Prompt


COUNTS = ("tokens", "decode_tokens", "decode_s", "wall_s", "rounds", "loose", "verify_s", "drafted", "accepted", "forced", "mask_s")    # summed per prompt over turns, repeats


@dataclass
class Row:
    method: str
    per_prompt: dict = field(default_factory=dict)  # prompt id -> {COUNTS}
    outputs: dict = field(default_factory=dict)    # prompt id -> (token ids, text) of the first turn, last repeat
    later: dict = field(default_factory=dict)      # prompt id -> [token ids of each later turn], last repeat
    nll: dict = field(default_factory=dict)        # prompt id -> target NLL
    spent: dict = field(default_factory=dict)      # prompt id -> ASD regret spent (every turn), last repeat
    passed: dict = field(default_factory=dict)     # prompt id -> HumanEval tests passed (with execute)
    failures: list = field(default_factory=list)   # {"prompt", "repeat", "error"} per failed prompt
    valid: dict = field(default_factory=dict)      # prompt id -> the answer is valid under --json-schema


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _speed(row: Row, ids) -> dict:
    """Summed counts of `row` over the prompt ids given."""
    t = dict.fromkeys(COUNTS, 0)
    for pid in ids:
        for key, v in row.per_prompt[pid].items():
            t[key] += v
    return t


def _ratios(mine: dict, ref: dict | None) -> dict:
    """Decode and end-to-end tokens/s, and their ratios to `ref`'s (None where undefined)."""
    tps = mine["decode_tokens"] / mine["decode_s"] if mine["decode_s"] > 0 else 0.0
    e2e = mine["tokens"] / mine["wall_s"] if mine["wall_s"] > 0 else 0.0
    out = {"tokens_per_s": round(tps, 2), "speedup": None, "e2e_tokens_per_s": round(e2e, 2), "e2e_speedup": None}
    if ref is not None and tps and e2e:
        ref_tps = ref["decode_tokens"] / ref["decode_s"] if ref["decode_s"] > 0 else 0.0
        ref_e2e = ref["tokens"] / ref["wall_s"] if ref["wall_s"] > 0 else 0.0
        out["speedup"] = round(tps / ref_tps, 3) if ref_tps else None
        out["e2e_speedup"] = round(e2e / ref_e2e, 3) if ref_e2e else None
    return out


def metrics(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per method. Speed ratios compare a method with autoregressive decoding over the
    prompts both completed; each quality metric is over the prompts the method completed
    (agreement: over those both it and autoregressive completed, every turn); None where there
    are none. `categories` holds the same speed figures per prompt group."""
    ref = rows.get("autoregressive")
    out = []
    for m, row in rows.items():
        done = [p for p in prompts if p.id in row.outputs]
        both = [p.id for p in done if ref is not None and p.id in ref.outputs]
        mine = _speed(row, [p.id for p in done])
        speed = _ratios(mine, None)
        if both:
            speed.update({k: v for k, v in _ratios(_speed(row, both), _speed(ref, both)).items()
                          if k.endswith("speedup")})
        with_answers = [p for p in done if p.answers]
        accuracy = _mean(any(a.lower() in row.outputs[p.id][1].lower() for a in p.answers) for p in with_answers)
        agreement = None
        if ref is not None:
            agreement = _mean(row.outputs[p.id][0] == ref.outputs[p.id][0]
                              and row.later.get(p.id, []) == ref.later.get(p.id, [])
                              for p in done if p.id in ref.outputs)
        categories = {}
        for group in _groups(prompts):
            ids = [p.id for p in done if p.group == group]
            ref_ids = [pid for pid in ids if ref is not None and pid in ref.outputs]
            if not ids:
                continue
            g = _speed(row, ids)
            categories[group] = {**_ratios(_speed(row, ref_ids), _speed(ref, ref_ids) if ref_ids else None),
                                 "mean_accepted_length": round(g["tokens"] / g["rounds"], 3) if g["rounds"] else None,
                                 "prompts": len(ids)}
        nll = _mean(row.nll.values())
        out.append({
            "method": m,
            **speed,
            "mean_accepted_length": round(mine["tokens"] / mine["rounds"], 3) if mine["rounds"] else None,
            "acceptance": round(mine["accepted"] / mine["drafted"], 3) if mine["drafted"] else None,
            "loose_rate": round(mine["loose"] / mine["tokens"], 4) if mine["rounds"] and mine["tokens"] else None,
            "agreement": agreement,
            "first_divergence": first_divergence(row, ref, done),
            "accuracy": accuracy,
            "pass_at_1": _mean(row.passed.values()),
            "valid": _mean(row.valid.values()),
            "forced_per_round": round(mine["forced"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "mask_ms_per_round": round(1e3 * mine["mask_s"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "target_nll": round(nll, 4) if nll is not None else None,
            "budget_spent": round(_mean(row.spent.values()), 4) if row.spent else None,
            "verify_share": round(mine["verify_s"] / mine["decode_s"], 4) if mine["rounds"] and mine["decode_s"] else None,
            "wall_s": round(mine["wall_s"], 3),
            "completed": len(done),
            "categories": categories,
            "failures": list(row.failures),
        })
    return out


def first_divergence(row: Row, ref: Row | None, done: list[Prompt]) -> float | None:
    """The median position of the first token where a first turn differs from autoregressive's,
    over the prompts where it differs; None where none does."""
    if ref is None or row is ref:
        return None
    where = []
    for p in done:
        if p.id in ref.outputs:
            a, b = row.outputs[p.id][0], ref.outputs[p.id][0]
            if a != b:
                where.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return float(statistics.median(where)) if where else None


def _groups(prompts: list[Prompt]) -> list[str]:
    present = {p.group for p in prompts if p.group is not None}
    return [g for g in GROUP_ORDER if g in present] + sorted(present - set(GROUP_ORDER))


def per_prompt(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per prompt and method: its speed, and its ratios to autoregressive decoding."""
    ref = rows.get("autoregressive")
    out = []
    for p in prompts:
        for m, row in rows.items():
            if p.id not in row.per_prompt or p.id not in row.outputs:
                continue
            mine = row.per_prompt[p.id]
            r = ref.per_prompt.get(p.id) if ref is not None and p.id in ref.outputs else None
            out.append({"prompt": p.id, "category": p.category, "method": m, "tokens": mine["tokens"],
                        **_ratios(mine, r),
                        "mean_accepted_length": round(mine["tokens"] / mine["rounds"], 3) if mine["rounds"] else None,
                        "wall_s": round(mine["wall_s"], 4)})
    return out


def machine_info(build: dict) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), **build}


def report_md(results: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "e2e_tokens_per_s", "e2e_speedup", "mean_accepted_length",
            "acceptance", "loose_rate", "agreement", "first_divergence", "accuracy", "pass_at_1", "valid", "forced_per_round",
            "mask_ms_per_round", "target_nll", "budget_spent",
            "verify_share", "wall_s"]
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
    lines += ["", "speedup: decode tokens/s (the tokens after the first round, over the time after it) over autoregressive's; e2e: tokens over "
                  "the wall time from the request to the last token, prefill included, over autoregressive's. "
                  "acceptance: committed draft tokens over drafted ones. agreement: outputs identical to autoregressive's; first_divergence: the median token where the "
                  "others first differ. budget_spent: ASD's regret per prompt. verify_share: the verifier's share "
                  "of decoding time."]
    groups = [g for g in GROUP_ORDER if any(g in r.get("categories", {}) for r in results["methods"])]
    groups += sorted({g for r in results["methods"] for g in r.get("categories", {})} - set(groups))
    if groups:
        for title, key in (("end to end", "e2e_speedup"), ("decode", "speedup")):
            lines += ["", f"## Speedup by category, {title} (Spec-Bench's layout)", "",
                      "| method | " + " | ".join(groups) + " | overall | mean accepted length |",
                      "|" + " --- |" * (len(groups) + 3)]
            for r in results["methods"]:
                c = r.get("categories", {})
                cells = [f"{c[g][key]:.2f}x" if g in c and c[g].get(key) else "-" for g in groups]
                overall = f"{r[key]:.2f}x" if r.get(key) else "-"
                tau = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "-"
                lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {overall} | {tau} |")
    rows = results.get("prompts", [])
    if rows:
        lines += ["", "## Per prompt", "",
                  "| prompt | category | method | tokens | tokens/s | speedup | e2e tokens/s | e2e speedup | "
                  "mean accepted length |", "|" + " --- |" * 9]
        for r in rows:
            lines.append("| " + " | ".join(
                "-" if r.get(k) is None else (f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]))
                for k in ("prompt", "category", "method", "tokens", "tokens_per_s", "speedup", "e2e_tokens_per_s",
                          "e2e_speedup", "mean_accepted_length")) + " |")
    if failures:
        lines += ["", "## Failures", "",
                  "Metrics of a method cover only the prompts it completed.", ""]
        for method, f in failures:
            message = f["error"].replace("|", "\\|").replace("`", "'")
            lines.append(f"- `{method}` on `{f['prompt']}` (repeat {f['repeat']}): {message}")
    m = results["machine"]
    lines += ["", f"Machine: {m['processor']}, {m['cpus']} CPUs, llama-cpp-python {m['llama_cpp_python']}, "
                  f"{m.get('kernels', 'fast')} build, {'GPU offload' if m['gpu_offload'] else 'CPU only'}"
                  + "".join(f"; the {who} on rpc servers {', '.join(results['config'][key])}" for who, key in
                            (("target", "target_rpc"), ("draft", "draft_rpc")) if results["config"].get(key))
                  + ".", ""]
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
    x = list(range(len(names)))
    axes[0].bar([i - 0.2 for i in x], [r["speedup"] or 0 for r in rows], width=0.4, color="#4c72b0", label="decode")
    axes[0].bar([i + 0.2 for i in x], [r.get("e2e_speedup") or 0 for r in rows], width=0.4, color="#dd8452",
                label="end to end")
    axes[0].set_xticks(x, names)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend()
    axes[0].set_title("speedup over autoregressive (tokens/s)")
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
