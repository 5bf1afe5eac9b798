//! Sparse decode's FFN hot loop allocates nothing once its scratch buffers
//! have grown: counted with the test binary's global allocator wrapper, in
//! a child process of its own, so no sibling test allocates during the
//! measurement.

use std::sync::atomic::Ordering;

use nflash_format::{Activation, BundleLayout, Criterion, DType, FfnLayer, NeuronCluster};
use nflash_runtime::kernels::{quantize_row, DotInput, QMatrix};
use nflash_runtime::model::ffn::{Ffn, FfnScratch, Selection};
use nflash_runtime::model::predictor::{LayerSparse, PredictScratch, Predictor};
use nflash_runtime::model::SegmentClusters;
use nflash_tests::ALLOCS;

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
    nflash_tests::run_alone("no_alloc::sparse_ffn_decode_does_not_allocate_per_token_alone");
}

/// The measurement itself, run in a process of its own by
/// [`sparse_ffn_decode_does_not_allocate_per_token`] (the allocation counter is process-wide).
#[test]
#[ignore = "run alone by sparse_ffn_decode_does_not_allocate_per_token"]
fn sparse_ffn_decode_does_not_allocate_per_token_alone() {
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
    let seg = SegmentClusters::new(&data, &[0]);
    let src = seg.view();
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
    // Every worker has started (thread start-up allocates) before anything is counted:
    // on a busy 2-core host a worker can start late, inside the measured window.
    pool.broadcast(|_| ());
    pool.install(|| {
        let x = values(6, H);
        let mut xin = DotInput::new(DType::Q8_0);
        let (mut fs, mut ps, mut list) = (FfnScratch::default(), PredictScratch::default(), Vec::new());
        let mut out = vec![0f32; H];
        let mut step = |xin: &mut DotInput, out: &mut Vec<f32>| {
            xin.set(&x);
            assert!(sp.predict_token(Activation::Silu, xin, &x, &mut ps, &mut list));
            ffn.forward_token(&src, xin, Selection::List(&list), Some((sp.criterion, sp.threshold)), &mut fs, out)
                .unwrap()
        };
        // Grows the scratch buffers; a few steps, so that each worker has
        // taken part (a worker's first stolen task may grow its job deque,
        // and on a loaded host one worker can sit out the first step).
        for _ in 0..5 {
            step(&mut xin, &mut out);
        }
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
