"""KV-cache sizing for real models: shapes, bytes per layer kind, recurrent state, tensor
parallel, fit.

The article's formula, `bytes = 2 × layers × kv_heads × head_dim × seq_len × dtype_bytes ×
batch`, is right for a plain multi-head or grouped-query decoder. Real models bend it in ways
that online calculators get wrong, and this package gets right:

- grouped KV heads (Llama-2-70B and most models since cache 8 heads, not 64);
- head_dim given explicitly rather than hidden / heads (Gemma-2: 256, not 3584 / 16);
- MLA (DeepSeek-V2/V3) caches one compressed latent per token per layer, shared by K and V;
- sliding-window and chunked layers hold at most the window; layers that reuse another
  layer's cache hold none;
- Mamba and linear-attention layers hold no KV but a fixed-size state per sequence, which
  is reported beside the KV bytes and counted in what fits;
- the cache dtype is not the weights' dtype, and int4 is half a byte;
- GiB (2^30) is not GB (10^9).

The parts, each readable on its own: `units` (dtypes, byte formats, parsing, ranges),
`shape` (ModelShape and the shape flags), `config` (the config.json reader: a table of
layer-kind rules), `presets`, `arithmetic` (bytes, tensor parallel, fit) and `verify`
(against a real transformers cache; the only part that imports torch, lazily).
"""

from kvcache_cli.sizing.arithmetic import (
    Fit,
    KindRow,
    SizeResult,
    TensorParallel,
    mha_values_per_token,
    size_cache,
    state_bytes_per_sequence,
    tokens_held,
    values_per_token,
)
from kvcache_cli.sizing.config import (
    LAYER_RULES,
    LAYER_TYPE_KIND,
    load_config,
    shape_from_config,
)
from kvcache_cli.sizing.params import params_from_config
from kvcache_cli.sizing.presets import PRESETS, ModelRow, Preset, list_models, preset, resolve_shape
from kvcache_cli.sizing.shape import KINDS, ModelShape, shape_from_flags
from kvcache_cli.sizing.units import (
    DTYPE_BITS,
    LIMITS,
    ConfigError,
    SizingError,
    bytes_for_values,
    canonical_dtype,
    check_range,
    dtype_bits,
    format_bytes,
    format_gb,
    format_gib,
    nearest,
    parse_bytes,
    parse_count,
    parse_tokens,
)

# --verify's module is imported on first use: `kvcache size` without it never pays for it.
_VERIFY_NAMES = {"Verification", "VerifyError", "VerifyLayer", "_verify_config", "verify_cache"}


def __getattr__(name: str):
    if name in _VERIFY_NAMES:
        from kvcache_cli.sizing import verify

        return getattr(verify, name)
    raise AttributeError(f"module 'kvcache_cli.sizing' has no attribute {name!r}")


__all__ = [
    "DTYPE_BITS", "KINDS", "LAYER_RULES", "LAYER_TYPE_KIND", "LIMITS", "PRESETS", "ConfigError",
    "Fit", "KindRow", "ModelRow", "ModelShape", "Preset", "SizeResult", "SizingError",
    "TensorParallel", "Verification", "VerifyError", "VerifyLayer", "_verify_config",
    "bytes_for_values", "canonical_dtype", "check_range", "dtype_bits", "format_bytes",
    "format_gb", "format_gib", "list_models", "load_config", "mha_values_per_token", "nearest",
    "params_from_config", "parse_bytes", "parse_count", "parse_tokens", "preset",
    "resolve_shape", "shape_from_config",
    "shape_from_flags", "size_cache", "state_bytes_per_sequence", "tokens_held",
    "values_per_token", "verify_cache",
]
