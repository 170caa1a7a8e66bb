"""The round loop: draft, score on the target in one decode, decide, commit, roll back.

    context -> drafter.propose -> target.decode([last, *draft], all k+1 rows)
            -> verifier(draft, target_argmax, logits) -> target.truncate(n_past + L + 1)

The target's cache always holds the committed tokens but the last one (`last`), which is
decoded at the head of the next round's batch. `generate` is a generator of events; it prints
nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Union

import numpy as np

from flylocal.adaptive import DraftLength, timed_decode
from flylocal.errors import FlylocalError
from flylocal.sampling import SamplingParams, sample_targets
from flylocal.stats import Stats
from flylocal.verifiers import Decision, Verifier, emitted_tokens, regrets

# How each committed token came to be.
ACCEPTED, LOOSE, TARGET = "accepted", "loose", "target"


@dataclass(frozen=True)
class EngineConfig:
    max_tokens: int = 256
    k: int = 8                 # draft length (the most, when adaptive)
    adaptive: bool = True      # let measured cost and acceptance shorten drafts (adaptive drafters only)
    recalibrate: bool = False  # measure the target's cost curve again instead of reading the cache
    trace: bool = False        # attach trace rows (docs/design.md) to round events
    sampling: SamplingParams = field(default_factory=SamplingParams)   # temperature 0: greedy


@dataclass(frozen=True)
class RoundEvent:
    index: int
    tokens: tuple[int, ...]    # committed this round, cut at EOG / max_tokens
    kinds: tuple[str, ...]     # ACCEPTED, LOOSE or TARGET per committed token
    trace: dict | None = None


@dataclass(frozen=True)
class DoneEvent:
    stats: Stats
    tokens: tuple[int, ...] = field(default=())   # all generated ids, EOG excluded


Event = Union[RoundEvent, DoneEvent]


class Engine:
    def __init__(self, target, drafter, verifier: Verifier, config: EngineConfig = EngineConfig()):
        self.target = target          # Runtime
        self.drafter = drafter
        self.verifier = verifier
        self.config = config
        self.length = (DraftLength(config.k, drafter.level_prior, target.costs)
                       if config.adaptive and drafter.adaptive else None)
        # The target's cost curve is needed by the engine's draft-length control and by drafters
        # that weigh a draft model against lookup (they hold a `plan`).
        self.costs = target.costs if self.length is not None or getattr(drafter, "plan", None) else None
        self.observe = getattr(drafter, "observe", None)
        self.corpus = getattr(drafter, "corpus", None)     # lookup remembers what was generated
        self.rng = np.random.default_rng(config.sampling.seed)

    def generate(self, prompt: np.ndarray) -> Iterator[Event]:
        """Generate after `prompt` [n] int32. Yields a RoundEvent per round, then a DoneEvent.
        Closing the generator early (Ctrl-C) leaves the caches consistent with what was yielded."""
        cfg, target = self.config, self.target
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise FlylocalError("the prompt is empty")
        if len(prompt) >= target.n_ctx:
            raise FlylocalError(
                f"the prompt is {len(prompt)} tokens, longer than the context (--ctx {target.n_ctx})")
        stats = Stats(prompt_tokens=len(prompt), stop="max_tokens")
        t_start = time.perf_counter()
        context = np.zeros(target.n_ctx, dtype=np.int32)    # [n_ctx] prompt + committed
        n = len(prompt)
        context[:n] = prompt
        generated: list[int] = []
        commit = getattr(self.verifier, "commit", None)
        try:
            reused = target.reuse_prefix(prompt)
            target.decode(prompt[reused:-1])
            if self.costs is not None:     # from the disk cache, or measured once per process
                known = self.costs.source != "none"
                self.costs.ensure(lambda rows: timed_decode(target, int(prompt[-1]), rows), max_rows=cfg.k + 1,
                                  limit=target.n_batch, recalibrate=cfg.recalibrate)
                stats.cost_curve = "reused" if known else self.costs.source
            stats.prompt_reused, stats.prompt_evaluated = reused, len(prompt) - reused
            stats.prefill_s = time.perf_counter() - t_start
            while len(generated) < cfg.max_tokens:
                if n >= target.n_ctx:
                    stats.stop = "context"
                    break
                # Room: the batch [last, *draft] needs k+1 cells, and drafting past max_tokens is waste.
                k = max(0, min(cfg.k, target.n_ctx - n, cfg.max_tokens - len(generated) - 1))
                t0 = time.perf_counter()
                proposal = self.drafter.propose(context[:n], k) if k else None
                draft = proposal.tokens[:k] if proposal is not None else context[:0]
                if self.length is not None and len(draft):
                    draft = draft[: self.length.choose(proposal.level, len(draft))]
                t1 = time.perf_counter()
                batch = np.empty(len(draft) + 1, dtype=np.int32)
                batch[0] = context[n - 1]
                batch[1:] = draft
                n_past = target.n_past
                logits = target.decode(batch, logits_from=0)          # [k+1, n_vocab]
                t2 = time.perf_counter()
                if cfg.sampling.greedy:
                    target_argmax = logits.argmax(axis=1).astype(np.int32)  # [k+1]
                else:   # the target's sample at each position stands in for its argmax
                    target_argmax = sample_targets(draft, logits, context[:n], cfg.sampling, self.rng)
                decision = self.verifier(draft, target_argmax, logits)
                L = decision.accepted
                emitted = emitted_tokens(draft, target_argmax, L)             # [L+1]
                t3 = time.perf_counter()

                # Cut at the first end-of-generation token, at max_tokens and at the context's end.
                eog = np.flatnonzero(target.eog_mask[emitted])
                m = int(eog[0]) + 1 if eog.size else len(emitted)
                m = min(m, cfg.max_tokens - len(generated), target.n_ctx - n)
                committed = emitted[:m]
                target.truncate(n_past + m)        # [last, *committed[:-1]] stay; committed[-1] is the new last
                if commit is not None:             # a ledger pays only for what was committed
                    decision = commit(decision, min(L, m))
                t4 = time.perf_counter()

                context[n : n + m] = committed
                n += m
                loose = set(decision.loose)
                kinds = tuple(LOOSE if j in loose else ACCEPTED if j < L else TARGET for j in range(m))
                stats.rounds += 1
                stats.drafted += len(draft)
                stats.accepted += min(L, m)
                committed_loose = sum(1 for j in loose if j < m)
                stats.loose += committed_loose
                stats.mismatches += committed_loose + (L < len(draft))
                if "budget_spent" in decision.trace:
                    stats.budget_spent = decision.trace["budget_spent"]
                    stats.budget_left = decision.trace["budget_left"]
                stats.emitted += m
                stats.draft_s += t1 - t0
                stats.target_s += (t2 - t1) + (t4 - t3)
                stats.verify_s += t3 - t2
                if self.length is not None:
                    self.length.update(proposal.level if proposal else 0, len(draft), L)
                if self.observe is not None and proposal is not None:
                    self.observe(proposal, min(L, m))     # drafts that choose their own length
                if self.costs is not None:
                    self.costs.update(len(draft) + 1, t4 - t1)
                trace = self._trace_row(stats.rounds - 1, n_past, draft, target_argmax, logits,
                                        decision, emitted) if cfg.trace else None
                stop = bool(eog.size) and int(eog[0]) < m
                if stop:
                    generated.extend(int(t) for t in committed[:-1])
                else:
                    generated.extend(int(t) for t in committed)
                yield RoundEvent(stats.rounds - 1, tuple(int(t) for t in committed), kinds, trace)
                if stop:
                    stats.stop = "eog"
                    break
        except (GeneratorExit, KeyboardInterrupt):
            stats.stop = "interrupted"
            raise
        finally:
            stats.wall_s = time.perf_counter() - t_start
            self.last_stats = stats
            if self.corpus is not None:
                self.corpus.add(generated)
        yield DoneEvent(stats, tuple(generated))

    def _trace_row(self, index, n_past, draft, target_argmax, logits, decision: Decision, emitted) -> dict:
        k = len(draft)
        regret = regrets(draft, target_argmax, logits)                      # [k] float64
        entropy = decision.entropy
        row = {
            "round": index,
            "n_past": int(n_past),
            "draft": [int(t) for t in draft],
            "target_argmax": [int(t) for t in target_argmax],
            "entropy": [None if entropy is None or np.isnan(e) else float(e) for e in
                        (entropy if entropy is not None else [np.nan] * k)],
            "regret": [float(r) for r in regret],
            "accepted": int(decision.accepted),
            "loose": [int(j) for j in decision.loose],
            "emitted": [int(t) for t in emitted],
        }
        row.update(decision.trace)
        return row


def generate_all(engine: Engine, prompt: np.ndarray) -> tuple[list[int], Stats, list[dict]]:
    """Run to completion: (generated ids, stats, trace rows)."""
    traces = []
    for event in engine.generate(prompt):
        if isinstance(event, RoundEvent) and event.trace is not None:
            traces.append(event.trace)
        elif isinstance(event, DoneEvent):
            return list(event.tokens), event.stats, traces
    raise RuntimeError("generation ended without a DoneEvent")
