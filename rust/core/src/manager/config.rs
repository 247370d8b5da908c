//! [`ManagerConfig`]: the sizes and switches a [`BlockManager`](super::BlockManager) is built
//! with, and their validation.
//!
//! `validate` is where the integer widths of the step buffers are guaranteed for every id and
//! length: block ids are written as `int32`, slot ids as `int64`, a sequence's length as `int32`.
//! No value a valid configuration allows can overflow them, so the step writes them with plain
//! casts and checks only its own totals.

use crate::error::{Error, Result};
use crate::groups::AttentionKind;

/// Configuration of a [`BlockManager`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Blocks in the pool; ids are `0..num_blocks`.
    pub num_blocks: u32,
    /// Tokens per block (`B`).
    pub block_size: u32,
    /// Reserve never handed to admissions, so running sequences can always append (< num_blocks).
    pub watermark_blocks: u32,
    /// Width of a block-table row: the most blocks one sequence may hold.
    pub max_blocks_per_seq: u32,
    /// Share full blocks between sequences with the same prefix (and keys), and keep freed full
    /// blocks cached until their space is needed.
    pub enable_prefix_caching: bool,
    /// Keep each cached block's token ids and compare them on every hit; a mismatch (a hash
    /// collision) is served as a miss and counted.
    pub verify_prefix: bool,
    /// Key of the prefix hash (the XXH3-128 seed of every block hash and of the chain root).
    /// `None` (the default): a fresh key from the OS for each manager, so nobody outside the
    /// process can predict or steer a hash. `Some(k)`: hashes are reproducible across processes
    /// and machines that share `k` — which also lets anyone who learns `k` compute them (see
    /// `docs/prefix-hash.md`, threat model).
    pub hash_seed: Option<u64>,
    /// Blocks of the host pool that swapped-out sequences live in (0: swap disabled). The host
    /// memory is the engine's; the core hands out its block ids.
    pub num_host_blocks: u32,
    /// Records of the KV-event ring (see [`crate::events`]); 0 (the default) disables it, so
    /// nothing is recorded and nothing is paid.
    pub kv_event_capacity: usize,
    /// The host pool doubles as a prefix-cache tier (see [`crate::tier`]): cached device blocks
    /// are offloaded to it, and admissions continue their prefix lookup there. Needs prefix
    /// caching with `verify_prefix` (the tier keeps each block's token ids) and host blocks.
    pub host_cache: bool,
    /// With `host_cache`: offload a block to the host tier when it is registered in the prefix
    /// cache (write-through), instead of when allocation evicts it (write-back, the default).
    pub host_write_through: bool,
    /// With `host_cache`: a run of host hits shorter than this many blocks is recomputed instead
    /// of loaded (>= 1).
    pub host_load_min_blocks: u32,
    /// The KV cache groups (see [`crate::groups`]), group `g` at index `g`. Empty (the default)
    /// means one [`AttentionKind::Full`] group, exactly the manager without groups. Group 0 must
    /// be `Full` when any group is: it carries the prefix chain. A model whose every layer is
    /// windowed runs with every group windowed (a windowed group 0 releases what it no longer
    /// reads like the others; no host tier then). With more than one group, swap moves every group's
    /// blocks and the host tier keeps each group's blocks under `(chain hash, group)`.
    /// KV events name each block's group (see [`crate::events`]).
    pub groups: Vec<AttentionKind>,
    /// Most provisional tokens a sequence may hold past its committed length (speculative drafts,
    /// or a step scheduled before the previous one finished; see `append_provisional` and
    /// `commit`). 0 (the default) disables them.
    pub max_provisional: u32,
}

/// Most KV cache groups one manager holds.
pub const MAX_GROUPS: usize = 64;

