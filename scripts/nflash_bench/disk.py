"""The disk as the offload benchmarks see it: `nflash probe` (random O_DIRECT
reads by block size and queue depth), the bandwidth at a given read size,
and the read-ahead of the device holding a file."""

from __future__ import annotations

import math
import os
import subprocess
import time
import tomllib
from pathlib import Path

from .common import die, log


def run_probe(a, out: Path, name: str = "probe.toml") -> Path:
    """`nflash probe` into out/name, or a.probe when given."""
    if a.probe:
        if not a.probe.exists():
            die(f"--probe {a.probe} does not exist")
        log(f"using the disk profile {a.probe} (no new measurement)")
        return a.probe
    dst = out / name
    cmd = [str(a.nflash), "probe", "--out", str(dst), "--dir", str(a.cache_dir)]
    log("measuring the disk: " + " ".join(cmd))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        die(f"nflash probe failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    log(f"  done in {time.perf_counter() - t0:.1f} s -> {dst}")
    return dst


def load_probe(path: Path) -> tuple[dict, list[dict]]:
    """The probe profile and its [[flash.read]] points (block_bytes, random_mb_s, ...)."""
    probe = tomllib.loads(path.read_text())
    return probe, probe.get("flash", {}).get("read", [])


def random_bw_mb_s(points: list[dict], block: float) -> float | None:
    """Best random_mb_s over in-flight counts, linear in log2(block size)
    between measured sizes, clamped at the ends (the planner's rule)."""
    best: dict[int, float] = {}
    for p in points:
        b = int(p["block_bytes"])
        best[b] = max(best.get(b, 0.0), float(p["random_mb_s"]))
    if not best or not block or block <= 0:
        return None
    xs = sorted(best)
    if block <= xs[0]:
        return best[xs[0]]
    if block >= xs[-1]:
        return best[xs[-1]]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= block <= hi:
            t = (math.log2(block) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return best[lo] + t * (best[hi] - best[lo])
    return None


def read_ahead_kb(path: Path) -> int | None:
    """read_ahead_kb of the block device holding `path`: the kernel reads up to
    this much around each major page fault of an mmapped file."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for q in (dev / "queue", dev / ".." / "queue"):
        try:
            return int((q / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None
