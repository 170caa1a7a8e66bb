"""Drafts from another vocabulary on real models, both directions: SmolLM2 (49,152 tokens, BPE)
drafting for Gemma 3 (262,144 tokens, SentencePiece) at Q8_0, and Gemma drafting for SmolLM2.
Verification stays on target tokens, so strict must equal the target's plain greedy output
token for token (the batch-invariant build, conftest)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import GEMMA_Q8_0, SMOL, prompt
from flylocal.decoding.adaptive import Learned
from flylocal.decoding.drafters.text import TextBridge
from flylocal.decoding.engine import generate_all
from flylocal.errors import FlylocalError
from flylocal.loader import build_engine, encode_prompt, pair
from flylocal.settings import Settings

pytestmark = pytest.mark.slow     # every test here loads real models

COPY = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, melons. "
        "The list again: apples, pears, plums, cherries,")
ROUND_TRIP = ["Ünïcödé: e\u0301 a\u0308 (combining marks) 😀👍🏽 🇯🇵 日本語のテキスト 中文 한국어 — «quotes» …",
              "def f(x):\n\treturn x ** 2  # 🐍\n", "  leading spaces and trailing  ", "ﬁ ligature, Ω, ß, ẞ"]


@pytest.fixture(params=["gemma<-smol", "smol<-gemma"])
def pair_of(request, smol, gemma_q8):
    target, draft = (gemma_q8, smol) if request.param == "gemma<-smol" else (smol, gemma_q8)
    target.reset()
    draft.reset()
    return target, draft


def prompt_ids(target, text):
    return encode_prompt(target, text, raw=target.chat_template() is None)[0]


def run(target, draft, ids, drafter, k=None, through_text=True, verifier="strict", max_tokens=40):
    settings = Settings(drafter=drafter, k=k, verifier=verifier, max_tokens=max_tokens, trace=True)
    return generate_all(build_engine(settings, target, draft, through_text=through_text), ids)


def test_the_vocabularies_really_differ(smol, gemma_q8):
    """The rule refuses this pair under --draft-vocab same, and auto drafts through text."""
    with pytest.raises(FlylocalError, match="incompatible"):
        pair(gemma_q8, smol, "same", print)
    said = []
    assert pair(gemma_q8, smol, "auto", said.append) is True
    assert len(said) == 1 and "through text" in said[0]


@pytest.mark.parametrize("drafter", ["model", "mla"])
@pytest.mark.parametrize("text", [COPY, prompt("chat-sky")])
def test_strict_through_text_equals_plain_greedy(pair_of, drafter, text):
    target, draft = pair_of
    ids = prompt_ids(target, text)
    expected, _, _ = run(target, draft, ids, "none")
    for k in (None, 3):       # adaptive: the draft may never pay for itself here, and not be used
        tokens, stats, _ = run(target, draft, ids, drafter, k)
        assert tokens == expected, (drafter, k)
        assert stats.drafted > 0 or k is None


@pytest.mark.parametrize("drafter", ["model", "mla"])
def test_a_copy_heavy_prompt_is_accepted(pair_of, drafter):
    target, draft = pair_of
    _, stats, trace = run(target, draft, prompt_ids(target, COPY), drafter, k=6)
    assert stats.accepted > 0
    assert stats.mean_accepted_length > 1.5
    texts = [row["draft_text"] for row in trace if row["draft"]]
    assert texts and all(isinstance(t, str) for t in texts)
    # A round's draft is a target tokenization of a prefix of its draft text.
    for row in trace:
        if row["draft"]:
            assert row["draft_text"].startswith(target.detokenize(row["draft"]))


def test_loose_verifiers_decide_on_target_tokens(pair_of):
    """FLy and ASD run through text; with a budget of 0 ASD is strict."""
    from flylocal.decoding.verifiers import VerifierConfig
    from flylocal.decoding.verifiers.asd import AsdParams

    target, draft = pair_of
    ids = prompt_ids(target, prompt("chat-focus"))
    expected, _, _ = run(target, draft, ids, "none")
    settings = Settings(drafter="mla", k=4, verifier="asd", max_tokens=40,
                        verifiers=VerifierConfig(asd=AsdParams(budget=0.0)))
    tokens, _, _ = generate_all(build_engine(settings, target, draft, through_text=True), ids)
    assert tokens == expected
    tokens, stats, _ = run(target, draft, ids, "mla", k=6, verifier="fly")
    assert stats.emitted > 0 and len(tokens) == 40


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_text_round_trips_through_both_vocabularies(smol, gemma_q8, text):
    for target, draft in ((gemma_q8, smol), (smol, gemma_q8)):
        ids = target.tokenize(text, add_special=False)
        bridge = TextBridge(target, draft)
        d = bridge.sync(ids)
        assert draft.detokenize(d) == text
        # Token by token, as a generation commits them: the same ids in the end.
        fresh = TextBridge(target, draft)
        for n in range(1, len(ids) + 1):
            fresh.sync(ids[:n])
        assert fresh.sync(ids).tolist() == d.tolist()
        # Back: the draft's tokens of the text become target tokens of the same text, but the
        # last one, which more text could extend.
        proposal = TextBridge(target, draft).proposal(draft.tokenize(text, add_special=False))
        back = b"".join(target.piece(int(t)) for t in proposal.tokens)
        assert text.encode().startswith(back)
        assert len(back) >= len(text.encode()) - max(len(target.piece(int(t))) for t in ids)
        assert proposal.text == text


def test_the_command_line_drafts_through_text():
    """auto says so in one line; same refuses the pair in one line; a trace shows draft_text.
    The draft length is fixed: an adaptive one may rightly draft nothing in 12 tokens on a busy
    machine, where the cost model finds that drafting does not pay."""
    args = [sys.executable, "-m", "flylocal", "generate", "--target", GEMMA_Q8_0, "--draft", SMOL,
            "--drafter", "mla", "--verifier", "strict", "--k", "4", "--max-tokens", "12", "--raw", "--json", COPY]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "through text" in line]
    assert len(lines) == 1 and "different vocabularies" in lines[0]
    assert json.loads(done.stdout)["stats"]["drafted"] > 0
    refused = subprocess.run(args + ["--draft-vocab", "same"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert refused.stderr.count("\n") == 1 and "incompatible" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_same_vocabulary_pair_can_go_through_text(smol, smol_draft):
    """--draft-vocab translate on a pair that agrees: still exactly greedy."""
    smol.reset()
    smol_draft.reset()
    assert pair(smol, smol_draft, "auto", print) is False
    ids = prompt_ids(smol, prompt("typos-short"))
    expected, _, _ = run(smol, smol_draft, ids, "none")
    tokens, stats, trace = run(smol, smol_draft, ids, "mla", k=6)
    assert tokens == expected
    assert stats.accepted > 0
    assert any(row.get("draft_text") for row in trace)      # it did go through text


@pytest.mark.parametrize("drafter", ["model", "mla"])
def test_engines_through_text_keep_what_the_last_measured(smol, gemma_q8, drafter):
    """What a request measured of acceptance is kept for the next one through text too: the
    controllers the inner drafter decides with are the ones the last engine used."""
    target, draft = gemma_q8, smol
    target.reset()
    draft.reset()
    ids = prompt_ids(target, COPY)
    settings = Settings(drafter=drafter, verifier="strict", max_tokens=24)
    learned = Learned()
    first = build_engine(settings, target, draft, through_text=True, learned=learned)
    generate_all(first, ids)
    second = build_engine(settings, target, draft, through_text=True, learned=learned)
    inner_first, inner_second = first.drafter.drafter, second.drafter.drafter
    assert inner_second.plan is inner_first.plan and second.drafter.plan is inner_first.plan
    if drafter == "mla":
        assert inner_second.guess_length is inner_first.guess_length
    later, earlier = second.drafter.controllers(), first.drafter.controllers()
    assert later and all(c in earlier for c in later)


def test_a_draft_through_text_reads_the_window_its_prefill_pays_for(smol, gemma_q8):
    """On a GPU-like machine with a long prompt and a short answer, a draft model in another
    vocabulary reads a window of the context too (its first SINKS tokens, then its last ones, in
    its own tokens), and strict still equals plain decoding."""
    from flylocal.decoding.drafters.model import SINKS

    import test_costs

    text = "Summarize this text in one sentence. " + " ".join(
        f"Item {i}: the {w} crate holds {i * 7 % 13} apples and {i * 5 % 11} pears." for i, w in
        enumerate(["red", "blue", "green", "grey", "black", "white", "brown", "pink"] * 3))
    ids = prompt_ids(smol, text)
    saved = smol.costs, gemma_q8.costs
    try:
        smol.costs, gemma_q8.costs = test_costs.gpu_like()
        smol.reset()
        gemma_q8.reset()
        tokens, stats, _ = run(smol, gemma_q8, ids, "mla", max_tokens=8)
        expected, _, _ = generate_all(build_engine(Settings(drafter="none", max_tokens=8), smol, None), ids)
        assert tokens == expected
        given = stats.draft_context
        assert given["chosen"] == "window" and 32 <= given["pays_for"] == given["tokens"] - SINKS
        assert gemma_q8.n_past > given["tokens"]                 # it was asked after its window
    finally:
        smol.costs, gemma_q8.costs = saved
