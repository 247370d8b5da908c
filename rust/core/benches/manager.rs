//! Criterion benches of the block manager, step builder and prefix cache (block size 16).
//!
//! - `decode_step_256/*`: one decode step for 256 running sequences: `append_batch` of one token
//!   each, then `build_step` of the whole batch into preallocated buffers. Contexts start at a
//!   random 500–2000 tokens. To keep the state steady, every 64 steps (outside the timed region) any
//!   sequence past 2100 tokens is freed and re-admitted with a fresh random 500–2000-token prompt.
//!   Variants: `prefix_on_no_csr` and `prefix_off_no_csr` leave out the optional FlashInfer CSR
//!   page table (the decode target counts slot mapping and block tables only);
//!   `*_append_only` / `*_build_only` time one half; `memcpy_floor` copies the same rows' worth of
//!   block ids into the two output buffers with no bookkeeping, the floor memory traffic sets.
//!   `prefix_off_ids_shifted`: `prefix_off` with sequence ids `i << 32` (packed request/sample
//!   ids), which a weak integer hash sends to one bucket.
//! - `decode_groups_256/*`: the `decode_step_256/prefix_on` trace (append one token to each of
//!   256 sequences, then build the step; same seeds, same re-admissions) with KV cache groups.
//!   `one_group`: the manager without groups; `full_sliding_128`: a full group plus a sliding
//!   group of window 128 (gpt-oss's pattern), stepped with `build_step_groups` into per-group
//!   buffers — the second group's slot mapping, rows, growth and release ride on the same step.
//! - `admit_4096/*`: admit a 4096-token prompt, then free it (both timed).
//!   `prefix_off`: caching disabled. `prefix_on_cold` / `prefix_on_cold_verify`: every prompt is
//!   new (its first token is a counter), so all 256 blocks miss, verify mode off / on.
//!   `prefix_on_cached` / `prefix_on_cached_verify`: the same prompt each time, cached by one
//!   earlier step; 255 blocks hit (the last is recomputed), with verify mode off / on.
//!   Other benches use `ManagerConfig::new`'s defaults: verify on, a random hash key.
//! - `hash_4096`: the chained, keyed XXH3-128 hash of a 4096-token prompt (256 blocks, no extra
//!   keys); `xxh3_128_80B` / `xxh3_128_80B_seeded`: one 80-byte block message alone, unkeyed /
//!   keyed, the per-block floor.
//! - `hash_maps/*`: the keyed map hasher. `register_48k/*`: register 48k block hashes into a fresh
//!   prefix cache — random hashes, and two crafted families (`lo ^ hi` equal for all, low 40 bits
//!   zero). `admit_free_80k/*`: admit then free 80k one-token sequences (caching off) with random,
//!   dense (`0..n`) and shifted (`i << 32`) ids.
//! - `evict_4096/*`: only the admission of a new 4096-token prompt is timed. `from_free_list`: its
//!   256 blocks come off the free list. `evicting`: the free list is empty and the pool is full of
//!   cached-free blocks, so each of the 256 allocations evicts the oldest one. The untimed cleanup
//!   (`build_step` to cache the blocks, then `free`) keeps each variant's pool in the same state.
//!   The difference divided by 256 is the cost of an eviction per block.
//! - `sched_4096/*`: scheduler-facing calls on a cached 4096-token prompt (its blocks held by a
//!   running sequence). `can_admit_tokens`: the read-only lookup (255 hits). `admit_chunked_512`:
//!   admit with `max_new_tokens = 512` (255 blocks shared, 1 new) and free. `admit_batch_8`:
//!   eight 512-token prompts admitted in one `admit_batch`, then `free_batch`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedkv::hash::{root_hash, Hasher};
use pagedkv::manager::{AdmitRequest, BlockManager, ManagerConfig};
use pagedkv::step::{OwnedStepBuffers, StepLayout};
use pagedkv::SeqId;

