//! Free lists of block ids.
//!
//! This module owns the set of block ids that are currently free, and nothing else: reference
//! counts and the "who owns what" bookkeeping live in [`crate::pool`]. Two implementations share
//! the [`FreeList`] trait:
//!
//! - [`LockFreeFreeList`]: a tagged Treiber stack threaded through a preallocated `next` array.
//!   The head (index of the top node plus a modification tag) is one `AtomicU64`, so a pop's
//!   compare-and-swap fails whenever *anything* happened to the stack since the head was read —
//!   the ABA problem cannot occur short of 2^32 successful operations landing between one
//!   thread's load and its CAS.
//! - [`MutexFreeList`]: a `Mutex<Vec<u32>>`, the baseline the benches compare against.
//!
//! Invariants, for both:
//! - Every id in `0..capacity` is either on the list exactly once or held by exactly one caller.
//!   `push` checks it: pushing an id that is already free (or outside the list) is a typed error
//!   that leaves the list unchanged, so a caller's double free cannot corrupt it.
//! - `len()` is authoritative: it is exact whenever no operation is in flight, and `try_pop_n(k)`
//!   succeeds iff it could reserve `k` from it.
//! - A fresh list hands out ids in increasing order (0, 1, 2, …), and a batch pop hands out the
//!   same ids, in the same order, as the equivalent run of single pops.
//!
//! Each operation also has an exclusive-access form (`pop_mut`, `try_pop_n_mut`, `push_mut`):
//! `&mut self` proves nobody else is using the list, so it runs the same protocol with plain loads
//! and stores — same results, a fraction of the cost. A single owner should use those.
//!
//! The lock-free list is written against `loom`'s atomics when built with `--cfg loom`, so the
//! very code below is model-checked by `tests/loom_freelist.rs`.

use crate::{BlockId, Error, Result};

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
#[cfg(loom)]
use loom::sync::Mutex;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
#[cfg(not(loom))]
use std::sync::Mutex;

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// A concurrent set of free block ids in `0..capacity`.
///
/// The `&self` methods are safe to call from many threads at once. The `*_mut` methods do the
/// same with exclusive access, which lets an implementation skip its synchronization; both
/// kinds can be mixed freely on one list.
pub trait FreeList: Send + Sync {
    /// A list holding every id in `0..n`, handing out low ids first.
    ///
    /// `u32::MAX` is reserved as the "no block" sentinel, so the capacity is at most
    /// `u32::MAX - 1`; a larger `n` is clamped to that.
    fn with_capacity(n: u32) -> Self
    where
        Self: Sized;

    /// [`with_capacity`](Self::with_capacity), with the allocation made fallibly:
    /// `AllocationFailed` instead of an abort when the host cannot hold the list.
    fn try_with_capacity(n: u32) -> Result<Self>
    where
        Self: Sized,
    {
        Ok(Self::with_capacity(n))
    }

    /// Number of ids this list was built over.
    fn capacity(&self) -> u32;

    /// Number of free ids. Exact when no operation is in flight; while pops and pushes race it
    /// may lag by the operations not yet finished, but it never exceeds what can be popped.
    fn len(&self) -> usize;

    /// Whether no id is free.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes one free id, or `None` if there is none.
    fn pop(&self) -> Option<BlockId>;

    /// All-or-nothing: appends exactly `k` free ids to `out` and returns `true`, or leaves `out`
    /// and the list untouched and returns `false` when fewer than `k` are free.
    fn try_pop_n(&self, k: usize, out: &mut Vec<BlockId>) -> bool;

    /// Returns `id` to the list. `InvalidBlock` for an id outside `0..capacity`;
    /// `RefcountUnderflow` (a double free) for an id that is already free (or that a concurrent
    /// `push` is returning). Either error leaves the list unchanged.
    fn push(&self, id: BlockId) -> Result<()>;

    /// A snapshot of the free ids, top of the list first (the order they would be popped in).
    ///
    /// Only meaningful when no operation is in flight. The walk is bounded by the capacity, so
    /// even a corrupted list cannot make it loop forever; the result may then hold duplicates or
    /// be cut short, which is exactly what an invariant check wants to see.
    fn free_ids(&self) -> Vec<BlockId>;

