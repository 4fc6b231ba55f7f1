/* keys.c -- the key codec: the bytes of a message's keys, made and read in one place.
 *
 * shmchan/codec.py decides what a key is (str, bytes or int, and which values of other
 * types count as one), which errors a caller gets, and how many keys a channel takes;
 * the bytes are made here, for the send fast path (sender.c), for the Handle's `keys`
 * (handle.c) and for codec.py alike (frame_keys, decode_keys).
 *
 * A key is a one-byte tag and its body, so "1", b"1" and 1 are three different keys:
 *
 *     str   's' + UTF-8 (lone surrogates passed through, so every str round-trips)
 *     bytes 'b' + the bytes
 *     int   'i' + minimal two's-complement big-endian bytes
 *
 * A message's keys travel as one blob: for each distinct key, in first-seen order, a
 * little-endian u16 length and the encoding (at most MAX_KEY_ENC bytes). The C core
 * hashes each encoding (csrc/hash.c); duplicates are merged here, by their encoding.
 */
#include "hot.h"

#define MAX_KEY_ENC 0xFFFEu /* longest encoding of one key (tag + body) */

/* Tag and body of key k, an exact str, bytes or int. Returns 1 (body valid while k and
 * *tmp live; *tmp: a new reference or NULL), 0 if k is not of those types, -1 with an
 * exception. Lone surrogates and ints beyond 64 bits take a Python call each. */
static int key_body(PyObject *k, uint8_t *tag, const uint8_t **body, Py_ssize_t *blen,
                    uint8_t num[8], PyObject **tmp) {
    *tmp = NULL;
    if (PyUnicode_CheckExact(k)) {
        *tag = 's';
        *body = (const uint8_t *)PyUnicode_AsUTF8AndSize(k, blen);
        if (*body != NULL) return 1;
        PyErr_Clear(); /* lone surrogates: passed through */
        *tmp = PyUnicode_AsEncodedString(k, "utf-8", "surrogatepass");
        if (*tmp == NULL) return -1;
    } else if (PyBytes_CheckExact(k)) {
        *tag = 'b';
        *body = (const uint8_t *)PyBytes_AS_STRING(k);
        *blen = PyBytes_GET_SIZE(k);
        return 1;
    } else if (PyLong_CheckExact(k)) { /* exact: bool is not a key type */
        *tag = 'i';
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(k, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (!overflow) {
            /* bit length of v (or of -v-1), plus the sign bit */
            unsigned long long mag = v < 0 ? ~(unsigned long long)v : (unsigned long long)v;
            int bits = mag ? 64 - __builtin_clzll(mag) : 0;
            int nb = bits / 8 + 1;
            for (int i = 0; i < nb; i++)
                num[nb - 1 - i] = (uint8_t)((unsigned long long)v >> (8 * i));
            *body = num;
            *blen = nb;
            return 1;
        }
        /* k.to_bytes((~k if k < 0 else k).bit_length() // 8 + 1, "big", signed=True) */
        PyObject *mag = overflow < 0 ? PyNumber_Invert(k) : Py_NewRef(k);
        PyObject *bits = mag ? PyObject_CallMethod(mag, "bit_length", NULL) : NULL;
        Py_XDECREF(mag);
        Py_ssize_t nb = bits ? PyLong_AsSsize_t(bits) / 8 + 1 : -1;
        Py_XDECREF(bits);
        if (nb < 0 || PyErr_Occurred()) return -1;
        PyObject *meth = PyObject_GetAttrString(k, "to_bytes");
        PyObject *args = Py_BuildValue("(ns)", nb, "big");
        PyObject *kw = Py_BuildValue("{sO}", "signed", Py_True);
        if (meth && args && kw) *tmp = PyObject_Call(meth, args, kw);
        Py_XDECREF(meth);
        Py_XDECREF(args);
        Py_XDECREF(kw);
        if (*tmp == NULL) return -1;
    } else {
        return 0;
    }
    *body = (const uint8_t *)PyBytes_AS_STRING(*tmp);
    *blen = PyBytes_GET_SIZE(*tmp);
    return 1;
}

void hot_keys_init(keyblob *kb) {
    kb->buf = kb->local;
    kb->cap = KEY_BUF;
    kb->len = kb->n = 0;
}

int hot_key_append(keyblob *kb, PyObject *k) {
    uint8_t num[8], tag;
    const uint8_t *body;
    Py_ssize_t blen;
    PyObject *tmp;
    int r = key_body(k, &tag, &body, &blen, num, &tmp);
    if (r <= 0) return r < 0 ? -1 : KEY_NOT_A_KEY;
    size_t enc = 1 + (size_t)blen;
    kb->last = enc;
    if (enc > MAX_KEY_ENC) r = KEY_TOO_LONG;
    else if (kb->len + 2 + enc > kb->cap) r = KEY_NO_ROOM;
    if (r != 1) {
        Py_XDECREF(tmp);
        return r;
    }
    uint8_t *f = kb->buf + kb->len;
    f[0] = (uint8_t)(enc & 0xFF);
    f[1] = (uint8_t)(enc >> 8);
    f[2] = tag;
    memcpy(f + 3, body, (size_t)blen);
    Py_XDECREF(tmp);
    for (uint32_t j = 0; j < kb->n; j++) {
        const uint8_t *g = kb->buf + kb->start[j];
        size_t glen = (size_t)g[0] | ((size_t)g[1] << 8);
        if (glen == enc && memcmp(g + 2, f + 2, enc) == 0) return 1; /* a duplicate */
    }
    if (kb->n == SHM_MAX_KEYS_LIMIT) return KEY_TOO_MANY;
    kb->start[kb->n++] = kb->len;
    kb->len += (uint32_t)(2 + enc);
    return 1;
}

/* *v = k, an exact int, read from the object without a call if it is a one-digit int
 * (|k| < 2**30: every key a counter or an id below a billion), the common key. 0 if k is
 * larger: PyLong_AsLongLongAndOverflow sees to it. */
static inline int small_int(PyObject *k, long long *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)k)) return 0;
    *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)k);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(k); /* the digit count, negative for k < 0 */
    if (size < -1 || size > 1) return 0;
    *v = (long long)size * (long long)((PyLongObject *)k)->ob_digit[0];
    return 1;
