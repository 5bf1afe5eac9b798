#!/usr/bin/env python3
"""Static throughput of nflash's aarch64 decode kernels against llama.cpp's,
by llvm-mca (`make mca`; docs/android.md "Kernel speed without a phone").

No phone is reachable from the development machine, and qemu's timing says
nothing about a phone's. llvm-mca replays a loop body on LLVM's scheduling
model of a CPU and reports cycles per iteration. This script:

1. takes the inner loop of each of nflash's NEON and dotprod dot-product
   kernels from the aarch64 `nflash` binary (`make android`), and of
   llama.cpp's (`ggml_vec_dot_q4_0_q8_0`, `ggml_vec_dot_q8_0_q8_0`, and the
   repacked `ggml_gemv_q4_0_4x4_q8_0` llama.cpp uses for Q4_0 on dotprod
   CPUs) compiled from its sources with the cross gcc, for the ARMv8.0
   baseline and for ARMv8.2 + dotprod;
2. picks each function's innermost loop with the most multiply-accumulates
   (MACs: 16 per `sdot`, 8 per `smull`/`smull2`/`smlal`/`smlal2`, 32 per
   `smmla`), drops its branches, and runs llvm-mca on it per CPU model;
3. prints cycles per 32 MACs (one 32-element block of one row: the unit
   of a Q4_0/Q8_0 dot product), the ratio llama.cpp / nflash's fastest
   kernel for the same type and ISA (the one nflash runs there; above 1:
   nflash needs fewer cycles), and writes the figures as JSON.

The figures are a model, not a measurement: LLVM 14 has no model of the
newest phone cores, so each core is priced on its nearest modelled
relative (see CPUS), and the model sees no cache misses (decode on a phone
is also bounded by memory bandwidth: profiles/oneplus-12.toml). LLVM 19
is the newest LLVM Debian 12 ships; it has no model of its own for the
Cortex-X4.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (llvm-mca -mcpu, the phone cores it stands for). LLVM 19 prices a
# Cortex-A76, A78 or X1 on its Cortex-A57 model, so those are asked for as
# the Neoverse N1 (the A76's server twin); it maps the A720 and the X4 to its
# Neoverse N2 model and the A520 to its A510 model itself; the V2 (the X3's
# server twin) is the widest modelled core, nearest the X4.
CPUS = [
    ("cortex-a55", "Cortex-A55 (little, in order; Snapdragon 8 Gen 1 and older)"),
    ("cortex-a520", "Cortex-A520 (little; LLVM's A510 model; Snapdragon 8 Gen 3)"),
    ("neoverse-n1", "Cortex-A76 / A77 / A78 (big, 2019-2021)"),
    ("cortex-a720", "Cortex-A720 (big; LLVM's Neoverse N2 model; Snapdragon 8 Gen 3)"),
    ("neoverse-v2", "Cortex-X3 / X4 class (prime; V2 is the X3's server twin)"),
]

# label, source ("nflash" or a llama.cpp object key), symbol, dtype, ISA
KERNELS = [
    ("nflash dot4_q4_0", "nflash", "kernels::aarch64::dot4_q4_0::", "q4_0", "neon"),
    ("llama.cpp ggml_vec_dot_q4_0_q8_0", "quants-neon", "ggml_vec_dot_q4_0_q8_0", "q4_0", "neon"),
    ("nflash dot4_q8_0", "nflash", "kernels::aarch64::dot4_q8_0::", "q8_0", "neon"),
    ("llama.cpp ggml_vec_dot_q8_0_q8_0", "quants-neon", "ggml_vec_dot_q8_0_q8_0", "q8_0", "neon"),
    ("nflash dot4_q4_0_dot", "nflash", "kernels::aarch64::dot4_q4_0_dot::", "q4_0", "dotprod"),
    ("llama.cpp ggml_vec_dot_q4_0_q8_0", "quants-dot", "ggml_vec_dot_q4_0_q8_0", "q4_0", "dotprod"),
    ("llama.cpp ggml_gemv_q4_0_4x4_q8_0", "repack-dot", "ggml_gemv_q4_0_4x4_q8_0", "q4_0", "dotprod"),
    ("nflash gemm_x8_q4_0_dot", "nflash", "kernels::aarch64::gemm_x8_q4_0_dot::", "q4_0", "dotprod"),
    ("nflash dot4_q8_0_dot", "nflash", "kernels::aarch64::dot4_q8_0_dot::", "q8_0", "dotprod"),
    ("llama.cpp ggml_vec_dot_q8_0_q8_0", "quants-dot", "ggml_vec_dot_q8_0_q8_0", "q8_0", "dotprod"),
    ("nflash gemm_x8_q8_0_dot", "nflash", "kernels::aarch64::gemm_x8_q8_0_dot::", "q8_0", "dotprod"),
    # Prefill's Q4_0 GEMM, 4 tokens per call: nflash's sdot kernel (8 rows)
    # against llama.cpp's smmla one for i8mm CPUs (4 rows, repacked).
    ("nflash gemm_x8_q4_0_dot, 4 tokens", "nflash", "kernels::aarch64::gemm_x8_q4_0_dot::", "q4_0", "prefill"),
    ("llama.cpp ggml_gemm_q4_0_4x8_q8_0 (i8mm)", "repack-mm", "ggml_gemm_q4_0_4x8_q8_0", "q4_0", "prefill"),
]

MACS = {"sdot": 16, "smull": 8, "smull2": 8, "smlal": 8, "smlal2": 8, "smmla": 32}
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


def die(msg):
    print(f"mca: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        die(f"{' '.join(cmd[:3])} … failed:\n{r.stderr.strip()[:2000]}")
    return r.stdout


def tool(names):
    for n in names:
        if shutil.which(n):
            return n
    die(f"none of {', '.join(names)} found: run `make mca`, which installs them")


def compile_llama(src, out, cc, cxx):
    """The llama.cpp objects: quants.c for ARMv8.0 and for ARMv8.2+dotprod,
    repack.cpp for ARMv8.2+dotprod. Returns {key: object path}."""
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
        objs[key] = obj
    return objs


def symbol_range(nm, path, needle, largest=False):
    """(start, end) address of the defined function whose (demangled) name
    contains `needle`; exactly one must match (of a generic kernel's
    instances, the smallest, or with `largest` the largest)."""
    hits = []
    for line in run([nm, "-C", "-S", "--defined-only", path]).splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] in "tT" and needle in parts[3]:
            if parts[3] == needle or "::" in needle or parts[3].startswith(needle):
                hits.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    hits = [h for h in hits if not h[2].endswith("_generic")]
    if len(hits) > 1 and "gemm_x8" in needle:
        # One instance per token count T (1 to 4), alike in Rust's legacy
        # symbol names: the smallest is T = 1 (decode), the largest T = 4
        # (prefill's tile).
        hits = [(max if largest else min)(hits, key=lambda h: h[1])]
    if len(hits) != 1:
        die(f"{path}: {len(hits)} functions match {needle!r}: {[h[2] for h in hits]}")
    start, size, _ = hits[0]
    return start, start + size


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
    return sum(MACS.get(mn, 0) for _, mn, _ in body)


def inner_loop(insns):
    """The loop body (without its branches) with the most MACs; among loops
    with as many, the shortest (the innermost)."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    best = None
    for i, (addr, mn, ops) in enumerate(insns):
        if not BRANCH.match(mn):
            continue
        m = re.search(r"0x([0-9a-f]+)", ops)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target > addr or target not in index:
            continue
        body = insns[index[target]:i + 1]
        key = (macs(body), -len(body))
        if best is None or key > best[0]:
            best = (key, body)
    if best is None or best[0][0] == 0:
        die("no loop with multiply-accumulates found")
    body = best[1]
    calls = [ops for _, mn, ops in body if mn in ("bl", "blr")]
    if calls:
        die(f"the loop calls out ({', '.join(calls)}): an inlining failure in the kernel, whose cost llvm-mca would not see")
    return [(mn, ops) for _, mn, ops in body if not BRANCH.match(mn)]


