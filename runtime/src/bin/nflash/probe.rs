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
//! The scratch file is removed at the end, on error and on Ctrl-C; the
//! profile is written to `<out>.tmp-<pid>` and renamed.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::k_quants::{BlockQ4_0, GgmlType};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use nflash_format::device::{CoreClass, CpuInfo, DeviceProfile, FlashInfo, KernelSpeeds, MemoryInfo, ReadPoint};
use nflash_format::{Activation, BundleLayout, DType, FfnLayer, NeuronCluster};
use nflash_runtime::cache::LayerClusters;
use nflash_runtime::ffn::{Ffn, FfnScratch, Selection};
use nflash_runtime::weights::{DotInput, QMatrix};
use rayon::prelude::*;

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
/// Alignment of O_DIRECT buffers and offsets, bytes.
const ALIGN: usize = 4096;
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
        CLEANUP
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| p != &self.0);
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
        bail!(
            "the directory of --out, {}, does not exist; create it first or pass another --out",
            out_dir.display()
        );
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
        .ok_or_else(|| {
            anyhow!(
                "--out {} is not a file path; pass a file name such as device.toml",
                a.out.display()
            )
        })?
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
        File::create(&t.0).with_context(|| format!("cannot create files next to --out ({}); pass another --out", t.0.display()))?;
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
    let file_bytes = file_mib
        .checked_mul(MIB)
        .ok_or_else(|| anyhow!("--file-mib {file_mib} is too large"))?;
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
    let mut mat = q4_0_matrix(rows, plan.mat_cols);
    if nflash_runtime::simd::q4_0x8_available() {
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
        memory: MemoryInfo {
            total_bytes,
            available_bytes,
            bandwidth_gb_s: round(bandwidth_gb_s, 2),
        },
        cpu: CpuInfo {
            cores: vec![CoreClass {
                class: "cpu".into(),
                count: cores as u32,
                ghz: max_ghz(),
            }],
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
    let text = format!(
        "# Measured by `nflash probe` (see profiles/README.md for the fields and units).\n\n{}",
        profile.to_toml()
    );
    DeviceProfile::parse(&text)
        .map_err(|e| anyhow!("the measured profile is invalid ({e}); a measurement returned nothing"))?;

    let mut tmp_name = out_name;
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = RemoveOnDrop::new(a.out.with_file_name(tmp_name));
    {
        let mut f = File::create(&tmp.0).with_context(|| format!("cannot create {}", tmp.0.display()))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .with_context(|| format!("cannot write {}", tmp.0.display()))?;
    }
    std::fs::rename(&tmp.0, &a.out)
        .with_context(|| format!("cannot rename {} to {}", tmp.0.display(), a.out.display()))?;
    drop(tmp);

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
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .context("cannot start the thread pool")?
        .install(f)
}

/// Free bytes for unprivileged users on the filesystem of `dir` (statvfs).
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{} contains a NUL byte", dir.display()))?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("cannot statvfs {}", dir.display()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
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

/// A zeroed heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), ALIGN).context("buffer layout")?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            bail!("cannot allocate a {len}-byte buffer");
        }
        Ok(AlignedBuf { ptr, layout })
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of layout.size() initialized bytes, borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// `posix_fadvise(advice)` on `len` bytes of `file` from `off` (`len` 0: to the end); advisory, errors ignored.
fn fadvise(file: &File, off: u64, len: u64, advice: i32) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: advisory call on an open descriptor; no memory is passed.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), off as libc::off_t, len as libc::off_t, advice);
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = (file, off, len, advice);
}

#[cfg(any(target_os = "linux", target_os = "android"))]
use libc::{POSIX_FADV_DONTNEED, POSIX_FADV_NORMAL, POSIX_FADV_RANDOM};
use nflash_runtime::message;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const POSIX_FADV_DONTNEED: i32 = 0;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const POSIX_FADV_NORMAL: i32 = 0;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const POSIX_FADV_RANDOM: i32 = 0;

/// Drops the page cache of `len` bytes of `file` from `off` (`len` 0: to the end).
fn drop_cache(file: &File, off: u64, len: u64) {
    fadvise(file, off, len, POSIX_FADV_DONTNEED);
}

