//! Caller-owned step buffers and what one step writes into them.
//!
//! The manager never allocates step output: the caller owns the buffers (pinned host tensors in the
//! Python layer, plain `Vec`s in Rust) and `BlockManager::build_step` fills them in place. This
//! module owns the buffer types and their validation:
//!
//! - [`StepBuffers`]: borrowed slices, checked for size on every step (cheap length comparisons);
//!   a buffer too small → `BufferTooSmall` naming it, nothing written.
//! - [`RegisteredBuffers`]: raw pointers handed over by the binding, validated once (non-null,
//!   aligned, right dtype, capacity for a declared [`StepLayout`], no two buffers overlapping) and
//!   turned into a [`StepBuffers`] view per step.
//!
//! - `StepCache` (crate-private): what the manager last wrote into a block-table buffer, so a
//!   step rewrites only the entries that changed (see "Incremental block tables" below).
//!
//! The FlashInfer CSR page table (`kv_indptr`, `kv_indices`, `kv_last_page_len`) is optional:
//! when all three buffers are empty, `build_step` skips it (it is half the bytes a decode step
//! writes) and reports `num_kv_indices == 0`.
//!
//! Copy list guarantee (for a parallel copy kernel): in the `(src, dst)` pairs one step emits, every
//! `dst` is distinct and no `dst` is also a `src`, so the pairs may be applied in any order or all at
//! once. They must be applied before the step writes new KV.
//!
//! Swap lists: `swap_out` holds `(device_block, host_block)` pairs (device → host copies queued by
//! `BlockManager::swap_out`), `swap_in` holds `(host_block, device_block)` pairs (host → device,
//! queued by `swap_in`). An engine applies one step's lists in this order, before the step's
//! forward writes anything: swap-out, then swap-in, then the copy-on-write list. (A device block
//! freed by a swap-out may already be handed out again, as a swap-in or copy destination; a
//! copy-on-write source may be a block a swap-in fills.) Host destinations of one swap-out list
//! are distinct, device destinations of one swap-in list are distinct; sources may repeat.
//!
//! Incremental block tables: `build_step` remembers, per row of the block-table buffer it last
//! wrote, a mark `(sequence uid, table version, entries written)`. Uids are unique for the manager's
//! life (a freed and readmitted id, or a reused slot, gets a new one) and the version changes
//! whenever an entry already in the table is replaced, so a matching mark proves the row's first
//! `written` entries still equal the table and only `[written, blocks)` need writing. The buffer is
//! identified by address, length and stride; any other buffer resets every mark. Invariant: for
//! every row with a mark `(uid, version, w)`, the row's first `w` entries are what the sequence
//! `uid` held at `version` — true as long as nobody but the manager writes the buffer between
//! steps, which is the caller's side of the contract (`BlockManager::invalidate_step_cache`).

use crate::error::{Error, Result};

/// Output buffers of one step, borrowed from the caller.
///
/// Pass all three CSR buffers (`kv_indptr`, `kv_indices`, `kv_last_page_len`) empty to skip the
/// FlashInfer page table.
///
/// Row `i` of `block_tables` is `block_tables[i * block_table_stride ..][.. ceil(len_i / B)]`;
/// entries past a row's block count and rows past the batch are left as they were.
///
/// Ownership between steps: the manager writes block-table rows incrementally, trusting that the
/// `block_tables` memory it wrote last step (same address, length and stride) still holds what it
/// wrote. Reading it freely is fine; writing into it (or reusing its address for new memory) must
/// be followed by `BlockManager::invalidate_step_cache` before the next `build_step`. The other
/// buffers are rewritten in full for the batch every step.
#[derive(Debug)]
pub struct StepBuffers<'a> {
    /// Physical slot of each new token, batch order: `>=` total new tokens.
    pub slot_mapping: &'a mut [i64],
    /// `[max_seqs, block_table_stride]`, row-major.
    pub block_tables: &'a mut [i32],
    /// Row width of `block_tables`: `>=` the block count of every sequence in the batch.
    pub block_table_stride: usize,
    /// Length of each sequence, new tokens included: `>=` batch.
    pub seq_lens: &'a mut [i32],
    /// Cumulative new-token counts, starting at 0: `>=` batch + 1.
    pub query_start_loc: &'a mut [i32],
    /// FlashInfer CSR row pointers into `kv_indices`: `>=` batch + 1.
    pub kv_indptr: &'a mut [i32],
    /// FlashInfer CSR page ids, every sequence's blocks concatenated: `>=` their sum.
    pub kv_indices: &'a mut [i32],
    /// Tokens in each sequence's last page, `((len - 1) % B) + 1`: `>=` batch.
    pub kv_last_page_len: &'a mut [i32],
    /// Copy-on-write copies, flat `(src, dst)` block pairs. A step writes as many pending copies
    /// as fit (at least those its own batch needs); the rest wait for a later step.
    pub copies: &'a mut [i64],
    /// Queued swap-out copies, flat `(device_block, host_block)` pairs.
    pub swap_out: &'a mut [i64],
    /// Queued swap-in copies, flat `(host_block, device_block)` pairs.
    pub swap_in: &'a mut [i64],
}

