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

    /// Gives refcount-0 block `h`, which is not on the free list (a host-cached block leaving the
    /// host tier), refcount 1.
    #[inline]
    pub(crate) fn claim(&mut self, h: HostBlockId) {
        debug_assert_eq!(self.refcount[h as usize], 0);
        self.refcount[h as usize] = 1;
    }

    /// Puts a refcount-0 block back on the free list.
    #[inline]
    pub(crate) fn release(&mut self, h: HostBlockId) {
        debug_assert_eq!(self.refcount[h as usize], 0);
        self.free.push(h);
    }

    /// The free list is exactly the refcount-0 blocks, each once.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.check_invariants_parked(|_| false)
    }

    /// [`HostPool::check_invariants`] where the refcount-0 blocks `parked` names (the host
    /// tier's LRU) are off the free list.
    pub fn check_invariants_parked(
        &self,
        parked: impl Fn(HostBlockId) -> bool,
    ) -> std::result::Result<(), String> {
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
            if (rc == 0 && !parked(h as HostBlockId)) != f {
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
///
/// A step is modelled as costing `max(step_floor_s, tokens / prefill_tokens_per_s)`: below the
/// knee a step is bound by what it pays whatever it carries (launch overhead, reading the
/// weights), so prefill tokens folded into a step that runs anyway cost nothing until the step
/// turns compute-bound. A recompute is re-admitted and prefilled beside the running decodes, so
/// its cost is what its chunks add to those steps; with `step_floor_s = 0` and
/// `max_step_tokens = 0` this is the plain `tokens / prefill_tokens_per_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Host ↔ device copy bandwidth, bytes per second (one direction).
    pub host_link_bytes_per_s: f64,
    /// Prefill throughput, tokens per second, once a step is compute-bound.
    pub prefill_tokens_per_s: f64,
    /// KV bytes of one token over all layers (`2 × kv_heads × head_dim × dtype bytes × layers`).
    pub kv_bytes_per_token: f64,
    /// Seconds a step costs however few tokens it carries; 0 makes every token cost
    /// `1 / prefill_tokens_per_s`.
    pub step_floor_s: f64,
    /// Most tokens one step carries (the scheduler's token budget), so a long recompute is split
    /// into chunks that each ride a step; 0 = no limit.
    pub max_step_tokens: u64,
}

impl CostModel {
    /// A linear model (no step floor, no chunking) from the three rates.
    pub fn new(
        host_link_bytes_per_s: f64,
        prefill_tokens_per_s: f64,
        kv_bytes_per_token: f64,
    ) -> Self {
        CostModel {
            host_link_bytes_per_s,
            prefill_tokens_per_s,
            kv_bytes_per_token,
            step_floor_s: 0.0,
            max_step_tokens: 0,
        }
    }

    /// Every rate finite and > 0 and the floor finite and ≥ 0, else `InvalidArgument` naming it.
    pub fn validate(&self) -> Result<()> {
        for (what, v, zero_ok) in [
            ("host_link_bytes_per_s", self.host_link_bytes_per_s, false),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s, false),
            ("kv_bytes_per_token", self.kv_bytes_per_token, false),
            ("step_floor_s", self.step_floor_s, true),
        ] {
            if !(v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0))) {
                let bound = if zero_ok { ">= 0" } else { "> 0" };
                return Err(Error::InvalidArgument {
                    what,
                    value: if v.is_finite() { v as i64 } else { -1 },
                    reason: format!("must be a finite number {bound}, got {v}"),
                });
            }
        }
        Ok(())
    }

    /// Seconds to swap `blocks` blocks of `block_size` tokens out and back in.
    pub fn swap_cost(&self, blocks: u64, block_size: u64) -> f64 {
        2.0 * (blocks * block_size) as f64 * self.kv_bytes_per_token / self.host_link_bytes_per_s
    }

    /// Seconds one step carrying `tokens` tokens costs (`max(floor, tokens / rate)`).
    pub fn step_cost(&self, tokens: u64) -> f64 {
        self.step_floor_s
            .max(tokens as f64 / self.prefill_tokens_per_s)
    }

    /// Seconds recomputing `tokens` tokens adds when each step also carries `batch_tokens`
    /// tokens of other work (the running decodes; 0 when nothing else runs, so every chunk pays
    /// a whole step). The prefill is cut into chunks of the room a step has left beside them.
    pub fn recompute_cost(&self, tokens: u64, batch_tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let room = if self.max_step_tokens == 0 {
            tokens
        } else {
            self.max_step_tokens.saturating_sub(batch_tokens).max(1)
        };
        let base = if batch_tokens == 0 {
            0.0
        } else {
            self.step_cost(batch_tokens)
        };
        let added = |chunk: u64| self.step_cost(batch_tokens + chunk) - base;
        let (full, rest) = (tokens / room, tokens % room);
        full as f64 * added(room) + if rest > 0 { added(rest) } else { 0.0 }
    }
}

