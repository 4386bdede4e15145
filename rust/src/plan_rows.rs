//! `BlockRows`: the block rows one batch's plan writes, held as compact data.
//!
//! The planner (consumer/core/plan.py) hands each BlockStored event over whole (`store`);
//! the rows it implies, the content rules and the merge of one batch's writes live here,
//! and the PostgreSQL store takes the result as binary COPY data (`copy_binary`) without a
//! Python object per row. Other stores read the rows as BlockWrites (`items`).
//!
//! The content rules (a row per hash):
//! - hash i of an event covers tokens `[start + i*size, +size)` and chains to hash i-1
//!   (the event's parent for i = 0);
//! - a row conflicts with what the index knows of the same hash when both are real rows
//!   and they disagree: at one block size, on tokens, parent or a known position; at two
//!   (a partial tail and a full block), on where they end or on the tokens they share
//!   (the shorter a suffix of the longer). A conflict rejects the whole event;
//! - content is kept from the first writer and replaced only by a row that upgrades it
//!   (`upgrades`); the LoRA name and extra keys are kept from the first writer that has
//!   them; first and last seen are the batch's earliest and latest event times.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};
use smallvec::SmallVec;

use crate::copy_data::encode;
use crate::py_args::{hash_list, key_bytes, key_object, token_list};

/// What the index knows of one block hash's content (a BlockRow's fields).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub parent: Option<Box<[u8]>>,
    pub start: Option<i64>,
    pub tokens: Box<[i32]>,
    pub size: i32,
    pub partial: bool,
}

impl Row {
    fn placeholder(&self) -> bool {
        self.size == 0
    }

    fn end(&self) -> Option<i64> {
        self.start.map(|s| s + self.tokens.len() as i64)
    }

    fn from_py(row: &Bound<'_, PyAny>) -> PyResult<Row> {
        let parent = row.get_item(0)?;
        let parent = if parent.is_none() {
            None
        } else {
            Some(key_bytes(&parent)?.into())
        };
        Ok(Row {
            parent,
            start: row.get_item(1)?.extract()?,
            tokens: token_list(&row.get_item(2)?)?.into(),
            size: row.get_item(3)?.extract()?,
            partial: row.get_item(4)?.extract()?,
        })
    }
}

/// Why `new` cannot describe the same hash as `existing` (None: they agree).
pub fn conflicts(existing: &Row, new: &Row) -> Option<&'static str> {
    if existing.placeholder() || new.placeholder() {
        return None;
    }
    if existing.size == new.size {
        if existing.tokens != new.tokens {
            return Some("same hash announced with different tokens");
        }
        if existing.parent != new.parent {
            return Some("same hash announced with a different parent");
        }
        if matches!((existing.start, new.start), (Some(a), Some(b)) if a != b) {
            return Some("same hash announced at a different position");
        }
        return None;
    }
    if matches!((existing.end(), new.end()), (Some(a), Some(b)) if a != b) {
        return Some("same hash announced ending at a different position");
    }
    let (shorter, longer) = if new.tokens.len() < existing.tokens.len() {
        (&new.tokens, &existing.tokens)
    } else {
        (&existing.tokens, &new.tokens)
    };
    if !longer.ends_with(shorter) {
        return Some("same hash announced with different tokens");
    }
    None
}

/// A full-size or real row replaces a placeholder or partial-tail row of the same hash,
/// and a row that knows its position replaces one of the same size that does not.
pub fn upgrades(known: &Row, new: &Row) -> bool {
    if new.placeholder() {
        return false;
    }
    known.placeholder()
        || (known.partial && !new.partial)
        || (known.start.is_none()
            && new.start.is_some()
            && known.size == new.size
            && known.partial == new.partial)
}

/// The rows of one event: hash i covers tokens `[start + i*size, +size)` (a slice clipped
/// to the tokens there are), its parent hash i-1.
pub fn explode(
    hashes: &[&[u8]],
    parent: Option<&[u8]>,
    tokens: &[i32],
    size: i32,
    start: Option<i64>,
    partial: bool,
) -> Vec<Row> {
    let width = usize::try_from(size).unwrap_or(0);
    let mut parent = parent.map(Box::from);
    let mut rows = Vec::with_capacity(hashes.len());
    for (i, h) in hashes.iter().enumerate() {
        let from = (i * width).min(tokens.len());
        let to = ((i + 1) * width).min(tokens.len());
        rows.push(Row {
            parent: parent.take(),
            start: start.map(|s| s + (i as i64) * i64::from(size)),
            tokens: tokens[from..to].into(),
            size,
            partial,
        });
        parent = Some(Box::from(*h));
    }
    rows
}

