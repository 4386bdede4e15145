//! A group's content: each block's tokens and metadata, its parent links, and the content
//! keys token walks follow (see the parent module's doc; the walk is in walk.rs).

use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, Hasher};

use foldhash::fast::RandomState;
use smallvec::SmallVec;

use super::tokens::{words, Ids};
use super::{
    chain_key, Content, Group, Shape, Stored, CHAINED, COUNTED, LIVE, NONE, PARTIAL, PLAIN, ROOT,
    SHARED, STORED,
};

/// The rows found at one level of a token walk (almost always one).
pub(super) type Level = SmallVec<[u32; 2]>;

impl Group {
    // ------------------------------------------------------------------ content
    /// The interned id of a name a lookup gives (Some(0): none given; None: a name no block
    /// has).
    pub(super) fn known_id(&self, name: Option<&str>) -> Option<u32> {
        match name {
            None => Some(0),
            Some(name) => self.lora_ids.get(name).copied(),
        }
    }

    /// An interned name (0: none).
    pub(super) fn name(&self, id: u32) -> Option<&str> {
        (id != 0).then(|| self.loras[id as usize - 1].as_str())
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
    /// level's key from the prompt before it probes any (Dynamo keys its tree alike). Its
    /// high half only (the content index's tag, all a row keeps): every candidate is
    /// checked in full anyway.
    pub(super) fn content_key(
        &self,
        parent: u64,
        size: i32,
        partial: bool,
        lora: u32,
        tokens: &[i32],
    ) -> u64 {
        let mut h = self.seed.build_hasher();
        (parent, size, partial, lora).hash(&mut h);
        tokens.hash(&mut h);
        h.finish() & 0xFFFF_FFFF_0000_0000
    }

    /// Where a token walk of `salt` (an interned id; 0: none) starts: the root's key, or one
    /// of the salt's own that no block's content key can be.
    pub(super) fn root_key(&self, salt: u32) -> u64 {
        if salt == 0 {
            return ROOT;
        }
        self.content_key(ROOT, -1, false, salt, &[])
    }

    pub(super) fn row_tokens(&self, row: u32) -> Ids {
        let r = &self.rows[row as usize];
        self.tokens.ids(r.tok_off, r.tok_len, r.tok_width)
    }

    /// A row's tokens left to the arena's garbage (see `compact_tokens_if_sparse`).
    pub(super) fn forget_tokens(&mut self, row: u32) {
        let r = &mut self.rows[row as usize];
        self.garbage += words(r.tok_len, r.tok_width);
        r.tok_len = 0;
    }

    /// Whether a row's tokens are `want`.
    pub(super) fn row_has(&self, row: u32, want: &[i32]) -> bool {
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
        let shape = self.shape(row);
        let parent = match r.parent {
            NONE => self.root_key(shape.salt),
            p if self.rows[p as usize].flags & CHAINED != 0 => chain_key(&self.rows[p as usize]),
            _ => return None,
        };
        let partial = r.flags & PARTIAL != 0;
        let tokens = self.row_tokens(row);
        Some(self.content_key(parent, shape.block_size, partial, shape.lora, &tokens))
    }

    /// After a change to `row`'s content, metadata or parent: its content key, and those of
    /// the rows below it whose key follows from it, made current (each changed key moved in
    /// the content index). A subtree is walked only where a key changed.
    ///
    /// `known`: the row's key where the caller computed it already (add_row's prefetch).
    fn rechain(&mut self, row: u32, known: Option<u64>) {
        if self.rows[row as usize].first_kid == NONE {
            // A row no other names (a new block, mostly): only its own key.
            let new = known.or_else(|| self.chain_of(row));
            debug_assert_eq!(new, self.chain_of(row));
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
                (x.flags & CHAINED != 0).then_some(chain_key(x))
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

    /// Whether a row with a content key is in the content index: every row but the one
    /// right after its parent's. A walk at a level of one row looks at the row after it
    /// first (`kid_after`), and a probe of the index adds the rows after the level's rows
    /// (`with_key`): an engine stores a prompt's blocks in one event, in consecutive rows,
    /// so the index mostly holds only the first block of each event.
    fn listed(&self, r: u32) -> bool {
        let parent = self.rows[r as usize].parent;
        parent == NONE || r != parent.wrapping_add(1)
    }

    /// The rows with content key `key` under one of `parents` (NONE: the root): those in
    /// the content index, then the rows right after a parent (never in it) that have it.
    pub(super) fn with_key(&self, key: u64, parents: &[u32]) -> Level {
        self.under(key, self.content.rows(key), parents).collect()
    }

    /// Of `listed` (rows the content index gave for `key`), those under one of `parents`,
    /// then the rows right after a parent that have `key` (never in the index).
    pub(super) fn under<'a>(
        &'a self,
        key: u64,
        listed: impl Iterator<Item = u32> + 'a,
        parents: &'a [u32],
    ) -> impl Iterator<Item = u32> + 'a {
        listed
            .filter(|&o| parents.contains(&self.rows[o as usize].parent))
            .chain(
                parents
                    .iter()
                    .filter_map(move |&p| self.next_with_key(p, key)),
            )
    }

    /// The row right after `parent` where it is a kid of it with content key `key`.
    fn next_with_key(&self, parent: u32, key: u64) -> Option<u32> {
        let kid = parent.checked_add(1).filter(|&k| k != NONE)?;
        let x = self.rows.get(kid as usize)?;
        (x.flags & CHAINED != 0 && x.parent == parent && chain_key(x) == key).then_some(kid)
    }

    /// A row's content key (None: none), moved in the content index (where `listed`).
    /// A row taking a key that a sibling has (the same content under the same parent: two
    /// hashes of one block) marks both SHARED: `kid_after` takes neither alone.
    pub(super) fn set_chain(&mut self, r: u32, new: Option<u64>) {
        let x = &self.rows[r as usize];
        let old = (x.flags & CHAINED != 0).then_some(chain_key(x));
        if old == new {
            return;
        }
        if let Some(key) = old {
            self.content.remove(key, r); // (nothing to remove where it is not listed)
        }
        let x = &mut self.rows[r as usize];
        x.chain = 0;
        x.flags &= !(CHAINED | SHARED);
        let Some(key) = new else {
            return;
        };
        // Its siblings with this key. A row that is its parent's only kid has none: no
        // probe (a new block of a stored prompt, mostly).
        let (parent, next_sib) = (x.parent, x.next_sib);
        let alone = parent != NONE && self.rows[parent as usize].first_kid == r && next_sib == NONE;
        let others = if alone {
            Level::new()
        } else {
            self.with_key(key, &[parent])
        };
        for &o in &others {
            self.rows[o as usize].flags |= SHARED;
        }
        let x = &mut self.rows[r as usize];
        x.chain = (key >> 32) as u32;
        x.flags |= CHAINED | if others.is_empty() { 0 } else { SHARED };
        if self.listed(r) {
            if self.content.full() {
                self.content.grow();
            }
            self.content.insert(key, r);
        }
    }

    /// The row after `row`, when it is the one row of the next level of a token walk of
    /// full blocks (`want`, `size`, `lora`): under `row`, its content exactly, and no
    /// sibling with its content key (see SHARED). Blocks stored together sit in consecutive
    /// rows, so a walk down a stored prompt needs no probe per level.
    /// `shape`: the id of the walk's (size, LoRA, no salt).
    pub(super) fn kid_after(&self, row: u32, want: &[i32], shape: u32) -> Option<u32> {
        if row == NONE {
            return None;
        }
        let kid = row + 1;
        let r = self.rows.get(kid as usize)?;
        let ok = r.flags & (CHAINED | SHARED | PARTIAL) == CHAINED
            && r.parent == row
            && r.shape == shape
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

    pub(super) fn unlink(&mut self, row: u32, parent: u32) {
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
        self.add_row_at(key, c, None);
    }

    /// `add_row`, giving the row it stored. `new`: the key's hash where the caller knows
    /// the key has no row (it is not looked for again).
    pub(super) fn add_row_at(&mut self, key: &[u8], c: &Content<'_>, new: Option<u64>) -> u32 {
        let chain = self.prefetch_content_slot(c);
        // The parent first: it is mostly the row found last (the block before, in the same
        // event), so `find` takes it from the hint; the new row then follows it.
        let parent = match c.parent {
            Some(p) => self.intern(p),
            None => NONE,
        };
        let row = match new {
            Some(hash) => self.intern_new(key, hash),
            None => self.intern(key),
        };
        self.dynamo_drop(row);
        let old_parent = self.rows[row as usize].parent;
        if old_parent != parent {
            // Out of the content index first: whether it is listed there follows its parent.
            self.set_chain(row, None);
            self.unlink(row, old_parent);
            self.link(row, parent);
        }
        let stored = self.rows[row as usize].flags & STORED != 0;
        let same_tokens = stored && self.row_has(row, c.tokens);
        if !same_tokens {
            if stored {
                self.forget_tokens(row);
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
        let shape = self.shape_id(Shape {
            block_size: c.block_size,
            lora,
            salt,
        });
        self.set_start(row, c.start);
        let r = &mut self.rows[row as usize];
        if r.flags & STORED == 0 {
            self.stored += 1;
        }
        r.parent = parent;
        r.shape = shape;
        r.flags = (r.flags & (CHAINED | COUNTED))
            | LIVE
            | STORED
            | if c.partial { PARTIAL } else { 0 }
            | if c.plain { PLAIN } else { 0 };
        self.rechain(row, chain);
        self.dynamo_add(row);
        self.seen[row as usize] = self.clock;
        if old_parent != parent && old_parent != NONE {
            self.release(old_parent);
        }
        if !same_tokens {
            self.compact_tokens_if_sparse();
        }
        row
    }

    /// The content key a block stored with `c` will have, where its parent's key is known
    /// (None: not known yet), with a hint for its slot in the content index where the row
    /// may be listed there, so that the slot's cache miss overlaps the work of making the
    /// row. It is `chain_of` the row once `add_row` has stored `c`: the same parent key,
    /// size, partial flag, LoRA and tokens.
    fn prefetch_content_slot(&self, c: &Content<'_>) -> Option<u64> {
        if !c.plain {
            return None;
        }
        // A name not met yet is interned in a moment: no key to guess now.
        let (lora, salt) = (self.known_id(c.lora)?, self.known_id(c.salt)?);
        let (parent, listed) = match c.parent {
            None => (self.root_key(salt), true),
            Some(p) => {
                let row = self.find(p)?;
                let r = &self.rows[row as usize];
                if r.flags & CHAINED == 0 {
                    return None;
                }
                // A new row made now is the one right after its parent's where no freed
                // row is reused: not listed, and its parent's only kid (no probe at all).
                let next = self.free.is_empty() && row as usize + 1 == self.rows.len();
                (chain_key(r), !next)
            }
        };
        let key = self.content_key(parent, c.block_size, c.partial, lora, c.tokens);
        if listed {
            self.content.prefetch(key);
        }
        Some(key)
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
        let block_size = self.shape(row).block_size;
        let shape = self.shape_id(Shape {
            block_size,
            lora,
            salt,
        });
        let r = &mut self.rows[row as usize];
        r.shape = shape;
        r.flags = (r.flags & !PLAIN) | if plain { PLAIN } else { 0 };
        self.rechain(row, None);
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
        let shape = self.shape(row);
        Some(Stored {
            parent: (r.parent != NONE).then(|| self.key(r.parent)),
            start: self.start_of(row),
            tokens: self.row_tokens(row),
            block_size: shape.block_size,
            partial: r.flags & PARTIAL != 0,
            lora: self.name(shape.lora),
            plain: r.flags & PLAIN != 0,
            salt: self.name(shape.salt),
        })
    }

    /// Every hash with content.
    pub fn stored_keys(&self) -> Vec<&[u8]> {
        self.live_rows()
            .filter(|&r| self.rows[r as usize].flags & STORED != 0)
            .map(|r| self.key(r))
            .collect()
    }
}
