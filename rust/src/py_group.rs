//! `Group`: the Python face of `group::Group` (`kvledger.serving.router.groups` imports it), with
//! the methods of the tests' pure-Python twin `tests/helpers/pure_router/group.py`'s `PureGroup`
//! and its answers.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};

use crate::dynamo_answer::{self, DynamoSlots};
use crate::group::{Content, Group as Core, StoreRun};
use crate::masks::MAX_HOLDERS;
use crate::py_args::{hash_list, key_bytes, token_list, u32_token_list};

/// One (model, group)'s blocks and holders, looked up a whole prompt at a time.
#[pyclass(module = "kvledger._core", name = "Group")]
pub struct Group {
    core: Core,
}

fn holder_id(hid: i64) -> PyResult<usize> {
    match usize::try_from(hid) {
        Ok(hid) if hid < MAX_HOLDERS => Ok(hid),
        _ => Err(PyValueError::new_err("a holder id is in [0, 2**20)")),
    }
}

#[pymethods]
impl Group {
    #[new]
    fn new() -> Self {
        Group { core: Core::new() }
    }

    /// add_row(hash, parent, token_start, tokens, block_size, partial, lora_name, plain,
    /// salt=None): a store's content for the hash (replacing what the group had); `salt`: a
    /// first block's cache salt.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (key, parent, token_start, tokens, block_size, partial, lora_name, plain, salt=None))]
    fn add_row(
        &mut self,
        key: &Bound<'_, PyAny>,
        parent: Option<Bound<'_, PyAny>>,
        token_start: Option<i64>,
        tokens: Vec<i32>,
        block_size: i32,
        partial: bool,
        lora_name: Option<String>,
        plain: bool,
        salt: Option<String>,
    ) -> PyResult<()> {
        let parent = parent.as_ref().map(key_bytes).transpose()?;
        let content = Content {
            parent,
            start: token_start,
            tokens: &tokens,
            block_size,
            partial,
            lora: lora_name.as_deref(),
            plain,
            salt: salt.as_deref(),
        };
        self.core.add_row(key_bytes(key)?, &content);
        Ok(())
    }

