"""Constrained decoding: a grammar over the target's vocabulary (docs/design.md, "Grammars").

A Grammar is compiled once for a vocabulary; each generation under it holds a Constraint, the
grammar's state at the committed tokens. In a round the engine asks the Constraint

    forced()            the tokens the grammar forces next (free drafts: the target may still
                        spell the same text with other tokens, and then its choice stands)
    allowed(draft)      how long a prefix of the draft the grammar allows (the rest is cut off)
    restrict(logits, draft)   sets every token the grammar forbids at row j (after draft[:j])
                        to -inf, in place: every rule after that sees the target's
                        distribution under the grammar
    commit(tokens)      advance over what the round committed

The state moves only on commit: the masks of a round are computed on the draft and rolled
back at once, so a round's rejected tokens never reach it.

The engine is llguidance (a Rust library on PyPI with no dependencies of its own): it builds
token masks from a vocabulary's bytes in tens of microseconds, compiles JSON schemas, Lark
and GBNF grammars, computes the forced tokens, and rolls back.
"""

from __future__ import annotations

import json
import weakref

import numpy as np

from flylocal.errors import FlylocalError, GrammarError

# JSON as people write it: ", " and ": " between items, no other whitespace. Fixed separators
# are forced tokens, and a model cannot pad its answer with endless newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # vocabulary owner -> LLTokenizer


def _llg():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:  # pragma: no cover - a dependency of the package
        raise FlylocalError("constrained output needs the llguidance package: pip install llguidance") from None
    return llguidance


class _Vocabulary:
    """What llguidance reads of a tokenizer: every token's bytes (control tokens marked with a
    leading 0xff byte, so that no text ever matches them), the end-of-generation ids, and the
    model's own tokenizer for text the grammar forces."""

    def __init__(self, model):
        self.tokens = [(b"\xff" if model.is_control(t) else b"") + model.piece(t, special=True)
                       for t in range(model.n_vocab)]
        self.special_token_ids = [t for t in range(model.n_vocab) if model.is_control(t)]
        eog = np.flatnonzero(model.eog_mask)
        self.eos_token_id = int(eog[0]) if eog.size else 0
        self.bos_token_id = getattr(model, "bos", None)
        self._model = weakref.ref(model)    # the cache below must not keep a closed model alive

    def __call__(self, data: bytes | str) -> list[int]:
        model = self._model()
        if model is None:
            raise FlylocalError("the model of this grammar was closed")
        return [int(t) for t in model.tokenize(data.encode() if isinstance(data, str) else data, add_special=False)]


def tokenizer(model):
    """The llguidance tokenizer of a model's vocabulary (the target Runtime, or anything with
    n_vocab, eog_mask, piece, is_control, bos and tokenize), built once per model: reading a
    vocabulary of 262,144 tokens takes a few seconds."""
    llg = _llg()
    found = _tokenizers.get(model)
    if found is None:
        vocab = _Vocabulary(model)
        found = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=model.n_vocab,
                                eos_token=[int(t) for t in np.flatnonzero(model.eog_mask)] or None)
        _tokenizers[model] = found
    return found


# ----- what a user gives -----

def json_schema(schema, source: str = "the JSON schema") -> str:
    """The grammar of JSON valid under `schema` (a dict, or its JSON text); errors name it `source`."""
    llg = _llg()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{source} is a {type(schema).__name__}; a JSON schema is an object")
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{source} cannot be used: {_line(e)}") from None


def json_object() -> str:
    """Any JSON object."""
    return json_schema({"type": "object"})


def json_output(schema=None, source: str = "the JSON schema") -> tuple[str, str]:
    """(what it is, its grammar) of an output that is JSON: valid under `schema` (a dict, or its
    JSON text; errors name it `source`), or any JSON object when `schema` is None."""
    if schema is None:
        return "the JSON object", json_object()
    return source, checked(json_schema(schema, source), source)


def grammar_text(text: str, source: str = "the grammar") -> str:
    """A grammar in Lark (llguidance's syntax) or llama.cpp's GBNF, whichever it is."""
    llg = _llg()
    try:
        return llg.grammar_from("grammar", text)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{source} cannot be read: {_line(e)}") from None


