//! The host tier through the manager: write-back and write-through offload, a block copied once,
//! demotions handed out with the bytes still in place, host hits loaded by the next step (and
//! shared while in flight), the load-or-recompute rule, the fetch from a lower tier
//! (`lookup_tiers` / `reserve_host_blocks` / `commit_host_blocks`), swapped blocks winning over
//! cached ones, reset, the host-tier events, and typed errors that change nothing.
//!
//! KV content is simulated as in `tests/swap.rs` (`common`): `dev[b]` / `host[h]` hold one value
//! per token slot (the token id), a step applies its lists in the documented order (demotions are
//! drained and copied to a simulated lower tier first, then swap-out, swap-in, copy-on-write) and
//! then writes each new token's value through the slot mapping.

mod common;

use common::{apply_lists, read_back, toks, write_new, Sim, B};
use pagedkv::events::{KvEvent, KvEventKind, Medium};
use pagedkv::manager::{AdmitResult, BlockManager, ManagerConfig};
use pagedkv::step::StepInfo;
use pagedkv::swap::CostModel;
use pagedkv::{Error, SeqId, TokenId};

fn config(num_blocks: u32, num_host: u32) -> ManagerConfig {
    let mut cfg = ManagerConfig::new(num_blocks, B);
    cfg.watermark_blocks = 0;
    cfg.num_host_blocks = num_host;
    cfg.hash_seed = Some(3);
    cfg.host_cache = true;
    cfg.kv_event_capacity = 256;
    cfg
}

impl Sim {
    fn new(cfg: ManagerConfig) -> Self {
        Self::with_config(cfg, 64)
    }

    /// Builds the step, drains the demotions, applies the lists, then writes each new token's id:
    /// the last `new[i]` of the first `seq_len` tokens of each sequence.
    fn step(&mut self, seqs: &[SeqId], new: &[u32]) -> StepInfo {
        let info = self.m.build_step(seqs, new, &mut self.ob.view()).unwrap();
        self.drain_demotions();
        apply_lists(&self.ob, &info, &mut self.dev, &mut self.host);
        let (tokens, m) = (&self.tokens, &self.m);
        write_new(
            &mut self.dev,
            &self.ob.slot_mapping,
            seqs,
            new,
            |sid| &tokens[&sid][..m.seq_len(sid).unwrap()],
            |tok| tok as i64,
        );
        self.m.check_invariants().unwrap();
        info
    }

    /// Admits without stepping.
    fn admit_only(&mut self, sid: SeqId, toks: &[TokenId]) -> AdmitResult {
        let r = self.m.admit(sid, toks).unwrap();
        self.tokens.insert(sid, toks.to_vec());
        self.m.check_invariants().unwrap();
        r
    }

    /// Admits and runs the prefill step.
    fn admit(&mut self, sid: SeqId, toks: &[TokenId]) -> AdmitResult {
        let r = self.admit_only(sid, toks);
        self.step(&[sid], &[r.num_tokens - r.cached_tokens]);
        r
    }

    fn free(&mut self, sid: SeqId) {
        self.m.free(sid).unwrap();
        self.m.check_invariants().unwrap();
    }

    /// What `sid`'s table reads back, position by position.
    fn content(&self, sid: SeqId) -> Vec<i64> {
        let t = self.m.block_table(sid).unwrap();
        read_back(&self.dev, t, self.m.seq_len(sid).unwrap())
    }

    fn expect(&self, sid: SeqId) -> Vec<i64> {
        let n = self.m.seq_len(sid).unwrap();
        self.tokens[&sid][..n].iter().map(|&t| t as i64).collect()
    }
}

/// Fills the pool with `a`, frees it, then runs a cold prompt over the whole pool: every cached
/// block of `a` is evicted.
fn evict_all(s: &mut Sim, a: &[TokenId], a_id: SeqId, cold_id: SeqId, cold_base: u32) {
    s.admit(a_id, a);
    s.free(a_id);
    let n = s.m.config().num_blocks * B - 3;
    let cold = toks(n, cold_base);
    s.admit(cold_id, &cold);
    assert_eq!(s.content(cold_id), s.expect(cold_id));
    s.free(cold_id);
}

