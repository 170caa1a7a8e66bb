"""What a run is asked to do, and every command-line option, declared once (docs/design.md,
"Options").

`Settings` holds a run's choices with their defaults (and the verifier and sampling parameters,
whose defaults live in FlyParams, AsdParams and SamplingParams). `OPTIONS` declares each
command-line option once: its flags, type and range, help, and the field its value goes to;
its default is read from that field. Commands take options by name (`options(...)`), so
generate, chat, bench, doctor and serve cannot disagree on a type, a range or a default, and
`settings_from` turns what click parsed into Settings in one place.

This module imports nothing heavy: the command line imports it before llama.cpp is chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import click

from flylocal.decoding.drafters import DRAFTERS
from flylocal.decoding.sampling import SamplingParams
from flylocal.decoding.verifiers import VERIFIERS, VerifierConfig
from flylocal.decoding.verifiers.asd import AsdParams
from flylocal.decoding.verifiers.fly import FlyParams
from flylocal.host import usable_cores

DEFAULT_TARGET = "smollm2-135m-instruct"
# A target whose decode is bound by memory bandwidth, as a desktop-class model's is (8 rows cost
# about 1.6 single steps, where the default target's cost 4.7), and a same-vocabulary draft for
# it: where drafts pay, measured here (docs/benchmarks.md). Not a model to chat with.
STANDIN_TARGET = "gemma-3-270m-f32"
STANDIN_DRAFT = "gemma-3-270m-q2_k"
# The same regime with a chat model (SmolLM2-135M-Instruct at F32: 2, 5, 9 and 17 rows cost 1.4,
# 2.1, 2.7 and 3.9 single steps), whose answers prompt lookup cannot copy from a base model's loops.
STANDIN_INSTRUCT_TARGET = "smollm2-135m-instruct-f32"
STANDIN_INSTRUCT_DRAFT = "smollm2-135m-instruct-q4_0"


@dataclass(frozen=True)
class Preset:
    """`flylocal bench --preset NAME`: a stand-in target, its draft, and whether questions are put
    in a base model's "Question: ...\nAnswer:" form (else through the chat template)."""
    target: str
    draft: str
    base_model: bool


PRESETS = {"standin": Preset(STANDIN_TARGET, STANDIN_DRAFT, True),
           "standin-instruct": Preset(STANDIN_INSTRUCT_TARGET, STANDIN_INSTRUCT_DRAFT, False)}
DEFAULT_K = 8
CACHE_TYPE_NAMES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "bf16", "f32")   # flylocal.llama.memory.CELL_BYTES
DEFAULT_DRAFT_WINDOW = 1024   # docs/benchmarks.md, "Long contexts": acceptance against the whole context
DEFAULT_P_MIN = 0.5     # a draft model's token it gives less than this ends its draft (adaptive runs)


