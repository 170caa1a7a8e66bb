"""`flylocal chat`: a conversation on a terminal, or line by line from a pipe, over one Session
(flylocal.session); answers stream with each token coloured by how it came."""

from __future__ import annotations

import dataclasses
import os
import sys

import click

from flylocal.decoding.costs import WAIT
from flylocal.decoding.drafters import DRAFTERS
from flylocal.decoding.verifiers import VERIFIERS
from flylocal.errors import FlylocalError
from flylocal.front.terminal import (check_text, compile_constraint, constrained_output, note, read_constraint)
from flylocal.settings import GENERATION, options, settings_from


COLORS = {"accepted": "\033[32m", "loose": "\033[33m", "target": ""}
RESET = "\033[0m"
CHAT_HELP = f"""commands:
  /reset              start a new conversation (and empty the ASD budget ledger); a model
                      whose rpc servers were lost reconnects
  /verifier NAME      switch verifier: {', '.join(VERIFIERS)}
  /drafter NAME       switch drafter: {', '.join(DRAFTERS)} (model and mla need --draft)
  /system             show the system prompt
  /system TEXT        set it (starts a new conversation); /system --clear removes it
  /save NAME          keep this conversation (and what the model computed of it) as NAME;
                      `flylocal chat --resume NAME` continues it without evaluating it again
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


@click.command()
@options(*GENERATION)
@click.option("--system", "system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--resume", "resume", default=None, metavar="NAME",
              help="Continue the conversation saved with /save NAME (its system prompt and turns; what the models "
                   "computed of it is restored when they, the build and --ctx are the same).")
@click.option("--color/--no-color", "color", default=None,
              help="Colour tokens by how they were accepted. Default: on a terminal, unless NO_COLOR is set.")
@constrained_output
def chat(system, resume, color, json_schema_file, json_object, grammar_file, **opts):
    """Chat with the target model; speculative decoding makes the answers come faster.

    Reads messages line by line (with line editing and history on a terminal). Ctrl-C stops
    an answer; Ctrl-C or Ctrl-D at the prompt leaves. Type /help for commands.
    """
    from flylocal.loader import check, load
    from flylocal.session import Session, TextStream, conversation_path

    if sys.stdin is None:
        raise FlylocalError("stdin is closed: chat reads its messages from stdin")
    if system is not None:
        check_text(system, "--system")
    if resume is not None:
        if system is not None:
            raise FlylocalError("--resume continues a conversation with its own system prompt: give --system or "
                                "--resume, not both")
        if not conversation_path(resume).exists():
            raise FlylocalError(f"no conversation was saved as {resume!r} (in {conversation_path(resume).parent})")
    if "-" in (json_schema_file, grammar_file):
        raise FlylocalError("chat reads its messages from stdin: give the grammar as a file")
    constraint = read_constraint(json_schema_file, json_object, grammar_file)
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401 - line editing and history for input()
    colored = use_color(color)
    # Each turn waits for a slice of a calibration at most; the rest follows before the next ones.
    settings = dataclasses.replace(settings_from(opts), calibration_wait=WAIT)
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
        if resume is not None:
            note(session.resume(resume))
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
            try:
                turn = session.send(line)
            except KeyboardInterrupt:        # while the conversation was being tokenized
                click.echo("", err=True)
                continue
            except FlylocalError as e:
                note(f"error: {e}")
                continue
            show(turn, TextStream(models.target), out, colored)
            click.echo(turn_line(turn.stats, session.settings.verifier), err=True)
    finally:
        models.close()


def show(turn, stream, out, colored: bool) -> None:
    """Stream a turn's answer to `out` as it is committed, each token coloured by how it came;
    Ctrl-C stops it and keeps what was shown, an error is one line."""
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
        elif name == "/save":
            if not arg:
                note("usage: /save NAME")
            else:
                path = session.save(arg)
                note(f"saved as {arg!r} ({path}); flylocal chat --resume {arg} continues it")
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
