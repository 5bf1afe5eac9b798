//! Collecting a [`Profile`]: tokenize the calibration text, run the dense
//! model layer by layer ([`Forward`]), and measure each layer's FFN in two
//! passes over token chunks — pass 1 fills the histograms (and the input
//! sample), pass 2 recomputes gate and up, counts per-neuron activity at the
//! grid thresholds from pass 1, and adds the FFN output to the residual stream.

use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use rayon::prelude::*;

use super::{sparsity_grid, CalibInfo, LayerProfile, Profile, ProfileModel};
use crate::checkpoint::Checkpoint;
use crate::forward::{split_windows, Activations, Ffn, Forward};
use crate::histogram::Histogram;
use nflash_runtime::message;

/// Tokens per FFN chunk: bounds the activations held at once (`[chunk, n_neurons]`).
const FFN_CHUNK: usize = 512;
/// Neurons per task when counting activity.
const NEURON_BLOCK: usize = 64;
/// Progress units per token and layer: attention, FFN pass 1, FFN pass 2.
const STAGES: u64 = 3;

/// Fewest sampled FFN inputs a profile keeps (predictor training needs them).
pub const MIN_SAMPLE: usize = 16;

/// What to profile.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Calibration tokens to run (the first ones of the text), ≥ 1.
    pub tokens: usize,
    /// Window length, tokens, ≥ 2: windows are independent causal sequences.
    pub window: usize,
    /// FFN inputs to keep per layer for predictor training (capped at the tokens run).
    pub sample: usize,
}

impl ProfileOptions {
    /// Checks the option values.
    ///
    /// # Errors
    /// `tokens` 0 or above `u32::MAX`, `window` below 2 or above `u32::MAX`,
    /// `tokens` below `window`.
    pub fn check(&self) -> Result<()> {
        if self.tokens == 0 {
            bail!("--tokens 0: profile at least one window of tokens (default 50000)");
        }
        if self.tokens > u32::MAX as usize {
            bail!("--tokens {} is too many; at most {}", self.tokens, u32::MAX);
        }
        if self.window < 2 {
            bail!("--window {} is too short; windows need at least 2 tokens (default 512)", self.window);
        }
        if self.window > u32::MAX as usize {
            bail!("--window {} is too long", self.window);
        }
        if self.sample < MIN_SAMPLE {
            bail!("--sample {} is too small: predictors are trained and calibrated on at least {MIN_SAMPLE} sampled FFN inputs (default 8192)", self.sample);
        }
        if self.tokens < self.window {
            bail!(
                "--tokens {} is less than one window (--window {}): raise --tokens or lower --window",
                self.tokens,
                self.window
            );
        }
        Ok(())
    }
}

/// Tokens past `want` a text prefix must give before its first `want` are
/// trusted to equal those of the whole text (only the last pre-token can differ).
const PREFIX_MARGIN: usize = 64;

/// Reads `path` as UTF-8 and returns its first `opts.tokens` tokens (no BOS,
/// no special tokens: the text as `nflash ppl` scores it).
///
/// # Errors
/// Unreadable, empty or non-UTF-8 file; fewer tokens than one window.
fn calib_tokens(ck: &Checkpoint, path: &Path, opts: &ProfileOptions) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read the calibration file {}", path.display()))?;
    if bytes.is_empty() {
        bail!("the calibration file {} is empty; pass a UTF-8 text file (e.g. WikiText-2)", path.display());
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "the calibration file {} is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let tok = nflash_runtime::tokenizer::Tokenizer::from_json(&ck.tokenizer_json)
        .map_err(|e| anyhow!("{}/tokenizer.json cannot be loaded: {e}", ck.dir.display()))?;
    let (mut ids, whole) = first_tokens(&tok, &text, opts.tokens)?;
    let available = ids.len();
    if available < opts.window {
        bail!(
            "the calibration file {} gives only {available} tokens, fewer than one window of {}: pass a smaller --window (2..={available}) or a longer file",
            path.display(),
            opts.window
        );
    }
    if whole && available < opts.tokens {
        message!("note: {} has only {available} tokens; profiling all of them", path.display());
    }
    ids.truncate(opts.tokens);
    Ok(ids)
}

