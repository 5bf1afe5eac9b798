//! Mixture-of-experts routing (Mixtral, Qwen3-MoE; DESIGN.md "Phone CPUs,
//! kernels and MoE"): the router's logits over a layer's experts, their
//! softmax, and the top-k experts each token runs, with their weights.
//! As transformers' `MixtralSparseMoeBlock` and `Qwen3MoeSparseMoeBlock`:
//! `p = softmax(W_r · x)`, the `experts_per_token` largest `p` (ties to the
//! lower expert index), divided by their sum when `norm_topk_prob` (always
//! for Mixtral).

use super::ops::softmax;
use super::Router;
use crate::kernels::DotInput;

impl Router<'_> {
    /// Experts per layer.
    pub fn n_experts(&self) -> usize {
        self.moe.num_experts as usize
    }

    /// Routes one token `x` (`[hidden]`, the FFN input): appends its
    /// `experts_per_token` (expert, weight) pairs to `routes`, in ascending
    /// expert order (the order their outputs are added in). `probs` is
    /// scratch (`[n_experts]`).
    pub fn route(&self, x: &[f32], probs: &mut Vec<f32>, routes: &mut Vec<(u32, f32)>) {
        probs.clear();
        probs.resize(self.n_experts(), 0.0);
        self.weight.matvec(&DotInput::from_slice(self.weight.dtype, x), probs);
        softmax(probs);
        top_k(probs, self.moe.experts_per_token as usize, self.moe.norm_topk_prob, routes);
    }
}

/// The tokens routed to expert `e`, with their weights, in token order:
/// `routes` is `[n_tokens · k]` (expert, weight), each token's `k` routings
/// in a row (as [`Router::route`] and [`top_k`] append them).
pub fn routed_to(routes: &[(u32, f32)], k: usize, e: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
    routes.iter().enumerate().filter(move |(_, r)| r.0 as usize == e).map(move |(i, r)| (i / k, r.1))
}

/// Appends the `k` largest of `probs` (ties to the lower index) to `out` as
/// (index, weight) in ascending index order; weights divided by their sum
/// when `normalize` (`norm_topk_prob`). `prep`'s profiler routes with it too.
pub fn top_k(probs: &[f32], k: usize, normalize: bool, out: &mut Vec<(u32, f32)>) {
    let start = out.len();
    for _ in 0..k.min(probs.len()) {
        // Largest not yet chosen; the first of equal values.
        let mut best: Option<usize> = None;
        for (i, &p) in probs.iter().enumerate() {
            if out[start..].iter().any(|&(e, _)| e as usize == i) {
                continue;
            }
            if best.is_none_or(|b| p > probs[b]) {
                best = Some(i);
            }
        }
        let Some(b) = best else { break };
        out.push((b as u32, probs[b]));
    }
    if normalize {
        // Summed in rank order, as the reference implementations do.
        let sum: f32 = out[start..].iter().map(|&(_, w)| w).sum();
        out[start..].iter_mut().for_each(|(_, w)| *w /= sum);
    }
    out[start..].sort_by_key(|&(e, _)| e);
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn top_k_picks_the_largest_ties_to_lower_index_and_normalizes() {
        let p = [0.1, 0.3, 0.05, 0.3, 0.25];
        let mut out = vec![(9, 9.0)];
        top_k(&p, 2, false, &mut out);
        assert_eq!(out, vec![(9, 9.0), (1, 0.3), (3, 0.3)]);
        let mut out = Vec::new();
        top_k(&p, 3, true, &mut out);
        let s = 0.3f32 + 0.3 + 0.25;
        assert_eq!(out, vec![(1, 0.3 / s), (3, 0.3 / s), (4, 0.25 / s)]);
        let mut out = Vec::new();
        top_k(&[0.5, 0.5], 1, true, &mut out);
        assert_eq!(out, vec![(0, 1.0)]);
        // Ascending expert order, whatever the rank order.
        let mut out = Vec::new();
        top_k(&[0.1, 0.2, 0.7], 2, false, &mut out);
        assert_eq!(out, vec![(1, 0.2), (2, 0.7)]);
    }
}
