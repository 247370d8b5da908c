//! Argument conversion: Python ints, lists and numpy arrays to the core's id types.
//!
//! Owns the rules for what the binding accepts as an id and how it is read:
//!
//! - a scalar id is a Python int (or anything with `__index__`) in `[0, MAX]` of its type, but
//!   never a `bool`: `True` is an int to Python, and taking it as id 1 turns a bug in the caller
//!   (a flag passed where an id belongs) into an operation on the wrong sequence;
//! - an id sequence is a list or tuple of such ints, or a 1-D numpy array of any integer dtype.
//!   Every sequence is copied into a caller-provided scratch vector (so steady-state calls do not
//!   allocate), arrays of the target's own width included: the core often runs with the GIL
//!   released, and an array lent in place could be resized (its memory freed) by another thread
//!   meanwhile. The copy of a 4096-token array costs well under a microsecond. A non-native byte
//!   order (a big-endian array on a little-endian machine) is converted to native first, by value;
//! - a flag is a `bool` and nothing else ([`flag`]): `"false"` is truthy.
//!
//! Every value is range-checked before the core sees it; a bad one raises `InvalidArgumentError`
//! naming the argument, the index and the value. Nothing here touches the manager, so a failed
//! conversion leaves it unchanged by construction.

use numpy::{
    Element, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList, PyTuple};

use crate::errors::{invalid_arg, invalid_arg_int};

/// A numpy element type the binding can read ids from.
pub trait Elem: Element + Copy {
    /// Signed types: a negative value must be rejected even for a `u64` target.
    const SIGNED: bool;
    /// The value widened to `u64`, signed types sign-extended (a negative value sets bit 63).
    fn bits(self) -> u64;
    /// The value as `i128`, for error messages only.
    fn wide(self) -> i128;
    /// Bits that must all be clear in [`Elem::bits`] for the value to lie in `[0, max]`, where
    /// `max` is `2^k - 1` (every id type's maximum is). A signed value cannot legitimately reach
    /// `2^63`, so bit 63 flags a negative one.
    #[inline(always)]
    fn reject_mask(max: u64) -> u64 {
        !max | if Self::SIGNED { 1 << 63 } else { 0 }
    }
    /// Whether the value lies in `[0, max]`.
    #[inline(always)]
    fn in_range(self, max: u64) -> bool {
        self.bits() & Self::reject_mask(max) == 0
    }
}

macro_rules! elem {
    ($signed:expr => $($t:ty),*) => {$(
        impl Elem for $t {
            const SIGNED: bool = $signed;
            #[inline(always)]
            fn bits(self) -> u64 {
                // `as i64` sign-extends signed types and zero-extends unsigned ones (u64 is a no-op).
                if $signed { self as i64 as u64 } else { self as u64 }
            }
            fn wide(self) -> i128 { self as i128 }
        }
    )*};
}
elem!(true => i8, i16, i32, i64);
elem!(false => u8, u16, u32, u64);

/// A target id type of the core.
pub trait Id: Copy + Send + Sync + 'static {
    const MAX: u64;
    /// Shown in error messages: what the valid range is.
    const RANGE: &'static str;
    fn from_bits(v: u64) -> Self;
}

impl Id for u32 {
    const MAX: u64 = u32::MAX as u64;
    const RANGE: &'static str = "must be in [0, 4294967295]";
    #[inline(always)]
    fn from_bits(v: u64) -> Self {
        v as u32
    }
}

impl Id for u64 {
    const MAX: u64 = u64::MAX;
    const RANGE: &'static str = "must be in [0, 18446744073709551615]";
    #[inline(always)]
    fn from_bits(v: u64) -> Self {
        v
    }
}

/// Reads one id from a Python int.
pub fn scalar<T: Id>(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<T> {
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u64>() {
            if v <= T::MAX {
                return Ok(T::from_bits(v));
            }
        }
    }
    Err(scalar_error::<T>(what, obj))
}

/// Reads a flag: a Python `bool` only (not an int, not a string, not `None`).
pub fn flag(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match obj.cast::<PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => {
            let reason = format!("must be a bool, got {}", type_name(obj));
            Err(invalid_arg(what, obj, reason))
        }
    }
}

const NOT_BOOL: &str = "must be an int, got bool";

