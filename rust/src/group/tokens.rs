//! Each block's token ids, packed in one arena per group: a block's ids take 2, 3 or 4
//! bytes each, the fewest that hold its largest id (as u32 bits), little-endian. A
//! vocabulary under 65,536 ids takes half the bytes of int32s, one under 16.7 M (Llama 3's
//! 128,256, Qwen's 151,936) three quarters. A block starts on a 4-byte boundary, so a row
//! names its place in words (a u32 reaches 16 GiB of tokens).

use smallvec::SmallVec;

/// A block's ids, decoded (a block of up to 64 ids on the stack).
pub(super) type Ids = SmallVec<[i32; 64]>;

#[derive(Default)]
pub(super) struct Arena {
    bytes: Vec<u8>, // a multiple of 4 long
}

/// The bytes a token takes for a block whose ids are `tokens`.
fn width_of(tokens: &[i32]) -> u8 {
    let top = tokens.iter().fold(0u32, |m, &t| m.max(t as u32));
    match top {
        0..=0xFFFF => 2,
        0x1_0000..=0xFF_FFFF => 3,
        _ => 4,
    }
}

/// The 4-byte words `len` ids of `width` bytes take.
pub(super) fn words(len: u32, width: u8) -> usize {
    (len as usize * width as usize).div_ceil(4)
}

impl Arena {
    /// How many 4-byte words the arena holds.
    pub(super) fn len_words(&self) -> usize {
        self.bytes.len() / 4
    }

    /// Keep a block's ids: (the word it starts at, its width).
    pub(super) fn put(&mut self, tokens: &[i32]) -> (u32, u8) {
        let off = u32::try_from(self.len_words()).expect("fewer than 2**32 token words a group");
        let width = width_of(tokens);
        let at = self.bytes.len();
        self.bytes
            .resize(at + words(tokens.len() as u32, width) * 4, 0);
        let out = &mut self.bytes[at..];
        match width {
            2 => {
                for (o, &t) in out.chunks_exact_mut(2).zip(tokens) {
                    o.copy_from_slice(&(t as u16).to_le_bytes());
                }
            }
            3 => {
                for (o, &t) in out.chunks_exact_mut(3).zip(tokens) {
                    o.copy_from_slice(&(t as u32).to_le_bytes()[..3]);
                }
            }
            _ => {
                for (o, &t) in out.chunks_exact_mut(4).zip(tokens) {
                    o.copy_from_slice(&t.to_le_bytes());
                }
            }
        }
        (off, width)
    }

    /// The packed bytes of a block.
    pub(super) fn bytes(&self, off: u32, len: u32, width: u8) -> &[u8] {
        let at = off as usize * 4;
        &self.bytes[at..at + len as usize * width as usize]
    }

    /// A hint that a block's ids are read soon.
    pub(super) fn prefetch(&self, off: u32) {
        self.prefetch_after(off, 0);
    }

    /// A hint that the ids `words` 4-byte words after word `off` are read soon.
    pub(super) fn prefetch_after(&self, off: u32, words: usize) {
        if let Some(b) = self.bytes.get((off as usize + words) * 4) {
            crate::masks::prefetch(b);
        }
    }

    /// Whether a block's ids are `want` (no call per id: a block is a few dozen).
    #[inline]
    pub(super) fn same(&self, off: u32, len: u32, width: u8, want: &[i32]) -> bool {
        if want.len() != len as usize {
            return false;
        }
        let b = self.bytes(off, len, width);
        let eq = |c: &[u8], w: i32| u32::from_le_bytes([c[0], c[1], c[2], 0]) == w as u32;
        match width {
            2 => b.chunks_exact(2).zip(want).fold(true, |same, (c, &w)| {
                same & (u32::from(u16::from_le_bytes([c[0], c[1]])) == w as u32)
            }),
            3 => b
                .chunks_exact(3)
                .zip(want)
                .fold(true, |same, (c, &w)| same & eq(c, w)),
            _ => b.chunks_exact(4).zip(want).fold(true, |same, (c, &w)| {
                same & (i32::from_le_bytes([c[0], c[1], c[2], c[3]]) == w)
            }),
        }
    }

    /// A block's ids.
    pub(super) fn ids(&self, off: u32, len: u32, width: u8) -> Ids {
        let b = self.bytes(off, len, width);
        let mut out = Ids::from_elem(0, len as usize); // then filled: no push per id
        match width {
            2 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = i32::from(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            3 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(3)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], 0]) as i32;
                }
            }
            _ => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
        out
    }

    /// The arena again with only the blocks `keep` gives (each block's word, ids and width;
    /// the new word of each is handed back in order through `moved`).
    pub(super) fn compacted(
        &self,
        keep: impl Iterator<Item = (u32, u32, u8)>,
        mut moved: impl FnMut(u32),
        words_kept: usize,
    ) -> Arena {
        let mut bytes = Vec::with_capacity(words_kept * 4);
        for (off, len, width) in keep {
            moved((bytes.len() / 4) as u32);
            bytes.extend_from_slice(self.bytes(off, len, width));
            bytes.resize(bytes.len().next_multiple_of(4), 0);
        }
        Arena { bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_back_at_every_width_and_compare_exactly() {
        let mut a = Arena::default();
        let blocks: [&[i32]; 5] = [
            &[1, 2, 65_535],
            &[1, 65_536, 3],
            &[0xFF_FFFF, 7],
            &[-1, 5, 0x100_0000],
            &[],
        ];
        let places: Vec<(u32, u8)> = blocks.iter().map(|b| a.put(b)).collect();
        assert_eq!(
            places.iter().map(|p| p.1).collect::<Vec<_>>(),
            [2, 3, 3, 4, 2]
        );
        for (b, &(off, width)) in blocks.iter().zip(&places) {
            let len = b.len() as u32;
            assert_eq!(&a.ids(off, len, width)[..], *b);
            assert!(a.same(off, len, width, b));
            let mut other = b.to_vec();
            if let Some(last) = other.last_mut() {
                *last ^= 1 << 20; // a bit the width may not hold
                assert!(!a.same(off, len, width, &other));
            }
            assert!(!a.same(off, len, width, &[b, &[0][..]].concat()));
        }
        assert_eq!(a.len_words() * 4, a.bytes.len());
    }
}