/// Output buffers of one KV cache group after group 0 (see [`crate::groups`]), borrowed from the
/// caller: the group's own slot mapping and block tables, laid out as group 0's in
/// [`StepBuffers`]. Lengths, query offsets and the copy and swap lists are shared by all groups
/// (pages are group-agnostic) and written once, into the [`StepBuffers`]. Rows hold
/// [`NULL_BLOCK`](crate::groups::NULL_BLOCK) (`-1`) for released positions. The block-table
/// buffer follows the same ownership contract as group 0's.
#[derive(Debug)]
pub struct GroupStepBuffers<'a> {
    /// Physical slot of each new token in this group, batch order: `>=` total new tokens.
    pub slot_mapping: &'a mut [i64],
    /// `[max_seqs, block_table_stride]`, row-major.
    pub block_tables: &'a mut [i32],
    /// Row width of `block_tables`.
    pub block_table_stride: usize,
}

/// Owned per-group step buffers for the groups after group 0, sized once for a [`StepLayout`]
/// (so their addresses stay put for the buffers' life).
#[derive(Debug, Clone, Default)]
pub struct OwnedGroupBuffers {
    /// One slot mapping per group after group 0 (`max_tokens` each).
    pub slot_mappings: Vec<Vec<i64>>,
    /// One block-table buffer per group after group 0 (`max_seqs * max_blocks_per_seq` each).
    pub block_tables: Vec<Vec<i32>>,
    /// Row width of every block-table buffer.
    pub block_table_stride: usize,
}

impl OwnedGroupBuffers {
    /// Zero-filled buffers for `extra_groups` groups (the manager's `num_groups() - 1`).
    pub fn new(layout: StepLayout, extra_groups: usize) -> Self {
        let t = layout.max_seqs * layout.max_blocks_per_seq;
        Self {
            slot_mappings: vec![vec![0; layout.max_tokens]; extra_groups],
            block_tables: vec![vec![0; t]; extra_groups],
            block_table_stride: layout.max_blocks_per_seq,
        }
    }

    /// Borrowed views, one per group, for `BlockManager::build_step_groups`.
    pub fn views(&mut self) -> Vec<GroupStepBuffers<'_>> {
        let stride = self.block_table_stride;
        self.slot_mappings
            .iter_mut()
            .zip(self.block_tables.iter_mut())
            .map(|(s, b)| GroupStepBuffers {
                slot_mapping: s,
                block_tables: b,
                block_table_stride: stride,
            })
            .collect()
    }
}

/// What one step wrote: the prefixes of each buffer that are meaningful.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepInfo {
    /// Sequences in the batch: rows written to `block_tables`, `seq_lens`, `kv_last_page_len`.
    pub num_seqs: usize,
    /// Total new tokens: entries written to `slot_mapping`, and `query_start_loc[num_seqs]`.
    pub num_tokens: usize,
    /// Entries written to `kv_indices`, and `kv_indptr[num_seqs]`.
    pub num_kv_indices: usize,
    /// `(src, dst)` pairs written to `copies` (so `2 * num_copies` elements).
    pub num_copies: usize,
    /// Longest sequence in the batch (0 for an empty batch).
    pub max_seq_len: usize,
    /// `(device, host)` pairs written to `swap_out`.
    pub num_swap_out: usize,
    /// `(host, device)` pairs written to `swap_in`.
    pub num_swap_in: usize,
    /// Most new tokens of one sequence in the batch: the largest difference of consecutive
    /// `query_start_loc` entries (1 for a decode-only step, 0 for an empty batch). A prefill
    /// kernel sizes its grid by it.
    pub max_query_len: usize,
}

