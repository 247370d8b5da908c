//! Prefix-cache keys from Python arguments (cache salt, adapter id, multimodal inputs, extra
//! keys), prefix-hash lists, and the `hash_blocks` function that computes the chain without a
//! manager.

use pagedkv::hash::{MmInput, SeqKeys};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyList, PyString, PyTuple};

use super::opt;
use crate::convert::{scalar, with_ids};
use crate::errors::{invalid_arg, CoreResultExt};

pub(super) fn bytes_of(what: &str, obj: &Bound<'_, PyAny>, allow_str: bool) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    if allow_str {
        if let Ok(s) = obj.cast::<PyString>() {
            // A str salt is its UTF-8 bytes; a lone surrogate has none.
            return match s.to_cow() {
                Ok(text) => Ok(text.as_bytes().to_vec()),
                Err(_) => Err(invalid_arg(
                    what,
                    obj,
                    "a str salt must be encodable as UTF-8 (it holds a lone surrogate)",
                )),
            };
        }
    }
    let want = if allow_str { "bytes or str" } else { "bytes" };
    let got = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    Err(invalid_arg(what, obj, format!("must be {want}, got {got}")))
}

/// Builds the core's [`SeqKeys`] from the keyword arguments of `admit` / `hash_blocks`; `None`
/// when every key is absent, so the plain (cheaper) path can be taken.
pub(super) fn seq_keys(
    cache_salt: Option<Bound<'_, PyAny>>,
    adapter_id: Option<Bound<'_, PyAny>>,
    mm_inputs: Option<Bound<'_, PyAny>>,
    extra_keys: Option<Bound<'_, PyAny>>,
) -> PyResult<Option<SeqKeys>> {
    let (salt, adapter, mm, extra) = (
        opt(&cache_salt),
        opt(&adapter_id),
        opt(&mm_inputs),
        opt(&extra_keys),
    );
    if salt.is_none() && adapter.is_none() && mm.is_none() && extra.is_none() {
        return Ok(None);
    }
    let mut keys = SeqKeys::default();
    if let Some(s) = salt {
        keys.cache_salt = bytes_of("cache_salt", s, true)?;
    }
    if let Some(a) = adapter {
        keys.adapter_id = Some(scalar::<u64>("adapter_id", a)?);
    }
    if let Some(list) = mm {
        let bad = |o: &Bound<'_, PyAny>| {
            invalid_arg(
                "mm_inputs",
                o,
                "must be a list of (start, end, hash: bytes) tuples",
            )
        };
        let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = list.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(t) = list.cast::<PyTuple>() {
            t.iter().collect()
        } else {
            return Err(bad(list));
        };
        for item in items {
            let t = item.cast::<PyTuple>().map_err(|_| bad(&item))?;
            if t.len() != 3 {
                return Err(bad(&item));
            }
            keys.mm_inputs.push(MmInput {
                start: scalar::<u32>("mm_inputs.start", &t.get_item(0)?)?,
                end: scalar::<u32>("mm_inputs.end", &t.get_item(1)?)?,
                hash: bytes_of("mm_inputs.hash", &t.get_item(2)?, false)?,
            });
        }
    }
    if let Some(e) = extra {
        keys.extra = bytes_of("extra_keys", e, false)?;
    }
    Ok(Some(keys))
}

/// A list of u128 prefix hashes (Python ints in `[0, 2**128)`, never bools).
pub(super) fn hash_list(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
    let mut out = Vec::new();
    for item in obj
        .try_iter()
        .map_err(|_| invalid_arg(what, obj, "must be a sequence of ints"))?
    {
        let item = item?;
        out.push(hash_of(what, &item)?);
    }
    Ok(out)
}

pub(super) fn hash_of(what: &str, item: &Bound<'_, PyAny>) -> PyResult<u128> {
    if item.is_instance_of::<PyBool>() {
        return Err(invalid_arg(what, item, "a hash is an int, not a bool"));
    }
    item.extract::<u128>()
        .map_err(|_| invalid_arg(what, item, "a hash is an int in [0, 2**128)"))
}

/// A list of parent hashes: ints or None.
pub(super) fn parent_list(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u128>>> {
    let mut out = Vec::new();
    for item in obj
        .try_iter()
        .map_err(|_| invalid_arg(what, obj, "must be a sequence of ints or None"))?
    {
        let item = item?;
        out.push(if item.is_none() {
            None
        } else {
            Some(hash_of(what, &item)?)
        });
    }
    Ok(out)
}

/// The chained prefix hashes of every full block of `token_ids` under hash key `hash_seed` (a
/// manager's `hash_seed`), 16 little-endian bytes each (the `u128le` encoding the chain itself
/// uses); the same keys as `BlockManager.admit`.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None, *, hash_seed))]
#[allow(clippy::too_many_arguments)]
pub fn hash_blocks<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
    cache_salt: Option<Bound<'py, PyAny>>,
    adapter_id: Option<Bound<'py, PyAny>>,
    mm_inputs: Option<Bound<'py, PyAny>>,
    extra_keys: Option<Bound<'py, PyAny>>,
    hash_seed: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let key = scalar::<u64>("hash_seed", hash_seed)?;
    let b = scalar::<u32>("block_size", block_size)?;
    if b == 0 {
        return Err(invalid_arg("block_size", block_size, "must be >= 1"));
    }
    let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?.unwrap_or_default();
    let mut scratch = Vec::new();
    let hashes = with_ids("token_ids", token_ids, &mut scratch, |toks| {
        keys.validate(toks.len()).py()?;
        Ok(py.detach(|| pagedkv::hash::prompt_hashes(key, toks, b as usize, &keys)))
    })?;
    PyList::new(
        py,
        hashes.iter().map(|h| PyBytes::new(py, &h.to_le_bytes())),
    )
}
