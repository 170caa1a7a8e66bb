"""What `flylocal bench` can compare: each method is a verifier and a drafter of flylocal's, or
llama-cpp-python's own generation (with or without its prompt-lookup drafter) as the point of
comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flylocal.errors import FlylocalError


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str = "strict"
    drafter: str = "none"
    baseline: bool = False          # llama-cpp-python's own generation, not flylocal's engine
    prompt_lookup: bool = False     # ... with its prompt-lookup drafter
    within_round: bool = False      # FLy as the reference implementation has it: the window within the round,
                                    # any draft token let through the gate

    @property
    def needs_draft(self) -> bool:
        return self.drafter in ("model", "mla")


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("autoregressive"),
    Method("llama-cpp-python", baseline=True),
    Method("llama-cpp-python-pld", baseline=True, prompt_lookup=True),
    *(Method(f"{verifier}-{drafter}", verifier, drafter)
      for verifier, drafter in (("strict", "pld"), ("fly", "pld"), ("strict", "model"), ("fly", "model"),
                                ("asd", "model"), ("strict", "mla"), ("fly", "mla"), ("asd", "mla"))),
    *(Method(f"fly-within-{drafter}", "fly", drafter, within_round=True) for drafter in ("pld", "mla")),
]}


def parse_methods(spec: str | None, have_draft: bool, say: Callable[[str], None]) -> list[str]:
    """The names of the methods --methods asks for (default: all), those needing a draft model
    skipped, and said so, without --draft."""
    methods = list(METHODS) if not spec else [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise FlylocalError(f"unknown method {unknown[0]!r}; methods are {', '.join(METHODS)}")
    if not have_draft:
        skipped = [m for m in methods if METHODS[m].needs_draft]
        if skipped:
            say(f"no --draft: skipping {', '.join(skipped)}")
        methods = [m for m in methods if not METHODS[m].needs_draft]
    if not methods:
        raise FlylocalError("no methods left to run")
    return methods
