//! What the integration tests share: KV content simulated through the lists and slot mappings a
//! step emits, and the per-group harness of the tests with KV cache groups.
//!
//! Simulated KV content: `dev[b * B + o]` / `host[h * B + o]` hold one value per token slot of
//! device block `b` / host block `h` (blocks of [`B`] slots). [`apply_lists`] applies a step's lists
//! in the documented order: swap-out (device → host), swap-in (host → device), then copy-on-write
//! (device → device, each copy reading the pool as the ones before it left it). [`write_new`] then
//! writes one value per new token of the step through a slot mapping. [`demote`] is the lower
//! tier's side of the demotion contract: a demoted host block still holds its block's tokens when
//! handed out. [`read_back`] is what a block table reads.
//!
//! [`Sim`]: a manager without groups, its step buffers, KV content where a token's value is its id,
//! and a lower tier that demotions are copied to.
//!
//! [`GroupSim`]: a manager with a full, a sliding and a chunked group ([`group_config`]), its step
//! buffers for every group, and KV content where each group writes `10 * token + group` through
//! its own slot mapping; [`GroupSim::check_content`] asserts every non-null entry of every group's
//! table holds its group's values.
//!
//! Beside them: [`expect_err_unchanged`] (a failed call leaves the manager as it was) and
//! [`GroupBufs`] (step buffers for every group of a manager).
//!
//! Each test binary uses a part of this module.

#![allow(dead_code)]

use std::collections::HashMap;
use std::fmt::Debug;

use pagedkv::events::KvEvent;
use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedGroupBuffers, OwnedStepBuffers, StepInfo, StepLayout};
use pagedkv::tier::Demotion;
use pagedkv::{Error, SeqId, TokenId};

/// The block size of every simulated pool.
pub const B: u32 = 4;
const BS: usize = B as usize;

pub const FULL: AttentionKind = AttentionKind::Full;
pub const SLIDING: AttentionKind = AttentionKind::Sliding { window: 6 };
pub const CHUNKED: AttentionKind = AttentionKind::Chunked { chunk: 8 };

/// Applies the step's swap-out, swap-in and copy-on-write lists, in that order, to `dev` / `host`.
pub fn apply_lists(ob: &OwnedStepBuffers, info: &StepInfo, dev: &mut [i64], host: &mut [i64]) {
    let block = |b: i64| b as usize * BS..(b as usize + 1) * BS;
    for j in 0..info.num_swap_out {
        let (d, h) = (ob.swap_out[2 * j], ob.swap_out[2 * j + 1]);
        host[block(h)].copy_from_slice(&dev[block(d)]);
    }
    for j in 0..info.num_swap_in {
        let (h, d) = (ob.swap_in[2 * j], ob.swap_in[2 * j + 1]);
        dev[block(d)].copy_from_slice(&host[block(h)]);
    }
    for j in 0..info.num_copies {
        let (s, d) = (ob.copies[2 * j], ob.copies[2 * j + 1]);
        dev.copy_within(block(s), d as usize * BS);
    }
}

/// Writes `value(token)` through `slots` for each new token of the step: the last `new[i]` of
/// `tokens(seqs[i])`, sequence after sequence.
pub fn write_new<'a>(
    dev: &mut [i64],
    slots: &[i64],
    seqs: &[SeqId],
    new: &[u32],
    tokens: impl Fn(SeqId) -> &'a [TokenId],
    value: impl Fn(TokenId) -> i64,
) {
    let mut k = 0;
    for (&sid, &n) in seqs.iter().zip(new) {
        let t = tokens(sid);
        for &tok in &t[t.len() - n as usize..] {
            dev[slots[k] as usize] = value(tok);
            k += 1;
        }
    }
}

