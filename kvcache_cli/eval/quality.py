"""What a cache costs in quality: teacher-forced evaluation against the exact cache.

One text's token ids go through each cache as generation feeds them: a prompt
prefilled, then one token a step (or `chunk` tokens), every cache in lockstep on the
same tokens, the exact full-precision `static` cache first. What is measured is
therefore the stored cache (what a quantised, bounded or evicting cache hands
attention at each step), not full-sequence attention over the unstored keys.

Per cache, from the next-token distributions computed in float64 from log-softmax:
perplexity and bits per token on the text, KL divergence from the exact cache's
distribution (mean and max over positions), top-1 agreement with it, the loss of every
scored token (where a collapse starts), the bytes the cache holds at the end, and the
median decode time per token, the prefill's time and, for a kind that compresses the
prompt once (`snapkv`, `knorm`, `recent`), the compression's share of it. Per layer,
the share of attention the first token draws under the exact cache ("is there a
sink?"), from one explicit-attention pass.

Scored: the predictions of tokens prompt_len .. n-1, the first from the prefill's last
position, the rest from the decode steps; the last token is never fed.

The prompt is always prefilled as one forward, so this protocol is also the prompt-
compression one: a compressing kind sees the whole prompt (its last tokens' attention for
SnapKV), compresses it once at the end of that forward, and every scored token after is
decoded over what it kept, appended to, never evicted. Its prefill prediction is the
exact one (the prompt attends over all of itself); what compression costs shows from the
first decoded token on.
Everything returns frozen dataclasses; nothing here prints.
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcache_cli.caches.base import ForwardingCache, KVCache
from kvcache_cli.caches.spec import CacheSpec, check_prompt, parse_cache_spec
from kvcache_cli.sizing.units import shown

if TYPE_CHECKING:
    from torch import Tensor

    from kvcache_cli.models.base import FamilyModel

REFERENCE = "static"  # the exact full-precision cache every other one is compared with
DEFAULT_PROMPT_LEN = 64
DEFAULT_TOKENS = 2_000  # the issues' targets are stated at 2,000 tokens of held-out text
# Without --cache: issue 15's table, each quantised format at its default layout, with the
# half-precision cache engines deploy as their float one beside the float32 reference.
# Bounded kinds need a budget that fits the model's context, so they are named with it; the
# exact ones score KL 0 by construction.
DEFAULT_CACHES = ("static", "fp16", "int8", "int4", "int2", "fp8-e4m3")


@dataclass(frozen=True)
class CacheMaker:
    """A cache that no spec names (a test's damaged cache, a peer library's wrapper):
    `build(model, max_len)` makes a fresh one."""

    name: str
    build: Callable[[FamilyModel, int], KVCache]

    def __str__(self) -> str:  # named as a spec is wherever caches are listed (progress)
        return self.name


@dataclass(frozen=True)
class CacheQuality:
    cache: str  # the spec's canonical spelling, or a CacheMaker's name
    reference: bool  # the exact cache the others are compared with
    perplexity: float  # exp(mean NLL) over the scored tokens
    bits_per_token: float  # mean NLL / ln 2 (bits per byte for a byte-level model)
    perplexity_change: float  # perplexity / the reference's - 1 (0.01 = 1% worse)
    kl_mean: float  # KL(exact || this) in nats, mean over scored positions
    kl_max: float
    kl_max_position: int  # the token position whose prediction diverged most
    top1_agreement: float  # share of positions whose argmax equals the exact cache's
    bytes_held: int  # cache.bytes_held after the last token: scales, zero points, residual
    positions: int  # positions written into the cache by then (cache.length)
    bytes_per_token: float  # bytes_held / positions: what a token of context costs
    bytes_ratio: float  # bytes_per_token / the reference's
    prefill_ms: float  # the prompt's forward through this cache, compression included
    compress_ms: float  # of which the compression of the prompt (0: a kind that keeps it)
    decode_ms_per_token: float  # median over decode steps of step time / tokens in the step
    loss_by_position: tuple[float, ...] = field(repr=False)  # NLL (nats) of tokens prompt_len..
    # The exact cache this row is scored against: `static`, or a peer engine's own
    # (llama.cpp's f32 cache), whose row is in the same table.
    against: str = REFERENCE
    # The library whose cache this is ('' for kvcache's own): transformers, llama.cpp.
    peer: str = ""
    # On a model with sliding-window layers (Gemma 3): the bytes held per layer kind,
    # {'full': ..., 'sliding': ...}; {} on a model whose every layer attends in full.
    bytes_by_kind: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """A cache a peer library would not build for this model, and its reason (one line)."""

    cache: str
    peer: str
    reason: str


@dataclass(frozen=True)
class QualityResult:
    model: str  # where the weights came from
    weights_note: str | None  # one line when `auto` fell back to random weights
    text: str  # what the tokens are (file, held-out text, ...)
    tokens: int  # token ids read; tokens - prompt_len predictions scored
    prompt_len: int
    chunk: int  # tokens fed per decode step
    device: str
    dtype: str
    threads: int
    torch_version: str
    machine: str
    reference: str  # the exact cache's spec
    caches: tuple[CacheQuality, ...]  # the reference first
    # Per layer, the share of attention the first token draws from the scored queries
    # (averaged over heads and queries), under the exact cache.
    first_token_share: tuple[float, ...]
    # What the first token would draw if attention were uniform over the past (the same
    # queries): a share far above it is a sink.
    uniform_share: float
    # The caches a peer refused for this model (transformers' QuantizedCache on a model
    # with a sliding layer), with why: rows of the table that have no figures.
    refused: tuple[Refusal, ...] = ()

    @property
    def scored(self) -> int:
        return self.tokens - self.prompt_len

    def against(self, row: CacheQuality) -> CacheQuality:
        """The exact row `row` is scored against (itself for a reference)."""
        return self.cache(row.against) if not row.reference else row

    def cache(self, name: str) -> CacheQuality:
        for row in self.caches:
            if row.cache == name:
                return row
        raise KeyError(f"cache {name!r} was not evaluated "
                       f"(evaluated {', '.join(c.cache for c in self.caches)})")


def result_from_json(data) -> QualityResult:
    """The QualityResult `kvcache eval --json` printed (lists back to the tuples the
    dataclasses hold, null back to NaN where a row has no time), or a ValueError saying what
    does not fit and what was expected: a retrieval run's, another command's, a hand-edited
    file. Every field is checked here, as the plot (minutes later, for a real run) would
    otherwise fail on it with matplotlib's words or a traceback."""
    try:
        result = _typed(data, "QualityResult", "the file")
        if not result.caches:
            raise ValueError("caches is []: expected a row per cache, the exact one first")
        if not 1 <= result.prompt_len < result.tokens:
            raise ValueError(f"prompt_len is {result.prompt_len:,} of {result.tokens:,} "
                             "tokens: expected at least 1 and fewer than tokens")
        names = {row.cache for row in result.caches}
        for i, row in enumerate(result.caches):
            if len(row.loss_by_position) != result.scored:
                raise ValueError(f"caches[{i}].loss_by_position has {len(row.loss_by_position):,}"
                                 f" values: expected {result.scored:,} (tokens - prompt_len)")
            if not row.reference and row.against not in names:
                raise ValueError(f"caches[{i}].against is {shown(row.against)}: expected the "
                                 f"name of a cache in the file ({', '.join(sorted(names))})")
    except ValueError as err:
        raise ValueError(f"not the --json of a kvcache eval text run ({err})") from None
    return result


