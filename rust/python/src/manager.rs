//! `_core.BlockManager`: the core's block manager behind a Python class.
//!
//! Owns nothing but the wrapped [`pagedkv::manager::BlockManager`], the registered step buffers
//! (with strong references to the objects owning their memory) and scratch vectors for argument
//! conversion. Every method converts its arguments (see [`crate::convert`]), calls the core once and
//! maps the result; the core makes every call all-or-nothing, and argument conversion happens
//! before the core is touched, so a raised exception always leaves the manager unchanged.
//!
//! The GIL is released around calls whose work grows with their input (admission, batched appends,
//! steps); constant-time queries keep it, since releasing and re-taking it would cost more than the
//! query. Python's borrow rules on the object (`PyRefMut`) keep two threads from entering the same
//! manager at once: the second gets a `RuntimeError` ("already borrowed") instead of a data race.

use pagedkv::hash::{MmInput, SeqKeys};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::metrics::Stats;
use pagedkv::step::{DType, RawBuffer, RawStepBuffers, RegisteredBuffers, StepLayout};
use pagedkv::{Error, SeqId};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::convert::{count, scalar, with_ids};
use crate::errors::{invalid_arg, CoreResultExt};

/// Inputs with at least this many elements are processed with the GIL released. Below it the
/// release/re-acquire pair (~0.1 µs) costs about as much as the work itself.
const DETACH_MIN: usize = 32;

/// Step buffers registered with the core, and the objects that own their memory.
struct Registered {
    bufs: RegisteredBuffers,
    /// Strong references to the tensors the raw pointers point into; dropping the registration is
    /// the only thing that lets them go.
    _keepalive: Py<PyAny>,
}

