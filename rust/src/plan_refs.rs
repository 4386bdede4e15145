//! `Residencies`: the reference counts and history intervals one batch's plan changes,
//! held as compact data (the residency half of consumer/core/plan.py's work, as
//! `BlockRows` is the block half).
//!
//! A residency (a block hash held by an instance on a medium, with an ownership) exists
//! while its reference count is above zero: a history interval opens at 0→1 and closes at
//! 1→0 (never before it opened). A removal with no reference left is a no-op, never a
//! negative count. What the store held is read, never changed: each residency the batch
//! touches gets its own delta. The planner hands over a store or a removal event whole
//! (`store`, `remove`), and the scope-wide endings (`live`, `end`); the PostgreSQL store
//! takes the result as binary COPY data, other stores as ResidencyDeltas (`touched`).

use std::collections::HashMap;

use foldhash::fast::RandomState;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use crate::copy_data::{encode, Copy};
use crate::plan_rows::{key, mapping_get, Key};
use crate::py_args::{hash_list, key_bytes};

/// (model, group, instance, medium, ownership): whose references these are.
type Holder = (String, i64, String, String, String);

/// A residency's state: its count and what opened it.
#[derive(Clone, Debug, Default)]
struct Held {
    refcount: i64,
    locality: Option<String>,
    since_us: Option<i64>,
    topic: String,
    partition: i32,
    offset: i64,
}

/// A history interval this batch opened (and closed, when it ended in the batch).
struct Interval {
    stored_us: i64,
    locality: Option<String>,
    partition: i32,
    offset: i64,
    removed: Option<(i64, String)>,
}

struct Delta {
    holder: u32,
    hash: Box<[u8]>,
    before: i64,
    existed: bool,
    now: Held,
    close_existing: Option<(i64, String)>, // an interval an earlier batch opened
    intervals: Vec<Interval>,
    touched: bool,
    asked: usize, // when a change first asked for it (the order `touched` gives)
}

/// Where the message that changes a residency sits: its Kafka (topic, partition, offset).
#[derive(FromPyObject)]
struct At(String, i32, i64);

#[pyclass(module = "kvledger._core", name = "Residencies")]
pub struct Residencies {
    known: Option<Py<PyAny>>, // Mapping[ResidencyKey, Residency]: what the store held
    held: Option<Py<PyAny>>,  // Mapping[HolderKey, Collection[bytes]]: whole holders
    base: Option<Py<Residencies>>,
    micros: Option<Py<PyAny>>, // a store's datetime -> µs since the Unix epoch
    history: bool,
    holders: Vec<Holder>,
    holder_ids: HashMap<Holder, u32, RandomState>,
    names: Vec<[Py<PyString>; 4]>, // each holder's model, instance, medium and ownership
    base_ids: Vec<Option<u32>>,    // each holder's id in `base`
    deltas: Vec<Delta>,
    at: HashMap<Key, usize, RandomState>,
    changes: usize, // residencies a change asked for so far
}

impl Residencies {
    fn holder_id(&mut self, py: Python<'_>, holder: Holder) -> u32 {
        if let Some(&id) = self.holder_ids.get(&holder) {
            return id;
        }
        let id = self.holders.len() as u32;
        let (model, _, instance, medium, ownership) = &holder;
        self.names
            .push([model, instance, medium, ownership].map(|n| PyString::new(py, n).unbind()));
        let base_id = self
            .base
            .as_ref()
            .and_then(|b| b.borrow(py).holder_ids.get(&holder).copied());
        self.base_ids.push(base_id);
        self.holders.push(holder.clone());
        self.holder_ids.insert(holder, id);
        id
    }

    /// The state this batch's changes left for a residency (None: untouched, or none).
    fn touched_state(&self, holder: u32, hash: &[u8]) -> Option<&Delta> {
        let d = &self.deltas[*self.at.get(&key(holder, hash)[..])?];
        d.touched.then_some(d)
    }

