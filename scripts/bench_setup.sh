#!/usr/bin/env bash
# Sets up the llama.cpp peer of the benchmarks, built as its users build it.
#
#  1. The bench venv at .venv-bench/ (matplotlib, gguf, cmake, ninja, and the
#     Python bindings of llama-cpp-python, pinned in
#     scripts/requirements-bench.txt, installed without their own library:
#     LLAMA_BUILD=OFF).
#  2. llama.cpp from the source that the pinned llama-cpp-python sdist vendors
#     (vendor/llama.cpp), compiled with CMake twice, each into its own
#     directory with libllama.so, llama-completion, and llama-quantize and
#     llama-tokenize (the GGUF tests: tests/tests/gguf.rs,
#     scripts/make_gguf_fixtures.py, scripts/tokenize_fixture.py) in build/bin/:
#       bench-out/llama-native/  -DGGML_NATIVE=ON (-march=native, what a plain
#                                `pip install llama-cpp-python` or `cmake -B
#                                build` gives), minus every extension that
#                                faults on this machine: scripts/cpu_probe.c
#                                runs one instruction of each extension
#                                -march=native enables, and each one that dies
#                                (e.g. AMX that CPUID lists but the kernel does
#                                not enable) gets -mno-<ext>;
#       bench-out/llama-avx2/    -DGGML_NATIVE=OFF, AVX2/FMA/F16C only: the
#                                portable x86-64-v3 build, as nflash's own
#                                binaries are. Built only when the native build
#                                enables more than that (else it is the same).
#     The benchmarks load a build's libllama.so into the bindings with
#     LLAMA_CPP_LIB_PATH (scripts/nflash_bench/worker.py) and run its
#     llama-completion directly.
#  3. bench-out/llama-builds.json: per build, its directory, CMake flags, and
#     the probe's findings, for the benchmarks' reports.
#
# Idempotent: a build is skipped when its binary is newer than its source and
# was made with the same flags (bench-out/llama-NAME/flags).
#
# FIRST RUN IS SLOW: each llama.cpp build takes ~4 min on 2 cores with 2
# jobs. Build logs: bench-out/llama-NAME/build.log.
#
# Env knobs:
#   BENCH_BUILD_JOBS  parallel compile jobs for llama.cpp (default 2)
#   PYTHON            interpreter used to create the venv (default python3)
#   BENCH_VENV        venv dir (default <repo>/.venv-bench)
#   BENCH_SKIP_AVX2   set to 1 to build only the native llama.cpp
#   BENCH_LOOKUP      set to 1 to build llama.cpp's prompt-lookup example too
#                     (bench-out/llama-lookup/build/bin/llama-lookup: the
#                     native build's flags with LLAMA_BUILD_EXAMPLES=ON; the
#                     peer of `make bench-speculate`)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$REPO/scripts/requirements-bench.txt"
VENV="${BENCH_VENV:-$REPO/.venv-bench}"
PY="${PYTHON:-python3}"
JOBS="${BENCH_BUILD_JOBS:-2}"
OUT="$REPO/bench-out"

LCP_PIN="$(sed -n 's/^llama-cpp-python==\([^[:space:]#]*\).*/\1/p' "$REQ")"
if [ -z "$LCP_PIN" ]; then
    echo "bench_setup: no 'llama-cpp-python==VERSION' pin in $REQ" >&2
    exit 1
fi
SDIST="$OUT/llama_cpp_python-$LCP_PIN.tar.gz"
SRC_ROOT="$OUT/llama-src"
SRC="$SRC_ROOT/llama_cpp_python-$LCP_PIN/vendor/llama.cpp"

# Flags common to both builds: shared libraries (libllama.so for the Python
# bindings), no curl, only the libraries and llama-completion (the
# non-conversational command-line tool of this llama.cpp version).
COMMON_CMAKE_ARGS="-DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF"
AVX2_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# The extensions that the AVX2 build has too: a native build that enables
# nothing beyond these is the same build.
AVX2_EXTS=" avx avx2 fma f16c bmi2 "

setup_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "bench_setup: creating venv $VENV"
        "$PY" -m venv "$VENV"
    fi
    if "$VENV/bin/python" - "$LCP_PIN" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
