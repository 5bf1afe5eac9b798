//! `nflash probe`: measure this device and write a device profile (SPEC §4.6,
//! `nflash_format::DeviceProfile`).
//!
//! - Flash: a scratch file of pseudo-random data is read with `O_DIRECT`
//!   (buffered reads followed by `posix_fadvise(DONTNEED)` where the
//!   filesystem refuses `O_DIRECT`) at each block size and number of reads in
//!   flight, at uniform random block-aligned offsets and sequentially. "In
//!   flight" is N threads, each doing blocking `pread`s in a loop.
//! - Memory: a streaming sum over a large f32 buffer on every core.
//! - CPU: the runtime's own Q4_0 matrix-vector kernel on one thread and on
//!   every core; the sparse FFN decode of the neuron engine (gate/up dot
//!   products and down axpy over 1/8 of a layer's bundles, `[kernels]`).
//!
//! Measurements: [`disk`] (flash reads), [`memory`] (bandwidth and size),
//! [`kernels`] (the runtime's own kernels); [`report`] writes and prints the
//! profile.
//!
//! The scratch file is removed at the end, on error and on Ctrl-C; the
//! profile is written to `<out>.tmp-<pid>` and renamed.

mod disk;
mod kernels;
mod memory;
mod report;

use std::fs::File;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::k_quants::{BlockQ4_0, GgmlType};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use nflash_format::device::{CoreClass, CpuInfo, DeviceProfile, FlashInfo, KernelSpeeds, MemoryInfo, ReadPoint};
use nflash_runtime::message;

use disk::{free_bytes, io_queues, measure_reads, open_for_reads, write_scratch};
use kernels::{attention_speed, ffn_speed, matvec_speed, predictor_layers, predictor_speed, q4_0_matrix};
use memory::{memory_bandwidth, memory_sizes};
use report::{hostname, max_ghz, print_table, utc_now, write_profile};

