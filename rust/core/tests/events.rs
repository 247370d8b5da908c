//! The KV-event ring through the manager: stored at step time with the chain's parent, removed
//! on eviction and swap-out, cleared on reset, nothing when disabled, overflow counted.

mod common;

use common::GroupBufs;
use pagedkv::events::{KvEvent, KvEventKind, Medium};
use pagedkv::hash::Hasher;
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::TokenId;

const B: u32 = 4;

fn manager(num_blocks: u32, cap: usize) -> (BlockManager, OwnedStepBuffers) {
    let mut cfg = ManagerConfig::new(num_blocks, B);
    cfg.watermark_blocks = 0;
    cfg.hash_seed = Some(5);
    cfg.kv_event_capacity = cap;
    cfg.num_host_blocks = 8;
    let ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 4,
        max_tokens: 64,
        max_blocks_per_seq: num_blocks as usize,
        max_copies: 4,
        max_swaps: 8,
    });
    (BlockManager::new(cfg).unwrap(), ob)
}

fn chain(tokens: &[TokenId]) -> Vec<u128> {
    let mut out = Vec::new();
    Hasher::new(5).extend_chain(
        pagedkv::hash::root_hash(5, &[]),
        tokens,
        B as usize,
        None,
        &mut out,
    );
    out
}

fn drain(m: &mut BlockManager) -> Vec<KvEvent> {
    let mut out = Vec::new();
    m.drain_events(&mut out);
    out
}

#[test]
fn transitions_are_recorded_in_order() {
    let (mut m, mut ob) = manager(4, 32);
    let toks: Vec<TokenId> = (10..19).collect();
    let h = chain(&toks);
    m.admit(1, &toks).unwrap();
    assert!(drain(&mut m).is_empty(), "admission registers nothing");
    m.build_step(&[1], &[9], &mut ob.view()).unwrap();
    let ev = drain(&mut m);
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].kind, ev[0].medium, &ev[0].block_hashes[..]),
        (KvEventKind::Stored, Medium::Gpu, &h[..2])
    );
    assert_eq!(
        (ev[0].parent_hash, &ev[0].token_ids[..]),
        (None, &toks[..8])
    );
    // Swap-out drops the hashes (tail block first); swap-in registers them again.
    m.swap_out(&[1]).unwrap();
    let ev = drain(&mut m);
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].kind, &ev[0].block_hashes[..]),
        (KvEventKind::Removed, &[h[1], h[0]][..])
    );
    m.swap_in(&[1]).unwrap();
    assert_eq!(drain(&mut m)[0].block_hashes, h[..2]);
    m.build_step(&[1], &[1], &mut ob.view()).unwrap();
    m.free(1).unwrap();
    // A cold 4-block prompt takes the free blocks, then evicts both cached-free ones.
    let other: Vec<TokenId> = (50..63).collect();
    m.admit(2, &other).unwrap();
    let ev = drain(&mut m);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].kind, KvEventKind::Removed);
    assert_eq!(ev[0].block_hashes, vec![h[1], h[0]]);
    m.reset_prefix_cache().unwrap();
    let ev = drain(&mut m);
    assert_eq!((ev.len(), ev[0].kind), (1, KvEventKind::Cleared));
    assert!(ev[0].block_hashes.is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn disabled_and_overflowing_rings() {
    let (mut m, mut ob) = manager(8, 0);
    m.admit(1, &(0..17).collect::<Vec<_>>()).unwrap();
    m.build_step(&[1], &[17], &mut ob.view()).unwrap();
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.events_dropped(), 0);

    let (mut m, mut ob) = manager(8, 3);
    let toks: Vec<TokenId> = (0..17).collect();
    let h = chain(&toks);
    m.admit(1, &toks).unwrap();
    m.build_step(&[1], &[17], &mut ob.view()).unwrap();
    assert_eq!(m.events_dropped(), 1);
    let ev = drain(&mut m);
    assert_eq!(ev[0].block_hashes, h[1..4]);
    assert_eq!(ev[0].parent_hash, Some(h[0]));
}

// ---------------------------------------------------------------------------- KV cache groups

