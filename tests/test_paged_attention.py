"""caches/paged_attention.cpp: a serving step's one-token rows read their blocks in place.

The kernel against a float64 reference of the same attention (each row's blocks gathered
through its table, softmax(q.k / sqrt(hs)) v over the slots it sees), on each of its paths
(the vector readers with AVX-512's lanes and with AVX2's, and the plain loops, built with
-DCODE_ATTENTION_SCALAR): block sizes 16 and 32 and an odd 5, ragged lengths, GQA groups of
1 to 9 queries, head sizes 64 and 256, sliding windows, float32/float16/bfloat16 pools. Then
each caller of `attend_in_place`
against the same step gathered and run through SDPA: `PackedRows` and `PaddedRows` (decodes
alone, first, and interleaved with prompt chunks), `PagedCache.attend`'s decode step (one
start, a start a row) and a `HybridPool`'s (per-group tables, a sliding window); greedy
tokens of `paged:b16` against `static` (a tiny Llama, a tiny Gemma 3), and the ops a step
saves."""

from __future__ import annotations

import pytest
import torch
from gemmakit import random_gemma3
from nativekit import kernel_fixtures
from torch.profiler import ProfilerActivity, profile

from kvcache_cli.caches import make_cache, paged
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.paged import PackedRows, PaddedRows, PagedCache
from kvcache_cli.caches.quantized_pool import QuantPagedCache
from kvcache_cli.caches.step import Step
from kvcache_cli.generate import generate
from kvcache_cli.models.llama import Llama, LlamaConfig, init_random
from kvcache_cli.serving.hybrid_blocks import Group
from kvcache_cli.serving.hybrid_pool import HybridPool

lib, use = kernel_fixtures(paged)


def scattered(nkv, n_blocks, bs, hs, dtype, seed=0):
    """A pool layer (nkv, n_blocks, bs, hs) of random keys and values."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(nkv, n_blocks, bs, hs, generator=g).to(dtype) for _ in range(2))
    return k, v


def reference(q, k, v, table, first, last):
    """(nh, B1, hs) float64: row r's query over slots first[r] .. last[r] of its blocks."""
    nh, rows, hs = q.shape
    nkv, _, bs, _ = k.shape
    out = torch.empty(nh, rows, hs, dtype=torch.float64)
    for r in range(rows):
        keys = k[:, table[r]].flatten(1, 2).double()[:, first[r] : last[r] + 1]  # (nkv, n, hs)
        values = v[:, table[r]].flatten(1, 2).double()[:, first[r] : last[r] + 1]
        keys = keys.repeat_interleave(nh // nkv, 0)  # (nh, n, hs): head i reads i // g
        values = values.repeat_interleave(nh // nkv, 0)
        s = (q[:, r, None].double() @ keys.transpose(1, 2))[:, 0] / hs**0.5  # (nh, n)
        out[:, r] = s.softmax(-1)[:, None].matmul(values)[:, 0]
    return out


@pytest.mark.parametrize("bs", [16, 32, 5])
@pytest.mark.parametrize(("nh", "nkv", "hs"), [(9, 3, 64), (4, 1, 256), (2, 2, 64),
                                               (9, 1, 64), (3, 3, 24)])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_each_row_reads_its_own_blocks_like_a_float64_reference(use, bs, nh, nkv, hs, window):
    lengths = [1, 2, 15, 16, 17, 33, 100, 301]  # tokens held, ragged around the block sizes
    width = -(-max(lengths) // bs)
    n_blocks = len(lengths) * width + 3
    k, v = scattered(nkv, n_blocks, bs, hs, torch.float32)
    # Each row's blocks drawn from anywhere in the pool, in no order.
    table = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(1))
    table = table[: len(lengths) * width].view(len(lengths), width)  # (B1, width)
    last = torch.tensor(lengths) - 1  # (B1,): the query at the last position
    first = last * 0 if window is None else (last - window + 1).clamp(min=0)
    q = torch.randn(nh, len(lengths), hs, generator=torch.Generator().manual_seed(2))
    out = torch.full_like(q, float("nan"))
    paged.attend_paged(q, k, v, table, first, last, out)
    torch.testing.assert_close(out.double(), reference(q, k, v, table, first, last),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_pool_is_widened_as_it_is_read(use, dtype):
    nkv, nh, hs, bs = 3, 9, 64, 16
    k, v = scattered(nkv, 40, bs, hs, dtype)
    table = torch.arange(40).flip(0).view(4, 10)  # (4, 10)
    last = torch.tensor([0, 37, 100, 159])
    q = torch.randn(nh, 4, hs)
    out = torch.empty_like(q)
    paged.attend_paged(q, k, v, table, last * 0, last, out)
    torch.testing.assert_close(out.double(), reference(q, k, v, table, last * 0, last),
                               atol=2e-5, rtol=1e-4)


def test_a_row_past_its_table_is_refused_not_read(use):
    k, v = scattered(1, 4, 16, 64, torch.float32)
    q = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="past its block table"):
        paged.attend_paged(q, k, v, torch.tensor([[0, 1]]), torch.tensor([0]),
                           torch.tensor([32]), torch.empty_like(q))
    with pytest.raises(ValueError, match="outside the pool's 4 blocks"):
        paged.attend_paged(q, k, v, torch.tensor([[0, 9]]), torch.tensor([0]),
                           torch.tensor([20]), torch.empty_like(q))


def step_through(pool, starts, lengths, nh, layers=1):
    """Every layer's `PackedRows.attend` output of one step (1, nh, N, hs), its keys written
    first."""
    pos = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, lengths)])  # (N,)
    view = PackedRows(pool, starts, lengths, pos)
    g = torch.Generator().manual_seed(5)
    nkv, hs, N = pool.k.size(1), pool.k.size(-1), len(pos)
    step = Step(pos[:1], pos[None], view.last)
    out = []
    for layer in range(layers):
        q = torch.randn(1, N, nh, hs, generator=g).transpose(1, 2)  # (1, nh, N, hs), a view
        k, v = (torch.randn(1, nkv, N, hs, generator=g) for _ in range(2))
        out.append(view.attend(layer, q, k, v, step))
    return out


