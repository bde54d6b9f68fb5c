#!/usr/bin/env bash
# Build llama-cpp-python[server] from source into its own venv, outside the repository.
# Idempotent: a venv whose llama_cpp imports (and runs a tiny eval) is left alone.
# Prints the venv path on its last line.
#
#   benchmarks/peer/setup_llama_cpp.sh            # venv at /work/peer-venv (or $PEER_VENV)
#   PEER_VENV=~/peer LLAMA_CPP_PYTHON_VERSION=0.3.16 benchmarks/peer/setup_llama_cpp.sh
#
# The build takes ~12 minutes on 2 cores and runs under `nice -n 19`. Portable x86 flags:
# GGML_NATIVE=OFF with the AVX/AVX2/AVX-512 family switched on explicitly and every AMX
# option off, plus -mno-amx-* in the compiler flags: on VMs whose CPUID advertises AMX that
# the kernel does not enable, an AMX build dies with SIGILL at the first matmul.
set -euo pipefail

VENV="${PEER_VENV:-/work/peer-venv}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
PYTHON="${PEER_PYTHON:-python3}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

check() {
    [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import llama_cpp, llama_cpp.server.settings, uvicorn  # noqa: F401
print(llama_cpp.__version__)
PY
}

if check; then
    echo "llama-cpp-python already built: $("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')" >&2
    echo "$VENV"
    exit 0
fi

[[ -d "$VENV" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip wheel >&2

cmake_args=(
    -DGGML_NATIVE=OFF
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF
    -DLLAMA_CURL=OFF
    "-DCMAKE_C_FLAGS=$NO_AMX"
    "-DCMAKE_CXX_FLAGS=$NO_AMX"
)
# AVX-512 only where the CPU has it (the flags are compile-time; a binary with them
# would SIGILL on an AVX2-only machine).
if grep -qw avx512f /proc/cpuinfo; then
    cmake_args+=(-DGGML_AVX512=ON)
    grep -qw avx512_vnni /proc/cpuinfo && cmake_args+=(-DGGML_AVX512_VNNI=ON)
    grep -qw avx512vbmi /proc/cpuinfo && cmake_args+=(-DGGML_AVX512_VBMI=ON)
    grep -qw avx512_bf16 /proc/cpuinfo && cmake_args+=(-DGGML_AVX512_BF16=ON)
fi

# scikit-build-core shlex-splits CMAKE_ARGS: quote each argument (the flags contain spaces).
CMAKE_ARGS="$(printf '%q ' "${cmake_args[@]}")"
echo "building llama-cpp-python==$VERSION into $VENV (CMAKE_ARGS=$CMAKE_ARGS)" >&2
CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    nice -n 19 "$VENV/bin/pip" install --no-cache-dir --no-binary llama-cpp-python \
    --verbose "llama-cpp-python[server]==$VERSION" >&2

check || { echo "llama-cpp-python installed but does not import" >&2; exit 1; }
echo "$VENV"
