#!/usr/bin/env python3
"""Load on `nflash serve` (a benchmark, not a test): --clients concurrent
clients for --secs seconds against a tiny synthetic model and SmolLM2, each
under a memory budget. Each client sends requests back to back — half chat
completions, a quarter streamed chats, a quarter text completions, up to
--max-tokens tokens each — and on a 503 waits what Retry-After says (at
most 1 s) before the next one.

Reported per model: requests answered (200), turned away (503), other
statuses, connection errors, P50/P99 latency of answered requests (from
sending to the last byte), completion tokens per second over the run, the
server's peak RSS (VmHWM) against its budget, and whether it was still
running, without a panic, at the end. Outputs: the table and OUT/results.json.

    python3 scripts/bench_serve.py [--clients 16] [--secs 60] [--out bench-out/serve]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nflash_bench import common  # noqa: E402
from nflash_bench.common import MIB, REPO, die, log, run_info  # noqa: E402

common.PROG = "bench-serve"
BIN = Path(os.environ.get("NFLASH_BIN_DIR", REPO / "target" / "release"))


def ensure_packs(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    smol = out / "smollm2-q8_0.nflash"
    if not smol.exists() or smol.stat().st_mtime < (BIN / "prep").stat().st_mtime:
        log(f"converting SmolLM2 -> {smol}")
        subprocess.run([str(BIN / "prep"), "convert", "--model", str(REPO / "models/SmolLM2-135M-Instruct"),
                        "--out", str(smol), "--quant", "q8_0"], check=True, capture_output=True)
    tiny = out / "tiny-q8_0.nflash"
    if not tiny.exists() or tiny.stat().st_mtime < (BIN / "prep").stat().st_mtime:
        ckpt = out / "tiny"
        log(f"prep synth --shape tiny -> {tiny}")
        subprocess.run([str(BIN / "prep"), "synth", "--shape", "tiny", "--out", str(ckpt), "--tokenizer",
                        str(REPO / "models/SmolLM2-135M-Instruct")], check=True, capture_output=True)
        subprocess.run([str(BIN / "prep"), "convert", "--model", str(ckpt), "--out", str(tiny), "--quant", "q8_0"],
                       check=True, capture_output=True)
    return {"tiny": tiny, "smollm2": smol}


def start(pack: Path, port: int, extra: list[str]) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([str(BIN / "nflash"), "serve", "--model", str(pack), "--port", str(port), *extra],
                         stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in p.stderr:
        lines.append(line)
        if "http://" in line:
            threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
            return p, lines
    die("nflash serve did not start:\n" + "".join(lines))


def request(port: int, rng: random.Random, max_tokens: int) -> tuple[int, float, int]:
    """One request: (status, seconds, completion tokens)."""
    kind = rng.random()
    q = rng.choice(["What is the capital of France?", "Write a haiku about the sea.",
                    "Name three colours.", "Why is the sky blue?"])
    if kind < 0.75:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                "temperature": 0.7, "seed": rng.randrange(1 << 31), "stream": kind >= 0.5}
    else:
        path = "/v1/completions"
        body = {"prompt": q, "max_tokens": max_tokens, "temperature": 0.7, "seed": rng.randrange(1 << 31)}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read().decode()
        dt = time.monotonic() - t0
        tokens = 0
        if r.status == 200:
            if body.get("stream"):
                last = [l for l in data.splitlines() if l.startswith("data: {")][-1]
                tokens = json.loads(last[6:]).get("usage", {}).get("completion_tokens", 0)
            else:
                tokens = json.loads(data)["usage"]["completion_tokens"]
        elif r.status == 503:
            time.sleep(min(1.0, float(r.getheader("Retry-After", "1"))))
        return r.status, dt, tokens
    finally:
        c.close()


def load(port: int, clients: int, secs: float, max_tokens: int, seed: int) -> dict:
    deadline = time.monotonic() + secs
    results: list[tuple[int, float, int]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            try:
                r = request(port, rng, max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - every failure is counted
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.2)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = sorted(dt for s, dt, _ in results if s == 200)
    pct = lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] if ok else None  # noqa: E731
    statuses: dict[str, int] = {}
    for s, _, _ in results:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    return {"wall_s": wall, "answered": statuses.get("200", 0), "busy_503": statuses.get("503", 0),
            "statuses": statuses, "connection_errors": len(errors), "error_samples": errors[:5],
            "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99),
            "completion_tokens_per_s": sum(t for _, _, t in results) / wall}


def vm_hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--secs", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--budget-tiny", default="56MiB")
    ap.add_argument("--budget-smollm2", default="120MiB")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18180)
    ap.add_argument("--out", type=Path, default=REPO / "bench-out/serve")
    a = ap.parse_args()
    packs = ensure_packs(a.out)
    rows = []
    for i, (name, pack) in enumerate(packs.items()):
        budget = a.budget_tiny if name == "tiny" else a.budget_smollm2
        port = a.port + i
        proc, lines = start(pack, port, ["--memory-budget", budget, "--ctx", str(a.ctx), "--queue", str(a.queue)])
        log(f"{name}: {a.clients} clients for {a.secs:.0f} s against {pack.name} (budget {budget}, --queue {a.queue})")
        r = load(port, a.clients, a.secs, a.max_tokens, a.seed)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        health = json.loads(c.getresponse().read())
        alive = proc.poll() is None
        hwm = vm_hwm(proc.pid)
        proc.terminate()
        proc.wait()
        r.update({"model": name, "pack": str(pack), "budget_bytes": health.get("memory_budget_bytes"),
                  "peak_rss_bytes": hwm, "alive_at_end": alive,
                  "panicked": any("panicked" in l for l in lines), "server_log_tail": lines[-5:]})
        rows.append(r)
        log(f"  {r['answered']} answered, {r['busy_503']} 503, statuses {r['statuses']}, "
            f"{r['connection_errors']} connection errors, P50 {r['latency_p50_s']:.2f} s, "
            f"P99 {r['latency_p99_s']:.2f} s, peak RSS {hwm / MIB:.1f} MiB of {r['budget_bytes'] / MIB:.1f}")
    print()
    print(f"nflash serve under load: {a.clients} clients, {a.secs:.0f} s, max_tokens {a.max_tokens}, "
          f"--queue {a.queue}, --ctx {a.ctx}")
    print(f"{'model':<8} {'answered':>8} {'503':>5} {'other':>5} {'conn err':>8} {'P50 s':>6} {'P99 s':>6} "
          f"{'tok/s':>6} {'peak RSS MiB':>12} {'budget MiB':>10} {'crashes':>7}")
    for r in rows:
        other = sum(v for k, v in r["statuses"].items() if k not in ("200", "503"))
        crashes = int(not r["alive_at_end"] or r["panicked"])
        print(f"{r['model']:<8} {r['answered']:>8} {r['busy_503']:>5} {other:>5} {r['connection_errors']:>8} "
              f"{r['latency_p50_s']:>6.2f} {r['latency_p99_s']:>6.2f} {r['completion_tokens_per_s']:>6.1f} "
              f"{r['peak_rss_bytes'] / MIB:>12.1f} {r['budget_bytes'] / MIB:>10.1f} {crashes:>7}")
    (a.out / "results.json").write_text(json.dumps({**run_info(a), "rows": rows}, indent=1))
    log(f"wrote {a.out / 'results.json'}")
    if any(not r["alive_at_end"] or r["panicked"] or r["peak_rss_bytes"] > r["budget_bytes"] for r in rows):
        die("a server crashed, panicked or went over its budget")


if __name__ == "__main__":
    main()
