//! Replays the serving trace of `benches/bench_manager.py::bench_serve` natively, for profiling.
//!
//! A pool of 24 000 blocks of 16 holds 256 running sequences (prompts of 300–1500 tokens sharing a
//! 512-token system prompt) plus the cached-free blocks of finished ones: the free list is empty,
//! so every block a decode step allocates is an LRU eviction, and every block it fills is
//! registered in the prefix cache. Every 8th step one sequence finishes and a new one is admitted
//! (a prefix hit on the system prompt, the rest prefilled by a step); sequences past 1900 tokens
//! are retired and replaced. Only the decode step (`append_batch` of one token each, then
//! `build_step` of the batch, no CSR page table) is timed; it lives in the non-inlined
//! `decode_step`, so an instruction count can be restricted to it:
//!
//! ```text
//! cargo build --release -p pagedkv --example serve_trace
//! target/release/examples/serve_trace 2000              # prints ns per decode step
//! valgrind --tool=callgrind --toggle-collect='*decode_step*' \
//!     target/release/examples/serve_trace 200           # Ir of 200 decode steps
//! ```
//!
//! The argument is the number of timed decode steps (default 4000).

use std::hint::black_box;
use std::time::Instant;

use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::SeqId;

const B: u32 = 16;
const NUM_BLOCKS: u32 = 24_000;
const SEQS: usize = 256;
const MAX_BLOCKS: usize = 2048 / B as usize;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 32_000) as u32).collect()
    }
}

struct Trace {
    m: BlockManager,
    bufs: OwnedStepBuffers,
    rng: Rng,
    system: Vec<u32>,
    live: Vec<SeqId>,
    next_id: SeqId,
    step_no: u64,
}

impl Trace {
    fn new() -> Self {
        let mut cfg = ManagerConfig::new(NUM_BLOCKS, B);
        cfg.max_blocks_per_seq = MAX_BLOCKS as u32;
        // Knobs for experiments: SERVE_VERIFY=0 turns verify mode off, SERVE_CACHING=0 the
        // prefix cache (then nothing is cached-free and nothing is evicted).
        let knob = |k: &str| std::env::var(k).map(|v| v != "0").unwrap_or(true);
        cfg.verify_prefix = knob("SERVE_VERIFY");
        cfg.enable_prefix_caching = knob("SERVE_CACHING");
        let mut bufs = OwnedStepBuffers::new(StepLayout {
            max_seqs: SEQS,
            max_tokens: 4096,
            max_blocks_per_seq: MAX_BLOCKS,
            max_copies: 16,
            max_swaps: 0,
        });
        bufs.kv_indptr.clear();
        bufs.kv_indices.clear();
        bufs.kv_last_page_len.clear();
        let mut rng = Rng(7);
        let system = rng.tokens(512);
        Trace {
            m: BlockManager::new(cfg).unwrap(),
            bufs,
            rng,
            system,
            live: Vec::new(),
            next_id: 0,
            step_no: 0,
        }
    }

    fn prompt(&mut self) -> Vec<u32> {
        let n = self.rng.range(300, 1500);
        let mut p = self.system.clone();
        p.extend(self.rng.tokens((n.max(513)) - 512));
        p
    }

    fn admit_one(&mut self) {
        let sid = self.next_id;
        self.next_id += 1;
        let p = self.prompt();
        while !self.m.can_admit(p.len()) {
            let s = self.live.remove(0);
            self.m.free(s).unwrap();
        }
        let r = self.m.admit(sid, &p).unwrap();
        let n = p.len() as u32 - r.cached_tokens;
        self.m
            .build_step(&[sid], &[n], &mut self.bufs.view())
            .unwrap();
        self.live.push(sid);
    }

    fn warm_up(&mut self) {
        let caching = self.m.config().enable_prefix_caching;
        while (caching && self.m.stats().free_blocks > 0) || self.live.len() < SEQS {
            if self.live.len() >= SEQS || !self.m.can_admit(1500) {
                let k = self.rng.range(0, self.live.len());
                let s = self.live.remove(k);
                self.m.free(s).unwrap();
            }
            self.admit_one();
        }
    }

    fn churn(&mut self) {
        self.step_no += 1;
        if self.step_no % 8 == 0 {
            let k = self.rng.range(0, self.live.len());
            let s = self.live.remove(k);
            self.m.free(s).unwrap();
            self.admit_one();
        }
        let old: Vec<SeqId> = self
            .live
            .iter()
            .copied()
            .filter(|&s| self.m.seq_len(s).unwrap() > 1900)
            .collect();
        for s in old {
            self.live.retain(|&x| x != s);
            self.m.free(s).unwrap();
            self.admit_one();
        }
    }
}

/// One decode step, as the engine makes it: one token appended to each sequence, then the step.
#[inline(never)]
fn decode_step(m: &mut BlockManager, bufs: &mut OwnedStepBuffers, ids: &[SeqId], toks: &[u32]) {
    m.append_batch(ids, toks).unwrap();
    let ones = [1u32; SEQS];
    black_box(
        m.build_step(ids, &ones[..ids.len()], &mut bufs.view())
            .unwrap(),
    );
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("steps"))
        .unwrap_or(4000);
    let mut t = Trace::new();
    t.warm_up();
    let ev0 = t.m.stats().evictions;
    let mut total = 0u128;
    let mut per = Vec::with_capacity(steps / 100 + 1);
    let mut chunk = 0u128;
    for i in 0..steps {
        t.churn();
        let ids = t.live.clone();
        let toks = t.rng.tokens(ids.len());
        let t0 = Instant::now();
        decode_step(&mut t.m, &mut t.bufs, &ids, &toks);
        let dt = t0.elapsed().as_nanos();
        total += dt;
        chunk += dt;
        if (i + 1) % 100 == 0 {
            per.push(chunk as f64 / 100.0);
            chunk = 0;
        }
    }
    let st = t.m.stats();
    if t.m.config().enable_prefix_caching {
        assert!(st.evictions > ev0, "the trace must evict");
        assert_eq!(st.free_blocks, 0);
    }
    t.m.check_invariants().unwrap();
    per.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = if per.is_empty() {
        total as f64 / steps as f64
    } else {
        per[per.len() / 2]
    };
    println!(
        "serve_trace: {steps} decode steps, mean {:.0} ns, median of 100-step means {:.0} ns, \
         {:.1} evictions/step",
        total as f64 / steps as f64,
        med,
        (st.evictions - ev0) as f64 / steps as f64
    );
}
