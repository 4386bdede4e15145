//! The router's holder masks: block hash -> a bitmask of holder ids, and the block's token end.
//!
//! `Masks` is the table itself, in plain Rust (unit-tested by `cargo test`); `MaskTable` is
//! its Python face, with the methods of `kvledger.consumer.router.masks.MaskDict`, the
//! pure-Python twin that answers identically (tests/unit/test_masks.py drives both).
//!
//! Layout: open addressing with linear probing (load at most 1/2) and backward-shift
//! deletion; each slot holds a key's 64-bit hash and its row number. A row is one cache
//! line: the key (inline up to 32 bytes, the sizes block hashes come in), its token end and
//! its mask's first 64 bits; a mask's further words (when a holder id passes 64; widened
//! for every row at once) lie in an array beside the rows. A removed row is filled by the
//! last one, so rows stay dense and a whole-table scan (a holder's blocks, on a restart)
//! reads contiguous memory.
//!
//! A prompt walk probes one hash per position in a table of a million blocks, and each probe
//! misses the CPU caches: the walk hashes every position first and prefetches its slot,
//! then finds every candidate row and prefetches its key and mask, then checks the keys, so
//! the misses overlap instead of coming one after the other.
//!
//! Keys are hashed with foldhash under a seed drawn at random for each table: block hashes
//! come from the topic, and anyone who can write to it could craft keys that collide under
//! a fixed mix; under a secret seed crafted keys cost what random ones do.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use smallvec::SmallVec;

/// The largest holder id plus one (as the pure table's callers are held to).
pub const MAX_HOLDERS: usize = 1 << 20;

const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Slot {
    hash: u64,
    row: u32, // EMPTY: a free slot
}

const FREE: Slot = Slot {
    hash: 0,
    row: EMPTY,
};

type Key = SmallVec<[u8; 32]>;

