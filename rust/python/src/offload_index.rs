//! `_core.OffloadIndex`: the offloading tier's index ([`pagedkv::offload_index::OffloadIndex`]),
//! one method per call of vLLM's `OffloadingManager` (`pagedkv.vllm.offload` adapts it).
//!
//! Owns the wrapped index behind one `Mutex` (the class is `frozen`, as `KeyedBlockPool` is), and
//! the three objects `lookup` answers with (vLLM's `LookupResult` members, given at construction,
//! so the manager can bind `lookup` itself as its own method with no Python frame in between).
//!
//! Arguments are converted before the lock is taken and every Python object is built after it is
//! released: the core runs only inside [`PyOffloadIndex::with`], whose closure is `Send` (no Python
//! object, so no Python code, inside it). Keys are `bytes` (any iterable of them; a list is read
//! fastest); chunk ids come back as numpy `int32` arrays; the keys handed back (to store,
//! completed) are the caller's own objects, and evicted keys the objects that were stored (the
//! binding holds each keyed chunk's key object). Token positions are read from a request context:
//! through its `_offload_key_positions` dict when its class keeps vLLM's
//! `get_offload_key_position` (the `context_getter` given at construction), else by calling its
//! `get_offload_key_position` once per key.
//!
//! `lookup_function` hands out `lookup` as a `METH_FASTCALL` builtin bound to the index: the
//! `abi3-py39` build gives PyO3 methods an argument tuple per call, which vLLM's one call per key
//! would pay 256 times a prompt. The binding also keeps guesses for later calls (the last
//! `prepare_*` call's key addresses and chunks, the trail of lookups before a load); the core
//! checks every guess against the chunk's own key, so an address reused by another object costs a
//! comparison, never a wrong answer.

use std::cell::UnsafeCell;
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard, PoisonError};

use numpy::PyArray1;
use pagedkv::offload_index::{Hint, Lookup, OffloadIndex, StoreOut, NIL_CHUNK};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::{ffi, intern};

use crate::convert::{flag, scalar};
use crate::errors::{invalid_arg, CoreResultExt};

/// The scheduler-side index of a host tier of KV chunks; see `pagedkv.vllm.offload`.
#[pyclass(frozen, module = "pagedkv._core", name = "OffloadIndex")]
pub struct PyOffloadIndex {
    num_chunks: u32,
    inner: Mutex<State>,
    /// What `lookup` returns for a miss, a hit and a store in flight.
    results: [Py<PyAny>; 3],
    /// The `get_offload_key_position` whose contexts keep their positions in a dict.
    getter: Option<Py<PyAny>>,
}

/// Guesses of chunks for later calls ([`Hint`]: the core checks each against the chunk's key, so
/// a stale or wrong guess costs a comparison, never a wrong answer): the last `prepare_*` call's
/// key objects (by address) and their chunks, and the keys `lookup` answered since the last
/// `prepare_load` (vLLM looks up a request's keys one by one, then loads the hits).
struct Memo {
    ptrs: Vec<usize>,
    chunks: Vec<u32>,
}

/// Lookups remembered at most (then the trail starts again).
const TRAIL_MAX: usize = 1 << 16;

/// The index, each keyed chunk's key object (evictions hand back the objects that were stored),
/// and the guesses.
struct State {
    idx: OffloadIndex,
    objs: Vec<Option<Py<PyBytes>>>,
    memo: Memo,
    /// `(key address, chunk)` of each lookup since the last `prepare_load`.
    trail: Vec<(usize, u32)>,
}

/// The memo's chunks as a hint for `ptrs` (the addresses of the call's key objects), if the
/// call names the same objects.
fn hint<'a>(memo: &'a Memo, ptrs: &[usize]) -> Option<Hint<'a>> {
    (memo.ptrs == ptrs).then_some(Hint {
        chunks: &memo.chunks,
    })
}

/// Guesses for `ptrs` from the lookup trail: aligned at the last lookup of the first key.
fn trail_guess(trail: &[(usize, u32)], ptrs: &[usize]) -> Option<Vec<u32>> {
    let first = *ptrs.first()?;
    let at = trail.iter().rposition(|&(p, _)| p == first)?;
    Some(
        ptrs.iter()
            .enumerate()
            .map(|(i, &p)| match trail.get(at + i) {
                Some(&(q, c)) if q == p => c,
                _ => NIL_CHUNK,
            })
            .collect(),
    )
}

