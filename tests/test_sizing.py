"""The sizing module: exact byte counts, presets against their published shapes, config.json
in every style it reads, tensor parallel, fit, and the bad inputs it must name."""

from __future__ import annotations

import json

import pytest

from kvcache_cli import sizing
from kvcache_cli.sizing import (
    PRESETS,
    ConfigError,
    SizingError,
    format_bytes,
    format_gb,
    format_gib,
    parse_bytes,
    parse_count,
    resolve_shape,
    shape_from_config,
    shape_from_flags,
    size_cache,
)

GiB = 2**30


def flags(layers=32, kv_heads=8, head_dim=None, heads=None):
    return shape_from_flags(layers, kv_heads, head_dim, heads)[0]


def write_config(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


# --- the formula and the SPEC's figures -----------------------------------------------------


def test_issue_example_is_exactly_4_gib():
    result = size_cache(flags(32, 8), seq=32768)
    assert result.total_bytes == 4 * GiB
    assert result.bytes_per_token == 131_072
    assert result.bytes_per_token_per_layer == 4096
    assert format_bytes(result.total_bytes) == "4.00 GiB (4.29 GB)"
    assert result.formula[1].strip() == "= 2 × 32 × 8 × 128 × 32,768 × 2 × 1"
    assert result.formula[2].strip() == "= 4,294,967,296"


def test_llama2_7b_shape_matches_spec_memory_table():
    shape = PRESETS["llama-2-7b"].shape
    assert size_cache(shape, seq=1).bytes_per_token == 524_288
    for seq, gib_b1, gib_b32 in ((1024, 0.5, 16), (4096, 2, 64), (32768, 16, 512),
                                 (131072, 64, 2048)):
        assert size_cache(shape, seq=seq).total_bytes == gib_b1 * GiB
        assert size_cache(shape, seq=seq, batch=32).total_bytes == gib_b32 * GiB
    fit = size_cache(shape, seq=4096, gpu_mem=80 * GiB).fit
    assert fit.weights_bytes == 13_476_831_232
    assert format_gib(fit.weights_bytes) == "12.55 GiB"


@pytest.mark.parametrize(
    ("kv_heads", "per_token", "gib_4k", "gib_32k", "reduction"),
    [(32, 524_288, 64, 512, 1.0), (8, 131_072, 16, 128, 4.0), (1, 16_384, 2, 16, 32.0)],
)
def test_gqa_table_and_reduction_is_heads_over_kv_heads(kv_heads, per_token, gib_4k, gib_32k,
                                                        reduction):
    shape = flags(32, kv_heads, heads=32)
    at_4k = size_cache(shape, seq=4096, batch=32)
    assert at_4k.bytes_per_token == per_token
    assert at_4k.total_bytes == gib_4k * GiB
    assert size_cache(shape, seq=32768, batch=32).total_bytes == gib_32k * GiB
    assert at_4k.reduction == reduction
    assert at_4k.mha_total_bytes == 64 * GiB


def test_kv_heads_defaults_to_heads_and_head_dim_to_128():
    shape = flags(layers=2, kv_heads=None, heads=4)
    assert (shape.kv_heads, shape.head_dim) == (4, 128)


@pytest.mark.parametrize(("dtype", "per_token"), [
    ("fp32", 262_144), ("fp16", 131_072), ("bf16", 131_072), ("fp8", 65_536), ("int8", 65_536),
    ("int4", 32_768), ("float16", 131_072), ("BFLOAT16", 131_072),
])
def test_cache_dtype_sets_bytes_exactly(dtype, per_token):
    assert size_cache(flags(32, 8), seq=1, dtype=dtype).bytes_per_token == per_token


def test_int4_rounds_a_row_with_an_odd_count_up_to_a_whole_byte():
    assert sizing.bytes_for_values(3, 4) == 2
    assert sizing.bytes_for_values(4, 4) == 2
    shape = shape_from_config({"model_type": "deepseek_v3", "num_hidden_layers": 1,
                               "num_attention_heads": 2, "kv_lora_rank": 3,
                               "qk_rope_head_dim": 2, "qk_nope_head_dim": 4, "v_head_dim": 4})
    assert size_cache(shape, seq=10, dtype="int4").total_bytes == 10 * 3  # ceil(5 × 4 / 8)


def test_huge_sizes_stay_exact_and_print_in_large_units():
    result = size_cache(flags(80, 8), seq=10**9, batch=10**4)
    assert result.total_bytes == 2 * 80 * 8 * 128 * 10**9 * 2 * 10**4
    assert format_gib(result.total_bytes) == "2.84 EiB"
    assert format_gib(2**50) == "1.00 PiB"
    assert format_gb(10**18) == "1.00 EB"
    # Every number at its upper limit: still exact, still one short line.
    enormous = size_cache(flags(100_000, 65_536, head_dim=65_536), seq=10**12,
                          batch=10**9).total_bytes
    assert enormous == 2 * 100_000 * 65_536 * 65_536 * 10**12 * 2 * 10**9
    assert format_gib(enormous).endswith(" YiB") and len(format_gib(enormous)) < 30
    assert format_bytes(999) == "999 bytes"


# --- presets --------------------------------------------------------------------------------

# (layers, query heads, KV heads, head_dim, params, context) from each model's config.json
# and its safetensors total; DeepSeek-V3's head_dim is the decompressed key width 128 + 64.
PUBLISHED = {
    "gpt2": (12, 12, 12, 64, 124_439_808, 1024),
    "gpt2-medium": (24, 16, 16, 64, 354_823_168, 1024),
    "gpt2-large": (36, 20, 20, 64, 774_030_080, 1024),
    "gpt2-xl": (48, 25, 25, 64, 1_557_611_200, 1024),
    "llama-2-7b": (32, 32, 32, 128, 6_738_415_616, 4096),
    "llama-2-13b": (40, 40, 40, 128, 13_015_864_320, 4096),
    "llama-2-70b": (80, 64, 8, 128, 68_976_648_192, 4096),
    "llama-3-8b": (32, 32, 8, 128, 8_030_261_248, 8192),
    "llama-3-70b": (80, 64, 8, 128, 70_553_706_496, 8192),
    "llama-3.1-405b": (126, 128, 8, 128, 405_853_388_800, 131072),
    "mistral-7b": (32, 32, 8, 128, 7_241_732_096, 32768),
    "mistral-7b-v0.3": (32, 32, 8, 128, 7_248_023_552, 32768),
    "qwen2.5-7b": (28, 28, 4, 128, 7_615_616_512, 131072),
    "gemma-2-9b": (42, 16, 8, 256, 9_241_705_984, 8192),
    "gemma-3-270m": (18, 4, 1, 256, 268_098_176, 32768),
    "deepseek-v3": (61, 128, 128, 192, 671_026_419_200, 163840),
    "mamba-2.8b": (64, None, 0, 0, 2_768_345_600, None),
    "jamba-v0.1": (32, 32, 8, 128, 51_570_323_328, 262144),
}


def test_the_issue_s_presets_are_all_there():
    assert set(PUBLISHED) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_its_published_shape(name):
    shape = PRESETS[name].shape
    got = (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.params,
           shape.max_positions)
    assert got == PUBLISHED[name]


def test_window_and_latent_presets_have_their_layer_kinds():
    gemma = PRESETS["gemma-2-9b"].shape
    assert gemma.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    assert gemma.kind_counts() == {"full": 21, "sliding": 21} and gemma.window == 4096
    assert PRESETS["mistral-7b"].shape.kind_counts() == {"sliding": 32}
    assert PRESETS["mistral-7b-v0.3"].shape.kind_counts() == {"full": 32}
    assert PRESETS["qwen2.5-7b"].shape.kind_counts() == {"full": 28}  # use_sliding_window false
    ds = PRESETS["deepseek-v3"].shape
    assert ds.kind_counts() == {"mla": 61}
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim) == (512, 64)


