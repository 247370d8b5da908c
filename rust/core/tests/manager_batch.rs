//! What a scheduler needs from the manager beyond one-at-a-time calls: chunked admission that
//! hits the prefix cache, `can_admit` counting hits, `admit_batch` / `free_batch`, and
//! `reset_prefix_cache`. Every error case asserts the manager is exactly as before.

mod common;

use common::expect_err_unchanged;
use pagedkv::hash::SeqKeys;
use pagedkv::manager::{AdmitRequest, AdmitResult, BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::{BlockId, Error, SeqId};

#[derive(Debug, PartialEq)]
struct Snap {
    seqs: Vec<(SeqId, usize, Vec<BlockId>)>,
    refcounts: Vec<u32>,
    free: usize,
    stats: pagedkv::metrics::Stats,
    hashes: Vec<Option<u128>>,
}

fn snap(m: &BlockManager) -> Snap {
    let mut seqs: Vec<_> = m
        .seq_ids()
        .map(|s| (s, m.seq_len(s).unwrap(), m.block_table(s).unwrap().to_vec()))
        .collect();
    seqs.sort();
    let n = m.config().num_blocks;
    Snap {
        seqs,
        refcounts: (0..n).map(|b| m.block_refcount(b).unwrap()).collect(),
        free: m.num_free_blocks(),
        stats: m.stats(),
        hashes: (0..n).map(|b| m.block_hash(b)).collect(),
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

fn mgr(num_blocks: u32, bs: u32, watermark: u32) -> BlockManager {
    let mut c = ManagerConfig::new(num_blocks, bs);
    c.watermark_blocks = watermark;
    BlockManager::new(c).unwrap()
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761).wrapping_add(seed) % 32000)
        .collect()
}

fn bufs(seqs: usize, tokens: usize, blocks: usize) -> OwnedStepBuffers {
    OwnedStepBuffers::new(StepLayout {
        max_seqs: seqs,
        max_tokens: tokens,
        max_blocks_per_seq: blocks,
        max_copies: 8,
        max_swaps: 4,
    })
}

/// Builds a step computing every token of `seq` not computed yet (`n` of them).
fn step(m: &mut BlockManager, ob: &mut OwnedStepBuffers, seq: SeqId, n: usize) {
    m.build_step(&[seq], &[n as u32], &mut ob.view()).unwrap();
}

/// Runs a whole chunked prefill of `prompt` as a scheduler would: admit holding at most `chunk`
/// new tokens, step, then append and step chunk by chunk. Returns the admission result.
fn chunked_prefill(
    m: &mut BlockManager,
    ob: &mut OwnedStepBuffers,
    seq: SeqId,
    prompt: &[u32],
    chunk: usize,
) -> AdmitResult {
    let r = m.admit_opts(seq, prompt, None, Some(chunk)).unwrap();
    let mut held = r.num_tokens as usize;
    step(m, ob, seq, held - r.cached_tokens as usize);
    while held < prompt.len() {
        let k = chunk.min(prompt.len() - held);
        m.append(seq, &prompt[held..held + k]).unwrap();
        step(m, ob, seq, k);
        held += k;
    }
    assert_eq!(m.seq_len(seq).unwrap(), prompt.len());
    r
}

#[test]
fn chunked_admission_of_a_cached_prompt_reuses_all_but_one_block() {
    let mut m = mgr(1024, 16, 1);
    let mut ob = bufs(4, 4096, 256);
    let prompt = toks(4096, 1);
    chunked_prefill(&mut m, &mut ob, 1, &prompt, 512);
    m.free(1).unwrap();

    // The lookup covers the whole prompt: 255 of 256 blocks hit (the last one is recomputed so
    // at least one token is), and the sequence holds cached + min(512, 16) tokens.
    let r = m.admit_opts(2, &prompt, None, Some(512)).unwrap();
    assert_eq!(
        r,
        AdmitResult {
            cached_tokens: 4080,
            cached_tokens_gpu: 4080,
            cached_tokens_host: 0,
            new_blocks: 1,
            num_blocks: 256,
            num_tokens: 4096
        }
    );
    m.check_invariants().unwrap();
    m.free(2).unwrap();

    // What admitting only the first chunk's tokens used to give: 496 tokens.
    let r = m.admit(3, &prompt[..512]).unwrap();
    assert_eq!(r.cached_tokens, 496);
    m.free(3).unwrap();

    // The cap uses the full prompt length: with 4096 + 8 tokens, all 256 full blocks hit.
    let mut longer = prompt.clone();
    longer.extend_from_slice(&[7; 8]);
    let r = m.admit_opts(4, &longer, None, Some(512)).unwrap();
    assert_eq!(
        (r.cached_tokens, r.num_tokens, r.new_blocks),
        (4096, 4104, 1)
    );
    m.check_invariants().unwrap();
}

#[test]
fn chunked_admission_holds_only_the_first_chunk() {
    let mut m = mgr(64, 4, 0);
    let prompt = toks(30, 2);
    let r = m.admit_opts(1, &prompt, None, Some(8)).unwrap();
    assert_eq!(
        r,
        AdmitResult {
            cached_tokens: 0,
            cached_tokens_gpu: 0,
            cached_tokens_host: 0,
            new_blocks: 2,
            num_blocks: 2,
            num_tokens: 8
        }
    );
    assert_eq!(m.seq_len(1).unwrap(), 8);
    assert_eq!(m.stats().used_tokens, 8);
    // A chunk larger than the prompt holds it all.
    let r = m.admit_opts(2, &prompt, None, Some(100)).unwrap();
    assert_eq!((r.num_tokens, r.num_blocks), (30, 8));
    m.check_invariants().unwrap();
}

#[test]
fn chunks_become_cacheable_when_their_step_is_built() {
    let mut m = mgr(1024, 16, 1);
    let mut ob = bufs(8, 4096, 256);
    let prompt = toks(4096, 3);
    let r = m.admit_opts(1, &prompt, None, Some(512)).unwrap();
    assert_eq!((r.cached_tokens, r.num_tokens), (0, 512));

    // Before chunk 1's step: nothing of it is cached.
    let r = m.admit_opts(2, &prompt, None, Some(512)).unwrap();
    assert_eq!(r.cached_tokens, 0);
    m.free(2).unwrap();

    step(&mut m, &mut ob, 1, 512);
    let r = m.admit_opts(3, &prompt, None, Some(512)).unwrap();
    assert_eq!((r.cached_tokens, r.num_tokens), (512, 1024));
    m.free(3).unwrap();

    // Chunk 2 appended but not stepped: still only chunk 1's blocks hit.
    m.append(1, &prompt[512..1024]).unwrap();
    let r = m.admit_opts(4, &prompt, None, Some(512)).unwrap();
    assert_eq!(r.cached_tokens, 512);
    m.free(4).unwrap();
    step(&mut m, &mut ob, 1, 512);
    let r = m.admit_opts(5, &prompt, None, Some(512)).unwrap();
    assert_eq!(r.cached_tokens, 1024);
    // Shared, not copied: the two tables start with the same 64 blocks.
    assert_eq!(
        m.block_table(5).unwrap()[..64],
        m.block_table(1).unwrap()[..64]
    );
    m.check_invariants().unwrap();
}

#[test]
fn chunked_admission_rejects_bad_arguments_unchanged() {
    let mut m = mgr(16, 4, 0);
    m.admit(1, &toks(5, 0)).unwrap();
    expect_err(
        &mut m,
        |m| m.admit_opts(2, &toks(5, 0), None, Some(0)),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "max_new_tokens",
                    ..
                }
            )
        },
    );
    // The whole prompt must fit a row, even if the first chunk would.
    expect_err(
        &mut m,
        |m| m.admit_opts(2, &toks(65, 0), None, Some(4)),
        |e| {
            matches!(
                e,
                Error::SequenceTooLong {
                    needed_blocks: 17,
                    ..
                }
            )
        },
    );
    expect_err(
        &mut m,
        |m| m.admit_opts(1, &toks(5, 0), None, Some(4)),
        |e| matches!(e, Error::DuplicateSequence { seq_id: 1 }),
    );
    // The watermark applies to the held chunk only.
    let mut m = mgr(8, 4, 2);
    assert!(m.admit_opts(1, &toks(32, 0), None, Some(24)).is_ok());
    assert_eq!(m.num_free_blocks(), 2);
}

