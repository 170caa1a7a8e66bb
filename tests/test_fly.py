"""FLy's rules, each on a hand-made case that fails if the rule is broken (docs/verifiers.md, "FLy")."""

import math
from dataclasses import replace

import numpy as np
import pytest

from flylocal.decoding.verifiers.base import emitted_tokens
from flylocal.decoding.verifiers.fly import FlyParams, fly, topk_entropy
from flylocal.decoding.verifiers.strict import strict

V = 16
UNSURE, SURE = "unsure", "sure"


def case(target, draft, unsure=()):
    """Target logits whose argmax is `target` ([k+1] ids). Rows in `unsure` are nearly flat
    (top-3 entropy about 0.6 nats); the others are confident (entropy about 0)."""
    k1 = len(target)
    logits = np.zeros((k1, V), dtype=np.float32)
    for j, t in enumerate(target):
        if j in unsure:
            logits[j, :] = 1.0
            logits[j, t] = 1.2
        else:
            logits[j, t] = 20.0
    d = np.asarray(draft, dtype=np.int32)
    a = logits.argmax(axis=1).astype(np.int32)
    assert a.tolist() == list(target)
    return d, a, logits


P = FlyParams(window=3, entropy=0.3, topk=3)


def test_topk_entropy_matches_a_direct_softmax():
    rng = np.random.default_rng(0)
    z = rng.normal(size=1000).astype(np.float32) * 3
    p = np.exp(z.astype(np.float64) - z.max())
    p /= p.sum()
    top = np.sort(p)[-3:]
    assert topk_entropy(z, 3) == pytest.approx(float(-(top * np.log(top)).sum()), rel=1e-5)


def test_gate_rejects_a_low_entropy_mismatch():
    # mismatch at 1 with a full window after it, but the target is confident there
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6])
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()
    assert dec.entropy[1] < 0.3


def test_window_accepts_high_entropy_mismatch_followed_by_native_matches():
    # W = 3: mismatch at 1, then 2 native matches (2, 3), and 1 + 3 < 6
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    dec = fly(d, a, z, P)
    assert dec.loose == (1,)
    assert dec.accepted == 6
    assert dec.entropy[1] > 0.3 and np.isnan(dec.entropy[[0, 2, 3, 4, 5]]).all()


def test_second_mismatch_inside_the_window_spoils_it():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 9, 5, 6], unsure={1, 3})
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()


def test_mismatch_whose_window_reaches_the_end_is_rejected():
    # k = 5, W = 3: j = 2 gives j + W = 5 >= k, although the matches after it are native
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 9, 4, 5], unsure={2})
    assert fly(d, a, z, P).accepted == 2
    # one token more and the same mismatch is accepted (j + W = 5 < 6)
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 4, 5, 6], unsure={2})
    assert fly(d, a, z, P).accepted == 6


def test_two_separate_windows_in_one_draft():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 2, 3, 9, 5, 6, 7, 8, 9], unsure={0, 3})
    dec = fly(d, a, z, P)
    assert dec.loose == (0, 3)
    assert dec.accepted == 9


def test_no_window_ablation_accepts_a_gated_open_mismatch_at_once():
    # the mismatch at 3 sits at the end of the draft and is followed by another mismatch
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], unsure={3, 4})
    assert fly(d, a, z, P).accepted == 3
    dec = fly(d, a, z, FlyParams(window=3, entropy=0.3, topk=3, use_window=False))
    assert dec.loose == (3, 4) and dec.accepted == 5
    # the gate still applies without the window
    d, a, z = case([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], unsure={3})
    assert fly(d, a, z, FlyParams(window=3, use_window=False)).accepted == 4


def test_decisions_come_from_native_matches_only():
    # Mismatch at 1 has in its window a mismatch at 2. Position 2 on its own would have a full
    # window (3, 4 native; 2 + 3 < 7) and could become loose; it must not rescue position 1.
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 9, 4, 5, 6, 7], unsure={1, 2})
    dec = fly(d, a, z, P)
    assert dec.accepted == 1 and dec.loose == ()


