/* The router's holder masks, compiled: block hash (bytes) -> a bitmask of holder ids.
 *
 * Why compiled: a prompt walk probes one hash per position in a table of a million blocks,
 * and every probe misses the CPU caches. Through a Python dict the misses come one after
 * the other (~200 ns each, ~25 us for 128 positions, measured). Here a walk hashes every
 * position first and prefetches every bucket, then every matching key and mask, so the
 * misses overlap; the AND over the positions is then done on words.
 *
 * The table is open addressing with linear probing (load <= 1/2) and backward-shift
 * deletion; each slot holds the key's 64-bit hash, a reference to the key (a bytes object,
 * compared in full on every hit: answers are exact) and, in parallel arrays, its mask as
 * `width` 64-bit words (widened when a holder id passes 64 * width) and its block's token
 * end (what a block-granularity match reports as matched tokens; 0: not known).
 *
 * MaskTable has the same methods as masks.MaskDict, the pure-Python implementation that
 * answers identically (tests/unit/test_masks.py runs both on the same operations).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#define CTZ64(x) __builtin_ctzll(x)
#else
#define PREFETCH(p) ((void)(p))
static int CTZ64(uint64_t x) { int n = 0; while (!(x & 1)) { x >>= 1; n++; } return n; }
#endif

typedef struct {
    uint64_t hash;
    PyObject *key; /* a bytes object; NULL: empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    uint64_t *bits;  /* cap * width words */
    int64_t *ends;   /* cap token ends */
    Py_ssize_t cap;  /* a power of two */
    Py_ssize_t used;
    Py_ssize_t width;
} MaskTable;

/* A key's hash: CPython's own hash of a bytes object, SipHash-1-3 under a key drawn at
 * random for each process (unless PYTHONHASHSEED fixes it), which the object caches. Block
 * hashes come from the topic, and anyone who can write to it could craft keys that collide
 * under an unkeyed mix (tried: 20,000 such keys made apply 8x and a lookup 25x slower):
 * under a secret key, crafted keys cost what random ones do. */
static uint64_t key_hash(PyObject *key) { return (uint64_t)PyObject_Hash(key); }

static int same_key(PyObject *stored, const char *p, Py_ssize_t n) {
    return PyBytes_GET_SIZE(stored) == n && memcmp(PyBytes_AS_STRING(stored), p, (size_t)n) == 0;
}

/* The slot holding the key (>= 0), or -(empty slot where it would go) - 1. */
static Py_ssize_t find_from(MaskTable *t, Py_ssize_t i, uint64_t h, const char *p, Py_ssize_t n) {
    Py_ssize_t m = t->cap - 1;
    for (;;) {
        Slot *s = &t->slots[i];
        if (s->key == NULL)
            return -i - 1;
        if (s->hash == h && same_key(s->key, p, n))
            return i;
        i = (i + 1) & m;
    }
}

static Py_ssize_t find(MaskTable *t, uint64_t h, const char *p, Py_ssize_t n) {
    return find_from(t, (Py_ssize_t)(h & (uint64_t)(t->cap - 1)), h, p, n);
}

