"""Sampling at temperature > 0: strict speculative sampling is lossless, and the test can fail.

Statistical checks are seeded, and the CPU build is batch-invariant, so they are deterministic.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
from collections import Counter

import numpy as np
import pytest

from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.sampling import (SamplingParams, _sample_among_top, adjust, position_noise, processed_probs,
                                       sample_targets, target_argmax)
from flylocal.decoding.contracts import Decision, Verifier
from flylocal.decoding.verifiers.strict import Strict


def critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at alpha = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Goodness of fit over categories with expected count >= 5; the rest pooled as 'other'."""
    cats = [c for c, p in expected.items() if p * n >= 5]
    exp = [expected[c] * n for c in cats]
    obs = [observed.get(c, 0) for c in cats]
    rest_e, rest_o = n - sum(exp), n - sum(obs)
    if rest_e >= 5:
        exp.append(rest_e)
        obs.append(rest_o)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(exp) - 1


# ----- pure functions -----

def test_processed_probs_filters_in_llama_cpp_order():
    z = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
    ids, p = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [0, 1, 2, 3, 4] and p == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [0, 1, 2]
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0))
    assert ids.tolist() == [0, 1, 2]            # 0.5 + 0.2 < 0.8 <= 0.85
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25))
    assert ids.tolist() == [0, 1, 2]            # >= 0.125
    _, p = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert p[0] == pytest.approx(0.25 / (0.25 + 0.04 + 0.0225 + 0.01 + 0.0025))
    # temperature comes last: top-p and min-p see the untempered distribution. Tempered first,
    # T = 0.5 would give [0.77, 0.12, ...] and top-p 0.8 would keep two tokens, min-p 0.25 two.
    ids, p = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=0.5, top_k=0, top_p=0.8, min_p=0.0))
    assert ids.tolist() == [0, 1, 2] and p == pytest.approx(np.array([0.25, 0.04, 0.0225]) / 0.3125)
    ids, _ = processed_probs(z, np.array([], dtype=np.int32), SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.25))
    assert ids.tolist() == [0, 1, 2]
    z2 = np.array([2.0, 1.9, 0.0], dtype=np.float32)  # the penalty sees the history only
    ids, _ = processed_probs(z2, np.array([0], dtype=np.int32),
                             SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5))
    assert ids[0] == 1


def reference_probs(z, p):
    """processed_probs by its definition, sorting every token (no top-k, no penalties)."""
    z = z.astype(np.float64)
    ids = np.argsort(-z, kind="stable")
    logits = z[ids]
    if p.top_p < 1.0:
        probs = np.exp(logits - logits[0])
        keep = int(np.searchsorted(np.cumsum(probs / probs.sum()), p.top_p)) + 1
        ids, logits = ids[:keep], logits[:keep]
    if p.min_p > 0.0:
        keep = logits >= logits[0] + np.log(p.min_p)
        ids, logits = ids[keep], logits[keep]
    probs = np.exp((logits - logits[0]) / p.temperature)
    return ids, probs / probs.sum()


@pytest.mark.parametrize("seed", range(4))
def test_without_top_k_only_the_kept_prefix_is_sorted_and_the_result_is_the_full_sorts(seed):
    """Min-p and top-p keep a prefix of the sorted vocabulary, found without sorting it all:
    the same candidates, in the same order (ties by id), with the same probabilities."""
    rng = np.random.default_rng(seed)
    for n in (300, 5000, 49152):
        for sharp in (0.5, 3.0, 12.0):                  # a flat, a usual and a peaked distribution
            z = (rng.standard_normal(n) * sharp).astype(np.float32)
            z[: n // 3] = np.round(z[: n // 3] * 2) / 2        # ties, as quantized models give
            for top_p, min_p in ((1.0, 0.05), (0.9, 0.0), (0.5, 0.0), (0.95, 0.02), (0.999, 0.0)):
                p = SamplingParams(temperature=0.8, top_k=0, top_p=top_p, min_p=min_p)
                ids, probs = processed_probs(z, np.zeros(0, dtype=np.int32), p)
                ref_ids, ref_probs = reference_probs(z, p)
                assert np.array_equal(ids, ref_ids), (n, sharp, top_p, min_p)
                assert np.allclose(probs, ref_probs, rtol=1e-9, atol=0)


def full_sort_sample(z: np.ndarray, history: np.ndarray, p: SamplingParams, u: float) -> int:
    """The inverse-CDF sample over processed_probs' candidates, all of them sorted."""
    ids, probs = reference_probs(adjust(z, history, p) if p.adjusts else z, p)
    cdf = np.cumsum(probs)
    return int(ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(ids) - 1)])


