"""A GGUF's converted folder written again as a transformers model folder, for the engines that
read only that format (vLLM, SGLang): `scripts/vllm_cpu.sh` serves SmolLM2 and Gemma 3 from it.

kvcache's converted folder (`llama_loading`) holds the weights under transformers' own
Llama names (`model.layers.0.self_attn.q_proj.weight`, q and k rows already in its order),
float32, beside a config.json in kvcache's format. This writes, in a folder beside it
(`<converted>-hf/`), what `LlamaForCausalLM` reads instead, every value from the GGUF's
metadata as the converted config and tokenizer carry it:

- config.json: `LlamaForCausalLM`, the shape, rope theta, RMS epsilon, tied embeddings,
  the special token ids, `torch_dtype` float32 (the weights' dtype: an engine asked for
  `--dtype float32` serves exactly kvcache's numbers);
- generation_config.json: the token ids generation starts and stops at;
- tokenizer_config.json: the chat template and the special tokens by name (bos, eos, pad,
  unk, from the GGUF's `tokenizer.ggml.*_token_id`), no BOS added (the template has its own);
- tokenizer.json and model.safetensors: links to the converted folder's (no 0.5 GB copy).

A Gemma 3 folder is converted already under transformers' names and values (the norms' gains
as w, not llama.cpp's 1 + w; `gguf.reader`), and its config.json is transformers'
Gemma3TextConfig with kvcache's own keys beside it: those are dropped, `query_pre_attn_scalar`
written as the int transformers' strict config wants, float32 stated; the base model has no
chat template, and its tokenizer.json puts <bos> first itself.

Written under a temporary name and renamed when whole, as the converted folder is. Run as
`python -m kvcache_cli.models.gguf.hf_export [MODEL]` (smollm2, gemma3 or a .gguf): prints
the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HF_FORMAT = 1  # bumped when what is written changes: an older folder is written again
LINKED = ("tokenizer.json", "model.safetensors")


@dataclass(frozen=True)
class HFFolder:
    path: Path
    source: Path  # kvcache's converted folder it was written from
    written: bool  # now, rather than found whole


def hf_dir(converted: Path) -> Path:
    return converted.with_name(converted.name + "-hf")


def _special_ids(gguf: str | None) -> dict[str, int]:
    """The GGUF's special token ids (tokenizer.ggml.{bos,eos,padding,unknown}_token_id)."""
    if not gguf or not Path(gguf).is_file():
        return {}
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    out = {}
    for key, name in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def _token_names(tokenizer: dict) -> dict[int, str]:
    """Token id -> its text, for the added (special) tokens and the vocabulary."""
    names = {int(i): t for t, i in tokenizer.get("model", {}).get("vocab", {}).items()}
    names.update({int(a["id"]): a["content"] for a in tokenizer.get("added_tokens", [])})
    return names


# kvcache's keys in a converted Gemma 3 config.json, which transformers' config has not.
KVCACHE_KEYS = ("gguf", "source_types", "name", "chat_template")


def hf_files(config: dict, tokenizer: dict, special: dict[str, int]) -> dict[str, dict]:
    """The three JSON files, from kvcache's converted config, its tokenizer.json and the
    GGUF's special ids."""
    if config.get("model_type") == "gemma3_text":
        return _gemma3_files(config, tokenizer, special)
    names = _token_names(tokenizer)
    bos = special.get("bos", config.get("bos_id"))
    eos_ids = list(config.get("eos_ids") or ([special["eos"]] if "eos" in special else []))
    eos = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    pad = special.get("pad")
    head_dim = config.get("head_dim") or config["n_embd"] // config["n_head"]
    model = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config["n_embd"], "intermediate_size": config["intermediate"],
        "num_hidden_layers": config["n_layer"], "num_attention_heads": config["n_head"],
        "num_key_value_heads": config["n_kv_head"], "head_dim": head_dim,
        "max_position_embeddings": config["context"], "rms_norm_eps": config["rms_eps"],
        "rope_theta": config["rope_theta"], "rope_scaling": None,
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "torch_dtype": "float32", "use_cache": True,
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    tokens = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": config["context"], "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False}
    for key, token_id in (("bos_token", bos), ("eos_token", eos_ids[0] if eos_ids else None),
                          ("pad_token", pad), ("unk_token", special.get("unk"))):
        if token_id is not None and token_id in names:
            tokens[key] = names[token_id]
    if config.get("chat_template"):
        tokens["chat_template"] = config["chat_template"]
    return {"config.json": model, "generation_config.json": generation,
            "tokenizer_config.json": tokens}


def _gemma3_files(config: dict, tokenizer: dict, special: dict[str, int]) -> dict[str, dict]:
    """A converted Gemma 3's config as transformers' own, its generation and tokenizer
    files."""
    names = _token_names(tokenizer)
    model = {k: v for k, v in config.items() if k not in KVCACHE_KEYS}
    model["query_pre_attn_scalar"] = int(model["query_pre_attn_scalar"])
    model.update(torch_dtype="float32", pad_token_id=special.get("pad"))
    ids = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": special.get("pad")}
    tokens = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": config["max_position_embeddings"],
              "clean_up_tokenization_spaces": False}
    for key, token_id in (("bos_token", ids["bos_token_id"]), ("eos_token", ids["eos_token_id"]),
                          ("pad_token", ids["pad_token_id"]), ("unk_token", special.get("unk"))):
        if token_id is not None and token_id in names:
            tokens[key] = names[token_id]
    return {"config.json": model, "generation_config.json": ids,
            "tokenizer_config.json": tokens}


def write_hf_folder(converted: Path) -> HFFolder:
    """The transformers folder beside CONVERTED, written now if it is not there whole."""
    out = hf_dir(converted)
    stamp = out / "kvcache-hf.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("format") == HF_FORMAT:
        return HFFolder(out, converted, False)
    config = json.loads((converted / "config.json").read_text())
    tokenizer = json.loads((converted / "tokenizer.json").read_text(encoding="utf-8"))
    files = hf_files(config, tokenizer, _special_ids(config.get("gguf")))
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for name, data in files.items():
            (staging / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                                        encoding="utf-8")
        for name in LINKED:
            _link(converted / name, staging / name)
        (staging / "kvcache-hf.json").write_text(json.dumps(
            {"format": HF_FORMAT, "from": str(converted)}) + "\n")
        if out.exists():  # an older format's: replaced whole
            shutil.rmtree(out)
        try:
            staging.rename(out)
        except OSError:  # another process wrote it first: theirs is as good
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return HFFolder(out, converted, True)


def _link(source: Path, target: Path) -> None:
    """A symlink (a hard link, a copy, where the filesystem has no such links)."""
    try:
        os.symlink(source.resolve(), target)
    except OSError:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def export(model: str = "smollm2") -> HFFolder:
    """MODEL (smollm2, gemma3 or a .gguf) converted once, then written as a transformers
    folder."""
    from kvcache_cli.models import family_of

    if family_of(model) == "gemma3":
        from kvcache_cli.models.gemma3_loading import _folder

        folder = _folder(model)[0]
    else:
        from kvcache_cli.models.llama_loading import _gguf_folder

        folder, _ = _gguf_folder(model)
    return write_hf_folder(folder)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("error: expected at most one model: smollm2, gemma3 or a .gguf file", file=sys.stderr)
        return 2
    try:
        folder = export(args[0] if args else "smollm2")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(folder.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
