"""Running one process and measuring it (exit status, its own rusage, output,
wall time), and checking that the CPUs are idle before a timed run."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

from .common import log

# A run that starts while the CPUs are busier than this is marked [CONTENDED].
BUSY_LIMIT = 0.15


def run_measured(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, int, str, str, float]:
    """Runs cmd; returns (exit status, ru_maxrss bytes, stdout, stderr, wall s).

    Exit status: 0.., -SIGNAL if a signal ended it, -1 if it ran past `timeout`
    seconds (it is then killed).

    os.wait4 gives this child's own rusage, so peak RSS is per run (unlike
    RUSAGE_CHILDREN, which is the max over every child so far).
    """
    code, ru, so, se, wall = run_measured_ru(cmd, timeout, env)
    return code, ru.ru_maxrss * 1024, so, se, wall


def run_measured_ru(cmd: list[str], timeout: float, env: dict | None = None):
    """run_measured, but returns the child's whole rusage (os.wait4) in place of
    the peak RSS: (exit status, rusage, stdout, stderr, wall s). On Linux
    ru_inblock is the process's storage read_bytes / 512 (/proc/PID/io, which
    is gone once it has exited; mmap page-fault reads included)."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env)
        status, ru = _reap(p, timeout)
        wall = time.perf_counter() - t0
        p.returncode = 0  # reaped by wait4 in _reap; stop Popen from waiting again
        code = os.waitstatus_to_exitcode(status) if status != -1 else -1
        fo.seek(0)
        fe.seek(0)
        return (code, ru, fo.read().decode("utf-8", "replace"),
                fe.read().decode("utf-8", "replace"), wall)


def _reap(p: subprocess.Popen, timeout: float):
    """Waits for p with os.wait4: (wait status, rusage); the status is -1 if p
    ran past `timeout` seconds and was killed."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                return status, ru
            if time.monotonic() > deadline:
                p.kill()
                _, _, ru = os.wait4(p.pid, 0)
                return -1, ru
            time.sleep(0.01)
    except BaseException:  # Ctrl-C or any error: never leave the child running
        if p.returncode is None:
            p.kill()
            p.wait()
        raise


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all CPUs busy over `interval` seconds (from /proc/stat)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(interval)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(max_wait: float) -> float:
    """Waits up to max_wait s for the CPUs to be idle; returns the last busy fraction."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > BUSY_LIMIT and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def warn_if_loaded(consequence: str) -> None:
    """Warns when the 1-min load average is over half the CPUs before starting."""
    la = loadavg()
    if la > 0.5 * (os.cpu_count() or 1):
        log(f"warning: 1-min load average is {la:.2f} on {os.cpu_count()} CPUs before starting: "
            + consequence)
