//! Swap and recompute in the core: host pool accounting, shared blocks of a forked group copied once,
//! prefix-cache entries of swapped blocks, the swap lists of the step (order, overflow), victim
//! choice, the cost model, and every error leaving the state unchanged.
//!
//! KV content is simulated (`common`): `dev[b]` / `host[h]` hold one value per token slot; a step
//! applies its lists in the documented order (swap-out, swap-in, copy-on-write) and then writes each
//! new token's value through the slot mapping.

mod common;

use common::{expect_err_unchanged, read_back, toks, Sim, B};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepInfo, StepLayout};
use pagedkv::swap::{CostModel, PreemptMode, SeqState};
use pagedkv::{BlockId, Error, SeqId, TokenId};

impl Sim {
    fn new(num_blocks: u32, num_host_blocks: u32, max_swaps: usize) -> Self {
        let mut cfg = ManagerConfig::new(num_blocks, B);
        cfg.watermark_blocks = 0;
        cfg.num_host_blocks = num_host_blocks;
        cfg.hash_seed = Some(1);
        Self::with_config(cfg, max_swaps)
    }

    fn step(&mut self, seqs: &[SeqId], new: &[u32]) -> pagedkv::Result<StepInfo> {
        let info = self.m.build_step(seqs, new, &mut self.ob.view())?;
        self.apply_step(&info, seqs, new);
        Ok(info)
    }

    fn admit(&mut self, sid: SeqId, toks: Vec<TokenId>) {
        let r = self.m.admit(sid, &toks).unwrap();
        self.tokens.insert(sid, toks);
        self.step(&[sid], &[r.num_tokens - r.cached_tokens])
            .unwrap();
    }

    fn append(&mut self, sid: SeqId, t: TokenId) {
        self.m.append(sid, &[t]).unwrap();
        self.tokens.get_mut(&sid).unwrap().push(t);
    }

    fn fork(&mut self, p: SeqId, c: SeqId) {
        self.m.fork(p, c).unwrap();
        let t = self.tokens[&p].clone();
        self.tokens.insert(c, t);
    }

    fn content(&self, sid: SeqId) -> Vec<i64> {
        let t = self.m.block_table(sid).unwrap();
        read_back(&self.dev, t, self.tokens[&sid].len())
    }

    fn expect(&self, sid: SeqId) -> Vec<i64> {
        self.tokens[&sid].iter().map(|&t| t as i64).collect()
    }
}

#[derive(Debug, PartialEq)]
struct Snap {
    seqs: Vec<(SeqId, SeqState, usize, Vec<BlockId>)>,
    refs: Vec<u32>,
    host_refs: Vec<u32>,
    queues: [Vec<(u32, u32)>; 3],
    stats: pagedkv::metrics::Stats,
}

fn snap(m: &BlockManager) -> Snap {
    let mut seqs: Vec<_> = m
        .seq_ids()
        .map(|s| {
            (
                s,
                m.seq_state(s).unwrap(),
                m.seq_len(s).unwrap(),
                m.block_table(s).unwrap().to_vec(),
            )
        })
        .collect();
    seqs.sort_by_key(|x| x.0);
    Snap {
        seqs,
        refs: (0..m.config().num_blocks)
            .map(|b| m.block_refcount(b).unwrap())
            .collect(),
        host_refs: (0..m.config().num_host_blocks)
            .map(|h| m.host_block_refcount(h).unwrap())
            .collect(),
        queues: [
            m.pending_copies().to_vec(),
            m.pending_swap_out().to_vec(),
            m.pending_swap_in().to_vec(),
        ],
        stats: m.stats(),
    }
}

fn unchanged<T: std::fmt::Debug>(
    m: &mut BlockManager,
    op: impl FnOnce(&mut BlockManager) -> pagedkv::Result<T>,
    check: impl FnOnce(&Error) -> bool,
) {
    expect_err_unchanged(m, snap, op, check);
}

