/* vLLM's events still in msgpack, as a relay receives them, to the same Avro bytes as the
 * object pass (producer/_vllm.c). Included by _vllm.c.
 *
 * A relay decodes a batch's outline (ts, events, rank) with msgspec and leaves each event
 * as its msgpack (msgspec.Raw): no Python object per token id or hash. event() reads one: a
 * tagged map (vLLM 0.33.0) or a positional array (older engines), vLLM's field names and
 * order, absent fields at their defaults. It takes only what it can read exactly: ints of
 * the contract's ranges, ASCII strings, hashes as unsigned 64-bit ints or bin, extra keys
 * all nil, known fields once each. Anything else is SLOW: the relay then decodes that
 * batch whole (msgspec, the Python mapping), which gives the same bytes or the reason. */

typedef struct {
    const unsigned char *p, *end;
} Packed;

static int take(Packed *m, int n, uint64_t *out) { /* n big-endian bytes */
    if (m->end - m->p < n)
        return SLOW;
    uint64_t x = 0;
    for (int i = 0; i < n; i++)
        x = x << 8 | m->p[i];
    m->p += n;
    *out = x;
    return 0;
}

/* The count of an array (maps: map = 1) whose items take a byte at least. */
static int mp_count(Packed *m, int map, Py_ssize_t *n) {
    if (m->p >= m->end)
        return SLOW;
    unsigned char b = *m->p++;
    uint64_t size;
    if ((b & 0xf0) == (map ? 0x80 : 0x90))
        size = b & 0x0f;
    else if (b == (map ? 0xde : 0xdc) || b == (map ? 0xdf : 0xdd)) {
        if (take(m, b == (map ? 0xde : 0xdc) ? 2 : 4, &size))
            return SLOW;
    } else
        return SLOW;
    if (size > (uint64_t)(m->end - m->p))
        return SLOW;
    *n = (Py_ssize_t)size;
    return 0;
}

static int mp_nil(Packed *m) {
    if (m->p < m->end && *m->p == 0xc0) {
        m->p++;
        return 1;
    }
    return 0;
}

/* One int: 0 and *out; SLOW for another type, or an unsigned beyond int64 (then *big holds
 * it, where hashes want it). */
static int mp_int(Packed *m, int64_t *out, uint64_t *big) {
    if (m->p >= m->end)
        return SLOW;
    unsigned char b = *m->p;
    uint64_t u;
    if (b <= 0x7f || b >= 0xe0) {
        m->p++;
        *out = b <= 0x7f ? (int64_t)b : (int64_t)(int8_t)b; /* positive, negative fixint */
        return 0;
    }
    if (b >= 0xcc && b <= 0xcf) { /* uint 8..64 */
        m->p++;
        if (take(m, 1 << (b - 0xcc), &u))
            return SLOW;
        if (u > INT64_MAX) {
            if (big != NULL)
                *big = u;
            return SLOW;
        }
        *out = (int64_t)u;
        return 0;
    }
    if (b >= 0xd0 && b <= 0xd3) { /* int 8..64 */
        int n = 1 << (b - 0xd0);
        m->p++;
        if (take(m, n, &u))
            return SLOW;
        *out = n == 8 ? (int64_t)u : (int64_t)(u << (64 - 8 * n)) >> (64 - 8 * n);
        return 0;
    }
    return SLOW;
}

/* A str: its bytes, ASCII only (msgspec checks UTF-8 where the batch is decoded whole). */
static int mp_str(Packed *m, const char **s, Py_ssize_t *n) {
    if (m->p >= m->end)
        return SLOW;
    unsigned char b = *m->p++;
    uint64_t len;
    if ((b & 0xe0) == 0xa0)
        len = b & 0x1f;
    else if (b >= 0xd9 && b <= 0xdb) {
        if (take(m, 1 << (b - 0xd9), &len))
            return SLOW;
    } else
        return SLOW;
    if (len > (uint64_t)(m->end - m->p))
        return SLOW;
    for (uint64_t i = 0; i < len; i++)
        if (m->p[i] & 0x80)
            return SLOW;
    *s = (const char *)m->p;
    *n = (Py_ssize_t)len;
    m->p += len;
    return 0;
}

