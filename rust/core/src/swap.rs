//! Reclamation: the host block pool, sequence states, and the swap-or-recompute cost model.
//!
//! When running sequences need blocks that are not there, the scheduler preempts a victim and
//! reclaims its blocks one of two ways:
//!
//! - **swap**: its blocks are copied to host memory (`BlockManager::swap_out`), the device blocks
//!   freed, and later copied back into freshly allocated device blocks (`swap_in`). Cost: about
//!   2 × its KV bytes over the host link.
//! - **recompute**: its blocks are freed but its token ids kept (`BlockManager::recompute`); it is
//!   re-admitted later from those tokens (`resume`), hitting whatever prefix is still cached, and
//!   the engine re-runs prefill for the rest. Cost: one prefill per branch of a forked group.
//!
//! This module owns the pieces that carry no manager state: [`HostPool`] (ids and reference counts
//! of the host blocks, its own free list, no hashing, no LRU), [`SeqState`], and [`CostModel`] /
//! [`Decision`]. The host memory itself (a pinned KV tensor) belongs to the engine; the core only
//! hands out host block ids and the copies to make.
//!
//! Host pool invariants: a host block is free (on the free list, refcount 0) or owned (refcount ≥ 1,
//! equal to the number of swapped-out block tables holding it plus one for each queued swap-in copy
//! reading it). The free list holds each free id once. Allocation hands out the most recently
//! freed id first (a stack) and is all-or-nothing through the manager's checks.

use crate::error::{alloc, Error, Result};

/// Host block id: an index into the engine's host KV pool.
pub type HostBlockId = u32;

/// Where a sequence's KV lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum SeqState {
    /// Its block table holds device blocks; it can be appended to and stepped.
    #[default]
    Running,
    /// Swapped out: its block table holds host blocks only (never a mix). Not schedulable until
    /// `swap_in`.
    Swapped,
    /// Preempted by recompute: it holds no blocks, only its length (and its token ids, with prefix
    /// caching on). Not schedulable until `resume`.
    Recompute,
}

impl SeqState {
    /// Lower-case name, as in error messages and the Python API.
    pub fn name(self) -> &'static str {
        match self {
            SeqState::Running => "running",
            SeqState::Swapped => "swapped",
            SeqState::Recompute => "recompute",
        }
    }
}

/// The host block pool: reference counts and a free stack. Exclusively owned by the manager.
#[derive(Debug, Clone, Default)]
pub struct HostPool {
    refcount: Vec<u32>,
    /// Free ids; the top is handed out next.
    free: Vec<HostBlockId>,
}

impl HostPool {
    /// A pool of `n` host blocks, all free; `AllocationFailed` if the host cannot hold its arrays.
    pub fn new(n: u32) -> Result<Self> {
        let refcount = alloc::zeroed_vec::<u32>(n as usize, "host block refcounts")?;
        let mut free = alloc::filled_vec::<HostBlockId>(n as usize, 0, "host block free list")?;
        // Lowest ids on top, so a fresh pool hands out 0, 1, 2, ...
        for (i, f) in free.iter_mut().enumerate() {
            *f = n - 1 - i as u32;
        }
        Ok(Self { refcount, free })
    }

    /// Blocks in the host pool; ids are `0..num_blocks`.
    pub fn num_blocks(&self) -> u32 {
        self.refcount.len() as u32
    }

    /// Free host blocks.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Reference count of host block `h` (`InvalidBlock` outside the pool).
    pub fn refcount(&self, h: HostBlockId) -> Result<u32> {
        self.refcount
            .get(h as usize)
            .copied()
            .ok_or(Error::InvalidBlock {
                block: h,
                num_blocks: self.num_blocks(),
            })
    }

    /// Takes a free block and gives it refcount 1. The caller checked `num_free() > 0`.
    #[inline]
    pub(crate) fn allocate(&mut self) -> Result<HostBlockId> {
        let h = self.free.pop().ok_or(Error::OutOfHostBlocks {
            needed: 1,
            available: 0,
        })?;
        self.refcount[h as usize] = 1;
        Ok(h)
    }

    #[inline]
    pub(crate) fn incref(&mut self, h: HostBlockId) {
        self.refcount[h as usize] += 1;
    }

    /// Drops a reference and returns the new count (the block is *not* released at 0: the caller
    /// decides, see [`HostPool::release`]). `RefcountUnderflow` if already 0.
    #[inline]
    pub(crate) fn decref(&mut self, h: HostBlockId) -> Result<u32> {
        let c = &mut self.refcount[h as usize];
        if *c == 0 {
            return Err(Error::RefcountUnderflow { block: h });
        }
        *c -= 1;
        Ok(*c)
    }

    /// Puts a refcount-0 block back on the free list.
    #[inline]
    pub(crate) fn release(&mut self, h: HostBlockId) {
        debug_assert_eq!(self.refcount[h as usize], 0);
        self.free.push(h);
    }

