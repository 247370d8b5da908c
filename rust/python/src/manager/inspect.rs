//! Read-only queries (membership, lengths, block tables, hashes, refcounts), the counters, the
//! KV-event ring, the prefix-cache reset and `check_invariants`.

use pagedkv::groups::NULL_BLOCK;
use pagedkv::metrics::Stats;
use pagedkv::BlockId;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList};

use super::{opt, seq, PyBlockManager};
use crate::convert::{count, scalar};
use crate::errors::CoreResultExt;

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    crate::stats::to_dict(py, s)
}
#[pymethods]
impl PyBlockManager {
    /// KV-event records dropped because the ring was full (the oldest are dropped first).
    #[getter]
    fn kv_events_dropped(&self, py: Python<'_>) -> u64 {
        self.with(py, |st| st.inner.events_dropped())
    }

    /// Drains the KV-event ring, oldest first: `(kind, medium, block_hashes, parent_hash,
    /// token_ids, block_size, group)` tuples, kind `"stored" | "removed" | "cleared"`, medium
    /// `"GPU" | "CPU"`, group the KV cache group of the blocks (0 without groups, and for
    /// `"cleared"`). Copied out under the lock; the Python objects are built after releasing it.
    fn drain_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with(py, |st| {
            let mut out = Vec::new();
            st.inner.drain_events(&mut out);
            out
        });
        let items = events
            .into_iter()
            .map(|e| {
                (
                    e.kind.name(),
                    e.medium.name(),
                    e.block_hashes,
                    e.parent_hash,
                    e.token_ids,
                    e.block_size,
                    e.group,
                )
            })
            .collect::<Vec<_>>();
        PyList::new(py, items)
    }

    /// `(group, hash)` of every block the device prefix cache holds (held or cached-free),
    /// sorted, hashes as ints: what the device tier's stored / removed events add up to.
    /// O(hashed blocks), for tests and diagnostics.
    fn cached_block_keys(&self, py: Python<'_>) -> Vec<(usize, u128)> {
        self.with(py, |st| st.inner.cached_block_keys())
    }

    /// Forgets every prefix-cache entry; returns the number of blocks dropped from the cache.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, true, |st| st.inner.reset_prefix_cache()).py()
    }

    /// Whether `seq_id` is live; False for anything that is not a valid id (a bool included).
    fn contains(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> bool {
        if seq_id.is_instance_of::<PyBool>() {
            return false;
        }
        match seq_id.extract::<u64>() {
            Ok(id) => self.with(py, |st| st.inner.contains(id)),
            Err(_) => false,
        }
    }

    fn __contains__(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> bool {
        self.contains(py, seq_id)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_seqs())
    }

    /// Tokens in a live sequence.
    fn seq_len(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.seq_len(id)).py()
    }

    /// A live sequence's block table in KV cache group `group` (default 0), as a list of block
    /// ids; -1 for a position the group released.
    #[pyo3(signature = (seq_id, group=None))]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        group: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = seq("seq_id", seq_id)?;
        let g = opt(&group).map(|g| count("group", g)).transpose()?;
        let Some(g) = g.filter(|&g| g != 0) else {
            let table = self
                .with(py, |st| st.inner.block_table(id).map(<[BlockId]>::to_vec))
                .py()?;
            if table.first() != Some(&NULL_BLOCK) {
                return PyList::new(py, table);
            }
            // A windowed group 0 (every group windowed) released its leading blocks.
            let table = table
                .iter()
                .map(|&b| if b == NULL_BLOCK { -1 } else { i64::from(b) });
            return PyList::new(py, table);
        };
        let table = self
            .with(py, |st| {
                st.inner.block_table_group(id, g).map(|t| {
                    t.iter()
                        .map(|&b| if b == NULL_BLOCK { -1 } else { i64::from(b) })
                        .collect::<Vec<i64>>()
                })
            })
            .py()?;
        PyList::new(py, table)
    }

    /// Live sequences.
    fn num_seqs(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_seqs())
    }

    /// Free plus cached-free (evictable) blocks.
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_free_blocks())
    }

    /// The core's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |st| st.inner.stats());
        stats_dict(py, &s)
    }

    /// Cross-checks the manager's state; raises InvariantViolationError on inconsistency.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, true, |st| st.inner.check_invariants()).py()
    }

    /// The prefix hash of each block of a live sequence's table, 16 little-endian bytes, or None
    /// for a block not (yet) in the prefix cache (a partial tail, or before the step that
    /// registers it).
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = seq("seq_id", seq_id)?;
        let hashes: Vec<Option<u128>> = self
            .with(py, |st| {
                let table = st.inner.block_table(id)?;
                Ok(table.iter().map(|&b| st.inner.block_hash(b)).collect())
            })
            .py()?;
        let items: Vec<Option<Bound<'py, PyBytes>>> = hashes
            .iter()
            .map(|h| h.map(|h| PyBytes::new(py, &h.to_le_bytes())))
            .collect();
        PyList::new(py, items)
    }

    /// Reference count of a block (InvalidBlockError outside the pool).
    fn block_refcount(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = scalar::<u32>("block", block)?;
        self.with(py, |st| st.inner.block_refcount(b)).py()
    }
}
