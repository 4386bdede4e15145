/* vLLM's KV cache events straight to the Avro bytes kvledger publishes, compiled.
 *
 * Why: an embedded engine publishes on its scheduler thread, and a relay shares two cores
 * with its engine. Mapping a vLLM event to kvledger's Python objects, fitting it to its
 * group, building its envelope and encoding it cost ~15 us a message (a 16-block store),
 * several times what Kafka's own produce of the same bytes costs. Here one pass reads the
 * event's attributes and writes its bytes.
 *
 * body(kind, event, digest, partial) -> (kind name, group, bytes) | None
 *     kind: 0 BlockStored, 1 BlockRemoved; event: any object with vLLM's attribute names (a
 *     vLLM msgspec struct, the relay's decoded structs); digest: hashes given as bytes are
 *     published whole (else as their last 8 bytes, vLLM's int64 form); partial: {group:
 *     hash block size} for the groups whose spec hashes at another size than its blocks
 *     (a store of that size there is a partial recurrent tail).
 *     Returns the event's type name and group, and the bytes of the envelope's event
 *     branch (the union index, then the record), exactly as kvledger.producer.vllm's
 *     mapping followed by the codec writes them. Returns None for anything this pass does
 *     not take as it is: a field of an unexpected type or range, a missing required field,
 *     extra keys, a bool where an int belongs (a missing field with a default takes it,
 *     None). The caller then takes the Python mapping, which gives the same bytes or the
 *     reason the event is refused; tests/unit/test_vllm_compiled.py holds the two to the
 *     same answers.
 *
 * prepare(events, digest, partial, codes) -> (items, left) | None
 *     body() over a list, each event's class looked up in codes (see vllm_prepare).
 *
 * event(packed, digest, partial) -> (kind name, group, bytes) | None
 *     The same for one event still in msgpack (a buffer: msgspec.Raw), as a relay
 *     receives it (producer/_vllm_packed.h).
 *
 * frame(head, seq, time_ms, body, engine_seq) -> bytes
 *     One message: head (the codec's header, then the envelope's source, model, dp_rank and
 *     epoch, written once per epoch), the seq and event time, the body, the engine batch.
 *
 * produce(...): frames and produces a run of prepared events (see vllm_produce).
 *
 * publish(digest, partial, codes, events, ...): prepare() and produce() over one batch in
 * one call (an embedded engine's batch: see vllm_publish); publish_packed(digest, partial,
 * events, ...) the same with event() (a relay's batch: see vllm_publish_packed). The
 * batch's bodies are written one after another into one buffer and each message framed
 * from there; only what produce leaves becomes items.
 *
 * Reading an event: a class's fields are found once (see Layout: a msgspec struct's slots
 * are read at their offsets), each int of a token list read in place. Most of what is left
 * is waiting on memory: every token id is an object of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h> /* T_OBJECT_EX, READONLY: a slot's member type and flags */
#include <string.h>

#include "../schemas/_avro_writer.h"

#if PY_VERSION_HEX >= 0x030D0000
#define lookup_attr PyObject_GetOptionalAttr
#else
#define lookup_attr _PyObject_LookupAttr
#endif

enum { SLOW = 1 }; /* a field this pass does not take: the Python mapping decides */

enum {
    F_BLOCK_HASHES, F_PARENT_BLOCK_HASH, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX, F_SPEC_KIND, F_SLIDING_WINDOW, F_LOCALITY,
    F_OWNERSHIP, F_SESSION_ID, F_LOOKAHEAD, F_TOKEN_START, F_PARTIAL, F_COUNT
};
static const char *const field_names[F_COUNT] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "token_start", "partial",
};
static PyObject *names[F_COUNT]; /* interned */
static PyObject *zero;           /* the default group */
static PyObject *one;
static PyObject *kind_names[2];  /* BlockStored, BlockRemoved */

/* An attribute: 0 and *out set (NULL when the object lacks it); SLOW when reading fails. */
static int attr(PyObject *event, int field, PyObject **out) {
    if (lookup_attr(event, names[field], out) < 0) {
        PyErr_Clear();
        return SLOW;
    }
    return 0;
}

/* Where a class keeps each field, so that an event's fields are read without a lookup by
 * name (17 of them a store, ~15 ns each). vLLM's events are msgspec structs: each field a
 * slot, whose member descriptor gives its offset in the object. A field no class on the
 * MRO defines, of a class whose objects have no __dict__, is known absent. Anything else
 * (a property, an instance dict, a class with its own __getattribute__ or __getattr__) is
 * read by name as before. A layout holds while its class's version tag does: any change to
 * the class or a base (a new attribute, a deleted slot) gives the class a new tag. */
enum { BY_NAME = 0, ABSENT = -1 };
typedef struct {
    unsigned int version;
    Py_ssize_t where[F_COUNT]; /* > 0: a slot's offset; ABSENT; BY_NAME */
} Layout;
static PyObject *layouts; /* {class: bytes of its Layout} */
enum { MAX_LAYOUTS = 256 }; /* classes made on the fly must not grow it without end */

static int has_valid_version(PyTypeObject *type) {
    return PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
}

/* The class attribute a name resolves to along the MRO (a new reference), or NULL: 0; -1 on
 * an error. */
