"""The bench report's logic on made-up measurements (no model runs): speed intervals over
prompts, the plain sentence per method and its word on noise, the warning for a busy machine,
the flag for a speedup whose mean accepted length is about 1, repeated 4-grams, and no `None`."""

from __future__ import annotations

import numpy as np

from flylocal.front import bench as b
from flylocal.front.bench.report import interval, repeated_4grams, report_md


def row(method: str, speeds: dict, rounds_per_token: float = 1.0, outputs=None) -> b.Row:
    """A method's Row: per prompt, 100 tokens at `speeds[prompt]` tokens/s, decode and end to end."""
    r = b.Row(method)
    for pid, tps in speeds.items():
        r.per_prompt[pid] = {**dict.fromkeys(b.report.COUNTS, 0), "tokens": 100, "emitted_in_rounds": 100,
                             "decode_tokens": 100,
                             "wall_s": 100 / tps, "decode_s": 100 / tps, "rounds": round(100 * rounds_per_token)}
        r.outputs[pid] = (outputs or {}).get(pid, ([1, 2, 3, 4, 5, 6], "text"))
    return r


def prompts(n: int, category: str | None = None) -> list[b.Prompt]:
    return [b.Prompt(f"p{i}", "q", category=category) for i in range(n)]


def results(rows: dict, ps: list, busy=0.0, kernels="fast") -> dict:
    return {"methods": b.metrics(rows, ps), "prompts": b.report.per_prompt(rows, ps),
            "machine": {**b.machine_info({"llama_cpp_python": "x", "gpu_offload": False, "kernels": kernels}),
                        "busy_cores": busy, "cpus": 2},
            "config": {"target": "t", "draft": None, "source": "s", "prompts": len(ps), "max_tokens": 8, "repeat": 3}}


def test_the_interval_is_the_bootstrap_of_the_summed_ratio_and_holds_the_estimate():
    ps = prompts(8)
    ref = row("autoregressive", {p.id: 20.0 for p in ps})
    fast = row("strict-pld", {p.id: 20.0 * (2.0 + 0.1 * (i % 3)) for i, p in enumerate(ps)}, 0.4)
    low, high = interval(fast, ref, [p.id for p in ps], e2e=True)
    assert 2.0 <= low < high <= 2.2                       # within the per-prompt ratios' range
    steady = row("strict-pld", {p.id: 40.0 for p in ps})
    assert interval(steady, ref, [p.id for p in ps], e2e=False) == [2.0, 2.0]
    assert interval(fast, ref, ["p0"], e2e=True) is None  # one prompt: no interval
    m = {r["method"]: r for r in b.metrics({"autoregressive": ref, "strict-pld": fast}, ps)}
    assert m["strict-pld"]["e2e_speedup_ci"][0] <= m["strict-pld"]["e2e_speedup"] <= m["strict-pld"]["e2e_speedup_ci"][1]
    assert m["autoregressive"].get("e2e_speedup_ci") is None


def test_the_report_opens_with_a_sentence_per_method_and_calls_noise_noise():
    ps = prompts(10)
    rng = np.random.default_rng(1)
    ref = row("autoregressive", {p.id: 20.0 for p in ps})
    real = row("fly-pld", {p.id: 60.0 * (1 + 0.05 * rng.standard_normal()) for p in ps}, 0.3,
               outputs={"p0": ([9, 9, 9, 9], "other")})
    noise = row("strict-pld", {p.id: 20.0 * (1.3 if i % 2 else 0.75) for i, p in enumerate(ps)}, 0.98)
    text = report_md(results({"autoregressive": ref, "fly-pld": real, "strict-pld": noise}, ps))
    head = text.split("| method")[0]
    fly = next(line for line in head.splitlines() if line.startswith("- **fly-pld**"))
    assert "plain decoding end to end" in fly and "over 10 prompts" in fly and "1 of 10 answers differ" in fly
    assert "noise" not in fly
    strict = next(line for line in head.splitlines() if line.startswith("- **strict-pld**"))
    assert "The interval includes 1.0: the difference from plain decoding is noise." in strict
    assert "None" not in text and "draft `" not in text


