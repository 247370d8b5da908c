//! The block manager: sequences, their block tables, the prefix cache and the step builder.
//!
//! Single owner (`&mut self`): one scheduler thread drives it. It holds the [`BlockPool`] (block
//! reference counts and the free list) and, owning it exclusively, uses the pool's `*_mut`
//! operations (plain loads and stores, no atomic read-modify-writes). It also holds the
//! [`PrefixCache`] and one state record per sequence: block table, token count, token ids (only
//! with prefix caching on: they are what gets hashed), the chained hashes of its full blocks, and
//! its hashing keys.
//!
//! Every block is in exactly one of four states:
//! - **free**: on the pool's free list;
//! - **cached-free**: refcount 0, hashed, in the prefix LRU — reusable by a prefix hit, evictable;
//! - **owned**: refcount ≥ 1, equal to the number of block tables that contain it;
//! - **copy source in flight**: refcount 0, unhashed, the `src` of a copy-on-write copy that the
//!   next step still has to emit; it goes back to the free list once the copy is emitted.
//!
//! Rules worth knowing:
//! - **Registration happens at step time.** A full block is offered to the prefix cache by the
//!   `build_step` that schedules its last token, not when the token is admitted or appended. A
//!   later admission can therefore only hit blocks whose KV a step has been built to write, and a
//!   sequence freed before any step ran leaves nothing stale in the cache. (A block completed by
//!   committed provisional tokens that a step already scheduled is registered by the `commit`.)
//! - **At least one prompt token is computed.** An admission shares at most `(len - 1) / B` cached
//!   blocks, `len` being the whole prompt's length: when the whole prompt is cached, its last block
//!   is allocated fresh (and recomputed) rather than shared, so the engine never writes into a
//!   shared block.
//! - **Chunked admission.** The lookup covers the whole prompt, but with `max_new_tokens = k` the
//!   sequence holds only `cached + min(k, len - cached)` tokens; the caller appends the rest chunk
//!   by chunk. Each chunk's full blocks enter the cache when the step computing them is built.
//! - **Batch calls** (`admit_batch`, `free_batch`) validate every argument before touching state;
//!   `admit_batch` then admits in order and stops at the first request that does not fit.
//! - **Copy-on-write.** Only a partly filled tail block can be shared *and* written (after a
//!   fork). Appending into one allocates a fresh block and queues a `(src, dst)` copy that a
//!   `build_step` emits: the next one with room in its copy buffer, and at the latest the first
//!   one that schedules a sequence holding the copy's `dst` or `src`. The copy list of one step
//!   has distinct `dst`s and no `dst` is a `src`.
//! - **Allocation order.** Never-cached free blocks first, then the least recently freed
//!   cached-free block (an eviction). A freed sequence's blocks enter the LRU tail first, so its
//!   tail is evicted before its prefix.
//! - **Watermark.** Admissions must leave `watermark_blocks` free (cached-free counts as free);
//!   appends and forks may use the reserve.
//! - **Provisional tokens.** The last `provisional` tokens of a sequence are not final: they have
//!   slots and table entries but no token ids or hashes, so they never reach the prefix cache;
//!   `commit` makes some final and drops the rest (see `provisional`).
//! - Every error leaves the manager unchanged: operations validate fully before touching state.
//!
//! The manager is one type whose methods live in several files, one per concern, so that each
//! can be read beside the rules it keeps: [`ManagerConfig`] and its checks in `config`;
//! admissions and the prefix-cache lookup in `admit`; appends, forks and frees in `append`;
//! swap, recompute and victim choice in `reclaim`; the step and its copy and swap lists in
//! `build_step`; provisional tokens (`append_provisional`, `commit`, `rewind`) in `provisional`;
//! the full consistency check in `invariants`. This file holds the state they
//! share, the read-only queries and stats, and the helpers through which they all allocate,
//! release and park blocks.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::events::{KvEvent, KvEventRing, Medium};
use crate::groups::{group_unhash, AttentionKind};
use crate::hash::{random_key, root_hash, Hasher, SeqKeys};
use crate::metrics::{hist_bucket, Counters, Stats, HIST_BUCKETS};
use crate::pool::BlockPool;
use crate::prefix::{FastMap, PrefixCache};
use crate::step::StepCache;
use crate::swap::{CostModel, HostBlockId, HostPool, SeqState};
use crate::table::BlockTable;
use crate::tier::HostTier;
use crate::{BlockId, SeqId, TokenId};

