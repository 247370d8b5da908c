//! `_core.StepArena`: the host memory of one set of step buffers, allocated and owned by the
//! extension.
//!
//! The manager's `step` writes through raw addresses with the GIL released, so the memory behind
//! those addresses must not be Python's to free, move or resize. The arena is one zeroed,
//! page-aligned allocation made here; Python reaches it only through [`PyStepArena::array`], a
//! numpy `uint8` array whose base object is the arena itself (numpy refuses to resize an array that
//! does not own its data, and `torch.from_numpy` over it gives a non-resizable storage). Every view
//! therefore keeps the arena alive, and so does every manager it is attached to: the memory is
//! freed only when nothing refers to it, after it has been unpinned.
//!
//! Invariants:
//! - the allocation, its address and its size never change for the arena's life;
//! - the ten fields lie at fixed, 64-byte aligned, pairwise disjoint offsets inside it (arena
//!   order below), sized exactly for the [`StepLayout`] it was built for; an arena for `G` KV
//!   cache groups adds, after them, one slot mapping (`max_tokens` int64) and one block-table
//!   buffer (`max_seqs * max_blocks_per_seq` int32) for each group `1..G`, placed the same way;
//! - at most one manager holds it at a time ([`PyStepArena::claim`] / [`PyStepArena::release`]):
//!   two managers writing block-table rows into one buffer would each trust incremental rows the
//!   other overwrote;
//! - when pinned (`cudaHostRegister`, through torch's `cudart` module), it is unregistered before
//!   the memory is freed.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pagedkv::step::{DType, RawBuffer, RawStepBuffers, RegisteredBuffers, StepLayout, NBUF};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{count, flag};
use crate::errors::{alloc_failed, invalid_arg, CoreResultExt};

