//! Memory pressure (issue 46): in a memory cgroup, another process grows
//! while nflash decodes; nflash gives memory back instead of being
//! OOM-killed, keeps its tokens, and grows back when the balloon leaves.
//! Needs root and a memory cgroup (v1 or v2); skipped with a message
//! elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nflash_tests::{bin, repo_root};

/// A memory cgroup made for one test, removed on drop.
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// A new group limited to `limit` bytes: cgroup v1's memory hierarchy,
    /// else v2 where its root enables the memory controller; `None` if
    /// neither can be made (not root, no controller).
    fn new(name: &str, limit: u64) -> Option<Self> {
        let candidates = [
            (PathBuf::from("/sys/fs/cgroup/memory"), false),
            (PathBuf::from("/sys/fs/cgroup"), true),
            (PathBuf::from("/sys/fs/cgroup/unified"), true),
        ];
        for (root, v2) in candidates {
            let ok = if v2 {
                std::fs::read_to_string(root.join("cgroup.subtree_control")).is_ok_and(|s| s.contains("memory"))
            } else {
                root.join("memory.limit_in_bytes").exists()
            };
            if !ok {
                continue;
            }
            let dir = root.join(name);
            let _ = std::fs::remove_dir(&dir);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let g = Cgroup { dir, v2 };
            let set = if v2 { g.write("memory.max", limit) } else { g.write("memory.limit_in_bytes", limit) };
            if set.is_ok() {
                if v2 {
                    let _ = g.write("memory.swap.max", 0);
                } else {
                    let _ = g.write("memory.swappiness", 0);
                }
                return Some(g);
            }
        }
        None
    }

    fn write(&self, file: &str, v: u64) -> std::io::Result<()> {
        std::fs::write(self.dir.join(file), v.to_string())
    }

    /// Bytes the group uses now.
    fn usage(&self) -> u64 {
        let f = if self.v2 { "memory.current" } else { "memory.usage_in_bytes" };
        std::fs::read_to_string(self.dir.join(f)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// OOM kills in the group so far.
    fn oom_kills(&self) -> u64 {
        let f = if self.v2 { "memory.events" } else { "memory.oom_control" };
        let s = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
        s.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    }

    /// `sh -c 'echo $$ > procs; exec program args'`: the program starts in the group.
    fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("echo $$ > '{}' && exec \"$0\" \"$@\"", self.dir.join("cgroup.procs").display()))
            .arg(program)
            .args(args);
        c
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

fn stats(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The demo's SmolLM2 q8_0 pack and a memory cgroup `name` limited to
/// `limit` bytes; `None`, with a message saying why the test is skipped,
/// without the pack (made by make test) or where no group can be made.
fn pack_and_group(name: &str, limit: u64) -> Option<(PathBuf, Cgroup)> {
    let pack = repo_root().join("models/smollm2-q8_0.nflash");
    if !pack.exists() {
        eprintln!("skipping: {} is made by make test (make demo)", pack.display());
        return None;
    }
    let Some(g) = Cgroup::new(name, limit) else {
        eprintln!("skipping: no memory cgroup can be made here (needs root and a memory controller)");
        return None;
    };
    Some((pack, g))
}

#[test]
fn a_balloon_in_the_cgroup_squeezes_nflash_to_its_floor_without_an_oom_kill() {
    let Some((pack, probe)) = pack_and_group("nflash-test-probe", 1 << 30) else { return };
    drop(probe);
    let dir = tempfile::tempdir().unwrap();
    let m = pack.to_str().unwrap();
    let args = |json: &Path| -> Vec<String> {
        [
            "run",
            "--model",
            m,
            "--prompt",
            "Tell me a long story about a lighthouse.",
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-tokens",
            "1200",
            "--ctx",
            "1300",
            "--threads",
            "2",
            "--memory-budget",
            "200MiB",
            "--stats-json",
            json.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // Unpressured, outside any limit: the tokens, the peak RSS and the floor.
    let quiet = dir.path().join("quiet.json");
    let a = args(&quiet);
    let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    let o = Command::new(bin("nflash")).args(&a).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = o.stdout;
    let q = stats(&quiet);
    let rss = q["peak_rss_bytes"].as_u64().unwrap();
    let (floor, ceiling) = (q["cache_floor_bytes"].as_u64().unwrap(), q["cache_ceiling_bytes"].as_u64().unwrap());
    assert!(ceiling > floor + (32 << 20), "floor {floor}, ceiling {ceiling}: too little to squeeze");
    // The limit leaves 48 MiB beside nflash at full size; the balloon takes
    // that and all but 24 MiB of what nflash can give back: an nflash that
    // kept its size would overflow the limit by far more than its file
    // pages, which the kernel could take, and be OOM-killed.
    let limit = rss + (48 << 20);
    let balloon_mib = (48 + (ceiling - floor) / (1 << 20) - 24) / 10 * 10;
    let g = Cgroup::new("nflash-test-balloon", limit).expect("the probe group could be made");
    let loud = dir.path().join("loud.json");
    let a = args(&loud);
    let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    let nf = g.command(&bin("nflash"), &a).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // The balloon starts once nflash is loaded (its usage near the quiet run's peak).
    let t0 = std::time::Instant::now();
    while g.usage() + (24 << 20) < rss && t0.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let steps = (balloon_mib / 10).to_string();
    let b =
        g.command(&bin("nflash-balloon"), &["--step", "10", "--steps", &steps, "--hold-ms", "2000"]).output().unwrap();
    let o = nf.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        g.oom_kills(),
        0,
        "the kernel OOM-killed in the group (nflash: {:?}; balloon: {:?})",
        o.status,
        b.status
    );
    assert!(o.status.success(), "nflash under the balloon: {:?}\n{err}", o.status);
    assert!(b.status.success(), "the balloon: {:?}", b.status);
    assert!(o.stdout == want, "the squeezed run's text differs from the quiet run's");
    let s = stats(&loud);
    // The group's own signals are followed beside its room.
    let followed = s["memory_signals"].as_str().unwrap_or_default();
    let want_signal = if g.v2 { "memory.events" } else { "memory.pressure_level" };
    assert!(followed.contains(want_signal), "{want_signal} not among the signals followed: {followed}");
    let (lo, hi) = (s["budget_min_bytes"].as_u64().unwrap(), s["budget_max_bytes"].as_u64().unwrap());
    assert!(s["budget_shrinks"].as_u64().unwrap() >= 1 && s["bytes_returned"].as_u64().unwrap() > 0, "{s}");
    assert!(hi - lo >= (balloon_mib << 20) / 2, "the budget moved only {lo}..{hi} under a {balloon_mib} MiB balloon");
    assert!(s["budget_grows"].as_u64().unwrap() >= 1, "nflash did not grow back after the balloon left: {s}");
    eprintln!(
        "balloon {balloon_mib} MiB in a {} MiB group: budget {}..{} MiB, {} shrinks, {} grows, decode {:.1} tok/s (unpressured {:.1})",
        limit >> 20,
        lo >> 20,
        hi >> 20,
        s["budget_shrinks"],
        s["budget_grows"],
        s["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
        q["decode_tokens_per_s"].as_f64().unwrap_or(0.0)
    );
}

/// bench-offload's setting: the budget is the cgroup's limit. nflash uses
/// its budget whole (the reserve inside the group is only what the limit
/// leaves above the budget), and `--memory-budget auto` in the same group
/// starts within the room less the reserve instead of at the whole model.
#[test]
fn a_budget_at_the_cgroup_limit_is_used_whole_and_auto_starts_within_the_room() {
    let limit: u64 = 160 << 20;
    let Some((pack, g)) = pack_and_group("nflash-test-budget", limit) else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = pack.to_str().unwrap();
    let run = |budget: &str, json: &Path, group: Option<&Cgroup>| {
        let a = [
            "run",
            "--model",
            m,
            "--prompt",
            "Tell me a story about a lighthouse.",
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-tokens",
            "150",
            "--ctx",
            "512",
            "--threads",
            "2",
            "--memory-budget",
            budget,
            "--stats-json",
            json.to_str().unwrap(),
        ];
        let o = match group {
            Some(g) => g.command(&bin("nflash"), &a).output().unwrap(),
            None => Command::new(bin("nflash")).args(a).output().unwrap(),
        };
        assert!(o.status.success(), "--memory-budget {budget}: {:?}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
        (o.stdout, stats(json), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (want, _, _) = run("160MiB", &dir.path().join("free.json"), None);
    let (text, s, err) = run("160MiB", &dir.path().join("limit.json"), Some(&g));
    assert_eq!(g.oom_kills(), 0);
    assert!(text == want, "the text at the limit differs from the run without one");
    let ceiling = s["cache_ceiling_bytes"].as_u64().unwrap();
    assert_eq!(s["budget_shrinks"], 0, "a budget at the cgroup's limit shrank alone in its group: {s}\n{err}");
    assert_eq!(s["budget_min_bytes"], s["memory_budget_bytes"], "{s}");
    assert_eq!(s["cache_held_bytes"].as_u64(), Some(ceiling), "{s}");
    let (text, s, err) = run("auto", &dir.path().join("auto.json"), Some(&g));
    assert_eq!(g.oom_kills(), 0);
    assert!(text == want, "the text with --memory-budget auto differs");
    assert!(err.contains("the neuron cache starts at"), "{err}");
    let (budget, max) = (s["memory_budget_bytes"].as_u64().unwrap(), s["budget_max_bytes"].as_u64().unwrap());
    let peak = s["peak_rss_bytes"].as_u64().unwrap();
    eprintln!(
        "auto in a {} MiB group: ceiling {} MiB, held up to {} MiB in the plan's terms, peak RSS {} MiB\n{err}",
        limit >> 20,
        budget >> 20,
        max >> 20,
        peak >> 20
    );
    assert!(budget > limit, "auto's ceiling {budget} is the whole model");
    assert!(max < budget, "auto in a {} MiB group went up to its ceiling", limit >> 20);
    assert!(peak + (24 << 20) <= limit, "auto in a {} MiB group peaked at {peak} bytes", limit >> 20);
}

/// A memory cgroup too small for the pack's resident tensors: nflash
/// refuses before loading, with both figures, instead of being OOM-killed
/// while it loads (with a budget, with `auto`, with none).
#[test]
fn a_cgroup_too_small_to_load_the_pack_is_refused_before_loading() {
    let Some((pack, g)) = pack_and_group("nflash-test-small", 40 << 20) else { return };
    let m = pack.to_str().unwrap();
    for budget in [&["--memory-budget", "auto"][..], &["--memory-budget", "200MiB"], &[]] {
        let a = [&["run", "--model", m, "--prompt", "Hi", "--max-tokens", "4", "--ctx", "128"][..], budget].concat();
        let o = g.command(&bin("nflash"), &a).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(g.oom_kills(), 0, "{budget:?}: OOM-killed while loading: {:?}\n{err}", o.status);
        assert_eq!(o.status.code(), Some(1), "{budget:?}: {:?}\n{err}", o.status);
        assert!(err.contains("of memory is free for this process") && err.contains("resident tensors"), "{err}");
    }
}

/// The cgroup v1 `memory.pressure_level` notifier the governor listens to
/// (`nflash_runtime::pressure::PressureLevel`) is registered and fires:
/// a 96 MiB file read through the page cache by a process in a 32 MiB
/// group makes the kernel reclaim there (`low`, the level that every
/// reclaim reaches; the governor listens for `medium`).
#[test]
fn a_v1_pressure_level_notifier_fires_when_the_group_reclaims() {
    use nflash_runtime::pressure::PressureLevel;
    let Some(g) = Cgroup::new("nflash-test-level", 32 << 20) else {
        eprintln!("skipping: no memory cgroup can be made here (needs root and a memory controller)");
        return;
    };
    if g.v2 {
        eprintln!("skipping: cgroup v2 has no memory.pressure_level (memory.events is read instead)");
        return;
    }
    let level = PressureLevel::new(&g.dir, "low").expect("a notifier on a v1 group, as root");
    assert!(!level.take(), "nothing reclaimed yet");
    // Written from outside the group and past the page cache, on disk (not
    // tmpfs): read in the group, its pages are charged there, clean, and
    // the kernel drops them to make room.
    let dir = tempfile::tempdir_in(repo_root().join("target")).unwrap();
    let file = dir.path().join("fill");
    let of = format!("of={}", file.display());
    let st = Command::new("dd")
        .args(["if=/dev/zero", &of, "bs=1M", "count=96", "oflag=direct"])
        .stderr(Stdio::null())
        .status();
    assert!(st.unwrap().success(), "dd writing {}", file.display());
    let st = g.command(Path::new("cat"), &[file.to_str().unwrap()]).stdout(Stdio::null()).status();
    assert!(st.unwrap().success(), "cat in the group");
    assert!(level.wait(Duration::from_secs(5)), "the group reclaimed 64 MiB or more without a notification");
    while level.wait(Duration::from_millis(200)) {}
    assert!(!level.take(), "a notification is taken once");
    assert!(PressureLevel::new(&dir.path().join("no-such-group"), "low").is_none());
}
