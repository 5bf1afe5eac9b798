#!/usr/bin/env python3
"""Static throughput of nflash's aarch64 dot-product kernels (decode's
matrix-vector products and prefill's 4-token tile) against llama.cpp's, by
llvm-mca 19 (`make mca`; docs/android.md "Kernel speed without a phone").

No phone is reachable from the development machine, and qemu's timing says
nothing about a phone's. llvm-mca replays a loop body on LLVM's scheduling
model of a CPU and reports cycles per iteration. This script:

1. takes each kernel's block loop from the aarch64 `nflash` binary (`make
   android`) and from llama.cpp's ARM kernels compiled from its sources by
   the cross gcc/g++ (`ggml_vec_dot_q4_0_q8_0` and `ggml_vec_dot_q8_0_q8_0`
   for the ARMv8.0 baseline and for ARMv8.2 + dotprod; the repacked
   `ggml_gemv_q4_0_4x4_q8_0` that llama.cpp runs for Q4_0 on dotprod CPUs
   and its prefill GEMM there, `ggml_gemm_q4_0_4x4_q8_0`;
   `ggml_gemm_q4_0_4x8_q8_0`, its prefill GEMM for i8mm CPUs);
2. the block loop is the innermost loop with the most multiply-accumulates
   (MACs: 16 per vector `sdot`, 8 per vector `smull`/`smull2`/`smlal`/
   `smlal2`, 32 per `smmla`). nflash's ×8 kernels are generic over the
   token count (1 to 4), one instance each with alike symbol names: the
   instance whose block loop holds 8 rows × 32 × tokens MACs is the one
   asked for; where the token loop is not unrolled (it sits inside the
   block loop with the same static MACs), the block loop is priced with
   the token loop's body repeated once per token;
3. runs llvm-mca on the loop body (branches dropped) per CPU model and
   prints cycles per 32 MACs (one 32-element block of one row, for one
   token), and the ratio llama.cpp / the fastest nflash kernel of the same
   type and phase that such a CPU runs (above 1: nflash needs fewer
   cycles); `--json` writes it all.

The figures are a model, not a measurement: LLVM 19 (the newest Debian 12
ships) has no model of its own for the newest phone cores, so each is
priced on a modelled relative (see CPUS), and the model sees no cache
misses (decode on a phone is also bounded by memory bandwidth).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (llvm-mca -mcpu, column header, the phone cores it stands for). LLVM 19
# prices a Cortex-A76, A78 or X1 on its Cortex-A57 model, so those are asked
# for as the Neoverse N1 (the A76's server twin); it maps the A720 (and the
# X3/X4) to its Neoverse N2 model and the A520 to its A510 model itself; the
# V2 (the X3's server twin) is the widest modelled core, nearest the X4.
CPUS = [
    ("cortex-a55", "A55", "Cortex-A55 (little, in order; Snapdragon 8 Gen 1 and older)"),
    ("cortex-a520", "A520 (A510 model)", "Cortex-A520 (little; Snapdragon 8 Gen 3)"),
    ("neoverse-n1", "A76/A78 (N1 model)", "Cortex-A76 / A77 / A78 (big, 2019-2021)"),
    ("cortex-a720", "A720 (N2 model)", "Cortex-A720 (big; Snapdragon 8 Gen 3)"),
    ("neoverse-v2", "X3/X4 (V2 model)", "Cortex-X3 / X4 class (prime)"),
]

# Feature order: a CPU with an ISA here has the ones before it.
ISAS = ["neon", "dotprod", "i8mm"]

# label, source ("nflash" or a llama.cpp object key), symbol, dtype, ISA,
# phase, tokens per call (nflash's generic ×8 kernels: which instance).
KERNELS = [
    ("nflash dot4_q4_0", "nflash", "kernels::aarch64::dot4_q4_0::", "q4_0", "neon", "decode", None),
    ("llama.cpp ggml_vec_dot_q4_0_q8_0", "quants-neon", "ggml_vec_dot_q4_0_q8_0", "q4_0", "neon", "decode", None),
    ("nflash dot4_q8_0", "nflash", "kernels::aarch64::dot4_q8_0::", "q8_0", "neon", "decode", None),
    ("llama.cpp ggml_vec_dot_q8_0_q8_0", "quants-neon", "ggml_vec_dot_q8_0_q8_0", "q8_0", "neon", "decode", None),
    ("nflash dot4_q4_0_dot", "nflash", "kernels::aarch64::dot4_q4_0_dot::", "q4_0", "dotprod", "decode", None),
    ("nflash gemm_x8_q4_0_dot", "nflash", "kernels::aarch64::gemm_x8_q4_0_dot::", "q4_0", "dotprod", "decode", 1),
    ("llama.cpp ggml_vec_dot_q4_0_q8_0", "quants-dot", "ggml_vec_dot_q4_0_q8_0", "q4_0", "dotprod", "decode", None),
    ("llama.cpp ggml_gemv_q4_0_4x4_q8_0", "repack-dot", "ggml_gemv_q4_0_4x4_q8_0", "q4_0", "dotprod", "decode", None),
    ("nflash dot4_q8_0_dot", "nflash", "kernels::aarch64::dot4_q8_0_dot::", "q8_0", "dotprod", "decode", None),
    ("nflash gemm_x8_q8_0_dot", "nflash", "kernels::aarch64::gemm_x8_q8_0_dot::", "q8_0", "dotprod", "decode", 1),
    ("llama.cpp ggml_vec_dot_q8_0_q8_0", "quants-dot", "ggml_vec_dot_q8_0_q8_0", "q8_0", "dotprod", "decode", None),
    # Prefill's Q4_0 GEMM: nflash's 8 rows × 4 tokens by sdot (batches of
    # fewer than 8 tokens).
    ("nflash gemm_x8_q4_0_dot, 4 tokens", "nflash", "kernels::aarch64::gemm_x8_q4_0_dot::", "q4_0", "dotprod",
     "prefill", 4),
    # On dotprod CPUs without i8mm, from 8 tokens on: half a ×8 group (4
    # rows) × 8 tokens per call, as llama.cpp's 4 rows × 4 tokens GEMM.
    ("nflash gemm_x8_half_q4_0_dot, 8 tokens", "nflash", "kernels::aarch64::gemm_x8_half_q4_0_dot::", "q4_0",
     "dotprod", "prefill", (4, 8)),
    ("llama.cpp ggml_gemm_q4_0_4x4_q8_0", "repack-dot", "ggml_gemm_q4_0_4x4_q8_0", "q4_0", "dotprod", "prefill", None),
    # nflash's smmla GEMM over a group rewritten once per batch (mm_prepare,
    # priced below as SETUP and added here for a batch of SETUP_TOKENS).
    ("nflash gemm_x8_q4_0_mm, 4 tokens", "nflash", "kernels::aarch64::gemm_x8_q4_0_mm::", "q4_0", "i8mm", "prefill",
     4),
    ("llama.cpp ggml_gemm_q4_0_4x8_q8_0", "repack-mm", "ggml_gemm_q4_0_4x8_q8_0", "q4_0", "i8mm", "prefill", None),
]

# Work done once per group and prefill batch, not per token: (label, symbol,
# the kernel row it adds to, a vector mnemonic that marks its loop among
# the function's loops). mm_prepare rewrites a Q4_0 ×8 group for smmla
# (its Q4_0 loop is the one with a vector `and`, the nibble mask); its cycles per
# 8-row column block, spread over SETUP_TOKENS tokens, are added to
# gemm_x8_q4_0_mm's cycles per block, so the i8mm row compares with llama.cpp
# (whose weights were repacked once at load) at a short prompt.
SETUP = [("nflash mm_prepare, Q4_0 (once per group and batch)", "kernels::aarch64::mm_prepare",
          "nflash gemm_x8_q4_0_mm, 4 tokens", "and")]
SETUP_TOKENS = 16

MACS = {"sdot": 16, "smull": 8, "smull2": 8, "smlal": 8, "smlal2": 8, "smmla": 32}
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
LLVM = "19"


def die(msg):
    print(f"mca: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        die(f"{' '.join(cmd[:3])} … failed:\n{r.stderr.strip()[:2000]}")
    return r.stdout


def tool(name):
    """The LLVM 19 (or cross gcc) tool `name`."""
    for n in ([f"{name}-{LLVM}", f"/usr/lib/llvm-{LLVM}/bin/{name}"] if name.startswith("llvm") else [name]):
        if shutil.which(n):
            return n
    die(f"{name} (LLVM {LLVM} for the llvm tools) not found: run `make mca` as root, which installs llvm-{LLVM} "
        "and the aarch64 cross g++ with apt-get, or install them yourself")


def check_inputs(args):
    """Every input checked before any work: an aarch64 ELF, a llama.cpp
    tree, a writable place for the JSON."""
    path = args.nflash
    if not os.path.exists(path):
        die(f"{path} does not exist: build the phone binary with `make android` "
            "(target/aarch64-unknown-linux-musl/release/nflash) or pass --nflash")
    if not os.path.isfile(path):
        die(f"{path} is not a file: pass the aarch64 nflash binary (`make android` builds it)")
    with open(path, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        die(f"{path} is not an ELF executable: pass the aarch64 nflash binary (`make android` builds it)")
    machine = int.from_bytes(head[18:20], "little")
    if machine != 0xB7:
        kind = {0x3E: "x86-64"}.get(machine, f"machine {machine:#x}")
        die(f"{path} is an {kind} binary, not aarch64: pass the `make android` build, "
            "target/aarch64-unknown-linux-musl/release/nflash")
    src = args.llama_src
    if not os.path.isfile(os.path.join(src, "ggml/src/ggml-cpu/arch/arm/quants.c")):
        die(f"{src} is not a llama.cpp source tree (no ggml/src/ggml-cpu/arch/arm/quants.c): pass the directory "
            "holding ggml/, e.g. bench-out/mca/llama_cpp_python-<version>/vendor/llama.cpp (scripts/mca.sh unpacks it)")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            die(f"cannot write {args.json}: {d} is not a writable directory")


def compile_llama(src, out, cc, cxx):
    """The llama.cpp objects: quants.c for ARMv8.0 and for ARMv8.2+dotprod,
    repack.cpp for ARMv8.2+dotprod and for +i8mm. Returns {key: path}."""
    ggml = os.path.join(src, "ggml")
    inc = ["-I", f"{ggml}/include", "-I", f"{ggml}/src", "-I", f"{ggml}/src/ggml-cpu"]
    arm = f"{ggml}/src/ggml-cpu/arch/arm"
    objs = {}
    for key, comp, file, march in [
        ("quants-neon", cc, "quants.c", "armv8-a"),
        ("quants-dot", cc, "quants.c", "armv8.2-a+dotprod+fp16"),
        ("repack-dot", cxx, "repack.cpp", "armv8.2-a+dotprod+fp16"),
        ("repack-mm", cxx, "repack.cpp", "armv8.2-a+dotprod+i8mm+fp16"),
    ]:
        obj = os.path.join(out, f"{key}.o")
        std = ["-std=c++17"] if file.endswith(".cpp") else ["-std=c11"]
        run([comp, "-O3", f"-march={march}", "-DNDEBUG", *std, *inc, "-c", f"{arm}/{file}", "-o", obj])
        objs[key] = (obj, march)
    return objs


def symbols(nm, path, needle):
    """[(start, end, name)] of the defined functions whose (demangled) name
    contains `needle` (nflash's generic kernels: one per instance)."""
    hits = []
    for line in run([nm, "-C", "-S", "--defined-only", path]).splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] in "tT" and needle in parts[3]:
            if "::" in needle or parts[3] == needle:
                start = int(parts[0], 16)
                hits.append((start, start + int(parts[1], 16), parts[3]))
    if not hits:
        die(f"{path}: no function matches {needle!r}")
    return hits


