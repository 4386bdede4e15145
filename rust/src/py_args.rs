//! Arguments from Python: block hashes as bytes, token ids as int32s.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

pub(crate) fn key_bytes<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    match key.cast::<PyBytes>() {
        Ok(bytes) => Ok(bytes.as_bytes()),
        Err(_) => Err(PyTypeError::new_err(format!(
            "a block hash is bytes, not {}",
            key.get_type().name()?
        ))),
    }
}

/// Every item of `hashes` as bytes (TypeError for one that is not).
pub(crate) fn hash_list<'py>(hashes: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut out = Vec::with_capacity(hashes.len().unwrap_or(0));
    for item in hashes.try_iter()? {
        let item = item?;
        key_bytes(&item)?;
        out.push(item.cast_into::<PyBytes>().map_err(PyErr::from)?);
    }
    Ok(out)
}

/// Token ids as int32s: a list of ints is read item by item through the stable API (a
/// prompt's thousands of ids cost ~12 ns each through pyo3's generic sequence extraction);
/// anything else (another sequence, an item that is not exactly an int) through pyo3.
pub(crate) fn token_list(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let Ok(list) = tokens.cast::<PyList>() else {
        return tokens.extract();
    };
    let py = tokens.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: a list, the GIL held and no Python code run between the length read and
        // each item (only exact ints are read here: no __index__ runs); the item is
        // borrowed for the one call that reads it.
        let x = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            if ffi::PyLong_CheckExact(item) == 0 {
                return tokens.extract();
            }
            ffi::PyLong_AsLongLong(item)
        };
        if x == -1 {
            if let Some(err) = PyErr::take(py) {
                return Err(err);
            }
        }
        match i32::try_from(x) {
            Ok(x) => out.push(x),
            Err(_) => {
                return Err(PyValueError::new_err(format!(
                    "a token id is an int32, not {x}"
                )))
            }
        }
    }
    Ok(out)
}
