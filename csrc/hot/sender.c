/* sender.c -- SenderBase: send, send_many and send_batch, the per-message half of
 * shmchan.Sender.
 *
 * A send of bytes with plain keys encodes the keys here (keys.c, on the stack) and
 * makes one core call (shm_send); a batch is packed into arrays and sent with one core
 * call (shm_send_many). Whatever
 * the core does not accept at once -- a full channel, a stall, an error -- and every
 * payload or key this file does not encode goes to the Python side (`_send_slow`,
 * codec.encode_payload, codec.encode_keys): nothing is sent twice, since a core call
 * that did not return SHM_OK sent nothing (a batch says how many it sent).
 */
#include "hot.h"

/* The blob for `keys` (None, one str/bytes/int, or a tuple or list of them), on the
 * stack (keys.c). Returns 1 if encoded, 0 if codec.py must see to it (other types, a
 * long blob, too many keys, errors: it raises them). */
static int keys_encode(keyblob *kb, PyObject *keys, uint32_t max_keys) {
    hot_keys_init(kb);
    if (keys == Py_None) return 1;
    if (PyTuple_CheckExact(keys) || PyList_CheckExact(keys)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
        PyObject **items = PySequence_Fast_ITEMS(keys);
        if (n == 1 && hot_key_single(kb, items[0])) return 1 <= max_keys; /* ("acct:1",) */
        for (Py_ssize_t i = 0; i < n; i++)
            if (hot_key_append(kb, items[i]) != 1) goto python;
    } else if (hot_key_single(kb, keys)) {
        return 1 <= max_keys;
    } else if (hot_key_append(kb, keys) != 1) {
        goto python;
    }
    return kb->n <= max_keys;
python:
    PyErr_Clear(); /* codec.py meets it again and raises it */
    return 0;
}


/* A seq as an int. PyLong_FromLongLong makes one of up to 30 bits (every seq of the
 * first billion messages) directly, where PyLong_FromUnsignedLongLong goes the general
 * way; seqs beyond 2**63 (never, in practice) take it. */
static inline PyObject *seq_object(uint64_t seq) {
    return seq <= (uint64_t)LLONG_MAX ? PyLong_FromLongLong((long long)seq)
                                      : PyLong_FromUnsignedLongLong(seq);
}

static PyObject *Sender_send(SenderObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    static const char *const names[] = {"obj", "keys", "timeout", "delay", "ttl"};
    PyObject *a[5] = {NULL, NULL, Py_None, NULL, NULL};
    if (kwnames == NULL && nargs >= 1 && nargs <= 3) { /* positional: the common call */
        for (Py_ssize_t i = 0; i < nargs; i++) a[i] = args[i];
    } else {
        if (nargs > 3) /* delay and ttl are keyword-only */
            return PyErr_Format(PyExc_TypeError, "send() takes at most 3 positional arguments");
        if (hot_parse_args("send", args, nargs, kwnames, names, 1, 5, a) < 0) return NULL;
        if (a[3] != NULL || a[4] != NULL) /* a delay or a ttl: the Python side (timers.py) */
            return PyObject_CallMethod((PyObject *)self, "_send_timed", "OOOOO", a[0],
                                       a[1] ? a[1] : Py_None, a[2], a[3] ? a[3] : Py_None,
                                       a[4] ? a[4] : Py_None);
    }
    PyObject *keys = a[1] ? a[1] : Py_None; /* the default () and None both mean no keys */
    SegmentObject *seg = self->seg;
    const char *data = NULL;
    Py_ssize_t len = 0;
    if (PyBytes_CheckExact(a[0])) {
        data = PyBytes_AS_STRING(a[0]);
        len = PyBytes_GET_SIZE(a[0]);
    } else if (PyByteArray_CheckExact(a[0])) { /* we hold the GIL: it cannot resize */
        data = PyByteArray_AS_STRING(a[0]);
        len = PyByteArray_GET_SIZE(a[0]);
    }
    keyblob kb;
    if (data && seg && seg->registered && timeout_plain(a[2]) &&
        keys_encode(&kb, keys, seg->max_keys)) {
        uint64_t seq = 0;
        shm_stall stall;
        int wake = 0;
        int rc = hot_core.send(seg->c, SHM_PAYLOAD_RAW, data, (uint64_t)len, (const char *)kb.buf,
                               kb.len, kb.n, &seq, &stall, &wake);
        if (rc == SHM_OK) {
            if (wake) wake_post(&seg->wk, WAKE_RX, 1); /* the receiver sleeps */
            return seq_object(seq);
        }
        /* full, stalled or an error: nothing was sent; the slow path waits or raises */
    }
    PyObject *keys_arg = a[1] ? Py_NewRef(a[1]) : PyTuple_New(0);
    if (keys_arg == NULL) return NULL;
    PyObject *res =
        PyObject_CallMethodObjArgs((PyObject *)self, hot_s_send_slow, a[0], keys_arg, a[2], NULL);
    Py_DECREF(keys_arg);
    return res;
}

