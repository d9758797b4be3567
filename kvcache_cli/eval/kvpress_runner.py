"""kvpress's presses on a transformers model, scored as `kvcache eval` scores a cache.

Run by `eval.peer_kvpress` with the Python of kvpress's own venv (scripts/kvpress_venv.sh:
kvpress pins transformers below 5.3, kvcache runs a newer one), never imported by kvcache's
own process. It reads one job as JSON on stdin and writes one result as JSON on stdout:

    in:  {"model": folder, "architecture": "LlamaForCausalLM", "layer_types": [...],
          "ids": [...], "prompt_len": P, "threads": N,
          "presses": [{"name": "kvpress:snapkv:0.25", "press": "SnapKVPress",
                       "kwargs": {"compression_ratio": 0.75, ...}}, ...]}
    out: {"kvpress": version, "transformers": version, "refused": reason or null,
          "rows": [{"name", "nll", "kl", "agree", "step_ms", "prefill_ms", "bytes_held",
                    "positions"}, ...]}   the exact DynamicCache's row first

The protocol is eval's and kvpress's own pipeline's: the prompt prefilled as one forward
with the press hooked on (kvpress compresses every layer's keys and values at the end of
that layer's prefill; its last position scored, from the whole prompt), then one token a
step with no press, each at its position in the text (`position_ids`, as kvpress's
pipeline passes them: the compressed cache is shorter than the text). Every press runs in
lockstep with transformers' exact DynamicCache on the same ids, and is scored against it by
eval's own `Tally` (kvcache_cli on PYTHONPATH; `eval.quality` needs only torch).

A model kvpress does not hook is refused before any weights load, with the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
import time
from collections.abc import Callable, Sequence

REFERENCE = "kvpress:dynamic"  # transformers' DynamicCache with no press: the exact cache


def refusal(architecture: str, layer_types: Sequence[str], supported: Sequence[str],
            version: str) -> str | None:
    """Why kvpress `version` cannot compress a model (one line), or None: an architecture
    outside the classes its presses are written for (`SUPPORTED_MODELS`), and, said
    apart, sliding-window layers, which kvpress skips only in Gemma3ForConditionalGeneration
    and would otherwise compress as if they held the whole context."""
    if architecture in supported:
        return None
    reason = (f"kvpress {version} compresses {', '.join(supported)}; not {architecture}")
    if any(kind != "full_attention" for kind in layer_types):
        reason += (": it skips sliding-window layers only in Gemma3ForConditionalGeneration, "
                   "and would compress this model's sliding layers as full ones")
    return reason


def layer_bytes(cache) -> int:
    """Bytes a transformers DynamicCache holds: every layer's keys and values (a press
    replaces them with the kept ones, so this is what compression frees)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               if getattr(layer, "keys", None) is not None for t in (layer.keys, layer.values))


def run(model, ids: Sequence[int], prompt_len: int,
        rows: Sequence[tuple[str, Callable[[], contextlib.AbstractContextManager]]],
        new_cache: Callable[[], object]) -> list:
    """The exact cache's row, then each (name, press context) row, in lockstep over `ids`:
    one `Tally` each, with `bytes_held` and `positions` set at the end."""
    import torch

    from kvcache_cli.eval.quality import Tally

    # transformers 5.3 and later take the cache as `cache` (and warn at the old name);
    # the releases kvpress pins, as `past_key_values`.
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    fed = len(ids) - 1  # the last token is only a target
    tokens = torch.tensor([ids[:fed]])  # (1, fed)
    targets = torch.tensor(ids[1:])  # (fed,)
    tallies = [(Tally(REFERENCE, new_cache()), contextlib.nullcontext)]
    tallies += [(Tally(name, new_cache()), press) for name, press in rows]
    steps = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, fed)]
    with torch.inference_mode():
        for start, end in steps:
            exact = None
            for tally, press in tallies:
                positions = torch.arange(start, end)[None]  # (1, T): the text's positions
                hooked = press() if start == 0 else contextlib.nullcontext()
                began = time.perf_counter()
                with hooked:
                    logits = model(tokens[:, start:end], position_ids=positions,
                                   use_cache=True, logits_to_keep=1,
                                   **{keyword: tally.cache}).logits[0]  # (1, vocab)
                ms = (time.perf_counter() - began) * 1e3
                if start:
                    tally.step_ms.append(ms)
                else:
                    tally.prefill_ms = ms
                logp = logits.double().log_softmax(-1)
                exact = logp if exact is None else exact
                tally.score(logp, targets[end - 1:end], exact)
    return [t for t, _ in tallies]


def _row(tally, positions: int) -> dict:
    return {"name": tally.name, "nll": tally.nll, "kl": tally.kl, "agree": tally.agree,
            "step_ms": tally.step_ms, "prefill_ms": tally.prefill_ms,
            "bytes_held": layer_bytes(tally.cache), "positions": positions}


def main() -> int:
    job = json.load(sys.stdin)
    import kvpress
    import torch
    import transformers
    from kvpress.presses.base_press import SUPPORTED_MODELS

    version = getattr(kvpress, "__version__", None) or _version("kvpress")
    out = {"kvpress": version, "transformers": transformers.__version__, "rows": [],
           "refused": refusal(job["architecture"], job["layer_types"],
                              [c.__name__ for c in SUPPORTED_MODELS], version)}
    if out["refused"] is None:
        torch.set_num_threads(job["threads"])
        model = transformers.AutoModelForCausalLM.from_pretrained(job["model"],
                                                                  dtype=torch.float32)
        model.eval()
        presses = [(p["name"], getattr(kvpress, p["press"])(**p["kwargs"]))
                   for p in job["presses"]]
        tallies = run(model, job["ids"], job["prompt_len"],
                      [(name, lambda press=press: press(model)) for name, press in presses],
                      transformers.DynamicCache)
        out["rows"] = [_row(t, len(job["ids"]) - 1) for t in tallies]
    json.dump(out, sys.stdout)
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