def test_correction_token_is_the_target_argmax_at_L():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 8, 6, 7], unsure={0})
    dec = fly(d, a, z, P)
    assert dec.loose == (0,) and dec.accepted == 4
    out = emitted_tokens(d, a, dec.accepted)
    assert out.tolist() == [9, 2, 3, 4, 5]      # the loose draft token stays; a[4] = 5 corrects d[4] = 8


def test_theta_zero_and_infinity():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6])   # confident mismatch
    assert fly(d, a, z, FlyParams(window=3, entropy=0.0)).loose == (1,)       # no gate
    for unsure in ({1}, set()):
        d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure=unsure)
        assert fly(d, a, z, FlyParams(window=3, entropy=math.inf)).accepted == strict(d, a, z).accepted == 1


def test_all_native_and_empty_drafts():
    d, a, z = case([1, 2, 3, 4], [1, 2, 3])
    assert fly(d, a, z, P).accepted == 3
    d, a, z = case([1], [])
    assert fly(d, a, z, P).accepted == 0


def test_the_gate_opens_only_for_one_of_the_targets_own_top_m_tokens():
    # The target is unsure at 1 (entropy over 0.3) and the window after it is full, but the
    # draft's 9 is its 4th choice: not one of the m = 3 it hesitates between.
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    z[1, [4, 5, 9]] = [1.15, 1.12, 1.1]
    assert fly(d, a, z, P).loose == () and fly(d, a, z, P).accepted == 1
    assert fly(d, a, z, P).entropy[1] > 0.3                          # closed by the rank, not the entropy
    assert fly(d, a, z, replace(P, topk=4)).loose == (1,)            # its 4th of 4
    assert fly(d, a, z, replace(P, candidates=False)).loose == (1,)  # any token: the reference's gate
    assert fly_across(d, a, z, A)[0].accepted == 1
    z[1, 9] = 1.12                                                   # tied with the 3rd: one of them
    assert fly(d, a, z, P).loose == (1,)


