//! Memory that follows the system (issue 46): the signals Linux and Android
//! give about memory running short, and the governor that resizes the
//! neuron cache ([`MemoryControl`]) between its floor and its ceiling.
//!
//! Signals, each read only where the system offers it:
//! - the process's memory cgroup: v2 `memory.max`/`memory.high` against
//!   `memory.current`, v1 `memory.limit_in_bytes` against
//!   `memory.usage_in_bytes`, each less the group's inactive file pages
//!   (`memory.stat`), which the kernel takes back first; v2
//!   `memory.events` (the group reaching `high` or `max`, and OOM kills in
//!   it), v1 `memory.oom_control` (OOM kills) and a v1
//!   `memory.pressure_level` notifier ([`PressureLevel`]);
//! - `/proc/meminfo` `MemAvailable`;
//! - PSI (`/proc/pressure/memory`, `some` stall time), where readable:
//!   Android's SELinux denies it to apps, and with zram the kernel swaps
//!   anonymous memory out instead of failing, so that stalls, not free
//!   memory, show the squeeze.
//!
//! The governor polls every [`POLL`]; below the reserve it gives back the
//! shortfall at once (one decode step later at most, for hot clusters),
//! and it grows back only after [`CALM`] without pressure, half the spare
//! room at a time (hysteresis, so that nflash and another app do not take
//! turns evicting each other).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::model::MemoryControl;

/// How often the governor reads the signals.
pub const POLL: Duration = Duration::from_millis(50);

/// How long pressure must be gone before the cache grows back.
pub const CALM: Duration = Duration::from_secs(2);

/// The v1 `memory.pressure_level` a [`Watch`] listens for: `medium`, the
/// group swapping or evicting active file pages (`low` fires at every
/// reclaim of the page cache, which reading flash causes all the time).
pub const PRESSURE_LEVEL: &str = "medium";

/// The default [`Governor::burst_min`]: 16 MiB.
pub const BURST_MIN: u64 = 16 << 20;

/// How fast the remembered burst fades: halved every 10 s without a larger one.
const BURST_HALF_LIFE: Duration = Duration::from_secs(10);

/// PSI `some` stall time per poll above which memory counts as short
/// (microseconds; 5% of [`POLL`]).
const STALL_US: u64 = 2_500;

/// One reading of the signals ([`Signals::read`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reading {
    /// Bytes the process's cgroup may still take before its limit: the
    /// limit (the lower of `memory.max` and `memory.high`, v1
    /// `memory.limit_in_bytes`) less the usage, not counting inactive file
    /// pages; negative when over. `None` without a limited memory cgroup.
    pub cgroup_room: Option<i64>,
    /// The cgroup's limit that `cgroup_room` is measured against, bytes.
    pub cgroup_limit: Option<u64>,
    /// `MemAvailable`, bytes.
    pub available: Option<u64>,
    /// PSI `some` total stall time, microseconds (cumulative).
    pub stall_us: Option<u64>,
    /// A PSI trigger ([`PsiTrigger`]) fired since the last reading.
    pub psi_fired: bool,
    /// `/proc/vmstat` `pswpout`: pages swapped out since boot (to zram on
    /// most phones), cumulative.
    pub swap_out_pages: Option<u64>,
    /// Times the cgroup reached its limits: v2 `memory.events` `high` plus
    /// `max`, cumulative (the kernel reclaimed or throttled in the group).
    pub limit_hits: Option<u64>,
    /// Processes of the cgroup the kernel OOM-killed: v2 `memory.events`,
    /// v1 `memory.oom_control`, `oom_kill`; cumulative.
    pub oom_kills: Option<u64>,
    /// The v1 `memory.pressure_level` notifier ([`PressureLevel`]) fired
    /// since the last reading.
    pub level_fired: bool,
}

impl Reading {
    /// `(bytes above its reserve, that reserve)` of the signal with the
    /// least room above its own reserve, negative when short; `None` when
    /// neither the cgroup's room nor `MemAvailable` is known. `MemAvailable`
    /// keeps `reserve`; the cgroup keeps `reserve` too, or only the gap
    /// between its limit and the process's `budget` where that is smaller
    /// (see [`Governor::budget`]). Both keep at least `least` bytes
    /// (the governor's guess at the next burst, [`Governor::burst_bytes`]).
    pub fn margin(&self, reserve: u64, budget: Option<u64>, least: u64) -> Option<(i64, i64)> {
        // Past 2^60 bytes every reserve means "always short" (compared in i64).
        let least = least.min(1 << 60) as i64;
        let reserve = (reserve.min(1 << 60) as i64).max(least);
        let cgroup_reserve = match (budget, self.cgroup_limit) {
            (Some(b), Some(l)) => (l.saturating_sub(b) as i64).min(reserve).max(least),
            _ => reserve,
        };
        [
            self.cgroup_room.map(|x| (x.saturating_sub(cgroup_reserve), cgroup_reserve)),
            self.available.map(|a| ((a.min(i64::MAX as u64) as i64).saturating_sub(reserve), reserve)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|m| m.0)
    }

    /// Bytes the process may hold in all, holding `held` now: that and what
    /// is above the reserve ([`Self::margin`]), at least 0; `None` as margin.
    pub fn allowance(&self, held: u64, reserve: u64, budget: Option<u64>) -> Option<u64> {
        let (margin, _) = self.margin(reserve, budget, 0)?;
        Some((held.min(i64::MAX as u64) as i64).saturating_add(margin).max(0) as u64)
    }
}

/// Pages swapped out between two readings that count as memory pressure:
/// 256 (1 MiB of 4 KiB pages) per [`POLL`], 20 MiB/s.
pub const SWAP_OUT_PAGES: u64 = 256;

/// Memory stall (PSI `some`) a trigger waits for within its window,
/// microseconds: 5% of the window, as [`STALL_US`] is of [`POLL`].
const TRIGGER_STALL_US: u64 = 50_000;

/// A PSI trigger on `/proc/pressure/memory` (the kernel's
/// Documentation/accounting/psi.rst, "Monitoring for pressure
/// thresholds"): the kernel wakes a waiter when tasks stalled on memory
/// for [`TRIGGER_STALL_US`] within a window, so the governor reacts at
/// once rather than at its next poll. Where triggers are not permitted
/// (kernels before 5.2, SELinux on Android apps, windows other than
/// multiples of 2 s for unprivileged processes) there is none and the
/// governor polls alone.
pub struct PsiTrigger {
    file: std::fs::File,
}

impl PsiTrigger {
    /// A trigger on the PSI file at `path` with a 1 s window (2 s where
    /// only that is permitted); `None` where neither is.
    pub fn new(path: &Path) -> Option<Self> {
        use std::io::Write;
        [1_000_000u64, 2_000_000].into_iter().find_map(|window| {
            let mut file = std::fs::OpenOptions::new().read(true).write(true).open(path).ok()?;
            let stall = TRIGGER_STALL_US * window / 1_000_000;
            file.write_all(format!("some {stall} {window}\0").as_bytes()).ok()?;
            Some(PsiTrigger { file })
        })
    }

