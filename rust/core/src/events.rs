//! The KV-event ring: a bounded record of what entered and left the prefix-cache tiers, for a
//! router or an external index to follow which prefixes this engine holds.
//!
//! The manager records one fixed-size [`Record`] per block transition: a block registered under
//! its hash (`Stored`, with its parent hash and token ids), a hash dropped (`Removed`), or the
//! whole tier dropped (`Cleared`), each for the device (`Gpu`) or the host tier (`Host`), and each
//! (but `Cleared`, which drops every group) for one KV cache group: the record's hash is the
//! sequence's chained prefix hash `h` of that block position, whatever the group, and `group` says
//! whose block it is (0 for a manager without groups, so its records are exactly as before; the
//! prefix cache keys group `g`'s block by `group_hash(h, g)`, see [`crate::groups`]). The
//! ring is sized once (`ManagerConfig::kv_event_capacity` records, plus that many blocks of token
//! ids in a flat arena, one slot per record), so recording is O(1) with no allocation; capacity 0
//! (the default) disables it: nothing is recorded and each transition costs one branch.
//!
//! **Overflow drops the oldest record**: a consumer that falls behind loses the start of the
//! history, never the newest state, and the step never blocks or fails for it. Every dropped
//! record is counted ([`KvEventRing::dropped`]); a consumer seeing the count move knows its view
//! is incomplete and can resynchronise (a `Cleared` event is a natural point to do so).
//!
//! [`KvEventRing::drain`] turns records into [`KvEvent`]s, coalescing runs: consecutive `Stored`
//! records of one medium that continue one chain (each one's parent is the previous one's hash)
//! become one event listing their hashes and concatenated token ids, with the first one's parent;
//! consecutive `Removed` records of one medium become one event. A run never mixes groups. The allocation happens there, on
//! the consumer's side, not on the step's.
//!
//! Invariants: `len <= capacity`; the live records are `head, head+1, ... (mod capacity)`, oldest
//! first; record slot `i` owns `tokens[i*B..(i+1)*B]`; every event of a drain holds records of one
//! kind, medium and group. Replayed in order from the manager's start (or its last `Cleared`), the
//! `Stored` / `Removed` events of the device tier leave exactly the set of `(group, hash)` pairs
//! of the blocks the device prefix cache holds (`BlockManager::cached_block_keys`), group by
//! group; `tests/events.rs` checks that balance with several groups.

use crate::TokenId;

/// What happened to a block (or to a whole tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvEventKind {
    /// A full block was registered under its hash.
    Stored,
    /// A hash was dropped (eviction, demotion, swap-out of the block, ...).
    Removed,
    /// Every hash of the tier was dropped at once (`reset_prefix_cache`).
    Cleared,
}

impl KvEventKind {
    /// `"stored"`, `"removed"` or `"cleared"`, as the Python API spells them.
    pub fn name(self) -> &'static str {
        match self {
            KvEventKind::Stored => "stored",
            KvEventKind::Removed => "removed",
            KvEventKind::Cleared => "cleared",
        }
    }
}

/// Which tier a transition happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device pool's prefix cache.
    Gpu,
    /// The host pool's prefix tier.
    Host,
}

impl Medium {
    /// `"GPU"` or `"CPU"`, as the Python API spells them.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Host => "CPU",
        }
    }
}

/// One recorded transition of one block: fixed size, its token ids live in the ring's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// What happened.
    pub kind: KvEventKind,
    /// Where.
    pub medium: Medium,
    /// The KV cache group whose block it is (0 for `Cleared` and for a manager without groups).
    pub group: u32,
    /// The block's prefix hash (0 for `Cleared`): the chained hash of its position, the same for
    /// every group (not the group's cache key).
    pub hash: u128,
    /// The previous block's hash in the chain, `None` for a chain's first block (`Stored` only).
    pub parent: Option<u128>,
}

/// A drained event: one record, or a coalesced run of them (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// What happened.
    pub kind: KvEventKind,
    /// Where.
    pub medium: Medium,
    /// The KV cache group of every block of the event (0 for `Cleared`, which drops all groups).
    pub group: u32,
    /// The blocks' hashes, in chain order (empty for `Cleared`).
    pub block_hashes: Vec<u128>,
    /// The first block's parent hash (`Stored` only; `None` for a chain's first block).
    pub parent_hash: Option<u128>,
    /// The blocks' token ids, `block_size` per hash (`Stored` only).
    pub token_ids: Vec<TokenId>,
    /// Tokens per block.
    pub block_size: u32,
}

/// The bounded ring. Owned by the manager; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct KvEventRing {
    records: Vec<Record>,
    tokens: Vec<TokenId>,
    block_size: usize,
    head: usize,
    len: usize,
    dropped: u64,
}

