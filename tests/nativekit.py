"""What the tests of a native attention kernel share: its builds as fixtures, and a
recorder of the torch ops a call dispatches."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

CPUINFO = Path("/proc/cpuinfo")
# A kernel's builds: the CPU's own (its vector path: AVX-512's lanes or AVX2's), AVX2's lanes
# where the CPU has AVX-512 (elsewhere that is the CPU's own build again), and the plain
# loops a CPU without AVX2 runs.
BUILDS = {"vector": (), "plain": ("-DCODE_ATTENTION_SCALAR",)}
FLAGS = CPUINFO.read_text() if CPUINFO.exists() else "avx512bw avx2"
if "avx512bw" in FLAGS:
    BUILDS["avx2"] = ("-DCODE_ATTENTION_AVX2",)
VECTOR_PATH = "avx2" in FLAGS  # where the builds but "plain" run the vector code


def keys_in_words(build: str, bits: int, per_channel: bool, hs: int, G: int) -> bool:
    """Whether `build` multiplies these keys in integers (`code_attention_simd.h`'s
    `word_dots`), the query rounded to 16-bit words: the vector builds, for 8-bit per-token
    keys in groups of 32 at head sizes 64 and 128, and 8- or 4-bit per-channel ones at 64,
    128 and 256."""
    if build == "plain" or not VECTOR_PATH:
        return False
    if per_channel:
        return hs in (64, 128, 256) and bits in (8, 4)
    return hs in (64, 128) and bits == 8 and G == 32


def values_in_words(build: str, bits: int, hs: int, G: int) -> bool:
    """Whether `build` multiplies these values in integers (`code_attention_simd.h`'s
    `word_values`), the softmax's weights times each group's scale rounded to 16-bit words on
    one step a block of tokens: the vector builds, for 4-bit values in groups of a multiple
    of 32 channels, 1, 2, 4 or 8 groups a token."""
    return (build != "plain" and VECTOR_PATH and bits == 4 and G % 32 == 0 and hs % G == 0
            and hs // G in (1, 2, 4, 8))


def kernel_fixtures(module):
    """The fixtures `lib` and `use` for a kernel module (`caches.code_attention`,
    `caches.paged`): `lib` each of the kernel's BUILDS, skipped where it does not build; `use`
    makes `module.kernel()` that build for one test. Bind both names in the test module:
    `lib, use = ...`."""

    @pytest.fixture(scope="module", params=list(BUILDS))
    def lib(request):
        built, why = module.load(BUILDS[request.param])
        if built is None:
            pytest.skip(why)
        return built

    @pytest.fixture
    def use(lib, monkeypatch):
        monkeypatch.setattr(module, "kernel", lambda: lib)

    return lib, use


class Ops(TorchDispatchMode):
    """The torch ops dispatched under it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