import matplotlib, gguf  # noqa: F401
assert version("llama_cpp_python") == sys.argv[1]
assert version("gguf") == "0.19.0"
PYEOF
        [ -x "$VENV/bin/cmake" ] && [ -x "$VENV/bin/ninja" ] && return 0
    fi
    echo "bench_setup: installing llama-cpp-python==$LCP_PIN (bindings only), matplotlib, gguf, cmake, ninja"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet cmake ninja "gguf==0.19.0"
    # LLAMA_BUILD=OFF: the bindings without a library of their own; the
    # benchmarks point them at a build below. --no-binary: from the sdist,
    # the same file whose vendored llama.cpp is compiled below.
    if ! CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VENV/bin/python" -m pip install \
         --no-cache-dir --no-binary llama-cpp-python -r "$REQ" >"$OUT/pip-install.log" 2>&1; then
        echo "bench_setup: pip install failed; last lines of $OUT/pip-install.log:" >&2
        tail -n 40 "$OUT/pip-install.log" >&2
        exit 1
    fi
}

unpack_source() {
    if [ ! -f "$SDIST" ]; then
        echo "bench_setup: downloading the llama-cpp-python==$LCP_PIN sdist (it vendors llama.cpp)"
        # --no-binary for this package only: its build dependencies may come as
        # wheels (--no-binary :all: would compile cmake itself to read metadata).
        "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCP_PIN" -d "$OUT/"
    fi
    if [ ! -d "$SRC" ] || [ "$SDIST" -nt "$SRC" ]; then
        echo "bench_setup: unpacking $SDIST into $SRC_ROOT"
        rm -rf "$SRC_ROOT"
        mkdir -p "$SRC_ROOT"
        tar xzf "$SDIST" -C "$SRC_ROOT"
        touch "$SRC"
    fi
}

# Sets NATIVE_NO_FLAGS (-mno-<ext> for each faulting extension), NATIVE_EXTS
# (the extensions -march=native enables that run) and FAULTS (lines of
# "<ext> faults (why)"), from scripts/cpu_probe.c built with the C compiler
# CMake will use.
probe_cpu() {
    local cc="${CC:-cc}" probe="$OUT/cpu_probe"
    if ! "$cc" -O1 -march=native -o "$probe" "$REPO/scripts/cpu_probe.c" 2>"$OUT/cpu_probe.log"; then
        echo "bench_setup: cannot compile scripts/cpu_probe.c with $cc -march=native:" >&2
        cat "$OUT/cpu_probe.log" >&2
        exit 1
    fi
    local out
    out="$("$probe")"
    NATIVE_NO_FLAGS="$(awk '$2 == "faults" { printf "-mno-%s ", $1 }' <<<"$out")"
    NATIVE_NO_FLAGS="${NATIVE_NO_FLAGS% }"
    NATIVE_EXTS="$(awk '$2 == "ok" { printf "%s ", $1 }' <<<"$out")"
    FAULTS="$(grep ' faults' <<<"$out" || true)"
    if [ -n "$FAULTS" ]; then
        echo "bench_setup: these extensions that -march=native enables fault here; the native build turns them off:"
        sed 's/^/  /' <<<"$FAULTS"
    else
        echo "bench_setup: every extension that -march=native enables runs here: ${NATIVE_EXTS% }"
    fi
}

# build NAME "CMAKE ARGS": bench-out/llama-NAME/build/bin/{libllama.so,llama-completion}
build() {
    local name="$1" args="$2" dir="$OUT/llama-$1"
    local bin="$dir/build/bin/llama-completion" log="$dir/build.log"
    mkdir -p "$dir"
    if [ -x "$bin" ] && [ -f "$dir/build/bin/libllama.so" ] && [ "$bin" -nt "$SRC" ] \
       && [ -x "$dir/build/bin/llama-quantize" ] && [ -x "$dir/build/bin/llama-tokenize" ] \
       && [ "$(cat "$dir/flags" 2>/dev/null)" = "$args" ] \
       && [ -z "$(find "$SRC" -newer "$bin" -print -quit)" ]; then
        echo "bench_setup: llama.cpp ($name) is up to date: $bin"
        return 0
    fi
    rm -rf "$dir/build"
    echo "bench_setup: building llama.cpp ($name) with $JOBS job(s) (log: $log)"
    echo "bench_setup:   cmake $args"
    local start end
    start=$(date +%s)
    # shellcheck disable=SC2086  # args is a list of flags
    if ! { PATH="$VENV/bin:$PATH" eval cmake -S "\"$SRC\"" -B "\"$dir/build\"" -G Ninja $args \
           && PATH="$VENV/bin:$PATH" cmake --build "$dir/build" --target llama llama-completion llama-quantize llama-tokenize \
                  --parallel "$JOBS"; } >"$log" 2>&1; then
        echo "bench_setup: llama.cpp ($name) build failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    touch "$bin"  # newer than the source even when ninja had nothing to do
    printf '%s' "$args" >"$dir/flags"
    end=$(date +%s)
    echo "bench_setup: llama.cpp ($name) built in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s: $bin"
}

