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
# LLAMA_CPP_PYTHON_VERSION (sdist version; default: the newest), LLAMA_SERVER_AMX (auto|on|off), PIP (a pip to download with;
# default: the repo's .venv pip, else pip3), LLAMA_SERVER_JOBS (build jobs, default nproc).
#
# The build takes ~11 minutes on 2 cores and runs under `nice -n 19`. GGML_NATIVE=ON. AMX is built
# in only where a probe runs an AMX tile instruction here (LLAMA_SERVER_AMX=auto, the default;
# on|off force it): on VMs whose CPUID advertises AMX that the kernel does not enable,
# -march=native would compile the AMX kernels in and the server dies with SIGILL at the first
# matmul (see setup_llama_cpp.sh), while where AMX works a user's own build has it.
# Several builds side by side: LLAMA_SERVER_DIR=/work/llama-server-amx LLAMA_SERVER_AMX=on ...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="${LLAMA_SERVER_DIR:-/work/llama-server}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"
JOBS="${LLAMA_SERVER_JOBS:-$(nproc)}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
AMX="${LLAMA_SERVER_AMX:-auto}"
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

amx_runs() {
    # Asks the kernel for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and runs one tile op.
    local probe ok=1
    probe="$(mktemp -d)"
    cat >"$probe/amx.c" <<'EOF'
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    /* palette 1, tile 0: 16 rows of 64 bytes; static so the compiler cannot drop the stores */
    static const uint8_t cfg[64] __attribute__((aligned(64))) = {[0] = 1, [16] = 64, [48] = 16};
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
    if gcc -O2 -mamx-tile "$probe/amx.c" -o "$probe/amx" 2>/dev/null && "$probe/amx" 2>/dev/null; then ok=0; fi
    rm -rf "$probe"
    return $ok
}
amx_flags=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
if [[ "$AMX" == on ]] || { [[ "$AMX" == auto ]] && amx_runs; }; then
    # GCC 12's dead-store pass drops the stores that fill ggml's tile configuration (a struct on
    # the stack that only ldtilecfg reads), and the server dies with SIGILL at its first tile
    # instruction (the SIGILL this script once blamed on the OS); -fno-dse keeps them.
    amx_flags=("-DCMAKE_C_FLAGS=-fno-dse" "-DCMAKE_CXX_FLAGS=-fno-dse")
    echo "AMX runs here: built in" >&2
fi
echo "building llama-server from $WORK/$src/vendor/llama.cpp" >&2

nice -n 19 cmake -B build \
    -DGGML_NATIVE=ON \
    "${amx_flags[@]}" \
    -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_BUILD_TYPE=Release >&2
nice -n 19 cmake --build build --target llama-server -j "$JOBS" >&2

mkdir -p "$WORK/bin"
cp -f build/bin/llama-server "$BIN"
if ! "$BIN" --version >&2; then
    echo "llama-server built but does not run --version" >&2
    exit 1
fi
echo "$BIN"
