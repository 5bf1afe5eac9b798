//! The io_uring engine of the I/O pipeline (`nflash_plan::layout::IoEngine`):
//! the compute thread that misses clusters puts every merged read of a
//! layer into the submission queue and starts them with one system call
//! ([`UringEngine::flush`]); one reaper thread sleeps until completions
//! arrive and publishes the slots. On the 2-core dev host a thread per
//! blocking `preadv` cost 22–26 µs of CPU per 8 KiB `O_DIRECT` read (wake-ups
//! and context switches, on the cores decode computes on) and io_uring 7–8
//! µs (fio, 100 000 random reads; docs/benchmarks.md).
//!
//! At most `depth` reads are in the kernel at once (the plan's reads in
//! flight, from the device profile's I/O queues); more wait in a queue here
//! and start as earlier ones complete. A read that completes short or with
//! an error (e.g. `O_DIRECT` refused at read time) is done again with a
//! blocking `preadv` on the reaper thread, which applies the same fallbacks
//! and error messages as the threads engine.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

use super::flash::Shared;
use super::slots::{InFlight, Published, ReadRequest};
use crate::error::{Error, Result};

/// `user_data` of the no-op that wakes the reaper to stop.
const STOP: u64 = u64::MAX;

/// The ring's reads and the reads waiting for room in it.
struct Queue {
    /// `[depth]`: the read with `user_data` i, and whether it went through
    /// the `O_DIRECT` descriptor. Allocated once and never resized, so an
    /// entry's iovecs keep their address while the kernel holds them, and a
    /// read allocates nothing.
    entries: Vec<Option<(InFlight, bool)>>,
    /// Free entry indices.
    free: Vec<u32>,
    /// Reads waiting for a free entry, in submission order.
    waiting: VecDeque<ReadRequest>,
    /// Set by `drop`: the reaper ends once every read has completed.
    stopping: bool,
}

/// An io_uring with its reaper thread.
pub struct UringEngine {
    ring: Arc<IoUring>,
    queue: Arc<Mutex<Queue>>,
    shared: Arc<Shared>,
    reaper: Option<JoinHandle<()>>,
}

fn lock(q: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    q.lock().unwrap_or_else(|e| e.into_inner())
}

