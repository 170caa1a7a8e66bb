"""Prompt lookup on literal token arrays."""

import numpy as np

from flylocal.decoding.drafters.pld import stop_at_eog
from flylocal.decoding.drafters.pld import PromptLookup, confidence_level, find_match, find_matches


def prompt_lookup(tokens, max_ngram, max_tokens):
    """(continuation, n): what the drafter proposes, and the n-gram size it matched."""
    draft = PromptLookup(np.zeros(64, dtype=bool), max_ngram=max_ngram).propose(tokens, max_tokens)
    return draft.tokens, find_match(tokens, max_ngram)[1] if len(draft.tokens) else 0


def arr(*xs):
    return np.array(xs, dtype=np.int32)


def test_longest_ngram_wins_over_more_recent_shorter_match():
    # suffix "1 2 3": the 3-gram occurs at 0..2; a later "3" alone occurs at 6.
    tokens = arr(1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3)
    cont, n = prompt_lookup(tokens, max_ngram=4, max_tokens=3)
    assert n == 3
    assert cont.tolist() == [4, 5, 9]


def test_most_recent_occurrence_of_the_ngram():
    tokens = arr(5, 6, 10, 5, 6, 11, 5, 6)
    cont, n = prompt_lookup(tokens, max_ngram=2, max_tokens=2)
    assert n == 2
    assert cont.tolist() == [11, 5]


def test_falls_back_to_unigram():
    tokens = arr(7, 8, 9, 1, 2, 8)
    cont, n = prompt_lookup(tokens, max_ngram=4, max_tokens=5)
    assert n == 1
    assert cont.tolist() == [9, 1, 2, 8]   # the continuation may run into the suffix itself


def test_max_ngram_caps_the_match():
    tokens = arr(1, 2, 3, 4, 0, 1, 2, 3, 4)
    end, n = find_match(tokens, max_ngram=2)
    assert (end, n) == (3, 2)
    assert find_match(tokens, max_ngram=8) == (3, 4)


def test_every_occurrence_of_the_longest_ngram_against_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).astype(np.int32)
        max_ngram = int(rng.integers(1, 6))
        ends, n = find_matches(tokens, max_ngram)
        last = len(tokens) - 1

        def occurs(e, size):
            return e - size + 1 >= 0 and (tokens[e - size + 1: e + 1] == tokens[last - size + 1:]).all()

        longest = max((s for s in range(1, max_ngram + 1) for e in range(last) if occurs(e, s)), default=0)
        assert n == longest
        assert ends.tolist() == [e for e in range(last) if n and occurs(e, n)]
        assert find_match(tokens, max_ngram) == ((ends[-1], n) if n else (-1, 0))


def test_no_match_and_degenerate_inputs():
    assert prompt_lookup(arr(1, 2, 3), 4, 5)[1] == 0
    assert prompt_lookup(arr(1), 4, 5)[1] == 0
    assert len(prompt_lookup(arr(1, 2, 1), 4, 0)[0]) == 0


def test_max_tokens_caps_the_continuation():
    tokens = arr(1, 2, 3, 4, 5, 6, 1)
    cont, _ = prompt_lookup(tokens, 4, 2)
    assert cont.tolist() == [2, 3]


def test_draft_stops_after_first_eog():
    eog = np.zeros(16, dtype=bool)
    eog[2] = True
    assert stop_at_eog(arr(5, 6, 2, 7, 8), eog).tolist() == [5, 6, 2]
    assert stop_at_eog(arr(5, 6), eog).tolist() == [5, 6]


def test_drafter_proposes_and_grades_confidence_by_match_extent():
    eog = np.zeros(64, dtype=bool)
    eog[0] = True
    drafter = PromptLookup(eog, max_ngram=2)
    copied = arr(*range(10, 30))
    context = np.concatenate([copied, arr(40), copied[:12]])   # 12 tokens copied so far
    d = drafter.propose(context, 4)
    assert d.tokens.tolist() == [22, 23, 24, 25]
    assert d.level == confidence_level(context, 11, 2, 2) == 3   # extent 12 >= 8: one level up
    short = arr(1, 2, 3, 9, 2, 3)
    assert drafter.propose(short, 4).level == 2
    assert drafter.propose(arr(1, 2, 0, 5, 1), 8).tokens.tolist() == [2, 0]   # cut at EOG
