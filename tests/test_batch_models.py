"""Several requests in one decode on real models (flylocal.decoding.batch over a Runtime with
several sequences; docs/serving.md, "Several requests in one decode").

Each sequence has cells of its own in llama.cpp (kv_unified off). Measured in the exact build,
a sequence's logits are then bit for bit the same whatever other sequences share its decode, so
strict requests run together equal their plain greedy runs alone, token for token, for every
drafter, and a rollback of one sequence leaves the others as they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SMOL, SMOL_Q4_0, model_path, prompt
from flylocal.decoding.batch import Batch
from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.engine import Engine, EngineConfig
from flylocal.decoding.verifiers.strict import Strict
from flylocal.loader import encode_prompt
from test_exact import plain

pytestmark = pytest.mark.slow

PROMPTS = ["typos-short", "poem-autumn", "qa-france", "typos-short"]


def runtime(name: str, n_seq: int, n_ctx: int = 1024):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    return Runtime(model_path(name), RuntimeConfig(n_ctx=n_ctx, n_seq=n_seq, n_threads=2))


@pytest.fixture(scope="module")
def smol4():
    rt = runtime(SMOL, 4)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def draft4():
    rt = runtime(SMOL_Q4_0, 4)
    yield rt
    rt.close()


def ids_of(target, name):
    return encode_prompt(target, prompt(name), raw=False)[0]


@pytest.mark.parametrize("drafter", ["none", "pld", "model", "mla"])
def test_strict_together_equals_plain_alone(smol, smol4, draft4, drafter):
    """Four strict requests joining at different rounds, one decode a round between them, each
    equal to its plain greedy run alone."""
    max_tokens = 48
    expected = [plain(smol, ids_of(smol, name), max_tokens=max_tokens) for name in PROMPTS]
    smol4.reset()
    draft4.reset()
    batch = Batch(smol4)
    gens, drafted, shared = {}, 0, 0
    arrivals = {0: [0, 1], 3: [2], 5: [3]}
    step = 0
    while step <= max(arrivals) or batch.members:
        for i in arrivals.get(step, []):
            ids = ids_of(smol4, PROMPTS[i])
            seq = batch.place(ids)
            view = smol4.sequence(seq)
            d = make_drafter(drafter, view, draft4.sequence(seq) if drafter in ("model", "mla") else None,
                             adaptive=drafter == "pld", k_max=6)
            engine = Engine(view, d, Strict(), EngineConfig(max_tokens=max_tokens, k=6))
            gens[i] = batch.join(seq, engine, ids)
        members = len(batch.members)
        batch.round()
        shared += members > 1
        step += 1
    for i, gen in gens.items():
        drafted += gen.stats.drafted
        assert gen.tokens == expected[i], f"request {i} ({PROMPTS[i]}) differs from its run alone"
    assert shared > 5
    if drafter != "none":
        assert drafted > 0


def test_a_rollback_is_the_sequence_s_own(smol, smol4):
    """Sequence 1 decodes and rolls back while sequence 0 holds a prompt: sequence 0's next
    logits are those of a fresh run, and sequence 1 after its rollback equals a fresh run too."""
    a, b = ids_of(smol4, "poem-autumn"), ids_of(smol4, "qa-france")
    smol4.reset()
    smol4.decode_batch([(0, a[:-1], None), (1, b, None)])
    smol4.decode_batch([(1, np.array([5, 6, 7, 8], dtype=np.int32), None)])
    smol4.sequence(1).truncate(len(b) - 3)
    out = smol4.decode_batch([(0, a[-1:], 0), (1, b[-3:], 2)])
    together = [out[0].copy(), out[1].copy()]
    smol.reset()
    smol.decode(a[:-1])
    alone_a = smol.decode(a[-1:], logits_from=0).copy()
    smol.reset()
    alone_b = smol.decode(b, logits_from=len(b) - 1).copy()
    assert np.array_equal(together[0], alone_a)
    assert np.array_equal(together[1], alone_b)
    assert smol4.cached(0).tolist() == a.tolist() and smol4.cached(1).tolist() == b.tolist()


def test_an_uneven_decode_gives_rows_in_batch_order(smol4):
    """llama.cpp runs an uneven decode as several computations (`split`); the rows come back
    in the order the parts were given."""
    from flylocal.llama.binding import llama_cpp

    smol4.reset()
    parts = [(0, np.array([1, 2, 3, 4, 5], dtype=np.int32), 0), (1, np.array([9], dtype=np.int32), 0),
             (3, np.array([7, 8], dtype=np.int32), 0)]
    out = smol4.decode_batch(parts)
    at = 0
    for (_, tokens, _), rows in zip(parts, out):
        for j in range(len(tokens)):
            ptr = llama_cpp.llama_get_logits_ith(smol4.context._ctx, at + j)
            row = np.ctypeslib.as_array(ptr, shape=(smol4.n_vocab,))
            assert np.array_equal(rows[j], row)
        at += len(tokens)
    assert smol4.split({0: 5, 1: 1, 3: 2}) == [2, 4, 2]


def test_a_unified_cache_keeps_sequences_apart(smol):
    """--kv-unified (one cache for every sequence): sequence 1 holding other text, and rolled
    back, changes nothing of sequence 0 beyond the numerics of summing attention in another
    order. A cell of one sequence seen by another would move the logits far more than that, and
    change their argmax."""
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=512, n_seq=2, kv_unified=True, n_threads=2))
    try:
        assert rt.split({0: 5, 1: 1}) == [6]               # one computation, however uneven
        a, b = ids_of(rt, "poem-autumn"), ids_of(rt, "qa-france")
        rt.decode_batch([(1, b, None), (0, a[:-1], None)])
        rt.decode_batch([(1, np.array([5, 6, 7, 8], dtype=np.int32), None)])
        rt.sequence(1).truncate(len(b) - 3)
        out = rt.decode_batch([(0, a[-1:], 0), (1, b[-3:], 2)])
        together = [out[0][0].copy(), out[1][0].copy()]
    finally:
        rt.close()
    smol.reset()
    smol.decode(a[:-1])
    alone_a = smol.decode(a[-1:], logits_from=0)[0].copy()
    smol.reset()
    alone_b = smol.decode(b, logits_from=len(b) - 1)[0].copy()
    for mine, alone in ((together[0], alone_a), (together[1], alone_b)):
        assert mine.argmax() == alone.argmax()
        assert np.abs(mine - alone).mean() < 0.25 and np.abs(mine - alone).max() < 2.0


def test_every_decode_stays_on_its_sequence_with_threads_auto(smol):
    """--threads auto steers the thread count on a round's decode: random decodes, rounds,
    rollbacks and shared decodes on random sequences leave every other sequence's cells and
    `past` as they were, and each sequence's next logits are those of a fresh run of its tokens."""
    import random

    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rng = random.Random(53)
    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=256, n_seq=3, n_threads=None))
    try:
        assert rt.thread_control is not None
        words = ids_of(rt, "poem-autumn").tolist()
        held = {s: [] for s in range(3)}

        def tokens(n):
            return np.array([rng.choice(words) for _ in range(n)], dtype=np.int32)

        for step in range(80):
            s = rng.randrange(3)
            op = rng.choice(["prompt", "round", "truncate", "shared"])
            touched = {s}
            room = 200 - len(held[s])
            if op == "prompt" and room > 40:           # a prompt: chunked without logits, then rows
                t = tokens(rng.randint(2, 40))
                rt.sequence(s).decode(t, logits_from=len(t) - 1)
                held[s] += t.tolist()
            elif op == "round" and room > 9:           # a round: [last, *draft], every row's logits
                t = tokens(rng.randint(1, 9))
                rt.sequence(s).decode(t, logits_from=0)
                held[s] += t.tolist()
            elif op == "truncate":
                keep = rng.randint(0, len(held[s]))
                rt.sequence(s).truncate(keep)
                held[s] = held[s][:keep]
            elif op == "shared":
                others = rng.sample(range(3), rng.randint(1, 3))
                parts = [(o, tokens(rng.randint(1, 5)), 0) for o in others if len(held[o]) < 190]
                touched = {o for o, _, _ in parts}
                rt.decode_batch(parts)
                for o, t, _ in parts:
                    held[o] += t.tolist()
            for o in range(3):
                where = f"step {step}, {op} on {sorted(touched)}: sequence {o}"
                assert rt.context.past[o] == len(held[o]), where
                assert rt.cached(o).tolist() == held[o], where
        for o in range(3):
            if not held[o]:
                continue
            nxt = np.array([words[o]], dtype=np.int32)
            mine = rt.sequence(o).decode(nxt, logits_from=0)[0].copy()
            smol.reset()
            smol.decode(np.array(held[o], dtype=np.int32))
            fresh = smol.decode(nxt, logits_from=0)[0]
            assert np.array_equal(mine, fresh), f"sequence {o}'s logits moved"
    finally:
        rt.close()
