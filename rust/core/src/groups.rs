//! KV cache groups: the attention kinds a manager's groups can have, which KV positions a query
//! reads under each, and the sizing arithmetic built on that.
//!
//! A model's layers of one attention kind form a group. A sequence has one block table per group,
//! all of the same logical length (`ceil(num_tokens / B)` entries), and every group draws on the
//! manager's one pool of uniform pages. A page belongs to one group at a time, so a page id is
//! meaningful to whichever group holds it; copies and swaps are per page and group-agnostic.
//!
//! # What a query reads
//!
//! A query at position `p` reads the keys in `[first_needed(p), p]`:
//! - [`AttentionKind::Full`]: `first_needed(p) = 0`;
//! - [`AttentionKind::Sliding`] `{ window: W }`: `first_needed(p) = max(0, p - W + 1)` — the `W`
//!   most recent positions, the query's own included (the Mistral / Gemma / gpt-oss convention);
//! - [`AttentionKind::Chunked`] `{ chunk: C }`: `first_needed(p) = floor(p / C) * C` — the
//!   positions of the query's own chunk up to itself (Llama 4's local layers).
//!
//! `first_needed` is non-decreasing in `p`.
//!
//! # When a block is dead
//!
//! Let `c` be the first position the step being built computes (`len - num_new` for its
//! sequence): every later query has `p >= c`, so reads only positions `>= first_needed(c)`. Block
//! `i` covers `[i * B, (i + 1) * B)`; it is **dead** once `(i + 1) * B <= first_needed(c)`, i.e.
//! the first [`dead_blocks`]`(kind, c, B) = floor(first_needed(c) / B)` blocks are dead. For a
//! sliding group that is `(i + 1) * B + W - 1 <= c`: a block is released once its last position
//! is `W` or more positions behind the first one still to be computed. Dead blocks always form a
//! prefix of the table; the manager releases them when the step is built and leaves
//! [`NULL_BLOCK`] in their entries, so logical indices stay stable.
//!
//! # Sizing
//!
//! [`live_blocks`] is the exact number of non-null entries of a group's table after a step of
//! `num_new` tokens on a sequence of `len` tokens; [`peak_decode_blocks`] its maximum over a
//! decode run up to a given length, the per-sequence need a capacity plan uses:
//! - full: `ceil(L / B)`;
//! - sliding: `min(ceil(L / B), ceil((W - 1) / B) + 1)` — `W` consecutive positions starting
//!   anywhere in a block span at most `ceil((W + B - 1) / B)` blocks;
//! - chunked: `min(ceil(L / B), ceil((C + B - g) / B))` with `g = gcd(B, C)` — a chunk starts at an
//!   offset into its block that is a multiple of `g`, at most `B - g`. This is an upper bound,
//!   exact once `L` reaches a chunk starting at that offset.

use crate::error::{Error, Result};
use crate::BlockId;

/// The entry a group's block table holds for a released (dead) block: `-1` once read as `i32`.
/// Never a valid block id (ids are below `i32::MAX`); kernels must not read it, and never need
/// to, since no query reads a dead position.
pub const NULL_BLOCK: BlockId = u32::MAX;

/// The attention kind of a KV cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every query reads every earlier position.
    Full,
    /// A query at `p` reads `[p - window + 1, p]`.
    Sliding {
        /// Positions read, the query's own included (>= 1).
        window: u32,
    },
    /// A query at `p` reads from the start of its chunk, `floor(p / chunk) * chunk`, to `p`.
    Chunked {
        /// Chunk length in tokens (>= 1).
        chunk: u32,
    },
}

impl AttentionKind {
    /// The first position a query at `p` reads.
    #[inline]
    pub fn first_needed(self, p: usize) -> usize {
        match self {
            AttentionKind::Full => 0,
            AttentionKind::Sliding { window } => (p + 1).saturating_sub(window as usize),
            AttentionKind::Chunked { chunk } => p / chunk as usize * chunk as usize,
        }
    }

    /// Whether the kind ever releases blocks (every kind but `Full`).
    #[inline]
    pub fn is_windowed(self) -> bool {
        !matches!(self, AttentionKind::Full)
    }

