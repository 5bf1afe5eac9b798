//! The I/O pipeline (PowerInfer-2 §4.3; docs/DESIGN.md, step 6): I/O
//! threads (or the io_uring engine, [`super::uring`]) read missed neuron
//! clusters from flash ([`super::flash`]) into cold-region slots while the
//! compute threads work on resident and already-read clusters. Each
//! request is one `preadv` of adjacent clusters merged into one larger read.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nflash_plan::layout::IoEngine;

use super::flash::Shared;
use super::slots::ReadRequest;
use crate::error::{Error, Result};

/// Requests queued before `submit` blocks: room for a layer's misses plus a
/// speculative prefetch of the next (~240 single-cluster reads per layer at
/// sparsity 0.8 on the synthetic 7B; at 256 the compute thread blocked in
/// `submit` instead of running the attention). ~1.1 MB of `ReadRequest`s.
const QUEUE: usize = 2048;

/// The I/O pipeline: reads queued by the cache ([`Self::submit`], then
/// [`Self::flush`]) land in their slots in the background, by one of two
/// engines ([`IoEngine`]).
pub struct IoPipeline {
    engine: Engine,
    shared: Arc<Shared>,
}

enum Engine {
    /// Blocking `preadv`, one per I/O thread at a time.
    Threads { tx: Option<SyncSender<ReadRequest>>, threads: Vec<JoinHandle<()>> },
    /// One io_uring (`super::uring`).
    Uring(super::uring::UringEngine),
    /// Tests: reads that never land (held until the pipeline is dropped).
    #[cfg(test)]
    Held(Mutex<Vec<ReadRequest>>),
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
                Ok(u) => return Ok(IoPipeline { engine: Engine::Uring(u), shared }),
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
        Ok(IoPipeline { engine: Engine::Threads { tx: Some(tx), threads }, shared })
    }

    /// Tests: a pipeline whose reads never land (failed when it is dropped).
    #[cfg(test)]
    pub(crate) fn held(shared: Arc<Shared>) -> Self {
        IoPipeline { engine: Engine::Held(Mutex::new(Vec::new())), shared }
    }

    /// The engine reads go through: `"io_uring"` or `"threads"`.
    pub fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::Threads { .. } => "threads",
            Engine::Uring(_) => "io_uring",
            #[cfg(test)]
            Engine::Held(_) => "held",
        }
    }

    /// Queues a read (the threads engine blocks while its queue is full).
    /// It may not start before [`Self::flush`]. A read that cannot be
    /// queued (every I/O thread has ended) fails its slots at once rather
    /// than leaving them pending.
    pub fn submit(&self, r: ReadRequest) {
        match &self.engine {
            Engine::Threads { tx: Some(tx), .. } => {
                if let Err(e) = tx.send(r) {
                    fail(&self.shared, e.0, "the I/O threads have ended");
                }
            }
            Engine::Threads { tx: None, .. } => fail(&self.shared, r, "the I/O pipeline is stopping"),
            Engine::Uring(u) => u.submit(r),
            #[cfg(test)]
            Engine::Held(h) => h.lock().unwrap_or_else(|e| e.into_inner()).push(r),
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
        match &mut self.engine {
            Engine::Threads { tx, threads } => {
                *tx = None;
                let deadline = std::time::Instant::now() + self.shared.slots.timeout();
                for t in threads.drain(..) {
                    join_until(t, deadline, "I/O thread");
                }
            }
            // `UringEngine` waits for its reads in its own `drop`.
            Engine::Uring(_) => {}
            #[cfg(test)]
            Engine::Held(h) => {
                for r in h.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
                    fail(&self.shared, r, "held by a test");
                }
            }
        }
    }
}

