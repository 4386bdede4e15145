//! An open-addressing table of (64-bit hash, row number) pairs: linear probing, load at most
//! one half, backward-shift deletion. A hash may be in it more than once (each pair is
//! distinct); callers compare what the rows hold. The hashes come already mixed under a
//! secret seed, so their low bits pick the slot.

use crate::masks::prefetch;

pub const NONE: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Slot {
    hash: u64,
    row: u32, // NONE: a free slot
}

const FREE: Slot = Slot { hash: 0, row: NONE };

pub struct Slots {
    slots: Vec<Slot>, // a power of two
    used: usize,
}

impl Default for Slots {
    fn default() -> Self {
        Slots {
            slots: vec![FREE; 8],
            used: 0,
        }
    }
}

impl Slots {
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// A hint that `hash` is looked up soon.
    pub fn prefetch(&self, hash: u64) {
        prefetch(&self.slots[hash as usize & self.mask()]);
    }

    /// The rows stored under `hash`, in probe order.
    pub fn rows(&self, hash: u64) -> Rows<'_> {
        Rows {
            slots: self,
            at: hash as usize & self.mask(),
            hash,
        }
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        let mut slots = vec![FREE; cap];
        for s in self.slots.iter().filter(|s| s.row != NONE) {
            let mut i = s.hash as usize & (cap - 1);
            while slots[i].row != NONE {
                i = (i + 1) & (cap - 1);
            }
            slots[i] = *s;
        }
        self.slots = slots;
    }

    pub fn insert(&mut self, hash: u64, row: u32) {
        if (self.used + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let m = self.mask();
        let mut i = hash as usize & m;
        while self.slots[i].row != NONE {
            i = (i + 1) & m;
        }
        self.slots[i] = Slot { hash, row };
        self.used += 1;
    }

    /// Point the pair (hash, row) at another row.
    pub fn replace(&mut self, hash: u64, row: u32, to: u32) {
        if let Some(i) = self.position(hash, row) {
            self.slots[i].row = to;
        }
    }

    fn position(&self, hash: u64, row: u32) -> Option<usize> {
        let m = self.mask();
        let mut i = hash as usize & m;
        loop {
            let s = self.slots[i];
            if s.row == NONE {
                return None;
            }
            if s.hash == hash && s.row == row {
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
            let home = s.hash as usize & m;
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
    hash: u64,
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
            if s.hash == self.hash {
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
        let mut t = Slots::default();
        for i in 0..10_000u32 {
            t.insert(u64::from(i % 97) << 7, i); // many rows per hash, runs that collide
        }
        for i in (0..10_000u32).step_by(3) {
            t.remove(u64::from(i % 97) << 7, i);
        }
        for h in 0..97u64 {
            let mut got: Vec<u32> = t.rows(h << 7).collect();
            got.sort();
            let want: Vec<u32> = (0..10_000u32)
                .filter(|i| i % 97 == h as u32 && i % 3 != 0)
                .collect();
            assert_eq!(got, want, "hash {h}");
        }
        assert_eq!(t.used, 10_000 - 3334);
    }
}
