"""Reading a Llama-family or Gemma 3 GGUF file: its shape, its tokenizer, its weights
dequantised.

llama.cpp's format holds the whole model in one file: metadata (the shape, the tokenizer's
vocabulary and merges, the chat template) and tensors, most of them quantised in blocks
(Q4_1: 32 weights as 4-bit integers with a float16 scale and minimum). `layout` parses it,
the `gguf` package dequantises every block type, and this module decides what is trusted.

A hostile or broken file ends in one ValueError naming the file and what is wrong, before
anything large is allocated: `layout` checks the file's structure (every count, length,
string and tensor extent); this module what the values mean to a model. Every number of
the shape is range-checked and cross-checked (`models.bounds`: heads divide the width, KV
heads the heads, rotary dimensions are the head's, a static cache of the whole context fits
in memory); the vocabulary holds distinct, non-empty tokens, every merge joins two of them
into a third, every special token's id is one of them; every tensor is one of a Llama's,
of the shape the metadata gives, and holds finite weights once dequantised.

llama.cpp's converter stores the rows of q and k interleaved pair by pair for its rotary
kernel; the loader restores transformers' order (the halves of each head), as transformers
does when it reads a GGUF (`reverse_permute_weights`).

A Gemma 3 file (`read_gemma3`) is checked the same way against its own shape
(`models.gemma3_config`: the layer pattern, the window, two rotary bases) and tensors (QK-norm
of the head size, four norms a block); its q and k are not permuted, and its norms are stored
as 1 + w. Its K-quant and Q5_0 blocks are dequantised by the same gguf function as the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvcache_cli.models import bounds
from kvcache_cli.models.gemma3_config import ARCH as GEMMA3
from kvcache_cli.models.gemma3_config import config_from_metadata
from kvcache_cli.models.gguf.layout import Layout, TensorEntry, open_file, read_layout

if TYPE_CHECKING:  # the family's config lives with its torch model; read_gemma3 imports it
    from kvcache_cli.models.gemma3 import Gemma3Config

# The tensor types kvcache dequantises: float, and llama.cpp's block and K-quant formats.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ARCHITECTURES = ("llama",)  # Llama's layout; SmolLM2 is one
MAX_NAME = 256  # characters of general.name, which the commands print
# llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_TYPES = range(0, 7)

# GGUF tensor names → transformers' (the block's index is filled in).
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# Gemma 3's blocks: QK-norm, and norms after attention and around the MLP. Its q and k rows
# are stored as transformers has them (llama.cpp's converter permutes only Llama's).
_GEMMA3_BLOCK_TENSORS = {
    **_BLOCK_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
BLOCK_TENSORS = {"llama": _BLOCK_TENSORS, "gemma3": _GEMMA3_BLOCK_TENSORS}


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


def read_gguf(path: str | Path) -> GGUFModel:
    """The model a GGUF file holds, every tensor dequantised to float32, or a ValueError."""
    path = Path(path)
    data, size = open_file(path)
    layout = read_layout(path, data, size)
    try:
        fields, tokenizer = _fields(layout.metadata, path.stem)
        tensors, types = _tensors(layout, data, fields)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    fields["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return GGUFModel(fields, *tokenizer, tensors, types)


def read_llama_fields(path: str | Path) -> dict:
    """The config fields a Llama GGUF's header gives (`read_gguf`'s, checked alike), with no
    tensor read or dequantised: what sizing needs of a file not yet converted. A ValueError
    naming the file."""
    path = Path(path)
    data, size = open_file(path)
    try:
        layout = read_layout(path, data, size)
        fields, _ = _fields(layout.metadata, path.stem)
        fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in layout.tensors)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    finally:
        data.close()
    return fields


@dataclass(frozen=True)
class Gemma3GGUF:
    """A Gemma 3 GGUF's shape and weights, checked; its tokenizer (SentencePiece's, which
    llama.cpp calls 'llama') is not read here."""

    config: Gemma3Config  # models.gemma3's, the family's one config class
    hf_config: dict  # the same, as transformers' gemma3_text config.json (converted folders)
    tensors: dict[str, np.ndarray]  # transformers' Gemma3ForCausalLM names → float32
    types: dict[str, str]  # transformers' names → the GGUF type they were stored in


def read_gemma3(path: str | Path) -> Gemma3GGUF:
    """The Gemma 3 a GGUF file holds, every tensor dequantised to float32 under transformers'
    names, or a ValueError (one line, naming the file). A norm's weight is stored as
    1 + w (Gemma's RMSNorm scales by 1 + w; llama.cpp's converter adds the 1, transformers'
    loader takes it off): this gives w, as transformers holds it."""
    from kvcache_cli.models.gemma3 import Gemma3Config

    path = Path(path)
    data, size = open_file(path)
    layout = read_layout(path, data, size)
    meta = layout.metadata
    try:
        arch = _get(meta, "general.architecture", str, arch=GEMMA3)
        if arch != GEMMA3:
            raise ValueError(f"general.architecture is {bounds.shown(arch)}; expected "
                             f"{GEMMA3!r}")
        tokens = _get(meta, "tokenizer.ggml.tokens", list, arch=GEMMA3)
        tied = all(t.name != "output.weight" for t in layout.tensors)
        hf = config_from_metadata(meta, _name(meta, path.stem), len(tokens), tied)
        ids = _token_ids(meta, len(tokens))
        hf.update(bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"))
        config = Gemma3Config.from_hf(hf, GEMMA3, name=hf["name"], gguf=str(path))
        tensors, types = _gemma3_tensors(layout, data, config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return Gemma3GGUF(config, hf, tensors, types)


def _gemma3_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    C, hs = c.n_embd, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, C), "model.norm.weight": (C,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, C)
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "pre_feedforward_layernorm.weight": (C,),
            p + "post_feedforward_layernorm.weight": (C,),
            p + "self_attn.q_norm.weight": (hs,), p + "self_attn.k_norm.weight": (hs,),
            p + "self_attn.q_proj.weight": (c.n_head * hs, C),
            p + "self_attn.k_proj.weight": (c.n_kv_head * hs, C),
            p + "self_attn.v_proj.weight": (c.n_kv_head * hs, C),
            p + "self_attn.o_proj.weight": (C, c.n_head * hs),
            p + "mlp.gate_proj.weight": (c.intermediate, C),
            p + "mlp.up_proj.weight": (c.intermediate, C),
            p + "mlp.down_proj.weight": (C, c.intermediate),
        })
    return shapes


def _gemma3_tensors(layout: Layout, data, c: Gemma3Config) -> tuple[dict[str, np.ndarray],
                                                                   dict[str, str]]:
    def fix(name: str, w: np.ndarray) -> np.ndarray:
        # llama.cpp stores Gemma's norm gains as 1 + w; transformers' names hold w.
        return w - np.float32(1) if name.endswith("norm.weight") else w

    return _checked_tensors(layout, data, _gemma3_shapes(c), "gemma3",
                            f"{c.n_layer}-layer Gemma 3", fix)


_ABSENT = object()


def _name(meta: dict, stem: str) -> str:
    """general.name (the file's stem if absent): printable, short, as the commands print it."""
    name = _get(meta, "general.name", str, "") or stem
    if len(name) > MAX_NAME or not name.isprintable():
        raise ValueError(f"general.name is {bounds.shown(name)}; expected printable text of at "
                         f"most {MAX_NAME} characters")
    return name


def _token_ids(meta: dict, n_tokens: int) -> dict[str, int]:
    """Every tokenizer.ggml.*_token_id, checked to be a token's id: {"bos": 2, ...}."""
    ids = {}
    for name in meta:
        if name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            value = meta[name]
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not 0 <= value < n_tokens:
                raise ValueError(f"{name} is {bounds.shown(value)}; expected a token id "
                                 f"from 0 to {n_tokens - 1:,}")
            ids[name[len("tokenizer.ggml."):-len("_token_id")]] = value
    return ids


def _get(meta: dict, key: str, kind: type, default=_ABSENT, arch: str = "llama"):
    """meta[key] if it is a `kind` (str or list), its default if absent, else a ValueError."""
    value = meta.get(key, _ABSENT)
    if value is _ABSENT:
        if default is _ABSENT:
            raise ValueError(f"no {key} in its metadata; expected a {arch} GGUF")
        return default
    if not isinstance(value, kind):
        what = "text" if kind is str else "an array"
        raise ValueError(f"{key} is {bounds.shown(value)}; expected {what}")
    return value


def _fields(meta: dict, stem: str) -> tuple[dict, tuple]:
    """The config's fields and (tokens, token types, merges, pre) from the metadata."""
    arch = _get(meta, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {bounds.shown(arch)}; kvcache reads "
                         f"{', '.join(ARCHITECTURES)} GGUF files")

    def key(field: str) -> str:
        return f"{arch}.{bounds.BOUNDS[field].key}"

    def number(field: str, default=_ABSENT):
        value = meta.get(key(field), default)
        if value is _ABSENT:
            raise ValueError(f"no {key(field)} in its metadata; expected a llama GGUF")
        return bounds.number(bounds.BOUNDS[field], value, key(field))

    f = {name: number(name) for name in ("n_layer", "n_head", "n_embd", "intermediate",
                                         "context")}
    f["n_kv_head"] = number("n_kv_head", f["n_head"])
    f["rope_theta"] = number("rope_theta", 10000.0)
    f["rms_eps"] = number("rms_eps", 1e-5)
    if key("head_dim") in meta:  # a head size of its own (else the width's share)
        f["head_dim"] = number("head_dim")
    tokens, token_types, merges, pre = _tokenizer(meta)
    f["vocab_size"] = number("vocab_size", len(tokens))
    if f["vocab_size"] != len(tokens):
        raise ValueError(f"the vocabulary holds {len(tokens):,} tokens, {key('vocab_size')} "
                         f"says {f['vocab_size']:,}; expected one token per id")
    ids = _token_ids(meta, len(tokens))
    for name, field in (("bos", "bos_id"), ("eos", "eos_id")):
        if name in ids:
            f[field] = ids[name]
    if "tokenizer.chat_template" in meta:
        f["chat_template"] = _get(meta, "tokenizer.chat_template", str)
    f["name"] = _name(meta, stem)
    bounds.check_shape(f, {field: key(field) for field in bounds.BOUNDS}.__getitem__)
    hs = bounds.head_size(f)
    for other in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        value = meta.get(other, hs)
        if isinstance(value, bool) or value != hs:
            raise ValueError(f"{other} is {bounds.shown(value)}; expected the head size {hs:,} "
                             "(kvcache's Llama rotates and attends with whole heads)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{arch}.rope.scaling.type is {bounds.shown(scaling)}; expected "
                         "'none' (kvcache's Llama runs unscaled rotary positions)")
    if f.get("head_dim") == f["n_embd"] // f["n_head"]:
        del f["head_dim"]  # the width's share: the config leaves it implied
    return f, (tokens, token_types, merges, pre)


def _tokenizer(meta: dict) -> tuple[list[str], list[int], list[str], str]:
    """(tokens, token types, merges, pre-tokenizer): distinct non-empty tokens, a type for
    each, merges that join two tokens into a third."""
    from kvcache_cli.models.tokenizer import PRE_TOKENIZERS, merge_pairs

    model_kind = _get(meta, "tokenizer.ggml.model", str)
    if model_kind != "gpt2":
        raise ValueError(f"tokenizer model {bounds.shown(model_kind)}; kvcache reads byte-level "
                         "BPE ('gpt2') from a GGUF; for another, pass a safetensors folder "
                         "with its tokenizer.json")
    tokens = _get(meta, "tokenizer.ggml.tokens", list)
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens is empty; expected the vocabulary")
    first = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str) or not token:
            raise ValueError(f"tokenizer.ggml.tokens[{i:,}] is {bounds.shown(token)}; "
                             "expected a token's text")
        j = first.setdefault(token, i)
        if j != i:
            raise ValueError(f"tokenizer.ggml.tokens[{i:,}] is {bounds.shown(token)}, as is "
                             f"[{j:,}]; expected each token once")
    token_types = _get(meta, "tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type holds {len(token_types):,} types for "
                         f"{len(tokens):,} tokens; expected one per token")
    bad = next((t for t in token_types if isinstance(t, bool) or t not in TOKEN_TYPES), None)
    if bad is not None:
        raise ValueError(f"tokenizer.ggml.token_type holds {bounds.shown(bad)}; expected "
                         "llama.cpp's token types 0 to 6")
    merges = _get(meta, "tokenizer.ggml.merges", list)
    merge_pairs(first, merges, "tokenizer.ggml.merges")
    pre = _get(meta, "tokenizer.ggml.pre", str, "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre is {bounds.shown(pre)}; kvcache splits text as "
                         f"{', '.join(PRE_TOKENIZERS)}")
    return tokens, [int(t) for t in token_types], merges, pre


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


