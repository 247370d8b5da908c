//! KV cache groups: configuration errors, per-group tables and step buffers, release of dead
//! blocks (with its off-by-ones), prefix hits keyed by (hash, group) that do not collapse when a
//! sliding group has released its old blocks, forks and copy-on-write across groups, and a
//! one-Full-group config behaving exactly like the manager without groups.

mod common;

use common::GroupBufs;
use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use pagedkv::manager::{BlockManager, ManagerConfig, MAX_GROUPS};
use pagedkv::step::{OwnedGroupBuffers, OwnedStepBuffers, StepLayout};
use pagedkv::Error;

const FULL: AttentionKind = AttentionKind::Full;

fn cfg(num_blocks: u32, bs: u32, groups: Vec<AttentionKind>) -> ManagerConfig {
    let mut c = ManagerConfig::new(num_blocks, bs);
    c.watermark_blocks = 0;
    c.hash_seed = Some(7);
    c.groups = groups;
    c
}

fn layout() -> StepLayout {
    StepLayout {
        max_seqs: 8,
        max_tokens: 512,
        max_blocks_per_seq: 64,
        max_copies: 16,
        max_swaps: 0,
    }
}

type Bufs = GroupBufs;

impl Bufs {
    fn new(m: &BlockManager) -> Self {
        Self::with_layout(m, layout())
    }

    fn step(
        &mut self,
        m: &mut BlockManager,
        seqs: &[u64],
        n: &[u32],
    ) -> pagedkv::Result<pagedkv::StepInfo> {
        self.build(m, seqs, n)
    }
}

fn nulls(t: &[u32]) -> usize {
    t.iter().take_while(|&&b| b == NULL_BLOCK).count()
}

