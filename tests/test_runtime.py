"""The runtime on real models: rows-only logits, rollback equal to a fresh run, text."""

from __future__ import annotations

import numpy as np
import pytest

from flylocal.errors import FlylocalError

TEXT = "Once upon a time, in a small village by the sea, there lived an old fisherman who "


def fresh_logits(rt, tokens):
    rt.reset()
    rt.decode(tokens[:-1])
    return rt.decode(tokens[-1:], logits_from=0)[0].copy()


@pytest.mark.parametrize("fixture", ["smol", "gemma_q8"])
def test_rollback_equals_fresh_run(request, fixture):
    rt = request.getfixturevalue(fixture)
    ids = rt.tokenize(TEXT * (12 if fixture == "gemma_q8" else 2))   # gemma: past its 512-token window
    expected = fresh_logits(rt, ids)
    rt.reset()
    rt.decode(ids[:-1])
    junk = np.array([ids[5], ids[9], ids[3], ids[7]] * 4, dtype=np.int32)
    rt.decode(junk, logits_from=0)
    rt.truncate(len(ids) - 1)
    assert rt.n_past == len(ids) - 1
    got = rt.decode(ids[-1:], logits_from=0)[0]
    assert np.array_equal(got, expected)


def test_refused_partial_removal_falls_back_to_reevaluation(smol, monkeypatch):
    ids = smol.tokenize(TEXT)
    expected = fresh_logits(smol, ids)
    smol.reset()
    smol.decode(ids[:-1])
    smol.decode(ids[:6], logits_from=0)
    # llama.cpp refuses partial removal for memory it cannot roll back (recurrent models).
    monkeypatch.setattr(smol, "_seq_rm", lambda n_keep: False)
    smol.truncate(len(ids) - 1)
    monkeypatch.undo()
    assert smol.tokens.tolist() == ids[:-1].tolist()
    assert np.array_equal(smol.decode(ids[-1:], logits_from=0)[0], expected)


def test_logits_only_for_requested_rows_are_views(smol):
    ids = smol.tokenize(TEXT)
    smol.reset()
    rows = smol.decode(ids, logits_from=len(ids) - 3)
    assert rows.shape == (3, smol.n_vocab) and rows.dtype == np.float32
    assert not rows.flags.owndata           # a view of llama.cpp's buffer, no copy
    assert smol.decode(ids[:2]) is None     # no rows asked, none returned
    assert smol.n_past == len(ids) + 2


def test_batched_rows_equal_single_rows(smol):
    """The CPU build is batch-invariant for this model, also past 256 cache cells: the premise
    of the exact strict tests."""
    from flylocal.doctor import batch_invariance

    delta, flips, rows = batch_invariance(smol)
    assert (delta, flips, rows) == (0.0, 0, 32)


def test_invariance_probe_detects_a_non_invariant_setting():
    """The probe can fail: with llama.cpp's CPU flash attention, batched logits differ."""
    from conftest import SMOL, model_path
    from flylocal.doctor import batch_invariance
    from flylocal.runtime import Runtime, RuntimeConfig

    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=1024, flash_attn="on")) as rt:
        delta, _, _ = batch_invariance(rt)
    assert delta > 0.0


def test_reuse_prefix_keeps_the_shared_part(smol):
    ids = smol.tokenize(TEXT)
    smol.reset()
    smol.decode(ids)
    other = np.concatenate([ids[:10], [ids[0]] * 3]).astype(np.int32)
    assert smol.reuse_prefix(other) == 10
    assert smol.n_past == 10
    assert smol.reuse_prefix(ids[:10]) == 9     # the last token is always left to decode


def test_context_overflow_is_an_error(smol):
    smol.reset()
    with pytest.raises(FlylocalError, match="context full"):
        smol.decode(np.zeros(smol.n_ctx + 1, dtype=np.int32))
    assert smol.n_past == 0


def test_tokenize_detokenize_multibyte(smol):
    text = "naïve café — 東京 ☃ 🙂"
    ids = smol.tokenize(text, add_special=False)
    assert smol.detokenize(ids) == text
    from flylocal.cli import TextStream

    stream = TextStream(smol)
    pieces = [stream.feed([t]) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)   # no broken characters on the way


def test_chat_template_and_special_tokens(smol, gemma_q8):
    rendered = smol.format_chat([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = smol.tokenize(rendered)
    assert smol.is_eog(int(smol.tokenize("<|im_end|>", add_special=False)[0]))
    assert smol.detokenize(ids, special=True) == rendered
    assert gemma_q8.format_chat([{"role": "user", "content": "hi"}]) is None   # base model
    g = gemma_q8.tokenize("hello")
    assert g[0] == gemma_q8.bos and g[1] != gemma_q8.bos


def test_target_nll_equals_stepwise_log_softmax(smol):
    from flylocal.quality import target_nll

    prompt = smol.tokenize("The capital of France is")
    output = smol.tokenize(" Paris, a city on the Seine.", add_special=False)
    smol.reset()
    expected = []
    smol.decode(prompt[:-1])
    seq = np.concatenate([prompt, output])
    for i in range(len(prompt) - 1, len(seq) - 1):
        z = smol.decode(seq[i : i + 1], logits_from=0)[0].astype(np.float64)
        expected.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[seq[i + 1]])
    assert target_nll(smol, prompt, output) == pytest.approx(float(np.mean(expected)), rel=1e-5)
    assert target_nll(smol, prompt, []) == 0.0