def hf_name(name: str, arch: str = "llama") -> str | None:
    """transformers' name of a GGUF tensor, None for one the architecture does not have."""
    stem, dot, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.weight"
    parts = stem.split(".")
    # The block's index as llama.cpp writes it ("blk.%d"): 07 would be a second name for 7.
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() \
            and str(int(parts[1])) == parts[1]:
        block = BLOCK_TENSORS[arch]
        if parts[2] in block:
            return f"model.layers.{int(parts[1])}.{block[parts[2]]}.weight"
    return None


def _tensors(layout: Layout, data, fields: dict) -> tuple[dict[str, np.ndarray],
                                                          dict[str, str]]:
    hs = bounds.head_size(fields)

    def fix(name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = fields["n_head"] if name.endswith("q_proj.weight") else fields["n_kv_head"]
            return _unpermute(w, heads, hs)
        return w

    return _checked_tensors(layout, data, _expected_shapes(fields), "llama",
                            f"{fields['n_layer']}-layer Llama", fix,
                            optional={"lm_head.weight"})  # absent: tied to the embedding


def _checked_tensors(layout: Layout, data, expected: dict[str, tuple[int, ...]], arch: str,
                     model: str, fix: Callable[[str, np.ndarray], np.ndarray],
                     optional: set[str] = frozenset()
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of the file as float32 under transformers' name, each checked against
    the shape the metadata gives (`expected`), then `fix(name, weights)`: the family's own
    conversion. A ValueError naming the first tensor that is unknown, repeated, of a type
    kvcache cannot read, of the wrong shape or missing (`optional` ones may be)."""
    tensors, types = {}, {}
    for t in layout.tensors:
        name = hf_name(t.name, arch)
        if name is None or name not in expected:
            raise ValueError(f"tensor {t.name!r} is not one of a {model}'s")
        if name in tensors:
            raise ValueError(f"tensor {t.name!r} is {name}, which another tensor is too")
        if t.kind not in TENSOR_TYPES:
            raise ValueError(f"tensor {t.name} is of type {t.kind}; kvcache reads "
                             f"{', '.join(TENSOR_TYPES)}")
        if t.shape != expected[name]:
            raise ValueError(f"tensor {t.name} has shape {t.shape}, the model's metadata says "
                             f"{expected[name]}")
        tensors[name], types[name] = fix(name, dequantized(t, data)), t.kind
    missing = sorted(set(expected) - set(tensors) - optional)
    if missing:
        raise ValueError(f"no tensor for {missing[0]} ({len(missing)} missing)")
    return tensors, types


def dequantized(t: TensorEntry, data) -> np.ndarray:
    """Tensor `t`'s weights as float32 of its shape, by gguf's own dequantiser for its block
    type (its layout already checked: whole blocks, inside the file); a ValueError naming
    it if any is NaN or infinite, which a block's NaN or infinite float16 scale makes of
    every weight it scales (even a zero one: inf × 0 is NaN)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.frombuffer(data, np.uint8, t.end - t.start, t.start)
    if t.kind == "F32":
        w = raw.view(np.float32)
    else:  # rows of whole blocks, as gguf's dequantize takes them
        rows = raw.reshape(-1, t.shape[-1] // t.block * t.block_bytes)
        # A hostile scale overflows or multiplies inf by 0: refused below, not warned of.
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.asarray(dequantize(rows, GGMLQuantizationType[t.kind]), dtype=np.float32)
    w = w.reshape(t.shape)
    finite = np.isfinite(w)
    if not finite.all():
        scales = "" if t.kind in ("F32", "F16", "BF16") else " (a block's scale, or its weight)"
        raise ValueError(f"tensor {t.name} holds {w.size - int(finite.sum()):,} non-finite "
                         f"weights of {w.size:,}, NaN or infinite{scales}; expected finite "
                         "weights")
    return w


def _unpermute(w: np.ndarray, heads: int, hs: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved pairs (0, 1), (2, 3) ... back to
    transformers' halves (0, hs/2), (1, hs/2 + 1) ...: the inverse of the converter's
    permute."""
    rows = w.reshape(heads, hs // 2, 2, -1)  # (heads, pairs, 2, in): pair i is rows 2i, 2i+1
    return rows.swapaxes(1, 2).reshape(w.shape)  # (heads, 2, pairs, in): the halves
