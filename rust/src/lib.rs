//! kvledger's compiled core, one Python extension module: `kvledger._core`.
//!
//! - `MaskTable` (masks.rs, py_masks.rs): the router's holder masks, block hash -> holder
//!   bits, probed a whole prompt at a time under a per-table secret hash seed;
//! - `decode` / `encode` / `MalformedAvroError` (avro.rs, wire.rs): Avro binary coding of
//!   the envelope schema's programs (kvledger.schemas.avro_program).
//!
//! Each has a pure-Python twin that answers identically (see README.md beside this file).

pub mod masks;
pub mod wire;

mod avro;
mod py_masks;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<py_masks::MaskTable>()?;
    m.add_function(wrap_pyfunction!(avro::decode, m)?)?;
    m.add_function(wrap_pyfunction!(avro::encode, m)?)?;
    m.add(
        "MalformedAvroError",
        m.py().get_type::<avro::MalformedAvroError>(),
    )?;
    Ok(())
}
