//! `nflash-fuzz`: seeded, reproducible mutation fuzzing of the files nflash
//! reads, on stable Rust (cargo-fuzz needs a nightly toolchain).
//!
//! Targets:
//! - `pack`: damaged copies of tiny packs (dense; sparse with a plan; a
//!   mixture of experts) through `nflash run` up to the first generated
//!   token, in memory or under a budget with every neuron cluster cold;
//! - `checkpoint`: a tiny checkpoint with one of `config.json`,
//!   `model.safetensors.index.json`, a safetensors shard (its header),
//!   `tokenizer_config.json` or `generation_config.json` damaged, through
//!   `prep convert`;
//! - `gguf`: damaged copies of the tiny GGUF files of `tests/data/gguf/`
//!   (made by llama.cpp's converter), structure-aware: extreme integers in
//!   every header field (counts, key, string and array lengths, value and
//!   tensor types, `n_dims`, `ne`, offsets) and `ne` products that
//!   overflow, besides byte flips, truncation and splices, through
//!   `prep convert --model X.gguf`.
//!
//! Input `N` of a `--seed` is always the same bytes (`--only N` makes it
//! again). Each runs in a child process with an address-space limit (so a
//! count read from the file and trusted shows as an abort) and a time
//! bound. Outcomes are counted by kind: `ok`, `refused` (a clean error),
//! and the failures `panic`, `signal`, `timeout` and `silent` (a non-zero
//! exit without a message), whose inputs are saved under `--out/failures`.
//! `make fuzz` runs it for `FUZZ_SECS`; `make test` runs a fixed slice.

mod mutate;

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use mutate::Kind;
use nflash_tests::{bin, repo_root, tiny_words, write_tiny_checkpoint, TinySpec, QUICK_CALIB};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Seeded mutation fuzzing of nflash's pack and checkpoint readers.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Run for this many seconds.
    #[arg(long, required_unless_present_any = ["inputs", "only"])]
    secs: Option<u64>,
    /// Run this many inputs (with --secs: whichever ends first).
    #[arg(long)]
    inputs: Option<u64>,
    /// Seed of the run: input N of a seed is always the same bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Inputs run at once (default: the number of cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Targets, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pack,checkpoint,gguf")]
    targets: Vec<Target>,
    /// Directory for seeds, failures and summary.json.
    #[arg(long, default_value = "fuzz-out")]
    out: PathBuf,
    /// A run longer than this is a hang, seconds.
    #[arg(long, default_value_t = 30)]
    bound_secs: u64,
    /// Address-space limit of each run, bytes.
    #[arg(long, default_value_t = 4 << 30)]
    as_limit: u64,
    /// Make input N only, run it, and keep it under --out/only.
    #[arg(long)]
    only: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Target {
    Pack,
    Checkpoint,
    Gguf,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Pack => "pack",
            Target::Checkpoint => "checkpoint",
            Target::Gguf => "gguf",
        }
    }
}

/// The valid inputs mutations start from.
struct Seeds {
    /// `(name, path, bytes, 8-byte-aligned offsets of its header and tables)`.
    packs: Vec<(String, PathBuf, Vec<u8>, Vec<usize>)>,
    /// Checkpoint directories.
    checkpoints: Vec<PathBuf>,
    /// `(name, bytes, header fields, each tensor's ne fields)` of the GGUF seeds.
    ggufs: Vec<GgufSeed>,
}

type GgufSeed = (String, Vec<u8>, Vec<(usize, usize)>, Vec<Vec<usize>>);

/// The GGUF seeds: llama.cpp-made files of tests/data/gguf/ (dense with a
/// permuted Q/K, Q8_0, a mixture of experts, fused projections, Gemma 3).
const GGUF_SEEDS: [&str; 5] = [
    "tiny-llama-f32.gguf",
    "tiny-llama-q8_0.gguf",
    "tiny-mixtral-f32.gguf",
    "tiny-phi3-f32.gguf",
    "tiny-gemma3-f32.gguf",
];

/// The checkpoint files the `checkpoint` target damages (those present).
const CHECKPOINT_FILES: [&str; 5] = [
    "config.json",
    "model.safetensors.index.json",
    "model.safetensors",
    "tokenizer_config.json",
    "generation_config.json",
];

