//! KV cache groups in the manager: the tables of groups `1..G` beside each sequence's group-0
//! table, their growth, copy-on-write, release of dead blocks, and the prefix-hit boundary.
//!
//! Invariants kept here (see [`crate::groups`] for the arithmetic):
//! - Every group's table has the group-0 table's length, `ceil(num_tokens / B)`. Growth,
//!   copy-on-write, forks and frees act on all groups at once; an operation that needs blocks
//!   counts every group's before it takes any.
//! - A group's table is `[NULL_BLOCK; start] ++ owned blocks`. `start` only grows while the
//!   sequence lives: `build_step` releases the blocks dead for its first computed position `c`
//!   (`dead_blocks(kind, c, B)`), so `start * B <= first_needed(num_tokens - 1)`. The tail is
//!   never null. Full groups keep `start == 0`.
//! - A block's refcount counts its entries in every group's table of every sequence. A released
//!   block goes through the same `drop_ref` as a freed one: hashed, it enters the cached-free
//!   LRU; unhashed, the free list (or waits as a pending copy's source).
//! - Group 0 is `Full` unless every group is windowed (a model whose every layer slides or is
//!   chunked). A windowed group 0 keeps `Seq::start0` leading null entries and releases like the
//!   others (`release_dead0`); its hit is checked like theirs (its hits need not be a leading
//!   run), and no host tier is kept for it.
//! - The prefix cache keys group `g`'s full block `j` by `group_hash(h_j, g)`, `h_j` the chained
//!   hash of the sequence's first `j + 1` blocks (group 0's key is `h_j` itself). An admission's
//!   hit is the longest boundary `k` (blocks) at which group 0 has blocks `[0, k)` cached and
//!   every other group `g` has `[dead_blocks(kind_g, k * B, B), k)` cached: exactly the blocks
//!   the first computed position `k * B` and every later one read. The blocks before that range
//!   enter the group's table as null entries.
//! - Eviction policy: cached-free blocks are evicted oldest first, and a freed sequence releases
//!   its blocks by position from the tail, each position's other-group blocks before group 0's
//!   (`release_table`). A hit at boundary `k` needs group 0's `[0, k)`, so once group 0's block
//!   `j` is gone no boundary past `j` can be completed, and a windowed group's block `i >= j`,
//!   which serves only boundaries past `i`, can complete none: it is released, hence evicted,
//!   before group 0's block `j`. The cache thus loses whole boundaries from the top, one at a time,
//!   instead of all of a sliding group's blocks before any of group 0's (which would leave group 0
//!   cached and every hit gone).
//! - Blocks a windowed group releases mid-run serve only boundaries inside the sequence's history.
//!   A block released at position `j` keeps its recency (enters the LRU as its newest entry,
//!   like any freed block) only while another running sequence shares that position: `j` lies
//!   inside the prefix group 0 already had cached at admission (`Seq::shared_prefix`) and group
//!   0's block `j` has a refcount above 1 (a system prompt or document other requests are
//!   reading now; the next request sharing it needs that window). Every other released block
//!   goes to the LRU's evicting end, before any idle history: past the shared prefix no other
//!   request has reached its boundaries, and inside a prefix nobody else holds (a chat session's
//!   own earlier turns, readmitted) it only serves a later turn of the same session, whose hit
//!   rests on the last window anyway. Otherwise every running sequence would push its dead
//!   windows in as the newest entries and evict the idle sessions' histories first.
//! - A prefix read by one request after another (a document longer than the window, with no two
//!   requests on it at once) is told apart from a session's own history by how many admissions
//!   found group 0's cached run ending at the same cached block (`note_reach`, counted in the
//!   high byte of `block_group` and reset when the block is registered again): a session's
//!   history top is reached once, by its next turn; a shared prefix's end by every request that
//!   reads it. From the second such admission on (`Seq::shared_reach >= 2`) the sequence does
//!   not let go of the blocks of the window ending at the shared prefix when it steps past
//!   them: they leave its table (the kernels never read them again) but stay referenced in
//!   `Seq::held` until it is freed, preempted or swapped out, and then enter the LRU as its
//!   newest entries. The window of a prefix in demand thus stays on the device while any
//!   request reading it runs, as a full-attention prefix does, and every request sharing it
//!   shares the same held blocks (a hit pins them). Without this, the first request's windows
//!   went to the evicting end, every later request found group 0's run but not the window,
//!   recomputed, and released its windows the same way: the prefix never hit again (a
//!   Gemma-3-27B-shaped simulation with 8 shared 1,536-token documents: 3.0% of prompt tokens
//!   hit against 19.9% counted as full attention; 22.2% with this rule). An admission whose
//!   hit stops short of group 0's cached run also makes that run's cached blocks the most
//!   recent (its own recomputed copies are unhashed duplicates, and the cached run must outlive
//!   them for its window to complete it).
//! - Swap moves every group's held blocks to the host and back, released entries staying null
//!   (see `reclaim`).
//! - The host tier keys each group's blocks as the device does (`group_hash(h_j, g)`), and the hit
//!   rule above spans both tiers: each needed block is on the device (shared) or in the host
//!   tier (loaded into a fresh block: `group_plan`, `load_extra`); the load-or-recompute rule
//!   weighs the boundary the host adds past the device-only one (`lookup_root`).
//! - KV events name each block's group: a registration in group `g` records `Stored` for
//!   `(h_j, g)`, and a hash dropped from block `b` records `Removed` for the group `b` was last
//!   registered in (`block_group`) and the key with that group's mix undone (`group_unhash`), so
//!   a windowed group's block released mid-run and evicted later is removed as `(h_j, g)`.

