//! The prefix cache: hash → block map, block → hash, and the LRU of cached-free blocks.
//!
//! A block is *hashed* when its (full, immutable) content has been registered under its chained
//! hash (see [`crate::hash`]). A hashed block whose refcount drops to 0 is not returned to the free
//! list: it becomes *cached-free* and joins the LRU, still findable by hash, until either a prefix
//! hit revives it or an allocation evicts it (dropping the hash).
//!
//! Invariants (checked by `BlockManager::check_invariants`):
//! - `map[h] == b` ⇔ `hash_of(b) == Some(h)`: one block per hash, one hash per block. A second block
//!   with the same content is simply left unhashed.
//! - A block is in the LRU ⇔ it is hashed and its refcount is 0.
//! - The LRU is a doubly linked list over `prev`/`next` arrays indexed by block id, oldest at
//!   `head`; insert, remove and pop-oldest are O(1) and allocation-free.
//! - In verify mode, `tokens[b*B..(b+1)*B]` holds the token ids of every hashed block `b`.
//!
//! This module does no reference counting; the manager decides when a block enters or leaves.

use crate::{BlockId, TokenId};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

const NIL: u32 = u32::MAX;

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
    map: FastMap<u128, BlockId>,
    hash_of: Vec<u128>,
    hashed: Vec<bool>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_lru: Vec<bool>,
    head: u32,
    tail: u32,
    lru_len: usize,
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
        use crate::error::alloc::{failure, filled_vec, zeroed_vec};
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
            // At most one hash per block: sized once, the map never grows on the hot path.
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
            prev: filled_vec(n, NIL, "prefix LRU links")?,
            next: filled_vec(n, NIL, "prefix LRU links")?,
            in_lru: zeroed_vec(n, "prefix LRU flags")?,
            head: NIL,
            tail: NIL,
            lru_len: 0,
            block_size: block_size as usize,
            tokens,
        })
    }

    /// True in verify mode.
    #[inline]
    pub fn verifies(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// The block registered under `h`, if any.
    #[inline]
    pub fn lookup(&self, h: u128) -> Option<BlockId> {
        self.map.get(&h).copied()
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
    pub fn num_hashed(&self) -> usize {
        self.map.len()
    }

    /// All `(hash, block)` entries (for invariant checks).
    pub fn entries(&self) -> impl Iterator<Item = (u128, BlockId)> + '_ {
        self.map.iter().map(|(&h, &b)| (h, b))
    }

    /// Registers block `b` (holding `tokens`) under `h`. Returns false, changing nothing, when `b`
    /// is already hashed or another block holds `h` (duplicate content stays unhashed).
    #[inline]
    pub fn register(&mut self, b: BlockId, h: u128, tokens: &[TokenId]) -> bool {
        if self.hashed[b as usize] {
            return false;
        }
        match self.map.entry(h) {
            std::collections::hash_map::Entry::Occupied(_) => return false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(b);
            }
        }
        self.hashed[b as usize] = true;
        self.hash_of[b as usize] = h;
        if self.verifies() {
            let bs = self.block_size;
            self.tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
        }
        true
    }

    /// Drops block `b`'s hash (no-op if unhashed). The caller makes sure `b` is not in the LRU.
    #[inline]
    pub fn unregister(&mut self, b: BlockId) {
        if self.hashed[b as usize] {
            self.hashed[b as usize] = false;
            let h = self.hash_of[b as usize];
            // One probe: on the eviction path each probe of a pool-sized map is a cache miss.
            if let std::collections::hash_map::Entry::Occupied(e) = self.map.entry(h) {
                if *e.get() == b {
                    e.remove();
                }
            }
        }
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
        if !self.hashed[b as usize] || self.map.contains_key(&h) {
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
        self.lru_len
    }

    /// Whether `b` is in the LRU.
    #[inline]
    pub fn in_lru(&self, b: BlockId) -> bool {
        self.in_lru[b as usize]
    }

    /// Appends `b` as the most recently freed block.
    #[inline]
    pub fn lru_push(&mut self, b: BlockId) {
        debug_assert!(!self.in_lru[b as usize]);
        let i = b as usize;
        self.in_lru[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.lru_len += 1;
    }

    /// Unlinks `b` from the LRU (no-op if absent).
    #[inline]
    pub fn lru_remove(&mut self, b: BlockId) {
        let i = b as usize;
        if !self.in_lru[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_lru[i] = false;
        self.lru_len -= 1;
    }

    /// Removes and returns the least recently freed block, dropping its hash: an eviction.
    #[inline]
    pub fn evict_oldest(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.lru_remove(b);
        self.unregister(b);
        Some(b)
    }

    /// The LRU from oldest to newest (for invariant checks and tests). Stops after `limit` steps so
    /// a corrupted (cyclic) list cannot hang the caller.
    pub fn lru_order(&self, limit: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut b = self.head;
        while b != NIL && out.len() <= limit {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    /// Checks the LRU's links: each `prev` mirrors the `next` before it, the tail is the last node.
    pub fn check_links(&self) -> Result<(), String> {
        let order = self.lru_order(self.hashed.len());
        if order.len() != self.lru_len {
            return Err(format!(
                "LRU walk finds {} blocks, length says {}",
                order.len(),
                self.lru_len
            ));
        }
        let mut p = NIL;
        for &b in &order {
            if self.prev[b as usize] != p {
                return Err(format!(
                    "LRU block {b}: prev is {}, expected {p}",
                    self.prev[b as usize]
                ));
            }
            if !self.in_lru[b as usize] {
                return Err(format!("LRU block {b} not flagged as in the LRU"));
            }
            p = b;
        }
        if self.tail != p {
            return Err(format!("LRU tail is {}, walk ends at {p}", self.tail));
        }
        let flagged = self.in_lru.iter().filter(|&&x| x).count();
        if flagged != self.lru_len {
            return Err(format!(
                "{flagged} blocks flagged in the LRU, length says {}",
                self.lru_len
            ));
        }
        Ok(())
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
        c.lru_push(2);
        assert_eq!(c.lru_order(10), vec![1, 2]);
        assert_eq!(c.lru_len(), 2);
        c.check_links().unwrap();
        assert_eq!(c.evict_oldest(), Some(1));
        assert_eq!(c.evict_oldest(), Some(2));
        assert_eq!(c.evict_oldest(), None);
        c.check_links().unwrap();
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
