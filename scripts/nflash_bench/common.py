"""What every part of the benchmarks uses: the repository root, log and die
under the running benchmark's name, number formatting, medians, whether a
cached file is fresh, and the `when` / `machine` / `args` fields of a results
file."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
MIB = 1 << 20

# Prefix of log/die messages; each benchmark driver sets its own name.
PROG = "bench"


def die(msg: str, code: int = 1) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", flush=True)


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def newer(a: Path, *deps: Path) -> bool:
    """a exists and is newer than every existing dep."""
    if not a.exists():
        return False
    m = a.stat().st_mtime
    return all(not d.exists() or m > d.stat().st_mtime for d in deps)


def run_info(a) -> dict:
    """`when`, `machine` and `args` fields of a results.json."""
    import platform
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                 if l.startswith("model name")), None)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
    }
