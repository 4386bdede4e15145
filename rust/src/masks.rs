//! The router's holder masks: block hash -> a bitmask of holder ids, and the block's token end.
//!
//! `Masks` is the table itself, in plain Rust (unit-tested by `cargo test`); `MaskTable` is
//! its Python face, with the methods of `kvledger.consumer.router.masks.MaskDict`, the
//! pure-Python twin that answers identically (tests/unit/test_masks.py drives both).
//!
//! Layout: a SwissTable of row numbers (`hashbrown::HashTable<u32>`), and per row the key,
//! its token end and its mask as `width` 64-bit words (widened for every row at once when a
//! holder id passes `64 * width`). A removed row is filled by the last one, so rows stay
//! dense and a whole-table scan (a holder's blocks, on a restart) reads contiguous memory.
//!
//! Keys are hashed with foldhash under a seed drawn at random for each table: block hashes
//! come from the topic, and anyone who can write to it could craft keys that collide under
//! a fixed mix; under a secret seed crafted keys cost what random ones do.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

/// The largest holder id plus one (as the pure table's callers are held to).
pub const MAX_HOLDERS: usize = 1 << 20;

pub struct Masks {
    index: HashTable<u32>,
    keys: Vec<Box<[u8]>>,
    ends: Vec<i64>,
    bits: Vec<u64>, // keys.len() * width words
    width: usize,
    seed: RandomState,
}

impl Default for Masks {
    fn default() -> Self {
        Self::new()
    }
}

impl Masks {
    pub fn new() -> Self {
        Masks {
            index: HashTable::new(),
            keys: Vec::new(),
            ends: Vec::new(),
            bits: Vec::new(),
            width: 1,
            seed: RandomState::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// The table's hash of a key (its seed is the table's own).
    pub fn hash_of(&self, key: &[u8]) -> u64 {
        self.seed.hash_one(key)
    }

    /// The row holding `key`.
    pub fn find(&self, key: &[u8]) -> Option<usize> {
        let keys = &self.keys;
        self.index
            .find(self.hash_of(key), |&row| &*keys[row as usize] == key)
            .map(|&row| row as usize)
    }

    fn widen(&mut self, bit: usize) {
        let mut width = self.width;
        while bit >= width * 64 {
            width *= 2;
        }
        if width == self.width {
            return;
        }
        let mut bits = vec![0u64; self.keys.len() * width];
        for (row, words) in self.bits.chunks_exact(self.width).enumerate() {
            bits[row * width..row * width + self.width].copy_from_slice(words);
        }
        self.bits = bits;
        self.width = width;
    }

    /// Holder `bit` holds `key`; whether `key` is new here.
    pub fn set_bit(&mut self, key: &[u8], bit: usize) -> bool {
        assert!(bit < MAX_HOLDERS, "a holder id is in [0, 2**20)");
        self.widen(bit);
        let (row, new) = match self.find(key) {
            Some(row) => (row, false),
            None => {
                let row = self.keys.len();
                let row32 = u32::try_from(row).expect("fewer than 2**32 blocks in one table");
                let hash = self.hash_of(key);
                let (keys, seed) = (&self.keys, &self.seed);
                self.index
                    .insert_unique(hash, row32, |&r| seed.hash_one(&*keys[r as usize]));
                self.keys.push(key.into());
                self.ends.push(0);
                self.bits.resize(self.bits.len() + self.width, 0);
                (row, true)
            }
        };
        self.bits[row * self.width + bit / 64] |= 1u64 << (bit % 64);
        new
    }

    /// `key`'s token end, if `key` is held; whether it is.
    pub fn set_end(&mut self, key: &[u8], end: i64) -> bool {
        match self.find(key) {
            Some(row) => {
                self.ends[row] = end;
                true
            }
            None => false,
        }
    }

    /// Holder `bit` no longer holds `key`; whether anyone still does.
    pub fn clear_bit(&mut self, key: &[u8], bit: usize) -> bool {
        let Some(row) = self.find(key) else {
            return false;
        };
        let w = self.width;
        if bit < w * 64 {
            self.bits[row * w + bit / 64] &= !(1u64 << (bit % 64));
        }
        if self.bits[row * w..(row + 1) * w].iter().any(|&x| x != 0) {
            return true;
        }
        self.remove_row(row);
        false
    }

    /// Drop `row`: the last row moves into its place (its index entry follows it).
    fn remove_row(&mut self, row: usize) {
        let hash = self.hash_of(&self.keys[row]);
        match self.index.find_entry(hash, |&r| r as usize == row) {
            Ok(entry) => {
                entry.remove();
            }
            Err(_) => unreachable!("every row is in the index"),
        }
        let last = self.keys.len() - 1;
        if row != last {
            let moved = self.hash_of(&self.keys[last]);
            if let Some(slot) = self.index.find_mut(moved, |&r| r as usize == last) {
                *slot = row as u32;
            }
            let w = self.width;
            self.bits.copy_within(last * w..(last + 1) * w, row * w);
        }
        self.keys.swap_remove(row);
        self.ends.swap_remove(row);
        self.bits.truncate(last * self.width);
    }

    pub fn has_bit(&self, key: &[u8], bit: usize) -> bool {
        match self.find(key) {
            Some(row) if bit < self.width * 64 => {
                self.bits[row * self.width + bit / 64] >> (bit % 64) & 1 == 1
            }
            _ => false,
        }
    }

    /// A row's mask words.
    pub fn words(&self, row: usize) -> &[u64] {
        &self.bits[row * self.width..(row + 1) * self.width]
    }

    pub fn key(&self, row: usize) -> &[u8] {
        &self.keys[row]
    }

    /// The rows holder `bit` holds.
    pub fn held_by(&self, bit: usize) -> Vec<usize> {
        if bit >= self.width * 64 {
            return Vec::new();
        }
        let (word, one) = (bit / 64, 1u64 << (bit % 64));
        (0..self.keys.len())
            .filter(|&row| self.bits[row * self.width + word] & one != 0)
            .collect()
    }

    /// Every position's mask (n * width words, zero where nobody holds the hash) and its
    /// row's token end.
    fn prompt<'a, I>(&self, hashes: I, masks: &mut Vec<u64>, ends: &mut Vec<i64>)
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let w = self.width;
        for key in hashes {
            match self.find(key) {
                Some(row) => {
                    masks.extend_from_slice(self.words(row));
                    ends.push(self.ends[row]);
                }
                None => {
                    masks.resize(masks.len() + w, 0);
                    ends.push(0);
                }
            }
        }
    }

    /// (holder id, run length, token end of the run's last position) for every holder of
    /// the first hash: the longest stretch of positions 1, 2, ... each holder holds.
    pub fn runs<'a, I>(&self, hashes: I) -> Vec<(usize, usize, i64)>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let (mut masks, mut ends) = (Vec::new(), Vec::new());
        self.prompt(hashes, &mut masks, &mut ends);
        runs_of(&masks, self.width)
            .into_iter()
            .map(|(hid, n)| (hid, n, ends[n - 1]))
            .collect()
    }

