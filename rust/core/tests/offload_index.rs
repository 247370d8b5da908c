//! [`pagedkv::offload_index::OffloadIndex`] against a plain model of the same rules (vectors and a
//! std `HashMap`, the free order as a `Vec`): random walks of every call, with and without token
//! positions, admission masks and hints (right, wrong or none), on tiers small enough that stores
//! refuse and evict often. After every call the answers, the free order, every chunk's key,
//! count and pending flag agree, and the index's invariants hold.

use std::collections::HashMap;

use pagedkv::offload_index::{Hint, Lookup, OffloadIndex, StoreOut, NIL_CHUNK};
use proptest::prelude::*;

/// The rules, written the plain way.
#[derive(Debug, Clone)]
struct Model {
    refcnt: Vec<u32>,
    free: Vec<u32>,
    key_of: Vec<Option<Vec<u8>>>,
    map: HashMap<Vec<u8>, u32>,
    pending: Vec<bool>,
    stamp: Vec<i64>,
    tick: i64,
}

impl Model {
    fn new(n: u32) -> Model {
        let n_ = n as usize;
        Model {
            refcnt: vec![0; n_],
            free: (0..n).collect(),
            key_of: vec![None; n_],
            map: HashMap::new(),
            pending: vec![false; n_],
            stamp: vec![0; n_],
            tick: 0,
        }
    }

    fn lookup(&self, k: &[u8]) -> Lookup {
        match self.map.get(k) {
            None => Lookup::Miss,
            Some(&c) if self.pending[c as usize] => Lookup::Pending,
            Some(_) => Lookup::Hit,
        }
    }

    fn stamp(&mut self, chunks: &[u32], pos: Option<Vec<i64>>) {
        match pos {
            Some(p) => {
                for (&c, x) in chunks.iter().zip(p) {
                    self.stamp[c as usize] = x;
                }
            }
            None => {
                for &c in chunks {
                    self.stamp[c as usize] = self.tick;
                    self.tick += 1;
                }
            }
        }
    }

    fn hold(&mut self, chunks: &[u32]) {
        for &c in chunks {
            if self.refcnt[c as usize] == 0 {
                self.free.retain(|&x| x != c);
            }
            self.refcnt[c as usize] += 1;
        }
    }

    /// Releases in order; each chunk reaching zero goes to the back. False (nothing changed)
    /// on an underflow.
    fn release_back(&mut self, chunks: &[u32]) -> bool {
        let mut r = self.refcnt.clone();
        let mut zero = Vec::new();
        for &c in chunks {
            if r[c as usize] == 0 {
                return false;
            }
            r[c as usize] -= 1;
            if r[c as usize] == 0 {
                zero.push(c);
            }
        }
        self.refcnt = r;
        self.free.extend(zero);
        true
    }

    fn tail_first(&self, chunks: &[u32]) -> Vec<u32> {
        let mut v = chunks.to_vec();
        v.sort_by_key(|&c| std::cmp::Reverse(self.stamp[c as usize]));
        v
    }

    fn ready(&self, keys: &[Vec<u8>]) -> Option<Vec<u32>> {
        keys.iter()
            .map(|k| {
                self.map
                    .get(k)
                    .copied()
                    .filter(|&c| !self.pending[c as usize])
            })
            .collect()
    }

    fn prepare_load(&mut self, keys: &[Vec<u8>], pos: &[Option<i64>]) -> Option<Vec<u32>> {
        let chunks = self.ready(keys)?;
        self.hold(&chunks);
        let p: Option<Vec<i64>> = if pos.is_empty() {
            None
        } else {
            pos.iter().copied().collect()
        };
        self.stamp(&chunks, p);
        Some(chunks)
    }

    fn complete_load(&mut self, keys: &[Vec<u8>]) -> bool {
        let Some(chunks) = self.ready(keys) else {
            return false;
        };
        let order = self.tail_first(&chunks);
        self.release_back(&order)
    }

    fn touch(&mut self, keys: &[Vec<u8>]) {
        let mut chunks: Vec<u32> = keys
            .iter()
            .filter_map(|k| self.map.get(k).copied())
            .filter(|&c| !self.pending[c as usize])
            .collect();
        chunks.reverse();
        self.hold(&chunks);
        assert!(self.release_back(&chunks));
    }

