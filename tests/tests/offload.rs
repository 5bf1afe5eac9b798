//! The segmented neuron cache and flash reads: results do not
//! depend on where FFN weights live or on the thread count; bad budgets are
//! refused up front; a pack shrunk while running gives an error, not a
//! crash; a device plan is stored and used.

use std::path::{Path, PathBuf};

use nflash_format::Pack;
use nflash_plan::{CacheConfig, KvType};
use nflash_runtime::model::Speculation;
use nflash_tests::{
    assert_fails, check_placement_and_threads, generate_in, logit_bits, placements, repo_root, run, tiny_words,
    write_tiny_checkpoint, TinySpec,
};

fn spec() -> TinySpec {
    TinySpec { inter: 256, layers: 3, ..TinySpec::default() }
}

/// A tiny checkpoint converted with small neuron clusters (many per layer);
/// `extra` adds `prep convert` flags.
fn pack(dir: &Path, name: &str, quant: &str, extra: &[&str]) -> PathBuf {
    let ckpt = dir.join("ckpt");
    if !ckpt.exists() {
        write_tiny_checkpoint(&ckpt, &spec());
        std::fs::write(dir.join("calib.txt"), tiny_words(1200, spec().vocab, 7)).unwrap();
    }
    let out = dir.join(name);
    let mut args = vec![
        "convert",
        "--model",
        ckpt.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quant",
        quant,
        "--cluster-bytes",
        "1KiB",
    ];
    args.extend_from_slice(extra);
    let o = run("prep", &args);
    assert!(o.status.success(), "prep convert failed: {}", String::from_utf8_lossy(&o.stderr));
    out
}

#[test]
fn dense_results_do_not_depend_on_where_weights_live_or_threads() {
    let dir = tempfile::tempdir().unwrap();
    check_placement_and_threads(&pack(dir.path(), "dense.nflash", "q8_0", &[]));
}

#[test]
fn sparse_results_do_not_depend_on_where_weights_live_or_threads() {
    let dir = tempfile::tempdir().unwrap();
    let calib = dir.path().join("calib.txt");
    let p = pack(dir.path(), "sparse.nflash", "q8_0", &[]);
    drop(p);
    let mut flags = vec!["--calib", calib.to_str().unwrap(), "--sparsity", "0.5"];
    flags.extend(nflash_tests::QUICK_CALIB);
    let p = pack(dir.path(), "sparse.nflash", "q8_0", &flags);
    check_placement_and_threads(&p);
}

/// `nflash run` reorders resident Q4_0 and Q8_0 matrices into groups of 8
/// rows (SPEC §5.1): prefill and decode give the same bits as the row
/// layout, with the FFN in memory or on flash, on 1 or 2 threads, and
/// verify passes (speculative decoding) give decode's bits over it.
#[test]
fn the_x8_layout_changes_no_result() {
    if !nflash_runtime::kernels::x8_available() {
        eprintln!("skipped: this CPU has no ×8 kernel, so nothing is interleaved");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| 3 + (i * 7) % 70).collect();
    let same = |path: &Path, cfgs: Vec<(&str, CacheConfig)>| {
        for (name, cfg) in cfgs {
            for threads in [1, 2] {
                let rows = generate_in(path, &cfg, threads, &prompt, 10, false, Speculation::Auto);
                let inter = generate_in(path, &cfg, threads, &prompt, 10, true, Speculation::Auto);
                assert_eq!(rows.1, inter.1, "{name}, {threads} threads: tokens differ");
                assert_eq!(logit_bits(&rows.0), logit_bits(&inter.0), "{name}, {threads} threads: logits differ");
            }
            // Verify passes over interleaved matrices give decode's bits too.
            let rows = generate_in(path, &cfg, 2, &prompt, 10, false, Speculation::Auto);
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
            pool.install(|| {
                let mut p = Pack::open_resident(path).unwrap();
                p.interleave().unwrap();
                let model = nflash_runtime::load_model(&p, &cfg).unwrap();
                nflash_tests::check_verify(&model, &prompt, &rows.0, &rows.1, name);
            });
        }
    };
    for quant in ["q8_0", "q4_0"] {
        let path = pack(dir.path(), &format!("{quant}.nflash"), quant, &[]);
        let mut p = Pack::open_resident(&path).unwrap();
        let bytes = p.interleave().unwrap();
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.self_attn.o_proj.weight",
            "model.embed_tokens.weight",
        ] {
            assert!(p.is_interleaved(name), "{quant}: {name} was not interleaved");
        }
        assert!(bytes > 0);
        p.verify().expect("segments checked before the reorder still verify");
        same(&path, placements(&path).into_iter().take(2).collect());
    }
    // A vocabulary of 84 rows keeps the (tied) embedding in the row layout
    // beside interleaved attention: both layouts in one model.
    let ckpt = dir.path().join("ckpt84");
    write_tiny_checkpoint(&ckpt, &TinySpec { vocab: 84, ..spec() });
    let p84 = dir.path().join("v84.nflash");
    nflash_tests::convert(&ckpt, &p84, "q4_0");
    let mut p = Pack::open_resident(&p84).unwrap();
    p.interleave().unwrap();
    assert!(
        !p.is_interleaved("model.embed_tokens.weight") && p.is_interleaved("model.layers.1.self_attn.k_proj.weight")
    );
    same(&p84, placements(&p84).into_iter().take(1).collect());
}

