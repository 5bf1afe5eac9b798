#!/usr/bin/env python3
"""Token ids from llama.cpp's own tokenizer, for the GGUF tokenizer test.

Usage: python3 scripts/tokenize_fixture.py LLAMA_TOKENIZE MODEL.gguf OUT.json

Tokenizes each text of tests/data/tokenizer/texts.json with `llama-tokenize`
(built by scripts/bench_setup.sh from the vendored llama.cpp: bench-out/
llama-native/build/bin/llama-tokenize): `--ids --no-bos --no-escape
--no-parse-special` (control-token text stays text, as nflash reads a raw
prompt; user-defined tokens still match whole), one process per text, read
from a file so that the bytes are kept exactly. Writes {"model", "command", "ids"}; the test
(tests/tests/gguf.rs) tokenizes the same texts with the tokenizer prep builds
from the same GGUF and compares.

texts.json, if absent, is made once: hand-written lines (code, Unicode,
numbers, whitespace runs) and lines 1..N of WikiText-2's validation split.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = os.path.join(ROOT, "tests/data/tokenizer/texts.json")

HAND = [
    "Hello world", " Hello world", "Hello  world", "  leading spaces", "trailing spaces   ",
    "tabs\tand\t\ttabs", "new\nline", "two\n\nnewlines", "\n", " ", "   ", "\t", "\r\n", "a\r\nb",
    "1234567890", "3.14159", "1,000,000", "$12.50", "100%", "2026-12-06", "0x1F 0b1010 1e-5",
    "I'm you're they've he'll we'd it's", "DON'T SHOUT", "CamelCaseIdentifier", "snake_case_name",
    "def f(x):\n    return x * 2\n", "fn main() {\n    println!(\"{}\", 42);\n}\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "if x == 1 && y != 2 || !z:",
    "<html><body class=\"x\">hi</body></html>", "SELECT * FROM t WHERE id = 7;",
    "    indented by four", "        indented by eight", "a  b   c    d     e",
    "café naïve résumé", "Ünïcödé", "straße", "日本語のテキスト", "中文文本测试", "한국어 텍스트",
    "Привет, мир!", "مرحبا بالعالم", "नमस्ते दुनिया", "Γειά σου Κόσμε", "emoji 😀🎉👍🏽",
    "mixed 日本 and English 123", "“quotes” ‘single’ «guillemets»", "em—dash en–dash …ellipsis",
    "math: ∑ x² ≤ ∞, √2 ≈ 1.414", "arrows → ← ↑ ↓", "zero\u200bwidth", "non\u00a0breaking",
    "!!!???...", "@user #hashtag", "https://example.com/path?q=1&r=2", "user@example.com",
    "a", "I", "the", "The", " the", "THE", "ab" * 40, "x" * 100, "1" * 50, " " * 20 + "x",
]


def make_texts():
    lines = list(HAND)
    src = os.path.join(ROOT, "../shared/data/wikitext2-valid.txt")
    with open(src, encoding="utf-8") as f:
        wiki = [l.rstrip("\n") for l in f if l.strip()]
    lines += wiki[:240]
    with open(TEXTS, "w", encoding="utf-8") as f:
        json.dump(lines, f, ensure_ascii=False, indent=0)
        f.write("\n")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    tool, model, out = sys.argv[1:]
    if not os.path.exists(TEXTS):
        make_texts()
    with open(TEXTS, encoding="utf-8") as f:
        texts = json.load(f)
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(tool)))
    ids = []
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "text")
        for t in texts:
            with open(p, "w", encoding="utf-8", newline="") as f:
                f.write(t)
            r = subprocess.run([tool, "-m", model, "-f", p, "--ids", "--no-bos", "--no-escape", "--no-parse-special",
                                "--log-disable"],
                               capture_output=True, text=True, env=env, check=True)
            ids.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cmd = f"python3 scripts/tokenize_fixture.py bench-out/llama-native/build/bin/llama-tokenize {os.path.basename(model)} {os.path.relpath(out, ROOT)}"
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"model": os.path.basename(model), "command": cmd, "ids": ids}, f)
        f.write("\n")
    print(f"{len(texts)} texts, {sum(map(len, ids))} tokens -> {out}")


if __name__ == "__main__":
    main()
