//! Swap with KV cache groups: a swapped-out sequence moves every held block of every group to the
//! host (released entries stay null), swap-in restores each group's table, shared blocks of a fork
//! group travel once per group, the cost model counts every group's blocks, freeing or recomputing
//! a swapped sequence releases every host block, and swapped-in blocks are found again by a prefix
//! hit in every group.
//!
//! KV content is simulated as in `swap.rs`, per group (`common::GroupSim`): `dev[b]` / `host[h]`
//! hold one value per token slot; a step applies its lists in the documented order (swap-out,
//! swap-in, copy-on-write) and then writes, through each group's slot mapping, `10 * token + group`
//! for each new token. After any step, every non-null entry of every group's table must hold its
//! group's values.

mod common;

use common::{group_config as config, toks, GroupSim as Sim, B};
use pagedkv::groups::NULL_BLOCK;
use pagedkv::manager::BlockManager;
use pagedkv::step::StepInfo;
use pagedkv::swap::{CostModel, PreemptMode, SeqState};
use pagedkv::{Error, SeqId, TokenId};

impl Sim {
    fn new(num_blocks: u32, num_host_blocks: u32, max_swaps: usize) -> Self {
        Self::with_config(config(num_blocks, num_host_blocks), max_swaps)
    }

    fn step(&mut self, seqs: &[SeqId], new: &[u32]) -> pagedkv::Result<StepInfo> {
        self.run_step(seqs, new)
    }

    fn admit(&mut self, sid: SeqId, toks: Vec<TokenId>) -> u32 {
        let r = self.m.admit(sid, &toks).unwrap();
        self.tokens.insert(sid, toks);
        self.step(&[sid], &[r.num_tokens - r.cached_tokens])
            .unwrap();
        r.cached_tokens
    }

    fn decode(&mut self, sids: &[SeqId], t: TokenId) {
        for &sid in sids {
            self.m.append(sid, &[t + sid as TokenId]).unwrap();
            self.tokens.get_mut(&sid).unwrap().push(t + sid as TokenId);
        }
        self.step(sids, &vec![1; sids.len()]).unwrap();
    }

    fn fork(&mut self, p: SeqId, c: SeqId) {
        self.m.fork(p, c).unwrap();
        let t = self.tokens[&p].clone();
        self.tokens.insert(c, t);
    }

    fn tables(&self, sid: SeqId) -> Vec<Vec<u32>> {
        (0..self.m.num_groups())
            .map(|g| self.m.block_table_group(sid, g).unwrap().to_vec())
            .collect()
    }
}

fn held(tables: &[Vec<u32>]) -> usize {
    tables
        .iter()
        .flatten()
        .filter(|&&b| b != NULL_BLOCK)
        .count()
}

fn nulls(tables: &[Vec<u32>]) -> Vec<Vec<bool>> {
    tables
        .iter()
        .map(|t| t.iter().map(|&b| b == NULL_BLOCK).collect())
        .collect()
}

#[test]
fn host_cache_and_swap_are_accepted_with_groups() {
    BlockManager::new(config(16, 8)).unwrap();
    let mut c = config(16, 8);
    c.host_cache = true;
    let m = BlockManager::new(c).unwrap();
    assert_eq!(m.num_groups(), 3);
}

