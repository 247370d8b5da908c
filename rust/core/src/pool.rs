//! The block pool: a free list plus one atomic reference count per block.
//!
//! The pool owns the answer to "is block `b` free, and if not, how many references does it
//! have?". It does not know about sequences, hashes or caching; those live in the manager, which
//! holds blocks through the counts kept here.
//!
//! Each block is in exactly one of three states, encoded in its count word:
//! - **free** (the word `FREE = u32::MAX` internally): on the free list, owned by nobody. Reported as refcount 0.
//! - **referenced** (count ≥ 1): handed out; `allocate` starts it at 1, `incref`/`decref` move it.
//! - **unreferenced** (count 0): allocated but holding no references — e.g. a block kept by a
//!   prefix cache for reuse. It can be revived with `incref` (0 → 1) or given back with `release`.
//!
//! Invariants:
//! - A block is on the free list iff its word is `FREE`; so no block is ever handed out twice,
//!   and no block is released twice (a second release or free fails instead of corrupting the
//!   list).
//! - Every state change is a single atomic compare-and-swap on the count word, so concurrent
//!   `incref`/`decref`/`free`/`release` calls on one block serialize without a lock. The last
//!   reference goes from 1 straight to free in one step, so a revive cannot slip in between.
//! - The transitions are written once, as pure functions of the current word; the `&self`
//!   methods apply them in CAS loops, and the `*_mut` methods (exclusive access, for a single
//!   owner such as the block manager) apply them with plain loads and stores. Both give the same
//!   results and errors and can be mixed on one pool.
//! - Every method validates its input first and returns a typed [`Error`] with the pool unchanged;
//!   nothing here panics on any input.

use crate::freelist::{FreeList, LockFreeFreeList};
use crate::{BlockId, Error, Result};

#[cfg(loom)]
use loom::sync::atomic::AtomicU32;
#[cfg(not(loom))]
use std::sync::atomic::AtomicU32;

use std::sync::atomic::Ordering::{self, AcqRel, Acquire, Relaxed};

/// Count word of a block that is on the free list.
const FREE: u32 = u32::MAX;
/// Largest reference count a block can reach; one more `incref` is refused.
pub const MAX_REFCOUNT: u32 = u32::MAX - 1;

// The state transitions, one pure function each: given a block's current count word, the word
// it moves to, or the error that refuses the move. The shared (`&self`, CAS loop) and the
// exclusive (`&mut self`, plain store) methods both apply these, so they cannot drift apart.

#[inline]
fn incref_step(id: BlockId, c: u32) -> Result<u32> {
    match c {
        FREE => Err(invalid_block_state(
            id,
            "block is on the free list; allocate it instead".into(),
        )),
        MAX_REFCOUNT => Err(invalid_block_state(
            id,
            format!("refcount would exceed {MAX_REFCOUNT}"),
        )),
        c => Ok(c + 1),
    }
}

#[inline]
fn decref_step(id: BlockId, c: u32) -> Result<u32> {
    match c {
        0 | FREE => Err(Error::RefcountUnderflow { block: id }),
        c => Ok(c - 1),
    }
}

/// Like [`decref_step`], but the last reference goes straight to `FREE`.
#[inline]
fn free_step(id: BlockId, c: u32) -> Result<u32> {
    match c {
        0 | FREE => Err(Error::RefcountUnderflow { block: id }),
        1 => Ok(FREE),
        c => Ok(c - 1),
    }
}

#[inline]
fn release_step(id: BlockId, c: u32) -> Result<u32> {
    match c {
        0 => Ok(FREE),
        FREE => Err(Error::RefcountUnderflow { block: id }),
        c => Err(invalid_block_state(
            id,
            format!("refcount is {c}; only a refcount-0 block can be released"),
        )),
    }
}

// Error construction is kept out of line, so the hot paths stay small.

#[cold]
#[inline(never)]
fn invalid_block_state(id: BlockId, reason: String) -> Error {
    Error::InvalidArgument {
        what: "block",
        value: id as i64,
        reason,
    }
}

