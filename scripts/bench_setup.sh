#!/usr/bin/env bash
# Creates (or reuses) the benchmark venv at .venv-bench/ in the repo root and
# installs the llama.cpp peer (llama-cpp-python, built from source) plus
# matplotlib, as pinned in scripts/requirements-bench.txt. Then builds the
# native llama.cpp peer of scripts/bench_offload.py: llama-completion from the
# llama.cpp source that the pinned llama-cpp-python sdist vendors
# (vendor/llama.cpp), with the same CPU flags, into bench-out/llama-native/
# (binary: bench-out/llama-native/build/bin/llama-completion).
#
# Idempotent: if the venv already imports the pinned llama_cpp and
# matplotlib, that part does nothing; the native build is skipped when the
# binary exists and is newer than its source (the sdist and its tree).
#
# FIRST RUN IS SLOW: llama.cpp is compiled from source. On the 2-core dev
# machine with one build job (the default, so a concurrent cargo build keeps a
# core) it took 13 min 20 s (measured, with cargo building alongside); with
# BENCH_BUILD_JOBS=2 on an idle machine expect roughly half. Later runs: ~1 s.
# The build log goes to .venv-bench/llama-cpp-build.log.
#
# Env knobs:
#   BENCH_BUILD_JOBS  parallel compile jobs for llama.cpp (default 1)
#   PYTHON            interpreter used to create the venv (default python3)
#   BENCH_VENV        venv dir (default <repo>/.venv-bench)
#   BENCH_NATIVE_JOBS parallel compile jobs for the native llama.cpp (default 2;
#                     ~5 min on the 2-core dev machine)
#   BENCH_SKIP_NATIVE set to 1 to skip the native llama.cpp build
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$REPO/scripts/requirements-bench.txt"
VENV="${BENCH_VENV:-$REPO/.venv-bench}"
PY="${PYTHON:-python3}"
JOBS="${BENCH_BUILD_JOBS:-1}"

LCP_PIN="$(sed -n 's/^llama-cpp-python==\([^[:space:]#]*\).*/\1/p' "$REQ")"
if [ -z "$LCP_PIN" ]; then
    echo "bench_setup: no 'llama-cpp-python==VERSION' pin in $REQ" >&2
    exit 1
fi

# The native build enables AMX on this CPU and dies with SIGILL; build for a
# fixed AVX2/FMA/F16C target instead. LLAVA_BUILD=OFF skips the multimodal
# library (not needed, saves build time).
GGML_CPU_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
LCP_CMAKE_ARGS="$GGML_CPU_ARGS -DLLAVA_BUILD=OFF"

# The native llama.cpp: same source (the sdist's vendor/llama.cpp), same CPU
# flags, static, no curl, only the llama-completion tool (the
# non-conversational command-line tool of this llama.cpp version).
NATIVE_DIR="$REPO/bench-out/llama-native"
NATIVE_JOBS="${BENCH_NATIVE_JOBS:-2}"
NATIVE_BIN="$NATIVE_DIR/build/bin/llama-completion"
NATIVE_CMAKE_ARGS="$GGML_CPU_ARGS -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF"

