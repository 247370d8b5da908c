//! The step: `build_step` fills the caller's buffers (slot mapping, block tables, lengths, query
//! offsets, the optional CSR page table) and emits the queued copy-on-write and swap copies.
//!
//! Invariants kept here:
//! - Validation (`check_step`, `plan_swaps`) finishes before any buffer is written, so a refused
//!   step leaves the buffers and the manager as they were.
//! - Full blocks are registered in the prefix cache here, by the step that schedules their last
//!   token: only blocks whose KV a step has been built to write can ever be hit. Blocks holding a
//!   provisional token are not; once committed, `commit` registers those a step has scheduled.
//! - A step's lists run swap-out, swap-in, copy-on-write, then the forward. Every queued copy a
//!   scheduled sequence depends on is emitted by that step; the rest wait for room, so a burst of
//!   forks or swaps never blocks stepping. One step's copy list has distinct `dst`s and no `dst`
//!   is a `src`.
//! - Block-table rows are written incrementally (see `StepCache`): a row is rewritten in full
//!   whenever its sequence's uid or table version changed, so a stale entry is never left behind.

use super::groups::{register_group_blocks, write_groups, TierSide};
use super::tier::{host_unindex, offload, registered};
use super::{BlockManager, Seq};
use crate::error::{Error, Result};
use crate::groups::release_threshold;
use crate::prefix::FastMap;
use crate::step::{GroupStepBuffers, StepBuffers, StepInfo};
use crate::swap::HostBlockId;
use crate::{BlockId, SeqId};

/// Which queued swap copies a step emits (see `BlockManager::plan_swaps`).
#[derive(Debug)]
struct SwapPlan {
    emit_out: Vec<bool>,
    /// Queued offloads cancelled to make room (never set for a swapped sequence's swap-out).
    drop_out: Vec<bool>,
    emit_in: Vec<bool>,
    /// Which pending copy-on-write copies to emit (in queue order).
    emit_cow: Vec<bool>,
}

impl BlockManager {
    /// Forgets what the manager remembers about the block-table buffer it last wrote, so the next
    /// `build_step` writes every row of its batch in full. Call it after writing into that buffer
    /// yourself (or after handing the manager new memory that reuses the old address, length and
    /// stride); see [`StepBuffers`] for the ownership contract.
    pub fn invalidate_step_cache(&mut self) {
        self.step_cache.invalidate();
    }

    /// Fills `out` for one step. Each `(seqs[i], num_new[i])` means "the last `num_new[i]` tokens
    /// of `seqs[i]` are new this step". Validates everything (lengths, ids, `1 <= n <= len`, every
    /// buffer's size) before writing anything; then emits pending copies and offers the batch's newly
    /// full blocks to the prefix cache.
    ///
    /// Copies: all pending copies when they fit in `copies`. Otherwise every pending copy whose
    /// `dst` or `src` a scheduled sequence holds is emitted (`BufferTooSmall` on `copies` only if
    /// those alone do not fit), then others while `copies` has room; the rest stay queued for a
    /// later step, so a burst of forks never blocks stepping.
    ///
    /// Block-table rows are written incrementally: the manager remembers, for the buffer it last
    /// wrote (identified by address, length and stride), which sequence each row holds and how many
    /// of its entries. A row that still holds a prefix of the same sequence's unchanged table gets
    /// only the entries past that prefix; any other row is written in full, and a different buffer
    /// resets the memory. So between steps the block-table buffer belongs to the manager: whoever
    /// writes into it must call [`BlockManager::invalidate_step_cache`] before the next step. The
    /// CSR page table, when requested, is packed and rewritten in full every step.
    ///
    /// A manager with more than one KV cache group needs [`BlockManager::build_step_groups`].
    #[inline]
    pub fn build_step(
        &mut self,
        seqs: &[SeqId],
        num_new: &[u32],
        out: &mut StepBuffers<'_>,
    ) -> Result<StepInfo> {
        self.build_step_groups(seqs, num_new, out, &mut [])
    }