def test_a_busy_machine_is_warned_of_and_a_quiet_one_is_not():
    ps = prompts(3)
    rows = {"autoregressive": row("autoregressive", {p.id: 20.0 for p in ps}),
            "strict-pld": row("strict-pld", {p.id: 30.0 for p in ps}, 0.5)}
    assert "Warning: other processes kept 1.40 of" in report_md(results(rows, ps, busy=1.4))
    assert "Warning" not in report_md(results(rows, ps, busy=0.05))
    assert "Warning" not in report_md(results(rows, ps, busy=None))


def test_a_speedup_with_mean_accepted_length_near_one_is_flagged():
    ps = prompts(4, "qa") + [b.Prompt(f"t{i}", "q", category="translation") for i in range(4)]
    ref = row("autoregressive", {p.id: 20.0 for p in ps})
    # qa: 1.5x with one token a round (not speculation); translation: 2x with 2.5 a round
    pld = row("strict-pld", {p.id: 30.0 if p.category == "qa" else 40.0 for p in ps})
    for p in ps:
        pld.per_prompt[p.id]["rounds"] = 100 if p.category == "qa" else 40
    text = report_md(results({"autoregressive": ref, "strict-pld": pld}, ps))
    line = next(x for x in text.splitlines() if x.startswith("| strict-pld | ") and "†" in x)
    translation, qa, overall = line.split(" | ")[1:4]   # groups in Spec-Bench's order
    assert "†" in qa and "†" not in translation and "†" not in overall
    assert "does not come from speculation" in text
    whole = report_md(results({"autoregressive": ref, "strict-pld": row("strict-pld", {p.id: 30.0 for p in ps})}, ps))
    assert "it does not come from speculation" in whole.split("| method")[0]


def test_repeated_4grams_measure_a_loop():
    assert repeated_4grams([1, 2, 3, 4, 5, 6, 7, 8]) == 0.0
    loop = [1, 2, 3, 4] * 5
    assert repeated_4grams(loop) == (len(loop) - 3 - 4) / (len(loop) - 3)
    assert repeated_4grams([1, 2, 3]) is None
    ps = prompts(2)
    rows = {"autoregressive": row("autoregressive", {p.id: 20.0 for p in ps}),
            "fly-pld": row("fly-pld", {p.id: 40.0 for p in ps}, 0.3, outputs={p.id: (loop, "loop") for p in ps})}
    m = {r["method"]: r for r in b.metrics(rows, ps)}
    assert m["fly-pld"]["repeated_4grams"] > 0.5 and m["autoregressive"]["repeated_4grams"] == 0.0
    assert "repeated 4-grams" in report_md(results(rows, ps))


def test_strict_below_full_agreement_is_explained_in_the_fast_build_only():
    ps = prompts(2)
    rows = {"autoregressive": row("autoregressive", {p.id: 20.0 for p in ps}),
            "strict-pld": row("strict-pld", {p.id: 30.0 for p in ps}, 0.5, outputs={"p0": ([7, 7, 7, 7], "x")})}
    assert "near-ties" in report_md(results(rows, ps))
    assert "near-ties" not in report_md(results(rows, ps, kernels="exact"))


def test_a_rounds_time_splits_into_draft_target_decide_and_host_work():
    """Two generations of 11 rounds each: the first round of each is the prompt's (its decode is
    the prefill's time, not a round's); the 20 rounds after them share the decoding time."""
    ps = prompts(1)
    ref = row("autoregressive", {"p0": 20.0})
    ref.per_prompt["p0"].update(rounds=0, generations=2)      # as plain decoding's runs count
    mine = row("strict-pld", {"p0": 40.0})
    mine.per_prompt["p0"].update(rounds=22, generations=2, decode_s=2.0, prefill_s=3.0, target_s=3.0 + 20 * 0.06,
                                 draft_s=22 * 0.01, verify_s=22 * 0.005)
    r = next(m for m in b.metrics({"autoregressive": ref, "strict-pld": mine}, ps) if m["method"] == "strict-pld")
    assert r["round_ms"] == {"draft": 10.0, "target": 60.0, "decide": 5.0, "host": 25.0}
    assert "10.0, 60.0, 5.0, 25.0" in report_md(results({"autoregressive": ref, "strict-pld": mine}, ps))
    assert next(m for m in b.metrics({"autoregressive": ref}, ps))["round_ms"] is None      # plain has no rounds
