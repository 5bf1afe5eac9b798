//! The aligned buffers of the neuron cache and who owns them: every `unsafe`
//! that hands a byte range to one thread lives in this file.
//!
//! - [`AlignedBuf`]: a zeroed heap buffer aligned for direct I/O. Its own
//!   API is safe (`&` to read, `&mut` to write): the hot region is filled
//!   through `&mut` at load and only read after.
//! - [`Slots`]: the cold region, `n` fixed-size slots shared by the compute
//!   threads and the I/O threads. Each slot has a state: [`EMPTY`] →
//!   [`PENDING`] (claimed for a read by the compute side, [`Slots::claim`])
//!   → [`READY`] or [`FAILED`] (published by the I/O thread that read it,
//!   release ordering) → read by the compute side (acquire ordering). A
//!   claim that carries the cluster's CRC-32C ([`Slots::claim_checked`])
//!   goes [`PENDING`] → [`LANDED`] → [`CHECKING`] → [`READY`] or
//!   [`CORRUPT`]: the I/O thread publishes every slot of a read as landed
//!   at once, then checks them one by one ([`Slots::settle`]), and a
//!   compute thread that needs a landed cluster before the I/O thread got
//!   to it checks it itself instead of waiting ([`Slots::wait`]); whoever
//!   moves it to [`CHECKING`] first checks it, the other waits. A
//!   [`Claim`] is the only way to put a slot into a [`ReadRequest`], and
//!   neither can be copied, so a pending slot is written by exactly one
//!   request and read by nobody until it is published.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use super::align::buffer_align;

use crate::error::{Error, Result};

/// Most buffers one read may scatter into (one per merged cluster).
pub const MAX_IOVECS: usize = 64;

/// Slot state: holds nothing (or a cluster no longer wanted).
pub const EMPTY: u8 = 0;
/// Slot state: a read into it is queued or running.
pub const PENDING: u8 = 1;
/// Slot state: holds its cluster's bytes.
pub const READY: u8 = 2;
/// Slot state: the read failed.
pub const FAILED: u8 = 3;
/// Slot state: the read landed but the cluster's CRC-32C does not match
/// (formats/SPEC.md §4.10); [`Slots::seen_crc`] holds what was computed.
pub const CORRUPT: u8 = 4;
/// Slot state: the read of a checked claim landed; its CRC-32C is not yet checked.
pub const LANDED: u8 = 5;
/// Slot state: one thread is checking the landed cluster's CRC-32C.
pub const CHECKING: u8 = 6;

/// A zeroed buffer of anonymous memory mapped for it alone, so aligned to
/// the page size ([`buffer_align`], as `O_DIRECT` reads into it need);
/// pages are only committed when touched, and [`AlignedBuf::discard`] gives
/// them back to the system (the heap would keep freed memory: the binaries
/// set `M_TRIM_THRESHOLD` high).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    /// The mapping `ptr` points into (unmapped on drop); `None` when empty.
    map: Option<memmap2::MmapMut>,
}

