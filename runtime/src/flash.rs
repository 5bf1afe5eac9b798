//! Reading neuron clusters from flash: `preadv` with `O_DIRECT` into
//! page-aligned buffers, so the page cache neither holds nor is charged for
//! FFN weights (DESIGN.md, I/O pipeline). Filesystems that refuse
//! `O_DIRECT` (tmpfs, some FUSE) get buffered reads followed by
//! `posix_fadvise(DONTNEED)`, with one warning.

use std::alloc::Layout;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;

use crate::message;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

/// Alignment of buffers, offsets and lengths of direct reads, bytes.
pub const DIRECT_ALIGN: usize = 4096;

/// Most buffers one read may scatter into (one per merged cluster).
pub const MAX_IOVECS: usize = 64;

/// Rounds `n` up to a multiple of [`DIRECT_ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN`], shared between
/// threads that write and read disjoint ranges (the neuron cache's regions).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain bytes; concurrent access is to disjoint ranges,
// ordered by the cache's slot states (release on write, acquire on read).
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (pages are only committed when touched).
    ///
    /// # Errors
    /// [`Error::Usage`] if the allocation fails.
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(AlignedBuf { ptr: std::ptr::null_mut(), len: 0 });
        }
        let layout = Layout::from_size_align(len, DIRECT_ALIGN).map_err(|e| Error::Usage(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Usage(format!("cannot allocate {len} bytes for the neuron cache; lower --memory-budget")));
        }
        Ok(AlignedBuf { ptr, len })
    }

    /// Length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `off .. off + n`, read-only.
    ///
    /// # Safety
    /// No thread may be writing this range (callers check the slot state).
    pub unsafe fn slice(&self, off: usize, n: usize) -> &[u8] {
        assert!(off.checked_add(n).is_some_and(|e| e <= self.len), "cache range");
        if n == 0 {
            return &[];
        }
        // SAFETY: in bounds (checked); no concurrent writer (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    /// Bytes `off .. off + n`, writable.
    ///
    /// # Safety
    /// The caller has exclusive access to this range (a slot it owns).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, n: usize) -> &mut [u8] {
        assert!(off.checked_add(n).is_some_and(|e| e <= self.len), "cache range");
        if n == 0 {
            return &mut [];
        }
        // SAFETY: in bounds (checked); exclusive (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe { std::alloc::dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, DIRECT_ALIGN)) }
        }
    }
}

/// The pack file opened for cluster reads.
pub struct FlashFile {
    path: PathBuf,
    direct: File,
    buffered: File,
    /// Whether reads go through `direct` (`O_DIRECT`).
    use_direct: AtomicBool,
}

impl FlashFile {
    /// Opens `path` twice, with and without `O_DIRECT`, and checks that it is
    /// the same file (device and inode) as `expect` — the file the pack was
    /// validated from.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn open(path: &Path, expect: &std::fs::Metadata) -> Result<Self> {
        let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), err: e };
        let buffered = File::open(path).map_err(io)?;
        let meta = buffered.metadata().map_err(io)?;
        if meta.dev() != expect.dev() || meta.ino() != expect.ino() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                err: std::io::Error::other("the file was replaced after it was opened; run again"),
            });
        }
        let (direct, use_direct) = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                warn_buffered(path);
                (buffered.try_clone().map_err(io)?, false)
            }
            Err(e) => return Err(io(e)),
        };
        Ok(FlashFile {
            path: path.to_path_buf(),
            direct,
            buffered,
            use_direct: AtomicBool::new(use_direct),
        })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.use_direct.load(Ordering::Relaxed)
    }

    /// Reads the file from `offset` into `bufs` back to back (one `preadv`
    /// per attempt). `offset` and every buffer's address and length are
    /// multiples of [`DIRECT_ALIGN`]. The first `need` bytes must arrive;
    /// bytes past the end of the file may be missing (the last cluster's
    /// padding).
    ///
    /// # Errors
    /// [`Error::Io`] on a read error, or if fewer than `need` bytes could be
    /// read (the file shrank while running).
    pub fn read_into(&self, offset: u64, bufs: &mut [&mut [u8]], need: u64) -> Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        debug_assert!(need as usize <= total && bufs.len() <= MAX_IOVECS);
        let mut done = 0usize;
        while done < total {
            // Skip the buffers already filled, then the filled part of the current one.
            let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS];
            let mut n_iov = 0;
            let mut skip = done;
            for b in bufs.iter_mut() {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                iov[n_iov] = libc::iovec { iov_base: b[skip..].as_mut_ptr().cast(), iov_len: b.len() - skip };
                skip = 0;
                n_iov += 1;
            }
            let direct = self.is_direct() && done % DIRECT_ALIGN == 0;
            let fd = if direct { self.direct.as_raw_fd() } else { self.buffered.as_raw_fd() };
            // SAFETY: every iovec points into a live, exclusively borrowed buffer of the stated length.
            let r = unsafe { libc::preadv(fd, iov.as_ptr(), n_iov as libc::c_int, (offset + done as u64) as libc::off_t) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EINVAL) if direct => {
                        // The filesystem takes O_DIRECT at open but not at read.
                        if self.use_direct.swap(false, Ordering::Relaxed) {
                            warn_buffered(&self.path);
                        }
                        continue;
                    }
                    _ => return Err(Error::Io { path: self.path.clone(), err: e }),
                }
            }
            if r == 0 {
                break; // end of file
            }
            done += r as usize;
        }
        if !self.is_direct() {
            // Buffered fallback: drop the pages again so they are not held or charged.
            // SAFETY: plain syscall on an owned descriptor.
            unsafe { libc::posix_fadvise(self.buffered.as_raw_fd(), offset as libc::off_t, total as libc::off_t, libc::POSIX_FADV_DONTNEED) };
        }
        if (done as u64) < need {
            return Err(Error::Io {
                path: self.path.clone(),
                err: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("neuron clusters at offset {offset}: read {done} of {need} bytes; the file shrank while running (truncated or replaced); copy the pack again"),
                ),
            });
        }
        Ok(())
    }
}

/// One warning per process for the buffered fallback.
fn warn_buffered(path: &Path) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        message!(
            "warning: {} does not support O_DIRECT; reading neuron clusters through the page cache (dropped after each read), so memory limits may see extra page-cache use",
            path.display()
        );
    }
}
