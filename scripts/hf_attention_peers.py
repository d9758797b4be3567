"""Step time and bytes held of SmolLM2 run by transformers: kvcache's quantised kinds under
the kvcache attention (the codes read in place by the C++ kernel) and under SDPA (a
dequantised copy every step), beside transformers' own DynamicCache and QuantizedCache
(quanto and hqq backends), at each context (docs/python-api.md publishes them).

    python scripts/hf_attention_peers.py                      # 1k, 4k, 8k; table
    python scripts/hf_attention_peers.py --context 1024 --steps 8 --json

Each context: a prompt of N - steps random ids (seed 0) prefilled in one forward, then
`steps` tokens fed one at a time; the median step in ms, and the bytes the cache holds at
the end (codes, scales, zero points and full-precision tokens: `BridgeCache.bytes_held`,
`caches.peer.layer_bytes` for transformers' layers). float32 weights, one row at a time.
Run it on a quiet machine: it says how busy the others kept the CPUs. Needs SmolLM2
(`-m smollm2`), optimum-quanto and hqq; a missing peer is left out with one line why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# (row name, kvcache spec or transformers' backend, the attention it runs under)
ROWS = (("transformers DynamicCache", "dynamic", "sdpa"),
        ("kvcache int8 · kvcache attention", "int8", "kvcache"),
        ("kvcache int8 · sdpa (dequantised)", "int8", "sdpa"),
        ("kvcache int4 · kvcache attention", "int4:g64:kchan:r128", "kvcache"),
        ("kvcache int4 · sdpa (dequantised)", "int4:g64:kchan:r128", "sdpa"),
        ("transformers QuantizedCache quanto int4", "quanto", "sdpa"),
        ("transformers QuantizedCache hqq int4", "hqq", "sdpa"))


def _cache(model, what: str):
    """A fresh cache for one row: kvcache's kind, or transformers' own (int4, groups of 64,
    a residual of 128: kvcache's int4 row above uses the same)."""
    from transformers import DynamicCache, QuantizedCache

    from kvcache_cli.hf import kv_cache

    if what == "dynamic":
        return DynamicCache(config=model.config)
    if what in ("quanto", "hqq"):
        return QuantizedCache(backend=what, config=model.config, nbits=4, q_group_size=64,
                              residual_length=128)
    return kv_cache(model, what)


def _held(cache) -> int:
    from kvcache_cli.caches.peer import layer_bytes

    held = getattr(cache, "bytes_held", None)
    return held if held is not None else sum(layer_bytes(layer) for layer in cache.layers)


def measure(model, context: int, steps: int, row: tuple[str, str, str]) -> dict:
    name, what, attention = row
    model.set_attn_implementation(attention)
    cache = _cache(model, what)
    ids = torch.randint(0, model.config.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(0))
    prompt = context - steps
    times = []
    with torch.inference_mode():
        model(input_ids=ids[:, :prompt], cache=cache, logits_to_keep=1)
        for p in range(prompt, context):
            began = time.perf_counter()
            model(input_ids=ids[:, p:p + 1], cache=cache, logits_to_keep=1)
            times.append((time.perf_counter() - began) * 1e3)
    return {"row": name, "context": context, "step_ms": statistics.median(times),
            "bytes_held": _held(cache)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="1024,4096,8176",
                        help="tokens at the end of the run, comma separated (SmolLM2 holds 8192)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per row")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    args = parser.parse_args()

    from kvcache_cli.eval.peer_hf import backend_missing
    from kvcache_cli.measure import free_cores, quiet_transformers
    from kvcache_cli.models import load_model, to_hf

    model = to_hf(load_model("smollm2", "pretrained", "cpu", torch.float32).model)
    rows = [r for r in ROWS if r[1] not in ("quanto", "hqq") or not backend_missing(r[1])]
    for r in ROWS:
        if r not in rows:
            print(f"left out: {r[0]}: {backend_missing(r[1])}")
    found = free_cores()
    results = []
    with quiet_transformers():
        for context in (int(c) for c in args.context.split(",")):
            results += [measure(model, context, args.steps, r) for r in rows]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"SmolLM2-135M in transformers, float32 weights, {torch.get_num_threads()} threads"
          + (f", {found[1]:.1f} cores' worth busy elsewhere" if found else ""))
    print(f"{'cache':42} {'context':>8} {'ms/step':>9} {'MiB held':>9}")
    for r in results:
        print(f"{r['row']:42} {r['context']:>8,} {r['step_ms']:>9.1f} "
              f"{r['bytes_held'] / 2**20:>9.2f}")


if __name__ == "__main__":
    main()
