//! An intrusive doubly linked list of block ids over preallocated arrays: the eviction order of
//! the prefix cache's LRU (`prefix`) and the keyed pool's free list (`keyed`).
//!
//! Owns a `prev` / `next` link and a membership flag per block of the pool, so pushing at either
//! end, unlinking any member and taking the front are O(1) and never allocate.
//!
//! Invariants (checked by [`IndexList::check`]): `head` and `tail` are the ends ([`NIL`] when
//! empty); the `next` walk from `head` visits each of the `len` members once and ends at `tail`;
//! each `prev` mirrors the `next` before it; `member[b]` holds exactly for the blocks on the walk.

use crate::error::alloc::{filled_vec, zeroed_vec};
use crate::error::{Error, Result};
use crate::BlockId;

/// The null link.
pub(crate) const NIL: u32 = u32::MAX;

/// See the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct IndexList {
    prev: Vec<u32>,
    next: Vec<u32>,
    member: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl IndexList {
    /// An empty list over blocks `0 .. n` (`what` names the arrays if allocation fails).
    pub(crate) fn new(n: usize, what: &'static str) -> Result<Self> {
        Ok(IndexList {
            prev: filled_vec(n, NIL, what)?,
            next: filled_vec(n, NIL, what)?,
            member: zeroed_vec(n, what)?,
            head: NIL,
            tail: NIL,
            len: 0,
        })
    }

    /// Members.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `b` is on the list (false for a block outside it).
    #[inline]
    pub(crate) fn contains(&self, b: BlockId) -> bool {
        self.member.get(b as usize).copied().unwrap_or(false)
    }

    /// `b` as an index, if it may join the list: `InvalidBlock` outside it, `RefcountUnderflow`
    /// (a double free) for a member. Linking a member again would make a cycle through it (the
    /// tail pushed at the back points at itself) and hand it out twice.
    #[inline]
    fn joining(&self, b: BlockId) -> Result<usize> {
        match self.member.get(b as usize) {
            Some(false) => Ok(b as usize),
            Some(true) => Err(Error::RefcountUnderflow { block: b }),
            None => Err(Error::InvalidBlock {
                block: b,
                num_blocks: self.member.len().min(u32::MAX as usize) as u32,
            }),
        }
    }

    /// The first member, if any.
    #[inline]
    pub(crate) fn front(&self) -> Option<BlockId> {
        (self.head != NIL).then_some(self.head)
    }

    /// The last member, if any.
    #[inline]
    pub(crate) fn back(&self) -> Option<BlockId> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The members before and after `b` (`b` must be a member).
    pub(crate) fn neighbours(&self, b: BlockId) -> (Option<BlockId>, Option<BlockId>) {
        let opt = |x: u32| (x != NIL).then_some(x);
        (opt(self.prev[b as usize]), opt(self.next[b as usize]))
    }

    /// Appends `b` at the back; an error ([`Self::joining`]) changes nothing.
    #[inline]
    pub(crate) fn push_back(&mut self, b: BlockId) -> Result<()> {
        let i = self.joining(b)?;
        self.member[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.len += 1;
        Ok(())
    }

    /// Puts `b` at the front; an error ([`Self::joining`]) changes nothing.
    #[inline]
    pub(crate) fn push_front(&mut self, b: BlockId) -> Result<()> {
        let i = self.joining(b)?;
        self.member[i] = true;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.len += 1;
        Ok(())
    }

    /// Unlinks `b`; returns whether it was a member (a non-member is left alone).
    #[inline]
    pub(crate) fn remove(&mut self, b: BlockId) -> bool {
        if !self.contains(b) {
            return false;
        }
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.member[i] = false;
        self.len -= 1;
        true
    }

    /// Unlinks and returns the first member.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        // The head has no `prev`: unlinking it touches only its successor.
        let i = b as usize;
        let n = self.next[i];
        self.head = n;
        if n == NIL {
            self.tail = NIL;
        } else {
            self.prev[n as usize] = NIL;
        }
        self.next[i] = NIL;
        self.member[i] = false;
        self.len -= 1;
        Some(b)
    }

    /// The members from front to back. Stops after `limit + 1` steps, so a corrupted (cyclic)
    /// list cannot hang the caller.
    pub(crate) fn order(&self, limit: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len.min(limit.saturating_add(1)));
        let mut b = self.head;
        while b != NIL && out.len() <= limit {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    /// Checks the invariants of the module documentation; the error names the first broken one
    /// (`what` names the list in it).
    pub(crate) fn check(&self, what: &str) -> std::result::Result<(), String> {
        let n = self.member.len();
        let mut seen = vec![false; n];
        let (mut b, mut p, mut walked) = (self.head, NIL, 0usize);
        while b != NIL {
            let i = b as usize;
            if i >= n || seen[i] {
                return Err(format!("{what} revisits or leaves the pool at block {b}"));
            }
            seen[i] = true;
            if self.prev[i] != p {
                return Err(format!(
                    "{what} block {b}: prev is {}, expected {p}",
                    self.prev[i]
                ));
            }
            if !self.member[i] {
                return Err(format!("{what} block {b} not flagged as a member"));
            }
            p = b;
            b = self.next[i];
            walked += 1;
        }
        if self.tail != p {
            return Err(format!(
                "{what} tail is {}, the walk ends at {p}",
                self.tail
            ));
        }
        if walked != self.len {
            return Err(format!(
                "{what} walk finds {walked} blocks, its length says {}",
                self.len
            ));
        }
        let flagged = self.member.iter().filter(|&&x| x).count();
        if flagged != self.len {
            return Err(format!(
                "{flagged} blocks flagged in the {what}, its length says {}",
                self.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_middle_and_front_pops_keep_the_links() {
        let mut l = IndexList::new(6, "test list").unwrap();
        for b in [3, 1, 4] {
            l.push_back(b).unwrap();
        }
        l.push_front(5).unwrap();
        assert_eq!(l.order(10), vec![5, 3, 1, 4]);
        assert_eq!((l.front(), l.back(), l.len()), (Some(5), Some(4), 4));
        assert_eq!(l.neighbours(1), (Some(3), Some(4)));
        assert!(l.remove(1) && !l.remove(1) && !l.contains(1));
        assert_eq!(l.pop_front(), Some(5));
        assert_eq!(l.order(10), vec![3, 4]);
        l.check("test list").unwrap();
        assert_eq!(
            (l.pop_front(), l.pop_front(), l.pop_front()),
            (Some(3), Some(4), None)
        );
        assert_eq!((l.front(), l.back(), l.len()), (None, None, 0));
        l.check("test list").unwrap();
    }

    #[test]
    fn check_names_a_broken_link() {
        let mut l = IndexList::new(4, "test list").unwrap();
        l.push_back(0).unwrap();
        l.push_back(2).unwrap();
        l.prev[2] = 3;
        assert!(l.check("test list").unwrap_err().contains("prev is 3"));
        l.prev[2] = 0;
        l.len = 3;
        assert!(l.check("test list").unwrap_err().contains("length says 3"));
    }

    /// Pushing a member again, at either end and wherever it sits, is a typed error that leaves
    /// the list as it was. Unchecked, pushing the tail at the back linked it to itself: the walk
    /// looped on it and `pop_front` handed it out twice.
    #[test]
    fn pushing_a_member_again_is_refused_and_changes_nothing() {
        let mut l = IndexList::new(5, "test list").unwrap();
        for b in [0, 1, 2] {
            l.push_back(b).unwrap();
        }
        let dbl = |b| Err(Error::RefcountUnderflow { block: b });
        for b in [0, 1, 2] {
            assert_eq!(l.push_back(b), dbl(b));
            assert_eq!(l.push_front(b), dbl(b));
        }
        assert_eq!(
            l.push_back(5),
            Err(Error::InvalidBlock {
                block: 5,
                num_blocks: 5
            })
        );
        assert_eq!(l.push_front(u32::MAX).map_err(|_| ()), Err(()));
        assert!(!l.contains(9) && !l.remove(9));
        assert_eq!((l.order(10), l.len()), (vec![0, 1, 2], 3));
        l.check("test list").unwrap();
        let popped: Vec<_> = std::iter::from_fn(|| l.pop_front()).collect();
        assert_eq!(popped, vec![0, 1, 2]);
        // Once off the list, a block may join again.
        l.push_front(1).unwrap();
        l.check("test list").unwrap();
    }
}
