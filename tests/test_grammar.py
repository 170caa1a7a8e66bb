"""Grammars in the round (docs/design.md, "Grammars"), on the in-memory fake target with a
vocabulary of 32 byte strings, so that llguidance's masks are real and llama.cpp is not needed.

- After every round the grammar's state equals a fresh matcher fed the committed tokens
  (random drafts, random rejections, every verifier, both temperatures).
- Strict under a grammar equals plain constrained greedy decoding token for token.
- A draft token the grammar forbids ends the draft: no verifier accepts it, however loose.
- The tokens the grammar forces are drafted first and counted as `forced`.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest

from fake_backend import FakeLM, FakeTarget, NoisyOracle, fixed_costs
from flylocal.decoding import grammar as G
from flylocal.decoding.contracts import Draft, Drafter
from flylocal.decoding.drafters import NoDraft
from flylocal.decoding.engine import Engine, EngineConfig
from flylocal.decoding.sampling import SamplingParams
from flylocal.decoding.verifiers.asd import Asd, AsdParams
from flylocal.decoding.verifiers.fly import Fly, FlyParams
from flylocal.decoding.verifiers.strict import Strict
from flylocal.errors import FlylocalError

PIECES = [b"<eos>", b"{", b"}", b'"', b":", b",", b" ", b"a", b"b", b"c", b"0", b"1", b"2", b"3", b"-", b"x",
          b"[", b"]", b'{"', b'":', b'", "', b'"}', b"ab", b"12", b"true", b"false", b"null", b".", b"e", b"y",
          b"\n", b"ba"]
EOS = 0


class Vocab:
    """The part of a Runtime a Grammar reads: 32 tokens, token 0 the end of generation."""

    n_vocab = len(PIECES)
    bos = None

    def __init__(self):
        self.eog_mask = np.zeros(self.n_vocab, dtype=bool)
        self.eog_mask[EOS] = True

    def piece(self, token: int, special: bool = False) -> bytes:
        return PIECES[token] if special or token != EOS else b""

    def is_control(self, token: int) -> bool:
        return token == EOS

    def tokenize(self, data: bytes, add_special: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(data):                            # longest match first; bytes it lacks are dropped
            t = max((t for t in range(1, self.n_vocab) if data.startswith(PIECES[t], i)),
                    key=lambda t: len(PIECES[t]), default=None)
            if t is not None:
                out.append(t)
            i += len(PIECES[t]) if t is not None else 1
        return out


VOCAB = Vocab()
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"ab": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                                      "c": {"type": "boolean"}},
     "required": ["ab", "c"], "additionalProperties": False},
]
GRAMMARS = [G.Grammar(VOCAB, G.json_schema(s), "the JSON schema") for s in SCHEMAS]
LM = FakeLM(seed=7, n_vocab=len(PIECES), eog=(EOS,), p_eog=0.05)
PROMPT = np.array([1, 7, 2, 11], dtype=np.int32)


def fresh_state(grammar: G.Grammar, tokens) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
    assert m.consume_tokens([int(t) for t in tokens]), m.get_error()
    return m


def same_state(a: llguidance.LLMatcher, b: llguidance.LLMatcher) -> bool:
    return (a.compute_bitmask() == b.compute_bitmask() and a.is_accepting() == b.is_accepting()
            and a.is_stopped() == b.is_stopped() and a.compute_ff_tokens() == b.compute_ff_tokens())


def text(tokens) -> str:
    return b"".join(PIECES[t] for t in tokens).decode()


class GrammarOracle(Drafter):
    """Proposes the LM's greedy continuation under the grammar, a token replaced by a random
    allowed one with probability p_corrupt, and by any random token with probability p_wild."""

    name = "oracle"

    def __init__(self, grammar: G.Grammar, seed: int, p_corrupt: float = 0.2, p_wild: float = 0.05):
        self.grammar, self.rng = grammar, np.random.default_rng(seed)
        self.p_corrupt, self.p_wild = p_corrupt, p_wild
        self.prompt_len = len(PROMPT)

    def propose(self, context: np.ndarray, k: int) -> Draft:
        m = fresh_state(self.grammar, context[self.prompt_len:])
        target = FakeTarget(LM, n_ctx=len(context) + k + 1)
        target.decode(context[:-1])
        draft, last = [], int(context[-1])
        for _ in range(int(self.rng.integers(0, k + 1))):
            z = target.decode([last], logits_from=0)[0].copy()
            allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:LM.n_vocab]
            ids = np.flatnonzero(allowed)
            if not len(ids) or m.is_stopped():
                break
            u = self.rng.random()
            t = (int(self.rng.integers(LM.n_vocab)) if u < self.p_wild
                 else int(self.rng.choice(ids)) if u < self.p_wild + self.p_corrupt
                 else int(ids[np.argmax(z[ids])]))
            draft.append(t)
            if t == EOS or not m.consume_token(t):
                break
            last = t
        return Draft(np.array(draft, dtype=np.int32))


def constrained_greedy(grammar: G.Grammar, max_tokens: int) -> list[int]:
    """The reference: plain greedy decoding one token at a time, each from the argmax of the
    target's logits over the tokens the grammar allows there."""
    m = fresh_state(grammar, [])
    target = FakeTarget(LM, n_ctx=len(PROMPT) + max_tokens + 1)
    target.decode(PROMPT[:-1])
    out, last = [], int(PROMPT[-1])
    while len(out) < max_tokens:
        z = target.decode([last], logits_from=0)[0]
        allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:LM.n_vocab]
        ids = np.flatnonzero(allowed)
        t = int(ids[np.argmax(z[ids])])
        if t == EOS:
            break
        assert m.consume_token(t)
        out.append(t)
        last = t
    return out