/* Past one value of any type, nested up to a depth. */
static int mp_skip(Packed *m, int depth);

/* The bytes an int, nil or bool takes (0: another type). */
static inline Py_ssize_t scalar_size(unsigned char b) {
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return 1;
    if (b >= 0xcc && b <= 0xd3)
        return 1 + ((Py_ssize_t)1 << ((b - 0xcc) & 3));
    return 0;
}

static int mp_skip(Packed *m, int depth) {
    if (m->p >= m->end || depth > 32)
        return SLOW;
    unsigned char b = *m->p;
    uint64_t len;
    Py_ssize_t n;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
        m->p++;
        return 0;
    }
    if ((b & 0xe0) == 0xa0) { /* fixstr */
        m->p++;
        len = b & 0x1f;
    } else if (b >= 0xd9 && b <= 0xdb) { /* str 8..32 */
        m->p++;
        if (take(m, 1 << (b - 0xd9), &len))
            return SLOW;
    } else if (b >= 0xc4 && b <= 0xc6) { /* bin */
        m->p++;
        if (take(m, 1 << (b - 0xc4), &len))
            return SLOW;
    } else if (b >= 0xcc && b <= 0xd3) { /* ints */
        m->p++;
        len = (uint64_t)1 << ((b - 0xcc) & 3);
    } else if (b == 0xca || b == 0xcb) { /* floats */
        m->p++;
        len = b == 0xca ? 4 : 8;
    } else if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd ||
               (b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
        int map = (b & 0xf0) == 0x80 || b == 0xde || b == 0xdf;
        if (mp_count(m, map, &n))
            return SLOW;
        for (Py_ssize_t i = 0; i < n * (map ? 2 : 1); i++) {
            Py_ssize_t size = m->p < m->end ? scalar_size(*m->p) : 0;
            if (size > 0 && size <= m->end - m->p) /* token ids, hashes: no call each */
                m->p += size;
            else if (mp_skip(m, depth + 1))
                return SLOW;
        }
        return 0;
    } else
        return SLOW; /* ext types: not vLLM's */
    if (len > (uint64_t)(m->end - m->p))
        return SLOW;
    m->p += len;
    return 0;
}

/* Token ids: an array of ints (lo..hi), the common widths read inline. */
static int mp_write_ints(Writer *w, Packed *m, int64_t lo, int64_t hi) {
    Py_ssize_t n;
    if (mp_count(m, 0, &n))
        return SLOW;
    /* Room for every item and the end byte, also when there is no item (the end byte of
     * an empty array is written too: many empty arrays must not outgrow the buffer). */
    if ((n > 0 && write_long(w, n) < 0) || grow(w, n * 10 + 1) < 0)
        return -1;
    unsigned char *o = (unsigned char *)w->buf + w->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t x;
        unsigned char b = m->p < m->end ? *m->p : 0xc1; /* 0xc1: never used by msgpack */
        if (b <= 0x7f) {
            x = b;
            m->p++;
        } else if (b == 0xcd && m->end - m->p >= 3) { /* uint 16: vocabularies' ids */
            x = (int64_t)m->p[1] << 8 | m->p[2];
            m->p += 3;
        } else if (mp_int(m, &x, NULL)) {
            return SLOW;
        }
        if (x < lo || x > hi)
            return SLOW;
        o = put_long(o, x);
    }
    *o++ = 0; /* the array's end */
    w->len = (char *)o - w->buf;
    return 0;
}

/* One hash: an unsigned 64-bit int (8 bytes, big-endian) or bin. */
static int mp_write_hash(Writer *w, Packed *m, int digest) {
    unsigned char b = m->p < m->end ? *m->p : 0xc1;
    if (b >= 0xc4 && b <= 0xc6) { /* bin 8..32 */
        uint64_t len;
        m->p++;
        if (take(m, 1 << (b - 0xc4), &len) || len > (uint64_t)(m->end - m->p))
            return SLOW;
        int rc = write_hash_bytes(w, (const char *)m->p, (Py_ssize_t)len, digest);
        m->p += len;
        return rc;
    }
    int64_t x;
    uint64_t u = 0;
    int got = mp_int(m, &x, &u);
    if (got == 0 && x >= 0)
        u = (uint64_t)x;
    else if (got == 0 || u <= INT64_MAX) /* negative, or not an int */
        return SLOW;
    unsigned char be[8];
    for (int k = 0; k < 8; k++)
        be[k] = (unsigned char)(u >> (56 - 8 * k));
    return write_long(w, 8) < 0 || write_raw(w, be, 8) < 0 ? -1 : 0;
}

