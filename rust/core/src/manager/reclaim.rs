//! Reclamation under memory pressure: swap-out and swap-in, preemption by recompute and
//! `resume`, victim choice, and the cost model's swap-or-recompute decision.
//!
//! Invariants kept here:
//! - A swapped-out sequence's tables hold host block ids only, never a mix: with KV cache groups,
//!   every group's table, its released entries still null (`NULL_BLOCK`), the same as before the
//!   swap; swap-in restores each table entry for entry. A sequence preempted
//!   by recompute holds no blocks but keeps its length and token ids, so `resume` is an admission
//!   of the same prompt and hits whatever of it stayed cached.
//! - A block shared within the swapped group is copied once, to one host block they all hold, and
//!   is shared again on the device after swap-in: a swap round trip never multiplies a fork
//!   group's memory.
//! - While a block's content is on the host it is not findable by prefix lookups; swap-in
//!   registers it again unless the prefix cache was reset meanwhile (`swap_epoch`).
//! - Victims are a whole fork group, the most recently admitted: its members share blocks, so
//!   only together do they free them.
//! - Every call checks fully first, so a refused swap, resume or decision changes nothing.

use super::admit::check_max_new;
use super::groups::{register_group_blocks, TierSide};
use super::tier::registered;
use super::{AdmitResult, BlockManager};
use crate::error::{Error, Result};
use crate::groups::{dead_blocks, group_hash, NULL_BLOCK};
use crate::prefix::FastMap;
use crate::swap::{CostModel, Decision, HostBlockId, PreemptMode, SeqState};
use crate::table::blocks_for;
use crate::{BlockId, SeqId};

impl BlockManager {
    /// Resolves `seqs` (known, distinct, each in `want`) to slots, in order.
    fn resolve_in_state(
        &mut self,
        seqs: &[SeqId],
        want: SeqState,
        expected: &'static str,
    ) -> Result<Vec<usize>> {
        if seqs.is_empty() {
            return Err(Error::InvalidArgument {
                what: "seqs.len",
                value: 0,
                reason: "needs at least one sequence".into(),
            });
        }
        let mut out = Vec::with_capacity(seqs.len());
        self.for_each_distinct(seqs, |id, i, s| {
            if s.state != want {
                return Err(Error::InvalidSequenceState {
                    seq_id: id,
                    state: s.state.name(),
                    expected,
                });
            }
            out.push(i);
            Ok(())
        })?;
        Ok(out)
    }

    /// Where the current content of device block `b` will be when the queued copies run: the host
    /// block of a queued swap-in filling `b` (directly, or through the copy-on-write that fills
    /// it), else the device block to read (`b`, or the source of the copy-on-write filling it).
    fn content_origin(&self, b: BlockId) -> std::result::Result<HostBlockId, BlockId> {
        let src = if self.pending.is_empty() {
            b
        } else {
            self.pending
                .iter()
                .find(|&&(_, d)| d == b)
                .map_or(b, |&(s0, _)| s0)
        };
        match self.swap_in_q.iter().find(|&&(_, d)| d == src) {
            Some(&(h, _)) => Ok(h),
            None => Err(src),
        }
    }

