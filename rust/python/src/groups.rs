//! KV cache groups at the Python boundary: attention kinds from and to tuples, and the core's
//! sizing helpers (`bytes_per_token`, `page_bytes`, `live_blocks`, `peak_decode_blocks`) as plain
//! functions.
//!
//! An attention kind crosses as a tuple: `("full",)` (or `("full", 0)`), `("sliding", window)`,
//! `("chunked", chunk)`; a bare `"full"` string is accepted too. The reverse direction always
//! gives `(name, size)`, size 0 for a full group. Every function here validates its arguments
//! before calling the core, whose arithmetic assumes them valid (a zero window or block size, a
//! product past `u64`), and raises `InvalidArgumentError` naming the offending value.

use pagedkv::groups::{self, AttentionKind};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::convert::{count, scalar};
use crate::errors::invalid_arg;

const KIND_HELP: &str =
    "a KV cache group is (\"full\",), (\"sliding\", window) or (\"chunked\", chunk)";

/// Reads one attention kind (see the module doc). A window or chunk of 0 is read as given; the
/// manager's configuration refuses it with `InvalidConfigError`, [`kind_checked`] with
/// `InvalidArgumentError`.
pub fn kind_of(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<AttentionKind> {
    if let Ok(s) = obj.cast::<PyString>() {
        if s.to_cow().map(|t| t == "full").unwrap_or(false) {
            return Ok(AttentionKind::Full);
        }
        return Err(invalid_arg(what, obj, KIND_HELP));
    }
    let items: Vec<Bound<'_, PyAny>> = if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else {
        return Err(invalid_arg(what, obj, KIND_HELP));
    };
    let name = match items.first().map(|n| n.cast::<PyString>()) {
        Some(Ok(n)) => n.to_cow().map(|t| t.into_owned()).unwrap_or_default(),
        _ => return Err(invalid_arg(what, obj, KIND_HELP)),
    };
    match (name.as_str(), items.len()) {
        ("full", 1) => Ok(AttentionKind::Full),
        ("full", 2) => {
            if scalar::<u32>(what, &items[1])? != 0 {
                return Err(invalid_arg(what, obj, "a full group has no size (give 0)"));
            }
            Ok(AttentionKind::Full)
        }
        ("sliding", 2) => Ok(AttentionKind::Sliding {
            window: scalar::<u32>("window", &items[1])?,
        }),
        ("chunked", 2) => Ok(AttentionKind::Chunked {
            chunk: scalar::<u32>("chunk", &items[1])?,
        }),
        _ => Err(invalid_arg(what, obj, KIND_HELP)),
    }
}

/// [`kind_of`], refusing a window or chunk of 0.
fn kind_checked(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<AttentionKind> {
    let k = kind_of(what, obj)?;
    if let AttentionKind::Sliding { window: 0 } | AttentionKind::Chunked { chunk: 0 } = k {
        return Err(invalid_arg(
            what,
            obj,
            "a sliding window or chunk must be >= 1 token",
        ));
    }
    Ok(k)
}

/// Reads a sequence of attention kinds (a manager's `groups`).
pub fn kinds_of(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<AttentionKind>> {
    if obj.cast::<PyString>().is_ok() {
        return Err(invalid_arg(what, obj, "must be a list of KV cache groups"));
    }
    let mut out = Vec::new();
    for item in obj
        .try_iter()
        .map_err(|_| invalid_arg(what, obj, "must be a list of KV cache groups"))?
    {
        out.push(kind_of(what, &item?)?);
    }
    Ok(out)
}

/// `(name, size)` of a kind; size 0 for a full group.
pub fn kind_tuple(k: AttentionKind) -> (&'static str, u32) {
    match k {
        AttentionKind::Full => ("full", 0),
        AttentionKind::Sliding { window } => ("sliding", window),
        AttentionKind::Chunked { chunk } => ("chunked", chunk),
    }
}

fn block_size_of(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let b = count("block_size", obj)?;
    if b == 0 || b > u32::MAX as usize {
        return Err(invalid_arg("block_size", obj, "must be in [1, 2**32 - 1]"));
    }
    Ok(b)
}

/// KV bytes one token takes in one layer group: `2 * kv_heads * head_dim * dtype_bytes * layers`.
/// InvalidArgumentError when the product does not fit 64 bits.
#[pyfunction]
pub fn bytes_per_token(
    kv_heads: &Bound<'_, PyAny>,
    head_dim: &Bound<'_, PyAny>,
    dtype_bytes: &Bound<'_, PyAny>,
    layers: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let args = [
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
        ("layers", layers),
    ];
    let mut vals = [0usize; 4];
    let mut product = Some(2u64);
    for (i, (what, obj)) in args.iter().enumerate() {
        vals[i] = count(what, obj)?;
        product = product.and_then(|p| p.checked_mul(vals[i] as u64));
    }
    if product.is_none() {
        return Err(invalid_arg(
            "layers",
            layers,
            "2 * kv_heads * head_dim * dtype_bytes * layers must fit 64 bits",
        ));
    }
    Ok(groups::bytes_per_token(vals[0], vals[1], vals[2], vals[3]))
}

/// Bytes of the one page size all groups share: `max(group_bytes_per_token) * block_size`.
#[pyfunction]
pub fn page_bytes(
    group_bytes_per_token: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let b = block_size_of(block_size)?;
    let mut per = Vec::new();
    for item in group_bytes_per_token.try_iter().map_err(|_| {
        invalid_arg(
            "group_bytes_per_token",
            group_bytes_per_token,
            "must be a sequence of ints",
        )
    })? {
        per.push(scalar::<u64>("group_bytes_per_token", &item?)?);
    }
    let max = per.iter().copied().max().unwrap_or(0);
    if max.checked_mul(b as u64).is_none() {
        return Err(invalid_arg(
            "block_size",
            block_size,
            "max(group_bytes_per_token) * block_size must fit 64 bits",
        ));
    }
    Ok(groups::page_bytes(&per, b))
}

/// Non-null entries of a group's table once a step computing the last `num_new` of `seq_len`
/// tokens is built (`1 <= num_new <= seq_len`).
#[pyfunction]
pub fn live_blocks(
    kind: &Bound<'_, PyAny>,
    seq_len: &Bound<'_, PyAny>,
    num_new: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let k = kind_checked("kind", kind)?;
    let len = count("seq_len", seq_len)?;
    let n = count("num_new", num_new)?;
    let b = block_size_of(block_size)?;
    if len == 0 {
        return Err(invalid_arg("seq_len", seq_len, "must be >= 1"));
    }
    if n == 0 || n > len {
        return Err(invalid_arg(
            "num_new",
            num_new,
            format!("must be in [1, seq_len] = [1, {len}]"),
        ));
    }
    Ok(groups::live_blocks(k, len, n, b))
}

/// Most non-null entries a group's table holds over a decode run up to `max_len` tokens: the
/// group's per-sequence block need at that context.
#[pyfunction]
pub fn peak_decode_blocks(
    kind: &Bound<'_, PyAny>,
    max_len: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let k = kind_checked("kind", kind)?;
    let len = count("max_len", max_len)?;
    let b = block_size_of(block_size)?;
    Ok(groups::peak_decode_blocks(k, len, b))
}
