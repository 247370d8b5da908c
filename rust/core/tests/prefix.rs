//! Prefix caching, LRU eviction, copy-on-write forks: exact block accounting in each case, with the
//! manager's invariants checked after every operation.

use pagedkv::hash::{prompt_hashes, MmInput, SeqKeys};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::{BlockId, Error, SeqId};

const B: u32 = 4;

fn mgr(num_blocks: u32, watermark: u32) -> BlockManager {
    let mut c = ManagerConfig::new(num_blocks, B);
    c.watermark_blocks = watermark;
    BlockManager::new(c).unwrap()
}

fn bufs() -> OwnedStepBuffers {
    OwnedStepBuffers::new(StepLayout {
        max_seqs: 16,
        max_tokens: 1024,
        max_blocks_per_seq: 64,
        max_copies: 16,
    })
}

/// Runs a step computing every given sequence's whole length (a prefill of uncached tokens).
fn step_all(m: &mut BlockManager, seqs: &[SeqId]) -> pagedkv::step::StepInfo {
    let lens: Vec<u32> = seqs.iter().map(|&s| m.seq_len(s).unwrap() as u32).collect();
    let mut ob = bufs();
    let info = m.build_step(seqs, &lens, &mut ob.view()).unwrap();
    m.check_invariants().unwrap();
    info
}

fn table(m: &BlockManager, s: SeqId) -> Vec<BlockId> {
    m.block_table(s).unwrap().to_vec()
}

fn used(m: &BlockManager) -> u64 {
    m.stats().used_blocks
}

fn prompt(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| i * 31 + seed).collect()
}

// ---------------------------------------------------------------- hits

#[test]
fn hit_after_step_and_free() {
    let mut m = mgr(16, 0);
    let p = prompt(10, 1); // two full blocks and a partial one
    assert_eq!(m.admit(1, &p).unwrap().cached_tokens, 0);
    step_all(&mut m, &[1]);
    let ta = table(&m, 1);
    m.free(1).unwrap();
    m.check_invariants().unwrap();
    let s = m.stats();
    assert_eq!(
        s.cached_free_blocks, 2,
        "full blocks stay cached, the partial one is freed"
    );
    assert_eq!(s.free_blocks, 14);
    assert_eq!(m.num_free_blocks(), 16);

    let r = m.admit(2, &p).unwrap();
    assert_eq!((r.cached_tokens, r.new_blocks, r.num_blocks), (8, 1, 3));
    let tb = table(&m, 2);
    assert_eq!(&tb[..2], &ta[..2], "the cached blocks are reused");
    let s = m.stats();
    assert_eq!(s.cached_free_blocks, 0);
    assert_eq!(s.used_blocks, 3);
    assert_eq!((s.prefix_query_tokens, s.prefix_hit_tokens), (20, 8));
    assert!((s.prefix_hit_ratio - 0.4).abs() < 1e-12);
    m.check_invariants().unwrap();

    // A prompt sharing only the first block hits only that block.
    let mut q = p.clone();
    q[5] = 999;
    let r = m.admit(3, &q).unwrap();
    assert_eq!(r.cached_tokens, 4);
    assert_eq!(table(&m, 3)[0], ta[0]);
    assert_eq!(m.block_refcount(ta[0]).unwrap(), 2);
    assert_eq!(m.stats().shared_blocks, 1);
    m.check_invariants().unwrap();
}

#[test]
fn nothing_is_cached_before_a_step_schedules_it() {
    let mut m = mgr(16, 0);
    let p = prompt(12, 2);
    m.admit(1, &p).unwrap();
    m.free(1).unwrap();
    assert_eq!(
        m.stats().cached_free_blocks,
        0,
        "never computed, so never cached"
    );
    assert_eq!(m.admit(2, &p).unwrap().cached_tokens, 0);
    // Tokens appended but not yet stepped are not cached either.
    m.append(2, &prompt(4, 3)).unwrap();
    step_all(&mut m, &[2]); // registers blocks 0..4
    m.append(2, &prompt(4, 5)).unwrap(); // block 4 full, unscheduled
    m.free(2).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 4);
    m.check_invariants().unwrap();
}