#[test]
fn round_trip_moves_every_group_and_keeps_released_entries_null() {
    let mut s = Sim::new(64, 64, 64);
    s.admit(1, toks(18, 100));
    s.admit(2, toks(9, 300));
    for t in 0..9 {
        s.decode(&[1, 2], 1000 + 10 * t);
    }
    let before1 = s.tables(1);
    let before2 = s.tables(2);
    // The windowed groups have released blocks: the round trip must keep those null.
    assert!(before1[1][0] == NULL_BLOCK && before1[2][0] == NULL_BLOCK);
    let held1 = held(&before1);
    assert_eq!(s.m.seq_blocks_held(1).unwrap(), held1);
    let free_before = s.m.num_free_blocks();
    let out = s.m.swap_out(&[1]).unwrap();
    assert_eq!(out.len(), held1, "one copy per held block of every group");
    assert_eq!(s.m.seq_state(1).unwrap(), SeqState::Swapped);
    let host = s.tables(1);
    assert_eq!(nulls(&host), nulls(&before1));
    let mut ids: Vec<u32> = host
        .iter()
        .flatten()
        .copied()
        .filter(|&h| h != NULL_BLOCK)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        held1,
        "distinct host blocks, one per device block"
    );
    for &h in &ids {
        assert_eq!(s.m.host_block_refcount(h).unwrap(), 1);
    }
    assert_eq!(s.m.num_free_blocks(), free_before + held1);
    assert_eq!(s.m.stats().swapped_out_blocks, held1 as u64);
    s.m.check_invariants().unwrap();

    // Sequence 2 keeps running and reuses freed blocks while 1 is out.
    let info = s.step(&[2], &[1]).unwrap();
    assert_eq!(info.num_swap_out, held1);
    for t in 0..6 {
        s.decode(&[2], 2000 + 10 * t);
    }
    s.check_content(2);
    s.m.check_invariants().unwrap();

    let back = s.m.swap_in(&[1]).unwrap();
    assert_eq!(back.len(), held1);
    let after = s.tables(1);
    assert_eq!(nulls(&after), nulls(&before1));
    assert_eq!(s.m.seq_blocks_held(1).unwrap(), held1);
    assert_eq!(
        s.m.num_free_host_blocks(),
        64 - held1,
        "held by the queued copies"
    );
    s.m.check_invariants().unwrap();
    let info = s.step(&[1, 2], &[1, 1]).unwrap();
    assert_eq!(info.num_swap_in, held1);
    assert_eq!(s.m.num_free_host_blocks(), 64);
    s.check_content(1);
    s.check_content(2);
    for t in 0..10 {
        s.decode(&[1, 2], 3000 + 10 * t);
        s.check_content(1);
        s.check_content(2);
        s.m.check_invariants().unwrap();
    }
    assert_ne!(before2, s.tables(2));
    s.m.free(1).unwrap();
    s.m.free(2).unwrap();
    s.m.check_invariants().unwrap();
    assert_eq!(s.m.num_free_blocks(), 64);
}

#[test]
fn forked_group_shares_every_groups_blocks_on_the_host_and_back() {
    let mut s = Sim::new(96, 96, 96);
    s.admit(1, toks(14, 50));
    s.fork(1, 2);
    s.fork(1, 3);
    for t in 0..3 {
        s.decode(&[1, 2, 3], 700 + 10 * t);
    }
    let total: usize = [1, 2, 3].iter().map(|&i| held(&s.tables(i))).sum();
    let mut distinct: Vec<u32> = [1, 2, 3]
        .iter()
        .flat_map(|&i| s.tables(i).into_iter().flatten())
        .filter(|&b| b != NULL_BLOCK)
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(
        distinct.len() < total,
        "the forks share blocks in some group"
    );
    let out = s.m.swap_out(&[1, 2, 3]).unwrap();
    assert_eq!(out.len(), distinct.len(), "a shared block is copied once");
    s.m.check_invariants().unwrap();
    s.step(&[], &[]).unwrap();
    let back = s.m.swap_in(&[1, 2, 3]).unwrap();
    assert_eq!(back.len(), distinct.len());
    s.step(&[1, 2, 3], &[1, 1, 1]).unwrap();
    let mut again: Vec<u32> = [1, 2, 3]
        .iter()
        .flat_map(|&i| s.tables(i).into_iter().flatten())
        .filter(|&b| b != NULL_BLOCK)
        .collect();
    again.sort_unstable();
    again.dedup();
    assert_eq!(again.len(), distinct.len(), "shared again on the device");
    for i in [1, 2, 3] {
        s.check_content(i);
    }
    // Diverging again copies each group's shared tail.
    for t in 0..8 {
        s.decode(&[1, 2, 3], 900 + 10 * t);
        for i in [1, 2, 3] {
            s.check_content(i);
        }
        s.m.check_invariants().unwrap();
    }
    s.m.free_batch(&[1, 2, 3]).unwrap();
    s.m.check_invariants().unwrap();
    assert_eq!(s.m.num_free_blocks(), 96);
}

#[test]
fn free_and_recompute_of_a_swapped_sequence_release_every_host_block() {
    let mut s = Sim::new(64, 32, 64);
    s.admit(1, toks(21, 10));
    s.admit(2, toks(21, 500));
    for t in 0..5 {
        s.decode(&[1, 2], 5000 + 10 * t);
    }
    s.m.swap_out(&[1]).unwrap();
    s.m.swap_out(&[2]).unwrap();
    assert!(s.m.num_free_host_blocks() < 32);
    s.m.free(1).unwrap();
    s.m.check_invariants().unwrap();
    s.m.recompute(2).unwrap();
    assert_eq!(s.m.seq_state(2).unwrap(), SeqState::Recompute);
    s.m.check_invariants().unwrap();
    // The queued copies went with their last holders.
    assert!(s.m.pending_swap_out().is_empty());
    assert_eq!(s.m.num_free_host_blocks(), 32);
    let r = s.m.resume(2, None).unwrap();
    assert_eq!(r.num_tokens, s.tokens[&2].len() as u32);
    s.m.check_invariants().unwrap();
}

