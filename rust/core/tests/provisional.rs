//! Provisional tokens: slots and tables like any token, never hashed or cached until `commit`;
//! `commit` / `commit_batch` / `rewind` settle them atomically, return emptied blocks and leave the
//! prefix cache exactly as appending the accepted tokens would; typed errors change nothing;
//! forks and appends refuse a sequence holding provisional tokens; preemption rewinds them; KV
//! cache groups release blocks by the committed length only.

use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedGroupBuffers, OwnedStepBuffers, StepLayout};
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

struct Bufs {
    ob: OwnedStepBuffers,
    gob: OwnedGroupBuffers,
}

impl Bufs {
    fn new(m: &BlockManager) -> Self {
        Self {
            ob: OwnedStepBuffers::new(layout()),
            gob: OwnedGroupBuffers::new(layout(), m.num_groups() - 1),
        }
    }
    fn step(&mut self, m: &mut BlockManager, seqs: &[SeqId], n: &[u32]) {
        let mut g = self.gob.views();
        m.build_step_groups(seqs, n, &mut self.ob.view(), &mut g)
            .unwrap();
        drop(g);
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
