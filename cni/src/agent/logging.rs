//! The node agent's log output: `tracing` lines on stdout, filtered by
//! `RUST_LOG` (default `info`), coloured only for a person at a terminal.

use std::ffi::OsStr;
use std::io::IsTerminal;

/// Whether log lines get ANSI colours: only when stdout is a terminal, and
/// not when `NO_COLOR` is set to anything but the empty string
/// (<https://no-color.org>). A log file, a pipe or a journal gets plain text.
pub fn use_colour(stdout_is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    stdout_is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// Installs the global subscriber (call once, first thing in `main`).
pub fn init() {
    let ansi = use_colour(
        std::io::stdout().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(ansi)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_at_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(!use_colour(false, None), "a file or pipe gets no escapes");
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, Some(OsStr::new("1"))));
        // no-color.org: an empty NO_COLOR does not count.
        assert!(use_colour(true, Some(OsStr::new(""))));
    }
}