def random_verifier(rng):
    kind = rng.integers(3)
    if kind == 0:
        return Strict()
    if kind == 1:
        return Fly(FlyParams(window=int(rng.integers(1, 5)), entropy=float(rng.choice([0.0, 0.0, 0.3, 1.0])),
                             use_window=bool(rng.random() < 0.8), across=bool(rng.random() < 0.8)))
    return Asd(AsdParams(gate=float(rng.choice([0.1, 10.0])), cap=int(rng.integers(1, 4)), budget=float(rng.choice([4.0, 100.0]))))


@pytest.mark.parametrize("seed", range(120))
def test_the_state_after_each_round_is_a_fresh_matcher_fed_the_committed_tokens(seed):
    rng = np.random.default_rng(seed)
    grammar = GRAMMARS[seed % len(GRAMMARS)]
    drafter = (GrammarOracle(grammar, seed) if seed % 3 else
               NoisyOracle(LM, seed=seed, p_corrupt=0.3, p_eog=0.05))
    sampling = SamplingParams(temperature=0.8, seed=seed) if seed % 4 == 1 else SamplingParams()
    config = EngineConfig(k=int(rng.integers(1, 9)), max_tokens=48, trace=True, sampling=sampling)
    target = FakeTarget(LM, n_ctx=128, costs=fixed_costs())
    gen = Engine(target, drafter, random_verifier(rng), config).generate(PROMPT, grammar=grammar)
    for event in gen:
        # Committed: the output and what a window across rounds (FLy) holds back after it; a
        # retraction rolls the matcher back.
        committed = gen.constraint.tokens
        assert committed[: len(gen.tokens)] == gen.tokens
        assert len(committed) - len(gen.tokens) == event.trace.get("held", 0)
        assert same_state(gen.constraint.matcher, fresh_state(grammar, committed)), f"seed {seed} round {event.index}"
        assert len(event.trace["draft"]) <= config.k
    if gen.stats.stop == "eog":            # a finished answer is valid under its schema
        jsonschema.validate(json.loads(text(gen.tokens)), SCHEMAS[seed % len(SCHEMAS)])


