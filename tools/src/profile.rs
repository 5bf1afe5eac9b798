//! The FFN activity profile of a model on calibration text (DESIGN "prep" step
//! 2): per layer, histograms of `|act(gate·x)|` and `|act(gate·x)·(up·x)|`,
//! per-neuron activity counts at a grid of sparsity levels, and a sample of
//! FFN inputs for predictor training.
//!
//! File: magic `b"NFPROFIL"`, [`PROFILE_VERSION`] as u32 little-endian, then
//! one zstd frame (with checksum) of the bincode encoding of [`Profile`]
//! (fixed-width little-endian integers). Written to `<out>.tmp-<pid>` and renamed.
//! Collection lives in `profile/collect.rs`, the command line in `profile/cli.rs`.

mod cli;
mod collect;

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use bincode::Options;
use nflash_format::{Criterion, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::histogram::Histogram;

pub use cli::{run, CalibArgs, ProfileArgs};
pub use collect::{profile, ProfileOptions};

/// First bytes of a profile file.
pub const PROFILE_MAGIC: [u8; 8] = *b"NFPROFIL";
/// Version of the encoding after the magic; bumped on any change of [`Profile`].
pub const PROFILE_VERSION: u32 = 3;
/// Largest decoded profile accepted or written, bytes (a 7B model with the
/// default 8192-token sample is about 2 GiB).
pub const MAX_PROFILE_BYTES: u64 = 16 << 30;
/// Sparsity levels of [`LayerProfile::grid`]: 0.05, 0.10, …, 0.95.
pub const GRID_POINTS: usize = 19;

/// The grid of sparsity levels `[GRID_POINTS]`: `0.05 · (k + 1)`.
pub fn sparsity_grid() -> Vec<f32> {
    (1..=GRID_POINTS).map(|k| (k as f64 / 20.0) as f32).collect()
}

/// Shape of the model a profile was made from; a profile applies only to a
/// checkpoint with the same shape.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ProfileModel {
    /// HF architecture class, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// Residual width.
    pub hidden_size: u64,
    /// FFN neurons per layer.
    pub intermediate_size: u64,
    /// Decoder layers.
    pub num_layers: u64,
    /// HF `hidden_act` name: `silu`, `relu`, `gelu`, `gelu_pytorch_tanh`.
    pub activation: String,
    /// Experts per layer (1: dense); the profile has a [`LayerProfile`] per
    /// FFN unit, `num_layers × experts` (SPEC §4.4).
    pub experts: u32,
    /// Experts each token is routed to (1: dense).
    pub experts_per_token: u32,
}

impl ProfileModel {
    /// The shape of `cfg`.
    pub fn of(cfg: &ModelConfig) -> Self {
        ProfileModel {
            architecture: cfg.family().to_string(),
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_layers: cfg.num_layers,
            activation: cfg.activation.name().to_string(),
            experts: cfg.architecture.moe().map_or(1, |m| m.num_experts),
            experts_per_token: cfg.architecture.moe().map_or(1, |m| m.experts_per_token),
        }
    }

    /// FFN units: one per layer, or per expert of each layer.
    pub fn units(&self) -> u64 {
        self.num_layers * u64::from(self.experts)
    }
}

impl std::fmt::Display for ProfileModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} with {} layers, hidden {}, FFN {}, {}",
            self.architecture, self.num_layers, self.hidden_size, self.intermediate_size, self.activation
        )?;
        if self.experts > 1 {
            write!(f, ", {} experts ({} per token)", self.experts, self.experts_per_token)?;
        }
        Ok(())
    }
}

/// The calibration run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CalibInfo {
    /// File name of the calibration text (no directory).
    pub source: String,
    /// Tokens profiled (every window's tokens; no BOS is added).
    pub n_tokens: u64,
    /// Window length, tokens; windows are independent causal sequences.
    pub window: u32,
    /// Windows run (the last one may be shorter than `window`, ≥ 2 tokens).
    pub n_windows: u32,
}