#endif
}

/* The framed encoding of the int v (u16 length, 'i', minimal big-endian body) at f, which
 * has room for 11 bytes (those past the encoding are scratch): tag and body as two stores.
 * Returns the bytes of the encoding. */
static inline size_t int_key_write(uint8_t *f, long long v) {
    unsigned long long mag = v < 0 ? ~(unsigned long long)v : (unsigned long long)v;
    int bits = 64 - __builtin_clzll(mag | 1); /* 1 for 0: the same blen as 0 bits */
    size_t blen = (size_t)(bits / 8 + 1);
    uint64_t be = (unsigned long long)v << (8 * (8 - blen)); /* the body: v's low blen bytes */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    be = __builtin_bswap64(be);
#endif
    /* length and tag, and a scratch byte the body's store overwrites */
    uint8_t head[4] = {(uint8_t)(blen + 1), 0, 'i', 0};
    memcpy(f, head, 4);
    memcpy(f + 3, &be, sizeof be);
    return blen + 3;
}

/* The framed encoding of one key (u16 length, tag, body) written at f, which has room
 * bytes, for the common cases made without the general path's calls: an exact int within
 * 64 bits, an exact bytes, an exact ASCII str (its UTF-8 is its data). Returns the bytes
 * written, or 0 if hot_key_append must see to it (the same bytes, by the same rules as
 * key_body), f untouched but for scratch. */
