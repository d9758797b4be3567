"""llama.cpp's own KV cache types as `kvcache eval` rows: the same GGUF, the same token ids,
each scored against llama.cpp's exact (f32) cache as kvcache's rows are against `static`.

Spec (the `--cache` grammar's conventions: a name, then colon-separated fields):

    llama.cpp:TYPE                K and V both in TYPE (f32, f16, bf16, q8_0, q4_0, q4_1,
                                  q5_0, q5_1, iq4_nl)
    llama.cpp:kTYPE:vTYPE         K and V apart (one of them may be left out: f16, llama.cpp's
                                  default)
    ...:norot                     LLAMA_ATTN_ROT_DISABLE=1: no Hadamard rotation of q, k, v

Where the rotation is decided: llama.cpp reads LLAMA_ATTN_ROT_DISABLE in `llama_kv_cache`'s
constructor, at each context's creation (its log says "llama_kv_cache: attention rotation
force disabled"); it rotates only a quantised cache whose head size suits it. So one process
holds both settings: the variable is set while a `norot` context is made, and restored.
Flash attention is on for every context, the reference too: llama.cpp needs it for a
quantised V.

The protocol is eval's: the prompt prefilled as one batch (its last position scored), then
the rest fed in chunks with every position's logits read. llama.cpp writes a batch's keys
and values into the cache and attention reads them back from it, quantised, so a chunk sees
what one-token steps would: only the float rounding of the batched kernels differs. Chunks
are `CHUNK` tokens whatever eval's --chunk, so decode time is not measured (NaN).
Needs llama-cpp-python (the `llama` extra); nothing here imports it until a run.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NAME = "llama.cpp"
# llama.cpp's KV cache types (common/arg.cpp's list) -> (values per block, bytes per block):
# ggml's block layouts (q8_0: 32 int8 and an f16 scale; q4_1: 32 nibbles, f16 scale and min).
KV_TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
            "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}
DEFAULT_TYPE = "f16"  # llama.cpp's own default for K and V
REFERENCE_TYPE = "f32"  # its exact cache: every value as the graph computed it
ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"
CHUNK = 256  # tokens a decode call; every position's logits are read back
GRAMMAR = "llama.cpp:TYPE or llama.cpp:kTYPE:vTYPE, then :norot"


@dataclass(frozen=True)
class LlamaCppSpec:
    k: str  # KV_TYPES key
    v: str
    rotate: bool  # False: LLAMA_ATTN_ROT_DISABLE=1 for its context

    def __str__(self) -> str:
        types = self.k if self.k == self.v else f"k{self.k}:v{self.v}"
        return f"{NAME}:{types}" + ("" if self.rotate else ":norot")

    @property
    def bits_per_value(self) -> float:
        """K's and V's bits per cached value, averaged (scales counted)."""
        return sum(8 * KV_TYPES[t][1] / KV_TYPES[t][0] for t in (self.k, self.v)) / 2


REFERENCE = LlamaCppSpec(REFERENCE_TYPE, REFERENCE_TYPE, True)


def is_llama_cpp(text: str) -> bool:
    return text.strip().split(":", 1)[0].lower() == NAME


def _type(spec: str, name: str) -> str:
    if name not in KV_TYPES:
        raise ValueError(f"cache spec {spec!r}: {name!r} is not a llama.cpp cache type; "
                         f"expected one of {', '.join(KV_TYPES)}")
    return name


def parse_llama_cpp(text: str) -> LlamaCppSpec:
    """'llama.cpp:kq8_0:vq4_0:norot' -> LlamaCppSpec, or a ValueError naming the spec."""
    spec = text.strip()
    _, *fields = spec.lower().split(":")
    given: dict[str, str] = {}  # "K", "V", "norot" -> the value given
    for f in fields:
        if f == "norot":
            sets, value = ("norot",), ""
        elif f in KV_TYPES or any(c.isdigit() for c in f) and f[:1] not in ("k", "v"):
            sets, value = ("K", "V"), _type(spec, f)  # a type's name has digits: q4_0, f16
        elif f[:1] in ("k", "v") and f[1:]:
            sets, value = (f[0].upper(),), _type(spec, f[1:])
        else:
            raise ValueError(f"cache spec {spec!r}: unknown field {f!r}; expected {GRAMMAR} "
                             f"(types: {', '.join(KV_TYPES)}), e.g. llama.cpp:q4_0")
        twice = next((what for what in sets if what in given), None)
        if twice:
            raise ValueError(f"cache spec {spec!r}: {twice} given twice; expected {GRAMMAR}")
        given.update(dict.fromkeys(sets, value))
    if not given.keys() - {"norot"}:
        raise ValueError(f"cache spec {spec!r}: no cache type; expected {GRAMMAR}, e.g. "
                         "llama.cpp:q8_0")
    return LlamaCppSpec(given.get("K", DEFAULT_TYPE), given.get("V", DEFAULT_TYPE),
                        "norot" not in given)


def check_installed(specs: Sequence[LlamaCppSpec], gguf: str | None, model: str) -> None:
    """Refuse llama.cpp rows that cannot run here, before any weights load: no GGUF to run,
    no llama-cpp-python, or a cache type the installed build does not have."""
    if not specs:
        return
    if gguf is None:
        raise ValueError(f"cache {str(specs[0])!r} runs llama.cpp on the model's GGUF; --model "
                         f"{model} was not read from one (expected -m smollm2 or a .gguf)")
    from kvcache_cli.models.llama_cpp import INSTALL, llama_available, llama_version

    if not llama_available():
        raise ValueError(f"cache {str(specs[0])!r} needs llama-cpp-python: {INSTALL}")
    import llama_cpp

    for spec in specs:
        for t in (spec.k, spec.v):
            if not hasattr(llama_cpp, f"GGML_TYPE_{t.upper()}"):
                raise ValueError(f"cache {str(spec)!r}: the installed llama.cpp "
                                 f"(llama-cpp-python {llama_version()}) has no cache type "
                                 f"{t}; expected one it has, e.g. q8_0")


def layer_bytes(spec: LlamaCppSpec, tokens: int, kv_heads: int, head_dim: int) -> int:
    """K and V of `tokens` positions in one layer, at their types' block sizes."""
    def one(t: str) -> int:
        per, nbytes = KV_TYPES[t]
        return tokens * kv_heads * (head_dim // per) * nbytes if per > 1 else \
            tokens * kv_heads * head_dim * nbytes
    return one(spec.k) + one(spec.v)


@contextlib.contextmanager
def _rotation(rotate: bool):
    """LLAMA_ATTN_ROT_DISABLE=1 while a `norot` context is made; as it was otherwise."""
    before = os.environ.get(ROT_ENV)
    if rotate:
        os.environ.pop(ROT_ENV, None)
    else:
        os.environ[ROT_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ROT_ENV, None)
        else:
            os.environ[ROT_ENV] = before


class _Context:
    """One llama.cpp context over the GGUF, its K and V in the spec's types."""

    def __init__(self, spec: LlamaCppSpec, path: str, n_ctx: int, threads: int):
        import llama_cpp
        from llama_cpp import Llama

        self.spec = spec
        with _rotation(spec.rotate), _quiet():
            # swa_full: a sliding layer (Gemma 3's) holds every position, masked to its
            # window, as llama-cpp-python 0.3.36 does by default: the bytes `_rows` counts.
            self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=CHUNK, n_ubatch=CHUNK,
                             n_threads=threads, n_threads_batch=threads, flash_attn=True,
                             swa_full=True,
                             type_k=getattr(llama_cpp, f"GGML_TYPE_{spec.k.upper()}"),
                             type_v=getattr(llama_cpp, f"GGML_TYPE_{spec.v.upper()}"),
                             verbose=False)  # fmt: skip
        self.nll: list[float] = []
        self.kl: list[float] = []
        self.agree: list[bool] = []

    def logp(self, ids: Sequence[int], start: int):
        """(len(ids), vocab) float64 log-probabilities of the positions start.. ."""
        import numpy as np

        self.llm._batch.set_batch(list(ids), start, True)  # every position's logits
        self.llm._ctx.decode(self.llm._batch)
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(),
                                       shape=(len(ids), self.llm.n_vocab())).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    def score(self, logp, targets, exact) -> None:
        import numpy as np

        self.nll += (-logp[np.arange(len(targets)), targets]).tolist()
        self.kl += np.clip((np.exp(exact) * (exact - logp)).sum(-1), 0.0, None).tolist()
        self.agree += (logp.argmax(-1) == exact.argmax(-1)).tolist()

    def close(self) -> None:
        self.llm.close()


