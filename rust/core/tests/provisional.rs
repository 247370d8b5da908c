//! Provisional tokens: slots and tables like any token, never hashed or cached until `commit`;
//! `commit` / `commit_batch` / `rewind` settle them atomically, return emptied blocks and leave the
//! prefix cache exactly as appending the accepted tokens would; typed errors change nothing;
//! forks and appends refuse a sequence holding provisional tokens; preemption rewinds them; KV
//! cache groups release blocks by the committed length only.

mod common;

use common::GroupBufs;
use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::StepLayout;
use pagedkv::swap::SeqState;
use pagedkv::{Error, SeqId};
use proptest::prelude::*;

fn cfg(num_blocks: u32, bs: u32, k: u32) -> ManagerConfig {
    let mut c = ManagerConfig::new(num_blocks, bs);
    c.watermark_blocks = 0;
    c.hash_seed = Some(7);
    c.max_provisional = k;
    c
}

fn layout() -> StepLayout {
    StepLayout {
        max_seqs: 8,
        max_tokens: 512,
        max_blocks_per_seq: 64,
        max_copies: 16,
        max_swaps: 16,
    }
}

type Bufs = GroupBufs;

impl Bufs {
    fn new(m: &BlockManager) -> Self {
        Self::with_layout(m, layout())
    }

    fn step(&mut self, m: &mut BlockManager, seqs: &[SeqId], n: &[u32]) {
        self.build(m, seqs, n).unwrap();
        m.check_invariants().unwrap();
    }
}

