//! Token sampling: greedy, temperature, top-k, top-p (nucleus).

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// nflash's temperature where neither the caller nor the pack's
/// `generation_config.json` gives one.
pub const DEFAULT_TEMPERATURE: f32 = 0.8;
/// nflash's top-k where neither the caller nor the pack gives one.
pub const DEFAULT_TOP_K: usize = 40;
/// nflash's top-p where neither the caller nor the pack gives one.
pub const DEFAULT_TOP_P: f32 = 0.95;

/// Whether `t` is a temperature the sampler takes: finite and ≥ 0 (0: greedy).
pub fn valid_temperature(t: f32) -> bool {
    t.is_finite() && t >= 0.0
}

/// Whether `p` is a nucleus mass the sampler takes: in (0, 1] (1: off).
pub fn valid_top_p(p: f32) -> bool {
    p > 0.0 && p <= 1.0
}

/// Sampling settings.
#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    /// Softmax temperature; ≤ 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1.0 keeps all.
    pub top_p: f32,
    /// RNG seed.
    pub seed: u64,
}

/// Picks the next token from logits.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: StdRng,
    idx: Vec<usize>,
    probs: Vec<f32>,
}

impl Sampler {
    /// A sampler seeded with `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler { cfg, rng: StdRng::seed_from_u64(cfg.seed), idx: Vec::new(), probs: Vec::new() }
    }

    /// Chooses a token id from `logits` (`[vocab]`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        self.prepare(logits);
        match WeightedIndex::new(&self.probs) {
            Ok(d) => self.idx[d.sample(&mut self.rng)] as u32,
            Err(_) => self.idx[0] as u32,
        }
    }

    /// The distribution [`Self::sample`] draws from for `logits`
    /// (`[vocab]`), into `out` (cleared first): `(token id, probability)`
    /// for each token it can choose, probabilities summing to 1; a point
    /// mass on the argmax when greedy. Uses no randomness.
    pub fn distribution(&mut self, logits: &[f32], out: &mut Vec<(u32, f32)>) {
        out.clear();
        if self.cfg.temperature <= 0.0 {
            out.push((argmax(logits), 1.0));
            return;
        }
        self.prepare(logits);
        let sum: f32 = self.probs.iter().sum();
        if !(sum > 0.0 && sum.is_finite()) {
            out.push((self.idx[0] as u32, 1.0));
            return;
        }
        out.extend(self.idx.iter().zip(&self.probs).map(|(&i, &p)| (i as u32, p / sum)));
    }

    /// Draws a token from `dist` (`(token id, weight)` pairs, weights ≥ 0,
    /// not all 0), with this sampler's random numbers.
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        match WeightedIndex::new(dist.iter().map(|&(_, p)| p)) {
            Ok(d) => dist[d.sample(&mut self.rng)].0,
            Err(_) => dist.first().map_or(0, |&(t, _)| t),
        }
    }

    /// Speculative sampling's step for one drafted token (Leviathan et al.
    /// 2023, Chen et al. 2023; issue 47): the draft proposed `d`, drawn
    /// from its distribution `q`; the model's distribution is `p` (both as
    /// [`Self::distribution`] gives them). Accepts `d` with probability
    /// [`acceptance_probability`] `min(1, p(d)/q(d))`; else draws from the
    /// [`residual`] `max(0, p − q)`, normalized. Returns whether `d` was
    /// accepted, and the token: so distributed exactly as `p`, whatever `q`.
    pub fn accept_or_resample(&mut self, p: &[(u32, f32)], q: &[(u32, f32)], d: u32) -> (bool, u32) {
        let u: f64 = self.rng.random();
        if u < acceptance_probability(p, q, d) {
            return (true, d);
        }
        let r = residual(p, q);
        if r.is_empty() {
            // p = q up to rounding: nothing left to correct.
            return (false, self.draw(p));
        }
        (false, self.draw(&r))
    }

    /// Fills `idx` (the tokens sampling keeps, most likely first) and
    /// `probs` (their unnormalized probabilities) for `logits`: temperature,
    /// then top-k, then top-p.
    fn prepare(&mut self, logits: &[f32]) {
        let t = self.cfg.temperature;
        self.idx.clear();
        self.idx.extend(0..logits.len());
        let k = if self.cfg.top_k == 0 { logits.len() } else { self.cfg.top_k.min(logits.len()) };
        if k < logits.len() {
            self.idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            self.idx.truncate(k);
        }
        self.idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let max = logits[self.idx[0]];
        self.probs.clear();
        // nflash's own e^x (`kernels::exp`), not the C library's: the same
        // probabilities, and so the same tokens for a seed, on every platform.
        self.probs.extend(self.idx.iter().map(|&i| crate::kernels::exp((logits[i] - max) / t)));
        let sum: f32 = self.probs.iter().sum();
        let mut cum = 0.0;
        let mut keep = self.probs.len();
        for (j, p) in self.probs.iter().enumerate() {
            cum += p / sum;
            if cum >= self.cfg.top_p {
                keep = j + 1;
                break;
            }
        }
        self.probs.truncate(keep);
        self.idx.truncate(keep);
    }
}