#[test]
fn swapped_in_blocks_are_hit_again_in_every_group() {
    let mut s = Sim::new(64, 64, 64);
    let prompt = toks(24, 40);
    s.admit(1, prompt.clone());
    let device = s.tables(1);
    assert!(device
        .iter()
        .flatten()
        .any(|&b| b != NULL_BLOCK && s.m.block_hash(b).is_some()));
    s.m.swap_out(&[1]).unwrap();
    // While swapped out, none of its blocks is findable: every group's left the prefix cache.
    for &b in device.iter().flatten().filter(|&&b| b != NULL_BLOCK) {
        assert_eq!(s.m.block_hash(b), None, "block {b}");
    }
    let mut probe = prompt.clone();
    probe.push(1);
    s.m.swap_in(&[1]).unwrap();
    s.step(&[1], &[1]).unwrap();
    s.check_content(1);
    // Back on the device, a prompt extending it hits every block in every group.
    assert_eq!(s.admit(3, probe), 24);
    s.check_content(3);
    let t1 = s.tables(1);
    let t3 = s.tables(3);
    for g in 0..3 {
        for (j, &b) in t3[g].iter().enumerate().take(6) {
            if b != NULL_BLOCK {
                assert_eq!(b, t1[g][j], "group {g} block {j} shared");
            }
        }
    }
    s.m.check_invariants().unwrap();
}

#[test]
fn swap_list_overflow_emits_every_group_block_a_step_needs() {
    // Room for 2 swap pairs a step: the queued copies drain over steps, and a step scheduling
    // the swapped-in sequence must emit every copy its tables (all groups) read.
    let mut s = Sim::new(64, 64, 2);
    s.admit(1, toks(10, 20));
    s.admit(2, toks(10, 400));
    let held1 = held(&s.tables(1));
    s.m.swap_out(&[1]).unwrap();
    let mut emitted = 0;
    while !s.m.pending_swap_out().is_empty() {
        emitted += s.step(&[], &[]).unwrap().num_swap_out;
    }
    assert_eq!(emitted, held1);
    s.m.swap_in(&[1]).unwrap();
    // Scheduling it needs all of its swap-ins at once: more than the room.
    let before = s.m.pending_swap_in().len();
    assert!(matches!(
        s.step(&[1], &[1]),
        Err(Error::BufferTooSmall {
            buffer: "swap_in",
            ..
        })
    ));
    assert_eq!(s.m.pending_swap_in().len(), before);
    while !s.m.pending_swap_in().is_empty() {
        s.step(&[2], &[1]).unwrap();
    }
    s.step(&[1], &[1]).unwrap();
    s.check_content(1);
    s.check_content(2);
    s.m.check_invariants().unwrap();
}

#[test]
fn cost_model_counts_every_groups_blocks() {
    let mut s = Sim::new(64, 64, 64);
    s.admit(1, toks(30, 1));
    for t in 0..4 {
        s.decode(&[1], 60 + 10 * t);
    }
    let held1 = s.m.seq_blocks_held(1).unwrap();
    assert!(held1 > s.m.block_table(1).unwrap().len());
    let model = CostModel::new(1e9, 1e4, 1e3);
    let d = s.m.decide(&[1], &model).unwrap();
    assert_eq!(d.swap_blocks, held1 as u64);
    assert!((d.swap_cost_s - model.swap_cost(held1 as u64, B as u64)).abs() < 1e-15);
    // Nothing else holds its blocks: a recompute redoes every token.
    assert_eq!(d.recompute_tokens, s.tokens[&1].len() as u64);
    assert!(d.swap_possible);
    // A host pool too small for every group's blocks (but big enough for group 0's) cannot swap.
    let mut small = Sim::new(64, 9, 64);
    small.admit(1, toks(30, 1));
    assert!(small.m.block_table(1).unwrap().len() <= 9);
    let d = small.m.decide(&[1], &model).unwrap();
    assert!(!d.swap_possible && d.mode == PreemptMode::Recompute);
    assert!(matches!(
        small.m.swap_out(&[1]),
        Err(Error::OutOfHostBlocks { .. })
    ));
    small.m.check_invariants().unwrap();
}