/// Everything observable a failed call must leave as it was.
fn snap(m: &BlockManager) -> String {
    let mut ids: Vec<SeqId> = m.seq_ids().collect();
    ids.sort();
    let seqs: Vec<_> = ids
        .iter()
        .map(|&s| {
            (
                s,
                m.seq_len(s).unwrap(),
                m.num_provisional(s).unwrap(),
                (0..m.num_groups())
                    .map(|g| m.block_table_group(s, g).unwrap().to_vec())
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let rc: Vec<_> = (0..m.config().num_blocks)
        .map(|b| (m.block_refcount(b).unwrap(), m.block_hash(b)))
        .collect();
    format!(
        "{seqs:?} {rc:?} {} {:?}",
        m.num_free_blocks(),
        m.pending_copies()
    )
}

#[test]
fn windowed_groups_release_by_committed_length() {
    let mut c = cfg(46, 4, 3);
    c.enable_prefix_caching = false;
    c.verify_prefix = false;
    c.max_blocks_per_seq = 7;
    c.groups = vec![
        AttentionKind::Full,
        AttentionKind::Chunked { chunk: 5 },
        AttentionKind::Sliding { window: 1 },
        AttentionKind::Full,
    ];
    let mut m = BlockManager::new(c).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(3, &[7, 101, 102, 103, 104, 105, 106]).unwrap();
    m.append(3, &[0]).unwrap();
    b.step(&mut m, &[3], &[8]);
    m.admit(2, &[100]).unwrap();
    m.append_provisional(3, 1).unwrap();
    // A step of the provisional token alone (position 8, a window of 1): block 1 is dead for it,
    // but it is the committed tail, which a rewind makes the tail again: only block 0 goes.
    b.step(&mut m, &[3, 2], &[1, 1]);
    let sliding = m.block_table_group(3, 2).unwrap();
    assert_eq!(sliding.iter().take_while(|&&x| x == NULL_BLOCK).count(), 1);
    m.rewind(3).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.seq_len(3).unwrap(), 8);
    // Block 2 (position 8) went with the rejected token; the tail block 1 is still held.
    let sliding = m.block_table_group(3, 2).unwrap();
    assert_eq!(sliding.len(), 2);
    assert_ne!(sliding[1], NULL_BLOCK);
    m.append(3, &[5]).unwrap();
    b.step(&mut m, &[3], &[1]);
}

#[test]
fn errors_are_typed_and_change_nothing() {
    let mut m = BlockManager::new(cfg(16, 4, 2)).unwrap();
    m.admit(1, &[1, 2, 3]).unwrap();
    m.admit(2, &[4, 5, 6]).unwrap();
    m.append_provisional(1, 2).unwrap();
    let before = snap(&m);
    // k exceeded (2 held, at most 2), and zero.
    assert!(matches!(
        m.append_provisional(1, 1),
        Err(Error::InvalidArgument {
            what: "num_provisional",
            value: 1,
            ..
        })
    ));
    assert!(matches!(
        m.append_provisional(2, 3),
        Err(Error::InvalidArgument {
            what: "num_provisional",
            value: 3,
            ..
        })
    ));
    assert!(matches!(
        m.append_provisional(2, 0),
        Err(Error::InvalidArgument {
            what: "num_provisional",
            value: 0,
            ..
        })
    ));
    // A batch with one bad row changes nothing for the good ones.
    assert!(matches!(
        m.append_provisional_batch(&[2, 1], &[1, 1]),
        Err(Error::InvalidArgument {
            what: "num_provisional",
            ..
        })
    ));
    assert!(matches!(
        m.append_provisional_batch(&[2, 2], &[1, 1]),
        Err(Error::InvalidArgument { what: "seqs", .. })
    ));
    // n_accepted above the provisional count; token ids of the wrong length; unknown sequence.
    assert!(matches!(
        m.commit(1, 3, &[9, 9, 9]),
        Err(Error::InvalidArgument {
            what: "n_accepted",
            value: 3,
            ..
        })
    ));
    assert!(matches!(
        m.commit(1, 1, &[9, 9]),
        Err(Error::InvalidArgument {
            what: "accepted.len",
            value: 2,
            ..
        })
    ));
    assert_eq!(
        m.commit(9, 0, &[]),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
    assert_eq!(m.rewind(9), Err(Error::UnknownSequence { seq_id: 9 }));
    assert_eq!(
        m.append_provisional(9, 1),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
    // Batch: a bad row anywhere, a repeated id, a token count off by one: nothing settled.
    assert!(matches!(
        m.commit_batch(&[(1, 1), (2, 1)], &[9, 9]),
        Err(Error::InvalidArgument {
            what: "n_accepted",
            ..
        })
    ));
    assert!(matches!(
        m.commit_batch(&[(1, 1), (1, 1)], &[9, 9]),
        Err(Error::InvalidArgument { what: "seqs", .. })
    ));
    assert!(matches!(
        m.commit_batch(&[(1, 2), (2, 0)], &[9]),
        Err(Error::InvalidArgument {
            what: "tokens.len",
            value: 1,
            ..
        })
    ));
    assert_eq!(
        m.commit_batch(&[(1, 1), (7, 0)], &[9]),
        Err(Error::UnknownSequence { seq_id: 7 })
    );
    // Appends and forks refuse a sequence holding provisional tokens.
    assert!(matches!(
        m.append(1, &[9]),
        Err(Error::InvalidSequenceState { seq_id: 1, .. })
    ));
    assert!(matches!(
        m.append_batch(&[2, 1], &[9, 9]),
        Err(Error::InvalidSequenceState { seq_id: 1, .. })
    ));
    assert!(matches!(
        m.fork(1, 3),
        Err(Error::InvalidSequenceState { seq_id: 1, .. })
    ));
    assert_eq!(snap(&m), before);
    m.check_invariants().unwrap();
    // Provisional tokens are off by default.
    let mut off = BlockManager::new(cfg(16, 4, 0)).unwrap();
    off.admit(1, &[1]).unwrap();
    assert!(matches!(
        off.append_provisional(1, 1),
        Err(Error::InvalidArgument {
            what: "num_provisional",
            ..
        })
    ));
    assert_eq!(off.rewind(1), Ok(()));
}

#[test]
fn rewind_across_block_edges_returns_blocks() {
    let mut m = BlockManager::new(cfg(16, 4, 4)).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[1, 2, 3]).unwrap();
    b.step(&mut m, &[1], &[3]);
    let free = m.num_free_blocks();
    let used = m.stats().used_tokens;
    // 3 + 4 = 7 tokens: one more block.
    m.append_provisional(1, 4).unwrap();
    assert_eq!(m.block_table(1).unwrap().len(), 2);
    assert_eq!(m.num_free_blocks(), free - 1);
    b.step(&mut m, &[1], &[4]);
    // Only the new block holds just rejected tokens: it goes back; the first stays.
    let first = m.block_table(1).unwrap()[0];
    m.commit(1, 1, &[4]).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.seq_len(1).unwrap(), 4);
    assert_eq!(m.block_table(1).unwrap(), &[first]);
    assert_eq!(m.num_free_blocks(), free);
    assert_eq!(m.stats().used_tokens, used + 1);
    // The committed full block was scheduled by the step: it is cached now.
    assert!(m.block_hash(first).is_some());
    // Rewind: back to the committed length.
    m.append_provisional(1, 4).unwrap();
    m.rewind(1).unwrap();
    assert_eq!(m.seq_len(1).unwrap(), 4);
    assert_eq!(m.num_free_blocks(), free);
    m.free(1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 16);
}

#[test]
fn provisional_tokens_are_never_hashed_or_published() {
    let mut c = cfg(16, 2, 4);
    c.kv_event_capacity = 64;
    let mut m = BlockManager::new(c).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[1, 2]).unwrap();
    b.step(&mut m, &[1], &[2]);
    let mut ev = Vec::new();
    m.drain_events(&mut ev);
    m.append_provisional(1, 4).unwrap();
    b.step(&mut m, &[1], &[4]);
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(t.len(), 3);
    assert!(m.block_hash(t[0]).is_some());
    assert!(m.block_hash(t[1]).is_none() && m.block_hash(t[2]).is_none());
    ev.clear();
    assert_eq!(
        m.drain_events(&mut ev),
        0,
        "provisional blocks published: {ev:?}"
    );
    // Nothing of them is findable: a prompt with the drafts hits the committed block only.
    let look = m.lookup_tiers(&[1, 2, 9, 9, 9, 9, 1], None).unwrap();
    assert_eq!(look.gpu_blocks, 1);
    m.rewind(1).unwrap();
    assert_eq!(m.drain_events(&mut ev), 0);
    m.check_invariants().unwrap();
}

#[test]
fn forked_tail_copy_then_rewind() {
    let mut m = BlockManager::new(cfg(16, 4, 4)).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[1, 2, 3, 4, 5, 6]).unwrap();
    b.step(&mut m, &[1], &[6]);
    m.fork(1, 2).unwrap();
    let shared_tail = m.block_table(1).unwrap()[1];
    // Writing a provisional token into the shared tail copies it first.
    m.append_provisional(2, 3).unwrap();
    let t2 = m.block_table(2).unwrap().to_vec();
    assert_eq!(t2.len(), 3);
    assert_ne!(t2[1], shared_tail);
    assert_eq!(m.pending_copies(), &[(shared_tail, t2[1])]);
    m.check_invariants().unwrap();
    // Rewind before any step: the fresh block goes; the copy holds committed tokens and stays.
    m.rewind(2).unwrap();
    assert_eq!(m.block_table(2).unwrap(), &t2[..2]);
    assert_eq!(m.pending_copies(), &[(shared_tail, t2[1])]);
    m.check_invariants().unwrap();
    m.free(2).unwrap();
    // The copy lost its reader: it is dropped, nothing leaks.
    assert!(m.pending_copies().is_empty());
    m.free(1).unwrap();
    b.step(&mut m, &[], &[]);
    assert_eq!(m.num_free_blocks(), 16);
}

