//! kvledger's compiled core, one Python extension module: `kvledger._core`.
//!
//! - `Group` (group.rs, py_group.rs): one (model, group)'s blocks and holders, the router
//!   index's core: lookups by hashes or by tokens (a content key per block) in one call,
//!   under a secret hash seed per group (masks.rs: the holder runs);
//! - `decode` / `encode` / `MalformedAvroError` (avro.rs, wire.rs): Avro binary coding of
//!   the envelope schema's programs (kvledger.schemas.avro_program);
//! - `dynamo_token_query` / `dynamo_packed_hashes` (dynamo_query.rs): Dynamo's /query
//!   body to token ids and block hashes, a fast path beside the service's msgspec reading;
//! - `DynamoSlots` (dynamo_answer.rs): what a /query answer needs beside the walk, which
//!   `Group.dynamo_answer` writes as Dynamo's JSON in the same call;
//! - `BlockRows` / `upgrades` (plan_rows.rs): the block rows of one batch's plan and the
//!   content rules that make them, and `Residencies` (plan_refs.rs): the reference counts
//!   and history intervals it changes; both written out as PostgreSQL's binary COPY data
//!   (copy_data.rs).
//!
//! Each has a pure-Python twin under tests/helpers/, the tests' reference, that answers
//! identically (see README.md beside this file).

pub mod group;
pub mod masks;
pub mod slots;
pub mod wire;

mod avro;
mod copy_data;
mod dynamo_answer;
mod dynamo_query;
mod plan_refs;
mod plan_rows;
mod py_args;
mod py_group;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<py_group::Group>()?;
    m.add_class::<dynamo_answer::DynamoSlots>()?;
    m.add_class::<plan_rows::BlockRows>()?;
    m.add_class::<plan_refs::Residencies>()?;
    m.add_function(wrap_pyfunction!(plan_rows::upgrades_row, m)?)?;
    m.add_function(wrap_pyfunction!(py_group::dynamo_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(dynamo_query::dynamo_token_query, m)?)?;
    m.add_function(wrap_pyfunction!(dynamo_query::dynamo_packed_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(avro::decode, m)?)?;
    m.add_function(wrap_pyfunction!(avro::encode, m)?)?;
    m.add(
        "MalformedAvroError",
        m.py().get_type::<avro::MalformedAvroError>(),
    )?;
    Ok(())
}
