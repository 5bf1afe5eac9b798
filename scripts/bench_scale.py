#!/usr/bin/env python3
"""Offload benchmark at 7B scale: nflash on synthetic ReLU llama-7b
models (q4_0, ~3.8 GB packed) at target sparsities 0.9 / 0.8 / 0.6 against
llama.cpp on the same weights, under cgroup v1 memory limits.

Run as root with the bench venv's python (`make bench-scale` does both):

    scripts/bench_setup.sh
    .venv-bench/bin/python scripts/bench_scale.py

Models (cached in --work-dir; each is made only when missing or unreadable):
- `prep synth --shape llama-7b --sparsity S` writes the checkpoint (13.5 GB
  BF16; ReLU with per-neuron gate biases, power-law hotness, skew 1.5);
- `prep convert --quant q4_0 --calib TEXT --tokens 2048 --device PROFILE`
  makes the sparse pack (MLP predictors, recall target 0.99); its wall time,
  peak RSS and per-stage table are kept in prep-S.json;
- scripts/hf_to_gguf.py makes the q4_0 GGUF of the first sparsity's
  checkpoint for llama.cpp (FFN biases included; llama.cpp's llama
  architecture applies SiLU, not ReLU, so its text differs, but it computes
  the FFN densely whatever the activation: its speed is that of the model);
- the checkpoints are then deleted (--keep-checkpoints keeps them).
llama.cpp's speed does not depend on the activation statistics, so it runs
on the first sparsity's model only and every sparsity is compared with it.

Limits, per sparsity. F = bytes of the pack's FFN segments; fixed = max over
the unlimited runs of (nflash peak RSS - F) + --headroom-extra-mib: what
nflash holds besides FFN weights (attention, embeddings, predictors, KV cache
at --ctx, scratch, runtime). M = GGUF bytes, H = max(llama.cpp peak RSS - M)
+ the same extra.
    a = max(fixed + F, M + H)    the whole model plus headroom
    b = fixed + 0.50 F           (the targets' setting)
    c = fixed + 0.25 F
llama.cpp runs at the first sparsity's limits (native llama-completion,
weights mmapped in place, its cgroup limited to exactly the limit). nflash
runs with `--device` the profile `nflash probe` measured at the start, so it
plans hot set and cold cache for this machine as it is (the pack holds the
plan for --device at prep), and plan-sim prices that same plan. Cold runs:
page cache dropped before each; engines alternate; the limits run round by
round (run i of every limit and sparsity, then run i + 1); medians of --runs.

Targets (the kernels issue, deliverable 7; host-independent ratios): at (a),
in memory, nflash's sparse decode >= 2.0x llama.cpp's dense decode of the same
weights; at (b), nflash >= 0.85x its own (a) speed and time per token <=
1.2x max(I/O floor, time per token at (a)), the larger of its two lower
bounds (reads alone, compute alone); the I/O floor = bytes read per token /
the random read bandwidth `nflash probe` measures at the average read size.
nflash / llama.cpp at (b) is printed beside them. plan-sim, fed this run's
probe, must predict the (a) and (b) speeds within +-20%.
`--sparsities 0.9` makes and runs only the pack the targets are set for.

Outputs: the table on stdout, OUT/results.json, OUT/scale.png. A benchmark,
not a test: run it on an idle machine. First run: ~1 h to make the models
(three 7B checkpoints and packs, one GGUF), then ~40 min of runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import common, scale  # noqa: E402
from nflash_bench.cgroup import need_root, remove_stale_groups  # noqa: E402
from nflash_bench.common import REPO  # noqa: E402
from nflash_bench.llama import LLAMA_NATIVE_BIN  # noqa: E402
from nflash_bench.scale import LIMIT_FFN_SHARE  # noqa: E402

common.PROG = "bench-scale"
# Run by hand on a results.json (README: `bench_scale.validate_sim`).
validate_sim = scale.validate_sim


def parse_args(argv, shapes=("llama-7b", "tiny")):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shape", default=shapes[0], choices=shapes,
                    help="prep synth shape (tiny: a quick check of the script itself)")
    ap.add_argument("--sparsities", default="0.9,0.8,0.6")
    ap.add_argument("--limits", default="a,b,c")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--wait-idle", type=float, default=30)
    ap.add_argument("--headroom-extra-mib", type=float, default=32)
    ap.add_argument("--work-dir", type=Path, default=REPO / "bench-out/scale")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-out/scale")
    ap.add_argument("--calib", type=Path, default=REPO.parent / "shared/data/wikitext2-valid.txt")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--device", type=Path, default=REPO / "profiles/dev-host.toml",
                    help="device profile prep plans the cluster size for")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    ap.add_argument("--tokenizer-gguf", type=Path,
                    default=REPO / "models/.download/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="a GGUF with the SmolLM2 tokenizer (make model downloads this one)")
    ap.add_argument("--probe", type=Path, help="reuse this nflash probe profile")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--prepare-only", action="store_true",
                    help="make the packs (and the GGUF) and stop: the slow, noise-tolerant part, which "
                         "can run at low priority beside other work; measure later on a quiet machine")
    ap.add_argument("--llama-from", type=Path,
                    help="with --skip-llama: take llama.cpp's medians per limit from this earlier results.json")
    ap.add_argument("--convert-extra", default="--rank 256 --epochs 4",
                    help="extra `prep convert` flags for packs made by this run (the default predictor, "
                         "rank 448 and 20 epochs, takes over an hour at 7B on 2 cores)")
    ap.add_argument("--llama-native", type=Path, default=LLAMA_NATIVE_BIN)
    ap.add_argument("--nflash", type=Path, default=REPO / "target/release/nflash")
    ap.add_argument("--prep", type=Path, default=REPO / "target/release/prep")
    a = ap.parse_args(argv)
    a.sparsities = [float(s) for s in a.sparsities.split(",")]
    a.limits = [x for x in a.limits.split(",") if x]
    if any(x not in LIMIT_FFN_SHARE for x in a.limits):
        ap.error(f"--limits: choose among {','.join(LIMIT_FFN_SHARE)}")
    if a.runs < 1 or a.tokens < 2 or a.threads < 1:
        ap.error("need --runs >= 1, --tokens >= 2, --threads >= 1")
    a.cache_dir = a.work_dir  # for nflash_bench.disk.run_probe
    return a


def main(argv) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    need_root("bench-scale")
    remove_stale_groups()
    b = scale.Scale(a, t_start)
    if not scale.prepare_and_measure(b):
        return 0
    scale.compute_targets(b)
    scale.print_results(b)
    scale.print_targets(b)
    scale.finish(b)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
