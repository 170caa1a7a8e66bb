"""Drafting through text: a draft model whose vocabulary differs from the target's
(docs/design.md, "Drafts from another vocabulary").

The draft keeps its own token sequence for the committed text (`TextBridge.sync`), and each
proposal goes back to target tokens through its text (`TextBridge.proposal`):

    target context --text--> draft ids --draft model--> draft tokens --text--> target draft

Verification never sees the draft's vocabulary: strict, FLy and ASD decide on target tokens
and target logits, so strict is still exactly the target's greedy output.

Tokenization is not prefix-stable: "ab" may be one token until "c" arrives and "abc" is
another. So the draft ids of the last few tokens of a run of text are provisional. A
checkpoint marks a point where a target token and a draft token end at the same byte, far
enough behind the end that later text cannot change the draft ids before it; each sync
re-tokenizes from the last checkpoint the context still shares, and the draft's cache rolls
back to the common prefix (`Runtime.reuse_prefix`) in the drafter's own catch-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from flylocal.decoding.contracts import EMPTY, NO_DRAFT, Draft, Drafter, Vocabulary

BACK = 4          # draft ids behind the end of the text that may still change
MAX_SPAN = 64     # draft ids between checkpoints before one is forced at a target token boundary


def complete_utf8(data: bytes) -> int:
    """Length of `data` without an unfinished UTF-8 character at its end (invalid bytes
    elsewhere are left to the tokenizer)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:                                  # a lead byte: is its character whole?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= need else len(data) - back
    return len(data)


class Tokenizer:
    """Text to ids in one vocabulary for text that continues other text. A SentencePiece
    tokenizer with `add_space_prefix` (Llama 2, Mistral) writes a space in front of every text it
    is given, which would put a space at every seam: there the text is tokenized after a newline
    and the ids of that newline (and the space) are dropped, so the ids' pieces are the text's
    bytes again."""

    LEAD = b"\n"

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.lead = 0          # bytes of pieces before the text: 0, or the space and LEAD
        if self._text(self._raw(b"a")) == b" a":
            lead = self._raw(self.LEAD + b"a")
            if self._text(lead) == b" " + self.LEAD + b"a":
                self.lead = 1 + len(self.LEAD)

    def _raw(self, data: bytes) -> list[int]:
        return self.vocab.tokenize(data, add_special=False, parse_special=False).tolist()

    def _text(self, ids) -> bytes:
        return b"".join(self.vocab.piece(int(t)) for t in ids)

    def __call__(self, data: bytes) -> list[int]:
        if not data:
            return []
        if not self.lead:
            return self._raw(data)
        ids = self._raw(self.LEAD + data)
        covered = 0
        for i, t in enumerate(ids):
            if covered == self.lead:
                return ids[i:]
            covered += len(self.vocab.piece(int(t)))
            if covered > self.lead:          # the newline merged with the text: no clean cut
                break
        ids = self._raw(data)
        return ids[1:] if ids and self.vocab.piece(int(ids[0])) == b" " else ids


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray       # [k'] int32, target ids
    text: str                # the draft text they came from
    draft_ends: np.ndarray   # [n] int64 byte end of each draft token used, in that text
    target_ends: np.ndarray  # [k'] int64 byte end of each target token, in that text
    ends_with_control: bool = False   # the last of `tokens` is the draft's end token, mapped

    def draft_tokens_within(self, accepted: int) -> int:
        """How many draft tokens lie wholly inside the first `accepted` target tokens' text
        (the draft's end token counts when its mapped token was accepted)."""
        accepted = min(accepted, len(self.target_ends))
        if accepted <= 0:
            return 0
        end = self.target_ends[accepted - 1]
        n = int(np.searchsorted(self.draft_ends, end, side="right"))
        return n + (self.ends_with_control and accepted == len(self.target_ends))


