//! The extension module `pagedkv._core`: thin PyO3 wrappers over the `pagedkv` core crate.
//!
//! Owns argument conversion, GIL release and error mapping, and nothing else: every decision about
//! blocks, tables and hashes is the core's. Modules:
//! - [`manager`]: the `BlockManager` class and the `hash_blocks` function;
//! - [`buffers`]: the `StepArena` class, the extension-owned host memory of the step buffers;
//! - [`groups`]: KV cache group kinds and the sizing helpers (`bytes_per_token`, `page_bytes`,
//!   `live_blocks`, `peak_decode_blocks`);
//! - [`plan`]: the `plan_decode` function, the core's split-K decode planner;
//! - [`keyed`]: the `KeyedBlockPool` class, blocks keyed by caller-supplied hashes;
//! - [`offload_index`]: the `OffloadIndex` class, the offloading tier's scheduler-side index;
//! - [`convert`]: Python ints, lists and numpy arrays to the core's id types;
//! - [`errors`]: core errors to the exception classes of `pagedkv.errors`;
//! - [`stats`]: the core's counters as a dict.
//!
//! The typed, documented API is the Python package's (`pagedkv.BlockManager`); this module's surface
//! is described by `python/pagedkv/_core.pyi`.

use pyo3::prelude::*;

mod buffers;
mod convert;
mod errors;
mod groups;
mod keyed;
mod manager;
mod offload_index;
mod offload_plan;
mod plan;
mod stats;

/// Raises the exception a sample of the named core error variant maps to. Lets tests check the
/// mapping of variants that no public call can reach (a refcount underflow, a hash collision).
#[pyfunction]
fn _raise_core_error(_py: Python<'_>, name: &str) -> PyResult<()> {
    match errors::sample(name) {
        Some(e) => Err(errors::core_err(e)),
        None => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "no core error variant named {name:?}"
        ))),
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<manager::PyBlockManager>()?;
    m.add_class::<buffers::PyStepArena>()?;
    m.add_class::<keyed::PyKeyedBlockPool>()?;
    m.add_class::<offload_index::PyOffloadIndex>()?;
    m.add_function(wrap_pyfunction!(manager::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(plan::plan_decode, m)?)?;
    m.add_function(wrap_pyfunction!(offload_plan::split_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(groups::bytes_per_token, m)?)?;
    m.add_function(wrap_pyfunction!(groups::page_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(groups::live_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(groups::peak_decode_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_core_error, m)?)?;
    Ok(())
}
