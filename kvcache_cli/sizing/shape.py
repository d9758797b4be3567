"""The model shape: the numbers that decide a KV cache (and a recurrent state), and nothing else.

A shape comes from the command-line flags here, from a config.json (`config`), or from a
preset (`presets`); the arithmetic in `arithmetic` takes it from there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from kvcache_cli.sizing.units import SizingError, check_range

# What a layer keeps per token. "sliding" and "chunked" hold at most `window` tokens; "mla"
# holds one compressed latent; "recurrent" (Mamba, linear attention, short convolutions) holds
# no KV but a fixed-size state per sequence; "none" (MLP-only layers, layers that reuse another
# layer's cache) holds nothing at all.
KINDS = ("full", "sliding", "chunked", "mla", "recurrent", "none")


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a model's KV cache and recurrent state, and nothing else.

    hidden_size, vocabulary and FFN width are absent on purpose: the cache does not depend on
    them, and the weights' size comes from `params`.
    """

    name: str
    layers: int  # cache layers of every kind (one per attention block)
    heads: int | None  # query heads; None when unknown (no multi-head baseline then)
    kv_heads: int  # n_kv: K/V heads per attention layer (heads for MHA, 1 for MQA)
    head_dim: int  # hs: width of one K (and one V) head
    layer_kinds: tuple[str, ...]  # one of KINDS per layer
    window: int | None = None  # tokens a sliding/chunked layer holds at most
    kv_lora_rank: int = 0  # MLA: compressed latent c_KV, shared by K and V
    qk_rope_head_dim: int = 0  # MLA: the decoupled rotary key, shared by all heads
    qk_nope_head_dim: int = 0  # MLA: per-head key width after decompression (no rope)
    v_head_dim: int = 0  # width of one V head when not head_dim (MLA: after decompression)
    index_head_dim: int = 0  # sparse attention (DeepSeek-V3.2): one indexer key per token
    state_layers: int = 0  # layers that keep a recurrent state (recurrent and hybrid layers)
    conv_state_values: int = 0  # numbers in one such layer's convolution state, per sequence
    ssm_state_values: int = 0  # numbers in one such layer's SSM / linear-attention state
    ssm_state_bits: int = 0  # bits per SSM state value when the config fixes them; 0: --dtype
    params: int | None = None  # published parameter count, for the weights
    max_positions: int | None = None  # the context window the config declares
    source: str = ""  # where the numbers came from
    notes: tuple[str, ...] = ()  # what the reader decided that a reader of the figures should know
    # Per layer, the fields above that this layer sets differently, as (name, value) pairs;
    # () when every layer has the model's widths (Gemma 4's global layers are 512 wide).
    layer_overrides: tuple[tuple[tuple[str, int], ...], ...] = ()

    def layer_shape(self, index: int) -> ModelShape:
        """The shape that layer `index` caches with: the model's, or its own widths."""
        overrides = self.layer_overrides[index] if self.layer_overrides else ()
        return replace(self, layer_overrides=(), **dict(overrides)) if overrides else self

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """Layers that cache alike, grouped: by kind, then by their own widths."""
        counts = Counter(
            (kind, self.layer_overrides[i] if self.layer_overrides else ())
            for i, kind in enumerate(self.layer_kinds))
        ordered = sorted(counts, key=lambda key: (KINDS.index(key[0]), key[1]))
        return tuple(
            LayerGroup(kind, counts[kind, over],
                       replace(self, layer_overrides=(), **dict(over)) if over else self)
            for kind, over in ordered)

    def kind_counts(self) -> dict[str, int]:
        counts = Counter(self.layer_kinds)
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    @property
    def is_mla(self) -> bool:
        return "mla" in self.layer_kinds

    @property
    def has_kv(self) -> bool:
        return any(kind in ("full", "sliding", "chunked", "mla") for kind in self.layer_kinds)

    def describe(self) -> str:
        """'GQA-8', 'MHA', 'MQA', 'MLA', plus the window pattern: one word for a table."""
        if not self.has_kv:
            attention = "no attention"
        elif self.is_mla:
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
        if counts.get("recurrent") == self.layers:
            attention = "recurrent only"
        elif "recurrent" in counts:
            attention += f", {counts['recurrent']}/{self.layers} recurrent"
        if "none" in counts:
            attention += f", {counts['none']}/{self.layers} no cache"
        return attention


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind that cache alike: how many, and the shape they cache with."""

    kind: str
    layers: int
    shape: ModelShape


def shape_from_flags(
    layers: int,
    kv_heads: int | None,
    head_dim: int | None = None,
    heads: int | None = None,
) -> tuple[ModelShape, dict[str, Any]]:
    """A plain decoder given by its numbers, and the Llama config that builds it for --verify."""
    check_range("--layers", layers)
    if heads is not None:
        check_range("--heads", heads)
    if kv_heads is None:
        if heads is None:
            raise SizingError("the shape needs --kv-heads (or --heads for multi-head attention)")
        kv_heads = heads  # multi-head attention: every query head has its own K and V
    check_range("--kv-heads", kv_heads)
    head_dim = 128 if head_dim is None else check_range("--head-dim", head_dim)
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
