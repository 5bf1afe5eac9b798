//! Process-level measurements.

/// Peak resident set size of this process, bytes (`VmHWM` in
/// `/proc/self/status`); `None` where that file does not exist.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