/// Field names, in the order of [`RawStepBuffers`]' fields.
pub const FIELDS: [&str; NBUF] = [
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

/// Element size of each field (int64 for the slot mapping and the copy and swap lists, int32
/// elsewhere).
const ELEM: [usize; NBUF] = [8, 4, 4, 4, 4, 4, 4, 8, 8, 8];

/// Arena order, as indices into [`FIELDS`]: the small per-sequence fields first, the large tables
/// last, so the used parts of one step lie close together and a host-to-device copy can move them
/// in one or two spans.
const ARENA_ORDER: [usize; NBUF] = [2, 3, 4, 6, 7, 8, 9, 0, 1, 5];

/// Each field starts on its own cache line: keeps every dtype aligned and stops two fields written
/// back to back from sharing a line.
const FIELD_ALIGN: u128 = 64;

/// The allocation is page-aligned and a whole number of pages, which is what `cudaHostRegister`
/// pins anyway.
const PAGE: usize = 4096;

/// An owned, zeroed, page-aligned allocation.
struct Memory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Memory` is a uniquely owned allocation; the pointer is only dereferenced through the
// views handed out under the rules of the module doc.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    /// `None` when the allocator refuses (the request is too large for the address space or the
    /// system), never an abort.
    fn zeroed(bytes: usize) -> Option<Self> {
        let size = bytes.max(1).checked_next_multiple_of(PAGE)?;
        let layout = Layout::from_size_align(size, PAGE).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(Self { ptr, layout })
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// What a pinned arena calls before its memory is freed: `cudaHostUnregister`, and the
/// synchronize to run first.
struct PinRelease {
    unregister: Py<PyAny>,
    synchronize: Option<Py<PyAny>>,
}

/// Element sizes of a group's two fields: its slot mapping (int64) and block tables (int32).
const GROUP_ELEM: [usize; 2] = [8, 4];

/// The raw fields of KV cache group `g >= 1`: `(slot_mapping, block_tables)`, `(address, len)`
/// each; addresses are 0 only for empty fields (never, for a valid layout).
pub type GroupRaw = [(usize, usize); 2];

/// Host memory for the step buffers of one [`StepLayout`]; see the module doc.
#[pyclass(frozen, weakref, module = "pagedkv._core", name = "StepArena")]
pub struct PyStepArena {
    mem: Memory,
    layout: StepLayout,
    csr: bool,
    /// Byte offset of each field, in [`FIELDS`] order.
    offsets: [usize; NBUF],
    /// Element count of each field, in [`FIELDS`] order.
    lens: [usize; NBUF],
    /// Per KV cache group after group 0: `(byte_offset, numel)` of its slot mapping and of its
    /// block tables.
    group_fields: Vec<[(usize, usize); 2]>,
    /// Bytes the fields span (the allocation is this, rounded up to whole pages).
    nbytes: usize,
    /// The id of the manager the arena is attached to; 0 when none.
    owner: AtomicU64,
    /// When the arena is pinned: `cudaHostUnregister`, and what to call before it (a device
    /// synchronize, so no asynchronous copy still reads the memory); both run before the memory
    /// is freed.
    unpin: Mutex<Option<PinRelease>>,
}

impl PyStepArena {
    pub fn layout(&self) -> StepLayout {
        self.layout
    }

    /// The fields by address, for [`RegisteredBuffers::new`]; valid for the arena's life.
    pub fn raw(&self) -> RawStepBuffers {
        let base = self.mem.ptr.as_ptr() as usize;
        let f = |i: usize| RawBuffer {
            // A zero-length field gets no address: the core accepts null only for empty buffers
            // and must never be handed an address it could write through.
            ptr: if self.lens[i] == 0 {
                0
            } else {
                base + self.offsets[i]
            },
            len: self.lens[i],
            dtype: if ELEM[i] == 8 { DType::I64 } else { DType::I32 },
        };
        RawStepBuffers {
            slot_mapping: f(0),
            block_tables: f(1),
            seq_lens: f(2),
            query_start_loc: f(3),
            kv_indptr: f(4),
            kv_indices: f(5),
            kv_last_page_len: f(6),
            copies: f(7),
            swap_out: f(8),
            swap_in: f(9),
        }
    }

    /// KV cache groups the arena holds buffers for (group 0's are the ten base fields).
    pub fn num_groups(&self) -> usize {
        1 + self.group_fields.len()
    }

    /// The fields of groups `1..G` by address, valid for the arena's life.
    pub fn group_raw(&self) -> Vec<GroupRaw> {
        let base = self.mem.ptr.as_ptr() as usize;
        self.group_fields
            .iter()
            .map(|f| f.map(|(off, len)| (if len == 0 { 0 } else { base + off }, len)))
            .collect()
    }

    /// Takes the arena for manager `id`. `Ok(())` when it was free or already `id`'s; `Err` with
    /// nothing changed when another manager holds it.
    pub fn claim(&self, id: u64) -> Result<(), ()> {
        match self
            .owner
            .compare_exchange(0, id, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(cur) if cur == id => Ok(()),
            Err(_) => Err(()),
        }
    }

    fn is_pinned(&self) -> bool {
        self.unpin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Gives the arena back if manager `id` holds it.
    pub fn release(&self, id: u64) {
        let _ = self
            .owner
            .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Byte offsets (arena order, 64-byte aligned) and total span of fields with element counts
/// `lens`, then of `extra` groups' two fields with counts `group_lens` each; computed in `u128`,
/// so no layout the caller can ask for overflows.
fn place(
    lens: &[u128; NBUF],
    group_lens: [u128; 2],
    extra: usize,
) -> ([u128; NBUF], Vec<[u128; 2]>, u128) {
    let mut offsets = [0u128; NBUF];
    let mut total = 0u128;
    for &i in &ARENA_ORDER {
        total = total.div_ceil(FIELD_ALIGN) * FIELD_ALIGN;
        offsets[i] = total;
        total += lens[i] * ELEM[i] as u128;
    }
    let mut groups = Vec::with_capacity(extra);
    for _ in 0..extra {
        let mut g = [0u128; 2];
        for j in 0..2 {
            total = total.div_ceil(FIELD_ALIGN) * FIELD_ALIGN;
            g[j] = total;
            total += group_lens[j] * GROUP_ELEM[j] as u128;
        }
        groups.push(g);
    }
    (offsets, groups, total)
}

/// Most KV cache groups one arena holds buffers for: the core's limit on a manager's groups.
const MAX_ARENA_GROUPS: usize = pagedkv::manager::MAX_GROUPS;

#[pymethods]
impl PyStepArena {
    /// Allocates zeroed host memory for step buffers of this layout. Sizes are counts (bools are
    /// refused); `max_seqs`, `max_tokens`, `max_blocks_per_seq` must be in `1..=2**31 - 1`;
    /// `groups` (default 1) is the number of KV cache groups, each after the first getting its
    /// own slot mapping and block tables. Raises AllocationFailedError when the memory cannot be
    /// had.
    #[new]
    #[pyo3(signature = (max_seqs, max_tokens, max_blocks_per_seq, max_copies, csr, max_swaps=None, groups=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_seqs: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        max_blocks_per_seq: &Bound<'_, PyAny>,
        max_copies: &Bound<'_, PyAny>,
        csr: &Bound<'_, PyAny>,
        max_swaps: Option<Bound<'_, PyAny>>,
        groups: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let layout = StepLayout {
            max_seqs: count("max_seqs", max_seqs)?,
            max_tokens: count("max_tokens", max_tokens)?,
            max_blocks_per_seq: count("max_blocks_per_seq", max_blocks_per_seq)?,
            max_copies: count("max_copies", max_copies)?,
            max_swaps: match max_swaps.as_ref().filter(|o| !o.is_none()) {
                Some(m) => count("max_swaps", m)?,
                None => 0,
            },
        };
        let csr = flag("csr", csr)?;
        let num_groups = match groups.as_ref().filter(|o| !o.is_none()) {
            Some(g) => {
                let n = count("groups", g)?;
                if n == 0 || n > MAX_ARENA_GROUPS {
                    return Err(invalid_arg(
                        "groups",
                        g,
                        format!("must be in [1, {MAX_ARENA_GROUPS}]"),
                    ));
                }
                n
            }
            None => 1,
        };
        for (what, obj, v) in [
            ("max_seqs", max_seqs, layout.max_seqs),
            ("max_tokens", max_tokens, layout.max_tokens),
            (
                "max_blocks_per_seq",
                max_blocks_per_seq,
                layout.max_blocks_per_seq,
            ),
        ] {
            if v == 0 || v > i32::MAX as usize {
                return Err(invalid_arg(what, obj, "must be in [1, 2147483647]"));
            }
        }
        let (s, b, c) = (
            layout.max_seqs as u128,
            layout.max_blocks_per_seq as u128,
            u128::from(csr),
        );
        let lens = [
            layout.max_tokens as u128,
            s * b,
            s,
            s + 1,
            c * (s + 1),
            c * s * b,
            c * s,
            2 * layout.max_copies as u128,
            2 * layout.max_swaps as u128,
            2 * layout.max_swaps as u128,
        ];
        let (offsets, group_offsets, total) =
            place(&lens, [layout.max_tokens as u128, s * b], num_groups - 1);
        let what = "step buffers (host arena)";
        if total > (isize::MAX as u128) - PAGE as u128 {
            return Err(alloc_failed(py, what, total));
        }
        let nbytes = total as usize;
        // Zeroing a large arena touches every page; do it without the GIL.
        let mem = py
            .detach(move || Memory::zeroed(nbytes))
            .ok_or_else(|| alloc_failed(py, what, total))?;
        let arena = Self {
            mem,
            layout,
            csr,
            offsets: offsets.map(|o| o as usize),
            lens: lens.map(|l| l as usize),
            group_fields: group_offsets
                .iter()
                .map(|g| {
                    [
                        (g[0] as usize, layout.max_tokens),
                        (g[1] as usize, layout.max_seqs * layout.max_blocks_per_seq),
                    ]
                })
                .collect(),
            nbytes,
            owner: AtomicU64::new(0),
            unpin: Mutex::new(None),
        };
        // The core's own validation (dtypes, alignment, capacity, no overlap) must accept what is
        // placed here; it runs again at every attach.
        RegisteredBuffers::new(layout, arena.raw()).py()?;
        Ok(arena)
    }

    /// Bytes the fields span.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Address of the first byte (for inspection; nothing takes an address back).
    #[getter]
    fn address(&self) -> usize {
        self.mem.ptr.as_ptr() as usize
    }

    #[getter]
    fn csr(&self) -> bool {
        self.csr
    }

    /// Whether the arena is registered with CUDA as page-locked memory.
    #[getter]
    fn pinned(&self) -> bool {
        self.is_pinned()
    }

    /// Whether a manager holds the arena.
    #[getter]
    fn attached(&self) -> bool {
        self.owner.load(Ordering::Acquire) != 0
    }

    /// KV cache groups the arena holds buffers for.
    #[getter(num_groups)]
    fn py_num_groups(&self) -> usize {
        self.num_groups()
    }

    /// Per KV cache group after group 0: `((slot_mapping_offset, numel), (block_tables_offset,
    /// numel))`, byte offsets into the arena.
    fn group_fields(&self) -> Vec<[(usize, usize); 2]> {
        self.group_fields.clone()
    }

    /// `{field: (byte_offset, numel)}` for the ten fields.
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (i, name) in FIELDS.iter().enumerate() {
            d.set_item(*name, (self.offsets[i], self.lens[i]))?;
        }
        Ok(d)
    }

    /// The whole arena as a writable 1-D numpy `uint8` array of `nbytes` elements whose base is
    /// this object; numpy refuses to resize it, and it keeps the arena alive.
    fn array<'py>(slf: Bound<'py, Self>) -> Bound<'py, PyArray1<u8>> {
        let me = slf.get();
        // SAFETY: `nbytes` bytes at `ptr` are allocated, initialised (zeroed) and live as long as
        // the arena object, which the array holds as its base.
        let view =
            unsafe { ArrayView1::from_shape_ptr(me.nbytes, me.mem.ptr.as_ptr().cast_const()) };
        // SAFETY: the container (the arena) owns the memory and outlives the array; no Rust
        // reference to it exists outside a step, whose exclusivity is the documented contract.
        unsafe { PyArray1::borrow_from_array(&view, slf.into_any()) }
    }

    /// Pins the arena with `cudart.cudaHostRegister` (torch's `torch.cuda.cudart()` module) so
    /// host-to-device copies from it can be asynchronous. Before the memory is freed, the arena
    /// calls `synchronize()` (if given: it should wait for every copy that may read the arena)
    /// and then `cudart.cudaHostUnregister`. A second call does nothing. Raises
    /// AllocationFailedError if CUDA refuses.
    #[pyo3(signature = (cudart, synchronize=None))]
    fn pin(
        &self,
        py: Python<'_>,
        cudart: &Bound<'_, PyAny>,
        synchronize: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // The lock is never held while Python code runs (`cudart` is Python, and it may call
        // back into this arena, or release the GIL for a thread that then waits on the lock).
        if self.is_pinned() {
            return Ok(());
        }
        let unregister = cudart.getattr("cudaHostUnregister")?;
        let size = self.mem.layout.size();
        let rc = cudart.call_method1("cudaHostRegister", (self.address(), size, 0))?;
        let code: i64 = rc.call_method0("__int__")?.extract()?;
        let mut slot = self.unpin.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            // Pinned meanwhile by another call (ours then failed: the range is registered once).
            return Ok(());
        }
        if code != 0 {
            drop(slot);
            return Err(alloc_failed(
                py,
                &format!("pinned step buffers (cudaHostRegister error {code})"),
                size as u128,
            ));
        }
        *slot = Some(PinRelease {
            unregister: unregister.unbind(),
            synchronize: synchronize.filter(|s| !s.is_none()).map(Bound::unbind),
        });
        Ok(())
    }

    fn __repr__(&self) -> String {
        let l = self.layout;
        format!(
            "StepArena(max_seqs={}, max_tokens={}, max_blocks_per_seq={}, max_copies={}, max_swaps={}, csr={}, groups={}, nbytes={})",
            l.max_seqs,
            l.max_tokens,
            l.max_blocks_per_seq,
            l.max_copies,
            l.max_swaps,
            if self.csr { "True" } else { "False" },
            self.num_groups(),
            self.nbytes
        )
    }
}

impl Drop for PyStepArena {
    fn drop(&mut self) {
        let unpin = self
            .unpin
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(PinRelease {
            unregister,
            synchronize,
        }) = unpin
        {
            let addr = self.mem.ptr.as_ptr() as usize;
            // The memory is freed right after this (field drop); an error here (CUDA already
            // torn down at exit) leaves nothing to undo.
            Python::attach(|py| {
                if let Some(sync) = synchronize {
                    let _ = sync.bind(py).call0();
                }
                let _ = unregister.bind(py).call1((addr,));
            });
        }
    }
}
