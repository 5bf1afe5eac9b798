//! Command-line helpers shared by the `nflash` and `prep` binaries. clap
//! stays in the binaries: they describe their options here as
//! [`OptionSpec`]s.

use std::ffi::OsString;

/// One command-line option, as [`join_dash_values`] needs to know it.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec<'a> {
    /// `--long` name, without the dashes.
    pub long: Option<&'a str>,
    /// `-s` name.
    pub short: Option<char>,
    /// Whether it takes a value (`--ctx 512`) or is a flag (`--raw`).
    pub takes_value: bool,
}

/// Joins each `--long` option that takes a value to the next word when that
/// word begins with a dash and is not itself an option (`--draft-tokens -1`
/// becomes `--draft-tokens=-1`; so do `--memory-budget -5MiB` and
/// `--prompt "- a list"`), so that the parser hands it to the option's own
/// check instead of reporting "unexpected argument '-1'". A missing value
/// (`--memory-budget --prompt hi`) is left for the parser to report, and
/// `--` ends the options. `args[0]` is the program.
pub fn join_dash_values(mut args: Vec<OsString>, options: &[OptionSpec]) -> Vec<OsString> {
    let is_option = |t: &str| {
        let name = t.split('=').next().unwrap_or(t);
        matches!(name, "--help" | "-h" | "--version" | "-V")
            || options.iter().any(|o| {
                o.long.is_some_and(|l| name.strip_prefix("--") == Some(l))
                    || o.short.is_some_and(|c| name.strip_prefix('-').is_some_and(|r| r.starts_with(c)))
            })
    };
    let takes_value =
        |t: &str| options.iter().any(|o| o.takes_value && o.long.is_some_and(|l| t.strip_prefix("--") == Some(l)));
    let mut i = 1;
    while i + 1 < args.len() {
        if let (Some(t), Some(v)) = (args[i].to_str(), args[i + 1].to_str()) {
            if t == "--" {
                break;
            }
            if takes_value(t) && v.starts_with('-') && v != "-" && !is_option(v) {
                args[i] = format!("{t}={v}").into();
                args.remove(i + 1);
            }
        }
        i += 1;
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(words: &[&str]) -> Vec<String> {
        let opts = [
            OptionSpec { long: Some("ctx"), short: None, takes_value: true },
            OptionSpec { long: Some("prompt"), short: Some('p'), takes_value: true },
            OptionSpec { long: Some("raw"), short: None, takes_value: false },
        ];
        let args = std::iter::once("prog").chain(words.iter().copied()).map(OsString::from).collect();
        join_dash_values(args, &opts).into_iter().skip(1).map(|a| a.into_string().unwrap()).collect()
    }

    #[test]
    fn dash_values_join_their_option_and_options_stay_apart() {
        assert_eq!(join(&["--ctx", "-1", "--raw"]), ["--ctx=-1", "--raw"]);
        assert_eq!(join(&["--prompt", "- a list"]), ["--prompt=- a list"]);
        assert_eq!(join(&["--ctx", "-5MiB"]), ["--ctx=-5MiB"]);
        // A missing value, a flag, stdin's "-", options after "--": untouched.
        assert_eq!(join(&["--ctx", "--raw"]), ["--ctx", "--raw"]);
        assert_eq!(join(&["--ctx", "-p", "x"]), ["--ctx", "-p", "x"]);
        assert_eq!(join(&["--prompt", "-"]), ["--prompt", "-"]);
        assert_eq!(join(&["--raw", "-1"]), ["--raw", "-1"]);
        assert_eq!(join(&["--", "--ctx", "-1"]), ["--", "--ctx", "-1"]);
        assert_eq!(join(&["--ctx", "--help"]), ["--ctx", "--help"]);
    }
}
