"""cgroup v1 memory groups: the root check, one run in a fresh group (page
cache dropped first, the group's peaks read afterwards), and clean-up of the
groups a run leaves behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from .common import MIB, log
from .proc import run_measured_ru

CG_ROOT = Path("/sys/fs/cgroup/memory")
# Every group is CG_PREFIX-<pid of the benchmark>-<n>; bench_scale.py uses the same prefix.
CG_PREFIX = "nflash-bench-offload"

_seq = 0


def need_root(target: str = "bench-offload") -> None:
    """Exits with status 2 unless we are root with a usable cgroup v1 memory controller."""
    why = _root_problem()
    if why:
        print(f"make {target} needs root and a cgroup v1 memory controller: " + why + ".\n"
              f"Run it as root on a machine with {CG_ROOT} mounted (cgroup v1), e.g. `sudo make "
              f"{target}`.", file=sys.stderr)
        sys.exit(2)


def _root_problem() -> str | None:
    """Why this process cannot run the cgroup benchmarks (None if it can)."""
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}, not root"
    if not (CG_ROOT / "memory.limit_in_bytes").exists():
        return f"{CG_ROOT} is not a cgroup v1 memory hierarchy (no memory.limit_in_bytes)"
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "/proc/sys/vm/drop_caches is not writable"
    return _try_limited_group()


def _try_limited_group() -> str | None:
    """Makes and limits a throwaway group; says why that failed (None if it worked)."""
    why = None
    probe = CG_ROOT / f"{CG_PREFIX}-{os.getpid()}-check"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(64 * MIB))
    except OSError as e:
        why = f"cannot create and limit a memory cgroup under {CG_ROOT}: {e}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return why


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def remove_group(d: Path) -> None:
    """Kills whatever is left in the group (only processes this script started
    can be there) and removes it, retrying while the kernel finishes the exit."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        except OSError:
            pids = []
        _kill_all(pids)
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    log(f"warning: could not remove cgroup {d}; remove it with `rmdir {d}`")


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale_groups() -> None:
    """Groups of an earlier run of this script that died without cleaning up."""
    for d in CG_ROOT.glob(CG_PREFIX + "-*"):
        pid = d.name[len(CG_PREFIX) + 1:].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            log(f"removing stale cgroup {d}")
            remove_group(d)


def cg_read(d: Path, name: str) -> int | None:
    try:
        return int((d / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def memory_stat(d: Path) -> dict:
    """A few fields of the group's memory.stat after the run (page cache left charged, faults)."""
    keep = ("cache", "rss", "mapped_file", "pgmajfault", "total_pgmajfault")
    try:
        return {k: int(v) for k, v in (l.split() for l in (d / "memory.stat").read_text().splitlines())
                if k in keep}
    except (OSError, ValueError):
        return {}


def oom_kills(d: Path) -> int | None:
    try:
        for line in (d / "memory.oom_control").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
    except (OSError, ValueError):
        pass
    return None


def run_in_cgroup(cmd: list[str], limit: int | None, timeout: float) -> dict:
    """Drops the page cache, runs cmd inside a fresh memory cgroup (limited to
    `limit` bytes, or unlimited), returns exit status, peaks and outputs."""
    d = new_group(limit)
    try:
        drop_caches()
        wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(d / "cgroup.procs"), *cmd]
        code, ru, so, se, wall = run_measured_ru(wrapped, timeout)
        return {"exit": code, "peak_rss_bytes": ru.ru_maxrss * 1024, "stdout": so, "stderr": se,
                "wall_s": wall,
                # The whole run's storage reads (model load included): ru_inblock
                # is the exited process's /proc/PID/io read_bytes / 512.
                "read_bytes_run": ru.ru_inblock * 512,
                "cgroup_limit_bytes": limit,
                **_group_figures(d)}
    finally:
        remove_group(d)


def new_group(limit: int | None) -> Path:
    """A fresh group, limited to `limit` bytes (memory and memory + swap)
    unless None; remove it with remove_group (remove_stale_groups finds it
    if this process dies first)."""
    d = _new_group()
    if limit is not None:
        _set_limit(d, limit)
    return d


def _new_group() -> Path:
    global _seq
    _seq += 1
    d = CG_ROOT / f"{CG_PREFIX}-{os.getpid()}-{_seq}"
    d.mkdir()
    return d


def _set_limit(d: Path, limit: int) -> None:
    """Memory, and memory + swap where the kernel has it (so swap cannot hide the limit)."""
    (d / "memory.limit_in_bytes").write_text(str(limit))
    if (d / "memory.memsw.limit_in_bytes").exists():
        (d / "memory.memsw.limit_in_bytes").write_text(str(limit))


def _group_figures(d: Path) -> dict:
    """The group's peaks, failures and OOM kills after the run."""
    return {"cgroup_peak_bytes": cg_read(d, "memory.max_usage_in_bytes"),
            "cgroup_memsw_peak_bytes": cg_read(d, "memory.memsw.max_usage_in_bytes"),
            "cgroup_failcnt": cg_read(d, "memory.failcnt"),
            "cgroup_oom_kills": oom_kills(d),
            "cgroup_memory_stat_at_exit": memory_stat(d)}
