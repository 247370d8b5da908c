//! `_core.KeyedBlockPool`: the core's caller-keyed pool ([`pagedkv::keyed::KeyedPool`]).
//!
//! Owns the wrapped pool behind one `Mutex` (the class is `frozen`, as `BlockManager` is, so
//! calls from several threads are serialized rather than refused). Every call is small work for
//! one engine step, so the GIL stays held: releasing it would cost about as much as the work.
//!
//! Arguments are converted before the lock is taken, and every Python object (a result, an
//! exception) is built after it is released: the core runs only inside [`PyKeyedBlockPool::with`],
//! whose guard ends with the closure. Building a Python object can run arbitrary Python code (the
//! cyclic GC and its finalizers), and code that touched this pool while its lock was held would
//! wait for it forever. Keys are `bytes`; block ids are ints; errors are the `pagedkv.errors`
//! classes (a key of another type is `InvalidArgumentError` naming the argument).

use std::sync::{Mutex, MutexGuard, PoisonError};

use pagedkv::keyed::{KeyedPool, Placement};
use pagedkv::BlockId;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::{count, flag, ids_into, scalar};
use crate::errors::{invalid_arg, CoreResultExt};

/// Paged KV block pool keyed by caller-supplied hashes; see `pagedkv.vllm` for its main user.
#[pyclass(frozen, module = "pagedkv._core", name = "KeyedBlockPool")]
pub struct PyKeyedBlockPool {
    num_blocks: u32,
    inner: Mutex<KeyedPool>,
}

impl PyKeyedBlockPool {
    /// Runs `f` on the locked pool; the lock is released when `f` returns. `f` is `Send`, which
    /// keeps Python objects (and so Python code) out of it.
    #[inline]
    fn with<R: Send>(&self, f: impl Send + FnOnce(&mut KeyedPool) -> R) -> R {
        // A panic inside the core while locked is a bug; the pool is still the all-or-nothing
        // result of the calls before it, so later calls go on rather than fail.
        let mut g: MutexGuard<'_, KeyedPool> =
            self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut g)
    }
}

/// A key argument: `bytes` only (a `str` has no one byte form, and a mutable buffer could change
/// between the check and the insert).
fn key_of<'a>(what: &str, obj: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    match obj.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes()),
        Err(_) => {
            let got = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            Err(invalid_arg(what, obj, format!("must be bytes, got {got}")))
        }
    }
}

/// A sequence of keys (`bytes` each), held as Python objects so their bytes can be borrowed.
fn keys_of<'py>(what: &str, obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        match item.cast_into::<PyBytes>() {
            Ok(b) => out.push(b),
            Err(e) => {
                let item = e.into_inner();
                let got = item
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "?".into());
                return Err(invalid_arg(
                    what,
                    &item,
                    format!("element {i}: must be bytes, got {got}"),
                ));
            }
        }
    }
    Ok(out)
}

fn placement(obj: &Bound<'_, PyAny>) -> PyResult<Placement> {
    match obj.extract::<String>().as_deref() {
        Ok("cache") => Ok(Placement::ByCache),
        Ok("front") => Ok(Placement::Front),
        Ok("back") => Ok(Placement::Back),
        _ => Err(invalid_arg(
            "placement",
            obj,
            "must be 'cache', 'front' or 'back'",
        )),
    }
}

fn block(obj: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    scalar::<u32>("block", obj)
}

