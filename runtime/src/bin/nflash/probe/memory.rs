//! Memory: streaming read bandwidth on every core, and how much memory this
//! process may use (`/proc/meminfo`, capped by its cgroup's limit).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use rayon::prelude::*;

/// Sum of a slice with 16 independent accumulators (vectorizes).
fn sum16(c: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = c.chunks_exact(16);
    for ch in &mut it {
        for k in 0..16 {
            acc[k] += ch[k];
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

/// Streaming read bandwidth over a `bytes` f32 buffer on the current rayon
/// pool, GB/s (10⁹ bytes/s): best of 3 trials of 4 passes.
pub(super) fn memory_bandwidth(bytes: usize) -> f64 {
    let n = bytes / 4;
    let mut buf = vec![0f32; n];
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        for (j, v) in c.iter_mut().enumerate() {
            *v = ((i * 7 + j) % 1024) as f32 * 1e-3 + 1.0;
        }
    });
    let passes = 4;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let mut s = 0f32;
        for _ in 0..passes {
            s += buf.par_chunks(1 << 18).map(sum16).sum::<f32>();
        }
        std::hint::black_box(s);
        best = best.max((n * 4 * passes) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo, bytes; the available figure
/// is capped by the memory limit of this process's cgroup (v1 or v2) when smaller.
pub(super) fn memory_sizes() -> Result<(u64, u64)> {
    let info = std::fs::read_to_string("/proc/meminfo").context("cannot read /proc/meminfo")?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    let total = field("MemTotal").ok_or_else(|| anyhow!("/proc/meminfo has no MemTotal"))?;
    let mut avail = field("MemAvailable").or_else(|| field("MemFree")).unwrap_or(total);
    if let Some(limit) = cgroup_limit() {
        avail = avail.min(limit);
    }
    Ok((total, avail.clamp(1, total)))
}

/// The smallest memory limit among the cgroup v1/v2 files that apply to this
/// process (the root paths and this process's own group), bytes.
fn cgroup_limit() -> Option<u64> {
    let mut paths =
        vec![PathBuf::from("/sys/fs/cgroup/memory/memory.limit_in_bytes"), PathBuf::from("/sys/fs/cgroup/memory.max")];
    if let Ok(s) = std::fs::read_to_string("/proc/self/cgroup") {
        for line in s.lines() {
            let mut it = line.splitn(3, ':');
            let (Some(_), Some(ctrl), Some(group)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            let group = group.trim_start_matches('/');
            if ctrl.is_empty() {
                paths.push(Path::new("/sys/fs/cgroup").join(group).join("memory.max"));
            } else if ctrl.split(',').any(|c| c == "memory") {
                paths.push(Path::new("/sys/fs/cgroup/memory").join(group).join("memory.limit_in_bytes"));
            }
        }
    }
    // "max" (v2, no limit) does not parse and is skipped; v1's "no limit" is a huge number.
    paths.iter().filter_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok()).min()
}
