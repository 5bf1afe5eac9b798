#!/usr/bin/env bash
# make test-aarch64: the phone build, tested under qemu-user on three CPU
# models: cortex-a53 (NEON only), cortex-a76 (+ dotprod), max (+ i8mm).
# For each: the runtime's kernel, alignment and model-op unit tests (the
# last hold RoPE to values that do not depend on the C library), the demo prompt
# on the q8_0 SmolLM2 pack (the answer must name Paris, and --stats-json
# must name the kernels used), and a tiny synthetic sparse pack that must
# give the same greedy tokens under a memory budget that reads clusters
# from the file as with no budget; and SmolLM2's q4_0 and q8_0 perplexity,
# which must be within 0.1% of the x86 build's (so far it is the same to
# the last digit); and tiny random Gemma 3 and Phi-3 packs (sliding-window
# and global layers, GELU-tanh, (1 + w) norms; fused projections, partial
# RoPE, LongRoPE), whose perplexity must be within 0.1% of the x86 build's
# too. Then the libnflash C example, built for aarch64.
#
# Usage: scripts/test_aarch64.sh DEMO_PACK   (the Makefile passes it)
# QEMU_CPUS overrides the CPU list, e.g. QEMU_CPUS=max.
set -euo pipefail

TARGET=aarch64-unknown-linux-musl
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DEMO_PACK=${1:?usage: test_aarch64.sh DEMO_PACK}
BIN=target/$TARGET/release/nflash
PREP=target/release/prep
CPUS=${QEMU_CPUS:-cortex-a53 cortex-a76 max}

die() { echo "test-aarch64: FAIL: $*" >&2; exit 1; }
say() { echo "test-aarch64: $*"; }

if ! command -v qemu-aarch64 > /dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        say "installing qemu-user (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends qemu-user > /dev/null ||
            { apt-get update > /dev/null && apt-get install -y --no-install-recommends qemu-user > /dev/null; } ||
            die "apt-get could not install qemu-user"
    else
        die "qemu-aarch64 not found: sudo apt-get install qemu-user"
    fi
fi
[ -x "$PREP" ] || die "no $PREP: run 'make build' first"
[ -f "$DEMO_PACK" ] || die "no demo pack $DEMO_PACK: run 'make demo' first"

start=$(date +%s)
bash scripts/android.sh build
file_out=$(file -b "$BIN" 2>/dev/null || true)
case "$file_out" in
*aarch64*statically\ linked* | *ARM\ aarch64*static*) ;;
"") ;; # no `file` command
*) die "$BIN is not a static aarch64 executable: $file_out" ;;
esac

