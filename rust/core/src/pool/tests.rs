//! Tests of the block pool: every transition and error of the count word, each run against both
//! free lists (lock-free and mutex), and proptest runs of random operation sequences against a
//! plain model of the pool.
//!
//! A child module of `pool`, so the corruption tests can write the private count words that
//! `check_invariants` must catch.

use super::*;
use crate::freelist::MutexFreeList;

/// Everything observable about a pool, to compare before and after an error.
fn state<F: FreeList>(p: &BlockPool<F>) -> (usize, Vec<BlockId>, Vec<u32>) {
    let counts = (0..p.num_blocks())
        .map(|b| p.refcount(b).unwrap())
        .collect();
    (p.num_free(), p.free_ids(), counts)
}

fn new_rejects_bad_sizes<F: FreeList>() {
    for n in [0, u32::MAX] {
        match BlockPool::<F>::new(n) {
            Err(Error::InvalidConfig {
                field: "num_blocks",
                value,
                ..
            }) => assert_eq!(value, n as u64),
            other => panic!("new({n}) gave {other:?}"),
        }
    }
    let p = BlockPool::<F>::new(1).unwrap();
    assert_eq!(p.num_blocks(), 1);
    assert_eq!(p.num_free(), 1);
}

fn allocate_in_order_and_exhaust<F: FreeList>() {
    let p = BlockPool::<F>::new(3).unwrap();
    assert_eq!(p.allocate(), Ok(0));
    assert_eq!(p.allocate(), Ok(1));
    assert_eq!(p.refcount(0), Ok(1));
    let mut out = Vec::new();
    assert_eq!(p.allocate_n(1, &mut out), Ok(()));
    assert_eq!(out, vec![2]);
    let before = state(&p);
    assert_eq!(
        p.allocate(),
        Err(Error::OutOfBlocks {
            needed: 1,
            available: 0
        })
    );
    assert_eq!(state(&p), before);
    p.check_invariants().unwrap();
}

fn allocate_n_all_or_nothing<F: FreeList>() {
    let p = BlockPool::<F>::new(4).unwrap();
    p.allocate().unwrap();
    let before = state(&p);
    let mut out = vec![42];
    assert_eq!(
        p.allocate_n(4, &mut out),
        Err(Error::OutOfBlocks {
            needed: 4,
            available: 3
        })
    );
    assert_eq!(out, vec![42]);
    assert_eq!(state(&p), before);
    assert_eq!(
        p.allocate_n(usize::MAX, &mut out),
        Err(Error::OutOfBlocks {
            needed: usize::MAX,
            available: 3
        })
    );
    assert_eq!(state(&p), before);
    assert_eq!(p.allocate_n(0, &mut out), Ok(()));
    assert_eq!(out, vec![42]);
    assert_eq!(p.allocate_n(3, &mut out), Ok(()));
    assert_eq!(out, vec![42, 1, 2, 3]);
    for b in 1..4 {
        assert_eq!(p.refcount(b), Ok(1));
    }
    assert_eq!(p.num_free(), 0);
    p.check_invariants().unwrap();
}

fn invalid_block_everywhere<F: FreeList>() {
    let p = BlockPool::<F>::new(2).unwrap();
    p.allocate().unwrap();
    let before = state(&p);
    for bad in [2, 3, u32::MAX] {
        let e = Error::InvalidBlock {
            block: bad,
            num_blocks: 2,
        };
        assert_eq!(p.refcount(bad), Err(e.clone()));
        assert_eq!(p.is_free(bad), Err(e.clone()));
        assert_eq!(p.incref(bad), Err(e.clone()));
        assert_eq!(p.decref(bad), Err(e.clone()));
        assert_eq!(p.release(bad), Err(e.clone()));
        assert_eq!(p.free(bad), Err(e));
        assert_eq!(state(&p), before);
    }
}

fn refcount_lifecycle<F: FreeList>() {
    let p = BlockPool::<F>::new(2).unwrap();
    let b = p.allocate().unwrap();
    assert_eq!(p.is_free(b), Ok(false));
    assert_eq!(p.incref(b), Ok(2));
    assert_eq!(p.incref(b), Ok(3));
    assert_eq!(p.free(b), Ok(false));
    assert_eq!(p.refcount(b), Ok(2));
    assert_eq!(p.decref(b), Ok(1));
    assert_eq!(p.decref(b), Ok(0));
    // Unreferenced but still allocated: not on the free list, revivable.
    assert_eq!(p.num_free(), 1);
    assert_eq!(p.is_free(b), Ok(false));
    p.check_invariants().unwrap();
    assert_eq!(p.incref(b), Ok(1));
    assert_eq!(p.decref(b), Ok(0));
    assert_eq!(p.release(b), Ok(()));
    assert_eq!(p.is_free(b), Ok(true));
    assert_eq!(p.refcount(b), Ok(0));
    assert_eq!(p.num_free(), 2);
    // Released blocks come back first (LIFO).
    assert_eq!(p.allocate(), Ok(b));
    assert_eq!(p.free(b), Ok(true));
    assert_eq!(p.num_free(), 2);
    p.check_invariants().unwrap();
}