#[test]
fn can_admit_counts_prefix_hits() {
    // 256 blocks for the running prompt, 2 spare, watermark 1.
    let mut m = mgr(259, 16, 1);
    let mut ob = bufs(2, 4096, 256);
    let prompt = toks(4096, 4);
    m.admit(1, &prompt).unwrap();
    step(&mut m, &mut ob, 1, 4096);
    assert_eq!(m.num_free_blocks(), 3);
    assert!(!m.can_admit(4096), "by length alone it does not fit");
    assert!(m.can_admit_tokens(&prompt, None, None).unwrap());
    assert!(
        !m.can_admit_tokens(&toks(4096, 5), None, None).unwrap(),
        "another prompt hits nothing"
    );
    let salted = SeqKeys {
        cache_salt: b"tenant".to_vec(),
        ..Default::default()
    };
    assert!(
        !m.can_admit_tokens(&prompt, Some(&salted), None).unwrap(),
        "another salt hits nothing"
    );
    assert_eq!(m.can_admit_len(4096, Some(32)), Ok(true));
    assert_eq!(m.can_admit_len(4096, Some(33)), Ok(false));
    let before = snap(&m);
    let r = m.admit(2, &prompt).unwrap();
    assert_eq!((r.cached_tokens, r.new_blocks), (4080, 1));
    m.check_invariants().unwrap();
    m.free(2).unwrap();
    assert_eq!(snap(&m).refcounts, before.refcounts);
    assert_eq!(
        m.can_admit_tokens(&prompt, None, Some(0)),
        Err(Error::InvalidArgument {
            what: "max_new_tokens",
            value: 0,
            reason: "must be >= 1 (at least one prompt token is computed)".into()
        })
    );
    assert_eq!(m.can_admit_tokens(&[], None, None), Ok(false));
    assert_eq!(m.can_admit_len(0, None), Ok(false));
}

