//! `step` and the step buffers it fills: attaching a `StepArena`, detaching it, and the
//! incremental block-table rows.
//!
//! Invariant: a registration holds a strong reference to its arena and the arena's single-owner
//! claim for this manager, so the raw addresses the core writes through stay valid and unshared.

use pagedkv::step::{GroupStepBuffers, RegisteredBuffers, StepInfo};
use pagedkv::{Error, SeqId};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use super::{scratch, PyBlockManager, State, COUNTS, DETACH_MIN, SEQS};
use crate::buffers::{GroupRaw, PyStepArena};
use crate::convert::{scalar, with_ids};
use crate::errors::{invalid_arg, CoreResultExt};

/// What `step` returns to Python: `(num_seqs, num_tokens, num_kv_indices, num_copies,
/// max_seq_len, num_swap_out, num_swap_in, max_query_len)`, the order `StepInfo` declares.
type StepTuple = (usize, usize, usize, usize, usize, usize, usize, usize);
/// Step buffers registered with the core, and the arena that owns their memory.
pub(super) struct Registered {
    bufs: RegisteredBuffers,
    /// The arena's fields for KV cache groups `1..G` (as many as the manager has groups).
    groups: Vec<GroupRaw>,
    /// Row width of every group's block tables (the layout's `max_blocks_per_seq`).
    group_stride: usize,
    /// The arena the raw pointers point into; this strong reference keeps it allocated.
    arena: Py<PyStepArena>,
    /// The manager id that claimed the arena; given back when the registration goes.
    owner: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Usually released already, under the manager's lock; this covers the manager's own end.
        // Releasing twice is harmless: it only clears the owner if it is still ours.
        self.arena.get().release(self.owner);
    }
}
impl State {
    fn step(&mut self, seqs: &[SeqId], counts: &[u32]) -> pagedkv::Result<StepInfo> {
        let Some(reg) = self.registered.as_mut() else {
            return Err(Error::BuffersNotRegistered);
        };
        // SAFETY: the registered memory is the arena `reg.arena` owns; that strong reference
        // keeps it allocated at a fixed address for as long as the registration exists, and
        // Python can neither free nor resize it (it only ever sees non-owning, non-resizable
        // views). The lock held by our caller excludes a second view from this manager, and the
        // arena's single-owner claim excludes other managers. That no Python code reads or
        // writes the host buffers while a step fills them is the documented contract of
        // `StepBuffers` (do not touch them, or copy from them, during a step).
        let mut out = unsafe { reg.bufs.as_step_buffers() };
        if reg.groups.is_empty() {
            return self.inner.build_step(seqs, counts, &mut out);
        }
        let stride = reg.group_stride;
        let mut groups: Vec<GroupStepBuffers<'_>> = reg
            .groups
            .iter()
            .map(|&[(sp, sn), (tp, tn)]| GroupStepBuffers {
                // SAFETY: as above: each field is `len` elements of its dtype at a 64-byte aligned
                // offset of the arena `reg.arena` keeps allocated, disjoint from every other field
                // (the arena's placement), non-empty (so the address is not null); nothing else
                // refers to it while the lock is held.
                slot_mapping: unsafe { std::slice::from_raw_parts_mut(sp as *mut i64, sn) },
                block_tables: unsafe { std::slice::from_raw_parts_mut(tp as *mut i32, tn) },
                block_table_stride: stride,
            })
            .collect();
        self.inner
            .build_step_groups(seqs, counts, &mut out, &mut groups)
    }
}

#[pymethods]
impl PyBlockManager {
    /// Whether step buffers are registered.
    #[getter]
    fn has_buffers(&self, py: Python<'_>) -> bool {
        self.with(py, |st| st.registered.is_some())
    }