use super::tier::{offload, registered};
use super::{BlockManager, GroupLoad, GroupTable, Seq};
use crate::error::{Error, Result};
use crate::events::KvEventRing;
use crate::groups::{dead_blocks, group_hash, release_threshold, AttentionKind, NULL_BLOCK};
use crate::metrics::Counters;
use crate::pool::BlockPool;
use crate::prefix::PrefixCache;
use crate::step::{GroupStepBuffers, StepCache};
use crate::swap::{HostBlockId, HostPool};
use crate::tier::HostTier;
use crate::{BlockId, SeqId, TokenId};

impl BlockManager {
    /// Number of KV cache groups (1 for a manager configured without groups).
    #[inline]
    pub fn num_groups(&self) -> usize {
        1 + self.kinds.len()
    }

    /// The attention kind of group `g`; `InvalidArgument` for an unknown group.
    pub fn group_kind(&self, g: usize) -> Result<AttentionKind> {
        self.check_group(g)?;
        Ok(if g == 0 {
            self.kind0
        } else {
            self.kinds[g - 1]
        })
    }

    fn check_group(&self, g: usize) -> Result<()> {
        if g >= self.num_groups() {
            return Err(Error::InvalidArgument {
                what: "group",
                value: g as i64,
                reason: format!(
                    "unknown KV cache group: the manager has {} (valid: 0..{})",
                    self.num_groups(),
                    self.num_groups()
                ),
            });
        }
        Ok(())
    }

    /// A sequence's block table in group `g` (group 0 is [`BlockManager::block_table`]). Released
    /// positions hold [`NULL_BLOCK`]. `InvalidArgument` for an unknown group.
    pub fn block_table_group(&self, seq: SeqId, g: usize) -> Result<&[BlockId]> {
        self.check_group(g)?;
        let s = &self.slots[self.slot_of(seq)?];
        Ok(if g == 0 {
            &s.table.blocks
        } else {
            &s.extra[g - 1].blocks
        })
    }

    /// Blocks a sequence holds in all groups together (null entries not counted).
    pub fn seq_blocks_held(&self, seq: SeqId) -> Result<usize> {
        let s = &self.slots[self.slot_of(seq)?];
        Ok(s.table.blocks.len() - s.start0
            + s.held.len()
            + s.extra
                .iter()
                .map(|t| t.blocks.len() - t.start)
                .sum::<usize>())
    }

