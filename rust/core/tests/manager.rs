//! Block manager and step builder: every operation and every error. Each error case asserts that
//! the manager is exactly as before (free count, tables, reference counts, stats) and that its
//! invariants hold.

mod common;

use common::expect_err_unchanged;
use pagedkv::manager::{AdmitResult, BlockManager, ManagerConfig};
use pagedkv::metrics::hist_bucket;
use pagedkv::step::{OwnedStepBuffers, RegisteredBuffers, StepInfo, StepLayout};
use pagedkv::{BlockId, Error, SeqId};

#[derive(Debug, PartialEq)]
struct Snap {
    seqs: Vec<(SeqId, usize, Vec<BlockId>)>,
    refcounts: Vec<u32>,
    free: usize,
    stats: pagedkv::metrics::Stats,
    pending: Vec<(BlockId, BlockId)>,
}

fn snap(m: &BlockManager) -> Snap {
    let mut seqs: Vec<_> = m
        .seq_ids()
        .map(|s| (s, m.seq_len(s).unwrap(), m.block_table(s).unwrap().to_vec()))
        .collect();
    seqs.sort();
    Snap {
        seqs,
        refcounts: (0..m.config().num_blocks)
            .map(|b| m.block_refcount(b).unwrap())
            .collect(),
        free: m.num_free_blocks(),
        stats: m.stats(),
        pending: m.pending_copies().to_vec(),
    }
}

/// Runs `op`, expects an error matching `check`, and asserts nothing changed.
fn expect_err<T: std::fmt::Debug>(
    m: &mut BlockManager,
    op: impl FnOnce(&mut BlockManager) -> pagedkv::Result<T>,
    check: impl FnOnce(&Error) -> bool,
) {
    expect_err_unchanged(m, snap, op, check);
}

fn cfg(num_blocks: u32, bs: u32) -> ManagerConfig {
    let mut c = ManagerConfig::new(num_blocks, bs);
    c.watermark_blocks = 0;
    c.enable_prefix_caching = false;
    c
}

fn mgr(num_blocks: u32, bs: u32) -> BlockManager {
    BlockManager::new(cfg(num_blocks, bs)).unwrap()
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761).wrapping_add(seed))
        .collect()
}

fn layout(seqs: usize, tokens: usize, blocks: usize) -> StepLayout {
    StepLayout {
        max_seqs: seqs,
        max_tokens: tokens,
        max_blocks_per_seq: blocks,
        max_copies: 8,
        max_swaps: 4,
    }
}

// ---------------------------------------------------------------- config

#[test]
fn config_defaults() {
    let c = ManagerConfig::new(1000, 16);
    assert_eq!(c.watermark_blocks, 10);
    assert_eq!(c.max_blocks_per_seq, 1000);
    assert!(c.enable_prefix_caching);
    assert!(c.verify_prefix);
    assert_eq!(c.hash_seed, None);
    c.validate().unwrap();
    assert_eq!(ManagerConfig::new(50, 16).watermark_blocks, 1);
    let one = ManagerConfig::new(1, 16);
    assert_eq!(one.watermark_blocks, 0);
    one.validate().unwrap();
    // Default rows are capped so a full row's length fits an int32.
    let wide = ManagerConfig::new(1 << 30, 16);
    assert_eq!(
        wide.max_blocks_per_seq as u64 * 16,
        (i32::MAX as u64 / 16) * 16
    );
    wide.validate().unwrap();
}

