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
        /// The configuration field, e.g. `"block_size"`.
        field: &'static str,
        /// The value it was given.
        value: u64,
        /// The rule it broke, e.g. `"must be at least 1"`.
        reason: String,
    },

    /// An argument is out of range (a zero or negative count, a length mismatch, …).
    #[error("invalid argument: {what} = {value}: {reason}")]
    InvalidArgument {
        /// The argument, e.g. `"num_tokens"`.
        what: &'static str,
        /// The offending value (a length where the argument is a slice).
        value: i64,
        /// The rule it broke.
        reason: String,
    },

    /// The sequence id is not known to the manager.
    #[error("unknown sequence id {seq_id}")]
    UnknownSequence {
        /// The id asked for.
        seq_id: SeqId,
    },

    /// The sequence id is already in use.
    #[error("sequence id {seq_id} already exists")]
    DuplicateSequence {
        /// The id already held by a live sequence.
        seq_id: SeqId,
    },

    /// The pool does not hold enough free blocks, reserve included.
    #[error("out of blocks: need {needed}, {available} available")]
    OutOfBlocks {
        /// Blocks the operation needs.
        needed: usize,
        /// Blocks it could take (free plus evictable cached ones).
        available: usize,
    },

    /// An admission would dip into the watermark reserve kept for running sequences.
    #[error("admission needs {needed} blocks but only {available} are free above the watermark reserve of {watermark}")]
    WatermarkReached {
        /// Blocks the admission needs.
        needed: usize,
        /// Free blocks above the reserve.
        available: usize,
        /// Blocks kept back for running sequences.
        watermark: usize,
    },

    /// A sequence would need more blocks than a block-table row holds.
    #[error("sequence {seq_id} would need {needed_blocks} blocks; a block-table row holds {max_blocks_per_seq}")]
    SequenceTooLong {
        /// The sequence that would grow too long.
        seq_id: SeqId,
        /// Blocks it would need.
        needed_blocks: usize,
        /// Width of a block-table row ([`crate::manager::ManagerConfig::max_blocks_per_seq`]).
        max_blocks_per_seq: usize,
    },

    /// A caller-owned step buffer is too small for this step.
    #[error("buffer `{buffer}` too small: need {needed} elements, capacity {capacity}")]
    BufferTooSmall {
        /// The buffer's name, e.g. `"slot_mapping"`.
        buffer: &'static str,
        /// Elements this step writes.
        needed: usize,
        /// Elements the buffer holds.
        capacity: usize,
    },

    /// A caller-owned step buffer has the wrong element type, or a null / misaligned pointer.
    #[error("buffer `{buffer}`: expected {expected}, got {got}")]
    BufferInvalid {
        /// The buffer's name.
        buffer: &'static str,
        /// What the core requires, e.g. `"int32"`.
        expected: &'static str,
        /// What it was given.
        got: String,
    },

    /// A step was requested before step buffers were registered.
    #[error("no step buffers registered")]
    BuffersNotRegistered,

    /// A block id outside the pool.
    #[error("block id {block} out of range: the pool holds {num_blocks} blocks")]
    InvalidBlock {
        /// The block id given.
        block: BlockId,
        /// Blocks in the pool (valid ids are `0..num_blocks`).
        num_blocks: u32,
    },

    /// A block's reference count would drop below zero (a double free).
    #[error("refcount underflow on block {block} (double free)")]
    RefcountUnderflow {
        /// The block freed once too often.
        block: BlockId,
    },

    /// Verify mode found a cached block whose token ids differ from the request's (a hash collision).
    #[error("prefix hash collision on block {block}: cached token ids differ from the request's")]
    PrefixCollision {
        /// The cached block whose hash matched.
        block: BlockId,
    },

    /// `check_invariants` found the state inconsistent. Never expected; a bug if seen.
    #[error("invariant violated: {0}")]
    InvariantViolation(String),
}
