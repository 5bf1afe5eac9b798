//! Sparse decode's FFN hot loop allocates nothing once its scratch buffers
//! have grown (issue 3), including fetching cold clusters through the
//! neuron cache and its I/O threads (issue 4): counted with a global
//! allocator wrapper.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use nflash_format::{Activation, BundleLayout, Criterion, DType, FfnLayer, NeuronCluster};
use nflash_runtime::cache::{CacheConfig, LayerClusters, NeuronCache};
use nflash_runtime::ffn::{Ffn, FfnScratch, Selection};
use nflash_runtime::sparse::{LayerSparse, PredictScratch, Predictor};
use nflash_runtime::weights::{quantize_row, DotInput, QMatrix};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The counter is process-wide: tests in this file run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = nflash_tests::Rng::new(seed);
    (0..n).map(|_| r.next_f32()).collect()
}

fn q8(rows: &[f32], cols: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for r in rows.chunks(cols) {
        quantize_row(DType::Q8_0, r, &mut out);
    }
    out
}

#[test]
fn sparse_ffn_decode_does_not_allocate_per_token() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const H: usize = 64;
    const N: usize = 256;
    const R: usize = 32;
    let layout = BundleLayout::new(DType::Q8_0, H as u64).unwrap();
    let (g, u, d) = (values(1, N * H), values(2, N * H), values(3, N * H));
    let mut data = Vec::new();
    for p in 0..N {
        for m in [&g, &u, &d] {
            quantize_row(DType::Q8_0, &m[p * H..(p + 1) * H], &mut data);
        }
    }
    let f = FfnLayer {
        layer: 0,
        segment: 0,
        n_neurons: N as u32,
        bundle: layout,
        cluster_align: 1,
        clusters: vec![NeuronCluster { offset: 0, first: 0, n_neurons: N as u32 }],
        order: (0..N as u32).collect(),
        sparse: None,
    };
    let ffn = Ffn::new(&f, Activation::Silu, None, None, None);
    let src = LayerClusters::Segment { data: &data, offsets: &[0] };
    let (w1, w2) = (q8(&values(4, R * H), H), q8(&values(5, N * R), R));
    let sp = LayerSparse {
        criterion: Criterion::GateUp,
        threshold: 0.05,
        predictor_threshold: 0.0,
        predictor: Predictor::Mlp {
            w1: QMatrix::new(DType::Q8_0, R, H, &w1),
            b1: vec![0.0; R],
            w2: QMatrix::new(DType::Q8_0, N, R, &w2),
            b2: vec![0.0; N],
        },
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let x = values(6, H);
        let mut xin = DotInput::new(DType::Q8_0);
        let (mut fs, mut ps, mut list) = (FfnScratch::default(), PredictScratch::default(), Vec::new());
        let mut out = vec![0f32; H];
        let mut step = |xin: &mut DotInput, out: &mut Vec<f32>| {
            xin.set(&x);
            assert!(sp.predict_token(Activation::Silu, xin, &x, &mut ps, &mut list));
            ffn.forward_token(&src, xin, Selection::List(&list), Some((sp.criterion, sp.threshold)), &mut fs, out).unwrap()
        };
        step(&mut xin, &mut out); // grows the scratch buffers
        let before = ALLOCS.load(Ordering::SeqCst);
        let mut computed = 0;
        for _ in 0..20 {
            computed += step(&mut xin, &mut out);
        }
        let after = ALLOCS.load(Ordering::SeqCst);
        assert!(computed > 0 && list.len() < N, "fixture should select some but not all neurons");
        assert_eq!(after - before, 0, "allocations in 20 sparse decode steps");
    });
}

#[test]
fn fetching_cold_clusters_through_the_cache_does_not_allocate_per_token() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let spec = nflash_tests::TinySpec { inter: 256, ..Default::default() };
    nflash_tests::write_tiny_checkpoint(&ckpt, &spec);
    let out = dir.path().join("t.nflash");
    let o = nflash_tests::run("prep", &["convert", "--model", ckpt.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quant", "q8_0", "--cluster-bytes", "1024"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pack = nflash_format::Pack::open_resident(&out).unwrap();
    let n_layers = pack.manifest().ffn.len();
    // Nothing hot, the minimum cold region: every token reads again.
    let cache = NeuronCache::open(&pack, &CacheConfig { hot_neurons: vec![0; n_layers], cold_bytes: 0, io_threads: 2 }).unwrap();
    let f = &pack.manifest().ffn[0];
    let ffn = Ffn::new(f, Activation::Silu, None, None, None);
    let h = spec.hidden;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let x = values(9, h);
        let mut xin = DotInput::new(DType::Q8_0);
        let (mut fs, mut table) = (FfnScratch::default(), Vec::new());
        let needed: Vec<u32> = (0..ffn.n_clusters() as u32).collect();
        let mut out = vec![0f32; h];
        let mut step = |layer: usize, xin: &mut DotInput, out: &mut Vec<f32>| {
            xin.set(&x);
            cache.fetch(layer, &needed, &mut table).unwrap();
            let src = LayerClusters::Cached { cache: &cache, layer, table: &table };
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
