"""The `q8_0` weight format: the float weights rounded to Q8_0 blocks exactly as llama.cpp's
quantiser rounds them, multiplied in llama.cpp's arithmetic (`gguf_q8_products.cpp`).

Q8_0 is 32 weights a block, 32 int8 integers and one float16 scale d: ggml-quants.c's
quantize_row_q8_0_ref takes amax = max |w| of the block, d = amax / 127 and q = roundf(w / d)
(w times the float32 1 / d, ties away from zero), all in float32, and stores d as float16.
`llama_model_quantize` writes a Q8_0 file so, so the blocks here are the bytes of a Q8_0
GGUF written from the same weights (tests/test_gguf_q8.py compares them), and a decode's
product is llama.cpp's on that file: the row rounded to Q8_0 too, integer dots, d_w d_x
after. The token embedding is rounded the same way in place (llama.cpp looks its rows up
in the Q8_0 file), so the model is llama.cpp's Q8_0 model, not the float one: it is like
for like with `bench`'s llama.cpp-q8_0 mode, where `int8` (one scale a row) is not.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache_cli.models.gguf.blocks import BlockLinear, block_problem

BLOCK = 32
ROWS_AT_ONCE = 4096  # rows rounded together: bounds the float32 temporaries (Gemma 3's head)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """(rows, K) float32, K a multiple of 32 -> (rows, K / 32 * 34) uint8: Q8_0 blocks."""
    rows, K = w.shape
    out = np.empty((rows, K // BLOCK, 2 + BLOCK), np.uint8)
    for at in range(0, rows, ROWS_AT_ONCE):
        x = np.ascontiguousarray(w[at:at + ROWS_AT_ONCE], np.float32).reshape(-1, K // BLOCK,
                                                                             BLOCK)
        d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)  # (r, K/32, 1)
        inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        v = x * inverse  # (r, K/32, 32) float32
        whole = np.trunc(v)
        q = whole + np.sign(v) * (np.abs(v - whole) >= 0.5)  # roundf: ties away from zero
        out[at:at + len(x), :, :2] = d.astype(np.float16).view(np.uint8)
        out[at:at + len(x), :, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """(rows, K / 32 * 34) uint8 Q8_0 blocks -> (rows, K) float32: q d, exact in float32."""
    raw = blocks.reshape(blocks.shape[0], -1, 2 + BLOCK)
    d = raw[..., :2].copy().view(np.float16).astype(np.float32)  # (rows, K/32, 1)
    return (raw[..., 2:].view(np.int8).astype(np.float32) * d).reshape(blocks.shape[0], -1)


def q8_0_problem(config, device) -> str | None:
    """Why a model cannot run `--weights-dtype q8_0` (one line), or None: every product's
    input width a whole number of blocks of 32, and the kernels built, on the CPU."""
    c = config
    widths = {"hidden size": c.n_embd, "query width": c.n_head * c.head_size,
              "MLP width": getattr(c, "intermediate", 4 * c.n_embd)}
    for what, n in widths.items():
        if n % BLOCK:
            return (f"q8_0 weights need the {what} a multiple of {BLOCK} (Q8_0's block); "
                    f"this model's is {n}")
    return block_problem("q8_0", device)


def set_q8_0(model) -> None:
    """Every product (the LM head included) as a BlockLinear of Q8_0 blocks rounded from
    its float weights, and the token embedding rounded alike, in place."""
    from kvcache_cli.models.linear import Linear

    embedding = model.embedding.weight
    table = None  # the embedding's blocks, where the tied head made them
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            w = child.weight.detach().float().contiguous().numpy()  # (out, in)
            blocks = quantize_q8_0(w)
            table = blocks if child.weight is embedding else table
            bias = None if child.bias is None else child.bias.detach().float().clone()
            setattr(parent, child_name,
                    BlockLinear([(blocks, "Q8_0")], w.shape[1], "q8_0", bias))
    if table is None:
        table = quantize_q8_0(embedding.detach().float().contiguous().numpy())  # (vocab, ..)
    with torch.no_grad():
        embedding.copy_(torch.from_numpy(dequantize_q8_0(table)).to(embedding.dtype))
