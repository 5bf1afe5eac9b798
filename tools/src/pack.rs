//! Laying a checkpoint out as a pack: resident tensors, then one FFN segment
//! per layer of page-aligned neuron clusters of bundles
//! (gate row | up row | down column), as SPEC §4.4 prescribes.

use std::borrow::Cow;

use anyhow::{anyhow, bail, Result};
use nflash_format::{
    BundleLayout, DType, FfnLayer, LayerSparsity, Manifest, ModelConfig, NeuronCluster, PackWriter, SegmentKind,
    TensorEntry, TokenizerInfo,
};
use nflash_runtime::kernels::quantize_row;
use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::sparsify::SparsePlan;
use nflash_runtime::message;

/// Layout choices for a pack.
pub struct PackOptions {
    /// Type of weight matrices (attention, embeddings, FFN bundles).
    pub quant: DType,
    /// Target bytes per neuron cluster.
    pub cluster_bytes: u64,
    /// Alignment of cluster offsets, bytes (flash page).
    pub cluster_align: u64,
    /// Segment alignment, bytes.
    pub alignment: u32,
}

/// One resident tensor to write: HF name, shape, type.
struct Resident {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
}

/// The type a matrix is stored as: `quant`, or F16 when its rows are not a
/// whole number of 32-element blocks.
fn matrix_dtype(quant: DType, cols: usize) -> DType {
    if quant.row_bytes(cols as u64).is_some() {
        quant
    } else {
        DType::F16
    }
}

fn resident_list(cfg: &ModelConfig, quant: DType) -> Vec<Resident> {
    let (h, v) = (cfg.hidden_size as usize, cfg.vocab_size as usize);
    let qd = (cfg.num_heads * cfg.head_dim) as usize;
    let kvd = (cfg.num_kv_heads * cfg.head_dim) as usize;
    let inter = cfg.intermediate_size as usize;
    let mat = |name: String, rows: usize, cols: usize| Resident {
        name,
        shape: vec![rows, cols],
        dtype: matrix_dtype(quant, cols),
    };
    let vec32 = |name: String, n: usize| Resident { name, shape: vec![n], dtype: DType::F32 };
    let mut out = vec![mat("model.embed_tokens.weight".into(), v, h)];
    let qkv_bias = cfg.attention_bias || cfg.architecture == nflash_format::Architecture::Qwen2;
    let o_bias = cfg.attention_bias && cfg.architecture != nflash_format::Architecture::Qwen2;
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        out.extend(cfg.layer_norms(l as usize).all().map(|name| vec32(name.clone(), h)));
        out.push(mat(format!("{p}.self_attn.q_proj.weight"), qd, h));
        out.push(mat(format!("{p}.self_attn.k_proj.weight"), kvd, h));
        out.push(mat(format!("{p}.self_attn.v_proj.weight"), kvd, h));
        out.push(mat(format!("{p}.self_attn.o_proj.weight"), h, qd));
        if cfg.qk_norm() {
            out.push(vec32(format!("{p}.self_attn.q_norm.weight"), cfg.head_dim as usize));
            out.push(vec32(format!("{p}.self_attn.k_norm.weight"), cfg.head_dim as usize));
        }
        if let (Some(router), Some(moe)) = (cfg.router_name(l as usize), cfg.architecture.moe()) {
            // Kept in f32, as llama.cpp keeps `ffn_gate_inp`: routing is exact.
            out.push(Resident { name: router, shape: vec![moe.num_experts as usize, h], dtype: DType::F32 });
        }
        if qkv_bias {
            out.push(vec32(format!("{p}.self_attn.q_proj.bias"), qd));
            out.push(vec32(format!("{p}.self_attn.k_proj.bias"), kvd));
            out.push(vec32(format!("{p}.self_attn.v_proj.bias"), kvd));
        }
        if o_bias {
            out.push(vec32(format!("{p}.self_attn.o_proj.bias"), h));
        }
        if cfg.mlp_bias {
            out.push(vec32(format!("{p}.mlp.gate_proj.bias"), inter));
            out.push(vec32(format!("{p}.mlp.up_proj.bias"), inter));
            out.push(vec32(format!("{p}.mlp.down_proj.bias"), h));
        }
    }
    out.push(vec32("model.norm.weight".into(), h));
    if !cfg.tie_word_embeddings {
        out.push(mat("lm_head.weight".into(), v, h));
    }
    out
}