static int key_of(PyObject *key, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a block hash is bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *p = PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

static int allocate(MaskTable *t, Py_ssize_t cap, Py_ssize_t width) {
    Slot *slots = PyMem_Calloc((size_t)cap, sizeof(Slot));
    uint64_t *bits = PyMem_Calloc((size_t)(cap * width), sizeof(uint64_t));
    int64_t *ends = PyMem_Calloc((size_t)cap, sizeof(int64_t));
    if (slots == NULL || bits == NULL || ends == NULL) {
        PyMem_Free(slots);
        PyMem_Free(bits);
        PyMem_Free(ends);
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->bits = bits;
    t->ends = ends;
    t->cap = cap;
    t->width = width;
    return 0;
}

/* Rebuild with another capacity and/or mask width (the masks keep their bits). */
static int rebuild(MaskTable *t, Py_ssize_t cap, Py_ssize_t width) {
    Slot *old = t->slots;
    uint64_t *old_bits = t->bits;
    int64_t *old_ends = t->ends;
    Py_ssize_t old_cap = t->cap, old_width = t->width;
    if (allocate(t, cap, width) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < old_cap; i++) {
        if (old[i].key == NULL)
            continue;
        Py_ssize_t j = (Py_ssize_t)(old[i].hash & (uint64_t)(cap - 1));
        while (t->slots[j].key != NULL)
            j = (j + 1) & (cap - 1);
        t->slots[j] = old[i];
        t->ends[j] = old_ends[i];
        memcpy(&t->bits[j * width], &old_bits[i * old_width], (size_t)old_width * sizeof(uint64_t));
    }
    PyMem_Free(old);
    PyMem_Free(old_bits);
    PyMem_Free(old_ends);
    return 0;
}

static void delete_at(MaskTable *t, Py_ssize_t i) {
    Py_ssize_t m = t->cap - 1, w = t->width;
    PyObject *gone = t->slots[i].key;
    Py_ssize_t j = i;
    for (;;) { /* backward shift: pull later entries of the run into the hole */
        j = (j + 1) & m;
        if (t->slots[j].key == NULL)
            break;
        Py_ssize_t home = (Py_ssize_t)(t->slots[j].hash & (uint64_t)m);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays)
            continue;
        t->slots[i] = t->slots[j];
        t->ends[i] = t->ends[j];
        memcpy(&t->bits[i * w], &t->bits[j * w], (size_t)w * sizeof(uint64_t));
        i = j;
    }
    t->slots[i].key = NULL;
    t->slots[i].hash = 0;
    t->ends[i] = 0;
    memset(&t->bits[i * w], 0, (size_t)w * sizeof(uint64_t));
    t->used--;
    Py_DECREF(gone);
}

static PyObject *mask_int(const uint64_t *words, Py_ssize_t width) {
    unsigned char buf[8 * 64];
    unsigned char *b = width <= 64 ? buf : PyMem_Malloc((size_t)width * 8);
    if (b == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < width; k++)
        for (int j = 0; j < 8; j++)
            b[k * 8 + j] = (unsigned char)(words[k] >> (8 * j));
    PyObject *out = _PyLong_FromByteArray(b, (size_t)width * 8, 1, 0);
    if (b != buf)
        PyMem_Free(b);
    return out;
}

/* ------------------------------------------------------------------ type */

static PyObject *MaskTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist))
        return NULL;
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (allocate(t, 8, 1) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void MaskTable_dealloc(MaskTable *t) {
    if (t->slots != NULL)
        for (Py_ssize_t i = 0; i < t->cap; i++)
            Py_XDECREF(t->slots[i].key);
    PyMem_Free(t->slots);
    PyMem_Free(t->bits);
    PyMem_Free(t->ends);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t MaskTable_len(MaskTable *t) { return t->used; }

static int bit_arg(PyObject *arg, Py_ssize_t *bit) {
    *bit = PyLong_AsSsize_t(arg);
    if (*bit == -1 && PyErr_Occurred())
        return -1;
    if (*bit < 0 || *bit >= (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "a holder id is in [0, 2**20)");
        return -1;
    }
    return 0;
}

/* (key, bit) arguments: the key's bytes and the holder id. */
static int key_bit(PyObject *const *args, Py_ssize_t nargs, const char *usage, const char **p,
                   Py_ssize_t *n, Py_ssize_t *bit) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    return key_of(args[0], p, n) < 0 || bit_arg(args[1], bit) < 0 ? -1 : 0;
}

static PyObject *MaskTable_set_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    Py_ssize_t n, bit;
    if (key_bit(args, nargs, "set_bit(key, bit)", &p, &n, &bit) < 0)
        return NULL;
    if (bit >= t->width * 64) {
        Py_ssize_t width = t->width;
        while (bit >= width * 64)
            width *= 2;
        if (rebuild(t, t->cap, width) < 0)
            return NULL;
    }
    uint64_t h = key_hash(args[0]);
    Py_ssize_t i = find(t, h, p, n);
    int inserted = i < 0;
    if (i < 0) {
        if ((t->used + 1) * 2 > t->cap) {
            if (rebuild(t, t->cap * 2, t->width) < 0)
                return NULL;
            i = find(t, h, p, n);
        }
        i = -i - 1;
        Py_INCREF(args[0]);
        t->slots[i].key = args[0];
        t->slots[i].hash = h;
        t->used++;
    }
    t->bits[i * t->width + bit / 64] |= (uint64_t)1 << (bit % 64);
    return PyBool_FromLong(inserted);
}