    /// Waits up to `timeout` for the trigger; whether it fired. An error
    /// (the trigger gone) counts as not fired.
    pub fn wait(&self, timeout: Duration) -> bool {
        wait_for_signal(Some(self), None, timeout).0
    }
}

/// A cgroup v1 `memory.pressure_level` notifier (the kernel's
/// Documentation/admin-guide/cgroup-v1/memory.rst, "Memory Pressure"): an
/// eventfd registered through the group's `cgroup.event_control`, which
/// the kernel signals when reclaim in the group reaches the level
/// (`low`: any reclaim; `medium`: swapping or evicting active file pages;
/// `critical`: about to OOM-kill). Needs write access to the group's
/// `cgroup.event_control` (root, or the group's owner); `None` elsewhere,
/// and on cgroup v2, which has no such file.
pub struct PressureLevel {
    event: rustix::fd::OwnedFd,
    // Kept open while registered.
    _level: std::fs::File,
}

impl PressureLevel {
    /// Registers a notifier for `level` on the v1 memory cgroup `dir`.
    pub fn new(dir: &Path, level: &str) -> Option<Self> {
        use rustix::event::{eventfd, EventfdFlags};
        use rustix::fd::AsRawFd;
        let event = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).ok()?;
        let file = std::fs::File::open(dir.join("memory.pressure_level")).ok()?;
        let line = format!("{} {} {level}", event.as_raw_fd(), file.as_raw_fd());
        std::fs::write(dir.join("cgroup.event_control"), line).ok()?;
        Some(PressureLevel { event, _level: file })
    }

    /// Whether the notifier fired since the last call (resets it).
    pub fn take(&self) -> bool {
        let mut n = [0u8; 8];
        matches!(rustix::io::read(&self.event, &mut n), Ok(8))
    }

    /// Waits up to `timeout` for the notifier (the kernel signals it from
    /// a work queue, shortly after the reclaim); whether it fired (resets it).
    pub fn wait(&self, timeout: Duration) -> bool {
        wait_for_signal(None, Some(self), timeout).1
    }
}

/// Waits up to `timeout` for a PSI `trigger` or a v1 pressure `level`
/// notifier, whichever the system gave (a plain sleep, cut short by
/// [`std::thread::Thread::unpark`], with neither); whether each fired.
fn wait_for_signal(trigger: Option<&PsiTrigger>, level: Option<&PressureLevel>, timeout: Duration) -> (bool, bool) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    if trigger.is_none() && level.is_none() {
        std::thread::park_timeout(timeout);
        return (false, false);
    }
    let mut fds = Vec::with_capacity(2);
    if let Some(t) = trigger {
        fds.push(PollFd::new(&t.file, PollFlags::PRI));
    }
    if let Some(l) = level {
        fds.push(PollFd::new(&l.event, PollFlags::IN));
    }
    let t = Timespec::try_from(timeout).ok();
    let ready = matches!(poll(&mut fds, t.as_ref()), Ok(n) if n > 0);
    let psi = ready && trigger.is_some() && fds[0].revents().contains(PollFlags::PRI);
    (psi, level.is_some_and(|l| l.take()))
}

/// Where the signals of this process are read ([`Signals::detect`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Signals {
    /// The memory cgroup's directory and whether it is cgroup v2.
    pub cgroup: Option<(PathBuf, bool)>,
    /// `/proc/meminfo`, if readable.
    pub meminfo: Option<PathBuf>,
    /// `/proc/pressure/memory`, if readable.
    pub psi: Option<PathBuf>,
    /// `/proc/vmstat`, if readable (swap-outs).
    pub vmstat: Option<PathBuf>,
    /// A zram device is among the swap areas (`/proc/swaps`).
    pub zram: bool,
}

