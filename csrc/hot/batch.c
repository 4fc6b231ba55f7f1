/* batch.c -- BatchBase: many messages on loan as one object (Receiver.recv_batch).
 *
 * A batch keeps the core's descriptions (shm_msg) of its messages in one C array and
 * creates a Python object for a message only when asked for one (payload(i), keys(i),
 * handle(i)); seqs, attempts and lengths come as memoryviews over one buffer each, and
 * joined() copies every payload into one bytes object. Its messages are released or
 * given back as a whole or in part, each exactly once (the `done` flag per message, and
 * `left` counting those still held), with one core call per call; whatever is still
 * held when the batch is collected (in the process that received it) is released, as a
 * Handle's message would be.
 */
#include "hot.h"

PyTypeObject *hot_batch_type = &BatchType; /* shmchan.Batch once bound */

PyObject *hot_batch_new(SegmentObject *seg, const shm_msg *msgs, Py_ssize_t n) {
    BatchObject *b = (BatchObject *)hot_batch_type->tp_alloc(hot_batch_type, 0);
    if (b == NULL) return NULL;
    b->msgs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(shm_msg));
    b->done = PyMem_Calloc((size_t)(n ? n : 1), 1);
    if (b->msgs == NULL || b->done == NULL) {
        /* nothing is owned yet: the caller gives the messages back */
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    memcpy(b->msgs, msgs, (size_t)n * sizeof(shm_msg));
    b->seg = (SegmentObject *)Py_NewRef(seg);
    b->n = b->left = n;
    b->pid = seg->pid;
    return (PyObject *)b;
}

#define ADOPT_MIN 16 /* fewer messages are copied: cheaper than a fresh array for the poller */

/* hot_batch_new for an array the batch may keep: *msgs (PyMem memory with room for cap
 * messages, n of them filled) becomes the batch's own and *msgs NULL, so the messages a
 * poll wrote are not copied again. Small batches, and batches filling less than half the
 * array (they would hold on to the rest), are copied and leave *msgs as it was. */
PyObject *hot_batch_adopt(SegmentObject *seg, shm_msg **msgs, Py_ssize_t n, Py_ssize_t cap) {
    if (n < ADOPT_MIN || n < cap / 2) return hot_batch_new(seg, *msgs, n);
    BatchObject *b = (BatchObject *)hot_batch_type->tp_alloc(hot_batch_type, 0);
    if (b == NULL) return NULL;
    b->done = PyMem_Calloc((size_t)n, 1);
    if (b->done == NULL) {
        Py_DECREF(b); /* nothing is owned yet: the caller gives the messages back */
        return PyErr_NoMemory();
    }
    b->msgs = *msgs;
    *msgs = NULL;
    b->seg = (SegmentObject *)Py_NewRef(seg);
    b->n = b->left = n;
    b->pid = seg->pid;
    return (PyObject *)b;
}

/* Release (nack = 0) or give back (nack = 1) the listed messages that are still held;
 * idx NULL = all of them. Returns the core's status (errors < 0), wake-ups posted. */