/// Every tensor the pack needs, with its expected shape: checked before
/// anything is written so a bad checkpoint never leaves a partial file.
pub fn check_tensors(ck: &Checkpoint) -> Result<()> {
    let cfg = &ck.config;
    let (h, inter) = (cfg.hidden_size as usize, cfg.intermediate_size as usize);
    if !cfg.tie_word_embeddings && !ck.has("lm_head.weight") {
        bail!("config.json says tie_word_embeddings: false but the checkpoint has no lm_head.weight; fix the config (set it to true if the output layer shares the embedding) or supply the missing shard");
    }
    let config = ck.config_name();
    let mut need: Vec<(String, Vec<usize>)> =
        resident_list(cfg, DType::F32).into_iter().map(|r| (r.name, r.shape)).collect();
    for u in 0..cfg.ffn_units() as usize {
        let [gate, up, down] = cfg.ffn_tensor_names(u);
        need.push((gate, vec![inter, h]));
        need.push((up, vec![inter, h]));
        need.push((down, vec![h, inter]));
    }
    for (name, shape) in &need {
        let got = ck.shape(name)?;
        if got != *shape {
            bail!("tensor {} has shape {got:?}, but {config} implies {shape:?}", ck.source_of(name));
        }
    }
    // Weights nothing reads: transformers loads such a checkpoint with a
    // warning, and so does prep (they often mean config.json describes
    // another model, e.g. fewer layers).
    let used: std::collections::HashSet<&str> = need.iter().map(|(n, _)| ck.source_of(n)).collect();
    let unused = ck.unused_tensors(&used);
    if !unused.is_empty() {
        let some = unused.iter().take(4).cloned().collect::<Vec<_>>().join(", ");
        let more = if unused.len() > 4 { format!(" and {} more", unused.len() - 4) } else { String::new() };
        if let Some(g) = ck.gguf() {
            // llama.cpp refuses such a file too ("wrong number of tensors").
            bail!(
                "{} holds {} tensors its metadata does not describe ({some}{more}): the metadata (e.g. block_count) and the tensors disagree; the file is corrupt or was edited: convert the model again",
                g.path().display(),
                unused.len()
            );
        }
        nflash_runtime::message!(
            "warning: the checkpoint holds {} tensors the model described by config.json does not use ({some}{more}); they are left out: check that config.json belongs to these weights",
            unused.len()
        );
    }
    Ok(())
}

fn bar(len: u64, msg: &str) -> crate::progress::Progress {
    let pb = crate::progress::Progress::new(
        len,
        "{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} {per_sec} eta {eta}",
        "quantize + pack",
    );
    pb.set_message(msg.to_string());
    pb
}

/// Writes the pack for `ck` to `out` (temporary file + rename).
///
/// With a `plan`, FFN neurons are stored in its hot-first order (gate/up
/// biases permuted to match), predictor tensors `nflash.predictor.{l}.*` join
/// the resident segment (rows of `[n_neurons, ·]` tensors permuted), and the
/// manifest carries the sparsity settings (SPEC §4.5).
/// Plans memory for a finished manifest (segments filled in); see `nflash_runtime::planner`.
pub type Planner<'p> = &'p dyn Fn(&Manifest) -> Result<nflash_format::Plan>;

