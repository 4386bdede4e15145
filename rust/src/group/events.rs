//! A whole store or removal event applied in one call: the router's common case.
//!
//! The index rules (consumer/core/plan.py) decide every event; most of them, though, store
//! blocks that are new to the group or that another holder stored already with the same
//! content, and remove blocks a holder holds. For those the rules come down to: add the
//! rows that are new, keep the first LoRA name, add one reference per block (none for a
//! block a source that reports reuse holds already) or take one away. `store_run` does
//! exactly that (a placeholder's blocks keep whatever their rows hold) and declines,
//! changing nothing, any event where a rule could say more (a block stored with other
//! content or position, a hash twice): the caller then plans it with the rules. Its
//! pure-Python twin, the tests' reference, is `tests/helpers/pure_router/event_runs.py`.

use smallvec::{smallvec, SmallVec};

use super::{Content, Group, NONE, PARTIAL, PLAIN, STORED};

/// A store event's blocks (one holder's): as the event carries them.
pub struct StoreRun<'a> {
    pub hashes: &'a [&'a [u8]],
    pub parent: Option<&'a [u8]>,
    /// The first block's position; None: after the parent's row, where that is known.
    pub start: Option<i64>,
    pub tokens: &'a [i32],
    pub block_size: i32,
    pub partial: bool,
    pub lora: Option<&'a str>,
}

impl Group {
    /// Where a block after `parent` starts, as the rules place an event without a
    /// position: 0 at the root, else its parent's token end (None: not known).
    fn start_after(&self, parent: Option<&[u8]>) -> Option<i64> {
        let Some(p) = parent else {
            return Some(0);
        };
        self.token_end(self.find(p)?)
    }

    /// Whether a store names a hash twice, or its parent among its hashes (`hs`: the
    /// hashes' hashes): each position goes in a small open-addressing table of positions,
    /// twice as many slots as positions, homed by its hash's top bits (the hashes are
    /// seeded mixes already), and equal keys meet there (their hashes are equal).
    fn repeats(&self, run: &StoreRun<'_>, hs: &[u64]) -> bool {
        let n = hs.len() + usize::from(run.parent.is_some());
        if n < 2 {
            return false;
        }
        let parent_hash = run.parent.map_or(0, |p| self.hash_of(p));
        let at = |i: usize| -> (u64, &[u8]) {
            match run.hashes.get(i) {
                Some(h) => (hs[i], h),
                None => (parent_hash, run.parent.unwrap_or_default()),
            }
        };
        let size = (2 * n).next_power_of_two();
        let shift = 64 - size.trailing_zeros();
        let mut slots: SmallVec<[u32; 512]> = smallvec![0; size]; // position + 1; 0: free
        for i in 0..n {
            let (hash, key) = at(i);
            let mut s = (hash >> shift) as usize;
            while let Some(j) = slots[s].checked_sub(1) {
                if at(j as usize) == (hash, key) {
                    return true;
                }
                s = (s + 1) & (size - 1);
            }
            slots[s] = u32::try_from(i + 1).expect("fewer than 2**32 blocks an event");
        }
        false
    }

    /// Whether the stored `row` is exactly a block of this content.
    fn is_block(&self, row: u32, c: &Content<'_>) -> bool {
        let r = &self.rows[row as usize];
        let parent_same = match c.parent {
            None => r.parent == NONE,
            Some(p) => r.parent != NONE && self.key(r.parent) == p,
        };
        parent_same
            && self.start_of(row) == c.start
            && self.shape(row).block_size == c.block_size
            && (r.flags & PARTIAL != 0) == c.partial
            && r.tok_len as usize == c.tokens.len()
            && self.row_has(row, c.tokens)
    }