    /// [`BlockManager::build_step`] for a manager with KV cache groups: `out` receives group 0's
    /// slot mapping and block tables and everything the groups share (lengths, query offsets,
    /// the CSR page table of group 0, the copy and swap lists); `groups[g - 1]` receives group
    /// `g`'s slot mapping and block tables. `InvalidArgument` unless `groups` has one entry per
    /// group after group 0; `BufferTooSmall` (`group_slot_mapping`, `group_block_table_stride`,
    /// `group_block_tables`) when one is too small. Both are checked before anything is written.
    ///
    /// After validation, every windowed group (sliding, chunked) of each scheduled sequence
    /// releases the blocks no query at or after the step's first new position reads (see
    /// [`crate::groups`]); their entries become [`NULL_BLOCK`](crate::groups::NULL_BLOCK) in the
    /// rows this step writes. Newly full blocks of every group are offered to the prefix cache,
    /// group `g`'s under `group_hash(h, g)`.
    pub fn build_step_groups(
        &mut self,
        seqs: &[SeqId],
        num_new: &[u32],
        out: &mut StepBuffers<'_>,
        groups: &mut [GroupStepBuffers<'_>],
    ) -> Result<StepInfo> {
        if seqs.len() != num_new.len() {
            return Err(Error::InvalidArgument {
                what: "num_new.len",
                value: num_new.len() as i64,
                reason: format!("must equal seqs.len() ({})", seqs.len()),
            });
        }
        self.resolve_batch(seqs)?;
        let (num_tokens, num_kv, max_len, max_query, csr, needed) =
            self.check_step(seqs, num_new, out)?;
        if !self.kinds.is_empty() || !groups.is_empty() {
            self.check_group_bufs(groups, seqs.len(), num_tokens, max_len.div_ceil(self.bs))?;
        }
        let swaps = self.plan_swaps(
            out.swap_out.len() / 2,
            out.swap_in.len() / 2,
            out.copies.len() / 2,
        )?;
        let idx = std::mem::take(&mut self.batch_idx);

        let num_copies = match &swaps {
            Some(plan) => self.emit_copies_masked(&plan.emit_cow, out.copies),
            None => self.emit_copies(&needed, out.copies),
        };
        let (num_swap_out, num_swap_in, swap_result) =
            self.emit_swaps(swaps, out.swap_out, out.swap_in);
        // Windowed groups release what no query of this step or a later one reads. After the
        // copies are emitted (a released copy destination drops its queued copy, which must not
        // shift the emitted mask) and before the rows are written (they show the null entries).
        let mut release_result = Ok(());
        if self.windowed {
            for (k, &i) in idx.iter().enumerate() {
                let s = &self.slots[i as usize];
                // Releases follow the committed length: a rewind must find every block the
                // positions it returns to read.
                let c = (s.table.num_tokens - num_new[k] as usize)
                    .min(s.table.num_tokens - s.provisional);
                if c >= s.next_release {
                    if let Err(e) = self.release_dead(i as usize, c) {
                        release_result = Err(e);
                    }
                }
            }
        }
        let bs = self.bs;
        let stride = out.block_table_stride;
        let marks = self
            .step_cache
            .rows_for(out.block_tables, stride, seqs.len());
        self.scratch_register.clear();
        write_batch(
            &self.slots,
            &idx,
            num_new,
            bs,
            self.caching,
            csr,
            out,
            marks,
            &mut self.scratch_register,
        );
        if !self.kinds.is_empty() {
            write_groups(
                &self.slots,
                &idx,
                num_new,
                bs,
                groups,
                &mut self.group_caches,
            );
        }

        let mut result = swap_result.and(release_result);
        if self.pending.is_empty() {
            while let Some(b) = self.deferred.pop() {
                if let Err(e) = self.park(b) {
                    result = Err(e);
                }
            }
        } else {
            // Some copies stay queued: only the srcs none of them needs are released.
            let mut j = 0;
            while j < self.deferred.len() {
                let b = self.deferred[j];
                if self.pending.iter().any(|&(src, _)| src == b) {
                    j += 1;
                } else {
                    self.deferred.swap_remove(j);
                    if let Err(e) = self.park(b) {
                        result = Err(e);
                    }
                }
            }
        }

        for k in 0..self.scratch_register.len() {
            let i = self.scratch_register[k] as usize;
            let s = &mut self.slots[i];
            let full = if s.provisional == 0 {
                let nb = s.table.blocks.len();
                nb - (s.table.num_tokens != nb * bs) as usize
            } else {
                // Provisional tokens are never hashed: only blocks full of committed tokens.
                s.stepped = s.table.num_tokens;
                (s.table.num_tokens - s.provisional) / bs
            };
            self.register_upto(i, full);
        }
        self.batch_idx = idx;
        let num_kv_indices = if csr { num_kv } else { 0 };
        result.map(|_| StepInfo {
            num_seqs: seqs.len(),
            num_tokens,
            num_kv_indices,
            num_copies,
            max_seq_len: max_len,
            num_swap_out,
            num_swap_in,
            max_query_len: max_query,
        })
    }

    /// Offers `slot`'s full blocks `[registered, full)` to the prefix cache (hashing the chain as
    /// far as its committed token ids go), with the events, tier index and write-through offloads
    /// a registration brings. `full` counts only blocks of committed tokens a step was built to
    /// write.
    pub(super) fn register_upto(&mut self, i: usize, full: usize) {
        let bs = self.bs;
        let s = &mut self.slots[i];
        if s.registered >= full {
            return;
        }
        self.hasher
            .extend_chain(s.root, &s.tokens, bs, s.keys.as_deref(), &mut s.hashes);
        for j in s.registered.max(s.start0)..full {
            let toks = &s.tokens[j * bs..(j + 1) * bs];
            let b = s.table.blocks[j];
            if self.prefix.register(b, s.hashes[j], toks) {
                Self::note_block_group(&mut self.block_group, b, 0);
                let parent = j.checked_sub(1).map(|p| s.hashes[p]);
                registered(
                    self.tier.as_mut(),
                    &mut self.host,
                    &mut self.events,
                    b,
                    s.hashes[j],
                    0,
                    parent,
                    s.root,
                    toks,
                );
                if self.cfg.host_write_through {
                    if let Some(t) = self.tier.as_mut() {
                        // Queued after this step's lists: the next step copies what this
                        // step's forward writes.
                        offload(
                            t,
                            &mut self.host,
                            &mut self.events,
                            &mut self.counters,
                            &mut self.swap_out_q,
                            b,
                            s.hashes[j],
                            0,
                            parent,
                            s.root,
                            toks,
                        );
                    }
                }
            }
        }
        let from = s.registered;
        let mut side = TierSide {
            tier: self.tier.as_mut(),
            host: &mut self.host,
            counters: &mut self.counters,
            swap_out_q: &mut self.swap_out_q,
            write_through: self.cfg.host_write_through,
        };
        register_group_blocks(
            &mut self.prefix,
            &mut self.block_group,
            &mut self.events,
            &mut side,
            s,
            bs,
            from,
            full,
        );
        s.registered = full;
    }

    /// Cancels the queued offload into host block `h` (nobody else holds `h`): it leaves the
    /// index and is freed.
    fn cancel_offload(&mut self, h: HostBlockId) -> Result<()> {
        if let Some(t) = self.tier.as_mut() {
            t.pinned[h as usize] = false;
            if t.is_indexed(h) {
                host_unindex(t, &mut self.events, h);
            }
        }
        if self.host.decref(h)? == 0 {
            self.host.release(h);
        }
        Ok(())
    }

    /// Which queued swap copies this step emits, when they do not all fit (`None`: all of them).
    ///
    /// Each step's lists run swap-out, then swap-in, then copy-on-write, before its forward. What
    /// this step writes is the blocks of the scheduled sequences (its forward), the destinations
    /// of its copies and of its swap-ins; so a queued swap-out must be emitted by the first step
    /// that writes its device block, and before (or with) a swap-in of its host block. A swap-in
    /// must be emitted by the first step that schedules a holder of its device block or may copy
    /// from it. Those copies must fit (`BufferTooSmall` on `swap_out` / `swap_in` otherwise,
    /// nothing written); the rest fill the remaining room in queue order, a swap-in only when every
    /// swap-out reading its device block or writing its host block is emitted too. A step of no
    /// sequences (and no queued copy-on-write) therefore always makes progress: an engine refused
    /// for a full swap list can drain the queues with empty steps.
    fn plan_swaps(
        &self,
        room_out: usize,
        room_in: usize,
        room_cow: usize,
    ) -> Result<Option<SwapPlan>> {
        let swaps_fit = self.swap_out_q.len() <= room_out && self.swap_in_q.len() <= room_in;
        if swaps_fit
            && (self.pending.len() <= room_cow
                || (self.swap_out_q.is_empty() && self.swap_in_q.is_empty()))
        {
            // Everything is emitted, or only copy-on-write overflows (`emit_copies` plans it).
            return Ok(None);
        }
        let small = |buffer: &'static str, needed: usize, room: usize| Error::BufferTooSmall {
            buffer,
            needed: 2 * needed,
            capacity: 2 * room,
        };
        // Device blocks this step's forward writes: every block of a scheduled table.
        let mut scheduled: FastMap<BlockId, ()> = FastMap::default();
        for &i in &self.batch_idx {
            let s = &self.slots[i as usize];
            let extra = s.extra.iter().flat_map(|t| &t.blocks[t.start..]);
            for &b in s.table.blocks.iter().chain(extra) {
                scheduled.insert(b, ());
            }
        }
        // What the step cannot do without: the copies whose destination or source a scheduled
        // table holds (as `check_step` already made sure fit), the swap-ins such a table or such a
        // copy reads, and the swap-outs of blocks any of those write, or of host blocks those
        // swap-ins read.
        let mut emit_cow: Vec<bool> = self
            .pending
            .iter()
            .map(|&(s0, d)| scheduled.contains_key(&s0) || scheduled.contains_key(&d))
            .collect();
        let cow_src: FastMap<BlockId, ()> = self
            .pending
            .iter()
            .zip(&emit_cow)
            .filter(|&(_, &e)| e)
            .map(|(&(s0, _), _)| (s0, ()))
            .collect();
        let mut emit_in: Vec<bool> = self
            .swap_in_q
            .iter()
            .map(|&(_, d)| scheduled.contains_key(&d) || cow_src.contains_key(&d))
            .collect();
        let mut n_in = emit_in.iter().filter(|&&x| x).count();
        if n_in > room_in {
            return Err(small("swap_in", n_in, room_in));
        }
        let mut written: FastMap<BlockId, ()> = FastMap::default();
        let mut read: FastMap<HostBlockId, ()> = FastMap::default();
        for (&(h, d), _) in self.swap_in_q.iter().zip(&emit_in).filter(|&(_, &e)| e) {
            written.insert(d, ());
            read.insert(h, ());
        }
        for (&(_, d), _) in self.pending.iter().zip(&emit_cow).filter(|&(_, &e)| e) {
            written.insert(d, ());
        }
        let mut emit_out: Vec<bool> = self
            .swap_out_q
            .iter()
            .map(|&(d, h)| {
                scheduled.contains_key(&d) || written.contains_key(&d) || read.contains_key(&h)
            })
            .collect();
        let mut n_out = emit_out.iter().filter(|&&x| x).count();
        let mut drop_out = vec![false; self.swap_out_q.len()];
        if n_out > room_out {
            if let Some(t) = &self.tier {
                // An offload is a cache decision: rather than refuse the step, cancel the newest
                // ones nobody else reads (a queued load of its host block holds a reference too).
                for j in (0..self.swap_out_q.len()).rev() {
                    if n_out <= room_out {
                        break;
                    }
                    let h = self.swap_out_q[j].1;
                    if emit_out[j] && t.pinned[h as usize] && self.host.refcount(h) == Ok(1) {
                        emit_out[j] = false;
                        drop_out[j] = true;
                        n_out -= 1;
                    }
                }
            }
        }
        if n_out > room_out {
            return Err(small("swap_out", n_out, room_out));
        }
        // Then the rest, in queue order while there is room: swap-outs first; a swap-in once
        // every swap-out reading its device block or filling its host block is emitted; a copy
        // once no swap-out still queued reads its destination and no swap-in still queued fills
        // its source.
        for (e, &dropped) in emit_out.iter_mut().zip(&drop_out) {
            if n_out == room_out {
                break;
            }
            if !*e && !dropped {
                *e = true;
                n_out += 1;
            }
        }
        let mut waiting_src: FastMap<BlockId, ()> = FastMap::default();
        let mut waiting_dst: FastMap<HostBlockId, ()> = FastMap::default();
        for (j, &(d, h)) in self.swap_out_q.iter().enumerate() {
            if emit_out[j] || drop_out[j] {
                continue;
            }
            waiting_src.insert(d, ());
            waiting_dst.insert(h, ());
        }
        for (j, &(h, d)) in self.swap_in_q.iter().enumerate() {
            if n_in == room_in {
                break;
            }
            if !emit_in[j] && !waiting_dst.contains_key(&h) && !waiting_src.contains_key(&d) {
                emit_in[j] = true;
                n_in += 1;
            }
        }
        let unfilled: FastMap<BlockId, ()> = self
            .swap_in_q
            .iter()
            .zip(&emit_in)
            .filter(|&(_, &e)| !e)
            .map(|(&(_, d), _)| (d, ()))
            .collect();
        let mut n_cow = emit_cow.iter().filter(|&&x| x).count();
        for (j, &(s0, d)) in self.pending.iter().enumerate() {
            if n_cow == room_cow {
                break;
            }
            if !emit_cow[j] && !waiting_src.contains_key(&d) && !unfilled.contains_key(&s0) {
                emit_cow[j] = true;
                n_cow += 1;
            }
        }
        Ok(Some(SwapPlan {
            emit_out,
            drop_out,
            emit_in,
            emit_cow,
        }))
    }

