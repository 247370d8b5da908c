//! The host tier: per-tier prefix lookups, reservations filled from lower tiers, demotions and
//! the load-or-recompute cost model.

use pagedkv::swap::CostModel;
use pyo3::prelude::*;

use super::keys::{hash_list, hash_of, parent_list, seq_keys};
use super::{scratch, PyBlockManager, DETACH_MIN, TOKENS};
use crate::convert::{count, flag, ids_into, with_ids};
use crate::errors::CoreResultExt;

/// What `take_demotions` returns per demotion: `(host_block, hash, parent, salt_digest, tokens)`.
type DemotionTuple = (u32, u128, Option<u128>, u128, Vec<u32>);
/// What `take_demotions_by_group` returns per demotion: the `DemotionTuple` and the group.
type GroupDemotionTuple = (u32, u128, Option<u128>, u128, Vec<u32>, u32);
/// `lookup_tiers_groups`' answer: `(hashes, salt_digest, present)`.
type GroupLookupTuple = (Vec<u128>, u128, Vec<Vec<bool>>);
/// `lookup_tiers`' answer: `(gpu_blocks, host_blocks, remaining_hashes, salt_digest, parent_hash)`.
type LookupTuple = (usize, usize, Vec<u128>, u128, Option<u128>);

#[pymethods]
impl PyBlockManager {
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

    /// Per KV cache group, which of a prompt's full blocks the device or the host tier holds:
    /// `(hashes, salt_digest, present)`, `hashes` the chain hashes of the full blocks an
    /// admission may share, `present[g][i]` whether group `g`'s block `i` is cached (with the
    /// prompt's token ids) on the device or in the host index.
    #[pyo3(signature = (token_ids, cache_salt=None, adapter_id=None, mm_inputs=None, extra_keys=None))]
    fn lookup_tiers_groups(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<Bound<'_, PyAny>>,
        adapter_id: Option<Bound<'_, PyAny>>,
        mm_inputs: Option<Bound<'_, PyAny>>,
        extra_keys: Option<Bound<'_, PyAny>>,
    ) -> PyResult<GroupLookupTuple> {
        let keys = seq_keys(cache_salt, adapter_id, mm_inputs, extra_keys)?;
        scratch(&TOKENS, |buf| {
            with_ids("token_ids", token_ids, buf, |toks| {
                Ok(self.run(py, toks.len() >= DETACH_MIN, |st| {
                    st.inner.lookup_tiers_groups(toks, keys.as_ref())
                }))
            })
        })?
        .py()
    }

    /// Reserves `n` host blocks to fill from a lower tier (never findable, never evicted until
    /// committed). May demote host-cached blocks: drain `take_demotions()` before writing.
    fn reserve_host_blocks(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let n = count("n", n)?;
        self.with(py, |st| st.inner.reserve_host_blocks(n)).py()
    }

    /// Ends reservations: with `ok`, indexes each block under its hash (token ids `block_size`
    /// per block, flat); otherwise frees them. Returns how many were indexed. With `groups`,
    /// block `i` is group `groups[i]`'s block of chain hash `hashes[i]`, indexed under that
    /// group's key (`parents` chain hashes too).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (blocks, hashes, parents, salt_digest, token_ids, ok, groups=None))]
    fn commit_host_blocks(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        parents: &Bound<'_, PyAny>,
        salt_digest: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        ok: &Bound<'_, PyAny>,
        groups: Option<Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let blocks: Vec<u32> = ids_into("blocks", blocks)?;
        let hashes = hash_list("hashes", hashes)?;
        let parents = parent_list("parents", parents)?;
        let salt = hash_of("salt_digest", salt_digest)?;
        let toks: Vec<u32> = ids_into("token_ids", token_ids)?;
        let ok = flag("ok", ok)?;
        let groups: Option<Vec<u32>> = match groups {
            Some(g) => Some(ids_into("groups", &g)?),
            None => None,
        };
        self.with(py, |st| {
            st.inner.commit_host_blocks_in_groups(
                &blocks,
                &hashes,
                groups.as_deref(),
                &parents,
                salt,
                &toks,
                ok,
            )
        })
        .py()
    }

    /// `take_demotions` with each demotion's KV cache group appended: `(host_block, hash,
    /// parent_hash, salt_digest, token_ids, group)` (`hash` and `parent_hash` that group's keys).
    fn take_demotions_by_group(&self, py: Python<'_>) -> Vec<GroupDemotionTuple> {
        self.with(py, |st| st.inner.take_demotions())
            .into_iter()
            .map(|d| {
                (
                    d.host_block,
                    d.hash,
                    d.parent,
                    d.salt_digest,
                    d.tokens,
                    d.group,
                )
            })
            .collect()
    }

    /// The host-tier demotions since the last call: `(host_block, hash, parent_hash,
    /// salt_digest, token_ids)`; with KV cache groups, a block of group `g >= 1` is named by that
    /// group's keys (`hash` and `parent_hash` mixed with `g`, never group 0's). Call right after
    /// `step()` (before applying its swap lists) and
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
}