#[test]
fn config_validation_names_the_field() {
    let field = |c: ManagerConfig| match c.validate() {
        Err(Error::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(field(ManagerConfig::new(10, 0)), "block_size");
    assert_eq!(field(ManagerConfig::new(0, 16)), "num_blocks");
    assert_eq!(
        field(ManagerConfig::new(i32::MAX as u32 + 1, 1)),
        "num_blocks"
    );
    assert_eq!(
        field(ManagerConfig {
            watermark_blocks: 10,
            ..ManagerConfig::new(10, 16)
        }),
        "watermark_blocks"
    );
    assert_eq!(
        field(ManagerConfig {
            max_blocks_per_seq: 0,
            ..ManagerConfig::new(10, 16)
        }),
        "max_blocks_per_seq"
    );
    assert_eq!(
        field(ManagerConfig {
            max_blocks_per_seq: i32::MAX as u32,
            ..ManagerConfig::new(10, 16)
        }),
        "max_blocks_per_seq"
    );
    assert!(matches!(
        BlockManager::new(ManagerConfig::new(0, 16)),
        Err(Error::InvalidConfig { .. })
    ));
}

// ---------------------------------------------------------------- admit

#[test]
fn admit_allocates_ceil_blocks() {
    let mut m = mgr(10, 4);
    assert_eq!(
        m.admit(1, &toks(9, 0)).unwrap(),
        AdmitResult {
            cached_tokens: 0,
            cached_tokens_gpu: 0,
            cached_tokens_host: 0,
            new_blocks: 3,
            num_blocks: 3,
            num_tokens: 9
        }
    );
    assert_eq!(m.admit(2, &toks(4, 0)).unwrap().num_blocks, 1);
    assert_eq!(m.admit(3, &toks(1, 0)).unwrap().num_blocks, 1);
    assert_eq!(m.num_free_blocks(), 5);
    assert_eq!(m.num_seqs(), 3);
    assert_eq!(m.seq_len(1).unwrap(), 9);
    // A fresh pool hands out low ids first.
    assert_eq!(m.block_table(1).unwrap(), &[0, 1, 2]);
    assert!(m.contains(2) && !m.contains(4));
    let st = m.stats();
    assert_eq!(st.used_blocks, 5);
    assert_eq!(st.used_tokens, 14);
    assert_eq!(st.allocated_token_slots, 20);
    m.check_invariants().unwrap();
}

#[test]
fn admit_errors_leave_state_unchanged() {
    let mut m = BlockManager::new(ManagerConfig {
        watermark_blocks: 2,
        max_blocks_per_seq: 4,
        ..cfg(8, 4)
    })
    .unwrap();
    m.admit(1, &toks(8, 0)).unwrap();
    expect_err(
        &mut m,
        |m| m.admit(2, &[]),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "tokens.len",
                    ..
                }
            )
        },
    );
    expect_err(
        &mut m,
        |m| m.admit(1, &toks(3, 0)),
        |e| *e == Error::DuplicateSequence { seq_id: 1 },
    );
    expect_err(
        &mut m,
        |m| m.admit(2, &toks(17, 0)),
        |e| {
            *e == Error::SequenceTooLong {
                seq_id: 2,
                needed_blocks: 5,
                max_blocks_per_seq: 4,
            }
        },
    );
    // A row holds 4 blocks; 5 are refused before any accounting.
    expect_err(
        &mut m,
        |m| m.admit(2, &toks(5 * 4, 0)),
        |e| matches!(e, Error::SequenceTooLong { .. }),
    );
    m.admit(2, &toks(12, 0)).unwrap(); // 3 blocks; 3 free left
    expect_err(
        &mut m,
        |m| m.admit(3, &toks(8, 0)),
        |e| {
            *e == Error::WatermarkReached {
                needed: 2,
                available: 1,
                watermark: 2,
            }
        },
    );
    m.admit(3, &toks(4, 0)).unwrap(); // exactly down to the reserve
    assert_eq!(m.num_free_blocks(), 2);
    expect_err(
        &mut m,
        |m| m.admit(4, &toks(1, 0)),
        |e| matches!(e, Error::WatermarkReached { .. }),
    );

    let mut m = mgr(3, 4);
    m.admit(1, &toks(8, 0)).unwrap();
    expect_err(
        &mut m,
        |m| m.admit(2, &toks(5, 0)),
        |e| {
            *e == Error::OutOfBlocks {
                needed: 2,
                available: 1,
            }
        },
    );
}

#[test]
fn can_admit_matches_admit() {
    let mut m = BlockManager::new(ManagerConfig {
        watermark_blocks: 1,
        max_blocks_per_seq: 3,
        ..cfg(6, 4)
    })
    .unwrap();
    assert!(!m.can_admit(0));
    assert!(m.can_admit(12));
    assert!(!m.can_admit(13), "row too narrow");
    m.admit(1, &toks(12, 0)).unwrap();
    assert!(m.can_admit(8));
    assert!(!m.can_admit(9), "would dip into the reserve");
    assert!(m.admit(2, &toks(9, 0)).is_err());
    m.admit(2, &toks(8, 0)).unwrap();
    assert!(!m.can_admit(1));
}