#[test]
fn fully_cached_prompt_recomputes_its_last_block() {
    let mut m = mgr(16, 0);
    let p = prompt(8, 4);
    m.admit(1, &p).unwrap();
    step_all(&mut m, &[1]);
    let ta = table(&m, 1);
    m.free(1).unwrap();
    let r = m.admit(2, &p).unwrap();
    assert_eq!(
        (r.cached_tokens, r.new_blocks),
        (4, 1),
        "at least one token is computed"
    );
    let tb = table(&m, 2);
    assert_eq!(tb[0], ta[0]);
    assert_ne!(
        tb[1], ta[1],
        "the last block is fresh, never written while shared"
    );
    assert_eq!(
        m.stats().cached_free_blocks,
        1,
        "the old copy of the last block stays cached"
    );
    step_all(&mut m, &[2]);
    assert_eq!(
        m.block_hash(tb[1]),
        None,
        "duplicate content stays unhashed"
    );
    m.free(2).unwrap();
    m.check_invariants().unwrap();
    let s = m.stats();
    assert_eq!((s.cached_free_blocks, s.free_blocks), (2, 14));
}

#[test]
fn live_sequences_share_and_the_last_owner_caches() {
    let mut m = mgr(16, 0);
    let p = prompt(9, 5);
    m.admit(1, &p).unwrap();
    step_all(&mut m, &[1]);
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 8);
    assert_eq!(used(&m), 4);
    assert_eq!(m.stats().shared_blocks, 2);
    m.free(1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.stats().shared_blocks, 0);
    assert_eq!(m.stats().cached_free_blocks, 0, "still owned by seq 2");
    m.free(2).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 2);
    m.check_invariants().unwrap();
}

#[test]
fn duplicate_content_never_corrupts_the_map() {
    let mut m = mgr(16, 0);
    let p = prompt(8, 6);
    m.admit(1, &p).unwrap();
    m.admit(2, &p).unwrap(); // nothing cached yet: separate blocks with the same content
    step_all(&mut m, &[1, 2]);
    let (ta, tb) = (table(&m, 1), table(&m, 2));
    assert!(m.block_hash(ta[0]).is_some() && m.block_hash(ta[1]).is_some());
    assert_eq!((m.block_hash(tb[0]), m.block_hash(tb[1])), (None, None));
    m.free(2).unwrap();
    assert_eq!(
        m.stats().cached_free_blocks,
        0,
        "unhashed duplicates go to the free list"
    );
    m.free(1).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 2);
    m.check_invariants().unwrap();
}

#[test]
fn keys_separate_cache_entries() {
    let mut m = mgr(64, 0);
    let p = prompt(12, 7);
    let base = SeqKeys::default();
    let variants = [
        SeqKeys {
            cache_salt: b"tenant".to_vec(),
            ..Default::default()
        },
        SeqKeys {
            adapter_id: Some(3),
            ..Default::default()
        },
        SeqKeys {
            extra: b"v2".to_vec(),
            ..Default::default()
        },
        SeqKeys {
            mm_inputs: vec![MmInput {
                start: 0,
                end: 2,
                hash: vec![1; 16],
            }],
            ..Default::default()
        },
    ];
    m.admit_with(100, &p, &base).unwrap();
    step_all(&mut m, &[100]);
    for (i, k) in variants.iter().enumerate() {
        let id = i as SeqId;
        assert_eq!(
            m.admit_with(id, &p, k).unwrap().cached_tokens,
            0,
            "keys {k:?} must not hit"
        );
        step_all(&mut m, &[id]);
        assert_eq!(
            m.admit_with(10 + id, &p, k).unwrap().cached_tokens,
            8,
            "same keys {k:?} must hit"
        );
    }
    // An mm input in block 1 only: block 0 is still shared with the plain prompt.
    let mm1 = SeqKeys {
        mm_inputs: vec![MmInput {
            start: 5,
            end: 7,
            hash: vec![2; 16],
        }],
        ..Default::default()
    };
    assert_eq!(m.admit_with(50, &p, &mm1).unwrap().cached_tokens, 4);
    // `admit` is `admit_with` default keys.
    assert_eq!(m.admit(51, &p).unwrap().cached_tokens, 8);
    m.check_invariants().unwrap();
    // Bad keys are rejected before anything changes.
    let bad = SeqKeys {
        mm_inputs: vec![MmInput {
            start: 4,
            end: 13,
            hash: vec![],
        }],
        ..Default::default()
    };
    let free = m.num_free_blocks();
    assert!(matches!(
        m.admit_with(52, &p, &bad),
        Err(Error::InvalidArgument {
            what: "mm_input.end",
            ..
        })
    ));
    assert_eq!(m.num_free_blocks(), free);
    assert!(!m.contains(52));
}

