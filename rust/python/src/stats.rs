//! The core's [`Stats`] snapshot as a Python dict.
//!
//! Owns the field names the Python `Stats` dataclass is built from: one key per field of the core
//! struct, same name, same meaning (`blocks_per_seq` becomes a list). The destructuring below is
//! exhaustive on purpose: a field added to the core fails to compile here until it is exposed.

use pagedkv::metrics::Stats;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub fn to_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let Stats {
        num_blocks,
        block_size,
        free_blocks,
        cached_free_blocks,
        used_blocks,
        num_seqs,
        used_tokens,
        kv_utilization,
        allocated_token_slots,
        prefix_query_tokens,
        prefix_hit_tokens,
        prefix_hit_ratio,
        evictions,
        prefix_collisions,
        shared_blocks,
        cow_copies,
        preemptions,
        preemptions_swap,
        preemptions_recompute,
        swapped_out_blocks,
        swapped_in_blocks,
        host_hit_tokens,
        host_loaded_blocks,
        offloaded_blocks,
        demotions,
        host_cached_blocks,
        num_host_blocks,
        host_free_blocks,
        swapped_seqs,
        kv_cache_usage,
        blocks_per_seq,
    } = *s;
    let d = PyDict::new(py);
    d.set_item("num_blocks", num_blocks)?;
    d.set_item("block_size", block_size)?;
    d.set_item("free_blocks", free_blocks)?;
    d.set_item("cached_free_blocks", cached_free_blocks)?;
    d.set_item("used_blocks", used_blocks)?;
    d.set_item("num_seqs", num_seqs)?;
    d.set_item("used_tokens", used_tokens)?;
    d.set_item("kv_utilization", kv_utilization)?;
    d.set_item("allocated_token_slots", allocated_token_slots)?;
    d.set_item("prefix_query_tokens", prefix_query_tokens)?;
    d.set_item("prefix_hit_tokens", prefix_hit_tokens)?;
    d.set_item("prefix_hit_ratio", prefix_hit_ratio)?;
    d.set_item("evictions", evictions)?;
    d.set_item("prefix_collisions", prefix_collisions)?;
    d.set_item("shared_blocks", shared_blocks)?;
    d.set_item("cow_copies", cow_copies)?;
    d.set_item("preemptions", preemptions)?;
    d.set_item("preemptions_swap", preemptions_swap)?;
    d.set_item("preemptions_recompute", preemptions_recompute)?;
    d.set_item("swapped_out_blocks", swapped_out_blocks)?;
    d.set_item("swapped_in_blocks", swapped_in_blocks)?;
    d.set_item("host_hit_tokens", host_hit_tokens)?;
    d.set_item("host_loaded_blocks", host_loaded_blocks)?;
    d.set_item("offloaded_blocks", offloaded_blocks)?;
    d.set_item("demotions", demotions)?;
    d.set_item("host_cached_blocks", host_cached_blocks)?;
    d.set_item("num_host_blocks", num_host_blocks)?;
    d.set_item("host_free_blocks", host_free_blocks)?;
    d.set_item("swapped_seqs", swapped_seqs)?;
    d.set_item("kv_cache_usage", kv_cache_usage)?;
    d.set_item("blocks_per_seq", blocks_per_seq.to_vec())?;
    Ok(d)
}
