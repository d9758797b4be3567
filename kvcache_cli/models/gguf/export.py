"""The project's GPT-2 written as a GGUF file, so llama.cpp runs the very same weights.

Written through the `gguf` package's `GGUFWriter` (llama.cpp's own Python writer), with
the tensor names and metadata keys its constants give for the `gpt2` architecture; what
llama.cpp reads of them is in its `src/models/gpt2.cpp` (tensors) and `llama-vocab.cpp`
(tokenizer). Three things decide whether llama.cpp computes the same function:

- **orientation**: ggml's shape {in, out} is numpy's (out, in), nn.Linear's order, so each
  weight is written as nn.Linear holds it (Hugging Face's Conv1D files hold the transpose);
- **the LM head** is not written: gpt2.cpp falls back to the token embedding when
  `output.weight` is absent, which is GPT-2's tie;
- **the tokenizer**: llama.cpp needs one of the model's size. GPT-2's real BPE vocabulary
  cannot be had offline, so the file carries a synthetic one (GPT-2's 256 byte symbols,
  its first merge, then placeholders up to the vocabulary size) and callers pass token ids
  directly; nothing is ever tokenised by llama.cpp.

Files are cached on disk under the weights' content hash (a model with the same weights
reuses its file), written F32 here and quantised to F16 or Q8_0 by llama.cpp's own
quantiser (`llama_model_quantize`), which needs the optional `llama` extra; writing F32
needs only `gguf`, pure Python.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# What a GGUF file of ours may be stored as: F32 written directly, the others quantised
# from it by llama.cpp. Q8_0 is blocks of 32 int8 values with one fp16 scale each.
GGUF_FORMATS = ("f32", "f16", "q8_0")
# Bumped when what is written changes, so cached files of an older layout are not reused.
WRITER_VERSION = 2
# GPT-2's layer norms use PyTorch's default epsilon (gpt2.py builds nn.LayerNorm plainly).
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    format: str  # one of GGUF_FORMATS
    digest: str  # content hash of the float32 weights and shape it was written from
    file_bytes: int
    cached: bool  # found on disk rather than written now


def cache_dir() -> Path:
    """Where GGUF files are kept: $KVCACHE_CACHE/gguf, else the XDG cache directory."""
    root = os.environ.get("KVCACHE_CACHE")
    if root:
        return Path(root) / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvcache" / "gguf"


# ---------------------------------------------------------------------------- names


def _names() -> dict[str, str]:
    """Our parameter name (per layer, with {bid}) -> llama.cpp's, from gguf's constants."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

    ours = {
        "transformer.wte": MODEL_TENSOR.TOKEN_EMBD,
        "transformer.wpe": MODEL_TENSOR.POS_EMBD,
        "transformer.ln_f": MODEL_TENSOR.OUTPUT_NORM,
        "transformer.h.{bid}.ln_1": MODEL_TENSOR.ATTN_NORM,
        "transformer.h.{bid}.attn.c_attn": MODEL_TENSOR.ATTN_QKV,
        "transformer.h.{bid}.attn.c_proj": MODEL_TENSOR.ATTN_OUT,
        "transformer.h.{bid}.ln_2": MODEL_TENSOR.FFN_NORM,
        "transformer.h.{bid}.mlp.c_fc": MODEL_TENSOR.FFN_UP,
        "transformer.h.{bid}.mlp.c_proj": MODEL_TENSOR.FFN_DOWN,
    }
    known = set(MODEL_TENSORS[MODEL_ARCH.GPT2])
    missing = [t.name for t in ours.values() if t not in known]
    if missing:  # a gguf release that renamed them: refuse rather than write a bad file
        raise RuntimeError(f"gguf {_gguf_version()} has no gpt2 tensor {missing[0]}")
    return {name: TENSOR_NAMES[t] for name, t in ours.items()}


