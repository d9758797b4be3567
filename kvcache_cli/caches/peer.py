"""The peer: transformers' `QuantizedCache` (quanto backend) behind our `KVCache` interface.

Each layer is transformers' own `QuantoQuantizedLayer` (optimum-quanto's packed codes,
a scale and a shift per group of G channels of a token, at the model's dtype), fed the
keys and values our attention computes, so `eval` and `bench` compare its quantisation
with ours on the same weights, text and attention. What it does, as transformers does:
a prefill is returned unquantised and then quantised whole; decoded tokens gather in a
residual of up to R - 1 tokens, and when it fills, the whole cache (codes dequantised,
plus the residual) is quantised again. Every step dequantises the whole cache.

Spec: `quanto-int4[:gN][:rN]`, `quanto-int2[...]`, transformers' defaults g64, r128
(its axis 0: groups run along a token's channels, for keys and values alike).
Needs `optimum-quanto` (the `test` extra); made lazily, so nothing else pays for it.
"""

from __future__ import annotations

from torch import Tensor

from kvcache_cli.caches.base import KVCache, RollbackError, nbytes


def quanto_missing() -> str | None:
    from importlib.util import find_spec

    if find_spec("optimum") is None or find_spec("optimum.quanto") is None:
        return ("transformers' QuantizedCache (quanto-int4, quanto-int2) needs optimum-quanto, "
                "which is not installed: pip install optimum-quanto")
    return None


class QuantoCache(KVCache):
    def __init__(self, shape, batch: int, device, dtype, *, bits: int, group: int,
                 residual: int):
        missing = quanto_missing()
        if missing:
            raise ValueError(missing)
        self.shape, self.bits, self.group, self.residual = shape, bits, group, residual
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, batch, device, dtype, bits=spec["bits"], group=spec["group"],
                   residual=spec["residual"])

    def reset(self) -> None:
        from transformers.cache_utils import QuantoQuantizedLayer

        self.layers = [QuantoQuantizedLayer(nbits=self.bits, q_group_size=self.group,
                                            residual_length=self.residual)
                       for _ in range(self.shape.n_layer)]
        self.length = 0
        self.bytes_copied = 0

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        held = self.layers[layer].cumulative_length if self.layers[layer].is_initialized else 0
        if isinstance(start_pos, Tensor) or start_pos != held:
            raise ValueError(f"transformers' QuantizedCache appends: layer {layer} holds {held} "
                             f"positions, asked to write at {start_pos}")
        keys, values = self.layers[layer].update(k, v)  # (B, nkv, S, hs)
        self.bytes_copied += nbytes(keys) + nbytes(values)
        self.length = start_pos + k.size(2)
        return keys, values

    def crop(self, length: int) -> None:
        raise RollbackError("transformers' QuantizedCache cannot roll back: its residual is "
                            "quantised into the codes together with the rest")

    @property
    def bytes_held(self) -> int:
        return sum(layer_bytes(layer) for layer in self.layers)


def layer_bytes(layer) -> int:
    """Bytes one transformers cache layer holds: a quantised layer's codes, scales and
    shifts (quanto) or zeros (HQQ) and its full-precision residual; any other layer's keys
    and values."""
    if not layer.is_initialized:
        return 0
    total = 0
    if getattr(layer, "_quantized_keys", None) is not None:
        for q in (layer._quantized_keys, layer._quantized_values):
            if isinstance(q, tuple):  # HQQ: (packed codes, meta holding scale and zero)
                codes, meta = q
                total += nbytes(codes) + nbytes(meta["scale"]) + nbytes(meta["zero"])
            else:  # quanto's QBitsTensor
                total += nbytes(q._data._data) + nbytes(q._scale) + nbytes(q._shift)
    if layer.keys is not None and layer.keys.dim() == 4:  # at the model's dtype
        total += nbytes(layer.keys) + nbytes(layer.values)
    return total