def test_a_retracted_window_rolls_the_grammar_back():
    """FLy's window across rounds under grammars: every round the matcher is where a fresh one
    fed the committed tokens is, through provisional tokens taken back."""
    retractions = 0
    for seed in range(40):
        grammar = GRAMMARS[seed % len(GRAMMARS)]
        verifier = Fly(FlyParams(window=2 + seed % 3, entropy=0.0, candidates=False))   # windows open often
        config = EngineConfig(k=1 + seed % 8, max_tokens=48, trace=True)
        gen = Engine(FakeTarget(LM, n_ctx=128, costs=fixed_costs()), GrammarOracle(grammar, seed), verifier,
                     config).generate(PROMPT, grammar=grammar)
        for event in gen:
            committed = gen.constraint.tokens
            assert committed[: len(gen.tokens)] == gen.tokens
            assert same_state(gen.constraint.matcher, fresh_state(grammar, committed)), f"seed {seed} round {event.index}"
        retractions += gen.stats.retractions
        if gen.stats.stop == "eog":
            jsonschema.validate(json.loads(text(gen.tokens)), SCHEMAS[seed % len(SCHEMAS)])
    assert retractions >= 5, retractions


@pytest.mark.parametrize("index", range(len(GRAMMARS)))
@pytest.mark.parametrize("drafter", ["oracle", "noisy", "none"])
def test_strict_under_a_grammar_is_plain_constrained_greedy(index, drafter):
    grammar = GRAMMARS[index]
    reference = constrained_greedy(grammar, 48)
    d = {"oracle": GrammarOracle(grammar, 1), "noisy": NoisyOracle(LM, seed=1, p_corrupt=0.3), "none": NoDraft()}[drafter]
    gen = Engine(FakeTarget(LM, n_ctx=128), d, Strict(), EngineConfig(k=6, max_tokens=48)) \
        .generate(PROMPT, grammar=grammar).run()
    assert gen.tokens == reference
    jsonschema.validate(json.loads(text(gen.tokens)), SCHEMAS[index])


class Scripted(Drafter):
    """Proposes the same tokens every round."""

    name = "scripted"

    def __init__(self, tokens):
        self.tokens = np.array(tokens, dtype=np.int32)

    def propose(self, context, k):
        return Draft(self.tokens[:k])


# The grammar of {"a": <integer>}: after '{"', 'a', '":', ' ' comes a digit or '-'.
OBJ_A = G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"], "additionalProperties": False}), "the JSON schema")
OPEN = [18, 7, 19, 6]                                  # '{"' 'a' '":' ' '
X = 15                                                 # 'x': no integer has it


@pytest.mark.parametrize("verifier", [Fly(FlyParams(window=1, entropy=0.0, use_window=False, candidates=False)),
                                      Asd(AsdParams(gate=1e9, cap=8, budget=1e9))])
def test_a_forbidden_draft_token_ends_the_draft_and_is_never_accepted(verifier):
    # These verifiers accept any mismatch: without the grammar the forbidden 'x' is committed.
    config = EngineConfig(k=6, max_tokens=8, trace=True, forced=False)
    loose = Engine(FakeTarget(LM, n_ctx=64), Scripted(OPEN + [X, 11]), verifier, config).generate(PROMPT).run()
    assert loose.tokens[4] == X
    verifier.reset()
    gen = Engine(FakeTarget(LM, n_ctx=64), Scripted(OPEN + [X, 11]), verifier, config).generate(PROMPT, grammar=OBJ_A)
    first = next(iter(gen))
    assert first.trace["draft"] == OPEN                # cut at 'x'
    assert list(first.tokens[:4]) == OPEN and first.tokens[4] != X
    assert first.tokens[4] in (10, 11, 12, 13, 14, 23)   # a digit or '-': the target's choice under the grammar


