"""The figures docs/models.md publishes for SmolLM2, measured on this machine in one run.

    python scripts/smollm2_figures.py            # loads (first and warm) and bytes a token

- first load: `kvcache generate -m smollm2 --ids 1 -n 1` in a fresh process with an empty
  conversion cache (the GGUF parsed, dequantised and converted), median of 3;
- warm load: the same with the converted folder in place, median of 5; each also split
  into the process's imports and `models.load_model` itself;
- bytes a token of every cache kind on SmolLM2 and on GPT-2 small, from the registry's
  formulas, which the tests check against the live caches' `bytes_held`.
Run it on a quiet machine: it says how busy the others kept the CPUs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LOAD = ("import time; t = time.perf_counter(); from kvcache_cli.models import load_model; "
        "import torch; i = time.perf_counter() - t; load_model('smollm2'); "
        "print(i, time.perf_counter() - t - i)")
KINDS = ("static", "int8", "int4", "int4:g32:kchan:r0", "int2", "fp8-e4m3", "window:256",
         "sink:4+252", "h2o:128+128")


def _timed(env: dict) -> tuple[float, float, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return time.perf_counter() - start, float(out[0]), float(out[1])


def loads() -> dict:
    first, warm = [], []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "KVCACHE_CACHE": cache}
            first.append(_timed(env))
            if not warm:
                warm = [_timed(env) for _ in range(5)]
    pick = lambda runs, i: statistics.median(r[i] for r in runs)  # noqa: E731
    return {"first_process_s": pick(first, 0), "first_load_s": pick(first, 2),
            "warm_process_s": pick(warm, 0), "warm_imports_s": pick(warm, 1),
            "warm_load_s": pick(warm, 2)}


def bytes_a_token() -> dict:
    from kvcache_cli.caches.spec import layer_bytes, parse_cache_spec
    from kvcache_cli.models import model_config
    from kvcache_cli.models.gpt2 import PRESETS

    shapes = {"smollm2": model_config("smollm2"), "gpt2": PRESETS["gpt2"]}
    table = {}
    for kind in KINDS:
        spec = parse_cache_spec(kind)
        # at 4,096 positions, so a residual window or a budget is counted at its share
        table[kind] = {name: c.n_layer * layer_bytes(spec, 4096, c.n_kv_head, c.head_size, 4)
                       / 4096 for name, c in shapes.items()}
    return table


if __name__ == "__main__":
    from kvcache_cli.measure import OtherProcesses

    others = OtherProcesses()
    result = {"loads": loads(), "bytes_per_token_fp32": bytes_a_token(),
              "others_cpu_share": others.share(), "cpus": os.cpu_count()}
    print(json.dumps(result, indent=1))
