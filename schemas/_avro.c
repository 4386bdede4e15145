/* Avro binary decoding of a record whose writer schema is the reader's own, compiled (and,
 * at the end of this file, encoding with that schema).
 *
 * Why: decoding is the largest single cost of applying a message (fastavro ~15 us of a
 * message's ~25 us on the consumer, measured). This decoder walks a "program" compiled
 * from the schema by kvledger.schemas.avro_program (nested tuples, opcode first) and builds
 * the same Python values fastavro returns with return_record_name=True: dicts for records,
 * lists for arrays, (full name, dict) for a union branch that is a record. Schemas it does
 * not cover (maps, enums, fixed, logical types, resolution between two schemas) stay with
 * fastavro; tests/unit/test_avro_program.py decodes the same bytes, valid and corrupted,
 * with both.
 *
 * A program may also build the codec's own types directly: OP_OBJECT makes an instance of a
 * slotted (frozen) dataclass whose fields are the record's, setting each slot through its
 * member descriptor (no __init__ runs: the classes have no __post_init__, and the program
 * compiler checks that every slot is a field of the record), and OP_TUPLE reads an array
 * into a tuple. Codec.decode then skips the record dicts entirely.
 *
 * Every read is bounds-checked; a count larger than the bytes left is refused before
 * anything is allocated (the program compiler only accepts items of at least one byte).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

enum { OP_NULL, OP_BOOLEAN, OP_INT, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_BYTES, OP_STRING,
       OP_ARRAY, OP_RECORD, OP_UNION, OP_TUPLE, OP_OBJECT };

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Reader;

static PyObject *MalformedAvroError; /* raised for any malformed input */

static int fail(const char *why) {
    PyErr_SetString(MalformedAvroError, why);
    return -1;
}

static int read_long(Reader *r, int64_t *out) {
    uint64_t acc = 0;
    int shift = 0;
    for (;;) {
        if (r->p >= r->end)
            return fail("truncated varint");
        unsigned char b = *r->p++;
        if (shift == 63 && (b & 0x7e))
            return fail("varint overflows 64 bits");
        acc |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            break;
        shift += 7;
        if (shift > 63)
            return fail("varint longer than 10 bytes");
    }
    *out = (int64_t)((acc >> 1) ^ (~(acc & 1) + 1));
    return 0;
}

static PyObject *decode(PyObject *prog, Reader *r);

static PyObject *read_sized(Reader *r, int as_text) {
    int64_t n;
    if (read_long(r, &n) < 0)
        return NULL;
    if (n < 0)
        return fail("negative length"), NULL;
    if (n > r->end - r->p)
        return fail("length past the end of the message"), NULL;
    const char *start = (const char *)r->p;
    r->p += n;
    if (as_text)
        return PyUnicode_DecodeUTF8(start, (Py_ssize_t)n, "strict");
    return PyBytes_FromStringAndSize(start, (Py_ssize_t)n);
}

