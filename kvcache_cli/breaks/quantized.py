"""The known failures of quantised KV caches, made visible on a model (SmolLM2 where it is
installed, GPT-2 or a Llama -m names), each beside its fix.

- `kv-outlier-keys`: a few key channels carry outliers (as in LLaMA-family models); one
  scale for a whole key vector (per token, the head's channels in one group) spends its
  levels on them and crushes the rest, where per-channel scales (KIVI) give each channel
  its own range;
- `kv-sink-token`: quantising the first token, the attention sink most heads park their
  weight on, against keeping it at full precision (sinks:1);
- `fp8-range`: fp8 with scale 1.0 on values beyond its range (they saturate at 448)
  against a scale calibrated on the prompt (amax / 448).

The outliers are put there without changing what the model computes: key channel c is
scaled up by s and the query channel c down by s (q.k is unchanged), value channel c up
by s and the output projection's row c down by s (the attention output is unchanged).
The exact cache's logits stay those of the original model, so the damage is the cache's
alone. Each break runs the same tokens teacher-forced (a prompt, then one token a step)
through the exact cache, the broken spec and the fixed one, and reports KL divergence
and top-1 agreement of the next-token distributions against the exact cache.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.breaks.base import DEFAULT_PROMPT_IDS
from kvcache_cli.breaks.registry import QUANT_BREAK_TOKENS
from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import ForwardingCache, KVCache
from kvcache_cli.generate import stream_tokens
from kvcache_cli.models.base import FamilyModel


@dataclass(frozen=True)
class QuantBreak:
    title: str
    broken: str  # what the broken cache does, one line
    fixed: str  # what the fix does
    outliers: str  # what is done to the model first ('' when nothing)


QUANT_BREAKS = {
    "kv-outlier-keys": QuantBreak(
        "quantised cache: outlier key channels under one scale per key vector",
        "int4, keys per token in one group of the head's channels",
        "int4, keys per channel in groups of 32 tokens (KIVI)",
        "4 key channels per head scaled x30 (queries /30: same model)"),
    "kv-sink-token": QuantBreak(
        "quantised cache: the attention-sink token quantised",
        "int2, per-channel keys, no residual, the first token quantised with the rest",
        "the same, the first token kept at full precision (s1)",
        ""),
    "fp8-range": QuantBreak(
        "quantised cache: fp8 with scale 1.0 on values beyond its range",
        "fp8-e4m3, one scale per tensor, 1.0",
        "fp8-e4m3, one scale per tensor calibrated on the prompt (amax / 448)",
        "4 value channels per head scaled x2000 (output projection /2000: same model)"),
}

OUTLIER_CHANNELS = 4
# The fix brings the figure back when its next-token distribution stays this close to the
# exact cache's: a mean KL a reader cannot tell in the text, and the same top choice almost
# everywhere. On random weights neither holds, and the verdict says so.
RESTORED_KL = 0.05  # nats
RESTORED_TOP1 = 0.95


@dataclass(frozen=True)
class Damage:
    spec: str
    mean_kl: float  # nats, next-token distribution against the exact cache's
    max_kl: float
    top1_agreement: float  # share of positions whose argmax equals the exact cache's
    max_logit_diff: float
    bytes_per_token: float
    saturated: int | None  # fp8 numbers clamped to the range; None for other kinds
    first_token_error: float  # largest |key or value read - exact| of position 0, any layer


@dataclass(frozen=True)
class QuantBreakResult:
    name: str
    title: str
    outliers: str
    broken_what: str
    fixed_what: str
    tokens: int  # positions scored
    prompt_len: int
    broken: Damage
    fixed: Damage
    restored: bool  # the fix within RESTORED_KL and RESTORED_TOP1 of the exact cache

    @property
    def damage_ratio(self) -> float:
        """How many times the broken spec's mean KL exceeds the fix's."""
        return self.broken.mean_kl / max(self.fixed.mean_kl, 1e-12)


def _specs(name: str, head_size: int) -> tuple[str, str]:
    # Groups of 32, or of the largest power of two that divides a narrower head's width
    # (values are grouped along the head's channels, so the group must divide it).
    g = math.gcd(32, head_size)
    if name == "kv-outlier-keys":
        return f"int4:g{head_size}:ktok:r0", f"int4:g{g}:kchan:r0"
    if name == "kv-sink-token":
        return f"int2:g{g}:kchan:r0", f"int2:g{g}:kchan:r0:s1"
    return "fp8-e4m3:tensor:one", "fp8-e4m3:tensor:calib"


def with_outliers(model: FamilyModel, which: str, scale: float) -> FamilyModel:
    """A copy of `model` computing the same function, whose cached keys ('k') or values
    ('v') carry OUTLIER_CHANNELS channels per KV head `scale` times larger."""
    from kvcache_cli.models.llama import Llama

    out = copy.deepcopy(model)
    with torch.no_grad():
        if isinstance(out, Llama):
            _llama_outliers(out, which, scale)
        else:
            _gpt2_outliers(out, which, scale)
    return out


def _gpt2_outliers(out: FamilyModel, which: str, scale: float) -> None:
    C, nh = out.config.n_embd, out.config.n_head
    hs = C // nh
    channels = torch.tensor([h * hs + c for h in range(nh)
                             for c in range(1, hs, hs // OUTLIER_CHANNELS)])  # (nh * 4,)
    for block in out.transformer.h:
        attn = block.attn
        w, b = attn.c_attn.weight, attn.c_attn.bias  # (3C, C), (3C,): q, k, v rows
        if which == "k":  # k up, q down: every score q.k is unchanged
            w[C + channels] *= scale
            b[C + channels] *= scale
            w[channels] /= scale
            b[channels] /= scale
        else:  # v up, and the output projection's input channels down
            w[2 * C + channels] *= scale
            b[2 * C + channels] *= scale
            attn.c_proj.weight[:, channels] /= scale


def _llama_outliers(out: FamilyModel, which: str, scale: float) -> None:
    """The same on a Llama: the fused q, k, v rows, its KV heads shared by groups of query
    heads (a key channel scaled up means that channel of every query head in its group
    scaled down), and key channels taken in rotary pairs (c, c + hs/2): RoPE turns a pair
    as a whole, so scaling both by s commutes with it and q.k stays unchanged."""
    c = out.config
    nh, nkv, hs = c.n_head, c.n_kv_head, c.head_size
    group, half = nh // nkv, hs // 2
    firsts = list(range(1, half, half // (OUTLIER_CHANNELS // 2)))[:OUTLIER_CHANNELS // 2]
    pairs = [*firsts, *(f + half for f in firsts)]  # OUTLIER_CHANNELS channels of a head
    for layer in out.model.layers:
        attn = layer.self_attn
        w = attn.qkv_proj.weight  # ((nh + 2 nkv) hs, C): q's heads, k's, v's
        for j in range(nkv):
            queries = [h * hs + ch for h in range(j * group, (j + 1) * group) for ch in pairs]
            if which == "k":
                w[[(nh + j) * hs + ch for ch in pairs]] *= scale
                w[queries] /= scale
            else:  # v up; each query head's output channel through o_proj down
                w[[(nh + nkv + j) * hs + ch for ch in pairs]] *= scale
                attn.o_proj.weight[:, queries] /= scale


class _FirstToken(ForwardingCache):
    """Wraps a cache and keeps what attention read of position 0 on the last step that
    read the keys `update` returns (a quantised cache's steps over its codes do not: `read`
    reads what it holds once more)."""

    def __init__(self, inner: KVCache):
        super().__init__(inner)
        self.first: dict[int, Tensor] = {}
        read = inner.update

        def update(layer, start_pos, k, v):
            keys, values = read(layer, start_pos, k, v)  # (B, nh, S, hs)
            self.first[layer] = torch.cat([keys[:, :, 0], values[:, :, 0]], dim=-1)  # (B, nh, 2hs)
            return keys, values

        inner.update = update  # the one the wrapped cache's own `attend` calls

    def read(self) -> None:
        """What every layer holds of position 0 now, as a step reads it: `update` with no
        new token (B, nkv, 0, hs)."""
        for layer, first in list(self.first.items()):
            B, nkv, width = first.shape
            none = first.new_empty(B, nkv, 0, width // 2)
            self.inner.update(layer, self.length, none, none)


def _logits(model: FamilyModel, spec: str, idx: Tensor, prompt_len: int):
    """Next-token logits at every position from the prompt's last on, and the cache."""
    cache = _FirstToken(make_cache(spec, model, idx.size(1)))
    with torch.no_grad():
        steps = [model(idx[:, :prompt_len], 0, cache)[:, -1:]]
        steps += [model(idx[:, p:p + 1], p, cache) for p in range(prompt_len, idx.size(1))]
        cache.read()
    return torch.cat(steps, dim=1)[0].float(), cache  # (N, vocab)


