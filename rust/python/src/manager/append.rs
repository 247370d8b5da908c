//! Growing and releasing sequences: `append`, `append_batch`, `fork`, `free`, `free_batch`.

use pyo3::prelude::*;

use super::{scratch, seq, PyBlockManager, DETACH_MIN, SEQS, TOKENS};
use crate::convert::with_ids;
use crate::errors::CoreResultExt;

#[pymethods]
impl PyBlockManager {
    /// Appends tokens to a live sequence.
    fn append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        scratch(&TOKENS, |buf| {
            with_ids("token_ids", token_ids, buf, |toks| {
                Ok(self.run(py, toks.len() >= DETACH_MIN, |st| st.inner.append(id, toks)))
            })
        })?
        .py()
    }

    /// Appends one token to each sequence; all or nothing.
    fn append_batch(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        scratch(&SEQS, |sbuf| {
            with_ids("seq_ids", seq_ids, sbuf, |seqs| {
                scratch(&TOKENS, |tbuf| {
                    with_ids("token_ids", token_ids, tbuf, |toks| {
                        Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| {
                            st.inner.append_batch(seqs, toks)
                        }))
                    })
                })
            })
        })?
        .py()
    }

    /// Creates `child` sharing all of `parent`'s blocks.
    fn fork(
        &self,
        py: Python<'_>,
        parent: &Bound<'_, PyAny>,
        child: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (p, c) = (seq("parent", parent)?, seq("child", child)?);
        self.with(py, |st| st.inner.fork(p, c)).py()
    }

    /// Releases a sequence.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        // Freeing walks the whole table, so a long sequence is worth releasing the GIL for. The
        // length is only a hint: another thread may change it before `run` takes the lock.
        let long = self.with(py, |st| {
            st.inner
                .block_table(id)
                .map(|t| t.len() >= DETACH_MIN)
                .unwrap_or(false)
        });
        self.run(py, long, |st| st.inner.free(id)).py()
    }

    /// Releases many sequences: validates (known, distinct) first, then frees all.
    fn free_batch(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| st.inner.free_batch(seqs)))
            })
        })?
        .py()
    }
}
