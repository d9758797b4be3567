"""`--weights-dtype gguf` and `gguf-q8`: every product of a model read from a GGUF on the
file's own blocks (`blocks.BlockLinear`), read from the file as it stores them; gguf-q8
multiplies them in llama.cpp's arithmetic (the row rounded to 8 bits, integer dots)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcache_cli.models.gguf.blocks import BLOCK_TYPES, BlockLinear
from kvcache_cli.models.linear import Linear


def set_gguf(model, fmt: str = "gguf") -> None:
    """Every product of a model read from a GGUF whose tensors are all of BLOCK_TYPES, the
    LM head included, as a BlockLinear on the file's own blocks in weights format `fmt`
    (gguf or gguf-q8), in place; the rest stay the float32 Linear they were loaded as
    (gguf-q8 refused those before loading: `blocks.gguf_problem`). A fused product
    (`llama.FUSED`) takes its parts' blocks, row after row."""
    from kvcache_cli.models.gguf.q4 import sources_of
    from kvcache_cli.models.llama import FUSED

    products = {f"{parent_name}.{child_name}".lstrip("."): (parent, child_name, child)
                for parent_name, parent in model.named_modules()
                for child_name, child in parent.named_children()
                if isinstance(child, Linear)}  # fmt: skip
    tied = model.config.tie_word_embeddings
    sources = {name: sources_of(name, tied, FUSED) for name in products}
    c = model.config
    stored = file_blocks(c.gguf, {s for names in sources.values() for s in names},
                         c.n_head, c.n_kv_head)
    for name, (parent, child_name, child) in products.items():
        parts = [stored[source] for source in sources[name]]
        if all(kind in BLOCK_TYPES for _, kind in parts):
            module = BlockLinear(_merged(parts), child.in_features, fmt)
            if module.out_features != child.out_features:
                raise ValueError(f"{c.gguf}: {name} holds {module.out_features:,} rows, the "
                                 f"model {child.out_features:,}; expected the file it was "
                                 "read from")
            setattr(parent, child_name, module)


def stored_types(path: str | Path) -> dict[str, str]:
    """transformers' name → the GGUF type its tensor is stored in, from the file's header
    (no tensor read)."""
    from kvcache_cli.models.gguf.layout import open_file, read_layout
    from kvcache_cli.models.gguf.reader import hf_name

    path = Path(path)
    data, size = open_file(path)
    layout = read_layout(path, data, size)
    arch = "gemma3" if layout.metadata.get("general.architecture") == "gemma3" else "llama"
    return {hf_name(t.name, arch): t.kind for t in layout.tensors
            if hf_name(t.name, arch) is not None}


def file_blocks(path: str | Path, names: set[str], n_head: int,
                n_kv: int) -> dict[str, tuple[np.ndarray, str]]:
    """transformers' name → (its bytes in the file as (rows, row bytes) uint8, its type),
    for the names asked. A Llama's q and k rows are put back in transformers' order
    (`reader._unpermute`: whole rows, so whole blocks, move); Gemma 3's are stored so."""
    from kvcache_cli.models.gguf.layout import open_file, read_layout
    from kvcache_cli.models.gguf.reader import _unpermute, hf_name

    path = Path(path)
    data, size = open_file(path)
    layout = read_layout(path, data, size)
    arch = layout.metadata.get("general.architecture")
    found = {}
    for t in layout.tensors:
        name = hf_name(t.name, "gemma3" if arch == "gemma3" else "llama")
        if name not in names:
            continue
        rows = int(np.prod(t.shape[:-1]))
        blocks = np.frombuffer(data, np.uint8, t.end - t.start, t.start).reshape(rows, -1)
        if arch != "gemma3" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if name.endswith("q_proj.weight") else n_kv
            blocks = _unpermute(blocks, heads, rows // heads)
        found[name] = (blocks, t.kind)
    missing = sorted(names - set(found))
    if missing:
        raise ValueError(f"{path}: no tensor for {missing[0]}; expected the file the model "
                         "was read from")
    return found


def _merged(parts: list[tuple[np.ndarray, str]]) -> list[tuple[np.ndarray, str]]:
    """Neighbouring parts of one type as one (rows after rows): one kernel call each."""
    merged: list[tuple[np.ndarray, str]] = []
    for blocks, kind in parts:
        if merged and merged[-1][1] == kind:
            blocks = np.concatenate([merged.pop()[0], blocks])
        merged.append((blocks, kind))
    return merged