static PyObject *MaskTable_set_end(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    Py_ssize_t n;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_end(key, end)");
        return NULL;
    }
    if (key_of(args[0], &p, &n) < 0)
        return NULL;
    long long end = PyLong_AsLongLong(args[1]);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t i = find(t, key_hash(args[0]), p, n);
    if (i < 0)
        Py_RETURN_FALSE;
    t->ends[i] = end;
    Py_RETURN_TRUE;
}

static PyObject *MaskTable_clear_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    Py_ssize_t n, bit;
    if (key_bit(args, nargs, "clear_bit(key, bit)", &p, &n, &bit) < 0)
        return NULL;
    Py_ssize_t i = find(t, key_hash(args[0]), p, n);
    if (i < 0)
        Py_RETURN_FALSE;
    uint64_t *row = &t->bits[i * t->width];
    if (bit < t->width * 64)
        row[bit / 64] &= ~((uint64_t)1 << (bit % 64));
    for (Py_ssize_t k = 0; k < t->width; k++)
        if (row[k])
            Py_RETURN_TRUE;
    delete_at(t, i);
    Py_RETURN_FALSE;
}

static PyObject *MaskTable_has_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    Py_ssize_t n, bit;
    if (key_bit(args, nargs, "has_bit(key, bit)", &p, &n, &bit) < 0)
        return NULL;
    Py_ssize_t i = find(t, key_hash(args[0]), p, n);
    if (i < 0 || bit >= t->width * 64)
        Py_RETURN_FALSE;
    return PyBool_FromLong((long)((t->bits[i * t->width + bit / 64] >> (bit % 64)) & 1));
}

static PyObject *MaskTable_get(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    if (PyBytes_Check(args[0])) {
        const char *p = PyBytes_AS_STRING(args[0]);
        Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
        Py_ssize_t i = find(t, key_hash(args[0]), p, n);
        if (i >= 0)
            return mask_int(&t->bits[i * t->width], t->width);
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    Py_RETURN_NONE;
}

static PyObject *MaskTable_mask(MaskTable *t, PyObject *key) {
    PyObject *zero = PyLong_FromLong(0), *args[2] = {key, zero};
    if (zero == NULL)
        return NULL;
    PyObject *out = MaskTable_get(t, args, 2);
    Py_DECREF(zero);
    return out;
}

static int MaskTable_contains(MaskTable *t, PyObject *key) {
    const char *p;
    Py_ssize_t n;
    if (!PyBytes_Check(key))
        return 0;
    key_of(key, &p, &n);
    return find(t, key_hash(key), p, n) >= 0;
}

static PyObject *MaskTable_items(MaskTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (t->slots[i].key == NULL)
            continue;
        PyObject *mask = mask_int(&t->bits[i * t->width], t->width);
        PyObject *pair = mask ? PyTuple_Pack(2, t->slots[i].key, mask) : NULL;
        Py_XDECREF(mask);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *MaskTable_keys(MaskTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(t->used);
    if (out == NULL)
        return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slots[i].key != NULL) {
            Py_INCREF(t->slots[i].key);
            PyList_SET_ITEM(out, k++, t->slots[i].key);
        }
    return out;
}

static PyObject *MaskTable_held_by(MaskTable *t, PyObject *arg) {
    Py_ssize_t bit;
    if (bit_arg(arg, &bit) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || bit >= t->width * 64)
        return out;
    uint64_t one = (uint64_t)1 << (bit % 64);
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slots[i].key != NULL && (t->bits[i * t->width + bit / 64] & one))
            if (PyList_Append(out, t->slots[i].key) < 0) {
                Py_DECREF(out);
                return NULL;
            }
    return out;
}

static PyObject *MaskTable_iter(MaskTable *t) {
    PyObject *keys = MaskTable_keys(t, NULL);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* The masks of a prompt's positions, into out (n * width words, zero for a hash nobody
 * holds): hash and prefetch every bucket, then find every candidate and prefetch its key and
 * mask, then check the keys in full. */
