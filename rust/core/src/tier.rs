//! The host tier: the host block pool doubling as a second prefix-cache level
//! (`ManagerConfig::host_cache`).
//!
//! This module owns the host index: key → host block, host block → (key, group, parent hash,
//! salt digest, token ids), the LRU of host-cached blocks nobody references, the reservations of
//! blocks being filled from a lower tier, and the list of demotions the engine drains. The host
//! memory and the copies belong to the engine; the manager queues them on its swap lists
//! (`swap_out_q` device → host, `swap_in_q` host → device). See `docs/tiers.md` for the rules as
//! the engine sees them.
//!
//! Every host block is in exactly one of these states:
//! - **free**: on the host pool's free list, refcount 0;
//! - **swapped**: refcount ≥ 1, held by swapped-out block tables and queued swap-ins, not indexed;
//! - **reserved** (loading from a lower tier): refcount 1, not indexed, never findable, never
//!   evicted, until `commit_host_blocks` indexes it or frees it;
//! - **host-cached**: indexed under its hash. Its refcount counts the queued loads reading it
//!   (swap-ins), its queued offload (the swap-out filling it: one reference, dropped when a step
//!   emits it) and swapped tables holding it (a sequence swapped out while its load was in
//!   flight takes the block back). It is in the host LRU iff its refcount is 0;
//! - **orphaned**: indexed until `reset_prefix_cache`, still referenced (a load or offload in
//!   flight): unindexed, released when its last reference goes.
//!
//! Policy between swap and cache: **swapped blocks always win.** A swap-out may take any
//! host-cached block of the LRU (oldest first, a demotion); offloading never takes a referenced
//! block, so it can never evict a swapped one. An offload that finds no free or LRU block is
//! skipped (the block is simply not kept).
//!
//! Keys are the device prefix cache's: group `g`'s block `j` is indexed under `group_hash(h_j, g)`
//! (group 0's under the chain hash `h_j` itself), its parent recorded as the chain hash
//! `h_{j-1}` and its group beside it, so one host pool serves every KV cache group and a block
//! of one group is never found for another.
//!
//! Invariants (checked by `BlockManager::check_invariants`): the map is a bijection between the
//! indexed blocks and their hashes; a block is in the LRU iff indexed with refcount 0; a reserved
//! block is not indexed; a block is pinned by an offload iff exactly one queued swap-out fills it;
//! a hash both on the device and in the host index names the same token ids.

use crate::index_list::IndexList;
use crate::prefix::FastMap;
use crate::swap::HostBlockId;
use crate::{BlockId, TokenId};

/// A host-cached block evicted from the host LRU to make room: the engine copies its bytes to a
/// lower tier (disk, a remote store) before the step that overwrites the slot runs (see
/// `BlockManager::take_demotions`).
///
/// With KV cache groups a block of group `g >= 1` is named by its group's cache keys: `hash` is
/// `group_hash(h_j, g)` and `parent` `group_hash(h_{j-1}, g)`, so a lower tier sees each group's
/// blocks as a chain of their own that never answers for another group's (group 0's keys are the
/// chain hashes themselves).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demotion {
    /// The host block whose bytes are the block's KV until the next step's lists run.
    pub host_block: HostBlockId,
    /// Its prefix-cache key (its chain hash for group 0).
    pub hash: u128,
    /// The previous block's key in its chain and group (`None` for a chain's first block).
    pub parent: Option<u128>,
    /// The KV cache group whose block it is (0 without groups).
    pub group: u32,
    /// Digest of the chain's salt (its root hash): lets a lower tier check a block belongs to a
    /// salt without storing the salt.
    pub salt_digest: u128,
    /// Its token ids (`block_size` of them).
    pub tokens: Vec<TokenId>,
}

