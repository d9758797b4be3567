"""Reading a Llama-family GGUF file: its shape, its tokenizer, its weights dequantised.

llama.cpp's format holds the whole model in one file: metadata (the shape, the tokenizer's
vocabulary and merges, the chat template) and tensors, most of them quantised in blocks
(Q4_1: 32 weights as 4-bit integers with a float16 scale and minimum). The `gguf` package
parses it and dequantises every block type; this module decides what is trusted first.

A hostile or broken file ends in one ValueError naming the file and what is wrong: before
the parser sees it, the header's counts and every metadata entry's length are checked
against the file's size (the parser would loop over an array of 2^60 strings, or slice
past the end), and after it, every tensor's type, shape and extent.

llama.cpp's converter stores the rows of q and k interleaved pair by pair for its rotary
kernel; the loader restores transformers' order (the halves of each head), as transformers
does when it reads a GGUF (`reverse_permute_weights`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# Metadata value types (GGUF v2/v3) and the bytes of one value; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 100_000  # a model has ~40 metadata entries, and tensors a few per layer
_MAX_TENSORS = 1_000_000
_MAX_DIMS = 4  # GGML tensors have at most 4 dimensions

# The tensor types kvcache dequantises: float, and llama.cpp's block and K-quant formats.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
ARCHITECTURES = ("llama",)  # Llama's layout; SmolLM2 is one

# GGUF tensor names → transformers' (the block's index is filled in).
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, checked: the shape, the tokenizer's pieces, the tensors."""

    fields: dict  # the config's fields (LlamaConfig's names), tokenizer aside
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str  # llama.cpp's name for the pre-tokenizer's split rules
    tensors: dict[str, np.ndarray]  # transformers' names → float32 (out, in)
    types: dict[str, str]  # transformers' names → the GGUF type they were stored in


def _check_layout(path: Path, data: bytes | memoryview, size: int) -> None:
    """Walk the header and metadata, checking every count and length against the file."""

    def fail(what: str) -> None:
        raise ValueError(f"{path}: {what}; expected a GGUF model file")

    if size < 24 or bytes(data[:4]) != MAGIC:
        fail("not a GGUF file (no 'GGUF' magic at its start)")
    version, n_tensors, n_keys = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        fail(f"GGUF version {version}, which kvcache does not read (2 or 3)")
    # A tensor's entry takes at least 33 bytes, a metadata entry at least 13: counts the
    # file cannot hold are refused before anything is allocated for them.
    if n_tensors > _MAX_TENSORS or n_keys > _MAX_KEYS or 33 * n_tensors + 13 * n_keys > size:
        fail(f"the header claims {n_tensors:,} tensors and {n_keys:,} metadata entries, "
             f"more than its {size:,} bytes can hold")
    at = 24

    def need(n: int) -> None:
        if at + n > size:
            fail(f"truncated: an entry at byte {at:,} runs past the end ({size:,} bytes)")

    def string() -> None:
        nonlocal at
        need(8)
        (n,) = struct.unpack_from("<Q", data, at)
        need(8 + n)
        at += 8 + n

    for _ in range(n_keys):
        string()  # the key
        need(4)
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if kind == _ARRAY:
            need(12)
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item == _STRING:
                for _ in range(count):
                    string()
            elif item in _SCALAR_BYTES:
                need(count * _SCALAR_BYTES[item])
                at += count * _SCALAR_BYTES[item]
            else:
                fail(f"a metadata array of unknown type {item}")
        elif kind == _STRING:
            string()
        elif kind in _SCALAR_BYTES:
            need(_SCALAR_BYTES[kind])
            at += _SCALAR_BYTES[kind]
        else:
            fail(f"a metadata value of unknown type {kind}")
    for _ in range(n_tensors):
        string()
        need(4)
        (n_dims,) = struct.unpack_from("<I", data, at)
        if not 1 <= n_dims <= _MAX_DIMS:
            fail(f"a tensor of {n_dims} dimensions (1 to {_MAX_DIMS})")
        need(4 + 8 * n_dims + 12)
        at += 4 + 8 * n_dims + 12


def read_gguf(path: str | Path) -> GGUFModel:
    """The model a GGUF file holds, every tensor dequantised to float32, or a ValueError."""
    import mmap

    path = Path(path)
    if not path.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"{path}: no such file; expected a GGUF model file"
                         if not path.exists() else f"{path}: not a regular file; expected "
                         "a GGUF model file")
    size = path.stat().st_size
    with path.open("rb") as f:
        if size < 24:
            raise ValueError(f"{path}: {size} bytes, too short for a GGUF header; expected a "
                             "GGUF model file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check_layout(path, data, size)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"{path}: reading GGUF needs the gguf package: pip install gguf"
                         ) from None
    try:
        reader = GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - the parser's own errors are many and plain
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        raise ValueError(f"{path}: not a readable GGUF file ({first})") from None
    return _model(path, reader)


def _field(path: Path, reader, key: str, kind: type, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"{path}: no {key!r} in its metadata; expected a llama GGUF")
        return default
    try:
        value = field.contents()
    except Exception:  # noqa: BLE001 - a value of the wrong type the parser cannot render
        value = None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{path}: {key} is {value!r}; expected a {kind.__name__}")
    return value


