//! Criterion benches of provisional tokens (block size 16, prefix caching on, k = 4).
//!
//! 256 running sequences with random 500–2000-token contexts, stepped like a speculative decoder:
//! each iteration gives every sequence 4 provisional tokens (`append_provisional_batch`), builds
//! the step that schedules them, then settles the batch with one `commit_batch`. Only the settling
//! call is timed in `commit_batch_256/*`; the figure per sequence-step is the time / 256.
//! - `random`: each sequence accepts a uniform 0–4 of its drafts (blocks emptied by the rejected
//!   ones go back; full blocks of accepted ones are hashed and cached).
//! - `accept_all`: every draft accepted. `rewind_all`: every draft rejected (a batch rewind).
//! - `cycle_random`: the whole cycle timed — provisional append, step and commit — for comparing
//!   with `decode_step_256/prefix_on_no_csr` of the manager bench (one step without drafts).
//!
//! Every 64 iterations (outside the timed region) a sequence past 2100 tokens is freed and
//! re-admitted with a fresh random prompt, keeping the state steady.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::SeqId;

const B: u32 = 16;
const N: usize = 256;
const K: u32 = 4;
const MAX_CTX: usize = 2100;
/// Growth between two re-admission checks (64 iterations of up to K tokens), and a margin.
const SLACK: usize = 64 * K as usize + 128;

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
        (0..n).map(|_| (self.next() % 128_000) as u32).collect()
    }
}

#[derive(Clone, Copy)]
enum Accept {
    Random,
    All,
    None,
}

fn commit(c: &mut Criterion) {
    let mut g = c.benchmark_group("commit_batch_256");
    for (name, accept, whole_cycle) in [
        ("random", Accept::Random, false),
        ("accept_all", Accept::All, false),
        ("rewind_all", Accept::None, false),
        ("cycle_random", Accept::Random, true),
    ] {
        g.bench_function(name, |b| {
            let mut cfg = ManagerConfig::new(
                (N * (MAX_CTX + SLACK + B as usize) / B as usize) as u32 + 64,
                B,
            );
            cfg.max_provisional = K;
            let mut m = BlockManager::new(cfg).unwrap();
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let seqs: Vec<SeqId> = (0..N as u64).collect();
            for &s in &seqs {
                let n = rng.range(500, 2000);
                m.admit(s, &rng.tokens(n)).unwrap();
            }
            let layout = StepLayout {
                max_seqs: N,
                max_tokens: N * 2048,
                max_blocks_per_seq: (MAX_CTX + SLACK) / B as usize + 1,
                max_copies: 16,
                max_swaps: 4,
            };
            let mut ob = OwnedStepBuffers::new(layout);
            ob.kv_indptr.clear();
            ob.kv_indices.clear();
            ob.kv_last_page_len.clear();
            let lens: Vec<u32> = seqs.iter().map(|&s| m.seq_len(s).unwrap() as u32).collect();
            m.build_step(&seqs, &lens, &mut ob.view()).unwrap();
            let ks = vec![K; N];
            let mut pairs: Vec<(SeqId, u32)> = seqs.iter().map(|&s| (s, 0)).collect();
            let mut toks: Vec<u32> = Vec::with_capacity(N * K as usize);
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0u64;
                while done < iters {
                    let chunk = (iters - done).min(64);
                    for _ in 0..chunk {
                        toks.clear();
                        for p in pairs.iter_mut() {
                            p.1 = match accept {
                                Accept::Random => (rng.next() % (K as u64 + 1)) as u32,
                                Accept::All => K,
                                Accept::None => 0,
                            };
                            for _ in 0..p.1 {
                                toks.push((rng.next() % 128_000) as u32);
                            }
                        }
                        let start = Instant::now();
                        if whole_cycle {
                            m.append_provisional_batch(black_box(&seqs), &ks).unwrap();
                            black_box(m.build_step(&seqs, &ks, &mut ob.view()).unwrap());
                            m.commit_batch(black_box(&pairs), black_box(&toks)).unwrap();
                            total += start.elapsed();
                        } else {
                            total += start.elapsed();
                            m.append_provisional_batch(&seqs, &ks).unwrap();
                            m.build_step(&seqs, &ks, &mut ob.view()).unwrap();
                            let start = Instant::now();
                            m.commit_batch(black_box(&pairs), black_box(&toks)).unwrap();
                            total += start.elapsed();
                        }
                    }
                    done += chunk;
                    for &s in &seqs {
                        if m.seq_len(s).unwrap() > MAX_CTX {
                            m.free(s).unwrap();
                            let n = rng.range(500, 2000);
                            m.admit(s, &rng.tokens(n)).unwrap();
                            m.build_step(&[s], &[n as u32], &mut ob.view()).unwrap();
                        }
                    }
                }
                total
            });
        });
    }
    g.finish();
}

criterion_group!(benches, commit);
criterion_main!(benches);
