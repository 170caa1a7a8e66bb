"""Task scores beside speed (docs/bench.md, "Task scores"): per task and method the mean score,
its paired difference from the reference's with a 95% interval (`compare`, through
flylocal.statistics), the speed on the task's questions, the answers lost to the reference and
the tokens accepted loosely in them; the report's Quality section, and quality.png.

A method *loses* when the whole interval of its difference lies below 0. It *keeps* the
reference's score when the interval reaches 0 or above, or when its loss is under KEEP_POINTS."""

from __future__ import annotations

import statistics
from pathlib import Path

from flylocal.front.bench.figures import pyplot, save
from flylocal.front.bench.methods import METHODS
from flylocal.front.bench.prompts import Prompt
from flylocal.front.bench.rows import Row, interval, ratios, speed_of
from flylocal.front.bench.tasks import TASKS
from flylocal.statistics import mcnemar, mean_difference

LOST_SHOWN = 5           # lost answers listed per task and method in report.md (results.json has all)
KEEP_POINTS = 1.0        # a loss under one point of the 0-100 scale is kept


def compare(reference: list[float], method: list[float], kind: str) -> dict:
    """`method`'s scores against `reference`'s on the same questions, in the same order:
    {diff, ci, p, lost, gained, loses, keeps}. Right/wrong tasks (`kind` "pass", scores 0 or 100)
    go through McNemar, anything else through the paired bootstrap (flylocal.statistics)."""
    if kind == "pass" and all(v in (0.0, 100.0) for v in (*reference, *method)):
        out = mcnemar([v > 0 for v in reference], [v > 0 for v in method])
    else:
        out = mean_difference(reference, method)
    ci = out["ci"]
    out["loses"] = ci is not None and ci[1] < 0
    out["keeps"] = ci is None or ci[1] >= 0 or -out["diff"] < KEEP_POINTS
    return out


def reference_of(rows: dict[str, Row]) -> str | None:
    """What every method's score is paired with: plain decoding (autoregressive), whose text
    strict's equals by construction, else the first strict method run."""
    if "autoregressive" in rows:
        return "autoregressive"
    return next((m for m in rows if METHODS[m].verifier == "strict" and not METHODS[m].baseline), None)


