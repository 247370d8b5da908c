//! The prefix cache: hash → block map, block → hash, and the LRU of cached-free blocks.
//!
//! A block is *hashed* when its (full, immutable) content has been registered under its chained
//! hash (see [`crate::hash`]). A hashed block whose refcount drops to 0 is not returned to the free
//! list: it becomes *cached-free* and joins the LRU, still findable by hash, until either a prefix
//! hit revives it or an allocation evicts it (dropping the hash).
//!
//! Invariants (checked by `BlockManager::check_invariants` and [`PrefixCache::check_map`]):
//! - `lookup(h) == Some(b)` ⇔ `hash_of(b) == Some(h)`: one block per hash, one hash per block. A
//!   second block with the same content is simply left unhashed.
//! - **Lazy deletion.** The map may also hold *stale* entries `h → b` with `hash_of(b) != Some(h)`:
//!   dropping a hash (an eviction) clears the block's flag and queues `(h, b)`; the queued entries
//!   are removed together once [`DROP_BATCH`] have gathered, so the eviction path does not stall
//!   on a probe of the pool-sized map (each a cache miss) and the probes of a batch overlap. A
//!   lookup checks the block's current hash, so a stale entry reads as a miss; a registration
//!   under a stale key takes it over. Every hashed block's entry is live (`map[hash_of(b)] == b`)
//!   and every stale entry is queued, so there are fewer than `DROP_BATCH`. The map is presized
//!   for twice every block (plus the batch), so it never grows on the hot path: tombstones left
//!   by removals are cleared by in-place rehashes.
//! - A block is in the LRU ⇔ it is hashed and its refcount is 0.
//! - The LRU is an [`IndexList`] (a doubly linked list over arrays indexed by block id), oldest
//!   at the front; insert, remove and pop-oldest are O(1) and allocation-free.
//! - In verify mode, `tokens[b*B..(b+1)*B]` holds the token ids of every hashed block `b`.
//!
//! This module does no reference counting; the manager decides when a block enters or leaves.

use crate::index_list::IndexList;
use crate::{BlockId, TokenId};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Dropped hashes whose map entries are removed in one batch. The removals of a batch are
/// independent probes of a pool-sized map, so their cache misses overlap instead of each stalling
/// the eviction that caused it; the batch also bounds the stale entries.
pub const DROP_BATCH: usize = 32;

/// A keyed hasher for integer keys: sequence ids and prefix hashes.
///
/// Both kinds of key can be structured or chosen by someone else: sequence ids often pack a
/// request id above a sample index (`i << 32`), and a deployment with a published `hash_seed`
/// lets anyone compute block hashes. A hash table degrades to quadratic time when many keys
/// share the bits it indexes with, so the hash must spread every key bit into every output bit,
/// under a key the key-chooser does not know. Each word goes through a *folded multiply*
/// (the 128-bit product of two 64-bit values, high half XOR low half) with a per-map random key
/// on both sides: every input bit reaches every output bit, low (bucket index) and high (the
/// table's control bits) alike, and without the key the product is not predictable, so keys
/// cannot be chosen to collide. `finish` folds once more so a single-word key is mixed twice.
/// This is the construction of `foldhash`/`ahash`'s fallback, at two multiplies per key.
#[derive(Debug, Clone, Copy)]
pub struct FastHasher {
    acc: u64,
    k1: u64,
    k2: u64,
}

/// The 128-bit product of `a` and `b`, high half XOR low half.
#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Constants (digits of pi) that keep a zero key from zeroing a product.
const P0: u64 = 0x243f_6a88_85a3_08d3;
const P1: u64 = 0x1319_8a2e_0370_7344;

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        folded_multiply(self.acc ^ self.k2, P1 ^ self.k1)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.acc = folded_multiply(self.acc ^ x, self.k1);
    }
    #[inline]
    fn write_u128(&mut self, x: u128) {
        // Both halves enter one product, each XORed with its own key word.
        self.acc = folded_multiply(self.acc ^ x as u64, self.k1 ^ (x >> 64) as u64);
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

/// `BuildHasher` for [`FastHasher`]: holds one map's random key. `Default` draws a fresh key
/// from std's `RandomState` (seeded from the OS once per thread, distinct for every instance),
/// so two maps never share a key and no process can predict another's.
#[derive(Debug, Clone, Copy)]
pub struct FastBuild {
    k0: u64,
    k1: u64,
    k2: u64,
}

impl Default for FastBuild {
    fn default() -> Self {
        let rs = std::collections::hash_map::RandomState::new();
        Self {
            k0: rs.hash_one(0u8),
            // Odd, so the multiplier never has low zero bits however the key falls.
            k1: rs.hash_one(1u8) | 1,
            k2: rs.hash_one(2u8),
        }
    }
}

impl BuildHasher for FastBuild {
    type Hasher = FastHasher;
    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher {
            acc: self.k0 ^ P0,
            k1: self.k1,
            k2: self.k2,
        }
    }
}

