//! NVIDIA Dynamo's view of a group: each full block's Dynamo local hash (XXH3-64 of its
//! token ids as little-endian u32, under Dynamo's seed, LoRA mixed in), and a walk of a
//! prompt by those hashes, as Dynamo's indexer keys its tree.
//!
//! Kept only once a group is asked to ([`Group::enable_dynamo`]: `serve --dynamo-api`): a
//! slot table of (parent row, local hash) -> row, and nothing per row: a row's local hash
//! is computed again from its tokens where it is needed (a walk's check of a candidate,
//! the row's removal), which costs less than keeping it. The table's keys are
//! mixed under the group's secret seed, so although Dynamo's hash is public (and XXH3
//! collisions are cheap to make), no one can aim rows at one slot run but by giving them
//! the same parent and the same local hash, and those are, for Dynamo, one node anyway.

use std::collections::HashMap;
use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use smallvec::SmallVec;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::{Group, DYNAMO, NONE, PARTIAL, PLAIN, STORED};
use crate::slots::Slots;

/// Dynamo's base seed for block hashes.
const SEED: u64 = 1337;

/// Dynamo's seed for a LoRA adapter's blocks (an empty name counts as none).
pub fn seed_for(lora: Option<&str>) -> u64 {
    match lora {
        Some(name) if !name.is_empty() => SEED.wrapping_add(xxh3_64(name.as_bytes())),
        _ => SEED,
    }
}

