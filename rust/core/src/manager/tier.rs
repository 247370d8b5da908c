//! The host tier's side of the manager: offload, demotion, load-or-recompute, the fetch from
//! lower tiers (`lookup_tiers`, `reserve_host_blocks`, `commit_host_blocks`; with KV cache groups
//! `lookup_tiers_groups` and `commit_host_blocks_in_groups`, every group's blocks under their
//! group's keys) and `take_demotions` (each demotion naming its group).
//! The index itself and the host-block states are described in [`crate::tier`].
//!
//! Rules kept here (see also `docs/tiers.md`):
//! - **Write-back** (default): an allocation that evicts a hashed cached-free device block whose
//!   hash is not in the host index takes a host block (a free one, else the oldest host-cached
//!   one: a demotion), indexes it and queues the `(device, host)` copy on the swap-out list. The
//!   device block may be handed out by the same call: the step's lists run before its forward, so
//!   the copy reads the old content. **Write-through**: the offload is queued when a step
//!   registers the block instead; it is emitted by the next step, after the forward that wrote it.
//! - **Loads**: an admission's lookup continues in the host index after its device hits. Each
//!   host hit takes a host reference (before any allocation, so it cannot be demoted by the
//!   admission's own offloads), gets a fresh device block registered under the hash, and queues
//!   the `(host, device)` copy on the swap-in list. The device block is findable at once: a second
//!   admission may share it, since any step that schedules a holder emits the load before its
//!   forward (the swap-in rule of `build_step`).
//!   With KV cache groups every group's blocks are offloaded and indexed under their group's
//!   key (`group_hash(h_j, g)`), and the admission takes the longest boundary every group
//!   completes from the device or the host (see `groups.rs`).
//! - **Load or recompute**: a run of host hits shorter than `host_load_min_blocks`, or (with a
//!   cost model) one whose copy over the host link would take longer than its prefill, is
//!   recomputed instead. With groups the run is the boundary the host adds, and the copy counts
//!   every block it loads, of every group.
//! - **Demotions** are handed to the engine by `take_demotions`; the demoted host block's bytes
//!   are intact until the next step's lists run or the engine writes a reserved block.

use super::BlockManager;
use crate::error::{Error, Result};
use crate::events::{KvEventRing, Medium};
use crate::groups::{group_hash, group_unhash};
use crate::hash::{Hasher, SeqKeys};
use crate::metrics::Counters;
use crate::swap::{CostModel, HostBlockId, HostPool};
use crate::tier::{Demotion, HostTier, TierLookup};
use crate::{BlockId, TokenId};

/// What [`BlockManager::lookup_tiers_groups`] answers: the prompt's chain hashes (the full
/// blocks an admission may share), its salt digest, and per group which blocks the device or
/// the host tier holds.
pub type GroupPresence = (Vec<u128>, u128, Vec<Vec<bool>>);

/// Takes one host block with refcount 1: a free one, else (with the tier on) the oldest
/// unreferenced host-cached one, demoting it. `None` when neither exists: every host block is
/// referenced (swapped, loading, reserved), and those are never taken.
pub(super) fn host_take(
    tier: Option<&mut HostTier>,
    host: &mut HostPool,
    events: &mut KvEventRing,
    counters: &mut Counters,
) -> Option<HostBlockId> {
    if host.num_free() > 0 {
        return host.allocate().ok();
    }
    let t = tier?;
    let h = t.lru.pop_front()?;
    let (key, parent, salt_digest) = t.meta(h);
    let g = t.group_of(h);
    let tokens = t.tokens_of(h).to_vec();
    t.unindex(h);
    events.removed_in(Medium::Host, g as u32, group_unhash(key, g));
    counters.demotions += 1;
    t.demotions.push(Demotion {
        host_block: h,
        hash: key,
        parent: parent.map(|p| group_hash(p, g)),
        group: g as u32,
        salt_digest,
        tokens,
    });
    host.claim(h);
    Some(h)
}