/* Blob bytes reserved a message before packing a batch: a small int key, with the scratch
 * hot_key_write may use, or a short str or bytes key, goes in without a growth check. */
#define KEY_ROOM 16u

/* A growable byte buffer for packing: heap memory (own), or none yet, or the caller's
 * stack buffer, left for the heap once it is outgrown. */
typedef struct {
    char *p;
    size_t len, cap;
    int own; /* p is ours to PyMem_Free */
} gbuf;

static inline void gbuf_local(gbuf *b, void *buf, size_t cap) {
    b->p = buf;
    b->len = 0;
    b->cap = cap;
    b->own = 0;
}

static int gbuf_grow_put(gbuf *b, const void *src, size_t n) {
    if (n > PY_SSIZE_T_MAX - b->len) {
        PyErr_SetString(EXC_INVALID, "send_many: the batch is too large for this process");
        return -1;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap = cap > PY_SSIZE_T_MAX / 2 ? b->len + n : cap * 2;
        char *p = b->own ? PyMem_Realloc(b->p, cap) : PyMem_Malloc(cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (!b->own && b->len) memcpy(p, b->p, b->len); /* out of the stack buffer */
        b->p = p;
        b->own = 1;
        b->cap = cap;
    }
    if (n && src) memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

/* Append n bytes: inline while there is room (the per-message fields of a batch are a
 * few bytes each, copied with constant sizes), growing otherwise. */
static inline int gbuf_put(gbuf *b, const void *src, size_t n) {
    if (__builtin_expect(b->p != NULL && b->cap - b->len >= n, 1)) {
        memcpy(b->p + b->len, src, n);
        b->len += n;
        return 0;
    }
    return gbuf_grow_put(b, src, n);
}

/* Room for n more bytes, so that the puts that follow take the inline path. */
static int gbuf_reserve(gbuf *b, size_t n) {
    if (b->cap - b->len >= n) return 0;
    size_t len = b->len;
    if (gbuf_grow_put(b, NULL, n) < 0) return -1;
    b->len = len;
    return 0;
}

static PyObject *gbuf_bytes(gbuf *b) { return PyBytes_FromStringAndSize(b->p ? b->p : "", b->len); }

/* Append one payload (raw or through codec.encode_payload) to the batch. */
static int pack_payload(SegmentObject *seg, PyObject *obj, gbuf *kinds, gbuf *data, gbuf *lens) {
    uint32_t kind = SHM_PAYLOAD_RAW;
    if (PyBytes_CheckExact(obj)) { /* the common payload: its bytes, without a buffer view */
        uint64_t n = (uint64_t)PyBytes_GET_SIZE(obj);
        int rc = gbuf_put(data, PyBytes_AS_STRING(obj), (size_t)n);
        if (rc == 0) rc = gbuf_put(kinds, &kind, sizeof kind);
        if (rc == 0) rc = gbuf_put(lens, &n, sizeof n);
        return rc;
    }
    PyObject *enc = NULL, *buf = obj;
    /* memoryviews too go through encode_payload, which refuses non-contiguous ones */
    if (!(PyBytes_Check(obj) || PyByteArray_Check(obj))) {
        enc = PyObject_CallFunction(hot_encode_payload_fn, "OO", obj,
                                    seg->raw_only ? Py_True : Py_False);
        if (enc == NULL) return -1;
        if (!PyTuple_Check(enc) || PyTuple_GET_SIZE(enc) != 2) {
            Py_DECREF(enc);
            PyErr_SetString(PyExc_SystemError, "encode_payload returned a bad value");
            return -1;
        }
        kind = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(enc, 0));
        buf = PyTuple_GET_ITEM(enc, 1);
        if (PyErr_Occurred()) {
            Py_DECREF(enc);
            return -1;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) {
        Py_XDECREF(enc);
        return -1;
    }
    uint64_t n = (uint64_t)view.len;
    int rc = gbuf_put(data, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    Py_XDECREF(enc);
    if (rc == 0) rc = gbuf_put(kinds, &kind, sizeof kind);
    if (rc == 0) rc = gbuf_put(lens, &n, sizeof n);
    return rc;
}

/* Append one message's key blob (fast encoding, or codec.encode_keys). */
static int pack_keys(SegmentObject *seg, PyObject *keys, keyblob *kb, gbuf *blob, gbuf *klens,
                     gbuf *nkeys) {
    uint32_t len, n;
    if (keys_encode(kb, keys, seg->max_keys)) {
        len = kb->len;
        n = kb->n;
        if (gbuf_put(blob, kb->buf, len) < 0) return -1;
    } else {
        PyObject *enc = PyObject_CallFunction(hot_encode_keys_fn, "OI", keys, seg->max_keys);
        if (enc == NULL) return -1;
        if (!PyTuple_Check(enc) || PyTuple_GET_SIZE(enc) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(enc, 0))) {
            Py_DECREF(enc);
            PyErr_SetString(PyExc_SystemError, "encode_keys returned a bad value");
            return -1;
        }
        PyObject *b = PyTuple_GET_ITEM(enc, 0);
        len = (uint32_t)PyBytes_GET_SIZE(b);
        n = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(enc, 1));
        int rc = PyErr_Occurred() ? -1 : gbuf_put(blob, PyBytes_AS_STRING(b), len);
        Py_DECREF(enc);
        if (rc < 0) return -1;
    }
    if (gbuf_put(klens, &len, sizeof len) < 0) return -1;
    return gbuf_put(nkeys, &n, sizeof n);
}

/* pack_keys for the common case, inline: one key of a common type (hot_key_write)
 * written straight into the blob, its length and count into reserved room. 1 if done,
 * 0 if pack_keys must see to it (nothing appended). */
static inline int pack_key_fast(SegmentObject *seg, PyObject *keys, gbuf *blob, gbuf *klens,
                                gbuf *nkeys) {
    if (seg->max_keys < 1 || blob->p == NULL || klens->cap - klens->len < 4 ||
        nkeys->cap - nkeys->len < 4)
        return 0;
    size_t w = hot_key_write((uint8_t *)blob->p + blob->len, blob->cap - blob->len, keys);
    if (w == 0) return 0;
    uint32_t len = (uint32_t)w, one = 1;
    blob->len += w;
    memcpy(klens->p + klens->len, &len, 4);
    klens->len += 4;
    memcpy(nkeys->p + nkeys->len, &one, 4);
    nkeys->len += 4;
    return 1;
}

/* A send_many batch packed as shm_send_many takes it: per message a kind (uint32), a
 * payload length (uint64), a key blob length and a key count (uint32 each), and the
 * payloads and key blobs back to back. */
typedef struct {
    Py_ssize_t n;
    gbuf kinds, data, lens, blob, klens, nkeys;
} packed;

static void packed_free(packed *p) {
    gbuf *all[] = {&p->kinds, &p->data, &p->lens, &p->blob, &p->klens, &p->nkeys};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->own) PyMem_Free(all[i]->p);
}

