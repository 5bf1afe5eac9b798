//! Diagnostics on stderr that never stop the program.
//!
//! `eprintln!` panics when stderr cannot be written, e.g. a pipe whose
//! reader has exited (a benchmark driver killed before `prep`). A panic in
//! the middle of `prep convert` or `prep synth` would end it without
//! removing its temporary output, and one in a signal handler would end the
//! handler instead of the process. These macros write the same text and
//! drop write errors: the message is lost, the work goes on (or, in a
//! handler, the exit still happens).

/// `eprintln!` that ignores write errors (see the [module](self) docs).
#[macro_export]
macro_rules! message {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stderr(), $($arg)*);
    }};
}

/// `eprint!` that ignores write errors: a progress line without a newline.
#[macro_export]
macro_rules! message_part {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::write!(::std::io::stderr(), $($arg)*);
    }};
}

/// Seconds between plain progress lines when stderr is not a terminal: 10,
/// or `NFLASH_PROGRESS_SECS` (a positive number; tests use a fraction of a second).
pub fn progress_interval() -> std::time::Duration {
    std::env::var("NFLASH_PROGRESS_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(std::time::Duration::from_secs(10), std::time::Duration::from_secs_f64)
}

/// Progress of a loop that reports after each step (`nflash ppl`, `prep
/// verify --quality`): on a terminal one line redrawn in place at every
/// step; otherwise (a log, CI) a whole line once per [`progress_interval`]
/// and at the last step, so that a log gets no carriage returns and is not
/// silent for minutes.
pub struct ProgressLine {
    tty: bool,
    start: std::time::Instant,
    every: std::time::Duration,
    next: std::time::Duration,
}

impl Default for ProgressLine {
    fn default() -> Self {
        let every = progress_interval();
        ProgressLine {
            tty: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            start: std::time::Instant::now(),
            every,
            next: every,
        }
    }
}

impl ProgressLine {
    /// Reports step `done` of `total`; `line` is built only when printed.
    pub fn step(&mut self, done: usize, total: usize, line: impl FnOnce() -> String) {
        if self.tty {
            message_part!("\r{}   ", line());
        } else if self.start.elapsed() >= self.next || done == total {
            message!("{}", line());
            while self.next <= self.start.elapsed() {
                self.next += self.every;
            }
        }
    }

    /// Ends the redrawn line on a terminal (`\r` before `text`); in a log,
    /// `text` on a line of its own.
    pub fn finish(&self, text: &str) {
        if self.tty {
            message!("\r{text}   ");
        } else {
            message!("{text}");
        }
    }

    /// Whether stderr is a terminal.
    pub fn is_tty(&self) -> bool {
        self.tty
    }
}
