"""What compressing one prompt's cache at prefill keeps, and what it costs (`kvcache compress`).

The prompt is prefilled as one forward through the exact cache and through each
compressing kind (`snapkv`, `knorm`, `recent`), which compresses it at the end of that
forward (docs/compression.md). Then, per kind:

- what it kept: keys per layer (each KV head keeps as many, chosen apart) of the prompt's
  tokens, and each prompt token's share of the (layer, KV head) pairs that kept it;
- what the prompt holds: bytes before (the exact cache, `concat`: the prompt's positions,
  nothing allocated ahead) and after (K, V and a position per kept key), per layer kind;
  a hybrid model compresses its full-attention layers only, its sliding layers keep
  their window (a ring, exact) in every cache;
- what it took: the prefill and the compression alone, device-synced (eval's compress_ms);
- what it changes: its own greedy continuation against the exact cache's (the leading
  tokens that match), and, teacher-forced on the exact continuation, KL(exact || this)
  and top-1 agreement of each decoded prediction. The continuation's first token comes
  from the prefill, exact by construction (the prompt attends over all of itself), so the
  scored predictions are the n - 1 after it.

The continuation never stops at an end token: n tokens, in every cache. Nothing here prints.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache_cli.caches.spec import KINDS, CacheSpec, check_prompt, parse_cache_spec
from kvcache_cli.caches.spec_bounded import prompt_budget

if TYPE_CHECKING:
    from torch import Tensor

REFERENCE = "concat"  # exact, and holds the prompt's positions only: its bytes are the prompt's
# Without --cache: each compressing kind at a quarter of the prompt's keys (eval's retrieval's).
DEFAULT_CACHES = "snapkv:0.25,knorm:0.25,recent:0.25"


@dataclass(frozen=True)
class KindBytes:
    kind: str  # 'full' or 'sliding' layers
    layers: int
    exact: int  # the prompt in the exact cache
    held: int  # the prompt after compression (a sliding layer's ring: the same)


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]  # greedy, n of them
    text: str
    prefill_ms: float  # the prompt's forward, compression included


@dataclass(frozen=True)
class Compressed:
    cache: str  # the spec's canonical spelling
    kept: tuple[int, ...]  # keys kept per compressed layer, each KV head as many
    bytes: tuple[KindBytes, ...]
    compress_ms: float  # the selection and copies, all layers, device-synced
    continuation: Continuation
    matching: int  # leading continuation tokens equal to the exact cache's
    kl_mean: float  # KL(exact || this) in nats over the n - 1 decoded predictions
    kl_max: float
    top1_agreement: float
    kept_share: tuple[float, ...]  # per prompt token: the share of (layer, KV head) keeping it

    @property
    def bytes_exact(self) -> int:
        return sum(b.exact for b in self.bytes)

    @property
    def bytes_held(self) -> int:
        return sum(b.held for b in self.bytes)


@dataclass(frozen=True)
class CompressResult:
    model: str
    device: str
    dtype: str
    prompt: str  # how the prompt was laid out ("the text as written", a chat template...)
    prompt_tokens: int
    pieces: tuple[str, ...]  # each prompt token's text
    new_tokens: int
    n_layer: int
    n_kv_head: int
    compressed_layers: tuple[int, ...]  # the layers the kinds compress (a hybrid's full ones)
    sliding_window: int | None  # a hybrid's sliding layers' window (None: no sliding layer)
    shown_layer: int | None  # the layer `kept_share` is of; None: every compressed layer
    exact: Continuation
    rows: tuple[Compressed, ...]


def fit_windows(specs: Sequence[CacheSpec], prompt: int) -> list[CacheSpec]:
    """SPECS with each observation window the user did not type (SnapKV's 32, its paper's)
    cut to the keys a prompt of `prompt` tokens keeps, as a budget in tokens already cuts
    it: SnapKV never observes more than it keeps, so the run is the same and the row names
    the window it used, and a short prompt runs with the defaults. A typed window is the
    user's, refused as typed (`check_compress`)."""
    fitted = []
    for spec in specs:
        params = dict(spec.params)
        keep = prompt_budget(params, prompt) if "window" in params and prompt else None
        if keep is not None and keep < params["window"] and not _typed_window(spec):
            spec = parse_cache_spec(f"{spec.typed or spec}:w{keep}")
        fitted.append(spec)
    return fitted


def _typed_window(spec: CacheSpec) -> bool:
    # No other field of a compressing spec starts with w (k, s, max, avg, uniform, pyramid).
    typed = spec.typed or str(spec)
    return any(f.strip().lower().startswith("w") for f in typed.split(":")[1:])


