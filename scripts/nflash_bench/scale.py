"""The steps of scripts/bench_scale.py: nflash on synthetic ReLU llama-7b
models at several sparsities against llama.cpp (native, dense) under cgroup
v1 memory limits, and `nflash plan-sim`'s predictions against the
measurement. The driver's docstring describes the method; here each step
fills in the Scale record of one benchmark run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import MIB, REPO, die, fmt, log, run_info
from .disk import load_probe, run_probe
from .engines import NATIVE, Runner, alternating, log_error_tail, run_when_idle, slim
from .models import ffn_bytes, pack_readable
from .proc import BUSY_LIMIT, run_measured
from .prompt import choose_prompt, write_prompt
from .stats import io_floor, status_cell, summarize
from .table import pass_miss, print_table

# Limit name -> share of the FFN bytes on top of nflash's fixed region.
LIMIT_FFN_SHARE = {"a": 1.0, "b": 0.5, "c": 0.25}
# The kernels issue's host-independent targets (its deliverable 7): in memory
# (limit a) nflash's sparse decode >= 2x llama.cpp's dense decode of the same
# weights; at TARGET nflash >= 0.85x its own (a) speed and time per token
# <= 1.2x max(I/O floor, time per token at (a)); plan-sim within +-20% of the
# measured speed at (a) and (b).
TARGET = "b"
TARGET_A_VS_LLAMA, TARGET_VS_A, TARGET_BOUND = 2.0, 0.85, 1.2
SIM_TOLERANCE, SIM_LIMITS = 0.2, ("a", "b")


@dataclass
class Scale:
    """One run of the benchmark: its arguments and what the steps found so far.
    Per-sparsity dicts are keyed by the sparsity (float) or, in what goes to
    results.json, by f"{s:g}"."""
    a: object
    t_start: float
    llama: bool = False  # llama.cpp rows (native binary and tokenizer GGUF at hand)
    tmpdir: Path | None = None
    packs: dict = field(default_factory=dict)
    prep_meas: dict = field(default_factory=dict)
    gguf: Path | None = None  # of the first sparsity's checkpoint
    t_prep: float = 0.0
    text: str = ""
    n_prompt: int | None = None
    prompt_file: Path | None = None
    probe_path: Path | None = None
    points: list = field(default_factory=list)
    runners: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)  # limit -> sparsity -> engine -> run records
    busy_runs: int = 0
    F: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)  # sparsity -> limit name -> bytes
    M: int | None = None
    H: int | None = None
    keys: list[str] = field(default_factory=list)  # "unlimited" and the limits run
    summary: dict = field(default_factory=dict)
    llama_key: str | None = None
    imported: dict = field(default_factory=dict)  # limit -> llama.cpp tok/s from --llama-from
    floors: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)
    sim: list = field(default_factory=list)

    @property
    def first(self) -> float:
        return self.a.sparsities[0]


# --------------------------------------------------------------------------
# Set-up and models
# --------------------------------------------------------------------------

def prepare_and_measure(b: Scale) -> bool:
    """Every step up to the summary of the runs: models (made if missing),
    prompt, disk probe, the unlimited runs, the limits, the limited runs.
    False after --prepare-only (the models are ready, nothing was measured)."""
    check_prerequisites(b)
    make_dirs(b)
    prepare_models(b)
    if b.a.prepare_only:
        log_prepared(b)
        return False
    prepare_prompt(b)
    probe_disk(b)
    make_runners(b)
    # 1. Unlimited: nflash's fixed region per sparsity and llama.cpp's headroom.
    measure_unlimited(b)
    set_limits(b)
    # 2. The limits, round by round.
    measure_limits(b)
    summarize_runs(b)
    return True


def check_prerequisites(b: Scale) -> None:
    """Exits with status 2 without the binaries or --calib; b.llama: whether llama.cpp can run."""
    a = b.a
    for p in (a.nflash, a.prep):
        if not p.exists():
            die(f"{p} not found: run `make build` first", 2)
    if not a.calib.exists():
        die(f"calibration text {a.calib} not found: pass --calib FILE (UTF-8 text of >= "
            f"{a.calib_tokens} tokens)", 2)
    b.llama = not a.skip_llama and a.tokenizer_gguf.exists() and (a.prepare_only or a.llama_native.exists())
    if not a.skip_llama and not b.llama:
        log(f"note: no llama.cpp rows: {a.llama_native} or {a.tokenizer_gguf} is missing "
            f"(run `make model` and scripts/bench_setup.sh)")


def make_dirs(b: Scale) -> None:
    b.a.work_dir.mkdir(parents=True, exist_ok=True)
    b.a.out_dir.mkdir(parents=True, exist_ok=True)
    b.tmpdir = b.a.out_dir / "tmp"
    b.tmpdir.mkdir(exist_ok=True)


def prepare_models(b: Scale) -> None:
    """The pack of every sparsity and the GGUF of the first; the preparation time."""
    for i, s in enumerate(b.a.sparsities):
        pack, g, meas = prepare(b.a, s, make_gguf=b.llama and i == 0)
        b.packs[s], b.prep_meas[f"{s:g}"] = pack, meas
        b.gguf = b.gguf or g
    b.t_prep = time.perf_counter() - b.t_start


def log_prepared(b: Scale) -> None:
    log(f"--prepare-only: packs ready in {b.t_prep / 60:.0f} min: "
        + ", ".join(str(p) for p in b.packs.values()) + (f", {b.gguf}" if b.gguf else ""))


def prepare(a, s: float, make_gguf: bool) -> tuple[Path, Path | None, dict]:
    """The pack (and GGUF) of sparsity s, made if missing; returns prep's measurements."""
    tag = f"{a.shape}-s{s:g}" + (f"-l{a.layers}" if getattr(a, "layers", None) else "")
    ckpt, pack = a.work_dir / tag, a.work_dir / f"{tag}-q4_0.nflash"
    gguf = a.work_dir / f"{tag}-q4_0.gguf" if make_gguf else None
    meas_file = a.work_dir / f"prep-{tag}.json"
    meas = json.loads(meas_file.read_text()) if meas_file.exists() else {}
    need_pack = not pack_readable(a.prep, pack)
    need_gguf = gguf is not None and not gguf.exists()
    if (need_pack or need_gguf) and not (ckpt / "config.json").exists():
        meas["synth"] = synth(a, s, ckpt)
    if need_pack:
        meas["convert"] = convert(a, ckpt, pack)
    if need_gguf:
        make_gguf_file(a, ckpt, gguf)
    meas_file.write_text(json.dumps(meas, indent=1) + "\n")
    if ckpt.exists() and not a.keep_checkpoints and pack_readable(a.prep, pack) and (gguf is None or gguf.exists()):
        log(f"removing the checkpoint {ckpt} (--keep-checkpoints keeps it)")
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    return pack, gguf, meas