/// Arguments of `nflash probe`.
#[derive(Args)]
pub struct ProbeArgs {
    /// Profile to write (TOML), e.g. profiles/my-device.toml.
    #[arg(long)]
    out: PathBuf,
    /// Directory for the scratch file of the flash measurement (default: the
    /// directory of --out). Put it on the storage models will be read from.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Scratch file size, MiB [default: 1024; 64 with --quick].
    #[arg(long)]
    file_mib: Option<u64>,
    /// Device name written in the profile [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// Seconds per measurement point [default: 0.5; 0.1 with --quick].
    #[arg(long)]
    seconds: Option<f64>,
    /// Fewer, shorter measurements, for tests: 4 KiB/64 KiB/512 KiB blocks ×
    /// 1/16 in flight, a 64 MiB file, 0.1 s per point, smaller memory and
    /// matrix-vector buffers.
    #[arg(long)]
    quick: bool,
    /// Use buffered reads as on a filesystem without O_DIRECT (tests the fallback).
    #[arg(long, hide = true)]
    buffered: bool,
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;
/// Free space left on the filesystem beyond the scratch file, bytes.
const FREE_MARGIN: u64 = 64 * MIB;

/// Files to remove if the process is interrupted (scratch file, temporary profile).
static CLEANUP: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes its file when dropped (normal end, error, panic) and, through
/// [`CLEANUP`], on Ctrl-C.
struct RemoveOnDrop(PathBuf);

impl RemoveOnDrop {
    fn new(p: PathBuf) -> Self {
        CLEANUP.lock().unwrap_or_else(|e| e.into_inner()).push(p.clone());
        RemoveOnDrop(p)
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        CLEANUP.lock().unwrap_or_else(|e| e.into_inner()).retain(|p| p != &self.0);
    }
}

/// What to measure.
struct Plan {
    blocks: Vec<u64>,
    in_flight: Vec<u32>,
    file_bytes: u64,
    seconds: f64,
    mem_bytes: usize,
    mat_rows: usize,
    mat_cols: usize,
    /// Neurons per FFN layer of the sparse FFN measurement (its bundles are
    /// the matvec matrix's bytes, 3 rows per neuron).
    ffn_neurons: usize,
    /// Layers of the predictor measurement (each a `[256, mat_cols]`
    /// projection and two `[mat_cols, 256]` factors, Q8_0: 3.3 MiB at 4096).
    predictor_layers: usize,
}

pub fn run(a: ProbeArgs) -> Result<()> {
    let out_dir = match a.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !out_dir.is_dir() {
        bail!("the directory of --out, {}, does not exist; create it first or pass another --out", out_dir.display());
    }
    if a.out.is_dir() {
        bail!(
            "--out {} is a directory; pass a file path such as {}",
            a.out.display(),
            a.out.join("device.toml").display()
        );
    }
    let out_name = a
        .out
        .file_name()
        .ok_or_else(|| anyhow!("--out {} is not a file path; pass a file name such as device.toml", a.out.display()))?
        .to_os_string();
    if let Ok(m) = std::fs::symlink_metadata(&a.out) {
        if !m.is_file() {
            bail!("--out {} exists and is not a regular file; pass a new or a regular file path", a.out.display());
        }
    }
    // Fail now, not after the measurement, if the profile cannot be written there.
    {
        let mut probe_name = out_name.clone();
        probe_name.push(format!(".tmp-{}", std::process::id()));
        let t = RemoveOnDrop::new(a.out.with_file_name(probe_name));
        File::create(&t.0)
            .with_context(|| format!("cannot create files next to --out ({}); pass another --out", t.0.display()))?;
    }
    let dir = a.dir.clone().unwrap_or_else(|| out_dir.clone());
    if !dir.is_dir() {
        bail!("--dir {} does not exist or is not a directory", dir.display());
    }
    let file_mib = a.file_mib.unwrap_or(if a.quick { 64 } else { 1024 });
    // Every reader of the deepest queue (16 quick, 64 full) gets its own 512 KiB block at least.
    let (readers, min_mib) = if a.quick { (16, 16) } else { (64, 32) };
    if file_mib < min_mib {
        bail!(
            "--file-mib {file_mib} is too small: the scratch file needs at least {min_mib} MiB ({readers} readers × 512 KiB blocks)"
        );
    }
    let file_bytes = file_mib.checked_mul(MIB).ok_or_else(|| anyhow!("--file-mib {file_mib} is too large"))?;
    let seconds = a.seconds.unwrap_or(if a.quick { 0.1 } else { 0.5 });
    if !(seconds.is_finite() && (0.01..=60.0).contains(&seconds)) {
        bail!("--seconds {seconds} must be a number in [0.01, 60]");
    }
    let plan = if a.quick {
        Plan {
            blocks: vec![4 * KIB, 64 * KIB, 512 * KIB],
            in_flight: vec![1, 16],
            file_bytes,
            seconds,
            mem_bytes: 64 << 20,
            mat_rows: 3072,
            mat_cols: 4096,
            ffn_neurons: 256,
            predictor_layers: 2,
        }
    } else {
        Plan {
            blocks: [4, 16, 64, 128, 256, 512].iter().map(|k| k * KIB).collect(),
            // 64 in flight: on the dev VM's virtio disk, 64 I/O threads ran
            // decode 10–20% faster than 16 where reads dominate (sparsity
            // 0.8 and 0.6 at half the FFN, 2026-12-02); `io_queues` picks
            // the best count and the planner starts that many I/O threads.
            in_flight: vec![1, 4, 16, 64],
            file_bytes,
            seconds,
            mem_bytes: 256 << 20,
            // 1008 MiB of Q4_0, the size of a 7B model's attention weights:
            // decode's weights are out of the last-level cache and spread
            // over many pages. At 72 MiB (before 2026-12-02) the matvec,
            // attention and FFN figures were 15–30% above what decode reached
            // (page walks over gigabytes of 4 KiB pages); at 9 MiB the matrix
            // stays cached and ran 1.4× faster still. Fewer rows if memory is short.
            mat_rows: 28 * 4 * 4096,
            mat_cols: 4096,
            // FFN layers of 11008 neurons (llama-7b) dealt over the same bytes.
            ffn_neurons: 11008,
            // 80 MiB: out of the last-level cache, as decode's predictors are.
            predictor_layers: 24,
        }
    };
    let free = free_bytes(&dir)?;
    if free < plan.file_bytes + FREE_MARGIN {
        bail!(
            "not enough free space in {}: the scratch file needs {} MiB (+{} MiB margin), {} MiB are free; \
             pass a smaller --file-mib or another --dir",
            dir.display(),
            file_mib,
            FREE_MARGIN / MIB,
            free / MIB
        );
    }

    let _ = ctrlc::set_handler(|| {
        let paths = CLEANUP.lock().map(|g| g.clone()).unwrap_or_default();
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
        // message!, not eprintln!, which panics when stderr is a closed pipe:
        // a panic here would end this thread without exiting the process.
        message!("\ninterrupted: removed the scratch file");
        std::process::exit(130);
    });

    let name = a.name.clone().unwrap_or_else(hostname);
    let started = Instant::now();
    let n_points = plan.blocks.len() * plan.in_flight.len();
    let pb = ProgressBar::new((2 * n_points + 10) as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:>18} [{elapsed_precise}] {wide_bar} {pos}/{len}").expect("static template"),
    );

