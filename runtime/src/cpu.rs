//! CPU topology: which cores are big and which are little. Phones have one
//! to three fast cores and several slow ones; PowerInfer-2 (arXiv 2406.06282) runs
//! compute on the big cores and I/O on the others. The topology comes from
//! sysfs (`/sys/devices/system/cpu/cpu<N>/cpufreq/cpuinfo_max_freq`, kHz);
//! `NFLASH_SYSFS_ROOT` points it at another root (tests use a fake one).
//!
//! A core is *big* if its maximum clock is at least [`BIG_SHARE`] of the
//! fastest core's. Where every core has the same clock, or sysfs does not
//! give a plausible clock for every core (most x86 VMs), all cores are
//! big and nothing is pinned.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A core is big if its maximum clock is at least this share of the
/// fastest core's: on a Snapdragon 8 Gen 3 (3.30 GHz X4, 3.15 and 2.96 GHz
/// A720s, 2.27 GHz A520s) the six X4 and A720 cores, not the A520s.
pub const BIG_SHARE: f64 = 0.8;

/// The compute thread pool: `threads` threads (`None`: the big cores where
/// a phone has big and little ones, else every core), each pinned to the
/// big cores when there are both kinds. Warns once if pinning fails.
///
/// # Errors
/// [`crate::Error::Usage`] for 0 or more than 1024 threads;
/// [`crate::Error::Thread`] when the pool cannot start.
pub fn compute_pool(threads: Option<usize>) -> crate::Result<rayon::ThreadPool> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match threads {
        Some(0) => return Err(crate::Error::Usage("--threads must be at least 1".into())),
        Some(t) if t > 1024 => {
            return Err(crate::Error::Usage(format!(
                "--threads {t} is more than 1024; use at most the number of cores ({cores})"
            )))
        }
        Some(t) if t > 4 * cores => {
            crate::message!("warning: --threads {t} is far more than the {cores} cores here; decode will be slow")
        }
        _ => {}
    }
    // Phones: compute on the big cores, one thread each, pinned there (I/O
    // threads go to the little ones: `pin_io_thread`).
    let topo = Topology::system();
    let n = threads.unwrap_or(topo.default_threads(cores));
    let pin = topo.compute_cores(n);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .start_handler(move |_| {
            if let Some(big) = &pin {
                if let Err(e) = pin_current_thread(big) {
                    warn_unpinned(&e);
                }
            }
        })
        .build()
        .map_err(|e| crate::Error::Thread { what: "compute thread pool", err: std::io::Error::other(e.to_string()) })
}

/// One warning per process when compute threads cannot be pinned.
fn warn_unpinned(e: &std::io::Error) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        crate::message!(
            "warning: could not pin compute threads to the big cores ({e}); they run where the OS puts them"
        );
    }
}

/// Plausible maximum clocks, kHz (100 MHz to 10 GHz); a value outside is
/// taken as unknown.
const KHZ_RANGE: std::ops::RangeInclusive<u64> = 100_000..=10_000_000;

/// Reads a small sysfs attribute: only a regular file (never a FIFO or a
/// device, which could block or never end), at most 64 bytes.
fn read_attr(path: &Path) -> Option<String> {
    use std::io::Read;
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::with_capacity(64);
    std::fs::File::open(path).ok()?.take(64).read_to_end(&mut buf).ok()?;
    String::from_utf8(buf).ok()
}

/// The online CPUs and their maximum clocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// `(cpu id, max clock in kHz; 0 if sysfs does not say)`, by id.
    cores: Vec<(usize, u64)>,
}