/// Keeps device block `b` (group `g`'s block under cache key `key`, holding `tokens`; `parent`
/// is the chain hash before it) in the host tier: unless the key is already there, takes a host
/// block, indexes it, pins it for the queued copy and queues `(b, host)` on the swap-out list.
/// Skipped when no host block can be taken.
#[allow(clippy::too_many_arguments)]
pub(super) fn offload(
    tier: &mut HostTier,
    host: &mut HostPool,
    events: &mut KvEventRing,
    counters: &mut Counters,
    swap_out_q: &mut Vec<(BlockId, HostBlockId)>,
    b: BlockId,
    key: u128,
    g: usize,
    parent: Option<u128>,
    salt: u128,
    tokens: &[TokenId],
) {
    if tier.lookup(key).is_some() {
        return;
    }
    let Some(h) = host_take(Some(&mut *tier), host, events, counters) else {
        return;
    };
    tier.index(h, key, g, parent, salt, tokens);
    tier.pinned[h as usize] = true;
    swap_out_q.push((b, h));
    events.stored_in(Medium::Host, g as u32, group_unhash(key, g), parent, tokens);
    counters.offloaded_blocks += 1;
}

/// Drops host-cached block `h` from the index (recording its removal for its group).
pub(super) fn host_unindex(t: &mut HostTier, events: &mut KvEventRing, h: HostBlockId) {
    let g = t.group_of(h);
    let key = t.unindex(h);
    events.removed_in(Medium::Host, g as u32, group_unhash(key, g));
}

/// After device block `b` was registered for group `g` under cache key `key` (chain hash
/// `group_unhash(key, g)`, `parent` the chain hash before it): records the event and, with the
/// tier on, the block's chain metadata; a host entry under the same key with other token ids (a
/// bad commit) is dropped, the device content being the one steps computed.
#[allow(clippy::too_many_arguments)]
pub(super) fn registered(
    tier: Option<&mut HostTier>,
    host: &mut HostPool,
    events: &mut KvEventRing,
    b: BlockId,
    key: u128,
    g: usize,
    parent: Option<u128>,
    salt: u128,
    tokens: &[TokenId],
) {
    events.stored_in(Medium::Gpu, g as u32, group_unhash(key, g), parent, tokens);
    let Some(t) = tier else {
        return;
    };
    t.note_device(b, parent, salt);
    if let Some(h) = t.lookup(key) {
        if t.tokens_of(h) != tokens {
            let in_lru = t.lru.contains(h);
            host_unindex(t, events, h);
            if in_lru {
                host.release(h);
            }
        }
    }
}

impl BlockManager {
    /// Sets (or clears) the cost model the host tier's load-or-recompute choice uses; see
    /// [`crate::manager::ManagerConfig::host_load_min_blocks`] for the other half of the rule.
    /// `InvalidArgument` for a rate that is not finite and > 0.
    pub fn set_host_cost_model(&mut self, model: Option<CostModel>) -> Result<()> {
        if let Some(m) = &model {
            m.validate()?;
        }
        self.host_cost = model;
        Ok(())
    }

    /// Whether loading `loads` host blocks beats recomputing the `gain` blocks of prompt they add
    /// to the hit (the same number without KV cache groups; with groups a hit may load several
    /// groups' blocks per position, or another group's few blocks beside group 0's on the
    /// device). A gain shorter than `host_load_min_blocks` is recomputed.
    pub(super) fn load_pays(&self, gain: usize, loads: usize) -> bool {
        if gain < self.cfg.host_load_min_blocks as usize {
            return false;
        }
        match &self.host_cost {
            None => true,
            Some(m) => {
                let load =
                    (loads * self.bs) as f64 * m.kv_bytes_per_token / m.host_link_bytes_per_s;
                load < (gain * self.bs) as f64 / m.prefill_tokens_per_s
            }
        }
    }

    /// Host blocks a swap-out or a reservation can take now: free ones plus unreferenced
    /// host-cached ones (taking those demotes them).
    pub fn host_blocks_available(&self) -> usize {
        self.host.num_free() + self.tier.as_ref().map_or(0, |t| t.lru.len())
    }

