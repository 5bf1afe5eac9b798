//! Compute threads kept awake between the parallel regions of decode.
//!
//! One decode token runs about four parallel regions per layer (Q/K/V,
//! attention, output projection, FFN) plus the lm_head, each a few tens of
//! microseconds on a small model. A rayon worker with no work goes to sleep
//! on a futex after a short spin, and waking it again costs a system call
//! on the critical path of every region (about a tenth of a SmolLM2 decode
//! token on the 2-core dev VM: `futex` and `sched_yield` in its profile).
//! llama.cpp keeps its threads spinning on a barrier between ops instead;
//! [`KeepAwake`] does the same with rayon: each other worker of the pool
//! runs a job that polls the pool for work ([`rayon::yield_now`]) until the
//! guard is dropped, so stolen halves of `join`s start at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// While alive, the other workers of the current rayon pool spin, taking
/// work as soon as it appears, instead of sleeping. Dropping it lets them
/// sleep again (each leaves its loop at its next poll). Costs a core's
/// worth of CPU per spinning worker while it lives: for in-memory decode,
/// not for decode that waits on flash reads (the I/O threads need the cores).
pub struct KeepAwake {
    stop: Arc<AtomicBool>,
    running: Arc<AtomicUsize>,
}

impl KeepAwake {
    /// Starts `threads − 1` spinners from a worker of the current pool; a
    /// no-op (nothing spins) outside a pool or on a pool of one thread. A
    /// spinner picked up by the calling thread itself (it pops its own queue
    /// while waiting in a `join`) returns at once, so the caller never spins
    /// on its own stack.
    pub fn start() -> Self {
        let (stop, running) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        if let Some(me) = rayon::current_thread_index() {
            for _ in 1..rayon::current_num_threads() {
                let (stop, running) = (stop.clone(), running.clone());
                rayon::spawn(move || {
                    if rayon::current_thread_index() == Some(me) {
                        return;
                    }
                    running.fetch_add(1, Ordering::AcqRel);
                    while !stop.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            std::hint::spin_loop();
                        }
                    }
                    running.fetch_sub(1, Ordering::AcqRel);
                });
            }
        }
        KeepAwake { stop, running }
    }

    /// Spinners currently in their loop.
    pub fn spinning(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::time::{Duration, Instant};

    #[test]
    fn spinners_take_work_and_stop_when_dropped() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            let guard = KeepAwake::start();
            let t0 = Instant::now();
            while guard.spinning() < 2 && t0.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
            assert_eq!(guard.spinning(), 2, "both other workers spin");
            // Parallel regions still compute the same results.
            for n in [1usize, 7, 1000, 100_000] {
                let s: u64 = (0..n as u64).into_par_iter().map(|v| v * 3).sum();
                assert_eq!(s, 3 * (n as u64) * (n as u64 - 1) / 2);
            }
            let running = guard.running.clone();
            drop(guard);
            let t0 = Instant::now();
            while running.load(Ordering::Acquire) > 0 && t0.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
            assert_eq!(running.load(Ordering::Acquire), 0, "spinners left their loops");
        });
    }

    #[test]
    fn nothing_spins_outside_a_pool_or_on_one_thread() {
        std::thread::spawn(|| assert_eq!(KeepAwake::start().spinning(), 0)).join().unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(|| {
            let g = KeepAwake::start();
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(g.spinning(), 0);
        });
    }
}
