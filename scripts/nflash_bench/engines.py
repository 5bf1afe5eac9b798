"""The engines of the offload benchmarks, each run in a fresh memory cgroup
(cgroup.run_in_cgroup): nflash (`nflash run`, --memory-budget), the native
llama.cpp (llama-completion) and the Python llama.cpp (worker.py), and how a
run ended (ok, oom-killed, refused, timeout, error)."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from .cgroup import run_in_cgroup
from .common import log
from .llama import native_llama_cmd, parse_native_llama
from .proc import wait_idle
from .worker import worker_cmd

# "llama.cpp native": llama-completion of the native build of
# scripts/bench_setup.sh (whose libllama.so llama-cpp-python loads), in a cgroup limited to
# exactly the limit L; "llama.cpp": llama-cpp-python in a Python process, whose
# cgroup gets L + the interpreter's allowance (kept for reference).
NATIVE = "llama.cpp native"
# --llama-repack (bench_offload.py) adds llama.cpp with its default weight handling.
LLAMA_REPACK = "llama.cpp repack"
LLAMA_WEIGHTS = {NATIVE: "mmap", "llama.cpp": "mmap", LLAMA_REPACK: "default"}
PY_LLAMAS = ("llama.cpp", LLAMA_REPACK)  # the engines that run inside a Python process
# nflash's refusal: "memory budget ... short of the fixed region ..." or "... short of the minimum ...".
REFUSED_RE = re.compile(r"memory budget\b.*\bshort of\b")


def refusal_detail(stderr: str) -> str | None:
    """What nflash's "memory budget ... short of ..." error says it needs."""
    for line in stderr.splitlines():
        m = REFUSED_RE.search(line)
        if m:
            return line[m.start():].split(";")[0].strip()
    return None


def outcome(r: dict, refused_ok: bool) -> str:
    if r["exit"] == -1:
        return "timeout"
    if r["exit"] == -signal.SIGKILL or (r["cgroup_oom_kills"] or 0) > 0:
        return "oom-killed"
    if r["exit"] != 0:
        return "refused" if refused_ok and REFUSED_RE.search(r["stderr"]) else "error"
    return "ok"