/// What a block-table row holds: the first `written` entries of the table of sequence `uid` at
/// `version`. `uid == 0` (never handed out) means "unknown".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RowMark {
    uid: u64,
    version: u64,
    written: usize,
}

impl RowMark {
    /// How many leading entries of a row for sequence `uid` at `version`, now `nb` blocks long,
    /// are already in place: `written` when the mark matches, else 0.
    #[inline]
    pub(crate) fn valid_prefix(&self, uid: u64, version: u64, nb: usize) -> usize {
        if self.uid == uid && self.version == version && self.written <= nb {
            self.written
        } else {
            0
        }
    }

    #[inline]
    pub(crate) fn set(&mut self, uid: u64, version: u64, nb: usize) {
        *self = RowMark {
            uid,
            version,
            written: nb,
        };
    }
}

/// The manager's memory of the block-table buffer it last wrote: its identity and one mark per
/// row. Only `build_step` (after validation) and `invalidate` change it.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepCache {
    ptr: usize,
    len: usize,
    stride: usize,
    marks: Vec<RowMark>,
}

impl StepCache {
    /// The marks of the first `rows` rows of `buf` (with `stride`), about to be written. A buffer
    /// other than the last one written resets every mark first.
    #[inline]
    pub(crate) fn rows_for(&mut self, buf: &[i32], stride: usize, rows: usize) -> &mut [RowMark] {
        let (ptr, len) = (buf.as_ptr() as usize, buf.len());
        if (ptr, len, stride) != (self.ptr, self.len, self.stride) {
            self.ptr = ptr;
            self.len = len;
            self.stride = stride;
            self.marks.clear();
        }
        if self.marks.len() < rows {
            self.marks.resize(rows, RowMark::default());
        }
        &mut self.marks[..rows]
    }

    /// Forgets every row: the next step writes its rows in full.
    pub(crate) fn invalidate(&mut self) {
        self.marks.clear();
    }
}

/// Element type of a raw buffer, as the binding reports it. Only `I32` and `I64` are accepted by
/// step buffers; the others exist so a wrong tensor is reported by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
    /// 8-bit signed integer.
    I8,
    /// 16-bit signed integer.
    I16,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit unsigned integer.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Boolean (one byte).
    Bool,
    /// Anything else the binding cannot name.
    Other,
}

impl DType {
    /// Size of one element in bytes (0 for `Other`).
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
            DType::Other => 0,
        }
    }

    /// Lower-case name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Bool => "bool",
            DType::Other => "other",
        }
    }
}

/// A caller-owned buffer given by address: `len` elements of `dtype` starting at `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawBuffer {
    /// Address of the first element.
    pub ptr: usize,
    /// Length in elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
}

/// The shape the step buffers are sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    /// Most sequences in one step (rows of `block_tables`).
    pub max_seqs: usize,
    /// Most new tokens in one step (length of `slot_mapping`).
    pub max_tokens: usize,
    /// Row width of `block_tables`; also bounds each sequence's share of `kv_indices`.
    pub max_blocks_per_seq: usize,
    /// Most copy-on-write pairs one step can emit.
    pub max_copies: usize,
    /// Most pairs of each swap list (`swap_out`, `swap_in`) one step can emit; more stay queued.
    pub max_swaps: usize,
}

impl StepLayout {
    /// Element count each buffer needs, in the order of [`RawStepBuffers`]' fields.
    fn needs(&self) -> Result<[usize; NBUF]> {
        let too_big = |what: &'static str, v: usize| Error::InvalidArgument {
            what,
            value: v as i64,
            reason: "layout size overflows".into(),
        };
        let table = self
            .max_seqs
            .checked_mul(self.max_blocks_per_seq)
            .ok_or(too_big("max_blocks_per_seq", self.max_blocks_per_seq))?;
        let seqs1 = self
            .max_seqs
            .checked_add(1)
            .ok_or(too_big("max_seqs", self.max_seqs))?;
        let copies = self
            .max_copies
            .checked_mul(2)
            .ok_or(too_big("max_copies", self.max_copies))?;
        let swaps = self
            .max_swaps
            .checked_mul(2)
            .ok_or(too_big("max_swaps", self.max_swaps))?;
        Ok([
            self.max_tokens,
            table,
            self.max_seqs,
            seqs1,
            seqs1,
            table,
            self.max_seqs,
            copies,
            swaps,
            swaps,
        ])
    }

    fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("max_seqs", self.max_seqs),
            ("max_tokens", self.max_tokens),
            ("max_blocks_per_seq", self.max_blocks_per_seq),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument {
                    what,
                    value: 0,
                    reason: "must be >= 1".into(),
                });
            }
            if v > i32::MAX as usize {
                return Err(Error::InvalidArgument {
                    what,
                    value: v as i64,
                    reason: format!("must be <= {}", i32::MAX),
                });
            }
        }
        self.needs().map(|_| ())
    }
}

