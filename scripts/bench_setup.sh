#!/usr/bin/env bash
# Creates (or reuses) the benchmark venv at .venv-bench/ in the repo root and
# installs the llama.cpp peer (llama-cpp-python, built from source) plus
# matplotlib, as pinned in scripts/requirements-bench.txt.
#
# Idempotent: if the venv already imports the pinned llama_cpp and
# matplotlib, it does nothing.
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
LCP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"

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

if [ -x "$VENV/bin/python" ] && check; then
    echo "bench_setup: $VENV already has llama-cpp-python==$LCP_PIN and matplotlib; nothing to do."
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
echo "bench_setup: ready: $VENV/bin/python scripts/bench.py --help"