    /// Attaches the step buffers whose memory `arena` owns (a `StepArena`, never an address).
    /// The manager holds the arena until detached, replaced or dropped; an arena belongs to one
    /// manager at a time (BufferInvalidError naming the other manager otherwise). Attaching
    /// resets the incremental block-table rows, so the next step writes its rows in full. On
    /// error the earlier registration stays.
    fn attach_buffers(&self, py: Python<'_>, arena: &Bound<'_, PyAny>) -> PyResult<()> {
        let arena = arena.cast::<PyStepArena>().map_err(|_| {
            invalid_arg(
                "buffers",
                arena,
                "must be the StepArena of a pagedkv.StepBuffers (memory the extension owns)",
            )
        })?;
        let a = arena.get();
        let want = self.cfg.num_groups();
        if a.num_groups() != want {
            return Err(Error::BufferInvalid {
                buffer: "step buffers",
                expected: "one slot mapping and block-table buffer per KV cache group of the manager",
                got: format!(
                    "buffers for {} KV cache group(s), the manager has {want} (StepBuffers(num_groups={want}))",
                    a.num_groups()
                ),
            })
            .py();
        }
        let bufs = RegisteredBuffers::new(a.layout(), a.raw()).py()?;
        let groups = a.group_raw();
        let group_stride = a.layout().max_blocks_per_seq;
        let arena = arena.clone().unbind();
        let id = self.id;
        // The replaced registration is dropped after the lock is released (dropping the last
        // reference to an arena runs its destructor, which may call into CUDA through Python).
        let replaced = self.with(py, move |st| {
            if let Some(reg) = &st.registered {
                if reg.arena.as_ptr() == arena.as_ptr() {
                    // Already ours: only forget what the rows held.
                    st.inner.invalidate_step_cache();
                    return Ok((None, Some(arena)));
                }
            }
            if arena.get().claim(id).is_err() {
                return Err((
                    Error::BufferInvalid {
                        buffer: "step buffers",
                        expected: "a buffer set no other manager holds",
                        got: "attached to another BlockManager (detach it there first)".into(),
                    },
                    arena,
                ));
            }
            // Other memory may now sit at an address the old rows were written to.
            st.inner.invalidate_step_cache();
            let old = st.registered.replace(Registered {
                bufs,
                groups,
                group_stride,
                arena,
                owner: id,
            });
            // Give the old arena back now (an atomic store), not when `old` is dropped later.
            if let Some(o) = &old {
                o.arena.get().release(id);
            }
            Ok((old, None))
        });
        match replaced {
            Ok(dropped) => {
                drop(dropped);
                Ok(())
            }
            Err((e, arena)) => {
                drop(arena);
                Err(e).py()
            }
        }
    }

    /// Drops the registered step buffers (and the reference keeping their arena alive), giving
    /// the arena back so another manager may attach it.
    fn detach_buffers(&self, py: Python<'_>) {
        let old = self.with(py, |st| {
            let old = st.registered.take();
            if let Some(o) = &old {
                o.arena.get().release(o.owner);
            }
            old
        });
        drop(old);
    }

    /// Makes the next step write every block-table row of its batch in full; call it after
    /// writing into the registered `block_tables` yourself.
    fn invalidate_step_cache(&self, py: Python<'_>) {
        self.with(py, |st| st.inner.invalidate_step_cache());
    }

    /// Fills the registered buffers for one step; returns `(num_seqs, num_tokens,
    /// num_kv_indices, num_copies, max_seq_len, num_swap_out, num_swap_in, max_query_len)`.
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<StepTuple> {
        let info = scratch(&SEQS, |sbuf| {
            with_ids("seq_ids", seq_ids, sbuf, |seqs| {
                let detach = seqs.len() >= DETACH_MIN;
                scratch(&COUNTS, |counts| {
                    if num_new_tokens.is_instance_of::<PyInt>() {
                        // One count for every sequence (a decode step): broadcast it (`scalar` refuses a bool).
                        let n = scalar::<u32>("num_new_tokens", num_new_tokens)?;
                        counts.clear();
                        counts.resize(seqs.len(), n);
                        let counts = &counts[..];
                        Ok(self.run(py, detach, |st| st.step(seqs, counts)))
                    } else {
                        with_ids("num_new_tokens", num_new_tokens, counts, |n| {
                            Ok(self.run(py, detach, |st| st.step(seqs, n)))
                        })
                    }
                })
            })
        })?
        .py()?;
        Ok((
            info.num_seqs,
            info.num_tokens,
            info.num_kv_indices,
            info.num_copies,
            info.max_seq_len,
            info.num_swap_out,
            info.num_swap_in,
            info.max_query_len,
        ))
    }

    /// Copy-on-write copies queued for the next step, as `(src, dst)` block pairs.
    fn pending_copies(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_copies().to_vec())
    }
}
