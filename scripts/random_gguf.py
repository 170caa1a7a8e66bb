#!/usr/bin/env python3
"""Write a llama-architecture GGUF of a given shape with random Q8_0 weights: a model whose
decode costs what a real one of that size costs, for cost curves and host-work figures only
(its text is noise). The default shape is Llama 3.2 1B's: 16 layers, width 2048, 32 heads (8 for
keys and values), feed-forward 8192, vocabulary 128,256; about 1.3 GB.

    .venv/bin/python scripts/random_gguf.py OUT.gguf [--layers 16] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BLOCK, BLOCK_BYTES = gguf.GGML_QUANT_SIZES[Q8_0]          # 32 weights in 34 bytes: an f16 scale, 32 int8


def q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 bytes for a [rows, cols] weight: scale 1/512, int8 weights uniform."""
    blocks = np.empty((rows, cols // BLOCK, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1 / 512).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, cols // BLOCK, BLOCK), dtype=np.uint8)
    return blocks.reshape(rows, cols // BLOCK * BLOCK_BYTES)


def write(path: str, layers: int, width: int, heads: int, kv_heads: int, ffn: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    head = width // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random-llama-{layers}x{width}")
    w.add_context_length(8192)
    w.add_block_count(layers)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    special = ["<unk>", "<s>", "</s>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581t{i}" for i in range(vocab - 259)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(vocab - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    ones = np.ones(width, dtype=np.float32)
    w.add_tensor("token_embd.weight", q8_0(rng, vocab, width), raw_dtype=Q8_0)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", q8_0(rng, width, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.attn_k.weight", q8_0(rng, kv_heads * head, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.attn_v.weight", q8_0(rng, kv_heads * head, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.attn_output.weight", q8_0(rng, width, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", q8_0(rng, ffn, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", q8_0(rng, ffn, width), raw_dtype=Q8_0)
        w.add_tensor(f"blk.{i}.ffn_down.weight", q8_0(rng, width, ffn), raw_dtype=Q8_0)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", q8_0(rng, vocab, width), raw_dtype=Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    write(args.out, args.layers, args.width, args.heads, args.kv_heads, args.ffn, args.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
