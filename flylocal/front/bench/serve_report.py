"""The report of `flylocal bench serve` (flylocal.front.bench.serve): each server's figures per
client count, and its ratios to the base server wave by wave (a wave's ratio sets two servers
side by side under the same moment's load); flylocal's drafting configurations against its plain
one, and each of flylocal's against the best of the other servers."""

from __future__ import annotations

from flylocal.statistics import median, median_interval


def paired(got: dict, name: str, other: str, key: str = "rate") -> list[tuple[float, str]]:
    """`name`'s figure over `other`'s, wave by wave, with each wave's label (waves where
    either failed left out)."""
    return [(a[key] / b[key], label) for a, b, label in zip(got[name], got[other], got["labels"])
            if a[key] == a[key] and b[key] == b[key] and b[key] > 0]


def ratio_text(pairs: list[tuple[float, str]], worst: str | None = "low") -> str:
    """'M (LO-HI)' and ', worst W (LABEL)': the median ratio with its interval, and the worst
    question's, the lowest (`worst` "low": a speed) or the highest ("high": a time): the median
    of its waves where it was asked more than once (--repeat), so that one noisy request does
    not stand for it."""
    if not pairs:
        return "-"
    values = [v for v, _ in pairs]
    lo, hi = median_interval(values)
    by_label: dict[str, list[float]] = {}
    for v, label in pairs:
        by_label.setdefault(label, []).append(v)
    low, label = (min if worst == "low" else max)((median(vs), label) for label, vs in by_label.items())
    times = len(by_label[label])
    of = f", the median of {times}" if times > 1 else ""
    return f"{median(values):.2f} ({lo:.2f}-{hi:.2f})" + (f", worst {low:.2f} ({label}{of})" if worst else "")


def _drafts_nothing(server) -> bool:
    """Whether a flylocal server (a Server of flylocal.front.bench.serve) decodes plainly
    (`--drafter none`): its drafting ones' yardstick."""
    command = server.command or []
    return any(a == "--drafter" and b == "none" for a, b in zip(command, command[1:]))


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def report(plan, results: dict, turns: int) -> str:
    """Per client count: each server's figures and its ratios to the base server; flylocal's
    drafting configurations against its plain one (autoregressive, or another with
    `--drafter none`) and against the best of the other servers. `plan`: the run's Plan
    (flylocal.front.bench.serve), `results`: what its `run` returned."""
    by_name = {s.name: s for s in plan.servers}
    lines = []
    for clients, got in results.items():
        if clients == "interrupted":
            continue
        names = [n for n in got if n != "labels"]
        if plan.base not in names:
            continue
        n = min(len(got[name]) for name in names)
        got = {"labels": got["labels"][:n], **{name: got[name][:n] for name in names}}
        banned = ("end of generation banned for servers of --target" if plan.banned
                  else "answers end where models end them")
        lines += [f"{n} wave{'s' * (n != 1)} of {clients} client{'s' * (clients != 1)} x {plan.per_client} "
                  f"conversation{'s' * (plan.per_client != 1)} of {'up to ' * (turns > 1)}{turns} "
                  f"turn{'s' * (turns != 1)}, "
                  f"{plan.max_tokens} "
                  f"tokens an answer ({banned}), greedy, streamed{', raw completions' if plan.raw else ''}; "
                  f"ratios to {plan.base}, wave by wave: median (95% interval)", "",
                  f"| server | requests | tokens | tok/s | / {plan.base} | decode tok/s | / {plan.base} | "
                  f"all tokens / all time | TTFT p50 s | TTFT p95 s | TTFT / {plan.base} | failed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in names:
            waves = got[name]
            ttft = [t for w in waves for t in w["ttft"]]
            wall = sum(w["wall"] for w in waves if w["wall"] > 0)
            lines.append(f"| {name} | {sum(w['requests'] for w in waves)} | {sum(w['tokens'] for w in waves)} | "
                         f"{median(w['rate'] for w in waves):.1f} | "
                         f"{'1' if name == plan.base else ratio_text(paired(got, name, plan.base))} | "
                         f"{median(w['decode'] for w in waves):.1f} | "
                         f"{'1' if name == plan.base else ratio_text(paired(got, name, plan.base, 'decode'), None)} | "
                         f"{sum(w['tokens'] for w in waves) / wall if wall else float('nan'):.1f} | "
                         f"{_percentile(ttft, 0.5):.2f} | {_percentile(ttft, 0.95):.2f} | "
                         f"{'1' if name == plan.base else ratio_text(paired(got, name, plan.base, 'first'), 'high')} | "
                         f"{sum(len(w['errors']) for w in waves)} |")
        lines.append("")
        ours = [m for m in names if by_name[m].flylocal]
        plain = next((m for m in sorted(ours, key=lambda m: m != "autoregressive")
                      if _drafts_nothing(by_name[m])), None)
        if plain and plain != plan.base:
            lines += [f"{m} / {plain}: {ratio_text(paired(got, m, plain))}; first token "
                      f"{ratio_text(paired(got, m, plain, 'first'), 'high')}" for m in ours if m != plain]
        others = [m for m in names if not by_name[m].flylocal]
        if ours and others:
            best = max(others, key=lambda m: median(v for v, _ in paired(got, m, plan.base)))
            lines += [f"{m} / {best} (the best of the other servers here): {ratio_text(paired(got, m, best))}"
                      for m in ours]
        for name in names:
            errors = [e for w in got[name] for e in w["errors"]]
            if errors:
                lines.append(f"{name}: {len(errors)} request{'s' * (len(errors) > 1)} failed, the first: {errors[0]}")
            if not all(w["counted"] for w in got[name]):
                lines.append(f"{name}: sent no usage; its tokens are counted as chunks of text")
        lines.append("")
    if results.get("interrupted"):
        lines.append("interrupted: the figures above are of the waves measured before")
    return "\n".join(lines).rstrip() + "\n"