#[cold]
#[inline(never)]
fn out_of_blocks(needed: usize, available: usize) -> Error {
    Error::OutOfBlocks { needed, available }
}

/// A fixed set of `num_blocks` blocks with per-block reference counts.
///
/// The `&self` methods are safe to call from many threads at once (share the pool behind an
/// `Arc` or a reference). A single owner should prefer the `*_mut` methods: same semantics,
/// no atomic read-modify-writes.
pub struct BlockPool<F: FreeList = LockFreeFreeList> {
    free: F,
    counts: Box<[AtomicU32]>,
}

impl<F: FreeList> std::fmt::Debug for BlockPool<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPool")
            .field("num_blocks", &self.num_blocks())
            .field("num_free", &self.num_free())
            .finish()
    }
}

impl<F: FreeList> BlockPool<F> {
    /// A pool of `num_blocks` free blocks, ids `0..num_blocks`.
    ///
    /// `InvalidConfig` for 0 blocks, or for `u32::MAX` (that id is the free list's sentinel).
    /// `AllocationFailed` when the host cannot hold its arrays.
    pub fn new(num_blocks: u32) -> Result<Self> {
        if num_blocks == 0 || num_blocks == u32::MAX {
            return Err(Error::InvalidConfig {
                field: "num_blocks",
                value: num_blocks as u64,
                reason: format!("must be in 1..={}", u32::MAX - 1),
            });
        }
        let counts = crate::error::alloc::collect_exact(
            num_blocks as usize,
            (0..num_blocks).map(|_| AtomicU32::new(FREE)),
            "block reference counts",
        )?
        .into_boxed_slice();
        Ok(BlockPool {
            free: F::try_with_capacity(num_blocks)?,
            counts,
        })
    }

    /// Number of blocks in the pool.
    #[inline]
    pub fn num_blocks(&self) -> u32 {
        self.counts.len() as u32
    }

    /// Number of blocks on the free list (exact when no operation is in flight).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    #[inline]
    fn word(&self, id: BlockId) -> Result<&AtomicU32> {
        let num_blocks = self.num_blocks();
        self.counts.get(id as usize).ok_or(Error::InvalidBlock {
            block: id,
            num_blocks,
        })
    }

    /// Applies `step` to the count word of `id` atomically (a CAS loop): the word changes only
    /// if `step` accepts its current value, so a refused transition leaves it untouched.
    /// Returns the new word. `success` is the ordering of the winning CAS.
    #[inline]
    fn update(
        &self,
        id: BlockId,
        success: Ordering,
        step: impl Fn(BlockId, u32) -> Result<u32>,
    ) -> Result<u32> {
        let w = self.word(id)?;
        let mut c = w.load(Relaxed);
        loop {
            let new = step(id, c)?;
            match w.compare_exchange_weak(c, new, success, Relaxed) {
                Ok(_) => return Ok(new),
                Err(actual) => c = actual,
            }
        }
    }

    /// Marks a block just taken off the free list as referenced once.
    #[inline]
    fn claim(&self, id: BlockId) {
        if let Some(w) = self.counts.get(id as usize) {
            debug_assert_eq!(
                w.load(Relaxed),
                FREE,
                "block {id} left the free list while not free"
            );
            // Relaxed store: nobody else writes a FREE word (every other transition refuses to
            // start from FREE), and the free list's Release push / Acquire pop already order
            // the release of this block before this store.
            w.store(1, Relaxed);
        }
    }

    /// Takes one free block; its refcount goes 0 → 1. `OutOfBlocks` if none is free.
    #[inline]
    pub fn allocate(&self) -> Result<BlockId> {
        match self.free.pop() {
            Some(id) => {
                self.claim(id);
                Ok(id)
            }
            None => Err(out_of_blocks(1, self.free.len())),
        }
    }