    // Flash.
    let scratch_path = dir.join(format!(".nflash-probe-{}.scratch", std::process::id()));
    pb.set_message("scratch file");
    let scratch = write_scratch(&scratch_path, plan.file_bytes)?;
    pb.inc(1);
    let (file, direct) = open_for_reads(&scratch.0, !a.buffered)?;
    if !direct {
        pb.suspend(|| {
            message!(
                "warning: {}; using buffered reads with posix_fadvise(DONTNEED) after each read \
                 (figures may include some caching)",
                if a.buffered {
                    "--buffered given".to_string()
                } else {
                    format!("the filesystem of {} refuses O_DIRECT", dir.display())
                }
            )
        });
    }
    let mut read = Vec::with_capacity(n_points);
    let (mut cpu_4k, mut cpu_64k) = (None, None);
    for &block in &plan.blocks {
        for &n in &plan.in_flight {
            let label = format!("{} KiB × {n}", block / KIB);
            pb.set_message(format!("random {label}"));
            let (random_mb_s, cpu_us) = measure_reads(&file, plan.file_bytes, block, n, true, direct, plan.seconds)?;
            // 4 and 64 KiB at the deepest queue: CPU per cluster read, by size.
            if n == *plan.in_flight.iter().max().unwrap_or(&1) {
                if block == 4 * KIB {
                    cpu_4k = Some(cpu_us);
                } else if block == 64 * KIB {
                    cpu_64k = Some(cpu_us);
                }
            }
            pb.inc(1);
            pb.set_message(format!("sequential {label}"));
            let (sequential_mb_s, _) = measure_reads(&file, plan.file_bytes, block, n, false, direct, plan.seconds)?;
            pb.inc(1);
            read.push(ReadPoint {
                block_bytes: block,
                in_flight: n,
                random_mb_s: round(random_mb_s, 1),
                sequential_mb_s: round(sequential_mb_s, 1),
            });
        }
    }
    drop(file);
    drop(scratch);
    let io_queues = io_queues(&read);

    // Memory.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    pb.set_message("memory bandwidth");
    let bandwidth_gb_s = in_threads(cores, || Ok(memory_bandwidth(plan.mem_bytes)))?;
    pb.inc(1);
    let (total_bytes, available_bytes) = memory_sizes()?;

    // CPU.
    pb.set_message("q4_0 matvec");
    // At most a quarter of the available memory, in whole attention layers (4 × 4096 rows).
    let row_bytes = (plan.mat_cols / BlockQ4_0::BLCK_SIZE * std::mem::size_of::<BlockQ4_0>()) as u64;
    let unit = 4 * plan.mat_cols.min(plan.mat_rows / 4) as u64;
    let rows = (plan.mat_rows as u64).min(available_bytes / 4 / row_bytes / unit * unit).max(unit) as usize;
    let mut mat = q4_0_matrix(rows, plan.mat_cols)?;
    if nflash_runtime::kernels::x8_available() {
        mat.interleave(); // as `nflash run` lays out resident Q4_0 matrices
    }
    let x: Vec<f32> = {
        let mut r = SplitMix(7);
        (0..plan.mat_cols).map(|_| r.next_f32()).collect()
    };
    let run_secs = (plan.seconds / 5.0).max(0.02);
    // A kernel's speed on one thread, then on every core.
    let on_1_and_all = |what: &str, f: &(dyn Fn() -> Result<f64> + Sync)| -> Result<(f64, f64)> {
        pb.set_message(format!("{what} 1 thread"));
        let one = in_threads(1, f)?;
        pb.inc(1);
        pb.set_message(format!("{what} {cores} threads"));
        let all = in_threads(cores, f)?;
        pb.inc(1);
        Ok((one, all))
    };
    let (one, all) = on_1_and_all("q4_0 matvec", &|| matvec_speed(&mat, &x, run_secs))?;
    let (attn_one, attn_all) = on_1_and_all("attention", &|| attention_speed(&mat, &x, run_secs))?;
    let (ffn_one, ffn_all) = on_1_and_all("sparse FFN", &|| ffn_speed(&mat, plan.ffn_neurons, &x, run_secs))?;
    drop(mat);
    let pred = predictor_layers(plan.predictor_layers, plan.mat_cols);
    let (pred_one, pred_all) = on_1_and_all("predictor", &|| predictor_speed(&pred, &x, run_secs))?;
    drop(pred);
    pb.finish_and_clear();