pub fn write_pack(
    ck: &Checkpoint,
    out: &std::path::Path,
    opts: &PackOptions,
    plan: Option<&SparsePlan>,
    planner: Option<Planner>,
) -> Result<()> {
    let cfg = ck.config.clone();
    let (h, inter) = (cfg.hidden_size as usize, cfg.intermediate_size as usize);
    let layout = BundleLayout::new(opts.quant, h as u64).ok_or_else(|| {
        anyhow!(
            "hidden_size {h} is not a multiple of 32, so FFN bundles cannot be stored as {}; use --quant f16 or f32",
            opts.quant
        )
    })?;
    let mut w = PackWriter::create(out, opts.alignment)?;
    for p in w.stale_removed() {
        message!("note: removed {}, the partial output of a conversion that was killed", p.display());
    }
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = Some(w.temp_path().to_path_buf());

    // Tokenizer segment.
    let tok_z = zstd::bulk::compress(&ck.tokenizer_json, 19)?;
    w.begin_segment("tokenizer", SegmentKind::Tokenizer)?;
    w.write(&tok_z)?;
    w.end_segment()?;

    // Metadata (SPEC §4.9): the checkpoint's sampling defaults.
    let meta = nflash_format::Metadata {
        generation: Some(ck.generation.clone()).filter(|g| !g.is_empty()),
        experts: plan
            .and_then(|p| p.routed_share.clone())
            .map(|routed_share| nflash_format::ExpertStats { routed_share }),
    };
    w.begin_segment("metadata", SegmentKind::Metadata)?;
    w.write(&serde_json::to_vec(&meta)?)?;
    w.end_segment()?;

    // Resident tensors.
    let residents = resident_list(&cfg, opts.quant);
    report_f16_fallback(&residents, opts.quant);
    let units = cfg.ffn_units() as usize;
    let pb = bar((residents.len() + units) as u64, "convert");
    w.begin_segment("resident", SegmentKind::Resident)?;
    let seg_idx = w.segments().len() as u32;
    let mut tensors = Vec::with_capacity(residents.len());
    let mut buf = Vec::new();
    let mut gguf = GgufReport::default();
    for r in &residents {
        pb.set_message(short(&r.name));
        if let Some(bytes) = ck.blocks(&r.name, &r.shape, r.dtype)? {
            // The GGUF's own Q4_0/Q8_0 blocks, unchanged.
            check_scales(ck.source_of(&r.name), r.dtype, &bytes)?;
            write_bytes(&mut w, seg_idx, &r.name, &r.shape, r.dtype, &bytes, &mut tensors)?;
            gguf.copied += 1;
            pb.inc(1);
            continue;
        }
        let lossy = r.shape.len() == 2 && gguf.note_requantized(ck, &r.name, r.dtype)?;
        let mut data = ck.tensor_f32(&r.name, &r.shape)?;
        check_range(&r.name, &r.shape, &data, r.dtype)?;
        if let (Some(plan), Some(l)) = (plan, ffn_bias_layer(&r.name)) {
            data = permute_rows(&data, 1, &plan.layers[l].order);
        }
        write_tensor(&mut w, seg_idx, &r.name, &r.shape, r.dtype, &data, &mut buf, &mut tensors)?;
        if lossy {
            let cols = *r.shape.last().expect("a matrix");
            let rb = r.dtype.row_bytes(cols as u64).expect("quantized rows") as usize;
            for (x, q) in data.chunks(cols).zip(buf.chunks(rb)) {
                gguf.lossy_error.add(r.dtype, x, q);
            }
        }
        pb.inc(1);
    }
    let mut predictor_bytes = vec![0u64; units];
    if let Some(plan) = plan {
        let pd = crate::sparsify::predictor_dtype(opts.quant);
        for (l, lp) in plan.layers.iter().enumerate() {
            for (suffix, shape, data) in &lp.tensors {
                // Tensors with a row per neuron follow the packed order.
                let data = if matches!(*suffix, "gate" | "up" | "w2" | "b2") {
                    Cow::Owned(permute_rows(data, shape[1..].iter().product(), &lp.order))
                } else {
                    Cow::Borrowed(data)
                };
                let dtype = if shape.len() == 1 { DType::F32 } else { matrix_dtype(pd, shape[1]) };
                let name = format!("nflash.predictor.{}.{suffix}", cfg.unit_name(l));
                check_range(&name, shape, &data, dtype)?;
                write_tensor(&mut w, seg_idx, &name, shape, dtype, &data, &mut buf, &mut tensors)?;
                predictor_bytes[l] += tensors.last().map_or(0, |t| t.bytes);
            }
        }
    }
    w.end_segment()?;

    // FFN neuron clusters, one segment per FFN unit (layer, or expert of a layer).
    let per_cluster = neurons_per_cluster(opts.cluster_bytes, layout.bundle_bytes, inter as u64) as usize;
    let mut ffn = Vec::with_capacity(units);
    let mut cluster_crcs = Vec::new();
    // `l` indexes the plan's units as well.
    #[allow(clippy::needless_range_loop)]
    for l in 0..units {
        let unit = cfg.unit_name(l);
        pb.set_message(format!("ffn.{unit}"));
        let names = cfg.ffn_tensor_names(l);
        // Gate and up rows: the GGUF's blocks where it stores them as
        // --quant (bit for bit), else quantized from f32.
        let mut rows = Vec::with_capacity(2);
        for name in &names[..2] {
            rows.push(match ck.blocks(name, &[inter, h], opts.quant)? {
                Some(b) => {
                    check_scales(ck.source_of(name), opts.quant, &b)?;
                    gguf.copied += 1;
                    FfnRows::Blocks(b)
                }
                None => {
                    let lossy = gguf.note_requantized(ck, name, opts.quant)?;
                    let t = ck.tensor_f32(name, &[inter, h])?; // [inter, hidden]
                    check_range(name, &[inter, h], &t, opts.quant)?;
                    FfnRows::F32(t, lossy)
                }
            });
        }
        let (gate, up) = (&rows[0], &rows[1]);
        // The down projection is stored per neuron along hidden (SPEC
        // §4.4); a GGUF's blocks run along n_ff, so it is always requantized.
        let down = ck.tensor_f32(&names[2], &[h, inter])?; // [hidden, inter]
        check_range(&names[2], &[h, inter], &down, opts.quant)?;
        gguf.note_down(ck, &names[2])?;

        // The error requantizing a GGUF's down projection adds (none into f32).
        let measure_down = ck.gguf().is_some() && opts.quant != DType::F32;
        // Packed order: hot first for a sparse pack, original order for a dense one.
        let order: Vec<u32> = plan.map_or_else(|| (0..inter as u32).collect(), |p| p.layers[l].order.clone());
        let bundles: Vec<Vec<u8>> = order
            .par_iter()
            .map(|&i| {
                let i = i as usize;
                let mut b = Vec::with_capacity(layout.bundle_bytes as usize);
                gate.push_row(opts.quant, i, h, &mut b, &gguf.lossy_error);
                up.push_row(opts.quant, i, h, &mut b, &gguf.lossy_error);
                let col: Vec<f32> = (0..h).map(|j| down[j * inter + i]).collect();
                quantize_row(opts.quant, &col, &mut b);
                if measure_down {
                    gguf.down_error.add(opts.quant, &col, &b[b.len() - layout.row_bytes as usize..]);
                }
                debug_assert_eq!(b.len() as u64, layout.bundle_bytes);
                b
            })
            .collect();
        let seg_name = format!("ffn.{unit}");
        w.begin_segment(&seg_name, SegmentKind::Ffn)?;
        let seg = w.segments().len() as u32;
        let mut clusters = Vec::new();
        for (ci, chunk) in bundles.chunks(per_cluster).enumerate() {
            let offset = w.pad_segment_to(opts.cluster_align)?;
            // The cluster's CRC-32C covers its bundles, not the padding (SPEC §4.10).
            let mut crc = nflash_format::ClusterHasher::default();
            for b in chunk {
                crc.update(b);
                w.write(b)?;
            }
            cluster_crcs.push(crc.finish());
            clusters.push(NeuronCluster { offset, first: (ci * per_cluster) as u32, n_neurons: chunk.len() as u32 });
        }
        w.end_segment()?;
        ffn.push(FfnLayer {
            layer: cfg.unit_layer_expert(l).0 as u32,
            segment: seg,
            n_neurons: inter as u32,
            bundle: layout,
            cluster_align: opts.cluster_align,
            clusters,
            order,
            sparse: plan.map(|p| LayerSparsity { predictor_bytes: predictor_bytes[l], ..p.layers[l].sparse.clone() }),
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    if ck.gguf().is_some() {
        gguf.report(opts.quant);
    }

    // Every cluster's checksum, so the runtime checks each one it reads (SPEC §4.10).
    w.begin_segment(nflash_format::checksums::SEGMENT_NAME, SegmentKind::ClusterChecksums)?;
    w.write(&nflash_format::checksums::encode(&cluster_crcs))?;
    w.end_segment()?;

    let tc = &ck.tokenizer_config;
    let manifest = Manifest {
        producer: format!("prep {}", env!("CARGO_PKG_VERSION")),
        config: cfg,
        tokenizer: TokenizerInfo {
            segment: "tokenizer".into(),
            json_bytes: ck.tokenizer_json.len() as u64,
            chat_template: chat_template(tc),
            bos_token: special_token(tc, "bos_token"),
            eos_token: special_token(tc, "eos_token"),
            add_bos_token: add_bos_token(ck)?,
        },
        segments: Vec::new(),
        tensors,
        ffn,
        sparse: plan.map(|p| p.info.clone()),
        plan: None,
    };
    let mut manifest = manifest;
    if let Some(planner) = planner {
        // The planner needs the segment sizes, known now that every segment is written.
        let mut full = manifest.clone();
        full.segments = w.segments().to_vec();
        let p = planner(&full)?;
        message!("{}", nflash_plan::planner::describe(&p, &full));
        manifest.plan = Some(p);
    }
    let result = w.finish(manifest);
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    result?;
    Ok(())
}

/// Neurons per cluster for a target of `cluster_bytes`: whole bundles of
/// `bundle_bytes`, at least one, at most the layer's `n_neurons`.
pub fn neurons_per_cluster(cluster_bytes: u64, bundle_bytes: u64, n_neurons: u64) -> u64 {
    (cluster_bytes / bundle_bytes.max(1)).clamp(1, n_neurons.max(1))
}

/// Largest magnitude `dtype` can store: F16's largest finite value, and for
/// Q8_0/Q4_0 the block maximum whose F16 scale (`max/127`, `max/8`) stays finite.
fn max_storable(dtype: DType) -> f32 {
    let f16_max = f32::from(half::f16::MAX);
    match dtype {
        DType::F32 => f32::MAX,
        DType::F16 => f16_max,
        DType::Q8_0 => f16_max * 127.0,
        DType::Q4_0 => f16_max * 8.0,
    }
}

/// Refuses a value of tensor `name` (`shape`) that `dtype` cannot store
/// (it would become infinite), naming the first one.
///
/// # Errors
/// The tensor, the element (flat and by coordinates), the value and the limit.
fn check_range(name: &str, shape: &[usize], data: &[f32], dtype: DType) -> Result<()> {
    let max = max_storable(dtype);
    let Some(i) = data.iter().position(|v| v.is_nan() || v.abs() > max) else { return Ok(()) };
    bail!(
        "tensor {name} holds {} at element {i} (index {:?} of shape {shape:?}), beyond what {dtype} can store (|x| ≤ {max}); the checkpoint is damaged, or convert with --quant f32",
        data[i],
        crate::checkpoint::unravel(i, shape)
    )
}

/// The matrices among `tensors` (name, shape, stored type) that a pack of
/// `quant` stores as F16 because their rows are not whole 32-element blocks
/// (e.g. `o_proj` with head_dim 20 under Q4_0), grouped by name with the
/// layer index as `*`: pattern → (tensors, row elements, bytes). Empty unless
/// `quant` is Q4_0 or Q8_0. Used by `prep convert` and `prep inspect`.
pub fn f16_fallback(
    quant: DType,
    tensors: impl IntoIterator<Item = (String, Vec<u64>, DType)>,
) -> std::collections::BTreeMap<String, (usize, u64, u64)> {
    let mut groups = std::collections::BTreeMap::new();
    if !matches!(quant, DType::Q4_0 | DType::Q8_0) {
        return groups;
    }
    for (name, shape, _) in tensors.into_iter().filter(|(_, shape, dtype)| shape.len() == 2 && *dtype == DType::F16) {
        let e = groups.entry(layer_pattern(&name)).or_insert((0, shape[1], 0));
        e.0 += 1;
        e.2 += DType::F16.tensor_bytes(&shape).unwrap_or(0);
    }
    groups
}

/// Says which matrices are stored as F16 although `quant` was asked for ([`f16_fallback`]).
fn report_f16_fallback(residents: &[Resident], quant: DType) {
    let tensors = residents.iter().map(|r| (r.name.clone(), r.shape.iter().map(|&d| d as u64).collect(), r.dtype));
    for (name, (n, cols, bytes)) in f16_fallback(quant, tensors) {
        message!(
            "{name} ({n} tensor{}, {:.2} MiB) stored as f16, not {quant}: its rows of {cols} elements are not whole 32-element blocks",
            if n == 1 { "" } else { "s" },
            bytes as f64 / (1 << 20) as f64
        );
    }
}

/// `model.layers.7.self_attn.o_proj.weight` → `model.layers.*.self_attn.o_proj.weight`.
fn layer_pattern(name: &str) -> String {
    match name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) {
        Some((l, rest)) if l.parse::<u32>().is_ok() => format!("model.layers.*.{rest}"),
        _ => name.to_string(),
    }
}

/// Layer of an FFN gate/up bias tensor name (those follow the neuron order).
fn ffn_bias_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, tail) = rest.split_once('.')?;
    matches!(tail, "mlp.gate_proj.bias" | "mlp.up_proj.bias").then(|| l.parse().ok())?
}

