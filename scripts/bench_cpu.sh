#!/usr/bin/env bash
# The CPU figures docs/bench.md publishes, in one go; run it on a quiet machine (the bench
# reports other processes' share of the CPUs in every run: keep it near 0%).
#
#   scripts/bench_cpu.sh [OUTDIR]      (default: bench-cpu/)
#
# 1. `kvcache bench` with its defaults, 3 times: its output, plot and wall time.
# 2. The targets' run (256 new tokens, every mode, --compile), 3 times, as JSON.
# summary.txt: the default's median wall time, and per target run the ratios the
# targets name, from that one run.
set -euo pipefail
out=${1:-bench-cpu}
mkdir -p "$out"
for i in 1 2 3; do
  /usr/bin/time -f "%e" -o "$out/default-$i.wall" \
    kvcache bench --device cpu --threads 2 --weights random --plot "$out/default-$i.png" \
    > "$out/default-$i.txt"
done
for i in 1 2 3; do
  kvcache bench --device cpu --threads 2 --weights random --new-tokens 256 --compile \
    --json > "$out/targets-$i.json"
done
python - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
walls = sorted(float((out / f"default-{i}.wall").read_text()) for i in (1, 2, 3))
print(f"default run: median {statistics.median(walls):.0f} s wall of {walls} (target <= 75 s)")
for i in (1, 2, 3):
    r = json.loads((out / f"targets-{i}.json").read_text())
    tps = {m["mode"]: m["tokens_per_s_median"] for m in r["modes"]}
    mode = {m["mode"]: m for m in r["modes"]}
    print(f"run {i}: others {r['others_cpu_share']:.0%}; limit {r['limit_gbps']:.1f} GB/s "
          f"({r['limit_probe']}), ceiling {r['ceiling_tokens_per_s']:.1f} tokens/s; "
          f"tokens agree: {r['tokens_agree']}")
    print(f"  static/hf {tps['static'] / tps['hf']:.2f} (>= 2.0)  "
          f"static/hf-static {tps['static'] / tps['hf-static']:.2f} (>= 1.3)  "
          f"compiled static/hf-static "
          f"{tps['static-compiled'] / tps['hf-static-compiled']:.2f} (>= 1.0)")
    print(f"  static MBU {mode['static']['mbu']:.0%} (>= 70%)  "
          f"static/naive {tps['static'] / tps['naive']:.1f} (>= 5)  "
          f"concat/naive {tps['concat'] / tps['naive']:.1f}  "
          f"static/concat {tps['static'] / tps['concat']:.2f}")
    print("  tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in tps.items())
          + "; compile s: " + ", ".join(f"{m['mode']} {m['compile_s']:.0f}"
                                        for m in r["modes"] if m["compile_s"] is not None))
PY
