//! `_core.plan_decode`: the binding of the core's split-K decode planner
//! ([`pagedkv::decode_plan`]).
//!
//! Owns reading the two arrays and nothing else; every decision is the core's. The lengths are a
//! 1-D numpy array of any integer dtype, read in place when C-contiguous and in native byte order
//! (a strided or byte-swapped array is converted by value first). A `uint64` array is read as
//! numpy's `astype(int64)` reads it (a value of 2^63 or more wraps negative and so clips to 0),
//! so the result matches the numpy reference `DecodePlan.plan_host` for every input. The plan
//! buffer must be a writable, C-contiguous, 1-D native `int32` numpy array that shares no memory
//! with the lengths (numpy's borrow tracking refuses an overlap); anything else raises
//! `BufferInvalidError` before the core runs.
//!
//! The GIL stays held: the plan takes about a microsecond, less than releasing and retaking the
//! GIL, and holding it keeps Python code from writing either array while the core reads or
//! writes them.

use numpy::{
    Element, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pagedkv::decode_plan::{self, DecodePlanParams, SeqLen};
use pagedkv::Error;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::convert::{count, describe_buffer, dtype_str, scalar};
use crate::errors::{core_err, invalid_arg, CoreResultExt};

fn bad_out_error(got: String) -> Error {
    Error::BufferInvalid {
        buffer: "plan",
        expected: "a writable, C-contiguous 1-D int32 numpy array (native byte order)",
        got,
    }
}

fn bad_out(got: String) -> PyErr {
    core_err(bad_out_error(got))
}

/// Runs the core over lengths of element type `E` (the array's dtype).
fn plan_with<'py, E: Element + SeqLen>(
    lens: &Bound<'py, PyAny>,
    out: &Bound<'py, PyArray1<i32>>,
    params: &DecodePlanParams,
) -> PyResult<(usize, u128)> {
    let arr = lens.cast::<PyArray1<E>>().map_err(|_| {
        invalid_arg(
            "seq_lens",
            lens,
            "cannot be read as a 1-D integer array of its dtype",
        )
    })?;
    // Errors are built only after both borrows end: building an exception runs Python code (the
    // cyclic GC, finalizers), which could resize either array, and numpy's borrow tracking
    // cannot release a borrow whose array moved (it panics, inside an `extern "C"` callback).
    let planned = {
        let ro = match arr.try_readonly() {
            Ok(ro) => ro,
            Err(e) => return Err(readonly_failed(lens, e.to_string())),
        };
        match out.try_readwrite() {
            Err(e) => Err(bad_out_error(format!(
                "an array that cannot be borrowed for writing ({e})"
            ))),
            Ok(mut rw) => match rw.as_slice_mut() {
                Err(_) => Err(bad_out_error("a non-contiguous array".into())),
                Ok(dst) => match ro.as_slice() {
                    Ok(src) => decode_plan::plan_decode(src, params, dst),
                    // Strided view: one copy, by value.
                    Err(_) => {
                        let copy: Vec<E> = ro.as_array().iter().copied().collect();
                        decode_plan::plan_decode(&copy, params, dst)
                    }
                },
            },
        }
    };
    let s = planned.py()?;
    Ok((s.num_items, s.chunk))
}

#[cold]
fn readonly_failed(lens: &Bound<'_, PyAny>, why: String) -> PyErr {
    invalid_arg(
        "seq_lens",
        lens,
        format!("array is mutably borrowed elsewhere ({why})"),
    )
}

fn plan_lens<'py>(
    lens: &Bound<'py, PyAny>,
    out: &Bound<'py, PyArray1<i32>>,
    params: &DecodePlanParams,
) -> PyResult<(usize, u128)> {
    let arr = lens.cast::<PyUntypedArray>().map_err(|_| {
        let shown = lens
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        invalid_arg(
            "seq_lens",
            &lens.get_type().into_any(),
            format!("expected a 1-D integer numpy array, got {shown}"),
        )
    })?;
    if arr.ndim() != 1 {
        return Err(invalid_arg(
            "seq_lens",
            lens,
            format!("must be 1-D, got {} dimensions", arr.ndim()),
        ));
    }
    let dtype = arr.dtype();
    if !dtype.is_native_byteorder().unwrap_or(true) {
        let native = dtype.call_method1("newbyteorder", ("=",))?;
        let converted = lens.call_method1("astype", (native,))?;
        return plan_lens(&converted, out, params);
    }
    match (dtype.kind(), dtype.itemsize()) {
        (b'i', 1) => plan_with::<i8>(lens, out, params),
        (b'i', 2) => plan_with::<i16>(lens, out, params),
        (b'i', 4) => plan_with::<i32>(lens, out, params),
        (b'i', 8) => plan_with::<i64>(lens, out, params),
        (b'u', 1) => plan_with::<u8>(lens, out, params),
        (b'u', 2) => plan_with::<u16>(lens, out, params),
        (b'u', 4) => plan_with::<u32>(lens, out, params),
        // As numpy's int64 cast: the same bits, read signed (a zero-copy view).
        (b'u', 8) => plan_with::<i64>(&lens.call_method1("view", ("int64",))?, out, params),
        _ => Err(invalid_arg(
            "seq_lens",
            &dtype.into_any(),
            format!("must have an integer dtype, got {}", dtype_str(arr)),
        )),
    }
}

/// Plans one decode step: writes the work list for the host lengths `seq_lens` into `out` (the
/// plan's int32 host buffer) and returns `(num_items, chunk)`. Layout and rules:
/// [`pagedkv::decode_plan`].
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn plan_decode<'py>(
    py: Python<'py>,
    seq_lens: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    kv_heads: &Bound<'py, PyAny>,
    programs: &Bound<'py, PyAny>,
    min_chunk: &Bound<'py, PyAny>,
    granule: &Bound<'py, PyAny>,
    items_off: &Bound<'py, PyAny>,
    capacity: &Bound<'py, PyAny>,
) -> PyResult<(usize, Bound<'py, PyAny>)> {
    let params = DecodePlanParams {
        kv_heads: scalar::<u32>("kv_heads", kv_heads)?,
        programs: scalar::<u32>("programs", programs)?,
        min_chunk: scalar::<u32>("min_chunk", min_chunk)?,
        granule: scalar::<u32>("granule", granule)?,
        items_off: count("items_off", items_off)?,
        capacity: count("capacity", capacity)?,
    };
    let out = match out.cast::<PyArray1<i32>>() {
        Ok(a) => a,
        Err(_) => return Err(bad_out(describe_buffer(out))),
    };
    if !out.is_contiguous() {
        return Err(bad_out("a non-contiguous array".into()));
    }
    let (m, chunk) = plan_lens(seq_lens, out, &params)?;
    let chunk = match u64::try_from(chunk) {
        Ok(c) => c.into_bound_py_any(py)?,
        Err(_) => chunk.into_bound_py_any(py)?,
    };
    Ok((m, chunk))
}
