#!/usr/bin/env python3
"""Makes the tiny GGUF fixtures of tests/data/gguf/ with llama.cpp's own
converter, not nflash's code, so the tests of `prep convert --model X.gguf`
do not share nflash's assumptions about the format.

Usage (once, on a development machine; the outputs are committed):

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers sentencepiece
    make build && bash scripts/bench_setup.sh   # nflash-tiny; the vendored llama.cpp and llama-quantize
    /tmp/tv/bin/python scripts/make_gguf_fixtures.py [--only NAME...]

For each twin of `TinySpec::GGUF_TWINS` (tests/src/lib.rs): `nflash-tiny
gguf-NAME` writes the tiny Hugging Face checkpoint (random f32 weights,
deterministic); its tokenizer is replaced by a SentencePiece BPE model of
400 pieces (byte fallback, digits split, as Llama 2 and Gemma train theirs)
trained here on tests/data/tokenizer/texts.json, so that the converter
writes a `llama` (SentencePiece) vocabulary; the vendored
`convert_hf_to_gguf.py --outtype f32` writes tiny-NAME-f32.gguf. The llama
twin is also converted to Q8_0 by `llama-quantize --pure` (tiny-llama-q8_0.gguf).
`spm-ids.json` holds llama-tokenize's ids of the texts for the tiny vocabulary.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests/data/gguf")
LLAMA = os.path.join(ROOT, "bench-out/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp")
BIN = os.path.join(ROOT, "bench-out/llama-native/build/bin")
TINY = os.path.join(ROOT, "target/release/nflash-tiny")
TWINS = ["llama", "llama31", "mixtral", "qwen2", "qwen3", "qwen3moe", "smollm3", "phi3", "gemma3"]


def train_spm(work):
    import sentencepiece as spm
    with open(os.path.join(ROOT, "tests/data/tokenizer/texts.json"), encoding="utf-8") as f:
        texts = json.load(f)
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(t.replace("\n", " ") + "\n")
    prefix = os.path.join(work, "spm")
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=400, model_type="bpe", byte_fallback=True,
        split_digits=True, character_coverage=0.98, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    return prefix + ".model"


# convert_hf_to_gguf.py --outtype f32, run in-process so that one thing can
# change: Qwen2/3-MoE converters read only a byte-level BPE tokenizer, whose
# pre-tokenizer they recognize by hashing its output (a tiny one is unknown
# to them), so for the qwen3moe twin the vocabulary is written by the
# SentencePiece path the dense Qwen converters try first. The weights and
# the metadata are converted by llama.cpp's code, unchanged.
CONVERT = """
import os, runpy, sys
llama, ck, out, name = sys.argv[1:]
sys.path.insert(0, os.path.join(llama, "gguf-py"))
sys.path.insert(0, llama)
if name == "qwen3moe":
    from conversion.qwen import Qwen2MoeModel
    Qwen2MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv = ["convert_hf_to_gguf.py", ck, "--outtype", "f32", "--outfile", out]
runpy.run_path(os.path.join(llama, "convert_hf_to_gguf.py"), run_name="__main__")
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def main():
    # `--only NAME...` remakes those twins alone (the others, the Q8_0 file
    # and the ids stay as committed).
    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else None
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        model = train_spm(work)
        for name in only or TWINS:
            ck = os.path.join(work, name)
            run([TINY, f"gguf-{name}", ck])
            shutil.copy(model, os.path.join(ck, "tokenizer.model"))
            os.remove(os.path.join(ck, "tokenizer.json"))
            with open(os.path.join(ck, "tokenizer_config.json"), "w") as f:
                json.dump({"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                           "unk_token": "<unk>", "model_max_length": 256, "tokenizer_class": "LlamaTokenizer"}, f)
            out = os.path.join(OUT, f"tiny-{name}-f32.gguf")
            run([sys.executable, "-c", CONVERT, LLAMA, ck, out, name])
            print(f"{name}: {os.path.getsize(out)} bytes")
        if only:
            return
        env = dict(os.environ, LD_LIBRARY_PATH=BIN)
        q8 = os.path.join(OUT, "tiny-llama-q8_0.gguf")
        run([os.path.join(BIN, "llama-quantize"), "--pure", os.path.join(OUT, "tiny-llama-f32.gguf"), q8, "Q8_0"], env=env)
        print(f"llama q8_0: {os.path.getsize(q8)} bytes")
    # llama.cpp's ids of the tokenizer texts for the tiny SentencePiece vocabulary.
    run([sys.executable, os.path.join(ROOT, "scripts/tokenize_fixture.py"), os.path.join(BIN, "llama-tokenize"),
         os.path.join(OUT, "tiny-llama-f32.gguf"), os.path.join(OUT, "spm-ids.json")])


if __name__ == "__main__":
    main()
