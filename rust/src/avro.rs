//! Avro binary coding of a record whose writer schema is the reader's own.
//!
//! `decode(program, data, offset)` and `encode(program, value, header)` walk a program
//! compiled from the schema by `kvledger.schemas.avro_program` (nested tuples, opcode
//! first). Each program is turned once into a `Node` tree (kept, with a reference to the
//! tuple, in a small cache looked up by identity) and then walked in Rust.
//!
//! Decoding builds fastavro's values (dicts for records, lists for arrays, `(full name,
//! value)` for a record branch of a union) or, for `OBJECT` and `TUPLE`, the codec's own
//! types: an instance of a slotted dataclass with each field set through the class's own
//! attribute (no `__init__` runs; the slots are checked to be the class's own, not
//! borrowed from another class), and a tuple for an array. Every read is bounds-checked
//! (wire.rs); malformed bytes raise `MalformedAvroError`, bad UTF-8 `UnicodeDecodeError`.
//!
//! Encoding is stricter than fastavro, which writes what it is given as best it can: an
//! int outside its type's range, a value of another type than its field's, a value that
//! fits no branch of a union raise. A union takes the first branch its value fits.

use std::sync::{Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyUnicodeDecodeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::wire::{put_long, Malformed, Reader};

create_exception!(
    kvledger._core,
    MalformedAvroError,
    PyValueError,
    "Bytes that are not a valid Avro body of the program's schema."
);

const NULL: i64 = 0;
const BOOLEAN: i64 = 1;
const INT: i64 = 2;
const LONG: i64 = 3;
const FLOAT: i64 = 4;
const DOUBLE: i64 = 5;
const BYTES: i64 = 6;
const STRING: i64 = 7;
const ARRAY: i64 = 8;
const RECORD: i64 = 9;
const UNION: i64 = 10;
const TUPLE: i64 = 11;
const OBJECT: i64 = 12;

/// Programs nest as deep as their schema; no schema kvledger writes comes near this.
const MAX_DEPTH: usize = 64;

enum Node {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Bytes,
    String,
    Array(Box<Node>),
    Tuple(Box<Node>),
    Record {
        names: Vec<Py<PyString>>,
        fields: Vec<Node>,
    },
    Union {
        branches: Vec<Node>,
        labels: Vec<Option<Py<PyAny>>>,
    },
    Object {
        cls: Py<PyType>,
        names: Vec<Py<PyString>>,
        fields: Vec<Node>,
    },
}

impl Node {
    fn opcode(&self) -> i64 {
        match self {
            Node::Null => NULL,
            Node::Boolean => BOOLEAN,
            Node::Int => INT,
            Node::Long => LONG,
            Node::Float => FLOAT,
            Node::Double => DOUBLE,
            Node::Bytes => BYTES,
            Node::String => STRING,
            Node::Array(_) => ARRAY,
            Node::Tuple(_) => TUPLE,
            Node::Record { .. } => RECORD,
            Node::Union { .. } => UNION,
            Node::Object { .. } => OBJECT,
        }
    }
}

fn bad_program(why: &str) -> PyErr {
    PyValueError::new_err(format!("not an Avro program: {why}"))
}

fn part<'py>(prog: &Bound<'py, PyTuple>, i: usize) -> PyResult<Bound<'py, PyAny>> {
    prog.get_item(i)
        .map_err(|_| bad_program("a tuple is too short"))
}

fn tuple_of<'py>(v: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
    v.cast_into::<PyTuple>()
        .map_err(|_| bad_program("expected a tuple"))
}