static int class_attr(PyTypeObject *type, PyObject *name, PyObject **out) {
    PyObject *mro = type->tp_mro;
    *out = NULL;
    if (mro == NULL || !PyTuple_Check(mro))
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *dict = PyType_GetDict((PyTypeObject *)PyTuple_GET_ITEM(mro, i));
#else
        PyObject *dict = Py_XNewRef(((PyTypeObject *)PyTuple_GET_ITEM(mro, i))->tp_dict);
#endif
        if (dict == NULL)
            return -1;
        PyObject *found = PyDict_GetItemWithError(dict, name); /* interned str: no Python code */
        Py_DECREF(dict);
        if (found != NULL) {
            *out = Py_NewRef(found);
            return 0;
        }
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

static int build_layout(PyTypeObject *type, Layout *out) {
    out->version = type->tp_version_tag;
    for (int i = 0; i < F_COUNT; i++) {
        PyObject *descr;
        if (class_attr(type, names[i], &descr) < 0)
            return -1;
        out->where[i] = BY_NAME;
        if (descr == NULL && type->tp_dictoffset == 0)
            out->where[i] = ABSENT;
        else if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
            /* A slot of this class or a base only: a descriptor another class's slot was
             * borrowed from (B.x = A.__dict__["x"]) has an offset into A's objects, which
             * a B object may not even reach (its read by name then says so). */
            PyTypeObject *owner = ((PyDescrObject *)descr)->d_type;
            int own = owner != NULL && PyType_IsSubtype(type, owner) &&
                      m->offset + (Py_ssize_t)sizeof(PyObject *) <= owner->tp_basicsize;
            if (own && m->type == T_OBJECT_EX && (m->flags & ~READONLY) == 0 && m->offset > 0)
                out->where[i] = m->offset;
        }
        Py_XDECREF(descr);
    }
    return 0;
}

/* The layout of an event's class (a new reference to its bytes: a property read by name may
 * replace the class's entry), or NULL: its fields are then read by name. */
static PyObject *layout_of(PyObject *event) {
    PyTypeObject *type = Py_TYPE(event);
    if (type->tp_getattro != PyObject_GenericGetAttr || !has_valid_version(type))
        return NULL;
    PyObject *known = PyDict_GetItemWithError(layouts, (PyObject *)type);
    if (known != NULL) {
        if (((const Layout *)PyBytes_AS_STRING(known))->version == type->tp_version_tag)
            return Py_NewRef(known);
    } else if (PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    Layout layout;
    if (build_layout(type, &layout) < 0 || !has_valid_version(type) ||
        type->tp_version_tag != layout.version) {
        PyErr_Clear();
        return NULL;
    }
    if (PyDict_GET_SIZE(layouts) >= MAX_LAYOUTS)
        PyDict_Clear(layouts);
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)&layout, sizeof layout);
    if (bytes == NULL || PyDict_SetItem(layouts, (PyObject *)type, bytes) < 0) {
        Py_XDECREF(bytes);
        PyErr_Clear();
        return NULL;
    }
    return bytes;
}

/* A field of an event as attr() reads it, through its class's layout where it has one. */
static inline int field_of(PyObject *event, const Layout *layout, int field, PyObject **out) {
    Py_ssize_t at = layout == NULL ? BY_NAME : layout->where[field];
    if (at > 0) { /* a slot: NULL while unset, as an absent attribute */
        *out = Py_XNewRef(*(PyObject **)((char *)event + at));
        return 0;
    }
    if (at == ABSENT) {
        *out = NULL;
        return 0;
    }
    return attr(event, field, out);
}

/* An int of one internal digit (token ids, sizes) read in place, without a call. */
static inline int small_int(PyObject *v, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return 0;
    *out = PyUnstable_Long_CompactValue((PyLongObject *)v);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v); /* the digit count, signed; no digit for 0 */
    if (size < -1 || size > 1)
        return 0;
    *out = size == 0 ? 0 : size * (int64_t)((PyLongObject *)v)->ob_digit[0];
    return 1;
#endif
}

/* A non-negative int below 2**64 read from its digits in place (CPython before 3.12, with
 * 30-bit digits: most 64-bit hashes take three); 0 where the general call must read it. */
static inline int u64_in_place(PyObject *v, unsigned long long *out) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    Py_ssize_t size = Py_SIZE(v);
    const digit *d = ((PyLongObject *)v)->ob_digit;
    if (size < 0 || size > 3 || (size == 3 && d[2] >> 4))
        return 0;
    unsigned long long x = 0;
    for (Py_ssize_t i = size - 1; i >= 0; i--)
        x = x << 30 | d[i];
    *out = x;
    return 1;
#else
    (void)v;
    (void)out;
    return 0;
#endif
}

static inline int exact_int(PyObject *v, int64_t lo, int64_t hi, int64_t *out) {
    if (!PyLong_CheckExact(v))
        return SLOW;
    int64_t x;
    if (!small_int(v, &x)) {
        int overflow = 0;
        x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow)
            return SLOW;
    }
    if (x < lo || x > hi)
        return SLOW;
    *out = x;
    return 0;
}