@pytest.mark.parametrize("seed", range(3))
def test_sampling_the_whole_vocabulary_looks_among_the_most_likely_and_gives_the_full_sorts_token(seed):
    """Without top-k, top-p or min-p, q is the whole vocabulary: the token at each noise is the
    one the full sort gives, on flat distributions (where u often falls past the most likely
    ids, and the full sort decides) as on peaked ones, with ties and with penalties."""
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 300, 40).astype(np.int32)
    found = Counter()                                # rows the most likely ids decided, and not
    for n in (300, 5000, 49152):
        for sharp in (0.5, 3.0, 12.0):
            z = (rng.standard_normal((6, n)) * sharp).astype(np.float32)
            z[:, : n // 3] = np.round(z[:, : n // 3] * 2) / 2
            for p in (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                      SamplingParams(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2,
                                     presence_penalty=0.5, logit_bias=((7, 3.0),))):
                noise = rng.random(6)
                noise[0] = 0.999999                          # past the most likely ids on any of these
                a = sample_targets(np.zeros(5, dtype=np.int32), z, history, p, noise)
                for j in range(6):
                    h = np.concatenate([history, np.zeros(j, dtype=np.int32)])
                    want = full_sort_sample(z[j], h, p, noise[j])
                    assert a[j] == want, (n, sharp, p, j)
                    fast = _sample_among_top(adjust(z[j], h, p), p.temperature, noise[j])
                    assert fast in (None, want)
                    found[fast is not None] += 1
    assert found[True] > 0 and found[False] > 0       # both ways were taken


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_a_bias_is_each_rows_adjusted_argmax(seed):
    """A bias that only lowers tokens no row chose is skipped; any other bias, a row that chose a
    lowered token, a tie with one, and penalties each give the argmax of the adjusted row."""
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 50, 30).astype(np.int32)
    draft = rng.integers(0, 50, 4).astype(np.int32)
    z = np.round(rng.standard_normal((5, 300)) * 4).astype(np.float32)      # ties
    chosen = int(z[2].argmax())
    for bias in (((7, -100.0), (9, -1.0)), ((chosen, -100.0),), ((chosen, -0.0),), ((11, 2.5),),
                 ((int(np.flatnonzero(z[0] == z[0].max())[-1]), -3.0),)):
        for p in (SamplingParams(logit_bias=bias), SamplingParams(logit_bias=bias, presence_penalty=0.5)):
            want = [int(adjust(z[j], np.concatenate([history, draft[:j]]), p).argmax()) for j in range(5)]
            assert target_argmax(draft, z, history, p).tolist() == want, (bias, p)


@pytest.mark.parametrize("draft_token", [0, 2, 4])
def test_sampled_targets_follow_q_whatever_the_draft(draft_token):
    z = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2] * 5], dtype=np.float32))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    d = np.array([draft_token], dtype=np.int32)
    n = 20000
    noise = position_noise(3, np.arange(2 * n)).reshape(n, 2)           # [n, k+1]: one request per row
    counts = Counter(int(sample_targets(d, z, np.zeros(0, dtype=np.int32), p, u)[0]) for u in noise)
    stat, df = chi_square(counts, dict(enumerate([0.4, 0.3, 0.15, 0.1, 0.05])), n)
    assert stat < critical(df)
    # the match probability is as high as a sample from q allows: q(d)
    assert counts[draft_token] / n == pytest.approx([0.4, 0.3, 0.15, 0.1, 0.05][draft_token], abs=0.015)