#[pymethods]
impl PyKeyedBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, reserve_null = None, null_keys = None))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        reserve_null: Option<&Bound<'_, PyAny>>,
        null_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let n = scalar::<u32>("num_blocks", num_blocks)?;
        let null = match reserve_null {
            Some(o) => flag("reserve_null", o)?,
            None => true,
        };
        let null_keys = match null_keys {
            Some(o) => flag("null_keys", o)?,
            None => false,
        };
        let inner = KeyedPool::new(n, null).py()?.with_null_keys(null_keys);
        Ok(Self {
            num_blocks: n,
            inner: Mutex::new(inner),
        })
    }

    /// Blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The null block's id, or None.
    #[getter]
    fn null_block(&self) -> Option<u32> {
        self.with(|p| p.null_block())
    }

    /// Free blocks, cached ones included.
    #[getter]
    fn num_free(&self) -> usize {
        self.with(|p| p.num_free())
    }

    /// Keys in the map.
    #[getter]
    fn num_keys(&self) -> usize {
        self.with(|p| p.num_keys())
    }

    /// Takes `n` blocks from the front (count 1 each): `(blocks, evicted)`, where `evicted` lists
    /// the blocks among them that lost their keys.
    fn allocate(&self, n: &Bound<'_, PyAny>) -> PyResult<(Vec<u32>, Vec<u32>)> {
        let n = count("n", n)?;
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let r = self.with(|p| p.allocate_into(n, &mut out, &mut ev));
        r.py()?;
        Ok((out, ev))
    }

    /// One more reference to each block; free ones are revived (the null block is skipped).
    fn touch(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids: Vec<u32> = ids_into("blocks", blocks)?;
        self.with(|p| p.touch(&ids)).py()
    }

    /// One reference fewer on each block; each reaching zero is placed per `placement`
    /// (`'cache'`: uncached to the front, cached to the back; `'front'`; `'back'`).
    #[pyo3(signature = (blocks, placement = None))]
    fn release(
        &self,
        blocks: &Bound<'_, PyAny>,
        placement: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids: Vec<u32> = ids_into("blocks", blocks)?;
        let p = match placement {
            Some(o) => self::placement(o)?,
            None => Placement::ByCache,
        };
        self.with(|pool| pool.release(&ids, p)).py()
    }

    /// Sets a held block's count (not to or from zero).
    fn set_ref(&self, block: &Bound<'_, PyAny>, count: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = self::block(block)?;
        let c = scalar::<u32>("count", count)?;
        self.with(|p| p.set_ref(b, c)).py()
    }

    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = self::block(block)?;
        self.with(|p| p.ref_count(b)).py()
    }

    fn is_cached(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let b = self::block(block)?;
        self.with(|p| p.is_cached(b)).py()
    }

    fn is_free(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let b = self::block(block)?;
        self.with(|p| p.is_free(b)).py()
    }

    /// The block's keys, the first inserted first.
    fn keys_of<'py>(
        &self,
        py: Python<'py>,
        block: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let b = self::block(block)?;
        let keys: Vec<Vec<u8>> = self
            .with(|p| {
                p.keys_of(b)
                    .map(|ks| ks.iter().map(|k| k.to_vec()).collect())
            })
            .py()?;
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
    }

    /// Free blocks in eviction order, front first.
    fn free_order(&self) -> Vec<u32> {
        self.with(|p| p.free_order())
    }

    /// The first block under `key`, or None.
    fn lookup(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let key = key_of("key", key)?;
        Ok(self.with(|p| p.lookup(key)))
    }

    /// The first block under each of `keys` (None where one misses), in one call.
    fn lookup_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u32>>> {
        let keys = keys_of("keys", keys)?;
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Ok(self.with(|p| keys.iter().map(|k| p.lookup(k)).collect()))
    }

    /// Stores `blocks[i]` under `keys[i]` for every `i`; how many pairs were new. All or nothing:
    /// a pair the core refuses (a block out of range, the null block) undoes the ones before it.
    fn insert_many(&self, keys: &Bound<'_, PyAny>, blocks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of("keys", keys)?;
        let ids: Vec<u32> = ids_into("blocks", blocks)?;
        if ids.len() != keys.len() {
            return Err(invalid_arg(
                "blocks",
                blocks,
                format!("{} blocks for {} keys", ids.len(), keys.len()),
            ));
        }
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        self.with(|p| {
            let mut added: Vec<usize> = Vec::new();
            for (i, (k, &b)) in keys.iter().zip(&ids).enumerate() {
                match p.insert(k, b) {
                    Ok(true) => added.push(i),
                    Ok(false) => {}
                    Err(e) => {
                        for &j in added.iter().rev() {
                            let _ = p.remove(keys[j], ids[j]);
                        }
                        return Err(e);
                    }
                }
            }
            Ok(added.len())
        })
        .py()
    }

    /// The first block under `hash + group (4 bytes, big-endian)` for each group, or None if any
    /// group misses.
    fn lookup_groups(
        &self,
        hash: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<u32>>> {
        let hash = key_of("hash", hash)?;
        let gs: Vec<u32> = ids_into("groups", groups)?;
        let mut out = Vec::with_capacity(gs.len());
        let hit = self.with(|p| p.lookup_groups(hash, &gs, &mut out));
        Ok(hit.then_some(out))
    }

    fn contains(&self, key: &Bound<'_, PyAny>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of("key", key)?;
        let b = self::block(block)?;
        Ok(self.with(|p| p.contains(key, b)))
    }

    /// Stores `block` under `key`; False if the pair was there already. The null block cannot
    /// be keyed (InvalidArgumentError).
    fn insert(&self, key: &Bound<'_, PyAny>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of("key", key)?;
        let b = self::block(block)?;
        self.with(|p| p.insert(key, b)).py()
    }

    /// Removes the pair `(key, block)`; whether it was present.
    fn remove(&self, key: &Bound<'_, PyAny>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of("key", key)?;
        let b = self::block(block)?;
        self.with(|p| p.remove(key, b)).py()
    }

    /// Removes every key of `block`; how many it had.
    fn evict(&self, block: &Bound<'_, PyAny>) -> PyResult<usize> {
        let b = self::block(block)?;
        self.with(|p| p.evict(b)).py()
    }

    /// Forgets every key if no block is held; whether it did.
    fn reset(&self) -> bool {
        self.with(|p| p.reset())
    }

    /// Forgets every key, held blocks' included.
    fn clear_keys(&self) {
        self.with(|p| p.clear_keys())
    }

    /// `{key: block}` for a key that has only ever held one block at a time, `{key: [blocks in
    /// insertion order]}` for one that has held several.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        type Entry = (Vec<u8>, Vec<u32>, bool);
        let all: Vec<Entry> = self.with(|p| {
            p.entries()
                .map(|(k, b, many)| (k.to_vec(), b.to_vec(), many))
                .collect()
        });
        let d = PyDict::new(py);
        for (k, b, many) in all {
            let key = PyBytes::new(py, &k);
            match (many, b.as_slice()) {
                (false, [one]) => d.set_item(key, *one)?,
                _ => d.set_item(key, b)?,
            }
        }
        Ok(d)
    }

    /// The first free block, or None.
    #[getter]
    fn free_front(&self) -> Option<u32> {
        self.with(|p| p.free_front())
    }

    /// The last free block, or None.
    #[getter]
    fn free_back(&self) -> Option<u32> {
        self.with(|p| p.free_back())
    }

    /// `(before, after)` of a free block in the eviction order (None at an end), or None if the
    /// block is not free.
    #[allow(clippy::type_complexity)]
    fn free_neighbours(
        &self,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(Option<u32>, Option<u32>)>> {
        let b = self::block(block)?;
        self.with(|p| p.free_neighbours(b)).py()
    }

    /// Counters: lookups, hits, evictions, revivals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|p| p.stats());
        let d = PyDict::new(py);
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("revivals", s.revivals)?;
        Ok(d)
    }

    /// Raises `InvariantViolationError` if the pool's state is inconsistent (never expected).
    fn check_invariants(&self) -> PyResult<()> {
        self.with(|p| p.check_invariants()).py()
    }

    fn __len__(&self) -> usize {
        self.num_blocks as usize
    }

    fn __repr__(&self) -> String {
        let (free, keys) = self.with(|p| (p.num_free(), p.num_keys()));
        format!(
            "KeyedBlockPool(num_blocks={}, num_free={}, num_keys={})",
            self.num_blocks, free, keys
        )
    }
}
