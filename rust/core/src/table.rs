//! One sequence's block table and token count.
//!
//! Logical token `t` of a sequence lives in physical slot `blocks[t / B] * B + t % B`.
//! Invariant (kept by the manager): `blocks.len() == ceil(num_tokens / B)` — a block is allocated
//! when a token first needs it, never ahead of time, so a table wastes at most `B - 1` slots.
//! Block ids are below `i32::MAX` (the manager's config guarantees it), so a table can be handed to
//! kernels as `i32` without conversion.

use crate::BlockId;

/// Blocks needed to hold `num_tokens` tokens in blocks of `block_size`.
#[inline]
pub fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

/// A block table: physical block ids in logical order, and the number of tokens they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) num_tokens: usize,
}

impl BlockTable {
    /// The physical block ids, in logical order.
    #[inline]
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of tokens held.
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Number of blocks held.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The blocks as `i32`, the element type kernels read.
    #[inline]
    pub fn blocks_i32(&self) -> &[i32] {
        as_i32(&self.blocks)
    }

    /// Physical slot of logical token `pos` (`pos < num_tokens`).
    #[inline]
    pub fn slot(&self, pos: usize, block_size: usize) -> i64 {
        self.blocks[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64
    }

    /// Tokens in the last block, `((len - 1) % B) + 1`; 0 for an empty table.
    #[inline]
    pub fn last_page_len(&self, block_size: usize) -> usize {
        if self.num_tokens == 0 {
            0
        } else {
            (self.num_tokens - 1) % block_size + 1
        }
    }

    /// Blocks that `extra` more tokens would add to this table.
    #[inline]
    pub fn blocks_to_grow(&self, extra: usize, block_size: usize) -> usize {
        blocks_for(self.num_tokens + extra, block_size) - self.blocks.len()
    }

    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.num_tokens = 0;
    }
}

/// Reinterprets block ids as `i32`.
///
/// Every block id the manager hands out is below `i32::MAX` (checked by `ManagerConfig::validate`),
/// so the values are unchanged by the reinterpretation.
#[inline]
pub fn as_i32(ids: &[BlockId]) -> &[i32] {
    // SAFETY: u32 and i32 have the same size and alignment and every bit pattern is valid for both.
    unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<i32>(), ids.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_for_rounds_up() {
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(1, 16), 1);
        assert_eq!(blocks_for(16, 16), 1);
        assert_eq!(blocks_for(17, 16), 2);
        assert_eq!(blocks_for(5, 1), 5);
    }

    #[test]
    fn slots_and_last_page() {
        let t = BlockTable {
            blocks: vec![7, 2, 9],
            num_tokens: 33,
        };
        assert_eq!(t.slot(0, 16), 7 * 16);
        assert_eq!(t.slot(15, 16), 7 * 16 + 15);
        assert_eq!(t.slot(16, 16), 2 * 16);
        assert_eq!(t.slot(32, 16), 9 * 16);
        assert_eq!(t.last_page_len(16), 1);
        assert_eq!(t.blocks_to_grow(15, 16), 0);
        assert_eq!(t.blocks_to_grow(16, 16), 1);
        assert_eq!(t.blocks_i32(), &[7, 2, 9]);
        let full = BlockTable {
            blocks: vec![1, 2],
            num_tokens: 32,
        };
        assert_eq!(full.last_page_len(16), 16);
        assert_eq!(full.blocks_to_grow(1, 16), 1);
        assert_eq!(BlockTable::default().last_page_len(16), 0);
    }
}
