"""The --threads auto controller on made-up timings (docs/operations.md, "Threads").

A simulated 2-core (or 8-core) machine: a single-row step on c threads takes BASE / c seconds
when idle; with `busy` cores taken by other work, each thread beyond the free cores stalls the
others: the step takes 1 + STALL times longer per such thread. Noise multiplies every timing."""

from __future__ import annotations

import os
import random

import pytest

from flylocal.llama.threads import BUDGET, RECHECK, ThreadControl, candidates

BASE = 0.02
STALL = 5.0


def step_time(threads: int, cores: int, busy: int, rng: random.Random, noise: float) -> float:
    t = BASE / threads * (1 + STALL * max(0, threads - (cores - busy)))
    return t * (1 + rng.uniform(-noise, noise))


def run(control: ThreadControl, cores: int, busy: int, steps: int, rng: random.Random, noise: float = 0.1):
    """Decode `steps` single-row steps; the thread count used at each."""
    used = []
    for _ in range(steps):
        used.append(control.current)
        t = step_time(control.current, cores, busy, rng, noise)
        control.observe(t, t)
    return used


def test_candidates():
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(8) == [1, 2, 4, 7, 8]
    assert candidates(12) == [1, 2, 4, 8, 11, 12]


def test_stays_on_every_core_when_idle():
    control = ThreadControl(candidates(2), 2)
    used = run(control, 2, 0, 2000, random.Random(1))
    assert control.current == 2 and control.moves == 0
    # Trying 1 thread now and then costs little: re-checks grow rare while nothing changes.
    assert used.count(1) / len(used) < 0.03


def test_moves_to_fewer_threads_when_rounds_slow_down_and_back_when_they_speed_up():
    rng = random.Random(2)
    control = ThreadControl(candidates(2), 2)
    run(control, 2, 0, 500, rng)
    assert control.current == 2
    used = run(control, 2, 1, 300, rng)             # a busy loop on one core
    assert control.current == 1
    assert used.index(1) < 10                       # within a few decodes
    assert used[20:].count(2) / len(used[20:]) < 0.1
    used = run(control, 2, 0, 2000, rng)            # the load goes away
    assert control.current == 2
    # Back within a re-check period (at most RECHECK[1] seconds of decoding at 1 thread).
    assert used.index(2) < RECHECK[1] / (BASE / 1) + 10


def test_rechecks_that_keep_the_count_grow_rarer_and_a_change_starts_them_short_again():
    """Each re-check in a row that keeps the count waits twice as long as the last (1, 2, 4,
    then 8 s of decoding at most); a move starts the doubling again."""
    control = ThreadControl(candidates(2), 2)
    rng = random.Random(3)
    trials = []                              # the decoding clock where each trial began

    def decode(steps: int, busy: int) -> None:
        for _ in range(steps):
            before = control.current
            t = step_time(control.current, 2, busy, rng, 0.0)
            control.observe(t, t)
            if control.current != before and control.current != control.home:
                trials.append(control.decoded_s)

    decode(3000, 0)
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert [round(g) for g in gaps[:4]] == [1, 2, 4, 8]
    assert all(RECHECK[1] <= g < RECHECK[1] + 0.1 for g in gaps[3:]) and len(gaps) > 4
    decode(50, 1)                            # a core gets busy: 1 thread now, found at once
    assert control.home == 1
    trials.clear()
    decode(2000, 1)
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    # Short again after the move (a trial of 2 threads now loses more, so the budget asks
    # for more than 1 s), then doubling up to the longest wait.
    assert gaps[0] < 4 and all(b > a - 1e-6 for a, b in zip(gaps, gaps[1:])), gaps
    assert RECHECK[1] <= gaps[-1] < RECHECK[1] + 0.1, gaps


