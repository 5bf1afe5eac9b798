//! Log-scale histograms of activation magnitudes: exact zeros counted apart,
//! positive values in bins of 1/32 octave, so any quantile is known to within
//! about 2% of its value from a few KiB of counts.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Bins per octave (factor of 2 in value).
pub const BINS_PER_OCTAVE: usize = 32;
/// Exponent of the lower edge of the first bin of [`Histogram::new`]: smaller
/// non-zero values (including subnormals) are counted in bin 0.
const MIN_EXP: i32 = -64;
/// Octaves covered by [`Histogram::new`]: values ≥ 2^(MIN_EXP + OCTAVES)
/// and non-finite values are counted in the top bin.
const OCTAVES: usize = 128;
/// Largest bin count accepted from a file.
const MAX_BINS: usize = 1 << 16;

/// Magnitudes `|v|` of many values: `zeros` exactly-zero values, and
/// `counts[i]` values in `[2^(min_exp + i/32), 2^(min_exp + (i+1)/32))`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Histogram {
    /// Values exactly 0 (or -0).
    pub zeros: u64,
    /// Non-zero values per log2 bin of 1/32 octave.
    pub counts: Vec<u64>,
    /// Exponent of the lower edge of bin 0.
    pub min_exp: i32,
    /// All values added: `zeros + Σ counts`.
    pub total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

/// Bin lookup tables on the 23-bit mantissa of an f32 in `[1, 2)`.
struct Tables {
    /// `bounds[k]`: smallest mantissa whose value is ≥ 2^(k/32), `k` in `0..=32`.
    bounds: [u32; BINS_PER_OCTAVE + 1],
    /// Bin of the lowest mantissa with these top 12 bits.
    coarse: Vec<u8>,
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        let mut bounds = [0u32; BINS_PER_OCTAVE + 1];
        for (k, b) in bounds.iter_mut().enumerate() {
            let v = (2f64.powf(k as f64 / BINS_PER_OCTAVE as f64) - 1.0) * (1u64 << 23) as f64;
            *b = v.ceil() as u32;
        }
        let coarse = (0..1u32 << 12).map(|j| (bounds.iter().rposition(|&b| j << 11 >= b).unwrap_or(0)) as u8).collect();
        Tables { bounds, coarse }
    })
}

/// Bin of `a` (positive, finite) relative to exponent `min_exp`, in `0..n_bins`.
#[inline]
fn bin_of(t: &Tables, a: f32, min_exp: i32, n_bins: usize) -> usize {
    let bits = a.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    if biased == 0 {
        // Subnormal: below 2^-126, under the first bin of every histogram prep makes.
        return 0;
    }
    let octave = biased - 127 - min_exp;
    if octave < 0 {
        return 0;
    }
    let m = bits & 0x7f_ffff;
    let mut sub = t.coarse[(m >> 11) as usize] as usize;
    if m >= t.bounds[sub + 1] {
        sub += 1;
    }
    (octave as usize * BINS_PER_OCTAVE + sub).min(n_bins - 1)
}

impl Histogram {
    /// An empty histogram covering `[2^-64, 2^64)` (4096 bins).
    pub fn new() -> Self {
        Histogram { zeros: 0, counts: vec![0; OCTAVES * BINS_PER_OCTAVE], min_exp: MIN_EXP, total: 0 }
    }

    /// Adds `|v|`. Non-finite values are counted in the top bin.
    #[allow(dead_code)] // prep itself adds whole slices
    pub fn add(&mut self, v: f32) {
        self.add_slice(std::slice::from_ref(&v));
    }

    /// Adds `|v|` for every `v` in `vs`.
    pub fn add_slice(&mut self, vs: &[f32]) {
        let t = tables();
        let n = self.counts.len();
        for &v in vs {
            let a = v.abs();
            if a == 0.0 {
                self.zeros += 1;
            } else if !a.is_finite() {
                self.counts[n - 1] += 1;
            } else {
                self.counts[bin_of(t, a, self.min_exp, n)] += 1;
            }
        }
        self.total += vs.len() as u64;
    }

    /// Adds the counts of `o` to `self`.
    ///
    /// # Panics
    /// If the two do not have the same bins (both come from [`Self::new`] in prep).
    pub fn merge(&mut self, o: &Histogram) {
        assert!(
            o.min_exp == self.min_exp && o.counts.len() == self.counts.len(),
            "histograms with different bins cannot be merged"
        );
        self.zeros += o.zeros;
        self.total += o.total;
        self.counts.iter_mut().zip(&o.counts).for_each(|(a, b)| *a += b);
    }

    /// Lower edge of bin `i` (a fractional `i` interpolates log-linearly).
    fn edge(&self, i: f64) -> f32 {
        2f64.powf(self.min_exp as f64 + i / BINS_PER_OCTAVE as f64) as f32
    }

