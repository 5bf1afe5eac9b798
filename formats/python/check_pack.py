#!/usr/bin/env python3
"""Checks formats/SPEC.md (through nflash_pack.py, the reader written from it)
against packs written by `prep`. Python 3.11, standard library only.

    check_pack.py compare PACK --prep BIN     every field `prep inspect --json` shows, against our reader's
    check_pack.py weights PACK --model DIR    dequantized tensors and FFN bundles against the checkpoint
    check_pack.py corrupt PACK --prep BIN --workdir DIR
                                              damaged copies: our reader and `prep verify` must both refuse each
    check_pack.py downgrade PACK OUT          PACK as format 3.3 wrote it (no neuron-cluster checksums), for tests
                  [--keep-minor]              (or still marked 3.4 or later: a pack stripped of its table)

Each prints what it checked and exits 1 on the first disagreement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nflash_pack as nf  # noqa: E402

CRITERION = {"Gate": "gate", "GateUp": "gate-up"}
PREDICTOR = {"Exact": "exact", "LowRank": "low-rank", "Mlp": "mlp"}


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def diff(a, b, path="") -> list[str]:
    """Differences between two JSON values (numbers equal as floats; NaN prints as null in serde_json)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'ours' if k in a else 'prep'}")
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, bool) or isinstance(b, bool):
        return [] if a is b else [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b or same_f32(a, b):
            return []
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, float) and math.isnan(a) and b is None:
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def same_f32(a: float, b: float) -> bool:
    """`prep inspect --json` prints some f32 fields widened to f64 (0.997 as 0.996999979019165): equal as f32."""
    try:
        return math.isfinite(a) and math.isfinite(b) and nf.pack_f32(a) == nf.pack_f32(b) and abs(a - b) <= 1e-7 * abs(b)
    except OverflowError:
        return False


def prep_view(pack: nf.Pack) -> dict:
    """What `prep inspect --json` would print, computed from our reader's decoding alone."""
    m, h = pack.manifest, pack.header
    types: dict[str, dict] = {}
    for t in m["tensors"]:
        e = types.setdefault(t["dtype"].lower(), {"tensors": 0, "bytes": 0})
        e["tensors"] += 1
        e["bytes"] += t["bytes"]
    sparse = None
    if m["sparse"] is not None:
        si = m["sparse"]
        layers = []
        for f in m["ffn"]:
            s = f["sparse"]
            q = s["quality"]
            layers.append(
                {
                    "layer": f["layer"],
                    "threshold": s["threshold"],
                    "predictor_threshold": s["predictor_threshold"],
                    "predictor_bytes": s["predictor_bytes"],
                    "recall": q["recall"],
                    "precision": q["precision"],
                    "bundles_skipped": q["bundles_skipped"],
                    "sparsity": q["sparsity"],
                    "frequency_curve": s["frequency_curve"],
                }
            )
        sparse = {
            "criterion": CRITERION[si["criterion"]],
            "predictor": PREDICTOR[si["predictor"]],
            "rank": si["rank"],
            "target_sparsity": si["target_sparsity"],
            "recall_target": si["recall_target"],
            "calib_tokens": si["calib_tokens"],
            "calib_source": si["calib_source"],
            "predictor_bytes": sum(f["sparse"]["predictor_bytes"] for f in m["ffn"]),
            "layers": layers,
        }
    # Matrices stored as F16 in a Q4_0/Q8_0 pack (rows not whole 32-element blocks).
    fallback = {}
    if m["ffn"] and m["ffn"][0]["bundle"]["dtype"] in ("Q4_0", "Q8_0"):
        for t in m["tensors"]:
            if len(t["shape"]) == 2 and t["dtype"] == "F16":
                parts = t["name"].split(".")
                if t["name"].startswith("model.layers.") and parts[2].isdigit():
                    parts[2] = "*"
                e = fallback.setdefault(".".join(parts), [0, t["shape"][1]])
                e[0] += 1
    return {
        "file": pack.path,
        "file_bytes": pack.file_len,
        "version": f"{h['major']}.{h['minor']}",
        "alignment": h["alignment"],
        "producer": m["producer"],
        "config": m["config"],
        "chat_template": m["tokenizer"]["chat_template"] is not None,
        "segments": [
            {k: s[k] for k in ("name", "offset", "bytes", "kind", "crc32")} for s in m["segments"]
        ],
        "resident_bytes": sum(t["bytes"] for t in m["tensors"]),
        "ffn_bytes": sum(s["bytes"] for s in m["segments"] if s["kind"] == "Ffn"),
        "ffn_dtype": m["ffn"][0]["bundle"]["dtype"].lower() if m["ffn"] else None,
        "ffn_clusters": sum(len(f["clusters"]) for f in m["ffn"]),
        "sparse": sparse,
        "plan": m["plan"],
        "f16_fallback": [
            {"tensors": k, "count": n, "row_elements": c} for k, (n, c) in sorted(fallback.items())
        ],
        "tensor_types": types,
        "metadata": pack.metadata,
    }