static int batch_finish_core(BatchObject *b, const Py_ssize_t *idx, Py_ssize_t k, int nack) {
    SegmentObject *seg = b->seg;
    if (idx == NULL && !nack && b->left == b->n && b->n <= UINT32_MAX && seg != NULL &&
        !seg_detached(seg)) {
        /* All of it, every message still held (the common release): the core reads the
         * slots and generations from the descriptions themselves. */
        memset(b->done, 1, (size_t)b->n);
        b->left = 0;
        int wake = 0;
        int rc = hot_core.release_msgs(seg->c, b->msgs, (uint32_t)b->n, &wake);
        wake_released(&seg->wk, wake);
        return rc;
    }
    Py_ssize_t cnt = idx ? k : b->n;
    uint32_t stack_s[256], stack_g[256];
    uint32_t *slots = stack_s, *gens = stack_g;
    if (cnt > 256) {
        slots = PyMem_Malloc((size_t)cnt * sizeof(uint32_t));
        gens = PyMem_Malloc((size_t)cnt * sizeof(uint32_t));
        if (slots == NULL || gens == NULL) { /* one at a time rather than not at all */
            PyMem_Free(slots);
            PyMem_Free(gens);
            slots = stack_s;
            gens = stack_g;
            cnt = 0;
        }
    }
    uint32_t m = 0;
    int rc = SHM_OK;
    int detached = seg == NULL || seg_detached(seg);
    for (Py_ssize_t j = 0; j < (idx ? k : b->n); j++) {
        Py_ssize_t i = idx ? idx[j] : j;
        if (b->done[i]) continue;
        b->done[i] = 1;
        b->left--;
        if (detached) continue; /* the mapping went first: nothing to release */
        if (cnt == 0) {         /* out of memory above */
            int r = hot_core.release(seg->c, (uint32_t)b->msgs[i].slot, (uint32_t)b->msgs[i].gen,
                                     nack);
            if (r > 0) wake_requests(&seg->wk, r);
            else if (r < 0) rc = r;
            continue;
        }
        slots[m] = (uint32_t)b->msgs[i].slot;
        gens[m] = (uint32_t)b->msgs[i].gen;
        m++;
    }
    if (m && !nack) {
        int wake = 0;
        rc = hot_core.release_many(seg->c, slots, gens, m, &wake);
        wake_released(&seg->wk, wake);
    } else if (m) { /* nacks, one core call each (rare: a batch given back) */
        for (uint32_t j = 0; j < m; j++) {
            int r = hot_core.release(seg->c, slots[j], gens[j], 1);
            if (r > 0) wake_requests(&seg->wk, r);
            else if (r < 0) rc = r;
        }
    }
    if (slots != stack_s) {
        PyMem_Free(slots);
        PyMem_Free(gens);
    }
    return rc;
}

