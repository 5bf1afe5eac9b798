//! Flash: random and sequential read bandwidth by block size and reads in
//! flight, over a scratch file of pseudo-random data (`O_DIRECT` where the
//! filesystem allows), and the CPU time each read costs.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nflash_format::device::ReadPoint;
use nflash_plan::layout::READ_ALIGN;
use nflash_runtime::offload::slots::AlignedBuf;

use super::{RemoveOnDrop, SplitMix, KIB, MIB};

/// Free bytes for unprivileged users on the filesystem of `dir` (statvfs).
pub(super) fn free_bytes(dir: &Path) -> Result<u64> {
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
pub(super) fn write_scratch(path: &Path, bytes: u64) -> Result<RemoveOnDrop> {
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
        f.write_all(&buf[..n]).with_context(|| format!("cannot write the scratch file {}", path.display()))?;
        written += n as u64;
    }
    f.sync_all().with_context(|| format!("cannot sync the scratch file {}", path.display()))?;
    drop_cache(&f, 0, 0);
    Ok(guard)
}

/// Opens the scratch file for reads with O_DIRECT when the filesystem accepts
/// it (EINVAL on open or on the first read means it does not). Returns the
/// file and whether it is O_DIRECT. `try_direct` false: buffered reads.
pub(super) fn open_for_reads(path: &Path, try_direct: bool) -> Result<(File, bool)> {
    let ctx = || format!("cannot open the scratch file {}", path.display());
    if try_direct && O_DIRECT != 0 {
        match OpenOptions::new().read(true).custom_flags(O_DIRECT).open(path) {
            Ok(f) => {
                let mut buf = AlignedBuf::zeroed(READ_ALIGN, "a probe read buffer")?;
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
pub(super) fn measure_reads(
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
                    let mut buf = AlignedBuf::zeroed(block as usize, "a probe read buffer")?;
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
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a reader thread panicked")))).collect()
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
pub(super) fn io_queues(read: &[ReadPoint]) -> u32 {
    let at = |n: u32| read.iter().find(|r| r.block_bytes == 4 * KIB && r.in_flight == n).map(|r| r.random_mb_s);
    match (at(1), at(16)) {
        (Some(one), Some(sixteen)) if sixteen >= 2.0 * one => read
            .iter()
            .filter(|r| r.block_bytes == 4 * KIB)
            .max_by(|a, b| a.random_mb_s.total_cmp(&b.random_mb_s))
            .map_or(1, |r| r.in_flight),
        _ => 1,
    }
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
