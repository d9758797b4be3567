"""`bench --context`: one decode step's time at long cached contexts, for each cache kind,
beside llama.cpp's step with the matched cache type on the same weights.

At a long context a decode step reads the whole cache once, so its time is the price of a
cache kind that `eval` (quality) and `size` (bytes) cannot show. Each of our caches is
filled to the context once, with seeded random keys and values written straight into every
layer (no forward: a step's time does not depend on what the keys hold); llama.cpp is fed
the same number of tokens as one prefill, with flash attention on (its quantised V cache
needs it). At each context the engines take turns, `repeats` rounds of `steps` decode steps
each, every step timed on its own; a round starts from the context again (the cache cropped
back), so every step is timed at the context it is listed under. Medians over all steps,
the spread of the rounds' medians beside them.

Caches that choose their keys by attention (heavy hitters, SnapKV and kin) cannot be filled
without a forward, and are refused with that reason.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache_cli.measure import OtherProcesses

# Our cache kind -> the llama.cpp cache type that stores the same elements (ggml type id for
# its type_k/type_v): the half-precision caches beside f16 (llama.cpp's default), and our
# float32 ones too (the nearest it has), int8 beside q8_0 (blocks of 32 with one fp16
# scale), int4 beside q4_0.
LLAMA_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}
LLAMA_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MATCHED = {"static": "f16", "paged": "f16", "concat": "f16", "fp16": "f16", "bf16": "f16",
           "int8": "q8_0", "int4": "q4_0"}
# The kind that stores what each llama.cpp type stores, 2 bytes a number for f16: the one
# its series is set beside when several of ours match it.
LIKE_FOR_LIKE = {"f16": "fp16", "q8_0": "int8", "q4_0": "int4"}
# --cache without a list: the float32 cache kvcache has always measured, the half-precision
# one engines deploy (the float baseline llama.cpp's f16 is matched with), int8 and int4.
DEFAULT_CACHES = "static,fp16,int8,int4"
# Weights format -> the llama.cpp bench mode that runs the same weights: q8_0 and gguf-q8
# in its very arithmetic (the same blocks, the row rounded to 8 bits alike), int8 (one
# scale a row) and gguf (exact float products) the nearest it has.
LLAMA_MODE_FOR_WEIGHTS = {"fp32": "llama.cpp", "fp16": "llama.cpp-f16", "bf16": "llama.cpp-f16",
                          "int8": "llama.cpp-q8_0", "q8_0": "llama.cpp-q8_0",
                          "q4": "llama.cpp-gguf", "gguf": "llama.cpp-gguf",
                          "gguf-q8": "llama.cpp-gguf"}

# (what is being timed, points done, points in all)
ContextProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ContextPoint:
    context: int  # tokens in the cache when each timed step began
    step_ms: float  # median over every timed step
    spread_ms: tuple[float, float]  # min, max of the rounds' medians
    cache_bytes: int  # what the step reads of the cache at this context


@dataclass(frozen=True)
class ContextSeries:
    engine: str  # "kvcache" or "llama.cpp"
    cache: str  # our spec, or llama.cpp's cache type
    matches: str | None  # the other engine's matched cache (None: it has none)
    points: tuple[ContextPoint, ...]
    replayed: bool = False  # ours: every step after the first recordings replayed


@dataclass(frozen=True)
class ContextResult:
    model: str
    weights: str  # the weights format, both engines'
    weight_bytes: int  # ours; llama.cpp's file is in llama_file
    head_bytes: int  # of weight_bytes, the LM head's: every row of the vocabulary
    threads: int
    steps: int
    repeats: int
    contexts: tuple[int, ...]
    series: tuple[ContextSeries, ...]
    llama_file: str | None
    llama_note: str | None  # why llama.cpp is absent, when it is
    others_cpu_share: float | None
    kernel_note: str | None  # why a C++ kernel (attention over codes, products) was not used
    replay: bool = False  # our steps asked to be replayed where the cache allows

    def of(self, engine: str, cache: str) -> ContextSeries | None:
        return next((s for s in self.series if s.engine == engine and s.cache == cache), None)


def check_context(model_config, specs: Sequence, contexts: Sequence[int], steps: int) -> None:
    """Refuse a context plan that cannot run, before the weights load (ValueError)."""
    from kvcache_cli.caches import cache_class
    from kvcache_cli.caches.bounded import HeavyHitterCache
    from kvcache_cli.caches.compressed import PromptCompressedCache

    for spec in specs:
        cls = cache_class(spec)
        if issubclass(cls, (HeavyHitterCache, PromptCompressedCache)):
            raise ValueError(f"--cache {spec}: it chooses its keys by attention, and --context "
                             "fills caches without a forward; expected an exact, quantised "
                             "or window cache")
    if list(contexts) != sorted(set(contexts)):
        raise ValueError(f"--context {','.join(map(str, contexts))}: expected increasing "
                         "token counts, each once")
    need = contexts[-1] + steps
    if need > model_config.context:
        raise ValueError(f"--context {contexts[-1]:,} with {steps} timed steps needs {need:,} "
                         f"positions; the model has {model_config.context:,}: lower the "
                         "context or --new-tokens")


def _fill(model, cache, start: int, end: int, seed: int) -> None:
    """Positions start .. end - 1 of every layer written with seeded random keys, values."""
    import torch

    c = model.config
    g = torch.Generator().manual_seed(seed)
    # Under inference mode, as the steps run: a cache that grew its buffers during a step
    # holds inference tensors, which only inference mode may write.
    with torch.inference_mode():
        for layer in range(c.n_layer):
            k, v = (torch.randn(1, c.n_kv_head, end - start, c.head_size, generator=g)
                    .to(device=model.device, dtype=model.dtype)
                    for _ in range(2))  # (1, nkv, T, hs)
            cache.update(layer, start, k, v)


class _Ours:
    """One of our caches, filled to each context in turn; its steps the model's, or, with
    `replay`, `generate.ReplayedDecode`'s (eager where the cache cannot be replayed)."""

    def __init__(self, model, spec, longest: int, steps: int, replay: bool = False):
        from kvcache_cli.caches import make_cache
        from kvcache_cli.generate import ReplayedDecode

        self.model, self.spec, self.name = model, spec, str(spec)
        self.cache = make_cache(spec, model, longest + steps)
        self.forward = ReplayedDecode(model) if replay else None
        self.filled = 0

    @property
    def replayed(self) -> bool:
        return self.forward is not None and self.forward.steps_replayed > 0

    def to(self, context: int) -> int:
        """Fill to `context`; the cache bytes a step then reads (what `size` counts, not the
        buffers' capacity): a sliding layer's ring at most its window."""
        from kvcache_cli.bench.summary import kv_bytes_read

        _fill(self.model, self.cache, self.filled, context, seed=context)
        self.filled = context
        return kv_bytes_read(self.model.config.cache_shape, context,
                             self.model.dtype.itemsize, self.spec)

    def steps(self, context: int, n: int) -> list[float]:
        import torch

        from kvcache_cli.caches import RollbackError

        token = torch.tensor([[1]], device=self.model.device)
        times = []
        with torch.inference_mode():
            for i in range(n):
                start = time.perf_counter()
                (self.forward or self.model)(token, context + i, self.cache)
                times.append(time.perf_counter() - start)
        try:
            self.cache.crop(context)  # the next round starts at the same context
        except RollbackError:  # a ring that wrapped cannot reach back: filled again
            self.cache.reset()
            _fill(self.model, self.cache, 0, context, seed=context)
        return times


