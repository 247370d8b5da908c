//! The host tier in the core: write-back and write-through offload, loads on admission (and the
//! load-or-recompute rule), demotions and their contract, swap winning over the cache, the fetch
//! from lower tiers (`lookup_tiers`, `reserve_host_blocks`, `commit_host_blocks`), reset, the
//! shedding of offloads that do not fit a step, events and stats.
//!
//! KV content is simulated (`common`): `dev[b]` / `host[h]` hold one value per token slot; a step
//! drains the demotions (checking the demoted bytes are still the block's, as the contract
//! promises), applies its lists in the documented order (swap-out, swap-in, copy-on-write) and then
//! writes each new token's value through the slot mapping; every scheduled sequence must then read
//! back its tokens.

mod common;

use common::{read_back, toks, Sim, B};
use pagedkv::events::{KvEventKind, Medium};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::StepInfo;
use pagedkv::swap::CostModel;
use pagedkv::{Error, SeqId, TokenId};

fn config(num_blocks: u32, num_host: u32) -> ManagerConfig {
    let mut c = ManagerConfig::new(num_blocks, B);
    c.watermark_blocks = 0;
    c.num_host_blocks = num_host;
    c.hash_seed = Some(9);
    c.host_cache = true;
    c.kv_event_capacity = 256;
    c
}

impl Sim {
    fn new(cfg: ManagerConfig, max_swaps: usize) -> Self {
        Self::with_config(cfg, max_swaps)
    }

    fn step(&mut self, seqs: &[SeqId], new: &[u32]) -> pagedkv::Result<StepInfo> {
        let info = self.m.build_step(seqs, new, &mut self.ob.view())?;
        self.drain_demotions();
        self.apply_step(&info, seqs, new);
        for &sid in seqs {
            assert_eq!(
                self.content(sid),
                self.expect(sid),
                "seq {sid} reads wrong KV"
            );
        }
        self.m.check_invariants().unwrap();
        Ok(info)
    }

    /// Admits and runs the prefill; returns the admission's result.
    fn admit(&mut self, sid: SeqId, toks: Vec<TokenId>) -> pagedkv::manager::AdmitResult {
        let r = self.m.admit(sid, &toks).unwrap();
        self.m.check_invariants().unwrap();
        self.tokens.insert(sid, toks);
        self.step(&[sid], &[r.num_tokens - r.cached_tokens])
            .unwrap();
        r
    }

    fn free(&mut self, sid: SeqId) {
        self.m.free(sid).unwrap();
        self.tokens.remove(&sid);
        self.m.check_invariants().unwrap();
    }

    fn content(&self, sid: SeqId) -> Vec<i64> {
        let t = self.m.block_table(sid).unwrap();
        read_back(&self.dev, t, self.tokens[&sid].len())
    }

    fn expect(&self, sid: SeqId) -> Vec<i64> {
        self.tokens[&sid].iter().map(|&t| t as i64).collect()
    }
}