impl KvEventRing {
    /// A ring of `capacity` records of blocks of `block_size` tokens (0: disabled, nothing
    /// allocated). `AllocationFailed` if the host cannot hold it.
    pub fn new(capacity: usize, block_size: u32) -> crate::Result<Self> {
        use crate::error::alloc::{failure, filled_vec, zeroed_vec};
        let bs = block_size as usize;
        let filler = Record {
            kind: KvEventKind::Cleared,
            medium: Medium::Gpu,
            group: 0,
            hash: 0,
            parent: None,
        };
        let records = filled_vec(capacity, filler, "kv event records")?;
        let what = "kv event token ids";
        let n = capacity
            .checked_mul(bs)
            .ok_or_else(|| failure(what, capacity as u128 * bs as u128 * 4))?;
        let tokens = zeroed_vec(n, what)?;
        Ok(Self {
            records,
            tokens,
            block_size: bs,
            head: 0,
            len: 0,
            dropped: 0,
        })
    }

    /// Whether anything is recorded (capacity > 0).
    #[inline(always)]
    pub fn enabled(&self) -> bool {
        !self.records.is_empty()
    }

    /// Records waiting to be drained.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no record waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records dropped on overflow since the manager was built.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The slot the next record goes to, dropping the oldest record when full.
    #[inline]
    fn slot(&mut self) -> usize {
        let cap = self.records.len();
        if self.len == cap {
            self.head = (self.head + 1) % cap;
            self.len -= 1;
            self.dropped += 1;
        }
        let i = (self.head + self.len) % cap;
        self.len += 1;
        i
    }

    /// Records `Stored` for a group-0 block of `tokens` (`block_size` of them). No-op when
    /// disabled.
    #[inline]
    pub fn stored(&mut self, medium: Medium, hash: u128, parent: Option<u128>, tokens: &[TokenId]) {
        self.stored_in(medium, 0, hash, parent, tokens);
    }

    /// Records `Stored` for group `group`'s block at chain hash `hash` (not the group's cache
    /// key), holding `tokens` (`block_size` of them). No-op when disabled.
    #[inline]
    pub fn stored_in(
        &mut self,
        medium: Medium,
        group: u32,
        hash: u128,
        parent: Option<u128>,
        tokens: &[TokenId],
    ) {
        if !self.enabled() {
            return;
        }
        let i = self.slot();
        self.records[i] = Record {
            kind: KvEventKind::Stored,
            medium,
            group,
            hash,
            parent,
        };
        let bs = self.block_size;
        let n = tokens.len().min(bs);
        self.tokens[i * bs..i * bs + n].copy_from_slice(&tokens[..n]);
    }

    /// Records `Removed` for one group-0 hash. No-op when disabled.
    #[inline]
    pub fn removed(&mut self, medium: Medium, hash: u128) {
        self.removed_in(medium, 0, hash);
    }

    /// Records `Removed` for group `group`'s block at chain hash `hash`. No-op when disabled.
    #[inline]
    pub fn removed_in(&mut self, medium: Medium, group: u32, hash: u128) {
        if !self.enabled() {
            return;
        }
        let i = self.slot();
        self.records[i] = Record {
            kind: KvEventKind::Removed,
            medium,
            group,
            hash,
            parent: None,
        };
    }

    /// Records `Cleared` for a whole tier. No-op when disabled.
    pub fn cleared(&mut self, medium: Medium) {
        if !self.enabled() {
            return;
        }
        let i = self.slot();
        self.records[i] = Record {
            kind: KvEventKind::Cleared,
            medium,
            group: 0,
            hash: 0,
            parent: None,
        };
    }

