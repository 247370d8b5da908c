//! Random operation sequences against a plain model (sequence id → token ids).
//!
//! Besides the manager's own invariants after every operation, the test simulates the KV memory
//! the manager describes: every step applies the emitted copies, then writes each new token's
//! "KV" (a fingerprint of the sequence's salt and tokens up to that position) to the slot the step
//! mapped it to. After every step, each computed position of every sequence must read back its own
//! fingerprint through the sequence's block table. That checks, end to end, that prefix hits hand
//! out blocks holding exactly the right content, that copy-on-write keeps forks apart, and that no
//! write ever lands in a block another sequence still reads.
//!
//! Swap and recompute are in the mix: `SwapOut` (of the chosen victim group or of one sequence),
//! `SwapIn`, `Recompute`, `Resume`. A step applies its swap-out list (device → simulated host KV),
//! its swap-in list (host → device), then its copies, then its writes; a swapped sequence's
//! computed positions must read back their fingerprints from the host blocks its table names, and a
//! running one's through any copies still queued for its blocks.
//!
//! KV cache groups: `hybrid_groups_match_model` runs the same walks on a full + sliding + chunked
//! manager. Each group writes its own fingerprint (the position's, mixed with the group index)
//! through its own slot mapping into the one pool, and after every step each group must read back
//! its own fingerprint at every position a later query of that group can read, through its own
//! table; a windowed group must have released exactly the blocks dead for the step's first new
//! position, no more and no fewer. Swaps are in the hybrid walks too: a swapped sequence's every
//! group reads its fingerprints back from the host blocks its tables name. Its KV events, replayed
//! per (group, hash) after every operation, must equal the device prefix cache's
//! `cached_block_keys()`.

use std::collections::HashMap;