/// Number of step buffers.
pub const NBUF: usize = 10;

/// The ten step buffers by address, as the binding receives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStepBuffers {
    /// Physical slot of each new token (`i64`); see [`StepBuffers::slot_mapping`].
    pub slot_mapping: RawBuffer,
    /// Block tables, `[max_seqs, stride]` row-major (`i32`); see [`StepBuffers::block_tables`].
    pub block_tables: RawBuffer,
    /// Length of each sequence (`i32`).
    pub seq_lens: RawBuffer,
    /// Cumulative new-token counts (`i32`).
    pub query_start_loc: RawBuffer,
    /// FlashInfer CSR row pointers (`i32`).
    pub kv_indptr: RawBuffer,
    /// FlashInfer CSR page ids (`i32`).
    pub kv_indices: RawBuffer,
    /// Tokens in each sequence's last page (`i32`).
    pub kv_last_page_len: RawBuffer,
    /// Pending copy-on-write `(src, dst)` pairs, flat (`i64`).
    pub copies: RawBuffer,
    /// Queued swap-out `(device, host)` pairs, flat (`i64`); run before the step's forward.
    pub swap_out: RawBuffer,
    /// Queued swap-in `(host, device)` pairs, flat (`i64`); run before the step's forward.
    pub swap_in: RawBuffer,
}

const NAMES: [&str; NBUF] = [
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "copies",
    "swap_out",
    "swap_in",
];
const DTYPES: [DType; NBUF] = [
    DType::I64,
    DType::I32,
    DType::I32,
    DType::I32,
    DType::I32,
    DType::I32,
    DType::I32,
    DType::I64,
    DType::I64,
    DType::I64,
];

impl RawStepBuffers {
    /// False when all three CSR buffers have length 0: no FlashInfer page table wanted.
    pub fn has_csr(&self) -> bool {
        !(self.kv_indptr.len == 0 && self.kv_indices.len == 0 && self.kv_last_page_len.len == 0)
    }

    fn as_array(&self) -> [RawBuffer; NBUF] {
        [
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.kv_indptr,
            self.kv_indices,
            self.kv_last_page_len,
            self.copies,
            self.swap_out,
            self.swap_in,
        ]
    }
}

/// Step buffers given by raw address, validated once at registration.
///
/// Holding one does not keep the memory alive: whoever registers the buffers must keep them
/// allocated, unmoved and not accessed by anyone else while [`RegisteredBuffers::as_step_buffers`]
/// views are in use (see its safety contract).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredBuffers {
    layout: StepLayout,
    bufs: RawStepBuffers,
}