// ---------------------------------------------------------------- eviction and accounting

#[test]
fn eviction_takes_free_blocks_first_then_oldest_cached_tail_first() {
    let mut m = mgr(5, 0);
    m.admit(1, &prompt(12, 8)).unwrap();
    step_all(&mut m, &[1]);
    let ta = table(&m, 1);
    m.free(1).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 3);
    assert_eq!(m.stats().free_blocks, 2);
    // 4 new blocks: the 2 never-cached ones, then evict 2 in LRU order: the tail (ta[2]) first.
    m.admit(2, &prompt(16, 9)).unwrap();
    let tb = table(&m, 2);
    assert!(!ta.contains(&tb[0]) && !ta.contains(&tb[1]));
    assert_eq!(&tb[2..], &[ta[2], ta[1]]);
    let s = m.stats();
    assert_eq!(s.evictions, 2);
    assert_eq!(s.cached_free_blocks, 1);
    assert!(m.block_hash(ta[0]).is_some());
    assert_eq!((m.block_hash(ta[1]), m.block_hash(ta[2])), (None, None));
    m.check_invariants().unwrap();
    // The surviving prefix block still hits.
    m.free(2).unwrap();
    let r = m.admit(3, &prompt(12, 8)).unwrap();
    assert_eq!(r.cached_tokens, 4);
    assert_eq!(table(&m, 3)[0], ta[0]);
    m.check_invariants().unwrap();
}

#[test]
fn least_recently_freed_sequence_is_evicted_first() {
    let mut m = mgr(4, 0);
    m.admit(1, &prompt(4, 10)).unwrap();
    m.admit(2, &prompt(4, 11)).unwrap();
    step_all(&mut m, &[1, 2]);
    let (a, b) = (table(&m, 1)[0], table(&m, 2)[0]);
    m.free(2).unwrap();
    m.free(1).unwrap();
    m.admit(3, &prompt(12, 12)).unwrap(); // 2 free + 1 eviction: seq 2's block, freed first
    assert_eq!(m.block_hash(b), None);
    assert!(m.block_hash(a).is_some());
    assert_eq!(m.stats().evictions, 1);
    m.check_invariants().unwrap();
}

#[test]
fn revived_blocks_count_against_the_watermark() {
    let p = prompt(12, 13);
    for (wm, ok) in [(1, true), (2, false)] {
        let mut m = mgr(4, wm);
        // Admit one block and grow by appending (appends may use the reserve).
        m.admit(1, &p[..4]).unwrap();
        m.append(1, &p[4..]).unwrap();
        step_all(&mut m, &[1]);
        m.free(1).unwrap();
        // Hits 2 cached-free blocks (revived) and allocates 1: 3 of the 4 available.
        let before = (m.stats(), m.num_free_blocks());
        let r = m.admit(2, &p);
        if ok {
            assert_eq!(r.unwrap().cached_tokens, 8);
            assert_eq!(m.num_free_blocks(), 1);
        } else {
            assert_eq!(
                r.unwrap_err(),
                Error::WatermarkReached {
                    needed: 3,
                    available: 2,
                    watermark: 2
                }
            );
            assert_eq!((m.stats(), m.num_free_blocks()), before);
        }
        m.check_invariants().unwrap();
    }
}

