//! # pagedkv — the core
//!
//! Bookkeeping for a paged KV cache, with no Python in it: usable from Rust schedulers and benched
//! natively. The KV region is carved into `num_blocks` uniform blocks of `block_size` tokens; every
//! sequence gets a block table mapping logical token `t` to physical slot
//! `table[t / B] * B + t % B`. Attention kernels read through those tables, so the manager can
//! share, move or drop blocks between steps without the model noticing.
//!
//! Modules, each named for what it owns:
//! - [`error`]: the one error enum.
//! - [`freelist`]: free lists of block ids — the lock-free tagged Treiber stack and a mutex baseline.
//! - [`pool`]: the block pool — a free list plus per-block atomic reference counts.
//! - [`table`]: one sequence's block table and token count.
//! - [`hash`]: the chained XXH3-128 prefix hash and its byte layout.
//! - [`prefix`]: the prefix cache — hash → block map and the LRU of cached-free blocks.
//! - [`step`]: caller-owned step buffers and what one step writes into them.
//! - [`metrics`]: cheap counters readable at any time.
//! - [`swap`]: reclamation — the host block pool, sequence states, the swap-or-recompute cost model.
//! - [`manager`]: the block manager tying them together.

pub mod error;
pub mod freelist;
pub mod hash;
pub mod manager;
pub mod metrics;
pub mod pool;
pub mod prefix;
pub mod step;
pub mod swap;
pub mod table;

pub use error::{Error, Result};

/// Physical block id: an index into the pool's K/V tensors.
pub type BlockId = u32;
/// Sequence id, chosen by the caller.
pub type SeqId = u64;
/// Token id.
pub type TokenId = u32;