fn compile(prog: &Bound<'_, PyAny>, depth: usize) -> PyResult<Node> {
    if depth > MAX_DEPTH {
        return Err(bad_program("nested too deeply"));
    }
    let prog = prog
        .cast::<PyTuple>()
        .map_err(|_| bad_program("expected a tuple"))?;
    let op: i64 = part(prog, 0)?
        .extract()
        .map_err(|_| bad_program("opcode"))?;
    let nodes = |v: Bound<'_, PyAny>| -> PyResult<Vec<Node>> {
        tuple_of(v)?
            .iter()
            .map(|p| compile(&p, depth + 1))
            .collect()
    };
    let names = |v: Bound<'_, PyAny>| -> PyResult<Vec<Py<PyString>>> {
        tuple_of(v)?
            .iter()
            .map(|n| {
                n.cast_into::<PyString>()
                    .map(Bound::unbind)
                    .map_err(|_| bad_program("a name"))
            })
            .collect()
    };
    Ok(match op {
        NULL => Node::Null,
        BOOLEAN => Node::Boolean,
        INT => Node::Int,
        LONG => Node::Long,
        FLOAT => Node::Float,
        DOUBLE => Node::Double,
        BYTES => Node::Bytes,
        STRING => Node::String,
        ARRAY => Node::Array(Box::new(compile(&part(prog, 1)?, depth + 1)?)),
        TUPLE => Node::Tuple(Box::new(compile(&part(prog, 1)?, depth + 1)?)),
        RECORD => {
            let (names, fields) = (names(part(prog, 1)?)?, nodes(part(prog, 2)?)?);
            if names.len() != fields.len() {
                return Err(bad_program("a record's names and fields differ in number"));
            }
            Node::Record { names, fields }
        }
        UNION => {
            let branches = nodes(part(prog, 1)?)?;
            let labels: Vec<Option<Py<PyAny>>> = tuple_of(part(prog, 2)?)?
                .iter()
                .map(|l| if l.is_none() { None } else { Some(l.unbind()) })
                .collect();
            if labels.len() != branches.len() {
                return Err(bad_program(
                    "a union's branches and labels differ in number",
                ));
            }
            Node::Union { branches, labels }
        }
        OBJECT => {
            let cls = part(prog, 1)?
                .cast_into::<PyType>()
                .map_err(|_| PyTypeError::new_err("not a class in an Avro program"))?;
            plain_class(&cls)?;
            let fields = nodes(part(prog, 3)?)?;
            let slots = tuple_of(part(prog, 2)?)?;
            let mut names = Vec::with_capacity(slots.len());
            for slot in slots.iter() {
                names.push(own_slot(&cls, &slot)?);
            }
            if names.len() != fields.len() {
                return Err(bad_program("an object's slots and fields differ in number"));
            }
            Node::Object {
                cls: cls.unbind(),
                names,
                fields,
            }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "not an Avro program opcode: {other}"
            )))
        }
    })
}

/// `cls` is made by `object.__new__` alone: no base of it but `object` has state of its own
/// to set up (a subclass of dict, set, deque or an exception would be left half made by a
/// bare allocation, and crash the interpreter when used).
fn plain_class(cls: &Bound<'_, PyType>) -> PyResult<()> {
    let object_new = cls.py().get_type::<PyAny>().getattr("__new__")?;
    if !cls.getattr("__new__")?.is(&object_new) {
        return Err(PyTypeError::new_err(format!(
            "{} in an Avro program is not made by object.__new__ alone",
            cls.name()?
        )));
    }
    Ok(())
}

/// A slot's name, where the slot is a member descriptor of `cls` itself (one borrowed from
/// another class's layout is refused: writing through it would write outside the object).
fn own_slot(cls: &Bound<'_, PyType>, slot: &Bound<'_, PyAny>) -> PyResult<Py<PyString>> {
    let refused = || PyTypeError::new_err("not a slot of the class in an Avro program");
    let name = slot.getattr("__name__").map_err(|_| refused())?;
    let name = name.cast_into::<PyString>().map_err(|_| refused())?;
    let owner = slot.getattr("__objclass__").map_err(|_| refused())?;
    let own = cls.getattr("__dict__")?.get_item(&name).ok();
    let is_member = slot.get_type().name()?.to_str()? == "member_descriptor";
    if !is_member || !owner.is(cls) || !own.is_some_and(|o| o.is(slot)) {
        return Err(refused());
    }
    Ok(name.unbind())
}