    /// All-or-nothing: appends `k` newly allocated blocks (each at refcount 1) to `out`, or
    /// returns `OutOfBlocks` with `out` and the pool unchanged. `k = 0` appends nothing.
    pub fn allocate_n(&self, k: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let start = out.len();
        if !self.free.try_pop_n(k, out) {
            return Err(out_of_blocks(k, self.free.len()));
        }
        for &id in &out[start..] {
            self.claim(id);
        }
        Ok(())
    }

    /// Current reference count of `id` (0 for a free block). `InvalidBlock` if out of range.
    #[inline]
    pub fn refcount(&self, id: BlockId) -> Result<u32> {
        let c = self.word(id)?.load(Acquire);
        Ok(if c == FREE { 0 } else { c })
    }

    /// Whether `id` is on the free list. `InvalidBlock` if out of range.
    #[inline]
    pub fn is_free(&self, id: BlockId) -> Result<bool> {
        Ok(self.word(id)?.load(Acquire) == FREE)
    }

    /// Adds a reference and returns the new count. 0 → 1 is allowed: it revives an
    /// unreferenced (cached) block. A free block cannot be referenced (it could be handed out
    /// at the same time) → `InvalidArgument`; so does a count already at [`MAX_REFCOUNT`].
    #[inline]
    pub fn incref(&self, id: BlockId) -> Result<u32> {
        // Acquire: a revive (0 → 1) must see what the last holder wrote before its Release
        // decref. For counts ≥ 1 it costs nothing extra on the platforms we target.
        self.update(id, Acquire, incref_step)
    }

    /// Drops a reference and returns the new count; the block stays allocated even at 0.
    /// `RefcountUnderflow` if the count is already 0 or the block is free (a double free).
    #[inline]
    pub fn decref(&self, id: BlockId) -> Result<u32> {
        // AcqRel: Release so this holder's writes are ordered before the drop; Acquire so the
        // holder that reaches 0 (and may release next) sees every earlier holder's.
        self.update(id, AcqRel, decref_step)
    }

    /// Puts an unreferenced (refcount-0) block back on the free list.
    /// `InvalidArgument` if it still has references; `RefcountUnderflow` if it is already free.
    #[inline]
    pub fn release(&self, id: BlockId) -> Result<()> {
        // The CAS 0 → FREE decides the race against a concurrent revive (incref 0 → 1): exactly
        // one of them wins. AcqRel as in `decref`; the push then publishes the block onwards.
        self.update(id, AcqRel, release_step)?;
        self.free.push(id)
    }

    /// Drops a reference and, if it was the last, puts the block back on the free list.
    /// Returns whether the block was released. `RefcountUnderflow` if the count is already 0 or
    /// the block is free.
    ///
    /// The last reference goes straight from 1 to free in one CAS, so no revive can slip in
    /// between the decrement and the release.
    #[inline]
    pub fn free(&self, id: BlockId) -> Result<bool> {
        // AcqRel: as in `decref`; the push below then publishes the block to its next owner.
        let released = self.update(id, AcqRel, free_step)? == FREE;
        if released {
            self.free.push(id)?;
        }
        Ok(released)
    }

    // Exclusive-access variants. `&mut self` proves no other thread can touch the pool, so
    // these read and write the count words and the free list with plain memory operations
    // instead of atomic read-modify-writes — the same transitions (the `*_step` functions), the
    // same results and errors, several times cheaper. A single-owner caller such as the block
    // manager should use them; the `&self` methods are for sharing the pool between threads.

    /// [`allocate`](Self::allocate) with exclusive access.
    #[inline]
    pub fn allocate_mut(&mut self) -> Result<BlockId> {
        match self.free.pop_mut() {
            Some(id) => {
                self.claim_mut(id);
                Ok(id)
            }
            None => Err(out_of_blocks(1, self.free.len())),
        }
    }