// ---------------------------------------------------------------- append

#[test]
fn append_allocates_only_on_block_boundaries() {
    let mut m = mgr(10, 4);
    m.admit(1, &toks(3, 0)).unwrap();
    assert_eq!(m.num_free_blocks(), 9);
    m.append(1, &[5]).unwrap(); // 4 tokens: still one block
    assert_eq!(m.num_free_blocks(), 9);
    m.append(1, &[6]).unwrap(); // 5: second block
    assert_eq!(m.num_free_blocks(), 8);
    m.append(1, &toks(7, 1)).unwrap(); // 12: three blocks
    assert_eq!(m.block_table(1).unwrap().len(), 3);
    assert_eq!(m.seq_len(1).unwrap(), 12);
    m.append(1, &toks(9, 1)).unwrap(); // 21: six blocks
    assert_eq!(m.block_table(1).unwrap().len(), 6);
    assert_eq!(m.stats().used_tokens, 21);
    m.check_invariants().unwrap();
}

#[test]
fn append_may_use_the_reserve() {
    let mut m = BlockManager::new(ManagerConfig {
        watermark_blocks: 2,
        ..cfg(4, 4)
    })
    .unwrap();
    m.admit(1, &toks(8, 0)).unwrap();
    assert_eq!(m.num_free_blocks(), 2);
    m.append(1, &toks(8, 0)).unwrap();
    assert_eq!(m.num_free_blocks(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn append_errors_leave_state_unchanged() {
    let mut m = BlockManager::new(ManagerConfig {
        max_blocks_per_seq: 3,
        ..cfg(4, 4)
    })
    .unwrap();
    m.admit(1, &toks(5, 0)).unwrap();
    m.admit(2, &toks(4, 0)).unwrap();
    expect_err(
        &mut m,
        |m| m.append(1, &[]),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    expect_err(
        &mut m,
        |m| m.append(9, &[1]),
        |e| *e == Error::UnknownSequence { seq_id: 9 },
    );
    expect_err(
        &mut m,
        |m| m.append(1, &toks(8, 0)),
        |e| {
            *e == Error::SequenceTooLong {
                seq_id: 1,
                needed_blocks: 4,
                max_blocks_per_seq: 3,
            }
        },
    );
    m.append(2, &[1]).unwrap(); // pool now empty
    assert_eq!(m.num_free_blocks(), 0);
    m.append(1, &toks(3, 0)).unwrap(); // fills block 2 of seq 1 without allocating
    expect_err(
        &mut m,
        |m| m.append(1, &[1]),
        |e| {
            *e == Error::OutOfBlocks {
                needed: 1,
                available: 0,
            }
        },
    );
}

// ---------------------------------------------------------------- append_batch

#[test]
fn append_batch_one_token_each() {
    let mut m = mgr(10, 4);
    m.admit(1, &toks(4, 0)).unwrap();
    m.admit(2, &toks(2, 0)).unwrap();
    m.admit(3, &toks(7, 0)).unwrap();
    let free = m.num_free_blocks();
    m.append_batch(&[3, 1, 2], &[7, 8, 9]).unwrap();
    assert_eq!(m.seq_len(1).unwrap(), 5);
    assert_eq!(m.seq_len(2).unwrap(), 3);
    assert_eq!(m.seq_len(3).unwrap(), 8);
    assert_eq!(
        m.num_free_blocks(),
        free - 1,
        "only seq 1 crossed a boundary"
    );
    m.append_batch(&[], &[]).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn append_batch_is_all_or_nothing() {
    let mut m = BlockManager::new(ManagerConfig {
        max_blocks_per_seq: 2,
        ..cfg(5, 4)
    })
    .unwrap();
    m.admit(1, &toks(4, 0)).unwrap();
    m.admit(2, &toks(4, 0)).unwrap();
    m.admit(3, &toks(8, 0)).unwrap();
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 2], &[0]),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "tokens.len",
                    ..
                }
            )
        },
    );
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 7], &[0, 0]),
        |e| *e == Error::UnknownSequence { seq_id: 7 },
    );
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 2, 1], &[0, 0, 0]),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "seqs",
                    value: 1,
                    ..
                }
            )
        },
    );
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 3], &[0, 0]),
        |e| {
            *e == Error::SequenceTooLong {
                seq_id: 3,
                needed_blocks: 3,
                max_blocks_per_seq: 2,
            }
        },
    );
    // 1 free block, 2 sequences at a boundary: neither grows.
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 2], &[0, 0]),
        |e| {
            *e == Error::OutOfBlocks {
                needed: 2,
                available: 1,
            }
        },
    );
    m.append_batch(&[2], &[0]).unwrap();
}

