#!/usr/bin/env python3
"""Write a llama-architecture GGUF of a real model's shape whose decode costs what that model's
costs, and whose greedy next token is known: a model for cost curves and speed figures only
(its text is noise).

Every block's weights are zero (of the given quantization type: Q4_K_M's mix of Q4_K and Q6_K,
Q4_1 or Q8_0), so the residual stream carries the token's embedding unchanged to the output; a
matrix of zeros costs a GPU or a CPU what any other matrix of its type costs. The embedding and
the output layer (Q8_0) are random, built so that the argmax after token t is `successor[t]`:
a fixed cycle through the ordinary tokens, drawn from `--seed` (byte and control tokens lead
into it; no token leads to end-of-generation).

A draft model for that target is the same cycle with a share of it changed: with `--agree P`
(and the target's `--seed`) its next token is the target's for a fraction P of the tokens, fixed
per token, and another one elsewhere. Its drafts are then accepted token by token with
probability P, as a real draft's are at acceptance P: in flylocal and in llama-server alike.

Shapes (layers, width, heads, kv heads, feed-forward, vocabulary):
  llama-1b   16, 2048, 32, 8,  8192, 128256   (Llama 3.2 1B)
  llama-8b   32, 4096, 32, 8, 14336, 128256   (Llama 3.1 8B)
  smollm2    30,  576,  9, 3,  1536,  49152   (SmolLM2 135M; its rows of 576 take no K-quant)
  tiny        2,  256,  4, 2,   512,   4096   (for tests)

    python scripts/random_gguf.py OUT.gguf [--shape llama-1b] [--type Q4_K_M] [--seed 0] [--agree P] [--vocab N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
SHAPES = {"llama-1b": (16, 2048, 32, 8, 8192, 128256), "llama-8b": (32, 4096, 32, 8, 14336, 128256),
          "smollm2": (30, 576, 9, 3, 1536, 49152), "tiny": (2, 256, 4, 2, 512, 4096)}
TYPES = {"Q4_K_M": (T.Q4_K, T.Q6_K), "Q4_1": (T.Q4_1, T.Q4_1), "Q8_0": (T.Q8_0, T.Q8_0)}
FILE_TYPES = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
FIRST = 259                       # <unk>, <s>, </s> and the 256 byte tokens come first
CORPUS = Path(__file__).resolve().parent.parent / "data" / "spec_bench" / "question.jsonl"


def pieces(n: int) -> list[str]:
    """n ordinary tokens: every prefix of the commonest words of Spec-Bench's questions (with
    the word-start mark), commonest first, so that text tokenizes into about as many tokens as
    a real vocabulary of this size gives; then filler. The same for every model of one size."""
    text = " ".join(t for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()
                    for t in json.loads(line)["turns"]) if CORPUS.is_file() else ""
    words = [w for w, _ in Counter(re.findall(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]", text)).most_common()]
    out, seen = [], set()
    for word in ["\u2581"] + [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"] + words:
        for piece in [word] if len(word) == 1 else [("\u2581" + word)[: i + 1] for i in range(1, len(word) + 1)] + [word]:
            if piece not in seen and len(out) < n:
                seen.add(piece)
                out.append(piece)
    return out + [f"\u2581t{i}" for i in range(n - len(out))]


def zeros(kind: T, rows: int, cols: int) -> np.ndarray:
    """A [rows, cols] weight of zeros in `kind`'s blocks (each block's scale 0)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if cols % block:
        raise SystemExit(f"random_gguf: rows of {cols} take no {kind.name} (blocks of {block})")
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


def successor(vocab: int, seed: int, agree: float | None) -> np.ndarray:
    """[vocab] the greedy next token after each token: one cycle through the ordinary tokens,
    from the seed; with `agree`, the same for a fraction `agree` of the tokens and another
    ordinary token for the rest (a derangement among them, so that no two tokens share a next)."""
    rng = np.random.default_rng(seed)
    order = FIRST + rng.permutation(vocab - FIRST)
    nxt = np.empty(vocab, dtype=np.int64)
    nxt[order] = np.roll(order, -1)
    nxt[:FIRST] = order[rng.integers(0, len(order), FIRST)]
    if agree is not None:
        kept = np.random.default_rng([seed, 1]).random(vocab) < agree
        moved = np.flatnonzero(~kept[FIRST:]) + FIRST
        if len(moved) > 1:
            nxt[moved] = nxt[np.roll(moved, 1)]
    return nxt