    /// Appends `count` fresh blocks to every extra group's table of `slot`. The caller has
    /// checked that enough blocks are available.
    pub(super) fn grow_extra(&mut self, slot: usize, count: usize) -> Result<()> {
        for g in 0..self.kinds.len() {
            for _ in 0..count {
                let b = self.alloc_block()?;
                self.slots[slot].extra[g].blocks.push(b);
            }
        }
        Ok(())
    }

    /// Extra groups whose partly filled tail is shared (so the next write copies it).
    pub(super) fn extra_shared_tails(pool: &BlockPool, s: &Seq, bs: usize) -> Result<usize> {
        if s.extra.is_empty() || s.table.num_tokens == s.table.blocks.len() * bs {
            return Ok(0);
        }
        let mut n = 0;
        for t in &s.extra {
            if let Some(&tail) = t.blocks.last() {
                n += (pool.refcount(tail)? > 1) as usize;
            }
        }
        Ok(n)
    }

    /// Copies every shared extra-group tail of `slot` (see `cow_tail`).
    pub(super) fn cow_extra(&mut self, slot: usize) -> Result<()> {
        for g in 0..self.slots[slot].extra.len() {
            let Some(&tail) = self.slots[slot].extra[g].blocks.last() else {
                continue;
            };
            if self.pool.refcount(tail)? <= 1 {
                continue;
            }
            let d = self.alloc_block()?;
            let t = &mut self.slots[slot].extra[g];
            let last = t.blocks.len() - 1;
            let src = std::mem::replace(&mut t.blocks[last], d);
            t.version += 1;
            self.queue_copy(src, d);
            self.drop_ref(src)?;
        }
        Ok(())
    }

    /// Queues the copy of `src` into the fresh block `d` (copying from the origin of a pending
    /// copy into `src`, so no block is both a dst and a src in one step).
    pub(super) fn queue_copy(&mut self, src: BlockId, d: BlockId) {
        let origin = self
            .pending
            .iter()
            .find(|&&(_, dst)| dst == src)
            .map_or(src, |&(s0, _)| s0);
        self.pending.push((origin, d));
        self.counters.cow_copies += 1;
    }

    /// Releases the blocks of `slot`'s windowed groups that no query at a position `>= c` reads,
    /// leaving null entries.
    pub(super) fn release_dead(&mut self, slot: usize, c: usize) -> Result<()> {
        let bs = self.bs;
        let mut result = Ok(());
        if self.kind0.is_windowed() {
            result = self.release_dead0(slot, c);
        }
        for g in 0..self.kinds.len() {
            let kind = self.kinds[g];
            if !kind.is_windowed() {
                continue;
            }
            let s = &self.slots[slot];
            let t = &s.extra[g];
            // Never the tail: a sequence's own last block is always read. With provisional
            // tokens, never the committed tail either: a rewind makes it the tail again.
            let tail = if s.provisional == 0 {
                t.blocks.len().saturating_sub(1)
            } else {
                (s.table.num_tokens - s.provisional).saturating_sub(1) / bs
            };
            let dead = dead_blocks(kind, c, bs).min(tail);
            if dead <= t.start {
                continue;
            }
            let shared = s.shared_prefix;
            let held = held_window(s, kind, bs);
            for j in t.start..dead {
                let b = std::mem::replace(&mut self.slots[slot].extra[g].blocks[j], NULL_BLOCK);
                if held.contains(&j) {
                    // The window ending where group 0's cached run ended for at least two
                    // admissions (a shared prefix read by one request after another): held,
                    // still referenced, until the sequence ends, for the next request reading it.
                    self.slots[slot].held.push(b);
                    continue;
                }
                // Group 0's block at `j` held by another running sequence too (a shared system
                // prompt or document being read right now): the next request sharing it needs
                // this window.
                let g0 = self.slots[slot].table.blocks[j];
                let live = j < shared && self.pool.refcount(g0).is_ok_and(|n| n > 1);
                if let Err(e) = self.drop_ref(b) {
                    result = Err(e);
                } else if !live {
                    // Past the shared prefix, or inside it with no other running sequence on
                    // group 0's block: it serves boundaries inside this sequence's own history
                    // (a session's earlier turns), which only a later turn of the same session
                    // reaches. First to go, before any idle history.
                    self.prefix.lru_to_front(b);
                }
            }
            let t = &mut self.slots[slot].extra[g];
            t.start = dead;
            t.version += 1;
        }
        self.set_next_release(slot);
        result
    }