    /// Moves every waiting record into `out` as events, oldest first, coalescing runs (see the
    /// module documentation). Returns the number of events appended.
    pub fn drain(&mut self, out: &mut Vec<KvEvent>) -> usize {
        let cap = self.records.len();
        let bs = self.block_size;
        let before = out.len();
        for k in 0..self.len {
            let i = (self.head + k) % cap;
            let r = self.records[i];
            if let Some(last) = out[before..].last_mut() {
                let joins = last.kind == r.kind
                    && last.medium == r.medium
                    && last.group == r.group
                    && match r.kind {
                        KvEventKind::Stored => last.block_hashes.last().copied() == r.parent,
                        KvEventKind::Removed => true,
                        KvEventKind::Cleared => false,
                    };
                if joins {
                    last.block_hashes.push(r.hash);
                    if r.kind == KvEventKind::Stored {
                        last.token_ids
                            .extend_from_slice(&self.tokens[i * bs..(i + 1) * bs]);
                    }
                    continue;
                }
            }
            out.push(KvEvent {
                kind: r.kind,
                medium: r.medium,
                group: r.group,
                block_hashes: if r.kind == KvEventKind::Cleared {
                    Vec::new()
                } else {
                    vec![r.hash]
                },
                parent_hash: r.parent,
                token_ids: if r.kind == KvEventKind::Stored {
                    self.tokens[i * bs..(i + 1) * bs].to_vec()
                } else {
                    Vec::new()
                },
                block_size: bs as u32,
            });
        }
        self.head = 0;
        self.len = 0;
        out.len() - before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_ring_records_nothing() {
        let mut r = KvEventRing::new(0, 4).unwrap();
        r.stored(Medium::Gpu, 1, None, &[1, 2, 3, 4]);
        r.removed(Medium::Gpu, 1);
        r.cleared(Medium::Gpu);
        let mut out = Vec::new();
        assert_eq!(r.drain(&mut out), 0);
        assert_eq!(r.dropped(), 0);
    }

    #[test]
    fn chains_coalesce_and_breaks_split() {
        let mut r = KvEventRing::new(16, 2).unwrap();
        r.stored(Medium::Gpu, 10, None, &[1, 2]);
        r.stored(Medium::Gpu, 11, Some(10), &[3, 4]);
        // Another chain: a new event even though the kind and medium match.
        r.stored(Medium::Gpu, 20, Some(99), &[5, 6]);
        // Another medium: a new event.
        r.stored(Medium::Host, 21, Some(20), &[7, 8]);
        r.removed(Medium::Gpu, 10);
        r.removed(Medium::Gpu, 11);
        r.cleared(Medium::Gpu);
        r.cleared(Medium::Gpu);
        let mut out = Vec::new();
        assert_eq!(r.drain(&mut out), 6);
        assert_eq!(out[0].block_hashes, vec![10, 11]);
        assert_eq!(out[0].parent_hash, None);
        assert_eq!(out[0].token_ids, vec![1, 2, 3, 4]);
        assert_eq!(
            (out[1].block_hashes.clone(), out[1].parent_hash),
            (vec![20], Some(99))
        );
        assert_eq!(
            (out[2].medium, out[2].token_ids.clone()),
            (Medium::Host, vec![7, 8])
        );
        assert_eq!(out[3].kind, KvEventKind::Removed);
        assert_eq!(out[3].block_hashes, vec![10, 11]);
        assert!(out[3].token_ids.is_empty() && out[3].parent_hash.is_none());
        assert_eq!(out[4].kind, KvEventKind::Cleared);
        assert!(out[4].block_hashes.is_empty());
        assert_eq!(out[5].kind, KvEventKind::Cleared, "clears never coalesce");
        assert!(r.is_empty());
        assert_eq!(r.drain(&mut out), 0);
    }

    #[test]
    fn runs_never_mix_groups() {
        let mut r = KvEventRing::new(16, 1).unwrap();
        r.stored(Medium::Gpu, 10, None, &[1]);
        // Group 1's block at the same position: same chain hash, its own event.
        r.stored_in(Medium::Gpu, 1, 10, None, &[1]);
        r.stored_in(Medium::Gpu, 1, 11, Some(10), &[2]);
        r.stored(Medium::Gpu, 11, Some(10), &[2]);
        r.removed_in(Medium::Gpu, 1, 10);
        r.removed_in(Medium::Gpu, 1, 11);
        r.removed(Medium::Gpu, 10);
        r.cleared(Medium::Gpu);
        let mut out = Vec::new();
        assert_eq!(r.drain(&mut out), 6);
        let seen: Vec<_> = out
            .iter()
            .map(|e| (e.kind, e.group, e.block_hashes.clone()))
            .collect();
        assert_eq!(
            seen,
            vec![
                (KvEventKind::Stored, 0, vec![10]),
                (KvEventKind::Stored, 1, vec![10, 11]),
                (KvEventKind::Stored, 0, vec![11]),
                (KvEventKind::Removed, 1, vec![10, 11]),
                (KvEventKind::Removed, 0, vec![10]),
                (KvEventKind::Cleared, 0, vec![]),
            ]
        );
        assert_eq!(out[2].parent_hash, Some(10));
        assert_eq!(out[1].token_ids, vec![1, 2]);
    }

    #[test]
    fn overflow_drops_the_oldest_and_counts() {
        let mut r = KvEventRing::new(3, 1).unwrap();
        for h in 0..5u128 {
            r.removed(Medium::Gpu, h);
        }
        assert_eq!((r.len(), r.dropped()), (3, 2));
        let mut out = Vec::new();
        r.drain(&mut out);
        assert_eq!(out[0].block_hashes, vec![2, 3, 4]);
        // After a drain the ring wraps cleanly and keeps each record's own tokens.
        for h in 0..4u128 {
            r.stored(Medium::Gpu, h + 100, Some(h + 99), &[h as u32]);
        }
        out.clear();
        r.drain(&mut out);
        assert_eq!(r.dropped(), 3);
        assert_eq!(out[0].block_hashes, vec![101, 102, 103]);
        assert_eq!(out[0].parent_hash, Some(100));
        assert_eq!(out[0].token_ids, vec![1, 2, 3]);
    }
}
