//! The block manager: sequences, their block tables, the prefix cache and the step builder.
//!
//! Single owner (`&mut self`): one scheduler thread drives it. It holds the [`BlockPool`] (block
//! reference counts and the free list) and, owning it exclusively, uses the pool's `*_mut`
//! operations (plain loads and stores, no atomic read-modify-writes). It also holds the
//! [`PrefixCache`] and one state record per sequence: block table, token count, token ids (only
//! with prefix caching on: they are what gets hashed), the chained hashes of its full blocks, and
//! its hashing keys.
//!
//! Every block is in exactly one of four states:
//! - **free**: on the pool's free list;
//! - **cached-free**: refcount 0, hashed, in the prefix LRU — reusable by a prefix hit, evictable;
//! - **owned**: refcount ≥ 1, equal to the number of block tables that contain it;
//! - **copy source in flight**: refcount 0, unhashed, the `src` of a copy-on-write copy that the
//!   next step still has to emit; it goes back to the free list once the copy is emitted.
//!
//! Rules worth knowing:
//! - **Registration happens at step time.** A full block is offered to the prefix cache by the
//!   `build_step` that schedules its last token, not when the token is admitted or appended. A
//!   later admission can therefore only hit blocks whose KV a step has been built to write, and a
//!   sequence freed before any step ran leaves nothing stale in the cache.
//! - **At least one prompt token is computed.** An admission shares at most `(len - 1) / B` cached
//!   blocks, `len` being the whole prompt's length: when the whole prompt is cached, its last block
//!   is allocated fresh (and recomputed) rather than shared, so the engine never writes into a
//!   shared block.
//! - **Chunked admission.** The lookup covers the whole prompt, but with `max_new_tokens = k` the
//!   sequence holds only `cached + min(k, len - cached)` tokens; the caller appends the rest chunk
//!   by chunk. Each chunk's full blocks enter the cache when the step computing them is built.
//! - **Batch calls** (`admit_batch`, `free_batch`) validate every argument before touching state;
//!   `admit_batch` then admits in order and stops at the first request that does not fit.
//! - **Copy-on-write.** Only a partly filled tail block can be shared *and* written (after a
//!   fork). Appending into one allocates a fresh block and queues a `(src, dst)` copy that a
//!   `build_step` emits: the next one with room in its copy buffer, and at the latest the first
//!   one that schedules a sequence holding the copy's `dst` or `src`. The copy list of one step
//!   has distinct `dst`s and no `dst` is a `src`.
//! - **Allocation order.** Never-cached free blocks first, then the least recently freed
//!   cached-free block (an eviction). A freed sequence's blocks enter the LRU tail first, so its
//!   tail is evicted before its prefix.
//! - **Watermark.** Admissions must leave `watermark_blocks` free (cached-free counts as free);
//!   appends and forks may use the reserve.
//! - Every error leaves the manager unchanged: operations validate fully before touching state.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::hash::{random_key, root_hash, Hasher, SeqKeys};
use crate::metrics::{hist_bucket, Counters, Stats, HIST_BUCKETS};
use crate::pool::BlockPool;
use crate::prefix::{FastMap, PrefixCache};
use crate::step::{StepBuffers, StepCache, StepInfo};
use crate::swap::{CostModel, Decision, HostBlockId, HostPool, PreemptMode, SeqState};
use crate::table::{blocks_for, BlockTable};
use crate::{BlockId, SeqId, TokenId};

/// Configuration of a [`BlockManager`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Blocks in the pool; ids are `0..num_blocks`.
    pub num_blocks: u32,
    /// Tokens per block (`B`).
    pub block_size: u32,
    /// Reserve never handed to admissions, so running sequences can always append (< num_blocks).
    pub watermark_blocks: u32,
    /// Width of a block-table row: the most blocks one sequence may hold.
    pub max_blocks_per_seq: u32,
    /// Share full blocks between sequences with the same prefix (and keys), and keep freed full
    /// blocks cached until their space is needed.
    pub enable_prefix_caching: bool,
    /// Keep each cached block's token ids and compare them on every hit; a mismatch (a hash
    /// collision) is served as a miss and counted.
    pub verify_prefix: bool,
    /// Key of the prefix hash (the XXH3-128 seed of every block hash and of the chain root).
    /// `None` (the default): a fresh key from the OS for each manager, so nobody outside the
    /// process can predict or steer a hash. `Some(k)`: hashes are reproducible across processes
    /// and machines that share `k` — which also lets anyone who learns `k` compute them (see
    /// `docs/prefix-hash.md`, threat model).
    pub hash_seed: Option<u64>,
    /// Blocks of the host pool that swapped-out sequences live in (0: swap disabled). The host
    /// memory is the engine's; the core hands out its block ids.
    pub num_host_blocks: u32,
}

impl ManagerConfig {
    /// Defaults: watermark 1% of the pool (at least 1, but 0 for a one-block pool), rows as wide
    /// as the pool (capped so `max_blocks_per_seq * block_size` fits an `i32` sequence length),
    /// prefix caching on, verify on, a random hash key.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        let watermark_blocks = if num_blocks <= 1 {
            0
        } else {
            (num_blocks / 100).max(1)
        };
        let cap = (i32::MAX as u32)
            .checked_div(block_size)
            .unwrap_or(num_blocks);
        Self {
            num_blocks,
            block_size,
            watermark_blocks,
            max_blocks_per_seq: num_blocks.min(cap),
            enable_prefix_caching: true,
            verify_prefix: true,
            hash_seed: None,
            num_host_blocks: 0,
        }
    }

    /// Checks every field; `InvalidConfig` names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: u64, reason: String| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.block_size == 0 {
            return bad("block_size", 0, "must be >= 1".into());
        }
        if self.num_blocks == 0 {
            return bad("num_blocks", 0, "must be >= 1".into());
        }
        if self.num_host_blocks > i32::MAX as u32 {
            return bad(
                "num_host_blocks",
                self.num_host_blocks as u64,
                format!(
                    "must be <= {} (block ids are written as int64 pairs of int32 ids)",
                    i32::MAX
                ),
            );
        }
        if self.num_blocks > i32::MAX as u32 {
            return bad(
                "num_blocks",
                self.num_blocks as u64,
                format!("must be <= {} (block ids are written as int32)", i32::MAX),
            );
        }
        if (self.num_blocks as u64) * (self.block_size as u64) > i64::MAX as u64 {
            return bad(
                "block_size",
                self.block_size as u64,
                "num_blocks * block_size must fit int64 slot ids".into(),
            );
        }
        if self.watermark_blocks >= self.num_blocks {
            return bad(
                "watermark_blocks",
                self.watermark_blocks as u64,
                format!("must be < num_blocks ({})", self.num_blocks),
            );
        }
        if self.max_blocks_per_seq == 0 {
            return bad("max_blocks_per_seq", 0, "must be >= 1".into());
        }
        if (self.max_blocks_per_seq as u64) * (self.block_size as u64) > i32::MAX as u64 {
            return bad(
                "max_blocks_per_seq",
                self.max_blocks_per_seq as u64,
                format!(
                    "max_blocks_per_seq * block_size must fit an int32 sequence length (block_size {})",
                    self.block_size
                ),
            );
        }
        Ok(())
    }
}

/// Outcome of an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitResult {
    /// Prompt tokens whose KV is already cached (a multiple of B, at most `len - 1`): the engine
    /// computes tokens `[cached_tokens, len)`.
    pub cached_tokens: u32,
    /// Blocks allocated for this admission (not shared from the cache).
    pub new_blocks: u32,
    /// Blocks in the sequence's table, `ceil(num_tokens / B)`.
    pub num_blocks: u32,
    /// Tokens the sequence holds after admission: `cached_tokens + min(max_new_tokens, len -
    /// cached_tokens)`, the whole prompt when no `max_new_tokens` was given. The engine computes
    /// `[cached_tokens, num_tokens)` in the first step and appends the rest of the prompt later.
    pub num_tokens: u32,
}

/// One admission of [`BlockManager::admit_batch`].
#[derive(Debug, Clone, Copy)]
pub struct AdmitRequest<'a> {
    /// A new sequence id.
    pub seq: SeqId,
    /// The whole prompt (the prefix-cache lookup covers all of it).
    pub tokens: &'a [TokenId],
    /// Hashing keys (salt, adapter, multimodal inputs, extra bytes); `None` for none.
    pub keys: Option<&'a SeqKeys>,
    /// Hold at most this many tokens past the cached prefix (chunked prefill); `None`: all.
    pub max_new_tokens: Option<usize>,
}

impl<'a> AdmitRequest<'a> {
    /// A request holding the whole prompt, with no keys.
    pub fn new(seq: SeqId, tokens: &'a [TokenId]) -> Self {
        Self {
            seq,
            tokens,
            keys: None,
            max_new_tokens: None,
        }
    }
}

/// What a prefix-cache lookup found.
#[derive(Debug, Clone, Copy, Default)]
struct Lookup {
    /// `h_{-1}` for the request's salt.
    root: u128,
    /// Leading tokens cached: `hits.len() * B`.
    cached: usize,
    /// Hits on cached-free blocks: each takes a block off the free count when revived.
    revive: usize,
    /// Verify-mode mismatches (served as misses).
    collisions: u64,
}

/// Tokens an admission holds: the cached prefix plus up to `max_new` more (the rest when `None`).
#[inline]
fn held_tokens(len: usize, cached: usize, max_new: Option<usize>) -> usize {
    cached + max_new.map_or(len - cached, |k| k.min(len - cached))
}

fn check_max_new(max_new: Option<usize>) -> Result<()> {
    if max_new == Some(0) {
        return Err(Error::InvalidArgument {
            what: "max_new_tokens",
            value: 0,
            reason: "must be >= 1 (at least one prompt token is computed)".into(),
        });
    }
    Ok(())
}

/// Which queued swap copies a step emits (see `BlockManager::plan_swaps`).
#[derive(Debug)]
struct SwapPlan {
    emit_out: Vec<bool>,
    emit_in: Vec<bool>,
    /// Which pending copy-on-write copies to emit (in queue order).
    emit_cow: Vec<bool>,
}

/// Per-sequence state, kept in a slab so batch calls index it directly after one lookup.
#[derive(Debug, Clone, Default)]
struct Seq {
    table: BlockTable,
    /// Token ids (prefix caching only).
    tokens: Vec<TokenId>,
    /// Chained hashes of the first `hashes.len()` full blocks (prefix caching only).
    hashes: Vec<u128>,
    /// Blocks `[0, registered)` have been offered to the prefix cache.
    registered: usize,
    /// `h_{-1}` for this sequence's salt.
    root: u128,
    /// Keys adding extra records to block hashes; `None` when there are none.
    keys: Option<Arc<SeqKeys>>,
    /// The tail block may be shared (set by fork); cleared once seen unshared.
    tail_maybe_shared: bool,
    /// Epoch of the last batch call that visited this sequence (duplicate detection).
    mark: u64,
    /// Identity of this sequence for the manager's whole life: fresh on admit and fork, never
    /// reused, so a step-cache row mark cannot match a later sequence in the same slot or id.
    uid: u64,
    /// Bumped whenever an existing entry of `table.blocks` is replaced in place (copy-on-write of
    /// the tail, a swap). Growth by push does not bump it: entries already written stay valid.
    version: u64,
    /// Running, swapped out (the table holds host block ids) or preempted by recompute (no blocks).
    state: SeqState,
    /// Admission order (victims are taken from the highest); a forked child inherits its parent's,
    /// and a swap or recompute keeps it.
    order: u64,
    /// Fork group: the uid of the admission the sequence descends from.
    group: u64,
    /// `cache_epoch` when it was swapped out: its hashes are re-registered on swap-in only if the
    /// prefix cache was not reset since.
    swap_epoch: u64,
}

