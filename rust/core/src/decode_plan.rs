//! Split-K decode planning: the work list a ragged decode batch is launched from.
//!
//! Owns the arithmetic of the Python `DecodePlan.update` (its readable numpy reference is
//! `DecodePlan.plan_host` in `python/pagedkv/decode_plan.py`): from the host lengths of one
//! decode step it picks one chunk size for the whole batch, cuts every sequence into chunks of
//! that size and writes the resulting work list into a caller-owned `int32` buffer, heaviest item
//! first. [`plan_decode`] writes exactly the words the reference writes, in the same order.
//!
//! The chunk: `ceil(total_tokens × kv_heads / programs)` rounded up to a multiple of `granule`,
//! at least `min_chunk`; then, if the longest sequence needs several chunks, rounded up again so
//! that it splits into equal pieces (`ceil(longest / (longest / chunk))`, to the granule). A
//! sequence of length `l` gets `max(1, ceil(l / chunk))` pieces.
//!
//! Buffer layout (`out`, `int32` words):
//! - `out[0]`: the item count `m`;
//! - `out[1 .. 2 + n]`: `indptr` — sequence `i`'s pieces are items `indptr[i] .. indptr[i + 1]`
//!   of the seq-major list;
//! - `out[items_off .. items_off + 4 m]`: the items `(seq, start, end, row)` in launch order.
//!   `end` is [`TO_END`] for each sequence's last piece (the kernel clamps it to the device
//!   length); `row` is the item's seq-major index (its partial-output row) or `-1` for a sequence
//!   of one piece, which writes its output directly.
//!
//! Launch order: a stable sort by descending work (`min(end, l) - start`) of the seq-major list.
//! Every piece but a sequence's last holds exactly `chunk` tokens, the most any item holds, so
//! the order is: every full item in seq-major order, then the short last pieces (at most one per
//! sequence) by descending work, ties by sequence index. That is built directly, in `out`
//! itself: the short pieces are sorted as (work, seq) pairs by a stable radix sort whose scratch
//! is the part of the items region they expand into afterwards, so a call allocates nothing and
//! costs O(n) (a few ns per sequence).
//!
//! Invariants: lengths are clipped to `[0, MAX_SEQ_CAP]` first; the pieces of a sequence are
//! contiguous from token 0 and cover it; `m ≤ capacity`. On an error nothing has been written:
//! every check (parameters, the indptr room, the item capacity, the buffer length) runs before
//! the first store, and no store leaves `out`.

use crate::error::{Error, Result};

/// Longest context the kernels serve; longer (and negative) lengths are clipped into
/// `[0, MAX_SEQ_CAP]` (the Python side's `MAX_SEQ_CAP`).
pub const MAX_SEQ_CAP: u32 = 1 << 30;

/// Item end meaning "to the end of the sequence" (the kernel clamps it to the real length).
pub const TO_END: i32 = i32::MAX;

/// A host sequence length of any integer type, as the planner reads it.
pub trait SeqLen: Copy {
    /// The length clipped to `[0, MAX_SEQ_CAP]`.
    fn clipped(self) -> u32;
}

macro_rules! seq_len_signed {
    ($($t:ty),*) => {$(
        impl SeqLen for $t {
            #[inline(always)]
            fn clipped(self) -> u32 {
                (self as i64).clamp(0, i64::from(MAX_SEQ_CAP)) as u32
            }
        }
    )*};
}
macro_rules! seq_len_unsigned {
    ($($t:ty),*) => {$(
        impl SeqLen for $t {
            #[inline(always)]
            fn clipped(self) -> u32 {
                (self as u64).min(u64::from(MAX_SEQ_CAP)) as u32
            }
        }
    )*};
}
seq_len_signed!(i8, i16, i32, i64, isize);
seq_len_unsigned!(u8, u16, u32, u64, usize);

