//! Model check of the lock-free free list with loom: every interleaving (up to a preemption
//! bound) of a few threads popping, batch-popping and pushing on a tiny list.
//!
//! Each model checks that no id is ever held by two threads at once (an `owned` flag per id, set
//! with `swap(true)` on every pop and cleared before every push), that an all-or-nothing batch
//! either gets all its ids or none, and that the list ends consistent: `len()` equals the
//! capacity and the free ids are a permutation of `0..capacity`.
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv --release --test loom_freelist`
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use pagedkv::freelist::{FreeList, LockFreeFreeList};
use pagedkv::BlockId;

struct Shared {
    list: LockFreeFreeList,
    owned: Vec<AtomicBool>,
}

impl Shared {
    fn new(cap: u32) -> Arc<Self> {
        Arc::new(Shared {
            list: LockFreeFreeList::with_capacity(cap),
            owned: (0..cap).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    fn take(&self, id: BlockId) {
        let was = self.owned[id as usize].swap(true, Ordering::Relaxed);
        assert!(!was, "id {id} popped while already held");
    }

    fn give(&self, id: BlockId) {
        let was = self.owned[id as usize].swap(false, Ordering::Relaxed);
        assert!(was, "id {id} pushed while not held");
        self.list.push(id).unwrap();
    }

    fn pop(&self) -> Option<BlockId> {
        let id = self.list.pop()?;
        self.take(id);
        Some(id)
    }

    fn pop_n(&self, k: usize) -> Option<Vec<BlockId>> {
        let mut out = vec![u32::MAX];
        if !self.list.try_pop_n(k, &mut out) {
            assert_eq!(out, [u32::MAX], "a refused batch must append nothing");
            return None;
        }
        assert_eq!(out.len(), k + 1);
        assert_eq!(out[0], u32::MAX);
        out.remove(0);
        for &id in &out {
            self.take(id);
        }
        Some(out)
    }

    fn check_final(&self) {
        let cap = self.list.capacity();
        assert_eq!(self.list.len(), cap as usize);
        let mut ids = self.list.free_ids();
        ids.sort_unstable();
        assert_eq!(ids, (0..cap).collect::<Vec<_>>());
        for f in &self.owned {
            assert!(!f.load(Ordering::Relaxed));
        }
    }
}

fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(f);
}

/// Two threads on a list of 3, each popping two ids and pushing them back in the order it got
/// them. One thread can pop A and B and push A back while the other sits between reading the
/// head (A, next B) and its CAS — the ABA shape the head's tag exists to defeat. (With only 2
/// ids the reservation count alone would rule that out, so 3 are needed to expose it.)
#[test]
fn pop_push_two_threads() {
    model(4, || {
        let s = Shared::new(3);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    let x = s.pop();
                    let y = s.pop();
                    for id in [x, y].into_iter().flatten() {
                        s.give(id);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        s.check_final();
    });
}

/// A batch pop of 2 against single pops and pushes on a list of 3: the batch must get both or
/// nothing, and when it succeeds the ids it got are not held by anyone else.
#[test]
fn batch_against_singles() {
    model(4, || {
        let s = Shared::new(3);
        let a = {
            let s = s.clone();
            thread::spawn(move || {
                if let Some(ids) = s.pop_n(2) {
                    for id in ids {
                        s.give(id);
                    }
                }
            })
        };
        let b = {
            let s = s.clone();
            thread::spawn(move || {
                let x = s.pop();
                let y = s.pop();
                if let Some(id) = x {
                    s.give(id);
                }
                if let Some(id) = y {
                    s.give(id);
                }
            })
        };
        a.join().unwrap();
        b.join().unwrap();
        s.check_final();
    });
}

/// Two batches of 2 on a list of 3: at most one can hold its pair at any time, and the loser
/// must be refused cleanly rather than get a partial batch.
#[test]
fn competing_batches() {
    model(4, || {
        let s = Shared::new(3);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    s.pop_n(2).map(|ids| {
                        for id in &ids {
                            s.give(*id);
                        }
                        ids.len()
                    })
                })
            })
            .collect();
        let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            got.iter().any(|g| g.is_some()),
            "with 3 free, the first batch of 2 must succeed"
        );
        s.check_final();
    });
}

/// Three threads on a list of 2, each popping once and pushing back: one of them may find the
/// list empty, but no id is ever held twice and nothing is lost.
#[test]
fn three_threads_two_ids() {
    model(2, || {
        let s = Shared::new(2);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    if let Some(id) = s.pop() {
                        s.give(id);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        s.check_final();
    });
}