static int write_hash_bytes(Writer *w, const char *data, Py_ssize_t n, int digest) {
    if (!digest && n > 8) { /* the int64 wire form: the digest's last 8 bytes */
        data += n - 8;
        n = 8;
    }
    return write_long(w, n) < 0 || write_raw(w, data, n) < 0 ? -1 : 0;
}

static int write_hash(Writer *w, PyObject *h, int digest) {
    if (PyLong_CheckExact(h)) { /* vLLM's unsigned 64-bit int: 8 bytes, big-endian */
        unsigned long long x;
        if (!u64_in_place(h, &x)) {
            x = PyLong_AsUnsignedLongLong(h);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return SLOW;
            }
        }
        unsigned char b[8];
        for (int i = 0; i < 8; i++)
            b[i] = (unsigned char)(x >> (56 - 8 * i));
        return write_long(w, 8) < 0 || write_raw(w, b, 8) < 0 ? -1 : 0;
    }
    if (!PyBytes_CheckExact(h))
        return SLOW;
    return write_hash_bytes(w, PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h), digest);
}

static int is_sequence(PyObject *v) { return PyList_CheckExact(v) || PyTuple_CheckExact(v); }

/* An Avro array of hashes. */
static int write_hashes(Writer *w, PyObject *v, int digest) {
    if (!is_sequence(v))
        return SLOW;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    if (n > 0 && write_long(w, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) { /* exact ints and bytes run no Python code */
        int rc = write_hash(w, items[i], digest);
        if (rc != 0)
            return rc;
    }
    return write_long(w, 0);
}

/* An Avro array of ints (lo..hi): token ids, the bulk of a store (a tight loop: the
 * room for every item is made first, and one-digit ints are read in place). */
static int write_ints(Writer *w, PyObject *v, int64_t lo, int64_t hi) {
    if (!is_sequence(v))
        return SLOW;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    /* Room for every item and the end byte, also when there is no item (the end byte of
     * an empty array is written too: many empty arrays must not outgrow the buffer). */
    if ((n > 0 && write_long(w, n) < 0) || grow(w, n * 10 + 1) < 0)
        return -1;
    unsigned char *p = (unsigned char *)w->buf + w->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t x;
        PyObject *v = items[i];
        if (i + 16 < n) /* each int is an object of its own, seldom in cache: ask early */
            __builtin_prefetch(items[i + 16]);
#if PY_VERSION_HEX < 0x030C0000
        /* the common case first: an exact int of one digit, 0 < x < 2**30 <= hi */
        if (Py_IS_TYPE(v, &PyLong_Type) && Py_SIZE(v) == 1 && lo <= 0 && hi >= (1 << 30)) {
            uint32_t u = ((PyLongObject *)v)->ob_digit[0] << 1;
            while (u >= 0x80) {
                *p++ = (unsigned char)(u | 0x80);
                u >>= 7;
            }
            *p++ = (unsigned char)u;
            continue;
        }
#endif
        if (exact_int(v, lo, hi, &x))
            return SLOW;
        p = put_long(p, x);
    }
    *p++ = 0; /* the array's end */
    w->len = (char *)p - w->buf;
    return 0;
}

/* A union [null, int] or [null, long]. */
static int write_opt_int(Writer *w, PyObject *v, int64_t lo, int64_t hi) {
    if (v == Py_None)
        return write_long(w, 0);
    int64_t x;
    if (exact_int(v, lo, hi, &x))
        return SLOW;
    return write_long(w, 1) < 0 || write_long(w, x) < 0 ? -1 : 0;
}

/* A union [null, string]. */
static int write_opt_str(Writer *w, PyObject *v) {
    if (v == Py_None)
        return write_long(w, 0);
    if (!PyUnicode_CheckExact(v))
        return SLOW;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    if (s == NULL) { /* e.g. a lone surrogate: the mapping's encoder says so */
        PyErr_Clear();
        return SLOW;
    }
    return write_long(w, 1) < 0 || write_long(w, n) < 0 || write_raw(w, s, n) < 0 ? -1 : 0;
}

/* extra_keys, taken here only when no block has any (None, or a list of None). */
static int write_extra_keys(Writer *w, PyObject *v) {
    if (v == Py_None)
        return write_long(w, 0);
    if (!is_sequence(v))
        return SLOW;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] != Py_None)
            return SLOW; /* keys to canonical JSON: the mapping's work */
    return write_long(w, 1) < 0 || write_nulls(w, n) < 0 ? -1 : 0; /* each block: null */
}

/* lookahead_token_ids: None, or a list of lists of longs. */
static int write_lookahead(Writer *w, PyObject *v) {
    if (v == Py_None)
        return write_long(w, 0);
    if (!is_sequence(v))
        return SLOW;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    if (write_long(w, 1) < 0 || (n > 0 && write_long(w, n) < 0))
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = write_ints(w, items[i], INT64_MIN, INT64_MAX);
        if (rc != 0)
            return rc;
    }
    return write_long(w, 0);
}

/* The value of each field, read before anything is written (a read may run Python code). */
typedef struct {
    PyObject *v[F_COUNT];
} Fields;

static void release(Fields *f) {
    for (int i = 0; i < F_COUNT; i++)
        Py_CLEAR(f->v[i]);
}