/// The addresses of `keys` (guesses are checked, so an address reused by another object is
/// harmless).
fn addresses(keys: &[Bound<'_, PyBytes>]) -> Vec<usize> {
    keys.iter().map(|k| k.as_ptr() as usize).collect()
}

/// Records the index's resolution of the keys at `ptrs` (the call just made) as the memo.
fn remember(idx: &OffloadIndex, memo: &mut Memo, ptrs: Vec<usize>) {
    memo.ptrs = ptrs;
    memo.chunks.clear();
    memo.chunks.extend_from_slice(idx.last_chunks());
}

impl PyOffloadIndex {
    #[inline]
    fn with<R: Send>(&self, f: impl Send + FnOnce(&mut State) -> R) -> R {
        // A panic inside the core while locked is a bug; every call is all or nothing, so later
        // calls go on rather than fail. Python objects dropped in here are `bytes` (no code runs
        // when they go); the ones a call replaces are handed out and dropped after the lock.
        let mut g: MutexGuard<'_, State> =
            self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut g)
    }

    /// Each key's token position in `ctx` (empty: none known).
    fn positions(
        &self,
        ctx: Option<&Bound<'_, PyAny>>,
        keys: &[Bound<'_, PyBytes>],
    ) -> PyResult<Vec<Option<i64>>> {
        let ctx = match ctx {
            Some(c) if !c.is_none() && !keys.is_empty() => c,
            _ => return Ok(Vec::new()),
        };
        let py = ctx.py();
        let name = intern!(py, "get_offload_key_position");
        let Ok(class_getter) = ctx.get_type().getattr(name) else {
            return Ok(Vec::new());
        };
        let pos = |v: Bound<'_, PyAny>| -> PyResult<Option<i64>> {
            if v.is_none() {
                return Ok(None);
            }
            v.extract::<i64>().map(Some).map_err(|_| {
                invalid_arg(
                    "req_context",
                    &v,
                    "a key position must be an int in the int64 range",
                )
            })
        };
        let mut out = Vec::with_capacity(keys.len());
        if self
            .getter
            .as_ref()
            .is_some_and(|g| class_getter.is(g.bind(py)))
        {
            if let Ok(table) = ctx.getattr(intern!(py, "_offload_key_positions")) {
                if let Ok(d) = table.cast::<PyDict>() {
                    for k in keys {
                        // SAFETY: the GIL is held; `d` and `k` are live. The value is borrowed
                        // from the dict and read before any other call.
                        let v = unsafe { ffi::PyDict_GetItemWithError(d.as_ptr(), k.as_ptr()) };
                        if v.is_null() {
                            if let Some(e) = PyErr::take(py) {
                                return Err(e);
                            }
                            out.push(None);
                            continue;
                        }
                        // SAFETY: as above; an exact int is read directly.
                        let fast = unsafe {
                            if ffi::Py_TYPE(v) == std::ptr::addr_of_mut!(ffi::PyLong_Type) {
                                let x = ffi::PyLong_AsLongLong(v);
                                if x == -1 && !ffi::PyErr_Occurred().is_null() {
                                    ffi::PyErr_Clear();
                                    None
                                } else {
                                    Some(x)
                                }
                            } else {
                                None
                            }
                        };
                        out.push(match fast {
                            Some(x) => Some(x),
                            // SAFETY: `v` is live (borrowed from the dict); owned from here.
                            None => pos(unsafe { Bound::from_borrowed_ptr(py, v) })?,
                        });
                    }
                    return Ok(out);
                }
            }
        }
        let method = ctx.getattr(name)?;
        for k in keys {
            out.push(pos(method.call1((k,))?)?);
        }
        Ok(out)
    }
}

/// A key that is not exact `bytes`: a `bytes` subclass is taken, anything else refused.
fn key_item<'py>(i: usize, item: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    item.cast_into::<PyBytes>().map_err(|e| {
        let item = e.into_inner();
        let got = item
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        invalid_arg(
            "keys",
            &item,
            format!("element {i}: must be bytes, got {got}"),
        )
    })
}

