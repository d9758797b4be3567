"""kvcache's attention inside transformers: a function registered with transformers'
`AttentionInterface` as "kvcache", which a model runs once it is asked to
(`model.set_attn_implementation("kvcache")`, or `attn_implementation="kvcache"` at load).

transformers calls a model's attention function after each layer's `cache.update`, with
the queries, what `update` returned, and the mask it built from `get_mask_sizes`. For a
bridge layer whose kind attends its own way, `update` stored nothing and handed this
call's keys and values on (`layers.claim` finds the layer by them, and refuses a
model that changes them first): the cache's own
`KVCache.attend` then stores them and attends, exactly as in kvcache's models (codes
through the C++ kernel, masks by key positions, H2O's observed weights). Every other
layer (transformers' own sliding layers, the exact kinds) gets transformers' SDPA under
transformers' mask, which is sdpa's (`sdpa_mask`, registered beside the function).

What kvcache's attention has no term for is refused in one line, on every layer, since
SDPA has none either: a logit cap (Gemma 2), learned attention sinks (GPT-OSS), a position
bias (T5-like); and dropout or non-causal attention on a bridge layer.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kvcache_cli.hf.layers import ATTENTION, BridgeError, claim

# Arguments a model may pass that neither kvcache's attention nor SDPA computes.
_UNSERVED = {"softcap": "a logit cap (softcap)", "s_aux": "learned attention sinks",
             "sinks": "learned attention sinks", "position_bias": "a position bias"}


def kvcache_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: queries (B, nh, T, hs), keys and values
    (B, nkv, S, hs) as the layer's cache returned them -> (output (B, T, nh, hs), None)."""
    layer = claim(key, value)
    for name, what in _UNSERVED.items():
        if kwargs.get(name) is not None:
            raise BridgeError(f"{type(module).__name__}: {what}, which the kvcache attention "
                              "does not compute; run the model with its own attention")
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    if dropout or not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise BridgeError(f"layer {layer.index}: dropout, or attention that sees ahead (a "
                          "decoder configured as an encoder); kvcache's caches attend "
                          "causally, at inference")
    y = layer.attend(query, key, value, attention_mask, scaling)  # (B, nh, T, hs)
    return y.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, kvcache_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