static int prompt_masks(MaskTable *t, PyObject *seq, uint64_t *out, int64_t *ends, uint64_t *h,
                        Py_ssize_t *at) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), w = t->width, m = t->cap - 1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "a block hash is bytes, not %.100s",
                         Py_TYPE(items[i])->tp_name);
            return -1;
        }
        h[i] = key_hash(items[i]);
        PREFETCH(&t->slots[h[i] & (uint64_t)m]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = (Py_ssize_t)(h[i] & (uint64_t)m);
        while (t->slots[j].key != NULL && t->slots[j].hash != h[i])
            j = (j + 1) & m;
        at[i] = t->slots[j].key != NULL ? j : -1;
        if (at[i] >= 0) {
            PREFETCH(PyBytes_AS_STRING(t->slots[j].key));
            PREFETCH(&t->bits[j * w]);
            PREFETCH(&t->ends[j]);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *p = PyBytes_AS_STRING(items[i]);
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]), j = at[i];
        if (j >= 0 && !same_key(t->slots[j].key, p, len)) {
            /* same 64-bit hash, another key: go on probing after it */
            j = find_from(t, (j + 1) & m, h[i], p, len);
        }
        if (j >= 0) {
            memcpy(&out[i * w], &t->bits[j * w], (size_t)w * sizeof(uint64_t));
            ends[i] = t->ends[j];
        } else {
            memset(&out[i * w], 0, (size_t)w * sizeof(uint64_t));
            ends[i] = 0;
        }
    }
    return 0;
}

static PyObject *run(Py_ssize_t hid, Py_ssize_t length, const int64_t *ends) {
    if (ends == NULL)
        return Py_BuildValue("(nn)", hid, length);
    return Py_BuildValue("(nnL)", hid, length, (long long)ends[length - 1]);
}

/* (holder id, run length) for every holder covering position 1: the longest stretch of
 * positions 1, 2, ... each holder covers; with ends, (holder id, run length, token end of
 * the run's last position). */
static PyObject *runs_of(const uint64_t *masks, Py_ssize_t n, Py_ssize_t w, const int64_t *ends) {
    PyObject *out = PyList_New(0);
    if (out == NULL || n == 0)
        return out;
    uint64_t acc[64], *alive = w <= 64 ? acc : PyMem_Malloc((size_t)w * sizeof(uint64_t));
    if (alive == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    memcpy(alive, masks, (size_t)w * sizeof(uint64_t));
    Py_ssize_t i = 1;
    for (;; i++) {
        int any = 0;
        for (Py_ssize_t k = 0; k < w; k++)
            any |= alive[k] != 0;
        if (!any || i == n)
            break;
        for (Py_ssize_t k = 0; k < w; k++) {
            uint64_t still = alive[k] & masks[i * w + k], gone = alive[k] & ~still;
            for (; gone; gone &= gone - 1) {
                PyObject *pair = run(k * 64 + CTZ64(gone), i, ends);
                if (pair == NULL || PyList_Append(out, pair) < 0)
                    goto fail;
                Py_DECREF(pair);
            }
            alive[k] = still;
        }
    }
    for (Py_ssize_t k = 0; k < w; k++)
        for (uint64_t left = alive[k]; left; left &= left - 1) {
            PyObject *pair = run(k * 64 + CTZ64(left), i, ends);
            if (pair == NULL || PyList_Append(out, pair) < 0)
                goto fail;
            Py_DECREF(pair);
        }
    if (alive != acc)
        PyMem_Free(alive);
    return out;
fail:
    if (alive != acc)
        PyMem_Free(alive);
    Py_DECREF(out);
    return NULL;
}

/* runs(hashes) or, with ratio > 0, the hash-granularity runs: position i is covered by its
 * own hash or by the last hash of the block it is in (ratio hashes a block). */
static PyObject *walk(MaskTable *t, PyObject *hashes, Py_ssize_t ratio) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), w = t->width;
    uint64_t *masks = PyMem_Malloc((size_t)(n * w + 1) * sizeof(uint64_t));
    uint64_t *h = PyMem_Malloc((size_t)(n + 1) * sizeof(uint64_t));
    int64_t *ends = PyMem_Malloc((size_t)(n + 1) * sizeof(int64_t));
    Py_ssize_t *at = PyMem_Malloc((size_t)(n + 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (masks == NULL || h == NULL || ends == NULL || at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (prompt_masks(t, seq, masks, ends, h, at) < 0)
        goto done;
    if (ratio > 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t end = (i / ratio + 1) * ratio;
            if (end <= n && end - 1 != i)
                for (Py_ssize_t k = 0; k < w; k++)
                    masks[i * w + k] |= masks[(end - 1) * w + k];
        }
    }
    out = runs_of(masks, n, w, ratio > 0 ? NULL : ends);
done:
    PyMem_Free(masks);
    PyMem_Free(h);
    PyMem_Free(ends);
    PyMem_Free(at);
    Py_DECREF(seq);
    return out;
}

static PyObject *MaskTable_runs(MaskTable *t, PyObject *hashes) { return walk(t, hashes, 0); }

static PyObject *MaskTable_runs_covered(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "runs_covered(hashes, ratio)");
        return NULL;
    }
    Py_ssize_t ratio = PyLong_AsSsize_t(args[1]);
    if (ratio == -1 && PyErr_Occurred())
        return NULL;
    if (ratio <= 0) {
        PyErr_SetString(PyExc_ValueError, "ratio must be positive");
        return NULL;
    }
    return walk(t, args[0], ratio);
}