def test_the_target_chooses_among_the_tokens_the_grammar_allows():
    # The fake target's first choice after the prompt is not '{' or '{"'; the answer starts with one.
    assert FakeTarget(LM, n_ctx=8).decode(PROMPT, logits_from=3)[0].argmax() not in (1, 18)
    gen = Engine(FakeTarget(LM, n_ctx=64), NoDraft(), Strict(), EngineConfig(max_tokens=1)) \
        .generate(PROMPT, grammar=OBJ_A).run()
    assert gen.tokens[0] in (1, 18)


def test_forced_tokens_are_drafted_first_and_counted():
    config = EngineConfig(k=6, max_tokens=12, trace=True)
    empty = Scripted([])
    gen = Engine(FakeTarget(LM, n_ctx=64), empty, Strict(), config).generate(PROMPT, grammar=OBJ_A)
    first = next(iter(gen))
    # '{"a": ' is forced; the last forced token may still merge with what follows, so the
    # grammar may hold it back.
    forced = first.trace["forced"]
    assert forced >= 3 and first.trace["draft"] == OPEN[:forced]
    assert list(first.tokens[:forced]) == OPEN[:forced]
    gen.run()
    assert gen.stats.forced >= forced
    plain = Engine(FakeTarget(LM, n_ctx=64), NoDraft(), Strict(), EngineConfig(k=6, max_tokens=12)) \
        .generate(PROMPT, grammar=OBJ_A).run()
    assert gen.tokens == plain.tokens and plain.stats.forced == 0 and plain.stats.rounds > gen.stats.rounds
    off = Engine(FakeTarget(LM, n_ctx=64), empty, Strict(), EngineConfig(k=6, max_tokens=12, forced=False)) \
        .generate(PROMPT, grammar=OBJ_A).run()
    assert off.stats.forced == 0 and off.tokens == plain.tokens


def accepts(grammar: G.Grammar, text: str) -> bool:
    """Whether `grammar` takes `text` whole (spelled in the 32-token vocabulary)."""
    m = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
    return bool(m.consume_tokens(VOCAB.tokenize(text.encode()))) and m.is_accepting()


def test_an_integer_has_at_most_16_digits_unless_its_schema_bounds_it():
    # A drafter that drafts '1' after '1', accepted by a verifier that accepts anything, writes
    # the number until the token limit; the grammar ends it at 16 digits.
    class Ones(Drafter):
        name = "ones"

        def propose(self, context, k):
            written = len(context) - len(PROMPT)
            return Draft(np.array((OPEN[written:] + [11] * k)[:k], dtype=np.int32))

    loose = Asd(AsdParams(gate=1e9, cap=8, budget=1e9))
    gen = Engine(FakeTarget(LM, n_ctx=96), Ones(), loose,
                 EngineConfig(k=8, max_tokens=40, forced=False)).generate(PROMPT, grammar=OBJ_A).run()
    written = text(gen.tokens)
    assert written.startswith('{"a": ') and len(written[6:].rstrip("}")) == 16 and written[6:22].isdigit(), written

    def schema(**number):
        return G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": number}, "required": ["a"]}), "s")

    integer, number = schema(type="integer"), schema(type="number")
    for g in (integer, number):
        assert accepts(g, '{"a": ' + "3" * 16 + "}") and accepts(g, '{"a": -' + "3" * 16 + "}")
        assert not accepts(g, '{"a": ' + "3" * 17 + "}") and not accepts(g, '{"a": -' + "3" * 17 + "}")
    assert accepts(number, '{"a": ' + "3" * 16 + ".25}")
    # The schema's own bounds stand; a side it leaves open is bounded.
    assert accepts(schema(type="integer", maximum=10**18), '{"a": ' + "3" * 18 + "}")
    assert not accepts(schema(type="integer", maximum=10**18), '{"a": -' + "3" * 17 + "}")
    assert not accepts(schema(type="integer", minimum=0), '{"a": ' + "3" * 17 + "}")
    assert accepts(schema(type="integer", minimum=10**17), '{"a": ' + "3" * 18 + "}")
    # Numbers in any value: an anyOf's branch, a $ref's target, {}, an object's other properties.
    anyof = G.Grammar(VOCAB, G.json_schema({"anyOf": [{"type": "integer"}, {"type": "null"}]}), "s")
    ref = G.Grammar(VOCAB, G.json_schema({"type": "array", "items": {"$ref": "#/$defs/b"},
                                          "$defs": {"b": {"type": "integer"}}}), "s")
    anything = G.Grammar(VOCAB, G.json_schema({}), "s")
    objects = G.Grammar(VOCAB, G.json_object(), "the JSON object")
    for g, ok, long in [(anyof, "null", "1" * 17), (ref, "[1, 2]", "[" + "1" * 17 + "]"), (anything, "[1, null]", "1" * 17),
                        (anything, '{"a": [1]}', '{"a": [' + "1" * 17 + "]}"),
                        (objects, '{"a": {"b": [1, 2.3]}}', '{"a": {"b": [1, ' + "1" * 17 + "]}}")]:
        assert accepts(g, ok) and not accepts(g, long), ok


