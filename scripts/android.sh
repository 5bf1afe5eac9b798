#!/usr/bin/env bash
# nflash on an Android phone (docs/android.md).
#
#   scripts/android.sh build                 static aarch64 nflash (what `make android` runs)
#   scripts/android.sh push PACK             push the binary and PACK to the phone
#   scripts/android.sh run PACK [ARGS...]    nflash run --model PACK ARGS... on the phone
#   scripts/android.sh probe [OUT.toml] [PROBE OPTIONS...]
#                                            nflash probe on the phone, pull its device profile
#   scripts/android.sh shell [ARGS...]       any nflash command on the phone
#
# Environment: ADB (default `adb`; `ADB="adb -s SERIAL"` picks a phone),
# NFLASH_REMOTE_DIR (default /data/local/tmp/nflash), NFLASH_BIN (the
# binary to push; default the `build` output).
set -euo pipefail

TARGET=aarch64-unknown-linux-musl
REPO=$(cd "$(dirname "$0")/.." && pwd)
REMOTE=${NFLASH_REMOTE_DIR:-/data/local/tmp/nflash}
BIN=${NFLASH_BIN:-$REPO/target/$TARGET/release/nflash}
read -r -a ADB <<< "${ADB:-adb}"

die() { echo "android.sh: $*" >&2; exit 1; }

# The file name of a path, taken literally (never an option).
name_of() { printf '%s' "${1##*/}"; }

# A local path adb cannot mistake for an option.
local_path() { case "$1" in -*) printf './%s' "$1" ;; *) printf '%s' "$1" ;; esac; }

usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
}

# A word quoted for the phone's shell (mksh): inside single quotes, with
# each ' written as '\''.
quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# The Rust target and a cross linker: rustup, then Debian's gcc for aarch64
# (installed with apt-get when run as root, otherwise the command to run).
toolchain() {
    if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
        echo "android.sh: rustup target add $TARGET"
        rustup target add "$TARGET" || die "could not add the Rust target $TARGET (rustup target add $TARGET)"
    fi
    if ! command -v aarch64-linux-gnu-gcc > /dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
            echo "android.sh: installing the cross linker (apt-get install gcc-aarch64-linux-gnu)"
            export DEBIAN_FRONTEND=noninteractive
            apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross > /dev/null ||
                { apt-get update > /dev/null && apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross > /dev/null; } ||
                die "apt-get could not install gcc-aarch64-linux-gnu"
        else
            die "no cross linker: install it with 'sudo apt-get install gcc-aarch64-linux-gnu' (Debian/Ubuntu) and run again"
        fi
    fi
}

build() {
    toolchain
    # Linker, C compiler and the 16 KiB page alignment: .cargo/config.toml.
    cargo build --release -p nflash-runtime --bin nflash --target "$TARGET"
    [ -x "$BIN" ] || die "the build did not write $BIN"
    if command -v readelf > /dev/null; then
        # Every LOAD segment must be aligned to 16 KiB (Android 15 devices with 16 KiB pages).
        local align
        for align in $(readelf -lW "$BIN" | awk '$1 == "LOAD" {print $NF}'); do
            [ $((align % 16384)) -eq 0 ] || die "$BIN has a LOAD segment aligned to $align, not 16 KiB (see .cargo/config.toml)"
        done
    fi
    echo "android.sh: built $BIN ($(du -h "$BIN" | cut -f1), static aarch64, 16 KiB-aligned segments)"
    echo "android.sh: next: scripts/android.sh push PACK (with a phone on adb), or copy it to /data/local/tmp yourself"
}

adb_ok() {
    command -v "${ADB[0]}" > /dev/null ||
        die "'${ADB[0]}' not found: install Android's platform tools (adb) or set ADB=/path/to/adb"
    local state err
    err=$(mktemp)
    state=$("${ADB[@]}" get-state 2> "$err" || true)
    local why
    why=$(tr '\n' ' ' < "$err")
    rm -f "$err"
    [ "$state" = device ] && return 0
    case "$why" in
    *unauthorized*) die "the phone has not authorized this computer ($why): accept the USB debugging prompt on the phone, then run again" ;;
    *"more than one"*) die "more than one phone on adb ($why): pick one with ADB=\"adb -s SERIAL\" (serials: adb devices)" ;;
    *offline*) die "the phone is offline on adb ($why): reconnect the cable or run 'adb kill-server'" ;;
    esac
    die "no phone on adb (state '${state:-none}'${why:+; adb: $why}): connect one with USB debugging on, and check 'adb devices'"
}