# Where a row has no time (a peer's rows: llama.cpp is fed in chunks), its --json has null;
# every other figure is measured, so a null or NaN there is a damaged file.
UNTIMED = frozenset({"prefill_ms", "decode_ms_per_token"})


def _typed(value, kind: str, where: str, field_name: str = ""):
    """VALUE as the dataclass annotation KIND reads it ('int', 'tuple[float, ...]',
    'CacheQuality', ...), or a ValueError naming WHERE it is and what was expected."""
    import dataclasses

    rows = {"QualityResult": (QualityResult, "a kvcache eval result"),
            "CacheQuality": (CacheQuality, "a cache's row"), "Refusal": (Refusal, "a refusal")}
    whole = isinstance(value, int) and not isinstance(value, bool)
    expected = None
    if kind in rows:
        cls, label = rows[kind]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(value, dict):
            expected = f"an object, {label}"
        else:
            extra = next((k for k in value if k not in fields), None)
            needed = next((f.name for f in fields.values() if f.name not in value
                           and f.default is f.default_factory is dataclasses.MISSING), None)
            if extra is not None:
                raise ValueError(f"{where} has {shown(extra)}: expected only the fields of "
                                 f"{label}")
            if needed is not None:
                raise ValueError(f"{where} has no {needed!r}: expected every field of {label}")
            prefix = "" if cls is QualityResult else f"{where}."
            return cls(**{k: _typed(v, fields[k].type, prefix + k, k) for k, v in value.items()})
    elif kind.startswith("tuple["):  # tuple[X, ...], a list in JSON
        if isinstance(value, list):
            return tuple(_typed(v, kind[6:-6], f"{where}[{i}]", field_name)
                         for i, v in enumerate(value))
        expected = "a list"
    elif kind == "dict[str, int]":  # bytes by layer kind
        if isinstance(value, dict):
            return {k: _typed(v, "int", f"{where}[{k!r}]") for k, v in value.items()}
        expected = "an object of whole numbers"
    elif kind == "float":
        if field_name in UNTIMED and (value is None or value == "nan"):  # "nan": before null
            return math.nan
        # abs() <= max: false for NaN and infinity, and for an integer past a float's range
        if (whole or isinstance(value, float)) and abs(value) <= sys.float_info.max:
            return float(value)
        expected = "a finite number" + (" or null" if field_name in UNTIMED else "")
    elif kind == "int":  # a count or a position: past 2^53 no JSON reader holds it exactly
        if whole and 0 <= value <= 2**53:
            return value
        expected = "a whole number from 0 to 2^53"
    elif kind == "bool":
        if isinstance(value, bool):
            return value
        expected = "true or false"
    elif kind in ("str", "str | None"):
        if isinstance(value, str) or (value is None and kind != "str"):
            return value
        expected = "a string" + (" or null" if kind != "str" else "")
    else:  # a field of a type this reader was not taught: the code's error, not the file's
        raise TypeError(f"{where}: no reader for a field of type {kind}")
    said = "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else shown(value)  # as the file spells it
    raise ValueError(f"{where} is {said}: expected {expected}")