/// Statistics of one FFN unit (a decoder layer's FFN, or one expert of a
/// mixture of experts) over the calibration tokens it ran: all of them, or
/// for an expert those the router sent to it (so `n_tokens()` is how many
/// were routed to it, and its counts are out of those).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LayerProfile {
    /// `|act(gate·xn)|` over all (token, neuron) pairs.
    pub gate: Histogram,
    /// `|act(gate·xn) · (up·xn)|` over all (token, neuron) pairs.
    pub gate_up: Histogram,
    /// Sparsity levels `[GRID_POINTS]` (see [`sparsity_grid`]).
    pub grid: Vec<f32>,
    /// `[grid]`: `gate.quantile(grid[k])`.
    pub gate_thresholds: Vec<f32>,
    /// `[grid]`: `gate_up.quantile(grid[k])`.
    pub gate_up_thresholds: Vec<f32>,
    /// `[grid][n_neurons]`: tokens where `|a| > gate_thresholds[k]`.
    pub gate_counts: Vec<Vec<u32>>,
    /// `[grid][n_neurons]`: tokens where `|a·u| > gate_up_thresholds[k]`.
    pub gate_up_counts: Vec<Vec<u32>>,
    /// f16 bits `[n_sample, hidden]`: FFN inputs `xn` (post_attention_layernorm
    /// output) of calibration tokens `i · n_tokens / n_sample`, `i` in
    /// `0..n_sample` (of an expert: those of them routed to it).
    pub sample: Vec<u16>,
}

/// A model's FFN activity profile; see the module docs for the file format.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Profile {
    /// Shape of the profiled model.
    pub model: ProfileModel,
    /// [`crate::checkpoint::Checkpoint::fingerprint`] of the profiled checkpoint.
    pub checkpoint: String,
    /// Calibration run.
    pub calib: CalibInfo,
    /// One per FFN unit: per decoder layer, or per expert of each layer in order.
    pub layers: Vec<LayerProfile>,
}

fn bincode_options() -> impl Options {
    bincode::DefaultOptions::new().with_fixint_encoding().with_little_endian().with_limit(MAX_PROFILE_BYTES)
}

/// `<path>.tmp-<pid>`, beside `path`.
fn temp_path(path: &Path) -> Result<std::path::PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| anyhow!("{} is not a file path; pass a file name for the profile", path.display()))?;
    let mut tmp = name.to_os_string();
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(path.with_file_name(tmp))
}

fn set_in_progress(p: Option<std::path::PathBuf>) {
    *crate::IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()) = p;
}

impl Profile {
    /// Writes the profile to `path` through a temporary file beside it,
    /// renamed at the end; Ctrl-C meanwhile removes the temporary file.
    ///
    /// # Errors
    /// `path` is a directory or cannot be written, encoding beyond [`MAX_PROFILE_BYTES`].
    pub fn save(&self, path: &Path) -> Result<()> {
        if path.is_dir() {
            bail!("{} is a directory; pass a file path for the profile", path.display());
        }
        let tmp = temp_path(path)?;
        set_in_progress(Some(tmp.clone()));
        let result = self.write_file(&tmp).and_then(|()| {
            std::fs::rename(&tmp, path)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
        });
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        set_in_progress(None);
        result
    }

