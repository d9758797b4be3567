"""How the matrices of a model's products are stored: every `--weights-dtype`.

`Linear` (float, stored in the order its one-row product reads fastest), `Int8Linear`
(int8, one scale per output channel) and `Int4Linear` (a GGUF's own 4-bit blocks); the
checks that refuse a format before weights load, and the switch between formats.

A decode step reads every weight once and does almost no arithmetic, so how a format is
stored, and how its product is shared among threads, decides how fast the weights stream:
each choice below (the float layout, the split product, the native products for a decode's
few rows, int8's bfloat16 activations) was made on timings, which docs/bench.md keeps with
the machine and the date they were taken on ("The weight layout", "The products, native").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.models.base import FamilyConfig, FamilyModel


class Linear(nn.Linear):
    """nn.Linear whose weight may be stored (in, out), splitting its products by thread.

    A decode's few rows (float32, on the CPU, no gradient) go to the native products
    (`products.cpp`: each output a dot product over one contiguous (out, in) weight row,
    float16 widened as it is read), which stream the weights faster than any layout below;
    what follows is the torch path, for prefills and where the kernel cannot be built.

    A decode step multiplies one row by every weight matrix: it reads each weight once and
    does almost no arithmetic, so its speed is how fast the weights stream from memory, and
    that depends on the order they are stored in and on how the product is shared among
    threads. In float32 on the CPU the weights are stored (in, out), as Hugging Face's
    Conv1D keeps them (`arrange_weights`), and with several threads the product runs one
    block of output columns per thread as one batched matmul: MKL gives a one-row product a
    single core, which cannot pull the bandwidth two can. Half precision keeps nn.Linear's
    (out, in) and its plain product, which already uses every thread and is there the faster
    order. Either way the parameter keeps its (out, in) shape and its name; only its strides
    differ, so state dicts and checkpoints are as before.

    The split serves any number of rows, not only one: a batched decode step (`serve`)
    is a few-row product, and F.linear on the (in, out) weight gives those rows far less
    bandwidth. The timings of each layout, thread count and row count: docs/bench.md.
    """

    threads = 1  # the thread count a compiled forward splits for (`pin_threads`)

    def forward(self, x: Tensor) -> Tensor:
        # The parameters read from their dict: as attributes each goes through nn.Module's
        # __getattr__, a Python call, and a decode step runs some 120 products.
        params = self._parameters
        w = params["weight"]  # (out, in); stored (in, out) when its first stride is 1
        bias = params["bias"]
        if native_rows(x) and w.dtype in NATIVE_FLOATS and w.is_contiguous():
            return native_product(x, w, None, bias)
        if w.dtype != x.dtype:  # a weight format of its own (set_weights_dtype)
            return self.forward(x.to(w.dtype)).to(x.dtype)
        if x.device.type != "cpu":
            return F.linear(x, w, self.bias)
        # Under torch.compile, asking for the thread count would break the graph at every
        # layer: there the count pinned before compiling (`pin_threads`) is a constant.
        compiling = torch.compiler.is_compiling()
        n = self.threads if compiling else torch.get_num_threads()
        N, K = w.shape
        if n < 2 or N < n or w.stride(0) != 1:
            return F.linear(x, w, self.bias)
        cols = N // n * n  # n equal blocks; the few columns left over go on their own
        # (n, K, N/n) and (n, 1, N/n): views, kept between eager calls
        blocks, bias = self._split(n, cols) if compiling else self._blocks(n, cols)
        rows = x.reshape(1, -1, K).expand(n, -1, K)  # (n, R, K): every row, once per block
        if compiling:  # the product kept whole: the compiler would write it as a loop
            y = blocked_product(rows, blocks, bias)
        else:  # the bias added by the product itself (baddbmm): one op fewer a layer
            y = torch.bmm(rows, blocks) if bias is None else torch.baddbmm(bias, rows, blocks)
        y = y.transpose(0, 1).reshape(*x.shape[:-1], cols)  # (..., cols): the blocks in order
        if cols < N:
            rest = F.linear(x, w[cols:], None if self.bias is None else self.bias[cols:])
            y = torch.cat([y, rest], dim=-1)  # (..., N)
        return y

    def _split(self, n: int, cols: int) -> tuple[Tensor, Tensor | None]:
        """The weight and bias cut into n column blocks, as views."""
        K = self.weight.shape[1]
        blocks = self.weight.t()[:, :cols].view(K, n, cols // n).transpose(0, 1)  # (n, K, N/n)
        bias = None if self.bias is None else self.bias[:cols].view(n, 1, cols // n)
        return blocks, bias

    def _blocks(self, n: int, cols: int) -> tuple[Tensor, Tensor | None]:
        """`_split`'s views, made once per thread count and storage: a decode step calls
        49 products, and four view ops each cost more dispatch than they are worth."""
        w = self.weight
        key = (n, w.data_ptr(), None if self.bias is None else self.bias.data_ptr())
        if getattr(self, "_block_key", None) != key:
            self._block_key, self._block_views = key, self._split(n, cols)
        return self._block_views


@torch.library.custom_op("kvcache::blocked_product", mutates_args=())
def blocked_product(rows: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
    """(n, R, K) @ (n, K, N/n) (+ bias (n, 1, N/n)) -> (n, R, N/n): `Linear`'s split
    product as one operator torch.compile cannot see into. Inductor writes a bmm of one
    row on the CPU as its own multiply-and-sum loop, several times slower than MKL's bmm,
    which made the compiled decode step slower than eager (docs/bench.md has the figures);
    called opaque, it is MKL's."""
    return torch.bmm(rows, blocks) if bias is None else torch.baddbmm(bias, rows, blocks)