    /// Threshold `t` such that a fraction `s` of the values is ≤ `t` (so
    /// "active iff value > t" gives sparsity ≈ `s`). `s` is clamped to `[0, 1]`;
    /// `s ≤ zeros/total` (or an empty histogram) gives 0.0. Inside a bin the
    /// threshold is interpolated log-linearly.
    pub fn quantile(&self, s: f64) -> f32 {
        let target = s.clamp(0.0, 1.0) * self.total as f64;
        if self.total == 0 || target <= self.zeros as f64 {
            return 0.0;
        }
        let mut cum = self.zeros as f64;
        let mut last = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let c = c as f64;
            if cum + c >= target {
                return self.edge(i as f64 + (target - cum) / c);
            }
            cum += c;
            last = i;
        }
        self.edge(last as f64 + 1.0)
    }

    /// Fraction of the values that are exactly 0.
    pub fn zero_fraction(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.zeros as f64 / self.total as f64
        }
    }

    /// Checks a histogram read from a file: bin count, exponent range and
    /// `total == zeros + Σ counts`.
    ///
    /// # Errors
    /// A description of the first inconsistency.
    pub fn check(&self) -> Result<(), String> {
        if self.counts.is_empty() || self.counts.len() > MAX_BINS {
            return Err(format!("{} bins (expected 1..={MAX_BINS})", self.counts.len()));
        }
        if !(-1000..=1000).contains(&self.min_exp) {
            return Err(format!("min_exp {} out of range", self.min_exp));
        }
        let sum = self.counts.iter().try_fold(self.zeros, |a, &c| a.checked_add(c)).ok_or("counts overflow")?;
        if sum != self.total {
            return Err(format!("total {} but zeros + counts = {sum}", self.total));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform in [0, 1) from a 64-bit LCG (Knuth's MMIX constants).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs()
    }

    #[test]
    fn bins_match_log2() {
        let mut rng = Lcg(7);
        let t = tables();
        let h = Histogram::new();
        for _ in 0..200_000 {
            // Log-uniform over [2^-70, 2^70).
            let v = 2f64.powf(rng.next() * 140.0 - 70.0) as f32;
            let expect = ((v as f64).log2() * 32.0).floor() as i64 - 32 * MIN_EXP as i64;
            let expect = expect.clamp(0, h.counts.len() as i64 - 1) as usize;
            assert_eq!(bin_of(t, v, h.min_exp, h.counts.len()), expect, "v = {v:e}");
        }
        // Exact bin edges land in the bin they open.
        for k in 0..32 {
            let v = 2f32.powf(k as f32 / 32.0);
            let b = bin_of(t, v, MIN_EXP, h.counts.len()) - 32 * (-MIN_EXP) as usize;
            assert!(b == k || (b + 1 == k && (v as f64) < 2f64.powf(k as f64 / 32.0)), "k {k}: bin {b}");
        }
    }

    /// Checks quantiles against the sample's own (sorted) quantiles within
    /// 1% (the histogram's error) and the distribution's within 3% (sampling noise).
    fn check_quantiles(h: &Histogram, mut vals: Vec<f32>, exact: impl Fn(f64) -> f64, what: &str) {
        vals.sort_by(f32::total_cmp);
        for k in 1..20 {
            let s = k as f64 / 20.0;
            let empirical = vals[(s * vals.len() as f64).ceil() as usize - 1] as f64;
            let q = h.quantile(s) as f64;
            assert!(rel(q, empirical) < 0.01, "{what}: quantile({s}) = {q}, sample quantile {empirical}");
            assert!(rel(q, exact(s)) < 0.03, "{what}: quantile({s}) = {q}, expected {}", exact(s));
        }
    }

    #[test]
    fn uniform_quantiles() {
        let mut rng = Lcg(42);
        let vals: Vec<f32> = (0..200_000).map(|_| rng.next() as f32).collect();
        let mut h = Histogram::new();
        vals.iter().for_each(|&v| h.add(v));
        assert_eq!(h.total, 200_000);
        check_quantiles(&h, vals, |s| s, "uniform");
    }

    #[test]
    fn exponential_quantiles_and_merge() {
        let mut rng = Lcg(3);
        let vals: Vec<f32> = (0..200_000).map(|_| -(1.0 - rng.next()).ln() as f32).collect();
        let (mut a, mut b) = (Histogram::new(), Histogram::new());
        for (i, &v) in vals.iter().enumerate() {
            if i % 3 == 0 {
                a.add(-v)
            } else {
                b.add(v)
            }
        }
        a.merge(&b);
        assert_eq!(a.total, 200_000);
        assert!(a.check().is_ok());
        check_quantiles(&a, vals, |s| -(1.0 - s).ln(), "exponential");
    }

    #[test]
    fn zeros_and_non_finite() {
        let mut h = Histogram::new();
        h.add_slice(&[0.0; 600]);
        h.add(-0.0);
        h.add_slice(&[1.0; 399]);
        assert_eq!((h.zeros, h.total), (601, 1000));
        assert_eq!(h.quantile(0.3), 0.0);
        assert_eq!(h.quantile(0.601), 0.0);
        let q = h.quantile(0.8);
        assert!((1.0..1.03).contains(&q), "{q}");
        h.add(f32::NAN);
        h.add(f32::INFINITY);
        assert_eq!(h.counts[h.counts.len() - 1], 2);
        assert_eq!(h.total, 1002);
        assert!(h.check().is_ok());
        assert_eq!(Histogram::new().quantile(0.5), 0.0);
    }

    #[test]
    fn check_rejects_inconsistent() {
        let mut h = Histogram::new();
        h.add(1.0);
        h.total = 5;
        assert!(h.check().is_err());
        h.counts.clear();
        assert!(h.check().is_err());
    }
}
