"""What a JSON output's constraint keeps beside its grammar (docs/design.md, "Grammars"):
two rules no JSON schema can state, checked on the bytes as they are written, over llguidance's
masks (flylocal.decoding.grammar.Constraint):

- a number's fraction has at most FRACTION_DIGITS digits (`Digits`);
- an object has each key once (`Keys`): llguidance keeps a key an object names to one, but not
  keys a pattern names (`patternProperties`) or any key (`{"type": "object"}`).

`JsonTables` holds what these rules read of a vocabulary, once per model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A number's fraction has at most 16 digits (as llama.cpp's converter bounds it).
FRACTION_DIGITS = 16


@dataclass(frozen=True)
class JsonTables:
    """Per token of a vocabulary, what a JSON output's constraint (JsonState) asks of it:
    - lead, after_dot ([n_vocab] int32): how many ASCII digits its bytes begin with, and how many
      follow a "." it begins with (0 where it begins otherwise);
    - closes: for the tokens that end a string (an unescaped '"' within them), the bytes before
      that quote -> those tokens; `closes_escaped` the same for a token that begins after a
      backslash within the string."""
    lead: np.ndarray
    after_dot: np.ndarray
    closes: dict[bytes, list[int]]
    closes_escaped: dict[bytes, list[int]]

    @classmethod
    def of(cls, pieces: list[bytes]) -> JsonTables:
        lead = np.zeros(len(pieces), dtype=np.int32)
        after_dot = np.zeros(len(pieces), dtype=np.int32)
        closes: dict[bytes, list[int]] = {}
        closes_escaped: dict[bytes, list[int]] = {}
        for t, piece in enumerate(pieces):          # a control token's leading 0xff is no digit
            if piece[:1].isdigit():
                lead[t] = len(piece) - len(piece.lstrip(b"0123456789"))
            elif piece[:1] == b"." and piece[1:2].isdigit():
                after_dot[t] = len(piece) - 1 - len(piece[1:].lstrip(b"0123456789"))
            if b'"' in piece:
                for table, escaped in ((closes, False), (closes_escaped, True)):
                    at = string_end(piece, escaped)
                    if at is not None:
                        table.setdefault(piece[:at], []).append(t)
        return cls(lead, after_dot, closes, closes_escaped)


def string_end(data: bytes, escaped: bool = False) -> int | None:
    """Where the first unescaped '"' of `data` is, read within a string (after a backslash
    when `escaped`); None when none ends the string."""
    for i, c in enumerate(data):
        if escaped:
            escaped = False
        elif c == 0x5C:
            escaped = True
        elif c == 0x22:
            return i
    return None


class Digits:
    """Where a JSON text stands in its numbers, byte by byte: outside or inside a string, and
    how many digits a number's fraction has so far (-1: not in a fraction; `integral`: in a
    number's integral part)."""

    __slots__ = ("in_string", "escaped", "integral", "fraction")

    def __init__(self):
        self.in_string = self.escaped = self.integral = False
        self.fraction = -1

    def copy(self) -> Digits:
        out = Digits()
        out.in_string, out.escaped, out.integral, out.fraction = self.in_string, self.escaped, self.integral, self.fraction
        return out

    def feed(self, data: bytes) -> None:
        for c in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == 0x5C:                         # backslash
                    self.escaped = True
                elif c == 0x22:
                    self.in_string = False
            elif 0x30 <= c <= 0x39:
                if self.fraction >= 0:
                    self.fraction += 1
                else:
                    self.integral = True
            elif c == 0x2E and self.integral:           # "." after an integral part
                self.integral, self.fraction = False, 0
            else:
                self.integral, self.fraction = c == 0x2D, -1     # "-" begins a number
                self.in_string = c == 0x22

    def refuses(self, token: int, lead: np.ndarray, after_dot: np.ndarray) -> bool:
        """Whether `token` would give a fraction more than FRACTION_DIGITS digits here."""
        if self.fraction >= 0:
            return lead[token] > FRACTION_DIGITS - self.fraction
        return self.integral and after_dot[token] > FRACTION_DIGITS

    def refused(self, lead: np.ndarray, after_dot: np.ndarray) -> np.ndarray | None:
        """[n_vocab] bool: the tokens that would give a fraction more than FRACTION_DIGITS
        digits here (None: no token would)."""
        if self.fraction >= 0:
            return lead > FRACTION_DIGITS - self.fraction
        if self.integral:
            return after_dot > FRACTION_DIGITS
        return None


