"""KV-cache sizing for real models: shapes, bytes per layer kind, tensor parallel, fit.

The article's formula, `bytes = 2 × layers × kv_heads × head_dim × seq_len × dtype_bytes ×
batch`, is right for a plain multi-head or grouped-query decoder. Real models bend it in ways
that online calculators get wrong, and this module gets right:

- grouped KV heads (Llama-2-70B and most models since cache 8 heads, not 64);
- head_dim given explicitly rather than hidden / heads (Gemma-2: 256, not 3584 / 16);
- MLA (DeepSeek-V2/V3) caches one compressed latent per token per layer, shared by K and V;
- sliding-window layers hold at most the window; linear-attention / Mamba layers hold no KV;
- the cache dtype is not the weights' dtype, and int4 is half a byte;
- GiB (2^30) is not GB (10^9).

Everything is pure computation on Python ints (exact, never overflowing) and returns frozen
dataclasses; `kvcache_cli.views.sizing` renders them. `verify_cache` is the one function that
needs torch and transformers, and imports them inside itself.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any


class SizingError(ValueError):
    """Bad input to the calculator: the message names the value and what was expected."""


class ConfigError(SizingError):
    """A config.json that is missing, malformed, or lacks a field the cache size needs."""


# ---------------------------------------------------------------------------------------------
# Dtypes and units
# ---------------------------------------------------------------------------------------------

# Bits, not bytes, so int4 (two values per byte) stays an exact integer.
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def nearest(name: str, choices: list[str], n: int = 3) -> str:
    """' (did you mean a, b?)' for a mistyped name, or '' when nothing is close."""
    close = difflib.get_close_matches(name.lower(), choices, n=n, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def dtype_bits(name: str) -> int:
    """Bits per cached value for a dtype name such as 'fp16' or 'bfloat16'."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_BITS:
        names = list(DTYPE_BITS)
        raise SizingError(
            f"unknown dtype {name!r}: expected one of {', '.join(names)}"
            + nearest(name, names + list(_DTYPE_ALIASES))
        )
    return DTYPE_BITS[key]


def canonical_dtype(name: str) -> str:
    dtype_bits(name)  # validates
    return _DTYPE_ALIASES.get(name.lower(), name.lower())


def bytes_for_values(values: int, bits: int) -> int:
    """Bytes to store `values` numbers of `bits` bits each.

    Rounded up: int4 packs two values per byte within a row, so a row with an odd count
    still occupies its last byte whole.
    """
    return -(-values * bits // 8)


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
_DECIMAL_UNITS = ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")


def _scaled(n: int, base: int, units: tuple[str, ...]) -> str:
    """`n` bytes in the largest unit that keeps the number ≥ 1, two decimals.

    Integer arithmetic throughout: a float conversion would overflow past 1.8e308 bytes, and
    the calculator accepts sizes that large.
    """
    if n < base:
        return f"{n:,} bytes"
    power = 1
    while power < len(units) and n >= base ** (power + 1):
        power += 1
    unit = base**power
    hundredths = (n * 100 + unit // 2) // unit  # rounded half up
    return f"{hundredths // 100:,}.{hundredths % 100:02d} {units[power - 1]}"


def format_gib(n: int) -> str:
    """Binary units: 4294967296 -> '4.00 GiB'."""
    return _scaled(n, 1024, _BINARY_UNITS)


def format_gb(n: int) -> str:
    """Decimal units: 4294967296 -> '4.29 GB'."""
    return _scaled(n, 1000, _DECIMAL_UNITS)


def format_bytes(n: int) -> str:
    """Both, because GiB and GB differ by 7 % and people mean either: '4.00 GiB (4.29 GB)'."""
    if n < 1000:
        return f"{n:,} bytes"
    return f"{format_gib(n)} ({format_gb(n)})"


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{u.lower(): 1000 ** (i + 1) for i, u in enumerate(_DECIMAL_UNITS)},
    **{u.lower(): 1024 ** (i + 1) for i, u in enumerate(_BINARY_UNITS)},
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, what: str = "--gpu-mem") -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1024' -> 1024 (plain bytes)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise SizingError(
            f"{what} {text!r}: expected a positive size such as 80GiB, 80GB or 85899345920 (bytes)"
        )
    number, unit = match.group(1).replace("_", "").replace(",", ""), match.group(2).lower()
    if unit in {"k", "m", "g", "t", "p", "e"}:
        raise SizingError(
            f"{what} {text!r}: unit {match.group(2)!r} is ambiguous; "
            f"expected {unit.upper()}iB (powers of 1024) or {unit.upper()}B (powers of 1000)"
        )
    if unit not in _SIZE_UNITS:
        raise SizingError(
            f"{what} {text!r}: unknown unit {match.group(2)!r}; expected one of "
            "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"
        )
    n = int(Decimal(number) * _SIZE_UNITS[unit])  # Decimal: '79.5GiB' is exact, no float
    if n <= 0:
        raise SizingError(f"{what} {text!r}: expected more than 0 bytes")
    return n


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str, what: str = "--params") -> int:
    """A parameter count: '6738415616', '6.74B', '70e9', '405_853_388_800'."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    suffix = cleaned[-1:].lower() if cleaned[-1:].isalpha() and cleaned[-1:].lower() != "e" else ""
    try:
        value = Decimal(cleaned[: len(cleaned) - len(suffix)]) * _COUNT_SUFFIX[suffix]
    except (InvalidOperation, KeyError):
        raise SizingError(
            f"{what} {text!r}: expected a whole number such as 6738415616, 6.74B or 70e9"
        ) from None
    if value != value.to_integral_value() or value < 0:
        raise SizingError(f"{what} {text!r}: expected a whole number of parameters, 0 or more")
    return int(value)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizingError(f"{name} {value!r}: expected a whole number")
    if value < 1:
        raise SizingError(f"{name} {value}: expected a positive whole number (1 or more)")
    return value


# ---------------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------------

# What a layer keeps per token. "sliding" and "chunked" hold at most `window` tokens; "mla"
# holds one compressed latent; "none" (linear attention, Mamba, MLP-only) holds no KV at all.
# Those recurrent layers do keep a fixed-size state per sequence, which does not grow with
# tokens and is not counted here.
KINDS = ("full", "sliding", "chunked", "mla", "none")

_LAYER_TYPE_KIND = {
    "full_attention": "full",
    "attention": "full",
    "global": "full",
    "global_attention": "full",
    "full": "full",
    "hybrid": "full",  # transformers: linear attention plus a full KV cache in one layer
    "sliding_attention": "sliding",
    "sliding": "sliding",
    "local": "sliding",
    "local_attention": "sliding",
    "hybrid_sliding": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "none",
    "mamba": "none",
    "mamba2": "none",
    "conv": "none",
    "recurrent": "none",
    "moe": "none",
    "mlp": "none",
}


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a model's KV cache, and nothing else.

    hidden_size, vocabulary and FFN width are absent on purpose: the cache does not depend on
    them, and the weights' size comes from `params`.
    """

    name: str
    layers: int  # decoder layers of every kind
    heads: int | None  # query heads; None when unknown (no multi-head baseline then)
    kv_heads: int  # n_kv: K/V heads per attention layer (heads for MHA, 1 for MQA)
    head_dim: int  # hs: width of one K (and one V) head
    layer_kinds: tuple[str, ...]  # one of KINDS per layer
    window: int | None = None  # tokens a sliding/chunked layer holds at most
    kv_lora_rank: int = 0  # MLA: compressed latent c_KV, shared by K and V
    qk_rope_head_dim: int = 0  # MLA: the decoupled rotary key, shared by all heads
    qk_nope_head_dim: int = 0  # MLA: per-head key width after decompression (no rope)
    v_head_dim: int = 0  # MLA: per-head value width after decompression
    params: int | None = None  # published parameter count, for the weights
    max_positions: int | None = None  # the context window the config declares
    source: str = ""  # where the numbers came from

    def kind_counts(self) -> dict[str, int]:
        counts = Counter(self.layer_kinds)
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    @property
    def is_mla(self) -> bool:
        return "mla" in self.layer_kinds

    def describe(self) -> str:
        """'GQA-8', 'MHA', 'MQA', 'MLA', plus the window pattern: one word for a table."""
        if self.is_mla:
            attention = f"MLA {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        elif self.heads is None:
            attention = f"{self.kv_heads} KV heads"
        elif self.kv_heads == self.heads:
            attention = "MHA"
        elif self.kv_heads == 1:
            attention = "MQA"
        else:
            attention = f"GQA-{self.kv_heads}"
        counts = self.kind_counts()
        for kind in ("sliding", "chunked"):
            if counts.get(kind) == self.layers:
                attention += f", all {kind} {self.window:,}"
            elif kind in counts:
                attention += f", {counts[kind]}/{self.layers} {kind} {self.window:,}"
        if "none" in counts:
            attention += f", {counts['none']}/{self.layers} no KV"
        return attention


