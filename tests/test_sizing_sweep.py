"""The sweep: `kvcache size` against the cache transformers itself allocates, for every
decoder-only (and text-of-multimodal) config class in the installed transformers.

Each config class's defaults are built small (a prefix of layers holding one of every layer
kind, tiny vocabulary and FFN, uninitialised weights: none of it changes the bytes per token
or the recurrent state), run for a few tokens with the cache on, and every cache layer's K/V
tensors and recurrent states are measured. The test requires the formula's bytes exactly,
allowing only transformers' known window − 1 convention for sliding layers (see --verify).

Classes that are not decoders, that transformers cannot build from its own defaults, or that
keep no Cache object are skipped with the reason; gaps in the reader are listed in KNOWN_GAPS
and run as strict xfails, so closing one shows up. `pytest -ra` (the project default) prints
both lists at the end of the run.
"""

from __future__ import annotations

import warnings

import pytest

from kvcache_cli import sizing

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

# Config spellings the reader does not model yet, each with what it would take.
KNOWN_GAPS = {
    "cpmant": "CPM-Ant caches prompt_types × prompt_length learned prompt tokens beside the text",
    "deepseek_v4": "compressed attention layers (heavily_compressed_attention) are not modelled",
    "inkling_text": "hybrid layers keep a convolution state not modelled yet",
    "inkling2_text": "hybrid layers keep a convolution state not modelled yet",
    "inkling2_loop_text": "hybrid layers keep a convolution state not modelled yet",
}


def _default_config(model_type: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type]().to_dict()


def _skip_reason(model_type: str, cfg: dict) -> str | None:
    """Why a class is out of scope: not a decoder-only model."""
    if cfg.get("is_encoder_decoder"):
        return "encoder-decoder: its cache pairs self- and cross-attention"
    if model_type in ("blt", "xlm", "big_bird"):
        return "not a decoder-only config (nested byte-level configs, or an encoder)"
    if model_type == "hrm_text":
        return ("recurrent-depth model: its layer count is num_layers_per_stack × cycles, "
                "which the sweep's cut to a few layers breaks")
    return None


def _cases() -> list:
    return [
        pytest.param(t, marks=pytest.mark.xfail(reason=f"{t}: {KNOWN_GAPS[t]}", strict=True))
        if t in KNOWN_GAPS else t
        for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    ]


@pytest.mark.parametrize("model_type", _cases())
def test_size_equals_the_bytes_transformers_caches(model_type, one_torch_thread):
    try:
        cfg = _default_config(model_type)
    except Exception as error:  # noqa: BLE001 - the class's own validators reject its defaults
        pytest.skip(f"{model_type}: its default config does not validate: "
                    f"{str(error).splitlines()[-1].strip()[:120]}")
    reason = _skip_reason(model_type, cfg)
    if reason:
        pytest.skip(f"{model_type}: {reason}")
    try:
        v = sizing.verify_cache(cfg, "fp32", max_layers=1)
    except sizing.VerifyError as error:
        if "returned no layered cache" in str(error):
            pytest.skip(f"{model_type}: transformers keeps no Cache for it (encoder-style, or "
                        "its own state object)")
        if "could not build and run" in str(error):
            pytest.skip(f"{model_type}: transformers fails on its default config, shrunk: "
                        f"{str(error).split(': ', 1)[1][:150]}")
        raise
    assert v.window_convention_only, (v.layers, v.state_measured_bytes, v.explanation)

    # The same numbers through `size` itself: the shrunk config, 8 tokens, fp32.
    small, _ = sizing._verify_config(cfg, max_layers=1)
    result = sizing.size_cache(sizing.shape_from_config(small), seq=v.tokens, dtype="fp32")
    assert result.total_bytes == v.formula_bytes
    assert result.state_bytes == v.state_measured_bytes


@pytest.mark.parametrize("model_type", sorted(KNOWN_GAPS))
def test_known_gaps_are_real_model_types(model_type):
    assert model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def test_recurrent_gemma_past_its_window_holds_what_transformers_holds(one_torch_thread):
    # Its attention blocks are local: past attention_window_size they hold the window, and
    # its RG-LRU layers keep a state on their modules that --verify reads there.
    cfg = _default_config("recurrent_gemma")
    v = sizing.verify_cache(cfg, "fp32", max_layers=1)
    assert v.window_convention_only, (v.layers, v.state_measured_bytes, v.explanation)
    assert v.state_measured_bytes == v.state_formula_bytes > 0
    assert [layer.kind for layer in v.layers] == ["recurrent", "recurrent", "sliding"]

    shape = sizing.shape_from_config(cfg)
    window = cfg["attention_window_size"]
    result = sizing.size_cache(shape, seq=2 * window, dtype="fp16")
    attention_layers = shape.layer_kinds.count("sliding")
    assert result.total_bytes == attention_layers * 2 * cfg["num_key_value_heads"] * cfg[
        "head_dim"] * window * 2
    # conv1d_width − 1 inputs at fp16 and an fp32 RG-LRU state, lru_width wide, per layer.
    recurrent = shape.layer_kinds.count("recurrent")
    width = cfg["lru_width"]
    assert result.state_bytes == recurrent * (width * (cfg["conv1d_width"] - 1) * 2 + width * 4)


def test_deepseek_v32_without_layer_types_caches_the_indexer_keys(one_torch_thread):
    # deepseek-ai/DeepSeek-V3.2's config.json carries index_head_dim but no layer_types: the
    # indexer's key grows with every token, as transformers' cache holds it.
    cfg = _default_config("deepseek_v32")
    del cfg["layer_types"]
    v = sizing.verify_cache(cfg, "fp32", max_layers=1)
    assert v.matches, v.explanation
    shape = sizing.shape_from_config(cfg)
    result = sizing.size_cache(shape, seq=4096, dtype="fp16")
    per_token = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + cfg["index_head_dim"]
    assert result.total_bytes == cfg["num_hidden_layers"] * per_token * 4096 * 2
    assert result.state_bytes == 0
    assert "index_head_dim" in result.formula[0], result.formula