    /// Releases the dead blocks of `slot`'s windowed group 0 (a model whose every group is
    /// windowed), as [`Self::release_dead`] does for the other groups. Group 0's block at `j`
    /// keeps its recency only while another running sequence holds it too (inside the shared
    /// prefix); the others go to the LRU's evicting end.
    fn release_dead0(&mut self, slot: usize, c: usize) -> Result<()> {
        let bs = self.bs;
        let s = &self.slots[slot];
        let tail = if s.provisional == 0 {
            s.table.blocks.len().saturating_sub(1)
        } else {
            (s.table.num_tokens - s.provisional).saturating_sub(1) / bs
        };
        let dead = dead_blocks(self.kind0, c, bs).min(tail);
        if dead <= s.start0 {
            return Ok(());
        }
        let (from, shared) = (s.start0, s.shared_prefix);
        let held = held_window(s, self.kind0, bs);
        let mut result = Ok(());
        for j in from..dead {
            let b = std::mem::replace(&mut self.slots[slot].table.blocks[j], NULL_BLOCK);
            if held.contains(&j) {
                self.slots[slot].held.push(b);
                continue;
            }
            let live = j < shared && self.pool.refcount(b).is_ok_and(|n| n > 1);
            if let Err(e) = self.drop_ref(b) {
                result = Err(e);
            } else if !live {
                self.prefix.lru_to_front(b);
            }
        }
        let s = &mut self.slots[slot];
        s.start0 = dead;
        s.version += 1;
        result
    }

    /// Recomputes `slot`'s `next_release` from its tables' null prefixes.
    pub(super) fn set_next_release(&mut self, slot: usize) {
        let bs = self.bs;
        let s = &mut self.slots[slot];
        s.next_release = self
            .kinds
            .iter()
            .zip(&s.extra)
            .map(|(&k, t)| release_threshold(k, t.start + 1, bs))
            .min()
            .unwrap_or(usize::MAX)
            .min(release_threshold(self.kind0, s.start0 + 1, bs));
    }

    /// Takes a reference to a prefix hit `b` (reviving it from the LRU if cached-free).
    pub(super) fn pin_hit(&mut self, b: BlockId) -> Result<()> {
        if self.prefix.in_lru(b) {
            self.prefix.lru_remove(b);
            self.pool.incref_mut(b)?;
        } else if self.pool.incref_mut(b)? == 2 {
            self.shared_blocks += 1;
        }
        Ok(())
    }

    /// Group `g`'s cached block for block index `i` of a prompt: present under
    /// `group_hash(hashes[i], g)` and, in verify mode, holding the same token ids.
    pub(super) fn group_hit(
        &self,
        g: usize,
        hashes: &[u128],
        tokens: &[TokenId],
        i: usize,
    ) -> Option<BlockId> {
        let bs = self.bs;
        let b = self.prefix.lookup(group_hash(hashes[i], g))?;
        self.prefix
            .matches(b, &tokens[i * bs..(i + 1) * bs])
            .then_some(b)
    }