/* Stack room for the per-message arrays of a batch of up to LOCAL_N messages: send_batch
 * packs the usual batch without an allocation. */
#define LOCAL_N 256
typedef struct {
    uint64_t lens[LOCAL_N];
    uint32_t kinds[LOCAL_N], klens[LOCAL_N], nkeys[LOCAL_N];
    uint64_t blob[KEY_ROOM * LOCAL_N / 8];
} packed_local;

/* The per-message arrays of p in loc while they fit (p's payloads stay on the heap). */
static void packed_use_local(packed *p, packed_local *loc) {
    gbuf_local(&p->lens, loc->lens, sizeof loc->lens);
    gbuf_local(&p->kinds, loc->kinds, sizeof loc->kinds);
    gbuf_local(&p->klens, loc->klens, sizeof loc->klens);
    gbuf_local(&p->nkeys, loc->nkeys, sizeof loc->nkeys);
    gbuf_local(&p->blob, loc->blob, sizeof loc->blob);
}

/* Pack `items`, the arrays in loc while they fit (loc NULL: on the heap); 0 on success,
 * -1 with an exception (the buffers are freed either way by packed_free). Works on a
 * tuple copy: encoding may run Python code (pickling), which must not be able to change
 * the sequence under us. */
static int pack_items(SegmentObject *seg, PyObject *items, packed *p, packed_local *loc) {
    memset(p, 0, sizeof *p);
    if (loc) packed_use_local(p, loc);
    /* seg is the caller's (referenced) segment; only its fixed fields are read here */
    PyObject *tup = PySequence_Tuple(items);
    if (tup == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(EXC_TYPE, "send_many() takes an iterable of (payload, keys) pairs, not %s",
                         Py_TYPE(items)->tp_name);
        }
        return -1;
    }
    keyblob kb;
    int rc = 0;
    p->n = PyTuple_GET_SIZE(tup);
    size_t un = (size_t)p->n;
    if (gbuf_reserve(&p->kinds, 4 * un) < 0 || gbuf_reserve(&p->lens, 8 * un) < 0 ||
        gbuf_reserve(&p->klens, 4 * un) < 0 || gbuf_reserve(&p->nkeys, 4 * un) < 0 ||
        gbuf_reserve(&p->blob, KEY_ROOM * un) < 0)
        rc = -1;
    for (Py_ssize_t i = 0; i < p->n && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(tup, i);
        /* a tuple of its own too (a copy if it is a list), for the same reason */
        PyObject *pair = PyTuple_CheckExact(item) ? Py_NewRef(item) : PySequence_Tuple(item);
        if (pair == NULL || PyTuple_GET_SIZE(pair) != 2) {
            Py_XDECREF(pair);
            PyErr_Clear();
            PyErr_Format(EXC_TYPE,
                         "send_many items must be (payload, keys) pairs; item %zd is not "
                         "(nothing was sent)",
                         i);
            rc = -1;
            break;
        }
        rc = pack_payload(seg, PyTuple_GET_ITEM(pair, 0), &p->kinds, &p->data, &p->lens);
        if (rc == 0 && !pack_key_fast(seg, PyTuple_GET_ITEM(pair, 1), &p->blob, &p->klens,
                                      &p->nkeys))
            rc = pack_keys(seg, PyTuple_GET_ITEM(pair, 1), &kb, &p->blob, &p->klens, &p->nkeys);
        Py_DECREF(pair);
    }
    Py_DECREF(tup);
    return rc;
}

