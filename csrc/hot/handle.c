/* handle.c -- HandleBase: one message on loan, the per-message half of shmchan.Handle.
 *
 * A Handle carries the core's description of its message (shm_msg: slot and generation,
 * where the payload and keys lie) and releases it, or gives it back (nack), exactly once:
 * `done` is set before the core call, and a Handle collected while held releases its
 * message only in the process that received it (pid; -1 once handed over). `payload`
 * and `keys` are copied out of the mapping seqlock-style: the bytes are kept only if the
 * core's shm_unmoved says the record did not move meanwhile, else Python's slow path
 * (`_payload_slow`, `_keys_slow`) decides. `data` pins the record (shm_handle_view) and
 * hands out a slice of the mapping's memoryview.
 *
 * Handles are made and dropped once per message, so a dropped Handle's memory is kept
 * for the next one (a free list of up to FREE_HANDLES, as CPython keeps for its own
 * small objects): allocating and freeing an object was an eighth of a consumer's time.
 * Only memory is reused, never a handle: an object on the list has been deallocated
 * completely (its message released or handed over, its references dropped, its
 * reference to the type dropped). Only objects of exactly hot_handle_type are kept, and
 * only while that type is plain (below: its size and allocator are HandleBase's);
 * bind() empties the list before it changes the type.
 *
 * shmchan.Handle adds only methods, so when the class is made (__init_subclass__) it
 * takes HandleBase's descriptors as its own and HandleBase's plain memory (subclass.c):
 * its objects are not tracked by the cyclic collector (nothing a HandleBase refers to
 * is visible to it anyway) and are deallocated by Handle_dealloc_plain directly, not
 * through subtype_dealloc.
 */
#include "hot.h"

#define FREE_HANDLES 256 /* a recv_many(256)'s worth */
static HandleObject *free_handles[FREE_HANDLES];
static int nfree_handles;

void hot_handles_flush(void) {
    while (nfree_handles > 0) PyObject_Free(free_handles[--nfree_handles]);
}

static HandleObject *handle_alloc(void) {
    PyTypeObject *t = hot_handle_type;
    if (nfree_handles == 0) return (HandleObject *)t->tp_alloc(t, 0);
    HandleObject *h = free_handles[--nfree_handles];
    /* as PyType_GenericAlloc: a new reference (and one to the type), and zero in every
     * field hot_make_handle does not write (see HandleObject) */
    (void)PyObject_Init((PyObject *)h, t);
    h->keys = NULL;
    h->payload = NULL;
    h->done = 0;
    return h;
}

PyObject *hot_make_handle(SegmentObject *seg, const shm_msg *m) {
    HandleObject *h = handle_alloc();
    if (h == NULL) return NULL;
    h->seg = (SegmentObject *)Py_NewRef(seg);
    h->slot = (uint32_t)m->slot;
    h->gen = (uint32_t)m->gen;
    h->seq = m->seq;
    h->attempt = m->attempt;
    h->kind = m->kind;
    h->data_off = m->data_off;
    h->data_len = m->data_len;
    h->keys_off = m->keys_off;
    h->keys_len = m->keys_len;
    h->nkeys = m->nkeys;
    h->pos = m->pos;
    h->word = m->word;
    h->pid = seg->pid;
    return (PyObject *)h;
}

/* The release of handle h in the core, once; no Python, so it may run in a deallocator.
 * Returns the core's status (SHM_OK, SHM_STALE or an error), its wake-ups posted. */
int hot_release_core(HandleObject *h, int nack) {
    h->done = 1;
    SegmentObject *seg = h->seg;
    if (seg == NULL || seg_detached(seg)) return SHM_STALE; /* the mapping went first */
    int r = hot_core.release(seg->c, h->slot, h->gen, nack);
    if (r <= 0) return r;
    wake_requests(&seg->wk, r);
    return r & 0xFF;
}

/* The core refused a release with error r (< 0): Handle._released raises it. */
static PyObject *release_failed(HandleObject *h, int r) {
    PyObject *code = PyLong_FromLong(r);
    if (code == NULL) return NULL;
    PyObject *res = PyObject_CallMethodOneArg((PyObject *)h, hot_s_released, code);
    Py_DECREF(code);
    return res;
}