    /// Takes one host block for a swap-out or a reservation (see [`host_take`]).
    pub(super) fn take_host_block(&mut self) -> Result<HostBlockId> {
        host_take(
            self.tier.as_mut(),
            &mut self.host,
            &mut self.events,
            &mut self.counters,
        )
        .ok_or(Error::OutOfHostBlocks {
            needed: 1,
            available: 0,
        })
    }

    /// Evicts the least recently freed cached-free block (recording its removal and, with the
    /// host tier on, offloading it) and hands it out with refcount 1.
    pub(super) fn evict_block(&mut self) -> Result<BlockId> {
        let Some(b) = self.prefix.evict_oldest() else {
            return Err(Error::OutOfBlocks {
                needed: 1,
                available: 0,
            });
        };
        let hash = self.prefix.last_hash(b);
        self.gpu_removed(b, hash);
        self.pool.incref_mut(b)?;
        self.counters.evictions += 1;
        if let Some(t) = self.tier.as_mut() {
            let (parent, salt) = t.device_meta(b);
            let g = super::registered_group(&self.block_group, b);
            offload(
                t,
                &mut self.host,
                &mut self.events,
                &mut self.counters,
                &mut self.swap_out_q,
                b,
                hash,
                g,
                parent,
                salt,
                self.prefix.stored_tokens(b),
            );
        }
        Ok(b)
    }

