//! Caller-keyed blocks: a block pool whose prefix cache is indexed by hashes the caller computes.
//!
//! [`crate::manager::BlockManager`] hashes token ids itself. An engine that already hashes its
//! blocks (vLLM v1 does, with its own hash function, extra keys and group ids) needs the other half
//! only: reference counts, an eviction order, and a map from its opaque keys to blocks. That is
//! what [`KeyedPool`] holds, and nothing else.
//!
//! # Keys
//! A key is an opaque byte string chosen by the caller. By convention its last four bytes are the
//! group id, big-endian ([`make_key`], [`key_group`]), so one pool can serve several groups of
//! layers that cache the same token prefix under different blocks. The pool never interprets the
//! hash bytes; it only compares them.
//!
//! # The eviction order
//! Free blocks sit in one [`IndexList`] (a doubly linked list over preallocated arrays), so a block
//! can leave from anywhere in O(1) (a cache hit on a free block *revives* it). Allocation takes
//! blocks from the front. A release places each block whose count reaches zero according to a
//! [`Placement`]: blocks that can never be hit again (no key) go to the front and are reused first;
//! cached blocks go to the back, so the front of the cached part is the least recently released
//! one (LRU). Taking a cached block off the front for a new owner *evicts* it: its keys leave
//! the map, and the caller is told which blocks lost keys.
//!
//! # The null block
//! With `reserve_null`, block 0 is taken at construction as a shared placeholder (vLLM's null
//! block for skipped positions). It is never free and its count is not kept: touching or
//! releasing it is a no-op, so callers may pass it in a table without filtering. It is never
//! keyed: it holds no KV of its own, so a key pointing at it would make a lookup hit a placeholder
//! ([`KeyedPool::insert`] refuses it), unless the pool was built with
//! [`KeyedPool::with_null_keys`]. That opt-in exists for vLLM's drop-in only: vLLM's
//! `BlockHashToBlockMap` keys whatever block its caller names (its own caching path skips the null
//! block, and so does the drop-in), and vLLM's tests key block 0 by hand.
//!
//! # Invariants (checked by [`KeyedPool::check_invariants`])
//! - A non-null block is in the free list iff its count is zero; the list's own invariants hold.
//! - `(key, block)` is in the map iff `key` is in the block's key list; no map entry is empty;
//!   a block appears at most once under a key.
//!
//! Every fallible call validates before it mutates: an error leaves the pool as it was.

use std::collections::HashMap;

use crate::error::alloc::{failure, zeroed_vec};
use crate::error::{Error, Result};
use crate::index_list::{IndexList, NIL};
use crate::BlockId;

/// Appends the 4-byte big-endian `group` to `hash`: the key layout the pool's group helpers use.
pub fn make_key(hash: &[u8], group: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(hash.len() + 4);
    k.extend_from_slice(hash);
    k.extend_from_slice(&group.to_be_bytes());
    k
}

/// The group id of a key built by [`make_key`] (`None` for keys shorter than four bytes).
pub fn key_group(key: &[u8]) -> Option<u32> {
    let n = key.len();
    (n >= 4).then(|| u32::from_be_bytes([key[n - 4], key[n - 3], key[n - 2], key[n - 1]]))
}

/// Where [`KeyedPool::release`] puts a block whose count reaches zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Uncached blocks to the front (reused first), cached blocks to the back (LRU order).
    ByCache,
    /// Every block to the front, in the order given (prefix caching off).
    Front,
    /// Every block to the back, in the order given (blocks still being read: last resort).
    Back,
}

/// Blocks stored under one key, in insertion order (the first one answers lookups). A key that
/// once held several blocks keeps the list form after removals down to one, which callers that
/// mirror vLLM's map shape can observe through [`KeyedPool::entries`].
#[derive(Debug, Clone)]
enum Slot {
    One(BlockId),
    Many(Vec<BlockId>),
}

impl Slot {
    fn first(&self) -> BlockId {
        match self {
            Slot::One(b) => *b,
            Slot::Many(v) => v[0],
        }
    }
    fn contains(&self, b: BlockId) -> bool {
        match self {
            Slot::One(x) => *x == b,
            Slot::Many(v) => v.contains(&b),
        }
    }
    fn blocks(&self) -> &[BlockId] {
        match self {
            Slot::One(b) => std::slice::from_ref(b),
            Slot::Many(v) => v,
        }
    }
}

