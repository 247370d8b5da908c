//! Cheap counters, readable at any time.
//!
//! The manager keeps plain `u64` counters ([`Counters`]) bumped on the paths that change them;
//! `BlockManager::stats` assembles a [`Stats`] snapshot from them plus a few sizes, and one pass over
//! the live sequences for the histogram. Nothing here is on a per-token path beyond an addition.

/// Number of buckets of [`Stats::blocks_per_seq`].
pub const HIST_BUCKETS: usize = 16;

/// Histogram bucket of a sequence holding `blocks` blocks: bucket 0 holds 0–1 blocks, bucket
/// `k ≥ 1` holds `(2^(k-1), 2^k]`, and the last bucket everything above `2^(HIST_BUCKETS-2)`.
#[inline]
pub fn hist_bucket(blocks: usize) -> usize {
    if blocks <= 1 {
        0
    } else {
        let k = (usize::BITS - (blocks - 1).leading_zeros()) as usize; // ceil(log2(blocks))
        k.min(HIST_BUCKETS - 1)
    }
}

/// Event counters kept by the manager.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache (every admission with caching on).
    pub prefix_query_tokens: u64,
    /// Of those, tokens served from cached blocks.
    pub prefix_hit_tokens: u64,
    /// Cached-free blocks evicted to satisfy an allocation.
    pub evictions: u64,
    /// Copy-on-write block copies queued.
    pub cow_copies: u64,
    /// Verify mode: hash hits whose cached token ids differed (served as misses).
    pub prefix_collisions: u64,
    /// Sequences preempted by swap-out.
    pub preemptions_swap: u64,
    /// Running sequences preempted by recompute.
    pub preemptions_recompute: u64,
    /// Device → host block copies queued by swap-outs.
    pub swapped_out_blocks: u64,
    /// Host → device block copies queued by swap-ins.
    pub swapped_in_blocks: u64,
    /// Prompt tokens served from the host tier (loaded instead of computed).
    pub host_hit_tokens: u64,
    /// Host → device block loads queued by admissions hitting the host tier.
    pub host_loaded_blocks: u64,
    /// Device → host copies queued to keep an evicted (write-back) or registered (write-through)
    /// block in the host tier.
    pub offloaded_blocks: u64,
    /// Host-cached blocks evicted from the host tier to make room (handed to the engine).
    pub demotions: u64,
}

/// A snapshot of the manager's state and counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Blocks in the pool.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Blocks on the free list (never cached or dropped from the cache).
    pub free_blocks: u64,
    /// Refcount-0 blocks kept for their cached content; reusable (evictable) on demand.
    pub cached_free_blocks: u64,
    /// Blocks neither free nor cached-free: held by a sequence, or by a pending copy.
    pub used_blocks: u64,
    /// Live sequences.
    pub num_seqs: u64,
    /// Sum of sequence lengths (a shared block counts for every sequence holding it).
    pub used_tokens: u64,
    /// `used_tokens / (num_blocks * block_size)`; can exceed 1 with sharing.
    pub kv_utilization: f64,
    /// `used_blocks * block_size`: slots set aside, partly filled tail blocks included.
    pub allocated_token_slots: u64,
    /// Prompt tokens looked up in the prefix cache (every admission with caching on).
    pub prefix_query_tokens: u64,
    /// Of those, tokens served from cached blocks.
    pub prefix_hit_tokens: u64,
    /// `prefix_hit_tokens / prefix_query_tokens` (0 before any query).
    pub prefix_hit_ratio: f64,
    /// Cached-free blocks evicted to satisfy an allocation.
    pub evictions: u64,
    /// Verify mode: hash hits whose cached token ids differed (served as misses).
    pub prefix_collisions: u64,
    /// Blocks with refcount > 1.
    pub shared_blocks: u64,
    /// Copy-on-write block copies queued.
    pub cow_copies: u64,
    /// Preemptions of either mode (`preemptions_swap + preemptions_recompute`), counted per
    /// sequence (a forked group of three preempted together counts three).
    pub preemptions: u64,
    /// Sequences swapped out.
    pub preemptions_swap: u64,
    /// Running sequences preempted by recompute.
    pub preemptions_recompute: u64,
    /// Device → host block copies queued so far (one per block, a block shared in a group once).
    pub swapped_out_blocks: u64,
    /// Host → device block copies queued so far.
    pub swapped_in_blocks: u64,
    /// Prompt tokens served from the host tier (also counted in `prefix_hit_tokens`).
    pub host_hit_tokens: u64,
    /// Host → device block loads queued by admissions hitting the host tier.
    pub host_loaded_blocks: u64,
    /// Device → host copies queued to keep cached blocks in the host tier.
    pub offloaded_blocks: u64,
    /// Host-cached blocks evicted from the host tier to make room.
    pub demotions: u64,
    /// Host blocks indexed in the host tier (host usage by the cache).
    pub host_cached_blocks: u64,
    /// Blocks of the host pool.
    pub num_host_blocks: u64,
    /// Free blocks of the host pool.
    pub host_free_blocks: u64,
    /// Sequences swapped out now.
    pub swapped_seqs: u64,
    /// `used_blocks / num_blocks`, cached-free blocks counted as free (vLLM's KV cache usage).
    pub kv_cache_usage: f64,
    /// Sequences per block-count bucket; see [`hist_bucket`].
    pub blocks_per_seq: [u64; HIST_BUCKETS],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_power_of_two_ranges() {
        assert_eq!(hist_bucket(0), 0);
        assert_eq!(hist_bucket(1), 0);
        assert_eq!(hist_bucket(2), 1);
        assert_eq!(hist_bucket(3), 2);
        assert_eq!(hist_bucket(4), 2);
        assert_eq!(hist_bucket(5), 3);
        assert_eq!(hist_bucket(8), 3);
        assert_eq!(hist_bucket(9), 4);
        assert_eq!(hist_bucket(1 << 14), 14);
        assert_eq!(hist_bucket((1 << 14) + 1), 15);
        assert_eq!(hist_bucket(usize::MAX), 15);
    }
}
