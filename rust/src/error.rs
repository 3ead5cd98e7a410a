//! Errors of the ring. Every message names the segment file and what is wrong.

use std::fmt;

#[derive(Debug)]
pub enum RingError {
    /// A system call on the segment file failed.
    Io { path: String, op: &'static str, source: std::io::Error },
    /// `create` found a file already there.
    Exists { path: String },
    /// The file is not a ring segment of this layout, or its header is damaged.
    BadHeader { path: String, what: String },
    /// The shared state failed a consistency check (a cursor or record header is out of range).
    Corrupt { path: String, what: String },
    /// A record longer than the ring can ever hold.
    TooLarge { len: usize, max: usize },
    /// Invalid argument given by the caller (e.g. a capacity of zero).
    Invalid(String),
    /// Nothing could be done before the deadline.
    Timeout,
    /// The ring was closed: no more pushes; pops fail once the ring is drained.
    Closed,
    /// An error of the embedding `Host` (e.g. a Python signal handler's exception, or a
    /// failed allocation in `pop_into`), passed through unchanged for the host to unwrap.
    Host(Box<dyn std::error::Error + Send + Sync>),
}

pub type Result<T> = std::result::Result<T, RingError>;

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RingError::Io { path, op, source } => write!(f, "ring {path}: {op} failed: {source}"),
            RingError::Exists { path } => {
                write!(f, "ring {path}: file already exists (use Ring.open, or Ring.open_or_create, or unlink it)")
            }
            RingError::BadHeader { path, what } => {
                write!(f, "ring {path}: not a usable ring segment: {what} (delete the file and create the ring again)")
            }
            RingError::Corrupt { path, what } => write!(f, "ring {path}: shared state is corrupt: {what}"),
            RingError::TooLarge { len, max } => write!(
                f,
                "record of {len} bytes is larger than this ring can hold ({max} bytes max); \
                 create the ring with a larger capacity or split the record"
            ),
            RingError::Invalid(what) => write!(f, "{what}"),
            RingError::Timeout => write!(f, "ring operation timed out"),
            RingError::Closed => write!(f, "ring is closed"),
            RingError::Host(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RingError {}
