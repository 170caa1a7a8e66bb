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

from flylocal.decoding.json_state import JsonState, JsonTables

from flylocal.decoding.contracts import Vocabulary
from flylocal.errors import FlylocalError, GrammarError

# JSON as people write it: ", " and ": " between items, no other whitespace. Fixed separators
# are forced tokens, and a model cannot pad its answer with endless newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A number's integral part has at most 16 digits where its schema sets no bound (as llama.cpp's
# own schema converter bounds it): an unbounded integer lets a model write digits until the
# token limit. The bound is written into the schema: strictly within ±10**16 (`bounded`).
DIGITS = 16
# How deep a schema's objects and arrays may lie within each other: llguidance reads 124 levels
# of JSON, and a tool's call and the bounds of numbers wrap a schema in a few more.
MAX_DEPTH = 100

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # vocabulary owner -> LLTokenizer
_json_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # vocabulary owner -> JsonTables


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

    def __init__(self, model: Vocabulary):
        self.tokens = [(b"\xff" if model.is_control(t) else b"") + model.piece(t, special=True)
                       for t in range(model.n_vocab)]
        self.special_token_ids = [t for t in range(model.n_vocab) if model.is_control(t)]
        eog = np.flatnonzero(model.eog_mask)
        self.eos_token_id = int(eog[0]) if eog.size else 0
        self.bos_token_id = model.bos
        self._model = weakref.ref(model)    # the cache below must not keep a closed model alive

    def __call__(self, data: bytes | str) -> list[int]:
        model = self._model()
        if model is None:
            raise FlylocalError("the model of this grammar was closed")
        return [int(t) for t in model.tokenize(data.encode() if isinstance(data, str) else data, add_special=False)]


def tokenizer(model: Vocabulary):
    """The llguidance tokenizer of a model's vocabulary (contracts.Vocabulary: the target Runtime,
    or the tests' literal ones), built once per model: reading a vocabulary of 262,144 tokens
    takes a few seconds."""
    llg = _llg()
    found = _tokenizers.get(model)
    if found is None:
        vocab = _Vocabulary(model)
        found = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=model.n_vocab,
                                eos_token=[int(t) for t in np.flatnonzero(model.eog_mask)] or None)
        _tokenizers[model] = found
        _json_tables[model] = JsonTables.of(vocab.tokens)       # from the same bytes, read once
    return found


# ----- what a user gives -----

def json_schema(schema, source: str = "the JSON schema") -> str:
    """The grammar of JSON valid under `schema` (a dict, or its JSON text); errors name it `source`."""
    llg = _llg()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise GrammarError(f"{source} is nested too deep: at most {MAX_DEPTH} levels of objects and arrays") from None
        except json.JSONDecodeError as e:
            raise GrammarError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{source} is a {type(schema).__name__}; a JSON schema is an object")
    check_depth(schema, source)
    try:
        # As text: llguidance takes no Python int past 64 bits, and reads one in JSON as it is.
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(bounded(schema)), defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{source} cannot be used: {_line(str(e))}") from None


def json_object() -> str:
    """Any JSON object."""
    return json_schema({"type": "object"})


def check_depth(schema, source: str) -> None:
    """GrammarError naming `source` where `schema`'s objects and arrays lie more than MAX_DEPTH
    levels within each other (counted without recursion: a request may hold a thousand)."""
    level, deepest = [schema], 0
    while level:
        deepest += 1
        if deepest > MAX_DEPTH:
            raise GrammarError(f"{source} is nested too deep: at most {MAX_DEPTH} levels of objects and arrays")
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else node)
                 if isinstance(v, (dict, list))]


# Where a schema puts a subschema of the values it allows (not under "not", "if" or
# "propertyNames": a bound there would widen or say nothing).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "then", "else")
# A schema with one of these is not bounded itself (a bound beside them would be an
# intersection, or says nothing): the schemas within it are.
_COMPOSED = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum")
_ANY = "flylocal_any"                     # the bounded "any value", in the root's $defs
# An object schema that names its keys with one of these and says nothing of others allows no
# others (docs/design.md, "Grammars"): llama.cpp's rule, for clients that leave the key out.
_NAMING = ("properties", "patternProperties")