// ---------------------------------------------------------------- verify mode

const SEED: u64 = 0x5eed_1234_abcd_0001;

fn forged(verify: bool) -> (BlockManager, u32) {
    let mut c = ManagerConfig::new(16, B);
    c.watermark_blocks = 0;
    c.verify_prefix = verify;
    c.hash_seed = Some(SEED);
    let mut m = BlockManager::new(c).unwrap();
    m.admit(1, &[1, 2, 3, 4, 5]).unwrap();
    step_all(&mut m, &[1]);
    let a0 = table(&m, 1)[0];
    m.free(1).unwrap();
    // Make block a0 (tokens 1,2,3,4) claim the hash of a different first block (9,9,9,9).
    let forged = prompt_hashes(SEED, &[9, 9, 9, 9, 5], B as usize, &SeqKeys::default())[0];
    assert!(m.debug_relabel_block(a0, forged));
    let r = m.admit(2, &[9, 9, 9, 9, 5]).unwrap();
    (m, r.cached_tokens)
}

#[test]
fn verify_mode_rejects_a_forged_collision() {
    // Without verification the forged entry is served: the hook really forges a collision.
    let (_, cached) = forged(false);
    assert_eq!(cached, 4);
    let (m, cached) = forged(true);
    assert_eq!(
        cached, 0,
        "verify mode must not serve a block whose tokens differ"
    );
    assert_eq!(m.stats().prefix_collisions, 1);
    m.check_invariants().unwrap();
}

/// Verify mode is the default: a forged collision on a default-configured manager is a miss,
/// counted, and the forged block is not served.
#[test]
fn verify_is_on_by_default() {
    let c = ManagerConfig::new(16, B);
    assert!(c.verify_prefix);
    let mut c = c;
    c.watermark_blocks = 0;
    c.hash_seed = Some(SEED);
    let mut m = BlockManager::new(c).unwrap();
    m.admit(1, &[1, 2, 3, 4, 5]).unwrap();
    step_all(&mut m, &[1]);
    let a0 = table(&m, 1)[0];
    m.free(1).unwrap();
    let h = prompt_hashes(SEED, &[9, 9, 9, 9, 5], B as usize, &SeqKeys::default())[0];
    assert!(m.debug_relabel_block(a0, h));
    assert_eq!(m.admit(2, &[9, 9, 9, 9, 5]).unwrap().cached_tokens, 0);
    assert_eq!(m.stats().prefix_collisions, 1);
    assert_ne!(
        table(&m, 2)[0],
        a0,
        "the forged block is not handed out as a hit"
    );
    m.check_invariants().unwrap();
}

// ---------------------------------------------------------------- hash keys

/// The block hashes of a one-sequence run of `p` on a manager with `seed`.
fn hashes_of(seed: Option<u64>, p: &[u32], salt: &[u8]) -> Vec<Option<u128>> {
    let mut c = ManagerConfig::new(16, B);
    c.watermark_blocks = 0;
    c.hash_seed = seed;
    let mut m = BlockManager::new(c).unwrap();
    let keys = SeqKeys {
        cache_salt: salt.to_vec(),
        ..Default::default()
    };
    m.admit_with(1, p, &keys).unwrap();
    step_all(&mut m, &[1]);
    table(&m, 1).iter().map(|&b| m.block_hash(b)).collect()
}

/// Without a configured key every manager draws its own: the same prompt is cached under
/// different, unpredictable hashes (none equals the public unkeyed chain), salt or not.
#[test]
fn default_hash_key_is_random_per_manager() {
    let p = prompt(9, 3);
    for salt in [&b""[..], b"tenant"] {
        let a = hashes_of(None, &p, salt);
        let b = hashes_of(None, &p, salt);
        assert!(a[0].is_some() && a[1].is_some() && a[2].is_none());
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        let keys = SeqKeys {
            cache_salt: salt.to_vec(),
            ..Default::default()
        };
        let public = prompt_hashes(0, &p, B as usize, &keys);
        assert_ne!(a[0], Some(public[0]));
        assert_ne!(a[1], Some(public[1]));
    }
}

