"""kvcache's Gemma 3 written as llama.cpp's converter writes one (arch `gemma3`), float32,
so llama.cpp runs the very weights kvcache runs (`export.export_gguf` quantises it to F16
or Q8_0 with llama.cpp's own quantiser, as for the other families).

What llama.cpp reads of it is in its `llama-model.cpp` (LLM_ARCH_GEMMA3) and
`src/models/gemma3.cpp`, and it decides what a file can say:

- **the norms are stored as 1 + w**: Gemma's RMSNorm scales by 1 + w, llama.cpp's graph
  by the stored weight, so its converter adds the 1 (`gguf.reader.read_gemma3` takes it
  off again); q and k rows are stored as transformers holds them (not permuted: llama.cpp
  rotates Gemma's heads in halves, NEOX order);
- **the shape llama.cpp does not read, it assumes**: every 6th layer global, the sliding
  layers' rotary base 10,000, queries scaled by 1/√head_dim (the 27B by its width per
  head), no logit soft-capping, no rotary scaling; a model that differs (a tiny test config
  of another pattern, a larger Gemma's scaled global layers) is refused in one line rather
  than written as a file llama.cpp would run as another function;
- **the head is tied**: no `output.weight`, llama.cpp multiplies by `token_embd`;
- **the tokenizer**: a model read from a GGUF (`config.gguf`, `-m gemma3`) gets that
  file's own SentencePiece vocabulary copied key for key; one with none (random weights)
  gets the synthetic byte-level one the other families get (ids are fed directly).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcache_cli.models.gemma3_config import ARCH, LAYERS_27B, LOCAL_ROPE_THETA, PATTERN
from kvcache_cli.models.gguf.reader import _TOP_TENSORS, BLOCK_TENSORS

# transformers' Gemma3ForCausalLM names -> llama.cpp's: the reader's map, turned round.
_TOP = {f"{hf}.weight": f"{gguf}.weight" for gguf, hf in _TOP_TENSORS.items()}
_BLOCK = {hf: gguf for gguf, hf in BLOCK_TENSORS[ARCH].items()}
# The tokenizer keys of a Gemma 3 GGUF copied as they are (the arrays and the ids).
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                   "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def gemma3_tensor_name(name: str) -> str:
    """llama.cpp's name of a transformers Gemma3ForCausalLM parameter."""
    if name in _TOP:
        return _TOP[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def check_writable(config) -> None:
    """A ValueError (one line) for a Gemma 3 llama.cpp would read as another model."""
    pattern = tuple(bool((i + 1) % PATTERN) for i in range(config.n_layer))
    scalar = (config.n_embd // config.n_head if config.n_layer == LAYERS_27B
              else config.head_dim)
    problems = [
        (tuple(t.sliding for t in config.layer_types) != pattern,
         f"its layer pattern is not every {PATTERN}th layer global"),
        (len({t.window for t in config.layer_types if t.sliding}) > 1,
         "its sliding layers have windows of more than one size"),
        (any(t.sliding and t.rope_theta != LOCAL_ROPE_THETA for t in config.layer_types),
         f"its sliding layers' rotary base is not {LOCAL_ROPE_THETA:,.0f}"),
        (config.query_pre_attn_scalar != scalar,
         f"query_pre_attn_scalar is {config.query_pre_attn_scalar}, not {scalar}"),
        (config.rope_factor_full != 1.0 or config.rope_factor_sliding != 1.0,
         "its rotary positions are scaled"),
        (config.final_logit_softcapping is not None, "its logits are soft-capped"),
        (not config.tie_word_embeddings, "its head is not tied to the embedding"),
    ]
    why = next((what for bad, what in problems if bad), None)
    if why is not None:
        raise ValueError(f"llama.cpp's gemma3 cannot run this model: {why} (llama.cpp "
                         "assumes Gemma 3's own values there)")


def write_gemma3(state: dict, config, path: Path) -> Path:
    """Write a float32 GGUF of a Gemma 3 state dict (transformers' names, float32, as
    `linear.float_state` gives them) to `path`."""
    from gguf import GGUFWriter, LlamaFileType

    from kvcache_cli.models.gguf.export import add_shape

    check_writable(config)
    writer = GGUFWriter(str(path), ARCH)
    try:
        add_shape(writer, config, config.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_eps)
        writer.add_rope_freq_base(config.rotation("full")[0])
        windows = {t.window for t in config.layer_types if t.sliding}
        if windows:
            writer.add_sliding_window(windows.pop())
        writer.add_file_type(LlamaFileType.ALL_F32)
        _add_tokenizer(writer, config)
        for name, t in state.items():
            if name == "lm_head.weight":
                continue  # tied (check_writable): llama.cpp reads token_embd
            w = t.detach().to("cpu").float().numpy()
            if name.endswith("norm.weight"):
                w = w + np.float32(1)  # llama.cpp's graph scales by the stored gain
            writer.add_tensor(gemma3_tensor_name(name), np.ascontiguousarray(w))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def _add_tokenizer(writer, config) -> None:
    """The source file's tokenizer keys, copied; else the synthetic byte-level vocabulary."""
    from gguf import GGUFReader

    from kvcache_cli.models.gguf.export import synthetic_vocab

    if config.gguf is None:
        tokens, types, merges = synthetic_vocab(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(config.vocab_size - 1)
        return
    fields = GGUFReader(config.gguf).fields
    for key in _TOKENIZER_KEYS:
        field = fields.get(key)
        if field is None:
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, kind, sub_type=sub)
