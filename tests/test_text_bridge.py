"""Drafting through text on literal token tables: the seam, the dropped trailing token, control
tokens, unfinished characters and rollback (docs/design.md, "Drafts from another vocabulary").

The tables are tiny vocabularies with a greedy longest-match tokenizer, whose tokens are at most
4 bytes long: then a boundary 4 tokens behind the end of the text can never move, and
translating a context piece by piece must give exactly the tokenization of the whole text."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flylocal.decoding.drafters.text import MAX_SPAN, TextBridge, complete_utf8


class Table:
    """A vocabulary from a literal list of token texts. Control tokens are written `<...>`."""

    def __init__(self, texts, bos=None, add_bos=False, eog=(), space_prefix=False):
        self.texts = [t.encode() if isinstance(t, str) else t for t in texts]
        self.ids = {t: i for i, t in enumerate(self.texts)}
        self.control = {i for i, t in enumerate(self.texts) if t.startswith(b"<") and len(t) > 1}
        self.bos = self.ids[bos.encode()] if bos else -1
        self.add_bos = add_bos
        self.eog_mask = np.zeros(len(self.texts), dtype=bool)
        for t in eog:
            self.eog_mask[self.ids[t.encode()]] = True
        self.tokenized = 0                                   # bytes tokenized, to bound the work
        self.space_prefix = space_prefix                     # SentencePiece's add_space_prefix
        self.longest = max(len(t) for i, t in enumerate(self.texts) if i not in self.control)

    def piece(self, t, special=False):
        return self.texts[t] if special or t not in self.control else b""

    def is_control(self, t):
        return t in self.control

    def control_ids(self):
        return {self.texts[i]: i for i in self.control}

    def tokenize(self, data, add_special=False, parse_special=False):
        assert isinstance(data, bytes) and not add_special and not parse_special
        if self.space_prefix:
            data = b" " + data
        self.tokenized += len(data)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                t = self.ids.get(data[i : i + n])
                if t is not None and t not in self.control:
                    out.append(t)
                    i += n
                    break
            else:
                raise AssertionError(f"no token for {data[i:i + 1]!r}")
        return np.asarray(out, dtype=np.int32)

    def encode(self, text):
        return self.tokenize(text.encode() if isinstance(text, str) else text)

    def text(self, ids, special=False):
        return b"".join(self.piece(int(t), special) for t in ids)


LETTERS = "abc "
# Target: single characters and a few words. Draft: pairs and triples that straddle them.
TARGET = Table(["<s>", "<end>", "<user>", *LETTERS, "ab", " a", " b", "ca", "é", b"\xc3", b"\xa9"],
               bos="<s>", add_bos=True, eog=["<end>"])
DRAFT = Table(["<d>", "<end>", *LETTERS, "ab", "abc", "bca", "c a", " ab", "abca", "cab ", "é", b"\xc3", b"\xa9"],
              bos="<d>", add_bos=True, eog=["<end>"])


def target_ids(text, bos=True):
    ids = TARGET.encode(text).tolist()
    return np.asarray(([TARGET.bos] if bos else []) + ids, dtype=np.int32)


def test_a_seam_is_re_tokenized_when_text_arrives():
    """"ab" is the draft's token until "c" arrives, and then "abc" is; appending the draft ids
    of the new text alone ("ab", "c") is the naive seam this must not have."""
    bridge = TextBridge(TARGET, DRAFT)
    first = target_ids("ab")
    assert DRAFT.text(bridge.sync(first)[1:]) == b"ab"
    whole = np.append(first, TARGET.ids[b"c"]).astype(np.int32)
    ids = bridge.sync(whole)
    assert ids[0] == DRAFT.bos
    assert ids[1:].tolist() == [DRAFT.ids[b"abc"]]


@pytest.mark.parametrize("seed", range(40))
def test_translating_piece_by_piece_equals_translating_the_whole_text(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 300)))
    ids = target_ids(text)
    bridge = TextBridge(TARGET, DRAFT)
    n, work = 1, 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 7))
        before = DRAFT.tokenized
        got = bridge.sync(ids[:n])
        work += DRAFT.tokenized - before
        assert got.tolist() == [DRAFT.bos] + DRAFT.encode(TARGET.text(ids[:n])).tolist(), n
    # Each round re-tokenized only the new text and a few tokens behind it.
    assert work < 8 * len(text) + 50


@pytest.mark.parametrize("seed", range(20))
def test_a_rolled_back_context_translates_as_a_fresh_one(seed):
    rng = random.Random(100 + seed)
    a = "".join(rng.choice(LETTERS) for _ in range(120))
    b = a[: rng.randint(0, 119)] + "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 40)))
    bridge = TextBridge(TARGET, DRAFT)
    ids_a = target_ids(a)
    for n in range(2, len(ids_a) + 1, 5):
        bridge.sync(ids_a[:n])
    ids_b = target_ids(b)
    assert bridge.sync(ids_b).tolist() == TextBridge(TARGET, DRAFT).sync(ids_b).tolist()


def test_control_tokens_map_by_their_text():
    """<end> exists in both vocabularies and maps across; <user> does not exist in the draft's
    and becomes plain text; the target's BOS becomes the draft's own BOS."""
    TARGET_WITH_TAGS = Table([*TARGET.texts[:3], *TARGET.texts[3:], b"<", b"u", b"s", b"e", b"r", b">"],
                             bos="<s>", add_bos=True, eog=["<end>"])
    DRAFT_WITH_TAGS = Table([*DRAFT.texts, b"<", b"us", b"er", b">"], bos="<d>", add_bos=True, eog=["<end>"])
    t = TARGET_WITH_TAGS
    ids = np.asarray([t.bos, t.ids[b"<user>"], t.ids[b"a"], t.ids[b"<end>"], t.ids[b"b"]], dtype=np.int32)
    got = TextBridge(t, DRAFT_WITH_TAGS).sync(ids)
    d = DRAFT_WITH_TAGS
    assert got.tolist() == [d.bos, d.ids[b"<"], d.ids[b"us"], d.ids[b"er"], d.ids[b">"], d.ids[b"a"],
                            d.ids[b"<end>"], d.ids[b"b"]]


def test_the_last_target_token_of_a_proposal_is_dropped():
    """The draft proposes "ab ca": tokenized for the target that is "ab", " ", "ca". The text
    could go on ("cab"), so "ca" is not proposed."""
    bridge = TextBridge(TARGET, DRAFT)
    bridge.sync(target_ids(" "))
    proposal = bridge.proposal(DRAFT.encode("ab ca"))
    assert proposal.tokens.tolist() == [TARGET.ids[b"ab"], TARGET.ids[b" "]]
    assert proposal.text == "ab ca"
    # Accepting "ab" covers the draft's "ab" (2 bytes) but not "ab " + ...: one draft token.
    assert proposal.draft_tokens_within(1) == 1
    assert proposal.draft_tokens_within(0) == 0


def test_a_proposal_ended_by_the_draft_is_final():
    """A draft that ends its text with its end-of-generation token: nothing is dropped, and the
    target's token of the same text follows."""
    bridge = TextBridge(TARGET, DRAFT)
    bridge.sync(target_ids("c"))
    draft = np.append(DRAFT.encode("ab ca"), DRAFT.ids[b"<end>"]).astype(np.int32)
    proposal = bridge.proposal(draft)
    assert proposal.tokens.tolist() == [TARGET.ids[b"ab"], TARGET.ids[b" "], TARGET.ids[b"ca"], TARGET.ids[b"<end>"]]
    assert DRAFT.text(draft[:-1]) == b"ab ca" and len(draft) == 5     # "ab", " ", "c", "a", <end>
    assert proposal.draft_tokens_within(4) == 5                         # the end token too
    assert proposal.draft_tokens_within(3) == 4
    assert proposal.draft_tokens_within(2) == 2


