"""The `gguf` weight format's product: a GGUF's own blocks, multiplied as stored.

llama.cpp keeps a matrix as rows of blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 32 weights with
a float16 scale, and a minimum for the _1 types; the k-quants Q4_K, Q5_K, Q6_K: 256
weights with 6- or 8-bit scales per 16 or 32) and multiplies them where they lie. This
format does the same: every product whose tensors in the file are all of those types
(`as_stored`) keeps the file's bytes (one uint8 tensor per run of parts of one type, rows
as the file has them, but q and k of a Llama restored to transformers' order, which moves
whole rows and so whole blocks) and multiplies them with `gguf_products.cpp`: each block
unpacked in registers, its integers widened to float32 and multiplied with the float32 row.
That is the dequantised matrix's product to float32 rounding (llama.cpp instead rounds the
row to 8-bit blocks: faster integer sums, other numbers), so the greedy tokens are the
float model's.
The `gguf-q8` and `q8_0` formats run llama.cpp's numbers instead (`gguf_q8_products.cpp`:
the row rounded to Q8_0, Q8_1 or Q8_K blocks once a call, integer dots, float scales
after): `gguf-q8` on the file's blocks, `q8_0` on float weights rounded to Q8_0 blocks
(`gguf.q8_0`). Neither is exact to the float matrix; each is llama.cpp's product.
A prefill's many rows are a matrix product: the blocks are unpacked to float32 a slice of
rows at a time and torch multiplies them, in every format. Tensors of other types (F32,
F16, Q2_K, Q3_K) run as the float32 they were loaded as under `gguf` (`gguf-q8` refuses
them).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from kvcache_cli.models.linear import whole

# ggml's block types the kernel reads: (GGMLQuantizationType's number, weights a block,
# bytes a block), as gguf's GGML_QUANT_SIZES has them.
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
               "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
               "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}  # fmt: skip
SOURCE = Path(__file__).parents[1] / "gguf_products.cpp"
Q8_SOURCE = Path(__file__).parents[1] / "gguf_q8_products.cpp"  # llama.cpp's arithmetic
# A decode's rows, a batched one's included (as `linear.NATIVE_MAX_ROWS`): the kernel
# unpacks each block once per four rows, so more rows go to torch's matrix product over
# unpacked float32 slices.
DECODE_ROWS = 16
DEQUANTIZE_FLOATS = 1 << 21  # a prefill's slice of unpacked rows: 8 MiB of float32
_library: dict = {}  # source -> the loaded library (or None) and why not, once each


def load(defines: tuple[str, ...] = (), source: Path = SOURCE
         ) -> tuple[ctypes.CDLL | None, str | None]:
    """(the kernel library built from `source` with `defines`, None), or (None, why not)."""
    from kvcache_cli.caches import native

    lib, why = native.build(source, off="KVCACHE_PRODUCTS", defines=defines)
    if lib is not None:
        ptr, size, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        product = lib.gguf_product if source == SOURCE else lib.gguf_q8_product
        product.argtypes = [i32, ptr, ptr, ptr, size, size, size, size, i32]
        if source == SOURCE:
            lib.gguf_dequantize.argtypes = [i32, ptr, ptr, size, size, i32]
    return lib, why


def kernels(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The library BlockLinear calls (`SOURCE` for the exact product and every prefill,
    `Q8_SOURCE` for llama.cpp's), built at first use (None where it cannot be)."""
    if source not in _library:
        _library[source] = load(source=source)
    return _library[source][0]


def block_problem(name: str, device) -> str | None:
    """Why the `name` weight format's kernels cannot run here (one line), or None."""
    if torch.device(device).type != "cpu":
        return (f"{name} weights run on the CPU only (the native block products); got device "
                f"{torch.device(device).type}: use --device cpu")
    for source in (SOURCE, Q8_SOURCE) if name != "gguf" else (SOURCE,):
        if kernels(source) is None:
            return f"{name} weights need the native block products: {_library[source][1]}"
    return None


def gguf_problem(config, device, name: str = "gguf") -> str | None:
    """Why a model cannot run `--weights-dtype gguf` or `gguf-q8` (one line), or None;
    gguf-q8 takes only BLOCK_TYPES for the products (their types read from the file's
    header: the weights are not loaded)."""
    from kvcache_cli.models.gguf.as_stored import stored_types
    from kvcache_cli.models.linear import is_product

    if getattr(config, "gguf", None) is None:
        model = getattr(config, "name", "this model")
        return (f"{name} weights are the blocks of the GGUF a model was read from; {model} "
                "was not read from one (expected -m smollm2, -m gemma3 or a .gguf)")
    types = stored_types(config.gguf) if name == "gguf-q8" else {}
    for tensor, kind in sorted(types.items()):
        if is_product(tensor, config) and kind not in BLOCK_TYPES:
            return (f"gguf-q8 multiplies {', '.join(BLOCK_TYPES)} blocks; {tensor} is "
                    f"{kind} in {Path(config.gguf).name} (--weights-dtype gguf runs it)")
    return block_problem(name, device)


