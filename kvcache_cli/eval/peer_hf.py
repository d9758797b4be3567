"""transformers' own quantised cache in its own model, as `kvcache eval` rows.

`quanto-int4` (`caches.peer`) runs transformers' QuantoQuantizedLayer inside kvcache's Llama;
this runs the whole peer as a user of transformers would: `LlamaForCausalLM` (or
`Gemma3ForCausalLM`) holding the same weights (`models.to_hf`), generating through
`QuantizedCache(backend="quanto")`, scored against the same model with its exact
`DynamicCache` on the same ids, so its row says what transformers' stack costs, attention
and all, not only its quantiser.

transformers builds no QuantizedCache for a model with a sliding layer (its constructor
raises unless every layer attends in full): on Gemma 3 each such spec is a `Refusal` row,
with transformers' own words, beside its DynamicCache's row, whose sliding layers hold
their window (`DynamicSlidingWindowLayer`).

Spec (the `--cache` grammar's conventions):

    transformers:quanto-int4[:gN][:rN]    QuantizedCache, quanto backend, 4 bits
    transformers:quanto-int2[:gN][:rN]    the same at 2 bits
    transformers:hqq-int4[:gN][:rN]       QuantizedCache, HQQ backend (half-quadratic
    transformers:hqq-int2[:gN][:rN]       quantisation: zero points fitted, not min-max)

gN: channels per group (transformers' q_group_size, default 64); rN: tokens kept at full
precision before they are quantised (residual_length, default 128).

The protocol is eval's: the prompt prefilled as one forward (its last position scored),
then one token a step, every step's logits read: a QuantizedCache quantises as tokens leave
its residual, so only one-token steps reproduce what generate() does.
Needs transformers and optimum-quanto (quanto) or hqq; nothing here imports them until a run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NAME = "transformers"
REFERENCE = f"{NAME}:dynamic"  # its exact cache: DynamicCache
# The spec's kind -> (transformers' backend, bits).
KINDS = {"quanto-int4": ("quanto", 4), "quanto-int2": ("quanto", 2),
         "hqq-int4": ("hqq", 4), "hqq-int2": ("hqq", 2)}
GRAMMAR = (f"transformers:KIND ({', '.join(KINDS)}), then :gN (channels a group) and :rN "
           "(tokens kept exact)")
HQQ_INSTALL = ("DISABLE_CUDA=1 pip install hqq (it builds from source; the CPU needs no CUDA "
               "kernels)")


@dataclass(frozen=True)
class HFCacheSpec:
    backend: str  # transformers' QuantizedCache backend: quanto or hqq
    bits: int
    group: int = 64  # transformers' q_group_size default
    residual: int = 128  # transformers' residual_length default

    def __str__(self) -> str:
        return f"{NAME}:{self.backend}-int{self.bits}:g{self.group}:r{self.residual}"


def is_transformers(text: str) -> bool:
    return text.strip().split(":", 1)[0].lower() == NAME


def parse_transformers(text: str) -> HFCacheSpec:
    """'transformers:quanto-int4:g32' -> HFCacheSpec, or a ValueError naming the spec."""
    spec = text.strip()
    _, *fields = spec.lower().split(":")
    if not fields or fields[0] not in KINDS:
        raise ValueError(f"cache spec {spec!r}: expected {GRAMMAR}, e.g. "
                         "transformers:quanto-int4")
    given: dict[str, int] = {}
    for f in fields[1:]:
        letter, number = f[:1], f[1:]
        if letter not in ("g", "r") or not number.isascii() or not number.isdigit():
            raise ValueError(f"cache spec {spec!r}: unknown field {f!r}; expected {GRAMMAR}")
        if letter in given:
            raise ValueError(f"cache spec {spec!r}: {letter}N given twice; expected {GRAMMAR}")
        given[letter] = int(number)
    group, residual = given.get("g", 64), given.get("r", 128)
    if group < 1 or residual < 1:
        raise ValueError(f"cache spec {spec!r}: group and residual must be at least 1")
    return HFCacheSpec(*KINDS[fields[0]], group, residual)


def check_installed(specs: Sequence[HFCacheSpec], config, model: str) -> None:
    """Refuse rows that cannot run, before any weights load: a model transformers' Llama
    cannot hold, a group that does not divide its head, a backend not installed."""
    if not specs:
        return
    from kvcache_cli.models.gemma3 import Gemma3Config
    from kvcache_cli.models.llama import LlamaConfig

    if not isinstance(config, LlamaConfig | Gemma3Config):
        raise ValueError(f"cache {str(specs[0])!r} runs transformers' LlamaForCausalLM or "
                         f"Gemma3ForCausalLM; --model {model} is not a Llama nor a Gemma 3 "
                         "(expected -m smollm2, -m gemma3 or a Llama checkpoint)")
    for spec in specs:
        if config.head_size % spec.group:
            raise ValueError(f"cache {str(spec)!r}: groups of {spec.group} channels do not "
                             f"divide the head size {config.head_size}")
    for spec in specs:
        missing = backend_missing(spec.backend)
        if missing:
            raise ValueError(f"cache {str(spec)!r}: {missing}")


def backend_missing(backend: str) -> str | None:
    """Why transformers' QuantizedCache cannot run this backend here (one line), or None."""
    from importlib.util import find_spec

    from kvcache_cli.caches.peer import quanto_missing

    if backend == "quanto":
        return quanto_missing()
    if find_spec("hqq") is None:
        return f"transformers' QuantizedCache with the hqq backend needs hqq: {HQQ_INSTALL}"
    return None