/// A `HashMap` keyed by integers, hashed with [`FastHasher`] under a per-map random key.
pub type FastMap<K, V> = HashMap<K, V, FastBuild>;

/// Probes a SwissTable-style map (hashbrown, behind `std::collections::HashMap`) would spend
/// inserting `keys` hashed by `build`, as groups visited per key on average. It replays
/// hashbrown's layout: the smallest power-of-two bucket count holding the keys at a 7/8 load,
/// the start bucket from the hash's low bits, 16-slot groups probed in triangular order. A
/// well-spread hash visits about one group per key at any size; keys whose hashes share their
/// low bits visit a number growing with the key count — the quadratic blowup, detected by
/// counting rather than by timing. For tests and diagnostics.
pub fn probe_cost<K: std::hash::Hash>(
    build: &impl BuildHasher,
    keys: impl IntoIterator<Item = K>,
) -> f64 {
    const GROUP: usize = 16;
    let hashes: Vec<u64> = keys.into_iter().map(|k| build.hash_one(k)).collect();
    let n = hashes.len();
    if n == 0 {
        return 0.0;
    }
    let buckets = (n * 8).div_ceil(7).next_power_of_two().max(GROUP);
    let mask = buckets - 1;
    let mut used = vec![false; buckets];
    let mut groups = 0u64;
    for h in hashes {
        let mut pos = h as usize & mask;
        let mut stride = 0;
        loop {
            groups += 1;
            if let Some(j) = (0..GROUP).find(|&j| !used[(pos + j) & mask]) {
                used[(pos + j) & mask] = true;
                break;
            }
            stride += GROUP;
            pos = (pos + stride) & mask;
        }
    }
    groups as f64 / n as f64
}

/// The prefix cache of one manager.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    /// Hash → block, live and stale entries (see "Lazy deletion" above).
    map: FastMap<u128, BlockId>,
    /// The hash of each block: current when `hashed[b]`, else the last one (a stale key, or 0).
    hash_of: Vec<u128>,
    hashed: Vec<bool>,
    /// Number of hashed blocks (the map's live entries).
    live: usize,
    /// Dropped `(hash, block)` pairs whose map entry may still be there (stale), removed together
    /// when [`DROP_BATCH`] have gathered.
    dropped: Vec<(u128, BlockId)>,
    lru: IndexList,
    block_size: usize,
    /// Token ids of hashed blocks, only in verify mode (empty otherwise).
    tokens: Vec<TokenId>,
}

impl PrefixCache {
    /// An empty cache for `num_blocks` blocks of `block_size` tokens; `verify` keeps token ids;
    /// `presize` reserves the hash map for every block up front (off when caching is disabled).
    /// Panics if the host cannot allocate it; [`PrefixCache::try_new`] returns an error instead.
    pub fn new(num_blocks: u32, block_size: u32, verify: bool, presize: bool) -> Self {
        match Self::try_new(num_blocks, block_size, verify, presize) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`PrefixCache::new`] with every allocation made fallibly: `AllocationFailed` names the
    /// array that did not fit and the bytes it asked for.
    pub fn try_new(
        num_blocks: u32,
        block_size: u32,
        verify: bool,
        presize: bool,
    ) -> crate::Result<Self> {
        use crate::error::alloc::{failure, zeroed_vec};
        let n = num_blocks as usize;
        // The verify copy first: the largest array, and lazily committed, so an impossible
        // size fails before anything else is allocated.
        let tokens = if verify {
            let what = "prefix cache token ids (verify_prefix)";
            let len = n
                .checked_mul(block_size as usize)
                .ok_or_else(|| failure(what, n as u128 * block_size as u128 * 4))?;
            zeroed_vec(len, what)?
        } else {
            Vec::new()
        };
        let mut map = FastMap::default();
        if presize {
            // At most one live hash per block plus the stale ones, in a table twice that: removed
            // entries leave tombstones, and when they use up the free slots the table rehashes,
            // in place only while at most half full. Sized so, the map never grows on the hot
            // path (sized for the blocks alone, it grew to this size after a few thousand
            // evictions anyway).
            let n = 2 * (n + DROP_BATCH);
            map.try_reserve(n).map_err(|_| {
                // What the SwissTable asks for: a power-of-two bucket count at a 7/8 load, each
                // bucket an entry and a control byte, plus one group of trailing control bytes.
                let buckets = (n as u128 * 8 / 7).max(4).next_power_of_two();
                let per = (std::mem::size_of::<(u128, BlockId)>() + 1) as u128;
                failure("prefix hash map", buckets * per + 16)
            })?;
        }
        Ok(Self {
            map,
            hash_of: zeroed_vec(n, "prefix cache block hashes")?,
            hashed: zeroed_vec(n, "prefix cache hashed flags")?,
            live: 0,
            dropped: Vec::with_capacity(DROP_BATCH),
            lru: IndexList::new(n, "prefix LRU links")?,
            block_size: block_size as usize,
            tokens,
        })
    }

