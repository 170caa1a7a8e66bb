"""Options are declared once (flylocal.settings): every command shows a shared option the same
way, and what click parses becomes Settings with the library's own defaults."""

import dataclasses

import click
import pytest

from flylocal.decoding.verifiers import VerifierConfig
from flylocal.decoding.verifiers.asd import AsdParams
from flylocal.decoding.verifiers.fly import FlyParams
from flylocal.front.cli import cli
from flylocal.llama import kernels
from flylocal.settings import OPTIONS, Settings, settings_from

COMMANDS = {name: cmd for name, cmd in cli.commands.items() if not isinstance(cmd, click.Group)}
COMMANDS |= {"bench": cli.commands["bench"], "bench serve": cli.commands["bench"].commands["serve"]}


def help_records() -> dict[str, dict[str, tuple]]:
    """option flag -> {command: the (flags, help) line its --help prints}"""
    seen: dict = {}
    for name, cmd in COMMANDS.items():
        ctx = click.Context(cmd, info_name=name)
        for p in cmd.params:
            record = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if record is not None:
                seen.setdefault(p.opts[0], {})[name] = record
    return seen


def test_a_shared_option_reads_the_same_in_every_commands_help():
    # --host and --port are each server's own address (serve and rpc-server), with its own default;
    # --json each command's own document (generate's answer, bench's results, bench serve's waves);
    # --repeat what each runs again (bench: every method on every prompt; bench serve: a question);
    # --api-key the key a server requires (serve) or a client sends (bench serve); --model a model
    # the command works on (serve serves it, doctor measures it).
    shared = {flag: per for flag, per in help_records().items()
              if len(per) > 1 and flag not in ("--host", "--port", "--json", "--repeat", "--api-key", "--model")}
    assert {"--max-tokens", "--ctx", "--k", "--threads", "--exact", "--temperature", "--target"} <= set(shared)
    assert {"--prompts", "--category", "--per-category", "--max-tokens", "--target", "--ctx", "--raw"} <= {
        flag for flag, per in shared.items() if "bench serve" in per}
    for flag, per in shared.items():
        assert len(set(per.values())) == 1, f"{flag} differs between commands: {per}"
    assert "[default: 256" in shared["--max-tokens"]["bench"][1]
    assert "[default: 4096" in shared["--ctx"]["bench"][1]


def test_every_declared_option_is_taken_by_a_command():
    taken = {p.name for cmd in COMMANDS.values() for p in cmd.params}
    assert set(OPTIONS) <= taken


@pytest.mark.parametrize("command,args", [("generate", ["hi"]), ("chat", []), ("bench", ["--out", "o"])])
def test_no_options_give_the_librarys_defaults(command, args):
    ctx = COMMANDS[command].make_context(command, list(args))
    want = dataclasses.replace(Settings(), exact=kernels.mode() == kernels.EXACT)
    if command == "bench":    # bench's methods set these
        want = dataclasses.replace(want, drafter=None, verifier=Settings.verifier)
    assert settings_from(ctx.params) == want


@pytest.mark.parametrize("given,want", [([], None), (["--threads", "auto"], None), (["--threads", "1"], 1),
                                        (["--threads", "0"], 0)])
def test_threads_are_auto_unless_given(given, want):
    ctx = COMMANDS["generate"].make_context("generate", ["hi", *given])
    assert settings_from(ctx.params).threads == want


def test_options_reach_their_fields():
    cmd = COMMANDS["generate"]
    ctx = cmd.make_context("generate", ["hi", "--k", "5", "--fly-window", "3", "--fly-no-window", "--asd-budget",
                                        "inf", "--temperature", "0.7", "--seed", "9", "--gpu-layers", "-1"])
    s = settings_from(ctx.params)
    assert s.k == 5 and s.gpu_layers == -1
    assert s.verifiers == VerifierConfig(fly=FlyParams(window=3, use_window=False), asd=AsdParams(budget=float("inf")))
    assert (s.sampling.temperature, s.sampling.seed, s.sampling.top_k) == (0.7, 9, 40)


def test_fly_within_round_and_the_draft_length_it_asks_for():
    cmd = COMMANDS["generate"]
    across = settings_from(cmd.make_context("generate", ["hi"]).params)
    within = settings_from(cmd.make_context("generate", ["hi", "--fly-within-round"]).params)
    assert across.verifiers.fly.across and not within.verifiers.fly.across
    assert (across.draft_length, within.draft_length) == (8, 10)     # within rounds: W + 4 fits a window
    assert settings_from(cmd.make_context("generate", ["hi", "--verifier", "strict", "--fly-within-round"]).params
                         ).draft_length == 8
    reference = settings_from(cmd.make_context("generate", ["hi", "--fly-within-round", "--fly-any-token"]).params)
    assert across.verifiers.fly.candidates and not reference.verifiers.fly.candidates
    assert not reference.verifiers.fly.across


def test_fly_echo_sets_the_n_gram_of_the_echo_rule():
    cmd = COMMANDS["generate"]
    assert settings_from(cmd.make_context("generate", ["hi"]).params).verifiers.fly.echo == 4
    assert settings_from(cmd.make_context("generate", ["hi", "--fly-echo", "0"]).params).verifiers.fly.echo == 0
    assert settings_from(cmd.make_context("generate", ["hi", "--fly-echo", "6"]).params).verifiers.fly.echo == 6
