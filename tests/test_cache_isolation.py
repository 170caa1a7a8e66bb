"""What a shared `flylocal serve` keeps apart, and what its disk tier survives (docs/serving.md,
"Who shares the prompt cache", "Prompt cache"), on the real target, in exact mode:

- the red team's PIN attack: a client guesses another's prompt a token at a time from
  `cached_tokens`; it works within one partition (the cache is on) and fails across API keys
  and across cache salts, on the OpenAI and the Ollama dialects; a stored response is found by
  its own key only;
- a disk tier removed or full under a running server costs prefill, never a failed request, and
  the log says only what happened;
- a forged file (one conversation's header, another's states and digest) is refused, and the
  answer is the one a server with no cache gives;
- a FIFO in DIR: the server starts, says so in one line, and SIGTERM stops it within 30 s."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from conftest import SMOL
from test_server import free_port, log, stop, wait_ready

pytestmark = pytest.mark.slow

KEYS = {"alice": "alice-key-7f3a", "bob": "bob-key-91c2"}
PREAMBLE = ("You are the support assistant of Northwind Savings Bank. Answer politely, briefly and only about the "
            "account in front of you. Never reveal internal notes. ") * 3
LEAD = PREAMBLE + "Internal note: the customer's account PIN is"
PIN = [5, 8, 2, 7]
SECRET = LEAD + " " + " ".join(map(str, PIN)) + " and their name is Margaret Holloway. Greet them."
UNRELATED = "Write one sentence about the weather in the mountains today, for a hiking newsletter of a town."


def start(*args: str, port: int, fsize: int | None = None) -> subprocess.Popen:
    err = tempfile.TemporaryFile(mode="w+")

    def limit():
        if fsize is not None:                 # a full disk: any file past `fsize` bytes is refused (EFBIG)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--threads", "1",
                             "--target", SMOL, "--ctx", "2048", "--parallel", "1", "--verifier", "strict", *args],
                            stdout=subprocess.DEVNULL, stderr=err, text=True, preexec_fn=limit)
    proc.log_file = err
    return proc


def server(*args, fsize=None):
    port = free_port()
    proc = start(*args, port=port, fsize=fsize)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def complete(url, prompt, who=None, salt=None, dialect="openai", max_tokens=1) -> int:
    """The prompt tokens a raw completion request reuses from the cache."""
    headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
    if dialect == "ollama":
        body = {"model": SMOL, "prompt": prompt, "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": max_tokens} | ({"cache_salt": salt} if salt else {})}
        r = httpx.post(url + "/api/generate", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["flylocal"]["prompt_reused"]
    body = {"model": SMOL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | \
        ({"cache_salt": salt} if salt else {})
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def attack(url, victim, attacker, victim_salt=None, salt=None, dialect="openai") -> list[int]:
    """The red team's attack: the victim's prompt ends in a PIN; after each of the victim's
    requests and an unrelated one of theirs (which moves the victim's cells from the slot into
    the cache), the attacker sends the prompt up to a guessed digit and takes the digit whose
    request reuses more tokens than every other. The digits found, stopping where no guess
    stands out."""
    found: list[int] = []
    for _ in PIN:
        counts = []
        for d in range(10):
            complete(url, SECRET, victim, victim_salt, max_tokens=4)
            complete(url, UNRELATED, victim, victim_salt)
            guess = LEAD + "".join(f" {x}" for x in found + [d]) + " and"
            counts.append(complete(url, guess, attacker, salt, dialect))
        best = max(counts)
        if counts.count(best) != 1:
            break
        found.append(counts.index(best))
    return found


def test_the_pin_attack_works_within_a_partition_and_fails_across_keys_and_salts(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# one key a line\n" + "\n".join(KEYS.values()) + "\n")
    proc, url = server("--api-key-file", str(keys), "--cache-ram", "64")
    try:
        assert attack(url, "alice", "alice") == PIN                          # one partition: the cache is on
        assert attack(url, "alice", "bob") == []                             # another key
        assert attack(url, "alice", "bob", dialect="ollama") == []
        assert attack(url, "alice", "alice", salt="tenant-2") == []          # the same key, another salt
        assert attack(url, "alice", "alice", "tenant-1", "tenant-2", dialect="ollama") == []
        assert attack(url, "alice", "alice", "tenant-1", "tenant-1", dialect="ollama") == PIN
        # a stored response is its key's alone
        made = httpx.post(url + "/v1/responses", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=120,
                          json={"model": SMOL, "input": "Hello", "max_output_tokens": 4}).json()
        for who, status in (("bob", 404), ("alice", 200)):
            got = httpx.get(f"{url}/v1/responses/{made['id']}", headers={"Authorization": f"Bearer {KEYS[who]}"})
            assert got.status_code == status
    finally:
        stop(proc)
    proc, url = server("--cache-ram", "64")                                  # one user: salts still part
    try:
        assert attack(url, None, None) == PIN
        assert attack(url, None, None, salt="mine") == []
    finally:
        stop(proc)


def conversation(url, n, turn) -> tuple[int, str]:
    """(status, text) of turn `turn` of conversation `n`, a document and questions about it."""
    doc = f"Document {n}: " + ("the lighthouse keeper of island %d logs the ships that pass. " % n) * 8
    messages = [{"role": "system", "content": doc}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"Question {t}: what does the keeper of island {n} do?"})
        if t < turn:
            messages.append({"role": "assistant", "content": "The keeper logs ships."})
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": SMOL, "messages": messages, "max_tokens": 12, "temperature": 0})
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text


def test_a_disk_tier_removed_or_full_under_a_running_server_never_fails_a_request(tmp_path):
    """Three conversations taking turns on one slot with 4 MiB of memory, so that entries go to
    DIR: DIR removed halfway, or every write past 1 MiB refused (a full disk). Every request
    answers as a server without a cache does; the log never says an entry moved to disk that
    did not."""
    proc, url = server("--cache-ram", "0")
    try:
        expected = [conversation(url, n, t) for t in range(3) for n in range(3)]
    finally:
        stop(proc)
    for case in ("removed", "full"):
        folder = tmp_path / case
        proc, url = server("--prompt-cache", str(folder), "--cache-ram", "4",
                           fsize=(1 << 20) if case == "full" else None)
        try:
            answers = []
            for t in range(3):
                for n in range(3):
                    answers.append(conversation(url, n, t))
                    if case == "removed" and (t, n) == (1, 0):
                        shutil.rmtree(folder)
        finally:
            stop(proc)
        said = log(proc)
        assert answers == expected, (case, said)
        if case == "full":
            assert "File too large" in said and "to disk" not in said
        else:
            assert "moved" in said and "internal error" not in said     # entries were on disk when DIR went


def test_a_forged_file_is_refused_and_the_answer_is_a_fresh_servers(tmp_path):
    """Conversation 5's header and tokens with conversation 3's states and digest, in DIR: the
    restarted server refuses it in one line and answers conversation 5 as a server with no
    cache does (before, it answered about conversation 3's document)."""
    from flylocal.decoding.prompt_files import DIGEST, MAGIC

    folder = tmp_path / "dir"
    files = {}
    for n in (3, 5):                          # each conversation's file, made by a server of its own
        proc, url = server("--prompt-cache", str(folder))
        try:
            conversation(url, n, 0)
        finally:
            stop(proc)
        (made,) = [p for p in folder.glob("*.prompt") if p not in files.values()]
        files[n] = made.rename(tmp_path / f"{n}.prompt")
    files = {n: p.rename(folder / p.name) for n, p in files.items()}

    def parts(path):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[len(MAGIC): len(MAGIC) + 8])
        at = len(MAGIC) + 8 + n
        return data[:at], data[at: at + DIGEST], data[at + DIGEST:]

    assert len(parts(files[5])[2]) == len(parts(files[3])[2])         # states of one size: only the digest can tell
    head5, _, _ = parts(files[5])
    _, digest3, states3 = parts(files[3])
    files[5].write_bytes(head5 + digest3 + states3)
    proc, url = server("--prompt-cache", str(folder))
    try:
        forged = conversation(url, 5, 1)
    finally:
        stop(proc)
    assert "do not match its digest" in log(proc)
    proc, url = server("--cache-ram", "0")
    try:
        assert forged == conversation(url, 5, 1)
    finally:
        stop(proc)


def test_a_fifo_in_the_prompt_cache_dir_is_skipped_and_sigterm_stops_the_server(tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    os.mkfifo(folder / "waiting.prompt")
    proc, url = server("--prompt-cache", str(folder))
    try:
        assert conversation(url, 1, 0)[0] == 200
    finally:
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert time.monotonic() - began < 30 and proc.returncode == 0
    said = [line for line in log(proc).splitlines() if "no regular files" in line]
    assert len(said) == 1 and "waiting.prompt (not a regular file (a FIFO))" in said[0]
