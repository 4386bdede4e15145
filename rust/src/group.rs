//! One (model, group)'s blocks and holders: the router index's core, in plain Rust.
//!
//! Every block hash the group has met is a row: its content when a store brought it (parent,
//! position, tokens, size, partial, LoRA, whether it has extra keys), its holders as bits
//! (holder ids are the router's numbering of (instance, medium, ownership)), reference
//! counts above one, and how many rows name it as their parent. A hash met only as a parent
//! or as a residency (its store not seen yet) is a row without content; such a row goes
//! when nothing holds it and no row names it. Rows never move (a freed one is reused), so a
//! parent is a row number.
//!
//! Lookups are one call each and return the runs: for each holder of the first position,
//! how far it holds the prompt (blocks) and the token end of its last block.
//! - by hashes: one probe per position, every position's cache misses overlapped (the
//!   slots are prefetched before any is read, then the rows);
//! - by tokens: the chain from the root, level by level, by a content key per row — a hash,
//!   under the group's secret seed, of its parent row, size, partial flag, LoRA and tokens —
//!   so that each level is one probe per candidate parent, not a comparison of every
//!   child's tokens; the tokens of each candidate are then compared in full (answers are
//!   exact, whatever the hash does). A row right after its parent's (a block stored in the
//!   same event as the block before it: most rows) is looked at there, not by a probe, so
//!   the content index holds only the others.
//!
//! The answers are those of the pure-Python twin `PureGroup`, the tests' reference
//! (tests/helpers/pure_router/group.py; tests/unit/test_group.py and the `group` fuzz target
//! hold the core to it).

use std::collections::HashMap;
use std::hash::BuildHasher;

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use foldhash::fast::RandomState;

use crate::masks::MAX_HOLDERS;
use crate::slots::{Slots, NONE};
const LIVE: u8 = 1; // the row is in use (else on the free list)
const STORED: u8 = 2; // a store brought its content
const PARTIAL: u8 = 4;
const PLAIN: u8 = 8; // no extra keys: token walks may use it
const CHAINED: u8 = 16; // Row::chain is its content key (in Group::content)
const COUNTED: u8 = 32; // some residency of the row has a refcount above one (Group::counts)
const DYNAMO: u8 = 64; // the row is in Group::dynamo's table (see dynamo.rs)
                       // Another row has (or had) this row's content key: a token walk cannot take the row as
                       // its level's only one without a probe. Set on both rows when a second takes a key.
const SHARED: u8 = 128;

/// The content key of the root (what a first block's key is mixed with).
const ROOT: u64 = 0x6b76_6c65_6467_6572;
/// How many levels of a token walk are probed at once (their misses overlapped).
const LEVELS_AT_ONCE: usize = 16;

/// `Row::key_len` of a key longer than 8 bytes: `Row::key` holds its index in `Group::longs`.
const LONG: u8 = u8::MAX;

/// `Row::start` of a row whose position is not known.
const NO_START: u32 = u32::MAX;
/// `Row::start` of a position that takes more than 32 bits: in `Group::far_starts`.
const FAR_START: u32 = u32::MAX - 1;

/// A row's content key (its high half is all a row keeps: see `Group::content_key`).
#[inline]
fn chain_key(r: &Row) -> u64 {
    u64::from(r.chain) << 32
}

/// Where a LONG row's key is in `Group::longs`.
#[inline]
fn long_at(r: &Row) -> usize {
    u32::from_ne_bytes([r.key[0], r.key[1], r.key[2], r.key[3]]) as usize
}

/// A row's key: inline up to 8 bytes (an engine's int64 hash, the usual), else in `longs`.
#[inline]
fn key_in<'a>(r: &'a Row, longs: &'a [Box<[u8]>]) -> &'a [u8] {
    if r.key_len == LONG {
        &longs[long_at(r)]
    } else {
        &r.key[..r.key_len as usize]
    }
}

/// Whether a row's key is `key`: an 8-byte one as one compare, not a call to memcmp.
#[inline]
fn is_key(r: &Row, key: &[u8], longs: &[Box<[u8]>]) -> bool {
    match <[u8; 8]>::try_from(key) {
        Ok(k) => r.key_len == 8 && u64::from_ne_bytes(r.key) == u64::from_ne_bytes(k),
        Err(_) => key_in(r, longs) == key,
    }
}

