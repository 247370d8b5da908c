//! The offloading tier's index: the whole scheduler-side state of a host tier of KV chunks, with
//! one method per call vLLM's `OffloadingManager` makes (`pagedkv.vllm.offload` is its adapter).
//!
//! Owns, for `num_chunks` chunks:
//! - each chunk's reference count and the free list ([`IndexList`]): the order in which free
//!   chunks are reused, the front first. Never-used and failed chunks sit at the front; a ready
//!   chunk joins the back when its last reference goes, so the front of the ready part is the least
//!   recently released one (LRU);
//! - the key map: each chunk's key (an opaque byte string, inline up to [`INLINE_KEY`] bytes in
//!   the chunk's own slot, boxed above) and its hash, and an open-addressing table of chunk ids,
//!   each tagged with 32 bits of its key's hash (linear probing, at most a quarter full, never
//!   resized: a chunk holds at most one key, so the table holds at most `num_chunks` entries).
//!   The hash is XXH3-64 seeded per instance from the OS random source, so keys chosen to
//!   collide in one process's table cannot be precomputed;
//! - which chunks have a store in flight (pending), and each chunk's position stamp: where the
//!   request that last named it had it (its token position), else a counter of names. Completions
//!   release chunks tail first: by stamp, descending, ties in the order given.
//!
//! The calls and what they do:
//! - [`OffloadIndex::lookup`]: miss, hit (ready) or hit-pending (store in flight);
//! - [`OffloadIndex::prepare_load`]: one reference per key (every key ready), stamps;
//! - [`OffloadIndex::complete_load`]: gives them back tail first;
//! - [`OffloadIndex::touch`]: the present ready chunks to the back of the free order (when free)
//!   in reverse (the first key evicted last); the references of loads are kept;
//! - [`OffloadIndex::prepare_store`]: the offered keys not present (first occurrence each; with
//!   an admission mask, only the admitted ones) get chunks from the front of the free list,
//!   evicting ready chunks (their keys are returned); the offered ready chunks are held for the
//!   call, so a store never evicts its own keys, then go back to the free order in reverse. "No
//!   room" (fewer free chunks than new keys, the offered free ones not counted) changes nothing;
//! - [`OffloadIndex::complete_store`]: the chunks of the pending keys (first occurrence each)
//!   become ready and are released tail first, or, on failure, lose their keys and go to the
//!   front of the free list (reused first), in the order given.
//!
//! The calls that name keys again (loads, touches, completions) may be given a [`Hint`]: a guess
//! of each key's chunk (an earlier call's resolution, [`OffloadIndex::last_chunks`]). A guess is
//! taken only when the chunk's own key is that key, so hints make calls faster, never different.
//!
//! Lookups: a connector asks key by key, in prefix order, and a prefix's keys sit in adjacent
//! chunks (a store takes its chunks in free-list order, and a completion frees a run of chunks
//! together), so a lookup first compares the key with the chunks either side of the last hit,
//! and probes the table only when neither holds it: the table's entry is then not read at all,
//! and the neighbour's key slot is usually already in cache. "No two chunks hold equal keys"
//! makes a chunk whose key matches the one answer.
//!
//! Invariants (checked by [`OffloadIndex::check_invariants`]):
//! - a chunk is in the free list iff its count is zero; the list's own invariants hold;
//! - every held chunk is keyed; a pending chunk is keyed and held exactly once; `num_pending`
//!   counts the pending chunks;
//! - the table holds exactly the keyed chunks, each once, each reachable from its hash's home
//!   slot without crossing an empty slot; no two chunks hold equal keys; each stored hash is the
//!   hash of its key.
//!
//! Every fallible call validates before it mutates: an error leaves the index as it was.

use std::fmt::Write as _;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::alloc::{filled_vec, zeroed_vec};
use crate::error::{Error, Result};
use crate::hash::random_key;
use crate::index_list::{IndexList, NIL};

/// Keys up to this many bytes are stored inline, in the chunk's own slot (a vLLM offload key is
/// 32 hash bytes and a 4-byte group: 36); longer ones are boxed in a side map.
pub const INLINE_KEY: usize = 44;

/// An empty entry of the key table.
const EMPTY: u64 = u64::MAX;

/// The table entry of chunk `c` keyed with hash `h`.
#[inline]
fn entry(c: u32, h: u64) -> u64 {
    (h << 32) | u64::from(c)
}

/// The chunk of a table entry.
#[inline]
fn chunk_of(e: u64) -> u32 {
    e as u32
}

/// [`KeySlot::len`] of an unkeyed chunk.
const NO_KEY: u32 = u32::MAX;

/// One chunk's key (48 bytes), written in place: its length ([`NO_KEY`] when unkeyed) and, up to
/// [`INLINE_KEY`] bytes, the key itself.
#[derive(Clone)]
struct KeySlot {
    len: u32,
    inline: [u8; INLINE_KEY],
}

const EMPTY_SLOT: KeySlot = KeySlot {
    len: NO_KEY,
    inline: [0; INLINE_KEY],
};

/// A guess of each key's chunk ([`NIL_CHUNK`]: no guess), e.g. an earlier call's resolution of
/// the same keys ([`OffloadIndex::last_chunks`]). A call given one checks each guess against the
/// chunk's own key (one comparison instead of hashing and probing) and resolves the keys whose
/// guess is missing or wrong itself: a hint changes how fast a call runs, never what it does.
#[derive(Debug, Clone, Copy)]
pub struct Hint<'a> {
    /// Each key's guessed chunk.
    pub chunks: &'a [u32],
}

/// The chunk id that stands for "absent" in [`Hint`] and [`OffloadIndex::last_chunks`].
pub const NIL_CHUNK: u32 = NIL;