@pytest.mark.parametrize("busy", [0, 1])
def test_rechecks_cost_at_most_their_budget(busy):
    """Trying the other count now and then, idle or with a core busy, loses at most BUDGET of
    the decoding time (plus the first re-checks, which come at once), against decoding on the
    best count throughout."""
    rng = random.Random(6 + busy)
    control = ThreadControl(candidates(2), 2)
    run(control, 2, busy, 200, rng, noise=0.0)          # settle first
    used = run(control, 2, busy, 20000, rng, noise=0.0)
    best = min((1, 2), key=lambda c: step_time(c, 2, busy, rng, 0.0))
    spent = sum(step_time(c, 2, busy, rng, 0.0) for c in used)
    ideal = len(used) * step_time(best, 2, busy, rng, 0.0)
    assert control.home == best
    assert spent / ideal - 1 <= BUDGET * 1.1


def test_an_eight_core_machine_climbs_down_and_up_step_by_step():
    rng = random.Random(3)
    control = ThreadControl(candidates(8), 8)
    run(control, 8, 0, 300, rng)
    assert control.current == 8
    run(control, 8, 5, 600, rng)                    # 3 cores free: 2 threads is the best candidate
    assert control.current == 2
    run(control, 8, 0, 6000, rng)
    assert control.current == 8


@pytest.mark.parametrize("seed", range(5))
def test_noise_does_not_make_it_oscillate(seed):
    """Two counts within 3% of each other under 25% noise, and heavy-tailed stalls now and then:
    the controller may settle on either but does not keep moving."""
    rng = random.Random(seed)

    control = ThreadControl([1, 2], 2)
    for i in range(3000):
        t = BASE * (1.0 if control.current == 2 else 1.03) * (1 + rng.uniform(-0.25, 0.25))
        if rng.random() < 0.01:
            t *= 4
        control.observe(t, t)
    assert control.moves <= 10          # about 60 s of decoding: a move now and then, no flapping


def test_timings_that_are_not_positive_numbers_are_ignored():
    control = ThreadControl(candidates(2), 2)
    run(control, 2, 0, 200, random.Random(4))
    state = (control.current, control.home, control.decoded_s, dict(control.speed), control.next_check)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert control.observe(bad, bad) == control.current
        assert control.observe(0.01, bad) == control.current
    assert (control.current, control.home, control.decoded_s, control.speed, control.next_check) == state
    used = run(control, 2, 0, 2000, random.Random(5))
    assert used.count(1) / len(used) < 0.03         # no endless re-checking afterwards


def test_a_single_core_has_nothing_to_choose():
    control = ThreadControl(candidates(1), 1)
    used = run(control, 1, 0, 100, random.Random(0))
    assert set(used) == {1}
    assert control.rates() and set(control.rates()) == {1}


# ----- on a real model -----

SPIN = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nend = time.monotonic() + 60\n" \
       "while time.monotonic() < end:\n    pass\n"


@pytest.mark.slow
def test_the_thread_count_changes_at_run_time_and_the_logits_do_not():
    """The context's own thread count follows set_threads, and a position's logits are the same
    on any count: auto can move without changing a token."""
    import numpy as np

    from conftest import SMOL, model_path
    from flylocal.llama.runtime import Runtime, RuntimeConfig     # before llama_cpp: it chooses the build

    import llama_cpp

    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=256)) as rt:
        assert rt.thread_control is not None and rt.n_threads == rt.thread_control.counts[-1]
        ids = rt.tokenize("The committee met on Tuesday to review the budget and agreed to")
        seen = []
        for n in (2, 1, 2):
            rt.set_threads(n)
            assert llama_cpp.llama_n_threads(rt.context._ctx) == n
            rt.reset()
            rt.decode(ids[:-4])
            seen.append(rt.decode(ids[-4:], logits_from=0).copy())
        assert np.array_equal(seen[0], seen[1]) and np.array_equal(seen[0], seen[2])
        # Calibration holds the count the cost curve is keyed by, and gives the count back after.
        rt.set_threads(1)
        with rt.steady():
            assert llama_cpp.llama_n_threads(rt.context._ctx) == rt.calibration_threads
        assert llama_cpp.llama_n_threads(rt.context._ctx) == 1 == rt.n_threads
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=256, n_threads=2)) as fixed:
        assert fixed.thread_control is None