// SAFETY: the buffer is plain bytes owned by this value; shared access goes
// through `&self` (read-only) or, for the cold region, through `Slots`,
// whose slot states order every write before the reads.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes.
    ///
    /// # Errors
    /// [`Error::Alloc`] naming `what` and the size if the allocation fails.
    pub fn zeroed(len: usize, what: &'static str) -> Result<Self> {
        if len == 0 {
            return Ok(AlignedBuf { ptr: std::ptr::null_mut(), len: 0, map: None });
        }
        let mut map = memmap2::MmapMut::map_anon(len).map_err(|_| Error::Alloc { what, bytes: len as u64 })?;
        let ptr = map.as_mut_ptr();
        if !(ptr as usize).is_multiple_of(buffer_align()) {
            return Err(Error::Alloc { what, bytes: len as u64 });
        }
        Ok(AlignedBuf { ptr, len, map: Some(map) })
    }

    /// Gives the whole pages inside bytes `off .. off + n` back to the
    /// system (`madvise(MADV_DONTNEED)`): resident memory falls at once, and
    /// the range reads as zeros until written again. Returns the bytes given
    /// back (the range rounded inwards to pages; 0 where the system refuses).
    ///
    /// # Safety
    /// No thread may be reading or writing the range, nor use what it held.
    unsafe fn discard(&self, off: usize, n: usize) -> usize {
        let Some(map) = &self.map else { return 0 };
        assert!(off.checked_add(n).is_some_and(|e| e <= self.len), "discard {off}+{n} of {}", self.len);
        let page = super::align::page_size();
        let (start, end) = (off.next_multiple_of(page), (off + n) / page * page);
        if end <= start {
            return 0;
        }
        // SAFETY: in bounds of our own private anonymous mapping; nobody
        // uses the range (caller's contract), and DONTNEED only makes it
        // read as zeros.
        match unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) } {
            Ok(()) => end - start,
            Err(_) => 0,
        }
    }

    /// Length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer, read-only.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: a live allocation of `len` initialized (zeroed) bytes; no
        // `&mut` to it can coexist with this borrow of `self`, and `Slots`
        // never lends its buffer out as a whole.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The whole buffer, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as `as_slice`, borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Bytes `off .. off + n`, or `None` past the end. Shared buffers are
    /// written only through [`Self::fill`] and emptied through
    /// [`Self::give_back`], whose callers promise that nobody reads the range.
    pub fn get(&self, off: usize, n: usize) -> Option<&[u8]> {
        if off.checked_add(n)? > self.len {
            return None;
        }
        // SAFETY: in bounds; no thread writes the range (the contract of
        // `fill` and `give_back`, the only writers of a shared buffer).
        Some(unsafe { self.range(off, n) })
    }

    /// Runs `f` on bytes `off .. off + n`, writable, through a shared buffer.
    ///
    /// # Safety
    /// Nobody reads or writes the range meanwhile, nor holds a slice of it
    /// from [`Self::get`].
    pub unsafe fn fill<R>(&self, off: usize, n: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        // SAFETY: exclusive (caller's contract); `range_mut` checks the bounds.
        f(unsafe { self.range_mut(off, n) })
    }

    /// Gives the whole pages of bytes `off .. off + n` back to the system
    /// ([`Self::discard`]); returns the bytes given back.
    ///
    /// # Safety
    /// As [`Self::fill`]; what the range held is lost.
    pub unsafe fn give_back(&self, off: usize, n: usize) -> usize {
        // SAFETY: the caller's contract.
        unsafe { self.discard(off, n) }
    }

    /// Bytes `off .. off + n`, read-only, through the raw pointer (for
    /// [`Slots`], which shares the buffer between threads).
    ///
    /// # Safety
    /// No thread may be writing this range.
    unsafe fn range(&self, off: usize, n: usize) -> &[u8] {
        assert!(off.checked_add(n).is_some_and(|e| e <= self.len), "slot range {off}+{n} of {}", self.len);
        if n == 0 {
            return &[];
        }
        // SAFETY: in bounds (checked); no concurrent writer (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    /// Bytes `off .. off + n`, writable, through the raw pointer.
    ///
    /// # Safety
    /// The caller has exclusive access to this range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range_mut(&self, off: usize, n: usize) -> &mut [u8] {
        assert!(off.checked_add(n).is_some_and(|e| e <= self.len), "slot range {off}+{n} of {}", self.len);
        if n == 0 {
            return &mut [];
        }
        // SAFETY: in bounds (checked); exclusive (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }
}

/// The right to fill one slot: made by [`Slots::claim`] (the slot is then
/// [`PENDING`]) and used up by [`ReadRequest`]. Neither `Clone` nor `Copy`.
#[derive(Debug, PartialEq, Eq)]
pub struct Claim(u32);

impl Claim {
    /// The claimed slot's index.
    pub fn slot(&self) -> u32 {
        self.0
    }
}

/// One merged read: file bytes `offset ..` into the claimed slots back to
/// back, `lens[i]` bytes each; the first `need` bytes must arrive (the rest
/// is direct-I/O padding, possibly past the end of the file).
pub struct ReadRequest {
    /// Absolute file offset (direct-I/O aligned).
    pub offset: u64,
    /// Bytes that must be read.
    pub need: u64,
    /// Number of slots used.
    n: usize,
    /// Destination slots (claimed).
    slots: [u32; MAX_IOVECS],
    /// Bytes read into each slot (aligned).
    lens: [u32; MAX_IOVECS],
}

impl ReadRequest {
    /// A read of `need` bytes at `offset` into the claimed slot, `len` bytes
    /// (`need` rounded up to the direct-I/O alignment).
    pub fn new(offset: u64, need: u64, claim: Claim, len: u32) -> Self {
        let mut r = ReadRequest { offset, need, n: 1, slots: [0; MAX_IOVECS], lens: [0; MAX_IOVECS] };
        r.slots[0] = claim.0;
        r.lens[0] = len;
        r
    }