    /// The free list is exactly the refcount-0 blocks, each once.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut on_free = vec![false; self.refcount.len()];
        for &h in &self.free {
            let Some(slot) = on_free.get_mut(h as usize) else {
                return Err(format!("host free list holds {h}, outside the pool"));
            };
            if *slot {
                return Err(format!("host free list holds {h} twice"));
            }
            *slot = true;
        }
        for (h, (&rc, &f)) in self.refcount.iter().zip(&on_free).enumerate() {
            if (rc == 0) != f {
                return Err(format!(
                    "host block {h}: refcount {rc}, on the free list {f}"
                ));
            }
        }
        Ok(())
    }
}

/// How a preempted sequence (or forked group) is reclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptMode {
    /// Copy the KV to host blocks and back.
    Swap,
    /// Free the blocks and recompute the KV from the kept token ids.
    Recompute,
}

impl PreemptMode {
    /// `"swap"` or `"recompute"`.
    pub fn name(self) -> &'static str {
        match self {
            PreemptMode::Swap => "swap",
            PreemptMode::Recompute => "recompute",
        }
    }
}

/// The rates the swap-or-recompute choice is made from, measured on the device at start-up (or
/// given).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Host ↔ device copy bandwidth, bytes per second (one direction).
    pub host_link_bytes_per_s: f64,
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// KV bytes of one token over all layers (`2 × kv_heads × head_dim × dtype bytes × layers`).
    pub kv_bytes_per_token: f64,
}

impl CostModel {
    /// Every rate finite and > 0, else `InvalidArgument` naming it.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("host_link_bytes_per_s", self.host_link_bytes_per_s),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidArgument {
                    what,
                    value: if v.is_finite() { v as i64 } else { -1 },
                    reason: format!("must be a finite number > 0, got {v}"),
                });
            }
        }
        Ok(())
    }

    /// Seconds to swap `blocks` blocks of `block_size` tokens out and back in.
    pub fn swap_cost(&self, blocks: u64, block_size: u64) -> f64 {
        2.0 * (blocks * block_size) as f64 * self.kv_bytes_per_token / self.host_link_bytes_per_s
    }

    /// Seconds to recompute `tokens` tokens.
    pub fn recompute_cost(&self, tokens: u64) -> f64 {
        tokens as f64 / self.prefill_tokens_per_s
    }
}

/// The cost model's verdict for one victim, with both estimates so a scheduler can log why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The cheaper mode (recompute when the host pool has no room for a swap).
    pub mode: PreemptMode,
    /// 2 × the victim's KV bytes (distinct device blocks, whole blocks) / host-link bandwidth.
    pub swap_cost_s: f64,
    /// Tokens to recompute after the prefix hits that would survive (summed over the branches of
    /// a forked group) / prefill throughput.
    pub recompute_cost_s: f64,
    /// Whether the host pool has room for the swap now; when not, the mode is recompute.
    pub swap_possible: bool,
    /// Distinct device blocks a swap would copy.
    pub swap_blocks: u64,
    /// Tokens a recompute would re-run.
    pub recompute_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_pool_allocates_low_ids_first_and_checks() {
        let mut p = HostPool::new(3).unwrap();
        assert_eq!(p.allocate().unwrap(), 0);
        assert_eq!(p.allocate().unwrap(), 1);
        assert_eq!(p.num_free(), 1);
        p.incref(1);
        assert_eq!(p.decref(1).unwrap(), 1);
        assert_eq!(p.decref(1).unwrap(), 0);
        p.release(1);
        assert!(p.check_invariants().is_ok());
        assert_eq!(p.decref(1), Err(Error::RefcountUnderflow { block: 1 }));
        assert_eq!(p.allocate().unwrap(), 1);
        assert_eq!(p.allocate().unwrap(), 2);
        assert!(matches!(p.allocate(), Err(Error::OutOfHostBlocks { .. })));
        assert!(HostPool::new(0).unwrap().check_invariants().is_ok());
    }

    #[test]
    fn cost_model_validates_and_computes() {
        let m = CostModel {
            host_link_bytes_per_s: 1e9,
            prefill_tokens_per_s: 1e4,
            kv_bytes_per_token: 1e3,
        };
        m.validate().unwrap();
        // 10 blocks of 16 tokens: 160 tokens × 1 kB × 2 / 1 GB/s = 320 µs.
        assert!((m.swap_cost(10, 16) - 320e-6).abs() < 1e-12);
        assert!((m.recompute_cost(100) - 0.01).abs() < 1e-12);
        let bad = CostModel {
            prefill_tokens_per_s: 0.0,
            ..m
        };
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidArgument {
                what: "prefill_tokens_per_s",
                ..
            })
        ));
        let nan = CostModel {
            kv_bytes_per_token: f64::NAN,
            ..m
        };
        assert!(nan.validate().is_err());
    }
}