    /// [`pop`](Self::pop) with exclusive access: `&mut self` proves no other thread is using
    /// the list, so an implementation may use plain memory operations. Same result as `pop`.
    #[inline]
    fn pop_mut(&mut self) -> Option<BlockId> {
        self.pop()
    }

    /// [`try_pop_n`](Self::try_pop_n) with exclusive access; same result.
    #[inline]
    fn try_pop_n_mut(&mut self, k: usize, out: &mut Vec<BlockId>) -> bool {
        self.try_pop_n(k, out)
    }

    /// [`push`](Self::push) with exclusive access; same effect and errors.
    #[inline]
    fn push_mut(&mut self, id: BlockId) -> Result<()> {
        self.push(id)
    }
}

/// Index value meaning "no node": the empty stack, or the end of the chain.
const NIL: u32 = u32::MAX;

/// `next` value of a node that is not on the list (handed out). Never a valid id or `NIL`, and
/// outside every list (ids are below [`MAX_CAPACITY`]), so a stale reader that follows it finds
/// no node. `push` only links a node whose `next` is `TAKEN`, which is how it recognises an id
/// that is already free in O(1) and without extra memory.
const TAKEN: u32 = u32::MAX - 1;

/// Largest capacity: every valid id must differ from [`NIL`] and [`TAKEN`].
const MAX_CAPACITY: u32 = u32::MAX - 1;

#[cold]
#[inline(never)]
fn push_error(id: BlockId, capacity: u32) -> Error {
    if id >= capacity {
        Error::InvalidBlock {
            block: id,
            num_blocks: capacity,
        }
    } else {
        Error::RefcountUnderflow { block: id }
    }
}

/// How many times a batch pop tries to take its whole reservation with one CAS before it
/// falls back to popping node by node (which always makes progress).
const BATCH_ATTEMPTS: usize = 2;

#[inline(always)]
fn pack(tag: u32, index: u32) -> u64 {
    ((tag as u64) << 32) | index as u64
}

#[inline(always)]
fn index_of(head: u64) -> u32 {
    head as u32
}

#[inline(always)]
fn tag_of(head: u64) -> u32 {
    (head >> 32) as u32
}

/// Exponential back-off for CAS retry loops: after a lost race, wait a little longer each time
/// before retrying, so two cores stop bouncing the head's cache line back and forth on every
/// attempt. Under loom it yields instead, so the model checker does not explore a busy spin.
struct Backoff(u32);

impl Backoff {
    /// Longest wait is 2^LIMIT spin hints.
    const LIMIT: u32 = 6;

    #[inline(always)]
    fn new() -> Self {
        Backoff(0)
    }

    #[inline]
    fn snooze(&mut self) {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        for _ in 0..1u32 << self.0 {
            std::hint::spin_loop();
        }
        if self.0 < Self::LIMIT {
            self.0 += 1;
        }
    }
}

/// The two words every operation touches — the stack head and the free count — kept together
/// on one line, aligned (and padded) to 128 bytes: one line to own per operation instead of
/// two, and nothing else (the `next` array, other objects) sharing it or the prefetched
/// neighbour line.
#[repr(align(128))]
struct Hot {
    head: AtomicU64,
    count: AtomicUsize,
}

/// Lock-free free list: a tagged Treiber stack over a preallocated `next` array.
///
/// Layout: `next[i]` is the id below `i` on the stack (or `NIL` = `u32::MAX`); `head` packs
/// `(tag << 32) | top_index`; `count` is the authoritative number of free ids.
///
/// Protocol:
/// - **push** links the node (store `next[id]`, CAS the head), *then* increments `count`.
/// - **pop** first reserves one unit from `count` (refusing at 0), *then* unlinks a node.
///
/// Because a node is always on the stack before it is counted, and counted before anyone can
/// reserve it, a thread holding a reservation of `k` is guaranteed that `k` nodes are on the
/// stack for it: it may have to retry a CAS, but it never finds the stack short. That is what
/// makes [`FreeList::try_pop_n`] all-or-nothing without a lock.
pub struct LockFreeFreeList {
    hot: Hot,
    next: Box<[AtomicU32]>,
    capacity: u32,
}