    /// End of the bytes read (offset + every slot's length).
    pub fn end(&self) -> u64 {
        self.offset + self.lens[..self.n].iter().map(|&l| l as u64).sum::<u64>()
    }

    /// Appends the cluster at `offset` (`need` bytes, read as `len`) if it
    /// starts where this read ends, a slot is left, and the read stays
    /// within `max_bytes`; otherwise gives the claim back.
    ///
    /// # Errors
    /// The claim, when the cluster does not fit.
    pub fn try_append(
        &mut self,
        offset: u64,
        need: u64,
        claim: Claim,
        len: u32,
        max_bytes: u64,
    ) -> std::result::Result<(), Claim> {
        let end = self.end();
        if end != offset || self.n >= MAX_IOVECS || end + len as u64 - self.offset > max_bytes {
            return Err(claim);
        }
        self.slots[self.n] = claim.0;
        self.lens[self.n] = len;
        self.n += 1;
        self.need = offset + need - self.offset;
        Ok(())
    }

    /// The destination slots.
    pub fn slots(&self) -> &[u32] {
        &self.slots[..self.n]
    }

    /// Bytes of every slot, summed.
    pub fn bytes(&self) -> u64 {
        self.lens[..self.n].iter().map(|&l| l as u64).sum()
    }
}

/// A read in progress ([`Slots::begin`]): the request and the iovecs of its
/// slots' buffers, which only this value may write until [`Slots::finish`].
pub struct InFlight {
    req: ReadRequest,
    iov: [libc::iovec; MAX_IOVECS],
}

// SAFETY: the iovecs point into the cold region, which outlives every read
// (the I/O pipeline ends before `Slots` is dropped), and only the holder of
// this value writes there; it is handed between threads, never shared.
unsafe impl Send for InFlight {}

impl InFlight {
    /// The request being read.
    pub fn request(&self) -> &ReadRequest {
        &self.req
    }

    /// The slots' buffers as iovecs (`[n_slots]`), for `preadv` or an
    /// io_uring `READV`: valid while this value lives.
    pub fn iovecs(&self) -> &[libc::iovec] {
        &self.iov[..self.req.n]
    }

    /// Runs `f` on the slots' buffers (back to back, `lens[i]` bytes each).
    pub fn with_buffers<R>(&mut self, f: impl FnOnce(&mut [&mut [u8]]) -> R) -> R {
        let mut bufs: [&mut [u8]; MAX_IOVECS] = std::array::from_fn(|_| <&mut [u8]>::default());
        for (b, v) in bufs.iter_mut().zip(&self.iov[..self.req.n]) {
            // SAFETY: `v` describes a slot buffer this value owns (see
            // `Slots::begin`), borrowed exclusively through `&mut self`.
            *b = unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len) };
        }
        f(&mut bufs[..self.req.n])
    }
}

/// The slots of a read just published by [`Slots::finish`].
pub struct Published {
    slots: [u32; MAX_IOVECS],
    n: usize,
}

impl Published {
    /// The slots, in the read's order.
    pub fn slots(&self) -> &[u32] {
        &self.slots[..self.n]
    }
}

/// How long a thread waits for one cluster read by default ([`Slots::wait`],
/// and [`Slots::claim`] for a read still running into the slot it takes)
/// before it gives up: reads from flash take milliseconds, so a read that
/// has not landed in this time is stuck (a dead device, a hung FUSE or
/// network file system), and an app must get an error rather than freeze.
pub const READ_TIMEOUT: Duration = Duration::from_secs(20);

/// Rounds a wait for a slot spins before it yields the core ([`Slots::wait`]).
const SPINS: u32 = 64;

/// A wait that ran out ([`Slots::wait`], [`Slots::claim`]): the slot's read
/// has not landed after [`Slots::timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stalled {
    /// The slot whose read is stuck.
    pub slot: u32,
    /// How long was waited.
    pub waited: Duration,
}

/// The cold region: `n` slots of `slot_bytes` each, with their states.
pub struct Slots {
    /// How long a wait for a read may last, milliseconds ([`READ_TIMEOUT`]).
    timeout_ms: AtomicU64,
    buf: AlignedBuf,
    slot_bytes: usize,
    state: Vec<AtomicU8>,
    /// Per slot: bytes of the claimed cluster to check (0 = not checked),
    /// set by [`Slots::claim_checked`].
    check_len: Vec<AtomicU32>,
    /// Per slot: the claimed cluster's expected CRC-32C.
    want: Vec<AtomicU32>,
    /// Per slot: the CRC-32C computed of a [`CORRUPT`] read.
    seen: Vec<AtomicU32>,
}

