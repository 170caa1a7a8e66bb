"""Turning command-line settings into loaded models and an engine, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flylocal import models
from flylocal.drafters import make_drafter
from flylocal.drafters.pld import Corpus
from flylocal.engine import Engine, EngineConfig
from flylocal.errors import FlylocalError
from flylocal.runtime import Runtime, RuntimeConfig, gpu_offload
from flylocal.sampling import SamplingParams
from flylocal.verifiers import VerifierConfig, make_verifier

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_K = 8
DEFAULT_P_MIN = 0.5     # a draft model's token it gives less than this ends its draft (adaptive runs)


@dataclass(frozen=True)
class Settings:
    target: str = DEFAULT_TARGET
    draft: str | None = None
    drafter: str | None = None        # None: mla with a draft, pld without
    verifier: str = "fly"
    k: int | None = None              # None: adaptive up to DEFAULT_K for drafters that adapt
    max_tokens: int = 256
    ctx: int = 4096
    threads: int = 0
    batch_size: int = 512
    flash_attn: str = "auto"
    gpu_layers: int = 0
    pld_ngram: int = 4
    pld_tokens: int | None = None
    seed: int | None = None
    draft_p_min: float | None = None  # None: 0.5 when the draft length adapts, 0 with an explicit --k
    recalibrate: bool = False         # measure the cost curves again instead of reading the cache
    exact: bool = False               # the batch-invariant build (flylocal.kernels)
    lookup_corpus: str | None = None  # a text file prompt lookup also searches
    verifiers: VerifierConfig = field(default_factory=VerifierConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trace: bool = False               # attach trace rows (docs/design.md) to round events

    @property
    def drafter_name(self) -> str:
        return self.drafter or ("mla" if self.draft else "pld")

    @property
    def window(self) -> int:
        """The FLy window that drafts must fit, or 0 when no verifier needs one."""
        fly = self.verifiers.fly
        return fly.window if self.verifier == "fly" and fly.use_window else 0

    @property
    def draft_length(self) -> int:
        """--k, or the default: 8, or with FLy's window at least W+4, so that a mismatch in the
        first four draft positions can still be accepted loosely (it needs j + W < k)."""
        if self.k is not None:
            return self.k
        return max(DEFAULT_K, self.window + 4) if self.window else DEFAULT_K


@dataclass
class Loaded:
    settings: Settings
    target: Runtime
    draft: Runtime | None
    engine: Engine
    corpus: Corpus | None = None      # what lookup searches beyond the context, for the session

    def close(self):
        for rt in (self.draft, self.target):
            if rt is not None:
                rt.close()


def load(settings: Settings, log: Callable[[str], None] = lambda s: None) -> Loaded:
    """Resolve and load the models, check the pair, and build the engine."""
    drafter_name = settings.drafter_name
    k = settings.draft_length
    if k + 1 > settings.batch_size:
        raise FlylocalError(f"--k {k} verifies {k + 1} rows per round; --batch-size must be at least {k + 1}")
    if drafter_name in ("model", "mla") and not settings.draft:
        raise FlylocalError(f"--drafter {drafter_name} needs a draft model (--draft NAME|PATH)")
    rconf = RuntimeConfig(n_ctx=settings.ctx, n_batch=settings.batch_size, n_threads=settings.threads,
                          n_gpu_layers=settings.gpu_layers, flash_attn=settings.flash_attn)
    target_path = models.resolve(settings.target, log)
    draft_path = models.resolve(settings.draft, log) if settings.draft else None
    if settings.gpu_layers and not gpu_offload():
        log("this llama.cpp build has no GPU backend: --gpu-layers is ignored")
    target = Runtime(target_path, rconf)
    draft = None
    try:
        if draft_path is not None:     # loaded even for pld/none, so chat can switch to it
            draft = Runtime(draft_path, rconf)
            models.check_compatible(target, draft)
        corpus = read_corpus(settings.lookup_corpus, target)
        engine = build_engine(settings, target, draft, corpus)
    except BaseException:
        if draft is not None:
            draft.close()
        target.close()
        raise
    return Loaded(settings, target, draft, engine, corpus)


CORPUS_LIMIT = 64 << 20     # bytes of --lookup-corpus text


def read_corpus(path: str | None, target: Runtime) -> Corpus:
    """The session's lookup corpus: the text of `path` (plain text, tokenized for the target),
    to which generated text is added as the session goes on."""
    if path is None:
        return Corpus()
    try:
        with open(path, "rb") as f:
            data = f.read(CORPUS_LIMIT + 1)
    except OSError as e:
        raise FlylocalError(f"cannot read --lookup-corpus {path}: {e.strerror}") from None
    if len(data) > CORPUS_LIMIT:
        raise FlylocalError(f"--lookup-corpus {path} is larger than {CORPUS_LIMIT >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FlylocalError(f"--lookup-corpus {path} is not UTF-8 text (bad byte at offset {e.start})") from None
    return Corpus(target.tokenize(text, add_special=False, parse_special=False) if text else None)


def build_engine(settings: Settings, target: Runtime, draft: Runtime | None, corpus: Corpus | None = None) -> Engine:
    adaptive = settings.k is None
    p_min = settings.draft_p_min if settings.draft_p_min is not None else (DEFAULT_P_MIN if adaptive else 0.0)
    drafter = make_drafter(settings.drafter_name, target, draft, pld_ngram=settings.pld_ngram,
                           pld_tokens=settings.pld_tokens, k_max=settings.draft_length, adaptive=adaptive,
                           p_min=p_min, corpus=corpus, recalibrate=settings.recalibrate)
    config = EngineConfig(
        max_tokens=settings.max_tokens,
        k=settings.draft_length,
        adaptive=adaptive,
        recalibrate=settings.recalibrate,
        trace=settings.trace,
        sampling=settings.sampling,
    )
    return Engine(target, drafter, make_verifier(settings.verifier, settings.verifiers), config)


def encode_prompt(target: Runtime, text: str, raw: bool, system: str | None = None,
                  special: bool = False) -> tuple[np.ndarray, str | None]:
    """The prompt's token ids, through the model's chat template unless `raw`.
    Returns (ids, note); the note says when a model has no template and the text is used as is.

    The user's text is plain text: special-token text in it stays characters. Only the chat
    template's own structure is special, or everything with `special` (hand-made templates)."""
    if not text.strip():
        raise FlylocalError("the prompt is empty")
    note = None
    if not raw:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        if special:
            rendered = target.format_chat(messages)
            ids = None if rendered is None else target.tokenize(rendered, parse_special=True)
        else:
            ids = target.tokenize_chat(messages)
        if ids is not None:
            return ids, None
        note = f"{target.name} has no chat template; using the prompt as plain text"
    return target.tokenize(text, add_special=True, parse_special=special), note