const B: u32 = 16;

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

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_256");
    for (name, caching, append, build, csr, shift) in [
        ("prefix_off", false, true, true, true, 0),
        ("prefix_on", true, true, true, true, 0),
        ("prefix_on_no_csr", true, true, true, false, 0),
        ("prefix_off_no_csr", false, true, true, false, 0),
        ("prefix_off_append_only", false, true, false, true, 0),
        ("prefix_off_build_only", false, false, true, true, 0),
        ("prefix_off_ids_shifted", false, true, true, true, 32),
    ] {
        g.bench_function(name, |b| {
            const N: usize = 256;
            const MAX_CTX: usize = 2100;
            let mut cfg = ManagerConfig::new(
                (N * (MAX_CTX + 64 + B as usize) / B as usize) as u32 + 64,
                B,
            );
            cfg.enable_prefix_caching = caching;
            let mut m = BlockManager::new(cfg).unwrap();
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let seqs: Vec<SeqId> = (0..N as u64).map(|i| i << shift).collect();
            for &s in &seqs {
                let n = rng.range(500, 2000);
                m.admit(s, &rng.tokens(n)).unwrap();
            }
            let layout = StepLayout {
                max_seqs: N,
                max_tokens: N * 2048,
                max_blocks_per_seq: (MAX_CTX + 128) / B as usize + 1,
                max_copies: 16,
                max_swaps: 4,
            };
            let mut ob = OwnedStepBuffers::new(layout);
            if !csr {
                ob.kv_indptr.clear();
                ob.kv_indices.clear();
                ob.kv_last_page_len.clear();
            }
            // Prefill step once so the state looks like a running batch.
            let lens: Vec<u32> = seqs.iter().map(|&s| m.seq_len(s).unwrap() as u32).collect();
            m.build_step(&seqs, &lens, &mut ob.view()).unwrap();
            let ones = vec![1u32; N];
            let mut toks = vec![0u32; N];
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0u64;
                while done < iters {
                    let chunk = (iters - done).min(64);
                    for t in toks.iter_mut() {
                        *t = (rng.next() % 128_000) as u32;
                    }
                    let start = Instant::now();
                    for _ in 0..chunk {
                        if append {
                            m.append_batch(black_box(&seqs), black_box(&toks)).unwrap();
                        }
                        if build {
                            black_box(m.build_step(&seqs, &ones, &mut ob.view()).unwrap());
                        }
                    }
                    total += start.elapsed();
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
    // The floor set by memory traffic alone: copy the same block-table rows (as i32) into a
    // block-table buffer and a CSR index buffer, with no bookkeeping at all.
    g.bench_function("memcpy_floor", |b| {
        const N: usize = 256;
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let rows: Vec<Vec<i32>> = (0..N)
            .map(|_| vec![1; rng.range(500, 2000).div_ceil(B as usize)])
            .collect();
        let stride = (2100 + 128) / B as usize + 1;
        let mut bt = vec![0i32; N * stride];
        let mut kv = vec![0i32; N * stride];
        b.iter(|| {
            let mut off = 0;
            for (k, r) in rows.iter().enumerate() {
                bt[k * stride..k * stride + r.len()].copy_from_slice(r);
                kv[off..off + r.len()].copy_from_slice(r);
                off += r.len();
            }
            black_box((&mut bt, &mut kv));
        });
    });
    g.finish();
}

fn decode_groups(c: &mut Criterion) {
    use pagedkv::groups::AttentionKind;
    use pagedkv::step::OwnedGroupBuffers;
    let mut g = c.benchmark_group("decode_groups_256");
    for (name, groups) in [
        ("one_group", vec![]),
        (
            "full_sliding_128",
            vec![AttentionKind::Full, AttentionKind::Sliding { window: 128 }],
        ),
        // Every layer sliding (Mistral-7B-v0.1): one group, group 0 windowed.
        (
            "sliding_only_128",
            vec![AttentionKind::Sliding { window: 128 }],
        ),
    ] {
        g.bench_function(name, |b| {
            const N: usize = 256;
            const MAX_CTX: usize = 2100;
            let ng = groups.len().max(1);
            let mut cfg = ManagerConfig::new(
                (ng * N * (MAX_CTX + 64 + B as usize) / B as usize) as u32 + 64,
                B,
            );
            cfg.groups = groups.clone();
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
                max_blocks_per_seq: (MAX_CTX + 128) / B as usize + 1,
                max_copies: 16,
                max_swaps: 4,
            };
            let mut ob = OwnedStepBuffers::new(layout);
            let mut gob = OwnedGroupBuffers::new(layout, ng - 1);
            let lens: Vec<u32> = seqs.iter().map(|&s| m.seq_len(s).unwrap() as u32).collect();
            m.build_step_groups(&seqs, &lens, &mut ob.view(), &mut gob.views())
                .unwrap();
            let ones = vec![1u32; N];
            let mut toks = vec![0u32; N];
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0u64;
                let mut views = gob.views();
                while done < iters {
                    let chunk = (iters - done).min(64);
                    for t in toks.iter_mut() {
                        *t = (rng.next() % 128_000) as u32;
                    }
                    let start = Instant::now();
                    for _ in 0..chunk {
                        m.append_batch(black_box(&seqs), black_box(&toks)).unwrap();
                        black_box(
                            m.build_step_groups(&seqs, &ones, &mut ob.view(), &mut views)
                                .unwrap(),
                        );
                    }
                    total += start.elapsed();
                    done += chunk;
                    for &s in &seqs {
                        if m.seq_len(s).unwrap() > MAX_CTX {
                            m.free(s).unwrap();
                            let n = rng.range(500, 2000);
                            m.admit(s, &rng.tokens(n)).unwrap();
                            m.build_step_groups(&[s], &[n as u32], &mut ob.view(), &mut views)
                                .unwrap();
                        }
                    }
                }
                total
            });
        });
    }
    g.finish();
}