    /// [`allocate_n`](Self::allocate_n) with exclusive access.
    pub fn allocate_n_mut(&mut self, k: usize, out: &mut Vec<BlockId>) -> Result<()> {
        let start = out.len();
        if !self.free.try_pop_n_mut(k, out) {
            return Err(out_of_blocks(k, self.free.len()));
        }
        for &id in &out[start..] {
            self.claim_mut(id);
        }
        Ok(())
    }

    /// [`incref`](Self::incref) with exclusive access.
    #[inline]
    pub fn incref_mut(&mut self, id: BlockId) -> Result<u32> {
        self.update_mut(id, incref_step)
    }

    /// [`decref`](Self::decref) with exclusive access.
    #[inline]
    pub fn decref_mut(&mut self, id: BlockId) -> Result<u32> {
        self.update_mut(id, decref_step)
    }

    /// [`release`](Self::release) with exclusive access.
    #[inline]
    pub fn release_mut(&mut self, id: BlockId) -> Result<()> {
        self.update_mut(id, release_step)?;
        self.free.push_mut(id)
    }

    /// [`free`](Self::free) with exclusive access.
    #[inline]
    pub fn free_mut(&mut self, id: BlockId) -> Result<bool> {
        let released = self.update_mut(id, free_step)? == FREE;
        if released {
            self.free.push_mut(id)?;
        }
        Ok(released)
    }

    #[cfg(not(loom))]
    #[inline]
    fn update_mut(
        &mut self,
        id: BlockId,
        step: impl Fn(BlockId, u32) -> Result<u32>,
    ) -> Result<u32> {
        let num_blocks = self.num_blocks();
        let w = self
            .counts
            .get_mut(id as usize)
            .ok_or(Error::InvalidBlock {
                block: id,
                num_blocks,
            })?
            .get_mut();
        *w = step(id, *w)?;
        Ok(*w)
    }

    #[cfg(not(loom))]
    #[inline]
    fn claim_mut(&mut self, id: BlockId) {
        if let Some(w) = self.counts.get_mut(id as usize) {
            debug_assert_eq!(
                *w.get_mut(),
                FREE,
                "block {id} left the free list while not free"
            );
            *w.get_mut() = 1;
        }
    }

    // loom's atomics have no `get_mut`; under loom the exclusive variants take the atomic path.
    #[cfg(loom)]
    fn update_mut(
        &mut self,
        id: BlockId,
        step: impl Fn(BlockId, u32) -> Result<u32>,
    ) -> Result<u32> {
        self.update(id, AcqRel, step)
    }

    #[cfg(loom)]
    fn claim_mut(&mut self, id: BlockId) {
        self.claim(id)
    }

    /// Snapshot of the free list, in the order it would hand blocks out. Exact only when no
    /// operation is in flight.
    pub fn free_ids(&self) -> Vec<BlockId> {
        self.free.free_ids()
    }

    /// Checks, while quiescent, that the free list and the count words agree: every listed id is
    /// in range, listed once and marked free; every block marked free is listed; the free count
    /// matches. `InvariantViolation` describing the first mismatch otherwise.
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.num_blocks() as usize;
        let mut listed = vec![false; n];
        let ids = self.free.free_ids();
        for &id in &ids {
            let Some(seen) = listed.get_mut(id as usize) else {
                return Err(Error::InvariantViolation(format!(
                    "free list holds block {id}, outside the pool of {n}"
                )));
            };
            if *seen {
                return Err(Error::InvariantViolation(format!(
                    "block {id} is on the free list twice"
                )));
            }
            *seen = true;
        }
        if ids.len() != self.free.len() {
            return Err(Error::InvariantViolation(format!(
                "free list holds {} blocks but counts {}",
                ids.len(),
                self.free.len()
            )));
        }
        for (id, (w, &on_list)) in self.counts.iter().zip(&listed).enumerate() {
            let is_free = w.load(Acquire) == FREE;
            if is_free != on_list {
                return Err(Error::InvariantViolation(format!(
                    "block {id}: marked {} but {} the free list",
                    if is_free { "free" } else { "allocated" },
                    if on_list { "on" } else { "not on" }
                )));
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
