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


# ----- the context index: the same answers as the scan, kept up to date across calls -----

def evolving_contexts(rng, steps, vocab, longest=400):
    """Contexts as rounds give them: appends of 1..8 tokens mostly, rollbacks to a shorter prefix
    and whole replacements (a new request) now and then; each a fresh array."""
    context = rng.integers(0, vocab, size=int(rng.integers(0, 40))).astype(np.int32)
    for _ in range(steps):
        r = rng.random()
        if r < 0.65 and len(context) < longest:
            context = np.concatenate([context, rng.integers(0, vocab, size=int(rng.integers(1, 9))).astype(np.int32)])
        elif r < 0.85:
            context = context[: int(rng.integers(0, len(context) + 1))].copy()
        elif r < 0.93:
            context = rng.integers(0, vocab, size=int(rng.integers(0, longest))).astype(np.int32)
        else:                                       # as long, one token different
            context = context.copy()
            if len(context):
                context[int(rng.integers(0, len(context)))] ^= 1
        yield context


def test_context_index_answers_as_the_scan_through_appends_rollbacks_and_replacements():
    from flylocal.decoding.drafters.pld import ContextIndex

    rng = np.random.default_rng(11)
    for vocab, small in ((5, ContextIndex.SMALL), (9, ContextIndex.SMALL), (20, ContextIndex.SMALL),
                         (7, -10**6), (7, 10**6)):          # every change rebuilt; none
        index = ContextIndex()
        index.SMALL = small
        for context in evolving_contexts(rng, 400, vocab):
            # the MLA case: a draft so far after the context, looked up with it
            extras = [arr(), rng.integers(0, vocab, size=int(rng.integers(1, 7))).astype(np.int32)]
            for extra in extras:
                joined = np.concatenate([context, extra])
                for max_ngram in (1, 2, 3, 4, 7):
                    ends, n = index.find(context, max_ngram, extra=extra)
                    want_ends, want_n = find_matches(joined, max_ngram)
                    assert n == want_n and ends.tolist() == want_ends.tolist(), (vocab, len(context), extra, max_ngram)
                    assert index.match(context, max_ngram, extra=extra) == find_match(joined, max_ngram)


def test_context_index_is_right_for_any_context_of_the_same_length():
    from flylocal.decoding.drafters.pld import ContextIndex

    index = ContextIndex()
    a = arr(1, 2, 3, 1, 2, 3, 1, 2)
    assert index.match(a, 4) == find_match(a, 4) == (4, 4)
    b = arr(5, 6, 7, 5, 6, 7, 9, 6)                 # as long, every token different
    assert index.match(b, 4) == find_match(b, 4) == (4, 1)
    ends, _ = index.find(b, 1)
    c = b.copy()
    c[3] = 6                                        # one token in the middle changed in place
    assert index.find(c, 1)[0].tolist() == find_matches(c, 1)[0].tolist() == [1, 3, 4]
    assert ends.tolist() == [1, 4]                  # an answer is not a view the index changes later
    assert index.match(c.astype(np.int64), 2) == find_match(c, 2)               # another dtype
    strided = np.repeat(c, 2)[::2]                                              # not contiguous
    assert index.match(strided, 3) == find_match(c, 3)
    c[0] = 7                                        # changed in place after it was indexed
    assert index.match(c, 4) == find_match(c, 4)


def test_joined_level_is_the_level_in_the_joined_sequence():
    from flylocal.decoding.drafters.pld import joined_level, span

    rng = np.random.default_rng(5)
    for _ in range(500):
        context = rng.integers(0, 3, size=int(rng.integers(0, 40))).astype(np.int32)
        extra = rng.integers(0, 3, size=int(rng.integers(0, 8))).astype(np.int32)
        joined = np.concatenate([context, extra])
        if len(joined) < 2:
            continue
        max_ngram = int(rng.integers(1, 5))
        end, n = find_match(joined, max_ngram)
        if n:
            assert joined_level(context, extra, end, n, max_ngram) == confidence_level(joined, end, n, max_ngram)
        start = int(rng.integers(0, len(joined) + 1))
        stop = int(rng.integers(start, len(joined) + 4))
        assert span(context, extra, start, stop).tolist() == joined[start:stop].tolist()


