//! Provisional tokens: `append_provisional`, `commit`, `commit_batch` and `rewind`.
//!
//! A sequence may hold up to `max_provisional` tokens past its committed length (speculative
//! drafts, or the token of a step scheduled before the previous step's result is known). They get
//! slots and table entries like any token — `append_provisional` allocates as `append` does,
//! copy-on-write and watermark reserve included — and a step schedules them like any token.
//!
//! Invariants kept here:
//! - The last `provisional` of a sequence's `num_tokens` are provisional; its token ids, hashes,
//!   `registered` count and prefix-cache entries cover committed tokens only. A provisional token
//!   is never hashed, so it never reaches the prefix cache, the host tier or an event.
//! - Provisional tokens sit at the end: `append` and `fork` refuse a sequence holding any
//!   (`InvalidSequenceState`): commit or rewind first. Preemption (swap-out, recompute) rewinds
//!   them first, as `rewind` does.
//! - `commit(seq, n, ids)` settles all of them at once: the first `n` become committed, with token
//!   ids `ids`, exactly as if appended one by one (same hashes, same prefix-cache state); the rest
//!   are dropped. Blocks left holding no token go back (free list, or a queued copy-on-write into
//!   them is cancelled); the table version is bumped so that no block-table row keeps a dropped
//!   entry. Full committed blocks that a step already scheduled are registered at once; the others
//!   by the next step that schedules the sequence, as for appended tokens.
//! - Windowed KV cache groups release blocks by the committed length only (see `build_step`), so
//!   a rewind never returns to a position whose blocks were released.
//! - Every call validates fully before touching state: an error leaves the manager unchanged.

use super::{not_running, BlockManager};
use crate::error::{Error, Result};
use crate::swap::SeqState;
use crate::table::blocks_for;
use crate::{SeqId, TokenId};

impl BlockManager {
    /// Provisional tokens `seq` holds past its committed length; `UnknownSequence` if not live.
    pub fn num_provisional(&self, seq: SeqId) -> Result<usize> {
        Ok(self.slots[self.slot_of(seq)?].provisional)
    }

    /// Committed tokens of `seq` (its length without the provisional ones).
    pub fn committed_len(&self, seq: SeqId) -> Result<usize> {
        let s = &self.slots[self.slot_of(seq)?];
        Ok(s.table.num_tokens - s.provisional)
    }

    /// Checks that `n` more provisional tokens fit sequence `slot` and returns the blocks they
    /// need (growth in every group plus copies of shared tails).
    fn provisional_needs(&self, seq: SeqId, slot: usize, n: usize) -> Result<usize> {
        let s = &self.slots[slot];
        if s.state != SeqState::Running {
            return Err(not_running(seq, s.state));
        }
        let max = self.cfg.max_provisional as usize;
        if n == 0 || s.provisional + n > max {
            return Err(Error::InvalidArgument {
                what: "num_provisional",
                value: n as i64,
                reason: if n == 0 {
                    "must be >= 1".into()
                } else {
                    format!(
                        "sequence {seq} holds {} provisional tokens; at most {max} (max_provisional)",
                        s.provisional
                    )
                },
            });
        }
        let bs = self.bs;
        let nb = blocks_for(s.table.num_tokens + n, bs);
        if nb > self.cfg.max_blocks_per_seq as usize {
            return Err(Error::SequenceTooLong {
                seq_id: seq,
                needed_blocks: nb,
                max_blocks_per_seq: self.cfg.max_blocks_per_seq as usize,
            });
        }
        let grow = nb - s.table.blocks.len();
        let mut needed = grow * self.num_groups();
        if s.tail_maybe_shared {
            needed += Self::needs_cow(&self.pool, s, bs)? as usize
                + Self::extra_shared_tails(&self.pool, s, bs)?;
        }
        Ok(needed)
    }

