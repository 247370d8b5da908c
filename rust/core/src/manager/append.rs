//! Growing, forking and freeing sequences: `append`, `append_batch`, `fork`, copy-on-write of a
//! shared tail, `free`, `free_batch` and `reset_prefix_cache`.
//!
//! Invariants kept here:
//! - A block's refcount is the number of tables holding it. `fork` bumps every block of the
//!   parent and allocates nothing, so the only shared block a sequence can write into is a partly
//!   filled tail; the first write into it replaces it with a fresh block (`cow_tail`) and queues
//!   the `(src, dst)` copy for the next step.
//! - Appends and forks may use the watermark reserve: it exists so that running sequences can
//!   always grow.
//! - Batch calls check the whole batch (ids known, running, none twice; enough blocks) before
//!   touching state. `append_batch` reuses the last resolution of its ids while no sequence was
//!   admitted, forked or freed, which keeps a decode loop free of map lookups.
//! - `free` drops references tail first, so a freed sequence's prefix outlives its tail in the
//!   LRU.

use super::{holds_provisional, not_running, BlockManager, Seq};
use crate::error::{Error, Result};
use crate::events::Medium;
use crate::pool::BlockPool;
use crate::swap::SeqState;
use crate::table::blocks_for;
use crate::{SeqId, TokenId};