/* Each event's fields in vLLM's order, the first ones required (the others have defaults,
 * and lora_id, medium, lora_name are absent from older engines' stores: None), then
 * kvledger's extensions (absent from vLLM's objects). */
static const int stored_fields[] = {
    F_BLOCK_HASHES, F_PARENT_BLOCK_HASH, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX, F_SPEC_KIND, F_SLIDING_WINDOW, F_LOCALITY,
    F_OWNERSHIP, F_SESSION_ID, F_LOOKAHEAD, F_TOKEN_START, F_PARTIAL,
};
static const int removed_fields[] = {F_BLOCK_HASHES, F_MEDIUM, F_GROUP_IDX, F_LOCALITY,
                                     F_OWNERSHIP};
enum { STORED_REQUIRED = 4, REMOVED_REQUIRED = 2 };

static int read_fields(PyObject *event, int stored, Fields *f) {
    PyObject *known = layout_of(event);
    const Layout *layout = known == NULL ? NULL : (const Layout *)PyBytes_AS_STRING(known);
    int rc = 0;
    const int *which = stored ? stored_fields : removed_fields;
    int n = stored ? (int)(sizeof stored_fields / sizeof *stored_fields)
                   : (int)(sizeof removed_fields / sizeof *removed_fields);
    int required = stored ? STORED_REQUIRED : REMOVED_REQUIRED;
    for (int i = 0; i < n; i++) {
        PyObject **slot = &f->v[which[i]];
        if (field_of(event, layout, which[i], slot) || (*slot == NULL && i < required)) {
            rc = SLOW; /* a missing one: the mapping names it */
            break;
        }
        if (*slot == NULL)
            *slot = Py_NewRef(Py_None);
    }
    Py_XDECREF(known);
    return rc;
}

/* Whether a store is a partial tail: flagged so, or its size is its group's hash size. */
static int is_partial(Fields *f, int64_t block_size, PyObject *group, PyObject *partial,
                      int *out) {
    PyObject *flag = f->v[F_PARTIAL];
    if (flag != Py_None && flag != Py_True && flag != Py_False)
        return SLOW;
    *out = flag == Py_True;
    if (*out || block_size == 0 || partial == Py_None)
        return 0;
    PyObject *hash_size = PyDict_GetItemWithError(partial, group);
    if (hash_size == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int64_t size;
    if (exact_int(hash_size, INT64_MIN, INT64_MAX, &size))
        return SLOW;
    *out = size == block_size;
    return 0;
}

static int write_stored(Writer *w, Fields *f, int digest, PyObject *group, PyObject *partial) {
    PyObject **v = f->v;
    int64_t block_size;
    int part, rc;
    if (exact_int(v[F_BLOCK_SIZE], INT32_MIN, INT32_MAX, &block_size))
        return SLOW;
    if ((rc = is_partial(f, block_size, group, partial, &part)) != 0)
        return rc;
    if (write_long(w, 0) < 0) /* the envelope's union: BlockStored */
        return -1;
    if ((rc = write_hashes(w, v[F_BLOCK_HASHES], digest)) != 0)
        return rc;
    PyObject *parent = v[F_PARENT_BLOCK_HASH];
    if (parent == Py_None)
        rc = write_long(w, 0);
    else
        rc = write_long(w, 1) < 0 ? -1 : write_hash(w, parent, digest);
    if (rc != 0 || (rc = write_ints(w, v[F_TOKEN_IDS], INT32_MIN, INT32_MAX)) != 0)
        return rc;
    if (write_long(w, block_size) < 0)
        return -1;
    if ((rc = write_opt_int(w, v[F_LORA_ID], INT32_MIN, INT32_MAX)) ||
        (rc = write_opt_str(w, v[F_MEDIUM])) || (rc = write_opt_str(w, v[F_LORA_NAME])) ||
        (rc = write_extra_keys(w, v[F_EXTRA_KEYS])) ||
        (rc = write_opt_int(w, v[F_GROUP_IDX], INT32_MIN, INT32_MAX)) ||
        (rc = write_opt_str(w, v[F_SPEC_KIND])) ||
        (rc = write_opt_int(w, v[F_SLIDING_WINDOW], INT32_MIN, INT32_MAX)) ||
        (rc = write_opt_str(w, v[F_LOCALITY])) || (rc = write_opt_str(w, v[F_OWNERSHIP])) ||
        (rc = write_opt_int(w, v[F_TOKEN_START], INT64_MIN, INT64_MAX)))
        return rc;
    char b = (char)part;
    if (write_raw(w, &b, 1) < 0)
        return -1;
    if ((rc = write_opt_str(w, v[F_SESSION_ID])) || (rc = write_lookahead(w, v[F_LOOKAHEAD])))
        return rc;
    return 0;
}

static int write_removed(Writer *w, Fields *f, int digest) {
    PyObject **v = f->v;
    int rc;
    if (write_long(w, 1) < 0) /* the envelope's union: BlockRemoved */
        return -1;
    if ((rc = write_hashes(w, v[F_BLOCK_HASHES], digest)) ||
        (rc = write_opt_str(w, v[F_MEDIUM])) ||
        (rc = write_opt_int(w, v[F_GROUP_IDX], INT32_MIN, INT32_MAX)) ||
        (rc = write_opt_str(w, v[F_LOCALITY])) || (rc = write_opt_str(w, v[F_OWNERSHIP])))
        return rc;
    return 0;
}

/* An item as the caller takes it: (kind name, group, bytes). Steals group. */
static PyObject *item_of(long kind, PyObject *group, const char *body, Py_ssize_t len) {
    PyObject *data = group == NULL ? NULL : PyBytes_FromStringAndSize(body, len);
    PyObject *out = data == NULL ? NULL : PyTuple_Pack(3, kind_names[kind], group, data);
    Py_XDECREF(data);
    Py_XDECREF(group);
    return out;
}

#include "_vllm_packed.h"

/* One event's body appended to w: 0 with *group its group (a new reference), SLOW where
 * this pass does not take the event, -1 on an error. */
static int write_one(long kind, PyObject *event, int digest, PyObject *partial, Writer *w,
                     PyObject **group) {
    Fields f = {{NULL}};
    int rc = read_fields(event, kind == 0, &f);
    PyObject *g = f.v[F_GROUP_IDX] == Py_None ? zero : f.v[F_GROUP_IDX];
    if (rc == 0 && g != NULL && !PyLong_CheckExact(g))
        rc = SLOW; /* the field's check below names the reason */
    if (rc == 0)
        rc = kind == 0 ? write_stored(w, &f, digest, g, partial) : write_removed(w, &f, digest);
    *group = rc == 0 ? Py_NewRef(g) : NULL;
    release(&f);
    return rc;
}

/* One event's (kind name, group, bytes), None where this pass does not take it, or NULL
 * with an error set; w: a started writer, emptied first (a list's events share one). */
static PyObject *prepare_one(long kind, PyObject *event, int digest, PyObject *partial,
                             Writer *w) {
    PyObject *group;
    w->len = 0;
    int rc = write_one(kind, event, digest, partial, w, &group);
    if (rc != 0)
        return rc == SLOW ? Py_NewRef(Py_None) : NULL;
    return item_of(kind, group, w->buf, w->len);
}

static PyObject *vllm_body(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyLong_Check(args[0]) || (args[3] != Py_None && !PyDict_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError,
                        "body(kind: int, event, digest: bool, partial: dict | None)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    if (kind != 0 && kind != 1) {
        PyErr_SetString(PyExc_ValueError, "kind is 0 (BlockStored) or 1 (BlockRemoved)");
        return NULL;
    }
    int digest = PyObject_IsTrue(args[2]);
    if (digest < 0)
        return NULL;
    Writer w;
    if (writer_start(&w, 1024) < 0)
        return NULL;
    PyObject *out = prepare_one(kind, args[1], digest, args[3], &w);
    PyMem_Free(w.buf);
    return out;
}

/* Whether a list of events has lost item i while its events were read (an attribute read
 * may run Python code): then RuntimeError is set. */
static int shrank(PyObject *events, Py_ssize_t i) {
    if (i < PyList_GET_SIZE(events))
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "the events changed while prepared");
    return 1;
}