# The unit tests of the runtime library for aarch64, run by qemu (the
# target's runner, .cargo/config.toml): the kernels against the portable
# reference, and the alignment checks.
cargo test --release -p nflash-runtime --lib --target "$TARGET" --no-run

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A tiny synthetic ReLU model (SmolLM2's tokenizer), its sparse q8_0 pack
# with 1 KiB clusters, calibrated on text from this repository.
cat README.md docs/*.md > "$work/calib.txt"
"$PREP" synth --shape tiny --out "$work/tiny" --tokenizer models/SmolLM2-135M-Instruct --dtype f32 > "$work/synth.log" 2>&1 ||
    { cat "$work/synth.log"; die "prep synth failed"; }
"$PREP" convert --model "$work/tiny" --out "$work/tiny.nflash" --quant q8_0 --cluster-bytes 1KiB \
    --calib "$work/calib.txt" --tokens 4000 --window 200 > "$work/convert.log" 2>&1 ||
    { cat "$work/convert.log"; die "prep convert of the tiny model failed"; }

# Runs the aarch64 nflash under qemu with CPU model $1; the rest are its arguments.
q() {
    local cpu=$1
    shift
    QEMU_CPU=$cpu qemu-aarch64 "$BIN" "$@"
}

# The kernel set each CPU model must pick (nflash_runtime::kernels::isa):
# NEON alone on the Cortex-A53, sdot where there is dotprod, and the smmla
# prefill GEMM where there is i8mm too (`max`).
expect_kernels() {
    case "$1" in
    cortex-a53 | cortex-a57 | cortex-a72 | cortex-a73) echo neon ;;
    max) echo i8mm ;;
    *) echo dotprod ;;
    esac
}

# Perplexity text: the WikiText-2 test text where it is (CI has ../shared),
# else this repository's docs. PPL_TOKENS tokens in one window, whose
# prompt goes through prefill's GEMMs (batches of 8 or more tokens take
# the 4-row sdot and the smmla kernels). Under qemu a run costs about 9 s
# plus 0.5 s per token, so 2 000 tokens on three CPU models would not fit
# the 15-minute budget of this target; 64 tokens take about 40 s.
PPL_TOKENS=${PPL_TOKENS:-64}
PPL_TEXT=../shared/data/wikitext2-test.txt
[ -f "$PPL_TEXT" ] || PPL_TEXT=docs/DESIGN.md
# Q4_0 on every CPU model (its prefill GEMM differs on each: NEON rows,
# sdot, smmla); Q8_0 where its kernels differ (its prefill has no i8mm path).
ppl_quants() {
    case "$1" in
    max) echo q4_0 ;;
    *) echo "q4_0 q8_0" ;;
    esac
}
ppl_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["perplexity"])' "$1"; }
# The q8_0 pack is the demo's; a q4_0 one is converted from the same checkpoint.
MODEL_DIR=$(dirname "$DEMO_PACK")/SmolLM2-135M-Instruct
"$PREP" convert --model "$MODEL_DIR" --out "$work/smollm2-q4_0.nflash" --quant q4_0 > "$work/convert-q4.log" 2>&1 ||
    { cat "$work/convert-q4.log"; die "prep convert of $MODEL_DIR to q4_0 failed"; }
pack_of() { if [ "$1" = q8_0 ]; then echo "$DEMO_PACK"; else echo "$work/smollm2-$1.nflash"; fi; }
declare -A X86_PPL
for quant in q4_0 q8_0; do
    pack=$(pack_of $quant)
    target/release/nflash ppl --model "$pack" --file "$PPL_TEXT" --max-tokens "$PPL_TOKENS" --json > "$work/ppl-x86-$quant.json" ||
        die "x86 nflash ppl on $pack failed"
    X86_PPL[$quant]=$(ppl_of "$work/ppl-x86-$quant.json")
done

# Tiny random Gemma 3 and Phi-3 checkpoints (the test suite's fixtures,
# written by nflash-tiny), their q8_0 and q4_0 packs, text of their
# word-level vocabulary (w3 … w79), and the x86 build's perplexity on it
# in windows of 64 tokens (longer than Gemma's sliding window of 5).
# (With make build's flags: a -p build would compile the dependencies again
# with other features.)
cargo build --release --workspace --all-targets 2>&1 | grep -E "^(error|warning)" || true
[ -x target/release/nflash-tiny ] || die "target/release/nflash-tiny was not built"
python3 -c 'import random; r = random.Random(7); print(" ".join("w%d" % r.randrange(3, 80) for _ in range(300)))' > "$work/tiny-words.txt"
declare -A TINY_PPL
TINY_PACKS=()
for arch in gemma3 phi3; do
    target/release/nflash-tiny "$arch" "$work/tiny-$arch" || die "nflash-tiny $arch failed"
    for quant in q8_0 q4_0; do
        pack="$work/tiny-$arch-$quant.nflash"
        "$PREP" convert --model "$work/tiny-$arch" --out "$pack" --quant $quant > "$work/convert-$arch.log" 2>&1 ||
            { cat "$work/convert-$arch.log"; die "prep convert of the tiny $arch model failed"; }
        target/release/nflash ppl --model "$pack" --file "$work/tiny-words.txt" --ctx 64 --json > "$work/ppl-x86-$arch-$quant.json" ||
            die "x86 nflash ppl on $pack failed"
        TINY_PPL[$pack]=$(ppl_of "$work/ppl-x86-$arch-$quant.json")
        TINY_PACKS+=("$pack")
    done
done

for cpu in $CPUS; do
    t0=$(date +%s)
    say "== qemu-aarch64 -cpu $cpu"
    QEMU_CPU=$cpu cargo test --release -p nflash-runtime --lib --target "$TARGET" -q -- kernels:: offload::align:: model::ops:: 2>&1 |
        tee "$work/unit-$cpu.log" | grep -E "^test result|FAILED|panicked" || true
    grep -q "^test result: ok" "$work/unit-$cpu.log" || die "$cpu: unit tests failed (log above)"

    # The demo prompt.
    out=$(q "$cpu" run --model "$DEMO_PACK" --chat --prompt "What is the capital of France?" \
        --temperature 0 --max-tokens 8 --stats-json "$work/demo-$cpu.json" 2> "$work/demo-$cpu.err") ||
        { cat "$work/demo-$cpu.err"; die "$cpu: nflash run failed"; }
    say "$cpu demo: $out"
    case "$out" in *Paris*) ;; *) die "$cpu: the demo answer does not name Paris: $out" ;; esac
    kernels=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["kernels"])' "$work/demo-$cpu.json")
    [ "$kernels" = "$(expect_kernels "$cpu")" ] || die "$cpu: kernels '$kernels', expected '$(expect_kernels "$cpu")'"
    say "$cpu kernels: $kernels"

    # The sparse pack, unlimited and under a budget that reads from the file.
    args=(run --model "$work/tiny.nflash" --prompt "The history of the city" --max-tokens 16 --temperature 0 --ignore-eos --ctx 64)
    free=$(q "$cpu" "${args[@]}" 2> "$work/free-$cpu.err") || { cat "$work/free-$cpu.err"; die "$cpu: sparse run failed"; }
    # Just above the smallest budget nflash accepts for this pack, a quarter
    # of each layer's neurons hot and the smallest cold cache: the rest are
    # read from the file as they are needed.
    min=$( { q "$cpu" "${args[@]}" --memory-budget 1KiB 2>&1 || true; } | sed -n 's/.*short of the minimum, \([0-9.]*\) MiB.*/\1/p' | head -1)
    [ -n "$min" ] || die "$cpu: a 1 KiB budget was not refused with the minimum budget"
    budget="$(python3 -c 'import sys; print(int((float(sys.argv[1]) + 1) * 1024))' "$min")KiB"
    tight=$(q "$cpu" "${args[@]}" --memory-budget "$budget" --hot-fraction 0.25 --cold-cache 64KiB --stats-json "$work/tight-$cpu.json" 2> "$work/tight-$cpu.err") ||
        { cat "$work/tight-$cpu.err"; die "$cpu: sparse run under a budget failed"; }
    read_mib=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_read_per_token"] / 2**20)' "$work/tight-$cpu.json")
    [ "$free" = "$tight" ] || die "$cpu: tokens differ under the budget:\n  unlimited: $free\n  budget:    $tight"
    python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > 0 else 1)' "$read_mib" ||
        die "$cpu: the budgeted run read nothing from the file; the budget did not bind"
    say "$cpu sparse pack: same tokens with and without a budget (${read_mib} MiB read per token)"

    # Perplexity against the x86 build's on the same pack and text.
    for quant in $(ppl_quants "$cpu"); do
        pack=$(pack_of $quant)
        q "$cpu" ppl --model "$pack" --file "$PPL_TEXT" --max-tokens "$PPL_TOKENS" --threads 2 --json > "$work/ppl-$cpu-$quant.json" ||
            die "$cpu: nflash ppl on $pack failed"
        got=$(ppl_of "$work/ppl-$cpu-$quant.json")
        python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) <= 1e-3 * b else 1)' "$got" "${X86_PPL[$quant]}" ||
            die "$cpu: $quant perplexity $got, x86 ${X86_PPL[$quant]} (more than 0.1% apart)"
        say "$cpu $quant perplexity ($PPL_TOKENS tokens of $PPL_TEXT): $got (x86: ${X86_PPL[$quant]})"
    done
    # The tiny Gemma 3 and Phi-3 packs against the x86 build.
    for pack in "${TINY_PACKS[@]}"; do
        name=$(basename "$pack" .nflash)
        q "$cpu" ppl --model "$pack" --file "$work/tiny-words.txt" --ctx 64 --threads 2 --json > "$work/ppl-$cpu-$name.json" ||
            die "$cpu: nflash ppl on $name failed"
        got=$(ppl_of "$work/ppl-$cpu-$name.json")
        python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) <= 1e-3 * b else 1)' "$got" "${TINY_PPL[$pack]}" ||
            die "$cpu: $name perplexity $got, x86 ${TINY_PPL[$pack]} (more than 0.1% apart)"
        say "$cpu $name perplexity: $got (x86: ${TINY_PPL[$pack]})"
    done
    say "$cpu: $(( $(date +%s) - t0 )) s"