impl std::fmt::Debug for LockFreeFreeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockFreeFreeList")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl LockFreeFreeList {
    /// Reserves `k` units from the free count, or refuses (returning `false`) if fewer are
    /// counted. On success the caller owns the right to unlink exactly `k` nodes.
    #[inline]
    fn reserve(&self, k: usize) -> bool {
        // Relaxed first read: it only seeds the CAS, which re-validates the value.
        let mut c = self.hot.count.load(Relaxed);
        let mut backoff = Backoff::new();
        loop {
            if c < k {
                return false;
            }
            // Acquire on success: it pairs with the Release increment in `push`, so the head
            // CAS that linked each counted node happens-before our own head operations. That
            // is the step that turns "counted" into "visible on the stack".
            match self
                .hot
                .count
                .compare_exchange_weak(c, c - k, Acquire, Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => {
                    c = actual;
                    backoff.snooze();
                }
            }
        }
    }

    /// Unlinks one node; the caller holds a reservation for it.
    #[inline]
    fn pop_reserved(&self) -> u32 {
        // Acquire: pairs with the Release head CAS of the push that linked the top node, so the
        // `next[top]` store that push made (and whatever the pusher wrote into the block) is
        // visible to us. Every head update is a read-modify-write, so this holds for any push
        // earlier in the head's modification order, not only the latest one.
        let mut cur = self.hot.head.load(Acquire);
        let mut backoff = Backoff::new();
        loop {
            let top = index_of(cur);
            if top == NIL {
                // Our reservation guarantees a node at the head's latest value; an empty head
                // can only be a stale read. Re-read until the link becomes visible.
                backoff.snooze();
                cur = self.hot.head.load(Acquire);
                continue;
            }
            // Relaxed: ordered by the Acquire above. If `top` was popped and re-pushed since
            // we read the head, this value may be garbage — but then the tag moved on, and the
            // CAS below fails.
            let below = match self.next.get(top as usize) {
                Some(n) => n.load(Relaxed),
                None => NIL, // unreachable: only valid ids are ever linked
            };
            let new = pack(tag_of(cur).wrapping_add(1), below);
            // Acquire on failure too: the value we get back becomes our next `cur`, whose
            // `next` entry we read on the next iteration.
            match self
                .hot
                .head
                .compare_exchange_weak(cur, new, Acquire, Acquire)
            {
                Ok(_) => {
                    // The node is ours: mark it handed out, so only its owner can push it back.
                    // Relaxed: the owner's later push is ordered after this by program order or
                    // by whatever hand-off gave another thread the id.
                    self.next[top as usize].store(TAKEN, Relaxed);
                    return top;
                }
                Err(actual) => {
                    cur = actual;
                    backoff.snooze();
                }
            }
        }
    }

    /// Unlinks `k >= 1` reserved nodes with one CAS: collects the top `k` nodes by walking the
    /// `next` links and swings the head to the node below them. Returns `false` (with `out` as it was) if the walk saw an
    /// inconsistent chain or the CAS lost a race.
    ///
    /// The walk is sound: a successful CAS proves the head did not change since it was read, and
    /// since every stack change moves the head's tag, the chain below it did not change either.
    /// The `next` values read along it were published by the pushes that linked those nodes, all
    /// of which precede the head value we acquired.
    #[inline]
    fn try_pop_chain(&self, k: usize, out: &mut Vec<BlockId>) -> bool {
        let start = out.len();
        let cur = self.hot.head.load(Acquire);
        let mut node = index_of(cur);
        for _ in 0..k {
            match self.next.get(node as usize) {
                Some(n) => {
                    out.push(node);
                    node = n.load(Relaxed);
                }
                None => {
                    // Hit NIL (or an out-of-range stale value): not a consistent snapshot.
                    out.truncate(start);
                    return false;
                }
            }
        }
        let new = pack(tag_of(cur).wrapping_add(1), node);
        if self
            .hot
            .head
            .compare_exchange(cur, new, Acquire, Relaxed)
            .is_ok()
        {
            for &id in &out[start..] {
                self.next[id as usize].store(TAKEN, Relaxed);
            }
            true
        } else {
            out.truncate(start);
            false
        }
    }
}