def test_deepseek_v3_caches_one_576_wide_latent_per_token_per_layer():
    result = size_cache(PRESETS["deepseek-v3"].shape, seq=1)
    assert result.bytes_per_token_per_layer == (512 + 64) * 2
    assert result.bytes_per_token == 61 * 1152 == 70_272
    # Decompressed: 128 heads × (128 + 64 key + 128 value) per layer.
    assert result.mha_bytes_per_token == 61 * 128 * 320 * 2
    assert result.reduction == 40960 / 576


def test_gemma2_sliding_layers_stop_growing_at_the_window():
    shape = PRESETS["gemma-2-9b"].shape
    per_layer = 2 * 8 * 256 * 2
    assert size_cache(shape, seq=2000).total_bytes == 42 * per_layer * 2000
    long = size_cache(shape, seq=32768)
    assert long.total_bytes == 21 * per_layer * 32768 + 21 * per_layer * 4096
    assert [row.tokens_held for row in long.kinds] == [32768, 4096]
    assert any("past the context window" in note for note in long.notes)


def test_preset_params_match_the_architecture_transformers_builds():
    """Instantiating each preset's config on the meta device counts the same parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    for name, p in PRESETS.items():
        cfg = dict(p.config)
        hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        count = sum(t.numel() for t in model.parameters())
        # DeepSeek-V3's router bias is a buffer in transformers but a tensor in the checkpoint.
        count += sum(t.numel() for n, t in model.named_buffers() if "e_score_correction" in n)
        assert count == p.params, name


def test_preset_lookup_by_hub_id_and_nearest_names_for_typos():
    assert sizing.preset("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert sizing.preset("LLAMA-3-8B").name == "llama-3-8b"
    with pytest.raises(SizingError, match=r"unknown model 'llama-2-7'.*did you mean llama-2-7b"):
        sizing.preset("llama-2-7")


# --- config.json in every style -------------------------------------------------------------


def test_gpt2_style_config(tmp_path):
    path = write_config(tmp_path, {"model_type": "gpt2", "n_layer": 12, "n_head": 12,
                                   "n_embd": 768, "n_positions": 1024})
    shape, cfg = resolve_shape(config=path)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (12, 12, 12, 64)
    assert shape.max_positions == 1024 and cfg["n_layer"] == 12
    assert size_cache(shape, seq=1024).total_bytes == 2 * 12 * 12 * 64 * 1024 * 2


def test_llama_gqa_config_read_from_its_folder(tmp_path):
    write_config(tmp_path, {"model_type": "llama", "num_hidden_layers": 80,
                            "num_attention_heads": 64, "num_key_value_heads": 8,
                            "hidden_size": 8192, "max_position_embeddings": 4096})
    shape, _ = resolve_shape(config=tmp_path)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (80, 64, 8, 128)
    assert size_cache(shape, seq=4096).total_bytes == 2 * 80 * 8 * 128 * 4096 * 2


def test_explicit_head_dim_wins_over_hidden_over_heads(tmp_path):
    path = write_config(tmp_path, {"model_type": "qwen3", "num_hidden_layers": 36,
                                   "num_attention_heads": 32, "num_key_value_heads": 8,
                                   "hidden_size": 2560, "head_dim": 128})
    assert resolve_shape(config=path)[0].head_dim == 128  # not 2560 / 32 = 80


def test_mla_config_caches_the_latent(tmp_path):
    path = write_config(tmp_path, {"model_type": "deepseek_v2", "num_hidden_layers": 27,
                                   "num_attention_heads": 16, "hidden_size": 2048,
                                   "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                   "qk_nope_head_dim": 128, "v_head_dim": 128})
    shape, _ = resolve_shape(config=path)
    assert shape.kind_counts() == {"mla": 27}
    assert size_cache(shape, seq=100, dtype="bf16").total_bytes == 27 * 576 * 100 * 2


def test_layer_types_with_sliding_and_linear_layers(tmp_path):
    types = ["linear_attention", "sliding_attention", "full_attention"] * 2
    path = write_config(tmp_path, {"model_type": "x", "num_hidden_layers": 6,
                                   "num_attention_heads": 8, "num_key_value_heads": 2,
                                   "hidden_size": 512, "sliding_window": 128,
                                   "layer_types": types})
    shape, _ = resolve_shape(config=path)
    assert shape.kind_counts() == {"full": 2, "sliding": 2, "recurrent": 2}
    result = size_cache(shape, seq=1000)
    per_layer = 2 * 2 * 64 * 2
    assert result.total_bytes == 2 * per_layer * 1000 + 2 * per_layer * 128
    assert [(row.kind, row.total_bytes) for row in result.kinds][-1] == ("recurrent", 0)
    # model_type 'x' has no known state formula: said, not silently zero.
    assert any("reader does not know for model_type 'x'" in note for note in result.notes)


def test_family_defaults_for_layer_types_follow_transformers():
    base = {"num_hidden_layers": 8, "num_attention_heads": 4, "hidden_size": 256}
    assert shape_from_config({**base, "model_type": "mistral", "sliding_window": 64}
                             ).kind_counts() == {"sliding": 8}
    assert shape_from_config({**base, "model_type": "qwen2", "sliding_window": 64,
                              "use_sliding_window": False}).kind_counts() == {"full": 8}
    qwen_on = shape_from_config({**base, "model_type": "qwen2", "sliding_window": 64,
                                 "use_sliding_window": True, "max_window_layers": 6})
    assert qwen_on.layer_kinds == ("full",) * 6 + ("sliding",) * 2
    gemma3 = shape_from_config({**base, "model_type": "gemma3_text", "sliding_window": 64})
    assert gemma3.layer_kinds == ("sliding",) * 5 + ("full", "sliding", "sliding")
    next_ = shape_from_config({**base, "model_type": "qwen3_next"})
    assert next_.layer_kinds == ("recurrent", "recurrent", "recurrent", "full") * 2
    jamba = shape_from_config({**base, "model_type": "jamba"})
    assert jamba.layer_kinds == ("recurrent",) * 4 + ("full",) + ("recurrent",) * 3


def test_nested_text_config(tmp_path):
    path = write_config(tmp_path, {"model_type": "llava", "text_config": {
        "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "hidden_size": 4096}})
    shape, _ = resolve_shape(config=path)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 8, 128)
    assert "text_config" in shape.source


# google/gemma-3-4b-it's config.json as the Hub has it: its text_config names no head counts,
# head size or rotary bases (transformers' Gemma3TextConfig fills them in).
GEMMA3_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "sliding_window": 1024,
                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}


@pytest.mark.parametrize("names_its_type", [True, False])
def test_a_text_config_silent_on_its_widths_takes_transformers_defaults(names_its_type):
    from transformers import Gemma3Config

    text = dict(GEMMA3_4B_TEXT)
    if not names_its_type:  # the wrapper's model_type says which text class it builds
        del text["model_type"]
    shape = shape_from_config({"model_type": "gemma3", "text_config": text})
    built = Gemma3Config(text_config=dict(text)).text_config
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.window, shape.max_positions) == (
        built.num_attention_heads, built.num_key_value_heads, built.head_dim,
        built.sliding_window, built.max_position_embeddings)
    assert shape.layer_kinds == tuple(t.split("_")[0] for t in built.layer_types)


@pytest.mark.parametrize("cfg", [
    # Qwen/Qwen3-0.6B's widths, QK-norm and tied embeddings
    {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
     "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
     "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    # google/gemma-3-4b-it's text_config alone: heads, head size, vocabulary from the defaults
    {k: v for k, v in GEMMA3_4B_TEXT.items() if k != "rope_scaling"},
])
def test_params_counted_from_a_config_are_what_transformers_builds(cfg):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    fields = dict(cfg)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sizing.params_from_config(cfg) == sum(t.numel() for t in model.parameters())


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"num_attention_heads": 8}', "no num_hidden_layers"),
    ('{"num_hidden_layers": 4}', "no num_attention_heads"),
    ('{"num_hidden_layers": 4, "num_attention_heads": 8}', "no hidden_size"),
    ('{"num_hidden_layers": "32", "num_attention_heads": 8}', "num_hidden_layers is '32'"),
    ('{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 3,'
     ' "hidden_size": 64}', "3 KV heads do not divide 8"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64,'
     ' "layer_types": ["full_attention"]}', "expected a list of 2"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 64,'
     ' "layer_types": ["warp_attention"]}', "unknown layer type 'warp_attention'"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 64,'
     ' "layer_types": ["sliding_attention"]}', "no sliding_window"),
])
def test_bad_config_names_the_problem(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        resolve_shape(config=path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        resolve_shape(config=tmp_path / "nope.json")


# --- flags and units ------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layers": 0, "kv_heads": 8}, "--layers 0: expected a whole number from 1 to 100,000"),
    ({"layers": 10**6, "kv_heads": 8}, "--layers 1,000,000: expected a whole number from 1 "),
    ({"layers": 32, "kv_heads": 10**9}, "--kv-heads 1,000,000,000: expected .* to 65,536"),
    ({"layers": 32, "kv_heads": -2}, "--kv-heads -2"),
    ({"layers": 32, "kv_heads": 8, "head_dim": 0}, "--head-dim 0"),
    ({"layers": 32, "kv_heads": 6, "heads": 32}, "--kv-heads 6 does not divide --heads 32"),
    ({"layers": 32}, "needs --kv-heads"),
    ({}, "no model shape"),
    ({"model": "llama-2-7b", "layers": 3}, "--layers cannot be combined with --model"),
    ({"model": "llama-2-7b", "config": "x.json"}, "both given"),
])
def test_bad_shape_flags(kwargs, message):
    with pytest.raises(SizingError, match=message):
        resolve_shape(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seq": 0}, "--seq 0"),
    ({"seq": 8, "batch": -1}, "--batch -1"),
    ({"seq": 8, "dtype": "fp61"}, r"unknown dtype 'fp61'.*did you mean"),
    ({"seq": 8, "weight_dtype": "int3"}, "unknown dtype 'int3'"),
    ({"seq": 8, "block_size": 16}, "without --gpu-mem"),
    ({"seq": 8, "gpu_mem": 10**12}, "needs the weights' size"),
])
def test_bad_size_arguments(kwargs, message):
    with pytest.raises(SizingError, match=message):
        size_cache(flags(), **kwargs)


def test_seq_defaults_to_the_context_window_or_must_be_given():
    result = size_cache(PRESETS["llama-3-8b"].shape)
    assert result.seq == 8192
    with pytest.raises(SizingError, match="expected --seq"):
        size_cache(flags())


@pytest.mark.parametrize(("text", "n"), [
    ("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("80 gib", 80 * GiB), ("1024", 1024),
    ("79.5GiB", 79 * GiB + GiB // 2), ("1.5TiB", 3 * 2**39), ("500MB", 5 * 10**8),
])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize(("text", "message"), [
    ("80G", "ambiguous"), ("0GiB", "from 1 byte to 1 EiB"), ("2EiB", "from 1 byte to 1 EiB"),
    ("-1GB", "expected a positive size"),
    ("lots", "expected a positive size"), ("80 furlongs", "unknown unit"),
])
def test_parse_bytes_rejects(text, message):
    with pytest.raises(SizingError, match=message):
        parse_bytes(text)


def test_parse_count():
    assert parse_count("6738415616") == 6_738_415_616
    assert parse_count("6.74B") == 6_740_000_000
    assert parse_count("70e9") == 70 * 10**9
    assert parse_count("405_853_388_800") == 405_853_388_800
    for bad in ("1.5", "seven", "-3"):
        with pytest.raises(SizingError):
            parse_count(bad)


# --- tensor parallel ------------------------------------------------------------------------


def test_tp_splits_kv_heads_evenly():
    result = size_cache(PRESETS["llama-2-70b"].shape, seq=4096, tp=8)
    assert (result.tp.kv_heads_per_gpu, result.tp.replicas) == (1, 1)
    assert result.tp.total_bytes_per_gpu * 8 == result.total_bytes
    assert result.tp.total_bytes_all_gpus == result.total_bytes


def test_tp_replicates_kv_heads_when_gpus_outnumber_them():
    result = size_cache(PRESETS["llama-3.1-405b"].shape, seq=1000, tp=32)
    assert (result.tp.kv_heads_per_gpu, result.tp.replicas) == (1, 4)
    assert result.tp.bytes_per_token_per_gpu == 126 * 2 * 1 * 128 * 2
    assert result.tp.total_bytes_all_gpus == 4 * result.total_bytes


def test_tp_keeps_the_whole_mla_latent_on_every_gpu():
    result = size_cache(PRESETS["deepseek-v3"].shape, seq=1000, tp=8)
    assert result.tp.total_bytes_per_gpu == result.total_bytes
    assert result.tp.total_bytes_all_gpus == 8 * result.total_bytes
    assert "cannot be split" in result.tp.note


@pytest.mark.parametrize(("shape", "tp", "message"), [
    (flags(32, 8, heads=64), 3, "does not divide the 64 attention heads"),
    (flags(32, 12, heads=24), 8, "does not divide the 12 KV heads"),
    (flags(32, 4, heads=48), 6, "not a multiple of the 4 KV heads"),
])
def test_tp_that_cannot_split_the_heads(shape, tp, message):
    with pytest.raises(SizingError, match=message):
        size_cache(shape, seq=8, tp=tp)


# --- fit ------------------------------------------------------------------------------------


def test_fit_llama2_7b_on_80_gib():
    fit = size_cache(PRESETS["llama-2-7b"].shape, seq=4096, gpu_mem=80 * GiB).fit
    assert fit.room_bytes == 80 * GiB - 13_476_831_232 == 72_422_514_688
    assert fit.max_tokens == 138_134  # room // 524,288 bytes per token
    assert fit.max_sequences == 33  # 2 GiB per 4,096-token sequence
    assert fit.batch_fits
    big = size_cache(PRESETS["llama-2-7b"].shape, seq=4096, batch=34, gpu_mem=80 * GiB).fit
    assert big.batch_bytes_per_gpu == 68 * GiB and not big.batch_fits


def test_fit_paged_rounding_charges_whole_blocks():
    fit = size_cache(PRESETS["llama-2-7b"].shape, seq=4001, gpu_mem=80 * GiB, block_size=16).fit
    assert fit.paged_bytes_per_sequence == 4016 * 524_288
    assert fit.paged_waste_bytes_per_sequence == 15 * 524_288
    assert fit.max_tokens_paged == 138_128  # whole 16-token blocks: 8,633 of them
    assert fit.max_sequences_paged == 72_422_514_688 // (4016 * 524_288)


def test_fit_with_sliding_layers_counts_the_window_once():
    fit = size_cache(PRESETS["gemma-2-9b"].shape, seq=32768, gpu_mem=24 * GiB).fit
    room = 24 * GiB - 9_241_705_984 * 2
    per_layer = 8192
    assert fit.max_tokens == (room - 21 * per_layer * 4096) // (21 * per_layer) == 38_258
    # Every layer sliding: past the window nothing grows, so no sequence length is too long.
    assert size_cache(PRESETS["mistral-7b"].shape, seq=8, gpu_mem=80 * GiB).fit.max_tokens is None


def test_fit_splits_weights_across_tp_and_uses_params_flag():
    shape, _ = resolve_shape(layers=80, kv_heads=8, heads=64, params=70 * 10**9)
    fit = size_cache(shape, seq=8192, tp=4, gpu_mem=80 * 10**9, weight_dtype="bf16").fit
    assert fit.weights_bytes_per_gpu == 35 * 10**9
    assert fit.room_bytes == 45 * 10**9


def test_gpu_smaller_than_the_weights_is_an_error_naming_both():
    with pytest.raises(SizingError, match=r"8.00 GiB .* is not more than the weights.*12.55 GiB"):
        size_cache(PRESETS["llama-2-7b"].shape, seq=8, gpu_mem=8 * GiB)


# --- --verify without torch: what it builds -------------------------------------------------


def test_verify_config_keeps_a_prefix_with_every_kind_and_the_attention_widths():
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
           "vocab_size": 151936, "intermediate_size": 5120, "eos_token_id": 151645,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"]
           * 3 + ["full_attention"] + ["linear_attention", "full_attention"] * 20}
    small, changes = sizing._verify_config(cfg, max_layers=2)
    # Qwen3-Next's first full-attention layer is the 4th: four layers cover both kinds.
    assert small["num_hidden_layers"] == 4
    assert small["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (small["num_attention_heads"], small["num_key_value_heads"], small["head_dim"]) == (
        16, 2, 256)
    assert small["vocab_size"] == 512 and small["eos_token_id"] == 0
    assert any(change.startswith("layers 48 → 4") for change in changes)


# --- layers with their own widths -------------------------------------------------------------

GEMMA4 = {"model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2304, "sliding_window": 512,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


def test_gemma4_global_layers_are_global_head_dim_wide():
    # The Hub's spelling (global_head_dim), and transformers 5's (per_layer_config), agree.
    hub = shape_from_config({**GEMMA4, "global_head_dim": 512})
    saved = shape_from_config({**GEMMA4, "per_layer_config": {"05": {"head_dim": 512}}})
    for shape in (hub, saved):
        result = size_cache(shape, seq=4096)
        assert [(r.kind, r.layers, r.values_per_token) for r in result.kinds] == [
            ("full", 1, 2 * 4 * 512), ("sliding", 5, 2 * 4 * 256)]
        assert result.total_bytes == (2 * 4 * 512 * 4096 + 5 * 2 * 4 * 256 * 512) * 2


def test_mimo_sliding_layers_keep_twice_the_kv_heads_and_the_query_in_the_window():
    shape = shape_from_config({
        "model_type": "mimo_v2_flash", "num_hidden_layers": 2, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "hidden_size": 4096,
        "sliding_window_size": 128, "layer_types": ["full_attention", "sliding_attention"]})
    assert shape.window == 129
    rows = {r.kind: r.values_per_token for r in size_cache(shape, seq=10).kinds}
    assert rows == {"full": 4 * (192 + 128), "sliding": 8 * (192 + 128)}


def test_deepseek_v32_indexer_key_is_cached_beside_the_latent():
    shape = shape_from_config({**PRESETS["deepseek-v3"].config, "model_type": "deepseek_v32",
                               "index_head_dim": 128,
                               "layer_types": ["indexed_attention"] * 61})
    assert size_cache(shape, seq=1).bytes_per_token == 61 * (512 + 64 + 128) * 2


# --- each config spelling as published checkpoints write it -----------------------------------

BASE = {"num_hidden_layers": 8, "num_attention_heads": 8, "hidden_size": 512}


@pytest.mark.parametrize(("cfg", "kinds", "kv_heads", "head_dim"), [
    # tiiuae/falcon-40b: num_kv_heads under new_decoder_architecture, multi_query also true.
    ({**BASE, "model_type": "falcon", "new_decoder_architecture": True, "multi_query": True,
      "num_kv_heads": 2}, {"full": 8}, 2, 64),
    # tiiuae/falcon-7b: multi_query alone, one K/V head.
    ({**BASE, "model_type": "falcon", "multi_query": True}, {"full": 8}, 1, 64),
    # databricks/dbrx-base: the KV heads nested in attn_config.
    ({"model_type": "dbrx", "n_layers": 8, "n_heads": 8, "d_model": 512,
      "attn_config": {"kv_n_heads": 2}}, {"full": 8}, 2, 64),
    # THUDM/chatglm3-6b: kv_channels and multi_query_group_num.
    ({**BASE, "model_type": "chatglm", "kv_channels": 128, "multi_query_group_num": 2},
     {"full": 8}, 2, 128),
    # google/recurrentgemma-2b: block_types repeated over the layers; attention is local.
    ({**BASE, "model_type": "recurrent_gemma", "block_types": ["recurrent", "recurrent",
      "attention"], "attention_window_size": 2048}, {"sliding": 2, "recurrent": 6}, 8, 64),
    # nvidia/Nemotron-H-8B-Base-8K: one character per layer.
    ({**BASE, "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-M-E",
      "mamba_num_heads": 16, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
      "conv_kernel": 4}, {"full": 1, "recurrent": 3, "none": 4}, 8, 64),
    # ibm-ai-platform/Bamba-9B: attention layers listed.
    ({**BASE, "model_type": "bamba", "attn_layer_indices": [3, 7], "mamba_n_heads": 16,
      "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4},
     {"full": 2, "recurrent": 6}, 8, 64),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: full layers counted from 1.
    ({**BASE, "model_type": "kimi_linear", "linear_attn_config": {"full_attn_layers": [4, 8]},
      "linear_num_heads": 8, "linear_head_dim": 64, "linear_conv_kernel_dim": 4},
     {"full": 2, "recurrent": 6}, 8, 64),
    # meta-llama/Llama-4-Scout-17B-16E: chunked attention, every 4th layer global.
    ({**BASE, "model_type": "llama4_text", "attention_chunk_size": 8192},
     {"full": 2, "chunked": 6}, 8, 64),
    # google/gemma-3n-E4B-it: the last layers reuse earlier caches.
    ({**BASE, "model_type": "gemma3n_text", "num_kv_shared_layers": 3}, {"full": 5, "none": 3},
     8, 64),
    # meituan-longcat/LongCat-Flash-Chat: two attention blocks per decoder layer.
    ({"num_attention_heads": 8, "hidden_size": 512, "model_type": "longcat_flash",
      "num_layers": 4}, {"full": 8}, 8, 64),
    # Zyphra/Zamba2-2.7B: attention_head_dim wins over kv_channels.
    ({**BASE, "model_type": "zamba2", "attention_head_dim": 128, "kv_channels": 64,
      "layers_block_type": ["mamba"] * 7 + ["hybrid"], "mamba_headdim": 64,
      "mamba_d_state": 64, "mamba_d_conv": 4}, {"full": 1, "recurrent": 7}, 8, 128),
])
def test_published_config_spellings(cfg, kinds, kv_heads, head_dim):
    shape = shape_from_config(cfg)
    assert shape.kind_counts() == kinds
    assert (shape.kv_heads, shape.head_dim) == (kv_heads, head_dim)


def test_mamba2_state_is_conv_over_x_b_c_and_heads_by_head_dim_by_state():
    # mistralai/Mamba-Codestral-7B-v0.1
    shape = shape_from_config({"model_type": "mamba2", "num_hidden_layers": 64,
                               "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
                               "n_groups": 8, "state_size": 128, "conv_kernel": 4,
                               "expand": 2})
    assert shape.state_layers == 64
    assert shape.conv_state_values == (128 * 64 + 2 * 8 * 128) * 4
    assert shape.ssm_state_values == 128 * 64 * 128


def test_params_counted_from_a_config_match_every_dense_presets_published_count():
    # The presets' counts are the published checkpoints' (and transformers' builds, above).
    counted = {name: sizing.params_from_config(dict(p.config)) for name, p in PRESETS.items()}
    for name, p in PRESETS.items():
        if p.config["model_type"] in ("mamba", "jamba", "deepseek_v3"):
            assert counted[name] is None, name  # experts, state spaces, MLA: --params
        else:
            assert counted[name] == p.params, name


def test_size_config_with_gpu_mem_counts_the_params_itself(tmp_path):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    path = write_config(tmp_path, dict(PRESETS["llama-2-7b"].config))
    by_config = CliRunner().invoke(app, ["size", "--config", str(path), "--seq", "4096",
                                         "--gpu-mem", "80GiB", "--json"])
    assert by_config.exit_code == 0, by_config.output
    by_preset = CliRunner().invoke(app, ["size", "-m", "llama-2-7b", "--seq", "4096",
                                         "--gpu-mem", "80GiB", "--json"])
    fit, preset_fit = json.loads(by_config.stdout)["fit"], json.loads(by_preset.stdout)["fit"]
    assert fit["params"] == 6_738_415_616 and fit == preset_fit
