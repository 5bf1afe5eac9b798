#!/usr/bin/env bash
# The SmolLM2 acceptance check of GGUF input (issue 45), with llama.cpp's own
# tools: make model's Hugging Face checkpoint → convert_hf_to_gguf.py
# --outtype bf16 → llama-quantize --pure Q8_0 → prep convert. Then
#  - the gguf:: test that compares that pack with the HF-converted q8_0 pack
#    block for block (every matrix but the requantized down projection) and
#    asks it the demo question;
#  - perplexity of both packs on WikiText-2 (../shared/data), and their ratio.
#
# Usage: bash scripts/gguf_acceptance.sh PYTHON_WITH_TORCH [MAX_TOKENS]
#   PYTHON_WITH_TORCH: an interpreter with torch, transformers and sentencepiece
#   (convert_hf_to_gguf.py imports them), e.g. after
#   python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers sentencepiece
# Needs: make build, make model, scripts/bench_setup.sh (llama-quantize).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:?usage: bash scripts/gguf_acceptance.sh PYTHON_WITH_TORCH [MAX_TOKENS]}"
MAX="${2:-65536}"
LLAMA="$ROOT/bench-out/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp"
BIN="$ROOT/bench-out/llama-native/build/bin"
OUT="$ROOT/target/test-packs"
mkdir -p "$OUT"
[ -x "$BIN/llama-quantize" ] || PATH="$ROOT/.venv-bench/bin:$PATH" cmake --build "$ROOT/bench-out/llama-native/build" --target llama-quantize llama-tokenize
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$ROOT/models/SmolLM2-135M-Instruct" --outtype bf16 --outfile "$OUT/smollm2-hf-bf16.gguf"
LD_LIBRARY_PATH="$BIN" "$BIN/llama-quantize" --pure "$OUT/smollm2-hf-bf16.gguf" "$OUT/smollm2-hf-q8_0.gguf" Q8_0
T=$(ls -t "$ROOT"/target/release/deps/main-* | grep -v '\.d$' | head -1)
"$T" gguf::smollm2_gguf_from_convert_hf_to_gguf --nocapture
"$ROOT/target/release/prep" convert --model "$OUT/smollm2-hf-q8_0.gguf" --out "$OUT/smollm2-gguf-q8_0.nflash"
for p in "$OUT/smollm2-gguf-q8_0.nflash" "$OUT/smollm2-q8_0.nflash"; do
  "$ROOT/target/release/nflash" ppl --model "$p" --file "$ROOT/../shared/data/wikitext2-test.txt" --max-tokens "$MAX" --json \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["model"], d["perplexity"], d["tokens"])'
done | python3 -c '
import sys
rows = [l.split() for l in sys.stdin]
for m, p, n in rows: print(f"{m}: perplexity {float(p):.4f} over {n} tokens")
print(f"GGUF / HF: {float(rows[0][1]) / float(rows[1][1]):.5f}")'
