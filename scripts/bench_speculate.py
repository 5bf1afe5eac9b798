#!/usr/bin/env python3
"""Speculative-decoding benchmark (issue 47): nflash's drafts against plain
decoding, in memory and under bench-offload's memory limits, and llama.cpp's
own prompt-lookup decoding beside nflash's.

Run as root with the bench venv's python (`make bench-speculate` does both,
and builds llama.cpp's lookup example with BENCH_LOOKUP=1):

    BENCH_LOOKUP=1 scripts/bench_setup.sh
    .venv-bench/bin/python scripts/bench_speculate.py

Model: SmolLM2-135M-Instruct, the sparse q4_0 pack bench-offload measures
(bench-out/smollm2-q4_0-sparse.nflash) and its GGUF (bench-out/smollm2-q4_0.gguf);
run `make bench-offload` first, which makes both and the limits. Optionally
(--scale-pack, default bench-scale's sparsity-0.9 pack when it exists) the
synthetic llama-7b ReLU q4_0 at bench-scale's (b) limit (fixed + 50% of the FFN,
read from the newest bench-scale results.json), --scale-runs times.

Limits: bench-offload's a/b/c (the newest bench/runs/*offload*/results.json,
or --offload-results), which it measured at ctx 256, each raised by the KV
cache's growth from ctx 256 to --ctx (f16 keys and values of every layer),
so the same share of the FFN is out of memory here; "none" runs without a
limit. Each run: `nflash run --raw --temperature 0 --max-tokens --tokens
--memory-budget L` in a fresh cgroup v1 group limited to L, page cache
dropped first (nflash_bench.cgroup.run_in_cgroup); drafts alternate run by
run (off, auto, lookup, self, pack: the draft pack --draft-pack held inside the
same limit, auto-pack: auto with that draft pack), --runs rounds; medians.

Prompts (raw text; the chat ones in SmolLM2's own chat format, written out,
so both engines read the very same text):
  summary  a document and "Summarize the text above." as a chat turn: the
           WikiText-2 article at the start of --wikitext when that file
           exists, else the benchmarks' fixed prompt text (nflash_bench.prompt);
  wiki     WikiText-2 text to continue (skipped without --wikitext);
  chat     two short chat questions (their acceptance is averaged).

Figures: decode tok/s (nflash's count: tokens sampled by decode's passes
over decode's wall time, drafting included) and the ratio to plain
decoding at the same limit and prompt; acceptance (accepted / drafted) and
tokens per pass; MB and neuron clusters read from flash per token and per
pass; for verify passes, the union of their tokens' neuron clusters against
the sum of each token's (dense layers); whether each run printed plain
decoding's text (greedy: it must). llama.cpp: llama-completion (plain) and
llama-lookup (its prompt-lookup decoding, --spec-draft-n-max = --draft-tokens)
on the summary prompt at the same limits, greedy, EOS ignored; decode tok/s
from their own timing lines. nflash stops at EOS, as users run it.

Targets (issue 47): at (c), the best draft >= 1.5x plain; the 7B at (b)
>= 1.5x; in memory, auto >= plain within noise (0.97x); the summary prompt
in memory, lookup >= 1.5x. Results: --out-dir/results.json (raw runs
included) and a table on stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench.cgroup import need_root, remove_stale_groups, run_in_cgroup  # noqa: E402
from nflash_bench.common import REPO, die, fmt, log, median, run_info  # noqa: E402
from nflash_bench.llama import LLAMA_NATIVE_BIN, native_llama_cmd, parse_native_llama  # noqa: E402
from nflash_bench.prompt import PROMPT_TEXT  # noqa: E402

DRAFTS = ["off", "auto", "lookup", "self", "pack", "auto-pack"]
LLAMA_LOOKUP_BIN = REPO / "bench-out/llama-lookup/build/bin/llama-lookup"
CHAT_QUESTIONS = [
    "What are three good habits for staying healthy? Explain each in a sentence or two.",
    "Explain how a bicycle works to a ten-year-old.",
]


def chat(user: str) -> str:
    """One user turn in SmolLM2's chat format, the assistant's turn opened."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def wikitext_article(path: Path, max_bytes: int) -> str | None:
    """The first article of a WikiText-2 file, cut to max_bytes at a line end."""
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8")
    cut = text[:max_bytes]
    return cut[: cut.rfind("\n") + 1] or cut


