"""Draft model: the draft model's own greedy continuation, one draft forward per token.

The draft keeps its own KV cache. Before each draft it rolls back to the longest prefix it
shares with the committed context and evaluates what it has not seen (the correction or
bonus token of the last round, or a new chat turn).

With draft-length control (the default; docs/design.md, "Cost model") each round weighs the
draft model against prompt lookup alone and a plain step, from the measured costs of both
models and the measured acceptance, and drafts with the one expected to commit the most
tokens per second. At a request's first proposal the draft model's prefill is weighed too: it
reads the whole context only where what its drafts are expected to save over the answer pays
for that; else the context's last tokens (a window, after its first SINKS), or nothing, and the
request drafts with prompt lookup alone (`report` says which). --draft-window bounds the window
whatever pays, and moves it on as the context grows (`_slide`). The prefill never delays the
first token: it is evaluated CHUNK tokens a round from the second round on, lookup drafting
meanwhile. A model draft then ends at a token the draft gives less than `p_min`, or where one
more token is not expected to pay for itself. With an explicit --k the model drafts k tokens
(ending early only at p_min), its prefill with its first draft.
"""

from __future__ import annotations

import time

import numpy as np

from flylocal.decoding.adaptive import DraftLength, Learned, ModelDraftLength, streak_after, timed_decode, top_probability
from flylocal.decoding.contracts import NO_DRAFT, Draft, Drafter, Target
from flylocal.decoding.drafters.pld import PromptLookup, level_prior

MIN_WINDOW = 32      # context tokens: a draft model given fewer than this is not asked (prompt lookup alone)
REFIT = 8            # rounds of lookup alone after which a request weighs the draft's prefill again, once
SINKS = 4            # the context's first tokens a draft model always keeps (attention sinks)
CHUNK = 256          # context tokens a draft model's prefill evaluates a round, after the request's first
FEW = 16             # ... or fewer, left to its next draft step