/// One row to write: its content, metadata from the first writer that had it, and the
/// times it was seen in the batch (µs since the Unix epoch).
struct Write {
    group: u32,
    hash: Box<[u8]>,
    row: Row,
    lora: Option<String>,
    extra: Option<String>,
    first_us: i64,
    last_us: i64,
    stored: bool, // the store held a row for the block when the batch was planned
}

/// A map key: a group's (or a holder's) id, then a block hash. Looked up from the stack
/// (`key`), stored boxed, so that a lookup allocates nothing.
pub(crate) type Key = Box<[u8]>;

pub(crate) fn key(id: u32, hash: &[u8]) -> SmallVec<[u8; 72]> {
    let mut out = SmallVec::new();
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(hash);
    out
}

/// A (model, group) as a map key: the group's eight bytes, then the model's.
fn group_key(model: &str, group: i64) -> SmallVec<[u8; 72]> {
    let mut out = SmallVec::new();
    out.extend_from_slice(&group.to_le_bytes());
    out.extend_from_slice(model.as_bytes());
    out
}

/// `mapping.get(key)`: a dict read in place, any other mapping through its method.
pub(crate) fn mapping_get<'py>(
    mapping: &Bound<'py, PyAny>,
    key: Bound<'py, PyTuple>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if let Ok(dict) = mapping.cast_exact::<PyDict>() {
        return dict.get_item(key);
    }
    let found = mapping.call_method1(pyo3::intern!(mapping.py(), "get"), (key,))?;
    Ok((!found.is_none()).then_some(found))
}

/// The block rows one batch's plan writes, over the rows the store held (a mapping from
/// BlockKey to BlockRow, read for the hashes the batch names) and, when the batch is
/// planned while the one before it is written, over that batch's rows.
#[pyclass(module = "kvledger._core", name = "BlockRows")]
pub struct BlockRows {
    known: Option<Py<PyAny>>,
    base: Option<Py<BlockRows>>,
    groups: Vec<(String, i64)>,
    group_ids: HashMap<Key, u32, RandomState>, // by `group_key`
    names: Vec<Py<PyString>>,                  // each group's model, for reading `known`
    writes: Vec<Write>,
    at: HashMap<Key, usize, RandomState>,
    looked: HashMap<Key, Option<Row>, RandomState>, // what `known` and `base` said
}

impl BlockRows {
    fn find_group(&self, model: &str, group: i64) -> Option<u32> {
        self.group_ids.get(&group_key(model, group)[..]).copied()
    }

    fn group_id(&mut self, py: Python<'_>, model: &str, group: i64) -> u32 {
        if let Some(id) = self.find_group(model, group) {
            return id;
        }
        let id = self.groups.len() as u32;
        self.groups.push((model.to_owned(), group));
        self.names.push(PyString::new(py, model).unbind());
        self.group_ids
            .insert(Box::from(&group_key(model, group)[..]), id);
        id
    }

    /// This batch's row of a block, if it wrote one.
    fn written(&self, model: &str, group: i64, hash: &[u8]) -> Option<&Row> {
        let id = self.find_group(model, group)?;
        let at = *self.at.get(&key(id, hash)[..])?;
        Some(&self.writes[at].row)
    }

    /// What the store held for a block, as the batch before this one (if any) left it.
    fn held(
        &mut self,
        py: Python<'_>,
        group: u32,
        hash: &Bound<'_, PyBytes>,
    ) -> PyResult<Option<Row>> {
        let k = key(group, hash.as_bytes());
        if let Some(row) = self.looked.get(&k[..]) {
            return Ok(row.clone());
        }
        let (model, idx) = &self.groups[group as usize];
        let before = match &self.base {
            Some(base) => base
                .borrow(py)
                .written(model, *idx, hash.as_bytes())
                .cloned(),
            None => None,
        };
        let row = match (before, &self.known) {
            (Some(row), _) => Some(row),
            (None, Some(known)) => {
                let name = self.names[group as usize].bind(py);
                let wanted = (name, *idx, hash).into_pyobject(py)?;
                match mapping_get(known.bind(py), wanted)? {
                    Some(found) => Some(Row::from_py(&found)?),
                    None => None,
                }
            }
            (None, None) => None,
        };
        self.looked.insert(Box::from(&k[..]), row.clone());
        Ok(row)
    }

