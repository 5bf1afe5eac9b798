//! The I/O pipeline (PowerInfer-2 §4.3; DESIGN.md): I/O threads read missed
//! neuron clusters from flash into cold-cache slots while the compute
//! threads work on resident and already-read clusters. Each request is one
//! `preadv` of adjacent clusters merged into one larger read.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::flash::{AlignedBuf, FlashFile, MAX_IOVECS};

/// Slot state: holds nothing (or a cluster no longer wanted).
pub const EMPTY: u8 = 0;
/// Slot state: a read into it is queued or running.
pub const PENDING: u8 = 1;
/// Slot state: holds its cluster's bytes.
pub const READY: u8 = 2;
/// Slot state: the read failed; the error is in [`Shared::error`].
pub const FAILED: u8 = 3;

/// Requests queued before `submit` blocks: room for a layer's misses plus a
/// speculative prefetch of the next (~240 single-cluster reads per layer at
/// sparsity 0.8 on the synthetic 7B; at 256 the compute thread blocked in
/// `submit` instead of running the attention). ~1.1 MB of `ReadRequest`s.
const QUEUE: usize = 2048;

/// State shared by the cache (compute side) and the I/O threads.
pub struct Shared {
    /// The pack file.
    pub flash: FlashFile,
    /// Cold region: `n_slots × slot_bytes`.
    pub slots: AlignedBuf,
    /// Bytes per slot: the largest cluster read, rounded up to the direct-I/O alignment.
    pub slot_bytes: usize,
    /// Per-slot [`EMPTY`] / [`PENDING`] / [`READY`] / [`FAILED`].
    pub state: Vec<AtomicU8>,
    /// The first read error, for the request that waits on it.
    pub error: Mutex<Option<String>>,
    /// Bytes read from flash.
    pub bytes_read: AtomicU64,
    /// `preadv` calls made.
    pub reads: AtomicU64,
}

/// One merged read: file bytes `offset ..` into slots `slots[..n]` back to
/// back, `lens[i]` bytes each; the first `need` bytes must arrive.
#[derive(Clone, Copy)]
pub struct ReadRequest {
    /// Absolute file offset (direct-I/O aligned).
    pub offset: u64,
    /// Bytes that must be read (the rest is padding, possibly past the end of the file).
    pub need: u64,
    /// Number of slots used.
    pub n: usize,
    /// Destination slots.
    pub slots: [u32; MAX_IOVECS],
    /// Bytes read into each slot (aligned).
    pub lens: [u32; MAX_IOVECS],
}

/// I/O threads and their queue.
pub struct IoPipeline {
    tx: Option<SyncSender<ReadRequest>>,
    threads: Vec<JoinHandle<()>>,
}

impl IoPipeline {
    /// Starts `n` I/O threads (at least one) reading into `shared`.
    pub fn start(shared: Arc<Shared>, n: usize) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<ReadRequest>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        // Every thread has started (and done its one-time set-up) before the first read.
        let started = Arc::new(std::sync::Barrier::new(n.max(1) + 1));
        for i in 0..n.max(1) {
            let (rx, sh, started) = (Arc::clone(&rx), Arc::clone(&shared), Arc::clone(&started));
            threads.push(std::thread::Builder::new().name(format!("nflash-io-{i}")).spawn(move || {
                started.wait();
                worker(&rx, &sh)
            })?);
        }
        started.wait();
        Ok(IoPipeline { tx: Some(tx), threads })
    }

    /// Queues a read (blocks while the queue is full).
    pub fn submit(&self, r: ReadRequest) {
        if let Some(tx) = &self.tx {
            // The workers only stop when `tx` is dropped, so this cannot fail.
            let _ = tx.send(r);
        }
    }
}

impl Drop for IoPipeline {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
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
        run(sh, &req);
    }
}

/// Performs one request and publishes the slots' states.
pub fn run(sh: &Shared, req: &ReadRequest) {
    let mut bufs: [&mut [u8]; MAX_IOVECS] = std::array::from_fn(|_| <&mut [u8]>::default());
    for i in 0..req.n {
        let s = req.slots[i] as usize;
        // SAFETY: slot `s` is PENDING: the cache handed it to this request
        // alone and no reader touches it until it is READY.
        bufs[i] = unsafe { sh.slots.slice_mut(s * sh.slot_bytes, req.lens[i] as usize) };
    }
    let res = sh.flash.read_into(req.offset, &mut bufs[..req.n], req.need);
    let state = match res {
        Ok(()) => {
            sh.bytes_read.fetch_add(req.lens[..req.n].iter().map(|&l| l as u64).sum(), Ordering::Relaxed);
            sh.reads.fetch_add(1, Ordering::Relaxed);
            READY
        }
        Err(e) => {
            if let Ok(mut g) = sh.error.lock() {
                g.get_or_insert_with(|| e.to_string());
            }
            FAILED
        }
    };
    for &s in &req.slots[..req.n] {
        // Release: the bytes written above are visible to whoever sees READY.
        sh.state[s as usize].store(state, Ordering::Release);
    }
}
