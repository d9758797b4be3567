"""Gemma 3 (text) in PyTorch with a KV cache: Llama's blocks, five sliding layers to one global.

Google's Gemma 3 is Llama's family with a few changes, each written here once on Llama's
pieces (`models.llama`): the same fused products, rotation and grouped-query attention.
Parameter names are transformers' `Gemma3ForCausalLM`'s, so its state dict loads key for
key; `forward` is every family's contract (`base.FamilyModel`). What differs, and why it
matters to the cache:

- most layers attend over a sliding window (`config.layer_types`; the 270M's are 512
  positions, every 6th layer global): `cache_shape` says so, and `caches.make_cache` gives
  those layers a ring of their window, which is exact (the window is the model's math);
- a rotary base per layer type (10,000 on sliding layers, 1,000,000 on global ones, the
  global ones "linear"-scaled in the larger models): a `Rotary` per layer type, and the
  cache's `Rope` (moving kept keys under `:rerotate`) is the global layers' rotation, the
  only layers a spec's bound applies to;
- one KV head in the 270M (multi-query attention): a cached token is 2 x 256 numbers a layer;
- RMSNorm on each head's q and k before the rotation (QK-norm), so cached keys are normed;
- RMSNorm with gain (1 + weight), in float32 before the cast back; a norm before and after
  both attention and the MLP; a GeGLU MLP (tanh GELU); embeddings scaled by sqrt(hidden) in
  the activations' dtype; the head tied to the embedding; attention scaled by
  query_pre_attn_scalar ** -0.5; the logits optionally soft-capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.caches.base import CacheShape, KVCache, LayerType
from kvcache_cli.caches.step import Step
from kvcache_cli.models import fused
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.models.llama import (
    LlamaAttention,
    LlamaMLP,
    RMSNorm,
    RopeShift,
    Rotary,
    RotaryAt,
    build_body,
    first_layers,
    split_fused,
)

# transformers' names of the two layer kinds (`LayerType.kind`), in config.layer_types and
# as the keys of a 5.x config's rope_parameters.
HF_LAYER_TYPE = {"full": "full_attention", "sliding": "sliding_attention"}
TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh")  # what transformers calls GELU's tanh form


@dataclass(frozen=True)
class Gemma3Config:
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (one in the 270M: multi-query attention)
    n_embd: int  # the hidden size
    intermediate: int  # the MLP's inner width
    vocab_size: int
    context: int  # positions the model was trained for
    head_dim: int  # not n_embd / n_head: the 270M's 4 heads of 256 over a width of 640
    # What each layer attends over, with its rotary base (`caches.base.LayerType`).
    layer_types: tuple[LayerType, ...]
    query_pre_attn_scalar: int  # attention scores are q.k / sqrt(this), not / sqrt(hs)
    rms_eps: float = 1e-6
    # Each layer kind's "linear" rotary scaling ('full', 'sliding'): positions divided by
    # it. Gemma 3 4B and larger scale the global layers by 8; 1.0 is none.
    rope_factor_full: float = 1.0
    rope_factor_sliding: float = 1.0
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    tie_word_embeddings: bool = True
    tokenizer: str = ""  # "file:<tokenizer.json>"
    chat_template: str | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    name: str = "gemma3"
    gguf: str | None = None  # the GGUF file it was read from

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.n_layer:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.n_layer} layers")
        if any(t.rope_theta is None for t in self.layer_types):
            raise ValueError("a layer without its rotary base: Gemma 3 gives each layer type one")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} query heads do not split into groups of "
                             f"{self.n_kv_head} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} is odd: rotary pairs need it even")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar {self.query_pre_attn_scalar}: "
                             "expected a positive number")

    @classmethod
    def from_hf(cls, raw: dict, where: str = "config.json", **fields) -> Gemma3Config:
        """The config of transformers' `Gemma3TextConfig.to_dict()` or a checkpoint's
        config.json (model_type gemma3_text; 5.x's rope_parameters per layer type, or 4.x's
        rope_theta, rope_local_base_freq and rope_scaling); a ValueError in one line for
        what this model does not run. `fields`: the rest (tokenizer, name, gguf)."""
        from kvcache_cli.sizing.layer_types import layer_types_from_hf

        def refuse_unless(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{where}: {what}")

        act = raw.get("hidden_activation") or raw.get("hidden_act") or TANH_GELU[0]
        refuse_unless(act in TANH_GELU, f"hidden_activation {act!r}; Gemma 3 runs tanh GELU")
        refuse_unless(raw.get("attn_logit_softcapping") is None,
                      "attn_logit_softcapping is set; Gemma 3 has none, and the caches' "
                      "attention does not cap scores")
        refuse_unless(not raw.get("attention_bias"), "attention_bias is set; Gemma 3 has none")
        refuse_unless(not raw.get("use_bidirectional_attention"),
                      "use_bidirectional_attention is set: an encoder, not a causal model")
        factors = {f"rope_factor_{kind}": x for kind, x in _rope_factors(raw, where).items()}
        f = _shape(raw, where)
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        scalar = raw.get("query_pre_attn_scalar") or f["head_dim"]
        # Whole, as transformers types it; 256.0 is what folders converted before that was
        # known hold, read as 256 so that `hf_config` builds a config transformers accepts.
        refuse_unless(isinstance(scalar, (int, float)) and not isinstance(scalar, bool)
                      and 0 < scalar < 2**20 and scalar == int(scalar),
                      f"query_pre_attn_scalar is {scalar!r}; expected a positive whole number")
        return cls(
            **f, layer_types=layer_types_from_hf(raw, where), query_pre_attn_scalar=int(scalar),
            **factors,
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            bos_id=raw.get("bos_token_id"), eos_ids=eos, **fields)

    @property
    def head_size(self) -> int:
        return self.head_dim

    def rotation(self, kind: str) -> tuple[float, float]:
        """(rotary base, linear factor) of the layers of kind 'full' or 'sliding'."""
        theta = next(t.rope_theta for t in self.layer_types if t.kind == kind)
        return theta, getattr(self, f"rope_factor_{kind}")

    @property
    def cache_shape(self) -> CacheShape:
        # The rotation a bounded cache moves kept keys with: the global layers', the only
        # layers a spec's bound applies to (the sliding ones hold rings of their window).
        full = [t for t in self.layer_types if not t.sliding]
        rope = RopeShift(self.head_size, *self.rotation("full")) if full else None
        return CacheShape(self.n_layer, self.n_kv_head, self.head_size, self.context,
                          rope=rope, layer_types=self.layer_types)

    def param_count(self) -> int:
        """Parameters of a Gemma 3 of this shape (the tied head counted once)."""
        C, hs, L = self.n_embd, self.head_size, self.n_layer
        attn = C * hs * (2 * self.n_head + 2 * self.n_kv_head) + 2 * hs  # q, o; k, v; norms
        mlp = 3 * C * self.intermediate  # gate, up, down
        head = 0 if self.tie_word_embeddings else self.vocab_size * C
        return self.vocab_size * C + L * (attn + mlp + 4 * C) + C + head


# transformers' name of each shape field (`models.bounds` bounds them all, as a Llama's).
HF_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
            "intermediate": "intermediate_size", "vocab_size": "vocab_size",
            "context": "max_position_embeddings", "head_dim": "head_dim",
            "rms_eps": "rms_norm_eps"}


def _shape(raw: dict, name: str) -> dict:
    """The shape fields of a config dict, each within its bound and the whole within this
    machine's memory (`bounds`): a ValueError in one line naming the key, else."""
    from kvcache_cli.models import bounds

    values = {"num_key_value_heads": raw.get("num_attention_heads"), "rms_norm_eps": 1e-6,
              **{k: v for k, v in raw.items() if v is not None}}
    try:
        f = {field: bounds.number(bounds.BOUNDS[field], values[key], key)
             for field, key in HF_NAMES.items() if key in values}
        missing = [key for key in HF_NAMES.values() if key not in values and key != "head_dim"]
        if missing:
            raise ValueError(f"no {missing[0]}; expected a Gemma 3 config")
        bounds.check_shape(f, HF_NAMES.__getitem__)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    f.setdefault("head_dim", bounds.head_size(f))
    return f


