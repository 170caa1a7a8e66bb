"""Gemma 3 (vocab 262,144) at --ctx 8192 with prompt lookup stays far below a full logits buffer.

A full n_ctx x n_vocab float32 buffer alone would be 8 GiB; flylocal asks llama.cpp for logits
only on the rows it verifies. Peak RSS is deterministic enough for a ceiling with wide margin.
"""

import pytest
import re
import subprocess
import sys
from pathlib import Path

from conftest import GEMMA, model_path

pytestmark = pytest.mark.slow     # every test here loads a real model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "memory.py"


def test_gemma_8k_context_peak_rss_under_1_5_gib():
    model_path(GEMMA)
    done = subprocess.run([sys.executable, str(SCRIPT), "--target", GEMMA, "--ctx", "8192", "--max-tokens", "32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    mib = float(re.search(r"peak RSS (\d+) MiB", done.stdout).group(1))
    assert 100 < mib < 1536, done.stdout