/// Rows of `data` (`[n, cols]`) in `order`: row `p` of the result is row `order[p]`.
fn permute_rows(data: &[f32], cols: usize, order: &[u32]) -> Vec<f32> {
    order.iter().flat_map(|&i| &data[i as usize * cols..(i as usize + 1) * cols]).copied().collect()
}

/// A gate or up projection (`[n_ff, hidden]`) on its way into bundles.
enum FfnRows {
    /// The GGUF's blocks of `--quant`, copied unchanged.
    Blocks(Vec<u8>),
    /// f32 values, quantized here; `true` where they were dequantized from
    /// a GGUF type nflash has no kernels for (the error is measured).
    F32(Vec<f32>, bool),
}

impl FfnRows {
    /// Appends row `i` (`cols` elements) as `dtype`, adding a lossy
    /// requantization's error to `err`.
    fn push_row(&self, dtype: DType, i: usize, cols: usize, out: &mut Vec<u8>, err: &RequantError) {
        let rb = dtype.row_bytes(cols as u64).expect("a bundle layout exists") as usize;
        match self {
            Self::Blocks(b) => out.extend_from_slice(&b[i * rb..(i + 1) * rb]),
            Self::F32(v, lossy) => {
                let x = &v[i * cols..(i + 1) * cols];
                quantize_row(dtype, x, out);
                if *lossy {
                    err.add(dtype, x, &out[out.len() - rb..]);
                }
            }
        }
    }
}