    let dir_abs = std::fs::canonicalize(&dir).unwrap_or(dir.clone());
    let source = format!(
        "nflash probe {}{} on {} ({}), file {} MiB in {}; io_queues heuristic: 1 unless 16-in-flight random 4 KiB reads \
         reach ≥ 2× the 1-in-flight figure, then the in-flight count with the best random 4 KiB figure",
        env!("CARGO_PKG_VERSION"),
        if a.quick { " --quick (small matrices that stay in cache: CPU figures too high for planning)" } else { "" },
        utc_now(),
        if direct { "O_DIRECT" } else { "buffered" },
        file_mib,
        dir_abs.display()
    );
    let profile = DeviceProfile {
        name,
        source,
        memory: MemoryInfo { total_bytes, available_bytes, bandwidth_gb_s: round(bandwidth_gb_s, 2) },
        cpu: CpuInfo {
            cores: core_classes(cores),
            q4_0_matvec_gb_s_1t: Some(round(one, 2)),
            q4_0_matvec_gb_s_mt: Some(round(all, 2)),
            threads_measured: Some(cores as u32),
        },
        flash: FlashInfo { io_queues, read },
        kernels: Some(KernelSpeeds {
            q4_0_ffn_gb_s_1t: round(ffn_one, 2),
            q4_0_ffn_gb_s_mt: round(ffn_all, 2),
            q8_0_predictor_gb_s_1t: Some(round(pred_one, 2)),
            q8_0_predictor_gb_s_mt: Some(round(pred_all, 2)),
            q4_0_attention_gb_s_1t: Some(round(attn_one, 2)),
            q4_0_attention_gb_s_mt: Some(round(attn_all, 2)),
            read_cpu_us: cpu_4k.map(|c| round(c, 1)),
            read_cpu_us_per_kib: cpu_4k.zip(cpu_64k).map(|(a, b)| round(((b - a) / 60.0).max(0.0), 3)),
        }),
    };
    write_profile(&a.out, out_name, &profile)?;
    print_table(&profile, direct, started.elapsed());
    message!("wrote {}", a.out.display());
    Ok(())
}

/// `v` rounded to `digits` decimals for a readable profile; unrounded if that would give 0.
fn round(v: f64, digits: i32) -> f64 {
    let k = 10f64.powi(digits);
    let r = (v * k).round() / k;
    if r > 0.0 {
        r
    } else {
        v
    }
}

/// Runs `f` inside a rayon pool of `n` threads.
fn in_threads<T: Send>(n: usize, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    rayon::ThreadPoolBuilder::new().num_threads(n).build().context("cannot start the thread pool")?.install(f)
}

/// Deterministic pseudo-random numbers (splitmix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn next_f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// The CPU's core classes, fastest first, from the sysfs topology
/// (`nflash_runtime::cpu`): `big` or `little` by clock, one class per
/// distinct maximum clock. Where sysfs gives no clocks, one class `cpu` of
/// `cores` cores at the fastest clock `/proc/cpuinfo` reports.
fn core_classes(cores: usize) -> Vec<CoreClass> {
    let Some(classes) = nflash_runtime::cpu::Topology::system().classes() else {
        return vec![CoreClass { class: "cpu".into(), count: cores as u32, ghz: max_ghz() }];
    };
    classes
        .into_iter()
        .map(|(ghz, n, big)| CoreClass {
            class: if big { "big" } else { "little" }.into(),
            count: n as u32,
            ghz: round(ghz, 2),
        })
        .collect()
}