static void Batch_dealloc(BatchObject *b) {
    /* Collected while holding messages, in the process that received them: release
     * them (no Python code runs here). A batch is never pickled. */
    if (b->left > 0 && b->seg != NULL && b->msgs != NULL && b->done != NULL &&
        b->pid == b->seg->pid)
        (void)batch_finish_core(b, NULL, 0, 0);
    Py_CLEAR(b->seg);
    PyMem_Free(b->msgs);
    PyMem_Free(b->done);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static Py_ssize_t Batch_len(BatchObject *b) { return b->n; }

/* An index into the batch, negative from the end, checked. -1 with IndexError. */
static Py_ssize_t batch_index(BatchObject *b, PyObject *o) {
    Py_ssize_t i = PyNumber_AsSsize_t(o, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0) i += b->n;
    if (i < 0 || i >= b->n) {
        PyErr_Format(PyExc_IndexError, "batch index out of range (%zd messages)", b->n);
        return -1;
    }
    return i;
}

/* A Handle for message i that does not release on collection: the payload and keys
 * getters' full logic (pickled payloads, moved records, odd keys) without duplicating it. */
static PyObject *batch_peek_handle(BatchObject *b, Py_ssize_t i) {
    if (b->done[i])
        return PyErr_Format(PyExc_ValueError, "batch message %zd was already released", i);
    HandleObject *h = (HandleObject *)hot_make_handle(b->seg, &b->msgs[i]);
    if (h != NULL) h->pid = -1; /* a view of the batch's message: never released by it */
    return (PyObject *)h;
}

static PyObject *batch_peek_attr(BatchObject *b, PyObject *arg, const char *attr) {
    Py_ssize_t i = batch_index(b, arg);
    if (i < 0) return NULL;
    PyObject *h = batch_peek_handle(b, i);
    if (h == NULL) return NULL;
    PyObject *v = PyObject_GetAttrString(h, attr);
    ((HandleObject *)h)->done = 1;
    Py_DECREF(h);
    return v;
}

static PyObject *Batch_payload(BatchObject *b, PyObject *arg) {
    Py_ssize_t i = batch_index(b, arg);
    if (i < 0) return NULL;
    shm_msg *m = &b->msgs[i];
    SegmentObject *seg = b->seg;
    if (!b->done[i] && m->kind == SHM_PAYLOAD_RAW && !seg_detached(seg) &&
        m->data_off <= seg->size && m->data_len <= seg->size - m->data_off) {
        PyObject *v = PyBytes_FromStringAndSize((const char *)seg->base + m->data_off,
                                                (Py_ssize_t)m->data_len);
        if (v == NULL) return NULL;
        /* accept the bytes only if the receiver did not move the record meanwhile */
        if (hot_core.unmoved(seg->c, (uint32_t)m->slot, m->word, m->pos) == SHM_OK) return v;
        Py_DECREF(v);
    }
    return batch_peek_attr(b, arg, "payload");
}

static PyObject *Batch_keys(BatchObject *b, PyObject *arg) { return batch_peek_attr(b, arg, "keys"); }

/* payloads() -> list[bytes] */
static PyObject *Batch_payloads(BatchObject *b, PyObject *unused) {
    PyObject *out = PyList_New(b->n);
    for (Py_ssize_t i = 0; out != NULL && i < b->n; i++) {
        PyObject *idx = PyLong_FromSsize_t(i);
        PyObject *v = idx ? Batch_payload(b, idx) : NULL;
        Py_XDECREF(idx);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* joined() -> bytes: every payload (raw bytes) back to back, in batch order. */
static PyObject *Batch_joined(BatchObject *b, PyObject *unused) {
    SegmentObject *seg = b->seg;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->msgs[i].kind != SHM_PAYLOAD_RAW)
            return PyErr_Format(PyExc_TypeError,
                                "joined(): message %zd carries a pickled object; use payload(i)",
                                i);
        if (b->done[i])
            return PyErr_Format(PyExc_ValueError, "batch message %zd was already released", i);
        total += b->msgs[i].data_len;
    }
    if (seg_detached(seg)) return PyErr_Format(PyExc_ValueError, "the channel was closed");
    if (total > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    /* Copy every payload in bounds, then one seqlock check for the batch (the core's
     * unmoved_many): the messages before the first moved one are good as copied. */
    Py_ssize_t good = b->n;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        shm_msg *m = &b->msgs[i];
        if (m->data_off <= seg->size && m->data_len <= seg->size - m->data_off)
            memcpy(p, seg->base + m->data_off, (size_t)m->data_len);
        else if (good == b->n)
            good = i; /* out of bounds: the careful way, below */
        p += m->data_len;
    }
    Py_ssize_t first = (Py_ssize_t)hot_core.unmoved_many(seg->c, b->msgs, (uint32_t)b->n);
    if (good > first) good = first;
    if (good == b->n) return out; /* all good as copied (the common case) */
    p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < good; i++) p += b->msgs[i].data_len;
    for (Py_ssize_t i = good; i < b->n; i++) { /* from the first that moved: one at a time */
        shm_msg *m = &b->msgs[i];
        int ok = m->data_off <= seg->size && m->data_len <= seg->size - m->data_off &&
                 hot_core.unmoved(seg->c, (uint32_t)m->slot, m->word, m->pos) == SHM_OK;
        if (!ok) { /* moved while we copied: the careful way for this one */
            PyObject *idx = PyLong_FromSsize_t(i);
            PyObject *v = idx ? batch_peek_attr(b, idx, "payload") : NULL;
            Py_XDECREF(idx);
            if (v == NULL || !PyBytes_Check(v) || (uint64_t)PyBytes_GET_SIZE(v) != m->data_len) {
                if (v != NULL) PyErr_SetString(PyExc_SystemError, "a payload changed length");
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            memcpy(p, PyBytes_AS_STRING(v), (size_t)m->data_len);
            Py_DECREF(v);
        }
        p += m->data_len;
    }
    return out;
}

/* A read-only memoryview of n uint64 values, one per message, taken by `field`. */
static PyObject *batch_words(BatchObject *b, size_t field) {
    PyObject *raw = PyBytes_FromStringAndSize(NULL, b->n * 8);
    if (raw == NULL) return NULL;
    uint64_t *w = (uint64_t *)PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < b->n; i++) w[i] = ((const uint64_t *)&b->msgs[i])[field];
    PyObject *mv = PyMemoryView_FromObject(raw);
    Py_DECREF(raw);
    if (mv == NULL) return NULL;
    PyObject *out = PyObject_CallMethod(mv, "cast", "s", "Q");
    Py_DECREF(mv);
    return out;
}