@blocked_product.register_fake
def _(rows: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
    return rows.new_empty(rows.size(0), rows.size(1), blocks.size(2))


NATIVE_FLOATS = (torch.float32, torch.float16)  # the float weights the native products read

# The native products serve decode-sized inputs, a batched decode's included; a prefill's
# many rows are a matrix product, which MKL does better than a dot product a row. Where the
# two cross was measured at 1 to 32 rows ("The products, native" in docs/bench.md).
NATIVE_MAX_ROWS = 16
PRODUCTS_SOURCE = Path(__file__).with_name("products.cpp")
NOTE: list[str] = []  # why the native products are not in use, once asked for
_products: list = []  # the loaded library (or None), once: read by every forward


def products():
    """The native product library (`products.cpp`, built at first use), or None with a line
    in NOTE: no compiler, or KVCACHE_PRODUCTS=torch."""
    if not _products:
        lib, why = load_products()
        if lib is None:
            NOTE.append(f"products run in torch: {why}")
        _products.append(lib)
    return _products[0]


def load_products(defines: tuple[str, ...] = ()):
    """(the product library built with `defines`, None), or (None, why not): -DPRODUCTS_AVX2
    keeps an AVX-512 CPU to AVX2's lanes, -DPRODUCTS_SCALAR to plain loops (what a CPU
    without AVX2 builds), so one machine checks every path."""
    import ctypes

    from kvcache_cli.caches import native

    lib, why = native.build(PRODUCTS_SOURCE, off="KVCACHE_PRODUCTS", defines=defines)
    if lib is not None:
        ptr, size = ctypes.c_void_p, ctypes.c_int64
        lib.product_int8.argtypes = [ptr] * 5 + [size] * 3 + [ctypes.c_int]
        for name in ("product_f16", "product_f32"):
            getattr(lib, name).argtypes = [ptr] * 4 + [size] * 3 + [ctypes.c_int]
    return lib, why


def native_rows(x: Tensor) -> bool:
    """Whether x's rows go to the native products: float32 rows on the CPU, a decode's
    few, no gradient asked for (the kernel has none: training keeps torch's product), the
    library built (loaded when weights were arranged or quantised)."""
    # x.is_cpu, not x.device.type: a decode step asks some 240 times, and building the
    # device object costs several times the flag.
    return (x.is_cpu and x.dtype == torch.float32 and bool(_products)
            and _products[0] is not None and not torch.is_grad_enabled()
            and x.numel() <= NATIVE_MAX_ROWS * x.shape[-1])


def native_product(x: Tensor, w: Tensor, scales: Tensor | None, bias: Tensor | None) -> Tensor:
    """x (..., K) @ w (N, K)^T (times bfloat16 scales (N,)) (+ bias): the native kernel,
    one op that torch.compile keeps whole."""
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    # Eager calls skip the custom op's dispatch (tens of µs, a fifth of a small product's
    # time) and the reshapes around it; a compiled graph needs the op to keep the call whole.
    if not torch.compiler.is_compiling():
        return _native_call(x, w, scales, bias)
    y = _native(x.reshape(-1, x.shape[-1]), w, scales, bias)  # (R, N)
    return y.view(*x.shape[:-1], w.shape[0])


def _native_call(x: Tensor, w: Tensor, scales: Tensor | None, bias: Tensor | None) -> Tensor:
    """x (..., K) @ w (N, K)^T -> (..., N): the rows as they lie, one kernel call (the
    library loaded: `native_rows` said so)."""
    lib = _products[0]
    x = whole(x)
    K, N = x.shape[-1], w.shape[0]
    y = x.new_empty((*x.shape[:-1], N))
    R = x.numel() // K
    scales_at = None if scales is None else scales.data_ptr()
    bias_at = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if w.dtype == torch.int8:
        lib.product_int8(x.data_ptr(), w.data_ptr(), scales_at, bias_at, y.data_ptr(),
                         R, N, K, threads)
    else:
        fn = lib.product_f16 if w.dtype == torch.float16 else lib.product_f32
        fn(x.data_ptr(), w.data_ptr(), bias_at, y.data_ptr(), R, N, K, threads)
    return y


def whole(t: Tensor) -> Tensor:
    """t, contiguous: a decode's wrappers check rather than call, since contiguous() on a
    contiguous tensor still costs a call through torch's Python binding."""
    return t if t.is_contiguous() else t.contiguous()


# A decode step makes some 270 outputs for its native calls: each as t.new_empty(shape),
# or torch.empty_like(t) where the shape is t's (contiguous t only: it keeps t's strides).
# torch.empty(shape, dtype=t.dtype, device=t.device) costs about twice as much, most of it
# in building t.device, a Python object, each call (measured per call in one process).


@torch.library.custom_op("kvcache::native_product", mutates_args=())
def _native(rows: Tensor, w: Tensor, scales: Tensor | None, bias: Tensor | None) -> Tensor:
    return _native_call(rows, w, scales, bias)


@_native.register_fake
def _(rows: Tensor, w: Tensor, scales: Tensor | None, bias: Tensor | None) -> Tensor:
    return rows.new_empty(rows.size(0), w.size(0))


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 with one scale per output channel (gpt-fast's
    weight-only scheme): w ≈ weight_int8 * scales[:, None].

    A decode's few rows go to the native product (`products.cpp`: the int8 row widened in
    registers, float32 sums, the row's scale after the sum); otherwise the product is
    `torch.ops.aten._weight_int8pack_mm`, which reads the int8 weight once and scales each
    output column, so a decode step streams a quarter of float32's bytes. Its activations
    are bfloat16 whatever the model's dtype: with float32 ones the kernel is many times
    slower than the float32 product itself (docs/bench.md); the row is cast in and the
    result cast back, which costs nothing next to the weight. The kernel
    needs the input width to be a multiple of 16 (other widths give wrong numbers or
    crash), which `check_weights_dtype` asks before a model loads.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        products()  # built or refused now, before any forward reads it
        w = linear.weight.detach().float()  # (out, in)
        # Symmetric, one scale per output channel: the largest |w| of each row maps to 127.
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)  # (out, in)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight", q.contiguous())  # (out, in): the kernel's order
        self.register_buffer("scales", scales.to(torch.bfloat16))  # (out,)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if native_rows(x):
            return native_product(x, self.weight, self.scales, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (R, in)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)  # (R, out)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)  # (..., out)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The float32 weight this module computes with, (out, in)."""
        return self.weight.float() * self.scales.float()[:, None]


