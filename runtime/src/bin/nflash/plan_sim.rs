//! `nflash plan-sim`: predict decode tokens/s of a pack or a model shape on a
//! device profile, without running it (issue 5; PowerInfer-2 §4.4 cost model).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use nflash_format::{DType, DeviceProfile, Manifest, Pack, SegmentKind};
use nflash_runtime::planner::{self, Estimate, PlanRequest};
use nflash_runtime::sim::{self, SimOptions};

/// Arguments of `nflash plan-sim`.
#[derive(Args)]
pub struct PlanSimArgs {
    /// Device profile (TOML): flash bandwidth by read size, matvec speed, cores.
    #[arg(long)]
    device: PathBuf,
    /// Packs to simulate (their frequency curves, predictor quality, clusters).
    #[arg(long = "model", value_name = "PACK")]
    models: Vec<PathBuf>,
    /// Model shapes to simulate, comma-separated: llama-7b, mistral-7b, mixtral-47b.
    #[arg(long, value_delimiter = ',')]
    shape: Vec<String>,
    /// Target sparsities of the shapes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.8,0.6")]
    sparsity: Vec<f64>,
    /// Power-law exponent of neuron hotness for the shapes (prep synth's default).
    #[arg(long, default_value_t = 1.5)]
    skew: f64,
    /// Predictor recall of the shapes.
    #[arg(long, default_value_t = 0.99)]
    recall: f64,
    /// Predictor precision of the shapes (measured on the synthetic llama-7b: see README).
    #[arg(long, default_value_t = 0.5)]
    precision: f64,
    /// Weight type of the shapes.
    #[arg(long, default_value = "q4_0")]
    quant: DType,
    /// Memory budgets, comma-separated (e.g. 3GiB,4GiB); default: the fixed
    /// region plus each of --ffn-share of the FFN bytes.
    #[arg(long, value_delimiter = ',', value_parser = nflash_runtime::planner::parse_bytes)]
    memory_budget: Vec<u64>,
    /// Shares of the FFN bytes kept in memory beside the fixed region, used without --memory-budget.
    #[arg(long, value_delimiter = ',', default_value = "1,0.5,0.25")]
    ffn_share: Vec<f64>,
    /// Context length the KV cache is sized for, tokens.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..=1 << 24))]
    ctx: u32,
    /// Compute threads; default: the device's cores.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
}

fn check(a: &PlanSimArgs) -> Result<()> {
    if a.models.is_empty() && a.shape.is_empty() {
        bail!("nothing to simulate: pass --model PACK or --shape NAME (llama-7b, mistral-7b, mixtral-47b)");
    }
    if let Some(s) = a.sparsity.iter().find(|s| !(0.0..1.0).contains(*s)) {
        bail!("--sparsity {s} is outside [0, 1)");
    }
    if let Some(f) = a.ffn_share.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        bail!("--ffn-share {f} is outside [0, 1]");
    }
    if !(a.recall > 0.0 && a.recall <= 1.0 && a.precision > 0.0 && a.precision <= 1.0) {
        bail!("--recall and --precision must be in (0, 1]");
    }
    if !(0.0..=8.0).contains(&a.skew) {
        bail!("--skew {} is outside [0, 8]", a.skew);
    }
    Ok(())
}

/// One simulated case.
struct Case {
    label: String,
    sparsity: String,
    budget: u64,
    ffn_bytes: u64,
    fixed: u64,
    hot_share: f64,
    est: Estimate,
}

fn simulate(m: &Manifest, dev: &DeviceProfile, a: &PlanSimArgs, threads: u32, label: &str, sparsity: String) -> Result<Vec<Case>> {
    let ffn_bytes: u64 = m.segments.iter().filter(|s| s.kind == SegmentKind::Ffn).map(|s| s.bytes).sum();
    let fixed = planner::fixed_region(m, a.ctx, None).total();
    let budgets: Vec<u64> = if a.memory_budget.is_empty() {
        // The planner also needs one layer's clusters to stage reads beyond the fixed region.
        let stage = ffn_bytes / m.ffn.len().max(1) as u64;
        a.ffn_share.iter().map(|f| fixed + ((*f * ffn_bytes as f64) as u64).max(stage) + (1 << 20)).collect()
    } else {
        a.memory_budget.clone()
    };
    let mut out = Vec::new();
    for budget in budgets {
        let req = PlanRequest { budget_bytes: budget, ctx: a.ctx, threads, io_threads: None, measured_rss_bytes: None };
        let p = planner::plan(m, dev, &req).with_context(|| format!("{label} at {:.2} GiB", budget as f64 / (1u64 << 30) as f64))?;
        out.push(Case {
            label: label.to_string(),
            sparsity: sparsity.clone(),
            budget,
            ffn_bytes,
            fixed: p.fixed_bytes,
            hot_share: p.hot_bytes as f64 / ffn_bytes.max(1) as f64,
            est: planner::estimate(m, dev, &p),
        });
    }
    Ok(out)
}

