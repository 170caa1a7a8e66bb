"""The round loop: draft, score on the target in one decode, decide, commit, roll back
(docs/design.md, "The round").

    context -> drafter.propose -> target.decode([last, *draft], all k+1 rows)
            -> verifier(draft, a, logits) -> target.truncate(n_past + m)

The target's cache always holds the committed tokens but the last one (`last`), which is
decoded at the head of the next round's batch. `Engine.generate` returns a Generation: an
iterable of RoundEvents that owns the request's stats, its output tokens and its stop reason.
The engine prints nothing.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from flylocal.decoding.adaptive import DraftLength, ModelDraftLength, timed_decode
from flylocal.decoding.sampling import SamplingParams, position_noise, sample_targets, target_argmax, token_logprobs
from flylocal.decoding.stats import Stats
from flylocal.decoding.verifiers import Decision, Verifier, emitted_tokens, regrets
from flylocal.errors import FlylocalError

if TYPE_CHECKING:
    from flylocal.decoding.grammar import Grammar

# How each committed token came to be, and the letter a stream marks it with (docs/design.md, "Server").
ACCEPTED, LOOSE, TARGET = "accepted", "loose", "target"
KIND_LETTERS = {ACCEPTED: "A", LOOSE: "L", TARGET: "T"}


@dataclass(frozen=True)
class EngineConfig:
    max_tokens: int = 256
    k: int = 8                 # draft length (the most, when adaptive)
    adaptive: bool = True      # let measured cost and acceptance shorten drafts (adaptive drafters only)
    recalibrate: bool = False  # measure the target's cost curve again instead of reading the cache
    trace: bool = False        # attach trace rows (docs/design.md) to round events
    sampling: SamplingParams = field(default_factory=SamplingParams)   # temperature 0: greedy
    pin_costs: bool = False    # decide draft lengths on calibrated costs only, never this run's timings
    logprobs: int | None = None   # give each output token its log-probability and this many of the most
                                  # likely ones at its position (None: none are computed)
    forced: bool = True        # under a grammar, draft the tokens it forces (docs/design.md, "Grammars")


@dataclass(frozen=True)
class RoundEvent:
    index: int
    tokens: tuple[int, ...]    # output committed this round, cut at max_tokens and the context's end;
                               # an end-of-generation token is committed but is not output
    kinds: tuple[str, ...]     # ACCEPTED, LOOSE or TARGET per token of `tokens`
    trace: dict | None = None
    logprobs: tuple | None = None   # per token of `tokens` (with EngineConfig.logprobs): (log-probability,
                                    # ((id, log-probability), ...) most likely first), from the round's rows


class Generation:
    """One request. Iterating yields a RoundEvent per round. `stats` (with its `stop` reason)
    and `tokens` (the output ids, end-of-generation excluded) belong to the request and are
    final once iteration ends or `close()` is called, whether the request ran to its end, was
    interrupted (Ctrl-C, a closed client) or failed. `on_end(generation)` is called once then."""

    def __init__(self, engine: Engine, prompt: np.ndarray, on_end: Callable[[Generation], None] | None = None,
                 grammar: Grammar | None = None):
        self.stats = Stats(prompt_tokens=len(prompt))
        self.tokens: list[int] = []
        self._on_end = on_end
        self._ended = False
        self.constraint = grammar.start() if grammar is not None else None   # the grammar's state
        self._rounds = engine._rounds(prompt, self)

    def __iter__(self) -> Iterator[RoundEvent]:
        return self._rounds

    def run(self) -> Generation:
        """Run to the end (or until an error, which is raised)."""
        for _ in self._rounds:
            pass
        return self

    def close(self) -> None:
        """Stop here; the caches stay consistent with what was yielded."""
        self._rounds.close()
        if not self.stats.stop:        # closed before it started
            self.stats.stop = "interrupted"
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self._on_end is not None:
                self._on_end(self)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The draft-length controllers an engine and its drafter may hold: (role, where, attribute).
CONTROLLERS = (("length", "engine", "length"), ("plan", "drafter", "plan"),
               ("lookup", "drafter", "lookup_length"), ("inner", "drafter", "inner"))


class Engine:
    def __init__(self, target, drafter, verifier: Verifier, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.perf_counter, learned: dict | None = None):
        self.target = target          # Runtime, or anything with its decode/truncate/reuse_prefix interface
        self.drafter = drafter
        self.verifier = verifier
        self.config = config
        self.clock = clock            # seconds; tests give a simulated machine's
        self.length = (DraftLength(config.k, drafter.level_prior, target.costs)
                       if config.adaptive and drafter.adaptive else None)
        # The target's cost curve is needed by the engine's draft-length control and by drafters
        # that weigh a draft model against lookup (they hold a `plan`).
        self.costs = target.costs if self.length is not None or getattr(drafter, "plan", None) else None
        # Every cost curve a decision here reads: pinned for a run whose output must not depend
        # on timings (a seeded run; docs/design.md, "Temperature > 0").
        model = getattr(drafter, "model", None)
        self.curves = [c for c in (target.costs, getattr(model, "costs", None)) if c is not None]
        self.observe = getattr(drafter, "observe", None)
        self.corpus = getattr(drafter, "corpus", None)     # lookup remembers what was generated
        self.controllers = self._share(learned if learned is not None else {})

    def _share(self, learned: dict) -> list:
        """Take over the draft-length controllers `learned` holds from earlier engines with the
        same models and settings (what they measured of acceptance: numbers, never text), and
        put this engine's there where it holds none. The controllers in use."""
        used = []
        drafter = self.drafter
        while hasattr(getattr(drafter, "inner", None), "propose"):    # a drafter wrapping one (through text)
            drafter = drafter.inner
        for role, where, attr in CONTROLLERS:
            owner = self if where == "engine" else drafter
            mine = getattr(owner, attr, None)
            if not isinstance(mine, (DraftLength, ModelDraftLength)):   # none here
                continue
            kept = learned.get(role)
            if kept is not None and mine.fits(kept):
                setattr(owner, attr, kept)
                mine = kept
            else:
                learned[role] = mine
            used.append(mine)
        return used

    def generate(self, prompt: np.ndarray, on_end: Callable[[Generation], None] | None = None,
                 grammar: Grammar | None = None) -> Generation:
        """Generate after `prompt` [n] int32, every committed token allowed by `grammar` when
        one is given. Checks the prompt at once (FlylocalError); the work happens as the
        Generation is iterated."""
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise FlylocalError("the prompt is empty")
        if len(prompt) >= self.target.n_ctx:
            raise FlylocalError(
                f"the prompt is {len(prompt)} tokens, longer than the context (--ctx {self.target.n_ctx})")
        return Generation(self, prompt, on_end, grammar)

    def _rounds(self, prompt: np.ndarray, gen: Generation) -> Iterator[RoundEvent]:
        cfg, target, stats, out, clock = self.config, self.target, gen.stats, gen.tokens, self.clock
        t_start = clock()
        context = np.zeros(target.n_ctx, dtype=np.int32)    # [n_ctx] prompt + committed
        n = len(prompt)
        context[:n] = prompt
        commit = getattr(self.verifier, "commit", None)
        eog_ids = frozenset(np.flatnonzero(target.eog_mask).tolist())
        greedy = cfg.sampling.greedy
        constraint = gen.constraint
        # Plain decoding (no drafter) stays plain under a grammar: the baseline drafts nothing.
        forcing = constraint is not None and cfg.forced and getattr(self.drafter, "name", "") != "none"
        # The randomness of a position depends on the seed and the position only (no seed: a
        # fresh one per request), so drafting cannot change what is sampled.
        seed = cfg.sampling.seed if cfg.sampling.seed is not None else secrets.randbits(64)
        for curve in self.curves:
            curve.pin(cfg.pin_costs)
        for controller in self.controllers:
            controller.begin()
        source = None                  # where the target's cost curve came from, once it is known
        try:
            reused = target.reuse_prefix(prompt)
            stats.prompt_reused, stats.prompt_evaluated = reused, len(prompt) - reused
            # The prompt but its last token goes in the first round's decode, ahead of the
            # round's own rows, unless a calibration needs it in the cache first.
            head = prompt[reused:-1]

            def probe(rows: int) -> float:
                nonlocal head
                if len(head):
                    target.decode(head)
                    head = head[:0]
                return timed_decode(target, int(prompt[-1]), rows, clock)

            if self.costs is not None:     # from the disk cache, or measured once per process
                known = self.costs.source != "none"
                self.costs.ensure(probe, max_rows=cfg.k + 1, limit=target.n_batch, recalibrate=cfg.recalibrate)
                source = "reused" if known else self.costs.source
            while True:
                if len(out) >= cfg.max_tokens:
                    stats.stop = "max_tokens"
                    break
                if n >= target.n_ctx:
                    stats.stop = "context"
                    break
                # Room: the batch [last, *draft] needs k+1 cells, and drafting past max_tokens is waste.
                k = max(0, min(cfg.k, target.n_ctx - n, cfg.max_tokens - len(out) - 1))
                t0 = clock()
                forced = constraint.forced(k) if forcing else context[:0]        # [f]
                f = len(forced)
                if f:
                    ahead = np.concatenate([context[:n], forced])
                    proposal = self.drafter.propose(ahead, k - f) if k > f else None
                else:
                    proposal = self.drafter.propose(context[:n], k) if k else None
                draft = proposal.tokens[: k - f] if proposal is not None else context[:0]
                if self.length is not None and len(draft):
                    draft = draft[: self.length.choose(proposal.level, len(draft))]
                if constraint is not None:          # a token the grammar forbids ends the draft
                    draft = np.concatenate([forced, draft]) if f else draft
                    draft = draft[: constraint.allowed(draft)]
                    f = min(f, len(draft))
                t1 = clock()
                h = len(head)
                batch = np.empty(h + len(draft) + 1, dtype=np.int32)
                batch[:h] = head
                batch[h] = context[n - 1]
                batch[h + 1:] = draft
                n_past = target.n_past + h
                logits = target.decode(batch, logits_from=h)          # [k+1, n_vocab]
                t2 = clock()
                if not stats.rounds:               # the prompt is in: the first round's tokens are its answer
                    stats.prefill_s = t2 - t_start
                    head = head[:0]
                masking = 0.0
                if constraint is not None:          # the target's distribution under the grammar
                    constraint.restrict(logits, draft)
                    masking = clock() - t2
                    stats.mask_s += masking
                # a[0..k]: the target's token at each position, its argmax at temperature 0 and
                # its speculative-sampling decision otherwise (docs/design.md, "Temperature > 0").
                if greedy:
                    a = target_argmax(draft, logits, context[:n], cfg.sampling)   # [k+1]
                else:
                    a = sample_targets(draft, logits, context[:n], cfg.sampling,
                                       position_noise(seed, np.arange(n, n + len(draft) + 1)))
                decision = self.verifier(draft, a, logits)
                L = decision.accepted
                emitted = emitted_tokens(draft, a, L)                    # [L+1]
                t3 = clock()

                # Cut at the first end-of-generation token, at max_tokens and at the context's end.
                ids = emitted.tolist()             # a few ids: Python beats numpy's per-call cost here
                eog = next((j for j, t in enumerate(ids) if t in eog_ids), None)
                m = eog + 1 if eog is not None else len(ids)
                m = min(m, cfg.max_tokens - len(out), target.n_ctx - n)
                committed = emitted[:m]
                target.truncate(n_past + m)        # [last, *committed[:-1]] stay; committed[-1] is the new last
                if commit is not None:             # a ledger pays only for what was committed
                    decision = commit(decision, min(L, m))
                t4 = clock()

                context[n : n + m] = committed
                n += m
                ended = eog is not None and eog < m
                shown = m - ended                  # the end-of-generation token is not output
                if constraint is not None:         # (the grammar allowed the end; it ends the generation)
                    constraint.commit(committed[:shown])
                loose = set(decision.loose)
                kinds = tuple(LOOSE if j in loose else ACCEPTED if j < L else TARGET for j in range(shown))
                stats.rounds += 1
                stats.drafted += len(draft)
                stats.accepted += min(L, m)
                stats.forced += min(f, L, m)
                committed_loose = sum(1 for j in loose if j < m)
                stats.loose += committed_loose
                stats.mismatches += committed_loose + (L < len(draft))
                if decision.budget_spent is not None:
                    stats.budget_spent, stats.budget_left = decision.budget_spent, decision.budget_left
                stats.emitted += m
                if stats.rounds == 1:
                    stats.first_tokens = m
                stats.draft_s += t1 - t0
                stats.target_s += (t2 - t1) + (t4 - t3)
                stats.verify_s += t3 - t2
                # The drafter's share of the round: its tokens after the forced ones, judged
                # only where the target reached them.
                if self.length is not None and L >= f:
                    self.length.update(proposal.level if proposal else 0, len(draft) - f, L - f)
                if self.observe is not None and proposal is not None and min(L, m) >= f:
                    self.observe(proposal, min(L, m) - f)     # drafts that choose their own length
                if self.costs is not None and not h:    # the decode's cost: a grammar's masks are not the target's
                    self.costs.update(len(draft) + 1, t4 - t1 - masking, emitted=m)
                trace = self._trace_row(stats.rounds - 1, n_past, draft, a, logits, decision, emitted,
                                        proposal, f if constraint is not None else None) if cfg.trace else None
                # Row j scored the position of committed[j] under the prefix committed before it.
                logprobs = (tuple(token_logprobs(committed[:shown], logits, context[: n - m], cfg.sampling,
                                                 cfg.logprobs)) if cfg.logprobs is not None else None)
                tokens = tuple(ids[:shown])
                out.extend(tokens)
                # The stop is known before the last event goes out: a consumer that closes
                # the generation right after it gets the real reason.
                if ended:
                    stats.stop = "eog"
                elif len(out) >= cfg.max_tokens:
                    stats.stop = "max_tokens"
                elif n >= target.n_ctx:
                    stats.stop = "context"
                yield RoundEvent(stats.rounds - 1, tokens, kinds, trace, logprobs)
                if stats.stop:
                    break
        except GeneratorExit:
            stats.stop = stats.stop or "interrupted"     # closed after its last event: it had ended
            raise
        except KeyboardInterrupt:
            stats.stop = "interrupted"
            raise
        except BaseException:
            stats.stop = "error"
            raise
        finally:
            for curve in self.curves:
                curve.pin(False)
            if source is not None:
                stats.cost_curve = self.costs.report() | {"source": source}
            stats.wall_s = clock() - t_start
            if self.corpus is not None:
                self.corpus.add(out)
            gen._end()

    def _trace_row(self, index, n_past, draft, a, logits, decision: Decision, emitted, proposal,
                   forced: int | None) -> dict:
        k = len(draft)
        entropy = decision.entropy
        row = {
            "round": index,
            "n_past": int(n_past),
            "draft": [int(t) for t in draft],
            "target_argmax": [int(t) for t in a],
            "entropy": [None if entropy is None or np.isnan(e) else float(e) for e in
                        (entropy if entropy is not None else [np.nan] * k)],
            "regret": [float(r) for r in regrets(draft, a, logits)],
            "accepted": int(decision.accepted),
            "loose": [int(j) for j in decision.loose],
            "emitted": [int(t) for t in emitted],
        }
        if decision.budget_spent is not None:
            row["budget_spent"], row["budget_left"] = decision.budget_spent, decision.budget_left
        if forced is not None:
            row["forced"] = forced              # under a grammar: the draft's first tokens it forced
        if proposal is not None and proposal.text is not None:
            row["draft_text"] = proposal.text       # a draft through text: the text it came from
        return row


def generate_all(engine: Engine, prompt: np.ndarray, grammar: Grammar | None = None) -> tuple[list[int], Stats, list[dict]]:
    """Run to completion (under `grammar`, if given): (output ids, stats, trace rows)."""
    gen = engine.generate(prompt, grammar=grammar)
    traces = [event.trace for event in gen if event.trace is not None]
    return list(gen.tokens), gen.stats, traces
