"""transformers' own quantised cache in its own model, as `kvcache eval` rows.

`quanto-int4` (`caches.peer`) runs transformers' QuantoQuantizedLayer inside kvcache's Llama;
this runs the whole peer as a user of transformers would: `LlamaForCausalLM` holding the
same weights (`models.to_hf`), generating through `QuantizedCache(backend="quanto")`, scored
against the same model with its exact `DynamicCache` on the same ids, so its row says what
transformers' stack costs, attention and all, not only its quantiser.

Spec (the `--cache` grammar's conventions):

    transformers:quanto-int4[:gN][:rN]    QuantizedCache, quanto backend, 4 bits
    transformers:quanto-int2[:gN][:rN]    the same at 2 bits

gN: channels per group (transformers' q_group_size, default 64); rN: tokens kept at full
precision before they are quantised (residual_length, default 128).

The protocol is eval's: the prompt prefilled as one forward (its last position scored),
then one token a step, every step's logits read: a QuantizedCache quantises as tokens leave
its residual, so only one-token steps reproduce what generate() does.
Needs transformers and optimum-quanto; nothing here imports them until a run.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NAME = "transformers"
REFERENCE = f"{NAME}:dynamic"  # its exact cache: DynamicCache
BACKENDS = {"quanto-int4": 4, "quanto-int2": 2}
GRAMMAR = "transformers:quanto-int4 or transformers:quanto-int2, then :gN and :rN"


@dataclass(frozen=True)
class HFCacheSpec:
    bits: int
    group: int = 64  # transformers' q_group_size default
    residual: int = 128  # transformers' residual_length default

    def __str__(self) -> str:
        return f"{NAME}:quanto-int{self.bits}:g{self.group}:r{self.residual}"


def is_transformers(text: str) -> bool:
    return text.strip().split(":", 1)[0].lower() == NAME


def parse_transformers(text: str) -> HFCacheSpec:
    """'transformers:quanto-int4:g32' -> HFCacheSpec, or a ValueError naming the spec."""
    spec = text.strip()
    _, *fields = spec.lower().split(":")
    if not fields or fields[0] not in BACKENDS:
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
    return HFCacheSpec(BACKENDS[fields[0]], group, residual)


def check_installed(specs: Sequence[HFCacheSpec], config, model: str) -> None:
    """Refuse rows that cannot run, before any weights load: a model transformers' Llama
    cannot hold, a group that does not divide its head, or no optimum-quanto."""
    if not specs:
        return
    from kvcache_cli.caches.peer import quanto_missing
    from kvcache_cli.models.llama import LlamaConfig

    if not isinstance(config, LlamaConfig):
        raise ValueError(f"cache {str(specs[0])!r} runs transformers' LlamaForCausalLM; "
                         f"--model {model} is not a Llama (expected -m smollm2 or a Llama "
                         "checkpoint)")
    for spec in specs:
        if config.head_size % spec.group:
            raise ValueError(f"cache {str(spec)!r}: groups of {spec.group} channels do not "
                             f"divide the head size {config.head_size}")
    missing = quanto_missing()
    if missing:
        raise ValueError(missing)


class _Scores:
    """What one cache predicted, position by position, against the exact cache."""

    def __init__(self, name: str):
        self.name = name
        self.nll: list[float] = []
        self.kl: list[float] = []
        self.agree: list[bool] = []
        self.decode_s: list[float] = []

    def score(self, logp, targets, exact) -> None:
        """logp, exact (n, vocab) float64 log-probabilities; targets (n,) ids."""
        self.nll += (-logp.gather(-1, targets[:, None])[:, 0]).tolist()
        self.kl += (exact.exp() * (exact - logp)).sum(-1).clamp_min(0).tolist()
        self.agree += (logp.argmax(-1) == exact.argmax(-1)).tolist()


def evaluate(model, tokens: Sequence[int], specs: Sequence[HFCacheSpec], *, prompt_len: int,
             progress: Callable[[int, int], None] | None = None) -> tuple:
    """transformers' exact DynamicCache, then each spec's QuantizedCache, in lockstep over
    `tokens` as `quality.evaluate` feeds them: one CacheQuality row each, the reference
    first."""
    import torch
    from transformers import DynamicCache, QuantizedCache

    from kvcache_cli.measure import quiet_transformers
    from kvcache_cli.models import to_hf

    hf = to_hf(model)
    cache_arg = cache_keyword(hf)
    fed = len(tokens) - 1
    ids = torch.tensor([tokens[:fed]], device=model.device)  # (1, fed)
    targets = torch.tensor(tokens[1:], device=model.device)  # (fed,)
    wanted = [None, *dict.fromkeys(specs)]  # None: the reference
    caches = [DynamicCache(config=hf.config) if s is None else
              QuantizedCache(backend="quanto", config=hf.config, nbits=s.bits,
                             q_group_size=s.group, residual_length=s.residual)
              for s in wanted]
    scores = [_Scores(REFERENCE if s is None else str(s)) for s in wanted]
    with torch.inference_mode(), quiet_transformers():
        for start, end in [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, fed)]:
            exact = None
            for cache, row in zip(caches, scores):
                began = time.perf_counter()
                logits = hf(ids[:, start:end], use_cache=True, logits_to_keep=1,
                            **{cache_arg: cache}).logits[0]  # (1, vocab): the last position
                if start:
                    row.decode_s.append(time.perf_counter() - began)
                logp = logits.double().log_softmax(-1)
                exact = logp if exact is None else exact
                row.score(logp, targets[end - 1:end], exact)
            if progress is not None:
                progress(len(scores[0].nll), fed - prompt_len + 1)
    held = [_bytes_held(cache) for cache in caches]
    return _rows(scores, held, prompt_len, fed)


def cache_keyword(hf_model) -> str:
    """The name a transformers model's forward and generate() take a cache by: `cache`
    from transformers 5 (which warns at the old name), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else \
        "past_key_values"


