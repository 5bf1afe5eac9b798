//! Flash offload: the FFN neuron clusters that do not fit the memory budget
//! stay in the pack file and are read on demand.
//!
//! - [`cache`]: [`NeuronCache`], the segmented neuron cache (hot region,
//!   cold LRU) and the model's [`crate::model::ClusterSource`];
//! - [`flash`]: the pack file opened for direct reads, and the state the
//!   cache and the I/O engines share;
//! - [`io`]: the I/O pipeline (I/O threads, or [`uring`]);
//! - [`uring`]: the io_uring engine of the pipeline;
//! - [`align`]: the page size and the file system's direct-I/O alignment,
//!   read from the running system;
//! - [`slots`]: the aligned buffers and who may write them (all of the
//!   slot-ownership `unsafe`).

pub mod align;
pub mod cache;
pub mod flash;
pub mod io;
pub mod slots;
pub mod uring;

pub use cache::{CacheMemory, NeuronCache};