fn scalar_error<T: Id>(what: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    if obj.is_instance_of::<PyBool>() {
        invalid_arg(what, obj, NOT_BOOL)
    } else if is_int_like(obj) {
        invalid_arg(what, obj, T::RANGE)
    } else {
        let reason = format!("must be an int, got {}", type_name(obj));
        invalid_arg(what, obj, reason)
    }
}

/// Reads a non-negative count (a token count, a length) as `usize`.
pub fn count(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    if obj.is_instance_of::<PyBool>() {
        return Err(scalar_error::<u64>(what, obj));
    }
    match obj.extract::<u64>() {
        Ok(v) if v <= usize::MAX as u64 => Ok(v as usize),
        _ => Err(scalar_error::<u64>(what, obj)),
    }
}

/// A Python int, or something `operator.index` accepts (a numpy integer scalar).
fn is_int_like(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyInt>() || obj.call_method0("__index__").is_ok()
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Reads an id sequence into `scratch` and hands `f` that slice: memory the binding owns, which
/// no Python code can free or move while `f` runs (with the GIL released or not).
pub fn with_ids<T: Id, R>(
    what: &str,
    obj: &Bound<'_, PyAny>,
    scratch: &mut Vec<T>,
    f: impl FnOnce(&[T]) -> PyResult<R>,
) -> PyResult<R> {
    // Lists first: the engine's usual argument, and a list test is one type-flag check where the
    // array test goes through numpy's C API (a list is never an array, so the order is free).
    if let Ok(list) = obj.cast::<PyList>() {
        scratch.clear();
        let n = list.len();
        scratch.reserve(n);
        // SAFETY: `list` is a live list and the GIL is held; `fill` runs no Python code, so the
        // list cannot change while its items are read.
        let done = unsafe { fast::fill::<T>(obj.py(), list.as_ptr(), fast::Seq::List, n, scratch) };
        for i in done..n {
            // `element` may run an item's `__index__`, and that code may shrink or grow the
            // list: the ids would then be neither the old list nor the new one.
            let item = list.get_item(i).map_err(|_| list_changed(what, obj, n))?;
            scratch.push(element::<T>(what, i, &item)?);
        }
        // Only the slow path above runs Python code, so only it can have changed the list.
        if done < n && list.len() != n {
            return Err(list_changed(what, obj, n));
        }
        return f(scratch);
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            let reason = format!("must be 1-D, got {} dimensions", arr.ndim());
            return Err(invalid_arg_int(obj.py(), what, arr.ndim() as i128, reason));
        }
        let dtype = arr.dtype();
        if !dtype.is_native_byteorder().unwrap_or(true) {
            // numpy's typed views require native byte order; convert by value (one copy), then
            // read the converted array the usual way.
            let native = dtype.call_method1("newbyteorder", ("=",))?;
            let converted = obj.call_method1("astype", (native,))?;
            return with_ids(what, &converted, scratch, f);
        }
        // Sizes, not type numbers: numpy has two type numbers for 64-bit ints on most platforms
        // (long and longlong), and the kind/width pair covers both.
        return match (dtype.kind(), dtype.itemsize()) {
            (b'i', 1) => from_array::<i8, T, R>(what, obj, scratch, f),
            (b'i', 2) => from_array::<i16, T, R>(what, obj, scratch, f),
            (b'i', 4) => from_array::<i32, T, R>(what, obj, scratch, f),
            (b'i', 8) => from_array::<i64, T, R>(what, obj, scratch, f),
            (b'u', 1) => from_array::<u8, T, R>(what, obj, scratch, f),
            (b'u', 2) => from_array::<u16, T, R>(what, obj, scratch, f),
            (b'u', 4) => from_array::<u32, T, R>(what, obj, scratch, f),
            (b'u', 8) => from_array::<u64, T, R>(what, obj, scratch, f),
            _ => {
                let shown = dtype
                    .str()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|_| "?".into());
                Err(invalid_arg(
                    what,
                    &dtype.into_any(),
                    format!("an id array must have an integer dtype, got {shown}"),
                ))
            }
        };
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        scratch.clear();
        let n = tuple.len();
        scratch.reserve(n);
        // SAFETY: as for the list; a tuple is immutable anyway.
        let done =
            unsafe { fast::fill::<T>(obj.py(), tuple.as_ptr(), fast::Seq::Tuple, n, scratch) };
        for i in done..n {
            scratch.push(element::<T>(what, i, &tuple.get_item(i)?)?);
        }
        return f(scratch);
    }
    let reason = format!(
        "expected a list or tuple of ints or a 1-D integer numpy array, got {}",
        type_name(obj)
    );
    Err(invalid_arg(what, &obj.get_type().into_any(), reason))
}

