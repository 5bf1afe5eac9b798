#!/usr/bin/env python3
"""Offload benchmark at 7B scale (issue 5): nflash on synthetic ReLU llama-7b
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

Targets at (b): nflash >= 20x llama.cpp, >= 70% of nflash at (a), and time per
token within 1.5x the I/O floor = bytes read per token / the random read
bandwidth `nflash probe` measures at the average read size. Printed beside
them, not a target: time per token / max(I/O floor, time per token at (a)),
how far (b) is from the larger of its two lower bounds (reads alone,
compute alone).

Outputs: the table on stdout, OUT/results.json, OUT/scale.png. A benchmark,
not a test: run it on an idle machine. First run: ~1 h to make the models
(three 7B checkpoints and packs, one GGUF), then ~40 min of runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import bench_offload as bo  # noqa: E402
from benchlib import (BUSY_LIMIT, LLAMA_NATIVE_BIN, REPO, choose_prompt, die, fmt, log, median,  # noqa: E402
                      run_info, run_measured, wait_idle)

benchlib.PROG = "bench-scale"
MIB = 1 << 20
LIMIT_FFN_SHARE = {"a": 1.0, "b": 0.5, "c": 0.25}
TARGET = "b"
TARGET_VS_LLAMA, TARGET_VS_A, TARGET_FLOOR = 20.0, 0.7, 1.5
NATIVE = bo.NATIVE


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shape", default="llama-7b", choices=("llama-7b", "tiny"),
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
    a.cache_dir = a.work_dir  # for bo.run_probe
    return a


def readable(prep: Path, pack: Path) -> bool:
    return pack.exists() and subprocess.run([str(prep), "inspect", str(pack)],
                                            capture_output=True).returncode == 0


def parse_stages(stderr: str) -> list[dict]:
    """The per-stage table `prep convert` prints at the end."""
    rows, on = [], False
    for line in stderr.splitlines():
        if line.startswith("stage "):
            on = True
            continue
        if on:
            m = re.match(r"^(.+?)\s+([\d.]+)\s+([\d.]+|-)$", line)
            if not m:
                break
            rows.append({"stage": m[1].strip(), "wall_s": float(m[2]),
                         "peak_rss_mib": None if m[3] == "-" else float(m[3])})
            if m[1].strip() == "total":
                break
    return rows


def prepare(a, s: float, make_gguf: bool) -> tuple[Path, Path | None, dict]:
    """The pack (and GGUF) of sparsity s, made if missing; returns prep's measurements."""
    tag = f"{a.shape}-s{s:g}"
    ckpt, pack = a.work_dir / tag, a.work_dir / f"{tag}-q4_0.nflash"
    gguf = a.work_dir / f"{tag}-q4_0.gguf" if make_gguf else None
    meas_file = a.work_dir / f"prep-{tag}.json"
    meas = json.loads(meas_file.read_text()) if meas_file.exists() else {}
    need_pack = not readable(a.prep, pack)
    need_gguf = gguf is not None and not gguf.exists()
    if (need_pack or need_gguf) and not (ckpt / "config.json").exists():
        cmd = [str(a.prep), "synth", "--shape", a.shape, "--sparsity", str(s), "--out", str(ckpt),
               "--tokenizer", str(a.tokenizer)]
        log("running " + " ".join(cmd))
        code, rss, so, se, wall = run_measured(cmd, 4 * 3600)
        if code != 0:
            die(f"prep synth failed (exit {code}):\n{se[-3000:]}")
        meas["synth"] = {"wall_s": wall, "peak_rss_bytes": rss, "log": se[-1500:]}
        log(f"  synth: {wall:.0f} s, peak RSS {rss / MIB:.0f} MiB")
    if need_pack:
        cmd = [str(a.prep), "convert", "--model", str(ckpt), "--out", str(pack), "--quant", "q4_0",
               "--calib", str(a.calib), "--tokens", str(a.calib_tokens), "--device", str(a.device),
               *a.convert_extra.split()]
        log("running " + " ".join(cmd))
        code, rss, so, se, wall = run_measured(cmd, 6 * 3600)
        if code != 0:
            die(f"prep convert failed (exit {code}):\n{se[-3000:]}")
        meas["convert"] = {"cmd": cmd, "wall_s": wall, "peak_rss_bytes": rss,
                           "stages": parse_stages(se), "log": se[-3000:]}
        log(f"  convert: {wall:.0f} s, peak RSS {rss / MIB:.0f} MiB")
    if need_gguf:
        cmd = [sys.executable, str(REPO / "scripts/hf_to_gguf.py"), str(ckpt), str(gguf),
               "--tokenizer-gguf", str(a.tokenizer_gguf)]
        log("running " + " ".join(cmd))
        code, rss, so, se, wall = run_measured(cmd, 4 * 3600)
        if code != 0:
            die(f"hf_to_gguf failed (exit {code}):\n{(so + se)[-3000:]}")
        log(f"  GGUF: {wall:.0f} s")
    meas_file.write_text(json.dumps(meas, indent=1) + "\n")
    if ckpt.exists() and not a.keep_checkpoints and readable(a.prep, pack) and (gguf is None or gguf.exists()):
        log(f"removing the checkpoint {ckpt} (--keep-checkpoints keeps it)")
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    return pack, gguf, meas