def gguf_tensors(state: dict, n_layer: int) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) for every tensor of a GPT-2 state dict.

    `state` maps our parameter names to tensors in nn.Linear's (out, in) order, as
    `linear.float_state` gives them; the LM head is left out (tied, see above).
    """
    for ours, theirs in _names().items():
        layers = range(n_layer) if "{bid}" in ours else (None,)
        # Embeddings are lookup tables: a weight and no bias.
        parts = ("weight",) if ours.endswith(("wte", "wpe")) else ("weight", "bias")
        for i in layers:
            stem, name = ours.format(bid=i), theirs.format(bid=i)
            for part in parts:
                key = f"{stem}.{part}"
                if key not in state:
                    raise ValueError(f"state has no {key!r}")
                tensor = state[key].detach().to("cpu").float().contiguous()
                yield f"{name}.{part}", tensor.numpy()  # (out, in) = ggml's {in, out}


# ---------------------------------------------------------------------------- tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's 256 byte symbols, in its vocabulary's order (ids 0-255 of encoder.json):
    printable bytes stand for themselves, the rest are shifted past U+0100."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


END_OF_TEXT = "<|endoftext|>"


def synthetic_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of `size` unique tokens for a model with no vocabulary.

    llama.cpp refuses a "gpt2" tokenizer without merges, and gguf drops an empty array,
    so GPT-2's first merge (Ġ t -> Ġt) is kept; the last token is <|endoftext|>, a
    control token, as in GPT-2. Ids are passed directly, so the strings matter only for
    being distinct.
    """
    from gguf.constants import TokenType

    if size < 2:
        raise ValueError(f"vocabulary size {size} must be at least 2")
    tokens = (_byte_symbols() + ["Ġt"])[: size - 1]
    tokens += [f"<|synthetic {i}|>" for i in range(len(tokens), size - 1)] + [END_OF_TEXT]
    types = [int(TokenType.NORMAL)] * (size - 1) + [int(TokenType.CONTROL)]
    return tokens, types, ["Ġ t"]


# ---------------------------------------------------------------------------- writing


def weights_digest(state: dict, config) -> str:
    """A content hash of the weights and shape: equal weights share one cached file."""
    h = hashlib.sha256(f"gpt2-gguf v{WRITER_VERSION} {config!r}".encode())
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").float().contiguous()
        h.update(f"{name} {tuple(tensor.shape)}".encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()[:20]


def write_gguf(state: dict, config, path: Path, name: str = "kvcache gpt2") -> Path:
    """Write a float32 GGUF of a GPT-2 state dict (see `gguf_tensors`), of a Llama-family
    one (`write_llama`) or of a Gemma 3 (`gemma3_export.write_gemma3`), to `path`.

    Written to a temporary name and renamed at the end, so a failed or interrupted write
    leaves nothing a later run would take for a finished file.
    """
    from gguf import GGUFWriter, LlamaFileType

    from kvcache_cli.models.gguf.gemma3_export import write_gemma3

    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    family = _family(config)
    if family != "gpt2":
        write = write_llama if family == "llama" else write_gemma3
        try:
            write(state, config, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)
        return path
    writer = GGUFWriter(tmp, "gpt2")
    try:
        writer.add_name(name)
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)  # GPT-2's MLP is 4x wide
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(LAYER_NORM_EPS)
        writer.add_file_type(LlamaFileType.ALL_F32)
        tokens, types, merges = synthetic_vocab(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's pre-tokenizer
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(config.vocab_size - 1)
        writer.add_eos_token_id(config.vocab_size - 1)
        for tensor_name, array in gguf_tensors(state, config.n_layer):
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    tmp.replace(path)
    return path


# transformers' Llama names -> llama.cpp's (gguf's constants for the llama architecture).
_LLAMA_TOP = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LLAMA_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_tensor_name(name: str) -> str:
    """llama.cpp's name of a transformers Llama parameter."""
    if name in _LLAMA_TOP:
        return _LLAMA_TOP[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_LLAMA_BLOCK[rest.removesuffix('.weight')]}.weight"


def permute_for_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from transformers' halves (i, i + hs/2) to
    interleaved pairs (2i, 2i + 1), the order its rotary kernel reads."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def add_shape(writer, config, head_dim: int) -> None:
    """The metadata every llama.cpp architecture reads for a decoder's shape, from a
    family's config (the name, positions, widths, layers, heads, one head's width)."""
    writer.add_name(config.name)
    writer.add_context_length(config.context)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.intermediate)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def write_llama(state: dict, config, path: Path, quant: str = "F32") -> Path:
    """A Llama-family state dict (transformers' names, float32) as llama.cpp's converter
    writes it: the shape's metadata, a synthetic byte-level vocabulary (ids are fed
    directly), the chat template, q and k rows permuted, 2-D weights in F32 or Q8_0
    (gguf's own quantiser; Q4_0 and Q4_1 too, for the tests of the q4 weight format).
    A tied head is left out, as in the converter."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    try:
        add_shape(writer, config, config.head_size)
        writer.add_rope_dimension_count(config.head_size)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.rms_eps)
        writer.add_vocab_size(config.vocab_size)
        tokens, types, merges = synthetic_vocab(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(config.vocab_size - 1)
        if config.chat_template:
            writer.add_chat_template(config.chat_template)
        for name, t in state.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            w = t.detach().to("cpu").float().numpy()
            if name.endswith("q_proj.weight"):
                w = permute_for_rope(w, config.n_head)
            elif name.endswith("k_proj.weight"):
                w = permute_for_rope(w, config.n_kv_head)
            if quant in ("Q8_0", "Q4_0", "Q4_1") and w.ndim == 2:
                kind = GGMLQuantizationType[quant]
                writer.add_tensor(llama_tensor_name(name), quantize(w, kind), raw_dtype=kind)
            else:
                writer.add_tensor(llama_tensor_name(name), np.ascontiguousarray(w))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


# llama.cpp's file types (llama.h's LLAMA_FTYPE_*) for its quantiser.
_FTYPES = {"f16": 1, "q8_0": 7}


def quantize_gguf(src: Path, dst: Path, fmt: str, threads: int | None = None) -> Path:
    """Quantise a float32 GGUF with llama.cpp's own quantiser (`llama_model_quantize`)."""
    import ctypes

    import llama_cpp

    if fmt not in _FTYPES:
        raise ValueError(f"unknown GGUF format {fmt!r}; expected {', '.join(_FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[fmt]
    params.nthread = threads or 0  # 0: llama.cpp's own choice
    tmp = Path(dst).with_name(Path(dst).name + ".partial")
    with _silenced_stderr():  # llama.cpp logs every tensor it quantises to stderr
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                                ctypes.byref(params))  # fmt: skip
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantise {src} to {fmt} (status {status})")
    tmp.replace(dst)
    return Path(dst)


