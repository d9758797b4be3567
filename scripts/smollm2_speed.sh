#!/usr/bin/env bash
# Issue 26's speed figures for SmolLM2, in one go (about 10 minutes at 2 threads); run it on
# a quiet machine (every bench reports the other processes' share of the CPUs: keep it ~0%).
#
#   scripts/smollm2_speed.sh [OUTDIR]      (default: smollm2-speed/)
#
# 1. At each matched format, ours eager and compiled (torch.compile on the CPU) against
#    llama.cpp on the same weights in one run: float32 (and transformers' generate()),
#    float16 ↔ F16, int8 ↔ Q8_0, q4 ↔ the file's Q4_1; each non-float32 format also checked
#    against float32 (logits, greedy tokens).
# 2. Transformers' QuantizedCache (quanto int4) in its own LlamaForCausalLM beside our
#    quantised caches, at a 1,024-token prompt.
# 3. Decode-step time from 256 to 8,192 cached tokens: float, int8 and int4 caches beside
#    llama.cpp's f16/q8_0/q4_0 caches, float16 weights (bench --context).
# 4. One step's profile in every weight format (bench --profile).
# summary.txt: tokens/s per mode and the ratios the targets name, from each run.
set -euo pipefail
out=${1:-smollm2-speed}
mkdir -p "$out"
run="kvcache bench -m smollm2 --device cpu --threads 2 --repeats 5 --prompt-len 32 --new-tokens 64"
$run --weights-dtype fp32 --modes static,static-compiled,hf,llama.cpp --json > "$out/fp32.json"
$run --weights-dtype fp16 --modes static,static-compiled,llama.cpp-f16 --json > "$out/fp16.json"
$run --weights-dtype int8 --modes static,static-compiled,llama.cpp-q8_0 --json > "$out/int8.json"
$run --weights-dtype q4 --modes static,static-compiled,llama.cpp-gguf --json > "$out/q4.json"
kvcache bench -m smollm2 --device cpu --threads 2 --repeats 3 --prompt-len 1024 \
  --new-tokens 128 --modes static,hf-quanto --cache int4,int4:ktok:r0,int8,quanto-int4 \
  --json > "$out/quantised-1024.json"
COLUMNS=120 kvcache bench -m smollm2 --device cpu --threads 2 --weights-dtype fp16 \
  --context 256,1024,2048,4096,6144,8176 --cache static,int8,int4 \
  --plot "$out/long_context.png" > "$out/long_context.txt"
profile="kvcache bench -m smollm2 --profile --threads 2 --new-tokens 16"
for format in "" "--dtype fp16" "--dtype bf16" "--weights-dtype int8" "--weights-dtype q4"; do
  $profile $format  # word-split on purpose: one format's options
done > "$out/step_profile.txt"
python - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
tps = {}
for name in ("fp32", "fp16", "int8", "q4", "quantised-1024"):
    r = json.loads((out / f"{name}.json").read_text())
    modes = {m["mode"]: m for m in r["modes"]}
    for mode, m in modes.items():
        share = m.get("mbu")
        print(f"{name:12} {mode:18} {m['tokens_per_s_median']:7.1f} tok/s"
              + (f", {share:.0%} of its limit" if share is not None else "")
              + f"  (others {r['others_cpu_share'] or 0:.1%} of the CPUs)")
    tps[name] = {mode: m["tokens_per_s_median"] for mode, m in modes.items()}
peer = {"fp32": "llama.cpp", "fp16": "llama.cpp-f16", "int8": "llama.cpp-q8_0",
        "q4": "llama.cpp-gguf"}
for name, mode in peer.items():
    for ours in ("static", "static-compiled"):
        print(f"{ours} {name} / {mode}: {tps[name][ours] / tps[name][mode]:.2f} "
              "(target >= 1.0)")
print(f"static / hf (float32): {tps['fp32']['static'] / tps['fp32']['hf']:.2f} (target >= 2)")
for name in ("fp16", "q4"):
    print(f"static {name} / static fp32: {tps[name]['static'] / tps['fp32']['static']:.2f} "
          "(target >= 2 for one of them)")
quant = tps["quantised-1024"]
for mode in ("int4:g32:kchan:r128", "int4:g32:ktok:r0", "int8:g32:ktok:r0", "quanto-int4:g64:r128"):
    print(f"{mode} / hf-quanto at 1,024 cached: {quant[mode] / quant['hf-quanto']:.2f} "
          "(target >= 1.0)")
print(open(out / "long_context.txt").read())
PY