class Keys:
    """Where a JSON text stands in its objects, byte by byte: the keys each open object has,
    and the key being written, so that no object gets a key twice. llguidance's JSON grammars
    keep the keys an object names to one each, but not keys a pattern names
    (`patternProperties`) or any key (`{"type": "object"}`): a model looping on one key would
    write it until the token limit. Keys are compared as written (escapes and all)."""

    __slots__ = ("stack", "in_string", "escaped", "key", "expect")

    def __init__(self):
        self.stack: list[set | None] = []      # per open container: its keys (an object) or None (an array)
        self.in_string = self.escaped = False
        self.key: bytearray | None = None      # the key being written (its bytes so far), or None
        self.expect = False                    # the innermost object's next string is a key

    def copy(self) -> Keys:
        out = Keys()
        out.stack = [None if keys is None else set(keys) for keys in self.stack]
        out.in_string, out.escaped, out.expect = self.in_string, self.escaped, self.expect
        out.key = None if self.key is None else bytearray(self.key)
        return out

    def feed(self, data: bytes) -> None:
        for c in data:
            if self.in_string:
                if c == 0x22 and not self.escaped:
                    self.in_string = False
                    if self.key is not None:
                        self.stack[-1].add(bytes(self.key))
                        self.key = None
                    continue
                self.escaped = not self.escaped and c == 0x5C
                if self.key is not None:
                    self.key.append(c)
            elif c == 0x22:
                self.in_string, self.escaped = True, False
                if self.expect:
                    self.key, self.expect = bytearray(), False
            elif c == 0x7B:                             # {
                self.stack.append(set())
                self.expect = True
            elif c == 0x5B:                             # [
                self.stack.append(None)
                self.expect = False
            elif c in (0x7D, 0x5D):                     # } ]
                if self.stack:
                    self.stack.pop()
                self.expect = False
            elif c == 0x2C:                             # ,
                self.expect = bool(self.stack) and self.stack[-1] is not None

    def _written(self) -> tuple[bytes, set] | None:
        """(the key so far, the keys its object has) while a key is written beside others."""
        if self.key is None or not self.stack[-1]:
            return None
        return bytes(self.key), self.stack[-1]

    def refuses(self, piece: bytes) -> bool:
        """Whether a token of these bytes would end the key being written as one its object has."""
        written = self._written()
        if written is None:
            return False
        at = string_end(piece, self.escaped)
        return at is not None and written[0] + piece[:at] in written[1]

    def refused(self, tables: JsonTables) -> list[int]:
        """The tokens that would end the key being written as one its object has."""
        written = self._written()
        if written is None:
            return []
        key, keys = written
        closes = tables.closes_escaped if self.escaped else tables.closes
        return [t for other in keys if other.startswith(key) for t in closes.get(other[len(key):], ())]


class JsonState:
    """A JSON output's place for the constraint's own rules, beside the grammar's: a fraction's
    digits (Digits) and an object's keys (Keys)."""

    __slots__ = ("digits", "keys")

    def __init__(self, digits: Digits | None = None, keys: Keys | None = None):
        self.digits, self.keys = digits or Digits(), keys or Keys()

    def copy(self) -> JsonState:
        return JsonState(self.digits.copy(), self.keys.copy())

    def feed(self, data: bytes) -> None:
        self.digits.feed(data)
        self.keys.feed(data)

    def refuses(self, token: int, tables: JsonTables, piece: bytes) -> bool:
        return self.digits.refuses(token, tables.lead, tables.after_dot) or self.keys.refuses(piece)

    def forbid(self, row: np.ndarray, tables: JsonTables) -> None:
        """Set the tokens these rules refuse here to -inf in `row` [n_vocab], in place. A key
        its object has is refused only while another token is left (a pattern naming one key
        alone, once written, leaves none): a repeated key beats no answer."""
        refused = self.digits.refused(tables.lead, tables.after_dot)
        if refused is not None:
            row[refused[:len(row)]] = -np.inf
        again = [t for t in self.keys.refused(tables) if t < len(row)]
        if again:
            kept = row[again].copy()
            row[again] = -np.inf
            if not np.isfinite(row).any():
                row[again] = kept