def synth(a, s: float, ckpt: Path) -> dict:
    """`prep synth` of the checkpoint; its wall time, peak RSS and log tail."""
    cmd = [str(a.prep), "synth", "--shape", a.shape, "--sparsity", str(s), "--out", str(ckpt),
           "--tokenizer", str(a.tokenizer)]
    # bench-moe: fewer layers of full width, and the experts' popularity.
    if getattr(a, "layers", None):
        cmd += ["--layers", str(a.layers)]
    if getattr(a, "router_skew", None) is not None:
        cmd += ["--router-skew", str(a.router_skew)]
    log("running " + " ".join(cmd))
    code, rss, so, se, wall = run_measured(cmd, 4 * 3600)
    if code != 0:
        die(f"prep synth failed (exit {code}):\n{se[-3000:]}")
    log(f"  synth: {wall:.0f} s, peak RSS {rss / MIB:.0f} MiB")
    return {"wall_s": wall, "peak_rss_bytes": rss, "log": se[-1500:]}


def convert(a, ckpt: Path, pack: Path) -> dict:
    """`prep convert` of the checkpoint into the sparse q4_0 pack; its measurements and stages."""
    cmd = [str(a.prep), "convert", "--model", str(ckpt), "--out", str(pack), "--quant", "q4_0",
           "--calib", str(a.calib), "--tokens", str(a.calib_tokens), "--device", str(a.device),
           *a.convert_extra.split()]
    log("running " + " ".join(cmd))
    code, rss, so, se, wall = run_measured(cmd, 6 * 3600)
    if code != 0:
        die(f"prep convert failed (exit {code}):\n{se[-3000:]}")
    log(f"  convert: {wall:.0f} s, peak RSS {rss / MIB:.0f} MiB")
    return {"cmd": cmd, "wall_s": wall, "peak_rss_bytes": rss,
            "stages": parse_stages(se), "log": se[-3000:]}


