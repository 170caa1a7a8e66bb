"""Verifiers: how much of a draft to commit (docs/verifiers.md).

Each rule is a pure numpy function of the round's arrays (`strict`, `fly`, `asd`), testable with
a few hand-written numbers and knowing nothing of llama.cpp, and a small `Verifier` object
(flylocal.decoding.contracts) around it: `Strict`, `Fly`, and `Asd`, which keeps its ledger
across rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flylocal.decoding.contracts import Verifier
from flylocal.decoding.verifiers.asd import Asd, AsdParams
from flylocal.decoding.verifiers.fly import Fly, FlyParams
from flylocal.decoding.verifiers.strict import Strict


@dataclass(frozen=True)
class VerifierConfig:
    """The parameters of every verifier, so that a session can switch between them."""

    fly: FlyParams = field(default_factory=FlyParams)
    asd: AsdParams = field(default_factory=AsdParams)


def make_verifier(name: str, config: VerifierConfig = VerifierConfig()) -> Verifier:
    if name == "strict":
        return Strict()
    if name == "fly":
        return Fly(config.fly)
    if name == "asd":
        return Asd(config.asd)
    raise ValueError(f"unknown verifier {name}")


VERIFIERS = ("fly", "strict", "asd")