impl FreeList for LockFreeFreeList {
    fn with_capacity(n: u32) -> Self {
        match Self::try_with_capacity(n) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    fn try_with_capacity(n: u32) -> Result<Self> {
        let n = n.min(MAX_CAPACITY);
        // Initial chain 0 -> 1 -> … -> n-1 -> NIL, so a fresh list pops 0 first.
        let next = crate::error::alloc::collect_exact(
            n as usize,
            (0..n).map(|i| AtomicU32::new(if i + 1 < n { i + 1 } else { NIL })),
            "free list links",
        )?
        .into_boxed_slice();
        let top = if n == 0 { NIL } else { 0 };
        Ok(LockFreeFreeList {
            hot: Hot {
                head: AtomicU64::new(pack(0, top)),
                count: AtomicUsize::new(n as usize),
            },
            next,
            capacity: n,
        })
    }

    #[inline]
    fn capacity(&self) -> u32 {
        self.capacity
    }

    #[inline]
    fn len(&self) -> usize {
        // Relaxed: a point-in-time reading for callers; it carries no synchronization duty.
        self.hot.count.load(Relaxed)
    }

    #[inline]
    fn pop(&self) -> Option<BlockId> {
        if !self.reserve(1) {
            return None;
        }
        Some(self.pop_reserved())
    }

    fn try_pop_n(&self, k: usize, out: &mut Vec<BlockId>) -> bool {
        if k == 0 {
            return true;
        }
        if k > self.capacity as usize {
            return false;
        }
        // Grow `out` before reserving, so that nothing can fail (or unwind) while we hold
        // a reservation that would otherwise leak free ids.
        out.reserve(k);
        if !self.reserve(k) {
            return false;
        }
        // Fast path: the whole reservation in one CAS. Under contention the chain walk may keep
        // losing to single pops, so after a few tries fall back to node-by-node, which is
        // guaranteed to finish because the reservation holds `k` nodes for us.
        let mut backoff = Backoff::new();
        for _ in 0..BATCH_ATTEMPTS {
            if self.try_pop_chain(k, out) {
                return true;
            }
            backoff.snooze();
        }
        for _ in 0..k {
            out.push(self.pop_reserved());
        }
        true
    }

    #[inline]
    fn push(&self, id: BlockId) -> Result<()> {
        let Some(slot) = self.next.get(id as usize) else {
            return Err(push_error(id, self.capacity));
        };
        // Relaxed load: the value only seeds the CAS, which validates it.
        let mut cur = self.hot.head.load(Relaxed);
        // Claim the node: only a handed-out one (`TAKEN`) may be linked, and of two concurrent
        // pushes of one id exactly one wins this CAS. Relaxed: published by the head CAS below.
        if slot
            .compare_exchange(TAKEN, index_of(cur), Relaxed, Relaxed)
            .is_err()
        {
            return Err(push_error(id, self.capacity));
        }
        let mut backoff = Backoff::new();
        loop {
            let new = pack(tag_of(cur).wrapping_add(1), id);
            // Release: makes the `next[id]` store above — and the caller's writes to the block
            // before handing it back — visible to the thread that pops `id`.
            match self
                .hot
                .head
                .compare_exchange_weak(cur, new, Release, Relaxed)
            {
                Ok(_) => break,
                Err(actual) => {
                    cur = actual;
                    // Relaxed: published by the Release CAS that links the node.
                    slot.store(index_of(cur), Relaxed);
                    backoff.snooze();
                }
            }
        }
        // Count only after the node is linked (see the type's docs). Release: a reserver that
        // acquires this increment also sees the link above.
        self.hot.count.fetch_add(1, Release);
        Ok(())
    }

    // The exclusive variants run the same protocol with plain loads and stores (loom's atomics
    // have no `get_mut`, so under loom the trait's defaults take the atomic path). The tag still
    // moves on every change, keeping "every change moves the tag" true for later shared use.

    #[cfg(not(loom))]
    #[inline]
    fn pop_mut(&mut self) -> Option<BlockId> {
        let count = self.hot.count.get_mut();
        if *count == 0 {
            return None;
        }
        let head = self.hot.head.get_mut();
        let top = index_of(*head);
        let slot = self.next.get_mut(top as usize)?.get_mut();
        let below = std::mem::replace(slot, TAKEN);
        *head = pack(tag_of(*head).wrapping_add(1), below);
        *count -= 1;
        Some(top)
    }

    #[cfg(not(loom))]
    fn try_pop_n_mut(&mut self, k: usize, out: &mut Vec<BlockId>) -> bool {
        let count = self.hot.count.get_mut();
        if k > *count {
            return false;
        }
        out.reserve(k);
        let head = self.hot.head.get_mut();
        let mut node = index_of(*head);
        let start = out.len();
        for _ in 0..k {
            match self.next.get_mut(node as usize) {
                Some(n) => {
                    out.push(node);
                    node = *n.get_mut();
                }
                None => {
                    // Unreachable while the count is exact; refuse rather than hand out less.
                    out.truncate(start);
                    return false;
                }
            }
        }
        for &id in &out[start..] {
            *self.next[id as usize].get_mut() = TAKEN;
        }
        *head = pack(tag_of(*head).wrapping_add(1), node);
        *count -= k;
        true
    }

    #[cfg(not(loom))]
    #[inline]
    fn push_mut(&mut self, id: BlockId) -> Result<()> {
        let capacity = self.capacity;
        let Some(slot) = self.next.get_mut(id as usize) else {
            return Err(push_error(id, capacity));
        };
        let slot = slot.get_mut();
        if *slot != TAKEN {
            return Err(push_error(id, capacity));
        }
        let head = self.hot.head.get_mut();
        *slot = index_of(*head);
        *head = pack(tag_of(*head).wrapping_add(1), id);
        *self.hot.count.get_mut() += 1;
        Ok(())
    }

    fn free_ids(&self) -> Vec<BlockId> {
        let mut ids = Vec::with_capacity(self.len());
        let mut node = index_of(self.hot.head.load(Acquire));
        while ids.len() < self.capacity as usize {
            match self.next.get(node as usize) {
                Some(n) => {
                    ids.push(node);
                    node = n.load(Acquire);
                }
                None => break,
            }
        }
        ids
    }
}

/// The baseline: a `Vec<u32>` behind a mutex, used as a stack (top = end of the vector), with
/// one "is free" flag per id so `push` can refuse a double free.
#[derive(Debug)]
pub struct MutexFreeList {
    ids: Mutex<Stack>,
    capacity: u32,
}

#[derive(Debug)]
struct Stack {
    ids: Vec<u32>,
    free: Vec<bool>,
}

impl Stack {
    #[inline]
    fn pop(&mut self) -> Option<BlockId> {
        let id = self.ids.pop()?;
        self.free[id as usize] = false;
        Some(id)
    }