#[test]
fn a_pack_shrunk_while_running_gives_an_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let p = Pack::open_resident(&path).unwrap();
    let n = p.manifest().ffn.len();
    let cfg = CacheConfig {
        hot_neurons: vec![0; n],
        cold_bytes: 0,
        io_threads: 1,
        io_engine: Default::default(),
        verify: true,
        start_bytes: None,
    };
    let model = nflash_runtime::load_model(&p, &cfg).unwrap();
    let mut kv = model.new_kv_cache(16);
    model.forward(&mut kv, &[5]).expect("reads work before the truncation");
    // Cut the file inside layer 0's FFN segment, after open.
    let ffn0 = p.segment_by_name("ffn.0").unwrap().1.offset;
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(ffn0 + 100).unwrap();
    let e = model.forward(&mut kv, &[6]).expect_err("a shrunk pack must fail the request");
    let msg = e.to_string();
    assert!(msg.contains("neuron cluster") && msg.contains("shrank"), "unexpected error: {msg}");
}

#[test]
fn budgets_below_the_fixed_region_or_the_kv_cache_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let m = path.to_str().unwrap();
    let o = run("nflash", &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--memory-budget", "1MiB"]);
    assert_fails(
        "budget below the fixed region",
        &o,
        &["memory budget 1.0 MiB", "short of the minimum", "fixed region", "--memory-budget"],
    );
    // Enough for the weights at a small context, not for the KV cache at a huge one.
    let o = run(
        "nflash",
        &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--memory-budget", "64MiB", "--ctx", "400000"],
    );
    assert_fails("KV cache larger than the budget", &o, &["KV cache at ctx 400000", "short", "or lower --ctx to"]);
    let o = run("nflash", &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--memory-budget", "lots"]);
    assert_fails("unparsable budget", &o, &["--memory-budget", "96MiB", "or auto"]);
    let base = ["run", "--model", m, "--prompt", "a b", "--max-tokens", "2"];
    let o = run("nflash", &[&base[..], &["--memory-budget", "64MiB", "--memory-max", "80MiB"]].concat());
    assert_fails("--memory-max with a size", &o, &["--memory-max goes with --memory-budget auto"]);
    let o = run("nflash", &[&base[..], &["--memory-budget", "auto", "--memory-reserve", "1000TiB"]].concat());
    assert_fails("auto with no room", &o, &["--memory-budget auto", "--memory-reserve", "short of its minimum"]);
    let o = run("nflash", &[&base[..], &["--memory-budget", "auto", "--memory-max", "64MiB", "--stats"]].concat());
    assert!(o.status.success(), "auto up to 64MiB: {}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("at 64.0 MiB") && err.contains("down to a floor of"), "{err}");
    let o = run(
        "nflash",
        &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--memory-budget", "64MiB", "--ctx", "64"],
    );
    assert!(o.status.success(), "a sufficient budget must run: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_device_plan_is_stored_in_the_pack_and_used_by_run() {
    let dir = tempfile::tempdir().unwrap();
    let profile = repo_root().join("profiles/oneplus-12.toml");
    let path = pack(
        dir.path(),
        "planned.nflash",
        "q8_0",
        &["--device", profile.to_str().unwrap(), "--memory-budget", "40MiB", "--ctx", "64", "--threads", "2"],
    );
    let p = Pack::open(&path).unwrap();
    let plan = p.manifest().plan.as_ref().expect("the pack carries a plan");
    assert_eq!(plan.memory_budget_bytes, 40 << 20);
    assert_eq!(plan.hot_neurons.len(), p.manifest().ffn.len());
    assert_eq!(plan.device.name, nflash_format::DeviceProfile::load(&profile).unwrap().name);
    assert!(plan.fixed_bytes + plan.hot_bytes + plan.cold_bytes <= plan.memory_budget_bytes);
    let m = path.to_str().unwrap();
    let o = run(
        "nflash",
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "a b",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--ctx",
            "64",
            "--threads",
            "2",
            "--stats",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("plan for") && err.contains("40.0 MiB"), "the stored plan is not reported: {err}");
    // The run flags override it.
    let o = run(
        "nflash",
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "a b",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--ctx",
            "64",
            "--threads",
            "2",
            "--stats",
            "--memory-budget",
            "48MiB",
        ],
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("48.0 MiB"));
}

#[test]
fn stats_json_reports_latency_percentiles_and_cache_figures() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let json = dir.path().join("stats.json");
    // Runs 12 tokens with nothing hot and `memory` (a flag and a size); returns the stats JSON.
    let stats = |memory: [&str; 2]| -> serde_json::Value {
        let mut args = vec![
            "run",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "a b c",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--ignore-eos",
            "--hot-fraction",
            "0",
        ];
        args.extend(memory);
        args.extend(["--ctx", "64", "--stats-json", json.to_str().unwrap()]);
        let o = run("nflash", &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
    };
    let v = stats(["--memory-budget", "64MiB"]);
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("missing {k} in {v}"));
    assert!(
        f("latency_ms_p50") > 0.0
            && f("latency_ms_p50") <= f("latency_ms_p90")
            && f("latency_ms_p90") <= f("latency_ms_p99")
    );
    assert!((0.0..1.0).contains(&f("cache_hit_rate")), "nothing hot: some clusters must miss");
    assert!(f("bytes_read_per_token") > 0.0);
    assert!((0.0..=1.0).contains(&f("io_wait_share")));
    // Each generated token's time after decode began, in order, within
    // decode; decode began during this run (seconds since the epoch).
    let times: Vec<f64> = v["token_times_s"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
    assert_eq!(times.len() as u64, v["generated_tokens"].as_u64().unwrap(), "{v}");
    assert!(times[0] < 0.1 && times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(*times.last().unwrap() <= f("decode_seconds"), "{times:?}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - 60.0..now).contains(&f("decode_start_unix_s")), "{v}");
    // Nothing hot but room for every cluster: the cold LRU serves the hits.
    let v = stats(["--cold-cache", "64MiB"]);
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("missing {k} in {v}"));
    assert!(f("cache_hit_rate") > 0.5, "the cold region holds every cluster: {v}");
    assert_eq!(f("hot_hit_rate"), 0.0, "--hot-fraction 0: no cluster is served by the hot region: {v}");
}

/// Cold clusters read through io_uring (where the kernel allows it) and
/// through I/O threads give the same greedy text; `--stats-json` names the
/// engine; a bad engine name is refused.
#[test]
fn io_uring_and_io_threads_read_the_same_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q4_0", &[]);
    let json = dir.path().join("s.json");
    let gen = |engine: &str| -> (String, serde_json::Value) {
        let o = run(
            "nflash",
            &[
                "run",
                "--model",
                path.to_str().unwrap(),
                "--prompt",
                "a b c",
                "--max-tokens",
                "16",
                "--temperature",
                "0",
            ]
            .into_iter()
            .chain(["--ignore-eos", "--raw", "--hot-fraction", "0", "--cold-cache", "0B", "--ctx", "64"])
            .chain(["--io-engine", engine, "--stats-json", json.to_str().unwrap()])
            .collect::<Vec<_>>(),
        );
        assert!(o.status.success(), "{engine}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert!(v["bytes_read_per_token"].as_f64().unwrap() > 0.0, "{engine}: nothing read from flash: {v}");
        (String::from_utf8_lossy(&o.stdout).into_owned(), v)
    };
    let (threads, vt) = gen("threads");
    assert_eq!(vt["io_engine"].as_str(), Some("threads"), "{vt}");
    let (auto, va) = gen("auto");
    let auto_engine = va["io_engine"].as_str().unwrap_or_default().to_string();
    assert!(["io_uring", "threads"].contains(&auto_engine.as_str()), "{va}");
    assert_eq!(auto, threads, "greedy text through {auto_engine} and threads");
    if auto_engine == "io_uring" {
        let (uring, vu) = gen("uring");
        assert_eq!(vu["io_engine"].as_str(), Some("io_uring"), "{vu}");
        assert_eq!(uring, threads);
    } else {
        eprintln!("note: io_uring is not available on this kernel; only the threads engine was run");
    }
    let o = run("nflash", &["run", "--model", path.to_str().unwrap(), "--prompt", "a", "--io-engine", "aio"]);
    nflash_tests::assert_fails("--io-engine aio", &o, &["aio", "threads"]);
}

/// The KV cache is f16 by default and f32 with `--kv f32`: the plan's KV
/// cache halves, greedy tokens stay, logits stay within f16 rounding, and
/// `--stats-json` says which was used.
#[test]
fn an_f16_kv_cache_halves_its_memory_and_keeps_greedy_tokens() {
    use nflash_plan::planner::fixed_region;
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let p = Pack::open_resident(&path).unwrap();
    let m = p.manifest();
    let (f16, f32) = (fixed_region(m, 256, KvType::F16, None), fixed_region(m, 256, KvType::F32, None));
    let kvd = (m.config.num_kv_heads * m.config.head_dim) as u64;
    assert_eq!(f32.kv, 2 * m.config.num_layers as u64 * 256 * kvd * 4);
    assert_eq!(2 * f16.kv, f32.kv);
    let prompt: Vec<u32> = (0..20).map(|i| 3 + (i * 11) % 70).collect();
    let run_kv = |kv: KvType| {
        let mut model = nflash_runtime::load_model(&p, &CacheConfig::all_hot(&p)).unwrap();
        model.set_kv_type(kv);
        assert_eq!(model.new_kv_cache(8).kv_type(), kv);
        let (logits, tokens) = nflash_tests::greedy(&model, &prompt, 12);
        (tokens, logits)
    };
    let (t16, l16) = run_kv(KvType::F16);
    let (t32, l32) = run_kv(KvType::F32);
    assert_eq!(t16, t32, "greedy tokens");
    assert_ne!(l16, l32, "the f16 cache rounds, so some logit must differ");
    // f16 keeps 11 bits (relative rounding 2^-11 ≈ 5e-4 per element); this
    // random 3-layer model amplifies it to about 1% of the logits (a wrong
    // conversion or a misread row would be of the order of 100%).
    for (a, b) in l16.iter().zip(&l32) {
        assert!(nflash_tests::rel_error_flat(a, b) < 3e-2, "logits differ by {}", nflash_tests::rel_error_flat(a, b));
    }
    // The command line: --kv f32 is reported, a bad type is refused.
    let json = dir.path().join("s.json");
    for kv in ["f16", "f32"] {
        let o = run(
            "nflash",
            &["run", "--model", path.to_str().unwrap(), "--prompt", "a b", "--max-tokens", "3", "--kv", kv]
                .into_iter()
                .chain(["--ctx", "64", "--stats-json", json.to_str().unwrap()])
                .collect::<Vec<_>>(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!((v["kv_cache"].as_str(), v["ctx"].as_u64()), (Some(kv), Some(64)), "{v}");
    }
    let o = run("nflash", &["run", "--model", path.to_str().unwrap(), "--prompt", "a", "--kv", "f8"]);
    nflash_tests::assert_fails("--kv f8", &o, &["f8", "f16 or f32"]);
}

/// A profile with the given random-read bandwidth at every block size, MB/s.
fn profile(read_mb_s: f64) -> nflash_format::DeviceProfile {
    nflash_format::DeviceProfile::parse(&format!(
        r#"
name = "test device"
source = "test"
[memory]
total_bytes = 8589934592
available_bytes = 4294967296
bandwidth_gb_s = 10.0
[cpu]
cores = [{{ class = "x", count = 2, ghz = 2.0 }}]
q4_0_matvec_gb_s_1t = 2.0
[flash]
io_queues = 1
read = [{{ block_bytes = 4096, in_flight = 1, random_mb_s = {read_mb_s}, sequential_mb_s = {read_mb_s} }}]
"#
    ))
    .unwrap()
}

#[test]
fn the_planner_fills_the_budget_hot_first_and_bounds_the_hot_set_by_io_time() {
    use nflash_plan::planner::{fixed_region, plan, PlanRequest};
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let p = Pack::open(&path).unwrap();
    let m = p.manifest();
    let req = |budget: u64| PlanRequest {
        budget_bytes: budget,
        ctx: 64,
        kv: KvType::F16,
        threads: 2,
        io_threads: None,
        measured: None,
        unit_share: None,
        draft_bytes: 0,
    };
    let fixed = fixed_region(m, 64, KvType::F16, None).total();
    let ffn: u64 = m.segments.iter().filter(|s| s.kind == nflash_format::SegmentKind::Ffn).map(|s| s.bytes).sum();
    let slow = profile(1.0);
    // Everything fits: all hot, no cold region.
    let all = plan(m, &slow, &req(fixed + 2 * ffn)).unwrap();
    assert!(all.hot_neurons.iter().zip(&m.ffn).all(|(&h, f)| h == f.n_neurons));
    assert_eq!(all.cold_bytes, 0);
    // Less memory: fewer hot neurons, never more memory than the budget, and
    // the hot set grows with the budget.
    let mut last = 0u64;
    // (With 3 layers, two layers' cold clusters are staged first, so hot starts above 2/3.)
    for frac in [0.75, 0.85, 0.95] {
        let b = fixed + (ffn as f64 * frac) as u64;
        let pl = plan(m, &slow, &req(b)).unwrap();
        let hot: u64 = pl.hot_neurons.iter().map(|&h| h as u64).sum();
        assert!(pl.fixed_bytes + pl.hot_bytes + pl.cold_bytes <= b, "plan exceeds its budget: {pl:?}");
        assert!(hot >= last && hot > 0, "hot set must grow with the budget: {hot} after {last}");
        assert!(pl.hot_neurons.iter().zip(&m.ffn).all(|(&h, f)| h <= f.n_neurons));
        last = hot;
    }
    // A disk fast enough that misses hide behind attention: no hot set is
    // needed, and the memory goes to the cold cache instead.
    let fast = plan(m, &profile(1e9), &req(fixed + ffn * 9 / 10)).unwrap();
    assert!(fast.hot_neurons.iter().all(|&h| h == 0), "{:?}", fast.hot_neurons);
    assert!(fast.cold_bytes > ffn / 2);
    // Below the fixed region: refused, saying by how much.
    let e = plan(m, &slow, &req(fixed - 1)).unwrap_err().to_string();
    assert!(e.contains("short of the minimum") && e.contains("fixed region"), "{e}");
    // A draft pack (issue 47) is held inside the same budget: the fixed
    // region grows by its bytes, the neuron cache shrinks by as much, and a
    // budget that held the model alone is refused with it, naming it.
    let draft = nflash_plan::planner::draft_pack_bytes(m, 64, KvType::F16);
    assert!(draft > ffn, "a draft holds its whole FFN: {draft} of FFN {ffn}");
    let b = fixed + draft + ffn * 3 / 4;
    let alone = plan(m, &slow, &req(b)).unwrap();
    let with = plan(m, &slow, &PlanRequest { draft_bytes: draft, ..req(b) }).unwrap();
    assert_eq!(with.fixed_bytes, alone.fixed_bytes + draft);
    assert!(with.fixed_bytes + with.hot_bytes + with.cold_bytes <= b, "{with:?}");
    let whole = |pl: &nflash_format::Plan| pl.hot_neurons.iter().zip(&m.ffn).all(|(&h, f)| h == f.n_neurons);
    assert!(whole(&alone), "alone, the model fits whole: {alone:?}");
    assert!(!whole(&with) && with.cold_bytes > 0, "beside the draft it does not: {with:?}");
    let e = plan(m, &slow, &PlanRequest { draft_bytes: draft, ..req(fixed + ffn / 2) }).unwrap_err().to_string();
    assert!(e.contains("draft pack"), "{e}");
}

#[test]
fn damaged_weights_huge_contexts_and_clobbering_outputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "t.nflash", "q8_0", &[]);
    let m = path.to_str().unwrap();
    // NaN scales (0xFFFF as f16) in layer 0's FFN: an error pointing to --verify, not flat garbage.
    let bad = dir.path().join("bad.nflash");
    std::fs::copy(&path, &bad).unwrap();
    let seg = Pack::open(&path).unwrap().segment_by_name("ffn.0").unwrap().1.clone();
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[seg.offset as usize..(seg.offset + seg.bytes) as usize].fill(0xFF);
    std::fs::write(&bad, &bytes).unwrap();
    let args = ["run", "--model", bad.to_str().unwrap(), "--prompt", "a b", "--max-tokens", "3", "--temperature", "0"];
    // The cluster checksums (SPEC §4.10) catch it at load.
    let o = run("nflash", &args);
    assert_fails("NaN weights", &o, &["neuron cluster 0 of layer 0", "CRC-32C"]);
    // Unchecked (or a pack without checksums), the NaN activations are caught and named.
    let o = run("nflash", &[&args[..], &["--verify", "off"]].concat());
    assert_fails("NaN weights, --verify off", &o, &["non-finite", "--verify full"]);
    // A context whose KV cache cannot be reserved: an error, not an abort.
    let o = run("nflash", &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--ctx", "4000000000000"]);
    assert_fails("huge --ctx", &o, &["KV cache", "--ctx"]);
    // --stats-json naming the pack would destroy it: refused before any work.
    let before = std::fs::read(&path).unwrap();
    let o = run("nflash", &["run", "--model", m, "--prompt", "a b", "--max-tokens", "2", "--stats-json", m]);
    assert_fails("--stats-json = --model", &o, &["--stats-json", "input"]);
    assert_eq!(std::fs::read(&path).unwrap(), before, "the pack was modified");
    // prep convert --out onto a checkpoint file: refused, checkpoint intact.
    let st = dir.path().join("ckpt/model.safetensors");
    let before = std::fs::read(&st).unwrap();
    let o =
        run("prep", &["convert", "--model", dir.path().join("ckpt").to_str().unwrap(), "--out", st.to_str().unwrap()]);
    assert_fails("--out inside the checkpoint", &o, &["checkpoint", "choose another path"]);
    assert_eq!(std::fs::read(&st).unwrap(), before, "the checkpoint was modified");
    // Plans that could never run are not written.
    let profile = repo_root().join("profiles/dev-host.toml");
    for bad in [["--threads", "0"], ["--ctx", "1"]] {
        let out = dir.path().join("never.nflash");
        let ck = dir.path().join("ckpt");
        let o = run(
            "prep",
            &[
                "convert",
                "--model",
                ck.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--device",
                profile.to_str().unwrap(),
                bad[0],
                bad[1],
            ],
        );
        assert_fails(&format!("prep convert {} {}", bad[0], bad[1]), &o, &[bad[0]]);
        assert!(!out.exists());
    }
}

/// The bytes of every neuron cluster of FFN `layer` (`n_neurons ×
/// bundle_bytes` each) as `cache` hands them out after a fetch of all of
/// them into `table`, against the file's.
fn assert_clusters_are_the_files(
    cache: &nflash_runtime::offload::NeuronCache,
    pack: &Pack,
    file: &[u8],
    layer: usize,
    table: &[nflash_runtime::model::source::Loc],
    what: &str,
) {
    let f = &pack.manifest().ffn[layer];
    let base = pack.segment_file_offset(f.segment) as usize;
    for (c, cl) in f.clusters.iter().enumerate() {
        let need = (cl.n_neurons as u64 * f.bundle.bundle_bytes) as usize;
        let at = base + cl.offset as usize;
        let got = &cache.cluster(layer, c, table[c]).unwrap()[..need];
        assert!(got == &file[at..at + need], "{what}: layer {layer} cluster {c} is not the file's");
    }
}

/// The second expert's reads start before the first computes
/// (`NeuronCache::fetch_ahead`): they never take a slot of the fetch before
/// them (its clusters keep the file's bytes when the cold region holds one
/// layer only), and where there is room the later fetch of their layer
/// finds them instead of reading them again.
#[test]
fn reads_started_ahead_keep_the_current_fetch_and_are_not_read_twice() {
    use nflash_runtime::offload::NeuronCache;
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "ahead.nflash", "q8_0", &[]);
    let pack = Pack::open_resident(&path).unwrap();
    let file = std::fs::read(&path).unwrap();
    let n_layers = pack.manifest().ffn.len();
    let all = |l: usize| (0..pack.manifest().ffn[l].clusters.len() as u32).collect::<Vec<u32>>();
    let open = |cold_bytes: u64| {
        let cfg = CacheConfig {
            hot_neurons: vec![0; n_layers],
            cold_bytes,
            io_threads: 2,
            io_engine: Default::default(),
            verify: true,
            start_bytes: None,
        };
        NeuronCache::open(&pack, &cfg).unwrap()
    };
    // Layers 0 then 2 (not 1, which layer 0's fetch reads ahead by itself),
    // with or without layer 2's reads started ahead; bytes read in all. With
    // `landed_before`, layer 2's reads started ahead must all land, that many
    // bytes in all, before its own fetch.
    let run = |cold_bytes: u64, ahead: bool, landed_before: Option<u64>| -> u64 {
        let cache = open(cold_bytes);
        let what = format!("cold region {cold_bytes}, ahead {ahead}");
        let mut table = Vec::new();
        cache.fetch(0, &all(0), &mut table).unwrap();
        if ahead {
            cache.fetch_ahead(2, &all(2));
        }
        assert_clusters_are_the_files(&cache, &pack, &file, 0, &table, &what);
        if let Some(total) = landed_before {
            let t0 = std::time::Instant::now();
            while cache.stats().bytes_read < total {
                assert!(t0.elapsed().as_secs() < 20, "{what}: layer 2 was not read ahead");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        cache.fetch(2, &all(2), &mut table).unwrap();
        assert_clusters_are_the_files(&cache, &pack, &file, 2, &table, &what);
        cache.stats().bytes_read
    };
    // A cold region of one layer: nothing of layer 2 fits beside layer 0.
    assert_eq!(run(0, true, None), run(0, false, None), "each cluster read once");
    // Room for all: layer 2 lands ahead and its fetch reads nothing more.
    let total = run(1 << 30, false, None);
    assert_eq!(run(1 << 30, true, Some(total)), total, "each cluster read once");
}

/// During a forward pass a shrink gives back at once the hot clusters of
/// every unit but the one whose locations the last fetch handed out (a
/// prefill layer call lasts about a second at 7B: a balloon growing
/// 100 MiB/s does not wait for it); that unit's go at the next fetch.
#[test]
fn a_shrink_during_a_pass_frees_the_other_layers_at_once() {
    use nflash_runtime::model::MemoryControl;
    use nflash_runtime::offload::NeuronCache;
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "inpass.nflash", "q8_0", &[]);
    let pack = Pack::open_resident(&path).unwrap();
    let cache = NeuronCache::open(&pack, &CacheConfig::all_hot(&pack)).unwrap();
    let mem = cache.memory();
    let (floor, ceiling) = (mem.floor_bytes(), mem.ceiling_bytes());
    let all = |l: usize| (0..pack.manifest().ffn[l].clusters.len() as u32).collect::<Vec<u32>>();
    let mut table = Vec::new();
    cache.fetch(1, &all(1), &mut table).unwrap();
    let held = mem.resize(0);
    // Three layers of equal size: layer 1's hot clusters stay, the others'
    // went (the floor, one layer's clusters to stage reads, comes in).
    let layer = ceiling / 3;
    assert_eq!(held, floor + layer, "held {held} of {ceiling}, floor {floor}: layer 1's hot clusters alone stay");
    // The next fetch lets layer 1's go; the pass ends at the floor.
    cache.fetch(2, &all(2), &mut table).unwrap();
    cache.end_pass();
    assert_eq!(mem.held_bytes(), floor);
}

/// Decodes with `cfg` while another thread squeezes and releases the
/// neuron cache (floor, ceiling and sizes between): the logits are the
/// bits of an unsqueezed run. Then, between tokens: a resize to the floor
/// gives back at once, clusters it dropped are read again, and a resize
/// to the ceiling brings everything back.
fn assert_squeezes_change_no_logit(path: &Path, cfg: &CacheConfig, what: &str) {
    let pack = Pack::open_resident(path).unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| 3 + (i * 5) % 70).collect();
    let (want, want_tokens, _) = generate_in(path, cfg, 2, &prompt, 12, false, Speculation::Never);

    let model = nflash_runtime::load_model(&pack, cfg).unwrap();
    let mem = model.memory_control().expect("a neuron cache's memory can move");
    let (floor, ceiling) = (mem.floor_bytes(), mem.ceiling_bytes());
    assert!(floor < ceiling, "{what}: floor {floor}, ceiling {ceiling}");
    assert_eq!(mem.held_bytes(), ceiling, "{what}");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let resizes = std::sync::atomic::AtomicUsize::new(0);
    let (logits, tokens) = std::thread::scope(|s| {
        s.spawn(|| {
            let sizes = [floor, ceiling, (floor + ceiling) / 2, 0, floor + 3 * 4096, u64::MAX, (floor + ceiling) / 3];
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let held = mem.resize(sizes[i % sizes.len()]);
                assert!(held >= floor, "{what}: held {held} below the floor {floor}");
                i += 1;
                resizes.store(i, std::sync::atomic::Ordering::Release);
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
        });
        // Stops the squeezing thread even when decoding panics.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        // A shrink and a grow first, then the rest while decoding.
        while resizes.load(std::sync::atomic::Ordering::Acquire) < 2 {
            std::thread::yield_now();
        }
        nflash_tests::greedy(&model, &prompt, 12)
    });
    assert_eq!(tokens, want_tokens, "{what}");
    assert_eq!(logit_bits(&logits), logit_bits(&want), "{what}: a resize changed the logits");
    let st = model.cache_stats();
    assert!(st.budget_shrinks > 0 && st.budget_grows > 0 && st.bytes_returned > 0, "{what}: {st:?}");

    let mut kv = model.new_kv_cache(64);
    model.forward(&mut kv, &prompt).unwrap();
    assert_eq!(mem.resize(ceiling), ceiling, "{what}");
    model.forward(&mut kv, &[5]).unwrap();
    let before = model.cache_stats();
    assert_eq!(mem.resize(0), floor, "{what}: between passes a resize is complete at once");
    model.forward(&mut kv, &[6]).unwrap();
    assert_eq!(mem.held_bytes(), floor, "{what}");
    let after = model.cache_stats().since(&before);
    assert!(after.reads_after_shrink > 0 && after.bytes_returned > 0, "{what}: {after:?}");
    // A whole generation at the floor, then again after growing back.
    let (at_floor, _) = nflash_tests::greedy(&model, &prompt, 12);
    assert_eq!(logit_bits(&at_floor), logit_bits(&want), "{what}: at the floor");
    assert_eq!(mem.resize(ceiling), ceiling, "{what}");
    assert!(model.cache_stats().budget_grows > before.budget_grows);
    let (grown, _) = nflash_tests::greedy(&model, &prompt, 12);
    assert_eq!(logit_bits(&grown), logit_bits(&want), "{what}: grown back");

    // Opened small (`--memory-budget auto`, or less memory free than the
    // budget): only what fits is read at load, and the rest grows back.
    for start in [0, (floor + ceiling) / 2] {
        let small =
            nflash_runtime::load_model(&pack, &CacheConfig { start_bytes: Some(start), ..cfg.clone() }).unwrap();
        let mem = small.memory_control().unwrap();
        let held = mem.held_bytes();
        assert!(held >= floor && held <= start.max(floor), "{what}: opened at {start}, holds {held} (floor {floor})");
        let (logits, _) = nflash_tests::greedy(&small, &prompt, 12);
        assert_eq!(logit_bits(&logits), logit_bits(&want), "{what}: opened at {start}");
        assert_eq!(mem.resize(ceiling), ceiling, "{what}: opened at {start}");
        let (logits, _) = nflash_tests::greedy(&small, &prompt, 12);
        assert_eq!(logit_bits(&logits), logit_bits(&want), "{what}: opened at {start}, grown");
    }
}

#[test]
fn the_neuron_cache_shrinks_and_grows_while_decoding_and_no_logit_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = pack(dir.path(), "elastic.nflash", "q8_0", &[]);
    let pack = Pack::open_resident(&path).unwrap();
    let n = pack.manifest().ffn.len();
    let all = |hot: u32| CacheConfig { hot_neurons: vec![hot; n], ..CacheConfig::all_hot(&pack) };
    let inter = spec().inter as u32;
    // Every cluster cold, in a cold region that can hold them all; every
    // cluster hot (the hot region gives way, its clusters served cold); half
    // and half, in a cold region of about one layer.
    for (cfg, what) in [
        (CacheConfig { cold_bytes: 1 << 30, ..all(0) }, "all cold"),
        (CacheConfig { cold_bytes: 0, ..all(inter) }, "all hot"),
        (CacheConfig { cold_bytes: 64 << 10, ..all(inter / 2) }, "half hot"),
    ] {
        assert_squeezes_change_no_logit(&path, &cfg, what);
    }
    // Clusters of 8 neurons and more, whose hot copies are in the ×8 layout
    // (where the CPU has it) and go back to it when read again.
    let ckpt = dir.path().join("ckpt");
    let big = dir.path().join("big.nflash");
    let o = run(
        "prep",
        &[
            "convert",
            "--model",
            ckpt.to_str().unwrap(),
            "--out",
            big.to_str().unwrap(),
            "--quant",
            "q4_0",
            "--cluster-bytes",
            "4KiB",
        ],
    );
    assert!(o.status.success(), "prep convert failed: {}", String::from_utf8_lossy(&o.stderr));
    let pack = Pack::open_resident(&big).unwrap();
    let cfg = CacheConfig { cold_bytes: 0, ..CacheConfig::all_hot(&pack) };
    assert_squeezes_change_no_logit(&big, &cfg, "all hot, 4 KiB clusters");
}
