"""A checkpoint's weights read safely: safetensors, one file or sharded, or a pickle held to
tensors only; whatever the file holds, a {name: tensor} dict or one ValueError naming it."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
from torch import Tensor


def read_weights(path: Path) -> dict[str, Tensor]:
    """Tensors only: safetensors, or a pickle restricted to tensors (weights_only).

    Whatever the file holds, the outcome is a {name: tensor} dict or a ValueError naming the
    file: never a traceback from the parser, never a read outside the checkpoint directory.
    """
    if not path.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"{path}: not a regular file; expected a checkpoint file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty; expected a checkpoint file")
    if path.name.endswith(".index.json"):  # a sharded safetensors checkpoint
        return read_shards(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except (SafetensorError, OSError, ValueError) as error:
            first = (str(error).strip().splitlines() or [""])[0][:120]
            raise ValueError(f"{path}: not a readable safetensors file ({first})") from None
    else:
        try:
            # weights_only=True unpickles tensors and plain containers and refuses any other
            # object, so a .bin that would run code on load fails here instead. Its warning
            # about a pickle protocol it was not written with is no news to the user.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - bytes that are no pickle make the
            # unpickler raise whatever its first opcode hits: plain text is a KeyError
            # (an unknown memo key), other bytes an IndexError, a struct.error, ...
            text = str(error)
            # torch's refusal of an object opens with a paragraph on its defaults; what it
            # refused follows "Unpickler error:" (an opcode, a global such as posix.system)
            _, said, refused = text.partition("Unpickler error:")
            lines = (refused if said else text).strip().splitlines() or [""]
            first = lines[0].strip()
            first = first if len(first) <= 120 else first[:117].rsplit(" ", 1)[0] + "..."
            if not isinstance(error, (pickle.UnpicklingError, RuntimeError, EOFError,
                                      ValueError, OSError)):
                first = f"not a pickle: {type(error).__name__}"
            raise ValueError(f"refusing {path}: not a plain tensor file ({first})") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(t, Tensor) for k, t in state.items()):
        kind = type(state).__name__ if not isinstance(state, dict) else "a dict of other values"
        raise ValueError(f"{path} holds {kind}, not a state dict of named tensors")
    return state


def read_shards(index: Path) -> dict[str, Tensor]:
    """The shards an index names, each inside the index's own directory."""
    from kvcache_cli.sizing.config import load_config  # regular files only, size-capped

    weight_map = load_config(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map of tensor name → shard file")
    root = index.parent.resolve()
    state: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = (root / shard).resolve()
        if path.parent != root:  # '../x', '/etc/x' or a link out: never read outside
            raise ValueError(f"{index}: shard {shard!r} is outside the checkpoint directory; "
                             "expected a file name next to the index")
        state.update(read_weights(path))
    return state
