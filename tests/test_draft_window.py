"""--draft-window on the fake backend (docs/design.md, "The draft window"): what the draft
model's cache keeps as the context grows, after the rollbacks of every round and after a restore
that held another view, and that strict stays lossless whatever the draft sees.

The fake draft's logits hash its whole cache, so a draft that reads a window really drafts
differently from one that reads everything: its drafts are rejected more often, never wrongly
accepted."""

from __future__ import annotations

import numpy as np
import pytest

from fake_backend import FakeLM, FakeTarget, fixed_costs, greedy
from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.drafters.model import SINKS
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.strict import Strict

LM = FakeLM(seed=7, n_vocab=12, eog=(), p_flat=0.2, p_peaked=0.6)     # repetitive: lookup and drafts hit


def watched(drafter, draft: FakeTarget, w: int | None, seen: list):
    """Check after every proposal the draft model made what its cache holds: the context's first
    SINKS tokens, then a stretch of the context from the drafter's offset (and the draft after
    it), never more than the sinks, 1.25 W and the round's k."""
    propose = drafter.propose

    def checked(context, k):
        out = propose(context, k)
        held = draft.tokens
        if draft.n_past and out.source != "pld":          # the draft model read this context
            if w is not None:
                assert len(held) <= SINKS + w + w // 4 + k + 1
            view = context if drafter.offset <= SINKS else np.concatenate([context[:SINKS], context[drafter.offset:]])
            shared = min(len(held), len(view))
            assert held[:shared].tolist() == view[:shared].tolist()
        seen.append((len(context), drafter.offset, draft.n_past))
        return out

    drafter.propose = checked


def run(name: str, prompt, w: int | None, *, k: int | None = 6, max_tokens: int = 300, shift: bool = True,
        draft: FakeTarget | None = None, target: FakeTarget | None = None):
    target = target or FakeTarget(LM, n_ctx=2048)
    draft = draft or FakeTarget(LM, n_ctx=2048)
    draft.can_shift = shift
    if k is None:
        target.costs, draft.costs = fixed_costs(0.0), fixed_costs(0.0, single=0.0005)   # drafts pay
    drafter = make_drafter(name, target, draft, k_max=8, adaptive=k is None, p_min=0.0, window=w)
    seen: list = []
    watched(drafter, draft, w, seen)
    engine = Engine(target, drafter, Strict(), EngineConfig(max_tokens=max_tokens, k=8 if k is None else k))
    tokens, stats, _ = generate_all(engine, prompt)
    return tokens, stats, drafter, draft, seen


PROMPT = np.random.default_rng(3).integers(1, LM.n_vocab, size=400).astype(np.int32)


@pytest.mark.parametrize("name", ["model", "mla"])
@pytest.mark.parametrize("w", [8, 64, None])
@pytest.mark.parametrize("k", [6, None])
def test_strict_is_lossless_whatever_the_window(name, w, k):
    expected, _ = greedy(LM, PROMPT, 300, 2048)
    tokens, stats, drafter, draft, seen = run(name, PROMPT, w, k=k)
    assert tokens == expected
    assert stats.drafted > 0
    if w is None:
        assert drafter.slid == 0 and draft.dropped == 0
    else:
        assert drafter.slid > 0 and draft.dropped > 0


@pytest.mark.parametrize("name", ["model", "mla"])
def test_the_window_moves_on_without_evaluating_again(name):
    """With positions that move, a window that moves on evaluates each context token at most once:
    the draft evaluates about the prompt's window and the answer, not the prompt again. Without,
    each move evaluates the window again, and the output is the same."""
    w = 32
    tokens, stats, drafter, draft, seen = run(name, PROMPT, w)
    evaluated = draft.evaluated
    assert drafter.offset > len(PROMPT) - 2 * w                     # it kept up with the context
    fallback = run(name, PROMPT, w, shift=False)
    assert fallback[0] == tokens and fallback[3].dropped == 0
    assert fallback[3].evaluated > evaluated + w                      # each move read the window again


def test_the_prefill_covers_only_the_window():
    """A long prompt's first draft evaluates the sinks and the last W tokens, not the prompt."""
    w = 16
    _, _, drafter, draft, seen = run("model", PROMPT, w, max_tokens=4)
    first_len, first_offset, first_held = seen[0]
    assert first_offset == len(PROMPT) - w
    assert first_held <= SINKS + w + 8
    assert draft.evaluated < SINKS + w + 4 * 30


def test_a_cache_that_held_another_view_is_caught_up():
    """A restore (the prompt cache) or another request may leave the draft holding another view of
    the context: it keeps what still matches its view (at least the sinks) and evaluates the rest;
    the output stays the target's."""
    w = 32
    draft = FakeTarget(LM, n_ctx=2048)
    draft.decode(PROMPT[:300])                       # the whole of an earlier, shorter context
    expected, _ = greedy(LM, PROMPT, 120, 2048)
    tokens, _, drafter, draft, seen = run("mla", PROMPT, w, max_tokens=120, draft=draft)
    assert tokens == expected
    assert drafter.offset > SINKS and draft.tokens[:SINKS].tolist() == PROMPT[:SINKS].tolist()
    # the next request of the conversation: the context goes on, and the window with it
    longer = np.concatenate([PROMPT, np.asarray(tokens, dtype=np.int32)])
    again, _, drafter2, draft2, _ = run("mla", longer, w, max_tokens=60, draft=draft)
    assert again == greedy(LM, longer, 60, 2048)[0]
    assert draft2.n_past <= SINKS + w + w // 4 + 9