/// Copies each demoted host block to `disk` under its hash, first asserting it still holds the
/// block's tokens; returns the hashes in order.
pub fn demote(host: &[i64], disk: &mut HashMap<u128, Vec<i64>>, ds: Vec<Demotion>) -> Vec<u128> {
    let mut out = Vec::new();
    for d in ds {
        let h = d.host_block as usize;
        let bytes = host[h * BS..(h + 1) * BS].to_vec();
        let want: Vec<i64> = d.tokens.iter().map(|&t| t as i64).collect();
        assert_eq!(
            bytes, want,
            "demoted host block {h} no longer holds its block"
        );
        disk.insert(d.hash, bytes);
        out.push(d.hash);
    }
    out
}

/// What the first `n` positions of a sequence read through its block `table`.
pub fn read_back(dev: &[i64], table: &[u32], n: usize) -> Vec<i64> {
    (0..n)
        .map(|p| dev[table[p / BS] as usize * BS + p % BS])
        .collect()
}

pub fn toks(n: u32, base: u32) -> Vec<TokenId> {
    (base..base + n).collect()
}

/// Runs `op`, expects an error that `check` accepts, and asserts that `snap` of the manager is as
/// before the call and that its invariants hold: a failed call changes nothing.
pub fn expect_err_unchanged<S: PartialEq + Debug, T: Debug>(
    m: &mut BlockManager,
    snap: impl Fn(&BlockManager) -> S,
    op: impl FnOnce(&mut BlockManager) -> pagedkv::Result<T>,
    check: impl FnOnce(&Error) -> bool,
) {
    let before = snap(m);
    let r = op(m);
    match &r {
        Err(e) if check(e) => {}
        other => panic!("unexpected result {other:?}"),
    }
    assert_eq!(
        snap(m),
        before,
        "state changed by a failed operation ({r:?})"
    );
    m.check_invariants().unwrap();
}

/// Step buffers for every group of a manager: group 0's and the other groups'.
pub struct GroupBufs {
    pub ob: OwnedStepBuffers,
    pub gob: OwnedGroupBuffers,
}

impl GroupBufs {
    pub fn with_layout(m: &BlockManager, layout: StepLayout) -> Self {
        Self {
            ob: OwnedStepBuffers::new(layout),
            gob: OwnedGroupBuffers::new(layout, m.num_groups() - 1),
        }
    }

    /// Builds the step of `n[i]` new tokens of each of `seqs` into the buffers.
    pub fn build(
        &mut self,
        m: &mut BlockManager,
        seqs: &[SeqId],
        n: &[u32],
    ) -> pagedkv::Result<StepInfo> {
        let mut g = self.gob.views();
        m.build_step_groups(seqs, n, &mut self.ob.view(), &mut g)
    }
}

/// A manager without KV cache groups, its step buffers, its simulated KV content, and a lower tier
/// (`disk`: what demotions wrote, by hash).
pub struct Sim {
    pub m: BlockManager,
    pub ob: OwnedStepBuffers,
    pub dev: Vec<i64>,
    pub host: Vec<i64>,
    pub tokens: HashMap<SeqId, Vec<TokenId>>,
    pub disk: HashMap<u128, Vec<i64>>,
}

impl Sim {
    /// Up to 8 sequences and 256 tokens a step, 8 copies and `max_swaps` swap pairs.
    pub fn with_config(cfg: ManagerConfig, max_swaps: usize) -> Self {
        let ob = OwnedStepBuffers::new(StepLayout {
            max_seqs: 8,
            max_tokens: 256,
            max_blocks_per_seq: cfg.num_blocks as usize,
            max_copies: 8,
            max_swaps,
        });
        Self {
            dev: vec![-1; (cfg.num_blocks * B) as usize],
            host: vec![-1; (cfg.num_host_blocks.max(1) * B) as usize],
            m: BlockManager::new(cfg).unwrap(),
            ob,
            tokens: HashMap::new(),
            disk: HashMap::new(),
        }
    }

    /// Copies every pending demotion's bytes to the lower tier (the engine's contract: before the
    /// step's lists run or a reserved block is written), checking they are the block's tokens;
    /// returns their hashes.
    pub fn drain_demotions(&mut self) -> Vec<u128> {
        demote(&self.host, &mut self.disk, self.m.take_demotions())
    }