def make_gguf_file(a, ckpt: Path, gguf: Path) -> None:
    """scripts/hf_to_gguf.py: the checkpoint as a q4_0 GGUF for llama.cpp."""
    cmd = [sys.executable, str(REPO / "scripts/hf_to_gguf.py"), str(ckpt), str(gguf),
           "--tokenizer-gguf", str(a.tokenizer_gguf)]
    log("running " + " ".join(cmd))
    code, rss, so, se, wall = run_measured(cmd, 4 * 3600)
    if code != 0:
        die(f"hf_to_gguf failed (exit {code}):\n{(so + se)[-3000:]}")
    log(f"  GGUF: {wall:.0f} s")


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


def prepare_prompt(b: Scale) -> None:
    b.text, b.n_prompt = choose_prompt(b.a.prompt_tokens, b.a.tokenizer_gguf if b.llama else None, 600)
    b.prompt_file = write_prompt(b.text, b.a.out_dir)


def probe_disk(b: Scale) -> None:
    """`nflash probe` (or --probe). nflash plans its hot set and cold cache for
    this machine as measured now (not the profile stored in the pack at
    prep), as plan-sim does after the runs."""
    b.probe_path = run_probe(b.a, b.a.out_dir)
    _, b.points = load_probe(b.probe_path)
    b.a.nflash_device = b.probe_path


def make_runners(b: Scale) -> None:
    a = b.a
    a.llama_native_ok = b.llama
    b.runners = {s: Runner(a, b.packs[s], b.gguf or b.packs[s], b.prompt_file, b.tmpdir)
                 for s in a.sparsities}


# --------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------

def engines_at(b: Scale, s: float) -> list[str]:
    """nflash, and llama.cpp on the first sparsity's model."""
    return ["nflash"] + ([NATIVE] if b.llama and s == b.first else [])


def measure_once(b: Scale, key: str, s: float, limit: int | None, i: int) -> None:
    """Run `i` of every engine at sparsity s and limit `key` (alternating their order by run)."""
    engines = engines_at(b, s)
    cell = b.runs.setdefault(key, {}).setdefault(f"{s:g}", {e: [] for e in engines})
    for e in alternating(engines, i):
        runner = b.runners[s]
        run = (lambda: runner.nflash(limit)) if e == "nflash" else (lambda: runner.native(limit))
        r, busy = run_when_idle(b.a.wait_idle, run, i)
        b.busy_runs += busy > BUSY_LIMIT
        cell[e].append(slim(r))
        log_run(b.a, key, s, e, i, r, busy)
        log_error_tail(r)


def log_run(a, key: str, s: float, e: str, i: int, r: dict, busy: float) -> None:
    st = r.get("stats") or {}
    extra = (f", hit {fmt(st.get('cache_hit_rate'), 3)}, "
             f"{fmt((st.get('bytes_read_per_token') or 0) / MIB)} MiB read/token"
             if e == "nflash" and st else "")
    cg = r["cgroup_peak_bytes"]
    log(f"s={s:g} {key:9s} {e:17s} run {i + 1}/{a.runs}: {r['outcome']}"
        + (f", decode {st['decode_tokens_per_s']:.2f} tok/s" if st else "") + extra
        + (f", cgroup peak {cg / MIB:.0f} MiB" if cg else "") + f", {r['wall_s']:.0f} s"
        + ("  [CONTENDED]" if busy > BUSY_LIMIT else ""))


def measure_unlimited(b: Scale) -> None:
    """Unlimited: nflash's fixed region per sparsity and llama.cpp's headroom."""
    for s in b.a.sparsities:
        for i in range(b.a.runs):
            measure_once(b, "unlimited", s, None, i)


def measure_limits(b: Scale) -> None:
    """The limits, round by round: run i of every limit and sparsity before
    run i + 1, so a drift of the host's speed over the ~30 min (±20% seen)
    moves every cell alike instead of biasing the ratios between limits."""
    for i in range(b.a.runs):
        for n in b.a.limits:
            for s in b.a.sparsities:
                measure_once(b, n, s, b.limits[s][n], i)


# --------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------

def set_limits(b: Scale) -> None:
    """llama.cpp's M and H, then per sparsity F, the fixed region and the limits."""
    a = b.a
    extra = int(a.headroom_extra_mib * MIB)
    b.M = b.gguf.stat().st_size if b.gguf else None
    if b.llama:
        ok = [r for r in b.runs["unlimited"][f"{b.first:g}"][NATIVE] if r["outcome"] == "ok"]
        if not ok:
            die("every unlimited llama.cpp run failed; see the log above")
        b.H = max(r["peak_rss_bytes"] - b.M for r in ok) + extra
    for s in a.sparsities:
        set_limits_of(b, s, extra)