@pytest.mark.slow
def test_auto_on_a_real_busy_machine_measures_and_runs_its_choice(all_cores):
    """Busy loops on every core but one, on the real model. Which count is fastest then depends
    on the machine and whatever else runs on it, so that is tested on made-up timings above;
    what must hold on any machine: the controller read the load, kept to the cores it leaves
    free (a reading may land between two counts: one more is tolerated on trials), and the
    context itself runs the count it says."""
    import subprocess
    import sys

    from conftest import SMOL, model_path, prompt
    from flylocal.decoding.engine import generate_all
    from flylocal.llama.runtime import Runtime, RuntimeConfig     # before llama_cpp: it chooses the build
    from flylocal.host import usable_cores
    from flylocal.loader import build_engine, encode_prompt
    from flylocal.settings import Settings

    import llama_cpp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to choose")
    spin = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in cores[1:]]
    try:
        with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=1024)) as rt:
            assert rt.n_threads == usable_cores()
            ids, _ = encode_prompt(rt, prompt("chat-focus"), raw=False)
            control = rt.thread_control
            generate_all(build_engine(Settings(drafter="none", max_tokens=48), rt, None), ids)
            # It read the load (one core's worth per busy loop), and never ran on more threads
            # than the cores it leaves free.
            assert control.busy is not None and control.busy >= 0.5 * len(spin), control.report()
            assert control.home <= max(1, len(cores) - round(control.busy))
            assert max(map(int, control.report()["decodes"])) <= max(1, len(cores) - round(control.busy)) + 1
            assert llama_cpp.llama_n_threads(rt.context._ctx) == rt.n_threads == control.current
    finally:
        for p in spin:
            p.kill()
            p.wait()


# ---- from the first token: what the last process learnt, and a probe before the first prompt

def test_a_settled_count_is_kept_for_the_next_process_for_a_while(tmp_path, monkeypatch):
    from flylocal.llama import threads

    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    assert threads.known_count([1, 2]) is None                       # nothing kept yet
    threads.keep_count(1, clock=lambda: 1000.0)
    assert threads.known_count([1, 2], clock=lambda: 1000.0 + threads.KEEP - 1) == 1
    assert threads.known_count([1, 2], clock=lambda: 1000.0 + threads.KEEP + 1) is None   # too old
    assert threads.known_count([2, 4], clock=lambda: 1000.0) is None                      # not a candidate
    assert threads.known_count([1, 2], clock=lambda: 999.0) is None                       # from the future
    (tmp_path / "costs" / "threads.json").write_text("{not json")
    assert threads.known_count([1, 2]) is None                       # unreadable: measure afresh
    threads.keep_count(2)                                           # and it is written whole again
    assert threads.known_count([1, 2]) == 2


def test_a_busy_spell_s_count_is_left_within_the_first_decodes_once_the_load_is_gone():
    """The last process settled on 1 thread under load; this one starts there on an idle
    machine, and is back on every core within its first dozen decodes, which it reports."""
    settled = []
    control = ThreadControl(candidates(2), start=1, on_settle=settled.append)
    used = run(control, cores=2, busy=0, steps=12, rng=random.Random(0))
    assert used[0] == 1 and control.home == 2 and used[-1] == 2
    assert settled and settled[-1] == 2


def test_a_count_the_load_chose_is_no_start_for_the_next_process(tmp_path, monkeypatch):
    """A load's move measured nothing, and a count settled on under load says nothing of an idle
    machine: neither is kept for the next process (which would start an idle machine on one
    thread); a count measured quiet is."""
    from flylocal.llama import threads

    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    control, _, meter = threads.auto(2)
    meter.stop()
    control.load(0.0)
    run(control, cores=2, busy=0, steps=40, rng=random.Random(3))
    assert control.home == 2 and threads.known_count([1, 2]) == 2
    control.load(2.0)                                  # both cores busy: moved to one thread
    assert control.home == 1
    assert threads.known_count([1, 2]) == 2            # the move is not kept
    run(control, cores=2, busy=2, steps=200, rng=random.Random(4))
    assert threads.known_count([1, 2]) == 2            # nor a re-check under the load
    control.load(0.0)
    run(control, cores=2, busy=0, steps=40, rng=random.Random(5))
    assert control.home == 2 and threads.known_count([1, 2]) == 2