mod admit;
mod append;
mod build_step;
mod config;
mod groups;
mod invariants;
mod provisional;
mod reclaim;
mod tier;

pub use config::{ManagerConfig, MAX_GROUPS};

/// An extra group's block an admission loads from the host tier: `(group, block index, host
/// block)`.
pub(super) type GroupLoad = (usize, usize, HostBlockId);

/// Outcome of an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitResult {
    /// Prompt tokens whose KV is already cached (a multiple of B, at most `len - 1`): the engine
    /// computes tokens `[cached_tokens, len)`.
    pub cached_tokens: u32,
    /// Of `cached_tokens`, those found on the device (shared blocks).
    pub cached_tokens_gpu: u32,
    /// Of `cached_tokens`, those the host tier adds to what the device alone holds: loaded by
    /// the next step's swap-in list into blocks allocated for them, not computed. With KV cache
    /// groups: the tokens past the longest boundary the device alone completes.
    pub cached_tokens_host: u32,
    /// Blocks allocated for this admission (not shared from the cache), loads included, summed
    /// over the KV cache groups (`num_blocks - hits` per group).
    pub new_blocks: u32,
    /// Blocks in the sequence's table, `ceil(num_tokens / B)` (every group's table has this length).
    pub num_blocks: u32,
    /// Tokens the sequence holds after admission: `cached_tokens + min(max_new_tokens, len -
    /// cached_tokens)`, the whole prompt when no `max_new_tokens` was given. The engine computes
    /// `[cached_tokens, num_tokens)` in the first step and appends the rest of the prompt later.
    pub num_tokens: u32,
}

/// One admission of [`BlockManager::admit_batch`].
#[derive(Debug, Clone, Copy)]
pub struct AdmitRequest<'a> {
    /// A new sequence id.
    pub seq: SeqId,
    /// The whole prompt (the prefix-cache lookup covers all of it).
    pub tokens: &'a [TokenId],
    /// Hashing keys (salt, adapter, multimodal inputs, extra bytes); `None` for none.
    pub keys: Option<&'a SeqKeys>,
    /// Hold at most this many tokens past the cached prefix (chunked prefill); `None`: all.
    pub max_new_tokens: Option<usize>,
}

impl<'a> AdmitRequest<'a> {
    /// A request holding the whole prompt, with no keys.
    pub fn new(seq: SeqId, tokens: &'a [TokenId]) -> Self {
        Self {
            seq,
            tokens,
            keys: None,
            max_new_tokens: None,
        }
    }
}

/// The block table of one extra KV cache group (group `g >= 1`) of a sequence. Its length and
/// token count are those of the group-0 table; entries `[0, start)` are
/// [`NULL_BLOCK`](crate::groups::NULL_BLOCK) (released or never needed), the rest are owned.
#[derive(Debug, Clone, Default)]
struct GroupTable {
    blocks: Vec<BlockId>,
    /// Leading null entries.
    start: usize,
    /// Bumped whenever an entry is replaced in place (a release, copy-on-write of the tail).
    version: u64,
}

