//! `_core.BlockManager`: the core's block manager behind a Python class.
//!
//! Owns the wrapped [`pagedkv::manager::BlockManager`] and the registered step buffers (with a
//! strong reference to the [`PyStepArena`] that owns their memory), behind one `Mutex`. The class
//! is `frozen`: Python never borrows it mutably, so two threads calling one manager are serialized
//! by the lock instead of one getting `RuntimeError("Already borrowed")`.
//!
//! # The pattern every method follows (new methods too)
//!
//! 1. **Convert every argument first**, with the GIL held and the lock *not* held. Conversion may
//!    run Python code (`__index__`, numpy), and that code may call this same manager; it must find
//!    the lock free. Id sequences go through [`with_ids`] into a thread-local scratch vector
//!    ([`scratch`] with [`TOKENS`] / [`SEQS`] / [`COUNTS`]), so steady-state calls do not allocate
//!    and concurrent or re-entrant calls never share a buffer.
//! 2. **Run the core under the lock** with [`PyBlockManager::with`] (small, constant-time work:
//!    the GIL stays held when the lock is free) or [`PyBlockManager::run`] with `detach = true`
//!    (work that grows with the input, at least [`DETACH_MIN`] ids: the GIL is released for it).
//!    Both wait for a contended lock with the GIL released, so a thread holding the lock can
//!    always get the GIL back: no deadlock. The closure is `Send`, which makes touching a
//!    Python object under the lock a compile error; it returns the core's `pagedkv::Result`, or
//!    plain data copied out of the state (a `Stats`, a `Vec` of block ids).
//! 3. **Build Python results and map errors (`.py()`) after the lock is released**: creating
//!    Python objects can run arbitrary code (the cyclic GC, `__del__`) that may re-enter.
//!
//! So a method looks like:
//!
//! ```ignore
//! fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
//!     let id = seq("seq_id", seq_id)?;                      // 1. convert
//!     self.with(py, |st| st.inner.free(id)).py()           // 2. core under the lock, 3. map
//! }
//! ```
//!
//! The core makes every call all-or-nothing and conversion happens before it is touched, so a
//! raised exception always leaves the manager unchanged. Configuration getters read an immutable
//! copy of the config without locking.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::thread::LocalKey;

use pagedkv::hash::{MmInput, SeqKeys};
use pagedkv::manager::{AdmitRequest, BlockManager, ManagerConfig};
use pagedkv::metrics::Stats;
use pagedkv::step::{RegisteredBuffers, StepInfo};
use pagedkv::swap::CostModel;
use pagedkv::{BlockId, Error, SeqId};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::buffers::PyStepArena;
use crate::convert::{count, flag, ids_into, scalar, with_ids};
use crate::errors::{invalid_arg, CoreResultExt};

/// What `step` returns to Python: `(num_seqs, num_tokens, num_kv_indices, num_copies,
/// max_seq_len, num_swap_out, num_swap_in, max_query_len)`, the order `StepInfo` declares.
type StepTuple = (usize, usize, usize, usize, usize, usize, usize, usize);

/// Inputs with at least this many elements are processed with the GIL released. Below it the
/// release/re-acquire pair (~0.1 µs) costs about as much as the work itself.
const DETACH_MIN: usize = 32;

thread_local! {
    /// Token-id scratch (admit, append, append_batch).
    static TOKENS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// Sequence-id scratch (append_batch, step).
    static SEQS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// Per-sequence count scratch (step).
    static COUNTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch vector `key`, or with a fresh one when the thread's vector
/// is in use (a call re-entered from Python code run during argument conversion).
fn scratch<T: 'static, R>(
    key: &'static LocalKey<RefCell<Vec<T>>>,
    f: impl FnOnce(&mut Vec<T>) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => f(&mut v),
        Err(_) => f(&mut Vec::new()),
    })
}

/// Ids for [`PyStepArena`] ownership: unique per manager for the life of the process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Step buffers registered with the core, and the arena that owns their memory.
struct Registered {
    bufs: RegisteredBuffers,
    /// The arena the raw pointers point into; this strong reference keeps it allocated.
    arena: Py<PyStepArena>,
    /// The manager id that claimed the arena; given back when the registration goes.
    owner: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Usually released already, under the manager's lock; this covers the manager's own end.
        // Releasing twice is harmless: it only clears the owner if it is still ours.
        self.arena.get().release(self.owner);
    }
}