/* prepare(events, digest, partial, codes) -> (items, left)
 * body() over a list of events: items[i] is events[i] prepared, or events[i] itself where
 * this pass leaves it (its class not in codes as 0 or 1, or a field it does not take);
 * left counts those. None instead when an event is itself a tuple (a prepared event's
 * shape: the caller takes the list one by one). */
static PyObject *vllm_prepare(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || (args[2] != Py_None && !PyDict_Check(args[2])) ||
        !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "prepare(events: list, digest: bool, "
                                         "partial: dict | None, codes: dict)");
        return NULL;
    }
    int digest = PyObject_IsTrue(args[1]);
    if (digest < 0)
        return NULL;
    PyObject *events = args[0], *codes = args[3];
    Py_ssize_t n = PyList_GET_SIZE(events), left = 0;
    Writer w; /* the events' bytes, one after another (room for a 256-token store) */
    if (writer_start(&w, 4096) < 0)
        return NULL;
    PyObject *items = PyList_New(n);
    if (items == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (shrank(events, i))
            goto fail;
        PyObject *event = Py_NewRef(PyList_GET_ITEM(events, i)), *got = NULL;
        if (PyTuple_Check(event)) {
            Py_DECREF(event);
            Py_DECREF(items);
            PyMem_Free(w.buf);
            return Py_NewRef(Py_None);
        }
        PyObject *code = PyDict_GetItemWithError(codes, (PyObject *)Py_TYPE(event));
        long kind = code != NULL && PyLong_CheckExact(code) ? PyLong_AsLong(code) : -1;
        if (code == NULL && PyErr_Occurred()) {
            Py_DECREF(event);
            goto fail;
        }
        if (kind == 0 || kind == 1) {
            got = prepare_one(kind, event, digest, args[2], &w);
            if (got == NULL) {
                Py_DECREF(event);
                goto fail;
            }
        }
        if (got == NULL || got == Py_None) {
            Py_XDECREF(got);
            got = Py_NewRef(event);
            left++;
        }
        Py_DECREF(event);
        PyList_SET_ITEM(items, i, got);
    }
    PyMem_Free(w.buf);
    return Py_BuildValue("(Nn)", items, left);