/// Per-sequence state, kept in a slab so batch calls index it directly after one lookup.
#[derive(Debug, Clone, Default)]
struct Seq {
    table: BlockTable,
    /// Token ids (prefix caching only).
    tokens: Vec<TokenId>,
    /// Chained hashes of the first `hashes.len()` full blocks (prefix caching only).
    hashes: Vec<u128>,
    /// Blocks `[0, registered)` have been offered to the prefix cache.
    registered: usize,
    /// `h_{-1}` for this sequence's salt.
    root: u128,
    /// Keys adding extra records to block hashes; `None` when there are none.
    keys: Option<Arc<SeqKeys>>,
    /// The tail block may be shared (set by fork); cleared once seen unshared.
    tail_maybe_shared: bool,
    /// Epoch of the last batch call that visited this sequence (duplicate detection).
    mark: u64,
    /// Identity of this sequence for the manager's whole life: fresh on admit and fork, never
    /// reused, so a step-cache row mark cannot match a later sequence in the same slot or id.
    uid: u64,
    /// Bumped whenever an existing entry of `table.blocks` is replaced in place (copy-on-write of
    /// the tail, a swap). Growth by push does not bump it: entries already written stay valid.
    version: u64,
    /// Running, swapped out (the table holds host block ids) or preempted by recompute (no blocks).
    state: SeqState,
    /// Admission order (victims are taken from the highest); a forked child inherits its parent's,
    /// and a swap or recompute keeps it.
    order: u64,
    /// Fork group: the uid of the admission the sequence descends from.
    group: u64,
    /// `cache_epoch` when it was swapped out: its hashes are re-registered on swap-in only if the
    /// prefix cache was not reset since.
    swap_epoch: u64,
    /// Tables of groups `1..G` (empty for a one-group manager).
    extra: Vec<GroupTable>,
    /// Leading null entries of group 0's table (released or never needed): 0 unless group 0 is
    /// windowed (a model whose every layer slides or is chunked).
    start0: usize,
    /// The first position from which a step releases another block of some windowed group
    /// (`usize::MAX` when none can): a step compares instead of dividing.
    next_release: usize,
    /// Blocks of the prompt's prefix that group 0 already had cached when the sequence was
    /// admitted (before the other groups shortened the hit): a prefix other requests share.
    /// A windowed block released mid-run inside it keeps its recency in the LRU while another
    /// running sequence holds group 0's block at its position; the others go to the LRU's
    /// evicting end (see `release_dead`).
    shared_prefix: usize,
    /// How many admissions (this one included) found group 0's cached run ending at the same
    /// cached block as this one's `shared_prefix` did: 2 or more, and the window ending at
    /// `shared_prefix` is one several requests reach (a shared document), so the sequence holds
    /// its blocks when it steps past them (`held`; see `release_dead`).
    shared_reach: u8,
    /// Windowed blocks released from this sequence's tables but still referenced by it: the
    /// window ending at an in-demand shared prefix (`shared_reach >= 2`), held while the sequence
    /// runs so that the next request reading that prefix finds it (see `release_dead`). Dropped
    /// (into the LRU as its newest entries) when the sequence is freed, preempted or swapped out.
    held: Vec<BlockId>,
    /// Provisional tokens: the last `provisional` of `table.num_tokens` are not final (no token
    /// ids kept, never hashed); `commit` settles them.
    provisional: usize,
    /// The length at the last step that scheduled this sequence while it held provisional tokens
    /// (prefix caching only): `commit` registers the full blocks that step was built to write.
    stepped: usize,
}

/// The block manager. See the module documentation for the rules it keeps.
#[derive(Debug)]
pub struct BlockManager {
    cfg: ManagerConfig,
    bs: usize,
    caching: bool,
    pool: BlockPool,
    prefix: PrefixCache,
    index: FastMap<SeqId, u32>,
    slots: Vec<Seq>,
    free_slots: Vec<u32>,
    /// Copy-on-write copies not yet emitted by a step.
    pending: Vec<(BlockId, BlockId)>,
    /// Refcount-0 blocks held back because they are the `src` of a pending copy.
    deferred: Vec<BlockId>,
    counters: Counters,
    shared_blocks: u64,
    used_tokens: u64,
    epoch: u64,
    /// The prefix-hash key in use (`cfg.hash_seed` or one drawn from the OS).
    hash_key: u64,
    empty_root: u128,
    hasher: Hasher,
    /// Bumped whenever the set of sequences changes (admit, fork, free).
    gen: u64,
    /// The last batch resolved by `resolve_batch`, its slots, and the `gen` it is valid for.
    batch_ids: Vec<SeqId>,
    batch_idx: Vec<u32>,
    batch_gen: u64,
    scratch_hashes: Vec<u128>,
    scratch_hits: Vec<BlockId>,
    scratch_host_hits: Vec<HostBlockId>,
    /// Extra groups' blocks an admission loads from the host tier: `(group, block index, host)`.
    scratch_group_loads: Vec<GroupLoad>,
    /// Last uid handed out (uids start at 1; 0 marks a row as unknown).
    last_uid: u64,
    /// What `build_step` last wrote into the block-table buffer it last wrote.
    step_cache: StepCache,
    /// Slots of the step's batch with full blocks not yet offered to the prefix cache.
    scratch_register: Vec<u32>,
    /// The host block pool.
    host: HostPool,
    /// Swap-out copies `(device, host)` not yet emitted by a step.
    swap_out_q: Vec<(BlockId, HostBlockId)>,
    /// Swap-in copies `(host, device)` not yet emitted by a step; each holds a host reference.
    swap_in_q: Vec<(HostBlockId, BlockId)>,
    /// Last admission order handed out.
    last_order: u64,
    /// Bumped by `reset_prefix_cache`.
    cache_epoch: u64,
    /// The KV-event ring (disabled, and empty, unless `kv_event_capacity > 0`).
    events: KvEventRing,
    /// The host tier's index (`host_cache` only).
    tier: Option<HostTier>,
    /// The cost model of the host tier's load-or-recompute choice.
    host_cost: Option<CostModel>,
    /// Attention kind of group 0: `Full` unless every group is windowed.
    kind0: AttentionKind,
    /// Attention kinds of groups `1..G` (empty for a one-group manager).
    kinds: Vec<AttentionKind>,
    /// Some group releases blocks (sliding or chunked).
    windowed: bool,
    /// What `build_step` last wrote into each extra group's block-table buffer.
    group_caches: Vec<StepCache>,
    /// With more than one group, per block: in the low byte, the group it was last registered in
    /// the prefix cache for (read when its hash is dropped, to name the group and chain hash in
    /// the removal event); in the high byte, for a group-0 block, how many admissions found
    /// group 0's cached run ending at it since it was registered (saturating; see
    /// `Seq::shared_reach`). Empty for a one-group manager, whose blocks are all group 0's.
    block_group: Vec<u16>,
}