/// Everything the lock protects.
struct State {
    inner: BlockManager,
    registered: Option<Registered>,
}

impl State {
    fn step(&mut self, seqs: &[SeqId], counts: &[u32]) -> pagedkv::Result<StepInfo> {
        let Some(reg) = self.registered.as_mut() else {
            return Err(Error::BuffersNotRegistered);
        };
        // SAFETY: the registered memory is the arena `reg.arena` owns; that strong reference
        // keeps it allocated at a fixed address for as long as the registration exists, and
        // Python can neither free nor resize it (it only ever sees non-owning, non-resizable
        // views). The lock held by our caller excludes a second view from this manager, and the
        // arena's single-owner claim excludes other managers. That no Python code reads or
        // writes the host buffers while a step fills them is the documented contract of
        // `StepBuffers` (do not touch them, or copy from them, during a step).
        let mut out = unsafe { reg.bufs.as_step_buffers() };
        self.inner.build_step(seqs, counts, &mut out)
    }
}

/// Paged KV cache block manager (the core's `BlockManager`); see `pagedkv.BlockManager` for the
/// documented Python API.
#[pyclass(frozen, module = "pagedkv._core", name = "BlockManager")]
pub struct PyBlockManager {
    /// A copy of the core's configuration, which never changes: read without the lock.
    cfg: ManagerConfig,
    /// This manager's id for arena ownership.
    id: u64,
    state: Mutex<State>,
}

