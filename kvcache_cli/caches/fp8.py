"""The fp8 KV cache (e4m3, e5m2): every key and value stored as torch's float8 over a
scale per tensor or head, fixed at 1.0 or calibrated on the prompt (the quantised
caches' design is in `quantized`)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.base import KVCache, RollbackError, nbytes
from kvcache_cli.caches.quantized import _cat
from kvcache_cli.caches.rotation import Rotation
from kvcache_cli.caches.spec_quantized import check_head_dim

FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


def fp8_range(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


class Fp8Cache(KVCache):
    """Keys and values stored as float8 (e4m3 or e5m2) over a float32 scale."""

    def __init__(self, shape, batch: int, device, dtype: torch.dtype, *, fmt: str,
                 per_head: bool, calibrate: bool, rotate: bool = False):
        check_head_dim(fmt, {"rotate": rotate}, shape.head_size)
        self.shape, self.batch, self.device, self.dtype = shape, batch, device, dtype
        self.rotation = Rotation(shape.head_size, device) if rotate else None
        self.store = FP8_DTYPES[fmt]
        self.max = fp8_range(self.store)
        # Every float8 value by its bits: a lookup reads them twice as fast as a cast.
        self.table = torch.arange(256, dtype=torch.uint8).view(self.store).float().to(device)
        self.per_head, self.calibrate = per_head, calibrate
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, batch, device, dtype, fmt=spec.kind, per_head=spec["scale"] == "head",
                   calibrate=spec["init"] == "calib", rotate=bool(spec["rotate"]))

    def reset(self) -> None:
        c = self.shape
        empty = (self.batch, c.n_kv_head, 0, c.head_size)  # (B, nkv, 0, hs)
        new = dict(device=self.device, dtype=self.store)
        self.k = [torch.empty(empty, **new) for _ in range(c.n_layer)]
        self.v = [torch.empty(empty, **new) for _ in range(c.n_layer)]
        heads = c.n_kv_head if self.per_head else 1
        # One scale per row (and head): (L, 2, B, heads), K's then V's; 1.0 until calibrated.
        self.scales = torch.ones(c.n_layer, 2, self.batch, heads, device=self.device)
        self.saturated = 0  # numbers beyond the range, clamped to it, since the last reset
        self.length = 0
        self.bytes_copied = 0

    def _calibrate(self, layer: int, which: int, x: Tensor) -> None:
        dims = (2, 3) if self.per_head else (1, 2, 3)
        amax = x.float().abs().amax(dim=dims).view(self.batch, -1)  # (B, heads)
        self.scales[layer, which] = (amax / self.max).clamp_min(torch.finfo(torch.float32).tiny)

    def _encode(self, layer: int, which: int, x: Tensor) -> Tensor:
        scale = self.scales[layer, which][:, :, None, None]  # (B, heads, 1, 1)
        y = x.float() / scale
        self.saturated += int((y.abs() > self.max).sum())
        return y.clamp_(-self.max, self.max).to(self.store)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(start_pos, Tensor) or start_pos != self.k[layer].size(2):
            raise ValueError(f"a quantised cache appends: layer {layer} holds "
                             f"{self.k[layer].size(2)} positions, asked to write at {start_pos}")
        if self.rotation is not None:  # the scales then fit the rotated numbers
            k, v = self.rotation.rotate(k), self.rotation.rotate(v)
        if self.calibrate and start_pos == 0:  # the prompt sets the scales
            self._calibrate(layer, 0, k)
            self._calibrate(layer, 1, v)
        self.k[layer] = _cat(self.k[layer], self._encode(layer, 0, k))  # (B, nkv, S, hs)
        self.v[layer] = _cat(self.v[layer], self._encode(layer, 1, v))
        self.bytes_copied += nbytes(self.k[layer]) + nbytes(self.v[layer])
        self.length = start_pos + k.size(2)
        return self._decode(layer, 0, self.k[layer]), self._decode(layer, 1, self.v[layer])

    def _decode(self, layer: int, which: int, x: Tensor) -> Tensor:
        values = self.table.take(x.view(torch.uint8).long())  # (B, nkv, S, hs) float32
        values = values * self.scales[layer, which][:, :, None, None]
        if self.rotation is not None:
            values = self.rotation.unrotate(values)
        return values.to(self.dtype)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise RollbackError(f"cannot crop to {length} positions: the cache holds "
                                f"{self.length}; expected 0..{self.length}")
        # Every token is stored alone: dropping the newest is exact (scales stay). Views,
        # no copy: the next append concatenates, as every append does.
        self.k = [k[:, :, :length] for k in self.k]
        self.v = [v[:, :, :length] for v in self.v]
        self.length = length

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for t in self.k + self.v) + nbytes(self.scales)