// ---------------------------------------------------------------- free

#[test]
fn free_returns_blocks() {
    let mut m = mgr(10, 4);
    m.admit(1, &toks(9, 0)).unwrap();
    m.admit(2, &toks(3, 0)).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_blocks(), 9);
    assert!(!m.contains(1));
    assert_eq!(m.stats().used_tokens, 3);
    expect_err(
        &mut m,
        |m| m.free(1),
        |e| *e == Error::UnknownSequence { seq_id: 1 },
    );
    expect_err(
        &mut m,
        |m| m.seq_len(1),
        |e| *e == Error::UnknownSequence { seq_id: 1 },
    );
    expect_err(
        &mut m,
        |m| m.block_table(1).map(|t| t.to_vec()),
        |e| *e == Error::UnknownSequence { seq_id: 1 },
    );
    // The id can be reused.
    m.admit(1, &toks(2, 0)).unwrap();
    m.free(2).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_blocks(), 10);
    assert_eq!(m.num_seqs(), 0);
    m.check_invariants().unwrap();
}

// ---------------------------------------------------------------- build_step

#[test]
fn build_step_prefill_then_decode() {
    let mut m = mgr(16, 4);
    m.admit(1, &toks(6, 0)).unwrap();
    m.admit(2, &toks(3, 0)).unwrap();
    let t1 = m.block_table(1).unwrap().to_vec();
    let t2 = m.block_table(2).unwrap().to_vec();
    let mut ob = OwnedStepBuffers::new(layout(4, 32, 4));
    ob.block_tables.fill(-1);
    let info = m.build_step(&[2, 1], &[3, 6], &mut ob.view()).unwrap();
    assert_eq!(
        info,
        StepInfo {
            num_seqs: 2,
            num_tokens: 9,
            num_kv_indices: 3,
            num_copies: 0,
            max_seq_len: 6,
            num_swap_out: 0,
            num_swap_in: 0,
            max_query_len: 6,
        }
    );
    let slot = |t: &[u32], p: usize| (t[p / 4] * 4 + (p % 4) as u32) as i64;
    let want: Vec<i64> = (0..3)
        .map(|p| slot(&t2, p))
        .chain((0..6).map(|p| slot(&t1, p)))
        .collect();
    assert_eq!(&ob.slot_mapping[..9], &want[..]);
    assert_eq!(&ob.block_tables[0..1], &[t2[0] as i32]);
    assert_eq!(
        &ob.block_tables[1..4],
        &[-1, -1, -1],
        "columns past a row's blocks are untouched"
    );
    assert_eq!(&ob.block_tables[4..6], &[t1[0] as i32, t1[1] as i32]);
    assert_eq!(&ob.seq_lens[..2], &[3, 6]);
    assert_eq!(&ob.query_start_loc[..3], &[0, 3, 9]);
    assert_eq!(&ob.kv_indptr[..3], &[0, 1, 3]);
    assert_eq!(
        &ob.kv_indices[..3],
        &[t2[0] as i32, t1[0] as i32, t1[1] as i32]
    );
    assert_eq!(&ob.kv_last_page_len[..2], &[3, 2]);

    // Decode: one token each, seq 2 crosses into a new block.
    m.append_batch(&[1, 2], &[100, 101]).unwrap();
    m.append_batch(&[1, 2], &[102, 103]).unwrap();
    let t2 = m.block_table(2).unwrap().to_vec();
    assert_eq!(t2.len(), 2);
    let info = m.build_step(&[1, 2], &[1, 1], &mut ob.view()).unwrap();
    assert_eq!(info.num_tokens, 2);
    assert_eq!(&ob.slot_mapping[..2], &[slot(&t1, 7), slot(&t2, 4)]);
    assert_eq!(&ob.seq_lens[..2], &[8, 5]);
    assert_eq!(&ob.query_start_loc[..3], &[0, 1, 2]);
    assert_eq!(&ob.kv_indptr[..3], &[0, 2, 4]);
    assert_eq!(&ob.kv_last_page_len[..2], &[4, 1]);
    // An empty batch is a valid (empty) step.
    let info = m.build_step(&[], &[], &mut ob.view()).unwrap();
    assert_eq!(info, StepInfo::default());
    m.check_invariants().unwrap();
}

