"""`--engine`: which engine runs a model. kvcache's own family where it has one for the
model (gpt2, llama, gemma3), else transformers with kvcache's caches (`hf.engine`).

Torch-free at import, and so is the choice for every model kvcache has a family for: a
name, a folder's config.json, a GGUF's architecture are read without torch; a Hub id's
config is read from the local Hub cache (`hf.load.read_hf_config`).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from kvcache_cli.cli.refusals import fail


class Engine(str, Enum):
    auto = "auto"
    kvcache = "kvcache"
    transformers = "transformers"


EngineOption = Annotated[Engine, typer.Option(
    help="kvcache: its own model of the family (gpt2, llama, gemma3); transformers: any "
    "model transformers loads (a folder, a Hub id in the local Hub cache, a GGUF) with "
    "kvcache's cache kinds as transformers cache layers; auto: kvcache's where it has the "
    "family, else transformers.")]

# config.json's model_type of the families kvcache runs itself.
KVCACHE_MODEL_TYPES = ("gpt2", "llama", "gemma3_text")
# A GGUF's general.architecture kvcache reads as its own (models.gguf.reader: read_gguf's
# Llama, read_gemma3's Gemma 3).
KVCACHE_GGUF = ("llama", "gemma3")


def pick_engine(model: str, engine: Engine) -> str:
    """'kvcache' or 'transformers' for -m MODEL; --engine kvcache on an architecture
    kvcache has no family for is refused in one line."""
    foreign = foreign_architecture(model)
    if engine is Engine.auto:
        return "kvcache" if foreign is None else "transformers"
    if engine is Engine.kvcache and foreign is not None:
        fail(f"model {model!r} is a {foreign}: kvcache has no family for it (gpt2, llama, "
             "gemma3); --engine transformers runs it")
    return engine.value


def foreign_architecture(model: str) -> str | None:
    """The architecture of a model kvcache has no family for (its config's
    architectures[0]), or None: one kvcache runs, or cannot tell (its loader then refuses
    it in its own words, as before --engine)."""
    from kvcache_cli.checkpoints import shipped_dir
    from kvcache_cli.hub import is_hub_id
    from kvcache_cli.models.smollm2 import SMOLLM2_HUB

    path = Path(model).expanduser()
    if model == SMOLLM2_HUB or shipped_dir(model) is not None:
        return None
    if path.is_dir():
        return _foreign(_folder_config(path))
    if path.suffix == ".gguf" and path.is_file():
        arch = _gguf_architecture(path)
        return None if arch in KVCACHE_GGUF or arch is None else arch
    if is_hub_id(model) and not path.exists():
        return _foreign(_hub_config(model))
    return None


def _foreign(config: dict | None) -> str | None:
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type is None or model_type in KVCACHE_MODEL_TYPES:
        return None
    names = config.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) \
        else str(model_type)


def _folder_config(folder: Path) -> dict | None:
    from kvcache_cli.sizing.config import ConfigError, load_config

    try:
        return load_config(folder / "config.json")
    except (ConfigError, OSError):
        return None


def _gguf_architecture(path: Path) -> str | None:
    """general.architecture of a GGUF file, or None when it does not read as one."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields.get("general.architecture")
        return bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception:  # noqa: BLE001 - a file gguf cannot parse: kvcache's reader refuses it
        return None


def _hub_config(repo_id: str) -> dict:
    """A Hub id's config.json from the local Hub cache; the offline refusal in one line."""
    from kvcache_cli.cli.loading import need_torch_extra

    need_torch_extra(f"-m {repo_id} (a Hub id) needs", "torch", "transformers")
    from kvcache_cli.hf.load import HFLoadError, read_hf_config

    try:
        return read_hf_config(repo_id)
    except HFLoadError as err:
        fail(str(err))


def transformers_source(model: str) -> str:
    """What transformers loads for -m MODEL: the GGUF file of kvcache's named models
    (smollm2, gemma3), else the value as given (a folder, a file, a Hub id)."""
    from kvcache_cli.models.gemma3_270m import GEMMA3, gemma3_gguf
    from kvcache_cli.models.smollm2 import SMOLLM2, smollm2_gguf

    named = {SMOLLM2: smollm2_gguf, GEMMA3: gemma3_gguf}.get(model)
    file = named() if named is not None else None
    return str(file) if file is not None else model


def refuse_options(ctx: typer.Context, names: tuple[str, ...], why: str) -> None:
    """An option typed that the transformers engine does not run, refused in one line."""
    given = [n for n in names
             if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE"]
    if given:
        fail(f"--{given[0].replace('_', '-')} with --engine transformers: {why}")


def refuse_kinds(specs) -> None:
    """A cache kind the bridge does not hold (yet), refused in one line."""
    from kvcache_cli.hf import BridgeError
    from kvcache_cli.hf.engine import check_kinds

    try:
        check_kinds(specs)
    except BridgeError as err:
        fail(str(err))


def load_engine(model: str, device: str, dtype: str = "fp32"):
    """The transformers model for -m MODEL behind kvcache's model contract, as a
    `LoadedModel`; what cannot be loaded or served, in one line."""
    import torch
    from transformers.utils import logging as hf_logging

    from kvcache_cli.cli.options import TORCH_DTYPES
    from kvcache_cli.hf.engine import engine_model
    from kvcache_cli.hf.load import load_hf
    from kvcache_cli.measure import quiet_transformers
    from kvcache_cli.models.base import LoadedModel

    source = transformers_source(model)
    hf_logging.disable_progress_bar()  # a command prints its own progress, and one line
    try:
        with quiet_transformers():
            loaded = load_hf(source, device=str(device),
                             dtype=getattr(torch, TORCH_DTYPES[dtype]))
        return LoadedModel(engine_model(loaded), f"transformers {loaded.architecture} "
                                                 f"({source})")
    except ValueError as err:  # HFLoadError, BridgeError, transformers' own refusals
        fail(str(err))
    except (OSError, RuntimeError) as err:
        fail(str(err).strip().splitlines()[0] if str(err).strip() else repr(err), code=1)
