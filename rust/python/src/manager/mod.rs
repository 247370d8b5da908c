//! `_core.BlockManager`: the core's block manager behind a Python class.
//!
//! The class is split by concern, as the core's manager is; each file adds its own
//! `#[pymethods]` block (PyO3's `multiple-pymethods`):
//! - this module: the shared state, the lock discipline and argument helpers;
//! - [`config`]: construction and the configuration getters, `__repr__`;
//! - [`keys`]: prefix-cache keys (salt, adapter, multimodal inputs), hashes, `hash_blocks`;
//! - [`admit`]: `can_admit`, `admit`, `admit_batch`;
//! - [`append`]: `append`, `append_batch`, `fork`, `free`, `free_batch`;
//! - [`build_step`]: the registered step buffers and `step`;
//! - [`provisional`]: provisional tokens (`append_provisional*`, `commit*`, `rewind`);
//! - [`reclaim`]: swapping, recompute preemption and the cost model's choice;
//! - [`tier`]: the host tier's lookups, reservations and demotions;
//! - [`inspect`]: read-only queries, counters, KV events and `check_invariants`.
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

mod admit;
mod append;
mod build_step;
mod config;
mod inspect;
mod keys;
mod provisional;
mod reclaim;
mod tier;

pub use keys::hash_blocks;

use std::cell::RefCell;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::thread::LocalKey;

use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::SeqId;
use pyo3::prelude::*;

use crate::convert::scalar;
use build_step::Registered;

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

/// Everything the lock protects.
struct State {
    inner: BlockManager,
    registered: Option<Registered>,
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