impl Signals {
    /// Finds this process's memory cgroup (`/proc/self/cgroup` and
    /// `/proc/self/mountinfo`), and checks that `/proc/meminfo` and
    /// `/proc/pressure/memory` can be read.
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let cgroup = match (read("/proc/self/cgroup"), read("/proc/self/mountinfo")) {
            (Some(c), Some(m)) => memory_cgroup(&c, &m),
            _ => None,
        };
        let readable = |p: &str| read(p).map(|_| PathBuf::from(p));
        Signals {
            cgroup,
            meminfo: readable("/proc/meminfo"),
            psi: readable("/proc/pressure/memory"),
            vmstat: readable("/proc/vmstat"),
            zram: read("/proc/swaps").is_some_and(|s| swaps_have_zram(&s)),
        }
    }

    /// A description for `--stats`: which signals are in use (`trigger`:
    /// PSI with a [`PsiTrigger`]; `level`: a v1 [`PressureLevel`] notifier).
    pub fn describe(&self, trigger: bool, level: bool) -> String {
        let mut v = Vec::new();
        if let Some((p, v2)) = &self.cgroup {
            let r = self.read();
            let limit = match r.cgroup_limit {
                Some(l) => format!(" (limit {:.1} MiB)", l as f64 / (1u64 << 20) as f64),
                None => " (no limit set)".into(),
            };
            let mut events = Vec::new();
            if r.limit_hits.is_some() {
                events.push("memory.events");
            } else if r.oom_kills.is_some() {
                events.push("memory.oom_control");
            }
            if level {
                events.push("memory.pressure_level");
            }
            let events = if events.is_empty() { String::new() } else { format!(", {}", events.join(", ")) };
            v.push(format!("cgroup {} {}{limit}{events}", if *v2 { "v2" } else { "v1" }, p.display()));
        }
        if self.meminfo.is_some() {
            v.push("MemAvailable".into());
        }
        if self.vmstat.is_some() {
            v.push(if self.zram { "swap-outs (to zram)" } else { "swap-outs" }.into());
        }
        if self.psi.is_some() {
            v.push(if trigger { "PSI (with a trigger)" } else { "PSI" }.into());
        }
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    }

    /// Reads every signal (a missing or unreadable one is `None`).
    pub fn read(&self) -> Reading {
        let read = |p: &Path| std::fs::read_to_string(p).ok();
        let mut cgroup_limit = None;
        let (mut limit_hits, mut oom_kills) = (None, None);
        if let Some((dir, v2)) = &self.cgroup {
            let events = read(&dir.join(if *v2 { "memory.events" } else { "memory.oom_control" }));
            if let Some(e) = events {
                if *v2 {
                    let f = |k| count_field(&e, k);
                    limit_hits = f("high").zip(f("max")).map(|(h, m)| h.saturating_add(m));
                }
                oom_kills = count_field(&e, "oom_kill");
            }
        }
        let cgroup_room = self.cgroup.as_ref().and_then(|(dir, v2)| {
            let f = |name: &str| read(&dir.join(name));
            let (max, high) =
                if *v2 { (f("memory.max")?, f("memory.high")) } else { (f("memory.limit_in_bytes")?, None) };
            let room = if *v2 {
                cgroup_room_v2(&max, high.as_deref(), &f("memory.current")?, &f("memory.stat")?)
            } else {
                cgroup_room_v1(&max, &f("memory.usage_in_bytes")?, &f("memory.stat")?)
            };
            cgroup_limit = room.and(cgroup_limit_of(&max, high.as_deref()));
            room
        });
        Reading {
            cgroup_room,
            cgroup_limit,
            available: self.meminfo.as_deref().and_then(read).and_then(|s| mem_available(&s)),
            stall_us: self.psi.as_deref().and_then(read).and_then(|s| psi_some_total(&s)),
            psi_fired: false,
            swap_out_pages: self.vmstat.as_deref().and_then(read).and_then(|s| count_field(&s, "pswpout")),
            limit_hits,
            oom_kills,
            level_fired: false,
        }
    }
}

/// The memory cgroup directory of a process from its `/proc/PID/cgroup`
/// and `/proc/PID/mountinfo`: a v1 hierarchy with the `memory` controller,
/// else the v2 one (unified) where it has `memory.max`; `(dir, is_v2)`.
pub fn memory_cgroup(cgroup: &str, mountinfo: &str) -> Option<(PathBuf, bool)> {
    // (hierarchy path, v2)
    let mut v1 = None;
    let mut v2 = None;
    for line in cgroup.lines() {
        let mut it = line.splitn(3, ':');
        let (_, ctrl, path) = (it.next()?, it.next()?, it.next()?);
        if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        } else if ctrl.is_empty() {
            v2 = Some(path.to_string());
        }
    }
    // mountinfo: ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS
    for line in mountinfo.lines() {
        let (left, right) = line.split_once(" - ")?;
        let f: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if f.len() < 5 || r.len() < 3 {
            continue;
        }
        let (root, mount) = (f[3], f[4]);
        let dir = |path: &str| -> PathBuf {
            let rel = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
            Path::new(mount).join(rel)
        };
        if r[0] == "cgroup" && r[2].split(',').any(|o| o == "memory") {
            if let Some(p) = &v1 {
                return Some((dir(p), false));
            }
        }
        if r[0] == "cgroup2" && v1.is_none() {
            if let Some(p) = &v2 {
                let d = dir(p);
                if d.join("memory.max").exists() {
                    return Some((d, true));
                }
            }
        }
    }
    None
}