#[test]
fn can_admit_counts_revived_cached_free_blocks_as_taken() {
    // The prompt's blocks are all cached-free: a hit revives them, and each revived block leaves
    // the free count as a new one would.
    let mut m = mgr(300, 16, 10);
    let mut ob = bufs(2, 4096, 256);
    let prompt = toks(4096, 6);
    m.admit(1, &prompt).unwrap();
    step(&mut m, &mut ob, 1, 4096);
    m.free(1).unwrap();
    // Occupy blocks until 256 + watermark - 1 are left: 255 revived + 1 new + 10 > 265.
    m.admit(9, &toks(35 * 16 - 1 + 1, 7)).unwrap();
    assert_eq!(m.num_free_blocks(), 265);
    assert!(!m.can_admit_tokens(&prompt, None, None).unwrap());
    expect_err(
        &mut m,
        |m| m.admit(2, &prompt),
        |e| matches!(e, Error::WatermarkReached { needed: 256, .. }),
    );
    m.free(9).unwrap();
    m.admit(9, &toks(34 * 16, 7)).unwrap();
    assert_eq!(m.num_free_blocks(), 266);
    assert!(m.can_admit_tokens(&prompt, None, None).unwrap());
    let r = m.admit(2, &prompt).unwrap();
    assert_eq!((r.cached_tokens, r.new_blocks), (4080, 1));
    assert_eq!(m.num_free_blocks(), 10);
    m.check_invariants().unwrap();
}

#[test]
fn admit_batch_validates_everything_first() {
    let mut m = mgr(64, 4, 0);
    m.admit(1, &toks(5, 0)).unwrap();
    let (a, b, long) = (toks(8, 1), toks(8, 2), toks(300, 3));
    let salt = SeqKeys {
        mm_inputs: vec![pagedkv::hash::MmInput {
            start: 4,
            end: 40,
            hash: vec![1],
        }],
        ..Default::default()
    };
    let req = AdmitRequest::new;
    type Case<'a> = (Vec<AdmitRequest<'a>>, fn(&Error) -> bool);
    let cases: Vec<Case<'_>> = vec![
        (vec![req(2, &a), req(1, &b)], |e| {
            matches!(e, Error::DuplicateSequence { seq_id: 1 })
        }),
        (vec![req(2, &a), req(2, &b)], |e| {
            matches!(e, Error::DuplicateSequence { seq_id: 2 })
        }),
        (vec![req(2, &a), req(3, &[])], |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "tokens.len",
                    ..
                }
            )
        }),
        (vec![req(2, &a), req(3, &long)], |e| {
            matches!(e, Error::SequenceTooLong { seq_id: 3, .. })
        }),
        (
            vec![
                req(2, &a),
                AdmitRequest {
                    max_new_tokens: Some(0),
                    ..req(3, &b)
                },
            ],
            |e| {
                matches!(
                    e,
                    Error::InvalidArgument {
                        what: "max_new_tokens",
                        ..
                    }
                )
            },
        ),
        (
            vec![
                req(2, &a),
                AdmitRequest {
                    keys: Some(&salt),
                    ..req(3, &b)
                },
            ],
            |e| {
                matches!(
                    e,
                    Error::InvalidArgument {
                        what: "mm_input.end",
                        ..
                    }
                )
            },
        ),
    ];
    for (reqs, check) in cases {
        expect_err(&mut m, |m| m.admit_batch(&reqs), check);
    }
}

