//! Admission: `can_admit`, `admit`, `admit_batch`. Every argument is converted before the core
//! is called, so a refused admission leaves the manager unchanged.

use pagedkv::hash::SeqKeys;
use pagedkv::manager::AdmitRequest;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyTuple};

use super::keys::{bytes_of, seq_keys};
use super::{opt, scratch, seq, PyBlockManager, DETACH_MIN, TOKENS};
use crate::convert::{count, ids_into, with_ids};
use crate::errors::{invalid_arg, CoreResultExt};

/// What `admit`, `admit_batch` (per sequence) and `resume` return: every field of the core's
/// `AdmitResult`, `(cached_tokens, new_blocks, num_blocks, num_tokens, cached_tokens_gpu,
/// cached_tokens_host)`.
pub(super) type AdmitTuple = (u32, u32, u32, u32, u32, u32);

pub(super) fn admit_tuple(r: &pagedkv::AdmitResult) -> AdmitTuple {
    (
        r.cached_tokens,
        r.new_blocks,
        r.num_blocks,
        r.num_tokens,
        r.cached_tokens_gpu,
        r.cached_tokens_host,
    )
}

#[pymethods]
impl PyBlockManager {
    /// Whether a prompt fits above the watermark now. With token ids, prefix-cache hits are
    /// counted (the same lookup as `admit`, read-only); with a count, none are assumed.
    #[pyo3(signature = (prompt, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None, max_new_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn can_admit(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        cache_salt: Option<Bound<'_, PyAny>>,
        adapter_id: Option<Bound<'_, PyAny>>,
        mm_inputs: Option<Bound<'_, PyAny>>,
        extra_keys: Option<Bound<'_, PyAny>>,
        max_new_tokens: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let k = opt(&max_new_tokens)
            .map(|k| count("max_new_tokens", k))
            .transpose()?;
        if prompt.is_instance_of::<PyInt>() {
            let n = count("num_tokens", prompt)?;
            return self.with(py, |st| st.inner.can_admit_len(n, k)).py();
        }
        let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?;
        scratch(&TOKENS, |buf| {
            with_ids("token_ids", prompt, buf, |toks| {
                Ok(self.run(py, toks.len() >= DETACH_MIN, |st| {
                    st.inner.can_admit_tokens(toks, keys.as_ref(), k)
                }))
            })
        })?
        .py()
    }

    /// Admits `seq_id` with its prompt, holding at most `max_new_tokens` tokens past the cached
    /// prefix; returns `(cached_tokens, new_blocks, num_blocks, num_tokens, cached_tokens_gpu,
    /// cached_tokens_host)` (host tokens are loaded by the next step's swap-in list).
    #[pyo3(signature = (seq_id, token_ids, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None, max_new_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Bound<'_, PyAny>>,
        adapter_id: Option<Bound<'_, PyAny>>,
        mm_inputs: Option<Bound<'_, PyAny>>,
        extra_keys: Option<Bound<'_, PyAny>>,
        max_new_tokens: Option<Bound<'_, PyAny>>,
    ) -> PyResult<AdmitTuple> {
        let id = seq("seq_id", seq_id)?;
        let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?;
        let k = opt(&max_new_tokens)
            .map(|k| count("max_new_tokens", k))
            .transpose()?;
        let r = scratch(&TOKENS, |buf| {
            with_ids("token_ids", token_ids, buf, |toks| {
                Ok(self.run(py, toks.len() >= DETACH_MIN, |st| {
                    st.inner.admit_opts(id, toks, keys.as_ref(), k)
                }))
            })
        })?
        .py()?;
        Ok(admit_tuple(&r))
    }

    /// Admits many sequences in order until one does not fit; every argument is validated first
    /// (nothing admitted on error). Returns the admitted prefix's tuples, as `admit`'s.
    #[pyo3(signature = (seq_ids, prompts, cache_salts=None, max_new_tokens=None))]
    fn admit_batch<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        prompts: &Bound<'py, PyAny>,
        cache_salts: Option<Bound<'py, PyAny>>,
        max_new_tokens: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<AdmitTuple>> {
        let ids = ids_into::<u64>("seq_ids", seq_ids)?;
        let b = ids.len();
        let items = |what: &str, obj: &Bound<'py, PyAny>| -> PyResult<Vec<Bound<'py, PyAny>>> {
            let v: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
                l.iter().collect()
            } else if let Ok(t) = obj.cast::<PyTuple>() {
                t.iter().collect()
            } else {
                return Err(invalid_arg(what, obj, "must be a list or tuple"));
            };
            if v.len() != b {
                let reason = format!("has {} items, seq_ids has {b}", v.len());
                return Err(invalid_arg(what, obj, reason));
            }
            Ok(v)
        };
        let mut toks: Vec<Vec<u32>> = Vec::with_capacity(b);
        for p in items("prompts", prompts)? {
            toks.push(ids_into::<u32>("prompts", &p)?);
        }
        let mut keys: Vec<Option<SeqKeys>> = Vec::new();
        if let Some(salts) = opt(&cache_salts) {
            for s in items("cache_salts", salts)? {
                keys.push(if s.is_none() {
                    None
                } else {
                    Some(SeqKeys {
                        cache_salt: bytes_of("cache_salts", &s, true)?,
                        ..SeqKeys::default()
                    })
                });
            }
        }
        let mut chunks: Vec<Option<usize>> = vec![None; b];
        if let Some(k) = opt(&max_new_tokens) {
            if k.is_instance_of::<PyInt>() {
                chunks.fill(Some(count("max_new_tokens", k)?));
            } else {
                for (i, x) in items("max_new_tokens", k)?.iter().enumerate() {
                    if !x.is_none() {
                        chunks[i] = Some(count("max_new_tokens", x)?);
                    }
                }
            }
        }
        let reqs: Vec<AdmitRequest<'_>> = (0..b)
            .map(|i| AdmitRequest {
                seq: ids[i],
                tokens: &toks[i],
                keys: keys.get(i).and_then(|k| k.as_ref()),
                max_new_tokens: chunks[i],
            })
            .collect();
        let total: usize = reqs.iter().map(|r| r.tokens.len()).sum();
        let out = self
            .run(py, total >= DETACH_MIN, |st| st.inner.admit_batch(&reqs))
            .py()?;
        Ok(out.iter().map(admit_tuple).collect())
    }
}