    /// The host-tier demotions since the last call, oldest first.
    ///
    /// Contract: each demoted host block's bytes stay the demoted block's KV until the engine
    /// applies the swap lists of the next step or writes into a block `reserve_host_blocks`
    /// returned (the manager hands the slot out again at once). So the engine calls this right
    /// after every `build_step` (before applying that step's lists) and after every
    /// `reserve_host_blocks` (before filling the reserved blocks), and copies each demoted block
    /// out (to disk, a remote store) before going on.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        match self.tier.as_mut() {
            Some(t) => std::mem::take(&mut t.demotions),
            None => Vec::new(),
        }
    }

    /// `(group, chain hash)` of every block the host tier indexes, sorted: the state the host
    /// tier's `Stored` / `Removed` events add up to. O(indexed blocks), for tests and
    /// diagnostics; empty with the tier off.
    pub fn host_block_keys(&self) -> Vec<(usize, u128)> {
        let mut out: Vec<(usize, u128)> = self.tier.iter().flat_map(|t| t.keys()).collect();
        out.sort_unstable();
        out
    }

    /// The indexed host block under `hash`, if any (host tier off: `None`).
    pub fn host_lookup(&self, hash: u128) -> Option<HostBlockId> {
        self.tier.as_ref().and_then(|t| t.lookup(hash))
    }

    fn need_tier(&self, what: &'static str) -> Result<()> {
        if self.tier.is_none() {
            return Err(Error::InvalidArgument {
                what,
                value: 0,
                reason: "needs a manager built with host_cache".into(),
            });
        }
        Ok(())
    }

    /// How far a prompt is cached in each tier, for the engine to probe lower tiers (disk, a
    /// remote store) for the blocks after: the device hits, the host hits after them (whatever
    /// the load-or-recompute rule would decide), the hashes of all the full blocks an admission
    /// may share (the first `(len - 1) / B`) and the chain's salt digest. Read-only. Errors: `InvalidArgument` for an empty prompt or malformed keys.
    pub fn lookup_tiers(&self, tokens: &[TokenId], keys: Option<&SeqKeys>) -> Result<TierLookup> {
        check_prompt(tokens, keys)?;
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        let (mut hashes, mut hits, mut host_hits) = (Vec::new(), Vec::new(), Vec::new());
        self.lookup_root(
            &mut Hasher::new(self.hash_key),
            tokens,
            root,
            extra,
            &mut hashes,
            &mut hits,
            &mut host_hits,
            &mut Vec::new(),
            false,
        );
        let (gpu, host) = (hits.len(), host_hits.len());
        let max_hit = if self.caching {
            (tokens.len() - 1) / self.bs
        } else {
            0
        };
        if hashes.len() < max_hit {
            Hasher::new(self.hash_key).extend_chain(
                root,
                &tokens[..max_hit * self.bs],
                self.bs,
                extra,
                &mut hashes,
            );
        }
        hashes.truncate(max_hit);
        let start = (gpu + host).min(max_hit);
        Ok(TierLookup {
            gpu_blocks: gpu,
            host_blocks: host,
            remaining_hashes: hashes[start..].to_vec(),
            parent_hash: start.checked_sub(1).map(|i| hashes[i]),
            hashes,
            salt_digest: root,
        })
    }

    /// Per KV cache group, which of a prompt's full blocks the device or the host tier holds, for
    /// the engine to probe lower tiers for the rest (every group's keys, the hit rule of
    /// `groups.rs`): `(hashes, salt_digest, present)` with `hashes` the chain hashes of the full
    /// blocks an admission may share (the first `(len - 1) / B`) and `present[g][i]` whether
    /// group `g`'s block `i` (key `group_hash(hashes[i], g)`) is cached with the prompt's token
    /// ids on the device or in the host index. Read-only. Errors: `InvalidArgument` for an
    /// empty prompt or malformed keys.
    pub fn lookup_tiers_groups(
        &self,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
    ) -> Result<GroupPresence> {
        check_prompt(tokens, keys)?;
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        let bs = self.bs;
        let max_hit = if self.caching {
            (tokens.len() - 1) / bs
        } else {
            0
        };
        let mut hashes = Vec::with_capacity(max_hit);
        if max_hit > 0 {
            Hasher::new(self.hash_key).extend_chain(
                root,
                &tokens[..max_hit * bs],
                bs,
                extra,
                &mut hashes,
            );
        }
        hashes.truncate(max_hit);
        let present = (0..self.num_groups())
            .map(|g| {
                hashes
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| {
                        let toks = &tokens[i * bs..(i + 1) * bs];
                        let key = group_hash(h, g);
                        let on_device = self
                            .prefix
                            .lookup(key)
                            .is_some_and(|b| self.prefix.matches(b, toks));
                        on_device
                            || self.tier.as_ref().is_some_and(|t| {
                                t.lookup(key).is_some_and(|hb| t.tokens_of(hb) == toks)
                            })
                    })
                    .collect()
            })
            .collect();
        Ok((hashes, root, present))
    }

    /// Reserves `n` host blocks for the engine to fill from a lower tier; they are never findable
    /// and never evicted until [`BlockManager::commit_host_blocks`]. Taking unreferenced
    /// host-cached blocks demotes them (see [`BlockManager::take_demotions`]: drain before
    /// writing). Errors, nothing changed: `InvalidArgument` without the host tier;
    /// `OutOfHostBlocks` when fewer than `n` can be taken.
    pub fn reserve_host_blocks(&mut self, n: usize) -> Result<Vec<HostBlockId>> {
        self.need_tier("reserve_host_blocks")?;
        let available = self.host_blocks_available();
        if n > available {
            return Err(Error::OutOfHostBlocks {
                needed: n,
                available,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let h = self.take_host_block()?;
            if let Some(t) = self.tier.as_mut() {
                t.reserve(h);
            }
            out.push(h);
        }
        Ok(out)
    }

    /// Ends reservations: with `ok`, indexes `blocks[i]` under `hashes[i]` (parent `parents[i]`,
    /// the chain's `salt_digest`, token ids `tokens[i*B..(i+1)*B]`) as unreferenced host-cached
    /// blocks; without, or for a hash already indexed, a reservation made before a
    /// `reset_prefix_cache`, or a hash the device holds with other token ids, frees the block.
    /// Returns how many were indexed. The caller vouches that each block's bytes are the KV of
    /// those tokens under that hash (a lookup still compares the token ids with the prompt's).
    ///
    /// Errors, nothing changed: `InvalidArgument` without the host tier, for lists of different
    /// lengths, `tokens` not `B` per block, or a block that is not reserved (or named twice).
    #[allow(clippy::too_many_arguments)]
    pub fn commit_host_blocks(
        &mut self,
        blocks: &[HostBlockId],
        hashes: &[u128],
        parents: &[Option<u128>],
        salt_digest: u128,
        tokens: &[TokenId],
        ok: bool,
    ) -> Result<usize> {
        self.commit_host_blocks_in_groups(blocks, hashes, None, parents, salt_digest, tokens, ok)
    }

    /// [`BlockManager::commit_host_blocks`] for blocks of KV cache groups: `blocks[i]` is group
    /// `groups[i]`'s block of chain hash `hashes[i]` (parent `parents[i]`, chain hashes both),
    /// indexed under its group's key `group_hash(hashes[i], groups[i])` (`None`: every block is
    /// group 0's, exactly `commit_host_blocks`). Errors, nothing changed: those of
    /// `commit_host_blocks`, and `InvalidArgument` for `groups` of another length or naming a
    /// group the manager does not have.
    #[allow(clippy::too_many_arguments)]
    pub fn commit_host_blocks_in_groups(
        &mut self,
        blocks: &[HostBlockId],
        hashes: &[u128],
        groups: Option<&[u32]>,
        parents: &[Option<u128>],
        salt_digest: u128,
        tokens: &[TokenId],
        ok: bool,
    ) -> Result<usize> {
        self.need_tier("commit_host_blocks")?;
        let bs = self.bs;
        let n = blocks.len();
        if let Some(gs) = groups {
            if gs.len() != n {
                return Err(Error::InvalidArgument {
                    what: "groups.len",
                    value: gs.len() as i64,
                    reason: format!("must have blocks.len() ({n}) entries"),
                });
            }
            let ng = self.num_groups();
            if let Some(&g) = gs.iter().find(|&&g| g as usize >= ng) {
                return Err(Error::InvalidArgument {
                    what: "groups",
                    value: g as i64,
                    reason: format!("unknown KV cache group: the manager has {ng}"),
                });
            }
        }
        let bad = |what: &'static str, value: usize, reason: String| {
            Err(Error::InvalidArgument {
                what,
                value: value as i64,
                reason,
            })
        };
        if hashes.len() != n || parents.len() != n {
            return bad(
                "hashes.len",
                hashes.len().min(parents.len()),
                format!("hashes and parents must both have blocks.len() ({n}) entries"),
            );
        }
        if tokens.len() != n * bs {
            return bad(
                "tokens.len",
                tokens.len(),
                format!("must be blocks.len() * block_size ({})", n * bs),
            );
        }
        let t = self.tier.as_ref().expect("checked");
        let nh = self.host.num_blocks();
        let mut seen = std::collections::HashSet::with_capacity(n);
        for &h in blocks {
            if h >= nh || !t.reserved[h as usize] || !seen.insert(h) {
                return bad(
                    "blocks",
                    h as usize,
                    "not a host block reserved by reserve_host_blocks (or named twice)".into(),
                );
            }
        }
        let mut indexed = 0;
        for (k, &h) in blocks.iter().enumerate() {
            let toks = &tokens[k * bs..(k + 1) * bs];
            let g = groups.map_or(0, |gs| gs[k] as usize);
            let key = group_hash(hashes[k], g);
            let t = self.tier.as_mut().expect("checked");
            t.reserved[h as usize] = false;
            let device_agrees = self
                .prefix
                .lookup(key)
                .is_none_or(|b| self.prefix.stored_tokens(b) == toks);
            let keep = ok && t.reservation_current(h) && t.lookup(key).is_none() && device_agrees;
            if keep {
                t.index(h, key, g, parents[k], salt_digest, toks);
                self.events
                    .stored_in(Medium::Host, g as u32, hashes[k], parents[k], toks);
                indexed += 1;
            }
            // The reservation's reference goes: an indexed block joins the host LRU.
            self.host_drop(h)?;
        }
        Ok(indexed)
    }
}

/// A tier lookup's prompt: at least one token, and keys (if any) that fit it.
fn check_prompt(tokens: &[TokenId], keys: Option<&SeqKeys>) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::InvalidArgument {
            what: "tokens.len",
            value: 0,
            reason: "a prompt needs at least one token".into(),
        });
    }
    if let Some(k) = keys {
        k.validate(tokens.len())?;
    }
    Ok(())
}
