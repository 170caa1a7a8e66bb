"""A model's vocabulary: text to token ids and back, special tokens, end-of-generation ids
and the GGUF chat template (rendered with Jinja2 through llama-cpp-python's formatter).

Text from a user is plain text: special-token text in it ("<|im_end|>") stays characters and
never becomes a control token, unless a caller asks to parse specials (`parse_special`); in a
conversation only the template's own structure is special (`tokenize_chat`).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import numpy as np

from flylocal.errors import FlylocalError
from flylocal.llama.binding import llama_cpp
from flylocal.llama.model import Model


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens, as llama.cpp finds them (the GGUF's
    tokenizer.ggml.fim_*_token_id, else the texts code models name them by); None where there
    is none. A model fills in the middle when it has `pre`, `suf` and `mid`."""
    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None     # a repository's name follows
    sep: int | None = None     # a file's name, then its text, follows

    @property
    def usable(self) -> bool:
        return None not in (self.pre, self.suf, self.mid)


class Vocabulary:
    def __init__(self, model: Model):
        self.model = model
        self.name = model.name
        self._vocab = llama_cpp.llama_model_get_vocab(model.handle)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bos = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos = llama_cpp.llama_vocab_eos(self._vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.vocab_type = llama_cpp.llama_vocab_type(self._vocab)
        fim = {name: getattr(llama_cpp, f"llama_vocab_fim_{name}")(self._vocab)
               for name in ("pre", "suf", "mid", "pad", "rep", "sep")}
        self.fim = FimTokens(**{name: t if 0 <= t < self.n_vocab else None for name, t in fim.items()})
        self._eog = np.zeros(self.n_vocab, dtype=bool)        # [n_vocab]
        for t in range(self.n_vocab):
            if llama_cpp.llama_vocab_is_eog(self._vocab, t):
                self._eog[t] = True
        self._specials = None   # control-token texts, found lazily for chat templates
        self._pieces: dict[int, bytes] = {}         # each token's text, as read once
        self._formatter = None  # the compiled chat template, made on first use

    def _check_open(self) -> None:
        if self.model.handle is None:
            raise FlylocalError(f"{self.name} was already closed")

    def chat_template(self) -> str | None:
        self._check_open()
        return self.model.chat_template()

    def format_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        """Render `messages` (and the functions in `tools`, for a template that reads them) with
        the model's GGUF chat template (Jinja2, as llama-cpp-python does), ending with the
        assistant's turn; None when the model has no template."""
        if self._formatter is None:          # compiling the template takes ~5 ms: once per model
            template = self.chat_template()
            if template is None:
                return None
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.piece(self.eos, special=True).decode("utf-8", "replace"),
                bos_token=self.piece(self.bos, special=True).decode("utf-8", "replace"),
                add_generation_prompt=True,
            )
        try:
            return self._formatter(messages=messages, tools=tools).prompt
        except Exception as e:  # a template may raise for unsupported roles or orderings
            raise FlylocalError(f"the chat template of {self.name} failed: {e}") from None

    def token_text(self, token: int) -> bytes:
        """The vocabulary's stored text for a token (as used by the compatibility rule)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def is_control(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def control_ids(self) -> dict[bytes, int]:
        """{text: id} of the tokens that are only ever written by templates, never typed."""
        return {text.encode(): spec[0] for text, spec in self._control_tokens()[1].items()}

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token]) if 0 <= token < self.n_vocab else False

    @property
    def eog_mask(self) -> np.ndarray:  # [n_vocab] bool
        return self._eog

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids of `text` (str, or UTF-8 bytes). Special-token text ("<|im_end|>") is plain
        text unless `parse_special`: text from a user never becomes control tokens by default."""
        self._check_open()
        try:
            data = text if isinstance(text, bytes) else text.encode("utf-8")
        except UnicodeEncodeError:
            raise FlylocalError("the text is not valid UTF-8") from None
        cap = len(data) + 16
        out = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            out = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        ids = np.ctypeslib.as_array(out)[:n].astype(np.int32)
        if len(ids) >= 2 and ids[0] == self.bos and ids[1] == self.bos:
            ids = ids[1:]  # a template that writes BOS itself, plus the tokenizer's own
        return ids

    def _control_tokens(self):
        """(regex matching any control-token text, longest first; {text: (id, lstrip, rstrip)}).
        These are the tokens llama.cpp parses out of text only when asked to parse specials."""
        if self._specials is None:
            wanted = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            found = {}
            for t in range(self.n_vocab):
                attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
                if attr & wanted:
                    text = self.piece(t, special=True).decode("utf-8", "replace")
                    if text:
                        found.setdefault(text, (t, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                                bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
            texts = sorted(found, key=len, reverse=True)
            pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
            self._specials = (pattern, found)
        return self._specials

    def tools_template(self) -> str | None:
        """The chat template, if it renders offered functions (it reads a `tools` variable)."""
        template = self.chat_template() or ""
        return template if re.search(r"\btools\b", template) else None

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray | None:
        """Token ids of `messages` rendered with the model's chat template, ending with the
        assistant's turn; None when the model has no template.

        Only the template's own text may hold control tokens. Message contents are plain text:
        typed "<|im_end|>" stays characters, never the end-of-turn token. The rendering is
        located by rendering once more with a placeholder for each content; where the template
        only inserts (or trims) the contents, the result is the template's exact token
        sequence. Where it transforms them otherwise, the placeholders' layout is used.
        """
        rendered = self.format_chat(messages, tools)
        if rendered is None:
            return None
        marks = [f"\ue000flylocal-{i}\ue001" for i in range(len(messages))]
        skeleton = self.format_chat([{**m, "content": mark} for m, mark in zip(messages, marks)], tools)
        # [template, index, template, index, ..., template]: odd items are message indices
        split = re.split("\ue000flylocal-(\\d+)\ue001", skeleton)
        pieces = [int(x) if i % 2 else x for i, x in enumerate(split)]
        contents = [str(m.get("content") or "") for m in messages]
        for variant in (contents, [c.strip() for c in contents]):
            if "".join(variant[x] if i % 2 else x for i, x in enumerate(pieces)) == rendered:
                contents = variant
                break
        parts: list = []                                    # str (plain text) or int (control token)
        pattern, specials = self._control_tokens()
        for i, x in enumerate(pieces):
            if i % 2:
                parts.append(contents[x])
                continue
            pos = 0
            for match in pattern.finditer(x) if pattern else ():
                token, lstrip, rstrip = specials[match.group()]
                parts.append(x[pos : match.start()])
                if lstrip and parts and isinstance(parts[-1], str):
                    parts[-1] = parts[-1].rstrip()
                parts.append(token)
                pos = match.end()
                if rstrip:
                    while pos < len(x) and x[pos].isspace():
                        pos += 1
            parts.append(x[pos:])
        ids: list[int] = []
        text = ""
        for part in parts + [None]:
            if isinstance(part, str):
                text += part
                continue
            if text:
                ids.extend(self.tokenize(text, add_special=False, parse_special=False).tolist())
                text = ""
            if part is not None:
                ids.append(part)
        if self.add_bos and (not ids or ids[0] != self.bos):
            ids.insert(0, self.bos)
        return np.asarray(ids, dtype=np.int32)

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:                  # a token's text never changes: read once, the stream's per token
            text = self._pieces.get(token)
            if text is None:
                text = self._pieces[token] = self._read_piece(token, False)
            return text
        return self._read_piece(token, True)

    def _read_piece(self, token: int, special: bool) -> bytes:
        self._check_open()
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens, special: bool = False) -> str:
        return b"".join(self.piece(int(t), special) for t in tokens).decode("utf-8", "replace")