/// Refuses Q4_0/Q8_0 blocks whose f16 scale `d` (each block's first two
/// bytes) is NaN or infinite: copied blocks skip the f32 checks.
///
/// # Errors
/// The tensor and the block.
fn check_scales(name: &str, dtype: DType, bytes: &[u8]) -> Result<()> {
    let block = match dtype {
        DType::Q8_0 | DType::Q4_0 => dtype.row_bytes(32).expect("one block") as usize,
        _ => return Ok(()),
    };
    if let Some(i) = bytes.chunks_exact(block).position(|b| !half::f16::from_le_bytes([b[0], b[1]]).is_finite()) {
        bail!("tensor {name}: block {i} has a NaN or infinite scale; the file is damaged: download it again");
    }
    Ok(())
}

/// Squared error and squared magnitude of requantized values, for the
/// relative RMS error a requantization adds (over f32 sums of f64).
#[derive(Default)]
struct RequantError {
    err: std::sync::Mutex<(f64, f64)>,
}

impl RequantError {
    /// Adds `x` against its quantization `q` (one row of `dtype`).
    fn add(&self, dtype: DType, x: &[f32], q: &[u8]) {
        let mut back = vec![0f32; x.len()];
        nflash_runtime::kernels::row_to_f32(dtype, q, &mut back);
        let (e, m) = x
            .iter()
            .zip(&back)
            .fold((0f64, 0f64), |(e, m), (&a, &b)| (e + ((a - b) as f64).powi(2), m + (a as f64).powi(2)));
        let mut g = self.err.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += e;
        g.1 += m;
    }
    /// `‖q − x‖ / ‖x‖`.
    fn relative(&self) -> f64 {
        let g = self.err.lock().unwrap_or_else(|p| p.into_inner());
        if g.1 > 0.0 {
            (g.0 / g.1).sqrt()
        } else {
            0.0
        }
    }
}