/// An explicit key reproduces the same hashes in every manager, equal to `prompt_hashes` under
/// that key; another key changes every hash, the root included.
#[test]
fn explicit_hash_seed_is_reproducible() {
    let p = prompt(9, 3);
    let a = hashes_of(Some(SEED), &p, b"s");
    assert_eq!(a, hashes_of(Some(SEED), &p, b"s"));
    let keys = SeqKeys {
        cache_salt: b"s".to_vec(),
        ..Default::default()
    };
    let want = prompt_hashes(SEED, &p, B as usize, &keys);
    assert_eq!(a, vec![Some(want[0]), Some(want[1]), None]);
    let other = hashes_of(Some(SEED ^ 1), &p, b"s");
    assert_ne!(a[0], other[0]);
    assert_ne!(a[1], other[1]);
    assert_ne!(
        pagedkv::hash::root_hash(SEED, b"s"),
        pagedkv::hash::root_hash(SEED ^ 1, b"s")
    );
}

// ---------------------------------------------------------------- fork and copy-on-write

/// `n` samples forked from a 10-token prompt (3 blocks, partial tail), each decoding one token.
#[test]
fn parallel_samples_cost_prompt_blocks_plus_one_tail_each() {
    for n in [1usize, 2, 5] {
        let mut m = mgr(64, 0);
        m.admit(0, &prompt(10, 14)).unwrap();
        step_all(&mut m, &[0]);
        let tail = *table(&m, 0).last().unwrap();
        let kids: Vec<SeqId> = (1..=n as u64).collect();
        for &k in &kids {
            m.fork(0, k).unwrap();
            m.check_invariants().unwrap();
        }
        assert_eq!(used(&m), 3, "forks allocate nothing");
        assert_eq!(m.block_refcount(tail).unwrap(), n as u32 + 1);
        m.append_batch(&kids, &vec![7; n]).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(
            used(&m),
            3 + n as u64,
            "the parent keeps its tail, each sample copies it once"
        );
        assert_eq!(m.stats().cow_copies, n as u64);
        let copies = m.pending_copies().to_vec();
        assert_eq!(copies.len(), n);
        assert!(copies.iter().all(|&(s, _)| s == tail));
        for (&k, &(_, d)) in kids.iter().zip(&copies) {
            assert_eq!(*table(&m, k).last().unwrap(), d);
            assert_eq!(
                &table(&m, k)[..2],
                &table(&m, 0)[..2],
                "full blocks stay shared"
            );
        }
        // The step emits the copies once.
        let mut ob = bufs();
        let info = m.build_step(&kids, &vec![1; n], &mut ob.view()).unwrap();
        assert_eq!(info.num_copies, n);
        let flat: Vec<i64> = copies
            .iter()
            .flat_map(|&(s, d)| [s as i64, d as i64])
            .collect();
        assert_eq!(&ob.copies[..2 * n], &flat[..]);
        assert!(m.pending_copies().is_empty());
        assert_eq!(
            m.build_step(&kids, &vec![1; n], &mut ob.view())
                .unwrap()
                .num_copies,
            0
        );
        m.check_invariants().unwrap();
    }
}

#[test]
fn sharers_that_all_decode_copy_all_but_the_last() {
    // Parent plus n children all decode: n copies, the last writer finds the tail unshared.
    let n = 3;
    let mut m = mgr(64, 0);
    m.admit(0, &prompt(10, 15)).unwrap();
    step_all(&mut m, &[0]);
    for k in 1..=n {
        m.fork(0, k).unwrap();
    }
    let all: Vec<SeqId> = (0..=n).collect();
    m.append_batch(&all, &[1, 2, 3, 4]).unwrap();
    assert_eq!(used(&m), 3 + n);
    assert_eq!(m.stats().cow_copies, n);
    m.check_invariants().unwrap();
    // Parent freed before the children write: the last child inherits the tail in place.
    let mut m = mgr(64, 0);
    m.admit(0, &prompt(10, 15)).unwrap();
    step_all(&mut m, &[0]);
    for k in 1..=n {
        m.fork(0, k).unwrap();
    }
    m.free(0).unwrap();
    let kids: Vec<SeqId> = (1..=n).collect();
    m.append_batch(&kids, &[1, 2, 3]).unwrap();
    assert_eq!(used(&m), 3 + n - 1);
    m.check_invariants().unwrap();
}