use pagedkv::events::{KvEventKind, Medium};
use pagedkv::groups::{dead_blocks, AttentionKind, NULL_BLOCK};
use pagedkv::manager::{AdmitRequest, BlockManager, ManagerConfig};
use pagedkv::step::{OwnedGroupBuffers, OwnedStepBuffers, StepLayout};
use pagedkv::swap::SeqState;
use pagedkv::table::blocks_for;
use pagedkv::{hash::SeqKeys, Error, SeqId};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Prompt: the first `len` tokens of family `family` (shared prefixes), with position `fork_at`
    /// changed when `fork_at < len` so families also diverge mid-block.
    Admit {
        seq: SeqId,
        family: u32,
        len: usize,
        fork_at: usize,
        salt: u8,
        /// Hold at most this many tokens past the cached prefix (chunked prefill).
        chunk: Option<usize>,
    },
    /// Feed up to `k` more prompt tokens of a chunked admission.
    Chunk {
        seq: SeqId,
        k: usize,
    },
    AdmitBatch {
        seqs: Vec<SeqId>,
        family: u32,
        len: usize,
        chunk: Option<usize>,
    },
    FreeBatch {
        seqs: Vec<SeqId>,
    },
    ResetPrefixCache,
    Append {
        seq: SeqId,
        toks: Vec<u32>,
    },
    AppendBatch {
        seqs: Vec<SeqId>,
        tok: u32,
    },
    Free {
        seq: SeqId,
    },
    Fork {
        parent: SeqId,
        child: SeqId,
    },
    /// Step the live sequences whose bit is set and that have uncomputed tokens.
    Step {
        mask: u16,
    },
    /// Swap out the victim group (`victim`) or `seq` alone.
    SwapOut {
        seq: SeqId,
        victim: bool,
    },
    SwapIn {
        seq: SeqId,
    },
    Recompute {
        seq: SeqId,
    },
    /// Host tier: fill up to `k` blocks after the prompt's cached ones from a "lower tier" (the
    /// model's fingerprints) through `reserve_host_blocks` / `commit_host_blocks`.
    Fetch {
        family: u32,
        len: usize,
        salt: u8,
        k: usize,
        ok: bool,
    },
    Resume {
        seq: SeqId,
        chunk: Option<usize>,
    },
    /// `k` provisional tokens (draft ids) for each of `seqs` (`append_provisional` for one).
    Provisional {
        seqs: Vec<SeqId>,
        k: u32,
        /// Only the running ones of `seqs`, once each.
        clamp: bool,
    },
    /// Accept the first `n` drafts of each of `seqs` (`commit` for one, `commit_batch` else).
    Commit {
        seqs: Vec<SeqId>,
        n: u32,
        /// Only the live ones of `seqs`, once each, `n` capped by what each holds.
        clamp: bool,
    },
    Rewind {
        seq: SeqId,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0u64..6;
    prop_oneof![
        4 => (seq.clone(), 0u32..3, 1usize..24, 0usize..40, 0u8..2, prop::option::of(1usize..9))
            .prop_map(|(seq, family, len, fork_at, salt, chunk)| Op::Admit { seq, family, len, fork_at, salt, chunk }),
        2 => (seq.clone(), 1usize..9).prop_map(|(seq, k)| Op::Chunk { seq, k }),
        1 => (prop::collection::vec(0u64..6, 0..4), 0u32..3, 1usize..24, prop::option::of(1usize..9))
            .prop_map(|(seqs, family, len, chunk)| Op::AdmitBatch { seqs, family, len, chunk }),
        1 => prop::collection::vec(0u64..6, 0..4).prop_map(|seqs| Op::FreeBatch { seqs }),
        1 => Just(Op::ResetPrefixCache),
        3 => (seq.clone(), prop::collection::vec(0u32..5, 1..7)).prop_map(|(seq, toks)| Op::Append { seq, toks }),
        3 => (prop::collection::vec(0u64..6, 0..5), 0u32..5).prop_map(|(seqs, tok)| Op::AppendBatch { seqs, tok }),
        2 => seq.clone().prop_map(|seq| Op::Free { seq }),
        3 => (seq.clone(), seq.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        4 => any::<u16>().prop_map(|mask| Op::Step { mask }),
        2 => (seq.clone(), any::<bool>()).prop_map(|(seq, victim)| Op::SwapOut { seq, victim }),
        2 => seq.clone().prop_map(|seq| Op::SwapIn { seq }),
        1 => seq.clone().prop_map(|seq| Op::Recompute { seq }),
        2 => (seq.clone(), prop::option::of(1usize..9)).prop_map(|(seq, chunk)| Op::Resume { seq, chunk }),
        2 => (0u32..3, 1usize..24, 0u8..2, 0usize..6, any::<bool>())
            .prop_map(|(family, len, salt, k, ok)| Op::Fetch { family, len, salt, k, ok }),
        6 => (prop::collection::vec(0u64..6, 1..4), 0u32..4, any::<bool>())
            .prop_map(|(seqs, k, clamp)| Op::Provisional { seqs, k, clamp }),
        6 => (prop::collection::vec(0u64..6, 1..4), 0u32..5, any::<bool>())
            .prop_map(|(seqs, n, clamp)| Op::Commit { seqs, n, clamp }),
        1 => seq.clone().prop_map(|seq| Op::Rewind { seq }),
    ]
}

/// `op()` weighted towards what brings blocks back from the host tier: admissions of few
/// families, steps (which register blocks), frees, and the allocations that evict them.
fn tier_op() -> impl Strategy<Value = Op> {
    let seq = 0u64..6;
    prop_oneof![
        6 => (seq.clone(), 0u32..2, 6usize..24, 30usize..40, Just(0u8), prop::option::of(4usize..12))
            .prop_map(|(seq, family, len, fork_at, salt, chunk)| Op::Admit { seq, family, len, fork_at, salt, chunk }),
        1 => (seq.clone(), 1usize..9).prop_map(|(seq, k)| Op::Chunk { seq, k }),
        6 => Just(Op::Step { mask: u16::MAX }),
        1 => any::<u16>().prop_map(|mask| Op::Step { mask }),
        4 => seq.clone().prop_map(|seq| Op::Free { seq }),
        2 => (seq.clone(), prop::collection::vec(0u32..5, 1..7)).prop_map(|(seq, toks)| Op::Append { seq, toks }),
        1 => (seq.clone(), seq.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        1 => (seq.clone(), any::<bool>()).prop_map(|(seq, victim)| Op::SwapOut { seq, victim }),
        1 => seq.clone().prop_map(|seq| Op::SwapIn { seq }),
        1 => seq.clone().prop_map(|seq| Op::Recompute { seq }),
        1 => (seq.clone(), prop::option::of(1usize..9)).prop_map(|(seq, chunk)| Op::Resume { seq, chunk }),
        1 => (0u32..2, 1usize..24, 0u8..2, 0usize..6, any::<bool>())
            .prop_map(|(family, len, salt, k, ok)| Op::Fetch { family, len, salt, k, ok }),
        1 => (prop::collection::vec(0u64..6, 1..4), 0u32..4, any::<bool>())
            .prop_map(|(seqs, k, clamp)| Op::Provisional { seqs, k, clamp }),
        1 => (prop::collection::vec(0u64..6, 1..4), 0u32..5, any::<bool>())
            .prop_map(|(seqs, n, clamp)| Op::Commit { seqs, n, clamp }),
    ]
}

#[derive(Debug, Clone)]
struct ModelSeq {
    tokens: Vec<u32>,
    /// Prompt tokens not yet held (chunked admission): fed by `Op::Chunk`.
    rest: Vec<u32>,
    salt: u8,
    /// Tokens whose KV has been written (or was served from the cache).
    computed: usize,
    state: SeqState,
    /// The last `prov` of `tokens` are provisional (draft ids).
    prov: usize,
}

/// The draft id of a provisional token at position `p`.
fn draft(p: usize) -> u32 {
    50 + (p % 3) as u32
}

impl ModelSeq {
    /// Drops the provisional tokens but the first `n` (which become committed).
    fn settle(&mut self, n: usize) {
        let len = self.tokens.len() - self.prov + n;
        self.tokens.truncate(len);
        self.computed = self.computed.min(len);
        self.prov = 0;
    }
}

/// Fingerprint of "the KV of position `p`": depends on the salt and tokens `0..=p`.
fn fingerprints(s: &ModelSeq) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ s.salt as u64;
    s.tokens
        .iter()
        .map(|&t| {
            h = (h ^ t as u64)
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(17);
            h
        })
        .collect()
}

/// Group `g`'s fingerprint of a position: group 0's is the plain one.
fn fp_group(v: u64, g: usize) -> u64 {
    v ^ (g as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

struct Harness {
    m: BlockManager,
    /// Per-group step buffers for groups after group 0 (empty for a one-group manager).
    gob: OwnedGroupBuffers,
    model: HashMap<SeqId, ModelSeq>,
    kv: Vec<Option<u64>>,
    host_kv: Vec<Option<u64>>,
    bs: usize,
    ob: OwnedStepBuffers,
}

type Snap = (
    Vec<(SeqId, usize, Vec<Vec<u32>>, SeqState)>,
    usize,
    Vec<(u32, u32)>,
    Vec<u32>,
    (Vec<(u32, u32)>, Vec<(u32, u32)>, Vec<u32>),
);

impl Harness {
    fn snapshot(&self) -> Snap {
        let mut seqs: Vec<_> = self
            .m
            .seq_ids()
            .map(|s| {
                (
                    s,
                    self.m.seq_len(s).unwrap(),
                    (0..self.m.num_groups())
                        .map(|g| self.m.block_table_group(s, g).unwrap().to_vec())
                        .collect(),
                    self.m.seq_state(s).unwrap(),
                )
            })
            .collect();
        seqs.sort_by_key(|x| x.0);
        let rc = (0..self.m.config().num_blocks)
            .map(|b| self.m.block_refcount(b).unwrap())
            .collect();
        let hrc = (0..self.m.config().num_host_blocks)
            .map(|h| self.m.host_block_refcount(h).unwrap())
            .collect();
        (
            seqs,
            self.m.num_free_blocks(),
            self.m.pending_copies().to_vec(),
            rc,
            (
                self.m.pending_swap_out().to_vec(),
                self.m.pending_swap_in().to_vec(),
                hrc,
            ),
        )
    }

    /// Records a successful admission of `toks` in the model and checks its result.
    fn admitted(
        &mut self,
        seq: SeqId,
        toks: Vec<u32>,
        salt: u8,
        chunk: Option<usize>,
        r: pagedkv::manager::AdmitResult,
    ) {
        let len = toks.len();
        let bs = self.bs;
        let cached = r.cached_tokens as usize;
        assert_eq!(cached % bs, 0);
        assert!(cached < len, "at least one prompt token is computed");
        let held = cached + chunk.map_or(len - cached, |k| k.min(len - cached));
        assert_eq!(r.num_tokens as usize, held);
        let nb = blocks_for(held, bs) as u32;
        assert_eq!(r.num_blocks, nb);
        let ng = self.m.num_groups() as u32;
        if ng == 1 || !self.m.config().host_cache {
            assert_eq!(
                r.new_blocks + ng * (r.cached_tokens_gpu / bs as u32),
                ng * nb
            );
        } else {
            // Other groups may load blocks inside the device-only boundary too: every block
            // taken is held, and the device hits cover at least group 0's device prefix.
            assert!(r.new_blocks as usize <= self.m.seq_blocks_held(seq).unwrap());
            assert!(r.new_blocks + r.cached_tokens_gpu / bs as u32 <= ng * nb);
        }
        assert_eq!(r.cached_tokens, r.cached_tokens_gpu + r.cached_tokens_host);
        if !self.m.config().host_cache {
            assert_eq!(r.cached_tokens_host, 0);
        }
        if !self.m.config().enable_prefix_caching {
            assert_eq!(r.cached_tokens, 0);
        }
        self.model.insert(
            seq,
            ModelSeq {
                tokens: toks[..held].to_vec(),
                rest: toks[held..].to_vec(),
                salt,
                computed: cached,
                state: SeqState::Running,
                prov: 0,
            },
        );
    }

    fn check_tables(&self) {
        assert_eq!(self.m.num_seqs(), self.model.len());
        for (&id, ms) in &self.model {
            assert_eq!(self.m.seq_len(id).unwrap(), ms.tokens.len());
            assert_eq!(self.m.num_provisional(id).unwrap(), ms.prov);
            assert_eq!(self.m.committed_len(id).unwrap(), ms.tokens.len() - ms.prov);
            assert_eq!(self.m.seq_state(id).unwrap(), ms.state);
            let t = self.m.block_table(id).unwrap();
            match ms.state {
                SeqState::Running => {}
                SeqState::Recompute => {
                    assert!(t.is_empty());
                    continue;
                }
                SeqState::Swapped => {
                    assert_eq!(t.len(), blocks_for(ms.tokens.len(), self.bs));
                    // A windowed group 0 keeps its released prefix null on the host too.
                    let start0 = t.iter().take_while(|&&h| h == NULL_BLOCK).count();
                    assert!(start0 == 0 || self.m.group_kind(0).unwrap().is_windowed());
                    assert!(start0 < t.len(), "swapped group 0 released its tail");
                    for &h in &t[start0..] {
                        assert_ne!(h, NULL_BLOCK, "swapped group 0: a null after a live one");
                        assert!(self.m.host_block_refcount(h).unwrap() >= 1);
                    }
                    // Other groups on the host too: as long, the released prefix still null.
                    for g in 1..self.m.num_groups() {
                        let gt = self.m.block_table_group(id, g).unwrap();
                        assert_eq!(gt.len(), t.len());
                        let start = gt.iter().take_while(|&&h| h == NULL_BLOCK).count();
                        assert!(start < gt.len(), "swapped group {g} released its tail");
                        for &h in &gt[start..] {
                            assert_ne!(h, NULL_BLOCK, "swapped group {g}: a null after a live one");
                            assert!(self.m.host_block_refcount(h).unwrap() >= 1);
                        }
                    }
                    continue;
                }
            }
            assert_eq!(t.len(), blocks_for(ms.tokens.len(), self.bs));
            // Group 0's null prefix: only when it is windowed (every group is), never the tail.
            let start0 = t.iter().take_while(|&&b| b == NULL_BLOCK).count();
            assert!(start0 == 0 || self.m.group_kind(0).unwrap().is_windowed());
            assert!(start0 < t.len(), "group 0 released its tail");
            let own0 = &t[start0..];
            let mut sorted = own0.to_vec();
            sorted.sort();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                own0.len(),
                "a table maps two positions to one slot"
            );
            for &b in own0 {
                assert!(
                    self.m.block_refcount(b).unwrap() >= 1,
                    "table holds unowned block {b}"
                );
            }
            // Other groups: same length, a null prefix, owned blocks, no block twice in any of
            // the sequence's tables.
            for g in 1..self.m.num_groups() {
                let gt = self.m.block_table_group(id, g).unwrap();
                assert_eq!(gt.len(), t.len());
                let start = gt.iter().take_while(|&&b| b == NULL_BLOCK).count();
                assert!(start < gt.len(), "group {g} released its tail");
                for &b in &gt[start..] {
                    assert_ne!(b, NULL_BLOCK, "group {g}: a null entry after a live one");
                    assert!(self.m.block_refcount(b).unwrap() >= 1);
                    sorted.push(b);
                }
            }
            let n = sorted.len();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), n, "one block in two groups of a sequence");
        }
    }

    /// The KV offset `o` of host block `h` will hold once the queued copies have run: a queued
    /// swap-out into `h` runs first in a step and reads its device block as it is now.
    fn host_value(&self, h: u32, o: usize) -> Option<u64> {
        match self.m.pending_swap_out().iter().find(|&&(_, x)| x == h) {
            Some(&(d, _)) => self.kv[d as usize * self.bs + o],
            None => self.host_kv[h as usize * self.bs + o],
        }
    }

    /// The same for device block `b`: a queued copy-on-write into it copies from its source
    /// (after the swap-ins), a queued swap-in into it reads its host block.
    fn device_value(&self, b: u32, o: usize) -> Option<u64> {
        let b = self
            .m
            .pending_copies()
            .iter()
            .find(|&&(_, d)| d == b)
            .map_or(b, |&(src, _)| src);
        match self.m.pending_swap_in().iter().find(|&&(_, d)| d == b) {
            Some(&(h, _)) => self.host_value(h, o),
            None => self.kv[b as usize * self.bs + o],
        }
    }

    fn check_kv(&self) {
        for (&id, ms) in &self.model {
            let t = self.m.block_table(id).unwrap();
            let fp = fingerprints(ms);
            // Group 0 reads from the first position a later query reads (0 when it is full).
            let kind0 = self.m.group_kind(0).unwrap();
            for p in kind0.first_needed(ms.computed)..ms.computed {
                let (b, o) = (t[p / self.bs], p % self.bs);
                let v = match ms.state {
                    SeqState::Running => self.device_value(b, o),
                    SeqState::Swapped => self.host_value(b, o),
                    SeqState::Recompute => {
                        unreachable!("a recompute sequence has nothing computed")
                    }
                };
                assert_eq!(
                    v,
                    Some(fp[p]),
                    "seq {id} ({:?}) position {p} reads the wrong KV",
                    ms.state
                );
            }
            // Every other group reads its own KV at every position a later query can read,
            // from the host blocks its table names while swapped out.
            for g in 1..self.m.num_groups() {
                let kind = self.m.group_kind(g).unwrap();
                let t = self.m.block_table_group(id, g).unwrap();
                for p in kind.first_needed(ms.computed)..ms.computed {
                    let b = t[p / self.bs];
                    assert_ne!(
                        b, NULL_BLOCK,
                        "seq {id} group {g}: position {p} released too early"
                    );
                    let v = match ms.state {
                        SeqState::Swapped => self.host_value(b, p % self.bs),
                        _ => self.device_value(b, p % self.bs),
                    };
                    assert_eq!(
                        v,
                        Some(fp_group(fp[p], g)),
                        "seq {id} group {g} position {p} reads the wrong KV"
                    );
                }
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        let before = self.snapshot();
        let res: Result<(), Error> = match op.clone() {
            Op::Admit {
                seq,
                family,
                len,
                fork_at,
                salt,
                chunk,
            } => {
                let mut toks: Vec<u32> = (0..len as u32).map(|i| 100 + family * 1000 + i).collect();
                if fork_at < len {
                    toks[fork_at] = 7;
                }
                let keys = SeqKeys {
                    cache_salt: vec![salt; salt as usize],
                    ..Default::default()
                };
                let could = self.m.can_admit_tokens(&toks, Some(&keys), chunk).unwrap();
                let by_len = self.m.can_admit_len(len, chunk).unwrap();
                let dup = self.model.contains_key(&seq);
                match self.m.admit_opts(seq, &toks, Some(&keys), chunk) {
                    Ok(r) => {
                        assert!(!dup);
                        assert!(could, "can_admit_tokens said no, admit succeeded");
                        self.admitted(seq, toks, salt, chunk, r);
                        Ok(())
                    }
                    Err(e) => {
                        assert!(!could || dup, "can_admit_tokens said yes, admit said {e:?}");
                        // By length it is a bound only for whole prompts: a chunked one that
                        // hits cached-free blocks revives them on top of its chunk.
                        assert!(
                            !by_len || dup || chunk.is_some(),
                            "can_admit_len said yes, admit said {e:?}"
                        );
                        if dup {
                            assert_eq!(e, Error::DuplicateSequence { seq_id: seq });
                        } else {
                            assert!(matches!(
                                e,
                                Error::OutOfBlocks { .. }
                                    | Error::WatermarkReached { .. }
                                    | Error::SequenceTooLong { .. }
                            ));
                        }
                        Err(e)
                    }
                }
            }
            Op::Chunk { seq, k } => match self.model.get(&seq) {
                Some(ms) if !ms.rest.is_empty() => {
                    let k = k.min(ms.rest.len());
                    let part = ms.rest[..k].to_vec();
                    let r = self.m.append(seq, &part);
                    if r.is_ok() {
                        let ms = self.model.get_mut(&seq).unwrap();
                        ms.rest.drain(..k);
                        ms.tokens.extend_from_slice(&part);
                    }
                    r
                }
                _ => Ok(()),
            },
            Op::AdmitBatch {
                seqs,
                family,
                len,
                chunk,
            } => {
                let prompts: Vec<Vec<u32>> = seqs
                    .iter()
                    .map(|&s| {
                        (0..len as u32)
                            .map(|i| 100 + family * 1000 + i + (i >= s as u32) as u32)
                            .collect()
                    })
                    .collect();
                let reqs: Vec<AdmitRequest<'_>> = seqs
                    .iter()
                    .zip(&prompts)
                    .map(|(&s, p)| AdmitRequest {
                        max_new_tokens: chunk,
                        ..AdmitRequest::new(s, p)
                    })
                    .collect();
                let mut uniq = seqs.clone();
                uniq.sort();
                uniq.dedup();
                let valid = uniq.len() == seqs.len()
                    && seqs.iter().all(|s| !self.model.contains_key(s))
                    && (seqs.is_empty()
                        || blocks_for(len, self.bs) <= self.m.config().max_blocks_per_seq as usize);
                let first_fits = prompts
                    .first()
                    .map(|p| self.m.can_admit_tokens(p, None, chunk).unwrap());
                match self.m.admit_batch(&reqs) {
                    Ok(rs) => {
                        assert!(valid);
                        assert_eq!(rs.is_empty(), first_fits == Some(false) || seqs.is_empty());
                        let n = rs.len();
                        for (k, r) in rs.into_iter().enumerate() {
                            self.admitted(seqs[k], prompts[k].clone(), 0, chunk, r);
                        }
                        for &s in &seqs[n..] {
                            assert!(!self.m.contains(s), "admitted past the first misfit");
                        }
                        Ok(())
                    }
                    Err(e) => {
                        assert!(!valid, "valid batch rejected: {e:?}");
                        Err(e)
                    }
                }
            }
            Op::FreeBatch { seqs } => {
                let mut uniq = seqs.clone();
                uniq.sort();
                uniq.dedup();
                let valid =
                    uniq.len() == seqs.len() && seqs.iter().all(|s| self.model.contains_key(s));
                let r = self.m.free_batch(&seqs);
                assert_eq!(r.is_ok(), valid, "{r:?}");
                if r.is_ok() {
                    for s in &seqs {
                        self.model.remove(s);
                    }
                }
                r
            }
            Op::ResetPrefixCache => {
                let hashed = (0..self.m.config().num_blocks)
                    .filter(|&b| self.m.block_hash(b).is_some())
                    .count();
                assert_eq!(self.m.reset_prefix_cache(), Ok(hashed));
                assert_eq!(self.m.stats().cached_free_blocks, 0);
                Ok(())
            }
            Op::Append { seq, toks } => {
                let expect = self.model.get(&seq).map(|ms| {
                    if ms.state != SeqState::Running || ms.prov != 0 {
                        return false;
                    }
                    let len = ms.tokens.len();
                    let t = self.m.block_table(seq).unwrap();
                    let grow = blocks_for(len + toks.len(), self.bs) - t.len();
                    let cows: usize = (0..self.m.num_groups())
                        .map(|g| {
                            let t = self.m.block_table_group(seq, g).unwrap();
                            (len % self.bs != 0
                                && self.m.block_refcount(*t.last().unwrap()).unwrap() > 1)
                                as usize
                        })
                        .sum();
                    let fits = blocks_for(len + toks.len(), self.bs)
                        <= self.m.config().max_blocks_per_seq as usize;
                    fits && grow * self.m.num_groups() + cows <= self.m.num_free_blocks()
                });
                let r = self.m.append(seq, &toks);
                match expect {
                    None => assert_eq!(r, Err(Error::UnknownSequence { seq_id: seq })),
                    Some(ok) => assert_eq!(r.is_ok(), ok, "append predicted {ok}, got {r:?}"),
                }
                if r.is_ok() {
                    self.model
                        .get_mut(&seq)
                        .unwrap()
                        .tokens
                        .extend_from_slice(&toks);
                }
                r
            }
            Op::AppendBatch { seqs, tok } => {
                let toks = vec![tok; seqs.len()];
                let r = self.m.append_batch(&seqs, &toks);
                let mut uniq = seqs.clone();
                uniq.sort();
                uniq.dedup();
                let all_known = seqs.iter().all(|s| self.model.contains_key(s));
                match &r {
                    Ok(()) => {
                        assert!(all_known && uniq.len() == seqs.len());
                        for s in &seqs {
                            self.model.get_mut(s).unwrap().tokens.push(tok);
                        }
                    }
                    Err(Error::UnknownSequence { seq_id }) => {
                        assert!(!self.model.contains_key(seq_id))
                    }
                    Err(Error::InvalidArgument { what: "seqs", .. }) => {
                        assert!(uniq.len() < seqs.len())
                    }
                    Err(Error::InvalidSequenceState { seq_id, .. }) => {
                        let ms = &self.model[seq_id];
                        assert!(ms.state != SeqState::Running || ms.prov != 0)
                    }
                    Err(e) => assert!(
                        matches!(e, Error::OutOfBlocks { .. } | Error::SequenceTooLong { .. }),
                        "unexpected {e:?}"
                    ),
                }
                r
            }
            Op::Free { seq } => {
                let r = self.m.free(seq);
                assert_eq!(r.is_ok(), self.model.remove(&seq).is_some());
                r
            }
            Op::Fork { parent, child } => {
                let r = self.m.fork(parent, child);
                match (
                    self.model.get(&parent).cloned(),
                    self.model.contains_key(&child),
                ) {
                    (None, _) => assert_eq!(r, Err(Error::UnknownSequence { seq_id: parent })),
                    (Some(p), _) if p.state != SeqState::Running || p.prov != 0 => {
                        assert!(matches!(r, Err(Error::InvalidSequenceState { .. })))
                    }
                    (Some(_), true) => {
                        assert_eq!(r, Err(Error::DuplicateSequence { seq_id: child }))
                    }
                    (Some(p), false) => {
                        assert_eq!(r, Ok(()));
                        self.model.insert(child, p);
                    }
                }
                r
            }
            Op::Step { mask } => {
                let mut seqs: Vec<SeqId> = self
                    .model
                    .iter()
                    .filter(|(&s, ms)| {
                        mask & (1 << s) != 0
                            && ms.state == SeqState::Running
                            && ms.computed < ms.tokens.len()
                    })
                    .map(|(&s, _)| s)
                    .collect();
                seqs.sort();
                let n: Vec<u32> = seqs
                    .iter()
                    .map(|s| (self.model[s].tokens.len() - self.model[s].computed) as u32)
                    .collect();
                let copies_before = self.m.pending_copies().to_vec();
                let swaps_queued =
                    !self.m.pending_swap_out().is_empty() || !self.m.pending_swap_in().is_empty();
                // The copies the batch needs when not all fit: those whose dst or src a scheduled
                // table holds.
                let room = self.ob.copies.len() / 2;
                let needed = if copies_before.len() <= room {
                    0
                } else {
                    copies_before
                        .iter()
                        .filter(|&&(src, d)| {
                            seqs.iter().any(|&q| {
                                (0..self.m.num_groups()).any(|g| {
                                    let t = self.m.block_table_group(q, g).unwrap();
                                    t.contains(&d) || t.contains(&src)
                                })
                            })
                        })
                        .count()
                };
                let mut gviews = self.gob.views();
                let built = self
                    .m
                    .build_step_groups(&seqs, &n, &mut self.ob.view(), &mut gviews);
                drop(gviews);
                match built {
                    Ok(info) => {
                        assert!(needed <= room);
                        self.check_step_output(&seqs, &n, &info, &copies_before, swaps_queued);
                        Ok(())
                    }
                    Err(
                        e @ Error::BufferTooSmall {
                            buffer: "swap_out" | "swap_in",
                            ..
                        },
                    ) => {
                        // The swap lists are planned after the copies fit.
                        assert!(needed <= room);
                        Err(e)
                    }
                    Err(e) => {
                        // Only a batch whose own copies do not fit may be refused.
                        assert!(needed > room, "{e}");
                        assert_eq!(
                            e,
                            Error::BufferTooSmall {
                                buffer: "copies",
                                needed: 2 * needed,
                                capacity: 2 * room
                            }
                        );
                        Err(e)
                    }
                }
            }
            Op::SwapOut { seq, victim } => {
                let seqs = if victim {
                    self.m.choose_victim().unwrap_or_default()
                } else {
                    vec![seq]
                };
                if victim {
                    // The most recently admitted running group, whole.
                    let running: Vec<SeqId> = self
                        .model
                        .iter()
                        .filter(|(_, ms)| ms.state == SeqState::Running)
                        .map(|(&s, _)| s)
                        .collect();
                    assert_eq!(seqs.is_empty(), running.is_empty());
                }
                let r = self.m.swap_out(&seqs);
                match &r {
                    Ok(_) => {
                        for s in &seqs {
                            let ms = self.model.get_mut(s).unwrap();
                            assert_eq!(ms.state, SeqState::Running);
                            // Preemption rewinds provisional tokens.
                            ms.settle(0);
                            ms.state = SeqState::Swapped;
                        }
                    }
                    Err(Error::UnknownSequence { seq_id }) => {
                        assert!(!self.model.contains_key(seq_id))
                    }
                    Err(Error::InvalidSequenceState { seq_id, .. }) => {
                        assert_ne!(self.model[seq_id].state, SeqState::Running)
                    }
                    Err(e) => assert!(
                        matches!(e, Error::OutOfHostBlocks { .. })
                            || (seqs.is_empty() && matches!(e, Error::InvalidArgument { .. })),
                        "unexpected {e:?}"
                    ),
                }
                r.map(|_| ())
            }
            Op::SwapIn { seq } => {
                let r = self.m.swap_in(&[seq]);
                match (&r, self.model.get_mut(&seq)) {
                    (Ok(_), Some(ms)) => {
                        assert_eq!(ms.state, SeqState::Swapped);
                        ms.state = SeqState::Running;
                    }
                    (Err(Error::UnknownSequence { .. }), None) => {}
                    (Err(Error::InvalidSequenceState { .. }), Some(ms)) => {
                        assert_ne!(ms.state, SeqState::Swapped)
                    }
                    (Err(Error::OutOfBlocks { .. } | Error::WatermarkReached { .. }), Some(ms)) => {
                        assert_eq!(ms.state, SeqState::Swapped)
                    }
                    (r, _) => panic!("swap_in: unexpected {r:?}"),
                }
                r.map(|_| ())
            }
            Op::Recompute { seq } => {
                let r = self.m.recompute(seq);
                match (&r, self.model.get_mut(&seq)) {
                    (Ok(()), Some(ms)) => {
                        assert_ne!(ms.state, SeqState::Recompute);
                        ms.settle(0);
                        ms.state = SeqState::Recompute;
                        ms.computed = 0;
                    }
                    (Err(Error::UnknownSequence { .. }), None) => {}
                    (Err(Error::InvalidSequenceState { .. }), Some(ms)) => {
                        assert_eq!(ms.state, SeqState::Recompute)
                    }
                    (r, _) => panic!("recompute: unexpected {r:?}"),
                }
                r
            }
            Op::Fetch {
                family,
                len,
                salt,
                k,
                ok,
            } => {
                let toks: Vec<u32> = (0..len as u32).map(|i| 100 + family * 1000 + i).collect();
                let keys = SeqKeys {
                    cache_salt: vec![salt; salt as usize],
                    ..Default::default()
                };
                let look = self.m.lookup_tiers(&toks, Some(&keys)).unwrap();
                if !self.m.config().host_cache {
                    assert!(matches!(
                        self.m.reserve_host_blocks(1),
                        Err(Error::InvalidArgument { .. })
                    ));
                    return self.m.check_invariants().unwrap();
                }
                let bs = self.bs;
                let first = look.gpu_blocks + look.host_blocks;
                assert_eq!(look.hashes.len(), (len - 1) / bs);
                assert!(first <= look.hashes.len());
                let rest = &look.hashes[first..];
                let n = k.min(rest.len());
                match self.m.reserve_host_blocks(n) {
                    Ok(hs) => {
                        // Reserved blocks are never findable (the reservation may have demoted
                        // some of the prompt's own host hits, never added any).
                        let again = self.m.lookup_tiers(&toks, Some(&keys)).unwrap();
                        if self.m.num_groups() == 1 {
                            assert!(again.host_blocks <= look.host_blocks);
                            assert_eq!(again.gpu_blocks, look.gpu_blocks);
                        } else {
                            // A demoted block of another group may shorten the boundary.
                            assert!(
                                again.gpu_blocks + again.host_blocks
                                    <= look.gpu_blocks + look.host_blocks
                            );
                        }
                        for d in self.m.take_demotions() {
                            assert_eq!(d.tokens.len(), bs);
                        }
                        let fp = fingerprints(&ModelSeq {
                            tokens: toks.clone(),
                            rest: Vec::new(),
                            salt,
                            computed: 0,
                            state: SeqState::Running,
                            prov: 0,
                        });
                        let mut parents = Vec::new();
                        let mut prev = first.checked_sub(1).map(|i| look.hashes[i]);
                        for (i, &h) in hs.iter().enumerate() {
                            let blk = first + i;
                            for o in 0..bs {
                                self.host_kv[h as usize * bs + o] = Some(fp[blk * bs + o]);
                            }
                            parents.push(prev);
                            prev = Some(rest[i]);
                        }
                        let t = &toks[first * bs..(first + n) * bs];
                        let c = self
                            .m
                            .commit_host_blocks(&hs, &rest[..n], &parents, look.salt_digest, t, ok)
                            .unwrap();
                        if !ok {
                            assert_eq!(c, 0);
                        }
                        Ok(())
                    }
                    Err(e @ Error::OutOfHostBlocks { .. }) => Err(e),
                    Err(e) => panic!("reserve: unexpected {e:?}"),
                }
            }
            Op::Resume { seq, chunk } => {
                let r = self.m.resume(seq, chunk);
                match (&r, self.model.get(&seq).cloned()) {
                    (Ok(res), Some(ms)) => {
                        assert_eq!(ms.state, SeqState::Recompute);
                        // Re-admitted from the kept tokens; what it does not hold yet is fed
                        // before the rest of the prompt.
                        let rest = ms.rest.clone();
                        self.admitted(seq, ms.tokens.clone(), ms.salt, chunk, *res);
                        self.model.get_mut(&seq).unwrap().rest.extend(rest);
                    }
                    (Err(Error::UnknownSequence { .. }), None) => {}
                    (Err(Error::InvalidSequenceState { .. }), Some(ms)) => {
                        assert_ne!(ms.state, SeqState::Recompute)
                    }
                    (Err(Error::OutOfBlocks { .. } | Error::WatermarkReached { .. }), Some(ms)) => {
                        assert_eq!(ms.state, SeqState::Recompute)
                    }
                    (r, _) => panic!("resume: unexpected {r:?}"),
                }
                r.map(|_| ())
            }
            Op::Provisional { seqs, k, clamp } => {
                let mut seqs = seqs;
                if clamp {
                    let mut seen = Vec::new();
                    seqs.retain(|s| {
                        let keep = self
                            .model
                            .get(s)
                            .is_some_and(|ms| ms.state == SeqState::Running)
                            && !seen.contains(s);
                        seen.push(*s);
                        keep
                    });
                    if seqs.is_empty() {
                        return;
                    }
                }
                let max = self.m.config().max_provisional as usize;
                let mut uniq = seqs.clone();
                uniq.sort();
                uniq.dedup();
                let r = if seqs.len() == 1 {
                    self.m.append_provisional(seqs[0], k as usize)
                } else {
                    self.m.append_provisional_batch(&seqs, &vec![k; seqs.len()])
                };
                match &r {
                    Ok(()) => {
                        assert_eq!(uniq.len(), seqs.len());
                        for s in &seqs {
                            let ms = self.model.get_mut(s).unwrap();
                            assert_eq!(ms.state, SeqState::Running);
                            assert!(k >= 1 && ms.prov + k as usize <= max);
                            let len = ms.tokens.len();
                            ms.tokens.extend((len..len + k as usize).map(draft));
                            ms.prov += k as usize;
                        }
                    }
                    Err(Error::UnknownSequence { seq_id }) => {
                        assert!(!self.model.contains_key(seq_id))
                    }
                    Err(Error::InvalidArgument { what: "seqs", .. }) => {
                        assert!(uniq.len() < seqs.len())
                    }
                    Err(Error::InvalidArgument {
                        what: "num_provisional",
                        ..
                    }) => assert!(seqs
                        .iter()
                        .any(|s| k == 0 || self.model[s].prov + k as usize > max)),
                    Err(Error::InvalidSequenceState { seq_id, .. }) => {
                        assert_ne!(self.model[seq_id].state, SeqState::Running)
                    }
                    Err(e) => assert!(
                        matches!(e, Error::OutOfBlocks { .. } | Error::SequenceTooLong { .. }),
                        "unexpected {e:?}"
                    ),
                }
                r
            }
            Op::Commit { seqs, n, clamp } => {
                let mut seqs = seqs;
                if clamp {
                    let mut seen = Vec::new();
                    seqs.retain(|s| {
                        let keep = self.model.contains_key(s) && !seen.contains(s);
                        seen.push(*s);
                        keep
                    });
                    if seqs.is_empty() {
                        return;
                    }
                }
                let pairs: Vec<(SeqId, u32)> = seqs
                    .iter()
                    .map(|s| match self.model.get(s) {
                        Some(ms) if clamp => (*s, n.min(ms.prov as u32)),
                        _ => (*s, n),
                    })
                    .collect();
                let mut uniq = seqs.clone();
                uniq.sort();
                uniq.dedup();
                let valid = uniq.len() == seqs.len()
                    && pairs
                        .iter()
                        .all(|(s, n)| self.model.get(s).is_some_and(|ms| *n as usize <= ms.prov));
                // The accepted ids are the drafts (what a step computed for those positions).
                let mut toks = Vec::new();
                for (s, n) in &pairs {
                    if let Some(ms) = self.model.get(s) {
                        let c = ms.tokens.len() - ms.prov;
                        let end = (c + *n as usize).min(ms.tokens.len());
                        toks.extend_from_slice(&ms.tokens[c..end]);
                    }
                }
                let r = if pairs.len() == 1 {
                    self.m.commit(pairs[0].0, pairs[0].1 as usize, &toks)
                } else {
                    self.m.commit_batch(&pairs, &toks)
                };
                assert_eq!(r.is_ok(), valid, "commit predicted {valid}, got {r:?}");
                if r.is_ok() {
                    for (s, n) in &pairs {
                        self.model.get_mut(s).unwrap().settle(*n as usize);
                    }
                } else {
                    assert!(matches!(
                        r,
                        Err(Error::UnknownSequence { .. } | Error::InvalidArgument { .. })
                    ));
                }
                r
            }
            Op::Rewind { seq } => {
                let r = self.m.rewind(seq);
                match self.model.get_mut(&seq) {
                    Some(ms) => {
                        assert_eq!(r, Ok(()));
                        ms.settle(0);
                    }
                    None => assert_eq!(r, Err(Error::UnknownSequence { seq_id: seq })),
                }
                r
            }
        };
        if res.is_err() {
            assert_eq!(
                self.snapshot(),
                before,
                "{op:?} failed but changed the state"
            );
        }
        self.m.check_invariants().unwrap();
        self.check_tables();
    }

    fn check_step_output(
        &mut self,
        seqs: &[SeqId],
        n: &[u32],
        info: &pagedkv::step::StepInfo,
        copies: &[(u32, u32)],
        swaps_queued: bool,
    ) {
        let bs = self.bs;
        let ob = &self.ob;
        assert_eq!(info.num_seqs, seqs.len());
        // The emitted copies are the queue minus what stays pending, in queue order; all of
        // them fit, and none still pending is one a scheduled table holds.
        let emitted: Vec<(u32, u32)> = (0..info.num_copies)
            .map(|j| (ob.copies[2 * j] as u32, ob.copies[2 * j + 1] as u32))
            .collect();
        let left = self.m.pending_copies().to_vec();
        let mut merged: Vec<(u32, u32)> = copies
            .iter()
            .copied()
            .filter(|c| emitted.contains(c) || left.contains(c))
            .collect();
        assert_eq!(merged.len(), copies.len());
        merged.retain(|c| emitted.contains(c));
        assert_eq!(merged, emitted);
        assert_eq!(
            copies
                .iter()
                .copied()
                .filter(|c| left.contains(c))
                .collect::<Vec<_>>(),
            left
        );
        assert!(info.num_copies <= ob.copies.len() / 2);
        // A copy may also wait (with room left) for a swap-out of its destination or a swap-in
        // of its source that did not fit this step.
        assert!(left.is_empty() || info.num_copies == ob.copies.len() / 2 || swaps_queued);
        for &(src, d) in &left {
            for &q in seqs {
                for g in 0..self.m.num_groups() {
                    let t = self.m.block_table_group(q, g).unwrap();
                    assert!(!t.contains(&d) && !t.contains(&src));
                }
            }
        }
        let copies = &emitted[..];
        // Copies: distinct dsts, no dst is a src; applied together, before any write.
        let dsts: std::collections::HashSet<u32> = copies.iter().map(|c| c.1).collect();
        assert_eq!(dsts.len(), copies.len());
        assert!(copies.iter().all(|c| !dsts.contains(&c.0)));
        for (j, &(s, d)) in copies.iter().enumerate() {
            assert_eq!(
                (ob.copies[2 * j], ob.copies[2 * j + 1]),
                (s as i64, d as i64)
            );
        }
        // Swap lists: host destinations distinct, device destinations distinct; applied in order
        // swap-out, swap-in, then the copies.
        let outs: Vec<(usize, usize)> = (0..info.num_swap_out)
            .map(|j| (ob.swap_out[2 * j] as usize, ob.swap_out[2 * j + 1] as usize))
            .collect();
        let ins: Vec<(usize, usize)> = (0..info.num_swap_in)
            .map(|j| (ob.swap_in[2 * j] as usize, ob.swap_in[2 * j + 1] as usize))
            .collect();
        let hd: std::collections::HashSet<usize> = outs.iter().map(|c| c.1).collect();
        assert_eq!(hd.len(), outs.len());
        let dd: std::collections::HashSet<usize> = ins.iter().map(|c| c.1).collect();
        assert_eq!(dd.len(), ins.len());
        for &(d, h) in &outs {
            for o in 0..bs {
                self.host_kv[h * bs + o] = self.kv[d * bs + o];
            }
        }
        for &(h, d) in &ins {
            for o in 0..bs {
                self.kv[d * bs + o] = self.host_kv[h * bs + o];
            }
        }
        let snapshot = self.kv.clone();
        for &(s, d) in copies {
            for o in 0..bs {
                self.kv[d as usize * bs + o] = snapshot[s as usize * bs + o];
            }
        }
        let (mut tok, mut kv) = (0usize, 0usize);
        assert_eq!(ob.query_start_loc[0], 0);
        assert_eq!(ob.kv_indptr[0], 0);
        let mut max_len = 0;
        for (k, &s) in seqs.iter().enumerate() {
            let ms = &self.model[&s];
            let len = ms.tokens.len();
            max_len = max_len.max(len);
            let t = self.m.block_table(s).unwrap();
            let fp = fingerprints(ms);
            for (j, p) in (len - n[k] as usize..len).enumerate() {
                let slot = ob.slot_mapping[tok + j];
                assert_eq!(slot, t[p / bs] as i64 * bs as i64 + (p % bs) as i64);
                self.kv[slot as usize] = Some(fp[p]);
            }
            tok += n[k] as usize;
            assert_eq!(ob.query_start_loc[k + 1] as usize, tok);
            assert_eq!(ob.seq_lens[k] as usize, len);
            let stride = ob.block_table_stride;
            let row: Vec<u32> = ob.block_tables[k * stride..k * stride + t.len()]
                .iter()
                .map(|&x| x as u32)
                .collect();
            assert_eq!(row, t);
            let csr: Vec<u32> = ob.kv_indices[kv..kv + t.len()]
                .iter()
                .map(|&x| x as u32)
                .collect();
            assert_eq!(csr, t);
            kv += t.len();
            assert_eq!(ob.kv_indptr[k + 1] as usize, kv);
            assert_eq!(ob.kv_last_page_len[k] as usize, (len - 1) % bs + 1);
            // Other groups: their own slots and rows; a windowed group has released exactly the
            // blocks dead for the step's first new position (never the tail).
            // Releases follow the committed length.
            let c = (len - n[k] as usize).min(len - ms.prov);
            let tok0 = tok - n[k] as usize;
            let kind0 = self.m.group_kind(0).unwrap();
            assert_eq!(
                t.iter().take_while(|&&b| b == NULL_BLOCK).count(),
                dead_blocks(kind0, c, bs).min(blocks_for(len - ms.prov, bs) - 1),
                "group 0 ({kind0:?}) at c = {c}"
            );
            for g in 1..self.m.num_groups() {
                let kind = self.m.group_kind(g).unwrap();
                let gt = self.m.block_table_group(s, g).unwrap();
                let start = gt.iter().take_while(|&&b| b == NULL_BLOCK).count();
                assert_eq!(
                    start,
                    dead_blocks(kind, c, bs).min(blocks_for(len - ms.prov, bs) - 1),
                    "group {g} ({kind:?}) at c = {c}"
                );
                let gb = &self.gob;
                for (j, p) in (len - n[k] as usize..len).enumerate() {
                    let slot = gb.slot_mappings[g - 1][tok0 + j];
                    assert_eq!(slot, gt[p / bs] as i64 * bs as i64 + (p % bs) as i64);
                    self.kv[slot as usize] = Some(fp_group(fp[p], g));
                }
                let stride = gb.block_table_stride;
                let row: Vec<u32> = gb.block_tables[g - 1][k * stride..k * stride + gt.len()]
                    .iter()
                    .map(|&x| x as u32)
                    .collect();
                assert_eq!(row, gt);
            }
        }
        assert_eq!(
            (info.num_tokens, info.num_kv_indices, info.max_seq_len),
            (tok, kv, max_len)
        );
        for s in seqs {
            let ms = self.model.get_mut(s).unwrap();
            ms.computed = ms.tokens.len();
        }
        self.check_kv();
    }
}

fn config() -> impl Strategy<Value = ManagerConfig> {
    (
        4u32..40,
        1u32..5,
        0u32..3,
        any::<bool>(),
        any::<bool>(),
        2u32..12,
        prop::sample::select(vec![0u32, 3, 40]),
        (0u8..4, 1u32..3),
    )
        .prop_map(
            |(num_blocks, bs, wm, caching, verify, max_row, host, (tier, min_load))| {
                let mut c = ManagerConfig::new(num_blocks, bs);
                c.num_host_blocks = host;
                c.watermark_blocks = wm.min(num_blocks - 1);
                c.enable_prefix_caching = caching;
                c.verify_prefix = verify;
                c.max_blocks_per_seq = max_row;
                // The host tier (write-back or write-through) wherever it can be on, half the time.
                c.host_cache = caching && verify && host > 0 && tier >= 2;
                c.host_write_through = c.host_cache && tier == 3;
                c.host_load_min_blocks = min_load;
                c.kv_event_capacity = if tier == 1 { 8 } else { 0 };
                // Provisional tokens: off (the default) or up to 2, 4 per sequence.
                c.max_provisional = [0, 2, 4][((num_blocks + max_row) % 3) as usize];
                c
            },
        )
}

/// Configurations with the host tier on: prefix caching with verify, a small or a large host pool,
/// write-back or write-through.
fn tier_config() -> impl Strategy<Value = ManagerConfig> {
    (
        config(),
        prop::sample::select(vec![2u32, 3, 6, 40]),
        any::<bool>(),
    )
        .prop_map(|(mut c, host, through)| {
            c.enable_prefix_caching = true;
            c.verify_prefix = true;
            c.num_host_blocks = host;
            c.host_cache = true;
            c.host_write_through = through;
            c
        })
}

impl Harness {
    /// A harness over a fresh manager of `cfg`: step buffers of up to 16 sequences and 4096 tokens
    /// a step, `max_copies` copy and `max_swaps` swap pairs, every group's; empty KV.
    fn new(cfg: ManagerConfig, max_copies: usize, max_swaps: usize) -> Self {
        let bs = cfg.block_size as usize;
        let layout = StepLayout {
            max_seqs: 16,
            max_tokens: 4096,
            max_blocks_per_seq: cfg.max_blocks_per_seq as usize,
            max_copies,
            max_swaps,
        };
        let extra = cfg.groups.len().saturating_sub(1);
        Self {
            kv: vec![None; cfg.num_blocks as usize * bs],
            host_kv: vec![None; cfg.num_host_blocks as usize * bs],
            m: BlockManager::new(cfg).unwrap(),
            model: HashMap::new(),
            bs,
            ob: OwnedStepBuffers::new(layout),
            gob: OwnedGroupBuffers::new(layout, extra),
        }
    }

    /// Applies `ops`, calling `after` on the manager after each. Then, when `drain_swaps`, empty
    /// steps until the swap queues are empty (failing if 64 do not empty them); then one step of
    /// every live sequence, every sequence freed, an empty step, and `after` once more. Nothing
    /// leaks: every device block is free again.
    fn walk(
        &mut self,
        ops: &[Op],
        drain_swaps: bool,
        mut after: impl FnMut(&mut BlockManager),
    ) -> Result<(), TestCaseError> {
        for op in ops {
            self.apply(op);
            after(&mut self.m);
        }
        if drain_swaps {
            for _ in 0..64 {
                if self.m.pending_swap_out().is_empty() && self.m.pending_swap_in().is_empty() {
                    break;
                }
                self.apply(&Op::Step { mask: 0 });
            }
            prop_assert!(
                self.m.pending_swap_out().is_empty() && self.m.pending_swap_in().is_empty()
            );
        }
        let live: Vec<SeqId> = self.model.keys().copied().collect();
        self.apply(&Op::Step {
            mask: live.iter().fold(0u16, |m, &s| m | 1 << s),
        });
        for s in live {
            self.apply(&Op::Free { seq: s });
        }
        self.apply(&Op::Step { mask: 0 });
        after(&mut self.m);
        prop_assert_eq!(
            self.m.num_free_blocks(),
            self.m.config().num_blocks as usize
        );
        prop_assert_eq!(self.m.stats().used_blocks, 0);
        Ok(())
    }

    /// Host-cached blocks stay, unreferenced; everything else of the host pool is free.
    fn check_host_pool_free_or_cached(&self) -> Result<(), TestCaseError> {
        let st = self.m.stats();
        prop_assert_eq!(
            self.m.num_free_host_blocks() + st.host_cached_blocks as usize,
            self.m.config().num_host_blocks as usize
        );
        Ok(())
    }
}

/// Replays a manager's KV events per (group, hash) and checks them against what it holds: the
/// device prefix cache's `cached_block_keys()` and, when `by_medium`, the host index's
/// `host_block_keys()` (host events kept apart). Without `by_medium` every event counts towards
/// the device's set.
struct EventReplay {
    by_medium: bool,
    held: [std::collections::BTreeSet<(usize, u128)>; 2],
    events: Vec<pagedkv::events::KvEvent>,
}

impl EventReplay {
    fn new(by_medium: bool) -> Self {
        Self {
            by_medium,
            held: Default::default(),
            events: Vec::new(),
        }
    }

    fn check(&mut self, m: &mut BlockManager) {
        self.events.clear();
        m.drain_events(&mut self.events);
        for e in &self.events {
            let g = e.group as usize;
            let tier = match e.medium {
                Medium::Host if self.by_medium => &mut self.held[1],
                _ => &mut self.held[0],
            };
            match e.kind {
                KvEventKind::Stored => {
                    for &x in &e.block_hashes {
                        assert!(tier.insert((g, x)), "stored twice: ({g}, {x:#x})");
                    }
                }
                KvEventKind::Removed => {
                    for &x in &e.block_hashes {
                        assert!(tier.remove(&(g, x)), "removed unheld: ({g}, {x:#x})");
                    }
                }
                KvEventKind::Cleared => tier.clear(),
            }
        }
        assert_eq!(m.events_dropped(), 0);
        let want: std::collections::BTreeSet<_> = m.cached_block_keys().into_iter().collect();
        assert_eq!(self.held[0], want);
        if self.by_medium {
            let want: std::collections::BTreeSet<_> = m.host_block_keys().into_iter().collect();
            assert_eq!(self.held[1], want);
        }
    }
}

/// The walk of the one-group tests: `ops`, the swap queues drained, everything freed; nothing
/// leaks, and without the host tier the host pool was never used as a cache.
fn one_group_walk(
    cfg: ManagerConfig,
    max_copies: usize,
    max_swaps: usize,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let mut h = Harness::new(cfg, max_copies, max_swaps);
    h.walk(ops, true, |_| {})?;
    h.check_host_pool_free_or_cached()?;
    let st = h.m.stats();
    if !h.m.config().host_cache {
        prop_assert_eq!(
            st.host_cached_blocks + st.offloaded_blocks + st.host_hit_tokens,
            0
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_model(
        cfg in config(),
        max_copies in prop::sample::select(vec![1usize, 2, 128]),
        max_swaps in prop::sample::select(vec![1usize, 3, 256]),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        one_group_walk(cfg, max_copies, max_swaps, &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn manager_with_host_tier_matches_model(
        cfg in tier_config(),
        max_copies in prop::sample::select(vec![1usize, 2, 128]),
        max_swaps in prop::sample::select(vec![1usize, 3, 256]),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        one_group_walk(cfg, max_copies, max_swaps, &ops)?;
    }
}

/// Hybrid configurations: a full group 0, then a sliding and a chunked group (windows and chunks
/// smaller and larger than a block, so releases happen mid-walk), with swap on or off (the host
/// pool of `config`, every group's blocks moving through it), the host tier off (on in
/// `hybrid_tier_config`), and the KV-event ring on (large enough for any walk).
fn hybrid_config() -> impl Strategy<Value = ManagerConfig> {
    (config(), 1u32..12, 1u32..12, any::<bool>()).prop_map(|(mut c, w, ch, order)| {
        c.host_cache = false;
        c.host_write_through = false;
        c.kv_event_capacity = 1 << 14;
        c.num_blocks *= 2;
        let (a, b) = (
            AttentionKind::Sliding { window: w },
            AttentionKind::Chunked { chunk: ch },
        );
        c.groups = if order {
            vec![AttentionKind::Full, a, b]
        } else {
            vec![AttentionKind::Full, b, a, AttentionKind::Full]
        };
        c
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_groups_match_model(
        cfg in hybrid_config(),
        max_copies in prop::sample::select(vec![1usize, 2, 128]),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        walk_groups(cfg, max_copies, &ops)?;
    }
}

/// One walk of `ops` on a manager with KV cache groups (`hybrid_groups_match_model`,
/// `all_windowed_groups_match_model`): the model's checks after every operation, the KV events
/// replayed per (group, hash) equal to the prefix cache, and everything free at the end.
fn walk_groups(
    cfg: ManagerConfig,
    max_copies: usize,
    ops: &[Op],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let mut h = Harness::new(cfg, max_copies, 4);
    let mut events = EventReplay::new(false);
    h.walk(ops, false, |m| events.check(m))?;
    prop_assert_eq!(
        h.m.num_free_host_blocks(),
        h.m.config().num_host_blocks as usize
    );
    Ok(())
}

/// Configurations whose every group is windowed (a model whose every layer slides or is
/// chunked): group 0 sliding or chunked, alone or beside other windowed groups, with swap on or
/// off and no host tier. Group 0 releases its dead blocks like the others.
fn all_windowed_config() -> impl Strategy<Value = ManagerConfig> {
    (config(), 1u32..12, 1u32..12, 0u8..4).prop_map(|(mut c, w, ch, shape)| {
        c.host_cache = false;
        c.host_write_through = false;
        c.kv_event_capacity = 1 << 14;
        let (a, b) = (
            AttentionKind::Sliding { window: w },
            AttentionKind::Chunked { chunk: ch },
        );
        c.groups = match shape {
            0 => vec![a],
            1 => vec![b],
            2 => vec![a, b],
            _ => vec![b, a, a],
        };
        if c.groups.len() > 1 {
            c.num_blocks *= 2;
        }
        c
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn all_windowed_groups_match_model(
        cfg in all_windowed_config(),
        max_copies in prop::sample::select(vec![1usize, 2, 128]),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        walk_groups(cfg, max_copies, &ops)?;
    }
}

/// Hybrid configurations with the host tier on: `hybrid_config`'s groups over a small or a large
/// host pool, write-back or write-through. Each group's blocks enter the host tier under
/// `(chain hash, group)` and come back at the admission's group-aware boundary.
fn hybrid_tier_config() -> impl Strategy<Value = ManagerConfig> {
    (
        hybrid_config(),
        prop::sample::select(vec![2u32, 3, 6, 40]),
        any::<bool>(),
    )
        .prop_map(|(mut c, host, through)| {
            c.enable_prefix_caching = true;
            c.verify_prefix = true;
            c.num_host_blocks = host;
            c.host_cache = true;
            c.host_write_through = through;
            // A tight device pool, so prefixes are evicted and come back from the host.
            c.num_blocks = c.num_blocks.max(24);
            c.max_blocks_per_seq = 24;
            c.watermark_blocks = c.watermark_blocks.min(1);
            c
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_groups_with_host_tier_match_model(
        cfg in hybrid_tier_config(),
        max_copies in prop::sample::select(vec![1usize, 2, 128]),
        max_swaps in prop::sample::select(vec![1usize, 3, 256]),
        ops in prop::collection::vec(tier_op(), 1..160),
    ) {
        let mut h = Harness::new(cfg, max_copies, max_swaps);
        // Each tier's KV events, replayed per (group, hash), equal what it holds after every
        // operation: the device prefix cache's `cached_block_keys()`, the host index's
        // `host_block_keys()`.
        let mut events = EventReplay::new(true);
        h.walk(&ops, true, |m| events.check(m))?;
        h.check_host_pool_free_or_cached()?;
    }
}

/// At least 10⁶ operations of seeded random walks (the `op()` mix: admissions with shared
/// prefixes, forks, chunked prefill, steps, swap and recompute preemption, evictions, tier
/// fetches, resets) on managers that hold provisional tokens (`max_provisional` 2 or 4): drafts
/// appended, stepped, committed in part and rewound, across block edges, with
/// `check_invariants` and the simulated KV read back after every operation. Walks are drawn
/// from a fixed seed, so a failure names the walk that reproduces it.
#[test]
fn provisional_walks_of_a_million_operations() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let seed = [0x5e_u8; 32];
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    );
    let walk = (
        config(),
        prop::sample::select(vec![1usize, 2, 128]),
        prop::sample::select(vec![1usize, 3, 256]),
        prop::sample::select(vec![2u32, 4]),
        prop::collection::vec(op(), 200..400),
    );
    let (mut ops_done, mut walks, mut drafts) = (0usize, 0usize, 0usize);
    while ops_done < 1_000_000 {
        let (mut cfg, copies, swaps, k, ops) = walk.new_tree(&mut runner).unwrap().current();
        cfg.max_provisional = k;
        drafts += ops
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    Op::Provisional { .. } | Op::Commit { .. } | Op::Rewind { .. }
                )
            })
            .count();
        if let Err(e) = one_group_walk(cfg.clone(), copies, swaps, &ops) {
            panic!("walk {walks} (seed {seed:?}) failed: {e}\nconfig: {cfg:?}");
        }
        ops_done += ops.len();
        walks += 1;
    }
    // The mix gives every walk drafts, commits and rewinds (about a fifth of the operations).
    assert!(
        drafts * 6 > ops_done,
        "{drafts} draft operations in {ops_done}"
    );
}
