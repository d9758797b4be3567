"""Attention over a quantised cache's codes in one C++ kernel (`code_attention.cpp`).

A decoding token's attention reads every cached key and value once: what decides its time
is how many bytes it reads and what it does to each. In torch the integer caches had to
turn their codes into float32 first (a copy a chunk at a time, then float products), which
cost more than SDPA reading float32 outright; this kernel reads the codes as bytes, folds
the scales into the query and the weights, and keeps the softmax's partial sums
(flash-decoding's m, l, acc), so the full-precision sinks and tail merge in exactly.

It is built at first use with the machine's C++ compiler (`c++ -O3 -march=native
-ffast-math -fopenmp`, linked without fast math; about a second), into the kvcache cache
folder, keyed by the source's hash, and loaded with ctypes. Where it cannot be built (no
compiler, another CPU), `kernel()` is None, `NOTE` says why in one line, and the caches
keep their torch path;
`KVCACHE_CODE_ATTENTION=torch` asks for that path, to time one against the other.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("code_attention.cpp")
# fast math for vectorised sums (their order is free), but infinities kept: the softmax's
# running maximum starts at minus infinity.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp",
                 "-fPIC", "-std=c++17", "-c")
# Linked apart, without -ffast-math: with it the compiler links crtfastmath.o, whose
# constructor sets flush-to-zero for the whole process when the library loads, and every
# later float in Python (numpy's, hypothesis's) would lose its subnormals.
LINK_FLAGS = ("-shared", "-fopenmp")
NOTE: list[str] = []  # why the kernel is not in use, once it was asked for


def _folder() -> Path:
    root = os.environ.get("KVCACHE_CACHE") or Path.home() / ".cache" / "kvcache"
    return Path(root) / "kernels"


@cache
def kernel() -> ctypes.CDLL | None:
    """The built kernel, or None (and a line in NOTE) where it cannot be built here."""
    if os.environ.get("KVCACHE_CODE_ATTENTION") == "torch":  # to compare the two paths
        NOTE.append("attention over codes runs in torch: KVCACHE_CODE_ATTENTION=torch")
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        NOTE.append("attention over codes runs in torch: no C++ compiler (c++ or g++) found")
        return None
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
    digest = hashlib.sha256(SOURCE.read_bytes() + flags.encode()).hexdigest()[:16]
    library = _folder() / f"code_attention-{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name  # renamed whole, so no reader sees half a file
            compiled = Path(tmp) / "code_attention.o"
            run = subprocess.run([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(compiled)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                run = subprocess.run([compiler, *LINK_FLAGS, str(compiled), "-o", str(built)],
                                     capture_output=True, text=True)
            if run.returncode != 0:
                first = (run.stderr.strip().splitlines() or ["no message"])[0]
                NOTE.append(f"attention over codes runs in torch: {compiler} could not build "
                            f"{SOURCE.name} ({first})")
                return None
            os.replace(built, library)
    lib = ctypes.CDLL(str(library))
    lib.attend_codes.restype = ctypes.c_int
    lib.attend_codes.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 12 + \
        [ctypes.c_void_p] * 3
    return lib


def attend_codes(qr: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor,
                 v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, G: int,
                 per_channel: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax partial sums over the quantised tokens, for queries qr (B, nkv, g, hs) in
    float32, already scaled by 1 / sqrt(hs) (and rotated where the codes are):
    m, l (B, nkv, g) and acc (B, nkv, g, hs), with y = acc / l over these tokens alone.
    Codes (B, nkv, n, hs * bits / 8) uint8; key scales and zeros (B, nkv, n, hs / G) per
    token or (B, nkv, n / G, hs) per channel, value ones (B, nkv, n, hs / G), float16;
    each a view whose rows (the token axis) are contiguous."""
    B, nkv, g, hs = qr.shape
    n = k_codes.size(2)
    q = qr.contiguous()
    m = q.new_empty(B, nkv, g)
    l_sum = q.new_empty(B, nkv, g)
    acc = q.new_empty(B, nkv, g, hs)
    for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero):
        # rows of one (b, h) reached by one stride: true of the growing buffers' views
        assert t.stride(-1) == 1 and t.stride(0) == nkv * t.stride(1), t.stride()
    status = kernel().attend_codes(
        q.data_ptr(), k_codes.data_ptr(), k_scale.data_ptr(), k_zero.data_ptr(),
        v_codes.data_ptr(), v_scale.data_ptr(), v_zero.data_ptr(),
        k_codes.stride(1), v_codes.stride(1), k_scale.stride(1), v_scale.stride(1),
        B * nkv, n, g, hs, bits, G, int(per_channel), torch.get_num_threads(),
        m.data_ptr(), l_sum.data_ptr(), acc.data_ptr())
    if status:
        raise ValueError(f"attention over codes: {bits}-bit codes are not supported")
    return m, l_sum, acc
