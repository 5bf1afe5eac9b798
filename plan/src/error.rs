//! The one error type of `nflash-plan`.

/// Errors from planning.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pack or the plan's request is invalid; for a budget below the
    /// minimum, [`nflash_format::Error::Budget`] names the parts and what fits.
    #[error(transparent)]
    Format(#[from] nflash_format::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