    /// Moves running sequences to the host pool and frees their device blocks; returns the
    /// device → host copies to make, `(device_block, host_block)`.
    ///
    /// Every held block of every KV cache group moves (one copy per distinct block; pages are
    /// group-agnostic, so the pairs of all groups share the one list); released entries of a
    /// windowed group stay null. A block shared by several of `seqs` (a forked group) is copied
    /// once, to one host block they all hold. A block shared with a sequence not in `seqs` is copied too and stays on the
    /// device for its other holders. Device blocks that lose their last holder are freed at once
    /// (and may be handed out again before the next step), hashed ones dropped from the prefix
    /// cache first: a swapped-out block is not findable by prefix lookups until it is swapped back
    /// in, when it is registered again (unless its hash was taken meanwhile, or the cache reset).
    ///
    /// The same pairs are queued and emitted by the next `build_step` into `swap_out`; the engine
    /// runs them before anything else of that step (see `step` for the order). A block whose
    /// content is still to arrive by a queued swap-in is not copied: the sequence takes that host
    /// block back. The sequences become `Swapped` (block tables of host ids; not schedulable) and
    /// count as swap preemptions.
    ///
    /// Errors, with nothing changed: `UnknownSequence`; `InvalidSequenceState` for one not
    /// running; `InvalidArgument` for an empty list or a repeated id; `OutOfHostBlocks` when the
    /// host pool lacks the blocks (always with `num_host_blocks == 0`).
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, HostBlockId)>> {
        let slots = self.resolve_in_state(seqs, SeqState::Running, "running")?;
        // Host blocks needed: one per distinct device block (of any group) whose content is not
        // already on the host, provisional tokens' own blocks left out (the rewind drops them).
        let mut seen: FastMap<BlockId, ()> = FastMap::default();
        let mut needed = 0usize;
        for &i in &slots {
            let s = &self.slots[i];
            let keep = blocks_for(s.table.num_tokens - s.provisional, self.bs);
            let extra = s.extra.iter().flat_map(|t| &t.blocks[t.start..keep]);
            for &b in s.table.blocks[s.start0..keep].iter().chain(extra) {
                if seen.insert(b, ()).is_none() && self.content_origin(b).is_err() {
                    needed += 1;
                }
            }
        }
        // Swapped blocks always win: unreferenced host-cached blocks count as available (taking
        // one demotes it).
        let available = self.host_blocks_available();
        if needed > available {
            return Err(Error::OutOfHostBlocks { needed, available });
        }
        // Apply. Provisional tokens are dropped first, as `rewind` does (fewer blocks to copy).
        let mut rewound = Ok(());
        for &i in &slots {
            if let Err(e) = self.settle(i, 0, &[]) {
                rewound = Err(e);
            }
        }
        // First map every device block to its host block (queueing the copies) for all
        // sequences and groups, while the pending copies the mapping consults are all still
        // there; then drop the device references. Released (null) entries stay null.
        let mut map: FastMap<BlockId, HostBlockId> = FastMap::default();
        let mut pairs = Vec::with_capacity(needed);
        let mut device_tables = Vec::with_capacity(slots.len());
        for &i in &slots {
            let n0 = self.slots[i].table.blocks.len();
            let mut hosts = Vec::with_capacity(n0);
            let lo0 = self.slots[i].start0;
            hosts.resize(lo0, NULL_BLOCK);
            for j in lo0..n0 {
                let b = self.slots[i].table.blocks[j];
                hosts.push(self.host_for(b, &mut map, &mut pairs)?);
            }
            let mut extra_devices = Vec::with_capacity(self.kinds.len());
            for g in 0..self.kinds.len() {
                let t = &self.slots[i].extra[g];
                let (lo, len) = (t.start, t.blocks.len());
                let mut hs = Vec::with_capacity(len);
                hs.resize(lo, NULL_BLOCK);
                for j in lo..len {
                    let b = self.slots[i].extra[g].blocks[j];
                    hs.push(self.host_for(b, &mut map, &mut pairs)?);
                }
                let t = &mut self.slots[i].extra[g];
                t.version += 1;
                extra_devices.push(std::mem::replace(&mut t.blocks, hs));
            }
            // The tables now name host blocks only.
            let device = std::mem::replace(&mut self.slots[i].table.blocks, hosts);
            device_tables.push((device, extra_devices));
        }
        let mut result = rewound;
        // Held windows are not the sequence's to keep while it is off the device.
        for &i in &slots {
            if let Err(e) = self.drop_held(i) {
                result = Err(e);
            }
        }
        for (&i, (device, extra)) in slots.iter().zip(&device_tables) {
            // Tail first, as `free` does, the groups interleaved by position.
            let starts: Vec<usize> = self.slots[i].extra.iter().map(|t| t.start).collect();
            for (j, &b) in device.iter().enumerate().rev() {
                for (&lo, d) in starts.iter().zip(extra) {
                    if j >= lo {
                        if let Err(e) = self.drop_device_unhashed(d[j]) {
                            result = Err(e);
                        }
                    }
                }
                if b == NULL_BLOCK {
                    continue;
                }
                if let Err(e) = self.drop_device_unhashed(b) {
                    result = Err(e);
                }
            }
            let epoch = self.cache_epoch;
            let s = &mut self.slots[i];
            s.state = SeqState::Swapped;
            s.version += 1;
            s.tail_maybe_shared = false;
            s.swap_epoch = epoch;
            self.used_tokens -= s.table.num_tokens as u64;
        }
        self.swap_out_q.extend_from_slice(&pairs);
        self.counters.swapped_out_blocks += pairs.len() as u64;
        self.counters.preemptions_swap += slots.len() as u64;
        self.gen += 1;
        result.map(|_| pairs)
    }

    /// The host block a swap-out maps device block `b` to, taking a reference to it: the one
    /// `map` already gave `b`, the host block of a queued swap-in still filling it, or a fresh
    /// one (queueing the copy into `pairs`).
    fn host_for(
        &mut self,
        b: BlockId,
        map: &mut FastMap<BlockId, HostBlockId>,
        pairs: &mut Vec<(BlockId, HostBlockId)>,
    ) -> Result<HostBlockId> {
        if let Some(&h) = map.get(&b) {
            self.host.incref(h);
            return Ok(h);
        }
        let h = match self.content_origin(b) {
            Ok(h0) => {
                self.host.incref(h0);
                h0
            }
            Err(src) => {
                let h = self.take_host_block()?;
                pairs.push((src, h));
                h
            }
        };
        map.insert(b, h);
        Ok(h)
    }

    /// Drops one reference to device block `b` for a swap-out: a block left unreferenced loses
    /// its hash (so it is not findable while its content is on the host) and is freed.
    fn drop_device_unhashed(&mut self, b: BlockId) -> Result<()> {
        match self.pool.decref_mut(b)? {
            0 => {
                if let Some(key) = self.prefix.hash_of(b) {
                    // The block's group and chain hash (a windowed group's block too).
                    self.gpu_removed(b, key);
                }
                self.prefix.unregister(b);
                self.unreferenced(b)
            }
            1 => {
                self.shared_blocks -= 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Brings swapped-out sequences back to the device; returns the host → device copies to
    /// make, `(host_block, device_block)`.
    ///
    /// Allocates one device block per distinct host block of `seqs`, over every KV cache group's
    /// table (a block the group shares on the host is shared on the device again; released
    /// entries stay null). Like an admission it must leave the watermark
    /// free. The pairs are queued and emitted by the next `build_step` into `swap_in`; each host
    /// block is released once the step that emits its copy has been built. Full blocks are
    /// offered to the prefix cache again under their hashes (group `g`'s under `group_hash(h, g)`). The sequences become `Running`,
    /// with their admission order and fork group unchanged.
    ///
    /// Errors, with nothing changed: `UnknownSequence`; `InvalidSequenceState` for one not
    /// swapped out; `InvalidArgument` for an empty list or a repeated id; `OutOfBlocks` or
    /// `WatermarkReached`.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(HostBlockId, BlockId)>> {
        let slots = self.resolve_in_state(seqs, SeqState::Swapped, "swapped")?;
        let mut seen: FastMap<HostBlockId, ()> = FastMap::default();
        for &i in &slots {
            let s = &self.slots[i];
            let extra = s.extra.iter().flat_map(|t| &t.blocks[t.start..]);
            for &h in s.table.blocks[s.start0..].iter().chain(extra) {
                seen.insert(h, ());
            }
        }
        let needed = seen.len();
        let avail = self.num_free_blocks();
        let wm = self.cfg.watermark_blocks as usize;
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        if avail - needed < wm {
            return Err(Error::WatermarkReached {
                needed,
                available: avail.saturating_sub(wm),
                watermark: wm,
            });
        }
        let mut map: FastMap<HostBlockId, BlockId> = FastMap::default();
        let mut pairs = Vec::with_capacity(needed);
        let bs = self.bs;
        let mut result = Ok(());
        for &i in &slots {
            let hosts = std::mem::take(&mut self.slots[i].table.blocks);
            let mut device = Vec::with_capacity(hosts.len());
            for &h in &hosts {
                device.push(if h == NULL_BLOCK {
                    NULL_BLOCK
                } else {
                    self.device_for(h, &mut map, &mut pairs)?
                });
            }
            let mut extra_hosts = Vec::with_capacity(self.kinds.len());
            for g in 0..self.kinds.len() {
                let hs = std::mem::take(&mut self.slots[i].extra[g].blocks);
                let lo = self.slots[i].extra[g].start;
                let mut ds = Vec::with_capacity(hs.len());
                ds.resize(lo, NULL_BLOCK);
                for &h in &hs[lo..] {
                    ds.push(self.device_for(h, &mut map, &mut pairs)?);
                }
                let t = &mut self.slots[i].extra[g];
                t.blocks = ds;
                t.version += 1;
                extra_hosts.push((lo, hs));
            }
            for (j, &h) in hosts.iter().enumerate().rev() {
                for (lo, hs) in &extra_hosts {
                    if j >= *lo {
                        if let Err(e) = self.host_drop(hs[j]) {
                            result = Err(e);
                        }
                    }
                }
                if h == NULL_BLOCK {
                    continue;
                }
                if let Err(e) = self.host_drop(h) {
                    result = Err(e);
                }
            }
            let epoch = self.cache_epoch;
            let s = &mut self.slots[i];
            s.table.blocks = device;
            if self.caching && s.swap_epoch == epoch {
                let upto = s.registered.min(s.hashes.len());
                for j in s.start0..upto {
                    let toks = &s.tokens[j * bs..(j + 1) * bs];
                    let b = s.table.blocks[j];
                    if self.prefix.register(b, s.hashes[j], toks) {
                        Self::note_block_group(&mut self.block_group, b, 0);
                        // No write-through here: the block's content arrives by this very swap-in.
                        registered(
                            self.tier.as_mut(),
                            &mut self.host,
                            &mut self.events,
                            b,
                            s.hashes[j],
                            0,
                            j.checked_sub(1).map(|p| s.hashes[p]),
                            s.root,
                            toks,
                        );
                    }
                }
                // Every other group's blocks under (hash, group), as the step registered them,
                // each announced for its group.
                let mut side = TierSide {
                    tier: self.tier.as_mut(),
                    host: &mut self.host,
                    counters: &mut self.counters,
                    swap_out_q: &mut self.swap_out_q,
                    write_through: false,
                };
                register_group_blocks(
                    &mut self.prefix,
                    &mut self.block_group,
                    &mut self.events,
                    &mut side,
                    s,
                    bs,
                    0,
                    upto,
                );
            }
            s.state = SeqState::Running;
            s.version += 1;
            // Another member of the group may hold the same tail again.
            s.tail_maybe_shared = s.table.num_tokens % bs != 0;
            self.used_tokens += s.table.num_tokens as u64;
        }
        self.swap_in_q.extend_from_slice(&pairs);
        self.counters.swapped_in_blocks += pairs.len() as u64;
        self.gen += 1;
        result.map(|_| pairs)
    }

    /// The device block a swap-in maps host block `h` to: the one `map` already gave `h` (one
    /// more reference), or a fresh one whose copy is queued into `pairs` (the queued copy holds
    /// a reference to `h` until a step emits it).
    fn device_for(
        &mut self,
        h: HostBlockId,
        map: &mut FastMap<HostBlockId, BlockId>,
        pairs: &mut Vec<(HostBlockId, BlockId)>,
    ) -> Result<BlockId> {
        if let Some(&b) = map.get(&h) {
            if self.pool.incref_mut(b)? == 2 {
                self.shared_blocks += 1;
            }
            return Ok(b);
        }
        let b = self.alloc_block()?;
        self.host.incref(h);
        pairs.push((h, b));
        map.insert(h, b);
        Ok(b)
    }

    /// Preempts a sequence by recompute: frees its blocks (hashed full blocks stay cached-free,
    /// so a later [`BlockManager::resume`] can hit them) but keeps its length and, with prefix
    /// caching on, its token ids. A swapped-out sequence may be dropped to this state too (its
    /// host blocks are freed; counted as a swap preemption already, not again). Errors
    /// (`UnknownSequence`, `InvalidSequenceState` when already preempted by recompute) change
    /// nothing.
    pub fn recompute(&mut self, seq: SeqId) -> Result<()> {
        let i = self.slot_of(seq)?;
        let state = self.slots[i].state;
        if state == SeqState::Recompute {
            return Err(Error::InvalidSequenceState {
                seq_id: seq,
                state: state.name(),
                expected: "running or swapped",
            });
        }
        // Provisional tokens are dropped first, as `rewind` does (only a running one holds any).
        let rewound = self.settle(i, 0, &[]);
        let result = self.release_table(i).and(rewound);
        if state == SeqState::Running {
            self.counters.preemptions_recompute += 1;
        }
        let s = &mut self.slots[i];
        s.state = SeqState::Recompute;
        s.version += 1;
        s.tail_maybe_shared = false;
        self.gen += 1;
        result
    }

    /// Re-admits a sequence preempted by recompute from its kept tokens, as
    /// [`BlockManager::admit_opts`] would with the same prompt and keys: the prefix-cache lookup
    /// covers all kept tokens, and the sequence holds `cached + min(max_new_tokens, len - cached)`
    /// of them (the rest is appended later, chunk by chunk). Keeps its id, admission order and fork
    /// group. Errors change nothing: `UnknownSequence`, `InvalidSequenceState` (not preempted by
    /// recompute), `InvalidArgument` (`max_new_tokens == 0`), `OutOfBlocks`, `WatermarkReached`.
    pub fn resume(&mut self, seq: SeqId, max_new_tokens: Option<usize>) -> Result<AdmitResult> {
        let i = self.slot_of(seq)?;
        let s = &self.slots[i];
        if s.state != SeqState::Recompute {
            return Err(Error::InvalidSequenceState {
                seq_id: seq,
                state: s.state.name(),
                expected: "preempted by recompute",
            });
        }
        check_max_new(max_new_tokens)?;
        let n = s.table.num_tokens;
        let root = s.root;
        let keys = s.keys.clone();
        let tokens = std::mem::take(&mut self.slots[i].tokens);
        let r = self.admit_core(
            seq,
            &tokens,
            n,
            root,
            keys.as_deref(),
            keys.clone(),
            max_new_tokens,
            Some(i),
        );
        if r.is_err() {
            // Nothing was applied: the sequence keeps its tokens and state.
            self.slots[i].tokens = tokens;
        }
        r
    }

    /// The next victim: the running sequences of the most recently admitted fork group (a
    /// forked child counts as admitted with its parent; swap and recompute keep the order), in
    /// creation order. `None` when nothing runs. O(sequences).
    pub fn choose_victim(&self) -> Option<Vec<SeqId>> {
        let mut best: Option<(u64, u64)> = None;
        for &i in self.index.values() {
            let s = &self.slots[i as usize];
            if s.state == SeqState::Running && best.is_none_or(|(o, _)| s.order > o) {
                best = Some((s.order, s.group));
            }
        }
        let (_, group) = best?;
        let mut members: Vec<(u64, SeqId)> = self
            .index
            .iter()
            .filter(|&(_, &i)| {
                let s = &self.slots[i as usize];
                s.state == SeqState::Running && s.group == group
            })
            .map(|(&id, &i)| (self.slots[i as usize].uid, id))
            .collect();
        members.sort_unstable();
        Some(members.into_iter().map(|(_, id)| id).collect())
    }

    /// The cost model's choice for preempting the running `seqs` together (usually what
    /// [`BlockManager::choose_victim`] returned), with both estimates; each step is assumed to
    /// carry one decode token per running sequence outside `seqs` beside the recompute
    /// ([`BlockManager::decide_beside`] takes another figure).
    pub fn decide(&mut self, seqs: &[SeqId], model: &CostModel) -> Result<Decision> {
        self.decide_beside(seqs, model, None)
    }

    /// [`BlockManager::decide`] with the tokens of other work a step carries given
    /// (`batch_tokens`; `None` counts the running sequences outside `seqs`).
    ///
    /// Swap: 2 × the KV bytes of their distinct device blocks (whole blocks, every KV cache
    /// group's, less the blocks only provisional tokens fill: a swap rewinds them) over the host
    /// link. Recompute: for each sequence, the tokens past the leading
    /// full blocks that would stay cached after the preemption (blocks also held by sequences
    /// outside `seqs`; with groups, the longest boundary at which every group's blocks, found
    /// under (hash, group), would stay cached, as an admission's lookup decides), at least one
    /// token, summed over the sequences (so × branches for a forked group), costed by
    /// [`CostModel::recompute_cost`] beside `batch_tokens`. The mode is swap when the host pool
    /// has room for it and it is strictly cheaper. Read-only. Errors: as
    /// [`BlockManager::swap_out`]'s checks, and `InvalidArgument` for a rate that is not finite
    /// and > 0 (a floor < 0).
    pub fn decide_beside(
        &mut self,
        seqs: &[SeqId],
        model: &CostModel,
        batch_tokens: Option<u64>,
    ) -> Result<Decision> {
        model.validate()?;
        let slots = self.resolve_in_state(seqs, SeqState::Running, "running")?;
        let bs = self.bs;
        // References the victims hold per block: a block survives if others hold it too.
        let mut held: FastMap<BlockId, u32> = FastMap::default();
        let mut host_needed = 0u64;
        for &i in &slots {
            let s = &self.slots[i];
            // A swap rewinds provisional tokens first: their own blocks do not travel.
            let keep = blocks_for(s.table.num_tokens - s.provisional, bs);
            let extra = s.extra.iter().flat_map(|t| &t.blocks[t.start..keep]);
            for &b in s.table.blocks[s.start0..keep].iter().chain(extra) {
                let c = held.entry(b).or_insert(0);
                if *c == 0 && self.content_origin(b).is_err() {
                    host_needed += 1;
                }
                *c += 1;
            }
        }
        let survives = |b: BlockId| -> Result<bool> {
            Ok(self.prefix.hash_of(b).is_some()
                && self.pool.refcount(b)? > held.get(&b).copied().unwrap_or(0))
        };
        let mut tokens = 0u64;
        for &i in &slots {
            let s = &self.slots[i];
            let t = &s.table;
            let len = t.num_tokens;
            let max_hit = (len - 1) / bs;
            let mut hits = 0usize;
            if self.caching {
                if self.kind0.is_windowed() {
                    // Every group windowed: group 0's hits are not a leading run either; the
                    // checks below start from the whole prompt.
                    hits = max_hit;
                } else {
                    for &b in t.blocks.iter().take(max_hit) {
                        if !survives(b)? {
                            break;
                        }
                        hits += 1;
                    }
                }
                // With KV cache groups a hit is a boundary at which every group has what it
                // needs (for a windowed group, the window ending there), as the admission's
                // lookup decides: the longest boundary whose blocks of every group, found under
                // (hash, group), survive.
                let first = if self.kind0.is_windowed() { 0 } else { 1 };
                let complete = |k: usize| -> Result<bool> {
                    let kinds = std::iter::once(&self.kind0).skip(first);
                    for (gi, &kind) in kinds.chain(&self.kinds).enumerate() {
                        for j in dead_blocks(kind, k * bs, bs)..k {
                            let found = match s.hashes.get(j) {
                                Some(&h) => self.prefix.lookup(group_hash(h, gi + first)),
                                None => None,
                            };
                            if !found.map_or(Ok(false), survives)? {
                                return Ok(false);
                            }
                        }
                    }
                    Ok(true)
                };
                while hits > 0 && !complete(hits)? {
                    hits -= 1;
                }
            }
            tokens += (len - hits * bs) as u64;
        }
        let swap_blocks = held.len() as u64;
        let swap_cost_s = model.swap_cost(swap_blocks, bs as u64);
        let batch_tokens = batch_tokens.unwrap_or_else(|| {
            let running = self
                .index
                .values()
                .filter(|&&i| self.slots[i as usize].state == SeqState::Running)
                .count();
            running.saturating_sub(slots.len()) as u64
        });
        let recompute_cost_s = model.recompute_cost(tokens, batch_tokens);
        let swap_possible = host_needed as usize <= self.host_blocks_available();
        let mode = if swap_possible && swap_cost_s < recompute_cost_s {
            PreemptMode::Swap
        } else {
            PreemptMode::Recompute
        };
        Ok(Decision {
            mode,
            swap_cost_s,
            recompute_cost_s,
            swap_possible,
            swap_blocks,
            recompute_tokens: tokens,
            batch_tokens,
        })
    }
}