/// What converting a GGUF did to its weights, reported at the end.
#[derive(Default)]
struct GgufReport {
    /// Matrices whose blocks were copied bit for bit.
    copied: usize,
    /// Matrices converted rather than copied, by their GGUF type: count.
    requantized: std::collections::BTreeMap<String, usize>,
    /// FFN down projections requantized along hidden, and their GGUF types.
    down: std::collections::BTreeMap<String, usize>,
    /// The error requantizing the down projections added.
    down_error: RequantError,
    /// The error requantizing the other matrices of quantized GGUF types added.
    lossy_error: RequantError,
}

/// Whether GGUF type `t` (by name) is a float type.
fn float_type(t: &str) -> bool {
    matches!(t, "F32" | "F16" | "BF16")
}

impl GgufReport {
    /// Counts matrix `name` as converted to `dtype` rather than copied (a
    /// GGUF input only); `true` where that rounds a quantized GGUF type
    /// again, whose added error is then measured.
    fn note_requantized(&mut self, ck: &Checkpoint, name: &str, dtype: DType) -> Result<bool> {
        let Some(g) = ck.gguf() else { return Ok(false) };
        let t = g.ggml_type(name)?.name();
        let again = !float_type(&t) && dtype != DType::F32;
        *self.requantized.entry(t).or_default() += 1;
        Ok(again)
    }
    fn note_down(&mut self, ck: &Checkpoint, name: &str) -> Result<()> {
        if let Some(g) = ck.gguf() {
            *self.down.entry(g.ggml_type(name)?.name()).or_default() += 1;
        }
        Ok(())
    }
    /// Says what was kept bit for bit, what was converted or requantized,
    /// and the error requantizing added.
    fn report(&self, quant: DType) {
        type Counts = std::collections::BTreeMap<String, usize>;
        let list = |m: &Counts| m.iter().map(|(t, n)| format!("{n} {t}")).collect::<Vec<_>>().join(", ");
        let plural = |n: usize| if n == 1 { "matrix" } else { "matrices" };
        if self.copied > 0 {
            message!("GGUF weights: {} {} copied bit for bit as {quant}", self.copied, plural(self.copied));
        }
        let (float, quantized): (Counts, Counts) =
            self.requantized.iter().map(|(t, n)| (t.clone(), *n)).partition(|(t, _)| float_type(t));
        let verb = if matches!(quant, DType::F16 | DType::F32) { "converted to" } else { "quantized as" };
        if !float.is_empty() {
            let n = float.values().sum::<usize>();
            message!("GGUF weights: {n} {} ({}) {verb} {quant}", plural(n), list(&float));
        }
        if !quantized.is_empty() {
            let n = quantized.values().sum::<usize>();
            let no_kernels: Vec<&str> =
                quantized.keys().map(String::as_str).filter(|t| !matches!(*t, "Q8_0" | "Q4_0")).collect();
            let error = if quant == DType::F32 {
                " (exactly)".to_string()
            } else {
                format!(": relative RMS error {:.3}% on top of the GGUF's own", 100.0 * self.lossy_error.relative())
            };
            let what = format!("{n} {} ({}) dequantized and {verb} {quant}{error}", plural(n), list(&quantized));
            if no_kernels.is_empty() || matches!(quant, DType::F16 | DType::F32) {
                message!("GGUF weights: {what}");
            } else {
                message!(
                    "warning: {what}; nflash has no kernels for {}, so a pack cannot keep its blocks",
                    no_kernels.join(", ")
                );
            }
        }
        if self.down.keys().any(|t| !float_type(t)) && quant != DType::F32 {
            let hint = if quant == DType::Q4_0 {
                "; with --quant q8_0 the down projections keep the GGUF's precision much more closely"
            } else {
                ""
            };
            message!(
                "GGUF weights: the FFN down projections ({}) are stored per neuron along hidden in a pack (SPEC §4.4) but along n_ff in GGUF, so they were dequantized and requantized as {quant}: relative RMS error {:.3}%{hint}",
                list(&self.down),
                100.0 * self.down_error.relative()
            );
        }
    }
}

