#!/bin/bash
# Informal: SmolLM2 q4_0, summary prompt, 128 greedy tokens; 3 alternating rounds, page cache dropped.
P=${P:-bench-out/smollm2-q4_0.nflash}
for r in 1 2 3; do for b in none 96MiB; do for d in off auto lookup self; do
  B=""; [ $b != none ] && B="--memory-budget $b --ctx 1024"
  sync; echo 3 > /proc/sys/vm/drop_caches
  target/release/nflash run --model $P --prompt-file /tmp/sum.txt --max-tokens 128 --temperature 0 $B --speculate-draft $d --stats-json /tmp/sb-$r-$b-$d.json > /tmp/sbo-$r-$b-$d.txt 2>/dev/null
done; done; done
python3 - <<'PY'
import json,statistics as S
for b in ['none','96MiB']:
  base=None
  for d in ['off','auto','lookup','self']:
    js=[json.load(open(f'/tmp/sb-{r}-{b}-{d}.json')) for r in (1,2,3)]
    m=S.median(j['decode_tokens_per_s'] for j in js)
    if d=='off': base=m
    print(f"{b:6} {d:7} {m:7.1f} tok/s  x{m/base:.2f}  acceptance {js[0]['acceptance_rate']:.3f}  drafted {js[0]['draft_tokens']}  passes {js[0]['decode_passes']}  MB read/token {js[0]['bytes_read_per_token']/1e6:.1f}")
PY
for b in none 96MiB; do for d in auto lookup self; do cmp -s /tmp/sbo-1-$b-off.txt /tmp/sbo-1-$b-$d.txt || echo "TEXT DIFFERS $b $d"; done; done