impl RegisteredBuffers {
    /// Validates every buffer against `layout`:
    /// - the layout: `max_seqs`, `max_tokens`, `max_blocks_per_seq` in `1..=i32::MAX`
    ///   (`InvalidArgument`);
    /// - dtype (`int64` for `slot_mapping` and `copies`, `int32` for the rest), non-null pointer,
    ///   alignment for the dtype, address range not wrapping, no overlap between two buffers
    ///   (`BufferInvalid`);
    /// - capacity for the layout (`BufferTooSmall`): `slot_mapping >= max_tokens`,
    ///   `block_tables, kv_indices >= max_seqs * max_blocks_per_seq`,
    ///   `seq_lens, kv_last_page_len >= max_seqs`, `query_start_loc, kv_indptr >= max_seqs + 1`,
    ///   `copies >= 2 * max_copies`, `swap_out, swap_in >= 2 * max_swaps`.
    ///
    /// A buffer that must hold zero elements may be null: `copies` with `max_copies == 0`, the swap
    /// lists with `max_swaps == 0`, and the
    /// three CSR buffers when all three are given with length 0 (no FlashInfer page table).
    pub fn new(layout: StepLayout, bufs: RawStepBuffers) -> Result<Self> {
        layout.validate()?;
        let mut needs = layout.needs()?;
        if !bufs.has_csr() {
            needs[4] = 0;
            needs[5] = 0;
            needs[6] = 0;
        }
        let arr = bufs.as_array();
        for i in 0..NBUF {
            let (b, name, want) = (arr[i], NAMES[i], DTYPES[i]);
            if b.dtype != want {
                return Err(Error::BufferInvalid {
                    buffer: name,
                    expected: want.name(),
                    got: b.dtype.name().to_string(),
                });
            }
            if b.ptr == 0 && !(needs[i] == 0 && b.len == 0) {
                return Err(Error::BufferInvalid {
                    buffer: name,
                    expected: "a non-null pointer",
                    got: "null".into(),
                });
            }
            if b.ptr % want.size() != 0 {
                return Err(Error::BufferInvalid {
                    buffer: name,
                    expected: if want.size() == 8 {
                        "8-byte alignment"
                    } else {
                        "4-byte alignment"
                    },
                    got: format!("address {:#x}", b.ptr),
                });
            }
            let end = b
                .len
                .checked_mul(want.size())
                .and_then(|bytes| b.ptr.checked_add(bytes))
                .filter(|&e| e <= isize::MAX as usize);
            if end.is_none() {
                return Err(Error::BufferInvalid {
                    buffer: name,
                    expected: "an address range inside the address space",
                    got: format!("{} elements at {:#x}", b.len, b.ptr),
                });
            }
            if b.len < needs[i] {
                return Err(Error::BufferTooSmall {
                    buffer: name,
                    needed: needs[i],
                    capacity: b.len,
                });
            }
        }
        // Two overlapping buffers would become two aliasing `&mut` slices.
        for i in 0..NBUF {
            for j in i + 1..NBUF {
                let (a, b) = (arr[i], arr[j]);
                let (a0, a1) = (a.ptr, a.ptr + a.len * a.dtype.size());
                let (b0, b1) = (b.ptr, b.ptr + b.len * b.dtype.size());
                if a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1 {
                    return Err(Error::BufferInvalid {
                        buffer: NAMES[j],
                        expected: "memory not shared with another step buffer",
                        got: format!("overlaps `{}`", NAMES[i]),
                    });
                }
            }
        }
        Ok(Self { layout, bufs })
    }

    /// The layout the buffers were validated for.
    pub fn layout(&self) -> &StepLayout {
        &self.layout
    }

    /// The registered buffers.
    pub fn raw(&self) -> &RawStepBuffers {
        &self.bufs
    }

    /// A [`StepBuffers`] view sized to the layout (not to the buffers' full capacity), so
    /// `build_step` refuses batches the layout does not allow, naming the buffer.
    ///
    /// # Safety
    /// For as long as the returned view lives, the caller guarantees that every registered buffer
    /// is still allocated at the registered address with at least the registered length, and that
    /// no other code reads or writes that memory (no other Rust reference, no device copy in
    /// flight from or to it). `&mut self` makes two views from one registration impossible, but
    /// registering the same memory twice is not detected.
    pub unsafe fn as_step_buffers(&mut self) -> StepBuffers<'_> {
        let l = self.layout;
        let table = l.max_seqs * l.max_blocks_per_seq;
        // SAFETY (all below): validated non-null (or zero length), aligned, in range and pairwise
        // disjoint at registration; liveness and exclusivity are the caller's contract above.
        unsafe fn sl<'b, T>(b: RawBuffer, len: usize) -> &'b mut [T] {
            if len == 0 {
                return &mut [];
            }
            unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut T, len) }
        }
        let b = self.bufs;
        let (seqs1, seqs, kv) = if b.has_csr() {
            (l.max_seqs + 1, l.max_seqs, table)
        } else {
            (0, 0, 0)
        };
        unsafe {
            StepBuffers {
                slot_mapping: sl(b.slot_mapping, l.max_tokens),
                block_tables: sl(b.block_tables, table),
                block_table_stride: l.max_blocks_per_seq,
                seq_lens: sl(b.seq_lens, l.max_seqs),
                query_start_loc: sl(b.query_start_loc, l.max_seqs + 1),
                kv_indptr: sl(b.kv_indptr, seqs1),
                kv_indices: sl(b.kv_indices, kv),
                kv_last_page_len: sl(b.kv_last_page_len, seqs),
                copies: sl(b.copies, 2 * l.max_copies),
                swap_out: sl(b.swap_out, 2 * l.max_swaps),
                swap_in: sl(b.swap_in, 2 * l.max_swaps),
            }
        }
    }
}