class ModelBased(Drafter):
    """What `model` and `mla` share: catching the draft's cache up, the confidence stop, and
    the round's choice between the draft model, prompt lookup alone and a plain step."""

    name = ""

    def __init__(self, model: Target, target_vocab: int, eog: np.ndarray, *, k_max: int = 8, p_min: float = 0.0,
                 target_costs=None, max_ngram: int = 4, corpus=None, recalibrate: bool = False,
                 learned: Learned | None = None, wait: float | None = None, window: int | None = None):
        self.model = model                # the draft model
        self.target_vocab = target_vocab
        self.eog = eog                    # [n_vocab] bool, the target's end-of-generation ids
        self.p_min = p_min
        self.plan = self.lookup = self.lookup_length = None
        self.corpus = corpus
        self.recalibrate = recalibrate
        self.wait = wait                  # the draft's cost curve measured in slices of this (None: whole)
        self._costs_ready = False
        # The draft's cache holds the context's first SINKS tokens and the tokens from `offset`
        # on (a window), or all of it (offset 0); `given` says what this request's prefill chose.
        # With `window` (--draft-window) it never holds more than the sinks and the last
        # `window` + `window` // 4 tokens: the window moves on as the context grows (`_slide`).
        self.offset = 0
        self.window = window
        self.slid = 0                     # tokens the window has moved on by, without evaluating them again
        self.caught = False
        self.budget: int | None = None    # tokens the request may emit
        self.given: dict | None = None
        self.asked = True                 # whether this request drafts with the model at all
        self.own: list[float] = []        # what prompt lookup alone offered in this request's rounds
        self.start = 0                    # the context's length at the request's first proposal
        self.streak = False               # its last lookup round accepted its whole draft
        learned = learned if learned is not None else Learned()
        if target_costs is not None:      # draft-length control
            self.plan = learned.keep("plan", ModelDraftLength(k_max, target_costs, model.costs, p_min))
            self.lookup = PromptLookup(eog, max_ngram=max_ngram, corpus=corpus)
            self.lookup_length = learned.keep("lookup", DraftLength(k_max, level_prior(max_ngram), target_costs))

    def controllers(self) -> tuple:
        return tuple(c for c in (self.plan, self.lookup_length) if c is not None)

    def begin(self, budget: int | None = None) -> None:
        super().begin(budget)
        self.budget, self.given, self.asked, self.streak, self.slid = budget, None, True, False, 0
        self.own = []
        self.caught = False               # its prefill done: what it lacks later, its drafts catch up

    def end(self, output: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(output)
        if self.plan is not None:
            self.plan.answered(len(output))

    def report(self) -> dict | None:
        if self.given is None or self.window is None:
            return self.given
        return self.given | {"window": self.window, "slid": self.slid}

    def _view(self, context: np.ndarray) -> np.ndarray:
        """What the draft model reads of `context`: all of it, or with a window its first SINKS
        tokens (a BOS and what follows, the attention sinks) and the tokens from `offset` on."""
        return context if self.offset <= SINKS else np.concatenate([context[:SINKS], context[self.offset:]])

    def _slide(self, context: np.ndarray) -> None:
        """--draft-window W: once the draft would hold more than the sinks and W + W // 4 of the
        last tokens, move the window on to the last W, dropping the oldest cells and moving the
        rest back (`Target.drop`): nothing is evaluated again, and each draft step attends over
        at most SINKS + 1.25 W cells at any context length (docs/design.md, "The draft window")."""
        w = self.window
        start = max(self.offset, SINKS)
        if w is None or len(context) - start <= w + w // 4:
            return
        new = len(context) - w
        self.model.drop(SINKS, new - start)
        self.offset, self.slid = new, self.slid + new - start

    def _catch_up(self, context: np.ndarray) -> np.ndarray:
        """Roll the draft's cache back to what it shares with `context` (its view of it); return
        the tokens it has not seen (at least the last one)."""
        self._slide(context)
        view = self._view(context)
        return view[self.model.reuse_prefix(view):]

    def _ensure_costs(self, context: np.ndarray, wait: float | None = None) -> None:
        """The draft model's own cost curve, from the disk cache or measured, on decodes after
        what its cache holds (the prefill is decided after, on that curve): whole, or with
        `wait` as the target's (`CostCurve.ensure`), a slice before each request's first draft
        until it settles. Until its first slice it is the prior's, no cheaper than the target,
        so the request drafts with prompt lookup alone."""
        if self._costs_ready and (wait is None or self.model.costs.measuring is None):
            return
        token = int(context[-1])
        self.model.costs.ensure(lambda rows: timed_decode(self.model, token, rows), max_rows=2,
                                limit=self.model.n_batch, recalibrate=self.recalibrate, wait=wait)
        self._costs_ready = True

    def _fit(self, context: np.ndarray, k: int, again: bool = False) -> None:
        """The request's first proposal: how much of the context the draft model evaluates
        (`ModelDraftLength.window`): what it has not seen of it, where that pays; else a window
        of the last tokens that pays, from MIN_WINDOW on; else nothing, and the request drafts
        with prompt lookup alone. `again`: after REFIT rounds of that, weighed once more on
        what lookup offered in them, for what is left of the budget. The catch-up is timed: what
        a prefill costs here."""
        n = len(context)
        if not again:
            self.start = n
        budget = self.budget if self.budget is not None else self.model.n_ctx
        pays = self.plan.window(k, budget - (n - self.start), self.own if again else None)
        if self.offset > SINKS and (n <= pays or self.offset >= n):
            self.offset = 0                           # the whole context pays, or is not the one held
        self._slide(context)
        view = self._view(context)
        unseen = len(view) - self.model.reuse_prefix(view)
        chosen = "full" if self.offset <= SINKS else "window"
        if pays <= 0 or (unseen > pays and pays < MIN_WINDOW):
            self.asked = False
            self.given = {"chosen": "lookup", "tokens": 0, "evaluated": 0, "pays_for": pays, "seconds": 0.0,
                          "after": len(self.own)}
            return
        self.asked = True
        if unseen > pays:                             # the last `pays` tokens, after the sinks
            self.offset, chosen = n - pays, "window"
            view = self._view(context)
        self.given = {"chosen": chosen, "tokens": len(view), "evaluated": 0, "pays_for": pays, "seconds": 0.0,
                      "after": len(self.own)}

    def _caught_up(self, context: np.ndarray, first: bool) -> bool:
        """Whether the draft model holds its view of `context` but for a few last tokens (which
        its next draft step evaluates); else evaluate up to CHUNK more of it, timed (what a
        prefill costs here), and say whether that was the rest. Nothing is evaluated in a
        request's `first` round, so its first token comes as soon as plain decoding's: the
        draft's prefill is spread over the rounds after it, which draft with prompt lookup
        meanwhile (docs/design.md, "The draft window")."""
        self._slide(context)
        view = self._view(context)
        left = len(view) - 1 - self.model.reuse_prefix(view)
        if left <= FEW:
            self.caught = True
            return True
        if first:
            return False
        n = min(left, CHUNK)
        start = len(view) - 1 - left
        t0 = time.perf_counter()
        self.model.decode(view[start : start + n])
        seconds = time.perf_counter() - t0
        self.plan.prefilled(n, seconds)
        self.given["evaluated"] += n
        self.given["seconds"] = round(self.given["seconds"] + seconds, 6)
        self.caught = left - n <= FEW
        return self.caught

    def propose(self, context: np.ndarray, k: int) -> Draft:
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return NO_DRAFT
        if self.plan is None:           # an explicit --k: k tokens, ended early only by p_min
            return self._draft(context, k, (lambda levels, p: p >= self.p_min) if self.p_min > 0 else None)
        first = self.given is None
        if first:
            self._ensure_costs(context, self.wait)
            self._fit(context, k)
        elif not self.asked and len(self.own) == REFIT and not self.given["after"]:
            self._fit(context, k, again=True)
        ready = self.asked and (self.caught or self._caught_up(context, first))
        model_rate, model_k = self.plan.best(k) if ready else (0.0, 0)
        guess = self.lookup.propose(context, k)
        rates = self.lookup_length.rates(self.lookup_length.row(guess.level, self.streak), len(guess.tokens))
        speedup = self.plan.looked(rates)
        if len(self.own) < REFIT:
            self.own.append(speedup)
        j = int(np.argmax(rates))
        if rates[j] >= model_rate or model_k == 0:
            j = self.lookup_length.curve.explore(rates, j)     # now and then a length with old evidence
            return Draft(guess.tokens[:j], guess.level, source="pld")
        t0 = time.perf_counter()
        draft = self._draft(context, k, self.plan.keep_going)
        return Draft(draft.tokens, source="model", levels=draft.levels, seconds=time.perf_counter() - t0)

    def reach(self, draft: Draft) -> np.ndarray:
        if self.plan is not None and draft.source == "model" and draft.levels is not None:
            return self.plan.reach(draft.levels)
        if self.plan is not None and draft.source == "pld":
            return self.lookup_length.reach(self.lookup_length.row(draft.level, self.streak), len(draft.tokens))
        return None

    def observe(self, draft: Draft, accepted: int) -> None:
        if self.plan is None:
            return
        if draft.source == "model":
            self.plan.observe(draft.levels, accepted, draft.seconds)
        else:
            self.lookup_length.update(self.lookup_length.row(draft.level, self.streak), len(draft.tokens), accepted)
            self.streak = streak_after(len(draft.tokens), accepted)

    def _draft(self, context: np.ndarray, k: int, keep) -> Draft:
        """Up to k draft tokens. `keep(levels, p)` says whether the next token, which the draft
        gives probability p, is kept and drafting goes on; None keeps every token (and spares
        the softmax)."""
        raise NotImplementedError


class ModelDrafter(ModelBased):
    name = "model"

    def _draft(self, context: np.ndarray, k: int, keep) -> Draft:
        out, levels = [], []
        feed = self._catch_up(context)
        while True:
            logits = self.model.decode(feed, logits_from=len(feed) - 1)   # [1, n_vocab_draft]
            token = int(logits[0].argmax())
            p = float(top_probability(logits)[0]) if keep is not None else 1.0
            if token >= self.target_vocab or (keep is not None and not keep(levels, p)):
                break
            out.append(token)
            levels.append(ModelDraftLength.level(p))
            if len(out) == k or self.eog[token]:
                break
            feed = out[-1:]
        return Draft(np.asarray(out, dtype=np.int32), levels=levels)