def test_a_fraction_has_at_most_16_digits_whatever_the_drafts_and_the_verifier():
    # A drafter that drafts "1" after "1." and a verifier that accepts anything write digits
    # until the token limit; the constraint ends the fraction at 16 (no schema can say so).
    # "12" (two digits in one token) may not cross the bound either; a string's digits are text.
    number = G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"type": "number"}},
                                             "required": ["a"]}), "s")
    head = OPEN + [11, 27]                                  # '{"a": 1.'

    class Ones(Drafter):
        name = "ones"

        def __init__(self, digit: int):
            self.digit = digit

        def propose(self, context, k):
            written = len(context) - len(PROMPT)
            return Draft(np.array((head[written:] + [self.digit] * k)[:k], dtype=np.int32))

    loose = Asd(AsdParams(gate=1e9, cap=32, budget=1e9))
    for digit in (11, 23):                                  # "1", "12": one round drafts past the bound
        gen = Engine(FakeTarget(LM, n_ctx=96), Ones(digit), loose,
                     EngineConfig(k=32, max_tokens=40, forced=False)).generate(PROMPT, grammar=number).run()
        written = text(gen.tokens)
        fraction = written[len('{"a": 1.'):].rstrip("}")
        assert written.startswith('{"a": 1.') and fraction.isdigit() and len(fraction) <= 16, written
        assert len(fraction) >= 15, written                  # the drafts ran to the bound
    # The grammar alone (a fresh matcher) would take more: the bound is the constraint's.
    assert accepts(number, '{"a": 1.' + "1" * 20 + "}")
    words = G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"type": "string"}},
                                            "required": ["a"]}), "s")
    state = words.start()
    state.commit(VOCAB.tokenize(b'{"a": "1.' + b"1" * 20))
    logits = np.zeros((1, VOCAB.n_vocab), dtype=np.float32)
    state.restrict(logits, np.zeros(0, dtype=np.int32))
    assert logits[0][11] == 0                               # in a string, another digit is still text


def repeated_key(written: str) -> str | None:
    """The first key written twice in one object of a JSON text (whole, or cut short), or None:
    read here on its own, character by character."""
    stack, in_string, escaped, key, expect = [], False, False, None, False
    for c in written:
        if in_string:
            if c == '"' and not escaped:
                in_string = False
                if key is not None:
                    if key in stack[-1]:
                        return key
                    stack[-1].add(key)
                    key = None
                continue
            escaped = not escaped and c == "\\"
            key = key + c if key is not None else None
        elif c == '"':
            in_string, escaped = True, False
            key, expect = ("", False) if expect else (None, expect)
        elif c in "{[":
            stack.append(set() if c == "{" else None)
            expect = c == "{"
        elif c in "}]":
            stack.pop()
            expect = False
        elif c == ",":
            expect = stack[-1] is not None
    return None


