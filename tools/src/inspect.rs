//! `prep inspect`: describe a pack.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nflash_format::{DType, Manifest, Pack, SegmentKind};

/// Arguments of `prep inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// The .nflash pack.
    file: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(a: InspectArgs) -> Result<()> {
    let pack = Pack::open(&a.file)?;
    let h = pack.header();
    let m = pack.manifest();
    let resident_bytes: u64 = m.tensors.iter().map(|t| t.bytes).sum();
    let ffn_bytes: u64 = m.segments.iter().filter(|s| s.kind == SegmentKind::Ffn).map(|s| s.bytes).sum();
    let mut types: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in &m.tensors {
        let e = types.entry(t.dtype.to_string()).or_default();
        e.0 += 1;
        e.1 += t.bytes;
    }
    let ffn_dtype = m.ffn.first().map(|f| f.bundle.dtype.to_string());
    let quant = m.ffn.first().map_or(DType::F32, |f| f.bundle.dtype);
    let fallback =
        crate::pack::f16_fallback(quant, m.tensors.iter().map(|t| (t.name.clone(), t.shape.clone(), t.dtype)));
    let meta = pack.metadata()?;
    let clusters: usize = m.ffn.iter().map(|f| f.clusters.len()).sum();
    if a.json {
        let segs: Vec<_> = m
            .segments
            .iter()
            .map(|s| serde_json::json!({"name": s.name, "offset": s.offset, "bytes": s.bytes, "kind": format!("{:?}", s.kind), "crc32": s.crc32}))
            .collect();
        let j = serde_json::json!({
            "file": a.file,
            "file_bytes": pack.file_len(),
            "version": format!("{}.{}", h.major, h.minor),
            "alignment": h.alignment,
            "producer": m.producer,
            "config": serde_json::to_value(&m.config)?,
            "chat_template": m.tokenizer.chat_template.is_some(),
            "segments": segs,
            "resident_bytes": resident_bytes,
            "ffn_bytes": ffn_bytes,
            "ffn_dtype": ffn_dtype,
            "ffn_clusters": clusters,
            "sparse": sparse_json(m),
            "plan": m.plan.as_ref().map(serde_json::to_value).transpose()?,
            "f16_fallback": fallback.iter().map(|(name, (n, cols, _))| serde_json::json!({"tensors": name, "count": n, "row_elements": cols})).collect::<Vec<_>>(),
            "metadata": serde_json::to_value(&meta)?,
            "tensor_types": types.iter().map(|(k, (n, b))| (k.clone(), serde_json::json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{}: nflash pack v{}.{}, {:.1} MiB, alignment {} bytes, by {}",
        a.file.display(),
        h.major,
        h.minor,
        mib(pack.file_len()),
        h.alignment,
        m.producer
    );
    let c = &m.config;
    let rope = match c.rope_scaling {
        None => "none".to_string(),
        Some(nflash_format::RopeScaling::Linear { factor }) => format!("linear ×{factor}"),
        Some(nflash_format::RopeScaling::Llama3 { factor, .. }) => format!("llama3 ×{factor}"),
        Some(nflash_format::RopeScaling::LongRope { original_max_position_embeddings, attention_factor, .. }) => {
            format!("longrope (long factors past {original_max_position_embeddings} tokens, attention ×{attention_factor:.4})")
        }
    };
    println!(
        "model: {}, {} layers, hidden {}, FFN {}, {} heads / {} KV heads, head_dim {}, vocab {}",
        c.family_and_activation(),
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
    );
    println!(
        "       RoPE theta {}, scaling {rope}, context {} tokens{}, embeddings {}",
        c.rope_theta,
        c.max_position_embeddings,
        c.sliding_window.map_or(String::new(), |w| format!(", sliding window {w}")),
        if c.tie_word_embeddings { "tied" } else { "untied" }
    );
    if let nflash_format::Architecture::SmolLm3(_) = c.architecture {
        let nope: Vec<String> =
            (0..c.num_layers as usize).filter(|&l| !c.layer_uses_rope(l)).map(|l| l.to_string()).collect();
        println!("       NoPE layers (no RoPE): {}", if nope.is_empty() { "none".into() } else { nope.join(", ") });
    }
    if c.rotary_dim() != c.head_dim {
        println!(
            "       RoPE on the first {} of each head's {} elements (partial_rotary_factor)",
            c.rotary_dim(),
            c.head_dim
        );
    }
    if c.qk_norm() {
        println!("       RMSNorm on each query and key head (q_norm, k_norm)");
    }
    if let Some(g) = c.gemma3() {
        let list = |global: bool| -> String {
            let l: Vec<String> = (0..c.num_layers as usize)
                .filter(|&l| g.sliding_layers.contains(l) != global)
                .map(|l| l.to_string())
                .collect();
            if l.is_empty() {
                "none".into()
            } else {
                l.join(", ")
            }
        };
        println!(
            "       sliding-window layers (local RoPE theta {}): {}; global layers: {}",
            g.rope_local_base_freq,
            list(false),
            list(true)
        );
        println!(
            "       attention scale 1/√{} (query_pre_attn_scalar), embeddings × √{}, norms after attention and FFN too, stored as 1 + w",
            g.query_pre_attn_scalar, c.hidden_size
        );
    }
    if let Some(moe) = c.architecture.moe() {
        println!(
            "       mixture of experts: {} experts per layer (FFN {} each), {} per token{}",
            moe.num_experts,
            c.intermediate_size,
            moe.experts_per_token,
            if moe.norm_topk_prob { ", weights renormalized" } else { "" }
        );
    }
    let g = meta.generation.clone().unwrap_or_default();
    // Where each default of `nflash run` comes from (flags override all).
    let src =
        if h.minor < 2 { "nflash default; packs before 3.2 do not record the checkpoint's" } else { "nflash default" };
    let pick = |v: Option<String>, default: &str| match v {
        Some(v) => format!("{v} (generation_config.json)"),
        None => format!("{default} ({src})"),
    };
    println!(
        "sampling defaults: temperature {}, top-k {}, top-p {}; nflash run flags override them",
        pick(g.temperature.map(|t| t.to_string()), "0.8"),
        pick(g.top_k.map(|k| k.to_string()), "40"),
        pick(g.top_p.map(|p| p.to_string()), "0.95"),
    );
    let bos = c.bos_token_id.map_or("none".to_string(), |b| b.to_string());
    let eos: Vec<String> = c.eos_token_ids.iter().map(|e| e.to_string()).collect();
    println!(
        "tokens: bos {bos}, eos {}, chat template {}",
        if eos.is_empty() { "none".to_string() } else { eos.join(", ") },
        if m.tokenizer.chat_template.is_some() { "yes" } else { "no" }
    );
    println!("resident tensors: {} ({:.2} MiB)", m.tensors.len(), mib(resident_bytes));
    for (k, (n, b)) in &types {
        println!("  {k:>5}: {n} tensors, {:.2} MiB", mib(*b));
    }
    if let Some(f) = m.ffn.first() {
        for (name, (n, cols, _)) in &fallback {
            println!(
                "  f16 fallback: {name} ({n} tensor{}): rows of {cols} elements are not whole 32-element {} blocks",
                if *n == 1 { "" } else { "s" },
                f.bundle.dtype
            );
        }
        println!(
            "FFN: {} {} × {} neurons as {} bundles of {} bytes, {} neuron clusters in all, {:.2} MiB",
            m.ffn.len(),
            if c.architecture.moe().is_some() { "experts" } else { "layers" },
            f.n_neurons,
            f.bundle.dtype,
            f.bundle.bundle_bytes,
            clusters,
            mib(ffn_bytes)
        );
    }
    print_sparse(m, meta.experts.as_ref().map(|e| &e.routed_share[..]));
    match &m.plan {
        Some(p) => println!("{}", nflash_plan::planner::describe(p, m)),
        None => {
            println!("plan: none (convert with --device PROFILE [--memory-budget SIZE] to plan memory for a device)")
        }
    }
    println!("segments:");
    let ffn_segs: Vec<_> = m.segments.iter().filter(|s| s.kind == SegmentKind::Ffn).collect();
    for s in m.segments.iter().filter(|s| s.kind != SegmentKind::Ffn) {
        println!("  {:<12} offset {:>12}  {:>12} bytes", s.name, s.offset, s.bytes);
    }
    if let (Some(first), Some(last)) = (ffn_segs.first(), ffn_segs.last()) {
        println!(
            "  {:<12} offset {:>12}  {:>12} bytes  ({} FFN segments {}..{}, --json lists each)",
            "ffn.*",
            first.offset,
            ffn_bytes,
            ffn_segs.len(),
            first.name,
            last.name
        );
    }
    Ok(())
}

/// The sparsity settings and per-layer profile summary (SPEC §4.5), or null.
fn sparse_json(m: &Manifest) -> serde_json::Value {
    let Some(si) = &m.sparse else { return serde_json::Value::Null };
    let layers: Vec<_> = m
        .ffn
        .iter()
        .filter_map(|f| f.sparse.as_ref().map(|s| (f.layer, s)))
        .map(|(l, s)| {
            serde_json::json!({
                "layer": l,
                "threshold": s.threshold,
                "predictor_threshold": s.predictor_threshold,
                "predictor_bytes": s.predictor_bytes,
                "recall": s.quality.recall,
                "precision": s.quality.precision,
                "bundles_skipped": s.quality.bundles_skipped,
                "sparsity": s.quality.sparsity,
                "frequency_curve": s.frequency_curve,
            })
        })
        .collect();
    serde_json::json!({
        "criterion": si.criterion.name(),
        "predictor": si.predictor.name(),
        "rank": si.rank,
        "target_sparsity": si.target_sparsity,
        "recall_target": si.recall_target,
        "calib_tokens": si.calib_tokens,
        "calib_source": si.calib_source,
        "predictor_bytes": m.ffn.iter().filter_map(|f| f.sparse.as_ref()).map(|s| s.predictor_bytes).sum::<u64>(),
        "layers": layers,
    })
}

/// Text form of [`sparse_json`]: settings, then one line per FFN unit (layer,
/// or expert `layer.expert` with its routed share of the tokens) with the
/// held-out predictor quality and the hot-first activation frequency curve.
fn print_sparse(m: &Manifest, routed_share: Option<&[f32]>) {
    let Some(si) = &m.sparse else {
        println!("sparsity: none (dense pack; convert with --calib for sparse decode)");
        return;
    };
    let pred_bytes: u64 = m.ffn.iter().filter_map(|f| f.sparse.as_ref()).map(|s| s.predictor_bytes).sum();
    println!(
        "sparsity: criterion {}, target {:.0}%, predictor {}{} ({:.2} MiB), recall target {:.2}, calibrated on {} tokens of {}",
        si.criterion.name(),
        100.0 * si.target_sparsity,
        si.predictor.name(),
        if si.rank > 0 { format!(" rank {}", si.rank) } else { String::new() },
        pred_bytes as f64 / (1 << 20) as f64,
        si.recall_target,
        si.calib_tokens,
        si.calib_source
    );
    let moe = m.config.architecture.moe().is_some();
    if moe {
        println!("  (per expert, over the tokens routed to it; routed: its share of the tokens; no predictor: too few calibration tokens to train one, every neuron read)");
    }
    println!(
        "  {}  threshold  sparsity  recall  precision  skipped  activation frequency, hottest → coldest (9 of 33 points)",
        if moe { "expert  routed" } else { "layer" }
    );
    for (u, f) in m.ffn.iter().enumerate() {
        let Some(s) = &f.sparse else { continue };
        let q = &s.quality;
        let curve: Vec<String> = s.frequency_curve.iter().step_by(4).map(|v| format!("{v:.2}")).collect();
        let unit = if moe {
            let share = routed_share.and_then(|r| r.get(u)).map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
            format!("{:>6}  {share:>6}", m.config.unit_name(u))
        } else {
            format!("{:>5}", f.layer)
        };
        let note = if q.tokens == 0 && s.predictor_threshold == f32::MIN { "  (no predictor)" } else { "" };
        println!(
            "  {}  {:>9.3e}  {:>7.1}%  {:>6.3}  {:>9.3}  {:>6.1}%  {}{note}",
            unit,
            s.threshold,
            100.0 * q.sparsity,
            q.recall,
            q.precision,
            100.0 * q.bundles_skipped,
            curve.join(" ")
        );
    }
}
