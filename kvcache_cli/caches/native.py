"""C++ kernels built at first use with the machine's compiler and loaded with ctypes.

A kernel's source ships with the package; `build` compiles it (`c++ -O3 -march=native
-ffast-math -fopenmp`, about a second) into the kvcache cache folder, named by a hash of the
source, the flags, the compiler's version and what `-march=native` resolves to on this CPU
(`target`). The flag text alone is the same on every machine: a cache folder shared by two
(an NFS home, a copied container, a CI cache) would hand an AVX2 machine a library built
with AVX-512, and the process would die of an illegal instruction without a word. Plain C
arguments, no torch headers: nothing to install beyond a compiler. Where it cannot be built
(no compiler, a CPU without the instructions a source asks for), `build` returns None and
one line saying why, and the caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

# fast math for vectorised sums (their order is free), but infinities kept: a softmax's
# running maximum starts at minus infinity.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp",
                 "-fPIC", "-std=c++17", "-c")
# Linked apart, without -ffast-math: with it the compiler links crtfastmath.o, whose
# constructor sets flush-to-zero for the whole process when the library loads, and every
# later float in Python (numpy's, hypothesis's) would lose its subnormals.
LINK_FLAGS = ("-shared", "-fopenmp")


def folder() -> Path:
    root = os.environ.get("KVCACHE_CACHE") or Path.home() / ".cache" / "kvcache"
    return Path(root) / "kernels"


@cache
def target(compiler: str) -> str:
    """The compiler's version line and the instruction set `-march=native` selects here,
    as text: what a built library depends on beyond its source and flags. Two short runs of
    the compiler's driver (no compilation), once per process."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL)
    driver = subprocess.run([compiler, "-march=native", "-###", "-E", "-"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    # gcc passes the resolved CPU as -march=<cpu> and one -m<feature>/-mno-<feature> per
    # extension; clang as -target-cpu <cpu> and -target-feature +<f>/-<f>. Other words of
    # these lines (clang's working folder, temporary names) would key by where it ran.
    words = driver.stderr.replace('"', " ").split()
    chosen = [w for i, w in enumerate(words)
              if (w.startswith("-m") and w != "-march=native")
              or (i and words[i - 1] in ("-target-cpu", "-target-feature"))]
    if not chosen:  # a driver that does not say: the kernel's own list of the CPU's features
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        chosen = [line for line in lines if line.startswith(("flags", "Features"))][:1]
    head = (version.stdout.strip().splitlines() or [""])[0]
    return "\n".join([head, *chosen])


def text(source: Path) -> bytes:
    """The source's bytes and those of the files it includes by a path from its folder
    (`#include "name"`, `#include "../caches/name"`): a library is rebuilt when any of them
    changes."""
    own = source.read_bytes()
    named = re.findall(rb'^#include "([^"]+)"', own, flags=re.MULTILINE)
    return own + b"".join(text(source.parent / n.decode()) for n in named)


def library(source: Path, compiler: str, defines: tuple[str, ...] = ()) -> Path:
    """Where the library built from `source` by `compiler` for this CPU lives."""
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS + defines)
    key = text(source) + flags.encode() + target(compiler).encode()
    return folder() / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"


def build(source: Path, off: str, defines: tuple[str, ...] = ()
          ) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from `source`, None), or (None, why not, in one line). The
    environment variable `off` set to `torch` asks for the caller's torch path instead,
    to time one against the other. `defines`: -D flags a source reads (gguf_products.cpp's
    GGUF_SCALAR builds its plain loops, which a machine without AVX2 runs)."""
    if os.environ.get(off) == "torch":
        return None, f"{off}=torch"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++ or g++) found"
    path = library(source, compiler, defines)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name  # renamed whole, so no reader sees half a file
            compiled = Path(tmp) / f"{source.stem}.o"
            run = subprocess.run([compiler, *COMPILE_FLAGS, *defines, str(source), "-o",
                                  str(compiled)], capture_output=True, text=True)
            if run.returncode == 0:
                run = subprocess.run([compiler, *LINK_FLAGS, str(compiled), "-o", str(built)],
                                     capture_output=True, text=True)
            if run.returncode != 0:
                errors = [line for line in run.stderr.splitlines() if "error" in line]
                first = (errors or run.stderr.strip().splitlines() or ["no message"])[0]
                return None, f"{compiler} could not build {source.name} ({first.strip()})"
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    _loaded.append(lib)
    return lib, None


_loaded: list[ctypes.CDLL] = []  # every library `build` loaded: what `recorded` watches


@contextlib.contextmanager
def recorded(calls: list[tuple[Callable, tuple]]) -> Iterator[None]:
    """Every call into a built library made inside, appended to `calls` as (function, its
    arguments) as it runs: what a replayed decode step runs again (`generate.ReplayedDecode`).
    A library's functions are the ctypes objects it keeps as attributes once named (each
    module names its own when it loads them, to give their argument types), so each is
    shadowed by a recorder for the while, and the call sites stay as they are."""
    shadowed = []
    for lib in _loaded:
        for name, function in list(vars(lib).items()):
            if isinstance(function, lib._FuncPtr):
                setattr(lib, name, _recorder(function, calls))
                shadowed.append((lib, name, function))
    try:
        yield
    finally:
        for lib, name, function in shadowed:
            setattr(lib, name, function)


def _recorder(function: Callable, calls: list[tuple[Callable, tuple]]) -> Callable:
    def call(*args):
        calls.append((function, args))
        return function(*args)
    return call