/// A numpy array's dtype as numpy spells it (`"<i4"`), for messages.
pub fn dtype_str(arr: &Bound<'_, PyUntypedArray>) -> String {
    arr.dtype()
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// What a buffer argument is, for a `BufferInvalid` message: `"a 2-D array of dtype <i4"`
/// (`"a 1-D non-contiguous array of dtype <i8"` where it is not contiguous), else its type's
/// name.
pub fn describe_buffer(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!(
            "a {}-D{} array of dtype {}",
            a.ndim(),
            if a.is_contiguous() {
                ""
            } else {
                " non-contiguous"
            },
            dtype_str(a)
        ),
        Err(_) => type_name(obj),
    }
}

#[cold]
fn list_changed(what: &str, obj: &Bound<'_, PyAny>, n: usize) -> PyErr {
    let now = obj.len().unwrap_or(0);
    invalid_arg(
        what,
        obj,
        format!("the list changed size while it was read (from {n} to {now} items)"),
    )
}

/// Reads an id sequence into a new vector, for callers that need several sequences at once.
pub fn ids_into<T: Id>(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<T>> {
    let mut scratch = Vec::new();
    with_ids(what, obj, &mut scratch, |ids| Ok(ids.to_vec()))
}

#[inline]
fn element<T: Id>(what: &str, index: usize, item: &Bound<'_, PyAny>) -> PyResult<T> {
    // An exact int is the common case; the bool test (a type comparison) only runs for others.
    if item.is_exact_instance_of::<PyInt>() || !item.is_instance_of::<PyBool>() {
        if let Ok(v) = item.extract::<u64>() {
            if v <= T::MAX {
                return Ok(T::from_bits(v));
            }
        }
    }
    let reason = if item.is_instance_of::<PyBool>() {
        format!("element {index}: {NOT_BOOL}")
    } else if is_int_like(item) {
        format!("element {index}: {}", T::RANGE)
    } else {
        format!("element {index}: must be an int, got {}", type_name(item))
    };
    Err(invalid_arg(what, item, reason))
}

fn from_array<E: Elem, T: Id, R>(
    what: &str,
    obj: &Bound<'_, PyAny>,
    scratch: &mut Vec<T>,
    f: impl FnOnce(&[T]) -> PyResult<R>,
) -> PyResult<R> {
    let arr = obj.cast::<PyArray1<E>>().map_err(|_| {
        let shown = obj
            .getattr("dtype")
            .and_then(|d| d.str().map(|s| s.to_string()))
            .unwrap_or_else(|_| "?".into());
        invalid_arg(
            what,
            obj,
            format!("cannot be read as a 1-D integer array (dtype {shown})"),
        )
    })?;
    // The values are copied out and the borrow ends before `f` runs: `f` may release the GIL
    // (or run Python code converting the next argument), and meanwhile another thread may
    // `resize` the array, freeing the memory a lent slice would point into. A borrow that
    // outlived such a resize would also make numpy's borrow tracking fail to find it on release,
    // which panics inside an `extern "C"` callback and aborts the process.
    let bad = {
        let ro = arr.try_readonly().map_err(|e| {
            invalid_arg(
                what,
                obj,
                format!("array is mutably borrowed elsewhere ({e})"),
            )
        })?;
        copy_checked::<E, T>(&ro, scratch)
    };
    // The error is built only after the borrow ended: building it runs Python code.
    if let Some((i, v)) = bad {
        return Err(invalid_arg_int(
            obj.py(),
            what,
            v,
            format!("element {i}: {}", T::RANGE),
        ));
    }
    f(scratch)
}

/// Copies the array's values into `scratch` (cleared first), checking each against `T`'s range;
/// returns the first out-of-range `(index, value)` if any. Runs no Python code.
fn copy_checked<E: Elem, T: Id>(
    ro: &numpy::PyReadonlyArray1<'_, E>,
    scratch: &mut Vec<T>,
) -> Option<(usize, i128)> {
    let mask = E::reject_mask(T::MAX);
    scratch.clear();
    let acc = match ro.as_slice() {
        Ok(src) if std::mem::size_of::<E>() == std::mem::size_of::<T>() => {
            // Check with an OR-reduction (it vectorises), then one memcpy.
            let acc = src.iter().fold(0u64, |acc, &v| acc | v.bits());
            if acc & mask == 0 {
                // SAFETY: `E` and `T` are plain integers of the same size and alignment, and
                // every value is in `[0, T::MAX]`, where their two's-complement bit patterns
                // coincide.
                let same: &[T] =
                    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<T>(), src.len()) };
                scratch.extend_from_slice(same);
            }
            acc
        }
        Ok(src) => {
            scratch.reserve(src.len());
            let mut acc = 0u64;
            // Convert and check in one pass (it vectorises); the slow scan for the culprit runs
            // only on failure.
            scratch.extend(src.iter().map(|&v| {
                let b = v.bits();
                acc |= b;
                T::from_bits(b)
            }));
            acc
        }
        // Strided (or misaligned) view: read element by element.
        Err(_) => {
            let view = ro.as_array();
            scratch.reserve(view.len());
            let mut acc = 0u64;
            scratch.extend(view.iter().map(|&v| {
                let b = v.bits();
                acc |= b;
                T::from_bits(b)
            }));
            acc
        }
    };
    if acc & mask == 0 {
        return None;
    }
    scratch.clear();
    let culprit = ro
        .as_array()
        .iter()
        .enumerate()
        .find(|(_, v)| !v.in_range(T::MAX))
        .map(|(i, v)| (i, v.wide()));
    // The OR of the values failed the mask, so some value is out of range.
    Some(culprit.unwrap_or((0, 0)))
}

