"""A method's measured rows in `flylocal bench`: what it counted on each prompt (Row), and the
speed figures drawn from them (summed counts, tokens per second and ratios to a reference, with
a bootstrap interval over the prompts). The report and the task scores read these."""

from __future__ import annotations

from dataclasses import dataclass, field

from flylocal.statistics import bootstrap

COUNTS = ("tokens", "emitted_in_rounds", "decode_tokens", "decode_s", "wall_s", "rounds", "loose", "verify_s", "drafted", "accepted", "forced", "mask_s",
          "draft_s", "target_s", "prefill_s", "generations")    # summed per prompt over turns, repeats


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
    scores: dict = field(default_factory=dict)     # prompt id -> its task's score of the answer, 0-100
    loose: dict = field(default_factory=dict)      # prompt id -> output positions accepted loosely (first turn)


def speed_of(row: Row, ids) -> dict:
    """Summed counts of `row` over the prompt ids given."""
    t = dict.fromkeys(COUNTS, 0)
    for pid in ids:
        for key, v in row.per_prompt[pid].items():
            t[key] += v
    return t


def ratios(mine: dict, ref: dict | None) -> dict:
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


RESAMPLES = 2000         # bootstrap resamples of the prompts for a speed ratio's interval


def interval(row: Row, ref: Row, ids: list[str], e2e: bool) -> list[float] | None:
    """The 95% interval of a speed ratio (row's summed tokens over summed seconds, over ref's)
    over the prompts `ids`: a percentile bootstrap of the prompts (RESAMPLES, a fixed seed, so
    a report is reproducible). None for fewer than two prompts."""
    if len(ids) < 2:
        return None
    tokens, seconds = ("tokens", "wall_s") if e2e else ("decode_tokens", "decode_s")
    counts = [[row.per_prompt[i][tokens], row.per_prompt[i][seconds],
               ref.per_prompt[i][tokens], ref.per_prompt[i][seconds]] for i in ids]     # [n, 4]

    def ratio(resampled):                                          # [RESAMPLES, n, 4] -> [RESAMPLES]
        sums = resampled.sum(axis=1)
        return (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])

    found = bootstrap(counts, ratio, RESAMPLES)
    return None if found is None else [round(found[0], 3), round(found[1], 3)]
