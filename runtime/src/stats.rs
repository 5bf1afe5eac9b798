//! Process-level measurements.

/// Current resident set size of this process, bytes (`VmRSS`); `None`
/// where `/proc/self/status` does not exist.
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

/// Releases freed heap memory to the system (glibc `malloc_trim`), so that
/// load-time transients do not count as resident; a no-op elsewhere.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the heap to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident set size of this process, bytes (`VmHWM` in
/// `/proc/self/status`); `None` where that file does not exist.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// The `q`-quantile (0–1) of `values` by nearest rank on a sorted copy;
/// `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(super::percentile(&v, 0.5), Some(50.0));
        assert_eq!(super::percentile(&v, 0.9), Some(90.0));
        assert_eq!(super::percentile(&v, 0.99), Some(99.0));
        assert_eq!(super::percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(super::percentile(&[], 0.5), None);
    }
}
