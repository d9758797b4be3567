"""SmolLM2's eager static decode in each weight format, against float32, in one process.

`bench` runs one weight format a run, so a ratio between formats crosses runs, and on a
shared VM two runs minutes apart drifted by a quarter (fp16 over fp32: 2.23× in one pair
of runs, 1.48× in the next). Here every format is loaded once and the formats take turns,
repeat by repeat, so drift reaches them alike; each figure is the median over repeats of
tokens per second over the decode steps (the prefill excluded).

    python scripts/smollm2_formats.py [--formats fp32,fp16,bf16,int8,q4] [--repeats 5]
        [--threads 2] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.generate import stream_tokens
from kvcache_cli.measure import OtherProcesses
from kvcache_cli.models import load_model, set_weights_dtype


def decode_tokens_per_s(model, prompt: list[int], new_tokens: int) -> float:
    """Decode steps per second of one greedy run with a static cache."""
    cache = make_cache("static", model, max_len=len(prompt) + new_tokens, batch=1)
    tokens = stream_tokens(model, prompt, new_tokens, "static", cache=cache)
    next(tokens)  # the prefill, not timed
    start = time.perf_counter()
    steps = sum(1 for _ in tokens)
    return steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp32,fp16,bf16,int8,q4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_model("smollm2").model
    formats = args.formats.split(",")
    models = {f: set_weights_dtype(copy.deepcopy(base), f) for f in formats}
    prompt = torch.randint(0, base.config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    runs: dict[str, list[float]] = {f: [] for f in formats}
    with torch.inference_mode():
        for f in formats:  # warm-up: first calls allocate and pick kernels
            decode_tokens_per_s(models[f], prompt, 8)
        others = OtherProcesses()
        for _ in range(args.repeats):
            for f in formats:
                runs[f].append(decode_tokens_per_s(models[f], prompt, args.new_tokens))
    share = others.share()
    first = formats[0]
    ref = statistics.median(runs[first])
    print(f"SmolLM2, static cache, eager, {args.threads} threads, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats} interleaved repeats; "
          f"others kept {'?' if share is None else f'{share:.1%}'} of the CPUs")
    for f in formats:
        med = statistics.median(runs[f])
        spread = f"{min(runs[f]):.1f}–{max(runs[f]):.1f}"
        print(f"{f:6} {med:7.1f} tokens/s ({spread})  {med / ref:5.2f}× {first}")


if __name__ == "__main__":
    main()
