/* The Avro writer shared by the compiled encoders (schemas/_avro.c, producer/_vllm.c): a
 * growing buffer, raw bytes, zigzag varints. Each function returns 0, or -1 with a Python
 * error set. */
#ifndef KVLEDGER_AVRO_WRITER_H
#define KVLEDGER_AVRO_WRITER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Writer;

/* An empty writer with room for cap bytes: 0, or -1 with MemoryError set. */
static inline int writer_start(Writer *w, Py_ssize_t cap) {
    w->buf = PyMem_Malloc((size_t)cap);
    w->len = 0;
    w->cap = cap;
    if (w->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static inline int grow(Writer *w, Py_ssize_t more) {
    if (w->len + more <= w->cap)
        return 0;
    Py_ssize_t cap = w->cap * 2;
    while (cap < w->len + more)
        cap *= 2;
    char *buf = PyMem_Realloc(w->buf, (size_t)cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->buf = buf;
    w->cap = cap;
    return 0;
}

static inline int write_raw(Writer *w, const void *data, Py_ssize_t n) {
    if (grow(w, n) < 0)
        return -1;
    memcpy(w->buf + w->len, data, (size_t)n);
    w->len += n;
    return 0;
}

/* A zigzag varint at p (room for 10 bytes); returns p past it. */
static inline unsigned char *put_long(unsigned char *p, int64_t v) {
    uint64_t u = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    while (u >= 0x80) {
        *p++ = (unsigned char)(u | 0x80);
        u >>= 7;
    }
    *p++ = (unsigned char)u;
    return p;
}

static inline int write_long(Writer *w, int64_t v) {
    if (grow(w, 10) < 0)
        return -1;
    w->len = (char *)put_long((unsigned char *)w->buf + w->len, v) - w->buf;
    return 0;
}

/* An Avro array of n nulls (or of a union's null branch): the count, n zero bytes, the end. */
static inline int write_nulls(Writer *w, Py_ssize_t n) {
    if ((n > 0 && write_long(w, n) < 0) || grow(w, n + 1) < 0)
        return -1;
    memset(w->buf + w->len, 0, (size_t)n + 1); /* each item's null, then the array's end */
    w->len += n + 1;
    return 0;
}

#endif