impl Topology {
    /// Reads the online CPUs under `root` (a sysfs root: `root/devices/system/cpu`).
    /// CPUs whose `online` file says 0 are left out. Returns `None` if the
    /// directory lists no CPU.
    pub fn read(root: &Path) -> Option<Topology> {
        let dir = root.join("devices/system/cpu");
        let mut cores = Vec::new();
        for e in std::fs::read_dir(&dir).ok()?.flatten().take(4096) {
            let name = e.file_name();
            // Exactly `cpu<N>` with N in canonical form, and a directory.
            let Some(id) = name.to_str().and_then(|n| n.strip_prefix("cpu")).and_then(|n| n.parse::<usize>().ok())
            else {
                continue;
            };
            if name.to_str() != Some(&format!("cpu{id}")) || !std::fs::metadata(e.path()).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            let read = |f: &str| read_attr(&e.path().join(f));
            if read("online").is_some_and(|s| s.trim() == "0") {
                continue;
            }
            let khz = read("cpufreq/cpuinfo_max_freq")
                .and_then(|s| s.trim().parse::<u64>().ok())
                .filter(|k| KHZ_RANGE.contains(k))
                .unwrap_or(0);
            cores.push((id, khz));
        }
        cores.sort_unstable();
        (!cores.is_empty()).then_some(Topology { cores })
    }

    /// This machine's topology (`NFLASH_SYSFS_ROOT`, default `/sys`), read
    /// once; if sysfs lists no CPU, as many cores as the OS reports, alike.
    pub fn system() -> &'static Topology {
        static T: OnceLock<Topology> = OnceLock::new();
        T.get_or_init(|| {
            let root = std::env::var_os("NFLASH_SYSFS_ROOT").map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
            Topology::read(&root).unwrap_or_else(|| {
                let n = std::thread::available_parallelism().map_or(1, |n| n.get());
                Topology { cores: (0..n).map(|i| (i, 0)).collect() }
            })
        })
    }

    /// Number of online cores.
    pub fn len(&self) -> usize {
        self.cores.len()
    }

    /// Whether no core is listed (never for [`Topology::system`]).
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }

    fn fastest(&self) -> u64 {
        self.cores.iter().map(|c| c.1).max().unwrap_or(0)
    }

    /// Whether every core's clock is known (else all count as big).
    fn clocks_known(&self) -> bool {
        self.cores.iter().all(|c| c.1 > 0)
    }

    fn is_big(&self, khz: u64) -> bool {
        !self.clocks_known() || khz as f64 >= BIG_SHARE * self.fastest() as f64
    }

    /// The big cores' ids (all cores where clocks are alike or unknown).
    pub fn big(&self) -> Vec<usize> {
        self.cores.iter().filter(|c| self.is_big(c.1)).map(|c| c.0).collect()
    }

    /// The little cores' ids (empty where clocks are alike or unknown).
    pub fn little(&self) -> Vec<usize> {
        self.cores.iter().filter(|c| !self.is_big(c.1)).map(|c| c.0).collect()
    }

    /// Whether there are both big and little cores (then compute and I/O
    /// threads are pinned apart).
    pub fn is_heterogeneous(&self) -> bool {
        !self.little().is_empty()
    }

    /// Core classes, fastest first: `(max clock in GHz, count, big)`, cores
    /// with the same clock in one class (for `nflash probe`'s device
    /// profile); `None` where sysfs does not give every core's clock.
    pub fn classes(&self) -> Option<Vec<(f64, usize, bool)>> {
        if !self.clocks_known() {
            return None;
        }
        let mut khz: Vec<u64> = self.cores.iter().map(|c| c.1).collect();
        khz.sort_unstable_by(|a, b| b.cmp(a));
        let mut out: Vec<(f64, usize, bool)> = Vec::new();
        for k in khz {
            let ghz = k as f64 / 1e6;
            match out.last_mut() {
                Some(last) if last.0 == ghz => last.1 += 1,
                _ => out.push((ghz, 1, self.is_big(k))),
            }
        }
        Some(out)
    }

    /// Compute threads when `--threads` is not given: one per big core
    /// where there are big and little ones (at most `4 × cores`, the
    /// cores the OS reports), else 0 (rayon's default: every core).
    pub fn default_threads(&self, cores: usize) -> usize {
        if self.is_heterogeneous() {
            self.big().len().min(4 * cores)
        } else {
            0
        }
    }

    /// The cores `threads` compute threads are pinned to: the big ones,
    /// where there are big and little cores and the threads fit on the big
    /// ones; else `None` (the OS places them).
    pub fn compute_cores(&self, threads: usize) -> Option<Vec<usize>> {
        let big = self.big();
        (self.is_heterogeneous() && threads <= big.len()).then_some(big)
    }

    /// One line for `--stats` and `nflash probe`: e.g. `8 cores: big 1-7
    /// (2.96-3.30 GHz), little 0 (2.27 GHz)`, or `2 cores, alike`.
    pub fn describe(&self) -> String {
        if !self.is_heterogeneous() {
            return format!("{} core{}, alike", self.len(), if self.len() == 1 { "" } else { "s" });
        }
        let part = |ids: &[usize]| {
            let k: Vec<u64> = self.cores.iter().filter(|c| ids.contains(&c.0)).map(|c| c.1).collect();
            let (lo, hi) = (k.iter().min().copied().unwrap_or(0), k.iter().max().copied().unwrap_or(0));
            let ghz = if lo == hi {
                format!("{:.2} GHz", hi as f64 / 1e6)
            } else {
                format!("{:.2}-{:.2} GHz", lo as f64 / 1e6, hi as f64 / 1e6)
            };
            format!("{} ({ghz})", ranges(ids))
        };
        format!("{} cores: big {}, little {}", self.len(), part(&self.big()), part(&self.little()))
    }
}