    /// True in verify mode.
    #[inline]
    pub fn verifies(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whether the map entry `h → b` is live (not left behind by a dropped hash).
    #[inline]
    fn is_live(&self, h: u128, b: BlockId) -> bool {
        self.hashed[b as usize] && self.hash_of[b as usize] == h
    }

    /// The block registered under `h`, if any.
    #[inline]
    pub fn lookup(&self, h: u128) -> Option<BlockId> {
        match self.map.get(&h) {
            Some(&b) if self.is_live(h, b) => Some(b),
            _ => None,
        }
    }

    /// The hash block `b` is registered under, if any.
    #[inline]
    pub fn hash_of(&self, b: BlockId) -> Option<u128> {
        if self.hashed[b as usize] {
            Some(self.hash_of[b as usize])
        } else {
            None
        }
    }

    /// [`probe_cost`] of the hash map's current keys under its own hasher: about 1 unless the
    /// keys cluster (for tests and diagnostics; O(number of hashed blocks)).
    pub fn map_probe_cost(&self) -> f64 {
        probe_cost(self.map.hasher(), self.map.keys())
    }

    /// Number of hashed blocks.
    #[inline]
    pub fn num_hashed(&self) -> usize {
        self.live
    }

    /// Stale map entries (dropped hashes not swept yet).
    pub fn num_stale(&self) -> usize {
        self.map.len() - self.live
    }

    /// All live `(hash, block)` entries (for invariant checks).
    pub fn entries(&self) -> impl Iterator<Item = (u128, BlockId)> + '_ {
        self.map
            .iter()
            .map(|(&h, &b)| (h, b))
            .filter(|&(h, b)| self.is_live(h, b))
    }

    /// Checks the map against the per-block hashes: every hashed block's entry is in the map and
    /// points back at it, the live count matches, stale entries stay within their bound.
    pub fn check_map(&self) -> Result<(), String> {
        let mut live = 0usize;
        for (b, &hashed) in self.hashed.iter().enumerate() {
            if !hashed {
                continue;
            }
            live += 1;
            let h = self.hash_of[b];
            if self.map.get(&h) != Some(&(b as BlockId)) {
                return Err(format!(
                    "hashed block {b} (hash {h:#x}) is not what the map holds: {:?}",
                    self.map.get(&h)
                ));
            }
        }
        if live != self.live {
            return Err(format!(
                "{live} blocks hashed, the count says {}",
                self.live
            ));
        }
        for (&h, &b) in &self.map {
            if !self.is_live(h, b) && !self.dropped.contains(&(h, b)) {
                return Err(format!(
                    "stale map entry {h:#x} -> {b} is not queued for removal"
                ));
            }
        }
        if self.dropped.len() >= DROP_BATCH {
            return Err(format!("{} dropped hashes queued", self.dropped.len()));
        }
        if self.map.values().any(|&b| b as usize >= self.hashed.len()) {
            return Err("a map entry names a block outside the pool".into());
        }
        Ok(())
    }

    /// Removes the map entries of the queued dropped hashes, unless registered again since
    /// (the same block under the same hash, or another block that took the key over).
    #[inline(never)]
    fn flush_dropped(&mut self) {
        use std::collections::hash_map::Entry;
        let mut dropped = std::mem::take(&mut self.dropped);
        for &(h, b) in &dropped {
            if let Entry::Occupied(e) = self.map.entry(h) {
                let cur = *e.get();
                if cur == b && !(self.hashed[b as usize] && self.hash_of[b as usize] == h) {
                    e.remove();
                }
            }
        }
        dropped.clear();
        self.dropped = dropped;
    }

