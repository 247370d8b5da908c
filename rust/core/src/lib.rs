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
//! - [`groups`]: KV cache groups — attention kinds, dead blocks, sizing.
//! - [`hash`]: the chained XXH3-128 prefix hash and its byte layout.
//! - [`prefix`]: the prefix cache — hash → block map and the LRU of cached-free blocks.
//! - [`keyed`]: caller-keyed blocks — counts, eviction order and a map from the caller's own
//!   hashes (vLLM's block pool sits on it).
//! - [`step`]: caller-owned step buffers and what one step writes into them.
//! - [`metrics`]: cheap counters readable at any time.
//! - [`decode_plan`]: the split-K work list of a ragged decode batch, planned from host lengths.
//! - [`swap`]: reclamation — the host block pool, sequence states, the swap-or-recompute cost model.
//! - [`tier`]: the host tier of the prefix cache — the host index (hash → host block), its LRU,
//!   blocks reserved while a lower tier fills them, and the demotions the engine drains.
//! - [`offload_index`]: the offloading tier's index — chunks, keys, stores in flight and the
//!   tail-first release, one method per call of vLLM's offloading manager.
//! - [`events`]: the KV-event ring — a bounded record of blocks stored in and removed from the
//!   cache tiers, for a router or an external index to follow.
//! - [`manager`]: the block manager tying them together.
//!
//! (`index_list`, private: the intrusive O(1) list behind the prefix cache's LRU and the keyed
//! pool's free list.)
//!
//! The main types are re-exported here: [`BlockManager`], [`ManagerConfig`], [`AdmitResult`],
//! [`AdmitRequest`], [`SeqKeys`] and [`MmInput`] (hashing keys), [`StepBuffers`],
//! [`OwnedStepBuffers`], [`StepLayout`], [`StepInfo`], [`Stats`], [`Error`], [`AttentionKind`]
//! (the attention kind of a KV cache group).
//!
//! # The main flow
//!
//! Admit a prompt (sharing whatever prefix is cached), fill the step buffers the kernels read,
//! fork a parallel sample (copy-on-write), decode, free. Every error is a value and leaves the
//! manager as it was.
//!
//! ```
//! use pagedkv::{BlockManager, Error, ManagerConfig, OwnedStepBuffers, StepLayout};
//!
//! # fn main() -> pagedkv::Result<()> {
//! let mut cfg = ManagerConfig::new(64, 16); // 64 blocks of 16 tokens
//! cfg.watermark_blocks = 0;
//! let mut m = BlockManager::new(cfg)?;
//! let mut bufs = OwnedStepBuffers::new(StepLayout {
//!     max_seqs: 8,
//!     max_tokens: 256,
//!     max_blocks_per_seq: 16,
//!     max_copies: 8,
//!     max_swaps: 0,
//! });
//!
//! // A 100-token prompt: 7 blocks, nothing cached yet.
//! let prompt: Vec<u32> = (0..100).collect();
//! let r = m.admit(1, &prompt)?;
//! assert_eq!((r.cached_tokens, r.num_blocks), (0, 7));
//!
//! // Prefill: all 100 tokens are new; token t goes to slot table[t / 16] * 16 + t % 16.
//! let info = m.build_step(&[1], &[100], &mut bufs.view())?;
//! assert_eq!(info.num_tokens, 100);
//! let table = m.block_table(1)?.to_vec();
//! assert_eq!(bufs.slot_mapping[17], i64::from(table[1]) * 16 + 1);
//!
//! // A parallel sample shares all 7 blocks; the first write into the shared, partly filled tail
//! // block copies it, and the next step hands the (src, dst) copy to the GPU.
//! m.fork(1, 2)?;
//! m.append_batch(&[1, 2], &[7, 8])?;
//! let info = m.build_step(&[1, 2], &[1, 1], &mut bufs.view())?;
//! assert_eq!((info.num_seqs, info.num_tokens, info.num_copies), (2, 2, 1));
//! assert_eq!(bufs.copies[0], i64::from(table[6])); // the old tail is the source
//!
//! // Freed full blocks stay cached: the same prompt again shares its 6 full blocks.
//! m.free(1)?;
//! m.free(2)?;
//! let r = m.admit(3, &prompt)?;
//! assert_eq!((r.cached_tokens, r.new_blocks), (96, 1));
//!
//! // Bad input is an error value, and nothing changed.
//! let free_before = m.num_free_blocks();
//! assert!(matches!(m.free(99), Err(Error::UnknownSequence { seq_id: 99 })));
//! assert_eq!(m.num_free_blocks(), free_before);
//! m.check_invariants()?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod decode_plan;
pub mod error;
pub mod events;
pub mod freelist;
pub mod groups;
pub mod hash;
mod index_list;
pub mod keyed;
pub mod manager;
pub mod metrics;
pub mod offload_index;
pub mod offload_plan;
pub mod pool;
pub mod prefix;
pub mod step;
pub mod swap;
pub mod table;
pub mod tier;

pub use error::{Error, Result};
pub use groups::AttentionKind;
pub use hash::{MmInput, SeqKeys};
pub use manager::{AdmitRequest, AdmitResult, BlockManager, ManagerConfig};
pub use metrics::Stats;
pub use step::{OwnedStepBuffers, StepBuffers, StepInfo, StepLayout};

/// Physical block id: an index into the pool's K/V tensors.
pub type BlockId = u32;
/// Sequence id, chosen by the caller.
pub type SeqId = u64;
/// Token id.
pub type TokenId = u32;
