//! Criterion benches of the block pool: the lock-free free list against the mutex baseline.
//!
//! Groups:
//! - `alloc_free_one`: one thread, `allocate` then `free` of one block, per iteration. The
//!   `*_exclusive` entries use `allocate_mut` / `free_mut`, the `&mut self` variants a single
//!   owner (the block manager) can call, which need no atomic read-modify-writes.
//! - `alloc_free_256`: one thread, `allocate_n(256)` then `free` of each of the 256 blocks
//!   (likewise with `_exclusive` entries).
//! - `freelist_pop_push`: the free list alone (no reference counts), `pop` then `push`.
//! - `contended`: two threads sharing one pool, each looping `allocate` + `free`.
//!   Measured with `iter_custom`: for a sample of `iters` iterations, two threads are spawned,
//!   meet at a barrier, and split the `iters` allocate+free pairs between them. The time
//!   reported is the wall time from the first thread starting to the last finishing, so the
//!   per-iteration figure is *wall time per pair for the pool as a whole* — a list that scaled
//!   perfectly over two cores would show half its single-thread time. Thread start-up is outside
//!   the timed region.
//!
//! - `atomic_floor`: one uncontended atomic read-modify-write (`fetch_add` on a private counter),
//!   the unit cost every lock-free or locking operation pays at least once. An allocate+free pair
//!   on the lock-free pool does five of them (count reserve, head CAS on pop; refcount CAS, head
//!   CAS, count increment on free), the mutex pool likewise five (lock + unlock twice, refcount).
//!
//! Run: `cargo bench -p pagedkv --bench pool -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::freelist::{FreeList, LockFreeFreeList, MutexFreeList};
use pagedkv::pool::BlockPool;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

const NUM_BLOCKS: u32 = 4096;
const BATCH: usize = 256;
const THREADS: u64 = 2;

fn alloc_free_one(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_one");
    g.throughput(Throughput::Elements(1));
    fn run<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                let id = pool.allocate().unwrap();
                black_box(pool.free(black_box(id)).unwrap())
            })
        });
    }
    fn run_mut<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let mut pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                let id = pool.allocate_mut().unwrap();
                black_box(pool.free_mut(black_box(id)).unwrap())
            })
        });
    }
    run::<LockFreeFreeList>(&mut g, "lock_free");
    run::<MutexFreeList>(&mut g, "mutex");
    run_mut::<LockFreeFreeList>(&mut g, "lock_free_exclusive");
    run_mut::<MutexFreeList>(&mut g, "mutex_exclusive");
    g.finish();
}

fn alloc_free_256(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_256");
    g.throughput(Throughput::Elements(BATCH as u64));
    fn run<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
        let mut ids = Vec::with_capacity(BATCH);
        g.bench_function(name, |b| {
            b.iter(|| {
                ids.clear();
                pool.allocate_n(BATCH, &mut ids).unwrap();
                for &id in black_box(&ids) {
                    pool.free(id).unwrap();
                }
            })
        });
    }
    fn run_mut<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let mut pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
        let mut ids = Vec::with_capacity(BATCH);
        g.bench_function(name, |b| {
            b.iter(|| {
                ids.clear();
                pool.allocate_n_mut(BATCH, &mut ids).unwrap();
                for &id in black_box(&ids) {
                    pool.free_mut(id).unwrap();
                }
            })
        });
    }
    run::<LockFreeFreeList>(&mut g, "lock_free");
    run::<MutexFreeList>(&mut g, "mutex");
    run_mut::<LockFreeFreeList>(&mut g, "lock_free_exclusive");
    run_mut::<MutexFreeList>(&mut g, "mutex_exclusive");
    g.finish();
}

fn freelist_pop_push(c: &mut Criterion) {
    let mut g = c.benchmark_group("freelist_pop_push");
    g.throughput(Throughput::Elements(1));
    fn run<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let list = F::with_capacity(NUM_BLOCKS);
        g.bench_function(name, |b| {
            b.iter(|| {
                let id = list.pop().unwrap();
                list.push(black_box(id)).unwrap();
            })
        });
    }
    run::<LockFreeFreeList>(&mut g, "lock_free");
    run::<MutexFreeList>(&mut g, "mutex");
    g.finish();
}

/// Wall time for `iters` allocate+free pairs split over [`THREADS`] threads on one pool.
fn contended_sample<F: FreeList>(pool: &BlockPool<F>, iters: u64) -> Duration {
    let barrier = Barrier::new(THREADS as usize);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let barrier = &barrier;
                // Thread t takes iterations t, t + THREADS, t + 2·THREADS, …
                let n = iters / THREADS + u64::from(t < iters % THREADS);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..n {
                        let id = pool.allocate().unwrap();
                        black_box(pool.free(black_box(id)).unwrap());
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = spans.iter().map(|s| s.0).min().unwrap();
    let last = spans.iter().map(|s| s.1).max().unwrap();
    last - first
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("contended");
    g.throughput(Throughput::Elements(1));
    fn run<F: FreeList>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
    ) {
        let pool = BlockPool::<F>::new(NUM_BLOCKS).unwrap();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| contended_sample(&pool, iters))
        });
    }
    run::<LockFreeFreeList>(&mut g, "lock_free");
    run::<MutexFreeList>(&mut g, "mutex");
    g.finish();
}

fn atomic_floor(c: &mut Criterion) {
    let mut g = c.benchmark_group("atomic_floor");
    g.throughput(Throughput::Elements(1));
    let word = std::sync::atomic::AtomicU64::new(0);
    g.bench_function("fetch_add", |b| {
        b.iter(|| black_box(&word).fetch_add(1, std::sync::atomic::Ordering::AcqRel))
    });
    g.finish();
}

criterion_group!(
    benches,
    atomic_floor,
    alloc_free_one,
    alloc_free_256,
    freelist_pop_push,
    contended
);
criterion_main!(benches);