#[test]
fn round_trip_with_reused_device_blocks() {
    let mut s = Sim::new(16, 16, 8);
    s.admit(1, toks(10, 100));
    let out = s.m.swap_out(&[1]).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(s.m.seq_state(1).unwrap(), SeqState::Swapped);
    assert_eq!(s.m.num_free_blocks(), 16);
    assert_eq!(s.m.num_free_host_blocks(), 13);
    s.m.check_invariants().unwrap();
    // Another sequence takes the freed blocks before the step that emits the swap-out.
    s.admit(2, toks(16, 500));
    assert_eq!(s.m.pending_swap_out(), &[] as &[(u32, u32)]);
    s.m.swap_in(&[1]).unwrap();
    s.append(1, 7);
    let info = s.step(&[1, 2], &[1, 1]).unwrap();
    assert_eq!(info.num_swap_in, 3);
    assert_eq!(s.content(1), s.expect(1));
    assert_eq!(s.content(2), s.expect(2));
    assert_eq!(s.m.num_free_host_blocks(), 16);
    let st = s.m.stats();
    assert_eq!((st.preemptions_swap, st.preemptions), (1, 1));
    assert_eq!((st.swapped_out_blocks, st.swapped_in_blocks), (3, 3));
    s.m.check_invariants().unwrap();
}

#[test]
fn swap_out_then_in_before_any_step() {
    // Neither copy has run when the sequence comes back: the step runs the swap-out, then the
    // swap-in, and the content survives even though the device block may be the same one.
    let mut s = Sim::new(8, 8, 8);
    s.admit(1, toks(6, 1));
    s.m.swap_out(&[1]).unwrap();
    s.m.swap_in(&[1]).unwrap();
    s.step(&[1], &[1]).unwrap();
    assert_eq!(s.content(1), s.expect(1));
    // In again, then out again before a step: the host copy is taken back, nothing is copied.
    s.m.swap_out(&[1]).unwrap();
    s.step(&[], &[]).unwrap();
    s.m.swap_in(&[1]).unwrap();
    let again = s.m.swap_out(&[1]).unwrap();
    assert!(again.is_empty());
    assert!(s.m.pending_swap_in().is_empty());
    s.m.check_invariants().unwrap();
    s.m.swap_in(&[1]).unwrap();
    s.step(&[1], &[1]).unwrap();
    assert_eq!(s.content(1), s.expect(1));
    s.m.check_invariants().unwrap();
}

#[test]
fn forked_group_is_copied_once_and_shared_back() {
    let mut s = Sim::new(32, 32, 16);
    s.admit(1, toks(10, 1));
    s.fork(1, 2);
    s.fork(1, 3);
    s.append(2, 99); // copy-on-write of the shared tail, queued
    s.step(&[1, 2, 3], &[1, 1, 1]).unwrap();
    let v = s.m.choose_victim().unwrap();
    assert_eq!(v, vec![1, 2, 3]);
    let out = s.m.swap_out(&v).unwrap();
    assert_eq!(
        out.len(),
        4,
        "2 shared full blocks, the tail 1 and 3 share, 2's own tail"
    );
    let t1 = s.m.block_table(1).unwrap().to_vec();
    assert_eq!(t1, s.m.block_table(3).unwrap());
    assert_eq!(s.m.host_block_refcount(t1[0]).unwrap(), 3);
    assert_eq!(s.m.stats().preemptions_swap, 3);
    assert_eq!(s.m.num_free_blocks(), 32);
    s.m.check_invariants().unwrap();
    let back = s.m.swap_in(&v).unwrap();
    assert_eq!(back.len(), 4);
    let d1 = s.m.block_table(1).unwrap().to_vec();
    assert_eq!(s.m.block_refcount(d1[0]).unwrap(), 3);
    assert_eq!(s.m.stats().shared_blocks, 3);
    s.append(3, 5); // the tail 1 and 3 share again is copied on write
    s.step(&[1, 2, 3], &[1, 1, 1]).unwrap();
    for sid in [1, 2, 3] {
        assert_eq!(s.content(sid), s.expect(sid));
    }
    s.m.check_invariants().unwrap();
}

