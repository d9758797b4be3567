"""C++ kernels built at first use with the machine's compiler and loaded with ctypes.

A kernel's source ships with the package; `build` compiles it (`c++ -O3 -march=native
-ffast-math -fopenmp`, about a second) into the kvcache cache folder, keyed by the source's
and the flags' hash, so a rebuilt source or another CPU's flags never load a stale
library. Plain C arguments, no torch headers: nothing to install beyond a compiler. Where
it cannot be built (no compiler, a CPU without the instructions a source asks for), `build`
returns None and one line saying why, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
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


def build(source: Path, off: str) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from `source`, None), or (None, why not, in one line). The
    environment variable `off` set to `torch` asks for the caller's torch path instead,
    to time one against the other."""
    if os.environ.get(off) == "torch":
        return None, f"{off}=torch"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++ or g++) found"
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS)
    digest = hashlib.sha256(source.read_bytes() + flags.encode()).hexdigest()[:16]
    library = folder() / f"{source.stem}-{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name  # renamed whole, so no reader sees half a file
            compiled = Path(tmp) / f"{source.stem}.o"
            run = subprocess.run([compiler, *COMPILE_FLAGS, str(source), "-o", str(compiled)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                run = subprocess.run([compiler, *LINK_FLAGS, str(compiled), "-o", str(built)],
                                     capture_output=True, text=True)
            if run.returncode != 0:
                errors = [line for line in run.stderr.splitlines() if "error" in line]
                first = (errors or run.stderr.strip().splitlines() or ["no message"])[0]
                return None, f"{compiler} could not build {source.name} ({first.strip()})"
            os.replace(built, library)
    return ctypes.CDLL(str(library)), None
