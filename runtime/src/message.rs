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