/// CPU ids as ranges: `[0, 1, 2, 5]` → `0-2,5`.
pub fn ranges(ids: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        out.push(if i == j { ids[i].to_string() } else { format!("{}-{}", ids[i], ids[j]) });
        i = j + 1;
    }
    out.join(",")
}

/// Pins the calling thread to `cpus` (`sched_setaffinity`).
///
/// # Errors
/// The OS error, e.g. `EINVAL` if none of `cpus` is online, or `EPERM`
/// where a sandbox forbids it; the thread then runs where it ran before.
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus.iter().filter(|&&c| c < max) {
        // SAFETY: `c` is below the set's size in bits (checked above).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Pins the calling I/O thread to the little cores where there are both
/// big and little ones (as PowerInfer-2 does); elsewhere does nothing. A
/// refusal is ignored: the thread runs unpinned.
pub fn pin_io_thread() {
    let t = Topology::system();
    if t.is_heterogeneous() {
        let _ = pin_current_thread(&t.little());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs root with CPUs of the given max clocks (kHz; 0: no
    /// cpufreq directory) and `offline` ids marked offline.
    fn fake(khz: &[u64], offline: &[usize]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let cpu = d.path().join("devices/system/cpu");
        std::fs::create_dir_all(cpu.join("cpufreq")).unwrap(); // not a cpuN entry
        for (i, &k) in khz.iter().enumerate() {
            let c = cpu.join(format!("cpu{i}"));
            std::fs::create_dir_all(&c).unwrap();
            if k > 0 {
                std::fs::create_dir_all(c.join("cpufreq")).unwrap();
                std::fs::write(c.join("cpufreq/cpuinfo_max_freq"), format!("{k}\n")).unwrap();
            }
            if i > 0 {
                std::fs::write(c.join("online"), if offline.contains(&i) { "0\n" } else { "1\n" }).unwrap();
            }
        }
        d
    }

    #[test]
    fn snapdragon_8_gen_3_has_six_big_cores() {
        // 2 × A520 2.27, 3 × A720 3.15, 2 × A720 2.96, 1 × X4 3.30 GHz.
        let d = fake(&[2_265_600, 2_265_600, 3_148_800, 3_148_800, 3_148_800, 2_956_800, 2_956_800, 3_302_400], &[]);
        let t = Topology::read(d.path()).unwrap();
        assert_eq!(t.len(), 8);
        assert_eq!(t.big(), vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(t.little(), vec![0, 1]);
        assert!(t.is_heterogeneous());
        assert_eq!(t.describe(), "8 cores: big 2-7 (2.96-3.30 GHz), little 0-1 (2.27 GHz)");
        assert_eq!(
            t.classes(),
            Some(vec![(3.3024, 1, true), (3.1488, 3, true), (2.9568, 2, true), (2.2656, 2, false)])
        );
        assert_eq!((t.default_threads(8), t.default_threads(1)), (6, 4));
        assert_eq!(t.compute_cores(6), Some(vec![2, 3, 4, 5, 6, 7]));
        assert_eq!(t.compute_cores(7), None, "more threads than big cores: not pinned");
    }

    #[test]
    fn alike_or_unknown_clocks_make_every_core_big() {
        let t = Topology::read(fake(&[0, 0, 0, 0], &[]).path()).unwrap();
        assert_eq!((t.big(), t.little(), t.describe()), (vec![0, 1, 2, 3], vec![], "4 cores, alike".to_string()));
        let t = Topology::read(fake(&[2_000_000; 3], &[]).path()).unwrap();
        assert!(!t.is_heterogeneous());
        assert_eq!(t.classes(), Some(vec![(2.0, 3, true)]));
        assert_eq!((t.default_threads(3), t.compute_cores(3)), (0, None));
        assert_eq!(Topology::read(fake(&[0, 0], &[]).path()).unwrap().classes(), None);
    }

    #[test]
    fn offline_cores_and_missing_sysfs() {
        let t = Topology::read(fake(&[1_800_000, 1_800_000, 2_800_000, 2_800_000], &[3]).path()).unwrap();
        assert_eq!((t.big(), t.little()), (vec![2], vec![0, 1]));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(Topology::read(empty.path()), None);
        assert!(!Topology::system().is_empty());
    }

    #[test]
    fn implausible_sysfs_entries_are_ignored() {
        // One unknown clock: all alike, not a 0 GHz little core.
        let t = Topology::read(fake(&[0, 2_000_000], &[]).path()).unwrap();
        assert_eq!((t.big(), t.is_heterogeneous()), (vec![0, 1], false));
        // Clocks outside 100 MHz..10 GHz count as unknown.
        let t = Topology::read(fake(&[u64::MAX, 2_000_000], &[]).path()).unwrap();
        assert!(!t.is_heterogeneous());
        let t = Topology::read(fake(&[99, 2_000_000], &[]).path()).unwrap();
        assert!(!t.is_heterogeneous());
        // Non-canonical names and plain files are not cores; a FIFO is not read.
        let d = fake(&[1_000_000, 3_000_000], &[]);
        let cpu = d.path().join("devices/system/cpu");
        std::fs::create_dir_all(cpu.join("cpu01")).unwrap();
        std::fs::create_dir_all(cpu.join("cpu+1")).unwrap();
        std::fs::write(cpu.join("cpu5"), "x").unwrap();
        std::fs::create_dir_all(cpu.join("cpu7/cpufreq")).unwrap();
        let fifo = std::ffi::CString::new(cpu.join("cpu7/cpufreq/cpuinfo_max_freq").to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let t = Topology::read(d.path()).unwrap();
        assert_eq!(t.cores.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 7]);
        assert!(!t.is_heterogeneous(), "cpu7's clock is unknown");
        assert_eq!(Topology { cores: vec![(0, 0)] }.describe(), "1 core, alike");
    }

    #[test]
    fn cpu_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(ranges(&[4]), "4");
        assert_eq!(ranges(&[]), "");
    }

    #[test]
    fn pinning_to_no_online_cpu_is_refused_not_fatal() {
        // A CPU id far beyond any machine's: EINVAL, and the thread runs on.
        let r = std::thread::spawn(|| pin_current_thread(&[1000])).join().unwrap();
        assert!(r.is_err());
        let ok = std::thread::spawn(|| pin_current_thread(&Topology::system().big())).join().unwrap();
        assert!(ok.is_ok(), "{ok:?}");
    }
}
