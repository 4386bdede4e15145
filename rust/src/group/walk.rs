//! The token walk: a prompt's blocks from the root by content key, down consecutive rows
//! where it can, each holder's run over the levels walked.

use smallvec::SmallVec;

use super::content::Level;
use super::{Group, Run, LEVELS_AT_ONCE, NONE, PARTIAL, PLAIN};
use crate::masks::prefetch;

impl Group {
    /// The rows under `parents` (NONE: the root) holding exactly `want`, sorted by hash,
    /// from the candidates with the level's content key.
    fn level(
        &self,
        candidates: &[u32],
        parents: &[u32],
        want: &[i32],
        size: i32,
        partial: bool,
        (lora, salt): (u32, u32), // the walk's LoRA and cache salt (interned; 0: none)
    ) -> Level {
        let mut found: Level = candidates
            .iter()
            .copied()
            .filter(|&row| {
                let r = &self.rows[row as usize];
                parents.contains(&r.parent)
                    && r.block_size == size
                    && (r.flags & PARTIAL != 0) == partial
                    && r.flags & PLAIN != 0
                    && r.lora == lora
                    && r.salt == if r.parent == NONE { salt } else { 0 }
                    && self.row_has(row, want)
            })
            .collect();
        found.sort_by(|&a, &b| self.key(a).cmp(self.key(b)));
        found
    }

    fn candidates(&self, key: u64) -> Level {
        self.content.rows(key).collect()
    }

    /// The token walk: full blocks of `block_size` from the root, then partial tails of
    /// `hash_block_size`; each holder's run over the levels walked (a level is held when
    /// any of its rows is: two engines that hash one content differently both hold it), at
    /// most the full levels' count in blocks. The walk stops at the first level no holder
    /// of every level before it holds.
    /// Where the row after the level before is the level's only one, it is taken without a
    /// probe; elsewhere the content keys of the next levels are computed from the prompt and
    /// probed together (their cache misses overlap), and each candidate is checked in full:
    /// its parent is one found at the level before, its tokens are the prompt's.
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
        let (bs, hbs) = (block_size, hash_block_size);
        let block =
            |i: usize| &tokens[(i * bs).min(tokens.len())..((i + 1) * bs).min(tokens.len())];
        let levels = (tokens.len() / bs).max(1); // the first is tried even if short
        let mut walk = Walk::new(self.width, levels);
        let root: [u32; 1] = [NONE];
        let mut key = self.root_key(salt);
        let mut i = 0;
        'full: while i < levels {
            // Down consecutive rows while each is its level's only one.
            while i < levels {
                let before = walk.last().unwrap_or(&root);
                let [row] = before else { break };
                let Some(kid) = self.kid_after(*row, block(i), bs as i32, lora) else {
                    break;
                };
                if let Some(ahead) = self.rows.get(kid as usize + 4) {
                    prefetch(ahead);
                }
                key = self.rows[kid as usize].chain;
                i += 1;
                if !walk.push_one(self, kid) {
                    break 'full;
                }
            }
            if i >= levels {
                break;
            }
            // The first level alone (the walk may go on down consecutive rows from it),
            // then as many as LEVELS_AT_ONCE where rows are apart.
            let upto = (i + if i == 0 { 1 } else { LEVELS_AT_ONCE }).min(levels);
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
            for (j, cands) in (i..upto).zip(found) {
                let before = walk.last().unwrap_or(&root);
                let next = self.level(&cands, before, block(j), bs as i32, false, (lora, salt));
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
            tip => self.rows[tip as usize].chain,
        };
        while walk.running() && hbs > 0 && pos + hbs <= tokens.len() {
            let want = &tokens[pos..pos + hbs];
            key = self.content_key(key, hbs as i32, true, lora, want);
            let found = self.level(
                &self.candidates(key),
                &parents,
                want,
                hbs as i32,
                true,
                (lora, salt),
            );
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

/// The levels of a token walk so far: their rows, the holders of every level (each
/// level's mask is the OR of its rows' words; a holder runs on while it is in all), and the
/// runs of those that stopped, as they stop.
struct Walk {
    rows: Vec<u32>,
    starts: Vec<usize>, // level i: rows[starts[i]..starts[i + 1]] (the last to rows.len())
    alive: SmallVec<[u64; 4]>,
    ended: Vec<(usize, usize)>, // (holder id, levels held), in the order they stopped
}

impl Walk {
    fn new(width: usize, levels: usize) -> Self {
        Walk {
            rows: Vec::with_capacity(levels),
            starts: Vec::with_capacity(levels),
            alive: smallvec::smallvec![0; width],
            ended: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.starts.len()
    }

    fn level(&self, i: usize) -> &[u32] {
        let end = self.starts.get(i + 1).copied().unwrap_or(self.rows.len());
        &self.rows[self.starts[i]..end]
    }

    fn last(&self) -> Option<&[u32]> {
        self.len().checked_sub(1).map(|i| self.level(i))
    }

    /// Whether some holder holds every level so far (before the first: yes).
    fn running(&self) -> bool {
        self.starts.is_empty() || self.alive.iter().any(|&w| w != 0)
    }

    /// One more level (its rows, found under the last); whether some holder holds every
    /// level (if none does, the runs are known: the walk goes no further).
    fn push(&mut self, g: &Group, level: &[u32]) -> bool {
        let [row] = level else {
            self.starts.push(self.rows.len());
            self.rows.extend_from_slice(level);
            return self.narrow(|k| level.iter().fold(0, |m, &row| m | g.word(row, k)));
        };
        self.push_one(g, *row)
    }

    /// `push` of a level of one row (a walk down consecutive rows: most levels), without
    /// the general level's copy.
    fn push_one(&mut self, g: &Group, row: u32) -> bool {
        self.starts.push(self.rows.len());
        self.rows.push(row);
        self.narrow(|k| g.word(row, k))
    }

    /// The holders still running after the level just pushed (`mask(k)`: its holder word
    /// k); those that stop are recorded. Whether any runs on.
    fn narrow(&mut self, mask: impl Fn(usize) -> u64) -> bool {
        let at = self.starts.len() - 1;
        let mut any = 0;
        for (k, alive) in self.alive.iter_mut().enumerate() {
            let held = mask(k);
            if at == 0 {
                *alive = held;
            } else {
                let mut gone = *alive & !held;
                while gone != 0 {
                    self.ended
                        .push((k * 64 + gone.trailing_zeros() as usize, at));
                    gone &= gone - 1;
                }
                *alive &= held;
            }
            any |= *alive;
        }
        any != 0
    }

    /// Each holder's run over the levels, and the token end of its last level (the
    /// furthest of the rows it holds there).
    fn runs(&self, g: &Group) -> Vec<Run> {
        let n = self.len();
        let still = self.alive.iter().enumerate().flat_map(|(k, &word)| {
            let mut left = word;
            std::iter::from_fn(move || {
                (left != 0).then(|| {
                    let hid = k * 64 + left.trailing_zeros() as usize;
                    left &= left - 1;
                    (hid, n)
                })
            })
        });
        self.ended
            .iter()
            .copied()
            .chain(still)
            .map(|(hid, n)| {
                let (k, bit) = (hid / 64, 1u64 << (hid % 64));
                let end = self
                    .level(n - 1)
                    .iter()
                    .filter(|&&row| g.word(row, k) & bit != 0)
                    .map(|&row| g.end(row))
                    .max()
                    .unwrap_or(0);
                (hid, n, end)
            })
            .collect()
    }
}
