"""The steps of scripts/bench.py: nflash against llama.cpp (llama-cpp-python)
on SmolLM2-135M, prefill and decode tokens/s and peak RSS, each run in a
fresh process, engines alternating run by run; and the sparse pack's sparse
decode against its dense decode."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .common import REPO, die, fmt, log, median, run_info
from .llama import (gguf_tensor_types, llama_builds_available, llama_builds_info,
                    llama_cpp_importable, llama_cpp_version)
from .models import prepare_llama, prepare_nflash, prepare_sparse
from .proc import BUSY_LIMIT, loadavg, run_measured, wait_idle
from .prompt import choose_prompt, write_prompt
from .table import print_table
from .worker import worker_cmd

QUANTS = ("q4_0", "q8_0")
# Engine names of the sparse pack's two modes.
SPARSE_DENSE = "nflash-sp --dense"
SPARSE = "nflash-sp sparse"
TIMING_PARTS = ("attention", "predictor", "ffn", "lm_head")
# Engine names of the llama.cpp builds (scripts/bench_setup.sh): "llama.cpp" is
# the native build, the peer every ratio is against; "llama.cpp avx2" the
# AVX2-only build, run too where it differs from the native one.
LLAMA_ENGINE = {"native": "llama.cpp", "avx2": "llama.cpp avx2"}


@dataclass
class Models:
    """Per quant: the llama.cpp GGUF, the dense nflash pack and the sparse one."""
    ggufs: dict[str, Path]
    packs: dict[str, Path]
    sparse: dict[str, Path]


# --------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------

def engines_to_run(a) -> list[str]:
    """nflash, then one engine per llama.cpp build (--llama-builds, default:
    every build scripts/bench_setup.sh made)."""
    engines = [] if a.skip_nflash else ["nflash"]
    if not a.skip_llama:
        builds = a.llama_builds or llama_builds_available() or ["native"]
        if "native" not in builds:
            die("--llama-builds must include native: every ratio is against it", 2)
        engines += [LLAMA_ENGINE[b] for b in builds]
    return engines


def check_engines(a, engines: list[str]) -> None:
    """Exits with status 2 if the nflash binary or a llama.cpp build is missing."""
    if "nflash" in engines and not a.nflash.exists():
        die(f"{a.nflash} not found: run `cargo build --release` first "
            f"(or pass --nflash PATH, or --skip-nflash for the llama.cpp half only)", 2)
    for b, e in LLAMA_ENGINE.items():
        if e in engines and not llama_cpp_importable(b):
            die(f"{sys.executable} cannot import llama_cpp with the {b} llama.cpp build: run "
                f"scripts/bench_setup.sh and use {REPO / '.venv-bench/bin/python'} scripts/bench.py", 2)


def make_dirs(out: Path) -> Path:
    """OUT and OUT/tmp (the per-run stats files); returns OUT/tmp."""
    out.mkdir(parents=True, exist_ok=True)
    tmpdir = out / "tmp"
    tmpdir.mkdir(exist_ok=True)
    return tmpdir


def prepare_models(a, out: Path, engines: list[str]) -> Models:
    return Models(ggufs=prepare_llama(a, out) if "llama.cpp" in engines else {},
                  packs=prepare_nflash(a, out) if "nflash" in engines else {},
                  sparse=prepare_sparse(a, out) if "nflash" in engines else {})


def prompt_file_for(a, out: Path, ggufs: dict[str, Path], n_tokens: int) -> tuple[str, Path]:
    """The prompt cut to n_tokens (by the first GGUF's tokenizer), in OUT/prompt-<n>.txt."""
    text, llama_prompt_tokens = choose_prompt(
        n_tokens, next(iter(ggufs.values()), None), a.timeout)
    prompt_file = write_prompt(text, out, f"prompt-{n_tokens}.txt")
    log(f"prompt: {len(text.split())} words"
        + (f", {llama_prompt_tokens} tokens by llama.cpp's tokenizer" if llama_prompt_tokens else "")
        + f" -> {prompt_file}")
    return text, prompt_file


# --------------------------------------------------------------------------
# One run of each engine
# --------------------------------------------------------------------------

def run_nflash(a, pack: Path, prompt_file: Path, tmpdir: Path, extra: tuple = ()) -> dict:
    j = tmpdir / "nflash-stats.json"
    j.unlink(missing_ok=True)
    cmd = [str(a.nflash), "run", "--model", str(pack), "--raw", "--prompt-file", str(prompt_file),
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


def run_llama(a, gguf: Path, prompt_file: Path, tmpdir: Path, build: str) -> dict:
    j = tmpdir / "llama-stats.json"
    j.unlink(missing_ok=True)
    cmd = worker_cmd("_llama-run", gguf, prompt_file, a.gen_tokens, a.threads, a.ctx, j, build=build)
    code, maxrss, so, se, wall = run_measured(cmd, a.timeout)
    if code != 0 or not j.exists():
        die(f"llama.cpp run failed (exit {code}):\n{se[-3000:]}")
    s = json.loads(j.read_text())
    if s["n_p_eval"] != s["prompt_tokens"] or s["n_eval"] != a.gen_tokens - 1:
        log(f"warning: llama.cpp perf counters n_p_eval={s['n_p_eval']} n_eval={s['n_eval']}, "
            f"expected {s['prompt_tokens']} and {a.gen_tokens - 1}")
    text = s.pop("text")
    return run_result(s, maxrss, s["vm_hwm_bytes"], wall, text)


def make_runners(a, m: Models, prompt_file: Path, tmpdir: Path) -> dict:
    """Engine name -> a function of the quant that runs it once."""
    return {"nflash": lambda q: run_nflash(a, m.packs[q], prompt_file, tmpdir),
            **{e: (lambda q, b=b: run_llama(a, m.ggufs[q], prompt_file, tmpdir, b))
               for b, e in LLAMA_ENGINE.items()},
            SPARSE_DENSE: lambda q: run_nflash(a, m.sparse[q], prompt_file, tmpdir, ("--dense",)),
            SPARSE: lambda q: run_nflash(a, m.sparse[q], prompt_file, tmpdir)}


# --------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------

def run_all(a, engines: list[str], runners: dict, label: str) -> dict:
    """Per quant: the warm-up runs, then --runs timed runs of every engine,
    alternating their order. Returns quant -> engine -> run records."""
    results: dict = {q: {e: [] for e in engines} for q in a.quant}
    for q in a.quant:
        for w in range(a.warmup):
            for e in engines:
                log(f"{q} {label} {e}: warm-up {w + 1}/{a.warmup}")
                runners[e](q)
        for i in range(a.runs):
            order = engines if i % 2 == 0 else engines[::-1]  # alternate to spread drift
            for e in order:
                results[q][e].append(timed_run(a, q, e, i, runners[e], label))
    return results


def timed_run(a, q: str, e: str, i: int, runner, label: str) -> dict:
    """Run i of engine e on quant q, after waiting for idle CPUs; logged."""
    la = loadavg()
    busy = wait_idle(a.wait_idle)
    r = runner(q)
    r["run"] = i
    r["loadavg_1m_before"] = la
    r["cpu_busy_before"] = busy
    log(f"{q} {label} {e:9s} run {i + 1}/{a.runs}: prompt {r['prompt_tokens']} tok, "
        f"prefill {r['prefill_tokens_per_s']:.1f} tok/s, decode "
        f"{r['decode_tokens_per_s']:.1f} tok/s, peak RSS "
        f"{r['peak_rss_bytes'] / 2**20:.1f} MiB (CPU {busy:.0%} busy before)"
        + ("  [CONTENDED]" if busy > BUSY_LIMIT else ""))
    return r


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------

def summarize_lengths(a, engines: list[str], per_len: dict) -> dict:
    """quant -> "prompt_<n>" -> the summary of that prompt length ([`summarize`])."""
    summary: dict = {q: {} for q in a.quant}
    for n, results in per_len.items():
        s = summarize(a, engines, results)
        for q in a.quant:
            summary[q][f"prompt_{n}"] = s[q]
    return summary


def summarize(a, engines: list[str], results: dict) -> dict:
    """quant -> engine -> medians, and the sparse/dense and nflash/llama.cpp
    ratios (against the native build, and against the AVX2 one where it ran,
    with the native/AVX2 ratio of llama.cpp itself)."""
    summary: dict = {}
    for q in a.quant:
        summary[q] = {e: engine_summary(results[q][e]) for e in engines}
        for e in (SPARSE_DENSE, SPARSE):
            if e in engines:
                summary[q][e].update(sparse_figures(results[q][e]))
        if SPARSE in engines:
            summary[q]["ratio_sparse_over_dense"] = speed_ratios(summary[q][SPARSE],
                                                                 summary[q][SPARSE_DENSE])
        if "nflash" in engines and "llama.cpp" in engines:
            n, l = summary[q]["nflash"], summary[q]["llama.cpp"]
            summary[q]["ratio_nflash_over_llama"] = speed_ratios(n, l)
            if n["prompt_tokens"] != l["prompt_tokens"]:
                log(f"note: {q}: prompt token counts differ (nflash {n['prompt_tokens']}, "
                    f"llama.cpp {l['prompt_tokens']}): tokenizers or BOS handling disagree")
        avx2 = LLAMA_ENGINE["avx2"]
        if avx2 in engines:
            summary[q]["ratio_llama_native_over_avx2"] = speed_ratios(summary[q]["llama.cpp"],
                                                                      summary[q][avx2])
            if "nflash" in engines:
                summary[q]["ratio_nflash_over_llama_avx2"] = speed_ratios(summary[q]["nflash"],
                                                                          summary[q][avx2])
    return summary


def engine_summary(rs: list[dict]) -> dict:
    return {
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


def sparse_figures(rs: list[dict]) -> dict:
    """Medians of a sparse pack's per-token decode time split, FFN sparsity and bundles skipped."""
    s = {f"{k}_ms_per_token_median": median([r["stats"].get(f"{k}_ms_per_token") for r in rs])
         for k in TIMING_PARTS}
    s["ffn_sparsity"] = median([r["stats"].get("ffn_sparsity") for r in rs])
    s["bundles_skipped"] = median([r["stats"].get("bundles_skipped") for r in rs])
    return s


def speed_ratios(s: dict, base: dict) -> dict:
    """prefill and decode median tokens/s of s over those of base."""
    return {k: s[f"{k}_tokens_per_s_median"] / base[f"{k}_tokens_per_s_median"]
            for k in ("prefill", "decode")}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def print_report(a, engines: list[str], summary: dict, per_len: dict) -> None:
    print_main_table(a, engines, summary)
    for key in summary[a.quant[0]]:
        if any(SPARSE in summary[q][key] for q in a.quant):
            print_sparse_table(a, {q: summary[q][key] for q in a.quant}, key)
    for results in per_len.values():
        print_contended(a, engines, results)
    if "llama.cpp" in engines:
        base = median([r["stats"]["python_baseline_rss_bytes"] for results in per_len.values()
                       for q in a.quant for r in results[q]["llama.cpp"]])
        print(f"(llama.cpp runs in a Python process: {base / 2**20:.0f} MiB of its peak RSS "
              f"is the interpreter + llama_cpp before the model loads)")


def print_main_table(a, engines: list[str], summary: dict) -> None:
    hdr = ["quant", "engine", "prompt tok", "prefill tok/s", "decode tok/s", "peak RSS MiB",
           "prefill ratio", "decode ratio"]
    rows = []
    for q in a.quant:
        for key, sq in summary[q].items():
            for e in engines:
                s = sq[e]
                ratio = None
                if e not in LLAMA_ENGINE.values() and "llama.cpp" in engines:
                    ratio = speed_ratios(s, sq["llama.cpp"])
                rows.append([q, e, str(int(s["prompt_tokens"])), fmt(s["prefill_tokens_per_s_median"]),
                             fmt(s["decode_tokens_per_s_median"]), fmt(s["peak_rss_mib_median"]),
                             fmt(ratio["prefill"], 2) if ratio else "", fmt(ratio["decode"], 2) if ratio else ""])
    print()
    print(f"medians of {a.runs} runs, {a.threads} threads, {a.gen_tokens} generated tokens, "
          f"ctx {a.ctx}; ratio = nflash / llama.cpp (the native build)")
    print_table(rows, hdr, left=2, last_left=False)
    print_build_ratios(a, engines, summary)


def print_build_ratios(a, engines: list[str], summary: dict) -> None:
    """Where the AVX2 llama.cpp ran: its speed against the native build, and nflash's against it."""
    if LLAMA_ENGINE["avx2"] not in engines:
        return
    print()
    print("the two llama.cpp builds (medians): native / avx2, and nflash / llama.cpp avx2")
    rows = []
    for q in a.quant:
        for key, sq in summary[q].items():
            r = sq["ratio_llama_native_over_avx2"]
            n = sq.get("ratio_nflash_over_llama_avx2")
            rows.append([q, key.removeprefix("prompt_"), fmt(r["prefill"], 2), fmt(r["decode"], 2),
                         fmt(n["prefill"], 2) if n else "", fmt(n["decode"], 2) if n else ""])
    print_table(rows, ["quant", "prompt tok", "native/avx2 prefill", "native/avx2 decode",
                       "nflash/avx2 prefill", "nflash/avx2 decode"], left=2, last_left=False)


def print_sparse_table(a, summary: dict, key: str) -> None:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    print()
    print(f"{key}: sparse decode vs dense decode of the same sparse pack (medians); per-token decode time, ms")
    print("quant | mode   | decode tok/s | sparse/dense | FFN sparsity | bundles skipped | attention | predictor |   FFN | lm_head")
    for q in a.quant:
        for e, name in ((SPARSE_DENSE, "dense"), (SPARSE, "sparse")):
            s = summary[q].get(e)
            if not s:
                continue
            r = summary[q]["ratio_sparse_over_dense"]["decode"] if e == SPARSE else 1.0
            print(f"{q:5} | {name:6} | {fmt(s['decode_tokens_per_s_median']):>12} | {fmt(r, 2):>12} | "
                  f"{pct(s.get('ffn_sparsity')):>12} | {pct(s.get('bundles_skipped')):>15} | "
                  f"{fmt(s['attention_ms_per_token_median'], 2):>9} | {fmt(s['predictor_ms_per_token_median'], 2):>9} | "
                  f"{fmt(s['ffn_ms_per_token_median'], 2):>5} | {fmt(s['lm_head_ms_per_token_median'], 2):>7}")


def print_contended(a, engines: list[str], results: dict) -> None:
    contended = sum(r["cpu_busy_before"] > BUSY_LIMIT
                    for q in a.quant for e in engines for r in results[q][e])
    if contended:
        print(f"WARNING: {contended} of {a.runs * len(a.quant) * len(engines)} runs started while "
              f"other work kept the CPUs > {BUSY_LIMIT:.0%} busy: these numbers are not reliable; "
              f"rerun on an idle machine")


def write_results(a, out: Path, engines: list[str], texts: dict, m: Models, summary: dict,
                  per_len: dict) -> None:
    """OUT/bench.json: the arguments, machine, prompts, models, summary
    (`summary[quant]["prompt_<n>"]`, with `ratio_nflash_over_llama` =
    `{prefill, decode}`) and every run (`runs["prompt_<n>"][quant][engine]`)."""
    info = {
        **run_info(a),
        "prompt_texts": {f"prompt_{n}": t for n, t in texts.items()},
        "models": {"gguf": {q: str(p) for q, p in m.ggufs.items()},
                   "gguf_tensor_types": {q: gguf_tensor_types(p) for q, p in m.ggufs.items()},
                   "nflash": {q: str(p) for q, p in m.packs.items()},
                   "nflash_sparse": {q: str(p) for q, p in m.sparse.items()}},
        "summary": summary,
        "runs": {f"prompt_{n}": r for n, r in per_len.items()},
    }
    if "llama.cpp" in engines:
        info["llama_cpp_python"] = llama_cpp_version("native")
        info["llama_cpp_builds"] = {
            **llama_builds_info(),
            "system_info": {b: llama_cpp_version(b) for b, e in LLAMA_ENGINE.items() if e in engines}}
    (out / "bench.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {out / 'bench.json'}")
