//! The pack file opened for cluster reads, and the state the cache and
//! the I/O engines ([`super::io`], [`super::uring`]) share. Reads use
//! `O_DIRECT` into page-aligned buffers so the page cache neither holds nor
//! is charged for FFN weights. Filesystems that refuse `O_DIRECT` (tmpfs,
//! some FUSE), or whose direct-I/O alignment is larger than the pack's
//! cluster alignment ([`super::align`]), get buffered reads followed by
//! `posix_fadvise(DONTNEED)`, with one warning.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use super::align;
use super::slots::{Slots, MAX_IOVECS};
use crate::error::{Error, Result};
use crate::message;

/// The pack file opened for cluster reads.
pub struct FlashFile {
    path: PathBuf,
    direct: File,
    buffered: File,
    /// Whether reads go through `direct` (`O_DIRECT`).
    use_direct: AtomicBool,
    /// Alignment of `O_DIRECT` offsets and lengths, bytes: the file
    /// system's, or the pack's cluster alignment where it does not say.
    direct_align: usize,
}

impl FlashFile {
    /// Opens `path` twice, with and without `O_DIRECT`, and checks that it is
    /// the same file (device and inode) as `expect` — the file the pack was
    /// validated from. Reads will be at offsets and of lengths that are
    /// multiples of `read_align` bytes (the pack's cluster alignment, SPEC
    /// §4.4); if the file system's direct-I/O alignment does not divide it
    /// ([`align::direct_io`]), reads go through the page cache.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn open(path: &Path, expect: &std::fs::Metadata, read_align: u64) -> Result<Self> {
        let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), err: e };
        let buffered = File::open(path).map_err(io)?;
        let meta = buffered.metadata().map_err(io)?;
        if meta.dev() != expect.dev() || meta.ino() != expect.ino() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                err: std::io::Error::other("the file was replaced after it was opened; run again"),
            });
        }
        let dio = align::dio_align(&buffered);
        let direct_align = dio.map_or(read_align, |d| d.offset as u64).max(1) as usize;
        // The O_DIRECT descriptor, or why reads go through the page cache.
        // Buffers (hot region, cold slots) are page-aligned and cut at multiples
        // of `read_align`, so that is also their addresses' alignment.
        let direct = match align::direct_io(dio, read_align, read_align as usize) {
            Err(why) => Err(why),
            Ok(()) => match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) => Ok(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Err("the file system refused O_DIRECT".into()),
                Err(e) => return Err(io(e)),
            },
        };
        let (direct, use_direct) = match direct {
            Ok(f) => (f, true),
            Err(why) => {
                warn_buffered(path, &why);
                (buffered.try_clone().map_err(io)?, false)
            }
        };
        Ok(FlashFile {
            path: path.to_path_buf(),
            direct,
            buffered,
            use_direct: AtomicBool::new(use_direct),
            direct_align,
        })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.use_direct.load(Ordering::Relaxed)
    }

    /// Reads the file from `offset` into `bufs` back to back (one `preadv`
    /// per attempt). `offset` and every buffer's length are multiples of
    /// the `read_align` given to [`FlashFile::open`], every buffer's address
    /// a multiple of [`align::buffer_align`]. The first `need` bytes must arrive;
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
            let direct = self.is_direct() && done.is_multiple_of(self.direct_align);
            let fd = self.fd(direct);
            // SAFETY: every iovec points into a live, exclusively borrowed buffer of the stated length.
            let r =
                unsafe { libc::preadv(fd, iov.as_ptr(), n_iov as libc::c_int, (offset + done as u64) as libc::off_t) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EINVAL) if direct => {
                        // The filesystem takes O_DIRECT at open but not at read.
                        if self.use_direct.swap(false, Ordering::Relaxed) {
                            warn_buffered(&self.path, "the file system refused an aligned O_DIRECT read");
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
            self.drop_cached(offset, total as u64);
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

impl FlashFile {
    /// The descriptor reads go through: the `O_DIRECT` one if `direct`.
    pub fn fd(&self, direct: bool) -> libc::c_int {
        if direct {
            self.direct.as_raw_fd()
        } else {
            self.buffered.as_raw_fd()
        }
    }

    /// After a buffered read of `len` bytes at `offset`: drops those pages
    /// from the page cache again, so they are neither held nor charged to
    /// the memory limit.
    pub fn drop_cached(&self, offset: u64, len: u64) {
        // SAFETY: plain syscall on an owned descriptor.
        unsafe {
            libc::posix_fadvise(
                self.buffered.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
    }
}

/// One warning per process for the buffered fallback, saying `why`.
fn warn_buffered(path: &Path, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        message!(
            "warning: no O_DIRECT for {} ({why}); reading neuron clusters through the page cache (dropped after each read), so memory limits may see extra page-cache use",
            path.display()
        );
    }
}

/// State shared by the cache (compute side) and the I/O threads.
pub struct Shared {
    /// The pack file.
    pub flash: FlashFile,
    /// The cold region's slots, which reads fill.
    pub slots: Slots,
    /// The first read error, for the request that waits on it.
    pub error: Mutex<Option<String>>,
    /// Bytes read from flash.
    pub bytes_read: AtomicU64,
    /// `preadv` calls made.
    pub reads: AtomicU64,
}

impl Shared {
    /// Counts a finished read of `bytes`, or keeps its error for the
    /// request that waits on it.
    pub fn record(&self, bytes: u64, res: Result<()>) {
        match res {
            Ok(()) => {
                self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
                self.reads.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                if let Ok(mut g) = self.error.lock() {
                    g.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }
}
