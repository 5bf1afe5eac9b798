//! The metadata segment (SPEC §4.9): a UTF-8 JSON object of optional,
//! self-describing settings. Keys are added by minor versions; readers
//! ignore keys they do not know, so adding one never breaks an older reader
//! of the same minor, and a pack without the segment (3.0, 3.1) has none.

use serde::{Deserialize, Serialize};

/// Largest metadata segment accepted, bytes.
pub const MAX_METADATA_BYTES: u64 = 1 << 20;

/// Sampling defaults of the checkpoint (HF `generation_config.json`:
/// `temperature`, `top_p`, `top_k`), each present only if the checkpoint set it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationDefaults {
    /// Softmax temperature, ≥ 0 and finite (`temperature`; 0 = greedy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus mass in (0, 1] (`top_p`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k, 0 = off (`top_k`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
}

impl GenerationDefaults {
    /// Whether no default is set.
    pub fn is_empty(&self) -> bool {
        self.temperature.is_none() && self.top_p.is_none() && self.top_k.is_none()
    }

    /// Checks the ranges; returns a description of the first bad value.
    pub fn check(&self) -> std::result::Result<(), String> {
        if let Some(t) = self.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
            return Err(format!("temperature {t} is not a finite number ≥ 0"));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(format!("top_p {p} is outside (0, 1]"));
        }
        Ok(())
    }
}

/// Router statistics of a mixture of experts from calibration (SPEC §4.9
/// `experts`, since 3.3).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    /// `[num_layers · num_experts]`, FFN unit order: the fraction of the
    /// calibration tokens the router sent to each expert (each in [0, 1]; a
    /// layer's sum is `experts_per_token`).
    pub routed_share: Vec<f32>,
}

impl ExpertStats {
    /// Checks the shares against `units` FFN units of layers of `moe`'s
    /// experts (each in [0, 1], each layer's summing to `experts_per_token`
    /// within 1%); returns a description of the first problem.
    pub fn check(&self, units: usize, moe: crate::Moe) -> std::result::Result<(), String> {
        if self.routed_share.len() != units {
            return Err(format!("{} routed shares for {units} FFN units", self.routed_share.len()));
        }
        if let Some((u, s)) =
            self.routed_share.iter().enumerate().find(|(_, s)| !(s.is_finite() && (0.0..=1.0).contains(*s)))
        {
            return Err(format!("routed share {s} of FFN unit {u} is not in [0, 1]"));
        }
        let k = moe.experts_per_token as f32;
        for (l, layer) in self.routed_share.chunks(moe.num_experts.max(1) as usize).enumerate() {
            let sum: f32 = layer.iter().sum();
            if (sum - k).abs() > 0.01 * k {
                return Err(format!("layer {l}'s routed shares sum to {sum}, not to the {k} experts each token runs"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ExpertStats;
    use crate::Moe;

    #[test]
    fn routed_shares_are_fractions_summing_to_the_experts_per_token() {
        let moe = Moe { num_experts: 4, experts_per_token: 2, norm_topk_prob: true };
        let ok = ExpertStats { routed_share: vec![0.9, 0.5, 0.4, 0.2, 0.5, 0.5, 0.5, 0.5] };
        assert!(ok.check(8, moe).is_ok());
        assert!(ok.check(4, moe).unwrap_err().contains("8 routed shares for 4"));
        let zeros = ExpertStats { routed_share: vec![0.0; 8] };
        assert!(zeros.check(8, moe).unwrap_err().contains("layer 0's routed shares sum to 0"));
        let over = ExpertStats { routed_share: vec![1.5, 0.5, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5] };
        assert!(over.check(8, moe).unwrap_err().contains("routed share 1.5 of FFN unit 0"));
        let nan = ExpertStats { routed_share: vec![f32::NAN, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5] };
        assert!(nan.check(8, moe).is_err());
    }
}

/// The metadata object (SPEC §4.9). Unknown keys are ignored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Sampling defaults (`"generation"`), from the checkpoint's `generation_config.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationDefaults>,
    /// Router statistics of a sparse mixture-of-experts pack (`"experts"`, 3.3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertStats>,
}