def _damage(spec: str, logits: Tensor, cache, exact: Tensor, exact_cache) -> Damage:
    logp, ref = logits.log_softmax(-1), exact.log_softmax(-1)  # (N, vocab)
    kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)  # (N,)
    return Damage(
        spec=spec, mean_kl=kl.mean().item(), max_kl=kl.max().item(),
        top1_agreement=(logits.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        max_logit_diff=(logits - exact).abs().max().item(),
        bytes_per_token=cache.bytes_held / cache.length,
        saturated=getattr(cache.inner, "saturated", None),
        first_token_error=max((cache.first[i] - exact_cache.first[i]).abs().max().item()
                              for i in cache.first))


def run_quant_break(name: str, model: FamilyModel, tokens: list[int], prompt_len: int
                    ) -> QuantBreakResult:
    """The broken and the fixed spec of break `name` against the exact cache, teacher-forced
    on `tokens` (the first `prompt_len` prefilled)."""
    if name not in QUANT_BREAKS:
        raise ValueError(f"unknown break {name!r}: expected {', '.join(QUANT_BREAKS)}")
    if not 0 < prompt_len < len(tokens) <= model.config.context:
        raise ValueError(f"{len(tokens)} tokens with a {prompt_len}-token prompt: expected "
                         f"1 <= prompt < tokens <= {model.config.context}")
    info = QUANT_BREAKS[name]
    if name == "kv-outlier-keys":
        model = with_outliers(model, "k", 30.0)
    elif name == "fp8-range":
        model = with_outliers(model, "v", 2000.0)
    idx = torch.tensor([tokens], device=model.device)  # (1, T)
    exact, reference = _logits(model, "static", idx, prompt_len)
    broken_spec, fixed_spec = _specs(name, model.config.head_size)
    broken = _damage(broken_spec, *_logits(model, broken_spec, idx, prompt_len), exact, reference)
    fixed = _damage(fixed_spec, *_logits(model, fixed_spec, idx, prompt_len), exact, reference)
    restored = fixed.mean_kl <= RESTORED_KL and fixed.top1_agreement >= RESTORED_TOP1
    return QuantBreakResult(name, info.title, info.outliers, info.broken, info.fixed,
                            exact.size(0), prompt_len, broken, fixed, restored)


def quantised(name: str, model, max_new_tokens: int = 16, progress=None):
    """A quantised-cache break, scored on the default prompt and the exact cache's greedy
    continuation of it (a text every model has, offline)."""
    V = model.config.vocab_size
    prompt = [t % V for t in DEFAULT_PROMPT_IDS]
    n = min(max(max_new_tokens, QUANT_BREAK_TOKENS), model.config.context - len(prompt))
    text = prompt + list(stream_tokens(model, prompt, n, "static"))
    return run_quant_break(name, model, text, len(prompt))