/* Release (nack = 0) or give back (nack = 1) once. Returns a new bool reference (True if
 * this call released a current handle) or NULL with an exception set. */
static PyObject *handle_finish(HandleObject *h, int nack) {
    if (h->done) Py_RETURN_FALSE;
    int r = hot_release_core(h, nack);
    if (r == SHM_OK) Py_RETURN_TRUE;
    if (r > 0) Py_RETURN_FALSE; /* stale: released, redelivered or revoked meanwhile */
    return release_failed(h, r);
}

/* What every Handle's deallocation does first. Collected while held, in the process that
 * holds it: release it. Nothing here runs Python code (so no finalizer and no
 * resurrection), and there is nobody to tell about an error. A handle pickled away has
 * pid -1; one inherited by a forked child has the parent's pid, not the child's segment
 * pid. */
static void handle_clear(HandleObject *h) {
    if (!h->done && h->seg != NULL && h->pid == h->seg->pid) (void)hot_release_core(h, 0);
    Py_CLEAR(h->seg);
    Py_CLEAR(h->keys);
    Py_CLEAR(h->payload);
}

/* HandleBase's deallocator; a subclass that is not plain reaches it from subtype_dealloc,
 * which drops the type reference afterwards. */
static void Handle_dealloc(PyObject *self) {
    handle_clear((HandleObject *)self);
    Py_TYPE(self)->tp_free(self);
}

/* The deallocator of a plain subclass (hot_subclass_plain), shmchan.Handle: called
 * directly, or from subtype_dealloc for a class statement's subclass of it (which then
 * leaves the type reference to us, its base being a heap type), so it drops the object's
 * reference to its type itself. The memory of an exactly hot_handle_type object is kept
 * for the next Handle. */
static void Handle_dealloc_plain(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    handle_clear((HandleObject *)self);
    if (tp == hot_handle_type && tp->tp_dealloc == Handle_dealloc_plain &&
        nfree_handles < FREE_HANDLES)
        free_handles[nfree_handles++] = (HandleObject *)self;
    else
        tp->tp_free(self);
    Py_DECREF(tp);
}

/* __init_subclass__: see the top of the file and subclass.c */
static PyObject *Handle_init_subclass(PyObject *cls, PyObject *args, PyObject *kwds) {
    if (hot_subclass_args(cls, args, kwds) < 0) return NULL;
    if (hot_subclass_descriptors((PyTypeObject *)cls, &HandleType) < 0) return NULL;
    (void)hot_subclass_plain((PyTypeObject *)cls, &HandleType, Handle_dealloc_plain);
    Py_RETURN_NONE;
}

static PyObject *Handle_release(HandleObject *h, PyObject *unused) {
    if (h->done) Py_RETURN_NONE;
    int r = hot_release_core(h, 0);
    if (r >= 0) Py_RETURN_NONE; /* released, or stale (a no-op) */
    PyObject *res = release_failed(h, r);
    if (res == NULL) return NULL;
    Py_DECREF(res);
    Py_RETURN_NONE;
}

static PyObject *Handle_finish(HandleObject *h, PyObject *arg) {
    int nack = PyObject_IsTrue(arg);
    if (nack < 0) return NULL;
    return handle_finish(h, nack);
}

static PyObject *Handle_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *Handle_exit(HandleObject *h, PyObject *const *args, Py_ssize_t nargs) {
    return Handle_release(h, NULL);
}

/* payload: raw bytes are copied here, seqlock-style; anything else (a pickled object,
 * a record that moved while we copied, a released handle) goes to _payload_slow. */
