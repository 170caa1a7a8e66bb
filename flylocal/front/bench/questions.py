"""The questions `flylocal bench serve` asks: Spec-Bench's (or a file's), chosen by group, each
conversation's user turns, and a first turn made long: other questions' words before it
(--prompt-words), or other questions' whole texts up to about N tokens (--context)."""

from __future__ import annotations

import math
from collections.abc import Callable

from flylocal.errors import FlylocalError


def conversations(path: str | None, category: str | None, per_category: int | None, skip: int, turns: int,
                  prompt_words: int | None, repeat: int, context: int | None = None,
                  count: Callable[[str], int] | None = None) -> list[tuple[str, list[str]]]:
    """(label, user turns) of the questions asked: Spec-Bench's (the project's copy) or the
    file's, `per_category` of each group after its first `skip` (2 of Spec-Bench's by default,
    every one of a file's), the groups in turn; the first `turns` turns of each; a first turn
    under `prompt_words` words preceded by other questions' words as background, or padded to
    about `context` tokens (`count` counts them) with other questions' whole texts; `repeat`
    times, each repeat of a padded turn after background of its own (no server's cache holds
    it: every request is a fresh prefill of the same length)."""
    from flylocal.front.bench.prompts import data_dir, load_prompts, of_categories, per_group

    source = path or str(data_dir() / "spec_bench")
    everything = prompts = load_prompts(source)
    if category:
        prompts = of_categories(prompts, category, source)
    if per_category is None and path is None:
        per_category = 2
    if per_category is not None or skip:
        seen = {id(p) for p in per_group(prompts, skip)} if skip else set()
        chosen = {id(p) for p in per_group(prompts, skip + (per_category or len(prompts)))} - seen
        prompts = [p for p in prompts if id(p) in chosen]
    if not prompts:
        raise FlylocalError(f"no questions left in {source} after --skip {skip}")
    groups: dict = {}
    for p in prompts:
        groups.setdefault(p.group, []).append(p)
    ordered = [g[i] for i in range(max(map(len, groups.values()))) for g in groups.values() if i < len(g)]
    words = [w for p in ordered for w in p.text.split()]
    documents = sorted({p.text for p in everything}, key=len, reverse=True)     # the longest first: fewer seams
    out = []
    for p in ordered * (repeat if context else 1):
        asked = list(p.turns or [p.text])[:turns]
        short = prompt_words - len(asked[0].split()) if prompt_words else 0
        if context:                 # a step prime to the documents' count: no start twice in a run
            others = [d for d in documents if d != asked[0]]
            step = next(s for s in range(7, 8 + len(others)) if math.gcd(s, len(others)) == 1)
            asked[0] = padded(asked[0], others, (len(out) * step) % len(others), context, count or _words)
        elif short > 0:
            start = (len(out) * 97) % len(words)
            filler = [words[(start + i) % len(words)] for i in range(short)]
            asked[0] = "Background:\n" + " ".join(filler) + "\n\n" + asked[0]
        out.append((f"{p.group or p.category or 'question'} {p.id}", asked))
    return out if context else out * repeat


def _words(text: str) -> int:
    """Tokens of `text` where no tokenizer is at hand: about 1.3 a word."""
    return round(len(text.split()) * 1.3)


def padded(question: str, documents: list[str], start: int, tokens: int, count: Callable[[str], int]) -> str:
    """`question` after other documents, whole and in turn from `documents[start]`, as
    background, until the whole is about `tokens` tokens (`count` counts them); the last one cut
    at a word to fit. Real text, none of it repeated, so prompt lookup finds in it only what
    it would find in a real long prompt."""
    have = count(question) + 8                  # the framing and a chat template's own tokens
    chosen: list[str] = []
    for i in range(len(documents)):
        if have >= tokens:
            break
        doc = documents[(start + i) % len(documents)]
        n = count(doc) + 2
        if have + n > tokens:
            cut = doc.split()
            doc = " ".join(cut[: max(0, len(cut) * (tokens - have) // n - 1)])
            n = count(doc) + 2 if doc else 0
        if doc:
            chosen.append(doc)
            have += n
    if not chosen:
        return question
    return "Background:\n\n" + "\n\n".join(chosen) + "\n\n" + question


def token_counter(path: str) -> Callable[[str], int]:
    """How many tokens the model at `path` makes of a text (its vocabulary alone is loaded)."""
    from flylocal.llama.model import Model
    from flylocal.llama.runtime import RuntimeConfig
    from flylocal.llama.vocab import Vocabulary

    vocab = Vocabulary(Model(path, RuntimeConfig(n_ctx=256, n_threads=1), vocab_only=True))
    return lambda text: len(vocab.tokenize(text, add_special=False))