impl Slots {
    /// `n` empty slots of `slot_bytes` bytes (a multiple of the direct-I/O alignment).
    ///
    /// # Errors
    /// [`Error::Alloc`] if the region cannot be allocated (or its size overflows).
    pub fn new(n: usize, slot_bytes: usize) -> Result<Self> {
        let bytes = n.checked_mul(slot_bytes).ok_or(Error::Alloc { what: "the cold region", bytes: u64::MAX })?;
        Ok(Slots {
            timeout_ms: AtomicU64::new(READ_TIMEOUT.as_millis() as u64),
            buf: AlignedBuf::zeroed(bytes, "the cold region")?,
            slot_bytes,
            state: (0..n).map(|_| AtomicU8::new(EMPTY)).collect(),
            check_len: (0..n).map(|_| AtomicU32::new(0)).collect(),
            want: (0..n).map(|_| AtomicU32::new(0)).collect(),
            seen: (0..n).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// How long [`Self::wait`] and [`Self::claim`] wait for a read.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Sets how long [`Self::wait`] and [`Self::claim`] wait for a read
    /// (default [`READ_TIMEOUT`]; at least 1 ms).
    pub fn set_timeout(&self, t: Duration) {
        self.timeout_ms.store((t.as_millis() as u64).max(1), Ordering::Relaxed);
    }

    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Bytes of the whole region.
    pub fn region_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Slot `s`'s state now (acquire).
    pub fn state(&self, s: u32) -> u8 {
        self.state[s as usize].load(Ordering::Acquire)
    }

    /// Takes slot `s` for a new read: waits until a read still running into
    /// it (from a request nobody waits for any more) has landed, then marks
    /// it [`PENDING`]. The caller (the cache's LRU, under its lock) makes sure
    /// no reader uses the slot's old contents any more.
    ///
    /// # Errors
    /// [`Stalled`] if that read has not landed after [`Self::timeout`] (the
    /// slot stays its read's: its buffer is never handed to another).
    pub fn claim(&self, s: u32) -> std::result::Result<Claim, Stalled> {
        let st = &self.state[s as usize];
        // A landed cluster nobody needed may still be checked by the I/O
        // thread: take it from LANDED first (then that thread's check does
        // not start), or wait until a check already running has ended.
        let mut deadline = None;
        loop {
            let now = st.load(Ordering::Acquire);
            if now == PENDING || now == CHECKING {
                self.backoff(s, &mut deadline)?;
            } else if st.compare_exchange(now, PENDING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                break;
            }
        }
        self.check_len[s as usize].store(0, Ordering::Relaxed);
        Ok(Claim(s))
    }

    /// One round of waiting for slot `s`: the first call sets the deadline
    /// ([`Self::timeout`] from now); the first [`SPINS`] rounds spin, later
    /// ones yield the core.
    ///
    /// # Errors
    /// [`Stalled`] once the deadline has passed.
    fn backoff(&self, s: u32, deadline: &mut Option<(Instant, u32)>) -> std::result::Result<(), Stalled> {
        let (t0, n) = deadline.get_or_insert_with(|| (Instant::now(), 0));
        *n += 1;
        if *n <= SPINS {
            std::hint::spin_loop();
            return Ok(());
        }
        // Reading the clock every round would cost more than the wait.
        if (*n).is_multiple_of(64) {
            let waited = t0.elapsed();
            if waited >= self.timeout() {
                return Err(Stalled { slot: s, waited });
            }
        }
        std::thread::yield_now();
        Ok(())
    }

    /// As [`Self::claim`], for a cluster whose first `len` bytes (its
    /// bundles, at least 1) must have CRC-32C `crc` (formats/SPEC.md
    /// §4.10): the read lands as [`LANDED`] and is checked by the thread
    /// that completed it ([`Self::settle`]) or by a compute thread that
    /// needs it first ([`Self::wait`]). The expectation reaches those
    /// threads with the request and the slot state (release/acquire).
    ///
    /// # Errors
    /// As [`Self::claim`].
    pub fn claim_checked(&self, s: u32, len: u32, crc: u32) -> std::result::Result<Claim, Stalled> {
        let c = self.claim(s)?;
        self.want[s as usize].store(crc, Ordering::Relaxed);
        self.check_len[s as usize].store(len, Ordering::Relaxed);
        Ok(c)
    }

    /// Empties slot `s` and gives its memory back to the system
    /// ([`AlignedBuf::discard`]), unless a read or a check is running in it
    /// ([`PENDING`], [`CHECKING`]): then `None`. Returns the bytes given back.
    /// The caller (the cache's LRU, under its lock) makes sure no reader uses
    /// the slot's contents any more and gives it no new read meanwhile.
    pub fn discard(&self, s: u32) -> Option<usize> {
        let st = &self.state[s as usize];
        // From LANDED too: the I/O thread's check then does not start (as in `claim`).
        let taken = [EMPTY, READY, FAILED, CORRUPT, LANDED]
            .iter()
            .any(|&from| st.compare_exchange(from, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok());
        if !taken {
            return None;
        }
        // SAFETY: the slot is EMPTY: no read is running into it (that needs a
        // claim, which only the caller makes), and no reader uses it
        // (caller's contract).
        Some(unsafe { self.buf.discard(s as usize * self.slot_bytes, self.slot_bytes) })
    }

    /// Marks a slot whose read failed or whose cluster was damaged as
    /// [`EMPTY`] (a later fetch reads it again); returns whether it was either.
    pub fn forget_failed(&self, s: u32) -> bool {
        let st = &self.state[s as usize];
        [FAILED, CORRUPT]
            .iter()
            .any(|&from| st.compare_exchange(from, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok())
    }

    /// The CRC-32C computed of slot `s`'s cluster when its state is [`CORRUPT`].
    pub fn seen_crc(&self, s: u32) -> u32 {
        self.seen[s as usize].load(Ordering::Acquire)
    }

    /// Runs `read` on the buffers of `req`'s slots (back to back, `lens[i]`
    /// bytes each), publishes each slot as [`Self::finish`] does (release:
    /// the bytes written are visible to whoever sees the state), then
    /// checks the landed ones ([`Self::settle`]). Called by the I/O thread
    /// that took `req`.
    ///
    /// # Errors
    /// `read`'s error, after the slots are marked [`FAILED`].
    pub fn fill(&self, req: ReadRequest, read: impl FnOnce(&mut [&mut [u8]]) -> Result<()>) -> Result<()> {
        let mut f = self.begin(req);
        let res = f.with_buffers(read);
        for &s in self.finish(f, res.is_ok()).slots() {
            self.settle(s);
        }
        res
    }

    /// Hands the buffers of `req`'s slots (back to back, `lens[i]` bytes
    /// each) to a read that completes later ([`InFlight`]); [`Self::finish`]
    /// publishes them.
    ///
    /// # Panics
    /// If a length exceeds the slot size (a bug of the request's builder).
    pub fn begin(&self, req: ReadRequest) -> InFlight {
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOVECS];
        for (v, (&s, &len)) in iov.iter_mut().zip(req.slots[..req.n].iter().zip(&req.lens[..req.n])) {
            let (s, len) = (s as usize, len as usize);
            debug_assert_eq!(self.state[s].load(Ordering::Relaxed), PENDING);
            assert!(len <= self.slot_bytes, "read of {len} bytes into a {}-byte slot", self.slot_bytes);
            // SAFETY: slot `s` was claimed (PENDING) and its one `Claim` moved
            // into `req`, which the returned `InFlight` owns until `finish`:
            // no other request writes it, and no reader touches it until it
            // is published there. Slots are disjoint `slot_bytes` ranges and
            // `len` fits one.
            let buf = unsafe { self.buf.range_mut(s * self.slot_bytes, len) };
            *v = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
        }
        InFlight { req, iov }
    }

    /// Publishes the slots of a read begun by [`Self::begin`] (release, as
    /// [`Self::fill`]): [`FAILED`] unless `ok`; else [`LANDED`] for a slot
    /// claimed with [`Self::claim_checked`] (to be checked by
    /// [`Self::settle`] or [`Self::wait`]) and [`READY`] for the others.
    /// Returns the request's slots.
    pub fn finish(&self, f: InFlight, ok: bool) -> Published {
        let slots = f.req.slots;
        for &s in f.req.slots() {
            let state = match (ok, self.check_len[s as usize].load(Ordering::Relaxed)) {
                (false, _) => FAILED,
                (true, 0) => READY,
                (true, _) => LANDED,
            };
            self.state[s as usize].store(state, Ordering::Release);
        }
        Published { slots, n: f.req.n }
    }

    /// Checks slot `s`'s landed cluster if nobody has started to: its
    /// CRC-32C against the claim's, then [`READY`] or [`CORRUPT`]
    /// (release). A no-op in any other state (already checked, being
    /// checked by another thread, or claimed again).
    pub fn settle(&self, s: u32) {
        let st = &self.state[s as usize];
        if st.compare_exchange(LANDED, CHECKING, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return;
        }
        let len = (self.check_len[s as usize].load(Ordering::Relaxed) as usize).min(self.slot_bytes);
        // SAFETY: this thread moved the slot from LANDED (acquired: the read
        // that wrote it has published) to CHECKING; nobody writes a slot in
        // that state (a new read needs a `claim`, which waits while it is
        // CHECKING), and `len` fits the slot.
        let bytes = unsafe { self.buf.range(s as usize * self.slot_bytes, len) };
        let got = nflash_format::checksums::cluster_crc32c(bytes);
        let state = if got == self.want[s as usize].load(Ordering::Relaxed) {
            READY
        } else {
            self.seen[s as usize].store(got, Ordering::Relaxed);
            CORRUPT
        };
        st.store(state, Ordering::Release);
    }

    /// Waits until slot `s` is no longer being read or checked (spinning
    /// briefly, then yielding), for at most [`Self::timeout`]; a [`LANDED`]
    /// cluster is checked here ([`Self::settle`]) rather than waited for.
    /// Returns its state and the nanoseconds waited (checking included).
    ///
    /// # Errors
    /// [`Stalled`] if the read has not landed in time.
    pub fn wait(&self, s: u32) -> std::result::Result<(u8, u64), Stalled> {
        let st = &self.state[s as usize];
        let mut state = st.load(Ordering::Acquire);
        if !matches!(state, PENDING | LANDED | CHECKING) {
            return Ok((state, 0));
        }
        let t0 = Instant::now();
        let mut deadline = None;
        loop {
            match state {
                LANDED => self.settle(s),
                PENDING | CHECKING => self.backoff(s, &mut deadline)?,
                _ => break,
            }
            state = st.load(Ordering::Acquire);
        }
        Ok((state, t0.elapsed().as_nanos() as u64))
    }

    /// The first `n` bytes of slot `s` if it is [`READY`] (acquire), else `None`.
    /// The cache does not reassign a slot while the layer call that fetched it uses it.
    pub fn ready_bytes(&self, s: u32, n: usize) -> Option<&[u8]> {
        if self.state[s as usize].load(Ordering::Acquire) != READY {
            return None;
        }
        assert!(n <= self.slot_bytes, "{n} bytes of a {}-byte slot", self.slot_bytes);
        // SAFETY: READY (acquired): the I/O thread finished writing this slot
        // and published it with release ordering; it is written again only
        // after a new `claim`, which the cache makes only for slots the
        // current layer call does not use.
        Some(unsafe { self.buf.range(s as usize * self.slot_bytes, n) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `len` bytes at `ptr` that are resident (`mincore`).
    fn resident_pages(ptr: *const u8, len: usize) -> usize {
        let page = crate::offload::align::page_size();
        let mut v = vec![0u8; len.div_ceil(page)];
        // SAFETY: `ptr .. ptr + len` is a live mapping of the test's own
        // buffer (page aligned); `v` has one byte per page.
        assert_eq!(unsafe { libc::mincore(ptr as *mut libc::c_void, len, v.as_mut_ptr()) }, 0);
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn a_discarded_slot_gives_its_pages_back_and_reads_as_zeros() {
        let page = crate::offload::align::page_size();
        let slot = 16 * page;
        let slots = Slots::new(4, slot).unwrap();
        let ptr = slots.buf.ptr;
        assert_eq!(resident_pages(ptr, 4 * slot), 0, "untouched pages are not committed");
        for s in 0..4u32 {
            let req = ReadRequest::new(0, slot as u64, slots.claim(s).unwrap(), slot as u32);
            slots
                .fill(req, |bufs| {
                    bufs[0].fill(0xA5);
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(resident_pages(ptr, 4 * slot), 4 * 16);
        assert_eq!(slots.discard(1), Some(slot));
        assert_eq!(slots.discard(2), Some(slot));
        assert_eq!(resident_pages(ptr, 4 * slot), 2 * 16, "two slots' pages were given back");
        assert_eq!((slots.state(1), slots.state(0)), (EMPTY, READY));
        assert!(slots.ready_bytes(0, slot).unwrap().iter().all(|&b| b == 0xA5));
        // SAFETY: slot 1 is empty and nobody writes it.
        assert!(unsafe { slots.buf.range(slot, slot) }.iter().all(|&b| b == 0));
        // A slot being read stays.
        let _claim = slots.claim(3).unwrap();
        assert_eq!(slots.discard(3), None);
        assert_eq!(slots.state(3), PENDING);
    }

    #[test]
    fn a_slot_goes_empty_pending_ready_and_its_bytes_arrive() {
        let slots = Slots::new(3, 4096).unwrap();
        assert_eq!((slots.len(), slots.region_bytes()), (3, 3 * 4096));
        assert_eq!(slots.state(1), EMPTY);
        assert!(slots.ready_bytes(1, 8).is_none());
        let c = slots.claim(1).unwrap();
        assert_eq!((c.slot(), slots.state(1)), (1, PENDING));
        let req = ReadRequest::new(0, 8, c, 4096);
        slots
            .fill(req, |bufs| {
                assert_eq!(bufs.len(), 1);
                bufs[0][..8].copy_from_slice(b"clusters");
                Ok(())
            })
            .unwrap();
        assert_eq!(slots.wait(1).unwrap(), (READY, 0));
        assert_eq!(slots.ready_bytes(1, 8), Some(&b"clusters"[..]));
        // Neighbours untouched.
        assert_eq!(slots.state(0), EMPTY);
        assert_eq!(slots.state(2), EMPTY);
    }

    #[test]
    fn a_failed_read_marks_every_slot_of_the_request_failed_until_forgotten() {
        let slots = Slots::new(4, 4096).unwrap();
        let mut req = ReadRequest::new(8192, 4096, slots.claim(2).unwrap(), 4096);
        req.try_append(12288, 100, slots.claim(3).unwrap(), 4096, 1 << 20).unwrap();
        assert_eq!(req.slots(), &[2, 3]);
        assert_eq!((req.need, req.bytes(), req.end()), (4096 + 100, 8192, 16384));
        let err = slots.fill(req, |_| Err(Error::Internal("disk gone".into())));
        assert!(err.is_err());
        assert_eq!((slots.state(2), slots.state(3)), (FAILED, FAILED));
        assert!(slots.ready_bytes(2, 1).is_none());
        assert!(slots.forget_failed(2));
        assert!(!slots.forget_failed(2), "already empty");
        assert_eq!(slots.state(2), EMPTY);
    }

    #[test]
    fn a_checked_claim_is_ready_only_if_its_crc32c_matches() {
        let slots = Slots::new(3, 4096).unwrap();
        let good = nflash_format::checksums::cluster_crc32c(&[7u8; 100]);
        // Slot 0: the expected bytes; slot 1: one byte differs; slot 2: unchecked.
        let mut req = ReadRequest::new(0, 4096, slots.claim_checked(0, 100, good).unwrap(), 4096);
        req.try_append(4096, 4096, slots.claim_checked(1, 100, good).unwrap(), 4096, 1 << 20).unwrap();
        req.try_append(8192, 4096, slots.claim(2).unwrap(), 4096, 1 << 20).unwrap();
        slots
            .fill(req, |bufs| {
                bufs[0][..100].fill(7);
                bufs[1][..100].fill(7);
                bufs[1][99] = 8;
                // Bytes past a cluster's length (its padding) are not covered.
                bufs[0][100] = 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(slots.state(0), READY);
        assert_eq!(slots.state(1), CORRUPT);
        assert_eq!(slots.state(2), READY);
        let mut bad = [7u8; 100];
        bad[99] = 8;
        assert_eq!(slots.seen_crc(1), nflash_format::checksums::cluster_crc32c(&bad));
        assert!(slots.ready_bytes(1, 100).is_none(), "a damaged cluster is never handed out");
        // Forgotten like a failed read, so a later fetch reads it again, unchecked unless claimed so.
        assert!(slots.forget_failed(1));
        let c = slots.claim(1).unwrap();
        slots
            .fill(ReadRequest::new(0, 100, c, 4096), |b| {
                b[0][0] = 0;
                Ok(())
            })
            .unwrap();
        assert_eq!(slots.state(1), READY);
    }

    #[test]
    fn a_landed_cluster_is_checked_by_whoever_needs_it_first_and_only_once() {
        let slots = Slots::new(3, 4096).unwrap();
        let good = nflash_format::checksums::cluster_crc32c(&[9u8; 64]);
        let mut req = ReadRequest::new(0, 4096, slots.claim_checked(0, 64, good).unwrap(), 4096);
        req.try_append(4096, 4096, slots.claim_checked(1, 64, good).unwrap(), 4096, 1 << 20).unwrap();
        req.try_append(8192, 4096, slots.claim_checked(2, 64, good).unwrap(), 4096, 1 << 20).unwrap();
        let mut f = slots.begin(req);
        f.with_buffers(|b| {
            for buf in b.iter_mut() {
                buf[..64].fill(9);
            }
            b[1][0] = 0;
        });
        let published = slots.finish(f, true);
        assert_eq!(published.slots(), &[0, 1, 2]);
        // Landed, not yet checked: never handed out as bytes.
        assert_eq!([slots.state(0), slots.state(1), slots.state(2)], [LANDED; 3]);
        assert!(slots.ready_bytes(0, 64).is_none());
        // A compute thread waiting for them checks them itself.
        assert_eq!(slots.wait(0).unwrap().0, READY);
        assert_eq!(slots.wait(1).unwrap().0, CORRUPT);
        assert!(slots.ready_bytes(1, 64).is_none());
        // The I/O thread's check after that is a no-op.
        slots.settle(0);
        slots.settle(1);
        assert_eq!((slots.state(0), slots.state(1)), (READY, CORRUPT));
        // A landed cluster nobody needed can be claimed again before its check:
        // the check then never runs on the new read's bytes.
        let c = slots.claim(2).unwrap();
        assert_eq!(slots.state(2), PENDING);
        slots.settle(2);
        assert_eq!(slots.state(2), PENDING);
        slots.fill(ReadRequest::new(0, 64, c, 4096), |_| Ok(())).unwrap();
        assert_eq!(slots.state(2), READY, "an unchecked claim lands ready");
    }

    #[test]
    fn requests_merge_only_adjacent_reads_within_the_limits() {
        let slots = Slots::new(MAX_IOVECS + 2, 4096).unwrap();
        let mut req = ReadRequest::new(0, 4096, slots.claim(0).unwrap(), 4096);
        // Not adjacent: the claim comes back.
        let c = req.try_append(8192, 4096, slots.claim(1).unwrap(), 4096, 1 << 20).unwrap_err();
        assert_eq!(c.slot(), 1);
        // Over the byte limit.
        let c = req.try_append(4096, 4096, c, 4096, 4096).unwrap_err();
        // Adjacent and within: merged, up to MAX_IOVECS slots.
        req.try_append(4096, 4096, c, 4096, 1 << 30).unwrap();
        for s in 2..MAX_IOVECS as u32 {
            req.try_append(s as u64 * 4096, 4096, slots.claim(s).unwrap(), 4096, 1 << 30).unwrap();
        }
        assert_eq!(req.slots().len(), MAX_IOVECS);
        let full =
            req.try_append(MAX_IOVECS as u64 * 4096, 4096, slots.claim(MAX_IOVECS as u32).unwrap(), 4096, 1 << 30);
        assert!(full.is_err(), "no slot left in the request");
    }

    #[test]
    fn a_waiting_reader_sees_the_bytes_written_before_ready() {
        let slots = std::sync::Arc::new(Slots::new(1, 4096).unwrap());
        let req = ReadRequest::new(0, 4096, slots.claim(0).unwrap(), 4096);
        let writer = {
            let slots = std::sync::Arc::clone(&slots);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                slots.fill(req, |b| {
                    b[0].fill(7);
                    Ok(())
                })
            })
        };
        let (state, waited) = slots.wait(0).unwrap();
        assert_eq!(state, READY);
        assert!(waited > 0);
        assert!(slots.ready_bytes(0, 4096).unwrap().iter().all(|&b| b == 7));
        writer.join().unwrap().unwrap();
    }

    #[test]
    fn aligned_buffers_are_aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::zeroed(3 * 4096, "test").unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % crate::offload::align::page_size(), 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 1;
        assert_eq!(b.as_slice()[5], 1);
        assert!(AlignedBuf::zeroed(0, "test").unwrap().is_empty());
        assert!(matches!(AlignedBuf::zeroed(usize::MAX - 10, "test"), Err(Error::Alloc { .. })));
    }
}
