"""Properties of the round loop (flylocal/decoding/engine.py, docs/design.md "The round"), tested over
thousands of random cases on an in-memory fake target (tests/fake_backend.py), in seconds and
without llama.cpp.

Every case is drawn from its own seed (`random_case(seed, ...)` with the test's arguments), and
a failure message names the seed and prints the whole case. Every run goes through
`run_engine`, which checks each round against the design as it happens (the target scored
the right prefix, what was committed and output, the kinds, the cache holding exactly the
context but its last token) and the stats at the end; the tests add their property on top.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from fake_backend import FakeLM, FakeTarget, NoisyOracle, controlled, fixed_costs, greedy, mix, prefix_hash
from flylocal.decoding.drafters import NoDraft
from flylocal.decoding.drafters.length import LengthControl
from flylocal.decoding.drafters.pld import PromptLookup, level_prior
from flylocal.decoding.engine import ACCEPTED, LOOSE, TARGET, Engine, EngineConfig
from flylocal.decoding.stats import Stats
from flylocal.decoding.verifiers.asd import Asd, AsdParams
from flylocal.decoding.verifiers.fly import Fly, FlyParams
from flylocal.decoding.verifiers.strict import Strict

N_CASES = 1000

# A few language models, built once: the cases pick among them.
LMS = (
    FakeLM(seed=1, n_vocab=32, eog=(0,), p_eog=0.03),
    FakeLM(seed=2, n_vocab=16, eog=(0, 1), p_eog=0.08),
    FakeLM(seed=3, n_vocab=64, eog=(), p_eog=0.0),                      # no EOG at all
    FakeLM(seed=4, n_vocab=24, eog=(5,), p_eog=0.15, p_flat=0.6, p_peaked=0.2),
)
EOG_HEAVY = (1, 3)          # indices of the LMs whose greedy text often ends


# ---------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    seed: int
    lm: int                      # index into LMS
    prompt: tuple[int, ...]
    n_ctx: int
    k: int
    max_tokens: int
    adaptive: bool
    drafter: str                 # "oracle", "pld" or "none"
    verifier: str                # "strict", "fly" or "asd"
    fly: FlyParams = field(default_factory=FlyParams)
    asd: AsdParams = field(default_factory=AsdParams)
    p_corrupt: float = 0.15      # oracle: share of random tokens in a draft
    p_eog: float = 0.03          # oracle: share of EOG tokens in a draft
    ngram: int = 4               # pld: the longest n-gram looked up
    row_cost: float = 0.1        # the fixed cost curve's extra cost per row

    def __str__(self) -> str:
        params = {"fly": self.fly, "asd": self.asd}.get(self.verifier, "")
        return (f"Case(lm {self.lm}, prompt {list(self.prompt)}, n_ctx {self.n_ctx}, "
                f"k {self.k}, max_tokens {self.max_tokens}, adaptive {self.adaptive}, "
                f"drafter {self.drafter} (seed {self.seed}, p_corrupt {self.p_corrupt:.2f}, p_eog {self.p_eog:.2f}, "
                f"ngram {self.ngram}), verifier {self.verifier} {params}, row_cost {self.row_cost})")


def random_prompt(rng: np.random.Generator, n_vocab: int, n: int) -> tuple[int, ...]:
    style = rng.integers(3)
    if style == 0:                                   # uniform
        tokens = rng.integers(n_vocab, size=n)
    elif style == 1:                                 # a repeated pattern: prompt lookup finds matches
        tokens = np.resize(rng.integers(n_vocab, size=rng.integers(1, 6)), n)
    else:                                            # a small alphabet
        tokens = rng.choice(rng.integers(n_vocab, size=3), size=n)
    return tuple(int(t) for t in tokens)


def random_case(seed: int, verifier: str = "any", lms=None, room=(1, 40), max_tokens=(0, 40),
                p_eog=(0.0, 0.1), drafters=("oracle", "oracle", "pld", "none")) -> Case:
    """The case of `seed`. `room`: how many cells the context has past the prompt (inclusive
    bounds); `max_tokens`, `p_eog` (the oracle's EOG share): inclusive bounds."""
    rng = np.random.default_rng(seed)
    lm = int(rng.choice(lms if lms is not None else range(len(LMS))))
    n_prompt = int(rng.integers(1, 25))
    if verifier == "any":
        verifier = str(rng.choice(["strict", "fly", "asd"]))
    case = Case(
        seed=seed, lm=lm, prompt=random_prompt(rng, LMS[lm].n_vocab, n_prompt),
        n_ctx=n_prompt + int(rng.integers(room[0], room[1] + 1)),
        k=int(rng.integers(0, 10)),
        max_tokens=int(rng.integers(max_tokens[0], max_tokens[1] + 1)),
        adaptive=bool(rng.random() < 0.3),
        drafter=str(rng.choice(drafters)),
        verifier=verifier,
        fly=FlyParams(window=int(rng.integers(1, 7)), entropy=float(rng.choice([0.0, 0.1, 0.3, 0.6, 1.0, math.inf])),
                      topk=int(rng.integers(1, 5)), use_window=bool(rng.random() < 0.7)),
        asd=AsdParams(gate=float(rng.choice([0.0, 0.05, 0.1, 0.3, 1.0, 10.0])), cap=int(rng.integers(0, 4)),
                      budget=float(rng.choice([0.0, 0.3, 1.0, 4.0, 20.0, 1e9]))),
        p_corrupt=float(rng.uniform(0.0, 0.4)),
        p_eog=float(rng.uniform(*p_eog)),
        ngram=int(rng.integers(1, 5)),
        row_cost=float(rng.choice([0.02, 0.1, 0.4])),
    )
    # drawn last, so the cases drawn before these options existed stay as they were
    return replace(case, fly=replace(case.fly, across=bool(rng.random() < 0.6), candidates=bool(rng.random() < 0.5)))


def make_target(case: Case, cls=FakeTarget) -> FakeTarget:
    return cls(LMS[case.lm], case.n_ctx, costs=fixed_costs(case.row_cost))


def make_drafter(case: Case, target: FakeTarget):
    """The case's drafter; an adaptive case's oracle or lookup under draft-length control."""
    lm = LMS[case.lm]
    if case.drafter == "oracle":
        oracle = NoisyOracle(lm, seed=case.seed, p_corrupt=case.p_corrupt, p_eog=case.p_eog)
        return controlled(oracle, case.k, target) if case.adaptive else oracle
    if case.drafter == "pld":
        lookup = PromptLookup(lm.eog_mask, max_ngram=case.ngram)
        return LengthControl(lookup, level_prior(case.ngram), case.k, target.costs) if case.adaptive else lookup
    return NoDraft()


def make_verifier(case: Case):
    return {"strict": Strict, "fly": lambda: Fly(case.fly), "asd": lambda: Asd(case.asd)}[case.verifier]()


# ---------------------------------------------------------------- one checked run

@dataclass
class Run:
    tokens: list[int]                  # the Generation's output ids
    stats: Stats
    traces: list[dict]
    committed: list[list[int]]         # per round: the committed ids (an EOG included)
    context: list[int]                 # prompt + everything committed
    target: FakeTarget | None = None
    closed: bool = False               # closed by the consumer while it was running
    follow: Follow | None = None       # the design's account of it
    problem: str | None = None         # the first broken rule, if any
    decodes: int = 0                   # the target's decodes before the run


class Follow:
    """The design's account of a generation, kept beside the engine's: the committed context,
    the output, and a window across rounds (FLy) with the output it holds back."""

    def __init__(self, case: Case):
        self.case, self.lm = case, LMS[case.lm]
        self.context = list(case.prompt)          # prompt + everything committed (held back or not)
        self.out: list[int] = []                  # the output the events gave
        self.window: int | None = None            # P: the provisional token's index in `context`
        self.held: list[tuple[int, str]] = []     # (token, kind) committed from P on, not yet output
        self.drafted: list[bool] = []             # per committed output token: a draft token accepted

    def greedy_at(self, n: int) -> int:
        return self.lm.next_token(prefix_hash(self.context[:n]))

    def retract(self, tr: dict) -> str | None:
        """Take back from P on, as the trace says the engine did; the problem, if any."""
        P = self.window
        if tr.get("retracted") != len(self.context) - P:
            return f"retracted {tr.get('retracted')}, but {len(self.context) - P} tokens follow the provisional one"
        if tr["recovered"] != self.greedy_at(P):
            return f"recovered {tr['recovered']}, but the target's token at {P} is {self.greedy_at(P)}"
        del self.context[P:]
        del self.drafted[P - len(self.case.prompt):]
        self.context.append(tr["recovered"])
        self.drafted.append(False)
        self.window, self.held = None, []
        return None

    def round(self, event, target) -> tuple[str | None, list[int]]:
        """Check one RoundEvent against the design; (problem or None, the ids the round
        committed before any retraction)."""
        case, lm, tr, context = self.case, self.lm, event.trace, self.context
        n, n_out = len(context), len(context) - len(case.prompt)
        h = prefix_hash(context)
        draft, a, L = tr["draft"], tr["target_argmax"], tr["accepted"]
        if tr["n_past"] != n - 1:
            return (f"the round started at n_past {tr['n_past']}, expected {n - 1}: the context before it "
                    f"is {n} tokens and all but the last must be cached"), []
        if len(a) != len(draft) + 1 or len(tr["regret"]) != len(draft) or not 0 <= L <= len(draft) or len(draft) > case.k:
            return f"draft {draft}, target_argmax {a}, accepted {L} (k {case.k}) do not fit", []
        if n - 1 + len(draft) + 1 > case.n_ctx:
            return f"a batch of {len(draft) + 1} rows at n_past {n - 1} passes n_ctx {case.n_ctx}", []
        if len(draft) > case.max_tokens - n_out - 1 and len(draft):
            return f"a draft of {len(draft)} with {case.max_tokens - n_out} output tokens left", []
        hj = h                                    # the target's greedy choice after context + draft[:j]
        for j in range(len(draft) + 1):
            if a[j] != lm.next_token(hj):
                return (f"target_argmax[{j}] = {a[j]}, but greedy after the context {context} + draft "
                        f"{draft[:j]} is {lm.next_token(hj)}: the target scored a different prefix"), []
            if j < len(draft):
                z = lm.logits(hj)
                regret = 0.0 if draft[j] == a[j] else float(z.max()) - float(z[draft[j]])
                if not math.isclose(tr["regret"][j], regret, rel_tol=1e-6, abs_tol=1e-6):
                    return f"regret[{j}] = {tr['regret'][j]}, but the target's logits give {regret}", []
                hj = mix(hj, draft[j])
        closed = tr.get("closed")
        shown: list[tuple[int, str]] = []
        if closed == "retracted":                # a mismatch inside the open window, or no evidence
            if self.window is None or tr["emitted"]:
                return f"a retraction with no window open ({self.window}) or output {tr['emitted']}", []
            if draft[:L] != a[:L] or (L == len(draft) and draft) or (L < len(draft) and draft[L] == a[L]):
                return f"retracted at {L} without a mismatch there: draft {draft}, a {a}", []
            committed = []
        else:
            if tr["emitted"] != draft[:L] + [a[L]]:
                return f"emitted {tr['emitted']} != draft[:{L}] + [a[{L}]] = {draft[:L] + [a[L]]}", []
            emitted = tr["emitted"]
            eog = next((i for i, t in enumerate(emitted) if lm.is_eog(t)), None)
            m = min(len(emitted) if eog is None else eog + 1, case.max_tokens - n_out, case.n_ctx - n)
            committed = emitted[:m]
            ended = eog is not None and eog < m
            p = tr.get("provisional")
            p = p if p is not None and p < min(L, m) else None
            loose = set(tr["loose"]) | ({tr["provisional"]} if "provisional" in tr else set())
            if loose != {j for j in range(L) if draft[j] != a[j]}:
                return (f"loose {sorted(tr['loose'])} and provisional {tr.get('provisional')} are not the accepted "
                        f"mismatches of draft {draft}, a {a}, L {L}"), []
            if closed == "kept" and self.window is None:
                return "a window kept, but none was open", []
            new = [(t, LOOSE if j in loose else ACCEPTED if j < L else TARGET)
                   for j, t in enumerate(committed[: m - ended])]
            context.extend(committed)
            self.drafted += [j < L for j in range(m)]
            if closed == "kept":
                shown, self.held, self.window = self.held, [], None
            if p is not None:
                self.window = n + p
                shown += new[:p]
                self.held = new[p:]
            elif self.window is not None:
                self.held += new
            else:
                shown += new
            end = ended or len(context) - len(case.prompt) >= case.max_tokens or len(context) >= case.n_ctx
            if bool(tr.get("retracted")) != (self.window is not None and end):
                return (f"retracted {tr.get('retracted')} at the end {end} with the window at {self.window}: "
                        f"a window still open at the end, and only then, is retracted"), committed
        if closed == "retracted" or tr.get("retracted"):
            problem = self.retract(tr)
            if problem:
                return problem, committed
            shown += [] if lm.is_eog(context[-1]) else [(context[-1], TARGET)]
        if (self.window is not None) != ("window" in tr):
            return f"the window is at {self.window}, but the trace's is {tr.get('window')}", committed
        expected = tuple(t for t, _ in shown)
        if event.tokens != expected:
            return f"event tokens {event.tokens}, expected {expected} (trace {tr})", committed
        if any(lm.is_eog(t) for t in event.tokens):
            return f"an EOG id in the output {event.tokens}", committed
        if event.kinds != tuple(kind for _, kind in shown):
            return f"kinds {event.kinds}, expected {tuple(kind for _, kind in shown)}", committed
        if tr.get("held", 0) != len(self.held):
            return f"held {tr.get('held', 0)}, expected {len(self.held)}", committed
        self.out += expected
        cache = target.tokens.tolist()
        if cache != context[:-1]:
            return (f"after the round the cache holds {cache} (n_past {target.n_past}), but it must hold "
                    f"the context minus its last token {context[:-1]}"), committed
        return None, committed


def run_engine(case: Case, target=None, drafter=None, verifier=None, stop_after: int | None = None) -> Run:
    """Generate for `case` (on `target`, default a fresh FakeTarget), checking every round
    and the final stats; with `stop_after`, close the Generation after that many rounds (if
    it is still running). Exceptions are reported as the run's problem."""
    target = target if target is not None else make_target(case)
    drafter = drafter if drafter is not None else make_drafter(case, target)
    verifier = verifier if verifier is not None else make_verifier(case)
    config = EngineConfig(k=case.k, max_tokens=case.max_tokens, trace=True)
    follow = Follow(case)
    run = Run([], Stats(), [], [], follow.context, target, decodes=getattr(target, "decodes", 0), follow=follow)
    ends = []
    try:
        gen = Engine(target, drafter, verifier, config).generate(np.array(case.prompt, dtype=np.int32), ends.append)
        rounds = iter(gen)
        while True:
            if stop_after is not None and len(run.traces) == stop_after:
                gen.close()
                run.closed = True
                break
            event = next(rounds, None)
            if event is None:
                break
            problem, committed = follow.round(event, target)
            if problem is not None:
                gen.close()
                run.problem = f"round {event.index}: {problem}"
                return run
            run.traces.append(event.trace)
            run.committed.append(committed)
        run.tokens, run.stats = list(gen.tokens), gen.stats
        gen.close()                        # after the end: changes nothing
        if len(ends) != 1 or ends[0] is not gen:
            run.problem = f"on_end was called {len(ends)} times"
            return run
    except Exception as e:  # noqa: BLE001 - any exception is a counterexample
        run.problem = f"raised {type(e).__name__}: {e}"
        return run
    run.problem = check_final(case, run, target)
    return run


def check_final(case: Case, run: Run, target) -> str | None:
    s, out, lm = run.stats, run.tokens, LMS[case.lm]
    made = run.context[len(case.prompt):]
    ended = bool(made) and lm.is_eog(made[-1])                # an EOG committed last
    shown = run.follow.out
    natural = ("eog" if ended else "max_tokens" if len(out) >= case.max_tokens
               else "context" if len(run.context) >= case.n_ctx else None)
    # closed after its last event, a generation keeps the reason it ended for
    expected_stop = ("interrupted" if run.closed and not run.traces     # closed before its first round
                     else natural or ("interrupted" if run.closed else "?"))
    pairs = list(zip(run.traces, run.committed))
    retracted = [t.get("retracted", 0) for t in run.traces]
    seen = [min(t["accepted"] + 1, len(t["draft"])) for t in run.traces]
    checks = [
        (out == shown, f"Generation.tokens {out} != the events' tokens {shown}"),
        (run.follow.window is None or run.closed, f"a window still open at {run.follow.window} at the end"),
        (s.stop == expected_stop, f"stop {s.stop!r}, expected {expected_stop!r}"),
        (target.high_water <= case.n_ctx, f"the cache held {target.high_water} > n_ctx {case.n_ctx} cells"),
        (s.rounds == len(run.traces), f"stats.rounds {s.rounds} != {len(run.traces)} events"),
        (s.emitted == sum(map(len, run.committed)) - sum(retracted) + sum(map(bool, retracted)) == len(made),
         f"stats.emitted {s.emitted}, committed {sum(map(len, run.committed))}, retracted {sum(retracted)}, "
         f"the context grew by {len(made)}"),
        (run.closed or len(made) == len(out) + ended, f"{len(made)} tokens made, output {len(out)} + eog {ended}"),
        (s.retracted == sum(retracted) and s.retractions == sum(map(bool, retracted)),
         f"stats.retracted {s.retracted} in {s.retractions}, the trace's {retracted}"),
        (s.drafted == sum(len(t["draft"]) for t in run.traces), f"stats.drafted {s.drafted}"),
        (s.accepted == sum(run.follow.drafted), f"stats.accepted {s.accepted}, but {sum(run.follow.drafted)} accepted "
                                                  f"draft tokens stayed"),
        (s.loose == sum(sum(j < len(c) for j in t["loose"]) + (t.get("closed") == "kept") for t, c in pairs),
         f"stats.loose {s.loose}"),
        (s.mismatches == sum(sum(d != a for d, a in zip(t["draft"][:n], t["target_argmax"]))
                             for t, n in zip(run.traces, seen)),
         f"stats.mismatches {s.mismatches}: not the native mismatches of the positions decided"),
        # The prompt rides in the first round's decode: a decode a round, none of its own.
        (not hasattr(target, "decodes") or target.decodes - run.decodes == s.rounds,
         f"{target.decodes - run.decodes} target decodes for {s.rounds} rounds"),
        (s.first_tokens == (len(run.committed[0]) - retracted[0] + bool(retracted[0]) if run.committed else 0),
         f"stats.first_tokens {s.first_tokens}, the first round committed {run.committed[:1]}"),
        (s.prompt_reused + s.prompt_evaluated == len(case.prompt) or (run.closed and not run.traces),
         f"prompt reused {s.prompt_reused} + "
         f"evaluated {s.prompt_evaluated} != {len(case.prompt)}"),
    ]
    return next((msg for ok, msg in checks if not ok), None)


def report(failures: list[str], n: int) -> str:
    return f"{len(failures)} of {n} cases failed; the first:\n" + "\n".join(failures[:3])


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- 1. rollback: strict equals greedy

def follow_up_prompt(rng: np.random.Generator, case: Case, context: list[int]) -> tuple[int, ...]:
    """A second request's prompt: the conversation so far plus more, an edit of the first
    prompt, the same prompt again, or something unrelated; shorter than the context."""
    V = LMS[case.lm].n_vocab
    style = rng.integers(4)
    if style == 0:
        prompt = context + rng.integers(V, size=rng.integers(0, 6)).tolist()
    elif style == 1:
        cut = int(rng.integers(0, len(case.prompt) + 1))
        prompt = list(case.prompt[:cut]) + rng.integers(V, size=rng.integers(1, 8)).tolist()
    elif style == 2:
        prompt = list(case.prompt)
    else:
        prompt = rng.integers(V, size=rng.integers(1, 20)).tolist()
    return tuple(prompt[: case.n_ctx - 1]) or (int(rng.integers(V)),)


def rollback_counterexample(seed: int, target_cls=FakeTarget) -> str | None:
    """Property 1 on the case of `seed` (strict, any drafter), on a target of class
    `target_cls`: every round leaves the cache at the context minus its last token, the output
    is plain greedy decoding's, and a second request on the same (rolled back) target reuses
    the right prefix and generates what a fresh target does. The first problem, or None."""
    case = random_case(seed, verifier="strict")
    lm = LMS[case.lm]
    target = make_target(case, target_cls)
    first = run_engine(case, target)
    if first.problem:
        return f"seed {seed}, {case}: {first.problem}"
    expected, stop = greedy(lm, case.prompt, case.max_tokens, case.n_ctx)
    if (first.tokens, first.stats.stop) != (expected, stop):
        return f"seed {seed}, {case}: output {first.tokens} stop {first.stats.stop}, greedy {expected} stop {stop}"

    rng = np.random.default_rng([seed, 1])
    second = replace(case, prompt=follow_up_prompt(rng, case, first.context), seed=seed + 1_000_000)
    cached = target.tokens.tolist()
    again = run_engine(second, target)
    where = f"seed {seed}, second request {second} after {cached} was cached"
    if again.problem:
        return f"{where}: {again.problem}"
    reused = min(common_prefix(cached, second.prompt), len(second.prompt) - 1)
    if again.stats.prompt_reused != reused:
        return f"{where}: reused {again.stats.prompt_reused} prompt tokens, expected {reused}"
    fresh = run_engine(second)
    expected, stop = greedy(lm, second.prompt, second.max_tokens, second.n_ctx)
    if (again.tokens, again.stats.stop, again.traces) != (fresh.tokens, fresh.stats.stop, fresh.traces):
        return f"{where}: output {again.tokens}, on a fresh target {fresh.tokens}"
    if (again.tokens, again.stats.stop) != (expected, stop):
        return f"{where}: output {again.tokens} stop {again.stats.stop}, greedy {expected} stop {stop}"
    return None


def first_rollback_counterexample(seeds, target_cls=FakeTarget) -> str | None:
    for seed in seeds:
        problem = rollback_counterexample(seed, target_cls)
        if problem is not None:
            return problem
    return None


def test_strict_equals_greedy_and_rolls_back():
    """Strict with any drafter (the noisy oracle, prompt lookup, none): plain greedy output,
    a cache rolled back exactly after every round, and a second request on it as on a fresh one."""
    problem = first_rollback_counterexample(range(N_CASES))
    assert problem is None, problem


def each_run(failures: list, adjust=None, **kw):
    """(where, case, run) for each of N_CASES random cases (`random_case(seed, **kw)`, then
    `adjust(seed, case)` if given) run on a fresh target. A run that broke run_engine's own
    per-round checks goes to `failures` instead."""
    for seed in range(N_CASES):
        case = random_case(seed, **kw)
        if adjust is not None:
            case = adjust(seed, case)
        run = run_engine(case)
        where = f"seed {seed}, {case}"
        if run.problem:
            failures.append(f"{where}: {run.problem}")
            continue
        yield where, case, run


def unlike_greedy(case: Case, run: Run) -> str | None:
    """Where a strict run's output or stop differs from plain greedy decoding's; None if not."""
    expected, stop = greedy(LMS[case.lm], case.prompt, case.max_tokens, case.n_ctx)
    if (run.tokens, run.stats.stop) != (expected, stop):
        return f"output {run.tokens} stop {run.stats.stop}, greedy {expected} stop {stop}"
    return None


# ---------------------------------------------------------------- 2. the context end

def test_context_end():
    """Tight contexts, every verifier: the cache never holds more than n_ctx cells, and a
    generation that fills the context stops with "context" (strict: where greedy does)."""
    failures, filled = [], 0
    for where, case, run in each_run(failures, room=(1, 12), max_tokens=(0, 60)):
        n_final = len(case.prompt) + run.stats.emitted
        if n_final > case.n_ctx:
            failures.append(f"{where}: {n_final} tokens in a context of {case.n_ctx}")
        if run.stats.stop == "context":
            filled += 1
            if n_final != case.n_ctx:
                failures.append(f"{where}: stop 'context' with {n_final} of {case.n_ctx} cells")
        if case.verifier == "strict" and (problem := unlike_greedy(case, run)):
            failures.append(f"{where}: {problem}")
    assert not failures, report(failures, N_CASES)
    assert filled > N_CASES // 5, f"only {filled} of {N_CASES} cases reached the context's end"


# ---------------------------------------------------------------- 3. EOG inside a draft

def test_eog_inside_a_draft():
    """EOG-heavy models and drafts full of EOG ids, every verifier: the output stops at the
    first EOG the target commits, the EOG id is never output, and nothing after it is committed."""
    failures, stopped, eog_inside = [], 0, 0
    for where, case, run in each_run(failures, lms=EOG_HEAVY, p_eog=(0.05, 0.4),
                                     drafters=("oracle", "oracle", "oracle", "pld")):
        lm = LMS[case.lm]
        eog_inside += any(lm.is_eog(t) for tr in run.traces for t in tr["draft"][:-1])
        committed = run.context[len(case.prompt):]
        eogs = [i for i, t in enumerate(committed) if lm.is_eog(t)]
        if any(lm.is_eog(t) for t in run.tokens):
            failures.append(f"{where}: an EOG id in the output {run.tokens}")
        if run.stats.stop == "eog":
            stopped += 1
            if eogs != [len(committed) - 1]:
                failures.append(f"{where}: committed {committed}: the EOG must be the last and only one")
            if run.target.tokens.tolist() != run.context[:-1]:
                failures.append(f"{where}: the cache holds {run.target.tokens.tolist()} after the EOG")
            if run.stats.emitted != len(run.tokens) + 1:
                failures.append(f"{where}: emitted {run.stats.emitted} for {len(run.tokens)} output + EOG")
        elif eogs:
            failures.append(f"{where}: stop {run.stats.stop} though {committed} commits an EOG")
        if case.verifier == "strict" and (problem := unlike_greedy(case, run)):
            failures.append(f"{where}: {problem}")
    assert not failures, report(failures, N_CASES)
    assert stopped > N_CASES // 5, f"only {stopped} of {N_CASES} cases stopped at an EOG"
    assert eog_inside > N_CASES // 10, f"only {eog_inside} of {N_CASES} cases drafted an EOG before a draft's end"


# ---------------------------------------------------------------- 4. the max_tokens cut

def test_max_tokens_cut():
    """Small max_tokens, every verifier: output length <= max_tokens, equal when the stop is
    "max_tokens"; stats.emitted counts the committed tokens, an EOG included."""
    failures, cut = [], 0
    for where, case, run in each_run(failures, room=(10, 60), max_tokens=(0, 12)):
        s = run.stats
        if len(run.tokens) > case.max_tokens:
            failures.append(f"{where}: {len(run.tokens)} output tokens > max_tokens")
        if s.stop == "max_tokens":
            cut += 1
            if len(run.tokens) != case.max_tokens:
                failures.append(f"{where}: stop max_tokens after {len(run.tokens)} tokens")
        if s.emitted != len(run.tokens) + (s.stop == "eog"):
            failures.append(f"{where}: emitted {s.emitted}, output {len(run.tokens)}, stop {s.stop}")
        if case.max_tokens == 0 and (s.rounds, run.tokens, s.stop) != (0, [], "max_tokens"):
            failures.append(f"{where}: max_tokens 0 ran {s.rounds} rounds, output {run.tokens}, stop {s.stop}")
    assert not failures, report(failures, N_CASES)
    assert cut > N_CASES // 2, f"only {cut} of {N_CASES} cases were cut at max_tokens"


# ---------------------------------------------------------------- 5. ASD's ledger; strict limits

def test_asd_ledger():
    """The ledger holds exactly the regret of the committed draft tokens, never more than B,
    and budget_left == B - spent; B = 0 is strict."""
    failures, exceptions = [], 0

    def no_budget_sometimes(seed, case):
        return replace(case, asd=replace(case.asd, budget=0.0)) if seed % 4 == 0 else case

    for where, case, run in each_run(failures, no_budget_sometimes, verifier="asd"):
        B = case.asd.budget
        s = run.stats
        exceptions += s.loose > 0
        spent, ledger_ok = 0.0, True
        for tr, c in zip(run.traces, run.committed):
            spent += sum(tr["regret"][: min(tr["accepted"], len(c))])
            ledger_ok &= math.isclose(tr["budget_spent"], spent, rel_tol=1e-9, abs_tol=1e-9)
        if not ledger_ok:
            failures.append(f"{where}: the trace's budget_spent {[t['budget_spent'] for t in run.traces]} "
                            f"is not the running regret of the committed draft tokens")
        if s.rounds == 0:
            if s.budget_spent is not None:
                failures.append(f"{where}: no round, but budget_spent {s.budget_spent}")
            continue
        if not math.isclose(s.budget_spent, spent, rel_tol=1e-9, abs_tol=1e-9):
            failures.append(f"{where}: budget_spent {s.budget_spent}, committed regret {spent}")
        if s.budget_spent > B + 1e-9:
            failures.append(f"{where}: spent {s.budget_spent} > B {B}")
        if not math.isclose(s.budget_left, B - s.budget_spent, rel_tol=1e-9, abs_tol=1e-9):
            failures.append(f"{where}: budget_left {s.budget_left} != B - spent {B - s.budget_spent}")
        if B == 0:
            strict_run = run_engine(replace(case, verifier="strict"))
            if run.tokens != strict_run.tokens:
                failures.append(f"{where}: B = 0 output {run.tokens}, strict {strict_run.tokens}")
            if s.loose or s.budget_spent != 0:
                failures.append(f"{where}: B = 0 with {s.loose} exceptions, spent {s.budget_spent}")
    assert not failures, report(failures, N_CASES)
    assert exceptions > N_CASES // 10, f"only {exceptions} of {N_CASES} cases accepted an exception"


def test_fly_without_gate_is_strict():
    """FLy with theta = inf (any window, top-m, with or without the window) is strict: the same
    output, rounds and acceptance as the strict verifier on the same drafts."""
    failures = []
    for seed in range(N_CASES):
        case = random_case(seed, verifier="fly")
        case = replace(case, fly=replace(case.fly, entropy=math.inf))
        run, strict_run = run_engine(case), run_engine(replace(case, verifier="strict"))
        where = f"seed {seed}, {case}"
        problem = run.problem or strict_run.problem
        if problem:
            failures.append(f"{where}: {problem}")
            continue
        a, b = run.stats, strict_run.stats
        if (run.tokens, a.stop, a.rounds, a.accepted, a.loose) != (strict_run.tokens, b.stop, b.rounds, b.accepted, 0):
            failures.append(f"{where}: FLy(theta=inf) {run.tokens} ({a.rounds} rounds, {a.accepted} accepted, "
                            f"{a.loose} loose), strict {strict_run.tokens} ({b.rounds} rounds, {b.accepted} accepted)")
    assert not failures, report(failures, N_CASES)


# ---------------------------------------------------------------- closing a generation early

def test_close_mid_generation():
    """A consumer that stops early (a closed client, Ctrl-C), every verifier: after close() the
    stop is "interrupted" (unless the last event it saw had ended the generation), the output is what was yielded, the cache holds the context but its
    last token (run_engine checks both), and the next request on that target generates what
    it would on a fresh one."""
    failures, closed = [], 0
    for seed in range(N_CASES):
        case = random_case(seed)
        rng = np.random.default_rng([seed, 2])
        target = make_target(case)
        run = run_engine(case, target, stop_after=int(rng.integers(0, 6)))
        where = f"seed {seed}, {case}"
        if run.problem:
            failures.append(f"{where}: {run.problem}")
            continue
        closed += run.closed
        second = replace(case, prompt=follow_up_prompt(rng, case, run.context), seed=seed + 1_000_000)
        again, fresh = run_engine(second, target), run_engine(second)
        where = f"seed {seed}, second request {second} after {run.stats.rounds} rounds of the first"
        problem = again.problem or fresh.problem
        if problem:
            failures.append(f"{where}: {problem}")
        elif (again.tokens, again.stats.stop, again.traces) != (fresh.tokens, fresh.stats.stop, fresh.traces):
            failures.append(f"{where}: output {again.tokens}, on a fresh target {fresh.tokens}")
    assert not failures, report(failures, N_CASES)
    assert closed > N_CASES // 2, f"only {closed} of {N_CASES} generations were closed early"


# ---------------------------------------------------------------- 6. the checker can fail

class KeepsOneTooMany(FakeTarget):
    """A wrong rollback: one rejected token stays in the cache."""

    def truncate(self, n_keep: int) -> None:
        super().truncate(n_keep + 1)


class NeverTruncates(FakeTarget):
    """A missing rollback: rejected tokens all stay."""

    def truncate(self, n_keep: int) -> None:
        pass


def test_broken_rollback_is_caught():
    """The rollback property can fail: on targets that roll back wrongly it reports a
    counterexample, both in a request's own rounds and in a second request's prefix reuse."""
    for cls in (KeepsOneTooMany, NeverTruncates):
        problem = first_rollback_counterexample(range(200), cls)
        assert problem is not None, f"the rollback property did not notice {cls.__name__}"
        assert problem.startswith("seed "), problem
        problems = [rollback_counterexample(seed, cls) for seed in range(100)]
        in_rounds = [p for p in problems if p is not None and "second request" not in p]
        assert in_rounds, f"no case noticed {cls.__name__} within a request's own rounds"


# ---------------------------------------------------------------- the fake itself

def test_fake_target_contract():
    lm = LMS[0]
    rng = np.random.default_rng(0)
    t = FakeTarget(lm, n_ctx=16)
    assert t.decode([3, 4, 5]) is None and t.n_past == 3
    rows = t.decode([6, 7], logits_from=0)
    assert rows.shape == (2, lm.n_vocab) and rows.dtype == np.float32
    assert np.array_equal(rows[1], lm.logits(prefix_hash([3, 4, 5, 6, 7])))
    t.truncate(2)
    assert t.tokens.tolist() == [3, 4]
    other = t.decode([9, 6, 7], logits_from=2)                      # a different earlier token
    assert not np.array_equal(other[0], rows[1])
    assert t.reuse_prefix(np.array([3, 4, 9, 1])) == 3 and t.n_past == 3
    assert t.reuse_prefix(np.array([3, 4, 9])) == 2                  # the last token stays out
    assert t.reuse_prefix(np.array([8, 4])) == 0 and t.n_past == 0
    t.decode(rng.integers(lm.n_vocab, size=16))
    try:
        t.decode([1])
    except Exception as e:                                          # noqa: BLE001
        assert "context full" in str(e)
    else:
        raise AssertionError("decoding past n_ctx must raise")
    # both sides of FLy's entropy gate exist, and greedy sometimes ends at an EOG
    from flylocal.decoding.verifiers.fly import topk_entropy
    h = [topk_entropy(lm.table[s], 3) for s in range(200)]
    assert min(h) < 0.05 and max(h) > 0.3
    ends = sum(greedy(lm, tuple(rng.integers(lm.n_vocab, size=3).tolist()), 40, 64)[1] == "eog" for _ in range(50))
    assert 0 < ends < 50


def test_no_native_imports():
    """The fake backend and these tests never load llama.cpp or the runtime."""
    code = ("import sys; sys.path.insert(0, 'tests'); import test_engine_properties; "
            "bad = [m for m in ('llama_cpp', 'flylocal.llama.runtime', 'flylocal.loader') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- sampling: the seed fixes the tokens

def test_seeded_sampling_is_plain_sampling_whatever_the_drafts():
    """At temperature > 0 with a seed, strict commits plain sampling's tokens (no drafter, the
    same seed) token for token, whatever is drafted and however long the drafts are, because a
    position's noise depends on the seed and the position only; another seed samples others."""
    from flylocal.decoding.engine import generate_all
    from flylocal.decoding.sampling import SamplingParams

    failures, differs, n = [], 0, N_CASES // 4
    for seed in range(n):
        case = random_case(seed, verifier="strict", max_tokens=(1, 30))
        sampling = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=seed)

        def out(drafter, k, s=sampling):
            engine = Engine(make_target(case), drafter, Strict(), EngineConfig(max_tokens=case.max_tokens, k=k,
                                                                              sampling=s))
            return generate_all(engine, np.asarray(case.prompt, dtype=np.int32))[0]

        plain = out(NoDraft(), 0)
        for k in (1, 3, 8):
            got = out(NoisyOracle(LMS[case.lm], seed=seed + k, p_short=0.5), k)
            if got != plain:
                failures.append(f"seed {seed}, k {k}, {case}: {got}, plain sampling {plain}")
        differs += out(NoDraft(), 0, replace(sampling, seed=seed + 1_000_000)) != plain
    assert not failures, report(failures, n)
    assert differs > n // 2, f"another seed changed the output in only {differs} of {n} cases"
