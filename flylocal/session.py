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
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from flylocal.decoding.engine import Engine, Generation
from flylocal.decoding.stats import Stats
from flylocal.decoding.verifiers import make_verifier
from flylocal.decoding import prompt_files
from flylocal.errors import FlylocalError
from flylocal.files import read_text, write_atomically
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



def conversations_dir() -> Path:
    """$FLYLOCAL_CHATS, or ~/.local/share/flylocal/chats: where chat keeps saved conversations."""
    folder = os.environ.get("FLYLOCAL_CHATS")
    if folder:
        return Path(folder).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "flylocal" / "chats"


def conversation_path(name: str) -> Path:
    """The file of the conversation saved as `name`; FlylocalError for a name that is not one."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", name or ""):
        raise FlylocalError(f"{name!r} is not a conversation name: letters, digits, '_', '.' and '-', at most 64")
    return conversations_dir() / f"{name}.json"


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

    # ----- saved conversations (chat's /save NAME, --resume NAME) -----
    def save(self, name: str) -> Path:
        """Keep the conversation as NAME (its messages, and the cells the models hold of it, so
        that a resumed chat prefills none of it); the file written."""
        path = conversation_path(name)
        target, draft = self.models.target, self.models.draft
        models = [m for m in (target, draft) if m is not None and not m.config.rpc and m.n_past]
        record = {"version": 1, "target": target.name, "system": self.system, "messages": self.messages}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(record, ensure_ascii=False, indent=1))
            cells = path.with_suffix(prompt_files.SUFFIX)
            if models:
                prompt_files.write(cells, [m.state_key() for m in models], [m.tokens for m in models],
                                   [m.state(0) for m in models])
            else:
                cells.unlink(missing_ok=True)
        except OSError as e:
            raise FlylocalError(f"cannot save the conversation to {path}: {e.strerror or e}") from None
        return path

    def resume(self, name: str) -> str:
        """Continue the conversation saved as NAME: its messages, and its cells where they were
        made by these models, this build and this context size (else it is evaluated on the next
        turn); a line saying which."""
        path = conversation_path(name)
        try:
            record = json.loads(read_text(path, f"the conversation {name!r}", limit=64 << 20, regular=True))
            system, messages = record["system"], record["messages"]
            if (system is not None and not isinstance(system, str)) or not all(
                    isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
                    for m in messages):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise FlylocalError(f"{path} is not a saved conversation") from None
        self.system, self.messages[:] = system, messages
        turns = sum(m["role"] == "user" for m in messages)
        cells = path.with_suffix(prompt_files.SUFFIX)
        if not cells.exists() and not cells.is_symlink():
            return f"resumed {name!r}: {turns} turns (its first answer evaluates the conversation)"
        target, draft = self.models.target, self.models.draft
        models = [m for m in (target, draft) if m is not None and not m.config.rpc]
        for keys in (models, models[:1]):              # with the draft's cells, or the target's alone
            try:
                tokens, data = prompt_files.read(cells, [m.state_key() for m in keys])
                break
            except prompt_files.Unusable as e:
                why = str(e)
        else:
            return f"resumed {name!r}: {turns} turns; its saved cells are not loaded ({why}), so its next answer " \
                   "evaluates the conversation"
        for m, t, d in zip(keys, tokens, data):
            if d is not None and not m.restore(0, t, d):
                m.reset()
                return f"resumed {name!r}: {turns} turns; its saved cells would not load, so its next answer " \
                       "evaluates the conversation"
        return f"resumed {name!r}: {turns} turns, {len(tokens[0])} tokens of it already in the cache"

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
