//! The one error type of the core.
//!
//! Every fallible operation returns [`Result`]; nothing reachable from the public API panics on bad
//! input. Each variant names the offending value and the limit it broke, so a message read in a
//! scheduler's log says what to fix. An operation that returns an error leaves the manager exactly
//! as it was: no block is allocated, freed or re-counted on an error path.
//!
//! The Python binding maps each variant to its own exception class (`pagedkv.errors`); adding a
//! variant here means adding its class there.

use crate::{BlockId, SeqId};

/// Result alias used throughout the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range (block size 0, no blocks, watermark ≥ pool, …).
    #[error("invalid config: {field} = {value}: {reason}")]
    InvalidConfig {
        field: &'static str,
        value: u64,
        reason: String,
    },

    /// An argument is out of range (a zero or negative count, a length mismatch, …).
    #[error("invalid argument: {what} = {value}: {reason}")]
    InvalidArgument {
        what: &'static str,
        value: i64,
        reason: String,
    },

    /// The sequence id is not known to the manager.
    #[error("unknown sequence id {seq_id}")]
    UnknownSequence { seq_id: SeqId },

    /// The sequence id is already in use.
    #[error("sequence id {seq_id} already exists")]
    DuplicateSequence { seq_id: SeqId },

    /// The pool does not hold enough free blocks, reserve included.
    #[error("out of blocks: need {needed}, {available} available")]
    OutOfBlocks { needed: usize, available: usize },

    /// An admission would dip into the watermark reserve kept for running sequences.
    #[error("admission needs {needed} blocks but only {available} are free above the watermark reserve of {watermark}")]
    WatermarkReached {
        needed: usize,
        available: usize,
        watermark: usize,
    },

    /// A sequence would need more blocks than a block-table row holds.
    #[error("sequence {seq_id} would need {needed_blocks} blocks; a block-table row holds {max_blocks_per_seq}")]
    SequenceTooLong {
        seq_id: SeqId,
        needed_blocks: usize,
        max_blocks_per_seq: usize,
    },

    /// A caller-owned step buffer is too small for this step.
    #[error("buffer `{buffer}` too small: need {needed} elements, capacity {capacity}")]
    BufferTooSmall {
        buffer: &'static str,
        needed: usize,
        capacity: usize,
    },

    /// A caller-owned step buffer has the wrong element type, or a null / misaligned pointer.
    #[error("buffer `{buffer}`: expected {expected}, got {got}")]
    BufferInvalid {
        buffer: &'static str,
        expected: &'static str,
        got: String,
    },

    /// A step was requested before step buffers were registered.
    #[error("no step buffers registered")]
    BuffersNotRegistered,

    /// A block id outside the pool.
    #[error("block id {block} out of range: the pool holds {num_blocks} blocks")]
    InvalidBlock { block: BlockId, num_blocks: u32 },

    /// A block's reference count would drop below zero (a double free).
    #[error("refcount underflow on block {block} (double free)")]
    RefcountUnderflow { block: BlockId },

    /// Verify mode found a cached block whose token ids differ from the request's (a hash collision).
    #[error("prefix hash collision on block {block}: cached token ids differ from the request's")]
    PrefixCollision { block: BlockId },

    /// `check_invariants` found the state inconsistent. Never expected; a bug if seen.
    #[error("invariant violated: {0}")]
    InvariantViolation(String),
}