def test_a_character_split_across_target_tokens_survives():
    """The target writes "é" as two byte tokens. After the first, the draft holds it back and
    nothing is proposed; after the second the draft sees the whole character as its token."""
    bridge = TextBridge(TARGET, DRAFT)
    half = np.append(target_ids("a"), TARGET.ids[b"\xc3"]).astype(np.int32)
    assert bridge.sync(half).tolist() == [DRAFT.bos, DRAFT.ids[b"a"]]
    assert len(bridge.proposal(DRAFT.encode("abc")).tokens) == 0
    whole = np.append(half, TARGET.ids[b"\xa9"]).astype(np.int32)
    assert bridge.sync(whole).tolist() == [DRAFT.bos, DRAFT.ids[b"a"], DRAFT.ids["é".encode()]]
    # A draft that ends inside a character proposes nothing of that character.
    bridge.sync(target_ids("a"))
    partial = np.asarray([DRAFT.ids[b"b"], DRAFT.ids[b"\xc3"]], dtype=np.int32)
    assert TARGET.text(bridge.proposal(partial).tokens) == b""


def test_complete_utf8():
    assert complete_utf8("aé".encode()) == 3
    assert complete_utf8("aé".encode()[:2]) == 1
    assert complete_utf8("😀".encode()[:3]) == 0
    assert complete_utf8("😀".encode()) == 4
    assert complete_utf8(b"\xa9") == 1          # a stray continuation byte is left to the tokenizer