def bin_stamp(p: Path):
    try:
        st = p.stat()
        return (st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        return None


class Runner:
    """One run of an engine on one model at one limit (None: no limit)."""

    def __init__(self, a, pack: Path, gguf: Path, prompt_file: Path, tmpdir: Path):
        self.a, self.pack, self.gguf, self.prompt_file, self.tmpdir = a, pack, gguf, prompt_file, tmpdir
        self.nflash_stamp = bin_stamp(a.nflash)
        self.warnings: list[str] = []

    def _check_binary(self) -> None:
        s = bin_stamp(self.a.nflash)
        if s != self.nflash_stamp:
            w = (f"{self.a.nflash} changed during the benchmark (rebuilt?): later nflash runs use "
                 f"the new binary")
            log("warning: " + w)
            self.warnings.append(w)
            self.nflash_stamp = s

    def _wait_binary(self) -> None:
        """Waits (up to 10 min) until the nflash binary exists and stops changing."""
        deadline = time.monotonic() + 600
        last = bin_stamp(self.a.nflash)
        while time.monotonic() < deadline:
            time.sleep(5)
            now = bin_stamp(self.a.nflash)
            if now is not None and now == last:
                return
            last = now

    def _nflash_cmd(self, stats_json: Path, limit: int | None) -> list[str]:
        a = self.a
        cmd = [str(a.nflash), "run", "--model", str(self.pack), "--raw", "--prompt-file", str(self.prompt_file),
               "--max-tokens", str(a.tokens), "--temperature", "0", "--ignore-eos",
               "--ctx", str(a.ctx), "--threads", str(a.threads), "--stats-json", str(stats_json)]
        if limit is not None:
            cmd += ["--memory-budget", f"{limit}B"]
        if getattr(a, "nflash_device", None):
            cmd += ["--device", str(a.nflash_device)]
        return cmd

    def nflash(self, limit: int | None) -> dict:
        """`nflash run` with --memory-budget limit in a cgroup limited to limit;
        retried (3 tries) while its binary is being rebuilt."""
        j = self.tmpdir / "nflash-stats.json"
        cmd = self._nflash_cmd(j, limit)
        for attempt in range(3):
            self._check_binary()
            j.unlink(missing_ok=True)
            r = run_in_cgroup(cmd, limit, self.a.timeout)
            r["outcome"] = outcome(r, refused_ok=True)
            if r["outcome"] == "ok" and not j.exists():
                r["outcome"] = "error"
            if not self._binary_changing(r):
                break
            log(f"nflash failed (exit {r['exit']}) and its binary is changing: waiting for the "
                f"build to settle, then retrying ({attempt + 1}/3)")
            self._wait_binary()
        r["cmd"] = cmd
        if r["outcome"] == "ok":
            r["stats"] = json.loads(j.read_text())
        return r

    def _binary_changing(self, r: dict) -> bool:
        """A binary being rebuilt under us (missing, "Text file busy", changed)."""
        return r["outcome"] == "error" and (bin_stamp(self.a.nflash) != self.nflash_stamp
                                            or r["exit"] in (126, 127))

    def native(self, limit: int | None) -> dict:
        """llama-completion in a cgroup limited to exactly `limit` (no allowance)."""
        a = self.a
        cmd = native_llama_cmd(a.llama_native, self.gguf, self.prompt_file, a.tokens, a.threads,
                               a.ctx)
        r = run_in_cgroup(cmd, limit, a.timeout)
        r["outcome"] = outcome(r, refused_ok=False)
        s = parse_native_llama(r["stderr"]) if r["outcome"] == "ok" else None
        if r["outcome"] == "ok" and s is None:
            r["outcome"] = "error"
        r["cmd"] = cmd
        if s is not None:
            s["vm_hwm_bytes"] = r["peak_rss_bytes"]
            r["stats"] = s
        return r

    def llama(self, limit: int | None, baseline: int, weights: str) -> dict:
        """The Python llama.cpp (the _llama-run worker) in a cgroup limited to limit + baseline."""
        a = self.a
        j = self.tmpdir / "llama-stats.json"
        j.unlink(missing_ok=True)
        cmd = worker_cmd("_llama-run", self.gguf, self.prompt_file, a.tokens, a.threads, a.ctx, j,
                         weights)
        r = run_in_cgroup(cmd, None if limit is None else limit + baseline, a.timeout)
        r["outcome"] = outcome(r, refused_ok=False)
        if r["outcome"] == "ok" and not j.exists():
            r["outcome"] = "error"
        r["cmd"] = cmd
        if r["outcome"] == "ok":
            s = json.loads(j.read_text())
            s.pop("text", None)
            r["stats"] = s
        return r


def alternating(engines: list[str], i: int) -> list[str]:
    """The engines in the order of run i: reversed every other run, to spread drift."""
    return engines if i % 2 == 0 else engines[::-1]


def run_when_idle(wait_s: float, run, i: int) -> tuple[dict, float]:
    """run() after waiting up to wait_s for idle CPUs: its record, marked with
    the run index and the CPU busy fraction before it, and that fraction."""
    busy = wait_idle(wait_s)
    r = run()
    r.update(run=i, cpu_busy_before=busy)
    return r, busy


def slim(r: dict) -> dict:
    """A run record for results.json: outputs cut to their tail."""
    r = dict(r)
    r["stdout"] = r["stdout"][-400:]
    r["stderr"] = r["stderr"][-2000:]
    return r


def log_error_tail(r: dict) -> None:
    """The end of a failed run's stderr, indented."""
    if r["outcome"] == "error":
        log("  stderr: " + r["stderr"].strip()[-600:].replace("\n", "\n  "))