def _check_window(spec: CacheSpec, prompt: int) -> None:
    """A typed observation window longer than the prompt, refused with the one that fits:
    the keys the prompt keeps, the window `fit_windows` gives a spec without :wN."""
    params = dict(spec.params)
    window, budget = params.get("window", 0), params["budget"]
    if window <= prompt or isinstance(budget, int) and budget > prompt:
        return  # fits; or a budget past the prompt, which `check_prompt` names first
    typed = (spec.typed or str(spec)).split(":")
    fields = [f for f in typed if not f.strip().lower().startswith("w")]
    fit = ":".join([*fields[:2], f"w{prompt_budget(params, prompt)}", *fields[2:]])
    raise ValueError(f"cache {str(spec)!r}: the observation window of {window:,} tokens is "
                     f"longer than the prompt of {prompt:,}; expected at most {prompt:,}, "
                     f"e.g. {fit!r}, or no :wN (the window then fits the prompt)")


def compressing_kinds() -> tuple[str, ...]:
    return tuple(name for name, kind in KINDS.items() if kind.compresses)


def check_compress(specs: Sequence[CacheSpec], prompt: int, new_tokens: int, shape,
                   context: int, layer: int | None) -> None:
    """ValueError naming the value when the run cannot be made (no model needed): a kind
    that does not compress, a budget or window the prompt cannot fill, a prompt and
    continuation past the context window, a --layer that is not a compressed one."""
    if prompt == 0:
        raise ValueError("the prompt is empty: expected some text (or --text FILE)")
    for spec in specs:
        if not spec.info.compresses:
            raise ValueError(f"cache {spec.typed or str(spec)!r} does not compress the prompt: "
                             f"expected a kind that compresses at prefill "
                             f"({', '.join(compressing_kinds())}), e.g. snapkv:0.25")
        _check_window(spec, prompt)
        check_prompt(spec, prompt)
    if prompt + new_tokens > context:
        raise ValueError(f"a prompt of {prompt:,} tokens and {new_tokens:,} new ones pass the "
                         f"model's context window of {context:,} positions; expected at most "
                         f"{context:,} in all (a shorter text or a smaller -n)")
    full = compressed_layers(shape)
    if not full:
        raise ValueError("every layer of the model slides over a window, which it keeps: no "
                         "layer attends in full, so no kind has a prompt to compress")
    if layer is not None and layer not in full:
        if not 0 <= layer < shape.n_layer:
            raise ValueError(f"--layer {layer}: the model has layers 0..{shape.n_layer - 1}")
        raise ValueError(f"--layer {layer} is a sliding layer, which keeps its window; "
                         f"expected a full-attention layer: {', '.join(map(str, full))}")


def compressed_layers(shape) -> tuple[int, ...]:
    """The layers a compressing kind applies to: every one that attends in full."""
    return tuple(i for i, t in enumerate(shape.layer_types) if not t.sliding)


def compress_prompt(model, ids: Sequence[int], specs: Sequence[CacheSpec], *, new_tokens: int,
                    decode: Callable[[list[int]], str], layer: int | None = None,
                    prompt: str = "the text as written", model_name: str = "",
                    progress: Callable[[int, int, str], None] | None = None
                    ) -> CompressResult:
    """The prompt `ids` through the exact cache, then through each spec (see the module)."""
    import torch

    from kvcache_cli.caches import make_cache

    shape = model.config.cache_shape
    check_compress(specs, len(ids), new_tokens, shape, model.config.context, layer)
    x = torch.tensor([list(ids)], device=model.device)  # (1, P)
    max_len = len(ids) + new_tokens
    rows = []
    with torch.inference_mode():
        # One untimed forward first: the first pays one-time costs (kernels, allocator).
        model(x[:, :1], 0, make_cache(REFERENCE, model, 1), last_only=True)
        names = [REFERENCE, *map(str, specs)]
        if progress is not None:
            progress(0, len(names), names[0])
        exact = _run(model, x, make_cache(REFERENCE, model, max_len), new_tokens, None)
        for done, spec in enumerate(specs, start=1):
            if progress is not None:
                progress(done, len(names), names[done])
            run = _run(model, x, make_cache(spec, model, max_len), new_tokens, exact.tokens)
            rows.append(_row(str(spec), run, exact, shape, layer, len(ids), decode))
        if progress is not None:
            progress(len(names), len(names), names[-1])
    window = next((t.window for t in shape.layer_types if t.sliding), None)
    return CompressResult(
        model=model_name, device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."), prompt=prompt, prompt_tokens=len(ids),
        pieces=tuple(decode([t]) for t in ids), new_tokens=new_tokens,
        n_layer=shape.n_layer, n_kv_head=shape.n_kv_head,
        compressed_layers=compressed_layers(shape), sliding_window=window, shown_layer=layer,
        exact=Continuation(exact.tokens, decode(list(exact.tokens)), exact.prefill_ms),
        rows=tuple(rows))


