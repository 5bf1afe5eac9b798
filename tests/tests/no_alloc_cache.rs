//! Fetching cold neuron clusters through the neuron cache and its I/O
//! threads allocates nothing per token: counted with the test binary's
//! global allocator wrapper, alone in a child process.

use std::sync::atomic::Ordering;

use nflash_format::{Activation, DType};
use nflash_plan::CacheConfig;
use nflash_runtime::kernels::DotInput;
use nflash_runtime::model::ffn::{Ffn, FfnScratch, Selection};
use nflash_runtime::model::LayerClusters;
use nflash_runtime::offload::NeuronCache;
use nflash_tests::ALLOCS;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = nflash_tests::Rng::new(seed);
    (0..n).map(|_| r.next_f32()).collect()
}

#[test]
fn fetching_cold_clusters_through_the_cache_does_not_allocate_per_token() {
    nflash_tests::run_alone(
        "no_alloc_cache::fetching_cold_clusters_through_the_cache_does_not_allocate_per_token_alone",
    );
}

/// The measurement itself, run in a process of its own by
/// [`fetching_cold_clusters_through_the_cache_does_not_allocate_per_token`] (the allocation counter is process-wide).
#[test]
#[ignore = "run alone by fetching_cold_clusters_through_the_cache_does_not_allocate_per_token"]
fn fetching_cold_clusters_through_the_cache_does_not_allocate_per_token_alone() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let spec = nflash_tests::TinySpec { inter: 256, ..Default::default() };
    nflash_tests::write_tiny_checkpoint(&ckpt, &spec);
    let out = dir.path().join("t.nflash");
    let o = nflash_tests::run(
        "prep",
        &[
            "convert",
            "--model",
            ckpt.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quant",
            "q8_0",
            "--cluster-bytes",
            "1KiB",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pack = nflash_format::Pack::open_resident(&out).unwrap();
    let n_layers = pack.manifest().ffn.len();
    // Nothing hot, the minimum cold region: every token reads again.
    let cache = NeuronCache::open(
        &pack,
        &CacheConfig {
            hot_neurons: vec![0; n_layers],
            cold_bytes: 0,
            io_threads: 2,
            io_engine: Default::default(),
            verify: true,
            start_bytes: None,
        },
    )
    .unwrap();
    let f = &pack.manifest().ffn[0];
    let ffn = Ffn::new(f, Activation::Silu, None, None, None);
    let h = spec.hidden;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    // Every worker has started (thread start-up allocates) before anything is counted:
    // on a busy 2-core host a worker can start late, inside the measured window.
    pool.broadcast(|_| ());
    pool.install(|| {
        let x = values(9, h);
        let mut xin = DotInput::new(DType::Q8_0);
        let (mut fs, mut table) = (FfnScratch::default(), Vec::new());
        let needed: Vec<u32> = (0..ffn.n_clusters() as u32).collect();
        let mut out = vec![0f32; h];
        let mut step = |layer: usize, xin: &mut DotInput, out: &mut Vec<f32>| {
            xin.set(&x);
            cache.fetch(layer, &needed, &mut table).unwrap();
            let src = LayerClusters::new(&cache, layer, &table);
            ffn.forward_token(&src, xin, Selection::All, None, &mut fs, out).unwrap()
        };
        // Warm up: scratch growth, and each I/O thread's first blocking wait
        // (std's channel sets up a per-thread waiter once), given time to happen.
        for _ in 0..3 {
            for l in 0..n_layers {
                step(l, &mut xin, &mut out);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let read0 = cache.stats().bytes_read;
        let before = ALLOCS.load(Ordering::SeqCst);
        for t in 0..20 {
            step(t % n_layers, &mut xin, &mut out);
        }
        let after = ALLOCS.load(Ordering::SeqCst);
        assert!(cache.stats().bytes_read > read0, "the fixture must read from flash");
        assert_eq!(after - before, 0, "allocations in 20 cached decode steps");
    });
}
