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

    /// The host block pool does not hold enough free blocks for a swap-out (always the case with
    /// `num_host_blocks == 0`: swap disabled).
    #[error("out of host blocks: need {needed}, {available} available")]
    OutOfHostBlocks {
        /// Host blocks the swap-out needs.
        needed: usize,
        /// Free host blocks.
        available: usize,
    },

    /// The sequence is not in the state the call needs (stepping a swapped-out sequence, swapping
    /// in a running one, resuming one that was not preempted by recompute, ...).
    #[error("sequence {seq_id} is {state}; this call needs it {expected}")]
    InvalidSequenceState {
        /// The sequence.
        seq_id: SeqId,
        /// Its state: `"running"`, `"swapped"` or `"recompute"`.
        state: &'static str,
        /// The state the call needs.
        expected: &'static str,
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

    /// The host could not allocate memory the core needs (a pool or cache too large for this
    /// machine): reserved fallibly, so the process keeps running and nothing was built.
    #[error("allocation failed: {what} needs {bytes} bytes")]
    AllocationFailed {
        /// The array being allocated, e.g. `"block reference counts"`.
        what: &'static str,
        /// The size asked for, in bytes.
        bytes: u64,
    },

    /// `check_invariants` found the state inconsistent. Never expected; a bug if seen.
    #[error("invariant violated: {0}")]
    InvariantViolation(String),
}

/// Fallible allocation of the core's large arrays: a failure is [`Error::AllocationFailed`]
/// naming the array and the bytes asked for, never an abort.
pub(crate) mod alloc {
    use super::{Error, Result};
    use std::alloc::Layout;

    #[cold]
    #[inline(never)]
    fn failed(what: &'static str, bytes: u128) -> Error {
        Error::AllocationFailed {
            what,
            bytes: bytes.min(u64::MAX as u128) as u64,
        }
    }

    /// Types for which all-zero bytes are a valid value.
    ///
    /// # Safety
    /// Implement only for types whose every field is an integer, `bool` or atomic integer.
    pub(crate) unsafe trait Zeroable: Sized {}
    // SAFETY: zero is a valid value of each of these.
    unsafe impl Zeroable for u32 {}
    unsafe impl Zeroable for u128 {}
    unsafe impl Zeroable for bool {}

    /// `n` zeroes, allocated fallibly. Zeroed memory comes from `alloc_zeroed`, so a large array
    /// is committed page by page as it is first written (as `vec![0; n]` would be), not up front.
    pub(crate) fn zeroed_vec<T: Zeroable>(n: usize, what: &'static str) -> Result<Vec<T>> {
        let bytes = n as u128 * std::mem::size_of::<T>() as u128;
        if n == 0 {
            return Ok(Vec::new());
        }
        let layout = Layout::array::<T>(n).map_err(|_| failed(what, bytes))?;
        // SAFETY: `layout` has a non-zero size (n > 0 and T is not zero-sized: every Zeroable
        // type has a size).
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
        if p.is_null() {
            return Err(failed(what, bytes));
        }
        // SAFETY: `p` was allocated by the global allocator with the layout of `[T; n]`, so
        // capacity `n` matches; all `n` elements are initialised (zero bytes are a valid `T`).
        Ok(unsafe { Vec::from_raw_parts(p, n, n) })
    }

    /// `n` copies of `value`, allocated fallibly (the memory is written, hence committed).
    pub(crate) fn filled_vec<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| failed(what, n as u128 * std::mem::size_of::<T>() as u128))?;
        v.resize(n, value);
        Ok(v)
    }

    /// The items of `it` (exactly `n` of them), allocated fallibly.
    pub(crate) fn collect_exact<T>(
        n: usize,
        it: impl Iterator<Item = T>,
        what: &'static str,
    ) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| failed(what, n as u128 * std::mem::size_of::<T>() as u128))?;
        v.extend(it.take(n));
        Ok(v)
    }

    /// `bytes` for an error naming an allocation the caller could not make (a hash map's).
    pub(crate) fn failure(what: &'static str, bytes: u128) -> Error {
        failed(what, bytes)
    }
}