def random_pool(pool, rows: int, width: int, seed: int, groups: int = 0):
    """pool with random keys and values, bound to random tables (rows, width): each row's
    blocks anywhere in the pool, in no order; one table per group where groups."""
    gen = torch.Generator().manual_seed(seed)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    n_blocks = pool.k.size(2)
    tables = [torch.randperm(n_blocks, generator=gen)[: rows * width].view(rows, width)
              for _ in range(max(groups, 1))]
    pool.bind(torch.stack(tables) if groups else tables[0])  # ([groups,] rows, width)
    return pool


def in_place_equals_gathered(pool, monkeypatch, run):
    """run() (a list of outputs) on the pool as it is, every row gathered, then again from
    the same pool in place: the same outputs within float32 rounding, and the same
    `length` and `bytes_copied`; the kernel called in place only."""
    saved = pool.k.clone(), pool.v.clone()
    read, runs, calls = paged.attend_paged, [], []  # calls: in place or not, per kernel call
    for in_place in (False, True):
        monkeypatch.setattr(paged, "reads_in_place", lambda pool, q, on=in_place: on)
        monkeypatch.setattr(paged, "attend_paged",
                            lambda *a, on=in_place: calls.append(on) or read(*a))
        pool.k.copy_(saved[0])
        pool.v.copy_(saved[1])
        pool.reset()
        runs.append((run(), pool.length, pool.bytes_copied))
    (want, *books), (got, *kept) = runs
    assert kept == books and set(calls) == {True}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("starts", "lengths"), [
    ([40, 7, 299, 0, 18], [1, 1, 1, 1, 1]),       # decodes only
    ([40, 7, 299, 0, 18], [1, 1, 1, 23, 9]),      # decodes first, then prompt chunks
    ([40, 0, 299, 16, 18], [1, 23, 1, 40, 1]),    # decodes among the chunks
])
def test_packed_rows_in_place_equal_the_gathered_step(use, monkeypatch, starts, lengths):
    shape = CacheShape(n_layer=2, n_kv_head=3, head_size=64, context=512)
    pool = random_pool(PagedCache(shape, 120, 16, "cpu", torch.float32), 5, 22, 3)
    in_place_equals_gathered(pool, monkeypatch,
                             lambda: step_through(pool, starts, lengths, 9, layers=2))


def test_a_hybrid_pools_groups_read_their_own_tables_and_window(use, monkeypatch):
    groups = (Group(8, (0, 2)), Group(None, (1, 3)))  # a sliding group, a global one
    shape = CacheShape(n_layer=4, n_kv_head=1, head_size=32, context=512)
    pool = random_pool(HybridPool(shape, groups, 90, 4, "cpu", torch.float32), 3, 25, 4, 2)
    pool.block_tables[0, :2, :2] = 0  # blocks the sliding group gave back: block 0, unseen
    in_place_equals_gathered(pool, monkeypatch,
                             lambda: step_through(pool, [60, 31, 0], [1, 1, 12], 4, layers=4))


def decode_through(cache, start, nh, layers):
    """Every layer's `PagedCache.attend` output of one decode step (B, nh, 1, hs) from
    start (an int, or (B,) per row)."""
    g = torch.Generator().manual_seed(6)
    B, nkv, hs = cache.block_tables.size(-2), cache.k.size(1), cache.k.size(-1)
    step = Step.at(start, 1, 512, "cpu")
    return [cache.attend(layer, torch.randn(B, nh, 1, hs, generator=g),
                         torch.randn(B, nkv, 1, hs, generator=g),
                         torch.randn(B, nkv, 1, hs, generator=g), step)
            for layer in range(layers)]


@pytest.mark.parametrize("start", [37, torch.tensor([40, 7, 299, 0])])
def test_a_decode_step_reads_its_rows_in_place_like_the_gather(use, monkeypatch, start):
    """generate, bench and eval (one start), and serve's prefill-first decode (a start a
    row), through `PagedCache.attend`."""
    shape = CacheShape(n_layer=2, n_kv_head=3, head_size=64, context=512)
    pool = random_pool(PagedCache(shape, 120, 16, "cpu", torch.float32), 4, 22, 7)
    in_place_equals_gathered(pool, monkeypatch, lambda: decode_through(pool, start, 9, 2))


