//! `nflash probe` end to end (quick mode): a profile that loads, no scratch
//! file left behind, clean failures on a bad --out; and every shipped
//! `profiles/*.toml` parses.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use nflash_format::DeviceProfile;
use nflash_tests::{assert_fails, assert_no_temp, repo_root, run};

/// Entries of `dir` other than `keep`.
fn others(dir: &Path, keep: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != keep)
        .collect()
}

#[test]
fn quick_probe_writes_a_loadable_profile_and_removes_its_scratch_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.toml");
    let t = std::time::Instant::now();
    let o = run("nflash", &["probe", "--quick", "--name", "test device", "--out", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "nflash probe failed:\n{stderr}");
    eprintln!("{stderr}\nquick probe took {:.1} s", t.elapsed().as_secs_f64());

    let p = DeviceProfile::load(&out).unwrap();
    assert_eq!(p.name, "test device");
    assert!(p.source.starts_with("nflash probe "), "source: {}", p.source);
    assert!(p.source.contains("file 64 MiB"), "source: {}", p.source);
    // 3 block sizes × 2 in-flight counts.
    assert_eq!(p.flash.read.len(), 6, "{:?}", p.flash.read);
    for (b, n) in [(4096, 1), (4096, 16), (65536, 1), (524288, 16)] {
        assert!(
            p.flash.read.iter().any(|r| r.block_bytes == b && r.in_flight == n),
            "no read point at {b} bytes × {n}"
        );
    }
    assert!(p.flash.io_queues == 1 || p.flash.io_queues == 16, "io_queues {}", p.flash.io_queues);
    assert!(p.memory.available_bytes <= p.memory.total_bytes);
    assert!(p.cpu.q4_0_matvec_gb_s_1t.is_some() && p.cpu.q4_0_matvec_gb_s_mt.is_some());
    let k = p.kernels.expect("the probe measures the sparse FFN ([kernels])");
    assert!(k.q4_0_ffn_gb_s_1t > 0.0 && k.q4_0_ffn_gb_s_mt > 0.0, "{k:?}");
    assert!(stderr.contains("sparse FFN"), "{stderr}");
    assert!(
        k.q8_0_predictor_gb_s_1t.is_some_and(|v| v > 0.0) && k.q8_0_predictor_gb_s_mt.is_some_and(|v| v > 0.0),
        "{k:?}"
    );
    assert!(stderr.contains("predictor (q8_0"), "{stderr}");
    assert_eq!(p.cpu.threads_measured, Some(p.n_cores()));
    assert!(stderr.contains(&format!("wrote {}", out.display())), "{stderr}");

    // Only the profile is left: no scratch file, no temporary profile.
    assert_eq!(others(dir.path(), "p.toml"), Vec::<String>::new());
    assert_no_temp(&out);
}

#[test]
fn probe_falls_back_to_buffered_reads_with_one_warning() {
    // --buffered (hidden) takes the path used where the filesystem refuses O_DIRECT.
    let dir = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let out = dir.path().join("b.toml");
    let o = run(
        "nflash",
        &[
            "probe",
            "--quick",
            "--buffered",
            "--seconds",
            "0.05",
            "--file-mib",
            "32",
            "--dir",
            scratch.path().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "nflash probe --buffered failed:\n{stderr}");
    assert_eq!(stderr.matches("warning:").count(), 1, "{stderr}");
    let p = DeviceProfile::load(&out).unwrap();
    assert!(p.source.contains("(buffered)") && p.source.contains("file 32 MiB"), "source: {}", p.source);
    assert_eq!(others(scratch.path(), ""), Vec::<String>::new(), "scratch file left in --dir");
    assert_eq!(others(dir.path(), "b.toml"), Vec::<String>::new());
}

#[test]
fn probe_refuses_a_missing_out_directory_and_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/p.toml");
    let o = run("nflash", &["probe", "--quick", "--out", missing.to_str().unwrap()]);
    assert_fails("probe into a missing directory", &o, &["does not exist", "no/such/dir"]);
    assert!(!missing.exists());

    let out = dir.path().join("p.toml");
    let o = run("nflash", &["probe", "--quick", "--out", dir.path().to_str().unwrap()]);
    assert_fails("probe --out DIR", &o, &["is a directory"]);
    let o = run("nflash", &["probe", "--quick", "--out", out.to_str().unwrap(), "--file-mib", "1000000000"]);
    assert_fails("probe with a huge --file-mib", &o, &["not enough free space", "--file-mib"]);
    let o = run("nflash", &["probe", "--quick", "--out", out.to_str().unwrap(), "--seconds", "0"]);
    assert_fails("probe --seconds 0", &o, &["--seconds"]);
    // Too short to measure anything: refused rather than written as figures.
    let o = run("nflash", &["probe", "--quick", "--out", out.to_str().unwrap(), "--seconds", "1e-300"]);
    assert_fails("probe --seconds 1e-300", &o, &["--seconds"]);
    // Not a regular file (the temporary + rename would replace it): refused before measuring.
    let o = run("nflash", &["probe", "--quick", "--out", "/dev/null"]);
    assert_fails("probe --out /dev/null", &o, &["not a regular file"]);
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    assert_eq!(others(dir.path(), ""), Vec::<String>::new(), "files left behind after failures");
}

#[test]
fn every_shipped_profile_loads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../profiles");
    assert_eq!(dir.canonicalize().unwrap(), repo_root().join("profiles").canonicalize().unwrap());
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "toml") {
            let p = DeviceProfile::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!p.flash.read.is_empty() && p.n_cores() > 0, "{}", path.display());
            names.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    names.sort();
    for want in ["dev-host.toml", "oneplus-12.toml", "oneplus-ace-2.toml"] {
        assert!(names.iter().any(|n| n == want), "profiles/{want} missing; found {names:?}");
    }
}
