//! A manager whose every KV cache group is windowed (a model whose every layer slides, or is
//! chunked): group 0 itself releases the blocks no later query reads, a prefix hit is the longest
//! boundary whose window the cache holds, and a sequence holds at most its window's blocks.

use pagedkv::groups::{AttentionKind, NULL_BLOCK};
use pagedkv::manager::{BlockManager, ManagerConfig};
use pagedkv::step::{OwnedGroupBuffers, OwnedStepBuffers, StepLayout};
use pagedkv::Error;

fn cfg(num_blocks: u32, bs: u32, groups: Vec<AttentionKind>) -> ManagerConfig {
    let mut c = ManagerConfig::new(num_blocks, bs);
    c.watermark_blocks = 0;
    c.hash_seed = Some(7);
    c.groups = groups;
    c
}

struct Bufs {
    ob: OwnedStepBuffers,
    gob: OwnedGroupBuffers,
}

impl Bufs {
    fn new(m: &BlockManager) -> Self {
        let layout = StepLayout {
            max_seqs: 8,
            max_tokens: 512,
            max_blocks_per_seq: 64,
            max_copies: 16,
            max_swaps: 16,
        };
        Self {
            ob: OwnedStepBuffers::new(layout),
            gob: OwnedGroupBuffers::new(layout, m.num_groups() - 1),
        }
    }
    fn step(&mut self, m: &mut BlockManager, seqs: &[u64], n: &[u32]) -> pagedkv::Result<()> {
        let mut g = self.gob.views();
        m.build_step_groups(seqs, n, &mut self.ob.view(), &mut g)
            .map(|_| ())
    }
}

fn nulls(t: &[u32]) -> usize {
    t.iter().take_while(|&&b| b == NULL_BLOCK).count()
}

const SLIDE: AttentionKind = AttentionKind::Sliding { window: 8 };

fn prompt(n: u32, base: u32) -> Vec<u32> {
    (0..n).map(|i| base + i).collect()
}

#[test]
fn windowed_group_zero_configs() {
    let field = |c: ManagerConfig| match BlockManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => (field, reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    // Every group windowed: accepted, group 0 reports its kind.
    let m = BlockManager::new(cfg(16, 4, vec![SLIDE])).unwrap();
    assert_eq!((m.num_groups(), m.group_kind(0).unwrap()), (1, SLIDE));
    let chunk = AttentionKind::Chunked { chunk: 6 };
    let m = BlockManager::new(cfg(16, 4, vec![chunk, SLIDE])).unwrap();
    assert_eq!(m.group_kind(0).unwrap(), chunk);
    // A windowed group 0 beside a full group: the full one must come first.
    let (f, r) = field(cfg(16, 4, vec![SLIDE, AttentionKind::Full]));
    assert_eq!(f, "groups");
    assert!(r.contains("group 0 must be Full"), "{r}");
    // Swap works; the host tier does not (it is keyed by group 0's leading run).
    let mut c = cfg(16, 4, vec![SLIDE]);
    c.num_host_blocks = 8;
    BlockManager::new(c.clone()).unwrap();
    c.host_cache = true;
    let (f, r) = field(c);
    assert_eq!(f, "host_cache");
    assert!(r.contains("windowed group 0"), "{r}");
}

/// A decode run far past the window holds at most `ceil((W - 1) / B) + 1` blocks, the rest
/// released into the free pool as it goes; the step's rows show the released entries as -1.
#[test]
fn decode_holds_only_the_window() {
    let mut m = BlockManager::new(cfg(64, 4, vec![SLIDE])).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &prompt(20, 100)).unwrap();
    b.step(&mut m, &[1], &[20]).unwrap();
    assert_eq!(
        m.seq_blocks_held(1).unwrap(),
        5,
        "the prompt's step holds every block"
    );
    let bound = (8 - 1usize).div_ceil(4) + 1;
    for t in 0..60u32 {
        m.append(1, &[500 + t]).unwrap();
        b.step(&mut m, &[1], &[1]).unwrap();
        let held = m.seq_blocks_held(1).unwrap();
        assert!(
            held <= bound,
            "{held} blocks held past the window at token {t}"
        );
        let table = m.block_table(1).unwrap();
        let len = 21 + t as usize;
        assert_eq!(table.len(), len.div_ceil(4));
        // Exactly the blocks dead for the step's first position are released.
        let c = len - 1;
        assert_eq!(nulls(table), (c + 1).saturating_sub(8) / 4);
        assert_eq!(held, table.len() - nulls(table));
        let row = &b.ob.block_tables[..table.len()];
        for (j, &x) in row.iter().enumerate() {
            assert_eq!(x, table[j] as i32, "row entry {j}");
        }
        m.check_invariants().unwrap();
    }
    // Everything the sequence released is reusable: used blocks are only its window.
    assert_eq!(
        m.stats().used_blocks as usize,
        m.seq_blocks_held(1).unwrap()
    );
    m.free(1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 64);
}

