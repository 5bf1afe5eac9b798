//! Progress of long stages: an indicatif bar on a terminal, and without one
//! (logs, CI, `nohup`) a plain line at least every
//! [`progress_interval`](nflash_runtime::message::progress_interval) with the
//! stage, percent done and ETA, so that no stage is silent for minutes.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use nflash_runtime::message;

/// A progress bar for stage `stage` of `len` units, drawn with the indicatif
/// `template` on a terminal; dereferences to the [`ProgressBar`].
pub struct Progress {
    pb: ProgressBar,
    stop: Arc<AtomicBool>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// Starts the bar (and, when stderr is not a terminal, the line printer).
    pub fn new(len: u64, template: &str, stage: &'static str) -> Self {
        let pb = ProgressBar::new(len);
        pb.set_style(ProgressStyle::with_template(template).expect("static template"));
        Self::from_bar(pb, stage)
    }

    /// As [`Progress::new`] for a bar already styled.
    pub fn from_bar(pb: ProgressBar, stage: &'static str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = (!std::io::stderr().is_terminal()).then(|| {
            let (pb, stop) = (pb.clone(), stop.clone());
            let every = nflash_runtime::message::progress_interval();
            std::thread::Builder::new()
                .name("progress".into())
                .spawn(move || {
                    let start = Instant::now();
                    let mut next = every;
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(50).min(every));
                        if start.elapsed() >= next && !stop.load(Ordering::Relaxed) {
                            message!("{}", line(stage, &pb, start.elapsed()));
                            next += every;
                        }
                    }
                })
                .ok()
        });
        Progress { pb, stop, ticker: ticker.flatten() }
    }
}

/// `predictors (mlp r=64): 40% (12/30), 1m 05s elapsed, ETA 1m 38s`.
fn line(stage: &str, pb: &ProgressBar, elapsed: Duration) -> String {
    let (pos, len) = (pb.position(), pb.length().unwrap_or(0).max(1));
    let frac = (pos as f64 / len as f64).clamp(0.0, 1.0);
    let eta = if pos == 0 { "unknown".to_string() } else { hms(elapsed.as_secs_f64() * (1.0 - frac) / frac) };
    let msg = pb.message();
    let msg = if msg.is_empty() { String::new() } else { format!(" ({})", msg.trim()) };
    format!("{stage}{msg}: {:.0}% ({pos}/{len}), {} elapsed, ETA {eta}", 100.0 * frac, hms(elapsed.as_secs_f64()))
}

/// `42s`, `3m 07s`, `1h 02m`.
fn hms(s: f64) -> String {
    let s = s.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
    }
}

impl std::ops::Deref for Progress {
    type Target = ProgressBar;
    fn deref(&self) -> &ProgressBar {
        &self.pb
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_say_stage_percent_and_eta() {
        let pb = ProgressBar::hidden();
        pb.set_length(30);
        pb.set_position(12);
        pb.set_message("mlp r=64");
        let l = line("predictors", &pb, Duration::from_secs(65));
        assert_eq!(l, "predictors (mlp r=64): 40% (12/30), 1m 05s elapsed, ETA 1m 38s");
        pb.set_position(0);
        assert!(line("x", &pb, Duration::from_secs(3)).ends_with("ETA unknown"));
        assert_eq!(hms(3725.0), "1h 02m");
    }
}