    /// `InvalidConfig` for a window or chunk of 0.
    pub fn validate(self, group: usize) -> Result<()> {
        let bad = |what: &str| {
            Err(Error::InvalidConfig {
                field: "groups",
                value: group as u64,
                reason: format!("group {group}: a {what} of 0 tokens (must be >= 1)"),
            })
        };
        match self {
            AttentionKind::Sliding { window: 0 } => bad("sliding window"),
            AttentionKind::Chunked { chunk: 0 } => bad("chunk"),
            _ => Ok(()),
        }
    }
}

/// Leading blocks of a table that no query at a position `>= c` reads:
/// `floor(first_needed(c) / block_size)`.
#[inline]
pub fn dead_blocks(kind: AttentionKind, c: usize, block_size: usize) -> usize {
    kind.first_needed(c) / block_size
}

/// The first position `c` from which the first `blocks` blocks of a table are dead (`c` with
/// `first_needed(c) >= blocks * B`); `usize::MAX` for a full group, which releases nothing. A
/// manager compares the step's first position with this instead of dividing every step.
#[inline]
pub fn release_threshold(kind: AttentionKind, blocks: usize, block_size: usize) -> usize {
    let pos = blocks * block_size;
    match kind {
        AttentionKind::Full => usize::MAX,
        AttentionKind::Sliding { window } => pos + window as usize - 1,
        AttentionKind::Chunked { chunk } => pos.div_ceil(chunk as usize) * chunk as usize,
    }
}