    /// Writes the pending copies `mask` selects into `copies`, in queue order; the rest stay
    /// queued, in order. Returns the number written.
    fn emit_copies_masked(&mut self, mask: &[bool], copies: &mut [i64]) -> usize {
        drain_selected(&mut self.pending, mask, copies)
    }

    /// Writes the planned swap copies (all when `plan` is `None`) into the step's lists, removes
    /// them from the queues, and drops the host reference each emitted swap-in held. Returns the
    /// pairs written to each list.
    fn emit_swaps(
        &mut self,
        plan: Option<SwapPlan>,
        out: &mut [i64],
        inn: &mut [i64],
    ) -> (usize, usize, Result<()>) {
        if self.swap_out_q.is_empty() && self.swap_in_q.is_empty() {
            return (0, 0, Ok(()));
        }
        let mut result = Ok(());
        let (emit_out, emit_in) = match plan {
            Some(p) if p.drop_out.iter().any(|&d| d) => {
                let queue = std::mem::take(&mut self.swap_out_q);
                let mut emit_out = Vec::with_capacity(queue.len());
                for (j, &(d, h)) in queue.iter().enumerate() {
                    if p.drop_out[j] {
                        if let Err(e) = self.cancel_offload(h) {
                            result = Err(e);
                        }
                    } else {
                        self.swap_out_q.push((d, h));
                        emit_out.push(p.emit_out[j]);
                    }
                }
                (emit_out, p.emit_in)
            }
            Some(p) => (p.emit_out, p.emit_in),
            None => (
                vec![true; self.swap_out_q.len()],
                vec![true; self.swap_in_q.len()],
            ),
        };
        let n_out = drain_selected(&mut self.swap_out_q, &emit_out, out);
        let n_in = drain_selected(&mut self.swap_in_q, &emit_in, inn);
        if self.tier.is_some() {
            // An emitted offload drops the reference that pinned its host block.
            for k in 0..n_out {
                let h = out[2 * k + 1] as HostBlockId;
                let t = self.tier.as_mut().expect("checked");
                if std::mem::take(&mut t.pinned[h as usize]) {
                    if let Err(e) = self.host_drop(h) {
                        result = Err(e);
                    }
                }
            }
        }
        // An emitted swap-in drops the host reference it held: the step's list now names the copy.
        for k in 0..n_in {
            if let Err(e) = self.host_drop(inn[2 * k] as HostBlockId) {
                result = Err(e);
            }
        }
        (n_out, n_in, result)
    }