/// Counters since construction (or since [`KeyedPool::reset`] for none: they survive resets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyedStats {
    /// Lookups answered.
    pub lookups: u64,
    /// Lookups that found a block.
    pub hits: u64,
    /// Blocks that lost their keys because allocation reused them.
    pub evictions: u64,
    /// Free blocks taken back by a hit (revived).
    pub revivals: u64,
}

/// A pool of `num_blocks` blocks with reference counts, an eviction order and a caller-keyed
/// prefix map. See the module documentation for the contract.
#[derive(Debug, Clone)]
pub struct KeyedPool {
    refcnt: Vec<u32>,
    free: IndexList,
    map: HashMap<Box<[u8]>, Slot>,
    /// Each block's keys, the first inserted first.
    keys: Vec<Vec<Box<[u8]>>>,
    null: Option<BlockId>,
    /// Whether `insert` may key the null block (see the module documentation).
    null_keys: bool,
    stats: KeyedStats,
}

impl KeyedPool {
    /// A pool of `num_blocks` free blocks in id order; with `reserve_null`, block 0 is taken as
    /// the null block (a one-block pool is then all null, with nothing to allocate).
    pub fn new(num_blocks: u32, reserve_null: bool) -> Result<Self> {
        if num_blocks == 0 || num_blocks == NIL {
            return Err(Error::InvalidConfig {
                field: "num_blocks",
                value: u64::from(num_blocks),
                reason: format!("must be in [1, {}]", NIL - 1),
            });
        }
        let n = num_blocks as usize;
        // Every array is reserved fallibly (`AllocationFailed`, not an abort of the process), the
        // largest (24 bytes a block) first and filled last, so that a pool too large for the
        // host fails before much memory is written.
        let mut keys: Vec<Vec<Box<[u8]>>> = Vec::new();
        keys.try_reserve_exact(n).map_err(|_| {
            failure(
                "keyed pool key lists",
                n as u128 * std::mem::size_of::<Vec<Box<[u8]>>>() as u128,
            )
        })?;
        let refcnt = zeroed_vec(n, "keyed pool reference counts")?;
        let mut free = IndexList::new(n, "keyed pool free list")?;
        for b in 0..num_blocks {
            free.push_back(b)?;
        }
        keys.resize(n, Vec::new());
        let mut pool = KeyedPool {
            refcnt,
            free,
            map: HashMap::new(),
            keys,
            null: None,
            null_keys: false,
            stats: KeyedStats::default(),
        };
        if reserve_null {
            pool.free.remove(0);
            pool.null = Some(0);
        }
        Ok(pool)
    }

    /// The same pool, whose `insert` keys the null block when `allow` (vLLM's map does; see the
    /// module documentation). Off by default.
    pub fn with_null_keys(mut self, allow: bool) -> Self {
        self.null_keys = allow;
        self
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.refcnt.len() as u32
    }

    /// Free blocks (cached ones included: they are reusable).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// The null block, if one was reserved.
    pub fn null_block(&self) -> Option<BlockId> {
        self.null
    }

    /// Keys in the map.
    pub fn num_keys(&self) -> usize {
        self.map.len()
    }

    /// Counters since construction.
    pub fn stats(&self) -> KeyedStats {
        self.stats
    }

    fn check_block(&self, b: BlockId) -> Result<()> {
        if (b as usize) < self.refcnt.len() {
            Ok(())
        } else {
            Err(Error::InvalidBlock {
                block: b,
                num_blocks: self.num_blocks(),
            })
        }
    }

    /// A block's reference count (0 for a free block and for the null block).
    pub fn ref_count(&self, b: BlockId) -> Result<u32> {
        self.check_block(b)?;
        Ok(self.refcnt[b as usize])
    }

    /// Whether the block has at least one key.
    pub fn is_cached(&self, b: BlockId) -> Result<bool> {
        self.check_block(b)?;
        Ok(!self.keys[b as usize].is_empty())
    }

    /// Whether the block is in the free list.
    pub fn is_free(&self, b: BlockId) -> Result<bool> {
        self.check_block(b)?;
        Ok(self.free.contains(b))
    }

    /// The block's keys, the first inserted first.
    pub fn keys_of(&self, b: BlockId) -> Result<&[Box<[u8]>]> {
        self.check_block(b)?;
        Ok(&self.keys[b as usize])
    }