/* (n, kinds, data, lens, keys, key_lens, nkeys) as bytes, for the Python side. */
static PyObject *packed_tuple(packed *p) {
    return Py_BuildValue("nNNNNNN", p->n, gbuf_bytes(&p->kinds), gbuf_bytes(&p->data),
                         gbuf_bytes(&p->lens), gbuf_bytes(&p->blob), gbuf_bytes(&p->klens),
                         gbuf_bytes(&p->nkeys));
}

/* _pack(items) -> (n, kinds, data, lens, keys, key_lens, nkeys) */
static PyObject *Sender_pack(SenderObject *self, PyObject *items) {
    SegmentObject *seg = self->seg;
    if (seg == NULL) return PyErr_Format(PyExc_RuntimeError, "sender is not bound");
    Py_INCREF(seg); /* packing may run Python code, which may close the sender */
    packed p;
    PyObject *res = pack_items(seg, items, &p, NULL) == 0 ? packed_tuple(&p) : NULL;
    packed_free(&p);
    Py_DECREF(seg);
    return res;
}

/* send_many(items, timeout=None): pack and send with one C call each; a batch the
 * channel cannot take whole right now goes on in Sender._send_packed (which waits), from
 * where this call stopped. */
static PyObject *Sender_send_many(SenderObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    static const char *const names[] = {"items", "timeout"};
    PyObject *a[2] = {NULL, Py_None};
    if (hot_parse_args("send_many", args, nargs, kwnames, names, 1, 2, a) < 0) return NULL;
    SegmentObject *seg = self->seg;
    if (!(seg && seg->registered && timeout_plain(a[1])))
        return PyObject_CallMethod((PyObject *)self, "_send_many_slow", "OO", a[0], a[1]);
    Py_INCREF(seg); /* packing may run Python code, which may close the sender */
    packed p;
    packed_local loc;
    if (pack_items(seg, a[0], &p, &loc) < 0) {
        packed_free(&p);
        Py_DECREF(seg);
        return NULL;
    }
    PyObject *res = NULL;
    if (p.n == 0) {
        res = PyList_New(0);
        goto out;
    }
    if (self->seg != seg || !seg->registered) { /* changed while packing */
        PyObject *pk = packed_tuple(&p);
        if (pk != NULL) {
            PyObject *seqs0 = PyByteArray_FromStringAndSize(NULL, p.n * 8);
            if (seqs0 != NULL)
                res = PyObject_CallMethod((PyObject *)self, "_send_packed", "NNIO", pk, seqs0, 0u,
                                          a[1]);
            else
                Py_DECREF(pk);
        }
        goto out;
    }
    if ((size_t)p.n > UINT32_MAX) {
        res = PyErr_Format(EXC_INVALID, "send_many: more than 4294967295 items in one batch");
        goto out;
    }
    PyObject *seqs = PyByteArray_FromStringAndSize(NULL, p.n * (Py_ssize_t)sizeof(uint64_t));
    if (seqs == NULL) goto out;
    uint64_t *sq = (uint64_t *)PyByteArray_AS_STRING(seqs);
    uint32_t done = 0;
    shm_stall stall;
    int wake = 0;
    int rc = hot_core.send_many(seg->c, (uint32_t)p.n, (const uint32_t *)p.kinds.p,
                                p.data.p ? p.data.p : "", p.data.len, (const uint64_t *)p.lens.p,
                                p.blob.p ? p.blob.p : "", p.blob.len,
                                (const uint32_t *)p.klens.p, (const uint32_t *)p.nkeys.p, sq,
                                &done, &stall, &wake);
    if (wake) wake_post(&seg->wk, WAKE_RX, 1); /* the receiver sleeps */
    if (rc == SHM_OK) {
        res = PyList_New(p.n);
        for (Py_ssize_t i = 0; res != NULL && i < p.n; i++) {
            PyObject *v = seq_object(sq[i]);
            if (v == NULL) Py_CLEAR(res);
            else PyList_SET_ITEM(res, i, v);
        }
    } else { /* full, stalled or an error: the first `done` went; Python goes on */
        PyObject *pk = packed_tuple(&p);
        if (pk != NULL)
            res = PyObject_CallMethod((PyObject *)self, "_send_packed", "NOIO", pk, seqs, done,
                                      a[1]);
    }
    Py_DECREF(seqs);
out:
    packed_free(&p);
    Py_DECREF(seg);
    return res;
}