def task_results(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per task the prompts hold, in TASKS' order."""
    ref_name = reference_of(rows)
    ref = rows.get(ref_name) if ref_name else None
    plain = rows.get("autoregressive")
    out = []
    for name, task in TASKS.items():
        questions = [p for p in prompts if p.task == name]
        if not questions:
            continue
        methods = []
        for m, row in rows.items():
            done = [p.id for p in questions if p.id in row.scores]
            entry: dict = {"method": m, "questions": len(done),
                           "score": round(statistics.fmean(row.scores[i] for i in done), 2) if done else None}
            if ref is not None and row is not ref:
                paired = [i for i in done if i in ref.scores]
                if paired:
                    c = compare([ref.scores[i] for i in paired], [row.scores[i] for i in paired], task.kind)
                    entry.update(paired=len(paired), diff=round(c["diff"], 2),
                                 diff_ci=None if c["ci"] is None else [round(v, 2) for v in c["ci"]],
                                 p=None if c["p"] is None else round(c["p"], 4), lost=c["lost"], gained=c["gained"],
                                 loses=c["loses"], keeps=c["keeps"])
                    entry["lost_answers"] = [{"prompt": i, "reference_score": round(ref.scores[i], 2),
                                              "score": round(row.scores[i], 2), "loose": row.loose.get(i, [])}
                                             for i in paired if row.scores[i] < ref.scores[i]]
            timed = [i for i in done if i in row.per_prompt]
            if timed:
                both = [i for i in timed if plain is not None and i in plain.per_prompt and i in plain.outputs]
                entry.update(ratios(speed_of(row, timed), None))
                if both:
                    entry.update({k: v for k, v in ratios(speed_of(row, both), speed_of(plain, both)).items()
                                  if k.endswith("speedup")})
                    if row is not plain:
                        entry["e2e_speedup_ci"] = interval(row, plain, both, e2e=True)
            methods.append(entry)
        out.append({"task": name, "scorer": task.scorer, "kind": task.kind, "questions": len(questions),
                    "reference": ref_name, "methods": methods})
    return out


def _points(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def quality_md(tasks: list[dict]) -> list[str]:
    """The report's Quality section."""
    if not tasks:
        return []
    lines = ["", "## Quality", "",
             "Each answer is scored by a program (0-100); each method is paired question by question with "
             f"`{tasks[0]['reference']}` (the reference: strict equals it). Δ: the method's mean score less the "
             "reference's, with its 95% interval: McNemar's exact (conditional) interval for right/wrong tasks, "
             "a paired bootstrap for graded ones. **loses**: the whole interval is below 0. keeps: the interval "
             f"reaches 0, or the loss is under {KEEP_POINTS:g} point. Speed over plain decoding, end to end, on the "
             "task's questions."]
    for t in tasks:
        lines += ["", f"### {t['task']}: {t['scorer']}, {t['questions']} questions", "",
                  "| method | score | Δ vs reference (95%) | p | lost / gained | decode tok/s | ×plain e2e (95%) | verdict |",
                  "|" + " --- |" * 8]
        for r in t["methods"]:
            if "diff" in r:
                ci = r["diff_ci"]
                delta = f"{r['diff']:+.1f}" + (f" ({ci[0]:+.1f} to {ci[1]:+.1f})" if ci else "")
                verdict = ("keeps" if not r["loses"] else
                           f"**loses** (under {KEEP_POINTS:g} point: kept)" if r["keeps"] else "**loses**")
                counts = f"{r['lost']} / {r['gained']}"
            else:
                delta = verdict = counts = "reference" if r["method"] == t["reference"] else "–"
            speed = "–" if not r.get("e2e_speedup") else f"{r['e2e_speedup']:.2f}×" + (
                f" ({r['e2e_speedup_ci'][0]:.2f}–{r['e2e_speedup_ci'][1]:.2f})" if r.get("e2e_speedup_ci") else "")
            p = "–" if r.get("p") is None else f"{r['p']:.3g}"
            lines.append(f"| {r['method']} | {_points(r['score'])} | {delta} | {p} | {counts} | "
                         f"{r.get('tokens_per_s', '–')} | {speed} | {verdict} |")
    lost = [(t, r) for t in tasks for r in t["methods"] if r.get("lost_answers") and any(a["loose"] for a in r["lost_answers"])]
    if lost:
        lines += ["", "### Answers lost, and the tokens accepted loosely in them", "",
                  "Questions the reference scored higher on, with each token the method accepted loosely "
                  "(the text just before it, then the token in brackets). results.json lists them all."]
        for t, r in lost:
            lines += ["", f"**{t['task']}, {r['method']}**", ""]
            for a in [a for a in r["lost_answers"] if a["loose"]][:LOST_SHOWN]:
                marks = "; ".join(f"…{x['before'][-24:]}[{x['token']}]" for x in a["loose"][:6])
                more = f" (and {len(a['loose']) - 6} more)" if len(a["loose"]) > 6 else ""
                lines.append(f"- `{a['prompt']}` {_points(a['reference_score'])} → {_points(a['score'])}: "
                             + marks.replace("\n", "⏎").replace("|", "\\|") + more)
    return lines


def quality_plot(tasks: list[dict], out: Path) -> Path | None:
    """quality.png: score against speed, one panel per task, one point per method with its
    intervals (the score's: the reference's score plus Δ's interval; the speed's)."""
    plt = pyplot()
    if plt is None:
        return None
    if not tasks:
        return None
    cols = min(3, len(tasks))
    rows_ = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.6 * rows_), squeeze=False)
    for ax, t in zip(axes.flat, tasks):
        ref = next((r for r in t["methods"] if r["method"] == t["reference"]), None)
        for r in t["methods"]:
            if r.get("score") is None:
                continue
            x = r.get("e2e_speedup") or 1.0
            y = r["score"]
            xerr = [[x - r["e2e_speedup_ci"][0]], [r["e2e_speedup_ci"][1] - x]] if r.get("e2e_speedup_ci") else None
            yerr = None
            if r.get("diff_ci") and ref is not None and ref.get("score") is not None:
                low, high = ref["score"] + r["diff_ci"][0], ref["score"] + r["diff_ci"][1]
                yerr = [[max(0.0, y - low)], [max(0.0, high - y)]]
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", capsize=3, label=r["method"],
                        markerfacecolor="none" if r.get("loses") else None)
        ax.set_title(f"{t['task']} ({t['scorer']})", fontsize=9)
        ax.set_xlabel("× plain decoding, end to end", fontsize=8)
        ax.set_ylabel("score (0-100)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return save(fig, out / "quality.png")