/// What [`OffloadIndex::lookup`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Not in the tier.
    Miss,
    /// Ready: loadable.
    Hit,
    /// Its store is in flight.
    Pending,
}

/// Counters since construction (they survive [`OffloadIndex::reset`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Lookups answered.
    pub lookups: u64,
    /// Lookups that found a ready chunk.
    pub hits: u64,
    /// Lookups that found a store in flight.
    pub pending_hits: u64,
    /// Chunks handed out by `prepare_store`.
    pub stores: u64,
    /// Stores that failed (chunks unkeyed by `complete_store`).
    pub failed_stores: u64,
    /// Ready chunks whose keys a store evicted.
    pub evictions: u64,
    /// Chunk references taken by `prepare_load`.
    pub loads: u64,
    /// `prepare_store` calls refused for want of room.
    pub refusals: u64,
}

/// What [`OffloadIndex::prepare_store`] hands back (buffers the caller may reuse).
#[derive(Debug, Clone, Default)]
pub struct StoreOut {
    /// Indices into the keys of the keys to store (first occurrence each, in order).
    pub new: Vec<usize>,
    /// Their chunks, in the same order (empty when there is no room).
    pub chunks: Vec<u32>,
    /// The bytes of the keys evicted to make room, one after the other, in eviction order.
    pub evicted: Vec<u8>,
    /// Where each evicted key ends in `evicted`.
    pub evicted_ends: Vec<usize>,
    /// The chunks that lost those keys, in the same order.
    pub evicted_chunks: Vec<u32>,
}

impl StoreOut {
    /// The evicted keys, in eviction order.
    pub fn evicted_keys(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        self.evicted_ends.iter().enumerate().map(|(j, &end)| {
            let start = if j == 0 { 0 } else { self.evicted_ends[j - 1] };
            &self.evicted[start..end]
        })
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct OffloadIndex {
    num_chunks: u32,
    refcnt: Vec<u32>,
    free: IndexList,
    /// Each chunk's key.
    key_of: Vec<KeySlot>,
    /// The keys longer than [`INLINE_KEY`] bytes, by chunk.
    long_keys: std::collections::HashMap<u32, Box<[u8]>>,
    /// Each keyed chunk's key hash.
    hash_of: Vec<u64>,
    /// Open-addressing table of keyed chunks, a power of two long: per entry the low 32 bits of
    /// the key's hash (a tag, and the home slot) above the chunk id ([`EMPTY`]: empty).
    slots: Vec<u64>,
    mask: usize,
    seed: u64,
    pending: Vec<bool>,
    num_pending: usize,
    num_keys: usize,
    stamp: Vec<i64>,
    tick: i64,
    stats: OffloadStats,
    /// The chunk the last [`Self::lookup`] hit ([`NIL`]: none): its neighbours are the first
    /// guesses for the next key (module docs, "Lookups").
    last_hit: u32,
    // Scratch, reused across calls.
    found: Vec<u32>,
    hashes: Vec<u64>,
    order: Vec<u32>,
    dedup: Vec<u32>,
    zeroed: Vec<u32>,
}

impl std::fmt::Debug for OffloadIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadIndex")
            .field("num_chunks", &self.num_chunks)
            .field("num_free", &self.free.len())
            .field("num_keys", &self.num_keys)
            .field("num_pending", &self.num_pending)
            .finish()
    }
}