impl BlockManager {
    /// A manager over a fresh pool; `InvalidConfig` if `cfg` does not validate,
    /// `AllocationFailed` (naming the array and its bytes) if the host cannot hold the pool's or
    /// the prefix cache's arrays.
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        let hash_key = match cfg.hash_seed {
            Some(k) => k,
            None => random_key()?,
        };
        // The prefix cache first: its arrays are the largest, and mostly committed lazily, so a
        // pool too large for the host fails before the pool's arrays are written.
        let prefix = PrefixCache::try_new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching && cfg.verify_prefix,
            cfg.enable_prefix_caching,
        )?;
        let pool = BlockPool::new(cfg.num_blocks)?;
        let host = HostPool::new(cfg.num_host_blocks)?;
        let events = KvEventRing::new(cfg.kv_event_capacity, cfg.block_size)?;
        let block_group = if cfg.groups.len() > 1 {
            crate::error::alloc::filled_vec(cfg.num_blocks as usize, 0u16, "block groups")?
        } else {
            Vec::new()
        };
        let tier = if cfg.host_cache {
            Some(HostTier::new(
                cfg.num_host_blocks,
                cfg.num_blocks,
                cfg.block_size,
            )?)
        } else {
            None
        };
        Ok(Self {
            bs: cfg.block_size as usize,
            caching: cfg.enable_prefix_caching,
            pool,
            prefix,
            index: FastMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            pending: Vec::new(),
            deferred: Vec::new(),
            counters: Counters::default(),
            shared_blocks: 0,
            used_tokens: 0,
            epoch: 0,
            hash_key,
            empty_root: root_hash(hash_key, &[]),
            hasher: Hasher::new(hash_key),
            gen: 0,
            batch_ids: Vec::new(),
            batch_idx: Vec::new(),
            batch_gen: u64::MAX,
            scratch_hashes: Vec::new(),
            scratch_hits: Vec::new(),
            scratch_host_hits: Vec::new(),
            scratch_group_loads: Vec::new(),
            last_uid: 0,
            step_cache: StepCache::default(),
            scratch_register: Vec::new(),
            host,
            swap_out_q: Vec::new(),
            swap_in_q: Vec::new(),
            last_order: 0,
            cache_epoch: 0,
            events,
            tier,
            host_cost: None,
            kind0: cfg.groups.first().copied().unwrap_or(AttentionKind::Full),
            kinds: cfg.groups.iter().skip(1).copied().collect(),
            windowed: cfg.groups.iter().any(|k| k.is_windowed()),
            group_caches: vec![StepCache::default(); cfg.groups.len().saturating_sub(1)],
            block_group,
            cfg,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    fn take_slot(&mut self) -> u32 {
        match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Seq::default());
                (self.slots.len() - 1) as u32
            }
        }
    }

    #[inline]
    fn slot_of(&self, seq: SeqId) -> Result<usize> {
        self.index
            .get(&seq)
            .map(|&s| s as usize)
            .ok_or(Error::UnknownSequence { seq_id: seq })
    }

    /// Walks a batch of ids in order: each must be live (`UnknownSequence`) and appear once
    /// (`InvalidArgument`); then `visit(id, slot, seq)` may refuse it (for its state, say). Stops
    /// at the first error. A repeat is found by stamping each visited sequence with a number
    /// fresh for this call, not with a set: O(batch) with no allocation or hashing, and the
    /// stamps of a refused call cannot match any later one.
    #[inline]
    fn for_each_distinct(
        &mut self,
        seqs: &[SeqId],
        mut visit: impl FnMut(SeqId, usize, &Seq) -> Result<()>,
    ) -> Result<()> {
        self.epoch += 1;
        let epoch = self.epoch;
        for &id in seqs {
            let i = self.slot_of(id)?;
            let s = &mut self.slots[i];
            if s.mark == epoch {
                return Err(Error::InvalidArgument {
                    what: "seqs",
                    value: id as i64,
                    reason: "sequence id appears twice in one batch".into(),
                });
            }
            s.mark = epoch;
            visit(id, i, s)?;
        }
        Ok(())
    }

    /// Allocates one block: the free list first, then the oldest cached-free block.
    #[inline]
    fn alloc_block(&mut self) -> Result<BlockId> {
        match self.pool.allocate_mut() {
            Ok(b) => Ok(b),
            Err(_) => self.evict_block(),
        }
    }

    /// Drops one reference to `b`, parking it (free list, LRU or deferred) when none remain.
    #[inline]
    fn drop_ref(&mut self, b: BlockId) -> Result<()> {
        if self.pending.is_empty() && self.swap_in_q.is_empty() && self.prefix.hash_of(b).is_none()
        {
            // Not cached and no copy in flight: the pool decrements and releases in one step
            // (one pool update per block on the free path instead of two).
            if !self.pool.free_mut(b)? && self.pool.refcount(b)? == 1 {
                self.shared_blocks -= 1;
            }
            return Ok(());
        }
        match self.pool.decref_mut(b)? {
            0 => self.unreferenced(b),
            1 => {
                self.shared_blocks -= 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn unreferenced(&mut self, b: BlockId) -> Result<()> {
        if !self.pending.is_empty() {
            if let Some(pos) = self.pending.iter().position(|&(_, d)| d == b) {
                // Nobody will read this dst: the copy is moot. Its src may have been held only for it.
                let (src, _) = self.pending.remove(pos);
                if !self.pending.iter().any(|&(s, _)| s == src) {
                    if let Some(dpos) = self.deferred.iter().position(|&x| x == src) {
                        self.deferred.swap_remove(dpos);
                        self.park(src)?;
                    }
                }
            }
            if self.pending.iter().any(|&(s, _)| s == b) {
                self.deferred.push(b);
                return Ok(());
            }
        }
        self.park(b)
    }

    /// Puts a refcount-0 block where it belongs: the LRU if hashed, else the free list.
    #[inline]
    fn park(&mut self, b: BlockId) -> Result<()> {
        if !self.swap_in_q.is_empty() {
            if let Some(pos) = self.swap_in_q.iter().position(|&(_, d)| d == b) {
                // Nobody will read this swap-in destination (no holder, no pending copy from it):
                // the copy is moot, and its host block loses the reference the queued copy held.
                // The block never received its content, so it must not stay findable under the
                // hash `swap_in` gave it.
                let (h, _) = self.swap_in_q.remove(pos);
                if let Some(hash) = self.prefix.hash_of(b) {
                    self.gpu_removed(b, hash);
                }
                self.prefix.unregister(b);
                self.host_drop(h)?;
            }
        }
        if self.prefix.hash_of(b).is_some() {
            // A block already in the LRU reaching refcount 0 again is a double release: linking
            // it twice would make a cycle and evict it twice, so refuse rather than corrupt.
            if self.prefix.lru_push(b) {
                Ok(())
            } else {
                Err(Error::InvariantViolation(format!(
                    "block {b} released while already cached-free (in the LRU)"
                )))
            }
        } else {
            self.pool.release_mut(b)
        }
    }

    /// Drops one reference to host block `h`, releasing it at zero (and forgetting a queued
    /// swap-out into it: nobody will read it).
    fn host_drop(&mut self, h: HostBlockId) -> Result<()> {
        if self.host.decref(h)? == 0 {
            if let Some(t) = self.tier.as_mut() {
                if t.is_indexed(h) {
                    // Host-cached and unreferenced: it stays findable, evictable from the LRU.
                    return t.lru.push_back(h).map_err(|_| {
                        Error::InvariantViolation(format!(
                            "host block {h} released while already in the host LRU"
                        ))
                    });
                }
            }
            if let Some(pos) = self.swap_out_q.iter().position(|&(_, x)| x == h) {
                self.swap_out_q.remove(pos);
            }
            self.host.release(h);
        }
        Ok(())
    }

    /// Drops every reference `slot`'s tables hold, last block first — device blocks while it
    /// runs, host blocks while it is swapped out (a recompute-preempted table is empty) — and
    /// empties the tables, keeping their allocations; a running sequence's tokens leave
    /// `used_tokens`. Every block is released even when one fails; the last error is returned.
    ///
    /// With KV cache groups the groups are interleaved by position, from the tail: position
    /// `j`'s blocks of the other groups, then group 0's. Cached-free blocks are evicted in the
    /// order they are released, so the cache loses one whole boundary at a time (boundary `j + 1`
    /// needs group 0's block `j`, and a windowed group's block `j` serves only boundaries past
    /// `j`): a windowed group's block is never kept after the group-0 block every boundary it
    /// serves needs.
    fn release_table(&mut self, slot: usize) -> Result<()> {
        let mut result = Ok(());
        let blocks = std::mem::take(&mut self.slots[slot].table.blocks);
        let mut extra = std::mem::take(&mut self.slots[slot].extra);
        let state = self.slots[slot].state;
        let start0 = std::mem::take(&mut self.slots[slot].start0);
        for (j, &b) in blocks.iter().enumerate().rev() {
            for t in &extra {
                if j >= t.start {
                    let r = if state == SeqState::Running {
                        self.drop_ref(t.blocks[j])
                    } else {
                        self.host_drop(t.blocks[j])
                    };
                    if let Err(e) = r {
                        result = Err(e);
                    }
                }
            }
            if j < start0 {
                continue;
            }
            let r = if state == SeqState::Running {
                self.drop_ref(b)
            } else {
                self.host_drop(b)
            };
            if let Err(e) = r {
                result = Err(e);
            }
        }
        for t in &mut extra {
            t.blocks.clear();
            t.start = 0;
            t.version += 1;
        }
        // The held windows last: the newest entries, evicted after the sequence's own history.
        if let Err(e) = self.drop_held(slot) {
            result = Err(e);
        }
        let s = &mut self.slots[slot];
        s.extra = extra;
        s.table.blocks = blocks;
        s.table.blocks.clear();
        if state == SeqState::Running {
            self.used_tokens -= s.table.num_tokens as u64;
        }
        result
    }

    /// Drops `slot`'s held windows (`Seq::held`) into the LRU as its newest entries. Every block
    /// is dropped even when one fails; the last error is returned.
    pub(super) fn drop_held(&mut self, slot: usize) -> Result<()> {
        let mut result = Ok(());
        let mut held = std::mem::take(&mut self.slots[slot].held);
        for &b in &held {
            if let Err(e) = self.drop_ref(b) {
                result = Err(e);
            }
        }
        held.clear();
        self.slots[slot].held = held; // keeps its capacity for the slot's next sequence
        result
    }

    /// A sequence's state.
    pub fn seq_state(&self, seq: SeqId) -> Result<SeqState> {
        Ok(self.slots[self.slot_of(seq)?].state)
    }

    /// Swap-out copies `(device, host)` queued for the next steps.
    pub fn pending_swap_out(&self) -> &[(BlockId, HostBlockId)] {
        &self.swap_out_q
    }

    /// Swap-in copies `(host, device)` queued for the next steps.
    pub fn pending_swap_in(&self) -> &[(HostBlockId, BlockId)] {
        &self.swap_in_q
    }

    /// Free blocks of the host pool.
    pub fn num_free_host_blocks(&self) -> usize {
        self.host.num_free()
    }

    /// Reference count of host block `h` (`InvalidBlock` outside the host pool).
    pub fn host_block_refcount(&self, h: HostBlockId) -> Result<u32> {
        self.host.refcount(h)
    }

    /// Whether `seq` is a live sequence.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.index.contains_key(&seq)
    }

    /// Tokens `seq` holds; `UnknownSequence` if it is not live.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.slots[self.slot_of(seq)?].table.num_tokens)
    }

    /// Physical blocks of `seq`, in logical order; `UnknownSequence` if it is not live.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.slots[self.slot_of(seq)?].table.blocks)
    }

    /// The live sequence ids, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.index.keys().copied()
    }

    /// Live sequences.
    pub fn num_seqs(&self) -> usize {
        self.index.len()
    }

    /// Blocks available to allocations: free plus cached-free (evictable).
    #[inline]
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free() + self.prefix.lru_len()
    }

    /// Reference count of block `b` (`InvalidBlock` outside the pool).
    pub fn block_refcount(&self, b: BlockId) -> Result<u32> {
        self.pool.refcount(b)
    }

    /// Copy-on-write copies queued for the next step, as `(src, dst)`.
    pub fn pending_copies(&self) -> &[(BlockId, BlockId)] {
        &self.pending
    }

    /// The prefix hash block `b` is cached under, if any.
    pub fn block_hash(&self, b: BlockId) -> Option<u128> {
        if (b as usize) < self.cfg.num_blocks as usize {
            self.prefix.hash_of(b)
        } else {
            None
        }
    }

    /// [`crate::prefix::probe_cost`] of the sequence-id index and of the prefix-hash map, each
    /// under its own hasher: about 1 group per key unless the keys cluster. For tests and
    /// diagnostics (O(sequences + hashed blocks)).
    pub fn map_probe_costs(&self) -> (f64, f64) {
        (
            crate::prefix::probe_cost(self.index.hasher(), self.index.keys()),
            self.prefix.map_probe_cost(),
        )
    }

    /// Test hook: evicts cached-free block `b` now, whatever its place in the LRU (it loses its
    /// hash and goes to the free list). Returns false if `b` is not cached-free.
    #[doc(hidden)]
    pub fn debug_evict_block(&mut self, b: BlockId) -> bool {
        if (b as usize) >= self.cfg.num_blocks as usize || !self.prefix.in_lru(b) {
            return false;
        }
        self.prefix.lru_remove(b);
        if let Some(h) = self.prefix.hash_of(b) {
            self.gpu_removed(b, h);
        }
        self.prefix.unregister(b);
        self.counters.evictions += 1;
        self.pool.release_mut(b).is_ok()
    }

    /// Test hook: re-labels hashed block `b` with `hash`, forging a hash collision (the block keeps
    /// its token ids). Returns false if `b` is not hashed or `hash` is taken.
    #[doc(hidden)]
    pub fn debug_relabel_block(&mut self, b: BlockId, hash: u128) -> bool {
        (b as usize) < self.cfg.num_blocks as usize && self.prefix.relabel(b, hash)
    }

    /// Moves the recorded KV events into `out`, oldest first, coalescing runs (see
    /// [`crate::events`]); returns how many were appended. Nothing when the ring is disabled.
    pub fn drain_events(&mut self, out: &mut Vec<KvEvent>) -> usize {
        self.events.drain(out)
    }

    /// KV-event records dropped because the ring was full (the oldest go first).
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped()
    }

    /// Records that device block `b`, cached under prefix-cache key `key`, loses its hash: a
    /// `Removed` event for the block's group and its chain hash (the key with the group's mix
    /// undone). No-op when the ring is disabled.
    #[inline]
    pub(super) fn gpu_removed(&mut self, b: BlockId, key: u128) {
        if !self.events.enabled() {
            return;
        }
        let g = registered_group(&self.block_group, b);
        self.events
            .removed_in(Medium::Gpu, g as u32, group_unhash(key, g));
    }

    /// Notes that device block `b` was registered in the prefix cache for group `g` (only kept
    /// with more than one group).
    #[inline]
    pub(super) fn note_block_group(block_group: &mut [u16], b: BlockId, g: usize) {
        if let Some(slot) = block_group.get_mut(b as usize) {
            *slot = g as u16; // a new registration: its reach count starts at 0
        }
    }

    /// Counts one more admission whose group-0 cached run ends at hashed block `b` (see
    /// `Seq::shared_reach`); the count
    /// (0 for a one-group manager).
    pub(super) fn note_reach(&mut self, b: BlockId) -> u8 {
        match self.block_group.get_mut(b as usize) {
            Some(x) => {
                let r = ((*x >> 8) as u8).saturating_add(1);
                *x = (*x & 0xFF) | (u16::from(r) << 8);
                r
            }
            None => 0,
        }
    }

    /// The group and chain hash of hashed device block `b` (`None` when `b` is not in the prefix
    /// cache or outside the pool): what its `Stored` event named.
    pub fn block_key(&self, b: BlockId) -> Option<(usize, u128)> {
        if (b as usize) >= self.cfg.num_blocks as usize {
            return None;
        }
        let key = self.prefix.hash_of(b)?;
        let g = registered_group(&self.block_group, b);
        Some((g, group_unhash(key, g)))
    }

    /// `(group, chain hash)` of every block the device prefix cache holds (held or cached-free),
    /// sorted: the state the device tier's `Stored` / `Removed` events add up to (see
    /// [`crate::events`]). O(hashed blocks), for tests and diagnostics.
    pub fn cached_block_keys(&self) -> Vec<(usize, u128)> {
        let mut out: Vec<(usize, u128)> = self
            .prefix
            .entries()
            .filter_map(|(_, b)| self.block_key(b))
            .collect();
        out.sort_unstable();
        out
    }

    /// A snapshot of sizes and counters. O(number of sequences) for the histogram.
    pub fn stats(&self) -> Stats {
        let nbk = self.cfg.num_blocks as u64;
        let free = self.pool.num_free() as u64;
        let cached = self.prefix.lru_len() as u64;
        let used = nbk - free - cached;
        let mut hist = [0u64; HIST_BUCKETS];
        let mut swapped = 0u64;
        for &i in self.index.values() {
            let s = &self.slots[i as usize];
            match s.state {
                SeqState::Running => hist[hist_bucket(s.table.blocks.len())] += 1,
                SeqState::Swapped => swapped += 1,
                SeqState::Recompute => {}
            }
        }
        let c = &self.counters;
        Stats {
            num_blocks: nbk,
            block_size: self.bs as u64,
            free_blocks: free,
            cached_free_blocks: cached,
            used_blocks: used,
            num_seqs: self.index.len() as u64,
            used_tokens: self.used_tokens,
            kv_utilization: self.used_tokens as f64 / (nbk as f64 * self.bs as f64),
            allocated_token_slots: used * self.bs as u64,
            prefix_query_tokens: c.prefix_query_tokens,
            prefix_hit_tokens: c.prefix_hit_tokens,
            prefix_hit_ratio: if c.prefix_query_tokens == 0 {
                0.0
            } else {
                c.prefix_hit_tokens as f64 / c.prefix_query_tokens as f64
            },
            evictions: c.evictions,
            prefix_collisions: c.prefix_collisions,
            shared_blocks: self.shared_blocks,
            cow_copies: c.cow_copies,
            preemptions: c.preemptions_swap + c.preemptions_recompute,
            preemptions_swap: c.preemptions_swap,
            preemptions_recompute: c.preemptions_recompute,
            swapped_out_blocks: c.swapped_out_blocks,
            swapped_in_blocks: c.swapped_in_blocks,
            host_hit_tokens: c.host_hit_tokens,
            host_loaded_blocks: c.host_loaded_blocks,
            offloaded_blocks: c.offloaded_blocks,
            demotions: c.demotions,
            host_cached_blocks: self.tier.as_ref().map_or(0, |t| t.num_indexed() as u64),
            num_host_blocks: self.host.num_blocks() as u64,
            host_free_blocks: self.host.num_free() as u64,
            swapped_seqs: swapped,
            kv_cache_usage: used as f64 / nbk as f64,
            blocks_per_seq: hist,
        }
    }
}

/// The error for a call that needs a running sequence.
#[cold]
fn not_running(seq_id: SeqId, state: SeqState) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: state.name(),
        expected: "running",
    }
}

/// The error for a call that needs a sequence without provisional tokens (`append`, `fork`).
#[cold]
fn holds_provisional(seq_id: SeqId) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: "holding provisional tokens",
        expected: "without provisional tokens (commit or rewind first)",
    }
}

/// The group device block `b` was last registered in the prefix cache for (the low byte of its
/// `block_group` word; 0 for a one-group manager).
#[inline]
pub(super) fn registered_group(block_group: &[u16], b: BlockId) -> usize {
    block_group
        .get(b as usize)
        .map_or(0, |&g| (g & 0xFF) as usize)
}