impl BlockManager {
    /// Appends tokens to a sequence. Allocates only when a block boundary is crossed (and for a
    /// copy-on-write of a shared tail); may use the watermark reserve. All-or-nothing.
    pub fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: 0,
                reason: "nothing to append".into(),
            });
        }
        let slot = self.slot_of(seq)?;
        let bs = self.bs;
        let s = &self.slots[slot];
        if s.state != SeqState::Running {
            return Err(not_running(seq, s.state));
        }
        if s.provisional != 0 {
            return Err(holds_provisional(seq));
        }
        let len = s.table.num_tokens;
        let nb = blocks_for(len + tokens.len(), bs);
        if nb > self.cfg.max_blocks_per_seq as usize {
            return Err(Error::SequenceTooLong {
                seq_id: seq,
                needed_blocks: nb,
                max_blocks_per_seq: self.cfg.max_blocks_per_seq as usize,
            });
        }
        let grow = nb - s.table.blocks.len();
        let cow = Self::needs_cow(&self.pool, s, bs)?;
        let extra_cows = if s.tail_maybe_shared {
            Self::extra_shared_tails(&self.pool, s, bs)?
        } else {
            0
        };
        let needed = grow * self.num_groups() + cow as usize + extra_cows;
        let avail = self.num_free_blocks();
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        if cow {
            self.cow_tail(slot)?;
        }
        if extra_cows > 0 {
            self.cow_extra(slot)?;
        }
        // The old tail is ours alone now (copied or unshared) and new blocks are fresh.
        self.slots[slot].tail_maybe_shared = false;
        for _ in 0..grow {
            let b = self.alloc_block()?;
            self.slots[slot].table.blocks.push(b);
        }
        if grow > 0 && !self.kinds.is_empty() {
            self.grow_extra(slot, grow)?;
        }
        let s = &mut self.slots[slot];
        s.table.num_tokens += tokens.len();
        if self.caching {
            s.tokens.extend_from_slice(tokens);
        }
        self.used_tokens += tokens.len() as u64;
        Ok(())
    }

    /// Appends one token to each sequence (a decode step). Validates everything first — equal
    /// lengths, known ids, no id twice, enough blocks for the whole batch — then applies.
    pub fn append_batch(&mut self, seqs: &[SeqId], tokens: &[TokenId]) -> Result<()> {
        if seqs.len() != tokens.len() {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: tokens.len() as i64,
                reason: format!("must equal seqs.len() ({})", seqs.len()),
            });
        }
        self.resolve_batch(seqs)?;
        let needed = self.append_needs(seqs)?;
        let avail = self.num_free_blocks();
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        let idx = std::mem::take(&mut self.batch_idx);
        let bs = self.bs;
        let mut result = Ok(());
        for (k, &i) in idx.iter().enumerate() {
            let i = i as usize;
            let s = &self.slots[i];
            // Full tail (no division on the per-token path): a new block is needed.
            if s.table.num_tokens == s.table.blocks.len() * bs {
                match self.alloc_block() {
                    Ok(b) => self.slots[i].table.blocks.push(b),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                if !self.kinds.is_empty() {
                    if let Err(e) = self.grow_extra(i, 1) {
                        result = Err(e);
                        break;
                    }
                }
                self.slots[i].tail_maybe_shared = false;
            } else if s.tail_maybe_shared {
                let step = match Self::needs_cow(&self.pool, s, bs) {
                    Ok(true) => self.cow_tail(i),
                    Ok(false) => Ok(()),
                    Err(e) => Err(e),
                }
                .and_then(|()| {
                    if self.kinds.is_empty() {
                        Ok(())
                    } else {
                        self.cow_extra(i)
                    }
                });
                if let Err(e) = step {
                    result = Err(e);
                    break;
                }
                // Every group's tail is ours alone now (copied or found unshared).
                self.slots[i].tail_maybe_shared = false;
            }
            let s = &mut self.slots[i];
            s.table.num_tokens += 1;
            if self.caching {
                s.tokens.push(tokens[k]);
            }
        }
        self.used_tokens += seqs.len() as u64;
        self.batch_idx = idx;
        result
    }

    /// Resolves `seqs` to slots in `self.batch_idx` (one lookup each), rejecting unknown and
    /// repeated ids. A decode loop passes the same batch step after step: when `seqs` equals the
    /// last resolved batch and no sequence was admitted, forked or freed since, the previous
    /// resolution is reused without any lookup.
    pub(super) fn resolve_batch(&mut self, seqs: &[SeqId]) -> Result<()> {
        if self.batch_gen == self.gen && self.batch_ids.as_slice() == seqs {
            return Ok(());
        }
        self.batch_gen = u64::MAX;
        let mut idx = std::mem::take(&mut self.batch_idx);
        idx.clear();
        let resolved = self.for_each_distinct(seqs, |id, i, s| {
            if s.state != SeqState::Running {
                return Err(not_running(id, s.state));
            }
            idx.push(i as u32);
            Ok(())
        });
        self.batch_idx = idx;
        resolved?;
        self.batch_ids.clear();
        self.batch_ids.extend_from_slice(seqs);
        self.batch_gen = self.gen;
        Ok(())
    }

    /// For the resolved batch: checks that one more token fits each row and returns the blocks
    /// the batch may need (an upper bound: one copy-on-write can make another's unnecessary).
    fn append_needs(&self, seqs: &[SeqId]) -> Result<usize> {
        let bs = self.bs;
        let max = self.cfg.max_blocks_per_seq as usize;
        let mut needed = 0usize;
        for (k, &i) in self.batch_idx.iter().enumerate() {
            let s = &self.slots[i as usize];
            if s.provisional != 0 {
                return Err(holds_provisional(seqs[k]));
            }
            let nb = s.table.blocks.len();
            if s.table.num_tokens == nb * bs {
                if nb + 1 > max {
                    return Err(Error::SequenceTooLong {
                        seq_id: seqs[k],
                        needed_blocks: nb + 1,
                        max_blocks_per_seq: max,
                    });
                }
                needed += self.num_groups();
            } else if s.tail_maybe_shared {
                needed += Self::needs_cow(&self.pool, s, bs)? as usize
                    + Self::extra_shared_tails(&self.pool, s, bs)?;
            }
        }
        Ok(needed)
    }

    /// Whether the tail block of `s` is shared and about to be written (so must be copied first).
    #[inline]
    pub(super) fn needs_cow(pool: &BlockPool, s: &Seq, bs: usize) -> Result<bool> {
        if !s.tail_maybe_shared || s.table.num_tokens == s.table.blocks.len() * bs {
            return Ok(false);
        }
        let tail = *s.table.blocks.last().expect("a partial tail block exists");
        Ok(pool.refcount(tail)? > 1)
    }

    /// Replaces the shared tail block of `slot` with a fresh copy and queues the copy.
    pub(super) fn cow_tail(&mut self, slot: usize) -> Result<()> {
        let d = self.alloc_block()?;
        let s = &mut self.slots[slot];
        let last = s.table.blocks.len() - 1;
        let src = std::mem::replace(&mut s.table.blocks[last], d);
        // An entry changed in place: block-table rows written before now are stale.
        s.version += 1;
        s.tail_maybe_shared = false;
        // A src that is itself waiting to be filled by a pending copy has the same content as that
        // copy's src when the copies run (before any write of the step): copy from there instead,
        // so no block is both a dst and a src in one step.
        self.queue_copy(src, d);
        self.drop_ref(src)
    }

    /// Starts `child` as a copy of `parent` sharing all its blocks (parallel sampling, beam
    /// search). No block is allocated; the first write into the shared tail copies it.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        let p = self.slot_of(parent)?;
        if self.slots[p].state != SeqState::Running {
            return Err(not_running(parent, self.slots[p].state));
        }
        if self.slots[p].provisional != 0 {
            // Only committed state is shared: commit or rewind first.
            return Err(holds_provisional(parent));
        }
        if self.index.contains_key(&child) {
            return Err(Error::DuplicateSequence { seq_id: child });
        }
        let extra_blocks = self.slots[p]
            .extra
            .iter()
            .flat_map(|t| &t.blocks[t.start..]);
        let ps = &self.slots[p];
        for &b in ps.table.blocks[ps.start0..].iter().chain(extra_blocks) {
            if self.pool.refcount(b)? >= crate::pool::MAX_REFCOUNT {
                return Err(Error::InvalidArgument {
                    what: "parent",
                    value: parent as i64,
                    reason: format!("block {b} is at the maximum reference count"),
                });
            }
        }
        let c = self.take_slot() as usize;
        let mut child_state = std::mem::take(&mut self.slots[c]);
        let ps = &self.slots[p];
        child_state.table.blocks.clone_from(&ps.table.blocks);
        child_state.table.num_tokens = ps.table.num_tokens;
        child_state.tokens.clone_from(&ps.tokens);
        child_state.hashes.clone_from(&ps.hashes);
        child_state.registered = ps.registered;
        child_state.root = ps.root;
        child_state.keys = ps.keys.clone();
        let partial = ps.table.num_tokens % self.bs != 0;
        child_state.tail_maybe_shared = partial;
        self.last_uid += 1;
        child_state.uid = self.last_uid;
        child_state.version = 0;
        child_state.state = SeqState::Running;
        child_state.order = ps.order;
        child_state.group = ps.group;
        child_state.extra.clone_from(&ps.extra);
        child_state.start0 = ps.start0;
        child_state.next_release = ps.next_release;
        child_state.shared_prefix = ps.shared_prefix;
        child_state.shared_reach = ps.shared_reach;
        child_state.held.clear(); // the parent keeps holding them
        child_state.provisional = 0;
        child_state.stepped = 0;
        let extra_blocks = child_state.extra.iter().flat_map(|t| &t.blocks[t.start..]);
        let own0 = &child_state.table.blocks[child_state.start0..];
        for &b in own0.iter().chain(extra_blocks) {
            if self.pool.incref_mut(b)? == 2 {
                self.shared_blocks += 1;
            }
        }
        self.used_tokens += child_state.table.num_tokens as u64;
        self.slots[c] = child_state;
        self.slots[p].tail_maybe_shared |= partial;
        self.index.insert(child, c as u32);
        self.gen += 1;
        Ok(())
    }

    /// Frees a sequence: drops its references, tail block first, so that cached blocks enter the
    /// LRU tail-first and the prefix outlives the tail.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let slot = self
            .index
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq_id: seq })? as usize;
        self.gen += 1;
        let result = self.release_table(slot);
        let s = &mut self.slots[slot];
        s.table.num_tokens = 0;
        s.state = SeqState::Running;
        s.keys = None;
        s.provisional = 0;
        s.stepped = 0;
        self.free_slots.push(slot as u32);
        result
    }

    /// Frees several sequences with one call. Validates first — every id live, none twice — and
    /// on failure returns the error with nothing freed; then frees each in order, as
    /// [`BlockManager::free`] does.
    pub fn free_batch(&mut self, seqs: &[SeqId]) -> Result<()> {
        // Known ids, none twice; any state (a swapped-out or recompute-preempted sequence is
        // freed too, so not through `resolve_batch`, which wants running sequences).
        self.for_each_distinct(seqs, |_, _, _| Ok(()))?;
        let mut result = Ok(());
        for &id in seqs {
            if let Err(e) = self.free(id) {
                result = Err(e);
            }
        }
        result
    }

    /// Forgets every prefix-cache entry: cached-free blocks go back to the free list and blocks
    /// still held by sequences lose their hash (they stay in their tables, and are not offered
    /// to the cache again). Later admissions hit nothing until new steps register blocks. Returns
    /// the number of blocks dropped from the cache (hashed blocks, cached-free or held).
    ///
    /// Use it when cached KV is no longer valid (new weights, a changed model config).
    pub fn reset_prefix_cache(&mut self) -> Result<usize> {
        // Swapped-out sequences do not re-register their blocks on swap-in after a reset.
        self.cache_epoch += 1;
        let dropped = self.prefix.num_hashed();
        let mut result = Ok(dropped);
        while let Some(b) = self.prefix.evict_oldest() {
            // Refcount 0 (a cached-free block): released to the free list.
            if let Err(e) = self.pool.release_mut(b) {
                result = Err(e);
            }
        }
        // Blocks still held lose their hash too; stale map entries go with them.
        self.prefix.clear_hashes();
        self.events.cleared(Medium::Gpu);
        if let Some(t) = self.tier.as_mut() {
            // Unreferenced host-cached blocks are freed; referenced ones (a load or an offload in
            // flight) are only unindexed, and freed when their last reference goes.
            t.epoch += 1;
            for h in 0..self.host.num_blocks() {
                if t.is_indexed(h) {
                    let in_lru = t.lru.contains(h);
                    t.unindex(h);
                    if in_lru {
                        self.host.release(h);
                    }
                }
            }
            self.events.cleared(Medium::Host);
        }
        result
    }
}
