"""What sizing reports beyond the arithmetic: every cache kind's bytes held by a model
kvcache runs (`size -m smollm2`), and the bytes transformers' own cache holds, layer by
layer, against the prediction (`size --verify`). Data only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindHeld:
    spec: str  # the kind, as --cache spells it in full (int4:g32:kchan:r128)
    kv_heads: int
    bytes_held: int  # one sequence of `seq` tokens, every layer
    bytes_per_token: float  # bytes_held / seq
    ratio_to_static: float


@dataclass(frozen=True)
class LiveKinds:
    """What every cache kind holds for one sequence of a model kvcache runs."""

    model: str
    dtype: str  # what the caches keep at full precision
    seq: int
    kinds: tuple[KindHeld, ...]
    mha: KindHeld  # the static cache of the same model with a KV head per query head
    left_out: tuple[str, ...]


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
    measured_bytes: int  # K/V (and indexer keys) in every layer
    formula_bytes: int
    state_measured_bytes: int  # recurrent states (conv + SSM) in every layer
    state_formula_bytes: int
    matches: bool  # K/V and states both exactly the formula's
    window_convention_only: bool  # every difference is transformers' window − 1 (see _explain)
    changes: tuple[str, ...]  # what was shrunk to build it fast; none of it changes the cache
    explanation: tuple[str, ...]