def make_prompts(a, out: Path) -> dict[str, Path]:
    """The prompt files, by name (chat prompts: chat-0, chat-1)."""
    wiki = wikitext_article(Path(a.wikitext), a.doc_bytes)
    if wiki is None:
        log(f"note: {a.wikitext} not found: the summary prompt uses the fixed prompt text, "
            "and the wiki prompt is skipped")
    doc = wiki if wiki is not None else PROMPT_TEXT
    texts = {"summary": chat(doc.strip() + "\n\nSummarize the text above.")}
    if wiki is not None:
        texts["wiki"] = wiki
    for i, q in enumerate(CHAT_QUESTIONS):
        texts[f"chat-{i}"] = chat(q)
    files = {}
    for name, t in texts.items():
        p = out / f"prompt-{name}.txt"
        p.write_text(t, encoding="utf-8")
        files[name] = p
    return files


def newest(pattern: str) -> Path | None:
    found = sorted(glob.glob(str(REPO / pattern)))
    return Path(found[-1]) if found else None


def kv_bytes_per_token(hf_config: Path) -> int:
    """f16 keys and values of every layer for one position, bytes."""
    c = json.loads(hf_config.read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * 2


def smollm_limits(a) -> dict[str, int | None]:
    src = Path(a.offload_results) if a.offload_results else newest("bench/runs/*offload*/results.json")
    if src is None or not src.exists():
        die("no bench-offload results (bench/runs/*offload*/results.json): run `make bench-offload` "
            "first, or give --offload-results")
    r = json.loads(src.read_text())
    ctx0 = r["args"]["ctx"]
    grow = kv_bytes_per_token(Path(a.hf_model) / "config.json") * max(0, a.ctx - ctx0)
    log(f"limits from {src.relative_to(REPO)} (ctx {ctx0}), each + {grow / 2**20:.1f} MiB of KV cache "
        f"for ctx {a.ctx}")
    lim: dict[str, int | None] = {}
    for name in a.limits:
        if name == "none":
            lim[name] = None
        elif name in r["limits"]:
            lim[name] = r["limits"][name]["bytes"] + grow
        else:
            die(f"limit {name!r} is not in {src}")
    return lim


def scale_limit(a) -> tuple[Path, int] | None:
    pack = Path(a.scale_pack)
    if not pack.exists():
        log(f"note: {pack} not found: no 7B rows (make it with `.venv-bench/bin/python "
            "scripts/bench_scale.py --sparsities 0.9 --prepare-only`)")
        return None
    src = newest("bench/runs/*bench-scale*/results.json")
    if src is None:
        log("note: no bench-scale results with limits: no 7B rows")
        return None
    s = json.loads(src.read_text())["summary"]["0.9"]["b"]["nflash"]["cgroup_limit_bytes"]
    return pack, int(s)


def nflash_run(a, pack: Path, prompt: Path, draft: str, limit: int | None, ctx: int, tmp: Path) -> dict:
    j = tmp / "stats.json"
    j.unlink(missing_ok=True)
    cmd = [str(a.nflash), "run", "--model", str(pack), "--raw", "--prompt-file", str(prompt),
           "--max-tokens", str(a.tokens), "--temperature", "0", "--ctx", str(ctx), "--threads", str(a.threads),
           "--speculate-draft", draft.removesuffix("-pack"), "--draft-tokens", str(a.draft_tokens),
           "--stats-json", str(j)]
    if draft in ("pack", "auto-pack"):
        cmd += ["--draft", str(a.draft_pack)]
    if limit is not None:
        cmd += ["--memory-budget", f"{limit}B"]
    r = run_in_cgroup(cmd, limit, a.timeout)
    ok = r["exit"] == 0 and j.exists() and not r.get("cgroup_oom_kills")
    out = {"cmd": cmd, "outcome": "ok" if ok else ("oom-killed" if r.get("cgroup_oom_kills") else "error"),
           "exit": r["exit"], "cgroup_peak_bytes": r.get("cgroup_peak_bytes"), "text": r["stdout"]}
    if ok:
        out["stats"] = json.loads(j.read_text())
    else:
        out["stderr_tail"] = r["stderr"][-2000:]
    return out


_LOOKUP_RE = {
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "n_drafted": re.compile(r"n_drafted\s+=\s+(\d+)"),
    "n_accept": re.compile(r"n_accept\s+=\s+(\d+)"),
}


def llama_run(a, prompt: Path, lookup: bool, limit: int | None) -> dict:
    """llama-completion, or llama-lookup with the same settings, in a group limited to `limit`."""
    if lookup:
        cmd = [str(LLAMA_LOOKUP_BIN), "-m", str(a.gguf), "-f", str(prompt), "-n", str(a.tokens),
               "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.ctx), "--temp", "0",
               "--spec-draft-n-max", str(a.draft_tokens), "--ignore-eos", "--no-repack", "--load-mode", "mmap"]
    else:
        cmd = native_llama_cmd(a.llama_native, a.gguf, prompt, a.tokens, a.threads, a.ctx)
    r = run_in_cgroup(cmd, limit, a.timeout)
    out = {"cmd": cmd, "exit": r["exit"], "outcome": "ok" if r["exit"] == 0 else "error"}
    if r["exit"] != 0:
        out["stderr_tail"] = r["stderr"][-2000:]
        return out
    if lookup:
        err = r["stderr"] + r["stdout"]
        m = _LOOKUP_RE["decoded"].findall(err)
        if not m:
            out["outcome"] = "error"
            out["stderr_tail"] = err[-2000:]
            return out
        n, s = int(m[-1][0]), float(m[-1][1])
        drafted = int(_LOOKUP_RE["n_drafted"].findall(err)[-1])
        accepted = int(_LOOKUP_RE["n_accept"].findall(err)[-1])
        out.update(decode_tokens_per_s=n / s if s > 0 else 0.0, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else 0.0)
    else:
        p = parse_native_llama(r["stderr"])
        if p is None:
            out["outcome"] = "error"
            return out
        out.update(decode_tokens_per_s=p["decode_tokens_per_s"])
    return out


def summarize(runs: list[dict], plain_text: str | None) -> dict:
    ok = [r for r in runs if r["outcome"] == "ok"]
    s = {"runs": len(runs), "ok": len(ok)}
    if not ok:
        return s
    st = [r["stats"] for r in ok]
    s["decode_tokens_per_s"] = median([x["decode_tokens_per_s"] for x in st])
    drafted = sum(x["draft_tokens"] for x in st)
    s["acceptance_rate"] = sum(x["accepted_tokens"] for x in st) / drafted if drafted else None
    s["draft_tokens"] = drafted / len(st)
    s["tokens_per_pass"] = median([x["decode_tokens"] / max(1, x["decode_passes"]) for x in st])
    s["mb_read_per_token"] = median([x["bytes_read_per_token"] / 1e6 for x in st])
    # Clusters read from flash per pass (one token's without speculation).
    s["clusters_read_per_pass"] = median([x["clusters_read_per_token"] * x["decode_tokens"]
                                          / max(1, x["decode_passes"]) for x in st])
    # Verify passes: the union of their tokens' clusters against the sum (dense layers).
    s["verify_cluster_union_per_pass"] = median([x.get("verify_cluster_union_per_pass") for x in st])
    s["verify_clusters_needed_per_pass"] = median([x.get("verify_clusters_needed_per_pass") for x in st])
    s["draft_seconds"] = median([x["draft_seconds"] for x in st])
    s["verify_seconds"] = median([x["verify_seconds"] for x in st])
    s["decode_seconds"] = median([x["decode_seconds"] for x in st])
    if plain_text is not None:
        s["same_text_as_plain"] = all(r["text"] == plain_text for r in ok)
    return s


def bench_model(a, label: str, pack: Path, prompts: dict[str, Path], limits: dict[str, int | None],
                runs: int, ctx: int, tmp: Path) -> dict:
    raw: dict = {}
    for i in range(runs):
        for lname, limit in limits.items():
            for pname, prompt in prompts.items():
                for d in a.drafts:
                    r = nflash_run(a, pack, prompt, d, limit, ctx, tmp)
                    raw.setdefault(lname, {}).setdefault(pname, {}).setdefault(d, []).append(r)
                    st = r.get("stats", {})
                    log(f"{label} {lname:5} {pname:8} {d:6} run {i + 1}: {r['outcome']} "
                        f"{fmt(st.get('decode_tokens_per_s'))} tok/s, acceptance {fmt(st.get('acceptance_rate'), 3)}")
    summary: dict = {}
    for lname, by_prompt in raw.items():
        for pname, by_draft in by_prompt.items():
            plain = [r for r in by_draft.get("off", []) if r["outcome"] == "ok"]
            plain_text = plain[0]["text"] if plain else None
            row = {d: summarize(rs, plain_text) for d, rs in by_draft.items()}
            base = row.get("off", {}).get("decode_tokens_per_s")
            for d, s in row.items():
                if base and s.get("decode_tokens_per_s"):
                    s["x_over_off"] = s["decode_tokens_per_s"] / base
            summary.setdefault(lname, {})[pname] = row
    return {"label": label, "pack": str(pack), "limits": limits, "ctx": ctx, "summary": summary, "runs": raw}


def bench_llama(a, prompt: Path, limits: dict[str, int | None]) -> dict:
    raw: dict = {}
    for i in range(a.runs):
        for lname, limit in limits.items():
            for eng, lookup in (("llama-completion", False), ("llama-lookup", True)):
                r = llama_run(a, prompt, lookup, limit)
                raw.setdefault(lname, {}).setdefault(eng, []).append(r)
                log(f"llama.cpp {lname:5} {eng:16} run {i + 1}: {r['outcome']} "
                    f"{fmt(r.get('decode_tokens_per_s'))} tok/s, acceptance {fmt(r.get('acceptance_rate'), 3)}")
    summary: dict = {}
    for lname, by_eng in raw.items():
        row = {}
        for eng, rs in by_eng.items():
            ok = [r for r in rs if r["outcome"] == "ok"]
            row[eng] = {"runs": len(rs), "ok": len(ok),
                        "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in ok]) if ok else None}
            if eng == "llama-lookup" and ok:
                d = sum(r["draft_tokens"] for r in ok)
                row[eng]["acceptance_rate"] = sum(r["accepted_tokens"] for r in ok) / d if d else None
        p, l_ = row["llama-completion"]["decode_tokens_per_s"], row["llama-lookup"]["decode_tokens_per_s"]
        row["lookup_x_over_plain"] = l_ / p if p and l_ else None
        summary[lname] = row
    return {"summary": summary, "runs": raw}


def chat_mean(row_by_prompt: dict, draft: str, key: str):
    vals = [row_by_prompt[p][draft].get(key) for p in row_by_prompt if p.startswith("chat-")]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def print_tables(res: dict) -> None:
    for m in res["models"]:
        print(f"\n## {m['label']}: decode tok/s (median of runs), x plain, acceptance, tokens/pass, MB read/token")
        print("| limit | prompt | draft | tok/s | x off | acceptance | tokens/pass | MB read/token | clusters read/pass "
              "| verify union / needed | same text |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for lname, by_prompt in m["summary"].items():
            for pname, row in by_prompt.items():
                for d, s in row.items():
                    print(f"| {lname} | {pname} | {d} | {fmt(s.get('decode_tokens_per_s'))} | "
                          f"{fmt(s.get('x_over_off'), 2)} | {fmt(s.get('acceptance_rate'), 3)} | "
                          f"{fmt(s.get('tokens_per_pass'), 2)} | {fmt(s.get('mb_read_per_token'), 1)} | "
                          f"{fmt(s.get('clusters_read_per_pass'), 0)} | "
                          f"{fmt(s.get('verify_cluster_union_per_pass'), 0)} / "
                          f"{fmt(s.get('verify_clusters_needed_per_pass'), 0)} | {s.get('same_text_as_plain', '-')} |")
    if res.get("llama"):
        print("\n## llama.cpp on the summary prompt: plain vs its prompt lookup")
        print("| limit | llama-completion tok/s | llama-lookup tok/s | x | acceptance |")
        print("|---|---|---|---|---|")
        for lname, row in res["llama"]["summary"].items():
            print(f"| {lname} | {fmt(row['llama-completion']['decode_tokens_per_s'])} | "
                  f"{fmt(row['llama-lookup']['decode_tokens_per_s'])} | {fmt(row['lookup_x_over_plain'], 2)} | "
                  f"{fmt(row['llama-lookup'].get('acceptance_rate'), 3)} |")
    print("\n## Targets")
    for t in res["targets"]:
        print(f"- {t['what']}: {fmt(t.get('value'), 2)} (goal {t['goal']}): "
              f"{'met' if t.get('pass') else 'NOT met' if t.get('pass') is False else 'not measured'}")


def targets(res: dict) -> list[dict]:
    out = []
    smol = res["models"][0]["summary"] if res["models"] else {}

    def best(lname: str, pname: str) -> tuple[float | None, str | None]:
        row = smol.get(lname, {}).get(pname, {})
        xs = [(s.get("x_over_off"), d) for d, s in row.items() if d != "off" and s.get("x_over_off")]
        return max(xs) if xs else (None, None)

    v, d = best("c", "summary")
    out.append({"what": f"SmolLM2 at (c), summary prompt, best draft ({d}) over plain", "value": v, "goal": ">= 1.5",
                "pass": None if v is None else v >= 1.5})
    v = smol.get("none", {}).get("summary", {}).get("lookup", {}).get("x_over_off")
    out.append({"what": "in memory, summary prompt, lookup over plain", "value": v, "goal": ">= 1.5",
                "pass": None if v is None else v >= 1.5})
    autos = [by_p[p]["auto"].get("x_over_off") for by_p in [smol.get("none", {})] for p in by_p
             if "auto" in by_p[p]]
    autos = [x for x in autos if x]
    v = min(autos) if autos else None
    out.append({"what": "in memory, auto over plain, worst prompt", "value": v, "goal": ">= 0.97 (noise)",
                "pass": None if v is None else v >= 0.97})
    if len(res["models"]) > 1:
        row = res["models"][1]["summary"].get("b", {})
        xs = [(s.get("x_over_off"), d) for p in row for d, s in row[p].items() if d != "off" and s.get("x_over_off")]
        v, d = max(xs) if xs else (None, None)
        out.append({"what": f"7B at (b), best draft ({d}) over plain", "value": v, "goal": ">= 1.5",
                    "pass": None if v is None else v >= 1.5})
    return out


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="rounds of SmolLM2 runs (default 3)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    ap.add_argument("--ctx", type=int, default=1024, help="context of every run (default 1024)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=4, help="K for every draft (default 4)")
    ap.add_argument("--drafts", default=",".join(DRAFTS),
                    help=f"drafts to run (default {','.join(DRAFTS)}; pack and auto-pack: with the --draft-pack)")
    ap.add_argument("--draft-pack", default=str(REPO / "models/smollm2-q8_0.nflash"),
                    help="the draft pack of the pack draft (default the demo pack, SmolLM2-135M q8_0: "
                         "the same tokenizer as both models), held inside each limit")
    ap.add_argument("--limits", default="none,b,c", help="limits (none, a, b, c; default none,b,c)")
    ap.add_argument("--prompts", default="summary,wiki,chat", help="prompts (default summary,wiki,chat)")
    ap.add_argument("--wikitext", default=str(REPO.parent / "shared/data/wikitext2-valid.txt"),
                    help="WikiText-2 text for the summary and wiki prompts (skipped when missing)")
    ap.add_argument("--doc-bytes", type=int, default=3000, help="bytes of the article the prompts take")
    ap.add_argument("--pack", default=str(REPO / "bench-out/smollm2-q4_0-sparse.nflash"))
    ap.add_argument("--gguf", default=str(REPO / "bench-out/smollm2-q4_0.gguf"))
    ap.add_argument("--hf-model", default=str(REPO / "models/SmolLM2-135M-Instruct"))
    ap.add_argument("--offload-results", default=None, help="bench-offload results.json (default: the newest)")
    ap.add_argument("--scale-pack", default=str(REPO / "bench-out/scale/llama-7b-s0.9-q4_0.nflash"))
    ap.add_argument("--scale-runs", type=int, default=1, help="rounds of 7B runs (default 1; 0 skips them)")
    ap.add_argument("--scale-prompt", default=str(REPO / "bench-out/prompt-128.txt"))
    ap.add_argument("--skip-llama", action="store_true", help="no llama.cpp rows")
    ap.add_argument("--nflash", default=str(REPO / "target/release/nflash"))
    ap.add_argument("--llama-native", default=str(LLAMA_NATIVE_BIN))
    ap.add_argument("--out-dir", default=str(REPO / "bench-out/speculate"))
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    a.drafts = [d for d in a.drafts.split(",") if d]
    if "off" not in a.drafts:
        a.drafts.insert(0, "off")
    if not Path(a.draft_pack).exists():
        log(f"note: {a.draft_pack} not found (make {a.draft_pack}): no pack draft rows")
        a.drafts = [d for d in a.drafts if d not in ("pack", "auto-pack")]
    a.limits = [x for x in a.limits.split(",") if x]
    a.llama_native = Path(a.llama_native)
    need_root("bench-speculate")
    remove_stale_groups()
    for p in (a.pack, a.nflash):
        if not Path(p).exists():
            die(f"{p} not found: run `make build` and `make bench-offload` first")
    out = Path(a.out_dir)
    tmp = out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    files = make_prompts(a, out)
    wanted = [x for x in a.prompts.split(",") if x]
    prompts = {n: p for n, p in files.items() if n in wanted or (n.startswith("chat-") and "chat" in wanted)}
    limits = smollm_limits(a)
    res: dict = run_info(a) | {"prompts": {n: p.read_text() for n, p in prompts.items()}}
    res["models"] = [bench_model(a, "SmolLM2-135M q4_0 (sparse)", Path(a.pack), prompts, limits, a.runs, a.ctx, tmp)]
    sc = scale_limit(a) if a.scale_runs > 0 else None
    if sc is not None:
        pack, lim = sc
        sp = {"synthetic": Path(a.scale_prompt)}
        res["models"].append(bench_model(a, "synthetic llama-7b ReLU q4_0 s0.9", pack, sp, {"b": lim},
                                         a.scale_runs, 512, tmp))
    if not a.skip_llama and "summary" in prompts:
        if not (LLAMA_LOOKUP_BIN.exists() and a.llama_native.exists()):
            log(f"note: {LLAMA_LOOKUP_BIN} or {a.llama_native} missing (BENCH_LOOKUP=1 scripts/bench_setup.sh): "
                "no llama.cpp rows")
        elif not Path(a.gguf).exists():
            log(f"note: {a.gguf} missing: no llama.cpp rows")
        else:
            a.gguf = Path(a.gguf)
            res["llama"] = bench_llama(a, prompts["summary"], limits)
    res["targets"] = targets(res)
    res["wall_s"] = time.monotonic() - t0
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print_tables(res)
    log(f"results: {out / 'results.json'} ({res['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
