//! `nflash plan-sim`: its estimates move the right way with the
//! memory budget and the predictor's precision, name the bounding resource,
//! and bad arguments are refused.

use nflash_tests::{assert_fails, convert, repo_root, run, write_tiny_checkpoint, TinySpec};
use serde_json::Value;

/// Runs plan-sim on the OnePlus 12 profile; one JSON object per row.
fn sim(extra: &[&str]) -> Vec<Value> {
    sim_on(&repo_root().join("profiles/oneplus-12.toml"), extra)
}

/// Runs plan-sim on the profile `device`; one JSON object per row.
fn sim_on(device: &std::path::Path, extra: &[&str]) -> Vec<Value> {
    let mut a = vec!["plan-sim", "--device", device.to_str().unwrap(), "--json"];
    a.extend_from_slice(extra);
    let o = run("nflash", &a);
    assert!(o.status.success(), "plan-sim failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// A row's time per token is the sum of its parts.
fn assert_parts_add_up(r: &Value) {
    let ms = f(r, "attention_ms")
        + f(r, "predictor_ms")
        + f(r, "ffn_ms")
        + f(r, "lm_head_ms")
        + f(r, "io_cpu_ms")
        + f(r, "io_exposed_ms");
    assert!((ms - f(r, "token_ms")).abs() < 1e-6 * ms.max(1.0), "parts {ms} vs token {r}");
}

#[test]
fn estimates_follow_the_budget_and_the_precision() {
    let rows = sim(&["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1,0.5,0.25"]);
    assert_eq!(rows.len(), 3, "{rows:?}");
    // Whole FFN in memory: nothing read, compute-bound.
    assert_eq!(f(&rows[0], "read_bytes_per_token"), 0.0);
    assert_eq!(rows[0]["bound"], "compute");
    for w in rows.windows(2) {
        assert!(f(&w[1], "memory_budget_bytes") < f(&w[0], "memory_budget_bytes"));
        assert!(f(&w[1], "tokens_per_s") <= f(&w[0], "tokens_per_s"), "{w:?}");
        assert!(f(&w[1], "read_bytes_per_token") >= f(&w[0], "read_bytes_per_token"), "{w:?}");
    }
    // Whole FFN hot: every hit is a hot-region hit; with less memory the hot
    // region serves part of the hits and the cold LRU may add to them.
    assert_eq!(f(&rows[0], "hot_hit_rate"), 1.0, "{:?}", rows[0]);
    assert!(f(&rows[2], "hot_hit_rate") < f(&rows[0], "hot_hit_rate"), "{rows:?}");
    for r in &rows {
        assert_parts_add_up(r);
        assert!(f(r, "hot_hit_rate") <= f(r, "hit_rate") + 1e-12, "{r}");
        assert!((1000.0 / f(r, "token_ms") - f(r, "tokens_per_s")).abs() < 1e-6, "{r}");
        assert!(["compute", "compute + I/O", "flash I/O"].contains(&r["bound"].as_str().unwrap()), "{r}");
        // Under pressure the budget gives way down to the floor: slower than any row, above the fixed region.
        assert!(f(r, "floor_bytes") > f(r, "fixed_bytes") && f(r, "floor_bytes") < f(r, "memory_budget_bytes"), "{r}");
        assert!(f(r, "floor_tokens_per_s") > 0.0 && f(r, "floor_tokens_per_s") <= f(r, "tokens_per_s"), "{r}");
    }
    assert_eq!(rows[0]["floor_bytes"], rows[2]["floor_bytes"], "the floor does not depend on the budget");
    // A less precise predictor reads and computes more at the same budget.
    let loose = sim(&["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "0.25", "--precision", "0.2"]);
    assert!(f(&loose[0], "read_bytes_per_token") > f(&rows[2], "read_bytes_per_token"), "{loose:?} vs {:?}", rows[2]);
    assert!(f(&loose[0], "tokens_per_s") < f(&rows[2], "tokens_per_s"));
    // Denser activations read more too.
    let dense = sim(&["--shape", "llama-7b", "--sparsity", "0.6", "--ffn-share", "0.25"]);
    assert!(f(&dense[0], "read_bytes_per_token") > f(&rows[2], "read_bytes_per_token"));
}

#[test]
fn the_ffn_is_priced_at_the_profiles_sparse_ffn_speed() {
    // The OnePlus 12 profile has no [kernels]: the FFN costs as the matvec.
    // With a measured sparse FFN speed, FFN time is bundle bytes / that speed.
    let dir = tempfile::tempdir().unwrap();
    // [kernels] figures need the thread count they were measured with.
    let base = std::fs::read_to_string(repo_root().join("profiles/oneplus-12.toml")).unwrap().replacen(
        "[cpu]\n",
        "[cpu]\nthreads_measured = 1\n",
        1,
    );
    assert!(base.contains("threads_measured = 1"));
    let with = |gb_s: f64| {
        let p = dir.path().join(format!("k{gb_s}.toml"));
        std::fs::write(&p, format!("{base}\n[kernels]\nq4_0_ffn_gb_s_1t = {gb_s}\nq4_0_ffn_gb_s_mt = {gb_s}\n"))
            .unwrap();
        sim_on(&p, &["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1", "--threads", "1"]).remove(0)
    };
    let plain = sim(&["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1", "--threads", "1"]).remove(0);
    let (slow, fast) = (with(1.0), with(2.0));
    assert!((f(&slow, "ffn_ms") / f(&fast, "ffn_ms") - 2.0).abs() < 1e-9, "{slow} vs {fast}");
    assert_ne!(f(&slow, "ffn_ms"), f(&plain, "ffn_ms"));
    // Everything else is still priced at the matvec speed.
    for k in ["attention_ms", "predictor_ms", "lm_head_ms"] {
        assert_eq!(f(&slow, k), f(&plain, k), "{k}");
    }
    // An impossible figure is refused with the field named.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, format!("{base}\n[kernels]\nq4_0_ffn_gb_s_1t = 0\nq4_0_ffn_gb_s_mt = 1\n")).unwrap();
    let o = run("nflash", &["plan-sim", "--device", bad.to_str().unwrap(), "--shape", "llama-7b"]);
    assert_fails("zero FFN speed", &o, &["kernels.q4_0_ffn_gb_s"]);
}

#[test]
fn attention_speed_read_cpu_and_speculation_enter_the_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(repo_root().join("profiles/oneplus-12.toml")).unwrap().replacen(
        "[cpu]\n",
        "[cpu]\nthreads_measured = 1\n",
        1,
    );
    let with = |name: &str, kernels: &str, extra: &[&str]| {
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, format!("{base}\n[kernels]\nq4_0_ffn_gb_s_1t = 10\nq4_0_ffn_gb_s_mt = 10\n{kernels}"))
            .unwrap();
        let mut a = vec!["--shape", "llama-7b", "--threads", "1"];
        a.extend_from_slice(extra);
        sim_on(&p, &a)
    };
    let tight = ["--sparsity", "0.8", "--ffn-share", "0.25"];
    let plain = with("plain", "", &tight).remove(0);
    // Attention weights at the attention-block speed; the KV cache and lm_head stay at the matvec speed.
    let slow_attn = with("attn", "q4_0_attention_gb_s_1t = 1\nq4_0_attention_gb_s_mt = 1\n", &tight).remove(0);
    assert!(f(&slow_attn, "attention_ms") > 2.0 * f(&plain, "attention_ms"), "{slow_attn} vs {plain}");
    assert_eq!(f(&slow_attn, "lm_head_ms"), f(&plain, "lm_head_ms"));
    // Each read's CPU time adds to compute, in proportion.
    assert_eq!(f(&plain, "io_cpu_ms"), 0.0);
    let cpu10 = with("cpu10", "read_cpu_us = 10\n", &tight).remove(0);
    let cpu20 = with("cpu20", "read_cpu_us = 20\n", &tight).remove(0);
    assert!(f(&cpu10, "io_cpu_ms") > 0.0);
    assert!((f(&cpu20, "io_cpu_ms") / f(&cpu10, "io_cpu_ms") - 2.0).abs() < 1e-9, "{cpu10} vs {cpu20}");
    assert!(f(&cpu20, "token_ms") > f(&cpu10, "token_ms"));
    // Speculative prefetch where reads stick out of the FFN: none with the FFN in memory.
    let all = with("all", "", &["--sparsity", "0.8", "--ffn-share", "1"]).remove(0);
    assert_eq!(f(&all, "speculated_layers"), 0.0);
    assert!(f(&plain, "speculated_layers") > 0.0, "{plain}");
    for r in [&plain, &slow_attn, &cpu10, &cpu20, &all] {
        assert_parts_add_up(r);
        assert!(f(r, "io_exposed_ms") <= f(r, "io_ms"), "{r}");
    }
    // A slower attention hides as much of the speculated reads or more.
    assert!(f(&slow_attn, "io_exposed_ms") <= f(&plain, "io_exposed_ms"), "{slow_attn} vs {plain}");
}

#[test]
fn a_closed_output_pipe_ends_plan_sim_quietly() {
    // `nflash plan-sim … | head -1`: the reader is gone before plan-sim prints.
    let device = repo_root().join("profiles/oneplus-12.toml");
    let mut child = std::process::Command::new(nflash_tests::bin("nflash"))
        .args(["plan-sim", "--device", device.to_str().unwrap(), "--shape", "llama-7b,mistral-7b", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

/// Speculative decoding (issue 47): a verify pass's figures beside each
/// row. Nothing accepted: one token per pass at a pass's cost, slower than
/// decode; where flash bounds decode, tokens that share their clusters
/// make speculation pay, and more so the more they share.
#[test]
fn speculation_is_priced_from_acceptance_and_the_union_of_clusters() {
    let spec = |extra: &[&str]| -> Vec<Value> {
        let mut a = vec!["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1,0.25", "--draft-tokens", "3"];
        a.extend_from_slice(extra);
        sim(&a)
    };
    let s = |r: &Value, k: &str| f(&r["speculative"], k);
    let plain = sim(&["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1,0.25"]);
    assert!(plain.iter().all(|r| r.get("speculative").is_none()), "{plain:?}");
    let none = spec(&["--acceptance", "0"]);
    let some = spec(&["--acceptance", "0.8", "--union-share", "0.3"]);
    let more = spec(&["--acceptance", "0.8", "--union-share", "0.1"]);
    for ((r, n), (s_, m)) in plain.iter().zip(&none).zip(some.iter().zip(&more)) {
        assert_eq!(f(r, "tokens_per_s"), f(n, "tokens_per_s"), "the plain estimate does not move");
        assert_eq!(s(n, "tokens_per_pass"), 1.0);
        assert!(s(n, "speedup") < 1.0, "{n}");
        assert!((s(s_, "tokens_per_pass") - 3.4).abs() < 1e-9, "{s_}");
        assert!((s(s_, "tokens_per_s") / f(s_, "tokens_per_s") - s(s_, "speedup")).abs() < 1e-9, "{s_}");
        assert!(s(m, "read_bytes_per_pass") <= s(s_, "read_bytes_per_pass"), "{m} {s_}");
        assert!(s(m, "speedup") >= s(s_, "speedup"), "{m} {s_}");
    }
    // A quarter of the FFN in memory: a pass that reads shared clusters
    // once gives more tokens/s.
    assert!(f(&some[1], "io_ms") > 0.0, "{}", some[1]);
    assert!(s(&some[1], "speedup") > 1.0, "{}", some[1]);
}

/// A draft pack (`--draft`) is priced in memory and in time: it takes its
/// bytes out of the model's neuron cache, each verify pass adds its draft
/// passes, so at the same acceptance it gives fewer tokens/s than prompt
/// lookup; a budget that holds the model but not the draft gets no
/// speculative row and a note.
#[test]
fn a_draft_pack_is_priced_in_memory_and_time() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("draft");
    // Large enough (about 8 MB) to move a 7B's hot region by whole clusters.
    write_tiny_checkpoint(&dir, &TinySpec { hidden: 256, inter: 2048, layers: 4, ..TinySpec::default() });
    let draft = tmp.path().join("draft.nflash");
    convert(&dir, &draft, "q8_0");
    let base = ["--shape", "llama-7b", "--sparsity", "0.9", "--ffn-share", "1,0.25", "--acceptance", "0.6"];
    let lookup = sim(&base);
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(&["--draft", draft.to_str().unwrap()]);
        a.extend_from_slice(extra);
        sim(&a)
    };
    let drafted = with(&[]);
    let s = |r: &Value, k: &str| f(&r["speculative"], k);
    for (l, d) in lookup.iter().zip(&drafted) {
        assert_eq!(f(l, "tokens_per_s"), f(d, "tokens_per_s"), "the plain estimate does not move");
        assert_eq!(s(l, "draft_ms"), 0.0);
        assert_eq!(s(l, "draft_bytes"), 0.0);
        assert!(s(d, "draft_ms") > 0.0 && s(d, "draft_bytes") > 0.0, "{d}");
        assert!((s(d, "pass_ms") - s(d, "verify_ms") - s(d, "draft_ms")).abs() < 1e-9, "{d}");
        assert!(s(d, "tokens_per_s") < s(l, "tokens_per_s"), "{l} {d}");
        assert!(s(d, "hot_share") <= s(l, "hot_share"), "{l} {d}");
    }
    // The draft's bytes come out of the neuron cache: all of them where the
    // plain plan fills the budget (a quarter of the FFN in memory), some
    // where the whole FFN and a MiB to spare fit.
    let cache = |r: &Value| s(r, "neuron_cache_bytes");
    assert_eq!(cache(&lookup[1]) - cache(&drafted[1]), s(&drafted[1], "draft_bytes"), "{} {}", lookup[1], drafted[1]);
    assert!(cache(&drafted[0]) < cache(&lookup[0]), "{} {}", lookup[0], drafted[0]);
    // More guesses per pass cost more draft passes.
    let more = with(&["--draft-tokens", "8"]);
    assert!(s(&more[0], "draft_ms") > s(&drafted[0], "draft_ms"), "{} {}", more[0], drafted[0]);
    // The floor budget holds the model alone: no speculative row there, and a note.
    let floor = format!("{}B", f(&lookup[1], "floor_bytes") as u64);
    let mut a = vec!["plan-sim", "--device", "profiles/oneplus-12.toml", "--json", "--shape", "llama-7b"];
    a.extend_from_slice(&["--sparsity", "0.9", "--acceptance", "0.6", "--memory-budget", &floor]);
    let device = repo_root().join("profiles/oneplus-12.toml");
    a[2] = device.to_str().unwrap();
    a.extend_from_slice(&["--draft", draft.to_str().unwrap()]);
    let o = run("nflash", &a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let row: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(row["tokens_per_s"].as_f64().is_some() && row.get("speculative").is_none(), "{row}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not it and the draft pack"), "{err}");
    // The tiny draft's vocabulary is not the 7B's: `nflash run` would refuse it, and plan-sim says so.
    assert!(err.contains("vocabulary") && err.contains("would refuse this draft"), "{err}");
}

#[test]
fn bad_plan_sim_arguments_are_refused() {
    let device = repo_root().join("profiles/oneplus-12.toml");
    let d = device.to_str().unwrap();
    let o = |extra: &[&str]| {
        let mut a = vec!["plan-sim", "--device", d];
        a.extend_from_slice(extra);
        run("nflash", &a)
    };
    assert_fails("unknown shape", &o(&["--shape", "gpt-5"]), &["gpt-5", "llama-7b"]);
    assert_fails("precision 0", &o(&["--shape", "llama-7b", "--precision", "0"]), &["--precision"]);
    assert_fails("acceptance 2", &o(&["--shape", "llama-7b", "--acceptance", "2"]), &["--acceptance 2"]);
    assert_fails("union share alone", &o(&["--shape", "llama-7b", "--union-share", "0.5"]), &["--acceptance"]);
    assert_fails("draft tokens alone", &o(&["--shape", "llama-7b", "--draft-tokens", "3"]), &["--acceptance"]);
    assert_fails("draft pack alone", &o(&["--shape", "llama-7b", "--draft", "/nonexistent.nflash"]), &["--acceptance"]);
    let a = &["--shape", "llama-7b", "--acceptance", "0.5", "--draft", "/nonexistent.nflash"];
    let e = assert_fails("missing draft pack", &o(a), &["--draft: /nonexistent.nflash"]);
    assert_eq!(e.matches("/nonexistent.nflash").count(), 1, "the path once: {e}");
    // Nothing priced: every budget refused is a failure, the rows say why.
    let a = &["--shape", "llama-7b", "--sparsity", "0.9", "--memory-budget", "1MiB,2MiB"];
    assert_fails("every budget refused", &o(a), &["every budget was refused"]);
    assert_fails(
        "negative acceptance",
        &o(&["--shape", "llama-7b", "--acceptance", "-0.1"]),
        &["--acceptance -0.1 is outside"],
    );
    let a = &["--shape", "llama-7b", "--acceptance", "0.5", "--draft-tokens", "0"];
    assert_fails("no draft tokens", &o(a), &["--draft-tokens 0 is outside"]);
    let a = &["--shape", "llama-7b", "--acceptance", "0.5", "--union-share", "0"];
    assert_fails("union share 0", &o(a), &["--union-share 0"]);
    assert_fails(
        "missing device",
        &run("nflash", &["plan-sim", "--device", "/nonexistent.toml", "--shape", "llama-7b"]),
        &["nonexistent.toml"],
    );
}