#[test]
fn admit_batch_admits_in_order_until_one_does_not_fit() {
    let mut m = mgr(20, 4, 2);
    let p: Vec<Vec<u32>> = (0..5).map(|i| toks(20, i)).collect(); // 5 blocks each
    let reqs: Vec<AdmitRequest<'_>> = p
        .iter()
        .enumerate()
        .map(|(i, t)| AdmitRequest::new(i as SeqId, t))
        .collect();
    // 18 blocks above the watermark: three prompts fit, the fourth does not, so the fifth is
    // not tried either (order is the scheduler's priority).
    let r = m.admit_batch(&reqs).unwrap();
    assert_eq!(r.len(), 3);
    assert!(r.iter().all(|a| a.num_blocks == 5 && a.num_tokens == 20));
    assert_eq!(m.num_seqs(), 3);
    assert!(!m.contains(3) && !m.contains(4));
    m.check_invariants().unwrap();
    // Chunked: each holds 4 tokens (1 block), so the rest fit too.
    let more: Vec<AdmitRequest<'_>> = reqs[3..]
        .iter()
        .map(|r| AdmitRequest {
            max_new_tokens: Some(4),
            ..*r
        })
        .collect();
    let r = m.admit_batch(&more).unwrap();
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|a| a.num_tokens == 4 && a.new_blocks == 1));
    // Nothing fits: an empty result, not an error.
    assert_eq!(
        m.admit_batch(&[AdmitRequest::new(9, &p[0])]).unwrap(),
        vec![]
    );
    assert_eq!(m.admit_batch(&[]).unwrap(), vec![]);
    m.check_invariants().unwrap();
}

#[test]
fn free_batch_validates_then_frees_all() {
    let mut m = mgr(32, 4, 0);
    for s in 0..4 {
        m.admit(s, &toks(9, s as u32)).unwrap();
    }
    expect_err(
        &mut m,
        |m| m.free_batch(&[0, 7]),
        |e| matches!(e, Error::UnknownSequence { seq_id: 7 }),
    );
    expect_err(
        &mut m,
        |m| m.free_batch(&[0, 1, 0]),
        |e| {
            matches!(
                e,
                Error::InvalidArgument {
                    what: "seqs",
                    value: 0,
                    ..
                }
            )
        },
    );
    m.free_batch(&[2, 0]).unwrap();
    assert_eq!(m.num_seqs(), 2);
    assert!(m.contains(1) && m.contains(3));
    m.free_batch(&[]).unwrap();
    m.free_batch(&[1, 3]).unwrap();
    assert_eq!(m.num_free_blocks(), 32);
    m.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_forgets_every_hash() {
    let mut m = mgr(64, 4, 0);
    let mut ob = bufs(4, 64, 16);
    let (a, b) = (toks(17, 1), toks(12, 2));
    m.admit(1, &a).unwrap();
    m.admit(2, &b).unwrap();
    m.build_step(&[1, 2], &[17, 12], &mut ob.view()).unwrap();
    m.free(1).unwrap(); // 4 full blocks cached-free, its tail block free
    let st = m.stats();
    assert_eq!(st.cached_free_blocks, 4);
    // 4 cached-free (seq 1) + 3 held by seq 2.
    assert_eq!(m.reset_prefix_cache(), Ok(7));
    let st = m.stats();
    assert_eq!((st.cached_free_blocks, st.free_blocks), (0, 61));
    assert!(m.block_hashes_all_none());
    m.check_invariants().unwrap();
    assert_eq!(m.admit(3, &a).unwrap().cached_tokens, 0);
    assert_eq!(m.admit(4, &b).unwrap().cached_tokens, 0);
    // Seq 2's blocks are not offered again; freeing it returns them to the free list.
    m.build_step(&[2], &[12], &mut ob.view()).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 0);
    assert_eq!(m.reset_prefix_cache(), Ok(0));
    m.check_invariants().unwrap();
}

trait AllNone {
    fn block_hashes_all_none(&self) -> bool;
}

impl AllNone for BlockManager {
    fn block_hashes_all_none(&self) -> bool {
        (0..self.config().num_blocks).all(|b| self.block_hash(b).is_none())
    }
}
