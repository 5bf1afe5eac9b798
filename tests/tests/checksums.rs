//! Neuron-cluster checksums (formats/SPEC.md §4.10): a damaged cluster stops
//! `nflash run` before any kernel uses it, in every placement (all in
//! memory, hot region, cold reads); an undamaged pack runs as without checks.

use std::path::{Path, PathBuf};

use nflash_tests::{assert_fails, bin, convert_with, repo_root, run, write_tiny_checkpoint, TinySpec};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny q8_0 pack with 5-neuron clusters (about 20 per layer) in `tmp`.
fn tiny_pack(tmp: &Path) -> PathBuf {
    let ckpt = tmp.join("ckpt");
    write_tiny_checkpoint(&ckpt, &TinySpec::default());
    let pack = tmp.join("tiny.nflash");
    convert_with(&ckpt, &pack, &["--quant", "q8_0", "--cluster-bytes", "1KiB"]);
    pack
}

/// `(offset, bytes)` of segment `name` of `pack`.
fn segment(pack: &Path, name: &str) -> (u64, u64) {
    let p = nflash_format::Pack::open(pack).unwrap();
    let (_, seg) = p.segment_by_name(name).unwrap();
    (seg.offset, seg.bytes)
}

/// Greedy `nflash run` arguments for `pack` with `extra` flags.
fn run_args<'a>(pack: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "run",
        "--model",
        s(pack),
        "--prompt",
        "w3 w4 w5",
        "--raw",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--threads",
        "1",
    ];
    v.extend_from_slice(extra);
    v
}

/// The placements checked: everything in memory (hot clusters checked at
/// load), a budget, and a budget with nothing hot (every cluster a cold read,
/// checked on the I/O thread).
const PLACEMENTS: [&[&str]; 3] =
    [&[], &["--memory-budget", "64MiB"], &["--memory-budget", "64MiB", "--hot-fraction", "0", "--io-threads", "2"]];

#[test]
fn a_byte_flipped_every_4_kib_of_an_ffn_segment_stops_every_placement_naming_the_layer_and_checksums() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let (off, len) = segment(&pack, "ffn.1");
    let mut bytes = std::fs::read(&pack).unwrap();
    let mut flipped = 0;
    for at in (off..off + len).step_by(4096) {
        bytes[at as usize] ^= 0x20;
        flipped += 1;
    }
    assert!(flipped >= 2, "segment ffn.1 is only {len} bytes");
    std::fs::write(&pack, &bytes).unwrap();
    for extra in PLACEMENTS {
        let o = run("nflash", &run_args(&pack, extra));
        let what = format!("nflash run {extra:?} on a damaged pack");
        let err =
            assert_fails(&what, &o, &["neuron cluster", "of layer 1", "CRC-32C stored", "computed", "file offset"]);
        assert!(err.contains("push or copy it again"), "{what}: no advice:\n{err}");
        // Stopped before any token computed with the damaged bytes was printed.
        assert!(
            o.stdout.iter().all(u8::is_ascii_whitespace),
            "{what} printed {:?}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    // `prep verify` finds it too (the segment's CRC-32 first).
    let o = run("prep", &["verify", s(&pack)]);
    assert_fails("prep verify", &o, &["checksum mismatch", "segment \"ffn.1\""]);
    // With the checks off the damage goes unnoticed: what the checks are for.
    let o = run("nflash", &run_args(&pack, &["--verify", "off"]));
    assert!(o.status.success(), "--verify off: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn an_undamaged_pack_gives_the_same_tokens_with_and_without_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    for extra in PLACEMENTS {
        let tokens = |verify: &str| {
            let mut args = run_args(&pack, extra);
            args.extend(["--verify", verify]);
            let o = run("nflash", &args);
            assert!(o.status.success(), "--verify {verify} {extra:?}: {}", String::from_utf8_lossy(&o.stderr));
            assert!(!String::from_utf8_lossy(&o.stderr).contains("note:"), "a notice for a 3.4 pack");
            String::from_utf8(o.stdout).unwrap()
        };
        let off = tokens("off");
        assert!(!off.trim().is_empty());
        assert_eq!(tokens("lazy"), off, "{extra:?}");
        assert_eq!(tokens("full"), off, "{extra:?}");
    }
    // `prep verify` counts every cluster.
    let n: usize = nflash_format::Pack::open(&pack).unwrap().manifest().ffn.iter().map(|f| f.clusters.len()).sum();
    let o = run("prep", &["verify", s(&pack)]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&format!("and {n} neuron-cluster checksums verified")), "{out}");
}

