#!/usr/bin/env bash
# kvcache's paged engine beside vLLM's CPU build on one workload, all at once and with 4 in
# flight (issue 42's serving comparison; docs/serving.md, "Against a real server").
#
#   bash scripts/vllm_compare.sh [smollm2|gemma3] [OUT_DIR]
#
# Starts vLLM for the model with scripts/vllm_cpu.sh (1 GiB of KV cache, float32, blocks of
# 32, max model len 2048), runs `kvcache serve --target` twice, writes each run's JSON to
# OUT_DIR/all.json and OUT_DIR/4.json (default OUT_DIR ./vllm-compare-<model>), and stops
# the server it started (also when a run fails). The server's prefix cache is emptied before
# each run: the second would otherwise find the first's prompts computed, where kvcache's
# engine starts empty.
# SmolLM2 runs the chat workload (16 requests through its chat template); Gemma 3, a base
# model with no chat template, the random workload at 16 requests.
#
# Settings (environment): THREADS (kvcache's torch threads, default 2), REQUESTS (default
# 16), SERVE_ARGS (more `kvcache serve` flags, e.g. "--output-len 8:16" for a short check),
# and scripts/vllm_cpu.sh's own (VLLM_PORT, VLLM_KV_GIB, ...; vLLM binds its worker's
# threads itself: on 2 cores one computes and one is reserved for its scheduler, unless
# VLLM_CPU_OMP_THREADS_BIND names the cores).
set -euo pipefail

MODEL=${1:-smollm2}
OUT=${2:-vllm-compare-$MODEL}
THREADS=${THREADS:-2}
REQUESTS=${REQUESTS:-16}
PORT=${VLLM_PORT:-8000}
HERE=$(cd "$(dirname "$0")" && pwd)

case $MODEL in
    smollm2) workload=(--workload chat) ;;
    gemma3) workload=(--workload random) ;;
    *) echo "error: model $MODEL: expected smollm2 or gemma3" >&2; exit 2 ;;
esac
mkdir -p "$OUT"

VLLM_MODEL=$MODEL bash "$HERE/vllm_cpu.sh" start
trap 'bash "$HERE/vllm_cpu.sh" stop' EXIT
for flight in all 4; do
    extra=()
    [[ $flight == all ]] || extra=(--max-concurrency "$flight")
    bash "$HERE/vllm_cpu.sh" reset
    # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
    kvcache serve -m "$MODEL" --device cpu --threads "$THREADS" --engines paged \
        --policy decode-first "${workload[@]}" --requests "$REQUESTS" "${extra[@]}" \
        --target "http://127.0.0.1:$PORT" ${SERVE_ARGS:-} --json >"$OUT/$flight.json"
    echo "wrote $OUT/$flight.json"
done
