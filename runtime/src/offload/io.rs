//! The I/O pipeline (PowerInfer-2 §4.3; docs/DESIGN.md, step 6): I/O
//! threads read missed neuron clusters from flash into cold-region slots
//! while the compute threads work on resident and already-read clusters.
//! Each request is one `preadv` of adjacent clusters merged into one larger
//! read, with `O_DIRECT` into page-aligned buffers so the page cache
//! neither holds nor is charged for FFN weights. Filesystems that refuse
//! `O_DIRECT` (tmpfs, some FUSE), or whose direct-I/O alignment is larger
//! than the pack's cluster alignment ([`super::align`]), get buffered reads
//! followed by `posix_fadvise(DONTNEED)`, with one warning.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nflash_plan::layout::IoEngine;

use super::align;
use super::slots::{ReadRequest, Slots, MAX_IOVECS};
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

/// Requests queued before `submit` blocks: room for a layer's misses plus a
/// speculative prefetch of the next (~240 single-cluster reads per layer at
/// sparsity 0.8 on the synthetic 7B; at 256 the compute thread blocked in
/// `submit` instead of running the attention). ~1.1 MB of `ReadRequest`s.
const QUEUE: usize = 2048;

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

/// The I/O pipeline: reads queued by the cache ([`Self::submit`], then
/// [`Self::flush`]) land in their slots in the background, by one of two
/// engines ([`IoEngine`]).
pub struct IoPipeline {
    engine: Engine,
}

enum Engine {
    /// Blocking `preadv`, one per I/O thread at a time.
    Threads { tx: Option<SyncSender<ReadRequest>>, threads: Vec<JoinHandle<()>> },
    /// One io_uring (`super::uring`).
    Uring(super::uring::UringEngine),
}

impl IoPipeline {
    /// Starts the pipeline reading into `shared` with at most `n` reads in
    /// flight (at least one): io_uring if `engine` allows it and the kernel
    /// does, else `n` I/O threads.
    ///
    /// # Errors
    /// [`Error::Thread`] if a thread cannot be started; [`Error::Usage`] if
    /// `engine` is [`IoEngine::Uring`] and the kernel refuses io_uring.
    pub fn start(shared: Arc<Shared>, n: usize, engine: IoEngine) -> Result<Self> {
        let n = n.max(1);
        if engine != IoEngine::Threads {
            match super::uring::UringEngine::start(Arc::clone(&shared), n) {
                Ok(u) => return Ok(IoPipeline { engine: Engine::Uring(u) }),
                Err(e) if engine == IoEngine::Uring => {
                    return Err(Error::Usage(format!(
                        "io_uring is not available here ({e}); run with --io-engine threads (or auto)"
                    )))
                }
                Err(_) => {}
            }
        }
        Self::start_threads(shared, n)
    }

    fn start_threads(shared: Arc<Shared>, n: usize) -> Result<Self> {
        let (tx, rx) = sync_channel::<ReadRequest>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        // Every thread has started before the first read. If one cannot be
        // started, returning drops `tx`, so the ones already running end.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        for i in 0..n {
            let (rx, sh, ready) = (Arc::clone(&rx), Arc::clone(&shared), ready_tx.clone());
            let t = std::thread::Builder::new()
                .name(format!("nflash-io-{i}"))
                .spawn(move || {
                    crate::cpu::pin_io_thread();
                    let _ = ready.send(());
                    worker(&rx, &sh)
                })
                .map_err(|err| Error::Thread { what: "I/O thread", err })?;
            threads.push(t);
        }
        for _ in 0..threads.len() {
            let _ = ready_rx.recv();
        }
        Ok(IoPipeline { engine: Engine::Threads { tx: Some(tx), threads } })
    }

    /// The engine reads go through: `"io_uring"` or `"threads"`.
    pub fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::Threads { .. } => "threads",
            Engine::Uring(_) => "io_uring",
        }
    }

    /// Queues a read (the threads engine blocks while its queue is full).
    /// It may not start before [`Self::flush`].
    pub fn submit(&self, r: ReadRequest) {
        match &self.engine {
            Engine::Threads { tx: Some(tx), .. } => {
                // The workers only stop when `tx` is dropped, so this cannot fail.
                let _ = tx.send(r);
            }
            Engine::Threads { tx: None, .. } => {}
            Engine::Uring(u) => u.submit(r),
        }
    }

    /// Starts the reads queued so far (io_uring: one system call for all of them).
    pub fn flush(&self) {
        if let Engine::Uring(u) = &self.engine {
            u.flush();
        }
    }
}

impl Drop for IoPipeline {
    fn drop(&mut self) {
        if let Engine::Threads { tx, threads } = &mut self.engine {
            *tx = None;
            for t in threads.drain(..) {
                let _ = t.join();
            }
        }
        // `UringEngine` waits for its reads in its own `drop`.
    }
}

fn worker(rx: &Mutex<Receiver<ReadRequest>>, sh: &Shared) {
    loop {
        let req = {
            let Ok(rx) = rx.lock() else { return };
            match rx.recv() {
                Ok(r) => r,
                Err(_) => return,
            }
        };
        run(sh, req);
    }
}

