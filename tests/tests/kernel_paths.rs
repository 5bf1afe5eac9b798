//! Whole models through the SIMD kernels dispatched on this CPU and
//! through the portable ones (`NFLASH_KERNELS=portable`): the same logits,
//! bit for bit. The kernel unit tests (`runtime/src/kernels/tests.rs`)
//! hold each ISA kernel to `portable.rs`; this checks that nothing else in
//! a forward pass (which kernel a shape takes, the ×8 layout against the
//! row layout, hot against cold clusters) depends on the CPU.

use std::path::Path;

use nflash_runtime::model::Speculation;
use nflash_tests::{generate_in, placements, repo_root, run_alone_with};

/// Where the child processes of [`portable_and_dispatched_kernels_give_the_same_logits`] write.
const OUT_ENV: &str = "NFLASH_TEST_LOGITS_OUT";

#[test]
fn portable_and_dispatched_kernels_give_the_same_logits() {
    let dir = repo_root().join("target/kernel-paths");
    std::fs::create_dir_all(&dir).unwrap();
    let mut outs = Vec::new();
    for kernels in ["auto", "portable"] {
        let out = dir.join(format!("{kernels}.txt"));
        let _ = std::fs::remove_file(&out);
        run_alone_with(
            "kernel_paths::logits_of_this_process",
            &[(nflash_runtime::kernels::KERNELS_ENV, kernels), (OUT_ENV, out.to_str().unwrap())],
        );
        outs.push(std::fs::read_to_string(&out).unwrap());
    }
    let (auto, portable) = (&outs[0], &outs[1]);
    assert!(portable.lines().next().is_some_and(|l| l.ends_with("portable")), "{}", &portable[..80]);
    assert_eq!(auto.lines().count(), portable.lines().count());
    let isa = auto.lines().next().unwrap_or("");
    for (a, p) in auto.lines().zip(portable.lines()).skip(1) {
        let (label, _) = a.split_once(':').unwrap_or((a, ""));
        let diff = a.split(' ').zip(p.split(' ')).position(|(x, y)| x != y);
        assert!(diff.is_none(), "{label}: dispatched ({isa}) and portable kernels differ at word {diff:?}");
    }
}

/// Run by [`portable_and_dispatched_kernels_give_the_same_logits`] in a
/// child process: greedy logits of SmolLM2 (Q8_0 and Q4_0; a 12-token
/// prompt, whose prefill takes the short-pass kernels, and a 44-token one,
/// the long-pass ones; 4 decode steps), with the FFN in memory and read
/// from flash, written one row per line as hex bits to `$NFLASH_TEST_LOGITS_OUT`.
#[test]
#[ignore = "run in a child process by portable_and_dispatched_kernels_give_the_same_logits"]
fn logits_of_this_process() {
    use std::fmt::Write;
    let out = std::env::var(OUT_ENV).expect("run by portable_and_dispatched_kernels_give_the_same_logits");
    let isa = nflash_runtime::kernels::isa();
    let mut text = format!("kernels {isa}\n");
    let ids = crate::smollm2::eval_tokens(44);
    for quant in ["q8_0", "q4_0"] {
        let path = crate::smollm2::pack(quant);
        let all = placements(&path);
        for (name, cfg) in [&all[0], &all[2]] {
            for n in [12, 44] {
                let (logits, tokens) = logits(&path, cfg, &ids[..n]);
                for (step, row) in logits.iter().enumerate() {
                    write!(text, "{quant} {name} prompt {n} step {step}:").unwrap();
                    row.iter().for_each(|v| write!(text, " {:08x}", v.to_bits()).unwrap());
                    text.push('\n');
                }
                writeln!(text, "{quant} {name} prompt {n} tokens {tokens:?}").unwrap();
            }
        }
    }
    std::fs::write(out, text).unwrap();
}

/// Greedy logits as `nflash run` computes them: ×8 layout where this
/// process's kernels have it, 2 threads.
fn logits(path: &Path, cfg: &nflash_plan::CacheConfig, prompt: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let x8 = nflash_runtime::kernels::x8_available();
    let (l, t, _) = generate_in(path, cfg, 2, prompt, 4, x8, Speculation::Auto);
    (l, t)
}