@dataclass
class _Run:
    cache: object  # the copy taken after the prefill: its kept keys, compress_ms
    prefill_ms: float
    bytes: dict[str, int]  # per layer kind, right after the prefill
    tokens: tuple[int, ...]
    forced: Tensor  # (n - 1, vocab) float64 log-probabilities on the exact continuation


def _run(model, x: Tensor, cache, n: int, forced: tuple[int, ...] | None) -> _Run:
    """Prefill; a greedy run of n tokens; and, from a copy of the cache as the prefill
    left it, the exact continuation `forced` (this run's own when None) fed as one chunk."""
    import torch

    from kvcache_cli.measure import synchronize

    P = x.size(1)
    synchronize(model.device)
    began = time.perf_counter()
    logits = model(x, 0, cache, last_only=True)  # (1, 1, vocab)
    synchronize(model.device)
    prefill_ms = (time.perf_counter() - began) * 1e3
    held = _bytes_by_kind(cache, model.config.cache_shape)
    before = copy.deepcopy(cache)  # the cache as compressed, for the teacher-forced pass
    tokens = [int(logits[0, -1].argmax())]
    for pos in range(P, P + n - 1):
        step = torch.tensor([[tokens[-1]]], device=x.device)  # (1, 1)
        tokens.append(int(model(step, pos, cache)[0, -1].argmax()))
    fed = torch.tensor([list(forced or tokens)[:n - 1]], device=x.device)  # (1, n - 1)
    logp = torch.log_softmax(model(fed, P, before)[0].double(), dim=-1)  # (n - 1, vocab)
    return _Run(before, prefill_ms, held, tuple(tokens), logp)


def _sub_caches(cache, shape):
    """(layer, the cache holding it, the layer's index there) for every layer of `shape`:
    a hybrid cache's and the transformers engine's (`EngineCache`) by their `cache_of`,
    whose cache is None where transformers' own layer holds the layer."""
    split = hasattr(cache, "cache_of")
    for layer in range(shape.n_layer):
        yield (layer, *(cache.cache_of(layer) if split else (cache, layer)))


def _bytes_by_kind(cache, shape) -> dict[str, int]:
    """The prompt's bytes per layer kind: a compressing cache's kept keys (its room for
    later tokens left out), any other cache's bytes held."""
    from kvcache_cli.caches.compressed import PromptCompressedCache

    out: dict[str, int] = {}
    seen: set[int] = set()
    for layer, sub, _ in _sub_caches(cache, shape):
        kind = shape.layer_types[layer].kind
        if sub is None:  # transformers' own layer: a sliding window the model keeps
            out[kind] = out.get(kind, 0) + cache.layer_bytes_held(layer)
        elif id(sub) not in seen:
            seen.add(id(sub))
            held = sub.prompt_bytes if isinstance(sub, PromptCompressedCache) else sub.bytes_held
            out[kind] = out.get(kind, 0) + held
    return out


def _row(name: str, run: _Run, exact: _Run, shape, layer: int | None, P: int,
         decode: Callable[[list[int]], str]) -> Compressed:
    import torch

    from kvcache_cli.caches.compressed import PromptCompressedCache

    kept, counts, pairs, compress_ms = [], torch.zeros(P, dtype=torch.float64), 0, 0.0
    seen: set[int] = set()
    for i, sub, j in _sub_caches(run.cache, shape):
        if not isinstance(sub, PromptCompressedCache):
            continue
        if id(sub) not in seen:
            seen.add(id(sub))
            compress_ms += sub.compress_ms
        positions = sub.kept(j)[0]  # (nkv, budget)
        kept.append(positions.size(1))
        if layer is None or layer == i:
            counts += torch.bincount(positions.flatten().cpu(), minlength=P).double()
            pairs += positions.size(0)
    kl = (exact.forced.exp() * (exact.forced - run.forced)).sum(-1).clamp_min(0.0)  # (n - 1,)
    agree = (exact.forced.argmax(-1) == run.forced.argmax(-1)).double()
    matching = next((k for k, (a, b) in enumerate(zip(run.tokens, exact.tokens)) if a != b),
                    len(exact.tokens))
    layers = {t.kind: 0 for t in shape.layer_types}
    for t in shape.layer_types:
        layers[t.kind] += 1
    return Compressed(
        cache=name, kept=tuple(kept),
        bytes=tuple(KindBytes(kind, layers[kind], exact.bytes[kind], run.bytes[kind])
                    for kind in layers),
        compress_ms=compress_ms,
        continuation=Continuation(run.tokens, decode(list(run.tokens)), run.prefill_ms),
        matching=matching, kl_mean=kl.mean().item(), kl_max=kl.max().item(),
        top1_agreement=agree.mean().item(), kept_share=tuple((counts / pairs).tolist()))