/// What [`crate::manager::BlockManager::lookup_tiers`] found for a prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TierLookup {
    /// Leading full blocks cached on the device.
    pub gpu_blocks: usize,
    /// Full blocks after those found in the host index.
    pub host_blocks: usize,
    /// The hashes of all the prompt's full blocks an admission may share (the first
    /// `(len - 1) / B`), in chain order: the engine probes lower tiers for
    /// `hashes[gpu_blocks + host_blocks..]`, and each block's parent is the hash before it.
    pub hashes: Vec<u128>,
    /// `hashes[gpu_blocks + host_blocks..]`: the blocks a lower tier may supply.
    pub remaining_hashes: Vec<u128>,
    /// The hash of the block before `remaining_hashes[0]` (`None` when it is the chain's first).
    pub parent_hash: Option<u128>,
    /// The salt digest of the prompt's chain (its root hash).
    pub salt_digest: u128,
}

/// The host index. Owned by the manager, only with `host_cache` on.
#[derive(Debug, Clone)]
pub struct HostTier {
    bs: usize,
    map: FastMap<u128, HostBlockId>,
    indexed: Vec<bool>,
    hash: Vec<u128>,
    group: Vec<u8>,
    parent: Vec<Option<u128>>,
    salt: Vec<u128>,
    tokens: Vec<TokenId>,
    pub(crate) lru: IndexList,
    pub(crate) reserved: Vec<bool>,
    reserved_epoch: Vec<u64>,
    /// Host blocks filled by a queued offload (each holds one reference until emitted).
    pub(crate) pinned: Vec<bool>,
    pub(crate) demotions: Vec<Demotion>,
    /// Parent hash and salt digest of each hashed device block, recorded at registration, for
    /// the write-back offload of an evicted block.
    dev_parent: Vec<Option<u128>>,
    dev_salt: Vec<u128>,
    /// Bumped by `clear`: a reservation made before a reset is not indexed by its commit.
    pub(crate) epoch: u64,
}

impl HostTier {
    /// An empty tier over `num_host` host blocks and `num_dev` device blocks.
    pub fn new(num_host: u32, num_dev: u32, block_size: u32) -> crate::Result<Self> {
        use crate::error::alloc::{failure, filled_vec, zeroed_vec};
        let (nh, nd, bs) = (num_host as usize, num_dev as usize, block_size as usize);
        let what = "host tier token ids";
        let nt = nh
            .checked_mul(bs)
            .ok_or_else(|| failure(what, nh as u128 * bs as u128 * 4))?;
        let mut map = FastMap::default();
        map.try_reserve(nh)
            .map_err(|_| failure("host tier hash map", nh as u128 * 24))?;
        Ok(Self {
            bs,
            map,
            indexed: zeroed_vec(nh, "host tier flags")?,
            hash: zeroed_vec(nh, "host tier hashes")?,
            group: filled_vec(nh, 0u8, "host tier groups")?,
            parent: filled_vec(nh, None, "host tier parents")?,
            salt: zeroed_vec(nh, "host tier salt digests")?,
            tokens: zeroed_vec(nt, what)?,
            lru: IndexList::new(nh, "host LRU links")?,
            reserved: zeroed_vec(nh, "host tier reservations")?,
            reserved_epoch: filled_vec(nh, 0u64, "host tier reservation epochs")?,
            pinned: zeroed_vec(nh, "host tier offload pins")?,
            demotions: Vec::new(),
            dev_parent: filled_vec(nd, None, "device block parents")?,
            dev_salt: zeroed_vec(nd, "device block salt digests")?,
            epoch: 0,
        })
    }

    /// The host block indexed under `h`.
    #[inline]
    pub fn lookup(&self, h: u128) -> Option<HostBlockId> {
        self.map.get(&h).copied()
    }

    /// Whether host block `b` is indexed.
    #[inline]
    pub fn is_indexed(&self, b: HostBlockId) -> bool {
        self.indexed[b as usize]
    }

    /// Indexed blocks.
    pub fn num_indexed(&self) -> usize {
        self.map.len()
    }