def arrange_weights(model: FamilyModel) -> FamilyModel:
    """Store every Linear weight in the order its one-row product reads fastest.

    (out, in) where the native products run (`products`: each output a dot product over
    one contiguous weight row); without them (in, out) for float32 on the CPU, (out, in)
    otherwise: the figures that decided it are in `Linear`'s docstring. Shapes, names and
    values are unchanged; the tied embedding follows the LM head (a lookup reads one
    strided row, which costs nothing). Then every weight moves into memory the kernel may
    back with 2 MiB pages (`huge_pages.gather`), which a step streams faster.
    """
    from kvcache_cli.models import fused, huge_pages

    fused.library()  # the small ops a decode's rows fuse, built now, before any forward
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear):
                w = module.weight
                in_out = (w.device.type == "cpu" and w.dtype == torch.float32
                          and products() is None)
                w.data = w.t().contiguous().t() if in_out else w.contiguous()
    return huge_pages.gather(model)


def pin_threads(model: FamilyModel) -> FamilyModel:
    """Fix the thread count the products split for, before torch.compile traces them: the
    compiled graph holds it as a constant (it would break at every layer asking torch)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.threads = torch.get_num_threads()
    return model


# How the matrices of the products may be stored. A float format other than the
# model's dtype keeps activations, norms and cache in the model's dtype and casts the
# one row in and out of each product; int8 is `Int8Linear`; q4 is a GGUF's own 4-bit
# blocks (`Int4Linear`, packed two to a byte), for a Llama read from one; gguf is the
# file's blocks of every type as stored (`gguf.blocks.BlockLinear`, bytes), for any
# family read from one; gguf-q8 the same blocks in llama.cpp's arithmetic (the row rounded
# to 8 bits, integer dots); q8_0 the float weights rounded to Q8_0 blocks as llama.cpp's
# quantiser rounds them, run by the same integer dots (`gguf.q8_0`), for any model.
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "int8": torch.int8, "q4": torch.quint4x2, "gguf": torch.uint8,
                 "gguf-q8": torch.uint8, "q8_0": torch.uint8}  # fmt: skip


def is_product(tensor: str, config) -> bool:
    """Whether a GGUF-read tensor (transformers' name) is a product's matrix: a projection,
    the head, or the embedding where the head is tied to it."""
    return tensor.endswith("proj.weight") or tensor == "lm_head.weight" or (
        tensor == "model.embed_tokens.weight" and config.tie_word_embeddings)


def check_weights_dtype(name: str, config: FamilyConfig, device: str | torch.device,
                        source_types: dict[str, str] | None = None) -> None:
    """Refuse, before any weights load, a weight format this model or device cannot run.
    source_types: the GGUF type each tensor was stored in, for a model read from a GGUF
    (q4 runs only those blocks)."""
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weights dtype {name!r}; expected {', '.join(WEIGHT_DTYPES)}")
    if name in ("gguf", "gguf-q8", "q8_0"):
        from kvcache_cli.models.gguf.blocks import gguf_problem
        from kvcache_cli.models.gguf.q8_0 import q8_0_problem

        problem = (q8_0_problem(config, device) if name == "q8_0"
                   else gguf_problem(config, device, name))
        if problem:
            raise ValueError(problem)
        return
    if name not in ("int8", "q4"):
        return
    kernel = "_weight_int8pack_mm" if name == "int8" else "_weight_int4pack_mm_for_cpu"
    if torch.device(device).type != "cpu":
        raise ValueError(f"{name} weights run on the CPU only (torch's {kernel}); "
                         f"got device {torch.device(device).type}: use --device cpu")
    if not hasattr(torch.ops.aten, kernel):
        raise ValueError(f"{name} weights need torch's {kernel} (torch >= "
                         f"{'2.3' if name == 'int8' else '2.6'}); this is torch "
                         f"{torch.__version__}")
    if name == "q4":
        problem = q4_problem(config, source_types)
        if problem:
            raise ValueError(problem)
        return
    if config.n_embd % 16:
        raise ValueError(f"int8 weights need n_embd a multiple of 16 (the int8 kernel's "
                         f"block); this model's is {config.n_embd}")


def set_weights_dtype(model: FamilyModel, name: str) -> FamilyModel:
    """Store every product's matrix (the LM head included) in `name`, a float format or
    int8, in place (q4 reads a GGUF's blocks: `models.set_weights_dtype` dispatches).

    The tied LM head gets a copy of its own in the new format; the token embedding stays
    in the model's dtype, where a lookup reads one row of it per step.
    """
    dtype = WEIGHT_DTYPES[name]
    if dtype == model.dtype:
        return model
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear):
                continue
            if dtype == torch.int8:
                setattr(parent, child_name, Int8Linear(child))
                continue
            tied = child.weight is model.embedding.weight
            weight = child.weight.detach().to(dtype)
            child.weight = nn.Parameter(weight.clone() if tied else weight, requires_grad=False)
            if child.bias is not None:
                child.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
    return arrange_weights(model)


def weights_format(model: FamilyModel) -> str:
    """The name in WEIGHT_DTYPES of how the model's product matrices are stored."""
    from kvcache_cli.models.gguf.blocks import BlockLinear

    block = next((m for m in model.modules() if isinstance(m, BlockLinear)), None)
    if block is not None:
        return block.format
    head = model.lm_head
    if isinstance(head, Int4Linear):
        return "q4"
    dtype = torch.int8 if isinstance(head, Int8Linear) else head.weight.dtype
    return next(name for name, d in WEIGHT_DTYPES.items() if d == dtype)


def float_state(model: FamilyModel) -> dict[str, Tensor]:
    """Every weight as float32, nn.Linear's (out, in) order, under its parameter name:
    what the model computes with, int8 matrices dequantised (for export to GGUF)."""
    from kvcache_cli.models.gguf.blocks import BlockLinear

    packed = tuple(f".{kind}{i}" for kind in ("packed", "scales") for i in range(2))
    state = {name: t.detach().float() for name, t in model.state_dict().items()
             if not name.endswith((".scales", *packed))}  # fmt: skip
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear | Int4Linear | BlockLinear):
            state[f"{name}.weight"] = module.dequantized()
    model.checkpoint_names(state)
    return state


GROUP = 32  # weights per block: GGUF's Q4_0/Q4_1/Q8_0 block, the kernel's group size


BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types q4 runs without re-quantising


class Int4Linear(nn.Module):
    """A bias-free Linear whose (out, in) weight is one or two planes of 4-bit groups:
    w = sum over planes of (q - 8) * s + z, s and z one pair per group of 32 inputs."""

    def __init__(self, planes: list[tuple[Tensor, Tensor]]):
        """planes: (q (out, in) int32 in 0..15, scales_and_zeros (in/32, out, 2) float32)."""
        super().__init__()
        self.out_features, self.in_features = planes[0][0].shape
        for i, (q, sz) in enumerate(planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            self.register_buffer(f"packed{i}", packed)  # (out, in/2) uint8: two q a byte
            self.register_buffer(f"scales{i}", sz.to(torch.bfloat16).contiguous())
        self.planes = len(planes)

    def forward(self, x: Tensor) -> Tensor:
        rows = whole(x).view(-1, self.in_features).to(torch.bfloat16)  # (R, in)
        y = None
        for i in range(self.planes):
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, getattr(self, f"packed{i}"), GROUP, getattr(self, f"scales{i}"))
            y = part.float() if y is None else y + part.float()  # (R, out)
        y = y.view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if x.dtype == torch.float32 else y.to(x.dtype)  # a check: no op to dispatch

    def dequantized(self) -> Tensor:
        """The float32 weight this module computes with, (out, in)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # (in, in): one input each
        w = None
        for i in range(self.planes):
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, getattr(self, f"packed{i}"), GROUP, getattr(self, f"scales{i}")).float()
            w = part if w is None else w + part  # (in, out)
        return w.t().contiguous()


def planes_of(blocks: np.ndarray, kind: str) -> list[tuple[Tensor, Tensor]]:
    """A GGUF tensor's raw blocks, (out, in/32 * block bytes) uint8, as Int4Linear planes."""
    out = blocks.shape[0]
    if kind == "Q8_0":  # 2-byte d, 32 int8
        raw = blocks.reshape(out, -1, 34)  # (out, in/32, 34)
        d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, in/32)
        q8 = raw[..., 2:].view(np.int8).astype(np.int32) + 128  # (out, in/32, 32) in 0..255
        s = torch.from_numpy(d)
        hi, lo = torch.from_numpy(q8 >> 4), torch.from_numpy(q8 & 15)
        return [(hi.reshape(out, -1), _scales_and_zeros(16 * s, torch.zeros_like(s))),
                (lo.reshape(out, -1), _scales_and_zeros(s, 8 * s))]
    if kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"q4 runs {', '.join(BLOCK_TYPES)} blocks, not {kind}")
    head = 4 if kind == "Q4_1" else 2  # d (and m), float16 each
    raw = blocks.reshape(out, -1, head + 16)  # (out, in/32, block bytes)
    scalars = raw[..., :head].copy().view(np.float16).astype(np.float32)  # (out, in/32, 1|2)
    qs = raw[..., head:]  # (out, in/32, 16): weight j in the low nibble, j + 16 in the high
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)  # (out, in/32, 32)
    d = torch.from_numpy(scalars[..., 0])
    z = torch.from_numpy(scalars[..., 1]) + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return [(torch.from_numpy(q).reshape(out, -1), _scales_and_zeros(d, z))]


