"""The prompt cache (flylocal/decoding/prompt_cache.py, docs/serving.md "Prompt cache") on the
in-memory fake target: conversations taking turns on a few slots, their cells kept, evicted,
moved to a disk tier and restored at random. Every answer must be what plain greedy decoding
gives on a fresh target, whatever was kept, evicted or restored before it; the cache must
save prefill where it holds what a turn needs, and a damaged or foreign entry must never be
loaded."""

from __future__ import annotations

import numpy as np
import pytest

from fake_backend import FakeLM, FakeSequences, NoisyOracle, fixed_costs, greedy
from flylocal.decoding.batch import Batch
from flylocal.decoding.engine import Engine, EngineConfig
from flylocal.decoding.prompt_cache import PromptCache
from flylocal.decoding.verifiers.strict import Strict
from flylocal.decoding.prompt_files import Shelf

LM = FakeLM(seed=11, n_vocab=32, eog=(), p_eog=0.0)
N_CTX = 400


def conversation_turns(rng, n_conv: int, turns: int) -> list[list[list[int]]]:
    """Per conversation, the user messages of its turns (random tokens), after a system prompt
    that every conversation shares."""
    return [[rng.integers(1, LM.n_vocab, size=int(rng.integers(4, 20))).tolist() for _ in range(turns)]
            for _ in range(n_conv)]


def serve(target, cache, order, system, messages, max_tokens, concurrent, rng):
    """Turns in `order` (conversation ids), up to `concurrent` at once on `target` through a Batch
    with `cache`: [(conversation, prompt, Generation)] in the order they ran."""
    batch = Batch(target, cache=cache)
    history = {c: list(system) for c in set(order)}
    turn = {c: 0 for c in set(order)}
    waiting, running, done = list(order), {}, []
    while waiting or batch.members:
        while waiting and len(running) < concurrent and waiting[0] not in running.values():
            c = waiting.pop(0)
            prompt = history[c] + messages[c][turn[c]]
            seq = batch.place(np.asarray(prompt, dtype=np.int32))
            engine = Engine(target.sequence(seq), NoisyOracle(LM, seed=int(rng.integers(1 << 30))), Strict(),
                            EngineConfig(max_tokens=max_tokens, k=4))
            gen = batch.join(seq, engine, np.asarray(prompt, dtype=np.int32))
            running[gen] = c
            done.append((c, prompt, gen))
        batch.round()
        for gen, c in list(running.items()):
            if gen.stats.stop:
                del running[gen]
                history[c] = prompt_of(done, gen) + gen.tokens
                turn[c] += 1
                if cache is not None:
                    cache.prefilled(gen.stats.prompt_evaluated, 0.01 * gen.stats.prompt_evaluated)
    return done


def prompt_of(done, gen):
    return next(p for _, p, g in done if g is gen)


@pytest.mark.parametrize("seed", range(24))
def test_every_answer_is_greedy_decoding_whatever_was_kept_evicted_or_restored(seed, tmp_path):
    rng = np.random.default_rng(seed)
    n_seq = int(rng.integers(1, 4))
    n_conv = int(rng.integers(2, 5))
    turns = 3
    system = rng.integers(1, LM.n_vocab, size=int(rng.integers(40, 90))).tolist()
    messages = conversation_turns(rng, n_conv, turns)
    order = [c for c in range(n_conv) for _ in range(turns)]
    rng.shuffle(order)
    target = FakeSequences(LM, n_seq, N_CTX, 64, fixed_costs(0.1, rows=64))
    entry = 12 * 150                                  # about one conversation's cells
    limit = int(rng.choice([0, entry, 3 * entry, 100 * entry]))
    shelf = Shelf(tmp_path, int(rng.choice([entry, 100 * entry])), [target.state_key()]) if seed % 3 == 0 else None
    if seed % 7 == 3:
        target.corrupt_restores = True
    cache = PromptCache([target], limit, shelf)
    max_tokens = int(rng.integers(3, 12))
    done = serve(target, cache, order, system, messages, max_tokens, n_seq, rng)
    assert len(done) == n_conv * turns
    for c, prompt, gen in done:
        assert gen.tokens == greedy(LM, prompt, max_tokens, N_CTX)[0], f"seed {seed}: conversation {c}"
    if target.corrupt_restores:
        assert cache.counts.hits == 0 and target.restores == 0
    elif limit >= 3 * entry and n_conv > n_seq:
        assert cache.counts.hits > 0, f"seed {seed}: conversations beyond the slots never took an entry"