#[test]
fn preemption_rewinds() {
    let mut c = cfg(16, 4, 3);
    c.num_host_blocks = 8;
    let mut m = BlockManager::new(c).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[1, 2, 3, 4]).unwrap();
    m.admit(2, &[5, 6, 7, 8]).unwrap();
    b.step(&mut m, &[1, 2], &[4, 4]);
    m.append_provisional_batch(&[1, 2], &[3, 2]).unwrap();
    b.step(&mut m, &[1, 2], &[3, 2]);
    m.swap_out(&[1]).unwrap();
    assert_eq!(m.seq_len(1).unwrap(), 4);
    assert_eq!(m.num_provisional(1).unwrap(), 0);
    assert_eq!(m.seq_state(1).unwrap(), SeqState::Swapped);
    m.recompute(2).unwrap();
    assert_eq!(m.seq_len(2).unwrap(), 4);
    m.check_invariants().unwrap();
    m.swap_in(&[1]).unwrap();
    m.resume(2, None).unwrap();
    m.check_invariants().unwrap();
}

/// Replays `cycles` on two managers: `a` drafts `k` tokens, steps them, and commits the first `n`;
/// `b` appends the same `n` tokens and steps them. After each cycle both hold the same tokens and
/// the same hashes at every position, and the prefix caches hold the same hashes.
fn replay_equal(bs: u32, prompt: usize, cycles: &[(u32, u32, bool)]) {
    let mk = || {
        let mut c = cfg(64, bs, 4);
        c.hash_seed = Some(11);
        BlockManager::new(c).unwrap()
    };
    let (mut a, mut b) = (mk(), mk());
    let (mut ba, mut bb) = (Bufs::new(&a), Bufs::new(&b));
    let toks: Vec<u32> = (0..prompt as u32).collect();
    a.admit(1, &toks).unwrap();
    b.admit(1, &toks).unwrap();
    ba.step(&mut a, &[1], &[prompt as u32]);
    bb.step(&mut b, &[1], &[prompt as u32]);
    let mut next = 1000u32;
    for &(k, n, step_first) in cycles {
        let n = n.min(k);
        let drafts: Vec<u32> = (next..next + k).collect();
        next += k;
        a.append_provisional(1, k as usize).unwrap();
        if step_first {
            ba.step(&mut a, &[1], &[k]);
        }
        let accepted = &drafts[..n as usize];
        a.commit_batch(&[(1, n)], accepted).unwrap();
        a.check_invariants().unwrap();
        if n > 0 {
            b.append(1, accepted).unwrap();
            if step_first {
                bb.step(&mut b, &[1], &[n]);
            }
        }
        if !step_first && n > 0 {
            // Neither computed them yet: the next step registers in both.
            ba.step(&mut a, &[1], &[n]);
            bb.step(&mut b, &[1], &[n]);
        }
        assert_eq!(a.seq_len(1).unwrap(), b.seq_len(1).unwrap());
        let ha: Vec<_> = a
            .block_table(1)
            .unwrap()
            .iter()
            .map(|&x| a.block_hash(x))
            .collect();
        let hb: Vec<_> = b
            .block_table(1)
            .unwrap()
            .iter()
            .map(|&x| b.block_hash(x))
            .collect();
        assert_eq!(ha, hb);
        let cached = |m: &BlockManager| {
            let mut v: Vec<u128> = (0..64).filter_map(|x| m.block_hash(x)).collect();
            v.sort();
            v
        };
        assert_eq!(cached(&a), cached(&b));
        assert_eq!(a.stats().used_tokens, b.stats().used_tokens);
    }
    a.free(1).unwrap();
    b.free(1).unwrap();
    assert_eq!(a.num_free_blocks(), 64);
    assert_eq!(a.stats().cached_free_blocks, b.stats().cached_free_blocks);
}

#[test]
fn commit_equals_append_at_block_edges() {
    replay_equal(
        4,
        3,
        &[(4, 1, true), (4, 4, true), (3, 0, true), (4, 2, false)],
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn commit_equals_append(
        bs in 1u32..5,
        prompt in 1usize..12,
        cycles in prop::collection::vec((1u32..5, 0u32..5, any::<bool>()), 1..12),
    ) {
        replay_equal(bs, prompt, &cycles);
    }
}
