"""Shared fixtures: the real registry models, loaded once per session.

The models come from `scripts/setup.sh` (or `flylocal models fetch`). A missing model is an
error, not a skip: these tests are the project's correctness anchor. Every test that loads a
real model (through these fixtures, or by running the command line on one) is marked `slow`;
`pytest -m "not slow"` runs the rest, which import neither llama.cpp nor a model.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# The exactness tests compare strict with plain decoding bit for bit, which needs the
# batch-invariant build (flylocal.llama.kernels); command-line tests inherit it. Cost curves are
# measured afresh into a directory of this session's own.
os.environ.setdefault("FLYLOCAL_EXACT", "1")
# One folder for the whole run: made by the process pytest started, inherited by its workers
# (a curve one worker measured is read by the others, as on a machine; the files are written
# whole and renamed), removed by the process that made it.
_COSTS = os.environ.get("FLYLOCAL_TEST_COSTS")
if _COSTS is None or not os.path.isdir(_COSTS):
    _COSTS = tempfile.mkdtemp(prefix="flylocal-test-costs-")
    os.environ["FLYLOCAL_TEST_COSTS"] = _COSTS
    atexit.register(shutil.rmtree, _COSTS, True)
os.environ["FLYLOCAL_COSTS"] = _COSTS
os.environ["FLYLOCAL_CHATS"] = os.path.join(_COSTS, "chats")     # saved conversations: never the user's
os.environ.setdefault("FLYLOCAL_METADATA", os.path.join(_COSTS, "gguf-metadata.json"))   # what model files are: ditto
# Tests send Ctrl-C to the processes they start. A shell without job control starts a
# background job with SIGINT ignored, and an ignored signal stays ignored across exec, in every
# process the tests start: given back its default here, so that a suite run in the background
# tests what a terminal would.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# No network in tests: litellm fetches a price list at import unless told to use its own copy.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

# The suite runs on every core at once (pytest-xdist, `-n auto` in pyproject.toml): each worker
# is a machine of its own cores, a share of this one's. Pinned there, the worker and every
# process it starts see only those cores (llama.cpp's thread count, --threads auto, the busy
# checks of calibration), so two workers never run spinning llama.cpp threads on one core.
# The cores the suite was given are kept for the tests that need a choice of counts (all_cores).
ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pin_worker() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or workers < 2 or len(ALL_CORES) < 2:
        return
    index = int(worker[2:])
    if workers >= len(ALL_CORES):              # a core each, shared by turns when there are more workers
        share = [ALL_CORES[index % len(ALL_CORES)]]
    else:
        share = [c for i, c in enumerate(ALL_CORES) if i % workers == index]
    if share:
        os.sched_setaffinity(0, share)


_pin_worker()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core this process may run on (not per core the machine has)."""
    return max(1, len(ALL_CORES))

import pytest  # noqa: E402


@pytest.fixture
def all_cores():
    """The test runs on every core the suite was given (the other workers' tests keep running on
    theirs, so the machine is busy the way a desktop is); the worker's own share afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)

SMOL = "smollm2-135m-instruct"
SMOL_Q4_0 = "smollm2-135m-instruct-q4_0"
GEMMA = "gemma-3-270m"
GEMMA_Q8_0 = "gemma-3-270m-q8_0"


PROMPTS_FILE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "prompts.jsonl")


def prompt(pid: str) -> str:
    """The text of prompt `pid` in data/prompts.jsonl, the one file of prompts that tests,
    scripts and benchmarks share."""
    import json

    with open(PROMPTS_FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] == pid:
                return row["prompt"]
    raise KeyError(pid)


MODEL_FIXTURES = {"smol", "smol_draft", "gemma_q8", "gemma_q4km"}


def pytest_collection_modifyitems(items):
    """A test that uses a real-model fixture is slow, whether or not its module says so."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def model_path(name: str):
    from flylocal import models

    path = models.local_path(name)
    if not path.exists():
        pytest.fail(f"model {name} is missing: run scripts/setup.sh (or flylocal models fetch {name})")
    return path


def _runtime(name: str, n_ctx: int = 2048):
    from flylocal.llama.runtime import Runtime, RuntimeConfig

    rt = Runtime(model_path(name), RuntimeConfig(n_ctx=n_ctx))
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def smol():
    yield from _runtime(SMOL)


@pytest.fixture(scope="session")
def smol_draft():
    yield from _runtime(SMOL_Q4_0)


@pytest.fixture(scope="session")
def gemma_q8():
    yield from _runtime(GEMMA_Q8_0)


@pytest.fixture(scope="session")
def gemma_q4km():
    yield from _runtime(GEMMA)