    /// Registers block `b` (holding `tokens`) under `h`. Returns false, changing nothing, when `b`
    /// is already hashed or another block holds `h` (duplicate content stays unhashed).
    #[inline]
    pub fn register(&mut self, b: BlockId, h: u128, tokens: &[TokenId]) -> bool {
        use std::collections::hash_map::Entry;
        if self.hashed[b as usize] {
            return false;
        }
        match self.map.entry(h) {
            Entry::Occupied(mut e) => {
                let old = *e.get();
                if self.hashed[old as usize] && self.hash_of[old as usize] == h {
                    return false;
                }
                // A stale entry under this key: it becomes the new block's.
                e.insert(b);
            }
            Entry::Vacant(v) => {
                v.insert(b);
            }
        }
        self.hashed[b as usize] = true;
        self.hash_of[b as usize] = h;
        self.live += 1;
        if self.verifies() {
            let bs = self.block_size;
            let dst = &mut self.tokens[b as usize * bs..(b as usize + 1) * bs];
            // The common block size as a fixed-size copy: no `memcpy` call per registration.
            match (
                <&mut [TokenId; 16]>::try_from(&mut *dst),
                <&[TokenId; 16]>::try_from(tokens),
            ) {
                (Ok(d), Ok(t)) => *d = *t,
                _ => dst.copy_from_slice(tokens),
            }
        }
        true
    }

    /// Drops block `b`'s hash (no-op if unhashed). The caller makes sure `b` is not in the LRU.
    ///
    /// The map entry is left for now (lazy deletion): it reads as stale, since `b` is no longer
    /// hashed, and is removed with the next batch of [`DROP_BATCH`] dropped hashes (unless a
    /// registration under the same key took it over).
    #[inline]
    pub fn unregister(&mut self, b: BlockId) {
        if self.hashed[b as usize] {
            self.hashed[b as usize] = false;
            self.live -= 1;
            self.dropped.push((self.hash_of[b as usize], b));
            if self.dropped.len() == DROP_BATCH {
                self.flush_dropped();
            }
        }
    }

    /// Drops every hash at once, stale entries included (`reset_prefix_cache`). The caller makes
    /// sure no block is in the LRU.
    pub fn clear_hashes(&mut self) {
        self.map.clear();
        self.dropped.clear();
        self.hashed.fill(false);
        self.live = 0;
    }

    /// Verify mode: whether hashed block `b` holds exactly `tokens`. Always true outside verify mode.
    #[inline]
    pub fn matches(&self, b: BlockId, tokens: &[TokenId]) -> bool {
        if !self.verifies() {
            return true;
        }
        let bs = self.block_size;
        self.tokens[b as usize * bs..(b as usize + 1) * bs] == *tokens
    }

    /// Verify mode: the stored token ids of block `b` (empty outside verify mode).
    pub fn stored_tokens(&self, b: BlockId) -> &[TokenId] {
        if !self.verifies() {
            return &[];
        }
        let bs = self.block_size;
        &self.tokens[b as usize * bs..(b as usize + 1) * bs]
    }

    /// Re-labels hashed block `b` with hash `h`, keeping its stored tokens: forges a collision for
    /// tests. Returns false if `b` is unhashed or `h` is taken.
    pub fn relabel(&mut self, b: BlockId, h: u128) -> bool {
        if !self.hashed[b as usize] || self.lookup(h).is_some() {
            return false;
        }
        self.map.remove(&self.hash_of[b as usize]);
        self.map.insert(h, b);
        self.hash_of[b as usize] = h;
        true
    }

    /// Number of cached-free blocks.
    #[inline]
    pub fn lru_len(&self) -> usize {
        self.lru.len()
    }

    /// Whether `b` is in the LRU.
    #[inline]
    pub fn in_lru(&self, b: BlockId) -> bool {
        self.lru.contains(b)
    }

    /// Appends `b` as the most recently freed block; returns whether it did. A block already in
    /// the LRU (a double free) or outside the cache is left where it is: linking it again would
    /// make a cycle through it and evict it twice.
    #[inline]
    pub fn lru_push(&mut self, b: BlockId) -> bool {
        self.lru.push_back(b).is_ok()
    }