/// Compiled programs, by the identity of their tuple (each held, so an identity is never
/// reused while cached). Programs are few (a codec has two); the cache is bounded.
static PROGRAMS: Mutex<Vec<(Py<PyAny>, Arc<Node>)>> = Mutex::new(Vec::new());
const CACHED_PROGRAMS: usize = 32;

fn program(prog: &Bound<'_, PyAny>) -> PyResult<Arc<Node>> {
    {
        let cache = PROGRAMS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, node)) = cache.iter().find(|(p, _)| p.bind(prog.py()).is(prog)) {
            return Ok(node.clone());
        }
    }
    let node = Arc::new(compile(prog, 0)?);
    let mut cache = PROGRAMS.lock().unwrap_or_else(|e| e.into_inner());
    if cache.len() >= CACHED_PROGRAMS {
        cache.remove(0);
    }
    cache.push((prog.clone().unbind(), node.clone()));
    Ok(node)
}

// ---------------------------------------------------------------------- decoding

fn malformed(m: Malformed) -> PyErr {
    MalformedAvroError::new_err(m.0)
}

fn read<'py>(py: Python<'py>, node: &Node, r: &mut Reader<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match node {
        Node::Null => py.None().into_bound(py),
        Node::Boolean => PyBool::new(py, r.byte("truncated boolean").map_err(malformed)? != 0)
            .to_owned()
            .into_any(),
        Node::Int | Node::Long => r.long().map_err(malformed)?.into_pyobject(py)?.into_any(),
        Node::Float => {
            let raw = r
                .fixed::<4>("truncated float or double")
                .map_err(malformed)?;
            PyFloat::new(py, f64::from(f32::from_le_bytes(raw))).into_any()
        }
        Node::Double => {
            let raw = r
                .fixed::<8>("truncated float or double")
                .map_err(malformed)?;
            PyFloat::new(py, f64::from_le_bytes(raw)).into_any()
        }
        Node::Bytes => PyBytes::new(py, r.sized().map_err(malformed)?).into_any(),
        Node::String => {
            let raw = r.sized().map_err(malformed)?;
            match std::str::from_utf8(raw) {
                Ok(text) => PyString::new(py, text).into_any(),
                Err(err) => {
                    return Err(PyErr::from_value(
                        PyUnicodeDecodeError::new_utf8(py, raw, err)?.into_any(),
                    ))
                }
            }
        }
        Node::Array(item) => PyList::new(py, items(py, item, r)?)?.into_any(),
        Node::Tuple(item) => PyTuple::new(py, items(py, item, r)?)?.into_any(),
        Node::Record { names, fields } => {
            let out = PyDict::new(py);
            for (name, field) in names.iter().zip(fields) {
                out.set_item(name.bind(py), read(py, field, r)?)?;
            }
            out.into_any()
        }
        Node::Union { branches, labels } => {
            let index = r.long().map_err(malformed)?;
            let Some(i) = usize::try_from(index).ok().filter(|&i| i < branches.len()) else {
                return Err(malformed(Malformed("union branch out of range")));
            };
            let value = read(py, &branches[i], r)?;
            match &labels[i] {
                None => value,
                Some(label) => PyTuple::new(py, [label.bind(py).clone(), value])?.into_any(),
            }
        }
        Node::Object { cls, names, fields } => {
            let out = new_instance(cls.bind(py))?;
            for (name, field) in names.iter().zip(fields) {
                let value = read(py, field, r)?;
                // SAFETY: three valid object pointers, the GIL held; the class's own slot
                // descriptor (checked when compiled) sets the field, bypassing a frozen
                // dataclass's __setattr__ as object.__setattr__ would.
                let rc = unsafe {
                    ffi::PyObject_GenericSetAttr(out.as_ptr(), name.as_ptr(), value.as_ptr())
                };
                if rc < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            out
        }
    })
}

