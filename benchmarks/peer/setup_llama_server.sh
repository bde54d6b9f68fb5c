#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp tree vendored in the
# llama-cpp-python sdist on PyPI (offline apart from that one download), outside the repository.
# Idempotent: a built binary that runs `--version` is left alone.
# Prints the binary path on its last line.
#
#   benchmarks/peer/setup_llama_server.sh             # work folder /work/llama-server
#   LLAMA_SERVER_DIR=~/ls LLAMA_CPP_PYTHON_VERSION=0.3.36 benchmarks/peer/setup_llama_server.sh
#
# Environment: LLAMA_SERVER_DIR (work folder, default /work/llama-server),
# LLAMA_CPP_PYTHON_VERSION (sdist version; default: the newest), PIP (a pip to download with;
# default: the repo's .venv pip, else pip3), LLAMA_SERVER_JOBS (build jobs, default nproc).
#
# The build takes ~11 minutes on 2 cores and runs under `nice -n 19`. GGML_NATIVE=ON with every
# AMX option off, plus -mno-amx-* in the compiler flags: on VMs whose CPUID advertises AMX that
# the kernel does not enable, -march=native would compile the AMX kernels in and the server
# dies with SIGILL at the first matmul (see setup_llama_cpp.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="${LLAMA_SERVER_DIR:-/work/llama-server}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"
JOBS="${LLAMA_SERVER_JOBS:-$(nproc)}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ -n "${PIP:-}" ]]; then
    read -r -a pip_cmd <<<"$PIP"
elif [[ -x "$REPO/.venv/bin/pip" ]]; then
    pip_cmd=("$REPO/.venv/bin/pip")
elif [[ -x "$REPO/.venv/bin/python" ]] && "$REPO/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
    pip_cmd=("$REPO/.venv/bin/python" -m pip)
else
    pip_cmd=(pip3)
fi

case "$WORK" in
    "$REPO"|"$REPO"/*) echo "LLAMA_SERVER_DIR must be outside the repository ($REPO)" >&2; exit 2 ;;
esac

mkdir -p "$WORK"
BIN="$WORK/bin/llama-server"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    echo "llama-server already built: $("$BIN" --version 2>&1 | grep -m1 -i version || true)" >&2
    echo "$BIN"
    exit 0
fi

cd "$WORK"
sdist="$(ls -1 llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -n1 || true)"
if [[ -n "$VERSION" ]]; then
    sdist="llama_cpp_python-$VERSION.tar.gz"
    [[ -f "$sdist" ]] || "${pip_cmd[@]}" download --no-deps --no-binary :all: \
        --dest "$WORK" "llama-cpp-python==$VERSION" >&2
elif [[ -z "$sdist" ]]; then
    "${pip_cmd[@]}" download --no-deps --no-binary :all: --dest "$WORK" llama-cpp-python >&2
    sdist="$(ls -1 llama_cpp_python-*.tar.gz | sort -V | tail -n1)"
fi
src="${sdist%.tar.gz}"
[[ -d "$src/vendor/llama.cpp" ]] || tar xzf "$sdist"
cd "$src/vendor/llama.cpp"
echo "building llama-server from $WORK/$src/vendor/llama.cpp" >&2

nice -n 19 cmake -B build \
    -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF \
    "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
    -DCMAKE_BUILD_TYPE=Release >&2
nice -n 19 cmake --build build --target llama-server -j "$JOBS" >&2

mkdir -p "$WORK/bin"
cp -f build/bin/llama-server "$BIN"
if ! "$BIN" --version >&2; then
    echo "llama-server built but does not run --version" >&2
    exit 1
fi
echo "$BIN"