def disassemble(objdump, path, start, end):
    """[(address, mnemonic, operands)] of the function at [start, end)."""
    out = run([objdump, "-d", "--no-show-raw-insn", "--mattr=+dotprod,+i8mm,+fullfp16",
               f"--start-address={start:#x}", f"--stop-address={end:#x}", path])
    insns = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            ops = m.group(3).split("//")[0].strip()
            insns.append((int(m.group(1), 16), m.group(2), ops))
    if not insns:
        die(f"{path}: no instructions at {start:#x}..{end:#x}")
    return insns


def macs(body):
    """Multiply-accumulates of vector instructions (operands with a lane
    arrangement: `smull x0, w1, w2` is scalar)."""
    return sum(MACS.get(mn, 0) for _, mn, ops in body if "." in ops)


def loops(insns):
    """Every loop as (first index, last index): a backward branch."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    out = []
    for i, (addr, mn, ops) in enumerate(insns):
        m = re.search(r"0x([0-9a-f]+)", ops) if BRANCH.match(mn) else None
        if m and int(m.group(1), 16) <= addr and int(m.group(1), 16) in index:
            out.append((index[int(m.group(1), 16)], i))
    return out


def block_loop(insns, tokens):
    """(body, nested) of the innermost loop with the most MACs, branches
    dropped; `nested`: that loop sits inside a loop with as many static
    MACs (a token loop inside nflash's block loop). Nested, with `tokens`
    > 1, the body is the enclosing loop's with the inner one repeated
    `tokens` times."""
    found = loops(insns)
    if not found:
        die("no loop found")
    best = max(found, key=lambda lp: (macs(insns[lp[0]:lp[1] + 1]), lp[0] - lp[1]))
    n = macs(insns[best[0]:best[1] + 1])
    if n == 0:
        die("no loop with multiply-accumulates found")
    body = insns[best[0]:best[1] + 1]
    outer = [lp for lp in found if lp[0] <= best[0] and lp[1] >= best[1] and lp != best
             and macs(insns[lp[0]:lp[1] + 1]) == n]
    if tokens and tokens > 1 and outer:
        o = min(outer, key=lambda lp: lp[1] - lp[0])
        body = insns[o[0]:best[0]] + body * tokens + insns[best[1] + 1:o[1] + 1]
    calls = [ops for _, mn, ops in body if mn in ("bl", "blr")]
    if calls:
        die(f"the loop calls out ({', '.join(calls)}): an inlining failure in the kernel, whose cost llvm-mca would not see")
    return [(a, mn, ops) for a, mn, ops in body if not BRANCH.match(mn)], bool(outer)


def mca(llvm_mca, body, cpu):
    """Cycles per iteration of `body` on `cpu` (llvm-mca, 200 iterations:
    loop-carried dependencies included)."""
    asm = "".join(f"\t{mn} {ops}\n" for _, mn, ops in body)
    out = run([llvm_mca, "-mtriple=aarch64-linux-gnu", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm,+fullfp16",
               "-iterations=200"], input=asm)
    it = int(re.search(r"Iterations:\s+(\d+)", out).group(1))
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return cycles / it


def kernel_body(nm, objdump, path, sym, tokens):
    """(symbol, loop body) of the kernel. For nflash's generic ×8 kernels
    (`tokens` given), the one instance whose block loop holds 8 rows × 32
    × `tokens` MACs (`tokens` = (rows, tokens) for a kernel over other than
    8 rows); one token asked for, an instance with a token loop inside its
    block loop (T > 1, not unrolled) is ruled out."""
    if isinstance(tokens, tuple):
        rows, t = tokens
        tokens = rows * t // 8
    hits = symbols(nm, path, sym)
    if tokens is None:
        if len(hits) != 1:
            die(f"{path}: {len(hits)} functions match {sym!r}: {[h[2] for h in hits]}")
        start, end, name = hits[0]
        return name, block_loop(disassemble(objdump, path, start, end), None)[0]
    chosen = []
    for start, end, name in hits:
        body, nested = block_loop(disassemble(objdump, path, start, end), tokens)
        if macs(body) == 8 * 32 * tokens and not (nested and tokens == 1):
            chosen.append((name, body))
    if len(chosen) != 1:
        die(f"{path}: {len(chosen)} instances of {sym!r} have a block loop of {8 * 32 * tokens} MACs "
            f"({tokens} token(s)); expected one")
    return chosen[0]


def setup_body(nm, objdump, path, sym, mark):
    """(symbol, loop body) of a once-per-batch function: its one loop
    holding the vector mnemonic `mark`, branches dropped."""
    hits = symbols(nm, path, sym)
    if len(hits) != 1:
        die(f"{path}: {len(hits)} functions match {sym!r}")
    start, end, name = hits[0]
    insns = disassemble(objdump, path, start, end)
    found = [lp for lp in loops(insns) if any(mn == mark and "." in ops for _, mn, ops in insns[lp[0]:lp[1] + 1])]
    inner = [lp for lp in found if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in found)]
    if len(inner) != 1:
        die(f"{name}: {len(inner)} innermost loops hold {mark!r}; expected one")
    body = insns[inner[0][0]:inner[0][1] + 1]
    if any(mn in ("bl", "blr") for _, mn, _ in body):
        die(f"{name}: the loop calls out: an inlining failure")
    return name, [(a, mn, ops) for a, mn, ops in body if not BRANCH.match(mn)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nflash", default="target/aarch64-unknown-linux-musl/release/nflash",
                    help="the aarch64 nflash binary (make android)")
    ap.add_argument("--llama-src", required=True, help="llama.cpp source tree (the directory holding ggml/)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    check_inputs(args)
    llvm_mca, nm, objdump = tool("llvm-mca"), tool("llvm-nm"), tool("llvm-objdump")
    cc, cxx = tool("aarch64-linux-gnu-gcc"), tool("aarch64-linux-gnu-g++")
    version = next((v.strip() for v in run([llvm_mca, "--version"]).splitlines() if "version" in v), "?")
    with tempfile.TemporaryDirectory() as tmp:
        objs = compile_llama(args.llama_src, tmp, cc, cxx)
        objs["nflash"] = (args.nflash, None)
        rows = []
        for label, src, sym, dtype, isa, phase, tokens in KERNELS:
            path, march = objs[src]
            name, body = kernel_body(nm, objdump, path, sym, tokens)
            blocks = macs(body) / 32
            rows.append({"kernel": label, "symbol": name, "compiled_with": march, "dtype": dtype, "isa": isa,
                         "phase": phase, "tokens_per_call": tokens, "loop_instructions": len(body),
                         "blocks_per_iteration": blocks,
                         "cycles_per_block": {cpu: mca(llvm_mca, body, cpu) / blocks for cpu, _, _ in CPUS}})
        for label, sym, adds_to, mark in SETUP:
            name, body = setup_body(nm, objdump, args.nflash, sym, mark)
            # One iteration: one 32-column block of the 8 rows of a group.
            per_block = {cpu: mca(llvm_mca, body, cpu) / 8 for cpu, _, _ in CPUS}
            k = next(r for r in rows if r["kernel"] == adds_to)
            k["kernel_cycles_per_block"] = dict(k["cycles_per_block"])
            k["setup_tokens"] = SETUP_TOKENS
            for cpu in per_block:
                k["cycles_per_block"][cpu] += per_block[cpu] / SETUP_TOKENS
            k["kernel"] += f" + rewrite over {SETUP_TOKENS} tokens"
            rows.append({"kernel": label, "symbol": name, "compiled_with": None, "dtype": k["dtype"], "isa": k["isa"],
                         "phase": "prefill, once per batch", "tokens_per_call": None,
                         "loop_instructions": len(body), "blocks_per_iteration": 8, "cycles_per_block": per_block})
    for r in rows:
        if r["kernel"].startswith("nflash"):
            continue
        # What nflash runs on a CPU with this ISA: its kernels of the same type and phase using no more.
        mine = [x for x in rows if x["kernel"].startswith("nflash") and x["dtype"] == r["dtype"]
                and x["phase"] == r["phase"] and ISAS.index(x["isa"]) <= ISAS.index(r["isa"])]
        r["ratio_over_nflash"] = {}
        r["nflash_reference"] = {}
        for cpu, _, _ in CPUS:
            ref = min(mine, key=lambda x: x["cycles_per_block"][cpu])
            r["ratio_over_nflash"][cpu] = r["cycles_per_block"][cpu] / ref["cycles_per_block"][cpu]
            r["nflash_reference"][cpu] = ref["kernel"]
    print(f"llvm-mca ({version}) cycles per 32 multiply-accumulates (one 32-element block of one row, one token); "
          "in brackets llama.cpp / the fastest nflash kernel of the same type and phase such a CPU runs "
          "(above 1: nflash needs fewer cycles)")
    print("| kernel | type | ISA | phase | " + " | ".join(h for _, h, _ in CPUS) + " |")
    print("|---|---|---|---|" + "---|" * len(CPUS))
    for r in rows:
        cells = [f"{r['cycles_per_block'][c]:.2f}" + (f" ({r['ratio_over_nflash'][c]:.2f})" if "ratio_over_nflash" in r else "")
                 for c, _, _ in CPUS]
        print(f"| {r['kernel']} | {r['dtype']} | {r['isa']} | {r['phase']} | " + " | ".join(cells) + " |")
    print("cores: " + "; ".join(f"{h} = {d}" for _, h, d in CPUS))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"llvm_mca": version, "unit": "cycles per 32 multiply-accumulates",
                           "cpus": {c: {"header": h, "stands_for": d} for c, h, d in CPUS}, "kernels": rows}, f,
                          indent=1)
        except OSError as e:
            die(f"cannot write {args.json}: {e.strerror}")


if __name__ == "__main__":
    main()