/// Performs one request and publishes its slots' states (READY or FAILED).
pub fn run(sh: &Shared, req: ReadRequest) {
    let (offset, need, bytes) = (req.offset, req.need, req.bytes());
    let res = sh.slots.fill(req, |bufs| sh.flash.read_into(offset, bufs, need));
    sh.record(bytes, res);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload::slots::{FAILED, READY};
    use io_uring::IoUring;
    use std::io::Write;

    /// Cluster alignment of the test files, bytes (what `prep` writes).
    const DIRECT_ALIGN: usize = 4096;

    /// The engines this kernel runs: threads, and io_uring unless refused
    /// (containers may forbid it; then only threads are tested, with a note).
    fn engines() -> Vec<IoEngine> {
        match IoUring::new(2) {
            Ok(_) => vec![IoEngine::Threads, IoEngine::Uring],
            Err(e) => {
                eprintln!("note: io_uring refused here ({e}); testing the threads engine only");
                vec![IoEngine::Threads]
            }
        }
    }

    /// A file of `n` bytes where byte `i` is `i % 251`, and the pipeline over
    /// it with `threads` reads in flight by `engine`.
    fn setup(
        n: usize,
        slots: usize,
        threads: usize,
        engine: IoEngine,
    ) -> (tempfile::NamedTempFile, Arc<Shared>, IoPipeline) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&(0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>()).unwrap();
        f.flush().unwrap();
        let meta = std::fs::metadata(f.path()).unwrap();
        let shared = Arc::new(Shared {
            flash: FlashFile::open(f.path(), &meta, DIRECT_ALIGN as u64).unwrap(),
            slots: Slots::new(slots, DIRECT_ALIGN).unwrap(),
            error: Mutex::new(None),
            bytes_read: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        });
        let io = IoPipeline::start(Arc::clone(&shared), threads, engine).unwrap();
        assert_eq!(io.engine_name(), if engine == IoEngine::Uring { "io_uring" } else { "threads" });
        (f, shared, io)
    }

    #[test]
    fn queued_reads_land_in_their_slots() {
        let a = DIRECT_ALIGN;
        for engine in engines() {
            let (_f, sh, io) = setup(8 * a, 8, 3, engine);
            // Slots 5, 6 as one merged read of clusters 2-3; slot 0 alone for cluster 7.
            let mut r = ReadRequest::new(2 * a as u64, a as u64, sh.slots.claim(5), a as u32);
            r.try_append(3 * a as u64, a as u64, sh.slots.claim(6), a as u32, 1 << 20).unwrap();
            io.submit(r);
            io.submit(ReadRequest::new(7 * a as u64, a as u64, sh.slots.claim(0), a as u32));
            io.flush();
            for (slot, cluster) in [(5u32, 2usize), (6, 3), (0, 7)] {
                assert_eq!(sh.slots.wait(slot).0, READY, "{engine:?}");
                let got = sh.slots.ready_bytes(slot, a).unwrap();
                assert!(
                    got.iter().enumerate().all(|(i, &b)| b == ((cluster * a + i) % 251) as u8),
                    "{engine:?} slot {slot}"
                );
            }
            drop(io);
            assert_eq!(sh.bytes_read.load(Ordering::Relaxed), 3 * a as u64, "{engine:?}");
            assert_eq!(sh.reads.load(Ordering::Relaxed), 2, "{engine:?}");
        }
    }

    #[test]
    fn a_read_past_the_end_fails_and_says_why() {
        let a = DIRECT_ALIGN;
        for engine in engines() {
            let (_f, sh, io) = setup(2 * a, 2, 1, engine);
            // The last cluster's padding may be missing; its bundles may not.
            io.submit(ReadRequest::new(a as u64, 100, sh.slots.claim(0), a as u32));
            io.flush();
            assert_eq!(sh.slots.wait(0).0, READY, "{engine:?}");
            io.submit(ReadRequest::new(2 * a as u64, 10, sh.slots.claim(1), a as u32));
            io.flush();
            assert_eq!(sh.slots.wait(1).0, FAILED, "{engine:?}");
            let msg = sh.error.lock().unwrap().clone().unwrap();
            assert!(msg.contains("read 0 of 10 bytes"), "{engine:?}: {msg}");
        }
    }

    #[test]
    fn more_reads_than_in_flight_wait_their_turn_and_all_land() {
        let a = DIRECT_ALIGN;
        for engine in engines() {
            // 2 reads in flight at most, 12 queued at once.
            let (_f, sh, io) = setup(12 * a, 12, 2, engine);
            for c in 0..12u32 {
                io.submit(ReadRequest::new(c as u64 * a as u64, a as u64, sh.slots.claim(11 - c), a as u32));
            }
            io.flush();
            for c in 0..12usize {
                let slot = 11 - c as u32;
                assert_eq!(sh.slots.wait(slot).0, READY, "{engine:?} cluster {c}");
                let got = sh.slots.ready_bytes(slot, a).unwrap();
                assert!(got.iter().enumerate().all(|(i, &b)| b == ((c * a + i) % 251) as u8), "{engine:?} {c}");
            }
            assert_eq!(sh.reads.load(Ordering::Relaxed), 12, "{engine:?}");
        }
    }

    #[test]
    fn dropping_the_pipeline_waits_for_reads_in_flight() {
        let a = DIRECT_ALIGN;
        for engine in engines() {
            let (_f, sh, io) = setup(16 * a, 16, 4, engine);
            for c in 0..16u32 {
                io.submit(ReadRequest::new(c as u64 * a as u64, a as u64, sh.slots.claim(c), a as u32));
            }
            io.flush();
            drop(io);
            // Every read has landed (none is still writing into a slot).
            for s in 0..16 {
                assert_eq!(sh.slots.state(s), READY, "{engine:?} slot {s}");
            }
        }
    }
}