def shape_from_flags(
    layers: int,
    kv_heads: int | None,
    head_dim: int | None = None,
    heads: int | None = None,
) -> tuple[ModelShape, dict[str, Any]]:
    """A plain decoder given by its numbers, and the Llama config that builds it for --verify."""
    _positive("--layers", layers)
    if heads is not None:
        _positive("--heads", heads)
    if kv_heads is None:
        if heads is None:
            raise SizingError("the shape needs --kv-heads (or --heads for multi-head attention)")
        kv_heads = heads  # multi-head attention: every query head has its own K and V
    _positive("--kv-heads", kv_heads)
    head_dim = 128 if head_dim is None else _positive("--head-dim", head_dim)
    if heads is not None and heads % kv_heads:
        raise SizingError(
            f"--kv-heads {kv_heads} does not divide --heads {heads}: expected a divisor of "
            f"{heads} (each KV head serves a whole group of query heads)"
        )
    name = f"{layers} layers, {kv_heads} KV heads, head_dim {head_dim}"
    shape = ModelShape(
        name=name,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=("full",) * layers,
        source="command-line flags",
    )
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": heads if heads is not None else kv_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": (heads if heads is not None else kv_heads) * head_dim,
    }
    return shape, config


# --- config.json --------------------------------------------------------------------------------

# Real configs spell the same number several ways; the first present wins.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")

# transformers fills `layer_types` for these families when config.json has none; the
# defaults are the ones in each family's configuration class (the Hub's gemma-2 configs, for
# one, carry only `sliding_window` and rely on this).
_SLIDING_EVERY = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


def _config_int(cfg: dict, keys: tuple[str, ...], where: str, required: bool = True) -> int | None:
    for key in keys:
        if cfg.get(key) is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {key} is {value!r}; expected a positive integer")
            return value
    if required:
        raise ConfigError(f"{where}: no {keys[0]} (expected one of {', '.join(keys)})")
    return None


