//! `nflash plan-sim`: predict decode tokens/s of a pack or a model shape on a
//! device profile, without running it (PowerInfer-2 §4.4 cost model).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::builder::PossibleValuesParser;
use clap::Args;
use nflash_format::{DType, DeviceProfile, Manifest, Pack};
use nflash_plan::cost::{self, Estimate};
use nflash_plan::layout::{ffn_read_bytes, segment_bytes};
use nflash_plan::planner::{self, PlanRequest};
use nflash_plan::sim::{self, SimOptions, SHAPES};
use nflash_runtime::message;

/// Arguments of `nflash plan-sim`.
#[derive(Args)]
pub struct PlanSimArgs {
    /// Device profile (TOML): flash bandwidth by read size, matvec and sparse FFN speeds, cores.
    #[arg(long)]
    device: PathBuf,
    /// Packs to simulate, comma-separated (their own frequency curves, predictor
    /// quality, clusters and quant: the shape options below do not apply to them).
    #[arg(long = "model", value_name = "PACK", value_delimiter = ',')]
    models: Vec<PathBuf>,
    /// Model shapes to simulate, comma-separated (`nflash_plan::sim::SHAPES`).
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(SHAPES.map(|s| s.name)))]
    shape: Vec<String>,
    /// Target sparsities of the shapes, comma-separated [default: 0.9,0.8,0.6].
    #[arg(long, value_delimiter = ',')]
    sparsity: Vec<f64>,
    /// Power-law exponent of neuron hotness for the shapes [default: 1.5, prep synth's].
    #[arg(long)]
    skew: Option<f64>,
    /// Mixture-of-experts shapes: power-law exponent of expert popularity
    /// [default: 0, every expert equally often; prep synth's default is 1].
    #[arg(long)]
    router_skew: Option<f64>,
    /// Predictor recall of the shapes [default: 0.99].
    #[arg(long)]
    recall: Option<f64>,
    /// Predictor precision of the shapes [default: 1.0]: prep's MLP predictor reached 1.00 on the synthetic
    /// llama-7b, whose gate has rank 128 (0.21 from a random start; docs/benchmarks.md). Pass a real model's value.
    #[arg(long)]
    precision: Option<f64>,
    /// Weight type of the shapes [default: q4_0].
    #[arg(long)]
    quant: Option<DType>,
    /// Memory budgets, comma-separated (e.g. 3GiB,4GiB); default: the fixed
    /// region plus each of --ffn-share of the FFN bytes.
    #[arg(long, value_delimiter = ',', value_parser = nflash_plan::planner::parse_bytes)]
    memory_budget: Vec<u64>,
    /// Shares of the FFN bytes kept in memory beside the fixed region, used without --memory-budget.
    #[arg(long, value_delimiter = ',', default_value = "1,0.5,0.25")]
    ffn_share: Vec<f64>,
    /// Context length the KV cache is sized for, tokens.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..=nflash_format::MAX_CONTEXT as i64))]
    ctx: u32,
    /// KV cache element type the plan sizes: f16 (as `nflash run` by default) or f32.
    #[arg(long, default_value = "f16", value_parser = crate::memory::parse_kv)]
    kv: nflash_plan::KvType,
    /// Compute threads; default: the device's cores.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Speculative decoding (`nflash run --speculate-draft`): also predict
    /// tokens/s with verify passes of --draft-tokens drafted tokens of
    /// which this share is accepted (`acceptance_rate` of
    /// `nflash run --stats-json`), 0 to 1.
    #[arg(long, allow_negative_numbers = true)]
    acceptance: Option<f64>,
    /// With --acceptance: tokens drafted per verify pass, on average
    /// (`draft_tokens / verify_passes` of `nflash run --stats-json`; a
    /// prompt lookup drafts fewer than its --draft-tokens where it finds
    /// no long match); above 0, at most 16 [default: 4].
    #[arg(long, allow_negative_numbers = true)]
    draft_tokens: Option<f64>,
    /// With --acceptance: what each token of a verify pass beyond the
    /// first adds to the pass's compute, in decode tokens' compute (weights
    /// are read once per pass), 0 to 2 [default: 0.5, fitted on the dev
    /// host; near 1 where compute bounds decode, lower where memory
    /// bandwidth does].
    #[arg(long, allow_negative_numbers = true)]
    verify_token_cost: Option<f64>,
    /// With --acceptance: the clusters a verify pass reads per cluster its
    /// tokens need in all, as measured on the pack
    /// (`verify_cluster_union_per_pass` / `verify_clusters_needed_per_pass`
    /// of `nflash run --stats-json`), above 0, at most 1 [default: tokens
    /// need clusters independently, more than real text's tokens, which
    /// share their neurons, need].
    #[arg(long, allow_negative_numbers = true)]
    union_share: Option<f64>,
    /// With --acceptance: the guesses come from this draft pack
    /// (`nflash run --draft PACK`), not from prompt lookup: it is held
    /// all in memory inside each budget, so the model's neuron cache
    /// shrinks by its bytes (weights, KV cache at --ctx, scratch), and
    /// each verify pass adds --draft-tokens of its decode passes.
    #[arg(long, value_name = "PACK")]
    draft: Option<PathBuf>,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
}

