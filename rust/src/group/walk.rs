//! The token walk: a prompt's blocks from the root by content key, down consecutive rows
//! where it can, each holder's run over the levels walked.

use smallvec::SmallVec;

use super::content::Level;
use super::tokens::words;
use super::{chain_key, Group, Run, Shape, LEVELS_AT_ONCE, NONE, PARTIAL, PLAIN};
use crate::masks::prefetch;

impl Group {
    /// The rows under `parents` (NONE: the root) holding exactly `want`, sorted by hash:
    /// the candidates from the content index with the level's key, and the rows right
    /// after the parents that have it (never in the index: see `listed`).
    fn level(
        &self,
        key: u64,
        candidates: &[u32],
        parents: &[u32],
        want: &[i32],
        partial: bool,
        (first, later): (u32, u32), // the level's shape under the root and under a block
    ) -> Level {
        let mut found: Level = self
            .under(key, candidates.iter().copied(), parents)
            .filter(|&row| {
                let r = &self.rows[row as usize];
                r.shape == if r.parent == NONE { first } else { later }
                    && (r.flags & PARTIAL != 0) == partial
                    && r.flags & PLAIN != 0
                    && self.row_has(row, want)
            })
            .collect();
        found.sort_by(|&a, &b| self.key(a).cmp(self.key(b)));
        found
    }

    /// The rows the content index has under `key`'s tag (the rows of the key among them).
    fn candidates(&self, key: u64) -> Level {
        self.content.rows(key).collect()
    }