    /// Apply a store event for holder `hid` (see the module doc): None when declined
    /// (nothing changed), else how many blocks were a reported reuse (`reports`: the
    /// source announces reused blocks as stores, so a block it holds gains no reference).
    pub fn store_run(&mut self, run: &StoreRun<'_>, hid: usize, reports: bool) -> Option<usize> {
        // A placeholder (no size, no tokens: a group that is not full attention) says only
        // that the blocks exist; whatever a row of its hashes holds stays.
        let placeholder = run.block_size == 0 && run.tokens.is_empty();
        let size = usize::try_from(run.block_size).ok()?;
        let n = run.hashes.len();
        if (size == 0 && !placeholder)
            || n == 0
            || run.hashes.iter().any(|h| h.is_empty())
            || run.parent == Some(&[][..])
        {
            return None;
        }
        let hs: Vec<u64> = run.hashes.iter().map(|h| self.hash_of(h)).collect();
        if self.repeats(run, &hs) {
            return None; // a hash twice (or its own parent): the rules' case
        }
        let start = match run.start {
            Some(s) => Some(s),
            None if placeholder => None,
            None => self.start_after(run.parent),
        };
        let block = |i: usize| -> Content<'_> {
            let lo = (i * size).min(run.tokens.len());
            let hi = ((i + 1) * size).min(run.tokens.len());
            Content {
                parent: if i == 0 {
                    run.parent
                } else {
                    Some(run.hashes[i - 1])
                },
                start: start.map(|s| s + (i * size) as i64),
                tokens: &run.tokens[lo..hi],
                block_size: run.block_size,
                partial: run.partial,
                lora: run.lora,
                plain: true,
                salt: None,
            }
        };
        // First every block checked (so a decline changes nothing), then applied. The rows
        // are found together (their cache misses overlapped); a stored row is never freed
        // by the changes below, so those found stay theirs.
        let rows = self.rows_hashed(run.hashes, |i| hs[i]);
        for (i, &row) in rows.iter().enumerate() {
            if row != NONE
                && self.rows[row as usize].flags & STORED != 0
                && !placeholder
                && !self.is_block(row, &block(i))
            {
                return None;
            }
        }
        let mut reused = 0;
        for (i, h) in run.hashes.iter().enumerate() {
            let row = match rows[i] {
                row if row != NONE && self.rows[row as usize].flags & STORED != 0 => {
                    self.keep_row(row, h, run.lora, placeholder);
                    row
                }
                NONE => self.add_row_at(h, &block(i), Some(hs[i])),
                _ => self.add_row_at(h, &block(i), None),
            };
            let held = self.refcount_row(row, hid);
            if reports && held > 0 {
                reused += 1;
            } else {
                self.hold_row(row, hid, held.saturating_add(1));
            }
        }
        Some(reused)
    }

    /// A stored row a store names again keeps its content and its first LoRA name; a
    /// placeholder row a placeholder names is stored again as it is (as the rules merge
    /// it: its metadata kept, its time touched).
    fn keep_row(&mut self, row: u32, key: &[u8], lora: Option<&str>, placeholder: bool) {
        let (r, shape) = (&self.rows[row as usize], self.shape(row));
        let again = placeholder && shape.block_size == 0;
        if !again && (shape.lora != 0 || lora.is_none()) {
            return; // nothing to change (most rows: the same store by another holder)
        }
        let (plain, salt) = (r.flags & PLAIN != 0, self.salt_of(row));
        let lora = self.name(shape.lora).or(lora).map(str::to_owned);
        if again {
            let parent = (r.parent != NONE).then(|| self.key(r.parent).to_vec());
            let tokens = self.row_tokens(row);
            let content = Content {
                parent: parent.as_deref(),
                start: self.start_of(row),
                tokens: &tokens,
                block_size: 0,
                partial: r.flags & PARTIAL != 0,
                lora: lora.as_deref(),
                plain,
                salt: salt.as_deref(),
            };
            self.add_row(key, &content);
        } else {
            self.set_meta(key, lora.as_deref(), plain, salt.as_deref());
        }
    }

    /// A row's first block's salt, as set_meta takes it.
    fn salt_of(&self, row: u32) -> Option<String> {
        self.name(self.shape(row).salt).map(str::to_owned)
    }

    /// Apply a removal event for holder `hid`: one reference less per hash; how many found
    /// no reference left (a recorded no-op, never a negative count).
    pub fn release_run(&mut self, hashes: &[&[u8]], hid: usize) -> usize {
        let mut noop = 0;
        for h in hashes {
            match self.refcount(h, hid) {
                0 => noop += 1,
                held => self.hold(h, hid, held - 1),
            }
        }
        noop
    }
}