/// `max_query_len` is the largest per-sequence new-token count, i.e. the largest step of
/// `query_start_loc`: a prefill chunk beside decodes, a decode-only step, an empty step.
#[test]
fn build_step_max_query_len() {
    let mut m = mgr(32, 4);
    m.admit(1, &toks(9, 1)).unwrap();
    m.admit(2, &toks(5, 2)).unwrap();
    m.admit(3, &toks(13, 3)).unwrap();
    let mut ob = OwnedStepBuffers::new(layout(4, 32, 8));
    // Sequence 1 decodes, 3 runs a 7-token prefill chunk, 2 a 5-token one (its whole prompt).
    let info = m
        .build_step(&[1, 3, 2], &[1, 7, 5], &mut ob.view())
        .unwrap();
    assert_eq!(&ob.query_start_loc[..4], &[0, 1, 8, 13]);
    let widest = ob.query_start_loc[..4]
        .windows(2)
        .map(|w| (w[1] - w[0]) as usize)
        .max()
        .unwrap();
    assert_eq!((info.max_query_len, widest), (7, 7));
    assert_eq!((info.num_tokens, info.max_seq_len), (13, 13));

    let info = m
        .build_step(&[2, 1, 3], &[1, 1, 1], &mut ob.view())
        .unwrap();
    assert_eq!(info.max_query_len, 1);

    let info = m.build_step(&[], &[], &mut ob.view()).unwrap();
    assert_eq!(info, StepInfo::default());
    assert_eq!(info.max_query_len, 0);
    m.check_invariants().unwrap();
}

#[test]
fn build_step_partial_new_tokens_span_blocks() {
    let mut m = mgr(16, 4);
    m.admit(1, &toks(3, 0)).unwrap();
    m.append(1, &toks(10, 0)).unwrap();
    let t = m.block_table(1).unwrap().to_vec();
    let mut ob = OwnedStepBuffers::new(layout(2, 16, 8));
    m.build_step(&[1], &[10], &mut ob.view()).unwrap();
    let want: Vec<i64> = (3..13)
        .map(|p| (t[p / 4] * 4) as i64 + (p % 4) as i64)
        .collect();
    assert_eq!(&ob.slot_mapping[..10], &want[..]);
}