def test_the_gate_never_opens_over_the_targets_end_of_generation():
    # The target is unsure at 1 between ending (its 15) and going on, and the draft goes on,
    # with a full window after it: the target's choice to end stands.
    d, a, z = case([1, 15, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    ends = np.zeros(V, dtype=bool)
    ends[15] = True
    assert fly(d, a, z, P).loose == (1,)                                   # nothing ends here
    dec = fly(d, a, z, P, ends)
    assert (dec.accepted, dec.loose) == (1, ()) and np.isnan(dec.entropy[1])
    assert fly(d, a, z, replace(P, candidates=False), ends).loose == (1,)  # the reference's gate
    assert fly_across(d, a, z, A, ends=ends)[0].accepted == 1
    assert fly_across(d, a, z, A, opened(0, 0), ends=ends)[0].verdict == REJECT   # inside a window: as any mismatch


def test_the_gate_never_opens_for_a_token_that_repeats_the_answer():
    # The target is unsure at 1 and the window after it is full, but the draft's 9 at 1 ends the
    # 4-gram (2, 8, 1, 9) the answer already holds: a copy of the answer's own text (prompt
    # lookup proposing it), which the target goes on to follow, and the answer loops.
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    z[1, 9] = 1.1                                                      # one of its top 3
    looped = np.array([2, 8, 1, 9, 3, 2, 8], dtype=np.int32)           # ... then 1 from the draft
    assert fly(d, a, z, P).loose == (1,)                               # nothing to repeat
    dec = fly(d, a, z, P, output=looped)
    assert (dec.accepted, dec.loose) == (1, ()) and np.isnan(dec.entropy[1])
    assert fly_across(d, a, z, A, output=looped)[0].accepted == 1
    assert fly(d, a, z, replace(P, echo=5), output=looped).loose == (1,)     # a 5-gram it does not hold
    assert fly(d, a, z, replace(P, echo=0), output=looped).loose == (1,)     # the rule off
    assert fly(d, a, z, replace(P, candidates=False), output=looped).loose == (1,)   # the reference's gate
    # the same 4-gram in the prompt is not the answer's: only the output counts
    assert fly(d, a, z, P, output=looped[4:]).loose == (1,)


def test_repeats_looks_at_the_output_and_the_draft_before_the_token():
    from flylocal.decoding.verifiers.fly import repeats

    out = np.array([5, 6, 7, 5, 6], dtype=np.int32)
    assert repeats(out, np.array([7, 1], dtype=np.int32), 0, 3)            # 5 6 7 again
    assert not repeats(out, np.array([1, 7], dtype=np.int32), 1, 3)        # 6 1 7: new
    assert repeats(np.zeros(0, dtype=np.int32), np.array([4, 4, 4, 4], dtype=np.int32), 3, 3)   # within the draft
    assert not repeats(out, np.array([7], dtype=np.int32), 0, 0)


def test_the_verifier_sees_the_answer_the_engine_gives_it():
    v = Fly(P)
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    z[1, 9] = 1.1
    v.see(np.array([2, 8, 1, 9, 3, 2, 8], dtype=np.int32))
    assert v.decide(d, a, z)[0].accepted == 1
    v.see(np.zeros(0, dtype=np.int32))
    assert v.decide(d, a, z)[0].loose == (1,)


# ---------------------------------------------------------------- the window across rounds

A = FlyParams(window=3, entropy=0.3, topk=3)          # across rounds: the default
from flylocal.decoding.contracts import ACCEPT, REJECT, Window   # noqa: E402
from flylocal.decoding.round import split_output   # noqa: E402
from flylocal.decoding.verifiers.fly import Fly, fly_across   # noqa: E402


def opened(matches: int, idle: int) -> Window:
    """A window opened in an earlier round (its pending token before draft token 0, at start 0),
    with `matches` native matches and `idle` empty rounds since."""
    return Window(at=-1, recovered=0, matches=matches, idle=idle)


def counts(window: Window | None) -> tuple[int, int] | None:
    """(native matches, rounds that drafted nothing) of an open window; None: none is open."""
    return (window.matches, window.idle) if window is not None else None


def test_a_window_that_does_not_fit_the_round_stays_open():
    # The mismatch at 2 of a 3-token draft: within rounds it is rejected (2 + 3 >= 3); across
    # rounds it is accepted provisionally, with the bonus token after it, and its window open.
    d, a, z = case([1, 2, 3, 4], [1, 2, 9], unsure={2})
    assert fly(d, a, z, A).accepted == 2
    dec, window = fly_across(d, a, z, A)
    assert (dec.accepted, window.at, counts(window), dec.loose, dec.verdict) == (3, 2, (0, 0), (), "")


def test_the_window_is_kept_after_w_minus_1_native_matches_in_later_rounds():
    d, a, z = case([5, 6], [5])                       # one native match: not yet enough
    dec, window = fly_across(d, a, z, A, opened(0, 0))
    assert (dec.verdict, counts(window), dec.accepted) == ("", (1, 0), 1)
    d, a, z = case([7, 8, 9, 4], [7, 9, 9], unsure={1})   # the second match closes it; 9 opens another
    dec, window = fly_across(d, a, z, A, opened(1, 0))
    assert (dec.verdict, window.at, counts(window), dec.accepted) == (ACCEPT, 1, (1, 0), 3)


def test_a_mismatch_inside_the_window_retracts_it_even_where_the_target_is_unsure():
    d, a, z = case([5, 6, 7], [5, 9], unsure={1})
    dec, window = fly_across(d, a, z, A, opened(0, 0))
    assert (dec.verdict, dec.accepted, window) == (REJECT, 1, None)
    # within one round: a rejection at the provisional position, the target's token there
    d, a, z = case([1, 2, 3, 4, 5], [1, 9, 9, 4], unsure={1, 2})
    dec, window = fly_across(d, a, z, A)
    assert (dec.accepted, window, dec.verdict) == (1, None, "")


def test_rounds_that_draft_nothing_give_no_evidence_and_retract_after_w_minus_1():
    d, a, z = case([5], [])
    dec, window = fly_across(d, a, z, A, opened(1, 0))
    assert (dec.verdict, counts(window)) == ("", (1, 1))
    dec, window = fly_across(d, a, z, A, opened(1, 1))
    assert dec.verdict == REJECT
    # a bonus token after a non-empty draft is no evidence either way: the count stays
    d, a, z = case([5, 6], [5])
    assert counts(fly_across(d, a, z, FlyParams(window=4), opened(0, 1))[1]) == (1, 1)


def test_a_window_closing_in_its_own_round_is_an_ordinary_loose_token():
    d, a, z = case([1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6], unsure={1})
    assert fly_across(d, a, z, A)[0].loose == fly(d, a, z, A).loose == (1,)
    assert fly_across(d, a, z, A)[0].accepted == 6 and fly_across(d, a, z, A)[1] is None


def test_a_window_longer_than_any_draft_still_closes():
    W = FlyParams(window=10, entropy=0.3, topk=3)
    d, a, z = case([1, 2, 3], [1, 9], unsure={1})
    assert fly(d, a, z, W).accepted == 1                          # within rounds: never
    _, state = fly_across(d, a, z, W)
    start = 0
    for _ in range(4):                                             # 4 rounds of 2 native matches
        start += len(d) + 1                                        # (each commits its draft and bonus)
        d, a, z = case([1, 2, 3], [1, 2])
        _, state = fly_across(d, a, z, W, state, start)
    d, a, z = case([1, 2, 3], [1, 2])
    assert fly_across(d, a, z, W, state, start + len(d) + 1)[0].verdict == ACCEPT


def test_the_gate_and_theta_infinity_hold_across_rounds():
    d, a, z = case([1, 2, 3, 4], [1, 2, 9])                       # the target is sure at 2
    assert fly_across(d, a, z, A)[0].accepted == 2
    d, a, z = case([1, 2, 3, 4], [1, 2, 9], unsure={2})
    assert fly_across(d, a, z, FlyParams(window=3, entropy=math.inf))[0].accepted == strict(d, a, z).accepted


def test_the_verifier_returns_its_window_and_a_new_request_has_none():
    v = Fly(A)
    d, a, z = case([1, 2, 3, 4], [1, 2, 9], unsure={2})
    dec, window = v.decide(d, a, z)
    v.commit(dec, 3)
    assert counts(window) == (0, 0)
    d, a, z = case([5, 6, 7], [5, 6])
    assert v.decide(d, a, z, window, 4)[0].verdict == ACCEPT      # the request's window, passed back in
    assert v.decide(d, a, z)[0].verdict == ""                     # a new request: none is open
    _, window = fly_across(*case([1, 2, 3, 4], [1, 2, 9], unsure={2}), A)
    new = [(1, "accepted", None), (2, "accepted", None)]
    assert split_output(window, (), 0, 2, 2, new)[1] is None       # the end cut the pending token


def test_the_window_keeps_pending_what_follows_its_token_until_the_verdict():
    # a window opened at draft position 2 of a round that committed 3 draft tokens and its bonus
    # from context position 10: its two tokens before it are output, the rest pending
    window = Window(at=12, recovered=9)
    new = [(t, "accepted", None) for t in (1, 2, 3, 4)]
    out, window = split_output(window, (), 10, 14, 3, new)
    assert out == new[:2] and (window.pending, window.accepted) == (tuple(new[2:]), 1)
    # the next round (4 tokens, 3 of them drafted) adds to it, and shows nothing
    more = [(t, "accepted", None) for t in (5, 6, 7, 8)]
    out, after = split_output(window, (), 14, 18, 3, more)
    assert out == [] and (after.pending, after.accepted, after.at) == (tuple(new[2:] + more), 4, 12)
    # a verdict that accepts it releases what it held, before the round's own output
    assert split_output(None, after.pending, 18, 20, 1, more[:2]) == ([*new[2:], *more, *more[:2]], None)