fn admit(c: &mut Criterion) {
    let mut g = c.benchmark_group("admit_4096");
    let prompt: Vec<u32> = Rng(7).tokens(4096);
    let layout = StepLayout {
        max_seqs: 1,
        max_tokens: 4096,
        max_blocks_per_seq: 256,
        max_copies: 1,
        max_swaps: 4,
    };

    g.bench_function("prefix_off", |b| {
        let mut cfg = ManagerConfig::new(4096, B);
        cfg.enable_prefix_caching = false;
        let mut m = BlockManager::new(cfg).unwrap();
        b.iter(|| {
            black_box(m.admit(1, black_box(&prompt)).unwrap());
            m.free(1).unwrap();
        });
    });

    for verify in [false, true] {
        let name = if verify {
            "prefix_on_cold_verify"
        } else {
            "prefix_on_cold"
        };
        g.bench_function(name, |b| {
            let mut cfg = ManagerConfig::new(4096, B);
            cfg.verify_prefix = verify;
            let mut m = BlockManager::new(cfg).unwrap();
            let mut p = prompt.clone();
            let mut i = 0u32;
            b.iter(|| {
                i = i.wrapping_add(1);
                p[0] = i;
                let r = m.admit(1, black_box(&p)).unwrap();
                debug_assert_eq!(r.cached_tokens, 0);
                m.free(1).unwrap();
            });
        });
    }

    for verify in [false, true] {
        let name = if verify {
            "prefix_on_cached_verify"
        } else {
            "prefix_on_cached"
        };
        g.bench_function(name, |b| {
            let mut cfg = ManagerConfig::new(4096, B);
            cfg.verify_prefix = verify;
            let mut m = BlockManager::new(cfg).unwrap();
            let mut ob = OwnedStepBuffers::new(layout);
            m.admit(1, &prompt).unwrap();
            m.build_step(&[1], &[4096], &mut ob.view()).unwrap();
            m.free(1).unwrap();
            b.iter(|| {
                let r = m.admit(1, black_box(&prompt)).unwrap();
                assert_eq!(r.cached_tokens, 4096 - B);
                m.free(1).unwrap();
            });
        });
    }
    g.finish();
}

fn hash(c: &mut Criterion) {
    let prompt: Vec<u32> = Rng(11).tokens(4096);
    // Any key: the cost does not depend on its value (the manager's is drawn from the OS).
    let key = 0x243f_6a88_85a3_08d3;
    let root = root_hash(key, &[]);
    let mut h = Hasher::new(key);
    let mut out = Vec::with_capacity(256);
    // One block message on its own (16-byte previous hash + 16 tokens): the floor per block.
    let msg: Vec<u8> = (0..80u8).collect();
    c.bench_function("xxh3_128_80B", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128(black_box(&msg)))
    });
    c.bench_function("xxh3_128_80B_seeded", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128_with_seed(black_box(&msg), black_box(key)))
    });
    c.bench_function("hash_4096", |b| {
        b.iter(|| {
            out.clear();
            h.extend_chain(root, black_box(&prompt), B as usize, None, &mut out);
            black_box(out.last().copied())
        });
    });
}

fn evict(c: &mut Criterion) {
    let mut g = c.benchmark_group("evict_4096");
    let layout = StepLayout {
        max_seqs: 1,
        max_tokens: 4096,
        max_blocks_per_seq: 256,
        max_copies: 1,
        max_swaps: 4,
    };
    for evicting in [false, true] {
        let name = if evicting {
            "evicting"
        } else {
            "from_free_list"
        };
        g.bench_function(name, |b| {
            // 1024 blocks: 4 prompts' worth. Evicting: fill the whole pool with cached-free blocks.
            let mut cfg = ManagerConfig::new(1024, B);
            cfg.watermark_blocks = 0;
            let mut m = BlockManager::new(cfg).unwrap();
            let mut ob = OwnedStepBuffers::new(layout);
            let mut rng = Rng(3);
            if evicting {
                for s in 0..4 {
                    m.admit(s, &rng.tokens(4096)).unwrap();
                    m.build_step(&[s], &[4096], &mut ob.view()).unwrap();
                }
                for s in 0..4 {
                    m.free(s).unwrap();
                }
                assert_eq!(m.stats().cached_free_blocks, 1024);
            }
            let mut p = rng.tokens(4096);
            let mut i = 0u32;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    i = i.wrapping_add(1);
                    p[0] = i;
                    let start = Instant::now();
                    black_box(m.admit(1, black_box(&p)).unwrap());
                    total += start.elapsed();
                    if evicting {
                        m.build_step(&[1], &[4096], &mut ob.view()).unwrap();
                    }
                    m.free(1).unwrap();
                }
                total
            });
            if evicting {
                assert!(m.stats().evictions > 0);
            }
        });
    }
    g.finish();
}

