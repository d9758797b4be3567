"""serve's quantised pools: paged-int8/int4/fp8 blocks behind the same bind/update as
`PagedCache`, their bytes, and `kvcache serve --kv-dtype` beside the fp32 pool."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.caches.quantized_pool import make_pool, pool_block_bytes
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig, to_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head width 64, as GPT-2's and the trained checkpoint's.
CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=128)


def model() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).eval()


@pytest.mark.parametrize("kind", ["paged-int8", "paged-int4", "paged-fp8"])
def test_a_quantised_pool_decodes_rows_of_different_lengths_like_one_row_each(kind):
    m = model()
    pool = make_pool(kind, CONFIG.cache_shape, 1 << 20, 4, m.device, m.dtype)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)  # (B, T)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]])  # (B, blocks)
    with torch.no_grad():
        pool.bind(table[:1])
        alone = m(idx[:1, :6], 0, pool)[:, -1]  # (1, vocab): row 0 prefilled alone
        pool.bind(table[1:])
        m(idx[1:, :9], 0, pool)  # row 1 prefilled to 9 positions
        pool.bind(table)
        both = m(torch.stack([idx[0, 6], idx[1, 8]])[:, None], torch.tensor([6, 9]), pool)
        pool.bind(table[:1])
        again = m(idx[:1, 6:7], 6, pool)[:, -1]  # row 0's step alone, same blocks
    # Row 0 read the same codes alone and batched: what it sees does not depend on row 1.
    torch.testing.assert_close(both[0, -1], again[0], rtol=1e-4, atol=1e-4)
    assert alone.shape == (1, CONFIG.vocab_size)


def test_an_int8_pool_holds_over_3_6_times_the_tokens_of_float32():
    fp32 = pool_block_bytes("paged", CONFIG.cache_shape, 16, torch.float32)
    int8 = pool_block_bytes("paged-int8", CONFIG.cache_shape, 16, torch.float32)
    # 64 one-byte codes + a float16 scale and zero, for each of K and V, per head and token.
    assert int8 == 2 * 2 * 16 * 2 * (64 + 4) and fp32 / int8 > 3.6
    pool = make_pool("paged-int8", CONFIG.cache_shape, 100 * int8 + 5, 16, "cpu", torch.float32)
    assert pool.bytes_held == 100 * int8


def test_serve_kv_dtype_runs_quantised_pools_in_the_same_memory(tmp_path):
    to_hf(model()).save_pretrained(tmp_path / "tiny")
    out = CliRunner().invoke(app, [
        "serve", "--model", str(tmp_path / "tiny"), "--weights", "pretrained", "--device",
        "cpu", "--requests", "6", "--prompt-len", "8:24", "--output-len", "4:12",
        "--shared-prefix", "0", "--kv-mem", "96KiB", "--block-size", "4", "--engines", "paged",
        "--kv-dtype", "int8,int4,fp8", "--policy", "prefill-first", "--json"])
    assert out.exit_code == 0, out.output
    # One policy: each pool is one row, named for its engine and policy.
    engines = {e["engine"].removesuffix(" pf"): e for e in json.loads(out.stdout)["engines"]}
    assert list(engines) == ["paged", "paged-int8", "paged-int4", "paged-fp8"]
    held = {name: e["pool_tokens"] for name, e in engines.items()}
    assert held["paged-int8"] >= 3.6 * held["paged"] and held["paged-int4"] > held["paged-int8"]
    assert all(e["kv_reserved_bytes"] <= 96 << 10 for e in engines.values())
    assert engines["paged"]["preemptions"] >= engines["paged-int8"]["preemptions"]


def test_serve_refuses_an_unknown_kv_dtype_in_one_line():
    out = CliRunner().invoke(app, ["serve", "--kv-dtype", "int3"])
    assert out.exit_code == 2
    assert "error: --kv-dtype 'int3': expected int8, int4, fp8" in out.output