impl UringEngine {
    /// A ring of `depth` entries over `shared`'s file and slots, and its
    /// reaper thread.
    ///
    /// # Errors
    /// [`Error::Io`] if the kernel refuses io_uring (too old, seccomp,
    /// SELinux, `kernel.io_uring_disabled`); [`Error::Thread`] if the reaper
    /// cannot be started.
    pub fn start(shared: Arc<Shared>, depth: usize) -> Result<Self> {
        let depth = depth.clamp(1, 4096) as u32;
        let entries = depth.next_power_of_two();
        // IORING_SETUP_COOP_TASKRUN (Linux 5.19+; plain setup before): a
        // completed read's work runs when the compute thread that submitted
        // it next enters the kernel (it yields while it waits for a cluster)
        // instead of interrupting it with an IPI mid-kernel-call. On the
        // synthetic Mixtral at half its experts in memory, decode was ~2.5%
        // faster (6 alternating runs each, docs/benchmarks.md).
        let ring = IoUring::builder()
            .setup_coop_taskrun()
            .build(entries)
            .or_else(|_| IoUring::new(entries))
            .map_err(|err| Error::Io { path: "io_uring_setup".into(), err })?;
        let ring = Arc::new(ring);
        let queue = Arc::new(Mutex::new(Queue {
            entries: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            waiting: VecDeque::new(),
            stopping: false,
        }));
        let reaper = {
            let (ring, queue, shared) = (Arc::clone(&ring), Arc::clone(&queue), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("nflash-io-uring".into())
                .spawn(move || {
                    crate::cpu::pin_io_thread();
                    reap(&ring, &queue, &shared)
                })
                .map_err(|err| Error::Thread { what: "io_uring reaper thread", err })?
        };
        Ok(UringEngine { ring, queue, shared, reaper: Some(reaper) })
    }

    /// Queues `r`: into the submission queue if fewer than `depth` reads are
    /// in the kernel, else behind them. Started by [`Self::flush`].
    pub fn submit(&self, r: ReadRequest) {
        let mut q = lock(&self.queue);
        match q.free.pop() {
            Some(i) => push(&self.ring, &self.shared, &mut q, i, r),
            None => q.waiting.push_back(r),
        }
    }

    /// Starts the queued reads: one `io_uring_enter`.
    pub fn flush(&self) {
        // An error here leaves the entries queued; the reaper's next enter submits them.
        let _ = self.ring.submit();
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        {
            let mut q = lock(&self.queue);
            q.stopping = true;
            let nop = opcode::Nop::new().build().user_data(STOP);
            // SAFETY: the submission queue is only touched under the queue
            // lock (held); a no-op references no memory.
            let pushed = unsafe { self.ring.submission_shared().push(&nop).is_ok() };
            if !pushed {
                // Full of reads not yet started: start them, then the no-op.
                let _ = self.ring.submit();
                // SAFETY: as above.
                let _ = unsafe { self.ring.submission_shared().push(&nop) };
            }
        }
        let _ = self.ring.submit();
        // The reaper returns once every read in the kernel has completed, so
        // no read writes into the slots after they are freed. A read that
        // never completes keeps the reaper (and the slots, the ring and the
        // buffers it holds through `Arc`s) alive: it is left behind after the
        // read timeout rather than joined forever.
        if let Some(t) = self.reaper.take() {
            let deadline = std::time::Instant::now() + self.shared.slots.timeout();
            super::io::join_until(t, deadline, "io_uring reaper thread");
        }
    }
}

/// Puts `r` into free entry `i` and its `READV` into the submission queue.
/// Called under the queue lock.
fn push(ring: &IoUring, sh: &Shared, q: &mut Queue, i: u32, r: ReadRequest) {
    let direct = sh.flash.is_direct();
    let offset = r.offset;
    let entry = q.entries[i as usize].insert((sh.slots.begin(r), direct));
    let iov = entry.0.iovecs();
    let sqe = opcode::Readv::new(types::Fd(sh.flash.fd(direct)), iov.as_ptr(), iov.len() as u32)
        .offset(offset)
        .build()
        .user_data(i as u64);
    // SAFETY: the submission queue is only touched under the queue lock,
    // which the caller holds. The iovecs and the buffers they describe stay
    // valid until the read's completion is reaped: the entry stays in place
    // in `entries` (never resized) until then, and the slots outlive the reaper, which holds them.
    let pushed = unsafe { ring.submission_shared().push(&sqe).is_ok() };
    if !pushed {
        // Entries not yet submitted fill the queue: submit them and retry.
        let _ = ring.submit();
        // SAFETY: as above.
        if unsafe { ring.submission_shared().push(&sqe).is_err() } {
            // Cannot happen (at most `depth` entries exist); fail the read rather than lose it.
            let (f, _) = q.entries[i as usize].take().expect("just inserted");
            sh.record(0, Err(Error::Internal("io_uring submission queue full".into())));
            sh.slots.finish(f, false);
            q.free.push(i);
        }
    }
}

/// The reaper: waits for completions, publishes their slots, starts waiting
/// reads in the entries they free; ends when stopping and idle.
fn reap(ring: &IoUring, queue: &Mutex<Queue>, sh: &Shared) {
    let mut done: Vec<(u64, i32)> = Vec::new();
    let mut finished: Vec<((InFlight, bool), i32)> = Vec::new();
    let mut landed: Vec<u32> = Vec::new();
    loop {
        if let Err(e) = ring.submit_and_wait(1) {
            if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                sh.record(0, Err(Error::Io { path: "io_uring_enter".into(), err: e }));
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        done.clear();
        // SAFETY: only this thread reads the completion queue.
        done.extend(unsafe { ring.completion_shared() }.map(|c| (c.user_data(), c.result())));
        {
            let mut q = lock(queue);
            for &(i, res) in done.iter().filter(|(i, _)| *i != STOP) {
                if let Some(e) = q.entries.get_mut(i as usize).and_then(Option::take) {
                    finished.push((e, res));
                }
            }
        }
        for (e, res) in finished.drain(..) {
            landed.extend_from_slice(complete(sh, e, res).slots());
        }
        // Start the reads waiting for the entries just freed before checking
        // what landed, so the flash keeps reading during the checks.
        let mut q = lock(queue);
        for &(i, _) in done.iter().filter(|(i, _)| *i != STOP) {
            q.free.push(i as u32);
        }
        let mut started = false;
        while !q.waiting.is_empty() && !q.free.is_empty() {
            let (i, r) = (q.free.pop().expect("checked"), q.waiting.pop_front().expect("checked"));
            push(ring, sh, &mut q, i, r);
            started = true;
        }
        let stop = q.stopping && q.free.len() == q.entries.len();
        drop(q);
        if started {
            let _ = ring.submit();
        }
        // A compute thread that needs one of these first checks it itself.
        for s in landed.drain(..) {
            sh.slots.settle(s);
        }
        if stop {
            return;
        }
    }
}

/// Publishes the slots of a read that completed with `res` (bytes read, or
/// `-errno`): landed or ready if its needed bytes arrived, else read again
/// with a blocking `preadv`, which retries, falls back from `O_DIRECT` and
/// words the error as the threads engine does. Returns its slots.
fn complete(sh: &Shared, (mut f, direct): (InFlight, bool), res: i32) -> Published {
    let (offset, need, bytes) = (f.request().offset, f.request().need, f.request().bytes());
    let result = if res >= 0 && res as u64 >= need {
        if !direct {
            sh.flash.drop_cached(offset, bytes);
        }
        Ok(())
    } else {
        f.with_buffers(|bufs| sh.flash.read_into(offset, bufs, need))
    };
    let ok = result.is_ok();
    sh.record(bytes, result);
    sh.slots.finish(f, ok)
}
