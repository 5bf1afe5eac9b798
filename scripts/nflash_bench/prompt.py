"""The one fixed prompt of the benchmarks, cut to a number of tokens."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .common import die, log
from .proc import run_measured
from .worker import worker_cmd

# The one fixed prompt, fed as raw text (no chat template) to both engines.
# --prompt-tokens N keeps the longest whole-word prefix of it that llama.cpp's
# tokenizer makes into at most N tokens (the default, 128, uses most of the
# first paragraph-and-a-half; the text is long enough for N up to ~450).
PROMPT_TEXT = """\
The history of the printing press is often told as the story of a single \
inventor, but the real story is longer and more interesting. Long before \
Gutenberg, craftsmen in China and Korea had carved wooden blocks and cast \
metal type, and merchants across Asia traded printed books, calendars and \
paper money. What changed in fifteenth-century Europe was the combination of \
several ideas at once: an alphabet with few letters, a mould that could cast \
thousands of identical pieces of type, an oil-based ink that stuck to metal, \
and a screw press borrowed from the makers of wine and olive oil. Together \
they made printing cheap enough that a small workshop could produce hundreds \
of copies of a book in the time a scribe needed to copy one. Within fifty \
years, presses were running in more than two hundred cities, and the number \
of books in Europe grew from thousands to millions. Scholars could compare \
identical copies of the same text, which made it easier to find and correct \
mistakes, and ideas travelled faster than ever before. Religious reformers, \
scientists and poets all learned to use the new machines, and governments \
soon learned to fear them. Printers became publishers, booksellers and \
sometimes censors, and the rules they invented for spelling, punctuation and \
page layout still shape the way we read today. The modern newspaper, the \
scientific journal and the paperback novel are all children of that first \
workshop, and so, in a sense, is the screen on which you may be reading \
these words. Historians still argue about how much credit each inventor \
deserves, and about whether the press caused the great changes that followed \
or simply made them possible. What nobody doubts is that the world after the \
press was very different from the world before it, and that the change \
happened with remarkable speed once the pieces were in place.
"""


def choose_prompt(n_tokens: int, gguf: Path | None, timeout: float) -> tuple[str, int | None]:
    """The longest whole-word prefix of PROMPT_TEXT (repeated as often as a
    long prompt needs) with at most n_tokens tokens (by llama.cpp's tokenizer
    when a GGUF is at hand, else ~1.3 tokens/word)."""
    base = PROMPT_TEXT.split()
    words = base * (int(n_tokens / 1.2 / len(base)) + 1)
    if gguf is None:
        k = max(1, min(len(words), int(n_tokens / 1.3)))
        return " ".join(words[:k]) + "\n", None
    cands = [" ".join(words[:k]) + "\n" for k in range(1, len(words) + 1)]
    counts = _token_counts(gguf, cands, timeout)
    best = 0
    for i, c in enumerate(counts):
        if c <= n_tokens:
            best = i
    if counts[-1] < n_tokens:
        log(f"warning: the whole prompt text is only {counts[-1]} tokens (< {n_tokens})")
    return cands[best], counts[best]


def _token_counts(gguf: Path, texts: list[str], timeout: float) -> list[int]:
    """The token count of each text by the GGUF's tokenizer (the _tokenize worker)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tf:
        json.dump(texts, tf)
    try:
        code, _, so, se, _ = run_measured(worker_cmd("_tokenize", gguf, tf.name), timeout)
    finally:
        os.unlink(tf.name)
    if code != 0:
        die(f"tokenizing the prompt failed:\n{se[-3000:]}")
    return json.loads(so.strip().splitlines()[-1])


def write_prompt(text: str, out: Path, name: str = "prompt.txt") -> Path:
    """OUT/name (default prompt.txt), the file both engines read the prompt from."""
    prompt_file = out / name
    prompt_file.write_text(text, encoding="utf-8")
    return prompt_file