/// One generated input.
struct Input {
    target: Target,
    kind: Kind,
    /// The seed it came from (and, for a checkpoint, the file damaged).
    from: String,
    /// For a checkpoint: the seed directory and the damaged file's name.
    checkpoint: Option<(PathBuf, String)>,
    bytes: Vec<u8>,
    /// `nflash run` under a budget with every cluster cold.
    cold: bool,
    /// `nflash run --verify off`: damaged weights reach the kernels.
    unchecked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    Refused,
    Panic,
    Signal,
    Timeout,
    Silent,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Panic => "panic",
            Outcome::Signal => "signal",
            Outcome::Timeout => "timeout",
            Outcome::Silent => "silent",
        }
    }

    fn is_failure(self) -> bool {
        !matches!(self, Outcome::Ok | Outcome::Refused)
    }
}

#[derive(Default)]
struct Tally {
    /// (target, outcome) → count.
    outcomes: BTreeMap<(Target, Outcome), u64>,
    /// (target, mutation) → count.
    kinds: BTreeMap<(Target, &'static str), u64>,
    /// First line of each refusal with digits and paths blanked → count.
    refusals: BTreeMap<String, u64>,
    failures: Vec<serde_json::Value>,
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Runs the campaign; `Ok(false)` if any input failed.
fn run(a: &Args) -> Result<bool> {
    if a.targets.is_empty() {
        bail!("--targets is empty; use pack, checkpoint or both");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let t0 = Instant::now();
    eprintln!("nflash-fuzz: making seeds in {}", a.out.join("seeds").display());
    let seeds = make_seeds(&a.out.join("seeds"))?;
    eprintln!("nflash-fuzz: seeds ready in {:.1} s", t0.elapsed().as_secs_f64());
    if let Some(n) = a.only {
        let dir = a.out.join("only");
        let input = make_input(a, &seeds, n);
        let (o, detail) = execute(a, &input, &dir)?;
        println!(
            "input {n}: {} {} from {}: {}\n{detail}",
            input.target.name(),
            input.kind.name(),
            input.from,
            o.name()
        );
        println!("kept in {}", dir.display());
        return Ok(!o.is_failure());
    }
    let jobs = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
    let next = AtomicU64::new(0);
    let tally = Mutex::new(Tally::default());
    let start = Instant::now();
    let deadline = a.secs.map(|s| start + Duration::from_secs(s));
    let limit = a.inputs.unwrap_or(u64::MAX);
    let done = AtomicU64::new(0);
    std::thread::scope(|s| {
        for w in 0..jobs {
            let (next, tally, seeds, done) = (&next, &tally, &seeds, &done);
            let dir = a.out.join("work").join(w.to_string());
            s.spawn(move || loop {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= limit {
                    return;
                }
                let input = make_input(a, seeds, n);
                let (o, detail) = match execute(a, &input, &dir) {
                    Ok(r) => r,
                    Err(e) => (Outcome::Silent, format!("harness error: {e:#}")),
                };
                let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                *t.outcomes.entry((input.target, o)).or_default() += 1;
                *t.kinds.entry((input.target, input.kind.name())).or_default() += 1;
                if o == Outcome::Refused {
                    *t.refusals.entry(normalize(&detail)).or_default() += 1;
                }
                if o.is_failure() {
                    let saved = save_failure(&a.out, n, &input, o, &detail);
                    eprintln!(
                        "nflash-fuzz: FAILURE input {n} ({} {}): {} -> {saved}",
                        input.target.name(),
                        input.kind.name(),
                        o.name()
                    );
                    t.failures.push(serde_json::json!({
                        "input": n, "target": input.target.name(), "mutation": input.kind.name(),
                        "from": input.from, "outcome": o.name(), "saved": saved, "detail": detail,
                    }));
                }
                drop(t);
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                if d % 500 == 0 {
                    eprintln!("nflash-fuzz: {d} inputs in {:.0} s", start.elapsed().as_secs_f64());
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(a.out.join("work"));
    let t = tally.into_inner().unwrap_or_else(|e| e.into_inner());
    let total: u64 = t.outcomes.values().sum();
    let wall = start.elapsed().as_secs_f64();
    print_summary(a, &t, total, wall);
    let summary = serde_json::json!({
        "seed": a.seed, "inputs": total, "wall_s": wall, "jobs": jobs,
        "bound_s": a.bound_secs, "as_limit_bytes": a.as_limit,
        "outcomes": t.outcomes.iter().map(|((tg, o), n)| serde_json::json!({"target": tg.name(), "outcome": o.name(), "count": n})).collect::<Vec<_>>(),
        "mutations": t.kinds.iter().map(|((tg, k), n)| serde_json::json!({"target": tg.name(), "mutation": k, "count": n})).collect::<Vec<_>>(),
        "refusals": t.refusals.iter().map(|(m, n)| serde_json::json!({"message": m, "count": n})).collect::<Vec<_>>(),
        "failures": t.failures,
    });
    let path = a.out.join("summary.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&summary)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("summary: {}", path.display());
    Ok(t.failures.is_empty())
}

fn print_summary(a: &Args, t: &Tally, total: u64, wall: f64) {
    println!("nflash-fuzz: seed {}, {total} inputs in {wall:.0} s ({:.1}/s)", a.seed, total as f64 / wall.max(1e-9));
    for tg in &a.targets {
        let row: Vec<String> =
            [Outcome::Ok, Outcome::Refused, Outcome::Panic, Outcome::Signal, Outcome::Timeout, Outcome::Silent]
                .iter()
                .map(|o| format!("{} {}", o.name(), t.outcomes.get(&(*tg, *o)).copied().unwrap_or(0)))
                .collect();
        let kinds: Vec<String> = Kind::ALL
            .iter()
            .map(|k| format!("{} {}", k.name(), t.kinds.get(&(*tg, k.name())).copied().unwrap_or(0)))
            .collect();
        println!("  {:<10} {} | mutations: {}", tg.name(), row.join(", "), kinds.join(", "));
    }
    let mut top: Vec<_> = t.refusals.iter().collect();
    top.sort_by(|x, y| y.1.cmp(x.1));
    println!("  most common refusals ({} kinds):", t.refusals.len());
    for (m, n) in top.iter().take(12) {
        println!("    {n:>6}  {}", m.chars().take(150).collect::<String>());
    }
    println!("  failures: {}", t.failures.len());
}

/// The error's first line with numbers and paths blanked, to count kinds of refusal.
fn normalize(detail: &str) -> String {
    let line = detail.lines().find(|l| l.starts_with("error")).unwrap_or(detail.lines().next().unwrap_or(""));
    let mut out = String::with_capacity(line.len());
    let mut prev_digit = false;
    for w in line.split(' ') {
        let w = if w.contains('/') { "PATH" } else { w };
        for c in w.chars() {
            if c.is_ascii_digit() {
                if !prev_digit {
                    out.push('N');
                }
                prev_digit = true;
            } else {
                prev_digit = false;
                out.push(c);
            }
        }
        out.push(' ');
    }
    out.trim_end().to_string()
}

// ------------------------------------------------------------------ seeds

/// Writes the seed checkpoints and converts the seed packs into `dir`.
fn make_seeds(dir: &Path) -> Result<Seeds> {
    let llama = dir.join("llama");
    let mixtral = dir.join("mixtral");
    let (dense, sparse, moe) = (dir.join("dense.nflash"), dir.join("sparse.nflash"), dir.join("moe.nflash"));
    // Made again every run, by this build's prep (a few seconds).
    {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        write_tiny_checkpoint(&llama, &TinySpec { shards: 2, ..TinySpec::default() });
        let moe_spec = TinySpec {
            arch: "MixtralForCausalLM",
            experts: 4,
            top_k: 2,
            inter: 64,
            tied: false,
            act: "relu",
            ..TinySpec::default()
        };
        write_tiny_checkpoint(&mixtral, &moe_spec);
        let calib = dir.join("calib.txt");
        std::fs::write(&calib, tiny_words(1200, TinySpec::default().vocab, 7))?;
        let calib = calib.to_str().context("seed path is not UTF-8")?;
        let profile = repo_root().join("profiles/dev-host.toml");
        let profile = profile.to_str().context("profile path is not UTF-8")?;
        let mut sparse_flags = vec!["--quant", "q4_0", "--cluster-bytes", "1KiB", "--calib", calib];
        sparse_flags.extend(QUICK_CALIB);
        sparse_flags.extend(["--device", profile, "--memory-budget", "64MiB", "--ctx", "64"]);
        let mut moe_flags = vec!["--quant", "q4_0", "--cluster-bytes", "1KiB", "--calib", calib];
        moe_flags.extend(QUICK_CALIB);
        for (ck, out, flags) in [
            (&llama, &dense, vec!["--quant", "q8_0", "--cluster-bytes", "1KiB"]),
            (&llama, &sparse, sparse_flags),
            (&mixtral, &moe, moe_flags),
        ] {
            let o = Command::new(bin("prep"))
                .args(["convert", "--model", path_str(ck)?, "--out", path_str(out)?])
                .args(&flags)
                .output()?;
            if !o.status.success() {
                bail!("making seed {}: {}", out.display(), String::from_utf8_lossy(&o.stderr));
            }
        }
    }
    let mut packs = Vec::new();
    for (name, p) in [("dense", &dense), ("sparse", &sparse), ("moe", &moe)] {
        let bytes = std::fs::read(p)?;
        let offsets = mutate::aligned_offsets(&mutate::pack_tables(p));
        packs.push((name.to_string(), p.clone(), bytes, offsets));
    }
    let mut ggufs = Vec::new();
    for name in GGUF_SEEDS {
        let bytes = std::fs::read(repo_root().join("tests/data/gguf").join(name))?;
        let (fields, dims) = mutate::gguf_fields(&bytes);
        ggufs.push((name.to_string(), bytes, fields, dims));
    }
    Ok(Seeds { packs, checkpoints: vec![llama, mixtral], ggufs })
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

// ------------------------------------------------------------------ inputs

/// SplitMix64: input `n`'s random stream from the run's seed.
fn stream(seed: u64, n: u64) -> StdRng {
    let mut z = seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

/// Input `n`: targets and mutation kinds in turn, so any slice is balanced;
/// [`Kind::Extreme`] walks every aligned offset of every seed in order.
fn make_input(a: &Args, seeds: &Seeds, n: u64) -> Input {
    let nt = a.targets.len() as u64;
    let target = a.targets[(n % nt) as usize];
    let j = n / nt;
    let kind = Kind::ALL[(j % Kind::ALL.len() as u64) as usize];
    let step = j / Kind::ALL.len() as u64;
    let mut rng = stream(a.seed, n);
    match target {
        Target::Pack => {
            let np = seeds.packs.len() as u64;
            let which = if kind == Kind::Extreme { (step % np) as usize } else { rng.random_range(0..np as usize) };
            let (name, _, seed_bytes, offsets) = &seeds.packs[which];
            let mut bytes = seed_bytes.clone();
            match kind {
                Kind::Flip => mutate::flip(&mut bytes, &mut rng),
                Kind::Truncate => mutate::truncate(&mut bytes, &mut rng),
                Kind::Extreme => mutate::extreme(&mut bytes, offsets, step / np),
                Kind::Splice => {
                    let other = &seeds.packs[rng.random_range(0..seeds.packs.len())].2;
                    bytes = mutate::splice(seed_bytes, other, &mut rng);
                }
                // Packs have no JSON to edit: a random extreme integer in a random table slot.
                Kind::Json => {
                    let step = rng.random_range(0..offsets.len().max(1) as u64 * 24);
                    mutate::extreme(&mut bytes, offsets, step);
                }
            }
            // Most damage is then caught by a CRC; often fix the header and
            // manifest CRCs so it reaches the validation behind them.
            let fix = match kind {
                Kind::Extreme | Kind::Json => 0.75,
                Kind::Flip | Kind::Splice => 0.25,
                Kind::Truncate => 0.5,
            };
            if rng.random_bool(fix) {
                mutate::fix_pack_crcs(&mut bytes);
            }
            let (cold, unchecked) = (rng.random_bool(0.5), rng.random_bool(0.25));
            Input { target, kind, from: name.clone(), checkpoint: None, bytes, cold, unchecked }
        }
        Target::Gguf => {
            let ng = seeds.ggufs.len() as u64;
            let which = if kind == Kind::Extreme { (step % ng) as usize } else { rng.random_range(0..ng as usize) };
            let (name, seed_bytes, fields, dims) = &seeds.ggufs[which];
            let mut bytes = seed_bytes.clone();
            match kind {
                Kind::Flip => mutate::flip(&mut bytes, &mut rng),
                Kind::Truncate => mutate::truncate(&mut bytes, &mut rng),
                Kind::Extreme => mutate::gguf_extreme(&mut bytes, fields, step / ng),
                Kind::Splice => {
                    let other = &seeds.ggufs[rng.random_range(0..seeds.ggufs.len())].1;
                    bytes = mutate::splice(seed_bytes, other, &mut rng);
                }
                // No JSON in a GGUF: an overflowing shape, or an extreme value in a random field.
                Kind::Json => {
                    if rng.random_bool(0.5) {
                        mutate::gguf_overflow(&mut bytes, dims, &mut rng);
                    } else {
                        let step = rng.random_range(0..fields.len().max(1) as u64 * 12);
                        mutate::gguf_extreme(&mut bytes, fields, step);
                    }
                }
            }
            Input { target, kind, from: name.clone(), checkpoint: None, bytes, cold: false, unchecked: false }
        }
        Target::Checkpoint => {
            let dir = &seeds.checkpoints[rng.random_range(0..seeds.checkpoints.len())];
            let files: Vec<String> = std::fs::read_dir(dir)
                .map(|r| {
                    r.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                        .filter(|f| CHECKPOINT_FILES.contains(&f.as_str()) || f.ends_with(".safetensors"))
                        .collect()
                })
                .unwrap_or_default();
            let mut files = files;
            files.sort();
            let file = files[rng.random_range(0..files.len())].clone();
            let seed_bytes = std::fs::read(dir.join(&file)).unwrap_or_default();
            let is_json = file.ends_with(".json");
            let mut bytes = seed_bytes.clone();
            match (kind, is_json) {
                (Kind::Flip, _) => mutate::flip(&mut bytes, &mut rng),
                (Kind::Truncate, _) => mutate::truncate(&mut bytes, &mut rng),
                (Kind::Extreme, false) => {
                    let offsets = mutate::aligned_offsets(&mutate::safetensors_tables(&seed_bytes));
                    mutate::extreme(&mut bytes, &offsets, step);
                }
                (Kind::Splice, _) => {
                    let other = files
                        .iter()
                        .filter(|f| f.ends_with(".json") == is_json)
                        .nth(rng.random_range(0..files.iter().filter(|f| f.ends_with(".json") == is_json).count()))
                        .cloned()
                        .unwrap_or_else(|| file.clone());
                    let other = std::fs::read(dir.join(other)).unwrap_or_default();
                    bytes = mutate::splice(&seed_bytes, &other, &mut rng);
                }
                (Kind::Extreme | Kind::Json, true) => {
                    bytes = mutate::json(&seed_bytes, &mut rng).unwrap_or(bytes);
                }
                (Kind::Json, false) => mutate::flip(&mut bytes, &mut rng),
            }
            let from = format!("{}/{file}", dir.file_name().unwrap_or_default().to_string_lossy());
            Input { target, kind, from, checkpoint: Some((dir.clone(), file)), bytes, cold: false, unchecked: false }
        }
    }
}

// ------------------------------------------------------------------ running

/// Runs `input` in `dir` (emptied first): its outcome and the child's stderr.
fn execute(a: &Args, input: &Input, dir: &Path) -> Result<(Outcome, String)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let mut cmd = match (&input.checkpoint, input.target) {
        (None, Target::Gguf) => {
            let gguf = dir.join("input.gguf");
            std::fs::write(&gguf, &input.bytes)?;
            let mut c = Command::new(bin("prep"));
            c.args(["convert", "--model", path_str(&gguf)?, "--out", path_str(&dir.join("out.nflash"))?]);
            c.args(["--quant", "q8_0"]);
            c
        }
        (None, _) => {
            let pack = dir.join("input.nflash");
            std::fs::write(&pack, &input.bytes)?;
            let mut c = Command::new(bin("nflash"));
            c.args(["run", "--model", path_str(&pack)?, "--raw", "--prompt", "w3 w4 w5", "--max-tokens", "1"]);
            c.args(["--temperature", "0", "--threads", "1"]);
            if input.cold {
                c.args(["--memory-budget", "64MiB", "--hot-fraction", "0", "--io-threads", "2"]);
            }
            if input.unchecked {
                c.args(["--verify", "off"]);
            }
            c
        }
        (Some((seed_dir, file)), _) => {
            let ck = dir.join("ckpt");
            std::fs::create_dir_all(&ck)?;
            for e in std::fs::read_dir(seed_dir)? {
                let e = e?;
                if e.file_name().to_string_lossy() != *file {
                    std::fs::hard_link(e.path(), ck.join(e.file_name()))
                        .or_else(|_| std::fs::copy(e.path(), ck.join(e.file_name())).map(|_| ()))?;
                }
            }
            std::fs::write(ck.join(file), &input.bytes)?;
            let mut c = Command::new(bin("prep"));
            c.args([
                "convert",
                "--model",
                path_str(&ck)?,
                "--out",
                path_str(&dir.join("out.nflash"))?,
                "--quant",
                "q8_0",
            ]);
            c
        }
    };
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    cmd.stdin(Stdio::null()).stdout(std::fs::File::create(&out)?).stderr(std::fs::File::create(&err)?);
    cmd.env("RUST_BACKTRACE", "0");
    let limit = a.as_limit;
    // SAFETY: runs in the forked child before exec; setrlimit is
    // async-signal-safe and touches only the child's own limits.
    unsafe {
        cmd.pre_exec(move || {
            let as_lim = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_AS, &as_lim);
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the target")?;
    let deadline = Instant::now() + Duration::from_secs(a.bound_secs);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let stderr = String::from_utf8_lossy(&std::fs::read(&err).unwrap_or_default()).into_owned();
    let outcome = match status {
        None => Outcome::Timeout,
        Some(st) if st.signal().is_some() => Outcome::Signal,
        Some(_) if stderr.contains("panicked at") => Outcome::Panic,
        Some(st) if st.code() == Some(101) => Outcome::Panic,
        Some(st) if st.success() => Outcome::Ok,
        Some(_) if stderr.trim().is_empty() => Outcome::Silent,
        Some(_) => Outcome::Refused,
    };
    let detail = match status {
        Some(st) if st.signal().is_some() => format!("killed by signal {}\n{stderr}", st.signal().unwrap_or(0)),
        None => format!("still running after {} s\n{stderr}", a.bound_secs),
        _ => stderr,
    };
    Ok((outcome, detail))
}

/// Keeps a failing input and what it printed; returns where.
fn save_failure(out: &Path, n: u64, input: &Input, o: Outcome, detail: &str) -> String {
    let dir = out.join("failures").join(format!("{}-{n:08}-{}", input.target.name(), o.name()));
    let _ = std::fs::create_dir_all(&dir);
    let plain = if input.target == Target::Gguf { "input.gguf" } else { "input.nflash" };
    let name = input.checkpoint.as_ref().map_or(plain.to_string(), |(_, f)| f.clone());
    let _ = std::fs::write(dir.join(&name), &input.bytes);
    if let Ok(mut f) = std::fs::File::create(dir.join("report.txt")) {
        let _ = writeln!(
            f,
            "input {n} ({} {} from {}{}): {}\nremake with: nflash-fuzz --only {n} --targets <the run's> --seed <the run's>\n\n{detail}",
            input.target.name(),
            input.kind.name(),
            input.from,
            match (input.cold, input.unchecked) {
                (true, true) => ", under a budget, every cluster cold, --verify off",
                (true, false) => ", under a budget, every cluster cold",
                (false, true) => ", --verify off",
                (false, false) => "",
            },
            o.name()
        );
    }
    dir.display().to_string()
}