/// Owned storage for a [`StepBuffers`] (tests, benches and Rust callers that do not bring their
/// own memory), sized for a [`StepLayout`].
#[derive(Debug, Clone, Default)]
pub struct OwnedStepBuffers {
    /// Physical slot of each new token; see [`StepBuffers::slot_mapping`].
    pub slot_mapping: Vec<i64>,
    /// `[max_seqs, block_table_stride]`, row-major; see [`StepBuffers::block_tables`].
    pub block_tables: Vec<i32>,
    /// Row width of `block_tables` (the layout's `max_blocks_per_seq`).
    pub block_table_stride: usize,
    /// Length of each sequence, new tokens included.
    pub seq_lens: Vec<i32>,
    /// Cumulative new-token counts, starting at 0.
    pub query_start_loc: Vec<i32>,
    /// FlashInfer CSR row pointers into `kv_indices`.
    pub kv_indptr: Vec<i32>,
    /// FlashInfer CSR page ids, every sequence's blocks concatenated.
    pub kv_indices: Vec<i32>,
    /// Tokens in each sequence's last page, `((len - 1) % B) + 1`.
    pub kv_last_page_len: Vec<i32>,
    /// Pending copy-on-write copies, flat `(src, dst)` block pairs.
    pub copies: Vec<i64>,
    /// Queued swap-out copies, flat `(device, host)` block pairs.
    pub swap_out: Vec<i64>,
    /// Queued swap-in copies, flat `(host, device)` block pairs.
    pub swap_in: Vec<i64>,
}

impl OwnedStepBuffers {
    /// Zero-filled buffers exactly as large as `layout` requires.
    pub fn new(layout: StepLayout) -> Self {
        let t = layout.max_seqs * layout.max_blocks_per_seq;
        Self {
            slot_mapping: vec![0; layout.max_tokens],
            block_tables: vec![0; t],
            block_table_stride: layout.max_blocks_per_seq,
            seq_lens: vec![0; layout.max_seqs],
            query_start_loc: vec![0; layout.max_seqs + 1],
            kv_indptr: vec![0; layout.max_seqs + 1],
            kv_indices: vec![0; t],
            kv_last_page_len: vec![0; layout.max_seqs],
            copies: vec![0; 2 * layout.max_copies],
            swap_out: vec![0; 2 * layout.max_swaps],
            swap_in: vec![0; 2 * layout.max_swaps],
        }
    }

    /// These buffers described by address, for [`RegisteredBuffers::new`]. The addresses stay
    /// valid while `self` is neither dropped nor resized.
    pub fn raw(&mut self) -> RawStepBuffers {
        fn r<T>(v: &mut [T], dtype: DType) -> RawBuffer {
            RawBuffer {
                ptr: v.as_mut_ptr() as usize,
                len: v.len(),
                dtype,
            }
        }
        RawStepBuffers {
            slot_mapping: r(&mut self.slot_mapping, DType::I64),
            block_tables: r(&mut self.block_tables, DType::I32),
            seq_lens: r(&mut self.seq_lens, DType::I32),
            query_start_loc: r(&mut self.query_start_loc, DType::I32),
            kv_indptr: r(&mut self.kv_indptr, DType::I32),
            kv_indices: r(&mut self.kv_indices, DType::I32),
            kv_last_page_len: r(&mut self.kv_last_page_len, DType::I32),
            copies: r(&mut self.copies, DType::I64),
            swap_out: r(&mut self.swap_out, DType::I64),
            swap_in: r(&mut self.swap_in, DType::I64),
        }
    }