/// The shape options with their defaults applied.
struct ShapeOptions {
    sparsity: Vec<f64>,
    skew: f64,
    router_skew: f64,
    recall: f64,
    precision: f64,
    quant: DType,
}

/// Checks the arguments; returns the shape options, and a note when shape
/// options were given but only packs are simulated (each pack's own
/// sparsity, predictor quality and quant override them).
fn check(a: &PlanSimArgs) -> Result<(ShapeOptions, Option<String>)> {
    if a.models.is_empty() && a.shape.is_empty() {
        let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        bail!("nothing to simulate: pass --model PACK[,PACK…] or --shape NAME ({})", names.join(", "));
    }
    let o = ShapeOptions {
        sparsity: if a.sparsity.is_empty() { vec![0.9, 0.8, 0.6] } else { a.sparsity.clone() },
        skew: a.skew.unwrap_or(1.5),
        router_skew: a.router_skew.unwrap_or(0.0),
        recall: a.recall.unwrap_or(0.99),
        precision: a.precision.unwrap_or(1.0),
        quant: a.quant.unwrap_or(DType::Q4_0),
    };
    if let Some(s) = o.sparsity.iter().find(|s| !(0.0..1.0).contains(*s)) {
        bail!("--sparsity {s} is outside [0, 1)");
    }
    if let Some(f) = a.ffn_share.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        bail!("--ffn-share {f} is outside [0, 1]");
    }
    if !(o.recall > 0.0 && o.recall <= 1.0 && o.precision > 0.0 && o.precision <= 1.0) {
        bail!("--recall and --precision must be in (0, 1]");
    }
    if !(0.0..=8.0).contains(&o.skew) {
        bail!("--skew {} is outside [0, 8]", o.skew);
    }
    if !(0.0..=8.0).contains(&o.router_skew) {
        bail!("--router-skew {} is outside [0, 8]", o.router_skew);
    }
    if let Some(x) = a.acceptance.filter(|x| !(0.0..=1.0).contains(x)) {
        bail!("--acceptance {x} is outside [0, 1]");
    }
    if let Some(c) = a.verify_token_cost.filter(|c| !(0.0..=2.0).contains(c)) {
        bail!("--verify-token-cost {c} is outside [0, 2]");
    }
    if let Some(k) = a.draft_tokens.filter(|k| !(*k > 0.0 && *k <= 16.0)) {
        bail!("--draft-tokens {k} is outside (0, 16]");
    }
    if let Some(u) = a.union_share.filter(|u| !(*u > 0.0 && *u <= 1.0)) {
        bail!("--union-share {u} is outside (0, 1]");
    }
    if a.acceptance.is_none()
        && (a.draft_tokens.is_some() || a.union_share.is_some() || a.verify_token_cost.is_some() || a.draft.is_some())
    {
        bail!("--draft-tokens, --union-share, --verify-token-cost and --draft describe verify passes: give --acceptance too");
    }
    let given: Vec<&str> = [
        ("--sparsity", !a.sparsity.is_empty()),
        ("--skew", a.skew.is_some()),
        ("--router-skew", a.router_skew.is_some()),
        ("--recall", a.recall.is_some()),
        ("--precision", a.precision.is_some()),
        ("--quant", a.quant.is_some()),
    ]
    .into_iter()
    .filter_map(|(f, g)| g.then_some(f))
    .collect();
    let note = (!a.models.is_empty() && !given.is_empty()).then(|| {
        format!(
            "{} apply to --shape only: the --model packs are simulated with their own sparsity, predictor quality, clusters and quant{}",
            given.join(", "),
            if a.shape.is_empty() { " (no --shape was given, so they are unused)" } else { "" }
        )
    });
    Ok((o, note))
}

