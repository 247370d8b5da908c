//! The plan of one transfer of the vLLM offloading tier's copier (`pagedkv.vllm.offload_copy`):
//! KV blocks of one or more KV cache groups moving between GPU blocks and host chunks, split into
//! the pieces that go through the copier's device staging slots.
//!
//! Owns [`split_transfer`] and its result [`TransferSplit`]. A transfer names GPU block ids, per
//! group how many ([`TransferShape`]'s groups, in order) and the logical index of the group's
//! first block in its request (a group's first chunk may be entered `index % blocks_per_chunk`
//! sub-blocks in), and the host chunk ids, group after group: block `i` of a group sits in chunk
//! `chunk_ids[c0 + (skip + i) / bpc]`, sub-block `(skip + i) % bpc`, where `c0` counts the chunks
//! of the groups before it and `skip = index % bpc`.
//!
//! The split: the transfer's distinct chunks in ascending order; piece `p` is chunks
//! `[p * piece, (p + 1) * piece)` of that order, and row `r` of its staging slot is chunk
//! `chunks[p * piece + r]`. A *run* is a range of consecutive chunk ids inside one piece (one DMA
//! between the slot and the host pool); an *entry* is one block of a group with tensors (one
//! kernel program row): `(GPU block, row in its piece's slot, sub-block)`, written into the
//! caller's buffer as three rows of `n` values, sorted by (piece, group), stable; a *span* is one
//! (group, piece)'s range of entries.
//!
//! Invariants: the whole transfer is validated before anything is written, so an error leaves the
//! caller's buffer untouched; every block of a group with tensors is one entry; the runs cover
//! the chunks once, in order; each piece's spans and runs are contiguous and in piece order.
//! Costs O(n log n) for the sort of the chunk ids and O(n) otherwise, with no allocation beyond
//! the result (the copier calls this once per transfer, before the first DMA).

use crate::error::{Error, Result};

/// The copier's fixed dimensions a transfer is checked against.
#[derive(Clone, Copy, Debug)]
pub struct TransferShape<'a> {
    /// GPU blocks in each KV cache tensor.
    pub num_blocks: u64,
    /// Chunks in the host pool.
    pub num_chunks: u64,
    /// GPU blocks per chunk (>= 1).
    pub blocks_per_chunk: u64,
    /// Per KV cache group, whether it has tensors (a group without any moves no bytes, but its
    /// chunks still belong to the transfer).
    pub tabled: &'a [bool],
}

/// One transfer split into pieces (module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferSplit {
    /// The distinct chunk ids, ascending.
    pub chunks: Vec<u64>,
    /// Per run: its first chunk id, its first row in its piece's slot, its chunk count.
    pub runs: Vec<[u64; 3]>,
    /// Piece `p`'s runs are `runs[run_edges[p]..run_edges[p + 1]]` (`pieces + 1` values).
    pub run_edges: Vec<u32>,
    /// Per span: its group, and its entries `[start, end)`.
    pub spans: Vec<[u32; 3]>,
    /// Piece `p`'s spans are `spans[span_edges[p]..span_edges[p + 1]]` (`pieces + 1` values).
    pub span_edges: Vec<u32>,
    /// Entries written (each of the buffer's three rows holds `entries` values).
    pub entries: usize,
}

impl TransferSplit {
    /// The number of pieces.
    pub fn pieces(&self) -> usize {
        self.run_edges.len().saturating_sub(1)
    }
}

fn invalid(what: &'static str, value: u64, reason: String) -> Error {
    Error::InvalidArgument {
        what,
        value: i64::try_from(value).unwrap_or(i64::MAX),
        reason,
    }
}

/// `InvalidArgument` for the first id of `ids` at or past `limit`.
fn in_range(ids: &[u64], limit: u64, what: &'static str, noun: &str, holds: &str) -> Result<()> {
    match ids.iter().find(|&&v| v >= limit) {
        None => Ok(()),
        Some(&v) => Err(invalid(
            what,
            v,
            format!("{noun} {v} out of range: {holds} {limit}"),
        )),
    }
}

