//! Token sampling: greedy, temperature, top-k, top-p (nucleus).

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::rngs::StdRng;
use rand::SeedableRng;

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
        match WeightedIndex::new(&self.probs) {
            Ok(d) => self.idx[d.sample(&mut self.rng)] as u32,
            Err(_) => self.idx[0] as u32,
        }
    }
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
}
