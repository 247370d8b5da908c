//! Admission: the prefix-cache lookup, the `can_admit*` questions and the `admit*` calls.
//!
//! Invariants kept here:
//! - An admission checks everything (id, keys, length, blocks against the watermark) before it
//!   takes a block, so a refused one changes nothing. `can_admit_tokens` runs the same lookup,
//!   read-only, so its answer is exact.
//! - At most `(len - 1) / B` blocks are shared, so at least one prompt token is computed and the
//!   engine never writes into a shared block.
//! - Blocks are allocated for the held tokens only, and the watermark applies to those: the
//!   reserve is for running sequences to grow into.
//! - An admission hashes but does not register: only blocks a step has been built to write can be
//!   hit, so no request in an `admit_batch` hits an earlier one's blocks.

use std::sync::Arc;

use super::tier::registered;
use super::{AdmitRequest, AdmitResult, BlockManager, GroupLoad};
use crate::error::{Error, Result};
use crate::groups::{dead_blocks, NULL_BLOCK};
use crate::hash::{root_hash, Hasher, SeqKeys};
use crate::swap::{HostBlockId, SeqState};
use crate::table::blocks_for;
use crate::{BlockId, SeqId, TokenId};

/// What a prefix-cache lookup found.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Lookup {
    /// `h_{-1}` for the request's salt.
    root: u128,
    /// Leading tokens cached: `(hits.len() + host_hits.len()) * B`.
    cached: usize,
    /// Hits on cached-free blocks: each takes a block off the free count when revived.
    revive: usize,
    /// Verify-mode mismatches (served as misses).
    collisions: u64,
    /// Group 0's hits (device, then host) before the other groups shortened them (blocks).
    group0: usize,
    /// Blocks the host tier adds to the hit: the boundary minus the device-only one.
    host_gain: usize,
}

/// Tokens an admission holds: the cached prefix plus up to `max_new` more (the rest when `None`).
#[inline]
fn held_tokens(len: usize, cached: usize, max_new: Option<usize>) -> usize {
    cached + max_new.map_or(len - cached, |k| k.min(len - cached))
}

pub(super) fn check_max_new(max_new: Option<usize>) -> Result<()> {
    if max_new == Some(0) {
        return Err(Error::InvalidArgument {
            what: "max_new_tokens",
            value: 0,
            reason: "must be >= 1 (at least one prompt token is computed)".into(),
        });
    }
    Ok(())
}

impl BlockManager {
    /// Whether an `num_tokens`-token prompt could be admitted now, ignoring possible prefix hits
    /// (the whole prompt held at once; see [`BlockManager::can_admit_len`] for chunked admission).
    pub fn can_admit(&self, num_tokens: usize) -> bool {
        self.can_admit_len(num_tokens, None).unwrap_or(false)
    }

    /// Whether a prompt of `num_tokens` tokens, admitted holding `min(max_new_tokens, num_tokens)`
    /// of them (all when `None`), fits now if none of it is cached. False for an empty prompt or
    /// one longer than a block-table row; `InvalidArgument` for `max_new_tokens == 0`.
    ///
    /// For a whole prompt (`None`) a `true` is a promise: hits only make an admission cheaper.
    /// For a chunk it is not: a chunked admission holds its cached prefix *plus* the chunk, and a
    /// hit on a cached-free block takes a block off the free count. Pass the token ids to
    /// [`BlockManager::can_admit_tokens`] for the exact answer.
    pub fn can_admit_len(&self, num_tokens: usize, max_new_tokens: Option<usize>) -> Result<bool> {
        check_max_new(max_new_tokens)?;
        if num_tokens == 0 || blocks_for(num_tokens, self.bs) > self.cfg.max_blocks_per_seq as usize
        {
            return Ok(false);
        }
        let held = max_new_tokens.map_or(num_tokens, |k| k.min(num_tokens));
        Ok(self.fits(blocks_for(held, self.bs) * self.num_groups()))
    }