def mca(llvm_mca, body, cpu):
    """Cycles per iteration of `body` on `cpu` (llvm-mca, 200 iterations:
    loop-carried dependencies included)."""
    asm = "".join(f"\t{mn} {ops}\n" for mn, ops in body)
    out = run([llvm_mca, "-mtriple=aarch64-linux-gnu", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm,+fullfp16",
               "-iterations=200"], input=asm)
    it = int(re.search(r"Iterations:\s+(\d+)", out).group(1))
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return cycles / it


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nflash", default="target/aarch64-unknown-linux-musl/release/nflash",
                    help="the aarch64 nflash binary (make android)")
    ap.add_argument("--llama-src", required=True, help="llama.cpp source tree (the directory holding ggml/)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not os.path.isfile(args.nflash):
        die(f"no {args.nflash}: run `make android` first")
    llvm_mca = tool(["llvm-mca-19", "llvm-mca"])
    nm = tool(["llvm-nm-19", "llvm-nm"])
    objdump = tool(["llvm-objdump-19", "llvm-objdump"])
    cc = tool(["aarch64-linux-gnu-gcc"])
    cxx = tool(["aarch64-linux-gnu-g++"])
    with tempfile.TemporaryDirectory() as tmp:
        objs = compile_llama(args.llama_src, tmp, cc, cxx)
        objs["nflash"] = args.nflash
        rows = []
        for label, src, sym, dtype, isa in KERNELS:
            start, end = symbol_range(nm, objs[src], sym, largest=isa == "prefill")
            body = inner_loop(disassemble(objdump, objs[src], start, end))
            blocks = macs([(0, mn, ops) for mn, ops in body]) / 32
            per_cpu = {cpu: mca(llvm_mca, body, cpu) / blocks for cpu, _ in CPUS}
            rows.append({"kernel": label, "dtype": dtype, "isa": isa, "loop_instructions": len(body),
                         "blocks_per_iteration": blocks, "cycles_per_block": per_cpu})
    version = run([llvm_mca, "--version"]).strip().splitlines()
    print(f"llvm-mca cycles per 32-element block of one row ({next((v.strip() for v in version if 'version' in v), '?')}); "
          "ratio = llama.cpp / nflash's fastest kernel for the same type and ISA (the one it runs), above 1: nflash faster")
    print("| kernel | ISA | " + " | ".join(c for c, _ in CPUS) + " |")
    print("|---|---|" + "---|" * len(CPUS))
    for r in rows:
        cells = []
        for cpu, _ in CPUS:
            c = r["cycles_per_block"][cpu]
            mine = min(x["cycles_per_block"][cpu] for x in rows if x["kernel"].startswith("nflash")
                       and x["dtype"] == r["dtype"] and x["isa"] == r["isa"])
            cells.append(f"{c:.2f}" if r["kernel"].startswith("nflash") else f"{c:.2f} ({c / mine:.2f}×)")
        print(f"| {r['kernel']} ({r['dtype']}) | {r['isa']} | " + " | ".join(cells) + " |")
    print("cores: " + "; ".join(f"{c} = {d}" for c, d in CPUS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": dict(CPUS), "kernels": rows}, f, indent=1)


if __name__ == "__main__":
    main()
