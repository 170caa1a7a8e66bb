"""Strict output equals plain greedy output token for token, for every drafter, on real models.

SmolLM2 (Q4_1, with its Q4_0 requant as draft) and Gemma-3-270M requantized to Q8_0 are
batch-invariant in the CPU build (ENV.md), so any difference is a bug: in rollback, catch-up,
drafting or verification. Gemma-3-270M Q4_K_M is not batch-invariant; for it the weaker
property holds: strict leaves plain decoding only at a numerical near-tie.
"""

from __future__ import annotations

import numpy as np
import pytest

from flylocal.drafters import make_drafter
from flylocal.engine import Engine, EngineConfig, generate_all
from flylocal.loader import encode_prompt
from flylocal.verifiers.strict import strict

TYPOS = (
    "Fix the typos in this text:\n\nThe old lighthouse stood at the edge of the cliff for more then two hundred "
    "years. Every nigth its keeper climbed the narow stairs to light the lamp, and every morning he wrote the "
    "wether in a leather book."
)
SMOL_PROMPTS = {
    # long copied spans: prompt lookup and MLA propose whole phrases
    "copy": TYPOS,
    # the model's own words
    "own-words": "Write a short poem about autumn leaves.",
    # a short answer: the end-of-turn token is drafted (it occurs in the prompt's template)
    "short-answer": "What is the capital of France? Answer with one word.",
}


def run(target, drafter, prompt_ids, k=None, max_tokens=64, draft_model=None):
    engine = Engine(
        target,
        make_drafter(drafter, target, draft_model),
        strict,
        EngineConfig(max_tokens=max_tokens, k=8 if k is None else k, adaptive=k is None, trace=True),
    )
    return generate_all(engine, prompt_ids)


def plain(target, prompt_ids, max_tokens=64):
    tokens, stats, _ = run(target, "none", prompt_ids, k=0, max_tokens=max_tokens)
    assert stats.drafted == 0 and stats.rounds == stats.emitted
    return tokens


@pytest.mark.parametrize("name", SMOL_PROMPTS)
@pytest.mark.parametrize("drafter,k", [("pld", 8), ("pld", None), ("pld", 3), ("model", 6), ("mla", 8)])
def test_smollm_strict_equals_plain(smol, smol_draft, name, drafter, k):
    ids, _ = encode_prompt(smol, SMOL_PROMPTS[name], raw=False)
    expected = plain(smol, ids)
    tokens, stats, trace = run(smol, drafter, ids, k=k, draft_model=smol_draft)
    assert tokens == expected
    if k is not None:  # a fixed k must really have drafted, or the comparison proves little
        assert stats.drafted > 0
    if drafter != "pld":
        assert stats.accepted > 0


LONG_TYPOS = TYPOS + (
    " When the keeper retired, the town decided to keep the light burning with an automatic system, but they "
    "kept the book in the libary so that visitors could read it.\n\nThe book is now one of the most popular things "
    "in the museum. Children like to find the days when storms hit the coast, and older visitors look for the day "
    "they were born."
)


@pytest.mark.parametrize("drafter,k", [("pld", 5), ("pld", None), ("model", 4)])
def test_long_generation_past_256_cache_cells(smol, smol_draft, drafter, k):
    """Attention kernels change blocking past 256 cache cells; strict must stay exact there.
    (llama.cpp's CPU flash attention is not batch-invariant past that point, which is why CPU
    builds run without it; the doctor probe test checks that the difference is detected.)"""
    ids, _ = encode_prompt(smol, LONG_TYPOS, raw=False)
    expected = plain(smol, ids, max_tokens=160)
    assert len(ids) + len(expected) > 256 + 8
    tokens, stats, _ = run(smol, drafter, ids, k=k, max_tokens=160, draft_model=smol_draft)
    assert tokens == expected


def test_eog_inside_a_draft_is_handled(smol):
    ids, _ = encode_prompt(smol, SMOL_PROMPTS["short-answer"], raw=False)
    expected = plain(smol, ids)
    tokens, stats, trace = run(smol, "pld", ids, k=8)
    assert tokens == expected
    eog_in_draft = [r for r in trace if any(smol.is_eog(t) for t in r["draft"])]
    assert eog_in_draft, "no draft contained an end-of-generation token; the case is not exercised"
    assert stats.stop == "eog"


def test_copy_prompt_accepts_long_spans(smol):
    ids, _ = encode_prompt(smol, TYPOS, raw=False)
    tokens, stats, trace = run(smol, "pld", ids, k=8)
    assert max(r["accepted"] for r in trace) >= 4
    assert stats.mean_accepted_length > 1.5


def test_max_tokens_cut_inside_a_round(smol):
    ids, _ = encode_prompt(smol, TYPOS, raw=False)
    for max_tokens in (1, 5, 13):
        expected = plain(smol, ids, max_tokens=max_tokens)
        tokens, stats, _ = run(smol, "pld", ids, k=8, max_tokens=max_tokens)
        assert tokens == expected and len(tokens) == max_tokens


GEMMA_TEXT = (
    "The river runs through the valley and past the mill. The miller grinds the grain each morning, and the "
    "baker buys the flour each afternoon. "
)


@pytest.mark.parametrize("k", [8, None])
def test_gemma_q8_strict_equals_plain(gemma_q8, k):
    ids = gemma_q8.tokenize(GEMMA_TEXT * 3)
    expected = plain(gemma_q8, ids, max_tokens=48)
    tokens, stats, _ = run(gemma_q8, "pld", ids, k=k, max_tokens=48)
    assert tokens == expected


def test_gemma_q8_rolls_back_past_the_sliding_window(gemma_q8):
    # 512-token sliding window: a prompt of ~700 tokens makes every rollback cross it.
    ids = gemma_q8.tokenize(GEMMA_TEXT * 20 + "Then one day, a stranger came to the village. He")
    assert len(ids) > 560
    expected = plain(gemma_q8, ids, max_tokens=40)
    tokens, stats, _ = run(gemma_q8, "pld", ids, k=8, max_tokens=40)
    assert stats.drafted > stats.accepted > 0   # rejected drafts were rolled back
    assert tokens == expected


@pytest.mark.parametrize("text", [GEMMA_TEXT * 3, "def fibonacci(n):\n    "])
def test_gemma_q4km_diverges_only_at_near_ties(gemma_q4km, text):
    """Where strict first differs from plain decoding, the two tokens' target logits (as plain
    decoding computed them) are within a small gap. (In this build the fibonacci prompt
    diverges at token 13; the other stays identical.)"""
    ids = gemma_q4km.tokenize(text)
    expected = plain(gemma_q4km, ids, max_tokens=64)
    tokens, _, _ = run(gemma_q4km, "pld", ids, k=8, max_tokens=64)
    diverge = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if diverge is None:
        assert tokens == expected
        return
    gemma_q4km.reset()
    context = np.concatenate([ids, np.asarray(expected[:diverge], dtype=np.int32)])
    gemma_q4km.decode(context[:-1])
    z = gemma_q4km.decode(context[-1:], logits_from=0)[0]
    gap = float(z[expected[diverge]] - z[tokens[diverge]])
    print(f"diverged at {diverge}, logit gap {gap:.4f}")
    assert 0.0 <= gap < 0.5, f"strict diverged at {diverge} with a logit gap of {gap}"