static int mp_write_hashes(Writer *w, Packed *m, int digest) {
    Py_ssize_t n;
    if (mp_count(m, 0, &n))
        return SLOW;
    if (n > 0 && write_long(w, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = mp_write_hash(w, m, digest);
        if (rc != 0)
            return rc;
    }
    return write_long(w, 0);
}

/* Each field's value, where it starts in the event (NULL: absent, its default); the
 * token ids already written as Avro (read once: they are most of a store's bytes). */
typedef struct {
    const unsigned char *at[F_COUNT];
    const unsigned char *end;
    Writer tokens;
} Located;

/* Past a field's value; token ids are written to e->tokens on the way. */
static int pass_value(Packed *m, Located *e, int f) {
    if (f != F_TOKEN_IDS)
        return mp_skip(m, 0);
    if (e->tokens.buf == NULL && writer_start(&e->tokens, 1024) < 0)
        return -1;
    e->tokens.len = 0;
    return mp_write_ints(&e->tokens, m, INT32_MIN, INT32_MAX);
}

static const unsigned char nil_byte = 0xc0;

static Packed field(Located *e, int f) {
    Packed m = {e->at[f] ? e->at[f] : &nil_byte, e->at[f] ? e->end : &nil_byte + 1};
    return m;
}

/* A union [null, int] or [null, long], or [null, string]. */
static int mp_write_opt_int(Writer *w, Located *e, int f, int64_t lo, int64_t hi) {
    Packed m = field(e, f);
    int64_t x;
    if (mp_nil(&m))
        return write_long(w, 0);
    if (mp_int(&m, &x, NULL) || x < lo || x > hi)
        return SLOW;
    return write_long(w, 1) < 0 || write_long(w, x) < 0 ? -1 : 0;
}

static int mp_write_opt_str(Writer *w, Located *e, int f) {
    Packed m = field(e, f);
    const char *s;
    Py_ssize_t n;
    if (mp_nil(&m))
        return write_long(w, 0);
    if (mp_str(&m, &s, &n))
        return SLOW;
    return write_long(w, 1) < 0 || write_long(w, n) < 0 || write_raw(w, s, n) < 0 ? -1 : 0;
}

static Py_ssize_t name_lengths[F_COUNT]; /* of field_names, set as the module loads */

/* Where each field of a tagged map or a positional array starts; *kind 0 or 1. */
static int locate(Packed *m, Located *e, int *kind) {
    static const char *const kinds[2] = {"BlockStored", "BlockRemoved"};
    const char *s;
    Py_ssize_t n, len;
    Writer tokens = e->tokens; /* the caller's, kept */
    memset(e, 0, sizeof *e);
    e->tokens = tokens;
    e->end = m->end;
    if (m->p < m->end && ((*m->p & 0xf0) == 0x90 || *m->p == 0xdc || *m->p == 0xdd)) {
        if (mp_count(m, 0, &n) || n < 1 || mp_str(m, &s, &len))
            return SLOW;
        *kind = -1;
        for (int k = 0; k < 2; k++)
            if ((Py_ssize_t)strlen(kinds[k]) == len && memcmp(s, kinds[k], len) == 0)
                *kind = k;
        if (*kind < 0)
            return SLOW;
        const int *order = *kind == 0 ? stored_fields : removed_fields;
        Py_ssize_t fields = *kind == 0 ? 15 : 5; /* vLLM's, without kvledger's two */
        if (n - 1 > fields)
            return SLOW;
        for (Py_ssize_t i = 0; i < n - 1; i++) {
            int rc;
            e->at[order[i]] = m->p;
            if ((rc = pass_value(m, e, order[i])) != 0)
                return rc;
        }
        return m->p == m->end ? 0 : SLOW;
    }
    if (mp_count(m, 1, &n))
        return SLOW;
    *kind = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mp_str(m, &s, &len))
            return SLOW;
        if (len == 4 && memcmp(s, "type", 4) == 0) {
            const char *t;
            Py_ssize_t tlen;
            if (*kind >= 0 || mp_str(m, &t, &tlen))
                return SLOW;
            for (int k = 0; k < 2; k++)
                if ((Py_ssize_t)strlen(kinds[k]) == tlen && memcmp(t, kinds[k], tlen) == 0)
                    *kind = k;
            if (*kind < 0)
                return SLOW;
            continue;
        }
        int f = -1;
        for (int k = 0; k < F_TOKEN_START && f < 0; k++) /* vLLM's, not kvledger's two */
            if (name_lengths[k] == len && memcmp(s, field_names[k], (size_t)len) == 0)
                f = k;
        if (f < 0 || e->at[f] != NULL) /* a field unknown here, or twice */
            return SLOW;
        e->at[f] = m->p;
        int rc = pass_value(m, e, f);
        if (rc != 0)
            return rc;
    }
    if (*kind < 0 || m->p != m->end)
        return SLOW;
    const int *order = *kind == 0 ? stored_fields : removed_fields;
    Py_ssize_t fields = *kind == 0 ? 15 : 5;
    for (int f = 0; f < F_TOKEN_START; f++) { /* every field present is one of the kind's */
        int ours = 0;
        for (Py_ssize_t i = 0; i < fields; i++)
            ours |= order[i] == f;
        if (e->at[f] != NULL && !ours)
            return SLOW;
    }
    return 0;
}