fail:
    Py_XDECREF(items);
    PyMem_Free(w.buf);
    return NULL;
}

static int long_arg(PyObject *v, int64_t *out) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "expected an int, got %.80s", Py_TYPE(v)->tp_name);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* One message: head, seq, time, body, engine batch, written straight into its bytes. */
static PyObject *make_frame(PyObject *head, int64_t seq, int64_t time_ms, const char *body,
                            Py_ssize_t len, int has_engine_seq, int64_t engine_seq) {
    unsigned char numbers[20], tail[11]; /* the varints, first: the size is then exact */
    size_t n = (size_t)(put_long(put_long(numbers, seq), time_ms) - numbers);
    tail[0] = has_engine_seq ? 2 : 0; /* engine_seq: the union's long branch, or null */
    size_t t = has_engine_seq ? (size_t)(put_long(tail + 1, engine_seq) - tail) : 1;
    size_t h = (size_t)PyBytes_GET_SIZE(head), b = (size_t)len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(h + n + b + t));
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    memcpy(p, PyBytes_AS_STRING(head), h);
    memcpy(p + h, numbers, n);
    memcpy(p + h + n, body, b);
    memcpy(p + h + n + b, tail, t);
    return out;
}

static PyObject *vllm_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "frame(head: bytes, seq: int, time_ms: int, "
                                         "body: bytes, engine_seq: int | None)");
        return NULL;
    }
    int64_t seq, time_ms, engine_seq = 0;
    int has_engine_seq = args[4] != Py_None;
    if (long_arg(args[1], &seq) < 0 || long_arg(args[2], &time_ms) < 0 ||
        (has_engine_seq && long_arg(args[4], &engine_seq) < 0))
        return NULL;
    return make_frame(args[0], seq, time_ms, PyBytes_AS_STRING(args[3]),
                      PyBytes_GET_SIZE(args[3]), has_engine_seq, engine_seq);
}

/* Where prepared events go and how they are stamped (produce()'s arguments but the items). */
typedef struct {
    PyObject *produce, *topic, *head, *seqs, *keys, *counts;
    int64_t time_ms, engine_seq;
    int has_engine_seq;
} Outlet;

/* a: produce, topic, head, time_ms, engine_seq; dicts: seqs, keys, counts. */
static int outlet_of(Outlet *o, PyObject *const *a, PyObject *const *dicts) {
    if (!PyBytes_Check(a[2]) || !PyDict_Check(dicts[0]) || !PyDict_Check(dicts[1]) ||
        !PyDict_Check(dicts[2])) {
        PyErr_SetString(PyExc_TypeError, "head: bytes, seqs, keys, counts: dict");
        return -1;
    }
    *o = (Outlet){a[0], a[1], a[2], dicts[0], dicts[1], dicts[2], 0, 0, a[4] != Py_None};
    return long_arg(a[3], &o->time_ms) < 0 ||
                   (o->has_engine_seq && long_arg(a[4], &o->engine_seq) < 0)
               ? -1
               : 0;
}

/* One prepared event framed and produced, numbered from seqs (then advanced) and counted in
 * counts[kind]: 1. 0 where the caller takes it itself: its group has no key yet, or
 * produce raised (cleared; its number not spent). -1 on an error. */
static int produce_one(const Outlet *o, PyObject *kind, PyObject *group, const char *body,
                       Py_ssize_t len) {
    PyObject *key = PyDict_GetItemWithError(o->keys, group);
    if (key == NULL)
        return PyErr_Occurred() ? -1 : 0; /* the caller checks it is announced first */
    PyObject *seq_obj = PyDict_GetItemWithError(o->seqs, group);
    int64_t seq = 0;
    if ((seq_obj == NULL && PyErr_Occurred()) || (seq_obj != NULL && long_arg(seq_obj, &seq) < 0))
        return -1;
    PyObject *value =
        make_frame(o->head, seq, o->time_ms, body, len, o->has_engine_seq, o->engine_seq);
    if (value == NULL)
        return -1;
    Py_INCREF(key); /* key, kind and group held while Python code (produce) runs */
    Py_INCREF(kind);
    Py_INCREF(group);
    PyObject *call[4] = {NULL, o->topic, value, key};
    PyObject *got =
        PyObject_Vectorcall(o->produce, call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(value);
    Py_DECREF(key);
    int rc = 1;
    if (got == NULL) {
        PyErr_Clear(); /* the caller produces it again and says why it cannot */
        rc = 0;
    } else {
        Py_DECREF(got);
        PyObject *next = PyLong_FromLongLong(seq + 1);
        PyObject *count = PyDict_GetItemWithError(o->counts, kind);
        PyObject *more = NULL;
        if (next != NULL && !(count == NULL && PyErr_Occurred()))
            more = count == NULL ? Py_NewRef(one) : PyNumber_Add(count, one);
        if (next == NULL || more == NULL || PyDict_SetItem(o->seqs, group, next) < 0 ||
            PyDict_SetItem(o->counts, kind, more) < 0)
            rc = -1;
        Py_XDECREF(next);
        Py_XDECREF(more);
    }
    Py_DECREF(kind);
    Py_DECREF(group);
    return rc;
}

/* produce(produce, topic, head, time_ms, engine_seq, items, start, seqs, keys, counts)
 *     -> the index of the first item not produced here (len(items): all were)
 * Frames and produces, in order from items[start], the prepared events (kind, group, body)
 * whose group has its key in keys (see produce_one). Stops at anything else (a kvledger
 * event, a group not keyed yet) and at a produce that raises: the caller takes that item
 * itself, retrying or refusing it, and calls again after it. */
static PyObject *vllm_produce(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Outlet o;
    int64_t start;
    if (nargs != 10 || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "produce(produce, topic, head: bytes, time_ms: int, engine_seq: "
                        "int | None, items: list, start: int, seqs: dict, keys: dict, "
                        "counts: dict)");
        return NULL;
    }
    if (outlet_of(&o, args, args + 7) < 0 || long_arg(args[6], &start) < 0)
        return NULL;
    PyObject *items = args[5];
    Py_ssize_t i = start < 0 ? 0 : (Py_ssize_t)start;
    for (; i < PyList_GET_SIZE(items); i++) { /* produce may run Python code: read again */
        PyObject *item = PyList_GET_ITEM(items, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyBytes_Check(PyTuple_GET_ITEM(item, 2)))
            break;
        PyObject *body = PyTuple_GET_ITEM(item, 2);
        Py_INCREF(item);
        int rc = produce_one(&o, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1),
                             PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body));
        Py_DECREF(item);
        if (rc < 0)
            return NULL;
        if (rc == 0)
            break;
    }
    return PyLong_FromSsize_t(i);
}