    /// Free blocks in eviction order, front (reused next) first.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.order(self.refcnt.len())
    }

    /// Every `(key, blocks, list_form)` entry of the map, blocks in insertion order (unordered
    /// keys); `list_form` says the key has held several blocks at once since it was created.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], &[BlockId], bool)> {
        self.map
            .iter()
            .map(|(k, s)| (&**k, s.blocks(), matches!(s, Slot::Many(_))))
    }

    /// The first free block (allocated next), if any.
    pub fn free_front(&self) -> Option<BlockId> {
        self.free.front()
    }

    /// The last free block (evicted last), if any.
    pub fn free_back(&self) -> Option<BlockId> {
        self.free.back()
    }

    /// A free block's neighbours in the eviction order, `(before, after)`; `None` if the block is
    /// not free.
    pub fn free_neighbours(
        &self,
        b: BlockId,
    ) -> Result<Option<(Option<BlockId>, Option<BlockId>)>> {
        self.check_block(b)?;
        Ok(self.free.contains(b).then(|| self.free.neighbours(b)))
    }

    // ---- allocation, hits, release -------------------------------------------------------

    /// Takes `n` blocks from the front of the free list, each with count 1, into `out`
    /// (cleared first). A block that still had keys loses them: its id goes to `evicted` (cleared
    /// first), so the caller can drop its own view of them. All or nothing:
    /// [`Error::OutOfBlocks`] when fewer than `n` blocks are free.
    pub fn allocate_into(
        &mut self,
        n: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<BlockId>,
    ) -> Result<()> {
        out.clear();
        evicted.clear();
        if n > self.free.len() {
            return Err(Error::OutOfBlocks {
                needed: n,
                available: self.free.len(),
            });
        }
        out.reserve(n);
        for _ in 0..n {
            let b = self.free.pop_front().expect("n <= num_free: checked above");
            self.refcnt[b as usize] = 1;
            if !self.keys[b as usize].is_empty() {
                self.drop_keys(b);
                self.stats.evictions += 1;
                evicted.push(b);
            }
            out.push(b);
        }
        Ok(())
    }

    /// [`Self::allocate_into`] returning `(blocks, evicted)`.
    pub fn allocate(&mut self, n: usize) -> Result<(Vec<BlockId>, Vec<BlockId>)> {
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        self.allocate_into(n, &mut out, &mut ev)?;
        Ok((out, ev))
    }

    /// Adds one reference to each block (a prefix hit); a free block leaves the free list
    /// (revived) and keeps its keys. The null block is skipped. A block listed twice gains two.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.check_block(b)?;
            if self.refcnt[b as usize] == u32::MAX {
                return Err(Error::InvalidArgument {
                    what: "blocks",
                    value: i64::from(b),
                    reason: "reference count would overflow".into(),
                });
            }
        }
        for &b in blocks {
            if Some(b) == self.null {
                continue;
            }
            let i = b as usize;
            if self.refcnt[i] == 0 {
                self.free.remove(b);
                self.stats.revivals += 1;
            }
            self.refcnt[i] += 1;
        }
        Ok(())
    }

    /// Drops one reference from each block, in order; each that reaches zero joins the free list
    /// as `placement` says. Blocks sent to the front keep the order given (the first is reused
    /// first); so do blocks sent to the back (the first is evicted first among them). The null
    /// block is skipped. [`Error::RefcountUnderflow`] if a block would drop below zero (counting
    /// repeats in `blocks`); nothing changes then.
    pub fn release(&mut self, blocks: &[BlockId], placement: Placement) -> Result<()> {
        for &b in blocks {
            self.check_block(b)?;
        }
        // Decrement, undoing on an underflow so the call is all-or-nothing. A block is placed
        // when its count reaches zero, so with repeats it goes where its last repeat stands.
        let mut zeroed: Vec<BlockId> = Vec::new();
        for (k, &b) in blocks.iter().enumerate() {
            if Some(b) == self.null {
                continue;
            }
            let i = b as usize;
            if self.refcnt[i] == 0 {
                for &u in &blocks[..k] {
                    if Some(u) != self.null {
                        self.refcnt[u as usize] += 1;
                    }
                }
                return Err(Error::RefcountUnderflow { block: b });
            }
            self.refcnt[i] -= 1;
            if self.refcnt[i] == 0 {
                zeroed.push(b);
            }
        }
        let mut front: Vec<BlockId> = Vec::new();
        for b in zeroed {
            let to_back = match placement {
                Placement::Front => false,
                Placement::Back => true,
                Placement::ByCache => !self.keys[b as usize].is_empty(),
            };
            if to_back {
                // Cannot fail: `b` just reached count zero, so it was not free.
                self.free.push_back(b)?;
            } else {
                front.push(b);
            }
        }
        // `front[0]` becomes the new head: the order of `front` is kept.
        for &b in front.iter().rev() {
            self.free.push_front(b)?;
        }
        Ok(())
    }

    /// Sets a held block's count to `count` (for callers that retain a block outside the pool's
    /// calls). Moving a count to or from zero must go through [`Self::touch`] / [`Self::release`],
    /// which keep the free list: [`Error::InvalidArgument`] then.
    pub fn set_ref(&mut self, b: BlockId, count: u32) -> Result<()> {
        self.check_block(b)?;
        if Some(b) == self.null {
            return Ok(());
        }
        if self.refcnt[b as usize] == 0 || count == 0 {
            return Err(Error::InvalidArgument {
                what: "count",
                value: i64::from(count),
                reason: format!(
                    "block {b} has count {}; only a held block may be set, and not to 0",
                    self.refcnt[b as usize]
                ),
            });
        }
        self.refcnt[b as usize] = count;
        Ok(())
    }

    // ---- the keyed map -------------------------------------------------------------------

    /// The first block stored under `key`, if any.
    pub fn lookup(&mut self, key: &[u8]) -> Option<BlockId> {
        self.stats.lookups += 1;
        let hit = self.map.get(key).map(Slot::first);
        if hit.is_some() {
            self.stats.hits += 1;
        }
        hit
    }

    /// The first block under `hash ‖ group` for every group, or `None` as soon as one misses.
    /// Writes into `out` (cleared first); returns whether every group hit.
    pub fn lookup_groups(&mut self, hash: &[u8], groups: &[u32], out: &mut Vec<BlockId>) -> bool {
        out.clear();
        let mut key = Vec::with_capacity(hash.len() + 4);
        for &g in groups {
            key.clear();
            key.extend_from_slice(hash);
            key.extend_from_slice(&g.to_be_bytes());
            match self.lookup(&key) {
                Some(b) => out.push(b),
                None => {
                    out.clear();
                    return false;
                }
            }
        }
        true
    }

    /// Whether `key` maps to block `b`.
    pub fn contains(&self, key: &[u8], b: BlockId) -> bool {
        self.map.get(key).is_some_and(|s| s.contains(b))
    }

    /// Stores block `b` under `key` (after any blocks already there). Returns `false` when the
    /// pair was already present. Inserting the null block is [`Error::InvalidArgument`] unless the
    /// pool was built [`KeyedPool::with_null_keys`].
    pub fn insert(&mut self, key: &[u8], b: BlockId) -> Result<bool> {
        self.check_block(b)?;
        if Some(b) == self.null && !self.null_keys {
            return Err(Error::InvalidArgument {
                what: "block",
                value: i64::from(b),
                reason: "the null block cannot be keyed (it holds no KV of its own)".into(),
            });
        }
        match self.map.get_mut(key) {
            None => {
                self.map.insert(key.into(), Slot::One(b));
            }
            Some(slot) => {
                if slot.contains(b) {
                    return Ok(false);
                }
                match slot {
                    Slot::One(x) => *slot = Slot::Many(vec![*x, b]),
                    Slot::Many(v) => v.push(b),
                }
            }
        }
        self.keys[b as usize].push(key.into());
        Ok(true)
    }

    /// Removes the pair `(key, b)`; returns whether it was present.
    pub fn remove(&mut self, key: &[u8], b: BlockId) -> Result<bool> {
        self.check_block(b)?;
        if !self.contains(key, b) {
            return Ok(false);
        }
        self.unmap(key, b);
        let ks = &mut self.keys[b as usize];
        if let Some(pos) = ks.iter().position(|k| &**k == key) {
            ks.remove(pos);
        }
        Ok(true)
    }

    /// Removes every key of block `b` (the block stays where it is: held, or free and now
    /// uncached). Returns how many keys it had.
    pub fn evict(&mut self, b: BlockId) -> Result<usize> {
        self.check_block(b)?;
        Ok(self.drop_keys(b))
    }

    fn unmap(&mut self, key: &[u8], b: BlockId) {
        let Some(slot) = self.map.get_mut(key) else {
            return;
        };
        let empty = match slot {
            Slot::One(x) => *x == b,
            Slot::Many(v) => {
                v.retain(|&x| x != b);
                v.is_empty()
            }
        };
        if empty {
            self.map.remove(key);
        }
    }

    fn drop_keys(&mut self, b: BlockId) -> usize {
        let ks = std::mem::take(&mut self.keys[b as usize]);
        for k in &ks {
            self.unmap(k, b);
        }
        ks.len()
    }

    /// Forgets every key if no block other than the null block is held; returns whether it did.
    /// The free order is kept.
    pub fn reset(&mut self) -> bool {
        let held = self.refcnt.iter().filter(|&&c| c > 0).count();
        if held > 0 {
            return false;
        }
        self.clear_keys();
        true
    }

    /// Forgets every key, held blocks' included (no block moves or changes count).
    pub fn clear_keys(&mut self) {
        self.map.clear();
        for ks in &mut self.keys {
            ks.clear();
        }
    }

    /// Verifies every invariant of the module documentation; [`Error::InvariantViolation`] names
    /// the first broken one. O(blocks + keys); for tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvariantViolation(m));
        let n = self.refcnt.len();
        self.free.check("free list").or_else(bad)?;
        #[allow(clippy::needless_range_loop)] // i indexes four parallel arrays
        for i in 0..n {
            let is_null = self.null == Some(i as BlockId);
            let free = self.free.contains(i as BlockId);
            if is_null {
                if free || self.refcnt[i] != 0 {
                    return bad("the null block is free or counted".into());
                }
                if !self.null_keys && !self.keys[i].is_empty() {
                    return bad("the null block is keyed in a pool that refuses null keys".into());
                }
            } else if free != (self.refcnt[i] == 0) {
                return bad(format!(
                    "block {i}: count {} but free={}",
                    self.refcnt[i], free
                ));
            }
            for k in &self.keys[i] {
                if !self.map.get(k).is_some_and(|s| s.contains(i as BlockId)) {
                    return bad(format!("block {i} lists a key the map does not give it"));
                }
            }
        }
        let mut pairs = 0usize;
        for (k, s) in &self.map {
            let bs = s.blocks();
            if bs.is_empty() {
                return bad("a map entry is empty".into());
            }
            for (j, &b) in bs.iter().enumerate() {
                if bs[..j].contains(&b) {
                    return bad(format!("block {b} twice under one key"));
                }
                if !self.keys[b as usize].iter().any(|x| x == k) {
                    return bad(format!("the map gives block {b} a key it does not list"));
                }
            }
            pairs += bs.len();
        }
        let listed: usize = self.keys.iter().map(Vec::len).sum();
        if listed != pairs {
            return bad(format!(
                "{listed} keys listed by blocks, {pairs} pairs in the map"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(h: u8, g: u32) -> Vec<u8> {
        make_key(&[h; 8], g)
    }

    #[test]
    fn null_block_is_reserved_and_inert() {
        let mut p = KeyedPool::new(4, true).unwrap();
        assert_eq!(p.num_free(), 3);
        assert_eq!(p.free_order(), vec![1, 2, 3]);
        p.touch(&[0, 0]).unwrap();
        p.release(&[0], Placement::ByCache).unwrap();
        assert_eq!(p.ref_count(0).unwrap(), 0);
        assert!(matches!(
            p.insert(&key(1, 0), 0),
            Err(Error::InvalidArgument {
                what: "block",
                value: 0,
                ..
            })
        ));
        assert_eq!((p.num_keys(), p.is_cached(0).unwrap()), (0, false));
        assert!(p.allocate(3).is_ok());
        assert_eq!(p.lookup(&key(1, 0)), None);
        p.check_invariants().unwrap();
        // vLLM's drop-in opts in: its map keys any block its caller names.
        let mut v = KeyedPool::new(4, true).unwrap().with_null_keys(true);
        assert!(v.insert(&key(1, 0), 0).unwrap());
        assert_eq!(v.lookup(&key(1, 0)), Some(0));
        v.check_invariants().unwrap();
        assert!(v.remove(&key(1, 0), 0).unwrap());
        v.check_invariants().unwrap();
        // Without a reserved null block, block 0 is an ordinary block and may be keyed.
        let mut plain = KeyedPool::new(2, false).unwrap();
        assert!(plain.insert(&key(1, 0), 0).unwrap());
        let one = KeyedPool::new(1, true).unwrap();
        assert_eq!((one.num_free(), one.free_order()), (0, vec![]));
        one.check_invariants().unwrap();
        assert!(KeyedPool::new(0, false).is_err());
    }

    #[test]
    fn a_pool_too_large_for_the_host_is_an_error_not_an_abort() {
        // 2^32 - 2 blocks need ~100 GiB of key lists alone; hosts that could hold it are rare,
        // and there the pool is simply built.
        match KeyedPool::new(NIL - 1, false) {
            Err(Error::AllocationFailed { what, bytes }) => {
                assert!(what.starts_with("keyed pool"));
                assert!(bytes >= u64::from(NIL - 1));
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(p) => assert_eq!(p.num_blocks(), NIL - 1),
        }
    }

    #[test]
    fn uncached_to_front_cached_to_back() {
        let mut p = KeyedPool::new(6, true).unwrap();
        let (a, _) = p.allocate(4).unwrap();
        assert_eq!(a, vec![1, 2, 3, 4]);
        p.insert(&key(1, 0), 1).unwrap();
        p.insert(&key(2, 0), 2).unwrap();
        p.release(&[1, 3, 2, 4], Placement::ByCache).unwrap();
        // Uncached 3, 4 in front, in the order given; then 5; cached 1, 2 at the back.
        assert_eq!(p.free_order(), vec![3, 4, 5, 1, 2]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn touch_revives_and_allocation_evicts_lru_first() {
        let mut p = KeyedPool::new(4, true).unwrap();
        let (a, _) = p.allocate(3).unwrap();
        for (i, &b) in a.iter().enumerate() {
            p.insert(&key(i as u8, 0), b).unwrap();
        }
        p.release(&a, Placement::ByCache).unwrap();
        assert_eq!(p.lookup(&key(1, 0)), Some(2));
        p.touch(&[2]).unwrap();
        assert_eq!(p.free_order(), vec![1, 3]);
        let (got, ev) = p.allocate(1).unwrap();
        assert_eq!((got, ev), (vec![1], vec![1]));
        assert_eq!(p.lookup(&key(0, 0)), None);
        assert_eq!(p.lookup(&key(1, 0)), Some(2));
        assert_eq!(p.stats().evictions, 1);
        assert_eq!(p.stats().revivals, 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn errors_leave_state_unchanged() {
        let mut p = KeyedPool::new(4, true).unwrap();
        let (a, _) = p.allocate(2).unwrap();
        let before = (
            p.free_order(),
            p.ref_count(1).unwrap(),
            p.ref_count(2).unwrap(),
        );
        assert!(matches!(
            p.release(&[1, 2, 2], Placement::ByCache),
            Err(Error::RefcountUnderflow { block: 2 })
        ));
        assert!(matches!(p.allocate(3), Err(Error::OutOfBlocks { .. })));
        assert!(matches!(
            p.touch(&[1, 9]),
            Err(Error::InvalidBlock { block: 9, .. })
        ));
        assert!(p.set_ref(3, 2).is_err());
        let after = (
            p.free_order(),
            p.ref_count(1).unwrap(),
            p.ref_count(2).unwrap(),
        );
        assert_eq!(before, after);
        p.release(&a, Placement::Back).unwrap();
        p.check_invariants().unwrap();
    }

    #[test]
    fn several_blocks_under_one_key_and_groups() {
        let mut p = KeyedPool::new(5, true).unwrap();
        let (a, _) = p.allocate(3).unwrap();
        let h = [7u8; 32];
        assert!(p.insert(&make_key(&h, 0), a[0]).unwrap());
        assert!(p.insert(&make_key(&h, 0), a[1]).unwrap());
        assert!(!p.insert(&make_key(&h, 0), a[1]).unwrap());
        assert!(p.insert(&make_key(&h, 1), a[2]).unwrap());
        assert_eq!(key_group(&make_key(&h, 1)), Some(1));
        let mut out = Vec::new();
        assert!(p.lookup_groups(&h, &[0, 1], &mut out));
        assert_eq!(out, vec![a[0], a[2]]);
        assert!(!p.lookup_groups(&h, &[0, 2], &mut out));
        assert!(out.is_empty());
        assert!(p.remove(&make_key(&h, 0), a[0]).unwrap());
        assert_eq!(p.lookup(&make_key(&h, 0)), Some(a[1]));
        assert_eq!(p.num_keys(), 2);
        p.check_invariants().unwrap();
        assert!(!p.reset());
        p.release(&a, Placement::ByCache).unwrap();
        assert!(p.reset());
        assert_eq!(p.num_keys(), 0);
        p.check_invariants().unwrap();
    }
}
