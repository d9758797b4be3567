"""Which model a command runs and how it loads: the default model, the torch extra's
checks, --device, the model's weights and their format, and the cache checked against the
model's shape before any weights load.

Nothing here imports torch at module level: the checks run before torch is known to be there.
"""

from __future__ import annotations

import os

from kvcache_cli.cli.options import TORCH_DTYPES
from kvcache_cli.cli.refusals import fail, print_note

# What the GPT-2 loader may import: torch always, safetensors for a checkpoint folder,
# huggingface_hub for the pretrained weights. All come with the torch extra.
GPT2_MODULES = ("torch", "safetensors", "huggingface_hub")


def torch_extra_missing(who_needs: str, *modules: str) -> str | None:
    """One line naming the missing MODULES and the install command, or None if none is missing.

    WHO_NEEDS starts the sentence ("kvcache bench needs"). find_spec locates a module
    without importing it, so the check costs no start-up time.
    """
    from importlib.util import find_spec

    missing = [name for name in modules if find_spec(name) is None]
    if not missing:
        return None
    names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
    verb = "is" if len(missing) == 1 else "are"
    from kvcache_cli import TORCH_INSTALL

    return f"{who_needs} {names}, which {verb} not installed: {TORCH_INSTALL}"


def need_torch_extra(who_needs: str, *modules: str) -> None:
    """Fail in one line, exit 2, when modules of the torch extra are missing."""
    message = torch_extra_missing(who_needs, *modules)
    if message is not None:
        fail(message)


def default_model() -> str:
    """The model every command runs without -m: SmolLM2 where it is installed, so a first
    run reads like a real model; the shipped stdlib-bytes checkpoint otherwise (trained,
    offline). GPT-2's shapes are one flag away (-m gpt2)."""
    from kvcache_cli.checkpoints import TRAINED
    from kvcache_cli.models.smollm2 import SMOLLM2, smollm2_gguf

    return SMOLLM2 if smollm2_gguf() is not None else TRAINED


def check_cache_for(spec, model: str, config=None) -> None:
    """Refuse, before the weights load, a bounded cache whose budget passes the model's
    context window, and a quantised one whose groups do not fit its heads (both read from
    its preset or config.json alone: `config` when the command has read it already)."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import check_context, check_spec
    from kvcache_cli.models import model_config

    try:
        config = config if config is not None else model_config(model)
    except ValueError:
        return  # not a model: the loader says so in its own words
    try:
        check_context(spec, config.context, model)
        check_spec(spec, config.head_size)
    except CacheSpecError as err:
        fail(str(err))


def refuse_missing_model(model: str) -> None:
    """A --model path that is not there, refused in one line naming every kind --model
    accepts, before torch is imported (seconds)."""
    from kvcache_cli.models import missing_model

    message = missing_model(model)
    if message is not None:
        fail(message)


# generate's words for no CUDA, naming the torch build; bench, eval and serve say NO_CUDA.
NO_CUDA_IN = "--device cuda: CUDA is not available (torch {version}); use --device cpu"


def refuse_unbuilt_cuda(device: str, words: str | None = None) -> None:
    """--device cuda on a torch built without CUDA, refused in one line (WORDS, else
    measure.NO_CUDA) before torch is imported (that alone takes seconds); a build with CUDA
    is asked later, by torch."""
    from kvcache_cli.measure import NO_CUDA, torch_without_cuda

    version = torch_without_cuda() if device == "cuda" else None
    if version:
        fail((words or NO_CUDA).format(version=version))


def torch_device(device: str) -> str:
    """Check --device before loading anything: no CUDA is bad input, in one line."""
    if device not in ("cpu", "cuda"):
        fail(f"--device {device!r}: expected cpu or cuda")
    refuse_unbuilt_cuda(device, NO_CUDA_IN)
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        fail(NO_CUDA_IN.format(version=torch.__version__))
    return device


def load_model(model: str, weights: str, device: str, dtype: str = "fp32", config=None):
    """Any family's model (`models.load_model`) with its errors as one line; its note
    (random weights...) on stderr. `config`: the model's, when the command has read it."""
    import torch

    from kvcache_cli import models

    try:
        loaded = models.load_model(model, weights, device, getattr(torch, TORCH_DTYPES[dtype]),
                                   config)
    except ValueError as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    if loaded.note:
        print_note(loaded.note)
    return loaded


def pick_threads(threads: int | None, device) -> int:
    """torch's intra-op threads for the run, set now: --threads when given; on the CPU,
    else, torch's own count (one per core) cut to the cores other processes leave free,
    with one note saying so. Measured (a 0.1 s sample) only when a model is about to run."""
    import torch

    from kvcache_cli import measure

    if threads is not None:
        torch.set_num_threads(threads)
        return threads
    own = torch.get_num_threads()
    sampled = measure.free_cores() if str(device) == "cpu" else None
    if sampled is None or sampled[0] >= own:
        return own
    free, busy = sampled
    torch.set_num_threads(free)
    print_note(f"other processes keep {busy:.1f} of {os.cpu_count()} cores busy: running "
               f"on {free} thread{'s' if free != 1 else ''}, not {own} (--threads sets it)")
    return free


def check_weights_dtype(weights_dtype: str | None, model: str, device: str,
                        config=None) -> None:
    """Refuse an unknown or unrunnable --weights-dtype before any weights load (`config`:
    the model's, when the command has read it)."""
    if weights_dtype is None:
        return
    from kvcache_cli.models import linear, model_config, source_types

    try:
        types = source_types(model) if weights_dtype == "q4" else None
        config = config if config is not None else model_config(model)
        linear.check_weights_dtype(weights_dtype, config, device, types)
    except ValueError as err:
        fail(f"--weights-dtype: {err}")


def with_weights_dtype(loaded, weights_dtype: str | None):
    """(the loaded model in --weights-dtype, the float32 model to check it against, or None).

    The float32 reference exists only where the format differs from it; it is the
    weights as loaded, so both hold the same function up to the format's rounding.
    """
    import copy

    import torch

    from kvcache_cli.models import linear, set_weights_dtype

    model = loaded.model
    fmt = weights_dtype or linear.weights_format(model)
    if fmt == "fp32" and model.dtype == torch.float32:
        return loaded, None
    reference = copy.deepcopy(model).float()  # the float32 original the format rounds
    reference = linear.arrange_weights(reference)
    if weights_dtype is not None:
        set_weights_dtype(model, weights_dtype)
    return loaded, reference
