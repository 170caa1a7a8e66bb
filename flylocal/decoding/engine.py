"""The round loop: draft, score on the target in one decode, decide, commit, account
(docs/design.md, "The round").

    context -> drafter.propose -> target.decode([last, *draft], k+1 rows of logits)
            -> verifier.decide(draft, a, logits, window) -> target.truncate(n_past + m) -> stats, feedback

Each step is a method over a small record of the round (flylocal.decoding.round); the loop is
`Engine._rounds`. FLy's window across rounds is one record per request (`Window`,
flylocal.decoding.contracts): the engine passes it in to each decision and keeps the one the
decision returns, with what the round committed from its pending token on.
The target's cache always holds the committed tokens but the last one (`last`), which is
decoded at the head of the next round's batch. `Engine.generate` returns a Generation: an
iterable of RoundEvents that owns the request's stats, its output tokens and its stop reason.
The engine prints nothing, and knows its parts only through their contracts
(flylocal.decoding.contracts).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from flylocal.decoding.adaptive import timed_decode
from flylocal.decoding.contracts import ACCEPT, EMPTY, NO_DRAFT, REJECT, Drafter, Target, Verifier, Window
from flylocal.decoding.costs import Source
from flylocal.decoding.round import Round, split_output
from flylocal.decoding.sampling import SamplingParams, position_noise, sample_targets, target_argmax, token_logprobs
from flylocal.decoding.stats import Stats
from flylocal.decoding.trace import trace_row
from flylocal.decoding.verifiers.base import emitted_tokens
from flylocal.errors import FlylocalError

if TYPE_CHECKING:
    from flylocal.decoding.costs import CostCurve
    from flylocal.decoding.grammar import Constraint, Grammar

# How each committed token came to be, and the letter a stream marks it with (docs/serving.md, "Server").
ACCEPTED, LOOSE, TARGET = "accepted", "loose", "target"
KIND_LETTERS = {ACCEPTED: "A", LOOSE: "L", TARGET: "T"}


@dataclass(frozen=True)
class EngineConfig:
    max_tokens: int = 256
    k: int = 8                 # the most draft tokens a round verifies
    recalibrate: bool = False  # measure the target's cost curve again instead of reading the cache
    trace: bool = False        # attach trace rows (docs/design.md) to round events
    sampling: SamplingParams = field(default_factory=SamplingParams)   # temperature 0: greedy
    pin_costs: bool = False    # decide draft lengths on calibrated costs only, never this run's timings
    calibration_wait: float | None = None   # seconds of a calibration a request waits for (None: all of it)
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


class Request:
    """What a generation carries from round to round."""

    def __init__(self, target: Target, prompt: np.ndarray, gen: Generation, seed: int):
        self.prompt = prompt
        self.context = np.zeros(target.n_ctx, dtype=np.int32)   # [n_ctx] prompt + committed
        self.context[: len(prompt)] = prompt
        self.n = len(prompt)                    # tokens of `context` in use
        self.stats = gen.stats
        self.out = gen.tokens
        self.constraint: Constraint | None = gen.constraint
        self.head = prompt[:0]                  # the prompt's tail, decoded ahead of the first round's rows
        self.seed = seed                        # a position's randomness: (seed, position)
        self.eog_ids = frozenset(np.flatnonzero(target.eog_mask).tolist())
        self.started = 0.0
        # FLy's window across rounds, the one record of it: its pending token and what follows it
        # are committed to the caches but held back from the output until the verdict.
        self.window: Window | None = None
        self.gen = gen
        self.source: str | None = None          # where the target's cost curve came from (`Engine.prefill`)
        self.closed = False                     # `Engine.stop` has run

    @property
    def produced(self) -> int:
        """Output tokens committed so far, held back or not (an end-of-generation token included)."""
        return self.n - len(self.prompt)


class Generation:
    """One request. Iterating yields a RoundEvent per round. `stats` (with its `stop` reason)
    and `tokens` (the output ids, end-of-generation excluded) belong to the request and are
    final once iteration ends or `close()` is called, whether the request ran to its end, was
    interrupted (Ctrl-C, a closed client) or failed. `on_end(generation)` is called once then."""

    def __init__(self, prompt: np.ndarray, on_end: Callable[[Generation], None] | None = None,
                 grammar: Grammar | None = None, engine: Engine | None = None):
        """With `engine`, iterating runs its rounds (`Engine.generate`); without, the rounds are
        run elsewhere (flylocal.decoding.batch) and this only collects what they give."""
        self.stats = Stats(prompt_tokens=len(prompt))
        self.tokens: list[int] = []
        self._on_end = on_end
        self._ended = False
        self.constraint = grammar.start() if grammar is not None else None   # the grammar's state
        self._rounds = engine._rounds(prompt, self) if engine is not None else None

    def __iter__(self) -> Iterator[RoundEvent]:
        return self._rounds if self._rounds is not None else iter(())

    def run(self) -> Generation:
        """Run to the end (or until an error, which is raised)."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop here; the caches stay consistent with what was yielded."""
        if self._rounds is not None:
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


