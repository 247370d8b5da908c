//! The KV-event ring through the manager: stored at step time with the chain's parent, removed
//! on eviction and swap-out, cleared on reset, nothing when disabled, overflow counted.

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
