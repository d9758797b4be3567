"""Decode-step time against the cached context on SmolLM2, for the float cache and each
quantised cache, beside llama.cpp with its f16, q8_0 and q4_0 caches on the same weights.

    python scripts/long_context.py [--threads 2] [--weights-dtype fp16]
        [--contexts 256,1024,2048,4096,6144,8176] [--steps 8] [--caches static,int8,int4]
        [--no-llama] [--plot docs/long_context.png] [--json]

For each cache the context is filled once per point (ours: every layer's cache written
with seeded random keys and values, which costs no forward; the time of a step does not
depend on what the keys hold), then `--steps` decode steps are timed one by one at that
context and their median reported. llama.cpp is fed the same number of tokens as one
batch (its cache then holds them), with flash attention on (its quantised V cache needs
it), and the same steps timed. The float cache's bytes pass the weights' where
context * bytes a token > weight bytes: with float16 weights (258 MiB) at about 5,870
tokens, which the table and the plot mark. Run it on a quiet machine: it prints how busy
the other processes kept the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.measure import OtherProcesses, weight_bytes
from kvcache_cli.models import load_model, set_weights_dtype
from kvcache_cli.models.smollm2 import smollm2_gguf

LLAMA_CACHES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids for type_k / type_v


def fill(model, cache, start: int, end: int, seed: int) -> None:
    """Positions start .. end - 1 of every layer written with seeded random keys, values."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    for layer in range(c.n_layer):
        k, v = (torch.randn(1, c.n_kv_head, end - start, c.head_size, generator=g)
                .to(model.dtype) for _ in range(2))  # (1, nkv, T, hs)
        cache.update(layer, start, k, v)


@torch.inference_mode()
def ours(model, spec: str, contexts: list[int], steps: int) -> list[dict]:
    cache = make_cache(spec, model, contexts[-1] + steps + 1)  # each point crops back to n
    rows, filled = [], 0
    token = torch.tensor([[1]])
    for n in contexts:
        fill(model, cache, filled, n, seed=n)
        times = []
        for i in range(steps + 1):  # the first step at each point is a warm-up
            start = time.perf_counter()
            model(token, n + i, cache)
            times.append(time.perf_counter() - start)
        cache.crop(n)  # the timed steps forgotten: the next point fills from n
        filled = n
        rows.append({"context": n, "step_ms": statistics.median(times[1:]) * 1e3,
                     "bytes_held": cache.bytes_held})
    return rows


def llama(path: str, kind: str, contexts: list[int], steps: int, threads: int) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=contexts[-1] + steps + 8, n_batch=512,
                n_threads=threads, n_threads_batch=threads, flash_attn=True,
                type_k=LLAMA_CACHES[kind], type_v=LLAMA_CACHES[kind], verbose=False)
    rows, fed = [], 0
    try:
        for n in contexts:
            llm.n_tokens = fed  # forget the timed steps: the next eval writes from here
            llm.eval([1] * (n - fed))
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                llm.eval([1])
                times.append(time.perf_counter() - start)
            fed = n
            rows.append({"context": n, "step_ms": statistics.median(times[1:]) * 1e3})
    finally:
        llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights-dtype", default="fp16")
    # The last point leaves room inside SmolLM2's 8,192 positions for the timed steps.
    ap.add_argument("--contexts", default="256,1024,2048,4096,6144,8176")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--caches", default="static,int8,int4")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    others = OtherProcesses()
    loaded = load_model("smollm2")
    model = set_weights_dtype(loaded.model, args.weights_dtype)
    c = model.config
    if contexts[-1] + args.steps + 1 > c.context:
        raise SystemExit(f"--contexts {args.contexts}: the last point and its {args.steps} "
                         f"steps need {contexts[-1] + args.steps + 1} positions; SmolLM2 has "
                         f"{c.context}")
    w_bytes = weight_bytes(model)
    kv_token = 2 * c.n_layer * c.n_kv_head * c.head_size * 4  # the float32 cache's
    result = {"threads": args.threads, "weights": args.weights_dtype, "weight_bytes": w_bytes,
              "float_cache_bytes_per_token": kv_token, "crossing_tokens": w_bytes / kv_token,
              "ours": {}, "llama.cpp": {}}
    for spec in args.caches.split(","):
        result["ours"][spec] = ours(model, spec, contexts, args.steps)
    if not args.no_llama:
        from kvcache_cli.models.gguf.export import export_gguf
        from kvcache_cli.models.linear import float_state

        fmt = {"fp16": "f16", "fp32": "f32", "int8": "q8_0"}.get(args.weights_dtype)
        path = (str(smollm2_gguf()) if fmt is None else
                str(export_gguf(float_state(load_model("smollm2").model), c, fmt).path))
        result["llama_file"] = path
        for kind in LLAMA_CACHES:
            result["llama.cpp"][kind] = llama(path, kind, contexts, args.steps, args.threads)
    result["others_cpu_share"] = others.share()
    result["cpus"] = os.cpu_count()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result, contexts)
    if args.plot:
        plot(result, args.plot)


def print_table(r: dict, contexts: list[int]) -> None:
    print(f"SmolLM2, {r['weights']} weights ({r['weight_bytes'] / 2**20:.0f} MiB), "
          f"{r['threads']} threads; the float cache outweighs the weights from "
          f"{r['crossing_tokens']:,.0f} tokens; others kept {r['others_cpu_share']:.0%} "
          "of the CPUs")
    series = {**r["ours"], **{f"llama.cpp {k}": v for k, v in r["llama.cpp"].items()}}
    print("ms/step".ljust(16) + "".join(f"{n:>9,}" for n in contexts))
    for name, rows in series.items():
        print(name.ljust(16) + "".join(f"{row['step_ms']:9.1f}" for row in rows))
    base = {row["context"]: row["step_ms"] for row in r["ours"].get("static", [])}
    for name, rows in r["ours"].items():
        if name != "static" and base:
            print(f"{name} / static".ljust(16)
                  + "".join(f"{row['step_ms'] / base[row['context']]:9.2f}" for row in rows))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in r["ours"].items():
        ax.plot([x["context"] for x in rows], [x["step_ms"] for x in rows], "o-", label=name)
    for name, rows in r["llama.cpp"].items():
        ax.plot([x["context"] for x in rows], [x["step_ms"] for x in rows], "s--",
                label=f"llama.cpp {name} cache")
    ax.axvline(r["crossing_tokens"], color="grey", lw=0.8)
    ax.text(r["crossing_tokens"], ax.get_ylim()[1] * 0.95, " float cache > weights",
            color="grey", fontsize=8, va="top")
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"SmolLM2, {r['weights']} weights, {r['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