/// One block hash's row: 56 bytes (what a row has rarely, a position past 32 bits or a
/// key past 8 bytes, is kept beside the rows; what few rows differ in, the block size,
/// LoRA and salt, is one interned shape).
struct Row {
    key: [u8; 8], // the key's bytes (key_len of them), or its index in Group::longs (LONG)
    word: u64,    // holders 0..64; further words in Group::wide
    parent: u32,
    tok_off: u32, // tokens: tok_len ids of tok_width bytes from word tok_off of Group::tokens
    tok_len: u32,
    shape: u32, // its block size, LoRA and salt: Group::shapes[shape]
    start: u32, // its first token's position; NO_START: not known; FAR_START: far_starts
    chain: u32, // the content key's high half, where CHAINED (see Group::chain_of)
    // The rows naming this one as their parent: a list through first_kid and the kids'
    // sibling links (doubly linked: a row changes parent in O(1)).
    first_kid: u32,
    next_sib: u32,
    prev_sib: u32,
    key_len: u8, // 0..=8, or LONG; 0 for a freed row
    tok_width: u8,
    flags: u8,
}

/// What a row's content is beside its tokens and parent, interned per group (a group's
/// rows share a few: one or two block sizes, a handful of LoRA names and salts).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(super) struct Shape {
    block_size: i32,
    lora: u32, // 0: none; else Group::loras[lora - 1]
    salt: u32, // a first block's cache salt: 0 none; else Group::loras[salt - 1]
}

/// A block's content as a store gives it.
pub struct Content<'a> {
    pub parent: Option<&'a [u8]>,
    pub start: Option<i64>,
    pub tokens: &'a [i32],
    pub block_size: i32,
    pub partial: bool,
    pub lora: Option<&'a str>,
    pub plain: bool,
    /// A first block's cache salt (its only extra key): the token walk of that salt starts
    /// at it. Kept for a block under the root only.
    pub salt: Option<&'a str>,
}

/// A block's content as the group keeps it.
pub struct Stored<'a> {
    pub parent: Option<&'a [u8]>,
    pub start: Option<i64>,
    pub tokens: tokens::Ids,
    pub block_size: i32,
    pub partial: bool,
    pub lora: Option<&'a str>,
    pub plain: bool,
    pub salt: Option<&'a str>,
}

pub type Run = (usize, usize, i64); // (holder id, matched blocks, token end)

pub struct Group {
    index: Slots, // block hash -> row
    rows: Vec<Row>,
    longs: Vec<Box<[u8]>>, // the keys longer than 8 bytes (an empty one: free)
    free_longs: Vec<u32>,
    // The row `find` found last: an engine stores a prompt's blocks in one event, and they
    // sit in consecutive rows, so the next key asked for is mostly this row's or the next's.
    hint: AtomicU32,
    free: Vec<u32>,
    live: usize,
    stored: usize,
    wide: Vec<u64>, // rows.len() * (width - 1)
    width: usize,
    // Per row, when a store or a holder last touched it (the caller's clock, in seconds):
    // a block no one holds or names as its parent goes once this is older than the
    // caller's retention (see `expire`).
    seen: Vec<u32>,
    clock: u32,
    sweep: usize, // where `expire_some` goes on from
    tokens: tokens::Arena,
    garbage: usize, // token words no row uses any more (see `compact_tokens_if_sparse`)
    loras: Vec<String>,
    lora_ids: HashMap<String, u32>,
    shapes: Vec<Shape>, // shapes[0]: a fresh row's (no size, LoRA or salt)
    shape_ids: HashMap<Shape, u32, RandomState>,
    last_shape: u32,                               // the id shape_id gave last
    far_starts: HashMap<u32, i64, RandomState>,    // per row, a position past 32 bits
    counts: HashMap<(u32, u32), u32, RandomState>, // (row, holder) -> refcount above 1
    content: Slots, // content key -> rows, but those right after their parent's (`listed`)
    seed: RandomState,
    dynamo: Option<Box<dynamo::Dynamo>>, // Dynamo's hashes, once asked for
}

