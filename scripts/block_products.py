"""One pass of a decode step's products alone, per integer weight format: ours beside ggml's.

    python scripts/block_products.py smollm2 --threads 2,1 --repeats 9
    python scripts/block_products.py gemma3 --formats gguf-q8

Every product matrix of the model once (the LM head included), one row, in three kernels:
ours (`gguf_q8_products.cpp`, the format's blocks), ggml's own (the installed llama.cpp's
row rounding and vec_dot, called a weight row at a time, the rows split among the threads as
ggml splits them, in chunks) on the same blocks, and the float16 product (`products.cpp`)
of the same matrices as the yardstick a step's time is read against. Each pass's time is a
median of interleaved repeats (A B C A B C ...) in one process, so a busy machine slows
them alike; the figures are bytes read a second and each pass's time over float16's.
ggml's x86 build repacks Q4_0 and Q4_K into rows of 8 where llama.cpp loads a model
(`ggml-cpu/repack.cpp`); this calls the plain vec_dot, which is what its other types run.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from kvcache_cli.caches import native  # noqa: E402
from kvcache_cli.models import load_model, set_weights_dtype  # noqa: E402
from kvcache_cli.models.gguf import blocks  # noqa: E402
from kvcache_cli.models.gguf.blocks import Q8_SOURCE, BlockLinear  # noqa: E402
from kvcache_cli.models.linear import load_products  # noqa: E402

# ggml's rounding of the row and its vec_dot a weight row at a time (ggml-cpu.h's type
# traits), the rows split among the threads in contiguous chunks.
GGML_ROWS = r"""
#include <cstddef>
#include <cstdint>
#include <vector>
typedef void (*from_float_t)(const float*, void*, int64_t);
typedef void (*vec_dot_t)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
extern "C" void ggml_rows(void* from_float, void* vec_dot, const float* x, const uint8_t* w,
                          int64_t N, int64_t K, int64_t row_bytes, float* y, int threads) {
    static std::vector<uint8_t> rounded(1 << 20);
    reinterpret_cast<from_float_t>(from_float)(x, rounded.data(), K);
    const vec_dot_t dot = reinterpret_cast<vec_dot_t>(vec_dot);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n)
        dot(static_cast<int>(K), y + n, 0, w + n * row_bytes, 0, rounded.data(), 0, 1);
}
"""


class Traits(ctypes.Structure):  # ggml-cpu.h's ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


def ggml_kernels():
    """(the llama.cpp CPU library, our row loop over its vec_dot)."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    ggml = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_cpu_init()
    ggml.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    source = Path(tempfile.mkdtemp()) / "ggml_rows.cpp"
    source.write_text(GGML_ROWS)
    loop, why = native.build(source, off="KVCACHE_PRODUCTS")
    if loop is None:
        sys.exit(f"cannot build the ggml row loop: {why}")
    p, i = ctypes.c_void_p, ctypes.c_int64
    loop.ggml_rows.argtypes = [p, p, p, p, i, i, i, p, ctypes.c_int]
    return ggml, loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--formats", default="q8_0,gguf-q8")
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(args.model).model
    matrices = {}  # format -> [(blocks (rows, row bytes) uint8, ggml type, K)]
    for fmt in args.formats.split(","):
        converted = set_weights_dtype(copy.deepcopy(model), fmt)
        matrices[fmt] = [(part, kind, m.in_features) for m in converted.modules()
                         if isinstance(m, BlockLinear) for part, kind in zip(m.parts(), m.types)]
    halves = [m.weight.detach().half().contiguous() for m in model.modules()
              if isinstance(m, torch.nn.Linear)]  # (out, in) float16 each
    ours, floats = blocks.kernels(Q8_SOURCE), load_products()[0]
    ggml, loop = ggml_kernels()
    rows = {}  # K -> one row (1, K)
    y = torch.empty(1 << 20)

    def row(K: int) -> torch.Tensor:
        return rows.setdefault(K, torch.randn(1, K))

    def f16_pass(threads: int) -> None:
        for w in halves:
            floats.product_f16(row(w.shape[1]).data_ptr(), w.data_ptr(), None, y.data_ptr(), 1,
                               w.shape[0], w.shape[1], threads)

    def our_pass(fmt: str, threads: int) -> None:
        for part, kind, K in matrices[fmt]:
            ours.gguf_q8_product(kind, row(K).data_ptr(), part.data_ptr(), y.data_ptr(), 1,
                                 part.shape[0], K, part.shape[0], threads)

    def ggml_pass(fmt: str, threads: int) -> None:
        for part, kind, K in matrices[fmt]:
            traits = ggml.ggml_get_type_traits_cpu(kind).contents
            from_float = ggml.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float
            loop.ggml_rows(from_float, traits.vec_dot, row(K).data_ptr(), part.data_ptr(),
                           part.shape[0], K, part.shape[1], y.data_ptr(), threads)

    passes = {"float16": (sum(w.numel() * 2 for w in halves), f16_pass)}
    for fmt, parts in matrices.items():
        size = sum(part.numel() for part, _, _ in parts)
        passes[f"{fmt} ours"] = (size, lambda t, f=fmt: our_pass(f, t))
        passes[f"{fmt} ggml"] = (size, lambda t, f=fmt: ggml_pass(f, t))
    for threads in (int(t) for t in args.threads.split(",")):
        times = {name: [] for name in passes}
        for _, run in passes.values():
            run(threads)  # warm: the libraries built, the pages touched
        for _ in range(args.repeats):
            for name, (_, run) in passes.items():
                start = time.perf_counter()
                run(threads)
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["float16"])
        print(f"{args.model}, {threads} thread(s), medians of {args.repeats} interleaved passes")
        for name, (size, _) in passes.items():
            t = statistics.median(times[name])
            print(f"  {name:14s} {size / 1e6:7.1f} MB {t * 1e3:8.2f} ms "
                  f"{size / t / 1e9:6.2f} GB/s  {t / base:5.2f}x float16's time")
    print(f"load average while it ran: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