    /// Writes pending copies into `copies` (room for `copies.len() / 2`), in queue order. When
    /// all fit (`needed` empty) all are written; otherwise every copy the batch needs
    /// (`needed[j]` for `pending[j]`; `check_step` made sure they fit) and others while room
    /// remains, the rest staying queued, in order, for a later step. Returns the number written.
    fn emit_copies(&mut self, needed: &[bool], copies: &mut [i64]) -> usize {
        if needed.is_empty() {
            for (j, &(src, dst)) in self.pending.iter().enumerate() {
                copies[2 * j] = src as i64;
                copies[2 * j + 1] = dst as i64;
            }
            let n = self.pending.len();
            self.pending.clear();
            return n;
        }
        let room = copies.len() / 2;
        // A copy the batch does not need goes only where it leaves room for every needed copy
        // after it.
        let mut needed_left = needed.iter().filter(|&&x| x).count();
        let mut n = 0;
        let mut keep = Vec::new();
        for (j, &(src, dst)) in self.pending.iter().enumerate() {
            if needed[j] {
                needed_left -= 1;
            } else if n + needed_left >= room {
                keep.push((src, dst));
                continue;
            }
            copies[2 * n] = src as i64;
            copies[2 * n + 1] = dst as i64;
            n += 1;
        }
        self.pending = keep;
        n
    }