/// `object.__new__(cls)`: an instance with no field set.
fn new_instance<'py>(cls: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    // SAFETY: cls is a type object, the GIL is held; PyType_GenericAlloc returns a new
    // reference or NULL with an exception set. A class whose base needs set-up of its own
    // (dict, set, an exception) was refused when compiled (plain_class): what object.__new__
    // would make, this makes.
    unsafe {
        let obj = ffi::PyType_GenericAlloc(cls.as_ptr().cast::<ffi::PyTypeObject>(), 0);
        Bound::from_owned_ptr_or_err(py, obj)
    }
}

fn items<'py>(
    py: Python<'py>,
    item: &Node,
    r: &mut Reader<'_>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut out = Vec::new();
    loop {
        let count = r.block_count().map_err(malformed)?;
        if count == 0 {
            return Ok(out);
        }
        out.reserve(count);
        for _ in 0..count {
            out.push(read(py, item, r)?);
        }
    }
}

/// decode(program, data, offset) -> (value, end offset): the value encoded at data[offset:].
#[pyfunction]
pub fn decode<'py>(
    program_: &Bound<'py, PyAny>,
    data: &Bound<'py, PyBytes>,
    offset: isize,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let bytes = data.as_bytes();
    let Some(at) = usize::try_from(offset).ok().filter(|&o| o <= bytes.len()) else {
        return Err(PyValueError::new_err("offset outside the data"));
    };
    let node = program(program_)?;
    let mut r = Reader::new(bytes, at);
    let value = read(data.py(), &node, &mut r)?;
    Ok((value, r.at))
}

// ---------------------------------------------------------------------- encoding

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn not_bool_int(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>()
}

fn has_index(v: &Bound<'_, PyAny>) -> bool {
    // SAFETY: a valid object pointer; PyIndex_Check only reads its type.
    unsafe { ffi::PyIndex_Check(v.as_ptr()) != 0 }
}

/// `v` as an int64 (or int32) through __index__; (None: it has none).
fn as_int(v: &Bound<'_, PyAny>, op: i64) -> PyResult<Option<i64>> {
    let py = v.py();
    let n = if v.is_instance_of::<PyInt>() {
        v.clone()
    } else {
        // SAFETY: a valid object pointer, the GIL held; a new reference or NULL.
        match unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyNumber_Index(v.as_ptr())) } {
            Ok(n) => n,
            Err(_) => return Ok(None),
        }
    };
    let mut overflow = 0;
    // SAFETY: n is an int object, the GIL is held.
    let x = unsafe { ffi::PyLong_AsLongLongAndOverflow(n.as_ptr(), &mut overflow) };
    if x == -1 {
        if let Some(err) = PyErr::take(py) {
            return Err(err);
        }
    }
    let out_of_range = overflow != 0 || (op == INT && i32::try_from(x).is_err());
    if out_of_range {
        let kind = if op == INT { "int" } else { "long" };
        return Err(PyValueError::new_err(format!(
            "{} is out of range for an Avro {kind}",
            n.repr()?
        )));
    }
    Ok(Some(x))
}

/// Whether `v` fits `node` (a union's branch choice).
fn fits(node: &Node, v: &Bound<'_, PyAny>) -> bool {
    match node {
        Node::Null => v.is_none(),
        Node::Boolean => v.is_instance_of::<PyBool>(),
        Node::Int => {
            if not_bool_int(v) {
                v.extract::<i32>().is_ok()
            } else {
                has_index(v) && !v.is_instance_of::<PyBool>()
            }
        }
        Node::Long => {
            has_index(v) && !v.is_instance_of::<PyBool>() && !v.is_instance_of::<PyFloat>()
        }
        Node::Float | Node::Double => v.is_instance_of::<PyFloat>() || not_bool_int(v),
        Node::Bytes => v.is_instance_of::<PyBytes>(),
        Node::String => v.is_instance_of::<PyString>(),
        Node::Array(_) | Node::Tuple(_) => {
            v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()
        }
        Node::Record { .. } => v.is_instance_of::<PyDict>(),
        Node::Object { cls, .. } => v.get_type().is(cls.bind(v.py())),
        Node::Union { .. } => false, // Avro has no union directly inside a union
    }
}

