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
    assert [a[0].shape[0] for a in calls] == [1, linear.NATIVE_MAX_ROWS]


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
