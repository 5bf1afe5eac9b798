//! The profile's report: CPU clock, host name, time stamp, and the table
//! `nflash probe` prints.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context, Result};

use nflash_format::device::{DeviceProfile, ReadPoint};
use nflash_runtime::message;

use super::{RemoveOnDrop, KIB};

/// Highest core clock, GHz: cpufreq's `cpuinfo_max_freq`, else the largest
/// "cpu MHz" of /proc/cpuinfo, else 1.0.
pub(super) fn max_ghz() -> f64 {
    let mut best = 0f64;
    if let Ok(rd) = std::fs::read_dir("/sys/devices/system/cpu") {
        for e in rd.flatten() {
            let p = e.path().join("cpufreq/cpuinfo_max_freq");
            if let Some(khz) = std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<f64>().ok()) {
                best = best.max(khz / 1e6);
            }
        }
    }
    if !(best.is_finite() && best > 0.0) {
        if let Ok(s) = std::fs::read_to_string("/proc/cpuinfo") {
            for l in s.lines().filter(|l| l.starts_with("cpu MHz")) {
                if let Some(mhz) = l.split(':').nth(1).and_then(|v| v.trim().parse::<f64>().ok()) {
                    best = best.max(mhz / 1e3);
                }
            }
        }
    }
    if best.is_finite() && best > 0.0 {
        (best * 100.0).round() / 100.0
    } else {
        1.0
    }
}

pub(super) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(s) if ok && !s.is_empty() => s.to_string(),
        _ => "unknown host".to_string(),
    }
}

/// The current time, `YYYY-MM-DD HH:MM UTC`.
pub(super) fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

pub(super) fn print_table(p: &DeviceProfile, direct: bool, took: Duration) {
    let mut in_flight: Vec<u32> = p.flash.read.iter().map(|r| r.in_flight).collect();
    in_flight.sort_unstable();
    in_flight.dedup();
    let mut blocks: Vec<u64> = p.flash.read.iter().map(|r| r.block_bytes).collect();
    blocks.sort_unstable();
    blocks.dedup();
    let cols: Vec<String> = in_flight.iter().map(|n| format!("×{n}")).collect();
    let w = 8;
    let pad = |v: &[String]| v.iter().map(|s| format!("{s:>w$}")).collect::<String>();
    message!("{} — flash read, MB/s ({}), reads in flight:", p.name, if direct { "O_DIRECT" } else { "buffered" });
    message!("{:>8}  {:<w2$} | sequential", "block", "random", w2 = w * cols.len());
    message!("{:>8}  {} | {}", "", pad(&cols), pad(&cols));
    for b in blocks {
        let get = |f: fn(&ReadPoint) -> f64| -> Vec<String> {
            in_flight
                .iter()
                .map(|&n| {
                    p.flash
                        .read
                        .iter()
                        .find(|r| r.block_bytes == b && r.in_flight == n)
                        .map_or("-".to_string(), |r| format!("{:.0}", f(r)))
                })
                .collect()
        };
        message!(
            "{:>8}  {} | {}",
            format!("{} KiB", b / KIB),
            pad(&get(|r| r.random_mb_s)),
            pad(&get(|r| r.sequential_mb_s))
        );
    }
    message!("io_queues {}", p.flash.io_queues);
    message!(
        "memory: {:.1} GiB total, {:.1} GiB available, {:.1} GB/s read",
        p.memory.total_bytes as f64 / (1u64 << 30) as f64,
        p.memory.available_bytes as f64 / (1u64 << 30) as f64,
        p.memory.bandwidth_gb_s
    );
    let cores = p.cpu.cores.iter().map(|c| format!("{} {} at {:.2} GHz", c.count, c.class, c.ghz)).collect::<Vec<_>>();
    message!(
        "cpu: {}; q4_0 matvec {:.2} GB/s on 1 thread, {:.2} GB/s on {}",
        cores.join(", "),
        p.cpu.q4_0_matvec_gb_s_1t.unwrap_or(0.0),
        p.cpu.q4_0_matvec_gb_s_mt.unwrap_or(0.0),
        p.cpu.threads_measured.unwrap_or(0)
    );
    if let Some(k) = &p.kernels {
        message!(
            "sparse FFN (q4_0 bundles, 1/8 selected): {:.2} GB/s on 1 thread, {:.2} GB/s on {}",
            k.q4_0_ffn_gb_s_1t,
            k.q4_0_ffn_gb_s_mt,
            p.cpu.threads_measured.unwrap_or(0)
        );
        if let (Some(one), Some(all)) = (k.q8_0_predictor_gb_s_1t, k.q8_0_predictor_gb_s_mt) {
            message!(
                "predictor (q8_0, rank 256): {one:.2} GB/s on 1 thread, {all:.2} GB/s on {}",
                p.cpu.threads_measured.unwrap_or(0)
            );
        }
        if let (Some(one), Some(all)) = (k.q4_0_attention_gb_s_1t, k.q4_0_attention_gb_s_mt) {
            message!(
                "attention projections (q4_0, per layer): {one:.2} GB/s on 1 thread, {all:.2} GB/s on {}",
                p.cpu.threads_measured.unwrap_or(0)
            );
        }
        if let Some(us) = k.read_cpu_us {
            message!(
                "CPU time per random read: {us:.1} µs at 4 KiB, +{:.3} µs per KiB beyond",
                k.read_cpu_us_per_kib.unwrap_or(0.0)
            );
        }
    }
    message!("probe took {:.1} s", took.as_secs_f64());
}

/// Writes `profile` as TOML to `out` (file name `out_name`) through a
/// temporary file in the same directory, renamed into place, after checking
/// that it parses back.
///
/// # Errors
/// An invalid profile (a measurement returned nothing), or the file cannot
/// be written or renamed.
pub(super) fn write_profile(out: &Path, out_name: OsString, profile: &DeviceProfile) -> Result<()> {
    let text = format!(
        "# Measured by `nflash probe` (see profiles/README.md for the fields and units).\n\n{}",
        profile.to_toml()
    );
    DeviceProfile::parse(&text)
        .map_err(|e| anyhow!("the measured profile is invalid ({e}); a measurement returned nothing"))?;

    let mut tmp_name = out_name;
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = RemoveOnDrop::new(out.with_file_name(tmp_name));
    {
        let mut f = File::create(&tmp.0).with_context(|| format!("cannot create {}", tmp.0.display()))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .with_context(|| format!("cannot write {}", tmp.0.display()))?;
    }
    std::fs::rename(&tmp.0, out).with_context(|| format!("cannot rename {} to {}", tmp.0.display(), out.display()))?;
    drop(tmp);

    Ok(())
}