/// A `key value` field of a `memory.stat` (bytes), or 0.
fn stat_field(stat: &str, key: &str) -> u64 {
    stat.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Cgroup v2 room (see [`Reading::cgroup_room`]): `max` and `high` are a
/// byte count or `max`; `stat` gives `inactive_file`.
pub fn cgroup_room_v2(max: &str, high: Option<&str>, current: &str, stat: &str) -> Option<i64> {
    let lim = cgroup_limit_of(max, high)?;
    let used = current.trim().parse::<u64>().ok()?.saturating_sub(stat_field(stat, "inactive_file"));
    Some(lim as i64 - used as i64)
}

/// A cgroup's memory limit, bytes: the lower of `max` and `high` (v2
/// `memory.max` and `memory.high`, v1 `memory.limit_in_bytes` and none),
/// each a byte count or `max`.
pub fn cgroup_limit_of(max: &str, high: Option<&str>) -> Option<u64> {
    let limit = |s: &str| -> Option<u64> { s.trim().parse().ok() };
    [limit(max), high.and_then(limit)].into_iter().flatten().min()
}

/// Cgroup v1 room (see [`Reading::cgroup_room`]); a limit of 2^62 or more
/// means none. `stat` gives `total_inactive_file` (the hierarchy's).
pub fn cgroup_room_v1(limit: &str, usage: &str, stat: &str) -> Option<i64> {
    let lim: u64 = limit.trim().parse().ok()?;
    if lim >= 1 << 62 {
        return None;
    }
    let inactive = match stat_field(stat, "total_inactive_file") {
        0 => stat_field(stat, "inactive_file"),
        n => n,
    };
    let used = usage.trim().parse::<u64>().ok()?.saturating_sub(inactive);
    Some(lim as i64 - used as i64)
}

/// A `name value` line's value in a `/proc/vmstat`, or a cgroup's
/// `memory.events` (v2) or `memory.oom_control` (v1).
pub fn count_field(vmstat: &str, name: &str) -> Option<u64> {
    vmstat.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Whether a `/proc/swaps` lists a zram device: the kernel then compresses
/// anonymous memory into RAM instead of failing, so free memory can look
/// fine while it swaps (docs/android.md §3d).
pub fn swaps_have_zram(swaps: &str) -> bool {
    swaps.lines().skip(1).any(|l| l.split_whitespace().next().is_some_and(|dev| dev.contains("zram")))
}

/// `MemAvailable` of a `/proc/meminfo`, bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let l = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The `some` line's `total=` (microseconds stalled) of a PSI file.
pub fn psi_some_total(psi: &str) -> Option<u64> {
    let l = psi.lines().find(|l| l.starts_with("some "))?;
    l.split_whitespace().find_map(|w| w.strip_prefix("total=")).and_then(|v| v.parse().ok())
}

/// The governor's decisions, from readings: pure, so that tests give it
/// readings and times.
#[derive(Debug, Clone)]
pub struct Governor {
    /// Bytes kept free below the cgroup's limit and of `MemAvailable`.
    pub reserve: u64,
    /// The most the cache may hold (its size at load, or `--memory-max`).
    pub ceiling: u64,
    /// The least it can hold.
    pub floor: u64,
    /// The whole process's memory budget (a numeric `--memory-budget`),
    /// bytes. In a memory cgroup whose limit leaves less than the reserve
    /// above it, the cgroup's reserve is that gap: the process may fill
    /// the budget it was given (down to none when the budget is the
    /// limit), and still gives back what other processes in the cgroup take.
    pub budget: Option<u64>,
    /// The least drop in room between two readings, not of the cache's
    /// own making, that counts as another process's burst
    /// ([`Self::burst_bytes`]), bytes ([`BURST_MIN`]; `u64::MAX`: none
    /// does): smaller changes are file pages moving between the inactive
    /// and active lists as clusters are read.
    pub burst_min: u64,
    last_pressure: Option<Instant>,
    last_stall: Option<u64>,
    last_swap_out: Option<u64>,
    last_limit_hits: Option<u64>,
    last_oom_kills: Option<u64>,
    /// The room (cgroup's or `MemAvailable`, the lower), what the cache
    /// held, and when, at the last reading.
    last_room: Option<(i64, u64, Instant)>,
    burst: f64,
}

impl Governor {
    /// A governor keeping `reserve` bytes free, for a cache between `floor` and `ceiling` bytes.
    pub fn new(reserve: u64, floor: u64, ceiling: u64) -> Self {
        Governor {
            reserve,
            ceiling,
            floor,
            budget: None,
            burst_min: BURST_MIN,
            last_pressure: None,
            last_stall: None,
            last_swap_out: None,
            last_limit_hits: None,
            last_oom_kills: None,
            last_room: None,
            burst: 0.0,
        }
    }

    /// The cache size to move to, given a reading at `now` and what the
    /// cache `held`; `None` to stay. Memory is short when the cgroup's
    /// room is below its reserve (the reserve, or less with a [`Self::budget`])
    /// or `MemAvailable` below the reserve (give back the shortfall and
    /// half that reserve more), or when the room is below twice its
    /// reserve and the system says it is reclaiming: PSI stalls, the v1
    /// pressure-level notifier, or the v2 group reaching `memory.high` or
    /// `memory.max` (give back a quarter of what is above the floor). The
    /// system swapping out more than [`SWAP_OUT_PAGES`] pages since the
    /// last reading (to zram, it compresses anonymous memory while free
    /// memory looks fine), or an OOM kill in the cgroup, gives back a
    /// quarter too, whatever the room. Every reserve is at least
    /// [`Self::burst_bytes`], after another process took room in a burst. With room to spare for [`CALM`] since the last shortage, take
    /// half the spare room above twice the reserve.
    pub fn decide(&mut self, r: &Reading, held: u64, now: Instant) -> Option<u64> {
        // How much a cumulative count grew since the last reading (0 at the first).
        fn grew(now: Option<u64>, last: &mut Option<u64>) -> u64 {
            match (now, std::mem::replace(last, now)) {
                (Some(n), Some(b)) => n.saturating_sub(b),
                _ => 0,
            }
        }
        let stall = grew(r.stall_us, &mut self.last_stall);
        let swapped = grew(r.swap_out_pages, &mut self.last_swap_out);
        let hits = grew(r.limit_hits, &mut self.last_limit_hits);
        let killed = grew(r.oom_kills, &mut self.last_oom_kills);
        let stalled = r.psi_fired || r.level_fired || stall > STALL_US || hits > 0;
        self.track_bursts(r, held, now);
        let margin = r.margin(self.reserve, self.budget, self.burst_bytes());
        let short = margin.is_some_and(|(m, _)| m < 0);
        let tight = margin.is_none_or(|(m, r)| m < r);
        if short || (stalled && tight) || swapped > SWAP_OUT_PAGES || killed > 0 {
            self.last_pressure = Some(now);
            let target = match margin {
                Some((m, r)) if m < 0 => held.saturating_sub(m.unsigned_abs().saturating_add((r / 2) as u64)),
                _ => held - held.saturating_sub(self.floor) / 4,
            };
            let target = target.max(self.floor);
            return (target < held).then_some(target);
        }
        let calm = self.last_pressure.is_none_or(|t| now.duration_since(t) >= CALM);
        match margin {
            Some((m, r)) if calm && held < self.ceiling && m > r => {
                Some((held + ((m - r) / 2) as u64).min(self.ceiling))
            }
            _ => None,
        }
    }

    /// The extra reserve kept for other processes' bursts, bytes: twice
    /// the largest drop in room between two readings that nflash did not
    /// cause (at least [`Self::burst_min`]), halved every 10 s. Another process
    /// that allocates 100 MiB at a time, faster than the governor polls,
    /// would otherwise outrun a smaller reserve and have the kernel
    /// OOM-kill one of the two; after its first such step the cache makes
    /// room for the next one ahead of it.
    pub fn burst_bytes(&self) -> u64 {
        2 * self.burst as u64
    }

    /// Updates the remembered burst from a reading at `now`, with the cache holding `held`.
    fn track_bursts(&mut self, r: &Reading, held: u64, now: Instant) {
        let room = [r.cgroup_room, r.available.map(|a| a.min(i64::MAX as u64) as i64)].into_iter().flatten().min();
        if let (Some(room), Some((before, held_before, at))) = (room, self.last_room) {
            // The cache's own change since then moved the room too (it
            // grew: less room; it gave back: more).
            let others = before - room - (held as i64 - held_before as i64);
            let fade = 0.5f64.powf(now.saturating_duration_since(at).as_secs_f64() / BURST_HALF_LIFE.as_secs_f64());
            self.burst *= fade;
            if others >= self.burst_min.min(i64::MAX as u64) as i64 {
                self.burst = self.burst.max(others as f64);
            }
        }
        self.last_room = room.map(|x| (x, held, now));
    }
}

/// Android's `ComponentCallbacks2.onTrimMemory` levels.
pub mod trim_level {
    /// `TRIM_MEMORY_RUNNING_MODERATE` (deprecated in API 34).
    pub const RUNNING_MODERATE: i32 = 5;
    /// `TRIM_MEMORY_RUNNING_LOW` (deprecated in API 34).
    pub const RUNNING_LOW: i32 = 10;
    /// `TRIM_MEMORY_RUNNING_CRITICAL` (deprecated in API 34).
    pub const RUNNING_CRITICAL: i32 = 15;
    /// `TRIM_MEMORY_UI_HIDDEN`: the app's UI is no longer visible.
    pub const UI_HIDDEN: i32 = 20;
    /// `TRIM_MEMORY_BACKGROUND`: the app is in the background, on the
    /// system's list of processes to kill.
    pub const BACKGROUND: i32 = 40;
}

/// The neuron-cache cap for an `onTrimMemory` `level`, for a cache
/// between `floor` and `ceiling` bytes (the same for the same level, however
/// often it comes): `BACKGROUND` and above (`MODERATE` 60, `COMPLETE` 80)
/// and `RUNNING_CRITICAL`: the floor (a process in the background is killed
/// largest first); `UI_HIDDEN` and `RUNNING_LOW`: the floor and half of
/// the rest; `RUNNING_MODERATE`: three quarters of the rest; 1-4: the
/// ceiling; 0 or below (not an Android level; the app is in the foreground
/// again): `u64::MAX`, no cap. Levels between take the next lower one's cap.
pub fn level_target(level: i32, floor: u64, ceiling: u64) -> u64 {
    use trim_level::*;
    let above = ceiling.saturating_sub(floor);
    match level {
        ..=0 => u64::MAX,
        l if l >= BACKGROUND || (RUNNING_CRITICAL..UI_HIDDEN).contains(&l) => floor,
        l if l >= RUNNING_LOW => floor + above / 2,
        l if l >= RUNNING_MODERATE => floor + above / 4 * 3,
        _ => ceiling,
    }
}

/// Applies an app's cap of `cap` bytes to `mem` (and to `watch`, whose
/// governor then never grows the cache above it): what is above it goes
/// at once; below it nothing is taken, except that lifting the cap
/// (`u64::MAX`, the app in the foreground again) grows back at once. The
/// governor grows the cache up to the cap later, when memory allows.
/// Returns what the cache holds after.
pub fn apply_cap(mem: &dyn MemoryControl, watch: Option<&Watch>, cap: u64) -> u64 {
    // The governor's decision in flight finishes first, or waits for this
    // one: it never grows the cache past a cap set between its reading
    // of the cap and its resize.
    let _turn = watch.map(|w| w.turn.lock().unwrap_or_else(|e| e.into_inner()));
    if let Some(w) = watch {
        w.set_cap(cap);
    }
    let held = mem.held_bytes();
    if cap == u64::MAX || cap < held {
        mem.resize(cap)
    } else {
        held
    }
}

/// The governor's thread: reads `signals` every [`POLL`] and resizes
/// `mem`; stops when the handle is dropped.
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The least and the most the cache held, bytes, at the polls so far;
    /// and since the last [`Watch::take_window`].
    range: Arc<Mutex<(u64, u64)>>,
    window: Arc<Mutex<(u64, u64)>>,
    /// The cache's size at load, bytes.
    ceiling: u64,
    /// The most an app lets the cache hold ([`Watch::set_cap`]), bytes.
    cap: Arc<AtomicU64>,
    /// Held by the governor from reading the cap to resizing, and by
    /// [`apply_cap`]: one of the two moves the cache at a time.
    turn: Arc<Mutex<()>>,
    signals: String,
}

impl Watch {
    /// Starts the thread (named `nflash-memory`).
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn start(signals: Signals, mut gov: Governor, mem: Arc<dyn MemoryControl>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let held = mem.held_bytes();
        let range = Arc::new(Mutex::new((held, held)));
        let window = Arc::new(Mutex::new((held, held)));
        let (s, rg, wd) = (Arc::clone(&stop), Arc::clone(&range), Arc::clone(&window));
        let trigger = signals.psi.as_deref().and_then(PsiTrigger::new);
        let level = match &signals.cgroup {
            Some((dir, false)) => PressureLevel::new(dir, PRESSURE_LEVEL),
            _ => None,
        };
        let described = signals.describe(trigger.is_some(), level.is_some());
        let ceiling = mem.ceiling_bytes();
        let cap = Arc::new(AtomicU64::new(u64::MAX));
        let cp = Arc::clone(&cap);
        let turn = Arc::new(Mutex::new(()));
        let tn = Arc::clone(&turn);
        let full = gov.ceiling;
        let thread = std::thread::Builder::new().name("nflash-memory".into()).spawn(move || {
            let mut fired = (false, false);
            while !s.load(Ordering::Relaxed) {
                let (psi_fired, level_fired) = std::mem::take(&mut fired);
                let r = Reading { psi_fired, level_fired, ..signals.read() };
                let turn = tn.lock().unwrap_or_else(|e| e.into_inner());
                gov.ceiling = full.min(cp.load(Ordering::Relaxed));
                let mut held = mem.held_bytes();
                if let Some(target) = gov.decide(&r, held, Instant::now()) {
                    held = mem.resize(target);
                }
                drop(turn);
                for r in [&rg, &wd] {
                    let mut g = r.lock().unwrap_or_else(|e| e.into_inner());
                    *g = (g.0.min(held), g.1.max(held));
                }
                // The next poll, or sooner when a PSI trigger or pressure-level notifier fires.
                fired = wait_for_signal(trigger.as_ref(), level.as_ref(), POLL);
            }
        })?;
        Ok(Watch { stop, thread: Some(thread), range, window, ceiling, cap, turn, signals: described })
    }

    /// Lets the cache grow back to at most `bytes` (an app's trim, which
    /// the governor must not undo); `u64::MAX` lifts the cap.
    pub fn set_cap(&self, bytes: u64) {
        self.cap.store(bytes, Ordering::Relaxed);
    }

    /// An app's cap on the cache, bytes; `None` when there is none.
    pub fn cap(&self) -> Option<u64> {
        Some(self.cap.load(Ordering::Relaxed)).filter(|&c| c != u64::MAX)
    }

    /// The least and the most the cache held so far, bytes.
    pub fn held_range(&self) -> (u64, u64) {
        *self.range.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The least and the most the cache held, bytes, at the polls since
    /// the last call and now (`held`, what it holds now: for one request of
    /// a server, called at its start and its end); starts the next window
    /// at `held`.
    pub fn take_window(&self, held: u64) -> (u64, u64) {
        let mut g = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let (lo, hi) = std::mem::replace(&mut *g, (held, held));
        (lo.min(held), hi.max(held))
    }

    /// The cache's size at load, bytes.
    pub fn ceiling(&self) -> u64 {
        self.ceiling
    }

    /// The signals followed ([`Signals::describe`]).
    pub fn signals(&self) -> &str {
        &self.signals
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_memory_cgroup_is_found_in_v1_and_v2_layouts() {
        // This machine's kind: cgroup v1 with the memory controller, v2 beside it.
        let cg = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        let mi = "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n\
                  31 25 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(memory_cgroup(cg, mi), Some((PathBuf::from("/sys/fs/cgroup/memory/process_api/abc"), false)));
        // A container whose mount root is its own group.
        let mi = "30 25 0:26 /process_api/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(memory_cgroup(cg, mi), Some((PathBuf::from("/sys/fs/cgroup/memory"), false)));
        // No memory controller anywhere.
        assert_eq!(memory_cgroup("1:cpu:/\n", "30 25 0:26 / /x rw - cgroup cgroup rw,cpu\n"), None);
    }

    #[test]
    fn cgroup_room_counts_inactive_file_pages_as_free() {
        let stat = "cache 10\ninactive_file 20971520\nactive_file 1\n";
        assert_eq!(cgroup_room_v2("251658240\n", Some("max\n"), "220200960\n", stat), Some(50 * MIB as i64));
        assert_eq!(
            cgroup_room_v2("max\n", Some("104857600"), "115343360", "inactive_file 0\n"),
            Some(-10 * MIB as i64)
        );
        assert_eq!(cgroup_room_v2("max\n", Some("max\n"), "1", ""), None);
        let stat1 = "inactive_file 5\ntotal_inactive_file 10485760\n";
        assert_eq!(cgroup_room_v1("251658240\n", "251658240\n", stat1), Some(10 * MIB as i64));
        assert_eq!(cgroup_room_v1("9223372036854771712\n", "1", stat1), None);
        assert_eq!(cgroup_room_v1("garbage", "1", stat1), None);
    }

    #[test]
    fn meminfo_and_psi_are_parsed() {
        let mi = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(mi), Some(2 * MIB));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let psi = "some avg10=0.00 avg60=0.00 avg300=0.00 total=557206\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=228433\n";
        assert_eq!(psi_some_total(psi), Some(557206));
        assert_eq!(psi_some_total("full total=3\n"), None);
    }

    #[test]
    fn the_governor_gives_back_at_once_and_grows_back_only_after_calm() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = Governor::new(32 * MIB, 100 * MIB, 200 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        let cg = |room_mib: i64| Reading { cgroup_room: Some(room_mib * MIB as i64), ..Default::default() };
        // A reserve of more than there is: always short, down to the floor.
        let mut huge = Governor::new(u64::MAX, 100 * MIB, 200 * MIB);
        huge.burst_min = u64::MAX; // the other rules alone
        assert_eq!(huge.decide(&cg(1 << 20), 200 * MIB, at(0)), Some(100 * MIB));
        // Room enough: stay.
        assert_eq!(g.decide(&cg(64), 200 * MIB, at(0)), None);
        // 12 MiB short of the reserve: give that back and 16 MiB more.
        assert_eq!(g.decide(&cg(20), 200 * MIB, at(50)), Some(172 * MIB));
        // Far over: down to the floor, not below.
        assert_eq!(g.decide(&cg(-500), 172 * MIB, at(100)), Some(100 * MIB));
        assert_eq!(g.decide(&cg(-500), 100 * MIB, at(150)), None, "already at the floor");
        // The squeeze is gone, but not for long enough.
        assert_eq!(g.decide(&cg(300), 100 * MIB, at(1000)), None);
        // After CALM: half the room above twice the reserve, up to the ceiling.
        assert_eq!(g.decide(&cg(104), 100 * MIB, at(2200)), Some(120 * MIB));
        assert_eq!(g.decide(&cg(1000), 120 * MIB, at(2250)), Some(200 * MIB));
        // MemAvailable counts too, the lower of the two.
        let both = Reading { cgroup_room: Some(1 << 40), available: Some(16 * MIB), ..Default::default() };
        assert_eq!(g.decide(&both, 200 * MIB, at(2300)), Some(168 * MIB));
    }

    /// bench-offload runs with the budget at the cgroup's limit: the cache
    /// fills the budget, and gives back only what others take.
    #[test]
    fn a_budget_near_the_cgroup_limit_keeps_only_the_gap_as_reserve() {
        let t0 = Instant::now();
        let cg = |room_mib: i64, limit_mib: u64| Reading {
            cgroup_room: Some(room_mib * MIB as i64),
            cgroup_limit: Some(limit_mib * MIB),
            ..Default::default()
        };
        let mut g = Governor::new(32 * MIB, 10 * MIB, 60 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        g.budget = Some(113 * MIB);
        // Alone at its budget in a 113 MiB group, 12 MiB of room: stay.
        assert_eq!(g.decide(&cg(12, 113), 60 * MIB, t0), None);
        // Someone else took 20 MiB of it: give back the shortfall.
        assert_eq!(g.decide(&cg(-8, 113), 60 * MIB, t0), Some(52 * MIB));
        // 10 MiB above the budget: that gap is the reserve (and half again is given back).
        g.budget = Some(103 * MIB);
        assert_eq!(g.decide(&cg(12, 113), 60 * MIB, t0), None);
        assert_eq!(g.decide(&cg(4, 113), 60 * MIB, t0), Some(49 * MIB));
        // No budget, or one far below the limit: the whole reserve.
        for b in [None, Some(10 * MIB)] {
            g.budget = b;
            assert_eq!(g.decide(&cg(12, 113), 60 * MIB, t0), Some(24 * MIB));
        }
    }

    /// Where the kernel permits a trigger (root here, or a 2 s window), a
    /// wait returns by its timeout; a fired trigger counts as a stall.
    #[test]
    fn a_psi_trigger_waits_and_a_fired_one_counts_as_a_stall() {
        if let Some(t) = PsiTrigger::new(Path::new("/proc/pressure/memory")) {
            let t0 = Instant::now();
            t.wait(Duration::from_millis(30));
            assert!(t0.elapsed() < Duration::from_secs(1));
        }
        assert!(PsiTrigger::new(Path::new("/nonexistent/pressure/memory")).is_none());
        let mut g = Governor::new(32 * MIB, 100 * MIB, 200 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        let r = |fired| Reading { available: Some(40 * MIB), psi_fired: fired, ..Default::default() };
        let t0 = Instant::now();
        assert_eq!(g.decide(&r(false), 200 * MIB, t0), None);
        assert_eq!(g.decide(&r(true), 200 * MIB, t0), Some(175 * MIB));
    }

    /// zram: swap-outs give memory back even with room to spare; a swap
    /// area on disk is not zram.
    #[test]
    fn swap_outs_count_as_pressure_and_zram_is_recognised() {
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/zram0 partition 4194300 1200 100\n";
        assert!(swaps_have_zram(swaps));
        assert!(!swaps_have_zram("Filename\tType\tSize\tUsed\tPriority\n/swapfile file 1048572 0 -2\n"));
        assert!(!swaps_have_zram("Filename\tType\tSize\tUsed\tPriority\n"));
        let vmstat = "pswpin 12\npswpout 345\npswpout_zero 9\n";
        assert_eq!(count_field(vmstat, "pswpout"), Some(345));
        assert_eq!(count_field(vmstat, "pswp"), None);
        let t0 = Instant::now();
        let mut g = Governor::new(32 * MIB, 100 * MIB, 200 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        let r = |pages| Reading { available: Some(4096 * MIB), swap_out_pages: Some(pages), ..Default::default() };
        assert_eq!(g.decide(&r(1000), 200 * MIB, t0), None, "the first reading sets the baseline");
        assert_eq!(g.decide(&r(1000 + SWAP_OUT_PAGES), 200 * MIB, t0), None, "a trickle is not pressure");
        assert_eq!(g.decide(&r(5000), 200 * MIB, t0), Some(175 * MIB), "swapping with plenty available");
    }

    /// A memory cgroup directory of `files` (`name`, text), v2 or v1, and
    /// the signals read from it alone.
    fn fake_cgroup(v2: bool, files: &[(&str, &str)]) -> (tempfile::TempDir, Signals) {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let signals = Signals { cgroup: Some((dir.path().to_path_buf(), v2)), ..Default::default() };
        (dir, signals)
    }

    /// Both cgroup versions' files, read as the governor's thread reads
    /// them (machines here have v1; v2 from files laid out as the kernel's).
    #[test]
    fn cgroup_files_of_both_versions_are_read_into_a_reading() {
        let (dir, v2) = fake_cgroup(
            true,
            &[
                ("memory.max", "251658240\n"),
                ("memory.high", "max\n"),
                ("memory.current", "220200960\n"),
                ("memory.stat", "anon 1\ninactive_file 20971520\n"),
                ("memory.events", "low 0\nhigh 3\nmax 4\noom 1\noom_kill 1\n"),
            ],
        );
        let w = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        let r = v2.read();
        assert_eq!((r.cgroup_room, r.cgroup_limit), (Some(50 * MIB as i64), Some(240 * MIB)));
        assert_eq!((r.limit_hits, r.oom_kills), (Some(7), Some(1)));
        assert!(v2.describe(false, false).contains("cgroup v2") && v2.describe(false, false).contains("memory.events"));
        // memory.high below memory.max is the limit.
        w("memory.high", "230686720\n");
        assert_eq!(v2.read().cgroup_room, Some(30 * MIB as i64));
        // No memory.events (an old kernel): the rest is still read.
        std::fs::remove_file(dir.path().join("memory.events")).unwrap();
        assert_eq!((v2.read().limit_hits, v2.read().oom_kills, v2.read().cgroup_limit), (None, None, Some(220 * MIB)));

        let (dir, v1) = fake_cgroup(
            false,
            &[
                ("memory.limit_in_bytes", "251658240\n"),
                ("memory.usage_in_bytes", "241172480\n"),
                ("memory.stat", "total_inactive_file 0\n"),
                ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
            ],
        );
        let w = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        let r = v1.read();
        assert_eq!((r.cgroup_room, r.limit_hits, r.oom_kills), (Some(10 * MIB as i64), None, Some(2)));
        assert!(v1.describe(false, true).contains("memory.oom_control, memory.pressure_level"));
        // Garbage in a file reads as that signal missing, not as a number.
        w("memory.usage_in_bytes", "12ab\n");
        assert_eq!(v1.read().cgroup_room, None);
    }

    /// The group reaching its limits, or the v1 notifier, counts as a PSI
    /// stall does (only while room is tight); an OOM kill in the group
    /// gives back whatever the room.
    #[test]
    fn limit_hits_and_notifiers_shrink_when_tight_and_oom_kills_always() {
        let t0 = Instant::now();
        let mut g = Governor::new(32 * MIB, 100 * MIB, 200 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        let r = |room: u64, hits: u64, kills: u64| Reading {
            cgroup_room: Some((room * MIB) as i64),
            limit_hits: Some(hits),
            oom_kills: Some(kills),
            ..Default::default()
        };
        assert_eq!(g.decide(&r(40, 5, 0), 200 * MIB, t0), None, "the first reading sets the baseline");
        assert_eq!(g.decide(&r(40, 5, 0), 200 * MIB, t0), None, "no new hit");
        assert_eq!(g.decide(&r(40, 6, 0), 200 * MIB, t0), Some(175 * MIB), "a hit with room tight");
        assert_eq!(g.decide(&r(400, 9, 0), 175 * MIB, t0), None, "hits with room to spare");
        assert_eq!(g.decide(&r(400, 9, 1), 175 * MIB, t0), Some(156 * MIB + 256 * 1024), "an OOM kill");
        let notified = Reading { level_fired: true, ..r(40, 9, 1) };
        assert_eq!(g.decide(&notified, 200 * MIB, t0), Some(175 * MIB));
        assert_eq!(g.decide(&Reading { level_fired: true, ..r(400, 9, 1) }, 200 * MIB, t0), None);
    }

    /// A burst of another process's memory raises the reserve for the
    /// next one; the cache's own growth and file-page noise do not; the
    /// raise fades.
    #[test]
    fn a_burst_raises_the_reserve_until_it_fades() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let cg = |room_mib: i64| Reading { cgroup_room: Some(room_mib * MIB as i64), ..Default::default() };
        let mut g = Governor::new(32 * MIB, 100 * MIB, 800 * MIB);
        assert_eq!(g.decide(&cg(100), 800 * MIB, at(0)), None);
        // Someone took 100 MiB within a poll: keep 200 MiB free, not 32.
        assert_eq!(g.decide(&cg(0), 800 * MIB, at(50)), Some(500 * MIB));
        assert_eq!(g.burst_bytes(), 200 * MIB);
        // What the cache gave back came back as room: no new burst, and
        // the room is above the raised reserve.
        assert_eq!(g.decide(&cg(300), 500 * MIB, at(100)), None);
        // Halved 10 s later; the cache's own growth is no burst.
        g.decide(&cg(200), 600 * MIB, at(10_100));
        assert!(g.burst_bytes().abs_diff(100 * MIB) < MIB, "{}", g.burst_bytes());

        // Noise below BURST_MIN is no burst: the 32 MiB reserve alone.
        let mut g = Governor::new(32 * MIB, 100 * MIB, 800 * MIB);
        assert_eq!(g.decide(&cg(60), 800 * MIB, at(0)), None);
        assert_eq!(g.decide(&cg(50), 800 * MIB, at(50)), None);
        assert_eq!(g.burst_bytes(), 0);
        // With the budget at the cgroup's limit (no reserve in the group)
        // a burst is still kept free.
        let lim = |room_mib: i64| Reading { cgroup_limit: Some(500 * MIB), ..cg(room_mib) };
        let mut g = Governor::new(32 * MIB, 100 * MIB, 400 * MIB);
        g.budget = Some(500 * MIB);
        assert_eq!(g.decide(&lim(10), 400 * MIB, at(0)), None);
        // 50 MiB taken: 100 MiB kept free, and half that more given back.
        assert_eq!(g.decide(&lim(-40), 400 * MIB, at(50)), Some(210 * MIB));
    }

    /// A cache whose `held_bytes`, asked by the governor's thread, takes
    /// 30 ms and says so in `inside` (a governor's reading in flight when
    /// an app trims).
    struct SlowCache {
        held: AtomicU64,
        inside: AtomicBool,
    }

    impl MemoryControl for SlowCache {
        fn floor_bytes(&self) -> u64 {
            100 * MIB
        }
        fn ceiling_bytes(&self) -> u64 {
            400 * MIB
        }
        fn held_bytes(&self) -> u64 {
            if std::thread::current().name() == Some("nflash-memory") {
                self.inside.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(30));
            }
            self.held.load(Ordering::SeqCst)
        }
        fn resize(&self, bytes: u64) -> u64 {
            let b = bytes.clamp(100 * MIB, 400 * MIB);
            self.held.store(b, Ordering::SeqCst);
            b
        }
    }

    /// The serve admin test's failure under load: the governor read the
    /// cap, an app's trim set a lower one and shrank, and the governor,
    /// with room to spare, then grew the cache back past it. A trim that
    /// comes while the governor is deciding now waits for it, and its cap
    /// holds.
    #[test]
    fn an_apps_cap_holds_against_a_governor_that_would_grow() {
        let (_dir, signals) = fake_cgroup(
            false,
            &[
                ("memory.limit_in_bytes", "10737418240\n"),
                ("memory.usage_in_bytes", "0\n"),
                ("memory.stat", "total_inactive_file 0\n"),
            ],
        );
        let cache = Arc::new(SlowCache { held: AtomicU64::new(400 * MIB), inside: AtomicBool::new(false) });
        let mem: Arc<dyn MemoryControl> = cache.clone();
        let watch = Watch::start(signals, Governor::new(32 * MIB, 100 * MIB, 400 * MIB), Arc::clone(&mem)).unwrap();
        for round in 0..3 {
            assert_eq!(apply_cap(mem.as_ref(), Some(&watch), u64::MAX), 400 * MIB);
            // Trim while the governor reads what the cache holds.
            cache.inside.store(false, Ordering::SeqCst);
            let t0 = Instant::now();
            while !cache.inside.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_millis(1));
            }
            apply_cap(mem.as_ref(), Some(&watch), 100 * MIB);
            std::thread::sleep(POLL * 3);
            assert_eq!(cache.held.load(Ordering::SeqCst), 100 * MIB, "round {round}: the governor grew past the cap");
        }
    }

    #[test]
    fn trim_levels_map_to_sizes() {
        let t = |l| level_target(l, 100, 500);
        assert_eq!([t(80), t(60), t(40), t(15), t(17)], [100; 5]);
        assert_eq!([t(20), t(10), t(12), t(39)], [300; 4]);
        assert_eq!([t(5), t(1), t(0), t(-3)], [400, 500, u64::MAX, u64::MAX]);
    }

    #[test]
    fn psi_stalls_shrink_only_when_room_is_tight() {
        let t0 = Instant::now();
        let mut g = Governor::new(32 * MIB, 100 * MIB, 200 * MIB);
        g.burst_min = u64::MAX; // the other rules alone
        let r =
            |stall: u64, room: Option<u64>| Reading { available: room, stall_us: Some(stall), ..Default::default() };
        assert_eq!(g.decide(&r(1000, Some(40 * MIB)), 200 * MIB, t0), None, "the first reading sets the baseline");
        // 10 ms stalled within a poll, 40 MiB available (below twice the reserve): a quarter above the floor goes.
        assert_eq!(g.decide(&r(11_000, Some(40 * MIB)), 200 * MIB, t0), Some(175 * MIB));
        // Stalls with plenty available (someone else's cgroup): stay.
        assert_eq!(g.decide(&r(30_000, Some(4096 * MIB)), 175 * MIB, t0 + CALM / 2), None);
        // No stall since: no shrink; not calm yet: no grow.
        assert_eq!(g.decide(&r(30_000, Some(4096 * MIB)), 175 * MIB, t0 + CALM / 2), None);
        assert!(g.decide(&r(30_000, Some(4096 * MIB)), 175 * MIB, t0 + CALM * 2).is_some());
    }
}