    /// The token ids of indexed block `b`.
    #[inline]
    pub fn tokens_of(&self, b: HostBlockId) -> &[TokenId] {
        &self.tokens[b as usize * self.bs..(b as usize + 1) * self.bs]
    }

    /// `(key, parent chain hash, salt digest)` of indexed block `b`.
    pub fn meta(&self, b: HostBlockId) -> (u128, Option<u128>, u128) {
        let i = b as usize;
        (self.hash[i], self.parent[i], self.salt[i])
    }

    /// The KV cache group of indexed block `b`.
    #[inline]
    pub fn group_of(&self, b: HostBlockId) -> usize {
        self.group[b as usize] as usize
    }

    /// `(group, chain hash)` of every indexed block, in no order.
    pub fn keys(&self) -> impl Iterator<Item = (usize, u128)> + '_ {
        self.map.values().map(|&b| {
            let g = self.group_of(b);
            (g, crate::groups::group_unhash(self.hash[b as usize], g))
        })
    }

    /// Indexes `b` (not indexed) under `key` (not taken) for group `group`.
    pub(crate) fn index(
        &mut self,
        b: HostBlockId,
        key: u128,
        group: usize,
        parent: Option<u128>,
        salt: u128,
        tokens: &[TokenId],
    ) {
        let i = b as usize;
        debug_assert!(!self.indexed[i] && !self.map.contains_key(&key));
        self.map.insert(key, b);
        self.indexed[i] = true;
        self.hash[i] = key;
        self.group[i] = group as u8;
        self.parent[i] = parent;
        self.salt[i] = salt;
        self.tokens[i * self.bs..(i + 1) * self.bs].copy_from_slice(tokens);
    }

    /// Drops `b` from the index and the LRU; returns its hash.
    pub(crate) fn unindex(&mut self, b: HostBlockId) -> u128 {
        let i = b as usize;
        debug_assert!(self.indexed[i]);
        self.indexed[i] = false;
        self.map.remove(&self.hash[i]);
        self.lru.remove(b);
        self.hash[i]
    }

    /// Records the parent and salt digest of device block `b`, just registered.
    #[inline]
    pub(crate) fn note_device(&mut self, b: BlockId, parent: Option<u128>, salt: u128) {
        self.dev_parent[b as usize] = parent;
        self.dev_salt[b as usize] = salt;
    }

    /// Parent and salt digest recorded for device block `b`.
    #[inline]
    pub(crate) fn device_meta(&self, b: BlockId) -> (Option<u128>, u128) {
        (self.dev_parent[b as usize], self.dev_salt[b as usize])
    }

    /// Marks `b` reserved (loading) in the current epoch.
    pub(crate) fn reserve(&mut self, b: HostBlockId) {
        self.reserved[b as usize] = true;
        self.reserved_epoch[b as usize] = self.epoch;
    }

    /// Whether reserved `b` was reserved since the last `clear`.
    pub(crate) fn reservation_current(&self, b: HostBlockId) -> bool {
        self.reserved_epoch[b as usize] == self.epoch
    }

    /// Checks the map against the per-block flags (the bijection) and the LRU's links.
    pub fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (b, &ix) in self.indexed.iter().enumerate() {
            if !ix {
                if self.lru.contains(b as u32) {
                    return Err(format!("host block {b} is in the LRU but not indexed"));
                }
                continue;
            }
            n += 1;
            if self.map.get(&self.hash[b]) != Some(&(b as u32)) {
                return Err(format!(
                    "indexed host block {b} (hash {:#x}) is not what the map holds",
                    self.hash[b]
                ));
            }
            if self.reserved[b] {
                return Err(format!("host block {b} is both reserved and indexed"));
            }
        }
        if n != self.map.len() {
            return Err(format!(
                "{n} host blocks indexed, the map holds {}",
                self.map.len()
            ));
        }
        self.lru.check("host LRU")
    }
}