mkdir -p "$OUT"
setup_venv
unpack_source
probe_cpu

NATIVE_ARGS="-DGGML_NATIVE=ON $COMMON_CMAKE_ARGS"
if [ -n "$NATIVE_NO_FLAGS" ]; then
    NATIVE_ARGS="$NATIVE_ARGS '-DCMAKE_C_FLAGS=$NATIVE_NO_FLAGS' '-DCMAKE_CXX_FLAGS=$NATIVE_NO_FLAGS'"
fi
build native "$NATIVE_ARGS"

# llama.cpp's own prompt-lookup decoding (examples/lookup), natively built.
build_lookup() {
    local dir="$OUT/llama-lookup" args="${NATIVE_ARGS/-DLLAMA_BUILD_EXAMPLES=OFF/-DLLAMA_BUILD_EXAMPLES=ON}"
    local bin="$dir/build/bin/llama-lookup" log="$dir/build.log"
    mkdir -p "$dir"
    if [ -x "$bin" ] && [ "$(cat "$dir/flags" 2>/dev/null)" = "$args" ] \
       && [ -z "$(find "$SRC" -newer "$bin" -print -quit)" ]; then
        echo "bench_setup: llama-lookup is up to date: $bin"
        return 0
    fi
    rm -rf "$dir/build"
    echo "bench_setup: building llama-lookup with $JOBS job(s) (log: $log)"
    # shellcheck disable=SC2086  # args is a list of flags
    if ! { PATH="$VENV/bin:$PATH" eval cmake -S "\"$SRC\"" -B "\"$dir/build\"" -G Ninja $args \
           && PATH="$VENV/bin:$PATH" cmake --build "$dir/build" --target llama-lookup --parallel "$JOBS"; } >"$log" 2>&1; then
        echo "bench_setup: llama-lookup build failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    touch "$bin"
    printf '%s' "$args" >"$dir/flags"
    echo "bench_setup: llama-lookup built: $bin"
}
if [ "${BENCH_LOOKUP:-0}" = 1 ]; then
    build_lookup
fi

BEYOND_AVX2=""
for e in $NATIVE_EXTS; do
    case "$AVX2_EXTS" in *" $e "*) ;; *) BEYOND_AVX2="$BEYOND_AVX2 $e" ;; esac
done
AVX2_BUILT=false
if [ -z "$BEYOND_AVX2" ]; then
    echo "bench_setup: the native build enables nothing beyond AVX2/FMA/F16C/BMI2 here: no separate AVX2 build"
    rm -rf "$OUT/llama-avx2"
elif [ "${BENCH_SKIP_AVX2:-0}" = 1 ]; then
    echo "bench_setup: BENCH_SKIP_AVX2=1: not building the AVX2 llama.cpp"
else
    build avx2 "$AVX2_CMAKE_ARGS $COMMON_CMAKE_ARGS"
    AVX2_BUILT=true
fi

# What the benchmarks report about the peer.
"$VENV/bin/python" - "$OUT" "$NATIVE_ARGS" "$NATIVE_EXTS" "$FAULTS" "$BEYOND_AVX2" \
    "$AVX2_BUILT" "$AVX2_CMAKE_ARGS $COMMON_CMAKE_ARGS" "$LCP_PIN" <<'PYEOF'
import json, os, sys
out, native_args, exts, faults, beyond, avx2_built, avx2_args, pin = sys.argv[1:]
builds = {"native": {"dir": f"{out}/llama-native/build", "cmake_args": native_args,
                     "extensions": exts.split(),
                     "faulting_extensions_turned_off": [l for l in faults.splitlines() if l]}}
if avx2_built == "true":
    builds["avx2"] = {"dir": f"{out}/llama-avx2/build", "cmake_args": avx2_args,
                      "extensions": ["avx", "avx2", "fma", "f16c", "bmi2"]}
info = {"llama_cpp_python": pin, "source": "vendor/llama.cpp of the llama-cpp-python sdist",
        "native_beyond_avx2": beyond.split(), "builds": builds}
tmp = f"{out}/llama-builds.json.tmp"
with open(tmp, "w") as f:
    json.dump(info, f, indent=1)
os.replace(tmp, f"{out}/llama-builds.json")
PYEOF
for b in native avx2; do
    [ -f "$OUT/llama-$b/build/bin/libllama.so" ] || continue
    LLAMA_CPP_LIB_PATH="$OUT/llama-$b/build/bin" "$VENV/bin/python" -c \
        "import llama_cpp as L; print('bench_setup: llama.cpp ($b):', L.llama_print_system_info().decode())"
done
echo "bench_setup: ready: $VENV/bin/python scripts/bench.py --help"
