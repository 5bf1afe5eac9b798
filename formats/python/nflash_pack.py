#!/usr/bin/env python3
"""An independent reader of `.nflash` packs, written from formats/SPEC.md alone.

Python 3.11, standard library only. It decodes the header (SPEC §2) and the
whole bincode manifest (SPEC §4), runs the checks of SPEC §6, checks the
header, manifest and every segment CRC-32, and prints everything as JSON:

    python3 formats/python/nflash_pack.py inspect PACK [--no-segment-crc] [--compact]

Exit status: 0 for a good pack, 1 for a bad one (the message on stderr names
the problem, its offset and the SPEC section), 2 for a usage error.

Enums print as serde_json prints them (a unit variant as its name, a struct
variant as {"Variant": {fields}}), f32 values as the shortest decimal that
reads back to the same f32, so the output can be compared with
`prep inspect --json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import zlib

# --- SPEC §2: header -------------------------------------------------------

MAGIC = b"NFLASHPK"
HEADER_BYTES = 64
VERSION_MAJOR = 3  # the version this reader implements (SPEC title)
VERSION_MINOR = 5
MAX_MANIFEST_BYTES = 256 << 20
MAX_TOKENIZER_BYTES = 256 << 20
MAX_METADATA_BYTES = 1 << 20
MAX_CONTEXT = 1 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# --- SPEC §4: the manifest schema, field by field ---------------------------
# A type is one of the primitive names, ("vec", T), ("option", T), ("array",
# T, n) (n elements, no length prefix), or the name of a struct or enum below.
# Structs: fields in wire order. Enums: variants in index order, each None
# (unit variant), a list of fields (struct variant) or a type (newtype
# variant, e.g. SmolLm3's LayerSet).

STRUCTS: dict[str, list[tuple[str, object]]] = {
    "Manifest": [
        ("producer", "string"),
        ("config", "ModelConfig"),
        ("tokenizer", "TokenizerInfo"),
        ("segments", ("vec", "Segment")),
        ("tensors", ("vec", "TensorEntry")),
        ("ffn", ("vec", "FfnLayer")),
        ("sparse", ("option", "SparseInfo")),
        ("plan", ("option", "Plan")),
    ],
    "Segment": [
        ("name", "string"),
        ("kind", "SegmentKind"),
        ("offset", "u64"),
        ("bytes", "u64"),
        ("crc32", "u32"),
    ],
    "ModelConfig": [
        ("architecture", "Architecture"),
        ("vocab_size", "u64"),
        ("hidden_size", "u64"),
        ("intermediate_size", "u64"),
        ("num_layers", "u64"),
        ("num_heads", "u64"),
        ("num_kv_heads", "u64"),
        ("head_dim", "u64"),
        ("rms_norm_eps", "f64"),
        ("rope_theta", "f64"),
        ("rope_scaling", ("option", "RopeScaling")),
        ("max_position_embeddings", "u64"),
        ("sliding_window", ("option", "u64")),
        ("activation", "Activation"),
        ("tie_word_embeddings", "bool"),
        ("attention_bias", "bool"),
        ("mlp_bias", "bool"),
        ("bos_token_id", ("option", "u32")),
        ("eos_token_ids", ("vec", "u32")),
    ],
    "TokenizerInfo": [
        ("segment", "string"),
        ("json_bytes", "u64"),
        ("chat_template", ("option", "string")),
        ("bos_token", ("option", "string")),
        ("eos_token", ("option", "string")),
        ("add_bos_token", "bool"),
    ],
    "TensorEntry": [
        ("name", "string"),
        ("segment", "u32"),
        ("offset", "u64"),
        ("bytes", "u64"),
        ("dtype", "DType"),
        ("shape", ("vec", "u64")),
    ],
    "FfnLayer": [
        ("layer", "u32"),
        ("segment", "u32"),
        ("n_neurons", "u32"),
        ("bundle", "BundleLayout"),
        ("cluster_align", "u64"),
        ("clusters", ("vec", "NeuronCluster")),
        ("order", ("vec", "u32")),
        ("sparse", ("option", "LayerSparsity")),
    ],
    "BundleLayout": [
        ("dtype", "DType"),
        ("row_elems", "u64"),
        ("row_bytes", "u64"),
        ("bundle_bytes", "u64"),
    ],
    "NeuronCluster": [
        ("offset", "u64"),
        ("first", "u32"),
        ("n_neurons", "u32"),
    ],
    "SparseInfo": [
        ("criterion", "Criterion"),
        ("predictor", "PredictorKind"),
        ("rank", "u32"),
        ("target_sparsity", "f32"),
        ("recall_target", "f32"),
        ("calib_tokens", "u64"),
        ("calib_source", "string"),
    ],
    "LayerSparsity": [
        ("threshold", "f32"),
        ("predictor_threshold", "f32"),
        ("predictor_bytes", "u64"),
        ("quality", "PredictorQuality"),
        ("frequency_curve", ("vec", "f32")),
    ],
    "PredictorQuality": [
        ("recall", "f32"),
        ("precision", "f32"),
        ("bundles_skipped", "f32"),
        ("sparsity", "f32"),
        ("tokens", "u32"),
    ],
    "Plan": [
        ("device", "DeviceProfile"),
        ("memory_budget_bytes", "u64"),
        ("ctx", "u32"),
        ("threads", "u32"),
        ("fixed_bytes", "u64"),
        ("resident_bytes", "u64"),
        ("kv_bytes", "u64"),
        ("hot_neurons", ("vec", "u32")),
        ("hot_bytes", "u64"),
        ("cold_bytes", "u64"),
        ("io_threads", "u32"),
        ("cluster_bytes", "u64"),
        ("expected_read_bytes_per_token", "u64"),
        ("expected_token_ms", "f64"),
    ],
    "DeviceProfile": [  # `kernels` is not encoded (SPEC §4.6)
        ("name", "string"),
        ("source", "string"),
        ("memory", "MemoryInfo"),
        ("cpu", "CpuInfo"),
        ("flash", "FlashInfo"),
    ],
    "MemoryInfo": [
        ("total_bytes", "u64"),
        ("available_bytes", "u64"),
        ("bandwidth_gb_s", "f64"),
    ],
    "CpuInfo": [
        ("cores", ("vec", "CoreClass")),
        ("q4_0_matvec_gb_s_1t", ("option", "f64")),
        ("q4_0_matvec_gb_s_mt", ("option", "f64")),
        ("threads_measured", ("option", "u32")),
    ],
    "CoreClass": [
        ("class", "string"),
        ("count", "u32"),
        ("ghz", "f64"),
    ],
    "FlashInfo": [
        ("io_queues", "u32"),
        ("read", ("vec", "ReadPoint")),
    ],
    "ReadPoint": [
        ("block_bytes", "u64"),
        ("in_flight", "u32"),
        ("random_mb_s", "f64"),
        ("sequential_mb_s", "f64"),
    ],
}

ENUMS: dict[str, list[tuple[str, object]]] = {
    "SegmentKind": [("Tokenizer", None), ("Resident", None), ("Ffn", None), ("Metadata", None), ("ClusterChecksums", None)],
    "DType": [("F32", None), ("F16", None), ("Q8_0", None), ("Q4_0", None)],
    # Since 3.3, the mixtures of experts carry their `Moe` fields (SPEC §4.1).
    "Architecture": [
        ("Llama", None),
        ("Mistral", None),
        ("Qwen2", None),
        ("Mixtral", [("num_experts", "u32"), ("experts_per_token", "u32"), ("norm_topk_prob", "bool")]),
        ("Qwen3Moe", [("num_experts", "u32"), ("experts_per_token", "u32"), ("norm_topk_prob", "bool")]),
        # Since 3.5: Qwen3 (dense), SmolLM3 with its LayerSet of RoPE layers:
        # layer l is in the set when bit l % 64 of word l // 64 is 1.
        ("Qwen3", None),
        ("SmolLm3", ("array", "u64", 16)),
        # Phi-3: the elements of each head RoPE rotates.
        ("Phi3", [("rotary_dim", "u64")]),
        # Gemma 3: the attention scale's denominator, the sliding layers'
        # RoPE base and the set of sliding-window layers (a LayerSet).
        (
            "Gemma3",
            [
                ("query_pre_attn_scalar", "u64"),
                ("rope_local_base_freq", "f64"),
                ("sliding_layers", ("array", "u64", 16)),
            ],
        ),
    ],
    "Activation": [("Silu", None), ("Relu", None), ("Gelu", None), ("GeluTanh", None), ("DRelu", None)],
    "RopeScaling": [
        ("Linear", [("factor", "f64")]),
        (
            "Llama3",
            [
                ("factor", "f64"),
                ("low_freq_factor", "f64"),
                ("high_freq_factor", "f64"),
                ("original_max_position_embeddings", "u64"),
            ],
        ),
        # Since 3.5 (Phi-3.5-mini, Phi-4-mini).
        (
            "LongRope",
            [
                ("short_factor", ("vec", "f32")),
                ("long_factor", ("vec", "f32")),
                ("original_max_position_embeddings", "u64"),
                ("attention_factor", "f64"),
            ],
        ),
    ],
    "Criterion": [("Gate", None), ("GateUp", None)],
    "PredictorKind": [("Exact", None), ("LowRank", None), ("Mlp", None)],
}

# --- SPEC §5: element types ------------------------------------------------

# dtype name -> (elements per block, bytes per block)
DTYPES = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18)}


def row_bytes(dtype: str, n: int) -> int | None:
    """Bytes of a row of n elements, or None if n is not a whole number of blocks."""
    elems, size = DTYPES[dtype]
    if n % elems:
        return None
    return n // elems * size


def tensor_bytes(dtype: str, shape: list[int]) -> int | None:
    if not shape:
        return None
    rb = row_bytes(dtype, shape[-1])
    if rb is None:
        return None
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rb * rows


def dequantize_row(dtype: str, data: bytes, n: int) -> list[float]:
    """The n values of one row stored as `dtype` (SPEC §5)."""
    if len(data) != row_bytes(dtype, n):
        raise ValueError(f"{len(data)} bytes is not one {dtype} row of {n} elements")
    if dtype == "F32":
        return list(struct.unpack(f"<{n}f", data))
    if dtype == "F16":
        return list(struct.unpack(f"<{n}e", data))
    out: list[float] = []
    if dtype == "Q8_0":
        for b in range(0, len(data), 34):
            (d,) = struct.unpack_from("<e", data, b)
            out.extend(q * d for q in struct.unpack_from("<32b", data, b + 2))
        return out
    if dtype == "Q4_0":
        for b in range(0, len(data), 18):
            (d,) = struct.unpack_from("<e", data, b)
            qs = data[b + 2 : b + 18]
            out.extend(((q & 0x0F) - 8) * d for q in qs)
            out.extend(((q >> 4) - 8) * d for q in qs)
        return out
    raise ValueError(f"unknown dtype {dtype}")


# --- errors ----------------------------------------------------------------


class PackError(Exception):
    """A bad pack: the message names the part, its offset and the SPEC section."""


# --- bincode decoding (SPEC §4) --------------------------------------------


F32_MAX = 3.4028234663852886e38
# Decimals above F32_MAX by less than half an ulp round to it (IEEE round to
# nearest); Python's struct refuses them, so pack_f32 rounds them itself.
F32_ROUNDS_TO_MAX = 3.4028235677973366e38


def pack_f32(v: float) -> bytes:
    """`v` rounded to the nearest f32, little-endian (as Rust's `as f32`: past
    the f32 range, infinity)."""
    if math.isfinite(v) and abs(v) > F32_MAX:
        v = math.copysign(F32_MAX if abs(v) < F32_ROUNDS_TO_MAX else math.inf, v)
    return struct.pack("<f", v)


def f32_value(bits: bytes) -> float:
    """The f32 as the shortest decimal that reads back to the same f32 (as serde_json prints it)."""
    (x,) = struct.unpack("<f", bits)
    if not math.isfinite(x):
        return x
    for p in range(1, 10):
        s = f"{x:.{p}g}"
        if pack_f32(float(s)) == bits:
            return float(s)
    return x


class Decoder:
    """bincode 1.x, fixint, little-endian, over the manifest bytes; `base` is their file offset."""

    def __init__(self, data: bytes, base: int):
        self.data = data
        self.pos = 0
        self.base = base
        self.path: list[str] = []

    def fail(self, why: str) -> PackError:
        where = ".".join(self.path) or "manifest"
        return PackError(
            f"manifest (SPEC §4): {why} at {where}, manifest byte {self.pos} (file offset {self.base + self.pos})"
        )

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise self.fail(f"needs {n} more bytes, {len(self.data) - self.pos} left")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def prim(self, t: str):
        if t == "u8":
            return self.take(1)[0]
        if t == "u32":
            return struct.unpack("<I", self.take(4))[0]
        if t == "u64":
            return struct.unpack("<Q", self.take(8))[0]
        if t == "f32":
            return f32_value(self.take(4))
        if t == "f64":
            return struct.unpack("<d", self.take(8))[0]
        if t == "bool":
            v = self.take(1)[0]
            if v > 1:
                self.pos -= 1
                raise self.fail(f"bool byte {v} (must be 0 or 1)")
            return v == 1
        if t == "string":
            n = struct.unpack("<Q", self.take(8))[0]
            raw = self.take(n)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise self.fail(f"string is not UTF-8 ({e})") from None
        raise AssertionError(t)

    def value(self, t):
        if isinstance(t, tuple) and t[0] == "array":
            return [self.value(t[1]) for _ in range(t[2])]
        if isinstance(t, tuple):
            kind, inner = t
            if kind == "option":
                tag = self.take(1)[0]
                if tag == 0:
                    return None
                if tag != 1:
                    self.pos -= 1
                    raise self.fail(f"Option tag {tag} (must be 0 or 1)")
                return self.value(inner)
            if kind == "vec":
                n = struct.unpack("<Q", self.take(8))[0]
                # Every element takes at least one byte: a count larger than the bytes left is an error.
                if n > len(self.data) - self.pos:
                    raise self.fail(f"Vec of {n} elements, only {len(self.data) - self.pos} bytes left")
                out = []
                for i in range(n):
                    self.path.append(f"[{i}]")
                    out.append(self.value(inner))
                    self.path.pop()
                return out
            raise AssertionError(kind)
        if t in STRUCTS:
            return self.fields(STRUCTS[t])
        if t in ENUMS:
            variants = ENUMS[t]
            idx = struct.unpack("<I", self.take(4))[0]
            if idx >= len(variants):
                self.pos -= 4
                raise self.fail(f"{t} variant index {idx} (this reader knows 0..{len(variants) - 1})")
            name, fields = variants[idx]
            if fields is None:
                return name
            if not isinstance(fields, list):
                return {name: self.value(fields)}
            return {name: self.fields(fields)}
        return self.prim(t)

    def fields(self, fields) -> dict:
        out = {}
        for name, t in fields:
            self.path.append(name)
            out[name] = self.value(t)
            self.path.pop()
        return out


def decode_manifest(data: bytes, base: int) -> dict:
    d = Decoder(data, base)
    m = d.value("Manifest")
    if d.pos != len(data):
        raise PackError(
            f"manifest (SPEC §4): {len(data) - d.pos} bytes left over after the Manifest "
            f"(decoded {d.pos} of {len(data)} bytes)"
        )
    return m


def encode(t, v) -> bytes:
    """The bincode bytes of value v of type t (the inverse of Decoder.value): for tests and tools."""
    if isinstance(t, tuple) and t[0] == "array":
        return b"".join(encode(t[1], x) for x in v)
    if isinstance(t, tuple):
        kind, inner = t
        if kind == "option":
            return b"\x00" if v is None else b"\x01" + encode(inner, v)
        return struct.pack("<Q", len(v)) + b"".join(encode(inner, x) for x in v)
    if t in STRUCTS:
        return b"".join(encode(ft, v[name]) for name, ft in STRUCTS[t])
    if t in ENUMS:
        names = [n for n, _ in ENUMS[t]]
        name = v if isinstance(v, str) else next(iter(v))
        fields = ENUMS[t][names.index(name)][1]
        out = struct.pack("<I", names.index(name))
        if isinstance(fields, list):
            out += b"".join(encode(ft, v[name][fn]) for fn, ft in fields)
        elif fields is not None:
            out += encode(fields, v[name])
        return out
    if t == "string":
        b = v.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    if t == "bool":
        return bytes([int(v)])
    if t == "f32":
        return pack_f32(v)
    return struct.pack({"u8": "<B", "u32": "<I", "u64": "<Q", "f64": "<d"}[t], v)


def encode_manifest(m: dict) -> bytes:
    return encode("Manifest", m)


# --- zstd frame header (RFC 8878 §3.1.1.1), for the tokenizer segment -------


def zstd_content_size(frame: bytes) -> int | None:
    """The Frame_Content_Size of a zstd frame header, or None if not recorded."""
    if frame[:4] != ZSTD_MAGIC or len(frame) < 6:
        raise ValueError("not a zstd frame (magic 28 B5 2F FD)")
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0:
        return None
    v = int.from_bytes(frame[pos : pos + size], "little")
    return v + 256 if size == 2 else v


# --- the pack ---------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), SPEC Conventions: reflected 0x82F63B78, init and final XOR 0xFFFFFFFF."""
    crc, t = 0xFFFFFFFF, CRC32C_TABLE
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc_of_range(f, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            raise PackError(f"file ends inside the range at offset {offset}, {length} bytes")
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def read_header(b: bytes) -> dict:
    (magic, major, minor, alignment, m_off, m_len, m_crc, flags, reserved, h_crc) = struct.unpack(
        "<8sHHIQQII20sI", b
    )
    return {
        "magic": magic.decode("latin-1"),
        "major": major,
        "minor": minor,
        "alignment": alignment,
        "manifest_offset": m_off,
        "manifest_bytes": m_len,
        "manifest_crc32": m_crc,
        "flags": flags,
        "reserved": reserved.hex(),
        "header_crc32": h_crc,
    }


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_config(c: dict) -> None:
    """SPEC §4.1."""
    nonzero = [
        "vocab_size", "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
    ]
    for k in nonzero:
        if c[k] == 0:
            raise PackError(f"model config (SPEC §4.1): {k} is 0")
    caps = {
        "vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
        "num_layers": 1 << 10, "num_heads": 1 << 10, "head_dim": 1 << 12,
        "max_position_embeddings": MAX_CONTEXT,
    }
    for k, cap in caps.items():
        if c[k] > cap:
            raise PackError(f"model config (SPEC §4.1): {k} = {c[k]} exceeds {cap}")
    if c["num_heads"] % c["num_kv_heads"]:
        raise PackError(
            f"model config (SPEC §4.1): num_heads {c['num_heads']} is not a multiple of num_kv_heads {c['num_kv_heads']}"
        )
    if c["head_dim"] % 2:
        raise PackError(f"model config (SPEC §4.1): head_dim {c['head_dim']} is odd")
    for k in ("rms_norm_eps", "rope_theta"):
        if not (math.isfinite(c[k]) and c[k] > 0):
            raise PackError(f"model config (SPEC §4.1): {k} {c[k]} is not a positive number")
    a = c["architecture"]
    rot = a["Phi3"]["rotary_dim"] if isinstance(a, dict) and "Phi3" in a else c["head_dim"]
    lr = c["rope_scaling"].get("LongRope") if isinstance(c["rope_scaling"], dict) else None
    if lr is not None:
        for k in ("short_factor", "long_factor"):
            if len(lr[k]) != rot // 2 or not all(math.isfinite(x) and x > 0 for x in lr[k]):
                raise PackError(f"model config (SPEC §4.1): rope_scaling {k} of {len(lr[k])} factors, RoPE rotates {rot}")
        if not 1 <= lr["original_max_position_embeddings"] <= MAX_CONTEXT:
            raise PackError("model config (SPEC §4.1): LongRoPE original_max_position_embeddings out of range")
        if not (math.isfinite(lr["attention_factor"]) and lr["attention_factor"] > 0):
            raise PackError("model config (SPEC §4.1): LongRoPE attention_factor is not a positive number")
    if isinstance(a, dict) and "Phi3" in a:
        if rot < 2 or rot % 2 or rot > c["head_dim"]:
            raise PackError(f"model config (SPEC §4.1): RoPE rotates {rot} elements of heads of {c['head_dim']}")
    if isinstance(a, dict) and "SmolLm3" in a:
        words = a["SmolLm3"]
        past = [l for l in range(1024) if words[l // 64] >> (l % 64) & 1 and l >= c["num_layers"]]
        if past:
            raise PackError(f"model config (SPEC §4.1): RoPE layer set names layer {past[0]} of {c['num_layers']}")
    if isinstance(a, dict) and "Gemma3" in a:
        g = a["Gemma3"]
        words = g["sliding_layers"]
        past = [l for l in range(1024) if words[l // 64] >> (l % 64) & 1 and l >= c["num_layers"]]
        if past:
            raise PackError(f"model config (SPEC §4.1): sliding layer set names layer {past[0]} of {c['num_layers']}")
        if g["query_pre_attn_scalar"] < 1:
            raise PackError("model config (SPEC §4.1): query_pre_attn_scalar is 0")
        if not (math.isfinite(g["rope_local_base_freq"]) and g["rope_local_base_freq"] > 0):
            raise PackError("model config (SPEC §4.1): rope_local_base_freq is not a positive number")
    moe = moe_of(c)
    if moe is not None:
        if not 1 <= moe["num_experts"] <= 1024:
            raise PackError(f"model config (SPEC §4.1): {moe['num_experts']} experts per layer")
        if not 1 <= moe["experts_per_token"] <= moe["num_experts"]:
            raise PackError(f"model config (SPEC §4.1): {moe['experts_per_token']} experts per token of {moe['num_experts']}")
        if c["num_layers"] * moe["num_experts"] > 1 << 16:
            raise PackError("model config (SPEC §4.1): more than 2^16 FFN units")
        if c["mlp_bias"]:
            raise PackError("model config (SPEC §4.1): mlp_bias with a mixture of experts")


def moe_of(c: dict) -> dict | None:
    """The `Moe` fields of a mixture-of-experts architecture (SPEC §4.1), or None."""
    a = c["architecture"]
    if isinstance(a, dict) and ("Mixtral" in a or "Qwen3Moe" in a):
        return next(iter(a.values()))
    return None


def experts(c: dict) -> int:
    """Experts per layer: 1 for a dense model (SPEC §4.1)."""
    moe = moe_of(c)
    return 1 if moe is None else moe["num_experts"]


def validate(m: dict, h: dict, file_len: int) -> None:
    """SPEC §6 steps 9-13."""
    c = m["config"]
    check_config(c)
    align = h["alignment"]
    segs = m["segments"]
    prev_end = HEADER_BYTES
    limit = min(h["manifest_offset"], file_len)
    for s in segs:
        what = f"segment {s['name']!r} (offset {s['offset']}, {s['bytes']} bytes)"
        if s["offset"] + s["bytes"] > limit:
            raise PackError(f"{what} (SPEC §3): extends past {limit}, the start of the manifest or the end of the file")
        if s["offset"] % align or s["offset"] < prev_end:
            raise PackError(f"{what} (SPEC §3): not aligned to {align} or overlaps the previous segment (ends {prev_end})")
        prev_end = s["offset"] + s["bytes"]
        if s["kind"] == "Metadata" and s["bytes"] > MAX_METADATA_BYTES:
            raise PackError(f"{what} (SPEC §4.9): metadata exceeds {MAX_METADATA_BYTES} bytes")
    n_meta = sum(s["kind"] == "Metadata" for s in segs)
    if n_meta > 1:
        raise PackError("segments (SPEC §4.9): more than one metadata segment")
    if n_meta and h["minor"] < 2:
        raise PackError(f"segments (SPEC §4.9): a metadata segment in a pack of version {h['major']}.{h['minor']}")
    tables = [s for s in segs if s["kind"] == "ClusterChecksums"]
    if len(tables) > 1:
        raise PackError("segments (SPEC §4.10): more than one neuron-cluster checksum table")
    if tables and h["minor"] < 4:
        raise PackError(f"segments (SPEC §4.10): a checksum table in a pack of version {h['major']}.{h['minor']}")
    n_clusters = sum(len(f["clusters"]) for f in m["ffn"])
    if tables and tables[0]["bytes"] != 4 * n_clusters:
        raise PackError(f"segment 'checksums' (SPEC §4.10): {tables[0]['bytes']} bytes for {n_clusters} neuron clusters (4 each)")

    def seg(idx: int, what: str) -> dict:
        if idx >= len(segs):
            raise PackError(f"{what}: segment index {idx} out of range ({len(segs)} segments)")
        return segs[idx]

    for t in m["tensors"]:
        what = f"tensor {t['name']!r} (SPEC §4.3)"
        s = seg(t["segment"], what)
        if not 1 <= len(t["shape"]) <= 4:
            raise PackError(f"{what}: rank {len(t['shape'])} not in 1..=4")
        need = tensor_bytes(t["dtype"], t["shape"])
        if need is None:
            raise PackError(f"{what}: shape {t['shape']} does not fit {t['dtype']} blocks")
        if need != t["bytes"]:
            raise PackError(f"{what}: {t['bytes']} bytes recorded, shape {t['shape']} of {t['dtype']} needs {need}")
        if t["offset"] + t["bytes"] > s["bytes"]:
            raise PackError(f"{what}: offset {t['offset']} + {t['bytes']} bytes extends past its segment ({s['bytes']} bytes)")
        if t["offset"] % 64:
            raise PackError(f"{what}: offset {t['offset']} not a multiple of 64")

    if moe_of(c) is not None and h["minor"] < 3:
        raise PackError(f"model config (SPEC §4.1): a mixture of experts in a pack of version {h['major']}.{h['minor']}")
    a = c["architecture"]
    longrope = isinstance(c["rope_scaling"], dict) and "LongRope" in c["rope_scaling"]
    new_in_35 = a == "Qwen3" or (isinstance(a, dict) and any(k in a for k in ("SmolLm3", "Phi3", "Gemma3")))
    if (longrope or new_in_35) and h["minor"] < 5:
        name = a if isinstance(a, str) else next(iter(a))
        raise PackError(f"model config (SPEC §4.1): architecture {name} in a pack of version {h['major']}.{h['minor']}")
    n_exp = experts(c)
    if len(m["ffn"]) != c["num_layers"] * n_exp:
        raise PackError(f"FFN index (SPEC §4.4): {len(m['ffn'])} entries, config has {c['num_layers']} layers × {n_exp} experts")
    for l, f in enumerate(m["ffn"]):
        what = f"FFN unit {l} (SPEC §4.4)"
        s = seg(f["segment"], what)
        if s["kind"] != "Ffn" or f["layer"] != l // n_exp:
            raise PackError(f"{what}: segment {s['name']!r} of kind {s['kind']}, layer number {f['layer']}")
        n = f["n_neurons"]
        if n != c["intermediate_size"]:
            raise PackError(f"{what}: {n} neurons, config has {c['intermediate_size']}")
        b = f["bundle"]
        rb = row_bytes(b["dtype"], c["hidden_size"])
        if rb is None or b != {"dtype": b["dtype"], "row_elems": c["hidden_size"], "row_bytes": rb, "bundle_bytes": 3 * rb}:
            raise PackError(f"{what}: bundle layout {b} does not match hidden_size {c['hidden_size']}")
        if not is_pow2(f["cluster_align"]) or f["cluster_align"] > align:
            raise PackError(f"{what}: cluster alignment {f['cluster_align']}")
        nxt = 0
        for cl in f["clusters"]:
            if cl["first"] != nxt or cl["n_neurons"] == 0 or cl["offset"] % f["cluster_align"]:
                raise PackError(
                    f"{what}: cluster at offset {cl['offset']} (first {cl['first']}, {cl['n_neurons']} neurons) is out of order or misaligned"
                )
            if cl["offset"] + cl["n_neurons"] * b["bundle_bytes"] > s["bytes"]:
                raise PackError(f"{what}: cluster at offset {cl['offset']} ({cl['n_neurons']} neurons) extends past its segment")
            nxt += cl["n_neurons"]
        if nxt != n:
            raise PackError(f"{what}: clusters cover {nxt} of {n} neurons")
        if len(f["order"]) != n or sorted(f["order"]) != list(range(n)):
            raise PackError(f"{what}: neuron order is not a permutation of 0..{n}")
        if (f["sparse"] is None) != (m["sparse"] is None):
            raise PackError(f"{what}: sparsity settings present in only some of the manifest (SPEC §4.5)")
        sp = f["sparse"]
        if sp is not None:
            q = sp["quality"]
            figs = list(sp["frequency_curve"]) + [q["recall"], q["precision"], q["bundles_skipped"], q["sparsity"]]
            if not all(0 <= v <= 1 for v in figs):
                raise PackError(f"{what}: a frequency or predictor quality figure is not a fraction in [0, 1] (SPEC §4.5)")
        if sp is not None and (
            not math.isfinite(sp["threshold"]) or not math.isfinite(sp["predictor_threshold"]) or len(sp["frequency_curve"]) > 33
        ):
            raise PackError(f"{what}: sparsity threshold / predictor threshold / {len(sp['frequency_curve'])}-point curve (SPEC §4.5)")

    p = m["plan"]
    if p is not None:
        if len(p["hot_neurons"]) != len(m["ffn"]):
            raise PackError(f"plan (SPEC §4.6): {len(p['hot_neurons'])} hot-set sizes for {len(m['ffn'])} layers")
        for f, hot in zip(m["ffn"], p["hot_neurons"]):
            if hot != f["n_neurons"] and not any(cl["first"] == hot for cl in f["clusters"]):
                raise PackError(f"plan (SPEC §4.6): layer {f['layer']} hot set of {hot} neurons does not end on a cluster boundary")
        if not 2 <= p["ctx"] <= MAX_CONTEXT:
            raise PackError(f"plan (SPEC §4.6): context of {p['ctx']} tokens (supported: 2 to {MAX_CONTEXT})")
        if not 1 <= p["io_threads"] <= 64 or p["threads"] == 0:
            raise PackError(f"plan (SPEC §4.6): {p['io_threads']} I/O threads, {p['threads']} compute threads")


class Pack:
    """An opened, validated pack."""

    def __init__(self, path: str, segment_crcs: bool = True):
        self.path = path
        self.checks: list[str] = []
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PackError("no such file") from None
        if not os.path.isfile(path):
            raise PackError("not a regular file")
        self.file_len = st.st_size
        with open(path, "rb") as f:
            self._open(f, segment_crcs)

    def _open(self, f, segment_crcs: bool) -> None:
        if self.file_len < HEADER_BYTES:
            raise PackError(f"file is {self.file_len} bytes, shorter than the {HEADER_BYTES}-byte header (SPEC §2)")
        hb = f.read(HEADER_BYTES)
        h = read_header(hb)
        self.header = h
        if hb[:8] != MAGIC:
            raise PackError(f"bad magic {hb[:8]!r}, expected {MAGIC!r}: not an nflash pack (SPEC §2)")
        ver, mine = f"{h['major']}.{h['minor']}", f"{VERSION_MAJOR}.{VERSION_MINOR}"
        if h["major"] < VERSION_MAJOR:
            raise PackError(f"format version {ver} is older than this reader's {mine}; convert the checkpoint again (SPEC §8)")
        if h["major"] != VERSION_MAJOR or h["minor"] > VERSION_MINOR:
            raise PackError(f"format version {ver} is newer than this reader's {mine} (SPEC §8)")
        self.checks.append(f"version {ver} readable by {mine}")
        crc = zlib.crc32(hb[:60])
        if crc != h["header_crc32"]:
            raise PackError(f"header checksum mismatch: stored {h['header_crc32']:#010x}, computed {crc:#010x} (SPEC §2)")
        self.checks.append("header crc32")
        if not is_pow2(h["alignment"]) or h["alignment"] < 4096:
            raise PackError(f"header alignment {h['alignment']} is not a power of two >= 4096 (SPEC §2)")
        m_off, m_len = h["manifest_offset"], h["manifest_bytes"]
        if m_off + m_len > self.file_len:
            raise PackError(
                f"file is {self.file_len} bytes but the header puts the manifest at offset {m_off}, "
                f"{m_len} bytes (ending at {m_off + m_len}): the file is truncated (SPEC §2)"
            )
        if m_len > MAX_MANIFEST_BYTES:
            raise PackError(f"manifest of {m_len} bytes exceeds the {MAX_MANIFEST_BYTES}-byte maximum (SPEC §2)")
        f.seek(m_off)
        mb = f.read(m_len)
        crc = zlib.crc32(mb)
        if crc != h["manifest_crc32"]:
            raise PackError(
                f"manifest checksum mismatch (offset {m_off}, {m_len} bytes): stored {h['manifest_crc32']:#010x}, computed {crc:#010x} (SPEC §2)"
            )
        self.checks.append("manifest crc32")
        self.manifest = decode_manifest(mb, m_off)
        self.checks.append(f"manifest decoded: {m_len} bytes, none left over")
        validate(self.manifest, h, self.file_len)
        self.checks.append("config, segments, tensors, FFN clusters, sparsity and plan valid (SPEC §6)")
        self._check_tokenizer(f)
        self.metadata = self._read_metadata(f)
        if segment_crcs:
            for s in self.manifest["segments"]:
                crc = crc_of_range(f, s["offset"], s["bytes"])
                if crc != s["crc32"]:
                    raise PackError(
                        f"segment {s['name']!r} (offset {s['offset']}, {s['bytes']} bytes) checksum mismatch: "
                        f"stored {s['crc32']:#010x}, computed {crc:#010x} (SPEC §3)"
                    )
            self.checks.append(f"crc32 of all {len(self.manifest['segments'])} segments")
            self._check_clusters(f)

    def _check_clusters(self, f) -> None:
        """SPEC §4.10: each neuron cluster's bundles against its CRC-32C in the table."""
        tables = [s for s in self.manifest["segments"] if s["kind"] == "ClusterChecksums"]
        if not tables:
            return
        f.seek(tables[0]["offset"])
        raw = f.read(tables[0]["bytes"])
        want = struct.unpack(f"<{len(raw) // 4}I", raw)
        k = 0
        for u, ff in enumerate(self.manifest["ffn"]):
            base = self.manifest["segments"][ff["segment"]]["offset"]
            for i, cl in enumerate(ff["clusters"]):
                n = cl["n_neurons"] * ff["bundle"]["bundle_bytes"]
                f.seek(base + cl["offset"])
                got = crc32c(f.read(n))
                if got != want[k]:
                    raise PackError(
                        f"neuron cluster {i} of FFN unit {u} (file offset {base + cl['offset']}, {n} bytes): "
                        f"CRC-32C stored {want[k]:#010x}, computed {got:#010x} (SPEC §4.10)"
                    )
                k += 1
        self.checks.append(f"crc32c of all {k} neuron clusters")

    def _check_tokenizer(self, f) -> None:
        """SPEC §3: the tokenizer segment is one zstd frame of json_bytes bytes (header only: no zstd in the stdlib)."""
        info = self.manifest["tokenizer"]
        segs = [s for s in self.manifest["segments"] if s["name"] == info["segment"]]
        if not segs:
            raise PackError(f"tokenizer segment {info['segment']!r} not found (SPEC §4.2)")
        s = segs[0]
        if info["json_bytes"] > MAX_TOKENIZER_BYTES:
            raise PackError(f"tokenizer.json size {info['json_bytes']} exceeds {MAX_TOKENIZER_BYTES} (SPEC §3)")
        f.seek(s["offset"])
        head = f.read(min(s["bytes"], 18))
        try:
            size = zstd_content_size(head)
        except ValueError as e:
            raise PackError(f"segment {s['name']!r} at offset {s['offset']}: {e} (SPEC §3)") from None
        if size is not None and size != info["json_bytes"]:
            raise PackError(
                f"segment {s['name']!r}: zstd frame content size {size}, manifest says json_bytes {info['json_bytes']} (SPEC §3)"
            )
        self.checks.append("tokenizer zstd frame header" + ("" if size is None else f" (content size {size} = json_bytes)"))

    def _read_metadata(self, f) -> dict:
        """SPEC §4.9: the metadata JSON object ({} without the segment); its CRC is checked here."""
        segs = [s for s in self.manifest["segments"] if s["kind"] == "Metadata"]
        if not segs:
            return {}
        s = segs[0]
        f.seek(s["offset"])
        raw = f.read(s["bytes"])
        crc = zlib.crc32(raw)
        if crc != s["crc32"]:
            raise PackError(
                f"segment {s['name']!r} (offset {s['offset']}, {s['bytes']} bytes) checksum mismatch: "
                f"stored {s['crc32']:#010x}, computed {crc:#010x} (SPEC §3)"
            )
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise PackError(f"segment {s['name']!r}: not the metadata JSON object: {e} (SPEC §4.9)") from None
        if not isinstance(meta, dict):
            raise PackError(f"segment {s['name']!r}: metadata is not a JSON object (SPEC §4.9)")
        g = meta.get("generation")
        if g is not None:
            t, p, k = g.get("temperature"), g.get("top_p"), g.get("top_k")
            if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise PackError(f"metadata generation defaults: temperature {t} (SPEC §4.9)")
            if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
                raise PackError(f"metadata generation defaults: top_p {p} (SPEC §4.9)")
            if k is not None and not (isinstance(k, int) and 0 <= k < 1 << 32):
                raise PackError(f"metadata generation defaults: top_k {k} (SPEC §4.9)")
        e = meta.get("experts")
        if e is not None:
            if moe_of(self.manifest["config"]) is None:
                raise PackError("metadata experts: expert statistics in a pack of a dense model (SPEC §4.9)")
            share = e.get("routed_share") if isinstance(e, dict) else None
            if not isinstance(share, list) or len(share) != len(self.manifest["ffn"]):
                raise PackError(f"metadata experts: routed_share is not one number per FFN unit (SPEC §4.9)")
            if not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in share):
                raise PackError("metadata experts: a routed share outside [0, 1] (SPEC §4.9)")
            moe = moe_of(self.manifest["config"])
            k, e = moe["experts_per_token"], moe["num_experts"]
            for l in range(0, len(share), e):
                if abs(sum(share[l:l + e]) - k) > 0.01 * k:
                    raise PackError(f"metadata experts: layer {l // e}'s routed shares do not sum to {k} (SPEC §4.9)")
        self.checks.append("metadata JSON object (SPEC §4.9)")
        return meta

    def tensor(self, name: str) -> tuple[dict, bytes]:
        """A resident tensor's entry and bytes."""
        for t in self.manifest["tensors"]:
            if t["name"] == name:
                s = self.manifest["segments"][t["segment"]]
                with open(self.path, "rb") as f:
                    f.seek(s["offset"] + t["offset"])
                    return t, f.read(t["bytes"])
        raise KeyError(name)

    def bundle(self, layer: int, p: int) -> tuple[bytes, bytes, bytes]:
        """Packed position p of `layer`: its (gate row, up row, down column) bytes (SPEC §4.4)."""
        fl = self.manifest["ffn"][layer]
        s = self.manifest["segments"][fl["segment"]]
        cl = next(c for c in fl["clusters"] if c["first"] <= p < c["first"] + c["n_neurons"])
        rb = fl["bundle"]["row_bytes"]
        with open(self.path, "rb") as f:
            f.seek(s["offset"] + cl["offset"] + (p - cl["first"]) * fl["bundle"]["bundle_bytes"])
            b = f.read(3 * rb)
        return b[:rb], b[rb : 2 * rb], b[2 * rb :]

    def to_json(self) -> dict:
        return {
            "file": self.path,
            "file_bytes": self.file_len,
            "version": f"{self.header['major']}.{self.header['minor']}",
            "header": self.header,
            "manifest": self.manifest,
            "metadata": self.metadata,
            "checks": self.checks,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nflash_pack.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="check a pack and print its header and manifest as JSON")
    ins.add_argument("pack")
    ins.add_argument("--no-segment-crc", action="store_true", help="skip the segment CRCs (reading the whole file)")
    ins.add_argument("--compact", action="store_true", help="one line of JSON")
    a = ap.parse_args(argv)
    try:
        pack = Pack(a.pack, segment_crcs=not a.no_segment_crc)
    except PackError as e:
        print(f"nflash_pack.py: error: {a.pack}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nflash_pack.py: error: {a.pack}: {e}", file=sys.stderr)
        return 1
    try:
        json.dump(pack.to_json(), sys.stdout, indent=None if a.compact else 1, ensure_ascii=False)
        sys.stdout.write("\n")
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