/// Probability of `token` in `dist` (0 when absent).
fn prob(dist: &[(u32, f32)], token: u32) -> f64 {
    dist.iter().find(|&&(t, _)| t == token).map_or(0.0, |&(_, p)| p as f64)
}

/// Speculative sampling's chance of keeping the draft's token `d`:
/// `min(1, p(d) / q(d))` (1 when `q(d)` is 0, which a token drawn from `q`
/// never has).
pub fn acceptance_probability(p: &[(u32, f32)], q: &[(u32, f32)], d: u32) -> f64 {
    let (pd, qd) = (prob(p, d), prob(q, d));
    if qd <= 0.0 {
        1.0
    } else {
        (pd / qd).min(1.0)
    }
}

/// Speculative sampling's residual `max(0, p − q)`, normalized: what a
/// rejection draws from, as `(token id, probability)` pairs in `p`'s
/// order; empty when `p ≤ q` everywhere (p = q).
pub fn residual(p: &[(u32, f32)], q: &[(u32, f32)]) -> Vec<(u32, f32)> {
    let mut q_of: std::collections::HashMap<u32, f32> = std::collections::HashMap::with_capacity(q.len());
    q_of.extend(q.iter().copied());
    let mut r: Vec<(u32, f64)> = p
        .iter()
        .map(|&(t, pt)| (t, (pt as f64 - q_of.get(&t).copied().unwrap_or(0.0) as f64).max(0.0)))
        .filter(|&(_, v)| v > 0.0)
        .collect();
    let sum: f64 = r.iter().map(|&(_, v)| v).sum();
    if sum.is_nan() || sum <= 1e-12 {
        return Vec::new();
    }
    r.iter_mut().for_each(|(_, v)| *v /= sum);
    r.into_iter().map(|(t, v)| (t, v as f32)).collect()
}