#[test]
fn bad_group_configs_are_typed_errors() {
    let field = |c: ManagerConfig| match BlockManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => (field, reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    let (f, r) = field(cfg(8, 4, vec![FULL, AttentionKind::Sliding { window: 0 }]));
    assert_eq!(f, "groups");
    assert!(r.contains("group 1") && r.contains("window"), "{r}");
    let (f, r) = field(cfg(8, 4, vec![FULL, AttentionKind::Chunked { chunk: 0 }]));
    assert_eq!(f, "groups");
    assert!(r.contains("chunk"), "{r}");
    let (f, _) = field(cfg(8, 4, vec![AttentionKind::Sliding { window: 8 }, FULL]));
    assert_eq!(f, "groups");
    let mut c = cfg(8, 4, vec![FULL, AttentionKind::Sliding { window: 8 }]);
    c.num_host_blocks = 4;
    // Swap and the host tier work with groups.
    BlockManager::new(c.clone()).unwrap();
    c.host_cache = true;
    assert!(BlockManager::new(c).is_ok());
    // KV events name each block's group (tests/events.rs): accepted with groups.
    let mut c = cfg(8, 4, vec![FULL, AttentionKind::Chunked { chunk: 8 }]);
    c.kv_event_capacity = 16;
    assert!(BlockManager::new(c).is_ok());
    let (f, _) = field(cfg(8, 4, vec![FULL; MAX_GROUPS + 1]));
    assert_eq!(f, "groups");
    // One Full group is the manager without groups.
    let m = BlockManager::new(cfg(8, 4, vec![FULL])).unwrap();
    assert_eq!(m.num_groups(), 1);
}

#[test]
fn unknown_group_and_bad_group_buffers_change_nothing() {
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = BlockManager::new(cfg(32, 4, vec![FULL, s])).unwrap();
    m.admit(1, &(0..10).collect::<Vec<_>>()).unwrap();
    assert!(matches!(
        m.block_table_group(1, 2),
        Err(Error::InvalidArgument {
            what: "group",
            value: 2,
            ..
        })
    ));
    assert!(matches!(
        m.group_kind(9),
        Err(Error::InvalidArgument { what: "group", .. })
    ));
    assert_eq!(m.group_kind(1).unwrap(), s);
    let before = (
        m.block_table_group(1, 1).unwrap().to_vec(),
        m.num_free_blocks(),
    );
    // Plain build_step on a two-group manager: no buffers for group 1.
    let mut ob = OwnedStepBuffers::new(layout());
    assert!(matches!(
        m.build_step(&[1], &[10], &mut ob.view()),
        Err(Error::InvalidArgument {
            what: "groups.len",
            value: 0,
            ..
        })
    ));
    // A group block table too small for the batch.
    let mut gob = OwnedGroupBuffers::new(layout(), 1);
    gob.block_tables[0].truncate(2);
    let mut g = gob.views();
    assert_eq!(
        m.build_step_groups(&[1], &[10], &mut ob.view(), &mut g),
        Err(Error::BufferTooSmall {
            buffer: "group_block_tables",
            needed: 64,
            capacity: 2
        })
    );
    drop(g);
    let mut gob = OwnedGroupBuffers::new(layout(), 1);
    gob.slot_mappings[0].truncate(3);
    let mut g = gob.views();
    assert!(matches!(
        m.build_step_groups(&[1], &[10], &mut ob.view(), &mut g),
        Err(Error::BufferTooSmall {
            buffer: "group_slot_mapping",
            ..
        })
    ));
    drop(g);
    assert_eq!(
        (
            m.block_table_group(1, 1).unwrap().to_vec(),
            m.num_free_blocks()
        ),
        before
    );
    m.check_invariants().unwrap();
}

#[test]
fn sliding_group_releases_exactly_the_dead_blocks() {
    // B = 4, W = 4: a query at p reads [p - 3, p]. Block 0 ([0, 4)) is dead once the first
    // position still to compute is 7 (reads from 4), not at 6 (reads from 3).
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = BlockManager::new(cfg(32, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[1, 2, 3, 4, 5, 6]).unwrap();
    assert_eq!(m.block_table_group(1, 1).unwrap().len(), 2);
    let free0 = m.num_free_blocks();
    assert_eq!(free0, 32 - 4);
    b.step(&mut m, &[1], &[6]).unwrap();
    m.append(1, &[7]).unwrap(); // len 7, c = 6
    b.step(&mut m, &[1], &[1]).unwrap();
    assert_eq!(nulls(m.block_table_group(1, 1).unwrap()), 0);
    let old = m.block_table_group(1, 1).unwrap()[0];
    m.append(1, &[8]).unwrap(); // len 8, c = 7
    let info = b.step(&mut m, &[1], &[1]).unwrap();
    let t1 = m.block_table_group(1, 1).unwrap().to_vec();
    assert_eq!(nulls(&t1), 1);
    assert_eq!(t1[0], NULL_BLOCK);
    // The row written this step shows the placeholder (-1) and the slot maps through group 1.
    assert_eq!(&b.gob.block_tables[0][..2], &[-1, t1[1] as i32]);
    assert_eq!(b.gob.slot_mappings[0][0], t1[1] as i64 * 4 + 3);
    assert_eq!(info.num_tokens, 1);
    // The released block was full and hashed: cached-free, not forgotten.
    assert_eq!(m.block_refcount(old).unwrap(), 0);
    assert!(m.block_hash(old).is_some());
    assert_eq!(m.stats().cached_free_blocks, 1);
    // Group 0 keeps everything.
    assert_eq!(nulls(m.block_table(1).unwrap()), 0);
    // A long decode keeps group 1 at most ceil((W - 1) / B) + 1 = 2 live blocks.
    for t in 9..60u32 {
        m.append(1, &[t]).unwrap();
        b.step(&mut m, &[1], &[1]).unwrap();
        let g1 = m.block_table_group(1, 1).unwrap();
        assert!(g1.len() - nulls(g1) <= 2);
        m.check_invariants().unwrap();
    }
    m.free(1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 32);
}

#[test]
fn chunked_group_releases_finished_chunks() {
    // C = 8, B = 4: once position 8 is computed from, chunk [0, 8) (blocks 0 and 1) is dead.
    let c = AttentionKind::Chunked { chunk: 8 };
    let mut m = BlockManager::new(cfg(32, 4, vec![FULL, c])).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &(0..8).collect::<Vec<_>>()).unwrap();
    b.step(&mut m, &[1], &[8]).unwrap();
    assert_eq!(nulls(m.block_table_group(1, 1).unwrap()), 0);
    m.append(1, &[8]).unwrap();
    b.step(&mut m, &[1], &[1]).unwrap();
    assert_eq!(nulls(m.block_table_group(1, 1).unwrap()), 2);
    // A prompt sharing the first chunk: group 0 hits blocks 0 and 1; the chunked group needs
    // nothing of a finished chunk at boundary 8, so it takes null entries, not hits.
    let r = m.admit(2, &(0..20).collect::<Vec<_>>()).unwrap();
    assert_eq!(r.cached_tokens, 8);
    assert_eq!(nulls(m.block_table_group(2, 1).unwrap()), 2);
    assert_eq!(r.new_blocks, 3 + 3);
    // A cold prefill crossing a chunk boundary keeps every block (its first position is 0).
    m.admit(3, &(100..120).collect::<Vec<_>>()).unwrap();
    b.step(&mut m, &[3], &[20]).unwrap();
    assert_eq!(nulls(m.block_table_group(3, 1).unwrap()), 0);
    // Its next decode step starts in chunk [16, 24): blocks 0..3 are dead.
    m.append(3, &[1]).unwrap();
    b.step(&mut m, &[3], &[1]).unwrap();
    assert_eq!(nulls(m.block_table_group(3, 1).unwrap()), 4);
    m.check_invariants().unwrap();
}

#[test]
fn one_full_group_is_the_plain_manager() {
    let script = |m: &mut BlockManager| {
        let mut ob = OwnedStepBuffers::new(layout());
        let p: Vec<u32> = (0..37).collect();
        m.admit(1, &p).unwrap();
        m.build_step(&[1], &[37], &mut ob.view()).unwrap();
        m.fork(1, 2).unwrap();
        m.append_batch(&[1, 2], &[5, 6]).unwrap();
        m.build_step(&[1, 2], &[1, 1], &mut ob.view()).unwrap();
        m.free(1).unwrap();
        let r = m.admit(3, &p).unwrap();
        (
            r,
            m.block_table(2).unwrap().to_vec(),
            m.block_table(3).unwrap().to_vec(),
            m.num_free_blocks(),
            ob.block_tables.clone(),
            ob.copies.clone(),
        )
    };
    let mut plain = BlockManager::new(cfg(40, 4, vec![])).unwrap();
    let mut one = BlockManager::new(cfg(40, 4, vec![FULL])).unwrap();
    assert_eq!(script(&mut plain), script(&mut one));
}

#[test]
fn prefix_hit_keeps_what_each_group_reads_and_does_not_collapse() {
    // B = 4, sliding W = 4. Sequence 1 prefills 24 tokens in three chunks, so its sliding group
    // releases blocks 0..3 along the way; they are hashed, hence cached-free.
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = BlockManager::new(cfg(40, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    let p: Vec<u32> = (100..124).collect();
    m.admit_opts(1, &p, None, Some(8)).unwrap();
    b.step(&mut m, &[1], &[8]).unwrap();
    m.append(1, &p[8..16]).unwrap();
    b.step(&mut m, &[1], &[8]).unwrap(); // c = 8: first needed 5, block 0 dead
    m.append(1, &p[16..24]).unwrap();
    b.step(&mut m, &[1], &[8]).unwrap(); // c = 16: first needed 13, blocks 0..3 dead
    let g1 = m.block_table_group(1, 1).unwrap().to_vec();
    assert_eq!(nulls(&g1), 3);
    assert_eq!(m.stats().cached_free_blocks, 3);
    // The same prompt: group 0 hits blocks 0..5 ((24 - 1) / 4 = 5); the sliding group needs only
    // the window ending at position 20, [17, 20] = block 4, which sequence 1 still holds.
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 20);
    let g2 = m.block_table_group(2, 1).unwrap().to_vec();
    assert_eq!(nulls(&g2), 4);
    assert_eq!(g2[4], g1[4], "the window block is shared");
    assert_ne!(g2[5], g1[5], "past the boundary: fresh");
    assert_eq!(
        &m.block_table(2).unwrap()[..5],
        &m.block_table(1).unwrap()[..5]
    );
    // New blocks: one per group for [5, 6).
    assert_eq!(r.new_blocks, 2);
    m.check_invariants().unwrap();

    // A shorter prompt ending at 13 tokens: boundary 3 blocks (12 tokens); the window ending
    // there is [9, 12) → block 2, released by sequence 1 but cached-free: revived.
    let r = m.admit(3, &p[..13]).unwrap();
    assert_eq!(r.cached_tokens, 12);
    let g3 = m.block_table_group(3, 1).unwrap().to_vec();
    assert_eq!(nulls(&g3), 2);
    assert_eq!(g3[2], g1_released(&m, 3, 2));
    m.check_invariants().unwrap();
}

#[test]
fn a_step_cannot_recompute_positions_a_group_released() {
    // B = 4, sliding W = 1, chunked C = 1. Sequence 1 computes [4, 5, 6, 4]; sequence 2's prompt
    // starts with it, so its admission hits 4 tokens and its windowed groups' block 0 is null.
    // Recomputing the whole prompt would read and write released blocks: refused, unchanged.
    let g = vec![
        FULL,
        AttentionKind::Sliding { window: 1 },
        AttentionKind::Chunked { chunk: 1 },
    ];
    let mut m = BlockManager::new(cfg(48, 4, g)).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &[4, 5, 6, 4]).unwrap();
    b.step(&mut m, &[1], &[4]).unwrap();
    let p = [4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5];
    assert_eq!(m.admit(2, &p).unwrap().cached_tokens, 4);
    let before: Vec<Vec<u32>> = (0..3)
        .map(|g| m.block_table_group(2, g).unwrap().to_vec())
        .collect();
    let free = m.num_free_blocks();
    match b.step(&mut m, &[2], &[11]) {
        Err(Error::InvalidArgument {
            what,
            value,
            reason,
        }) => {
            assert_eq!((what, value), ("num_new", 11));
            assert!(reason.contains("at most its last 7 of 11"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    for (g, t) in before.iter().enumerate() {
        assert_eq!(m.block_table_group(2, g).unwrap(), &t[..]);
    }
    assert_eq!(m.num_free_blocks(), free);
    // The uncached tail steps; so does a batch holding both sequences.
    b.step(&mut m, &[2], &[7]).unwrap();
    m.append_batch(&[1, 2], &[0, 0]).unwrap();
    b.step(&mut m, &[1, 2], &[1, 1]).unwrap();
    m.check_invariants().unwrap();
}

/// The group-1 block sequence `seq` holds at index `i` (checked to be hashed: a revived hit).
fn g1_released(m: &BlockManager, seq: u64, i: usize) -> u32 {
    let b = m.block_table_group(seq, 1).unwrap()[i];
    assert!(m.block_hash(b).is_some());
    b
}

#[test]
fn hit_shortens_to_a_boundary_whose_window_is_complete() {
    // Sliding W = 8 over B = 4: the window ending at boundary k reads blocks
    // [dead(k * 4), k). Evict two cached sliding blocks, and the hit stops at the longest
    // boundary whose window avoids them, not at the first missing block of the sliding group.
    let s = AttentionKind::Sliding { window: 8 };
    let mut m = BlockManager::new(cfg(30, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    let p: Vec<u32> = (0..25).collect();
    m.admit(1, &p).unwrap(); // 7 blocks per group
    b.step(&mut m, &[1], &[25]).unwrap();
    let g0 = m.block_table(1).unwrap().to_vec();
    let g1 = m.block_table_group(1, 1).unwrap().to_vec();
    m.free(1).unwrap();
    assert_eq!(
        (m.stats().free_blocks, m.stats().cached_free_blocks),
        (18, 12)
    );
    // Evict two chosen sliding blocks (5 and 4) by hand.
    assert!(m.debug_evict_block(g1[5]) && m.debug_evict_block(g1[4]));
    assert!(!m.debug_evict_block(g1[4]), "no longer cached-free");
    let cached = |blk: u32| m.block_hash(blk).is_some();
    assert!(!cached(g1[5]) && !cached(g1[4]) && cached(g1[3]) && cached(g1[2]));
    assert!(g0[..6].iter().all(|&x| cached(x)));
    // The rule: k = 6 needs group 1's [4, 6), k = 5 needs [3, 5) — both hold an evicted
    // block; k = 4 needs [2, 4): cached. So 16 tokens hit, with group 1 blocks 2 and 3 revived.
    let expect = (0..=6usize)
        .rev()
        .find(|&k| (s.first_needed(k * 4) / 4..k).all(|i| cached(g1[i])))
        .unwrap();
    assert_eq!(expect, 4);
    assert!(m.can_admit_tokens(&p, None, None).unwrap());
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 16);
    let t1 = m.block_table_group(2, 1).unwrap();
    assert_eq!(nulls(t1), 2);
    assert_eq!(&t1[2..4], &g1[2..4]);
    assert_eq!(&m.block_table(2).unwrap()[..4], &g0[..4]);
    m.check_invariants().unwrap();
}

#[test]
fn fork_copies_every_groups_shared_tail() {
    let s = AttentionKind::Sliding { window: 6 };
    let c = AttentionKind::Chunked { chunk: 8 };
    let mut m = BlockManager::new(cfg(64, 4, vec![FULL, s, c])).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &(0..10).collect::<Vec<_>>()).unwrap();
    b.step(&mut m, &[1], &[10]).unwrap();
    m.fork(1, 2).unwrap();
    let free = m.num_free_blocks();
    m.append_batch(&[1, 2], &[1, 2]).unwrap();
    // Sequence 1 copies its three shared tails; sequence 2's are then its own.
    assert_eq!(m.num_free_blocks(), free - 3);
    assert_eq!(m.pending_copies().len(), 3);
    let info = b.step(&mut m, &[1, 2], &[1, 1]).unwrap();
    assert_eq!(info.num_copies, 3);
    for g in 0..3 {
        let (t1, t2) = (
            m.block_table_group(1, g).unwrap(),
            m.block_table_group(2, g).unwrap(),
        );
        assert_ne!(t1.last(), t2.last(), "group {g} tails apart");
    }
    m.recompute(2).unwrap();
    m.check_invariants().unwrap();
    let r = m.resume(2, None).unwrap();
    assert_eq!(r.cached_tokens, 8);
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 64);
}

#[test]
fn eviction_takes_whole_boundaries_from_the_top() {
    // B = 4, sliding W = 4. A freed 17-token sequence leaves 4 full blocks per group cached.
    // Released by position from the tail, each position's sliding block before group 0's, two
    // evictions take position 3 of both groups: boundary 3 (12 tokens) still hits. Releasing all
    // of the sliding group first would have evicted its blocks 3 and 2, leaving only boundary 2.
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = BlockManager::new(cfg(12, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    let p: Vec<u32> = (0..17).collect();
    m.admit(1, &p).unwrap(); // 5 blocks per group
    b.step(&mut m, &[1], &[17]).unwrap();
    let (g0, g1) = (
        m.block_table(1).unwrap().to_vec(),
        m.block_table_group(1, 1).unwrap().to_vec(),
    );
    m.free(1).unwrap();
    assert_eq!(
        (m.stats().free_blocks, m.stats().cached_free_blocks),
        (4, 8)
    );
    // A 6-block filler (3 per group): the 4 free blocks and the 2 oldest cached ones.
    m.admit(9, &(1000..1012).collect::<Vec<_>>()).unwrap();
    assert_eq!(m.stats().evictions, 2);
    let cached = |blk: u32| m.block_hash(blk).is_some();
    assert!(!cached(g1[3]) && !cached(g0[3]));
    assert!(cached(g1[2]) && cached(g0[2]));
    m.free(9).unwrap();
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 12);
    m.check_invariants().unwrap();
}

/// Prefills `p` through `m` as sequence `id` in steps of `chunk` tokens (after any cached prefix).
fn prefill_in_steps(m: &mut BlockManager, b: &mut Bufs, id: u64, p: &[u32], chunk: usize) {
    let r = m.admit_opts(id, p, None, Some(chunk)).unwrap();
    let (cached, mut done) = (r.cached_tokens as usize, r.num_tokens as usize);
    b.step(m, &[id], &[(done - cached) as u32]).unwrap();
    while done < p.len() {
        let n = chunk.min(p.len() - done);
        m.append(id, &p[done..done + n]).unwrap();
        b.step(m, &[id], &[n as u32]).unwrap();
        done += n;
    }
}

#[test]
fn blocks_released_past_the_shared_prefix_are_evicted_first() {
    // B = 4, sliding W = 4. Sequence 1 prefills 24 tokens in three steps of 8: its sliding group
    // releases blocks 0..3 mid-run. Nothing else shared its prompt, so they serve boundaries no
    // other request has reached: they go to the LRU's evicting end, before an idle sequence's
    // history freed earlier.
    let s = AttentionKind::Sliding { window: 4 };
    let mut m = BlockManager::new(cfg(40, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    let idle: Vec<u32> = (500..509).collect(); // 9 tokens: 2 full blocks per group cached
    m.admit(7, &idle).unwrap();
    b.step(&mut m, &[7], &[9]).unwrap();
    m.free(7).unwrap();
    assert_eq!(m.stats().cached_free_blocks, 4);
    let p: Vec<u32> = (100..124).collect();
    prefill_in_steps(&mut m, &mut b, 1, &p, 8);
    assert_eq!(nulls(m.block_table_group(1, 1).unwrap()), 3);
    assert_eq!(m.stats().cached_free_blocks, 7);
    // A filler needing the free blocks and 2 more evicts two of the three released blocks.
    let free = m.stats().free_blocks;
    assert_eq!(free % 2, 0);
    let filler: Vec<u32> = (2000..2000 + 2 * (free as u32 + 2)).collect();
    m.admit(9, &filler).unwrap();
    assert_eq!(m.stats().evictions, 2);
    m.free(9).unwrap();
    assert_eq!(
        m.admit(8, &idle).unwrap().cached_tokens,
        8,
        "the idle history still hits"
    );
    m.check_invariants().unwrap();
}

/// A chat-shaped scenario for the rule on windows released mid-run inside a shared prefix. B = 4,
/// sliding W = 8: boundary k needs group 0's [0, k) and the sliding blocks k - 2 and k - 1, and a
/// step from position c releases the blocks before `(c - 7) / 4`. An idle history E (9 tokens:
/// 2 full blocks per group, the LRU's oldest entries), then a session's first turn A = S ++ X
/// (S an 8-token system prompt, 16 tokens) prefilled and freed. C and D, two other sessions'
/// first turns S ++ 9 tokens, both hit boundary 2 (8 tokens), holding group 0's blocks of S and
/// A's sliding blocks 0 and 1 (`s01`), and prefill their own 9 tokens.
struct Chat {
    m: BlockManager,
    b: Bufs,
    idle: Vec<u32>,
    s01: [u32; 2],
}

fn chat_scenario() -> Chat {
    let s = AttentionKind::Sliding { window: 8 };
    let mut m = BlockManager::new(cfg(64, 4, vec![FULL, s])).unwrap();
    let mut b = Bufs::new(&m);
    let idle: Vec<u32> = (500..509).collect();
    m.admit(7, &idle).unwrap();
    b.step(&mut m, &[7], &[9]).unwrap();
    m.free(7).unwrap();
    let a: Vec<u32> = (100..108).chain(200..208).collect();
    m.admit(1, &a).unwrap();
    b.step(&mut m, &[1], &[16]).unwrap();
    let s1 = m.block_table_group(1, 1).unwrap().to_vec();
    m.free(1).unwrap();
    for (id, own) in [(3u64, 300u32), (4, 400)] {
        let p: Vec<u32> = (100..108).chain(own..own + 9).collect();
        assert_eq!(m.admit(id, &p).unwrap().cached_tokens, 8);
        assert_eq!(m.block_table_group(id, 1).unwrap()[..2], s1[..2]);
        b.step(&mut m, &[id], &[9]).unwrap();
    }
    Chat {
        m,
        b,
        idle,
        s01: [s1[0], s1[1]],
    }
}

impl Chat {
    /// Appends one token to `id` and steps it alone.
    fn decode(&mut self, id: u64) {
        self.m.append(id, &[7]).unwrap();
        self.b.step(&mut self.m, &[id], &[1]).unwrap();
    }
    /// Admits and frees a filler that takes every free block and 2 or 3 cached-free ones (a
    /// filler takes blocks in pairs, one per group); returns the evictions.
    fn evict_a_few(&mut self) -> u64 {
        let free = self.m.stats().free_blocks as u32;
        let before = self.m.stats().evictions;
        let e = 2 + free % 2;
        let filler: Vec<u32> = (3000..3000 + 2 * (free + e)).collect();
        self.m.admit(10, &filler).unwrap();
        assert_eq!(self.m.stats().evictions, before + e as u64);
        self.m.free(10).unwrap();
        e as u64
    }
    fn cached(&self, blk: u32) -> bool {
        self.m.block_hash(blk).is_some()
    }
    /// Cached tokens of a new session's first turn on the system prompt (admitted and freed).
    fn system_prompt_hit(&mut self) -> u32 {
        let p: Vec<u32> = (100..108).chain(900..909).collect();
        let r = self.m.admit(11, &p).unwrap().cached_tokens;
        self.m.free(11).unwrap();
        r
    }
}

#[test]
fn blocks_released_inside_a_shared_prefix_keep_their_recency() {
    // C steps past the system prompt's window first (the sliding blocks 0 and 1 stay held by D),
    // then D. D is the second admission whose group-0 run ended at the system prompt's last
    // block (C was the first): the window ending there is in demand, so D keeps holding it
    // (still referenced, out of its table) while it runs. The evictions take the idle history's
    // oldest entries, not them.
    let mut c = chat_scenario();
    c.decode(3);
    assert_eq!(c.m.block_refcount(c.s01[0]).unwrap(), 1, "D still reads it");
    c.decode(4);
    assert_eq!(c.m.block_table_group(4, 1).unwrap()[..2], [NULL_BLOCK; 2]);
    assert_eq!(c.m.block_refcount(c.s01[0]).unwrap(), 1, "D holds it");
    assert_eq!(c.m.seq_blocks_held(4).unwrap(), 5 + 3 + 2);
    // E's 4 blocks and A's blocks 2 and 3 of both groups.
    assert_eq!(c.m.stats().cached_free_blocks, 4 + 4);
    c.evict_a_few();
    assert!(c.cached(c.s01[0]) && c.cached(c.s01[1]));
    assert_eq!(
        c.system_prompt_hit(),
        8,
        "the next session hits the system prompt"
    );
    c.m.check_invariants().unwrap();

    // C finishes before D leaves the window: nothing else runs on the system prompt. But D is
    // the second admission whose group-0 run ended at the system prompt's last block (C was the
    // first), so the window ending there is one several requests reach: D's released windows
    // keep their recency too, and the evictions take the idle history instead.
    let mut c = chat_scenario();
    c.decode(3);
    c.m.free(3).unwrap();
    c.decode(4);
    let e = c.evict_a_few();
    assert_eq!(e, 2);
    assert!(c.cached(c.s01[0]) && c.cached(c.s01[1]));
    assert_eq!(c.system_prompt_hit(), 8);
    let idle = c.idle.clone();
    let r = c.m.admit(12, &idle).unwrap();
    assert_eq!(
        r.cached_tokens, 4,
        "the idle history lost its last boundary"
    );
    c.m.check_invariants().unwrap();
}

#[test]
fn a_sessions_own_stale_windows_go_to_the_evicting_end() {
    // The session's second turn B = A ++ 5 tokens hits all of A (boundary 4: group 0's 4 blocks,
    // sliding blocks 2 and 3, all inside the prefix group 0 had cached at its admission) and
    // decodes past that window: blocks 2 and 3 are released mid-run with group 0's twins held by
    // B alone (its own earlier turn). They go to the evicting end, ahead of the idle history; D's
    // windows of the system prompt, released while C and B run on it, keep their recency. (The
    // previous rule kept every release inside the admission's shared prefix recent: the
    // evictions took the idle history and left B's stale windows cached.)
    let mut c = chat_scenario();
    let turn2: Vec<u32> = (100..108).chain(200..208).chain(600..605).collect();
    assert_eq!(c.m.admit(2, &turn2).unwrap().cached_tokens, 16);
    let own = c.m.block_table_group(2, 1).unwrap().to_vec();
    assert_eq!(nulls(&own), 2);
    c.b.step(&mut c.m, &[2], &[5]).unwrap();
    c.decode(3);
    c.decode(4);
    for _ in 0..4 {
        c.decode(2);
    }
    assert_eq!(nulls(c.m.block_table_group(2, 1).unwrap()), 4);
    let e = c.evict_a_few();
    assert!(
        !c.cached(own[2]) && !c.cached(own[3]),
        "own stale windows go first"
    );
    assert!(c.cached(c.s01[0]) && c.cached(c.s01[1]));
    assert_eq!(c.system_prompt_hit(), 8);
    let idle = c.idle.clone();
    let r = c.m.admit(12, &idle).unwrap();
    assert_eq!(
        r.cached_tokens,
        if e == 2 { 8 } else { 4 },
        "the idle history"
    );
    c.m.check_invariants().unwrap();
}
