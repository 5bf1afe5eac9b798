//! Page size and direct-I/O alignment of the running system, never a
//! constant: Android 15 phones may run 16 KiB pages, and a file system may
//! ask `O_DIRECT` reads for an alignment larger than the 4 KiB a pack's
//! clusters are aligned to (formats/SPEC.md §4.4, `cluster_align`).
//!
//! - [`page_size`]: `sysconf(_SC_PAGESIZE)`; buffers that reads land in
//!   are aligned to it.
//! - [`dio_align`]: what `statx(STATX_DIOALIGN)` (Linux ≥ 6.1) reports for
//!   the pack file; [`direct_io`] decides from it whether cluster reads can
//!   bypass the page cache.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::sync::OnceLock;

/// The system's page size, bytes (`sysconf(_SC_PAGESIZE)`; 4096 if the
/// call fails, which POSIX allows only for unknown names). Cached.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a system constant; no memory is passed.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 && (p as usize).is_power_of_two() {
            p as usize
        } else {
            4096
        }
    })
}

/// Alignment of buffers in memory that `O_DIRECT` reads land in, bytes: the
/// page size, and never less than 4096.
pub fn buffer_align() -> usize {
    page_size().max(4096)
}

/// Direct-I/O alignment of one open file, bytes (`statx`'s
/// `stx_dio_mem_align` and `stx_dio_offset_align`; both 0 when the file
/// does not support `O_DIRECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Alignment of the buffer's address and length.
    pub mem: u32,
    /// Alignment of the file offset and the length.
    pub offset: u32,
}

/// The kernel's `struct statx` (include/uapi/linux/stat.h), up to the
/// direct-I/O fields, padded to its 256 bytes. Declared here because the
/// libc crate exposes `statx` on glibc but not on musl.
#[repr(C)]
struct Statx {
    mask: u32,
    blksize: u32,
    attributes: u64,
    nlink: u32,
    uid: u32,
    gid: u32,
    mode: u16,
    _pad1: u16,
    ino: u64,
    size: u64,
    blocks: u64,
    attributes_mask: u64,
    /// atime, btime, ctime, mtime: 16 bytes each.
    _times: [u64; 8],
    rdev_major: u32,
    rdev_minor: u32,
    dev_major: u32,
    dev_minor: u32,
    mnt_id: u64,
    dio_mem_align: u32,
    dio_offset_align: u32,
    _spare: [u64; 12],
}
const _: () = assert!(std::mem::size_of::<Statx>() == 256);

/// `STATX_DIOALIGN` (Linux 6.1).
const STATX_DIOALIGN: u32 = 0x2000;

/// What `statx(STATX_DIOALIGN)` reports for `file`; `None` when the kernel
/// is older than Linux 6.1 or the file system does not say (then only a
/// read can tell, and [`super::flash::FlashFile`] falls back to buffered reads
/// if an aligned `O_DIRECT` read is refused).
pub fn dio_align(file: &File) -> Option<DioAlign> {
    // SAFETY: all-zero bytes are a valid `Statx` (plain integers).
    let mut st: Statx = unsafe { std::mem::zeroed() };
    // SAFETY: the raw statx system call on an open descriptor with an empty
    // path and AT_EMPTY_PATH; the kernel writes at most 256 bytes, the size
    // of `st`, which lives for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_statx,
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            STATX_DIOALIGN,
            &mut st as *mut Statx,
        )
    };
    if r != 0 || st.mask & STATX_DIOALIGN == 0 {
        return None;
    }
    Some(DioAlign { mem: st.dio_mem_align, offset: st.dio_offset_align })
}

/// Whether cluster reads of a pack whose clusters are aligned to
/// `cluster_align` bytes (and rounded up to it in length) can go through
/// `O_DIRECT` into buffers whose addresses are multiples of `buf_align`,
/// given the file's direct-I/O alignment `dio` (`None`: not reported, try).
///
/// # Errors
/// The reason, for the one-line notice that reads go through the page
/// cache instead.
pub fn direct_io(dio: Option<DioAlign>, cluster_align: u64, buf_align: usize) -> Result<(), String> {
    // Not reported, or both 0 ("no direct I/O" — but qemu-user also passes
    // zeros through): try, and let a refused open or read fall back.
    let Some(d) = dio.filter(|d| d.offset != 0 && d.mem != 0) else { return Ok(()) };
    if !cluster_align.is_multiple_of(d.offset as u64) {
        return Err(format!(
            "the file system's direct-I/O alignment is {} bytes, larger than the pack's {}-byte cluster alignment",
            d.offset, cluster_align
        ));
    }
    if !buf_align.is_multiple_of(d.mem as usize) {
        return Err(format!(
            "the file system wants read buffers aligned to {} bytes, more than nflash's {buf_align}",
            d.mem
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_is_the_systems() {
        let p = page_size();
        assert!(p.is_power_of_two() && p >= 4096, "page size {p}");
        assert_eq!(buffer_align() % p, 0);
        // As `getconf PAGESIZE` says, where it exists.
        if let Ok(o) = std::process::Command::new("getconf").arg("PAGESIZE").output() {
            let s = String::from_utf8_lossy(&o.stdout);
            if let Ok(g) = s.trim().parse::<usize>() {
                assert_eq!(p, g, "sysconf against getconf");
            }
        }
    }

    #[test]
    fn direct_io_decisions() {
        let d = |mem, offset| Some(DioAlign { mem, offset });
        assert_eq!(direct_io(None, 4096, 4096), Ok(()), "not reported: try O_DIRECT");
        assert_eq!(direct_io(d(4, 512), 4096, 4096), Ok(()));
        assert_eq!(direct_io(d(512, 4096), 4096, 16384), Ok(()), "16 KiB pages, 4 KiB blocks");
        let e = direct_io(d(4, 16384), 4096, 16384).unwrap_err();
        assert!(e.contains("16384") && e.contains("4096"), "{e}");
        assert_eq!(direct_io(d(0, 0), 4096, 4096), Ok(()), "zeros: try, the open or read tells");
        assert!(direct_io(d(8192, 512), 4096, 4096).unwrap_err().contains("8192"));
    }

    #[test]
    fn statx_reports_a_consistent_alignment_or_nothing() {
        let f = tempfile::tempfile().unwrap();
        if let Some(d) = dio_align(&f) {
            // Either no O_DIRECT (tmpfs: both 0) or powers of two.
            assert!((d.mem == 0) == (d.offset == 0), "{d:?}");
            assert!(d.mem == 0 || (d.mem.is_power_of_two() && d.offset.is_power_of_two()), "{d:?}");
        }
    }
}
