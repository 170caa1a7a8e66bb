"""ASD on real models: SmolLM2-135M-Instruct as target, its Q4_0 requant as draft model."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import prompt
from flylocal.decoding.contracts import Draft, Drafter
from flylocal.decoding.engine import Engine, EngineConfig, generate_all
from flylocal.decoding.verifiers.asd import Asd, AsdParams
from flylocal.decoding.verifiers.strict import Strict
from flylocal.loader import encode_prompt
from test_fly_models import PROMPTS, generate, strict_run


def test_defaults_accept_at_least_as_long_as_strict(smol, smol_draft):
    longer = 0
    for name in PROMPTS:
        ids, _, s_strict = strict_run(smol, smol_draft, name)
        _, s_asd, _ = generate(smol, smol_draft, Asd(), ids)
        assert s_asd.mean_accepted_length >= s_strict.mean_accepted_length
        longer += s_asd.mean_accepted_length > s_strict.mean_accepted_length
    assert longer >= 1          # on some prompt (which, a machine's numerics decide)


def test_zero_budget_equals_strict(smol, smol_draft):
    ids, expected, _ = strict_run(smol, smol_draft, "chat")
    tokens, stats, _ = generate(smol, smol_draft, Asd(AsdParams(gate=10.0, cap=10, budget=0.0)), ids)
    assert tokens == expected and stats.loose == 0 and stats.budget_spent == 0.0
    # the same gate and cap with a budget accept mismatches wherever they come: B = 0 is what
    # makes it strict (that a budget spends is built, not hoped for: the Replay cases below)
    loose, control, _ = generate(smol, smol_draft, Asd(AsdParams(gate=10.0, cap=10, budget=4.0)), ids)
    assert (control.loose > 0) == (loose != expected)


@pytest.mark.parametrize("drafter", ["model", "mla"])
def test_every_traced_round_follows_the_rule_and_the_ledger_stays_within_budget(smol, smol_draft, drafter):
    p = AsdParams(gate=0.5, cap=2, budget=6.0)
    ids, _ = encode_prompt(smol, PROMPTS["reply"], raw=False)
    _, stats, trace = generate(smol, smol_draft, Asd(p), ids, drafter=drafter, max_tokens=96)
    spent = 0.0
    for row in trace:
        d, a, r, L = row["draft"], row["target_argmax"], row["regret"], row["accepted"]
        k = len(d)
        feasible = []
        exceptions, cost = 0, 0.0
        for j in range(k):
            native = d[j] == a[j]
            assert (r[j] == 0) if native else (r[j] >= 0)
            exceptions += not native
            cost += r[j]
            gate = native or r[j] / (k - j) <= p.gate
            budget = cost <= p.budget - spent + 1e-9 and (native or p.budget - spent > 0)
            feasible.append(gate and exceptions <= p.cap and budget)
        expected_L = next((j for j, f in enumerate(feasible) if not f), k)
        assert L == expected_L, row
        assert row["loose"] == [j for j in range(L) if d[j] != a[j]]
        assert row["emitted"] == d[:L] + [a[L]]
        # only committed draft tokens are charged: an end-of-generation token cuts the rest
        eog = next((i for i, t in enumerate(row["emitted"]) if smol.is_eog(t)), None)
        spent += sum(r[: L if eog is None else min(L, eog + 1)])
        assert row["budget_spent"] == pytest.approx(spent, abs=1e-6)
        assert row["budget_spent"] <= p.budget + 1e-9
        assert row["budget_left"] == pytest.approx(p.budget - spent, abs=1e-6)
    assert stats.budget_spent == pytest.approx(spent, abs=1e-6)


class Replay(Drafter):
    """A drafter that proposes a fixed continuation of the prompt."""

    name = "replay"

    def __init__(self, prompt_len: int, tokens: list[int]):
        self.prompt_len, self.tokens = prompt_len, tokens

    def propose(self, context, k):
        done = len(context) - self.prompt_len
        return Draft(np.asarray(self.tokens[done : done + k], dtype=np.int32))


def test_regret_after_an_end_of_generation_token_is_not_charged(smol):
    """ASD accepts the whole draft, but the answer ends at the end-of-generation token inside
    it: the mismatches drafted after that token are never committed, so they cost nothing."""
    ids, _ = encode_prompt(smol, prompt("qa-france"), raw=False)
    answer, _, plain_trace = generate(smol, None, Strict(), ids, drafter="none", k=0)
    eog = plain_trace[-1]["emitted"][-1]
    assert smol.is_eog(eog)
    junk = [100, 200, 300]
    draft = answer + [eog] + junk
    verifier = Asd(AsdParams(gate=1e9, cap=100, budget=1e9))       # every position is feasible
    engine = Engine(smol, Replay(len(ids), draft), verifier,
                    EngineConfig(max_tokens=64, k=len(draft), trace=True))
    tokens, stats, trace = generate_all(engine, ids)
    assert tokens == answer and stats.stop == "eog" and stats.rounds == 1
    assert trace[0]["accepted"] == len(draft)                       # the junk was accepted ...
    assert min(trace[0]["regret"][-len(junk):]) > 0                 # ... at a real regret ...
    assert verifier.spent == 0.0 and stats.budget_spent == 0.0      # ... but never committed