#[test]
fn partial_group_copies_shared_blocks_and_keeps_them_on_device() {
    let mut s = Sim::new(16, 16, 8);
    s.admit(1, toks(8, 1));
    s.fork(1, 2);
    let out = s.m.swap_out(&[2]).unwrap();
    assert_eq!(out.len(), 2);
    // Seq 1 still holds both blocks on the device.
    for &b in s.m.block_table(1).unwrap() {
        assert_eq!(s.m.block_refcount(b).unwrap(), 1);
    }
    assert_eq!(s.m.stats().shared_blocks, 0);
    s.m.swap_in(&[2]).unwrap();
    s.step(&[1, 2], &[1, 1]).unwrap();
    assert_eq!(s.content(2), s.expect(2));
    s.m.check_invariants().unwrap();
}

#[test]
fn cow_destination_swapped_before_its_copy_is_read_from_the_source() {
    let mut s = Sim::new(16, 16, 8);
    s.admit(1, toks(6, 1));
    s.fork(1, 2);
    s.append(2, 42); // queues (tail, fresh) for seq 2
    assert_eq!(s.m.pending_copies().len(), 1);
    let (src, _) = s.m.pending_copies()[0];
    let out = s.m.swap_out(&[2]).unwrap();
    assert!(out.contains(&(src, s.m.block_table(2).unwrap()[1])));
    assert!(
        s.m.pending_copies().is_empty(),
        "the copy into a freed block is moot"
    );
    s.m.check_invariants().unwrap();
    s.step(&[1], &[1]).unwrap();
    s.m.swap_in(&[2]).unwrap();
    s.step(&[2], &[1]).unwrap(); // computes token 42
    assert_eq!(s.content(2), s.expect(2));
    s.m.check_invariants().unwrap();
}

#[test]
fn hashed_blocks_leave_the_cache_while_swapped() {
    let mut s = Sim::new(16, 16, 8);
    let p = toks(9, 1);
    s.admit(1, p.clone());
    let h0 = s.m.block_hash(s.m.block_table(1).unwrap()[0]).unwrap();
    s.m.swap_out(&[1]).unwrap();
    assert_eq!(s.m.stats().cached_free_blocks, 0);
    assert_eq!(s.m.admit(2, &p).unwrap().cached_tokens, 0);
    s.m.free(2).unwrap();
    s.m.swap_in(&[1]).unwrap();
    assert_eq!(s.m.block_hash(s.m.block_table(1).unwrap()[0]), Some(h0));
    s.step(&[1], &[1]).unwrap();
    assert_eq!(s.m.admit(3, &p).unwrap().cached_tokens, 8);
    s.m.check_invariants().unwrap();
    // After a reset, a swapped-out sequence does not offer its blocks again.
    s.m.swap_out(&[1]).unwrap_or_default();
    s.m.reset_prefix_cache().unwrap();
    s.m.free(3).unwrap();
    s.m.swap_in(&[1]).unwrap_or_default();
    assert_eq!(s.m.block_hash(s.m.block_table(1).unwrap()[0]), None);
    s.m.check_invariants().unwrap();
}

#[test]
fn recompute_and_resume() {
    let mut s = Sim::new(16, 4, 8);
    s.admit(1, toks(10, 1));
    s.m.recompute(1).unwrap();
    assert_eq!(s.m.seq_state(1).unwrap(), SeqState::Recompute);
    assert_eq!(s.m.seq_len(1).unwrap(), 10);
    assert!(s.m.block_table(1).unwrap().is_empty());
    assert_eq!(s.m.stats().preemptions_recompute, 1);
    assert_eq!(s.m.stats().used_tokens, 0);
    s.m.check_invariants().unwrap();
    let r = s.m.resume(1, Some(1)).unwrap();
    assert_eq!((r.cached_tokens, r.num_tokens), (8, 9));
    s.m.append(1, &[9]).unwrap();
    s.step(&[1], &[2]).unwrap();
    assert_eq!(s.content(1), s.expect(1));
    // A swapped sequence dropped to recompute frees its host blocks.
    s.m.swap_out(&[1]).unwrap();
    s.m.recompute(1).unwrap();
    assert_eq!(s.m.num_free_host_blocks(), 4);
    assert_eq!(s.m.stats().preemptions_recompute, 1);
    s.m.check_invariants().unwrap();
    s.m.resume(1, None).unwrap();
    s.m.check_invariants().unwrap();
}