#[test]
fn write_back_offloads_on_eviction_and_a_readmission_loads() {
    let mut s = Sim::new(config(8, 8));
    let a = toks(17, 100);
    s.admit(1, &a);
    assert!(
        s.m.pending_swap_out().is_empty(),
        "write-back offloads nothing at registration"
    );
    s.free(1);
    s.admit_only(2, &toks(29, 500));
    // The cold prompt evicted a's four full blocks; each is queued for the host.
    assert_eq!(s.m.pending_swap_out().len(), 4);
    assert_eq!(s.m.stats().offloaded_blocks, 4);
    assert_eq!(s.m.stats().host_cached_blocks, 4);
    // Its step copies them out before its forward overwrites the reused device blocks.
    s.step(&[2], &[29]);
    assert_eq!(s.content(2), s.expect(2));
    s.free(2);
    let r = s.admit_only(3, &a);
    assert_eq!(
        (r.cached_tokens, r.cached_tokens_gpu, r.cached_tokens_host),
        (16, 0, 16)
    );
    assert_eq!(s.m.pending_swap_in().len(), 4);
    let info = s.step(&[3], &[1]);
    assert_eq!(info.num_swap_in, 4);
    assert_eq!(s.content(3), s.expect(3));
    let st = s.m.stats();
    assert_eq!((st.host_hit_tokens, st.host_loaded_blocks), (16, 4));
    // The loaded blocks are registered on the device again: a third copy hits the GPU.
    s.free(3);
    let r = s.admit_only(4, &a);
    assert_eq!((r.cached_tokens_gpu, r.cached_tokens_host), (16, 0));
}

#[test]
fn write_through_offloads_at_registration_and_copies_once() {
    let mut cfg = config(8, 16);
    cfg.host_write_through = true;
    let mut s = Sim::new(cfg);
    let a = toks(17, 100);
    s.admit(1, &a);
    // Queued after the step that computes the blocks; the next step copies them.
    assert_eq!(s.m.pending_swap_out().len(), 4);
    assert_eq!(s.step(&[], &[]).num_swap_out, 4);
    s.free(1);
    s.admit(2, &toks(29, 500));
    // Evicting a's blocks copies nothing more: they are on the host already.
    let st = s.m.stats();
    assert_eq!(
        st.offloaded_blocks,
        4 + 7,
        "a's four, then the cold prompt's seven"
    );
    s.step(&[], &[]);
    s.free(2);
    let r = s.admit_only(3, &a);
    assert_eq!(r.cached_tokens_host, 16);
    s.step(&[3], &[1]);
    assert_eq!(s.content(3), s.expect(3));
}