impl PyBlockManager {
    #[inline]
    fn lock_blocking(&self) -> MutexGuard<'_, State> {
        // A panic inside the core while locked is a bug; the state is still the core's
        // all-or-nothing result of the calls before it, so later calls go on rather than fail.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the locked state: with the GIL held when the lock is free (the common,
    /// single-threaded case costs one uncontended lock), otherwise waiting for the lock and
    /// running `f` with the GIL released.
    #[inline]
    fn with<R, F>(&self, py: Python<'_>, f: F) -> R
    where
        F: Send + FnOnce(&mut State) -> R,
        R: Send,
    {
        match self.state.try_lock() {
            Ok(mut g) => f(&mut g),
            Err(TryLockError::Poisoned(p)) => f(&mut p.into_inner()),
            Err(TryLockError::WouldBlock) => py.detach(|| f(&mut self.lock_blocking())),
        }
    }

    /// [`Self::with`], or, when `detach`, takes the lock and runs `f` with the GIL released.
    #[inline]
    fn run<R, F>(&self, py: Python<'_>, detach: bool, f: F) -> R
    where
        F: Send + FnOnce(&mut State) -> R,
        R: Send,
    {
        if detach {
            py.detach(|| f(&mut self.lock_blocking()))
        } else {
            self.with(py, f)
        }
    }
}

fn seq(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<SeqId> {
    scalar::<u64>(what, obj)
}

fn opt<'a, 'py>(obj: &'a Option<Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    obj.as_ref().filter(|o| !o.is_none())
}

fn bytes_of(what: &str, obj: &Bound<'_, PyAny>, allow_str: bool) -> PyResult<Vec<u8>> {
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
fn seq_keys(
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
fn hash_list(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
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

fn hash_of(what: &str, item: &Bound<'_, PyAny>) -> PyResult<u128> {
    if item.is_instance_of::<PyBool>() {
        return Err(invalid_arg(what, item, "a hash is an int, not a bool"));
    }
    item.extract::<u128>()
        .map_err(|_| invalid_arg(what, item, "a hash is an int in [0, 2**128)"))
}

/// A list of parent hashes: ints or None.
fn parent_list(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u128>>> {
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

/// What `admit`, `admit_batch` (per sequence) and `resume` return: every field of the core's
/// `AdmitResult`, `(cached_tokens, new_blocks, num_blocks, num_tokens, cached_tokens_gpu,
/// cached_tokens_host)`.
type AdmitTuple = (u32, u32, u32, u32, u32, u32);

fn admit_tuple(r: &pagedkv::AdmitResult) -> AdmitTuple {
    (
        r.cached_tokens,
        r.new_blocks,
        r.num_blocks,
        r.num_tokens,
        r.cached_tokens_gpu,
        r.cached_tokens_host,
    )
}

/// What `take_demotions` returns per demotion: `(host_block, hash, parent, salt_digest, tokens)`.
type DemotionTuple = (u32, u128, Option<u128>, u128, Vec<u32>);
/// `lookup_tiers`' answer: `(gpu_blocks, host_blocks, remaining_hashes, salt_digest, parent_hash)`.
type LookupTuple = (usize, usize, Vec<u128>, u128, Option<u128>);

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    crate::stats::to_dict(py, s)
}

#[pymethods]
impl PyBlockManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size=None, watermark_blocks=None, max_blocks_per_seq=None, enable_prefix_caching=None, verify_prefix=None, hash_seed=None, num_host_blocks=None, kv_event_capacity=None, host_cache=None, host_write_through=None, host_load_min_blocks=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<Bound<'_, PyAny>>,
        watermark_blocks: Option<Bound<'_, PyAny>>,
        max_blocks_per_seq: Option<Bound<'_, PyAny>>,
        enable_prefix_caching: Option<Bound<'_, PyAny>>,
        verify_prefix: Option<Bound<'_, PyAny>>,
        hash_seed: Option<Bound<'_, PyAny>>,
        num_host_blocks: Option<Bound<'_, PyAny>>,
        kv_event_capacity: Option<Bound<'_, PyAny>>,
        host_cache: Option<Bound<'_, PyAny>>,
        host_write_through: Option<Bound<'_, PyAny>>,
        host_load_min_blocks: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let num_blocks = scalar::<u32>("num_blocks", num_blocks)?;
        let block_size = match opt(&block_size) {
            Some(b) => scalar::<u32>("block_size", b)?,
            None => 16,
        };
        let mut cfg = ManagerConfig::new(num_blocks, block_size);
        if let Some(w) = opt(&watermark_blocks) {
            cfg.watermark_blocks = scalar::<u32>("watermark_blocks", w)?;
        }
        if let Some(m) = opt(&max_blocks_per_seq) {
            cfg.max_blocks_per_seq = scalar::<u32>("max_blocks_per_seq", m)?;
        }
        // Flags are bools only: `bool("false")` is True. None (not given) keeps the default.
        if let Some(f) = &enable_prefix_caching {
            cfg.enable_prefix_caching = flag("enable_prefix_caching", f)?;
        }
        if let Some(f) = &verify_prefix {
            cfg.verify_prefix = flag("verify_prefix", f)?;
        }
        if let Some(k) = opt(&hash_seed) {
            cfg.hash_seed = Some(scalar::<u64>("hash_seed", k)?);
        }
        if let Some(h) = opt(&num_host_blocks) {
            cfg.num_host_blocks = scalar::<u32>("num_host_blocks", h)?;
        }
        if let Some(c) = opt(&kv_event_capacity) {
            cfg.kv_event_capacity = count("kv_event_capacity", c)?;
        }
        if let Some(f) = &host_cache {
            cfg.host_cache = flag("host_cache", f)?;
        }
        if let Some(f) = &host_write_through {
            cfg.host_write_through = flag("host_write_through", f)?;
        }
        if let Some(n) = opt(&host_load_min_blocks) {
            cfg.host_load_min_blocks = scalar::<u32>("host_load_min_blocks", n)?;
        }
        let inner = BlockManager::new(cfg).py()?;
        Ok(Self {
            cfg: inner.config().clone(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State {
                inner,
                registered: None,
            }),
        })
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.cfg.num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.cfg.block_size
    }

    #[getter]
    fn watermark_blocks(&self) -> u32 {
        self.cfg.watermark_blocks
    }

    #[getter]
    fn max_blocks_per_seq(&self) -> u32 {
        self.cfg.max_blocks_per_seq
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.cfg.enable_prefix_caching
    }

    #[getter]
    fn verify_prefix(&self) -> bool {
        self.cfg.verify_prefix
    }

    #[getter]
    fn num_host_blocks(&self) -> u32 {
        self.cfg.num_host_blocks
    }

    /// Whether step buffers are registered.
    #[getter]
    fn has_buffers(&self, py: Python<'_>) -> bool {
        self.with(py, |st| st.registered.is_some())
    }

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

    #[getter]
    fn host_cache(&self) -> bool {
        self.cfg.host_cache
    }

    #[getter]
    fn host_write_through(&self) -> bool {
        self.cfg.host_write_through
    }

    #[getter]
    fn host_load_min_blocks(&self) -> u32 {
        self.cfg.host_load_min_blocks
    }

    /// How far a prompt is cached per tier: `(gpu_blocks, host_blocks, remaining_hashes,
    /// salt_digest, parent_hash)`; `remaining_hashes` are the full blocks after both (up to the
    /// `(len - 1) // block_size` an admission may share) for probing lower tiers, `parent_hash`
    /// the hash before the first of them (None at the chain's start).
    #[pyo3(signature = (token_ids, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None))]
    fn lookup_tiers(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Bound<'_, PyAny>>,
        adapter_id: Option<Bound<'_, PyAny>>,
        mm_inputs: Option<Bound<'_, PyAny>>,
        extra_keys: Option<Bound<'_, PyAny>>,
    ) -> PyResult<LookupTuple> {
        let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?;
        let r = scratch(&TOKENS, |buf| {
            with_ids("token_ids", token_ids, buf, |toks| {
                Ok(self.run(py, toks.len() >= DETACH_MIN, |st| {
                    st.inner.lookup_tiers(toks, keys.as_ref())
                }))
            })
        })?
        .py()?;
        let start = (r.gpu_blocks + r.host_blocks).min(r.hashes.len());
        let parent = start.checked_sub(1).map(|i| r.hashes[i]);
        let remaining = r.hashes[start..].to_vec();
        Ok((
            r.gpu_blocks,
            r.host_blocks,
            remaining,
            r.salt_digest,
            parent,
        ))
    }

    /// Reserves `n` host blocks to fill from a lower tier (never findable, never evicted until
    /// committed). May demote host-cached blocks: drain `take_demotions()` before writing.
    fn reserve_host_blocks(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let n = count("n", n)?;
        self.with(py, |st| st.inner.reserve_host_blocks(n)).py()
    }

    /// Ends reservations: with `ok`, indexes each block under its hash (token ids `block_size`
    /// per block, flat); otherwise frees them. Returns how many were indexed.
    #[allow(clippy::too_many_arguments)]
    fn commit_host_blocks(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        parents: &Bound<'_, PyAny>,
        salt_digest: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        ok: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let blocks: Vec<u32> = ids_into("blocks", blocks)?;
        let hashes = hash_list("hashes", hashes)?;
        let parents = parent_list("parents", parents)?;
        let salt = hash_of("salt_digest", salt_digest)?;
        let toks: Vec<u32> = ids_into("token_ids", token_ids)?;
        let ok = flag("ok", ok)?;
        self.with(py, |st| {
            st.inner
                .commit_host_blocks(&blocks, &hashes, &parents, salt, &toks, ok)
        })
        .py()
    }

    /// The host-tier demotions since the last call: `(host_block, hash, parent_hash,
    /// salt_digest, token_ids)`. Call right after `step()` (before applying its swap lists) and
    /// after `reserve_host_blocks` (before filling the blocks), and copy each demoted host
    /// block's bytes out then: the slot is reused.
    fn take_demotions(&self, py: Python<'_>) -> Vec<DemotionTuple> {
        self.with(py, |st| st.inner.take_demotions())
            .into_iter()
            .map(|d| (d.host_block, d.hash, d.parent, d.salt_digest, d.tokens))
            .collect()
    }

    /// Host blocks a swap-out or a reservation can take now (free plus unreferenced
    /// host-cached).
    fn host_blocks_available(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.host_blocks_available())
    }

    /// Sets the cost model of the host tier's load-or-recompute choice; no arguments clears it.
    #[pyo3(signature = (host_link_bytes_per_s=None, prefill_tokens_per_s=None, kv_bytes_per_token=None))]
    fn set_host_cost_model(
        &self,
        py: Python<'_>,
        host_link_bytes_per_s: Option<f64>,
        prefill_tokens_per_s: Option<f64>,
        kv_bytes_per_token: Option<f64>,
    ) -> PyResult<()> {
        let model = match (
            host_link_bytes_per_s,
            prefill_tokens_per_s,
            kv_bytes_per_token,
        ) {
            (None, None, None) => None,
            (Some(a), Some(b), Some(c)) => Some(CostModel::new(a, b, c)),
            _ => {
                return Err(crate::errors::invalid_arg_int(
                    py,
                    "set_host_cost_model",
                    0,
                    "give all three rates, or none to clear the model",
                ))
            }
        };
        self.with(py, |st| st.inner.set_host_cost_model(model)).py()
    }

    #[getter]
    fn kv_event_capacity(&self) -> usize {
        self.cfg.kv_event_capacity
    }

    /// KV-event records dropped because the ring was full (the oldest are dropped first).
    #[getter]
    fn kv_events_dropped(&self, py: Python<'_>) -> u64 {
        self.with(py, |st| st.inner.events_dropped())
    }

    /// Drains the KV-event ring, oldest first: `(kind, medium, block_hashes, parent_hash,
    /// token_ids, block_size)` tuples, kind `"stored" | "removed" | "cleared"`, medium `"GPU" |
    /// "CPU"`. Copied out under the lock; the Python objects are built after releasing it.
    fn drain_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with(py, |st| {
            let mut out = Vec::new();
            st.inner.drain_events(&mut out);
            out
        });
        let items = events
            .into_iter()
            .map(|e| {
                (
                    e.kind.name(),
                    e.medium.name(),
                    e.block_hashes,
                    e.parent_hash,
                    e.token_ids,
                    e.block_size,
                )
            })
            .collect::<Vec<_>>();
        PyList::new(py, items)
    }

    /// Forgets every prefix-cache entry; returns the number of blocks dropped from the cache.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, true, |st| st.inner.reset_prefix_cache()).py()
    }

    /// Whether `seq_id` is live; False for anything that is not a valid id (a bool included).
    fn contains(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> bool {
        if seq_id.is_instance_of::<PyBool>() {
            return false;
        }
        match seq_id.extract::<u64>() {
            Ok(id) => self.with(py, |st| st.inner.contains(id)),
            Err(_) => false,
        }
    }

    fn __contains__(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> bool {
        self.contains(py, seq_id)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_seqs())
    }

    /// Tokens in a live sequence.
    fn seq_len(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.seq_len(id)).py()
    }

    /// A live sequence's block table, as a list of block ids.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = seq("seq_id", seq_id)?;
        let table = self
            .with(py, |st| st.inner.block_table(id).map(<[BlockId]>::to_vec))
            .py()?;
        PyList::new(py, table)
    }

    /// Live sequences.
    fn num_seqs(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_seqs())
    }