/// A size for the table: MiB below 1 GiB, else GiB.
fn size(b: u64) -> String {
    if b < 1 << 30 {
        format!("{:.0}MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2}GiB", b as f64 / (1u64 << 30) as f64)
    }
}

/// One simulated case.
struct Case {
    label: String,
    /// Target sparsity; `None` for a dense pack.
    sparsity: Option<f64>,
    budget: u64,
    ffn_bytes: u64,
    fixed: u64,
    hot_share: f64,
    /// The estimate, or why the planner refused the budget.
    est: std::result::Result<Estimate, String>,
    /// Under memory pressure the budget goes down to this floor (the fixed
    /// region and one layer's clusters, nothing hot), bytes, and decodes at
    /// these tokens/s there (`None`: not estimated).
    floor: u64,
    floor_tokens_per_s: Option<f64>,
    /// With --acceptance: one verify pass's estimate (with --draft, under
    /// the plan that holds the draft).
    verify: Option<SpecCase>,
}

/// A verify pass as plan-sim prices it.
struct SpecCase {
    /// The pass's estimate (its `token_ms` is the pass's, draft passes apart).
    pass: Estimate,
    /// The draft pack's passes per verify pass, ms (0: prompt lookup).
    draft_ms: f64,
    /// The FFN's share in memory under the plan that holds the draft.
    hot_share: f64,
    /// That plan's neuron cache, hot and cold regions, bytes.
    cache_bytes: u64,
}

impl SpecCase {
    /// Tokens/s with `v`'s tokens per pass.
    fn tokens_per_s(&self, v: &cost::Verify) -> f64 {
        v.tokens_per_pass() * 1e3 / (self.pass.token_ms() + self.draft_ms)
    }
}

/// A draft pack as plan-sim prices it (`--draft`).
struct DraftCost {
    /// Its bytes inside the budget ([`planner::draft_pack_bytes`] at --ctx).
    bytes: u64,
    /// One of its decode passes on the device, all of it in memory, ms.
    pass_ms: f64,
    /// Its vocabulary (HF `vocab_size`): `nflash run` needs the model's tokenizer.
    vocab: u64,
    /// Its segments' bytes.
    weights: u64,
}

/// Prices the draft pack at `path` on `dev` at `threads` (`--draft`).
///
/// # Errors
/// The pack cannot be opened, or the planner refuses the budget its whole
/// pack takes (a broken manifest).
fn draft_cost(path: &std::path::Path, dev: &DeviceProfile, a: &PlanSimArgs, threads: u32) -> Result<DraftCost> {
    // The pack's errors name its path.
    let pack = Pack::open(path).context("--draft")?;
    let m = pack.manifest();
    let share = pack.unit_share().context("--draft")?;
    // A budget that holds all of it, every cluster hot, as `nflash run --draft` loads it.
    let budget =
        planner::fixed_region(m, a.ctx, a.kv, None).total() + ffn_read_bytes(m) + planner::staging_bytes(m) + (1 << 20);
    let req = PlanRequest {
        budget_bytes: budget,
        ctx: a.ctx,
        kv: a.kv,
        threads,
        io_threads: None,
        measured: None,
        unit_share: Some(share.clone()),
        draft_bytes: 0,
    };
    let p = planner::plan(m, dev, &req).with_context(|| format!("--draft {}", path.display()))?;
    Ok(DraftCost {
        bytes: planner::draft_pack_bytes(m, a.ctx, a.kv),
        vocab: m.config.vocab_size,
        weights: segment_bytes(m),
        pass_ms: cost::estimate(m, &share, dev, &p).token_ms(),
    })
}