# ---------------------------------------------------------------------------- inputs


def check_eval(block_size: int, tokens: int | None, prompt_len: int, chunk: int) -> None:
    """Raise ValueError naming the value when the run cannot be made (no model needed).
    `tokens`: --tokens as given, None when not (a default is never named in a refusal)."""
    if not 1 <= prompt_len < block_size:
        raise ValueError(f"--prompt-len {prompt_len:,}: expected a whole number from 1 to "
                         f"{block_size - 1:,} (a token left to score within the model's "
                         f"context window of {block_size:,})")
    if not 1 <= chunk < block_size:
        raise ValueError(f"--chunk {chunk:,}: expected a whole number from 1 to "
                         f"{block_size - 1:,} (1 feeds one token a step, as decoding does)")
    if tokens is None:
        return
    if tokens > block_size:
        raise ValueError(f"--tokens {tokens:,} is beyond the model's context window of "
                         f"{block_size:,} positions: expected at most {block_size:,}")
    if tokens <= prompt_len:
        raise ValueError(f"--tokens {tokens:,} leaves nothing to score after --prompt-len "
                         f"{prompt_len:,}: expected more tokens than --prompt-len (or a "
                         "shorter prompt)")


def tokens_to_read(available: int, block_size: int, requested: int | None, prompt_len: int,
                   text: str = "the text") -> int:
    """How many of a text's `available` tokens to evaluate: `requested`, or by default as
    many as the text, the context window and DEFAULT_TOKENS allow; ValueError when the
    text is too short for the prompt or for the tokens asked."""
    if available <= prompt_len:
        raise ValueError(f"{text} has {available:,} tokens, too few for a prompt of "
                         f"{prompt_len:,} and a token to predict: expected a longer text or "
                         "a shorter --prompt-len")
    if requested is None:
        return min(available, block_size, DEFAULT_TOKENS)
    if requested > available:
        raise ValueError(f"--tokens {requested:,}: {text} has only {available:,} tokens; "
                         f"expected at most {available:,} (or a longer text)")
    return requested