#[test]
fn build_step_errors_write_nothing() {
    let mut m = mgr(32, 4);
    m.admit(1, &toks(9, 0)).unwrap(); // 3 blocks
    m.admit(2, &toks(4, 0)).unwrap(); // 1 block
    let mut ob = OwnedStepBuffers::new(layout(2, 13, 3));
    let sentinel = |ob: &mut OwnedStepBuffers| {
        ob.slot_mapping.fill(-7);
        ob.block_tables.fill(-7);
        ob.seq_lens.fill(-7);
        ob.query_start_loc.fill(-7);
        ob.kv_indptr.fill(-7);
        ob.kv_indices.fill(-7);
        ob.kv_last_page_len.fill(-7);
        ob.copies.fill(-7);
    };
    let untouched = |ob: &OwnedStepBuffers| {
        ob.slot_mapping.iter().all(|&x| x == -7)
            && ob.block_tables.iter().all(|&x| x == -7)
            && ob.seq_lens.iter().all(|&x| x == -7)
            && ob.query_start_loc.iter().all(|&x| x == -7)
            && ob.kv_indptr.iter().all(|&x| x == -7)
            && ob.kv_indices.iter().all(|&x| x == -7)
            && ob.kv_last_page_len.iter().all(|&x| x == -7)
    };
    type Case = (Vec<SeqId>, Vec<u32>, fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        (vec![1, 2], vec![1], |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "num_new.len",
                    ..
                }
            )
        }),
        (vec![1, 5], vec![1, 1], |e| {
            *e == Error::UnknownSequence { seq_id: 5 }
        }),
        (vec![1, 1], vec![1, 1], |e| {
            matches!(e, Error::InvalidArgument { what: "seqs", .. })
        }),
        (vec![1, 2], vec![0, 1], |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "num_new",
                    ..
                }
            )
        }),
        (vec![1, 2], vec![1, 5], |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "num_new",
                    ..
                }
            )
        }),
    ];
    for (seqs, nn, check) in cases {
        sentinel(&mut ob);
        expect_err(&mut m, |m| m.build_step(&seqs, &nn, &mut ob.view()), check);
        assert!(untouched(&ob));
    }
    // Buffer sizes, one at a time.
    let mut shrink = |f: fn(&mut OwnedStepBuffers), buffer: &'static str| {
        let mut small = OwnedStepBuffers::new(layout(2, 13, 3));
        sentinel(&mut small);
        f(&mut small);
        expect_err(
            &mut m,
            |m| m.build_step(&[1, 2], &[9, 4], &mut small.view()),
            |e| matches!(e, Error::BufferTooSmall { buffer: b, .. } if *b == buffer),
        );
        assert!(untouched(&small), "{buffer}: something was written");
    };
    shrink(|o| o.slot_mapping.truncate(12), "slot_mapping");
    shrink(|o| o.seq_lens.truncate(1), "seq_lens");
    shrink(|o| o.query_start_loc.truncate(2), "query_start_loc");
    shrink(|o| o.kv_indptr.truncate(2), "kv_indptr");
    shrink(|o| o.kv_indices.truncate(3), "kv_indices");
    shrink(|o| o.kv_last_page_len.truncate(1), "kv_last_page_len");
    shrink(|o| o.block_tables.truncate(5), "block_tables");
    shrink(|o| o.block_table_stride = 2, "block_table_stride");
    // The full batch fits exactly.
    let info = m.build_step(&[1, 2], &[9, 4], &mut ob.view()).unwrap();
    assert_eq!((info.num_tokens, info.num_kv_indices), (13, 4));
}

#[test]
fn registered_buffers_enforce_the_layout() {
    let mut m = mgr(32, 4);
    for s in 0..3 {
        m.admit(s, &toks(5, 0)).unwrap();
    }
    let l = layout(2, 16, 4);
    let mut ob = OwnedStepBuffers::new(l);
    let raw = ob.raw();
    let mut reg = RegisteredBuffers::new(l, raw).unwrap();
    // Three sequences do not fit a two-row layout.
    let before = snap(&m);
    let err = m
        .build_step(&[0, 1, 2], &[1, 1, 1], &mut unsafe {
            reg.as_step_buffers()
        })
        .unwrap_err();
    assert_eq!(
        err,
        Error::BufferTooSmall {
            buffer: "seq_lens",
            needed: 3,
            capacity: 2
        }
    );
    assert_eq!(snap(&m), before);
    let info = m
        .build_step(&[2, 0], &[5, 5], &mut unsafe { reg.as_step_buffers() })
        .unwrap();
    assert_eq!(info.num_tokens, 10);
    // No view is alive any more: read the memory back through its owner.
    assert_eq!(&ob.seq_lens[..2], &[5, 5]);
    assert_eq!(&ob.query_start_loc[..3], &[0, 5, 10]);
    assert_eq!(ob.slot_mapping[0], m.block_table(2).unwrap()[0] as i64 * 4);
}

// ---------------------------------------------------------------- stats and invariants