build_native() {
    if [ "${BENCH_SKIP_NATIVE:-0}" = 1 ]; then
        echo "bench_setup: BENCH_SKIP_NATIVE=1: not building the native llama.cpp"
        return 0
    fi
    local sdist="$REPO/bench-out/llama_cpp_python-$LCP_PIN.tar.gz"
    local src="$NATIVE_DIR/llama_cpp_python-$LCP_PIN/vendor/llama.cpp"
    mkdir -p "$NATIVE_DIR"
    if [ ! -f "$sdist" ]; then
        echo "bench_setup: downloading the llama-cpp-python==$LCP_PIN sdist (it vendors llama.cpp)"
        # --no-binary for this package only: its build dependencies may come as
        # wheels (--no-binary :all: would compile cmake itself to read metadata).
        "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCP_PIN" -d "$REPO/bench-out/"
    fi
    if [ ! -d "$src" ] || [ "$sdist" -nt "$src" ]; then
        echo "bench_setup: unpacking $sdist into $NATIVE_DIR"
        rm -rf "$NATIVE_DIR/llama_cpp_python-$LCP_PIN"
        tar xzf "$sdist" -C "$NATIVE_DIR"
        touch "$src"
    fi
    if [ -x "$NATIVE_BIN" ] && [ "$NATIVE_BIN" -nt "$sdist" ] && [ "$NATIVE_BIN" -nt "$src" ] \
       && [ -z "$(find "$src" -newer "$NATIVE_BIN" -print -quit)" ]; then
        echo "bench_setup: native llama.cpp is up to date: $NATIVE_BIN"
        return 0
    fi
    # cmake and ninja: the venv's if present, else pip-installed into it.
    if [ ! -x "$VENV/bin/cmake" ] || [ ! -x "$VENV/bin/ninja" ]; then
        "$VENV/bin/python" -m pip install --quiet cmake ninja
    fi
    local log="$NATIVE_DIR/build.log"
    echo "bench_setup: building native llama.cpp (llama-completion) with $NATIVE_JOBS job(s) (log: $log)"
    local start end
    start=$(date +%s)
    # shellcheck disable=SC2086  # NATIVE_CMAKE_ARGS is a list of flags
    if ! { PATH="$VENV/bin:$PATH" cmake -S "$src" -B "$NATIVE_DIR/build" -G Ninja $NATIVE_CMAKE_ARGS \
           && PATH="$VENV/bin:$PATH" cmake --build "$NATIVE_DIR/build" --target llama-completion \
                  --parallel "$NATIVE_JOBS"; } >"$log" 2>&1; then
        echo "bench_setup: native llama.cpp build failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    touch "$NATIVE_BIN"  # newer than the source even when ninja had nothing to do
    end=$(date +%s)
    echo "bench_setup: native llama.cpp built in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s: $NATIVE_BIN"
}

check() {
    "$VENV/bin/python" - "$LCP_PIN" <<'PYEOF' 2>/dev/null
import sys
import llama_cpp, matplotlib  # noqa: F401
want = sys.argv[1]
if llama_cpp.__version__ != want:
    print(f"llama_cpp {llama_cpp.__version__} installed, want {want}")
    sys.exit(1)
PYEOF
}

# gguf (pure Python, pinned as in requirements-model.txt): scripts/hf_to_gguf.py
# writes the q4_0 GGUF of the synthetic 7B model for make bench-scale.
install_gguf() {
    "$VENV/bin/python" -m pip install --quiet "gguf==0.19.0"
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "bench_setup: $VENV already has llama-cpp-python==$LCP_PIN and matplotlib; nothing to do there."
    install_gguf
    build_native
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bench_setup: creating venv $VENV"
    "$PY" -m venv "$VENV"
fi

"$VENV/bin/python" -m pip install --quiet --upgrade pip

LOG="$VENV/llama-cpp-build.log"
echo "bench_setup: building llama-cpp-python==$LCP_PIN from source with $JOBS job(s)."
echo "bench_setup: this takes ~13-15 min on 2 cores with 1 job (log: $LOG)"
start=$(date +%s)
# --no-binary: always compile (only an sdist is published, but be explicit);
# --no-cache-dir: never reuse a wheel cached from a build with other flags.
# Build isolation fetches cmake and ninja wheels from PyPI if needed.
if ! CMAKE_ARGS="$LCP_CMAKE_ARGS" \
     CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
     "$VENV/bin/python" -m pip install --verbose --no-cache-dir \
         --no-binary llama-cpp-python -r "$REQ" >"$LOG" 2>&1; then
    echo "bench_setup: pip install failed; last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
fi
end=$(date +%s)
echo "bench_setup: built and installed in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s"

if ! check; then
    echo "bench_setup: installed, but 'import llama_cpp, matplotlib' still fails" >&2
    "$VENV/bin/python" -c 'import llama_cpp, matplotlib'
    exit 1
fi
"$VENV/bin/python" -c 'import llama_cpp; print("bench_setup: llama.cpp system info:", llama_cpp.llama_print_system_info().decode())'
install_gguf
build_native
echo "bench_setup: ready: $VENV/bin/python scripts/bench.py --help"
