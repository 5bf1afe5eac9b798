"""llama.cpp as the benchmarks see it from outside: whether this interpreter
can import llama_cpp (the Python peer, see worker.py), the native
llama-completion command and its timing lines, and the tensor types of a
GGUF file."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

from .common import REPO

# The llama.cpp builds of scripts/bench_setup.sh, from the llama.cpp source
# that llama-cpp-python vendors, each with libllama.so (for the Python
# bindings, through LLAMA_CPP_LIB_PATH) and llama-completion (the
# non-conversational command-line tool of this llama.cpp version) in build/bin:
#   "native": -march=native minus the extensions that fault on this machine,
#             as a user builds it; the peer of every benchmark;
#   "avx2":   AVX2/FMA/F16C only (x86-64-v3, like nflash's binaries); built
#             only where the native build enables more.
LLAMA_BUILDS = ("native", "avx2")
LLAMA_BUILDS_JSON = REPO / "bench-out/llama-builds.json"
LLAMA_NATIVE_BIN = REPO / "bench-out/llama-native/build/bin/llama-completion"


def llama_lib_dir(build: str) -> Path:
    """The directory of a build's libllama.so (its build/bin)."""
    if build not in LLAMA_BUILDS:
        raise ValueError(f"unknown llama.cpp build {build!r} ({', '.join(LLAMA_BUILDS)})")
    return REPO / f"bench-out/llama-{build}/build/bin"


def llama_builds_available() -> list[str]:
    """The builds whose libllama.so exists, native first."""
    return [b for b in LLAMA_BUILDS if (llama_lib_dir(b) / "libllama.so").exists()]


def llama_builds_info() -> dict:
    """bench-out/llama-builds.json (CMake flags, extensions, faulting ones), or {}."""
    try:
        return json.loads(LLAMA_BUILDS_JSON.read_text())
    except (OSError, ValueError):
        return {}


def llama_env(build: str) -> dict:
    """The environment that makes llama_cpp load this build's libllama.so."""
    return {**os.environ, "LLAMA_CPP_LIB_PATH": str(llama_lib_dir(build))}


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


def llama_cpp_importable(build: str = "native") -> bool:
    """Whether this interpreter (the one the workers run with) can import
    llama_cpp with that build's libllama.so."""
    return subprocess.run([sys.executable, "-c", "import llama_cpp"], env=llama_env(build),
                          capture_output=True).returncode == 0


def llama_cpp_version(build: str = "native") -> str:
    """llama-cpp-python's version and the build's llama.cpp system info line."""
    r = subprocess.run([sys.executable, "-c",
                        "import llama_cpp as L; print(L.__version__); "
                        "print(L.llama_print_system_info().decode())"],
                       env=llama_env(build), capture_output=True, text=True)
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