    /// Group `g`'s (`g >= 1`) host-cached block for block index `i` of a prompt: indexed under
    /// `group_hash(hashes[i], g)` with the prompt's token ids (host tier off: `None`).
    fn group_host_hit(
        &self,
        g: usize,
        hashes: &[u128],
        tokens: &[TokenId],
        i: usize,
    ) -> Option<HostBlockId> {
        let t = self.tier.as_ref()?;
        let bs = self.bs;
        let h = t.lookup(group_hash(hashes[i], g))?;
        (t.tokens_of(h) == &tokens[i * bs..(i + 1) * bs]).then_some(h)
    }

    /// The longest prefix-hit boundary `k <= k0` (in blocks; group 0 has `[0, k0)` cached, on
    /// the device or, past its device hits, in the host tier) at which every extra group has
    /// the blocks it needs: on the device, or with `host` in the host tier too.
    pub(super) fn group_boundary(
        &self,
        tokens: &[TokenId],
        hashes: &[u128],
        k0: usize,
        host: bool,
    ) -> usize {
        if k0 == 0 {
            return 0;
        }
        let bs = self.bs;
        // A windowed group 0 is checked like the others (its hits are not a leading run).
        let first = if self.kind0.is_windowed() { 0 } else { 1 };
        // misses[g][i]: group g misses among its blocks [0, i).
        let mut misses: Vec<Vec<u32>> = Vec::with_capacity(self.num_groups());
        for g in first..self.num_groups() {
            let mut m = Vec::with_capacity(k0 + 1);
            m.push(0u32);
            for i in 0..k0 {
                let miss = self.group_hit(g, hashes, tokens, i).is_none()
                    && !(host && self.group_host_hit(g, hashes, tokens, i).is_some());
                m.push(m[i] + miss as u32);
            }
            misses.push(m);
        }
        let mut k = k0;
        while k > 0 {
            let kinds = std::iter::once(&self.kind0).skip(first);
            let ok = kinds.chain(&self.kinds).zip(&misses).all(|(&kind, m)| {
                let lo = dead_blocks(kind, k * bs, bs);
                m[k] == m[lo]
            });
            if ok {
                break;
            }
            k -= 1;
        }
        k
    }

    /// What the extra groups take at hit boundary `k` (found by [`Self::group_boundary`]): each
    /// needed block on the device is shared; each one that is not is loaded from the host tier
    /// (appended to `loads` as `(group, block index, host block)`). Returns how many of the
    /// shared blocks are cached-free (each takes a block off the free count when revived).
    pub(super) fn group_plan(
        &self,
        tokens: &[TokenId],
        hashes: &[u128],
        k: usize,
        loads: &mut Vec<GroupLoad>,
    ) -> usize {
        let bs = self.bs;
        let mut revive = 0;
        for (gi, &kind) in self.kinds.iter().enumerate() {
            for i in dead_blocks(kind, k * bs, bs)..k {
                if let Some(b) = self.group_hit(gi + 1, hashes, tokens, i) {
                    revive += self.prefix.in_lru(b) as usize;
                } else if let Some(h) = self.group_host_hit(gi + 1, hashes, tokens, i) {
                    loads.push((gi + 1, i, h));
                }
            }
        }
        revive
    }

    /// Starts the extra groups' tables of a sequence admitted at `slot` with `k` blocks hit:
    /// null entries before each group's needed range, then the hits, pinned; a block the
    /// admission loads from the host tier (in `loads`) is left null here and filled by the
    /// caller once it allocates. Called before any block is allocated for the admission, so an
    /// eviction cannot take a hit; the caller then grows every table to its length with
    /// `grow_extra`.
    pub(super) fn pin_extra(
        &mut self,
        slot: usize,
        tokens: &[TokenId],
        hashes: &[u128],
        k: usize,
        loads: &[GroupLoad],
    ) -> Result<()> {
        let bs = self.bs;
        let ng = self.kinds.len();
        let mut extra = std::mem::take(&mut self.slots[slot].extra);
        extra.resize_with(ng, GroupTable::default);
        let mut next = 0;
        for (gi, t) in extra.iter_mut().enumerate() {
            let lo = dead_blocks(self.kinds[gi], k * bs, bs);
            t.blocks.clear();
            t.blocks.resize(lo, NULL_BLOCK);
            t.start = lo;
            t.version += 1;
            for i in lo..k {
                if loads
                    .get(next)
                    .is_some_and(|&(g, j, _)| g == gi + 1 && j == i)
                {
                    next += 1;
                    t.blocks.push(NULL_BLOCK);
                    continue;
                }
                let b = self.group_hit(gi + 1, hashes, tokens, i).ok_or_else(|| {
                    Error::InvariantViolation(format!("group {} hit {i} vanished", gi + 1))
                })?;
                self.pin_hit(b)?;
                t.blocks.push(b);
            }
        }
        self.slots[slot].extra = extra;
        self.set_next_release(slot);
        Ok(())
    }