/* A batch prepared whole into one buffer: each event's kind, group and body's place. */
typedef struct {
    Writer w;
    Py_ssize_t n;
    struct {
        long kind;
        PyObject *group;
        Py_ssize_t at, len;
    } *ev;
} Batch;

static int batch_start(Batch *b, Py_ssize_t n) {
    b->n = 0;
    b->ev = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *b->ev);
    if (b->ev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (writer_start(&b->w, 4096) < 0) { /* room for a 256-token store */
        PyMem_Free(b->ev);
        return -1;
    }
    return 0;
}

static void batch_end(Batch *b) {
    for (Py_ssize_t i = 0; i < b->n; i++)
        Py_XDECREF(b->ev[i].group);
    PyMem_Free(b->ev);
    PyMem_Free(b->w.buf);
}

/* An event written to b's buffer from at on: its kind and group (stolen) kept beside. */
static void batch_add(Batch *b, long kind, PyObject *group, Py_ssize_t at) {
    b->ev[b->n].kind = kind;
    b->ev[b->n].group = group;
    b->ev[b->n].at = at;
    b->ev[b->n].len = b->w.len - at;
    b->n++;
}

/* The batch produced from its start: (rest, done), rest the items not produced (as
 * prepare() gives them: the caller takes them from there, as produce() says). */
static PyObject *produce_prepared(Batch *b, const Outlet *o) {
    Py_ssize_t done = 0;
    for (; done < b->n; done++) {
        int rc = produce_one(o, kind_names[b->ev[done].kind], b->ev[done].group,
                             b->w.buf + b->ev[done].at, b->ev[done].len);
        if (rc < 0)
            return NULL;
        if (rc == 0)
            break;
    }
    PyObject *rest = PyList_New(b->n - done);
    for (Py_ssize_t i = done; rest != NULL && i < b->n; i++) {
        PyObject *item = item_of(b->ev[i].kind, Py_NewRef(b->ev[i].group),
                                 b->w.buf + b->ev[i].at, b->ev[i].len);
        if (item == NULL)
            Py_CLEAR(rest);
        else
            PyList_SET_ITEM(rest, i - done, item);
    }
    return rest == NULL ? NULL : Py_BuildValue("(Nn)", rest, done);
}

/* A publish's answer once its batch is prepared (rc as the last event's write gave it):
 * the batch produced, None where this pass left an event, NULL on an error; b ended. */
static PyObject *batch_finish(Batch *b, const Outlet *o, int rc) {
    PyObject *out = rc == 0 ? produce_prepared(b, o) : rc == SLOW ? Py_NewRef(Py_None) : NULL;
    batch_end(b);
    return out;
}

/* publish(digest, partial, codes, events, produce, topic, head, time_ms, engine_seq, seqs,
 *         keys, counts) -> (rest, done) | None
 * prepare() over the whole batch, then produce() from its start, in one call, each body
 * framed straight from where it was written: done produced, rest the items after them
 * (empty: all were; else produce stopped there, as it says). None, with nothing produced,
 * when this pass leaves any event of the batch (the caller prepares and writes it). */
