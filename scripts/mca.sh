#!/usr/bin/env bash
# make mca: llvm-mca cycles of nflash's aarch64 dot-product kernels against
# llama.cpp's on models of phone cores (scripts/mca.py says how). Installs
# what it needs on a Debian machine when run as root: llvm-19 (the newest
# LLVM Debian 12 ships; it models the Neoverse N1, N2 and V2, relatives of
# the Cortex-A76, A7xx and X cores, which LLVM 14 priced as a Cortex-A57)
# and the aarch64 cross g++. llama.cpp's source is the one the benchmark
# uses (the llama-cpp-python sdist pinned in
# scripts/requirements-bench.txt), downloaded from PyPI into bench-out/ if
# it is not there yet and unpacked into bench-out/mca/.
#
# Usage: scripts/mca.sh [--json FILE]   (after `make android`; `make mca`
# passes --json bench-out/mca.json)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
die() { echo "mca: $*" >&2; exit 1; }

need=()
command -v llvm-mca-19 > /dev/null || need+=(llvm-19)
command -v aarch64-linux-gnu-g++ > /dev/null || need+=(g++-aarch64-linux-gnu)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        echo "mca: installing ${need[*]} (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends "${need[@]}" > /dev/null ||
            { apt-get update > /dev/null && apt-get install -y --no-install-recommends "${need[@]}" > /dev/null; } ||
            die "apt-get could not install ${need[*]}"
    else
        die "missing ${need[*]}: sudo apt-get install ${need[*]}"
    fi
fi
export PATH="/usr/lib/llvm-19/bin:$PATH"

PIN=$(sed -n 's/^llama-cpp-python==\([^[:space:]#]*\).*/\1/p' scripts/requirements-bench.txt)
[ -n "$PIN" ] || die "no llama-cpp-python pin in scripts/requirements-bench.txt"
SDIST=bench-out/llama_cpp_python-$PIN.tar.gz
SRC=bench-out/mca/llama_cpp_python-$PIN/vendor/llama.cpp
if [ ! -f "$SRC/ggml/src/ggml-cpu/arch/arm/quants.c" ]; then
    if [ ! -f "$SDIST" ]; then
        echo "mca: downloading the llama-cpp-python $PIN sdist (it vendors llama.cpp)"
        mkdir -p bench-out
        python3 - "$PIN" "$SDIST" << 'EOF' || die "could not download the sdist from PyPI"
import json, os, sys, urllib.request
pin, out = sys.argv[1], sys.argv[2]
meta = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-python/{pin}/json", timeout=60))
url = next(u["url"] for u in meta["urls"] if u["packagetype"] == "sdist")
urllib.request.urlretrieve(url, out + ".part")
os.replace(out + ".part", out)
EOF
    fi
    # Unpacked beside, then renamed: an interrupted tar leaves no half tree.
    rm -rf bench-out/mca.tmp && mkdir -p bench-out/mca.tmp bench-out/mca
    tar -xzf "$SDIST" -C bench-out/mca.tmp "llama_cpp_python-$PIN/vendor/llama.cpp/ggml" ||
        die "could not unpack $SDIST (delete it to download it again)"
    rm -rf "bench-out/mca/llama_cpp_python-$PIN"
    mv "bench-out/mca.tmp/llama_cpp_python-$PIN" bench-out/mca/
    rmdir bench-out/mca.tmp
fi
python3 scripts/mca.py --llama-src "$SRC" "$@"