#[allow(clippy::too_many_arguments)]
fn simulate(
    m: &Manifest,
    share: &[f64],
    dev: &DeviceProfile,
    a: &PlanSimArgs,
    draft: Option<&DraftCost>,
    threads: u32,
    label: &str,
    sparsity: Option<f64>,
    notes: &mut Vec<String>,
) -> Vec<Case> {
    // FFN bytes as read (whole aligned clusters), the unit hot_bytes is counted in.
    let ffn_bytes = ffn_read_bytes(m);
    let fixed = planner::fixed_region(m, a.ctx, a.kv, None).total();
    let budgets: Vec<u64> = if a.memory_budget.is_empty() {
        // The planner also needs one layer's clusters to stage reads beyond the fixed region.
        let stage = ffn_bytes / m.ffn.len().max(1) as u64;
        let b: Vec<u64> =
            a.ffn_share.iter().map(|f| fixed + ((*f * ffn_bytes as f64) as u64).max(stage) + (1 << 20)).collect();
        if a.ffn_share.iter().any(|f| ((*f * ffn_bytes as f64) as u64) < stage) {
            notes.push(format!("{label}: an --ffn-share below one layer's FFN ({:.1}% of it) is raised to that minimum (the cold region stages one layer's reads)", 100.0 / m.ffn.len().max(1) as f64));
        }
        b
    } else {
        a.memory_budget.clone()
    };
    // Sliding-window layers keep a ring of their window plus one pass, not the context.
    if let Some(w) = (0..m.config.num_layers as usize).find_map(|l| m.config.layer_window(l)) {
        let c = &m.config;
        let ring = nflash_plan::layout::kv_cache_bytes_of(c, a.ctx as usize, a.kv);
        let kvd = (c.num_kv_heads * c.head_dim) as usize;
        let all = nflash_plan::layout::kv_cache_bytes(c.num_layers as usize, kvd, a.ctx as usize, a.kv);
        let sliding = (0..c.num_layers as usize).filter(|&l| c.layer_window(l).is_some()).count();
        notes.push(format!(
            "{label}: KV cache ({}) at --ctx {}: {} with {sliding} of {} layers keeping a ring of window {w} + one pass of {} tokens; {} if every layer kept the whole context",
            a.kv.name(),
            a.ctx,
            size(ring),
            c.num_layers,
            nflash_plan::layout::kv_ring_room(c),
            size(all)
        ));
    }
    if a.ctx as u64 > m.config.max_position_embeddings {
        notes.push(format!(
            "{label}: --ctx {} is beyond the model's context of {} tokens",
            a.ctx, m.config.max_position_embeddings
        ));
    }
    let request = |budget_bytes: u64| PlanRequest {
        budget_bytes,
        ctx: a.ctx,
        kv: a.kv,
        threads,
        io_threads: None,
        measured: None,
        unit_share: Some(share.to_vec()),
        draft_bytes: 0,
    };
    // The floor the budget gives way to under pressure, and its speed.
    let floor = fixed + planner::staging_bytes(m);
    let floor_tokens_per_s =
        planner::plan(m, dev, &request(floor)).ok().map(|p| 1e3 / cost::estimate(m, share, dev, &p).token_ms());
    let verify = verify_of(a);
    if let Some(d) = draft {
        if d.vocab != m.config.vocab_size {
            notes.push(format!(
                "{label}: the draft's vocabulary ({} tokens) is not the model's ({}): `nflash run --draft` needs the model's tokenizer and would refuse this draft",
                d.vocab, m.config.vocab_size
            ));
        }
        let weights = segment_bytes(m);
        if d.weights >= weights {
            notes.push(format!(
                "{label}: the draft ({}) is not smaller than the model ({}): its passes cost about what the model's do, so it cannot pay",
                size(d.weights),
                size(weights)
            ));
        }
    }
    // A verify pass's estimate under the plan that also holds the draft pack,
    // and its draft passes' time; `None` (noted) where the budget does not hold both.
    let hot_share = |p: &nflash_format::Plan| p.hot_bytes as f64 / ffn_bytes.max(1) as f64;
    let verify_at = |budget: u64, plain: &nflash_format::Plan, notes: &mut Vec<String>| -> Option<SpecCase> {
        let v = verify?;
        let Some(d) = draft else {
            let pass = cost::estimate_verify(m, share, dev, plain, &v);
            return Some(SpecCase {
                pass,
                draft_ms: 0.0,
                hot_share: hot_share(plain),
                cache_bytes: plain.hot_bytes + plain.cold_bytes,
            });
        };
        match planner::plan(m, dev, &PlanRequest { draft_bytes: d.bytes, ..request(budget) }) {
            Ok(p) => Some(SpecCase {
                pass: cost::estimate_verify(m, share, dev, &p, &v),
                draft_ms: v.draft_tokens * d.pass_ms,
                hot_share: hot_share(&p),
                cache_bytes: p.hot_bytes + p.cold_bytes,
            }),
            Err(_) => {
                notes.push(format!(
                    "{label}: the budget {} holds the model but not it and the draft pack ({}): no spec tok/s there",
                    size(budget),
                    size(d.bytes)
                ));
                None
            }
        }
    };
    budgets
        .into_iter()
        .map(|budget| {
            if budget > dev.memory.available_bytes {
                notes.push(format!(
                    "{label}: the budget {} is more than {}'s available memory ({}): that row cannot run there",
                    size(budget),
                    dev.name,
                    size(dev.memory.available_bytes)
                ));
            }
            match planner::plan(m, dev, &request(budget)) {
                Ok(p) => Case {
                    verify: verify_at(budget, &p, notes),
                    label: label.to_string(),
                    sparsity,
                    budget,
                    ffn_bytes,
                    fixed: p.fixed_bytes,
                    hot_share: hot_share(&p),
                    est: Ok(cost::estimate(m, share, dev, &p)),
                    floor,
                    floor_tokens_per_s,
                },
                Err(e) => Case {
                    label: label.to_string(),
                    sparsity,
                    budget,
                    ffn_bytes,
                    fixed,
                    hot_share: 0.0,
                    est: Err(e.to_string()),
                    floor,
                    floor_tokens_per_s,
                    verify: None,
                },
            }
        })
        .collect()
}