# The binary to push must be an aarch64 ELF file.
check_bin() {
    [ -f "$BIN" ] && [ -x "$BIN" ] || die "no binary at $BIN: run 'make android' first"
    # NFLASH_SKIP_ARCH_CHECK=1: the tests push this machine's binary to a stand-in adb.
    [ "${NFLASH_SKIP_ARCH_CHECK:-0}" = 1 ] && return 0
    local machine
    machine=$(od -An -tx1 -j18 -N2 "$BIN" 2>/dev/null | tr -d ' \n')
    [ "$(head -c4 "$BIN" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ] && [ "$machine" = b700 ] ||
        die "$BIN is not an aarch64 executable: run 'make android' (or set NFLASH_BIN to the aarch64 build)"
}

push() {
    [ $# -ge 1 ] || die "usage: android.sh push PACK"
    local pack=$1 name
    name=$(name_of "$pack")
    [ -f "$pack" ] || die "no pack at $pack (make one with: prep convert --model DIR --out $pack)"
    case "$name" in
    nflash | device.toml) die "a pack named '$name' would overwrite nflash's own file on the phone; rename it (e.g. model.nflash)" ;;
    esac
    check_bin
    adb_ok
    "${ADB[@]}" shell "mkdir -p $(quote "$REMOTE")"
    "${ADB[@]}" push "$(local_path "$BIN")" "$REMOTE/nflash"
    "${ADB[@]}" shell "chmod 755 $(quote "$REMOTE/nflash")"
    "${ADB[@]}" push "$(local_path "$pack")" "$REMOTE/$name"
    echo "android.sh: $REMOTE/nflash and $REMOTE/$name are on the phone"
}

# Runs `nflash ARGS...` in the remote directory; the arguments are quoted
# one by one, so prompts with spaces and quotes arrive as typed.
remote() {
    adb_ok
    local cmd="cd $(quote "$REMOTE") && ./nflash"
    local a
    for a in "$@"; do cmd+=" $(quote "$a")"; done
    "${ADB[@]}" shell "$cmd"
}

run() {
    [ $# -ge 1 ] || die "usage: android.sh run PACK [nflash run options...]"
    local pack
    pack=$(name_of "$1")
    shift
    remote run "--model=$pack" "$@"
}

probe() {
    local out=
    if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then
        out=$1
        shift
    fi
    local a
    for a in "$@"; do
        case "$a" in --out | --out=* | --dir | --dir=*) die "probe sets --out and --dir itself (the profile comes back to OUT.toml)" ;; esac
    done
    adb_ok
    local model slug
    model=$("${ADB[@]}" shell getprop ro.product.model 2>/dev/null | tr -d '\r' || true)
    slug=$(printf '%s' "$model" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-' | sed 's/--*/-/g; s/^-//; s/-$//')
    [ -n "$out" ] || out=$REPO/profiles/${slug:-phone}.toml
    # Check where the profile goes before minutes of measuring.
    [ ! -d "$out" ] || die "$out is a directory; give a file name, e.g. $out/phone.toml"
    [ -d "$(dirname -- "$out")" ] || die "no directory $(dirname -- "$out") for $out"
    [ -w "$(dirname -- "$out")" ] || die "cannot write to $(dirname -- "$out")"
    local name=()
    case " $* " in *" --name "* | *" --name="*) ;; *) name=(--name "${model:-phone}") ;; esac
    # An old profile must not come back as this run's.
    "${ADB[@]}" shell "rm -f $(quote "$REMOTE/device.toml")"
    remote probe --out "$REMOTE/device.toml" --dir "$REMOTE" "${name[@]}" "$@"
    "${ADB[@]}" pull "$REMOTE/device.toml" "$out"
    echo "android.sh: wrote $out; plan a pack for this phone with: prep convert --device $out ..."
}

[ $# -ge 1 ] || { usage; exit 2; }
cmd=$1
shift
case "$cmd" in
build) build "$@" ;;
push) push "$@" ;;
run) run "$@" ;;
probe) probe "$@" ;;
shell) remote "$@" ;;
-h | --help | help) usage ;;
*) usage >&2; die "unknown command '$cmd'" ;;
esac
