"""A multi-turn conversation over loaded models: history, prompt rendering with KV reuse,
method switching and the ASD ledger. No terminal I/O here; `cli.chat` renders.

Each turn renders the whole conversation with the model's chat template and hands it to the
engine, whose prefill keeps the longest prefix the target (and the draft) already hold: only
the new user turn is evaluated. When the conversation outgrows the context, the oldest turns
are dropped (the system prompt stays).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

from flylocal.engine import DoneEvent, Engine, RoundEvent
from flylocal.errors import FlylocalError
from flylocal.loader import Loaded, build_engine
from flylocal.stats import Stats
from flylocal.verifiers import make_verifier


@dataclass
class Totals:
    turns: int = 0
    tokens: int = 0
    rounds: int = 0
    loose: int = 0
    decode_s: float = 0.0
    prompt_reused: int = 0
    prompt_evaluated: int = 0

    def add(self, s: Stats) -> None:
        self.turns += 1
        self.tokens += s.emitted
        self.rounds += s.rounds
        self.loose += s.loose
        self.decode_s += s.decode_s
        self.prompt_reused += s.prompt_reused
        self.prompt_evaluated += s.prompt_evaluated


@dataclass
class Conversation:
    loaded: Loaded
    system: str | None = None
    messages: list[dict] = field(default_factory=list)   # user/assistant turns, oldest first
    totals: Totals = field(default_factory=Totals)
    notes: list[str] = field(default_factory=list)       # one-line notices for the user

    def __post_init__(self):
        self.target = self.loaded.target
        self.has_template = self.target.chat_template() is not None
        if not self.has_template:
            self.notes.append(f"{self.target.name} has no chat template; running as a plain continuation")
        self._verifiers = {}
        self._engine = None
        self.last_stats: Stats | None = None

    # ----- methods -----
    @property
    def settings(self):
        return self.loaded.settings

    def verifier(self, name: str):
        """One verifier object per method, kept for the conversation: ASD's ledger persists."""
        if name not in self._verifiers:
            self._verifiers[name] = make_verifier(name, self.settings.verifiers)
        return self._verifiers[name]

    def engine(self) -> Engine:
        if self._engine is None:
            engine = build_engine(self.settings, self.target, self.loaded.draft, self.loaded.corpus)
            engine.verifier = self.verifier(self.settings.verifier)
            self._engine = engine
        return self._engine

    def switch(self, verifier: str | None = None, drafter: str | None = None) -> None:
        if drafter in ("model", "mla") and self.loaded.draft is None:
            raise FlylocalError(f"/drafter {drafter} needs a draft model: start chat with --draft NAME|PATH")
        changes = {}
        if verifier is not None:
            changes["verifier"] = verifier
        if drafter is not None:
            changes["drafter"] = drafter
        self.loaded.settings = dataclasses.replace(self.settings, **changes)
        self._engine = None

    def reset(self) -> None:
        """A new conversation: history cleared, ASD ledger emptied (the caches are reused)."""
        self.messages.clear()
        for v in self._verifiers.values():
            reset = getattr(v, "reset", None)
            if reset:
                reset()

    # ----- turns -----
    def _encode(self, messages: list[dict]):
        """Token ids of the conversation. Message text is plain text: only the chat template's
        own structure becomes control tokens."""
        if self.has_template:
            head = [{"role": "system", "content": self.system}] if self.system else []
            return self.target.tokenize_chat(head + messages)
        # A base model continues the text: user turns start a paragraph, replies follow on.
        text = self.system or ""
        for m in messages:
            text += ("\n\n" if text else "") + m["content"] if m["role"] == "user" else m["content"]
        return self.target.tokenize(text)

    def _prompt_ids(self, user: str):
        """Token ids of the conversation plus the new message, dropping the oldest turns if it
        would not leave room to answer; raises if the new message alone cannot fit."""
        room = self.target.n_ctx - min(self.settings.max_tokens, self.target.n_ctx // 2)
        history = self.messages + [{"role": "user", "content": user}]
        dropped = 0
        while True:
            ids = self._encode(history)
            if len(ids) <= room:
                break
            if len(history) <= 1:
                raise FlylocalError(f"the message is {len(ids)} tokens with the system prompt; it does not fit "
                                    f"the context (--ctx {self.target.n_ctx}) with room to answer")
            history = history[2:] if len(history) > 2 else history[1:]
            dropped += 1
        if dropped:
            self.messages[:] = history[:-1]
            self.notes.append(f"the conversation outgrew the context: dropped the {dropped} oldest exchange(s)")
        return ids

    def send(self, user: str) -> Iterator[RoundEvent | DoneEvent]:
        """Answer `user`. Yields the engine's events. Closing early (Ctrl-C) keeps what was
        yielded as the assistant's turn; the caches resync on the next turn."""
        self.last_stats = None
        ids = self._prompt_ids(user)
        engine = self.engine()
        engine.last_stats = None
        self.messages.append({"role": "user", "content": user})
        reply: list[int] = []
        events = engine.generate(ids)
        try:
            for event in events:
                if isinstance(event, RoundEvent):
                    reply.extend(t for t in event.tokens if not self.target.is_eog(t))
                yield event
        finally:
            events.close()   # an interrupted engine records its stats on close
            if reply:
                self.messages.append({"role": "assistant", "content": self.target.detokenize(reply)})
            else:            # nothing was answered: the turn leaves no trace in the history
                self.messages.pop()
            stats = getattr(engine, "last_stats", None)
            if stats is not None:
                self.totals.add(stats)
            self.last_stats = stats
