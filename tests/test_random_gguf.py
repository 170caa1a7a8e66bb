"""scripts/random_gguf.py on real llama.cpp: a model of a given shape whose greedy next token is
a known cycle, and draft models built to agree with it on a share p of tokens, which strict
decoding then accepts token by token with probability p (the device check's speed-ups at a set
acceptance rest on this)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import random_gguf as R  # noqa: E402

VOCAB = R.SHAPES["tiny"][5]
AGREE = 0.7


def runtime(path, n_ctx: int):
    from flylocal.llama.runtime import Runtime, RuntimeConfig     # llama.cpp: the slow tests only

    return Runtime(path, RuntimeConfig(n_ctx=n_ctx))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("successor")
    R.write(str(folder / "target.gguf"), "tiny", "Q8_0", seed=3)
    R.write(str(folder / "draft.gguf"), "tiny", "Q4_1", seed=3, agree=AGREE)
    target, draft = runtime(folder / "target.gguf", 1024), runtime(folder / "draft.gguf", 1024)
    yield target, draft
    target.close()
    draft.close()


@pytest.mark.slow
def test_greedy_decoding_follows_the_cycle_from_any_prompt(models):
    target, _ = models
    nxt = R.successor(VOCAB, 3, None)
    ids = target.tokenize("Write a short poem about the sea, then explain it.")
    logits = target.decode(ids, logits_from=0)
    assert np.array_equal(logits.argmax(axis=1), nxt[ids])        # byte, control and word tokens alike
    token = int(logits[-1].argmax())
    for _ in range(64):
        nxt_id = int(target.decode(np.array([token], dtype=np.int32), logits_from=0)[0].argmax())
        assert nxt_id == nxt[token] and nxt_id >= R.FIRST          # never a control token: no end
        token = nxt_id
    target.reset()


def test_a_draft_agrees_on_its_share_and_nowhere_else():
    target, draft = R.successor(VOCAB, 3, None), R.successor(VOCAB, 3, AGREE)
    same = draft[R.FIRST:] == target[R.FIRST:]
    assert abs(same.mean() - AGREE) < 0.03
    assert len(set(draft[R.FIRST:])) == VOCAB - R.FIRST        # still a permutation: no two share a next
    assert np.array_equal(R.successor(VOCAB, 3, 1.0), target) and not (R.successor(VOCAB, 3, 0.0)[R.FIRST:]
                                                                        == target[R.FIRST:]).any()


@pytest.mark.slow
def test_strict_accepts_each_drafted_token_with_the_agreed_probability(models):
    from flylocal.decoding.drafters import make_drafter
    from flylocal.decoding.engine import Engine, EngineConfig, generate_all
    from flylocal.decoding.verifiers.strict import Strict

    target, draft = models
    ids = target.tokenize("Question: what is the capital of France?\nAnswer:")
    engine = Engine(target, make_drafter("model", target, draft), Strict(), EngineConfig(max_tokens=400, k=1))
    tokens, stats, _ = generate_all(engine, ids)
    nxt = R.successor(VOCAB, 3, None)
    chain = [int(nxt[ids[-1]])]
    while len(chain) < len(tokens):
        chain.append(int(nxt[chain[-1]]))
    assert list(tokens) == chain                                   # strict: the target's own greedy text
    rate = stats.accepted / stats.drafted
    assert stats.drafted > 200 and abs(rate - AGREE) < 0.1, (stats.accepted, stats.drafted)


@pytest.mark.slow
def test_text_takes_about_as_many_tokens_as_a_real_vocabulary_gives(tmp_path):
    R.write(str(tmp_path / "m.gguf"), "tiny", "Q8_0", vocab=49152)          # SmolLM2's vocabulary size
    text = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    with runtime(tmp_path / "m.gguf", 256) as rt:
        tokens = rt.tokenize(text, add_special=False)
        assert len(tokens) <= 1.6 * len(text.split()) and rt.detokenize(tokens).strip() == text


@pytest.mark.parametrize("args, says", [(["--agree", "1.5"], "--agree is a share between 0 and 1"),
                                        (["--shape", "smollm2", "--type", "Q4_K_M"], "take no K-quant"),
                                        (["--vocab", "10"], "--vocab must exceed")])
def test_bad_arguments_get_one_line(tmp_path, args, says):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "random_gguf.py"), str(tmp_path / "x.gguf"), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.gguf").exists()