def cmd_compare(a) -> None:
    pack = nf.Pack(a.pack)
    out = subprocess.run([a.prep, "inspect", "--json", a.pack], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"prep inspect failed: {out.stderr.strip()}")
    theirs = json.loads(out.stdout)
    with open(a.pack, "rb") as f:
        f.seek(pack.header["manifest_offset"])
        raw = f.read(pack.header["manifest_bytes"])
    if nf.encode_manifest(pack.manifest) != raw:
        fail(f"{a.pack}: the decoded manifest, encoded again per SPEC §4, differs from the stored bytes")
    ours = prep_view(pack)
    d = diff(ours, theirs)
    if d:
        fail(f"{a.pack}: our reader and prep inspect disagree:\n  " + "\n  ".join(d[:40]))
    n = count_leaves(theirs)
    m = pack.manifest
    print(
        f"ok  {a.pack}: v{ours['version']}, {n} values of prep inspect --json equal; "
        f"manifest re-encoded byte for byte; {len(m['segments'])} segments, {len(m['tensors'])} tensors, {len(m['ffn'])} FFN layers, "
        f"sparse={'yes' if m['sparse'] else 'no'}, plan={'yes' if m['plan'] else 'no'}; checks: {'; '.join(pack.checks)}"
    )


def count_leaves(v) -> int:
    if isinstance(v, dict):
        return sum(count_leaves(x) for x in v.values())
    if isinstance(v, list):
        return sum(count_leaves(x) for x in v)
    return 1


# --- weights: dequantized pack bytes against the checkpoint ------------------


