"""`--engine transformers`: a transformers model run by kvcache's own loops (generate's
stream, eval's scoring, bench's decode), its cache built by the bridge (`hf.kv_cache`).

`EngineModel` presents the model contract (`models.base.FamilyModel`): `forward(idx, step,
cache, last_only=...)` is one call of the transformers model with the bridge cache as its
`past_key_values`; positions and masks come from what the cache has seen, as in
`model.generate`. `make_cache` builds that cache, so `caches.make_cache` (which every loop
calls) hands a transformers model a bridge cache (`EngineCache`) of the spec's kind; a kind
outside `BRIDGE_KINDS` is refused in one line (`check_kinds`). `EngineConfig` is the config
contract read from the transformers config, and the tokenizer is the model's own,
written once as a tokenizer.json kvcache's tokenizer reads (`models.tokenizer`).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from kvcache_cli.caches import CacheSpec
from kvcache_cli.caches.base import CacheShape, ForwardingCache, KVCache, LayerType
from kvcache_cli.caches.hybrid import BandedCache
from kvcache_cli.caches.step import Step
from kvcache_cli.hf import ATTENTION, BRIDGE_KINDS, BridgeError, kv_cache
from kvcache_cli.hf.bridge import refuse_across_layers
from kvcache_cli.hf.layers import BridgeCache, BridgeLayer, layer_bytes_held
from kvcache_cli.hf.load import HFModel
from kvcache_cli.models.base import FamilyModel


def check_kinds(specs: Iterable[CacheSpec]) -> None:
    """Refuse, in one line, a cache kind the bridge does not hold (yet), or an option one
    layer's cache cannot hold (pyramid, rerotate): BridgeError."""
    for spec in specs:
        if spec.kind not in BRIDGE_KINDS:
            raise BridgeError(f"cache {spec.typed or str(spec)!r}: the transformers engine holds "
                              f"{', '.join(BRIDGE_KINDS)} so far; --engine kvcache runs "
                              "every kind on kvcache's own families")
        refuse_across_layers(spec)


@dataclass(frozen=True)
class EngineConfig:
    """The config contract (`models.base.FamilyConfig`) of a transformers model."""

    architecture: str
    n_layer: int
    n_head: int
    n_kv_head: int
    head_size: int
    n_embd: int
    vocab_size: int
    context: int
    tokenizer: str  # "file:<tokenizer.json>", or "gpt2" for a model without a fast one
    params: int
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    layer_types: tuple[LayerType, ...] = ()  # which layers slide, and their window

    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(self.n_layer, self.n_kv_head, self.head_size, self.context,
                          layer_types=self.layer_types)

    def param_count(self) -> int:
        return self.params


class EngineCache(KVCache):
    """A bridge cache as kvcache's loops read a cache: positions seen, bytes held and
    copied. The transformers model reads `held` itself; `attend` is never called."""

    def __init__(self, held: BridgeCache):
        self.held = held

    @property
    def length(self) -> int:
        return self.held.get_seq_length()

    @property
    def bytes_held(self) -> int:
        return self.held.bytes_held

    @property
    def bytes_copied(self) -> int:
        # kvcache's layers count their copies; transformers' own sliding layers do not.
        return sum(layer.cache.bytes_copied for layer in self.held.layers
                   if isinstance(layer, BridgeLayer) and layer.is_initialized)

    def cache_of(self, layer: int) -> tuple[KVCache | None, int]:
        """The kvcache cache holding model layer `layer` and the layer's index there, as
        `HybridCache.cache_of` says it (a bridge layer's cache holds one layer: index 0; a
        band around a kind reads as the kind); (None, 0) where transformers' own layer
        holds it (a sliding window the model keeps)."""
        held = self.held.layers[layer]
        if not isinstance(held, BridgeLayer) or not held.is_initialized:
            return None, 0
        cache = held.cache
        return (cache.inner if isinstance(cache, BandedCache) else cache), 0

    def layer_bytes_held(self, layer: int) -> int:
        """Bytes model layer `layer` holds now, whichever cache holds it."""
        return layer_bytes_held(self.held.layers[layer])

    def crop(self, length: int) -> None:
        self.held.crop(length)

    def reset(self) -> None:
        self.held.reset()