class Engine:
    def __init__(self, target: Target, drafter: Drafter, verifier: Verifier, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.perf_counter):
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        verifier.bind(target.eog_mask)
        self.config = config
        self.clock = clock            # seconds; tests give a simulated machine's
        # Every cost curve a decision here reads: pinned for a run whose output must not depend
        # on timings (a seeded run; docs/verifiers.md, "Temperature > 0"). The target's is
        # calibrated before the first round and refined by every round's timing.
        self.curves = drafter.cost_curves()
        self.costs = target.costs if any(c is target.costs for c in self.curves) else None

    def generate(self, prompt: np.ndarray, on_end: Callable[[Generation], None] | None = None,
                 grammar: Grammar | None = None) -> Generation:
        """Generate after `prompt` [n] int32, every committed token allowed by `grammar` when
        one is given. Checks the prompt at once (FlylocalError); the work happens as the
        Generation is iterated."""
        prompt = self.checked(prompt)
        return Generation(prompt, on_end, grammar, engine=self)

    def checked(self, prompt) -> np.ndarray:
        """`prompt` as int32 ids [n], or FlylocalError when it is empty or the context cannot hold it."""
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise FlylocalError("the prompt is empty")
        if len(prompt) >= self.target.n_ctx:
            raise FlylocalError(
                f"the prompt is {len(prompt)} tokens, longer than the context (--ctx {self.target.n_ctx})")
        return prompt

    def _rounds(self, prompt: np.ndarray, gen: Generation) -> Iterator[RoundEvent]:
        req = self.start(prompt, gen)
        try:
            self.prefill(req)
            while (r := self.plan(req)) is not None:
                t0 = self.clock()
                tokens = self.rows(req, r)
                self.score(req, r, self.target.decode(tokens, logits_from=r.head), self.clock() - t0)
                yield self.verify(req, r)
        except GeneratorExit:
            self.stop(req, req.stats.stop or "interrupted")     # closed after its last event: it had ended
            raise
        except KeyboardInterrupt:
            self.stop(req, "interrupted")
            raise
        except BaseException:
            self.stop(req, "error")
            raise
        self.stop(req)

    # ----- a request's steps: `_rounds` runs them alone, flylocal.decoding.batch beside others' -----
    def start(self, prompt: np.ndarray, gen: Generation) -> Request:
        """A request's record, its drafter begun. `stop` ends it, however it ends."""
        # The randomness of a position depends on the seed and the position only (no seed: a
        # fresh one per request), so drafting cannot change what is sampled.
        seed = self.config.sampling.seed
        req = Request(self.target, prompt, gen, seed if seed is not None else secrets.randbits(64))
        req.started = self.clock()
        if self.config.pin_costs:
            for curve in self.curves:
                curve.pin(True)
        self.drafter.begin(self.config.max_tokens)
        return req

    def prefill(self, req: Request, rows: int | None = None) -> None:
        """Keep what the cache holds of the prompt (`_prefill`); the prompt's tail is `req.head`.
        The target's cost curve is then known up to decodes of `rows` rows (a round's k + 1
        unless given: a batch's decodes are larger)."""
        req.source = self._prefill(req, rows)

    def plan(self, req: Request) -> Round | None:
        """The next round with its draft, or None when the request has stopped."""
        return None if self._finished(req) else self._draft(req)

    def rows(self, req: Request, r: Round) -> np.ndarray:
        """The round's decode: [prompt's tail on the first round, last, *draft] int32, logits
        wanted from row `r.head` on."""
        h = len(req.head)
        batch = np.empty(h + len(r.draft) + 1, dtype=np.int32)
        batch[:h] = req.head
        batch[h] = req.context[req.n - 1]
        batch[h + 1:] = r.draft
        r.head, r.n_past = h, self.target.n_past
        return batch

    def score(self, req: Request, r: Round, logits: np.ndarray, seconds: float) -> None:
        """The decode of `rows` gave `logits` [k+1, n_vocab] in `seconds`."""
        r.logits, r.score_s = logits, seconds
        r.n_past += r.head
        r.threads = self.target.decoded_on     # a CPU context's thread count, for the trace
        if not r.index:                # the prompt is in: the first round's tokens are its answer
            req.stats.prefill_s = self.clock() - req.started
            req.head = req.head[:0]
        if req.constraint is not None:
            t1 = self.clock()
            req.constraint.restrict(r.logits, r.draft)
            r.mask_s = self.clock() - t1

    def verify(self, req: Request, r: Round) -> RoundEvent:
        """Decide, commit and account a scored round: its event."""
        self._decide(req, r)
        self._commit(req, r)
        return self._account(req, r)

    def stop(self, req: Request, why: str | None = None) -> None:
        """The request ends (`why`: the stop reason when it did not end by itself)."""
        if req.closed:
            return
        req.closed = True
        if why is not None:
            req.stats.stop = why
        if self.config.pin_costs:
            for curve in self.curves:
                curve.pin(False)
        if req.source is not None:
            req.stats.cost_curve = self.costs.report() | {"source": req.source}
        req.stats.wall_s = self.clock() - req.started
        self.drafter.end(req.out)
        req.stats.draft_context = self.drafter.report()
        req.stats.calibrating = any(curve.measuring is not None for curve in self.curves)
        req.gen._end()

    # ----- before the first round -----
    def _prefill(self, req: Request, rows: int | None = None) -> str | None:
        """Keep what the cache holds of the prompt; the rest but its last token goes in the first
        round's decode, ahead of the round's own rows, unless a calibration of the target's
        cost curve needs it in the cache first. Returns where that curve came from ("reused":
        known in this process already), None when no decision reads it."""
        target, prompt, stats = self.target, req.prompt, req.stats
        reused = target.reuse_prefix(prompt)
        stats.prompt_reused, stats.prompt_evaluated = reused, len(prompt) - reused
        req.head = prompt[reused:-1]
        if self.costs is None:
            return None
        known = self.costs.source != Source.NONE
        self.calibrate(req, self.costs, rows or self.config.k + 1)
        return "reused" if known else self.costs.source.value

    def calibrate(self, req: Request, curve: CostCurve, max_rows: int) -> None:
        """`curve`, the target's, known up to decodes of `max_rows` rows: read from the disk
        cache, or measured on this request's target (its sequence, in a batch) after its prompt,
        which a probe needs in the cache: whole, or a slice of at most `calibration_wait`
        seconds before each request until it settles (docs/design.md, "Cost model")."""
        target, prompt = self.target, req.prompt

        def probe(rows: int) -> float:
            if len(req.head):
                target.decode(req.head)
                req.head = req.head[:0]
            return timed_decode(target, int(prompt[-1]), rows, self.clock)

        # With `calibration_wait` (serve, chat), a request waits for a slice of a calibration at
        # most (the first, where nothing is known, none), and the rest follows in slices before
        # the next ones; a seeded run, whose decisions a curve must not move, and --recalibrate,
        # which asks for it, wait for all of it.
        wait = None if self.config.pin_costs or self.config.recalibrate else self.config.calibration_wait
        curve.ensure(probe, max_rows=max_rows, limit=target.n_batch, recalibrate=self.config.recalibrate, wait=wait)

    def _finished(self, req: Request) -> bool:
        """Whether the request has stopped; the output's length and the context's end are
        checked here, an end-of-generation token where it is committed."""
        stats = req.stats
        if not stats.stop:
            if req.produced >= self.config.max_tokens:
                stats.stop = "max_tokens"
            elif req.n >= self.target.n_ctx:
                stats.stop = "context"
        return bool(stats.stop)

    # ----- the round's steps -----
    def _draft(self, req: Request) -> Round:
        """The grammar's forced tokens (under a grammar), then the drafter's, cut where the
        grammar forbids one. The batch [last, *draft] needs k+1 cells, and drafting past
        max_tokens is waste."""
        cfg, clock, n, constraint = self.config, self.clock, req.n, req.constraint
        t0 = clock()
        if self.costs is not None:
            self.costs.at(n)                # the round's decisions and its cost follow its context
        k = max(0, min(cfg.k, self.target.n_ctx - n, cfg.max_tokens - req.produced - 1))
        forced = constraint.forced(k) if constraint is not None and cfg.forced and self.drafter.drafts else EMPTY
        f = len(forced)
        if k > f:
            context = np.concatenate([req.context[:n], forced]) if f else req.context[:n]
            proposal = self.drafter.propose(context, k - f)
        else:
            proposal = NO_DRAFT
        draft = proposal.tokens[: k - f].copy()     # not a view of the context, which a retraction rewrites
        if constraint is not None:          # a token the grammar forbids ends the draft
            draft = np.concatenate([forced, draft]) if f else draft
            draft = draft[: constraint.allowed(draft)]
            f = min(f, len(draft))
        return Round(req.stats.rounds, proposal, draft, forced=f, draft_s=clock() - t0)

    def _decide(self, req: Request, r: Round) -> None:
        """a[0..k]: the target's token at each position, its argmax at temperature 0 and its
        speculative-sampling decision otherwise (docs/verifiers.md, "Temperature > 0"); then the
        verifier's decision and the tokens it emits."""
        t0 = self.clock()
        sampling, history = self.config.sampling, req.context[: req.n]
        if sampling.greedy:
            r.target = target_argmax(r.draft, r.logits, history, sampling)              # [k+1]
        else:
            positions = np.arange(req.n, req.n + len(r.draft) + 1)
            r.target = sample_targets(r.draft, r.logits, history, sampling, position_noise(req.seed, positions))
        self.verifier.see(history[len(req.prompt):])
        r.decision, r.window = self.verifier.decide(r.draft, r.target, r.logits, req.window, req.n)
        r.emitted = emitted_tokens(r.draft, r.target, r.decision.accepted)             # [L+1]
        r.decide_s = self.clock() - t0

    def _commit(self, req: Request, r: Round) -> None:
        """Cut the emitted tokens at the first end-of-generation token, at max_tokens and at the
        context's end; roll the cache back to keep [last, *committed[:-1]] (committed[-1] is
        the new last); charge the verifier for what was committed. A REJECT verdict takes the
        request's window back instead (`_reject`), and nothing of the round stays."""
        t0 = self.clock()
        decision = r.decision
        if decision.verdict == REJECT:
            r.emitted = r.emitted[:0]
            r.decision = self.verifier.commit(decision, 0)
            self._reject(req, r)
            r.commit_s = self.clock() - t0
            return
        eog_ids = req.eog_ids
        ids = r.emitted.tolist()          # a few ids: Python beats numpy's per-call cost here
        eog = next((j for j, t in enumerate(ids) if t in eog_ids), None)
        m = eog + 1 if eog is not None else len(ids)
        m = min(m, self.config.max_tokens - req.produced, self.target.n_ctx - req.n)
        self.target.truncate(r.n_past + m)
        r.committed, r.ended, r.accepted = m, eog is not None and eog < m, min(decision.accepted, m)
        r.decision = self.verifier.commit(decision, r.accepted)      # a ledger pays for what stays
        req.context[req.n : req.n + m] = r.emitted[:m]
        req.n += m
        if req.constraint is not None:    # (the grammar allowed the end; it ends the generation)
            req.constraint.commit(r.emitted[: m - r.ended])
        r.commit_s = self.clock() - t0

    def _reject(self, req: Request, r: Round) -> None:
        """Take back the window's pending token at P and everything after it: the caches roll
        back to P, and its recovered token goes there (docs/verifiers.md, "FLy")."""
        window = r.rejected = req.window
        P, token = window.at, window.recovered
        r.retracted, req.window = req.n - P, None
        self.target.truncate(P)
        if req.constraint is not None:
            req.constraint.truncate(P - len(req.prompt))
        req.context[P] = token
        req.n = P + 1
        r.ended = token in req.eog_ids
        if req.constraint is not None and not r.ended:
            req.constraint.commit([token])

    def _account(self, req: Request, r: Round) -> RoundEvent:
        """Stats, the drafter's feedback, the cost curve's timing, trace and logprobs; the
        event that carries the round's output."""
        cfg, stats = self.config, req.stats
        out = [] if r.rejected is not None else self._output(req, r)
        if req.window is not None and (r.ended or req.produced >= cfg.max_tokens or req.n >= self.target.n_ctx):
            self._reject(req, r)          # the end cuts its window short: the pending token goes
        if r.rejected is not None and not r.ended:    # its recovered token where the pending one stood
            out.append((r.rejected.recovered, TARGET, r.rejected.recovered_logprobs))
        stats.add(r)
        # The drafter's share of the round: its tokens after the forced ones, judged where the
        # target reached them (a round that rejected a window: as far as they matched).
        f, proposal = r.forced, r.proposal
        accepted = r.accepted if r.decision.verdict != REJECT else min(r.decision.accepted, len(r.draft))
        if accepted >= f:
            own = len(r.draft) - f
            verified = proposal if own == len(proposal.tokens) else proposal.cut(own)
            self.drafter.observe(verified, accepted - f)
        if self.costs is not None and not r.head and not r.shared:    # the decode's cost (a grammar's masks are not
                                                                      # the target's; a shared decode: the batch's)
            self.costs.update(len(r.draft) + 1, r.score_s + r.decide_s + r.commit_s, emitted=max(r.added, 0))
        tokens = tuple(t for t, _, _ in out)
        kinds = tuple(kind for _, kind, _ in out)
        logprobs = tuple(lp for _, _, lp in out) if cfg.logprobs is not None else None
        trace = trace_row(r, grammar=req.constraint is not None, window=req.window) if cfg.trace else None
        req.out.extend(tokens)
        # The stop is known before the event goes out: a consumer that closes the generation
        # right after it gets the real reason.
        if r.ended:
            stats.stop = "eog"
        self._finished(req)
        return RoundEvent(r.index, tokens, kinds, trace, logprobs)

    def _output(self, req: Request, r: Round) -> list[tuple]:
        """(token, kind, logprobs entry) of what the round makes output, and the request's window
        after it (`split_output`): the pending output of a window the verdict accepted, then the
        round's own output tokens up to the pending token of the window left open."""
        cfg, decision, window = self.config, r.decision, r.window
        n, start = r.committed - r.ended, req.n - r.committed     # its output tokens; draft token 0's position
        L, loose = decision.accepted, decision.loose
        j = window.at - start if window is not None else -1       # a pending token of this round's
        tokens = r.emitted[:n].tolist()
        kinds = [LOOSE if i in loose or i == j else ACCEPTED if i < L else TARGET for i in range(n)]
        # Row i scored the position of committed[i] under the prefix committed before it.
        logprobs = (token_logprobs(r.emitted[:n], r.logits, req.context[:start], cfg.sampling, cfg.logprobs)
                    if cfg.logprobs is not None else [None] * n)
        if 0 <= j < r.accepted and cfg.logprobs is not None:    # what its recovered token will be output with
            entry = token_logprobs(r.target[j : j + 1], r.logits[j : j + 1], req.context[: start + j], cfg.sampling,
                                   cfg.logprobs)[0]
            window = replace(window, recovered_logprobs=entry)
        pending = req.window.pending if decision.verdict == ACCEPT else ()     # now output
        out, req.window = split_output(window, pending, start, req.n, r.accepted, list(zip(tokens, kinds, logprobs)))
        return out


def generate_all(engine: Engine, prompt: np.ndarray, grammar: Grammar | None = None) -> tuple[list[int], Stats, list[dict]]:
    """Run to completion (under `grammar`, if given): (output ids, stats, trace rows)."""
    gen = engine.generate(prompt, grammar=grammar)
    traces = [event.trace for event in gen if event.trace is not None]
    return list(gen.tokens), gen.stats, traces