#[test]
fn recompute_estimate_follows_the_group_hit_rule() {
    // Sequence 2 shares sequence 1's prompt in every group. Preempting 2 alone, 1 keeps the
    // shared blocks: a recompute of 2 redoes only its own tokens. Once 1 has decoded on, its
    // windowed groups released the windows 2's boundaries need: group 0's prefix is still held
    // by 1, but no boundary is complete in every group, so the whole of 2 is to recompute.
    let mut s = Sim::new(96, 64, 64);
    let prompt = toks(24, 7);
    s.admit(1, prompt.clone());
    let mut p2 = prompt.clone();
    p2.extend(toks(3, 900));
    assert_eq!(s.admit(2, p2), 24);
    let model = CostModel::new(1e9, 1e4, 1e3);
    let d = s.m.decide(&[2], &model).unwrap();
    assert_eq!(d.recompute_tokens, 27 - 24);
    for t in 0..16 {
        s.decode(&[1], 2000 + t);
    }
    let t1 = s.tables(1);
    assert_eq!(
        t1[0][..6],
        s.tables(2)[0][..6],
        "group 0's prefix still shared"
    );
    assert!(t1[1][..6].iter().all(|&b| b == NULL_BLOCK));
    let d = s.m.decide(&[2], &model).unwrap();
    assert_eq!(d.recompute_tokens, 27);
    s.m.check_invariants().unwrap();
}

#[test]
fn provisional_tokens_are_dropped_from_every_group_before_a_swap() {
    // A host pool of exactly the committed blocks (9 in three groups) is enough: the drafts
    // own blocks are dropped by the swap's rewind, never copied or counted.
    let host = 9;
    let mut cfg = config(64, host);
    cfg.max_provisional = 6;
    let mut s = Sim::new(64, host, 64);
    s.m = BlockManager::new(cfg).unwrap();
    s.admit(1, toks(14, 30));
    for t in 0..3 {
        s.decode(&[1], 400 + t);
    }
    let committed = s.tables(1);
    assert_eq!(held(&committed), host as usize);
    let len = s.m.seq_len(1).unwrap();
    // Six drafts reach into two new blocks of every group.
    s.m.append_provisional(1, 6).unwrap();
    assert!(s.m.block_table(1).unwrap().len() > committed[0].len());
    let d = s.m.decide(&[1], &CostModel::new(1e9, 1e4, 1e3)).unwrap();
    assert_eq!(d.swap_blocks, host as u64);
    assert!(d.swap_possible);
    let out = s.m.swap_out(&[1]).unwrap();
    assert_eq!(s.m.seq_len(1).unwrap(), len, "the drafts were rewound");
    assert_eq!(
        out.len(),
        held(&committed),
        "only the committed blocks travel"
    );
    assert_eq!(nulls(&s.tables(1)), nulls(&committed));
    s.m.check_invariants().unwrap();
    s.step(&[], &[]).unwrap();
    s.m.swap_in(&[1]).unwrap();
    s.step(&[1], &[1]).unwrap();
    s.check_content(1);
    s.m.check_invariants().unwrap();
    s.m.free(1).unwrap();
    assert_eq!(s.m.num_free_blocks(), 64);
    assert_eq!(s.m.num_free_host_blocks(), host as usize);
}

#[test]
fn swapped_out_again_before_its_loads_ran_takes_the_host_blocks_back() {
    let mut s = Sim::new(64, 64, 64);
    s.admit(1, toks(22, 70));
    for t in 0..4 {
        s.decode(&[1], 800 + t);
    }
    let before = s.tables(1);
    let n = held(&before);
    s.m.swap_out(&[1]).unwrap();
    s.step(&[], &[]).unwrap();
    let host = s.tables(1);
    s.m.swap_in(&[1]).unwrap();
    // Out again before any step emitted the loads: no new copy, the same host blocks.
    let out = s.m.swap_out(&[1]).unwrap();
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(s.tables(1), host);
    assert!(s.m.pending_swap_in().is_empty());
    s.m.check_invariants().unwrap();
    s.m.swap_in(&[1]).unwrap();
    let info = s.step(&[1], &[1]).unwrap();
    assert_eq!(info.num_swap_in, n);
    assert_eq!(nulls(&s.tables(1)), nulls(&before));
    s.check_content(1);
    s.m.check_invariants().unwrap();
}