#[test]
fn a_pack_without_checksums_runs_with_a_one_line_notice() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let old = tmp.path().join("v3.3.nflash");
    let script = repo_root().join("formats/python/check_pack.py");
    let o = std::process::Command::new("python3").arg(&script).args(["downgrade", s(&pack), s(&old)]).output().unwrap();
    assert!(o.status.success(), "downgrade: {}", String::from_utf8_lossy(&o.stderr));
    let p = nflash_format::Pack::open(&old).unwrap();
    assert_eq!(p.header().minor, 3);
    assert!(p.cluster_checksums().unwrap().is_none());
    let new = run("nflash", &run_args(&pack, &[]));
    let o = run("nflash", &run_args(&old, &[]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout, new.stdout, "the same weights give the same tokens");
    let err = String::from_utf8_lossy(&o.stderr);
    let notes: Vec<&str> = err.lines().filter(|l| l.starts_with("note:")).collect();
    assert_eq!(notes.len(), 1, "{err}");
    for needle in ["format 3.3", "without neuron-cluster checksums", "--verify full", "prep upgrade"] {
        assert!(notes[0].contains(needle), "{needle:?} not in {:?}", notes[0]);
    }
    // Checks off: no notice. `prep verify` says what it could not check.
    let o = run("nflash", &run_args(&old, &["--verify", "off"]));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("note:"));
    let o = std::process::Command::new(bin("prep")).args(["verify", s(&old)]).output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("no neuron-cluster checksums"));
    // `prep upgrade` adds them: the same bytes as prep writes today, the same tokens, no notice.
    let up = tmp.path().join("upgraded.nflash");
    let o = run("prep", &["upgrade", s(&old), "--out", s(&up)]);
    assert!(o.status.success(), "prep upgrade: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read(&up).unwrap(), std::fs::read(&pack).unwrap(), "upgrade gives what convert writes");
    let o = run("prep", &["upgrade", s(&up), "--out", s(&tmp.path().join("again.nflash"))]);
    assert_fails("prep upgrade of a 3.4 pack", &o, &["already has neuron-cluster checksums"]);
    assert!(!tmp.path().join("again.nflash").exists());
    let o = run("prep", &["upgrade", s(&old), "--out", s(&old)]);
    assert_fails("prep upgrade onto its input", &o, &["--out"]);
    assert!(nflash_format::Pack::open(&old).is_ok(), "the input survived");
}

#[test]
fn the_table_holds_each_clusters_crc32c_in_manifest_order() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let p = nflash_format::Pack::open(&pack).unwrap();
    let (idx, seg) = p.segment_by_name("checksums").unwrap();
    assert_eq!(seg.kind, nflash_format::SegmentKind::ClusterChecksums);
    let n: u64 = p.manifest().ffn.iter().map(|f| f.clusters.len() as u64).sum();
    assert_eq!(seg.bytes, 4 * n);
    assert_eq!(idx as usize, p.manifest().segments.len() - 1, "prep writes the table last");
    let table = p.cluster_checksums().unwrap().unwrap();
    assert_eq!(table.all().len() as u64, n);
    // Each entry is the CRC-32C of its cluster's bundles.
    let m = p.manifest();
    let f = &m.ffn[1];
    let c = &f.clusters[2];
    let bytes = p.segment(f.segment).unwrap();
    let len = (c.n_neurons as u64 * f.bundle.bundle_bytes) as usize;
    let want = nflash_format::cluster_crc32c(&bytes[c.offset as usize..c.offset as usize + len]);
    assert_eq!(table.unit(1)[2], want);
    assert_eq!(p.verify_clusters().unwrap(), Some(n));
}

