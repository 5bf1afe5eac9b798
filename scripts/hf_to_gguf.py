#!/usr/bin/env python3
"""Writes a Q4_0 GGUF of a Llama- or Mixtral-architecture Hugging Face
checkpoint (the synthetic models of `prep synth`) for llama.cpp, with the
`gguf` package.

    hf_to_gguf.py CKPT_DIR OUT.gguf --tokenizer-gguf SMOLLM2.gguf

- Every 2-D weight is Q4_0 (pure, as `llama_model_quantize` with pure=True),
  norms and FFN biases are F32. Q and K rows are permuted to GGUF's interleaved
  RoPE layout (the inverse of scripts/gguf_to_hf.py).
- The tokenizer metadata (byte-level BPE) is copied from an existing GGUF of
  the same tokenizer (the synthetic models reuse SmolLM2's).
- Mixtral (`MixtralForCausalLM`, also the dReLU `TurboSparseMixtralForCausalLM`)
  is written as llama.cpp writes it: the `llama` architecture with
  `expert_count` / `expert_used_count`, each layer's experts stacked into
  `ffn_{gate,up,down}_exps` (Q4_0) and the router `ffn_gate_inp` (F32).
- llama.cpp's `llama` architecture always applies SiLU to the gate: on a ReLU
  checkpoint its *outputs* differ from the model's, but it computes every FFN
  neuron densely whatever the activation, so its *speed* is that of the model
  (make bench-scale compares speed only).

Tensors are read one at a time (np.memmap of the shards); the writer holds the
quantized tensors (~0.56 bytes per weight) until it writes the file, which is
written to OUT.tmp and renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("hf_to_gguf: the gguf package is missing; run scripts/bench_setup.sh "
             "(it installs gguf==0.19.0 into .venv-bench)")


def shards(ckpt: Path) -> dict[str, tuple[Path, dict, int]]:
    """name -> (file, header entry, data start) over every safetensors shard."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            hdr = json.loads(fh.read(n))
        for name, e in hdr.items():
            if name != "__metadata__":
                out[name] = (f, e, 8 + n)
    if not out:
        sys.exit(f"hf_to_gguf: no *.safetensors in {ckpt}")
    return out


def load(index, name: str) -> np.ndarray:
    f, e, start = index[name]
    a, b = e["data_offsets"]
    shape = tuple(e["shape"])
    raw = np.memmap(f, dtype=np.uint8, mode="r", offset=start + a, shape=(b - a,))
    if e["dtype"] == "BF16":
        v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif e["dtype"] == "F16":
        v = raw.view(np.float16).astype(np.float32)
    elif e["dtype"] == "F32":
        v = np.array(raw.view(np.float32))
    else:
        sys.exit(f"hf_to_gguf: {name} has dtype {e['dtype']}; supported: BF16, F16, F32")
    return v.reshape(shape)


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate_half rows -> GGUF interleaved rows: (n_head, 2, hd/2) -> (n_head, hd/2, 2)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-gguf", type=Path, required=True,
                    help="a GGUF with the same tokenizer (e.g. bench-out/smollm2-q4_0.gguf)")
    a = ap.parse_args(argv)
    cfg = json.loads((a.ckpt / "config.json").read_text())
    arch = cfg["architectures"][0]
    moe = arch in ("MixtralForCausalLM", "TurboSparseMixtralForCausalLM")
    if arch != "LlamaForCausalLM" and not moe:
        sys.exit(f"hf_to_gguf: {arch} is not supported (LlamaForCausalLM, MixtralForCausalLM)")
    n_exp, k_exp = (cfg["num_local_experts"], cfg["num_experts_per_tok"]) if moe else (0, 0)
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    L, ff, vocab = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    idx = shards(a.ckpt)
    tok = gguf.GGUFReader(a.tokenizer_gguf)

    tmp = a.out.with_name(a.out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(a.ckpt.name)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_block_count(L)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(h // nh)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(vocab)
    if moe:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(k_exp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # Tokenizer: copied field by field from the reference GGUF.
    for key, field in tok.fields.items():
        if not key.startswith("tokenizer."):
            continue
        t = field.types
        if t[0] == gguf.GGUFValueType.ARRAY:
            vals = [field.parts[i] for i in field.data]
            if t[-1] == gguf.GGUFValueType.STRING:
                vals = [bytes(v).decode("utf-8") for v in vals]
            else:
                vals = [v.tolist()[0] for v in vals]
            w.add_array(key, vals)
        elif t[0] == gguf.GGUFValueType.STRING:
            w.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], t[0])

    q4 = gguf.GGMLQuantizationType.Q4_0
    t0 = time.perf_counter()

    def mat(name: str, hf: str, permute: int | None = None):
        x = load(idx, hf)
        if permute:
            x = rope_permute(x, permute)
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), q4), raw_dtype=q4)

    def vec(name: str, hf: str):
        w.add_tensor(name, np.ascontiguousarray(load(idx, hf), dtype=np.float32))

    def experts(name: str, hf: list[str]):
        """The experts' matrices stacked `[n_expert, rows, cols]`, Q4_0 along the rows."""
        x = np.stack([np.asarray(load(idx, n), dtype=np.float32) for n in hf])
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x), q4), raw_dtype=q4)

    mat("token_embd.weight", "model.embed_tokens.weight")
    for l in range(L):
        p, g = f"model.layers.{l}", f"blk.{l}"
        vec(f"{g}.attn_norm.weight", f"{p}.input_layernorm.weight")
        mat(f"{g}.attn_q.weight", f"{p}.self_attn.q_proj.weight", nh)
        mat(f"{g}.attn_k.weight", f"{p}.self_attn.k_proj.weight", nkv)
        mat(f"{g}.attn_v.weight", f"{p}.self_attn.v_proj.weight")
        mat(f"{g}.attn_output.weight", f"{p}.self_attn.o_proj.weight")
        vec(f"{g}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
        if moe:
            e = f"{p}.block_sparse_moe"
            vec(f"{g}.ffn_gate_inp.weight", f"{e}.gate.weight")
            for gg, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                experts(f"{g}.ffn_{gg}_exps.weight", [f"{e}.experts.{j}.{hf}.weight" for j in range(n_exp)])
            print(f"hf_to_gguf: layer {l + 1}/{L} quantized ({time.perf_counter() - t0:.0f} s)", flush=True)
            continue
        mat(f"{g}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight")
        mat(f"{g}.ffn_up.weight", f"{p}.mlp.up_proj.weight")
        mat(f"{g}.ffn_down.weight", f"{p}.mlp.down_proj.weight")
        if cfg.get("mlp_bias"):
            for part in ("gate", "up", "down"):
                vec(f"{g}.ffn_{part}.bias", f"{p}.mlp.{part}_proj.bias")
        print(f"hf_to_gguf: layer {l + 1}/{L} quantized ({time.perf_counter() - t0:.0f} s)", flush=True)
    vec("output_norm.weight", "model.norm.weight")
    mat("output.weight", "lm_head.weight" if "lm_head.weight" in idx else "model.embed_tokens.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, a.out)
    print(f"hf_to_gguf: wrote {a.out} ({a.out.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