    /// row(hash) -> (parent, token_start, token_ids, block_size, partial), or None: the
    /// content a store brought (a BlockRow's fields).
    fn row<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(s) = self.core.stored(key_bytes(key)?) else {
            return Ok(None);
        };
        let parent = s.parent.map(|p| PyBytes::new(py, p));
        let tokens = PyTuple::new(py, s.tokens)?;
        Ok(Some(
            (parent, s.start, tokens, s.block_size, s.partial).into_pyobject(py)?,
        ))
    }

    /// meta(hash) -> (lora_name, plain, salt), or None.
    #[allow(clippy::type_complexity)]
    fn meta(
        &self,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(Option<String>, bool, Option<String>)>> {
        Ok(self.core.stored(key_bytes(key)?).map(|s| {
            (
                s.lora.map(str::to_owned),
                s.plain,
                s.salt.map(str::to_owned),
            )
        }))
    }

    /// set_meta(hash, lora_name, plain, salt=None): a known block's LoRA, extra-keys flag
    /// and first block's salt.
    #[pyo3(signature = (key, lora_name, plain, salt=None))]
    fn set_meta(
        &mut self,
        key: &Bound<'_, PyAny>,
        lora_name: Option<String>,
        plain: bool,
        salt: Option<String>,
    ) -> PyResult<()> {
        self.core.set_meta(
            key_bytes(key)?,
            lora_name.as_deref(),
            plain,
            salt.as_deref(),
        );
        Ok(())
    }

    /// hold(hash, holder id, refcount): one residency's reference count (0: it ends).
    fn hold(&mut self, key: &Bound<'_, PyAny>, hid: i64, refcount: i64) -> PyResult<()> {
        let hid = holder_id(hid)?;
        let Ok(refcount) = u32::try_from(refcount) else {
            return Err(PyValueError::new_err("a reference count is in [0, 2**32)"));
        };
        self.core.hold(key_bytes(key)?, hid, refcount);
        Ok(())
    }

    fn refcount(&self, key: &Bound<'_, PyAny>, hid: i64) -> PyResult<u32> {
        Ok(self.core.refcount(key_bytes(key)?, holder_id(hid)?))
    }

    fn held_by<'py>(&self, py: Python<'py>, hid: i64) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.core
                .held_by(holder_id(hid)?)
                .into_iter()
                .map(|k| PyBytes::new(py, k)),
        )
    }

    /// Every residency: [(hash, holder id, refcount)].
    fn residencies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (key, hid, count) in self.core.residencies() {
            out.append((PyBytes::new(py, key), hid, count))?;
        }
        Ok(out)
    }

    /// The hashes a store brought content for.
    fn hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.core
                .stored_keys()
                .into_iter()
                .map(|k| PyBytes::new(py, k)),
        )
    }

    fn end_of(&self, key: &Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.core.end_of(key_bytes(key)?))
    }

    /// store_run(hashes, parent, token_start, tokens, block_size, partial, lora_name, hid,
    /// reports) -> reused blocks, or None: a store event applied whole for holder `hid` when
    /// its blocks are new or stored with this content already (else declined, nothing
    /// changed: the rules decide it). See rust/src/group/events.rs.
    #[allow(clippy::too_many_arguments)]
    fn store_run(
        &mut self,
        hashes: &Bound<'_, PyAny>,
        parent: Option<Bound<'_, PyAny>>,
        token_start: Option<i64>,
        tokens: &Bound<'_, PyAny>,
        block_size: i32,
        partial: bool,
        lora_name: Option<String>,
        hid: i64,
        reports: bool,
    ) -> PyResult<Option<usize>> {
        let hid = holder_id(hid)?;
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        let parent = parent.as_ref().map(key_bytes).transpose()?;
        let tokens = token_list(tokens)?;
        let run = StoreRun {
            hashes: &keys,
            parent,
            start: token_start,
            tokens: &tokens,
            block_size,
            partial,
            lora: lora_name.as_deref(),
        };
        Ok(self.core.store_run(&run, hid, reports))
    }

    /// release_run(hashes, hid) -> no-op removals: a removal event applied for holder `hid`.
    fn release_run(&mut self, hashes: &Bound<'_, PyAny>, hid: i64) -> PyResult<usize> {
        let hid = holder_id(hid)?;
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        Ok(self.core.release_run(&keys, hid))
    }

    /// runs(hashes) -> [(holder id, matched blocks, token end)] for every holder of hashes[0].
    fn runs<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        PyList::new(py, self.core.runs(&keys))
    }

    /// runs_covered(hashes, ratio) -> [(holder id, run length)]: hash granularity.
    fn runs_covered<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        ratio: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let ratio = usize::try_from(ratio).ok().filter(|&r| r > 0);
        let Some(ratio) = ratio else {
            return Err(PyValueError::new_err("ratio must be positive"));
        };
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        PyList::new(py, self.core.runs_covered(&keys, ratio))
    }

    /// match_tokens(tokens, block_size, hash_block_size, lora_name, salt=None) -> runs: the
    /// token walk (of a salted prompt: from the first block of that cache salt).
    #[pyo3(signature = (tokens, block_size, hash_block_size, lora_name, salt=None))]
    fn match_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        block_size: i64,
        hash_block_size: i64,
        lora_name: Option<&str>,
        salt: Option<&str>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (Ok(bs), Ok(hbs)) = (
            usize::try_from(block_size),
            usize::try_from(hash_block_size),
        ) else {
            return Ok(PyList::empty(py));
        };
        if bs == 0 {
            return Ok(PyList::empty(py));
        }
        let tokens = token_list(tokens)?;
        PyList::new(
            py,
            self.core.match_tokens(&tokens, bs, hbs, lora_name, salt),
        )
    }

    /// held_path(tokens, block_size, lora_name, hid, salt=None) -> [hash]: the hashes of the
    /// blocks holder `hid` holds down the prompt's full blocks from the root (the token
    /// walk's rows, its own where a level has several), to the first it does not hold.
    #[pyo3(signature = (tokens, block_size, lora_name, hid, salt=None))]
    fn held_path<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        block_size: i64,
        lora_name: Option<&str>,
        hid: i64,
        salt: Option<&str>,
    ) -> PyResult<Bound<'py, PyList>> {
        let hid = holder_id(hid)?;
        let Ok(bs) = usize::try_from(block_size) else {
            return Ok(PyList::empty(py));
        };
        let tokens = token_list(tokens)?;
        let path = self.core.held_path(&tokens, bs, lora_name, salt, hid);
        PyList::new(py, path.into_iter().map(|k| PyBytes::new(py, k)))
    }

    /// enable_dynamo(): keep each full block's Dynamo local hash from now on.
    fn enable_dynamo(&mut self) {
        self.core.enable_dynamo();
    }

    /// dynamo_local(hash) -> int | None: the block's Dynamo local hash.
    fn dynamo_local(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        Ok(self.core.dynamo_local(key_bytes(key)?))
    }

    /// dynamo_levels(locals, block_size) -> [(holder id, levels held as an int's bits)]:
    /// the walk of a prompt's Dynamo local hashes (empty before enable_dynamo).
    fn dynamo_levels<'py>(
        &self,
        py: Python<'py>,
        locals: Vec<u64>,
        block_size: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let Ok(bs) = i32::try_from(block_size) else {
            return Ok(out);
        };
        let from_bytes = py.get_type::<PyInt>().getattr("from_bytes")?;
        for (hid, words) in self.core.dynamo_levels(&locals, bs) {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let bits = from_bytes.call1((PyBytes::new(py, &bytes), "little"))?;
            out.append((hid, bits))?;
        }
        Ok(out)
    }

    /// dynamo_runs(locals, block_size, slots) -> [(slot, gpu, cpu, disk)]: see
    /// `Group::dynamo_runs` (rust/src/group/dynamo.rs).
    fn dynamo_runs(
        &self,
        locals: Vec<u64>,
        block_size: i64,
        slots: Vec<i64>,
    ) -> Vec<(u32, u32, u32, u32)> {
        match i32::try_from(block_size) {
            Ok(bs) => self.core.dynamo_runs(&locals, bs, &slots),
            Err(_) => Vec::new(),
        }
    }

    /// dynamo_answer(locals, block_size, slots, cut) -> bytes: Dynamo's /query answer
    /// (JSON) of the walk of `locals`, per `slots` (a `DynamoSlots`), scoring the slots
    /// seen at or after `cut` (µs since the epoch): see rust/src/dynamo_answer.rs.
    fn dynamo_answer<'py>(
        &self,
        py: Python<'py>,
        locals: Vec<u64>,
        block_size: i64,
        slots: PyRef<'_, DynamoSlots>,
        cut: i64,
    ) -> Bound<'py, PyBytes> {
        let runs = match i32::try_from(block_size) {
            Ok(bs) => self.core.dynamo_runs(&locals, bs, &slots.holders),
            Err(_) => Vec::new(),
        };
        let body = dynamo_answer::answer(&runs, &slots, block_size.unsigned_abs(), cut);
        PyBytes::new(py, &body)
    }

    /// dynamo_answer_packed(packed, block_size, seed, slots, cut) -> bytes: as
    /// `dynamo_answer` of the Dynamo local hashes of packed u32 LE token ids (what
    /// `dynamo_token_query` reads from a /query body) under `seed`: no Python int per hash.
    fn dynamo_answer_packed<'py>(
        &self,
        py: Python<'py>,
        packed: &[u8],
        block_size: i64,
        seed: u64,
        slots: PyRef<'_, DynamoSlots>,
        cut: i64,
    ) -> Bound<'py, PyBytes> {
        let runs = match (i32::try_from(block_size), usize::try_from(block_size)) {
            (Ok(bs), Ok(size)) => {
                let locals = crate::dynamo_query::packed_hashes(packed, size, seed);
                self.core.dynamo_runs(&locals, bs, &slots.holders)
            }
            _ => Vec::new(),
        };
        let body = dynamo_answer::answer(&runs, &slots, block_size.unsigned_abs(), cut);
        PyBytes::new(py, &body)
    }

    /// set_clock(now): the time (whole seconds, in [0, 2**32)) that stores and holders
    /// from now on stamp on the blocks they touch.
    fn set_clock(&mut self, now: u32) {
        self.core.set_clock(now);
    }

    /// expire(cutoff) -> int: drop the blocks no one holds, no block names as its parent,
    /// and nothing touched before `cutoff` (a clock time); how many went.
    fn expire(&mut self, cutoff: u32) -> usize {
        self.core.expire(cutoff)
    }

    /// expire_some(cutoff, rows) -> (dropped, done): expire over the next `rows` rows from
    /// where the last call stopped; `done`: the pass reached the last row.
    fn expire_some(&mut self, cutoff: u32, rows: usize) -> (usize, bool) {
        self.core.expire_some(cutoff, rows)
    }

    fn __len__(&self) -> usize {
        self.core.blocks()
    }

    /// The group's hash of a key under its own seed (for tests of the seeding).
    fn _hash(&self, key: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.core.hash_of(key_bytes(key)?))
    }
}

/// dynamo_block_hashes(token_ids, block_size, seed) -> [int]: Dynamo's local hash of each
/// full block (kvledger.schemas.dynamo's, natively).
#[pyfunction]
pub fn dynamo_block_hashes(
    tokens: &Bound<'_, PyAny>,
    block_size: i64,
    seed: u64,
) -> PyResult<Vec<u64>> {
    let Ok(bs) = usize::try_from(block_size) else {
        return Ok(Vec::new());
    };
    if bs == 0 {
        return Ok(Vec::new());
    }
    let tokens = u32_token_list(tokens)?;
    Ok(tokens
        .chunks_exact(bs)
        .map(|block| crate::group::local_hash(block, seed))
        .collect())
}