def test_position_noise_is_uniform_and_keyed_by_seed_and_position_only():
    u = position_noise(11, np.arange(50000))
    counts = Counter((u * 20).astype(int).tolist())
    stat, df = chi_square(counts, {b: 0.05 for b in range(20)}, len(u))
    assert stat < critical(df) and 0 <= u.min() and u.max() < 1
    assert position_noise(11, [7, 123]).tolist() == [u[7], u[123]]        # the same whoever asks, in any batch
    assert position_noise(12, [7])[0] != u[7]
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02                    # neighbours unrelated


def test_a_draft_token_is_accepted_exactly_when_it_is_the_sample():
    """The same noise: the draft decides nothing, it is accepted where it equals the sample."""
    z = np.log(np.array([[0.5, 0.3, 0.2]] * 3, dtype=np.float32))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    noise = np.array([0.1, 0.6, 0.95])                  # the tokens at these quantiles: 0, 1, 2
    for draft in ([0, 1], [2, 2], [0, 0]):
        a = sample_targets(np.array(draft, dtype=np.int32), z, np.zeros(0, dtype=np.int32), p, noise)
        assert a.tolist() == [0, 1, 2]


# ----- penalties, bias and log-probabilities at temperature 0, on the fake target -----

PENALTIES = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7, repeat_last_n=8,
                           logit_bias=((3, -100.0), (5, 1.5)))


def plain_adjusted(lm, prompt, p: SamplingParams, n: int):
    """Plain greedy decoding, one token at a time, of the adjusted logits: (tokens, logprobs)."""
    from fake_backend import FakeTarget

    from flylocal.decoding.sampling import adjust

    target = FakeTarget(lm, n_ctx=256)
    context = [int(t) for t in prompt]
    target.decode(context[:-1])
    out, logprobs = [], []
    for _ in range(n):
        z = adjust(target.decode(context[-1:], logits_from=0)[0], np.array(context, dtype=np.int32), p)
        token = int(z.argmax())
        logprobs.append(float(z[token] - (z.max() + np.log(np.exp(z - z.max()).sum()))))
        out.append(token)
        context.append(token)
    return out, logprobs


@pytest.mark.parametrize("seed", range(5))
def test_strict_with_penalties_and_bias_is_plain_greedy_with_them_and_logprobs_are_plain_decodings(seed):
    """The penalties and the bias act at temperature 0, on every verified row with its own
    history (the committed tokens and the draft before it), so strict is plain greedy decoding
    of the adjusted logits whatever was drafted; each token's log-probability is the plain
    decode's, read from the round's rows."""
    from fake_backend import FakeLM, FakeTarget, NoisyOracle

    lm = FakeLM(seed=seed, n_vocab=12, eog=(), p_eog=0.0)
    prompt = np.random.default_rng(seed).integers(0, 12, size=6).astype(np.int32)
    reference, ref_logprobs = plain_adjusted(lm, prompt, PENALTIES, 40)
    assert 3 not in reference                                  # the -100 bias bans it
    raw, _ = plain_adjusted(lm, prompt, SamplingParams(), 40)
    assert raw != reference                                    # the penalties changed something
    drafter = NoisyOracle(lm, seed=seed, p_corrupt=0.2, p_eog=0.0)
    engine = Engine(FakeTarget(lm, n_ctx=256), drafter, Strict(),
                    EngineConfig(max_tokens=40, k=5, sampling=PENALTIES, logprobs=2))
    gen = engine.generate(prompt)
    logprobs = [lp for event in gen for lp in event.logprobs]
    assert gen.tokens == reference and gen.stats.drafted > 0
    assert np.allclose([lp for lp, _ in logprobs], ref_logprobs)
    for lp, top in logprobs:
        assert len(top) == 2 and top[0][1] >= top[1][1] and np.isclose(top[0][1], lp)   # greedy: itself first


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-40, 9.9e-11])
def test_a_temperature_too_small_to_divide_by_is_greedy_decoding(temperature):
    """Below GREEDY_BELOW (1e-10) a temperature is greedy: 1e-320 overflowed the division (logits
    over it were inf, their differences NaN) and gave a fixed answer of its own, for every seed."""
    from fake_backend import FakeLM, FakeTarget, NoisyOracle

    from flylocal.decoding.sampling import GREEDY_BELOW

    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    lm = FakeLM(seed=3, n_vocab=12, eog=(), p_eog=0.0)
    prompt = np.array([1, 5, 2, 7], dtype=np.int32)

    def run(sampling: SamplingParams) -> list[int]:
        engine = Engine(FakeTarget(lm, n_ctx=128), NoisyOracle(lm, seed=1, p_corrupt=0.2, p_eog=0.0), Strict(),
                        EngineConfig(max_tokens=30, k=4, sampling=sampling))
        return engine.generate(prompt).run().tokens

    greedy = run(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0))
    for seed in (1, 2, 3):
        assert run(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)) == greedy


