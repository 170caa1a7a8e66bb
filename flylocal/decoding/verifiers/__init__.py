"""Verifiers: pure numpy functions that decide how much of a draft to commit.

A verifier is called once per round as

    decision = verifier(draft, target_argmax, logits)

with `draft` [k] int32, `target_argmax` [k+1] int32 (the target's greedy choice at each draft
position and at the bonus position) and `logits` [k+1, n_vocab] float32 (the target's raw
logits for exactly those rows). It returns a Decision. Verifiers know nothing of llama.cpp;
a verifier with state across rounds (a ledger) is a small object with `__call__` and `reset()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flylocal.decoding.verifiers.asd import Asd, AsdParams
from flylocal.decoding.verifiers.base import Decision, Verifier, emitted_tokens, native_prefix, regrets
from flylocal.decoding.verifiers.fly import Fly, FlyParams
from flylocal.decoding.verifiers.strict import strict

__all__ = ["Decision", "Verifier", "VerifierConfig", "emitted_tokens", "make_verifier", "native_prefix", "regrets"]


@dataclass(frozen=True)
class VerifierConfig:
    """The parameters of every verifier, so that a session can switch between them."""

    fly: FlyParams = field(default_factory=FlyParams)
    asd: AsdParams = field(default_factory=AsdParams)


def make_verifier(name: str, config: VerifierConfig = VerifierConfig()) -> Verifier:
    if name == "strict":
        return strict
    if name == "fly":
        return Fly(config.fly)
    if name == "asd":
        return Asd(config.asd)
    raise ValueError(f"unknown verifier {name}")


VERIFIERS = ("fly", "strict", "asd")
