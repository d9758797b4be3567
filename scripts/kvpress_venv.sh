#!/usr/bin/env bash
# kvpress (NVIDIA's KV-cache presses) in a venv of its own, for `kvcache eval --cache kvpress:...`.
#
#   bash scripts/kvpress_venv.sh install   # the venv, kvpress and the transformers it pins
#   bash scripts/kvpress_venv.sh path      # the venv's Python, if it is there
#
# kvpress pins transformers below 5.3 (kvpress 0.5.5, its latest release: transformers>=4.56,<5.3,
# torch>=2.3.1,<3) and kvcache runs a newer one, so kvpress never goes in kvcache's environment:
# `kvcache eval --cache kvpress:...` runs kvcache_cli/eval/kvpress_runner.py with this venv's
# Python, one subprocess per eval, and reads its JSON. torch is pinned to the CPU build first
# and named again beside kvpress, so pip keeps it: kvpress asks only torch>=2.3.1, and an
# unpinned torch would pull a multi-GB CUDA build (.ci/run does the same). With the defaults
# the pins resolve to kvpress 0.5.5, transformers 5.2.0, torch 2.13.0+cpu.
#
# Settings (environment):
#   KVCACHE_KVPRESS_VENV   the venv (default ~/.cache/kvcache/kvpress-venv, under
#                          $KVCACHE_CACHE or $XDG_CACHE_HOME/kvcache where set)
#   KVCACHE_PYTHON         the Python that makes the venv (default python3, 3.10 or newer)
#   KVPRESS_VERSION        the kvpress release (default 0.5.5)
#   KVPRESS_TORCH          the torch release (default 2.13.0)
set -euo pipefail

ROOT=${KVCACHE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcache}
VENV=${KVCACHE_KVPRESS_VENV:-$ROOT/kvpress-venv}
PY=${KVCACHE_PYTHON:-python3}
VERSION=${KVPRESS_VERSION:-0.5.5}
TORCH=${KVPRESS_TORCH:-2.13.0}

install() {
    [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --upgrade pip
    "$VENV/bin/python" -m pip install "torch==$TORCH"
    "$VENV/bin/python" -m pip install "kvpress==$VERSION" "torch==$TORCH"
    "$VENV/bin/python" -c "import kvpress, torch, transformers; print('kvpress', '$VERSION', 'transformers', transformers.__version__, 'torch', torch.__version__)"
    echo "kvpress $VERSION in $VENV"
}

case "${1:-}" in
    install) install ;;
    path)
        [[ -x $VENV/bin/python ]] || { echo "error: no kvpress venv at $VENV: bash scripts/kvpress_venv.sh install" >&2; exit 1; }
        echo "$VENV/bin/python" ;;
    *) echo "usage: bash scripts/kvpress_venv.sh install|path" >&2; exit 2 ;;
esac