# ----- the same q as llama.cpp's own sampler chain -----

def llama_cpp_chain(z: np.ndarray, history: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, probabilities) after llama.cpp's sampler chain, through llama-cpp-python's
    sampler API: penalties -> top-k -> top-p -> min-p -> temperature, then softmax."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if p.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(p.logit_bias))()
        for i, (token, bias) in enumerate(p.logit_bias):
            biases[i].token, biases[i].bias = token, bias
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_logit_bias(len(z), len(p.logit_bias),
                                                                                         biases))
    # The binding still declares an older signature with n_vocab first; the library reads the
    # first int as penalty_last_n. Passing last_n twice is right under either signature.
    for smpl in (llama_cpp.llama_sampler_init_penalties(p.repeat_last_n, p.repeat_last_n, p.repeat_penalty,
                                                         p.frequency_penalty, p.presence_penalty),
                 llama_cpp.llama_sampler_init_top_k(p.top_k),
                 llama_cpp.llama_sampler_init_top_p(p.top_p, 1),
                 llama_cpp.llama_sampler_init_min_p(p.min_p, 1),
                 llama_cpp.llama_sampler_init_temp(p.temperature)):
        llama_cpp.llama_sampler_chain_add(chain, smpl)
    for t in history:
        llama_cpp.llama_sampler_accept(chain, int(t))
    data = (llama_cpp.llama_token_data * len(z))()
    for i, logit in enumerate(z.tolist()):
        data[i].id, data[i].logit, data[i].p = i, logit, 0.0
    array = llama_cpp.llama_token_data_array(data=data, size=len(z), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    llama_cpp.llama_sampler_free(chain)
    ids = np.array([array.data[i].id for i in range(array.size)])
    logits = np.array([array.data[i].logit for i in range(array.size)], dtype=np.float64)
    probs = np.exp(logits - logits.max())
    return ids, probs / probs.sum()


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.3])
@pytest.mark.parametrize("filters", [dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=20, top_p=0.8, min_p=0.1),
                                     dict(top_k=0, top_p=0.9, min_p=0.02, repeat_penalty=1.3),
                                     dict(top_k=0, top_p=1.0, min_p=0.0, frequency_penalty=0.6, presence_penalty=0.4),
                                     dict(top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.1, frequency_penalty=-0.3,
                                          presence_penalty=1.5, logit_bias=((13, 4.0), (260, -100.0), (1000, 2.5)))])