    /// As `runs`, with position i also covered by the last hash of the block it is in
    /// (`ratio` hashes a block); (holder id, run length).
    pub fn runs_covered<'a, I>(&self, hashes: I, ratio: usize) -> Vec<(usize, usize)>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        assert!(ratio > 0, "ratio must be positive");
        let (mut masks, mut ends) = (Vec::new(), Vec::new());
        self.prompt(hashes, &mut masks, &mut ends);
        let (w, n) = (self.width, ends.len());
        for i in 0..n {
            let end = (i / ratio + 1) * ratio;
            if end <= n && end - 1 != i {
                for k in 0..w {
                    masks[i * w + k] |= masks[(end - 1) * w + k];
                }
            }
        }
        runs_of(&masks, w)
    }
}

/// (holder id, run length) for every holder covering position 1, from per-position masks
/// of `w` words each.
pub fn runs_of(masks: &[u64], w: usize) -> Vec<(usize, usize)> {
    let n = masks.len() / w;
    let mut out = Vec::new();
    if n == 0 {
        return out;
    }
    let mut alive = masks[..w].to_vec();
    let mut i = 1;
    while i < n && alive.iter().any(|&x| x != 0) {
        for k in 0..w {
            let still = alive[k] & masks[i * w + k];
            let mut gone = alive[k] & !still;
            while gone != 0 {
                out.push((k * 64 + gone.trailing_zeros() as usize, i));
                gone &= gone - 1;
            }
            alive[k] = still;
        }
        i += 1;
    }
    for (k, &word) in alive.iter().enumerate() {
        let mut left = word;
        while left != 0 {
            out.push((k * 64 + left.trailing_zeros() as usize, i));
            left &= left - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> Vec<u8> {
        i.to_le_bytes().to_vec()
    }

    #[test]
    fn runs_stop_where_each_holder_stops() {
        assert_eq!(
            runs_of(&[0b111, 0b101, 0b100, 0b110], 1),
            vec![(1, 1), (0, 2), (2, 4)]
        );
        assert!(runs_of(&[0, 1], 1).is_empty() && runs_of(&[], 1).is_empty());
    }

    #[test]
    fn rows_stay_findable_through_growth_widening_and_removal() {
        let mut t = Masks::new();
        for i in 0..5000u64 {
            assert!(t.set_bit(&key(i), (i % 130) as usize));
        }
        assert_eq!(t.width(), 4);
        for i in (0..5000u64).step_by(2) {
            assert!(!t.clear_bit(&key(i), (i % 130) as usize));
        }
        assert_eq!(t.len(), 2500);
        for i in 0..5000u64 {
            assert_eq!(
                t.has_bit(&key(i), (i % 130) as usize),
                i % 2 == 1,
                "key {i}"
            );
        }
        assert!(!t.clear_bit(&key(0), 0), "a key no one holds");
    }

    #[test]
    fn a_walk_reports_each_holders_run_and_its_token_end() {
        let mut t = Masks::new();
        let (x, y, z) = (b"x".as_slice(), b"y".as_slice(), b"z".as_slice());
        t.set_bit(x, 0);
        t.set_bit(y, 0);
        t.set_bit(z, 1);
        assert!(t.set_end(y, 32) && !t.set_end(b"w", 1));
        assert_eq!(t.runs([x, y, z]), vec![(0, 2, 32)]);
        let mut covered = t.runs_covered([x, z], 2);
        covered.sort();
        assert_eq!(covered, vec![(0, 1), (1, 2)]);
    }

    #[test]
    fn two_tables_hash_under_two_seeds() {
        let (a, b) = (Masks::new(), Masks::new());
        let same = (0..64u64)
            .filter(|&i| a.hash_of(&key(i)) == b.hash_of(&key(i)))
            .count();
        assert_eq!(same, 0);
    }
}