def _layer_type_names(cfg: dict, layers: int, where: str) -> list[str]:
    """Every layer's transformers layer type: explicit, or derived as transformers derives it."""
    model_type = str(cfg.get("model_type", ""))
    window = cfg.get("sliding_window")
    if cfg.get("layer_types") is not None:
        names = cfg["layer_types"]
        if not isinstance(names, list) or len(names) != layers:
            raise ConfigError(
                f"{where}: layer_types has {len(names) if isinstance(names, list) else names!r} "
                f"entries; expected a list of {layers}, one per layer"
            )
        return [str(name) for name in names]
    if cfg.get("layers_block_type") is not None:  # Zamba / Falcon-H1 spelling
        return [str(name) for name in cfg["layers_block_type"]]
    if "attn_layer_period" in cfg or model_type == "jamba":  # Jamba: one attention layer per period
        period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    if model_type == "qwen3_next" or "full_attention_interval" in cfg:
        every = cfg.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(layers)]
    if model_type in ("mamba", "mamba2", "rwkv"):
        return ["mamba"] * layers
    if cfg.get("use_sliding_window") is False or window is None:
        # Qwen2/Qwen3 ship sliding_window with use_sliding_window false: the window is off.
        return ["full_attention"] * layers
    every = cfg.get("sliding_window_pattern", _SLIDING_EVERY.get(model_type))
    if every:
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(layers)]
    if "max_window_layers" in cfg:  # Qwen2/Qwen3 with the window on: layers from this index slide
        first = cfg["max_window_layers"]
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["sliding_attention"] * layers  # Mistral-7B-v0.1: every layer slides


def shape_from_config(cfg: Any, name: str = "config.json", params: int | None = None) -> ModelShape:
    """Read the cache-relevant numbers from a Hugging Face config dict, as transformers would."""
    where = name
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers: the decoder is inside
        cfg = cfg["text_config"]
        where = f"{name} (text_config)"
    layers = _config_int(cfg, _LAYER_KEYS, where)
    heads = _config_int(cfg, _HEAD_KEYS, where)
    if cfg.get("multi_query"):  # GPTBigCode / Falcon-7B spelling of MQA
        kv_heads = 1
    else:
        kv_heads = _config_int(cfg, _KV_HEAD_KEYS, where, required=False) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{where}: {kv_heads} KV heads do not divide {heads} attention heads; "
            "expected a divisor"
        )
    is_mla = cfg.get("kv_lora_rank") is not None
    if is_mla:
        # The width of one query/key head after decompression; the cache holds the latent.
        head_dim = _config_int(cfg, ("qk_nope_head_dim",), where) + _config_int(
            cfg, ("qk_rope_head_dim",), where)
    elif cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, ("head_dim",), where)
    else:
        hidden = _config_int(cfg, _HIDDEN_KEYS, where)
        if hidden % heads:
            raise ConfigError(
                f"{where}: hidden size {hidden} is not a multiple of {heads} heads and there "
                "is no head_dim; expected head_dim or a divisible hidden size"
            )
        head_dim = hidden // heads
    names = _layer_type_names(cfg, layers, where)
    kinds = []
    for type_name in names:
        if type_name not in _LAYER_TYPE_KIND:
            raise ConfigError(
                f"{where}: unknown layer type {type_name!r}; expected one of "
                + ", ".join(sorted(_LAYER_TYPE_KIND))
            )
        kind = _LAYER_TYPE_KIND[type_name]
        kinds.append("mla" if is_mla and kind == "full" else kind)
    window = None
    if "sliding" in kinds:
        window = _config_int(cfg, ("sliding_window",), where)
    elif "chunked" in kinds:
        window = _config_int(cfg, ("attention_chunk_size",), where)
    mla = {}
    if is_mla:
        mla = {
            "kv_lora_rank": _config_int(cfg, ("kv_lora_rank",), where),
            "qk_rope_head_dim": _config_int(cfg, ("qk_rope_head_dim",), where),
            "qk_nope_head_dim": _config_int(cfg, ("qk_nope_head_dim",), where),
            "v_head_dim": _config_int(cfg, ("v_head_dim",), where),
        }
    return ModelShape(
        name=name,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=tuple(kinds),
        window=window,
        params=params,
        max_positions=_config_int(cfg, _CONTEXT_KEYS, where, required=False),
        source=where,
        **mla,
    )


def load_config(path: str | Path) -> dict:
    """config.json as a dict: PATH may be the file or the model folder that holds it."""
    import json  # here, not at the top: `kvcache size` with flags starts ~7 ms faster

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found; expected a config.json") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {error}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config file {str(path)!r} is not valid JSON: {error.msg} at line {error.lineno} "
            f"column {error.colno}"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"config file {str(path)!r}: expected a JSON object, got {type(cfg).__name__}"
        )
    return cfg