def _model(path: Path, reader) -> GGUFModel:
    arch = _field(path, reader, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r}; kvcache reads "
                         f"{', '.join(ARCHITECTURES)} GGUF files")

    def number(key: str, high: int, default=None) -> int:
        value = _field(path, reader, f"{arch}.{key}", int, default)
        if not 1 <= value <= high:
            raise ValueError(f"{path}: {arch}.{key} is {value:,}; expected 1 to {high:,}")
        return value

    n_embd = number("embedding_length", 2**16)
    n_head = number("attention.head_count", 1024)
    fields = dict(
        n_layer=number("block_count", 1000), n_head=n_head,
        n_kv_head=number("attention.head_count_kv", 1024, default=n_head),
        n_embd=n_embd, intermediate=number("feed_forward_length", 2**18),
        context=number("context_length", 2**20),
        rope_theta=_field(path, reader, f"{arch}.rope.freq_base", float, 10000.0),
        rms_eps=_field(path, reader, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-5),
    )
    head_dim = number("attention.key_length", 4096, default=n_embd // n_head)
    if head_dim != n_embd // n_head:
        fields["head_dim"] = head_dim
    if fields["n_head"] % fields["n_kv_head"]:
        raise ValueError(f"{path}: {n_head} query heads do not share "
                         f"{fields['n_kv_head']} KV heads evenly")

    model_kind = _field(path, reader, "tokenizer.ggml.model", str)
    if model_kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {model_kind!r}; kvcache reads byte-level "
                         "BPE ('gpt2') from a GGUF; for another, pass a safetensors folder "
                         "with its tokenizer.json")
    tokens = _field(path, reader, "tokenizer.ggml.tokens", list)
    token_types = _field(path, reader, "tokenizer.ggml.token_type", list, default=[1])
    merges = _field(path, reader, "tokenizer.ggml.merges", list)
    if len(token_types) != len(tokens):
        token_types = [1] * len(tokens)
    vocab = _field(path, reader, f"{arch}.vocab_size", int, default=len(tokens))
    if vocab != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: the vocabulary holds {len(tokens):,} tokens, the model "
                         f"{vocab:,}; expected one token per id")
    fields["vocab_size"] = vocab
    for key, name in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        value = _field(path, reader, f"tokenizer.ggml.{key}", int, default=-1)
        if value != -1:
            if not 0 <= value < vocab:
                raise ValueError(f"{path}: tokenizer.ggml.{key} is {value:,}; expected an id "
                                 f"from 0 to {vocab - 1:,}")
            fields[name] = value
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        fields["chat_template"] = _field(path, reader, "tokenizer.chat_template", str)
    fields["name"] = _field(path, reader, "general.name", str, default=path.stem)

    tensors, types = _tensors(path, reader, fields)
    fields["tie_word_embeddings"] = "lm_head.weight" not in tensors
    pre = _field(path, reader, "tokenizer.ggml.pre", str, default="default")
    return GGUFModel(fields, tokens, [int(t) for t in token_types], merges, pre, tensors, types)


def _expected_shapes(f: dict) -> dict[str, tuple[int, ...]]:
    C, hs = f["n_embd"], f.get("head_dim", f["n_embd"] // f["n_head"])
    shapes = {"model.embed_tokens.weight": (f["vocab_size"], C), "model.norm.weight": (C,),
              "lm_head.weight": (f["vocab_size"], C)}
    for i in range(f["n_layer"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (f["n_head"] * hs, C),
            p + "self_attn.k_proj.weight": (f["n_kv_head"] * hs, C),
            p + "self_attn.v_proj.weight": (f["n_kv_head"] * hs, C),
            p + "self_attn.o_proj.weight": (C, f["n_head"] * hs),
            p + "mlp.gate_proj.weight": (f["intermediate"], C),
            p + "mlp.up_proj.weight": (f["intermediate"], C),
            p + "mlp.down_proj.weight": (C, f["intermediate"]),
        })
    return shapes


def hf_name(name: str) -> str | None:
    """transformers' name of a GGUF tensor, None for one Llama does not have."""
    stem, dot, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit():
        if parts[2] in _BLOCK_TENSORS:
            return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}.weight"
    return None


def _tensors(path: Path, reader, fields: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    expected = _expected_shapes(fields)
    tensors, types = {}, {}
    hs = fields.get("head_dim", fields["n_embd"] // fields["n_head"])
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in expected:
            raise ValueError(f"{path}: tensor {t.name!r} is not one of a "
                             f"{fields['n_layer']}-layer Llama's")
        kind = t.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {t.name} is of type {kind}; kvcache reads "
                             f"{', '.join(TENSOR_TYPES)}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dims inner first
        if shape != expected[name]:
            raise ValueError(f"{path}: tensor {t.name} has shape {shape}, the model's "
                             f"metadata says {expected[name]}")
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if t.n_elements % block or t.data.nbytes != t.n_elements // block * block_bytes:
            raise ValueError(f"{path}: tensor {t.name} runs past the end of the file "
                             "(truncated?)")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = fields["n_head"] if name.endswith("q_proj.weight") else fields["n_kv_head"]
            w = _unpermute(w, heads, hs)
        tensors[name], types[name] = w, kind
    missing = sorted(set(expected) - set(tensors) - {"lm_head.weight"})
    if missing:
        raise ValueError(f"{path}: no tensor for {missing[0]} ({len(missing)} missing)")
    return tensors, types


def _unpermute(w: np.ndarray, heads: int, hs: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved pairs (0, 1), (2, 3) ... back to
    transformers' halves (0, hs/2), (1, hs/2 + 1) ...: the inverse of the converter's
    permute."""
    rows = w.reshape(heads, hs // 2, 2, -1)  # (heads, pairs, 2, in): pair i is rows 2i, 2i+1
    return rows.swapaxes(1, 2).reshape(w.shape)  # (heads, 2, pairs, in): the halves