    /// Applies the built step's lists, then writes each new token's id through the slot mapping:
    /// the last `new[i]` of `tokens[seqs[i]]`.
    pub fn apply_step(&mut self, info: &StepInfo, seqs: &[SeqId], new: &[u32]) {
        apply_lists(&self.ob, info, &mut self.dev, &mut self.host);
        let tokens = &self.tokens;
        write_new(
            &mut self.dev,
            &self.ob.slot_mapping,
            seqs,
            new,
            |sid| &tokens[&sid],
            |tok| tok as i64,
        );
    }

    /// The KV events queued since the last call.
    pub fn events(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        self.m.drain_events(&mut out);
        out
    }
}

/// Blocks of [`B`] slots, no watermark, a host pool of `num_host_blocks`, hash seed 3, and the
/// groups full, sliding (window 6), chunked (chunk 8).
pub fn group_config(num_blocks: u32, num_host_blocks: u32) -> ManagerConfig {
    let mut cfg = ManagerConfig::new(num_blocks, B);
    cfg.watermark_blocks = 0;
    cfg.num_host_blocks = num_host_blocks;
    cfg.hash_seed = Some(3);
    cfg.groups = vec![FULL, SLIDING, CHUNKED];
    cfg
}

/// A manager with KV cache groups, its step buffers and its simulated KV content.
pub struct GroupSim {
    pub m: BlockManager,
    pub ob: OwnedStepBuffers,
    pub gob: OwnedGroupBuffers,
    pub dev: Vec<i64>,
    pub host: Vec<i64>,
    pub tokens: HashMap<SeqId, Vec<TokenId>>,
}

impl GroupSim {
    /// Up to 8 sequences and 256 tokens a step, 16 copies and `max_swaps` swap pairs.
    pub fn with_config(cfg: ManagerConfig, max_swaps: usize) -> Self {
        let (num_blocks, num_host_blocks) = (cfg.num_blocks, cfg.num_host_blocks);
        let m = BlockManager::new(cfg).unwrap();
        let layout = StepLayout {
            max_seqs: 8,
            max_tokens: 256,
            max_blocks_per_seq: num_blocks as usize,
            max_copies: 16,
            max_swaps,
        };
        Self {
            ob: OwnedStepBuffers::new(layout),
            gob: OwnedGroupBuffers::new(layout, m.num_groups() - 1),
            m,
            dev: vec![-1; (num_blocks * B) as usize],
            host: vec![-1; (num_host_blocks.max(1) * B) as usize],
            tokens: Default::default(),
        }
    }

    /// Builds the step of `new[i]` tokens of each of `seqs`, applies its lists, then writes each
    /// new token's value of every group through that group's slot mapping.
    pub fn run_step(&mut self, seqs: &[SeqId], new: &[u32]) -> pagedkv::Result<StepInfo> {
        let mut views = self.gob.views();
        let info = self
            .m
            .build_step_groups(seqs, new, &mut self.ob.view(), &mut views)?;
        apply_lists(&self.ob, &info, &mut self.dev, &mut self.host);
        for g in 0..self.m.num_groups() {
            let slots: &[i64] = if g == 0 {
                &self.ob.slot_mapping
            } else {
                &self.gob.slot_mappings[g - 1]
            };
            let tokens = &self.tokens;
            write_new(
                &mut self.dev,
                slots,
                seqs,
                new,
                |sid| &tokens[&sid],
                |tok| 10 * tok as i64 + g as i64,
            );
        }
        Ok(info)
    }

    /// Every held entry of every group of a running `sid` holds its group's values.
    pub fn check_content(&self, sid: SeqId) {
        let toks = &self.tokens[&sid];
        for g in 0..self.m.num_groups() {
            let t = self.m.block_table_group(sid, g).unwrap();
            for (p, &tok) in toks.iter().enumerate() {
                let b = t[p / BS];
                if b == NULL_BLOCK {
                    continue;
                }
                assert_eq!(
                    self.dev[b as usize * BS + p % BS],
                    10 * tok as i64 + g as i64,
                    "sequence {sid}, group {g}, position {p} (block {b})"
                );
            }
        }
    }
}