    /// Grows `slot` by `n` provisional tokens (validated by `provisional_needs`).
    fn grow_provisional(&mut self, slot: usize, n: usize) -> Result<()> {
        let bs = self.bs;
        let s = &self.slots[slot];
        let grow = blocks_for(s.table.num_tokens + n, bs) - s.table.blocks.len();
        if s.tail_maybe_shared {
            if Self::needs_cow(&self.pool, s, bs)? {
                self.cow_tail(slot)?;
            }
            if !self.kinds.is_empty() {
                self.cow_extra(slot)?;
            }
        }
        self.slots[slot].tail_maybe_shared = false;
        for _ in 0..grow {
            let b = self.alloc_block()?;
            self.slots[slot].table.blocks.push(b);
        }
        if grow > 0 && !self.kinds.is_empty() {
            self.grow_extra(slot, grow)?;
        }
        let s = &mut self.slots[slot];
        s.table.num_tokens += n;
        s.provisional += n;
        self.used_tokens += n as u64;
        Ok(())
    }

    /// Adds `n` provisional tokens to `seq` (their ids are not needed: `commit` gives the accepted
    /// ones). Allocates as [`BlockManager::append`] does and may use the watermark reserve.
    /// Errors, with nothing changed: `UnknownSequence`; `InvalidSequenceState` (not running);
    /// `InvalidArgument` (`n == 0`, or more than `max_provisional` in all); `SequenceTooLong`;
    /// `OutOfBlocks`.
    pub fn append_provisional(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let slot = self.slot_of(seq)?;
        let needed = self.provisional_needs(seq, slot, n)?;
        let avail = self.num_free_blocks();
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        self.grow_provisional(slot, n)
    }