/// The verify pass of --acceptance, --draft-tokens, --verify-token-cost and --union-share.
fn verify_of(a: &PlanSimArgs) -> Option<cost::Verify> {
    Some(cost::Verify {
        draft_tokens: a.draft_tokens.unwrap_or(nflash_runtime::draft::DEFAULT_DRAFT_TOKENS as f64),
        acceptance: a.acceptance?,
        token_cost: a.verify_token_cost.unwrap_or(cost::VERIFY_TOKEN_COST),
        union_share: a.union_share,
    })
}

pub fn run(a: PlanSimArgs) -> Result<()> {
    let (so, override_note) = check(&a)?;
    let dev = DeviceProfile::load(&a.device)?;
    let mut notes: Vec<String> = override_note.into_iter().collect();
    let threads = match a.threads {
        Some(t) if t > dev.n_cores() => {
            notes.push(format!(
                "--threads {t} is more than {}'s {} cores: simulated with {}",
                dev.name,
                dev.n_cores(),
                dev.n_cores()
            ));
            dev.n_cores()
        }
        Some(t) => t,
        None => dev.n_cores(),
    };
    let draft = a.draft.as_deref().map(|p| draft_cost(p, &dev, &a, threads)).transpose()?;
    let mut cases = Vec::new();
    // Mixtral-sized shapes take seconds per budget; drawn only on a terminal.
    let pb = indicatif::ProgressBar::new((a.models.len() + a.shape.len() * so.sparsity.len()) as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("plan-sim {bar:30} {pos}/{len} {msg}").expect("valid template"),
    );
    for path in &a.models {
        pb.set_message(path.display().to_string());
        let pack = Pack::open(path)?;
        let m = pack.manifest();
        let s = m.sparse.as_ref().map(|s| s.target_sparsity as f64);
        let name = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let share = pack.unit_share()?;
        cases.extend(simulate(m, &share, &dev, &a, draft.as_ref(), threads, &name, s, &mut notes));
        pb.inc(1);
    }
    for name in &a.shape {
        let shape = sim::shape(name).with_context(|| {
            format!(
                "unknown --shape {name:?}; known: {}",
                sim::SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
            )
        })?;
        for &s in &so.sparsity {
            pb.set_message(format!("{} at sparsity {s}", shape.name));
            let o = SimOptions {
                sparsity: s,
                skew: so.skew,
                quant: so.quant,
                recall: so.recall,
                precision: so.precision,
                predictor_budget: 0.1,
                router_skew: so.router_skew,
            };
            let (m, share) = sim::synthetic_manifest(&shape, &o, &dev)
                .with_context(|| format!("{} cannot be stored as {}", shape.name, so.quant))?;
            cases.extend(simulate(&m, &share, &dev, &a, draft.as_ref(), threads, shape.name, Some(s), &mut notes));
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    if a.json {
        for c in &cases {
            let mut j = serde_json::json!({
                "model": c.label, "sparsity": c.sparsity, "memory_budget_bytes": c.budget, "fixed_bytes": c.fixed,
                "ffn_bytes": c.ffn_bytes, "threads": threads, "ctx": a.ctx,
                "floor_bytes": c.floor, "floor_tokens_per_s": c.floor_tokens_per_s,
            });
            match &c.est {
                Ok(e) => {
                    let more = serde_json::json!({
                        "hot_share": c.hot_share, "hit_rate": e.hit_rate, "hot_hit_rate": e.hot_hit_rate,
                        "read_bytes_per_token": e.read_bytes_per_token, "attention_ms": e.attention_ms,
                        "predictor_ms": e.predictor_ms, "ffn_ms": e.ffn_ms, "lm_head_ms": e.lm_head_ms,
                        "io_ms": e.io_ms, "io_exposed_ms": e.io_exposed_ms, "io_cpu_ms": e.io_cpu_ms,
                        "speculated_layers": e.speculated_layers, "token_ms": e.token_ms(),
                        "tokens_per_s": 1e3 / e.token_ms(), "bound": e.bound(),
                    });
                    j.as_object_mut().expect("object").extend(more.as_object().expect("object").clone());
                }
                Err(why) => j["refused"] = serde_json::json!(why),
            }
            if let (Some(v), Some(sc), Ok(e)) = (verify_of(&a), &c.verify, &c.est) {
                let tps = sc.tokens_per_s(&v);
                j["speculative"] = serde_json::json!({
                    "acceptance": v.acceptance, "draft_tokens": v.draft_tokens,
                    "verify_token_cost": v.token_cost, "union_share": v.union_share,
                    "tokens_per_pass": v.tokens_per_pass(), "pass_ms": sc.pass.token_ms() + sc.draft_ms,
                    "verify_ms": sc.pass.token_ms(), "draft_ms": sc.draft_ms,
                    "draft_bytes": draft.as_ref().map_or(0, |d| d.bytes), "hot_share": sc.hot_share,
                    "neuron_cache_bytes": sc.cache_bytes,
                    "read_bytes_per_pass": sc.pass.read_bytes_per_token, "tokens_per_s": tps,
                    "speedup": tps * e.token_ms() / 1e3,
                });
            }
            println!("{j}");
        }
        for n in &notes {
            message!("note: {n}");
        }
        return all_refused(&cases);
    }
    println!("plan-sim on {} ({threads} threads, ctx {}): decode cost per token", dev.name, a.ctx);
    println!(
        "{:<26} {:>5} {:>9} {:>9} {:>9} {:>6} {:>6} {:>9} {:>9} {:>7} {:>8} {:>8} {:>9} {:>8}{}  bound",
        "model",
        "spars",
        "budget",
        "fixed",
        "FFN",
        "hot",
        "hit",
        "MiB read",
        "compute",
        "I/O",
        "I/O exp",
        "tok/s",
        "floor",
        "at floor",
        if a.acceptance.is_some() { format!(" {:>9} {:>6}", "spec tok/s", "x") } else { String::new() }
    );
    for c in &cases {
        let sp = c.sparsity.map_or("dense".into(), |s| format!("{s:.2}"));
        match &c.est {
            Ok(e) => println!(
                "{:<26} {:>5} {:>9} {:>9} {:>9} {:>5.0}% {:>6.3} {:>9.1} {:>7.1}ms {:>5.1}ms {:>6.1}ms {:>8.2} {:>9} {:>8}{}  {}",
                c.label,
                sp,
                size(c.budget),
                size(c.fixed),
                size(c.ffn_bytes),
                100.0 * c.hot_share,
                e.hit_rate,
                e.read_bytes_per_token / (1u64 << 20) as f64,
                e.compute_ms(),
                e.io_ms,
                e.io_exposed_ms,
                1e3 / e.token_ms(),
                size(c.floor),
                c.floor_tokens_per_s.map_or("-".into(), |t| format!("{t:.2}")),
                match (verify_of(&a), &c.verify) {
                    (Some(v), Some(sc)) => {
                        let tps = sc.tokens_per_s(&v);
                        format!(" {:>10.2} {:>5.2}x", tps, tps * e.token_ms() / 1e3)
                    }
                    _ => String::new(),
                },
                e.bound()
            ),
            Err(why) => println!("{:<26} {:>5} {:>9} refused: {why}", c.label, sp, size(c.budget)),
        }
    }
    let speed = if dev.cpu.q4_0_matvec_gb_s_1t.is_some() {
        format!("the profile's Q4_0 matvec speed at {threads} threads")
    } else {
        format!(
            "half the profile's memory bandwidth shared by {threads} of its {} cores (it has no matvec figures)",
            dev.n_cores()
        )
    };
    let ffn_note = if dev.kernels.is_some() {
        "the FFN bundles at its sparse FFN speed ([kernels])"
    } else {
        "the FFN bundles too (no [kernels] in the profile)"
    };
    let (waste, loss) = (100.0 * cost::SPECULATION_WASTE, cost::OVERLAP_LOSS);
    let attn_note = if dev.kernels.as_ref().is_some_and(|k| k.q4_0_attention_gb_s_1t.is_some()) {
        ", attention weights at its attention-block speed ([kernels])"
    } else {
        ""
    };
    let cpu_note = if dev.read_cpu_s(4096) > 0.0 {
        ", plus each read's CPU time ([kernels] read_cpu_us*) shared by the threads"
    } else {
        ""
    };
    println!("compute: weights touched per token (attention with the KV cache at half the context) / {speed}{attn_note}, {ffn_note}{cpu_note}; I/O: cold misses per token (a layer-ordered LRU: a cluster survives as many whole tokens as the cold region holds) at the profile's random-read bandwidth for the merged read size; I/O exp: the part of it not hidden behind the layer's FFN compute (and its attention where a speculative prefetch runs, as `nflash run --speculate auto` decides: {waste:.0}% extra reads), a layer taking max(compute, reads) + {loss} × the smaller (the I/O threads share the cores); bound: flash I/O when I/O exp is over half the token, compute + I/O over a fifth, else compute; floor: the least memory pressure can take the budget to (the fixed region and one layer's clusters, nothing hot), and at floor its tokens/s");
    if let Some(v) = verify_of(&a) {
        println!(
            "spec tok/s: speculative decoding, verify passes of {} drafted tokens, a share of {} of them accepted ({:.2} tokens per pass), {}; a pass reads its weights once and the union of its tokens' cold clusters ({}), and computes {} of a decode token's work per token beyond the first; x: against plain decode",
            v.draft_tokens,
            v.acceptance,
            v.tokens_per_pass(),
            match (&a.draft, &draft) {
                (Some(p), Some(d)) => format!(
                    "the draft pack {} held in each budget ({}, out of the model's neuron cache), {} of its passes per verify pass at {:.2} ms each",
                    p.display(),
                    size(d.bytes),
                    v.draft_tokens,
                    d.pass_ms
                ),
                _ => "the draft free (prompt lookup)".into(),
            },
            v.union_share.map_or("tokens independent".into(), |u| format!("{u} of the clusters they need in all")),
            v.token_cost
        );
    }
    let mut seen = std::collections::HashSet::new();
    for n in notes.iter().filter(|n| seen.insert(n.as_str())) {
        println!("note: {n}");
    }
    all_refused(&cases)
}

/// Fails when the planner refused every case: nothing was priced (the
/// rows say why).
fn all_refused(cases: &[Case]) -> Result<()> {
    if !cases.is_empty() && cases.iter().all(|c| c.est.is_err()) {
        bail!("every budget was refused (see the rows): give a larger --memory-budget or --ffn-share");
    }
    Ok(())
}
