//! `scripts/android.sh` against a stand-in `adb` first on PATH: it records
//! every call, serves the phone's files from a directory, and runs `adb
//! shell` commands on this machine with `/data/local/tmp` mapped into that
//! directory. The pushed binary is this machine's `nflash` (`NFLASH_BIN`),
//! so push, run and probe are exercised end to end.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use nflash_format::DeviceProfile;
use nflash_tests::{bin, convert, repo_root, run, write_tiny_checkpoint, TinySpec};

const FAKE_ADB: &str = r#"#!/usr/bin/env bash
# A stand-in adb: one line per call in $ADB_LOG (arguments NUL-separated
# would be exact; tab-separated is enough here), files under $FAKE_PHONE.
( IFS=$'\t'; printf '%s\n' "$*" ) >> "$ADB_LOG"
map() { printf '%s' "${1//\/data\/local\/tmp/$FAKE_PHONE/data/local/tmp}"; }
case "$1" in
get-state)
    case "${FAKE_STATE:-device}" in
    device) echo device ;;
    unauthorized) echo "error: device unauthorized." >&2; exit 1 ;;
    *) echo "error: no devices/emulators found" >&2; exit 1 ;;
    esac ;;
push) mkdir -p "$(dirname "$(map "$3")")" && cp "$2" "$(map "$3")" && echo "$2: 1 file pushed" ;;
pull) cp "$(map "$2")" "$3" && echo "$2: 1 file pulled" ;;
shell)
    shift
    if [ "$1" = getprop ]; then echo "Pixel 8 Pro"; exit 0; fi
    sh -c "$(map "$*")" ;;
*) echo "fake adb: unknown command $1" >&2; exit 1 ;;
esac
"#;

/// A directory holding the stand-in `adb`, and the phone's file tree.
struct FakePhone {
    _tmp: tempfile::TempDir,
    bin: PathBuf,
    phone: PathBuf,
    log: PathBuf,
}

impl FakePhone {
    fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let adb = bin.join("adb");
        std::fs::write(&adb, FAKE_ADB).unwrap();
        std::fs::set_permissions(&adb, std::fs::Permissions::from_mode(0o755)).unwrap();
        let phone = tmp.path().join("phone");
        std::fs::create_dir_all(&phone).unwrap();
        let log = tmp.path().join("adb.log");
        FakePhone { _tmp: tmp, bin, phone, log }
    }

    /// `scripts/android.sh args...` with the stand-in first on PATH.
    fn script(&self, args: &[&str], state: &str) -> Output {
        self.script_in(&std::env::temp_dir(), args, state)
    }

    /// The same, run in directory `dir`.
    fn script_in(&self, dir: &Path, args: &[&str], state: &str) -> Output {
        let path = format!("{}:{}", self.bin.display(), std::env::var("PATH").unwrap_or_default());
        Command::new("bash")
            .current_dir(dir)
            .arg(repo_root().join("scripts/android.sh"))
            .args(args)
            .env("PATH", path)
            .env("ADB_LOG", &self.log)
            .env("FAKE_PHONE", &self.phone)
            .env("FAKE_STATE", state)
            .env("NFLASH_BIN", bin("nflash"))
            .env("NFLASH_SKIP_ARCH_CHECK", "1")
            .env_remove("ADB")
            .env_remove("NFLASH_REMOTE_DIR")
            .output()
            .unwrap()
    }

    /// The calls adb received, each as its arguments.
    fn calls(&self) -> Vec<Vec<String>> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect()
    }

    fn remote(&self, name: &str) -> PathBuf {
        self.phone.join("data/local/tmp/nflash").join(name)
    }
}

fn ok(what: &str, o: &Output) -> String {
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{what} failed:\n{out}\n{err}");
    out.into_owned()
}

fn tiny_pack(dir: &Path) -> PathBuf {
    let ckpt = dir.join("tiny");
    write_tiny_checkpoint(&ckpt, &TinySpec::default());
    let pack = dir.join("tiny q8.nflash");
    convert(&ckpt, &pack, "q8_0");
    pack
}