def scan_proposal(context, k, eog, max_ngram):
    """What PromptLookup proposed before the index: the scan's match, its continuation and level."""
    end, n = find_match(context, max_ngram)
    if n == 0:
        return [], None
    return stop_at_eog(context[end + 1 : end + 1 + k], eog).tolist(), confidence_level(context, end, n, max_ngram)


def test_prompt_lookup_proposals_are_the_scans_across_rounds():
    rng = np.random.default_rng(7)
    eog = np.zeros(16, dtype=bool)
    eog[3] = True
    for max_ngram in (2, 4):
        drafter = PromptLookup(eog, max_ngram=max_ngram)
        proposed = 0
        for context in evolving_contexts(rng, 300, 12):
            k = int(rng.integers(1, 9))
            draft = drafter.propose(context, k)
            tokens, level = scan_proposal(context, k, eog, max_ngram)
            assert draft.tokens.tolist() == tokens
            assert (draft.level if len(draft.tokens) else None) == (level if tokens else None)
            proposed += bool(tokens)
        assert proposed > 100


def scan_mla_lookup(drafter, context, draft, room):
    """MLA's lookup as it was: a scan of the context and the draft so far, concatenated."""
    seq = np.concatenate([context, draft])
    end, n = find_match(seq, drafter.max_ngram)
    if n == 0 or room <= 0:
        return seq[:0], 0
    guess = stop_at_eog(seq[end + 1 : end + 1 + room], drafter.eog)
    if len(guess) and drafter.eog[guess[-1]]:
        guess = guess[:-1]
    return guess, confidence_level(seq, end, n, drafter.max_ngram)


def copied_text(rng):
    """A context that repeats itself: long matches, hence the higher confidence levels."""
    return np.tile(rng.integers(1, 5, size=int(rng.integers(4, 16))), 3).astype(np.int32)


def test_mla_lookups_and_proposals_are_unchanged_by_the_index():
    from fake_backend import FakeLM, FakeTarget
    from flylocal.decoding.drafters.mla import MLADrafter

    guesses = []

    class Checked(MLADrafter):
        """Each lookup checked against the scan's: the same guess, the same level."""

        def _lookup(self, context, draft, room):
            guess, level = super()._lookup(context, draft, room)
            want, want_level = scan_mla_lookup(self, context, draft, room)
            assert guess.tolist() == want.tolist() and level == want_level
            end = find_match(np.concatenate([context, draft]), self.max_ngram)[0]
            guesses.append((len(want), end + 1 < len(context) < end + 1 + len(want), level))  # straddles?
            return guess, level

    class ScanMLA(MLADrafter):
        def _lookup(self, context, draft, room):
            return scan_mla_lookup(self, context, draft, room)

    lm = FakeLM(seed=4, n_vocab=32)
    rng = np.random.default_rng(2)
    for adaptive in (False, True):
        drafters = [cls(FakeTarget(lm, n_ctx=512), 32, lm.eog_mask, max_ngram=3, max_tokens=4, adaptive_lookup=adaptive)
                    for cls in (Checked, ScanMLA)]
        context = copied_text(rng)
        for _ in range(150):
            k = int(rng.integers(1, 9))
            new, old = (d.propose(context, k) for d in drafters)
            if not adaptive:                       # adaptive: lengths follow measured seconds, not comparable
                assert new.tokens.tolist() == old.tokens.tolist() and new.levels == old.levels
            taken = int(rng.integers(0, len(new.tokens) + 1))
            context = np.concatenate([context, new.tokens[:taken], rng.integers(1, 5, size=2).astype(np.int32)])
            if len(context) > 400 or rng.random() < 0.1:                         # a new request, or a rollback
                context = copied_text(rng) if rng.random() < 0.5 else context[: int(rng.integers(1, len(context)))].copy()
    assert sum(n > 0 for n, _, _ in guesses) > 50 and sum(across for _, across, _ in guesses) > 5
    assert sum(level > 3 for _, _, level in guesses) > 5          # extents of 8 and more