    /// When more copies are pending than `room`: which of them the batch (`self.batch_idx`)
    /// needs this step — those whose `dst` or `src` a scheduled table holds. A scheduled holder
    /// of `dst` reads and writes it, so its copy must run first; a scheduled holder of `src` may
    /// fill it and have it registered in the prefix cache, and a cached block must not be a
    /// pending src (it could be evicted and reused before the copy runs). Copies of sequences
    /// that are not scheduled may wait. Empty (emit everything) when all pending copies fit.
    /// O(blocks of the batch), paid only in that overflow case.
    fn copies_needed(&self, room: usize) -> Vec<bool> {
        if self.pending.len() <= room {
            return Vec::new();
        }
        let mut at: FastMap<BlockId, Vec<usize>> = FastMap::default();
        for (j, &(src, dst)) in self.pending.iter().enumerate() {
            at.entry(src).or_default().push(j);
            at.entry(dst).or_default().push(j);
        }
        let mut needed = vec![false; self.pending.len()];
        for &i in &self.batch_idx {
            let s = &self.slots[i as usize];
            // Every group's blocks: a copy into any of them must run before this step.
            let extra = s.extra.iter().flat_map(|t| &t.blocks[t.start..]);
            for b in s.table.blocks.iter().chain(extra) {
                if let Some(js) = at.get(b) {
                    for &j in js {
                        needed[j] = true;
                    }
                }
            }
        }
        needed
    }

