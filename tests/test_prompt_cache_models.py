"""The prompt cache on real models in exact mode (flylocal/decoding/prompt_cache.py, docs/serving.md
"Prompt cache"): conversations taking turns on fewer slots than there are conversations, their
cells (the target's and the draft model's) kept, evicted to a disk tier and restored. Every
strict answer equals plain greedy decoding on a fresh context, bit for bit, for every drafter;
a restored sequence's logits equal a fresh decode's; a state is never loaded under another key.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import GEMMA_Q8_0, SMOL, SMOL_Q4_0, model_path
from flylocal.decoding.batch import Batch
from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.engine import Engine, EngineConfig
from flylocal.decoding.prompt_cache import PromptCache
from flylocal.decoding.verifiers.strict import Strict
from flylocal.decoding.prompt_files import Shelf, read, write
from test_exact import plain

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one or two sentences, plainly. "
          "The bakery opens at seven, sells rye, spelt and sourdough loaves, and closes on Mondays. ") * 2
TURNS = [["What time do you open?", "Do you sell spelt bread?", "Which day are you closed?"],
         ["Name a bread you sell.", "Is sourdough on the list?", "When can I come on Tuesday?"],
         ["Say hello in French.", "Now in German.", "And in Italian?"]]


def runtime(name: str, n_seq: int, n_ctx: int = 1024):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    return Runtime(model_path(name), RuntimeConfig(n_ctx=n_ctx, n_seq=n_seq, n_threads=2))


@pytest.fixture(scope="module")
def pair():
    target, draft = runtime(SMOL, 2), runtime(SMOL_Q4_0, 2)
    yield target, draft
    target.close()
    draft.close()


def converse(target, draft, drafter, cache, order, max_tokens=24):
    """Turns of the conversations in `order`, one at a time through a Batch with `cache`:
    [(prompt ids, Generation)]."""
    batch = Batch(target, cache=cache)
    history = {c: [{"role": "system", "content": SYSTEM}] for c in set(order)}
    turn = {c: 0 for c in set(order)}
    out = []
    for c in order:
        history[c].append({"role": "user", "content": TURNS[c][turn[c]]})
        turn[c] += 1
        ids = target.tokenize_chat(history[c])
        seq = batch.place(ids)
        view = target.sequence(seq)
        d = make_drafter(drafter, view, draft.sequence(seq) if drafter in ("model", "mla") else None,
                         adaptive=False, k_max=4)
        gen = batch.join(seq, Engine(view, d, Strict(), EngineConfig(max_tokens=max_tokens, k=4)), ids)
        while batch.members:
            batch.round()
        cache.prefilled(gen.stats.prompt_evaluated, gen.stats.prefill_s)
        history[c].append({"role": "assistant", "content": target.detokenize(gen.tokens)})
        out.append((ids, gen))
    return out


@pytest.mark.parametrize("drafter", ["none", "pld", "model", "mla"])
def test_strict_answers_after_keeps_evictions_and_restores_are_plain_greedy(smol, pair, drafter, tmp_path):
    """Three conversations on two slots, with room in memory for about one entry and a disk
    tier for the rest: entries are kept, moved to disk and restored (the draft's cells with the
    target's), and every answer is plain greedy decoding's."""
    target, draft = pair
    target.reset()
    draft.reset()
    models = [target, draft] if drafter in ("model", "mla") else [target]
    lines = []
    shelf = Shelf(tmp_path, 1 << 30, [m.state_key() for m in models], lines.append)
    cache = PromptCache(models, len(models) * 5 << 20, shelf, lines.append)    # about one entry
    order = [0, 1, 2, 0, 2, 1, 0, 1, 2]
    for ids, gen in converse(target, draft, drafter, cache, order):
        assert gen.tokens == plain(smol, ids, max_tokens=24)
    report = cache.report()
    assert report["hits"] >= 3 and report["disk_entries"] >= 1, (report, lines)
    assert any("restored" in line for line in lines) and any("to disk" in line for line in lines)


def test_a_restored_sequence_decodes_as_a_fresh_one(pair):
    """A state taken from sequence 0 and put into sequence 1 gives the next logits of a fresh
    decode of the same tokens, bit for bit; under a state of the wrong length nothing loads."""
    target, _ = pair
    target.reset()
    ids = target.tokenize_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    target.decode_batch([(0, ids, None)])
    data = target.state(0)
    assert target.restore(1, ids, data) and target.cached(1).tolist() == ids.tolist()
    again = target.decode_batch([(1, np.array([42], dtype=np.int32), 0)])[0].copy()
    target.reset()
    target.decode_batch([(0, ids, None)])
    fresh = target.decode_batch([(0, np.array([42], dtype=np.int32), 0)])[0].copy()
    assert np.array_equal(again, fresh)
    assert not target.restore(1, ids[:-1], data) and len(target.cached(1)) == 0
    assert not target.restore(1, ids, data[: len(data) // 2]) and len(target.cached(1)) == 0


def test_a_sliding_window_model_s_state_round_trips(tmp_path):
    """Gemma 3 keeps a sliding-window cache beside the full one: its state, written to disk and
    read back, restores a sequence whose next logits are a fresh decode's."""
    rt = runtime(GEMMA_Q8_0, 2, n_ctx=2048)
    try:
        ids = rt.tokenize("The history of bread begins with flatbreads baked on hot stones. " * 50)
        assert len(ids) > 600                       # past Gemma 3's 512-token window
        rt.decode_batch([(0, ids[:500], None)])
        rt.decode_batch([(0, ids[500:], None)])
        path = tmp_path / "gemma.prompt"
        write(path, [rt.state_key()], [ids], [rt.state(0)])
        tokens, data = read(path, [rt.state_key()])
        assert rt.restore(1, tokens[0], data[0])
        again = rt.decode_batch([(1, np.array([7], dtype=np.int32), 0)])[0].copy()
        rt.reset()
        rt.decode(ids)
        fresh = rt.decode(np.array([7], dtype=np.int32), logits_from=0).copy()
        assert np.array_equal(again, fresh)
    finally:
        rt.close()


def test_quantized_key_cells_shrink_an_entry_and_keep_strict_lossless():
    """--cache-type-k q8_0 in exact mode: an entry takes less memory than with f16 cells, and
    strict with prompt lookup still gives plain greedy decoding's tokens on the same cells (a
    cell is quantized alone, whatever its batch); a quantized V cache, which needs flash
    attention, is refused in one line in exact mode."""
    from flylocal.errors import FlylocalError
    from flylocal.llama.runtime import Runtime, RuntimeConfig
    from test_exact import run

    f16 = runtime(SMOL, 1)
    try:
        ids = f16.tokenize_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
        f16.decode(ids)
        full = len(f16.state(0))
    finally:
        f16.close()
    rt = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=1024, n_threads=2, type_k="q8_0"))
    try:
        rt.decode(ids)
        assert len(rt.state(0)) < 0.8 * full
        assert rt.state_key()["type_k"] == "q8_0"
        tokens, stats, _ = run(rt, "pld", ids, k=6, max_tokens=48)
        assert stats.drafted > 0 and tokens == plain(rt, ids, max_tokens=48)
    finally:
        rt.close()
    with pytest.raises(FlylocalError, match="--cache-type-v q8_0 needs flash attention, which exact mode turns off"):
        Runtime(model_path(SMOL), RuntimeConfig(n_ctx=1024, n_threads=2, type_v="q8_0"))
