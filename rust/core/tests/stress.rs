//! Multi-threaded stress test of the block pool, run over both free lists.
//!
//! Several threads hammer one shared pool with a random mix of single allocations, all-or-nothing
//! batch allocations, frees, and shared references (incref then free twice, or a second reference
//! handed to another thread through a mailbox, so two threads race to drop the last one). Every
//! block has an "owned" flag outside the pool: the thread that gets it from the pool sets it with
//! `swap(true)` and must find it unset — a block handed out twice would trip that immediately —
//! and whoever drops the last reference clears it before giving the block back. At the end every block must be free and the free list
//! must be a permutation of `0..N`.
//!
//! The pool is kept small relative to what the threads want to hold, so allocations regularly
//! fail with `OutOfBlocks` and the all-or-nothing path is exercised under contention.

use pagedkv::freelist::{FreeList, LockFreeFreeList, MutexFreeList};
use pagedkv::pool::BlockPool;
use pagedkv::{BlockId, Error};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Barrier;

const THREADS: usize = 4;
const OPS_PER_THREAD: usize = 500_000;
/// Slots through which threads hand each other references to the same block.
const MAILBOXES: usize = 8;
const EMPTY: u32 = u32::MAX;
const NUM_BLOCKS: u32 = 256;
const MAX_BATCH: usize = 24;
/// Each thread tries to hold up to this many blocks; 4 × 96 > 256 keeps the pool near empty.
const MAX_HELD: usize = 96;

/// xorshift64*: deterministic per thread and cheap even in a debug build.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Default)]
struct Tally {
    allocated: AtomicUsize,
    batch_ok: AtomicUsize,
    batch_refused: AtomicUsize,
    single_refused: AtomicUsize,
    shared: AtomicUsize,
    handed_over: AtomicUsize,
}

fn take(owned: &[AtomicBool], id: BlockId) {
    let was = owned[id as usize].swap(true, Ordering::AcqRel);
    assert!(!was, "block {id} handed out while already owned");
}

fn give_back(owned: &[AtomicBool], id: BlockId) {
    let was = owned[id as usize].swap(false, Ordering::AcqRel);
    assert!(was, "block {id} freed while not owned");
}

/// Drops one reference; whoever drops the last one clears the flag and releases the block.
fn drop_ref<F: FreeList>(pool: &BlockPool<F>, owned: &[AtomicBool], id: BlockId) {
    match pool.decref(id) {
        Ok(0) => {
            give_back(owned, id);
            assert_eq!(pool.release(id), Ok(()));
        }
        Ok(_) => {}
        Err(e) => panic!("decref of a held reference: {e}"),
    }
}

struct Shared<'a, F: FreeList> {
    pool: &'a BlockPool<F>,
    owned: &'a [AtomicBool],
    mailboxes: &'a [AtomicU32],
    tally: &'a Tally,
    start: &'a Barrier,
}

