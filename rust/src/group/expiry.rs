//! Expiry: a group forgets the blocks no one holds, no block names as its parent, and
//! nothing touched since a cutoff (the caller's clock), leaves first; their tokens are given
//! back once they are most of the arena.

use super::{Group, NONE, PARTIAL, PLAIN, STORED};

impl Group {
    /// The time (seconds, the caller's clock) that stores and holders from now on stamp on
    /// the rows they touch.
    pub fn set_clock(&mut self, now: u32) {
        self.clock = now;
    }

    /// Drop the blocks no one holds, no block names as its parent, and nothing touched
    /// since before `cutoff`; a dropped block's parent is tried next (a chain goes from its
    /// leaves up in one pass). How many went. The same blocks go whatever the order, as
    /// the pure twin drops them.
    pub fn expire(&mut self, cutoff: u32) -> usize {
        let dropped = self.expire_rows(cutoff, 0, self.rows.len());
        self.sweep = 0;
        dropped
    }

    /// `expire` a slice at a time: the next `rows` rows from where the last call stopped
    /// (a caller that holds a lock for each slice lets lookups in between). How many
    /// went, and whether the pass reached the last row (the next call starts another).
    pub fn expire_some(&mut self, cutoff: u32, rows: usize) -> (usize, bool) {
        let from = self.sweep.min(self.rows.len());
        let to = from.saturating_add(rows.max(1)).min(self.rows.len());
        let dropped = self.expire_rows(cutoff, from, to);
        let done = to >= self.rows.len();
        self.sweep = if done { 0 } else { to };
        (dropped, done)
    }

    fn expire_rows(&mut self, cutoff: u32, from: usize, to: usize) -> usize {
        let mut dropped = 0;
        for row in from as u32..to as u32 {
            let mut at = row;
            while at != NONE && self.expired(at, cutoff) {
                let parent = self.rows[at as usize].parent;
                self.unstore(at);
                dropped += 1;
                at = parent;
            }
            if at != NONE {
                self.release(at); // a parent without content that nothing names now
            }
        }
        self.compact_tokens_if_sparse();
        dropped
    }

    fn expired(&self, row: u32, cutoff: u32) -> bool {
        let r = &self.rows[row as usize];
        r.flags & STORED != 0
            && r.first_kid == NONE
            && r.word == 0
            && !self.wide_any(row)
            && self.seen[row as usize] < cutoff
    }

    /// A row's content gone (it then goes itself: no one holds or names it).
    fn unstore(&mut self, row: u32) {
        self.dynamo_drop(row);
        self.set_chain(row, None);
        let parent = self.rows[row as usize].parent;
        self.unlink(row, parent);
        self.forget_tokens(row);
        let r = &mut self.rows[row as usize];
        r.parent = NONE;
        r.flags &= !(STORED | PARTIAL | PLAIN);
        self.stored -= 1;
        self.release(row);
    }

    /// The token arena again without what no row uses, once that is most of it (so each
    /// token is copied a bounded number of times, amortized).
    pub(super) fn compact_tokens_if_sparse(&mut self) {
        let total = self.tokens.len_words();
        if self.garbage < 1 << 16 || self.garbage * 2 < total {
            return;
        }
        let kept: Vec<u32> = (0..self.rows.len() as u32)
            .filter(|&r| self.rows[r as usize].flags & STORED != 0)
            .collect();
        let rows = &self.rows;
        let spans = kept.iter().map(|&r| {
            let x = &rows[r as usize];
            (x.tok_off, x.tok_len, x.tok_width)
        });
        let mut moved = Vec::with_capacity(kept.len());
        let tokens = self
            .tokens
            .compacted(spans, |off| moved.push(off), total - self.garbage);
        for (&r, off) in kept.iter().zip(moved) {
            self.rows[r as usize].tok_off = off;
        }
        self.tokens = tokens;
        self.garbage = 0;
    }
}