    /// A borrowed view for `build_step`.
    pub fn view(&mut self) -> StepBuffers<'_> {
        StepBuffers {
            slot_mapping: &mut self.slot_mapping,
            block_tables: &mut self.block_tables,
            block_table_stride: self.block_table_stride,
            seq_lens: &mut self.seq_lens,
            query_start_loc: &mut self.query_start_loc,
            kv_indptr: &mut self.kv_indptr,
            kv_indices: &mut self.kv_indices,
            kv_last_page_len: &mut self.kv_last_page_len,
            copies: &mut self.copies,
            swap_out: &mut self.swap_out,
            swap_in: &mut self.swap_in,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> StepLayout {
        StepLayout {
            max_seqs: 4,
            max_tokens: 16,
            max_blocks_per_seq: 8,
            max_copies: 2,
            max_swaps: 3,
        }
    }

    fn mem(l: StepLayout) -> (OwnedStepBuffers, RawStepBuffers) {
        let mut o = OwnedStepBuffers::new(l);
        let raw = o.raw();
        (o, raw)
    }

    #[test]
    fn accepts_valid_and_views_write_through() {
        let (m, raw) = mem(layout());
        let mut reg = RegisteredBuffers::new(layout(), raw).unwrap();
        {
            let v = unsafe { reg.as_step_buffers() };
            assert_eq!(v.slot_mapping.len(), 16);
            assert_eq!(v.block_tables.len(), 32);
            assert_eq!(v.block_table_stride, 8);
            assert_eq!(v.query_start_loc.len(), 5);
            assert_eq!(v.copies.len(), 4);
            v.seq_lens[3] = 42;
        }
        assert_eq!(m.seq_lens[3], 42);
    }

    #[test]
    fn rejects_wrong_dtype_null_misaligned_small_and_overlap() {
        let (_m, raw) = mem(layout());
        let mut r = raw;
        r.seq_lens.dtype = DType::I64;
        assert!(matches!(
            RegisteredBuffers::new(layout(), r),
            Err(Error::BufferInvalid {
                buffer: "seq_lens",
                expected: "int32",
                ..
            })
        ));
        let mut r = raw;
        r.kv_indptr.ptr = 0;
        assert!(matches!(
            RegisteredBuffers::new(layout(), r),
            Err(Error::BufferInvalid {
                buffer: "kv_indptr",
                ..
            })
        ));
        let mut r = raw;
        r.slot_mapping.ptr += 4;
        r.slot_mapping.len -= 1;
        assert!(matches!(
            RegisteredBuffers::new(layout(), r),
            Err(Error::BufferInvalid {
                buffer: "slot_mapping",
                ..
            })
        ));
        let mut r = raw;
        r.kv_indices.len = 31;
        assert_eq!(
            RegisteredBuffers::new(layout(), r),
            Err(Error::BufferTooSmall {
                buffer: "kv_indices",
                needed: 32,
                capacity: 31
            })
        );
        let mut r = raw;
        r.kv_last_page_len = r.seq_lens;
        assert!(matches!(
            RegisteredBuffers::new(layout(), r),
            Err(Error::BufferInvalid {
                buffer: "kv_last_page_len",
                ..
            })
        ));
        let mut l = layout();
        l.max_seqs = 0;
        assert!(matches!(
            RegisteredBuffers::new(l, raw),
            Err(Error::InvalidArgument {
                what: "max_seqs",
                ..
            })
        ));
    }

    #[test]
    fn csr_buffers_may_all_be_left_out() {
        let (_m, mut raw) = mem(layout());
        let empty = RawBuffer {
            ptr: 0,
            len: 0,
            dtype: DType::I32,
        };
        raw.kv_indptr = empty;
        raw.kv_indices = empty;
        assert!(matches!(
            RegisteredBuffers::new(layout(), raw),
            Err(Error::BufferInvalid {
                buffer: "kv_indptr",
                ..
            })
        ));
        raw.kv_last_page_len = empty;
        let mut reg = RegisteredBuffers::new(layout(), raw).unwrap();
        let v = unsafe { reg.as_step_buffers() };
        assert!(v.kv_indptr.is_empty() && v.kv_indices.is_empty() && v.kv_last_page_len.is_empty());
        assert_eq!(v.seq_lens.len(), 4);
    }

    #[test]
    fn null_allowed_only_for_empty_copies() {
        let mut l = layout();
        l.max_copies = 0;
        let (_m, mut raw) = mem(l);
        raw.copies = RawBuffer {
            ptr: 0,
            len: 0,
            dtype: DType::I64,
        };
        let mut reg = RegisteredBuffers::new(l, raw).unwrap();
        assert!(unsafe { reg.as_step_buffers() }.copies.is_empty());
    }
}
