//! A group's content: each block's tokens and metadata, the content keys token walks follow
//! (see the parent module's doc), and the token walk itself.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, Hasher};

use foldhash::fast::RandomState;
use smallvec::SmallVec;

use super::tokens::{words, Ids};
use super::{
    Content, Group, Run, Stored, CHAINED, COUNTED, LEVELS_AT_ONCE, LIVE, NONE, PARTIAL, PLAIN,
    ROOT, SHARED, STORED,
};
use crate::masks::prefetch;

/// The rows found at one level of a token walk (almost always one).
type Level = SmallVec<[u32; 2]>;

impl Group {
    // ------------------------------------------------------------------ content
    /// The interned id of a name a lookup gives (Some(0): none given; None: a name no block
    /// has).
    fn known_id(&self, name: Option<&str>) -> Option<u32> {
        match name {
            None => Some(0),
            Some(name) => self.lora_ids.get(name).copied(),
        }
    }

    fn lora_id(&mut self, lora: Option<&str>) -> u32 {
        let Some(name) = lora else {
            return 0;
        };
        if let Some(&id) = self.lora_ids.get(name) {
            return id;
        }
        self.loras.push(name.to_owned());
        let id = self.loras.len() as u32;
        self.lora_ids.insert(name.to_owned(), id);
        id
    }