/// Write-back: an evicted cached block is offloaded by the allocation that evicts it, and a
/// re-admission loads it back (no prefill for those tokens) with the right bytes.
#[test]
fn write_back_offloads_on_eviction_and_readmission_loads() {
    let mut s = Sim::new(config(8, 8), 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    s.free(1);
    assert!(
        s.m.pending_swap_out().is_empty(),
        "nothing offloaded before an eviction"
    );
    // An 8-block prompt needs every block: A's two cached-free blocks are evicted and offloaded.
    s.admit(2, toks(32, 500));
    let st = s.m.stats();
    assert_eq!(
        (st.offloaded_blocks, st.host_cached_blocks, st.evictions),
        (2, 2, 2)
    );
    s.free(2);
    let r = s.m.admit(3, &a).unwrap();
    assert_eq!(
        (r.cached_tokens, r.cached_tokens_gpu, r.cached_tokens_host),
        (8, 0, 8)
    );
    assert_eq!(s.m.pending_swap_in().len(), 2);
    s.tokens.insert(3, a.clone());
    // The step loads both blocks and computes the last token only.
    let info = s.step(&[3], &[1]).unwrap();
    assert_eq!(info.num_swap_in, 2);
    let st = s.m.stats();
    assert_eq!((st.host_hit_tokens, st.host_loaded_blocks), (8, 2));
    // A block already on the host is not copied again when evicted once more: this eviction of
    // everything offloads B's five remaining blocks, not A's two.
    s.free(3);
    let before = s.m.stats().offloaded_blocks;
    s.admit(4, toks(32, 900));
    assert_eq!(s.m.stats().offloaded_blocks - before, 5);
}

/// Write-through: the offload is queued by the step that registers the block and emitted by the
/// next one, after the forward that wrote it.
#[test]
fn write_through_offloads_at_registration() {
    let mut cfg = config(8, 8);
    cfg.host_write_through = true;
    let mut s = Sim::new(cfg, 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    assert_eq!(s.m.pending_swap_out().len(), 2);
    s.m.append(1, &[7]).unwrap();
    s.tokens.get_mut(&1).unwrap().push(7);
    let info = s.step(&[1], &[1]).unwrap();
    assert_eq!(info.num_swap_out, 2);
    s.free(1);
    s.m.reset_prefix_cache().unwrap();
    // The reset dropped the host tier too.
    assert_eq!(s.m.stats().host_cached_blocks, 0);
    assert_eq!(s.m.admit(2, &a).unwrap().cached_tokens, 0);
}

/// A second admission in the same step shares a block whose load is still queued: the step that
/// schedules either emits the load before its forward.
#[test]
fn a_load_in_flight_is_shared_by_the_next_admission() {
    let mut s = Sim::new(config(12, 8), 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    s.free(1);
    s.admit(2, toks(48, 500));
    s.free(2);
    let r = s.m.admit(3, &a).unwrap();
    assert_eq!(r.cached_tokens_host, 8);
    let r2 = s.m.admit(4, &a).unwrap();
    assert_eq!((r2.cached_tokens_gpu, r2.cached_tokens_host), (8, 0));
    assert_eq!(
        s.m.pending_swap_in().len(),
        2,
        "the load is not queued twice"
    );
    s.tokens.insert(3, a.clone());
    s.tokens.insert(4, a.clone());
    // Schedule only the second: the load it depends on is emitted anyway.
    s.step(&[4], &[1]).unwrap();
    assert!(s.m.pending_swap_in().is_empty());
    s.step(&[3], &[1]).unwrap();
}

/// Freeing the admitted sequence before its load runs cancels the load: the device block is
/// dropped from the prefix cache (it never got its bytes) and the host block stays cached.
#[test]
fn a_cancelled_load_leaves_nothing_findable() {
    let mut s = Sim::new(config(8, 8), 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    s.free(1);
    s.admit(2, toks(32, 500));
    s.free(2);
    assert_eq!(s.m.admit(3, &a).unwrap().cached_tokens_host, 8);
    s.free(3);
    assert!(s.m.pending_swap_in().is_empty());
    let r = s.m.admit(4, &a).unwrap();
    assert_eq!((r.cached_tokens_gpu, r.cached_tokens_host), (0, 8));
    s.tokens.insert(4, a);
    s.step(&[4], &[1]).unwrap();
}

#[test]
fn short_runs_and_costly_loads_are_recomputed() {
    let mut cfg = config(8, 8);
    cfg.host_load_min_blocks = 3;
    let mut s = Sim::new(cfg, 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    s.free(1);
    s.admit(2, toks(32, 500));
    s.free(2);
    // Two host hits < 3: recomputed, nothing loaded.
    let r = s.m.admit(3, &a).unwrap();
    assert_eq!((r.cached_tokens, r.cached_tokens_host), (0, 0));
    assert!(s.m.pending_swap_in().is_empty());
    s.free(3);

    let mut s = Sim::new(config(8, 8), 16);
    s.admit(1, a.clone());
    s.free(1);
    s.admit(2, toks(32, 500));
    s.free(2);
    // A link of 1 kB/s against a prefill of 1M tokens/s: recomputing is cheaper.
    s.m.set_host_cost_model(Some(CostModel::new(1e3, 1e6, 1e3)))
        .unwrap();
    assert_eq!(s.m.admit(3, &a).unwrap().cached_tokens_host, 0);
    s.m.free(3).unwrap();
    // A fast link: loaded.
    s.m.set_host_cost_model(Some(CostModel::new(1e12, 1e3, 1e3)))
        .unwrap();
    assert_eq!(s.m.admit(3, &a).unwrap().cached_tokens_host, 8);
    assert!(matches!(
        s.m.set_host_cost_model(Some(CostModel::new(0.0, 1.0, 1.0))),
        Err(Error::InvalidArgument { .. })
    ));
}

/// The host LRU demotes its oldest block to make room; the demotion carries the block's hash,
/// parent, salt digest and tokens, and its bytes are intact when the engine drains it after the
/// step (the `Sim` checks that).
#[test]
fn demotions_carry_the_block_and_its_bytes() {
    let mut s = Sim::new(config(4, 2), 16);
    let a = toks(9, 100);
    s.admit(1, a.clone());
    s.free(1);
    s.admit(2, toks(13, 500)); // evicts A's two blocks into the two host blocks
    s.free(2);
    assert_eq!(s.m.stats().host_cached_blocks, 2);
    s.events();
    s.admit(3, toks(13, 900)); // evicts B's three blocks: demotes both of A's, keeps B's newest
    let st = s.m.stats();
    assert_eq!((st.demotions, st.host_cached_blocks), (2, 2));
    assert_eq!(
        s.disk.len(),
        2,
        "both demotions were drained and copied out"
    );
    let lk = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!((lk.gpu_blocks, lk.host_blocks), (0, 0));
    assert!(s.disk.contains_key(&lk.hashes[0]));
    assert!(s.disk.contains_key(&lk.hashes[1]));
    let ev = s.events();
    assert!(ev
        .iter()
        .any(|e| e.kind == KvEventKind::Removed && e.medium == Medium::Host));
    assert!(ev
        .iter()
        .any(|e| e.kind == KvEventKind::Stored && e.medium == Medium::Host));
}

/// Swapped blocks always win: a swap-out takes host-cached blocks (demoting them); offloading
/// never takes a swapped block.
#[test]
fn swap_wins_over_the_cache() {
    let mut s = Sim::new(config(8, 3), 16);
    let a = toks(13, 100);
    s.admit(1, a);
    s.free(1);
    s.admit(2, toks(32, 500)); // offloads A's three blocks: the host is full of cached blocks
    assert_eq!(s.m.num_free_host_blocks(), 0);
    assert_eq!(s.m.host_blocks_available(), 3);
    s.m.swap_out(&[2]).unwrap_err(); // 8 blocks do not fit 3
    s.free(2);
    s.admit(3, toks(9, 900)); // offloads three of B's blocks, demoting A's
    let before = s.m.stats().demotions;
    s.m.swap_out(&[3]).unwrap();
    let st = s.m.stats();
    assert_eq!(
        st.demotions - before,
        3,
        "the swap-out took every cached block"
    );
    assert_eq!(st.host_cached_blocks, 0);
    s.step(&[], &[]).unwrap();
    // The host pool is all swapped: a new eviction cannot offload.
    s.admit(4, toks(13, 1300));
    s.free(4);
    let before = s.m.stats().offloaded_blocks;
    s.admit(5, toks(32, 2000));
    assert_eq!(s.m.stats().offloaded_blocks, before);
    s.free(5);
    s.m.swap_in(&[3]).unwrap();
    // The swapped blocks came through intact.
    s.step(&[3], &[1]).unwrap();
}

/// The fetch from a lower tier: lookup, reserve (never findable), commit (then loaded by an
/// admission), and the errors.
#[test]
fn reserve_and_commit_fill_the_host_tier() {
    let mut s = Sim::new(config(8, 4), 16);
    let a = toks(13, 100);
    let lk = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!((lk.gpu_blocks, lk.host_blocks, lk.hashes.len()), (0, 0, 3));
    assert_eq!(lk.parent_hash, None);
    let hs = s.m.reserve_host_blocks(3).unwrap();
    s.m.check_invariants().unwrap();
    assert_eq!(s.m.lookup_tiers(&a, None).unwrap().host_blocks, 0);
    assert!(matches!(
        s.m.reserve_host_blocks(2),
        Err(Error::OutOfHostBlocks {
            needed: 2,
            available: 1
        })
    ));
    // The "disk" bytes: each block holds its tokens.
    for (i, &h) in hs.iter().enumerate() {
        for o in 0..B as usize {
            s.host[h as usize * B as usize + o] = a[i * B as usize + o] as i64;
        }
    }
    let parents = [None, Some(lk.hashes[0]), Some(lk.hashes[1])];
    let bad = s.m.commit_host_blocks(
        &hs[..2],
        &lk.hashes[..1],
        &parents[..1],
        lk.salt_digest,
        &a[..8],
        true,
    );
    assert!(matches!(bad, Err(Error::InvalidArgument { .. })));
    let bad = s.m.commit_host_blocks(
        &[3],
        &lk.hashes[..1],
        &parents[..1],
        lk.salt_digest,
        &a[..4],
        true,
    );
    assert!(matches!(
        bad,
        Err(Error::InvalidArgument { what: "blocks", .. })
    ));
    s.m.check_invariants().unwrap();
    let n =
        s.m.commit_host_blocks(&hs, &lk.hashes, &parents, lk.salt_digest, &a[..12], true)
            .unwrap();
    assert_eq!(n, 3);
    s.m.check_invariants().unwrap();
    let lk2 = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!((lk2.host_blocks, lk2.hashes.len()), (3, 3));
    let r = s.m.admit(1, &a).unwrap();
    assert_eq!(r.cached_tokens_host, 12);
    s.tokens.insert(1, a.clone());
    s.step(&[1], &[1]).unwrap();

    // A failed fetch frees its reservation.
    let b = toks(9, 700);
    let lk = s.m.lookup_tiers(&b, None).unwrap();
    let hs = s.m.reserve_host_blocks(1).unwrap();
    let n =
        s.m.commit_host_blocks(
            &hs,
            &lk.hashes[..1],
            &[None],
            lk.salt_digest,
            &b[..4],
            false,
        )
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(s.m.lookup_tiers(&b, None).unwrap().host_blocks, 0);
    s.m.check_invariants().unwrap();

    // Without the host tier the calls are refused.
    let mut off = BlockManager::new(ManagerConfig::new(8, B)).unwrap();
    assert!(matches!(
        off.reserve_host_blocks(1),
        Err(Error::InvalidArgument { .. })
    ));
}

/// A reservation made before a reset is freed by its commit, not indexed.
#[test]
fn a_reset_voids_reservations() {
    let mut s = Sim::new(config(8, 4), 16);
    let a = toks(9, 100);
    let lk = s.m.lookup_tiers(&a, None).unwrap();
    let hs = s.m.reserve_host_blocks(1).unwrap();
    s.m.reset_prefix_cache().unwrap();
    let n =
        s.m.commit_host_blocks(&hs, &lk.hashes[..1], &[None], lk.salt_digest, &a[..4], true)
            .unwrap();
    assert_eq!(n, 0);
    assert_eq!(s.m.num_free_host_blocks(), 4);
    s.m.check_invariants().unwrap();
}

/// Offloads that the step's swap-out list cannot hold are cancelled rather than failing the step.
#[test]
fn offloads_that_do_not_fit_are_shed() {
    let mut s = Sim::new(config(8, 8), 1);
    let a = toks(13, 100);
    s.admit(1, a.clone());
    s.free(1);
    // Evicts and offloads A's three blocks; this admission's step schedules all three device
    // blocks again, so all three swap-outs would be needed, with room for one.
    let r = s.m.admit(2, &toks(32, 500)).unwrap();
    assert_eq!(s.m.pending_swap_out().len(), 3);
    s.tokens.insert(2, toks(32, 500));
    let info = s.step(&[2], &[r.num_tokens]).unwrap();
    assert_eq!(info.num_swap_out, 1);
    assert!(s.m.pending_swap_out().is_empty());
    assert_eq!(s.m.stats().host_cached_blocks, 1);
}

#[test]
fn config_is_validated() {
    let field = |c: ManagerConfig| match BlockManager::new(c) {
        Err(Error::InvalidConfig { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    let mut c = config(8, 0);
    assert_eq!(field(c.clone()), "host_cache");
    c.num_host_blocks = 4;
    c.verify_prefix = false;
    assert_eq!(field(c.clone()), "host_cache");
    let mut c = ManagerConfig::new(8, B);
    c.host_write_through = true;
    assert_eq!(field(c.clone()), "host_write_through");
    c.host_write_through = false;
    c.host_load_min_blocks = 0;
    assert_eq!(field(c), "host_load_min_blocks");
}
