"""Llama in PyTorch with a KV cache: rotary positions, grouped-query attention, RMSNorm, SwiGLU.

The family every model `kvcache size` is asked about belongs to (Llama, Qwen, Mistral,
SmolLM2). Parameter names are transformers' (`model.layers.0.self_attn.q_proj.weight`), so
a safetensors checkpoint loads key for key, and `forward` is GPT-2's contract: the new
tokens, where they sit (`caches.step.Step`), a cache. What differs from GPT-2, and why it
matters to the cache:

- positions are a rotation of q and k (RoPE), applied *before* the key is cached: a cached
  key carries its position, so a cache that evicts must decide what a kept key's position
  is (`kvcache break rope-decode` shows what forgetting it at decode costs);
- nkv < nh KV heads (grouped-query attention): the cache holds nkv heads, expanded to the
  query heads only inside attention (`caches.step`), never before the cache;
- RMSNorm before attention and MLP, and a gated MLP (SwiGLU); no biases.

Inside a forward, blocks and their parts are run by `module.forward(...)`, not
`module(...)`: nn.Module's call adds hook handling that no kvcache code uses, a few Python
frames that cost more than a decode's norm (Gemma 3 shares the blocks' calls). A recording
that shadows a module's `forward` (`bench.profile`) still sees every call; a forward hook
would not, so none is registered on these modules.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.caches.base import CacheShape, KVCache, LayerType
from kvcache_cli.caches.step import Step
from kvcache_cli.models import fused
from kvcache_cli.models.base import FamilyModel, causal_attention, heads, merge_heads
from kvcache_cli.models.linear import Linear


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads: n_head / n_kv_head query heads share each one
    n_embd: int  # the hidden size
    intermediate: int  # the MLP's inner width
    vocab_size: int
    context: int  # positions the model was trained for
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # n_embd / n_head unless a checkpoint says otherwise
    # How text becomes ids: "file:<tokenizer.json>" (read from a GGUF or a checkpoint).
    tokenizer: str = ""
    chat_template: str | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()  # ids that end a reply (the end-of-turn token first)
    name: str = "llama"
    gguf: str | None = None  # the GGUF file it was read from (llama.cpp runs the same)
    # What each layer attends over (`caches.base.LayerType`); () for full attention on
    # every layer. Sliding layers are Mistral's and Qwen2's; one rotary base for all.
    layer_types: tuple[LayerType, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.n_layer:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.n_layer} layers")
        if any(t.rope_theta not in (None, self.rope_theta) for t in self.layer_types):
            raise ValueError(f"a layer with a rotary base other than {self.rope_theta}: "
                             "Llama rotates every layer with one")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} query heads do not split into groups of "
                             f"{self.n_kv_head} KV heads")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"hidden size {self.n_embd} is not a multiple of "
                             f"{self.n_head} heads")
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} is odd: rotary pairs need it even")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def cache_shape(self) -> CacheShape:
        # The rotation too: a bounded cache under `:rerotate` moves kept keys with it.
        return CacheShape(self.n_layer, self.n_kv_head, self.head_size, self.context,
                          rope=RopeShift(self.head_size, self.rope_theta),
                          layer_types=self.layer_types)

    def param_count(self) -> int:
        """Parameters of a Llama of this shape (a tied head counted once)."""
        C, hs, L = self.n_embd, self.head_size, self.n_layer
        attn = C * hs * (2 * self.n_head + 2 * self.n_kv_head)  # q, o; k, v
        mlp = 3 * C * self.intermediate  # gate, up, down
        head = 0 if self.tie_word_embeddings else self.vocab_size * C
        return self.vocab_size * C + L * (attn + mlp + 2 * C) + C + head

    def decode_flops(self, context: int) -> int:
        """FLOPs of one token's step at `context` cached positions: 2 per weight of every
        product (the head's, tied or not; the embedding is a lookup), plus attention's q.k
        and p.v over every cached key, per query head."""
        C, hs, L = self.n_embd, self.head_size, self.n_layer
        products = L * (C * hs * (2 * self.n_head + 2 * self.n_kv_head)
                        + 3 * C * self.intermediate) + self.vocab_size * C
        return 2 * products + 4 * L * self.n_head * hs * context


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm; on a decode's rows (`fused.rows`) one fused call, with
    the residual add before it where the block asks (`add_then_norm`, `norm_then_add`)."""

    offset = 0.0  # the gain is offset + weight (Gemma's is 1 + weight)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normed(self, x: Tensor) -> Tensor:
        """x scaled to unit root mean square, in float32 whatever the activations' dtype,
        as transformers' LlamaRMSNorm: a mean of squares in half precision loses the small
        channels."""
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def in_torch(self, x: Tensor) -> Tensor:
        return self.weight * self.normed(x).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if fused.rows(x):
            return fused.rms_norm(x, self.weight, self.eps, self.offset)
        return self.in_torch(x)

    def add_then_norm(self, x: Tensor, delta: Tensor, delta_norm: RMSNorm | None = None
                      ) -> tuple[Tensor, Tensor]:
        """(x + delta, that sum normed): a residual add and the next sublayer's norm; delta
        normed by `delta_norm` first where given (Gemma's norm after each sublayer, of this
        norm's eps and form)."""
        if fused.rows(x):
            return fused.add_rms_norm(x, delta, None if delta_norm is None else
                                      delta_norm.weight, self.weight, self.eps, self.offset)
        x = x + (delta if delta_norm is None else delta_norm.forward(delta))
        return x, self.forward(x)

    def norm_then_add(self, x: Tensor, delta: Tensor) -> Tensor:
        """x + delta normed: Gemma's residual add of a sublayer's normed output."""
        if fused.rows(x):
            return fused.add_normed(x, delta, self.weight, self.eps, self.offset)
        return x + self.forward(delta)


class Rotary(nn.Module):
    """cos and sin of every position's rotation angles, (context, hs), made once.

    Llama rotates the pair (x_i, x_{i + hs/2}) of each head by the angle p * theta^(-2i/hs)
    (transformers' rotate_half layout; a GGUF stores q and k rows interleaved for llama.cpp,
    and the loader restores this order).
    """

    lookup = True  # a step reads one row of each table (`measure.weight_bytes`)

    def __init__(self, config: LlamaConfig, theta: float | None = None, factor: float = 1.0):
        """The config's rotation, or one of base `theta` (a model with a base per layer
        type, Gemma 3), its positions divided by `factor` (transformers' "linear" scaling)."""
        super().__init__()
        hs = config.head_size
        # On the CPU even inside a meta-device context (a model built to be loaded): meta
        # kernels for these ops import torch's decompositions, seconds on 2 cores.
        steps = torch.arange(0, hs, 2, device="cpu").float() / hs
        inv_freq = 1.0 / ((theta or config.rope_theta) ** steps) / factor  # (hs/2,)
        angles = torch.outer(torch.arange(config.context, device="cpu").float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (ctx, hs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def at(self, pos: Tensor, dtype: torch.dtype) -> RotaryAt:
        """The rotation to positions pos, (T,) for every row or (B, T): a forward makes it
        once and its 30 layers share it (SmolLM2 looked the table up 120 times a step, four
        small ops each)."""
        return RotaryAt(self, pos, dtype)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (B, h, T, hs) rotated to positions pos: (T,) for every row, or (B, T)."""
        return self.at(pos, x.dtype)(x)


@dataclass
class RotaryAt:
    """`Rotary` at the positions of one forward's tokens. The tables' rows are looked up
    when the torch path first rotates, once for every layer; a decode's fused rows read
    the tables by position (`fused.qk_rotary`), so their step makes no lookup."""

    table: Rotary
    pos: Tensor  # (T,) or (B, T)
    dtype: torch.dtype  # the activations'
    # cos and sin at these positions, (T, hs) or (B, 1, T, hs), once looked up (an
    # attribute set, not functools.cached_property, whose lock torch.compile cannot trace)
    rows: tuple[Tensor, Tensor] | None = dataclasses.field(default=None, init=False, repr=False)

    def cos_sin(self) -> tuple[Tensor, Tensor]:
        if self.rows is None:
            t, pos = self.table, self.pos
            cos, sin = t.cos[pos].to(self.dtype), t.sin[pos].to(self.dtype)  # (T|B,T, hs)
            if pos.dim() == 2:  # per row: one more axis for the heads
                cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs)
            self.rows = cos, sin
        return self.rows

    def __call__(self, x: Tensor) -> Tensor:
        """x (B, h, T, hs) rotated to these positions."""
        cos, sin = self.cos_sin()
        half = x.size(-1) // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
        return x * cos + rotated * sin

    def moved_to(self, pos: Tensor) -> RotaryAt:
        """The same table at other positions."""
        return self.table.at(pos, self.dtype)


@dataclass(frozen=True)
class RopeShift:
    """`Rotary`'s rotation by any positions, as a cache that moves kept keys calls it
    (`caches.base.Rope`): angles computed from the positions given, not read from the
    table, so a shift can be negative or past the context. The rotation of p then d is
    that of p + d up to float32 rounding of the angles (about 1e-6 of a key)."""

    head_size: int
    theta: float
    factor: float = 1.0  # positions divided by it ("linear" scaling), as `Rotary`'s

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., S, hs) rotated by positions broadcastable to x.shape[:-1]."""
        hs = self.head_size
        steps = torch.arange(0, hs, 2, device=x.device).float() / hs
        inv_freq = 1.0 / (self.theta ** steps) / self.factor
        angles = positions.float()[..., None] * inv_freq  # (..., hs/2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., hs)
        half = hs // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
        return (x.float() * angles.cos() + rotated.float() * angles.sin()).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer  # which slot of the cache is this layer's
        # A sliding layer's window, which the naive loop applies itself (a cache applies
        # its own: `caches.hybrid`); None for full attention.
        self.window = config.layer_types[layer].window if config.layer_types else None
        self.n_head, self.n_kv_head, self.head_size = (config.n_head, config.n_kv_head,
                                                       config.head_size)
        C, hs = config.n_embd, config.head_size
        # q, k and v of one input in one product (GPT-2's c_attn); the checkpoint's
        # q_proj, k_proj and v_proj are its rows (`FUSED`).
        self.qkv_proj = Linear(C, (config.n_head + 2 * config.n_kv_head) * hs, bias=False)
        self.o_proj = Linear(config.n_head * hs, C, bias=False)
        # Gemma 3's QK-norm and query scale (`Gemma3Attention`); Llama has neither.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.q_scale = 1.0

    def project(self, x: Tensor, rope: RotaryAt) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, nh, T, hs) and k, v (B, nkv, T, hs) of x (B, T, C), q and k normed (where
        the family norms them) and rotated."""
        B, T, _ = x.shape
        nh, nkv = self.n_head, self.n_kv_head
        qkv = self.qkv_proj.forward(x)  # (B, T, H * hs)
        if fused.rows(x):  # q's and k's heads normed and rotated in place, one call
            norms = [None if n is None else n.weight for n in (self.q_norm, self.k_norm)]
            offset, eps = (0.0, 0.0) if self.q_norm is None else (self.q_norm.offset,
                                                                  self.q_norm.eps)
            fused.qk_rotary(qkv, nh, nkv, rope.table.cos, rope.table.sin, rope.pos, *norms,
                            offset, eps, self.q_scale)
            hs = self.head_size
            return heads(qkv, 0, nh, hs), heads(qkv, nh, nkv, hs), heads(qkv, nh + nkv, nkv, hs)
        qkv = qkv.view(B, T, nh + 2 * nkv, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        return (*self.rotated(qkv[:, :nh + nkv], rope), qkv[:, nh + nkv:])

    def rotated(self, qk: Tensor, rope: RotaryAt) -> tuple[Tensor, Tensor]:
        """q (B, nh, T, hs) and k (B, nkv, T, hs) of q's and k's heads qk, rotated in torch."""
        qk = rope(qk)  # (B, nh + nkv, T, hs): q's and k's heads at once
        return qk[:, :self.n_head], qk[:, self.n_head:]

    def forward(self, x: Tensor, step: Step, rope: RotaryAt, cache: KVCache | None) -> Tensor:
        q, k, v = self.project(x, rope)
        if cache is None:  # the naive loop: every position, every step
            y = (causal_attention(q, k, v) if self.window is None else
                 step.by_position(q, k, v, step.pos, self.window))  # keys: these tokens
            return self.o_proj.forward(merge_heads(y))
        y = cache.attend(self.layer, q, k, v, step)  # (B, nh, T, hs)
        return self.o_proj.forward(merge_heads(y))  # (B, T, C)


class LlamaMLP(nn.Module):
    activation = "silu"  # of the gate (SwiGLU); one of `fused.ACTIVATIONS`

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.intermediate = config.intermediate
        # gate and up of one input in one product; the checkpoint's gate_proj and
        # up_proj are its rows (`FUSED`).
        self.gate_up_proj = Linear(config.n_embd, 2 * config.intermediate, bias=False)
        self.down_proj = Linear(config.intermediate, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj.forward(x)  # (B, T, 2I)
        if fused.rows(x):
            return self.down_proj.forward(fused.glu(gate_up, self.activation))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # (B, T, I) each
        return self.down_proj.forward(self.gated(gate) * up)

    def gated(self, gate: Tensor) -> Tensor:
        return F.silu(gate)  # SwiGLU


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, step: Step, rope: RotaryAt, cache: KVCache | None) -> Tensor:
        x, h = self.post_attention_layernorm.add_then_norm(
            x, self.self_attn.forward(self.input_layernorm.forward(x), step, rope, cache))
        return fused.add(x, self.mlp.forward(h))


# The products that read one input, each run as one matrix whose rows are the
# checkpoint's matrices, in this order: what a decode step dispatches per layer falls
# from 7 products to 4. state_dict() and load_state_dict() speak the checkpoint's names
# (`split_fused`, `join_fused`), so transformers, GGUF files and exports never see these.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fused_rows(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Each fused product's rows per part, in `FUSED`'s order."""
    q, kv = config.n_head * config.head_size, config.n_kv_head * config.head_size
    return {"self_attn.qkv_proj": (q, kv, kv),
            "mlp.gate_up_proj": (config.intermediate, config.intermediate)}


def join_fused(state: dict, config: LlamaConfig, prefix: str = "") -> None:
    """A checkpoint's q/k/v and gate/up matrices, in place, as the fused products' rows. A
    layer missing any of a group's parts keeps what it has under the checkpoint's names,
    so load_state_dict names what is missing and what it did not expect."""
    for layer in range(config.n_layer):
        block = f"{prefix}model.layers.{layer}."
        for product, parts in FUSED.items():
            names = [f"{block}{part}.weight" for part in parts]
            if not all(name in state for name in names):
                continue
            state[f"{block}{product}.weight"] = torch.cat([state.pop(n) for n in names])


def split_fused(state: dict, config: LlamaConfig, prefix: str = "") -> None:
    """The fused products' matrices, in place, under the checkpoint's names: each tensor
    of a fused product whose first axis is its rows (a weight; an int8 product's
    scales) cut into its parts. Packed 4-bit planes are left whole."""
    rows = fused_rows(config)
    for layer in range(config.n_layer):
        block = f"{prefix}model.layers.{layer}."
        for product, parts in FUSED.items():
            for field in ("weight", "scales"):
                name = f"{block}{product}.{field}"
                if name not in state or state[name].size(0) != sum(rows[product]):
                    continue
                for part, t in zip(parts, state.pop(name).split(rows[product])):
                    state[f"{block}{part}.{field}"] = t


class Llama(FamilyModel):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        build_body(self, config, LlamaBlock, RMSNorm)
        self.rotary = Rotary(config)

    def forward(self, idx: Tensor, step: int | Tensor | Step, cache: KVCache | None = None,
                *, last_only: bool = False) -> Tensor:
        """Logits (B, T, vocab) for tokens idx (B, T) where `step` puts them: GPT's contract
        (`base.FamilyModel.forward`), positions given by rotating q and k."""
        if not isinstance(step, Step):
            step = Step.at(step, idx.size(1), self.config.context, idx.device)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        rope = self.rotary.at(step.pos, x.dtype)  # looked up once, for every layer
        for block in self.model.layers:  # `forward`, not the call: module docstring
            x = block.forward(x, step, rope, cache)
        if last_only:
            x = step.last_rows(x)  # (B, 1, C): the LM head is the largest matmul
        return self.lm_head(self.model.norm(x))  # (B, T, vocab), or (B, 1, vocab)

    def checkpoint_names(self, state: dict[str, Tensor]) -> None:
        split_fused(state, self.config)

    def first_layers(self, n_layer: int) -> Llama:
        return first_layers(self, n_layer)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens


def build_body(model: FamilyModel, config, block: type[nn.Module], norm: type[nn.Module]
               ) -> None:
    """What every family built as Llama is holds, set on `model`: its config, the embedding,
    the blocks, the final norm and the head (tied where the config says), and the
    checkpoint's names in and out (`FUSED`)."""
    model.config = config
    # An embedding handed an empty weight skips nn's init, which on the meta device (a
    # model built to be loaded) imports torch's compiler stack: seconds on 2 cores.
    weight = torch.empty(config.vocab_size, config.n_embd)  # (vocab, C)
    model.model = nn.ModuleDict(dict(
        embed_tokens=nn.Embedding(config.vocab_size, config.n_embd, _weight=weight),
        layers=nn.ModuleList(block(config, i) for i in range(config.n_layer)),
        norm=norm(config.n_embd, config.rms_eps),
    ))
    model.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model._register_state_dict_hook(
        lambda module, state, prefix, meta: split_fused(state, module.config, prefix))
    model._register_load_state_dict_pre_hook(
        lambda state, prefix, *rest: join_fused(state, model.config, prefix))


def first_layers(model, n_layer: int):
    """The first n_layer blocks of a model built as Llama is (`model.embed_tokens`, `layers`,
    `norm`; `rotary`, `lm_head`), its final norm and head, sharing its weights (speculative
    decoding's self-draft): no copy. Built on the meta device, then given the weights."""
    config = model.config
    with torch.device("meta"):
        draft = type(model)(dataclasses.replace(config, n_layer=1,
                                                layer_types=config.layer_types[:1]))
    draft.config = dataclasses.replace(config, n_layer=n_layer,
                                       layer_types=config.layer_types[:n_layer])
    draft.model = nn.ModuleDict(dict(embed_tokens=model.model.embed_tokens,
                                     layers=model.model.layers[:n_layer],
                                     norm=model.model.norm))
    draft.rotary, draft.lm_head = model.rotary, model.lm_head
    return draft


def to_hf(model: Llama):
    """A transformers LlamaForCausalLM holding the same weights (for comparisons)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    c = model.config
    hf_config = HFLlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head, head_dim=c.head_size,
        max_position_embeddings=c.context, rms_norm_eps=c.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=False, mlp_bias=False,
        bos_token_id=c.bos_id, eos_token_id=c.eos_ids[0] if c.eos_ids else None,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config)
    state = {k: t.detach().float().contiguous() for k, t in model.state_dict().items()}
    hf.load_state_dict(state, strict=False, assign=True)
    if c.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config)  # off the meta device
    missing = [k for k in hf.state_dict() if k not in state and k != "lm_head.weight"]
    if missing:
        raise ValueError(f"to_hf: weights not copied: {missing[:3]}")
    return hf.to(device=model.device, dtype=model.dtype).eval()


def init_random(model: Llama, std: float, seed: int) -> Llama:
    """Seeded random weights (norm gains 1): a Llama of any shape to test and time."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = std / math.sqrt(2 * model.config.n_layer) if residual else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model
