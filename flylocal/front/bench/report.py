"""The bench's results: the metrics of every method (speed as ratios to autoregressive
decoding, overall, per prompt and per category; acceptance; agreement, accuracy and the
target's own likelihood), results.json, report.md and the plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

from flylocal.errors import FlylocalError
from flylocal.front.bench.figures import pyplot, save
from flylocal.front.bench.prompts import GROUP_ORDER, Prompt
from flylocal.front.bench.rows import COUNTS, Row, interval, ratios, speed_of  # noqa: F401 - COUNTS, Row: the bench's names


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


NEAR_ONE = 1.1           # mean accepted length below which a speedup is not speculation's doing
BUSY = 0.25              # cores kept busy by other processes above which the report warns


def repeated_4grams(tokens) -> float | None:
    """The share of a text's 4-grams (of token ids) that already occurred earlier in it: 0 for
    text that never repeats itself, near 1 for a loop. None for fewer than 4 tokens."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    if not grams:
        return None
    seen, again = set(), 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / len(grams)


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
        mine = speed_of(row, [p.id for p in done])
        speed = ratios(mine, None)
        if both:
            speed.update({k: v for k, v in ratios(speed_of(row, both), speed_of(ref, both)).items()
                          if k.endswith("speedup")})
            if row is not ref:
                speed["speedup_ci"] = interval(row, ref, both, e2e=False)
                speed["e2e_speedup_ci"] = interval(row, ref, both, e2e=True)
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
            g = speed_of(row, ids)
            cis = ({"speedup_ci": interval(row, ref, ref_ids, e2e=False),
                    "e2e_speedup_ci": interval(row, ref, ref_ids, e2e=True)} if ref_ids and row is not ref else {})
            categories[group] = {**ratios(speed_of(row, ref_ids), speed_of(ref, ref_ids) if ref_ids else None), **cis,
                                 "mean_accepted_length": round(g["emitted_in_rounds"] / g["rounds"], 3) if g["rounds"] else None,
                                 "prompts": len(ids)}
        nll = _mean(row.nll.values())
        out.append({
            "method": m,
            **speed,
            "mean_accepted_length": round(mine["emitted_in_rounds"] / mine["rounds"], 3) if mine["rounds"] else None,
            "acceptance": round(mine["accepted"] / mine["drafted"], 3) if mine["drafted"] else None,
            "loose_rate": round(mine["loose"] / mine["tokens"], 4) if mine["rounds"] and mine["tokens"] else None,
            "agreement": agreement,
            "changed": (sum(row.outputs[p.id][0] != ref.outputs[p.id][0] or row.later.get(p.id, []) != ref.later.get(p.id, [])
                            for p in done if p.id in ref.outputs) if ref is not None else None),
            "compared": sum(p.id in ref.outputs for p in done) if ref is not None else None,
            "repeated_4grams": _rounded(_mean(x for x in (repeated_4grams(row.outputs[p.id][0]) for p in done)
                                              if x is not None), 4),
            "first_divergence": first_divergence(row, ref, done),
            "accuracy": accuracy,
            "pass_at_1": _mean(row.passed.values()),
            "valid": _mean(row.valid.values()),
            "forced_per_round": round(mine["forced"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "mask_ms_per_round": round(1e3 * mine["mask_s"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "target_nll": round(nll, 4) if nll is not None else None,
            "budget_spent": round(_mean(row.spent.values()), 4) if row.spent else None,
            "verify_share": round(mine["verify_s"] / mine["decode_s"], 4) if mine["rounds"] and mine["decode_s"] else None,
            "round_ms": round_ms(mine),
            "wall_s": round(mine["wall_s"], 3),
            "completed": len(done),
            "categories": categories,
            "failures": list(row.failures),
        })
    return out


def round_ms(c: dict) -> dict | None:
    """Where a decoding round's time goes, in ms per round after the first (whose decode also
    evaluated the prompt): drafting, the target's decode and rollback, the verifier's decision,
    and the rest (host work between them: the engine, streaming, the bench's own). The target's
    share excludes the first round's decode as the prefill's time (its few ms of drafting there
    counted to the target)."""
    n = c["rounds"] - c["generations"]
    if n <= 0 or not c["decode_s"]:
        return None
    draft, decide = c["draft_s"] / c["rounds"], c["verify_s"] / c["rounds"]
    target = max(c["target_s"] - c["prefill_s"], 0.0) / n
    host = c["decode_s"] / n - draft - target - decide
    return {k: round(1e3 * v, 2) for k, v in (("draft", draft), ("target", target), ("decide", decide), ("host", host))}


def _rounded(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


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
    """One dict per prompt and method: its speed, its ratios to autoregressive decoding, and its
    answer's text (the first turn, of the last repeat), so answers can be read side by side."""
    ref = rows.get("autoregressive")
    out = []
    for p in prompts:
        for m, row in rows.items():
            if p.id not in row.per_prompt or p.id not in row.outputs:
                continue
            mine = row.per_prompt[p.id]
            r = ref.per_prompt.get(p.id) if ref is not None and p.id in ref.outputs else None
            out.append({"prompt": p.id, "category": p.category, "method": m, "tokens": mine["tokens"],
                        **ratios(mine, r),
                        "mean_accepted_length": round(mine["emitted_in_rounds"] / mine["rounds"], 3) if mine["rounds"] else None,
                        "wall_s": round(mine["wall_s"], 4), "answer": row.outputs[p.id][1],
                        **({"task": p.task, "seed": p.seed, "score": round(row.scores[p.id], 2),
                            "loose": row.loose.get(p.id, [])} if p.id in row.scores else {})})
    return out


def machine_info(build: dict) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), **build}


def _ratio(v: float | None, ci: list | None = None) -> str:
    if not v:
        return "–"
    return f"{v:.2f}×" + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")


def _noise(ci: list | None) -> bool:
    return ci is not None and ci[0] <= 1.0 <= ci[1]


def summary(results: dict) -> list[str]:
    """The report's opening: a warning when other processes kept the cores busy, then one plain
    sentence per method on its speed against plain decoding and how much its text changed."""
    lines = []
    busy = results["machine"].get("busy_cores")
    if busy is not None and busy > BUSY:
        lines += [f"**Warning: other processes kept {busy:.2f} of this process's {results['machine']['cpus']} cores "
                  "busy during the run.** Its speeds are lower and noisier than on a quiet machine; compare only "
                  "figures from one run.", ""]
    for r in results["methods"]:
        if r["method"] == "autoregressive" or not r.get("e2e_speedup"):
            continue
        ci = r.get("e2e_speedup_ci")
        words = f"- **{r['method']}**: {_ratio(r['e2e_speedup'], ci)} plain decoding end to end, over {r['completed']} prompts"
        if r.get("changed") is not None and r.get("compared"):
            words += (f"; every answer equals plain decoding's ({r['compared']} of {r['compared']})" if not r["changed"] else
                      f"; {r['changed']} of {r['compared']} answers differ from plain decoding's")
        words += "."
        if _noise(ci):
            words += " The interval includes 1.0: the difference from plain decoding is noise."
        tau = r.get("mean_accepted_length")
        if tau is not None and tau < NEAR_ONE and r["e2e_speedup"] > 1.0 and not _noise(ci):
            words += (f" Its mean accepted length is {tau:.2f}: whatever the speed difference, it does not come "
                      "from speculation.")
        lines.append(words)
    if len(lines) and lines[-1].startswith("- "):
        lines += ["", "Intervals: 95%, a bootstrap over the prompts (the ratio of summed speeds, prompts resampled)."]
    strict = [r for r in results["methods"] if r["method"].startswith("strict") and r.get("agreement") is not None
              and r["agreement"] < 1.0]
    if strict and results["machine"].get("kernels", "fast") != "exact":
        lines += ["", f"Strict verification ({', '.join(r['method'] for r in strict)}) left plain decoding on some "
                      "prompts: in the fast build a batch of rows can give logits a hair different from one row's, and where two "
                      "tokens are near-tied the argmax flips (near-ties, not errors; `--exact` gives identical "
                      "output)."]
    return lines


def category_tables(results: dict) -> list[str]:
    """The report's speed-up tables by category, end to end and decode, in Spec-Bench's layout."""
    lines: list[str] = []
    groups = [g for g in GROUP_ORDER if any(g in r.get("categories", {}) for r in results["methods"])]
    groups += sorted({g for r in results["methods"] for g in r.get("categories", {})} - set(groups))
    if groups:
        for title, key in (("end to end", "e2e_speedup"), ("decode", "speedup")):
            lines += ["", f"## Speedup by category, {title} (Spec-Bench's layout)", "",
                      "| method | " + " | ".join(groups) + " | overall | mean accepted length |",
                      "|" + " --- |" * (len(groups) + 3)]
            flagged = False
            for r in results["methods"]:
                c = r.get("categories", {})
                cells = []
                for g in groups:
                    cell_ = _ratio(c[g].get(key), c[g].get(f"{key}_ci")) if g in c else "–"
                    tau_g = c.get(g, {}).get("mean_accepted_length")
                    if r["method"] != "autoregressive" and tau_g is not None and tau_g < NEAR_ONE and c[g].get(key):
                        cell_ += " †"
                        flagged = True
                    cells.append(cell_)
                overall = _ratio(r.get(key), r.get(f"{key}_ci"))
                tau = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "–"
                lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {overall} | {tau} |")
            if flagged:
                lines += ["", f"† mean accepted length below {NEAR_ONE} there: the speed difference does not "
                              "come from speculation (it is noise, or the machine's drift)."]
    return lines


COLUMNS = {"e2e_speedup": "end to end ×plain (95% interval)", "speedup": "decode ×plain (95% interval)",
           "e2e_tokens_per_s": "end-to-end tok/s", "mean_accepted_length": "mean accepted length",
           "changed": "answers changed", "loose_rate": "loose per 100 tokens", "repeated_4grams": "repeated 4-grams",
           "target_nll": "target NLL", "accuracy": "accuracy", "pass_at_1": "pass@1", "valid": "valid JSON",
           "tokens_per_s": "decode tok/s", "acceptance": "acceptance", "agreement": "agreement",
           "first_divergence": "first divergence", "forced_per_round": "forced / round",
           "mask_ms_per_round": "mask ms / round", "budget_spent": "ASD budget spent",
           "verify_share": "verify share", "round_ms": "ms / round: draft, target, decide, host",
           "wall_s": "wall s", "failed": "failed"}   # report_md's column headings


def report_md(results: dict) -> str:
    from flylocal.front.bench.scores import quality_md       # it reads this module's figures

    first = ["method", "e2e_speedup", "speedup", "e2e_tokens_per_s", "mean_accepted_length", "changed", "loose_rate",
             "repeated_4grams", "target_nll", "accuracy", "pass_at_1", "valid"]
    later = ["tokens_per_s", "acceptance", "agreement", "first_divergence", "forced_per_round", "mask_ms_per_round",
             "budget_spent", "verify_share", "round_ms", "wall_s"]
    failures = [(r["method"], f) for r in results["methods"] for f in r.get("failures", [])]

    def shown(cols):
        return [c for c in cols if c in ("method", "failed") or any(r.get(c) is not None for r in results["methods"])]

    def cell(r, key):
        v = len(r.get("failures", [])) if key == "failed" else r.get(key)
        if key in ("speedup", "e2e_speedup"):
            return _ratio(v, r.get(f"{key}_ci")) if r["method"] != "autoregressive" else "1.00×"
        if key == "changed" and v is not None:
            return f"{v}/{r['compared']}" if r.get("compared") else "–"
        if key == "loose_rate" and v is not None:
            return f"{100 * v:.2f}"
        if v is None:
            return "–"
        if key == "round_ms":
            return ", ".join(f"{x:.1f}" for x in v.values())
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    def table(cols):
        return (["| " + " | ".join(COLUMNS.get(c, c) for c in cols) + " |", "|" + " --- |" * len(cols)]
                + ["| " + " | ".join(cell(r, k) for k in cols) + " |" for r in results["methods"]])

    c = results["config"]
    draft = f", draft `{c['draft']}`" if c.get("draft") else ""
    main_cols, detail_cols = shown(first), shown(["method", *later] + (["failed"] if failures else []))
    lines = ["# flylocal bench", "",
             f"target `{c['target']}`{draft}, {c['prompts']} prompts from `{c['source']}`, "
             f"max_tokens {c['max_tokens']}, repeat {c['repeat']}", "", *summary(results), "", *table(main_cols),
             "", "end to end: tokens over the wall time from the request to the last token, prompt evaluation "
                 "included, over plain (autoregressive) decoding's; decode: the tokens after the first round over "
                 "the time after it. answers changed: answers not token for token plain decoding's. "
                 "repeated 4-grams: the share of an answer's 4-grams that already occurred in it (a speedup "
                 "bought by repetition shows here). target NLL: the target's own mean negative log-likelihood "
                 "of the answer's tokens.",
             *quality_md(results.get("tasks") or []),
             "", "## Details", "", *table(detail_cols),
             "", "acceptance: committed draft tokens over drafted ones. agreement: the share of answers identical "
                 "to plain decoding's; first divergence: the median token where the others first differ. "
                 "verify share: the verifier's share of decoding time. ms / round: a decoding round's "
                 "drafting, the target's decode and rollback, the decision, and the host work around them."]
    lines += category_tables(results)
    rows = results.get("prompts", [])
    if rows:
        lines += ["", "## Per prompt", "",
                  "| prompt | category | method | tokens | tokens/s | speedup | e2e tokens/s | e2e speedup | "
                  "mean accepted length | score |", "|" + " --- |" * 10]
        for r in rows:
            lines.append("| " + " | ".join(
                "–" if r.get(k) is None else (f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]))
                for k in ("prompt", "category", "method", "tokens", "tokens_per_s", "speedup", "e2e_tokens_per_s",
                          "e2e_speedup", "mean_accepted_length", "score")) + " |")
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
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in results["methods"] if r["method"] != "autoregressive"] or results["methods"]
    groups = [g for g in GROUP_ORDER if any(g in r.get("categories", {}) for r in rows)]
    groups += sorted({g for r in rows for g in r.get("categories", {})} - set(groups))
    columns = [*groups, "overall"] if len(groups) > 1 else ["overall"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(columns) * max(1, len(rows)) ** 0.5 + 3), 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        figures = [r if g == "overall" else r.get("categories", {}).get(g, {}) for g in columns]
        heights = [f.get("e2e_speedup") or 0.0 for f in figures]
        low = [h - f["e2e_speedup_ci"][0] if f.get("e2e_speedup_ci") else 0.0 for h, f in zip(heights, figures)]
        high = [f["e2e_speedup_ci"][1] - h if f.get("e2e_speedup_ci") else 0.0 for h, f in zip(heights, figures)]
        ax.bar([j - 0.4 + width * (i + 0.5) for j in range(len(columns))], heights, width=width, label=r["method"],
               yerr=[low, high], capsize=2, error_kw={"lw": 0.8})
    ax.set_xticks(range(len(columns)), columns)
    ax.tick_params(axis="x", rotation=30)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("× plain decoding, end to end")
    ax.set_title("speed over plain decoding, with 95% intervals over prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, out / "speedup.png")


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
    png = plot(results, out)
    if results.get("tasks"):
        from flylocal.front.bench.scores import quality_plot

        quality_plot(results["tasks"], out)
    return report, png
