"""--gpu-layers auto on made-up devices: what fits goes on the GPU, the target first."""

from __future__ import annotations

import pytest

from flylocal.llama import memory
from flylocal.llama.placement import ALL, NO_GPU, fit, place
from flylocal.gguf_info import Layout

MiB = 1 << 20
CTX, BATCH = 4096, 512


def layout(n_layer: int, layer_mib: float, output_mib: float = 100, n_vocab: int = 32000, kv_heads: int = 8) -> Layout:
    return Layout(n_layer=n_layer, layer_bytes=(int(layer_mib * MiB),) * n_layer, output_bytes=int(output_mib * MiB),
                  n_head=32, n_head_kv=kv_heads, key_width=128, value_width=128, n_vocab=n_vocab)


TARGET = layout(32, 200)          # a 7B-class model at about 4.5 bits: 6.4 GB of blocks
DRAFT = layout(22, 20, 60)        # a 1B-class draft


def whole(l: Layout, ctx: int = CTX) -> int:
    need = memory.need(memory.Shape(l.n_layer, l.n_head, l.n_head_kv, l.key_width, l.value_width, l.n_vocab, 0),
                       ctx, BATCH, True)
    return sum(l.layer_bytes) + l.output_bytes + need.kv + need.compute


def test_both_fit_and_go_whole_with_no_line():
    p = place(TARGET, DRAFT, CTX, BATCH, free=24 << 30, names=("t", "d"), device="RX 7900 XTX")
    assert (p.target, p.draft, p.line) == (ALL, ALL, None)
    assert p.reason.startswith("all: every layer of t and d on RX 7900 XTX") and "24.0 GiB free" in p.reason


def test_the_target_fits_the_draft_only_in_part_and_the_line_says_how_much():
    free = int((whole(TARGET) + whole(DRAFT) / 2) / memory.HEADROOM)
    p = place(TARGET, DRAFT, CTX, BATCH, free, names=("t", "d"))
    assert p.target == ALL and 0 < p.draft < DRAFT.n_layer
    assert p.line == p.reason.replace("partial: ", "--gpu-layers auto: ")
    assert f"every layer of t and {p.draft} of 22 layers of d on the GPU" in p.line and "the rest of d on the CPU" in p.line


def test_a_target_too_big_offloads_its_last_layers_that_fit_and_the_draft_stays_on_the_cpu():
    free = 3 << 30
    p = place(TARGET, DRAFT, CTX, BATCH, free, names=("t", "d"))
    assert p.draft == 0 and 0 < p.target < TARGET.n_layer
    f = fit(TARGET, CTX, BATCH, int(memory.HEADROOM * free))
    assert f.bytes <= memory.HEADROOM * free < f.bytes + 200 * MiB + whole(TARGET) // 1000   # one more would not fit
    assert f"{p.target} of 32 layers of t on the GPU" in p.line and "the rest and d on the CPU" in p.line


def test_layers_are_counted_from_the_end_as_llama_cpp_offloads_them():
    uneven = Layout(n_layer=4, layer_bytes=(50 * MiB, 50 * MiB, 50 * MiB, 400 * MiB), output_bytes=0, n_head=8,
                    n_head_kv=8, key_width=64, value_width=64, n_vocab=1000)
    # room for 3 small layers, but the last layer is the big one: none fits
    assert fit(uneven, 256, 32, 200 * MiB).blocks == 0
    assert fit(uneven, 256, 32, 430 * MiB).blocks == 1          # the big one, and no room for the next
    assert fit(uneven, 256, 32, 520 * MiB).blocks == 3


def test_a_longer_context_is_a_bigger_kv_cache_and_can_stop_a_model_fitting():
    free = int(whole(TARGET, 4096) / memory.HEADROOM) + MiB
    assert place(TARGET, None, 4096, BATCH, free).target == ALL
    longer = place(TARGET, None, 32768, BATCH, free)
    assert 0 < longer.target < TARGET.n_layer and longer.draft == 0


def test_no_gpu_means_no_layers_and_nothing_said():
    p = place(TARGET, DRAFT, CTX, BATCH, None)
    assert (p.target, p.draft, p.line, p.reason) == (0, 0, None, NO_GPU)


@pytest.mark.parametrize("given,want", [("auto", None), ("-1", -1), ("0", 0), ("12", 12)])
def test_gpu_layers_option(given, want):
    from flylocal.settings import GpuLayers

    assert GpuLayers().convert(given, None, None) == want


@pytest.mark.parametrize("given", ["-2", "many"])
def test_gpu_layers_out_of_range_is_refused(given):
    import click

    from flylocal.settings import GpuLayers

    with pytest.raises(click.BadParameter):
        GpuLayers().convert(given, None, None)


@pytest.mark.parametrize("tied", [False, True])
def test_the_layout_is_read_from_the_header_block_by_block(tmp_path, tied):
    import gguf
    import numpy as np

    from flylocal.gguf_info import read_layout

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    for i, width in enumerate((64, 64, 128)):           # the last block twice as big
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((width, 64), np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.zeros(64, np.float32))
    w.add_tensor("output_norm.weight", np.zeros(64, np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_layout(path)
    assert got.layer_bytes == (64 * 64 * 4 + 256, 64 * 64 * 4 + 256, 128 * 64 * 4 + 256)
    assert got.output_bytes == (4 if tied else 8) * 64 * 4 + 256      # tied: the embedding is the output
    assert (got.n_layer, got.n_head, got.n_head_kv, got.key_width, got.value_width, got.n_vocab) == (3, 4, 2, 16, 16, 4)