    /// `(new key indices, Some(chunks, evicted keys) | None for no room)`.
    #[allow(clippy::type_complexity)]
    fn prepare_store(
        &mut self,
        keys: &[Vec<u8>],
        pos: &[Option<i64>],
        admit: Option<&[bool]>,
    ) -> (Vec<usize>, Option<(Vec<u32>, Vec<Vec<u8>>)>) {
        let mut new: Vec<usize> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if !self.map.contains_key(k)
                && admit.is_none_or(|a| a[i])
                && !new.iter().any(|&j| keys[j] == *k)
            {
                new.push(i);
            }
        }
        let held: Vec<u32> = keys
            .iter()
            .filter_map(|k| self.map.get(k).copied())
            .filter(|&c| !self.pending[c as usize])
            .collect();
        if new.is_empty() {
            return (new, Some((Vec::new(), Vec::new())));
        }
        let free_held = held
            .iter()
            .filter(|&&c| self.refcnt[c as usize] == 0)
            .count();
        if new.len() + free_held > self.free.len() {
            return (new, None);
        }
        if free_held > 0 {
            self.hold(&held);
        }
        let mut chunks = Vec::new();
        let mut evicted = Vec::new();
        for _ in 0..new.len() {
            let c = self.free.remove(0);
            self.refcnt[c as usize] = 1;
            if let Some(k) = self.key_of[c as usize].take() {
                self.map.remove(&k);
                evicted.push(k);
            }
            chunks.push(c);
        }
        for (&i, &c) in new.iter().zip(&chunks) {
            self.map.insert(keys[i].clone(), c);
            self.key_of[c as usize] = Some(keys[i].clone());
            self.pending[c as usize] = true;
        }
        let p: Option<Vec<i64>> = if pos.is_empty() {
            None
        } else {
            new.iter().map(|&i| pos[i]).collect()
        };
        self.stamp(&chunks, p);
        if free_held > 0 {
            let mut h = held.clone();
            h.reverse();
            assert!(self.release_back(&h));
        }
        (new, Some((chunks, evicted)))
    }

    fn complete_store(&mut self, keys: &[Vec<u8>], success: bool) -> Vec<usize> {
        let mut done = Vec::new();
        let mut chunks = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if let Some(&c) = self.map.get(k) {
                if self.pending[c as usize] {
                    self.pending[c as usize] = false;
                    done.push(i);
                    chunks.push(c);
                }
            }
        }
        if success {
            let order = self.tail_first(&chunks);
            assert!(self.release_back(&order));
        } else {
            for &c in &chunks {
                let k = self.key_of[c as usize].take().unwrap();
                self.map.remove(&k);
                self.refcnt[c as usize] = 0;
            }
            let mut f = chunks.clone();
            f.extend(self.free.iter().copied());
            self.free = f;
        }
        done
    }
}

fn key(i: u8) -> Vec<u8> {
    // 36 bytes as vLLM packs them; every 7th key is long (boxed in the index).
    let mut k = vec![i; if i % 7 == 3 { 60 } else { 32 }];
    k.extend_from_slice(&0u32.to_be_bytes());
    k
}

#[derive(Debug, Clone)]
enum Op {
    Lookup(u8),
    Store(Vec<u8>, u8, Option<Vec<bool>>, u8),
    Complete(Vec<u8>, bool, u8),
    Load(Vec<u8>, u8, u8),
    Unload(usize, u8),
    Touch(Vec<u8>, u8),
    Reset,
}

/// An admission mask (for up to 10 keys), one store in five.
fn admit() -> impl Strategy<Value = Option<Vec<bool>>> {
    prop::option::weighted(0.2, prop::collection::vec(any::<bool>(), 10))
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || prop::collection::vec(0u8..40, 0..10);
    prop_oneof![
        4 => (0u8..40).prop_map(Op::Lookup),
        5 => (keys(), 0u8..3, admit(), 0u8..3).prop_map(|(k, p, a, h)| Op::Store(k, p, a, h)),
        3 => (keys(), prop::bool::weighted(0.85), 0u8..3)
            .prop_map(|(k, s, h)| Op::Complete(k, s, h)),
        3 => (keys(), 0u8..3, 0u8..3).prop_map(|(k, p, h)| Op::Load(k, p, h)),
        2 => (any::<usize>(), 0u8..3).prop_map(|(i, h)| Op::Unload(i, h)),
        2 => (keys(), 0u8..3).prop_map(|(k, h)| Op::Touch(k, h)),
        1 => Just(Op::Reset),
    ]
}

/// Token positions for `ks`: 0 none known, 1 every one, 2 some missing (then none are used).
fn positions(ks: &[Vec<u8>], kind: u8, scale: i64) -> Vec<Option<i64>> {
    match kind {
        0 => Vec::new(),
        1 => ks.iter().map(|k| Some(i64::from(k[0]) * scale)).collect(),
        _ => ks
            .iter()
            .enumerate()
            .map(|(i, k)| (i % 3 != 1).then_some(i64::from(k[0]) * scale))
            .collect(),
    }
}

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|k| k.as_slice()).collect()
}

/// A hint for `n` keys: 0 none, 1 the index's last resolution (right when the keys are the last
/// call's), 2 wrong guesses.
fn hint_of(kind: u8, x: &OffloadIndex, n: usize, buf: &mut Vec<u32>) -> bool {
    buf.clear();
    match kind {
        1 => buf.extend(
            x.last_chunks()
                .iter()
                .copied()
                .chain(std::iter::repeat(NIL_CHUNK))
                .take(n),
        ),
        2 => buf.extend((0..n as u32).map(|i| (i * 7 + 3) % (x.num_chunks() + 2))),
        _ => return false,
    }
    true
}