# --- presets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A real model: its Hub id, published parameter count, and the config.json fields that
    matter (copied from the model's own config, so the preset goes through the same reader as
    --config)."""

    name: str
    hf_id: str
    params: int  # total parameters in the published checkpoint (safetensors metadata)
    config: dict = field(hash=False)

    @property
    def shape(self) -> ModelShape:
        return replace(
            shape_from_config(self.config, self.name, self.params), source=self.hf_id
        )


def _gpt2(size: str, layers: int, heads: int, width: int, params: int) -> Preset:
    name = "gpt2" if size == "small" else f"gpt2-{size}"
    config = {
        "model_type": "gpt2",
        "n_layer": layers,
        "n_head": heads,
        "n_embd": width,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    return Preset(name, f"openai-community/{name}", params, config)


def _llama(name: str, hf_id: str, params: int, layers: int, heads: int, kv: int, hidden: int,
           ffn: int, vocab: int, context: int, **extra: Any) -> Preset:
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        **extra,
    }
    return Preset(name, hf_id, params, config)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _gpt2("small", 12, 12, 768, 124_439_808),
        _gpt2("medium", 24, 16, 1024, 354_823_168),
        _gpt2("large", 36, 20, 1280, 774_030_080),
        _gpt2("xl", 48, 25, 1600, 1_557_611_200),
        _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", 6_738_415_616,
               32, 32, 32, 4096, 11008, 32000, 4096),
        _llama("llama-2-13b", "meta-llama/Llama-2-13b-hf", 13_015_864_320,
               40, 40, 40, 5120, 13824, 32000, 4096),
        _llama("llama-2-70b", "meta-llama/Llama-2-70b-hf", 68_976_648_192,
               80, 64, 8, 8192, 28672, 32000, 4096),
        _llama("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 8_030_261_248,
               32, 32, 8, 4096, 14336, 128256, 8192),
        _llama("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 70_553_706_496,
               80, 64, 8, 8192, 28672, 128256, 8192),
        _llama("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 405_853_388_800,
               126, 128, 8, 16384, 53248, 128256, 131072),
        # v0.1 is the model of the Mistral paper: every layer attends over a 4,096-token
        # window, so its cache stops growing there (the rolling buffer).
        _llama("mistral-7b", "mistralai/Mistral-7B-v0.1", 7_241_732_096,
               32, 32, 8, 4096, 14336, 32000, 32768, model_type="mistral", sliding_window=4096),
        _llama("mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3", 7_248_023_552,
               32, 32, 8, 4096, 14336, 32768, 32768, model_type="mistral", sliding_window=None),
        # Qwen2.5 ships a sliding_window value with use_sliding_window false: all layers full.
        _llama("qwen2.5-7b", "Qwen/Qwen2.5-7B", 7_615_616_512,
               28, 28, 4, 3584, 18944, 152064, 131072, model_type="qwen2",
               use_sliding_window=False, sliding_window=131072, max_window_layers=28,
               tie_word_embeddings=False),
        # Gemma-2: head_dim 256 although 3584 / 16 = 224; layers alternate between a
        # 4,096-token sliding window and global attention (transformers derives the pattern).
        _llama("gemma-2-9b", "google/gemma-2-9b", 9_241_705_984,
               42, 16, 8, 3584, 14336, 256000, 8192, model_type="gemma2", head_dim=256,
               sliding_window=4096),
        # MLA: each layer caches a 512-wide latent plus a 64-wide rotary key, for all 128 heads.
        Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 671_026_419_200, {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "hidden_size": 7168,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "n_group": 8,
            "topk_group": 4,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
        }),
    )
}

_PRESET_ALIASES = {p.hf_id.lower(): p.name for p in PRESETS.values()} | {
    p.hf_id.split("/")[-1].lower(): p.name for p in PRESETS.values()
}


def preset(name: str) -> Preset:
    """A preset by name ('llama-2-7b') or Hub id ('meta-llama/Llama-2-7b-hf'), any case."""
    key = name.lower()
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise SizingError(
            f"unknown model {name!r}: expected a preset name (see 'kvcache models')"
            + nearest(name, list(PRESETS))
        )
    return PRESETS[key]


def resolve_shape(
    model: str | None = None,
    config: str | Path | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    heads: int | None = None,
    params: int | None = None,
) -> tuple[ModelShape, dict[str, Any]]:
    """One shape from exactly one source: a preset, a config.json, or the shape flags.

    Returns the shape and the config dict that `verify_cache` builds the model from.
    """
    flags = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim, "--heads": heads}
    given = [flag for flag, value in flags.items() if value is not None]
    if model is not None and config is not None:
        raise SizingError("--model and --config both given: expected one source for the shape")
    if model is not None or config is not None:
        source = "--model" if model is not None else "--config"
        if given:
            raise SizingError(
                f"{', '.join(given)} cannot be combined with {source}: expected the shape "
                f"from {source} or from flags, not both"
            )
    if model is not None:
        chosen = preset(model)
        shape = chosen.shape
        if params is not None:
            shape = replace(shape, params=params)
        return shape, dict(chosen.config)
    if config is not None:
        cfg = load_config(config)
        return shape_from_config(cfg, str(config), params), cfg
    if layers is None:
        raise SizingError("no model shape: expected --model NAME, --config PATH, or --layers N "
                          "with --kv-heads N")
    shape, cfg = shape_from_flags(layers, kv_heads, head_dim, heads)
    return replace(shape, params=params), cfg


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------


def _values_per_token(shape: ModelShape, kind: str, kv_heads: int | None = None) -> int:
    """Numbers one layer of `kind` caches per token (K and V together)."""
    if kind == "none":
        return 0
    if kind == "mla":
        # One latent c_KV, decompressed into both K and V at attention time, plus the rotary
        # key shared by every head: no factor 2, no heads.
        return shape.kv_lora_rank + shape.qk_rope_head_dim
    return 2 * (shape.kv_heads if kv_heads is None else kv_heads) * shape.head_dim


def _mha_values_per_token(shape: ModelShape, kind: str) -> int:
    """The same layer with one K and one V per query head: the multi-head baseline."""
    if kind == "none":
        return 0
    if kind == "mla":
        # What an implementation that decompresses the latent would cache per head.
        return shape.heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    return 2 * shape.heads * shape.head_dim


def tokens_held(shape: ModelShape, kind: str, seq: int) -> int:
    """Tokens a layer of `kind` holds once a sequence is `seq` tokens long."""
    if kind == "none":
        return 0
    if kind in ("sliding", "chunked"):
        return min(seq, shape.window)
    return seq


def _round_up(n: int, block: int | None) -> int:
    return n if not block else -(-n // block) * block


@dataclass(frozen=True)
class KindRow:
    """One kind of layer in the model: how many there are and what each holds."""

    kind: str
    layers: int
    values_per_token: int  # numbers one layer caches per token (K and V together)
    bytes_per_token_per_layer: int
    tokens_held: int  # per sequence, at --seq
    total_bytes: int  # all layers of this kind, seq × batch
    formula: str  # the formula for this kind, in symbols ('' for layers without KV)
    substituted: str  # the same with this model's numbers


@dataclass(frozen=True)
class TensorParallel:
    """The cache of one GPU when attention heads are split across `tp` GPUs."""

    tp: int
    kv_heads_per_gpu: int  # standard attention layers; 0 when the model has none
    replicas: int  # GPUs that hold a copy of each KV head (1 = no replication)
    bytes_per_token_per_gpu: int
    total_bytes_per_gpu: int  # seq × batch, one GPU
    total_bytes_all_gpus: int  # counting replicas: what the cluster actually allocates
    note: str


@dataclass(frozen=True)
class Fit:
    """What fits on one GPU of `gpu_mem` bytes beside the weights."""

    gpu_mem_bytes: int
    weight_dtype: str
    params: int
    weights_bytes: int  # whole model
    weights_bytes_per_gpu: int  # split across --tp GPUs
    room_bytes: int  # left for the cache on one GPU
    max_tokens: int | None  # longest single sequence whose cache fits; None: no limit
    max_sequences: int | None  # concurrent sequences of --seq tokens; None: no limit
    batch_bytes_per_gpu: int  # the --batch × --seq cache this GPU would hold
    batch_fits: bool
    block_size: int | None
    paged_bytes_per_sequence: int | None  # one --seq sequence rounded up to whole blocks
    paged_waste_bytes_per_sequence: int | None
    max_sequences_paged: int | None
    max_tokens_paged: int | None


@dataclass(frozen=True)
class VerifyLayer:
    index: int  # the layer's index in the model that was built (not the original)
    kind: str
    key_shape: tuple[int, ...]  # as stored: (B, n_kv, T, hs)
    value_shape: tuple[int, ...]
    measured_bytes: int
    formula_bytes: int


@dataclass(frozen=True)
class Verification:
    """The bytes a real transformers cache holds beside the formula's, for the same layers."""

    model_type: str
    dtype: str
    tokens: int
    window: int | None  # the window used for the check (shrunk so the check stays fast)
    layers: tuple[VerifyLayer, ...]
    measured_bytes: int
    formula_bytes: int
    matches: bool
    changes: tuple[str, ...]  # what was shrunk to build it fast; none of it changes the cache
    explanation: tuple[str, ...]