    /// What the store held for a residency, as the batch before this one (if any) left it.
    fn stored(
        &self,
        py: Python<'_>,
        holder: u32,
        hash: &Bound<'_, PyBytes>,
    ) -> PyResult<Option<Held>> {
        if let (Some(base), Some(id)) = (&self.base, self.base_ids[holder as usize]) {
            if let Some(d) = base.borrow(py).touched_state(id, hash.as_bytes()) {
                return Ok((d.now.refcount > 0).then(|| d.now.clone()));
            }
        }
        let Some(known) = &self.known else {
            return Ok(None);
        };
        let [model, instance, medium, ownership] = &self.names[holder as usize];
        let group = self.holders[holder as usize].1;
        let wanted = (
            model.bind(py),
            group,
            hash,
            instance.bind(py),
            medium.bind(py),
            ownership.bind(py),
        );
        let Some(found) = mapping_get(known.bind(py), wanted.into_pyobject(py)?)? else {
            return Ok(None);
        };
        let since = found.getattr("since")?;
        let since_us = match &self.micros {
            Some(micros) => Some(micros.bind(py).call1((since,))?.extract()?),
            None => None,
        };
        Ok(Some(Held {
            refcount: found.getattr("refcount")?.extract()?,
            locality: found.getattr("locality")?.extract()?,
            since_us,
            topic: found.getattr("topic")?.extract()?,
            partition: found.getattr("partition")?.extract()?,
            offset: found.getattr("offset")?.extract()?,
        }))
    }

    /// The residency's delta, made from what the store held on first touch.
    fn delta(&mut self, py: Python<'_>, holder: u32, hash: &Bound<'_, PyBytes>) -> PyResult<usize> {
        let k = key(holder, hash.as_bytes());
        if let Some(&at) = self.at.get(&k[..]) {
            return Ok(at);
        }
        let held = self.stored(py, holder, hash)?;
        let delta = Delta {
            holder,
            hash: Box::from(hash.as_bytes()),
            before: held.as_ref().map_or(0, |h| h.refcount),
            existed: held.is_some(),
            now: held.unwrap_or_default(),
            close_existing: None,
            intervals: Vec::new(),
            touched: false,
            asked: usize::MAX,
        };
        let k: Key = Box::from(&k[..]);
        self.at.insert(k, self.deltas.len());
        self.deltas.push(delta);
        Ok(self.deltas.len() - 1)
    }

    fn count(&mut self, py: Python<'_>, holder: u32, hash: &Bound<'_, PyBytes>) -> PyResult<i64> {
        let at = self.delta(py, holder, hash)?;
        Ok(self.deltas[at].now.refcount)
    }

    /// Change a residency's reference count; false for a removal with no reference left.
    #[allow(clippy::too_many_arguments)]
    fn change(
        &mut self,
        py: Python<'_>,
        holder: u32,
        hash: &Bound<'_, PyBytes>,
        change: i64,
        when_us: i64,
        locality: Option<&str>,
        at: &At,
        how: &str,
    ) -> PyResult<bool> {
        let i = self.delta(py, holder, hash)?;
        let history = self.history;
        let d = &mut self.deltas[i];
        if d.asked == usize::MAX {
            d.asked = self.changes;
            self.changes += 1;
        }
        let before = d.now.refcount;
        if change < 0 && before == 0 {
            return Ok(false);
        }
        d.now.refcount = before + change;
        d.touched = true;
        if before == 0 {
            // 0 -> n: a residency and its history interval open
            d.now.locality = locality.map(str::to_owned);
            d.now.since_us = Some(when_us);
            d.now.topic.clone_from(&at.0);
            d.now.partition = at.1;
            d.now.offset = at.2;
            if history {
                d.intervals.push(Interval {
                    stored_us: when_us,
                    locality: locality.map(str::to_owned),
                    partition: at.1,
                    offset: at.2,
                    removed: None,
                });
            }
        } else if d.now.refcount == 0 && history {
            // n -> 0: they end
            match d.intervals.iter_mut().find(|i| i.removed.is_none()) {
                Some(open) => open.removed = Some((when_us.max(open.stored_us), how.to_owned())),
                None => d.close_existing = Some((when_us, how.to_owned())),
            }
        }
        Ok(true)
    }

