//! `MaskTable`: the Python face of `masks::Masks`, with `MaskDict`'s methods and answers.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};

use crate::masks::{Masks, MAX_HOLDERS};

/// Block hash -> holder-id bitmask, probed a whole prompt at a time.
#[pyclass(module = "kvledger._core", name = "MaskTable")]
pub struct MaskTable {
    table: Masks,
}

fn key_bytes<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    match key.cast::<PyBytes>() {
        Ok(bytes) => Ok(bytes.as_bytes()),
        Err(_) => Err(PyTypeError::new_err(format!(
            "a block hash is bytes, not {}",
            key.get_type().name()?
        ))),
    }
}

fn holder_id(bit: i64) -> PyResult<usize> {
    match usize::try_from(bit) {
        Ok(bit) if bit < MAX_HOLDERS => Ok(bit),
        _ => Err(PyValueError::new_err("a holder id is in [0, 2**20)")),
    }
}

/// A mask's words as one Python int.
fn mask_int<'py>(py: Python<'py>, words: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    if words[1..].iter().all(|&w| w == 0) {
        return Ok(words[0].into_pyobject(py)?.into_any());
    }
    static FROM_BYTES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let from_bytes = FROM_BYTES.get_or_try_init(py, || {
        py.get_type::<PyInt>()
            .getattr("from_bytes")
            .map(Bound::unbind)
    })?;
    let raw: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    from_bytes
        .bind(py)
        .call1((PyBytes::new(py, &raw), "little"))
}

/// Every item of `hashes` as bytes (TypeError for one that is not).
fn hash_list<'py>(hashes: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut out = Vec::with_capacity(hashes.len().unwrap_or(0));
    for item in hashes.try_iter()? {
        let item = item?;
        key_bytes(&item)?;
        out.push(item.cast_into::<PyBytes>().map_err(PyErr::from)?);
    }
    Ok(out)
}

#[pymethods]
impl MaskTable {
    #[new]
    fn new() -> Self {
        MaskTable {
            table: Masks::new(),
        }
    }

    /// set_bit(key, bit) -> bool: the holder with id bit holds key; whether key is new.
    fn set_bit(&mut self, key: &Bound<'_, PyAny>, bit: i64) -> PyResult<bool> {
        let bit = holder_id(bit)?;
        Ok(self.table.set_bit(key_bytes(key)?, bit))
    }

    /// set_end(key, end) -> bool: key's token end, if key is held (whether it is).
    fn set_end(&mut self, key: &Bound<'_, PyAny>, end: i64) -> PyResult<bool> {
        Ok(self.table.set_end(key_bytes(key)?, end))
    }

    /// clear_bit(key, bit) -> bool: it no longer does; whether anyone still holds key.
    fn clear_bit(&mut self, key: &Bound<'_, PyAny>, bit: i64) -> PyResult<bool> {
        let bit = holder_id(bit)?;
        Ok(self.table.clear_bit(key_bytes(key)?, bit))
    }

    fn has_bit(&self, key: &Bound<'_, PyAny>, bit: i64) -> PyResult<bool> {
        let bit = holder_id(bit)?;
        Ok(self.table.has_bit(key_bytes(key)?, bit))
    }

    /// get(key, default=None): key's mask as an int.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(bytes) = key.cast::<PyBytes>() {
            if let Some(row) = self.table.find(bytes.as_bytes()) {
                return mask_int(py, &self.table.words(row));
            }
        }
        Ok(default.unwrap_or_else(|| py.None().into_bound(py)))
    }

    /// mask(key): key's mask as an int (0: nobody's).
    fn mask<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match self.table.find(key_bytes(key)?) {
            Some(row) => mask_int(py, &self.table.words(row)),
            None => Ok(0u64.into_pyobject(py)?.into_any()),
        }
    }

    /// A list of (key, mask).
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for row in 0..self.table.len() {
            let pair = (
                PyBytes::new(py, self.table.key(row)),
                mask_int(py, &self.table.words(row))?,
            );
            out.append(pair)?;
        }
        Ok(out)
    }

    /// A list of the keys.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            (0..self.table.len()).map(|row| PyBytes::new(py, self.table.key(row))),
        )
    }

    /// held_by(bit): the keys that holder holds.
    fn held_by<'py>(&self, py: Python<'py>, bit: i64) -> PyResult<Bound<'py, PyList>> {
        let rows = self.table.held_by(holder_id(bit)?);
        PyList::new(
            py,
            rows.into_iter()
                .map(|row| PyBytes::new(py, self.table.key(row))),
        )
    }

    /// runs(hashes) -> [(holder id, run length, token end)] for every holder of hashes[0].
    fn runs<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        let found = self.table.runs(&keys);
        let rows: PyResult<Vec<Bound<'py, PyTuple>>> =
            found.into_iter().map(|run| run.into_pyobject(py)).collect();
        PyList::new(py, rows?)
    }

    /// runs_covered(hashes, ratio): runs where a position is also covered by the last hash
    /// of its block (ratio hashes a block).
    fn runs_covered<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        ratio: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let Ok(ratio) = usize::try_from(ratio) else {
            return Err(PyValueError::new_err("ratio must be positive"));
        };
        if ratio == 0 {
            return Err(PyValueError::new_err("ratio must be positive"));
        }
        let hashes = hash_list(hashes)?;
        let keys: Vec<&[u8]> = hashes.iter().map(|h| h.as_bytes()).collect();
        let found = self.table.runs_covered(&keys, ratio);
        let rows: PyResult<Vec<Bound<'py, PyTuple>>> =
            found.into_iter().map(|run| run.into_pyobject(py)).collect();
        PyList::new(py, rows?)
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        match key.cast::<PyBytes>() {
            Ok(bytes) => self.table.find(bytes.as_bytes()).is_some(),
            Err(_) => false,
        }
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.keys(py)?.try_iter()?.into_any())
    }

    /// The table's hash of a key under its own seed (for tests of the seeding).
    fn _hash(&self, key: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.table.hash_of(key_bytes(key)?))
    }
}
