"""FLy's window across rounds (docs/verifiers.md, "FLy"), over thousands of random cases on the fake
backend (tests/fake_backend.py), each run checked round by round by test_engine_properties'
`Follow`: the engine's output equals a slow reference implementation of the rule, token by
token; every kept loose token had the gate open (with `candidates`, for one of the target's top
m tokens) and W-1 native matches after it; nothing taken back was ever output; and a target that took tokens back serves the next request as a fresh
one does."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from fake_backend import prefix_hash
from flylocal.decoding.verifiers.fly import FlyParams, topk_entropy
from test_engine_properties import LMS, N_CASES, follow_up_prompt, make_target, random_case, report, run_engine


def across_case(seed: int, **kw):
    """A random FLy case with the window across rounds, a gate that opens often enough."""
    case = random_case(seed, verifier="fly", **kw)
    rng = np.random.default_rng([seed, 7])
    fly = FlyParams(window=int(rng.integers(1, 9)), entropy=float(rng.choice([0.0, 0.1, 0.3, 0.6, math.inf])),
                    topk=int(rng.integers(1, 5)), across=True, candidates=bool(rng.random() < 0.5),
                    echo=int(rng.choice([0, 2, 4])))      # 2: the echo rule fires often
    return replace(case, fly=fly)


def gate_open(z: np.ndarray, token: int, p: FlyParams) -> bool:
    """The gate, written out (but for the end rule, checked where it is called): the target unsure
    at the position, and (with `candidates`) the draft's token at least as likely as the target's
    m-th choice."""
    unsure = topk_entropy(z, p.topk) >= p.entropy
    return unsure and (not p.candidates or z[token] >= np.sort(z)[-min(p.topk, len(z))])


def echoes(seq: list[int], n: int) -> bool:
    """Whether the last n tokens of `seq` already occur earlier in it (the gate's echo rule)."""
    return n > 0 and len(seq) > n and any(seq[i:i + n] == seq[-n:] for i in range(len(seq) - n))


def reference(case, drafts: list[list[int]]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The rule applied one token at a time to the same drafts, on plain lists: (the committed
    sequence, the output, (position, token) of every kept loose token). The target's choice at
    a position is the LM's greedy token after the prefix; nothing is batched or cached."""
    lm, p = LMS[case.lm], case.fly
    ctx, prompt = list(case.prompt), len(case.prompt)
    window = None                     # [P, the target's token at P, native matches, empty rounds]
    kept = []

    def target_at(seq):
        return lm.next_token(prefix_hash(seq))

    def retract():
        nonlocal window
        del ctx[window[0]:]
        ctx.append(window[1])
        window = None

    def ended():
        return (len(ctx) > prompt and lm.is_eog(ctx[-1])) or len(ctx) - prompt >= case.max_tokens \
            or len(ctx) >= case.n_ctx

    for draft in drafts:
        assert not ended()
        if not draft and window is not None:
            window[3] += 1
            if window[3] >= p.window - 1:
                retract()
                continue
        base, seq = list(ctx), []          # the round decides on its whole draft, then commits
        for j, d in enumerate(draft + [None]):
            a = target_at(base + draft[:j])
            if d is None:                       # the bonus token
                seq.append(a)
                break
            if d == a:
                seq.append(d)
                if window is not None:
                    window[2] += 1
                    if window[2] >= p.window - 1:
                        kept.append((window[0], (base + seq)[window[0]]))
                        window = None
                continue
            if window is not None:              # a mismatch inside the window
                if window[0] < len(base):
                    retract()
                    seq = None
                else:                           # opened in this round: rejected where it stood
                    seq = seq[: window[0] - len(base)] + [window[1]]
                    window = None
                break
            if (p.candidates and (lm.is_eog(a) or echoes((base + draft[: j + 1])[prompt:], p.echo))) \
                    or not gate_open(lm.logits(prefix_hash(base + draft[:j])), d, p):
                seq.append(a)                   # rejected: the target's token
                break
            seq.append(d)
            if p.window == 1:
                kept.append((len(base) + j, d))
            else:
                window = [len(base) + j, a, 0, 0]
        if seq is None:
            continue
        eog = next((i for i, t in enumerate(seq) if lm.is_eog(t)), None)
        m = min(len(seq) if eog is None else eog + 1, case.max_tokens - (len(base) - prompt), case.n_ctx - len(base))
        ctx.extend(seq[:m])
        if window is not None and window[0] >= len(ctx):
            window = None                       # the cut came before the provisional token
        if window is not None and ended():
            retract()
    kept = [(P, t) for P, t in kept if P < len(ctx) and ctx[P] == t]
    made = ctx[prompt:]
    out = made[:-1] if made and lm.is_eog(made[-1]) else made
    return ctx, out, kept


def checked_run(case):
    """(the engine's run of `case`, checked round by round; the problem, or None; the reference's
    kept loose tokens). A run that ended by itself is compared with the reference, token by token."""
    run, kept = run_engine(case), []
    if run.problem:
        return run, run.problem, kept
    if run.stats.stop in ("eog", "max_tokens", "context"):
        ctx, out, kept = reference(case, [t["draft"] for t in run.traces])
        if (run.context, run.tokens) != (ctx, out):
            return run, f"output {run.tokens}, the reference's {out}", kept
    return run, None, kept


def test_the_engine_follows_the_reference_and_keeps_only_what_the_rule_allows():
    failures, loose, retracted, idle = [], 0, 0, 0
    for seed in range(N_CASES):
        case = across_case(seed)
        run, problem, kept = checked_run(case)
        where = f"seed {seed}, {case}"
        if problem:
            failures.append(f"{where}: {problem}")
            continue
        # every kept loose token: the gate was open and W-1 native matches followed it
        lm, n_prompt = LMS[case.lm], len(case.prompt)
        for P, token in kept:
            h = prefix_hash(run.context[:P])
            target = lm.next_token(h)
            echo = case.fly.candidates and echoes(run.context[n_prompt:P + 1], case.fly.echo)
            if token == target or (case.fly.candidates and lm.is_eog(target)) or echo \
                    or not gate_open(lm.logits(h), token, case.fly):
                failures.append(f"{where}: the token at {P} was kept loose without an open gate")
        made = run.context[n_prompt:]
        if run.tokens != made[: len(run.tokens)]:
            failures.append(f"{where}: output {run.tokens} is not the committed sequence {made}")
        loose += run.stats.loose
        retracted += run.stats.retractions
        idle += any(t.get("closed") == "retracted" and not t["draft"] for t in run.traces)
    assert not failures, report(failures, N_CASES)
    assert loose > N_CASES // 20 and retracted > N_CASES // 20 and idle > N_CASES // 300, (loose, retracted, idle)


def test_the_targets_end_of_generation_is_never_overridden():
    """The gate always open by entropy, every token a candidate, drafts often wrong: where the
    target's token ends the generation, the draft's never replaces it, and the engine still
    follows the reference."""
    failures, held = [], 0
    for seed in range(N_CASES):
        case = across_case(seed)
        rng = np.random.default_rng([seed, 11])
        case = replace(case, drafter="oracle", p_corrupt=0.5, p_eog=0.0,
                       fly=replace(case.fly, window=int(rng.integers(1, 3)), entropy=0.0, topk=64, candidates=True))
        run, problem, _ = checked_run(case)
        if problem:
            failures.append(f"seed {seed}, {case}: {problem}")
            continue
        lm = LMS[case.lm]
        held += any(t["accepted"] < len(t["draft"]) and lm.is_eog(t["target_argmax"][t["accepted"]])
                    and t["draft"][t["accepted"]] != t["target_argmax"][t["accepted"]] for t in run.traces)
    assert not failures, report(failures, N_CASES)
    assert held > N_CASES // 20, held


def test_a_window_longer_than_any_draft_still_loosens():
    failures, loosened = [], 0
    for seed in range(N_CASES // 2):
        case = across_case(seed)
        case = replace(case, k=int(np.random.default_rng(seed).integers(1, 4)), max_tokens=40, drafter="oracle",
                       p_corrupt=0.1, fly=replace(case.fly, window=6, entropy=0.0))
        run = run_engine(case)
        if run.problem:
            failures.append(f"seed {seed}, {case}: {run.problem}")
        loosened += run.stats.loose > 0
    assert not failures, report(failures, N_CASES // 2)
    assert loosened > N_CASES // 40, loosened        # within rounds: none can (k < W)


def test_after_a_retraction_the_target_serves_the_next_request_as_a_fresh_one():
    failures, after = [], 0
    for seed in range(N_CASES):
        case = across_case(seed)
        target = make_target(case)
        first = run_engine(case, target)
        if first.problem or not first.stats.retractions:
            failures += [f"seed {seed}: {first.problem}"] if first.problem else []
            continue
        after += 1
        rng = np.random.default_rng([seed, 3])
        second = replace(case, prompt=follow_up_prompt(rng, case, first.context), seed=seed + 1_000_000)
        again, fresh = run_engine(second, target), run_engine(second)
        problem = again.problem or fresh.problem
        if problem or (again.tokens, again.traces) != (fresh.tokens, fresh.traces):
            failures.append(f"seed {seed}, second {second}: {problem or (again.tokens, fresh.tokens)}")
    assert not failures, report(failures, N_CASES)
    assert after > N_CASES // 20, after


def kept_positions(traces: list[dict]) -> set[int]:
    """Context positions of the kept loose tokens, from the trace: a round's loose positions, and
    a provisional one whose window a later round kept."""
    kept, pending = set(), None
    for row in traces:
        at = row["n_past"] + 1                          # the position of draft token 0
        if row.get("closed") == "kept":
            kept.add(pending)
        if row.get("closed") or row.get("retracted"):
            pending = None
        kept |= {at + j for j in row["loose"]}
        if "provisional" in row:
            pending = at + row["provisional"]
    return kept


def test_seeded_sampling_stays_the_targets_own_through_retractions():
    """At temperature > 0 with a seed, across retractions: the same seed gives the same tokens,
    and every output token but the kept loose ones is plain sampling's at its position (the
    target's sample after the tokens before it, with that position's noise), the recovered token
    put in after a retraction included."""
    from flylocal.decoding.drafters import NoDraft
    from flylocal.decoding.engine import generate_all
    from flylocal.decoding.sampling import SamplingParams
    from flylocal.decoding.verifiers.fly import Fly
    from flylocal.decoding.verifiers.strict import Strict
    from test_engine_properties import Engine, EngineConfig, make_drafter

    failures, retracted, n = [], 0, N_CASES // 5
    for seed in range(n):
        case = across_case(seed, max_tokens=(1, 30))
        case = replace(case, fly=replace(case.fly, entropy=0.0, window=int(np.random.default_rng(seed).integers(2, 5))))
        sampling = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=seed)

        def fly_run():
            target = make_target(case)
            engine = Engine(target, make_drafter(case, target), Fly(case.fly),
                            EngineConfig(k=case.k, max_tokens=case.max_tokens, trace=True, sampling=sampling))
            gen = engine.generate(np.asarray(case.prompt, dtype=np.int32))
            traces = [e.trace for e in gen]
            return list(gen.tokens), gen.stats, traces

        def plain_next(prefix):
            engine = Engine(make_target(case), NoDraft(), Strict(), EngineConfig(max_tokens=1, k=0, sampling=sampling))
            return generate_all(engine, np.asarray(list(case.prompt) + prefix, dtype=np.int32))[0][:1]

        tokens, stats, traces = fly_run()
        if fly_run()[0] != tokens:
            failures.append(f"seed {seed}: the same seed gave other tokens")
            continue
        retracted += stats.retractions > 0
        kept = {P - len(case.prompt) for P in kept_positions(traces)}
        for i, t in enumerate(tokens):
            if i not in kept and plain_next(tokens[:i]) != [t]:
                failures.append(f"seed {seed}, {case}: token {i} ({t}) is not plain sampling's {plain_next(tokens[:i])}")
                break
    assert not failures, report(failures, n)
    assert retracted > n // 10, retracted
