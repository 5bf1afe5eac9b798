//! A balloon for memory-pressure tests: takes `--step` MiB every
//! `--every-ms` (touching every page, so it is really resident) until it
//! holds `--steps` of them, holds them for `--hold-ms`, then exits. Prints
//! `full` and `leaving` on stdout (flushed) as it goes.

use std::io::Write;
use std::time::Duration;

use clap::Parser;

#[derive(Parser)]
struct Args {
    /// MiB taken per step.
    #[arg(long, default_value_t = 10)]
    step: usize,
    /// Steps.
    #[arg(long)]
    steps: usize,
    /// Milliseconds between steps.
    #[arg(long, default_value_t = 100)]
    every_ms: u64,
    /// Milliseconds held once full.
    #[arg(long)]
    hold_ms: u64,
}

fn main() {
    let a = Args::parse();
    let mut held: Vec<Vec<u8>> = Vec::new();
    for _ in 0..a.steps {
        let mut b = vec![0u8; a.step << 20];
        for i in (0..b.len()).step_by(4096) {
            b[i] = 1;
        }
        held.push(std::hint::black_box(b));
        std::thread::sleep(Duration::from_millis(a.every_ms));
    }
    println!("full");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_millis(a.hold_ms));
    println!("leaving");
    let _ = std::io::stdout().flush();
    drop(held);
}