def embeddings(rng: np.random.Generator, nxt: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_embd, output) as Q8_0 bytes: random rows e_t, and output row j = e_t of the
    ordinary token t that leads to j, so that e_t scores j = nxt[t] highest. A byte or control
    token's row is that of the ordinary token leading where it leads."""
    block, size = gguf.GGML_QUANT_SIZES[T.Q8_0]
    vocab = len(nxt)
    rows = np.empty((vocab, width // block, size), dtype=np.uint8)
    rows[:, :, :2] = np.frombuffer(np.float16(1 / 64).tobytes(), dtype=np.uint8)
    rows[:, :, 2:] = rng.integers(-127, 128, size=(vocab, width // block, block), dtype=np.int8).view(np.uint8)
    lead = np.empty(vocab, dtype=np.int64)           # lead[j]: the ordinary token whose next is j
    ordinary = np.arange(FIRST, vocab)
    lead[nxt[ordinary]] = ordinary
    rows[:FIRST] = rows[lead[nxt[:FIRST]]]
    out = np.zeros_like(rows)
    out[nxt[ordinary]] = rows[ordinary]
    return rows.reshape(vocab, -1), out.reshape(vocab, -1)


def more_bits(i: int, n: int) -> bool:
    """Whether Q4_K_M keeps block i's attn_v and ffn_down at Q6_K (llama.cpp's rule)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write(path: str, shape: str = "llama-1b", kind: str = "Q4_K_M", seed: int = 0, agree: float | None = None,
          vocab: int | None = None) -> None:
    layers, width, heads, kv_heads, ffn, vocab = SHAPES[shape][:5] + (vocab or SHAPES[shape][5],)
    low, high = TYPES[kind]
    head = width // heads
    nxt = successor(vocab, seed, agree)
    embd, output = embeddings(np.random.default_rng([seed, 2, width]), nxt, width)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{shape}-shaped successor model" + (f", agreeing {agree:g}" if agree is not None else ""))
    w.add_context_length(8192)
    w.add_block_count(layers)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(FILE_TYPES[kind])
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces(vocab - FIRST))
    w.add_token_scores([0.0] * FIRST + [float(len(p)) - i / vocab for i, p in enumerate(pieces(vocab - FIRST))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - FIRST))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    ones = np.ones(width, dtype=np.float32)
    kv = kv_heads * head
    same = {}                                        # one buffer per (type, shape): every block shares it
    def z(k, r, c):
        return same.setdefault((k, r, c), zeros(k, r, c))
    w.add_tensor("token_embd.weight", embd, raw_dtype=T.Q8_0)
    for i in range(layers):
        v = high if more_bits(i, layers) else low
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", z(low, width, width), raw_dtype=low)
        w.add_tensor(f"blk.{i}.attn_k.weight", z(low, kv, width), raw_dtype=low)
        w.add_tensor(f"blk.{i}.attn_v.weight", z(v, kv, width), raw_dtype=v)
        w.add_tensor(f"blk.{i}.attn_output.weight", z(low, width, width), raw_dtype=low)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", z(low, ffn, width), raw_dtype=low)
        w.add_tensor(f"blk.{i}.ffn_up.weight", z(low, ffn, width), raw_dtype=low)
        w.add_tensor(f"blk.{i}.ffn_down.weight", z(v, width, ffn), raw_dtype=v)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", output, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--type", choices=sorted(TYPES), default="Q4_K_M", dest="kind")
    ap.add_argument("--seed", type=int, default=0, help="the cycle of next tokens (a draft takes its target's)")
    ap.add_argument("--vocab", type=int, default=None, help="another vocabulary size than the shape's (a draft's must be its target's)")
    ap.add_argument("--agree", type=float, default=None,
                    help="a draft model: the share of tokens whose next token is the target's, 0..1")
    args = ap.parse_args()
    if args.agree is not None and not 0 <= args.agree <= 1:
        ap.error(f"--agree is a share between 0 and 1, not {args.agree}")
    if args.kind == "Q4_K_M" and SHAPES[args.shape][1] % 256:
        ap.error(f"{args.shape}'s rows of {SHAPES[args.shape][1]} take no K-quant: give --type Q4_1 or Q8_0")
    if args.vocab is not None and args.vocab <= FIRST + 1:
        ap.error(f"--vocab must exceed {FIRST + 1}")
    part = f"{args.out}.part"                        # the file appears whole, or not at all
    try:
        write(part, args.shape, args.kind, args.seed, args.agree, args.vocab)
        os.replace(part, args.out)
    except KeyboardInterrupt:
        return 130
    finally:
        if os.path.exists(part):
            os.remove(part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