/// The planner's fixed parameters (those of one `DecodePlan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlanParams {
    /// KV heads per sequence: each item is launched once per kv head.
    pub kv_heads: u32,
    /// The (item, kv head) programs a full batch of chunks should come to.
    pub programs: u32,
    /// The shortest chunk, in tokens.
    pub min_chunk: u32,
    /// Chunks are rounded up to a multiple of this (the kernel's tile).
    pub granule: u32,
    /// Word offset of the items in the buffer; the indptr region `1 .. items_off` must hold
    /// `n + 1` entries.
    pub items_off: usize,
    /// The most items the buffer (and the partial-output scratch behind it) may hold.
    pub capacity: usize,
}

/// What one plan came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSummary {
    /// Items written (`out[0]`).
    pub num_items: usize,
    /// The chunk size chosen, in tokens (wide: `total × kv_heads / programs` is not bounded by
    /// the clip when no sequence needs splitting).
    pub chunk: u128,
}

impl DecodePlanParams {
    /// Checks the parameters' ranges: counts at least 1, `min_chunk` and `granule` at most
    /// [`MAX_SEQ_CAP`], `capacity` within `i32` (item indices are stored as `int32`).
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: u64, reason: &str| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason: reason.into(),
            })
        };
        if self.kv_heads == 0 {
            return bad("kv_heads", 0, "must be at least 1");
        }
        if self.programs == 0 {
            return bad("programs", 0, "must be at least 1");
        }
        for (field, v) in [("min_chunk", self.min_chunk), ("granule", self.granule)] {
            if v == 0 || v > MAX_SEQ_CAP {
                return bad(field, u64::from(v), "must be in [1, 2^30]");
            }
        }
        if self.capacity > i32::MAX as usize {
            return bad(
                "capacity",
                self.capacity as u64,
                "must be at most 2^31 - 1 (item indices are int32)",
            );
        }
        Ok(())
    }

    /// The chunk size for a batch of `total` tokens whose longest sequence is `longest` (both
    /// after clipping).
    pub fn chunk_for(&self, total: u64, longest: u32) -> u128 {
        let g = u128::from(self.granule);
        let mut chunk =
            (u128::from(total) * u128::from(self.kv_heads)).div_ceil(u128::from(self.programs));
        chunk = u128::from(self.min_chunk).max(chunk.div_ceil(g) * g);
        let longest = u128::from(longest);
        if longest > chunk {
            // Round the chunk up so the longest sequence splits into equal pieces (4096 tokens
            // with a 4032-token chunk would be 4032 + 64); a larger chunk only means fewer items.
            let p = longest / chunk;
            chunk = longest.div_ceil(p).div_ceil(g) * g;
        }
        chunk
    }
}

/// Pieces of a sequence of (clipped) length `l` under chunk `c` (`c ≥ 1`), and whether its
/// last piece is short (holds fewer than `c` tokens; always so for an empty sequence).
#[inline(always)]
fn pieces(l: u32, c: u64) -> (u64, bool) {
    let l = u64::from(l);
    if l <= c {
        (1, l != c)
    } else {
        (l.div_ceil(c), l % c != 0)
    }
}

/// Sorts the `(work, seq)` pairs of `a` (2 words each, in ascending `seq`) by descending work,
/// stably, using `b` (as long as `a`) as scratch. Returns whether the result is in `b`.
///
/// An LSD radix sort on 8-bit digits, as many passes as the largest work needs (two for
/// chunks below 65536 tokens), skipping a pass whose digit is the same for every pair; an
/// insertion sort for a few pairs. No allocation: the counts live on the stack.
fn sort_short(a: &mut [i32], b: &mut [i32]) -> bool {
    let q = a.len() / 2;
    if q <= 24 {
        for j in 1..q {
            let (w, s) = (a[2 * j], a[2 * j + 1]);
            let mut i = j;
            while i > 0 && a[2 * (i - 1)] < w {
                a[2 * i] = a[2 * (i - 1)];
                a[2 * i + 1] = a[2 * (i - 1) + 1];
                i -= 1;
            }
            a[2 * i] = w;
            a[2 * i + 1] = s;
        }
        return false;
    }
    let max = (0..q).map(|j| a[2 * j] as u32).max().unwrap_or(0);
    let passes = (32 - max.leading_zeros()).div_ceil(8);
    let (mut src, mut dst) = (a, b);
    let mut in_b = false;
    for pass in 0..passes {
        let shift = 8 * pass;
        // Descending: bucket 255 - digit, so the largest digit comes first.
        let bucket = |w: i32| 255 - ((w as u32 >> shift) & 255) as usize;
        let mut at = [0u32; 256];
        for j in 0..q {
            at[bucket(src[2 * j])] += 1;
        }
        if at.contains(&(q as u32)) {
            continue; // one digit for all: the pass would not move anything
        }
        let mut sum = 0;
        for c in at.iter_mut() {
            (*c, sum) = (sum, sum + *c);
        }
        for j in 0..q {
            let k = bucket(src[2 * j]);
            let o = at[k] as usize;
            at[k] += 1;
            dst[2 * o] = src[2 * j];
            dst[2 * o + 1] = src[2 * j + 1];
        }
        std::mem::swap(&mut src, &mut dst);
        in_b = !in_b;
    }
    in_b
}