fn underflow_and_double_free<F: FreeList>() {
    let p = BlockPool::<F>::new(3).unwrap();
    let b = p.allocate().unwrap();
    p.decref(b).unwrap();
    let before = state(&p);
    assert_eq!(p.decref(b), Err(Error::RefcountUnderflow { block: b }));
    assert_eq!(p.free(b), Err(Error::RefcountUnderflow { block: b }));
    assert_eq!(state(&p), before);
    p.release(b).unwrap();
    let before = state(&p);
    // Every operation on a free block that would take a reference away or hand it back fails.
    assert_eq!(p.decref(b), Err(Error::RefcountUnderflow { block: b }));
    assert_eq!(p.free(b), Err(Error::RefcountUnderflow { block: b }));
    assert_eq!(p.release(b), Err(Error::RefcountUnderflow { block: b }));
    assert_eq!(state(&p), before);
    // Never-allocated blocks are free too.
    assert_eq!(p.free(2), Err(Error::RefcountUnderflow { block: 2 }));
    assert_eq!(p.release(2), Err(Error::RefcountUnderflow { block: 2 }));
    assert_eq!(state(&p), before);
    p.check_invariants().unwrap();
}

fn release_refuses_referenced<F: FreeList>() {
    let p = BlockPool::<F>::new(2).unwrap();
    let b = p.allocate().unwrap();
    p.incref(b).unwrap();
    let before = state(&p);
    match p.release(b) {
        Err(Error::InvalidArgument {
            what: "block",
            value,
            reason,
        }) => {
            assert_eq!(value, b as i64);
            assert!(reason.contains("refcount is 2"), "{reason}");
        }
        other => panic!("release of a referenced block gave {other:?}"),
    }
    assert_eq!(state(&p), before);
}

fn incref_refuses_free_and_overflow<F: FreeList>() {
    let p = BlockPool::<F>::new(2).unwrap();
    let before = state(&p);
    assert!(matches!(
        p.incref(0),
        Err(Error::InvalidArgument {
            what: "block",
            value: 0,
            ..
        })
    ));
    assert_eq!(state(&p), before);
    let b = p.allocate().unwrap();
    // Drive the count to the ceiling directly rather than with 4 billion increfs.
    p.counts[b as usize].store(MAX_REFCOUNT, Relaxed);
    let before = state(&p);
    match p.incref(b) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("exceed"), "{reason}")
        }
        other => panic!("incref at the ceiling gave {other:?}"),
    }
    assert_eq!(state(&p), before);
    assert_eq!(p.decref(b), Ok(MAX_REFCOUNT - 1));
}