def test_a_probe_starts_on_the_fastest_count_and_the_usual_check_follows():
    rng = random.Random(1)
    control = ThreadControl(candidates(2), on_settle=lambda home: None)
    home = control.seed({c: step_time(c, 2, 1, rng, 0.0) for c in control.counts})    # one core busy
    assert home == control.home == control.current == 1
    used = run(control, cores=2, busy=1, steps=40, rng=rng)
    assert 2 in used[:12]                        # re-checked within the first decodes
    assert control.home == 1 and used.count(1) > 30
    assert control.seed({}) == 1 and control.seed({3: 0.1, 2: float("nan")}) == 1     # nothing usable


@pytest.mark.slow
def test_a_fresh_process_measures_before_its_first_prompt_and_the_next_starts_there(tmp_path, monkeypatch, all_cores):
    """No kept count: every candidate is timed once before the first prompt runs, the prompt
    runs on the fastest, and a second model opened afterwards starts on the count kept."""
    import numpy as np

    from conftest import SMOL, model_path
    from flylocal.llama import threads
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    # The machine reads as idle (the suite's other workers may be busy): the probe is what is tested.
    monkeypatch.setattr("flylocal.host.CpuLoad.stop", lambda self: 0.0)
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=512)) as rt:
        control = rt.thread_control
        ids = rt.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        rt.decode(ids[:-1])
        assert set(control.speed) == set(control.counts)         # each count timed, before the prompt
        assert rt.n_threads == control.home == min(control.speed, key=control.speed.get)
        assert rt.n_past == len(ids) - 1                          # the probe left nothing behind
        got = rt.decode(ids[-1:], logits_from=0)[0].copy()
        rt.reset()
        rt.decode(ids[:-1])
        expected = rt.decode(ids[-1:], logits_from=0)[0]
        assert np.array_equal(got, expected)
        kept = threads.known_count(control.counts)
        assert kept == control.home
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=512)) as again:
        assert again.thread_control.home == kept and not again.thread_control.speed    # no probe needed
        again.decode(ids[:-1])
        assert again.n_threads == kept and not again.thread_control.speed


# ---- load the scheduler moves between cores (docs/operations.md, "Threads")

def shared_step(threads: int, cores: int, others: float, rng: random.Random) -> float:
    """A single-row step with `others` cores' worth of runnable work the scheduler moves
    around, as measured with unpinned busy loops: a count that fits the free cores runs at its
    speed (a thread sharing a core, at its share of it); one that does not is mostly quick but
    now and then waits a scheduler slice at each barrier (100 ms to 3 s)."""
    free = cores - others
    if threads <= max(free, 1) or threads == 1:
        return BASE / threads * (1 + max(0.0, threads - free)) * rng.uniform(0.95, 1.05)
    return BASE / threads * 0.8 if rng.random() < 0.8 else rng.uniform(0.1, 3.0)


def run_loaded(control: ThreadControl, cores: int, others, steps: int, rng: random.Random,
               period: float = 1.0) -> tuple[list[int], float]:
    """Decode `steps` steps under `others(i)` cores of load at step i, the meter read every
    `period` seconds of decoding (and before the first), as the context does; (the counts used,
    the seconds spent)."""
    used, spent, since = [], 0.0, period
    for i in range(steps):
        if since >= period:
            control.load(max(0.0, others(i) + rng.uniform(-0.3, 0.3)))
            since = 0.0
        used.append(control.current)
        t = shared_step(control.current, cores, others(i), rng)
        control.observe(t, t)
        spent += t
        since += t
    return used, spent


