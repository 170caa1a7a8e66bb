"""Who may call `flylocal serve`, and whose prompt cache a request may share (docs/serving.md,
"Who shares the prompt cache").

The keys come from --api-key and --api-key-file (one a line). A request names its key with
`Authorization: Bearer KEY`; it is compared in constant time with each. The prompt cache is
shared within a partition only, which --cache-share draws:

    all   every request shares with every other of the same cache_salt (one user: the default
          without keys)
    key   requests of the same key and the same cache_salt share (the default with keys)
    none  no request shares with another

A partition is a digest of the key's and the salt's: neither is kept in the cache or written
into its files.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from flylocal.errors import FlylocalError
from flylocal.files import read_text

SHARES = ("all", "key", "none")
MAX_SALT = 1024          # characters of a cache_salt


def read_key_file(path: str | Path) -> list[str]:
    """The keys of --api-key-file: one a line; blank lines and lines starting with # are none.
    FlylocalError in one line when it cannot be read or holds none."""
    text = read_text(path, f"--api-key-file {path}", limit=1 << 20)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise FlylocalError(f"--api-key-file {path} holds no key (one a line)")
    for i, key in enumerate(keys):
        if any(c.isspace() for c in key) or not key.isprintable():
            raise FlylocalError(f"--api-key-file {path}: key {i + 1} holds a space or a control character")
    return keys


class Keys:
    """The server's keys and its --cache-share rule."""

    def __init__(self, keys: tuple[str, ...] = (), share: str | None = None):
        self.keys = tuple(dict.fromkeys(k for k in keys if k))
        if share is None:
            share = "key" if self.keys else "all"
        if share not in SHARES:
            raise FlylocalError(f"--cache-share {share}: one of {', '.join(SHARES)}")
        if share == "key" and not self.keys:
            raise FlylocalError("--cache-share key needs --api-key or --api-key-file: without keys every request "
                                "is the same user's")
        self.share = share
        self._ids = [hashlib.sha256(k.encode()).hexdigest()[:32] for k in self.keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str) -> str | None:
        """The id of the key an `Authorization` header carries (None: no key is required);
        ValueError when keys are required and it carries none of them."""
        if not self.keys:
            return None
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        found = None
        for key, kid in zip(self.keys, self._ids):        # every key compared, whichever matches
            if hmac.compare_digest(given, key.encode()) and scheme.lower() == "bearer":
                found = kid
        if found is None:
            raise ValueError("missing or wrong API key")
        return found

    def partition(self, key: str | None, salt: str | None) -> str | None:
        """The prompt-cache partition of a request with key id `key` and `salt`: "" for the
        one everyone shares, None for none at all."""
        if self.share == "none":
            return None
        who = key if self.share == "key" else None
        if who is None and not salt:
            return ""
        return hashlib.sha256(json.dumps([who, salt or ""]).encode()).hexdigest()[:32]


def checked_salt(value) -> str | None:
    """A request's cache_salt: a non-empty string of at most MAX_SALT characters, or None;
    ValueError naming it otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SALT:
        raise ValueError(f"{json.dumps(value)[:80]}; a non-empty string of at most {MAX_SALT} characters")
    return value