def evaluate(model, tokens: Sequence[int], specs: Sequence[HFCacheSpec], *, prompt_len: int,
             progress: Callable[[int, int], None] | None = None) -> tuple:
    """transformers' exact DynamicCache, then each spec's QuantizedCache, in lockstep over
    `tokens` as `quality.evaluate` feeds them: one CacheQuality row each, the reference
    first; a spec transformers will not build for this model has none (`refusals`)."""
    import torch
    from transformers import DynamicCache

    from kvcache_cli.eval.quality import Tally, summarise
    from kvcache_cli.measure import quiet_transformers
    from kvcache_cli.models import to_hf

    hf = to_hf(model)
    cache_arg = cache_keyword(hf)
    fed = len(tokens) - 1
    ids = torch.tensor([tokens[:fed]], device=model.device)  # (1, fed)
    targets = torch.tensor(tokens[1:], device=model.device)  # (fed,)
    kinds = _layer_kinds(hf.config)
    tallies = [Tally(REFERENCE, _Held(DynamicCache(config=hf.config), kinds))]
    tallies += [Tally(str(s), _Held(cache, kinds)) for s, cache in _quantized(hf.config,
                                                                               specs)[0]]
    with torch.inference_mode(), quiet_transformers():
        for start, end in [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, fed)]:
            exact = None
            for tally in tallies:
                began = time.perf_counter()
                logits = hf(ids[:, start:end], use_cache=True, logits_to_keep=1,
                            **{cache_arg: tally.cache.cache}).logits[0]  # (1, vocab): the last
                if start:
                    tally.step_ms.append((time.perf_counter() - began) * 1e3)
                logp = logits.double().log_softmax(-1)
                exact = logp if exact is None else exact
                tally.score(logp, targets[end - 1:end], exact)
            if progress is not None:
                progress(len(tallies[0].nll), fed - prompt_len + 1)
    return tuple(dataclasses.replace(row, against=REFERENCE, peer=NAME, prefill_ms=math.nan)
                 for row in summarise(tallies, prompt_len))


def refusals(model, specs: Sequence[HFCacheSpec]) -> tuple:
    """The `Refusal` of each spec transformers will not build a QuantizedCache for on this
    model, in its own words: on a model with a sliding layer (Gemma 3), every one."""
    if not model.config.cache_shape.hybrid:
        return ()
    from kvcache_cli.models.gemma3 import hf_config

    return _quantized(hf_config(model.config), specs)[1]


def _quantized(config, specs: Sequence[HFCacheSpec]) -> tuple[list, tuple]:
    """([(spec, its QuantizedCache)] for the specs transformers builds for `config`, the
    `Refusal`s of those it raises on: on a model with a sliding layer, every one)."""
    from transformers import QuantizedCache

    from kvcache_cli.eval.quality import Refusal

    built, refused = [], []
    for s in dict.fromkeys(specs):
        try:
            built.append((s, QuantizedCache(
                backend=s.backend, config=config, nbits=s.bits, q_group_size=s.group,
                residual_length=s.residual)))
        except ValueError as err:  # its own check of the layer types, in its own words
            refused.append(Refusal(str(s), NAME, " ".join(str(err).split())))
    return built, tuple(refused)


def _layer_kinds(config) -> list[str] | None:
    """Each layer's kind ('full', 'sliding') from a transformers config's layer_types; None
    for a model without them (every layer full)."""
    types = getattr(config, "layer_types", None)
    if not types or all(t == "full_attention" for t in types):
        return None
    return ["sliding" if t == "sliding_attention" else "full" for t in types]


def cache_keyword(hf_model) -> str:
    """The name a transformers model's forward and generate() take a cache by: `cache`
    from transformers 5 (which warns at the old name), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else \
        "past_key_values"


class _Held:
    """A transformers cache as eval counts a cache: the bytes it holds (every layer's
    tensors; a quantised layer's codes, scales and shifts) and the positions."""

    def __init__(self, cache, kinds: list[str] | None = None):
        self.cache = cache
        self.kinds = kinds  # each layer's kind, None on a model without sliding layers

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def bytes_held(self) -> int:
        from kvcache_cli.caches.peer import layer_bytes

        return sum(layer_bytes(layer) for layer in self.cache.layers)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind (eval's column), {} on a model without sliding layers."""
        from kvcache_cli.caches.peer import layer_bytes

        held: dict[str, int] = {}
        for kind, layer in zip(self.kinds or (), self.cache.layers, strict=False):
            held[kind] = held.get(kind, 0) + layer_bytes(layer)
        return held