#[inline(always)]
fn prefetch<T>(item: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it reads nothing and cannot fault.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((item as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = item;
}

/// One held block: its key, its token end and its mask's first word, in one cache line.
#[repr(align(64))]
struct Row {
    key: Key,
    end: i64,
    word: u64,
}

pub struct Masks {
    slots: Vec<Slot>, // a power of two
    rows: Vec<Row>,
    wide: Vec<u64>, // the masks' words past the first: rows.len() * (width - 1)
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
            slots: vec![FREE; 8],
            rows: Vec::new(),
            wide: Vec::new(),
            width: 1,
            seed: RandomState::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// The table's hash of a key (its seed is the table's own).
    pub fn hash_of(&self, key: &[u8]) -> u64 {
        self.seed.hash_one(key)
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `key` (Ok), or the free slot where it would go (Err), probing from
    /// slot `i`.
    fn probe(&self, mut i: usize, hash: u64, key: &[u8]) -> Result<usize, usize> {
        let m = self.mask();
        loop {
            let s = self.slots[i];
            if s.row == EMPTY {
                return Err(i);
            }
            if s.hash == hash && &self.rows[s.row as usize].key[..] == key {
                return Ok(i);
            }
            i = (i + 1) & m;
        }
    }

    fn slot_of(&self, hash: u64, key: &[u8]) -> Result<usize, usize> {
        self.probe(hash as usize & self.mask(), hash, key)
    }

    /// The row holding `key`.
    pub fn find(&self, key: &[u8]) -> Option<usize> {
        self.slot_of(self.hash_of(key), key)
            .ok()
            .map(|i| self.slots[i].row as usize)
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        let mut slots = vec![FREE; cap];
        for s in self.slots.iter().filter(|s| s.row != EMPTY) {
            let mut i = s.hash as usize & (cap - 1);
            while slots[i].row != EMPTY {
                i = (i + 1) & (cap - 1);
            }
            slots[i] = *s;
        }
        self.slots = slots;
    }

    fn widen(&mut self, bit: usize) {
        let mut width = self.width;
        while bit >= width * 64 {
            width *= 2;
        }
        if width == self.width {
            return;
        }
        let (old, new) = (self.width - 1, width - 1);
        let mut wide = vec![0u64; self.rows.len() * new];
        if old > 0 {
            for (row, words) in self.wide.chunks_exact(old).enumerate() {
                wide[row * new..row * new + old].copy_from_slice(words);
            }
        }
        self.wide = wide;
        self.width = width;
    }

    fn word_mut(&mut self, row: usize, k: usize) -> &mut u64 {
        if k == 0 {
            &mut self.rows[row].word
        } else {
            &mut self.wide[row * (self.width - 1) + k - 1]
        }
    }

    fn word(&self, row: usize, k: usize) -> u64 {
        if k == 0 {
            self.rows[row].word
        } else {
            self.wide[row * (self.width - 1) + k - 1]
        }
    }

    /// Holder `bit` holds `key`; whether `key` is new here.
    pub fn set_bit(&mut self, key: &[u8], bit: usize) -> bool {
        assert!(bit < MAX_HOLDERS, "a holder id is in [0, 2**20)");
        self.widen(bit);
        let hash = self.hash_of(key);
        let (row, new) = match self.slot_of(hash, key) {
            Ok(i) => (self.slots[i].row as usize, false),
            Err(mut i) => {
                if (self.rows.len() + 1) * 2 > self.slots.len() {
                    self.grow();
                    i = self.slot_of(hash, key).expect_err("a new key");
                }
                let row = self.rows.len();
                let row32 = u32::try_from(row).ok().filter(|&r| r != EMPTY);
                self.slots[i] = Slot {
                    hash,
                    row: row32.expect("fewer than 2**32 - 1 blocks"),
                };
                self.rows.push(Row {
                    key: Key::from_slice(key),
                    end: 0,
                    word: 0,
                });
                self.wide.resize(self.wide.len() + self.width - 1, 0);
                (row, true)
            }
        };
        *self.word_mut(row, bit / 64) |= 1u64 << (bit % 64);
        new
    }

    /// `key`'s token end, if `key` is held; whether it is.
    pub fn set_end(&mut self, key: &[u8], end: i64) -> bool {
        match self.find(key) {
            Some(row) => {
                self.rows[row].end = end;
                true
            }
            None => false,
        }
    }

    /// Holder `bit` no longer holds `key`; whether anyone still does.
    pub fn clear_bit(&mut self, key: &[u8], bit: usize) -> bool {
        let Ok(slot) = self.slot_of(self.hash_of(key), key) else {
            return false;
        };
        let row = self.slots[slot].row as usize;
        if bit < self.width * 64 {
            *self.word_mut(row, bit / 64) &= !(1u64 << (bit % 64));
        }
        if (0..self.width).any(|k| self.word(row, k) != 0) {
            return true;
        }
        self.delete_slot(slot);
        self.remove_row(row);
        false
    }

    /// Free slot `i`, pulling later entries of its run back into the hole.
    fn delete_slot(&mut self, mut i: usize) {
        let m = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & m;
            let s = self.slots[j];
            if s.row == EMPTY {
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
    }

    /// Drop `row` (its slot already freed): the last row moves into its place.
    fn remove_row(&mut self, row: usize) {
        let last = self.rows.len() - 1;
        let extra = self.width - 1;
        if row != last {
            let key = &self.rows[last].key[..];
            let at = self
                .slot_of(self.hash_of(key), key)
                .expect("every row has a slot");
            self.slots[at].row = row as u32;
            self.wide
                .copy_within(last * extra..(last + 1) * extra, row * extra);
        }
        self.rows.swap_remove(row);
        self.wide.truncate(last * extra);
    }

    pub fn has_bit(&self, key: &[u8], bit: usize) -> bool {
        match self.find(key) {
            Some(row) if bit < self.width * 64 => self.word(row, bit / 64) >> (bit % 64) & 1 == 1,
            _ => false,
        }
    }

    /// A row's mask words.
    pub fn words(&self, row: usize) -> Vec<u64> {
        (0..self.width).map(|k| self.word(row, k)).collect()
    }

    pub fn key(&self, row: usize) -> &[u8] {
        &self.rows[row].key
    }

    /// The rows holder `bit` holds.
    pub fn held_by(&self, bit: usize) -> Vec<usize> {
        if bit >= self.width * 64 {
            return Vec::new();
        }
        let (k, one) = (bit / 64, 1u64 << (bit % 64));
        (0..self.rows.len())
            .filter(|&row| self.word(row, k) & one != 0)
            .collect()
    }

    /// Every position's mask (n * width words, zero where nobody holds the hash) and its
    /// row's token end, the cache misses of all positions overlapped (see the module doc).
    fn prompt(&self, hashes: &[&[u8]], masks: &mut Vec<u64>, ends: &mut Vec<i64>) {
        let (w, m, n) = (self.width, self.mask(), hashes.len());
        let hs: Vec<u64> = hashes.iter().map(|k| self.hash_of(k)).collect();
        for &h in &hs {
            prefetch(&self.slots[h as usize & m]);
        }
        // A candidate per position: the first slot of its run with its full hash.
        let mut at: Vec<usize> = Vec::with_capacity(n);
        for &h in &hs {
            let mut i = h as usize & m;
            loop {
                let s = self.slots[i];
                if s.row == EMPTY || s.hash == h {
                    break;
                }
                i = (i + 1) & m;
            }
            let row = self.slots[i].row;
            if row != EMPTY {
                prefetch(&self.rows[row as usize]);
            }
            at.push(i);
        }
        masks.reserve(n * w);
        ends.reserve(n);
        for (k, key) in hashes.iter().enumerate() {
            let i = at[k];
            let found = match self.slots[i].row {
                EMPTY => None,
                row if &self.rows[row as usize].key[..] == *key => Some(row as usize),
                // the same 64-bit hash, another key: go on probing after it
                _ => self
                    .probe((i + 1) & m, hs[k], key)
                    .ok()
                    .map(|j| self.slots[j].row as usize),
            };
            match found {
                Some(row) => {
                    masks.push(self.rows[row].word);
                    let extra = w - 1;
                    masks.extend_from_slice(&self.wide[row * extra..(row + 1) * extra]);
                    ends.push(self.rows[row].end);
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
    pub fn runs(&self, hashes: &[&[u8]]) -> Vec<(usize, usize, i64)> {
        let (mut masks, mut ends) = (Vec::new(), Vec::new());
        self.prompt(hashes, &mut masks, &mut ends);
        runs_of(&masks, self.width)
            .into_iter()
            .map(|(hid, n)| (hid, n, ends[n - 1]))
            .collect()
    }

    /// As `runs`, with position i also covered by the last hash of the block it is in
    /// (`ratio` hashes a block); (holder id, run length).
    pub fn runs_covered(&self, hashes: &[&[u8]], ratio: usize) -> Vec<(usize, usize)> {
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
        assert_eq!(t.runs(&[x, y, z]), vec![(0, 2, 32)]);
        let mut covered = t.runs_covered(&[x, z], 2);
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