#[test]
fn full_shared_tail_needs_no_copy() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(8, 16)).unwrap();
    m.fork(0, 1).unwrap();
    m.append_batch(&[0, 1], &[1, 2]).unwrap();
    assert_eq!(m.stats().cow_copies, 0);
    assert!(m.pending_copies().is_empty());
    assert_eq!(used(&m), 4);
    assert_eq!(&table(&m, 0)[..2], &table(&m, 1)[..2]);
    assert_ne!(table(&m, 0)[2], table(&m, 1)[2]);
    m.check_invariants().unwrap();
}

#[test]
fn append_copies_a_shared_tail_and_fails_cleanly_without_a_block() {
    let mut m = mgr(3, 0);
    m.admit(0, &prompt(6, 17)).unwrap(); // 2 blocks, tail partial
    m.fork(0, 1).unwrap();
    m.append(1, &[5]).unwrap(); // copy-on-write takes the last free block
    assert_eq!(m.num_free_blocks(), 0);
    m.fork(1, 2).unwrap();
    let before = (
        table(&m, 1),
        table(&m, 2),
        m.pending_copies().to_vec(),
        m.stats(),
    );
    assert_eq!(
        m.append(2, &[6]).unwrap_err(),
        Error::OutOfBlocks {
            needed: 1,
            available: 0
        }
    );
    assert_eq!(
        m.append_batch(&[2], &[6]).unwrap_err(),
        Error::OutOfBlocks {
            needed: 1,
            available: 0
        }
    );
    assert_eq!(
        (
            table(&m, 1),
            table(&m, 2),
            m.pending_copies().to_vec(),
            m.stats()
        ),
        before
    );
    m.check_invariants().unwrap();
}

#[test]
fn freed_copy_destination_drops_its_copy() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(6, 18)).unwrap();
    m.fork(0, 1).unwrap();
    m.append(1, &[1]).unwrap();
    assert_eq!(m.pending_copies().len(), 1);
    m.free(1).unwrap();
    assert!(m.pending_copies().is_empty());
    assert_eq!(used(&m), 2);
    m.check_invariants().unwrap();
}

#[test]
fn freed_copy_source_is_held_until_the_step_emits_it() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(6, 19)).unwrap();
    let tail = table(&m, 0)[1];
    m.fork(0, 1).unwrap();
    m.append(1, &[1]).unwrap();
    m.free(0).unwrap();
    // The tail has no owner left but its content is still to be copied: not reusable yet.
    assert_eq!(m.block_refcount(tail).unwrap(), 0);
    assert_eq!(used(&m), 3);
    assert_eq!(m.num_free_blocks(), 13);
    m.check_invariants().unwrap();
    let mut ob = bufs();
    let info = m.build_step(&[1], &[7], &mut ob.view()).unwrap();
    assert_eq!(info.num_copies, 1);
    assert_eq!(ob.copies[0], tail as i64);
    assert_eq!(used(&m), 2);
    assert_eq!(m.num_free_blocks(), 14);
    m.check_invariants().unwrap();
}

#[test]
fn a_copy_of_a_pending_copy_reads_from_the_origin() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(6, 20)).unwrap();
    let t = table(&m, 0)[1];
    m.fork(0, 1).unwrap();
    m.append(1, &[1]).unwrap(); // (t -> d)
    let d = table(&m, 1)[1];
    m.fork(1, 2).unwrap();
    m.append(2, &[2]).unwrap(); // d is shared and still waiting for its copy: (t -> d2)
    let d2 = table(&m, 2)[1];
    assert_eq!(m.pending_copies(), &[(t, d), (t, d2)]);
    m.check_invariants().unwrap();
}

