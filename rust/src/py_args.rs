//! Arguments from Python: block hashes as bytes, token ids as int32s.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

pub(crate) fn key_bytes<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    Ok(key_object(key)?.as_bytes())
}

/// A block hash as its bytes object (TypeError for anything else).
pub(crate) fn key_object<'a, 'py>(key: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyBytes>> {
    match key.cast::<PyBytes>() {
        Ok(bytes) => Ok(bytes),
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

/// Token ids as int32s: a list or tuple of ints is read item by item through the stable
/// API (a prompt's thousands of ids cost ~12 ns each through pyo3's generic sequence
/// extraction, ~3 ns here); an int32 buffer is copied whole (no id read as a Python int);
/// anything else (another sequence, an item that is not exactly an int) through pyo3.
pub(crate) fn token_list(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    int_list(tokens, i64::from(i32::MIN), i64::from(i32::MAX), "an int32")
}

/// Token ids as Dynamo takes them, unsigned 32-bit (or int32s, the same four bytes), each
/// kept as the int32 of its bits.
pub(crate) fn u32_token_list(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    int_list(
        tokens,
        i64::from(i32::MIN),
        i64::from(u32::MAX),
        "a 32-bit integer",
    )
}

fn int_list(tokens: &Bound<'_, PyAny>, low: i64, high: i64, what: &str) -> PyResult<Vec<i32>> {
    // Any other sequence, or a list with an item that is not exactly an int: through pyo3.
    let generic = || -> PyResult<Vec<i32>> {
        let all: Vec<i64> = tokens.extract()?;
        all.into_iter()
            .map(|x| bits_of(x, low, high, what))
            .collect()
    };
    // A list or a tuple (what the decoder gives an event's token ids) is read in place.
    let (seq, n, is_list) = if let Ok(list) = tokens.cast::<PyList>() {
        (list.as_ptr(), list.len(), true)
    } else if let Ok(tuple) = tokens.cast::<PyTuple>() {
        (tuple.as_ptr(), tuple.len(), false)
    } else if let Ok(buffer) = PyBuffer::<i32>::get(tokens) {
        // An int32 buffer (array('i'), a NumPy int32 array): its ids copied as they are,
        // none read as a Python int.
        return buffer
            .to_vec(tokens.py())?
            .into_iter()
            .map(|x| bits_of(i64::from(x), low, high, what))
            .collect();
    } else {
        return generic();
    };
    let py = tokens.py();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: a list or tuple, the GIL held and no Python code run between the length
        // read and each item (only exact ints are read here: no __index__ runs); the item
        // is borrowed for the one call that reads it.
        let x = unsafe {
            let at = i as ffi::Py_ssize_t;
            let item = if is_list {
                ffi::PyList_GetItem(seq, at)
            } else {
                ffi::PyTuple_GetItem(seq, at)
            };
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            if ffi::PyLong_CheckExact(item) == 0 {
                return generic();
            }
            ffi::PyLong_AsLongLong(item)
        };
        if x == -1 {
            if let Some(err) = PyErr::take(py) {
                return Err(err);
            }
        }
        out.push(bits_of(x, low, high, what)?);
    }
    Ok(out)
}

/// ``x`` as the int32 of its low 32 bits, if it is in ``[low, high]``.
fn bits_of(x: i64, low: i64, high: i64, what: &str) -> PyResult<i32> {
    if x < low || x > high {
        return Err(PyValueError::new_err(format!(
            "a token id is {what}, not {x}"
        )));
    }
    Ok(x as u32 as i32)
}
