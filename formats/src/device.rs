//! Device profiles: what the planner knows about the target (SPEC §4.6).
//!
//! A profile is a TOML file (`profiles/*.toml`), either transcribed from
//! published figures (`oneplus-12.toml`) or measured by `nflash probe`
//! (`dev-host.toml`). Units are in the field names: bytes, MB/s (10⁶ bytes
//! per second), GB/s (10⁹ bytes per second).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Largest profile file accepted, bytes.
const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// An error `reason` cut to a readable length. TOML errors quote the
/// offending line before saying what is wrong; a long line is cut, the
/// explanation kept.
fn shorten(reason: &str) -> String {
    const MAX: usize = 300;
    let cut = |l: &str| {
        if l.chars().count() > MAX {
            format!("{}…", l.chars().take(MAX).collect::<String>())
        } else {
            l.to_string()
        }
    };
    let lines: Vec<String> = reason.lines().map(cut).collect();
    if lines.len() > 12 {
        // Keep the location and the explanation.
        format!("{}\n…\n{}", lines[..3].join("\n"), lines[lines.len() - 3..].join("\n"))
    } else {
        lines.join("\n")
    }
}

/// A device profile (SPEC §4.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// Human-readable device name, e.g. `OnePlus 12`.
    pub name: String,
    /// Where the figures come from (a paper, a datasheet, `nflash probe` and its date).
    pub source: String,
    /// Memory.
    pub memory: MemoryInfo,
    /// CPU cores and measured kernel speeds.
    pub cpu: CpuInfo,
    /// Flash storage.
    pub flash: FlashInfo,
    /// Decode kernel speeds beyond the matvec figures (the TOML's optional
    /// `[kernels]` table, written by `nflash probe`). Read from TOML files
    /// only: the profile a pack stores in its plan (SPEC §4.6) leaves it out,
    /// so packs of format 3.1 stay readable, and a plan re-made from a
    /// pack's stored profile prices the FFN at the matvec speed.
    #[serde(skip)]
    pub kernels: Option<KernelSpeeds>,
}

/// Decode kernel speeds measured by `nflash probe` (`[kernels]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelSpeeds {
    /// Sparse FFN decode through the neuron engine on one thread: bytes of
    /// the selected neurons' Q4_0 bundles (gate row, up row, down column;
    /// PowerInfer-2 §4.3) per second, GB/s. The down column is a
    /// dequantize-and-accumulate (axpy), slower per byte than the dot
    /// products the matvec figures time.
    pub q4_0_ffn_gb_s_1t: f64,
    /// The same on `cpu.threads_measured` threads, GB/s.
    pub q4_0_ffn_gb_s_mt: f64,
    /// The activation predictor's Q8_0 matrix-vector products on one
    /// thread (a low-rank projection `[r, hidden]` then `[n, r]` gate and up
    /// factors, SPEC §4.5, in the row layout), weight bytes/s, GB/s. Absent
    /// in profiles from before 2026-12-01: the matvec figures stand in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q8_0_predictor_gb_s_1t: Option<f64>,
    /// The same on `cpu.threads_measured` threads, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q8_0_predictor_gb_s_mt: Option<f64>,
    /// A decode attention block's projections on one thread, as the runtime
    /// runs them per layer: Q, K and V in one parallel region, then O
    /// (square Q4_0 matrices, ×8 layout where available), weight
    /// bytes/s, GB/s. Lower than the matvec figure by the per-layer
    /// fork–join and smaller matrices. Absent in profiles from before
    /// 2026-12-02: the matvec figures stand in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q4_0_attention_gb_s_1t: Option<f64>,
    /// The same on `cpu.threads_measured` threads, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q4_0_attention_gb_s_mt: Option<f64>,
    /// CPU time (user + system, all threads) per random 4 KiB flash read at
    /// the probe's deepest queue, µs: what each cluster read takes from the
    /// compute threads (syscall, block layer, completion interrupt, thread
    /// wake-ups). Absent in profiles from before 2026-12-02: not counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_cpu_us: Option<f64>,
    /// The extra CPU time per KiB a random read has beyond 4 KiB, µs/KiB
    /// (from the 4 KiB and 64 KiB figures). Absent: reads of every size cost `read_cpu_us`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_cpu_us_per_kib: Option<f64>,
}