    fn write_file(&self, tmp: &Path) -> Result<()> {
        let file = File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&PROFILE_MAGIC)?;
        out.write_all(&PROFILE_VERSION.to_le_bytes())?;
        let mut z = zstd::Encoder::new(out, 3)?;
        z.include_checksum(true)?;
        bincode_options().serialize_into(&mut z, self).context("encoding the profile")?;
        let file = z.finish()?.into_inner().map_err(|e| e.into_error())?;
        file.sync_all().with_context(|| format!("cannot write {}", tmp.display()))?;
        Ok(())
    }

    /// Reads and checks a profile written by [`Profile::save`].
    ///
    /// # Errors
    /// Missing file; not a profile (bad magic); another format version;
    /// corrupt or truncated data (zstd, bincode or consistency failure).
    pub fn load(path: &Path) -> Result<Profile> {
        if let Some(kind) = nflash_format::reader::special_file_kind(path) {
            bail!("{} is {kind}, not a profile; make one with `prep profile`", path.display());
        }
        let file = File::open(path)
            .with_context(|| format!("cannot open the profile {}; make one with `prep profile`", path.display()))?;
        let mut r = BufReader::new(file);
        let mut head = [0u8; 12];
        if r.read_exact(&mut head).is_err() || head[..8] != PROFILE_MAGIC {
            bail!("{} is not an nflash profile (bad magic); make one with `prep profile`", path.display());
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != PROFILE_VERSION {
            bail!(
                "{} is a profile of format version {version}, but this prep reads version {PROFILE_VERSION}; re-run `prep profile`",
                path.display()
            );
        }
        let corrupt = |what: String| {
            anyhow!("the profile {} is corrupt or truncated ({what}); re-run `prep profile`", path.display())
        };
        let mut z = zstd::Decoder::with_buffer(r).map_err(|e| corrupt(e.to_string()))?;
        let p: Profile = bincode_options().deserialize_from(&mut z).map_err(|e| corrupt(e.to_string()))?;
        // Reading past the encoding checks the frame checksum and trailing bytes.
        match z.read(&mut [0u8; 1]) {
            Ok(0) => {}
            Ok(_) => return Err(corrupt("trailing data".into())),
            Err(e) => return Err(corrupt(e.to_string())),
        }
        p.check().map_err(corrupt)?;
        Ok(p)
    }

    /// Consistency of every size and count with `model` and `calib`.
    fn check(&self) -> std::result::Result<(), String> {
        let (h, inter) = (self.model.hidden_size as usize, self.model.intermediate_size as usize);
        let (experts, k) = (self.model.experts as u64, self.model.experts_per_token as u64);
        if experts == 0 || k == 0 || k > experts || experts > u64::from(nflash_format::MAX_EXPERTS) {
            return Err(format!("{k} of {experts} experts per token"));
        }
        if self.layers.len() as u64 != self.model.units() {
            return Err(format!("{} FFN units, model has {}", self.layers.len(), self.model.units()));
        }
        let pairs = self.calib.n_tokens.checked_mul(inter as u64).ok_or("sizes overflow")?;
        let n_sample = self.n_sample_max();
        if h == 0 || n_sample > self.calib.n_tokens as usize {
            return Err(format!("sample of {n_sample} tokens for {} calibration tokens", self.calib.n_tokens));
        }
        // Per decoder layer: its experts saw k routings of every token in all.
        for (li, layer) in self.layers.chunks(experts as usize).enumerate() {
            let seen: u64 = layer.iter().map(|l| l.gate.total).sum();
            if seen != pairs.saturating_mul(k) {
                return Err(format!(
                    "layer {li}: histograms count {seen} values, expected {}",
                    pairs.saturating_mul(k)
                ));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            let e = |m: String| format!("FFN unit {i}: {m}");
            l.gate.check().map_err(|m| e(format!("gate histogram: {m}")))?;
            l.gate_up.check().map_err(|m| e(format!("gate_up histogram: {m}")))?;
            let routed = l.gate.total / inter.max(1) as u64;
            if l.gate.total != l.gate_up.total
                || !l.gate.total.is_multiple_of(inter.max(1) as u64)
                || routed > self.calib.n_tokens
            {
                return Err(e(format!(
                    "histograms count {} and {} values for {inter} neurons",
                    l.gate.total, l.gate_up.total
                )));
            }
            if experts == 1 && l.gate.total != pairs {
                return Err(e(format!("histograms count {} values, expected {pairs}", l.gate.total)));
            }
            let g = l.grid.len();
            if g == 0 || l.gate_thresholds.len() != g || l.gate_up_thresholds.len() != g {
                return Err(e("grid and thresholds differ in length".into()));
            }
            for counts in [&l.gate_counts, &l.gate_up_counts] {
                if counts.len() != g || counts.iter().any(|c| c.len() != inter) {
                    return Err(e(format!("counts are not [{g}][{inter}]")));
                }
                if counts.iter().flatten().any(|&c| c as u64 > routed) {
                    return Err(e(format!("a count exceeds the {routed} calibration tokens it ran")));
                }
            }
            if !l.sample.len().is_multiple_of(h) || l.sample.len() / h > routed as usize {
                return Err(e(format!("sample of {} values for hidden size {h} and {routed} tokens", l.sample.len())));
            }
            if experts == 1 && l.sample.len() != n_sample * h {
                return Err(e(format!("sample of {} values, layer 0 has {}", l.sample.len(), n_sample * h)));
            }
        }
        Ok(())
    }

    /// Checks that the profile was made from the checkpoint `ck` (in
    /// `model_dir`): the same shape and the same weights fingerprint.
    ///
    /// # Errors
    /// Any difference in architecture, sizes, layer count or activation; a
    /// checkpoint of the same shape with other weights.
    pub fn check_matches(&self, ck: &crate::checkpoint::Checkpoint, model_dir: &Path) -> Result<()> {
        let cfg: &ModelConfig = &ck.config;
        let want = ProfileModel::of(cfg);
        if self.model != want {
            bail!(
                "the profile is of a different model: it was made from a {}, but {} is a {}; re-run `prep profile --model {}`",
                self.model,
                model_dir.display(),
                want,
                model_dir.display()
            );
        }
        let fp = ck.fingerprint()?;
        if self.checkpoint != fp {
            bail!(
                "the profile was made from another checkpoint of the same shape (weights fingerprint {}, but {} has {fp}): its activity statistics do not apply; re-run `prep profile --model {}`",
                self.checkpoint,
                model_dir.display(),
                model_dir.display()
            );
        }
        Ok(())
    }

    /// Sampled FFN inputs of `layer` as f32: `[n_sample, hidden]`.
    ///
    /// # Panics
    /// If `layer ≥ layers.len()`.
    pub fn sample(&self, layer: usize) -> Vec<f32> {
        self.layers[layer].sample.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect()
    }

    /// Tokens in the sample of every layer (of a mixture of experts, the
    /// largest expert sample: each expert has the sampled tokens routed to it).
    pub fn n_sample(&self) -> usize {
        self.n_sample_max()
    }

    fn n_sample_max(&self) -> usize {
        let h = self.model.hidden_size as usize;
        self.layers.iter().map(|l| l.sample.len() / h.max(1)).max().unwrap_or(0)
    }

    /// Fraction of the calibration tokens each FFN unit ran (`[units]`): 1
    /// for a dense layer, for an expert the share the router sent to it
    /// (a layer's experts sum to `experts_per_token`).
    pub fn routed_share(&self) -> Vec<f32> {
        let n = self.calib.n_tokens.max(1) as f64;
        self.layers.iter().map(|l| (l.n_tokens() as f64 / n) as f32).collect()
    }
}

impl LayerProfile {
    fn parts(&self, c: Criterion) -> (&Histogram, &[Vec<u32>]) {
        match c {
            Criterion::Gate => (&self.gate, &self.gate_counts),
            Criterion::GateUp => (&self.gate_up, &self.gate_up_counts),
        }
    }

    /// Neurons in the layer.
    pub fn n_neurons(&self) -> usize {
        self.gate_counts.first().map_or(0, Vec::len)
    }

    /// Calibration tokens the counts are out of.
    pub fn n_tokens(&self) -> u64 {
        self.gate.total / (self.n_neurons().max(1) as u64)
    }

    /// Fraction of (token, neuron) values of criterion `c` that are exactly 0
    /// (the natural sparsity of ReLU-family models).
    pub fn zero_fraction(&self, c: Criterion) -> f64 {
        self.parts(c).0.zero_fraction()
    }

    /// Threshold on criterion `c` that leaves a fraction `sparsity` of the
    /// (token, neuron) values at or below it (neuron inactive iff value ≤ threshold).
    pub fn threshold(&self, c: Criterion, sparsity: f64) -> f32 {
        self.parts(c).0.quantile(sparsity)
    }

    /// Per-neuron activation frequency `[n_neurons]` (fraction of calibration
    /// tokens active) at `sparsity`, linearly interpolated between grid points
    /// (clamped to the first and last grid point).
    pub fn frequency(&self, c: Criterion, sparsity: f64) -> Vec<f32> {
        let counts = self.parts(c).1;
        if counts.is_empty() || counts.len() != self.grid.len() {
            return vec![0.0; self.n_neurons()];
        }
        let n = self.n_tokens().max(1) as f64;
        let g: Vec<f64> = self.grid.iter().map(|&v| v as f64).collect();
        let last = g.len() - 1;
        let s = sparsity.clamp(g[0], g[last]);
        let k = g.iter().rposition(|&v| v <= s).unwrap_or(0).min(last.saturating_sub(1));
        let t = if last == 0 { 0.0 } else { ((s - g[k]) / (g[k + 1] - g[k])).clamp(0.0, 1.0) };
        let hi = &counts[(k + 1).min(last)];
        counts[k].iter().zip(hi).map(|(&a, &b)| (((1.0 - t) * a as f64 + t * b as f64) / n) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer of 2 neurons over 100 tokens whose counts fall linearly with the grid.
    fn layer() -> LayerProfile {
        let grid = sparsity_grid();
        let mut gate = Histogram::new();
        gate.add_slice(&[1.0; 200]);
        LayerProfile {
            gate_up: gate.clone(),
            gate,
            gate_thresholds: vec![0.0; GRID_POINTS],
            gate_up_thresholds: vec![0.0; GRID_POINTS],
            gate_counts: grid.iter().map(|&s| vec![(100.0 * (1.0 - s)).round() as u32, 50]).collect(),
            gate_up_counts: vec![vec![7, 7]; GRID_POINTS],
            grid,
            sample: vec![],
        }
    }

    #[test]
    fn frequency_interpolates_and_clamps() {
        let l = layer();
        assert_eq!(l.n_tokens(), 100);
        let close = |a: f32, b: f32| (a - b).abs() < 1e-5;
        let f = l.frequency(Criterion::Gate, 0.5);
        assert!(close(f[0], 0.5) && close(f[1], 0.5), "{f:?}");
        let f = l.frequency(Criterion::Gate, 0.525); // halfway between 0.50 and 0.55
        assert!(close(f[0], 0.475), "{f:?}");
        let f = l.frequency(Criterion::Gate, 0.0); // clamped to 0.05
        assert!(close(f[0], 0.95), "{f:?}");
        let f = l.frequency(Criterion::Gate, 1.0); // clamped to 0.95
        assert!(close(f[0], 0.05), "{f:?}");
        let f = l.frequency(Criterion::Gate, 0.95);
        assert!(close(f[0], 0.05), "{f:?}");
        assert!(close(l.frequency(Criterion::GateUp, 0.3)[1], 0.07));
    }

    fn tiny_profile() -> Profile {
        let mut l = layer();
        l.sample = vec![half::f16::from_f32(1.5).to_bits(); 6];
        Profile {
            model: ProfileModel {
                architecture: "LlamaForCausalLM".into(),
                hidden_size: 3,
                intermediate_size: 2,
                num_layers: 1,
                activation: "silu".into(),
                experts: 1,
                experts_per_token: 1,
            },
            checkpoint: "0123456789abcdef".into(),
            calib: CalibInfo { source: "a.txt".into(), n_tokens: 100, window: 50, n_windows: 2 },
            layers: vec![l],
        }
    }

    #[test]
    fn save_load_round_trip_and_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.profile");
        let p = tiny_profile();
        p.save(&path).unwrap();
        let q = Profile::load(&path).unwrap();
        assert_eq!(p, q);
        assert_eq!(q.n_sample(), 2);
        assert_eq!(q.sample(0), vec![1.5; 6]);
        let bytes = std::fs::read(&path).unwrap();
        let err = |b: &[u8]| {
            std::fs::write(&path, b).unwrap();
            format!("{:#}", Profile::load(&path).unwrap_err())
        };
        assert!(err(&bytes[..bytes.len() - 5]).contains("corrupt or truncated"));
        assert!(err(b"hello world, not a profile").contains("bad magic"));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(err(&v2).contains("re-run `prep profile`"));
        let mut flipped = bytes.clone();
        let mid = 12 + (bytes.len() - 12) / 2;
        flipped[mid] ^= 0x55;
        assert!(err(&flipped).contains("corrupt"));
        assert!(format!("{:#}", Profile::load(&dir.path().join("none")).unwrap_err()).contains("cannot open"));
    }
}
