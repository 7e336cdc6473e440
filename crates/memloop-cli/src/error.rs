//! A small error type for the CLI: every failure becomes one readable line.

use std::fmt;

pub type CliResult<T> = Result<T, CliError>;

#[derive(Debug)]
pub struct CliError(String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// Like anyhow: anything that is an error converts, so `?` works everywhere.
impl<E: std::error::Error> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError(e.to_string())
    }
}

/// An error with this message.
pub fn fail(msg: impl fmt::Display) -> CliError {
    CliError(msg.to_string())
}

pub trait Context<T> {
    /// Prefixes the error with what we were doing.
    fn context(self, what: impl fmt::Display) -> CliResult<T>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: impl fmt::Display) -> CliResult<T> {
        self.map_err(|e| CliError(format!("{what}: {e}")))
    }
}