/// Appends `bytes` (tensor `name`, already `dtype`) to the open resident
/// segment, 64-byte aligned, recording its entry.
fn write_bytes(
    w: &mut PackWriter,
    segment: u32,
    name: &str,
    shape: &[usize],
    dtype: DType,
    bytes: &[u8],
    tensors: &mut Vec<TensorEntry>,
) -> Result<()> {
    let offset = w.pad_segment_to(64)?;
    w.write(bytes)?;
    tensors.push(TensorEntry {
        name: name.to_string(),
        segment,
        offset,
        bytes: bytes.len() as u64,
        dtype,
        shape: shape.iter().map(|&d| d as u64).collect(),
    });
    Ok(())
}

/// Quantizes `data` (`[rows, cols]`, row-major) as `dtype` and appends it to
/// the open resident segment, 64-byte aligned, recording its entry.
#[allow(clippy::too_many_arguments)]
fn write_tensor(
    w: &mut PackWriter,
    segment: u32,
    name: &str,
    shape: &[usize],
    dtype: DType,
    data: &[f32],
    buf: &mut Vec<u8>,
    tensors: &mut Vec<TensorEntry>,
) -> Result<()> {
    let cols = *shape.last().expect("rank ≥ 1");
    buf.clear();
    let rows: Vec<Vec<u8>> = data
        .par_chunks(cols)
        .map(|row| {
            let mut b = Vec::new();
            quantize_row(dtype, row, &mut b);
            b
        })
        .collect();
    rows.iter().for_each(|b| buf.extend_from_slice(b));
    write_bytes(w, segment, name, shape, dtype, buf, tensors)
}