use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use std::collections::BTreeSet;

const FULL: AttentionKind = AttentionKind::Full;

fn grouped(num_blocks: u32, groups: Vec<AttentionKind>) -> BlockManager {
    let mut cfg = ManagerConfig::new(num_blocks, B);
    cfg.watermark_blocks = 0;
    cfg.hash_seed = Some(5);
    cfg.kv_event_capacity = 1 << 12;
    cfg.groups = groups;
    BlockManager::new(cfg).unwrap()
}

fn glayout() -> StepLayout {
    StepLayout {
        max_seqs: 8,
        max_tokens: 256,
        max_blocks_per_seq: 64,
        max_copies: 16,
        max_swaps: 0,
    }
}

type GBufs = GroupBufs;

impl GBufs {
    fn new(m: &BlockManager) -> Self {
        Self::with_layout(m, glayout())
    }

    fn step(&mut self, m: &mut BlockManager, seqs: &[u64], n: &[u32]) {
        self.build(m, seqs, n).unwrap();
    }
}

/// Applies device-tier events to `set` ((group, hash) pairs), checking each one is consistent
/// with it (no store of a pair already held, no removal of a pair not held).
fn apply(set: &mut BTreeSet<(usize, u128)>, events: &[KvEvent]) {
    for e in events {
        assert_eq!(e.medium, Medium::Gpu);
        let g = e.group as usize;
        match e.kind {
            KvEventKind::Stored => {
                assert_eq!(e.token_ids.len(), e.block_hashes.len() * B as usize);
                for &h in &e.block_hashes {
                    assert!(set.insert((g, h)), "stored twice: group {g} {h:#x}");
                }
            }
            KvEventKind::Removed => {
                for &h in &e.block_hashes {
                    assert!(set.remove(&(g, h)), "removed unheld: group {g} {h:#x}");
                }
            }
            KvEventKind::Cleared => set.clear(),
        }
    }
}

#[test]
fn a_released_window_block_is_removed_for_its_group_when_evicted() {
    // B = 4, sliding W = 4. Sequence 1 prefills 24 tokens in three steps of 8; its sliding group
    // releases blocks 0..3 mid-run (still cached, cached-free). A filler then evicts released
    // blocks: each eviction is a removal of (h_j, 1) while group 0 keeps h_j.
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = grouped(40, vec![FULL, s]);
    let mut b = GBufs::new(&m);
    let p: Vec<TokenId> = (100..124).collect();
    let h = chain(&p);
    m.admit_opts(1, &p[..8], None, Some(8)).unwrap();
    b.step(&mut m, &[1], &[8]);
    let ev = drain(&mut m);
    // Group 0's chain, then group 1's blocks of the same positions: same hashes, group 1.
    assert_eq!(ev.len(), 2);
    assert_eq!(
        (ev[0].group, &ev[0].block_hashes[..], ev[0].parent_hash),
        (0, &h[..2], None)
    );
    assert_eq!(
        (ev[1].group, &ev[1].block_hashes[..], ev[1].parent_hash),
        (1, &h[..2], None)
    );
    assert_eq!(ev[1].token_ids, p[..8]);
    for k in [8, 16] {
        m.append(1, &p[k..k + 8]).unwrap();
        b.step(&mut m, &[1], &[8]);
    }
    let ev = drain(&mut m);
    assert!(ev.iter().all(|e| e.kind == KvEventKind::Stored), "{ev:?}");
    let g1: Vec<u128> = ev
        .iter()
        .filter(|e| e.group == 1)
        .flat_map(|e| e.block_hashes.clone())
        .collect();
    assert_eq!(g1, h[2..6]);
    let released = m
        .block_table_group(1, 1)
        .unwrap()
        .iter()
        .take_while(|&&x| x == NULL_BLOCK)
        .count();
    assert_eq!(released, 3);
    // A filler needing every free block and 2 more evicts two released sliding blocks.
    let free = m.stats().free_blocks as u32;
    let filler: Vec<TokenId> = (2000..2000 + 2 * (free + 2)).collect();
    m.admit(9, &filler).unwrap();
    assert_eq!(m.stats().evictions, 2);
    let ev = drain(&mut m);
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].kind, KvEventKind::Removed);
    assert_eq!(ev[0].group, 1);
    assert_eq!(ev[0].block_hashes.len(), 2);
    for x in &ev[0].block_hashes {
        assert!(h[..3].contains(x), "a released sliding block: {x:#x}");
    }
    // Group 0 still holds every block of the chain (the sequence runs).
    let keys = m.cached_block_keys();
    for &x in &h[..6] {
        assert!(keys.contains(&(0, x)));
    }
    for x in &ev[0].block_hashes {
        assert!(!keys.contains(&(1, *x)));
    }
    m.check_invariants().unwrap();
}

