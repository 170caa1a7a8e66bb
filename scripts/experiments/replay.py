"""What the replay benchmarks share (pld_ceiling.py, tree_ceiling.py): strict decoding is
deterministic, so once the target's greedy answer to a prompt is known, every round of a
prompt-lookup run can be replayed without the model, and timed on the target's cost curve.

`answers` runs the target once per prompt (kept in a .npz file when one is named, and read back
from it next time); `curve` times the target's decodes of 1..rows rows, with logits on every row,
as the engine's calibration does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # scripts/bench's shared helpers (harness)
import harness


def answers(models, prompts_path: str, per_category: int, skip: int, raw: bool, path: str | None,
            context: int | None = None):
    """[(group, prompt + greedy answer token ids, prompt length)] for `per_category` prompts of
    each Spec-Bench group after its first `skip`, asked through the chat template or, `raw`, as
    'Question: ...\\nAnswer:' (a base model); with `context`, each padded to about that many
    tokens with other questions' texts, as `flylocal bench serve --context` pads them."""
    from flylocal.decoding.engine import generate_all
    from flylocal.front.bench.prompts import BASE_FORM
    from flylocal.loader import encode_prompt

    if path and os.path.exists(path):
        kept = np.load(path, allow_pickle=False)
        return [(str(g), kept[f"t{i}"], int(n)) for i, (g, n) in enumerate(zip(kept["groups"], kept["n0"]))]
    items = []
    target = models.target
    if context:
        from flylocal.front.bench.questions import conversations

        count = lambda text: len(target.tokenize(text, add_special=False))         # noqa: E731
        asked = [(label.rsplit(" ", 1)[0], turns[0]) for label, turns in
                 conversations(prompts_path, None, per_category, skip, 1, None, 1, context, count)]
    else:
        asked = harness.spec_bench_questions(per_category, skip, prompts_path)
    for group, text in asked:
        ids, _ = encode_prompt(target, BASE_FORM.format(text) if raw else text, raw=raw)
        target.reset()
        tokens, _, _ = generate_all(models.engine(), ids)
        items.append((group, np.concatenate([ids, np.asarray(tokens, dtype=np.int32)]), len(ids)))
        print(f"\r{len(items)} prompts", end="", file=sys.stderr)
    print(file=sys.stderr)
    if path:
        np.savez(path, groups=np.array([g for g, _, _ in items]), n0=np.array([n for _, _, n in items]),
                 **{f"t{i}": full for i, (_, full, _) in enumerate(items)})
    target.reset()
    return items


def curve(target, probe: np.ndarray, rows: int, repeat: int = 7) -> np.ndarray:
    """[rows] seconds of one decode of 1..rows rows after a 256-token context (each the median
    of `repeat`, the sizes taking turns)."""
    from flylocal.decoding.adaptive import timed_decode

    target.reset()
    target.decode(probe[:256])
    times = np.array([[timed_decode(target, int(probe[0]), n) for n in range(1, rows + 1)] for _ in range(repeat)])
    target.reset()
    return np.median(times, axis=0)


GROUPS = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def table(rows, cost: np.ndarray, n_items: int, mode: str, sizes=(1, 2, 3, 5, 9, 17), what: str = "decode") -> None:
    """Print speedups over plain decoding: `rows` [(policy, ({group: speedup}, overall))]."""
    groups = [g for g in GROUPS if g in rows[0][1][0]]
    print(f"{what} speedup over plain decoding, {n_items} prompts, {mode} build, cost curve (ms): "
          + ", ".join(f"{n}: {1000 * cost[n - 1]:.1f}" for n in sizes if n <= len(cost)))
    print("| policy | " + " | ".join(groups) + " | overall |")
    print("|" + " --- |" * (len(groups) + 2))
    for name, (per, overall) in rows:
        print(f"| {name} | " + " | ".join(f"{per[g]:.3f}" for g in groups) + f" | {overall:.3f} |")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="What the replay benchmarks share: greedy answers, the cost curve, the "
                            "table.", epilog="A module they import; run by itself it does nothing.").parse_args()