# ---------------------------------------------------------------- the real cache

def positions(rt) -> tuple[int, int]:
    from flylocal.llama.binding import llama_cpp

    mem = rt.context._mem
    return llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)


@pytest.mark.slow                                   # real models (by name: conftest marks fixtures it sees)
@pytest.mark.parametrize("model", ["smol", "gemma_q8"])
def test_drop_removes_a_range_and_moves_the_rest_back(model, request):
    """Context.drop on llama.cpp's cache (Gemma's has a sliding-window part too): the tokens and
    the positions are those of the kept tokens held from 0, the next decode goes on from there,
    and dropping the last cells is a rollback, bit for bit."""
    rt = request.getfixturevalue(model)
    ids = rt.tokenize("The lighthouse keeper wrote in his book every night. " * 40)[:400]
    rt.reset()
    rt.decode(ids[:-1])
    assert rt.drop(SINKS, 250) is True
    kept = np.concatenate([ids[:SINKS], ids[SINKS + 250 : -1]])
    assert rt.n_past == len(kept) and rt.tokens.tolist() == kept.tolist()
    assert positions(rt) == (0, len(kept) - 1)
    assert rt.decode(ids[-1:], logits_from=0).shape[0] == 1 and positions(rt) == (0, len(kept))
    rt.reset()
    rt.decode(ids[:300])
    rt.drop(200, 100)
    after_drop = rt.decode(ids[300:310], logits_from=0).copy()
    rt.reset()
    rt.decode(ids[:200])
    assert after_drop.tobytes() == rt.decode(ids[300:310], logits_from=0).tobytes()


def test_the_prefill_never_delays_the_first_token_and_comes_a_chunk_a_round():
    """A draft model's prefill (here the whole of a 1,500-token prompt, which pays on this cheap
    draft) is not evaluated before the request's first token: the first round drafts with prompt
    lookup; from the second the draft reads CHUNK tokens a round, lookup drafting meanwhile, then
    drafts itself. Strict equals greedy throughout."""
    from flylocal.decoding.drafters.model import CHUNK

    prompt = np.random.default_rng(5).integers(1, LM.n_vocab, size=1500).astype(np.int32)
    target, draft = FakeTarget(LM, n_ctx=4096), FakeTarget(LM, n_ctx=4096)
    target.costs, draft.costs = fixed_costs(0.0), fixed_costs(0.0, single=0.0005)
    drafter = make_drafter("model", target, draft, k_max=8, adaptive=True, p_min=0.0)
    rounds = []
    propose = drafter.propose

    def counted(context, k):
        before = draft.evaluated
        out = propose(context, k)
        rounds.append((out.source, draft.evaluated - before))
        return out

    drafter.propose = counted
    engine = Engine(target, drafter, Strict(), EngineConfig(max_tokens=120, k=8))
    tokens, stats, _ = generate_all(engine, prompt)
    assert tokens == greedy(LM, prompt, 120, 4096)[0]
    assert rounds[0] == ("pld", 0)                                     # nothing before the first token
    first_model = next(i for i, (source, _) in enumerate(rounds) if source == "model")
    assert first_model >= -(-(len(prompt) - 1 - 16) // CHUNK)          # the prefill took its rounds
    assert all(n <= CHUNK for _, n in rounds[1:first_model])          # ... a chunk each
    assert stats.draft_context["chosen"] == "full" and stats.draft_context["evaluated"] >= len(prompt) - 17


@pytest.mark.parametrize("again", [True, False])
def test_a_request_on_lookup_alone_weighs_the_draft_again_on_its_own_rounds(monkeypatch, again):
    """Earlier requests' rounds say prompt lookup alone gave 10x (as much as any draft): the
    draft model's prefill would save nothing, so the request starts on lookup alone. After
    REFIT rounds in which lookup gave this request little, the prefill is weighed again on
    them, for the budget left, and pays: the model reads the context and drafts. Without the
    second weighing it is never asked. Strict equals greedy either way."""
    from flylocal.decoding.drafters import model

    if not again:
        monkeypatch.setattr(model, "REFIT", 10**9)
    prompt = np.random.default_rng(5).integers(1, LM.n_vocab, size=400).astype(np.int32)
    target, draft = FakeTarget(LM, n_ctx=4096), FakeTarget(LM, n_ctx=4096)
    target.costs, draft.costs = fixed_costs(0.0), fixed_costs(0.0, single=0.0005)
    drafter = make_drafter("model", target, draft, k_max=8, adaptive=True, p_min=0.0)
    drafter.plan.lookups = [10.0] * 64
    sources = []
    propose = drafter.propose
    drafter.propose = lambda context, k: _noted(propose(context, k), sources)
    tokens, stats, _ = generate_all(Engine(target, drafter, Strict(), EngineConfig(max_tokens=120, k=8)), prompt)
    assert tokens == greedy(LM, prompt, 120, 4096)[0]
    given = stats.draft_context
    if again:
        assert given["after"] == model.REFIT and given["chosen"] == "full" and given["evaluated"] >= 400 - 17
        assert set(sources[: model.REFIT + 1]) == {"pld"} and "model" in sources
        assert max(drafter.own) < 10.0
    else:
        assert given["chosen"] == "lookup" and given["pays_for"] == 0 and draft.n_past == 0
        assert "model" not in sources


def _noted(draft, sources: list):
    sources.append(draft.source)
    return draft