def default_caches() -> list[CacheSpec]:
    """DEFAULT_CACHES, parsed: every quantised format at its default layout."""
    return [parse_cache_spec(name) for name in DEFAULT_CACHES]


def check_caches(specs: Sequence[CacheSpec], config, max_len: int,
                 model: str = "the model", prompt_len: int | None = None) -> None:
    """Refuse a bounded cache whose budget passes the context window (it would never
    evict), a compressing one the prompt of `prompt_len` tokens cannot fill, then build
    each cache for this model's shape on the meta device, which allocates nothing: a kind
    that cannot hold the shape (a group size that does not divide the head width) raises
    its ValueError before any weights load."""
    import torch

    from kvcache_cli.caches import cache_class
    from kvcache_cli.caches.spec import check_context, check_prompt, check_spec

    for spec in specs:
        check_context(spec, config.context, model)
        check_spec(spec, config.head_size)  # every command's rule, before the peer's own
        if prompt_len is not None:
            check_prompt(spec, prompt_len)
        cache_class(spec).build(spec, config.cache_shape, max_len=max_len, batch=1,
                                device=torch.device("meta"), dtype=torch.float32, whole=False)


# What a row on every layer of a hybrid model is named: the spec, then this.
ALL_LAYERS = " all layers"


def with_sliding(specs: Sequence[CacheSpec], choices: Sequence[str]
                 ) -> list[CacheSpec | CacheMaker]:
    """Each spec once per `make_cache(sliding=)` choice asked: as itself for "model" (the
    spec on the full-attention layers, the sliding ones in exact rings of their window),
    and for "full" a maker of the spec on every layer, the sliding ones holding every
    position under their band (`<spec> all layers`). The exact reference is never repeated:
    on every layer it would be the same function at more bytes. A kind that picks what to keep
    from attention (a compressing one, H2O) sees each sliding layer's banded weights."""
    from kvcache_cli.caches import make_cache

    def everywhere(spec: CacheSpec) -> CacheMaker:
        return CacheMaker(f"{spec}{ALL_LAYERS}",
                          lambda model, n: make_cache(spec, model, n, sliding="full"))

    out: list[CacheSpec | CacheMaker] = []
    for spec in specs:
        if "model" in choices:
            out.append(spec)
        if "full" in choices and str(spec) != REFERENCE:
            out.append(everywhere(spec))
    return out


def _makers(caches: Sequence[str | CacheSpec | CacheMaker]) -> list[CacheMaker]:
    """The reference first, then every other cache in the order given (once each)."""
    from kvcache_cli.caches import make_cache

    def from_spec(spec: CacheSpec) -> CacheMaker:
        return CacheMaker(str(spec), lambda model, n: make_cache(spec, model, n))

    makers = [from_spec(parse_cache_spec(REFERENCE))]
    for item in caches:
        if isinstance(item, str):
            item = parse_cache_spec(item)
        maker = from_spec(item) if isinstance(item, CacheSpec) else item
        if maker.name not in {m.name for m in makers}:
            makers.append(maker)
    return makers


# ---------------------------------------------------------------------------- the run


@dataclass
class Tally:
    """One cache's running figures, one entry per scored position; a peer's evaluation
    (`hf_quality`) keeps its rows with it. `cache` is anything with bytes_held and length."""

    name: str
    cache: KVCache
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # per token
    prefill_ms: float = 0.0
    compress_ms: float = 0.0

    def score(self, logp: Tensor, targets: Tensor, exact: Tensor) -> None:
        """logp, exact: (T, vocab) float64 log-probabilities; targets (T,)."""
        self.nll += (-logp.gather(1, targets[:, None])[:, 0]).tolist()
        # KL(p || q) = sum p (log p - log q); exp of a log-softmax is p itself.
        self.kl += (exact.exp() * (exact - logp)).sum(-1).clamp_min(0.0).tolist()
        self.agree += (logp.argmax(-1) == exact.argmax(-1)).tolist()