    /// Free plus cached-free (evictable) blocks.
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_free_blocks())
    }

    /// The core's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |st| st.inner.stats());
        stats_dict(py, &s)
    }

    /// Cross-checks the manager's state; raises InvariantViolationError on inconsistency.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, true, |st| st.inner.check_invariants()).py()
    }

    /// Attaches the step buffers whose memory `arena` owns (a `StepArena`, never an address).
    /// The manager holds the arena until detached, replaced or dropped; an arena belongs to one
    /// manager at a time (BufferInvalidError naming the other manager otherwise). Attaching
    /// resets the incremental block-table rows, so the next step writes its rows in full. On
    /// error the earlier registration stays.
    fn attach_buffers(&self, py: Python<'_>, arena: &Bound<'_, PyAny>) -> PyResult<()> {
        let arena = arena.cast::<PyStepArena>().map_err(|_| {
            invalid_arg(
                "buffers",
                arena,
                "must be the StepArena of a pagedkv.StepBuffers (memory the extension owns)",
            )
        })?;
        let a = arena.get();
        let bufs = RegisteredBuffers::new(a.layout(), a.raw()).py()?;
        let arena = arena.clone().unbind();
        let id = self.id;
        // The replaced registration is dropped after the lock is released (dropping the last
        // reference to an arena runs its destructor, which may call into CUDA through Python).
        let replaced = self.with(py, move |st| {
            if let Some(reg) = &st.registered {
                if reg.arena.as_ptr() == arena.as_ptr() {
                    // Already ours: only forget what the rows held.
                    st.inner.invalidate_step_cache();
                    return Ok((None, Some(arena)));
                }
            }
            if arena.get().claim(id).is_err() {
                return Err((
                    Error::BufferInvalid {
                        buffer: "step buffers",
                        expected: "a buffer set no other manager holds",
                        got: "attached to another BlockManager (detach it there first)".into(),
                    },
                    arena,
                ));
            }
            // Other memory may now sit at an address the old rows were written to.
            st.inner.invalidate_step_cache();
            let old = st.registered.replace(Registered {
                bufs,
                arena,
                owner: id,
            });
            // Give the old arena back now (an atomic store), not when `old` is dropped later.
            if let Some(o) = &old {
                o.arena.get().release(id);
            }
            Ok((old, None))
        });
        match replaced {
            Ok(dropped) => {
                drop(dropped);
                Ok(())
            }
            Err((e, arena)) => {
                drop(arena);
                Err(e).py()
            }
        }
    }

    /// Drops the registered step buffers (and the reference keeping their arena alive), giving
    /// the arena back so another manager may attach it.
    fn detach_buffers(&self, py: Python<'_>) {
        let old = self.with(py, |st| {
            let old = st.registered.take();
            if let Some(o) = &old {
                o.arena.get().release(o.owner);
            }
            old
        });
        drop(old);
    }

    /// Makes the next step write every block-table row of its batch in full; call it after
    /// writing into the registered `block_tables` yourself.
    fn invalidate_step_cache(&self, py: Python<'_>) {
        self.with(py, |st| st.inner.invalidate_step_cache());
    }

    /// Fills the registered buffers for one step; returns `(num_seqs, num_tokens,
    /// num_kv_indices, num_copies, max_seq_len, num_swap_out, num_swap_in, max_query_len)`.
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<StepTuple> {
        let info = scratch(&SEQS, |sbuf| {
            with_ids("seq_ids", seq_ids, sbuf, |seqs| {
                let detach = seqs.len() >= DETACH_MIN;
                scratch(&COUNTS, |counts| {
                    if num_new_tokens.is_instance_of::<PyInt>() {
                        // One count for every sequence (a decode step): broadcast it (`scalar` refuses a bool).
                        let n = scalar::<u32>("num_new_tokens", num_new_tokens)?;
                        counts.clear();
                        counts.resize(seqs.len(), n);
                        let counts = &counts[..];
                        Ok(self.run(py, detach, |st| st.step(seqs, counts)))
                    } else {
                        with_ids("num_new_tokens", num_new_tokens, counts, |n| {
                            Ok(self.run(py, detach, |st| st.step(seqs, n)))
                        })
                    }
                })
            })
        })?
        .py()?;
        Ok((
            info.num_seqs,
            info.num_tokens,
            info.num_kv_indices,
            info.num_copies,
            info.max_seq_len,
            info.num_swap_out,
            info.num_swap_in,
            info.max_query_len,
        ))
    }

    // ------------------------------------------------------------------------- reclamation

    /// Moves running sequences (a forked group together) to host blocks; returns the
    /// `(device_block, host_block)` copies to make (also queued for the next step).
    fn swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u32)>> {
        scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| st.inner.swap_out(seqs)))
            })
        })?
        .py()
    }

    /// Brings swapped-out sequences back; returns the `(host_block, device_block)` copies to make
    /// (also queued for the next step).
    fn swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u32)>> {
        scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| st.inner.swap_in(seqs)))
            })
        })?
        .py()
    }

    /// Preempts by recompute: frees the blocks, keeps the length and token ids.
    fn recompute(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        self.run(py, true, |st| st.inner.recompute(id)).py()
    }

    /// Re-admits a sequence preempted by recompute from its kept tokens; returns the same
    /// tuple as `admit`.
    #[pyo3(signature = (seq_id, max_new_tokens=None))]
    fn resume(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        max_new_tokens: Option<Bound<'_, PyAny>>,
    ) -> PyResult<AdmitTuple> {
        let id = seq("seq_id", seq_id)?;
        let k = opt(&max_new_tokens)
            .map(|k| count("max_new_tokens", k))
            .transpose()?;
        let r = self.run(py, true, |st| st.inner.resume(id, k)).py()?;
        Ok(admit_tuple(&r))
    }

    /// The running members of the most recently admitted fork group, or None.
    fn choose_victim(&self, py: Python<'_>) -> Option<Vec<u64>> {
        self.run(py, true, |st| st.inner.choose_victim())
    }

    /// The cost model's choice for preempting `seq_ids` together: `(mode, swap_cost_s,
    /// recompute_cost_s, swap_possible, swap_blocks, recompute_tokens, batch_tokens)`.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    #[pyo3(signature = (seq_ids, host_link_bytes_per_s, prefill_tokens_per_s, kv_bytes_per_token,
                        step_floor_s=0.0, max_step_tokens=0, batch_tokens=None))]
    fn decide(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        host_link_bytes_per_s: f64,
        prefill_tokens_per_s: f64,
        kv_bytes_per_token: f64,
        step_floor_s: f64,
        max_step_tokens: u64,
        batch_tokens: Option<u64>,
    ) -> PyResult<(&'static str, f64, f64, bool, u64, u64, u64)> {
        let model = CostModel {
            host_link_bytes_per_s,
            prefill_tokens_per_s,
            kv_bytes_per_token,
            step_floor_s,
            max_step_tokens,
        };
        let d = scratch(&SEQS, |buf| {
            with_ids("seq_ids", seq_ids, buf, |seqs| {
                Ok(self.run(py, seqs.len() >= DETACH_MIN, |st| {
                    st.inner.decide_beside(seqs, &model, batch_tokens)
                }))
            })
        })?
        .py()?;
        Ok((
            d.mode.name(),
            d.swap_cost_s,
            d.recompute_cost_s,
            d.swap_possible,
            d.swap_blocks,
            d.recompute_tokens,
            d.batch_tokens,
        ))
    }

    /// `"running"`, `"swapped"` or `"recompute"`.
    fn seq_state(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let id = seq("seq_id", seq_id)?;
        self.with(py, |st| st.inner.seq_state(id).map(|s| s.name()))
            .py()
    }

    /// Swap-out copies `(device, host)` queued for the next steps.
    fn pending_swap_out(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_swap_out().to_vec())
    }

    /// Swap-in copies `(host, device)` queued for the next steps.
    fn pending_swap_in(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_swap_in().to_vec())
    }

    /// Free blocks of the host pool.
    fn num_free_host_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |st| st.inner.num_free_host_blocks())
    }

    /// Reference count of a host block (InvalidBlockError outside the host pool).
    fn host_block_refcount(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = scalar::<u32>("block", block)?;
        self.with(py, |st| st.inner.host_block_refcount(b)).py()
    }

    /// The prefix hash of each block of a live sequence's table, 16 little-endian bytes, or None
    /// for a block not (yet) in the prefix cache (a partial tail, or before the step that
    /// registers it).
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = seq("seq_id", seq_id)?;
        let hashes: Vec<Option<u128>> = self
            .with(py, |st| {
                let table = st.inner.block_table(id)?;
                Ok(table.iter().map(|&b| st.inner.block_hash(b)).collect())
            })
            .py()?;
        let items: Vec<Option<Bound<'py, PyBytes>>> = hashes
            .iter()
            .map(|h| h.map(|h| PyBytes::new(py, &h.to_le_bytes())))
            .collect();
        PyList::new(py, items)
    }

    /// Reference count of a block (InvalidBlockError outside the pool).
    fn block_refcount(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = scalar::<u32>("block", block)?;
        self.with(py, |st| st.inner.block_refcount(b)).py()
    }

    /// Copy-on-write copies queued for the next step, as `(src, dst)` block pairs.
    fn pending_copies(&self, py: Python<'_>) -> Vec<(u32, u32)> {
        self.with(py, |st| st.inner.pending_copies().to_vec())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (seqs, free) = self.with(py, |st| (st.inner.num_seqs(), st.inner.num_free_blocks()));
        format!(
            "BlockManager(num_blocks={}, block_size={}, seqs={}, free_blocks={})",
            self.cfg.num_blocks, self.cfg.block_size, seqs, free
        )
    }
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
