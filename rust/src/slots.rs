//! An open-addressing table of (hash, row number) pairs: linear probing, load at most three
//! quarters (a probe that finds nothing reads about 8 slots there, 64 bytes: a cache line
//! or two; [`Slots::dense`]: seven eighths, for a table read less often than it is kept:
//! about 32 slots then, in half the memory where the count falls just past a power of
//! two), backward-shift deletion. A hash may be in it more than once (each pair is
//! distinct). The hashes come already mixed under a secret seed: their high 32 bits are
//! kept in the slot as its tag (8 bytes a slot), so a lookup yields the rows whose tag
//! matches and callers compare what the rows hold; the tag's top bits pick the home slot.
//! So an entry's home is in its slot: deleting needs no row read, and growing walks the old
//! table in order, writing the new one in order (slot i's entries go to 2i or 2i + 1): no
//! random write, no row read, no hash made again.

use crate::masks::prefetch;

pub const NONE: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Slot {
    tag: u32, // the hash's high 32 bits
    row: u32, // NONE: a free slot
}

const FREE: Slot = Slot { tag: 0, row: NONE };

fn tag(hash: u64) -> u32 {
    (hash >> 32) as u32
}

pub struct Slots {
    slots: Vec<Slot>, // a power of two, at most 2**32
    used: usize,
    shift: u32,     // 32 - log2(slots.len()): a tag's home is its top log2(len) bits
    eighths: usize, // the most load, in eighths of the slots
}

impl Default for Slots {
    fn default() -> Self {
        Slots {
            slots: vec![FREE; 8],
            used: 0,
            shift: 29,
            eighths: 6,
        }
    }
}

impl Slots {
    /// A table loaded up to seven eighths (see the module's comment).
    pub fn dense() -> Self {
        Slots {
            eighths: 7,
            ..Slots::default()
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        (u64::from(tag) >> self.shift) as usize
    }

    /// A hint that `hash` is looked up soon.
    pub fn prefetch(&self, hash: u64) {
        prefetch(&self.slots[self.home(tag(hash))]);
    }

    /// The rows stored under `hash`'s tag, in probe order (those of `hash` among them).
    pub fn rows(&self, hash: u64) -> Rows<'_> {
        let tag = tag(hash);
        Rows {
            slots: self,
            at: self.home(tag),
            tag,
        }
    }

    /// Whether one more pair needs a larger table (`grow` first).
    pub fn full(&self) -> bool {
        (self.used + 1) * 8 > self.slots.len() * self.eighths
    }

    /// The table again, twice as large, with the same pairs: the old slots read in order,
    /// each entry written at its new home (twice its old one, or one past) or just after.
    pub fn grow(&mut self) {
        assert!(self.shift > 0, "at most 2**32 slots in one table");
        let bigger = vec![FREE; self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, bigger);
        self.shift -= 1;
        for s in old {
            if s.row != NONE {
                self.place(s);
            }
        }
    }

    fn place(&mut self, s: Slot) {
        let m = self.mask();
        let mut i = self.home(s.tag);
        while self.slots[i].row != NONE {
            i = (i + 1) & m;
        }
        self.slots[i] = s;
    }

    /// Add the pair (hash, row) (the table has room: see `full`).
    pub fn insert(&mut self, hash: u64, row: u32) {
        assert!(
            self.used < self.slots.len() - 1,
            "a full table: grow it first"
        );
        self.place(Slot {
            tag: tag(hash),
            row,
        });
        self.used += 1;
    }

    fn position(&self, hash: u64, row: u32) -> Option<usize> {
        let m = self.mask();
        let mut i = self.home(tag(hash));
        loop {
            let s = self.slots[i];
            if s.row == NONE {
                return None;
            }
            if s.row == row {
                return Some(i);
            }
            i = (i + 1) & m;
        }
    }

    /// Remove the pair (hash, row), if it is there.
    pub fn remove(&mut self, hash: u64, row: u32) {
        let Some(mut i) = self.position(hash, row) else {
            return;
        };
        let m = self.mask();
        let mut j = i;
        loop {
            // backward shift: pull later entries of the run into the hole
            j = (j + 1) & m;
            let s = self.slots[j];
            if s.row == NONE {
                break;
            }
            let home = self.home(s.tag);
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = FREE;
        self.used -= 1;
    }
}

pub struct Rows<'a> {
    slots: &'a Slots,
    at: usize,
    tag: u32,
}

impl Iterator for Rows<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let m = self.slots.mask();
        loop {
            let s = self.slots.slots[self.at];
            if s.row == NONE {
                return None;
            }
            self.at = (self.at + 1) & m;
            if s.tag == self.tag {
                return Some(s.row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_survive_growth_and_removal_in_any_order() {
        // many rows per hash, runs that collide, tags that differ from the home slot's bits
        let hash = |row: u32| (u64::from(row % 97) << 40) | (u64::from(row % 97) << 7);
        let mut t = Slots::default();
        for i in 0..10_000u32 {
            if t.full() {
                t.grow();
            }
            t.insert(hash(i), i);
        }
        for i in (0..10_000u32).step_by(3) {
            t.remove(hash(i), i);
        }
        for h in 0..97u32 {
            let mut got: Vec<u32> = t.rows(hash(h)).collect();
            got.sort();
            let want: Vec<u32> = (0..10_000u32)
                .filter(|i| i % 97 == h && i % 3 != 0)
                .collect();
            assert_eq!(got, want, "hash {h}");
        }
        assert_eq!(t.used, 10_000 - 3334);
    }

    #[test]
    fn a_dense_table_holds_seven_eighths_before_it_grows() {
        let (mut loose, mut dense) = (Slots::default(), Slots::dense());
        for i in 0..14u32 {
            for t in [&mut loose, &mut dense] {
                if t.full() {
                    t.grow();
                }
                t.insert(u64::from(i) << 40, i);
            }
        }
        assert_eq!((loose.slots.len(), dense.slots.len()), (32, 16));
        assert_eq!(dense.rows(5 << 40).collect::<Vec<_>>(), vec![5]);
    }
}
