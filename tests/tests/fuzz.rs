//! A fixed-seed slice of the mutation fuzzer (`tests/src/bin/nflash-fuzz`,
//! `make fuzz` for a long run): damaged packs through `nflash run` and
//! damaged checkpoint and GGUF files through `prep convert` must each end in a clean
//! result or a clean refusal: no panic, no signal, no hang, no silent exit.

use nflash_tests::bin;

#[test]
fn a_fixed_seed_slice_of_the_fuzzer_finds_no_panic_signal_or_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fuzz");
    let o = std::process::Command::new(bin("nflash-fuzz"))
        .args(["--inputs", "210", "--seed", "2026", "--jobs", "2", "--bound-secs", "60", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "nflash-fuzz found failures:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["inputs"], 210, "{stdout}");
    // The slice exercises every target, and both outcomes a reader can give.
    let count = |target: &str, outcome: &str| {
        s["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["target"] == target && r["outcome"] == outcome)
            .map(|r| r["count"].as_u64().unwrap())
            .sum::<u64>()
    };
    for t in ["pack", "checkpoint", "gguf"] {
        assert!(count(t, "refused") > 0, "no {t} input was refused:\n{stdout}");
        assert!(count(t, "ok") > 0, "no {t} input ran (seeds broken?):\n{stdout}");
    }
}
