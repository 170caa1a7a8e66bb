"""A context too big for the machine is refused in one line before llama.cpp allocates it
(flylocal.llama.memory); past the training context there is a warning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flylocal.llama import memory

# SmolLM2-135M: 30 layers, 9 heads, 3 KV heads of 64, a 49,152-token vocabulary.
SMOL = memory.Shape(n_layer=30, n_head=9, n_head_kv=3, key_width=64, value_width=64, n_vocab=49152,
                    model_bytes=100 << 20)
MiB = 1 << 20


def test_the_estimate_matches_what_llama_cpp_reported():
    """llama.cpp's own figures for SmolLM2-135M, n_batch 512: KV cache 22.5 KiB a cell; compute
    buffers 98 MiB at 4K cells and 142 MiB at 128K with flash attention, 2,566 MiB without. The
    estimate may be above them, by little, never below by much."""
    assert memory.need(SMOL, 1, 512, True).kv == 30 * 3 * 128 * 2
    for n_ctx, flash, reported in ((4096, True, 98.25), (131072, True, 141.5), (131072, False, 2566.4),
                                   (32768, False, 646.4)):
        got = memory.need(SMOL, n_ctx, 512, flash).compute / MiB
        assert 0.97 * reported <= got <= 1.15 * reported, (n_ctx, flash, got)


def test_a_context_that_does_not_fit_is_one_line_with_the_largest_that_does():
    available = 8 << 30
    problem = memory.check(SMOL, 1 << 20, 512, True, "smol.gguf", available=available)
    assert problem and "\n" not in problem
    assert problem.startswith("--ctx 1048576 needs about 23.2 GiB") and "KV cache 22.5 GiB" in problem
    assert "8.0 GiB is available" in problem
    fits = int(problem.rsplit(" ", 1)[1])
    assert fits % 256 == 0
    assert memory.need(SMOL, fits, 512, True).total <= memory.HEADROOM * available
    assert memory.need(SMOL, fits + 256, 512, True).total > memory.HEADROOM * available
    assert memory.check(SMOL, fits, 512, True, "smol.gguf", available=available) is None
    # without flash attention the scores grow with the context too: a smaller context fits
    slow = memory.check(SMOL, 1 << 20, 512, False, "smol.gguf", available=available)
    assert int(slow.rsplit(" ", 1)[1]) < fits
    tiny = memory.check(SMOL, 4096, 512, True, "smol.gguf", available=50 << 20)
    assert tiny.endswith("not even a small context fits")


def test_offloaded_layers_are_checked_against_the_gpu():
    plenty = 64 << 30
    assert memory.check(SMOL, 1 << 16, 512, True, "m", available=plenty, gpu_share=1.0, gpu_free=8 << 30) is None
    problem = memory.check(SMOL, 1 << 20, 512, True, "m", available=plenty, gpu_share=1.0, gpu_free=8 << 30)
    assert problem and "GPU memory" in problem and "--gpu-layers" in problem


def test_what_a_model_holds_follows_its_offloaded_layers():
    """/api/ps's size and size_vram (flylocal.llama.memory.held): the whole need, of which the
    offloaded share of the weights and cache is on the GPU, none on a CPU build."""
    need = memory.need(SMOL, 4 * 1024, 512, True)
    assert memory.held(SMOL, 1024, 512, True, slots=4) == (need.total, 0)
    for share in (0.25, 0.5, 1.0):
        total, vram = memory.held(SMOL, 1024, 512, True, share, slots=4)
        assert total == need.total and vram == int((need.kv + need.model) * share) < total


@pytest.mark.slow
def test_generate_with_a_context_no_machine_holds_is_one_line():
    done = subprocess.run([sys.executable, "-m", "flylocal", "generate", "--ctx", str(1 << 26), "--max-tokens", "2",
                           "hi"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flylocal: error: --ctx {1 << 26} needs about ")
    assert "the largest --ctx that fits is" in lines[0]


@pytest.mark.slow
def test_a_context_past_the_training_one_is_one_warning():
    done = subprocess.run([sys.executable, "-m", "flylocal", "generate", "--ctx", "16384", "--max-tokens", "2", "hi"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--ctx 16384 is past the 8192 tokens smollm2-135m-instruct.gguf was trained on" in done.stderr