/// Plans one decode step from the host lengths `lens` into `out` (layout in the module doc) and
/// returns the item count and chunk. Errors (nothing written): [`Error::InvalidConfig`] for bad
/// parameters, [`Error::BufferTooSmall`] when the indptr region (`items_off`), the item capacity
/// or `out` is too small for this batch.
pub fn plan_decode<L: SeqLen>(
    lens: &[L],
    params: &DecodePlanParams,
    out: &mut [i32],
) -> Result<PlanSummary> {
    params.validate()?;
    let n = lens.len();
    if params.items_off < n.saturating_add(2) {
        return Err(Error::BufferTooSmall {
            buffer: "plan indptr",
            needed: n.saturating_add(2),
            capacity: params.items_off,
        });
    }
    let (mut total, mut longest) = (0u64, 0u32);
    for &l in lens {
        let l = l.clipped();
        total += u64::from(l);
        longest = longest.max(l);
    }
    let chunk = params.chunk_for(total, longest);
    // Every clipped length is at most 2^30, so any larger chunk gives the same pieces: narrow
    // it for the per-sequence arithmetic (all of it in u64, all results fit in i32).
    let c = chunk.min(1 << 31) as u64;
    let (mut m, mut q) = (0u64, 0usize);
    for &l in lens {
        let (p, short) = pieces(l.clipped(), c);
        m += p;
        q += usize::from(short);
    }
    if m > params.capacity as u64 {
        return Err(Error::BufferTooSmall {
            buffer: "plan items",
            needed: m as usize,
            capacity: params.capacity,
        });
    }
    let m = m as usize; // ≤ capacity ≤ i32::MAX
    let need = params.items_off + 4 * m;
    if out.len() < need {
        return Err(Error::BufferTooSmall {
            buffer: "plan",
            needed: need,
            capacity: out.len(),
        });
    }

    // All checks passed: write. Values below fit in i32: m, indptr and seq ≤ capacity ≤
    // i32::MAX; starts and non-final ends are below the sequence's length ≤ 2^30.
    out[0] = m as i32;
    let (head, tail) = out.split_at_mut(params.items_off);
    let indptr = &mut head[1..n + 2];
    let items = &mut tail[..4 * m];
    indptr[0] = 0;
    // Full items (exactly `chunk` tokens) go first, in seq-major order, in the first `4 (m - q)`
    // words. The `q` short last pieces (at most one per sequence) are collected meanwhile as
    // (work, seq) pairs in the last `2 q` words, sorted (the `2 q` words between as scratch),
    // then expanded in place into records.
    let full = 4 * (m - q);
    let (mut front, mut pair) = (0usize, full + 2 * q);
    let mut row = 0u64;
    for (i, &l) in lens.iter().enumerate() {
        let l = u64::from(l.clipped());
        if l < c {
            // The common case in a ragged batch: one short piece.
            items[pair..pair + 2].copy_from_slice(&[l as i32, i as i32]);
            pair += 2;
            row += 1;
            indptr[i + 1] = row as i32;
            continue;
        }
        let (p, short) = pieces(l as u32, c);
        let last = (p - 1) * c;
        let r = |k: u64| if p > 1 { (row + k) as i32 } else { -1 };
        for k in 0..p - 1 {
            let start = k * c;
            let rec = [i as i32, start as i32, (start + c) as i32, r(k)];
            items[front..front + 4].copy_from_slice(&rec);
            front += 4;
        }
        if short {
            items[pair..pair + 2].copy_from_slice(&[(l - last) as i32, i as i32]);
            pair += 2;
        } else {
            items[front..front + 4].copy_from_slice(&[i as i32, last as i32, TO_END, r(p - 1)]);
            front += 4;
        }
        row += p;
        indptr[i + 1] = row as i32;
    }
    debug_assert!(front == full && pair == 4 * m);
    let (scratch, pairs) = items[full..].split_at_mut(2 * q);
    let in_scratch = sort_short(pairs, scratch);
    // Pair j (2 words) becomes record j (4 words, at full + 4j). From the scratch half (at
    // full + 2j) expand last to first: record j ends before pair j + 1 starts only when read
    // backwards. From the upper half (at full + 2q + 2j) expand first to last: record j ends
    // at full + 4j + 3 < full + 2q + 2j + 2 as j < q. Either way no pair is overwritten unread.
    let base = if in_scratch { full } else { full + 2 * q };
    let mut expand = |j: usize| {
        let at = base + 2 * j;
        let (work, seq) = (items[at], items[at + 1]);
        let start = lens[seq as usize].clipped() as i32 - work;
        // A short piece with a nonzero start is the last of several: its row is the sequence's
        // last seq-major index.
        let r = if start > 0 {
            indptr[seq as usize + 1] - 1
        } else {
            -1
        };
        let o = full + 4 * j;
        items[o..o + 4].copy_from_slice(&[seq, start, TO_END, r]);
    };
    if in_scratch {
        (0..q).rev().for_each(&mut expand);
    } else {
        (0..q).for_each(&mut expand);
    }
    Ok(PlanSummary {
        num_items: m,
        chunk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A straightforward reference, written as the numpy one is: build the seq-major list, then
    /// stable-sort it by descending work.
    fn reference(lens: &[i64], p: &DecodePlanParams) -> (u128, Vec<i32>) {
        let lens: Vec<i64> = lens
            .iter()
            .map(|&l| l.clamp(0, i64::from(MAX_SEQ_CAP)))
            .collect();
        let total: i128 = lens.iter().map(|&l| i128::from(l)).sum();
        let g = i128::from(p.granule);
        let mut chunk = -((-total * i128::from(p.kv_heads)).div_euclid(i128::from(p.programs)));
        chunk = i128::from(p.min_chunk).max(-((-chunk).div_euclid(g)) * g);
        let longest = i128::from(lens.iter().copied().max().unwrap_or(0));
        if longest > chunk {
            let k = longest / chunk;
            let per = -((-longest).div_euclid(k));
            chunk = -((-per).div_euclid(g)) * g;
        }
        let mut list = Vec::new(); // (seq, start, end, row, work)
        let mut indptr = vec![0i64];
        for (i, &l) in lens.iter().enumerate() {
            let np = std::cmp::max(1, -((-i128::from(l)).div_euclid(chunk))) as i64;
            for k in 0..np {
                let start = k as i128 * chunk;
                let end = if k == np - 1 {
                    i128::from(TO_END)
                } else {
                    start + chunk
                };
                let row = if np == 1 { -1 } else { list.len() as i64 };
                let work = end.min(i128::from(l)) - start;
                list.push((i as i64, start as i64, end as i64, row, work));
            }
            indptr.push(list.len() as i64);
        }
        list.sort_by_key(|x| std::cmp::Reverse(x.4)); // stable
        let mut out = vec![list.len() as i32];
        out.extend(indptr.iter().map(|&v| v as i32));
        while out.len() < p.items_off {
            out.push(0);
        }
        for (s, a, e, r, _) in list {
            out.extend([s as i32, a as i32, e as i32, r as i32]);
        }
        (chunk as u128, out)
    }

    fn params(
        n: usize,
        kv_heads: u32,
        programs: u32,
        min_chunk: u32,
        tile: u32,
    ) -> DecodePlanParams {
        let capacity = n + (programs as usize).div_ceil(kv_heads as usize) + 1;
        DecodePlanParams {
            kv_heads,
            programs,
            min_chunk,
            granule: tile.min(min_chunk),
            items_off: (2 + n).div_ceil(4) * 4,
            capacity,
        }
    }

    fn run(lens: &[i64], p: &DecodePlanParams) -> (PlanSummary, Vec<i32>) {
        let mut out = vec![0i32; p.items_off + 4 * p.capacity];
        let s = plan_decode(lens, p, &mut out).unwrap();
        out.truncate(p.items_off + 4 * s.num_items);
        (s, out)
    }

    #[test]
    fn matches_reference_on_a_ragged_batch() {
        let lens = [1i64, 7, 300, 33, 0, 129, 64, 1000];
        let p = params(16, 2, 40, 64, 64);
        let (s, out) = run(&lens, &p);
        let (chunk, want) = reference(&lens, &p);
        assert_eq!(s.chunk, chunk);
        assert_eq!(out, want);
        assert!(s.num_items > lens.len()); // it split
        assert_eq!(s.chunk % 64, 0);
    }

    #[test]
    fn no_split_is_sorted_by_length_stably() {
        let lens = [5i64, 70, 3, 70, 0, 5];
        let p = params(8, 1, 200, 256, 64);
        let (s, out) = run(&lens, &p);
        assert_eq!(s.num_items, 6);
        assert_eq!(s.chunk, 256);
        let seqs: Vec<i32> = out[p.items_off..].chunks(4).map(|r| r[0]).collect();
        assert_eq!(seqs, [1, 3, 0, 5, 2, 4]);
        for r in out[p.items_off..].chunks(4) {
            assert_eq!(&r[1..], &[0, TO_END, -1]);
        }
        assert_eq!(out, reference(&lens, &p).1);
    }

    #[test]
    fn empty_batch_and_clipping() {
        let p = params(4, 2, 40, 64, 64);
        let (s, out) = run(&[], &p);
        assert_eq!((s.num_items, s.chunk), (0, 64));
        assert_eq!(&out[..2], &[0, 0]);
        // Negative lengths are 0, huge ones MAX_SEQ_CAP.
        let lens = [-5i64, i64::MAX, i64::MIN, 1 << 40];
        let (_, a) = run(&lens, &p);
        let (_, b) = run(&[0, 1 << 30, 0, 1 << 30], &p);
        assert_eq!(a, b);
        assert_eq!(a, reference(&lens, &p).1);
        // Unsigned and narrow types read the same values.
        let mut o1 = vec![0; p.items_off + 4 * p.capacity];
        let mut o2 = o1.clone();
        plan_decode(&[3u16, 900, 0], &p, &mut o1).unwrap();
        plan_decode(&[3i8 as i64, 900, 0], &p, &mut o2).unwrap();
        assert_eq!(o1, o2);
        plan_decode(&[u64::MAX, 0], &p, &mut o1).unwrap();
        plan_decode(&[1i64 << 30, 0], &p, &mut o2).unwrap();
        assert_eq!(o1, o2);
    }

    #[test]
    fn huge_chunk_is_exact() {
        // total × kv_heads / programs beyond u64: nothing splits, the chunk is still exact.
        let n = 64;
        let p = DecodePlanParams {
            kv_heads: u32::MAX,
            programs: 1,
            ..params(n, 1, 1, 256, 64)
        };
        let lens = vec![i64::MAX; n];
        let (s, out) = run(&lens, &p);
        let (chunk, want) = reference(&lens, &p);
        assert!(chunk > u128::from(u64::MAX));
        assert_eq!((s.chunk, s.num_items), (chunk, n));
        assert_eq!(out, want);
    }

    #[test]
    fn errors_write_nothing() {
        let p = params(4, 2, 8, 64, 64);
        let sentinel = vec![7i32; p.items_off + 4 * p.capacity];
        let mut out = sentinel.clone();
        // Too many sequences for the indptr region.
        let e = plan_decode(&[1i32; 7], &p, &mut out).unwrap_err();
        assert!(matches!(
            e,
            Error::BufferTooSmall {
                buffer: "plan indptr",
                needed: 9,
                capacity: 8
            }
        ));
        // More items than the capacity (a capacity too small for these lengths).
        let tight = DecodePlanParams { capacity: 1, ..p };
        let e = plan_decode(&[1i32, 2], &tight, &mut out).unwrap_err();
        assert!(matches!(
            e,
            Error::BufferTooSmall {
                buffer: "plan items",
                needed: 2,
                capacity: 1
            }
        ));
        // A buffer shorter than the items.
        let mut short = vec![7i32; p.items_off + 3];
        let e = plan_decode(&[1i32, 2], &p, &mut short).unwrap_err();
        assert!(matches!(
            e,
            Error::BufferTooSmall { buffer: "plan", needed, capacity } if needed == p.items_off + 8 && capacity == p.items_off + 3
        ));
        assert!(short.iter().all(|&v| v == 7));
        // Bad parameters.
        for bad in [
            DecodePlanParams { kv_heads: 0, ..p },
            DecodePlanParams { programs: 0, ..p },
            DecodePlanParams { min_chunk: 0, ..p },
            DecodePlanParams {
                granule: (1 << 30) + 1,
                ..p
            },
            DecodePlanParams {
                capacity: 1 << 31,
                ..p
            },
        ] {
            assert!(matches!(
                plan_decode(&[1i32], &bad, &mut out),
                Err(Error::InvalidConfig { .. })
            ));
        }
        assert_eq!(out, sentinel);
        // A zero-length buffer with an empty batch still needs the count and indptr words.
        let e = plan_decode::<i32>(&[], &p, &mut []).unwrap_err();
        assert!(matches!(e, Error::BufferTooSmall { buffer: "plan", .. }));
    }

    #[test]
    fn capacity_bound_holds_for_skewed_lengths() {
        let p = params(16, 2, 40, 64, 64);
        let mut cases: Vec<Vec<i64>> = vec![
            vec![0; 16],
            vec![5000; 16],
            (0..16).map(|i| i * 1000).collect(),
        ];
        let mut skew = vec![1i64; 16];
        skew[0] = 1_000_000;
        cases.push(skew);
        for lens in cases {
            let (s, out) = run(&lens, &p);
            assert!(s.num_items <= p.capacity);
            assert_eq!(out, reference(&lens, &p).1);
        }
    }

    proptest! {
        #[test]
        fn sort_short_is_a_stable_descending_sort(
            works in proptest::collection::vec(
                prop_oneof![0i32..4, 0i32..300, 0i32..70_000, 0i32..i32::MAX], 0..300),
        ) {
            let q = works.len();
            let mut a: Vec<i32> = works.iter().enumerate().flat_map(|(s, &w)| [w, s as i32]).collect();
            let mut b = vec![-1; 2 * q];
            let mut want: Vec<(i32, i32)> = works.iter().enumerate().map(|(s, &w)| (w, s as i32)).collect();
            want.sort_by_key(|x| std::cmp::Reverse(x.0));
            let got = if sort_short(&mut a, &mut b) { b } else { a };
            let got: Vec<(i32, i32)> = got.chunks(2).map(|p| (p[0], p[1])).collect();
            prop_assert_eq!(got, want);
        }
    }

    fn length() -> impl Strategy<Value = i64> {
        prop_oneof![
            4 => 0i64..64,
            4 => 0i64..20_000,
            1 => Just(0i64),
            1 => -1000i64..0,
            1 => (1i64 << 29)..(1i64 << 31),
            1 => any::<i64>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn matches_the_reference(
            lens in proptest::collection::vec(length(), 0..80),
            spare in 0usize..4,
            kv_heads in 1u32..9,
            programs in 1u32..600,
            min_chunk in prop_oneof![1u32..64, Just(256u32), 1u32..5000],
            tile in prop_oneof![Just(32u32), Just(64u32), 1u32..100],
        ) {
            let p = params(lens.len() + spare, kv_heads, programs, min_chunk, tile);
            let (s, out) = run(&lens, &p);
            let (chunk, want) = reference(&lens, &p);
            prop_assert_eq!(s.chunk, chunk);
            prop_assert!(s.num_items <= p.capacity);
            prop_assert_eq!(out, want);
        }
    }
}