def set_limits_of(b: Scale, s: float, extra: int) -> None:
    """fixed = max(nflash peak RSS - F) + extra over the ok unlimited runs;
    limit n = fixed + LIMIT_FFN_SHARE[n] F, and (a) at least M + H."""
    b.F[s], _ = ffn_bytes(b.a.prep, b.packs[s])
    ok = [r for r in b.runs["unlimited"][f"{s:g}"]["nflash"] if r["outcome"] == "ok"]
    if not ok:
        die(f"every unlimited nflash run at sparsity {s:g} failed; see the log above")
    b.fixed[s] = max(r["peak_rss_bytes"] for r in ok) - b.F[s] + extra
    b.limits[s] = {}
    for n in b.a.limits:
        v = b.fixed[s] + LIMIT_FFN_SHARE[n] * b.F[s]
        if n == "a" and b.M is not None:
            v = max(v, b.M + b.H)
        b.limits[s][n] = int(v)
    log(f"sparsity {s:g}: F = {b.F[s] / MIB:.0f} MiB, fixed = {b.fixed[s] / MIB:.0f} MiB; limits "
        + ", ".join(f"({n}) {v / MIB:.0f} MiB" for n, v in b.limits[s].items()))


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------

def summarize_runs(b: Scale) -> None:
    """b.summary: sparsity -> limit -> engine -> medians; llama.cpp's speeds
    (measured, or from --llama-from); nflash's I/O floor per cell."""
    a = b.a
    b.keys = ["unlimited"] + a.limits
    b.summary = {f"{s:g}": {k: {e: summarize(v, e) for e, v in b.runs[k][f"{s:g}"].items()}
                            for k in b.keys} for s in a.sparsities}
    b.llama_key = f"{b.first:g}" if b.llama else None
    if a.llama_from and not b.llama:
        prev = json.loads(a.llama_from.read_text())
        k0 = next(iter(prev["summary"]))
        b.imported = {n: v.get(NATIVE, {}).get("decode_tokens_per_s_median") for n, v in prev["summary"][k0].items()}
        log(f"llama.cpp medians from {a.llama_from} (sparsity {k0} model, same limit names): {b.imported}")
    b.floors = {f"{s:g}": {n: io_floor(b.summary[f"{s:g}"][n]["nflash"], b.points) for n in b.keys}
                for s in a.sparsities}


def llama_speed(b: Scale, n: str) -> float | None:
    """llama.cpp's median decode tok/s at limit n (on the first sparsity's model)."""
    return (b.summary[b.llama_key][n][NATIVE]["decode_tokens_per_s_median"] if b.llama_key
            else b.imported.get(n))


def nflash_at_a(b: Scale, k: str) -> float | None:
    return b.summary[k].get("a", {}).get("nflash", {}).get("decode_tokens_per_s_median")


def compute_targets(b: Scale) -> None:
    """b.targets per sparsity at TARGET, when it was run."""
    if TARGET not in b.a.limits:
        return
    for s in b.a.sparsities:
        k = f"{s:g}"
        b.targets[k] = targets_of(b, k, nflash_at_a(b, k))


def targets_of(b: Scale, k: str, at_a: float | None) -> dict:
    """nflash at (a) over llama.cpp at (a); at TARGET: over llama.cpp (reported,
    no target), over nflash at (a), and its time per token over the larger of
    its two lower bounds (the reads alone: the I/O floor; compute alone: the
    time per token at (a))."""
    t = b.summary[k][TARGET]["nflash"]
    v = t["decode_tokens_per_s_median"]
    f = b.floors[k][TARGET]
    ll_a = llama_speed(b, "a") if "a" in b.a.limits else None
    ll = llama_speed(b, TARGET)
    r_a_ll = at_a / ll_a if at_a and ll_a else None
    r_ll = v / ll if v and ll else None
    r_a = v / at_a if v and at_a else None
    r_f = f["measured_over_floor"] if f else None
    bound_ms = max(f["floor_ms_per_token"], 1e3 / at_a) if f and at_a else None
    r_b = f["measured_ms_per_token"] / bound_ms if bound_ms else None
    return {
        "a_nflash_over_llama": {"value": r_a_ll, "target": TARGET_A_VS_LLAMA,
                                "pass": r_a_ll is not None and r_a_ll >= TARGET_A_VS_LLAMA},
        "nflash_over_llama": r_ll,
        "nflash_over_nflash_a": {"value": r_a, "target": TARGET_VS_A,
                                 "pass": r_a is not None and r_a >= TARGET_VS_A},
        "time_over_max_floor_and_a": {"value": r_b, "target": TARGET_BOUND,
                                      "pass": r_b is not None and r_b <= TARGET_BOUND},
        "time_over_io_floor": r_f,
        "oom_kills": t["oom-killed"]}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