class _Llama:
    """llama.cpp with one cache type, fed to each context in turn."""

    def __init__(self, path: str, kind: str, longest: int, steps: int, threads: int, shape):
        from llama_cpp import Llama

        self.name, self.shape = kind, shape
        # K and V of one layer and position, in llama.cpp's type
        self.per_position = 2 * shape.n_kv_head * shape.head_size * LLAMA_ELEMENT_BYTES[kind]
        self.llm = Llama(model_path=path, n_ctx=longest + steps, n_batch=512,
                         n_threads=threads, n_threads_batch=threads, flash_attn=True,
                         swa_full=False,  # sliding layers hold their window (`LlamaRunner`)
                         type_k=LLAMA_CACHE_TYPES[kind], type_v=LLAMA_CACHE_TYPES[kind],
                         verbose=False)
        self.fed = 0

    def to(self, context: int) -> int:
        self.llm.n_tokens = self.fed
        self.llm.eval([1] * (context - self.fed))
        self.fed = context
        # A sliding layer counted up to its window, as ours: with swa_full off llama.cpp's
        # sliding cache holds the window (and a batch, padded), and a step reads the window.
        positions = sum(min(context, t.window or context) for t in self.shape.layer_types)
        return round(self.per_position * positions)

    def steps(self, context: int, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.llm.eval([1])
            times.append(time.perf_counter() - start)
        self.llm.n_tokens = context  # the next eval writes from the context again
        return times

    def close(self) -> None:
        self.llm.close()


def llama_file(model, weights: str) -> tuple[str | None, str | None]:
    """(the GGUF llama.cpp runs for these weights, or None and why not)."""
    from kvcache_cli.models.llama_cpp import INSTALL, llama_available, prepare

    if not llama_available():
        return None, f"llama.cpp is not installed: {INSTALL}"
    mode = LLAMA_MODE_FOR_WEIGHTS.get(weights)
    if mode is None:
        return None, f"llama.cpp has no format for {weights} weights"
    if mode == "llama.cpp-gguf" and getattr(model.config, "gguf", None) is None:
        return None, "q4 weights come from a GGUF's blocks; this model was not read from one"
    return str(prepare(model, mode).path), None


def _matched(specs: Sequence, kind: str) -> str | None:
    """Ours that llama.cpp's `kind` is set beside: the like-for-like kind where listed
    (fp16 for f16), else the first that matches it."""
    matching = [s for s in specs if MATCHED.get(s.kind) == kind]
    alike = [s for s in matching if s.kind == LIKE_FOR_LIKE[kind]]
    return str((alike or matching)[0]) if matching else None


def run_context(model, specs: Sequence, contexts: Sequence[int], steps: int, repeats: int,
                threads: int, model_name: str, weights: str, with_llama: bool = True,
                progress: ContextProgress | None = None, replay: bool = False
                ) -> ContextResult:
    """Every cache's (and llama.cpp's matched cache's) decode step timed at each context;
    ours replayed where a cache allows it, with `replay`."""
    from kvcache_cli.bench.summary import kernel_note
    from kvcache_cli.measure import head_bytes, weight_bytes

    others = OtherProcesses()
    c = model.config
    longest = contexts[-1]
    engines: list = [_Ours(model, spec, longest, steps, replay) for spec in specs]
    path, note = llama_file(model, weights) if with_llama else (None, "not asked for")
    if path is not None:
        wanted = [MATCHED[s.kind] for s in specs if s.kind in MATCHED]
        engines += [_Llama(path, kind, longest, steps, threads, c.cache_shape)
                    for kind in LLAMA_CACHE_TYPES if kind in wanted]
    points: dict[str, list[ContextPoint]] = {e.name: [] for e in engines}
    # Work counted in tokens of context, each engine's at each context: a longer context
    # takes longer to fill and to step, and the ETA is the rate of the work done so far.
    done, total = 0, sum(contexts) * len(engines)
    try:
        for context in contexts:
            held = {}
            for e in engines:
                if progress:
                    progress(f"filling {e.name} to {context:,}", done, total)
                held[e.name] = e.to(context)
            rounds: dict[str, list[list[float]]] = {e.name: [] for e in engines}
            for _ in range(repeats):  # the engines take turns: a slow patch hits them all
                for e in engines:
                    rounds[e.name].append(e.steps(context, steps))
            for e in engines:
                every = [t for r in rounds[e.name] for t in r]
                medians = [statistics.median(r) * 1e3 for r in rounds[e.name]]
                points[e.name].append(ContextPoint(
                    context, statistics.median(every) * 1e3, (min(medians), max(medians)),
                    held[e.name]))
                done += context
            if progress:
                progress(f"{context:,} tokens timed", done, total)
    finally:
        for e in engines:
            if isinstance(e, _Llama):
                e.close()
    series = [ContextSeries("kvcache", e.name, MATCHED.get(e.spec.kind) if path else None,
                            tuple(points[e.name]), e.replayed)
              for e in engines if isinstance(e, _Ours)]
    series += [ContextSeries("llama.cpp", e.name, _matched(specs, e.name), tuple(points[e.name]))
               for e in engines if isinstance(e, _Llama)]
    return ContextResult(
        model=model_name, weights=weights, weight_bytes=weight_bytes(model),
        head_bytes=head_bytes(model), threads=threads,
        steps=steps, repeats=repeats, contexts=tuple(contexts), series=tuple(series),
        llama_file=path, llama_note=note, others_cpu_share=others.share(),
        kernel_note=kernel_note(), replay=replay)