size_t hot_key_write(uint8_t *f, size_t room, PyObject *k) {
    uint8_t num[8], tag;
    const uint8_t *body;
    size_t blen;
    if (PyLong_CheckExact(k)) {
        long long v;
        if (!small_int(k, &v)) {
            int overflow;
            v = PyLong_AsLongLongAndOverflow(k, &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return 0;
            }
        }
        if (room >= 11) return int_key_write(f, v);
        unsigned long long mag = v < 0 ? ~(unsigned long long)v : (unsigned long long)v;
        int bits = mag ? 64 - __builtin_clzll(mag) : 0;
        blen = (size_t)(bits / 8 + 1);
        for (size_t i = 0; i < blen; i++) num[blen - 1 - i] = (uint8_t)((unsigned long long)v >> (8 * i));
        tag = 'i';
        body = num;
    } else if (PyUnicode_CheckExact(k) && PyUnicode_IS_COMPACT_ASCII(k)) {
        tag = 's';
        body = (const uint8_t *)PyUnicode_DATA(k);
        blen = (size_t)PyUnicode_GET_LENGTH(k);
    } else if (PyBytes_CheckExact(k)) {
        tag = 'b';
        body = (const uint8_t *)PyBytes_AS_STRING(k);
        blen = (size_t)PyBytes_GET_SIZE(k);
    } else {
        return 0;
    }
    if (blen + 1 > MAX_KEY_ENC || blen + 3 > room) return 0;
    f[0] = (uint8_t)((blen + 1) & 0xFF);
    f[1] = (uint8_t)((blen + 1) >> 8);
    f[2] = tag;
    if (blen <= 16) {
        for (size_t i = 0; i < blen; i++) f[3 + i] = body[i];
    } else {
        memcpy(f + 3, body, blen);
    }
    return blen + 3;
}

/* The blobs of keys[0..n), one key each, written back to back at out (room bytes), with
 * each blob's length in klens and 1 in nkeys: a batch's keys without a call a key. Stops at
 * the first key that is not an exact int of up to 30 bits (small_int) or for which room
 * runs short (the caller sees to it with hot_key_write or the general path). Returns how
 * many were written; *used: their bytes. */
Py_ssize_t hot_keys_write_ints(uint8_t *out, size_t room, PyObject *const *keys, Py_ssize_t n,
                               uint32_t *klens, uint32_t *nkeys, size_t *used) {
    size_t len = 0;
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *k = keys[i];
        long long v;
        if (!PyLong_CheckExact(k) || room - len < 11 || !small_int(k, &v)) break;
        size_t w = int_key_write(out + len, v);
        len += w;
        klens[i] = (uint32_t)w;
        nkeys[i] = 1;
    }
    *used = len;
    return i;
}

/* The blob of one key on its own (hot_key_write into kb, freshly initialized). Returns 1
 * if made, 0 if hot_key_append must see to it. */
int hot_key_single(keyblob *kb, PyObject *k) {
    size_t n = hot_key_write(kb->buf, kb->cap, k);
    if (n == 0) return 0;
    kb->start[0] = 0;
    kb->n = 1;
    kb->len = (uint32_t)n;
    kb->last = n - 2;
    return 1;
}

/* One key from its encoding (tag + body); a new reference, or NULL without an
 * exception if the encoding is malformed. */
static PyObject *key_decode(const uint8_t *enc, size_t size) {
    const uint8_t *body = enc + 1;
    size_t blen = size - 1;
    PyObject *k = NULL;
    if (enc[0] == 's') {
        k = PyUnicode_DecodeUTF8((const char *)body, (Py_ssize_t)blen, "surrogatepass");
    } else if (enc[0] == 'b') {
        k = PyBytes_FromStringAndSize((const char *)body, (Py_ssize_t)blen);
    } else if (enc[0] == 'i' && blen >= 1 && blen <= 8) {
        uint64_t v = body[0] & 0x80 ? UINT64_MAX : 0; /* sign-extend, big-endian */
        for (size_t i = 0; i < blen; i++) v = (v << 8) | body[i];
        k = PyLong_FromLongLong((long long)v);
    } else if (enc[0] == 'i' && blen > 8) { /* int.from_bytes(body, "big", signed=True) */
        PyObject *meth = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes");
        PyObject *args = Py_BuildValue("(y#s)", (const char *)body, (Py_ssize_t)blen, "big");
        PyObject *kw = Py_BuildValue("{sO}", "signed", Py_True);
        if (meth && args && kw) k = PyObject_Call(meth, args, kw);
        Py_XDECREF(meth);
        Py_XDECREF(args);
        Py_XDECREF(kw);
    }
    if (k == NULL) PyErr_Clear();
    return k;
}