fn agree(x: &OffloadIndex, m: &Model) {
    x.check_invariants().unwrap();
    assert_eq!(x.free_order(), m.free);
    for c in 0..m.refcnt.len() as u32 {
        assert_eq!(x.ref_count(c).unwrap(), m.refcnt[c as usize], "chunk {c}");
        assert_eq!(
            x.key(c).unwrap(),
            m.key_of[c as usize].as_deref(),
            "chunk {c}"
        );
        assert_eq!(x.is_pending(c).unwrap(), m.pending[c as usize], "chunk {c}");
    }
    assert_eq!(x.num_keys(), m.map.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_the_model(n in 0u32..14, seed in any::<u64>(),
                               ops in prop::collection::vec(op(), 1..80)) {
        let mut x = OffloadIndex::with_seed(n, seed).unwrap();
        let mut m = Model::new(n);
        let mut loads: Vec<Vec<Vec<u8>>> = Vec::new();
        let (mut out, mut ids, mut done, mut hint) =
            (StoreOut::default(), Vec::new(), Vec::new(), Vec::new());
        for op in ops {
            match op {
                Op::Lookup(k) => {
                    let k = key(k);
                    prop_assert_eq!(x.lookup(&k), m.lookup(&k));
                }
                Op::Store(ks, with_pos, admit, h) => {
                    let ks: Vec<Vec<u8>> = ks.into_iter().map(key).collect();
                    let pos = positions(&ks, with_pos, 16);
                    let admit: Option<Vec<bool>> = admit.map(|a| a[..ks.len()].to_vec());
                    let _ = h;
                    let room = x
                        .prepare_store(&refs(&ks), &pos, admit.as_deref(), &mut out)
                        .unwrap();
                    let (new, want) = m.prepare_store(&ks, &pos, admit.as_deref());
                    prop_assert_eq!(&out.new, &new);
                    match want {
                        None => prop_assert!(!room),
                        Some((chunks, evicted)) => {
                            prop_assert!(room);
                            prop_assert_eq!(&out.chunks, &chunks);
                            let got: Vec<&[u8]> = out.evicted_keys().collect();
                            prop_assert_eq!(got, refs(&evicted));
                        }
                    }
                }
                Op::Complete(ks, ok, h) => {
                    let ks: Vec<Vec<u8>> = ks.into_iter().map(key).collect();
                    let hinted = hint_of(h, &x, ks.len(), &mut hint);
                    x.complete_store(&refs(&ks), ok, hinted.then_some(Hint { chunks: &hint }),
                                     &mut done);
                    prop_assert_eq!(&done, &m.complete_store(&ks, ok));
                }
                Op::Load(ks, with_pos, h) => {
                    let ks: Vec<Vec<u8>> = ks.into_iter().map(key).collect();
                    let pos = positions(&ks, with_pos, -1);
                    let hinted = hint_of(h, &x, ks.len(), &mut hint);
                    let r = x.prepare_load(&refs(&ks), &pos,
                                           hinted.then_some(Hint { chunks: &hint }), &mut ids);
                    match m.prepare_load(&ks, &pos) {
                        Some(chunks) => {
                            prop_assert!(r.is_ok());
                            prop_assert_eq!(&ids, &chunks);
                            loads.push(ks);
                        }
                        None => prop_assert!(r.is_err()),
                    }
                }
                Op::Unload(i, h) => {
                    // A load's completion, or (no load held) a completion nothing holds.
                    let ks = if loads.is_empty() {
                        vec![key(1)]
                    } else {
                        loads.remove(i % loads.len())
                    };
                    let hinted = hint_of(h, &x, ks.len(), &mut hint);
                    let r = x.complete_load(&refs(&ks), hinted.then_some(Hint { chunks: &hint }));
                    let before = m.clone();
                    let ok = m.complete_load(&ks);
                    prop_assert_eq!(r.is_ok(), ok);
                    if !ok {
                        m = before;
                    }
                }
                Op::Touch(ks, h) => {
                    let ks: Vec<Vec<u8>> = ks.into_iter().map(key).collect();
                    let hinted = hint_of(h, &x, ks.len(), &mut hint);
                    x.touch(&refs(&ks), hinted.then_some(Hint { chunks: &hint }));
                    m.touch(&ks);
                }
                Op::Reset => {
                    x.reset();
                    m = Model::new(n);
                    loads.clear();
                }
            }
            agree(&x, &m);
        }
    }
}

/// Many keys through a small table: every eviction shifts probe runs back, and every key the
/// model holds stays findable.
#[test]
fn long_churn_keeps_the_table_exact() {
    let mut x = OffloadIndex::with_seed(64, 11).unwrap();
    let mut m = Model::new(64);
    let (mut out, mut done) = (StoreOut::default(), Vec::new());
    for round in 0..400u32 {
        let ks: Vec<Vec<u8>> = (0..24u32)
            .map(|i| {
                let mut k = (round * 7 + i * 13).to_le_bytes().to_vec();
                k.resize(36, 0);
                k
            })
            .collect();
        assert!(x.prepare_store(&refs(&ks), &[], None, &mut out).unwrap());
        let (_, want) = m.prepare_store(&ks, &[], None);
        assert_eq!(out.chunks, want.unwrap().0);
        let ok = round % 5 != 0;
        x.complete_store(&refs(&ks), ok, None, &mut done);
        m.complete_store(&ks, ok);
        agree(&x, &m);
    }
}