@pytest.mark.parametrize("schema", [{"type": "object", "patternProperties": {"^a.*$": {"type": "integer"}}},
                                    {"type": "object", "additionalProperties": {"type": "integer"}},
                                    {"type": "object"}])
@pytest.mark.parametrize("verifier", [Fly(FlyParams(window=1, entropy=0.0, use_window=False, candidates=False)),
                                      Asd(AsdParams(gate=1e9, cap=32, budget=1e9))])
def test_an_object_gets_no_key_twice_whatever_the_drafts_and_the_verifier(schema, verifier):
    # llguidance keeps a named key to one, but not keys a pattern names or any key: a drafter
    # that drafts '"a": 1, ' again and again, with a verifier that accepts anything, would write
    # "a" until the token limit. The constraint ends the key before it closes as "a" again.
    grammar = G.Grammar(VOCAB, G.json_schema(schema), "s")
    assert accepts(grammar, '{"a": 1, "a": 1}')                    # the grammar alone would take it
    assert repeated_key('{"a": 1, "b": {"a": [{"a": 2}]}, "a": 1}') == "a" and repeated_key('{"a": {"a": 1}}') is None
    again = [6, 3, 7, 19, 6, 11, 5]                                 # ' ' '"' 'a' '":' ' ' '1' ','

    class Repeats(Drafter):
        name = "repeats"

        def propose(self, context, k):
            written = len(context) - len(PROMPT)
            script = OPEN + [11, 5] + again * 8
            return Draft(np.array(script[written:written + k], dtype=np.int32))

    for seed in range(4):
        lm = FakeLM(seed=seed, n_vocab=len(PIECES), eog=(EOS,), p_eog=0.0)
        verifier.reset()
        gen = Engine(FakeTarget(lm, n_ctx=128), Repeats(), verifier,
                     EngineConfig(k=8, max_tokens=48, forced=False)).generate(PROMPT, grammar=grammar).run()
        written = text(gen.tokens)
        assert repeated_key(written) is None, written
        assert written.startswith('{"a": 1, "') and gen.stats.drafted > 0, written
    # Whatever the keys are written as: tokens that end a key within them ('", "' ends one and
    # begins the next).
    state = grammar.start()
    state.commit(VOCAB.tokenize(b'{"ab": 1, "a'))
    logits = np.zeros((1, VOCAB.n_vocab), dtype=np.float32)
    state.restrict(logits, np.zeros(0, dtype=np.int32))
    assert logits[0][19] == 0 and logits[0][3] == 0                # '":' and '"': "a" is new
    state.commit([8])                                               # 'b': "ab" so far
    logits[:] = 0
    state.restrict(logits, np.zeros(0, dtype=np.int32))
    assert logits[0][19] == -np.inf and logits[0][3] == -np.inf and logits[0][7] == 0   # "ab" again: no


def test_an_object_that_names_its_keys_allows_no_others_unless_it_says_so():
    # Clients send pydantic's and zod's schemas without additionalProperties; as llama.cpp reads
    # them, the keys they name are all there is (docs/design.md, "Grammars").
    def g(**schema):
        return G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, **schema}), "s")

    closed, opened, typed = g(), g(additionalProperties=True), g(additionalProperties={"type": "integer"})
    for grammar, extra in [(closed, False), (opened, True), (typed, True)]:
        assert accepts(grammar, '{"a": 1}') and accepts(grammar, "{}")
        assert accepts(grammar, '{"a": 1, "b": 2}') == extra and accepts(grammar, '{"b": 2}') == extra
        assert not accepts(grammar, '{"a": 1, "a": 2}')          # a key it names never appears twice
    assert not accepts(typed, '{"b": "x"}') and accepts(opened, '{"b": "x"}')
    # At any depth, in a tool's arguments as in a response format: pydantic's nested models.
    nested = G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}},
                                             "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}}}}), "s")
    assert accepts(nested, '{"a": {"b": 1}}') and not accepts(nested, '{"a": {"b": 1, "c": 2}}')
    assert not accepts(nested, '{"a": {"b": 1}, "c": 2}')
    # An object that names no keys is any object, as {"type": "object"} has always meant.
    for anything in (G.Grammar(VOCAB, G.json_schema({"type": "object"}), "s"), G.Grammar(VOCAB, G.json_object(), "s")):
        assert accepts(anything, '{"b": 2, "c": [1]}')


