//! `_core.split_transfer`: the binding of the offloading copier's transfer split
//! ([`pagedkv::offload_plan`]).
//!
//! Owns reading the arguments and building the result; every check and decision is the core's.
//! The id sequences are read as the rest of the binding reads ids (lists, tuples or 1-D integer
//! numpy arrays, copied, range-checked); the entries go into `out`, a writable, C-contiguous,
//! 1-D native `int64` numpy array (the copier's pinned index buffer), anything else raising
//! `BufferInvalidError` before the core runs. The GIL stays held: the split of a 256-block
//! transfer takes a few microseconds, and holding it keeps Python code from touching `out`
//! meanwhile.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pagedkv::offload_plan::{split_transfer as split, TransferShape};
use pagedkv::Error;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::convert::{count, describe_buffer, ids_into, scalar};
use crate::errors::{core_err, invalid_arg, CoreResultExt};

fn bad_out_error(got: String) -> Error {
    Error::BufferInvalid {
        buffer: "out",
        expected: "a writable, C-contiguous 1-D int64 numpy array (native byte order)",
        got,
    }
}

fn bad_out(got: String) -> PyErr {
    core_err(bad_out_error(got))
}

/// The split's result: the distinct chunk ids (ascending, `uint64`), the runs (`uint64`
/// `[runs, 3]`: first chunk id, first row in its piece's slot, chunk count), per piece its runs'
/// range, per piece its spans (`(group, start, end)` of the entries), and the entry count.
type Split<'py> = (
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyAny>,
    Vec<u32>,
    Bound<'py, PyList>,
    usize,
);

/// Splits one offload transfer into staging pieces (`pagedkv.vllm.offload_copy`; the core's
/// `offload_plan` module docs).
#[pyfunction]
#[pyo3(signature = (block_ids, group_sizes, block_indices, chunk_ids, tabled, blocks_per_chunk,
                    num_blocks, num_chunks, piece, out))]
#[allow(clippy::too_many_arguments)]
pub fn split_transfer<'py>(
    py: Python<'py>,
    block_ids: &Bound<'py, PyAny>,
    group_sizes: &Bound<'py, PyAny>,
    block_indices: &Bound<'py, PyAny>,
    chunk_ids: &Bound<'py, PyAny>,
    tabled: &Bound<'py, PyAny>,
    blocks_per_chunk: &Bound<'py, PyAny>,
    num_blocks: &Bound<'py, PyAny>,
    num_chunks: &Bound<'py, PyAny>,
    piece: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
) -> PyResult<Split<'py>> {
    let blocks = ids_into::<u64>("block_ids", block_ids)?;
    let sizes = ids_into::<u64>("group_sizes", group_sizes)?;
    let indices = ids_into::<u64>("block_indices", block_indices)?;
    let chunks = ids_into::<u64>("chunk_ids", chunk_ids)?;
    let tabled: Vec<bool> = tabled
        .extract()
        .map_err(|_| invalid_arg("tabled", tabled, "must be a list of bools, one per group"))?;
    let shape = TransferShape {
        num_blocks: scalar::<u64>("num_blocks", num_blocks)?,
        num_chunks: scalar::<u64>("num_chunks", num_chunks)?,
        blocks_per_chunk: scalar::<u64>("blocks_per_chunk", blocks_per_chunk)?,
        tabled: &tabled,
    };
    let piece = count("piece", piece)?;
    let arr = match out.cast::<PyArray1<i64>>() {
        Ok(a) if a.is_contiguous() => a,
        _ => return Err(bad_out(describe_buffer(out))),
    };
    // The error (if any) is built after the borrow ends: building an exception runs Python code.
    let result = match arr.try_readwrite() {
        Err(e) => Err(bad_out_error(format!(
            "an array that cannot be borrowed for writing ({e})"
        ))),
        Ok(mut rw) => match rw.as_slice_mut() {
            Ok(dst) => split(&shape, &blocks, &sizes, &indices, &chunks, piece, dst),
            Err(_) => Err(bad_out_error("a non-contiguous array".into())),
        },
    };
    let s = result.py()?;
    let flat: Vec<u64> = s.runs.iter().flatten().copied().collect();
    let runs = PyArray1::from_vec(py, flat).reshape([s.runs.len(), 3])?;
    let spans = PyList::empty(py);
    for p in 0..s.pieces() {
        let (a, z) = (s.span_edges[p] as usize, s.span_edges[p + 1] as usize);
        let piece_spans = PyList::empty(py);
        for sp in &s.spans[a..z] {
            piece_spans.append(PyTuple::new(py, sp.iter().copied())?)?;
        }
        spans.append(piece_spans)?;
    }
    Ok((
        PyArray1::from_vec(py, s.chunks),
        runs.into_any(),
        s.run_edges,
        spans,
        s.entries,
    ))
}