def test_processed_distribution_equals_llama_cpp_sampler_chain(smol, temperature, filters):
    """On real logits, flylocal's q has llama.cpp's candidate set and its probabilities: the
    logit bias, the repeat, frequency and presence penalties (over a history that repeats
    itself), top-k, top-p, min-p and temperature, in llama.cpp's order."""
    ids = smol.tokenize("The weather today is sunny. The weather today is warm. The weather today is", add_special=True)
    smol.reset()
    smol.decode(ids[:-1])
    z = smol.decode(ids[-1:], logits_from=0)[0].copy()           # [n_vocab] float32
    p = SamplingParams(temperature=temperature, **filters)
    ours_ids, ours_p = processed_probs(z, ids, p)
    ref_ids, ref_p = llama_cpp_chain(z, ids, p)
    assert len(ours_ids) > 1                                      # a real choice, not one survivor
    ref = dict(zip(ref_ids.tolist(), ref_p.tolist()))
    assert set(ours_ids.tolist()) == set(ref)
    assert max(abs(q - ref[t]) for t, q in zip(ours_ids.tolist(), ours_p.tolist())) < 1e-5


# ----- real models -----

RAW = "one two three four five six seven. one two three four five six seven. one two three"
# (prompt, settings): T = 1 with no filters; T = 0.7 with top-k, top-p and min-p (temperature
# applied last), on a prompt where the sharper distribution still leaves 11 pairs to count
CASES = {"T=1": (RAW, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)),
         "T=0.7": ("I like the red car. She likes the",
                   SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02, seed=1234))}
N = 250


class AcceptAll(Verifier):
    """A deliberately wrong rule: commit every draft token."""

    name = "accept-all"

    def decide(self, draft, target_argmax, logits, window=None, start=0):
        return Decision(accepted=len(draft)), window


def expected_pairs(rt, ids, p: SamplingParams, top: int = 6) -> dict:
    """Exact P(x1, x2) of plain sampling for the `top` most likely first tokens."""
    rt.reset()
    rt.decode(ids[:-1])
    z0 = rt.decode(ids[-1:], logits_from=0)[0].copy()
    ids0, p0 = processed_probs(z0, ids, p)
    out = {}
    for x1, q1 in zip(ids0[:top], p0[:top]):
        ctx = np.append(ids, x1).astype(np.int32)
        rt.reset()
        rt.decode(ctx[:-1])
        z1 = rt.decode(ctx[-1:], logits_from=0)[0].copy()
        ids1, p1 = processed_probs(z1, ctx, p)
        for x2, q2 in zip(ids1, p1):
            out[(int(x1), int(x2))] = float(q1 * q2)
    return out


def sample_pairs(target, drafter, verifier, ids, k, settings, n=N):
    """Counts of the first two tokens over n runs with seeds settings.seed + 0 .. n-1, and how
    many runs drafted two or more tokens in a round (so that position 1 was decided after an
    accepted or rejected 0). Three tokens are generated: drafts are shortened to fit
    max_tokens, and two fit."""
    pairs, long_drafts = Counter(), 0
    for i in range(n):
        engine = Engine(target, drafter, verifier,
                        EngineConfig(max_tokens=3, k=k, trace=True,
                                     sampling=dataclasses.replace(settings, seed=settings.seed + i)))
        tokens, stats, trace = generate_all(engine, ids)
        pairs[tuple(tokens[:2])] += 1
        long_drafts += any(len(r["draft"]) >= 2 for r in trace)
    return pairs, long_drafts


# Plain sampling (no drafter) is not sampled here on its own: it draws from q as the fast
# tests check (q itself is llama.cpp's, above), and with a seed every drafter gives its tokens
# (below). What needs the statistics is the acceptance rule: once with a draft model's own
# distribution over the whole vocabulary (T = 1, no filters), once with prompt lookup's
# certain drafts under every filter (T = 0.7).
@pytest.mark.parametrize("case,drafter,k", [("T=1", "model", 3), ("T=0.7", "pld", 4)])
def test_strict_speculative_sampling_matches_plain_sampling(smol, smol_draft, case, drafter, k):
    text, settings = CASES[case]
    ids = smol.tokenize(text)
    expected = expected_pairs(smol, ids, settings)
    pairs, long_drafts = sample_pairs(smol, make_drafter(drafter, smol, smol_draft), Strict(), ids, k, settings)
    assert long_drafts > N // 4
    stat, df = chi_square(pairs, expected, N)
    assert df >= 3 and stat < critical(df), (stat, df)