/// Joins `t` if it ends before `deadline`; otherwise leaves it running
/// (detached) with a warning. An I/O thread stuck in a read that never
/// completes holds its own reference to the slots it reads into, so they
/// stay allocated (leaked) instead of being freed under the read; the
/// process goes on rather than hanging in a `join`.
pub(crate) fn join_until(t: JoinHandle<()>, deadline: std::time::Instant, what: &str) {
    while !t.is_finished() {
        if std::time::Instant::now() >= deadline {
            crate::message!("warning: an {what} is stuck in a read from flash; leaving it behind");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let _ = t.join();
}

/// Fails the slots of a read that will never be made, so that nobody
/// waits for them, and keeps `why` as the read error.
fn fail(sh: &Shared, r: ReadRequest, why: &str) {
    let res = sh.slots.fill(r, |_| Err(Error::Internal(format!("a cluster read was dropped: {why}"))));
    sh.record(0, res);
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::offload::flash::FlashFile;
    use crate::offload::slots::{Slots, FAILED, READY};
    use io_uring::IoUring;
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};

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

    /// A read that never lands: waiting for it gives up after the timeout
    /// naming the slot, claiming its slot for another read too (the slot
    /// stays the stuck read's), other slots work, and dropping the
    /// pipeline neither hangs nor leaves the slot pending.
    #[test]
    fn a_read_that_never_lands_is_an_error_in_bounded_time() {
        let a = DIRECT_ALIGN;
        let (_f, sh, io) = setup(4 * a, 4, 1, IoEngine::Threads);
        drop(io);
        let io = IoPipeline::held(Arc::clone(&sh));
        sh.slots.set_timeout(std::time::Duration::from_millis(100));
        io.submit(ReadRequest::new(0, a as u64, sh.slots.claim(0).unwrap(), a as u32));
        io.flush();
        let t = std::time::Instant::now();
        let e = sh.slots.wait(0).unwrap_err();
        assert_eq!(e.slot, 0);
        assert!(e.waited >= std::time::Duration::from_millis(100), "{e:?}");
        assert_eq!(sh.slots.claim(0).unwrap_err().slot, 0);
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "waited {:?}", t.elapsed());
        assert!(sh.slots.claim(1).is_ok(), "another slot is free");
        drop(io);
        assert_eq!(sh.slots.wait(0).unwrap().0, FAILED, "the held read failed when the pipeline ended");
    }

    /// A read submitted to a threads pipeline whose I/O threads have ended
    /// fails its slots instead of leaving them pending forever.
    #[test]
    fn a_read_that_cannot_be_queued_fails_its_slots() {
        let a = DIRECT_ALIGN;
        let (_f, sh, mut io) = setup(4 * a, 4, 1, IoEngine::Threads);
        if let Engine::Threads { tx, threads } = &mut io.engine {
            *tx = None;
            threads.drain(..).for_each(|t| t.join().unwrap());
        }
        io.submit(ReadRequest::new(0, a as u64, sh.slots.claim(2).unwrap(), a as u32));
        assert_eq!(sh.slots.wait(2).unwrap().0, FAILED);
        assert!(sh.error.lock().unwrap().as_deref().is_some_and(|m| m.contains("dropped")));
    }

    /// A file of `n` bytes where byte `i` is `i % 251`, and the pipeline over
    /// it with `threads` reads in flight by `engine`.
    pub(crate) fn setup(
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
            let mut r = ReadRequest::new(2 * a as u64, a as u64, sh.slots.claim(5).unwrap(), a as u32);
            r.try_append(3 * a as u64, a as u64, sh.slots.claim(6).unwrap(), a as u32, 1 << 20).unwrap();
            io.submit(r);
            io.submit(ReadRequest::new(7 * a as u64, a as u64, sh.slots.claim(0).unwrap(), a as u32));
            io.flush();
            for (slot, cluster) in [(5u32, 2usize), (6, 3), (0, 7)] {
                assert_eq!(sh.slots.wait(slot).unwrap().0, READY, "{engine:?}");
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
            io.submit(ReadRequest::new(a as u64, 100, sh.slots.claim(0).unwrap(), a as u32));
            io.flush();
            assert_eq!(sh.slots.wait(0).unwrap().0, READY, "{engine:?}");
            io.submit(ReadRequest::new(2 * a as u64, 10, sh.slots.claim(1).unwrap(), a as u32));
            io.flush();
            assert_eq!(sh.slots.wait(1).unwrap().0, FAILED, "{engine:?}");
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
                io.submit(ReadRequest::new(c as u64 * a as u64, a as u64, sh.slots.claim(11 - c).unwrap(), a as u32));
            }
            io.flush();
            for c in 0..12usize {
                let slot = 11 - c as u32;
                assert_eq!(sh.slots.wait(slot).unwrap().0, READY, "{engine:?} cluster {c}");
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
                io.submit(ReadRequest::new(c as u64 * a as u64, a as u64, sh.slots.claim(c).unwrap(), a as u32));
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