/// The block manager. See the module documentation for the rules it keeps.
#[derive(Debug)]
pub struct BlockManager {
    cfg: ManagerConfig,
    bs: usize,
    caching: bool,
    pool: BlockPool,
    prefix: PrefixCache,
    index: FastMap<SeqId, u32>,
    slots: Vec<Seq>,
    free_slots: Vec<u32>,
    /// Copy-on-write copies not yet emitted by a step.
    pending: Vec<(BlockId, BlockId)>,
    /// Refcount-0 blocks held back because they are the `src` of a pending copy.
    deferred: Vec<BlockId>,
    counters: Counters,
    shared_blocks: u64,
    used_tokens: u64,
    epoch: u64,
    /// The prefix-hash key in use (`cfg.hash_seed` or one drawn from the OS).
    hash_key: u64,
    empty_root: u128,
    hasher: Hasher,
    /// Bumped whenever the set of sequences changes (admit, fork, free).
    gen: u64,
    /// The last batch resolved by `resolve_batch`, its slots, and the `gen` it is valid for.
    batch_ids: Vec<SeqId>,
    batch_idx: Vec<u32>,
    batch_gen: u64,
    scratch_hashes: Vec<u128>,
    scratch_hits: Vec<BlockId>,
    /// Last uid handed out (uids start at 1; 0 marks a row as unknown).
    last_uid: u64,
    /// What `build_step` last wrote into the block-table buffer it last wrote.
    step_cache: StepCache,
    /// Slots of the step's batch with full blocks not yet offered to the prefix cache.
    scratch_register: Vec<u32>,
    /// The host block pool.
    host: HostPool,
    /// Swap-out copies `(device, host)` not yet emitted by a step.
    swap_out_q: Vec<(BlockId, HostBlockId)>,
    /// Swap-in copies `(host, device)` not yet emitted by a step; each holds a host reference.
    swap_in_q: Vec<(HostBlockId, BlockId)>,
    /// Last admission order handed out.
    last_order: u64,
    /// Bumped by `reset_prefix_cache`.
    cache_epoch: u64,
}

