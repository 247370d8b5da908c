//! The caller-keyed pool against a plain model: random operation sequences (allocate, touch,
//! release under each placement, insert, remove, evict, lookup, reset, set_ref) must leave the
//! pool and a deliberately naive reference (a `Vec` for the free order, a list of pairs for the
//! map) in the same state after every step, with the pool's invariants holding throughout.

use pagedkv::keyed::{make_key, KeyedPool, Placement};
use pagedkv::{BlockId, Error};
use proptest::prelude::*;

/// The naive reference: free order as a vector, counts, and (key, block) pairs in insert order.
#[derive(Debug, Clone)]
struct Model {
    free: Vec<BlockId>,
    refcnt: Vec<u32>,
    pairs: Vec<(Vec<u8>, BlockId)>,
}

impl Model {
    fn new(n: u32) -> Self {
        Model {
            free: (1..n).collect(),
            refcnt: vec![0; n as usize],
            pairs: Vec::new(),
        }
    }
    fn cached(&self, b: BlockId) -> bool {
        self.pairs.iter().any(|(_, x)| *x == b)
    }
    fn lookup(&self, k: &[u8]) -> Option<BlockId> {
        self.pairs.iter().find(|(x, _)| x == k).map(|(_, b)| *b)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Touch(Vec<u32>),
    Release(Vec<usize>, u8),
    Insert(u8, u8, usize),
    Remove(u8, u8, usize),
    Evict(u32),
    Lookup(u8, u8),
    Reset,
    SetRef(usize, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..5).prop_map(Op::Allocate),
        prop::collection::vec(0u32..12, 0..4).prop_map(Op::Touch),
        (prop::collection::vec(0usize..16, 0..5), 0u8..3).prop_map(|(v, p)| Op::Release(v, p)),
        (0u8..6, 0u8..2, 0usize..16).prop_map(|(h, g, i)| Op::Insert(h, g, i)),
        (0u8..6, 0u8..2, 0usize..16).prop_map(|(h, g, i)| Op::Remove(h, g, i)),
        (0u32..12).prop_map(Op::Evict),
        (0u8..6, 0u8..2).prop_map(|(h, g)| Op::Lookup(h, g)),
        Just(Op::Reset),
        (0usize..16, 1u32..4).prop_map(|(i, c)| Op::SetRef(i, c)),
    ]
}

const N: u32 = 10;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn keyed_pool_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut p = KeyedPool::new(N, true).unwrap();
        let mut m = Model::new(N);
        // Blocks held by someone, one entry per reference: what Release and Insert pick from.
        let mut held: Vec<BlockId> = Vec::new();
        for o in ops {
            match o {
                Op::Allocate(n) => {
                    let r = p.allocate(n);
                    if n > m.free.len() {
                        prop_assert!(matches!(r, Err(Error::OutOfBlocks { .. })), "{:?}", r);
                    } else {
                        let (got, ev) = r.unwrap();
                        let want: Vec<BlockId> = m.free.drain(..n).collect();
                        prop_assert_eq!(&got, &want);
                        let want_ev: Vec<BlockId> =
                            want.iter().copied().filter(|&b| m.cached(b)).collect();
                        prop_assert_eq!(ev, want_ev);
                        m.pairs.retain(|(_, b)| !want.contains(b));
                        for &b in &want {
                            m.refcnt[b as usize] = 1;
                        }
                        held.extend(want);
                    }
                }
                Op::Touch(bs) => {
                    let r = p.touch(&bs);
                    if bs.iter().any(|&b| b >= N) {
                        prop_assert!(r.is_err());
                    } else {
                        r.unwrap();
                        for &b in &bs {
                            if b == 0 { continue; }
                            if m.refcnt[b as usize] == 0 {
                                m.free.retain(|&x| x != b);
                            }
                            m.refcnt[b as usize] += 1;
                            held.push(b);
                        }
                    }
                }
                Op::Release(idx, pl) => {
                    let placement = [Placement::ByCache, Placement::Front, Placement::Back]
                        [pl as usize];
                    // Pick distinct entries of `held` (a valid release), plus sometimes one
                    // stale id to exercise the underflow path.
                    let mut picks: Vec<usize> = idx.iter().filter(|&&i| i < held.len())
                        .copied().collect();
                    picks.sort_unstable();
                    picks.dedup();
                    let bs: Vec<BlockId> = picks.iter().map(|&i| held[i]).collect();
                    let stale = m.free.first().copied().filter(|_| idx.len() == 4);
                    let mut call = bs.clone();
                    call.extend(stale);
                    let r = p.release(&call, placement);
                    if stale.is_some() {
                        prop_assert!(matches!(r, Err(Error::RefcountUnderflow { .. })), "{:?}", r);
                    } else {
                        r.unwrap();
                        for &i in picks.iter().rev() {
                            held.remove(i);
                        }
                        let (mut front, mut back) = (Vec::new(), Vec::new());
                        for &b in &bs {
                            m.refcnt[b as usize] -= 1;
                            if m.refcnt[b as usize] == 0 {
                                let to_back = match placement {
                                    Placement::Front => false,
                                    Placement::Back => true,
                                    Placement::ByCache => m.cached(b),
                                };
                                if to_back { back.push(b) } else { front.push(b) }
                            }
                        }
                        front.append(&mut m.free);
                        front.extend(back);
                        m.free = front;
                    }
                }
                Op::Insert(h, g, i) => {
                    let Some(&b) = held.get(i) else { continue };
                    let k = make_key(&[h; 4], u32::from(g));
                    let fresh = p.insert(&k, b).unwrap();
                    let had = m.pairs.iter().any(|(x, y)| *x == k && *y == b);
                    prop_assert_eq!(fresh, !had);
                    if !had { m.pairs.push((k, b)); }
                }
                Op::Remove(h, g, i) => {
                    let b = (i as u32) % N;
                    let k = make_key(&[h; 4], u32::from(g));
                    let had = m.pairs.iter().any(|(x, y)| *x == k && *y == b);
                    prop_assert_eq!(p.remove(&k, b).unwrap(), had);
                    m.pairs.retain(|(x, y)| !(*x == k && *y == b));
                }
                Op::Evict(b) => {
                    if b >= N {
                        let r = p.evict(b);
                        prop_assert!(matches!(r, Err(Error::InvalidBlock { .. })), "{:?}", r);
                        continue;
                    }
                    let n = m.pairs.iter().filter(|(_, y)| *y == b).count();
                    prop_assert_eq!(p.evict(b).unwrap(), n);
                    m.pairs.retain(|(_, y)| *y != b);
                }
                Op::Lookup(h, g) => {
                    let k = make_key(&[h; 4], u32::from(g));
                    prop_assert_eq!(p.lookup(&k), m.lookup(&k));
                }
                Op::Reset => {
                    let ok = m.refcnt.iter().all(|&c| c == 0);
                    prop_assert_eq!(p.reset(), ok);
                    if ok { m.pairs.clear(); }
                }
                Op::SetRef(i, c) => {
                    let Some(&b) = held.get(i) else { continue };
                    p.set_ref(b, c + m.refcnt[b as usize]).unwrap();
                    m.refcnt[b as usize] += c;
                    for _ in 0..c { held.push(b); }
                }
            }
            p.check_invariants().unwrap();
            prop_assert_eq!(p.free_order(), m.free.clone());
            prop_assert_eq!(p.num_free(), m.free.len());
            for b in 0..N {
                prop_assert_eq!(p.ref_count(b).unwrap(), m.refcnt[b as usize]);
                prop_assert_eq!(p.is_cached(b).unwrap(), m.cached(b));
            }
        }
    }
}