/// Memory figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryInfo {
    /// Physical memory, bytes.
    pub total_bytes: u64,
    /// Memory an application can use for a model without being killed, bytes.
    pub available_bytes: u64,
    /// Sustained read bandwidth of one streaming pass, GB/s.
    pub bandwidth_gb_s: f64,
}

/// One class of identical cores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoreClass {
    /// Class name, e.g. `prime`, `performance`, `efficiency`, `x86`.
    pub class: String,
    /// Number of cores.
    pub count: u32,
    /// Maximum clock, GHz.
    pub ghz: f64,
}

/// Cores and measured dot-product speeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuInfo {
    /// Core classes, fastest first.
    pub cores: Vec<CoreClass>,
    /// Q4_0 matrix-vector speed on one thread: weight bytes streamed through
    /// the dot kernel per second, GB/s. `None` when not measured.
    #[serde(default)]
    pub q4_0_matvec_gb_s_1t: Option<f64>,
    /// The same with every core busy (`threads_measured` threads), GB/s.
    #[serde(default)]
    pub q4_0_matvec_gb_s_mt: Option<f64>,
    /// Threads used for the multi-thread figure.
    #[serde(default)]
    pub threads_measured: Option<u32>,
}

/// Flash storage figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlashInfo {
    /// Independent I/O command queues (UFS phones: 1; more I/O threads than this can hurt).
    pub io_queues: u32,
    /// Read bandwidth by block size and reads in flight.
    pub read: Vec<ReadPoint>,
}

/// Read bandwidth at one block size and queue depth.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadPoint {
    /// Bytes per read.
    pub block_bytes: u64,
    /// Reads in flight.
    pub in_flight: u32,
    /// Random reads (uniform offsets), MB/s.
    pub random_mb_s: f64,
    /// Sequential reads, MB/s.
    pub sequential_mb_s: f64,
}