    /// Validation half of `build_step` (after `resolve_batch`): returns (new tokens, kv indices,
    /// longest sequence, most new tokens of one sequence, whether to write the CSR page table,
    /// which pending copies the batch needs).
    // Out of line: inlined into `build_step`, its loop spilled its values to the stack.
    #[inline(never)]
    fn check_step(
        &self,
        seqs: &[SeqId],
        num_new: &[u32],
        out: &StepBuffers<'_>,
    ) -> Result<(usize, usize, usize, usize, bool, Vec<bool>)> {
        let (mut tokens, mut kv, mut max_len, mut max_blocks) = (0usize, 0usize, 0usize, 0usize);
        let mut max_query = 0usize;
        for (k, &i) in self.batch_idx.iter().enumerate() {
            let t = &self.slots[i as usize].table;
            let n = num_new[k] as usize;
            if n == 0 || n > t.num_tokens {
                return Err(Error::InvalidArgument {
                    what: "num_new",
                    value: n as i64,
                    reason: format!(
                        "must be in 1..={} (length of sequence {})",
                        t.num_tokens, seqs[k]
                    ),
                });
            }
            if self.windowed {
                self.check_computable(seqs[k], i as usize, n)?;
            }
            tokens += n;
            max_query = max_query.max(n);
            kv += t.blocks.len();
            max_len = max_len.max(t.num_tokens);
            max_blocks = max_blocks.max(t.blocks.len());
        }
        let b = seqs.len();
        if tokens > i32::MAX as usize || kv > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "seqs.len",
                value: b as i64,
                reason: format!("step of {tokens} tokens / {kv} blocks overflows int32 offsets"),
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
        // All three CSR buffers empty: the caller does not want the FlashInfer page table.
        let csr = !(out.kv_indptr.is_empty()
            && out.kv_indices.is_empty()
            && out.kv_last_page_len.is_empty());
        small("seq_lens", b, out.seq_lens.len())?;
        small("query_start_loc", b + 1, out.query_start_loc.len())?;
        if csr {
            small("kv_indptr", b + 1, out.kv_indptr.len())?;
            small("kv_last_page_len", b, out.kv_last_page_len.len())?;
        }
        small("slot_mapping", tokens, out.slot_mapping.len())?;
        small("block_table_stride", max_blocks, out.block_table_stride)?;
        small(
            "block_tables",
            b.saturating_mul(out.block_table_stride),
            out.block_tables.len(),
        )?;
        if csr {
            small("kv_indices", kv, out.kv_indices.len())?;
        }
        // Only the copies this batch reads must fit; the rest wait for a later step, so more
        // pending copies than the buffer holds never blocks a step.
        let needed = self.copies_needed(out.copies.len() / 2);
        small(
            "copies",
            2 * needed.iter().filter(|&&x| x).count(),
            out.copies.len(),
        )?;
        Ok((tokens, kv, max_len, max_query, csr, needed))
    }
}