impl ManagerConfig {
    /// Defaults: watermark 1% of the pool (at least 1, but 0 for a one-block pool), rows as wide
    /// as the pool (capped so `max_blocks_per_seq * block_size` fits an `i32` sequence length),
    /// prefix caching on, verify on, a random hash key.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        let watermark_blocks = if num_blocks <= 1 {
            0
        } else {
            (num_blocks / 100).max(1)
        };
        let cap = (i32::MAX as u32)
            .checked_div(block_size)
            .unwrap_or(num_blocks);
        Self {
            num_blocks,
            block_size,
            watermark_blocks,
            max_blocks_per_seq: num_blocks.min(cap),
            enable_prefix_caching: true,
            verify_prefix: true,
            hash_seed: None,
            num_host_blocks: 0,
            kv_event_capacity: 0,
            host_cache: false,
            host_write_through: false,
            host_load_min_blocks: 1,
            groups: Vec::new(),
            max_provisional: 0,
        }
    }

    /// The number of KV cache groups (1 when `groups` is empty).
    pub fn num_groups(&self) -> usize {
        self.groups.len().max(1)
    }

    /// The attention kind of group `g` (`Full` for group 0 of a config without groups).
    pub fn group_kind(&self, g: usize) -> Option<AttentionKind> {
        if self.groups.is_empty() {
            (g == 0).then_some(AttentionKind::Full)
        } else {
            self.groups.get(g).copied()
        }
    }

    /// Checks every field; `InvalidConfig` names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: u64, reason: String| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.block_size == 0 {
            return bad("block_size", 0, "must be >= 1".into());
        }
        if self.num_blocks == 0 {
            return bad("num_blocks", 0, "must be >= 1".into());
        }
        if self.num_host_blocks > i32::MAX as u32 {
            return bad(
                "num_host_blocks",
                self.num_host_blocks as u64,
                format!(
                    "must be <= {} (block ids are written as int64 pairs of int32 ids)",
                    i32::MAX
                ),
            );
        }
        if self.num_blocks > i32::MAX as u32 {
            return bad(
                "num_blocks",
                self.num_blocks as u64,
                format!("must be <= {} (block ids are written as int32)", i32::MAX),
            );
        }
        if (self.num_blocks as u64) * (self.block_size as u64) > i64::MAX as u64 {
            return bad(
                "block_size",
                self.block_size as u64,
                "num_blocks * block_size must fit int64 slot ids".into(),
            );
        }
        if self.watermark_blocks >= self.num_blocks {
            return bad(
                "watermark_blocks",
                self.watermark_blocks as u64,
                format!("must be < num_blocks ({})", self.num_blocks),
            );
        }
        if self.max_blocks_per_seq == 0 {
            return bad("max_blocks_per_seq", 0, "must be >= 1".into());
        }
        if (self.max_blocks_per_seq as u64) * (self.block_size as u64) > i32::MAX as u64 {
            return bad(
                "max_blocks_per_seq",
                self.max_blocks_per_seq as u64,
                format!(
                    "max_blocks_per_seq * block_size must fit an int32 sequence length (block_size {})",
                    self.block_size
                ),
            );
        }
        if self.kv_event_capacity > MAX_KV_EVENTS {
            return bad(
                "kv_event_capacity",
                self.kv_event_capacity as u64,
                format!("must be <= {MAX_KV_EVENTS}"),
            );
        }
        if self.host_load_min_blocks == 0 {
            return bad("host_load_min_blocks", 0, "must be >= 1".into());
        }
        if self.groups.len() > MAX_GROUPS {
            return bad(
                "groups",
                self.groups.len() as u64,
                format!("at most {MAX_GROUPS} groups"),
            );
        }
        for (g, k) in self.groups.iter().enumerate() {
            k.validate(g)?;
        }
        // Group 0 carries the prefix chain. It is `Full` whenever any group is: a windowed group
        // 0 is only for a model whose every layer is windowed (its blocks outside the window are
        // released like any windowed group's).
        if let Some(&k) = self.groups.first() {
            if k.is_windowed() && self.groups.iter().any(|g| !g.is_windowed()) {
                return bad(
                    "groups",
                    0,
                    format!(
                        "group 0 must be Full when some group is (it carries the prefix chain), \
                         got {k:?}"
                    ),
                );
            }
            if k.is_windowed() && self.host_cache {
                return bad(
                    "host_cache",
                    1,
                    format!("a windowed group 0 ({k:?}) has no host tier of the prefix cache"),
                );
            }
        }
        if self.host_cache {
            let need = |what: &str| format!("host_cache needs {what}");
            if !self.enable_prefix_caching {
                return bad("host_cache", 1, need("enable_prefix_caching"));
            }
            if !self.verify_prefix {
                return bad(
                    "host_cache",
                    1,
                    need("verify_prefix (the host tier keeps and checks token ids)"),
                );
            }
            if self.num_host_blocks == 0 {
                return bad("host_cache", 1, need("num_host_blocks >= 1"));
            }
        } else if self.host_write_through {
            return bad("host_write_through", 1, "needs host_cache".into());
        }
        Ok(())
    }
}

/// Most records the KV-event ring may hold (its arena is this many blocks of token ids).
pub const MAX_KV_EVENTS: usize = 1 << 24;
