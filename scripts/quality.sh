#!/usr/bin/env bash
# Quality sweep: perplexity of sparse decode against the dense
# model at 30–70% sparsity, for each criterion and predictor, on held-out text.
# A measurement, not a test: it takes about an hour on 2 cores.
#
#   scripts/quality.sh                       # SmolLM2 from `make model`
#   TOKENS=16384 SPARSITIES="0.5" scripts/quality.sh
#
# Steps: one `prep profile` on the calibration text (cached), one
# `prep convert --profile` per (criterion, predictor, sparsity), then one
# `prep verify --quality` over all packs, which prints the table, writes
# quality.json and the plot ppl-vs-sparsity.png.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
CALIB=${CALIB:-../shared/data/wikitext2-valid.txt}
TEXT=${TEXT:-../shared/data/wikitext2-test.txt}
OUT=${OUT:-bench-out/quality}
QUANT=${QUANT:-q8_0}
TOKENS=${TOKENS:-4096}              # held-out tokens scored per pack
CALIB_TOKENS=${CALIB_TOKENS:-50000}
SPARSITIES=${SPARSITIES:-"0.3 0.4 0.5 0.6 0.7"}
CRITERIA=${CRITERIA:-"gate gate-up"}
PREDICTORS=${PREDICTORS:-"exact low-rank mlp"}
# MLP training takes ~7 minutes per pack on 2 cores: fewer points for it.
MLP_SPARSITIES=${MLP_SPARSITIES:-"0.3 0.5 0.7"}
THREADS=${THREADS:-2}
BIN=target/release

for f in "$MODEL/config.json" "$CALIB" "$TEXT" "$BIN/prep"; do
  [ -e "$f" ] || { echo "quality: $f is missing (run make build model; CALIB/TEXT point at text files)" >&2; exit 2; }
done
mkdir -p "$OUT"
PROFILE="$OUT/$(basename "$MODEL").profile"
if [ ! -f "$PROFILE" ]; then
  echo "quality: profiling $CALIB_TOKENS tokens of $CALIB"
  "$BIN/prep" profile --model "$MODEL" --calib "$CALIB" --tokens "$CALIB_TOKENS" --out "$PROFILE"
fi
packs=()
for c in $CRITERIA; do
  for p in $PREDICTORS; do
    points=$SPARSITIES
    [ "$p" = mlp ] && points=$MLP_SPARSITIES
    for s in $points; do
      pack="$OUT/$c-$p-$s.nflash"
      if [ ! -f "$pack" ] || [ "$BIN/prep" -nt "$pack" ] || [ "$PROFILE" -nt "$pack" ]; then
        echo "quality: $pack"
        "$BIN/prep" convert --model "$MODEL" --profile "$PROFILE" --quant "$QUANT" \
          --criterion "$c" --predictor "$p" --sparsity "$s" --out "$pack" 2>&1 | grep -v '^converting' || true
        [ -f "$pack" ] || { echo "quality: prep convert failed for $pack" >&2; exit 1; }
      fi
      packs+=("$pack")
    done
  done
done
"$BIN/prep" verify "${packs[@]}" --quality --text "$TEXT" --tokens "$TOKENS" --threads "$THREADS" \
  --json --plot "$OUT/ppl-vs-sparsity.png" > "$OUT/quality.json"
python3 - "$OUT/quality.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'criterion':9} {'predictor':9} {'rank':>4} {'sparsity':>8} {'dense ppl':>9} {'sparse ppl':>10} {'Δ%':>7} {'top-1':>6} {'ffn sparsity':>12} {'skipped':>8} {'recall':>6} {'pred MiB':>8}")
for r in rows:
    print(f"{r['criterion']:9} {r['predictor']:9} {r['rank']:>4} {100*r['target_sparsity']:>7.0f}% {r['dense_ppl']:>9.3f} {r['sparse_ppl']:>10.3f} "
          f"{r['delta_pct']:>+6.1f}% {r['top1_agreement']:>6.3f} {100*r['ffn_sparsity']:>11.1f}% {100*r['bundles_skipped']:>7.1f}% "
          f"{r['recall']:>6.3f} {r['predictor_bytes']/2**20:>8.2f}")
print(f"({rows[0]['tokens']} held-out tokens per pack)")
EOF
echo "quality: wrote $OUT/quality.json and $OUT/ppl-vs-sparsity.png"
