//! Criterion benches of the caller-keyed pool ([`pagedkv::keyed::KeyedPool`]), shaped like one
//! decode step of a serving engine with prefix caching on.
//!
//! - `decode_step_256`: 256 sequences each take one new block, key it (a 36-byte key: 32 hash
//!   bytes and a group id, as vLLM packs them), and release a block of an earlier step to the back
//!   of the eviction order, so allocation keeps evicting the least recently released block.
//! - `lookup_hit_miss`: one lookup that hits and one that misses.
//! - `touch_release_16`: a 16-block prefix hit on free cached blocks (revive), then its release.
//!
//! Run: `cargo bench -p pagedkv --bench keyed -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::keyed::{make_key, KeyedPool, Placement};
use std::hint::black_box;

const SEQS: usize = 256;

fn key(i: u64) -> Vec<u8> {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&i.to_le_bytes());
    h[8..16].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    make_key(&h, 0)
}

fn decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_256");
    g.throughput(Throughput::Elements(SEQS as u64));
    let mut p = KeyedPool::new(4096, true).unwrap();
    // Warm state: every block cached and free, so each allocation evicts.
    let (all, _) = p.allocate(4095).unwrap();
    for (i, &b) in all.iter().enumerate() {
        p.insert(&key(i as u64), b).unwrap();
    }
    p.release(&all, Placement::ByCache).unwrap();
    let keys: Vec<Vec<u8>> = (0..1_000_000u64).map(key).collect();
    let (mut out, mut ev) = (Vec::new(), Vec::new());
    let mut prev: Vec<u32> = Vec::new();
    let mut step = 0usize;
    g.bench_function("allocate_insert_release", |b| {
        b.iter(|| {
            p.allocate_into(SEQS, &mut out, &mut ev).unwrap();
            for (j, &blk) in out.iter().enumerate() {
                let k = &keys[(step * SEQS + j) % keys.len()];
                p.insert(k, blk).unwrap();
            }
            if !prev.is_empty() {
                p.release(&prev, Placement::ByCache).unwrap();
            }
            std::mem::swap(&mut prev, &mut out);
            step += 1;
            black_box(ev.len());
        })
    });
    g.finish();
}

fn lookup(c: &mut Criterion) {
    let mut p = KeyedPool::new(4096, true).unwrap();
    let (all, _) = p.allocate(4095).unwrap();
    for (i, &b) in all.iter().enumerate() {
        p.insert(&key(i as u64), b).unwrap();
    }
    let (hit, miss) = (key(17), key(1 << 40));
    c.bench_function("lookup_hit_miss", |b| {
        b.iter(|| (black_box(p.lookup(&hit)), black_box(p.lookup(&miss))))
    });
}

fn touch_release(c: &mut Criterion) {
    let mut p = KeyedPool::new(4096, true).unwrap();
    let (all, _) = p.allocate(4095).unwrap();
    for (i, &b) in all.iter().enumerate() {
        p.insert(&key(i as u64), b).unwrap();
    }
    p.release(&all, Placement::ByCache).unwrap();
    let prefix: Vec<u32> = all[100..116].to_vec();
    c.bench_function("touch_release_16", |b| {
        b.iter(|| {
            p.touch(&prefix).unwrap();
            p.release(&prefix, Placement::ByCache).unwrap();
        })
    });
}

criterion_group!(benches, decode_step, lookup, touch_release);
criterion_main!(benches);