/// Index of the largest logit (first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1, 3.0, 0.2, 2.9];
        let mut g = Sampler::new(SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 1 });
        assert_eq!(g.sample(&logits), 1);
        let cfg = SamplerConfig { temperature: 1.0, top_k: 2, top_p: 1.0, seed: 7 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == 1 || t == 3));
        let mut p = Sampler::new(SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.1, seed: 3 });
        assert!((0..10).all(|_| p.sample(&logits) == 1));
    }

    type Dist = Vec<(u32, f32)>;
    type D = [(u32, f32)];

    /// The distribution one speculative-sampling step outputs, computed
    /// exactly (no random numbers) from its parts: the draft proposes `d`
    /// with probability `q(d)`, kept with `accept(p, q, d)`, else replaced
    /// by a draw from `resid(p, q)` (from `p` when that is empty, as
    /// [`Sampler::accept_or_resample`] does). `[vocab]`.
    fn step_output(
        vocab: usize,
        p: &D,
        q: &D,
        accept: impl Fn(&D, &D, u32) -> f64,
        resid: impl Fn(&D, &D) -> Dist,
    ) -> Vec<f64> {
        let mut out = vec![0f64; vocab];
        let r = resid(p, q);
        let r = if r.is_empty() { p.to_vec() } else { r };
        for &(d, qd) in q {
            let a = accept(p, q, d);
            out[d as usize] += qd as f64 * a;
            for &(x, rx) in &r {
                out[x as usize] += qd as f64 * (1.0 - a) * rx as f64;
            }
        }
        out
    }

    /// Pairs (p, q) on a vocabulary of 5: overlapping, disjoint supports,
    /// equal, point masses, a draft sure of a token the model doubts.
    fn cases() -> Vec<(Dist, Dist)> {
        vec![
            (vec![(0, 0.5), (1, 0.3), (2, 0.2)], vec![(0, 0.2), (1, 0.6), (3, 0.2)]),
            (vec![(4, 0.7), (2, 0.3)], vec![(0, 0.5), (1, 0.5)]),
            (vec![(1, 0.25), (2, 0.25), (3, 0.5)], vec![(1, 0.25), (2, 0.25), (3, 0.5)]),
            (vec![(3, 1.0)], vec![(2, 1.0)]),
            (vec![(0, 0.1), (1, 0.1), (2, 0.1), (3, 0.1), (4, 0.6)], vec![(0, 0.9), (4, 0.1)]),
        ]
    }

    /// Largest gap between a step's output distribution and `p`, over the cases.
    fn worst_gap(accept: impl Fn(&D, &D, u32) -> f64 + Copy, resid: impl Fn(&D, &D) -> Dist + Copy) -> f64 {
        cases()
            .iter()
            .map(|(p, q)| {
                let out = step_output(5, p, q, accept, resid);
                (0..5u32).map(|x| (out[x as usize] - super::prob(p, x)).abs()).fold(0.0, f64::max)
            })
            .fold(0.0, f64::max)
    }

    /// Speculative sampling outputs exactly the model's distribution p,
    /// whatever the draft's q; biased variants of the step do not.
    #[test]
    fn speculative_sampling_outputs_exactly_the_models_distribution() {
        let gap = worst_gap(acceptance_probability, residual);
        assert!(gap < 1e-6, "accept/resample is off p by {gap}");
        // Biased variants must fail the same check.
        let resample_from_p = |p: &D, _: &D| p.to_vec();
        let point_mass_rule = |p: &D, _: &D, d: u32| super::prob(p, d);
        let reversed_ratio = |p: &D, q: &D, d: u32| (super::prob(q, d) / super::prob(p, d).max(1e-9)).min(1.0);
        for (name, gap) in [
            ("resample from p", worst_gap(acceptance_probability, resample_from_p)),
            ("accept with p(d)", worst_gap(point_mass_rule, residual)),
            ("accept with q/p", worst_gap(reversed_ratio, residual)),
        ] {
            assert!(gap > 0.05, "the biased variant {name:?} passed: gap {gap}");
        }
    }

    /// The sampler's own step, with its random numbers, draws tokens with
    /// p's frequencies (200 000 draws per case, within 0.005).
    #[test]
    fn accept_or_resample_draws_follow_p() {
        for (i, (p, q)) in cases().iter().enumerate() {
            let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 11 + i as u64 };
            let (mut target, mut draft) = (Sampler::new(cfg), Sampler::new(SamplerConfig { seed: 99, ..cfg }));
            let n = 200_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                let d = draft.draw(q);
                counts[target.accept_or_resample(p, q, d).1 as usize] += 1;
            }
            for x in 0..5u32 {
                let f = counts[x as usize] as f64 / n as f64;
                assert!((f - super::prob(p, x)).abs() < 0.005, "case {i}, token {x}: {f} vs {}", super::prob(p, x));
            }
        }
    }

    /// The distribution sampling draws from: greedy a point mass; top-k and
    /// top-p cut it, and it sums to 1.
    #[test]
    fn distribution_is_what_sample_draws_from() {
        let logits = [0.1, 3.0, 0.2, 2.9];
        let mut out = Vec::new();
        Sampler::new(SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 1 }).distribution(&logits, &mut out);
        assert_eq!(out, vec![(1, 1.0)]);
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, top_k: 3, top_p: 1.0, seed: 1 });
        s.distribution(&logits, &mut out);
        assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((out.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        let n = 50_000;
        let hits = (0..n).filter(|_| s.sample(&logits) == 3).count() as f32 / n as f32;
        assert!((hits - out[1].1).abs() < 0.01, "{hits} vs {}", out[1].1);
    }
}