static PyMethodDef MaskTable_methods[] = {
    {"set_bit", (PyCFunction)(void (*)(void))MaskTable_set_bit, METH_FASTCALL,
     "set_bit(key, bit) -> bool: the holder with id bit holds key; whether key is new."},
    {"clear_bit", (PyCFunction)(void (*)(void))MaskTable_clear_bit, METH_FASTCALL,
     "clear_bit(key, bit) -> bool: it no longer does; whether anyone still holds key."},
    {"has_bit", (PyCFunction)(void (*)(void))MaskTable_has_bit, METH_FASTCALL,
     "has_bit(key, bit) -> bool."},
    {"get", (PyCFunction)(void (*)(void))MaskTable_get, METH_FASTCALL,
     "get(key, default=None): key's mask as an int."},
    {"mask", (PyCFunction)MaskTable_mask, METH_O, "mask(key): key's mask as an int (0: none)."},
    {"items", (PyCFunction)MaskTable_items, METH_NOARGS, "A list of (key, mask)."},
    {"keys", (PyCFunction)MaskTable_keys, METH_NOARGS, "A list of the keys."},
    {"held_by", (PyCFunction)MaskTable_held_by, METH_O, "held_by(bit): the keys that holder holds."},
    {"set_end", (PyCFunction)(void (*)(void))MaskTable_set_end, METH_FASTCALL,
     "set_end(key, end) -> bool: key's token end, if key is held (whether it is)."},
    {"runs", (PyCFunction)MaskTable_runs, METH_O,
     "runs(hashes) -> [(holder id, run length, token end)] for every holder of hashes[0]."},
    {"runs_covered", (PyCFunction)(void (*)(void))MaskTable_runs_covered, METH_FASTCALL,
     "runs_covered(hashes, ratio): runs where a position is also covered by the last hash "
     "of its block (ratio hashes a block)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods MaskTable_as_sequence = {
    .sq_contains = (objobjproc)MaskTable_contains,
};

static PyMappingMethods MaskTable_as_mapping = {
    .mp_length = (lenfunc)MaskTable_len,
};

static PyTypeObject MaskTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvledger.consumer.router._masks.MaskTable",
    .tp_basicsize = sizeof(MaskTable),
    .tp_dealloc = (destructor)MaskTable_dealloc,
    .tp_as_sequence = &MaskTable_as_sequence,
    .tp_as_mapping = &MaskTable_as_mapping,
    .tp_iter = (getiterfunc)MaskTable_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block hash -> holder-id bitmask, probed a whole prompt at a time.",
    .tp_methods = MaskTable_methods,
    .tp_new = MaskTable_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_masks", "The router's holder masks, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__masks(void) {
    if (PyType_Ready(&MaskTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MaskTableType);
    if (PyModule_AddObject(m, "MaskTable", (PyObject *)&MaskTableType) < 0) {
        Py_DECREF(&MaskTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