/* frame_keys(keys) -> bytes: the blob of a list of exact str, bytes and int keys,
 * duplicates merged (codec.encode_keys checked the types and the count). InvalidArgument
 * for a key whose encoding is too long. */
PyObject *hot_frame_keys(PyObject *mod, PyObject *keys) {
    if (!PyList_CheckExact(keys)) return PyErr_Format(PyExc_TypeError, "frame_keys takes a list");
    keyblob *kb = PyMem_Malloc(sizeof *kb);
    if (kb == NULL) return PyErr_NoMemory();
    hot_keys_init(kb);
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        int r;
        while ((r = hot_key_append(kb, k)) == KEY_NO_ROOM) { /* grow, and try again */
            uint32_t cap = kb->cap * 2 + MAX_KEY_ENC + 2;
            uint8_t *buf = PyMem_Malloc(cap);
            if (buf == NULL) {
                PyErr_NoMemory();
                goto out;
            }
            memcpy(buf, kb->buf, kb->len);
            if (kb->buf != kb->local) PyMem_Free(kb->buf);
            kb->buf = buf;
            kb->cap = cap;
        }
        if (r == 1) continue;
        if (r == KEY_TOO_LONG)
            PyErr_Format(EXC_INVALID, "key too long: %zu bytes encoded (limit %u)",
                         kb->last - 1, MAX_KEY_ENC - 1);
        else if (r == KEY_NOT_A_KEY)
            PyErr_Format(EXC_TYPE, "keys must be str, bytes or int, not %s", Py_TYPE(k)->tp_name);
        else if (r == KEY_TOO_MANY)
            PyErr_Format(EXC_INVALID, "more than %d distinct keys", SHM_MAX_KEYS_LIMIT);
        goto out; /* r < 0: its exception */
    }
    out = PyBytes_FromStringAndSize((const char *)kb->buf, kb->len);
out:
    if (kb->buf != kb->local) PyMem_Free(kb->buf);
    PyMem_Free(kb);
    return out;
}

PyObject *hot_keys_from_blob(const uint8_t *buf, size_t len, size_t n) {
    if (n > SHM_MAX_KEYS_LIMIT) return NULL;
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (t == NULL) return NULL;
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        if (len - off < 2) goto bad;
        size_t size = (size_t)buf[off] | ((size_t)buf[off + 1] << 8);
        if (size == 0 || size > len - off - 2) goto bad;
        PyObject *k = key_decode(buf + off + 2, size);
        if (k == NULL) goto bad;
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, k);
        off += 2 + size;
    }
    if (off == len) return t;
bad:
    Py_DECREF(t);
    return NULL;
}

/* decode_keys(blob, n) -> tuple | None: the keys of a blob; None if it is malformed
 * (codec.decode_keys raises ChannelCorrupted then). */
PyObject *hot_decode_keys(PyObject *mod, PyObject *args) {
    Py_buffer view;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*n", &view, &n)) return NULL;
    PyObject *t = n < 0 ? NULL : hot_keys_from_blob(view.buf, (size_t)view.len, (size_t)n);
    PyBuffer_Release(&view);
    if (t != NULL || PyErr_Occurred()) return t;
    Py_RETURN_NONE;
}