/* send_batch(data, lengths, keys=None, timeout=None) -> memoryview of seqs: the
 * buffer-and-lengths form of send_many. Message i's payload is the next lengths[i] bytes
 * of `data` (raw bytes, not pickled); keys[i] its keys (one key or a tuple, as send takes),
 * or no keys at all with keys=None. No Python object is made per message. */
static PyObject *Sender_send_batch(SenderObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    static const char *const names[] = {"data", "lengths", "keys", "timeout"};
    PyObject *a[4] = {NULL, NULL, Py_None, Py_None};
    if (hot_parse_args("send_batch", args, nargs, kwnames, names, 2, 4, a) < 0) return NULL;
    SegmentObject *seg = self->seg;
    if (seg == NULL) return PyObject_CallMethod((PyObject *)self, "_live", NULL);
    Py_buffer data, lv;
    if (PyObject_GetBuffer(a[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    int have_lv = 0;
    packed p;
    memset(&p, 0, sizeof p);
    packed_local loc; /* used by the arrays while they fit */
    packed_use_local(&p, &loc);
    PyObject *res = NULL, *keyseq = NULL;
    Py_INCREF(seg); /* key encoding may run Python code, which may close the sender */
    /* lengths: a buffer of 8-byte unsigned ints (array('Q'), numpy uint64) or ints */
    if (PyObject_CheckBuffer(a[1]) && PyObject_GetBuffer(a[1], &lv, PyBUF_FORMAT) == 0) {
        have_lv = 1;
        const char *f = lv.format ? lv.format : "B";
        if (*f == '@' || *f == '=' || *f == '<') f++;
        if (lv.itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0)) {
            PyErr_SetString(EXC_TYPE,
                            "send_batch: lengths must be ints or a buffer of uint64 ('Q')");
            goto out;
        }
        p.n = lv.len / 8;
        if (gbuf_put(&p.lens, lv.buf, (size_t)lv.len) < 0) goto out;
    } else {
        PyErr_Clear();
        PyObject *ls = PySequence_Fast(a[1], "send_batch: lengths must be ints or a buffer");
        if (ls == NULL) goto out;
        p.n = PySequence_Fast_GET_SIZE(ls);
        for (Py_ssize_t i = 0; i < p.n; i++) {
            PyObject *o = PySequence_Fast_GET_ITEM(ls, i);
            unsigned long long v = PyLong_Check(o) ? PyLong_AsUnsignedLongLong(o) : (unsigned long long)-1;
            if (v == (unsigned long long)-1 && (PyErr_Occurred() || !PyLong_Check(o))) {
                PyErr_Clear();
                PyErr_Format(EXC_INVALID, "send_batch: lengths[%zd] is not a length", i);
                Py_DECREF(ls);
                goto out;
            }
            uint64_t v64 = v;
            if (gbuf_put(&p.lens, &v64, 8) < 0) {
                Py_DECREF(ls);
                goto out;
            }
        }
        Py_DECREF(ls);
    }
    if ((size_t)p.n > UINT32_MAX) {
        PyErr_SetString(EXC_INVALID, "send_batch: too many messages in one batch");
        goto out;
    }
    uint64_t total = 0;
    const uint64_t *lens = (const uint64_t *)p.lens.p;
    for (Py_ssize_t i = 0; i < p.n; i++) {
        if (lens[i] > (uint64_t)data.len - total) {
            PyErr_SetString(EXC_INVALID, "send_batch: the lengths add up to more than data");
            goto out;
        }
        total += lens[i];
    }
    if (total != (uint64_t)data.len) {
        PyErr_SetString(EXC_INVALID, "send_batch: the lengths add up to less than data");
        goto out;
    }
    uint32_t raw = SHM_PAYLOAD_RAW;
    size_t un = (size_t)p.n;
    if (gbuf_reserve(&p.kinds, 4 * un) < 0 || gbuf_reserve(&p.klens, 4 * un) < 0 ||
        gbuf_reserve(&p.nkeys, 4 * un) < 0 || gbuf_reserve(&p.blob, KEY_ROOM * un) < 0)
        goto out;
    if (a[2] != Py_None) {
        keyseq = PySequence_Fast(a[2], "send_batch: keys must be None or a sequence");
        if (keyseq == NULL) goto out;
        if (PySequence_Fast_GET_SIZE(keyseq) != p.n) {
            PyErr_Format(EXC_INVALID, "send_batch: %zd lengths but %zd keys", p.n,
                         PySequence_Fast_GET_SIZE(keyseq));
            goto out;
        }
    }
    keyblob kb;
    /* kinds, and the key lengths and counts: room for all n was reserved above */
    for (Py_ssize_t i = 0; i < p.n; i++) ((uint32_t *)p.kinds.p)[i] = raw;
    p.kinds.len = 4 * un;
    if (keyseq == NULL && un) {
        memset(p.klens.p, 0, 4 * un);
        memset(p.nkeys.p, 0, 4 * un);
        p.klens.len = p.nkeys.len = 4 * un;
    }
    for (Py_ssize_t i = 0; keyseq != NULL && i < p.n;) {
        if (seg->max_keys >= 1) { /* small int keys, the common batch, in one call */
            size_t used;
            Py_ssize_t w = hot_keys_write_ints(
                (uint8_t *)p.blob.p + p.blob.len, p.blob.cap - p.blob.len,
                PySequence_Fast_ITEMS(keyseq) + i, p.n - i, (uint32_t *)(p.klens.p + p.klens.len),
                (uint32_t *)(p.nkeys.p + p.nkeys.len), &used);
            p.blob.len += used;
            p.klens.len += 4 * (size_t)w;
            p.nkeys.len += 4 * (size_t)w;
            if ((i += w) == p.n) break;
        }
        /* any other key; encoding it may run Python code (codec.encode_keys), which may
         * change the list under us: such a batch is refused, nothing sent */
        PyObject *k = Py_NewRef(PySequence_Fast_GET_ITEM(keyseq, i));
        int bad = !pack_key_fast(seg, k, &p.blob, &p.klens, &p.nkeys) &&
                  pack_keys(seg, k, &kb, &p.blob, &p.klens, &p.nkeys) < 0;
        Py_DECREF(k);
        if (bad) goto out;
        if (PySequence_Fast_GET_SIZE(keyseq) != p.n) {
            PyErr_SetString(EXC_INVALID, "send_batch: keys changed size while being encoded "
                                         "(nothing was sent)");
            goto out;
        }
        i++;
        if (gbuf_reserve(&p.blob, KEY_ROOM * (size_t)(p.n - i)) < 0) goto out;
    }
    PyObject *seqs = PyByteArray_FromStringAndSize(NULL, p.n * (Py_ssize_t)sizeof(uint64_t));
    if (seqs == NULL) goto out;
    uint32_t done = 0;
    int rc = SHM_FULL;
    if (p.n && self->seg == seg && seg->registered && timeout_plain(a[3])) {
        shm_stall stall;
        int wake = 0;
        rc = hot_core.send_many(seg->c, (uint32_t)p.n, (const uint32_t *)p.kinds.p,
                                data.len ? data.buf : "", (uint64_t)data.len, lens,
                                p.blob.p ? p.blob.p : "", p.blob.len,
                                (const uint32_t *)p.klens.p, (const uint32_t *)p.nkeys.p,
                                (uint64_t *)PyByteArray_AS_STRING(seqs), &done, &stall, &wake);
        if (wake) wake_post(&seg->wk, WAKE_RX, 1); /* the receiver sleeps */
    }
    if (rc == SHM_OK || p.n == 0) {
        PyObject *mv = PyMemoryView_FromObject(seqs);
        if (mv != NULL) {
            res = PyObject_CallMethod(mv, "cast", "s", "Q");
            Py_DECREF(mv);
        }
    } else { /* full, stalled, unregistered, an error or an odd timeout: Python goes on */
        if (gbuf_put(&p.data, data.buf, (size_t)data.len) == 0) {
            PyObject *pk = packed_tuple(&p);
            if (pk != NULL)
                res = PyObject_CallMethod((PyObject *)self, "_send_batch_slow", "NOIO", pk, seqs,
                                          done, a[3]);
        }
    }
    Py_DECREF(seqs);
out:
    Py_XDECREF(keyseq);
    if (have_lv) PyBuffer_Release(&lv);
    PyBuffer_Release(&data);
    packed_free(&p);
    Py_DECREF(seg);
    return res;
}

static void Sender_dealloc(SenderObject *self) {
    Py_CLEAR(self->seg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Sender_get_seg(SenderObject *s, void *c) { return hot_get_seg(s->seg); }
static int Sender_set_seg(SenderObject *s, PyObject *v, void *c) { return hot_set_seg(&s->seg, v); }

static PyGetSetDef Sender_getset[] = {
    {"_seg", (getter)Sender_get_seg, (setter)Sender_set_seg, "None once closed", NULL},
    {NULL},
};

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL | METH_KEYWORDS,
     "send(obj, keys=(), timeout=None, *, delay=None, ttl=None) -> int: send one message;\n"
     "returns its sequence number. Blocks while the channel is full; with `timeout`, raises\n"
     "Full when it runs out. `delay` (seconds): not handed out before then, keeping its\n"
     "place on its keys (nothing behind it on them passes it). `ttl` (seconds): a dead\n"
     "letter (reason \"expired\") if not handed out within that time of its send."},
    {"send_many", (PyCFunction)(void (*)(void))Sender_send_many, METH_FASTCALL | METH_KEYWORDS,
     "send_many(items, timeout=None) -> list[int]: send (payload, keys) pairs in order\n"
     "with one C call per batch; returns their seqs."},
    {"send_batch", (PyCFunction)(void (*)(void))Sender_send_batch, METH_FASTCALL | METH_KEYWORDS,
     "send_batch(data, lengths, keys=None, timeout=None) -> memoryview of seqs: message i\n"
     "is the next lengths[i] bytes of data, with keys[i]; one C call, no object per message."},
    {"_pack", (PyCFunction)Sender_pack, METH_O,
     "_pack(items): the packed arrays of a send_many batch"},
    HOT_INIT_SUBCLASS, /* shmchan.Sender's tx.send(): CPython's quick C call (subclass.c) */
    {NULL},
};

PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.SenderBase",
    .tp_basicsize = sizeof(SenderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The per-message half of shmchan.Sender.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_getset = Sender_getset,
};