def test_a_hybrid_pools_decode_step_keeps_each_groups_window_in_place(use, monkeypatch):
    groups = (Group(8, (0, 2)), Group(None, (1, 3)))  # a sliding group, a global one
    shape = CacheShape(n_layer=4, n_kv_head=1, head_size=32, context=512)
    pool = random_pool(HybridPool(shape, groups, 90, 4, "cpu", torch.float32), 3, 25, 8, 2)
    pool.block_tables[0, :2, :2] = 0  # blocks the sliding group gave back: block 0, unseen
    start = torch.tensor([60, 31, 90])
    in_place_equals_gathered(pool, monkeypatch, lambda: decode_through(pool, start, 4, 4))


@pytest.mark.parametrize(("starts", "lengths"), [
    ([40, 7, 299, 0], [1, 1, 1, 1]),     # decodes only: T == 1
    ([40, 7, 200, 18], [1, 1, 23, 9]),   # decodes first, then prompt chunks
    ([40, 0, 299, 16], [1, 23, 1, 40]),  # decodes among the chunks
])
def test_padded_rows_decodes_in_place_equal_the_gathered_step(use, monkeypatch, starts,
                                                              lengths):
    shape = CacheShape(n_layer=2, n_kv_head=3, head_size=64, context=512)
    pool = random_pool(PagedCache(shape, 120, 16, "cpu", torch.float32), 4, 22, 9)
    start, length = torch.tensor(starts), torch.tensor(lengths)  # (B,) each
    T = max(lengths)
    steps = torch.arange(T)  # (T,)
    real = steps < length[:, None]  # (B, T)
    pos = start[:, None] + torch.minimum(steps, length[:, None] - 1)  # (B, T), as serve's
    step = Step(start, pos, torch.arange(4) * T + length - 1)

    def run():
        view, g = PaddedRows(pool, pos, real), torch.Generator().manual_seed(5)
        out = []
        for layer in range(2):
            q = torch.randn(4, 9, T, 64, generator=g)  # (B, nh, T, hs)
            k, v = (torch.randn(4, 3, T, 64, generator=g) for _ in range(2))
            out.append(view.attend(layer, q, k, v, step).transpose(1, 2)[real])  # (N, nh, hs)
        return out

    in_place_equals_gathered(pool, monkeypatch, run)


def tiny_llama():
    config = LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=48, intermediate=64,
                         vocab_size=96, context=128)
    return init_random(Llama(config), 0.3, 0).eval()


@pytest.mark.parametrize("make", [tiny_llama, random_gemma3])
def test_generate_through_a_paged_cache_in_place_makes_the_static_tokens(use, monkeypatch,
                                                                         make):
    model, calls = make(), []
    read = paged.attend_paged
    monkeypatch.setattr(paged, "attend_paged", lambda *a: calls.append(1) or read(*a))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # past one block of 16
    with torch.no_grad():
        static = generate(model, prompt, 40, "static").tokens
        assert not calls
        got = generate(model, prompt, 40, "paged:b16").tokens
    assert len(set(static)) >= 8  # tokens that vary: a repeated one would prove little
    assert list(got) == list(static) and calls  # the decode steps read in place


def test_a_paged_decode_step_runs_fewer_ops_in_place(use, monkeypatch):
    model = tiny_llama()
    prompt = list(range(10, 30))

    def ops(in_place: bool) -> int:
        monkeypatch.setattr(paged, "reads_in_place", lambda pool, q: in_place)
        cache = make_cache("paged:b16", model, max_len=32)
        with torch.no_grad():
            model(torch.tensor([prompt]), 0, cache)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(torch.tensor([[7]]), len(prompt), cache)
        return sum(e.count for e in prof.key_averages())

    gathered, in_place = ops(False), ops(True)
    assert in_place < gathered, (in_place, gathered)


def test_codes_half_queries_and_the_torch_switch_keep_the_gather(lib, monkeypatch):
    """A quantised pool's codes and queries not in float32 are gathered and run through SDPA;
    KVCACHE_PAGED_ATTENTION=torch asks for that path everywhere."""
    monkeypatch.setattr(paged, "kernel", lambda: lib)
    shape = CacheShape(n_layer=1, n_kv_head=1, head_size=64, context=64)
    q = torch.randn(1, 1, 1, 64)
    assert paged.reads_in_place(PagedCache(shape, 4, 16, "cpu", torch.float16), q)
    assert not paged.reads_in_place(PagedCache(shape, 4, 16, "cpu", torch.float32), q.half())
    for fmt in ("int8", "int4", "fp8"):
        assert not paged.reads_in_place(QuantPagedCache(shape, 4, 16, "cpu", torch.float32, fmt), q)
    monkeypatch.setenv("KVCACHE_PAGED_ATTENTION", "torch")
    assert paged.load() == (None, "KVCACHE_PAGED_ATTENTION=torch")