fn invariants_catch_corruption<F: FreeList>() {
    let p = BlockPool::<F>::new(3).unwrap();
    let b = p.allocate().unwrap();
    p.check_invariants().unwrap();
    // A block marked free that is not on the list.
    p.counts[b as usize].store(FREE, Relaxed);
    assert!(matches!(
        p.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
    p.counts[b as usize].store(1, Relaxed);
    p.check_invariants().unwrap();
    // A block on the list that is marked allocated.
    p.counts[1].store(1, Relaxed);
    assert!(matches!(
        p.check_invariants(),
        Err(Error::InvariantViolation(_))
    ));
}

fn exclusive_variants<F: FreeList>() {
    let mut p = BlockPool::<F>::new(3).unwrap();
    assert_eq!(p.allocate_mut(), Ok(0));
    let mut out = vec![9];
    let before = state(&p);
    assert_eq!(
        p.allocate_n_mut(3, &mut out),
        Err(Error::OutOfBlocks {
            needed: 3,
            available: 2
        })
    );
    assert_eq!(out, vec![9]);
    assert_eq!(state(&p), before);
    assert_eq!(p.allocate_n_mut(2, &mut out), Ok(()));
    assert_eq!(out, vec![9, 1, 2]);
    let before = state(&p);
    assert_eq!(
        p.allocate_mut(),
        Err(Error::OutOfBlocks {
            needed: 1,
            available: 0
        })
    );
    let bad = Error::InvalidBlock {
        block: 3,
        num_blocks: 3,
    };
    assert_eq!(p.incref_mut(3), Err(bad.clone()));
    assert_eq!(p.decref_mut(3), Err(bad.clone()));
    assert_eq!(p.release_mut(3), Err(bad.clone()));
    assert_eq!(p.free_mut(3), Err(bad));
    assert!(matches!(
        p.release_mut(0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(state(&p), before);
    assert_eq!(p.incref_mut(0), Ok(2));
    assert_eq!(p.free_mut(0), Ok(false));
    assert_eq!(p.decref_mut(0), Ok(0));
    assert_eq!(p.decref_mut(0), Err(Error::RefcountUnderflow { block: 0 }));
    assert_eq!(p.release_mut(0), Ok(()));
    let before = state(&p);
    assert_eq!(p.release_mut(0), Err(Error::RefcountUnderflow { block: 0 }));
    assert_eq!(p.free_mut(0), Err(Error::RefcountUnderflow { block: 0 }));
    assert!(matches!(
        p.incref_mut(0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(state(&p), before);
    assert_eq!(p.free_mut(1), Ok(true));
    // Exclusive and shared calls interleave on one pool: LIFO order carries across.
    assert_eq!(p.allocate(), Ok(1));
    assert_eq!(p.allocate_mut(), Ok(0));
    p.check_invariants().unwrap();
}

macro_rules! both {
    ($($name:ident),*) => {
        mod lock_free {
            $(#[test] fn $name() { super::$name::<crate::freelist::LockFreeFreeList>(); })*
        }
        mod mutex {
            $(#[test] fn $name() { super::$name::<super::MutexFreeList>(); })*
        }
    };
}
both!(
    new_rejects_bad_sizes,
    allocate_in_order_and_exhaust,
    allocate_n_all_or_nothing,
    invalid_block_everywhere,
    refcount_lifecycle,
    underflow_and_double_free,
    release_refuses_referenced,
    incref_refuses_free_and_overflow,
    invariants_catch_corruption,
    exclusive_variants
);

#[test]
fn default_free_list_is_lock_free() {
    let p: BlockPool = BlockPool::new(4).unwrap();
    assert_eq!(p.allocate(), Ok(0));
    assert_eq!(format!("{p:?}"), "BlockPool { num_blocks: 4, num_free: 3 }");
}

#[test]
fn pool_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<BlockPool>();
    check::<BlockPool<MutexFreeList>>();
}

/// Sequential model check: random operation sequences against a plain model (a LIFO stack of
/// free ids and a map of reference counts), comparing every result — ids, counts and errors.
mod model {
    use super::super::*;
    use crate::freelist::{LockFreeFreeList, MutexFreeList};
    use proptest::prelude::*;

    const N: u32 = 12;

    #[derive(Debug, Clone)]
    enum Op {
        Allocate,
        AllocateN(usize),
        Refcount(u32),
        Incref(u32),
        Decref(u32),
        Release(u32),
        Free(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Ids a little past the pool, so the InvalidBlock path is exercised too.
        let id = 0..N + 2;
        prop_oneof![
            3 => Just(Op::Allocate),
            2 => (0usize..8).prop_map(Op::AllocateN),
            1 => id.clone().prop_map(Op::Refcount),
            2 => id.clone().prop_map(Op::Incref),
            2 => id.clone().prop_map(Op::Decref),
            2 => id.clone().prop_map(Op::Release),
            3 => id.prop_map(Op::Free),
        ]
    }

    /// `None` = free; `Some(c)` = allocated with count `c` (0 = unreferenced).
    struct Model {
        stack: Vec<u32>,
        state: Vec<Option<u32>>,
    }

    impl Model {
        fn new() -> Self {
            Model {
                stack: (0..N).rev().collect(),
                state: vec![None; N as usize],
            }
        }
        fn bad(id: u32) -> Option<Error> {
            (id >= N).then_some(Error::InvalidBlock {
                block: id,
                num_blocks: N,
            })
        }
    }

    /// Compares a pool result with the model's; `InvalidArgument` is compared by variant and
    /// offending value only, since its reason text is free-form.
    fn same<T: PartialEq + std::fmt::Debug>(got: Result<T>, want: Result<T>) {
        match (&got, &want) {
            (
                Err(Error::InvalidArgument {
                    what: a, value: x, ..
                }),
                Err(Error::InvalidArgument {
                    what: b, value: y, ..
                }),
            ) => assert_eq!((a, x), (b, y)),
            _ => assert_eq!(got, want),
        }
    }

    fn invalid_arg(id: u32) -> Error {
        Error::InvalidArgument {
            what: "block",
            value: id as i64,
            reason: String::new(),
        }
    }

    /// Each op runs through the shared (`&self`) method or, when its flag is set, the
    /// exclusive (`&mut self`) one; both must match the model, interleaved on one pool.
    fn run<F: FreeList>(ops: &[(Op, bool)]) {
        let mut pool = BlockPool::<F>::new(N).unwrap();
        let mut m = Model::new();
        for (op, exclusive) in ops {
            let ex = *exclusive;
            match *op {
                Op::Allocate => {
                    let want = match m.stack.pop() {
                        Some(id) => {
                            m.state[id as usize] = Some(1);
                            Ok(id)
                        }
                        None => Err(Error::OutOfBlocks {
                            needed: 1,
                            available: 0,
                        }),
                    };
                    same(
                        if ex {
                            pool.allocate_mut()
                        } else {
                            pool.allocate()
                        },
                        want,
                    );
                }
                Op::AllocateN(k) => {
                    let mut out = vec![u32::MAX];
                    let got = if ex {
                        pool.allocate_n_mut(k, &mut out)
                    } else {
                        pool.allocate_n(k, &mut out)
                    };
                    if k > m.stack.len() {
                        same(
                            got,
                            Err(Error::OutOfBlocks {
                                needed: k,
                                available: m.stack.len(),
                            }),
                        );
                        assert_eq!(out, [u32::MAX]);
                    } else {
                        same(got, Ok(()));
                        let mut want = vec![u32::MAX];
                        for _ in 0..k {
                            let id = m.stack.pop().unwrap();
                            m.state[id as usize] = Some(1);
                            want.push(id);
                        }
                        assert_eq!(out, want);
                    }
                }
                Op::Refcount(id) => {
                    let want = match Model::bad(id) {
                        Some(e) => Err(e),
                        None => Ok(m.state[id as usize].unwrap_or(0)),
                    };
                    same(pool.refcount(id), want);
                }
                Op::Incref(id) => {
                    let want = match Model::bad(id) {
                        Some(e) => Err(e),
                        None => match &mut m.state[id as usize] {
                            None => Err(invalid_arg(id)),
                            Some(c) => {
                                *c += 1;
                                Ok(*c)
                            }
                        },
                    };
                    same(
                        if ex {
                            pool.incref_mut(id)
                        } else {
                            pool.incref(id)
                        },
                        want,
                    );
                }
                Op::Decref(id) => {
                    let want = match Model::bad(id) {
                        Some(e) => Err(e),
                        None => match &mut m.state[id as usize] {
                            None | Some(0) => Err(Error::RefcountUnderflow { block: id }),
                            Some(c) => {
                                *c -= 1;
                                Ok(*c)
                            }
                        },
                    };
                    same(
                        if ex {
                            pool.decref_mut(id)
                        } else {
                            pool.decref(id)
                        },
                        want,
                    );
                }
                Op::Release(id) => {
                    let want = match Model::bad(id) {
                        Some(e) => Err(e),
                        None => match m.state[id as usize] {
                            None => Err(Error::RefcountUnderflow { block: id }),
                            Some(0) => {
                                m.state[id as usize] = None;
                                m.stack.push(id);
                                Ok(())
                            }
                            Some(_) => Err(invalid_arg(id)),
                        },
                    };
                    same(
                        if ex {
                            pool.release_mut(id)
                        } else {
                            pool.release(id)
                        },
                        want,
                    );
                }
                Op::Free(id) => {
                    let want = match Model::bad(id) {
                        Some(e) => Err(e),
                        None => match m.state[id as usize] {
                            None | Some(0) => Err(Error::RefcountUnderflow { block: id }),
                            Some(1) => {
                                m.state[id as usize] = None;
                                m.stack.push(id);
                                Ok(true)
                            }
                            Some(c) => {
                                m.state[id as usize] = Some(c - 1);
                                Ok(false)
                            }
                        },
                    };
                    same(if ex { pool.free_mut(id) } else { pool.free(id) }, want);
                }
            }
            assert_eq!(pool.num_free(), m.stack.len());
            let listed: Vec<u32> = m.stack.iter().rev().copied().collect();
            assert_eq!(pool.free_ids(), listed);
            for b in 0..N {
                assert_eq!(pool.is_free(b), Ok(m.state[b as usize].is_none()));
            }
            pool.check_invariants().unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn lock_free_matches_model(ops in proptest::collection::vec((op(), any::<bool>()), 1..200)) {
            run::<LockFreeFreeList>(&ops);
        }

        #[test]
        fn mutex_matches_model(ops in proptest::collection::vec((op(), any::<bool>()), 1..200)) {
            run::<MutexFreeList>(&ops);
        }
    }
}
