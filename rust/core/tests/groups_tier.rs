//! The host tier with KV cache groups: each group's blocks are kept in the host index under
//! `(chain hash, group)`, and an admission's hit is the longest boundary at which group 0 has
//! every block before it and each other group the blocks its first computed position reads, each
//! block on the device or in the host tier; what is only on the host is loaded.
//!
//! KV content is simulated as in `groups_swap.rs` (`common::GroupSim`): `dev[b]` / `host[h]` hold
//! one value per token slot; a step applies its lists in the documented order (swap-out, swap-in,
//! copy-on-write) and then writes, through each group's slot mapping, `10 * token + group` for each
//! new token. After every step, every non-null entry of every group's table must hold its group's
//! values: a block loaded from the host for the wrong group, or never loaded, fails that.

mod common;

use common::{group_config, toks, GroupSim as Sim};
use pagedkv::events::{KvEvent, KvEventKind, Medium};
use pagedkv::groups::NULL_BLOCK;
use pagedkv::manager::ManagerConfig;
use pagedkv::step::StepInfo;
use pagedkv::{SeqId, TokenId};

fn config(num_blocks: u32, num_host_blocks: u32, tier: bool) -> ManagerConfig {
    let mut cfg = group_config(num_blocks, num_host_blocks);
    cfg.host_cache = tier;
    cfg.kv_event_capacity = 4096;
    cfg
}

impl Sim {
    fn new(cfg: ManagerConfig) -> Self {
        Self::with_config(cfg, 256)
    }

    fn step(&mut self, seqs: &[SeqId], new: &[u32]) -> StepInfo {
        let info = self.run_step(seqs, new).unwrap();
        self.m.check_invariants().unwrap();
        for &sid in seqs {
            self.check_content(sid);
        }
        info
    }

    /// Admits and prefills `toks`; returns `(cached_tokens, cached_tokens_host)`.
    fn admit(&mut self, sid: SeqId, toks: Vec<TokenId>) -> (u32, u32) {
        let r = self.m.admit(sid, &toks).unwrap();
        self.m.check_invariants().unwrap();
        self.tokens.insert(sid, toks);
        self.step(&[sid], &[r.num_tokens - r.cached_tokens]);
        (r.cached_tokens, r.cached_tokens_host)
    }

    fn free(&mut self, sid: SeqId) {
        self.m.free(sid).unwrap();
        self.tokens.remove(&sid);
        self.m.check_invariants().unwrap();
    }

    /// Host blocks referenced by anyone (a queued load, a swapped table, an offload in flight).
    fn host_refs(&self) -> u32 {
        (0..self.m.config().num_host_blocks)
            .map(|h| self.m.host_block_refcount(h).unwrap())
            .sum()
    }
}

/// Prefills and frees `toks(18, 100)`, then an unrelated 32-token prompt (8 blocks in each of 3
/// groups: the whole of a 24-block pool), so every cached block of the first is evicted. Returns
/// the first prompt.
fn evict_to_host(s: &mut Sim) -> Vec<TokenId> {
    let prompt = toks(18, 100);
    s.admit(1, prompt.clone());
    s.free(1);
    s.admit(2, toks(32, 500));
    s.free(2);
    prompt
}

/// The whole device pool is evicted by one long unrelated prompt: every group's blocks of the
/// first prompt go to the host, and the same prompt comes back from the host in every group.
#[test]
fn an_evicted_prefix_comes_back_from_the_host_in_every_group() {
    for write_through in [false, true] {
        let mut c = config(24, 64, true);
        c.host_write_through = write_through;
        let mut s = Sim::new(c);
        let prompt = toks(18, 100);
        assert_eq!(s.admit(1, prompt.clone()), (0, 0));
        s.free(1);
        // 8 blocks in each of 3 groups: the whole pool, so every cached block is evicted.
        assert_eq!(s.admit(2, toks(32, 500)), (0, 0));
        s.free(2);
        let st = s.m.stats();
        assert!(st.offloaded_blocks >= 12, "{st:?}");
        // (18 - 1) / 4 = 4 blocks shareable; all of them from the host. At boundary 4 (position
        // 16) the sliding group (window 6) reads blocks 2 and 3, the chunked one (chunk 8) none.
        let (cached, host) = s.admit(3, prompt.clone());
        assert_eq!((cached, host), (16, 16), "write_through {write_through}");
        let st = s.m.stats();
        assert_eq!(st.host_loaded_blocks, 4 + 2);
        assert_eq!(st.host_hit_tokens, 16);
        let t = s.m.block_table_group(3, 1).unwrap();
        assert!(t[0] == NULL_BLOCK && t[1] == NULL_BLOCK && t[2] != NULL_BLOCK);
        let t = s.m.block_table_group(3, 2).unwrap();
        assert!(t[..4].iter().all(|&b| b == NULL_BLOCK) && t[4] != NULL_BLOCK);
        // Loads emitted: no host reference left.
        assert_eq!(s.host_refs(), 0);
        s.free(3);
        assert_eq!(s.m.num_free_blocks(), 24);
    }
}