impl BlockManager {
    /// `InvalidArgument` unless every position of the last `n` tokens of `slot` (`seq`) still has
    /// its blocks, and the blocks its queries read, in every windowed group: a group whose table
    /// starts with `start` null entries can compute only from the position where those blocks are
    /// dead ([`release_threshold`]). A prefix hit's null entries and a step's releases set
    /// `start`; a caller recomputing cached tokens past them would read and write released
    /// blocks.
    #[inline(never)]
    fn check_computable(&self, seq: SeqId, slot: usize, n: usize) -> Result<()> {
        let s = &self.slots[slot];
        let len = s.table.num_tokens;
        let first = self
            .kinds
            .iter()
            .zip(&s.extra)
            .filter(|(_, t)| t.start > 0)
            .map(|(&kind, t)| release_threshold(kind, t.start, self.bs))
            .max()
            .unwrap_or(0)
            .max(if s.start0 > 0 {
                release_threshold(self.kind0, s.start0, self.bs)
            } else {
                0
            });
        if len - n < first {
            return Err(Error::InvalidArgument {
                what: "num_new",
                value: n as i64,
                reason: format!(
                    "sequence {seq} has released the blocks of its positions before {first} in a \
                     windowed group; a step may compute at most its last {} of {len} tokens",
                    len - first
                ),
            });
        }
        Ok(())
    }
}