#define MSG_WORD(f) (offsetof(shm_msg, f) / sizeof(uint64_t))
static PyObject *Batch_get_seqs(BatchObject *b, void *c) { return batch_words(b, MSG_WORD(seq)); }
static PyObject *Batch_get_attempts(BatchObject *b, void *c) {
    return batch_words(b, MSG_WORD(attempt));
}
static PyObject *Batch_get_lengths(BatchObject *b, void *c) {
    return batch_words(b, MSG_WORD(data_len));
}
static PyObject *Batch_get_held(BatchObject *b, void *c) { return PyLong_FromSsize_t(b->left); }

/* The indices `which` names: None = all (returns 0 with *idx NULL), an int, or an
 * iterable of ints. -1 with an exception. */
static int batch_which(BatchObject *b, PyObject *which, Py_ssize_t **idx, Py_ssize_t *k) {
    *idx = NULL;
    *k = 0;
    if (which == NULL || which == Py_None) return 0;
    PyObject *seq;
    if (PyIndex_Check(which)) {
        seq = PyTuple_Pack(1, which);
    } else {
        seq = PySequence_Fast(which, "expected None, an index or an iterable of indices");
    }
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        out[j] = batch_index(b, PySequence_Fast_GET_ITEM(seq, j));
        if (out[j] < 0) { /* every index is checked before anything is released */
            PyMem_Free(out);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *idx = out;
    *k = n;
    return 0;
}

static PyObject *batch_finish(BatchObject *b, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames, const char *fname, int nack) {
    static const char *const names[] = {"which"};
    PyObject *a[1] = {Py_None};
    if (hot_parse_args(fname, args, nargs, kwnames, names, 0, 1, a) < 0) return NULL;
    Py_ssize_t *idx, k;
    if (batch_which(b, a[0], &idx, &k) < 0) return NULL;
    int rc = b->left ? batch_finish_core(b, idx, k, nack) : SHM_OK;
    PyMem_Free(idx);
    if (rc >= 0) Py_RETURN_NONE;
    return PyObject_CallMethod((PyObject *)b, "_released", "i", rc);
}

static PyObject *Batch_release(BatchObject *b, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    return batch_finish(b, args, nargs, kwnames, "release", 0);
}

static PyObject *Batch_nack(BatchObject *b, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    return batch_finish(b, args, nargs, kwnames, "nack", 1);
}

/* handle(i) -> Handle: message i leaves the batch as a Handle of its own. */
static PyObject *Batch_handle(BatchObject *b, PyObject *arg) {
    Py_ssize_t i = batch_index(b, arg);
    if (i < 0) return NULL;
    if (b->done[i])
        return PyErr_Format(PyExc_ValueError, "batch message %zd was already released", i);
    PyObject *h = hot_make_handle(b->seg, &b->msgs[i]);
    if (h == NULL) return NULL;
    b->done[i] = 1;
    b->left--;
    return h;
}

static PyObject *Batch_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *Batch_exit(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    return batch_finish(b, NULL, 0, NULL, "__exit__", 0);
}

static PyMethodDef Batch_methods[] = {
    {"payload", (PyCFunction)Batch_payload, METH_O,
     "payload(i): message i's object (bytes for bytes payloads; a copy)."},
    {"payloads", (PyCFunction)Batch_payloads, METH_NOARGS,
     "payloads() -> list: every message's payload(i)."},
    {"joined", (PyCFunction)Batch_joined, METH_NOARGS,
     "joined() -> bytes: every payload back to back (bytes payloads only); split it with\n"
     "`lengths`."},
    {"keys", (PyCFunction)Batch_keys, METH_O, "keys(i): message i's keys as they were sent."},
    {"handle", (PyCFunction)Batch_handle, METH_O,
     "handle(i) -> Handle: take message i out of the batch as a Handle of its own."},
    {"release", (PyCFunction)(void (*)(void))Batch_release, METH_FASTCALL | METH_KEYWORDS,
     "release(which=None): release the messages `which` names (an index or an iterable\n"
     "of indices; None = all) that are still held; each exactly once."},
    {"ack", (PyCFunction)(void (*)(void))Batch_release, METH_FASTCALL | METH_KEYWORDS,
     "Same as release()."},
    {"nack", (PyCFunction)(void (*)(void))Batch_nack, METH_FASTCALL | METH_KEYWORDS,
     "nack(which=None): give messages back, as Handle.nack does, each exactly once."},
    {"__enter__", (PyCFunction)Batch_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Batch_exit, METH_FASTCALL, NULL},
    HOT_INIT_SUBCLASS, /* shmchan.Batch's b.payload(i): CPython's quick C call (subclass.c) */
    {NULL},
};

static PyGetSetDef Batch_getset[] = {
    {"seqs", (getter)Batch_get_seqs, NULL, "The messages' seqs (a memoryview of uint64).", NULL},
    {"attempts", (getter)Batch_get_attempts, NULL,
     "The messages' delivery attempts (a memoryview of uint64).", NULL},
    {"lengths", (getter)Batch_get_lengths, NULL,
     "The messages' payload lengths in bytes (a memoryview of uint64).", NULL},
    {"held", (getter)Batch_get_held, NULL,
     "How many messages are still held (not released, given back or taken as a Handle).", NULL},
    {NULL},
};

static PySequenceMethods Batch_as_sequence = {.sq_length = (lenfunc)Batch_len};

PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.BatchBase",
    .tp_basicsize = sizeof(BatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Messages on loan as one object (the C half of shmchan.Batch).",
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
    .tp_as_sequence = &Batch_as_sequence,
};

/* batch_from_handles(seg, handles): a Batch taking over the messages of Handles (the
 * receiver's waiting path builds Handles); each handle ends up done. */
PyObject *hot_batch_from_handles(PyObject *mod, PyObject *args) {
    PyObject *seg, *hs;
    if (!PyArg_ParseTuple(args, "O!O!", &SegmentType, &seg, &PyList_Type, &hs)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hs);
    shm_msg *msgs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(shm_msg));
    if (msgs == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(hs, i);
        if (!PyObject_TypeCheck(o, &HandleType) || ((HandleObject *)o)->seg != (SegmentObject *)seg ||
            ((HandleObject *)o)->done) {
            PyMem_Free(msgs);
            return PyErr_Format(PyExc_ValueError, "batch_from_handles: not a held handle");
        }
        HandleObject *h = (HandleObject *)o;
        msgs[i] = (shm_msg){h->slot, h->gen, h->seq, h->attempt, h->kind, h->data_off,
                            h->data_len, h->keys_off, h->keys_len, h->nkeys, h->pos, h->word};
    }
    PyObject *b = hot_batch_new((SegmentObject *)seg, msgs, n);
    PyMem_Free(msgs);
    if (b == NULL) return NULL; /* the handles still hold their messages */
    for (Py_ssize_t i = 0; i < n; i++) ((HandleObject *)PyList_GET_ITEM(hs, i))->done = 1;
    return b;
}