static int mp_write_stored(Writer *w, Located *e, int digest, int64_t group, PyObject *partial) {
    Packed m;
    int rc;
    int64_t block_size, hash_size;
    for (int f = 0; f < STORED_REQUIRED; f++)
        if (e->at[f] == NULL)
            return SLOW; /* the mapping names what is missing */
    m = field(e, F_BLOCK_SIZE);
    if (mp_int(&m, &block_size, NULL) || block_size < INT32_MIN || block_size > INT32_MAX)
        return SLOW;
    int part = 0;
    if (block_size != 0 && partial != Py_None) {
        PyObject *key = PyLong_FromLongLong(group);
        PyObject *size = key == NULL ? NULL : PyDict_GetItemWithError(partial, key);
        Py_XDECREF(key);
        if (size == NULL && PyErr_Occurred())
            return -1;
        if (size != NULL) {
            if (exact_int(size, INT64_MIN, INT64_MAX, &hash_size))
                return SLOW;
            part = hash_size == block_size;
        }
    }
    if (write_long(w, 0) < 0) /* the envelope's union: BlockStored */
        return -1;
    m = field(e, F_BLOCK_HASHES);
    if ((rc = mp_write_hashes(w, &m, digest)) != 0)
        return rc;
    m = field(e, F_PARENT_BLOCK_HASH);
    if (mp_nil(&m))
        rc = write_long(w, 0);
    else
        rc = write_long(w, 1) < 0 ? -1 : mp_write_hash(w, &m, digest);
    if (rc != 0)
        return rc;
    if (write_raw(w, e->tokens.buf, e->tokens.len) < 0 || write_long(w, block_size) < 0)
        return -1;
    if ((rc = mp_write_opt_int(w, e, F_LORA_ID, INT32_MIN, INT32_MAX)) ||
        (rc = mp_write_opt_str(w, e, F_MEDIUM)) || (rc = mp_write_opt_str(w, e, F_LORA_NAME)))
        return rc;
    m = field(e, F_EXTRA_KEYS); /* taken only when no block has any */
    if (mp_nil(&m))
        rc = write_long(w, 0);
    else {
        Py_ssize_t n;
        if (mp_count(&m, 0, &n))
            return SLOW;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!mp_nil(&m))
                return SLOW;
        rc = write_long(w, 1) < 0 || write_nulls(w, n) < 0 ? -1 : 0;
    }
    if (rc != 0 || (rc = mp_write_opt_int(w, e, F_GROUP_IDX, INT32_MIN, INT32_MAX)) ||
        (rc = mp_write_opt_str(w, e, F_SPEC_KIND)) ||
        (rc = mp_write_opt_int(w, e, F_SLIDING_WINDOW, INT32_MIN, INT32_MAX)) ||
        (rc = mp_write_opt_str(w, e, F_LOCALITY)) || (rc = mp_write_opt_str(w, e, F_OWNERSHIP)))
        return rc;
    char flags[2] = {0, (char)part}; /* token_start: null (vLLM says none); partial */
    if (write_raw(w, flags, 2) < 0 || (rc = mp_write_opt_str(w, e, F_SESSION_ID)) != 0)
        return rc < 0 ? -1 : rc;
    m = field(e, F_LOOKAHEAD);
    if (mp_nil(&m))
        return write_long(w, 0);
    Py_ssize_t n;
    if (mp_count(&m, 0, &n))
        return SLOW;
    if (write_long(w, 1) < 0 || (n > 0 && write_long(w, n) < 0))
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((rc = mp_write_ints(w, &m, INT64_MIN, INT64_MAX)) != 0)
            return rc;
    return write_long(w, 0);
}

