"""`kvcache size --window W --sinks S`: the bytes of a bounded cache, and what fits.

Torch-free, like the sizing it checks; figures are exact integers.
"""

import pytest

from kvcache_cli import sizing
from kvcache_cli.caches.spec import layer_bytes, parse_cache_spec


def gpt2():
    shape, _ = sizing.resolve_shape("gpt2", None, None, None, None, None, None)
    return shape


def test_a_bounded_cache_holds_sinks_plus_window_positions_in_every_layer():
    r = sizing.size_cache(gpt2(), 1024, 1, "fp32", window=252, sinks=4)
    # 12 layers × 2 (K, V) × 768 × 4 bytes × 256 positions
    assert r.total_bytes == 12 * 2 * 768 * 4 * 256 == 18_874_368
    assert [row.tokens_held for row in r.kinds] == [256]
    assert "min(seq_len, sinks + cache_window)" in r.formula[0]
    assert (r.window, r.sinks) == (252, 4)


def test_the_bounded_bytes_are_the_cache_registrys_bytes():
    for spec, window, sinks in (("sink:4+252", 252, 4), ("window:128", 128, 0)):
        for seq in (100, 256, 1000):
            r = sizing.size_cache(gpt2(), seq, 1, "fp32", window=window, sinks=sinks)
            assert r.total_bytes == 12 * layer_bytes(parse_cache_spec(spec), seq, 12, 64, 4)


def test_bytes_stop_growing_at_the_budget():
    sizes = [sizing.size_cache(gpt2(), seq, 1, "fp16", window=252, sinks=4).total_bytes
             for seq in (256, 500, 1000)]
    assert len(set(sizes)) == 1
    assert sizing.size_cache(gpt2(), 100, 1, "fp16", window=252, sinks=4).total_bytes < sizes[0]


def test_a_bounded_cache_fits_any_length_and_more_sequences():
    mem = sizing.parse_bytes("1GiB")
    full = sizing.size_cache(gpt2(), 1024, 1, "fp32", gpu_mem=mem, weight_dtype="fp32")
    bounded = sizing.size_cache(gpt2(), 1024, 1, "fp32", gpu_mem=mem, weight_dtype="fp32",
                                window=252, sinks=4)
    assert bounded.fit.max_tokens is None  # the cache stops growing below the room
    # 256 positions a sequence instead of 1,024: four times the sequences, or more
    # (the room divided by a quarter of the bytes, rounded down once instead of after).
    assert bounded.fit.max_sequences >= 4 * full.fit.max_sequences > 0


def test_a_sliding_layer_keeps_its_own_smaller_window():
    shape, _ = sizing.resolve_shape("mistral-7b", None, None, None, None, None, None)
    assert shape.window == 4096
    r = sizing.size_cache(shape, 32768, 1, "fp16", window=8192)
    assert [row.tokens_held for row in r.kinds] == [4096]  # min(seq, 4096, 8192)


@pytest.mark.parametrize("kw, message", [
    (dict(window=2000), "--window 2,000 is beyond the context window of 1,024"),
    (dict(window=1020, sinks=8), "--window 1,020 \\+ --sinks 8 = 1,028 positions is beyond"),
    (dict(sinks=4), "--sinks 4 given without --window"),
    (dict(window=4, sinks=8), "--sinks 8 is more than --window 4"),
    (dict(window=0), "--window 0: expected a whole number from 1"),
])
def test_a_bound_that_cannot_be_meant_is_refused(kw, message):
    with pytest.raises(sizing.SizingError, match=message):
        sizing.size_cache(gpt2(), 1024, 1, "fp32", **kw)


def _cli(*args):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    return CliRunner().invoke(app, ["size", *args])


def test_size_window_and_sinks_on_the_command_line():
    result = _cli("-m", "gpt2", "--window", "252", "--sinks", "4", "--dtype", "fp32", "--json")
    assert result.exit_code == 0, result.output
    import json

    data = json.loads(result.stdout)
    assert data["total_bytes"] == 18_874_368 and (data["window"], data["sinks"]) == (252, 4)


@pytest.mark.parametrize("args, message", [
    (("--window", "2000"), "error: --window 2,000 is beyond the context window of 1,024"),
    (("--window", "0"), "error: --window 0: expected a whole number from 1"),
    (("--sinks", "4"), "error: --sinks 4 given without --window"),
    (("--window", "4", "--sinks", "8"), "error: --sinks 8 is more than --window 4"),
    (("--window", "8", "--verify"), "error: --verify measures transformers' exact cache"),
])
def test_size_refuses_a_bad_bound_in_one_line(args, message):
    result = _cli("-m", "gpt2", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def test_size_cache_spec_counts_a_bounded_kind_as_the_window_flags_do():
    from kvcache_cli.sizing.cache_spec import size_spec

    mem = sizing.parse_bytes("1GiB")
    spec = size_spec(gpt2(), parse_cache_spec("sink:4+252"), 1024, 1, "fp32", mem, "fp32")
    flags = sizing.size_cache(gpt2(), 1024, 1, "fp32", window=252, sinks=4)
    assert spec.bytes_per_sequence == flags.total_bytes == 18_874_368
    assert (spec.full_tokens, spec.quantised_tokens) == (256, 0)
    assert spec.fit.max_tokens is None  # it stops growing at 256 tokens
    h2o = size_spec(gpt2(), parse_cache_spec("h2o:128+128"), 1024, 1, "fp32")
    # its float32 score and int64 position per slot and head, every layer
    assert h2o.bytes_per_sequence == 18_874_368 + 12 * 256 * 12 * (4 + 8)


def test_size_cache_refuses_a_bounded_spec_past_the_context_window():
    result = _cli("-m", "gpt2", "--cache", "window:2000")
    assert result.exit_code == 2, result.output
    assert "beyond gpt2's context window of 1,024" in result.stderr
    shown = _cli("-m", "gpt2", "--cache", "sink:4+252")
    assert shown.exit_code == 0 and "every token at fp16" in shown.stdout, shown.output