done
# libnflash for the phone: the C example (examples/chat.c) compiled by the
# cross gcc, linked against the aarch64 static library and the musl C
# library Rust ships for this target, run under qemu (a chat, its second
# turn reusing the KV cache, a cancel from another thread, errors as codes).
cargo build --release -p nflash-capi --target "$TARGET" 2>&1 | grep -v "dropping unsupported crate type" || true
lib=target/$TARGET/release/libnflash.a
[ -f "$lib" ] || die "the aarch64 libnflash.a was not built"
sc="$(rustc --print sysroot)/lib/rustlib/$TARGET/lib/self-contained"
aarch64-linux-gnu-gcc -O2 -fno-stack-protector -U_FORTIFY_SOURCE -Icapi/include -c examples/chat.c -o "$work/chat.o"
aarch64-linux-gnu-gcc -static -nostdlib -nostartfiles "$sc/crt1.o" "$sc/crti.o" "$sc/crtbegin.o" "$work/chat.o" "$lib" \
    "$sc/libunwind.a" "$sc/libc.a" -lgcc "$sc/crtend.o" "$sc/crtn.o" -o "$work/chat-aarch64"
QEMU_CPU=max qemu-aarch64 "$work/chat-aarch64" "$DEMO_PACK" > "$work/chat.out" 2>&1 ||
    { cat "$work/chat.out"; die "the C example against the aarch64 libnflash failed"; }
say "libnflash C example (aarch64, qemu max): $(tail -1 "$work/chat.out")"
say "passed on: $CPUS ($(( $(date +%s) - start )) s)"