def bounded(schema: dict) -> dict:
    """`schema` (checked by check_depth) with every number it allows bounded to DIGITS
    integral digits where it leaves them open: a side the schema bounds itself keeps its own
    bound, a side it leaves open lies at ±10**16 (unless the other side's bound lies past
    it), and any value it allows ({}, true, an object's other properties, an array's items
    when not given) is one whose numbers, at any depth, are bounded likewise.

    Objects are closed unless they say otherwise: one that names its keys (`properties`,
    `patternProperties`) and gives no `additionalProperties` allows no other keys; one that
    names none (`{"type": "object"}`) is any object, and so is a branch of an `allOf`, whose
    keys the other branches name."""
    limit = 10**DIGITS
    ref = {"$ref": f"#/$defs/{_ANY}"}
    used = []

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def walk(node, branch: bool = False):
        if node is True:
            used.append(True)
            return ref
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: walk(v) for name, v in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [walk(v, key == "allOf") for v in out[key]]
        for key in _SCHEMAS:
            if isinstance(out.get(key), (dict, bool)):
                out[key] = walk(out[key])
        if any(key in out for key in _COMPOSED):
            return out
        types = out.get("type", ("null", "boolean", "number", "integer", "string", "array", "object"))
        types = (types,) if isinstance(types, str) else types
        if "number" in types or "integer" in types:
            low = out.get("minimum", out.get("exclusiveMinimum"))
            high = out.get("maximum", out.get("exclusiveMaximum"))
            if low is None and (high is None or number(high) and high > -limit):
                out["exclusiveMinimum"] = -limit
            if high is None and (low is None or number(low) and low < limit):
                out["exclusiveMaximum"] = limit
        if "object" in types and "additionalProperties" not in out:
            if branch or not any(key in out for key in _NAMING):
                used.append(True)
                out["additionalProperties"] = ref
            else:
                out["additionalProperties"] = False
        if "array" in types and "items" not in out:
            used.append(True)
            out["items"] = ref
        return out

    out = walk(schema)
    if used:
        any_value = {"exclusiveMinimum": -limit, "exclusiveMaximum": limit, "items": ref, "additionalProperties": ref}
        defs = out.get("$defs")
        out["$defs"] = {**(defs if isinstance(defs, dict) else {}), _ANY: any_value}
    return out


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
        raise GrammarError(f"{source} cannot be read: {_line(str(e))}") from None


def checked(grammar: str, source: str) -> str:
    """`grammar`, once it is known to compile (before any vocabulary is read): FlylocalError
    naming `source` otherwise."""
    error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise GrammarError(f"{source} cannot be used: {_line(messages[0])}")
    return grammar