static PyObject *Handle_get_payload(HandleObject *h, void *closure) {
    if (h->payload) return Py_NewRef(h->payload);
    SegmentObject *seg = h->seg;
    if (!h->done && h->kind == SHM_PAYLOAD_RAW && seg && !seg_detached(seg) &&
        h->data_off <= seg->size && h->data_len <= seg->size - h->data_off) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)seg->base + h->data_off,
                                                (Py_ssize_t)h->data_len);
        if (b == NULL) return NULL;
        /* accept the bytes only if the receiver did not move the record meanwhile */
        if (hot_core.unmoved(seg->c, h->slot, h->word, h->pos) == SHM_OK) {
            h->payload = Py_NewRef(b);
            return b;
        }
        Py_DECREF(b);
    }
    PyObject *v = PyObject_CallMethodNoArgs((PyObject *)h, hot_s_payload_slow);
    if (v == NULL) return NULL;
    Py_XSETREF(h->payload, Py_NewRef(v));
    return v;
}

/* data: pin the record (the core's shm_handle_view), take its current place, and hand
 * out a slice of the mapping's memoryview, which keeps the mapping alive. Anything
 * else -- a released or stale handle, a record being moved -- goes to _data_slow, which
 * says what is wrong. */
static PyObject *Handle_get_data(HandleObject *h, void *closure) {
    SegmentObject *seg = h->seg;
    shm_msg m;
    if (h->done || seg == NULL || seg->mem == NULL || seg_detached(seg))
        return PyObject_CallMethodNoArgs((PyObject *)h, hot_s_data_slow);
    int rc = hot_core.handle_view(seg->c, h->slot, h->gen, &m);
    if (rc != SHM_OK) /* Python raises for this status (without trying again) */
        return PyObject_CallMethod((PyObject *)h, "_data_slow", "i", rc);
    h->kind = m.kind;
    h->data_off = m.data_off;
    h->data_len = m.data_len;
    h->keys_off = m.keys_off;
    h->keys_len = m.keys_len;
    h->nkeys = m.nkeys;
    h->pos = m.pos;
    h->word = m.word;
    if (h->data_off > seg->size || h->data_len > seg->size - h->data_off)
        return PyErr_Format(PyExc_SystemError, "handle view out of the mapping"); /* core bug */
    return PySequence_GetSlice(seg->mem, (Py_ssize_t)h->data_off,
                               (Py_ssize_t)(h->data_off + h->data_len));
}

/* keys: the blob copied seqlock-style like payload, then decoded here; anything
 * unusual goes to _keys_slow (codec.decode_keys), which raises ChannelCorrupted for a
 * malformed blob. */
static PyObject *Handle_get_keys(HandleObject *h, void *closure) {
    if (h->keys && h->keys != Py_None) return Py_NewRef(h->keys); /* None: not decoded */
    SegmentObject *seg = h->seg;
    uint8_t stack[512];
    uint8_t *buf = NULL;
    PyObject *t = NULL;
    size_t len = (size_t)h->keys_len, n = (size_t)h->nkeys;
    if (h->done || seg == NULL || seg_detached(seg) || n > SHM_MAX_KEYS_LIMIT ||
        h->keys_off > seg->size || len > seg->size - h->keys_off || len > sizeof stack)
        goto slow;
    buf = stack;
    memcpy(buf, seg->base + h->keys_off, len);
    if (hot_core.unmoved(seg->c, h->slot, h->word, h->pos) != SHM_OK) goto slow; /* moved */
    t = hot_keys_from_blob(buf, len, n);
    if (t == NULL) {
        if (PyErr_Occurred()) return NULL;
        goto slow;
    }
    h->keys = Py_NewRef(t);
    return t;
slow:
    t = PyObject_CallMethodNoArgs((PyObject *)h, hot_s_keys_slow);
    if (t != NULL && h->keys == NULL) h->keys = Py_NewRef(t);
    return t;
}

static PyObject *Handle_get_seg(HandleObject *h, void *closure) { return hot_get_seg(h->seg); }

static PyGetSetDef Handle_getset[] = {
    {"payload", (getter)Handle_get_payload, NULL,
     "The message's object: bytes for bytes-like payloads, else the unpickled object.", NULL},
    {"data", (getter)Handle_get_data, NULL,
     "The stored bytes, zero-copy and read-only; valid until the handle is released.\n\n"
     "Taking a view pins the record where it is: the receiver will not move it to free\n"
     "space behind it (use `payload` for handles you keep for long).",
     NULL},
    {"keys", (getter)Handle_get_keys, NULL,
     "The message's keys as they were sent (duplicates merged).", NULL},
    {"_seg", (getter)Handle_get_seg, NULL, "the attachment the handle belongs to", NULL},
    {NULL},
};