def test_conversations_taking_turns_prefill_only_their_new_messages():
    """Three conversations on one slot, A B C A B C ...: with a cache, every turn after a
    conversation's first keeps all it had (its previous prompt and answer); without one, only
    the shared system prompt."""
    rng = np.random.default_rng(1)
    system = rng.integers(1, LM.n_vocab, size=60).tolist()
    messages = conversation_turns(rng, 3, 4)
    order = [0, 1, 2] * 4
    for limit in (0, 1 << 20):
        target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
        cache = PromptCache([target], limit)
        done = serve(target, cache, order, system, messages, 8, 1, rng)
        for i, (c, prompt, gen) in enumerate(done[3:], start=3):
            before = next(p + g.tokens for cc, p, g in reversed(done[:i]) if cc == c)
            reused = gen.stats.prompt_reused
            if limit:
                assert reused == len(before) - 1, (i, reused, len(before))   # all but the answer's last token
            else:
                assert reused < len(before) and reused >= len(system) - 1
        if limit:
            assert cache.counts.hits == 9 and target.restores == 9
            assert cache.counts.restored_tokens > 0 and cache.counts.saved_s > 0


def test_an_entry_is_restored_only_into_a_free_slot_and_never_past_the_bound():
    rng = np.random.default_rng(2)
    target = FakeSequences(LM, 2, N_CTX, 64, fixed_costs(0.1, rows=64))
    size = 12 * 100
    cache = PromptCache([target], 2 * size + size // 2)
    for i in range(6):                                      # six different 100-token slots' worth
        prompt = rng.integers(1, LM.n_vocab, size=100).astype(np.int32)
        seq = cache.seat([0, 1], prompt)
        target.sequence(seq).truncate(0)
        target.sequence(seq).decode(prompt)
        assert cache._bytes(False) <= cache.limit
    busy = 0
    seq = cache.seat([1], np.asarray(target.cached(busy)[:50].tolist() + [3] * 60, dtype=np.int32))
    assert seq == 1 and len(target.cached(busy)) == 100      # the busy slot was never touched
    assert len(cache.entries) == 2 and cache.counts.evicted >= 3


def test_a_restarted_cache_continues_from_the_disk_tier_and_skips_what_it_must_not_load(tmp_path):
    system = list(range(1, 31)) * 3
    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    lines = []
    cache = PromptCache([target], 1 << 20, Shelf(tmp_path, 1 << 20, [target.state_key()], lines.append), lines.append)
    seq = cache.seat([0], np.asarray(system + [5], dtype=np.int32))
    target.sequence(seq).decode(np.asarray(system + [5, 6, 7], dtype=np.int32))
    cache.close(1)
    files = sorted(tmp_path.glob("*.prompt"))
    assert len(files) == 1

    def restart(key=None):
        fresh = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
        said = []
        c = PromptCache([fresh], 1 << 20, Shelf(tmp_path, 1 << 20, [key or fresh.state_key()], said.append), said.append)
        return fresh, c, said

    fresh, c, said = restart()
    prompt = np.asarray(system + [5, 6, 7, 8, 9], dtype=np.int32)
    assert c.seat([0], prompt) == 0 and fresh.cached(0).tolist() == system + [5, 6, 7]
    assert c.counts.hits == 1

    fresh, c, said = restart(key={"another": "model"})        # foreign: one line, not loaded, kept
    assert c.seat([0], prompt) == 0 and len(fresh.cached(0)) == 0
    assert any("another model" in line for line in said) and files[0].exists()

    data = files[0].read_bytes()                              # damaged: one line, deleted, prefilled
    files[0].write_bytes(data[:-5] + bytes(5 * [0xFF]))
    fresh, c, said = restart()
    assert c.seat([0], prompt) == 0 and len(fresh.cached(0)) == 0
    assert c.counts.failed == 1 and not files[0].exists()
    assert sum("not loaded" in line for line in said) == 1

    files[0].write_bytes(data[: len(data) // 2])              # cut short: deleted when indexed
    fresh, c, said = restart()
    assert not c.entries and not files[0].exists() and any("damaged" in line for line in said)


def test_a_short_conversation_continues_in_its_own_slot_and_a_new_one_takes_an_empty_slot():
    """Slot choice with a cache: a prompt that continues all a slot holds takes that slot, however
    short; a prompt sharing little with every slot takes an empty one rather than displacing
    another conversation, then the one used longest ago."""
    target = FakeSequences(LM, 3, N_CTX, 64, fixed_costs(0.1, rows=64))
    cache = PromptCache([target], 1 << 20)
    short = np.arange(1, 11, dtype=np.int32)
    assert cache.seat([0, 1, 2], short) == 0
    target.sequence(0).decode(short)
    assert cache.seat([0, 1, 2], np.concatenate([short, [3, 4]])) == 0        # continues it
    other = np.arange(20, 30, dtype=np.int32)
    assert cache.seat([0, 1, 2], other) == 1                                   # an empty slot
    target.sequence(1).decode(other)
    third = np.arange(5, 9, dtype=np.int32) % 31 + 1
    assert cache.seat([0, 1, 2], third) == 2
    target.sequence(2).decode(third)
    assert cache.seat([0, 1, 2], np.full(12, 7, dtype=np.int32)) == 0         # the one used longest ago


def test_a_file_with_a_hostile_header_is_deleted_not_a_traceback(tmp_path):
    """A header that parses as JSON but holds no token ids or sizes is a damaged entry: deleted
    with one line when the folder is read."""
    import json
    import struct

    from flylocal.decoding.prompt_files import MAGIC

    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    for header in ({"key": [target.state_key()], "tokens": [["a"]], "sizes": [4], "sha256": ""},
                   {"key": [target.state_key()], "tokens": [[1]], "sizes": ["x"], "sha256": ""}):
        raw = json.dumps(header).encode()
        (tmp_path / "bad.prompt").write_bytes(MAGIC + struct.pack("<Q", len(raw)) + raw + b"1234")
        said = []
        cache = PromptCache([target], 1 << 20, Shelf(tmp_path, 1 << 20, [target.state_key()], said.append), said.append)
        assert not cache.entries and not (tmp_path / "bad.prompt").exists()
        assert any("damaged" in line for line in said)


# ----- partitions: cells shared only within one (docs/serving.md, "Who shares the prompt cache") -----

def reused_by(batch, target, prompt, partition, max_tokens=1) -> int:
    """The prompt tokens a request of `partition` reuses (its cached_tokens), run to its end."""
    prompt = np.asarray(prompt, dtype=np.int32)
    seq = batch.place(prompt, partition)
    engine = Engine(target.sequence(seq), NoisyOracle(LM, seed=3), Strict(), EngineConfig(max_tokens=max_tokens, k=2))
    gen = batch.join(seq, engine, prompt)
    while batch.members:
        batch.round()
    return gen.stats.prompt_reused


def extract(batch, target, secret: list[int], known: int, partition, victim) -> list[int]:
    """The PIN attack on cached token counts: for each hidden token after the first `known` of
    `secret`, the guess whose request reuses one more token than every other guess (`victim()`
    runs the victim's requests before each guess); the tokens found (fewer than hidden where no
    guess stands out)."""
    found = list(secret[:known])
    for _ in range(len(secret) - known):
        counts = {}
        for g in range(2, LM.n_vocab):
            victim()
            counts[g] = reused_by(batch, target, found + [g, 1], partition)
        top = max(counts.values())
        if sorted(counts.values()).count(top) != 1:
            break
        found.append(max(counts, key=counts.get))
    return found[known:]


@pytest.mark.parametrize("limit", [0, 1 << 20])
def test_cached_token_counts_reveal_a_prompt_within_its_partition_only(limit):
    """A's prompt ends with four hidden tokens; B guesses them one at a time from how many
    prompt tokens each guess reuses, on one slot: without a cache, right after A's request in
    the slot; with one, after an unrelated request of A's has moved A's cells into the cache.
    Within A's partition the guesses recover the tokens (so sharing is on); from another
    partition, or from none, every guess reuses the same count, and nothing is found."""
    rng = np.random.default_rng(5)
    secret = rng.integers(2, LM.n_vocab, size=40).tolist()
    unrelated = rng.integers(2, LM.n_vocab, size=30).tolist()
    for attacker, recovered in (("alice", True), ("bob", False), (None, False)):
        target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
        batch = Batch(target, cache=PromptCache([target], limit))

        def victim():
            reused_by(batch, target, secret, "alice", max_tokens=3)
            if limit:
                reused_by(batch, target, unrelated, "alice")

        found = extract(batch, target, secret, 36, attacker, victim)
        assert (found == secret[36:]) == recovered, (attacker, found)
        if not recovered:
            assert found == []


def test_a_slot_of_another_partition_is_emptied_in_every_model_and_kept_as_its_owners_entry():
    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    draft = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    cache = PromptCache([target, draft], 1 << 20)
    prompt = np.arange(1, 41, dtype=np.int32) % 31 + 1
    assert cache.seat([0], prompt, "a") == 0
    target.sequence(0).decode(prompt)
    draft.sequence(0).decode(prompt[:30])
    assert cache.seat([0], prompt, "b") == 0
    assert len(target.cached(0)) == 0 and len(draft.cached(0)) == 0          # nothing of A's is reused
    assert [e.partition for e in cache.entries] == ["a"]
    assert cache.seat([0], np.concatenate([prompt, [5]]), "b") == 0 and cache.counts.hits == 0
    assert cache.seat([0], np.concatenate([prompt, [5]]), "a") == 0 and cache.counts.hits == 1
    assert target.cached(0).tolist() == prompt.tolist() and draft.cached(0).tolist() == prompt[:30].tolist()
    # the partition None shares with no one: its cells are neither reused nor kept
    assert cache.seat([0], prompt, None) == 0 and len(target.cached(0)) == 0
    target.sequence(0).decode(prompt)
    kept = len(cache.entries)
    assert cache.seat([0], prompt, None) == 0 and len(target.cached(0)) == 0 and len(cache.entries) == kept


# ----- the disk tier fails closed -----

def filled(tmp_path, limit, lines, n_seq=1):
    """A cache whose memory holds about one 100-token entry, over a shelf in tmp_path."""
    target = FakeSequences(LM, n_seq, N_CTX, 64, fixed_costs(0.1, rows=64))
    return target, PromptCache([target], limit, Shelf(tmp_path, 1 << 20, [target.state_key()], lines.append),
                               lines.append)


def take_turns_on(target, cache, prompts, rounds=2):
    for _ in range(rounds):
        for p in prompts:
            seq = cache.seat([0], p)
            kept = target.sequence(seq).reuse_prefix(p)
            target.sequence(seq).decode(p[kept:])


def test_a_disk_tier_that_cannot_be_written_drops_entries_in_one_true_line(tmp_path, monkeypatch):
    """A full disk: every write fails. Entries past the memory bound are dropped, each with one
    line saying why, never said to be on disk; no later request fails."""
    import errno

    from flylocal.decoding import prompt_files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prompt_files, "write", full)
    lines = []
    target, cache = filled(tmp_path, 12 * 110, lines)
    prompts = [np.full(100, t, dtype=np.int32) for t in (3, 4, 5)]
    take_turns_on(target, cache, prompts)
    assert not any("to disk" in line for line in lines)
    dropped = [line for line in lines if "evicted" in line]
    assert dropped and all("No space left on device" in line for line in dropped)
    assert all(e.data is not None for e in cache.entries) and cache._bytes(False) <= cache.limit


def test_a_removed_disk_tier_costs_a_prefill_and_is_made_again(tmp_path):
    """DIR removed under a running cache: an entry kept there is not loaded (one line; the
    request prefills), and the next entries go to DIR made anew."""
    import shutil

    lines = []
    folder = tmp_path / "dir"
    target, cache = filled(folder, 12 * 110, lines)
    prompts = [np.full(100, t, dtype=np.int32) for t in (3, 4, 5)]
    take_turns_on(target, cache, prompts, rounds=1)
    assert any(e.path is not None and e.data is None for e in cache.entries)
    shutil.rmtree(folder)
    take_turns_on(target, cache, prompts, rounds=2)
    assert cache.counts.failed >= 1 and any("cannot read it" in line for line in lines)
    assert folder.is_dir() and list(folder.glob("*.prompt"))
    assert all(e.data is not None or e.path is not None for e in cache.entries)


def test_a_forged_file_is_refused_before_its_states_are_loaded(tmp_path):
    """Conversation 5's header and tokens with conversation 3's states and their digest: the
    digest covers the header and the tokens, so the file is refused (and deleted) and the
    request prefills; nothing is restored."""
    import struct

    from flylocal.decoding.prompt_files import DIGEST, MAGIC, Unusable, read

    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    cache = PromptCache([target], 1 << 20, Shelf(tmp_path, 1 << 20, [target.state_key()]))
    three, five = np.full(60, 3, dtype=np.int32), np.full(60, 5, dtype=np.int32)
    take_turns_on(target, cache, [three, five], rounds=1)
    cache.close(1)

    def parts(path):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[len(MAGIC): len(MAGIC) + 8])
        at = len(MAGIC) + 8 + n
        return data[:at], data[at: at + DIGEST], data[at + DIGEST:]

    files = {int(np.frombuffer(parts(f)[2][:4], dtype=np.int32)[0]): f for f in tmp_path.glob("*.prompt")}
    head5, _, _ = parts(files[5])
    _, digest3, states3 = parts(files[3])
    files[5].write_bytes(head5 + digest3 + states3)
    with pytest.raises(Unusable, match="digest"):
        read(files[5], [target.state_key()])
    lines = []
    fresh = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    again = PromptCache([fresh], 1 << 20, Shelf(tmp_path, 1 << 20, [fresh.state_key()], lines.append), lines.append)
    assert again.seat([0], np.concatenate([five, [7]])) == 0
    assert fresh.restores == 0 and len(fresh.cached(0)) == 0 and again.counts.failed == 1
    assert any("do not match its digest" in line for line in lines) and not files[5].exists()
    # a file whose tokens are not those its entry was listed with: refused before any state is read
    with pytest.raises(Unusable, match="other tokens"):
        read(files[3], [target.state_key()], [five])


def test_a_fifo_a_link_or_a_device_in_the_folder_is_skipped_in_one_line(tmp_path):
    """Opening a FIFO waits for a writer for ever: the folder's listing and every read open
    regular files only, and say in one line what they skipped."""
    import os
    import threading

    from flylocal.decoding.prompt_files import Unusable, read

    os.mkfifo(tmp_path / "fifo.prompt")
    (tmp_path / "link.prompt").symlink_to("/dev/zero")
    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    lines, out = [], []
    worker = threading.Thread(target=lambda: out.append(
        PromptCache([target], 1 << 20, Shelf(tmp_path, 1 << 20, [target.state_key()], lines.append), lines.append)),
        daemon=True)
    worker.start()
    worker.join(10)
    assert out, "listing a folder with a FIFO in it never ended"
    assert not out[0].entries
    assert [line for line in lines if "no regular files" in line] == \
        [line for line in lines if "fifo.prompt (not a regular file (a FIFO))" in line and "link.prompt" in line]
    assert (tmp_path / "fifo.prompt").exists() and (tmp_path / "link.prompt").is_symlink()
    for name in ("fifo.prompt", "link.prompt"):
        with pytest.raises(Unusable, match="not a regular file"):
            read(tmp_path / name, [target.state_key()])


def test_leftover_temporary_files_are_removed_at_start_and_young_ones_count_against_the_bound(tmp_path):
    import os
    import time

    old, young = tmp_path / ".abc.prompt.1234.tmp", tmp_path / ".def.prompt.5678.tmp"
    old.write_bytes(b"x" * 1000)
    young.write_bytes(b"y" * 5000)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    lines = []
    target = FakeSequences(LM, 1, N_CTX, 64, fixed_costs(0.1, rows=64))
    shelf = Shelf(tmp_path, 12 * 100 + 5000, [target.state_key()], lines.append)
    cache = PromptCache([target], 12 * 100, shelf, lines.append)
    assert not old.exists() and young.exists() and shelf.held == 5000
    assert any("removed 1 unfinished" in line for line in lines)
    prompts = [np.full(100, t, dtype=np.int32) for t in (3, 4, 5, 6)]
    take_turns_on(target, cache, prompts, rounds=1)
    assert cache._bytes(True) + shelf.held <= shelf.limit