def test_a_checkpoint_is_forced_where_the_vocabularies_never_agree():
    """Target tokens "a" + pairs, draft tokens pairs: no byte is a boundary of both, so without a
    forced checkpoint every round would re-tokenize the whole text."""
    target = Table(["<s>", "a", "ba", "b"], bos="<s>", add_bos=True)
    draft = Table(["<d>", "ab", "a", "b"], bos="<d>", add_bos=True)
    text = "ab" * 600
    ids = np.asarray([target.bos, target.ids[b"a"]] + [target.ids[b"ba"]] * 599 + [target.ids[b"b"]], dtype=np.int32)
    bridge = TextBridge(target, draft)
    for n in range(2, len(ids) + 1):
        got = bridge.sync(ids[:n])
        assert draft.text(got[1:]) == target.text(ids[:n])
    assert draft.text(got[1:]) == text.encode()
    assert len(bridge.checkpoints) > len(ids) // MAX_SPAN // 2
    assert draft.tokenized < len(ids) * 4 * (MAX_SPAN + 8)   # without checkpoints: about len(ids)**2


def test_a_tokenizer_that_writes_a_leading_space_gets_none_at_a_seam():
    """A SentencePiece vocabulary with add_space_prefix puts a space in front of every text it
    tokenizes: without care, every seam and every proposal would gain a space."""
    spm_draft = Table(["<d>", *LETTERS, "\n", " ab", "ab", "ca", " c", "abc"], bos="<d>", add_bos=True,
                      space_prefix=True)
    spm_target = Table(["<s>", *LETTERS, "\n", " ab", "ab", " c"], bos="<s>", add_bos=True, space_prefix=True)
    text = "abc abc ab cab " * 12
    ids = np.asarray([TARGET.bos] + TARGET.encode(text).tolist(), dtype=np.int32)
    bridge = TextBridge(TARGET, spm_draft)
    for n in range(2, len(ids) + 1, 3):
        got = bridge.sync(ids[:n])
        assert spm_draft.text(got[1:]) == TARGET.text(ids[:n])
    back = TextBridge(spm_target, DRAFT)
    back.sync(np.asarray([spm_target.bos, spm_target.ids[b"a"]], dtype=np.int32))
    proposal = back.proposal(DRAFT.encode("b cab c"))
    assert spm_target.text(proposal.tokens) == b"b cab"      # no space in front; " c" dropped


def test_a_control_token_replaced_by_text_is_re_tokenized_across():
    """"ab" <end> and then, rolled back, "ab" "c": the seam before <end> is gone, and the draft
    sees "abc" as a fresh translation would."""
    bridge = TextBridge(TARGET, DRAFT)
    first = np.asarray([TARGET.bos, TARGET.ids[b"ab"], TARGET.ids[b"<end>"]], dtype=np.int32)
    bridge.sync(first)
    second = np.asarray([TARGET.bos, TARGET.ids[b"ab"], TARGET.ids[b"c"]], dtype=np.int32)
    assert bridge.sync(second).tolist() == TextBridge(TARGET, DRAFT).sync(second).tolist() \
        == [DRAFT.bos, DRAFT.ids[b"abc"]]


def test_a_sync_cut_short_leaves_nothing_stale():
    """Ctrl-C inside a sync (here: in the draft's tokenizer): the next sync gives what a fresh
    bridge gives, not the half-translated state."""

    class Interrupting(Table):
        armed = False

        def tokenize(self, data, add_special=False, parse_special=False):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return super().tokenize(data, add_special, parse_special)

    draft = Interrupting(DRAFT.texts, bos="<d>", add_bos=True, eog=["<end>"])
    bridge = TextBridge(TARGET, draft)
    ids = target_ids("abc ab cab " * 20)
    bridge.sync(ids[:100])
    draft.armed = True
    with pytest.raises(KeyboardInterrupt):
        bridge.sync(ids[:150])
    assert bridge.sync(ids[:150]).tolist() == TextBridge(TARGET, DRAFT).sync(ids[:150]).tolist()
    assert bridge.sync(ids).tolist() == TextBridge(TARGET, DRAFT).sync(ids).tolist()
