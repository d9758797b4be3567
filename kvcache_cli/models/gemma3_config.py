"""Gemma 3's shape, read from a GGUF's metadata and checked, as the config.json transformers
writes for it (the one config class is `models.gemma3.Gemma3Config`). Torch-free.

Gemma 3 (text) is a Llama with more parts: GeGLU (tanh GELU), an RMSNorm on each head's
queries and keys (QK-norm), norms before and after attention and the MLP, embeddings scaled
by √width and tied to the head, queries scaled by 1/√query_pre_attn_scalar, and two kinds
of layer: most attend over a sliding window of the newest `window` positions with rotary
base 10,000, every sixth attends over everything with base 1,000,000.

What llama.cpp's converter writes for it (`gemma3.*`) does not say everything: it gives one
rotary base (the global layers'), the window, and neither the layer pattern nor the local
base nor the query scale. llama.cpp's loader fills them in (pattern 6, local base 10,000,
the scale from the head size), as transformers' Gemma3TextConfig defaults do; this reads
the keys where a file gives them (`attention.sliding_window_pattern`, `rope.freq_base_swa`,
llama.cpp's names) and takes llama.cpp's values where it does not. Where llama.cpp and
transformers would read a missing key differently (the global rotary base: 10,000 for the
one, 1,000,000 for the other; the window: none for the one, 4,096 for the other) the file
is refused rather than run as either.

A value no model takes is one ValueError naming the key: a window of 0, negative or longer
than the context, a pattern whose length is not the layer count, a rotary base missing or
not finite, a head size the query scale cannot use. The tensors' widths (QK-norm's is the
head size) are checked against this shape by `gguf.reader`.
"""

from __future__ import annotations

from kvcache_cli.models import bounds

ARCH = "gemma3"
# llama.cpp's values for what the converter does not write (llama-model.cpp, LLM_ARCH_GEMMA3).
PATTERN = 6  # every 6th layer global: layers 5, 11, 17, ...
LOCAL_ROPE_THETA = 10_000.0
# Gemma 3's residual stream passes float16's largest number (65,504): every logit is NaN from
# the middle layers on, in transformers' Gemma3ForCausalLM as in kvcache's own.
FP16_OVERFLOWS = ("--dtype fp16: Gemma 3's activations pass float16's largest number (65,504) "
                  "and every logit comes out NaN (transformers' Gemma3ForCausalLM too); "
                  "expected --dtype bf16 or fp32")
LAYERS_27B = 62  # llama.cpp scales the 27B's queries by its width per head, not its head size
ACTIVATION = "gelu_pytorch_tanh"  # GeGLU's GELU, tanh-approximated (transformers' name)
# transformers' name of each checked field in a gemma3_text config.json.
HF_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
            "intermediate": "intermediate_size", "vocab_size": "vocab_size",
            "context": "max_position_embeddings", "head_dim": "head_dim",
            "rms_eps": "rms_norm_eps"}


_ABSENT = object()
WINDOW = bounds.Bound("window", "attention.sliding_window", 1, 2**20)
PATTERN_BOUND = bounds.Bound("pattern", "attention.sliding_window_pattern", 1, 1000)
LOCAL_THETA = bounds.Bound("rope_local_theta", "rope.freq_base_swa", 1.0, 1e12, whole=False)


def _key(b: bounds.Bound) -> str:
    return f"{ARCH}.{b.key}"


def _number(meta: dict, b: bounds.Bound, default=_ABSENT, why: str = ""):
    value = meta.get(_key(b), default)
    if value is _ABSENT:
        raise ValueError(f"no {_key(b)} in its metadata; expected a Gemma 3 GGUF{why}")
    return bounds.number(b, value, _key(b))