def evaluate(
    model: FamilyModel,
    tokens: Sequence[int],
    caches: Sequence[str | CacheSpec | CacheMaker],
    *,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    chunk: int = 1,
    threads: int | None = None,
    model_name: str = "",
    weights_note: str | None = None,
    text_name: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> QualityResult:
    """Every cache in `caches` (and the exact `static` reference, always, first) fed
    `tokens` as generation feeds them, scored against the reference on the same tokens.

    `progress(done, total)` is called after each step with the positions scored so far.
    """
    import torch

    n = len(tokens)
    check_eval(model.config.context, n, prompt_len, chunk)
    if min(tokens) < 0 or max(tokens) >= model.config.vocab_size:
        bad = next(t for t in tokens if not 0 <= t < model.config.vocab_size)
        raise ValueError(f"token id {bad} is outside the model's vocabulary "
                         f"0..{model.config.vocab_size - 1}")
    for item in caches:
        if not isinstance(item, CacheMaker):
            check_prompt(parse_cache_spec(item) if isinstance(item, str) else item, prompt_len)
    makers = _makers(caches)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            tallies = _run(model, tokens, makers, prompt_len, chunk, progress)
            share, uniform = first_token_share(model, tokens, prompt_len)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(saved_threads)
    rows = summarise(tallies, prompt_len)
    return QualityResult(
        model=model_name, weights_note=weights_note, text=text_name, tokens=n,
        prompt_len=prompt_len, chunk=chunk, device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."), threads=used_threads,
        torch_version=torch.__version__, machine=platform.machine(), reference=REFERENCE,
        caches=rows, first_token_share=share, uniform_share=uniform,
    )  # fmt: skip


def _run(model: FamilyModel, tokens: Sequence[int], makers: list[CacheMaker], prompt_len: int,
         chunk: int, progress: Callable[[int, int], None] | None) -> list[Tally]:
    """Prefill, then decode steps, every cache in turn on each step (the reference first,
    so its log-probabilities are there to score the others against)."""
    import torch

    from kvcache_cli.caches import make_cache
    from kvcache_cli.measure import synchronize

    device = model.device
    ids = torch.tensor(tokens, device=device)[None]  # (1, n)
    fed = ids.size(1) - 1  # the last token is only ever a target
    tallies = [Tally(m.name, m.build(model, fed)) for m in makers]
    total = fed - prompt_len + 1

    def forward(tally: Tally, start: int, end: int, last_only: bool) -> tuple[Tensor, float]:
        synchronize(device)
        began = time.perf_counter()
        logits = model(ids[:, start:end], start, tally.cache, last_only=last_only)
        synchronize(device)
        ms = (time.perf_counter() - began) * 1e3
        # float64 from here: KL of nearly equal distributions is a difference of nearly
        # equal numbers, which float32 would round to noise around 1e-7.
        return torch.log_softmax(logits[0].double(), dim=-1), ms  # (T, vocab)

    # One untimed prefill and step first: the first forward pays one-time costs (kernel
    # selection, the allocator's first blocks) that would land in the reference's time.
    warm = make_cache(REFERENCE, model, prompt_len + 1)
    model(ids[:, :prompt_len], 0, warm, last_only=True)
    model(ids[:, prompt_len:prompt_len + 1], prompt_len, warm)

    # The prefill scores one prediction: its last position's, of token prompt_len.
    steps = [(0, prompt_len, True)] + [
        (start, min(start + chunk, fed), False) for start in range(prompt_len, fed, chunk)]
    done = 0
    if progress is not None:
        progress(done, total)  # the count is known before the first step: say it
    for start, end, prefill in steps:
        first = end - 1 if prefill else start  # the first position this step scores
        targets = ids[0, first + 1:end + 1]  # (T,)
        exact = None
        for tally in tallies:
            logp, ms = forward(tally, start, end, last_only=prefill)
            if exact is None:
                exact = logp
            tally.score(logp, targets, exact)
            if prefill:
                tally.prefill_ms = ms
                tally.compress_ms = _compress_ms(tally.cache)
            else:
                tally.step_ms.append(ms / (end - start))
        done += end - first
        if progress is not None:
            progress(done, total)
    return tallies


def _compress_ms(cache) -> float:
    """The prompt's compression time of a compressing kind, summed over a hybrid cache's
    groups (on Gemma 3 only the global layers' cache compresses); 0 for the others."""
    return sum(getattr(c, "compress_ms", 0.0) for c in getattr(cache, "caches", (cache,)))


def bytes_by_kind(cache) -> dict[str, int]:
    """Bytes held per layer kind of a cache that splits them (`HybridCache`, a peer's
    wrapper), {} for one that does not (every layer attends in full)."""
    split = getattr(cache, "bytes_by_kind", None)
    return split() if split is not None else {}


def summarise(tallies: list[Tally], prompt_len: int) -> tuple[CacheQuality, ...]:
    def per_token(t: Tally) -> float:
        return t.cache.bytes_held / t.cache.length

    reference = tallies[0]
    ref_nll = statistics.fmean(reference.nll)
    rows = []
    for t in tallies:
        nll = statistics.fmean(t.nll)
        worst = max(range(len(t.kl)), key=t.kl.__getitem__)
        rows.append(CacheQuality(
            cache=t.name, reference=t is reference, perplexity=math.exp(nll),
            bits_per_token=nll / math.log(2), perplexity_change=math.expm1(nll - ref_nll),
            kl_mean=statistics.fmean(t.kl), kl_max=t.kl[worst],
            kl_max_position=prompt_len + worst,
            top1_agreement=statistics.fmean(t.agree), bytes_held=t.cache.bytes_held,
            positions=t.cache.length, bytes_per_token=per_token(t),
            bytes_ratio=per_token(t) / per_token(reference), prefill_ms=t.prefill_ms,
            compress_ms=t.compress_ms,
            decode_ms_per_token=statistics.median(t.step_ms) if t.step_ms else math.nan,
            loss_by_position=tuple(t.nll), peer=_peer(t.name),
            bytes_by_kind=bytes_by_kind(t.cache),
        ))  # fmt: skip
    return tuple(rows)


def _peer(name: str) -> str:
    """'transformers' for a spec of transformers' QuantizedCache; '' for kvcache's own kinds
    and a CacheMaker's (a test's cache, named by no spec)."""
    from kvcache_cli.caches.grammar import CacheSpecError

    try:
        factory = parse_cache_spec(name).info.factory
    except CacheSpecError:
        return ""
    return "transformers" if factory.startswith("kvcache_cli.caches.peer:") else ""


# ---------------------------------------------------------------------------- the sink


class _FirstTokenWatch(ForwardingCache):
    """The exact cache holding every position (a sliding layer's too, under its band),
    with attention asked to hand back its weights: it records, per layer, the share the
    first key draws from the queries at positions `first_query` on."""

    wants_attention = True

    def __init__(self, inner: KVCache, windows: list[int | None], first_query: int):
        super().__init__(inner)
        self.first_query = first_query
        self.windows = windows  # each layer's sliding window, None for full attention
        self.share = [math.nan] * len(windows)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step) -> Tensor:
        import torch

        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs), in order
        held = torch.arange(keys.size(2), device=keys.device)  # (S,): key j is position j
        y, weights = step.weighted(q, keys, values, step.visible(held, self.windows[layer]))
        self.observe(layer, weights)
        return y

    def observe(self, layer: int, weights: Tensor) -> None:
        # weights (B, nh, T, S): one pass from position 0, so query i is position i.
        self.share[layer] = weights[0, :, self.first_query:, 0].double().mean().item()


def first_token_share(model: FamilyModel, tokens: Sequence[int], prompt_len: int
                      ) -> tuple[tuple[float, ...], float]:
    """(per layer, the mean attention share of the first token over heads and the scored
    queries; the share uniform attention would give it), from one pass with explicit
    attention through the exact cache.

    One pass of every fed token equals the step-by-step run for an exact cache (every
    query sees the same keys), and costs one forward instead of a second decode.
    """
    import torch

    from kvcache_cli.caches import make_cache

    fed = len(tokens) - 1
    ids = torch.tensor(tokens[:fed], device=model.device)[None]  # (1, fed)
    # sliding="full": every position held in order, so key j is position j on every layer.
    windows = [t.window for t in model.config.cache_shape.layer_types]
    watch = _FirstTokenWatch(make_cache(REFERENCE, model, fed, sliding="full"), windows,
                             prompt_len - 1)
    with torch.inference_mode():
        model(ids, 0, watch, last_only=True)
    # The query at position p spreads uniform attention over p + 1 keys.
    uniform = statistics.fmean(1 / (p + 1) for p in range(prompt_len - 1, fed))
    return tuple(watch.share), uniform