def test_a_wrong_acceptance_rule_fails_the_same_test(smol):
    text, settings = CASES["T=1"]                 # the test has power: it rejects a wrong rule
    ids = smol.tokenize(text)
    expected = expected_pairs(smol, ids, settings)
    pairs, long_drafts = sample_pairs(smol, make_drafter("pld", smol), AcceptAll(), ids, 4, settings)
    assert long_drafts > 0
    stat, df = chi_square(pairs, expected, N)
    assert stat > critical(df)


SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)        # top-k 40 and min-p 0.05 as defaults


def test_seeded_strict_is_plain_sampling_for_every_drafter_and_draft_length(smol, smol_draft):
    """In exact mode, with a seed: strict gives plain sampling's tokens (no drafter, the same
    seed) for every drafter, at fixed draft lengths from 1 to 8 and with the adaptive length."""
    from flylocal.loader import build_engine
    from flylocal.settings import Settings

    ids = smol.tokenize(RAW)                 # a pattern: prompt lookup has something to propose

    def run(drafter, k, sampling=SEEDED):
        smol.reset()
        smol_draft.reset()
        engine = Engine(smol, make_drafter(drafter, smol, smol_draft, k_max=max(k, 1)), Strict(),
                        EngineConfig(max_tokens=40, k=k, sampling=sampling))
        return generate_all(engine, ids)[0]

    plain = run("none", 0)
    assert len(plain) > 10
    for drafter, ks in (("pld", (2, 8)), ("model", (1, 4)), ("mla", (3, 8))):
        for k in ks:
            assert run(drafter, k) == plain, (drafter, k)
    # Draft lengths chosen by the controller, on a given GPU-like cost model: on this machine's
    # own timings drafting may never pay, and then the comparison would prove nothing.
    from test_costs import gpu_like

    saved = smol.costs, smol_draft.costs
    try:
        smol.costs, smol_draft.costs = gpu_like()
        for drafter in ("pld", "model", "mla"):
            smol.reset()
            smol_draft.reset()
            engine = build_engine(Settings(drafter=drafter, verifier="strict", max_tokens=40, sampling=SEEDED),
                                  smol, smol_draft)
            tokens, stats, _ = generate_all(engine, ids)
            assert tokens == plain, drafter
            assert stats.drafted > 0, drafter
    finally:
        smol.costs, smol_draft.costs = saved
    assert run("none", 0, dataclasses.replace(SEEDED, seed=8)) != plain


@pytest.mark.slow
def test_the_same_command_twice_gives_the_same_tokens_even_under_load():
    """Each drafter and verifier, draft lengths adapting: the second run has a busy loop
    beside it, so its timings differ, and its tokens do not."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "flylocal", "generate", "Write a short story about a cat.", "--draft",
            "smollm2-135m-instruct-q4_0", "--temperature", "0.8", "--top-p", "0.95", "--seed", "7",
            "--max-tokens", "32", "--json", "--threads", "1"]
    busy = [sys.executable, "-c", "import time\nend = time.time() + 300\nwhile time.time() < end: pass"]
    # each drafter and each verifier once: what keeps tokens from timings (a position's
    # randomness from the seed and the position alone) is the engine's, shared by all of them
    for drafter, verifier in (("pld", "strict"), ("model", "fly"), ("mla", "asd")):
        args = base + ["--drafter", drafter, "--verifier", verifier]
        idle = subprocess.run(args, capture_output=True, text=True, timeout=300)
        load = subprocess.Popen(busy)
        try:
            loaded = subprocess.run(args, capture_output=True, text=True, timeout=300)
        finally:
            load.kill()
            load.wait()
        assert idle.returncode == 0 and loaded.returncode == 0, idle.stderr + loaded.stderr
        assert json.loads(idle.stdout)["tokens"] == json.loads(loaded.stdout)["tokens"], (drafter, verifier)