/// Tokenizes growing prefixes of `text` (cut after a newline) until one gives
/// more than `want` tokens with [`PREFIX_MARGIN`] to spare, so a large file is
/// never tokenized whole. Returns the tokens and whether they cover the whole text.
fn first_tokens(tok: &nflash_runtime::tokenizer::Tokenizer, text: &str, want: usize) -> Result<(Vec<u32>, bool)> {
    let mut len = want.saturating_mul(8).max(1 << 16);
    loop {
        if len >= text.len() {
            return Ok((tok.encode(text, false)?, true));
        }
        let mut cut = len;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let cut = text[..cut].rfind('\n').map_or(cut, |i| i + 1);
        let ids = tok.encode(&text[..cut], false)?;
        if ids.len() >= want + PREFIX_MARGIN {
            return Ok((ids, false));
        }
        len = len.saturating_mul(2);
    }
}

/// Evenly spaced token indices `i · n_tokens / n_sample`, ascending.
fn sample_indices(n_tokens: usize, n_sample: usize) -> Vec<usize> {
    let n_sample = n_sample.min(n_tokens);
    (0..n_sample).map(|i| (i as u128 * n_tokens as u128 / n_sample as u128) as usize).collect()
}

fn progress_bar(len: u64, layers: u64) -> crate::progress::Progress {
    let pb = ProgressBar::new(len);
    let style =
        ProgressStyle::with_template("{msg:>12} [{elapsed_precise}] {wide_bar} {percent:>3}% {tps} tokens/s eta {eta}")
            .expect("static template")
            .with_key("tps", move |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let secs = s.elapsed().as_secs_f64().max(1e-9);
                let _ = write!(w, "{:.0}", s.pos() as f64 / (STAGES * layers) as f64 / secs);
            });
    pb.set_style(style);
    crate::progress::Progress::from_bar(pb, "profile")
}

/// Profiles the dense f32 model `ck` on the first `opts.tokens` tokens of
/// the calibration text `calib`, in windows of `opts.window` tokens (a final
/// partial window is kept when it has at least 2 tokens). Shows a progress bar.
/// Memory: the residual stream `[n_tokens, hidden]` f32, one layer's weights
/// in f32, one chunk's activations and the sample.
///
/// # Errors
/// Bad options or calibration text (see [`ProfileOptions::check`]),
/// checkpoint tensors missing or misshapen, tokenizer mismatch.
pub fn profile(ck: &Checkpoint, calib: &Path, opts: &ProfileOptions) -> Result<Profile> {
    opts.check()?;
    let mut tokens = calib_tokens(ck, calib, opts)?;
    let windows = split_windows(tokens.len(), opts.window);
    // A final 1-token window is dropped: so is its token.
    tokens.truncate(windows.last().map_or(0, |w| w.end));
    let n_windows = windows.len();
    let mut fwd = Forward::new(ck, &tokens, windows)?;
    let n = fwd.n_tokens();
    let samples = sample_indices(n, opts.sample);
    let cfg = &ck.config;
    let n_layers = cfg.num_layers as usize;
    // Per token and layer: attention, then the FFN's two passes over each of
    // the token's routings (1 dense, experts_per_token for a mixture).
    let k = cfg.architecture.moe().map_or(1, |m| m.experts_per_token as u64);
    let pb = progress_bar((1 + (STAGES - 1) * k) * (n * n_layers) as u64, n_layers as u64);
    let mut layers = Vec::with_capacity(cfg.ffn_units() as usize);
    for l in 0..n_layers {
        pb.set_message(format!("layer {}/{n_layers}", l + 1));
        fwd.attention(l, |t| pb.inc(t as u64))?;
        match fwd.router(l)? {
            None => {
                let ffn = fwd.ffn(l)?;
                layers.push(profile_unit(&mut fwd, &ffn, Tokens::All, &samples, &pb)?);
            }
            Some(router) => {
                // Every token routed first (the router reads the FFN input
                // before any expert adds to the residual), then each expert
                // on its tokens, its output weighted into `delta`.
                let routes = fwd.route(&router)?;
                let experts = cfg.experts() as usize;
                let mut delta = vec![0f32; fwd.n_tokens() * cfg.hidden_size as usize];
                for e in 0..experts {
                    let (idx, weights): (Vec<usize>, Vec<f32>) =
                        nflash_runtime::model::moe::routed_to(&routes, k as usize, e).unzip();
                    let ffn = fwd.ffn(l * experts + e)?;
                    let tokens = Tokens::Routed { idx: &idx, weights: &weights, delta: &mut delta };
                    layers.push(profile_unit(&mut fwd, &ffn, tokens, &samples, &pb)?);
                }
                fwd.add_residual(0..fwd.n_tokens(), &delta);
            }
        }
    }
    pb.finish_and_clear();
    Ok(Profile {
        model: ProfileModel::of(&ck.config),
        checkpoint: ck.fingerprint()?,
        calib: CalibInfo {
            source: calib.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
            n_tokens: n as u64,
            window: opts.window as u32,
            n_windows: n_windows as u32,
        },
        layers,
    })
}

