"""The `q4` weight format: a GGUF's own 4-bit blocks run by torch's CPU int4 kernel.

llama.cpp's Q4_1 stores each run of 32 weights of a row as 4-bit integers q (0..15) with a
float16 scale d and minimum m: w = d*q + m; Q4_0 has no minimum: w = d*(q - 8). torch's
`_weight_int4pack_mm_for_cpu` computes with w = (q - 8)*s + z per group of 32 along the
input, so both map onto it block for block, with no rounding of q: Q4_1 as s = d,
z = m + 8d, Q4_0 as s = d, z = 0.

What is not exact, and why: the kernel is fast only with bfloat16 activations and
bfloat16 scales (one 576 -> 1,536 row product, 1 thread: 135 µs in bfloat16, 2,576 µs in
float32, 4,738 µs in float16), so d and m + 8d are rounded from float16's 11 significant
bits to bfloat16's 8: a weight moves by at most 2^-9 of |s*(q - 8)| + 2^-9 of |z|, under
1/32 of its block's step d where a fresh 4-bit rounding moves it by up to d/2. The row is
rounded to bfloat16 on the way in, as `linear.Int8Linear` does.

A tensor the file keeps at 8 bits (SmolLM2's token embedding, which is also its tied LM
head, is Q8_0: w = d*q8, q8 in -128..127) runs as two 4-bit planes of the same kernel, the
high and the low nibble of q8 + 128 = 16a + b: w = (a - 8)*16d + (b - 8)*d + 8d. That is
the file's numbers again (no re-quantising), read at 8 bits a weight plus two scales a
block, where llama.cpp reads its Q8_0 head. The embedding lookup keeps the float32 rows it
was loaded with (one row a step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvcache_cli.models.linear import Int4Linear, planes_of


def read_blocks(path: str | Path, names: set[str], n_head: int,
                n_kv: int) -> dict[str, tuple[np.ndarray, str]]:
    """transformers' name → (its raw blocks (out, bytes), GGUF type), for the names asked,
    rows of q and k restored to transformers' order (`reader._unpermute`): a block is
    one row's run of 32 inputs, so moving whole rows keeps every block."""
    from gguf import GGUFReader

    from kvcache_cli.models.gguf.reader import _unpermute, hf_name

    found = {}
    for t in GGUFReader(path).tensors:
        name = hf_name(t.name)
        if name not in names:
            continue
        blocks = np.asarray(t.data)  # (out, bytes)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            h = n_head if name.endswith("q_proj.weight") else n_kv
            hs = blocks.shape[0] // h
            blocks = _unpermute(blocks, h, hs)
        found[name] = (blocks, t.tensor_type.name)
    return found


def set_q4(model) -> None:
    """Every product of a Llama read from a GGUF, the LM head included, as Int4Linear
    built from the file's own blocks, in place (check_q4 has refused what it cannot); a
    fused product (`llama.FUSED`) from its parts' blocks, row after row."""
    from kvcache_cli.models.linear import Linear
    from kvcache_cli.models.llama import FUSED

    products = {name: (parent, child_name)
                for parent_name, parent in model.named_modules()
                for child_name, child in parent.named_children()
                if isinstance(child, Linear)
                for name in [f"{parent_name}.{child_name}".lstrip(".")]}
    # A tied head is the embedding's tensor in the file (llama.cpp's converter drops it).
    tied = model.config.tie_word_embeddings
    sources = {name: sources_of(name, tied, FUSED) for name in products}
    c = model.config
    blocks = read_blocks(c.gguf, {s for names in sources.values() for s in names},
                         c.n_head, c.n_kv_head)
    with torch.no_grad():
        for name, (parent, child_name) in products.items():
            parts = [planes_of(*blocks[source]) for source in sources[name]]
            setattr(parent, child_name, Int4Linear(_stacked(parts)))


def sources_of(product: str, tied: bool, fused: dict[str, tuple[str, ...]]) -> list[str]:
    """The file's tensors (transformers' names) whose rows make up a product."""
    if tied and product == "lm_head":
        return ["model.embed_tokens.weight"]
    for name, parts in fused.items():
        if product.endswith(f".{name}"):  # model.layers.N.<name>
            return [f"{product[:-len(name)]}{part}.weight" for part in parts]
    return [f"{product}.weight"]


def _stacked(parts: list[list[tuple[Tensor, Tensor]]]) -> list[tuple[Tensor, Tensor]]:
    """Several products' planes as one product's, rows after rows. A part with fewer
    planes (a Q4 tensor beside a Q8_0 one) gets planes that add nothing: q = 8 and s = z = 0."""
    planes = max(len(p) for p in parts)
    stacked = []
    for i in range(planes):
        qs, szs = [], []
        for part in parts:
            if i < len(part):
                q, sz = part[i]
            else:
                q, sz = torch.full_like(part[0][0], 8), torch.zeros_like(part[0][1])
            qs.append(q)
            szs.append(sz)
        stacked.append((torch.cat(qs), torch.cat(szs, dim=1)))  # (out, in), (in/32, out, 2)
    return stacked