    /// Moves cached-free `b` to the LRU's evicting end (the next eviction takes it); no-op if
    /// `b` is not in the LRU.
    #[inline]
    pub fn lru_to_front(&mut self, b: BlockId) {
        if self.lru.contains(b) {
            self.lru.remove(b);
            let _ = self.lru.push_front(b);
        }
    }

    /// Unlinks `b` from the LRU (no-op if absent).
    #[inline]
    pub fn lru_remove(&mut self, b: BlockId) {
        self.lru.remove(b);
    }

    /// The hash `b` was last registered under, current or dropped (0 if never): what an eviction
    /// reports as removed.
    #[inline]
    pub fn last_hash(&self, b: BlockId) -> u128 {
        self.hash_of[b as usize]
    }

    /// Removes and returns the least recently freed block, dropping its hash: an eviction.
    #[inline]
    pub fn evict_oldest(&mut self) -> Option<BlockId> {
        let b = self.lru.pop_front()?;
        self.unregister(b);
        Some(b)
    }

    /// The LRU from oldest to newest (for invariant checks and tests). Stops after `limit` steps so
    /// a corrupted (cyclic) list cannot hang the caller.
    pub fn lru_order(&self, limit: usize) -> Vec<BlockId> {
        self.lru.order(limit)
    }