/// Reads keys (`bytes` each) from a list or any iterable, holding the objects.
fn keys_of<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut out = Vec::new();
    if let Ok(list) = obj.cast::<PyList>() {
        let py = obj.py();
        let n = list.len();
        out.reserve(n);
        for i in 0..n {
            // SAFETY: the GIL is held and `i` is below the list's length, which only Python code
            // could change: none runs between these reads unless an item is not exact `bytes`
            // (then the length is checked again).
            let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: `item` is a live borrowed reference; the type test reads its header.
            let exact = unsafe { ffi::Py_TYPE(item) == std::ptr::addr_of_mut!(ffi::PyBytes_Type) };
            // SAFETY: a live reference, owned from here on.
            let item = unsafe { Bound::from_borrowed_ptr(py, item) };
            if exact {
                // SAFETY: checked to be exactly `bytes` just above.
                out.push(unsafe { item.cast_into_unchecked::<PyBytes>() });
            } else {
                out.push(key_item(i, item)?);
                if list.len() != n {
                    return Err(invalid_arg(
                        "keys",
                        obj,
                        "the list changed size while it was read",
                    ));
                }
            }
        }
    } else {
        for (i, item) in obj.try_iter()?.enumerate() {
            out.push(key_item(i, item?)?);
        }
    }
    Ok(out)
}

/// The bytes and addresses of the keys of an exact list of exact `bytes`, read without taking
/// references; `None` for anything else (the caller then reads the keys with [`keys_of`]).
///
/// # Safety
/// The slices borrow from objects the list owns: until the caller is done with them it must run
/// no Python code and create no Python object (either could change the list and free a key).
unsafe fn borrowed_keys<'a>(obj: &'a Bound<'_, PyAny>) -> Option<(Vec<&'a [u8]>, Vec<usize>)> {
    let list = obj.cast_exact::<PyList>().ok()?;
    let n = list.len();
    let (mut ks, mut ptrs) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        // SAFETY: the GIL is held, `i` is in range and nothing runs between these reads; the
        // item is borrowed from the list, exact `bytes` checked before its buffer is read.
        unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() || ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyBytes_Type) {
                ffi::PyErr_Clear();
                return None;
            }
            let (mut data, mut len) = (std::ptr::null_mut(), 0);
            if ffi::PyBytes_AsStringAndSize(item, &mut data, &mut len) != 0 {
                ffi::PyErr_Clear();
                return None;
            }
            ks.push(std::slice::from_raw_parts(data as *const u8, len as usize));
            ptrs.push(item as usize);
        }
    }
    Some((ks, ptrs))
}

fn slices<'a>(keys: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    keys.iter().map(|k| k.as_bytes()).collect()
}

fn chunk_array<'py>(py: Python<'py>, chunks: &[u32]) -> Bound<'py, PyArray1<i32>> {
    // Chunk ids are below num_chunks <= i32::MAX (checked at construction).
    PyArray1::from_iter(py, chunks.iter().map(|&c| c as i32))
}

fn picked<'py>(
    py: Python<'py>,
    keys: &[Bound<'py, PyBytes>],
    idx: &[usize],
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, idx.iter().map(|&i| &keys[i]))
}

/// `METH_FASTCALL` (PEP 590), in CPython since 3.7; its stable-ABI constant is gated on 3.10.
const METH_FASTCALL: c_int = 0x0080;

/// The `PyMethodDef` of the fast `lookup`, shared by every index; CPython reads it, never writes.
struct FastDef(UnsafeCell<ffi::PyMethodDef>);

// SAFETY: the definition is written once, here, and only read afterwards (by CPython, with the
// GIL held).
unsafe impl Sync for FastDef {}

type FastWithKeywords = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

