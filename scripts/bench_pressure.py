#!/usr/bin/env python3
"""Memory-pressure benchmark (issue 46): nflash and llama.cpp (mmap) decode
in a memory cgroup while a balloon process in the same group grows, holds
and leaves.

Run as root with the bench venv's python (`make bench-pressure` does both):

    scripts/bench_setup.sh
    .venv-bench/bin/python scripts/bench_pressure.py --gguf-src models/.download/SmolLM2-135M-Instruct.Q4_1.gguf

Models (--models, default q4_0,q8_0,7b): SmolLM2-135M-Instruct q4_0 and
q8_0, the dense packs (bench-out/smollm2-{q}.nflash, `prep convert`) and
the pure GGUFs llama.cpp reads (bench-out/smollm2-{q}.gguf, requantized
from the Q4_1 GGUF), from nflash_bench.models as in `make bench`; and 7b,
the synthetic llama-7b ReLU q4_0 pack at sparsity 0.9 and its GGUF that
`make bench-scale SPARSITIES=0.9` leaves in --scale-dir (skipped with a
note when they are missing: making them takes about an hour).

Setting, per model (the issue's, for q8_0): a cgroup v1 group limited to L
= --budget-mib + 40 MiB; nflash runs with `--memory-budget` --budget-mib
(default 200) and --ctx 2048; the 7B the same at its own scale
(--scale-budget-mib 4700 + 256 MiB, a --scale-balloon-mib 2048 balloon in
--scale-step-mib 10 MiB steps, held --scale-hold-s 8, --scale-tokens 400,
ctx 1024 (the 356-token prompt and 400 tokens): the
squeeze leaves room for about half of its FFN, bench-scale's (b)); llama.cpp is llama-completion (the native
build of scripts/bench_setup.sh) with the weights mmapped and not repacked
(nflash_bench.llama.native_llama_cmd), -c 2048. Both decode --tokens (1500)
tokens of the fixed prompt, greedy, EOS ignored, 2 threads. Once the
engine's first text appears and --before-s (2) more have passed, the
balloon (tests' nflash-balloon) takes --balloon-mib (100) in 10 MiB steps
every 100 ms, holds --hold-s (4), and leaves. Page cache dropped before
each run; engines alternate run by run (--runs 3); medians over the runs.

Figures: outcome (ok, or OOM-killed: the group's oom_kill count, exit
status), tokens/s before (from first text to the balloon's start), during
(from the balloon full to its leaving) and after (1 s after it left to the
end): nflash's from the time of each token (--stats-json `token_times_s`),
llama.cpp's from the times of its output bytes (bytes / the run's bytes
per generated token: text of a steady byte length per token, which the
synthetic 7B's is only roughly), and over the whole decode (the engine's own count:
nflash's --stats-json, llama.cpp's eval timing); nflash's reaction time: from the first poll (every
50 ms) at which the group's room (limit less usage) fell below the 32 MiB
reserve to the first poll at which nflash's RSS was 4 MiB below its size
then; nflash's --stats-json budget figures. One plot per model (the first
run): memory of each process and the group, and tokens/s, over time, the
balloon marked.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import common  # noqa: E402
from nflash_bench.cgroup import drop_caches, need_root, new_group, oom_kills, remove_group, remove_stale_groups  # noqa: E402
from nflash_bench.common import MIB, REPO, die, fmt, log, median, run_info  # noqa: E402
from nflash_bench.llama import llama_env, native_llama_cmd, parse_native_llama  # noqa: E402
from nflash_bench.models import prepare_llama, prepare_nflash  # noqa: E402
from nflash_bench.prompt import PROMPT_TEXT  # noqa: E402

common.PROG = "bench-pressure"
POLL_S = 0.05
RESERVE = 32 * MIB
# bench-scale's pack at sparsity 0.9 (nflash_bench.scale.prepare).
SCALE_TAG = "llama-7b-s0.9"


def rss_of(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def in_group(d: Path, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(d / "cgroup.procs"), *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def run_once(a, m: dict, engine: str, cmd: list[str], env: dict | None) -> dict:
    """One run of `cmd` in a group limited to m["limit"] with m's balloon."""
    limit = m["limit"]
    d = new_group(limit)
    try:
        drop_caches()
        t0, t0_unix = time.perf_counter(), time.time()
        p = in_group(d, cmd, env)
        out: list[tuple[float, int]] = []  # (time, bytes)
        err: list[bytes] = []

        def read_out():
            while chunk := os.read(p.stdout.fileno(), 65536):
                out.append((time.perf_counter() - t0, len(chunk)))

        threads = [threading.Thread(target=read_out, daemon=True),
                   threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)]
        for t in threads:
            t.start()
        series: list[tuple[float, int, int | None, int | None]] = []  # t, group usage, engine rss, balloon rss
        balloon: dict = {}
        state = {"balloon": None}

        def poll():
            while p.poll() is None:
                b = state["balloon"]
                u = int((d / "memory.usage_in_bytes").read_text())
                series.append((time.perf_counter() - t0, u, rss_of(p.pid), rss_of(b.pid) if b else None))
                time.sleep(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        # The balloon: --before-s (the 7B: --scale-before-s) after the
        # first text, or at a fixed time after the start.
        if m.get("balloon_at_s") is not None:
            time.sleep(max(0.0, m["balloon_at_s"] - (time.perf_counter() - t0)))
        else:
            while not out and p.poll() is None and time.perf_counter() - t0 < a.timeout:
                time.sleep(0.01)
            time.sleep(m["before_s"])
        if p.poll() is None:
            steps = m["balloon_mib"] // m["step_mib"]
            b = in_group(d, [str(a.balloon), "--step", str(m["step_mib"]), "--steps", str(steps), "--hold-ms",
                             str(int(m["hold_s"] * 1000))])
            state["balloon"] = b
            balloon["start"] = time.perf_counter() - t0
            for line in b.stdout:
                balloon[line.decode().strip()] = time.perf_counter() - t0
            balloon["exit"] = b.wait()
        timed_out = False
        try:
            code = p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            code, timed_out = p.wait(), True
        end = time.perf_counter() - t0
        for t in threads:
            t.join(timeout=5)
        poller.join(timeout=5)
        kills = oom_kills(d) or 0
    finally:
        remove_group(d)
    return {"engine": engine, "exit": code, "timed_out": timed_out, "oom_kills": kills, "end_s": end, "out": out,
            "t0_unix": t0_unix,
            "series": series,
            "balloon": balloon, "stderr": b"".join(err).decode(errors="replace")[-4000:]}


def token_events(r: dict, tokens: int, stats: dict | None) -> list[tuple[float, float]]:
    """(seconds after the engine started, tokens) events of a run: each
    token's time from nflash's --stats-json, else the engine's output
    bytes as tokens (generated text only: llama.cpp runs with
    --no-display-prompt)."""
    if stats and stats.get("token_times_s") and stats.get("decode_start_unix_s"):
        start = stats["decode_start_unix_s"] - r["t0_unix"]
        return [(start + t, 1.0) for t in stats["token_times_s"]]
    per_tok = max(sum(n for _, n in r["out"]) / tokens, 1e-9)
    return [(t, n / per_tok) for t, n in r["out"]]


def rates(r: dict, events: list[tuple[float, float]]) -> dict:
    """Tokens/s before, during and after the balloon."""
    b = r["balloon"]
    if not events or "start" not in b:
        return {}

    def rate(t0: float, t1: float) -> float | None:
        if t1 - t0 < 0.3:
            return None
        return sum(n for t, n in events if t0 <= t < t1) / (t1 - t0)

    first = events[0][0]
    full, leave = b.get("full", b["start"]), b.get("leaving", r["end_s"])
    return {"before": rate(first, b["start"]), "during": rate(full, leave),
            "after": rate(leave + 1.0, events[-1][0])}


def reaction(r: dict, limit: int) -> float | None:
    """Seconds from the group's room first falling below the reserve to the engine's RSS 4 MiB lower."""
    s = [x for x in r["series"] if x[2] is not None]
    for i, (t, u, rss, _) in enumerate(s):
        if limit - u < RESERVE:
            for t2, _, rss2, _ in s[i:]:
                if rss2 is not None and rss2 < rss - 4 * MIB:
                    return t2 - t
            return None
    return None


def plot(runs: dict, limit: int, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), sharex="col", squeeze=False)
    for col, (engine, r) in enumerate(runs.items()):
        s = r["series"]
        t = [x[0] for x in s]
        ax = axes[0][col]
        ax.plot(t, [x[1] / MIB for x in s], label="cgroup usage")
        ax.plot(t, [(x[2] or 0) / MIB for x in s], label=f"{engine} RSS")
        ax.plot(t, [(x[3] or 0) / MIB for x in s], label="balloon RSS")
        ax.axhline(limit / MIB, color="k", ls="--", lw=0.8, label="limit")
        ax.set_ylabel("MiB")
        state = "timed out" if r.get("timed_out") else "OOM-killed" if r["oom_kills"] or r["exit"] else "ok"
        ax.set_title(f"{title}: {engine} ({state})")
        ax.legend(fontsize=7, loc="lower right")
        ax2 = axes[1][col]
        ev = r.get("events", [])
        win, xs, ys = 0.5, [], []
        if ev:
            x = ev[0][0]
            while x < ev[-1][0]:
                xs.append(x + win / 2)
                ys.append(sum(n for tt, n in ev if x <= tt < x + win) / win)
                x += win / 2
        ax2.plot(xs, ys)
        ax2.set_ylabel("tokens/s")
        ax2.set_xlabel("s")
        for a_ in (ax, ax2):
            b = r["balloon"]
            if "start" in b:
                a_.axvspan(b["start"], b.get("leaving", r["end_s"]), color="orange", alpha=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def model_settings(a) -> dict[str, dict]:
    """Per model in --models: its pack, GGUF and pressure setting (sizes in MiB, limit in bytes)."""
    unknown = [x for x in a.models if x not in ("q4_0", "q8_0", "7b")]
    if unknown:
        die(f"--models: unknown {','.join(unknown)} (choose among q4_0,q8_0,7b)", 2)
    models: dict[str, dict] = {}
    smol = [q for q in a.models if q in ("q4_0", "q8_0")]
    if smol:
        a.quant = smol
        ggufs, packs = prepare_llama(a, a.cache_dir), prepare_nflash(a, a.cache_dir)
        for q in smol:
            models[q] = {"title": f"SmolLM2 {q}", "pack": packs[q], "gguf": ggufs[q], "budget_mib": a.budget_mib,
                         "limit": (a.budget_mib + 40) * MIB, "balloon_mib": a.balloon_mib, "step_mib": 10,
                         "hold_s": a.hold_s, "tokens": a.tokens, "ctx": a.ctx, "before_s": a.before_s}
    if "7b" in a.models:
        pack, gguf = a.scale_dir / f"{SCALE_TAG}-q4_0.nflash", a.scale_dir / f"{SCALE_TAG}-q4_0.gguf"
        if pack.exists() and gguf.exists():
            models["7b"] = {"title": "synthetic llama-7b ReLU q4_0 (s=0.9)", "pack": pack, "gguf": gguf,
                            "budget_mib": a.scale_budget_mib, "limit": (a.scale_budget_mib + 256) * MIB,
                            "balloon_mib": a.scale_balloon_mib, "step_mib": a.scale_step_mib, "hold_s": a.scale_hold_s,
                            "tokens": a.scale_tokens, "ctx": a.scale_ctx, "before_s": a.scale_before_s,
                            "balloon_at_s": a.scale_balloon_at_s}
        else:
            log(f"note: no 7B rows: {pack} or {gguf} is missing (make them with "
                f"`.venv-bench/bin/python scripts/bench_scale.py --sparsities 0.9 --prepare-only`, about an hour)")
    return models


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="q4_0,q8_0,7b", help="comma-separated: q4_0, q8_0 (SmolLM2), 7b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=200)
    ap.add_argument("--balloon-mib", type=int, default=100)
    ap.add_argument("--hold-s", type=float, default=4.0)
    ap.add_argument("--before-s", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--scale-dir", type=Path, default=REPO / "bench-out/scale",
                    help="where bench-scale left the 7B pack and GGUF")
    ap.add_argument("--scale-budget-mib", type=int, default=4700)
    ap.add_argument("--scale-balloon-mib", type=int, default=2048)
    ap.add_argument("--scale-step-mib", type=int, default=10,
                    help="the 7B balloon's step every 100 ms (SmolLM2's is 10 MiB)")
    ap.add_argument("--scale-hold-s", type=float, default=8.0)
    ap.add_argument("--scale-before-s", type=float, default=5.0,
                    help="the 7B's balloon starts this long after the engine's first text")
    ap.add_argument("--scale-balloon-at-s", type=float, default=None,
                    help="start the 7B's balloon this long after the engine starts instead")
    ap.add_argument("--scale-tokens", type=int, default=400)
    ap.add_argument("--scale-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nflash-extra", default="", help="more `nflash run` flags, e.g. \"--io-engine threads\"")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-out/pressure")
    ap.add_argument("--cache-dir", type=Path, default=REPO / "bench-out")
    ap.add_argument("--hf-model", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    ap.add_argument("--gguf-src", type=Path)
    ap.add_argument("--nflash", type=Path, default=REPO / "target/release/nflash")
    ap.add_argument("--prep", type=Path, default=REPO / "target/release/prep")
    ap.add_argument("--balloon", type=Path, default=REPO / "target/release/nflash-balloon")
    ap.add_argument("--llama", type=Path, default=REPO / "bench-out/llama-native/build/bin/llama-completion")
    a = ap.parse_args(argv)
    a.models = [x for x in a.models.split(",") if x]
    need_root("bench-pressure")
    remove_stale_groups()
    for p in (a.nflash, a.balloon, a.llama):
        if not p.exists():
            die(f"{p} not found: run `make build` and scripts/bench_setup.sh", 2)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    models = model_settings(a)
    prompt = a.out_dir / "prompt.txt"
    prompt.write_text(PROMPT_TEXT)
    results = {"settings": {"limit_bytes": (a.budget_mib + 40) * MIB, "budget_bytes": a.budget_mib * MIB,
                            "balloon_bytes": a.balloon_mib * MIB, "hold_s": a.hold_s, "tokens": a.tokens,
                            "ctx": a.ctx, "threads": a.threads, "nflash_extra": a.nflash_extra, "poll_s": POLL_S, "reserve_bytes": RESERVE},
               **run_info(a), "models": {}}
    for q, m in models.items():
        stats_json = a.out_dir / f"nflash-{q}.json"
        cmds = {
            "nflash": ([str(a.nflash), "run", "--model", str(m["pack"]), "--prompt-file", str(prompt), "--raw",
                        "--temperature", "0", "--ignore-eos", "--max-tokens", str(m["tokens"]), "--ctx",
                        str(m["ctx"]), "--threads", str(a.threads), "--memory-budget", f"{m['budget_mib']}MiB",
                        "--stats-json", str(stats_json), *shlex.split(a.nflash_extra)], None),
            # Without the prompt echoed, its output is the generated text alone, as nflash's.
            "llama.cpp": (native_llama_cmd(a.llama, m["gguf"], prompt, m["tokens"], a.threads, m["ctx"])
                          + ["--no-display-prompt"], llama_env("native")),
        }
        per: dict[str, list] = {e: [] for e in cmds}
        first: dict[str, dict] = {}
        for i in range(a.runs):
            for engine in (list(cmds) if i % 2 == 0 else list(reversed(cmds))):
                cmd, env = cmds[engine]
                log(f"{q} {engine} run {i + 1}/{a.runs}")
                stats_json.unlink(missing_ok=True)
                r = run_once(a, m, engine, cmd, env)
                r["tokens"] = m["tokens"]
                ok = r["exit"] == 0 and r["oom_kills"] == 0
                s = json.loads(stats_json.read_text()) if engine == "nflash" and ok else None
                r["events"] = token_events(r, m["tokens"], s)
                row = {"outcome": "ok" if ok else (f"timed out after {a.timeout:.0f} s" if r["timed_out"] else
                                                   "oom-killed" if r["oom_kills"] or r["exit"] in (-9, 137)
                                                   else f"exit {r['exit']}"),
                       "oom_kills": r["oom_kills"], "balloon_exit": r["balloon"].get("exit"),
                       **{f"tokens_per_s_{k}": v for k, v in rates(r, r["events"]).items()},
                       "reaction_s": reaction(r, m["limit"]) if engine == "nflash" else None,
                       "peak_group_bytes": max((x[1] for x in r["series"]), default=None)}
                if s is not None and s.get("generated_tokens", 0) < m["tokens"]:
                    log(f"  note: nflash generated {s.get('generated_tokens')} of {m['tokens']} tokens "
                        f"(a prompt of {s.get('prompt_tokens')} tokens in a context of {m['ctx']})")
                if s is not None:
                    row.update({k: s.get(k) for k in ("decode_tokens_per_s", "budget_min_bytes", "budget_max_bytes",
                                                      "budget_shrinks", "budget_grows", "bytes_returned",
                                                      "reads_after_shrink", "memory_signals")})
                if engine == "llama.cpp" and ok:
                    perf = parse_native_llama(r["stderr"])
                    row["decode_tokens_per_s"] = perf["n_eval"] / (perf["t_eval_ms"] / 1e3) if perf else None
                if not ok:
                    log(f"  {row['outcome']}: {r['stderr'][-300:]}")
                log("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                                     if k in ("outcome", "tokens_per_s_before", "tokens_per_s_during",
                                              "tokens_per_s_after", "reaction_s")))
                per[engine].append(row)
                first.setdefault(engine, r)
        plot(first, m["limit"], a.out_dir / f"pressure-{q}.png", m["title"])
        summary = {}
        for engine, rows in per.items():
            summary[engine] = {
                "oom_killed_runs": sum(r["outcome"] == "oom-killed" for r in rows), "runs": len(rows),
                "failed_runs": sum(r["outcome"] != "ok" for r in rows),
                **{k: median([r.get(k) for r in rows if r["outcome"] == "ok"])
                   for k in ("tokens_per_s_before", "tokens_per_s_during", "tokens_per_s_after", "reaction_s",
                             "decode_tokens_per_s")}}
        setting = {k: (str(v) if isinstance(v, Path) else v) for k, v in m.items()}
        results["models"][q] = {"setting": setting, "runs": per, "summary": summary}
    (a.out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n| model | engine | OOM-killed runs | tok/s before | during | after | whole decode | reaction s |")
    print("|---|---|---|---|---|---|---|---|")
    for q, m in results["models"].items():
        for engine, s in m["summary"].items():
            print(f"| {q} | {engine} | {s['oom_killed_runs']}/{s['runs']} | {fmt(s['tokens_per_s_before'])} | "
                  f"{fmt(s['tokens_per_s_during'])} | {fmt(s['tokens_per_s_after'])} | "
                  f"{fmt(s['decode_tokens_per_s'])} | {fmt(s['reaction_s'], 2)} |")
    log(f"wrote {a.out_dir / 'results.json'} and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
