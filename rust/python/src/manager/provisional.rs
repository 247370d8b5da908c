//! Provisional tokens: `append_provisional`, `append_provisional_batch`, `commit`,
//! `commit_batch`, `rewind`, and the queries `num_provisional` / `committed_len`.
//!
//! Wrappers only: the core (`pagedkv::manager`, `provisional.rs`) owns the semantics — up to
//! `max_provisional` tokens past the committed length, slots like any token, never hashed or
//! cached until committed, every call all-or-nothing.

use pyo3::prelude::*;

use super::{scratch, seq, PyBlockManager, COUNTS, DETACH_MIN, SEQS, TOKENS};
use crate::convert::{count, with_ids};
use crate::errors::{invalid_arg_int, CoreResultExt};

#[pymethods]
impl PyBlockManager {
    /// Adds `num_tokens` provisional tokens to a running sequence (slots only, no ids).
    fn append_provisional(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        let n = count("num_tokens", num_tokens)?;
        self.with(py, |st| st.inner.append_provisional(id, n)).py()
    }

    /// `append_provisional` for a whole step: `counts[k]` tokens for `seq_ids[k]`; all or nothing.
    fn append_provisional_batch(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        scratch(&SEQS, |sbuf| {
            with_ids("seq_ids", seq_ids, sbuf, |seqs| {
                scratch(&COUNTS, |cbuf| {
                    with_ids("counts", counts, cbuf, |cnts| {
                        Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| {
                            st.inner.append_provisional_batch(seqs, cnts)
                        }))
                    })
                })
            })
        })?
        .py()
    }

    /// Settles a sequence's provisional tokens: `accepted_tokens` (a prefix of them, by count)
    /// become committed with those ids, the rest are dropped.
    fn commit(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        accepted_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        scratch(&TOKENS, |buf| {
            with_ids("accepted_tokens", accepted_tokens, buf, |toks| {
                Ok(self.with(py, |st| st.inner.commit(id, toks.len(), toks)))
            })
        })?
        .py()
    }

    /// `commit` for a whole step: `num_accepted[k]` of `seq_ids[k]`'s provisional tokens become
    /// committed; `token_ids` are the accepted ids of all of them concatenated in order.
    fn commit_batch(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_accepted: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        scratch(&SEQS, |sbuf| {
            with_ids("seq_ids", seq_ids, sbuf, |seqs| {
                scratch(&COUNTS, |cbuf| {
                    with_ids("num_accepted", num_accepted, cbuf, |cnts| {
                        if cnts.len() != seqs.len() {
                            return Err(invalid_arg_int(
                                py,
                                "num_accepted.len",
                                cnts.len() as i128,
                                format!("must equal len(seq_ids) ({})", seqs.len()),
                            ));
                        }
                        let pairs: Vec<(u64, u32)> =
                            seqs.iter().copied().zip(cnts.iter().copied()).collect();
                        scratch(&TOKENS, |tbuf| {
                            with_ids("token_ids", token_ids, tbuf, |toks| {
                                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| {
                                    st.inner.commit_batch(&pairs, toks)
                                }))
                            })
                        })
                    })
                })
            })
        })?
        .py()
    }

    /// Drops every provisional token of a sequence (`commit(seq_id, [])`).
    fn rewind(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.rewind(id)).py()
    }

    /// Provisional tokens the sequence holds past its committed length.
    fn num_provisional(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.num_provisional(id)).py()
    }

    /// The sequence's committed length (its length without the provisional tokens).
    fn committed_len(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.committed_len(id)).py()
    }
}