    /// The touched deltas in key order (model, group, hash, instance, medium, ownership).
    fn sorted(&self) -> Vec<&Delta> {
        let mut out: Vec<&Delta> = self.deltas.iter().filter(|d| d.touched).collect();
        out.sort_by(|a, b| self.sort_key(a).cmp(&self.sort_key(b)));
        out
    }

    #[allow(clippy::type_complexity)]
    fn sort_key<'a>(&'a self, d: &'a Delta) -> (&'a str, i64, &'a [u8], &'a str, &'a str, &'a str) {
        let h = &self.holders[d.holder as usize];
        (&h.0, h.1, &d.hash, &h.2, &h.3, &h.4)
    }

    fn key_fields(&self, out: &mut Copy, d: &Delta) {
        let h = &self.holders[d.holder as usize];
        out.bytes(Some(h.0.as_bytes()));
        out.int4(h.1 as i32);
        out.bytes(Some(&d.hash));
        out.bytes(Some(h.2.as_bytes()));
        out.bytes(Some(h.3.as_bytes()));
        out.bytes(Some(h.4.as_bytes()));
    }

    fn key_tuple<'py>(&self, py: Python<'py>, d: &Delta) -> PyResult<Bound<'py, PyTuple>> {
        let h = &self.holders[d.holder as usize];
        (&h.0, h.1, PyBytes::new(py, &d.hash), &h.2, &h.3, &h.4).into_pyobject(py)
    }
}

/// (model, group, instance, medium, ownership) with None for "any" (a HolderScope).
type Scope = (String, Option<i64>, String, Option<String>, Option<String>);

fn covers(scope: &Scope, h: &Holder) -> bool {
    h.0 == scope.0
        && h.2 == scope.2
        && scope.1.is_none_or(|g| g == h.1)
        && scope.3.as_ref().is_none_or(|m| *m == h.3)
        && scope.4.as_ref().is_none_or(|o| *o == h.4)
}

#[pymethods]
impl Residencies {
    /// Residencies(known, held, base, history, micros): `known` maps a ResidencyKey to the
    /// Residency the store held, `held` a HolderKey to every hash it held (for the holders
    /// a batch ends whole); `base`: the residencies of the batch written before this one
    /// commits; `history`: whether the store keeps history intervals; `micros`: a store's
    /// time as µs since the Unix epoch.
    #[new]
    #[pyo3(signature = (known, held, base, history, micros))]
    fn new(
        known: Py<PyAny>,
        held: Py<PyAny>,
        base: Option<Py<Residencies>>,
        history: bool,
        micros: Py<PyAny>,
    ) -> Self {
        Residencies {
            known: Some(known),
            held: Some(held),
            base,
            micros: Some(micros),
            history,
            holders: Vec::new(),
            holder_ids: HashMap::default(),
            names: Vec::new(),
            base_ids: Vec::new(),
            deltas: Vec::new(),
            at: HashMap::default(),
            changes: 0,
        }
    }