static LOOKUP_DEF: FastDef = FastDef(UnsafeCell::new(ffi::PyMethodDef {
    ml_name: c"lookup".as_ptr(),
    ml_meth: ffi::PyMethodDefPointer {
        // SAFETY: CPython calls `ml_meth` with the signature its flags name: METH_FASTCALL |
        // METH_KEYWORDS is `FastWithKeywords`. The union's field for it is gated on 3.10 in the
        // limited API, so the pointer goes through the field of the same size.
        PyCFunctionWithKeywords: unsafe {
            std::mem::transmute::<FastWithKeywords, ffi::PyCFunctionWithKeywords>(lookup_fast)
        },
    },
    ml_flags: METH_FASTCALL | ffi::METH_KEYWORDS,
    ml_doc: c"lookup(key, req_context=None): OffloadIndex.lookup, bound (req_context ignored)."
        .as_ptr(),
}));

/// The fast `lookup` (see [`PyOffloadIndex::lookup_function`]): `slf` is the index object.
/// Exactly one or two positional arguments with an exact `bytes` key are answered here; anything
/// else goes through the ordinary method (its checks and errors).
unsafe extern "C" fn lookup_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // No Rust panic may cross into C.
    let r = std::panic::catch_unwind(|| {
        // SAFETY: CPython calls a method with the GIL held, `args` holding `nargs` positional
        // arguments then one per keyword name, all borrowed for the call.
        unsafe {
            if kwnames.is_null() && (nargs == 1 || nargs == 2) {
                let key = *args;
                if ffi::Py_TYPE(key) == std::ptr::addr_of_mut!(ffi::PyBytes_Type) {
                    let py = Python::assume_attached();
                    if let Ok(me) = Borrowed::from_ptr(py, slf).cast::<PyOffloadIndex>() {
                        let me = me.get();
                        let data = ffi::PyBytes_AsString(key) as *const u8;
                        let len = ffi::PyBytes_Size(key) as usize;
                        let k = std::slice::from_raw_parts(data, len);
                        let i = me.answer(key as usize, k);
                        let out = me.results[i].as_ptr();
                        ffi::Py_INCREF(out);
                        return out;
                    }
                }
            }
            lookup_slow(slf, args, nargs, kwnames)
        }
    });
    r.unwrap_or_else(|_| {
        // SAFETY: the GIL is held (see above).
        unsafe {
            ffi::PyErr_SetString(
                ffi::PyExc_RuntimeError,
                c"pagedkv: panic in OffloadIndex.lookup".as_ptr(),
            );
        }
        std::ptr::null_mut()
    })
}

/// The ordinary `lookup` method called with the same arguments.
///
/// # Safety
/// As for [`lookup_fast`].
unsafe fn lookup_slow(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    Python::attach(|py| {
        let call = || -> PyResult<Bound<'_, PyAny>> {
            // SAFETY: as for `lookup_fast`: borrowed, live objects.
            let (me, names) = unsafe {
                (
                    Bound::from_borrowed_ptr(py, slf),
                    Bound::from_borrowed_ptr_or_opt(py, kwnames),
                )
            };
            let nkw = names.as_ref().map_or(0, |n| n.len().unwrap_or(0));
            let arg = |i: usize| {
                // SAFETY: `i < nargs + nkw`, the length of `args`.
                unsafe { Bound::from_borrowed_ptr(py, *args.add(i)) }
            };
            let pos = pyo3::types::PyTuple::new(py, (0..nargs as usize).map(arg))?;
            let kw = PyDict::new(py);
            if let Some(names) = &names {
                for j in 0..nkw {
                    kw.set_item(names.get_item(j)?, arg(nargs as usize + j))?;
                }
            }
            me.call_method(intern!(py, "lookup"), pos, Some(&kw))
        };
        match call() {
            Ok(v) => v.into_ptr(),
            Err(e) => {
                e.restore(py);
                std::ptr::null_mut()
            }
        }
    })
}

impl PyOffloadIndex {
    /// `complete_store` on the locked state: the completed key indices into `done`; the key
    /// objects of a failed store's chunks, to be dropped after the lock.
    fn complete(
        st: &mut State,
        ks: &[&[u8]],
        ptrs: &[usize],
        success: bool,
        done: &mut Vec<usize>,
    ) -> Vec<Py<PyBytes>> {
        let State {
            idx, objs, memo, ..
        } = st;
        idx.complete_store(ks, success, hint(memo, ptrs), done);
        if success {
            return Vec::new();
        }
        // A failed store's chunks lose their keys: their key objects go.
        let chunks = idx.last_chunks();
        done.iter()
            .map(|&i| chunks[i])
            .filter(|&c| c != NIL_CHUNK)
            .filter_map(|c| objs[c as usize].take())
            .collect()
    }

