#!/usr/bin/env bash
# Serve the embedded SmolLM2 GGUF (the very file kvcellar serves) with llama.cpp's own
# `llama-server`, built by setup_llama_server.sh: one slot holding a Claude-Code-sized prompt.
#
#   benchmarks/peer/run_llama_server.sh PORT
#
# It serves /v1/messages (+ count_tokens), /v1/responses and /v1/chat/completions. Its prompt
# cache lives in RAM (the slot, and --cache-ram); nothing survives a restart.
# Used by benchmarks/bench_agent_replay.py (--peer-bin), or by hand.
# Environment: LLAMA_SERVER_BIN (default $LLAMA_SERVER_DIR/bin/llama-server,
# LLAMA_SERVER_DIR default /work/llama-server), KVCELLAR_PYTHON (a python that has kvcellar, to
# find the GGUF; default: the repo's .venv), PEER_GGUF (another model file), PEER_THREADS
# (default: all cores), PEER_CTX (default 32768), PEER_CTX_OVERRIDE (default: the GGUF key
# llama.context_length set to PEER_CTX; `none` to leave it), PEER_EXTRA_ARGS (more flags, word-split).
#
# llama-server caps a slot at the model's trained context (SmolLM2: 8192) whatever -c says; the
# override raises that cap, as kvcellar's --max-model-len 32768 does (RoPE untouched in both).
set -euo pipefail

PORT="${1:?usage: run_llama_server.sh PORT}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BIN="${LLAMA_SERVER_BIN:-${LLAMA_SERVER_DIR:-/work/llama-server}/bin/llama-server}"
KVPY="${KVCELLAR_PYTHON:-$REPO/.venv/bin/python}"

if [[ ! -x "$BIN" ]]; then
    echo "no llama-server at $BIN: run benchmarks/peer/setup_llama_server.sh first" >&2
    exit 2
fi
GGUF="${PEER_GGUF:-$("$KVPY" -c 'from kvcellar.model_source import find_embedded_gguf; print(find_embedded_gguf())')}"
THREADS="${PEER_THREADS:-$(nproc)}"
CTX="${PEER_CTX:-32768}"
read -r -a extra <<<"${PEER_EXTRA_ARGS:-}"
OVERRIDE="${PEER_CTX_OVERRIDE:-llama.context_length=int:$CTX}"
[[ "$OVERRIDE" == none ]] || extra+=(--override-kv "$OVERRIDE")

# -np 1: one slot of the whole context (a 20k-token prompt must fit one slot);
# --cache-reuse 256: reuse cached chunks of >= 256 tokens after a shifted prefix.
exec "$BIN" -m "$GGUF" --alias SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" \
    -c "$CTX" -np 1 -t "$THREADS" \
    --cache-reuse 256 --no-webui "${extra[@]}"
