"""llama.cpp as a `bench` peer: the engine a CPU user would pick, on the very same weights.

The model is written to GGUF by `models.gguf.export.export_gguf` (cached by content,
quantised to F16 or Q8_0 by llama.cpp's own quantiser) and run through llama-cpp-python,
the optional `llama` extra, which builds llama.cpp from source when installed (minutes). The loop
is the bench's own: the same prompt ids, fed directly (the file's tokenizer is
synthetic), one token a step, greedy by argmax of the step's logits, so the bench's
clock and warm-up apply unchanged.

llama.cpp keeps its own KV cache, in float16 by default; a step's bytes count it so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Bench mode -> the GGUF format it runs; "gguf" is the file the model was read from
# (SmolLM2's own Q4_1, Gemma 3's Q4_K_M mix), run as it is.
LLAMA_MODES = {"llama.cpp": "f32", "llama.cpp-f16": "f16", "llama.cpp-q8_0": "q8_0",
               "llama.cpp-gguf": "gguf"}
INSTALL = "pip install 'kvcache[llama]' (it builds llama.cpp from source: minutes)"
# llama.cpp's default K and V cache type (GGML_TYPE_F16): two bytes an element.
KV_ELEMENT_BYTES = 2


def llama_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "gguf"))


def check_llama_modes(modes: Sequence[str], device_type: str) -> None:
    """Refuse a llama.cpp mode that cannot run, before any model loads."""
    wanted = [m for m in modes if m in LLAMA_MODES]
    if not wanted:
        return
    if not llama_available():
        raise ValueError(f"mode {wanted[0]!r} needs the llama extra: {INSTALL}")
    if device_type != "cpu":
        raise ValueError(f"mode {wanted[0]!r} runs llama.cpp on the CPU, where the extra "
                         f"builds it; got device {device_type}: use --device cpu")


def llama_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class LlamaFile:
    """What one llama.cpp mode runs, and the bytes its decode step reads."""

    mode: str
    format: str  # GGUF format: f32, f16, q8_0
    path: Path
    file_bytes: int
    cached: bool
    weight_bytes: int  # a step's weights: every matrix whole, one position row
    kv_bytes_per_token: int


def prepare(model, mode: str, directory: Path | None = None) -> LlamaFile:
    """Write (or find in the cache) `model`'s GGUF for `mode`, and count its bytes."""
    from gguf import GGUFReader

    from kvcache_cli.models.gguf.export import GGUFFile, export_gguf
    from kvcache_cli.models.linear import float_state

    cfg = model.config
    if LLAMA_MODES[mode] == "gguf":
        source = getattr(cfg, "gguf", None)
        if source is None:
            raise ValueError(f"mode {mode!r} runs the GGUF file the model was read from; this "
                             "model was not read from one (expected -m smollm2, -m gemma3 or "
                             "a .gguf)")
        path = Path(source)
        gguf = GGUFFile(path, "gguf", "", path.stat().st_size, cached=True)
    else:
        gguf = export_gguf(float_state(model), cfg, LLAMA_MODES[mode], directory)
    total = 0
    for tensor in GGUFReader(gguf.path).tensors:
        nbytes = int(tensor.n_bytes)
        # The position table is looked up, one row a step; the token table is the LM
        # head too (tied), so every byte of it is read.
        total += nbytes // cfg.context if tensor.name == "position_embd.weight" else nbytes
    # K and V, every layer, one token: llama.cpp caches the KV heads, as ours do
    kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_size * KV_ELEMENT_BYTES
    return LlamaFile(mode, gguf.format, gguf.path, gguf.file_bytes, gguf.cached, total, kv)


class LlamaRunner:
    """One llama.cpp model and context, decoding greedily from token ids."""

    def __init__(self, file: LlamaFile, max_len: int, threads: int):
        from llama_cpp import Llama

        self.file = file
        # One context as long as the run; the prompt goes in as one batch, as ours does.
        # swa_full=False: a sliding-window model's (Gemma 3's) sliding layers hold their
        # window (padded by a batch), as llama-server's default and as ours do, not the
        # whole context llama-cpp-python's default gives them.
        self.llm = Llama(model_path=str(file.path), n_ctx=max_len, n_batch=max_len,
                         n_threads=threads, n_threads_batch=threads, swa_full=False,
                         verbose=False)  # fmt: skip

    def stream(self, prompt_ids: Sequence[int], new_tokens: int) -> Iterator[int]:
        """Yield `new_tokens` greedy tokens after the prompt: the prefill's, then one a step."""
        import llama_cpp
        import numpy as np

        llm = self.llm
        n_vocab = llm.n_vocab()
        llm.reset()  # forget the last run: the next eval drops the cache past position 0
        ids = list(prompt_ids)
        for _ in range(new_tokens):
            llm.eval(ids)
            # The batch's last token's logits, read in place (Llama keeps no copy of them
            # unless every position's are asked for).
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                           shape=(n_vocab,))  # fmt: skip
            token = int(logits.argmax())
            yield token
            ids = [token]

    def close(self) -> None:
        self.llm.close()