#[test]
fn stats_track_usage_and_histogram() {
    let mut m = mgr(100, 4);
    m.admit(1, &toks(1, 0)).unwrap(); // 1 block
    m.admit(2, &toks(8, 0)).unwrap(); // 2
    m.admit(3, &toks(17, 0)).unwrap(); // 5
    m.admit(4, &toks(20, 0)).unwrap(); // 5
    let s = m.stats();
    assert_eq!(s.num_blocks, 100);
    assert_eq!(s.num_seqs, 4);
    assert_eq!(s.used_blocks, 13);
    assert_eq!(s.free_blocks, 87);
    assert_eq!(s.cached_free_blocks, 0);
    assert_eq!(s.used_tokens, 46);
    assert!((s.kv_utilization - 46.0 / 400.0).abs() < 1e-12);
    assert_eq!(s.allocated_token_slots, 52);
    assert_eq!(s.blocks_per_seq.iter().sum::<u64>(), 4);
    assert_eq!(s.blocks_per_seq[hist_bucket(1)], 1);
    assert_eq!(s.blocks_per_seq[hist_bucket(2)], 1);
    assert_eq!(s.blocks_per_seq[hist_bucket(5)], 2);
    assert_eq!(
        (s.shared_blocks, s.cow_copies, s.preemptions, s.evictions),
        (0, 0, 0, 0)
    );
    assert_eq!(s.prefix_hit_ratio, 0.0);
}

#[test]
fn check_invariants_holds_through_a_workload() {
    let mut m = mgr(64, 4);
    let mut ob = OwnedStepBuffers::new(layout(8, 256, 64));
    for s in 0..6u64 {
        m.admit(s, &toks(1 + 7 * s as usize, s as u32)).unwrap();
        m.check_invariants().unwrap();
    }
    for round in 0..20u32 {
        let live: Vec<SeqId> = m.seq_ids().collect();
        let toks_: Vec<u32> = live.iter().map(|&s| s as u32 + round).collect();
        m.append_batch(&live, &toks_).unwrap();
        m.build_step(&live, &vec![1; live.len()], &mut ob.view())
            .unwrap();
        m.check_invariants().unwrap();
        if round % 5 == 4 {
            m.free(live[0]).unwrap();
            m.check_invariants().unwrap();
        }
    }
}

#[test]
fn csr_is_skipped_when_its_buffers_are_empty() {
    let mut m = mgr(16, 4);
    m.admit(1, &toks(6, 0)).unwrap();
    let mut ob = OwnedStepBuffers::new(layout(2, 8, 4));
    ob.kv_indptr.clear();
    ob.kv_indices.clear();
    ob.kv_last_page_len.clear();
    let info = m.build_step(&[1], &[6], &mut ob.view()).unwrap();
    assert_eq!((info.num_tokens, info.num_kv_indices), (6, 0));
    assert_eq!(&ob.query_start_loc[..2], &[0, 6]);
    // Only some of them empty is a size error, not a skip.
    let mut ob = OwnedStepBuffers::new(layout(2, 8, 4));
    ob.kv_indices.clear();
    expect_err(
        &mut m,
        |m| m.build_step(&[1], &[6], &mut ob.view()),
        |e| {
            matches!(
                e,
                Error::BufferTooSmall {
                    buffer: "kv_indices",
                    ..
                }
            )
        },
    );
}

#[test]
fn repeated_batches_follow_admissions_and_frees() {
    // The same batch slice is resolved once and reused; any admit/free/fork must invalidate that.
    let mut m = mgr(64, 4);
    let mut ob = OwnedStepBuffers::new(layout(4, 64, 16));
    m.admit(1, &toks(3, 0)).unwrap();
    m.admit(2, &toks(5, 0)).unwrap();
    m.append_batch(&[1, 2], &[0, 0]).unwrap();
    m.build_step(&[1, 2], &[1, 1], &mut ob.view()).unwrap();
    assert_eq!(&ob.seq_lens[..2], &[4, 6]);
    m.free(2).unwrap();
    expect_err(
        &mut m,
        |m| m.append_batch(&[1, 2], &[0, 0]),
        |e| *e == Error::UnknownSequence { seq_id: 2 },
    );
    m.admit(3, &toks(9, 0)).unwrap(); // likely reuses seq 2's slot
    m.admit(2, &toks(1, 0)).unwrap();
    m.append_batch(&[1, 2], &[0, 0]).unwrap();
    m.build_step(&[1, 2], &[1, 1], &mut ob.view()).unwrap();
    assert_eq!(&ob.seq_lens[..2], &[5, 2]);
    assert_eq!(m.seq_len(3).unwrap(), 9);
    m.fork(1, 4).unwrap();
    m.free(1).unwrap();
    expect_err(
        &mut m,
        |m| m.build_step(&[1, 2], &[1, 1], &mut ob.view()),
        |e| *e == Error::UnknownSequence { seq_id: 1 },
    );
    m.build_step(&[4, 2], &[1, 1], &mut ob.view()).unwrap();
    assert_eq!(&ob.seq_lens[..2], &[5, 2]);
    m.check_invariants().unwrap();
}

