"""Draft model: the draft model's own greedy continuation, one draft forward per token.

The draft keeps its own KV cache. Before each draft it rolls back to the longest prefix it
shares with the committed context and evaluates what it has not seen (the correction or
bonus token of the last round, or a new chat turn).

With draft-length control (the default; docs/design.md, "Cost model") each round weighs the
draft model against prompt lookup alone and a plain step, from the measured costs of both
models and the measured acceptance, and drafts with the one expected to commit the most
tokens per second. A model draft then ends at a token the draft gives less than `p_min`, or
where one more token is not expected to pay for itself. With an explicit --k the model drafts
k tokens (ending early only at p_min).
"""

from __future__ import annotations

import time

import numpy as np

from flylocal.decoding.adaptive import DraftLength, Learned, ModelDraftLength, timed_decode, top_probability
from flylocal.decoding.contracts import NO_DRAFT, Draft, Drafter, Target
from flylocal.decoding.drafters.pld import PromptLookup, level_prior


class ModelBased(Drafter):
    """What `model` and `mla` share: catching the draft's cache up, the confidence stop, and
    the round's choice between the draft model, prompt lookup alone and a plain step."""

    name = ""

    def __init__(self, model: Target, target_vocab: int, eog: np.ndarray, *, k_max: int = 8, p_min: float = 0.0,
                 target_costs=None, max_ngram: int = 4, corpus=None, recalibrate: bool = False,
                 learned: Learned | None = None):
        self.model = model                # the draft model
        self.target_vocab = target_vocab
        self.eog = eog                    # [n_vocab] bool, the target's end-of-generation ids
        self.p_min = p_min
        self.plan = self.lookup = self.lookup_length = None
        self.corpus = corpus
        self.recalibrate = recalibrate
        self._costs_ready = False
        learned = learned if learned is not None else Learned()
        if target_costs is not None:      # draft-length control
            self.plan = learned.keep("plan", ModelDraftLength(k_max, target_costs, model.costs, p_min))
            self.lookup = PromptLookup(eog, max_ngram=max_ngram, corpus=corpus)
            self.lookup_length = learned.keep("lookup", DraftLength(k_max, level_prior(max_ngram), target_costs))

    def controllers(self) -> tuple:
        return tuple(c for c in (self.plan, self.lookup_length) if c is not None)

    def end(self, output: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(output)

    def _catch_up(self, context: np.ndarray) -> np.ndarray:
        """Roll the draft's cache back to what it shares with `context`; return the tokens it
        has not seen (at least the last one)."""
        return context[self.model.reuse_prefix(context):]

    def _ensure_costs(self, context: np.ndarray) -> None:
        """The draft model's own cost curve, from the disk cache or measured once, after the
        draft has caught up with `context` (but its last token)."""
        if self._costs_ready:
            return
        token = []

        def probe(rows):                  # the catch-up is paid only if the curve must be measured
            if not token:
                feed = self._catch_up(context)
                self.model.decode(feed[:-1])
                token.append(int(feed[-1]))
            return timed_decode(self.model, token[0], rows)

        self.model.costs.ensure(probe, max_rows=2, limit=self.model.n_batch, recalibrate=self.recalibrate)
        self._costs_ready = True

    def propose(self, context: np.ndarray, k: int) -> Draft:
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return NO_DRAFT
        if self.plan is None:           # an explicit --k: k tokens, ended early only by p_min
            return self._draft(context, k, (lambda levels, p: p >= self.p_min) if self.p_min > 0 else None)
        self._ensure_costs(context)
        model_rate, model_k = self.plan.best(k)
        guess = self.lookup.propose(context, k)
        rates = self.lookup_length.rates(guess.level, len(guess.tokens))
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
            return self.lookup_length.reach(draft.level, len(draft.tokens))
        return None

    def observe(self, draft: Draft, accepted: int) -> None:
        if self.plan is None:
            return
        if draft.source == "model":
            self.plan.observe(draft.levels, accepted, draft.seconds)
        else:
            self.lookup_length.update(draft.level, len(draft.tokens), accepted)

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