class TextBridge:
    """The draft's token sequence for the target's committed tokens, kept up to date
    incrementally, and the way back from draft tokens to target tokens.

    `target` and `draft` are vocabularies (contracts.Vocabulary): Runtimes, or the tests'
    literal tables."""

    def __init__(self, target: Vocabulary, draft: Vocabulary):
        self.target, self.draft = target, draft
        self.t_ids = EMPTY                 # [n] int32 the target tokens translated so far
        self.d_ids: list[int] = []         # their draft ids
        self.start = [int(draft.bos)] if draft.add_bos else []
        self.checkpoints = [(0, len(self.start))]    # (target tokens, draft ids) that are final
        self.held = b""                    # an unfinished character at the end, not yet translated
        self.draft_text = Tokenizer(draft)
        self.target_text = Tokenizer(target)
        self._units: dict[int, bytes | list[int]] = {}
        self._pieces: dict[int, bytes] = {}           # draft id -> its text
        self._controls: tuple[dict, dict] | None = None   # control texts -> ids: (draft's, target's)

    # ----- committed text -> draft ids -----
    def _unit(self, t: int) -> bytes | list[int]:
        """A target token as plain text (bytes), or as fixed draft ids: a control token maps
        to the draft's control token of the same text, or else to that text as plain text.
        The BOS the target's tokenizer adds maps to nothing (the draft has its own)."""
        unit = self._units.get(t)
        if unit is None:
            target = self.target
            if not target.is_control(t):
                unit = target.piece(t)
            elif target.add_bos and t == target.bos:
                unit = []
            else:
                text = target.piece(t, special=True)
                mapped = self._control_maps()[0].get(text)
                unit = [mapped] if mapped is not None else self.draft_text(text)
            self._units[t] = unit
        return unit

    def sync(self, context: np.ndarray) -> np.ndarray:
        """The draft ids [m] int32 of `context` [n] int32 (target ids), re-translating only from
        the last checkpoint it shares with what was translated before."""
        n = min(len(context), len(self.t_ids))
        differ = np.flatnonzero(context[:n] != self.t_ids[:n])
        shared = int(differ[0]) if differ.size else n
        if shared == len(self.t_ids) == len(context):
            return self._ids()
        # A checkpoint at `shared` itself stands only if the old text merely goes on: where a
        # token there changed (a control token became text), the seam before it may move.
        last = shared if shared == len(self.t_ids) else shared - 1
        while len(self.checkpoints) > 1 and self.checkpoints[-1][0] > last:
            self.checkpoints.pop()
        t_mark, d_mark = self.checkpoints[-1]
        translated = np.array(context, dtype=np.int32)
        self.t_ids = EMPTY          # until the translation is whole: one cut short (Ctrl-C) starts over
        del self.d_ids[d_mark - len(self.start):]
        self.held = b""
        self._translate(translated, t_mark)
        self.t_ids = translated
        return self._ids()

    def _ids(self) -> np.ndarray:
        return np.asarray(self.start + self.d_ids, dtype=np.int32)

    def _translate(self, ids: np.ndarray, t_from: int) -> None:
        """Append the draft ids of ids[t_from:]: plain runs tokenized whole, control units as
        they map; checkpoints after every unit and at stable seams inside runs."""
        i, n = t_from, len(ids)
        while i < n:
            unit = self._unit(int(ids[i]))
            if isinstance(unit, list):
                self.d_ids.extend(unit)
                i += 1
                self._mark(i)
                continue
            j = i
            pieces = []
            while j < n and isinstance(self._unit(int(ids[j])), bytes):
                pieces.append(self._unit(int(ids[j])))
                j += 1
            self._run(i, pieces, last=j == n)
            i = j

    def _run(self, t_from: int, pieces: list[bytes], last: bool) -> None:
        """Tokenize one run of plain text that starts at target token `t_from`. In the last
        run an unfinished character is held back and the final BACK draft ids stay provisional."""
        t_ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)    # [r] byte end per target token
        data = b"".join(pieces)
        usable = complete_utf8(data) if last else len(data)
        self.held = data[usable:]
        while True:
            d = self._tokenize(data[:usable])
            d_ends = np.cumsum([len(self._piece(t)) for t in d], dtype=np.int64)   # [m]
            stable = len(d) - BACK if last else len(d)
            seams = np.flatnonzero(np.isin(d_ends[:max(stable, 0)], t_ends))
            if len(seams) or not last or stable <= MAX_SPAN:
                break
            # No seam for a long stretch (text where the vocabularies never split alike):
            # force one at the target token boundary behind the provisional tail.
            cut = int(np.searchsorted(t_ends, d_ends[stable - 1], side="right"))
            if cut == 0:
                break
            head = self._tokenize(data[: t_ends[cut - 1]])
            self.d_ids.extend(head)
            self._mark(t_from + cut)
            t_from, data, usable = t_from + cut, data[t_ends[cut - 1]:], usable - int(t_ends[cut - 1])
            t_ends = t_ends[cut:] - t_ends[cut - 1]
        base = len(self.start) + len(self.d_ids)
        self.d_ids.extend(d)
        for s in seams:
            t = int(np.searchsorted(t_ends, d_ends[s])) + 1
            self.checkpoints.append((t_from + t, base + int(s) + 1))
        if not last:
            self._mark(t_from + len(pieces))

    def _mark(self, t_index: int) -> None:
        point = (t_index, len(self.start) + len(self.d_ids))
        if point != self.checkpoints[-1]:
            self.checkpoints.append(point)

    def _tokenize(self, data: bytes) -> list[int]:
        return self.draft_text(data)

    # ----- draft tokens -> target ids -----
    def proposal(self, draft_tokens: np.ndarray) -> Proposal:
        """The target ids [k'] of the text of `draft_tokens`, which continue the synced context.

        The text is tokenized from the current target token boundary. Its last target token is
        dropped, since more text could still extend it, unless the draft ended its text with a
        control token (end of generation): that maps to the target's token of the same text."""
        pieces, end = [], None
        for t in draft_tokens:
            t = int(t)
            if self.draft.is_control(t) or self.draft.eog_mask[t]:
                end = self._target_control(t)
                break
            pieces.append(self._piece(t))
        data = b"".join(pieces)
        draft_ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        if self.held:                      # the target is inside a character: nothing lines up
            return Proposal(EMPTY, data.decode("utf-8", "replace"), draft_ends[:0], draft_ends[:0])
        usable = complete_utf8(data)
        tokens = np.asarray(self.target_text(data[:usable]), dtype=np.int32)
        final = end is not None and usable == len(data)
        if len(tokens) and not final:
            tokens = tokens[:-1]
        target_ends = np.cumsum([len(self.target.piece(int(t))) for t in tokens], dtype=np.int64)
        mapped = final and end >= 0
        if mapped:                         # the draft's own end token is proposed too
            tokens = np.append(tokens, end).astype(np.int32)
            target_ends = np.append(target_ends, len(data))
        return Proposal(np.asarray(tokens, dtype=np.int32), data.decode("utf-8", "replace"),
                        draft_ends, target_ends, mapped)

    def _target_control(self, t: int) -> int:
        """The target's control token with the text of draft control token `t`, or -1."""
        return self._control_maps()[1].get(self.draft.piece(t, special=True), -1)

    def _control_maps(self) -> tuple[dict, dict]:
        if self._controls is None:
            self._controls = (self.draft.control_ids(), self.target.control_ids())
        return self._controls

    def _piece(self, t: int) -> bytes:
        piece = self._pieces.get(t)
        if piece is None:
            piece = self._pieces[t] = self.draft.piece(t)
        return piece


