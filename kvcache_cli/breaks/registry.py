"""Every break `kvcache break` knows, in one registry: its name, what it runs on, its title,
and the function that runs it.

`kvcache break --list`, shell completion and dispatch all read `registry()`, so a new break
registers here and nowhere else. Torch-free, like the cache registry (`caches.spec`): the
list and completion never pay for torch; a runner's module is imported only when it runs.

What a break runs on (`runs_on`, its first family the one it is listed under and whose
default model it loads without `-m`):

- `toy`: the reference script's NumPy model (`kv_cache_from_scratch.BREAKS`, which keeps its
  own table so the script stays one file);
- `gpt2`: GPT-2 (`-m gpt2` by default); most also run on a Llama, since they break the
  decode loop or the cache, which every family shares (the two that plant outliers,
  kv-outlier-keys and fp8-range, do it in either family's fused q, k, v weights);
- `llama`: the Llama family only (rotary positions, grouped-query attention), SmolLM2
  unless `-m` names another Llama;
- `gemma3`: the Gemma 3 family only (sliding-window and global layers, a rotary base
  each), Gemma 3 270M (`-m gemma3`) unless `-m` names another.

A break whose symptom needs trained attention (`real`: the quantised caches' three, whose
damage and fix mean something only on a model that predicts well, and evict-sink, whose
sink must exist to be lost) runs on SmolLM2 without `-m` where it is installed, though it
is listed under GPT-2, where it also runs.

A runner is `module:function`, called `function(name, model, max_new_tokens=..., progress=...)`
with the loaded model; it returns the frozen result that the views render and --json dumps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FAMILIES = ("toy", "gpt2", "llama", "gemma3")
# Positions a quantised-cache break scores at least: a prompt's continuation.
QUANT_BREAK_TOKENS = 128


@dataclass(frozen=True)
class Break:
    name: str
    runs_on: tuple[str, ...]  # the model families it runs on (FAMILIES), its own first
    title: str  # one line: --list, completion's help
    runner: str  # 'module:function'; '' for the toy's, which the reference script runs
    # Its symptom needs trained attention (a real sink): without -m it runs on SmolLM2
    # where that is installed, on its family's default otherwise.
    real: bool = False

    @property
    def family(self) -> str:
        """The family it is listed under, whose default model it loads without -m."""
        return self.runs_on[0]


ANY = ("gpt2", "llama")  # a break of the loop or the cache: every family has one


def _torch(runs_on: tuple[str, ...], runner: str, *rows: tuple[str, str],
           real: bool = False) -> list[Break]:
    return [Break(name, runs_on, title, runner, real) for name, title in rows]


_TORCH_BREAKS = (
    # The article's three: a correct loop with one call changed (kvcache_cli.breaks.loop).
    *_torch(ANY, "kvcache_cli.breaks.loop:run_break",
            ("position-offset", "GPT-2: every decode token gets position 0"),
            ("causal-decode", "GPT-2: is_causal=True for a one-row query against the cache"),
            ("stale-cache", "GPT-2: a cache reused across requests without a reset")),
    # Speculative decoding's rollback (kvcache_cli.speculative.decode).
    *_torch(ANY, "kvcache_cli.breaks.speculative:no_rollback",
            ("no-rollback", "GPT-2: speculative decoding keeps the rejected keys and values")),
    *_torch(ANY, "kvcache_cli.breaks.speculative:rollback_shared",
            ("rollback-shared", "GPT-2: a paged rollback frees a block another sequence "
                                "still reads")),
    # The quantised caches' known failures, each beside its fix (kvcache_cli.breaks.quantized).
    # kv-outlier-keys and fp8-range plant their outliers in the fused q, k, v weights.
    *_torch(ANY, "kvcache_cli.breaks.quantized:quantised",
            ("kv-outlier-keys", "int4 cache: outlier key channels under one scale per key "
                                "vector, against per-channel scales"), real=True),
    # kv-sink-token and evict-sink need a real sink: SmolLM2's first token draws half
    # the attention of its later layers; GPT-2's tiny checkpoints have none to lose.
    *_torch(ANY, "kvcache_cli.breaks.quantized:quantised",
            ("kv-sink-token", "int2 cache: the attention-sink token quantised, against kept "
                              "(SmolLM2 where installed)"), real=True),
    *_torch(ANY, "kvcache_cli.breaks.quantized:quantised",
            ("fp8-range", "fp8 cache: scale 1.0 on values beyond the range, against "
                          "calibrated"), real=True),
    # The bounded caches' (kvcache_cli.breaks.bounded).
    *_torch(ANY, "kvcache_cli.breaks.bounded:run_bounded_break",
            ("evict-sink", "a window that evicts the first tokens, against sinks + window "
                           "(SmolLM2 where installed)"), real=True),
    *_torch(ANY, "kvcache_cli.breaks.bounded:run_bounded_break",
            ("ring-mask", "GPT-2: a ring buffer masked by slot index instead of position"),
            ("ring-off-by-one", "GPT-2: the newest token written one slot late, over a live "
                                "key")),
    # Rotary positions and grouped-query attention (kvcache_cli.breaks.llama).
    *_torch(("llama",), "kvcache_cli.breaks.llama:run_llama_break",
            ("rope-decode", "Llama: the rotary position forgotten at decode (every new key "
                            "and query rotated as position 0)"),
            ("kv-expand-early", "Llama: KV heads expanded to query heads before the cache: "
                                "the same tokens, 3x the bytes"),
            ("gqa-interleave", "Llama: query heads grouped with the wrong KV heads "
                               "(h % nkv, not h // (nh/nkv))"),
            ("rope-twice", "Llama: the cached key rotated again when read from the cache")),
    # A bounded cache under rotary positions (kvcache_cli.breaks.bounded).
    *_torch(("llama",), "kvcache_cli.breaks.bounded:run_bounded_break",
            ("evict-rope-slot", "Llama: a sink ring evicts with no position decided: each "
                                "kept key read at its slot index")),
    # The sliding window and the two rotary bases (kvcache_cli.breaks.gemma3).
    *_torch(("gemma3",), "kvcache_cli.breaks.gemma3:run_gemma3_break",
            ("sliding-unbanded", "Gemma 3: the sliding layers given a full cache without "
                                 "their band (they attend past the window)"),
            ("rope-bases-swapped", "Gemma 3: the rotary bases swapped (1,000,000 on the "
                                   "sliding layers, 10,000 on the global ones)"),
            ("global-windowed", "Gemma 3: the global layers bounded like the sliding ones "
                                "(a ring of the window)")),
)


@functools.cache
def registry() -> dict[str, Break]:
    """name → Break, in the order `--list` shows and `all` runs: the toy's, then GPT-2's,
    then Llama's, then Gemma 3's."""
    import kv_cache_from_scratch as ref  # NumPy only: the toy's names and titles

    toy = [Break(name, ("toy",), s.title, "") for name, s in ref.BREAKS.items()]
    return {b.name: b for b in (*toy, *_TORCH_BREAKS)}


def names(family: str) -> list[str]:
    """The breaks that run on `family`, in registry order."""
    return [b.name for b in registry().values() if b.family == family]


def runner(name: str):
    """The function that runs break `name` (imports its module: torch for all but the toy)."""
    import importlib

    module, function = registry()[name].runner.split(":")
    return getattr(importlib.import_module(module), function)