    /// The token walk: full blocks of `block_size` from the root, then partial tails of
    /// `hash_block_size`; each holder's run over the levels walked (a level is held when
    /// any of its rows is: two engines that hash one content differently both hold it), at
    /// most the full levels' count in blocks. The walk stops at the first level no holder
    /// of every level before it holds.
    /// Where the row after the level before is the level's only one, it is taken without a
    /// probe; where consecutive rows end, the next level's content key alone is probed (a
    /// prompt's match mostly ends there), and where rows keep being apart the keys of the
    /// next levels are computed from the prompt and probed together (their cache misses
    /// overlap). Each candidate is checked in full: its parent is one found at the level
    /// before, its tokens are the prompt's.
    pub fn match_tokens(
        &self,
        tokens: &[i32],
        block_size: usize,
        hash_block_size: usize,
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> Vec<Run> {
        let (Some(lora), Some(salt)) = (self.known_id(lora), self.known_id(salt)) else {
            return Vec::new(); // no block of that LoRA, or with that salt
        };
        let args = (tokens, block_size, hash_block_size, lora, salt);
        // The holder words in an array where there are few (the loops over them unrolled).
        match self.width {
            1 => self.walk_tokens(Walk::new([0; 1]), args),
            2 => self.walk_tokens(Walk::new([0; 2]), args),
            3 => self.walk_tokens(Walk::new([0; 3]), args),
            4 => self.walk_tokens(Walk::new([0; 4]), args),
            w => self.walk_tokens(Walk::new(vec![0; w]), args),
        }
    }

    /// The shapes a token walk's rows of `size` tokens have: under the root (with the
    /// walk's cache salt) and under a block (without one).
    fn level_shapes(&self, size: i32, lora: u32, salt: u32) -> (u32, u32) {
        let at = |salt| {
            self.known_shape(Shape {
                block_size: size,
                lora,
                salt,
            })
        };
        (at(salt), at(0))
    }

    /// The keys of the rows holder `hid` holds down the prompt's full blocks from the root,
    /// as the token walk finds them, to the first level where it holds none: what a prompt
    /// reported by token ids holds on that holder, named by the engine's hashes. Where a
    /// level has several rows it holds (one content hashed apart), the walk goes on under
    /// each, and the path is the chain up from the first row of the deepest level.
    pub fn held_path(
        &self,
        tokens: &[i32],
        block_size: usize,
        lora: Option<&str>,
        salt: Option<&str>,
        hid: usize,
    ) -> Vec<&[u8]> {
        let (Some(lora), Some(salt)) = (self.known_id(lora), self.known_id(salt)) else {
            return Vec::new();
        };
        let Ok(size) = i32::try_from(block_size) else {
            return Vec::new();
        };
        if size == 0 {
            return Vec::new();
        }
        let shapes = self.level_shapes(size, lora, salt);
        let mut parents: Level = Level::from_slice(&[NONE]);
        let mut key = self.root_key(salt);
        let mut depth = 0;
        for want in tokens.chunks_exact(block_size) {
            key = self.content_key(key, size, false, lora, want);
            let held: Level = self
                .level(key, &self.candidates(key), &parents, want, false, shapes)
                .into_iter()
                .filter(|&row| self.holds(row, hid))
                .collect();
            if held.is_empty() {
                break;
            }
            parents = held;
            depth += 1;
        }
        let mut path = Vec::with_capacity(depth);
        let mut row = parents[0];
        for _ in 0..depth {
            path.push(self.key(row));
            row = self.rows[row as usize].parent;
        }
        path.reverse();
        path
    }

    /// `match_tokens` with the walk's holder words in `walk` (their count: the width).
    fn walk_tokens<A: AsRef<[u64]> + AsMut<[u64]>>(
        &self,
        mut walk: Walk<A>,
        (tokens, block_size, hash_block_size, lora, salt): (&[i32], usize, usize, u32, u32),
    ) -> Vec<Run> {
        let (bs, hbs) = (block_size, hash_block_size);
        let (full_shapes, tail_shapes) = (
            self.level_shapes(bs as i32, lora, salt),
            self.level_shapes(hbs as i32, lora, salt),
        );
        let block =
            |i: usize| &tokens[(i * bs).min(tokens.len())..((i + 1) * bs).min(tokens.len())];
        let levels = (tokens.len() / bs).max(1); // the first is tried even if short
        let root: [u32; 1] = [NONE];
        let mut key = self.root_key(salt);
        let mut i = 0;
        let mut apart = 0; // the level after the last probed ones
        'full: while i < levels {
            // Down consecutive rows while each is its level's only one.
            while i < levels {
                let before = walk.last().unwrap_or(&root);
                let [row] = before else { break };
                let Some(kid) = self.kid_after(*row, block(i), full_shapes.1) else {
                    break;
                };
                let r = &self.rows[kid as usize];
                if let Some(ahead) = self.rows.get(kid as usize + 4) {
                    prefetch(ahead);
                }
                // The blocks stored with this one follow its tokens in the arena.
                self.tokens
                    .prefetch_after(r.tok_off, 4 * words(r.tok_len, r.tok_width));
                if let Some(t) = tokens.get((i + 8) * bs) {
                    prefetch(t); // the prompt's block eight levels on
                }
                key = chain_key(r);
                i += 1;
                if !walk.push_one(self, kid) {
                    break 'full;
                }
            }
            if i >= levels {
                break;
            }
            // One level alone where the consecutive rows end (past a prompt's match there
            // is nothing to find, and after it the rows may run on consecutively again),
            // then as many as LEVELS_AT_ONCE where rows keep being apart.
            let one = i == 0 || i > apart;
            let upto = (i + if one { 1 } else { LEVELS_AT_ONCE }).min(levels);
            apart = upto;
            let mut keys: SmallVec<[u64; LEVELS_AT_ONCE]> = SmallVec::new();
            for j in i..upto {
                key = self.content_key(key, bs as i32, false, lora, block(j));
                keys.push(key);
            }
            for &k in &keys {
                self.content.prefetch(k);
            }
            let found: SmallVec<[Level; LEVELS_AT_ONCE]> =
                keys.iter().map(|&k| self.candidates(k)).collect();
            // The candidates' rows, then (their places known once the rows arrive) their
            // tokens: two passes, so no prefetch waits on a row still on its way.
            for &row in found.iter().flatten() {
                prefetch(&self.rows[row as usize]);
            }
            for &row in found.iter().flatten() {
                self.tokens.prefetch(self.rows[row as usize].tok_off);
            }
            for ((j, cands), &k) in (i..upto).zip(found).zip(&keys) {
                let before = walk.last().unwrap_or(&root);
                let next = self.level(k, &cands, before, block(j), false, full_shapes);
                if next.is_empty() || !walk.push(self, &next) {
                    break 'full;
                }
            }
            i = upto;
        }
        let full = walk.len();
        let mut pos = full * bs;
        // Every row of the last full level is a parent of the tails (they share its key).
        let mut parents: Level = walk.last().unwrap_or(&root).into();
        let mut key = match parents[0] {
            NONE => self.root_key(salt),
            tip => chain_key(&self.rows[tip as usize]),
        };
        while walk.running() && hbs > 0 && pos + hbs <= tokens.len() {
            let want = &tokens[pos..pos + hbs];
            key = self.content_key(key, hbs as i32, true, lora, want);
            let cands = self.candidates(key);
            let found = self.level(key, &cands, &parents, want, true, tail_shapes);
            if found.is_empty() || !walk.push(self, &found) {
                break;
            }
            parents = found;
            pos += hbs;
        }
        walk.runs(self)
            .into_iter()
            .map(|(hid, blocks, end)| (hid, blocks.min(full), end))
            .collect()
    }
}