    /// The row a block has now: this batch's, else the store's.
    fn current(
        &mut self,
        py: Python<'_>,
        group: u32,
        hash: &Bound<'_, PyBytes>,
    ) -> PyResult<Option<Row>> {
        match self.at.get(&key(group, hash.as_bytes())[..]) {
            Some(&at) => Ok(Some(self.writes[at].row.clone())),
            None => self.held(py, group, hash),
        }
    }

    fn sorted(&self, stored: Option<bool>) -> Vec<&Write> {
        let mut out: Vec<&Write> = self
            .writes
            .iter()
            .filter(|w| stored.is_none_or(|s| w.stored == s))
            .collect();
        out.sort_by(|a, b| {
            let (ga, gb) = (
                &self.groups[a.group as usize],
                &self.groups[b.group as usize],
            );
            (ga, &a.hash).cmp(&(gb, &b.hash))
        });
        out
    }
}

#[pymethods]
impl BlockRows {
    /// BlockRows(known, base=None): `known` maps a BlockKey to the BlockRow the store held
    /// (read with .get); `base`: the rows of the batch written before this one commits.
    #[new]
    #[pyo3(signature = (known, base=None))]
    fn new(known: Py<PyAny>, base: Option<Py<BlockRows>>) -> Self {
        BlockRows {
            known: Some(known),
            base,
            groups: Vec::new(),
            group_ids: HashMap::default(),
            names: Vec::new(),
            writes: Vec::new(),
            at: HashMap::default(),
            looked: HashMap::default(),
        }
    }

    /// store(model, group, hashes, tokens, block_size, start, parent, partial, lora_name,
    /// extra_keys, when_us) -> None, or why the event conflicts with a known row (then
    /// nothing of it is kept). `start`: the first token's position (None: unknown);
    /// `extra_keys`: one entry per hash (or fewer); `when_us`: the event's time.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (model, group, hashes, tokens, block_size, start, parent, partial, lora_name, extra_keys, when_us))]
    fn store(
        &mut self,
        py: Python<'_>,
        model: &str,
        group: i64,
        hashes: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        block_size: i32,
        start: Option<i64>,
        parent: Option<Bound<'_, PyAny>>,
        partial: bool,
        lora_name: Option<String>,
        extra_keys: Option<Vec<Option<String>>>,
        when_us: i64,
    ) -> PyResult<Option<String>> {
        let id = self.group_id(py, model, group);
        let objects = hash_list(hashes)?;
        let hashes: Vec<&[u8]> = objects.iter().map(|h| h.as_bytes()).collect();
        let tokens = token_list(tokens)?;
        let parent = parent.as_ref().map(key_bytes).transpose()?;
        let rows = explode(&hashes, parent, &tokens, block_size, start, partial);
        let mut before = Vec::with_capacity(rows.len());
        for (h, row) in objects.iter().zip(&rows) {
            let known = self.current(py, id, h)?;
            if let Some(why) = known.as_ref().and_then(|k| conflicts(k, row)) {
                return Ok(Some(format!("{why}: hash {}", hex(h.as_bytes()))));
            }
            before.push(known);
        }
        let extra = extra_keys.unwrap_or_default();
        for (i, ((h, row), known)) in hashes.iter().zip(rows).zip(before).enumerate() {
            let k = key(id, h);
            let Some(&at) = self.at.get(&k[..]) else {
                let stored = known.is_some();
                let row = match known {
                    Some(k) if !upgrades(&k, &row) => k,
                    _ => row,
                };
                self.at.insert(Box::from(&k[..]), self.writes.len());
                self.writes.push(Write {
                    group: id,
                    hash: Box::from(*h),
                    row,
                    lora: lora_name.clone(),
                    extra: extra.get(i).cloned().flatten(),
                    first_us: when_us,
                    last_us: when_us,
                    stored,
                });
                continue;
            };
            let w = &mut self.writes[at];
            if upgrades(&w.row, &row) {
                w.row = row;
            }
            if w.lora.is_none() {
                w.lora.clone_from(&lora_name);
            }
            if w.extra.is_none() {
                w.extra = extra.get(i).cloned().flatten();
            }
            w.first_us = w.first_us.min(when_us);
            w.last_us = w.last_us.max(when_us);
        }
        Ok(None)
    }

    /// token_end(model, group, hash) -> where the block's known row ends (None: no row,
    /// or its position is unknown).
    fn token_end(
        &mut self,
        py: Python<'_>,
        model: &str,
        group: i64,
        hash: &Bound<'_, PyAny>,
    ) -> PyResult<Option<i64>> {
        let id = self.group_id(py, model, group);
        Ok(self
            .current(py, id, key_object(hash)?)?
            .and_then(|r| r.end()))
    }