/// While a running sequence holds group 0's blocks of a prefix, evictions take the other groups'
/// idle blocks of it: without the host tier the hit shrinks to the boundary the device still
/// completes; with it, only those other groups' blocks are loaded and group 0's are shared.
#[test]
fn other_groups_blocks_come_from_the_host_beside_group_0_on_the_device() {
    let mut hits = Vec::new();
    for tier in [false, true] {
        let mut s = Sim::new(config(34, 64, tier));
        let prompt = toks(18, 100);
        s.admit(1, prompt.clone());
        s.free(1);
        // 12 blocks cached-free (4 full per group), 22 free. This one holds group 0's 4 and the
        // sliding group's blocks 2 and 3 (the chunked group reads none at position 16).
        assert_eq!(s.admit(5, prompt[..17].to_vec()), (16, 0));
        // 28 tokens, 21 blocks: 19 free ones, then 2 evictions of idle blocks of the prefix,
        // the oldest first: the chunked group's blocks 3 and 2.
        s.admit(2, toks(28, 500));
        assert_eq!(s.m.stats().evictions, 2);
        s.free(2);
        // Boundary 3 (position 12): the sliding group reads blocks 1 and 2, the chunked one 2.
        let (cached, host) = s.admit(3, prompt[..13].to_vec());
        let st = s.m.stats();
        if tier {
            assert_eq!((cached, host), (12, 4));
            assert_eq!(st.host_loaded_blocks, 1, "{st:?}");
            // Group 0's blocks are the running sequence's, shared on the device.
            let g0 = s.m.block_table_group(3, 0).unwrap()[..3].to_vec();
            assert_eq!(g0, s.m.block_table_group(5, 0).unwrap()[..3].to_vec());
        } else {
            assert_eq!((cached, host), (8, 0));
        }
        hits.push(cached);
        for sid in [3, 5] {
            s.free(sid);
        }
        assert_eq!(s.host_refs(), 0);
        assert_eq!(s.m.num_free_blocks(), 34);
    }
    assert_eq!(hits, vec![8, 12]);
}

/// The load rule applies to what the host tier adds: with `host_load_min_blocks` above it, the
/// admission keeps the device-only boundary, loads nothing and holds no host block.
#[test]
fn a_host_gain_below_the_load_rule_is_recomputed() {
    let mut c = config(24, 64, true);
    c.host_load_min_blocks = 5;
    let mut s = Sim::new(c);
    let prompt = evict_to_host(&mut s);
    assert_eq!(s.admit(3, prompt), (0, 0));
    assert_eq!(s.m.stats().host_loaded_blocks, 0);
    assert_eq!(s.host_refs(), 0);
}

/// The host tier's KV events name each block's group and its chain hash (not the group's cache
/// key), and replayed they equal the host index; a block is never found for another group.
#[test]
fn host_events_name_each_group_and_add_up_to_the_index() {
    let mut s = Sim::new(config(24, 10, true));
    s.admit(1, toks(18, 100));
    s.free(1);
    s.admit(2, toks(32, 500));
    s.free(2);
    s.admit(3, toks(32, 900));
    s.free(3);
    let mut events: Vec<KvEvent> = Vec::new();
    s.m.drain_events(&mut events);
    let mut held = std::collections::BTreeSet::new();
    let mut groups = std::collections::BTreeSet::new();
    for e in events.iter().filter(|e| e.medium == Medium::Host) {
        for &h in &e.block_hashes {
            match e.kind {
                KvEventKind::Stored => {
                    groups.insert(e.group);
                    assert!(held.insert((e.group as usize, h)));
                }
                KvEventKind::Removed => assert!(held.remove(&(e.group as usize, h))),
                KvEventKind::Cleared => held.clear(),
            }
        }
    }
    assert_eq!(groups.len(), 3, "every group reached the host: {groups:?}");
    let index: std::collections::BTreeSet<_> = s.m.host_block_keys().into_iter().collect();
    assert_eq!(held, index);
    assert!(s.m.stats().demotions > 0, "a 10-block host pool demoted");
    // Every demotion names its group; a group's key differs from group 0's for the same hash.
    let d = s.m.take_demotions();
    assert!(d.iter().any(|d| d.group > 0));
}

/// With a cost model the copy is priced by the blocks a hit loads (every group's), the prefill
/// by the tokens it adds. Copying a block costs 0.8 of prefilling one here: a hit that loads 6
/// blocks to add 4 is recomputed, one that loads 1 block to add 1 is loaded.
#[test]
fn the_cost_model_prices_every_groups_loads_against_the_tokens_added() {
    use pagedkv::swap::CostModel;
    let cost = CostModel::new(1.0, 1.0, 0.8);
    // Every group's blocks evicted: 4 blocks added, 4 + 2 loaded.
    let mut s = Sim::new(config(24, 64, true));
    s.m.set_host_cost_model(Some(cost)).unwrap();
    let prompt = evict_to_host(&mut s);
    assert_eq!(s.admit(3, prompt), (0, 0));
    assert_eq!(s.m.stats().host_loaded_blocks, 0);
    assert_eq!(s.host_refs(), 0);
    // Group 0 on the device, the chunked group's block 2 on the host: 1 block added, 1 loaded.
    let mut s = Sim::new(config(34, 64, true));
    s.m.set_host_cost_model(Some(cost)).unwrap();
    let prompt = toks(18, 100);
    s.admit(1, prompt.clone());
    s.free(1);
    s.admit(5, prompt[..17].to_vec());
    s.admit(2, toks(28, 500));
    s.free(2);
    assert_eq!(s.admit(3, prompt[..13].to_vec()), (12, 4));
    assert_eq!(s.m.stats().host_loaded_blocks, 1);
}
