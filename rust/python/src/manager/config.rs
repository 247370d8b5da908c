//! Construction and the configuration getters. The configuration never changes after `new`, so
//! the getters read the immutable copy without taking the lock.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use pagedkv::manager::{BlockManager, ManagerConfig};
use pyo3::prelude::*;

use super::{opt, PyBlockManager, State, NEXT_ID};
use crate::convert::{count, flag, scalar};
use crate::errors::CoreResultExt;
use crate::groups::{kind_tuple, kinds_of};

#[pymethods]
impl PyBlockManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size=None, watermark_blocks=None, max_blocks_per_seq=None, enable_prefix_caching=None, verify_prefix=None, hash_seed=None, num_host_blocks=None, kv_event_capacity=None, host_cache=None, host_write_through=None, host_load_min_blocks=None, groups=None, max_provisional=None))]
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
        groups: Option<Bound<'_, PyAny>>,
        max_provisional: Option<Bound<'_, PyAny>>,
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
        if let Some(g) = opt(&groups) {
            cfg.groups = kinds_of("groups", g)?;
        }
        if let Some(k) = opt(&max_provisional) {
            cfg.max_provisional = scalar::<u32>("max_provisional", k)?;
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

    /// Number of KV cache groups (1 for a manager configured without groups).
    #[getter]
    fn num_groups(&self) -> usize {
        self.cfg.num_groups()
    }

    /// The KV cache groups as `(kind, size)` tuples, group `g` at index `g` (size 0 for full).
    #[getter]
    fn groups(&self) -> Vec<(&'static str, u32)> {
        (0..self.cfg.num_groups())
            .filter_map(|g| self.cfg.group_kind(g))
            .map(kind_tuple)
            .collect()
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

    /// Provisional tokens a sequence may hold past its committed length (0: none).
    #[getter]
    fn max_provisional(&self) -> u32 {
        self.cfg.max_provisional
    }

    #[getter]
    fn kv_event_capacity(&self) -> usize {
        self.cfg.kv_event_capacity
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (seqs, free) = self.with(py, |st| (st.inner.num_seqs(), st.inner.num_free_blocks()));
        format!(
            "BlockManager(num_blocks={}, block_size={}, seqs={}, free_blocks={})",
            self.cfg.num_blocks, self.cfg.block_size, seqs, free
        )
    }
}