def checked(grammar: str, source: str) -> str:
    """`grammar`, once it is known to compile (before any vocabulary is read): FlylocalError
    naming `source` otherwise."""
    error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise GrammarError(f"{source} cannot be used: {_line(Exception(messages[0]))}")
    return grammar


def _line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class Grammar:
    """A grammar checked against one vocabulary; `start()` gives a fresh Constraint."""

    def __init__(self, model, grammar: str, name: str = "the grammar"):
        llg = _llg()
        self.name = name
        self.tokenizer = tokenizer(model)
        self.n_vocab = model.n_vocab
        error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"{name} cannot be used: {_line(Exception(messages[0]))}")
        self.grammar = grammar

    def start(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """The grammar's state at the tokens committed so far in one generation."""

    def __init__(self, grammar: Grammar):
        llg = _llg()
        self._llg = llg
        self.grammar = grammar
        self.matcher = llg.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        self._check()
        self.n_vocab = grammar.n_vocab
        self._words = (grammar.tokenizer.vocab_size + 31) // 32
        self._executor = _executor()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.grammar.name} failed: {_line(Exception(self.matcher.get_error()))}")

    def forced(self, limit: int) -> np.ndarray:
        """The next tokens the grammar allows no alternative to (up to `limit`) [f] int32."""
        if limit <= 0:
            return np.zeros(0, dtype=np.int32)
        return np.asarray(self.matcher.compute_ff_tokens()[:limit], dtype=np.int32)

    def allowed(self, draft: np.ndarray) -> int:
        """How many of the draft's first tokens the grammar allows in sequence."""
        return int(self.matcher.validate_tokens(draft.tolist())) if len(draft) else 0

    def restrict(self, logits: np.ndarray, draft: np.ndarray) -> None:
        """Row j of `logits` [k+1, n_vocab] follows draft[:j] (a prefix the grammar allows):
        set the tokens the grammar forbids there to -inf, in place."""
        rows = len(draft) + 1
        masks = np.full((rows, self._words), -1, dtype=np.int32)
        if len(draft):
            self._llg.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(self.matcher, 0, draft.tolist())], masks)
        else:
            self._llg.numpy.fill_next_token_bitmask(self.matcher, masks)
        self._check()
        for j in range(rows):
            forbid(logits[j], masks[j])

    def commit(self, tokens) -> None:
        """Advance over committed tokens (each allowed where it stands)."""
        if len(tokens) and not self.matcher.consume_tokens([int(t) for t in tokens]):
            self._check()
            raise FlylocalError(f"{self.grammar.name} refused a committed token")  # pragma: no cover


def forbid(row: np.ndarray, words: np.ndarray) -> None:
    """Set row[t] = -inf (in place) for every token t whose bit is clear in `words`
    ([ceil(V/32)] int32, bit t % 32 of word t // 32). Rows where a grammar allows a few tokens
    (structure) or forbids a few (free text) touch only those; others are masked whole."""
    V = len(row)
    nz = np.flatnonzero(words)
    if len(nz) * 8 < len(words):                                    # a few allowed: keep them
        bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(len(nz), 32)
        r, b = np.nonzero(bits)
        ids = nz[r] * 32 + b
        keep = row[ids]
        row.fill(-np.inf)
        row[ids] = keep
        return
    partial = np.flatnonzero(words != -1)
    if len(partial) * 8 < len(words):                               # a few forbidden: clear them
        bits = np.unpackbits((~words[partial]).view(np.uint8), bitorder="little").reshape(len(partial), 32)
        r, b = np.nonzero(bits)
        ids = partial[r] * 32 + b
        row[ids[ids < V]] = -np.inf
        return
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:V].view(bool)
    np.putmask(row, ~allowed, -np.inf)


_shared_executor = None


def _executor():
    """One thread pool for mask computation in the process (llguidance's)."""
    global _shared_executor
    if _shared_executor is None:
        _shared_executor = _llg().LLExecutor(1)
    return _shared_executor