class BlockLinear(nn.Module):
    """A Linear whose (out, in) weight is a GGUF's blocks: parts of rows, one block type
    each (a fused product's q, k and v may be stored in different types). `fmt`: the
    weights format it runs, gguf (exact to the dequantised matrix) or gguf-q8 / q8_0
    (llama.cpp's arithmetic for a decode's rows)."""

    def __init__(self, parts: list[tuple[np.ndarray, str]], in_features: int,
                 fmt: str = "gguf", bias: Tensor | None = None):
        """parts: (blocks (rows, row bytes) uint8, their type), rows in order; a ValueError
        if a part's rows are not whole blocks of in_features (the kernel would read past
        them)."""
        super().__init__()
        for blocks, kind in parts:
            _, block, size = BLOCK_TYPES[kind]
            if in_features % block or blocks.shape[1] != in_features // block * size:
                raise ValueError(f"{kind} rows of {blocks.shape[1]:,} bytes are not "
                                 f"{in_features:,} inputs in blocks of {block}")
        self.in_features, self.format = in_features, fmt
        self.out_features = sum(blocks.shape[0] for blocks, _ in parts)
        self.types = [BLOCK_TYPES[kind][0] for _, kind in parts]
        self.kinds = [kind for _, kind in parts]
        for i, (blocks, _) in enumerate(parts):
            # Not in the state dict: a checkpoint holds float weights (`float_state`).
            self.register_buffer(f"blocks{i}", torch.from_numpy(np.array(blocks)),
                                 persistent=False)  # (rows, row bytes) uint8
        self.register_buffer("bias", bias)  # (out,) float32, or None

    def parts(self) -> list[Tensor]:
        # From the buffers' dict: as attributes each goes through nn.Module's __getattr__,
        # a Python call, for every part of every product of a step.
        buffers = self._buffers
        return [buffers[f"blocks{i}"] for i in range(len(self.types))]

    def forward(self, x: Tensor) -> Tensor:
        # Each cast, reshape or add a check, not a call, on a decode's float32 rows: each
        # call is an op to dispatch, a few µs, for every product of every step.
        rows = x if x.dtype == torch.float32 else x.float()  # (..., in)
        run = block_product if torch.compiler.is_compiling() else _product
        y = run(rows, self.parts(), self.types, self.format != "gguf")  # (..., out)
        bias = self._buffers["bias"]  # as `parts`
        y = y if bias is None else y + bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantized(self) -> Tensor:
        """The float32 weight its blocks hold, (out, in)."""
        return torch.cat([_unpacked(b, t, self.in_features) for b, t in
                          zip(self.parts(), self.types, strict=True)])


def _unpacked(blocks: Tensor, kind: int, K: int) -> Tensor:
    """(rows, K) float32: a part's blocks unpacked by the kernel."""
    out = torch.empty(blocks.shape[0], K)
    kernels().gguf_dequantize(kind, blocks.data_ptr(), out.data_ptr(), blocks.shape[0], K,
                              torch.get_num_threads())
    return out


def _product(x: Tensor, parts: list[Tensor], types: list[int], integer: bool) -> Tensor:
    """x (..., K) @ the parts' rows^T -> (..., N): a decode's few rows by the block kernel
    (`integer`: llama.cpp's, the row rounded to 8 bits), a prefill's many through float32
    slices of rows and torch's matrix product."""
    threads = torch.get_num_threads()
    product = kernels(Q8_SOURCE).gguf_q8_product if integer else kernels().gguf_product
    x = whole(x)
    K, N = x.shape[-1], sum(p.shape[0] for p in parts)
    R = x.numel() // K
    y = x.new_empty((*x.shape[:-1], N))
    at = 0
    for blocks, kind in zip(parts, types, strict=True):
        n = blocks.shape[0]
        if R <= DECODE_ROWS:  # written straight into its columns: rows N apart
            product(kind, x.data_ptr(), blocks.data_ptr(), y.data_ptr() + 4 * at, R, n, K,
                    N, threads)
        else:
            rows, out = x.view(R, K), y.view(R, N)
            step = max(1, DEQUANTIZE_FLOATS // K)
            for i in range(0, n, step):
                w = _unpacked(blocks[i:i + step], kind, K)  # (step, K)
                out[:, at + i:at + i + w.shape[0]] = rows @ w.t()
        at += n
    return y


@torch.library.custom_op("kvcache::block_product", mutates_args=())
def block_product(rows: Tensor, parts: list[Tensor], types: list[int], integer: bool) -> Tensor:
    """`_product` as one operator torch.compile keeps whole (eager calls skip its
    dispatch, as `linear.native_product`'s do)."""
    return _product(rows, parts, types, integer)


@block_product.register_fake
def _(rows: Tensor, parts: list[Tensor], types: list[int], integer: bool) -> Tensor:
    return rows.new_empty(*rows.shape[:-1], sum(p.size(0) for p in parts))