    /// store(holder, hashes, when_us, locality, at, reports_reuse) -> how many hashes the
    /// holder (a HolderKey's fields) already held and reports as reused (no second
    /// reference); every other hash gains one. `at`: the message's (topic, partition,
    /// offset).
    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        py: Python<'_>,
        holder: Holder,
        hashes: &Bound<'_, PyAny>,
        when_us: i64,
        locality: Option<&str>,
        at: At,
        reports_reuse: bool,
    ) -> PyResult<usize> {
        let holder = self.holder_id(py, holder);
        let mut reused = 0;
        for h in hash_list(hashes)? {
            if reports_reuse && self.count(py, holder, &h)? > 0 {
                reused += 1; // a reused block reported: no second copy
            } else {
                self.change(py, holder, &h, 1, when_us, locality, &at, "removed")?;
            }
        }
        Ok(reused)
    }

    /// remove(holder, hashes, when_us, locality, at) -> how many hashes had no reference
    /// left (recorded no-ops).
    fn remove(
        &mut self,
        py: Python<'_>,
        holder: Holder,
        hashes: &Bound<'_, PyAny>,
        when_us: i64,
        locality: Option<&str>,
        at: At,
    ) -> PyResult<usize> {
        let holder = self.holder_id(py, holder);
        let mut noop = 0;
        for h in hash_list(hashes)? {
            if !self.change(py, holder, &h, -1, when_us, locality, &at, "removed")? {
                noop += 1;
            }
        }
        Ok(noop)
    }

    /// live(model, group, instance, medium, ownership) -> every residency in that scope
    /// (None: any group, medium or ownership) with a reference, as ResidencyKey fields in
    /// key order.
    #[allow(clippy::type_complexity)]
    fn live(
        &mut self,
        py: Python<'_>,
        model: String,
        group: Option<i64>,
        instance: String,
        medium: Option<String>,
        ownership: Option<String>,
    ) -> PyResult<Vec<(String, i64, Vec<u8>, String, String, String)>> {
        let scope: Scope = (model, group, instance, medium, ownership);
        let mut keys: Vec<(Holder, Vec<u8>)> = Vec::new();
        if let Some(held) = &self.held {
            for item in held.bind(py).call_method0("items")?.try_iter()? {
                let (holder, hashes): (Holder, Bound<'_, PyAny>) = item?.extract()?;
                if covers(&scope, &holder) {
                    for h in hashes.try_iter()? {
                        keys.push((holder.clone(), key_bytes(&h?)?.to_vec()));
                    }
                }
            }
        }
        if let Some(base) = &self.base {
            let base = base.borrow(py);
            for d in base
                .deltas
                .iter()
                .filter(|d| d.touched && d.now.refcount > 0)
            {
                let h = &base.holders[d.holder as usize];
                if covers(&scope, h) {
                    keys.push((h.clone(), d.hash.to_vec()));
                }
            }
        }
        for d in &self.deltas {
            let h = &self.holders[d.holder as usize];
            if covers(&scope, h) {
                keys.push((h.clone(), d.hash.to_vec()));
            }
        }
        let mut out = Vec::new();
        for (h, hash) in keys {
            let holder = self.holder_id(py, h.clone());
            if self.count(py, holder, &PyBytes::new(py, &hash))? > 0 {
                out.push((h.0, h.1, hash, h.2, h.3, h.4));
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// end(keys, how, when_us, at) -> {medium: residencies ended}:
    /// every reference of `keys` (ResidencyKey fields) dropped; `how`: the history's reason.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn end<'py>(
        &mut self,
        py: Python<'py>,
        keys: Vec<(String, i64, Vec<u8>, String, String, String)>,
        how: &str,
        when_us: i64,
        at: At,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ended = PyDict::new(py);
        let mut counts: Vec<(String, i64)> = Vec::new();
        for (model, group, hash, instance, medium, ownership) in keys {
            let holder = self.holder_id(py, (model, group, instance, medium.clone(), ownership));
            let hash = PyBytes::new(py, &hash);
            let count = self.count(py, holder, &hash)?;
            if count > 0 {
                self.change(py, holder, &hash, -count, when_us, None, &at, how)?;
                match counts.iter_mut().find(|(m, _)| *m == medium) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((medium, 1)),
                }
            }
        }
        for (medium, n) in counts {
            ended.set_item(medium, n)?;
        }
        Ok(ended)
    }

    /// sealed() -> these residencies, done with: what the store held and the batch before
    /// this one are let go (the next batch's reads them as its base).
    fn sealed(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        slf.known = None;
        slf.held = None;
        slf.base = None;
        slf.micros = None;
        slf
    }

    /// How many residencies the batch changed.
    fn __len__(&self) -> usize {
        self.deltas.iter().filter(|d| d.touched).count()
    }

    /// touched() -> per residency the batch changed, in the order a change first asked for
    /// it (successful or not: a removal with no reference left asks too): (key
    /// fields, before, refcount, existed, (locality, since_us, topic, partition, offset),
    /// (close_existing_us, close_existing_by) or None, [(stored_us, locality, partition,
    /// offset, removed_us, removed_by)]): a ResidencyDelta's fields.
    fn touched<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let mut deltas: Vec<&Delta> = self.deltas.iter().filter(|d| d.touched).collect();
        deltas.sort_by_key(|d| d.asked);
        let mut out = Vec::new();
        for d in deltas {
            let n = &d.now;
            let now = (
                n.locality.as_deref(),
                n.since_us,
                &n.topic,
                n.partition,
                n.offset,
            );
            let close = d.close_existing.as_ref().map(|(us, by)| (*us, by.as_str()));
            let intervals: Vec<_> = d
                .intervals
                .iter()
                .map(|i| {
                    let (removed_us, removed_by) = match &i.removed {
                        Some((us, by)) => (Some(*us), Some(by.as_str())),
                        None => (None, None),
                    };
                    (
                        i.stored_us,
                        i.locality.as_deref(),
                        i.partition,
                        i.offset,
                        removed_us,
                        removed_by,
                    )
                })
                .collect();
            let key = self.key_tuple(py, d)?;
            out.push(
                (key, d.before, n.refcount, d.existed, now, close, intervals).into_pyobject(py)?,
            );
        }
        Ok(out)
    }

    /// Whether an interval opened in this batch also closed in it.
    fn closes_own(&self) -> bool {
        self.deltas
            .iter()
            .any(|d| d.touched && d.intervals.iter().any(|i| i.removed.is_some()))
    }

    /// copy_closes() -> binary COPY data of the intervals earlier batches opened that this
    /// one closes (tables.HISTORY_CLOSE), in key order; None when there are none.
    fn copy_closes<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        encode(py, |out| {
            for d in self.sorted() {
                if let Some((us, by)) = &d.close_existing {
                    out.row(8);
                    self.key_fields(out, d);
                    out.timestamp(Some(*us));
                    out.bytes(Some(by.as_bytes()));
                }
            }
        })
    }

    /// copy_history(closed_at_us) -> binary COPY data of the intervals this batch opened
    /// (tables.RESIDENCY_HISTORY); one it also closed goes to `closed_at_us`'s partition.
    fn copy_history<'py>(
        &self,
        py: Python<'py>,
        closed_at_us: Option<i64>,
    ) -> Option<Bound<'py, PyBytes>> {
        encode(py, |out| {
            for d in self.sorted() {
                for i in &d.intervals {
                    out.row(13);
                    self.key_fields(out, d);
                    out.bytes(i.locality.as_deref().map(str::as_bytes));
                    out.timestamp(Some(i.stored_us));
                    out.timestamp(i.removed.as_ref().map(|r| r.0));
                    out.bytes(i.removed.as_ref().map(|r| r.1.as_bytes()));
                    out.int4(i.partition);
                    out.int8(Some(i.offset));
                    out.timestamp(i.removed.as_ref().and(closed_at_us));
                }
            }
        })
    }

    /// copy_holders(existed=None) -> binary COPY data of the residencies to write
    /// (tables.RESIDENCIES): each with a reference, and each the store held (a count of 0
    /// deletes it); `existed`: only those the store held when the batch was planned (to
    /// merge), or only the new ones with a reference (to copy straight in).
    #[pyo3(signature = (existed=None))]
    fn copy_holders<'py>(
        &self,
        py: Python<'py>,
        existed: Option<bool>,
    ) -> Option<Bound<'py, PyBytes>> {
        encode(py, |out| {
            for d in self.sorted() {
                let n = &d.now;
                if (n.refcount > 0 || d.existed) && existed.is_none_or(|e| d.existed == e) {
                    out.row(12);
                    self.key_fields(out, d);
                    out.bytes(n.locality.as_deref().map(str::as_bytes));
                    out.timestamp(n.since_us);
                    out.bytes(Some(n.topic.as_bytes()));
                    out.int4(n.partition);
                    out.int8(Some(n.offset));
                    out.int4(n.refcount as i32);
                }
            }
        })
    }
}