    /// The index of `lookup`'s answer for `key` (the bytes of the object at `ptr`) in `results`;
    /// the lookup joins the trail.
    #[inline]
    fn answer(&self, ptr: usize, key: &[u8]) -> usize {
        let r = self.with(|st| {
            let (r, c) = st.idx.lookup_chunk(key);
            if st.trail.len() >= TRAIL_MAX {
                st.trail.clear();
            }
            st.trail.push((ptr, c));
            r
        });
        match r {
            Lookup::Miss => 0,
            Lookup::Hit => 1,
            Lookup::Pending => 2,
        }
    }
}

#[pymethods]
impl PyOffloadIndex {
    #[new]
    #[pyo3(signature = (num_chunks, lookup_results = None, context_getter = None))]
    fn new(
        num_chunks: &Bound<'_, PyAny>,
        lookup_results: Option<(Py<PyAny>, Py<PyAny>, Py<PyAny>)>,
        context_getter: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let py = num_chunks.py();
        let n = scalar::<u32>("num_chunks", num_chunks)?;
        if n > i32::MAX as u32 {
            return Err(invalid_arg(
                "num_chunks",
                num_chunks,
                format!("must be at most {} (chunk ids are int32)", i32::MAX),
            ));
        }
        let results = match lookup_results {
            Some((m, h, p)) => [m, h, p],
            None => [0, 1, 2].map(|i: i32| i.into_pyobject(py).unwrap().into_any().unbind()),
        };
        let idx = OffloadIndex::new(n).py()?;
        let mut objs = Vec::new();
        objs.resize_with(n as usize, || None);
        Ok(Self {
            num_chunks: n,
            inner: Mutex::new(State {
                idx,
                objs,
                memo: Memo {
                    ptrs: Vec::new(),
                    chunks: Vec::new(),
                },
                trail: Vec::new(),
            }),
            results,
            getter: context_getter,
        })
    }

    /// Chunks in the tier.
    #[getter]
    fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    /// Free chunks (never used, failed, or ready and unread).
    #[getter]
    fn num_free(&self) -> usize {
        self.with(|st| st.idx.num_free())
    }

    /// Chunks with a store in flight.
    #[getter]
    fn num_pending(&self) -> usize {
        self.with(|st| st.idx.num_pending())
    }

    /// Keyed chunks.
    #[getter]
    fn num_keys(&self) -> usize {
        self.with(|st| st.idx.num_keys())
    }