def _bytes_held(cache) -> int:
    """Bytes a transformers cache holds: tensors of every layer, codes, scales and
    shifts of a quantised one included."""
    from kvcache_cli.caches.base import nbytes

    total = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        quantised = getattr(layer, "_quantized_keys", None)
        if quantised is not None:
            for q in (layer._quantized_keys, layer._quantized_values):
                total += nbytes(q._data._data) + nbytes(q._scale) + nbytes(q._shift)
        if layer.keys is not None and layer.keys.dim() == 4:
            total += nbytes(layer.keys) + nbytes(layer.values)
    return total


def _rows(scores: list[_Scores], held: list[int], prompt_len: int, fed: int) -> tuple:
    from kvcache_cli.quality import CacheQuality

    reference = scores[0]
    ref_nll = statistics.fmean(reference.nll)
    rows = []
    for row, nbytes in zip(scores, held, strict=True):
        nll = statistics.fmean(row.nll)
        worst = max(range(len(row.kl)), key=row.kl.__getitem__)
        decode = statistics.median(row.decode_s) * 1e3 if row.decode_s else math.nan
        rows.append(CacheQuality(
            cache=row.name, reference=row is reference, perplexity=math.exp(nll),
            bits_per_token=nll / math.log(2), perplexity_change=math.expm1(nll - ref_nll),
            kl_mean=statistics.fmean(row.kl), kl_max=row.kl[worst],
            kl_max_position=prompt_len + worst,
            top1_agreement=statistics.fmean(row.agree), bytes_held=nbytes, positions=fed,
            bytes_per_token=nbytes / fed, bytes_ratio=nbytes / held[0], prefill_ms=math.nan,
            compress_ms=0.0, decode_ms_per_token=decode, loss_by_position=tuple(row.nll),
            against=REFERENCE, peer=NAME,
        ))  # fmt: skip
    return tuple(rows)