    /// A block's content key: a hash, under the group's secret seed, of its parent's key
    /// (the root's for a first block), its size, partial flag, LoRA and tokens. It depends
    /// on the content of the path from the root alone, so a token walk computes every
    /// level's key from the prompt before it probes any (Dynamo keys its tree alike).
    fn content_key(&self, parent: u64, size: i32, partial: bool, lora: u32, tokens: &[i32]) -> u64 {
        let mut h = self.seed.build_hasher();
        (parent, size, partial, lora).hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// Where a token walk of `salt` (an interned id; 0: none) starts: the root's key, or one
    /// of the salt's own that no block's content key can be.
    fn root_key(&self, salt: u32) -> u64 {
        if salt == 0 {
            return ROOT;
        }
        self.content_key(ROOT, -1, false, salt, &[])
    }

    pub(super) fn row_tokens(&self, row: u32) -> Ids {
        let r = &self.rows[row as usize];
        self.tokens.ids(r.tok_off, r.tok_len, r.tok_width)
    }

    /// Whether a row's tokens are `want`.
    fn row_has(&self, row: u32, want: &[i32]) -> bool {
        let r = &self.rows[row as usize];
        self.tokens.same(r.tok_off, r.tok_len, r.tok_width, want)
    }

    /// A row's content key: where it has content, no extra keys, and a parent that is the
    /// root or has a content key itself (else no token walk reaches it).
    fn chain_of(&self, row: u32) -> Option<u64> {
        let r = &self.rows[row as usize];
        if r.flags & STORED == 0 || r.flags & PLAIN == 0 {
            return None;
        }
        let parent = match r.parent {
            NONE => self.root_key(r.salt),
            p if self.rows[p as usize].flags & CHAINED != 0 => self.rows[p as usize].chain,
            _ => return None,
        };
        let partial = r.flags & PARTIAL != 0;
        Some(self.content_key(parent, r.block_size, partial, r.lora, &self.row_tokens(row)))
    }

    /// After a change to `row`'s content, metadata or parent: its content key, and those of
    /// the rows below it whose key follows from it, made current (each changed key moved in
    /// the content index). A subtree is walked only where a key changed.
    fn rechain(&mut self, row: u32) {
        if self.rows[row as usize].first_kid == NONE {
            // A row no other names (a new block, mostly): only its own key.
            let new = self.chain_of(row);
            self.set_chain(row, new);
            return;
        }
        // Each row has one parent, so a row met twice here is on a cycle of parent links:
        // no walk from the root reaches it, and it has no key (nor have the rows below it).
        let mut seen: HashSet<u32, RandomState> = HashSet::default();
        let mut todo = vec![row];
        while let Some(r) = todo.pop() {
            let cyclic = !seen.insert(r);
            let new = if cyclic { None } else { self.chain_of(r) };
            let old = {
                let x = &self.rows[r as usize];
                (x.flags & CHAINED != 0).then_some(x.chain)
            };
            if new == old && (r != row || cyclic) {
                continue;
            }
            self.set_chain(r, new);
            if new != old {
                let mut kid = self.rows[r as usize].first_kid;
                while kid != NONE {
                    todo.push(kid);
                    kid = self.rows[kid as usize].next_sib;
                }
            }
        }
    }

    /// A row's content key (None: none), moved in the content index.
    fn set_chain(&mut self, r: u32, new: Option<u64>) {
        let x = &self.rows[r as usize];
        let old = (x.flags & CHAINED != 0).then_some(x.chain);
        if old == new {
            return;
        }
        if let Some(key) = old {
            let rows = &self.rows;
            self.content.remove(key, r, |x| rows[x as usize].chain);
        }
        let x = &mut self.rows[r as usize];
        x.chain = 0;
        x.flags &= !(CHAINED | SHARED);
        let Some(key) = new else {
            return;
        };
        if self.content.full() {
            let chained = self
                .rows
                .iter()
                .enumerate()
                .filter(|(_, x)| x.flags & CHAINED != 0);
            self.content
                .rebuild(chained.map(|(i, x)| (x.chain, i as u32)));
        }
        // The rows that have this key already: they and this one are SHARED from now on.
        let others: SmallVec<[u32; 2]> = self
            .content
            .rows(key)
            .filter(|&o| {
                let x = &self.rows[o as usize];
                x.flags & CHAINED != 0 && x.chain == key
            })
            .collect();
        for &o in &others {
            self.rows[o as usize].flags |= SHARED;
        }
        let x = &mut self.rows[r as usize];
        x.chain = key;
        x.flags |= CHAINED | if others.is_empty() { 0 } else { SHARED };
        self.content.insert(key, r);
    }

    /// The row after `row`, when it is the one row of the next level of a token walk of
    /// full blocks (`want`, `size`, `lora`): under `row`, its content exactly, and no other
    /// row with its content key (see SHARED). Blocks stored together sit in consecutive
    /// rows, so a walk down a stored prompt needs no probe per level.
    fn kid_after(&self, row: u32, want: &[i32], size: i32, lora: u32) -> Option<u32> {
        if row == NONE {
            return None;
        }
        let kid = row + 1;
        let r = self.rows.get(kid as usize)?;
        let ok = r.flags & (CHAINED | SHARED | PARTIAL) == CHAINED
            && r.parent == row
            && r.block_size == size
            && r.lora == lora
            && r.salt == 0
            && self.row_has(kid, want);
        ok.then_some(kid)
    }

    fn link(&mut self, row: u32, parent: u32) {
        if parent == NONE {
            return;
        }
        let first = self.rows[parent as usize].first_kid;
        if first != NONE {
            self.rows[first as usize].prev_sib = row;
        }
        let r = &mut self.rows[row as usize];
        r.next_sib = first;
        r.prev_sib = NONE;
        self.rows[parent as usize].first_kid = row;
    }

    fn unlink(&mut self, row: u32, parent: u32) {
        if parent == NONE {
            return;
        }
        let (prev, next) = {
            let r = &self.rows[row as usize];
            (r.prev_sib, r.next_sib)
        };
        if prev == NONE {
            self.rows[parent as usize].first_kid = next;
        } else {
            self.rows[prev as usize].next_sib = next;
        }
        if next != NONE {
            self.rows[next as usize].prev_sib = prev;
        }
        let r = &mut self.rows[row as usize];
        r.next_sib = NONE;
        r.prev_sib = NONE;
    }

    /// A store's content for `key` (replacing what the row had).
    pub fn add_row(&mut self, key: &[u8], c: &Content<'_>) {
        self.prefetch_content_slot(c);
        let row = self.intern(key);
        self.dynamo_drop(row);
        let parent = match c.parent {
            Some(p) => self.intern(p),
            None => NONE,
        };
        let old_parent = self.rows[row as usize].parent;
        if old_parent != parent {
            self.unlink(row, old_parent);
            self.link(row, parent);
        }
        let stored = self.rows[row as usize].flags & STORED != 0;
        let same_tokens = stored && self.row_has(row, c.tokens);
        if !same_tokens {
            if stored {
                let r = &self.rows[row as usize];
                self.garbage += words(r.tok_len, r.tok_width);
            }
            let len = u32::try_from(c.tokens.len()).expect("fewer than 2**32 tokens a block");
            let (off, width) = self.tokens.put(c.tokens);
            let r = &mut self.rows[row as usize];
            r.tok_off = off;
            r.tok_len = len;
            r.tok_width = width;
        }
        let lora = self.lora_id(c.lora);
        let salt = if parent == NONE {
            self.lora_id(c.salt)
        } else {
            0
        };
        let r = &mut self.rows[row as usize];
        if r.flags & STORED == 0 {
            self.stored += 1;
        }
        r.parent = parent;
        r.salt = salt;
        r.start = c.start.unwrap_or(i64::MIN);
        r.block_size = c.block_size;
        r.lora = lora;
        r.flags = (r.flags & (CHAINED | COUNTED))
            | LIVE
            | STORED
            | if c.partial { PARTIAL } else { 0 }
            | if c.plain { PLAIN } else { 0 };
        self.rechain(row);
        self.dynamo_add(row);
        self.seen[row as usize] = self.clock;
        if old_parent != parent && old_parent != NONE {
            self.release(old_parent);
        }
        if !same_tokens {
            self.compact_tokens_if_sparse();
        }
    }

    // ------------------------------------------------------------------ expiry
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
        let r = &self.rows[row as usize];
        self.garbage += words(r.tok_len, r.tok_width);
        let r = &mut self.rows[row as usize];
        r.parent = NONE;
        r.tok_len = 0;
        r.flags &= !(STORED | PARTIAL | PLAIN);
        self.stored -= 1;
        self.release(row);
    }