/// Same for a chunked group 0: at most `ceil((C + B - gcd(B, C)) / B)` blocks.
#[test]
fn chunked_group_zero_releases_past_chunks() {
    let kind = AttentionKind::Chunked { chunk: 6 };
    let mut m = BlockManager::new(cfg(64, 4, vec![kind])).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &prompt(5, 100)).unwrap();
    b.step(&mut m, &[1], &[5]).unwrap();
    let bound = pagedkv::groups::peak_decode_blocks(kind, 1 << 20, 4);
    assert_eq!(bound, 2);
    for t in 0..40u32 {
        m.append(1, &[500 + t]).unwrap();
        b.step(&mut m, &[1], &[1]).unwrap();
        assert!(m.seq_blocks_held(1).unwrap() <= bound);
        let c = 5 + t as usize;
        assert_eq!(nulls(m.block_table(1).unwrap()), c / 6 * 6 / 4);
        m.check_invariants().unwrap();
    }
}

/// The prefix hit is the longest boundary whose window the cache holds: with the prompt's
/// early blocks evicted, a request with the same prompt still hits up to its last full block,
/// holding null entries before the window (a full group 0 would hit nothing: its boundary needs
/// block 0).
#[test]
fn hit_needs_only_the_window() {
    let mut m = BlockManager::new(cfg(24, 4, vec![SLIDE])).unwrap();
    let mut b = Bufs::new(&m);
    let p = prompt(40, 100);
    m.admit(1, &p).unwrap();
    b.step(&mut m, &[1], &[40]).unwrap();
    let a_blocks: Vec<u32> = m.block_table(1).unwrap().to_vec();
    for t in 0..8u32 {
        m.append(1, &[900 + t]).unwrap();
        b.step(&mut m, &[1], &[1]).unwrap();
    }
    // Positions before 40 are past sequence 1's window: its blocks 0..10 are released, cached.
    assert_eq!(nulls(m.block_table(1).unwrap()), 10);
    // The same prompt while they are cached: boundary 9 blocks needs only [dead(36), 9) = [7, 9).
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 36);
    let t2 = m.block_table(2).unwrap().to_vec();
    assert_eq!(nulls(&t2), 7);
    assert_eq!(&t2[7..9], &a_blocks[7..9]);
    assert_eq!(m.seq_blocks_held(2).unwrap(), 3);
    b.step(&mut m, &[2], &[4]).unwrap();
    m.check_invariants().unwrap();
    // A filler takes every free block but one, evicting the early blocks 1..=6.
    let free = m.num_free_blocks() as u32;
    m.admit(9, &prompt(4 * (free - 1), 5000)).unwrap();
    let filler = m.block_table(9).unwrap().to_vec();
    for &x in &a_blocks[1..7] {
        assert!(filler.contains(&x), "early block {x} not evicted");
    }
    // The window ending at the prompt's last full block is still held (by sequence 2): the hit
    // is whole, although the prompt's first blocks are gone.
    let r = m.admit(3, &p).unwrap();
    assert_eq!(r.cached_tokens, 36);
    assert_eq!(r.new_blocks, 1);
    let t3 = m.block_table(3).unwrap();
    assert_eq!(nulls(t3), 7);
    assert_eq!(&t3[7..9], &a_blocks[7..9]);
    m.check_invariants().unwrap();
    b.step(&mut m, &[3], &[4]).unwrap();
    for s in [1, 2, 3, 9] {
        m.free(s).unwrap();
    }
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 24);
}