#[test]
fn resume_without_prefix_caching() {
    let mut cfg = ManagerConfig::new(8, B);
    cfg.enable_prefix_caching = false;
    cfg.watermark_blocks = 0;
    let mut m = BlockManager::new(cfg).unwrap();
    m.admit(1, &toks(9, 1)).unwrap();
    m.recompute(1).unwrap();
    let r = m.resume(1, None).unwrap();
    assert_eq!((r.cached_tokens, r.num_tokens, r.num_blocks), (0, 9, 3));
    m.check_invariants().unwrap();
}

#[test]
fn errors_leave_state_unchanged() {
    let mut s = Sim::new(8, 2, 8);
    s.admit(1, toks(12, 1));
    s.admit(2, toks(1, 50));
    let m = &mut s.m;
    unchanged(
        m,
        |m| m.swap_out(&[1]),
        |e| {
            matches!(
                e,
                Error::OutOfHostBlocks {
                    needed: 3,
                    available: 2
                }
            )
        },
    );
    unchanged(
        m,
        |m| m.swap_out(&[2, 9]),
        |e| matches!(e, Error::UnknownSequence { seq_id: 9 }),
    );
    unchanged(
        m,
        |m| m.swap_out(&[2, 2]),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    unchanged(
        m,
        |m| m.swap_out(&[]),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    unchanged(
        m,
        |m| m.swap_in(&[2]),
        |e| {
            matches!(
                e,
                Error::InvalidSequenceState {
                    seq_id: 2,
                    state: "running",
                    ..
                }
            )
        },
    );
    unchanged(
        m,
        |m| m.resume(2, None),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    m.swap_out(&[2]).unwrap();
    unchanged(
        m,
        |m| m.append(2, &[1]),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    unchanged(
        m,
        |m| m.append_batch(&[1, 2], &[1, 1]),
        |e| matches!(e, Error::InvalidSequenceState { seq_id: 2, .. }),
    );
    unchanged(
        m,
        |m| m.fork(2, 5),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    unchanged(
        m,
        |m| m.swap_out(&[1, 2]),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    let mut ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 4,
        max_tokens: 16,
        max_blocks_per_seq: 8,
        max_copies: 4,
        max_swaps: 4,
    });
    unchanged(
        m,
        |m| m.build_step(&[2], &[1], &mut ob.view()),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    let model = CostModel::new(1.0, 1.0, 1.0);
    unchanged(
        m,
        |m| m.decide(&[2], &model),
        |e| matches!(e, Error::InvalidSequenceState { .. }),
    );
    let bad = CostModel {
        host_link_bytes_per_s: f64::INFINITY,
        ..model
    };
    unchanged(
        m,
        |m| m.decide(&[1], &bad),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    // swap_in is checked like an admission.
    m.recompute(1).unwrap();
    m.admit(3, &toks(28, 9)).unwrap(); // 7 of 8 blocks
    m.admit(4, &toks(4, 90)).unwrap();
    unchanged(
        m,
        |m| m.swap_in(&[2]),
        |e| {
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 1,
                    available: 0
                }
            )
        },
    );
    unchanged(
        m,
        |m| m.resume(1, Some(0)),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    unchanged(
        m,
        |m| m.resume(1, None),
        |e| matches!(e, Error::OutOfBlocks { .. }),
    );
}

#[test]
fn watermark_applies_to_swap_in() {
    let mut cfg = ManagerConfig::new(8, B);
    cfg.watermark_blocks = 4;
    cfg.num_host_blocks = 4;
    let mut m = BlockManager::new(cfg).unwrap();
    m.admit(1, &toks(8, 1)).unwrap();
    m.swap_out(&[1]).unwrap();
    m.admit(2, &toks(12, 9)).unwrap();
    unchanged(
        &mut m,
        |m| m.swap_in(&[1]),
        |e| {
            matches!(
                e,
                Error::WatermarkReached {
                    needed: 2,
                    available: 1,
                    watermark: 4
                }
            )
        },
    );
}

#[test]
fn swap_list_overflow_emits_what_the_step_needs_and_keeps_the_rest() {
    let mut s = Sim::new(16, 16, 1);
    s.admit(1, toks(12, 1));
    s.m.swap_out(&[1]).unwrap();
    // Seq 2 takes the last freed block (seq 1's tail, freed first): its step must emit that
    // block's swap-out and has room for nothing else.
    s.m.admit(2, &[7]).unwrap();
    s.tokens.insert(2, vec![7]);
    let tail = s.m.block_table(2).unwrap()[0];
    let info = s.step(&[2], &[1]).unwrap();
    assert_eq!(info.num_swap_out, 1);
    assert_eq!(s.ob.swap_out[0], tail as i64);
    assert_eq!(s.m.pending_swap_out().len(), 2);
    // A step of other sequences drains the rest, one pair a step.
    s.step(&[], &[]).unwrap();
    s.step(&[], &[]).unwrap();
    assert!(s.m.pending_swap_out().is_empty());
    s.m.swap_in(&[1]).unwrap();
    unchanged(
        &mut s.m,
        |m| {
            m.build_step(
                &[1],
                &[1],
                &mut OwnedStepBuffers::new(StepLayout {
                    max_seqs: 2,
                    max_tokens: 8,
                    max_blocks_per_seq: 16,
                    max_copies: 2,
                    max_swaps: 1,
                })
                .view(),
            )
        },
        |e| {
            matches!(
                e,
                Error::BufferTooSmall {
                    buffer: "swap_in",
                    needed: 6,
                    capacity: 2
                }
            )
        },
    );
    for _ in 0..3 {
        s.step(&[2], &[1]).unwrap();
    }
    assert!(s.m.pending_swap_in().is_empty());
    s.step(&[1], &[1]).unwrap();
    assert_eq!(s.content(1), s.expect(1));
    assert_eq!(s.content(2), s.expect(2));
    s.m.check_invariants().unwrap();
}

#[test]
fn freed_before_emission_drops_the_queued_copies() {
    let mut s = Sim::new(8, 8, 8);
    s.admit(1, toks(8, 1));
    s.m.swap_out(&[1]).unwrap();
    s.m.free(1).unwrap();
    assert!(s.m.pending_swap_out().is_empty());
    assert_eq!(s.m.num_free_host_blocks(), 8);
    s.admit(2, toks(8, 1));
    s.m.swap_out(&[2]).unwrap();
    s.step(&[], &[]).unwrap();
    s.m.swap_in(&[2]).unwrap();
    s.m.free(2).unwrap();
    assert!(s.m.pending_swap_in().is_empty());
    assert_eq!(s.m.num_free_host_blocks(), 8);
    assert_eq!(s.m.num_free_blocks(), 8);
    s.m.check_invariants().unwrap();
}

#[test]
fn victim_order_and_groups() {
    let mut cfg = ManagerConfig::new(32, B);
    cfg.num_host_blocks = 8;
    cfg.watermark_blocks = 0;
    let mut m = BlockManager::new(cfg).unwrap();
    assert_eq!(m.choose_victim(), None);
    m.admit(1, &[1]).unwrap();
    m.admit(2, &[2]).unwrap();
    m.fork(1, 3).unwrap();
    assert_eq!(m.choose_victim(), Some(vec![2]));
    m.swap_out(&[2]).unwrap();
    assert_eq!(m.choose_victim(), Some(vec![1, 3]));
    m.swap_in(&[2]).unwrap();
    assert_eq!(m.choose_victim(), Some(vec![2]));
    m.fork(2, 4).unwrap();
    m.recompute(2).unwrap();
    assert_eq!(m.choose_victim(), Some(vec![4]));
    m.free(4).unwrap();
    assert_eq!(m.choose_victim(), Some(vec![1, 3]));
}

#[test]
fn cost_model_crossover() {
    let mut cfg = ManagerConfig::new(512, 16);
    cfg.num_host_blocks = 512;
    cfg.watermark_blocks = 0;
    let mut m = BlockManager::new(cfg).unwrap();
    let model = CostModel::new(50e9, 10_000.0, 128.0 * 1024.0);
    // Per token: swap 2 × 128 KiB / 50 GB/s = 5.2 µs, recompute 100 µs: swap wins at any length.
    m.admit(1, &toks(100, 1)).unwrap();
    // A step registers the full blocks in the prefix cache.
    let mut ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 2,
        max_tokens: 128,
        max_blocks_per_seq: 8,
        max_copies: 2,
        max_swaps: 2,
    });
    m.build_step(&[1], &[100], &mut ob.view()).unwrap();
    let d = m.decide(&[1], &model).unwrap();
    assert_eq!(d.mode, PreemptMode::Swap);
    assert_eq!(d.swap_blocks, 7);
    assert_eq!(d.recompute_tokens, 100);
    let slow = CostModel {
        host_link_bytes_per_s: 1e6,
        ..model
    };
    assert_eq!(m.decide(&[1], &slow).unwrap().mode, PreemptMode::Recompute);
    // A forked group: swap copies shared blocks once, recompute repeats them per branch.
    m.fork(1, 2).unwrap();
    let g = m.decide(&[1, 2], &model).unwrap();
    assert_eq!(g.swap_blocks, 7);
    assert_eq!(g.recompute_tokens, 200);
    // One branch alone: its blocks survive in its sibling, so only the tail is recomputed.
    let one = m.decide(&[2], &model).unwrap();
    assert_eq!(one.recompute_tokens, 100 - 96);
    // Beside its sibling's decode a step has a floor: a short recompute rides it for free, so
    // recompute wins; the same victim alone pays a whole step, and swap wins.
    assert_eq!(one.batch_tokens, 1);
    let floored = CostModel {
        step_floor_s: 0.030,
        max_step_tokens: 2048,
        ..model
    };
    let d = m.decide(&[2], &floored).unwrap();
    assert_eq!((d.mode, d.recompute_cost_s), (PreemptMode::Recompute, 0.0));
    let alone = m.decide_beside(&[2], &floored, Some(0)).unwrap();
    assert_eq!(alone.mode, PreemptMode::Swap);
    assert!((alone.recompute_cost_s - 0.030).abs() < 1e-12);
    let bad = CostModel {
        step_floor_s: f64::NAN,
        ..model
    };
    assert!(m.decide(&[2], &bad).is_err());
}

#[test]
fn free_batch_frees_every_state() {
    let mut s = Sim::new(16, 8, 8);
    s.admit(1, toks(5, 1));
    s.admit(2, toks(5, 20));
    s.admit(3, toks(5, 40));
    s.m.swap_out(&[1]).unwrap();
    s.m.recompute(2).unwrap();
    unchanged(
        &mut s.m,
        |m| m.free_batch(&[1, 2, 1]),
        |e| matches!(e, Error::InvalidArgument { .. }),
    );
    s.m.free_batch(&[1, 2, 3]).unwrap();
    assert_eq!(s.m.num_seqs(), 0);
    assert_eq!(s.m.num_free_host_blocks(), 8);
    assert_eq!(s.m.num_free_blocks(), 16);
    s.m.check_invariants().unwrap();
}