static PyObject *read_array(PyObject *item, Reader *r) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (;;) {
        int64_t count;
        if (read_long(r, &count) < 0)
            goto fail;
        if (count == 0)
            return out;
        if (count < 0) { /* a block with its size in bytes: the size is not needed */
            int64_t size;
            if (count == INT64_MIN || read_long(r, &size) < 0) {
                if (!PyErr_Occurred())
                    fail("array block count out of range");
                goto fail;
            }
            count = -count;
        }
        if (count > r->end - r->p) { /* every item takes at least one byte */
            fail("array longer than the message");
            goto fail;
        }
        for (int64_t i = 0; i < count; i++) {
            PyObject *v = decode(item, r);
            if (v == NULL)
                goto fail;
            int rc = PyList_Append(out, v);
            Py_DECREF(v);
            if (rc < 0)
                goto fail;
        }
    }
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *read_record(PyObject *names, PyObject *progs, Reader *r) {
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *out = _PyDict_NewPresized(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = decode(PyTuple_GET_ITEM(progs, i), r);
        if (v == NULL || PyDict_SetItem(out, PyTuple_GET_ITEM(names, i), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

/* An instance of cls with its slots (member descriptors, in field order) set from the
 * record's fields. */
static PyObject *read_object(PyObject *cls, PyObject *slots, PyObject *progs, Reader *r) {
    Py_ssize_t n = PyTuple_GET_SIZE(slots);
    if (!PyType_Check(cls))
        return PyErr_Format(PyExc_TypeError, "not a class in an Avro program"), NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!Py_IS_TYPE(PyTuple_GET_ITEM(slots, i), &PyMemberDescr_Type))
            return PyErr_Format(PyExc_TypeError, "not a slot in an Avro program"), NULL;
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *out = type->tp_alloc(type, 0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = decode(PyTuple_GET_ITEM(progs, i), r);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyMemberDescrObject *slot = (PyMemberDescrObject *)PyTuple_GET_ITEM(slots, i);
        int rc = PyMember_SetOne((char *)out, slot->d_member, v);
        Py_DECREF(v);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *decode(PyObject *prog, Reader *r) {
    if (Py_EnterRecursiveCall(" while decoding Avro"))
        return NULL;
    PyObject *out = NULL;
    long op = PyLong_AsLong(PyTuple_GET_ITEM(prog, 0));
    switch (op) {
    case OP_NULL:
        out = Py_NewRef(Py_None);
        break;
    case OP_BOOLEAN:
        if (r->p >= r->end) {
            fail("truncated boolean");
            break;
        }
        out = PyBool_FromLong(*r->p++ != 0);
        break;
    case OP_INT:
    case OP_LONG: {
        int64_t v;
        if (read_long(r, &v) == 0)
            out = PyLong_FromLongLong(v);
        break;
    }
    case OP_FLOAT:
    case OP_DOUBLE: {
        /* IEEE 754 little-endian, as the host's (checked at import) */
        int size = op == OP_FLOAT ? 4 : 8;
        if (r->end - r->p < size) {
            fail("truncated float or double");
            break;
        }
        float f;
        double d;
        if (op == OP_FLOAT) {
            memcpy(&f, r->p, 4);
            d = f;
        } else {
            memcpy(&d, r->p, 8);
        }
        r->p += size;
        out = PyFloat_FromDouble(d);
        break;
    }
    case OP_BYTES:
    case OP_STRING:
        out = read_sized(r, op == OP_STRING);
        break;
    case OP_ARRAY:
        out = read_array(PyTuple_GET_ITEM(prog, 1), r);
        break;
    case OP_RECORD:
        out = read_record(PyTuple_GET_ITEM(prog, 1), PyTuple_GET_ITEM(prog, 2), r);
        break;
    case OP_TUPLE: {
        PyObject *items = read_array(PyTuple_GET_ITEM(prog, 1), r);
        if (items != NULL) {
            out = PyList_AsTuple(items);
            Py_DECREF(items);
        }
        break;
    }
    case OP_OBJECT:
        out = read_object(PyTuple_GET_ITEM(prog, 1), PyTuple_GET_ITEM(prog, 2),
                          PyTuple_GET_ITEM(prog, 3), r);
        break;
    case OP_UNION: {
        PyObject *branches = PyTuple_GET_ITEM(prog, 1), *labels = PyTuple_GET_ITEM(prog, 2);
        int64_t index;
        if (read_long(r, &index) < 0)
            break;
        if (index < 0 || index >= PyTuple_GET_SIZE(branches)) {
            fail("union branch out of range");
            break;
        }
        PyObject *v = decode(PyTuple_GET_ITEM(branches, index), r);
        PyObject *label = PyTuple_GET_ITEM(labels, index);
        if (v == NULL || label == Py_None) {
            out = v;
            break;
        }
        out = PyTuple_Pack(2, label, v);
        Py_DECREF(v);
        break;
    }
    default:
        PyErr_Format(PyExc_ValueError, "not an Avro program opcode: %ld", op);
    }
    Py_LeaveRecursiveCall();
    return out;
}

/* decode(program, data, offset) -> (value, end): the value encoded at data[offset:]. */
static PyObject *avro_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "decode(program: tuple, data: bytes, offset: int)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[2]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t size = PyBytes_GET_SIZE(args[1]);
    if (offset < 0 || offset > size) {
        PyErr_SetString(PyExc_ValueError, "offset outside the data");
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    Reader r = {base + offset, base + size};
    PyObject *value = decode(args[0], &r);
    if (value == NULL)
        return NULL;
    PyObject *out = Py_BuildValue("(Nn)", value, (Py_ssize_t)(r.p - base));
    return out;
}


/* ------------------------------------------------------------------ encoding
 *
 * encode(program, value, header) -> header + the Avro body of value, for the programs the
 * decoder walks: OP_OBJECT reads an instance's slots through their member descriptors,
 * OP_RECORD a dict's keys, OP_ARRAY and OP_TUPLE a list or a tuple. A union takes its first
 * branch the value fits (None: null; bool: boolean; int: int or long; float: float or double;
 * bytes; str: string; list or tuple: array; an instance of a branch's class, exactly: that
 * record). A boolean takes any truth value, an int anything with __index__ (numpy's
 * integers). Stricter than fastavro, which writes what it is given as best it can: an int
 * outside its type's range, a value of another type than its field's, a value that fits no
 * branch of a union, raise. Otherwise the bytes are fastavro's (tests/unit/test_avro_program.py
 * compares them). */

#include "_avro_writer.h"

static int as_int64(PyObject *v, long op, int64_t *out) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow || (op == OP_INT && (x < INT32_MIN || x > INT32_MAX))) {
        PyErr_Format(PyExc_ValueError, "%R is out of range for an Avro %s", v,
                     op == OP_INT ? "int" : "long");
        return -1;
    }
    *out = x;
    return 0;
}

/* Whether value fits program (a union's branch choice). */
static int fits(PyObject *prog, PyObject *v) {
    switch (PyLong_AsLong(PyTuple_GET_ITEM(prog, 0))) {
    case OP_NULL:
        return v == Py_None;
    case OP_BOOLEAN:
        return PyBool_Check(v);
    case OP_INT: /* an int32 (a bigger int fits a long branch, if there is one) */
        if (PyLong_Check(v) && !PyBool_Check(v)) {
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
            return !overflow && x >= INT32_MIN && x <= INT32_MAX;
        }
        return PyIndex_Check(v) && !PyBool_Check(v);
    case OP_LONG:
        return PyIndex_Check(v) && !PyBool_Check(v) && !PyFloat_Check(v);
    case OP_FLOAT:
    case OP_DOUBLE:
        return PyFloat_Check(v) || (PyLong_Check(v) && !PyBool_Check(v));
    case OP_BYTES:
        return PyBytes_Check(v);
    case OP_STRING:
        return PyUnicode_Check(v);
    case OP_ARRAY:
    case OP_TUPLE:
        return PyList_Check(v) || PyTuple_Check(v);
    case OP_RECORD:
        return PyDict_Check(v);
    case OP_OBJECT:
        return (PyObject *)Py_TYPE(v) == PyTuple_GET_ITEM(prog, 1);
    default:
        return 0;
    }
}

static int encode(PyObject *prog, PyObject *v, Writer *w);

static int write_items(PyObject *item, PyObject *v, Writer *w) {
    if (!PyList_Check(v) && !PyTuple_Check(v)) {
        PyErr_Format(PyExc_TypeError, "an Avro array needs a list or a tuple, not %.80s",
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    if (n > 0) {
        if (write_long(w, n) < 0)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* A list is re-read each time and its item held: an __index__ may change it. */
            if (i >= PySequence_Fast_GET_SIZE(v)) {
                PyErr_SetString(PyExc_RuntimeError, "a list changed size while encoded");
                return -1;
            }
            PyObject *x = Py_NewRef(PySequence_Fast_GET_ITEM(v, i));
            int rc = encode(item, x, w);
            Py_DECREF(x);
            if (rc < 0)
                return -1;
        }
    }
    return write_long(w, 0);
}

static int write_object(PyObject *cls, PyObject *slots, PyObject *progs, PyObject *v,
                        Writer *w) {
    if ((PyObject *)Py_TYPE(v) != cls) {
        PyErr_Format(PyExc_TypeError, "expected a %.80s, got %.80s",
                     ((PyTypeObject *)cls)->tp_name, Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(slots);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyTuple_GET_ITEM(slots, i);
        if (!Py_IS_TYPE(slot, &PyMemberDescr_Type)) {
            PyErr_SetString(PyExc_TypeError, "not a slot in an Avro program");
            return -1;
        }
        PyObject *field = PyMember_GetOne((const char *)v, ((PyMemberDescrObject *)slot)->d_member);
        if (field == NULL)
            return -1;
        int rc = encode(PyTuple_GET_ITEM(progs, i), field, w);
        Py_DECREF(field);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static int write_record(PyObject *names, PyObject *progs, PyObject *v, Writer *w) {
    if (!PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "an Avro record needs a dict, not %.80s",
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyDict_GetItemWithError(v, PyTuple_GET_ITEM(names, i));
        if (field == NULL && PyErr_Occurred())
            return -1;
        field = Py_NewRef(field != NULL ? field : Py_None); /* held: an __index__ may change v */
        int rc = encode(PyTuple_GET_ITEM(progs, i), field, w);
        Py_DECREF(field);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static int encode(PyObject *prog, PyObject *v, Writer *w) {
    if (Py_EnterRecursiveCall(" while encoding Avro"))
        return -1;
    int rc = -1;
    long op = PyLong_AsLong(PyTuple_GET_ITEM(prog, 0));
    if ((op == OP_NULL || op == OP_FLOAT || op == OP_DOUBLE || op == OP_BYTES ||
         op == OP_STRING) && !fits(prog, v)) {
        PyErr_Format(PyExc_TypeError, "%.80s does not fit Avro type %ld", Py_TYPE(v)->tp_name, op);
        goto done;
    }
    switch (op) {
    case OP_NULL:
        rc = 0;
        break;
    case OP_BOOLEAN: { /* any truth value, as fastavro writes it */
        int truth = PyObject_IsTrue(v);
        char b = (char)truth;
        rc = truth < 0 ? -1 : write_raw(w, &b, 1);
        break;
    }
    case OP_INT:
    case OP_LONG: { /* an int, or what __index__ makes one (numpy's integers) */
        int64_t x;
        PyObject *n = PyLong_Check(v) ? Py_NewRef(v) : PyNumber_Index(v);
        if (n == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%.80s does not fit Avro type %ld",
                         Py_TYPE(v)->tp_name, op);
            break;
        }
        rc = as_int64(n, op, &x) < 0 ? -1 : write_long(w, x);
        Py_DECREF(n);
        break;
    }
    case OP_FLOAT:
    case OP_DOUBLE: {
        double d = PyFloat_AsDouble(v);
        if (d == -1.0 && PyErr_Occurred())
            break;
        if (op == OP_FLOAT) {
            float f = (float)d;
            rc = write_raw(w, &f, 4);
        } else {
            rc = write_raw(w, &d, 8);
        }
        break;
    }
    case OP_BYTES:
    case OP_STRING: {
        Py_ssize_t n;
        const char *data;
        if (op == OP_STRING) {
            data = PyUnicode_AsUTF8AndSize(v, &n);
            if (data == NULL)
                break;
        } else {
            data = PyBytes_AS_STRING(v);
            n = PyBytes_GET_SIZE(v);
        }
        rc = write_long(w, n) < 0 ? -1 : write_raw(w, data, n);
        break;
    }
    case OP_ARRAY:
    case OP_TUPLE:
        rc = write_items(PyTuple_GET_ITEM(prog, 1), v, w);
        break;
    case OP_RECORD:
        rc = write_record(PyTuple_GET_ITEM(prog, 1), PyTuple_GET_ITEM(prog, 2), v, w);
        break;
    case OP_OBJECT:
        rc = write_object(PyTuple_GET_ITEM(prog, 1), PyTuple_GET_ITEM(prog, 2),
                          PyTuple_GET_ITEM(prog, 3), v, w);
        break;
    case OP_UNION: {
        PyObject *branches = PyTuple_GET_ITEM(prog, 1);
        Py_ssize_t n = PyTuple_GET_SIZE(branches);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (fits(PyTuple_GET_ITEM(branches, i), v)) {
                rc = write_long(w, i) < 0 ? -1 : encode(PyTuple_GET_ITEM(branches, i), v, w);
                goto done;
            }
        }
        PyErr_Format(PyExc_ValueError, "%.80s fits no branch of the Avro union",
                     Py_TYPE(v)->tp_name);
        break;
    }
    default:
        PyErr_Format(PyExc_ValueError, "not an Avro program opcode: %ld", op);
    }
done:
    Py_LeaveRecursiveCall();
    return rc;
}

/* encode(program, value, header) -> header + the Avro body of value. */
static PyObject *avro_encode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "encode(program: tuple, value, header: bytes)");
        return NULL;
    }
    Writer w;
    if (writer_start(&w, 512) < 0)
        return NULL;
    PyObject *out = NULL;
    if (write_raw(&w, PyBytes_AS_STRING(args[2]), PyBytes_GET_SIZE(args[2])) == 0 &&
        encode(args[0], args[1], &w) == 0)
        out = PyBytes_FromStringAndSize(w.buf, w.len);
    PyMem_Free(w.buf);
    return out;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))avro_decode, METH_FASTCALL,
     "decode(program, data, offset) -> (value, end offset)."},
    {"encode", (PyCFunction)(void (*)(void))avro_encode, METH_FASTCALL,
     "encode(program, value, header) -> header + the value's Avro body."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_avro", "Avro binary coding of a compiled schema program.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__avro(void) {
    uint16_t probe = 1;
    if (*(unsigned char *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "the compiled Avro decoder needs a little-endian host");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    MalformedAvroError = PyErr_NewException("kvledger.schemas._avro.MalformedAvroError", PyExc_ValueError, NULL);
    if (MalformedAvroError == NULL || PyModule_AddObject(m, "MalformedAvroError", Py_NewRef(MalformedAvroError)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
