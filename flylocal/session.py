"""A session: the loaded models, the engine and the conversation of one user (docs/design.md,
"Requests and sessions"). `flylocal chat` renders one. No terminal I/O here.

Each turn renders the whole conversation with the model's chat template and hands it to the
engine, whose prefill keeps the longest prefix the target (and the draft) already hold: only
the new user turn is evaluated. When the conversation outgrows the context, the oldest turns
are dropped (the system prompt stays). The session keeps one verifier object per method, so
ASD's ledger spans the conversation until `reset()`.
"""

from __future__ import annotations

import codecs
import dataclasses
import threading
from dataclasses import dataclass

from flylocal.decoding.engine import Engine, Generation
from flylocal.decoding.stats import Stats
from flylocal.decoding.verifiers import make_verifier
from flylocal.errors import FlylocalError
from flylocal.loader import Models
from flylocal.settings import Settings


@dataclass
class Totals:
    turns: int = 0
    tokens: int = 0
    decode_tokens: int = 0     # tokens after each turn's first round, over decode_s: its tokens/s
    rounds: int = 0
    loose: int = 0
    decode_s: float = 0.0
    prompt_reused: int = 0
    prompt_evaluated: int = 0

    def add(self, s: Stats) -> None:
        self.turns += 1
        self.tokens += s.emitted
        self.decode_tokens += s.decode_tokens
        self.rounds += s.rounds
        self.loose += s.loose
        self.decode_s += s.decode_s
        self.prompt_reused += s.prompt_reused
        self.prompt_evaluated += s.prompt_evaluated


class TextStream:
    """Token ids in, text out, never splitting a multibyte character: an incomplete character
    left by the last token (an answer cut at --max-tokens inside one) is never shown."""

    def __init__(self, target):
        self.target = target
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens) -> str:
        return self.decoder.decode(b"".join(self.target.piece(t) for t in tokens))

    def each(self, tokens) -> list[tuple[bytes, str]]:
        """Per token: its bytes, and the text the decoder gives out at it (what `feed` gives,
        token by token; "" for a token that only begins a character)."""
        out = []
        for t in tokens:
            piece = self.target.piece(t)
            out.append((piece, self.decoder.decode(piece)))
        return out



class Session:
    def __init__(self, models: Models, system: str | None = None, grammar=None):
        self.models = models
        self.grammar = grammar                         # every answer under it (a Grammar), or None
        self.lock = threading.Lock()                   # one generation at a time on the models
        self.target = models.target
        self.settings: Settings = models.settings      # this session's; switching replaces it
        self.system = system
        self.messages: list[dict] = []                 # user/assistant turns, oldest first
        self.totals = Totals()
        self.notes: list[str] = []                     # one-line notices for the user
        self.has_template = self.target.chat_template() is not None
        if not self.has_template:
            self.notes.append(f"{self.target.name} has no chat template; running as a plain continuation")
        self._verifiers: dict = {}
        self._engine: Engine | None = None

    # ----- methods -----
    def verifier(self, name: str):
        """One verifier object per method, kept for the session: ASD's ledger persists."""
        if name not in self._verifiers:
            self._verifiers[name] = make_verifier(name, self.settings.verifiers)
        return self._verifiers[name]

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self.models.engine(self.settings, self.verifier(self.settings.verifier))
        return self._engine

    def switch(self, verifier: str | None = None, drafter: str | None = None) -> None:
        if drafter in ("model", "mla") and self.models.draft is None:
            raise FlylocalError(f"/drafter {drafter} needs a draft model: start chat with --draft NAME|PATH")
        changes = {"verifier": verifier, "drafter": drafter}
        self.settings = dataclasses.replace(self.settings, **{k: v for k, v in changes.items() if v is not None})
        self._engine = None

    def reset(self) -> list[str]:
        """A new conversation: history cleared, ASD ledger emptied (the caches are reused), and
        models whose rpc servers were lost started again; their names. FlylocalError, after the
        rest, when such a server still does not answer."""
        self.messages.clear()
        for v in self._verifiers.values():
            v.reset()
        return self.models.reconnect()

    # ----- turns -----
    def encode(self, messages: list[dict], tools: list[dict] | None = None):
        """Token ids of a conversation (the session's system prompt first, if any), with the
        functions in `tools` for a template that reads them. Message text is plain text: only
        the chat template's own structure becomes control tokens."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        if self.has_template:
            return self.target.tokenize_chat(head + messages, tools)
        # A base model continues the text: other turns start a paragraph, replies follow on.
        text = ""
        for m in head + messages:
            text += m["content"] if m["role"] == "assistant" else ("\n\n" if text else "") + m["content"]
        return self.target.tokenize(text)

    def _prompt_ids(self, user: str):
        """Token ids of the conversation plus the new message, dropping the oldest turns if it
        would not leave room to answer; raises if the new message alone cannot fit."""
        room = self.target.n_ctx - min(self.settings.max_tokens, self.target.n_ctx // 2)
        history = self.messages + [{"role": "user", "content": user}]
        dropped = 0
        while True:
            ids = self.encode(history)
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

    def send(self, user: str) -> Generation:
        """Start answering `user`: the Generation to iterate (FlylocalError at once if the message
        cannot be sent). When it ends, however it ends, what it produced becomes the assistant's
        turn (a turn that produced nothing leaves no trace), and its stats are counted."""
        ids = self._prompt_ids(user)
        turn = {"role": "user", "content": user}

        def finished(gen: Generation) -> None:
            if gen.tokens:
                self.messages.append({"role": "assistant", "content": self.target.detokenize(gen.tokens)})
            elif self.messages and self.messages[-1] is turn:
                self.messages.pop()
            self.totals.add(gen.stats)

        generation = self.engine().generate(ids, on_end=finished, grammar=self.grammar)
        self.messages.append(turn)
        return generation
