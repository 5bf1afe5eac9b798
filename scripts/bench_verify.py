#!/usr/bin/env python3
"""What checking neuron clusters costs (issue 24, formats/SPEC.md §4.10):
`nflash run --verify lazy` (the default: each cluster's CRC-32C after it is
read, before it is used) against `--verify off`, in the same script, on the
same packs, alternating run by run.

Packs: SmolLM2-135M-Instruct q8_0 (converted here from `make model`'s
checkpoint) and the synthetic 7B ReLU pack of `make bench-scale`
(bench-out/scale/llama-7b-s0.9-q4_0.nflash; `prep upgrade` adds the
checksums if it predates them; made here with 512 calibration tokens when
absent). Placements: in memory (every cluster read
and checked at load; decode then reads nothing) and from flash (half of
each layer's FFN hot, the other half read from flash for every token through
the smallest cold region, page cache dropped first; the 7B pack's own sparse
decode reads what its predictor selects), and under a memory budget
(the planner's hot set and cold cache: SmolLM2 130 MiB, 7B 3 GiB, both at
--ctx 512; hot clusters read and checked at load, misses read from flash).

Reported per pack and placement: medians over --runs of decode tokens/s and
of load time (process wall time less prefill and decode), the ratio lazy /
off, and `valgrind --tool=callgrind` instruction counts of one fixed greedy
decode of SmolLM2 with and without checks (repeatable, unlike timings), with
the instructions spent in the CRC-32C itself. Root is needed to drop the
page cache. Outputs: the table and OUT/results.json.

    python3 scripts/bench_verify.py [--runs 5] [--out bench-out/verify]

NFLASH_BIN_DIR points at other prep/nflash binaries (default target/release).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import common  # noqa: E402
from nflash_bench.common import REPO, die, fmt, log, median, run_info  # noqa: E402

common.PROG = "bench-verify"
BIN = Path(os.environ.get("NFLASH_BIN_DIR", REPO / "target" / "release"))


def drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        die(f"cannot drop the page cache ({e}): run as root")


def ensure_packs(a) -> dict[str, Path]:
    """The packs to measure, with neuron-cluster checksums."""
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    packs = {}
    smol = out / "smollm2-q8_0.nflash"
    if not smol.exists() or smol.stat().st_mtime < (BIN / "prep").stat().st_mtime:
        log(f"converting SmolLM2 -> {smol}")
        subprocess.run([str(BIN / "prep"), "convert", "--model", str(REPO / "models/SmolLM2-135M-Instruct"),
                        "--out", str(smol), "--quant", "q8_0"], check=True, capture_output=True)
    packs["smollm2-q8_0"] = smol
    src = REPO / "bench-out/scale/llama-7b-s0.9-q4_0.nflash"
    if a.skip_7b:
        return packs
    if not src.exists():
        src = make_7b(a, out)
    up = out / "llama-7b-s0.9-q4_0.nflash"
    if not up.exists() or up.stat().st_mtime < src.stat().st_mtime:
        r = subprocess.run([str(BIN / "prep"), "upgrade", str(src), "--out", str(up)], capture_output=True, text=True)
        if r.returncode != 0:
            if "already has neuron-cluster checksums" in r.stderr:
                up = src
            else:
                die(f"prep upgrade {src}: {r.stderr.strip()}")
        else:
            log(r.stderr.strip().splitlines()[-1])
    packs["llama-7b-s0.9-q4_0"] = up
    return packs


def make_7b(a, out: Path) -> Path:
    """The synthetic 7B ReLU pack (sparsity 0.9, q4_0) when bench-scale's is absent:
    `prep synth` then `prep convert` with --calib-tokens of calibration text
    (fewer than bench-scale's 2048: the check's cost depends on the bytes read,
    not on the predictor's quality); the 13 GiB checkpoint is removed after."""
    pack = out / "llama-7b-s0.9-q4_0-src.nflash"
    if pack.exists():
        return pack
    if not a.calib.exists():
        die(f"{a.calib} missing: pass --calib TEXT (calibration text for the 7B pack) or --skip-7b")
    ckpt = out / "llama-7b-s0.9"
    if not (ckpt / "config.json").exists():
        log(f"prep synth --shape llama-7b -> {ckpt} (about 5 minutes, 13 GiB)")
        subprocess.run([str(BIN / "prep"), "synth", "--shape", "llama-7b", "--sparsity", "0.9", "--out", str(ckpt),
                        "--tokenizer", str(REPO / "models/SmolLM2-135M-Instruct")], check=True)
    log(f"prep convert {ckpt} -> {pack} ({a.calib_tokens} calibration tokens)")
    subprocess.run([str(BIN / "prep"), "convert", "--model", str(ckpt), "--out", str(pack), "--quant", "q4_0",
                    "--calib", str(a.calib), "--tokens", str(a.calib_tokens)], check=True)
    subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    return pack


# `--memory-budget` per pack for the "budget" placement: the fixed region
# plus about a fifth (SmolLM2) or two fifths (7B) of the FFN bytes.
BUDGET = {"smollm2-q8_0": "130MiB", "llama-7b-s0.9-q4_0": "3GiB"}


def placement_args(name: str, placement: str) -> list[str]:
    """`nflash run` options of a placement."""
    if placement == "flash":
        return ["--hot-fraction", "0.5", "--cold-cache", "0B"]
    if placement == "budget":
        return ["--ctx", "512", "--memory-budget", BUDGET[name]]
    return []


def nflash_run(pack: Path, verify: str, args: list[str], tokens: int, threads: int, prompt: str) -> dict:
    """One `nflash run`; its --stats-json plus wall and load time, seconds."""
    with tempfile.TemporaryDirectory() as d:
        j = Path(d) / "stats.json"
        cmd = [str(BIN / "nflash"), "run", "--model", str(pack), "--raw", "--prompt", prompt, "--max-tokens",
               str(tokens), "--temperature", "0", "--ignore-eos", "--threads", str(threads), "--verify", verify,
               "--stats-json", str(j), *args]
        drop_caches()
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            die(f"{' '.join(cmd)} failed: {r.stderr.strip()[-800:]}")
        s = json.loads(j.read_text())
    s["wall_s"] = wall
    s["load_s"] = wall - s["prefill_seconds"] - s["decode_seconds"]
    s["text"] = r.stdout
    return s


def callgrind(pack: Path, verify: str, placement: str, tokens: int) -> dict:
    """Instructions of one greedy decode under callgrind: total, and in CRC-32C functions."""
    with tempfile.TemporaryDirectory() as d:
        outf = Path(d) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={outf}", str(BIN / "nflash"), "run",
               "--model", str(pack), "--raw", "--prompt", "The capital of France is", "--max-tokens", str(tokens),
               "--temperature", "0", "--ignore-eos", "--threads", "1", "--verify", verify,
               "--io-engine", "threads"]
        if placement == "flash":
            cmd += ["--hot-fraction", "0.5", "--cold-cache", "0B", "--io-threads", "1"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            die(f"callgrind failed: {r.stderr.strip()[-800:]}")
        ann = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(outf)],
                             capture_output=True, text=True).stdout
    total = None
    crc = 0
    for line in ann.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\(?[\d.%)]*\s*PROGRAM TOTALS", line)
        if m:
            total = int(m.group(1).replace(",", ""))
        m = re.match(r"^\s*([\d,]+)\s.*(crc32c|crc_fast)", line)
        if m:
            crc += int(m.group(1).replace(",", ""))
    return {"instructions": total, "crc32c_instructions": crc, "cmd": " ".join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per run (SmolLM2; 7B: half)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench-out/verify")
    ap.add_argument("--skip-7b", action="store_true", help="SmolLM2 only (no bench-scale pack needed)")
    ap.add_argument("--no-callgrind", action="store_true")
    ap.add_argument("--calib", type=Path, default=REPO.parent / "shared/data/wikitext2-valid.txt",
                    help="calibration text for the 7B pack when bench-scale's is absent")
    ap.add_argument("--calib-tokens", type=int, default=512)
    a = ap.parse_args()
    if os.geteuid() != 0:
        die("needs root to drop the page cache between runs (sudo)")
    packs = ensure_packs(a)
    prompt = "The history of the city goes back more than two thousand years, to a settlement by the river"
    rows = []
    for name, pack in packs.items():
        tokens = a.tokens if "smollm2" in name else max(8, a.tokens // 2)
        for placement in ["memory", "flash", "budget"]:
            runs = {"lazy": [], "off": []}
            for i in range(a.runs):
                order = ["lazy", "off"] if i % 2 == 0 else ["off", "lazy"]
                for v in order:
                    s = nflash_run(pack, v, placement_args(name, placement), tokens, a.threads, prompt)
                    runs[v].append(s)
                    log(f"{name} {placement:<6} --verify {v:<4} run {i + 1}/{a.runs}: decode "
                        f"{s['decode_tokens_per_s']:.2f} tok/s, load {s['load_s']:.2f} s, "
                        f"{s['bytes_read_per_token'] / 2**20:.2f} MiB read/token")
            same = len({s["text"] for s in runs["lazy"] + runs["off"]}) == 1
            med = {v: {"decode_tokens_per_s": median([s["decode_tokens_per_s"] for s in rs]),
                       "load_s": median([s["load_s"] for s in rs]),
                       "bytes_read_per_token": median([s["bytes_read_per_token"] for s in rs])}
                   for v, rs in runs.items()}
            ratio = med["lazy"]["decode_tokens_per_s"] / med["off"]["decode_tokens_per_s"]
            rows.append({"pack": name, "placement": placement, "tokens": tokens, "medians": med,
                         "lazy_over_off": ratio, "slowdown_pct": 100 * (1 - ratio), "same_tokens": same,
                         "runs": {v: [{k: s[k] for k in ("decode_tokens_per_s", "load_s", "wall_s",
                                                         "bytes_read_per_token", "cache_hit_rate")}
                                      for s in rs] for v, rs in runs.items()}})
    cg = []
    if not a.no_callgrind:
        for placement in ["memory", "flash"]:
            res = {v: callgrind(packs["smollm2-q8_0"], v, placement, 16) for v in ["lazy", "off"]}
            extra = res["lazy"]["instructions"] - res["off"]["instructions"]
            cg.append({"pack": "smollm2-q8_0", "placement": placement, "tokens": 16, **{v: r for v, r in res.items()},
                       "extra_instructions": extra,
                       "extra_pct": 100 * extra / res["off"]["instructions"]})
            log(f"callgrind smollm2 {placement}: lazy {res['lazy']['instructions']:,} vs off "
                f"{res['off']['instructions']:,} instructions (+{100 * extra / res['off']['instructions']:.3f}%), "
                f"crc32c {res['lazy']['crc32c_instructions']:,}")
    print()
    print(f"--verify lazy against --verify off: medians of {a.runs} runs each, alternating, {a.threads} threads")
    print(f"{'pack':<20} {'placement':<9} {'off tok/s':>9} {'lazy tok/s':>10} {'lazy/off':>8} {'slower':>7} "
          f"{'off load s':>10} {'lazy load s':>11} {'MiB/tok':>7} same tokens")
    for r in rows:
        m = r["medians"]
        print(f"{r['pack']:<20} {r['placement']:<9} {fmt(m['off']['decode_tokens_per_s'], 2):>9} "
              f"{fmt(m['lazy']['decode_tokens_per_s'], 2):>10} {r['lazy_over_off']:>8.3f} {r['slowdown_pct']:>6.1f}% "
              f"{fmt(m['off']['load_s'], 2):>10} {fmt(m['lazy']['load_s'], 2):>11} "
              f"{m['lazy']['bytes_read_per_token'] / 2**20:>7.2f} {'yes' if r['same_tokens'] else 'NO'}")
    for c in cg:
        print(f"callgrind {c['pack']} {c['placement']} ({c['tokens']} tokens, 1 thread): off {c['off']['instructions']:,}, "
              f"lazy {c['lazy']['instructions']:,} instructions: +{c['extra_instructions']:,} "
              f"(+{c['extra_pct']:.3f}%), of which in crc32c {c['lazy']['crc32c_instructions']:,}")
    res = {**run_info(a), "packs": {k: str(v) for k, v in packs.items()}, "rows": rows, "callgrind": cg}
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    log(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