fn does_not_fit(node: &Node, v: &Bound<'_, PyAny>) -> PyErr {
    PyTypeError::new_err(format!(
        "{} does not fit Avro type {}",
        type_name(v),
        node.opcode()
    ))
}

fn write(node: &Node, v: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    let py = v.py();
    match node {
        Node::Null if v.is_none() => {}
        Node::Boolean => out.push(u8::from(v.is_truthy()?)),
        Node::Int | Node::Long => match as_int(v, node.opcode())? {
            Some(x) => put_long(out, x),
            None => return Err(does_not_fit(node, v)),
        },
        Node::Float | Node::Double if fits(node, v) => {
            let d: f64 = v.extract()?;
            if matches!(node, Node::Float) {
                out.extend_from_slice(&(d as f32).to_le_bytes());
            } else {
                out.extend_from_slice(&d.to_le_bytes());
            }
        }
        Node::Bytes if fits(node, v) => {
            let data = v.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes();
            put_long(out, data.len() as i64);
            out.extend_from_slice(data);
        }
        Node::String if fits(node, v) => {
            let text = v.cast::<PyString>().map_err(PyErr::from)?.to_str()?;
            put_long(out, text.len() as i64);
            out.extend_from_slice(text.as_bytes());
        }
        Node::Array(item) | Node::Tuple(item) => write_items(item, v, out)?,
        Node::Record { names, fields } => {
            let Ok(dict) = v.cast::<PyDict>() else {
                return Err(PyTypeError::new_err(format!(
                    "an Avro record needs a dict, not {}",
                    type_name(v)
                )));
            };
            for (name, field) in names.iter().zip(fields) {
                let value = dict
                    .get_item(name.bind(py))?
                    .unwrap_or_else(|| py.None().into_bound(py));
                write(field, &value, out)?;
            }
        }
        Node::Object { cls, names, fields } => {
            let cls = cls.bind(py);
            if !v.get_type().is(cls) {
                return Err(PyTypeError::new_err(format!(
                    "expected a {}, got {}",
                    cls.name()?,
                    type_name(v)
                )));
            }
            for (name, field) in names.iter().zip(fields) {
                // SAFETY: valid object pointers, the GIL held; a new reference or NULL.
                let value = unsafe {
                    Bound::from_owned_ptr_or_err(
                        py,
                        ffi::PyObject_GenericGetAttr(v.as_ptr(), name.as_ptr()),
                    )?
                };
                write(field, &value, out)?;
            }
        }
        Node::Union { branches, .. } => {
            let Some(i) = branches.iter().position(|b| fits(b, v)) else {
                return Err(PyValueError::new_err(format!(
                    "{} fits no branch of the Avro union",
                    type_name(v)
                )));
            };
            put_long(out, i as i64);
            write(&branches[i], v, out)?;
        }
        _ => return Err(does_not_fit(node, v)),
    }
    Ok(())
}

fn write_items(item: &Node, v: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    let len = |v: &Bound<'_, PyAny>| -> Option<usize> {
        if let Ok(list) = v.cast::<PyList>() {
            Some(list.len())
        } else {
            v.cast::<PyTuple>().ok().map(|t| t.len())
        }
    };
    let Some(n) = len(v) else {
        return Err(PyTypeError::new_err(format!(
            "an Avro array needs a list or a tuple, not {}",
            type_name(v)
        )));
    };
    if n > 0 {
        put_long(out, n as i64);
        for i in 0..n {
            // A list is re-read each time: an __index__ may change it.
            if len(v).is_none_or(|now| i >= now) {
                return Err(PyRuntimeError::new_err("a list changed size while encoded"));
            }
            write(item, &v.get_item(i)?, out)?;
        }
    }
    out.push(0);
    Ok(())
}

/// encode(program, value, header) -> header + the Avro body of value.
#[pyfunction]
pub fn encode<'py>(
    program_: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    header: &Bound<'py, PyBytes>,
) -> PyResult<Bound<'py, PyBytes>> {
    let node = program(program_)?;
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(header.as_bytes());
    write(&node, value, &mut out)?;
    Ok(PyBytes::new(value.py(), &out))
}