static PyObject *vllm_publish(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Outlet o;
    if (nargs != 12 || (args[1] != Py_None && !PyDict_Check(args[1])) ||
        !PyDict_Check(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "publish(digest, partial: dict | None, codes: dict, events: list, "
                        "produce, topic, head, time_ms, engine_seq, seqs, keys, counts)");
        return NULL;
    }
    int digest = PyObject_IsTrue(args[0]);
    if (digest < 0 || outlet_of(&o, args + 4, args + 9) < 0)
        return NULL;
    PyObject *events = args[3], *codes = args[2];
    Batch b;
    if (batch_start(&b, PyList_GET_SIZE(events)) < 0)
        return NULL;
    int rc = 0;
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(events); rc == 0 && i < n; i++) {
        if (shrank(events, i)) {
            rc = -1;
            break;
        }
        PyObject *event = Py_NewRef(PyList_GET_ITEM(events, i));
        PyObject *code = PyDict_GetItemWithError(codes, (PyObject *)Py_TYPE(event));
        long kind = code != NULL && PyLong_CheckExact(code) ? PyLong_AsLong(code) : -1;
        if (code == NULL && PyErr_Occurred())
            rc = -1;
        else if (kind != 0 && kind != 1) /* a class not seen yet, or not vLLM's */
            rc = SLOW;
        else {
            Py_ssize_t at = b.w.len;
            PyObject *group;
            if ((rc = write_one(kind, event, digest, args[1], &b.w, &group)) == 0)
                batch_add(&b, kind, group, at);
        }
        Py_DECREF(event);
    }
    return batch_finish(&b, &o, rc);
}

/* publish_packed(digest, partial, events, produce, topic, head, time_ms, engine_seq, seqs,
 *                keys, counts) -> (rest, done) | None
 * As publish(), for a relay's batch whose events are still msgpack (buffers): event() over
 * the whole batch, then produce() from its start. None, nothing produced, when event()
 * declines any of them (the caller decodes the batch whole). */
static PyObject *vllm_publish_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Outlet o;
    if (nargs != 11 || (args[1] != Py_None && !PyDict_Check(args[1])) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "publish_packed(digest, partial: dict | None, events: list, produce, "
                        "topic, head, time_ms, engine_seq, seqs, keys, counts)");
        return NULL;
    }
    int digest = PyObject_IsTrue(args[0]);
    if (digest < 0 || outlet_of(&o, args + 3, args + 8) < 0)
        return NULL;
    PyObject *events = args[2];
    Batch b;
    Located e = {.tokens = {NULL, 0, 0}}; /* shared by the batch's events, as b's writer is */
    if (batch_start(&b, PyList_GET_SIZE(events)) < 0)
        return NULL;
    int rc = 0;
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(events); rc == 0 && i < n; i++) {
        if (shrank(events, i)) {
            rc = -1;
            break;
        }
        int kind;
        int64_t group;
        Py_ssize_t at = b.w.len;
        PyObject *g = NULL;
        rc = packed_write(PyList_GET_ITEM(events, i), digest, args[1], &b.w, &e, &kind, &group);
        if (rc == 0 && (g = PyLong_FromLongLong(group)) == NULL)
            rc = -1;
        if (rc == 0)
            batch_add(&b, kind, g, at);
    }
    PyMem_Free(e.tokens.buf);
    return batch_finish(&b, &o, rc);
}

static PyMethodDef methods[] = {
    {"body", (PyCFunction)(void (*)(void))vllm_body, METH_FASTCALL,
     "body(kind, event, digest, partial) -> (kind name, group, branch bytes) | None."},
    {"prepare", (PyCFunction)(void (*)(void))vllm_prepare, METH_FASTCALL,
     "prepare(events, digest, partial, codes) -> (items, left) | None."},
    {"event", (PyCFunction)(void (*)(void))vllm_event, METH_FASTCALL,
     "event(packed, digest, partial) -> (kind name, group, branch bytes) | None."},
    {"produce", (PyCFunction)(void (*)(void))vllm_produce, METH_FASTCALL,
     "produce(produce, topic, head, time_ms, engine_seq, items, start, seqs, keys, counts) "
     "-> the index of the first item not produced."},
    {"publish", (PyCFunction)(void (*)(void))vllm_publish, METH_FASTCALL,
     "publish(digest, partial, codes, events, produce, topic, head, time_ms, engine_seq, "
     "seqs, keys, counts) -> (items, done) | None."},
    {"publish_packed", (PyCFunction)(void (*)(void))vllm_publish_packed, METH_FASTCALL,
     "publish_packed(digest, partial, events, produce, topic, head, time_ms, engine_seq, "
     "seqs, keys, counts) -> (items, done) | None."},
    {"frame", (PyCFunction)(void (*)(void))vllm_frame, METH_FASTCALL,
     "frame(head, seq, time_ms, body, engine_seq) -> one message's bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_vllm", "vLLM's KV cache events to kvledger's Avro, compiled.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__vllm(void) {
    for (int i = 0; i < F_COUNT; i++) {
        name_lengths[i] = (Py_ssize_t)strlen(field_names[i]);
        if ((names[i] = PyUnicode_InternFromString(field_names[i])) == NULL)
            return NULL;
    }
    if ((layouts = PyDict_New()) == NULL || (zero = PyLong_FromLong(0)) == NULL ||
        (one = PyLong_FromLong(1)) == NULL ||
        (kind_names[0] = PyUnicode_InternFromString("BlockStored")) == NULL ||
        (kind_names[1] = PyUnicode_InternFromString("BlockRemoved")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