@dataclass(frozen=True)
class SizeResult:
    """Everything `kvcache size` shows, as raw numbers; the views format them."""

    model: str
    source: str
    shape: ModelShape
    dtype: str
    dtype_bits: int
    seq: int
    batch: int
    bytes_per_token: int  # whole model, one token in every KV layer, batch 1
    bytes_per_token_per_layer: int  # one layer of the model's main attention kind
    total_bytes: int  # seq × batch, whole model (unique bytes, no TP replicas)
    kinds: tuple[KindRow, ...]
    formula: tuple[str, ...]
    mha_bytes_per_token: int | None
    mha_total_bytes: int | None
    reduction: float | None  # multi-head bytes / these bytes
    tp: TensorParallel | None
    fit: Fit | None
    notes: tuple[str, ...]
    verify: Verification | None = None


def _kind_formula(shape: ModelShape, kind: str, n: int, seq: int, bits: int,
                  batch: int) -> tuple[str, str]:
    """The formula for one kind of layer, in symbols and with this model's numbers."""
    size = f"{bits // 8}" if bits >= 8 else f"{bits / 8:g}"
    if kind == "mla":
        return (
            "layers × (kv_lora_rank + qk_rope_head_dim) × seq_len × dtype_bytes × batch",
            f"{n} × ({shape.kv_lora_rank} + {shape.qk_rope_head_dim}) × {seq:,} × {size} "
            f"× {batch:,}",
        )
    tokens, held = "seq_len", f"{seq:,}"
    if kind in ("sliding", "chunked"):
        tokens, held = "min(seq_len, window)", f"min({seq:,}, {shape.window:,})"
    return (
        f"2 × layers × kv_heads × head_dim × {tokens} × dtype_bytes × batch",
        f"2 × {n} × {shape.kv_heads} × {shape.head_dim} × {held} × {size} × {batch:,}",
    )