class EngineModel(FamilyModel):
    """A transformers causal LM behind the model contract, run by kvcache's loops."""

    def __init__(self, hf_model, config: EngineConfig):
        super().__init__()
        self.hf, self.config = hf_model, config
        self.embedding = hf_model.get_input_embeddings()
        self.lm_head = hf_model.get_output_embeddings()
        # transformers 5 takes the cache as `cache` (and warns at the old name).
        params = inspect.signature(hf_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def make_cache(self, spec: CacheSpec, max_len: int, *, batch: int = 1, whole: bool = False,
                   sliding: str = "model") -> EngineCache:
        """The bridge cache of `spec` for this model (`caches.make_cache` asks for it); its
        layers are built at the first forward, for that forward's rows (`batch`)."""
        if whole:
            raise ValueError("a compiled decode step reads kvcache's own static cache: "
                             "--engine kvcache runs it")
        check_kinds([spec])
        if not spec.info.exact:
            # Each kind attends its own way: codes read in place, evicted keys masked by the
            # positions they hold (transformers' masks cannot describe those).
            self.hf.set_attn_implementation(ATTENTION)
        return EngineCache(kv_cache(self.hf, spec, max_len=max_len, sliding=sliding))

    def forward(self, idx: Tensor, step: int | Step, cache: KVCache | None = None, *,
                last_only: bool = False) -> Tensor:
        """Logits (B, T, vocab), or the last position's (B, 1, vocab), of tokens idx (B, T)
        following what `cache` has seen (no cache: idx is the whole sequence, from 0).
        `step`, where the tokens go, is the cache's length in every loop that runs here:
        transformers reads the positions and the mask from the cache itself."""
        if cache is not None and cache.wants_attention:  # eval's one pass of explicit weights
            return self._watched(idx, cache)
        held = cache.held if cache is not None else None
        out = self.hf(input_ids=idx, **{self._cache_arg: held}, use_cache=held is not None,
                      logits_to_keep=1 if last_only else 0)
        return out.logits

    def _watched(self, idx: Tensor, watch: ForwardingCache) -> Tensor:
        """One forward with each layer's attention weights (B, nh, T, S) handed to the
        watching cache's `observe`: transformers returns them from its eager attention."""
        inner = watch.inner
        implementation = self.hf.config._attn_implementation
        self.hf.set_attn_implementation("eager")
        try:
            out = self.hf(input_ids=idx, **{self._cache_arg: inner.held}, use_cache=True,
                          output_attentions=True)
        finally:
            self.hf.set_attn_implementation(implementation)
        for layer, weights in enumerate(out.attentions):
            watch.observe(layer, weights)
        return out.logits

    def first_layers(self, n_layer: int) -> FamilyModel:
        raise ValueError("a draft of the target's first layers runs on kvcache's own "
                         "families: --engine kvcache")


def engine_model(loaded: HFModel) -> EngineModel:
    """A loaded transformers model (`hf.load.load_hf`) behind the model contract; a
    BridgeError for one whose layers the bridge cannot hold (latent, linear attention)."""
    from kvcache_cli.sizing.config import shape_from_config
    from kvcache_cli.sizing.units import ConfigError

    model = loaded.model
    text = model.config.get_text_config(decoder=True)
    try:
        shape = shape_from_config(model.config.to_dict(), loaded.source)
    except ConfigError as err:
        raise BridgeError(str(err)) from None
    kv_cache(model, "concat")  # refuses, in one line, layers the bridge cannot hold
    eos = model.generation_config.eos_token_id
    eos = eos if eos is not None else text.eos_token_id
    config = EngineConfig(
        architecture=loaded.architecture, n_layer=shape.layers,
        n_head=shape.heads or text.num_attention_heads, n_kv_head=shape.kv_heads,
        head_size=shape.head_dim, n_embd=text.hidden_size, vocab_size=text.vocab_size,
        # A model that declares no window: as far as the bridge will build a cache.
        context=shape.max_positions or getattr(text, "max_position_embeddings", None) or 1 << 20,
        tokenizer=_tokenizer_file(loaded.tokenizer),
        params=sum(p.numel() for p in model.parameters()),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        chat_template=getattr(loaded.tokenizer, "chat_template", None),
        layer_types=tuple(LayerType(shape.window if kind == "sliding" else None)
                          for kind in shape.layer_kinds))
    return EngineModel(model, config)


def _tokenizer_file(tokenizer) -> str:
    """The model's fast tokenizer as "file:<tokenizer.json>", written once into kvcache's
    cache under the hash of its contents (a folder's, a Hub snapshot's, a GGUF's alike);
    "gpt2" (GPT-2's BPE for GPT-2's vocabulary, else token ids only) without one."""
    from kvcache_cli.models.gguf.converted import cache_root

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "gpt2"
    text = backend.to_str()
    folder = cache_root() / "hf-tokenizers" / hashlib.sha256(text.encode()).hexdigest()[:16]
    path = folder / "tokenizer.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        staging = folder / f"tokenizer.json.{os.getpid()}"
        staging.write_text(text, encoding="utf-8")
        staging.replace(path)  # whole or absent: another process may read it now
    return f"file:{path}"
