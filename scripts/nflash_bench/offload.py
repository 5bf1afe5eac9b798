"""The steps of scripts/bench_offload.py: nflash (sparse, --memory-budget)
against llama.cpp (mmap) under cgroup v1 memory limits on SmolLM2-135M q4_0.
The driver's docstring describes the method; here each step fills in the
Bench record of one benchmark run, which the report steps then print and
write."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import MIB, REPO, die, fmt, log, median, run_info
from .disk import load_probe, read_ahead_kb, run_probe
from .engines import (LLAMA_REPACK, LLAMA_WEIGHTS, NATIVE, PY_LLAMAS, Runner, alternating,
                      log_error_tail, refusal_detail, run_when_idle, slim)
from .llama import llama_cpp_importable, native_llama_cmd
from .models import ffn_bytes, prepare_llama, prepare_sparse
from .proc import BUSY_LIMIT
from .prompt import choose_prompt, write_prompt
from .stats import io_floor, status_cell, summarize
from .table import pass_miss, print_table

ENGINES = ("nflash", NATIVE, "llama.cpp")
# Limit name -> fraction of the FFN bytes taken away from a = M + H.
LIMITS = {"a": 0.0, "b": 0.25, "c": 0.5, "d": 0.75}
TARGET_LIMIT = "c"
TARGET_VS_LLAMA = 2.5
TARGET_VS_UNLIMITED = 0.5


@dataclass
class Bench:
    """One run of the benchmark: its arguments and what the steps found so far."""
    a: object
    t_start: float
    engines: list[str] = field(default_factory=list)
    ref: str | None = None  # the llama.cpp the targets are computed against
    have_llama_cpp: bool = False
    out: Path | None = None
    tmpdir: Path | None = None
    gguf: Path | None = None
    pack: Path | None = None
    M: int = 0  # bytes of the q4_0 GGUF
    F: int = 0  # bytes of the pack's FFN segments
    inspect: dict = field(default_factory=dict)  # prep inspect --json of the pack
    ra_kb: int | None = None
    text: str = ""
    llama_prompt_tokens: int | None = None
    prompt_file: Path | None = None
    probe_path: Path | None = None
    probe: dict = field(default_factory=dict)
    points: list = field(default_factory=list)
    t_prep: float = 0.0
    runner: Runner | None = None
    runs: dict[str, dict[str, list]] = field(default_factory=dict)
    busy_runs: int = 0
    llamas: list[str] = field(default_factory=list)  # the Python llama.cpps: they get an allowance
    base: int = 0  # their cgroup allowance
    base_rss: int = 0
    base_anon: int = 0
    over: dict = field(default_factory=dict)  # engine -> peak RSS - M without a limit
    H: int = 0
    limits: dict = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # "unlimited" and the limits run
    summary: dict = field(default_factory=dict)
    io_floor: dict = field(default_factory=dict)
    targets: dict | None = None


# --------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------

def choose_engines(b: Bench) -> None:
    """b.engines from the flags and the native binary; b.ref: the native llama.cpp when it runs."""
    a = b.a
    engines = [e for e in ENGINES if e == "nflash" or not a.skip_llama]
    if NATIVE in engines and (a.no_native or not a.llama_native.exists()):
        engines.remove(NATIVE)
        if not a.no_native:
            log(f"note: {a.llama_native} not found: no '{NATIVE}' rows (run scripts/bench_setup.sh "
                f"to build it); the targets are then computed against the Python llama.cpp")
    if a.llama_repack:
        engines.append(LLAMA_REPACK)
    b.engines = engines
    b.ref = NATIVE if NATIVE in engines else "llama.cpp" if "llama.cpp" in engines else None


def check_prerequisites(b: Bench) -> None:
    """Exits with status 2 without the binaries, llama_cpp (when a Python llama.cpp runs) or --calib."""
    a = b.a
    for p in (a.nflash, a.prep):
        if not p.exists():
            die(f"{p} not found: run `make build` (cargo build --release) first", 2)
    b.have_llama_cpp = llama_cpp_importable()
    if not b.have_llama_cpp and any(e in PY_LLAMAS for e in b.engines):
        die(f"{sys.executable} cannot import llama_cpp: run scripts/bench_setup.sh and use "
            f"{REPO / '.venv-bench/bin/python'} (or --skip-llama)", 2)
    if not a.calib.exists():
        die(f"calibration text {a.calib} not found (it makes the sparse pack's profile): pass "
            f"--calib FILE with any UTF-8 text of >= {a.calib_tokens} tokens", 2)


def make_dirs(b: Bench) -> None:
    """--out-dir, --cache-dir and OUT/tmp (the per-run stats files)."""
    b.out = b.a.out_dir
    b.out.mkdir(parents=True, exist_ok=True)
    b.a.cache_dir.mkdir(parents=True, exist_ok=True)
    b.tmpdir = b.out / "tmp"
    b.tmpdir.mkdir(exist_ok=True)


def prepare_models(b: Bench) -> None:
    """The q4_0 GGUF and the sparse pack (cached in --cache-dir; the pack's MLP
    predictors take ~5-10 min to train), their sizes M and F."""
    a = b.a
    b.gguf = a.cache_dir / "smollm2-q4_0.gguf"
    if b.have_llama_cpp:
        b.gguf = prepare_llama(a, a.cache_dir)["q4_0"]
    elif not b.gguf.exists():
        die(f"{b.gguf} is missing and llama_cpp is not importable to make it: run "
            f"scripts/bench_setup.sh", 2)
    b.pack = prepare_sparse(a, a.cache_dir).get("q4_0")
    if b.pack is None:
        die("no sparse pack was made", 2)
    b.M = b.gguf.stat().st_size
    b.ra_kb = read_ahead_kb(b.gguf)
    b.F, b.inspect = ffn_bytes(a.prep, b.pack)
    log(f"model M = {b.M / MIB:.1f} MiB ({b.gguf.name}); FFN F = {b.F / MIB:.1f} MiB of {b.pack.name} "
        f"({b.pack.stat().st_size / MIB:.1f} MiB)")


def prepare_prompt(b: Bench) -> None:
    """The prompt cut to --prompt-tokens (by the GGUF's tokenizer when llama_cpp is there)."""
    b.text, b.llama_prompt_tokens = choose_prompt(
        b.a.prompt_tokens, b.gguf if b.have_llama_cpp else None, b.a.timeout)
    b.prompt_file = write_prompt(b.text, b.out)


def probe_disk(b: Bench) -> None:
    """`nflash probe` (or --probe); the end of the preparation time."""
    b.probe_path = run_probe(b.a, b.out)
    b.probe, b.points = load_probe(b.probe_path)
    b.t_prep = time.perf_counter() - b.t_start


def make_runner(b: Bench) -> None:
    b.runner = Runner(b.a, b.pack, b.gguf, b.prompt_file, b.tmpdir)


# --------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------

def measure(b: Bench, name: str, limit: int | None, baseline: int) -> None:
    """--runs cold runs of every engine at one limit, alternating their order, into b.runs[name]."""
    a = b.a
    b.runs[name] = {e: [] for e in b.engines}
    for i in range(a.runs):
        for e in alternating(b.engines, i):
            r, busy = run_when_idle(a.wait_idle, functools.partial(run_engine, b, e, limit, baseline), i)
            b.busy_runs += busy > BUSY_LIMIT
            b.runs[name][e].append(slim(r))
            log_run(a, name, e, i, r, busy)
            log_error_tail(r)


def run_engine(b: Bench, e: str, limit: int | None, baseline: int) -> dict:
    if e == "nflash":
        return b.runner.nflash(limit)
    if e == NATIVE:
        return b.runner.native(limit)
    return b.runner.llama(limit, baseline, LLAMA_WEIGHTS[e])


def log_run(a, name: str, e: str, i: int, r: dict, busy: float) -> None:
    s = r.get("stats") or {}
    extra = ""
    if e == "nflash" and s:
        extra = (f", hit {fmt(s.get('cache_hit_rate'), 3)}, "
                 f"{fmt((s.get('bytes_read_per_token') or 0) / 1024)} KiB read/token")
    elif s and s.get("bytes_read_per_token") is not None:
        extra = f", {fmt(s['bytes_read_per_token'] / 1024)} KiB read/token"
    if r.get("read_bytes_run") is not None:
        extra += f", {r['read_bytes_run'] / MIB:.1f} MiB read in the run"
    cg = r["cgroup_peak_bytes"]
    log(f"{name:9s} {e:9s} run {i + 1}/{a.runs}: {r['outcome']}"
        + (f", decode {s['decode_tokens_per_s']:.1f} tok/s" if s else "")
        + extra
        + (f", cgroup peak {cg / MIB:.1f} MiB" if cg is not None else "")
        + f", {r['wall_s']:.1f} s"
        + ("  [CONTENDED]" if busy > BUSY_LIMIT else ""))


def measure_unlimited(b: Bench) -> None:
    """No limit: each engine's own speed, and its peak for the headroom."""
    log(f"unlimited runs ({b.a.runs} per engine, cold page cache, cgroups without a limit)")
    measure(b, "unlimited", None, 0)


def measure_limits(b: Bench) -> None:
    """The limits, in order."""
    for n in b.a.limits:
        log(f"limit ({n}): {b.limits[n]['bytes'] / MIB:.1f} MiB, {b.a.runs} cold runs per engine")
        measure(b, n, b.limits[n]["bytes"], b.base)


# --------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------

def set_allowance(b: Bench) -> None:
    """The Python llama.cpps' cgroup allowance: the median of their
    interpreter's RSS (--llama-allowance rss) or anonymous RSS before the
    model loads, over the ok unlimited runs."""
    b.llamas = [e for e in b.engines if e in PY_LLAMAS]
    if not b.llamas:
        return
    ok = [r["stats"] for e in b.llamas for r in b.runs["unlimited"][e] if r["outcome"] == "ok"]
    b.base_rss = int(median([s["python_baseline_rss_bytes"] for s in ok]) or 0)
    b.base_anon = int(median([s.get("python_baseline_rss_anon_bytes") for s in ok]) or 0)
    b.base = b.base_rss if b.a.llama_allowance == "rss" else b.base_anon


def measured_headroom(engines: list[str], unlimited: dict, M: int) -> dict:
    """Per engine (not the repack one): max over its ok unlimited runs of peak RSS - M.
    The native binary's peak RSS is llama.cpp's alone; the Python one's less
    the interpreter's RSS before the model loads. Exits if an engine has no ok run."""
    over = {}
    for e in engines:
        if e == LLAMA_REPACK:
            continue
        ok = [r for r in unlimited[e] if r["outcome"] == "ok"]
        if not ok:
            die(f"every unlimited {e} run failed; see the log above", 1)
        over[e] = max(r["peak_rss_bytes"] - M
                      - (r["stats"]["python_baseline_rss_bytes"] if e == "llama.cpp" else 0)
                      for r in ok)
    return over


def set_headroom(b: Bench) -> None:
    """H: --headroom-mib, or the measured headroom rounded up to a MiB + --headroom-extra-mib."""
    a = b.a
    b.over = measured_headroom(b.engines, b.runs["unlimited"], b.M)
    if a.headroom_mib is not None:
        b.H = int(math.ceil(a.headroom_mib * MIB))
        log(f"headroom H = {b.H / MIB:.0f} MiB (--headroom-mib; measured: "
            + ", ".join(f"{e} {v / MIB:.1f} MiB" for e, v in b.over.items()) + ")")
    else:
        b.H = (max(0, int(math.ceil(max(b.over.values()) / MIB)) * MIB)
               + int(a.headroom_extra_mib * MIB))
        log("headroom H = max(peak RSS - M) = " + ", ".join(f"{e} {v / MIB:.1f}" for e, v in b.over.items())
            + f" MiB, + {a.headroom_extra_mib:g} MiB -> {b.H / MIB:.0f} MiB")


def set_limits(b: Bench) -> None:
    """Each limit n = M + H - LIMITS[n] F, and the Python llama.cpp's cgroup (+ allowance)."""
    la_bytes = b.M + b.H
    b.limits = {n: {"ffn_fraction_removed": LIMITS[n], "bytes": int(la_bytes - LIMITS[n] * b.F)}
                for n in b.a.limits}
    for n, v in b.limits.items():
        v["llama_cgroup_bytes"] = v["bytes"] + b.base
        log(f"limit ({n}) = M + H - {LIMITS[n]:.2f} F = {v['bytes'] / MIB:.1f} MiB"
            + (f" (the Python llama.cpp's cgroup: + {b.base / MIB:.1f} MiB = "
               f"{v['llama_cgroup_bytes'] / MIB:.1f} MiB)" if b.llamas else ""))


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------

def summarize_runs(b: Bench) -> None:
    """b.summary: limit -> engine -> medians, with nflash's speed ratios; b.io_floor per limit."""
    b.names = ["unlimited"] + b.a.limits
    b.summary = {n: {e: summarize(b.runs[n][e], e) for e in b.engines} for n in b.names}
    nf_unlim = b.summary["unlimited"]["nflash"]["decode_tokens_per_s_median"]
    for n in b.names:
        add_ratios(b.summary[n], b.engines, b.ref, nf_unlim)
    b.io_floor = {n: offload_io_floor(b.summary[n]["nflash"], b.points) for n in b.names}


def add_ratios(s: dict, engines: list[str], ref: str | None, nf_unlim: float | None) -> None:
    """nflash's decode speed over each llama.cpp's (ratio_nflash_over_llama:
    over `ref`) and over its own without a limit, into one limit's summary."""
    nf = s["nflash"]["decode_tokens_per_s_median"]
    for e, key in ((ref, "ratio_nflash_over_llama"), (NATIVE, "ratio_nflash_over_llama_native"),
                   ("llama.cpp", "ratio_nflash_over_llama_python")):
        if e in engines:
            ll = s[e]["decode_tokens_per_s_median"]
            s[key] = nf / ll if nf and ll else None
    s["ratio_nflash_over_nflash_unlimited"] = nf / nf_unlim if nf and nf_unlim else None


def offload_io_floor(s: dict, points: list) -> dict | None:
    """stats.io_floor and the I/O wait per token (nflash's io_wait_share x the measured time)."""
    f = io_floor(s, points)
    if f is not None:
        f["io_wait_ms_per_token"] = ((s["io_wait_share_median"] or 0) * f["measured_ms_per_token"]
                                     if s["io_wait_share_median"] is not None else None)
    return f


def compute_targets(b: Bench) -> None:
    """b.targets at TARGET_LIMIT (None if it was not run): nflash / the
    reference llama.cpp, nflash / nflash unlimited, OOM kills; the Python
    llama.cpp's figures for reference when the native one is the reference."""
    if TARGET_LIMIT not in b.summary:
        b.targets = None
        return
    c = b.summary[TARGET_LIMIT]
    kills = {e: c[e]["oom-killed"] for e in ("nflash", b.ref) if e in b.engines}
    r_ll = c.get("ratio_nflash_over_llama")
    r_un = c["ratio_nflash_over_nflash_unlimited"]
    b.targets = {
        "llama_reference": b.ref,
        "nflash_over_llama": {"value": r_ll, "target": TARGET_VS_LLAMA, "engine": b.ref,
                              "pass": r_ll is not None and r_ll >= TARGET_VS_LLAMA},
        "nflash_over_nflash_unlimited": {"value": r_un, "target": TARGET_VS_UNLIMITED,
                                         "pass": r_un is not None and r_un >= TARGET_VS_UNLIMITED},
        "oom_kills": {"value": kills, "target": 0, "pass": sum(kills.values()) == 0},
        "nflash_refused": c["nflash"]["refused"],
    }
    if b.ref == NATIVE and "llama.cpp" in b.engines:
        b.targets["reference_python_llama"] = {
            "nflash_over_llama_python": c.get("ratio_nflash_over_llama_python"),
            "oom_kills": c["llama.cpp"]["oom-killed"],
            "cgroup_limit_bytes": c["llama.cpp"]["cgroup_limit_bytes"]}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

TABLE_HEADER = ["limit", "limit MiB", "engine", "cgroup MiB", "decode tok/s", "x llama", "p50 ms",
                "p99 ms", "hit rate", "KiB read/tok", "MiB read/run", "I/O wait", "peak cg MiB", "runs"]


def table_row(b: Bench, n: str, e: str) -> list[str]:
    s = b.summary[n][e]
    lim = b.limits.get(n, {}).get("bytes")
    ratio = b.summary[n].get("ratio_nflash_over_llama") if e == "nflash" else None
    rd = s["bytes_read_per_token_median"]
    rb = s["read_bytes_run_median"]
    return [
        n, fmt(lim / MIB if lim else None), e,
        fmt(s["cgroup_limit_bytes"] / MIB if s["cgroup_limit_bytes"] else None),
        fmt(s["decode_tokens_per_s_median"]), fmt(ratio, 2),
        fmt(s["latency_ms_p50_median"], 1), fmt(s["latency_ms_p99_median"], 1),
        fmt(s.get("cache_hit_rate_median"), 3), fmt(rd / 1024 if rd is not None else None),
        fmt(rb / MIB if rb is not None else None),
        "-" if s.get("io_wait_share_median") is None else f"{100 * s['io_wait_share_median']:.0f}%",
        fmt(s["cgroup_peak_bytes_max"] / MIB if s["cgroup_peak_bytes_max"] else None),
        status_cell(s)]


def print_results(b: Bench) -> None:
    """The table of every limit and engine, under its two heading lines."""
    a = b.a
    rows = [table_row(b, n, e) for n in b.names for e in b.engines]
    print()
    print(f"SmolLM2-135M-Instruct q4_0: medians of {a.runs} cold runs per row (page cache dropped "
          f"before each), {a.threads} threads, ctx {a.ctx}, {b.llama_prompt_tokens or '~' + str(a.prompt_tokens)}"
          f"-token prompt, {a.tokens} generated tokens")
    print(f"M = {b.M / MIB:.1f} MiB (q4_0 GGUF), F = {b.F / MIB:.1f} MiB (FFN of the sparse pack), "
          f"H = {b.H / MIB:.0f} MiB; limit = M + H - k F, k = 0 / 0.25 / 0.5 / 0.75 for a / b / c / d")
    print_table(rows, TABLE_HEADER, left=3)


def print_notes(b: Bench) -> None:
    """What the columns and each engine's rows mean."""
    a = b.a
    print(f"x llama = nflash / {b.ref or 'llama.cpp'} decode tok/s; KiB read/tok (decode only): nflash's "
          "own count (--stats-json), the Python llama.cpp's /proc/self/io read_bytes during decode "
          "(not available for the native binary); MiB read/run: the process's storage reads over "
          "the whole run, model load included (rusage ru_inblock x 512 = /proc/PID/io read_bytes "
          "at exit); peak cg = the cgroup's max_usage_in_bytes (page cache included), max over runs")
    if NATIVE in b.engines:
        print(f"'{NATIVE}' = {a.llama_native} (llama-completion, built by scripts/bench_setup.sh from "
              "the llama.cpp source that llama-cpp-python vendors, natively): its cgroup is "
              "limited to exactly the limit, no allowance; decode tok/s from its timing lines "
              "timings (eval runs / eval time, the counters the Python worker divides too); no "
              "per-token latencies.")
    if b.llamas:
        print_python_llama_note(b)
    if any(e != "nflash" for e in b.engines):
        print("llama.cpp reads its weights in place from the mmapped GGUF (load_mode mmap, no "
              "repacking: llama.cpp's default repacks Q4_0 into an anonymous copy that cannot be "
              f"paged out; --llama-repack adds that as '{LLAMA_REPACK}'); read-ahead of the disk "
              f"holding the GGUF: {b.ra_kb if b.ra_kb is not None else '?'} KiB per page-fault read.")
    print("unlimited rows: cold page cache too, no memory limit (a cgroup without a limit, only to "
          "measure the peak); nflash without --memory-budget holds the whole pack in memory.")


def print_python_llama_note(b: Bench) -> None:
    a = b.a
    print("'llama.cpp' runs in a Python process (llama-cpp-python"
          + (", kept for reference" if NATIVE in b.engines else "")
          + f"): its cgroup limit is the limit + {b.base / MIB:.1f} MiB, "
          f"the interpreter's {'RSS' if a.llama_allowance == 'rss' else 'anonymous RSS'} before "
          f"the model loads (median of the unlimited runs: RSS {b.base_rss / MIB:.1f} MiB, of which "
          f"{b.base_anon / MIB:.1f} MiB anonymous and {(b.base_rss - b.base_anon) / MIB:.1f} MiB "
          f"file-backed); its peak cg includes that."
          + (" The file-backed part (shared libraries, mostly cold after import) can be evicted, "
             "so llama.cpp can use much of it for the model: --llama-allowance anon gives only "
             "the anonymous part." if a.llama_allowance == "rss" else ""))


def print_targets(b: Bench) -> None:
    """The targets at TARGET_LIMIT, PASS or MISS each."""
    if b.targets is None:
        print(f"(no targets check: limit ({TARGET_LIMIT}) was not run)")
        return
    c, t, ref = b.summary[TARGET_LIMIT], b.targets, b.ref
    nf = c["nflash"]
    nf_unlim = b.summary["unlimited"]["nflash"]["decode_tokens_per_s_median"]
    print()
    print(f"targets at ({TARGET_LIMIT}) = {b.limits[TARGET_LIMIT]['bytes'] / MIB:.1f} MiB "
          f"(M + H - 0.5 F, PowerInfer-2's main setting):")
    if ref:
        print(f"  (computed against '{ref}'"
              + (": the native llama-completion binary, its cgroup limited to exactly the limit)"
                 if ref == NATIVE else ": the Python llama.cpp, its cgroup limited to the limit + "
                 f"{b.base / MIB:.1f} MiB allowance; no native binary)"))
        print(f"  nflash / {ref} decode{' ' * max(1, 20 - len(ref))}{fmt(t['nflash_over_llama']['value'], 2):>6}  "
              f"(target >= {TARGET_VS_LLAMA})   {pass_miss(t['nflash_over_llama']['pass'])}   "
              f"[{fmt(nf['decode_tokens_per_s_median'])} vs "
              f"{fmt(c[ref]['decode_tokens_per_s_median'])} tok/s]")
    else:
        print("  nflash / llama.cpp decode    n/a (--skip-llama)")
    print(f"  nflash / nflash unlimited    {fmt(t['nflash_over_nflash_unlimited']['value'], 2):>6}  "
          f"(target >= {TARGET_VS_UNLIMITED})   {pass_miss(t['nflash_over_nflash_unlimited']['pass'])}   "
          f"[{fmt(nf['decode_tokens_per_s_median'])} vs {fmt(nf_unlim)} tok/s]")
    kills = t["oom_kills"]
    print("  out-of-memory kills          "
          + ", ".join(f"{e} {k}/{c[e]['runs']}" for e, k in kills["value"].items())
          + f"  (target 0)   {pass_miss(kills['pass'])}"
          + (f"; nflash refused the budget in {nf['refused']} runs" if nf["refused"] else ""))
    if "reference_python_llama" in t:
        print(f"  for reference, the Python llama.cpp (cgroup + {b.base / MIB:.1f} MiB allowance): "
              f"nflash / llama.cpp {fmt(t['reference_python_llama']['nflash_over_llama_python'], 2)} "
              f"[{fmt(nf['decode_tokens_per_s_median'])} vs "
              f"{fmt(c['llama.cpp']['decode_tokens_per_s_median'])} tok/s], "
              f"OOM kills {c['llama.cpp']['oom-killed']}/{c['llama.cpp']['runs']}")


def print_io_floor(b: Bench) -> None:
    """The I/O floor: at (c) as the issue asks, and at the other limits for context."""
    print()
    print("I/O floor of nflash = bytes read per token / disk bandwidth (`nflash probe`: random O_DIRECT "
          "reads at the average read size, best in-flight count, log2-interpolated):")
    for n in b.names:
        print(io_floor_line(b, n))


def io_floor_line(b: Bench, n: str) -> str:
    f = b.io_floor.get(n)
    s = b.summary[n]["nflash"]
    tag = f"({n})" if n != "unlimited" else n
    mark = "  <- target limit" if n == TARGET_LIMIT else ""
    if f and f["floor_ms_per_token"]:
        return (f"  {tag:9s} {f['bytes_per_token'] / 1024:8.1f} KiB/token in {f['reads_per_token']:5.1f} "
                f"reads of {f['avg_read_bytes'] / 1024:6.1f} KiB at {f['random_mb_s']:5.0f} MB/s -> floor "
                f"{f['floor_ms_per_token']:6.2f} ms/token; measured {f['measured_ms_per_token']:6.2f} "
                f"ms/token = {f['measured_over_floor']:4.1f}x the floor"
                + (f" (I/O wait {f['io_wait_ms_per_token']:.2f} ms)" if f["io_wait_ms_per_token"] is not None
                   else "") + mark)
    if f:
        return f"  {tag:9s} no bandwidth figure in {b.probe_path}{mark}"
    if s["ok"]:
        return f"  {tag:9s} nothing read from disk during decode{mark}"
    return f"  {tag:9s} no nflash run completed ({status_cell(s)}){mark}"


def print_warnings(b: Bench) -> None:
    """What nflash said it needed where it refused a budget; contended runs; a rebuilt binary."""
    for n in b.names:
        why = [refusal_detail(r["stderr"]) for r in b.runs[n]["nflash"] if r["outcome"] == "refused"]
        if why and why[-1]:
            print(f"nflash refused ({n}) = {b.limits[n]['bytes'] / MIB:.1f} MiB: {why[-1]}")
    if b.busy_runs:
        print(f"WARNING: {b.busy_runs} runs started while other work kept the CPUs > "
              f"{BUSY_LIMIT:.0%} busy: those numbers are not reliable")
    for w in b.runner.warnings:
        print("WARNING: " + w)


# --------------------------------------------------------------------------
# Plot and JSON
# --------------------------------------------------------------------------

def write_outputs(b: Bench) -> None:
    """OUT/offload.png and OUT/results.json; the benchmark's wall time."""
    a, out = b.a, b.out
    png = out / "offload.png"
    title = (f"SmolLM2-135M-Instruct q4_0, {a.threads} threads, {a.tokens} tokens, cgroup v1 limits "
             f"(cold runs, medians of {a.runs})")
    err = plot(png, b.summary, b.limits, b.engines, title)
    if err:
        log(err)
    wall = time.perf_counter() - b.t_start
    (out / "results.json").write_text(json.dumps(results_json(b, wall), indent=1) + "\n")
    log(f"wrote {out / 'results.json'}" + ("" if err else f" and {png}"))
    t_prep = b.t_prep
    log(f"whole benchmark: {wall // 60:.0f} min {wall % 60:.0f} s (models and disk probe "
        f"{t_prep // 60:.0f} min {t_prep % 60:.0f} s, runs {(wall - t_prep) // 60:.0f} min "
        f"{(wall - t_prep) % 60:.0f} s)")


def results_json(b: Bench, wall: float) -> dict:
    a = b.a
    return {
        **run_info(a),
        "prompt_text": b.text, "prompt_tokens_llama": b.llama_prompt_tokens,
        "models": {"gguf": str(b.gguf), "pack": str(b.pack), "model_bytes_M": b.M, "ffn_bytes_F": b.F,
                   "pack_bytes": b.pack.stat().st_size,
                   "pack_segments": b.inspect.get("segments")},
        "headroom_bytes_H": b.H, "headroom_measured_bytes": b.over,
        "llama_python_baseline_rss_bytes": b.base_rss,
        "llama_python_baseline_rss_anon_bytes": b.base_anon,
        "llama_cgroup_allowance_bytes": b.base,
        "llama_weights": {e: LLAMA_WEIGHTS[e] for e in b.engines if e != "nflash"},
        "llama_native": {"binary": str(a.llama_native), "cmd": native_llama_cmd(
            a.llama_native, b.gguf, b.prompt_file, a.tokens, a.threads, a.ctx)} if NATIVE in b.engines
        else None,
        "llama_reference_engine": b.ref,
        "gguf_device_read_ahead_kb": b.ra_kb,
        "limits": b.limits,
        "probe": {"path": str(b.probe_path), "source": b.probe.get("source"), "flash_read": b.points},
        "summary": b.summary, "targets": b.targets, "io_floor": b.io_floor,
        "warnings": b.runner.warnings, "contended_runs": b.busy_runs,
        "wall_s": wall, "prepare_s": b.t_prep,
        "runs": b.runs,
    }


PLOT_COLORS = {"nflash": "tab:blue", NATIVE: "tab:green", "llama.cpp": "tab:orange",
               LLAMA_REPACK: "tab:red"}


def plot(path: Path, summary: dict, limits: dict, engines: list[str], title: str) -> str | None:
    """Decode tok/s against the limit, one line per engine; None, or why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is missing ({e}); run scripts/bench_setup.sh"
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [n for n in LIMITS if n in limits]
    ys_all = []
    for k, e in enumerate(engines):
        ys_all += _plot_engine(ax, k, e, summary, limits, names)
    for n in names:
        x = limits[n]["bytes"] / MIB
        ax.axvline(x, color="0.85", lw=0.8, zorder=0)
        ax.annotate(f"({n})", (x, 1.0), xycoords=("data", "axes fraction"), ha="center",
                    va="bottom", fontsize=9)
    if ys_all:
        ax.set_yscale("log")
    ax.set_xlabel("memory limit, MiB (Python llama.cpp: + interpreter allowance)")
    ax.set_ylabel("decode tokens/s (median; bars: min-max)")
    ax.set_title(title, fontsize=10, pad=18)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _plot_engine(ax, k: int, e: str, summary: dict, limits: dict, names: list[str]) -> list[float]:
    """Engine e's medians (min-max bars), its unlimited speed as a dashed line,
    and why it has no point at a limit; returns the speeds drawn."""
    xs, ys, lo, hi, bad_x = [], [], [], [], []
    for n in names:
        s = summary[n][e]
        x = limits[n]["bytes"] / MIB
        v = s["decode_tokens_per_s_median"]
        if v is None:
            bad_x.append((x, "refused" if s["refused"] else "killed" if s["oom-killed"]
                          else "timeout" if s["timeout"] else "error"))
            continue
        xs.append(x)
        ys.append(v)
        lo.append(v - s["decode_tokens_per_s_min_max"][0])
        hi.append(s["decode_tokens_per_s_min_max"][1] - v)
    drawn = list(ys)
    if xs:
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=PLOT_COLORS[e], label=e)
    u = summary["unlimited"][e]["decode_tokens_per_s_median"]
    if u:
        ax.axhline(u, ls="--", lw=1, color=PLOT_COLORS[e], label=f"{e}, no limit")
        drawn.append(u)
    for x, why in bad_x:
        ax.annotate(f"{e}: {why}", (x, 0.02), xycoords=("data", "axes fraction"),
                    xytext=(10 * k - 10, 0), textcoords="offset points",
                    rotation=90, color=PLOT_COLORS[e], fontsize=8, ha="center", va="bottom")
    return drawn