class SafeTensors:
    """Reads rows of a Hugging Face safetensors checkpoint (one file or an index of shards)."""

    def __init__(self, model_dir: str):
        self.entries: dict[str, tuple[str, dict, int]] = {}
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        for fn in files:
            p = os.path.join(model_dir, fn)
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                hdr = json.loads(f.read(n))
            for k, v in hdr.items():
                if k != "__metadata__":
                    self.entries[k] = (p, v, 8 + n)

    def has(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> list[int]:
        return self.entries[name][1]["shape"]

    def row(self, name: str, r: int) -> list[float]:
        p, e, base = self.entries[name]
        cols = e["shape"][-1]
        size = {"BF16": 2, "F16": 2, "F32": 4}[e["dtype"]]
        with open(p, "rb") as f:
            f.seek(base + e["data_offsets"][0] + r * cols * size)
            b = f.read(cols * size)
        return decode_floats(e["dtype"], b)

    def column(self, name: str, c: int) -> list[float]:
        p, e, base = self.entries[name]
        rows, cols = e["shape"]
        size = {"BF16": 2, "F16": 2, "F32": 4}[e["dtype"]]
        out = []
        with open(p, "rb") as f:
            for r in range(rows):
                f.seek(base + e["data_offsets"][0] + (r * cols + c) * size)
                out += decode_floats(e["dtype"], f.read(size))
        return out


def decode_floats(dtype: str, b: bytes) -> list[float]:
    n = len(b) // (4 if dtype == "F32" else 2)
    if dtype == "F32":
        return list(struct.unpack(f"<{n}f", b))
    if dtype == "F16":
        return list(struct.unpack(f"<{n}e", b))
    # bf16: the high half of an f32
    return list(struct.unpack(f"<{n}f", b"".join(b"\x00\x00" + b[i : i + 2] for i in range(0, len(b), 2))))


def block_scales(dtype: str, data: bytes) -> list[float]:
    """Per-element |d| of a quantized row (the step of its block), 0 for float types."""
    if dtype in ("F32", "F16"):
        return [0.0] * (len(data) // (4 if dtype == "F32" else 2))
    bb = nf.DTYPES[dtype][1]
    out = []
    for b in range(0, len(data), bb):
        (d,) = struct.unpack_from("<e", data, b)
        out += [abs(d)] * 32
    return out


def compare_row(what: str, dtype: str, data: bytes, ref: list[float]) -> float:
    """Checks a stored row against the checkpoint row; returns the worst error in units of the block step."""
    got = nf.dequantize_row(dtype, data, len(ref))
    steps = block_scales(dtype, data)
    worst = 0.0
    for j, (g, r, s) in enumerate(zip(got, ref, steps)):
        err = abs(g - r)
        if dtype == "F32":
            ok = err == 0.0
        elif dtype == "F16":
            ok = err <= abs(r) * 2**-10 + 2**-24
        else:
            # Q8_0: within half a step; Q4_0: within one step (the clamp at +7); plus d's own f16 rounding.
            bound = (0.5 if dtype == "Q8_0" else 1.0) * s + abs(r) * 2**-9 + 1e-7
            ok = err <= bound
            worst = max(worst, err / s if s else 0.0)
        if not ok:
            fail(f"{what}: element {j} is {g} in the pack, {r} in the checkpoint (step {s})")
    # A layout error (wrong nibble order, wrong block order) would also show as a poor correlation.
    num = sum(g * r for g, r in zip(got, ref))
    den = math.sqrt(sum(g * g for g in got) * sum(r * r for r in ref))
    if den == 0.0:
        if any(got) or any(ref):
            fail(f"{what}: all zero on one side only")
    elif num / den < 0.95:
        fail(f"{what}: correlation {num / den:.3f} with the checkpoint")
    return worst


def split_source(c: dict, name: str) -> tuple[str, int]:
    """The checkpoint tensor and first row that stored tensor `name` comes
    from: Phi-3's q/k/v and gate/up projections are rows of its fused
    `qkv_proj` and `gate_up_proj` (SPEC §4.1); other tensors are themselves."""
    a = c["architecture"]
    if not (isinstance(a, dict) and "Phi3" in a):
        return name, 0
    qd, kvd = c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    for part, fused, row0 in (
        ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight", 0),
        ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight", qd),
        ("self_attn.v_proj.weight", "self_attn.qkv_proj.weight", qd + kvd),
        ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0),
        ("mlp.up_proj.weight", "mlp.gate_up_proj.weight", c["intermediate_size"]),
    ):
        if name.endswith("." + part):
            return name[: -len(part)] + fused, row0
    return name, 0


def gemma3_norm(c: dict, name: str) -> bool:
    """Whether `name` is a Gemma 3 norm weight, which packs store as 1 + w (SPEC §4.1, §4.3)."""
    a = c["architecture"]
    norm = name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight"
    return isinstance(a, dict) and "Gemma3" in a and norm


def cmd_weights(a) -> None:
    pack = nf.Pack(a.pack, segment_crcs=False)
    st = SafeTensors(a.model)
    m = pack.manifest
    rng = random.Random(a.seed)
    checked, worst = 0, 0.0
    # Resident tensors: a few rows of each kind that comes from the checkpoint.
    for t in m["tensors"]:
        name = t["name"]
        src, row0 = split_source(m["config"], name)
        if name.startswith("nflash.predictor.") or not st.has(src):
            continue
        last = m["config"]["num_layers"] - 1
        if "layers." in name and int(name.split(".")[2]) not in (0, last):
            continue
        _, data = pack.tensor(name)
        rows = t["shape"][0] if len(t["shape"]) > 1 else 1
        rb = nf.row_bytes(t["dtype"], t["shape"][-1])
        perm = None
        if name.endswith(("mlp.gate_proj.bias", "mlp.up_proj.bias")):
            perm = m["ffn"][int(name.split(".")[2])]["order"]
        for r in sorted(set(rng.randrange(rows) for _ in range(min(rows, a.rows)))):
            if perm is not None:
                ref = [st.row(name, 0)[i] for i in perm] if len(t["shape"]) == 1 else None
            else:
                ref = st.row(src, row0 + r) if len(t["shape"]) > 1 else st.row(name, 0)
            if gemma3_norm(m["config"], name):
                # Stored as 1 + w, added in f32 (SPEC §4.1): the f64 sum is exact, then rounded once.
                ref = [struct.unpack("<f", struct.pack("<f", x + 1.0))[0] for x in ref]
            w = compare_row(f"tensor {name} row {r}", t["dtype"], data[r * rb : (r + 1) * rb], ref)
            worst, checked = max(worst, w), checked + 1
    # FFN bundles: gate row, up row, down column of original neuron order[p].
    bundles = 0
    for unit, f in enumerate(m["ffn"]):
        if f["layer"] not in (0, m["config"]["num_layers"] - 1) and not a.all_layers:
            continue
        gate_w, up_w, down_w = ffn_names(m["config"], unit)
        (gate_w, gate0), (up_w, up0) = split_source(m["config"], gate_w), split_source(m["config"], up_w)
        p_all = [0, f["n_neurons"] - 1] + [rng.randrange(f["n_neurons"]) for _ in range(a.rows)]
        for p in sorted(set(p_all)):
            i = f["order"][p]
            g, u, d = pack.bundle(unit, p)
            dt = f["bundle"]["dtype"]
            what = f"FFN unit {unit} (layer {f['layer']}) bundle {p}"
            worst = max(worst, compare_row(f"{what} gate (neuron {i})", dt, g, st.row(gate_w, gate0 + i)))
            worst = max(worst, compare_row(f"{what} up (neuron {i})", dt, u, st.row(up_w, up0 + i)))
            worst = max(worst, compare_row(f"{what} down (neuron {i})", dt, d, st.column(down_w, i)))
            bundles += 1
    print(
        f"ok  {a.pack}: {checked} resident tensor rows and {bundles} FFN bundles (gate row, up row, down column) "
        f"match {a.model} after dequantizing per SPEC §5; worst error {worst:.3f} block steps"
    )


def ffn_names(c: dict, unit: int) -> tuple[str, str, str]:
    """Checkpoint names of FFN unit `unit`'s gate, up and down weights (SPEC §4.1, §4.4)."""
    arch, n_exp = c["architecture"], nf.experts(c)
    layer, expert = unit // n_exp, unit % n_exp
    if isinstance(arch, dict) and "Mixtral" in arch:
        pre = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{pre}.w1.weight", f"{pre}.w3.weight", f"{pre}.w2.weight"
    pre = f"model.layers.{layer}.mlp" + (f".experts.{expert}" if nf.moe_of(c) is not None else "")
    return f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight", f"{pre}.down_proj.weight"


# --- corrupt: damaged copies must be refused ---------------------------------


def refix_header(b: bytearray) -> None:
    b[60:64] = struct.pack("<I", zlib.crc32(bytes(b[:60])))


def cmd_corrupt(a) -> None:
    src = open(a.pack, "rb").read()
    pack = nf.Pack(a.pack, segment_crcs=False)
    h, m = pack.header, pack.manifest
    m_off, m_len = h["manifest_offset"], h["manifest_bytes"]
    ffn_seg = next(s for s in m["segments"] if s["kind"] == "Ffn")
    os.makedirs(a.workdir, exist_ok=True)

    def with_manifest(mb: bytes) -> bytearray:
        b = bytearray(src[:m_off]) + mb
        b[24:32] = struct.pack("<Q", len(mb))
        b[32:36] = struct.pack("<I", zlib.crc32(mb))
        refix_header(b)
        return b

    mb = src[m_off : m_off + m_len]
    arch_at = 8 + struct.unpack_from("<Q", mb, 0)[0]  # after the producer string: config.architecture
    cases: list[tuple[str, bytes, str]] = []
    cases.append(("truncated header", src[:40], "shorter than the 64-byte header"))
    b = bytearray(src); b[0:8] = b"NOTAPACK"
    cases.append(("bad magic", bytes(b), "bad magic"))
    b = bytearray(src); b[10:12] = struct.pack("<H", nf.VERSION_MINOR + 1); refix_header(b)
    cases.append((f"minor {nf.VERSION_MINOR + 1}", bytes(b), "newer than this reader"))
    b = bytearray(src); b[8:10] = struct.pack("<H", 2); refix_header(b)
    cases.append(("major 2", bytes(b), "older than this reader"))
    b = bytearray(src); b[45] ^= 0x01
    cases.append(("header byte (reserved) flipped", bytes(b), "header checksum mismatch"))
    cases.append(("truncated in the manifest", src[: m_off + m_len // 2], "truncated"))
    b = bytearray(src); b[m_off + m_len // 2] ^= 0x40
    cases.append(("manifest byte flipped", bytes(b), "manifest checksum mismatch"))
    p = ffn_seg["offset"] + ffn_seg["bytes"] // 2
    b = bytearray(src); b[p] ^= 0x01
    cases.append((f"segment {ffn_seg['name']} byte flipped", bytes(b), f"segment '{ffn_seg['name']}'"))
    bad = bytearray(mb); bad[arch_at : arch_at + 4] = struct.pack("<I", 7)
    cases.append(("architecture variant 7 (CRCs fixed)", bytes(with_manifest(bytes(bad))), "Architecture variant index 7"))
    cases.append(("one byte after the manifest (CRCs fixed)", bytes(with_manifest(mb + b"\x00")), "left over"))
    cases.append(("manifest one byte short (CRCs fixed)", bytes(with_manifest(mb[:-1])), "needs"))
    # rope_scaling tag (after architecture, 7 u64 and 2 f64) set to 2: neither None nor Some.
    bad = bytearray(mb); bad[arch_at + 4 + 56 + 16] = 2
    cases.append(("Option tag 2 (CRCs fixed)", bytes(with_manifest(bytes(bad))), "Option tag 2"))

    def edited(edit) -> bytes:
        m2 = json.loads(json.dumps(m))
        edit(m2)
        return bytes(with_manifest(nf.encode_manifest(m2)))

    def set_(path, value):
        def f(m2):
            o = m2
            for k in path[:-1]:
                o = o[k]
            o[path[-1]] = value
        return f

    t0 = next(i for i, t in enumerate(m["tensors"]) if t["offset"] > 0)
    cases.append(("bool byte 2 (CRCs fixed)", edited(set_(["config", "mlp_bias"], 2)), "bool byte 2"))
    cases.append(("num_heads not a multiple of num_kv_heads", edited(set_(["config", "num_heads"], m["config"]["num_kv_heads"] * 2 + 1)), "not a multiple of num_kv_heads"))
    cases.append(("segment off its alignment", edited(set_(["segments", 1, "offset"], m["segments"][1]["offset"] + 4096)), "not aligned"))
    cases.append(("tensor offset not a multiple of 64", edited(set_(["tensors", t0, "offset"], m["tensors"][t0]["offset"] + 1)), "not a multiple of 64"))
    cases.append(("tensor bytes wrong for its shape", edited(set_(["tensors", 0, "bytes"], m["tensors"][0]["bytes"] - 2)), "needs"))
    if len(m["ffn"][0]["clusters"]) > 1:
        cases.append(("cluster out of order", edited(set_(["ffn", 0, "clusters", 1, "first"], m["ffn"][0]["clusters"][1]["first"] + 1)), "out of order"))
    cases.append(("order not a permutation", edited(set_(["ffn", 0, "order", 0], m["ffn"][0]["order"][1])), "not a permutation"))
    cases.append(("bundle layout wrong", edited(set_(["ffn", 0, "bundle", "bundle_bytes"], m["ffn"][0]["bundle"]["bundle_bytes"] + 1)), "bundle layout"))
    if m["sparse"] is not None:
        cases.append(("layer sparsity missing in one layer", edited(set_(["ffn", 0, "sparse"], None)), "only some"))
    if m["plan"] is not None:
        cases.append(("hot set off a cluster boundary", edited(set_(["plan", "hot_neurons", 0], 1)), "cluster boundary"))
        cases.append(("65 I/O threads", edited(set_(["plan", "io_threads"], 65)), "I/O threads"))

    for name, data, expect in cases:
        path = os.path.join(a.workdir, "corrupt.nflash")
        with open(path, "wb") as f:
            f.write(data)
        try:
            nf.Pack(path)
            fail(f"{name}: our reader accepted it")
        except nf.PackError as e:
            ours = str(e)
        if expect not in ours:
            fail(f"{name}: our reader said {ours!r}, expected {expect!r}")
        r = subprocess.run([a.prep, "verify", path], capture_output=True, text=True)
        if r.returncode == 0:
            fail(f"{name}: prep verify accepted it")
        theirs = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1]
        print(f"ok  {name}: ours: {ours}\n    prep verify (exit {r.returncode}): {theirs}")
        os.remove(path)
    print(f"ok  {len(cases)} damaged copies of {a.pack}: refused by both readers")


# --- downgrade: the same pack as format 3.3 wrote it ------------------------


def cmd_downgrade(a) -> None:
    """Writes OUT: PACK as a 3.3 writer would have written it, without the
    neuron-cluster checksum table (SPEC §4.10, §8.2): the table's segment
    entry dropped from the manifest (its bytes stay, a gap no CRC covers) and
    the header's minor set to 3. For testing readers of older packs."""
    src = open(a.pack, "rb").read()
    pack = nf.Pack(a.pack)
    h, m = pack.header, pack.manifest
    if m["segments"][-1]["kind"] != "ClusterChecksums":
        fail(f"{a.pack}: its last segment is not the checksum table; nothing to downgrade")
    m2 = json.loads(json.dumps(m))
    m2["segments"].pop()
    mb = nf.encode_manifest(m2)
    b = bytearray(src[: h["manifest_offset"]]) + mb
    if not a.keep_minor:
        b[10:12] = struct.pack("<H", 3)
    b[24:32] = struct.pack("<Q", len(mb))
    b[32:36] = struct.pack("<I", zlib.crc32(mb))
    refix_header(b)
    with open(a.out, "wb") as f:
        f.write(b)
    if a.keep_minor:
        print(f"ok  {a.out}: {a.pack} without its neuron-cluster checksums, still marked format {h['major']}.{h['minor']}")
        return
    nf.Pack(a.out)
    print(f"ok  {a.out}: {a.pack} as format 3.3, without neuron-cluster checksums")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("pack")
    c.add_argument("--prep", required=True)
    w = sub.add_parser("weights")
    w.add_argument("pack")
    w.add_argument("--model", required=True)
    w.add_argument("--rows", type=int, default=3, help="rows / bundles sampled per tensor / layer")
    w.add_argument("--all-layers", action="store_true")
    w.add_argument("--seed", type=int, default=0)
    k = sub.add_parser("corrupt")
    k.add_argument("pack")
    k.add_argument("--prep", required=True)
    k.add_argument("--workdir", required=True)
    d = sub.add_parser("downgrade")
    d.add_argument("pack")
    d.add_argument("out")
    d.add_argument("--keep-minor", action="store_true", help="keep the header's version: a 3.4-or-later pack stripped of its table")
    a = ap.parse_args()
    try:
        {"compare": cmd_compare, "weights": cmd_weights, "corrupt": cmd_corrupt, "downgrade": cmd_downgrade}[a.cmd](a)
    except nf.PackError as e:
        fail(f"{a.pack}: {e}")


if __name__ == "__main__":
    main()