def export_gguf(state: dict, config, fmt: str = "f32", directory: Path | None = None,
                threads: int | None = None) -> GGUFFile:  # fmt: skip
    """The model as a GGUF file in `fmt`, from the cache when the same weights were
    written before; F32 is written (and kept) first, the others quantised from it."""
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; expected {', '.join(GGUF_FORMATS)}")
    directory = cache_dir() if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest = weights_digest(state, config)
    family = _family(config)
    if family == "gemma3":  # refused before a 1 GB hash and file, not after
        from kvcache_cli.models.gguf.gemma3_export import check_writable

        check_writable(config)
    path = directory / f"{family}-{digest}-{fmt}.gguf"
    if _as_written(path):
        return GGUFFile(path, fmt, digest, path.stat().st_size, cached=True)
    f32 = directory / f"{family}-{digest}-f32.gguf"
    if not _as_written(f32):
        write_gguf(state, config, f32)
        _stamp(f32)
    if fmt != "f32":
        quantize_gguf(f32, path, fmt, threads)
        _stamp(path)
    return GGUFFile(path, fmt, digest, path.stat().st_size, cached=False)


def _family(config) -> str:
    """Which writer a config's model takes: gpt2, llama or gemma3."""
    from kvcache_cli.models.gemma3 import Gemma3Config

    if hasattr(config, "block_size"):
        return "gpt2"
    return "gemma3" if isinstance(config, Gemma3Config) else "llama"


# What a stamp hashes of a written GGUF: its header, metadata and first tensors. With the
# size, a file truncated, emptied or overwritten since is told from the one written.
_STAMPED_HEAD = 2**20


def _stamp_of(path: Path) -> Path:
    return path.with_name(path.name + ".stamp")


def _fingerprint(path: Path) -> dict:
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(_STAMPED_HEAD)).hexdigest()
    return {"bytes": path.stat().st_size, "head_sha256": head}


def _stamp(path: Path) -> None:
    """Record what was written at PATH, beside it (written last: no stamp, no file)."""
    _stamp_of(path).write_text(json.dumps(_fingerprint(path)))


def _as_written(path: Path) -> bool:
    """PATH is a cached GGUF this writer finished and nothing changed since: a file cut
    short or emptied (a full disk, a user) is written again, not handed to a reader that
    would fail in numpy's or mmap's words; one from before stamps is written again once."""
    try:
        return path.is_file() and json.loads(_stamp_of(path).read_text()) == _fingerprint(path)
    except (OSError, ValueError):
        return False


class _silenced_stderr:
    """File descriptor 2 pointed at /dev/null for a C library that writes to it."""

    def __enter__(self):
        import sys

        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