def _rope_factors(raw: dict, name: str) -> dict[str, float]:
    """Each layer kind's linear rotary factor, {} for none: transformers 5 keys
    rope_parameters by layer type; 4.x's rope_scaling applied to the global layers only."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()):
        scaling = {kind: params.get(hf) for kind, hf in HF_LAYER_TYPE.items()}
    else:
        scaling = {"full": raw.get("rope_scaling")}
    factors = {}
    for kind, rope in scaling.items():
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        if rope_type == "linear":
            factors[kind] = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"{name}: rope_type {rope_type!r} on the {kind} layers; Gemma 3 "
                             "runs default and linear rotary scaling only")
    return factors


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with gain (1 + weight), applied in float32 before the cast back (Llama casts
    first): transformers' Gemma3RMSNorm, so a checkpoint's zero weight is a gain of 1."""

    offset = 1.0

    def in_torch(self, x: Tensor) -> Tensor:
        return (self.normed(x) * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with each head's q and k normed before the rotation, and q scaled
    so that SDPA's 1/sqrt(hs) makes Gemma's 1/sqrt(query_pre_attn_scalar): scaled before the
    cache, every kind's attention (its kernel, explicit weights) scores alike."""

    def __init__(self, config: Gemma3Config, layer: int):
        super().__init__(config, layer)
        self.q_norm = GemmaRMSNorm(config.head_size, config.rms_eps)
        self.k_norm = GemmaRMSNorm(config.head_size, config.rms_eps)
        self.q_scale = math.sqrt(config.head_size / config.query_pre_attn_scalar)  # 1 in 270M

    def rotated(self, qk: Tensor, rope: RotaryAt) -> tuple[Tensor, Tensor]:
        """q (B, nh, T, hs) and k (B, nkv, T, hs) of q's and k's heads qk, each normed, then
        rotated, in torch (`LlamaAttention.project` fuses the same on a decode's rows)."""
        nh = self.n_head
        q = rope(self.q_norm(qk[:, :nh]))  # (B, nh, T, hs)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, rope(self.k_norm(qk[:, nh:]))


class Gemma3MLP(LlamaMLP):
    activation = "gelu_tanh"

    def gated(self, gate: Tensor) -> Tensor:
        return F.gelu(gate, approximate="tanh")  # GeGLU


class Gemma3Block(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int):
        super().__init__()
        self.kind = config.layer_types[layer].kind  # which rotation it reads
        C, eps = config.n_embd, config.rms_eps
        self.input_layernorm = GemmaRMSNorm(C, eps)
        self.self_attn = Gemma3Attention(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(C, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(C, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(C, eps)

    def forward(self, x: Tensor, step: Step, rope: RotaryAt, cache: KVCache | None) -> Tensor:
        # Normed after each sublayer too, before the residual add: that norm, the add and
        # the next sublayer's norm one call on a decode's rows (`RMSNorm.add_then_norm`).
        x, h = self.pre_feedforward_layernorm.add_then_norm(
            x, self.self_attn.forward(self.input_layernorm.forward(x), step, rope, cache),
            self.post_attention_layernorm)
        return self.post_feedforward_layernorm.norm_then_add(x, self.mlp.forward(h))


_SCALES: dict[tuple[int, torch.dtype], float] = {}


def embedding_scale(n_embd: int, dtype: torch.dtype) -> float:
    """sqrt(C) made in float32 and rounded to the activations' dtype, as transformers does
    (in bfloat16 sqrt(640) = 25.298 is 25.25): a number, made once, so a step multiplies by
    it with one op, not four (a tensor made, cast and multiplied). Kept in a plain dict, not
    functools.cache, which torch.compile traces through with a warning."""
    if (n_embd, dtype) not in _SCALES:
        _SCALES[n_embd, dtype] = torch.tensor(n_embd ** 0.5).to(dtype).item()
    return _SCALES[n_embd, dtype]


def rotaries(config: Gemma3Config) -> nn.ModuleDict:
    """A `Rotary` per layer kind present ('full', 'sliding'), each of its base and factor."""
    kinds = dict.fromkeys(t.kind for t in config.layer_types)  # in layer order, once each
    return nn.ModuleDict({kind: Rotary(config, *config.rotation(kind)) for kind in kinds})


class Gemma3(FamilyModel):
    def __init__(self, config: Gemma3Config):
        super().__init__()
        build_body(self, config, Gemma3Block, GemmaRMSNorm)  # Llama's, its own block and norm
        self.rotary = rotaries(config)

    def forward(self, idx: Tensor, step: int | Tensor | Step, cache: KVCache | None = None,
                *, last_only: bool = False) -> Tensor:
        """Logits (B, T, vocab) for tokens idx (B, T) where `step` puts them (`FamilyModel`)."""
        if not isinstance(step, Step):
            step = Step.at(step, idx.size(1), self.config.context, idx.device)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        x = fused.scale(x, embedding_scale(self.config.n_embd, x.dtype))
        ropes = {kind: r.at(step.pos, x.dtype) for kind, r in self.rotary.items()}  # once each
        for block in self.model.layers:  # `forward`, not the call: `models.llama`'s docstring
            x = block.forward(x, step, ropes[block.kind], cache)
        if last_only:
            x = step.last_rows(x)  # (B, 1, C): the LM head is the largest matmul
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab), or (B, 1, vocab)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def checkpoint_names(self, state: dict[str, Tensor]) -> None:
        split_fused(state, self.config)

    def first_layers(self, n_layer: int) -> Gemma3:
        return first_layers(self, n_layer)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens


def hf_config(config: Gemma3Config):
    """transformers' Gemma3TextConfig of the same shape."""
    from transformers import Gemma3TextConfig

    rope = {}
    for kind, hf in HF_LAYER_TYPE.items():
        if any(t.kind == kind for t in config.layer_types):
            theta, factor = config.rotation(kind)
            rope[hf] = ({"rope_type": "default", "rope_theta": theta} if factor == 1.0 else
                        {"rope_type": "linear", "rope_theta": theta, "factor": factor})
    windows = {t.window for t in config.layer_types if t.sliding}
    if len(windows) > 1:
        raise ValueError(f"sliding windows {sorted(windows)}: transformers' Gemma 3 has one")
    return Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.n_embd,
        intermediate_size=config.intermediate, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        head_dim=config.head_size, max_position_embeddings=config.context,
        rms_norm_eps=config.rms_eps, query_pre_attn_scalar=config.query_pre_attn_scalar,
        layer_types=[HF_LAYER_TYPE[t.kind] for t in config.layer_types],
        sliding_window=windows.pop() if windows else None, rope_parameters=rope,
        final_logit_softcapping=config.final_logit_softcapping,
        tie_word_embeddings=config.tie_word_embeddings, hidden_activation=TANH_GELU[0],
        bos_token_id=config.bos_id, eos_token_id=config.eos_ids[0] if config.eos_ids else None,
        pad_token_id=None)


def to_hf(model: Gemma3):
    """A transformers Gemma3ForCausalLM holding the same weights (for comparisons)."""
    from transformers import Gemma3ForCausalLM

    config = hf_config(model.config)
    hf = Gemma3ForCausalLM(config)  # off the meta device: its rotary and scale buffers
    state = {k: t.detach().float().contiguous() for k, t in model.state_dict().items()}
    missing = [k for k in hf.state_dict() if k not in state and k != "lm_head.weight"]
    if missing:
        raise ValueError(f"to_hf: weights not copied: {missing[:3]}")
    hf.load_state_dict(state, strict=False)
    return hf.to(device=model.device, dtype=model.dtype).eval()