    /// sealed() -> these rows, done with: what the store held and the batch before this one
    /// are let go (a plan keeps its rows, and the next batch's reads them as its base).
    fn sealed(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        slf.known = None;
        slf.base = None;
        slf.looked = HashMap::default();
        slf
    }

    fn __len__(&self) -> usize {
        self.writes.len()
    }

    /// items() -> [((model, group, hash), (parent, token_start, token_ids, block_size,
    /// partial), (lora_name, extra_keys, first_us, last_us, stored))], in the order written:
    /// a BlockKey, a BlockRow and the rest of a BlockWrite.
    #[allow(clippy::type_complexity)]
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let mut out = Vec::with_capacity(self.writes.len());
        for w in &self.writes {
            let (model, group) = &self.groups[w.group as usize];
            let r = &w.row;
            let key = (model.as_str(), *group, PyBytes::new(py, &w.hash));
            let parent = r.parent.as_deref().map(|p| PyBytes::new(py, p));
            let row = (
                parent,
                r.start,
                PyTuple::new(py, r.tokens.iter())?,
                r.size,
                r.partial,
            );
            let meta = (
                w.lora.as_deref(),
                w.extra.as_deref(),
                w.first_us,
                w.last_us,
                w.stored,
            );
            out.push((key, row, meta).into_pyobject(py)?);
        }
        Ok(out)
    }

    /// copy_binary(stored=None) -> the rows (those the store held when planned, or those it
    /// did not, or all) in key order, as PostgreSQL's binary COPY data for kvledger.blocks'
    /// columns (tables.BLOCKS); None when there are none.
    #[pyo3(signature = (stored=None))]
    fn copy_binary<'py>(
        &self,
        py: Python<'py>,
        stored: Option<bool>,
    ) -> Option<Bound<'py, PyBytes>> {
        encode(py, |out| {
            for w in self.sorted(stored) {
                let (model, group) = &self.groups[w.group as usize];
                out.row(13);
                out.bytes(Some(model.as_bytes()));
                out.int4(*group as i32);
                out.bytes(Some(&w.hash));
                out.bytes(w.row.parent.as_deref());
                out.int8(w.row.start);
                out.int8(w.row.end());
                out.int4_array(&w.row.tokens);
                out.int4(w.row.size);
                out.boolean(w.row.partial);
                out.bytes(w.lora.as_deref().map(str::as_bytes));
                out.bytes(w.extra.as_deref().map(str::as_bytes));
                out.timestamp(Some(w.first_us));
                out.timestamp(Some(w.last_us));
            }
        })
    }
}

/// upgrades(known, new) -> whether a store replaces the content `known` (a BlockRow) with
/// `new`'s (the rule the planner applies, for stores merging what another writer stored).
#[pyfunction]
#[pyo3(name = "upgrades")]
pub fn upgrades_row(known: &Bound<'_, PyAny>, new: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(upgrades(&Row::from_py(known)?, &Row::from_py(new)?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(parent: Option<&[u8]>, start: Option<i64>, tokens: &[i32], size: i32) -> Row {
        Row {
            parent: parent.map(Box::from),
            start,
            tokens: tokens.into(),
            size,
            partial: false,
        }
    }

    #[test]
    fn an_event_explodes_into_chained_slices() {
        let rows = explode(&[b"a", b"b"], Some(b"p"), &[1, 2, 3], 2, Some(4), false);
        assert_eq!(rows[0], row(Some(b"p"), Some(4), &[1, 2], 2));
        assert_eq!(rows[1], row(Some(b"a"), Some(6), &[3], 2));
    }

    #[test]
    fn a_partial_tail_agrees_with_the_full_block_it_ends() {
        let full = row(None, Some(0), &[1, 2, 3, 4], 4);
        let tail = Row {
            partial: true,
            ..row(None, Some(2), &[3, 4], 2)
        };
        assert_eq!(conflicts(&full, &tail), None);
        assert!(upgrades(&tail, &full));
        assert!(!upgrades(&full, &tail));
        let shifted = Row {
            start: Some(3),
            ..tail.clone()
        };
        assert_eq!(
            conflicts(&full, &shifted),
            Some("same hash announced ending at a different position")
        );
    }

    #[test]
    fn nothing_replaces_a_row_with_a_placeholder() {
        let real = row(None, Some(0), &[1, 2], 2);
        let placeholder = row(None, None, &[], 0);
        assert!(!upgrades(&real, &placeholder));
        assert!(upgrades(&placeholder, &real));
        assert_eq!(conflicts(&real, &placeholder), None);
    }
}