/// A token walk so far: how many levels it has, the last level's rows, the holders of
/// every level (each level's mask is the OR of its rows' words; a holder runs on while it
/// is in all), and the runs of those that stopped, each with its token end found as it
/// stops (from the level before, which it held): no level but the last is kept. `A` holds
/// the holder words: an array where the group has few, so their loops unroll.
struct Walk<A> {
    levels: usize,
    last: Level,
    alive: A,
    ended: Vec<Run>, // in the order they stopped
}

impl<A: AsRef<[u64]> + AsMut<[u64]>> Walk<A> {
    fn new(alive: A) -> Self {
        Walk {
            levels: 0,
            last: Level::new(),
            alive,
            ended: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.levels
    }

    fn last(&self) -> Option<&[u32]> {
        (self.levels > 0).then_some(&self.last[..])
    }

    /// Whether some holder holds every level so far (before the first: yes).
    fn running(&self) -> bool {
        self.levels == 0 || self.alive.as_ref().iter().any(|&w| w != 0)
    }

    /// One more level (its rows, found under the last); whether some holder holds every
    /// level (if none does, the runs are known: the walk goes no further).
    fn push(&mut self, g: &Group, level: &[u32]) -> bool {
        let [row] = level else {
            let on = self.narrow(g, |k| level.iter().fold(0, |m, &row| m | g.word(row, k)));
            self.last.clear();
            self.last.extend_from_slice(level);
            return on;
        };
        self.push_one(g, *row)
    }

    /// `push` of a level of one row (a walk down consecutive rows: most levels).
    #[inline(always)]
    fn push_one(&mut self, g: &Group, row: u32) -> bool {
        let on = self.narrow(g, |k| g.word(row, k));
        self.last.clear();
        self.last.push(row);
        on
    }

    /// The holders still running after the level whose holder word k is `mask(k)`; those
    /// that stop are recorded with the token end of the level before. Whether any runs on.
    #[inline(always)]
    fn narrow(&mut self, g: &Group, mask: impl Fn(usize) -> u64) -> bool {
        let first = self.levels == 0;
        self.levels += 1;
        let mut any = 0;
        for k in 0..self.alive.as_ref().len() {
            let held = mask(k);
            let was = self.alive.as_ref()[k];
            let now = if first { held } else { was & held };
            let gone = was & !now;
            if gone != 0 && !first {
                self.stopped(g, k, gone);
            }
            self.alive.as_mut()[k] = now;
            any |= now;
        }
        any != 0
    }

    /// The holders of `gone` (in word k) stopped at the level being pushed: their runs end
    /// at the level before.
    #[cold]
    fn stopped(&mut self, g: &Group, k: usize, mut gone: u64) {
        let at = self.levels - 1;
        while gone != 0 {
            let bit = gone & gone.wrapping_neg();
            let hid = k * 64 + bit.trailing_zeros() as usize;
            self.ended.push((hid, at, self.end(g, k, bit)));
            gone &= gone - 1;
        }
    }

    /// The token end of the last level for the holder of `bit` in word k: the furthest of
    /// the level's rows it holds.
    fn end(&self, g: &Group, k: usize, bit: u64) -> i64 {
        match self.last[..] {
            [row] => g.end(row),
            ref rows => rows
                .iter()
                .filter(|&&row| g.word(row, k) & bit != 0)
                .map(|&row| g.end(row))
                .max()
                .unwrap_or(0),
        }
    }

    /// Each holder's run over the levels, and the token end of its last level.
    fn runs(mut self, g: &Group) -> Vec<Run> {
        let n = self.levels;
        for k in 0..self.alive.as_ref().len() {
            let mut left = self.alive.as_ref()[k];
            while left != 0 {
                let bit = left & left.wrapping_neg();
                let hid = k * 64 + bit.trailing_zeros() as usize;
                let end = self.end(g, k, bit);
                self.ended.push((hid, n, end));
                left &= left - 1;
            }
        }
        self.ended
    }
}