/// A boundary whose window lost a block is not a hit: the longest one whose window is whole is.
#[test]
fn hit_stops_where_the_window_is_incomplete() {
    let mut m = BlockManager::new(cfg(16, 4, vec![SLIDE])).unwrap();
    let mut b = Bufs::new(&m);
    let p = prompt(40, 100);
    m.admit(1, &p).unwrap();
    b.step(&mut m, &[1], &[40]).unwrap();
    let a_blocks: Vec<u32> = m.block_table(1).unwrap().to_vec();
    m.free(1).unwrap();
    // Freed tail first: evicting two blocks takes blocks 9 and 8 of the prompt.
    let free = m.num_free_blocks() as u32;
    m.admit(9, &prompt(4 * (16 - 10 + 2), 5000)).unwrap();
    assert!(m.block_table(9).unwrap().contains(&a_blocks[8]));
    assert_eq!(free, 16);
    // Boundary 9 needs [7, 9): block 8 is gone. Boundary 8 needs [dead(32), 8) = [6, 8): held.
    let r = m.admit(2, &p).unwrap();
    assert_eq!(r.cached_tokens, 32);
    let t = m.block_table(2).unwrap();
    assert_eq!(nulls(t), 6);
    assert_eq!(&t[6..8], &a_blocks[6..8]);
    m.check_invariants().unwrap();
}

/// Fork shares the window, swap moves only the held blocks and keeps the null prefix; recompute
/// re-admits with the window's hit.
#[test]
fn fork_swap_and_recompute_keep_the_null_prefix() {
    let mut c = cfg(48, 4, vec![SLIDE]);
    c.num_host_blocks = 16;
    let mut m = BlockManager::new(c).unwrap();
    let mut b = Bufs::new(&m);
    m.admit(1, &prompt(30, 100)).unwrap();
    b.step(&mut m, &[1], &[30]).unwrap();
    m.append(1, &[7]).unwrap();
    b.step(&mut m, &[1], &[1]).unwrap();
    let start = nulls(m.block_table(1).unwrap());
    assert_eq!(start, (31 - 8) / 4);
    m.fork(1, 2).unwrap();
    assert_eq!(nulls(m.block_table(2).unwrap()), start);
    m.check_invariants().unwrap();
    let held = m.seq_blocks_held(1).unwrap();
    let pairs = m.swap_out(&[1, 2]).unwrap();
    // One host block per distinct held block (the fork shares all but none yet).
    assert_eq!(pairs.len(), held);
    assert_eq!(nulls(m.block_table(1).unwrap()), start);
    m.check_invariants().unwrap();
    b.step(&mut m, &[], &[]).unwrap();
    m.swap_in(&[1, 2]).unwrap();
    assert_eq!(nulls(m.block_table(2).unwrap()), start);
    m.check_invariants().unwrap();
    b.step(&mut m, &[], &[]).unwrap();
    m.append(2, &[8]).unwrap();
    b.step(&mut m, &[2], &[1]).unwrap();
    m.recompute(1).unwrap();
    m.check_invariants().unwrap();
    let r = m.resume(1, None).unwrap();
    // Its window ending at the last full block is cached (held by the fork).
    assert_eq!(r.cached_tokens, 28);
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_free_blocks(), 48);
}