fn sched(c: &mut Criterion) {
    let mut g = c.benchmark_group("sched_4096");
    let prompt: Vec<u32> = Rng(11).tokens(4096);
    let mut m = BlockManager::new(ManagerConfig::new(8192, B)).unwrap();
    let mut ob = OwnedStepBuffers::new(StepLayout {
        max_seqs: 1,
        max_tokens: 4096,
        max_blocks_per_seq: 256,
        max_copies: 1,
        max_swaps: 4,
    });
    m.admit(1, &prompt).unwrap();
    m.build_step(&[1], &[4096], &mut ob.view()).unwrap();
    g.bench_function("can_admit_tokens", |b| {
        b.iter(|| black_box(m.can_admit_tokens(black_box(&prompt), None, None).unwrap()));
    });
    g.bench_function("admit_chunked_512", |b| {
        b.iter(|| {
            let r = m
                .admit_opts(2, black_box(&prompt), None, Some(512))
                .unwrap();
            debug_assert_eq!(r.cached_tokens, 4080);
            m.free(2).unwrap();
        });
    });
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| Rng(100 + i).tokens(512)).collect();
    let ids: Vec<SeqId> = (10..18).collect();
    g.bench_function("admit_batch_8", |b| {
        b.iter(|| {
            let reqs: Vec<AdmitRequest<'_>> = ids
                .iter()
                .zip(&prompts)
                .map(|(&s, p)| AdmitRequest::new(s, p))
                .collect();
            black_box(m.admit_batch(&reqs).unwrap());
            m.free_batch(&ids).unwrap();
        });
    });
    g.finish();
}

/// The keyed map hasher on structured and crafted keys against random ones: registering 48k
/// block hashes into a fresh prefix cache, and admitting then freeing 80k one-token sequences.
fn hash_maps(c: &mut Criterion) {
    use pagedkv::prefix::PrefixCache;
    let mut g = c.benchmark_group("hash_maps");
    g.sample_size(10);
    const NB: u32 = 48_000;
    let mut rng = Rng(5);
    let random: Vec<u128> = (0..NB)
        .map(|_| ((rng.next() as u128) << 64) | rng.next() as u128)
        .collect();
    let cancel: Vec<u128> = (0..NB as u128).map(|i| (i << 64) | i).collect();
    let low_zero: Vec<u128> = (0..NB as u128).map(|i| i << 40).collect();
    for (name, keys) in [
        ("register_48k/random", &random),
        ("register_48k/crafted_halves_cancel", &cancel),
        ("register_48k/crafted_low_bits_zero", &low_zero),
    ] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || PrefixCache::new(NB, 1, false, true),
                |mut p| {
                    for (blk, &h) in keys.iter().enumerate() {
                        p.register(blk as u32, h, &[0]);
                    }
                    p
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    const NS: u64 = 80_000;
    let rand_ids: Vec<SeqId> = (0..NS).map(|_| rng.next()).collect();
    let dense: Vec<SeqId> = (0..NS).collect();
    let shifted: Vec<SeqId> = (0..NS).map(|i| i << 32).collect();
    for (name, ids) in [
        ("admit_free_80k/random_ids", &rand_ids),
        ("admit_free_80k/dense_ids", &dense),
        ("admit_free_80k/ids_shifted_32", &shifted),
    ] {
        g.bench_function(name, |b| {
            let mut cfg = ManagerConfig::new(NS as u32 + 1, B);
            cfg.enable_prefix_caching = false;
            cfg.watermark_blocks = 0;
            let mut m = BlockManager::new(cfg).unwrap();
            b.iter(|| {
                for &s in ids.iter() {
                    m.admit(s, &[1]).unwrap();
                }
                for &s in ids.iter() {
                    m.free(s).unwrap();
                }
            });
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    decode,
    decode_groups,
    admit,
    hash,
    evict,
    sched,
    hash_maps
);
criterion_main!(benches);