static int mp_write_removed(Writer *w, Located *e, int digest) {
    Packed m;
    int rc;
    for (int i = 0; i < REMOVED_REQUIRED; i++)
        if (e->at[removed_fields[i]] == NULL)
            return SLOW;
    if (write_long(w, 1) < 0) /* the envelope's union: BlockRemoved */
        return -1;
    m = field(e, F_BLOCK_HASHES);
    if ((rc = mp_write_hashes(w, &m, digest)) ||
        (rc = mp_write_opt_str(w, e, F_MEDIUM)) ||
        (rc = mp_write_opt_int(w, e, F_GROUP_IDX, INT32_MIN, INT32_MAX)) ||
        (rc = mp_write_opt_str(w, e, F_LOCALITY)) || (rc = mp_write_opt_str(w, e, F_OWNERSHIP)))
        return rc;
    return 0;
}

/* One event still in msgpack, its body appended to w: 0 with *kind and *group set, SLOW
 * where this pass does not take it, -1 on an error; e: a place for the event's fields and
 * token ids (a batch's events share one). */
static int packed_write(PyObject *packed, int digest, PyObject *partial, Writer *w, Located *e,
                        int *kind, int64_t *group) {
    Py_buffer view;
    if (PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE) < 0)
        return -1;
    Packed m = {view.buf, (const unsigned char *)view.buf + view.len};
    *kind = -1;
    *group = 0;
    int rc = locate(&m, e, kind);
    if (rc == 0 && e->at[F_GROUP_IDX] != NULL) {
        Packed g = field(e, F_GROUP_IDX);
        if (!mp_nil(&g) && (mp_int(&g, group, NULL) || *group < INT32_MIN || *group > INT32_MAX))
            rc = SLOW;
    }
    if (rc == 0)
        rc = *kind == 0 ? mp_write_stored(w, e, digest, *group, partial)
                        : mp_write_removed(w, e, digest);
    PyBuffer_Release(&view);
    return rc;
}

/* event(packed, digest, partial) -> (kind name, group, bytes) | None */
static PyObject *vllm_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || (args[2] != Py_None && !PyDict_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "event(packed, digest: bool, partial: dict | None)");
        return NULL;
    }
    int digest = PyObject_IsTrue(args[1]);
    if (digest < 0)
        return NULL;
    Writer w;
    Located e = {.tokens = {NULL, 0, 0}};
    int kind;
    int64_t group;
    if (writer_start(&w, 1024) < 0)
        return NULL;
    int rc = packed_write(args[0], digest, args[2], &w, &e, &kind, &group);
    PyObject *out = rc == SLOW ? Py_NewRef(Py_None)
                    : rc < 0   ? NULL
                               : item_of(kind, PyLong_FromLongLong(group), w.buf, w.len);
    PyMem_Free(w.buf);
    PyMem_Free(e.tokens.buf);
    return out;
}
