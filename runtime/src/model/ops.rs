//! Small f32 building blocks of the transformer: RMSNorm, RoPE, softmax,
//! FFN activations.

use nflash_format::{Activation, ModelConfig, RopeScaling};

/// `x` folded into 8 lanes: lane `i mod 8` takes element `i` by `f`, in
/// order, each lane starting at `init`. A fixed lane order (not a chain of
/// `x.len()` dependent steps) that the compiler vectorizes and that gives
/// the same bits in every build: the sums and maximum of [`rms_norm`] and
/// [`softmax`].
#[inline(always)]
fn fold_lanes8(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; 8] {
    let mut l = [init; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in l.iter_mut().zip(c) {
            *a = f(*a, v);
        }
    }
    for (a, &v) in l.iter_mut().zip(chunks.remainder()) {
        *a = f(*a, v);
    }
    l
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * weight`. `x`, `weight`, `out`: `[hidden]`.
/// The sum of squares runs in 8 lanes (element `i` into lane `i mod 8`, in
/// order, then `kernels::portable::sum8`), as softmax's sum does: the
/// compiler vectorizes it, every build gives the same bits, and a row is
/// not a chain of `hidden` dependent additions (4.1 ms of a 128-token
/// SmolLM2 prefill went to the norms).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let ss = crate::kernels::portable::sum8(fold_lanes8(x, 0.0, |a, v| a + v * v)) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// In-place softmax over `x` (`e^x` by `kernels::exp_slice`, 8 lanes at a
/// time). The maximum and the sum run in 8 lanes (element `i` into lane
/// `i mod 8`, in order; the sum then reduced as `kernels::portable::sum8`),
/// so the compiler vectorizes them and every build gives the same bits;
/// NaNs are skipped by the maximum as `f32::max` skips them.
pub fn softmax(x: &mut [f32]) {
    let max = fold_lanes8(x, f32::NEG_INFINITY, f32::max).into_iter().fold(f32::NEG_INFINITY, f32::max);
    x.iter_mut().for_each(|v| *v -= max);
    crate::kernels::exp_slice(x);
    let inv = 1.0 / crate::kernels::portable::sum8(fold_lanes8(x, 0.0, |a, v| a + v));
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Applies the FFN activation to a gate projection output (SiLU's `e^x`:
/// `kernels::exp`, the same bits on every path).
#[inline]
pub fn activate(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Silu => x / (1.0 + crate::kernels::exp(-x)),
        Activation::Relu | Activation::DRelu => x.max(0.0),
        Activation::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
        Activation::GeluTanh => x / (1.0 + crate::kernels::exp(gelu_tanh_exponent(x))),
    }
}

/// GELU's tanh approximation `0.5·x·(1 + tanh(y))`, `y = √(2/π)·(x +
/// 0.044715·x³)` (HF `gelu_pytorch_tanh`), is `x·σ(2y) = x / (1 + e^(−2y))`:
/// this is `−2y`. Written with `e^x` (`kernels::exp`, the same bits on
/// every path and build) rather than the C library's `tanhf`, whose last
/// bits differ between glibc and the phone build's musl.
#[inline]
fn gelu_tanh_exponent(x: f32) -> f32 {
    const TWO_C: f32 = 2.0 * 0.797_884_6; // 2·√(2/π)
    -TWO_C * (x + 0.044715 * x * x * x)
}

/// Applies the activation's up-projection part: ReLU for dReLU, identity otherwise.
#[inline]
pub fn activate_up(act: Activation, u: f32) -> f32 {
    match act {
        Activation::DRelu => u.max(0.0),
        _ => u,
    }
}

/// A neuron's output (the input of its down-projection column) from its gate
/// and up pre-activations `g`, `u` (biases included): `act(g) · u`, or
/// `relu(g) · relu(u)` for dReLU.
#[inline]
pub fn neuron_output(act: Activation, g: f32, u: f32) -> f32 {
    activate(act, g) * activate_up(act, u)
}

/// [`neuron_output`] over a row: `g[j] = act(g[j]) · act_up(u[j])` (`g`,
/// `u`: `[m]` pre-activations, biases included), with the bits of
/// [`neuron_output`] per element; SiLU and GELU (tanh) take their `e^x` 8
/// lanes at a time (`kernels::exp_slice`).
pub fn neuron_outputs(act: Activation, g: &mut [f32], u: &[f32]) {
    match act {
        Activation::Silu => sigmoid_gated(g, u, |g| -g),
        Activation::GeluTanh => sigmoid_gated(g, u, gelu_tanh_exponent),
        _ => g.iter_mut().zip(u).for_each(|(g, &u)| *g = neuron_output(act, *g, u)),
    }
}

/// `g[j] = g[j] / (1 + e^{exponent(g[j])}) · u[j]`, the `e^x` 64 at a time
/// (`kernels::exp_slice`); generic so that `exponent` is inlined into the
/// loop that the compiler vectorizes (through a function pointer it cost
/// 0.6% of a Gemma-shaped decode, `perf`).
#[inline(always)]
fn sigmoid_gated(g: &mut [f32], u: &[f32], exponent: impl Fn(f32) -> f32) {
    let mut e = [0f32; 64];
    for (g, u) in g.chunks_mut(64).zip(u.chunks(64)) {
        let e = &mut e[..g.len()];
        e.iter_mut().zip(g.iter()).for_each(|(e, &g)| *e = exponent(g));
        crate::kernels::exp_slice(e);
        for ((g, &u), &e) in g.iter_mut().zip(u).zip(e.iter()) {
            *g = *g / (1.0 + e) * u;
        }
    }
}

/// erf with max error 1.5e-7 (Abramowitz–Stegun 7.1.26), in f64 internally.
fn erf(x: f32) -> f32 {
    let x = x as f64;
    let s = x.signum();
    let x = x.abs();
    let t = 1.0 / (1.0 + 0.3275911 * x);
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592)
            * t
            * (-x * x).exp();
    (s * y) as f32
}

/// Rotary position embedding tables (HF "rotate_half" layout: element `i`
/// pairs with `i + rotary_dim/2`). RoPE rotates the first `rotary_dim`
/// elements of each head (all of it, except Phi-3's partial rotary,
/// [`ModelConfig::rotary_dim`]) and leaves the rest as they are.
pub struct Rope {
    /// Inverse frequencies `[rotary_dim/2]`, after `rope_scaling`.
    inv_freq: Vec<f32>,
    /// LongRoPE: the frequencies with the long factors, for runs whose
    /// context exceeds `original` tokens, and the cos/sin scale.
    long: Option<LongFreq>,
    /// `rotary_dim / 2`.
    half: usize,
    /// Elements per head.
    head_dim: usize,
}

/// LongRoPE's second set of frequencies ([`RopeScaling::LongRope`]).
struct LongFreq {
    inv_freq: Vec<f32>,
    original: usize,
    attention_factor: f32,
}

impl Rope {
    /// Builds the frequencies from `rope_theta`, the rotated dimensions
    /// (`head_dim`, or Phi-3's `rotary_dim`) and `rope_scaling` (HF
    /// `_compute_default/linear/llama3/longrope_parameters`).
    pub fn new(cfg: &ModelConfig) -> Self {
        let half = cfg.rotary_dim() as usize / 2;
        let f32s = |v: Vec<f64>| -> Vec<f32> { v.into_iter().map(|f| f as f32).collect() };
        let long = match cfg.rope_scaling {
            Some(RopeScaling::LongRope { original_max_position_embeddings, attention_factor, .. }) => Some(LongFreq {
                inv_freq: f32s(cfg.rope_inv_freq(true)),
                original: original_max_position_embeddings as usize,
                attention_factor: attention_factor as f32,
            }),
            _ => None,
        };
        Rope { inv_freq: f32s(cfg.rope_inv_freq(false)), long, half, head_dim: cfg.head_dim as usize }
    }

    /// Rotated pairs per head (`rotary_dim / 2`): the width of a row of
    /// [`Self::tables`].
    pub fn half(&self) -> usize {
        self.half
    }

    /// Rotation tables for positions `p0..p0 + n` of a run whose context
    /// (KV cache) holds `ctx` tokens: `(cos, sin)`, each `[n, rotary_dim/2]`.
    /// `ctx` matters only for LongRoPE, whose long factors (and not the
    /// short ones) apply when `ctx` exceeds the pretrained context.
    /// Computed once per forward pass and shared by every layer and head.
    pub fn tables(&self, p0: usize, n: usize, ctx: usize) -> (Vec<f32>, Vec<f32>) {
        let (inv_freq, scale) = match &self.long {
            Some(l) if ctx > l.original => (&l.inv_freq, l.attention_factor),
            Some(l) => (&self.inv_freq, l.attention_factor),
            None => (&self.inv_freq, 1.0),
        };
        let mut cos = Vec::with_capacity(n * self.half);
        let mut sin = Vec::with_capacity(n * self.half);
        for t in 0..n {
            for &f in inv_freq {
                // In f64, rounded once: f32 `sin_cos` comes from the C
                // library (glibc on the workstation, musl in the phone
                // build), whose f32 results differ in the last bit for
                // large angles, and those bits moved perplexity by 0.25%
                // between the two builds (512 tokens, q4_0 SmolLM2).
                // Times LongRoPE's attention factor as HF does (cos() ·
                // attention_scaling, in f32); 1 otherwise, which leaves
                // every value's bits as they are.
                let (s, c) = (((p0 + t) as f32 * f) as f64).sin_cos();
                cos.push(c as f32 * scale);
                sin.push(s as f32 * scale);
            }
        }
        (cos, sin)
    }

    /// Rotates every head of `x` (`[n_heads * head_dim]`) with one position's
    /// `cos`/`sin` rows (`[rotary_dim/2]`, from [`Self::tables`]): its first
    /// `rotary_dim` elements; the rest of the head stays as it is.
    pub fn rotate(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let h = self.half;
        for head in x.chunks_exact_mut(self.head_dim) {
            let (lo, hi) = head[..2 * h].split_at_mut(h);
            for i in 0..h {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RoPE tables are f64 `sin_cos` rounded once, not the C library's f32
    /// `sin_cos`, whose last bits differ between glibc (the workstation)
    /// and musl (the phone build) at large angles: with f32 `sin_cos` the
    /// two builds' perplexities differed by 0.25% over 512 tokens.
    #[test]
    fn rope_tables_do_not_depend_on_the_c_library() {
        let half = 32;
        let rope = Rope {
            inv_freq: (0..half).map(|i| 1.0 / 10000f32.powf(i as f32 / half as f32)).collect(),
            long: None,
            half,
            head_dim: 2 * half,
        };
        let (p0, n) = (3000, 1200);
        let (cos, sin) = rope.tables(p0, n, p0 + n);
        for t in 0..n {
            for (i, &f) in rope.inv_freq.iter().enumerate() {
                let a = ((p0 + t) as f32 * f) as f64;
                assert_eq!(cos[t * half + i].to_bits(), (a.cos() as f32).to_bits(), "cos at {}, {i}", p0 + t);
                assert_eq!(sin[t * half + i].to_bits(), (a.sin() as f32).to_bits(), "sin at {}, {i}", p0 + t);
            }
        }
    }

    /// LongRoPE (Phi-3.5/Phi-4-mini) against transformers'
    /// `_compute_longrope_parameters` written out: `inv_freq_i = 1 / (ext_i ·
    /// θ^(2i/d))` over the rotated `d` elements, `ext` the short factors
    /// when the run's context is at most the pretrained one and the long
    /// ones beyond, cos and sin times the attention factor; the other
    /// elements of a head are not rotated.
    #[test]
    fn longrope_tables_follow_transformers() {
        use nflash_format::{Activation, Architecture, Phi3};
        let (head_dim, rot, theta, orig) = (16usize, 12usize, 10000f64, 64u64);
        let short: Vec<f32> = (0..rot / 2).map(|i| 1.0 + 0.25 * i as f32).collect();
        let long: Vec<f32> = (0..rot / 2).map(|i| 2.0 + 3.0 * i as f32).collect();
        let af = (1.0 + (4.0f64).ln() / (orig as f64).ln()).sqrt();
        let cfg = ModelConfig {
            architecture: Architecture::Phi3(Phi3 { rotary_dim: rot as u64 }),
            vocab_size: 8,
            hidden_size: 32,
            intermediate_size: 8,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: head_dim as u64,
            rms_norm_eps: 1e-5,
            rope_theta: theta,
            rope_scaling: Some(RopeScaling::LongRope {
                short_factor: short.clone(),
                long_factor: long.clone(),
                original_max_position_embeddings: orig,
                attention_factor: af,
            }),
            max_position_embeddings: 4 * orig,
            sliding_window: None,
            activation: Activation::Silu,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        let rope = Rope::new(&cfg);
        assert_eq!(rope.half(), rot / 2);
        for (ctx, ext) in [(orig as usize, &short), (orig as usize + 1, &long)] {
            let (p0, n) = (40, 30);
            let (cos, sin) = rope.tables(p0, n, ctx);
            for t in 0..n {
                for i in 0..rot / 2 {
                    let inv = 1.0 / (ext[i] as f64 * theta.powf((2 * i) as f64 / rot as f64));
                    let a = (p0 + t) as f64 * inv;
                    let (c, s) = (cos[t * rot / 2 + i] as f64, sin[t * rot / 2 + i] as f64);
                    assert!((c - a.cos() * af).abs() < 1e-5, "ctx {ctx} cos at {} {i}: {c}", p0 + t);
                    assert!((s - a.sin() * af).abs() < 1e-5, "ctx {ctx} sin at {} {i}: {s}", p0 + t);
                }
            }
            // One head: the rotated pairs (i, i + rot/2) move, the last head_dim − rot stay.
            let mut x: Vec<f32> = (0..head_dim).map(|i| i as f32 + 1.0).collect();
            let x0 = x.clone();
            rope.rotate(&mut x, &cos[..rot / 2], &sin[..rot / 2]);
            assert_eq!(&x[rot..], &x0[rot..]);
            assert!((x[0] - (x0[0] * cos[0] - x0[rot / 2] * sin[0])).abs() < 1e-6);
        }
    }

    #[test]
    fn rms_norm_is_close_to_f64_and_sums_in_eight_lanes() {
        for n in [1usize, 7, 8, 13, 576] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.37).collect();
            let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
            let mut out = vec![0f32; n];
            rms_norm(&x, &w, 1e-5, &mut out);
            let ss = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
            for ((&o, &v), &wi) in out.iter().zip(&x).zip(&w) {
                let want = v as f64 / (ss + 1e-5).sqrt() * wi as f64;
                assert!((o as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "n {n}: {o} vs {want}");
            }
        }
        // The lane order, on a row whose sequential fold rounds differently.
        let x: Vec<f32> = (0..16).map(|i| ((i * 11 * 37 % 29) as f32 - 14.0) * 0.37).collect();
        let (mut out, w) = (vec![0f32; 16], vec![1f32; 16]);
        rms_norm(&x, &w, 1e-5, &mut out);
        let with = |ss: f32| x.iter().map(|v| (v * (1.0 / (ss / 16.0 + 1e-5).sqrt())).to_bits()).collect::<Vec<u32>>();
        let mut l = [0f32; 8];
        for (i, v) in x.iter().enumerate() {
            l[i % 8] += v * v;
        }
        let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, with(crate::kernels::portable::sum8(l)));
        assert_ne!(bits, with(x.iter().map(|v| v * v).sum::<f32>()), "the row must tell the two orders apart");
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] == 0.0 && x[2] > x[1]);
        // Lengths around the 8 lanes against an f64 softmax.
        for n in [1, 7, 8, 9, 16, 29] {
            let v: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.9).collect();
            let mut x = v.clone();
            softmax(&mut x);
            let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let sum: f64 = v.iter().map(|&a| (a as f64 - max).exp()).sum();
            for (g, &a) in x.iter().zip(&v) {
                let want = (a as f64 - max).exp() / sum;
                assert!((*g as f64 - want).abs() < 1e-6, "n {n}: {g} vs {want}");
            }
        }
    }

    #[test]
    fn a_row_of_neuron_outputs_has_the_bits_of_each_neuron() {
        let g: Vec<f32> = (0..77).map(|i| (i as f32 - 38.0) * 0.7).chain([f32::NAN, -100.0, 100.0]).collect();
        let u: Vec<f32> = g.iter().map(|v| 0.3 - v * 0.5).collect();
        for act in [Activation::Silu, Activation::Relu, Activation::DRelu, Activation::Gelu, Activation::GeluTanh] {
            let mut row = g.clone();
            neuron_outputs(act, &mut row, &u);
            for (j, (&r, (&gv, &uv))) in row.iter().zip(g.iter().zip(&u)).enumerate() {
                let want = neuron_output(act, gv, uv);
                assert!(r.to_bits() == want.to_bits() || (r.is_nan() && want.is_nan()), "{act:?} {j}: {r} vs {want}");
            }
        }
    }

    #[test]
    fn activations() {
        assert!((activate(Activation::Silu, 1.0) - 0.7310586).abs() < 1e-6);
        assert_eq!(activate(Activation::Relu, -2.0), 0.0);
        assert_eq!(neuron_output(Activation::Relu, 2.0, -3.0), -6.0);
        assert_eq!(neuron_output(Activation::DRelu, 2.0, -3.0), 0.0);
        assert_eq!(neuron_output(Activation::DRelu, 2.0, 3.0), 6.0);
        assert_eq!(neuron_output(Activation::DRelu, -2.0, 3.0), 0.0);
        assert!((activate(Activation::Gelu, 1.0) - 0.8413447).abs() < 1e-5);
        assert!((activate(Activation::GeluTanh, 1.0) - 0.841192).abs() < 1e-5);
    }
}