/// The cost model's verdict for one victim, with both estimates so a scheduler can log why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The cheaper mode (recompute when the host pool has no room for a swap).
    pub mode: PreemptMode,
    /// 2 × the victim's KV bytes (distinct device blocks of every KV cache group, whole blocks) /
    /// host-link bandwidth.
    pub swap_cost_s: f64,
    /// Tokens to recompute after the prefix hits that would survive (summed over the branches of
    /// a forked group) / prefill throughput.
    pub recompute_cost_s: f64,
    /// Whether the host pool has room for the swap now; when not, the mode is recompute.
    pub swap_possible: bool,
    /// Distinct device blocks a swap would copy (summed over the KV cache groups).
    pub swap_blocks: u64,
    /// Tokens a recompute would re-run.
    pub recompute_tokens: u64,
    /// Tokens of other work each step was assumed to carry beside the recompute.
    pub batch_tokens: u64,
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
        let m = CostModel::new(1e9, 1e4, 1e3);
        m.validate().unwrap();
        // 10 blocks of 16 tokens: 160 tokens × 1 kB × 2 / 1 GB/s = 320 µs.
        assert!((m.swap_cost(10, 16) - 320e-6).abs() < 1e-12);
        assert!((m.recompute_cost(100, 0) - 0.01).abs() < 1e-12);
        assert!((m.recompute_cost(100, 32) - 0.01).abs() < 1e-12);
        assert_eq!(m.recompute_cost(0, 0), 0.0);
        let neg = CostModel {
            step_floor_s: -1.0,
            ..m
        };
        assert!(matches!(
            neg.validate(),
            Err(Error::InvalidArgument {
                what: "step_floor_s",
                ..
            })
        ));
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

    #[test]
    fn step_floor_absorbs_tokens_and_chunks_pay_per_step() {
        // 10 ms floor at 10k tokens/s: a step is free up to 100 tokens.
        let m = CostModel {
            step_floor_s: 0.010,
            max_step_tokens: 200,
            ..CostModel::new(1e9, 1e4, 1e3)
        };
        m.validate().unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Beside 20 decode tokens, 80 more tokens fit under the floor: free.
        assert!(close(m.recompute_cost(80, 20), 0.0));
        // 180 tokens: one chunk, the step grows from 10 ms to 20 ms.
        assert!(close(m.recompute_cost(180, 20), 0.010));
        // 400 tokens: chunks of 180, 180, 40 → 10 + 10 + 0 ms.
        assert!(close(m.recompute_cost(400, 20), 0.020));
        // Nothing else runs: every chunk pays a whole step (200 + 200 + 10 tokens).
        assert!(close(m.recompute_cost(410, 0), 0.020 + 0.020 + 0.010));
        // A batch that fills the budget leaves room for one token a step.
        assert!(close(m.recompute_cost(3, 500), 3.0 * 1e-4));
    }
}