/// The calibration tokens an FFN unit runs, and where its output goes.
enum Tokens<'t> {
    /// Every token; the output is added to the residual stream.
    All,
    /// The tokens `idx` (ascending) routed to an expert with routing
    /// `weights`; `weight · output` is added to `delta` (`[n_tokens, hidden]`).
    Routed { idx: &'t [usize], weights: &'t [f32], delta: &'t mut Vec<f32> },
}

impl Tokens<'_> {
    /// How many tokens the unit runs, of `n` calibration tokens.
    fn len(&self, n: usize) -> usize {
        match self {
            Tokens::All => n,
            Tokens::Routed { idx, .. } => idx.len(),
        }
    }

    /// Calibration token index of the unit's `i`-th token.
    fn token(&self, i: usize) -> usize {
        match self {
            Tokens::All => i,
            Tokens::Routed { idx, .. } => idx[i],
        }
    }
}

/// FFN inputs of the unit's tokens `rows` (positions in its token list).
fn unit_input(fwd: &Forward, ffn: &Ffn, tokens: &Tokens, rows: Range<usize>) -> Vec<f32> {
    match tokens {
        Tokens::All => fwd.ffn_input(ffn, rows),
        Tokens::Routed { idx, .. } => fwd.ffn_input_of(ffn, &idx[rows]),
    }
}

fn chunks(n: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n).step_by(FFN_CHUNK).map(move |s| s..(s + FFN_CHUNK).min(n))
}

/// One FFN unit's statistics over the tokens it runs; adds its output to
/// the residual stream (or, weighted, to the layer's expert sum).
fn profile_unit(
    fwd: &mut Forward,
    ffn: &Ffn,
    mut tokens: Tokens,
    samples: &[usize],
    pb: &ProgressBar,
) -> Result<LayerProfile> {
    let inter = ffn.n_neurons();
    let n_unit = tokens.len(fwd.n_tokens());
    // Pass 1: histograms and the input sample (the sampled tokens this unit runs).
    let (mut gate, mut gate_up) = (Histogram::new(), Histogram::new());
    let mut sample = Vec::new();
    let mut next = 0; // first sample index not yet reached
    for rows in chunks(n_unit) {
        let xn = unit_input(fwd, ffn, &tokens, rows.clone());
        let h = xn.len() / rows.len();
        for i in rows.clone() {
            let t = tokens.token(i);
            while next < samples.len() && samples[next] < t {
                next += 1;
            }
            if samples.get(next) == Some(&t) {
                let r = &xn[(i - rows.start) * h..(i - rows.start + 1) * h];
                sample.extend(r.iter().map(|&v| half::f16::from_f32(v).to_bits()));
            }
        }
        let act = ffn.activations(xn, rows.len())?;
        gate.merge(&histogram(&act.a, inter));
        gate_up.merge(&histogram(&act.hv, inter));
        pb.inc(rows.len() as u64);
    }
    let grid = sparsity_grid();
    let gate_thr: Vec<f32> = grid.iter().map(|&s| gate.quantile(s as f64)).collect();
    let gate_up_thr: Vec<f32> = grid.iter().map(|&s| gate_up.quantile(s as f64)).collect();
    // Pass 2: per-neuron counts, then the FFN output.
    let levels = grid.len() + 1;
    let (mut gate_lv, mut gate_up_lv) = (vec![0u32; inter * levels], vec![0u32; inter * levels]);
    for rows in chunks(n_unit) {
        let xn = unit_input(fwd, ffn, &tokens, rows.clone());
        let Activations { a, hv } = ffn.activations(xn, rows.len())?;
        count_levels(&a, &gate_thr, &mut gate_lv);
        count_levels(&hv, &gate_up_thr, &mut gate_up_lv);
        let out = ffn.down(hv, rows.len())?;
        match &mut tokens {
            Tokens::All => fwd.add_residual(rows.clone(), &out),
            Tokens::Routed { idx, weights, delta } => {
                let h = out.len() / rows.len();
                for (i, o) in rows.clone().zip(out.chunks_exact(h)) {
                    let (t, w) = (idx[i], weights[i]);
                    delta[t * h..(t + 1) * h].iter_mut().zip(o).for_each(|(d, v)| *d += w * v);
                }
            }
        }
        pb.inc(rows.len() as u64);
    }
    Ok(LayerProfile {
        gate,
        gate_up,
        gate_counts: counts_from_levels(&gate_lv, grid.len()),
        gate_up_counts: counts_from_levels(&gate_up_lv, grid.len()),
        grid,
        gate_thresholds: gate_thr,
        gate_up_thresholds: gate_up_thr,
        sample,
    })
}