#[test]
fn copies_that_do_not_fit_stay_pending() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(6, 21)).unwrap();
    m.fork(0, 1).unwrap();
    m.fork(0, 2).unwrap();
    m.append_batch(&[1, 2], &[1, 1]).unwrap();
    let mut ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 4,
        max_tokens: 8,
        max_blocks_per_seq: 4,
        max_copies: 1,
    });
    ob.copies.fill(-1);
    let err = m.build_step(&[1, 2], &[1, 1], &mut ob.view()).unwrap_err();
    assert_eq!(
        err,
        Error::BufferTooSmall {
            buffer: "copies",
            needed: 4,
            capacity: 2
        }
    );
    assert_eq!(ob.copies, vec![-1, -1]);
    assert_eq!(m.pending_copies().len(), 2);
    m.check_invariants().unwrap();
}

#[test]
fn fork_errors() {
    let mut m = mgr(16, 0);
    m.admit(0, &prompt(6, 22)).unwrap();
    m.admit(1, &prompt(3, 22)).unwrap();
    let before = (m.stats(), table(&m, 0));
    assert_eq!(
        m.fork(9, 2).unwrap_err(),
        Error::UnknownSequence { seq_id: 9 }
    );
    assert_eq!(
        m.fork(0, 1).unwrap_err(),
        Error::DuplicateSequence { seq_id: 1 }
    );
    assert_eq!(
        m.fork(0, 0).unwrap_err(),
        Error::DuplicateSequence { seq_id: 0 }
    );
    assert_eq!((m.stats(), table(&m, 0)), before);
    m.check_invariants().unwrap();
}

#[test]
fn free_in_any_order_after_forks_leaks_nothing() {
    // Every permutation of freeing a small fork tree with copies pending and cached blocks.
    let order_sets: Vec<Vec<SeqId>> = permutations(&[0, 1, 2, 3]);
    for order in order_sets {
        for stepped in [false, true] {
            let mut m = mgr(32, 0);
            m.admit(0, &prompt(10, 23)).unwrap();
            step_all(&mut m, &[0]);
            m.fork(0, 1).unwrap();
            m.append(1, &[1, 2, 3]).unwrap();
            m.fork(1, 2).unwrap();
            m.fork(0, 3).unwrap();
            m.append_batch(&[2, 3], &[4, 5]).unwrap();
            m.append(0, &[6]).unwrap();
            if stepped {
                step_all(&mut m, &[0, 1, 2, 3]);
            }
            for &s in &order {
                m.free(s).unwrap();
                m.check_invariants().unwrap();
            }
            if !stepped {
                // Copies whose sources were freed are emitted by the next step, then released.
                step_all(&mut m, &[]);
            }
            let st = m.stats();
            assert_eq!(
                m.num_free_blocks(),
                32,
                "order {order:?}, stepped {stepped}"
            );
            assert_eq!(
                (
                    st.used_blocks,
                    st.shared_blocks,
                    st.used_tokens,
                    st.num_seqs
                ),
                (0, 0, 0, 0)
            );
            assert!(m.pending_copies().is_empty());
        }
    }
}