#[test]
fn android_script_pushes_runs_and_probes_through_adb() {
    let phone = FakePhone::new();
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let pack_s = pack.to_str().unwrap();

    // push: the binary (executable) and the pack, byte for byte, in /data/local/tmp/nflash.
    ok("push", &phone.script(&["push", pack_s], "device"));
    let pushed = phone.remote("tiny q8.nflash");
    assert_eq!(std::fs::read(&pushed).unwrap(), std::fs::read(&pack).unwrap());
    assert_eq!(std::fs::read(phone.remote("nflash")).unwrap(), std::fs::read(bin("nflash")).unwrap());
    let calls = phone.calls();
    assert!(calls.iter().any(|c| c[0] == "push" && c[2] == "/data/local/tmp/nflash/nflash"), "{calls:?}");
    assert!(calls.iter().any(|c| c[0] == "shell" && c[1].contains("chmod 755")), "{calls:?}");

    // run: the same greedy text as this machine's nflash on the same pack; a
    // prompt with spaces and quotes arrives as typed.
    let prompt = "it's a \"quoted\" prompt";
    let args = ["--prompt", prompt, "--max-tokens", "6", "--temperature", "0", "--ignore-eos"];
    let mut a = vec!["run", "tiny q8.nflash"];
    a.extend_from_slice(&args);
    let remote_out = ok("run", &phone.script(&a, "device"));
    let mut local = vec!["run", "--model", pack_s];
    local.extend_from_slice(&args);
    let local_out = ok("local run", &run("nflash", &local));
    assert_eq!(remote_out, local_out);
    assert!(!remote_out.trim().is_empty());

    // probe: runs on the phone in the remote directory, pulls the profile back.
    let out = tmp.path().join("pixel.toml");
    let o = phone.script(&["probe", out.to_str().unwrap(), "--quick"], "device");
    ok("probe", &o);
    let p = DeviceProfile::load(&out).unwrap();
    assert_eq!(p.name, "Pixel 8 Pro");
    let calls = phone.calls();
    let probe = calls.iter().find(|c| c[0] == "shell" && c[1].contains("'probe'")).expect("a probe call");
    assert!(probe[1].contains("'--dir' '/data/local/tmp/nflash'") && probe[1].contains("'--quick'"), "{probe:?}");
    assert!(calls.iter().any(|c| c[0] == "pull" && c[1] == "/data/local/tmp/nflash/device.toml"), "{calls:?}");

    // No phone attached: a clear error, nothing pushed.
    let before = phone.calls().len();
    let o = phone.script(&["push", pack_s], "offline");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no phone on adb") && err.contains("adb devices"), "{err}");
    assert!(phone.calls()[before..].iter().all(|c| c[0] == "get-state"), "{:?}", phone.calls());

    // adb's own reason reaches the user, with what to do.
    let o = phone.script(&["push", pack_s], "unauthorized");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("accept the USB debugging prompt"), "{err}");

    // A pack whose name starts with a dash is a file name, not an option;
    // one named `nflash` would overwrite the binary and is refused.
    let dash = tmp.path().join("-q.nflash");
    std::fs::copy(&pack, &dash).unwrap();
    ok("push -q.nflash", &phone.script_in(tmp.path(), &["push", "-q.nflash"], "device"));
    assert_eq!(std::fs::read(phone.remote("-q.nflash")).unwrap(), std::fs::read(&pack).unwrap());
    let dash_out =
        ok("run -q.nflash", &phone.script(&["run", "-q.nflash", "--prompt", "x", "--max-tokens", "2"], "device"));
    assert!(!dash_out.trim().is_empty());
    let named = tmp.path().join("nflash");
    std::fs::copy(&pack, &named).unwrap();
    let o = phone.script(&["push", named.to_str().unwrap()], "device");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("rename it"));

    // probe: a directory or a missing directory as OUT is refused before measuring.
    let o = phone.script(&["probe", tmp.path().to_str().unwrap(), "--quick"], "device");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("is a directory"));
    let o = phone.script(&["probe", "/nonexistent-dir/p.toml", "--quick"], "device");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no directory"));

    // A pack that does not exist, an unknown command: errors naming them.
    let o = phone.script(&["push", "/nonexistent/x.nflash"], "device");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("/nonexistent/x.nflash"));
    let o = phone.script(&["flash"], "device");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("unknown command 'flash'"));
}

/// A fake sysfs of a Snapdragon 8 Gen 3 (2 little, 6 big cores): `nflash
/// run` defaults to one compute thread per big core and says where they
/// and the I/O threads run; `--threads` overrides the default. (On this
/// machine the big cores' ids do not exist, so pinning is refused with one
/// warning and the run goes on.)
#[test]
fn big_cores_from_sysfs_set_the_default_compute_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let root = tmp.path().join("sys");
    let khz = [2_265_600u64, 2_265_600, 3_148_800, 3_148_800, 3_148_800, 2_956_800, 2_956_800, 3_302_400];
    for (i, k) in khz.iter().enumerate() {
        let d = root.join(format!("devices/system/cpu/cpu{i}/cpufreq"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cpuinfo_max_freq"), format!("{k}\n")).unwrap();
    }
    let stats = tmp.path().join("stats.json");
    let run_with = |extra: &[&str]| {
        let mut args = vec!["run", "--model", pack.to_str().unwrap(), "--prompt", "a b", "--max-tokens", "3"];
        args.extend_from_slice(&["--stats", "--stats-json", stats.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let o = Command::new(bin("nflash")).args(&args).env("NFLASH_SYSFS_ROOT", &root).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        (err, j)
    };
    let (err, j) = run_with(&[]);
    assert_eq!(j["compute_threads"], 6, "{err}");
    assert_eq!(j["big_cores"], serde_json::json!([2, 3, 4, 5, 6, 7]));
    assert_eq!(j["little_cores"], serde_json::json!([0, 1]));
    assert!(err.contains("6 compute threads on the big cores 2-7, I/O threads on 0-1"), "{err}");
    assert!(err.contains("8 cores: big 2-7 (2.96-3.30 GHz), little 0-1 (2.27 GHz)"), "{err}");
    let (_, j) = run_with(&["--threads", "2"]);
    assert_eq!(j["compute_threads"], 2);

    // `nflash probe` records the core classes, fastest first.
    let out = tmp.path().join("phone.toml");
    let o = Command::new(bin("nflash"))
        .args(["probe", "--quick", "--out", out.to_str().unwrap()])
        .env("NFLASH_SYSFS_ROOT", &root)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p = DeviceProfile::load(&out).unwrap();
    let classes: Vec<(&str, u32, f64)> = p.cpu.cores.iter().map(|c| (c.class.as_str(), c.count, c.ghz)).collect();
    assert_eq!(classes, vec![("big", 1, 3.3), ("big", 3, 3.15), ("big", 2, 2.96), ("little", 2, 2.27)]);
}
