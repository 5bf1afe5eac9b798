//! `nflash-format`: the `.nflash` packed model file (see `SPEC.md`).
//!
//! A pack is a fixed 64-byte [`Header`], aligned segments (tokenizer,
//! resident tensors, one FFN segment of neuron clusters per layer), and a
//! bincode [`Manifest`] describing them. [`PackWriter`] writes one atomically;
//! [`Pack::open`] validates one before any access.

pub mod checksums;
pub mod config;
pub mod device;
pub mod dtype;
pub mod error;
pub mod header;
pub mod interleave;
pub mod manifest;
pub mod metadata;
pub mod plan;
pub mod reader;
pub mod writer;

pub use checksums::{cluster_crc32c, ClusterChecksums, ClusterHasher};
pub use config::{
    Activation, Architecture, Gemma3, LayerNorms, LayerSet, ModelConfig, Moe, Phi3, RopeScaling, MAX_CONTEXT,
    MAX_EXPERTS, MAX_FFN_UNITS, MAX_LAYERS,
};
pub use device::{DeviceProfile, KernelSpeeds};
pub use dtype::DType;
pub use error::{Error, Result};
pub use header::{Header, DEFAULT_ALIGNMENT, HEADER_BYTES, MAGIC, VERSION_MAJOR, VERSION_MINOR};
pub use manifest::{
    BundleLayout, Criterion, FfnLayer, LayerSparsity, Manifest, NeuronCluster, PredictorKind, PredictorQuality,
    Segment, SegmentKind, SparseInfo, TensorEntry, TokenizerInfo,
};
pub use metadata::{ExpertStats, GenerationDefaults, Metadata};
pub use plan::Plan;
pub use reader::Pack;
pub use writer::PackWriter;