def config_from_metadata(meta: dict, stem: str, vocab_size: int, tied: bool) -> dict:
    """The config a `gemma3` GGUF's metadata gives, checked, as transformers writes a
    gemma3_text config.json (`models.gemma3.Gemma3Config.from_hf` reads it; so does `size`,
    torch-free); `vocab_size` is the tokenizer's count, `tied` whether the file has no
    output tensor of its own. A ValueError (one line, naming the key) for a value no
    Gemma 3 takes."""
    B = bounds.BOUNDS
    f = {field: _number(meta, B[field]) for field in (
        "n_layer", "n_head", "n_embd", "intermediate", "context", "rms_eps")}
    f["n_kv_head"] = _number(meta, B["n_kv_head"], f["n_head"])
    f["head_dim"] = _number(meta, B["head_dim"], f["n_embd"] // f["n_head"])
    f["rope_theta"] = _number(meta, B["rope_theta"], why=(
        " (its global layers' rotary base, which llama.cpp and transformers would read "
        "differently without it)"))
    f["vocab_size"] = _number(meta, B["vocab_size"], vocab_size)
    if f["vocab_size"] != vocab_size:
        raise ValueError(f"the vocabulary holds {vocab_size:,} tokens, {_key(B['vocab_size'])} "
                         f"says {f['vocab_size']:,}; expected one token per id")
    bounds.check_shape(f, {field: f"{ARCH}.{b.key}" for field, b in B.items()}.__getitem__)
    value_length = meta.get(f"{ARCH}.attention.value_length", f["head_dim"])
    if isinstance(value_length, bool) or value_length != f["head_dim"]:
        raise ValueError(f"{ARCH}.attention.value_length is {bounds.shown(value_length)}; "
                         f"expected the key length {f['head_dim']:,} (Gemma 3's values and "
                         "keys are heads of one size)")
    scaling = meta.get(f"{ARCH}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{ARCH}.rope.scaling.type is {bounds.shown(scaling)}; expected "
                         "'none' (kvcache runs unscaled rotary positions)")

    window = _number(meta, WINDOW, why=(
        " (its sliding window, which llama.cpp and transformers would read differently "
        "without it)"))
    if window > f["context"]:
        raise ValueError(f"{_key(WINDOW)} is {window:,}, longer than "
                         f"{_key(B['context'])} {f['context']:,}; expected a window within "
                         "the context")
    local_theta = _number(meta, LOCAL_THETA, LOCAL_ROPE_THETA)
    sliding = _sliding(meta, f["n_layer"])
    heads_share = f["n_embd"] // f["n_head"]
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        **{HF_NAMES[field]: f[field] for field in HF_NAMES},
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": {"rope_type": "default", "rope_theta": f["rope_theta"]}},
        # A whole number, as transformers' strict Gemma3TextConfig types it (a float fails
        # its validation when the dict becomes a config).
        "query_pre_attn_scalar": heads_share if f["n_layer"] == LAYERS_27B else f["head_dim"],
        "hidden_activation": ACTIVATION, "tie_word_embeddings": tied, "name": stem,
    }


def _sliding(meta: dict, n_layer: int) -> tuple[bool, ...]:
    """Whether each layer slides: llama.cpp's `attention.sliding_window_pattern` as it
    writes it (an array, true for a sliding layer) or as transformers' configs say it
    (a number N: every Nth layer global), else llama.cpp's Gemma 3 rule, N = 6."""
    key = _key(PATTERN_BOUND)
    value = meta.get(key, PATTERN)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ValueError(f"{key} holds {len(value):,} layer types for "
                             f"{_key(bounds.BOUNDS['n_layer'])} {n_layer:,}; expected one "
                             "per layer")
        bad = next((v for v in value if not isinstance(v, bool)), _ABSENT)
        if bad is not _ABSENT:
            raise ValueError(f"{key} holds {bounds.shown(bad)}; expected true (sliding) or "
                             "false (global) per layer")
        return tuple(value)
    n = bounds.number(PATTERN_BOUND, value, key)
    return tuple(bool((i + 1) % n) for i in range(n_layer))


def check_converted(raw: dict, where) -> None:
    """A converted Gemma 3 folder's config.json (what `config_from_metadata` wrote, and the
    converter's fields) of the shape and types it was written with, torch-free, or a
    ValueError naming the field; `Gemma3Config.from_hf` reads it fully when it loads."""
    def fail(what: str):
        raise ValueError(f"{where}: {what}; expected the config of a converted Gemma 3 GGUF")

    if raw.get("model_type") != "gemma3_text":
        fail(f"model_type is {bounds.shown(raw.get('model_type'))}")
    f = {}
    for field, key in HF_NAMES.items():
        if key not in raw:
            fail(f"no {key}")
        try:
            f[field] = bounds.number(bounds.BOUNDS[field], raw[key], key)
        except ValueError as err:
            fail(str(err))
    try:
        bounds.check_shape(f, HF_NAMES.__getitem__)
    except ValueError as err:
        fail(str(err))
    types = raw.get("layer_types")
    if not isinstance(types, list) or len(types) != f["n_layer"]:
        fail(f"layer_types is {bounds.shown(types)}")
    for field, kind in (("name", str), ("gguf", str), ("source_types", dict),
                        ("tie_word_embeddings", bool)):
        if not isinstance(raw.get(field), kind):
            fail(f"{field} is {bounds.shown(raw.get(field))}")