def _max_tokens(cost, room: int, growing: int, bounded_at: int) -> int | None:
    """Longest sequence n with cost(n) ≤ room; None when the cost stops growing below room.

    cost is non-decreasing in n, so a binary search finds it exactly for any mix of full,
    sliding and paged layers.
    """
    if growing == 0:
        if cost(bounded_at) <= room:
            return None
        hi = bounded_at
    else:
        hi = room // growing + 1  # cost(n) ≥ growing · n, so hi cannot fit
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_cache(
    shape: ModelShape,
    seq: int | None = None,
    batch: int = 1,
    dtype: str = "fp16",
    tp: int = 1,
    gpu_mem: int | None = None,
    weight_dtype: str = "fp16",
    block_size: int | None = None,
) -> SizeResult:
    """The KV cache of `shape` at `seq` tokens × `batch`, per GPU under `tp`, and what fits.

    seq defaults to the model's context window when the config declares one.
    """
    notes: list[str] = []
    if seq is None:
        if shape.max_positions is None:
            raise SizingError("no --seq given and the model declares no context window; "
                              "expected --seq N")
        seq = shape.max_positions
        notes.append(f"--seq defaults to the model's context window, {seq:,} tokens")
    _positive("--seq", seq)
    _positive("--batch", batch)
    _positive("--tp", tp)
    if block_size is not None:
        _positive("--block-size", block_size)
        if gpu_mem is None:
            raise SizingError(f"--block-size {block_size} given without --gpu-mem: expected "
                              "both, the block size only changes what fits")
    dtype = canonical_dtype(dtype)
    bits = DTYPE_BITS[dtype]
    weight_dtype = canonical_dtype(weight_dtype)
    if shape.max_positions is not None and seq > shape.max_positions:
        notes.append(
            f"--seq {seq:,} is past the context window the config declares "
            f"({shape.max_positions:,}); the bytes are still what such a cache would hold"
        )

    counts = shape.kind_counts()
    kinds: list[KindRow] = []
    for kind, n in counts.items():
        values = _values_per_token(shape, kind)
        per_layer = bytes_for_values(values, bits)
        held = tokens_held(shape, kind, seq)
        total = n * per_layer * held * batch
        symbols, numbers = ("", "") if kind == "none" else _kind_formula(
            shape, kind, n, seq, bits, batch)
        kinds.append(KindRow(kind, n, values, per_layer, held, total, symbols, numbers))
    total_bytes = sum(row.total_bytes for row in kinds)
    bytes_per_token = sum(row.layers * row.bytes_per_token_per_layer for row in kinds)
    main = max(kinds, key=lambda row: (row.kind != "none", row.layers))
    with_kv = [row for row in kinds if row.formula]
    formula = []
    for row in with_kv:
        indent = ""
        if len(with_kv) > 1:
            formula.append(f"{row.kind} ({row.layers} layers):")
            indent = "  "
        formula += [f"{indent}bytes = {row.formula}", f"{indent}      = {row.substituted}",
                    f"{indent}      = {row.total_bytes:,}"]
    if len(with_kv) > 1:
        formula.append(f"total = {' + '.join(f'{r.total_bytes:,}' for r in with_kv)} "
                       f"= {total_bytes:,} bytes")
    if "none" in counts:
        notes.append(
            f"{counts['none']} layers without attention (linear attention / Mamba / MLP) hold no "
            "KV; their fixed-size recurrent state, if any, is not counted"
        )
    if bits < 16:
        notes.append(
            f"{dtype} counts the values only; per-group scales add a few percent in practice"
        )

    mha_per_token = mha_total = reduction = None
    if shape.heads is not None:
        mha_per_layer = {k: bytes_for_values(_mha_values_per_token(shape, k), bits)
                         for k in counts}
        mha_per_token = sum(n * mha_per_layer[k] for k, n in counts.items())
        mha_total = sum(n * mha_per_layer[k] * tokens_held(shape, k, seq) * batch
                        for k, n in counts.items())
        if total_bytes:
            reduction = mha_total / total_bytes
        if shape.is_mla:
            notes.append(
                "the multi-head baseline for MLA is the decompressed cache: "
                f"{shape.heads} heads × ({shape.qk_nope_head_dim} + {shape.qk_rope_head_dim} key "
                f"+ {shape.v_head_dim} value) per token per layer"
            )

    tp_result = _tensor_parallel(shape, counts, bits, seq, batch, tp) if tp > 1 else None
    per_gpu = _per_gpu_bytes_per_token(shape, counts, bits, tp)

    fit = None
    if gpu_mem is not None:
        fit = _fit(shape, counts, per_gpu, seq, batch, tp, gpu_mem, weight_dtype, block_size)

    return SizeResult(
        model=shape.name,
        source=shape.source,
        shape=shape,
        dtype=dtype,
        dtype_bits=bits,
        seq=seq,
        batch=batch,
        bytes_per_token=bytes_per_token,
        bytes_per_token_per_layer=main.bytes_per_token_per_layer,
        total_bytes=total_bytes,
        kinds=tuple(kinds),
        formula=tuple(formula),
        mha_bytes_per_token=mha_per_token,
        mha_total_bytes=mha_total,
        reduction=reduction,
        tp=tp_result,
        fit=fit,
        notes=tuple(notes),
    )


def _kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """KV heads on each GPU: split evenly, or one replicated head when there are fewer than GPUs.

    These are the rules vLLM enforces: query heads must split evenly, and KV heads either
    split evenly or divide the GPU count so that whole groups of GPUs share one head.
    """
    if shape.heads is not None and shape.heads % tp:
        raise SizingError(
            f"--tp {tp} does not divide the {shape.heads} attention heads: expected a divisor "
            f"of {shape.heads}"
        )
    if shape.is_mla or set(shape.layer_kinds) == {"none"}:
        return 0
    if shape.kv_heads >= tp:
        if shape.kv_heads % tp:
            raise SizingError(
                f"--tp {tp} does not divide the {shape.kv_heads} KV heads: expected a divisor of "
                f"{shape.kv_heads}, or a multiple of it to replicate them"
            )
        return shape.kv_heads // tp
    if tp % shape.kv_heads:
        raise SizingError(
            f"--tp {tp} is not a multiple of the {shape.kv_heads} KV heads: with fewer KV heads "
            "than GPUs each head is replicated, so expected a multiple"
        )
    return 1


def _per_gpu_bytes_per_token(shape: ModelShape, counts: dict[str, int], bits: int,
                             tp: int) -> dict[str, int]:
    """Bytes per token per layer on one GPU, for each kind."""
    heads = _kv_heads_per_gpu(shape, tp)
    return {
        # The MLA latent belongs to no head, so it cannot be split: every GPU keeps all of it.
        kind: bytes_for_values(
            _values_per_token(shape, kind, kv_heads=heads if kind != "mla" else None), bits
        )
        for kind in counts
    }


def _tensor_parallel(shape: ModelShape, counts: dict[str, int], bits: int, seq: int, batch: int,
                     tp: int) -> TensorParallel:
    heads = _kv_heads_per_gpu(shape, tp)
    per_layer = _per_gpu_bytes_per_token(shape, counts, bits, tp)
    per_token = sum(n * per_layer[k] for k, n in counts.items())
    per_gpu = sum(n * per_layer[k] * tokens_held(shape, k, seq) * batch for k, n in counts.items())
    if shape.is_mla:
        replicas = tp
        note = (f"the MLA latent is shared by all heads, so it cannot be split: each of the {tp} "
                "GPUs holds the whole latent cache")
    elif heads and shape.kv_heads < tp:
        replicas = tp // shape.kv_heads
        note = (f"{shape.kv_heads} KV heads over {tp} GPUs: each head is replicated on "
                f"{replicas} GPUs, so each GPU holds 1 head")
    else:
        replicas = 1
        note = f"{shape.kv_heads} KV heads split {heads} per GPU; no replication"
    return TensorParallel(tp, heads, replicas, per_token, per_gpu, per_gpu * tp, note)