TABLE_HEADER = ["sparsity", "limit", "MiB", "engine", "decode tok/s", "x llama", "x (a)", "p50 ms",
                "p99 ms", "hit rate", "MiB read/tok", "I/O wait", "floor ms", "x floor", "peak cg MiB",
                "runs"]


def table_row(b: Scale, s: float, n: str, e: str, at_a: float | None) -> list[str]:
    k = f"{s:g}"
    sm = b.summary[k][n][e]
    v = sm["decode_tokens_per_s_median"]
    f = b.floors[k][n] if e == "nflash" else None
    ll = llama_speed(b, n)
    x_ll = v / ll if e == "nflash" and v and ll else None
    x_a = v / at_a if e == "nflash" and v and at_a and n != "unlimited" else None
    rd = sm["bytes_read_per_token_median"] if e == "nflash" else None
    return [k, n, fmt(b.limits[s].get(n, 0) / MIB if n in b.limits[s] else None, 0), e,
            fmt(v, 2), fmt(x_ll, 1), fmt(x_a, 2),
            fmt(sm["latency_ms_p50_median"], 0), fmt(sm["latency_ms_p99_median"], 0),
            fmt(sm.get("cache_hit_rate_median"), 3),
            fmt(rd / MIB if rd is not None else None, 1),
            "-" if sm.get("io_wait_share_median") is None else f"{100 * sm['io_wait_share_median']:.0f}%",
            fmt(f and f["floor_ms_per_token"], 0), fmt(f and f["measured_over_floor"], 2),
            fmt(sm["cgroup_peak_bytes_max"] / MIB if sm["cgroup_peak_bytes_max"] else None, 0),
            status_cell(sm)]


def print_results(b: Scale) -> None:
    """The table of every sparsity, limit and engine, with its heading and note."""
    a = b.a
    rows = [table_row(b, s, n, e, nflash_at_a(b, f"{s:g}"))
            for s in a.sparsities for n in b.keys for e in b.summary[f"{s:g}"][n]]
    print()
    print(f"synthetic {a.shape} (ReLU, power-law hotness, skew 1.5) q4_0: medians of {a.runs} cold runs, "
          f"{a.threads} threads, ctx {a.ctx}, {b.n_prompt or '~' + str(a.prompt_tokens)}-token prompt, "
          f"{a.tokens} generated tokens")
    print("limits: (a) max(fixed + F, M + H), (b) fixed + 0.5 F, (c) fixed + 0.25 F; "
          + "; ".join(f"s={s:g}: F {b.F[s] / MIB:.0f} MiB, fixed {b.fixed[s] / MIB:.0f} MiB" for s in a.sparsities)
          + (f"; GGUF M {b.M / MIB:.0f} MiB, H {b.H / MIB:.0f} MiB" if b.M else ""))
    print_table(rows, TABLE_HEADER, left=4)
    print(f"x llama: against llama.cpp native (llama-completion, mmap, dense FFN) on the sparsity-{b.first:g} "
          "weights at the same limit name; x (a): against nflash at (a) of the same sparsity; floor: bytes read "
          "per token / `nflash probe` random read bandwidth at the average read size")