    /// Miss, hit or pending (the objects given at construction); `req_context` is ignored.
    #[pyo3(signature = (key, req_context = None))]
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = req_context;
        let k = match key.cast::<PyBytes>() {
            Ok(b) => b.as_bytes(),
            Err(_) => {
                return Err(invalid_arg("key", key, "must be bytes"));
            }
        };
        Ok(self.results[self.answer(key.as_ptr() as usize, k)].clone_ref(py))
    }

    /// `lookup` as a builtin function bound to this index, called without PyO3's argument
    /// parsing (`lookup(key, req_context=None)`, the same answers and errors): what a caller
    /// making one call per key binds.
    fn lookup_function<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        // SAFETY: `LOOKUP_DEF` is a static, valid definition; the new function holds a reference
        // to the index (its `self`); the GIL is held.
        unsafe {
            let f = ffi::PyCFunction_NewEx(LOOKUP_DEF.0.get(), slf.as_ptr(), std::ptr::null_mut());
            Bound::from_owned_ptr_or_err(py, f)
        }
    }

    /// Holds the chunks of `keys` (each ready) until `complete_load`: their ids, in key order.
    #[pyo3(signature = (keys, req_context = None))]
    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let keys = keys_of(keys)?;
        let pos = self.positions(req_context, &keys)?;
        let (ks, ptrs) = (slices(&keys), addresses(&keys));
        let mut out = Vec::new();
        self.with(|st| {
            let State {
                idx, memo, trail, ..
            } = st;
            let guess = trail_guess(trail, &ptrs);
            trail.clear();
            let h = match &guess {
                Some(g) => Some(Hint { chunks: g }),
                None => hint(memo, &ptrs),
            };
            let r = idx.prepare_load(&ks, &pos, h, &mut out);
            if r.is_ok() {
                remember(idx, memo, ptrs);
            }
            r
        })
        .py()?;
        Ok(chunk_array(py, &out))
    }

    /// Gives back the references `prepare_load` took, tail first.
    fn complete_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        // SAFETY: only the core runs while the slices live; the error is built after.
        if let Some((ks, ptrs)) = unsafe { borrowed_keys(keys) } {
            let r = self.with(|st| st.idx.complete_load(&ks, hint(&st.memo, &ptrs)));
            drop(ks);
            return r.py();
        }
        let keys = keys_of(keys)?;
        let (ks, ptrs) = (slices(&keys), addresses(&keys));
        self.with(|st| st.idx.complete_load(&ks, hint(&st.memo, &ptrs)))
            .py()
    }

    /// Moves the present ready chunks of `keys` to the back of the free order, the first last.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        // SAFETY: only the core runs while the slices live.
        if let Some((ks, ptrs)) = unsafe { borrowed_keys(keys) } {
            self.with(|st| st.idx.touch(&ks, hint(&st.memo, &ptrs)));
            return Ok(());
        }
        let keys = keys_of(keys)?;
        let (ks, ptrs) = (slices(&keys), addresses(&keys));
        self.with(|st| st.idx.touch(&ks, hint(&st.memo, &ptrs)));
        Ok(())
    }

    /// The keys of `keys` not in the tier, first occurrence each (the caller's objects).
    fn missing<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let ks = slices(&keys);
        let idx = self.with(|st| st.idx.missing(&ks));
        picked(py, &keys, &idx)
    }

    /// Chunks for the keys not in the tier: `(keys_to_store, chunk ids or None when there is no
    /// room (nothing changed), evicted keys)`. With `admit` (bools aligned with `keys`), only the
    /// admitted new keys are stored.
    #[pyo3(signature = (keys, req_context = None, admit = None))]
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: Option<&Bound<'py, PyAny>>,
        admit: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(
        Bound<'py, PyList>,
        Option<Bound<'py, PyArray1<i32>>>,
        Bound<'py, PyList>,
    )> {
        let keys = keys_of(keys)?;
        let mask: Option<Vec<bool>> = match admit {
            Some(a) if !a.is_none() => {
                let mut v = Vec::new();
                for item in a.try_iter()? {
                    v.push(flag("admit", &item?)?);
                }
                Some(v)
            }
            _ => None,
        };
        let pos = self.positions(req_context, &keys)?;
        let (ks, ptrs) = (slices(&keys), addresses(&keys));
        let mut objs: Vec<Option<Py<PyBytes>>> =
            keys.iter().map(|k| Some(k.clone().unbind())).collect();
        let mut out = StoreOut::default();
        let (room, evicted_objs) = self
            .with(|st| {
                let room = st.idx.prepare_store(&ks, &pos, mask.as_deref(), &mut out)?;
                // The evicted chunks' key objects out, the new chunks' in.
                let evicted: Vec<Option<Py<PyBytes>>> = out
                    .evicted_chunks
                    .iter()
                    .map(|&c| st.objs[c as usize].take())
                    .collect();
                for (&i, &c) in out.new.iter().zip(&out.chunks) {
                    st.objs[c as usize] = objs[i].take();
                }
                remember(&st.idx, &mut st.memo, ptrs);
                Ok::<_, pagedkv::Error>((room, evicted))
            })
            .py()?;
        drop(objs);
        let new = picked(py, &keys, &out.new)?;
        let chunks = room.then(|| chunk_array(py, &out.chunks));
        let evicted = PyList::empty(py);
        for (o, k) in evicted_objs.into_iter().zip(out.evicted_keys()) {
            match o {
                Some(o) => evicted.append(o.into_bound(py))?,
                None => evicted.append(PyBytes::new(py, k))?,
            }
        }
        Ok((new, chunks, evicted))
    }

    /// Completes the stores of the pending keys among `keys` (ready, or dropped when not
    /// `success`); the keys completed, first occurrence each (the caller's objects).
    #[pyo3(signature = (keys, success = true))]
    fn complete_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        success: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut done = Vec::new();
        // SAFETY: only the core runs while the slices live; the completed keys are taken (owned)
        // from the unchanged list before any object is created.
        if let Some((ks, ptrs)) = unsafe { borrowed_keys(keys) } {
            let dropped = self.with(|st| Self::complete(st, &ks, &ptrs, success, &mut done));
            drop(ks);
            let list = keys.cast_exact::<PyList>()?;
            let owned: Vec<Bound<'py, PyAny>> = done
                .iter()
                .map(|&i| {
                    // SAFETY: `i` indexes the list read above, which nothing has changed since.
                    unsafe {
                        let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
                        Bound::from_borrowed_ptr(py, item)
                    }
                })
                .collect();
            drop(dropped);
            return PyList::new(py, owned);
        }
        let keys = keys_of(keys)?;
        let (ks, ptrs) = (slices(&keys), addresses(&keys));
        let _dropped = self.with(|st| Self::complete(st, &ks, &ptrs, success, &mut done));
        picked(py, &keys, &done)
    }

    /// Forgets every chunk, held ones included.
    fn reset(&self) {
        let _dropped = self.with(|st| {
            st.idx.reset();
            st.memo.ptrs.clear();
            st.trail.clear();
            st.objs
                .iter_mut()
                .filter_map(Option::take)
                .collect::<Vec<_>>()
        });
    }

    fn ref_count(&self, chunk: &Bound<'_, PyAny>) -> PyResult<u32> {
        let c = scalar::<u32>("chunk", chunk)?;
        self.with(|st| st.idx.ref_count(c)).py()
    }

    fn is_free(&self, chunk: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = scalar::<u32>("chunk", chunk)?;
        self.with(|st| st.idx.is_free(c)).py()
    }

    fn is_pending(&self, chunk: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = scalar::<u32>("chunk", chunk)?;
        self.with(|st| st.idx.is_pending(c)).py()
    }

    /// The chunk's key, or None.
    fn key<'py>(
        &self,
        py: Python<'py>,
        chunk: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let c = scalar::<u32>("chunk", chunk)?;
        let k = self
            .with(|st| st.idx.key(c).map(|k| k.map(<[u8]>::to_vec)))
            .py()?;
        Ok(k.map(|k| PyBytes::new(py, &k)))
    }

    /// The chunk's position stamp (token position, else a name counter).
    fn stamp(&self, chunk: &Bound<'_, PyAny>) -> PyResult<i64> {
        let c = scalar::<u32>("chunk", chunk)?;
        self.with(|st| st.idx.stamp(c)).py()
    }

    /// Free chunks in reuse order, front (taken next) first.
    fn free_order(&self) -> Vec<u32> {
        self.with(|st| st.idx.free_order())
    }

    /// `{key: chunk}` for every keyed chunk.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let all: Vec<(Vec<u8>, u32)> =
            self.with(|st| st.idx.entries().map(|(k, c)| (k.to_vec(), c)).collect());
        let d = PyDict::new(py);
        for (k, c) in all {
            d.set_item(PyBytes::new(py, &k), c)?;
        }
        Ok(d)
    }

    /// Counters: lookups, hits, pending_hits, stores, failed_stores, evictions, loads, refusals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|st| st.idx.stats());
        let d = PyDict::new(py);
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("pending_hits", s.pending_hits)?;
        d.set_item("stores", s.stores)?;
        d.set_item("failed_stores", s.failed_stores)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("loads", s.loads)?;
        d.set_item("refusals", s.refusals)?;
        Ok(d)
    }

    /// Raises `InvariantViolationError` if the index is inconsistent (never expected).
    fn check_invariants(&self) -> PyResult<()> {
        self.with(|st| st.idx.check_invariants()).py()
    }

    fn __len__(&self) -> usize {
        self.num_chunks as usize
    }

    fn __repr__(&self) -> String {
        let (free, keys, pending) =
            self.with(|st| (st.idx.num_free(), st.idx.num_keys(), st.idx.num_pending()));
        format!(
            "OffloadIndex(num_chunks={}, num_free={free}, num_keys={keys}, num_pending={pending})",
            self.num_chunks
        )
    }
}