    /// The token arena again without what no row uses, once that is most of it (so each
    /// token is copied a bounded number of times, amortized).
    fn compact_tokens_if_sparse(&mut self) {
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

    /// A hint for the content slot a block's key will take (where its parent's key is
    /// known), so that its cache miss overlaps the work of making the row.
    fn prefetch_content_slot(&self, c: &Content<'_>) {
        if !c.plain {
            return;
        }
        let (Some(lora), Some(salt)) = (self.known_id(c.lora), self.known_id(c.salt)) else {
            return; // a name not met yet: interned in a moment, no key to guess now
        };
        let parent = match c.parent {
            None => self.root_key(salt),
            Some(p) => match self.find(p) {
                Some(row) if self.rows[row as usize].flags & CHAINED != 0 => {
                    self.rows[row as usize].chain
                }
                _ => return,
            },
        };
        let key = self.content_key(parent, c.block_size, c.partial, lora, c.tokens);
        self.content.prefetch(key);
    }

    /// A known row's LoRA, extra-keys flag and salt (a later store's metadata, its content
    /// kept).
    pub fn set_meta(&mut self, key: &[u8], lora: Option<&str>, plain: bool, salt: Option<&str>) {
        let Some(row) = self.find(key) else {
            return;
        };
        if self.rows[row as usize].flags & STORED == 0 {
            return;
        }
        self.dynamo_drop(row);
        let lora = self.lora_id(lora);
        let root = self.rows[row as usize].parent == NONE;
        let salt = if root { self.lora_id(salt) } else { 0 };
        let r = &mut self.rows[row as usize];
        r.lora = lora;
        r.salt = salt;
        r.flags = (r.flags & !PLAIN) | if plain { PLAIN } else { 0 };
        self.rechain(row);
        self.dynamo_add(row);
    }

    /// Whether a store brought content for `key`.
    pub fn has_content(&self, key: &[u8]) -> bool {
        self.find(key)
            .is_some_and(|row| self.rows[row as usize].flags & STORED != 0)
    }

    /// The content a store brought for `key`.
    pub fn stored(&self, key: &[u8]) -> Option<Stored<'_>> {
        let row = self.find(key)?;
        let r = &self.rows[row as usize];
        if r.flags & STORED == 0 {
            return None;
        }
        Some(Stored {
            parent: (r.parent != NONE).then(|| self.key(r.parent)),
            start: (r.start != i64::MIN).then_some(r.start),
            tokens: self.row_tokens(row),
            block_size: r.block_size,
            partial: r.flags & PARTIAL != 0,
            lora: (r.lora != 0).then(|| self.loras[r.lora as usize - 1].as_str()),
            plain: r.flags & PLAIN != 0,
            salt: (r.salt != 0).then(|| self.loras[r.salt as usize - 1].as_str()),
        })
    }

    /// Every hash with content.
    pub fn stored_keys(&self) -> Vec<&[u8]> {
        self.live_rows()
            .filter(|&r| self.rows[r as usize].flags & STORED != 0)
            .map(|r| self.key(r))
            .collect()
    }

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
                if !walk.push(self, &[kid]) {
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
        let first = self.starts.is_empty();
        let at = self.starts.len();
        self.starts.push(self.rows.len());
        self.rows.extend_from_slice(level);
        let mut any = 0;
        for (k, alive) in self.alive.iter_mut().enumerate() {
            let mask = match level {
                [row] => g.word(*row, k),
                _ => level.iter().fold(0, |m, &row| m | g.word(row, k)),
            };
            if first {
                *alive = mask;
            } else {
                let mut gone = *alive & !mask;
                while gone != 0 {
                    self.ended
                        .push((k * 64 + gone.trailing_zeros() as usize, at));
                    gone &= gone - 1;
                }
                *alive &= mask;
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