#[cfg(any(target_os = "linux", target_os = "android"))]
const O_DIRECT: i32 = libc::O_DIRECT;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const O_DIRECT: i32 = 0;

/// Creates `path` (new), fills it with `bytes` of pseudo-random data, syncs it
/// and drops it from the page cache.
fn write_scratch(path: &Path, bytes: u64) -> Result<RemoveOnDrop> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create the scratch file {}", path.display()))?;
    let guard = RemoveOnDrop::new(path.to_path_buf());
    let chunk = 8 * MIB as usize;
    let mut buf = vec![0u8; chunk];
    let mut rng = SplitMix(0x5EED);
    let mut written = 0u64;
    while written < bytes {
        let n = chunk.min((bytes - written) as usize);
        for w in buf[..n].chunks_exact_mut(8) {
            // `| 0x0101…` keeps every byte non-zero, so no layer can store the file sparsely or compress it away.
            w.copy_from_slice(&(rng.next() | 0x0101_0101_0101_0101).to_le_bytes());
        }
        f.write_all(&buf[..n])
            .with_context(|| format!("cannot write the scratch file {}", path.display()))?;
        written += n as u64;
    }
    f.sync_all()
        .with_context(|| format!("cannot sync the scratch file {}", path.display()))?;
    drop_cache(&f, 0, 0);
    Ok(guard)
}

