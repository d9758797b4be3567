"""Sizing a model kvcache runs itself (`-m smollm2`, a `.gguf`): its shape read without
torch, and the bytes every cache kind holds for it, the figures its live caches'
`bytes_held` is tested against.

A GGUF's shape comes from the config.json of the folder `models.loading` converts it into
once (`models.converted` says where): no torch, no weights. A Llama file never converted
before is converted now, which needs torch (once, about 5 s for SmolLM2); a Gemma 3 file's
shape is read from its header instead (`models.gemma3_config`), torch-free on the first run
too.

The cache kinds are counted at the dtype kvcache runs the model in (float32 unless
`--dtype` says otherwise), each by its own formula in `caches.spec` through `cache_spec`,
beside the same model with as many KV heads as query heads: grouped-query attention's
saving on a real model (the toy's `kvcache demo gqa`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvcache_cli.sizing.config import shape_from_config
from kvcache_cli.sizing.reports import KindHeld, LiveKinds
from kvcache_cli.sizing.shape import ModelShape
from kvcache_cli.sizing.units import SizingError

# A bounded kind needs a budget: one a reader can hold in mind, an eighth of SmolLM2's
# context (a kind whose budget passes the context is refused, so it shrinks to fit).
BOUNDED_BUDGET = 1024
SINKS = 4  # StreamingLLM's
# transformers' QuantizedCache (quanto-int4/int2) lays its bytes out as optimum-quanto
# does; kvcache counts it from the live cache only, so it is left out here.
LEFT_OUT = ("quanto-int4", "quanto-int2")


def is_live(model: str) -> bool:
    """Whether `size -m` names a model kvcache loads itself (not a preset or a config)."""
    from kvcache_cli.models.gemma3_270m import GEMMA3
    from kvcache_cli.models.smollm2 import SMOLLM2

    return model in (SMOLLM2, GEMMA3) or model.endswith(".gguf")


def live_config(model: str) -> dict:
    """A transformers-style Llama config of `model` (smollm2, a .gguf): read from its
    converted folder, or from the file's header where it has none yet (no torch, nothing
    written: sizing a model never converts it)."""
    from kvcache_cli.models import family_of
    from kvcache_cli.models.gemma3_270m import GEMMA3
    from kvcache_cli.models.gguf.converted import converted_config
    from kvcache_cli.models.smollm2 import resolve_llama

    if model == GEMMA3 or family_of(model) == "gemma3":  # family_of reads a .gguf's header
        return _gemma3_config(model)
    path = Path(resolve_llama(model)).expanduser()  # ValueError: how to install SmolLM2
    if not (path.exists() or path.is_symlink()):
        raise SizingError(f"model {model!r}: no such file; expected smollm2 or a .gguf file")
    raw = converted_config(path)  # checked against the file; a ValueError for no GGUF
    if raw is None:
        from kvcache_cli.models.gguf.reader import read_llama_fields

        try:
            raw = read_llama_fields(path)
        except ValueError as err:
            raise SizingError(str(err)) from None
    hf = {
        "model_type": "llama", "num_hidden_layers": raw["n_layer"],
        "num_attention_heads": raw["n_head"], "num_key_value_heads": raw["n_kv_head"],
        "hidden_size": raw["n_embd"], "intermediate_size": raw["intermediate"],
        "vocab_size": raw["vocab_size"], "max_position_embeddings": raw["context"],
        "rope_theta": raw.get("rope_theta", 10000.0), "rms_norm_eps": raw.get("rms_eps", 1e-5),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
    }
    if raw.get("head_dim"):
        hf["head_dim"] = raw["head_dim"]
    return hf


def _gemma3_config(model: str) -> dict:
    """A Gemma 3 GGUF's (`-m gemma3`'s, or a path's) config as transformers' gemma3_text
    config.json has it: its converted folder's, else read from the file's header (no torch,
    no tensor read), what the conversion would write."""
    from kvcache_cli.models.gemma3_270m import GEMMA3, resolve_gemma3
    from kvcache_cli.models.gemma3_config import check_converted, config_from_metadata
    from kvcache_cli.models.gguf.converted import converted_config
    from kvcache_cli.models.gguf.layout import open_file, read_layout

    path = resolve_gemma3() if model == GEMMA3 else Path(model).expanduser()
    raw = converted_config(path, check_converted)
    if raw is not None:
        return raw
    data, size = open_file(path)
    try:
        layout = read_layout(path, data, size)
        tokens = layout.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError("no tokenizer.ggml.tokens list in its metadata; expected a "
                             "Gemma 3 GGUF")
        tied = all(t.name != "output.weight" for t in layout.tensors)
        return config_from_metadata(layout.metadata, path.stem, len(tokens), tied)
    except ValueError as err:
        raise SizingError(f"{path}: {err}") from None
    finally:
        data.close()


def live_shape(model: str) -> tuple[ModelShape, dict]:
    """(the shape, its transformers-style config) of a model kvcache loads itself."""
    from kvcache_cli.sizing.params import params_from_config

    cfg = live_config(model)
    shape = shape_from_config(cfg, model, params_from_config(cfg))
    return replace(shape, name=model, source=f"{model}: the converted GGUF's config.json, "
                   "the shape kvcache runs"), cfg


def default_specs(context: int) -> list[str]:
    """Every kind's default spelling; the bounded and compressing ones at BOUNDED_BUDGET
    positions."""
    from kvcache_cli.caches.spec import KINDS

    budget = min(BOUNDED_BUDGET, context)
    # The prompt-compressing kinds keep the same budget of the prompt's keys.
    bounded = {"window": f"window:{budget}", "sink": f"sink:{SINKS}+{budget - SINKS}",
               "h2o": f"h2o:{budget // 4}+{budget - budget // 4}",
               "snapkv": f"snapkv:{budget}", "knorm": f"knorm:{budget}",
               "recent": f"recent:{budget}"}
    return [bounded.get(name, name) for name in KINDS if name not in LEFT_OUT]


def live_kinds(shape: ModelShape, seq: int, dtype: str = "fp32") -> LiveKinds:
    """Bytes every cache kind holds for `shape` at `seq` tokens, keeping `dtype` numbers."""
    from kvcache_cli.caches.spec import fitted, parse_cache_spec
    from kvcache_cli.sizing.cache_spec import size_spec

    def held(spec: str, of: ModelShape, static_bytes: int | None) -> KindHeld:
        # Each kind's default, its groups laid out for this model's heads.
        s = size_spec(of, fitted(parse_cache_spec(spec), of.head_dim), seq, 1, dtype)
        base = static_bytes or s.bytes_per_sequence
        return KindHeld(s.spec, of.kv_heads, s.bytes_per_sequence, s.bytes_per_token,
                        s.bytes_per_sequence / base)

    static = held("static", shape, None)
    kinds = tuple(held(spec, shape, static.bytes_held)
                  for spec in default_specs(shape.max_positions or seq))
    mha = held("static", replace(shape, kv_heads=shape.heads or shape.kv_heads),
               static.bytes_held)
    return LiveKinds(shape.name, dtype, seq, kinds, mha, LEFT_OUT)