impl DeviceProfile {
    /// Reads and checks a TOML profile.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read, [`Error::Profile`] if it is
    /// too large, not valid TOML, misses a field, or has impossible values.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let unreadable =
            |e: std::io::Error| Error::Profile { path: path.to_path_buf(), reason: format!("cannot read it ({e})") };
        let meta = std::fs::metadata(path).map_err(unreadable)?;
        if meta.is_dir() {
            return Err(Error::Profile { path: path.to_path_buf(), reason: "is a directory, not a TOML file".into() });
        }
        if !meta.is_file() {
            // A device node or FIFO: no size to check, and reading it may never end.
            return Err(Error::Profile {
                path: path.to_path_buf(),
                reason: "is not a regular file; a device profile is a small TOML file".into(),
            });
        }
        let too_big = |len: u64| Error::Profile {
            path: path.to_path_buf(),
            reason: format!("{len} bytes or more; a device profile is a small TOML file"),
        };
        if meta.len() > MAX_PROFILE_BYTES {
            return Err(too_big(meta.len()));
        }
        // Read at most one byte past the limit: the file may grow after the check.
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(std::fs::File::open(path).map_err(unreadable)?, MAX_PROFILE_BYTES + 1),
            &mut bytes,
        )
        .map_err(unreadable)?;
        if bytes.len() as u64 > MAX_PROFILE_BYTES {
            return Err(too_big(bytes.len() as u64));
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::Profile { path: path.to_path_buf(), reason: format!("is not UTF-8 text ({e})") })?;
        Self::parse(&text).map_err(|reason| Error::Profile { path: path.to_path_buf(), reason: shorten(&reason) })
    }

    /// Parses and checks TOML text; the error says what is wrong.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        // `[kernels]` is not a serde field of the profile (packs leave it
        // out), so it is taken out of the table before the rest is read.
        let mut table: toml::Table = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        // serde would also take an array for a struct, by position.
        for key in ["memory", "cpu", "flash", "kernels"] {
            if let Some(v) = table.get(key) {
                if !v.is_table() {
                    return Err(format!("`{key}` must be a table ([{key}]), not a {}", v.type_str()));
                }
            }
        }
        for (outer, inner) in [("cpu", "cores"), ("flash", "read")] {
            if let Some(toml::Value::Array(items)) = table.get(outer).and_then(|t| t.get(inner)) {
                if items.iter().any(|v| !v.is_table()) {
                    return Err(format!("every `{outer}.{inner}` entry must be a table ([[{outer}.{inner}]])"));
                }
            }
        }
        let kernels = match table.remove("kernels") {
            Some(k) => {
                Some(k.try_into::<KernelSpeeds>().map_err(|e| format!("[kernels]: {}", e.to_string().trim_end()))?)
            }
            None => None,
        };
        let mut p: DeviceProfile =
            table.try_into().map_err(|e: toml::de::Error| e.to_string().trim_end().to_string())?;
        p.kernels = kernels;
        p.check()?;
        Ok(p)
    }

    /// The profile as TOML (with `[kernels]` when present).
    pub fn to_toml(&self) -> String {
        let mut text = toml::to_string_pretty(self).expect("a profile always serializes");
        if let Some(k) = &self.kernels {
            text.push_str("\n[kernels]\n");
            text.push_str(&toml::to_string_pretty(k).expect("kernel speeds always serialize"));
        }
        text
    }

    fn check(&self) -> std::result::Result<(), String> {
        // Positive and plausible: no device reads or computes at less than
        // 1 kB/s, nor at more than 1 PB/s (1e6 GB/s, 1e9 MB/s; larger values
        // overflow the planner's arithmetic to infinity).
        let pos = |v: f64| v.is_finite() && (1e-6..=1e6).contains(&v);
        let pos_mb = |v: f64| v.is_finite() && (1e-6..=1e9).contains(&v);
        if self.memory.available_bytes == 0 || self.memory.available_bytes > self.memory.total_bytes {
            return Err("memory.available_bytes must be in 1..=memory.total_bytes".into());
        }
        if !pos(self.memory.bandwidth_gb_s) {
            return Err("memory.bandwidth_gb_s must be a positive number up to 1e6".into());
        }
        if self.cpu.cores.is_empty() || self.cpu.cores.iter().any(|c| c.count == 0 || c.count > 4096 || !pos(c.ghz)) {
            return Err("cpu.cores needs at least one class with count in 1..=4096 and ghz in (0, 1e6]".into());
        }
        if self.cpu.threads_measured.is_some_and(|t| t == 0 || t > 4096) {
            return Err("cpu.threads_measured must be in 1..=4096".into());
        }
        if self.cpu.threads_measured.is_none() && (self.cpu.q4_0_matvec_gb_s_mt.is_some() || self.kernels.is_some()) {
            return Err("cpu.threads_measured is needed with the multi-thread figures (cpu.q4_0_matvec_gb_s_mt, [kernels]): how many threads measured them".into());
        }
        for v in [self.cpu.q4_0_matvec_gb_s_1t, self.cpu.q4_0_matvec_gb_s_mt].into_iter().flatten() {
            if !pos(v) {
                return Err("cpu.q4_0_matvec_gb_s_* must be positive numbers up to 1e6".into());
            }
        }
        if let Some(k) = &self.kernels {
            if !pos(k.q4_0_ffn_gb_s_1t) || !pos(k.q4_0_ffn_gb_s_mt) {
                return Err("kernels.q4_0_ffn_gb_s_* must be positive numbers up to 1e6".into());
            }
            if [k.q8_0_predictor_gb_s_1t, k.q8_0_predictor_gb_s_mt].into_iter().flatten().any(|v| !pos(v)) {
                return Err("kernels.q8_0_predictor_gb_s_* must be positive numbers up to 1e6".into());
            }
            if [k.q4_0_attention_gb_s_1t, k.q4_0_attention_gb_s_mt].into_iter().flatten().any(|v| !pos(v)) {
                return Err("kernels.q4_0_attention_gb_s_* must be positive numbers up to 1e6".into());
            }
            if [k.read_cpu_us, k.read_cpu_us_per_kib]
                .into_iter()
                .flatten()
                .any(|c| !(c.is_finite() && (0.0..=1e6).contains(&c)))
            {
                return Err("kernels.read_cpu_us and read_cpu_us_per_kib must be numbers in 0 ..= 1e6".into());
            }
        }
        if self.flash.io_queues == 0 {
            return Err("flash.io_queues must be ≥ 1".into());
        }
        if self.flash.read.is_empty() {
            return Err("flash.read needs at least one [[flash.read]] point".into());
        }
        for r in &self.flash.read {
            if r.block_bytes == 0 || r.in_flight == 0 || !pos_mb(r.random_mb_s) || !pos_mb(r.sequential_mb_s) {
                return Err(format!(
                    "flash.read point at {} bytes × {} in flight: block_bytes, in_flight and both bandwidths must be positive (bandwidths 1e-6 ..= 1e9 MB/s)",
                    r.block_bytes, r.in_flight
                ));
            }
        }
        Ok(())
    }

    /// Total cores.
    pub fn n_cores(&self) -> u32 {
        self.cpu.cores.iter().map(|c| c.count).sum()
    }

    /// Best random-read bandwidth at `block_bytes`, bytes/s, over any queue
    /// depth, interpolated in log2(block size) between measured points and
    /// clamped at the ends.
    pub fn random_read_bytes_per_s(&self, block_bytes: u64) -> f64 {
        // Best figure per block size, ascending by size.
        let mut pts: Vec<(f64, f64)> = Vec::new();
        let mut sizes: Vec<u64> = self.flash.read.iter().map(|r| r.block_bytes).collect();
        sizes.sort_unstable();
        sizes.dedup();
        for s in sizes {
            let best = self.flash.read.iter().filter(|r| r.block_bytes == s).map(|r| r.random_mb_s).fold(0.0, f64::max);
            pts.push(((s as f64).log2(), best));
        }
        let x = (block_bytes.max(1) as f64).log2();
        let mb = if x <= pts[0].0 {
            pts[0].1
        } else if x >= pts[pts.len() - 1].0 {
            pts[pts.len() - 1].1
        } else {
            let i = pts.iter().position(|p| p.0 >= x).expect("inside the range");
            let (a, b) = (pts[i - 1], pts[i]);
            a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)
        };
        mb * 1e6
    }

    /// Q4_0 matrix-vector speed with `threads` threads, weight bytes/s: the
    /// measured figures when present, otherwise half the memory bandwidth
    /// shared by the threads (a conservative estimate for phones, where
    /// decode is bandwidth-bound).
    pub fn matvec_bytes_per_s(&self, threads: u32) -> f64 {
        let mem = self.memory.bandwidth_gb_s * 1e9;
        match self.cpu.q4_0_matvec_gb_s_1t {
            Some(one) => self.at_threads(one, self.cpu.q4_0_matvec_gb_s_mt, threads),
            None => mem * 0.5 * (threads.max(1) as f64 / self.n_cores().max(1) as f64).min(1.0),
        }
    }

    /// Sparse FFN decode speed with `threads` threads, bundle bytes/s: the
    /// `[kernels]` figures when present, otherwise [`Self::matvec_bytes_per_s`].
    pub fn ffn_bytes_per_s(&self, threads: u32) -> f64 {
        self.kernel_or_matvec(|k| Some((k.q4_0_ffn_gb_s_1t, Some(k.q4_0_ffn_gb_s_mt))), threads)
    }

    /// Activation predictor speed with `threads` threads, weight bytes/s:
    /// the `[kernels]` Q8_0 predictor figures when present, otherwise
    /// [`Self::matvec_bytes_per_s`].
    pub fn predictor_bytes_per_s(&self, threads: u32) -> f64 {
        self.kernel_or_matvec(|k| k.q8_0_predictor_gb_s_1t.map(|one| (one, k.q8_0_predictor_gb_s_mt)), threads)
    }

    /// Decode attention projections with `threads` threads, weight bytes/s:
    /// the `[kernels]` attention figures when present, otherwise
    /// [`Self::matvec_bytes_per_s`].
    pub fn attention_bytes_per_s(&self, threads: u32) -> f64 {
        self.kernel_or_matvec(|k| k.q4_0_attention_gb_s_1t.map(|one| (one, k.q4_0_attention_gb_s_mt)), threads)
    }

    /// A `[kernels]` speed at `threads` threads from its (1-thread,
    /// multi-thread) figures that `pick` finds, bytes/s; the matvec speed
    /// when the profile has no `[kernels]` or `pick` finds none.
    fn kernel_or_matvec(&self, pick: impl Fn(&KernelSpeeds) -> Option<(f64, Option<f64>)>, threads: u32) -> f64 {
        match self.kernels.as_ref().and_then(pick) {
            Some((one, all)) => self.at_threads(one, all, threads),
            None => self.matvec_bytes_per_s(threads),
        }
    }

    /// CPU seconds one random read of `block_bytes` costs the compute
    /// threads: `[kernels]` `read_cpu_us` + `read_cpu_us_per_kib` per KiB
    /// beyond 4 KiB; 0 when the profile has none.
    pub fn read_cpu_s(&self, block_bytes: u64) -> f64 {
        let Some(k) = &self.kernels else { return 0.0 };
        let extra_kib = (block_bytes as f64 / 1024.0 - 4.0).max(0.0);
        k.read_cpu_us.map_or(0.0, |us| (us + k.read_cpu_us_per_kib.unwrap_or(0.0) * extra_kib) * 1e-6)
    }

    /// A kernel speed at `threads` threads from its 1-thread figure `one`
    /// and its figure `all` at `cpu.threads_measured` threads (GB/s): linear
    /// in threads up to the measured count, flat beyond, capped at the
    /// memory bandwidth. Bytes/s.
    fn at_threads(&self, one: f64, all: Option<f64>, threads: u32) -> f64 {
        let n = self.cpu.threads_measured.unwrap_or(1).max(1) as f64;
        let all = all.unwrap_or(one * n);
        let t = (threads.max(1) as f64).min(n);
        let v = if n > 1.0 { one + (all - one) * (t - 1.0) / (n - 1.0) } else { one };
        (v * 1e9).min(self.memory.bandwidth_gb_s * 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceProfile {
        DeviceProfile {
            name: "t".into(),
            source: "test".into(),
            memory: MemoryInfo { total_bytes: 8 << 30, available_bytes: 4 << 30, bandwidth_gb_s: 20.0 },
            cpu: CpuInfo {
                cores: vec![CoreClass { class: "x86".into(), count: 2, ghz: 3.0 }],
                q4_0_matvec_gb_s_1t: Some(10.0),
                q4_0_matvec_gb_s_mt: Some(18.0),
                threads_measured: Some(2),
            },
            flash: FlashInfo {
                io_queues: 1,
                read: vec![
                    ReadPoint { block_bytes: 4096, in_flight: 16, random_mb_s: 200.0, sequential_mb_s: 400.0 },
                    ReadPoint { block_bytes: 65536, in_flight: 1, random_mb_s: 500.0, sequential_mb_s: 900.0 },
                    ReadPoint { block_bytes: 65536, in_flight: 16, random_mb_s: 1300.0, sequential_mb_s: 1400.0 },
                ],
            },
            kernels: Some(KernelSpeeds {
                q4_0_ffn_gb_s_1t: 4.0,
                q4_0_ffn_gb_s_mt: 7.0,
                q8_0_predictor_gb_s_1t: Some(9.0),
                q8_0_predictor_gb_s_mt: Some(15.0),
                q4_0_attention_gb_s_1t: Some(8.0),
                q4_0_attention_gb_s_mt: Some(14.0),
                read_cpu_us: Some(12.0),
                read_cpu_us_per_kib: Some(0.5),
            }),
        }
    }

    #[test]
    fn toml_round_trips_and_interpolates_in_log_block_size() {
        let p = sample();
        let back = DeviceProfile::parse(&p.to_toml()).unwrap();
        assert_eq!(p, back);
        assert_eq!(p.random_read_bytes_per_s(4096), 200e6);
        assert_eq!(p.random_read_bytes_per_s(65536), 1300e6);
        assert_eq!(p.random_read_bytes_per_s(1 << 20), 1300e6);
        // 16 KiB is half-way between 4 KiB and 64 KiB in log2.
        assert!((p.random_read_bytes_per_s(16384) - 750e6).abs() < 1.0);
        assert_eq!(p.matvec_bytes_per_s(1), 10e9);
        assert_eq!(p.matvec_bytes_per_s(2), 18e9);
        assert_eq!(p.matvec_bytes_per_s(8), 18e9);
        assert_eq!(p.ffn_bytes_per_s(1), 4e9);
        assert_eq!(p.ffn_bytes_per_s(2), 7e9);
        assert_eq!(p.predictor_bytes_per_s(1), 9e9);
        assert_eq!(p.predictor_bytes_per_s(2), 15e9);
        assert_eq!(p.attention_bytes_per_s(1), 8e9);
        assert_eq!(p.attention_bytes_per_s(2), 14e9);
        assert!((p.read_cpu_s(4096) - 12e-6).abs() < 1e-12);
        assert!((p.read_cpu_s(1024) - 12e-6).abs() < 1e-12);
        assert!((p.read_cpu_s(12288) - 16e-6).abs() < 1e-12);
        // Profiles from before these figures: matvec speed for attention, reads cost no CPU.
        let mut old = p.clone();
        let k = old.kernels.as_mut().unwrap();
        (k.q4_0_attention_gb_s_1t, k.read_cpu_us) = (None, None);
        assert_eq!(old.attention_bytes_per_s(2), 18e9);
        assert_eq!(old.read_cpu_s(8192), 0.0);
        let mut bad = p.clone();
        bad.kernels.as_mut().unwrap().read_cpu_us = Some(-1.0);
        assert!(DeviceProfile::parse(&bad.to_toml()).unwrap_err().contains("read_cpu_us"));
    }

    #[test]
    fn kernels_are_optional_in_toml_and_left_out_of_packs() {
        let p = sample();
        let text = p.to_toml();
        assert!(text.contains("[kernels]"), "{text}");
        // A profile without [kernels] (older files, oneplus-12.toml) prices the FFN at the matvec speed.
        let plain = DeviceProfile { kernels: None, ..p.clone() };
        let back = DeviceProfile::parse(&plain.to_toml()).unwrap();
        assert_eq!(back.kernels, None);
        assert_eq!(back.ffn_bytes_per_s(2), 18e9);
        // [kernels] from before the predictor figures: the predictor at the matvec speed.
        let old = DeviceProfile::parse(
            &text.replace("q8_0_predictor_gb_s_1t = 9.0\n", "").replace("q8_0_predictor_gb_s_mt = 15.0\n", ""),
        )
        .unwrap();
        assert_eq!(old.kernels.unwrap().q8_0_predictor_gb_s_1t, None);
        assert_eq!((old.predictor_bytes_per_s(2), old.ffn_bytes_per_s(2)), (18e9, 7e9));
        // The binary form stored in a pack's plan leaves [kernels] out: same bytes as before it existed.
        let bin = bincode::serialize(&p).unwrap();
        assert_eq!(bin, bincode::serialize(&plain).unwrap());
        assert_eq!(bincode::deserialize::<DeviceProfile>(&bin).unwrap(), plain);
        // Unknown keys are refused inside [kernels] and at the top level alike.
        let bad = text.replace("q4_0_ffn_gb_s_mt", "q4_0_ffn_gb_s_typo");
        assert!(DeviceProfile::parse(&bad).is_err());
        assert!(DeviceProfile::parse(&format!("colour = 1\n{text}")).unwrap_err().contains("colour"));
        let mut z = p.clone();
        z.kernels = Some(KernelSpeeds {
            q4_0_ffn_gb_s_1t: 0.0,
            q4_0_ffn_gb_s_mt: 1.0,
            q8_0_predictor_gb_s_1t: None,
            q8_0_predictor_gb_s_mt: None,
            q4_0_attention_gb_s_1t: None,
            q4_0_attention_gb_s_mt: None,
            read_cpu_us: None,
            read_cpu_us_per_kib: None,
        });
        assert!(DeviceProfile::parse(&z.to_toml()).unwrap_err().contains("kernels.q4_0_ffn_gb_s"));
    }

    #[test]
    fn arrays_for_tables_absurd_speeds_and_special_files_are_refused() {
        // serde alone would read an array as the struct's fields by position.
        let plain = DeviceProfile { kernels: None, ..sample() }.to_toml();
        let arr = format!("kernels = [4.0, 7.0]\n{plain}");
        assert!(DeviceProfile::parse(&arr).unwrap_err().contains("`kernels` must be a table"));
        // Finite but absurd figures would overflow bytes/s to infinity in the planner.
        let mut p = sample();
        p.memory.bandwidth_gb_s = 1e300;
        assert!(DeviceProfile::parse(&p.to_toml()).unwrap_err().contains("memory.bandwidth_gb_s"));
        let mut p = sample();
        p.kernels = Some(KernelSpeeds {
            q4_0_ffn_gb_s_1t: 1.0,
            q4_0_ffn_gb_s_mt: 1e7,
            q8_0_predictor_gb_s_1t: None,
            q8_0_predictor_gb_s_mt: None,
            q4_0_attention_gb_s_1t: None,
            q4_0_attention_gb_s_mt: None,
            read_cpu_us: None,
            read_cpu_us_per_kib: None,
        });
        assert!(DeviceProfile::parse(&p.to_toml()).is_err());
        let mut p = sample();
        p.cpu.threads_measured = Some(u32::MAX);
        assert!(DeviceProfile::parse(&p.to_toml()).unwrap_err().contains("threads_measured"));
        // Without it the multi-thread figures would be ignored silently.
        p.cpu.threads_measured = None;
        assert!(DeviceProfile::parse(&p.to_toml()).unwrap_err().contains("threads_measured is needed"));
        // A device node has no size to check and may never end.
        let e = DeviceProfile::load("/dev/zero").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // A long quoted line is cut; the explanation after it is kept.
        let long = format!("name = \"{}\" junk\n", "x".repeat(2000));
        let why = shorten(&DeviceProfile::parse(&long).unwrap_err());
        assert!(why.chars().count() < 1200 && why.contains('…'), "{why}");
        assert!(why.lines().last().unwrap().len() < 200 && !why.lines().last().unwrap().contains("xxxx"), "{why}");
    }

    #[test]
    fn impossible_profiles_are_refused_with_the_field_named() {
        let mut p = sample();
        p.flash.read.clear();
        assert!(DeviceProfile::parse(&p.to_toml()).unwrap_err().contains("flash.read"));
        let mut p = sample();
        p.memory.available_bytes = p.memory.total_bytes + 1;
        assert!(DeviceProfile::parse(&p.to_toml()).unwrap_err().contains("available_bytes"));
        assert!(DeviceProfile::parse("name = 1").is_err());
    }
}
