"""Medians of the cgroup runs of one engine at one limit, and nflash's I/O
floor (bytes read per token / the disk's bandwidth at that read size)."""

from __future__ import annotations

from .common import median
from .disk import random_bw_mb_s

OUTCOMES = ("ok", "oom-killed", "refused", "timeout", "error")


def summarize(runs: list[dict], engine: str) -> dict:
    """Counts per outcome and medians over the ok runs (cgroup peak: max over all runs)."""
    ok = [r for r in runs if r["outcome"] == "ok"]
    st = lambda k: median([r["stats"].get(k) for r in ok])
    counts = {o: sum(r["outcome"] == o for r in runs) for o in OUTCOMES}
    dec = [r["stats"]["decode_tokens_per_s"] for r in ok]
    s = {"runs": len(runs), **counts,
         "decode_tokens_per_s_median": median(dec),
         "decode_tokens_per_s_min_max": [min(dec), max(dec)] if dec else None,
         "prefill_tokens_per_s_median": st("prefill_tokens_per_s"),
         "latency_ms_p50_median": st("latency_ms_p50"),
         "latency_ms_p99_median": st("latency_ms_p99"),
         "bytes_read_per_token_median": st("bytes_read_per_token"),
         "read_bytes_run_median": median([r.get("read_bytes_run") for r in ok]),
         "cgroup_peak_bytes_max": max((r["cgroup_peak_bytes"] or 0 for r in runs), default=None),
         "cgroup_peak_bytes_median": median([r["cgroup_peak_bytes"] for r in ok]),
         "peak_rss_bytes_median": median([r["peak_rss_bytes"] for r in ok]),
         "cgroup_failcnt_median": median([r["cgroup_failcnt"] for r in ok]),
         "cgroup_limit_bytes": runs[0]["cgroup_limit_bytes"] if runs else None}
    if engine == "nflash":
        for k in ("cache_hit_rate", "hot_hit_rate", "reads_per_token", "io_wait_share", "hot_bytes", "cold_bytes",
                  "expert_prefetch_precision", "expert_prefetch_recall", "misses_read_ahead", "misses_read_early"):
            s[k + "_median"] = st(k)
        s["o_direct"] = [r["stats"].get("o_direct") for r in ok]
    else:
        s["major_faults_per_token_median"] = st("major_faults_per_token")
        s["python_baseline_rss_bytes_median"] = st("python_baseline_rss_bytes")
    return s


def status_cell(s: dict) -> str:
    """"2/3 ok (1 oom-killed)": the outcomes of a summary."""
    bad = [f"{s[k]} {k}" for k in OUTCOMES[1:] if s[k]]
    return f"{s['ok']}/{s['runs']} ok" + (" (" + ", ".join(bad) + ")" if bad else "")


def io_floor(s: dict, points: list) -> dict | None:
    """nflash's I/O floor from its summary `s` and the probe's read points: the
    time per token the reads alone would take at the disk's random-read
    bandwidth at the average read size (None without reads or decode speed)."""
    b, rd, dec = s["bytes_read_per_token_median"], s.get("reads_per_token_median"), s["decode_tokens_per_s_median"]
    if not b or not rd or not dec:
        return None
    size = b / rd
    bw = random_bw_mb_s(points, size)
    floor_ms = b / (bw * 1e6) * 1e3 if bw else None
    meas = 1e3 / dec
    return {"bytes_per_token": b, "reads_per_token": rd, "avg_read_bytes": size, "random_mb_s": bw,
            "floor_ms_per_token": floor_ms, "measured_ms_per_token": meas,
            "measured_over_floor": meas / floor_ms if floor_ms else None}
