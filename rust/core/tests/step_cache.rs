//! Incremental block-table writes: after every step, the valid part of every block-table row of
//! the batch must equal its sequence's block table, whatever happened in between.
//!
//! `build_step` rewrites only the entries a row does not already hold (per-row marks of sequence
//! uid, table version and entries written, for the buffer it last wrote). These tests drive it
//! through everything that can make a mark stale: batches in a new order, sequences leaving and
//! coming back in other rows, a freed id readmitted, forks whose shared tail is replaced by
//! copy-on-write, two buffer sets used in turn, and a caller writing into the buffer followed by
//! `invalidate_step_cache`. Rows are pre-filled with garbage so a skipped write shows.

use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::{Error, SeqId};
use proptest::prelude::*;

const B: u32 = 4;
const ROWS: usize = 6;
const WIDTH: usize = 24;

fn layout() -> StepLayout {
    StepLayout {
        max_seqs: ROWS,
        max_tokens: ROWS * WIDTH * B as usize,
        max_blocks_per_seq: WIDTH,
        max_copies: 64,
        max_swaps: 4,
    }
}

/// Two buffer sets: the first with the CSR page table, the second without. Garbage-filled.
fn buffers() -> [OwnedStepBuffers; 2] {
    let mut a = OwnedStepBuffers::new(layout());
    let mut b = OwnedStepBuffers::new(layout());
    b.kv_indptr.clear();
    b.kv_indices.clear();
    b.kv_last_page_len.clear();
    a.block_tables.fill(-7);
    b.block_tables.fill(-9);
    [a, b]
}

fn manager(caching: bool) -> BlockManager {
    let mut cfg = ManagerConfig::new(400, B);
    cfg.max_blocks_per_seq = WIDTH as u32;
    cfg.enable_prefix_caching = caching;
    BlockManager::new(cfg).unwrap()
}

/// Asserts that row `k` of `buf` starts with the block table of `seqs[k]`, for every `k`.
fn assert_rows(m: &BlockManager, buf: &OwnedStepBuffers, seqs: &[SeqId]) {
    for (k, &s) in seqs.iter().enumerate() {
        let want: Vec<i32> = m
            .block_table(s)
            .unwrap()
            .iter()
            .map(|&b| b as i32)
            .collect();
        let row = &buf.block_tables[k * WIDTH..k * WIDTH + want.len()];
        assert_eq!(row, &want[..], "row {k} (sequence {s})");
    }
}

fn step(m: &mut BlockManager, buf: &mut OwnedStepBuffers, seqs: &[SeqId]) {
    let ones = vec![1u32; seqs.len()];
    m.build_step(seqs, &ones, &mut buf.view()).unwrap();
    assert_rows(m, buf, seqs);
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i))
        .collect()
}

/// The copy-on-write case on its own: the parent's row holds the shared tail, then an append
/// replaces that tail in place without adding a block. Only the version bump tells the step.
#[test]
fn copy_on_write_tail_is_rewritten() {
    for caching in [false, true] {
        let mut m = manager(caching);
        let [mut buf, _] = buffers();
        m.admit(1, &toks(1, 10)).unwrap(); // 3 blocks, tail partly filled
        step(&mut m, &mut buf, &[1]);
        m.fork(1, 2).unwrap();
        m.fork(1, 3).unwrap();
        step(&mut m, &mut buf, &[1, 2, 3]);
        let shared_tail = m.block_table(1).unwrap()[2];
        m.append(1, &[5]).unwrap(); // 11 tokens: still 3 blocks, tail copied
        assert_ne!(m.block_table(1).unwrap()[2], shared_tail);
        assert_eq!(m.block_table(1).unwrap().len(), 3);
        step(&mut m, &mut buf, &[1, 2, 3]);
        // Same through append_batch, for a child this time (the tail is still shared by 2 and 3).
        m.append_batch(&[2], &[6]).unwrap();
        assert_ne!(m.block_table(2).unwrap()[2], shared_tail);
        step(&mut m, &mut buf, &[1, 2, 3]);
    }
}

/// A freed id readmitted into the same slot and row, with the same block count: the uid differs,
/// so the row is rewritten even though nothing else tells the two apart.
#[test]
fn readmitted_id_gets_a_full_row() {
    let mut m = manager(false);
    let [mut buf, _] = buffers();
    m.admit(1, &toks(1, 12)).unwrap();
    m.admit(2, &toks(2, 12)).unwrap();
    step(&mut m, &mut buf, &[1, 2]);
    m.free(1).unwrap();
    m.admit(3, &toks(3, 12)).unwrap(); // takes sequence 1's blocks, possibly in another order
    m.free(2).unwrap();
    m.admit(1, &toks(4, 12)).unwrap();
    step(&mut m, &mut buf, &[1, 3]);
    step(&mut m, &mut buf, &[3, 1]);
}

/// The caller writes into the buffer: after `invalidate_step_cache` the next step repairs every row
/// of its batch. Without the call the row would stay scribbled (the contract is the caller's).
#[test]
fn invalidate_after_caller_writes() {
    let mut m = manager(true);
    let [mut buf, _] = buffers();
    m.admit(1, &toks(1, 30)).unwrap();
    m.admit(2, &toks(2, 7)).unwrap();
    step(&mut m, &mut buf, &[1, 2]);
    buf.block_tables[..2 * WIDTH].fill(12345);
    m.invalidate_step_cache();
    step(&mut m, &mut buf, &[1, 2]);
    // Without invalidation the marks still claim the rows are up to date.
    buf.block_tables[1] = 999;
    m.build_step(&[1, 2], &[1, 1], &mut buf.view()).unwrap();
    assert_eq!(buf.block_tables[1], 999);
}

