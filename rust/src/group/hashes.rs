//! The walk by hashes: a prompt's block hashes, one probe per position (every position's
//! cache misses overlapped, consecutive rows followed without one), and each holder's run
//! over them, at block or hash granularity.

use super::{is_key, Group, Run, LEVELS_AT_ONCE, NONE};
use crate::masks::{prefetch, runs_of};

impl Group {
    /// The rows of a prompt's hashes (NONE where the group has none), the cache misses of
    /// every position overlapped.
    pub(super) fn rows_of(&self, hashes: &[&[u8]]) -> Vec<u32> {
        self.rows_hashed(hashes, |i| self.hash_of(hashes[i]))
    }

    /// `rows_of`, with the hash of position i made by `hash(i)` where it is probed.
    pub(super) fn rows_hashed(&self, hashes: &[&[u8]], hash: impl Fn(usize) -> u64) -> Vec<u32> {
        // Blocks stored together sit in consecutive rows (an engine stores a prompt's
        // blocks in one event): while the row after the one found at the position before
        // is this position's, it needs no probe. Past the first that is not, all are probed.
        let mut out = Vec::with_capacity(hashes.len());
        let Some(first) = hashes.first() else {
            return out;
        };
        let mut row = self.find_hashed(first, || hash(0)).unwrap_or(NONE);
        out.push(row);
        while out.len() < hashes.len() {
            let Some(next) = self.row_after(row, hashes[out.len()]) else {
                break;
            };
            out.push(next);
            row = next;
        }
        let rest = out.len();
        let hs: Vec<u64> = (rest..hashes.len()).map(hash).collect();
        out.extend(self.probe_hashed(&hashes[rest..], &hs));
        out
    }

    /// Each hash's row (NONE: not held), every probe issued before any is read.
    fn probe_rows(&self, hashes: &[&[u8]]) -> Vec<u32> {
        let hs: Vec<u64> = hashes.iter().map(|k| self.hash_of(k)).collect();
        self.probe_hashed(hashes, &hs)
    }

    /// `probe_rows`, given the hashes' hashes (`hs`).
    fn probe_hashed(&self, hashes: &[&[u8]], hs: &[u64]) -> Vec<u32> {
        if hashes.is_empty() {
            return Vec::new();
        }
        for &h in hs {
            self.index.prefetch(h);
        }
        let first: Vec<u32> = hs
            .iter()
            .map(|&h| self.index.rows(h).next().unwrap_or(NONE))
            .collect();
        for &row in &first {
            if row != NONE {
                prefetch(&self.rows[row as usize]);
            }
        }
        hashes
            .iter()
            .zip(first)
            .map(|(key, row)| match row {
                NONE => NONE,
                row if is_key(&self.rows[row as usize], key, &self.longs) => row,
                _ => self.find(key).unwrap_or(NONE), // the same 64-bit hash, another key
            })
            .collect()
    }

    fn masks_of(&self, rows: &[u32]) -> Vec<u64> {
        let w = self.width;
        let mut out = Vec::with_capacity(rows.len() * w);
        for &row in rows {
            if row == NONE {
                out.resize(out.len() + w, 0);
            } else {
                out.extend((0..w).map(|k| self.word(row, k)));
            }
        }
        out
    }

    fn runs_over(&self, rows: &[u32]) -> Vec<Run> {
        runs_of(&self.masks_of(rows), self.width)
            .into_iter()
            .map(|(hid, n)| {
                (
                    hid,
                    n,
                    if rows[n - 1] == NONE {
                        0
                    } else {
                        self.end(rows[n - 1])
                    },
                )
            })
            .collect()
    }

    /// Block granularity: (holder, run length, token end of the run's last block).
    pub fn runs(&self, hashes: &[&[u8]]) -> Vec<Run> {
        match self.width {
            1 => self.runs_of_width::<1>(hashes),
            2 => self.runs_of_width::<2>(hashes),
            3 => self.runs_of_width::<3>(hashes),
            4 => self.runs_of_width::<4>(hashes),
            _ => self.runs_over(&self.rows_of(hashes)),
        }
    }

    /// `runs_over(rows_of(hashes))` in one pass for groups of `W` holder words, which
    /// stops as soon as no holder runs on: a prompt's positions past its longest match are
    /// never probed.
    fn runs_of_width<const W: usize>(&self, hashes: &[&[u8]]) -> Vec<Run> {
        debug_assert_eq!(W, self.width);
        let n = hashes.len();
        let mut out = Vec::new();
        let mut alive = [0u64; W];
        let mut ahead: Vec<u32> = Vec::new(); // rows probed for the positions from `next`
        let mut next = 0;
        let mut last = NONE; // the row at the position before
        let mut probed = false; // whether it took a probe to find
        for (i, key) in hashes.iter().enumerate() {
            let row = if next < ahead.len() {
                next += 1;
                ahead[next - 1]
            } else if let Some(row) = self.row_after(last, key) {
                probed = false;
                if let Some(ahead) = self.rows.get(row as usize + 4) {
                    prefetch(ahead); // the rows a consecutive walk reads next
                }
                row
            } else if !probed {
                // One probe: past a prompt's match there is nothing to find, and after it
                // the rows may run on consecutively again.
                probed = true;
                self.find(key).unwrap_or(NONE)
            } else {
                // Rows stored apart: the next positions' probes issued together.
                ahead = self.probe_rows(&hashes[i..(i + LEVELS_AT_ONCE).min(n)]);
                next = 1;
                ahead[0]
            };
            let mut words = [0u64; W];
            if row != NONE {
                words[0] = self.rows[row as usize].word;
                if W > 1 {
                    let wide = row as usize * (W - 1);
                    words[1..].copy_from_slice(&self.wide[wide..wide + W - 1]);
                }
            }
            let mut any = 0;
            for k in 0..W {
                let still = if i == 0 {
                    words[k]
                } else {
                    alive[k] & words[k]
                };
                let mut gone = alive[k] & !still;
                while gone != 0 {
                    out.push((k * 64 + gone.trailing_zeros() as usize, i, self.end(last)));
                    gone &= gone - 1;
                }
                alive[k] = still;
                any |= still;
            }
            if any == 0 {
                return out;
            }
            last = row;
        }
        for (k, &word) in alive.iter().enumerate() {
            let mut left = word;
            while left != 0 {
                out.push((k * 64 + left.trailing_zeros() as usize, n, self.end(last)));
                left &= left - 1;
            }
        }
        out
    }

    /// The row after `row`, if it is `key`'s (blocks stored together sit in consecutive
    /// rows): found without a probe.
    #[inline]
    fn row_after(&self, row: u32, key: &[u8]) -> Option<u32> {
        // A freed row's key is empty: a key that is not can only be a live row's.
        if row == NONE || key.is_empty() {
            return None;
        }
        let next = row + 1;
        let r = self.rows.get(next as usize)?;
        is_key(r, key, &self.longs).then_some(next)
    }

    /// Hash granularity (`ratio` hashes a block): position i is also covered by the last
    /// hash of its block; (holder, run length).
    pub fn runs_covered(&self, hashes: &[&[u8]], ratio: usize) -> Vec<(usize, usize)> {
        assert!(ratio > 0, "ratio must be positive");
        let rows = self.rows_of(hashes);
        let mut masks = self.masks_of(&rows);
        let (w, n) = (self.width, rows.len());
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