/// A pack marked format 3.4 or later (this build writes 3.5) whose checksum table is gone (a tool that
/// dropped it, or damage) is refused as damaged by `nflash run` (lazy and
/// full checks) and `prep verify`, naming what is missing, and runs with
/// `--verify off`.
#[test]
fn a_3_4_pack_without_its_checksum_table_is_refused_unless_checks_are_off() {
    let tmp = tempfile::tempdir().unwrap();
    let pack = tiny_pack(tmp.path());
    let stripped = tmp.path().join("stripped.nflash");
    let script = repo_root().join("formats/python/check_pack.py");
    let o = std::process::Command::new("python3")
        .arg(&script)
        .args(["downgrade", "--keep-minor", s(&pack), s(&stripped)])
        .output()
        .unwrap();
    assert!(o.status.success(), "downgrade --keep-minor: {}", String::from_utf8_lossy(&o.stderr));
    let p = nflash_format::Pack::open(&stripped).unwrap();
    // This build's version, which has carried the table since 3.4.
    let (major, minor) = (p.header().major, p.header().minor);
    assert!((major, minor) >= (3, 4) && minor == nflash_format::VERSION_MINOR);
    let version = format!("format {major}.{minor}");
    assert!(p.cluster_checksums().is_err());
    for verify in [&[][..], &["--verify", "full"], &["--memory-budget", "64MiB", "--hot-fraction", "0"]] {
        let o = run("nflash", &run_args(&stripped, verify));
        assert_fails(&format!("nflash run {verify:?}"), &o, &[&version, "neuron-cluster checksums", "--verify off"]);
    }
    let o = run("prep", &["verify", s(&stripped)]);
    assert_fails("prep verify", &o, &[&version, "neuron-cluster checksums"]);
    let o = run("nflash", &run_args(&stripped, &["--verify", "off"]));
    assert!(o.status.success(), "--verify off: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout, run("nflash", &run_args(&pack, &[])).stdout);
}

/// Damage that only decode's own reads meet: single tokens go straight
/// into decode (no prefill, which would read every cluster first),
/// nothing is hot, and only layer 1 is damaged, so its clusters are first
/// read by the speculative prefetch at the end of layer 0 (`--speculate
/// always`), by the next-layer prefetch, or by layer 1's own fetch. Decode
/// stops with the cluster's checksum error on every path; it never returns
/// logits computed from damaged bytes.
#[test]
fn damage_met_only_by_decode_reads_stops_decode_on_every_path() {
    use nflash_runtime::model::Speculation;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    write_tiny_checkpoint(&ckpt, &TinySpec::default());
    let calib = tmp.path().join("calib.txt");
    std::fs::write(&calib, nflash_tests::tiny_words(1200, TinySpec::default().vocab, 7)).unwrap();
    let pack = tmp.path().join("sparse.nflash");
    let mut flags = vec!["--quant", "q8_0", "--cluster-bytes", "1KiB", "--calib", s(&calib), "--sparsity", "0.5"];
    flags.extend(nflash_tests::QUICK_CALIB);
    convert_with(&ckpt, &pack, &flags);
    nflash_tests::damage_segments(&pack, &["ffn.1"]);
    for spec in [Speculation::Never, Speculation::Auto, Speculation::Always] {
        let (err, st) = nflash_tests::decode_until_error(&pack, spec, 8);
        for needle in ["neuron cluster", "layer 1", "CRC-32C stored"] {
            assert!(err.contains(needle), "{spec:?}: {needle:?} not in {err}");
        }
        if spec == Speculation::Always {
            assert!(st.speculated > 0, "{spec:?}: nothing was read speculatively: {st:?}");
        }
    }
}
