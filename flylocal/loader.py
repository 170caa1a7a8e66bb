"""Turning Settings into loaded models and engines, in one place: every command goes through here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from flylocal import models
from flylocal.decoding.adaptive import Learned, timed_decode
from flylocal.decoding.contracts import Verifier
from flylocal.decoding.drafters import make_drafter
from flylocal.decoding.drafters.pld import Corpus
from flylocal.decoding.engine import Engine, EngineConfig
from flylocal.decoding.verifiers import make_verifier
from flylocal.errors import FlylocalError, OptionError
from flylocal.files import read_text
from flylocal.settings import Settings

from flylocal.llama.config import RuntimeConfig

AUTO_SLOTS = 4          # --parallel auto: at most this many sequences

if TYPE_CHECKING:      # llama.cpp is imported when models are loaded, not before (flylocal.llama.kernels)
    from flylocal.llama.embedding import Embedder
    from flylocal.llama.placement import Placement
    from flylocal.llama.runtime import Runtime


@dataclass
class Models:
    """The loaded models of a run, and what lookup searches beyond the context. Engines are
    built from them (`engine`); sessions and commands own them and close them."""

    settings: Settings
    target: Runtime
    draft: Runtime | None
    corpus: Corpus | None = None      # what lookup searches beyond the context, for the session
    through_text: bool = False        # the draft drafts in its own vocabulary (flylocal.decoding.drafters.text)
    # What draft-length control has measured of acceptance, per method and drafting settings:
    # numbers only, kept across requests and chat's /reset (flylocal.decoding.adaptive.Learned).
    learned: dict[tuple, Learned] = field(default_factory=dict)
    embedder: Embedder | None = None  # made on the first embeddings asked for (`embeddings`)

    def engine(self, settings: Settings | None = None, verifier: Verifier | None = None,
               private: bool = False, seq: int | None = None) -> Engine:
        """An engine over these models for `settings` (default: the ones they were loaded with).
        `verifier` passes a verifier object to keep, such as a conversation's ASD ledger. A
        `private` engine's lookup searches the --lookup-corpus file alone, never what other
        requests generated (a server's clients must not draft from each other's text); the
        acceptance statistics of its draft-length control, numbers, are the method's own. With
        `seq`, the engine runs on that sequence of the models (a server's slot)."""
        settings = settings or self.settings
        corpus = self.corpus.copy() if private and self.corpus is not None else self.corpus
        key = (settings.drafter_name, settings.verifier, settings.draft_length, settings.k is None,
               settings.pld_ngram, settings.pld_tokens, settings.draft_p_min_value, settings.draft_window)
        target, draft = self.target, self.draft
        if seq is not None:
            target = target.sequence(seq)
            draft = draft.sequence(seq) if draft is not None and draft.n_seq > seq else None
        return build_engine(settings, target, draft, corpus, verifier, self.through_text,
                            learned=self.learned.setdefault(key, Learned()))

    def reconnect(self) -> list[str]:
        """Start again the models whose rpc servers were lost (flylocal.llama.remote), once they
        answer; the names of those reconnected. FlylocalError when a server still does not."""
        return [rt.name for rt in (self.target, self.draft) if rt is not None and rt.reconnect()]

    def embeddings(self, path: Path | None = None) -> Embedder:
        """The embedder (flylocal.llama.embedding): of the model at `path`, loaded once for
        embeddings alone, or of the target, in a context of its own. FlylocalError for a target
        on rpc servers, whose weights are not here."""
        if self.embedder is None:
            from flylocal.host import usable_cores
            from flylocal.llama.embedding import Embedder

            threads = self.settings.threads or usable_cores()
            if path is not None:
                self.embedder = Embedder.open(path, self.settings.ctx, threads)
            elif self.target.config.rpc:
                raise FlylocalError("the target runs on rpc servers: start the server with --embedding-model NAME "
                                    "to compute embeddings here")
            else:
                self.embedder = Embedder(self.target.model, self.target.vocab, self.settings.ctx, threads)
        return self.embedder

    def finish_costs(self, seconds: float = math.inf) -> None:
        """Measure now what the cost curves of the target and the draft still lack
        (`CostCurve.finish`; at most `seconds` each): for a process that serves no other
        request, after its answer, or a server's model as it unloads, so that the next one
        finds them cached."""
        for rt in (self.target, self.draft):
            if rt is not None and not rt.config.rpc and rt.costs.measuring is not None:
                token = int(rt.tokens[-1]) if rt.n_past else 0
                rt.costs.finish(lambda rows, rt=rt, token=token: timed_decode(rt, token, rows), seconds)

    def close(self):
        if self.embedder is not None:     # before the model it may read
            self.embedder.close()
        for rt in (self.draft, self.target):
            if rt is not None:
                rt.close()


def check(settings: Settings, slots: int | None = None) -> None:
    """Refuse settings no engine can run, before any model is loaded. `slots`: the requests a
    server decodes together (default: --parallel as given, 1 for auto, which `load` fits to the
    draft length): a draft verified whole must fit a slot's share of a shared decode, so that
    company never cuts it (docs/serving.md, "Several requests in one decode")."""
    if settings.drafter_name in ("model", "mla") and not settings.draft:
        raise OptionError(f"--drafter {settings.drafter_name} needs a draft model (--draft NAME|PATH)", "drafter",
                          f"drafter {settings.drafter_name} needs a draft model: start the server with --draft")
    slots = slots or max(settings.parallel, 1)
    k, rows = settings.draft_length, settings.batch_size // slots
    given = f"--batch-size {settings.batch_size}" if slots == 1 else \
        f"--batch-size {settings.batch_size} shared by {slots} slots (--parallel) gives each {rows}"
    api = f"the server's --batch-size is {rows}" if slots == 1 else \
        f"the server's --batch-size of {settings.batch_size} shared by its {slots} slots gives each {rows}"
    if settings.round_rows > max(k + 1, rows):
        # Across rounds a window needs no long draft, but it is held to a slot's share as a
        # draft is: what one round could verify whole.
        w = settings.verifiers.fly.window
        raise OptionError(f"--fly-window {w} spans {w + 1} rows, more than a round verifies; {given}: give "
                          f"--fly-window at most {rows - 1}, or a larger --batch-size", "fly_window",
                          f"fly_window {w} spans {w + 1} rows, more than a round verifies; {api}: at most {rows - 1}")
    if k + 1 > rows:
        if settings.k is None:            # the length FLy's window asks for, not one given
            w = settings.window
            raise OptionError(f"--fly-window {w} needs drafts of {k} tokens, {k + 1} rows per round; {given}: give "
                              f"--fly-window at most {rows - 5}, or a larger --batch-size", "fly_window",
                              f"fly_window {w} needs drafts of {k} tokens, {k + 1} rows per round; {api}: at most "
                              f"{rows - 5}")
        raise OptionError(f"--k {k} verifies {k + 1} rows per round; {given}: give --k at most {rows - 1}, or a larger "
                          "--batch-size", "k",
                          f"k {k} verifies {k + 1} rows per round; {api}: at most {rows - 1}")
    if settings.draft_rpc and not settings.draft:
        raise FlylocalError("--draft-rpc places a draft model: give --draft NAME|PATH")
    shared = set(settings.target_rpc) & set(settings.draft_rpc)
    if shared:
        raise FlylocalError(f"rpc server {sorted(shared)[0]} is given for both the target and the draft; a server "
                            "serves one client at a time: run another rpc-server for the draft, or draft locally")
    if settings.tensor_split and not settings.target_rpc:
        raise FlylocalError("--tensor-split shares the target among its --target-rpc servers: give --target-rpc")


def load(settings: Settings, log: Callable[[str], None] = lambda s: None) -> Models:
    """Resolve and load the models, check the pair, and read the lookup corpus."""
    check(settings)
    target_path = models.resolve(settings.target, log)
    draft_path = models.resolve(settings.draft, log) if settings.draft else None
    from flylocal.llama.devices import gpu_offload     # llama.cpp, once the files are known good

    if settings.gpu_layers and not gpu_offload() and not settings.target_rpc:
        log("this llama.cpp build has no GPU backend: --gpu-layers is ignored")
    layers = gpu_layers(settings, target_path, draft_path)
    slots = settings.parallel
    if slots != 1 and (settings.target_rpc or settings.draft_rpc):
        slots = 1
        log("a model on rpc servers decodes one request at a time: --parallel is 1")
    if layers.line:
        log(layers.line)
    config = runtime_config(settings, settings.target_rpc, settings.tensor_split, layers.target)
    if slots == 0:
        slots = auto_slots(settings, target_path, config)
    target = open_model(target_path, dataclasses.replace(config, n_seq=slots))
    past_training(target, settings.ctx, log)
    draft = None
    through_text = False
    try:
        if draft_path is not None:     # loaded even for pld/none, so chat can switch to it
            draft = open_model(draft_path, runtime_config(settings, settings.draft_rpc, gpu_layers=layers.draft,
                                                          n_seq=target.n_seq))
            past_training(draft, settings.ctx, log)
            through_text = pair(target, draft, settings.draft_vocab, log)
        corpus = read_corpus(settings.lookup_corpus, target)
    except BaseException:
        if draft is not None:
            draft.close()
        target.close()
        raise
    for rt in (target, draft) if draft is not None else (target,):
        rt.costs.say = log         # a calibration the cost cache cannot spare says so (flylocal.decoding.costs)
    return Models(settings, target, draft, corpus, through_text)


def past_training(rt: Runtime, n_ctx: int, log: Callable[[str], None]) -> None:
    trained = rt.n_ctx_train
    if 0 < trained < n_ctx:
        log(f"--ctx {n_ctx} is past the {trained} tokens {rt.name} was trained on: past them its answers may "
            "fall apart")


def pair(target: Runtime, draft: Runtime, mode: str, log: Callable[[str], None]) -> bool:
    """Whether `draft` drafts for `target` through text (--draft-vocab). llama.cpp's
    vocabulary rule still decides whether the vocabularies agree; `same` refuses a pair
    they do not."""
    if mode == "translate":
        return True
    try:
        models.check_compatible(target, draft)
    except FlylocalError as e:
        if mode == "same":
            raise
        why = str(e).split(": ", 1)[-1]
        log(f"draft {draft.name} and target {target.name} have different vocabularies ({why}): drafting "
            "through text (--draft-vocab same refuses such a pair)")
        return True
    return False


def gpu_layers(settings: Settings, target_path, draft_path) -> Placement:
    """n_gpu_layers for the target and the draft: --gpu-layers as given (-1: all), or with auto
    what fits in the GPUs' free memory now (flylocal.llama.placement). A model on rpc servers
    keeps every layer there whatever this says (flylocal.llama.runtime)."""
    from flylocal.llama.placement import ALL, NO_GPU, Placement, place
    from flylocal.llama.devices import gpu_offload, local_devices

    if settings.gpu_layers is not None:
        n = ALL if settings.gpu_layers == -1 else settings.gpu_layers
        return Placement(n, n, f"{settings.gpu_layers} (--gpu-layers)", None)
    gpus = [d for d in local_devices() if d.name != "CPU"] if gpu_offload() else []
    if not gpus:
        return Placement(0, 0, NO_GPU, None)
    local = [p for p, rpc in ((target_path, settings.target_rpc), (draft_path, settings.draft_rpc))
             if p is not None and not rpc]
    if not local:
        return Placement(0, 0, "every layer on the rpc servers", None)
    device = gpus[0].description or gpus[0].name
    placed = place(models.read_layout(local[0]), models.read_layout(local[1]) if len(local) > 1 else None,
                   settings.ctx, settings.batch_size, sum(d.free for d in gpus),
                   names=(Path(local[0]).stem, Path(local[1]).stem if len(local) > 1 else None),
                   device=device if len(gpus) == 1 else f"{len(gpus)} GPUs")
    if settings.target_rpc:            # only the draft is here: it had the GPUs to itself
        return Placement(0, placed.target, placed.reason, placed.line)
    return placed


def auto_slots(settings: Settings, target_path, config: RuntimeConfig) -> int:
    """--parallel auto: as many sequences of --ctx cells as memory holds for the target of
    `config`, up to AUTO_SLOTS and to the slots whose drafts fit a decode (so that company
    never cuts a draft verified whole: `check`)."""
    from flylocal.llama.model import sequences_that_fit

    fit = max(settings.batch_size // settings.round_rows, 1)
    return sequences_that_fit(target_path, config, min(AUTO_SLOTS, fit))


def runtime_config(settings: Settings, rpc: tuple[str, ...] = (), tensor_split: tuple[float, ...] = (),
                   gpu_layers: int = 0, n_seq: int = 1) -> RuntimeConfig:
    """A model's llama.cpp settings; `rpc`: the servers that hold its layers; `gpu_layers`: its
    n_gpu_layers (loader.gpu_layers); `n_seq`: its sequences (--parallel, resolved)."""
    return RuntimeConfig(n_ctx=settings.ctx, n_batch=settings.batch_size, n_threads=settings.threads,
                         n_gpu_layers=gpu_layers, n_seq=n_seq, kv_unified=settings.kv_unified,
                         flash_attn=settings.flash_attn, type_k=settings.cache_type_k,
                         type_v=settings.cache_type_v, rpc=rpc, tensor_split=tensor_split,
                         rpc_timeout=settings.rpc_timeout, rpc_output=settings.rpc_output)


def open_model(path, config: RuntimeConfig) -> Runtime:
    """A loaded model: here, or on rpc servers through a worker process (flylocal.llama.remote)."""
    from flylocal.llama.runtime import Runtime

    return Runtime(path, config, remote=bool(config.rpc))


CORPUS_LIMIT = 64 << 20     # bytes of --lookup-corpus text


def read_corpus(path: str | None, target: Runtime) -> Corpus:
    """The session's lookup corpus: the text of `path` (plain text, tokenized for the target),
    to which generated text is added as the session goes on."""
    if path is None:
        return Corpus()
    text = read_text(path, f"--lookup-corpus {path}", limit=CORPUS_LIMIT)
    return Corpus(target.tokenize(text, add_special=False, parse_special=False) if text else None)


def build_engine(settings: Settings, target: Runtime, draft: Runtime | None, corpus: Corpus | None = None,
                 verifier: Verifier | None = None, through_text: bool = False, learned: Learned | None = None) -> Engine:
    drafter = make_drafter(settings.drafter_name, target, draft, pld_ngram=settings.pld_ngram,
                           pld_tokens=settings.pld_tokens, k_max=settings.draft_length, adaptive=settings.k is None,
                           p_min=settings.draft_p_min_value, corpus=corpus, recalibrate=settings.recalibrate,
                           through_text=through_text, learned=learned, window=settings.draft_window or None,
                           # the draft model's curve as the target's: in slices, unless seeded or asked for
                           calibration_wait=None if settings.sampling.seed is not None or settings.recalibrate
                           else settings.calibration_wait)
    config = EngineConfig(
        max_tokens=settings.max_tokens,
        k=settings.draft_length,
        recalibrate=settings.recalibrate,
        trace=settings.trace,
        logprobs=settings.logprobs,
        sampling=settings.sampling,
        # With a seed, draft lengths must not follow this run's timings: a loose verifier's
        # output follows the drafts, and with the fast kernels so can strict's at a near-tie.
        pin_costs=settings.sampling.seed is not None,
        calibration_wait=settings.calibration_wait,
    )
    return Engine(target, drafter, verifier or make_verifier(settings.verifier, settings.verifiers), config)


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
