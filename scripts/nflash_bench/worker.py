"""The llama-cpp-python jobs of the benchmarks. Each runs in its own process,
started with the benchmark's own interpreter (the bench venv's python):

    python scripts/nflash_bench/worker.py --build {native|avx2} {_quantize|_tokenize|_llama-run} ARGS...

worker_cmd() builds that command. --build picks the llama.cpp build of
scripts/bench_setup.sh whose libllama.so the bindings load (through
LLAMA_CPP_LIB_PATH, set before llama_cpp is first imported). llama_cpp is
imported inside each job, so importing this module needs no llama_cpp.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a file: import the package from scripts/, not from this folder
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from nflash_bench.common import die  # noqa: E402
from nflash_bench.llama import llama_lib_dir  # noqa: E402

# llama_ftype values (llama.h): LLAMA_FTYPE_MOSTLY_Q4_0 = 2, _Q8_0 = 7.
LLAMA_FTYPE = {"q4_0": 2, "q8_0": 7}


def worker_cmd(name: str, *args, build: str = "native") -> list[str]:
    """The command that runs worker `name` with llama.cpp build `build`
    ("native" or "avx2", see nflash_bench.llama.LLAMA_BUILDS)."""
    return [sys.executable, str(Path(__file__).resolve()), "--build", build, name, *map(str, args)]


# --------------------------------------------------------------------------
# What the process itself reads from /proc
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


# --------------------------------------------------------------------------
# _quantize and _tokenize
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# _llama-run: prompt + greedy generation, timed
# --------------------------------------------------------------------------

def worker_llama_run(gguf: str, prompt_file: str, n_gen: int, threads: int, n_ctx: int,
                     out_json: str, weights: str = "default") -> None:
    """weights: "default" = llama.cpp's defaults (on this CPU, Q4_0 weights are
    repacked into an 8x8-interleaved copy in anonymous memory: faster kernels,
    but that copy cannot be paged out); "mmap" = weights used in place from the
    mmapped file (no repacking), so the kernel can evict and re-read them."""
    import llama_cpp as L

    baseline_kib = _status_kib("VmRSS")  # Python + numpy + llama_cpp, no model yet
    baseline_anon_kib = _status_kib("RssAnon")  # the rest is file-backed (shared libraries)
    L.llama_backend_init()
    model, mp = _load_model(L, gguf, weights)
    vocab = L.llama_model_get_vocab(model)
    toks, n_prompt = _tokenize_prompt(L, vocab, prompt_file, n_gen, n_ctx)
    ctx, cp = _new_context(L, model, n_ctx, threads)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())

    out, lat_ms, io_flt = _generate(L, ctx, chain, toks, n_prompt, n_gen)
    perf = L.llama_perf_context(ctx)
    text = _detokenize(L, vocab, out)
    res = {
        "prompt_tokens": n_prompt,
        "generated_tokens": len(out),
        **_perf_figures(perf),
        "vm_hwm_bytes": _status_kib("VmHWM") * 1024,
        "python_baseline_rss_bytes": baseline_kib * 1024,
        "python_baseline_rss_anon_bytes": baseline_anon_kib * 1024,
        "flash_attn_type": int(cp.flash_attn_type),
        "weights": weights,
        "load_mode": int(mp.load_mode),
        "use_extra_bufts": bool(mp.use_extra_bufts),
        **_decode_io_figures(io_flt, lat_ms),
        **latency_summary(lat_ms),
        "text": text,
    }
    Path(out_json).write_text(json.dumps(res) + "\n")
    L.llama_sampler_free(chain)
    L.llama_free(ctx)
    L.llama_model_free(model)


def _load_model(L, gguf: str, weights: str):
    """The model loaded with the `weights` handling of worker_llama_run; returns (model, its params)."""
    mp = L.llama_model_default_params()
    if weights == "mmap":
        mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
        mp.use_extra_bufts = False
    elif weights != "default":
        die(f"unknown weights mode {weights!r} (default, mmap)")
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        die(f"cannot load {gguf}")
    return model, mp


def _tokenize_prompt(L, vocab, prompt_file: str, n_gen: int, n_ctx: int):
    """The prompt file's tokens (a llama_token array) and their count; dies if
    prompt and generated tokens do not fit in n_ctx."""
    text = Path(prompt_file).read_text(encoding="utf-8").encode()
    toks = (L.llama_token * (len(text) + 16))()
    n_prompt = L.llama_tokenize(vocab, text, len(text), toks, len(toks), True, False)
    if n_prompt <= 0:
        die("llama_tokenize failed")
    if n_prompt + n_gen > n_ctx:
        die(f"prompt ({n_prompt}) + generated ({n_gen}) tokens exceed n_ctx {n_ctx}")
    return toks, n_prompt


def _new_context(L, model, n_ctx: int, threads: int):
    """A context with batch and micro-batch 512 and perf counters on; returns (context, its params)."""
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
    return ctx, cp


def _generate(L, ctx, chain, toks, n_prompt: int, n_gen: int):
    """The prompt in one batch, then single-token steps until exactly n_gen
    tokens (EOS is ignored). Returns (tokens, per-step latency in ms, the
    storage read bytes and major faults before and after the steps)."""
    L.llama_perf_context_reset(ctx)
    if L.llama_decode(ctx, L.llama_batch_get_one(toks, n_prompt)) != 0:
        die("llama_decode (prompt) failed")
    tok = L.llama_sampler_sample(chain, ctx, -1)
    out = [tok]
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
    return out, lat_ms, (io0, io1, flt0, flt1)


def _perf_figures(perf) -> dict:
    """llama_perf_context's counters and the tokens/s they give."""
    return {
        "n_p_eval": perf.n_p_eval,
        "t_p_eval_ms": perf.t_p_eval_ms,
        "n_eval": perf.n_eval,
        "t_eval_ms": perf.t_eval_ms,
        "prefill_tokens_per_s": perf.n_p_eval / perf.t_p_eval_ms * 1e3 if perf.t_p_eval_ms > 0 else 0.0,
        "decode_tokens_per_s": perf.n_eval / perf.t_eval_ms * 1e3 if perf.t_eval_ms > 0 else 0.0,
    }