pub fn run(a: PlanSimArgs) -> Result<()> {
    check(&a)?;
    let dev = DeviceProfile::load(&a.device)?;
    let threads = a.threads.unwrap_or_else(|| dev.n_cores());
    let mut cases = Vec::new();
    for path in &a.models {
        let pack = Pack::open(path)?;
        let m = pack.manifest();
        let s = m.sparse.as_ref().map_or("dense".to_string(), |s| format!("{:.2}", s.target_sparsity));
        let name = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        cases.extend(simulate(m, &dev, &a, threads, &name, s)?);
    }
    for name in &a.shape {
        let shape = sim::shape(name).with_context(|| {
            format!("unknown --shape {name:?}; known: {}", sim::SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", "))
        })?;
        for &s in &a.sparsity {
            let o = SimOptions { sparsity: s, skew: a.skew, quant: a.quant, recall: a.recall, precision: a.precision, predictor_budget: 0.1 };
            let m = sim::synthetic_manifest(&shape, &o, &dev).with_context(|| format!("{} cannot be stored as {}", shape.name, a.quant))?;
            cases.extend(simulate(&m, &dev, &a, threads, shape.name, format!("{s:.2}"))?);
        }
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if a.json {
        for c in &cases {
            let e = &c.est;
            println!(
                "{}",
                serde_json::json!({
                    "model": c.label, "sparsity": c.sparsity, "memory_budget_bytes": c.budget, "fixed_bytes": c.fixed,
                    "ffn_bytes": c.ffn_bytes, "hot_share": c.hot_share, "hit_rate": e.hit_rate,
                    "read_bytes_per_token": e.read_bytes_per_token, "attention_ms": e.attention_ms,
                    "predictor_ms": e.predictor_ms, "ffn_ms": e.ffn_ms, "lm_head_ms": e.lm_head_ms,
                    "io_ms": e.io_ms, "io_exposed_ms": e.io_exposed_ms, "token_ms": e.token_ms(),
                    "tokens_per_s": 1e3 / e.token_ms(), "bound": e.bound(),
                })
            );
        }
        return Ok(());
    }
    println!("plan-sim on {} ({threads} threads, ctx {}): decode cost per token", dev.name, a.ctx);
    println!(
        "{:<26} {:>5} {:>8} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9} {:>7} {:>8} {:>8}  bound",
        "model", "spars", "budget", "fixed", "FFN", "hot", "hit", "MiB read", "compute", "I/O", "I/O exp", "tok/s"
    );
    for c in &cases {
        let e = &c.est;
        println!(
            "{:<26} {:>5} {:>6.2}Gi {:>6.2}Gi {:>6.2}Gi {:>5.0}% {:>6.3} {:>9.1} {:>7.1}ms {:>5.1}ms {:>6.1}ms {:>8.2}  {}",
            c.label,
            c.sparsity,
            gib(c.budget),
            gib(c.fixed),
            gib(c.ffn_bytes),
            100.0 * c.hot_share,
            e.hit_rate,
            e.read_bytes_per_token / (1u64 << 20) as f64,
            e.compute_ms(),
            e.io_ms,
            e.io_exposed_ms,
            1e3 / e.token_ms(),
            e.bound()
        );
    }
    println!("compute: weights touched per token / the profile's Q4_0 matvec speed at {threads} threads; I/O: expected cold misses (Che's LRU approximation) at the profile's random-read bandwidth for the merged read size; I/O exp: the part not hidden behind the layer's FFN compute");
    Ok(())
}
