"""The modes `bench` times (ours, transformers', llama.cpp's, any cache spec), parsed and
checked, and the facts a mode depends on (its compile mode, the CPU's half support)."""

from __future__ import annotations

import contextlib

from kvcache_cli.models.llama_cpp import LLAMA_MODES

# hf-static is transformers' generate() with its static cache; a "-compiled" mode is
# the same under torch.compile (the compile is paid in the untimed warm-up);
# static-replayed is static with each decode step's native calls recorded once and run
# again without the Python between them (`generate.ReplayedDecode`). hf-quanto is
# generate() with its QuantizedCache (quanto, int4, groups of 64, residual 128: its
# defaults), the peer of kvcache's quantised caches as a transformers user runs it.
# llama.cpp, llama.cpp-f16, llama.cpp-q8_0 run llama.cpp (the `llama` extra) on the
# same weights written to GGUF: the engine a CPU user would pick, as a peer;
# llama.cpp-gguf runs the very file a Llama-family model was read from.
MODES = (
    "naive", "concat", "static", "hf", "hf-static", "static-compiled", "hf-static-compiled",
    "static-replayed", "hf-quanto", *LLAMA_MODES,
)  # fmt: skip

# The project's own loops; every other mode is a peer it is measured against.
OURS = ("naive", "concat", "static", "static-compiled", "static-replayed")

# The cache each of our step's ways runs on: a compiled or replayed static mode's is static.
STEP_SUFFIXES = ("-compiled", "-replayed")


def cache_of(mode: str) -> str:
    """The cache spec a mode of ours decodes with: `static-compiled` -> `static`."""
    for suffix in STEP_SUFFIXES:
        mode = mode.removesuffix(suffix)
    return mode

DEFAULT_MODES = ("naive", "concat", "static", "hf", "hf-static")

COMPILED = {"static": "static-compiled", "hf-static": "hf-static-compiled"}

# torch.compile's mode per device: CUDA graphs remove the launch overhead on a GPU;
# the CPU has none to remove.
COMPILE_MODE = {"cpu": "default", "cuda": "reduce-overhead"}


def parse_modes(text: str) -> tuple[str, ...]:
    """`"naive,static,window:128"` -> `("naive", "static", "window:128")`, in the order
    given: the modes above, or any other cache spec (`caches.spec`), spelled canonically."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import names as kinds
    from kvcache_cli.caches.spec import parse_cache_spec

    given = [part.strip() for part in text.split(",") if part.strip()]
    for part in given:  # a known kind with a bad field: the spec's own reason, not "unknown"
        if part.lower() not in MODES and part.split(":", 1)[0].lower() in kinds():
            try:
                parse_cache_spec(part)
            except CacheSpecError as err:
                raise ValueError(f"--modes: {err}") from None
    names = tuple(mode_name(part) for part in given)
    unknown = [part for part, name in zip(given, names, strict=True) if name is None]
    if unknown or not names:
        what = f"unknown mode {', '.join(map(repr, unknown))}" if unknown else "no modes given"
        raise ValueError(f"{what}; valid modes: {', '.join(MODES)}, or a cache spec such as "
                         "window:128, sink:4+124, h2o:64+64")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"mode {', '.join(map(repr, repeated))} given twice")
    return names


def mode_name(text: str) -> str | None:
    """A mode's name, a cache spec's canonical spelling, or None for neither."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_spec

    if text.lower() in MODES:  # names in any case, as cache specs are read
        return text.lower()
    try:
        return str(parse_cache_spec(text))
    except CacheSpecError:
        return None


def bounded_spec(mode: str):
    """The cache spec of a bounded mode (window, sink, h2o), else None."""
    from kvcache_cli.caches.spec import KINDS, parse_cache_spec

    if mode in MODES or mode.split(":", 1)[0] not in KINDS:
        return None
    spec = parse_cache_spec(mode)
    return spec if spec.info.bounded else None


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Seeded random token ids: speed does not depend on what the prompt says."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def cpu_half_support() -> str:
    """The CPU's half-precision instructions, from /proc/cpuinfo's flags (Linux)."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    wanted = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
    has = [flag for flag in wanted if flag in flags]
    lacks = [flag for flag in wanted if flag not in flags]
    return (f"has {', '.join(has)}" if has else "has none of " + ", ".join(wanted)) + (
        f"; lacks {', '.join(lacks)}" if has and lacks else "")