/// Histogram of `|v|` over `vals` (`[n, n_neurons]`), built in parallel.
fn histogram(vals: &[f32], inter: usize) -> Histogram {
    vals.par_chunks(16 * inter)
        .fold(Histogram::new, |mut h, c| {
            h.add_slice(c);
            h
        })
        .reduce(Histogram::new, |mut a, b| {
            a.merge(&b);
            a
        })
}

/// For every value of `vals` (`[n, n_neurons]`), `levels[neuron · (G+1) + j] += 1`
/// where `j` is the number of thresholds (ascending, `[G]`) strictly below `|v|`:
/// the neuron is active at grid points `k < j`.
fn count_levels(vals: &[f32], thr: &[f32], levels: &mut [u32]) {
    let lv = thr.len() + 1;
    let inter = levels.len() / lv;
    levels.par_chunks_mut(NEURON_BLOCK * lv).enumerate().for_each(|(b, block)| {
        let n0 = b * NEURON_BLOCK;
        let nb = block.len() / lv;
        for row in vals.chunks_exact(inter) {
            for (i, &v) in row[n0..n0 + nb].iter().enumerate() {
                let j = thr.partition_point(|&t| t < v.abs());
                block[i * lv + j] += 1;
            }
        }
    });
}

/// `[G][n_neurons]` counts of tokens active at each grid point from
/// [`count_levels`] output: `counts[k][n] = Σ_{j > k} levels[n][j]`.
fn counts_from_levels(levels: &[u32], g: usize) -> Vec<Vec<u32>> {
    let lv = g + 1;
    let inter = levels.len() / lv;
    let mut counts = vec![vec![0u32; inter]; g];
    for (n, l) in levels.chunks_exact(lv).enumerate() {
        let mut above = 0;
        for k in (0..g).rev() {
            above += l[k + 1];
            counts[k][n] = above;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_to_counts() {
        // 2 neurons, thresholds [1, 2]; neuron 0 sees 0.5, 1.5, 2.5; neuron 1 sees 3 three times.
        let vals = [0.5, 3.0, -1.5, 3.0, 2.5, -3.0];
        let mut lv = vec![0u32; 2 * 3];
        count_levels(&vals, &[1.0, 2.0], &mut lv);
        assert_eq!(lv, vec![1, 1, 1, 0, 0, 3]);
        assert_eq!(counts_from_levels(&lv, 2), vec![vec![2, 3], vec![1, 3]]);
        // A value equal to a threshold is not above it.
        let mut lv = vec![0u32; 3];
        count_levels(&[1.0], &[1.0, 2.0], &mut lv);
        assert_eq!(lv, vec![1, 0, 0]);
    }

    #[test]
    fn samples_are_evenly_spaced() {
        assert_eq!(sample_indices(10, 4), vec![0, 2, 5, 7]);
        assert_eq!(sample_indices(3, 8), vec![0, 1, 2]);
        assert!(sample_indices(5, 0).is_empty());
    }
}