#[test]
fn grouped_event_stream_balances_with_the_cache() {
    // Three groups (full, sliding 6, chunked 8), blocks of 4, a pool small enough that
    // admissions evict; prompts share prefixes, prefill in chunks, decode, fork and free. After
    // every operation the replayed stream equals the device cache's (group, hash) set.
    let kinds = vec![
        FULL,
        AttentionKind::Sliding { window: 6 },
        AttentionKind::Chunked { chunk: 8 },
    ];
    let mut m = grouped(72, kinds);
    let mut b = GBufs::new(&m);
    let mut set = BTreeSet::new();
    let mut seen = [[0usize; 2]; 3];
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let prefixes: Vec<Vec<TokenId>> = (0..3)
        .map(|k| (0..12).map(|t| 1000 * (k + 1) + t).collect())
        .collect();
    let mut live: Vec<u64> = Vec::new();
    let check =
        |m: &mut BlockManager, set: &mut BTreeSet<(usize, u128)>, seen: &mut [[usize; 2]; 3]| {
            let ev = drain(m);
            for e in &ev {
                let k = match e.kind {
                    KvEventKind::Stored => 0,
                    KvEventKind::Removed => 1,
                    KvEventKind::Cleared => continue,
                };
                seen[e.group as usize][k] += e.block_hashes.len();
            }
            apply(set, &ev);
            let want: BTreeSet<(usize, u128)> = m.cached_block_keys().into_iter().collect();
            assert_eq!(*set, want);
            m.check_invariants().unwrap();
        };
    for round in 0..120u64 {
        let id = 100 + round;
        match next(4) {
            0 | 1 if live.len() < 5 => {
                let mut p = prefixes[next(3) as usize].clone();
                let extra = 1 + next(14) as u32;
                p.extend((0..extra).map(|t| 7 * id as u32 + t));
                // Admitted in chunks of 8 after any cached prefix, as the engine prefills.
                let Ok(r) = m.admit_opts(id, &p, None, Some(8)) else {
                    continue;
                };
                live.push(id);
                let (cached, mut done) = (r.cached_tokens as usize, r.num_tokens as usize);
                b.step(&mut m, &[id], &[(done - cached) as u32]);
                while done < p.len() {
                    let k = 8.min(p.len() - done);
                    m.append(id, &p[done..done + k]).unwrap();
                    b.step(&mut m, &[id], &[k as u32]);
                    done += k;
                }
            }
            2 if !live.is_empty() => {
                let s = live[next(live.len() as u64) as usize];
                for t in 0..1 + next(6) as u32 {
                    if m.append(s, &[t]).is_err() {
                        break;
                    }
                    b.step(&mut m, &[s], &[1]);
                }
            }
            _ if !live.is_empty() => {
                let k = next(live.len() as u64) as usize;
                m.free(live.swap_remove(k)).unwrap();
            }
            _ => {}
        }
        check(&mut m, &mut set, &mut seen);
    }
    for s in live.drain(..) {
        m.free(s).unwrap();
    }
    check(&mut m, &mut set, &mut seen);
    for (g, [stored, removed]) in seen.iter().enumerate() {
        assert!(
            *stored > 0 && *removed > 0,
            "group {g}: {stored} stored, {removed} removed"
        );
    }
    m.reset_prefix_cache().unwrap();
    check(&mut m, &mut set, &mut seen);
    assert!(set.is_empty());
}
