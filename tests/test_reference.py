"""The NumPy reference script: SPEC.md's figures exactly, and every behaviour it must show."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_cache_from_scratch as ref

SCRIPT = Path(ref.__file__)


@pytest.fixture(scope="module")
def model() -> ref.Model:
    # Weights are never mutated by the code under test; one build serves the module.
    return ref.init_model()


# --- analytic figures: exact, from SPEC.md's table ------------------------------


def test_macs_totals_and_ratio_match_spec():
    r = ref.demo_macs()
    assert r.naive_total == 62_566_400
    assert r.cached_total == 1_839_104
    assert f"{r.ratio:.1f}" == "34.0"


def test_macs_per_step_rows_match_spec():
    assert ref.demo_macs().rows == (
        (1, 24_704, 24_704), (8, 204_800, 25_600), (16, 425_984, 26_624),
        (32, 917_504, 28_672), (48, 1_474_560, 30_720), (64, 2_097_152, 32_768))


def test_memory_figures_match_spec():
    r = ref.demo_memory()
    assert r.bytes_per_token == 524_288 == 512 * 1024
    assert f"{r.weights_gib:.2f}" == "12.55"
    assert [(s, f"{b1:.2f}") for s, b1, _, _ in r.rows] == [
        (1024, "0.50"), (4096, "2.00"), (32768, "16.00"), (131072, "64.00")]
    assert [(f"{b32:.1f}", f"{x:.1f}") for _, _, b32, x in r.rows] == [
        ("16.0", "1.3"), ("64.0", "5.1"), ("512.0", "40.8"), ("2048.0", "163.2")]


def test_gqa_figures_match_spec():
    rows = ref.demo_gqa().rows
    assert [(g.kv_heads, g.gib_4k_b32, g.gib_32k_b32) for g in rows] == [
        (32, 64.0, 512.0), (8, 16.0, 128.0), (1, 2.0, 16.0)]
    assert [g.bytes_per_token for g in rows] == [524_288, 131_072, 16_384]
    assert [g.reduction for g in rows] == [1, 4, 32]


def test_intensity_figures_match_spec():
    r = ref.demo_intensity()
    assert r.prefill_macs == 3_332_961_730_560
    assert r.decode_total_macs == 3_332_961_730_560
    assert r.decode_step_macs == 6_576_668_672
    assert f"{r.prefill_macs_per_byte:.1f}" == "242.5"
    assert f"{r.decode_macs_per_byte:.2f}" == "0.48"


def test_kv_cache_bytes_is_the_formula():
    assert ref.kv_cache_bytes(32, 8, 128, 32768, 2, 1) == 4 * 2**30
    assert ref.kv_cache_bytes(2, 3, 5, 7, 4, 11) == 2 * 2 * 3 * 5 * 7 * 4 * 11


# --- behaviours -------------------------------------------------------------------


def test_exact_cached_equals_naive_to_float64_noise(model):
    r = ref.demo_exact(model)
    assert r.distinct_tokens > 1, "a loop that repeats one token proves nothing"
    assert r.naive_tokens == r.cached_tokens
    assert r.same_tokens
    assert r.max_logit_diff <= 1e-12


def test_mask_keeps_earlier_rows_exactly_and_no_mask_moves_them(model):
    r = ref.demo_mask(model)
    assert r.masked.max_change == 0.0
    assert r.unmasked.max_change > 0.0
    assert r.masked.after.shape == (4, 5) and r.masked.before.shape == (4, 4)
    # Each attention row is a distribution over the keys it may read.
    np.testing.assert_allclose(r.masked.after.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    assert r.unmasked_cache_logit_diff > 1e-3


def test_paged_allocator_allocates_on_demand_and_frees_shared_pages_last():
    alloc = ref.PageAllocator(n_pages=8, page_size=4)
    parent = ref.PagedSequence(alloc)
    parent.append(9)                       # 9 tokens -> 3 pages, the last one partly full
    assert parent.pages == [0, 1, 2] and alloc.pages_in_use == 3
    child = ref.PagedSequence(alloc)
    child.fork_prefix(parent, 9)           # only the 2 full prefix pages are shared
    assert child.pages == [0, 1] and child.length == 8
    child.append(2)
    assert child.pages == [0, 1, 3]
    assert alloc.refcount[:4] == [2, 2, 1, 1]
    parent.free()
    assert alloc.pages_in_use == 3         # pages 0 and 1 still held by the child
    child.free()
    assert alloc.pages_in_use == 0


def test_paged_allocator_refuses_when_the_pool_is_empty():
    alloc = ref.PageAllocator(n_pages=1, page_size=2)
    seq = ref.PagedSequence(alloc)
    seq.append(2)
    with pytest.raises(MemoryError, match="all 1 KV pages"):
        seq.append()


def test_paged_demo_wastes_less_than_contiguous_and_sharing_saves_pages():
    r = ref.demo_paged()
    assert r.contiguous_utilisation < 0.5 < r.paged_utilisation <= 1.0
    assert r.shared_pages < r.paged_pages
    assert r.pages_saved_by_sharing == (r.n_requests - 1) * (r.shared_prefix // r.page_size)
    assert r.pages_free_after == r.n_pages
    assert len(r.example_block_table) == -(-r.example_length // r.page_size)
    # The example request's first pages are the shared prefix pages of request 0.
    assert r.example_block_table[: r.shared_prefix // r.page_size] == tuple(
        range(r.shared_prefix // r.page_size))


# --- breaks: each asserts its symptom ------------------------------------------------


def test_break_no_mask_cached_logits_drift_and_argmax_flips(model):
    r = ref.break_no_mask(model)
    assert r.earlier_rows_change > 0.0
    assert r.max_logit_diff > 1e-3
    assert r.argmax_flips >= 1
    assert r.cached_tokens != r.recomputed_tokens


def test_break_no_append_repeats_itself(model):
    r = ref.break_no_append(model)
    assert r.broken_distinct < r.correct_distinct
    assert r.cache_len_broken == len(ref.PROMPT)
    assert r.cache_len_correct == len(ref.PROMPT) + len(r.correct_tokens) - 1


def test_break_cache_q_norms_differ_every_step_and_q_is_read_once(model):
    r = ref.break_cache_q(model)
    norms = np.array(r.q_norms)
    assert np.all(np.abs(np.diff(norms)) > 0)
    assert set(r.q_reads) == {1}
    assert r.k_reads[0] == len(r.q_norms) and r.k_reads[-1] == 1
    assert r.same_tokens
    assert r.bytes_kv_and_q == r.bytes_kv * 3 // 2


def test_break_overflow_names_position_and_window(model):
    r = ref.break_overflow(model)
    assert r.error == "position 128 past context window 128"
    assert r.position == 128 and r.window == 128
    assert r.tokens_before_error == 128 - len(ref.PROMPT) + 1
    with pytest.raises(IndexError, match="position 128 past context window 128"):
        ref.decode_step(model, 0, 128, ref.new_cache(model.cfg))


def test_break_wrong_cache_changes_the_output(model):
    r = ref.break_wrong_cache(model)
    assert r.leaked_tokens != r.own_tokens
    assert r.first_divergence is not None
    assert r.foreign_tokens_attended == len(r.prompt_b) + len(r.own_tokens) - 1


# --- property: the cache is exact for any small configuration ------------------------


@settings(max_examples=25, deadline=None)
@given(n_layers=st.integers(1, 3), n_heads=st.integers(1, 4), head_dim=st.integers(1, 8),
       prompt_len=st.integers(1, 8), n_new=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_cached_logits_equal_naive_for_random_configs(n_layers, n_heads, head_dim, prompt_len,
                                                     n_new, seed):
    cfg = ref.Config(n_layers=n_layers, n_heads=n_heads, d_model=n_heads * head_dim,
                     d_ff=4 * n_heads * head_dim, vocab_size=32, max_ctx=32, seed=seed)
    m = ref.init_model(cfg)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 32, prompt_len)]
    naive = ref.generate_naive(m, prompt, n_new)
    cached = ref.generate_cached(m, prompt, n_new)
    assert cached.tokens == naive.tokens
    # float64 with values of order 10: a different summation order costs ~1e-14.
    np.testing.assert_allclose(cached.logits, naive.logits, rtol=0, atol=1e-10)


# --- the script as a program ----------------------------------------------------------


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)


def test_script_prints_every_demo_and_break_title():
    done = run_script()
    assert done.returncode == 0, done.stderr
    for scenario in [*ref.DEMOS.values(), *ref.BREAKS.values()]:
        assert scenario.title in done.stdout
    assert "62,566,400" in done.stdout and "3,332,961,730,560" in done.stdout


def test_script_runs_one_demo_and_one_break():
    done = run_script("--demo", "gqa", "--break", "overflow")
    assert done.returncode == 0, done.stderr
    assert ref.DEMOS["gqa"].title in done.stdout and ref.BREAKS["overflow"].title in done.stdout
    assert ref.DEMOS["macs"].title not in done.stdout


@pytest.mark.parametrize("flag", ["--demo", "--break"])
def test_script_unknown_name_is_one_line_and_exit_2(flag):
    done = run_script(flag, "nope")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0]
    table = ref.DEMOS if flag == "--demo" else ref.BREAKS
    assert all(name in lines[0] for name in table)
    assert done.stdout == ""


def test_script_list_names_everything():
    done = run_script("--list")
    assert done.returncode == 0
    for name in [*ref.DEMOS, *ref.BREAKS]:
        assert name in done.stdout


def test_script_imports_nothing_but_numpy_and_the_standard_library():
    probe = ("import json, sys, kv_cache_from_scratch; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=SCRIPT.parent, timeout=60)
    loaded = set(json.loads(done.stdout))
    assert not loaded & {"torch", "transformers", "typer", "rich", "kvcache_cli"}