def io_floor(s: dict, points: list) -> dict | None:
    b, rd, dec = s["bytes_read_per_token_median"], s.get("reads_per_token_median"), s["decode_tokens_per_s_median"]
    if not b or not rd or not dec:
        return None
    size = b / rd
    bw = bo.random_bw_mb_s(points, size)
    floor_ms = b / (bw * 1e6) * 1e3 if bw else None
    meas = 1e3 / dec
    return {"bytes_per_token": b, "reads_per_token": rd, "avg_read_bytes": size, "random_mb_s": bw,
            "floor_ms_per_token": floor_ms, "measured_ms_per_token": meas,
            "measured_over_floor": meas / floor_ms if floor_ms else None}


def validate_sim(a, packs: dict, limits: dict, summary: dict, probe: Path, when: str) -> list[dict]:
    """`nflash plan-sim` on each pack at each limit with the disk and kernel
    speeds `nflash probe` measured in this benchmark (`when`: "before" the
    runs, the profile nflash planned with, or "after" them), against the
    measured decode tokens/s (the issue asks for predictions within +-30%)."""
    rows = []
    for s, pack in packs.items():
        k = f"{s:g}"
        for n, limit in limits[s].items():
            cmd = [str(a.nflash), "plan-sim", "--device", str(probe), "--model", str(pack), "--threads",
                   str(a.threads), "--ctx", str(a.ctx), "--memory-budget", str(limit), "--json"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                log(f"plan-sim failed: {r.stderr.strip()[-500:]}")
                continue
            p = json.loads(r.stdout.strip().splitlines()[-1])
            meas = summary[k][n]["nflash"]["decode_tokens_per_s_median"]
            pred = p.get("tokens_per_s")
            rows.append({"probe": when, "sparsity": k, "limit": n, "budget_bytes": limit, "predicted_tokens_per_s": pred,
                         "measured_tokens_per_s": meas, "predicted_over_measured": pred / meas if pred and meas else None,
                         "bound": p.get("bound"), "predicted_read_bytes_per_token": p.get("read_bytes_per_token"),
                         "measured_read_bytes_per_token": summary[k][n]["nflash"]["bytes_read_per_token_median"],
                         "predicted_hit_rate": p.get("hit_rate"),
                         "measured_hit_rate": summary[k][n]["nflash"].get("cache_hit_rate_median"),
                         "predicted_hot_hit_rate": p.get("hot_hit_rate"),
                         "measured_hot_hit_rate": summary[k][n]["nflash"].get("hot_hit_rate_median")})
            rows[-1]["within_30pct"] = bool(rows[-1]["predicted_over_measured"]
                                            and abs(rows[-1]["predicted_over_measured"] - 1) <= 0.3)
    if rows:
        print()
        print(f"nflash plan-sim (this benchmark's probe profile, taken {when} the runs: {probe.name}) "
              "against the measurement:")
        print_rows = [[r["sparsity"], r["limit"], fmt(r["predicted_tokens_per_s"], 2), fmt(r["measured_tokens_per_s"], 2),
                       fmt(r["predicted_over_measured"], 2),
                       fmt((r["predicted_read_bytes_per_token"] or 0) / MIB, 1),
                       fmt((r["measured_read_bytes_per_token"] or 0) / MIB, 1),
                       fmt(r["predicted_hit_rate"], 3), fmt(r["measured_hit_rate"], 3),
                       fmt(r["predicted_hot_hit_rate"], 3), fmt(r["measured_hot_hit_rate"], 3), r["bound"] or "-",
                       "yes" if r["within_30pct"] else "no"]
                      for r in rows]
        bo.print_table(print_rows, ["sparsity", "limit", "predicted tok/s", "measured tok/s", "pred/meas",
                                    "pred MiB/tok", "meas MiB/tok", "pred hit", "meas hit", "pred hot", "meas hot", "bound",
                                    "within 30%"], left=2)
        print(f"  within +-30%: {sum(r['within_30pct'] for r in rows)} of {len(rows)}")
    return rows


def plot(path: Path, summary: dict, a, llama: dict, llama_label: str) -> str | None:
    """nflash's medians per sparsity and limit, and llama.cpp's (`llama`: limit -> tok/s or None)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is missing ({e}); run scripts/bench_setup.sh"
    fig, ax = plt.subplots(figsize=(8, 5))
    names = a.limits
    xs = list(range(len(names)))
    for s in a.sparsities:
        ys = [summary[f"{s:g}"][n]["nflash"]["decode_tokens_per_s_median"] for n in names]
        ax.plot([x for x, y in zip(xs, ys) if y], [y for y in ys if y], marker="o",
                label=f"nflash, sparsity {s:g}")
    ys = [llama.get(n) for n in names]
    if any(ys):
        ax.plot([x for x, y in zip(xs, ys) if y], [y for y in ys if y], marker="s", color="k",
                label=llama_label)
    ax.set_xticks(xs, [f"({n}) {'whole model' if n == 'a' else f'fixed + {LIMIT_FFN_SHARE[n]:.0%} FFN'}"
                       for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"synthetic {a.shape} ReLU q4_0, {a.threads} threads, cgroup v1 limits, cold runs",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    bo.need_root("bench-scale")
    bo.remove_stale_groups()
    for b in (a.nflash, a.prep):
        if not b.exists():
            die(f"{b} not found: run `make build` first", 2)
    if not a.calib.exists():
        die(f"calibration text {a.calib} not found: pass --calib FILE (UTF-8 text of >= "
            f"{a.calib_tokens} tokens)", 2)
    llama = not a.skip_llama and a.tokenizer_gguf.exists() and (a.prepare_only or a.llama_native.exists())
    if not a.skip_llama and not llama:
        log(f"note: no llama.cpp rows: {a.llama_native} or {a.tokenizer_gguf} is missing "
            f"(run `make model` and scripts/bench_setup.sh)")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tmpdir = a.out_dir / "tmp"
    tmpdir.mkdir(exist_ok=True)

    packs, prep_meas, gguf = {}, {}, None
    for i, s in enumerate(a.sparsities):
        pack, g, meas = prepare(a, s, make_gguf=llama and i == 0)
        packs[s], prep_meas[f"{s:g}"] = pack, meas
        gguf = gguf or g
    t_prep = time.perf_counter() - t_start
    if a.prepare_only:
        log(f"--prepare-only: packs ready in {t_prep / 60:.0f} min: "
            + ", ".join(str(p) for p in packs.values()) + (f", {gguf}" if gguf else ""))
        return 0

    text, n_prompt = choose_prompt(a.prompt_tokens, a.tokenizer_gguf if llama else None, 600)
    prompt_file = a.out_dir / "prompt.txt"
    prompt_file.write_text(text, encoding="utf-8")
    probe_path = bo.run_probe(a, a.out_dir)
    points = tomllib.loads(probe_path.read_text()).get("flash", {}).get("read", [])
    # nflash plans its hot set and cold cache for this machine as measured
    # now (not the profile stored in the pack at prep), as plan-sim does below.
    a.nflash_device = probe_path

    a.llama_native_ok = llama
    runners = {s: bo.Runner(a, packs[s], gguf or packs[s], prompt_file, tmpdir) for s in a.sparsities}
    runs: dict = {}
    busy_runs = 0
    first = a.sparsities[0]

    def measure_once(key: str, s: float, limit: int | None, engines: list[str], i: int) -> None:
        """Run `i` of every engine in `engines` (alternating their order by run)."""
        nonlocal busy_runs
        cell = runs.setdefault(key, {}).setdefault(f"{s:g}", {e: [] for e in engines})
        for e in (engines if i % 2 == 0 else engines[::-1]):
            busy = wait_idle(a.wait_idle)
            busy_runs += busy > BUSY_LIMIT
            r = runners[s].nflash(limit) if e == "nflash" else runners[s].native(limit)
            r.update(run=i, cpu_busy_before=busy)
            cell[e].append(bo.slim(r))
            st = r.get("stats") or {}
            extra = (f", hit {fmt(st.get('cache_hit_rate'), 3)}, "
                     f"{fmt((st.get('bytes_read_per_token') or 0) / MIB)} MiB read/token"
                     if e == "nflash" and st else "")
            cg = r["cgroup_peak_bytes"]
            log(f"s={s:g} {key:9s} {e:17s} run {i + 1}/{a.runs}: {r['outcome']}"
                + (f", decode {st['decode_tokens_per_s']:.2f} tok/s" if st else "") + extra
                + (f", cgroup peak {cg / MIB:.0f} MiB" if cg else "") + f", {r['wall_s']:.0f} s"
                + ("  [CONTENDED]" if busy > BUSY_LIMIT else ""))
            if r["outcome"] == "error":
                log("  stderr: " + r["stderr"].strip()[-600:].replace("\n", "\n  "))

    # 1. Unlimited: nflash's fixed region per sparsity and llama.cpp's headroom.
    for s in a.sparsities:
        for i in range(a.runs):
            measure_once("unlimited", s, None, ["nflash"] + ([NATIVE] if llama and s == first else []), i)
    extra = int(a.headroom_extra_mib * MIB)
    F, fixed, limits = {}, {}, {}
    M = gguf.stat().st_size if gguf else None
    H = None
    if llama:
        ok = [r for r in runs["unlimited"][f"{first:g}"][NATIVE] if r["outcome"] == "ok"]
        if not ok:
            die("every unlimited llama.cpp run failed; see the log above")
        H = max(r["peak_rss_bytes"] - M for r in ok) + extra
    for s in a.sparsities:
        F[s], _ = bo.ffn_bytes(a.prep, packs[s])
        ok = [r for r in runs["unlimited"][f"{s:g}"]["nflash"] if r["outcome"] == "ok"]
        if not ok:
            die(f"every unlimited nflash run at sparsity {s:g} failed; see the log above")
        fixed[s] = max(r["peak_rss_bytes"] for r in ok) - F[s] + extra
        limits[s] = {}
        for n in a.limits:
            b = fixed[s] + LIMIT_FFN_SHARE[n] * F[s]
            if n == "a" and M is not None:
                b = max(b, M + H)
            limits[s][n] = int(b)
        log(f"sparsity {s:g}: F = {F[s] / MIB:.0f} MiB, fixed = {fixed[s] / MIB:.0f} MiB; limits "
            + ", ".join(f"({n}) {v / MIB:.0f} MiB" for n, v in limits[s].items()))

    # 2. The limits, round by round: run i of every limit and sparsity before
    # run i + 1, so a drift of the host's speed over the ~30 min (±20% seen)
    # moves every cell alike instead of biasing the ratios between limits.
    for i in range(a.runs):
        for n in a.limits:
            for s in a.sparsities:
                engines = ["nflash"] + ([NATIVE] if llama and s == first else [])
                measure_once(n, s, limits[s][n], engines, i)

    # Summary.
    keys = ["unlimited"] + a.limits
    summary = {f"{s:g}": {k: {e: bo.summarize(v, e) for e, v in runs[k][f"{s:g}"].items()}
                          for k in keys} for s in a.sparsities}
    llama_key = f"{first:g}" if llama else None
    imported = {}
    if a.llama_from and not llama:
        prev = json.loads(a.llama_from.read_text())
        k0 = next(iter(prev["summary"]))
        imported = {n: v.get(NATIVE, {}).get("decode_tokens_per_s_median") for n, v in prev["summary"][k0].items()}
        log(f"llama.cpp medians from {a.llama_from} (sparsity {k0} model, same limit names): {imported}")
    ll = lambda n: (summary[llama_key][n][NATIVE]["decode_tokens_per_s_median"] if llama_key
                    else imported.get(n))
    floors = {f"{s:g}": {n: io_floor(summary[f"{s:g}"][n]["nflash"], points) for n in keys}
              for s in a.sparsities}
    hdr = ["sparsity", "limit", "MiB", "engine", "decode tok/s", "x llama", "x (a)", "p50 ms", "p99 ms",
           "hit rate", "MiB read/tok", "I/O wait", "floor ms", "x floor", "peak cg MiB", "runs"]
    rows = []
    targets = {}
    for s in a.sparsities:
        k = f"{s:g}"
        at_a = summary[k].get("a", {}).get("nflash", {}).get("decode_tokens_per_s_median")
        for n in keys:
            for e, sm in summary[k][n].items():
                v = sm["decode_tokens_per_s_median"]
                f = floors[k][n] if e == "nflash" else None
                x_ll = v / ll(n) if e == "nflash" and v and ll(n) else None
                x_a = v / at_a if e == "nflash" and v and at_a and n != "unlimited" else None
                b = sm["bytes_read_per_token_median"] if e == "nflash" else None
                rows.append([k, n, fmt(limits[s].get(n, 0) / MIB if n in limits[s] else None, 0), e,
                             fmt(v, 2), fmt(x_ll, 1), fmt(x_a, 2),
                             fmt(sm["latency_ms_p50_median"], 0), fmt(sm["latency_ms_p99_median"], 0),
                             fmt(sm.get("cache_hit_rate_median"), 3),
                             fmt(b / MIB if b is not None else None, 1),
                             "-" if sm.get("io_wait_share_median") is None else f"{100 * sm['io_wait_share_median']:.0f}%",
                             fmt(f and f["floor_ms_per_token"], 0), fmt(f and f["measured_over_floor"], 2),
                             fmt(sm["cgroup_peak_bytes_max"] / MIB if sm["cgroup_peak_bytes_max"] else None, 0),
                             bo.status_cell(sm)])
        if TARGET in a.limits:
            t = summary[k][TARGET]["nflash"]
            v = t["decode_tokens_per_s_median"]
            f = floors[k][TARGET]
            r_ll = v / ll(TARGET) if v and ll(TARGET) else None
            r_a = v / at_a if v and at_a else None
            r_f = f["measured_over_floor"] if f else None
            # The larger lower bound: the reads alone (floor) or compute alone (the (a) time).
            bound_ms = max(f["floor_ms_per_token"], 1e3 / at_a) if f and at_a else None
            r_b = f["measured_ms_per_token"] / bound_ms if bound_ms else None
            targets[k] = {
                "nflash_over_llama": {"value": r_ll, "target": TARGET_VS_LLAMA,
                                      "pass": r_ll is not None and r_ll >= TARGET_VS_LLAMA},
                "nflash_over_nflash_a": {"value": r_a, "target": TARGET_VS_A,
                                         "pass": r_a is not None and r_a >= TARGET_VS_A},
                "time_over_io_floor": {"value": r_f, "target": TARGET_FLOOR,
                                       "pass": r_f is not None and r_f <= TARGET_FLOOR},
                "time_over_max_floor_and_a": r_b,
                "oom_kills": t["oom-killed"]}
    print()
    print(f"synthetic {a.shape} (ReLU, power-law hotness, skew 1.5) q4_0: medians of {a.runs} cold runs, "
          f"{a.threads} threads, ctx {a.ctx}, {n_prompt or '~' + str(a.prompt_tokens)}-token prompt, "
          f"{a.tokens} generated tokens")
    print("limits: (a) max(fixed + F, M + H), (b) fixed + 0.5 F, (c) fixed + 0.25 F; "
          + "; ".join(f"s={s:g}: F {F[s] / MIB:.0f} MiB, fixed {fixed[s] / MIB:.0f} MiB" for s in a.sparsities)
          + (f"; GGUF M {M / MIB:.0f} MiB, H {H / MIB:.0f} MiB" if M else ""))
    bo.print_table(rows, hdr, left=4)
    print(f"x llama: against llama.cpp native (llama-completion, mmap, dense FFN) on the sparsity-{first:g} "
          "weights at the same limit name; x (a): against nflash at (a) of the same sparsity; floor: bytes read "
          "per token / `nflash probe` random read bandwidth at the average read size")
    if targets:
        print()
        print(f"targets at ({TARGET}) = fixed + 50% of the FFN:")
        pf = lambda ok: "PASS" if ok else "MISS"
        for k, t in targets.items():
            print(f"  sparsity {k}: nflash / llama.cpp {fmt(t['nflash_over_llama']['value'], 1):>6} "
                  f"(>= {TARGET_VS_LLAMA:g}) {pf(t['nflash_over_llama']['pass'])};  "
                  f"nflash (b) / (a) {fmt(t['nflash_over_nflash_a']['value'], 2):>5} (>= {TARGET_VS_A}) "
                  f"{pf(t['nflash_over_nflash_a']['pass'])};  time / I/O floor "
                  f"{fmt(t['time_over_io_floor']['value'], 2):>5} (<= {TARGET_FLOOR}) "
                  f"{pf(t['time_over_io_floor']['pass'])};  OOM kills {t['oom_kills']};  "
                  f"(time / max(floor, (a) time) {fmt(t['time_over_max_floor_and_a'], 2)})")
    print()
    print("prep per sparsity (synth, then convert: profile on "
          f"{a.calib_tokens} tokens, MLP predictors, plan, quantize, pack):")
    for k, m in prep_meas.items():
        c = m.get("convert", {})
        sy = m.get("synth", {})
        print(f"  s={k}: synth {fmt(sy.get('wall_s'), 0)} s / {fmt((sy.get('peak_rss_bytes') or 0) / MIB, 0)} MiB; "
              f"convert {fmt(c.get('wall_s'), 0)} s / peak RSS {fmt((c.get('peak_rss_bytes') or 0) / MIB, 0)} MiB"
              + ("; " + ", ".join(f"{r['stage']} {r['wall_s']:.0f} s ({fmt(r['peak_rss_mib'], 0)} MiB)"
                                  for r in c.get("stages", [])) if c.get("stages") else ""))
    # The kernel and disk figures of one probe move by 20-35% between runs on
    # a shared host: price the same plans with a second probe taken now, after
    # the runs, and report both (nflash planned with the first).
    sim = validate_sim(a, packs, limits, summary, probe_path, "before")
    if not a.probe:
        sim += validate_sim(a, packs, limits, summary, bo.run_probe(a, a.out_dir, "probe-after.toml"), "after")
    if busy_runs:
        print(f"WARNING: {busy_runs} runs started while the CPUs were > {BUSY_LIMIT:.0%} busy")
    png = a.out_dir / "scale.png"
    err = plot(png, summary, a, {n: ll(n) for n in a.limits},
               "llama.cpp (dense)" if llama_key else f"llama.cpp (dense; from {a.llama_from.name if a.llama_from else '-'})")
    if err:
        log(err)
    wall = time.perf_counter() - t_start
    (a.out_dir / "results.json").write_text(json.dumps({
        **run_info(a), "prompt_text": text, "prompt_tokens_llama": n_prompt,
        "packs": {f"{s:g}": str(p) for s, p in packs.items()}, "gguf": str(gguf) if gguf else None,
        "ffn_bytes": {f"{s:g}": v for s, v in F.items()}, "fixed_bytes": {f"{s:g}": v for s, v in fixed.items()},
        "gguf_bytes": M, "llama_headroom_bytes": H, "limits": {f"{s:g}": v for s, v in limits.items()},
        "probe": {"path": str(probe_path), "flash_read": points},
        "summary": summary, "io_floor": floors, "targets": targets, "prep": prep_meas, "plan_sim": sim,
        "contended_runs": busy_runs, "wall_s": wall, "prepare_s": t_prep, "runs": runs,
    }, indent=1, default=str) + "\n")
    log(f"wrote {a.out_dir / 'results.json'}" + ("" if err else f" and {png}"))
    log(f"whole benchmark: {wall / 60:.0f} min (models {t_prep / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