/// Hints the CPU to bring `x`'s cache line in (no effect on other targets).
#[inline(always)]
fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint; it never faults, and `x` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch(
            (x as *const T).cast::<i8>(),
            std::arch::x86_64::_MM_HINT_T0,
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Short hex of a key for messages (the first 16 bytes).
fn show(key: &[u8]) -> String {
    let mut s = String::with_capacity(40);
    for b in key.iter().take(16) {
        let _ = write!(s, "{b:02x}");
    }
    if key.len() > 16 {
        s.push_str("..");
    }
    s
}

impl OffloadIndex {
    /// An index of `num_chunks` unkeyed free chunks in id order (0 is allowed: a tier that
    /// refuses every store). The hash seed comes from the OS random source.
    pub fn new(num_chunks: u32) -> Result<Self> {
        Self::with_seed(num_chunks, random_key()?)
    }

    /// [`Self::new`] with a given hash seed (tests; a fixed seed gives up HashDoS resistance).
    pub fn with_seed(num_chunks: u32, seed: u64) -> Result<Self> {
        if num_chunks == NIL {
            return Err(Error::InvalidConfig {
                field: "num_chunks",
                value: u64::from(num_chunks),
                reason: format!("must be in [0, {}]", NIL - 1),
            });
        }
        let n = num_chunks as usize;
        // At most a quarter full; the home slot is taken from the low 32 bits of the hash.
        let cap = (4 * n).max(8).next_power_of_two().min(1 << 32);
        let mut idx = OffloadIndex {
            num_chunks,
            refcnt: zeroed_vec(n, "offload index reference counts")?,
            free: IndexList::new(n, "offload index free list")?,
            key_of: Vec::new(),
            long_keys: std::collections::HashMap::new(),
            hash_of: Vec::new(),
            slots: filled_vec(cap, EMPTY, "offload index key table")?,
            mask: cap - 1,
            seed,
            pending: zeroed_vec(n, "offload index pending flags")?,
            num_pending: 0,
            num_keys: 0,
            stamp: Vec::new(),
            tick: 0,
            stats: OffloadStats::default(),
            last_hit: NIL,
            found: Vec::new(),
            hashes: Vec::new(),
            order: Vec::new(),
            dedup: Vec::new(),
            zeroed: Vec::new(),
        };
        idx.hash_of = filled_vec(n, 0u64, "offload index key hashes")?;
        idx.stamp = filled_vec(n, 0i64, "offload index position stamps")?;
        idx.key_of = filled_vec(n, EMPTY_SLOT, "offload index keys")?;
        for c in 0..num_chunks {
            idx.free.push_back(c)?;
        }
        Ok(idx)
    }

    /// Forgets every key and every reference, held chunks included: the state of a new index
    /// (the seed and the counters stay).
    pub fn reset(&mut self) {
        let n = self.num_chunks;
        self.refcnt.fill(0);
        self.key_of.fill(EMPTY_SLOT);
        self.long_keys.clear();
        self.hash_of.fill(0);
        self.slots.fill(EMPTY);
        self.pending.fill(false);
        self.stamp.fill(0);
        self.num_pending = 0;
        self.num_keys = 0;
        self.tick = 0;
        // Rebuilding the list cannot fail: it was allocated for `n` chunks and is emptied first.
        while self.free.pop_front().is_some() {}
        for c in 0..n {
            let _ = self.free.push_back(c);
        }
    }

    // ---- figures -------------------------------------------------------------------------

    /// Chunks in the tier.
    pub fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    /// Free chunks (never used, failed, or ready and unread): what a store may take.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Chunks with a store in flight.
    pub fn num_pending(&self) -> usize {
        self.num_pending
    }

    /// Keyed chunks (ready or pending).
    pub fn num_keys(&self) -> usize {
        self.num_keys
    }

    /// Counters since construction.
    pub fn stats(&self) -> OffloadStats {
        self.stats
    }

    /// Each key's chunk ([`NIL_CHUNK`]: absent) after the last call that named keys, in their
    /// order (a [`Hint`] for a later call naming the same keys).
    pub fn last_chunks(&self) -> &[u32] {
        &self.found
    }

    fn check_chunk(&self, c: u32) -> Result<usize> {
        if c < self.num_chunks {
            Ok(c as usize)
        } else {
            Err(Error::InvalidBlock {
                block: c,
                num_blocks: self.num_chunks,
            })
        }
    }

    /// A chunk's reference count (0: free).
    pub fn ref_count(&self, c: u32) -> Result<u32> {
        Ok(self.refcnt[self.check_chunk(c)?])
    }

    /// Whether the chunk is in the free list.
    pub fn is_free(&self, c: u32) -> Result<bool> {
        self.check_chunk(c)?;
        Ok(self.free.contains(c))
    }

    /// Whether the chunk has a store in flight.
    pub fn is_pending(&self, c: u32) -> Result<bool> {
        Ok(self.pending[self.check_chunk(c)?])
    }

    /// The chunk's key, if keyed.
    pub fn key(&self, c: u32) -> Result<Option<&[u8]>> {
        Ok(self.key_bytes(self.check_chunk(c)? as u32))
    }

    /// The chunk's position stamp (see the module documentation).
    pub fn stamp(&self, c: u32) -> Result<i64> {
        Ok(self.stamp[self.check_chunk(c)?])
    }

    /// Free chunks in reuse order, the front (taken next) first.
    pub fn free_order(&self) -> Vec<u32> {
        self.free.order(self.num_chunks as usize)
    }

    /// Every `(key, chunk)` pair, in chunk order.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], u32)> {
        (0..self.num_chunks).filter_map(|c| self.key_bytes(c).map(|k| (k, c)))
    }

    // ---- the key table -------------------------------------------------------------------

    /// Chunk `c`'s key, if keyed.
    #[inline]
    fn key_bytes(&self, c: u32) -> Option<&[u8]> {
        let s = &self.key_of[c as usize];
        match s.len {
            NO_KEY => None,
            n if n as usize <= INLINE_KEY => Some(&s.inline[..n as usize]),
            _ => self.long_keys.get(&c).map(|b| &b[..]),
        }
    }

    #[inline]
    fn hash(&self, key: &[u8]) -> u64 {
        xxh3_64_with_seed(key, self.seed)
    }

    /// The chunk keyed `key` (hash `h`), or [`NIL`].
    #[inline]
    fn find(&self, key: &[u8], h: u64) -> u32 {
        let tag = h & 0xffff_ffff;
        let mut i = h as usize & self.mask;
        loop {
            let e = self.slots[i];
            if e == EMPTY {
                return NIL;
            }
            if e >> 32 == tag && self.key_bytes(chunk_of(e)) == Some(key) {
                return chunk_of(e);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Keys unkeyed chunk `c` with `key` (hash `h`; the key must be absent).
    fn insert_key(&mut self, c: u32, key: &[u8], h: u64) {
        let mut i = h as usize & self.mask;
        while self.slots[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = entry(c, h);
        let s = &mut self.key_of[c as usize];
        s.len = key.len() as u32;
        if key.len() <= INLINE_KEY {
            s.inline[..key.len()].copy_from_slice(key);
        } else {
            self.long_keys.insert(c, key.into());
        }
        self.hash_of[c as usize] = h;
        self.num_keys += 1;
    }

    /// Unkeys chunk `c` (keyed), closing the gap in its probe run.
    fn remove_key(&mut self, c: u32) {
        let mut i = self.hash_of[c as usize] as usize & self.mask;
        while chunk_of(self.slots[i]) != c {
            i = (i + 1) & self.mask;
        }
        // Backward-shift deletion: move each later entry of the run whose home slot does not lie
        // cyclically in (i, j] into the hole.
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let e = self.slots[j];
            if e == EMPTY {
                break;
            }
            let home = (e >> 32) as usize & self.mask;
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = e;
                i = j;
            }
        }
        self.slots[i] = EMPTY;
        self.num_keys -= 1;
        self.hash_of[c as usize] = 0;
        if self.key_of[c as usize].len as usize > INLINE_KEY {
            self.long_keys.remove(&c);
        }
        self.key_of[c as usize].len = NO_KEY;
    }

    /// Fills `self.found` with each key's chunk ([`NIL`] when absent) and `self.hashes` with
    /// each key's hash. Two passes: every key's hash (prefetching its home slot), then the
    /// probes, so the table's cache misses overlap instead of following one another.
    fn find_all(&mut self, keys: &[&[u8]]) {
        let (mut found, mut hashes) = (
            std::mem::take(&mut self.found),
            std::mem::take(&mut self.hashes),
        );
        found.clear();
        hashes.clear();
        for k in keys {
            let h = self.hash(k);
            hashes.push(h);
            prefetch(&self.slots[h as usize & self.mask]);
        }
        for (k, &h) in keys.iter().zip(&hashes) {
            found.push(self.find(k, h));
        }
        self.found = found;
        self.hashes = hashes;
    }

    /// Fills `self.found`: each key's guessed chunk in `hint` when its key is that key, else by
    /// [`Self::find`]. Without a hint (or one of another length), [`Self::find_all`].
    fn resolve(&mut self, keys: &[&[u8]], hint: Option<Hint<'_>>) {
        let Some(h) = hint.filter(|h| h.chunks.len() == keys.len()) else {
            return self.find_all(keys);
        };
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        self.hashes.clear();
        for (k, &c) in keys.iter().zip(h.chunks) {
            let right = c < self.num_chunks && self.key_bytes(c) == Some(*k);
            found.push(if right { c } else { self.find(k, self.hash(k)) });
        }
        self.found = found;
    }

    // ---- references and the free order ---------------------------------------------------

    /// One reference more on each chunk (a chunk listed twice gains two); free ones leave the
    /// free list. Checked for overflow first.
    fn hold(&mut self, chunks: &[u32]) -> Result<()> {
        for &c in chunks {
            if self.refcnt[c as usize] == u32::MAX {
                return Err(Error::InvalidArgument {
                    what: "keys",
                    value: i64::from(c),
                    reason: format!("chunk {c}: reference count would overflow"),
                });
            }
        }
        for &c in chunks {
            let i = c as usize;
            if self.refcnt[i] == 0 {
                self.free.remove(c);
            }
            self.refcnt[i] += 1;
        }
        Ok(())
    }

    /// One reference fewer on each chunk, in order; each reaching zero joins the back of the
    /// free list. All or nothing: `RefcountUnderflow` (naming the chunk) changes nothing.
    fn unhold_to_back(&mut self, chunks: &[u32]) -> Result<()> {
        // A chunk joins the list when its count reaches zero: with repeats, where its last
        // repeat stands.
        self.zeroed.clear();
        for (k, &c) in chunks.iter().enumerate() {
            let i = c as usize;
            if self.refcnt[i] == 0 {
                for &u in &chunks[..k] {
                    self.refcnt[u as usize] += 1;
                }
                self.zeroed.clear();
                return Err(Error::RefcountUnderflow { block: c });
            }
            self.refcnt[i] -= 1;
            if self.refcnt[i] == 0 {
                self.zeroed.push(c);
            }
        }
        for &c in &self.zeroed {
            // Cannot fail: `c` just reached count zero, so it was not free.
            let _ = self.free.push_back(c);
        }
        Ok(())
    }

    /// Stamps `chunks` (named by `keys[idx[j]]`): positions when every one is known, else the
    /// next ticks. `positions` is empty (none known) or aligned with the keys.
    fn stamp_chunks(
        &mut self,
        chunks: &[u32],
        idx: impl Iterator<Item = usize> + Clone,
        positions: &[Option<i64>],
    ) {
        let known = !positions.is_empty() && idx.clone().all(|i| positions[i].is_some());
        if known {
            for (&c, i) in chunks.iter().zip(idx) {
                self.stamp[c as usize] = positions[i].unwrap_or_default();
            }
        } else {
            for &c in chunks {
                self.stamp[c as usize] = self.tick;
                self.tick += 1;
            }
        }
    }

    /// `self.order` sorted tail first: stamp descending, ties in the order given (stable).
    fn sort_tail_first(&mut self) {
        let stamp = &self.stamp;
        self.order
            .sort_by_key(|&c| std::cmp::Reverse(stamp[c as usize]));
    }

    fn check_positions(keys: &[&[u8]], positions: &[Option<i64>]) -> Result<()> {
        if !positions.is_empty() && positions.len() != keys.len() {
            return Err(Error::InvalidArgument {
                what: "positions",
                value: positions.len() as i64,
                reason: format!("{} positions for {} keys", positions.len(), keys.len()),
            });
        }
        Ok(())
    }

    /// Fills `self.found` and checks every key is present and ready (`what` names the call).
    fn ready(&mut self, keys: &[&[u8]], hint: Option<Hint<'_>>, what: &str) -> Result<()> {
        self.resolve(keys, hint);
        for (i, &c) in self.found.iter().enumerate() {
            let why = if c == NIL {
                "is not offloaded"
            } else if self.pending[c as usize] {
                "has a store in flight"
            } else {
                continue;
            };
            return Err(Error::InvalidArgument {
                what: "keys",
                value: i as i64,
                reason: format!("{what} of key {i} ({}): it {why}", show(keys[i])),
            });
        }
        Ok(())
    }

    // ---- the calls -----------------------------------------------------------------------

    /// Miss, hit or hit-pending.
    #[inline]
    pub fn lookup(&mut self, key: &[u8]) -> Lookup {
        self.lookup_chunk(key).0
    }

    /// [`Self::lookup`] and the key's chunk ([`NIL_CHUNK`] on a miss).
    #[inline]
    pub fn lookup_chunk(&mut self, key: &[u8]) -> (Lookup, u32) {
        self.stats.lookups += 1;
        let mut c = self.neighbour_of_last_hit(key);
        if c == NIL {
            c = self.find(key, self.hash(key));
        }
        let r = if c == NIL {
            Lookup::Miss
        } else if self.pending[c as usize] {
            self.stats.pending_hits += 1;
            Lookup::Pending
        } else {
            self.stats.hits += 1;
            Lookup::Hit
        };
        if c != NIL {
            self.last_hit = c;
        }
        (r, c)
    }

    /// The chunk after or before the last hit when it is keyed `key`, else [`NIL`]. A key is
    /// in one chunk at most, so a chunk whose key is `key` is the answer: a wrong guess costs
    /// one comparison and never changes it.
    #[inline]
    fn neighbour_of_last_hit(&self, key: &[u8]) -> u32 {
        let c = self.last_hit;
        if c == NIL {
            return NIL;
        }
        for g in [c.wrapping_add(1), c.wrapping_sub(1)] {
            if g < self.num_chunks && self.key_bytes(g) == Some(key) {
                return g;
            }
        }
        NIL
    }

    /// Each key's chunk ([`NIL`] when absent) into `out` (cleared first); changes nothing.
    pub fn chunks_of(&self, keys: &[&[u8]], out: &mut Vec<u32>) {
        out.clear();
        out.extend(keys.iter().map(|k| self.find(k, self.hash(k))));
    }

    /// Indices of the keys not in the tier, first occurrence each, in order (what a store of
    /// `keys` would offer to store before admission); changes nothing.
    pub fn missing(&mut self, keys: &[&[u8]]) -> Vec<usize> {
        self.find_all(keys);
        let mut out = Vec::new();
        let found = std::mem::take(&mut self.found);
        self.dedup_missing(keys, &found, None, &mut out);
        self.found = found;
        out
    }

    /// The indices `i` with `found[i] == NIL` (and `admit[i]`), first occurrence of each key.
    fn dedup_missing(
        &mut self,
        keys: &[&[u8]],
        found: &[u32],
        admit: Option<&[bool]>,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        let m = found.iter().filter(|&&c| c == NIL).count();
        if m == 0 {
            return;
        }
        // A scratch open-addressing set of key indices, at most half full.
        let cap = (2 * m).max(8).next_power_of_two();
        let mask = cap - 1;
        let mut set = std::mem::take(&mut self.dedup);
        set.clear();
        set.resize(cap, NIL);
        for (i, (&k, &c)) in keys.iter().zip(found).enumerate() {
            if c != NIL || admit.is_some_and(|a| !a[i]) {
                continue;
            }
            let h = self.hashes[i];
            let mut s = h as usize & mask;
            let dup = loop {
                let j = set[s];
                if j == NIL {
                    set[s] = i as u32;
                    break false;
                }
                if keys[j as usize] == k {
                    break true;
                }
                s = (s + 1) & mask;
            };
            if !dup {
                out.push(i);
            }
        }
        self.dedup = set;
    }

    /// Holds the chunks of `keys` (each present and ready; a key listed twice is held twice)
    /// until [`Self::complete_load`]; their chunks into `out` in the order of the keys, stamped.
    /// `InvalidArgument` naming the first key missing or pending, with nothing held.
    pub fn prepare_load(
        &mut self,
        keys: &[&[u8]],
        positions: &[Option<i64>],
        hint: Option<Hint<'_>>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        out.clear();
        Self::check_positions(keys, positions)?;
        self.ready(keys, hint, "prepare_load")?;
        let found = std::mem::take(&mut self.found);
        let r = self.hold(&found);
        if r.is_ok() {
            self.stamp_chunks(&found, 0..keys.len(), positions);
            self.stats.loads += found.len() as u64;
            out.extend_from_slice(&found);
        }
        self.found = found;
        r
    }

    /// Gives back the references [`Self::prepare_load`] took, tail first. `InvalidArgument` when
    /// a key is missing or pending, or its chunk is not held by a load; nothing changes then.
    pub fn complete_load(&mut self, keys: &[&[u8]], hint: Option<Hint<'_>>) -> Result<()> {
        self.ready(keys, hint, "complete_load")?;
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend_from_slice(&self.found);
        self.order = order;
        self.sort_tail_first();
        let order = std::mem::take(&mut self.order);
        let r = self.unhold_to_back(&order);
        self.order = order;
        r.map_err(|e| match e {
            Error::RefcountUnderflow { block } => Error::InvalidArgument {
                what: "keys",
                value: i64::from(block),
                reason: format!("complete_load of chunk {block}, which no load holds"),
            },
            e => e,
        })
    }

    /// Moves the present, ready chunks of `keys` that are free to the back of the free order,
    /// the first key last (evicted last); held ones keep their references. Other keys are
    /// ignored.
    pub fn touch(&mut self, keys: &[&[u8]], hint: Option<Hint<'_>>) {
        self.resolve(keys, hint);
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(
            self.found
                .iter()
                .rev()
                .copied()
                .filter(|&c| c != NIL && !self.pending[c as usize]),
        );
        // Overflow is impossible here short of u32::MAX loads of one chunk; then nothing moves.
        if self.hold(&order).is_ok() {
            let _ = self.unhold_to_back(&order);
        }
        self.order = order;
    }

    /// Chunks for the keys of `keys` not in the tier (first occurrence each; with `admit`,
    /// aligned with `keys`, only those admitted), evicting ready chunks from the front of the free
    /// order as needed, never one of `keys`. Fills `out`; returns false ("no room", nothing
    /// changed, `out.new` still says which keys would have been stored) when the free chunks not
    /// offered are too few. With no key to store it returns true with everything empty.
    pub fn prepare_store(
        &mut self,
        keys: &[&[u8]],
        positions: &[Option<i64>],
        admit: Option<&[bool]>,
        out: &mut StoreOut,
    ) -> Result<bool> {
        out.new.clear();
        out.chunks.clear();
        out.evicted.clear();
        out.evicted_ends.clear();
        out.evicted_chunks.clear();
        Self::check_positions(keys, positions)?;
        if let Some(a) = admit {
            if a.len() != keys.len() {
                return Err(Error::InvalidArgument {
                    what: "admit",
                    value: a.len() as i64,
                    reason: format!("{} admission flags for {} keys", a.len(), keys.len()),
                });
            }
        }
        self.find_all(keys);
        let found = std::mem::take(&mut self.found);
        let mut new = std::mem::take(&mut out.new);
        self.dedup_missing(keys, &found, admit, &mut new);
        out.new = new;
        let missing = found.iter().filter(|&&c| c == NIL).count();
        // The offered ready chunks, in order (repeats kept): held for the call.
        let mut held = std::mem::take(&mut self.order);
        held.clear();
        held.extend(
            found
                .iter()
                .copied()
                .filter(|&c| c != NIL && !self.pending[c as usize]),
        );
        self.found = found;
        let n = out.new.len();
        if n == 0 {
            self.order = held;
            return Ok(true);
        }
        let free_held = held.iter().filter(|&&c| self.free.contains(c)).count();
        if n + free_held > self.free.len() {
            self.order = held;
            self.stats.refusals += 1;
            return Ok(false);
        }
        if free_held > 0 {
            // Cannot overflow: a free chunk has count 0 and a held one at most the loads on it.
            let _ = self.hold(&held);
        }
        out.chunks.reserve(n);
        for _ in 0..n {
            let c = self.free.pop_front().expect("n <= free: checked above");
            self.refcnt[c as usize] = 1;
            if let Some(k) = self.key_bytes(c) {
                out.evicted.extend_from_slice(k);
                self.remove_key(c);
                out.evicted_ends.push(out.evicted.len());
                out.evicted_chunks.push(c);
                self.stats.evictions += 1;
            }
            out.chunks.push(c);
        }
        for (j, &i) in out.new.iter().enumerate() {
            let c = out.chunks[j];
            self.insert_key(c, keys[i], self.hashes[i]);
            self.pending[c as usize] = true;
            self.found[i] = c;
        }
        if out.new.len() != missing {
            // A repeated or unadmitted new key: what each of those names now, for last_chunks.
            for (i, k) in keys.iter().enumerate() {
                if self.found[i] == NIL {
                    self.found[i] = self.find(k, self.hashes[i]);
                }
            }
        }
        self.num_pending += n;
        self.stats.stores += n as u64;
        let chunks = std::mem::take(&mut out.chunks);
        self.stamp_chunks(&chunks, out.new.iter().copied(), positions);
        out.chunks = chunks;
        if free_held > 0 {
            held.reverse();
            let _ = self.unhold_to_back(&held);
        }
        self.order = held;
        Ok(true)
    }

    /// Completes the stores of the pending keys among `keys` (first occurrence each; others are
    /// ignored): on success their chunks become ready and are released tail first; on failure
    /// they lose their keys and go to the front of the free list in the order given. The indices
    /// of the completed keys go into `done` (cleared first).
    pub fn complete_store(
        &mut self,
        keys: &[&[u8]],
        success: bool,
        hint: Option<Hint<'_>>,
        done: &mut Vec<usize>,
    ) {
        done.clear();
        self.resolve(keys, hint);
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        for (i, &c) in self.found.iter().enumerate() {
            if c != NIL && self.pending[c as usize] {
                self.pending[c as usize] = false;
                order.push(c);
                done.push(i);
            }
        }
        self.num_pending -= order.len();
        self.order = order;
        if success {
            self.sort_tail_first();
            let order = std::mem::take(&mut self.order);
            // Each was held once, by its store.
            let _ = self.unhold_to_back(&order);
            self.order = order;
        } else {
            let order = std::mem::take(&mut self.order);
            for &c in &order {
                self.remove_key(c);
                self.refcnt[c as usize] = 0;
            }
            for &c in order.iter().rev() {
                let _ = self.free.push_front(c);
            }
            self.stats.failed_stores += order.len() as u64;
            self.order = order;
        }
    }

    // ---- checks --------------------------------------------------------------------------

    /// Checks the invariants of the module documentation; `InvariantViolation` names the first
    /// broken one.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |s: String| Err(Error::InvariantViolation(format!("offload index: {s}")));
        if let Err(e) = self.free.check("offload index free list") {
            return bad(e);
        }
        let n = self.num_chunks as usize;
        let mut pending = 0;
        let mut keyed = 0;
        for c in 0..n {
            let (r, free) = (self.refcnt[c], self.free.contains(c as u32));
            if (r == 0) != free {
                return bad(format!("chunk {c}: count {r}, in the free list: {free}"));
            }
            let k = self.key_bytes(c as u32);
            if r > 0 && k.is_none() {
                return bad(format!("chunk {c} is held {r} times but unkeyed"));
            }
            if self.pending[c] {
                pending += 1;
                if k.is_none() || r != 1 {
                    return bad(format!(
                        "pending chunk {c}: keyed {}, count {r}",
                        k.is_some()
                    ));
                }
            }
            if let Some(k) = k {
                keyed += 1;
                let h = self.hash(k);
                if self.hash_of[c] != h {
                    return bad(format!("chunk {c}: stored hash is not its key's"));
                }
                if self.find(k, h) != c as u32 {
                    return bad(format!(
                        "chunk {c}: its key ({}) finds another chunk or none",
                        show(k)
                    ));
                }
            }
        }
        let long = self
            .key_of
            .iter()
            .filter(|s| s.len != NO_KEY && s.len as usize > INLINE_KEY);
        if long.count() != self.long_keys.len() {
            return bad(format!(
                "{} long keys stored, not one per long-keyed chunk",
                self.long_keys.len()
            ));
        }
        if pending != self.num_pending {
            return bad(format!(
                "{pending} pending chunks, num_pending says {}",
                self.num_pending
            ));
        }
        let in_table = self.slots.iter().filter(|&&e| e != EMPTY).count();
        if keyed != self.num_keys || in_table != keyed {
            return bad(format!(
                "{keyed} keyed chunks, {in_table} table entries, num_keys says {}",
                self.num_keys
            ));
        }
        let mut seen = vec![false; n];
        for &e in &self.slots {
            if e == EMPTY {
                continue;
            }
            let c = chunk_of(e);
            if c as usize >= n || seen[c as usize] || self.key_bytes(c).is_none() {
                return bad(format!(
                    "table entry {c}: repeated, out of range or unkeyed"
                ));
            }
            if e >> 32 != self.hash_of[c as usize] & 0xffff_ffff {
                return bad(format!("table entry {c}: its tag is not its key's hash"));
            }
            seen[c as usize] = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Vec<u8> {
        let mut k = vec![0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        k.extend_from_slice(&0u32.to_be_bytes());
        k
    }

    fn keys(ids: &[u32]) -> Vec<Vec<u8>> {
        ids.iter().map(|&i| key(i)).collect()
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(|k| k.as_slice()).collect()
    }

    fn store(x: &mut OffloadIndex, ids: &[u32]) -> StoreOut {
        let k = keys(ids);
        let mut out = StoreOut::default();
        assert!(x.prepare_store(&refs(&k), &[], None, &mut out).unwrap());
        out
    }

    fn complete(x: &mut OffloadIndex, ids: &[u32], ok: bool) -> Vec<usize> {
        let k = keys(ids);
        let mut done = Vec::new();
        x.complete_store(&refs(&k), ok, None, &mut done);
        done
    }

    fn look(x: &mut OffloadIndex, i: u32) -> Lookup {
        x.lookup(&key(i))
    }

    #[test]
    fn lookups_guess_the_last_hits_neighbours_and_stay_right() {
        let mut x = OffloadIndex::with_seed(4, 3).unwrap();
        let out = store(&mut x, &[10, 11, 12]);
        assert_eq!(out.chunks, vec![0, 1, 2]);
        complete(&mut x, &[10, 11, 12], true);
        // In order and backwards: each answer from a neighbour of the last hit.
        for i in [10, 11, 12, 11, 10] {
            assert_eq!(x.lookup_chunk(&key(i)), (Lookup::Hit, i - 10));
        }
        // The neighbour loses its key (a failed store reuses it): no stale answer.
        assert_eq!(x.lookup_chunk(&key(10)), (Lookup::Hit, 0));
        let out = store(&mut x, &[20]);
        assert_eq!(out.chunks, vec![3]);
        complete(&mut x, &[20], false);
        assert_eq!(look(&mut x, 20), Lookup::Miss);
        assert_eq!(x.lookup_chunk(&key(12)), (Lookup::Hit, 2));
        // A key held in a non-adjacent chunk is still found through the table.
        assert_eq!(x.lookup_chunk(&key(10)), (Lookup::Hit, 0));
        assert_eq!(look(&mut x, 99), Lookup::Miss);
        x.check_invariants().unwrap();
    }

    #[test]
    fn store_is_pending_then_ready_and_dedups() {
        let mut x = OffloadIndex::with_seed(4, 1).unwrap();
        let out = store(&mut x, &[1, 2, 1]);
        assert_eq!((out.new, out.chunks), (vec![0, 1], vec![0, 1]));
        assert_eq!(look(&mut x, 1), Lookup::Pending);
        assert_eq!(look(&mut x, 3), Lookup::Miss);
        assert_eq!(complete(&mut x, &[2, 1, 2, 9], true), vec![0, 1]);
        assert_eq!(
            (look(&mut x, 1), look(&mut x, 2)),
            (Lookup::Hit, Lookup::Hit)
        );
        // Tail first by name order: 2 (named second) released first.
        assert_eq!(x.free_order(), vec![2, 3, 1, 0]);
        let out = store(&mut x, &[1, 2]);
        assert!(out.new.is_empty() && out.chunks.is_empty());
        x.check_invariants().unwrap();
    }

    #[test]
    fn no_room_changes_nothing_and_offered_keys_are_not_evicted() {
        let mut x = OffloadIndex::with_seed(3, 2).unwrap();
        store(&mut x, &[1, 2]);
        complete(&mut x, &[1, 2], true);
        store(&mut x, &[3]);
        let before = (
            x.free_order(),
            x.entries()
                .map(|(k, c)| (k.to_vec(), c))
                .collect::<Vec<_>>(),
        );
        let k = keys(&[2, 4, 5]);
        let mut out = StoreOut::default();
        assert!(!x.prepare_store(&refs(&k), &[], None, &mut out).unwrap());
        assert_eq!(out.new, vec![1, 2]);
        let after = (
            x.free_order(),
            x.entries()
                .map(|(k, c)| (k.to_vec(), c))
                .collect::<Vec<_>>(),
        );
        assert_eq!(before, after);
        let k = keys(&[2, 4]);
        assert!(x.prepare_store(&refs(&k), &[], None, &mut out).unwrap());
        assert_eq!(out.evicted_keys().collect::<Vec<_>>(), vec![&key(1)[..]]);
        assert_eq!(look(&mut x, 2), Lookup::Hit);
        x.check_invariants().unwrap();
    }

    #[test]
    fn loads_pin_and_release_tail_first_and_errors_change_nothing() {
        let mut x = OffloadIndex::with_seed(4, 3).unwrap();
        store(&mut x, &[1, 2, 3, 4]);
        complete(&mut x, &[1, 2, 3, 4], true);
        assert_eq!(x.free_order(), vec![3, 2, 1, 0]);
        let k = keys(&[3, 1]);
        let mut out = Vec::new();
        x.prepare_load(&refs(&k), &[], None, &mut out).unwrap();
        assert_eq!(out, vec![2, 0]);
        let bad = keys(&[1, 7]);
        let before = (x.free_order(), x.ref_count(0).unwrap());
        assert!(matches!(
            x.prepare_load(&refs(&bad), &[], None, &mut out),
            Err(Error::InvalidArgument { value: 1, .. })
        ));
        assert_eq!(before, (x.free_order(), x.ref_count(0).unwrap()));
        x.complete_load(&refs(&k), None).unwrap();
        assert_eq!(x.free_order(), vec![3, 1, 0, 2]);
        assert!(matches!(
            x.complete_load(&refs(&k), None),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(x.free_order(), vec![3, 1, 0, 2]);
        // With positions, the stamps decide: key 3 at 10, key 4 at 20 -> 4 released first.
        let k = keys(&[3, 4]);
        x.prepare_load(&refs(&k), &[Some(10), Some(20)], None, &mut out)
            .unwrap();
        x.complete_load(&refs(&k), None).unwrap();
        assert_eq!(x.free_order(), vec![1, 0, 3, 2]);
        x.check_invariants().unwrap();
    }

    #[test]
    fn failed_store_frees_first_and_touch_reorders() {
        let mut x = OffloadIndex::with_seed(4, 4).unwrap();
        store(&mut x, &[1]);
        complete(&mut x, &[1], true);
        let out = store(&mut x, &[2, 3]);
        assert_eq!(complete(&mut x, &[1, 2, 3], false), vec![1, 2]);
        assert_eq!(x.free_order()[..2], out.chunks[..]);
        assert_eq!(
            (look(&mut x, 2), look(&mut x, 1)),
            (Lookup::Miss, Lookup::Hit)
        );
        store(&mut x, &[5, 6]);
        complete(&mut x, &[5, 6], true);
        // free order now: 3, 0 (key 1), then 6's and 5's chunks
        let t = keys(&[1, 99, 6]);
        x.touch(&refs(&t), None);
        let order = x.free_order();
        assert_eq!(order[order.len() - 1], 0);
        x.check_invariants().unwrap();
    }

    #[test]
    fn zero_chunks_and_long_keys_and_reset() {
        let mut x = OffloadIndex::with_seed(0, 5).unwrap();
        let k = keys(&[1]);
        let mut out = StoreOut::default();
        assert!(!x.prepare_store(&refs(&k), &[], None, &mut out).unwrap());
        assert_eq!(look(&mut x, 1), Lookup::Miss);
        x.check_invariants().unwrap();
        let mut x = OffloadIndex::with_seed(2, 6).unwrap();
        let long = vec![7u8; 100];
        assert!(x.prepare_store(&[&long], &[], None, &mut out).unwrap());
        assert_eq!(x.lookup(&long), Lookup::Pending);
        x.check_invariants().unwrap();
        x.reset();
        assert_eq!(
            (x.lookup(&long), x.num_free(), x.num_pending()),
            (Lookup::Miss, 2, 0)
        );
        x.check_invariants().unwrap();
    }

    #[test]
    fn hints_are_checked_against_the_keys() {
        let mut x = OffloadIndex::with_seed(8, 8).unwrap();
        let k = keys(&[1, 2, 1, 3]);
        let mut out = StoreOut::default();
        assert!(x.prepare_store(&refs(&k), &[], None, &mut out).unwrap());
        // last_chunks names every key's chunk after the store, the repeat included.
        let last = x.last_chunks().to_vec();
        assert_eq!(last, vec![0, 1, 0, 2]);
        let mut done = Vec::new();
        x.complete_store(&refs(&k), true, Some(Hint { chunks: &last }), &mut done);
        assert_eq!(done, vec![0, 1, 3]);
        // Wrong, out-of-range and missing guesses are resolved by the keys themselves.
        let two = keys(&[1, 3]);
        let mut ids = Vec::new();
        x.prepare_load(&refs(&two), &[], Some(Hint { chunks: &[2, 99] }), &mut ids)
            .unwrap();
        assert_eq!(ids, vec![0, 2]);
        x.complete_load(
            &refs(&two),
            Some(Hint {
                chunks: &[NIL_CHUNK, 0],
            }),
        )
        .unwrap();
        assert_eq!((x.ref_count(0).unwrap(), x.ref_count(2).unwrap()), (0, 0));
        // A guess for a missing key does not make it present.
        let gone = keys(&[9]);
        assert!(x
            .prepare_load(&refs(&gone), &[], Some(Hint { chunks: &[0] }), &mut ids)
            .is_err());
        x.check_invariants().unwrap();
    }

    #[test]
    fn table_deletion_keeps_colliding_runs_reachable() {
        // Many keys in a small table: every removal shifts the run back; all stay findable.
        let mut x = OffloadIndex::with_seed(64, 7).unwrap();
        let all: Vec<u32> = (0..64).collect();
        store(&mut x, &all);
        complete(&mut x, &all, true);
        let odd: Vec<u32> = (0..64).filter(|i| i % 2 == 1).collect();
        store(&mut x, &[1000]); // evicts one
        let k = keys(&odd);
        let mut out = StoreOut::default();
        let _ = x.prepare_store(&refs(&k), &[], None, &mut out).unwrap();
        x.check_invariants().unwrap();
        let fresh: Vec<u32> = (2000..2040).collect();
        store(&mut x, &fresh);
        complete(&mut x, &fresh, false);
        x.check_invariants().unwrap();
    }
}