    /// Checks the LRU's links: each `prev` mirrors the `next` before it, the tail is the last node,
    /// the flags mark exactly the blocks on it.
    pub fn check_links(&self) -> Result<(), String> {
        self.lru.check("LRU")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_is_one_to_one() {
        let mut c = PrefixCache::new(4, 2, false, true);
        assert!(c.register(0, 10, &[1, 2]));
        assert!(
            !c.register(1, 10, &[1, 2]),
            "second block with the same hash stays unhashed"
        );
        assert!(!c.register(0, 11, &[1, 2]), "a hashed block keeps its hash");
        assert_eq!(c.lookup(10), Some(0));
        assert_eq!(c.hash_of(1), None);
        c.unregister(0);
        assert_eq!(c.lookup(10), None);
        assert!(c.register(1, 10, &[1, 2]));
        assert_eq!(c.num_hashed(), 1);
    }

    #[test]
    fn lru_order_push_remove_evict() {
        let mut c = PrefixCache::new(5, 1, false, true);
        for b in 0..5 {
            assert!(c.register(b, 100 + b as u128, &[0]));
        }
        for b in [3, 1, 4, 0] {
            c.lru_push(b);
        }
        assert_eq!(c.lru_order(10), vec![3, 1, 4, 0]);
        c.lru_remove(4);
        c.lru_remove(4);
        assert_eq!(c.lru_order(10), vec![3, 1, 0]);
        c.check_links().unwrap();
        assert_eq!(c.evict_oldest(), Some(3));
        assert_eq!(c.lookup(103), None);
        assert_eq!(c.hash_of(3), None);
        c.lru_remove(0);
        assert_eq!(c.lru_order(10), vec![1]);
        assert!(c.lru_push(2));
        assert_eq!(c.lru_order(10), vec![1, 2]);
        // A double push (of the newest, of the oldest) and a block outside the cache change
        // nothing: each block is still evicted once.
        assert!(!c.lru_push(2) && !c.lru_push(1) && !c.lru_push(5));
        assert_eq!(c.lru_order(10), vec![1, 2]);
        assert!(!c.in_lru(7));
        c.lru_remove(7);
        assert_eq!(c.lru_len(), 2);
        c.check_links().unwrap();
        assert_eq!(c.evict_oldest(), Some(1));
        assert_eq!(c.evict_oldest(), Some(2));
        assert_eq!(c.evict_oldest(), None);
        c.check_links().unwrap();
    }

    /// Dropped hashes leave stale map entries that read as misses, are overwritten by a later
    /// registration under the same key, and are swept before they pass their bound.
    #[test]
    fn lazy_deletion_reads_stale_entries_as_misses() {
        let n = 1024u32;
        let mut c = PrefixCache::new(n, 2, true, true);
        assert!(c.register(0, 10, &[1, 2]));
        c.lru_push(0);
        assert_eq!(c.evict_oldest(), Some(0));
        assert_eq!((c.lookup(10), c.num_hashed(), c.num_stale()), (None, 0, 1));
        c.check_map().unwrap();
        // The same key on another block takes the stale entry over; the old block gets a new key.
        assert!(c.register(1, 10, &[1, 2]));
        assert_eq!((c.lookup(10), c.num_stale()), (Some(1), 0));
        assert!(c.register(0, 11, &[3, 4]));
        assert!(!c.register(2, 10, &[1, 2]), "a live key stays its block's");
        c.unregister(0);
        assert_eq!(c.lookup(11), None);
        assert_eq!(c.entries().collect::<Vec<_>>(), vec![(10, 1)]);
        c.check_map().unwrap();
        // Churn through every block many times: stale entries never exceed the bound and the map
        // never grows past its presized capacity.
        let cap = c.map.capacity();
        let mut h = 100u128;
        for round in 0..20 {
            for b in 2..n {
                h += 1;
                assert!(c.register(b, h, &[b, round]));
                c.lru_push(b);
            }
            while c.lru_len() > 0 {
                c.evict_oldest();
            }
            assert!(c.num_stale() < DROP_BATCH, "{}", c.num_stale());
            c.check_map().unwrap();
        }
        // Never grown (a reallocation doubles it). Deletions can leave tombstones, which lower the
        // reported capacity by a few slots depending on the map's random key: not a growth.
        assert!(c.map.capacity() <= cap, "{} > {cap}", c.map.capacity());
        assert_eq!(c.lookup(10), Some(1));
        c.clear_hashes();
        assert_eq!((c.lookup(10), c.num_hashed(), c.num_stale()), (None, 0, 0));
    }

    #[test]
    fn verify_mode_keeps_tokens() {
        let mut c = PrefixCache::new(2, 3, true, true);
        assert!(c.register(1, 5, &[7, 8, 9]));
        assert!(c.matches(1, &[7, 8, 9]));
        assert!(!c.matches(1, &[7, 8, 0]));
        assert!(c.relabel(1, 6));
        assert_eq!(c.lookup(5), None);
        assert_eq!(c.lookup(6), Some(1));
        assert_eq!(c.stored_tokens(1), &[7, 8, 9]);
        let off = PrefixCache::new(2, 3, false, false);
        assert!(off.matches(0, &[1, 2, 3]));
    }

    #[test]
    fn fast_hasher_spreads_small_keys() {
        let b = FastBuild::default();
        let tops: std::collections::HashSet<u64> =
            (0..64u64).map(|x| b.hash_one(x) >> 57).collect();
        assert!(
            tops.len() > 32,
            "control bits should vary across small keys"
        );
    }

    /// Structured and crafted keys cost the same probes as random ones: the counts of a replayed
    /// SwissTable stay near one group per key, where the previous one-multiply hasher sent every
    /// such key to one bucket (tens of thousands of groups per key at these sizes).
    #[test]
    fn adversarial_keys_probe_like_random_ones() {
        let n = 48_000u64;
        let b = FastBuild::default();
        let seq_ids = probe_cost(&b, (0..n).map(|i| i << 32));
        let packed = probe_cost(&b, (0..n).map(|i| (i << 32) | 3));
        let dense = probe_cost(&b, 0..n);
        // Block hashes whose halves cancel (`lo ^ hi` constant) or whose low bits are zero.
        let cancel = probe_cost(&b, (0..n as u128).map(|i| (i << 64) | i));
        let high = probe_cost(&b, (0..n as u128).map(|i| i << 40));
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random = probe_cost(
            &b,
            (0..n).map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x as u128) << 64) | x.rotate_left(21) as u128
            }),
        );
        for (name, c) in [
            ("i << 32", seq_ids),
            ("(i << 32) | 3", packed),
            ("0..n", dense),
            ("lo ^ hi = 0", cancel),
            ("i << 40", high),
            ("random", random),
        ] {
            assert!(c < 1.5, "{name}: {c} groups per key");
        }
    }

    /// The replay really detects the blowup: a hasher that ignores its key's low bits costs a
    /// number of groups per key that grows with the key count.
    #[test]
    fn probe_cost_detects_clustered_hashes() {
        #[derive(Default)]
        struct Shift(u64);
        impl Hasher for Shift {
            fn finish(&self) -> u64 {
                self.0
            }
            fn write(&mut self, _: &[u8]) {}
            fn write_u64(&mut self, x: u64) {
                self.0 = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            }
        }
        let b = std::hash::BuildHasherDefault::<Shift>::default();
        let small = probe_cost(&b, (0..2_000u64).map(|i| i << 32));
        let large = probe_cost(&b, (0..8_000u64).map(|i| i << 32));
        assert!(small > 20.0 && large > 3.0 * small, "{small} {large}");
    }
}
