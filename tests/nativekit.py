"""What the tests of a native attention kernel share: its two builds as fixtures, and a
recorder of the torch ops a call dispatches."""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode


def kernel_fixtures(module):
    """The fixtures `lib` and `use` for a kernel module (`caches.code_attention`,
    `caches.paged`): `lib` the kernel as the caches load it, or its plain loops (built with
    -DCODE_ATTENTION_SCALAR), skipped where neither builds; `use` makes `module.kernel()`
    that build for one test. Bind both names in the test module: `lib, use = ...`."""

    @pytest.fixture(scope="module", params=["vector", "plain"])
    def lib(request):
        built, why = module.load(() if request.param == "vector" else
                                 ("-DCODE_ATTENTION_SCALAR",))
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