impl BlockManager {
    /// A manager over a fresh pool; `InvalidConfig` if `cfg` does not validate,
    /// `AllocationFailed` (naming the array and its bytes) if the host cannot hold the pool's or
    /// the prefix cache's arrays.
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        let hash_key = match cfg.hash_seed {
            Some(k) => k,
            None => random_key()?,
        };
        // The prefix cache first: its arrays are the largest, and mostly committed lazily, so a
        // pool too large for the host fails before the pool's arrays are written.
        let prefix = PrefixCache::try_new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching && cfg.verify_prefix,
            cfg.enable_prefix_caching,
        )?;
        let pool = BlockPool::new(cfg.num_blocks)?;
        let host = HostPool::new(cfg.num_host_blocks)?;
        Ok(Self {
            bs: cfg.block_size as usize,
            caching: cfg.enable_prefix_caching,
            pool,
            prefix,
            index: FastMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            pending: Vec::new(),
            deferred: Vec::new(),
            counters: Counters::default(),
            shared_blocks: 0,
            used_tokens: 0,
            epoch: 0,
            hash_key,
            empty_root: root_hash(hash_key, &[]),
            hasher: Hasher::new(hash_key),
            gen: 0,
            batch_ids: Vec::new(),
            batch_idx: Vec::new(),
            batch_gen: u64::MAX,
            scratch_hashes: Vec::new(),
            scratch_hits: Vec::new(),
            last_uid: 0,
            step_cache: StepCache::default(),
            scratch_register: Vec::new(),
            host,
            swap_out_q: Vec::new(),
            swap_in_q: Vec::new(),
            last_order: 0,
            cache_epoch: 0,
            cfg,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// Whether an `num_tokens`-token prompt could be admitted now, ignoring possible prefix hits
    /// (the whole prompt held at once; see [`BlockManager::can_admit_len`] for chunked admission).
    pub fn can_admit(&self, num_tokens: usize) -> bool {
        self.can_admit_len(num_tokens, None).unwrap_or(false)
    }

    /// Whether a prompt of `num_tokens` tokens, admitted holding `min(max_new_tokens, num_tokens)`
    /// of them (all when `None`), fits now if none of it is cached. False for an empty prompt or
    /// one longer than a block-table row; `InvalidArgument` for `max_new_tokens == 0`.
    ///
    /// For a whole prompt (`None`) a `true` is a promise: hits only make an admission cheaper.
    /// For a chunk it is not: a chunked admission holds its cached prefix *plus* the chunk, and a
    /// hit on a cached-free block takes a block off the free count. Pass the token ids to
    /// [`BlockManager::can_admit_tokens`] for the exact answer.
    pub fn can_admit_len(&self, num_tokens: usize, max_new_tokens: Option<usize>) -> Result<bool> {
        check_max_new(max_new_tokens)?;
        if num_tokens == 0 || blocks_for(num_tokens, self.bs) > self.cfg.max_blocks_per_seq as usize
        {
            return Ok(false);
        }
        let held = max_new_tokens.map_or(num_tokens, |k| k.min(num_tokens));
        Ok(self.fits(blocks_for(held, self.bs)))
    }

    /// Whether `admit_opts(_, tokens, keys, max_new_tokens)` would succeed now (for a new id),
    /// counting prefix-cache hits: a prompt whose leading blocks are cached needs blocks only for
    /// the rest, and a hit on a cached-free block still takes one block off the free count. False
    /// for an empty prompt or one longer than a block-table row; `InvalidArgument` for malformed
    /// keys or `max_new_tokens == 0`. Read-only: nothing is hashed into the manager's state.
    pub fn can_admit_tokens(
        &self,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<bool> {
        check_max_new(max_new_tokens)?;
        let n = tokens.len();
        if let Some(k) = keys {
            k.validate(n)?;
        }
        if n == 0 || blocks_for(n, self.bs) > self.cfg.max_blocks_per_seq as usize {
            return Ok(false);
        }
        let (mut hashes, mut hits) = (Vec::new(), Vec::new());
        let look = self.lookup(
            &mut Hasher::new(self.hash_key),
            tokens,
            keys,
            &mut hashes,
            &mut hits,
        );
        let held = held_tokens(n, look.cached, max_new_tokens);
        let needed = blocks_for(held, self.bs) - hits.len() + look.revive;
        Ok(self.fits(needed))
    }

    /// Whether `needed` blocks can be taken by an admission without dipping into the watermark.
    #[inline]
    fn fits(&self, needed: usize) -> bool {
        needed.saturating_add(self.cfg.watermark_blocks as usize) <= self.num_free_blocks()
    }

    /// Admits a sequence with no hashing keys (empty salt), holding the whole prompt.
    pub fn admit(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<AdmitResult> {
        self.admit_opts(seq, tokens, None, None)
    }

    /// Admits a sequence whose block hashes include `keys`, holding the whole prompt.
    pub fn admit_with(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: &SeqKeys,
    ) -> Result<AdmitResult> {
        self.admit_opts(seq, tokens, Some(keys), None)
    }

    /// Admits a sequence, possibly holding only the first chunk of its prompt (chunked prefill).
    ///
    /// The prefix-cache lookup covers all of `tokens`: the leading run of cached full blocks is
    /// shared, capped at `(len - 1) / B` blocks so at least one prompt token is computed. The
    /// sequence then holds `cached + min(max_new_tokens, len - cached)` tokens (all of them when
    /// `None`); the caller feeds the rest later with [`BlockManager::append`], chunk by chunk.
    /// Blocks are allocated for the held tokens only, and the watermark applies to those.
    /// `SequenceTooLong` is judged on the whole prompt, which the sequence will eventually hold.
    pub fn admit_opts(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<AdmitResult> {
        self.check_admit(seq, tokens, keys, max_new_tokens)?;
        self.admit_checked(seq, tokens, keys, max_new_tokens)
    }

    /// Admits several sequences in order, with one call.
    ///
    /// Validates every request first — non-empty prompts, valid keys and `max_new_tokens`, each
    /// prompt within a block-table row, ids new and distinct — and on any failure returns the
    /// error with nothing admitted. Then admits in order until one request does not fit (out of
    /// blocks, or it would dip into the watermark) and returns the results of those admitted: a
    /// prefix of `reqs`, possibly empty. A request in the batch cannot hit blocks of an earlier
    /// one: blocks enter the prefix cache when a step is built.
    pub fn admit_batch(&mut self, reqs: &[AdmitRequest<'_>]) -> Result<Vec<AdmitResult>> {
        let mut seen: std::collections::HashSet<SeqId, crate::prefix::FastBuild> =
            std::collections::HashSet::with_capacity_and_hasher(reqs.len(), Default::default());
        for r in reqs {
            self.check_admit(r.seq, r.tokens, r.keys, r.max_new_tokens)?;
            if !seen.insert(r.seq) {
                return Err(Error::DuplicateSequence { seq_id: r.seq });
            }
        }
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            match self.admit_checked(r.seq, r.tokens, r.keys, r.max_new_tokens) {
                Ok(a) => out.push(a),
                Err(Error::OutOfBlocks { .. } | Error::WatermarkReached { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Checks of an admission that do not depend on free blocks (the id included).
    fn check_admit(
        &self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: 0,
                reason: "a prompt needs at least one token".into(),
            });
        }
        if self.index.contains_key(&seq) {
            return Err(Error::DuplicateSequence { seq_id: seq });
        }
        check_max_new(max_new_tokens)?;
        if let Some(k) = keys {
            k.validate(n)?;
        }
        let nb = blocks_for(n, self.bs);
        if nb > self.cfg.max_blocks_per_seq as usize {
            return Err(Error::SequenceTooLong {
                seq_id: seq,
                needed_blocks: nb,
                max_blocks_per_seq: self.cfg.max_blocks_per_seq as usize,
            });
        }
        Ok(())
    }

    /// The prefix-cache lookup of an admission: fills `hits` with the leading run of cached
    /// blocks (at most `(len - 1) / B`) and `hashes` with at least their chain. The chain is
    /// computed in groups, stopping after the group of the first miss: blocks past it are hashed
    /// when a step registers them, so a cold prompt is not hashed twice.
    fn lookup(
        &self,
        hasher: &mut Hasher,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        hashes: &mut Vec<u128>,
        hits: &mut Vec<BlockId>,
    ) -> Lookup {
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        self.lookup_root(hasher, tokens, root, extra, hashes, hits)
    }

    /// `h_{-1}` for the keys' salt.
    #[inline]
    fn root_for(&self, keys: Option<&SeqKeys>) -> u128 {
        match keys {
            Some(k) if self.caching && !k.cache_salt.is_empty() => {
                root_hash(self.hash_key, &k.cache_salt)
            }
            _ => self.empty_root,
        }
    }

    /// [`Self::lookup`] with the chain root and the block-extra keys already known.
    fn lookup_root(
        &self,
        hasher: &mut Hasher,
        tokens: &[TokenId],
        root: u128,
        extra: Option<&SeqKeys>,
        hashes: &mut Vec<u128>,
        hits: &mut Vec<BlockId>,
    ) -> Lookup {
        const GROUP: usize = 16;
        let bs = self.bs;
        let mut look = Lookup {
            root,
            ..Lookup::default()
        };
        hashes.clear();
        hits.clear();
        if !self.caching {
            return look;
        }
        let max_hit = (tokens.len() - 1) / bs;
        for i in 0..max_hit {
            if i == hashes.len() {
                let upto = (i + GROUP).min(max_hit);
                hasher.extend_chain(look.root, &tokens[..upto * bs], bs, extra, hashes);
            }
            let Some(b) = self.prefix.lookup(hashes[i]) else {
                break;
            };
            if !self.prefix.matches(b, &tokens[i * bs..(i + 1) * bs]) {
                look.collisions += 1;
                break;
            }
            if self.prefix.in_lru(b) {
                look.revive += 1;
            }
            hits.push(b);
        }
        look.cached = hits.len() * bs;
        look
    }

    /// Admission after `check_admit` and the duplicate check: lookup, fit, apply.
    fn admit_checked(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        keys: Option<&SeqKeys>,
        max_new_tokens: Option<usize>,
    ) -> Result<AdmitResult> {
        let root = self.root_for(keys);
        let extra = keys.filter(|k| k.has_block_extras());
        self.admit_core(
            seq,
            tokens,
            tokens.len(),
            root,
            extra,
            None,
            max_new_tokens,
            None,
        )
    }

    /// Lookup, fit and apply of an admission. `n` is the prompt's length (`tokens` holds its ids,
    /// or nothing when prefix caching is off and this is a resume). `shared` is the sequence's own
    /// keys on a resume (reused instead of cloning `extra`), and `resume` its slot: then its
    /// admission order, fork group and slot are kept.
    #[allow(clippy::too_many_arguments)]
    fn admit_core(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        n: usize,
        root: u128,
        extra: Option<&SeqKeys>,
        shared: Option<Arc<SeqKeys>>,
        max_new_tokens: Option<usize>,
        resume: Option<usize>,
    ) -> Result<AdmitResult> {
        let bs = self.bs;
        let mut hits = std::mem::take(&mut self.scratch_hits);
        let mut hashes = std::mem::take(&mut self.scratch_hashes);
        let mut hasher = std::mem::take(&mut self.hasher);
        let look = self.lookup_root(&mut hasher, tokens, root, extra, &mut hashes, &mut hits);
        self.hasher = hasher;
        let held = held_tokens(n, look.cached, max_new_tokens);
        let nb = blocks_for(held, bs);
        let new = nb - hits.len();
        let needed = new + look.revive;
        let avail = self.num_free_blocks();
        let wm = self.cfg.watermark_blocks as usize;
        let err = if needed > avail {
            Some(Error::OutOfBlocks {
                needed,
                available: avail,
            })
        } else if avail - needed < wm {
            Some(Error::WatermarkReached {
                needed,
                available: avail.saturating_sub(wm),
                watermark: wm,
            })
        } else {
            None
        };
        if let Some(e) = err {
            self.scratch_hits = hits;
            self.scratch_hashes = hashes;
            return Err(e);
        }

        // Validated: apply.
        let slot = match resume {
            Some(i) => i as u32,
            None => self.take_slot(),
        };
        self.last_uid += 1;
        let uid = self.last_uid;
        let (order, group) = match resume {
            Some(i) => (self.slots[i].order, self.slots[i].group),
            None => {
                self.last_order += 1;
                (self.last_order, uid)
            }
        };
        let s = &mut self.slots[slot as usize];
        s.table.clear();
        for &b in &hits {
            if self.prefix.in_lru(b) {
                self.prefix.lru_remove(b);
                self.pool.incref_mut(b)?;
            } else if self.pool.incref_mut(b)? == 2 {
                self.shared_blocks += 1;
            }
            s.table.blocks.push(b);
        }
        let from_pool = new.min(self.pool.num_free());
        self.pool.allocate_n_mut(from_pool, &mut s.table.blocks)?;
        for _ in from_pool..new {
            let b = evict(&mut self.prefix, &mut self.pool, &mut self.counters)?;
            s.table.blocks.push(b);
        }
        s.table.num_tokens = held;
        s.tokens.clear();
        s.hashes.clear();
        if self.caching {
            s.tokens.extend_from_slice(&tokens[..held]);
            // Only hashes of blocks the sequence holds in full; the step extends the chain.
            hashes.truncate(held / bs);
            std::mem::swap(&mut s.hashes, &mut hashes);
        }
        s.registered = hits.len();
        s.root = look.root;
        s.keys = match shared {
            Some(k) => Some(k),
            None => extra.map(|k| Arc::new(k.clone())),
        };
        s.tail_maybe_shared = false;
        s.uid = uid;
        s.version = 0;
        s.state = SeqState::Running;
        s.order = order;
        s.group = group;
        self.index.insert(seq, slot);
        self.gen += 1;
        self.used_tokens += held as u64;
        if self.caching {
            self.counters.prefix_query_tokens += n as u64;
            self.counters.prefix_hit_tokens += look.cached as u64;
            self.counters.prefix_collisions += look.collisions;
        }
        self.scratch_hits = hits;
        self.scratch_hashes = hashes;
        Ok(AdmitResult {
            cached_tokens: look.cached as u32,
            new_blocks: new as u32,
            num_blocks: nb as u32,
            num_tokens: held as u32,
        })
    }

    /// Frees several sequences with one call. Validates first — every id live, none twice — and
    /// on failure returns the error with nothing freed; then frees each in order, as
    /// [`BlockManager::free`] does.
    pub fn free_batch(&mut self, seqs: &[SeqId]) -> Result<()> {
        // Known ids, none twice; any state (a swapped-out or recompute-preempted sequence is
        // freed too, so not through `resolve_batch`, which wants running sequences).
        self.epoch += 1;
        let epoch = self.epoch;
        for &id in seqs {
            let i = self.slot_of(id)?;
            let s = &mut self.slots[i];
            if s.mark == epoch {
                return Err(Error::InvalidArgument {
                    what: "seqs",
                    value: id as i64,
                    reason: "sequence id appears twice in one batch".into(),
                });
            }
            s.mark = epoch;
        }
        let mut result = Ok(());
        for &id in seqs {
            if let Err(e) = self.free(id) {
                result = Err(e);
            }
        }
        result
    }

    /// Forgets every prefix-cache entry: cached-free blocks go back to the free list and blocks
    /// still held by sequences lose their hash (they stay in their tables, and are not offered
    /// to the cache again). Later admissions hit nothing until new steps register blocks. Returns
    /// the number of blocks dropped from the cache (hashed blocks, cached-free or held).
    ///
    /// Use it when cached KV is no longer valid (new weights, a changed model config).
    pub fn reset_prefix_cache(&mut self) -> Result<usize> {
        // Swapped-out sequences do not re-register their blocks on swap-in after a reset.
        self.cache_epoch += 1;
        let dropped = self.prefix.num_hashed();
        let mut result = Ok(dropped);
        while let Some(b) = self.prefix.evict_oldest() {
            // Refcount 0 (a cached-free block): released to the free list.
            if let Err(e) = self.pool.release_mut(b) {
                result = Err(e);
            }
        }
        // Blocks still held lose their hash too; stale map entries go with them.
        self.prefix.clear_hashes();
        result
    }

    fn take_slot(&mut self) -> u32 {
        match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Seq::default());
                (self.slots.len() - 1) as u32
            }
        }
    }

    #[inline]
    fn slot_of(&self, seq: SeqId) -> Result<usize> {
        self.index
            .get(&seq)
            .map(|&s| s as usize)
            .ok_or(Error::UnknownSequence { seq_id: seq })
    }

    /// Whether the tail block of `s` is shared and about to be written (so must be copied first).
    #[inline]
    fn needs_cow(pool: &BlockPool, s: &Seq, bs: usize) -> Result<bool> {
        if !s.tail_maybe_shared || s.table.num_tokens == s.table.blocks.len() * bs {
            return Ok(false);
        }
        let tail = *s.table.blocks.last().expect("a partial tail block exists");
        Ok(pool.refcount(tail)? > 1)
    }

    /// Appends tokens to a sequence. Allocates only when a block boundary is crossed (and for a
    /// copy-on-write of a shared tail); may use the watermark reserve. All-or-nothing.
    pub fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: 0,
                reason: "nothing to append".into(),
            });
        }
        let slot = self.slot_of(seq)?;
        let bs = self.bs;
        let s = &self.slots[slot];
        if s.state != SeqState::Running {
            return Err(not_running(seq, s.state));
        }
        let len = s.table.num_tokens;
        let nb = blocks_for(len + tokens.len(), bs);
        if nb > self.cfg.max_blocks_per_seq as usize {
            return Err(Error::SequenceTooLong {
                seq_id: seq,
                needed_blocks: nb,
                max_blocks_per_seq: self.cfg.max_blocks_per_seq as usize,
            });
        }
        let grow = nb - s.table.blocks.len();
        let cow = Self::needs_cow(&self.pool, s, bs)?;
        let needed = grow + cow as usize;
        let avail = self.num_free_blocks();
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        if cow {
            self.cow_tail(slot)?;
        }
        // The old tail is ours alone now (copied or unshared) and new blocks are fresh.
        self.slots[slot].tail_maybe_shared = false;
        for _ in 0..grow {
            let b = self.alloc_block()?;
            self.slots[slot].table.blocks.push(b);
        }
        let s = &mut self.slots[slot];
        s.table.num_tokens += tokens.len();
        if self.caching {
            s.tokens.extend_from_slice(tokens);
        }
        self.used_tokens += tokens.len() as u64;
        Ok(())
    }

    /// Appends one token to each sequence (a decode step). Validates everything first — equal
    /// lengths, known ids, no id twice, enough blocks for the whole batch — then applies.
    pub fn append_batch(&mut self, seqs: &[SeqId], tokens: &[TokenId]) -> Result<()> {
        if seqs.len() != tokens.len() {
            return Err(Error::InvalidArgument {
                what: "tokens.len",
                value: tokens.len() as i64,
                reason: format!("must equal seqs.len() ({})", seqs.len()),
            });
        }
        self.resolve_batch(seqs)?;
        let needed = self.append_needs(seqs)?;
        let avail = self.num_free_blocks();
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        let idx = std::mem::take(&mut self.batch_idx);
        let bs = self.bs;
        let mut result = Ok(());
        for (k, &i) in idx.iter().enumerate() {
            let i = i as usize;
            let s = &self.slots[i];
            // Full tail (no division on the per-token path): a new block is needed.
            if s.table.num_tokens == s.table.blocks.len() * bs {
                match self.alloc_block() {
                    Ok(b) => self.slots[i].table.blocks.push(b),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                self.slots[i].tail_maybe_shared = false;
            } else if s.tail_maybe_shared {
                match Self::needs_cow(&self.pool, s, bs) {
                    Ok(true) => {
                        if let Err(e) = self.cow_tail(i) {
                            result = Err(e);
                            break;
                        }
                    }
                    Ok(false) => self.slots[i].tail_maybe_shared = false,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            let s = &mut self.slots[i];
            s.table.num_tokens += 1;
            if self.caching {
                s.tokens.push(tokens[k]);
            }
        }
        self.used_tokens += seqs.len() as u64;
        self.batch_idx = idx;
        result
    }

    /// Resolves `seqs` to slots in `self.batch_idx` (one lookup each), rejecting unknown and
    /// repeated ids. A decode loop passes the same batch step after step: when `seqs` equals the
    /// last resolved batch and no sequence was admitted, forked or freed since, the previous
    /// resolution is reused without any lookup.
    fn resolve_batch(&mut self, seqs: &[SeqId]) -> Result<()> {
        if self.batch_gen == self.gen && self.batch_ids.as_slice() == seqs {
            return Ok(());
        }
        self.batch_gen = u64::MAX;
        self.batch_idx.clear();
        self.epoch += 1;
        let epoch = self.epoch;
        for &id in seqs {
            let Some(&i) = self.index.get(&id) else {
                return Err(Error::UnknownSequence { seq_id: id });
            };
            let s = &mut self.slots[i as usize];
            if s.mark == epoch {
                return Err(Error::InvalidArgument {
                    what: "seqs",
                    value: id as i64,
                    reason: "sequence id appears twice in one batch".into(),
                });
            }
            if s.state != SeqState::Running {
                return Err(not_running(id, s.state));
            }
            s.mark = epoch;
            self.batch_idx.push(i);
        }
        self.batch_ids.clear();
        self.batch_ids.extend_from_slice(seqs);
        self.batch_gen = self.gen;
        Ok(())
    }

    /// For the resolved batch: checks that one more token fits each row and returns the blocks
    /// the batch may need (an upper bound: one copy-on-write can make another's unnecessary).
    fn append_needs(&self, seqs: &[SeqId]) -> Result<usize> {
        let bs = self.bs;
        let max = self.cfg.max_blocks_per_seq as usize;
        let mut needed = 0usize;
        for (k, &i) in self.batch_idx.iter().enumerate() {
            let s = &self.slots[i as usize];
            let nb = s.table.blocks.len();
            if s.table.num_tokens == nb * bs {
                if nb + 1 > max {
                    return Err(Error::SequenceTooLong {
                        seq_id: seqs[k],
                        needed_blocks: nb + 1,
                        max_blocks_per_seq: max,
                    });
                }
                needed += 1;
            } else if Self::needs_cow(&self.pool, s, bs)? {
                needed += 1;
            }
        }
        Ok(needed)
    }

    /// Allocates one block: the free list first, then the oldest cached-free block.
    #[inline]
    fn alloc_block(&mut self) -> Result<BlockId> {
        match self.pool.allocate_mut() {
            Ok(b) => Ok(b),
            Err(_) => evict(&mut self.prefix, &mut self.pool, &mut self.counters),
        }
    }

    /// Replaces the shared tail block of `slot` with a fresh copy and queues the copy.
    fn cow_tail(&mut self, slot: usize) -> Result<()> {
        let d = self.alloc_block()?;
        let s = &mut self.slots[slot];
        let last = s.table.blocks.len() - 1;
        let src = std::mem::replace(&mut s.table.blocks[last], d);
        // An entry changed in place: block-table rows written before now are stale.
        s.version += 1;
        s.tail_maybe_shared = false;
        // A src that is itself waiting to be filled by a pending copy has the same content as that
        // copy's src when the copies run (before any write of the step): copy from there instead,
        // so no block is both a dst and a src in one step.
        let origin = self
            .pending
            .iter()
            .find(|&&(_, dst)| dst == src)
            .map_or(src, |&(s0, _)| s0);
        self.pending.push((origin, d));
        self.counters.cow_copies += 1;
        self.drop_ref(src)
    }

    /// Drops one reference to `b`, parking it (free list, LRU or deferred) when none remain.
    #[inline]
    fn drop_ref(&mut self, b: BlockId) -> Result<()> {
        if self.pending.is_empty() && self.swap_in_q.is_empty() && self.prefix.hash_of(b).is_none()
        {
            // Not cached and no copy in flight: the pool decrements and releases in one step
            // (one pool update per block on the free path instead of two).
            if !self.pool.free_mut(b)? && self.pool.refcount(b)? == 1 {
                self.shared_blocks -= 1;
            }
            return Ok(());
        }
        match self.pool.decref_mut(b)? {
            0 => self.unreferenced(b),
            1 => {
                self.shared_blocks -= 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn unreferenced(&mut self, b: BlockId) -> Result<()> {
        if !self.pending.is_empty() {
            if let Some(pos) = self.pending.iter().position(|&(_, d)| d == b) {
                // Nobody will read this dst: the copy is moot. Its src may have been held only for it.
                let (src, _) = self.pending.remove(pos);
                if !self.pending.iter().any(|&(s, _)| s == src) {
                    if let Some(dpos) = self.deferred.iter().position(|&x| x == src) {
                        self.deferred.swap_remove(dpos);
                        self.park(src)?;
                    }
                }
            }
            if self.pending.iter().any(|&(s, _)| s == b) {
                self.deferred.push(b);
                return Ok(());
            }
        }
        self.park(b)
    }

    /// Puts a refcount-0 block where it belongs: the LRU if hashed, else the free list.
    #[inline]
    fn park(&mut self, b: BlockId) -> Result<()> {
        if !self.swap_in_q.is_empty() {
            if let Some(pos) = self.swap_in_q.iter().position(|&(_, d)| d == b) {
                // Nobody will read this swap-in destination (no holder, no pending copy from it):
                // the copy is moot, and its host block loses the reference the queued copy held.
                // The block never received its content, so it must not stay findable under the
                // hash `swap_in` gave it.
                let (h, _) = self.swap_in_q.remove(pos);
                self.prefix.unregister(b);
                self.host_drop(h)?;
            }
        }
        if self.prefix.hash_of(b).is_some() {
            self.prefix.lru_push(b);
            Ok(())
        } else {
            self.pool.release_mut(b)
        }
    }

    /// Starts `child` as a copy of `parent` sharing all its blocks (parallel sampling, beam
    /// search). No block is allocated; the first write into the shared tail copies it.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        let p = self.slot_of(parent)?;
        if self.slots[p].state != SeqState::Running {
            return Err(not_running(parent, self.slots[p].state));
        }
        if self.index.contains_key(&child) {
            return Err(Error::DuplicateSequence { seq_id: child });
        }
        for &b in &self.slots[p].table.blocks {
            if self.pool.refcount(b)? >= crate::pool::MAX_REFCOUNT {
                return Err(Error::InvalidArgument {
                    what: "parent",
                    value: parent as i64,
                    reason: format!("block {b} is at the maximum reference count"),
                });
            }
        }
        let c = self.take_slot() as usize;
        let mut child_state = std::mem::take(&mut self.slots[c]);
        let ps = &self.slots[p];
        child_state.table.blocks.clone_from(&ps.table.blocks);
        child_state.table.num_tokens = ps.table.num_tokens;
        child_state.tokens.clone_from(&ps.tokens);
        child_state.hashes.clone_from(&ps.hashes);
        child_state.registered = ps.registered;
        child_state.root = ps.root;
        child_state.keys = ps.keys.clone();
        let partial = ps.table.num_tokens % self.bs != 0;
        child_state.tail_maybe_shared = partial;
        self.last_uid += 1;
        child_state.uid = self.last_uid;
        child_state.version = 0;
        child_state.state = SeqState::Running;
        child_state.order = ps.order;
        child_state.group = ps.group;
        for &b in &child_state.table.blocks {
            if self.pool.incref_mut(b)? == 2 {
                self.shared_blocks += 1;
            }
        }
        self.used_tokens += child_state.table.num_tokens as u64;
        self.slots[c] = child_state;
        self.slots[p].tail_maybe_shared |= partial;
        self.index.insert(child, c as u32);
        self.gen += 1;
        Ok(())
    }

    /// Frees a sequence: drops its references, tail block first, so that cached blocks enter the
    /// LRU tail-first and the prefix outlives the tail.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let slot = self
            .index
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq_id: seq })? as usize;
        self.gen += 1;
        let result = self.release_table(slot);
        let s = &mut self.slots[slot];
        s.table.num_tokens = 0;
        s.state = SeqState::Running;
        s.keys = None;
        self.free_slots.push(slot as u32);
        result
    }

    // ------------------------------------------------------------------------------ reclamation

    /// Resolves `seqs` (known, distinct, each in `want`) to slots, in order.
    fn resolve_in_state(
        &mut self,
        seqs: &[SeqId],
        want: SeqState,
        expected: &'static str,
    ) -> Result<Vec<usize>> {
        if seqs.is_empty() {
            return Err(Error::InvalidArgument {
                what: "seqs.len",
                value: 0,
                reason: "needs at least one sequence".into(),
            });
        }
        self.epoch += 1;
        let epoch = self.epoch;
        let mut out = Vec::with_capacity(seqs.len());
        for &id in seqs {
            let i = self.slot_of(id)?;
            let s = &mut self.slots[i];
            if s.mark == epoch {
                return Err(Error::InvalidArgument {
                    what: "seqs",
                    value: id as i64,
                    reason: "sequence id appears twice in one batch".into(),
                });
            }
            if s.state != want {
                return Err(Error::InvalidSequenceState {
                    seq_id: id,
                    state: s.state.name(),
                    expected,
                });
            }
            s.mark = epoch;
            out.push(i);
        }
        Ok(out)
    }

    /// Where the current content of device block `b` will be when the queued copies run: the host
    /// block of a queued swap-in filling `b` (directly, or through the copy-on-write that fills
    /// it), else the device block to read (`b`, or the source of the copy-on-write filling it).
    fn content_origin(&self, b: BlockId) -> std::result::Result<HostBlockId, BlockId> {
        let src = if self.pending.is_empty() {
            b
        } else {
            self.pending
                .iter()
                .find(|&&(_, d)| d == b)
                .map_or(b, |&(s0, _)| s0)
        };
        match self.swap_in_q.iter().find(|&&(_, d)| d == src) {
            Some(&(h, _)) => Ok(h),
            None => Err(src),
        }
    }

    /// Moves running sequences to the host pool and frees their device blocks; returns the
    /// device → host copies to make, `(device_block, host_block)`.
    ///
    /// A block shared by several of `seqs` (a forked group) is copied once, to one host block they
    /// all hold. A block shared with a sequence not in `seqs` is copied too and stays on the
    /// device for its other holders. Device blocks that lose their last holder are freed at once
    /// (and may be handed out again before the next step), hashed ones dropped from the prefix
    /// cache first: a swapped-out block is not findable by prefix lookups until it is swapped back
    /// in, when it is registered again (unless its hash was taken meanwhile, or the cache reset).
    ///
    /// The same pairs are queued and emitted by the next `build_step` into `swap_out`; the engine
    /// runs them before anything else of that step (see `step` for the order). A block whose
    /// content is still to arrive by a queued swap-in is not copied: the sequence takes that host
    /// block back. The sequences become `Swapped` (block tables of host ids; not schedulable) and
    /// count as swap preemptions.
    ///
    /// Errors, with nothing changed: `UnknownSequence`; `InvalidSequenceState` for one not
    /// running; `InvalidArgument` for an empty list or a repeated id; `OutOfHostBlocks` when the
    /// host pool lacks the blocks (always with `num_host_blocks == 0`).
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, HostBlockId)>> {
        let slots = self.resolve_in_state(seqs, SeqState::Running, "running")?;
        // Host blocks needed: one per distinct device block whose content is not already on the host.
        let mut seen: FastMap<BlockId, ()> = FastMap::default();
        let mut needed = 0usize;
        for &i in &slots {
            for &b in &self.slots[i].table.blocks {
                if seen.insert(b, ()).is_none() && self.content_origin(b).is_err() {
                    needed += 1;
                }
            }
        }
        if needed > self.host.num_free() {
            return Err(Error::OutOfHostBlocks {
                needed,
                available: self.host.num_free(),
            });
        }
        // Apply. First map every device block to its host block (queueing the copies) for all
        // sequences, while the pending copies the mapping consults are all still there; then drop
        // the device references.
        let mut map: FastMap<BlockId, HostBlockId> = FastMap::default();
        let mut pairs = Vec::with_capacity(needed);
        let mut device_tables = Vec::with_capacity(slots.len());
        for &i in &slots {
            let mut hosts = Vec::with_capacity(self.slots[i].table.blocks.len());
            for j in 0..self.slots[i].table.blocks.len() {
                let b = self.slots[i].table.blocks[j];
                let h = match map.get(&b) {
                    Some(&h) => {
                        self.host.incref(h);
                        h
                    }
                    None => {
                        let h = match self.content_origin(b) {
                            Ok(h0) => {
                                self.host.incref(h0);
                                h0
                            }
                            Err(src) => {
                                let h = self.host.allocate()?;
                                pairs.push((src, h));
                                h
                            }
                        };
                        map.insert(b, h);
                        h
                    }
                };
                hosts.push(h);
            }
            // The table now names host blocks only.
            device_tables.push(std::mem::replace(&mut self.slots[i].table.blocks, hosts));
        }
        let mut result = Ok(());
        for (&i, device) in slots.iter().zip(&device_tables) {
            // Tail first, as `free` does.
            for &b in device.iter().rev() {
                if let Err(e) = self.drop_device_unhashed(b) {
                    result = Err(e);
                }
            }
            let epoch = self.cache_epoch;
            let s = &mut self.slots[i];
            s.state = SeqState::Swapped;
            s.version += 1;
            s.tail_maybe_shared = false;
            s.swap_epoch = epoch;
            self.used_tokens -= s.table.num_tokens as u64;
        }
        self.swap_out_q.extend_from_slice(&pairs);
        self.counters.swapped_out_blocks += pairs.len() as u64;
        self.counters.preemptions_swap += slots.len() as u64;
        self.gen += 1;
        result.map(|_| pairs)
    }

    /// Drops one reference to device block `b` for a swap-out: a block left unreferenced loses
    /// its hash (so it is not findable while its content is on the host) and is freed.
    fn drop_device_unhashed(&mut self, b: BlockId) -> Result<()> {
        match self.pool.decref_mut(b)? {
            0 => {
                self.prefix.unregister(b);
                self.unreferenced(b)
            }
            1 => {
                self.shared_blocks -= 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Drops one reference to host block `h`, releasing it at zero (and forgetting a queued
    /// swap-out into it: nobody will read it).
    fn host_drop(&mut self, h: HostBlockId) -> Result<()> {
        if self.host.decref(h)? == 0 {
            if let Some(pos) = self.swap_out_q.iter().position(|&(_, x)| x == h) {
                self.swap_out_q.remove(pos);
            }
            self.host.release(h);
        }
        Ok(())
    }

    /// Brings swapped-out sequences back to the device; returns the host → device copies to
    /// make, `(host_block, device_block)`.
    ///
    /// Allocates one device block per distinct host block of `seqs` (a block the group shares on
    /// the host is shared on the device again). Like an admission it must leave the watermark
    /// free. The pairs are queued and emitted by the next `build_step` into `swap_in`; each host
    /// block is released once the step that emits its copy has been built. Full blocks are
    /// offered to the prefix cache again under their hashes. The sequences become `Running`,
    /// with their admission order and fork group unchanged.
    ///
    /// Errors, with nothing changed: `UnknownSequence`; `InvalidSequenceState` for one not
    /// swapped out; `InvalidArgument` for an empty list or a repeated id; `OutOfBlocks` or
    /// `WatermarkReached`.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(HostBlockId, BlockId)>> {
        let slots = self.resolve_in_state(seqs, SeqState::Swapped, "swapped")?;
        let mut seen: FastMap<HostBlockId, ()> = FastMap::default();
        for &i in &slots {
            for &h in &self.slots[i].table.blocks {
                seen.insert(h, ());
            }
        }
        let needed = seen.len();
        let avail = self.num_free_blocks();
        let wm = self.cfg.watermark_blocks as usize;
        if needed > avail {
            return Err(Error::OutOfBlocks {
                needed,
                available: avail,
            });
        }
        if avail - needed < wm {
            return Err(Error::WatermarkReached {
                needed,
                available: avail.saturating_sub(wm),
                watermark: wm,
            });
        }
        let mut map: FastMap<HostBlockId, BlockId> = FastMap::default();
        let mut pairs = Vec::with_capacity(needed);
        let bs = self.bs;
        let mut result = Ok(());
        for &i in &slots {
            let hosts = std::mem::take(&mut self.slots[i].table.blocks);
            let mut device = Vec::with_capacity(hosts.len());
            for &h in &hosts {
                let b = match map.get(&h) {
                    Some(&b) => {
                        if self.pool.incref_mut(b)? == 2 {
                            self.shared_blocks += 1;
                        }
                        b
                    }
                    None => {
                        let b = self.alloc_block()?;
                        // The queued copy holds the host block until a step emits it.
                        self.host.incref(h);
                        pairs.push((h, b));
                        map.insert(h, b);
                        b
                    }
                };
                device.push(b);
            }
            for &h in &hosts {
                if let Err(e) = self.host_drop(h) {
                    result = Err(e);
                }
            }
            let epoch = self.cache_epoch;
            let s = &mut self.slots[i];
            s.table.blocks = device;
            if self.caching && s.swap_epoch == epoch {
                let upto = s.registered.min(s.hashes.len());
                for j in 0..upto {
                    self.prefix.register(
                        s.table.blocks[j],
                        s.hashes[j],
                        &s.tokens[j * bs..(j + 1) * bs],
                    );
                }
            }
            s.state = SeqState::Running;
            s.version += 1;
            // Another member of the group may hold the same tail again.
            s.tail_maybe_shared = s.table.num_tokens % bs != 0;
            self.used_tokens += s.table.num_tokens as u64;
        }
        self.swap_in_q.extend_from_slice(&pairs);
        self.counters.swapped_in_blocks += pairs.len() as u64;
        self.gen += 1;
        result.map(|_| pairs)
    }

    /// Drops every reference `slot`'s table holds, last block first — device blocks while it
    /// runs, host blocks while it is swapped out (a recompute-preempted table is empty) — and
    /// empties the table, keeping its allocation; a running sequence's tokens leave
    /// `used_tokens`. Every block is released even when one fails; the last error is returned.
    fn release_table(&mut self, slot: usize) -> Result<()> {
        let blocks = std::mem::take(&mut self.slots[slot].table.blocks);
        let state = self.slots[slot].state;
        let mut result = Ok(());
        for &b in blocks.iter().rev() {
            let r = if state == SeqState::Running {
                self.drop_ref(b)
            } else {
                self.host_drop(b)
            };
            if let Err(e) = r {
                result = Err(e);
            }
        }
        let s = &mut self.slots[slot];
        s.table.blocks = blocks;
        s.table.blocks.clear();
        if state == SeqState::Running {
            self.used_tokens -= s.table.num_tokens as u64;
        }
        result
    }

    /// Preempts a sequence by recompute: frees its blocks (hashed full blocks stay cached-free,
    /// so a later [`BlockManager::resume`] can hit them) but keeps its length and, with prefix
    /// caching on, its token ids. A swapped-out sequence may be dropped to this state too (its
    /// host blocks are freed; counted as a swap preemption already, not again). Errors
    /// (`UnknownSequence`, `InvalidSequenceState` when already preempted by recompute) change
    /// nothing.
    pub fn recompute(&mut self, seq: SeqId) -> Result<()> {
        let i = self.slot_of(seq)?;
        let state = self.slots[i].state;
        if state == SeqState::Recompute {
            return Err(Error::InvalidSequenceState {
                seq_id: seq,
                state: state.name(),
                expected: "running or swapped",
            });
        }
        let result = self.release_table(i);
        if state == SeqState::Running {
            self.counters.preemptions_recompute += 1;
        }
        let s = &mut self.slots[i];
        s.state = SeqState::Recompute;
        s.version += 1;
        s.tail_maybe_shared = false;
        self.gen += 1;
        result
    }

    /// Re-admits a sequence preempted by recompute from its kept tokens, as
    /// [`BlockManager::admit_opts`] would with the same prompt and keys: the prefix-cache lookup
    /// covers all kept tokens, and the sequence holds `cached + min(max_new_tokens, len - cached)`
    /// of them (the rest is appended later, chunk by chunk). Keeps its id, admission order and fork
    /// group. Errors change nothing: `UnknownSequence`, `InvalidSequenceState` (not preempted by
    /// recompute), `InvalidArgument` (`max_new_tokens == 0`), `OutOfBlocks`, `WatermarkReached`.
    pub fn resume(&mut self, seq: SeqId, max_new_tokens: Option<usize>) -> Result<AdmitResult> {
        let i = self.slot_of(seq)?;
        let s = &self.slots[i];
        if s.state != SeqState::Recompute {
            return Err(Error::InvalidSequenceState {
                seq_id: seq,
                state: s.state.name(),
                expected: "preempted by recompute",
            });
        }
        check_max_new(max_new_tokens)?;
        let n = s.table.num_tokens;
        let root = s.root;
        let keys = s.keys.clone();
        let tokens = std::mem::take(&mut self.slots[i].tokens);
        let r = self.admit_core(
            seq,
            &tokens,
            n,
            root,
            keys.as_deref(),
            keys.clone(),
            max_new_tokens,
            Some(i),
        );
        if r.is_err() {
            // Nothing was applied: the sequence keeps its tokens and state.
            self.slots[i].tokens = tokens;
        }
        r
    }

    /// The next victim: the running sequences of the most recently admitted fork group (a
    /// forked child counts as admitted with its parent; swap and recompute keep the order), in
    /// creation order. `None` when nothing runs. O(sequences).
    pub fn choose_victim(&self) -> Option<Vec<SeqId>> {
        let mut best: Option<(u64, u64)> = None;
        for &i in self.index.values() {
            let s = &self.slots[i as usize];
            if s.state == SeqState::Running && best.is_none_or(|(o, _)| s.order > o) {
                best = Some((s.order, s.group));
            }
        }
        let (_, group) = best?;
        let mut members: Vec<(u64, SeqId)> = self
            .index
            .iter()
            .filter(|&(_, &i)| {
                let s = &self.slots[i as usize];
                s.state == SeqState::Running && s.group == group
            })
            .map(|(&id, &i)| (self.slots[i as usize].uid, id))
            .collect();
        members.sort_unstable();
        Some(members.into_iter().map(|(_, id)| id).collect())
    }

    /// The cost model's choice for preempting the running `seqs` together (usually what
    /// [`BlockManager::choose_victim`] returned), with both estimates; each step is assumed to
    /// carry one decode token per running sequence outside `seqs` beside the recompute
    /// ([`BlockManager::decide_beside`] takes another figure).
    pub fn decide(&mut self, seqs: &[SeqId], model: &CostModel) -> Result<Decision> {
        self.decide_beside(seqs, model, None)
    }

    /// [`BlockManager::decide`] with the tokens of other work a step carries given
    /// (`batch_tokens`; `None` counts the running sequences outside `seqs`).
    ///
    /// Swap: 2 × the KV bytes of their distinct device blocks (whole blocks) over the host link.
    /// Recompute: for each sequence, the tokens past the leading full blocks that would stay
    /// cached after the preemption (blocks also held by sequences outside `seqs`), at least one
    /// token, summed over the sequences (so × branches for a forked group), costed by
    /// [`CostModel::recompute_cost`] beside `batch_tokens`. The mode is swap when the host pool
    /// has room for it and it is strictly cheaper. Read-only. Errors: as
    /// [`BlockManager::swap_out`]'s checks, and `InvalidArgument` for a rate that is not finite
    /// and > 0 (a floor < 0).
    pub fn decide_beside(
        &mut self,
        seqs: &[SeqId],
        model: &CostModel,
        batch_tokens: Option<u64>,
    ) -> Result<Decision> {
        model.validate()?;
        let slots = self.resolve_in_state(seqs, SeqState::Running, "running")?;
        let bs = self.bs;
        // References the victims hold per block: a block survives if others hold it too.
        let mut held: FastMap<BlockId, u32> = FastMap::default();
        let mut host_needed = 0u64;
        for &i in &slots {
            for &b in &self.slots[i].table.blocks {
                let c = held.entry(b).or_insert(0);
                if *c == 0 && self.content_origin(b).is_err() {
                    host_needed += 1;
                }
                *c += 1;
            }
        }
        let mut tokens = 0u64;
        for &i in &slots {
            let t = &self.slots[i].table;
            let len = t.num_tokens;
            let max_hit = (len - 1) / bs;
            let mut hits = 0usize;
            if self.caching {
                for &b in t.blocks.iter().take(max_hit) {
                    let survives = self.prefix.hash_of(b).is_some()
                        && self.pool.refcount(b)? > held.get(&b).copied().unwrap_or(0);
                    if !survives {
                        break;
                    }
                    hits += 1;
                }
            }
            tokens += (len - hits * bs) as u64;
        }
        let swap_blocks = held.len() as u64;
        let swap_cost_s = model.swap_cost(swap_blocks, bs as u64);
        let batch_tokens = batch_tokens.unwrap_or_else(|| {
            let running = self
                .index
                .values()
                .filter(|&&i| self.slots[i as usize].state == SeqState::Running)
                .count();
            running.saturating_sub(slots.len()) as u64
        });
        let recompute_cost_s = model.recompute_cost(tokens, batch_tokens);
        let swap_possible = host_needed as usize <= self.host.num_free();
        let mode = if swap_possible && swap_cost_s < recompute_cost_s {
            PreemptMode::Swap
        } else {
            PreemptMode::Recompute
        };
        Ok(Decision {
            mode,
            swap_cost_s,
            recompute_cost_s,
            swap_possible,
            swap_blocks,
            recompute_tokens: tokens,
            batch_tokens,
        })
    }

    /// A sequence's state.
    pub fn seq_state(&self, seq: SeqId) -> Result<SeqState> {
        Ok(self.slots[self.slot_of(seq)?].state)
    }

    /// Swap-out copies `(device, host)` queued for the next steps.
    pub fn pending_swap_out(&self) -> &[(BlockId, HostBlockId)] {
        &self.swap_out_q
    }

    /// Swap-in copies `(host, device)` queued for the next steps.
    pub fn pending_swap_in(&self) -> &[(HostBlockId, BlockId)] {
        &self.swap_in_q
    }

    /// Free blocks of the host pool.
    pub fn num_free_host_blocks(&self) -> usize {
        self.host.num_free()
    }

    /// Reference count of host block `h` (`InvalidBlock` outside the host pool).
    pub fn host_block_refcount(&self, h: HostBlockId) -> Result<u32> {
        self.host.refcount(h)
    }

    /// Whether `seq` is a live sequence.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.index.contains_key(&seq)
    }

    /// Tokens `seq` holds; `UnknownSequence` if it is not live.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.slots[self.slot_of(seq)?].table.num_tokens)
    }

    /// Physical blocks of `seq`, in logical order; `UnknownSequence` if it is not live.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.slots[self.slot_of(seq)?].table.blocks)
    }

    /// The live sequence ids, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.index.keys().copied()
    }

    /// Live sequences.
    pub fn num_seqs(&self) -> usize {
        self.index.len()
    }

    /// Blocks available to allocations: free plus cached-free (evictable).
    #[inline]
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free() + self.prefix.lru_len()
    }

    /// Reference count of block `b` (`InvalidBlock` outside the pool).
    pub fn block_refcount(&self, b: BlockId) -> Result<u32> {
        self.pool.refcount(b)
    }

    /// Copy-on-write copies queued for the next step, as `(src, dst)`.
    pub fn pending_copies(&self) -> &[(BlockId, BlockId)] {
        &self.pending
    }

    /// The prefix hash block `b` is cached under, if any.
    pub fn block_hash(&self, b: BlockId) -> Option<u128> {
        if (b as usize) < self.cfg.num_blocks as usize {
            self.prefix.hash_of(b)
        } else {
            None
        }
    }

    /// [`crate::prefix::probe_cost`] of the sequence-id index and of the prefix-hash map, each
    /// under its own hasher: about 1 group per key unless the keys cluster. For tests and
    /// diagnostics (O(sequences + hashed blocks)).
    pub fn map_probe_costs(&self) -> (f64, f64) {
        (
            crate::prefix::probe_cost(self.index.hasher(), self.index.keys()),
            self.prefix.map_probe_cost(),
        )
    }

    /// Test hook: re-labels hashed block `b` with `hash`, forging a hash collision (the block keeps
    /// its token ids). Returns false if `b` is not hashed or `hash` is taken.
    #[doc(hidden)]
    pub fn debug_relabel_block(&mut self, b: BlockId, hash: u128) -> bool {
        (b as usize) < self.cfg.num_blocks as usize && self.prefix.relabel(b, hash)
    }

    /// Forgets what the manager remembers about the block-table buffer it last wrote, so the next
    /// `build_step` writes every row of its batch in full. Call it after writing into that buffer
    /// yourself (or after handing the manager new memory that reuses the old address, length and
    /// stride); see [`StepBuffers`] for the ownership contract.
    pub fn invalidate_step_cache(&mut self) {
        self.step_cache.invalidate();
    }

    /// Fills `out` for one step. Each `(seqs[i], num_new[i])` means "the last `num_new[i]` tokens
    /// of `seqs[i]` are new this step". Validates everything (lengths, ids, `1 <= n <= len`, every
    /// buffer's size) before writing anything; then emits pending copies and offers the batch's newly
    /// full blocks to the prefix cache.
    ///
    /// Copies: all pending copies when they fit in `copies`. Otherwise every pending copy whose
    /// `dst` or `src` a scheduled sequence holds is emitted (`BufferTooSmall` on `copies` only if
    /// those alone do not fit), then others while `copies` has room; the rest stay queued for a
    /// later step, so a burst of forks never blocks stepping.
    ///
    /// Block-table rows are written incrementally: the manager remembers, for the buffer it last
    /// wrote (identified by address, length and stride), which sequence each row holds and how many
    /// of its entries. A row that still holds a prefix of the same sequence's unchanged table gets
    /// only the entries past that prefix; any other row is written in full, and a different buffer
    /// resets the memory. So between steps the block-table buffer belongs to the manager: whoever
    /// writes into it must call [`BlockManager::invalidate_step_cache`] before the next step. The
    /// CSR page table, when requested, is packed and rewritten in full every step.
    pub fn build_step(
        &mut self,
        seqs: &[SeqId],
        num_new: &[u32],
        out: &mut StepBuffers<'_>,
    ) -> Result<StepInfo> {
        if seqs.len() != num_new.len() {
            return Err(Error::InvalidArgument {
                what: "num_new.len",
                value: num_new.len() as i64,
                reason: format!("must equal seqs.len() ({})", seqs.len()),
            });
        }
        self.resolve_batch(seqs)?;
        let (num_tokens, num_kv, max_len, max_query, csr, needed) =
            self.check_step(seqs, num_new, out)?;
        let swaps = self.plan_swaps(
            out.swap_out.len() / 2,
            out.swap_in.len() / 2,
            out.copies.len() / 2,
        )?;
        let idx = std::mem::take(&mut self.batch_idx);

        let bs = self.bs;
        let stride = out.block_table_stride;
        let marks = self
            .step_cache
            .rows_for(out.block_tables, stride, seqs.len());
        self.scratch_register.clear();
        write_batch(
            &self.slots,
            &idx,
            num_new,
            bs,
            self.caching,
            csr,
            out,
            marks,
            &mut self.scratch_register,
        );

        let num_copies = match &swaps {
            Some(plan) => self.emit_copies_masked(&plan.emit_cow, out.copies),
            None => self.emit_copies(&needed, out.copies),
        };
        let (num_swap_out, num_swap_in, swap_result) =
            self.emit_swaps(swaps, out.swap_out, out.swap_in);
        let mut result = swap_result;
        if self.pending.is_empty() {
            while let Some(b) = self.deferred.pop() {
                if let Err(e) = self.park(b) {
                    result = Err(e);
                }
            }
        } else {
            // Some copies stay queued: only the srcs none of them needs are released.
            let mut j = 0;
            while j < self.deferred.len() {
                let b = self.deferred[j];
                if self.pending.iter().any(|&(src, _)| src == b) {
                    j += 1;
                } else {
                    self.deferred.swap_remove(j);
                    if let Err(e) = self.park(b) {
                        result = Err(e);
                    }
                }
            }
        }

        for &i in &self.scratch_register {
            let s = &mut self.slots[i as usize];
            let nb = s.table.blocks.len();
            let full = if s.table.num_tokens == nb * bs {
                nb
            } else {
                nb - 1
            };
            self.hasher
                .extend_chain(s.root, &s.tokens, bs, s.keys.as_deref(), &mut s.hashes);
            for j in s.registered..full {
                self.prefix.register(
                    s.table.blocks[j],
                    s.hashes[j],
                    &s.tokens[j * bs..(j + 1) * bs],
                );
            }
            s.registered = full;
        }
        self.batch_idx = idx;
        let num_kv_indices = if csr { num_kv } else { 0 };
        result.map(|_| StepInfo {
            num_seqs: seqs.len(),
            num_tokens,
            num_kv_indices,
            num_copies,
            max_seq_len: max_len,
            num_swap_out,
            num_swap_in,
            max_query_len: max_query,
        })
    }

    /// Which queued swap copies this step emits, when they do not all fit (`None`: all of them).
    ///
    /// Each step's lists run swap-out, then swap-in, then copy-on-write, before its forward. What
    /// this step writes is the blocks of the scheduled sequences (its forward), the destinations
    /// of its copies and of its swap-ins; so a queued swap-out must be emitted by the first step
    /// that writes its device block, and before (or with) a swap-in of its host block. A swap-in
    /// must be emitted by the first step that schedules a holder of its device block or may copy
    /// from it. Those copies must fit (`BufferTooSmall` on `swap_out` / `swap_in` otherwise,
    /// nothing written); the rest fill the remaining room in queue order, a swap-in only when every
    /// swap-out reading its device block or writing its host block is emitted too. A step of no
    /// sequences (and no queued copy-on-write) therefore always makes progress: an engine refused
    /// for a full swap list can drain the queues with empty steps.
    fn plan_swaps(
        &self,
        room_out: usize,
        room_in: usize,
        room_cow: usize,
    ) -> Result<Option<SwapPlan>> {
        let swaps_fit = self.swap_out_q.len() <= room_out && self.swap_in_q.len() <= room_in;
        if swaps_fit
            && (self.pending.len() <= room_cow
                || (self.swap_out_q.is_empty() && self.swap_in_q.is_empty()))
        {
            // Everything is emitted, or only copy-on-write overflows (`emit_copies` plans it).
            return Ok(None);
        }
        let small = |buffer: &'static str, needed: usize, room: usize| Error::BufferTooSmall {
            buffer,
            needed: 2 * needed,
            capacity: 2 * room,
        };
        // Device blocks this step's forward writes: every block of a scheduled table.
        let mut scheduled: FastMap<BlockId, ()> = FastMap::default();
        for &i in &self.batch_idx {
            for &b in &self.slots[i as usize].table.blocks {
                scheduled.insert(b, ());
            }
        }
        // What the step cannot do without: the copies whose destination or source a scheduled
        // table holds (as `check_step` already made sure fit), the swap-ins such a table or such a
        // copy reads, and the swap-outs of blocks any of those write, or of host blocks those
        // swap-ins read.
        let mut emit_cow: Vec<bool> = self
            .pending
            .iter()
            .map(|&(s0, d)| scheduled.contains_key(&s0) || scheduled.contains_key(&d))
            .collect();
        let cow_src: FastMap<BlockId, ()> = self
            .pending
            .iter()
            .zip(&emit_cow)
            .filter(|&(_, &e)| e)
            .map(|(&(s0, _), _)| (s0, ()))
            .collect();
        let mut emit_in: Vec<bool> = self
            .swap_in_q
            .iter()
            .map(|&(_, d)| scheduled.contains_key(&d) || cow_src.contains_key(&d))
            .collect();
        let mut n_in = emit_in.iter().filter(|&&x| x).count();
        if n_in > room_in {
            return Err(small("swap_in", n_in, room_in));
        }
        let mut written: FastMap<BlockId, ()> = FastMap::default();
        let mut read: FastMap<HostBlockId, ()> = FastMap::default();
        for (&(h, d), _) in self.swap_in_q.iter().zip(&emit_in).filter(|&(_, &e)| e) {
            written.insert(d, ());
            read.insert(h, ());
        }
        for (&(_, d), _) in self.pending.iter().zip(&emit_cow).filter(|&(_, &e)| e) {
            written.insert(d, ());
        }
        let mut emit_out: Vec<bool> = self
            .swap_out_q
            .iter()
            .map(|&(d, h)| {
                scheduled.contains_key(&d) || written.contains_key(&d) || read.contains_key(&h)
            })
            .collect();
        let mut n_out = emit_out.iter().filter(|&&x| x).count();
        if n_out > room_out {
            return Err(small("swap_out", n_out, room_out));
        }
        // Then the rest, in queue order while there is room: swap-outs first; a swap-in once
        // every swap-out reading its device block or filling its host block is emitted; a copy
        // once no swap-out still queued reads its destination and no swap-in still queued fills
        // its source.
        for e in emit_out.iter_mut() {
            if n_out == room_out {
                break;
            }
            if !*e {
                *e = true;
                n_out += 1;
            }
        }
        let mut waiting_src: FastMap<BlockId, ()> = FastMap::default();
        let mut waiting_dst: FastMap<HostBlockId, ()> = FastMap::default();
        for (&(d, h), _) in self.swap_out_q.iter().zip(&emit_out).filter(|&(_, &e)| !e) {
            waiting_src.insert(d, ());
            waiting_dst.insert(h, ());
        }
        for (j, &(h, d)) in self.swap_in_q.iter().enumerate() {
            if n_in == room_in {
                break;
            }
            if !emit_in[j] && !waiting_dst.contains_key(&h) && !waiting_src.contains_key(&d) {
                emit_in[j] = true;
                n_in += 1;
            }
        }
        let unfilled: FastMap<BlockId, ()> = self
            .swap_in_q
            .iter()
            .zip(&emit_in)
            .filter(|&(_, &e)| !e)
            .map(|(&(_, d), _)| (d, ()))
            .collect();
        let mut n_cow = emit_cow.iter().filter(|&&x| x).count();
        for (j, &(s0, d)) in self.pending.iter().enumerate() {
            if n_cow == room_cow {
                break;
            }
            if !emit_cow[j] && !waiting_src.contains_key(&d) && !unfilled.contains_key(&s0) {
                emit_cow[j] = true;
                n_cow += 1;
            }
        }
        Ok(Some(SwapPlan {
            emit_out,
            emit_in,
            emit_cow,
        }))
    }

    /// Writes the pending copies `mask` selects into `copies`, in queue order; the rest stay
    /// queued, in order. Returns the number written.
    fn emit_copies_masked(&mut self, mask: &[bool], copies: &mut [i64]) -> usize {
        drain_selected(&mut self.pending, mask, copies)
    }

    /// Writes the planned swap copies (all when `plan` is `None`) into the step's lists, removes
    /// them from the queues, and drops the host reference each emitted swap-in held. Returns the
    /// pairs written to each list.
    fn emit_swaps(
        &mut self,
        plan: Option<SwapPlan>,
        out: &mut [i64],
        inn: &mut [i64],
    ) -> (usize, usize, Result<()>) {
        if self.swap_out_q.is_empty() && self.swap_in_q.is_empty() {
            return (0, 0, Ok(()));
        }
        let (emit_out, emit_in) = match plan {
            Some(p) => (p.emit_out, p.emit_in),
            None => (
                vec![true; self.swap_out_q.len()],
                vec![true; self.swap_in_q.len()],
            ),
        };
        let n_out = drain_selected(&mut self.swap_out_q, &emit_out, out);
        let n_in = drain_selected(&mut self.swap_in_q, &emit_in, inn);
        // An emitted swap-in drops the host reference it held: the step's list now names the copy.
        let mut result = Ok(());
        for k in 0..n_in {
            if let Err(e) = self.host_drop(inn[2 * k] as HostBlockId) {
                result = Err(e);
            }
        }
        (n_out, n_in, result)
    }

    /// Writes pending copies into `copies` (room for `copies.len() / 2`), in queue order. When
    /// all fit (`needed` empty) all are written; otherwise every copy the batch needs
    /// (`needed[j]` for `pending[j]`; `check_step` made sure they fit) and others while room
    /// remains, the rest staying queued, in order, for a later step. Returns the number written.
    fn emit_copies(&mut self, needed: &[bool], copies: &mut [i64]) -> usize {
        if needed.is_empty() {
            for (j, &(src, dst)) in self.pending.iter().enumerate() {
                copies[2 * j] = src as i64;
                copies[2 * j + 1] = dst as i64;
            }
            let n = self.pending.len();
            self.pending.clear();
            return n;
        }
        let room = copies.len() / 2;
        // A copy the batch does not need goes only where it leaves room for every needed copy
        // after it.
        let mut needed_left = needed.iter().filter(|&&x| x).count();
        let mut n = 0;
        let mut keep = Vec::new();
        for (j, &(src, dst)) in self.pending.iter().enumerate() {
            if needed[j] {
                needed_left -= 1;
            } else if n + needed_left >= room {
                keep.push((src, dst));
                continue;
            }
            copies[2 * n] = src as i64;
            copies[2 * n + 1] = dst as i64;
            n += 1;
        }
        self.pending = keep;
        n
    }

    /// When more copies are pending than `room`: which of them the batch (`self.batch_idx`)
    /// needs this step — those whose `dst` or `src` a scheduled table holds. A scheduled holder
    /// of `dst` reads and writes it, so its copy must run first; a scheduled holder of `src` may
    /// fill it and have it registered in the prefix cache, and a cached block must not be a
    /// pending src (it could be evicted and reused before the copy runs). Copies of sequences
    /// that are not scheduled may wait. Empty (emit everything) when all pending copies fit.
    /// O(blocks of the batch), paid only in that overflow case.
    fn copies_needed(&self, room: usize) -> Vec<bool> {
        if self.pending.len() <= room {
            return Vec::new();
        }
        let mut at: FastMap<BlockId, Vec<usize>> = FastMap::default();
        for (j, &(src, dst)) in self.pending.iter().enumerate() {
            at.entry(src).or_default().push(j);
            at.entry(dst).or_default().push(j);
        }
        let mut needed = vec![false; self.pending.len()];
        for &i in &self.batch_idx {
            for b in &self.slots[i as usize].table.blocks {
                if let Some(js) = at.get(b) {
                    for &j in js {
                        needed[j] = true;
                    }
                }
            }
        }
        needed
    }

    /// Validation half of `build_step` (after `resolve_batch`): returns (new tokens, kv indices,
    /// longest sequence, most new tokens of one sequence, whether to write the CSR page table,
    /// which pending copies the batch needs).
    // Out of line: inlined into `build_step`, its loop spilled its values to the stack.
    #[inline(never)]
    fn check_step(
        &self,
        seqs: &[SeqId],
        num_new: &[u32],
        out: &StepBuffers<'_>,
    ) -> Result<(usize, usize, usize, usize, bool, Vec<bool>)> {
        let (mut tokens, mut kv, mut max_len, mut max_blocks) = (0usize, 0usize, 0usize, 0usize);
        let mut max_query = 0usize;
        for (k, &i) in self.batch_idx.iter().enumerate() {
            let t = &self.slots[i as usize].table;
            let n = num_new[k] as usize;
            if n == 0 || n > t.num_tokens {
                return Err(Error::InvalidArgument {
                    what: "num_new",
                    value: n as i64,
                    reason: format!(
                        "must be in 1..={} (length of sequence {})",
                        t.num_tokens, seqs[k]
                    ),
                });
            }
            tokens += n;
            max_query = max_query.max(n);
            kv += t.blocks.len();
            max_len = max_len.max(t.num_tokens);
            max_blocks = max_blocks.max(t.blocks.len());
        }
        let b = seqs.len();
        if tokens > i32::MAX as usize || kv > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "seqs.len",
                value: b as i64,
                reason: format!("step of {tokens} tokens / {kv} blocks overflows int32 offsets"),
            });
        }
        let small = |buffer: &'static str, needed: usize, capacity: usize| {
            if capacity < needed {
                Err(Error::BufferTooSmall {
                    buffer,
                    needed,
                    capacity,
                })
            } else {
                Ok(())
            }
        };
        // All three CSR buffers empty: the caller does not want the FlashInfer page table.
        let csr = !(out.kv_indptr.is_empty()
            && out.kv_indices.is_empty()
            && out.kv_last_page_len.is_empty());
        small("seq_lens", b, out.seq_lens.len())?;
        small("query_start_loc", b + 1, out.query_start_loc.len())?;
        if csr {
            small("kv_indptr", b + 1, out.kv_indptr.len())?;
            small("kv_last_page_len", b, out.kv_last_page_len.len())?;
        }
        small("slot_mapping", tokens, out.slot_mapping.len())?;
        small("block_table_stride", max_blocks, out.block_table_stride)?;
        small(
            "block_tables",
            b.saturating_mul(out.block_table_stride),
            out.block_tables.len(),
        )?;
        if csr {
            small("kv_indices", kv, out.kv_indices.len())?;
        }
        // Only the copies this batch reads must fit; the rest wait for a later step, so more
        // pending copies than the buffer holds never blocks a step.
        let needed = self.copies_needed(out.copies.len() / 2);
        small(
            "copies",
            2 * needed.iter().filter(|&&x| x).count(),
            out.copies.len(),
        )?;
        Ok((tokens, kv, max_len, max_query, csr, needed))
    }

    /// A snapshot of sizes and counters. O(number of sequences) for the histogram.
    pub fn stats(&self) -> Stats {
        let nbk = self.cfg.num_blocks as u64;
        let free = self.pool.num_free() as u64;
        let cached = self.prefix.lru_len() as u64;
        let used = nbk - free - cached;
        let mut hist = [0u64; HIST_BUCKETS];
        let mut swapped = 0u64;
        for &i in self.index.values() {
            let s = &self.slots[i as usize];
            match s.state {
                SeqState::Running => hist[hist_bucket(s.table.blocks.len())] += 1,
                SeqState::Swapped => swapped += 1,
                SeqState::Recompute => {}
            }
        }
        let c = &self.counters;
        Stats {
            num_blocks: nbk,
            block_size: self.bs as u64,
            free_blocks: free,
            cached_free_blocks: cached,
            used_blocks: used,
            num_seqs: self.index.len() as u64,
            used_tokens: self.used_tokens,
            kv_utilization: self.used_tokens as f64 / (nbk as f64 * self.bs as f64),
            allocated_token_slots: used * self.bs as u64,
            prefix_query_tokens: c.prefix_query_tokens,
            prefix_hit_tokens: c.prefix_hit_tokens,
            prefix_hit_ratio: if c.prefix_query_tokens == 0 {
                0.0
            } else {
                c.prefix_hit_tokens as f64 / c.prefix_query_tokens as f64
            },
            evictions: c.evictions,
            prefix_collisions: c.prefix_collisions,
            shared_blocks: self.shared_blocks,
            cow_copies: c.cow_copies,
            preemptions: c.preemptions_swap + c.preemptions_recompute,
            preemptions_swap: c.preemptions_swap,
            preemptions_recompute: c.preemptions_recompute,
            swapped_out_blocks: c.swapped_out_blocks,
            swapped_in_blocks: c.swapped_in_blocks,
            num_host_blocks: self.host.num_blocks() as u64,
            host_free_blocks: self.host.num_free() as u64,
            swapped_seqs: swapped,
            kv_cache_usage: used as f64 / nbk as f64,
            blocks_per_seq: hist,
        }
    }

    /// Checks every structural invariant; `InvariantViolation` describes the first one broken.
    /// O(blocks + tokens); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvariantViolation(m));
        let n = self.cfg.num_blocks as usize;
        let bs = self.bs;
        let mut occ = vec![0u64; n];
        let nh = self.host.num_blocks() as usize;
        let mut host_occ = vec![0u64; nh];
        let mut used_tokens = 0u64;
        let mut seen_slots = std::collections::HashSet::new();
        for (&id, &i) in &self.index {
            if !seen_slots.insert(i) {
                return bad(format!("slot {i} used by two sequences"));
            }
            let s = &self.slots[i as usize];
            let t = &s.table;
            if t.num_tokens == 0 {
                return bad(format!("sequence {id} is empty"));
            }
            if self.caching && s.tokens.len() != t.num_tokens {
                return bad(format!(
                    "sequence {id}: {} token ids for length {}",
                    s.tokens.len(),
                    t.num_tokens
                ));
            }
            match s.state {
                SeqState::Running => {}
                SeqState::Recompute => {
                    if !t.blocks.is_empty() {
                        return bad(format!(
                            "sequence {id} preempted by recompute holds {} blocks",
                            t.blocks.len()
                        ));
                    }
                    continue;
                }
                SeqState::Swapped => {
                    // All on the host, never a mix: every entry is a host block id it holds.
                    if t.blocks.len() != blocks_for(t.num_tokens, bs) {
                        return bad(format!(
                            "swapped sequence {id}: {} tokens in {} host blocks",
                            t.num_tokens,
                            t.blocks.len()
                        ));
                    }
                    for &h in &t.blocks {
                        if h as usize >= nh {
                            return bad(format!(
                                "swapped sequence {id}: host block {h} outside the host pool"
                            ));
                        }
                        host_occ[h as usize] += 1;
                    }
                    continue;
                }
            }
            if t.blocks.len() != blocks_for(t.num_tokens, bs) {
                return bad(format!(
                    "sequence {id}: {} tokens in {} blocks",
                    t.num_tokens,
                    t.blocks.len()
                ));
            }
            if t.blocks.len() > self.cfg.max_blocks_per_seq as usize {
                return bad(format!(
                    "sequence {id}: {} blocks exceed the row width",
                    t.blocks.len()
                ));
            }
            if s.registered > t.num_tokens / bs || s.hashes.len() > t.num_tokens / bs {
                return bad(format!("sequence {id}: hashes cover a partial block"));
            }
            for (j, &b) in t.blocks.iter().enumerate() {
                if b as usize >= n {
                    return bad(format!("sequence {id}: block {b} outside the pool"));
                }
                occ[b as usize] += 1;
                if let Some(h) = self.prefix.hash_of(b) {
                    if (j + 1) * bs > t.num_tokens {
                        return bad(format!("sequence {id}: partial block {b} is hashed"));
                    }
                    if j < s.hashes.len() && s.hashes[j] != h && !self.prefix.verifies() {
                        return bad(format!(
                            "sequence {id}: block {b} cached under another chain"
                        ));
                    }
                    if self.prefix.verifies()
                        && self.prefix.stored_tokens(b) != &s.tokens[j * bs..(j + 1) * bs]
                    {
                        // A relabelled (forged) block keeps its own tokens; only content matters.
                        return bad(format!(
                            "sequence {id}: block {b} content differs from its cached tokens"
                        ));
                    }
                }
            }
            used_tokens += t.num_tokens as u64;
        }
        if used_tokens != self.used_tokens {
            return bad(format!(
                "used_tokens {} but sequences hold {used_tokens}",
                self.used_tokens
            ));
        }
        // Host pool: refcount = swapped tables holding the block + queued swap-ins reading it;
        // queued swap-outs write distinct, owned host blocks; swap-ins fill distinct, owned
        // device blocks.
        for &(h, d) in &self.swap_in_q {
            if h as usize >= nh || d as usize >= n {
                return bad(format!("swap-in ({h}, {d}) outside a pool"));
            }
            host_occ[h as usize] += 1;
            // Held by a running table, or the source of a pending copy-on-write (deferred).
            if occ[d as usize] == 0 && !self.deferred.contains(&d) {
                return bad(format!(
                    "swap-in destination {d} is in no running table and no copy's source"
                ));
            }
        }
        let mut in_dsts = std::collections::HashSet::new();
        for &(_, d) in &self.swap_in_q {
            if !in_dsts.insert(d) {
                return bad(format!(
                    "device block {d} is the destination of two swap-ins"
                ));
            }
        }
        let mut out_dsts = std::collections::HashSet::new();
        for &(d, h) in &self.swap_out_q {
            if h as usize >= nh || d as usize >= n {
                return bad(format!("swap-out ({d}, {h}) outside a pool"));
            }
            if !out_dsts.insert(h) {
                return bad(format!(
                    "host block {h} is the destination of two swap-outs"
                ));
            }
            if host_occ[h as usize] == 0 {
                return bad(format!("swap-out destination {h} is held by no one"));
            }
        }
        for (h, &o) in host_occ.iter().enumerate() {
            let rc = self.host.refcount(h as u32)? as u64;
            if rc != o {
                return bad(format!("host block {h}: refcount {rc} but {o} holders"));
            }
        }
        self.host
            .check_invariants()
            .map_err(Error::InvariantViolation)?;
        // Pending copies: distinct dsts, owned; no dst is a src; deferred blocks are srcs.
        let mut dsts = std::collections::HashSet::new();
        for &(s, d) in &self.pending {
            if !dsts.insert(d) {
                return bad(format!("block {d} is the dst of two pending copies"));
            }
            if occ[d as usize] == 0 {
                return bad(format!("pending copy dst {d} is not in any table"));
            }
            if self.prefix.hash_of(s).is_some() {
                return bad(format!("pending copy src {s} is hashed"));
            }
        }
        for &(s, _) in &self.pending {
            if dsts.contains(&s) {
                return bad(format!(
                    "block {s} is both a src and a dst of pending copies"
                ));
            }
        }
        let mut free_count = 0usize;
        let mut shared = 0u64;
        for b in 0..n as u32 {
            let rc = self.pool.refcount(b)? as u64;
            let on_free_list = self.pool.is_free(b)?;
            let in_lru = self.prefix.in_lru(b);
            let deferred = self.deferred.contains(&b);
            if rc != occ[b as usize] {
                return bad(format!(
                    "block {b}: refcount {rc} but in {} tables",
                    occ[b as usize]
                ));
            }
            if rc > 1 {
                shared += 1;
            }
            let states = (rc > 0) as u8 + on_free_list as u8 + in_lru as u8 + deferred as u8;
            if states != 1 {
                return bad(format!(
                    "block {b}: refcount {rc}, free list {on_free_list}, LRU {in_lru}, deferred {deferred}"
                ));
            }
            if on_free_list {
                free_count += 1;
                if self.prefix.hash_of(b).is_some() {
                    return bad(format!("free block {b} still hashed"));
                }
            }
            if in_lru && self.prefix.hash_of(b).is_none() {
                return bad(format!("cached-free block {b} has no hash"));
            }
            if deferred && !self.pending.iter().any(|&(s, _)| s == b) {
                return bad(format!("deferred block {b} is no pending copy's src"));
            }
        }
        if free_count != self.pool.num_free() {
            return bad(format!(
                "{free_count} blocks free but the pool counts {}",
                self.pool.num_free()
            ));
        }
        if shared != self.shared_blocks {
            return bad(format!(
                "{shared} shared blocks but the counter says {}",
                self.shared_blocks
            ));
        }
        for (h, b) in self.prefix.entries() {
            if self.prefix.hash_of(b) != Some(h) {
                return bad(format!(
                    "hash {h:#x} maps to block {b}, which carries {:?}",
                    self.prefix.hash_of(b)
                ));
            }
        }
        let hashed = (0..n as u32)
            .filter(|&b| self.prefix.hash_of(b).is_some())
            .count();
        if hashed != self.prefix.num_hashed() {
            return bad(format!(
                "{hashed} blocks carry a hash but the map holds {}",
                self.prefix.num_hashed()
            ));
        }
        self.prefix
            .check_links()
            .map_err(Error::InvariantViolation)?;
        self.prefix.check_map().map_err(Error::InvariantViolation)?;
        self.pool.check_invariants()
    }
}