def _fit(shape: ModelShape, counts: dict[str, int], per_layer: dict[str, int], seq: int,
         batch: int, tp: int, gpu_mem: int, weight_dtype: str, block_size: int | None) -> Fit:
    if shape.params is None:
        raise SizingError(
            "--gpu-mem needs the weights' size: expected --model NAME or --params N "
            "(e.g. --params 6.74B)"
        )
    weights = bytes_for_values(shape.params, DTYPE_BITS[weight_dtype])
    # Tensor parallel splits every weight matrix; the norms it replicates are negligible.
    weights_per_gpu = -(-weights // tp)
    if weights_per_gpu >= gpu_mem:
        split = f" per GPU at --tp {tp}" if tp > 1 else ""
        raise SizingError(
            f"--gpu-mem {format_bytes(gpu_mem)} ({gpu_mem:,} bytes) is not more than the "
            f"weights{split}: {shape.params:,} params × {weight_dtype} = "
            f"{format_bytes(weights_per_gpu)}; expected more memory, a smaller --weight-dtype "
            "or a larger --tp"
        )
    room = gpu_mem - weights_per_gpu

    def cost(n: int, block: int | None = None) -> int:
        return sum(cnt * per_layer[k] * _round_up(tokens_held(shape, k, n), block)
                   for k, cnt in counts.items())

    growing = sum(cnt * per_layer[k] for k, cnt in counts.items() if k in ("full", "mla"))
    bounded_at = (shape.window or 0) + (block_size or 0)
    per_sequence = cost(seq)
    max_sequences = room // per_sequence if per_sequence else None
    paged = waste = paged_sequences = paged_tokens = None
    if block_size is not None:
        paged = cost(seq, block_size)
        waste = paged - per_sequence
        paged_sequences = room // paged if paged else None
        paged_tokens = _max_tokens(lambda n: cost(n, block_size), room, growing, bounded_at)
    return Fit(
        gpu_mem_bytes=gpu_mem,
        weight_dtype=weight_dtype,
        params=shape.params,
        weights_bytes=weights,
        weights_bytes_per_gpu=weights_per_gpu,
        room_bytes=room,
        max_tokens=_max_tokens(cost, room, growing, bounded_at),
        max_sequences=max_sequences,
        batch_bytes_per_gpu=per_sequence * batch,
        batch_fits=per_sequence * batch <= room,
        block_size=block_size,
        paged_bytes_per_sequence=paged,
        paged_waste_bytes_per_sequence=waste,
        max_sequences_paged=paged_sequences,
        max_tokens_paged=paged_tokens,
    )


@dataclass(frozen=True)
class ModelRow:
    """One preset as `kvcache models` lists it."""

    name: str
    hf_id: str
    params: int
    shape: ModelShape
    dtype: str
    bytes_per_token: int  # whole model, at `dtype`


def list_models(dtype: str = "fp16") -> tuple[ModelRow, ...]:
    """Every preset with its cache per token at `dtype`."""
    dtype = canonical_dtype(dtype)
    rows = []
    for p in PRESETS.values():
        shape = p.shape
        per_token = sum(
            n * bytes_for_values(_values_per_token(shape, kind), DTYPE_BITS[dtype])
            for kind, n in shape.kind_counts().items()
        )
        rows.append(ModelRow(p.name, p.hf_id, p.params, shape, dtype, per_token))
    return tuple(rows)


# ---------------------------------------------------------------------------------------------
# --verify: the formula against a real transformers cache
# ---------------------------------------------------------------------------------------------


class VerifyError(RuntimeError):
    """transformers could not build or run the model: a failure at run time, not bad input."""


# Widths the cache does not depend on, shrunk so a 70B-shaped layer builds in a second on a
# CPU. Attention widths (heads, KV heads, head_dim, MLA ranks) are never touched.
_SHRINK = {
    "vocab_size": 512,
    "intermediate_size": 64,
    "n_inner": 64,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
}
_VERIFY_WINDOW = 4  # a sliding window small enough to fill with a short prompt
_VERIFY_TOKENS = 8


def _verify_config(config: dict, max_layers: int) -> tuple[dict, list[str]]:
    """A copy of `config` with 1–3 representative layers and small non-attention widths."""
    import copy

    cfg = copy.deepcopy(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    if not cfg.get("model_type"):
        raise VerifyError("the config has no model_type: transformers cannot tell what to build")
    shape = shape_from_config(cfg)
    names = _layer_type_names(cfg, shape.layers, "config")
    changes: list[str] = []

    # One layer of each kind the model has (so a sliding/global model checks both), then
    # more of the first kind up to max_layers.
    picks: list[int] = []
    for kind in dict.fromkeys(shape.layer_kinds):
        picks.append(shape.layer_kinds.index(kind))
    for i in range(shape.layers):
        if len(picks) >= max_layers:
            break
        if i not in picks:
            picks.append(i)
    picks = sorted(picks)
    cfg[next(k for k in _LAYER_KEYS if k in cfg)] = len(picks)
    changes.append(f"layers {shape.layers} → {len(picks)} (original layers {picks})")
    if picks != list(range(len(picks))):
        cfg["layer_types"] = [names[i] for i in picks]

    for key, small in _SHRINK.items():
        if key == "n_inner" and cfg.get("model_type") == "gpt2":
            cfg.setdefault("n_inner", None)
        if key in cfg and (cfg[key] is None or (isinstance(cfg[key], int) and cfg[key] > small)):
            changes.append(f"{key} {cfg[key]} → {small}")
            cfg[key] = small
    if cfg.get("head_dim") is not None or cfg.get("kv_lora_rank") is not None:
        # head_dim is explicit, so the hidden width no longer sets it: shrink it too.
        hidden_key = next((k for k in _HIDDEN_KEYS if k in cfg), None)
        small = 8 * shape.heads
        if hidden_key and cfg[hidden_key] > small:
            changes.append(f"{hidden_key} {cfg[hidden_key]} → {small}")
            cfg[hidden_key] = small
    for key in ("sliding_window", "attention_chunk_size"):
        if cfg.get(key) and cfg[key] > _VERIFY_WINDOW and any(
            k in ("sliding", "chunked") for k in shape_from_config(cfg).layer_kinds
        ):
            changes.append(
                f"{key} {cfg[key]} → {_VERIFY_WINDOW}, so {_VERIFY_TOKENS} tokens overflow it"
            )
            cfg[key] = _VERIFY_WINDOW
    # Token ids past the shrunk vocabulary, hub-only loaders and quantised weights have no
    # bearing on the cache and would stop an offline CPU build.
    for key in {"bos_token_id", "eos_token_id", "pad_token_id"} | {
        k for k in cfg if k.endswith("_token_id")
    }:
        cfg[key] = None
    for key in ("quantization_config", "auto_map", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    return cfg, changes


def verify_cache(config: dict, dtype: str = "fp16", max_layers: int = 2) -> Verification:
    """Build `config` with a few layers and random weights on CPU, run a short forward with
    the cache on, and compare the bytes its cache tensors hold with the formula's."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise VerifyError(
            f"--verify needs torch and transformers ({error.name} is not installed): "
            "pip install 'kvcache[torch]'"
        ) from None

    cfg, changes = _verify_config(config, max_layers)
    dtype = canonical_dtype(dtype)
    explanation: list[str] = []
    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype not in torch_dtypes:
        # transformers' default cache stores the model's own dtype; a quantised cache needs
        # optional backends. The element count is what is being checked, so check it at bf16.
        explanation.append(f"a {dtype} cache needs a quantised-cache backend; checked at bf16")
        dtype = "bf16"
    shape = shape_from_config(cfg)
    model_type = cfg.pop("model_type")
    verbosity = transformers.logging.get_verbosity()
    # The shrunk model trips config warnings that say nothing about the cache; keep stderr clean.
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config, dtype=torch_dtypes[dtype]
            )
            model.eval()
            input_ids = torch.randint(0, hf_config.vocab_size, (1, _VERIFY_TOKENS))
            with torch.inference_mode():
                out = model(input_ids=input_ids, use_cache=True)
    except Exception as error:  # transformers raises many types; all mean "cannot build/run it"
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise VerifyError(
            f"transformers could not build and run model_type {model_type!r}: "
            f"{type(error).__name__}: {first[:200]}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise VerifyError(f"model_type {model_type!r} returned no layered cache to measure")

    bits = DTYPE_BITS[dtype]
    layers = []
    for index, (layer, kind) in enumerate(zip(cache.layers, shape.layer_kinds, strict=True)):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in (keys, values)]
        measured = sum(t.numel() * t.element_size() for t in (keys, values)
                       if isinstance(t, torch.Tensor))
        expected = bytes_for_values(_values_per_token(shape, kind), bits) * tokens_held(
            shape, kind, _VERIFY_TOKENS)
        layers.append(VerifyLayer(index, kind, shapes[0], shapes[1], measured, expected))
    measured = sum(layer.measured_bytes for layer in layers)
    formula = sum(layer.formula_bytes for layer in layers)
    explanation.extend(_explain(shape, layers, bits))
    return Verification(
        model_type=model_type,
        dtype=dtype,
        tokens=_VERIFY_TOKENS,
        window=shape.window,
        layers=tuple(layers),
        measured_bytes=measured,
        formula_bytes=formula,
        matches=measured == formula,
        changes=tuple(changes),
        explanation=tuple(explanation),
    )


def _explain(shape: ModelShape, layers: list[VerifyLayer], bits: int) -> list[str]:
    """Why a layer's real cache differs from the formula, when it does."""
    lines = []
    for layer in layers:
        if layer.measured_bytes == layer.formula_bytes:
            continue
        per_token = bytes_for_values(_values_per_token(shape, layer.kind), bits)
        decompressed = bytes_for_values(_mha_values_per_token(shape, layer.kind), bits)
        if layer.kind in ("sliding", "chunked") and (
            layer.measured_bytes == per_token * (shape.window - 1)
        ):
            lines.append(
                f"layer {layer.index} ({layer.kind}): transformers keeps window − 1 = "
                f"{shape.window - 1} tokens between steps and adds the new token's K/V inside "
                f"the step, so attention sees {shape.window}; the formula counts the whole "
                "window, which is what a serving engine allocates"
            )
        elif layer.kind == "mla" and layer.measured_bytes == decompressed * _VERIFY_TOKENS:
            lines.append(
                f"layer {layer.index} (mla): this transformers caches the decompressed per-head "
                f"keys and values, {shape.heads} × ({shape.qk_nope_head_dim} + "
                f"{shape.qk_rope_head_dim} + {shape.v_head_dim}) per token, "
                f"{decompressed / per_token:.1f}x the latent the formula counts"
            )
        else:
            lines.append(
                f"layer {layer.index} ({layer.kind}): the cache holds K {layer.key_shape} and "
                f"V {layer.value_shape}, {layer.measured_bytes:,} bytes against the formula's "
                f"{layer.formula_bytes:,}"
            )
    if not lines:
        lines.append("the real cache tensors hold exactly the formula's bytes")
    return lines