@pytest.mark.parametrize("others", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("start", [1, 2])
def test_load_the_scheduler_moves_keeps_it_on_the_cores_left_free(others, start):
    """Unpinned load on 2 cores, a process starting on either count (the one the last process
    kept): the first reading puts it on 1 thread, no decode ever runs on 2 (one can cost
    seconds), and the run takes the time of 1 thread throughout, within noise."""
    rng = random.Random(int(others * 10) + start)
    control = ThreadControl(candidates(2), start)
    used, spent = run_loaded(control, 2, lambda i: others, 3000, rng)
    ideal = sum(shared_step(1, 2, others, random.Random(i)) for i in range(3000))
    assert 2 not in used and control.home == 1
    assert spent / ideal < 1 / 0.9
    assert control.report()["decodes"] == {"1": 3000}


def test_load_that_starts_and_stops_mid_run():
    """Idle: 2 threads. A busy loop starts: the next reading moves to 1 thread at once, and says
    why. It stops: the next reading gives 2 threads back, and the re-checks keep them."""
    rng = random.Random(3)
    control = ThreadControl(candidates(2), 2)
    load = lambda i: 1.0 if 1000 <= i < 3000 else 0.0                      # noqa: E731
    used, _ = run_loaded(control, 2, load, 5000, rng)
    assert set(used[800:1000]) == {2}
    moved = next(i for i in range(1000, 3000) if used[i] == 1)
    assert moved - 1000 < 80                                                # within a reading
    assert 2 not in used[moved:3000]
    assert used[3500:].count(2) > 0.95 * len(used[3500:]) and control.home == 2   # (1 on re-checks)
    back = next(i for i in range(3000, 5000) if used[i] == 2)
    assert back - 3000 < 80                                                 # within a reading
    whys = [m["why"] for m in control.report()["moves"]]
    assert any("cores busy" in w for w in whys) and any(w.startswith("the load that moved it lifted") for w in whys)


def test_a_costly_recheck_waits_its_budget_past_the_backoff_cap():
    """A trial that cost seconds (a count waiting on a shared core, load unknown) is not
    repeated for as long as keeps re-checks within BUDGET, well past RECHECK's cap."""
    control = ThreadControl(candidates(2), 1)
    for _ in range(5):
        control.observe(0.02, 0.02)
    assert control.current == 2                          # the first re-check comes at once
    control.observe(3.0, 3.0)                            # one trial decode: 3 s, ended there
    assert control.current == 1 and control.home == 1
    assert control.next_check - control.decoded_s > RECHECK[1] * 10
    for _ in range(5000):                                # 100 s of decoding: no second trial
        assert control.observe(0.02, 0.02) == 1


@pytest.mark.slow
def test_a_busy_machine_skips_the_probe_and_starts_on_the_free_cores(tmp_path, monkeypatch, all_cores):
    """Other processes keep every core busy before the first prompt: no count above one is
    timed (a decode on a shared core can cost seconds), the prompt runs on one thread, and
    the report says why."""
    from conftest import SMOL, model_path
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    monkeypatch.setattr("flylocal.host.CpuLoad.stop", lambda self: float(cores))
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=512)) as rt:
        ids = rt.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        rt.decode(ids[:-1])
        rt.decode(ids[-1:], logits_from=0)
        report = rt.thread_report()
        assert rt.n_threads == rt.decoded_on == 1 and not rt.thread_control.speed
        assert report["busy_cores"] == cores and "cores busy" in report["moves"][-1]["why"]


@pytest.mark.slow
def test_doctor_says_what_the_last_process_settled_on_and_when(tmp_path, monkeypatch):
    from flylocal.front.doctor import cache_report, kept_threads_line
    from flylocal.llama import threads

    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path))
    assert "no count kept yet" in kept_threads_line()
    threads.keep_count(2, clock=lambda: 1_000_000.0)
    line = kept_threads_line(clock=lambda: 1_000_120.0)
    assert "settled on 2" in line and "2 min ago" in line and "the next process starts there" in line
    assert "measures before its first prompt" in kept_threads_line(clock=lambda: 1_000_000.0 + threads.KEEP + 1)
    report = cache_report()
    assert report[0].startswith("--threads auto: the last process") and "not a cost curve" not in "\n".join(report)