def print_targets(b: Scale) -> None:
    if not b.targets:
        return
    print()
    print(f"targets: in memory (a) nflash sparse / llama.cpp dense; at ({TARGET}) = fixed + 50% of the FFN, "
          "nflash / its (a) and time per token / max(I/O floor, (a) time per token):")
    for k, t in b.targets.items():
        a_ll, r_a, r_b = t["a_nflash_over_llama"], t["nflash_over_nflash_a"], t["time_over_max_floor_and_a"]
        print(f"  sparsity {k}: (a) nflash / llama.cpp {fmt(a_ll['value'], 2):>5} (>= {TARGET_A_VS_LLAMA:g}) "
              f"{pass_miss(a_ll['pass'])};  ({TARGET}) / (a) {fmt(r_a['value'], 2):>5} (>= {TARGET_VS_A:g}) "
              f"{pass_miss(r_a['pass'])};  ({TARGET}) time / max(floor, (a) time) {fmt(r_b['value'], 2):>5} "
              f"(<= {TARGET_BOUND:g}) {pass_miss(r_b['pass'])};  ({TARGET}) nflash / llama.cpp "
              f"{fmt(t['nflash_over_llama'], 1)};  time / I/O floor {fmt(t['time_over_io_floor'], 2)};  "
              f"OOM kills {t['oom_kills']}")


def print_prep(b: Scale) -> None:
    """prep's wall time and peak RSS per sparsity, and convert's stages."""
    print()
    print("prep per sparsity (synth, then convert: profile on "
          f"{b.a.calib_tokens} tokens, MLP predictors, plan, quantize, pack):")
    for k, m in b.prep_meas.items():
        c = m.get("convert", {})
        sy = m.get("synth", {})
        print(f"  s={k}: synth {fmt(sy.get('wall_s'), 0)} s / {fmt((sy.get('peak_rss_bytes') or 0) / MIB, 0)} MiB; "
              f"convert {fmt(c.get('wall_s'), 0)} s / peak RSS {fmt((c.get('peak_rss_bytes') or 0) / MIB, 0)} MiB"
              + ("; " + ", ".join(f"{r['stage']} {r['wall_s']:.0f} s ({fmt(r['peak_rss_mib'], 0)} MiB)"
                                  for r in c.get("stages", [])) if c.get("stages") else ""))


def check_plan_sim(b: Scale) -> None:
    """plan-sim with this run's probe, and unless --probe with a second probe
    taken now: the kernel and disk figures of one probe move by 20-35%
    between runs on a shared host, so the same plans are priced with both
    (nflash planned with the first)."""
    a = b.a
    b.sim = validate_sim(a, b.packs, b.limits, b.summary, b.probe_path, "before")
    if not a.probe:
        b.sim += validate_sim(a, b.packs, b.limits, b.summary,
                              run_probe(a, a.out_dir, "probe-after.toml"), "after")


def finish(b: Scale) -> None:
    """After a driver's own table: prep's figures, plan-sim against the
    measurement, warnings, and OUT/results.json and OUT/scale.png."""
    print_prep(b)
    check_plan_sim(b)
    print_warnings(b)
    write_outputs(b)


def print_warnings(b: Scale) -> None:
    if b.busy_runs:
        print(f"WARNING: {b.busy_runs} runs started while the CPUs were > {BUSY_LIMIT:.0%} busy")


# --------------------------------------------------------------------------
# plan-sim against the measurement
# --------------------------------------------------------------------------

def validate_sim(a, packs: dict, limits: dict, summary: dict, probe: Path, when: str) -> list[dict]:
    """`nflash plan-sim` on each pack at each limit with the disk and kernel
    speeds `nflash probe` measured in this benchmark (`when`: "before" the
    runs, the profile nflash planned with, or "after" them), against the
    measured decode tokens/s (the target: within +-SIM_TOLERANCE at SIM_LIMITS)."""
    rows = []
    for s, pack in packs.items():
        k = f"{s:g}"
        for n, limit in limits[s].items():
            p = plan_sim(a, probe, pack, limit)
            if p is not None:
                rows.append(sim_row(p, summary[k][n]["nflash"], when, k, n, limit))
    if rows:
        print_sim(rows, probe, when)
    return rows