/// Checks one transfer whole and splits it into pieces of at most `piece` chunks, writing its
/// entries into `out` (`[blocks | rows | sub-blocks]`, each `entries` long, so `out` needs
/// `3 * block_ids.len()` values at most). See the module docs for the layout.
///
/// # Errors
/// `InvalidArgument` naming `group_sizes` (not one per group, or not adding up to the block
/// count), `block_ids` (an id out of range), `chunk_ids` (an id out of range, too few chunks for
/// a group's blocks, or chunks the blocks do not fill), `piece` or `blocks_per_chunk` (zero) or
/// `out` (too short); nothing is written then.
pub fn split_transfer(
    shape: &TransferShape<'_>,
    block_ids: &[u64],
    group_sizes: &[u64],
    block_indices: &[u64],
    chunk_ids: &[u64],
    piece: usize,
    out: &mut [i64],
) -> Result<TransferSplit> {
    let groups = shape.tabled.len();
    let bpc = shape.blocks_per_chunk;
    if group_sizes.len() != groups || block_indices.len() != groups {
        return Err(invalid(
            "group_sizes",
            group_sizes.len() as u64,
            format!(
                "{} group sizes and {} block indices: one per KV cache group ({groups})",
                group_sizes.len(),
                block_indices.len()
            ),
        ));
    }
    let total = group_sizes
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .unwrap_or(u64::MAX);
    if total != block_ids.len() as u64 {
        return Err(invalid(
            "group_sizes",
            total,
            format!(
                "the group sizes add up to {total}, {} blocks given: must add up to the block \
                 count",
                block_ids.len()
            ),
        ));
    }
    if piece == 0 {
        return Err(invalid("piece", 0, "must be >= 1".into()));
    }
    if bpc == 0 {
        return Err(invalid("blocks_per_chunk", 0, "must be >= 1".into()));
    }
    in_range(
        block_ids,
        shape.num_blocks,
        "block_ids",
        "GPU block",
        "the KV cache holds",
    )?;
    in_range(
        chunk_ids,
        shape.num_chunks,
        "chunk_ids",
        "host chunk",
        "the host pool holds",
    )?;
    // Each group's chunk range, and the entry count.
    let mut c0 = 0u64;
    let mut entries = 0usize;
    for g in 0..groups {
        let n = group_sizes[g];
        if n == 0 {
            continue;
        }
        let skip = block_indices[g] % bpc;
        let nc = (skip + n).div_ceil(bpc);
        if c0 + nc > chunk_ids.len() as u64 {
            return Err(invalid(
                "chunk_ids",
                chunk_ids.len() as u64,
                format!(
                    "group {g} needs {nc} chunks from chunk {c0}; {} given",
                    chunk_ids.len()
                ),
            ));
        }
        c0 += nc;
        if shape.tabled[g] {
            entries += n as usize;
        }
    }
    if c0 != chunk_ids.len() as u64 {
        return Err(invalid(
            "chunk_ids",
            chunk_ids.len() as u64,
            format!(
                "{} chunks given, the blocks fill {c0}: one chunk per block run",
                chunk_ids.len()
            ),
        ));
    }
    if out.len() < 3 * entries {
        return Err(invalid(
            "out",
            out.len() as u64,
            format!("needs {} values for {entries} entries", 3 * entries),
        ));
    }

    // The distinct chunks, ascending.
    let mut chunks = chunk_ids.to_vec();
    chunks.sort_unstable();
    chunks.dedup();
    let pieces = chunks.len().div_ceil(piece);

    // Runs: consecutive ids, cut at piece edges.
    let mut runs: Vec<[u64; 3]> = Vec::new();
    let mut run_edges = Vec::with_capacity(pieces + 1);
    for (i, &c) in chunks.iter().enumerate() {
        if i % piece == 0 {
            run_edges.push(runs.len() as u32);
        }
        match runs.last_mut() {
            Some(r) if i % piece != 0 && r[0] + r[2] == c => r[2] += 1,
            _ => runs.push([c, (i % piece) as u64, 1]),
        }
    }
    run_edges.push(runs.len() as u32);

    // Entries: counted per (piece, group) key, then placed stably.
    let keys = pieces * groups;
    let mut start = vec![0u32; keys + 1];
    let rank = |c: u64| chunks.binary_search(&c).unwrap_or(0);
    let each = |f: &mut dyn FnMut(usize, u64, usize, u64)| {
        let (mut b0, mut c0) = (0usize, 0usize);
        for g in 0..groups {
            let n = group_sizes[g] as usize;
            if n == 0 {
                continue;
            }
            let skip = (block_indices[g] % bpc) as usize;
            let bpcu = bpc as usize;
            if shape.tabled[g] {
                for i in 0..n {
                    let logical = skip + i;
                    f(
                        g,
                        block_ids[b0 + i],
                        rank(chunk_ids[c0 + logical / bpcu]),
                        (logical % bpcu) as u64,
                    );
                }
            }
            b0 += n;
            c0 += (skip + n).div_ceil(bpcu);
        }
    };
    each(&mut |g, _, r, _| start[(r / piece) * groups + g + 1] += 1);
    for k in 0..keys {
        start[k + 1] += start[k];
    }
    let mut spans = Vec::new();
    let mut span_edges = Vec::with_capacity(pieces + 1);
    for p in 0..pieces {
        span_edges.push(spans.len() as u32);
        for g in 0..groups {
            let (a, z) = (start[p * groups + g], start[p * groups + g + 1]);
            if z > a {
                spans.push([g as u32, a, z]);
            }
        }
    }
    span_edges.push(spans.len() as u32);
    let mut next = start;
    let (blocks_out, rest) = out.split_at_mut(entries);
    let (rows_out, rest) = rest.split_at_mut(entries);
    let subs_out = &mut rest[..entries];
    each(&mut |g, b, r, s| {
        let k = (r / piece) * groups + g;
        let at = next[k] as usize;
        next[k] += 1;
        blocks_out[at] = b as i64;
        rows_out[at] = (r % piece) as i64;
        subs_out[at] = s as i64;
    });
    Ok(TransferSplit {
        chunks,
        runs,
        run_edges,
        spans,
        span_edges,
        entries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tabled: &[bool]) -> TransferShape<'_> {
        TransferShape {
            num_blocks: 100,
            num_chunks: 50,
            blocks_per_chunk: 2,
            tabled,
        }
    }

    #[test]
    fn two_groups_partial_first_chunk_and_runs_cut_at_pieces() {
        let tabled = [true, true];
        let mut out = vec![0i64; 3 * 5];
        // Group 0: blocks 7, 8, 9 entered one sub-block in: chunks 11 (sub 1), 12 (subs 0, 1).
        // Group 1: blocks 3, 4: chunk 10 (subs 0, 1).
        let s = split_transfer(
            &shape(&tabled),
            &[7, 8, 9, 3, 4],
            &[3, 2],
            &[1, 0],
            &[11, 12, 10],
            2,
            &mut out,
        )
        .unwrap();
        assert_eq!(s.chunks, vec![10, 11, 12]);
        // Piece 0: chunks 10, 11 (one run); piece 1: chunk 12.
        assert_eq!(s.runs, vec![[10, 0, 2], [12, 0, 1]]);
        assert_eq!(s.run_edges, vec![0, 1, 2]);
        assert_eq!(s.entries, 5);
        // Piece 0: group 0's block 7 (chunk 11 = row 1, sub 1), group 1's blocks 3, 4 (row 0);
        // piece 1: group 0's blocks 8, 9 (chunk 12 = row 0).
        assert_eq!(s.spans, vec![[0, 0, 1], [1, 1, 3], [0, 3, 5]]);
        assert_eq!(s.span_edges, vec![0, 2, 3]);
        assert_eq!(&out[..5], &[7, 3, 4, 8, 9]);
        assert_eq!(&out[5..10], &[1, 0, 0, 0, 0]);
        assert_eq!(&out[10..15], &[1, 0, 1, 0, 1]);
    }

    #[test]
    fn a_group_without_tensors_has_chunks_but_no_entries() {
        let tabled = [false, true];
        let mut out = vec![0i64; 6];
        let s = split_transfer(
            &shape(&tabled),
            &[1, 2, 5],
            &[2, 1],
            &[0, 0],
            &[4, 9],
            8,
            &mut out,
        )
        .unwrap();
        assert_eq!(s.chunks, vec![4, 9]);
        assert_eq!(s.entries, 1);
        assert_eq!(s.spans, vec![[1, 0, 1]]);
        assert_eq!(&out[..3], &[5, 1, 0]);
    }

    #[test]
    fn bad_transfers_are_refused_with_nothing_written() {
        let tabled = [true, false];
        type Case = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>, &'static str);
        let cases: Vec<Case> = vec![
            (
                vec![0, 1],
                vec![1, 1],
                vec![0, 0],
                vec![0, 1, 2],
                "chunk_ids",
            ),
            (vec![0, 1], vec![2, 0], vec![0, 0], vec![], "chunk_ids"),
            (vec![0, 100], vec![2, 0], vec![0, 0], vec![0], "block_ids"),
            (vec![0, 1], vec![2, 0], vec![0, 0], vec![50], "chunk_ids"),
            (vec![0, 1], vec![1, 0], vec![0, 0], vec![0], "group_sizes"),
            (vec![0, 1], vec![2], vec![0], vec![0], "group_sizes"),
        ];
        for (blocks, sizes, idx, chunks, what) in cases {
            let mut out = vec![-7i64; 6];
            match split_transfer(&shape(&tabled), &blocks, &sizes, &idx, &chunks, 4, &mut out) {
                Err(Error::InvalidArgument { what: w, .. }) => assert_eq!(w, what),
                other => panic!("{blocks:?} {sizes:?} {chunks:?}: {other:?}"),
            }
            assert!(out.iter().all(|&v| v == -7));
        }
        let mut short = vec![0i64; 2];
        assert!(
            split_transfer(&shape(&tabled), &[0], &[1, 0], &[0, 0], &[0], 4, &mut short).is_err()
        );
    }

    #[test]
    fn empty_transfer_has_no_piece() {
        let tabled = [true];
        let s = split_transfer(&shape(&tabled), &[], &[0], &[0], &[], 4, &mut []).unwrap();
        assert_eq!(s.pieces(), 0);
        assert_eq!(s.entries, 0);
        assert!(s.runs.is_empty() && s.spans.is_empty());
    }
}
