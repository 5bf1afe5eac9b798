//! Pack → model: views of every resident tensor, checked by name and shape
//! against the config (formats/SPEC.md §4.3), the FFN layers' neuron
//! cluster tables (§4.4) and predictors (§4.5).

use std::sync::Mutex;

use nflash_format::{Architecture, Pack};

use super::attention::{Attention, LayerRope};
use super::ffn::Ffn;
use super::ops::Rope;
use super::predictor::{LayerCounts, LayerSparse};
use super::source::ClusterSource;
use super::tensors::{matrix, opt_vector, vector};
use super::{Layer, Model, Router, SpecScratch, Speculation, Unit, Work};
use crate::error::Result;

impl<'a> Model<'a> {
    /// Builds views of every tensor of `pack`, checking names and shapes
    /// against the config; the FFN's neuron clusters come from `source`.
    ///
    /// # Errors
    /// [`crate::Error::MissingTensor`], [`crate::Error::Shape`], [`crate::Error::Format`].
    pub fn load(pack: &'a Pack, source: Box<dyn ClusterSource + 'a>) -> Result<Self> {
        let cfg = pack.manifest().config.clone();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let qd = cfg.num_heads * cfg.head_dim;
        let kvd = cfg.num_kv_heads * cfg.head_dim;
        let inter = cfg.intermediate_size;
        let embed = matrix(pack, "model.embed_tokens.weight", v, h)?;
        let lm_head = if cfg.tie_word_embeddings { embed } else { matrix(pack, "lm_head.weight", v, h)? };
        let sparse_info = pack.manifest().sparse.clone();
        let qkv_bias = cfg.attention_bias || cfg.architecture == Architecture::Qwen2;
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        let experts = cfg.experts() as usize;
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            // The FFN units of this layer: one, or one per expert (SPEC §4.4).
            let mut units = Vec::with_capacity(experts);
            for index in l as usize * experts..(l as usize + 1) * experts {
                let f = pack.ffn_layer(index)?;
                let sparse = match (&sparse_info, &f.sparse) {
                    (Some(si), Some(ls)) => Some(LayerSparse::load(pack, index, si.predictor, si.criterion, ls)?),
                    _ => None,
                };
                let ffn = Ffn::new(
                    f,
                    cfg.activation,
                    opt_vector(pack, &format!("{p}.mlp.gate_proj.bias"), inter, cfg.mlp_bias)?,
                    opt_vector(pack, &format!("{p}.mlp.up_proj.bias"), inter, cfg.mlp_bias)?,
                    opt_vector(pack, &format!("{p}.mlp.down_proj.bias"), h, cfg.mlp_bias)?,
                );
                units.push(Unit { index, ffn, sparse });
            }
            let router = match (cfg.router_name(l as usize), cfg.architecture.moe()) {
                (Some(name), Some(moe)) => {
                    Some(Router { weight: matrix(pack, &name, u64::from(moe.num_experts), h)?, moe })
                }
                _ => None,
            };
            let attn = Attention {
                q: matrix(pack, &format!("{p}.self_attn.q_proj.weight"), qd, h)?,
                k: matrix(pack, &format!("{p}.self_attn.k_proj.weight"), kvd, h)?,
                v: matrix(pack, &format!("{p}.self_attn.v_proj.weight"), kvd, h)?,
                o: matrix(pack, &format!("{p}.self_attn.o_proj.weight"), h, qd)?,
                q_bias: opt_vector(pack, &format!("{p}.self_attn.q_proj.bias"), qd, qkv_bias)?,
                k_bias: opt_vector(pack, &format!("{p}.self_attn.k_proj.bias"), kvd, qkv_bias)?,
                v_bias: opt_vector(pack, &format!("{p}.self_attn.v_proj.bias"), kvd, qkv_bias)?,
                o_bias: opt_vector(
                    pack,
                    &format!("{p}.self_attn.o_proj.bias"),
                    h,
                    cfg.attention_bias && cfg.architecture != Architecture::Qwen2,
                )?,
                q_norm: opt_vector(pack, &format!("{p}.self_attn.q_norm.weight"), cfg.head_dim, cfg.qk_norm())?,
                k_norm: opt_vector(pack, &format!("{p}.self_attn.k_norm.weight"), cfg.head_dim, cfg.qk_norm())?,
                rope: match (cfg.layer_uses_rope(l as usize), cfg.layer_uses_local_rope(l as usize)) {
                    (false, _) => LayerRope::None,
                    (true, false) => LayerRope::Global,
                    (true, true) => LayerRope::Local,
                },
                window: cfg.layer_window(l as usize).map(|w| w as usize),
            };
            let norms = cfg.layer_norms(l as usize);
            let opt = |name: &Option<String>| name.as_ref().map(|n| vector(pack, n, h)).transpose();
            layers.push(Layer {
                attn_norm: vector(pack, &norms.attn, h)?,
                ffn_norm: vector(pack, &norms.ffn, h)?,
                post_attn_norm: opt(&norms.post_attn)?,
                post_ffn_norm: opt(&norms.post_ffn)?,
                attn,
                units,
                router,
            });
        }
        Ok(Model {
            rope: Rope::new(&cfg),
            rope_local: cfg.local_rope().map(|c| Rope::new(&c)),
            final_norm: vector(pack, "model.norm.weight", h)?,
            embed,
            lm_head,
            sparse_enabled: sparse_info.is_some(),
            kv_type: Default::default(),
            speculation: Speculation::Auto,
            misguide_prefetch: false,
            source,
            work: Mutex::new(Work {
                counts: vec![LayerCounts::default(); layers.len()],
                layer_wait: vec![(0.0, 0.0); layers.len()],
                spec: SpecScratch { guess_layer: usize::MAX, ..Default::default() },
                ..Default::default()
            }),
            layers,
            cfg,
        })
    }
}