    /// Whether `admit_opts(_, tokens, keys, max_new_tokens)` would succeed now (for a new id),
    /// counting prefix-cache hits: a prompt whose leading blocks are cached needs blocks only for
    /// the rest, and a hit on a cached-free block still takes one block off the free count. False
    /// for an empty prompt or one longer than a block-table row; `InvalidArgument` for malformed
    /// keys or `max_new_tokens == 0`. Read-only: nothing is hashed into the manager's state.
    pub fn can_admit_tokens(
        &self,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<bool> {
        check_max_new(max_new_tokens)?;
        let n = tokens.len();
        if let Some(k) = keys {
            k.validate(n)?;
        }
        if n == 0 || blocks_for(n, self.bs) > self.cfg.max_blocks_per_seq as usize {
            return Ok(false);
        }
        let (mut hashes, mut hits, mut host_hits) = (Vec::new(), Vec::new(), Vec::new());
        let mut loads = Vec::new();
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        let look = self.lookup_root(
            &mut Hasher::new(self.hash_key),
            tokens,
            root,
            extra,
            &mut hashes,
            &mut hits,
            &mut host_hits,
            &mut loads,
            true,
        );
        let held = held_tokens(n, look.cached, max_new_tokens);
        let needed = self.admission_need(
            blocks_for(held, self.bs),
            hits.len(),
            look.cached / self.bs,
            loads.len(),
            look.revive,
        );
        Ok(self.fits(needed))
    }

    /// Whether `needed` blocks can be taken by an admission without dipping into the watermark.
    #[inline]
    fn fits(&self, needed: usize) -> bool {
        needed.saturating_add(self.cfg.watermark_blocks as usize) <= self.num_free_blocks()
    }

    /// Admits a sequence with no hashing keys (empty salt), holding the whole prompt.
    pub fn admit(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<AdmitResult> {
        self.admit_opts(seq, tokens, None, None)
    }

    /// Admits a sequence whose block hashes include `keys`, holding the whole prompt.
    pub fn admit_with(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: &SeqKeys,
    ) -> Result<AdmitResult> {
        self.admit_opts(seq, tokens, Some(keys), None)
    }

    /// Admits a sequence, possibly holding only the first chunk of its prompt (chunked prefill).
    ///
    /// The prefix-cache lookup covers all of `tokens`: the leading run of cached full blocks is
    /// shared, capped at `(len - 1) / B` blocks so at least one prompt token is computed. The
    /// sequence then holds `cached + min(max_new_tokens, len - cached)` tokens (all of them when
    /// `None`); the caller feeds the rest later with [`BlockManager::append`], chunk by chunk.
    /// Blocks are allocated for the held tokens only, and the watermark applies to those.
    /// `SequenceTooLong` is judged on the whole prompt, which the sequence will eventually hold.
    pub fn admit_opts(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<AdmitResult> {
        self.check_admit(seq, tokens, keys, max_new_tokens)?;
        self.admit_checked(seq, tokens, keys, max_new_tokens)
    }

    /// Admits several sequences in order, with one call.
    ///
    /// Validates every request first — non-empty prompts, valid keys and `max_new_tokens`, each
    /// prompt within a block-table row, ids new and distinct — and on any failure returns the
    /// error with nothing admitted. Then admits in order until one request does not fit (out of
    /// blocks, or it would dip into the watermark) and returns the results of those admitted: a
    /// prefix of `reqs`, possibly empty. A request in the batch cannot hit blocks of an earlier
    /// one: blocks enter the prefix cache when a step is built.
    pub fn admit_batch(&mut self, reqs: &[AdmitRequest<'_>]) -> Result<Vec<AdmitResult>> {
        let mut seen: std::collections::HashSet<SeqId, crate::prefix::FastBuild> =
            std::collections::HashSet::with_capacity_and_hasher(reqs.len(), Default::default());
        for r in reqs {
            self.check_admit(r.seq, r.tokens, r.keys, r.max_new_tokens)?;
            if !seen.insert(r.seq) {
                return Err(Error::DuplicateSequence { seq_id: r.seq });
            }
        }
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            match self.admit_checked(r.seq, r.tokens, r.keys, r.max_new_tokens) {
                Ok(a) => out.push(a),
                Err(Error::OutOfBlocks { .. } | Error::WatermarkReached { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Checks of an admission that do not depend on free blocks (the id included).
    fn check_admit(
        &self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: 0,
                reason: "a prompt needs at least one token".into(),
            });
        }
        if self.index.contains_key(&seq) {
            return Err(Error::DuplicateSequence { seq_id: seq });
        }
        check_max_new(max_new_tokens)?;
        if let Some(k) = keys {
            k.validate(n)?;
        }
        let nb = blocks_for(n, self.bs);
        if nb > self.cfg.max_blocks_per_seq as usize {
            return Err(Error::SequenceTooLong {
                seq_id: seq,
                needed_blocks: nb,
                max_blocks_per_seq: self.cfg.max_blocks_per_seq as usize,
            });
        }
        Ok(())
    }

    /// `h_{-1}` for the keys' salt.
    #[inline]
    pub(super) fn root_for(&self, keys: Option<&SeqKeys>) -> u128 {
        match keys {
            Some(k) if self.caching && !k.cache_salt.is_empty() => {
                root_hash(self.hash_key, &k.cache_salt)
            }
            _ => self.empty_root,
        }
    }

    /// The prefix-cache lookup of an admission, under chain root `root` and block-extra keys
    /// `extra`: fills `hits` with the leading run of cached device blocks of group 0, then, with
    /// the host tier on, `host_hits` with group 0's run of host-cached blocks after it, and
    /// `hashes` with at least their chain. With KV cache groups both are cut to the longest
    /// boundary at which every other group has what it reads there (on the device, or in the
    /// host tier: those blocks go to `group_loads`). The host tier's part of the hit (past the
    /// device-only boundary) is dropped again when `load_rule` and loading it does not pay. The
    /// chain is computed in groups of blocks, stopping after the group of the first miss: blocks
    /// past it are hashed when a step registers them, so a cold prompt is not hashed twice.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lookup_root(
        &self,
        hasher: &mut Hasher,
        tokens: &[TokenId],
        root: u128,
        extra: Option<&SeqKeys>,
        hashes: &mut Vec<u128>,
        hits: &mut Vec<BlockId>,
        host_hits: &mut Vec<HostBlockId>,
        group_loads: &mut Vec<GroupLoad>,
        load_rule: bool,
    ) -> Lookup {
        const GROUP: usize = 16;
        let bs = self.bs;
        let mut look = Lookup {
            root,
            ..Lookup::default()
        };
        hashes.clear();
        hits.clear();
        host_hits.clear();
        group_loads.clear();
        if !self.caching {
            return look;
        }
        let max_hit = (tokens.len() - 1) / bs;
        if self.kind0.is_windowed() {
            self.lookup_windowed0(hasher, tokens, extra, hashes, hits, &mut look, max_hit);
            return look;
        }
        for i in 0..max_hit {
            if i == hashes.len() {
                let upto = (i + GROUP).min(max_hit);
                hasher.extend_chain(look.root, &tokens[..upto * bs], bs, extra, hashes);
            }
            let Some(b) = self.prefix.lookup(hashes[i]) else {
                break;
            };
            if !self.prefix.matches(b, &tokens[i * bs..(i + 1) * bs]) {
                look.collisions += 1;
                break;
            }
            hits.push(b);
        }
        let d0 = hits.len();
        if let Some(t) = &self.tier {
            if look.collisions == 0 {
                for i in d0..max_hit {
                    if i == hashes.len() {
                        let upto = (i + GROUP).min(max_hit);
                        hasher.extend_chain(look.root, &tokens[..upto * bs], bs, extra, hashes);
                    }
                    let Some(h) = t.lookup(hashes[i]) else {
                        break;
                    };
                    if t.tokens_of(h) != &tokens[i * bs..(i + 1) * bs] {
                        look.collisions += 1;
                        break;
                    }
                    host_hits.push(h);
                }
            }
        }
        let k0 = d0 + host_hits.len();
        // The device-only boundary, and the one the host tier may extend it to.
        let (k_dev, mut k) = if self.kinds.is_empty() {
            (d0, k0)
        } else {
            let k_dev = self.group_boundary(tokens, hashes, d0, false);
            let k = if self.tier.is_some() && k0 > k_dev {
                self.group_boundary(tokens, hashes, k0, true)
            } else {
                k_dev
            };
            (k_dev, k)
        };
        let plan = |k: usize, loads: &mut Vec<GroupLoad>| {
            loads.clear();
            if self.kinds.is_empty() {
                0
            } else {
                self.group_plan(tokens, hashes, k, loads)
            }
        };
        let mut revive = plan(k, group_loads);
        if load_rule && k > k_dev {
            let loads = k.saturating_sub(d0) + group_loads.len();
            if !self.load_pays(k - k_dev, loads) {
                k = k_dev;
                revive = plan(k, group_loads);
            }
        }
        hits.truncate(k.min(d0));
        host_hits.truncate(k - hits.len());
        look.revive = revive + hits.iter().filter(|&&b| self.prefix.in_lru(b)).count();
        look.group0 = d0.max(k);
        look.host_gain = k - k_dev.min(k);
        look.cached = k * bs;
        look
    }

    /// The lookup of a manager whose every group is windowed (no host tier): the whole prompt's
    /// chain is hashed, the hit is the longest boundary `k` at which every group, group 0
    /// included, has the blocks `[dead_blocks(kind, k * B, B), k)` cached, and `hits` holds
    /// group 0's table at that boundary: null entries, then the hits.
    #[allow(clippy::too_many_arguments)]
    fn lookup_windowed0(
        &self,
        hasher: &mut Hasher,
        tokens: &[TokenId],
        extra: Option<&SeqKeys>,
        hashes: &mut Vec<u128>,
        hits: &mut Vec<BlockId>,
        look: &mut Lookup,
        max_hit: usize,
    ) {
        if max_hit == 0 {
            return;
        }
        hasher.extend_chain(
            look.root,
            &tokens[..max_hit * self.bs],
            self.bs,
            extra,
            hashes,
        );
        let k = self.group_boundary(tokens, hashes, max_hit, false);
        let lo = dead_blocks(self.kind0, k * self.bs, self.bs);
        hits.resize(lo, NULL_BLOCK);
        let mut revive = 0;
        for i in lo..k {
            // Present: `group_boundary` checked it (a verify mismatch counts as a miss there).
            let b = self.group_hit(0, hashes, tokens, i).unwrap_or(NULL_BLOCK);
            revive += (b != NULL_BLOCK && self.prefix.in_lru(b)) as usize;
            hits.push(b);
        }
        let mut loads = Vec::new();
        if !self.kinds.is_empty() {
            revive += self.group_plan(tokens, hashes, k, &mut loads);
        }
        look.revive = revive;
        look.group0 = k;
        look.cached = k * self.bs;
    }

    /// Blocks an admission holding `nb` blocks takes (watermark aside): group 0's past its `kd`
    /// device hits, every other group's past the hit boundary `k`, one per block loaded into
    /// another group from the host tier, and one per cached-free hit revived.
    #[inline]
    fn admission_need(&self, nb: usize, kd: usize, k: usize, loads: usize, revive: usize) -> usize {
        (nb - kd) + self.kinds.len() * (nb - k) + loads + revive
    }

    /// Admission after `check_admit` and the duplicate check: lookup, fit, apply.
    fn admit_checked(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<AdmitResult> {
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        self.admit_core(
            seq,
            tokens,
            tokens.len(),
            root,
            extra,
            None,
            max_new_tokens,
            None,
        )
    }

    /// Lookup, fit and apply of an admission. `n` is the prompt's length (`tokens` holds its ids,
    /// or nothing when prefix caching is off and this is a resume). `shared` is the sequence's own
    /// keys on a resume (reused instead of cloning `extra`), and `resume` its slot: then its
    /// admission order, fork group and slot are kept.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn admit_core(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        n: usize,
        root: u128,
        extra: Option<&SeqKeys>,
        shared: Option<Arc<SeqKeys>>,
        max_new_tokens: Option<usize>,
        resume: Option<usize>,
    ) -> Result<AdmitResult> {
        let bs = self.bs;
        let mut hits = std::mem::take(&mut self.scratch_hits);
        let mut hashes = std::mem::take(&mut self.scratch_hashes);
        let mut host_hits = std::mem::take(&mut self.scratch_host_hits);
        let mut loads = std::mem::take(&mut self.scratch_group_loads);
        let mut hasher = std::mem::take(&mut self.hasher);
        let look = self.lookup_root(
            &mut hasher,
            tokens,
            root,
            extra,
            &mut hashes,
            &mut hits,
            &mut host_hits,
            &mut loads,
            true,
        );
        self.hasher = hasher;
        let held = held_tokens(n, look.cached, max_new_tokens);
        let nb = blocks_for(held, bs);
        // The hit boundary (blocks): group 0's device hits, then its host loads.
        let k = look.cached / bs;
        let new = nb - hits.len();
        let needed = self.admission_need(nb, hits.len(), k, loads.len(), look.revive);
        let avail = self.num_free_blocks();
        let wm = self.cfg.watermark_blocks as usize;
        let err = if needed > avail {
            Some(Error::OutOfBlocks {
                needed,
                available: avail,
            })
        } else if avail - needed < wm {
            Some(Error::WatermarkReached {
                needed,
                available: avail.saturating_sub(wm),
                watermark: wm,
            })
        } else {
            None
        };
        if let Some(e) = err {
            self.scratch_hits = hits;
            self.scratch_hashes = hashes;
            self.scratch_host_hits = host_hits;
            self.scratch_group_loads = loads;
            return Err(e);
        }

        // Validated: apply.
        let slot = match resume {
            Some(i) => i as u32,
            None => self.take_slot(),
        };
        self.last_uid += 1;
        let uid = self.last_uid;
        let (order, group) = match resume {
            Some(i) => (self.slots[i].order, self.slots[i].group),
            None => {
                self.last_order += 1;
                (self.last_order, uid)
            }
        };
        self.slots[slot as usize].table.clear();
        let mut blocks = std::mem::take(&mut self.slots[slot as usize].table.blocks);
        for &b in &hits {
            if b == NULL_BLOCK {
                // Dead at the boundary (a windowed group 0).
                blocks.push(b);
                continue;
            }
            if self.prefix.in_lru(b) {
                self.prefix.lru_remove(b);
                self.pool.incref_mut(b)?;
            } else if self.pool.incref_mut(b)? == 2 {
                self.shared_blocks += 1;
            }
            blocks.push(b);
        }
        let start0 = hits.iter().take_while(|&&b| b == NULL_BLOCK).count();
        self.slots[slot as usize].start0 = start0;
        if self.windowed {
            // Group 0's cached run ends at block `look.group0 - 1`: count this admission there.
            let reach = look
                .group0
                .checked_sub(1)
                .and_then(|j| hashes.get(j))
                .and_then(|&h| self.prefix.lookup(h))
                .map_or(0, |b| self.note_reach(b));
            let s = &mut self.slots[slot as usize];
            s.shared_prefix = look.group0;
            s.shared_reach = reach;
            // Group 0 had the prefix past the hit (another group's window there was gone): this
            // request recomputes it as unhashed duplicates, so group 0's cached copy would age
            // while the prefix is in demand. It becomes the most recent instead, for the windows
            // this request releases there to complete again.
            for &h in hashes.get(k..look.group0).unwrap_or(&[]) {
                if let Some(b) = self.prefix.lookup(h) {
                    if self.prefix.in_lru(b) {
                        self.prefix.lru_remove(b);
                        self.prefix.lru_push(b);
                    }
                }
            }
        }
        if !self.kinds.is_empty() {
            self.slots[slot as usize].table.blocks = blocks;
            self.pin_extra(slot as usize, tokens, &hashes, k, &loads)?;
            blocks = std::mem::take(&mut self.slots[slot as usize].table.blocks);
        } else if self.kind0.is_windowed() {
            self.set_next_release(slot as usize);
        }
        // Host hits are pinned before anything is allocated: an eviction below may offload, and
        // an offload may demote an unreferenced host-cached block, never one of these.
        if let Some(t) = self.tier.as_mut() {
            for h in host_hits.iter().copied().chain(loads.iter().map(|l| l.2)) {
                t.lru.remove(h);
                self.host.incref(h);
            }
        }
        let from_pool = new.min(self.pool.num_free());
        self.pool.allocate_n_mut(from_pool, &mut blocks)?;
        for _ in from_pool..new {
            let b = self.evict_block()?;
            blocks.push(b);
        }
        if !self.kinds.is_empty() {
            self.grow_extra(slot as usize, nb - k)?;
            self.load_extra(slot as usize, tokens, &hashes, look.root, &loads)?;
        }
        let g = hits.len();
        for (k, &h) in host_hits.iter().enumerate() {
            let (i, b) = (g + k, blocks[g + k]);
            let toks = &tokens[i * bs..(i + 1) * bs];
            if self.prefix.register(b, hashes[i], toks) {
                Self::note_block_group(&mut self.block_group, b, 0);
                registered(
                    self.tier.as_mut(),
                    &mut self.host,
                    &mut self.events,
                    b,
                    hashes[i],
                    0,
                    i.checked_sub(1).map(|p| hashes[p]),
                    look.root,
                    toks,
                );
            }
            // The queued load holds the host reference taken above until a step emits it.
            self.swap_in_q.push((h, b));
        }
        let s = &mut self.slots[slot as usize];
        s.table.blocks = blocks;
        s.table.num_tokens = held;
        s.tokens.clear();
        s.hashes.clear();
        if self.caching {
            s.tokens.extend_from_slice(&tokens[..held]);
            // Only hashes of blocks the sequence holds in full; the step extends the chain.
            hashes.truncate(held / bs);
            std::mem::swap(&mut s.hashes, &mut hashes);
        }
        s.registered = hits.len() + host_hits.len();
        s.root = look.root;
        s.keys = match shared {
            Some(k) => Some(k),
            None => extra.map(|k| Arc::new(k.clone())),
        };
        s.tail_maybe_shared = false;
        s.provisional = 0;
        s.stepped = 0;
        s.uid = uid;
        s.version = 0;
        s.state = SeqState::Running;
        s.order = order;
        s.group = group;
        self.index.insert(seq, slot);
        self.gen += 1;
        self.used_tokens += held as u64;
        if self.caching {
            self.counters.prefix_query_tokens += n as u64;
            self.counters.prefix_hit_tokens += look.cached as u64;
            self.counters.prefix_collisions += look.collisions;
            self.counters.host_hit_tokens += (look.host_gain * bs) as u64;
            self.counters.host_loaded_blocks += (host_hits.len() + loads.len()) as u64;
        }
        let host_cached = look.host_gain * bs;
        let taken = needed - look.revive;
        self.scratch_hits = hits;
        self.scratch_hashes = hashes;
        self.scratch_host_hits = host_hits;
        self.scratch_group_loads = loads;
        Ok(AdmitResult {
            cached_tokens: look.cached as u32,
            cached_tokens_gpu: (look.cached - host_cached) as u32,
            cached_tokens_host: host_cached as u32,
            new_blocks: taken as u32,
            num_blocks: nb as u32,
            num_tokens: held as u32,
        })
    }
}
