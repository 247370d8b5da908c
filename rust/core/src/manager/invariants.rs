//! `check_invariants`: rebuilds every count from the tables and queues and compares it with
//! what the manager and its parts keep incrementally.
//!
//! The fast paths keep counters (`used_tokens`, `shared_blocks`, refcounts, the free count, the
//! host pool's references) instead of recomputing them; this O(blocks + tokens) walk, meant for
//! tests and debugging, is where a drift between the two shows up, as `InvariantViolation`
//! naming the first mismatch.

use super::{registered_group, BlockManager};
use crate::error::{Error, Result};
use crate::groups::{group_hash, release_threshold, NULL_BLOCK};
use crate::swap::SeqState;
use crate::table::blocks_for;

impl BlockManager {
    /// Checks every structural invariant; `InvariantViolation` describes the first one broken.
    /// O(blocks + tokens); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvariantViolation(m));
        let n = self.cfg.num_blocks as usize;
        let bs = self.bs;
        let mut occ = vec![0u64; n];
        let nh = self.host.num_blocks() as usize;
        let mut host_occ = vec![0u64; nh];
        let mut used_tokens = 0u64;
        let mut seen_slots = std::collections::HashSet::new();
        let want = if self.kinds.is_empty() { 0 } else { n };
        if self.block_group.len() != want
            || self
                .block_group
                .iter()
                .any(|&g| (g & 0xFF) as usize >= self.num_groups())
        {
            return bad(format!(
                "{} block-group entries (want {want}) or one past the {} groups",
                self.block_group.len(),
                self.num_groups()
            ));
        }
        for (&id, &i) in &self.index {
            if !seen_slots.insert(i) {
                return bad(format!("slot {i} used by two sequences"));
            }
            let s = &self.slots[i as usize];
            let t = &s.table;
            if t.num_tokens == 0 {
                return bad(format!("sequence {id} is empty"));
            }
            // Held windows: device blocks a running sequence still references, hashed, inside
            // its shared prefix.
            if !s.held.is_empty() && (s.state != SeqState::Running || s.shared_reach < 2) {
                return bad(format!(
                    "sequence {id} ({}) holds {} released blocks (reach {})",
                    s.state.name(),
                    s.held.len(),
                    s.shared_reach
                ));
            }
            for &b in &s.held {
                if b as usize >= n {
                    return bad(format!("sequence {id}: held block {b} outside the pool"));
                }
                occ[b as usize] += 1;
            }
            // Provisional tokens: at most `max_provisional`, only while running, and never all of
            // a sequence; token ids, hashes and cache entries cover the committed ones only.
            if s.provisional > self.cfg.max_provisional as usize
                || s.provisional >= t.num_tokens
                || (s.provisional != 0 && s.state != SeqState::Running)
            {
                return bad(format!(
                    "sequence {id} ({}): {} provisional of {} tokens, at most {}",
                    s.state.name(),
                    s.provisional,
                    t.num_tokens,
                    self.cfg.max_provisional
                ));
            }
            let committed = t.num_tokens - s.provisional;
            if self.caching && s.tokens.len() != committed {
                return bad(format!(
                    "sequence {id}: {} token ids for committed length {committed}",
                    s.tokens.len(),
                ));
            }
            match s.state {
                SeqState::Running => {}
                SeqState::Recompute => {
                    if !t.blocks.is_empty() || s.extra.iter().any(|g| !g.blocks.is_empty()) {
                        return bad(format!(
                            "sequence {id} preempted by recompute holds {} blocks",
                            t.blocks.len()
                        ));
                    }
                    continue;
                }
                SeqState::Swapped => {
                    // All on the host, never a mix: every entry is a host block id it holds.
                    if t.blocks.len() != blocks_for(t.num_tokens, bs) {
                        return bad(format!(
                            "swapped sequence {id}: {} tokens in {} host blocks",
                            t.num_tokens,
                            t.blocks.len()
                        ));
                    }
                    for (j, &h) in t.blocks.iter().enumerate() {
                        if (j < s.start0) != (h == NULL_BLOCK) {
                            return bad(format!(
                                "swapped sequence {id}: group 0 entry {j} is {h} with {} leading nulls",
                                s.start0
                            ));
                        }
                        if h == NULL_BLOCK {
                            continue;
                        }
                        if h as usize >= nh {
                            return bad(format!(
                                "swapped sequence {id}: host block {h} outside the host pool"
                            ));
                        }
                        host_occ[h as usize] += 1;
                    }
                    // Every other group: as long, its released prefix still null, the rest
                    // host blocks it holds.
                    if s.extra.len() != self.kinds.len() {
                        return bad(format!(
                            "swapped sequence {id}: {} extra group tables for {} groups",
                            s.extra.len(),
                            self.num_groups()
                        ));
                    }
                    for (gi, gt) in s.extra.iter().enumerate() {
                        let g = gi + 1;
                        if gt.blocks.len() != t.blocks.len() || gt.start >= t.blocks.len().max(1) {
                            return bad(format!(
                                "swapped sequence {id}: group {g} table holds {} entries ({} released), group 0 {}",
                                gt.blocks.len(),
                                gt.start,
                                t.blocks.len()
                            ));
                        }
                        for (j, &h) in gt.blocks.iter().enumerate() {
                            if (j < gt.start) != (h == NULL_BLOCK) {
                                return bad(format!(
                                    "swapped sequence {id}: group {g} entry {j} is {h} with {} leading nulls",
                                    gt.start
                                ));
                            }
                            if h == NULL_BLOCK {
                                continue;
                            }
                            if h as usize >= nh {
                                return bad(format!(
                                    "swapped sequence {id}: group {g} host block {h} outside the host pool"
                                ));
                            }
                            host_occ[h as usize] += 1;
                        }
                    }
                    continue;
                }
            }
            if t.blocks.len() != blocks_for(t.num_tokens, bs) {
                return bad(format!(
                    "sequence {id}: {} tokens in {} blocks",
                    t.num_tokens,
                    t.blocks.len()
                ));
            }
            if t.blocks.len() > self.cfg.max_blocks_per_seq as usize {
                return bad(format!(
                    "sequence {id}: {} blocks exceed the row width",
                    t.blocks.len()
                ));
            }
            if s.registered > committed / bs || s.hashes.len() > committed / bs {
                return bad(format!("sequence {id}: hashes cover a partial block"));
            }
            let reads_from = if self.cfg.max_provisional == 0 {
                t.num_tokens - 1
            } else {
                committed
            };
            // Group 0's null entries: none unless it is windowed, and then as another group's.
            if s.start0 != 0
                && (!self.kind0.is_windowed()
                    || s.start0 >= t.blocks.len()
                    || s.start0 > (committed - 1) / bs
                    || s.start0 * bs > self.kind0.first_needed(reads_from))
            {
                return bad(format!(
                    "sequence {id}: group 0 ({:?}) releases {} of {} blocks at length {}",
                    self.kind0,
                    s.start0,
                    t.blocks.len(),
                    t.num_tokens
                ));
            }
            for (j, &b) in t.blocks.iter().enumerate() {
                if (j < s.start0) != (b == NULL_BLOCK) {
                    return bad(format!(
                        "sequence {id}: group 0 entry {j} is {b} with {} leading nulls",
                        s.start0
                    ));
                }
                if b == NULL_BLOCK {
                    continue;
                }
                if b as usize >= n {
                    return bad(format!("sequence {id}: block {b} outside the pool"));
                }
                occ[b as usize] += 1;
                if let Some(h) = self.prefix.hash_of(b) {
                    if (j + 1) * bs > committed {
                        return bad(format!(
                            "sequence {id}: partial or provisional block {b} is hashed"
                        ));
                    }
                    let rg = registered_group(&self.block_group, b);
                    if rg != 0 {
                        return bad(format!(
                            "sequence {id}: block {b} is hashed for group {rg} but held by group 0"
                        ));
                    }
                    if j < s.hashes.len() && s.hashes[j] != h && !self.prefix.verifies() {
                        return bad(format!(
                            "sequence {id}: block {b} cached under another chain"
                        ));
                    }
                    if self.prefix.verifies()
                        && self.prefix.stored_tokens(b) != &s.tokens[j * bs..(j + 1) * bs]
                    {
                        // A relabelled (forged) block keeps its own tokens; only content matters.
                        return bad(format!(
                            "sequence {id}: block {b} content differs from its cached tokens"
                        ));
                    }
                }
            }
            if s.extra.len() != self.kinds.len() {
                return bad(format!(
                    "sequence {id}: {} extra group tables for {} groups",
                    s.extra.len(),
                    self.num_groups()
                ));
            }
            if !self.kinds.is_empty() || self.kind0.is_windowed() {
                let next = self
                    .kinds
                    .iter()
                    .zip(&s.extra)
                    .map(|(&k, gt)| release_threshold(k, gt.start + 1, bs))
                    .min()
                    .unwrap_or(usize::MAX)
                    .min(release_threshold(self.kind0, s.start0 + 1, bs));
                if s.next_release != next {
                    return bad(format!(
                        "sequence {id}: next release at {} but its tables say {next}",
                        s.next_release
                    ));
                }
            }
            for (gi, gt) in s.extra.iter().enumerate() {
                let g = gi + 1;
                let kind = self.kinds[gi];
                if gt.blocks.len() != t.blocks.len() {
                    return bad(format!(
                        "sequence {id}: group {g} table holds {} entries, group 0 {}",
                        gt.blocks.len(),
                        t.blocks.len()
                    ));
                }
                // Null entries: exactly the prefix [0, start), never the tail, and only blocks
                // no query at or after the last position can read. With provisional tokens a step
                // releases for a first query at most at the committed length, and a rewind makes
                // that the next query's position: only what it reads is kept.
                if gt.start >= gt.blocks.len().max(1)
                    || gt.start > (committed - 1) / bs
                    || gt.start * bs > kind.first_needed(reads_from)
                {
                    return bad(format!(
                        "sequence {id}: group {g} ({kind:?}) releases {} of {} blocks at length {}",
                        gt.start,
                        gt.blocks.len(),
                        t.num_tokens
                    ));
                }
                for (j, &b) in gt.blocks.iter().enumerate() {
                    if (j < gt.start) != (b == NULL_BLOCK) {
                        return bad(format!(
                            "sequence {id}: group {g} entry {j} is {b} with {} leading nulls",
                            gt.start
                        ));
                    }
                    if b == NULL_BLOCK {
                        continue;
                    }
                    if b as usize >= n {
                        return bad(format!(
                            "sequence {id}: group {g} block {b} outside the pool"
                        ));
                    }
                    occ[b as usize] += 1;
                    if let Some(h) = self.prefix.hash_of(b) {
                        if (j + 1) * bs > committed {
                            return bad(format!(
                                "sequence {id}: group {g} partial or provisional block {b} is hashed"
                            ));
                        }
                        // Its removal event will name the group it was registered for.
                        let rg = registered_group(&self.block_group, b);
                        if rg != g {
                            return bad(format!(
                                "sequence {id}: group {g} block {b} is hashed for group {rg}"
                            ));
                        }
                        if j < s.hashes.len()
                            && group_hash(s.hashes[j], g) != h
                            && !self.prefix.verifies()
                        {
                            return bad(format!(
                                "sequence {id}: group {g} block {b} cached under another key"
                            ));
                        }
                        if self.prefix.verifies()
                            && self.prefix.stored_tokens(b) != &s.tokens[j * bs..(j + 1) * bs]
                        {
                            return bad(format!(
                                "sequence {id}: group {g} block {b} content differs from its cached tokens"
                            ));
                        }
                    }
                }
            }
            used_tokens += t.num_tokens as u64;
        }
        if used_tokens != self.used_tokens {
            return bad(format!(
                "used_tokens {} but sequences hold {used_tokens}",
                self.used_tokens
            ));
        }
        // Host pool: refcount = swapped tables holding the block + queued swap-ins reading it;
        // queued swap-outs write distinct, owned host blocks; swap-ins fill distinct, owned
        // device blocks.
        for &(h, d) in &self.swap_in_q {
            if h as usize >= nh || d as usize >= n {
                return bad(format!("swap-in ({h}, {d}) outside a pool"));
            }
            host_occ[h as usize] += 1;
            // Held by a running table, or the source of a pending copy-on-write (deferred).
            if occ[d as usize] == 0 && !self.deferred.contains(&d) {
                return bad(format!(
                    "swap-in destination {d} is in no running table and no copy's source"
                ));
            }
        }
        let mut in_dsts = std::collections::HashSet::new();
        for &(_, d) in &self.swap_in_q {
            if !in_dsts.insert(d) {
                return bad(format!(
                    "device block {d} is the destination of two swap-ins"
                ));
            }
        }
        let mut out_dsts = std::collections::HashSet::new();
        for &(d, h) in &self.swap_out_q {
            if h as usize >= nh || d as usize >= n {
                return bad(format!("swap-out ({d}, {h}) outside a pool"));
            }
            if !out_dsts.insert(h) {
                return bad(format!(
                    "host block {h} is the destination of two swap-outs"
                ));
            }
            let pinned = self.tier.as_ref().is_some_and(|t| t.pinned[h as usize]);
            if host_occ[h as usize] == 0 && !pinned {
                return bad(format!("swap-out destination {h} is held by no one"));
            }
        }
        if let Some(t) = &self.tier {
            // Host tier: pins and reservations hold one reference each; see `crate::tier`.
            t.check().map_err(Error::InvariantViolation)?;
            let mut fills = vec![0u32; nh];
            for &(_, h) in &self.swap_out_q {
                fills[h as usize] += 1;
            }
            for h in 0..nh {
                let hb = h as u32;
                if t.pinned[h] {
                    if fills[h] != 1 {
                        return bad(format!(
                            "host block {h} is pinned by an offload but {} swap-outs fill it",
                            fills[h]
                        ));
                    }
                    host_occ[h] += 1;
                }
                if t.reserved[h] {
                    if host_occ[h] != 0 {
                        return bad(format!("reserved host block {h} has other holders"));
                    }
                    host_occ[h] += 1;
                }
                if t.is_indexed(hb) {
                    let rc = self.host.refcount(hb)?;
                    if (rc == 0) != t.lru.contains(hb) {
                        return bad(format!(
                            "host-cached block {h}: refcount {rc}, in the host LRU {}",
                            t.lru.contains(hb)
                        ));
                    }
                    if fills[h] > 0 && !t.pinned[h] {
                        return bad(format!(
                            "host-cached block {h} is filled by a swap-out it is not pinned by"
                        ));
                    }
                    let (hash, _, _) = t.meta(hb);
                    if let Some(b) = self.prefix.lookup(hash) {
                        if self.prefix.stored_tokens(b) != t.tokens_of(hb) {
                            return bad(format!(
                                "hash {hash:#x}: device block {b} and host block {h} hold different tokens"
                            ));
                        }
                    }
                }
            }
        }
        for (h, &o) in host_occ.iter().enumerate() {
            let rc = self.host.refcount(h as u32)? as u64;
            if rc != o {
                return bad(format!("host block {h}: refcount {rc} but {o} holders"));
            }
        }
        match &self.tier {
            Some(t) => self.host.check_invariants_parked(|h| t.lru.contains(h)),
            None => self.host.check_invariants(),
        }
        .map_err(Error::InvariantViolation)?;
        // Pending copies: distinct dsts, owned; no dst is a src; deferred blocks are srcs.
        let mut dsts = std::collections::HashSet::new();
        for &(s, d) in &self.pending {
            if !dsts.insert(d) {
                return bad(format!("block {d} is the dst of two pending copies"));
            }
            if occ[d as usize] == 0 {
                return bad(format!("pending copy dst {d} is not in any table"));
            }
            if self.prefix.hash_of(s).is_some() {
                return bad(format!("pending copy src {s} is hashed"));
            }
        }
        for &(s, _) in &self.pending {
            if dsts.contains(&s) {
                return bad(format!(
                    "block {s} is both a src and a dst of pending copies"
                ));
            }
        }
        let mut free_count = 0usize;
        let mut shared = 0u64;
        for b in 0..n as u32 {
            let rc = self.pool.refcount(b)? as u64;
            let on_free_list = self.pool.is_free(b)?;
            let in_lru = self.prefix.in_lru(b);
            let deferred = self.deferred.contains(&b);
            if rc != occ[b as usize] {
                return bad(format!(
                    "block {b}: refcount {rc} but in {} tables",
                    occ[b as usize]
                ));
            }
            if rc > 1 {
                shared += 1;
            }
            let states = (rc > 0) as u8 + on_free_list as u8 + in_lru as u8 + deferred as u8;
            if states != 1 {
                return bad(format!(
                    "block {b}: refcount {rc}, free list {on_free_list}, LRU {in_lru}, deferred {deferred}"
                ));
            }
            if on_free_list {
                free_count += 1;
                if self.prefix.hash_of(b).is_some() {
                    return bad(format!("free block {b} still hashed"));
                }
            }
            if in_lru && self.prefix.hash_of(b).is_none() {
                return bad(format!("cached-free block {b} has no hash"));
            }
            if deferred && !self.pending.iter().any(|&(s, _)| s == b) {
                return bad(format!("deferred block {b} is no pending copy's src"));
            }
        }
        if free_count != self.pool.num_free() {
            return bad(format!(
                "{free_count} blocks free but the pool counts {}",
                self.pool.num_free()
            ));
        }
        if shared != self.shared_blocks {
            return bad(format!(
                "{shared} shared blocks but the counter says {}",
                self.shared_blocks
            ));
        }
        for (h, b) in self.prefix.entries() {
            if self.prefix.hash_of(b) != Some(h) {
                return bad(format!(
                    "hash {h:#x} maps to block {b}, which carries {:?}",
                    self.prefix.hash_of(b)
                ));
            }
        }
        let hashed = (0..n as u32)
            .filter(|&b| self.prefix.hash_of(b).is_some())
            .count();
        if hashed != self.prefix.num_hashed() {
            return bad(format!(
                "{hashed} blocks carry a hash but the map holds {}",
                self.prefix.num_hashed()
            ));
        }
        self.prefix
            .check_links()
            .map_err(Error::InvariantViolation)?;
        self.prefix.check_map().map_err(Error::InvariantViolation)?;
        self.pool.check_invariants()
    }
}