    #[inline]
    fn pop_n(&mut self, k: usize, out: &mut Vec<BlockId>) -> bool {
        if k > self.ids.len() {
            return false;
        }
        let split = self.ids.len() - k;
        // Same order as `k` single pops: top (end of the vector) first.
        for id in self.ids.drain(split..).rev() {
            self.free[id as usize] = false;
            out.push(id);
        }
        true
    }

    #[inline]
    fn push(&mut self, id: BlockId, capacity: u32) -> Result<()> {
        match self.free.get_mut(id as usize) {
            Some(f) if !*f => {
                *f = true;
                self.ids.push(id);
                Ok(())
            }
            _ => Err(push_error(id, capacity)),
        }
    }
}

impl MutexFreeList {
    /// Locks the stack. A poisoned lock is still usable: every critical section below leaves
    /// the stack consistent before anything in it could panic.
    #[inline]
    fn guard(&self) -> impl std::ops::DerefMut<Target = Stack> + '_ {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stack without locking: `&mut self` already excludes every other user.
    #[cfg(not(loom))]
    #[inline]
    fn ids_mut(&mut self) -> &mut Stack {
        self.ids.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}

impl FreeList for MutexFreeList {
    fn with_capacity(n: u32) -> Self {
        match Self::try_with_capacity(n) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    fn try_with_capacity(n: u32) -> Result<Self> {
        use crate::error::alloc::{collect_exact, filled_vec};
        let n = n.min(MAX_CAPACITY);
        // Reversed, so that popping from the end hands out 0 first.
        Ok(MutexFreeList {
            ids: Mutex::new(Stack {
                ids: collect_exact(n as usize, (0..n).rev(), "free list ids")?,
                free: filled_vec(n as usize, true, "free list flags")?,
            }),
            capacity: n,
        })
    }

    #[inline]
    fn capacity(&self) -> u32 {
        self.capacity
    }

    #[inline]
    fn len(&self) -> usize {
        self.guard().ids.len()
    }

    #[inline]
    fn pop(&self) -> Option<BlockId> {
        self.guard().pop()
    }

    fn try_pop_n(&self, k: usize, out: &mut Vec<BlockId>) -> bool {
        self.guard().pop_n(k, out)
    }

    #[inline]
    fn push(&self, id: BlockId) -> Result<()> {
        self.guard().push(id, self.capacity)
    }

    fn free_ids(&self) -> Vec<BlockId> {
        self.guard().ids.iter().rev().copied().collect()
    }

    #[cfg(not(loom))]
    #[inline]
    fn pop_mut(&mut self) -> Option<BlockId> {
        self.ids_mut().pop()
    }

    #[cfg(not(loom))]
    fn try_pop_n_mut(&mut self, k: usize, out: &mut Vec<BlockId>) -> bool {
        self.ids_mut().pop_n(k, out)
    }

    #[cfg(not(loom))]
    #[inline]
    fn push_mut(&mut self, id: BlockId) -> Result<()> {
        let capacity = self.capacity;
        self.ids_mut().push(id, capacity)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn fresh_order<F: FreeList>() {
        let l = F::with_capacity(5);
        assert_eq!(l.capacity(), 5);
        assert_eq!(l.len(), 5);
        assert_eq!(l.free_ids(), vec![0, 1, 2, 3, 4]);
        let got: Vec<_> = (0..5).map(|_| l.pop().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        assert_eq!(l.pop(), None);
        assert!(l.is_empty());
        assert!(l.free_ids().is_empty());
    }

    fn lifo_and_batch<F: FreeList>() {
        let l = F::with_capacity(8);
        let mut out = vec![99];
        assert!(l.try_pop_n(3, &mut out));
        assert_eq!(out, vec![99, 0, 1, 2]);
        l.push(1).unwrap();
        l.push(0).unwrap();
        assert_eq!(l.len(), 7);
        // Batch pop sees the same order as single pops would: 0, 1, 3, 4, …
        assert_eq!(l.free_ids(), vec![0, 1, 3, 4, 5, 6, 7]);
        let mut out = Vec::new();
        assert!(l.try_pop_n(4, &mut out));
        assert_eq!(out, vec![0, 1, 3, 4]);
        assert_eq!(l.pop(), Some(5));
    }

    fn all_or_nothing<F: FreeList>() {
        let l = F::with_capacity(4);
        let mut out = vec![7];
        assert!(!l.try_pop_n(5, &mut out));
        assert_eq!(out, vec![7]);
        assert_eq!(l.len(), 4);
        assert_eq!(l.pop(), Some(0));
        assert!(!l.try_pop_n(4, &mut out));
        assert_eq!(out, vec![7]);
        assert_eq!(l.len(), 3);
        assert!(l.try_pop_n(0, &mut out));
        assert_eq!(out, vec![7]);
        assert!(l.try_pop_n(3, &mut out));
        assert_eq!(out, vec![7, 1, 2, 3]);
        assert!(l.is_empty());
        assert!(!l.try_pop_n(1, &mut out));
        assert!(l.try_pop_n(0, &mut out));
        assert_eq!(l.pop(), None);
    }

    fn rejects_out_of_range_push<F: FreeList>() {
        let mut l = F::with_capacity(2);
        let oob = |b| {
            Err(Error::InvalidBlock {
                block: b,
                num_blocks: 2,
            })
        };
        assert_eq!(l.push(2), oob(2));
        assert_eq!(l.push(u32::MAX), oob(u32::MAX));
        assert_eq!(l.push_mut(u32::MAX - 1), oob(u32::MAX - 1));
        assert_eq!(l.len(), 2);
        assert_eq!(l.free_ids(), vec![0, 1]);
    }

    /// Pushing an id that is already free is a typed error and changes nothing; before the
    /// check, the lock-free list linked the node to itself and handed the id out forever.
    fn rejects_double_push<F: FreeList>() {
        let mut l = F::with_capacity(4);
        let dbl = |b| Err(Error::RefcountUnderflow { block: b });
        // Never handed out.
        assert_eq!(l.push(3), dbl(3));
        assert_eq!(l.push_mut(0), dbl(0));
        assert_eq!(l.free_ids(), vec![0, 1, 2, 3]);
        let a = l.pop().unwrap();
        let b = l.pop_mut().unwrap();
        let mut out = Vec::new();
        assert!(l.try_pop_n(1, &mut out));
        assert!(l.try_pop_n_mut(1, &mut out));
        assert_eq!((a, b, &out[..]), (0, 1, &[2, 3][..]));
        l.push(a).unwrap();
        assert_eq!(l.push(a), dbl(a));
        assert_eq!(l.push_mut(a), dbl(a));
        l.push_mut(out[0]).unwrap();
        assert_eq!(l.push(out[0]), dbl(out[0]));
        assert_eq!(l.len(), 2);
        assert_eq!(l.free_ids(), vec![2, 0]);
        // The list still hands out each free id once.
        let mut got = vec![l.pop().unwrap(), l.pop().unwrap()];
        got.sort();
        assert_eq!(got, vec![0, 2]);
        assert_eq!(l.pop(), None);
        for id in [0, 1, 2, 3] {
            l.push(id).unwrap();
        }
        assert_eq!(l.len(), 4);
    }

    fn empty_list<F: FreeList>() {
        let l = F::with_capacity(0);
        assert_eq!(l.capacity(), 0);
        assert!(l.is_empty());
        assert_eq!(l.pop(), None);
        let mut out = Vec::new();
        assert!(!l.try_pop_n(1, &mut out));
        assert!(l.try_pop_n(0, &mut out));
        assert!(l.push(0).is_err());
        assert!(l.is_empty());
        assert!(l.free_ids().is_empty());
    }

    fn many_cycles<F: FreeList>() {
        // Interleaved pushes and pops keep the set exact.
        let n = 64u32;
        let l = F::with_capacity(n);
        let mut held = Vec::new();
        let mut state = 0x9e37_79b9_u32;
        for _ in 0..10_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            match state % 3 {
                0 => {
                    if let Some(id) = l.pop() {
                        held.push(id);
                    }
                }
                1 => {
                    let k = (state >> 8) as usize % 6;
                    let before = held.len();
                    let ok = l.try_pop_n(k, &mut held);
                    assert_eq!(held.len(), if ok { before + k } else { before });
                }
                _ => {
                    if !held.is_empty() {
                        let i = (state >> 4) as usize % held.len();
                        l.push(held.swap_remove(i)).unwrap();
                    }
                }
            }
            assert_eq!(l.len() + held.len(), n as usize);
        }
        let free: HashSet<_> = l.free_ids().into_iter().collect();
        assert_eq!(free.len(), l.len());
        for id in &held {
            assert!(!free.contains(id));
        }
        assert_eq!(free.len() + held.len(), n as usize);
    }

    /// The exclusive (`&mut`) operations give exactly what the shared ones give: two lists fed
    /// the same random sequence, one through each, agree at every step, and mixing the two on
    /// one list keeps it consistent.
    fn exclusive_matches_shared<F: FreeList>() {
        let n = 32u32;
        let shared = F::with_capacity(n);
        let mut excl = F::with_capacity(n);
        let mut mixed = F::with_capacity(n);
        let (mut held_s, mut held_e, mut held_m) = (Vec::new(), Vec::new(), Vec::new());
        let mut state = 0x2545_f491_u32;
        for step in 0..5_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let use_mut = step % 3 == 0;
            match state % 3 {
                0 => {
                    let (a, b) = (shared.pop(), excl.pop_mut());
                    let c = if use_mut {
                        mixed.pop_mut()
                    } else {
                        mixed.pop()
                    };
                    assert_eq!(a, b);
                    assert_eq!(a, c);
                    held_s.extend(a);
                    held_e.extend(b);
                    held_m.extend(c);
                }
                1 => {
                    let k = (state >> 8) as usize % 5;
                    let a = shared.try_pop_n(k, &mut held_s);
                    let b = excl.try_pop_n_mut(k, &mut held_e);
                    let c = if use_mut {
                        mixed.try_pop_n_mut(k, &mut held_m)
                    } else {
                        mixed.try_pop_n(k, &mut held_m)
                    };
                    assert_eq!((a, a), (b, c));
                }
                _ => {
                    if !held_s.is_empty() {
                        let i = (state >> 4) as usize % held_s.len();
                        shared.push(held_s.swap_remove(i)).unwrap();
                        excl.push_mut(held_e.swap_remove(i)).unwrap();
                        let id = held_m.swap_remove(i);
                        if use_mut {
                            mixed.push_mut(id).unwrap()
                        } else {
                            mixed.push(id).unwrap()
                        }
                    }
                }
            }
            assert_eq!(held_s, held_e);
            assert_eq!(held_s, held_m);
            assert_eq!(shared.len(), excl.len());
            assert_eq!(shared.len(), mixed.len());
        }
        assert_eq!(shared.free_ids(), excl.free_ids());
        assert_eq!(shared.free_ids(), mixed.free_ids());
        assert!(excl.push_mut(n).is_err());
        assert_eq!(excl.len(), shared.len());
    }

    macro_rules! both {
        ($($name:ident),*) => {
            mod lock_free {
                $(#[test] fn $name() { super::$name::<super::LockFreeFreeList>(); })*
            }
            mod mutex {
                $(#[test] fn $name() { super::$name::<super::MutexFreeList>(); })*
            }
        };
    }
    both!(
        fresh_order,
        lifo_and_batch,
        all_or_nothing,
        rejects_out_of_range_push,
        rejects_double_push,
        empty_list,
        many_cycles,
        exclusive_matches_shared
    );

    #[test]
    fn packing_round_trips() {
        let h = pack(0xdead_beef, 0x1234_5678);
        assert_eq!(tag_of(h), 0xdead_beef);
        assert_eq!(index_of(h), 0x1234_5678);
        assert_eq!(index_of(pack(u32::MAX, NIL)), NIL);
    }

    #[test]
    fn tag_moves_on_every_change() {
        let l = LockFreeFreeList::with_capacity(3);
        let t0 = tag_of(l.hot.head.load(Relaxed));
        let id = l.pop().unwrap();
        let t1 = tag_of(l.hot.head.load(Relaxed));
        l.push(id).unwrap();
        let t2 = tag_of(l.hot.head.load(Relaxed));
        let mut out = Vec::new();
        assert!(l.try_pop_n(2, &mut out));
        let t3 = tag_of(l.hot.head.load(Relaxed));
        assert!(t0 != t1 && t1 != t2 && t2 != t3);
        // The same top index with a different tag: exactly the ABA case the tag guards against.
        assert_eq!(index_of(l.hot.head.load(Relaxed)), 2);
    }
}