/// Paged KV cache block manager (the core's `BlockManager`); see `pagedkv.BlockManager` for the
/// documented Python API.
#[pyclass(module = "pagedkv._core", name = "BlockManager")]
pub struct PyBlockManager {
    inner: BlockManager,
    registered: Option<Registered>,
    tokens: Vec<u32>,
    seqs: Vec<u64>,
    counts: Vec<u32>,
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
            return Ok(s.to_cow()?.as_bytes().to_vec());
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

fn dtype(name: &str) -> DType {
    match name.strip_prefix("torch.").unwrap_or(name) {
        "int32" | "int" => DType::I32,
        "int64" | "long" => DType::I64,
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "int16" | "short" => DType::I16,
        "uint32" => DType::U32,
        "uint64" => DType::U64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "bool" => DType::Bool,
        _ => DType::Other,
    }
}

fn raw_buffer(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<RawBuffer> {
    let bad = || {
        invalid_arg(
            what,
            obj,
            "must be a (data_ptr: int, numel: int, dtype: str) tuple",
        )
    };
    let t = obj.cast::<PyTuple>().map_err(|_| bad())?;
    if t.len() != 3 {
        return Err(bad());
    }
    let ptr = count(what, &t.get_item(0)?)?;
    let len = count(what, &t.get_item(1)?)?;
    let name = t.get_item(2)?;
    let name = name.cast::<PyString>().map_err(|_| bad())?;
    Ok(RawBuffer {
        ptr,
        len,
        dtype: dtype(&name.to_cow()?),
    })
}

fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    crate::stats::to_dict(py, s)
}

#[pymethods]
impl PyBlockManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size=None, watermark_blocks=None, max_blocks_per_seq=None, enable_prefix_caching=true, verify_prefix=true, hash_seed=None))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<Bound<'_, PyAny>>,
        watermark_blocks: Option<Bound<'_, PyAny>>,
        max_blocks_per_seq: Option<Bound<'_, PyAny>>,
        enable_prefix_caching: bool,
        verify_prefix: bool,
        hash_seed: Option<Bound<'_, PyAny>>,
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
        cfg.enable_prefix_caching = enable_prefix_caching;
        cfg.verify_prefix = verify_prefix;
        if let Some(k) = opt(&hash_seed) {
            cfg.hash_seed = Some(scalar::<u64>("hash_seed", k)?);
        }
        Ok(Self {
            inner: BlockManager::new(cfg).py()?,
            registered: None,
            tokens: Vec::new(),
            seqs: Vec::new(),
            counts: Vec::new(),
        })
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.config().block_size
    }

    #[getter]
    fn watermark_blocks(&self) -> u32 {
        self.inner.config().watermark_blocks
    }

    #[getter]
    fn max_blocks_per_seq(&self) -> u32 {
        self.inner.config().max_blocks_per_seq
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }

    #[getter]
    fn verify_prefix(&self) -> bool {
        self.inner.config().verify_prefix
    }

    /// Whether step buffers are registered.
    #[getter]
    fn has_buffers(&self) -> bool {
        self.registered.is_some()
    }

    /// Whether a prompt of `num_tokens` tokens fits above the watermark (prefix hits ignored).
    fn can_admit(&self, num_tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.can_admit(count("num_tokens", num_tokens)?))
    }

    /// Admits `seq_id` with its prompt; returns `(cached_tokens, new_blocks, num_blocks)`.
    #[pyo3(signature = (seq_id, token_ids, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None))]
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Bound<'_, PyAny>>,
        adapter_id: Option<Bound<'_, PyAny>>,
        mm_inputs: Option<Bound<'_, PyAny>>,
        extra_keys: Option<Bound<'_, PyAny>>,
    ) -> PyResult<(u32, u32, u32)> {
        let id = seq("seq_id", seq_id)?;
        let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?;
        let inner = &mut self.inner;
        with_ids("token_ids", token_ids, &mut self.tokens, |toks| {
            let mut run = move || match &keys {
                None => inner.admit(id, toks),
                Some(k) => inner.admit_with(id, toks, k),
            };
            let r = if toks.len() >= DETACH_MIN {
                py.detach(run)
            } else {
                run()
            }
            .py()?;
            Ok((r.cached_tokens, r.new_blocks, r.num_blocks))
        })
    }

    /// Appends tokens to a live sequence.
    fn append(
        &mut self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        let inner = &mut self.inner;
        with_ids("token_ids", token_ids, &mut self.tokens, |toks| {
            let mut run = move || inner.append(id, toks);
            if toks.len() >= DETACH_MIN {
                py.detach(run)
            } else {
                run()
            }
            .py()
        })
    }

    /// Appends one token to each sequence; all or nothing.
    fn append_batch(
        &mut self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (inner, tokens) = (&mut self.inner, &mut self.tokens);
        with_ids("seq_ids", seq_ids, &mut self.seqs, |seqs| {
            with_ids("token_ids", token_ids, tokens, |toks| {
                let mut run = move || inner.append_batch(seqs, toks);
                if seqs.len() >= DETACH_MIN {
                    py.detach(run)
                } else {
                    run()
                }
                .py()
            })
        })
    }

    /// Creates `child` sharing all of `parent`'s blocks.
    fn fork(&mut self, parent: &Bound<'_, PyAny>, child: &Bound<'_, PyAny>) -> PyResult<()> {
        let (p, c) = (seq("parent", parent)?, seq("child", child)?);
        self.inner.fork(p, c).py()
    }

    /// Releases a sequence.
    fn free(&mut self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = seq("seq_id", seq_id)?;
        let inner = &mut self.inner;
        // Freeing walks the whole table, so a long sequence is worth releasing the GIL for.
        let long = inner
            .block_table(id)
            .map(|t| t.len() >= DETACH_MIN)
            .unwrap_or(false);
        let mut run = move || inner.free(id);
        if long { py.detach(run) } else { run() }.py()
    }

    /// Whether `seq_id` is live; False for anything that is not a valid id.
    fn contains(&self, seq_id: &Bound<'_, PyAny>) -> bool {
        match seq_id.extract::<u64>() {
            Ok(id) => self.inner.contains(id),
            Err(_) => false,
        }
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> bool {
        self.contains(seq_id)
    }

    fn __len__(&self) -> usize {
        self.inner.num_seqs()
    }

    /// Tokens in a live sequence.
    fn seq_len(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.inner.seq_len(seq("seq_id", seq_id)?).py()
    }

    /// A live sequence's block table, as a list of block ids.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let table = self.inner.block_table(seq("seq_id", seq_id)?).py()?;
        PyList::new(py, table)
    }

    /// Live sequences.
    fn num_seqs(&self) -> usize {
        self.inner.num_seqs()
    }

    /// Free plus cached-free (evictable) blocks.
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    /// The core's counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    /// Cross-checks the manager's state; raises InvariantViolationError on inconsistency.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(move || inner.check_invariants()).py()
    }

    /// Registers the step buffers by address; each buffer is `(data_ptr, numel, dtype_name)`.
    /// `keepalive` is held until the next registration, so the memory outlives it. On error the
    /// earlier registration stays.
    #[pyo3(signature = (max_seqs, max_tokens, max_blocks_per_seq, max_copies, slot_mapping, block_tables, seq_lens, query_start_loc, kv_indptr, kv_indices, kv_last_page_len, copies, *, keepalive))]
    #[allow(clippy::too_many_arguments)]
    fn register_buffers(
        &mut self,
        max_seqs: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        max_blocks_per_seq: &Bound<'_, PyAny>,
        max_copies: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
        kv_indptr: &Bound<'_, PyAny>,
        kv_indices: &Bound<'_, PyAny>,
        kv_last_page_len: &Bound<'_, PyAny>,
        copies: &Bound<'_, PyAny>,
        keepalive: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let layout = StepLayout {
            max_seqs: count("max_seqs", max_seqs)?,
            max_tokens: count("max_tokens", max_tokens)?,
            max_blocks_per_seq: count("max_blocks_per_seq", max_blocks_per_seq)?,
            max_copies: count("max_copies", max_copies)?,
        };
        let raw = RawStepBuffers {
            slot_mapping: raw_buffer("slot_mapping", slot_mapping)?,
            block_tables: raw_buffer("block_tables", block_tables)?,
            seq_lens: raw_buffer("seq_lens", seq_lens)?,
            query_start_loc: raw_buffer("query_start_loc", query_start_loc)?,
            kv_indptr: raw_buffer("kv_indptr", kv_indptr)?,
            kv_indices: raw_buffer("kv_indices", kv_indices)?,
            kv_last_page_len: raw_buffer("kv_last_page_len", kv_last_page_len)?,
            copies: raw_buffer("copies", copies)?,
        };
        let bufs = RegisteredBuffers::new(layout, raw).py()?;
        // New memory may sit at the old address: rows written into the old buffers prove nothing.
        self.inner.invalidate_step_cache();
        self.registered = Some(Registered {
            bufs,
            _keepalive: keepalive.unbind(),
        });
        Ok(())
    }

    /// Drops the registered step buffers (and the references keeping them alive).
    fn unregister_buffers(&mut self) {
        self.registered = None;
    }

    /// Makes the next step write every block-table row of its batch in full; call it after
    /// writing into the registered `block_tables` yourself.
    fn invalidate_step_cache(&mut self) {
        self.inner.invalidate_step_cache();
    }

    /// Fills the registered buffers for one step; returns
    /// `(num_seqs, num_tokens, num_kv_indices, num_copies, max_seq_len)`.
    fn step(
        &mut self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, usize, usize, usize)> {
        let Some(reg) = self.registered.as_mut() else {
            return Err(Error::BuffersNotRegistered).py();
        };
        let (inner, counts) = (&mut self.inner, &mut self.counts);
        with_ids("seq_ids", seq_ids, &mut self.seqs, |seqs| {
            let run_with = |py: Python<'_>, n: &[u32]| {
                // SAFETY: the registered memory is owned by the objects in `reg._keepalive`, which
                // this registration keeps alive; it is host memory (the Python side checks the
                // device before registering), and `&mut self` excludes a second view. That no
                // other code touches the memory during the step is the documented contract of
                // `StepBuffers` (do not refill while a copy from it is in flight).
                let mut out = unsafe { reg.bufs.as_step_buffers() };
                let mut run = move || inner.build_step(seqs, n, &mut out);
                let info = if seqs.len() >= DETACH_MIN {
                    py.detach(run)
                } else {
                    run()
                }
                .py()?;
                Ok((
                    info.num_seqs,
                    info.num_tokens,
                    info.num_kv_indices,
                    info.num_copies,
                    info.max_seq_len,
                ))
            };
            if num_new_tokens.is_instance_of::<PyInt>() {
                // One count for every sequence (a decode step): broadcast it.
                let n = scalar::<u32>("num_new_tokens", num_new_tokens)?;
                counts.clear();
                counts.resize(seqs.len(), n);
                run_with(py, counts)
            } else {
                let mut local = std::mem::take(counts);
                let r = with_ids("num_new_tokens", num_new_tokens, &mut local, |n| {
                    run_with(py, n)
                });
                *counts = local;
                r
            }
        })
    }

    /// The prefix hash of each block of a live sequence's table, 16 little-endian bytes, or None
    /// for a block not (yet) in the prefix cache (a partial tail, or before the step that
    /// registers it).
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let table = self.inner.block_table(seq("seq_id", seq_id)?).py()?;
        let items: Vec<Option<Bound<'py, PyBytes>>> = table
            .iter()
            .map(|&b| {
                self.inner
                    .block_hash(b)
                    .map(|h| PyBytes::new(py, &h.to_le_bytes()))
            })
            .collect();
        PyList::new(py, items)
    }

    /// Reference count of a block (InvalidBlockError outside the pool).
    fn block_refcount(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.inner
            .block_refcount(scalar::<u32>("block", block)?)
            .py()
    }

    /// Copy-on-write copies queued for the next step, as `(src, dst)` block pairs.
    fn pending_copies(&self) -> Vec<(u32, u32)> {
        self.inner.pending_copies().to_vec()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "BlockManager(num_blocks={}, block_size={}, seqs={}, free_blocks={})",
            c.num_blocks,
            c.block_size,
            self.inner.num_seqs(),
            self.inner.num_free_blocks()
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