/// A step that fails validation writes nothing and leaves the marks as they were.
#[test]
fn failed_step_leaves_buffer_and_marks() {
    let mut m = manager(false);
    let [mut buf, _] = buffers();
    m.admit(1, &toks(1, 9)).unwrap();
    m.admit(2, &toks(2, 9)).unwrap();
    step(&mut m, &mut buf, &[1, 2]);
    m.append_batch(&[1, 2], &[0, 0]).unwrap();
    let before = buf.block_tables.clone();
    assert!(matches!(
        m.build_step(&[2, 1, 77], &[1, 1, 1], &mut buf.view()),
        Err(Error::UnknownSequence { seq_id: 77 })
    ));
    assert!(matches!(
        m.build_step(&[2, 1], &[1, 99], &mut buf.view()),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(buf.block_tables, before);
    step(&mut m, &mut buf, &[2, 1]);
}

/// Two buffer sets in turn: each switch resets the marks, and each buffer ends up right.
#[test]
fn alternating_buffers() {
    let mut m = manager(true);
    let [mut a, mut b] = buffers();
    m.admit(1, &toks(1, 15)).unwrap();
    m.admit(2, &toks(2, 3)).unwrap();
    for i in 0..12u32 {
        let (buf, order): (&mut OwnedStepBuffers, &[SeqId]) = if i % 2 == 0 {
            (&mut a, &[1, 2])
        } else {
            (&mut b, &[2, 1])
        };
        step(&mut m, buf, order);
        m.append_batch(&[1, 2], &[i, i]).unwrap();
    }
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        seq: SeqId,
        len: usize,
        seed: u32,
    },
    Append {
        seq: SeqId,
        n: usize,
    },
    AppendBatch {
        picks: Vec<u8>,
    },
    Free {
        seq: SeqId,
    },
    Fork {
        parent: SeqId,
        child: SeqId,
    },
    /// Step the live sequences chosen by `picks` (indexes into the sorted live ids, repeats
    /// dropped), in that order, into buffer set `buf`.
    Step {
        picks: Vec<u8>,
        buf: bool,
    },
    /// Overwrite `cells` entries of buffer set `buf` with garbage, then invalidate.
    Scribble {
        buf: bool,
        cells: Vec<(u8, u8)>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0u64..8;
    let picks = prop::collection::vec(any::<u8>(), 0..ROWS + 2);
    prop_oneof![
        3 => (seq.clone(), 1usize..40, any::<u32>()).prop_map(|(seq, len, seed)| Op::Admit { seq, len, seed }),
        3 => (seq.clone(), 1usize..9).prop_map(|(seq, n)| Op::Append { seq, n }),
        3 => picks.clone().prop_map(|picks| Op::AppendBatch { picks }),
        2 => seq.clone().prop_map(|seq| Op::Free { seq }),
        3 => (seq.clone(), seq).prop_map(|(parent, child)| Op::Fork { parent, child }),
        6 => (picks, any::<bool>()).prop_map(|(picks, buf)| Op::Step { picks, buf }),
        1 => (any::<bool>(), prop::collection::vec(any::<(u8, u8)>(), 1..8))
            .prop_map(|(buf, cells)| Op::Scribble { buf, cells }),
    ]
}

/// Live ids chosen by `picks`, in pick order, without repeats, at most `ROWS`.
fn choose(m: &BlockManager, picks: &[u8]) -> Vec<SeqId> {
    let mut live: Vec<SeqId> = m.seq_ids().collect();
    live.sort_unstable();
    let mut out = Vec::new();
    if live.is_empty() {
        return out;
    }
    for &p in picks {
        let s = live[p as usize % live.len()];
        if !out.contains(&s) && out.len() < ROWS {
            out.push(s);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn rows_match_tables_after_every_step(
        caching in any::<bool>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut m = manager(caching);
        let mut bufs = buffers();
        for op in &ops {
            // Errors (full pool, unknown or duplicate ids, too long) leave the manager unchanged;
            // what matters here is the step output that follows.
            match op {
                Op::Admit { seq, len, seed } => {
                    let _ = m.admit(*seq, &toks(*seed, *len));
                }
                Op::Append { seq, n } => {
                    let _ = m.append(*seq, &toks(*seq as u32, *n));
                }
                Op::AppendBatch { picks } => {
                    let seqs = choose(&m, picks);
                    let t = vec![3u32; seqs.len()];
                    let _ = m.append_batch(&seqs, &t);
                }
                Op::Free { seq } => {
                    let _ = m.free(*seq);
                }
                Op::Fork { parent, child } => {
                    let _ = m.fork(*parent, *child);
                }
                Op::Step { picks, buf } => {
                    let seqs = choose(&m, picks);
                    step(&mut m, &mut bufs[*buf as usize], &seqs);
                }
                Op::Scribble { buf, cells } => {
                    let bt = &mut bufs[*buf as usize].block_tables;
                    for &(r, c) in cells {
                        let i = (r as usize % ROWS) * WIDTH + c as usize % WIDTH;
                        bt[i] = bt[i].wrapping_add(1000);
                    }
                    m.invalidate_step_cache();
                }
            }
            m.check_invariants().unwrap();
        }
    }
}