    /// Gives each extra-group block of `loads` (left null by `pin_extra`) a fresh device block,
    /// registers it under `(chain hash, group)` as a step would, and queues its load from the
    /// host block (whose reference, taken before any allocation, the queued load now holds).
    pub(super) fn load_extra(
        &mut self,
        slot: usize,
        tokens: &[TokenId],
        hashes: &[u128],
        root: u128,
        loads: &[GroupLoad],
    ) -> Result<()> {
        let bs = self.bs;
        for &(g, i, h) in loads {
            let b = self.alloc_block()?;
            self.slots[slot].extra[g - 1].blocks[i] = b;
            let toks = &tokens[i * bs..(i + 1) * bs];
            let key = group_hash(hashes[i], g);
            if self.prefix.register(b, key, toks) {
                Self::note_block_group(&mut self.block_group, b, g);
                registered(
                    self.tier.as_mut(),
                    &mut self.host,
                    &mut self.events,
                    b,
                    key,
                    g,
                    i.checked_sub(1).map(|p| hashes[p]),
                    root,
                    toks,
                );
            }
            self.swap_in_q.push((h, b));
        }
        Ok(())
    }

    /// Checks the per-group step buffers of a batch whose largest table has `max_blocks` entries
    /// and whose new tokens number `tokens`.
    pub(super) fn check_group_bufs(
        &self,
        groups: &[GroupStepBuffers<'_>],
        batch: usize,
        tokens: usize,
        max_blocks: usize,
    ) -> Result<()> {
        if groups.len() != self.kinds.len() {
            return Err(Error::InvalidArgument {
                what: "groups.len",
                value: groups.len() as i64,
                reason: format!(
                    "one step buffer set per group after group 0: {} for {} groups",
                    self.kinds.len(),
                    self.num_groups()
                ),
            });
        }
        let small = |buffer: &'static str, needed: usize, capacity: usize| {
            if capacity < needed {
                Err(Error::BufferTooSmall {
                    buffer,
                    needed,
                    capacity,
                })
            } else {
                Ok(())
            }
        };
        for gb in groups {
            small("group_slot_mapping", tokens, gb.slot_mapping.len())?;
            small(
                "group_block_table_stride",
                max_blocks,
                gb.block_table_stride,
            )?;
            small(
                "group_block_tables",
                batch.saturating_mul(gb.block_table_stride),
                gb.block_tables.len(),
            )?;
        }
        Ok(())
    }
}

