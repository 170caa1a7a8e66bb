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
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flylocal.errors import FlylocalError
from flylocal.front.bench.methods import METHODS, parse_methods
from flylocal.front.bench.prompts import (Prompt, encode_all, humaneval_prompts, load_prompts, of_categories, passes,
                                          per_group, standin_prompts, stop_code, valid_json)
from flylocal.front.bench.tasks import TASKS, answer, cut, parse_tasks, task_prompts
from flylocal.front.bench.report import COUNTS, Row, machine_info, metrics, per_prompt, write_results
from flylocal.front.bench.sandbox import Sandbox
from flylocal.settings import PRESETS

if TYPE_CHECKING:
    from flylocal.loader import Models
    from flylocal.settings import Settings

Progress = Callable[[int, int, str], None]     # (step, total, what): told before each step runs


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


def one_line(e: BaseException) -> str:
    """An exception as one short line for results.json and report.md."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not isinstance(e, FlylocalError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class _Turns:
    """One method's turns on one prompt, and what the run keeps of them; the state the methods
    share: settings, models, baselines, the grammar."""

    def __init__(self, settings: Settings, models: Models, baselines: dict, grammar, warn: Callable[[str], None]):
        self.settings, self.models, self.baselines, self.grammar, self.warn = settings, models, baselines, grammar, warn
        self.target, self.draft = models.target, models.draft

    def reset(self) -> None:
        self.target.reset()
        if self.draft is not None:
            self.draft.reset()

    def fail(self, row: Row, p: Prompt, r: int, e: Exception) -> None:
        message = one_line(e)
        row.failures.append({"prompt": p.id, "repeat": r, "error": message})
        row.outputs.pop(p.id, None)
        row.per_prompt.pop(p.id, None)
        self.warn(f"{row.method} failed on {p.id}: {message}")
        self.reset()                  # a failed decode leaves no half-known cache behind

    def one(self, m: str, p: Prompt, ids, fresh: bool):
        """(token ids, text, {COUNTS but wall_s}, ASD regret spent or None, output positions
        accepted loosely) of method m on prompt ids. A task's question generates until its
        answer is complete (flylocal.front.bench.tasks.cut), at its own max_tokens and seed."""
        from flylocal.decoding.engine import LOOSE

        method, s, target = METHODS[m], self.settings, self.target
        if p.max_tokens is not None:
            s = dataclasses.replace(s, max_tokens=p.max_tokens)
        if p.seed is not None:
            s = dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, seed=p.seed))
        if method.baseline:
            text, n, _, decode_s = self.baselines[m].generate(ids, s.max_tokens, s.sampling, reuse=not fresh)
            tokens = list(target.tokenize(text, add_special=False, parse_special=False)) if text else []
            return tokens, text, dict(tokens=n, emitted_in_rounds=n, decode_tokens=max(n - 1, 0), decode_s=decode_s, rounds=0, loose=0, verify_s=0.0,
                                      drafted=0, accepted=0, forced=0, mask_s=0.0, draft_s=0.0, target_s=0.0, prefill_s=0.0,
                                      generations=1), None, []
        s = dataclasses.replace(s, verifier=method.verifier, drafter=method.drafter)
        if method.within_round:
            fly = dataclasses.replace(s.verifiers.fly, across=False, candidates=False)
            s = dataclasses.replace(s, verifiers=dataclasses.replace(s.verifiers, fly=fly))
        if fresh:
            self.reset()
        # Each run searches the --lookup-corpus file alone, never what other runs generated.
        gen = self.models.engine(s, private=True).generate(ids, grammar=self.grammar)
        tokens, loose, ends = gen.tokens, [], bool(p.stops) or (p.task == "humaneval" and p.raw)
        try:
            for event in gen:
                loose += [len(tokens) - len(event.tokens) + j for j, kind in enumerate(event.kinds) if kind == LOOSE]
                if ends and cut(p, target.detokenize(tokens)) is not None:
                    break
        finally:
            gen.close()
        stats, text = gen.stats, target.detokenize(tokens)
        if ends and (done := cut(p, text)) is not None:      # the tokens the answer needed, no more
            keep = next(n for n in range(len(tokens) + 1) if len(target.detokenize(tokens[:n])) >= len(done))
            tokens, text, loose = tokens[:keep], done, [j for j in loose if j < keep]
        counts = dict(tokens=stats.emitted, emitted_in_rounds=stats.emitted_in_rounds, decode_tokens=stats.decode_tokens, decode_s=stats.decode_s, rounds=stats.rounds, loose=stats.loose,
                      verify_s=stats.verify_s, drafted=stats.drafted, accepted=stats.accepted, forced=stats.forced,
                      mask_s=stats.mask_s, draft_s=stats.draft_s, target_s=stats.target_s, prefill_s=stats.prefill_s,
                      generations=1)
        return list(tokens), text, counts, stats.budget_spent, loose

    def all(self, m: str, p: Prompt, first_ids) -> tuple[list, dict, float | None, list]:
        """Every turn of prompt p with method m: ([(token ids, text)] a turn, summed counts,
        ASD regret spent or None, the first turn's loose positions). A later turn follows the
        method's own answers."""
        target = self.target
        messages: list[dict] = []
        outputs, sums, spent, loose = [], dict.fromkeys(COUNTS, 0), None, []
        for i, turn in enumerate(p.turns or [p.text]):
            if i == 0:
                ids = first_ids
            else:
                ids = target.tokenize_chat(messages + [{"role": "user", "content": turn}])
                if ids is None:
                    raise FlylocalError(f"{target.name} has no chat template for a second turn")
                if len(ids) >= target.n_ctx:
                    raise FlylocalError(f"turn {i + 1} is {len(ids)} tokens, longer than --ctx {target.n_ctx}")
            t0 = time.perf_counter()
            tokens, text, counts, budget, where = self.one(m, p, ids, fresh=i == 0)
            counts["wall_s"] = time.perf_counter() - t0
            loose = where if i == 0 else loose
            for key, v in counts.items():
                sums[key] += v
            if budget is not None:
                spent = (spent or 0.0) + budget
            outputs.append((list(tokens), text))
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
        return outputs, sums, spent, loose

    def judge(self, row: Row, p: Prompt, ids, execute: Sandbox | None, schema: dict | None) -> None:
        """The quality figures of row's answer to p: the target's NLL, the task's score and the
        loose tokens in it, HumanEval's tests, validity under the schema."""
        from flylocal.decoding.quality import target_nll

        tokens, text = row.outputs[p.id]
        target = self.target
        row.nll[p.id] = target_nll(target, ids, tokens)
        if p.task is not None:
            task = TASKS[p.task]
            said = answer(p, text)
            row.scores[p.id] = task.score(p, said, execute) if task.executes else task.score(p, said)
            row.loose[p.id] = [{"at": j, "token": target.detokenize(tokens[j:j + 1]),
                                "before": target.detokenize(tokens[max(0, j - 8):j])}
                               for j in row.loose.get(p.id, []) if j < len(tokens)]
        elif execute and p.test is not None:
            row.passed[p.id] = passes(p, stop_code(text), execute)
        if schema is not None:
            row.valid[p.id] = valid_json(text, schema)


def run(settings: Settings, models: Models, baselines: dict, prompts: list[Prompt], methods: list[str],
        repeat: int, progress: Progress | None = None, raw: bool = False, *, encoded: dict | None = None,
        execute: Sandbox | None = None, warn: Callable[[str], None] = lambda s: None,
        schema: dict | None = None) -> dict[str, Row]:
    """Run every method on every prompt, `repeat` times, interleaved. `settings` carries the
    engine settings shared by all methods; each method sets its verifier and drafter.
    `encoded` is encode_all's result (computed here if not given). A method that raises on a
    prompt gets a failure recorded for it and is not run on that prompt again. With `execute`,
    HumanEval completions are run against their tests (in flylocal.front.bench.sandbox). With a JSON
    `schema`, every answer is generated under it, and checked against it. `progress(step,
    total, what)` is told of each step before it runs."""
    rows = {m: Row(m) for m in methods}
    grammar = None
    if schema is not None:
        from flylocal.decoding import grammar as G

        grammar = G.Grammar(models.target, G.json_output(schema)[1], "the JSON schema")
    if encoded is None:
        encoded = encode_all(models.target, prompts, raw)
    turns = _Turns(settings, models, baselines, grammar, warn)
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
                try:
                    outputs, sums, spent, loose = turns.all(m, p, encoded[p.id])
                except Exception as e:  # noqa: BLE001 - any failure is recorded, and the run goes on
                    turns.fail(row, p, r + 1, e)
                    continue
                mine = row.per_prompt.setdefault(p.id, dict.fromkeys(COUNTS, 0))
                for key, v in sums.items():
                    mine[key] += v
                if r == repeat - 1:
                    row.outputs[p.id], row.later[p.id], row.loose[p.id] = outputs[0], [t for t, _ in outputs[1:]], loose
                    if spent is not None:
                        row.spent[p.id] = spent
    for p in prompts:                 # prompt-major: the target's cache keeps the prompt between methods
        for row in rows.values():
            if p.id in row.outputs:
                try:
                    turns.judge(row, p, encoded[p.id], execute, schema)
                except Exception as e:  # noqa: BLE001
                    row.nll.pop(p.id, None)
                    turns.fail(row, p, repeat, e)
    return rows


def _prompts(prompts_path, humaneval, humaneval_limit, category, per_category, execute, preset) -> tuple[list[Prompt], str]:
    """The prompts of a run without --tasks, and how to name where they came from."""
    if execute and not humaneval:
        raise FlylocalError("--execute runs model-written code: it goes with --humaneval or --tasks")
    if preset is not None:            # its own prompts: Spec-Bench's (--prompts, or the project's) as questions
        if humaneval:
            raise FlylocalError(f"--preset {preset} has prompts of its own; it takes no --humaneval")
        prompts = standin_prompts(per_category or 2, prompts_path, base_model=PRESETS[preset].base_model)
        source = f"the {preset} preset ({prompts_path or 'data/spec_bench'} as questions, and copy-heavy edits)"
    else:
        if (prompts_path is None) == (not humaneval):
            raise FlylocalError("give --prompts FILE_OR_DIR, --humaneval or --tasks (one of them)")
        prompts = humaneval_prompts(humaneval_limit) if humaneval else load_prompts(prompts_path)
        source = "HumanEval" if humaneval else prompts_path
    if category is not None:
        prompts = of_categories(prompts, category, source)
    if per_category is not None and preset is None:
        prompts = per_group(prompts, per_category)
    return prompts, source


def _task_prompts(settings: Settings, spec: str, per_task: int | None, seeds: int | None, execute: Sandbox | None,
                  own_max_tokens: bool, base: bool, others: dict, say: Callable[[str], None]) -> tuple[list[Prompt], str]:
    """The questions of --tasks (a base model's question form with `base`), each at its task's
    max_tokens where `own_max_tokens`, once per seed with --seeds; and how to name them."""
    given = [f"--{k.replace('_', '-').replace('-path', '')}" for k, v in others.items() if v]
    if given:
        raise FlylocalError(f"--tasks has questions of its own; it takes no {given[0]}")
    chosen = parse_tasks(spec, execute, say)
    seed_list = None
    if seeds is not None:
        if settings.sampling.temperature <= 0:
            raise FlylocalError("--seeds runs each question under several seeds: it needs --temperature above 0")
        first = settings.sampling.seed if settings.sampling.seed is not None else 0
        seed_list = list(range(first, first + seeds))
    elif settings.sampling.temperature > 0 and settings.sampling.seed is None:
        raise FlylocalError("--tasks at --temperature above 0 needs --seed (or --seeds N), so that every method "
                            "samples with the same randomness")
    prompts = task_prompts(chosen, per_task, base, seed_list)
    if own_max_tokens:
        prompts = [dataclasses.replace(p, max_tokens=TASKS[p.task].max_tokens) for p in prompts]
    form = "a base model's question form" if base else "as asked"
    return prompts, f"tasks {', '.join(t.name for t in chosen)} ({form})"


def _without_baselines(chosen: list[str], why: str, because: str, say: Callable[[str], None]) -> list[str]:
    """The methods but llama-cpp-python's own generation, which `why` leaves out, said once."""
    local = [m for m in chosen if METHODS[m].baseline]
    if local:
        say(f"{why}: skipping {', '.join(local)} ({because})")
    chosen = [m for m in chosen if m not in local]
    if not chosen:
        raise FlylocalError("no methods left to run")
    return chosen


def _check_schema(chosen: list[str], schema: tuple[str, str] | None, say: Callable[[str], None]):
    """(methods, the schema as a dict, how to name it) for --json-schema's (text, name), checked
    by the grammar engine and by jsonschema; (methods, None, None) without one."""
    if schema is None:
        return chosen, None, None
    import jsonschema

    from flylocal.decoding import grammar as G

    text, source = schema
    G.json_output(text, source)
    parsed = json.loads(text)
    try:                              # the answers are checked against it with jsonschema too
        jsonschema.validators.validator_for(parsed).check_schema(parsed)
    except jsonschema.SchemaError as e:
        raise FlylocalError(f"{source} is not valid: {e.message}") from None
    return _without_baselines(chosen, "--json-schema", "flylocal's grammar engine runs the schema", say), parsed, source


def main(settings: Settings, *, prompts_path: str | None, humaneval: bool, humaneval_limit: int | None,
         category: str | None, per_category: int | None, execute: Sandbox | None, out_dir: str, methods: str | None,
         repeat: int, raw: bool,
         schema: tuple[str, str] | None = None,
         note: Callable[[str], None], progress: Progress | None = None,
         warn: Callable[[str], None] = lambda s: None, preset: str | None = None, tasks: str | None = None,
         per_task: int | None = None, seeds: int | None = None, task_max_tokens: bool = True) -> str:
    """`flylocal bench`: check everything that can be checked before a model loads, load the
    models through the loader like every command, run, and write the results. Returns the
    report's text and the results (results.json's content)."""
    from flylocal.host import CpuLoad
    from flylocal.loader import load, runtime_config

    notes = []                        # said once every check has passed, so that an error stays one line
    if tasks is not None:
        prompts, source = _task_prompts(settings, tasks, per_task, seeds, execute, task_max_tokens,
                                        base=raw or (preset is not None and PRESETS[preset].base_model), others=dict(
                                            prompts_path=prompts_path, humaneval=humaneval, category=category,
                                            per_category=per_category), say=notes.append)
    else:
        if seeds is not None or per_task is not None:
            raise FlylocalError(f"{'--seeds' if seeds is not None else '--per-task'} goes with --tasks")
        prompts, source = _prompts(prompts_path, humaneval, humaneval_limit, category, per_category, execute, preset)
    chosen = parse_methods(methods, settings.draft is not None, notes.append)
    chosen, schema, schema_source = _check_schema(chosen, schema, notes.append)
    if settings.target_rpc:
        chosen = _without_baselines(chosen, "--target-rpc", "llama-cpp-python's own generation runs the target here",
                                    notes.append)
    out = prepare_out(out_dir)
    if humaneval and not execute:
        notes.append("HumanEval completions will not be run (no pass@1); --execute runs them, see --help")
    models = load(settings, log=note)
    from flylocal.front.bench.baseline import LlamaCppPythonBaseline     # loaded by now
    from flylocal.llama.devices import build_info

    baselines = {}
    try:
        encoded = encode_all(models.target, prompts, raw)
        for message in notes:
            note(message)
        for m in chosen:
            if METHODS[m].baseline:
                baselines[m] = LlamaCppPythonBaseline(models.target.path,
                                                      runtime_config(settings, gpu_layers=models.target.config.n_gpu_layers),
                                                      prompt_lookup=METHODS[m].prompt_lookup)
        meter = CpuLoad()             # how busy other processes kept the cores: the report warns
        meter.start()
        rows = run(settings, models, baselines, prompts, chosen, repeat, progress, raw=raw, encoded=encoded,
                   execute=execute, warn=warn, schema=schema)
        busy = meter.stop()
        results = {
            "methods": metrics(rows, prompts),
            "prompts": per_prompt(rows, prompts),
            "machine": {**machine_info(build_info()), "busy_cores": None if busy is None else round(busy, 3)},
            "config": {"target": settings.target, "draft": settings.draft,
                       "source": source, "preset": preset, "prompts": len(prompts),
                       "category": category, "per_category": per_category, "max_tokens": settings.max_tokens, "repeat": repeat,
                       "k": settings.k, "ctx": settings.ctx, "exact": settings.exact, "threads": settings.threads,
                       "target_rpc": list(settings.target_rpc), "draft_rpc": list(settings.draft_rpc),
                       "methods": chosen, "executed": bool(execute) if humaneval or tasks else None,
                       "sandbox": execute.name if execute else None, "json_schema": schema_source,
                       "tasks": sorted({p.task for p in prompts if p.task}, key=list(TASKS).index) or None,
                       "per_task": per_task, "seeds": sorted({p.seed for p in prompts if p.seed is not None}) or None,
                       "temperature": settings.sampling.temperature},
        }
        if tasks is not None:
            from flylocal.front.bench.scores import task_results

            results["tasks"] = task_results(rows, prompts)
        report, png = write_results(out, results)
        if png is None:
            note("matplotlib is not installed: no plot (pip install 'flylocal[plot]')")
        return report, results
    finally:
        for x in baselines.values():
            x.close()
        models.close()
