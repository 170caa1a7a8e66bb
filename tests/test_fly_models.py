"""FLy on real models: SmolLM2-135M-Instruct as target, its Q4_0 requant as draft model."""

from __future__ import annotations


import pytest

from conftest import prompt
from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.fly import Fly, FlyParams
from flylocal.decoding.verifiers.strict import Strict
from flylocal.loader import encode_prompt

PROMPTS = {"summarise": prompt("summarise-report"), "reply": prompt("reply-email"), "chat": prompt("chat-focus")}


def generate(target, draft, verifier, ids, drafter="model", k=10, max_tokens=64):
    engine = Engine(target, make_drafter(drafter, target, draft), verifier,
                    EngineConfig(max_tokens=max_tokens, k=k, trace=True))
    return generate_all(engine, ids)


_STRICT: dict = {}


def strict_run(target, draft, name: str):
    """(prompt ids, tokens, stats) of strict with `generate`'s defaults on PROMPTS[name], run once
    per process: the FLy and ASD tests both compare with it."""
    if name not in _STRICT:
        ids, _ = encode_prompt(target, PROMPTS[name], raw=False)
        tokens, stats, _ = generate(target, draft, Strict(), ids)
        _STRICT[name] = ids, tokens, stats
    return _STRICT[name]


@pytest.mark.parametrize("name", PROMPTS)
def test_fly_accepts_longer_than_strict(smol, smol_draft, name):
    ids, _, s_strict = strict_run(smol, smol_draft, name)
    _, s_fly, _ = generate(smol, smol_draft, Fly(), ids)
    assert s_fly.loose > 0
    assert s_fly.mean_accepted_length > s_strict.mean_accepted_length


def check_round(row: dict, p: FlyParams) -> None:
    """Re-check one trace row against the FLy rule of docs/design.md, independently of the verifier."""
    d, a, L = row["draft"], row["target_argmax"], row["accepted"]
    k, W = len(d), p.window
    native = [d[j] == a[j] for j in range(k)]
    expected_loose = []
    for j in range(L):
        if native[j]:
            continue
        h = row["entropy"][j]
        assert h is not None and h >= p.entropy, f"loose position {j} below the gate: {row}"
        assert j + W < k and all(native[j + 1 : j + W]), f"loose position {j} without a clean window: {row}"
        expected_loose.append(j)
    assert row["loose"] == expected_loose
    if L < k:   # the rejected position is a mismatch that fails the gate or the window
        assert not native[L]
        window_ok = L + W < k and all(native[L + 1 : L + W])
        h = row["entropy"][L]
        assert not window_ok or (h is not None and h < p.entropy), f"position {L} should have been loose: {row}"
    assert row["emitted"] == d[:L] + [a[L]]
    for j in range(k):   # regret is the target's logit gap; 0 exactly at native matches
        assert (row["regret"][j] == 0) if native[j] else (row["regret"][j] >= 0)


@pytest.mark.parametrize("drafter", ["model", "mla"])
def test_every_traced_round_follows_the_rule(smol, smol_draft, drafter):
    ids, _ = encode_prompt(smol, PROMPTS["summarise"], raw=False)
    p = FlyParams()
    _, stats, trace = generate(smol, smol_draft, Fly(p), ids, drafter=drafter)
    assert stats.loose > 0 and len(trace) == stats.rounds
    for row in trace:
        check_round(row, p)


# θ = ∞ equals strict on the real models through the command line (test_cli.py,
# test_infinite_entropy_gate_is_strict), and over thousands of cases on the fast suite
# (test_engine_properties.py).