/// Reading the items of a list or tuple of small non-negative ints without a call per item.
///
/// Under the stable ABI every item would cost a `PyList_GetItem` and a `PyLong_As*` call plus
/// error checks (~11 ns each through PyO3's `extract`). Token ids are small ints in a list, so
/// this reads the object layouts directly: the item array of a list (`ob_item`, as the full API's
/// `PyList_GET_ITEM` macro does) or tuple, and the one or two 30-bit digits of an exact `int`.
/// The int layout changed in CPython 3.12 (a tag word replaced the signed size), so the reader is
/// chosen by the running interpreter's version, and only after a self-test at first use: known
/// ints and a probe list and tuple are read both ways and must agree, or the fast path stays off
/// for the process. Any item it does not handle (a subclass such as `bool`, a negative or large
/// int, anything else) ends the fast loop; the caller converts the rest through the API, so
/// results and errors are exactly those of the slow path.
mod fast {
    use std::sync::OnceLock;

    use pyo3::ffi;
    use pyo3::Python;

    use super::Id;

    /// Which container's item array to read.
    #[derive(Clone, Copy)]
    pub enum Seq {
        List,
        Tuple,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum IntLayout {
        /// CPython <= 3.11: `ob_size` holds the signed digit count.
        Size,
        /// CPython 3.12+: `lv_tag` holds the sign (bits 0-1) and digit count (bits 3+).
        Tag,
    }

    /// The int layout, and whether the tuple item layout passed its test too (CPython 3.14 moved
    /// tuple items behind a cached hash, for one).
    static LAYOUT: OnceLock<Option<(IntLayout, bool)>> = OnceLock::new();

    /// Offset of the word after `PyObject_HEAD` (`ob_size` / `lv_tag`), the digits, and a list's
    /// `ob_item` pointer / a tuple's inline items, on 64-bit builds.
    const SIZE_OFF: usize = 16;
    const ITEMS_OFF: usize = 24;

    #[inline(always)]
    unsafe fn read_int(layout: IntLayout, o: *mut ffi::PyObject) -> Option<u64> {
        let base = o.cast::<u8>();
        let word = base.add(SIZE_OFF).cast::<usize>().read();
        let digits = base.add(ITEMS_OFF).cast::<u32>();
        let n = match layout {
            IntLayout::Size => {
                let size = word as isize;
                if size < 0 {
                    return None;
                }
                size as usize
            }
            IntLayout::Tag => match word & 3 {
                0 => word >> 3,
                1 => return Some(0),
                _ => return None,
            },
        };
        match n {
            0 => Some(0),
            1 => Some(digits.read() as u64),
            2 => Some(digits.read() as u64 | (digits.add(1).read() as u64) << 30),
            _ => None,
        }
    }