static PyMethodDef Handle_methods[] = {
    {"release", (PyCFunction)Handle_release, METH_NOARGS,
     "Free the handle's keys for the next message in line. Idempotent."},
    {"ack", (PyCFunction)Handle_release, METH_NOARGS, "Same as release()."},
    {"_finish", (PyCFunction)Handle_finish, METH_O,
     "_finish(nack) -> bool: release or give back, once"},
    {"__enter__", (PyCFunction)Handle_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Handle_exit, METH_FASTCALL, NULL},
    {"__init_subclass__", (PyCFunction)(void (*)(void))Handle_init_subclass,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS, NULL},
    {NULL},
};

#define HM(name, type, field, flags, doc) {name, type, offsetof(HandleObject, field), flags, doc}
static PyMemberDef Handle_members[] = {
    HM("seq", T_ULONGLONG, seq, READONLY, "The channel-wide sequence number of the message."),
    HM("attempt", T_ULONGLONG, attempt, READONLY, "1 on first delivery, +1 per redelivery."),
    HM("_slot", T_UINT, slot, READONLY, NULL),
    HM("_gen", T_UINT, gen, READONLY, NULL),
    HM("_kind", T_ULONGLONG, kind, 0, NULL),
    HM("_data_off", T_ULONGLONG, data_off, 0, NULL),
    HM("_data_len", T_ULONGLONG, data_len, 0, NULL),
    HM("_keys_off", T_ULONGLONG, keys_off, 0, NULL),
    HM("_keys_len", T_ULONGLONG, keys_len, 0, NULL),
    HM("_nkeys", T_ULONGLONG, nkeys, 0, NULL),
    HM("_pos", T_ULONGLONG, pos, 0, NULL),
    HM("_word", T_ULONGLONG, word, 0, NULL),
    HM("_keys", T_OBJECT, keys, 0, NULL),
    HM("_done", T_BOOL, done, 0, NULL),
    HM("_pid", T_LONG, pid, 0, NULL),
    {NULL},
};

PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.HandleBase",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A message on loan (the per-message half of shmchan.Handle).",
    .tp_dealloc = Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_members = Handle_members,
    .tp_getset = Handle_getset,
};

/* handles_from(seg, address, n): Handles for n shm_msg structs at `address` (the slow
 * path's cffi array). */
PyObject *hot_handles_from(PyObject *mod, PyObject *args) {
    PyObject *seg;
    unsigned long long addr;
    unsigned int n;
    if (!PyArg_ParseTuple(args, "O!KI", &SegmentType, &seg, &addr, &n)) return NULL;
    if (((SegmentObject *)seg)->c == NULL)
        return PyErr_Format(PyExc_ValueError, "an unbound segment");
    const shm_msg *m = (const shm_msg *)(uintptr_t)addr;
    PyObject *out = PyList_New(n);
    unsigned int made = 0;
    for (; out != NULL && made < n; made++) {
        PyObject *h = hot_make_handle((SegmentObject *)seg, &m[made]);
        if (h == NULL) break;
        PyList_SET_ITEM(out, made, h);
    }
    if (out != NULL && made == n) return out;
    /* Out of memory part-way: the messages were taken out for us. Give every one back
     * (as poll_fast does) rather than drop them: a Handle made already is given back
     * through itself (and so marked done: collecting it must not release it), the rest
     * by their (slot, gen). */
    for (unsigned int i = 0; i < n; i++) {
        if (i < made) {
            (void)hot_release_core((HandleObject *)PyList_GET_ITEM(out, i), 1);
            continue;
        }
        int r = hot_core.release(((SegmentObject *)seg)->c, (uint32_t)m[i].slot,
                                 (uint32_t)m[i].gen, 1);
        if (r > 0) wake_requests(&((SegmentObject *)seg)->wk, r);
    }
    Py_XDECREF(out);
    return NULL;
}