/// Opens the scratch file for reads with O_DIRECT when the filesystem accepts
/// it (EINVAL on open or on the first read means it does not). Returns the
/// file and whether it is O_DIRECT. `try_direct` false: buffered reads.
fn open_for_reads(path: &Path, try_direct: bool) -> Result<(File, bool)> {
    let ctx = || format!("cannot open the scratch file {}", path.display());
    if try_direct && O_DIRECT != 0 {
        match OpenOptions::new().read(true).custom_flags(O_DIRECT).open(path) {
            Ok(f) => {
                let mut buf = AlignedBuf::new(ALIGN)?;
                match f.read_at(buf.as_mut_slice(), 0) {
                    Ok(_) => return Ok((f, true)),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot read the scratch file {}", path.display()))
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e).with_context(ctx),
        }
    }
    let f = File::open(path).with_context(ctx)?;
    Ok((f, false))
}

/// Read bandwidth, MB/s (10⁶ bytes/s), of `in_flight` threads each doing
/// blocking `block`-byte reads for `seconds`: at uniform block-aligned random
/// offsets over the whole file, or sequentially through its own contiguous
/// region of the file (wrapping around).
fn measure_reads(
    file: &File,
    file_bytes: u64,
    block: u64,
    in_flight: u32,
    random: bool,
    direct: bool,
    seconds: f64,
) -> Result<(f64, f64)> {
    drop_cache(file, 0, 0);
    // Buffered fallback: no kernel read-ahead for random reads (it would
    // count pages never asked for); normal read-ahead for sequential ones.
    fadvise(file, 0, 0, if random { POSIX_FADV_RANDOM } else { POSIX_FADV_NORMAL });
    let n_blocks = file_bytes / block;
    let region_blocks = n_blocks / in_flight as u64;
    if region_blocks == 0 {
        bail!("the scratch file is too small for {in_flight} readers of {block} bytes");
    }
    let limit = Duration::from_secs_f64(seconds);
    let cpu0 = process_cpu_s();
    let start = Instant::now();
    let results: Vec<Result<(u64, u64, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..in_flight as u64)
            .map(|t| {
                s.spawn(move || -> Result<(u64, u64, Duration)> {
                    let mut buf = AlignedBuf::new(block as usize)?;
                    let mut rng = SplitMix(0xB10C ^ (t << 32) ^ block);
                    let (mut bytes, mut i) = (0u64, 0u64);
                    loop {
                        let off = if random {
                            rng.next() % n_blocks * block
                        } else {
                            (t * region_blocks + i % region_blocks) * block
                        };
                        i += 1;
                        let n = file
                            .read_at(buf.as_mut_slice(), off)
                            .with_context(|| format!("cannot read {block} bytes of the scratch file at {off}"))?;
                        if n == 0 {
                            bail!("the scratch file ended early at offset {off}");
                        }
                        if !direct {
                            drop_cache(file, off, n as u64);
                        }
                        bytes += n as u64;
                        let el = start.elapsed();
                        if el >= limit {
                            return Ok((bytes, i, el));
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a reader thread panicked"))))
            .collect()
    });
    let cpu_s = process_cpu_s() - cpu0;
    let (mut total, mut reads, mut elapsed) = (0u64, 0u64, Duration::ZERO);
    for r in results {
        let (b, n, e) = r?;
        total += b;
        reads += n;
        elapsed = elapsed.max(e);
    }
    Ok((total as f64 / elapsed.as_secs_f64() / 1e6, cpu_s * 1e6 / reads.max(1) as f64))
}

/// User + system CPU time of this process so far (all threads), seconds.
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// `flash.io_queues` heuristic: a device with one I/O command queue (UFS
/// phones) gains little from more reads in flight, so 1 unless 16 random
/// 4 KiB reads in flight reach at least twice the 1-in-flight figure; then
/// the in-flight count with the best random 4 KiB figure.
fn io_queues(read: &[ReadPoint]) -> u32 {
    let at = |n: u32| {
        read.iter()
            .find(|r| r.block_bytes == 4 * KIB && r.in_flight == n)
            .map(|r| r.random_mb_s)
    };
    match (at(1), at(16)) {
        (Some(one), Some(sixteen)) if sixteen >= 2.0 * one => read
            .iter()
            .filter(|r| r.block_bytes == 4 * KIB)
            .max_by(|a, b| a.random_mb_s.total_cmp(&b.random_mb_s))
            .map_or(1, |r| r.in_flight),
        _ => 1,
    }
}

/// Sum of a slice with 16 independent accumulators (vectorizes).
fn sum16(c: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = c.chunks_exact(16);
    for ch in &mut it {
        for k in 0..16 {
            acc[k] += ch[k];
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

/// Streaming read bandwidth over a `bytes` f32 buffer on the current rayon
/// pool, GB/s (10⁹ bytes/s): best of 3 trials of 4 passes.
fn memory_bandwidth(bytes: usize) -> f64 {
    let n = bytes / 4;
    let mut buf = vec![0f32; n];
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        for (j, v) in c.iter_mut().enumerate() {
            *v = ((i * 7 + j) % 1024) as f32 * 1e-3 + 1.0;
        }
    });
    let passes = 4;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let mut s = 0f32;
        for _ in 0..passes {
            s += buf.par_chunks(1 << 18).map(sum16).sum::<f32>();
        }
        std::hint::black_box(s);
        best = best.max((n * 4 * passes) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// A random `rows × cols` Q4_0 matrix (`cols` a multiple of 32).
fn q4_0_matrix(rows: usize, cols: usize) -> QMatrixOwned {
    let per_row = cols / BlockQ4_0::BLCK_SIZE;
    let mut blocks = vec![BlockQ4_0::zeros(); rows * per_row];
    let mut rng = SplitMix(0x0A4);
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        row.iter_mut().for_each(|v| *v = rng.next_f32());
        BlockQ4_0::from_float(&row, &mut blocks[r * per_row..(r + 1) * per_row]);
    }
    QMatrixOwned { blocks, rows, cols, interleaved: false }
}

/// Owned Q4_0 blocks viewed as a [`QMatrix`].
struct QMatrixOwned {
    blocks: Vec<BlockQ4_0>,
    rows: usize,
    cols: usize,
    /// In the Q4_0×8 layout (`nflash_format::interleave`).
    interleaved: bool,
}

impl QMatrixOwned {
    /// Reorders the blocks to the Q4_0×8 layout (rows a multiple of 8).
    fn interleave(&mut self) {
        // SAFETY: BlockQ4_0 is a plain-old-data repr(C) type for which every
        // bit pattern is valid; the bytes are borrowed mutably from `self`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.blocks.as_mut_ptr() as *mut u8,
                self.blocks.len() * std::mem::size_of::<BlockQ4_0>(),
            )
        };
        nflash_format::interleave::interleave_q4_0(bytes, self.cols, &mut Vec::new());
        self.interleaved = true;
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: BlockQ4_0 is a plain-old-data repr(C) type; its memory read
        // as bytes is valid for len × size_of bytes while `self` is borrowed.
        unsafe {
            std::slice::from_raw_parts(
                self.blocks.as_ptr() as *const u8,
                self.blocks.len() * std::mem::size_of::<BlockQ4_0>(),
            )
        }
    }
    fn view(&self) -> QMatrix<'_> {
        if self.interleaved {
            return QMatrix::q4_0x8(self.rows, self.cols, self.bytes());
        }
        QMatrix::new(DType::Q4_0, self.rows, self.cols, self.bytes())
    }
}

/// Q4_0 matrix-vector speed on the current rayon pool, GB/s of weight bytes
/// ([`median_gb_s`] of `matvec`).
fn matvec_speed(m: &QMatrixOwned, x: &[f32], run_secs: f64) -> Result<f64> {
    let mat = m.view();
    let input = DotInput::from_slice(DType::Q4_0, x);
    let mut out = vec![0f32; mat.rows];
    median_gb_s(1, run_secs, || {
        mat.matvec(&input, &mut out);
        std::hint::black_box(&out);
        Ok(m.bytes().len() as u64)
    })
}

/// Decode attention projection speed on the current rayon pool, GB/s of
/// weight bytes: `m`'s rows cut into layers of four square `[cols, cols]`
/// matrices, each layer run as decode runs it (Q, K and V in one parallel
/// region, the O projection of the quantized Q output in another); what
/// the matvec figure leaves out is the per-layer fork–join and the smaller
/// matrices ([`median_gb_s`]).
fn attention_speed(m: &QMatrixOwned, x: &[f32], run_secs: f64) -> Result<f64> {
    let cols = m.cols;
    let bytes = m.bytes();
    // [rows, cols] per projection: square, or a quarter of `m` if it is smaller (--quick).
    let rows = cols.min(m.rows / 4) / 8 * 8;
    let sq = bytes.len() / m.rows * rows; // bytes of one projection
    let n_layers = m.rows / (4 * rows);
    let view = |i: usize| {
        let b = &bytes[i * sq..(i + 1) * sq];
        if m.interleaved { QMatrix::q4_0x8(rows, cols, b) } else { QMatrix::new(DType::Q4_0, rows, cols, b) }
    };
    let layers: Vec<[QMatrix; 4]> = (0..n_layers).map(|l| [view(4 * l), view(4 * l + 1), view(4 * l + 2), view(4 * l + 3)]).collect();
    let xin = DotInput::from_slice(DType::Q4_0, x);
    let mut attn_in = DotInput::new(DType::Q4_0);
    let (mut q, mut k, mut v, mut o) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
    let mut q_full = vec![0f32; cols]; // O's input: Q's output, zero-padded when rows < cols
    median_gb_s(1, run_secs, || {
        for [wq, wk, wv, wo] in &layers {
            nflash_runtime::weights::matvec_many(&[wq, wk, wv], &xin, &mut [&mut q, &mut k, &mut v]);
            q_full[..rows].copy_from_slice(&q);
            attn_in.set(&q_full);
            wo.matvec(&attn_in, &mut o);
        }
        std::hint::black_box((&k, &v, &o));
        Ok((n_layers * 4 * sq) as u64)
    })
}

/// GB/s of the bytes each call of `pass` returns: `warmup` calls, then the
/// median of 7 runs, each repeating `pass` for at least `run_secs`.
///
/// # Errors
/// The first error `pass` returns.
fn median_gb_s(warmup: usize, run_secs: f64, mut pass: impl FnMut() -> Result<u64>) -> Result<f64> {
    for _ in 0..warmup {
        pass()?;
    }
    let mut speeds = Vec::with_capacity(7);
    for _ in 0..7 {
        let t = Instant::now();
        let mut bytes = 0u64;
        let mut reps = 0u64;
        while reps == 0 || t.elapsed().as_secs_f64() < run_secs {
            bytes += pass()?;
            reps += 1;
        }
        speeds.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    speeds.sort_by(f64::total_cmp);
    Ok(speeds[speeds.len() / 2])
}

/// One predictor layer as decode runs it (`LayerSparse`, MLP kind): a
/// Q8_0 projection `[256, cols]`, then gate and up factors `[cols, 256]`.
struct PredictorLayer {
    proj: Vec<u8>,
    gate: Vec<u8>,
    up: Vec<u8>,
}

/// `n` predictor layers of random Q8_0 weights for hidden size `cols`.
fn predictor_layers(n: usize, cols: usize) -> Vec<PredictorLayer> {
    const R: usize = 256;
    let mut rng = SplitMix(0x9D);
    let mut mat = |rows: usize, width: usize| {
        let mut bytes = Vec::new();
        let mut row = vec![0f32; width];
        for _ in 0..rows {
            row.iter_mut().for_each(|v| *v = rng.next_f32());
            nflash_runtime::weights::quantize_row(DType::Q8_0, &row, &mut bytes);
        }
        bytes
    };
    (0..n).map(|_| PredictorLayer { proj: mat(R, cols), gate: mat(cols, R), up: mat(cols, R) }).collect()
}

/// Predictor speed on the current rayon pool, GB/s of predictor weight
/// bytes: every layer's projection of `x`, then its gate and up factors in
/// one parallel region, as `LayerSparse::predict_token` does ([`median_gb_s`]).
fn predictor_speed(layers: &[PredictorLayer], x: &[f32], run_secs: f64) -> Result<f64> {
    const R: usize = 256;
    let cols = x.len();
    let xin = DotInput::from_slice(DType::Q8_0, x);
    let mut zin = DotInput::new(DType::Q8_0);
    let (mut z, mut g, mut u) = (vec![0f32; R], vec![0f32; cols], vec![0f32; cols]);
    let bytes: usize = layers.iter().map(|l| l.proj.len() + l.gate.len() + l.up.len()).sum();
    median_gb_s(1, run_secs, || {
        for l in layers {
            QMatrix::new(DType::Q8_0, R, cols, &l.proj).matvec(&xin, &mut z);
            zin.set(&z);
            let (gm, um) = (QMatrix::new(DType::Q8_0, cols, R, &l.gate), QMatrix::new(DType::Q8_0, cols, R, &l.up));
            nflash_runtime::weights::matvec_many(&[&gm, &um], &zin, &mut [&mut g, &mut u]);
        }
        std::hint::black_box((&g, &u));
        Ok(bytes as u64)
    })
}

/// Sparse FFN decode speed of the runtime's neuron engine
/// ([`Ffn::forward_token`]) on the current rayon pool, GB/s of selected
/// bundle bytes. `bundles`' bytes are read as Q4_0 bundles (gate row, up
/// row, down column of `x.len()` elements each, SPEC §4.4), one neuron per
/// cluster, cut into layers of `layer_neurons`; each layer's neurons are
/// dealt at random into 8 disjoint selections (1/8 ≈ 12% selected, as
/// decode at sparsity 0.9). A pass runs one selection of every layer, one
/// `forward_token` call per layer as decode does, the next pass the next
/// selection, so a selection's bundles have left the caches when it comes
/// round again. Median of 7 runs of at least `run_secs`.
///
/// # Errors
/// If the engine refuses the layout (a bug: the layout is built here).
fn ffn_speed(bundles: &QMatrixOwned, layer_neurons: usize, x: &[f32], run_secs: f64) -> Result<f64> {
    let cols = x.len();
    let n = bundles.rows / 3;
    let layer_neurons = layer_neurons.clamp(1, n.max(1));
    let layout = BundleLayout::new(DType::Q4_0, cols as u64).context("FFN probe: hidden size does not fit Q4_0 blocks")?;
    let bb = layout.bundle_bytes;
    let layer = FfnLayer {
        layer: 0,
        segment: 0,
        n_neurons: n as u32,
        bundle: layout,
        cluster_align: 1,
        clusters: (0..n as u32).map(|i| NeuronCluster { offset: i as u64 * bb, first: i, n_neurons: 1 }).collect(),
        order: (0..n as u32).collect(),
        sparse: None,
    };
    let offsets: Vec<u64> = layer.clusters.iter().map(|c| c.offset).collect();
    let src = LayerClusters::Segment { data: bundles.bytes(), offsets: &offsets };
    let ffn = Ffn::new(&layer, Activation::Relu, None, None, None);
    // groups[g][layer]: selection g of each layer, ascending packed positions.
    let n_layers = n / layer_neurons;
    let mut groups: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); n_layers]; 8];
    let mut rng = SplitMix(0xFF);
    for p in 0..(n_layers * layer_neurons) as u32 {
        groups[(rng.next() % 8) as usize][p as usize / layer_neurons].push(p);
    }
    let input = DotInput::from_slice(DType::Q4_0, x);
    let mut scratch = FfnScratch::default();
    let mut out = vec![0f32; cols];
    let mut k = 0usize;
    // Eight warm-up passes: every selection once.
    median_gb_s(8, run_secs, || {
        let sels = &groups[k % groups.len()];
        k += 1;
        let mut bytes = 0u64;
        for sel in sels {
            ffn.forward_token(&src, &input, Selection::List(sel), None, &mut scratch, &mut out)?;
            bytes += sel.len() as u64 * bb;
        }
        std::hint::black_box(&out);
        Ok(bytes)
    })
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo, bytes; the available figure
/// is capped by the memory limit of this process's cgroup (v1 or v2) when smaller.
fn memory_sizes() -> Result<(u64, u64)> {
    let info = std::fs::read_to_string("/proc/meminfo").context("cannot read /proc/meminfo")?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    let total = field("MemTotal").ok_or_else(|| anyhow!("/proc/meminfo has no MemTotal"))?;
    let mut avail = field("MemAvailable").or_else(|| field("MemFree")).unwrap_or(total);
    if let Some(limit) = cgroup_limit() {
        avail = avail.min(limit);
    }
    Ok((total, avail.clamp(1, total)))
}

/// The smallest memory limit among the cgroup v1/v2 files that apply to this
/// process (the root paths and this process's own group), bytes.
fn cgroup_limit() -> Option<u64> {
    let mut paths = vec![
        PathBuf::from("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        PathBuf::from("/sys/fs/cgroup/memory.max"),
    ];
    if let Ok(s) = std::fs::read_to_string("/proc/self/cgroup") {
        for line in s.lines() {
            let mut it = line.splitn(3, ':');
            let (Some(_), Some(ctrl), Some(group)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            let group = group.trim_start_matches('/');
            if ctrl.is_empty() {
                paths.push(Path::new("/sys/fs/cgroup").join(group).join("memory.max"));
            } else if ctrl.split(',').any(|c| c == "memory") {
                paths.push(
                    Path::new("/sys/fs/cgroup/memory")
                        .join(group)
                        .join("memory.limit_in_bytes"),
                );
            }
        }
    }
    // "max" (v2, no limit) does not parse and is skipped; v1's "no limit" is a huge number.
    paths
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        .min()
}

/// Highest core clock, GHz: cpufreq's `cpuinfo_max_freq`, else the largest
/// "cpu MHz" of /proc/cpuinfo, else 1.0.
fn max_ghz() -> f64 {
    let mut best = 0f64;
    if let Ok(rd) = std::fs::read_dir("/sys/devices/system/cpu") {
        for e in rd.flatten() {
            let p = e.path().join("cpufreq/cpuinfo_max_freq");
            if let Some(khz) = std::fs::read_to_string(p)
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
            {
                best = best.max(khz / 1e6);
            }
        }
    }
    if !(best.is_finite() && best > 0.0) {
        if let Ok(s) = std::fs::read_to_string("/proc/cpuinfo") {
            for l in s.lines().filter(|l| l.starts_with("cpu MHz")) {
                if let Some(mhz) = l.split(':').nth(1).and_then(|v| v.trim().parse::<f64>().ok()) {
                    best = best.max(mhz / 1e3);
                }
            }
        }
    }
    if best.is_finite() && best > 0.0 {
        (best * 100.0).round() / 100.0
    } else {
        1.0
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(s) if ok && !s.is_empty() => s.to_string(),
        _ => "unknown host".to_string(),
    }
}

/// The current time, `YYYY-MM-DD HH:MM UTC`.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

fn print_table(p: &DeviceProfile, direct: bool, took: Duration) {
    let mut in_flight: Vec<u32> = p.flash.read.iter().map(|r| r.in_flight).collect();
    in_flight.sort_unstable();
    in_flight.dedup();
    let mut blocks: Vec<u64> = p.flash.read.iter().map(|r| r.block_bytes).collect();
    blocks.sort_unstable();
    blocks.dedup();
    let cols: Vec<String> = in_flight.iter().map(|n| format!("×{n}")).collect();
    let w = 8;
    let pad = |v: &[String]| v.iter().map(|s| format!("{s:>w$}")).collect::<String>();
    message!(
        "{} — flash read, MB/s ({}), reads in flight:",
        p.name,
        if direct { "O_DIRECT" } else { "buffered" }
    );
    message!("{:>8}  {:<w2$} | sequential", "block", "random", w2 = w * cols.len());
    message!("{:>8}  {} | {}", "", pad(&cols), pad(&cols));
    for b in blocks {
        let get = |f: fn(&ReadPoint) -> f64| -> Vec<String> {
            in_flight
                .iter()
                .map(|&n| {
                    p.flash
                        .read
                        .iter()
                        .find(|r| r.block_bytes == b && r.in_flight == n)
                        .map_or("-".to_string(), |r| format!("{:.0}", f(r)))
                })
                .collect()
        };
        message!(
            "{:>8}  {} | {}",
            format!("{} KiB", b / KIB),
            pad(&get(|r| r.random_mb_s)),
            pad(&get(|r| r.sequential_mb_s))
        );
    }
    message!("io_queues {}", p.flash.io_queues);
    message!(
        "memory: {:.1} GiB total, {:.1} GiB available, {:.1} GB/s read",
        p.memory.total_bytes as f64 / (1u64 << 30) as f64,
        p.memory.available_bytes as f64 / (1u64 << 30) as f64,
        p.memory.bandwidth_gb_s
    );
    let c = &p.cpu.cores[0];
    message!(
        "cpu: {} cores at {:.2} GHz; q4_0 matvec {:.2} GB/s on 1 thread, {:.2} GB/s on {}",
        c.count,
        c.ghz,
        p.cpu.q4_0_matvec_gb_s_1t.unwrap_or(0.0),
        p.cpu.q4_0_matvec_gb_s_mt.unwrap_or(0.0),
        p.cpu.threads_measured.unwrap_or(0)
    );
    if let Some(k) = &p.kernels {
        message!(
            "sparse FFN (q4_0 bundles, 1/8 selected): {:.2} GB/s on 1 thread, {:.2} GB/s on {}",
            k.q4_0_ffn_gb_s_1t,
            k.q4_0_ffn_gb_s_mt,
            p.cpu.threads_measured.unwrap_or(0)
        );
        if let (Some(one), Some(all)) = (k.q8_0_predictor_gb_s_1t, k.q8_0_predictor_gb_s_mt) {
            message!("predictor (q8_0, rank 256): {one:.2} GB/s on 1 thread, {all:.2} GB/s on {}", p.cpu.threads_measured.unwrap_or(0));
        }
        if let (Some(one), Some(all)) = (k.q4_0_attention_gb_s_1t, k.q4_0_attention_gb_s_mt) {
            message!("attention projections (q4_0, per layer): {one:.2} GB/s on 1 thread, {all:.2} GB/s on {}", p.cpu.threads_measured.unwrap_or(0));
        }
        if let Some(us) = k.read_cpu_us {
            message!("CPU time per random read: {us:.1} µs at 4 KiB, +{:.3} µs per KiB beyond", k.read_cpu_us_per_kib.unwrap_or(0.0));
        }
    }
    message!("probe took {:.1} s", took.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(mb_s: &[(u32, f64)]) -> Vec<ReadPoint> {
        mb_s.iter()
            .map(|&(n, mb)| ReadPoint { block_bytes: 4 * KIB, in_flight: n, random_mb_s: mb, sequential_mb_s: mb })
            .collect()
    }

    #[test]
    fn io_queues_is_one_unless_parallel_reads_double_the_rate() {
        // A UFS-like single queue: 16 in flight gain less than 2×.
        assert_eq!(io_queues(&points(&[(1, 40.0), (4, 55.0), (16, 70.0), (64, 72.0)])), 1);
        // Many queues: the in-flight count with the best figure, 64 included.
        assert_eq!(io_queues(&points(&[(1, 40.0), (4, 90.0), (16, 220.0), (64, 320.0)])), 64);
        assert_eq!(io_queues(&points(&[(1, 40.0), (4, 90.0), (16, 220.0), (64, 200.0)])), 16);
        // Without both the 1- and 16-in-flight points: 1.
        assert_eq!(io_queues(&points(&[(4, 90.0), (64, 320.0)])), 1);
    }
}