    #[inline(always)]
    unsafe fn items(seq: Seq, o: *mut ffi::PyObject) -> *const *mut ffi::PyObject {
        let at = o.cast::<u8>().add(ITEMS_OFF);
        match seq {
            Seq::List => at.cast::<*const *mut ffi::PyObject>().read(),
            Seq::Tuple => at.cast::<*mut ffi::PyObject>(),
        }
    }

    fn detect(py: Python<'_>) -> Option<(IntLayout, bool)> {
        if cfg!(not(target_pointer_width = "64")) {
            return None;
        }
        let v = py.version_info();
        let layout = match (v.major, v.minor) {
            (3, 9..=11) => IntLayout::Size,
            (3, 12..=14) => IntLayout::Tag,
            _ => return None,
        };
        // SAFETY: the GIL is held (`py`); every object created here is released before return.
        unsafe { self_test(layout) }
    }

    unsafe fn self_test(layout: IntLayout) -> Option<(IntLayout, bool)> {
        let values: [u64; 12] = [
            0,
            1,
            5,
            255,
            256,
            32_000,
            (1 << 30) - 1,
            1 << 30,
            1 << 31,
            u32::MAX as u64,
            1 << 32,
            (1 << 60) - 1,
        ];
        let mut ok = true;
        let list = ffi::PyList_New(0);
        if list.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        for &v in &values {
            let o = ffi::PyLong_FromUnsignedLongLong(v);
            if o.is_null() {
                ffi::PyErr_Clear();
                ok = false;
                break;
            }
            ok &= read_int(layout, o) == Some(v);
            ok &= ffi::PyList_Append(list, o) == 0;
            ffi::Py_DecRef(o);
        }
        for v in [-1i64, -(1 << 40)] {
            let o = ffi::PyLong_FromLongLong(v);
            if !o.is_null() {
                ok &= read_int(layout, o).is_none();
                ffi::Py_DecRef(o);
            }
        }
        let big = ffi::PyLong_FromUnsignedLongLong(u64::MAX);
        if !big.is_null() {
            ok &= read_int(layout, big).is_none();
            ffi::Py_DecRef(big);
        }
        let mut tuple_ok = false;
        if ok {
            let li = items(Seq::List, list);
            for i in 0..values.len() {
                ok &= *li.add(i) == ffi::PyList_GetItem(list, i as ffi::Py_ssize_t);
            }
            let tuple = ffi::PyList_AsTuple(list);
            if !tuple.is_null() {
                let ti = items(Seq::Tuple, tuple);
                tuple_ok = (0..values.len())
                    .all(|i| *ti.add(i) == ffi::PyTuple_GetItem(tuple, i as ffi::Py_ssize_t));
                ffi::Py_DecRef(tuple);
            }
        }
        ffi::Py_DecRef(list);
        if !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            ok = false;
        }
        ok.then_some((layout, tuple_ok))
    }

    /// Converts the leading items of list or tuple `o` (of length `n`) that are exact ints in
    /// `[0, min(2^60, T::MAX)]`, appending them to `out` (capacity for `n` reserved by the
    /// caller); returns how many it converted.
    ///
    /// # Safety
    /// `o` is a live list (`Seq::List`) or tuple (`Seq::Tuple`) of length `n`, the GIL is held,
    /// and `out` has room for `n` more elements.
    #[inline]
    pub unsafe fn fill<T: Id>(
        py: Python<'_>,
        o: *mut ffi::PyObject,
        seq: Seq,
        n: usize,
        out: &mut Vec<T>,
    ) -> usize {
        let Some((layout, tuple_ok)) = *LAYOUT.get_or_init(|| detect(py)) else {
            return 0;
        };
        if matches!(seq, Seq::Tuple) && !tuple_ok {
            return 0;
        }
        debug_assert!(out.capacity() - out.len() >= n);
        let src = items(seq, o);
        let long = &raw mut ffi::PyLong_Type;
        let base = out.len();
        let dst = out.as_mut_ptr().add(base);
        let mut i = 0;
        while i < n {
            let it = *src.add(i);
            if (*it).ob_type != long {
                break;
            }
            match read_int(layout, it) {
                Some(v) if v <= T::MAX => dst.add(i).write(T::from_bits(v)),
                _ => break,
            }
            i += 1;
        }
        out.set_len(base + i);
        i
    }
}
