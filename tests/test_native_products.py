"""The native products (`models/products.cpp`): a decode's few rows times int8, float16 and
float32 weights, each weight widened as it is read, equal to the float64 product of the
weights the module holds; used where they apply, torch's product everywhere else, and one
line where they cannot be built."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvcache_cli.models import linear
from kvcache_cli.models.linear import Int8Linear, Linear

if linear.products() is None:
    pytest.skip(linear.NOTE[-1], allow_module_level=True)

# A decode runs without gradients (the kernels have none; training keeps torch's product).
pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


def _linear(n_out: int, n_in: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("n_out, n_in", [(97, 64), (40, 70), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_equal_the_float64_product_of_the_held_weights(fmt, rows, n_out, n_in, bias):
    layer = _linear(n_out, n_in, bias)
    if fmt == "int8":
        layer = Int8Linear(layer)
        weight, b = layer.dequantized().double(), layer.bias
    else:
        with torch.no_grad():
            layer.weight.data = layer.weight.to(torch.float16 if fmt == "fp16" else torch.float32)
        weight, b = layer.weight.double(), layer.bias
    x = torch.randn(rows, n_in)
    want = x.double() @ weight.T + (0 if b is None else b.double())  # (rows, n_out)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n_out)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=0)


def test_only_a_decodes_rows_take_the_native_path(monkeypatch):
    calls = []
    real = linear._native_call
    monkeypatch.setattr(linear, "_native_call", lambda *a: calls.append(a) or real(*a))
    layer = _linear(48, 64, bias=True)
    for rows in (1, linear.NATIVE_MAX_ROWS, linear.NATIVE_MAX_ROWS + 1, 64):
        x = torch.randn(1, rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert [a[0].shape[:-1].numel() for a in calls] == [1, linear.NATIVE_MAX_ROWS]


def test_arranged_float32_weights_keep_the_rows_the_kernel_reads():
    from kvcache_cli.models import load_model

    model = load_model("stdlib-bytes").model
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, Linear))


def test_with_gradients_asked_for_the_product_is_torchs(monkeypatch):
    monkeypatch.setattr(linear, "_native_call", None)  # any use of it would raise
    layer = _linear(48, 64, bias=True)
    with torch.enable_grad():
        y = layer(torch.randn(1, 64))
    assert y.grad_fn is not None


def test_a_compiled_product_is_the_eager_one():
    layer = _linear(64, 96, bias=True)
    x = torch.randn(1, 1, 96)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=0, rtol=0)


@pytest.mark.parametrize("env, words", [({"KVCACHE_PRODUCTS": "torch"}, "KVCACHE_PRODUCTS"),
                                        ({"CXX": "/bin/false"}, "could not build")])
def test_without_the_kernel_products_run_in_torch_with_one_line(tmp_path, env, words):
    probe = ("from kvcache_cli.models import linear; assert linear.products() is None; "
             "print(linear.NOTE[-1])")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "KVCACHE_CACHE": str(tmp_path), **env})
    assert run.returncode == 0, run.stderr
    assert words in run.stdout and run.stdout.count("\n") == 1


@pytest.mark.parametrize("load", ["from kvcache_cli.models import linear as m; lib = m.products()",
                                  "from kvcache_cli.caches import code_attention as m; "
                                  "lib = m.kernel()"])
def test_loading_a_kernel_leaves_the_process_floats_subnormals(tmp_path, load):
    """A library linked with -ffast-math sets flush-to-zero for the whole process as it
    loads (crtfastmath); hypothesis, and any numpy user, would then see 1e-310 become 0."""
    probe = (f"import sys; {load}; assert lib is not None, m.NOTE; "
             "sys.exit(0 if 2.2250738585072014e-308 / 2 > 0 else 3)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "KVCACHE_CACHE": str(tmp_path)})
    assert run.returncode == 0, run.stderr


# Each build of the kernel: the CPU's own (AVX-512 here, where it has it), AVX2's lanes, and
# the plain loops a CPU without AVX2 runs; all three run on any machine that builds the first.
BUILDS = ["native", "-DPRODUCTS_AVX2", "-DPRODUCTS_SCALAR"]


@pytest.fixture(scope="module", params=BUILDS)
def build(request):
    if request.param == "native":
        return linear.products()
    lib, why = linear.load_products((request.param,))
    if lib is None:
        pytest.skip(f"no {request.param} build: {why}")
    return lib


def _held(fmt: str, n_out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight (n_out, n_in) in `fmt` and, for int8, its bfloat16 scales (n_out,)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        w = torch.randint(-128, 128, (n_out, n_in), generator=g, dtype=torch.int8)
        return w, (torch.rand(n_out, generator=g) + 0.5).to(torch.bfloat16)
    w = torch.randn(n_out, n_in, generator=g)
    return w.to(torch.float16 if fmt == "fp16" else torch.float32), None


def _product(lib, x, w, scales=None, bias=None, threads=1) -> torch.Tensor:
    """The kernel called as `linear._native_call` calls it, with a given library and threads."""
    R, K = x.shape
    N = w.shape[0]
    y = torch.full((R, N), float("nan"))
    at = [None if t is None else t.data_ptr() for t in (scales, bias)]
    if w.dtype == torch.int8:
        lib.product_int8(x.data_ptr(), w.data_ptr(), *at, y.data_ptr(), R, N, K, threads)
    else:
        fn = lib.product_f16 if w.dtype == torch.float16 else lib.product_f32
        fn(x.data_ptr(), w.data_ptr(), at[1], y.data_ptr(), R, N, K, threads)
    return y


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("n_in", [1, 7, 17, 100, 577])  # odd widths: a partial last chunk
@pytest.mark.parametrize("n_out", [1, 6, 37])  # no multiple of the 4-row tile, or of a lane
@pytest.mark.parametrize("bias", [False, True])
def test_every_build_equals_the_float64_product_at_any_width(build, fmt, n_in, n_out, bias):
    w, scales = _held(fmt, n_out, n_in, seed=n_in * n_out)
    b = torch.randn(n_out) if bias else None
    x = torch.randn(16, n_in, generator=torch.Generator().manual_seed(n_in))
    weight = w.double() * (1 if scales is None else scales.double()[:, None])
    want = x.double() @ weight.T + (0 if b is None else b.double())  # (16, n_out)
    got = _product(build, x, w, scales, b)
    # float32 sums of up to 577 terms, in another order than float64's: ~1e-7 of the
    # largest output each rounding; a wrong lane or a lost tail moves an output by a term.
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
def test_a_batchs_rows_are_each_rows_solo_product_bit_for_bit(build, fmt):
    """So a batched decode (serve) gives each sequence the tokens it gets alone."""
    w, scales = _held(fmt, 45, 131, seed=1)
    b = torch.randn(45)
    x = torch.randn(linear.NATIVE_MAX_ROWS, 131, generator=torch.Generator().manual_seed(2))
    solo = torch.cat([_product(build, x[r:r + 1], w, scales, b) for r in range(len(x))])
    for rows in range(1, linear.NATIVE_MAX_ROWS + 1):
        assert torch.equal(_product(build, x[:rows], w, scales, b), solo[:rows]), rows


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
def test_the_thread_split_changes_no_bit(fmt):
    w, scales = _held(fmt, 203, 96, seed=3)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    one = _product(linear.products(), x, w, scales)
    for threads in (2, 3, 7):
        assert torch.equal(_product(linear.products(), x, w, scales, threads=threads), one)


def test_no_byte_past_the_weights_or_the_rows_is_read(build):
    """The last chunk of a row is masked or copied, never loaded whole: a matrix and rows
    that end where their memory does (the page after each unreadable) multiply unfaulted."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    memory = mmap.mmap(-1, 4 * page)  # x's page, a guard, w's page, a guard
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    guards = (base + page, base + 3 * page)
    assert all(libc.mprotect(at, page, 0) == 0 for at in guards)  # PROT_NONE: reads fault
    try:
        buffer = torch.frombuffer(memory, dtype=torch.uint8)
        for fmt in ("fp32", "fp16", "int8"):
            w, scales = _held(fmt, 3, 21, seed=5)
            x = torch.randn(2, 21, generator=torch.Generator().manual_seed(6))
            w_bytes, x_bytes = w.numel() * w.element_size(), x.numel() * 4
            at_x = buffer[page - x_bytes:page].view(torch.float32).view(2, 21)
            at_w = buffer[3 * page - w_bytes:3 * page].view(w.dtype).view(3, 21)
            at_x.copy_(x), at_w.copy_(w)
            assert torch.equal(_product(build, at_x, at_w, scales), _product(build, x, w, scales))
        del buffer, at_x, at_w
    finally:
        for at in guards:
            libc.mprotect(at, page, 3)  # readable again before the map is closed