fn short(name: &str) -> String {
    name.trim_start_matches("model.").chars().take(28).collect()
}

/// `add_bos_token` of tokenizer_config.json (SPEC §4.2): a boolean, or where
/// it is absent, what the tokenizer's post-processor does.
///
/// # Errors
/// A value that is not a boolean; `true` for a model without a BOS token id.
fn add_bos_token(ck: &Checkpoint) -> Result<bool> {
    let add = match ck.tokenizer_config.get("add_bos_token") {
        None | Some(serde_json::Value::Null) => post_processor_adds_bos(ck)?,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(v) => bail!("tokenizer_config.json: add_bos_token = {v} is not true or false; fix or remove the key"),
    };
    if add && ck.config.bos_token_id.is_none() {
        bail!("tokenizer_config.json says add_bos_token: true, but neither config.json nor generation_config.json has a bos_token_id; add the BOS token's id (see tokenizer.json) to config.json");
    }
    Ok(add)
}

/// Whether the tokenizer's own post-processor puts the BOS token first (the
/// `add_bos_token` of a tokenizer_config.json that does not say): the
/// runtime then prepends it to raw prompts itself (SPEC §4.2).
fn post_processor_adds_bos(ck: &Checkpoint) -> Result<bool> {
    let Some(bos) = ck.config.bos_token_id else { return Ok(false) };
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&ck.tokenizer_json)?;
    let (with, without) = (tok.encode("a", true)?, tok.encode("a", false)?);
    Ok(with.first() == Some(&bos) && with.len() == without.len() + 1)
}

/// `chat_template` from tokenizer_config.json: a string, or a list of
/// `{name, template}` of which "default" is taken.
fn chat_template(tc: &serde_json::Value) -> Option<String> {
    match tc.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// A special token string (`"<s>"` or `{"content": "<s>", ...}`).
fn special_token(tc: &serde_json::Value, key: &str) -> Option<String> {
    match tc.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content").and_then(|c| c.as_str()).map(str::to_string),
    }
}