@pytest.mark.slow
def test_doctor_says_which_cached_curves_are_provisional_and_why(tmp_path, monkeypatch):
    import numpy as np

    from flylocal.decoding.costs import CostCurve, store
    from flylocal.front.doctor import cache_report

    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path))
    calls: dict = {}                                       # each size's passes never agree

    def noisy(rows):
        calls[rows] = calls.get(rows, 0) + 1
        return 0.01 * (1 + 0.4 * (rows - 1)) * (1 + calls[rows])

    curve = CostCurve(key={"model": "/m/loaded.gguf", "kernels": "fast", "threads": 1, "batch": 512})
    curve.ensure(noisy, max_rows=9)
    assert curve.state == "provisional"
    line = next(x for x in cache_report() if "loaded.gguf" in x)
    assert "PROVISIONAL" in line and "disagree" in line and "a start for the next process" in line, line
    settled = CostCurve(key=curve.key)                     # another process settles beside it
    settled.ensure(lambda rows: 0.01 * (1 + 0.4 * (rows - 1)), max_rows=9)
    # ... after this one looked for a settled curve and before it wrote its provisional one
    store.write(curve.key, curve.meta | {"provisional": "passes disagree"}, curve.base, curve.base * np.nan)
    lines = [x for x in cache_report() if "loaded.gguf" in x]
    assert len(lines) == 2 and any("unused: a settled curve is cached beside it" in x for x in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("here_now", [True, False])
def test_a_load_seen_only_between_requests(tmp_path, monkeypatch, all_cores, here_now):
    """Other work kept every core busy while the process was idle between two prompts (another
    server answering in turn). Still runnable when the prompt comes: the prompt runs on one
    thread, and the load is read again after 0.1 s of decoding, not a second, and the free
    cores come back. Gone by then (nothing else runnable): the prompt runs on every core."""
    import time

    from conftest import SMOL, model_path
    from flylocal.llama.context import LOAD_PERIOD
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to choose")
    monkeypatch.setenv("FLYLOCAL_COSTS", str(tmp_path / "costs"))
    busy = {"cores": 0.0, "now": 0}
    monkeypatch.setattr("flylocal.host.CpuLoad.stop", lambda self: busy["cores"])
    monkeypatch.setattr("flylocal.host.CpuLoad.running_now", staticmethod(lambda: busy["now"]))
    with Runtime(model_path(SMOL), RuntimeConfig(n_ctx=512)) as rt:
        ids = rt.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        rt.decode(ids[:-1])
        rt.decode(ids[-1:], logits_from=0)
        control = rt.thread_control
        busy["cores"], busy["now"] = float(cores), cores if here_now else 0     # the gap: other work
        time.sleep(LOAD_PERIOD + 0.2)
        rt.reset()
        rt.decode(ids[:-1])
        if not here_now:                          # nothing rules a count out (which is fastest, the trials say)
            assert max(control.allowed()) == cores and control.limit == cores
            assert not any("cores busy" in m["why"] for m in control.report()["moves"])
            return
        assert max(control.allowed()) == 1 and rt.decoded_on == 1       # the prompt on the free core
        busy["cores"] = busy["now"] = 0           # ... and the other work is over
        t0, token, ran = time.monotonic(), ids[-1], []
        while time.monotonic() - t0 < 0.5 * LOAD_PERIOD:
            token = int(rt.decode([token], logits_from=0)[0].argmax())
            ran.append(rt.decoded_on)
        assert max(control.allowed()) == cores, "the load was not read again within the first decodes"
        assert cores in ran, ran                  # the count the load took, given back (or tried)


def test_a_load_that_lifts_gives_back_the_count_it_took_at_once():
    """A load moves 8 threads down to 4; lifting halfway leaves 4 (8 is still ruled out); lifting
    whole gives back 8 at once, with no trial to win: the move measured nothing."""
    control = ThreadControl(candidates(8), 8)
    control.load(4.0)
    assert control.home == control.current == 4 and control.displaced == 8
    control.load(2.0)
    assert control.home == 4 and control.displaced == 8
    control.load(0.0)
    assert control.home == control.current == 8 and control.displaced is None
    assert control.report()["moves"][-1]["why"].startswith("the load that moved it lifted")