// ---------------------------------------------------------------- hash maps under structured keys

/// Sequence ids that pack a request id above a sample index (`i << 32`) keep the id index at
/// about one probe group per key (counted by replaying the table's probes, not timed); the
/// previous one-multiply hasher sent every such id to one bucket.
#[test]
fn structured_seq_ids_keep_the_index_flat() {
    let n = 80_000u64;
    let mut c = ManagerConfig::new(n as u32 + 1, 16);
    c.watermark_blocks = 0;
    let mut m = BlockManager::new(c).unwrap();
    for i in 0..n {
        m.admit(i << 32, &[i as u32]).unwrap();
    }
    let (index, _) = m.map_probe_costs();
    assert!(index < 1.5, "{index} probe groups per sequence id");
    // A decode step over 256 of them resolves every id once.
    let batch: Vec<SeqId> = (0..256u64).map(|i| i << 32).collect();
    m.append_batch(&batch, &[1; 256]).unwrap();
    m.check_invariants().unwrap();
}

/// Block hashes crafted to defeat a weak integer hash (halves that cancel, zero low bits) keep
/// the prefix map flat too.
#[test]
fn crafted_block_hashes_keep_the_prefix_map_flat() {
    use pagedkv::prefix::PrefixCache;
    let n = 48_000u32;
    for craft in [
        (|i: u128| (i << 64) | i) as fn(u128) -> u128,
        |i| i << 40,
        |i| i << 96,
    ] {
        let mut p = PrefixCache::new(n, 1, false, true);
        for b in 0..n {
            assert!(p.register(b, craft(b as u128), &[0]));
        }
        let cost = p.map_probe_cost();
        assert!(cost < 1.5, "{cost} probe groups per block hash");
    }
}

// ---------------------------------------------------------------- allocation failures

/// A pool whose verify copy cannot exist on any 64-bit host (2^64 bytes of token ids) is a typed
/// error naming the array and the bytes asked for, not an abort; nothing is left allocated.
#[test]
fn impossible_allocation_is_a_typed_error() {
    let mut c = ManagerConfig::new(i32::MAX as u32, i32::MAX as u32);
    c.max_blocks_per_seq = 1;
    c.validate().unwrap();
    assert!(c.verify_prefix);
    match BlockManager::new(c) {
        Err(Error::AllocationFailed { what, bytes }) => {
            assert!(what.contains("verify_prefix"), "{what}");
            assert_eq!(bytes, (i32::MAX as u64).pow(2) * 4);
            let msg = Error::AllocationFailed { what, bytes }.to_string();
            assert!(msg.contains(&bytes.to_string()), "{msg}");
        }
        other => panic!("expected AllocationFailed, got {:?}", other.map(|_| ())),
    }
}

/// 2^26 blocks with verify on (4 GiB of token ids, committed lazily): builds, or fails with
/// `AllocationFailed` on a host too small for it; never aborts. (The documented maximum,
/// 2^31 - 1 one-token blocks, is left out: on a large host it would build and write tens of GiB.)
#[test]
fn large_pools_build_or_fail_typed() {
    for (n, bs) in [(1u32 << 26, 16u32)] {
        match BlockManager::new(ManagerConfig::new(n, bs)) {
            Ok(m) => assert_eq!(m.num_free_blocks(), n as usize),
            Err(Error::AllocationFailed { bytes, .. }) => assert!(bytes > 0),
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}