@contextlib.contextmanager
def _quiet():
    """llama.cpp logs to the process's stderr (fd 2) while a context is made: silenced."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def evaluate(path: str, tokens: Sequence[int], specs: Sequence[LlamaCppSpec], config, *,
             prompt_len: int, threads: int = 1,
             progress: Callable[[int, int], None] | None = None) -> tuple:
    """llama.cpp's reference (f32) cache, then each spec, in lockstep over `tokens` as
    `quality.evaluate` feeds them: one CacheQuality row each, the reference first."""
    import numpy as np

    fed = len(tokens) - 1
    wanted = [REFERENCE] + [s for s in dict.fromkeys(specs) if s != REFERENCE]
    contexts = []
    try:
        for spec in wanted:
            contexts.append(_Context(spec, path, fed, threads))
        steps = [(0, prompt_len)] + [(s, min(s + CHUNK, fed)) for s in range(prompt_len, fed,
                                                                             CHUNK)]
        # The prompt goes in by CHUNK tokens too (llama.cpp's batch); only its last is scored.
        for start, end in steps:
            for s in range(start, end, CHUNK):
                first = max(s, end - 1) if start == 0 else s
                piece = tokens[s:min(s + CHUNK, end)]
                targets = np.asarray(tokens[first + 1:s + len(piece) + 1], dtype=np.int64)
                exact = None
                for ctx in contexts:
                    logp = ctx.logp(piece, s)[first - s:]
                    if not len(targets):  # a prompt's chunk before its last token: fed only
                        continue
                    exact = logp if exact is None else exact
                    ctx.score(logp, targets, exact)
            if progress is not None:
                progress(len(contexts[0].nll), fed - prompt_len + 1)
    finally:
        for ctx in contexts:
            ctx.close()
    return _rows(contexts, config, prompt_len, fed)


def _rows(contexts: list[_Context], config, prompt_len: int, fed: int) -> tuple:
    from kvcache_cli.eval.quality import CacheQuality

    reference = contexts[0]
    ref_nll = statistics.fmean(reference.nll)
    per_layer = [layer_bytes(c.spec, fed, config.n_kv_head, config.head_size)
                 for c in contexts]
    held = [config.n_layer * n for n in per_layer]
    # Layers of each kind, on a model with sliding layers (every one holds `fed` positions).
    kinds = [t.kind for t in config.cache_shape.layer_types]
    count = {k: kinds.count(k) for k in dict.fromkeys(kinds)} if "sliding" in kinds else {}
    rows = []
    for ctx, nbytes, one in zip(contexts, held, per_layer, strict=True):
        nll = statistics.fmean(ctx.nll)
        worst = max(range(len(ctx.kl)), key=ctx.kl.__getitem__)
        rows.append(CacheQuality(
            cache=str(ctx.spec), reference=ctx is reference, perplexity=math.exp(nll),
            bits_per_token=nll / math.log(2), perplexity_change=math.expm1(nll - ref_nll),
            kl_mean=statistics.fmean(ctx.kl), kl_max=ctx.kl[worst],
            kl_max_position=prompt_len + worst,
            top1_agreement=statistics.fmean(ctx.agree), bytes_held=nbytes, positions=fed,
            bytes_per_token=nbytes / fed, bytes_ratio=nbytes / held[0], prefill_ms=math.nan,
            compress_ms=0.0, decode_ms_per_token=math.nan, loss_by_position=tuple(ctx.nll),
            against=str(REFERENCE), peer=NAME,
            bytes_by_kind={kind: n * one for kind, n in count.items()},
        ))  # fmt: skip
    return tuple(rows)