#[test]
fn demotions_carry_the_chain_and_the_bytes_and_a_lower_tier_refills() {
    // Two host blocks: b's offload demotes a's two host-cached blocks.
    let mut s = Sim::new(config(8, 2));
    let a = toks(9, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    s.step(&[], &[]);
    let a_look = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!((a_look.gpu_blocks, a_look.host_blocks), (0, 2));
    let b = toks(9, 300);
    s.admit(3, &b);
    s.free(3);
    s.events();
    // Evicting b's blocks takes the host blocks a's occupy: oldest first.
    s.m.admit(4, &toks(29, 700)).unwrap();
    s.tokens.insert(4, toks(29, 700));
    let demoted = s.drain_demotions();
    assert_eq!(demoted.len(), 2);
    let full = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!(full.host_blocks, 0);
    assert_eq!(full.hashes, a_look.hashes);
    let ev = s.events();
    let removed: Vec<_> = ev
        .iter()
        .filter(|e| e.kind == KvEventKind::Removed && e.medium == Medium::Host)
        .flat_map(|e| e.block_hashes.clone())
        .collect();
    assert_eq!(removed.len(), 2);
    assert!(demoted.iter().all(|h| removed.contains(h)));
    s.step(&[4], &[29]);
    s.free(4);
    // Every demotion reached the lower tier (the blocks' hashes are all distinct).
    assert_eq!(s.m.stats().demotions as usize, s.disk.len());

    // Refill a's chain from the lower tier, as the engine would.
    let look = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!((look.gpu_blocks, look.host_blocks), (0, 0));
    assert_eq!(look.hashes.len(), 2);
    assert!(look.hashes.iter().all(|h| s.disk.contains_key(h)));
    let hs = s.m.reserve_host_blocks(2).unwrap();
    // The reservation took b's host-cached blocks: their bytes go down first.
    assert_eq!(s.drain_demotions().len(), 2);
    // Reserved blocks are not findable.
    assert_eq!(s.m.lookup_tiers(&a, None).unwrap().host_blocks, 0);
    for (i, &h) in hs.iter().enumerate() {
        let bytes = s.disk[&look.hashes[i]].clone();
        s.host[h as usize * 4..(h as usize + 1) * 4].copy_from_slice(&bytes);
    }
    let parents = [None, Some(look.hashes[0])];
    let n =
        s.m.commit_host_blocks(&hs, &look.hashes, &parents, look.salt_digest, &a[..8], true)
            .unwrap();
    assert_eq!(n, 2);
    s.m.check_invariants().unwrap();
    let r = s.admit_only(5, &a);
    assert_eq!(r.cached_tokens_host, 8);
    s.step(&[5], &[1]);
    assert_eq!(s.content(5), s.expect(5));
}

#[test]
fn a_load_in_flight_is_shared_and_emitted_before_any_reader_runs() {
    let mut s = Sim::new(config(12, 8));
    let a = toks(13, 100);
    s.admit(1, &a);
    s.free(1);
    // Evict a's three blocks (the pool's nine free blocks, then the three cached-free ones).
    s.admit(2, &toks(45, 500));
    s.free(2);
    let r1 = s.admit_only(3, &a);
    assert_eq!(r1.cached_tokens_host, 12);
    // A second admission before any step hits the device blocks the load fills.
    let r2 = s.admit_only(4, &a);
    assert_eq!((r2.cached_tokens_gpu, r2.cached_tokens_host), (12, 0));
    assert_eq!(
        s.m.block_table(3).unwrap()[..3],
        s.m.block_table(4).unwrap()[..3]
    );
    // A step scheduling only the second reader still emits the load (before its forward).
    let info = s.step(&[4], &[1]);
    assert_eq!(info.num_swap_in, 3);
    assert_eq!(s.content(4), s.expect(4));
    s.step(&[3], &[1]);
    assert_eq!(s.content(3), s.expect(3));
}

#[test]
fn short_or_slow_host_runs_are_recomputed() {
    let mut cfg = config(8, 8);
    cfg.host_load_min_blocks = 3;
    let mut s = Sim::new(cfg);
    let a = toks(9, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    s.step(&[], &[]);
    assert_eq!(s.m.lookup_tiers(&a, None).unwrap().host_blocks, 2);
    let r = s.admit_only(3, &a);
    assert_eq!(
        r.cached_tokens, 0,
        "two host hits are fewer than host_load_min_blocks"
    );
    assert!(s.m.pending_swap_in().is_empty());
    s.step(&[3], &[9]);
    assert_eq!(s.content(3), s.expect(3));

    let mut s = Sim::new(config(8, 8));
    let a = toks(9, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    s.step(&[], &[]);
    // One byte per second over the link, 1e9 tokens per second of prefill: recompute wins.
    s.m.set_host_cost_model(Some(CostModel::new(1.0, 1e9, 1024.0)))
        .unwrap();
    assert_eq!(s.admit_only(3, &a).cached_tokens, 0);
    s.free(3);
    // A fast link: loading wins.
    s.m.set_host_cost_model(Some(CostModel::new(1e12, 1.0, 1024.0)))
        .unwrap();
    assert_eq!(s.admit_only(4, &a).cached_tokens_host, 8);
    assert!(matches!(
        s.m.set_host_cost_model(Some(CostModel::new(0.0, 1.0, 1.0))),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn swapped_blocks_win_over_host_cached_ones() {
    let mut s = Sim::new(config(8, 2));
    let a = toks(9, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    s.step(&[], &[]);
    assert_eq!(s.m.stats().host_cached_blocks, 2);
    assert_eq!(s.m.num_free_host_blocks(), 0);
    // A swap-out needing both host blocks demotes the cached ones.
    let b = toks(6, 300);
    s.admit(3, &b);
    s.m.swap_out(&[3]).unwrap();
    assert_eq!(s.drain_demotions().len(), 2);
    assert_eq!(s.m.stats().host_cached_blocks, 0);
    s.step(&[], &[]);
    // Offloads now find every host block swapped: they are skipped, the swapped blocks stay.
    let c = toks(9, 900);
    s.admit(4, &c);
    s.free(4);
    let before = s.m.stats().offloaded_blocks;
    s.admit(5, &toks(29, 1300));
    assert_eq!(s.m.stats().offloaded_blocks, before);
    assert_eq!(s.m.stats().host_cached_blocks, 0);
    s.free(5);
    s.m.swap_in(&[3]).unwrap();
    s.step(&[], &[]);
    assert_eq!(s.content(3), s.expect(3));
    // Too few host blocks for a swap-out counts the host-cached ones as available.
    assert!(matches!(
        s.m.reserve_host_blocks(3),
        Err(Error::OutOfHostBlocks {
            needed: 3,
            available: 2
        })
    ));
}

#[test]
fn commit_rules_and_errors_change_nothing() {
    let mut s = Sim::new(config(8, 4));
    let a = toks(9, 100);
    let look = s.m.lookup_tiers(&a, None).unwrap();
    assert_eq!(look.hashes.len(), 2);
    let hs = s.m.reserve_host_blocks(2).unwrap();
    let parents = [None, Some(look.hashes[0])];
    let stats = s.m.stats();
    let bad = [
        s.m.commit_host_blocks(&hs, &look.hashes[..1], &parents, 0, &a[..8], true),
        s.m.commit_host_blocks(&hs, &look.hashes, &parents, 0, &a[..7], true),
        s.m.commit_host_blocks(&[hs[0], hs[0]], &look.hashes, &parents, 0, &a[..8], true),
        s.m.commit_host_blocks(&[3, hs[1]], &look.hashes, &parents, 0, &a[..8], true),
        s.m.commit_host_blocks(&[99, hs[1]], &look.hashes, &parents, 0, &a[..8], true),
    ];
    for r in bad {
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }
    assert_eq!(s.m.stats(), stats);
    s.m.check_invariants().unwrap();
    // A failed fetch frees its blocks.
    let n =
        s.m.commit_host_blocks(
            &hs,
            &look.hashes,
            &parents,
            look.salt_digest,
            &a[..8],
            false,
        )
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(s.m.num_free_host_blocks(), 4);
    // Committing twice: the second is not reserved any more.
    assert!(matches!(
        s.m.commit_host_blocks(&hs, &look.hashes, &parents, 0, &a[..8], true),
        Err(Error::InvalidArgument { .. })
    ));
    // A reservation made before a reset is not indexed by its commit.
    let hs = s.m.reserve_host_blocks(2).unwrap();
    s.m.reset_prefix_cache().unwrap();
    let n =
        s.m.commit_host_blocks(&hs, &look.hashes, &parents, look.salt_digest, &a[..8], true)
            .unwrap();
    assert_eq!(n, 0);
    assert_eq!(s.m.num_free_host_blocks(), 4);
    // A hash already indexed keeps its block; the duplicate is freed.
    let hs = s.m.reserve_host_blocks(2).unwrap();
    let salt = look.salt_digest;
    let h = &look.hashes;
    assert_eq!(
        s.m.commit_host_blocks(&hs[..1], &h[..1], &[None], salt, &a[..4], true)
            .unwrap(),
        1
    );
    assert_eq!(
        s.m.commit_host_blocks(&hs[1..], &h[..1], &[None], salt, &a[..4], true)
            .unwrap(),
        0
    );
    assert_eq!(s.m.num_free_host_blocks(), 3);
    assert!(matches!(
        s.m.reserve_host_blocks(5),
        Err(Error::OutOfHostBlocks {
            needed: 5,
            available: 4
        })
    ));
    s.m.check_invariants().unwrap();
}

#[test]
fn reset_clears_the_host_tier_and_spares_blocks_in_flight() {
    let mut s = Sim::new(config(8, 8));
    let a = toks(17, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    s.step(&[], &[]);
    let r = s.admit_only(3, &a);
    assert_eq!(r.cached_tokens_host, 16);
    s.events();
    s.m.reset_prefix_cache().unwrap();
    let ev = s.events();
    assert!(ev
        .iter()
        .any(|e| e.kind == KvEventKind::Cleared && e.medium == Medium::Host));
    assert_eq!(s.m.stats().host_cached_blocks, 0);
    s.m.check_invariants().unwrap();
    // The loads queued before the reset still run and the sequence reads its prompt.
    s.step(&[3], &[1]);
    assert_eq!(s.content(3), s.expect(3));
    s.free(3);
    assert_eq!(s.m.lookup_tiers(&a, None).unwrap().host_blocks, 0);
    assert_eq!(s.m.num_free_host_blocks(), 8);
}

#[test]
fn host_events_record_offloads_and_demotions() {
    let mut s = Sim::new(config(8, 8));
    let a = toks(9, 100);
    s.admit(1, &a);
    s.free(1);
    let la = s.m.lookup_tiers(&a, None).unwrap();
    s.events();
    s.admit(2, &toks(29, 500));
    let ev = s.events();
    let stored: Vec<&KvEvent> = ev
        .iter()
        .filter(|e| e.kind == KvEventKind::Stored && e.medium == Medium::Host)
        .collect();
    // The cached-free LRU evicts a chain tail first: one event per block, each with its
    // parent and tokens.
    let (h0, h1) = (la.hashes[0], la.hashes[1]);
    let got: Vec<(Vec<u128>, Option<u128>, Vec<TokenId>)> = stored
        .iter()
        .map(|e| (e.block_hashes.clone(), e.parent_hash, e.token_ids.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (vec![h1], Some(h0), a[4..8].to_vec()),
            (vec![h0], None, a[..4].to_vec()),
        ]
    );
}

#[test]
fn without_the_tier_nothing_is_offloaded() {
    let mut cfg = config(8, 8);
    cfg.host_cache = false;
    let mut s = Sim::new(cfg);
    let a = toks(9, 100);
    evict_all(&mut s, &a, 1, 2, 500);
    assert!(s.m.pending_swap_out().is_empty());
    assert_eq!(s.admit_only(3, &a).cached_tokens, 0);
    assert!(s.m.take_demotions().is_empty());
    assert!(matches!(
        s.m.reserve_host_blocks(1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        s.m.commit_host_blocks(&[], &[], &[], 0, &[], true),
        Err(Error::InvalidArgument { .. })
    ));
    let mut bad = config(8, 0);
    assert!(matches!(
        BlockManager::new(bad.clone()),
        Err(Error::InvalidConfig {
            field: "host_cache",
            ..
        })
    ));
    bad.num_host_blocks = 4;
    bad.verify_prefix = false;
    assert!(matches!(
        BlockManager::new(bad),
        Err(Error::InvalidConfig {
            field: "host_cache",
            ..
        })
    ));
    let mut wt = config(8, 4);
    wt.host_cache = false;
    wt.host_write_through = true;
    assert!(matches!(
        BlockManager::new(wt),
        Err(Error::InvalidConfig {
            field: "host_write_through",
            ..
        })
    ));
}
