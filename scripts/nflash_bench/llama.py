"""llama.cpp as the benchmarks see it from outside: whether this interpreter
can import llama_cpp (the Python peer, see worker.py), the native
llama-completion command and its timing lines, and the tensor types of a
GGUF file."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

from .common import REPO

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

# ggml_type values (ggml.h), for the GGUF tensor-type check.
GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
                   30: "bf16"}
# GGUF metadata value types with a fixed size (struct format); 8 = string, 9 = array.
_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                12: "d"}


def llama_cpp_importable() -> bool:
    """Whether this interpreter (the one the workers run with) can import llama_cpp."""
    return subprocess.run([sys.executable, "-c", "import llama_cpp"],
                          capture_output=True).returncode == 0


def llama_cpp_version() -> str:
    """llama-cpp-python's version and llama.cpp's system info line."""
    r = subprocess.run([sys.executable, "-c",
                        "import llama_cpp as L; print(L.__version__); "
                        "print(L.llama_print_system_info().decode())"],
                       capture_output=True, text=True)
    return r.stdout.strip()


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


class _GgufReader:
    """Little-endian reads from an open GGUF file."""

    def __init__(self, f):
        self.f = f

    def value(self, fmt: str):
        return struct.unpack("<" + fmt, self.f.read(struct.calcsize("<" + fmt)))[0]

    def string(self) -> bytes:
        return self.f.read(self.value("Q"))

    def skip(self, t: int) -> None:
        """Skips one metadata value of type t."""
        if t in _GGUF_SCALAR:
            self.f.seek(struct.calcsize("<" + _GGUF_SCALAR[t]), 1)
        elif t == 8:
            self.string()
        elif t == 9:
            et, n = self.value("I"), self.value("Q")
            if et in _GGUF_SCALAR:
                self.f.seek(n * struct.calcsize("<" + _GGUF_SCALAR[et]), 1)
            else:
                for _ in range(n):
                    self.skip(et)
        else:
            raise ValueError(f"unknown GGUF value type {t}")


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Counts the GGUF's tensors by ggml type (a minimal GGUF v2/v3 reader)."""
    with open(path, "rb") as f:
        rd = _GgufReader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        if rd.value("I") < 2:
            raise ValueError(f"{path}: GGUF v1 is not supported")
        n_tensors, n_kv = rd.value("Q"), rd.value("Q")
        for _ in range(n_kv):
            rd.string()
            rd.skip(rd.value("I"))
        counts: dict[str, int] = {}
        for _ in range(n_tensors):
            rd.string()
            n_dims = rd.value("I")
            f.seek(8 * n_dims, 1)
            t = rd.value("I")
            rd.value("Q")
            name = GGML_TYPE_NAMES.get(t, f"type{t}")
            counts[name] = counts.get(name, 0) + 1
        return counts