/// Dynamo's local hash of one block's token ids.
pub fn local_hash(tokens: &[i32], seed: u64) -> u64 {
    // The ids as u32 LE bytes: a block of up to 64 tokens on the stack, a bigger one on
    // the heap; one copy loop the compiler vectorizes.
    let mut small = [0u8; 256];
    let mut large = Vec::new();
    let bytes: &mut [u8] = if tokens.len() <= 64 {
        &mut small[..tokens.len() * 4]
    } else {
        large.resize(tokens.len() * 4, 0);
        &mut large
    };
    for (out, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        out.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(bytes, seed)
}

pub(super) struct Dynamo {
    index: Slots, // seed-mixed (parent row, local hash) -> row: read by /query walks only
}

impl Default for Dynamo {
    fn default() -> Self {
        Dynamo {
            index: Slots::dense(),
        }
    }
}

impl Group {
    fn dynamo_key(&self, parent: u32, local: u64) -> u64 {
        self.seed.hash_one((parent, local))
    }

    /// The row's Dynamo local hash: it has content, a full block, no extra keys.
    pub(super) fn local_of(&self, row: u32) -> Option<u64> {
        let (r, shape) = (&self.rows[row as usize], self.shape(row));
        let full = shape.block_size > 0 && r.tok_len == shape.block_size as u32;
        let plain = r.flags & PLAIN != 0 && shape.salt == 0; // a salt is an extra key to Dynamo
        if r.flags & STORED == 0 || !plain || r.flags & PARTIAL != 0 || !full {
            return None;
        }
        let lora = self.name(shape.lora);
        Some(local_hash(&self.row_tokens(row), seed_for(lora)))
    }

    /// The local hash of a row in Dynamo's table, from its tokens and its adapter as they
    /// were when it went in (a change to either takes it out first).
    fn kept_local(&self, row: u32) -> u64 {
        let lora = self.name(self.shape(row).lora);
        local_hash(&self.row_tokens(row), seed_for(lora))
    }

    /// Keep Dynamo's hashes from now on (those of the rows already here included).
    pub fn enable_dynamo(&mut self) {
        if self.dynamo.is_some() {
            return;
        }
        self.dynamo = Some(Box::default());
        for row in 0..self.rows.len() as u32 {
            if self.rows[row as usize].flags & STORED != 0 {
                self.dynamo_add(row);
            }
        }
    }

    pub fn dynamo_enabled(&self) -> bool {
        self.dynamo.is_some()
    }

    /// The Dynamo local hash of a block (None: not a full plain block with content).
    pub fn dynamo_local(&self, key: &[u8]) -> Option<u64> {
        self.local_of(self.find(key)?)
    }

    /// Before a change to `row`'s content, parent or metadata: its entry out of the table.
    pub(super) fn dynamo_drop(&mut self, row: u32) {
        if self.rows[row as usize].flags & DYNAMO == 0 {
            return;
        }
        if self.dynamo.is_none() {
            return;
        }
        let key = self.dynamo_key(self.rows[row as usize].parent, self.kept_local(row));
        let d = self.dynamo.as_deref_mut().expect("checked above");
        d.index.remove(key, row);
        self.rows[row as usize].flags &= !DYNAMO;
    }

    /// After such a change: its entry, where it has a local hash.
    pub(super) fn dynamo_add(&mut self, row: u32) {
        if self.dynamo.is_none() {
            return;
        }
        let Some(local) = self.local_of(row) else {
            return;
        };
        let key = self.dynamo_key(self.rows[row as usize].parent, local);
        let d = self.dynamo.as_deref_mut().expect("checked above");
        if d.index.full() {
            d.index.grow();
        }
        d.index.insert(key, row);
        self.rows[row as usize].flags |= DYNAMO;
    }

    /// The walk of a prompt's Dynamo local hashes from the root: level i holds the rows
    /// of local hash `locals[i]` and block size `block_size` whose parent is at level
    /// i - 1. For every holder of any level, the levels it holds, as bits (bit i of word
    /// i / 64). Empty where Dynamo's hashes are not kept.
    pub fn dynamo_levels(&self, locals: &[u64], block_size: i32) -> Vec<(usize, Vec<u64>)> {
        let Some(d) = self.dynamo.as_deref() else {
            return Vec::new();
        };
        let words = locals.len().div_ceil(64);
        let mut held: HashMap<usize, Vec<u64>, RandomState> = HashMap::default();
        let mut parents: SmallVec<[u32; 2]> = smallvec::smallvec![NONE];
        for (i, &local) in locals.iter().enumerate() {
            let mut level: SmallVec<[u32; 2]> = SmallVec::new();
            for &p in &parents {
                for row in d.index.rows(self.dynamo_key(p, local)) {
                    let r = &self.rows[row as usize];
                    if r.flags & DYNAMO != 0
                        && r.parent == p
                        && self.shape(row).block_size == block_size
                        && self.kept_local(row) == local
                    {
                        level.push(row);
                    }
                }
            }
            if level.is_empty() {
                break;
            }
            for &row in &level {
                for k in 0..self.width {
                    let mut w = self.word(row, k);
                    while w != 0 {
                        let hid = k * 64 + w.trailing_zeros() as usize;
                        let bits = held.entry(hid).or_insert_with(|| vec![0; words]);
                        bits[i / 64] |= 1 << (i % 64);
                        w &= w - 1;
                    }
                }
            }
            parents = level;
        }
        let mut out: Vec<(usize, Vec<u64>)> = held.into_iter().collect();
        out.sort_unstable_by_key(|(hid, _)| *hid);
        out
    }

    /// The walk of `dynamo_levels`, summed up per slot: `slots[hid]` is a holder's
    /// `slot * 3 + tier` (tier 0 GPU, 1 CPU, 2 storage; negative or absent: left out).
    /// For each slot with a match, (slot, blocks matched on GPU from the root, then on down
    /// through CPU, then through storage): each lower tier goes on from where the one
    /// above it ended. In slot order.
    pub fn dynamo_runs(
        &self,
        locals: &[u64],
        block_size: i32,
        slots: &[i64],
    ) -> Vec<(u32, u32, u32, u32)> {
        let words = locals.len().div_ceil(64);
        let mut tiers: std::collections::BTreeMap<u32, [Vec<u64>; 3]> = Default::default();
        for (hid, bits) in self.dynamo_levels(locals, block_size) {
            let Some(&s) = slots.get(hid) else { continue };
            let (Ok(slot), Ok(tier)) = (u32::try_from(s / 3), usize::try_from(s % 3)) else {
                continue;
            };
            let masks = tiers
                .entry(slot)
                .or_insert_with(|| [vec![0; words], vec![0; words], vec![0; words]]);
            for (w, b) in masks[tier].iter_mut().zip(&bits) {
                *w |= b;
            }
        }
        let mut out = Vec::with_capacity(tiers.len());
        for (slot, [gpu, cpu, disk]) in tiers {
            let on_gpu = run_from(&gpu, 0);
            let on_cpu = on_gpu + run_from(&cpu, on_gpu);
            let on_disk = on_cpu + run_from(&disk, on_cpu);
            if on_disk > 0 {
                out.push((slot, on_gpu as u32, on_cpu as u32, on_disk as u32));
            }
        }
        out
    }
}

/// How many bits are set in a row from bit `start` of `bits` (bit i in word i / 64).
fn run_from(bits: &[u64], start: usize) -> usize {
    let mut i = start;
    while i / 64 < bits.len() && (bits[i / 64] >> (i % 64)) & 1 == 1 {
        i += 1;
    }
    i - start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hash_is_dynamos() {
        // compute_block_hash_for_seq([1..8], 4) in Dynamo 1.6.1 (../shared/DYNAMO_FACTS.md)
        let seed = seed_for(None);
        assert_eq!(local_hash(&[1, 2, 3, 4], seed), 14643705804678351452);
        assert_eq!(local_hash(&[5, 6, 7, 8], seed), 16777012769546811212);
        assert_eq!(seed_for(Some("")), SEED);
        assert_ne!(seed_for(Some("adapter")), SEED);
    }

    #[test]
    fn runs_count_set_bits_from_a_start_across_words() {
        assert_eq!(run_from(&[0b0111], 0), 3);
        assert_eq!(run_from(&[0b0110], 0), 0);
        assert_eq!(run_from(&[0b0110], 1), 2);
        assert_eq!(run_from(&[u64::MAX, 0b1], 0), 65);
        assert_eq!(run_from(&[u64::MAX], 64), 0);
        assert_eq!(run_from(&[], 0), 0);
    }
}