def plan_sim(a, probe: Path, pack: Path, limit: int) -> dict | None:
    """plan-sim's JSON for the pack at the budget (None if it failed)."""
    cmd = [str(a.nflash), "plan-sim", "--device", str(probe), "--model", str(pack), "--threads",
           str(a.threads), "--ctx", str(a.ctx), "--memory-budget", f"{limit}B", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log(f"plan-sim failed: {r.stderr.strip()[-500:]}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def sim_row(p: dict, nf: dict, when: str, k: str, n: str, limit: int) -> dict:
    """plan-sim's prediction `p` beside nflash's measured summary `nf`."""
    meas = nf["decode_tokens_per_s_median"]
    pred = p.get("tokens_per_s")
    row = {"probe": when, "sparsity": k, "limit": n, "budget_bytes": limit, "predicted_tokens_per_s": pred,
           "measured_tokens_per_s": meas, "predicted_over_measured": pred / meas if pred and meas else None,
           "bound": p.get("bound"), "predicted_read_bytes_per_token": p.get("read_bytes_per_token"),
           "measured_read_bytes_per_token": nf["bytes_read_per_token_median"],
           "predicted_hit_rate": p.get("hit_rate"),
           "measured_hit_rate": nf.get("cache_hit_rate_median"),
           "predicted_hot_hit_rate": p.get("hot_hit_rate"),
           "measured_hot_hit_rate": nf.get("hot_hit_rate_median")}
    row["within_tolerance"] = bool(row["predicted_over_measured"]
                                   and abs(row["predicted_over_measured"] - 1) <= SIM_TOLERANCE)
    return row


SIM_HEADER = ["sparsity", "limit", "predicted tok/s", "measured tok/s", "pred/meas", "pred MiB/tok",
              "meas MiB/tok", "pred hit", "meas hit", "pred hot", "meas hot", "bound", f"within {SIM_TOLERANCE:.0%}"]


def print_sim(rows: list[dict], probe: Path, when: str) -> None:
    print()
    print(f"nflash plan-sim (this benchmark's probe profile, taken {when} the runs: {probe.name}) "
          "against the measurement:")
    print_rows = [[r["sparsity"], r["limit"], fmt(r["predicted_tokens_per_s"], 2), fmt(r["measured_tokens_per_s"], 2),
                   fmt(r["predicted_over_measured"], 2),
                   fmt((r["predicted_read_bytes_per_token"] or 0) / MIB, 1),
                   fmt((r["measured_read_bytes_per_token"] or 0) / MIB, 1),
                   fmt(r["predicted_hit_rate"], 3), fmt(r["measured_hit_rate"], 3),
                   fmt(r["predicted_hot_hit_rate"], 3), fmt(r["measured_hot_hit_rate"], 3), r["bound"] or "-",
                   "yes" if r["within_tolerance"] else "no"]
                  for r in rows]
    print_table(print_rows, SIM_HEADER, left=2)
    judged = [r for r in rows if r["limit"] in SIM_LIMITS]
    print(f"  within +-{SIM_TOLERANCE:.0%} at {', '.join(f'({n})' for n in SIM_LIMITS)} (the target): "
          f"{sum(r['within_tolerance'] for r in judged)} of {len(judged)}; all limits: "
          f"{sum(r['within_tolerance'] for r in rows)} of {len(rows)}")


# --------------------------------------------------------------------------
# Plot and JSON
# --------------------------------------------------------------------------

def write_outputs(b: Scale) -> None:
    """OUT/scale.png and OUT/results.json; the benchmark's wall time."""
    a = b.a
    png = a.out_dir / "scale.png"
    err = plot(png, b.summary, a, {n: llama_speed(b, n) for n in a.limits},
               "llama.cpp (dense)" if b.llama_key else f"llama.cpp (dense; from {a.llama_from.name if a.llama_from else '-'})")
    if err:
        log(err)
    wall = time.perf_counter() - b.t_start
    (a.out_dir / "results.json").write_text(json.dumps(results_json(b, wall), indent=1, default=str) + "\n")
    log(f"wrote {a.out_dir / 'results.json'}" + ("" if err else f" and {png}"))
    log(f"whole benchmark: {wall / 60:.0f} min (models {b.t_prep / 60:.0f} min)")


def results_json(b: Scale, wall: float) -> dict:
    return {
        **run_info(b.a), "prompt_text": b.text, "prompt_tokens_llama": b.n_prompt,
        "packs": {f"{s:g}": str(p) for s, p in b.packs.items()}, "gguf": str(b.gguf) if b.gguf else None,
        "ffn_bytes": {f"{s:g}": v for s, v in b.F.items()}, "fixed_bytes": {f"{s:g}": v for s, v in b.fixed.items()},
        "gguf_bytes": b.M, "llama_headroom_bytes": b.H, "limits": {f"{s:g}": v for s, v in b.limits.items()},
        "probe": {"path": str(b.probe_path), "flash_read": b.points},
        "summary": b.summary, "io_floor": b.floors, "targets": b.targets, "prep": b.prep_meas, "plan_sim": b.sim,
        "contended_runs": b.busy_runs, "wall_s": wall, "prepare_s": b.t_prep, "runs": b.runs,
    }


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