class ThroughText(Drafter):
    """A model drafter (`model` or `mla`) that drafts in its own vocabulary for a target with
    another: prompt lookup inside it (MLA, and the lookup it weighs the model against) runs on
    the draft's ids too, and the session's lookup corpus (target ids) is not searched. Its
    draft-length plan counts draft tokens; the feedback it gets is the number of draft tokens
    inside the accepted target tokens' text."""

    def __init__(self, drafter, bridge: TextBridge):
        self.drafter = drafter            # the model drafter, in the draft's vocabulary
        self.bridge = bridge
        self.name = drafter.name
        self.model = drafter.model
        self._last: tuple[Draft, Proposal] | None = None

    @property
    def plan(self):
        """The drafter's draft-length plan (the one that decides, and that engines share)."""
        return self.drafter.plan

    def controllers(self) -> tuple:
        return self.drafter.controllers()

    def begin(self, budget: int | None = None) -> None:
        self.drafter.begin(budget)

    def report(self) -> dict | None:
        return self.drafter.report()

    def propose(self, context: np.ndarray, k: int) -> Draft:
        self._last = None
        if k <= 0:
            return NO_DRAFT
        ids = self.bridge.sync(context)
        if self.bridge.held or not len(ids):          # nothing would line up, or nothing to go on
            return NO_DRAFT
        inner = self.drafter.propose(ids, k + 1)      # one more: the trailing token is dropped
        proposal = self.bridge.proposal(inner.tokens)
        self._last = (inner, proposal)
        return Draft(proposal.tokens[:k], inner.level, source=inner.source, seconds=inner.seconds,
                     text=proposal.text)

    def observe(self, draft: Draft, accepted: int) -> None:
        """Feedback in draft tokens, over the draft tokens the target was shown: the dropped
        trailing text, and what lay past what was verified, was never tried and is not counted
        as rejected."""
        if self._last is None:
            return
        inner, proposal = self._last
        shown = proposal.draft_tokens_within(len(draft.tokens))
        tried = dataclasses.replace(inner, tokens=inner.tokens[:shown],
                                    levels=inner.levels[:shown] if inner.levels is not None else None)
        self.drafter.observe(tried, min(proposal.draft_tokens_within(accepted), shown))
