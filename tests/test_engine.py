"""The round loop at the context's end, on real models: every drafter stops cleanly there.

The target's context holds the prompt and everything generated; a round verifies k+1 rows and
commits up to k+1 tokens, and the draft model keeps a cache of its own. Where those meet the
end of the context, generation must stop with `stop: context`, and strict must still equal
plain greedy decoding up to that point.
"""

from __future__ import annotations

import pytest

from conftest import SMOL, SMOL_Q4_0, model_path
from flylocal.decoding.engine import generate_all
from flylocal.loader import build_engine
from flylocal.settings import Settings
from test_costs import gpu_like

pytestmark = pytest.mark.slow     # every test here loads a real model

TEXT = "one two three four five six seven eight nine ten " * 8   # prompt lookup always has a match


# One context size: the fast suite covers every prompt and draft length on an in-memory target.
@pytest.fixture(scope="module", params=[57])
def small_ctx(request):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    n_ctx = request.param
    target = Runtime(model_path(SMOL), RuntimeConfig(n_ctx=n_ctx))
    draft = Runtime(model_path(SMOL_Q4_0), RuntimeConfig(n_ctx=n_ctx))
    # Costs given by hand: a context this small is a cache key of its own, and measuring it is
    # not what these tests are about; on a GPU-like curve the model drafters use the model.
    target.costs, draft.costs = gpu_like()
    yield n_ctx, target, draft
    draft.close()
    target.close()


def run(target, draft, prompt, drafter, k, verifier="strict"):
    target.reset()
    draft.reset()
    settings = Settings(drafter=drafter, draft=SMOL_Q4_0, k=k, verifier=verifier, max_tokens=1000)
    return generate_all(build_engine(settings, target, draft), prompt)


@pytest.mark.parametrize("drafter", ["none", "pld", "model", "mla"])
def test_every_drafter_stops_at_the_context_end(small_ctx, drafter):
    """Over prompt lengths up to ctx-1 and draft lengths up to 10: the output fills the context
    exactly, stops with `context`, and (strict) equals plain decoding's."""
    n_ctx, target, draft = small_ctx
    ids = target.tokenize(TEXT)
    assert len(ids) > n_ctx
    # The fast suite checks the context end over thousands of prompt and draft lengths on an
    # in-memory target (tests/test_engine_properties.py); here the real caches meet it: room
    # for one token, for fewer than a draft, and for more.
    for length in (n_ctx - 1, n_ctx - 7, n_ctx - 16):
        prompt = ids[:length]
        expected, _, _ = run(target, draft, prompt, "none", 0)
        for k in (1, 10):
            tokens, stats, _ = run(target, draft, prompt, drafter, k)
            assert (stats.stop, length + len(tokens)) == ("context", n_ctx), (length, k)
            assert tokens == expected, (length, k)
            if drafter != "none" and length <= n_ctx - 7:
                assert stats.drafted > 0, (length, k)


def test_loose_verifiers_stop_at_the_context_end_too(small_ctx):
    n_ctx, target, draft = small_ctx
    prompt = target.tokenize(TEXT)[: n_ctx - 12]
    for verifier in ("fly", "asd"):
        for drafter in ("pld", "mla"):
            tokens, stats, _ = run(target, draft, prompt, drafter, 10, verifier=verifier)
            assert stats.stop == "context" and len(prompt) + len(tokens) == n_ctx
            assert stats.drafted > 0 and stats.accepted > 0