/// The per-sequence half of [`BlockManager::build_step`], after validation: slot mapping, the
/// block-table entries each row lacks, lengths, query offsets and (with `csr`) the page table,
/// for the batch `idx` (slots); pushes onto `register` the slots with full blocks not yet offered
/// to the prefix cache. Out of line, with the batch-length slices cut once up front, so the loop
/// keeps its values in registers and indexes without bounds checks (inlined into `build_step`,
/// it spilled most of them to the stack).
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn write_batch(
    slots: &[Seq],
    idx: &[u32],
    num_new: &[u32],
    bs: usize,
    caching: bool,
    csr: bool,
    out: &mut StepBuffers<'_>,
    marks: &mut [crate::step::RowMark],
    register: &mut Vec<u32>,
) {
    let b = idx.len();
    let stride = out.block_table_stride;
    let num_new = &num_new[..b];
    let marks = &mut marks[..b];
    let seq_lens = &mut out.seq_lens[..b];
    let qsl = &mut out.query_start_loc[..b + 1];
    qsl[0] = 0;
    if csr {
        out.kv_indptr[0] = 0;
    }
    let (mut tok, mut kv) = (0usize, 0usize);
    let rows = idx
        .iter()
        .zip(num_new)
        .zip(marks.iter_mut())
        .zip(seq_lens.iter_mut().zip(qsl[1..].iter_mut()));
    for (k, (((&i, &n), mark), (seq_len, q))) in rows.enumerate() {
        let s = &slots[i as usize];
        let len = s.table.num_tokens;
        let n = n as usize;
        let blocks = s.table.blocks_i32();
        let nb = blocks.len();
        // Tokens in the last block; the table holds exactly ceil(len / B) blocks, so this needs
        // no division (a runtime-divisor `div` per sequence shows up in decode profiles).
        let last_page = len - (nb - 1) * bs;
        if n == 1 {
            out.slot_mapping[tok] = blocks[nb - 1] as i64 * bs as i64 + (last_page - 1) as i64;
        } else {
            let dst = &mut out.slot_mapping[tok..tok + n];
            let mut p = len - n;
            let mut w = 0;
            while p < len {
                let off = p % bs;
                let run = (bs - off).min(len - p);
                let base = blocks[p / bs] as i64 * bs as i64 + off as i64;
                for (j, d) in dst[w..w + run].iter_mut().enumerate() {
                    *d = base + j as i64;
                }
                w += run;
                p += run;
            }
        }
        // Only entries the row does not already hold: in a decode step that is at most one.
        let from = mark.valid_prefix(s.uid, s.version, nb);
        let row = &mut out.block_tables[k * stride + from..k * stride + nb];
        // Zero or one new entry is the decode case: a `memcpy` call per row would cost more.
        match row.len() {
            0 => {}
            1 => row[0] = blocks[nb - 1],
            _ => row.copy_from_slice(&blocks[from..]),
        }
        mark.set(s.uid, s.version, nb);
        // Noted here, while the sequence's state is in cache, rather than in another pass.
        let full = if s.provisional == 0 {
            nb - (last_page < bs) as usize
        } else {
            0
        };
        // A sequence holding provisional tokens is always noted: its step length is recorded for
        // `commit`, and only its committed blocks are offered.
        if caching && (s.registered < full || s.provisional != 0) {
            register.push(i);
        }
        tok += n;
        *seq_len = len as i32;
        *q = tok as i32;
        if csr {
            out.kv_indices[kv..kv + nb].copy_from_slice(blocks);
            kv += nb;
            out.kv_indptr[k + 1] = kv as i32;
            out.kv_last_page_len[k] = last_page as i32;
        }
    }
}

/// Writes the pairs of `queue` that `mask` selects into `out` as `[a0, b0, a1, b1, ...]`, in queue
/// order, keeps the others queued in order, and returns the number of pairs written.
fn drain_selected(queue: &mut Vec<(u32, u32)>, mask: &[bool], out: &mut [i64]) -> usize {
    let (mut n, mut j) = (0, 0);
    queue.retain(|&(a, b)| {
        let emit = mask[j];
        j += 1;
        if emit {
            out[2 * n] = a as i64;
            out[2 * n + 1] = b as i64;
            n += 1;
        }
        !emit
    });
    n
}