fn permutations(xs: &[SeqId]) -> Vec<Vec<SeqId>> {
    if xs.len() <= 1 {
        return vec![xs.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..xs.len() {
        let mut rest = xs.to_vec();
        let x = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

#[test]
fn check_invariants_reports_a_block_cached_under_a_foreign_chain() {
    // Verify off: in verify mode a block's content, not its chain, is what the check compares.
    let mut c = ManagerConfig::new(16, B);
    c.watermark_blocks = 0;
    c.verify_prefix = false;
    let mut m = BlockManager::new(c).unwrap();
    m.admit(1, &prompt(8, 24)).unwrap();
    step_all(&mut m, &[1]);
    let b0 = table(&m, 1)[0];
    // The live sequence computed another hash for this block than the one it now carries.
    assert!(m.debug_relabel_block(b0, 12345));
    assert!(
        matches!(m.check_invariants(), Err(Error::InvariantViolation(msg)) if msg.contains("another chain"))
    );
    // Out-of-range block ids are typed errors, not panics.
    assert_eq!(
        m.block_refcount(16),
        Err(Error::InvalidBlock {
            block: 16,
            num_blocks: 16
        })
    );
    assert_eq!(m.block_hash(16), None);
    assert!(!m.debug_relabel_block(16, 1));
}

/// More pending copies than the copy buffer holds: every step still runs. An empty step emits
/// what fits (queue order) and keeps the rest queued; a step that schedules a sequence emits that
/// sequence's copy first; only a batch whose own copies do not fit is refused, changing nothing.
/// Before, every step failed with `BufferTooSmall` once the queue outgrew the buffer.
#[test]
fn copies_beyond_the_buffer_stay_queued() {
    let mut m = mgr(64, 0);
    m.admit(0, &prompt(6, 5)).unwrap(); // one full block and a 2-token tail
    step_all(&mut m, &[0]);
    for k in 1..=4 {
        m.fork(0, k).unwrap();
    }
    m.append_batch(&[1, 2, 3, 4], &[7, 7, 7, 7]).unwrap();
    let queued = m.pending_copies().to_vec();
    assert_eq!(queued.len(), 4);
    let mut ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 16,
        max_tokens: 1024,
        max_blocks_per_seq: 64,
        max_copies: 1,
    });
    // An empty step: the oldest copy goes out, three stay.
    let info = m.build_step(&[], &[], &mut ob.view()).unwrap();
    assert_eq!(info.num_copies, 1);
    assert_eq!(
        (ob.copies[0], ob.copies[1]),
        (queued[0].0 as i64, queued[0].1 as i64)
    );
    assert_eq!(m.pending_copies(), &queued[1..]);
    m.check_invariants().unwrap();
    // Scheduling sequence 4 emits its own copy (the newest), not the oldest.
    let info = m.build_step(&[4], &[1], &mut ob.view()).unwrap();
    assert_eq!(info.num_copies, 1);
    assert_eq!(
        (ob.copies[0], ob.copies[1]),
        (queued[3].0 as i64, queued[3].1 as i64)
    );
    assert_eq!(m.pending_copies(), &queued[1..3]);
    m.check_invariants().unwrap();
    // Two scheduled sequences each needing a copy do not fit one slot: refused, unchanged.
    let before = (m.pending_copies().to_vec(), m.stats());
    assert_eq!(
        m.build_step(&[2, 3], &[1, 1], &mut ob.view()),
        Err(Error::BufferTooSmall {
            buffer: "copies",
            needed: 4,
            capacity: 2
        })
    );
    assert_eq!((m.pending_copies().to_vec(), m.stats()), before);
    // The parent holds every copy's src: scheduling it needs both remaining copies too.
    assert!(m.build_step(&[0], &[1], &mut ob.view()).is_err());
    // One at a time they go through; then the queue is empty.
    assert_eq!(
        m.build_step(&[2], &[1], &mut ob.view()).unwrap().num_copies,
        1
    );
    assert_eq!(
        m.build_step(&[3], &[1], &mut ob.view()).unwrap().num_copies,
        1
    );
    assert!(m.pending_copies().is_empty());
    assert_eq!(
        m.build_step(&[0], &[6], &mut ob.view()).unwrap().num_copies,
        0
    );
    m.check_invariants().unwrap();
    // Freeing the parent while its tail is still a queued src keeps that block until the copy
    // goes out, then releases it.
    for k in 1..=4 {
        m.free(k).unwrap();
    }
    m.fork(0, 5).unwrap();
    m.fork(0, 6).unwrap();
    m.append_batch(&[5, 6], &[1, 1]).unwrap();
    m.free(0).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(
        m.build_step(&[], &[], &mut ob.view()).unwrap().num_copies,
        1
    );
    m.check_invariants().unwrap();
    assert_eq!(
        m.build_step(&[6], &[1], &mut ob.view()).unwrap().num_copies,
        1
    );
    assert!(m.pending_copies().is_empty());
    m.check_invariants().unwrap();
}