def test_a_grammar_that_allows_nothing_the_vocabulary_can_write_says_where():
    # No token spells "q": after "ab" nothing can be written (llguidance says "NoExtensionBias").
    grammar = G.Grammar(VOCAB, G.grammar_text('start: "ab" "q"'), "the grammar")
    for drafter in (NoDraft(), Scripted([22])):
        with pytest.raises(FlylocalError) as e:
            Engine(FakeTarget(LM, n_ctx=64), drafter, Strict(), EngineConfig(k=4, max_tokens=8)) \
                .generate(PROMPT, grammar=grammar).run()
        assert str(e.value) == "the grammar failed after 'ab': it allows nothing this model's vocabulary can write"


def test_a_bad_regex_says_what_is_wrong_with_it():
    with pytest.raises(FlylocalError) as e:
        G.checked(G.json_schema({"type": "string", "pattern": "a("}), "the JSON schema")
    assert str(e.value) == 'the JSON schema cannot be used: invalid regex "a(": unclosed group'
    with pytest.raises(FlylocalError) as e:
        G.checked(G.grammar_text("start: /[z-a]/"), "the grammar")
    assert str(e.value).endswith("invalid character class range, the start must be <= the end")
    assert "\n" not in str(e.value)


def test_a_schema_nested_too_deep_says_so():
    deep_text = '{"type": "object", "properties": {"a": ' * 500 + "{}" + "}}" * 500   # past Python's json reader
    deep = {"type": "integer"}
    for _ in range(300):                                                            # past llguidance's
        deep = {"type": "array", "items": deep}
    for schema in (deep_text, deep):
        with pytest.raises(FlylocalError, match="^the JSON schema is nested too deep: at most 100 levels"):
            G.json_schema(schema)
    shallow = {"type": "integer"}
    for _ in range(99):
        shallow = {"type": "array", "items": shallow}
    G.checked(G.json_schema(shallow), "the JSON schema")


def test_bad_grammars_are_one_line_errors():
    with pytest.raises(FlylocalError, match="not valid JSON"):
        G.json_schema("{nope")
    with pytest.raises(FlylocalError, match="a JSON schema is an object"):
        G.json_schema("[1, 2]")
    with pytest.raises(FlylocalError, match="cannot"):
        G.Grammar(VOCAB, G.grammar_text("start: bar"), "the grammar")
    with pytest.raises(FlylocalError, match="cannot"):
        G.Grammar(VOCAB, G.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "the JSON schema")


@pytest.mark.parametrize("density", [0.0005, 0.01, 0.5, 0.99, 0.9995])
@pytest.mark.parametrize("V", [1000, 49152, 49153])
def test_forbid_clears_exactly_the_forbidden_tokens(density, V):
    rng = np.random.default_rng(V)
    allowed = rng.random(V) < density
    allowed[rng.integers(V)] = True
    padded = np.zeros(-(-V // 32) * 32, dtype=bool)
    padded[:V] = allowed
    words = np.packbits(padded, bitorder="little").view(np.int32)
    row = rng.normal(size=V).astype(np.float32)
    expected = np.where(allowed, row, -np.inf).astype(np.float32)
    G.forbid(row, words)
    assert np.array_equal(row, expected)