impl Default for Group {
    fn default() -> Self {
        Self::new()
    }
}

impl Group {
    pub fn new() -> Self {
        Group {
            index: Slots::default(),
            rows: Vec::new(),
            longs: Vec::new(),
            free_longs: Vec::new(),
            hint: AtomicU32::new(NONE),
            free: Vec::new(),
            live: 0,
            stored: 0,
            wide: Vec::new(),
            width: 1,
            seen: Vec::new(),
            clock: 0,
            sweep: 0,
            tokens: tokens::Arena::default(),
            garbage: 0,
            loras: Vec::new(),
            lora_ids: HashMap::new(),
            shapes: vec![Shape::default()],
            shape_ids: HashMap::default(),
            last_shape: 0,
            far_starts: HashMap::default(),
            counts: HashMap::default(),
            content: Slots::default(),
            seed: RandomState::default(),
            dynamo: None,
        }
    }

    /// Rows with content (the blocks a store brought).
    pub fn blocks(&self) -> usize {
        self.stored
    }

    pub fn hash_of(&self, key: &[u8]) -> u64 {
        self.seed.hash_one(key)
    }

    // ------------------------------------------------------------------ the table
    /// The row of `key`: the row found last or the one after it where it is `key`'s, else
    /// by a probe.
    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(key, || self.hash_of(key))
    }

    /// `find`, with `key`'s hash made by `hash` where the index is probed.
    fn find_hashed(&self, key: &[u8], hash: impl FnOnce() -> u64) -> Option<u32> {
        let hint = self.hint.load(Relaxed);
        if !key.is_empty() {
            // (a freed row's key is empty: a key that is not can only be a live row's)
            for row in [hint, hint.wrapping_add(1)] {
                if let Some(r) = self.rows.get(row as usize) {
                    if is_key(r, key, &self.longs) {
                        self.hint.store(row, Relaxed);
                        return Some(row);
                    }
                }
            }
        }
        let found = self
            .index
            .rows(hash())
            .find(|&r| is_key(&self.rows[r as usize], key, &self.longs));
        if let Some(row) = found {
            self.hint.store(row, Relaxed);
        }
        found
    }

    /// The key of `row`.
    pub(super) fn key(&self, row: u32) -> &[u8] {
        key_in(&self.rows[row as usize], &self.longs)
    }

    /// A row's inline key bytes and length for `key` (a long one kept in `longs`).
    fn keep_key(&mut self, key: &[u8]) -> ([u8; 8], u8) {
        if key.len() <= 8 {
            let mut inline = [0u8; 8];
            inline[..key.len()].copy_from_slice(key);
            return (inline, key.len() as u8);
        }
        let boxed: Box<[u8]> = key.into();
        let at = match self.free_longs.pop() {
            Some(at) => {
                self.longs[at as usize] = boxed;
                at
            }
            None => {
                self.longs.push(boxed);
                u32::try_from(self.longs.len() - 1).expect("fewer than 2**32 long keys")
            }
        };
        let mut inline = [0u8; 8];
        inline[..4].copy_from_slice(&at.to_ne_bytes());
        (inline, LONG)
    }

    /// The row of `key`, made (without content) if it has none.
    fn intern(&mut self, key: &[u8]) -> u32 {
        match self.find(key) {
            Some(row) => row,
            None => self.intern_new(key, self.hash_of(key)),
        }
    }

    /// A row made (without content) for `key`, which has none; `hash`: its hash.
    pub(super) fn intern_new(&mut self, key: &[u8], hash: u64) -> u32 {
        debug_assert!(self.find(key).is_none() && hash == self.hash_of(key));
        if self.index.full() {
            self.index.grow();
        }
        let (inline, key_len) = self.keep_key(key);
        let fresh = Row {
            key: inline,
            key_len,
            word: 0,
            start: NO_START,
            parent: NONE,
            tok_off: 0,
            tok_len: 0,
            tok_width: 2,
            shape: 0,
            first_kid: NONE,
            next_sib: NONE,
            prev_sib: NONE,
            chain: 0,
            flags: LIVE,
        };
        let row = match self.free.pop() {
            Some(row) => {
                self.rows[row as usize] = fresh;
                self.seen[row as usize] = self.clock;
                row
            }
            None => {
                let row = u32::try_from(self.rows.len()).ok().filter(|&r| r != NONE);
                self.rows.push(fresh);
                self.seen.push(self.clock);
                self.wide.resize(self.wide.len() + self.width - 1, 0);
                row.expect("fewer than 2**32 - 1 blocks in one group")
            }
        };
        self.index.insert(hash, row);
        self.live += 1;
        self.hint.store(row, Relaxed);
        row
    }

    /// Drop a row without content that nobody holds and no row names (a freed one stays
    /// as it is).
    fn release(&mut self, row: u32) {
        let r = &self.rows[row as usize];
        if r.flags & LIVE == 0
            || r.flags & STORED != 0
            || r.first_kid != NONE
            || r.word != 0
            || self.wide_any(row)
        {
            return;
        }
        let hash = self.hash_of(key_in(r, &self.longs));
        self.index.remove(hash, row);
        if r.key_len == LONG {
            let at = long_at(r);
            self.longs[at] = Box::default();
            self.free_longs.push(at as u32);
        }
        if r.start == FAR_START {
            self.far_starts.remove(&row);
        }
        let r = &mut self.rows[row as usize];
        r.flags = 0;
        r.key_len = 0;
        r.start = NO_START;
        self.free.push(row);
        self.live -= 1;
    }

    // ------------------------------------------------------------------ holders
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

    fn wide_any(&self, row: u32) -> bool {
        let extra = self.width - 1;
        let at = row as usize * extra;
        self.wide[at..at + extra].iter().any(|&w| w != 0)
    }

    fn word(&self, row: u32, k: usize) -> u64 {
        if k == 0 {
            self.rows[row as usize].word
        } else {
            self.wide[row as usize * (self.width - 1) + k - 1]
        }
    }

    fn word_mut(&mut self, row: u32, k: usize) -> &mut u64 {
        if k == 0 {
            &mut self.rows[row as usize].word
        } else {
            &mut self.wide[row as usize * (self.width - 1) + k - 1]
        }
    }

    /// Set one residency's reference count (0: it ends).
    pub fn hold(&mut self, key: &[u8], hid: usize, refcount: u32) {
        assert!(hid < MAX_HOLDERS, "a holder id is in [0, 2**20)");
        if refcount == 0 {
            let Some(row) = self.find(key) else {
                return;
            };
            if hid < self.width * 64 {
                *self.word_mut(row, hid / 64) &= !(1u64 << (hid % 64));
            }
            self.uncount(row, hid);
            self.seen[row as usize] = self.clock;
            self.release(row);
            return;
        }
        let row = self.intern(key);
        self.hold_row(row, hid, refcount);
    }

    /// Set a residency of a row to a count above zero.
    pub(super) fn hold_row(&mut self, row: u32, hid: usize, refcount: u32) {
        self.widen(hid);
        self.seen[row as usize] = self.clock;
        *self.word_mut(row, hid / 64) |= 1u64 << (hid % 64);
        if refcount > 1 {
            self.counts.insert((row, hid as u32), refcount);
            self.rows[row as usize].flags |= COUNTED;
        } else {
            self.uncount(row, hid);
        }
    }

    /// The residency's refcount is one or none: no entry for it (most rows have none).
    fn uncount(&mut self, row: u32, hid: usize) {
        if self.rows[row as usize].flags & COUNTED != 0 {
            self.counts.remove(&(row, hid as u32));
        }
    }

    fn count(&self, row: u32, hid: usize) -> u32 {
        if self.rows[row as usize].flags & COUNTED == 0 {
            return 1;
        }
        self.counts.get(&(row, hid as u32)).copied().unwrap_or(1)
    }

    /// A row's residency count for a holder (0: none).
    pub(super) fn refcount_row(&self, row: u32, hid: usize) -> u32 {
        if self.holds(row, hid) {
            self.count(row, hid)
        } else {
            0
        }
    }

    fn holds(&self, row: u32, hid: usize) -> bool {
        hid < self.width * 64 && self.word(row, hid / 64) >> (hid % 64) & 1 == 1
    }

    /// The residency's reference count (0: none).
    pub fn refcount(&self, key: &[u8], hid: usize) -> u32 {
        match self.find(key) {
            Some(row) if self.holds(row, hid) => self.count(row, hid),
            _ => 0,
        }
    }

    fn live_rows(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.rows.len() as u32).filter(|&r| self.rows[r as usize].flags & LIVE != 0)
    }

    /// The hashes holder `hid` holds.
    pub fn held_by(&self, hid: usize) -> Vec<&[u8]> {
        self.live_rows()
            .filter(|&r| self.holds(r, hid))
            .map(|r| self.key(r))
            .collect()
    }

    /// Every residency: (hash, holder id, refcount).
    pub fn residencies(&self) -> Vec<(&[u8], usize, u32)> {
        let mut out = Vec::new();
        for row in self.live_rows() {
            for k in 0..self.width {
                let mut w = self.word(row, k);
                while w != 0 {
                    let hid = k * 64 + w.trailing_zeros() as usize;
                    let count = self.count(row, hid);
                    out.push((self.key(row), hid, count));
                    w &= w - 1;
                }
            }
        }
        out
    }

    /// A row's token end (None: no content or no position known).
    pub(super) fn token_end(&self, row: u32) -> Option<i64> {
        let r = &self.rows[row as usize];
        if r.flags & STORED == 0 {
            return None;
        }
        Some(self.start_of(row)?.wrapping_add(i64::from(r.tok_len)))
    }

    /// A row's position (None: not known).
    #[inline]
    pub(super) fn start_of(&self, row: u32) -> Option<i64> {
        match self.rows[row as usize].start {
            NO_START => None,
            FAR_START => self.far_starts.get(&row).copied(),
            near => Some(i64::from(near)),
        }
    }

    /// Set a row's position (one past 32 bits kept beside the rows).
    pub(super) fn set_start(&mut self, row: u32, start: Option<i64>) {
        if self.rows[row as usize].start == FAR_START {
            self.far_starts.remove(&row);
        }
        self.rows[row as usize].start = match start {
            None => NO_START,
            Some(s) => match u32::try_from(s) {
                Ok(near) if near < FAR_START => near,
                _ => {
                    self.far_starts.insert(row, s);
                    FAR_START
                }
            },
        };
    }

    /// A row's block size, LoRA and salt.
    #[inline]
    pub(super) fn shape(&self, row: u32) -> Shape {
        self.shapes[self.rows[row as usize].shape as usize]
    }

    /// The id of a shape, interned.
    pub(super) fn shape_id(&mut self, shape: Shape) -> u32 {
        // Mostly the shape asked for last (a group's stores share one or two).
        if self.shapes[self.last_shape as usize] == shape {
            return self.last_shape;
        }
        let id = if shape == Shape::default() {
            0
        } else if let Some(&id) = self.shape_ids.get(&shape) {
            id
        } else {
            let id = u32::try_from(self.shapes.len()).expect("fewer than 2**32 shapes a group");
            self.shapes.push(shape);
            self.shape_ids.insert(shape, id);
            id
        };
        self.last_shape = id;
        id
    }

    /// The id of a shape some row has had (NONE: none has).
    #[inline]
    pub(super) fn known_shape(&self, shape: Shape) -> u32 {
        if shape == Shape::default() {
            return 0;
        }
        self.shape_ids.get(&shape).copied().unwrap_or(NONE)
    }

    /// A row's token end, as a block-granularity match reports it (0: not known).
    fn end(&self, row: u32) -> i64 {
        self.token_end(row).unwrap_or(0)
    }

    pub fn end_of(&self, key: &[u8]) -> i64 {
        self.find(key).map_or(0, |row| self.end(row))
    }
}

mod content;
mod dynamo;
mod events;
mod expiry;
mod hashes;
mod tokens;
mod walk;
pub use dynamo::{local_hash, seed_for};
pub use events::StoreRun;
#[cfg(test)]
mod tests;
