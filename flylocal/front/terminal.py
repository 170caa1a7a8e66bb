"""What the commands write and read on a terminal: one-line notes and errors on stderr, listings
on stdout, text from argv, stdin and files checked as UTF-8, and the options that put an
output under a grammar (docs/design.md, "Grammars")."""

from __future__ import annotations

import sys

import click

from flylocal.errors import FlylocalError
from flylocal.files import decode_text, read_text


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


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise FlylocalError("give either PROMPT or --prompt-file, not both")
    if prompt_file is not None:
        return read_input(prompt_file, "prompt" if prompt_file == "-" else "prompt file")[0]
    if prompt is None:
        raise FlylocalError("no prompt: give PROMPT or --prompt-file FILE (- for stdin)")
    return check_text(prompt, "the prompt")


json_schema_option = click.option("--json-schema", "json_schema_file", metavar="FILE|-", default=None,
                                  help="Constrain the output to JSON valid under the JSON schema in FILE (- for stdin).")


def constrained_output(f):
    """The options that put a command's output under a grammar (docs/design.md, "Grammars")."""
    f = click.option("--grammar", "grammar_file", metavar="FILE", default=None,
                     help="Constrain the output to a grammar: Lark (llguidance's syntax) or llama.cpp's GBNF.")(f)
    f = click.option("--json-object", is_flag=True, help="Constrain the output to one JSON object.")(f)
    return json_schema_option(f)


def read_constraint(json_schema_file: str | None, json_object: bool, grammar_file: str | None):
    """(what it is, its llguidance grammar) for the options given, or None; read and compiled
    before any model is loaded, so a bad file costs nothing."""
    from flylocal.decoding import grammar as G

    given = [name for name, value in (("--json-schema", json_schema_file), ("--json-object", json_object),
                                      ("--grammar", grammar_file)) if value]
    if len(given) > 1:
        raise FlylocalError(f"give one of {', '.join(given)}, not several")
    if json_object:
        return G.json_output()
    path = json_schema_file or grammar_file
    if path is None:
        return None
    text, source = read_input(path, "JSON schema" if json_schema_file else "grammar")
    if json_schema_file:
        return G.json_output(text, source)
    return source, G.checked(G.grammar_text(text, source), source)


def read_input(path: str, what: str) -> tuple[str, str]:
    """(the text of file `path`, or of stdin for "-"; how to name it in a message)."""
    if path == "-":
        source = f"the {what} on stdin"
        return decode_text(read_stdin(f"the {what}"), source), source
    source = f"the {what} {path}"
    return read_text(path, source), source


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


def say(line: str) -> None:
    """A line on stderr that cannot fail: stderr may itself be closed."""
    try:
        click.echo(line, err=True)
    except (OSError, ValueError):
        pass