fn worker<F: FreeList>(sh: &Shared<'_, F>, seed: u64) {
    let Shared {
        pool,
        owned,
        mailboxes,
        tally,
        start,
    } = *sh;
    let mut rng = Rng(seed);
    let mut held: Vec<BlockId> = Vec::with_capacity(MAX_HELD + MAX_BATCH);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    // Start together, so the threads really overlap instead of running one after another.
    start.wait();
    for _ in 0..OPS_PER_THREAD {
        let roll = rng.below(100);
        let want_alloc = held.is_empty() || (held.len() < MAX_HELD && roll < 50);
        if want_alloc {
            if roll % 2 == 0 {
                match pool.allocate() {
                    Ok(id) => {
                        take(owned, id);
                        assert_eq!(pool.refcount(id), Ok(1));
                        held.push(id);
                        tally.allocated.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(Error::OutOfBlocks {
                        needed: 1,
                        available,
                    }) => {
                        assert!(available <= NUM_BLOCKS as usize);
                        tally.single_refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("allocate: {e}"),
                }
            } else {
                let k = 1 + rng.below(MAX_BATCH);
                batch.clear();
                batch.push(u32::MAX); // a sentinel that must survive a refused batch
                match pool.allocate_n(k, &mut batch) {
                    Ok(()) => {
                        assert_eq!(batch.len(), k + 1);
                        assert_eq!(batch[0], u32::MAX);
                        for &id in &batch[1..] {
                            take(owned, id);
                            assert_eq!(pool.refcount(id), Ok(1));
                        }
                        held.extend_from_slice(&batch[1..]);
                        tally.allocated.fetch_add(k, Ordering::Relaxed);
                        tally.batch_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(Error::OutOfBlocks { needed, .. }) => {
                        assert_eq!(needed, k);
                        assert_eq!(batch, [u32::MAX], "a refused batch must append nothing");
                        tally.batch_refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("allocate_n: {e}"),
                }
            }
        } else {
            let id = held.swap_remove(rng.below(held.len()));
            match roll % 5 {
                // Hand a second reference to whichever thread next visits a mailbox; take over
                // the reference left there. Both may end up dropping the last reference of a
                // block concurrently with its other holder.
                4 => {
                    assert_eq!(pool.incref(id), Ok(2));
                    let old = mailboxes[rng.below(MAILBOXES)].swap(id, Ordering::AcqRel);
                    drop_ref(pool, owned, id);
                    if old != EMPTY {
                        drop_ref(pool, owned, old);
                    }
                    tally.handed_over.fetch_add(1, Ordering::Relaxed);
                }
                // A second reference, dropped by `free` (not the last) and then `free` (the last).
                0 => {
                    assert_eq!(pool.incref(id), Ok(2));
                    assert_eq!(pool.free(id), Ok(false));
                    give_back(owned, id);
                    assert_eq!(pool.free(id), Ok(true));
                    tally.shared.fetch_add(1, Ordering::Relaxed);
                }
                // decref to 0 (the block stays allocated), then release.
                1 => {
                    assert_eq!(pool.decref(id), Ok(0));
                    assert_eq!(pool.is_free(id), Ok(false));
                    give_back(owned, id);
                    assert_eq!(pool.release(id), Ok(()));
                }
                _ => {
                    give_back(owned, id);
                    assert_eq!(pool.free(id), Ok(true));
                }
            }
        }
    }
    for id in held {
        give_back(owned, id);
        assert_eq!(pool.free(id), Ok(true));
    }
}

fn stress<F: FreeList + 'static>() -> Tally {
    let pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
    let owned: Vec<AtomicBool> = (0..NUM_BLOCKS).map(|_| AtomicBool::new(false)).collect();
    let mailboxes: Vec<AtomicU32> = (0..MAILBOXES).map(|_| AtomicU32::new(EMPTY)).collect();
    let tally = Tally::default();
    let start = Barrier::new(THREADS);
    let sh = Shared {
        pool: &pool,
        owned: &owned,
        mailboxes: &mailboxes,
        tally: &tally,
        start: &start,
    };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let sh = &sh;
            let seed = 0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678_9abc);
            s.spawn(move || worker(sh, seed));
        }
    });
    for m in &mailboxes {
        let id = m.swap(EMPTY, Ordering::AcqRel);
        if id != EMPTY {
            drop_ref(&pool, &owned, id);
        }
    }

    assert_eq!(pool.num_free(), NUM_BLOCKS as usize);
    let mut free = pool.free_ids();
    free.sort_unstable();
    assert_eq!(
        free,
        (0..NUM_BLOCKS).collect::<Vec<_>>(),
        "free list is not a permutation of 0..N"
    );
    pool.check_invariants().unwrap();
    for b in 0..NUM_BLOCKS {
        assert_eq!(pool.refcount(b), Ok(0));
        assert!(!owned[b as usize].load(Ordering::Relaxed));
    }
    // The pool still works after the storm: it hands out every block exactly once.
    let mut all = Vec::new();
    pool.allocate_n(NUM_BLOCKS as usize, &mut all).unwrap();
    all.sort_unstable();
    assert_eq!(all, (0..NUM_BLOCKS).collect::<Vec<_>>());
    assert!(matches!(
        pool.allocate(),
        Err(Error::OutOfBlocks {
            needed: 1,
            available: 0
        })
    ));
    tally
}

fn check_tally(t: &Tally) {
    let (ok, refused) = (
        t.batch_ok.load(Ordering::Relaxed),
        t.batch_refused.load(Ordering::Relaxed),
    );
    eprintln!(
        "allocated {} blocks, {ok} batches ok, {refused} refused, {} singles refused, {} shared, {} handed over",
        t.allocated.load(Ordering::Relaxed),
        t.single_refused.load(Ordering::Relaxed),
        t.shared.load(Ordering::Relaxed),
        t.handed_over.load(Ordering::Relaxed)
    );
    // The mix must really have exercised every path, or the test proves little.
    assert!(t.allocated.load(Ordering::Relaxed) > 100_000);
    assert!(ok > 1_000, "only {ok} batches succeeded");
    assert!(refused > 100, "only {refused} batches were refused");
    assert!(t.single_refused.load(Ordering::Relaxed) > 0);
    assert!(t.shared.load(Ordering::Relaxed) > 1_000);
    assert!(t.handed_over.load(Ordering::Relaxed) > 1_000);
}

#[test]
fn stress_lock_free() {
    check_tally(&stress::<LockFreeFreeList>());
}

#[test]
fn stress_mutex() {
    check_tally(&stress::<MutexFreeList>());
}