/// Writes each extra group's slot mapping and block-table rows for the batch `idx` (slots),
/// incrementally like group 0's (a row is rewritten in full when its table's version changed).
pub(super) fn write_groups(
    slots: &[Seq],
    idx: &[u32],
    num_new: &[u32],
    bs: usize,
    groups: &mut [GroupStepBuffers<'_>],
    caches: &mut [StepCache],
) {
    for (g, (gb, cache)) in groups.iter_mut().zip(caches.iter_mut()).enumerate() {
        let stride = gb.block_table_stride;
        let marks = cache.rows_for(gb.block_tables, stride, idx.len());
        let mut tok = 0usize;
        for (k, (&i, &n)) in idx.iter().zip(num_new).enumerate() {
            let s = &slots[i as usize];
            let t = &s.extra[g];
            let len = s.table.num_tokens;
            let n = n as usize;
            let nb = t.blocks.len();
            if n == 1 {
                // The decode case, without a division: the new token is in the tail block.
                let off = len - 1 - (nb - 1) * bs;
                gb.slot_mapping[tok] = t.blocks[nb - 1] as i64 * bs as i64 + off as i64;
            } else {
                for (w, p) in (len - n..len).enumerate() {
                    gb.slot_mapping[tok + w] =
                        t.blocks[p / bs] as i64 * bs as i64 + (p % bs) as i64;
                }
            }
            tok += n;
            let from = marks[k].valid_prefix(s.uid, t.version, nb);
            let row = &mut gb.block_tables[k * stride + from..k * stride + nb];
            match row.len() {
                0 => {}
                1 => row[0] = t.blocks[nb - 1] as i32,
                _ => row.copy_from_slice(crate::table::as_i32(&t.blocks[from..])),
            }
            marks[k].set(s.uid, t.version, nb);
        }
    }
}

/// The host tier's side of a registration: the tier (when on), the host pool, the counters and
/// the swap-out queue an offload needs, and whether registration offloads (write-through).
pub(super) struct TierSide<'a> {
    pub tier: Option<&'a mut HostTier>,
    pub host: &'a mut HostPool,
    pub counters: &'a mut Counters,
    pub swap_out_q: &'a mut Vec<(BlockId, HostBlockId)>,
    pub write_through: bool,
}

/// The block positions a windowed group of kind `kind` holds for `s` when it steps past them
/// (`Seq::held`): the window ending at its shared prefix, once at least two admissions reached
/// that prefix's end (`Seq::shared_reach`); empty otherwise.
fn held_window(s: &Seq, kind: AttentionKind, bs: usize) -> std::ops::Range<usize> {
    if s.shared_reach >= 2 {
        dead_blocks(kind, s.shared_prefix * bs, bs)..s.shared_prefix
    } else {
        0..0
    }
}

/// Registers the blocks of `s`'s groups `1..G` at block indices `from.max(start)..upto` in the
/// prefix cache under `(chain hash, group)`, as a step does: each newly registered block's group
/// is noted (`block_group`) and announced (`Stored` for its group); with the host tier on its
/// chain metadata is noted for a later write-back, and with `write_through` it is offloaded.
/// Shared by the step's registration and a swap-in's re-registration (which passes
/// `write_through: false`: its content arrives by the swap-in itself).
#[allow(clippy::too_many_arguments)]
pub(super) fn register_group_blocks(
    prefix: &mut PrefixCache,
    block_group: &mut [u16],
    events: &mut KvEventRing,
    side: &mut TierSide<'_>,
    s: &Seq,
    bs: usize,
    from: usize,
    upto: usize,
) {
    for (gi, t) in s.extra.iter().enumerate() {
        let g = gi + 1;
        for j in from.max(t.start)..upto {
            let toks = &s.tokens[j * bs..(j + 1) * bs];
            let b = t.blocks[j];
            let key = group_hash(s.hashes[j], g);
            if prefix.register(b, key, toks) {
                BlockManager::note_block_group(block_group, b, g);
                let parent = j.checked_sub(1).map(|p| s.hashes[p]);
                registered(
                    side.tier.as_deref_mut(),
                    side.host,
                    events,
                    b,
                    key,
                    g,
                    parent,
                    s.root,
                    toks,
                );
                if side.write_through {
                    if let Some(tier) = side.tier.as_deref_mut() {
                        offload(
                            tier,
                            side.host,
                            events,
                            side.counters,
                            side.swap_out_q,
                            b,
                            key,
                            g,
                            parent,
                            s.root,
                            toks,
                        );
                    }
                }
            }
        }
    }
}