    /// [`BlockManager::append_provisional`] for a whole step: `counts[k]` provisional tokens for
    /// `seqs[k]`. Validates the whole batch (lengths, ids known, running and distinct, limits,
    /// enough blocks for all) before changing anything.
    pub fn append_provisional_batch(&mut self, seqs: &[SeqId], counts: &[u32]) -> Result<()> {
        if seqs.len() != counts.len() {
            return Err(Error::InvalidArgument {
                what: "counts.len",
                value: counts.len() as i64,
                reason: format!("must equal seqs.len() ({})", seqs.len()),
            });
        }
        self.resolve_batch(seqs)?;
        let idx = std::mem::take(&mut self.batch_idx);
        let mut needed = 0usize;
        let mut checked = Ok(());
        for (k, &i) in idx.iter().enumerate() {
            match self.provisional_needs(seqs[k], i as usize, counts[k] as usize) {
                Ok(n) => needed += n,
                Err(e) => {
                    checked = Err(e);
                    break;
                }
            }
        }
        let avail = self.num_free_blocks();
        if checked.is_ok() && needed > avail {
            checked = Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        let mut result = checked;
        if result.is_ok() {
            for (k, &i) in idx.iter().enumerate() {
                if let Err(e) = self.grow_provisional(i as usize, counts[k] as usize) {
                    result = Err(e);
                    break;
                }
            }
        }
        self.batch_idx = idx;
        result
    }

    /// Checks one commit: `n_accepted` of the provisional tokens of `seq` (at `slot`).
    fn check_commit(&self, seq: SeqId, slot: usize, n_accepted: usize) -> Result<()> {
        let held = self.slots[slot].provisional;
        if n_accepted > held {
            return Err(Error::InvalidArgument {
                what: "n_accepted",
                value: n_accepted as i64,
                reason: format!("sequence {seq} holds {held} provisional tokens"),
            });
        }
        Ok(())
    }

    /// Settles the provisional tokens of `seq`: the first `n_accepted` become committed with ids
    /// `accepted` (exactly as if appended: hashed and cached the same), the rest are dropped and
    /// the blocks they alone used go back. Errors, with nothing changed: `UnknownSequence`;
    /// `InvalidArgument` when `n_accepted` exceeds the provisional count or `accepted.len() !=
    /// n_accepted`.
    pub fn commit(&mut self, seq: SeqId, n_accepted: usize, accepted: &[TokenId]) -> Result<()> {
        let slot = self.slot_of(seq)?;
        self.check_commit(seq, slot, n_accepted)?;
        if accepted.len() != n_accepted {
            return Err(Error::InvalidArgument {
                what: "accepted.len",
                value: accepted.len() as i64,
                reason: format!("must equal n_accepted ({n_accepted})"),
            });
        }
        self.settle(slot, n_accepted, accepted)
    }

    /// Drops every provisional token of `seq`: `commit(seq, 0, &[])`.
    pub fn rewind(&mut self, seq: SeqId) -> Result<()> {
        self.commit(seq, 0, &[])
    }

    /// [`BlockManager::commit`] for a whole step: `(seq, n_accepted)` pairs, and the accepted ids
    /// of all of them concatenated in order. Validates everything first — ids known and distinct,
    /// each count within its sequence's provisional tokens, `tokens.len()` the sum of the counts —
    /// then settles each in order.
    pub fn commit_batch(&mut self, accepted: &[(SeqId, u32)], tokens: &[TokenId]) -> Result<()> {
        let mut total = 0usize;
        self.epoch += 1;
        let epoch = self.epoch;
        for &(id, n) in accepted {
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
            self.check_commit(id, i, n as usize)?;
            total += n as usize;
        }
        if tokens.len() != total {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: tokens.len() as i64,
                reason: format!("must equal the accepted counts' sum ({total})"),
            });
        }
        let mut result = Ok(());
        let mut at = 0usize;
        for &(id, n) in accepted {
            let n = n as usize;
            let i = self.index[&id] as usize;
            if let Err(e) = self.settle(i, n, &tokens[at..at + n]) {
                result = Err(e);
            }
            at += n;
        }
        result
    }

    /// Applies a validated commit of `n` tokens (ids `accepted`) to `slot`.
    pub(super) fn settle(&mut self, slot: usize, n: usize, accepted: &[TokenId]) -> Result<()> {
        let s = &mut self.slots[slot];
        let held = s.provisional;
        if held == 0 {
            return Ok(());
        }
        let new_len = s.table.num_tokens - held + n;
        s.provisional = 0;
        if self.caching {
            s.tokens.extend_from_slice(accepted);
        }
        let result = if n < held {
            self.truncate_to(slot, new_len)
        } else {
            Ok(())
        };
        if self.caching {
            let s = &mut self.slots[slot];
            // Blocks full of tokens that a built step scheduled are registered now, as that step
            // would have done had they been committed; the rest wait for the next step.
            let ready = s.stepped.min(new_len) / self.bs;
            s.stepped = 0;
            self.register_upto(slot, ready);
        }
        result
    }

    /// Shortens running `slot` to `new_len` tokens, dropping the references of the blocks (in
    /// every group) past `ceil(new_len / B)`, last block first.
    fn truncate_to(&mut self, slot: usize, new_len: usize) -> Result<()> {
        let nb_new = blocks_for(new_len, self.bs);
        let nb = self.slots[slot].table.blocks.len();
        let mut result = Ok(());
        for j in (nb_new..nb).rev() {
            for g in 0..self.slots[slot].extra.len() {
                let t = &self.slots[slot].extra[g];
                if j >= t.start {
                    let b = t.blocks[j];
                    if let Err(e) = self.drop_ref(b) {
                        result = Err(e);
                    }
                }
            }
            let b = self.slots[slot].table.blocks[j];
            if let Err(e) = self.drop_ref(b) {
                result = Err(e);
            }
        }
        let s = &mut self.slots[slot];
        if nb_new < nb {
            s.table.blocks.truncate(nb_new);
            // A later growth may put another block at a dropped position: rows must not keep it.
            s.version += 1;
            for t in &mut s.extra {
                // Its null prefix stays: releases follow the committed length, so `start` is
                // below the committed tail.
                t.blocks.truncate(nb_new);
                t.version += 1;
            }
        }
        let dropped = s.table.num_tokens - new_len;
        s.table.num_tokens = new_len;
        self.used_tokens -= dropped as u64;
        result
    }
}