@dataclass(frozen=True)
class Settings:
    target: str = DEFAULT_TARGET
    draft: str | None = None
    draft_vocab: str = "auto"         # same | translate | auto: a draft of another vocabulary drafts through text
    target_rpc: tuple[str, ...] = ()  # rpc servers ("HOST:PORT") holding the target's layers (docs/scale-out.md)
    draft_rpc: tuple[str, ...] = ()   # ... and the draft's
    tensor_split: tuple[float, ...] = ()   # the target's split across its servers' devices (empty: by free memory)
    rpc_timeout: float = 60.0         # seconds one decode (per --batch-size tokens) may wait for rpc servers
    rpc_output: str = "here"          # here: a placed model's output layer runs here, and hidden states cross
    drafter: str | None = None        # None: mla with a draft, pld without
    verifier: str = "fly"
    k: int | None = None              # None: adaptive up to DEFAULT_K for drafters that adapt
    max_tokens: int = 256
    ctx: int = 4096
    threads: int | None = None        # None: auto (follow the free cores); 0: every core; N: N threads
    batch_size: int = 512
    flash_attn: str = "auto"
    cache_type_k: str = "f16"         # the KV cache's cell types (llama.cpp's names)
    cache_type_v: str = "f16"
    gpu_layers: int | None = None     # None: auto (what fits, flylocal.llama.placement); -1: all; 0: none
    pld_ngram: int = 4
    pld_tokens: int | None = None
    draft_window: int = DEFAULT_DRAFT_WINDOW   # a draft model keeps the sinks and this many last tokens; 0: all
    draft_p_min: float | None = None  # None: 0.5 when the draft length adapts, 0 with an explicit --k
    recalibrate: bool = False         # measure the cost curves again instead of reading the cache
    calibration_wait: float | None = None   # seconds of the target curve's calibration a request waits
                                            # for; the rest in slices before the next (serve, chat: WAIT)
    exact: bool = False               # the batch-invariant build (flylocal.llama.kernels)
    lookup_corpus: str | None = None  # a text file prompt lookup also searches
    verifiers: VerifierConfig = field(default_factory=VerifierConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace: bool = False               # attach trace rows (docs/design.md) to round events
    logprobs: int | None = None       # give output tokens their log-probabilities (and this many alternatives)
    parallel: int = 1                 # sequences decoded together (serve --parallel); 0: as many as memory holds, up to 4
    kv_unified: bool = False          # the sequences share one unified cache (serve --kv-unified)

    @property
    def drafter_name(self) -> str:
        return self.drafter or ("mla" if self.draft else "pld")

    @property
    def window(self) -> int:
        """The FLy window that drafts must fit (within rounds), or 0 when no verifier needs one."""
        fly = self.verifiers.fly
        return fly.window if self.verifier == "fly" and fly.use_window and not fly.across else 0

    @property
    def draft_length(self) -> int:
        """--k, or the default: 8, or with FLy's window within rounds at least W+4, so that a
        mismatch in the first four draft positions can still be accepted loosely (it needs
        j + W < k)."""
        if self.k is not None:
            return self.k
        return max(DEFAULT_K, self.window + 4) if self.window else DEFAULT_K

    @property
    def round_rows(self) -> int:
        """The rows a slot's share of a decode must hold: a draft verified whole (k + 1), and
        FLy's window across rounds (W + 1), held to a round as a draft is (flylocal.loader.check)."""
        fly = self.verifiers.fly
        across = fly.window if self.verifier == "fly" and fly.use_window and fly.across else 0
        return max(self.draft_length, across) + 1

    @property
    def draft_p_min_value(self) -> float:
        if self.draft_p_min is not None:
            return self.draft_p_min
        return DEFAULT_P_MIN if self.k is None else 0.0


# ----- option types -----

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


class Slots(click.ParamType):
    """`auto` (0: as many as memory holds, up to 4) or a number of requests generated at once."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto" or value == 0:
            return 0
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither auto nor a number of requests.", param, ctx)
        if not 1 <= n <= MAX_SLOTS:
            self.fail(f"{n} is not between 1 and {MAX_SLOTS}.", param, ctx)
        return n


MAX_SLOTS = 64


class Mebibytes(click.ParamType):
    """`auto` (None) or a size in MiB (0: none)."""

    name = "auto|MIB"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither auto nor a size in MiB.", param, ctx)
        if n < 0:
            self.fail(f"{n} is below 0.", param, ctx)
        return n


class Threads(click.ParamType):
    """`auto` (None) or a thread count (0: every core)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        if isinstance(value, int):
            n = value
        else:
            try:
                n = int(value)
            except ValueError:
                self.fail(f"{value!r} is neither auto nor a number of threads.", param, ctx)
        if n < 0:
            self.fail(f"{n} is not a number of threads (auto, 0 for all cores, or N >= 1).", param, ctx)
        return n


class GpuLayers(click.ParamType):
    """`auto` (None) or a layer count (-1: all)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        try:
            n = value if isinstance(value, int) else int(value)
        except ValueError:
            self.fail(f"{value!r} is neither auto nor a number of layers.", param, ctx)
        if n < -1:
            self.fail(f"{n} is not a number of layers (auto, -1 for all, 0 for none, or N >= 1).", param, ctx)
        return n


class Endpoints(click.ParamType):
    """`HOST:PORT[,HOST:PORT...]`: llama.cpp rpc servers."""

    name = "HOST:PORT[,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from flylocal.errors import FlylocalError
        from flylocal.llama.rpc import parse_endpoints

        try:
            return parse_endpoints(value)
        except FlylocalError as e:
            self.fail(str(e), param, ctx)


class Proportions(click.ParamType):
    """`P[,P...]`: non-negative proportions, not all zero."""

    name = "P[,P...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            parts = tuple(float(p) for p in value.split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers, such as 3,1.", param, ctx)
        if any(not math.isfinite(p) or p < 0 for p in parts) or not any(parts):
            self.fail(f"{value!r}: proportions are finite numbers >= 0, not all 0.", param, ctx)
        if len(parts) > 16:
            self.fail(f"{value!r}: at most 16 proportions (llama.cpp's limit on devices).", param, ctx)
        return parts


def _check_threads(ctx, param, value):
    """More threads than usable cores only makes threads wait."""
    if value is not None and value > usable_cores():
        raise click.BadParameter(f"{value} is more than the {usable_cores()} CPU cores this process can use "
                                 "(auto, or 0 for all of them).", ctx, param)
    return value


def _choose_build(ctx, param, value):
    """--exact picks the llama.cpp build before anything imports it; the value says which runs."""
    from flylocal.llama import kernels

    if value:
        kernels.choose(True)
    return kernels.mode() == kernels.EXACT


# ----- the declarations -----

@dataclass(frozen=True)
class Option:
    name: str                       # the parameter's name in click and in OPTIONS
    flags: tuple[str, ...]
    help: str
    type: Any = None
    to: str | None = "settings"     # where the value goes: settings, fly, asd, sampling, or None (the command's own)
    field: str | None = None        # the field there (default: name)
    is_flag: bool = False
    invert: bool = False            # a flag that turns its field off
    metavar: str | None = None
    callback: Callable | None = None

    @property
    def field_name(self) -> str:
        return self.field or self.name

    @property
    def default(self):
        if self.is_flag:
            return False
        owner = {"settings": Settings, "fly": FlyParams, "asd": AsdParams, "sampling": SamplingParams}[self.to]
        return {f.name: f.default for f in dataclasses.fields(owner)}[self.field_name]

    def click_option(self):
        if self.is_flag:
            return click.option(*self.flags, self.name, is_flag=True, callback=self.callback, help=self.help)
        return click.option(*self.flags, self.name, type=self.type, default=self.default,
                            show_default=self.default not in (None, ()), metavar=self.metavar,
                            callback=self.callback, help=self.help)


OPTIONS = {o.name: o for o in [
    # models
    Option("target", ("--target",), "Target model: a models.txt name, a GGUF path, or the name of a model "
           "already on this machine (LM Studio, ollama, Hugging Face or llama.cpp caches; see `flylocal models "
           "list`).", metavar="NAME|PATH"),
    Option("draft", ("--draft",), "Draft model for --drafter model/mla: a name or path as for --target; "
           "another vocabulary drafts through text (--draft-vocab).", metavar="NAME|PATH"),
    Option("draft_vocab", ("--draft-vocab",),
           "A draft whose vocabulary differs from the target's: auto drafts through text (the draft's text "
           "is tokenized for the target) and says so; same refuses such a draft; translate goes through text "
           "even when the vocabularies agree. Verification is on target tokens either way.",
           type=click.Choice(["auto", "same", "translate"])),
    # placement
    Option("target_rpc", ("--target-rpc",),
           "Put the target's layers on these llama.cpp rpc servers (flylocal rpc-server on other machines); "
           "only a round's rows cross the network. See docs/scale-out.md.", type=Endpoints(), metavar="HOST:PORT[,...]"),
    Option("draft_rpc", ("--draft-rpc",), "Put the draft model's layers on these rpc servers (not the target's: "
           "a server serves one client at a time).", type=Endpoints(), metavar="HOST:PORT[,...]"),
    Option("tensor_split", ("--tensor-split",),
           "How the target's layers are shared among the --target-rpc servers' devices, in order, as proportions "
           "(3,1: three quarters on the first). Default: by their free memory.", type=Proportions(), metavar="P[,P...]"),
    Option("rpc_output", ("--rpc-output",),
           "Where the output layer of a model on rpc servers runs. here: on this machine's CPU, so a verified "
           "row brings back its hidden state (kilobytes); server: with the last layer, so each row brings back "
           "n_vocab logits (a megabyte for a 256k vocabulary), better on a fast link with a slow CPU here.",
           type=click.Choice(["here", "server"])),
    Option("rpc_timeout", ("--rpc-timeout",),
           "Seconds a decode (per --batch-size tokens) may wait for rpc servers before they count as lost.",
           type=Number(min=1.0, max=86400.0)),
    # methods
    Option("drafter", ("--drafter",), "Where drafts come from. Default: mla with --draft, pld without.",
           type=click.Choice(DRAFTERS)),
    Option("verifier", ("--verifier",),
           "How drafts are accepted. fly also accepts mismatches where the target is unsure and agrees right "
           "after; asd accepts a mismatch the target prefers its own token to by only a small logit margin, "
           "within a per-request regret budget. Both change the output relative to the target's greedy "
           "decoding, by design. strict is lossless: the target's own greedy output (bit for bit with --exact; "
           "up to numerical near-ties with the default fast kernels).", type=click.Choice(VERIFIERS)),
    Option("k", ("--k",),
           f"Draft length per round. Default: {DEFAULT_K}, or W+4 with --fly-within-round so that a mismatch in "
           "the first 4 positions can be accepted loosely; prompt lookup and draft models shorten it each round "
           "from measured cost and acceptance. Given explicitly, it is used as is.",
           type=click.IntRange(min=0)),
    Option("draft_p_min", ("--draft-p-min",),
           f"A draft model's draft ends at a token it gives less than this probability. Default: {DEFAULT_P_MIN}, "
           "or 0 with an explicit --k.", type=Number(min=0.0, max=1.0)),
    Option("lookup_corpus", ("--lookup-corpus",),
           "A text file prompt lookup also searches (as well as the context and, in chat, what was generated "
           "earlier in the session).", metavar="FILE"),
    Option("pld_ngram", ("--pld-ngram",), "Longest n-gram prompt lookup tries (it falls back down to 1).",
           type=click.IntRange(min=1)),
    Option("pld_tokens", ("--pld-tokens",),
           "Most tokens one prompt lookup proposes. Default: --k for pld, 6 for mla.", type=click.IntRange(min=1)),
    Option("draft_window", ("--draft-window",),
           f"A draft model reads the context's first 4 tokens and its last W (default {DEFAULT_DRAFT_WINDOW}), the "
           "window moving on as the context grows without evaluating anything again: its prefill and each draft "
           "step cost the same at any context length. 0: the whole context. What the draft sees changes only "
           "speed: the target verifies every token.", type=click.IntRange(min=0), metavar="W"),
    Option("max_tokens", ("--max-tokens",), "Most tokens to generate (per turn).", type=click.IntRange(min=1)),
    # llama.cpp
    Option("ctx", ("--ctx",), "Context size in tokens (prompt + output).", type=click.IntRange(min=16)),
    Option("batch_size", ("--batch-size",), "Most tokens llama.cpp evaluates in one call (prompt evaluation).",
           type=click.IntRange(min=32)),
    Option("gpu_layers", ("--gpu-layers",), "Layers to offload to the GPU, in a GPU build. auto: every layer of the "
           "target, then of the draft, that fits in the GPU's free memory (doctor shows the choice); -1: all; 0: none.",
           type=GpuLayers()),
    Option("flash_attn", ("--flash-attn",),
           "llama.cpp flash attention. auto: off in the exact build (its CPU kernel is not batch-invariant), "
           "llama.cpp's choice otherwise (on, on a CPU).", type=click.Choice(["auto", "on", "off"])),
    Option("cache_type_k", ("--cache-type-k",),
           "The KV cache's type for keys: f16, or a quantized type (q8_0, q4_0, ...) that holds a context in "
           "less memory at some cost in fidelity.", type=click.Choice(CACHE_TYPE_NAMES)),
    Option("cache_type_v", ("--cache-type-v",),
           "The KV cache's type for values, as --cache-type-k; a quantized one needs flash attention (not in "
           "exact mode).", type=click.Choice(CACHE_TYPE_NAMES)),
    Option("threads", ("--threads",),
           "CPU threads per model. auto starts on every core and follows how fast decoding runs now: on a busy "
           "desktop fewer threads decode faster, since one descheduled thread stalls the others. N (at most the "
           "cores available) is used as given; 0: all of them. Default: auto.", type=Threads(), callback=_check_threads),
    Option("exact", ("--exact",),
           "Run the batch-invariant CPU build of llama.cpp: strict output then equals plain greedy decoding bit "
           "for bit (Q4_0, Q4_1, Q8_0 and F16 weights), at a cost in speed. Default: llama.cpp's fast kernels, "
           "where strict equals greedy decoding up to numerical near-ties. FLYLOCAL_EXACT=1 makes it the "
           "default.", is_flag=True, callback=_choose_build),
    Option("recalibrate", ("--recalibrate",),
           "Measure the decode cost curves again instead of using the cached ones (measured once per model "
           "file, build, backend, thread count and batch size).", is_flag=True),
    # FLy and ASD
    Option("fly_window", ("--fly-window",),
           "FLy: a mismatch is accepted only if the W-1 draft tokens after it match natively.",
           type=click.IntRange(min=1), to="fly", field="window"),
    Option("fly_entropy", ("--fly-entropy",),
           "FLy: entropy gate theta (nats, top-m); a mismatch where the target's entropy is below it is "
           "rejected. 0: no gate; inf: strict.", type=Number(min=0.0, allow_inf=True), to="fly", field="entropy"),
    Option("fly_topk", ("--fly-topk",), "FLy: m, the number of largest probabilities the entropy sums over.",
           type=click.IntRange(min=1), to="fly", field="topk"),
    Option("fly_echo", ("--fly-echo",),
           "FLy: n; the gate stays shut for a draft token that ends an n-gram the answer already holds (a "
           "copy of the answer's own text, where an answer starts to loop). 0: off.",
           type=click.IntRange(min=0), to="fly", field="echo"),
    Option("fly_no_window", ("--fly-no-window",),
           "FLy ablation: accept a gated-open mismatch at once, without the window.", is_flag=True, to="fly",
           field="use_window", invert=True),
    Option("fly_any_token", ("--fly-any-token",),
           "FLy: let the gate open for any draft token where the target is unsure, as in the reference "
           "implementation. Default: only for one of the target's own top m (--fly-topk) tokens, never over its "
           "end of generation, nor for a token that repeats the answer (--fly-echo).",
           is_flag=True, to="fly", field="candidates", invert=True),
    Option("fly_within_round", ("--fly-within-round",),
           "FLy: the window must close in the round that drafted the mismatch (j + W < k), as in the reference "
           "implementation. Default: a window may close in later rounds, the output held back until it does.",
           is_flag=True, to="fly", field="across", invert=True),
    Option("asd_gate", ("--asd-gate",),
           "ASD: g, the most regret (target logit of its own token minus that of the draft token) per remaining "
           "draft position for an exception.", type=Number(min=0.0, allow_inf=True), to="asd", field="gate"),
    Option("asd_cap", ("--asd-cap",), "ASD: M, the most exceptions (accepted mismatches) in one round.",
           type=click.IntRange(min=0), to="asd", field="cap"),
    Option("asd_budget", ("--asd-budget",),
           "ASD: B, the most regret in logits one request may spend in all; 0 is strict.",
           type=Number(min=0.0, allow_inf=True), to="asd", field="budget"),
    # prompts
    Option("raw", ("--raw",), "Use the prompt text as is, without the model's chat template.", is_flag=True, to=None),
    # sampling
    Option("temperature", ("--temperature",),
           "Sampling temperature; 0 is greedy. strict stays lossless at any temperature (speculative sampling); "
           "fly and asd are lossy, by design.", type=Number(min=0.0), to="sampling"),
    Option("top_k", ("--top-k",), "Sample among the k most likely tokens (0: all).", type=click.IntRange(min=0),
           to="sampling"),
    Option("top_p", ("--top-p",), "Nucleus sampling mass (1: off).", type=Number(min=0.0, max=1.0, min_open=True),
           to="sampling"),
    Option("min_p", ("--min-p",), "Drop tokens below this fraction of the top probability (0: off).",
           type=Number(min=0.0, max=1.0), to="sampling"),
    Option("repeat_penalty", ("--repeat-penalty",),
           "Penalty on the last 64 committed tokens (1: off; 0.01 to 100, past which a logit is scaled "
           "to nothing or past float range); rejected drafts never count.",
           type=Number(min=0.01, max=100.0), to="sampling"),
    Option("frequency_penalty", ("--frequency-penalty",),
           "Subtracted from a token's logit once per time it occurs in the last 64 committed tokens "
           "(0: off; OpenAI's and llama.cpp's frequency penalty).", type=Number(min=-2.0, max=2.0), to="sampling"),
    Option("presence_penalty", ("--presence-penalty",),
           "Subtracted from the logit of every token that occurs in the last 64 committed tokens "
           "(0: off; OpenAI's and llama.cpp's presence penalty).", type=Number(min=-2.0, max=2.0), to="sampling"),
    Option("seed", ("--seed",), "Random seed for sampling: the same command then gives the same tokens run after "
           "run, under any load; with --exact, strict gives plain sampling's tokens whatever the drafter.",
           type=click.IntRange(min=0, max=2**32 - 1), to="sampling"),
]}

# A request's own fields (serve) that no command-line option sets: settings_from routes them
# as it routes the options, so that a request becomes settings the way a command line does.
REQUEST_FIELDS = {o.name: o for o in [
    Option("logit_bias", (), "(token id, added to its logit) pairs, sorted.", to="sampling"),
    Option("repeat_last_n", (), "How many last tokens the penalties look at.", to="sampling"),
    Option("logprobs", (), "Give output tokens their log-probabilities, and this many alternatives."),
]}

MODEL = ("target", "draft", "draft_vocab", "target_rpc", "draft_rpc", "tensor_split", "rpc_output", "rpc_timeout")
METHOD = ("drafter", "verifier")
DRAFTING = ("k", "draft_p_min", "draft_window", "lookup_corpus", "pld_ngram", "pld_tokens", "max_tokens")
LLAMA = ("ctx", "batch_size", "gpu_layers", "flash_attn", "cache_type_k", "cache_type_v", "threads", "exact", "recalibrate")
VERIFIER_PARAMS = ("fly_window", "fly_entropy", "fly_topk", "fly_echo", "fly_no_window", "fly_within_round", "fly_any_token", "asd_gate", "asd_cap",
                   "asd_budget")
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty",
            "seed")
GENERATION = MODEL + METHOD + DRAFTING + LLAMA + VERIFIER_PARAMS + SAMPLING    # generate, chat, serve


def options(*names: str):
    """A decorator adding the named options to a click command, in the order given."""
    return lambda f: functools.reduce(lambda g, name: OPTIONS[name].click_option()(g), reversed(names), f)


def settings_from(params: dict, base: Settings = Settings()) -> Settings:
    """Settings from click's parsed parameters, or a request's (serve): each declared option
    (or request field, REQUEST_FIELDS) present in `params` goes to its field; anything else
    keeps `base`'s value."""
    parts: dict[str, dict] = {"settings": {}, "fly": {}, "asd": {}, "sampling": {}}
    for name, value in params.items():
        opt = OPTIONS.get(name) or REQUEST_FIELDS.get(name)
        if opt is not None and opt.to is not None:
            parts[opt.to][opt.field_name] = (not value) if opt.invert else value
    verifiers = VerifierConfig(fly=dataclasses.replace(base.verifiers.fly, **parts["fly"]),
                               asd=dataclasses.replace(base.verifiers.asd, **parts["asd"]))
    return dataclasses.replace(base, **parts["settings"], verifiers=verifiers,
                               sampling=dataclasses.replace(base.sampling, **parts["sampling"]))