def _decode_io_figures(io_flt: tuple, lat_ms: list[float]) -> dict:
    """Decode only (after the prompt): storage reads (/proc/self/io read_bytes,
    which counts mmap page-fault reads) and major page faults, per token."""
    io0, io1, flt0, flt1 = io_flt
    return {
        "bytes_read_per_token": (io1 - io0) / len(lat_ms) if io0 is not None and lat_ms else None,
        "major_faults_per_token": (flt1 - flt0) / len(lat_ms) if lat_ms else None,
    }


def _detokenize(L, vocab, tokens: list) -> str:
    import ctypes

    pieces = []
    buf = (ctypes.c_char * 256)()
    for t in tokens:
        n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        pieces.append(bytes(buf[:max(n, 0)]))
    return b"".join(pieces).decode("utf-8", "replace")


WORKERS = {
    "_quantize": lambda a: worker_quantize(a[0], a[1], a[2], int(a[3])),
    "_tokenize": lambda a: worker_tokenize(a[0], a[1]),
    "_llama-run": lambda a: worker_llama_run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5], *a[6:7]),
}


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[1] != "--build" or argv[3] not in WORKERS:
        die(f"usage: {argv[0]} --build {{native|avx2}} {{{'|'.join(WORKERS)}}} ARGS... "
            f"(workers of the benchmarks)")
    try:
        lib = llama_lib_dir(argv[2])
    except ValueError as e:
        die(str(e))
    if not (lib / "libllama.so").exists():
        die(f"{lib / 'libllama.so'} not found: run scripts/bench_setup.sh")
    import os
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    WORKERS[argv[3]](argv[4:])


if __name__ == "__main__":
    main(sys.argv)