def _line(message: str) -> str:
    """llguidance's message in one line: its first, with the detail a regex error gives below
    it ("regex parse error:", the pattern, carets, "error: unclosed group")."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "an unknown error"
    first = lines[0]
    detail = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), None)
    if not first.endswith("regex parse error:") or detail is None:
        return first
    head = first.removesuffix("regex parse error:").rstrip(": ")
    if not head:                                    # a schema's pattern: say which
        head = f"invalid regex {json.dumps(lines[1])}" if not lines[1].startswith("error:") else "invalid regex"
    return f"{head}: {detail}"


def json_tables(model: Vocabulary) -> JsonTables:
    """What a JSON output's constraint reads of `model`'s vocabulary (JsonTables), read with
    its tokenizer (`tokenizer`), once per model."""
    tokenizer(model)
    return _json_tables[model]


def is_json(grammar: str) -> bool:
    """Whether `grammar` is one JSON schema's (json_schema, json_object): its output is JSON
    from its first byte."""
    try:
        grammars = json.loads(grammar).get("grammars")
    except (ValueError, AttributeError):
        return False
    return isinstance(grammars, list) and len(grammars) == 1 and "json_schema" in grammars[0]


class Grammar:
    """A grammar checked against one vocabulary; `start()` gives a fresh Constraint."""

    def __init__(self, model: Vocabulary, grammar: str, name: str = "the grammar"):
        llg = _llg()
        self.name = name
        self.tokenizer = tokenizer(model)
        self.n_vocab = model.n_vocab
        error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"{name} cannot be used: {_line(messages[0])}")
        self.grammar = grammar
        # A JSON output's fractions are bounded, and its objects' keys kept one each, as it is
        # written (JsonState).
        self.tables = json_tables(model) if is_json(grammar) else None

    def start(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """The grammar's state at the tokens committed so far in one generation."""

    def __init__(self, grammar: Grammar):
        llg = _llg()
        self._llg = llg
        self.grammar = grammar
        self.tokens: list[int] = []         # committed: to say where the grammar failed, if it does
        self.matcher = llg.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        self._check()
        self.n_vocab = grammar.n_vocab
        self._words = (grammar.tokenizer.vocab_size + 31) // 32
        self._executor = _executor()
        self._json = JsonState() if grammar.tables is not None else None     # at the committed tokens

    def _check(self, ahead=()) -> None:
        """GrammarError, saying where, once the matcher has failed: after the committed tokens
        and the first of `ahead` (the draft, or the tokens being committed) it accepts."""
        if not self.matcher.is_error():
            return
        reason = _line(self.matcher.get_error())
        if reason in ("NoExtension", "NoExtensionBias"):      # llguidance's words for a dead end
            reason = "it allows nothing this model's vocabulary can write"
        elif reason in ("LexerTooComplex", "ParserTooComplex"):
            reason = f"it is too complex for llguidance ({reason})"
        raise GrammarError(f"{self.grammar.name} failed {self._where(ahead)}: {reason}")

    def _where(self, ahead) -> str:
        """"after '<the text>'" (its end) or "at the start": how far a fresh matcher gets over
        the committed tokens and `ahead` (the failed one stays failed)."""
        matcher = self._llg.LLMatcher(self.grammar.tokenizer, self.grammar.grammar, log_level=0)
        tokens = list(self.tokens)
        matcher.consume_tokens(tokens)
        for t in [int(t) for t in ahead]:
            matcher.compute_bitmask()
            if matcher.is_error() or not matcher.consume_token(t):
                break
            tokens.append(t)
        text = self.grammar.tokenizer.decode_str(tokens)
        return f"after {'…' if len(text) > 40 else ''}{text[-40:]!r}" if text else "at the start"

    def forced(self, limit: int) -> np.ndarray:
        """The next tokens the grammar allows no alternative to (up to `limit`) [f] int32."""
        if limit <= 0:
            return np.zeros(0, dtype=np.int32)
        return np.asarray(self.matcher.compute_ff_tokens()[:limit], dtype=np.int32)

    def allowed(self, draft: np.ndarray) -> int:
        """How many of the draft's first tokens the grammar allows in sequence."""
        n = int(self.matcher.validate_tokens(draft.tolist())) if len(draft) else 0
        if self._json is None or not n:
            return n
        state = self._json.copy()
        for j, t in enumerate(draft[:n].tolist()):
            piece = self.grammar.tokenizer.decode_bytes([t])
            if state.refuses(t, self.grammar.tables, piece):
                return j
            state.feed(piece)
        return n

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
        self._check(draft)
        state = self._json.copy() if self._json is not None else None
        for j in range(rows):
            forbid(logits[j], masks[j])
            if state is not None:
                state.forbid(logits[j], self.grammar.tables)
                if j < len(draft):
                    state.feed(self.grammar.tokenizer.decode_bytes([int(draft[j])]))

    def truncate(self, n: int) -> None:
        """Go back to the state after the first n committed tokens (a retracted window)."""
        back = len(self.tokens) - n
        if back <= 0:
            return
        self.matcher.rollback(back)
        del self.tokens[n:]
        if self._json is not None:
            self._json = JsonState()
            self._json.feed(self.grammar.tokenizer.decode_bytes(self.tokens))
        if self.matcher.is_error():          # past what llguidance keeps: replay from the start
            self.matcher = self._llg.LLMatcher(self.grammar.tokenizer, self.grammar.grammar, log_level=0)
            self.matcher.consume_tokens(self.tokens)

    def commit(self, tokens) -> None:
        """Advance over committed tokens (each allowed where it stands)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) and not self.matcher.consume_tokens(tokens):
            self._check(tokens)
            raise FlylocalError(f"{self.grammar.name} refused a committed token")  # pragma: no cover
        self.tokens += tokens
        if self._json is not None:
            self._json.feed(self.grammar.tokenizer.decode_bytes(tokens))


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
