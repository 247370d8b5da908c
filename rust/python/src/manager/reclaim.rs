//! Reclaiming blocks from running sequences: swap out and in, recompute preemption and resume,
//! the victim choice and the cost model's swap-or-recompute decision, and the host pool's state.

use pagedkv::swap::CostModel;
use pyo3::prelude::*;

use super::admit::{admit_tuple, AdmitTuple};
use super::{opt, scratch, seq, PyBlockManager, DETACH_MIN, SEQS};
use crate::convert::{count, scalar, with_ids};
use crate::errors::CoreResultExt;

#[pymethods]
impl PyBlockManager {
    /// Moves running sequences (a forked group together) to host blocks; returns the
    /// `(device_block, host_block)` copies to make (also queued for the next step).
    fn swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u32)>> {
        scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| st.inner.swap_out(seqs)))
            })
        })?
        .py()
    }

    /// Brings swapped-out sequences back; returns the `(host_block, device_block)` copies to make
    /// (also queued for the next step).
    fn swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u32)>> {
        scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| st.inner.swap_in(seqs)))
            })
        })?
        .py()
    }

    /// Preempts by recompute: frees the blocks, keeps the length and token ids.
    fn recompute(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        self.run(py, true, |st| st.inner.recompute(id)).py()
    }

    /// Re-admits a sequence preempted by recompute from its kept tokens; returns the same
    /// tuple as `admit`.
    #[pyo3(signature = (seq_id, max_new_tokens=None))]
    fn resume(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        max_new_tokens: Option<Bound<'_, PyAny>>,
    ) -> PyResult<AdmitTuple> {
        let id = seq("seq_id", seq_id)?;
        let k = opt(&max_new_tokens)
            .map(|k| count("max_new_tokens", k))
            .transpose()?;
        let r = self.run(py, true, |st| st.inner.resume(id, k)).py()?;
        Ok(admit_tuple(&r))
    }

    /// The running members of the most recently admitted fork group, or None.
    fn choose_victim(&self, py: Python<'_>) -> Option<Vec<u64>> {
        self.run(py, true, |st| st.inner.choose_victim())
    }

    /// The cost model's choice for preempting `seq_ids` together: `(mode, swap_cost_s,
    /// recompute_cost_s, swap_possible, swap_blocks, recompute_tokens, batch_tokens)`.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    #[pyo3(signature = (seq_ids, host_link_bytes_per_s, prefill_tokens_per_s, kv_bytes_per_token,
                        step_floor_s=0.0, max_step_tokens=0, batch_tokens=None))]
    fn decide(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        host_link_bytes_per_s: f64,
        prefill_tokens_per_s: f64,
        kv_bytes_per_token: f64,
        step_floor_s: f64,
        max_step_tokens: u64,
        batch_tokens: Option<u64>,
    ) -> PyResult<(&'static str, f64, f64, bool, u64, u64, u64)> {
        let model = CostModel {
            host_link_bytes_per_s,
            prefill_tokens_per_s,
            kv_bytes_per_token,
            step_floor_s,
            max_step_tokens,
        };
        let d = scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| {
                    st.inner.decide_beside(seqs, &model, batch_tokens)
                }))
            })
        })?
        .py()?;
        Ok((
            d.mode.name(),
            d.swap_cost_s,
            d.recompute_cost_s,
            d.swap_possible,
            d.swap_blocks,
            d.recompute_tokens,
            d.batch_tokens,
        ))
    }

    /// `"running"`, `"swapped"` or `"recompute"`.
    fn seq_state(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.seq_state(id).map(|s| s.name()))
            .py()
    }

    /// Swap-out copies `(device, host)` queued for the next steps.
    fn pending_swap_out(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_swap_out().to_vec())
    }

    /// Swap-in copies `(host, device)` queued for the next steps.
    fn pending_swap_in(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_swap_in().to_vec())
    }

    /// Free blocks of the host pool.
    fn num_free_host_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_free_host_blocks())
    }

    /// Reference count of a host block (InvalidBlockError outside the host pool).
    fn host_block_refcount(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = scalar::<u32>("block", block)?;
        self.with(py, |st| st.inner.host_block_refcount(b)).py()
    }
}