/// The per-sequence half of [`BlockManager::build_step`], after validation: slot mapping, the
/// block-table entries each row lacks, lengths, query offsets and (with `csr`) the page table,
/// for the batch `idx` (slots); pushes onto `register` the slots with full blocks not yet offered
/// to the prefix cache. Out of line, with the batch-length slices cut once up front, so the loop
/// keeps its values in registers and indexes without bounds checks (inlined into `build_step`,
/// it spilled most of them to the stack).
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn write_batch(
    slots: &[Seq],
    idx: &[u32],
    num_new: &[u32],
    bs: usize,
    caching: bool,
    csr: bool,
    out: &mut StepBuffers<'_>,
    marks: &mut [crate::step::RowMark],
    register: &mut Vec<u32>,
) {
    let b = idx.len();
    let stride = out.block_table_stride;
    let num_new = &num_new[..b];
    let marks = &mut marks[..b];
    let seq_lens = &mut out.seq_lens[..b];
    let qsl = &mut out.query_start_loc[..b + 1];
    qsl[0] = 0;
    if csr {
        out.kv_indptr[0] = 0;
    }
    let (mut tok, mut kv) = (0usize, 0usize);
    let rows = idx
        .iter()
        .zip(num_new)
        .zip(marks.iter_mut())
        .zip(seq_lens.iter_mut().zip(qsl[1..].iter_mut()));
    for (k, (((&i, &n), mark), (seq_len, q))) in rows.enumerate() {
        let s = &slots[i as usize];
        let len = s.table.num_tokens;
        let n = n as usize;
        let blocks = s.table.blocks_i32();
        let nb = blocks.len();
        // Tokens in the last block; the table holds exactly ceil(len / B) blocks, so this needs
        // no division (a runtime-divisor `div` per sequence shows up in decode profiles).
        let last_page = len - (nb - 1) * bs;
        if n == 1 {
            out.slot_mapping[tok] = blocks[nb - 1] as i64 * bs as i64 + (last_page - 1) as i64;
        } else {
            let dst = &mut out.slot_mapping[tok..tok + n];
            let mut p = len - n;
            let mut w = 0;
            while p < len {
                let off = p % bs;
                let run = (bs - off).min(len - p);
                let base = blocks[p / bs] as i64 * bs as i64 + off as i64;
                for (j, d) in dst[w..w + run].iter_mut().enumerate() {
                    *d = base + j as i64;
                }
                w += run;
                p += run;
            }
        }
        // Only entries the row does not already hold: in a decode step that is at most one.
        let from = mark.valid_prefix(s.uid, s.version, nb);
        let row = &mut out.block_tables[k * stride + from..k * stride + nb];
        // Zero or one new entry is the decode case: a `memcpy` call per row would cost more.
        match row.len() {
            0 => {}
            1 => row[0] = blocks[nb - 1],
            _ => row.copy_from_slice(&blocks[from..]),
        }
        mark.set(s.uid, s.version, nb);
        // Noted here, while the sequence's state is in cache, rather than in another pass.
        let full = nb - (last_page < bs) as usize;
        if caching && s.registered < full {
            register.push(i);
        }
        tok += n;
        *seq_len = len as i32;
        *q = tok as i32;
        if csr {
            out.kv_indices[kv..kv + nb].copy_from_slice(blocks);
            kv += nb;
            out.kv_indptr[k + 1] = kv as i32;
            out.kv_last_page_len[k] = last_page as i32;
        }
    }
}

/// Evicts the least recently freed cached-free block and hands it out with refcount 1.
#[inline]
fn evict(
    prefix: &mut PrefixCache,
    pool: &mut BlockPool,
    counters: &mut Counters,
) -> Result<BlockId> {
    match prefix.evict_oldest() {
        Some(b) => {
            pool.incref_mut(b)?;
            counters.evictions += 1;
            Ok(b)
        }
        None => Err(Error::OutOfBlocks {
            needed: 1,
            available: 0,
        }),
    }
}

/// The error for a call that needs a running sequence.
#[cold]
fn not_running(seq_id: SeqId, state: SeqState) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: state.name(),
        expected: "running",
    }
}

/// Writes the pairs of `queue` that `mask` selects into `out` as `[a0, b0, a1, b1, ...]`, in queue
/// order, keeps the others queued in order, and returns the number of pairs written.
fn drain_selected(queue: &mut Vec<(u32, u32)>, mask: &[bool], out: &mut [i64]) -> usize {
    let (mut n, mut j) = (0, 0);
    queue.retain(|&(a, b)| {
        let emit = mask[j];
        j += 1;
        if emit {
            out[2 * n] = a as i64;
            out[2 * n + 1] = b as i64;
            n += 1;
        }
        !emit
    });
    n
}
