#!/usr/bin/env bash
# Serve the embedded SmolLM2 GGUF with llama-cpp-python's OpenAI server and its disk
# prompt cache, configured like kvcellar (same context, same thread count).
#
#   benchmarks/peer/run_llama_cpp.sh PORT [CACHE_DIR]
#
# CACHE_DIR (default ./llama-cache) is the working directory of the server: llama-cpp-python's
# disk cache (diskcache) lives in CACHE_DIR/.cache/llama_cache, so the same dir across
# restarts is a warm disk cache and a new dir a cold one. Used by the bench as
#   kvcellar bench ttft --peer-name llama-cpp-python \
#       --peer-command 'benchmarks/peer/run_llama_cpp.sh {port} {cache_dir}'
# Environment: PEER_VENV (default /work/peer-venv, built by setup_llama_cpp.sh),
# KVCELLAR_PYTHON (a python that has kvcellar, to find the GGUF; default: the repo's .venv),
# PEER_GGUF (another model file), PEER_THREADS (default: all cores), PEER_CTX (default 8192),
# PEER_CACHE_BYTES (disk cache capacity, default 16 GiB), PEER_VERBOSE (true: llama.cpp logs, cache hits).
set -euo pipefail

PORT="${1:?usage: run_llama_cpp.sh PORT [CACHE_DIR]}"
CACHE_DIR="${2:-./llama-cache}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${PEER_VENV:-/work/peer-venv}"
KVPY="${KVCELLAR_PYTHON:-$REPO/.venv/bin/python}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "no llama-cpp-python venv at $VENV: run benchmarks/peer/setup_llama_cpp.sh first" >&2
    exit 2
fi
GGUF="${PEER_GGUF:-$("$KVPY" -c 'from kvcellar.model_source import find_embedded_gguf; print(find_embedded_gguf())')}"
THREADS="${PEER_THREADS:-$(nproc)}"

# The same OpenMP wait policy kvcellar sets for itself (kvcellar/__init__.py): spinning
# OpenMP threads are several times slower whenever another process is busy on 2 cores
# (measured here: 901-token prefill 19.1 s spinning vs 5.8 s passive, with one busy core).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

mkdir -p "$CACHE_DIR"
cd "$CACHE_DIR"
# --interrupt_requests false: by default a new request cancels the one being streamed,
# which would turn concurrent clients into cancelled ones.
exec "$VENV/bin/python" -m llama_cpp.server \
    --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" \
    --n_ctx "${PEER_CTX:-8192}" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --cache true --cache_type disk --cache_size "${PEER_CACHE_BYTES:-17179869184}" \
    --logits_all false --interrupt_requests false --verbose "${PEER_VERBOSE:-false}"
