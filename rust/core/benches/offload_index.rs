//! Criterion benches of the offloading tier's index ([`pagedkv::offload_index::OffloadIndex`]),
//! per 4096-token prompt of 256 keys (36 bytes each: 32 hash bytes and a group id, as vLLM packs
//! an offload key), in a 4096-chunk tier, with token positions known:
//!
//! - `store`: `prepare_store` of 256 new keys and `complete_store`, with no eviction (the tier is
//!   reset when full);
//! - `load`: 256 `lookup`s, `prepare_load`, `touch`, `complete_load` of a stored prompt;
//! - `evict`: as `store`, in a tier full of ready chunks: each store evicts 256.
//!
//! Run: `cargo bench -p pagedkv --bench offload_index -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::offload_index::{OffloadIndex, StoreOut};
use std::hint::black_box;

const N: usize = 256;
const CHUNKS: u32 = 4096;

fn prompt(p: u64) -> Vec<Vec<u8>> {
    (0..N as u64)
        .map(|i| {
            let mut k = vec![0u8; 32];
            k[..8].copy_from_slice(&p.to_le_bytes());
            k[8..16].copy_from_slice(&i.to_le_bytes());
            k.extend_from_slice(&0u32.to_be_bytes());
            k
        })
        .collect()
}

fn positions() -> Vec<Option<i64>> {
    (0..N as i64).map(|i| Some((i + 1) * 16)).collect()
}

fn store(
    x: &mut OffloadIndex,
    keys: &[&[u8]],
    pos: &[Option<i64>],
    out: &mut StoreOut,
    done: &mut Vec<usize>,
) {
    assert!(x.prepare_store(keys, pos, None, out).unwrap());
    x.complete_store(keys, true, None, done);
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("offload_index_prompt_256");
    g.throughput(Throughput::Elements(N as u64));
    let pos = positions();
    let prompts: Vec<Vec<Vec<u8>>> = (0..64).map(prompt).collect();
    let refs: Vec<Vec<&[u8]>> = prompts
        .iter()
        .map(|p| p.iter().map(|k| k.as_slice()).collect())
        .collect();
    let (mut out, mut done, mut ids) = (StoreOut::default(), Vec::new(), Vec::new());

    let mut x = OffloadIndex::new(CHUNKS).unwrap();
    let mut i = 0usize;
    g.bench_function("store", |b| {
        b.iter(|| {
            if x.num_free() < N {
                x.reset();
            }
            store(&mut x, &refs[i % 16], &pos, &mut out, &mut done);
            i += 1;
            black_box(out.chunks.len());
        })
    });

    let mut x = OffloadIndex::new(CHUNKS).unwrap();
    for p in &refs[..16] {
        store(&mut x, p, &pos, &mut out, &mut done);
    }
    let mut i = 0usize;
    g.bench_function("load", |b| {
        b.iter(|| {
            let keys = &refs[i % 16];
            for k in keys {
                black_box(x.lookup(k));
            }
            x.prepare_load(keys, &pos, None, &mut ids).unwrap();
            x.touch(keys, None);
            x.complete_load(keys, None).unwrap();
            i += 1;
        })
    });

    let mut x = OffloadIndex::new(CHUNKS).unwrap();
    for p in &refs[..16] {
        store(&mut x, p, &pos, &mut out, &mut done);
    }
    let mut i = 16usize;
    g.bench_function("evict", |b| {
        b.iter(|| {
            store(&mut x, &refs[16 + i % 48], &pos, &mut out, &mut done);
            i += 1;
            black_box(out.evicted_ends.len());
        })
    });
    g.finish();
}

criterion_group!(offload, benches);
criterion_main!(offload);