def _scales_and_zeros(s: Tensor, z: Tensor) -> Tensor:
    """(out, groups) scales and zeros as the kernel reads them, (groups, out, 2)."""
    return torch.stack([s.t(), z.t()], dim=-1)


def q4_problem(config, types: dict[str, str] | None) -> str | None:
    """Why a model cannot run q4 (one line), or None: it must come from a GGUF whose
    product tensors are all blocks of 32 that the int4 kernel can take."""
    if getattr(config, "gguf", None) is None or types is None:
        name = getattr(config, "name", "this model")
        return (f"q4 weights are a GGUF's own 4-bit blocks; {name} was not read from a "
                "GGUF file (expected -m smollm2, -m gemma3 or a .gguf)")
    c = config
    widths = {"hidden size": (c.n_embd, GROUP), "MLP width": (c.intermediate, GROUP),
              "vocabulary": (c.vocab_size, 16), "KV width": (c.n_kv_head * c.head_size, 16),
              "query width": (c.n_head * c.head_size, GROUP)}
    for what, (n, multiple) in widths.items():
        if n % multiple:  # the kernel's packing: rows in 16s, inputs in groups of 32
            return (f"q4 weights need the {what} a multiple of {multiple} (torch's int4 "
                    f"packing); this model's is {n}")
    for name, kind in sorted(types.items()):
        if is_product(name, config) and kind not in BLOCK_TYPES:
            return (f"q4 runs {', '.join(BLOCK_TYPES)} blocks without re-quantising; "
                    f"{name} is {kind} in {Path(config.gguf).name}")
    return None