/// Non-null entries of a group's table once a step computing the last `num_new` of `len` tokens
/// is built (`1 <= num_new <= len`): `ceil(len / B) - dead_blocks(len - num_new)`.
pub fn live_blocks(kind: AttentionKind, len: usize, num_new: usize, block_size: usize) -> usize {
    let c = len - num_new.clamp(1, len.max(1));
    len.div_ceil(block_size) - dead_blocks(kind, c, block_size)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Most non-null entries a group's table holds over a decode run (one token per step) up to
/// `max_len` tokens: the per-sequence block need of the group at that context (see the module
/// documentation for the formulas). Exact for full and sliding groups; an upper bound for
/// chunked ones (exact once a chunk starting at the worst offset is reached).
pub fn peak_decode_blocks(kind: AttentionKind, max_len: usize, block_size: usize) -> usize {
    let b = block_size;
    let all = max_len.div_ceil(b);
    match kind {
        AttentionKind::Full => all,
        AttentionKind::Sliding { window } => all.min((window as usize - 1).div_ceil(b) + 1),
        AttentionKind::Chunked { chunk } => {
            let c = chunk as usize;
            all.min((c + b - gcd(b, c)).div_ceil(b))
        }
    }
}

/// KV bytes one token takes in one layer group: `2 (K and V) * kv_heads * head_dim * dtype_bytes
/// * layers`.
pub fn bytes_per_token(kv_heads: usize, head_dim: usize, dtype_bytes: usize, layers: usize) -> u64 {
    2 * kv_heads as u64 * head_dim as u64 * dtype_bytes as u64 * layers as u64
}

/// Bytes of one uniform page shared by all groups: a block of `block_size` tokens for the group
/// with the most bytes per token (the others' pages are sized to it).
pub fn page_bytes(group_bytes_per_token: &[u64], block_size: usize) -> u64 {
    group_bytes_per_token.iter().copied().max().unwrap_or(0) * block_size as u64
}

/// The prefix-cache key of group `g`'s block whose chained hash is `h`: `h` itself for group 0
/// (a one-group manager keys exactly as before), `h` mixed with the group index otherwise. The
/// mix is a bijection for each `g`, so distinct hashes stay distinct within a group.
#[inline]
pub fn group_hash(h: u128, g: usize) -> u128 {
    if g == 0 {
        h
    } else {
        h ^ (g as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
    }
}

/// The chained hash `h` whose group-`g` key is `key`: the inverse of [`group_hash`] for that
/// group (a KV event names a block by `h` and its group, not by the cache key).
#[inline]
pub fn group_unhash(key: u128, g: usize) -> u128 {
    // The mix is an XOR with a per-group constant: its own inverse.
    group_hash(key, g)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute_peak(kind: AttentionKind, max_len: usize, b: usize) -> usize {
        (1..=max_len)
            .map(|l| live_blocks(kind, l, 1, b))
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn first_needed_conventions() {
        let s = AttentionKind::Sliding { window: 4 };
        assert_eq!(s.first_needed(0), 0);
        assert_eq!(s.first_needed(3), 0);
        assert_eq!(s.first_needed(4), 1);
        let c = AttentionKind::Chunked { chunk: 8 };
        assert_eq!(c.first_needed(7), 0);
        assert_eq!(c.first_needed(8), 8);
        assert_eq!(AttentionKind::Full.first_needed(1000), 0);
    }

    #[test]
    fn release_threshold_is_the_first_dead_position() {
        for b in [1usize, 3, 4, 16] {
            for w in 1..30u32 {
                for kind in [
                    AttentionKind::Sliding { window: w },
                    AttentionKind::Chunked { chunk: w },
                ] {
                    for j in 1..6 {
                        let c = release_threshold(kind, j, b);
                        assert!(dead_blocks(kind, c, b) >= j, "{kind:?} B={b} j={j}");
                        assert!(dead_blocks(kind, c - 1, b) < j, "{kind:?} B={b} j={j}");
                    }
                }
            }
        }
        assert_eq!(release_threshold(AttentionKind::Full, 3, 16), usize::MAX);
    }

    #[test]
    fn dead_blocks_off_by_one() {
        // B = 4, W = 4: block 0 covers [0, 4); a query at p reads [p - 3, p]. At c = 6 the first
        // read position is 3 (block 0 still live); at c = 7 it is 4 (block 0 dead).
        let s = AttentionKind::Sliding { window: 4 };
        assert_eq!(dead_blocks(s, 6, 4), 0);
        assert_eq!(dead_blocks(s, 7, 4), 1);
        assert_eq!(dead_blocks(s, 10, 4), 1);
        assert_eq!(dead_blocks(s, 11, 4), 2);
    }

    #[test]
    fn peaks_match_brute_force() {
        for b in [1usize, 3, 4, 16] {
            for w in 1..40u32 {
                for l in [1usize, 5, 17, 64, 130] {
                    let s = AttentionKind::Sliding { window: w };
                    assert_eq!(
                        peak_decode_blocks(s, l, b),
                        brute_peak(s, l, b),
                        "W={w} B={b} L={l}"
                    );
                    let c = AttentionKind::Chunked { chunk: w };
                    assert!(peak_decode_blocks(c, l, b) >= brute_peak(c, l, b));
                    // Exact once the run covers every chunk offset (lcm(B, C) plus a chunk).
                    let lcm = b * w as usize / gcd(b, w as usize);
                    let long = lcm + w as usize;
                    assert_eq!(
                        peak_decode_blocks(c, long, b),
                        brute_peak(c, long, b),
                        "C={w} B={b}"
                    );
                }
            }
        }
        assert_eq!(peak_decode_blocks(AttentionKind::Full, 33, 16), 3);
        // gpt-oss: 128-token window in 16-token blocks: 9 blocks.
        assert_eq!(
            peak_decode_blocks(AttentionKind::Sliding { window: 128 }, 100_000, 16),
            9
        );
    }

    #[test]
    fn zero_window_or_chunk_is_refused() {
        assert!(AttentionKind::Sliding { window: 0 }.validate(1).is_err());
        assert!(AttentionKind::Chunked { chunk: 0 }.validate(2).is_err());
        assert!(AttentionKind::Sliding { window: 1 }.validate(1).is_ok());
    }

    #[test]
    fn group_hash_keeps_group_zero() {
        assert_eq!(group_hash(42, 0), 42);
        assert_ne!(group_hash(42, 1), 42);
        assert_ne!(group_hash(42, 1), group_hash(42, 2));
        for g in 0..64 {
            assert_eq!(
                group_unhash(group_hash(0xDEAD_BEEF << 70, g), g),
                0xDEAD_BEEF << 70
            );
        }
        assert_eq!(bytes_per_token(8, 64, 2, 12), 2 * 8 * 64 * 2 * 12);
        assert_eq!(page_bytes(&[10, 30, 20], 16), 480);
    }
}
