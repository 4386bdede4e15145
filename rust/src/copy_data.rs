//! PostgreSQL's binary COPY format, written by the plan's compact halves (plan_rows.rs,
//! plan_refs.rs) for the PostgreSQL store: a signature, rows of length-prefixed fields
//! (-1: NULL), a trailer. The store sends it as it is (consumer/store/copy.py `copy_data`).
//! The rows are written with the GIL released: the writer thread encodes one batch while
//! the planner thread plans the next (consumer/ahead.py).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// µs from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
const POSTGRES_EPOCH_US: i64 = 946_684_800_000_000;

pub(crate) struct Copy {
    out: Vec<u8>,
    rows: usize,
}

impl Copy {
    fn new() -> Copy {
        let mut out = Vec::with_capacity(1 << 16);
        out.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
        out.extend_from_slice(&0i32.to_be_bytes()); // flags
        out.extend_from_slice(&0i32.to_be_bytes()); // header extension length
        Copy { out, rows: 0 }
    }

    pub(crate) fn row(&mut self, fields: i16) {
        self.rows += 1;
        self.out.extend_from_slice(&fields.to_be_bytes());
    }

    fn field(&mut self, len: usize) {
        self.out.extend_from_slice(&(len as i32).to_be_bytes());
    }

    fn null(&mut self) {
        self.out.extend_from_slice(&(-1i32).to_be_bytes());
    }

    /// bytea or text (UTF-8), or NULL.
    pub(crate) fn bytes(&mut self, value: Option<&[u8]>) {
        match value {
            Some(v) => {
                self.field(v.len());
                self.out.extend_from_slice(v);
            }
            None => self.null(),
        }
    }

    pub(crate) fn int4(&mut self, value: i32) {
        self.field(4);
        self.out.extend_from_slice(&value.to_be_bytes());
    }

    pub(crate) fn int8(&mut self, value: Option<i64>) {
        match value {
            Some(v) => {
                self.field(8);
                self.out.extend_from_slice(&v.to_be_bytes());
            }
            None => self.null(),
        }
    }

    pub(crate) fn boolean(&mut self, value: bool) {
        self.field(1);
        self.out.push(u8::from(value));
    }

    /// A timestamptz from µs since the Unix epoch, or NULL.
    pub(crate) fn timestamp(&mut self, unix_us: Option<i64>) {
        self.int8(unix_us.map(|us| us - POSTGRES_EPOCH_US));
    }

    /// An int4[]: dimensions, a null flag, the element type (23), then per dimension its
    /// length and lower bound, then each element as a field (an empty array: no dimensions).
    pub(crate) fn int4_array(&mut self, values: &[i32]) {
        let head: &[i32] = if values.is_empty() {
            &[0, 0, 23]
        } else {
            &[1, 0, 23, values.len() as i32, 1]
        };
        self.field(4 * head.len() + 8 * values.len());
        for v in head {
            self.out.extend_from_slice(&v.to_be_bytes());
        }
        for v in values {
            self.out.extend_from_slice(&4i32.to_be_bytes());
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// The data with its trailer (None: no rows were written).
    fn finish(mut self) -> Option<Vec<u8>> {
        if self.rows == 0 {
            return None;
        }
        self.out.extend_from_slice(&(-1i16).to_be_bytes());
        Some(self.out)
    }
}

/// The COPY data `rows` writes, made without the GIL (None: no rows were written).
pub(crate) fn encode<'py>(
    py: Python<'py>,
    rows: impl Send + FnOnce(&mut Copy),
) -> Option<Bound<'py, PyBytes>> {
    let data = py.detach(|| {
        let mut out = Copy::new();
        rows(&mut out);
        out.finish()
    });
    data.map(|d| PyBytes::new(py, &d))
}
