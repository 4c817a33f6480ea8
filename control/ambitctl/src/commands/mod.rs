//! One module per command family: its flags (clap) and how its results are
//! printed. The work is done by the library module of the same name
//! (`ambitctl::<family>`). Shared here: the output format flag and writing
//! to stdout.

pub mod analyze;
pub mod local;

use clap::ValueEnum;

/// `-o`: human tables by default, or machine-readable output.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
pub fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}
