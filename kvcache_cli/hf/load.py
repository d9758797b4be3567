"""Loading any transformers causal LM offline, checked: a model folder (config.json and
safetensors, one file or shards with their index), a GGUF file transformers reads, or a Hub
id ("org/name") already in the local Hub cache.

    from kvcache_cli.hf.load import load_hf
    loaded = load_hf("path/to/folder")            # or "model.gguf", or "org/name"
    loaded.model, loaded.tokenizer, loaded.architecture

A model's files come from someone else, so the load never runs their code (no
`trust_remote_code`; `auto_map` is refused), never unpickles (safetensors only; weights present
only as `pytorch_model.bin` are refused unread), never reaches the network
(`local_files_only`), and never takes a model whose weights do not fill it: transformers would
initialise missing weights at random, or skip mismatched ones, with a warning. Every refusal
is an HFLoadError of one line; transformers' warnings and progress bars are silenced while it
loads. `read_hf_config` reads the config alone, without torch (`hf/folder_checks.py`).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache_cli.hf.folder_checks import (
    HFLoadError,
    HFOffline,
    Located,
    folder_config,
    gguf_config,
    locate,
    safetensors_files,
)
from kvcache_cli.models import GEMMA3_MODEL_TYPES
from kvcache_cli.models.bounds import BOUNDS
from kvcache_cli.models.gemma3_config import FP16_OVERFLOWS
from kvcache_cli.sizing.families import decoder_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HFLoadError", "HFOffline", "HFModel", "read_hf_config", "load_hf"]

# kvcache's own bound on a model's layers (models.bounds): the model is built before its
# weights are read, and a hostile count would build millions of empty layers.
MAX_LAYERS = int(BOUNDS["n_layer"].high)
# safetensors' float types: transformers would cast integers or booleans stored for a float
# weight without a word (quantised checkpoints hold them with scales, which this does not read).
FLOAT_TYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class HFModel:
    """A transformers causal LM loaded offline and checked, with its tokenizer."""

    model: PreTrainedModel  # eval mode, on `device`, in `dtype`
    tokenizer: PreTrainedTokenizerBase
    source: str  # the folder, file or Hub id as the user gave it
    architecture: str  # config's architectures[0] (or model_type)


def read_hf_config(source: str) -> dict:
    """config.json of a folder, of a GGUF file's metadata (the fields transformers maps), or
    of a Hub id in the local Hub cache, without importing torch; raises HFLoadError (HFOffline
    for a Hub id not in the cache)."""
    return _config_of(locate(source))


def _config_of(located: Located) -> dict:
    if located.gguf:
        return gguf_config(located.folder / located.gguf)
    return folder_config(located.folder)


def load_hf(source: str, *, device: str = "cpu",
            dtype: torch.dtype | None = None) -> HFModel:
    """SOURCE's model (in DTYPE, float32 by default, on DEVICE, eval mode) and tokenizer,
    through transformers' Auto classes, offline, never running or unpickling the files;
    raises HFLoadError naming what is wrong (HFOffline for a Hub id not in the cache)."""
    import torch

    located = locate(source)
    config = _config_of(located)
    if dtype == torch.float16 and decoder_config(config).get("model_type") in \
            GEMMA3_MODEL_TYPES:
        raise HFLoadError(FP16_OVERFLOWS)
    with _quiet():
        hf_config = _transformers_config(located, config)
        _check_fills(located, hf_config, _stored_shapes(located))
        model = _weights(located, torch.float32 if dtype is None else dtype)
        tokenizer = _tokenizer(located)
        try:
            model = model.to(device).eval()
        except (RuntimeError, AssertionError, ValueError) as error:  # torch's, per backend
            raise HFLoadError(f"device {device!r}: {_one_line(error)}") from None
        _check_computes(located, model)
    names = config.get("architectures") or [config["model_type"]]
    return HFModel(model, tokenizer, source, names[0])


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' and huggingface_hub's warnings, logs and progress bars off, then back
    as they were: a refusal is one line, and a load that worked says nothing."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off = are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        # The GGUF reader's bar is tqdm's own, which transformers' switch does not reach.
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()


def _one_line(error: BaseException) -> str:
    """An exception's message as one short line (transformers' run to paragraphs, the cause
    often on the second)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _transformers_config(located: Located, config: dict) -> PretrainedConfig:
    """transformers' config object for the model, refused unless transformers has the model
    type built in and as a causal LM, and every class `architectures` names."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = located.folder / (located.gguf or "config.json")
    model_type = config["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        raise HFLoadError(f"{where}: model_type {model_type!r} is not one transformers "
                          f"{transformers.__version__} has; expected a built-in model type "
                          "such as 'llama'")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFLoadError(f"{where}: model_type {model_type!r} has no causal LM in "
                          "transformers (no *ForCausalLM class); expected a model that "
                          "generates text")
    for name in config.get("architectures") or []:
        if not hasattr(transformers, name):
            raise HFLoadError(f"{where}: architectures names {name!r}, a class transformers "
                              f"{transformers.__version__} does not have; expected one such "
                              f"as {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]!r}")
    try:
        hf_config = AutoConfig.from_pretrained(
            located.folder, gguf_file=located.gguf, local_files_only=True,
            trust_remote_code=False)
    # Each model's config class checks its own fields, raising what it likes (ValueError,
    # TypeError, KeyError, ZeroDivisionError...): all of them mean the file is wrong.
    except Exception as error:
        raise HFLoadError(f"{where}: transformers refuses the config ({_one_line(error)})") \
            from None
    layers = getattr(hf_config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and not 1 <= layers <= MAX_LAYERS:
        raise HFLoadError(f"{where}: num_hidden_layers is {layers:,}; expected a whole number "
                          f"from 1 to {MAX_LAYERS:,}")
    return hf_config


def _stored_shapes(located: Located) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor the model's files hold, its shape and its type, from their headers alone
    (a GGUF's under llama.cpp's names, a safetensors file's under the checkpoint's)."""
    if located.gguf:
        from kvcache_cli.models.gguf.layout import open_file, read_layout

        path = located.folder / located.gguf
        data, size = open_file(path)
        return {t.name: (t.shape, t.kind) for t in read_layout(path, data, size).tensors}
    from safetensors import safe_open

    stored = {}
    for path in safetensors_files(located.folder):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                stored[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return stored


def _check_fills(located: Located, hf_config: PretrainedConfig,
                 stored: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Refuse weights that disagree with the config before any is allocated: a tensor of
    another shape than the config makes it, or fewer weights than the model has (transformers
    would fill the rest at random, with a warning that _quiet silences)."""
    import torch
    from transformers import AutoModelForCausalLM

    where = located.folder / (located.gguf or "config.json")
    try:
        with torch.device("meta"):  # shapes only: no memory, however large the config says
            skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
    except Exception as error:  # as in _transformers_config: the config's own checks
        raise HFLoadError(f"{where}: transformers cannot build the model it describes "
                          f"({_one_line(error)})") from None
    for name, tensor in skeleton.state_dict().items():
        if name not in stored:
            continue  # tied, or saved under another name: transformers' loading info says
        shape, kind = stored[name]
        if shape != tuple(tensor.shape):
            raise HFLoadError(f"{where}: the weights hold {name} as {list(shape)}, the "
                              f"config makes it {list(tensor.shape)}; expected the config "
                              "the weights were saved with")
        if tensor.is_floating_point() and kind not in FLOAT_TYPES:
            raise HFLoadError(f"{where}: the weights hold {name} as {kind}; expected a "
                              f"float type ({', '.join(FLOAT_TYPES)})")
    wanted = sum(p.numel() for p in skeleton.parameters())
    held = sum(math.prod(shape) for shape, _ in stored.values())
    if wanted > held:
        raise HFLoadError(f"{where}: describes a model of {wanted:,} weights and its files "
                          f"hold {held:,}; expected weights for every parameter")


def _weights(located: Located, dtype: torch.dtype) -> PreTrainedModel:
    """The model with its weights, refused unless every weight was found at its shape."""
    from transformers import AutoModelForCausalLM

    where = located.folder / (located.gguf or "")
    files = {"gguf_file": located.gguf} if located.gguf else {"use_safetensors": True}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            located.folder, local_files_only=True, trust_remote_code=False, dtype=dtype,
            output_loading_info=True, **files)
    except Exception as error:  # transformers' loaders, like its configs, raise any type
        raise HFLoadError(f"{where}: transformers cannot load the weights "
                          f"({_one_line(error)})") from None
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        found = sorted(map(str, info.get(what) or ()))
        if found:
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3
                                            else "")
            raise HFLoadError(f"{where}: {what.replace('_', ' ')} loading the weights "
                              f"({shown}); expected weights that match the config")
    return model


def _check_computes(located: Located, model: PreTrainedModel) -> None:
    """Refuse a model whose first two positions give an error or logits that are not finite:
    transformers takes a NaN epsilon or a zero, negative or NaN rotary base without a word,
    and every later figure would be NaN."""
    import torch

    where = located.folder / (located.gguf or "config.json")
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(2, device=model.device) % max(vocab, 1))[None]  # (1, 2)
    try:
        with torch.inference_mode():
            logits = model(ids).logits  # (1, 2, vocab)
    except Exception as error:  # the config's values reach kernels that raise any type
        raise HFLoadError(f"{where}: the model fails on its first tokens "
                          f"({_one_line(error)}); expected a config it can run") from None
    if not torch.isfinite(logits).all():
        raise HFLoadError(f"{where}: the model's logits on its first tokens are not finite; "
                          "expected a config and weights that compute numbers (check "
                          "epsilons and rotary bases)")


def _tokenizer(located: Located) -> PreTrainedTokenizerBase:
    """The model's tokenizer, from its folder or GGUF file, offline, no custom code."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            located.folder, gguf_file=located.gguf, local_files_only=True,
            trust_remote_code=False)
    except Exception as error:  # tokenizer files are parsed by several libraries
        raise HFLoadError(f"{located.folder / (located.gguf or '')}: the tokenizer does not "
                          f"load ({_one_line(error)}); expected tokenizer.json or the files "
                          "of a tokenizer transformers has built in") from None
    if not tokenizer:
        raise HFLoadError(f"{located.folder}: no tokenizer; expected tokenizer.json or the "
                          "files of a tokenizer transformers has built in")
    return tokenizer
