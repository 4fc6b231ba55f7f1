/* publish.c -- PublisherBase: Exchange.publish's fast path, the per-publish half of
 * shmchan.Exchange (shmchan/exchange.py subclasses it).
 *
 * A publish routes one message to the channels its routing key matches and writes it to
 * all of them or to none (exch_publish, csrc/exchange.c: the protocol is there; nothing
 * here touches shared memory but through the core). What the Python layer works out per
 * routing key -- the matched channels, their attachments, the bindings that matched --
 * it hands over once (`_fast_route`), tagged with the bindings' version it was compiled
 * under. A publish then makes one C call into the core when all of these hold:
 *
 *   - the exchange's bindings version (exch_version, an acquire load in shared memory)
 *     still equals the tagged one: a bind or unbind in any process changes it, and the
 *     publish goes to Python, which compiles the bindings again and hands over anew;
 *   - the routing key (an exact str) has a route, none of its channels missing (a route
 *     with a missing channel must look for it on every publish: Python's);
 *   - the payload is bytes or bytearray and the keys are plain (keys.c encodes them
 *     once, on the stack, for every copy); the timeout is None or a non-negative number;
 *   - every channel's attachment is open and registered as a producer in this process
 *     (cleared when its Channel is closed and in a forked child).
 *
 * A route of one channel is a plain send (shm_send: one copy is all or nothing by
 * itself), as the Python layer makes it; two or more are one exch_publish.
 *
 * Otherwise, and whenever the core call does not return SHM_OK, the call goes to
 * `_publish_slow` (Python) with the same arguments. That is safe because a call that
 * did not return SHM_OK published nothing (exch_publish aborted it; shm_send wrote
 * nothing): the slow path waits for room, re-routes, or raises, and publishes at most
 * once.
 *
 * The routes are held in a dict (routing key -> capsule of a route); the dict is emptied
 * when the version moves, when the Python layer asks (`_fast_clear`: close, fork, a
 * channel removed) and when it reaches ROUTES_MAX entries.
 */
#include "hot.h"

#define ROUTES_MAX 4096 /* routing keys remembered (the Python layer's cache holds as many) */

typedef int (*exch_publish_fn)(shm_exch *, shm_chan **, uint32_t, uint32_t, const char *,
                               uint64_t, const char *, uint32_t, uint32_t, uint64_t *, int *,
                               uint32_t *, shm_stall *);
typedef uint64_t (*exch_version_fn)(shm_exch *);
typedef int (*exch_removed_fn)(shm_exch *);
typedef int (*exch_note_fn)(shm_exch *, const uint32_t *, uint32_t, uint64_t);

static struct {
    exch_publish_fn publish;
    exch_version_fn version;
    exch_removed_fn removed;
    exch_note_fn note;
} core; /* set once by bind_exchange() */

static PyTypeObject *published_type; /* shmchan.Published, a dict subclass */
static PyObject *s_publish_slow, *s_published_removed, *s_missing, *empty_tuple, *empty_str;

/* Where one routing key goes: n channels (sorted by name, the order exch_publish writes
 * them in) and the nidx bindings that matched. Owned by its capsule. */
typedef struct {
    uint32_t n, nidx, max_keys;
    SegmentObject **segs; /* n references                                        */
    shm_chan **chans;     /* segs[i]->c, as exch_publish takes them              */
    PyObject **names;     /* n references: the keys of the result                */
    uint32_t *idx;        /* the matched bindings' table indexes (exch_note)     */
} route;

static void route_free(route *r) {
    if (r == NULL) return;
    for (uint32_t i = 0; i < r->n; i++) {
        if (r->segs) Py_XDECREF(r->segs[i]);
        if (r->names) Py_XDECREF(r->names[i]);
    }
    PyMem_Free(r->segs);
    PyMem_Free(r->chans);
    PyMem_Free(r->names);
    PyMem_Free(r->idx);
    PyMem_Free(r);
}

static void route_capsule_free(PyObject *cap) {
    route_free(PyCapsule_GetPointer(cap, "shmchan.route"));
}

typedef struct {
    PyObject_HEAD
    shm_exch *x;      /* NULL: no fast path (not attached, closed)              */
    PyObject *owner;  /* the object that keeps x mapped (the exchange's attachment) */
    uint64_t version; /* the bindings' version the routes were compiled under    */
    PyObject *routes; /* dict: routing key -> capsule of a route                  */
} PublisherObject;

static int Publisher_clear(PublisherObject *self) {
    self->x = NULL;
    Py_CLEAR(self->owner);
    Py_CLEAR(self->routes);
    return 0;
}

static void Publisher_dealloc(PublisherObject *self) {
    Publisher_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The payload's bytes, if it is one the fast path sends as it is. */
static int raw_payload(PyObject *p, const char **data, Py_ssize_t *len) {
    if (PyBytes_CheckExact(p)) {
        *data = PyBytes_AS_STRING(p);
        *len = PyBytes_GET_SIZE(p);
        return 1;
    }
    if (PyByteArray_CheckExact(p)) { /* we hold the GIL: it cannot resize */
        *data = PyByteArray_AS_STRING(p);
        *len = PyByteArray_GET_SIZE(p);
        return 1;
    }
    return 0;
}

/* The key blob of `keys` (None, one plain key, or a tuple or list of them) for channels
 * that take at most max_keys. 1 if encoded; 0 if codec.py must see to it (it raises what
 * there is to raise). */
static int plain_keys(keyblob *kb, PyObject *keys, uint32_t max_keys) {
    hot_keys_init(kb);
    if (keys == Py_None) return 1;
    if (PyTuple_CheckExact(keys) || PyList_CheckExact(keys)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
        for (Py_ssize_t i = 0; i < n; i++)
            if (hot_key_append(kb, PySequence_Fast_GET_ITEM(keys, i)) != 1) goto python;
    } else if (hot_key_append(kb, keys) != 1) {
        goto python;
    }
    return kb->n <= max_keys;
python:
    PyErr_Clear();
    return 0;
}

/* The route for this call, borrowed from a capsule the caller holds (*cap), or NULL. */
static route *route_for(PublisherObject *self, PyObject *rk, PyObject **cap) {
    if (self->x == NULL || self->routes == NULL || !PyUnicode_CheckExact(rk)) return NULL;
    /* acquire (inside exch_version): pairs with the release bump of every binding change */
    if (core.version(self->x) != self->version) return NULL;
    PyObject *c = PyDict_GetItemWithError(self->routes, rk);
    if (c == NULL) {
        PyErr_Clear();
        return NULL;
    }
    route *r = PyCapsule_GetPointer(c, "shmchan.route");
    if (r == NULL) {
        PyErr_Clear();
        return NULL;
    }
    for (uint32_t i = 0; i < r->n; i++)
        if (!r->segs[i]->registered || seg_detached(r->segs[i])) return NULL;
    *cap = Py_NewRef(c);
    return r;
}

/* The result: a Published {name: seq} with no channel missing. */
static PyObject *published(route *r, const uint64_t *seqs) {
    PyObject *res = published_type->tp_new(published_type, empty_tuple, NULL);
    if (res == NULL) return NULL;
    for (uint32_t i = 0; i < r->n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(seqs[i]);
        if (v == NULL || PyDict_SetItem(res, r->names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(res);
            return NULL;
        }
        Py_DECREF(v);
    }
    if (PyObject_SetAttr(res, s_missing, empty_tuple) < 0) Py_CLEAR(res);
    return res;
}

/* publish(payload, routing_key="", keys=(), timeout=None, *, mandatory=False) */
static PyObject *Publisher_publish(PublisherObject *self, PyObject *const *args,
                                   Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"payload", "routing_key", "keys", "timeout",
                                        "mandatory"};
    PyObject *a[5] = {NULL, NULL, NULL, Py_None, Py_False};
    if (nargs > 4)
        return PyErr_Format(PyExc_TypeError,
                            "publish() takes at most 4 positional arguments (%zd given); "
                            "mandatory is keyword-only",
                            nargs);
    if (hot_parse_args("publish", args, nargs, kwnames, names, 1, 5, a) < 0) return NULL;
    PyObject *rk = a[1] ? a[1] : empty_str;
    PyObject *keys = a[2] ? a[2] : empty_tuple; /* () and None both mean no keys */
    const char *data;
    Py_ssize_t len;
    PyObject *cap = NULL;
    route *r = NULL;
    keyblob kb;
    if (raw_payload(a[0], &data, &len) && timeout_plain(a[3]) &&
        (r = route_for(self, rk, &cap)) != NULL && plain_keys(&kb, keys, r->max_keys)) {
        uint64_t seqs[r->n];
        int wakes[r->n];
        uint32_t failed = 0;
        shm_stall stall;
        int rc = SHM_REMOVED;
        if (r->n == 1) { /* the exchange's removal refuses it here (exch_publish: txn_begin) */
            wakes[0] = 0;
            if (!core.removed(self->x))
                rc = hot_core.send(r->chans[0], SHM_PAYLOAD_RAW, data, (uint64_t)len,
                                   (const char *)kb.buf, kb.len, kb.n, &seqs[0], &stall,
                                   &wakes[0]);
        } else {
            rc = core.publish(self->x, r->chans, r->n, SHM_PAYLOAD_RAW, data, (uint64_t)len,
                              (const char *)kb.buf, kb.len, kb.n, seqs, wakes, &failed, &stall);
        }
        for (uint32_t i = 0; i < r->n; i++)
            if (wakes[i]) wake_post(&r->segs[i]->wk, WAKE_RX, 1); /* that receiver sleeps */
        if (rc == SHM_OK) {
            PyObject *res = NULL;
            if (core.removed(self->x)) { /* removed while we settled our copies */
                PyObject *t = PyObject_CallMethodNoArgs((PyObject *)self, s_published_removed);
                if (t == NULL) goto done;
                Py_DECREF(t);
            }
            core.note(self->x, r->idx, r->nidx, r->n);
            res = published(r, seqs);
        done:
            Py_DECREF(cap);
            return res;
        }
        /* full, stalled, no transaction slot, removed, an error: nothing was published */
    }
    Py_XDECREF(cap);
    PyObject *sargs[6] = {(PyObject *)self, a[0], rk, a[2] ? a[2] : empty_tuple, a[3], a[4]};
    return PyObject_VectorcallMethod(s_publish_slow, sargs, 6, NULL);
}

/* _fast_attach(exchange_address, owner): publish through the shm_exch at that address,
 * which `owner` keeps mapped; forgets every route. */
static PyObject *Publisher_fast_attach(PublisherObject *self, PyObject *args) {
    unsigned long long addr;
    PyObject *owner;
    if (!PyArg_ParseTuple(args, "KO", &addr, &owner)) return NULL;
    if (core.publish == NULL) return PyErr_Format(PyExc_RuntimeError, "bind_exchange() first");
    PyObject *routes = PyDict_New();
    if (routes == NULL) return NULL;
    Publisher_clear(self);
    self->x = (shm_exch *)(uintptr_t)addr;
    self->owner = Py_NewRef(owner);
    self->routes = routes;
    self->version = UINT64_MAX; /* no route yet */
    Py_RETURN_NONE;
}

/* _fast_clear(): no fast path until the next _fast_attach. */
static PyObject *Publisher_fast_clear(PublisherObject *self, PyObject *unused) {
    Publisher_clear(self);
    Py_RETURN_NONE;
}

/* _fast_route(routing_key, version, segments, names, bindings): from now on, while the
 * bindings' version is `version`, routing_key goes to segments[i] (its channel called
 * names[i], in the order exch_publish writes them) through the table entries `bindings`.
 * Routes of another version are dropped. No segments: routing_key has no fast route (it
 * goes nowhere, or to a missing channel). */
static PyObject *Publisher_fast_route(PublisherObject *self, PyObject *args) {
    PyObject *rk, *segs, *names, *idx;
    unsigned long long version;
    if (!PyArg_ParseTuple(args, "UKO!O!O!", &rk, &version, &PyList_Type, &segs, &PyList_Type,
                          &names, &PyList_Type, &idx))
        return NULL;
    if (self->routes == NULL) Py_RETURN_NONE; /* closed meanwhile */
    Py_ssize_t n = PyList_GET_SIZE(segs), ni = PyList_GET_SIZE(idx);
    if (n == 0) {
        if (version == self->version && PyDict_DelItem(self->routes, rk) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) return NULL;
            PyErr_Clear();
        }
        Py_RETURN_NONE;
    }
    if (n > EXCH_MAX_BINDINGS || PyList_GET_SIZE(names) != n || ni > EXCH_MAX_BINDINGS)
        return PyErr_Format(PyExc_ValueError, "_fast_route: at most %d channels, one name each",
                            EXCH_MAX_BINDINGS);
    route *r = PyMem_Calloc(1, sizeof *r);
    if (r == NULL) return PyErr_NoMemory();
    r->segs = PyMem_Calloc((size_t)n, sizeof *r->segs);
    r->chans = PyMem_Calloc((size_t)n, sizeof *r->chans);
    r->names = PyMem_Calloc((size_t)n, sizeof *r->names);
    r->idx = PyMem_Calloc((size_t)(ni ? ni : 1), sizeof *r->idx);
    if (!r->segs || !r->chans || !r->names || !r->idx) {
        route_free(r);
        return PyErr_NoMemory();
    }
    r->max_keys = UINT32_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(segs, i), *nm = PyList_GET_ITEM(names, i);
        if (!PyObject_TypeCheck(s, &SegmentType) || ((SegmentObject *)s)->c == NULL ||
            !PyUnicode_CheckExact(nm)) {
            r->n = (uint32_t)i;
            route_free(r);
            return PyErr_Format(PyExc_TypeError, "_fast_route: bound segments and str names");
        }
        r->segs[i] = (SegmentObject *)Py_NewRef(s);
        r->names[i] = Py_NewRef(nm);
        r->chans[i] = r->segs[i]->c;
        if (r->segs[i]->max_keys < r->max_keys) r->max_keys = r->segs[i]->max_keys;
    }
    r->n = (uint32_t)n;
    for (Py_ssize_t i = 0; i < ni; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(idx, i));
        if (PyErr_Occurred()) {
            route_free(r);
            return NULL;
        }
        r->idx[i] = (uint32_t)v;
    }
    r->nidx = (uint32_t)ni;
    PyObject *cap = PyCapsule_New(r, "shmchan.route", route_capsule_free);
    if (cap == NULL) {
        route_free(r);
        return NULL;
    }
    if (version != self->version || PyDict_GET_SIZE(self->routes) >= ROUTES_MAX) {
        PyDict_Clear(self->routes);
        self->version = version;
    }
    int rc = PyDict_SetItem(self->routes, rk, cap);
    Py_DECREF(cap);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Publisher_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))Publisher_publish, METH_FASTCALL | METH_KEYWORDS,
     "publish(payload, routing_key='', keys=(), timeout=None, *, mandatory=False) -> "
     "Published\n\n"
     "Send `payload` with `keys` to every channel whose binding matches `routing_key`, all\n"
     "or nothing. Returns a Published: {channel name: the seq its copy got}, empty if\n"
     "nothing matched, and in `.missing` the matched channels that do not exist (removed,\n"
     "not yet created again): they got no copy. With `mandatory=True` that is refused\n"
     "instead: Unroutable if nothing matched or a matched channel is missing, and no\n"
     "channel gets the message. Full (after `timeout`) if some matched channel stayed\n"
     "full: then no channel got it."},
    {"_fast_attach", (PyCFunction)Publisher_fast_attach, METH_VARARGS,
     "_fast_attach(exchange_address, owner): publish through that exchange"},
    {"_fast_route", (PyCFunction)Publisher_fast_route, METH_VARARGS,
     "_fast_route(routing_key, version, segments, names, bindings): remember a route"},
    {"_fast_clear", (PyCFunction)Publisher_fast_clear, METH_NOARGS,
     "_fast_clear(): forget the exchange and every route"},
    {NULL},
};

PyTypeObject PublisherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.PublisherBase",
    .tp_basicsize = sizeof(PublisherObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Exchange.publish's fast path (subclassed by shmchan.Exchange)",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Publisher_dealloc,
    .tp_methods = Publisher_methods,
};

/* bind_exchange(publish, version, removed, note, published_type): the addresses of the
 * core's exch_publish, exch_version, exch_removed and exch_note in the loaded cffi module,
 * and the result type, a dict subclass with a `missing` slot. */
static PyObject *bind_exchange(PyObject *mod, PyObject *args) {
    unsigned long long fp[4];
    PyObject *ptype;
    if (!PyArg_ParseTuple(args, "KKKKO!", &fp[0], &fp[1], &fp[2], &fp[3], &PyType_Type, &ptype))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)ptype, &PyDict_Type))
        return PyErr_Format(PyExc_TypeError, "the result type must subclass dict");
    for (int i = 0; i < 4; i++)
        if (fp[i] == 0) return PyErr_Format(PyExc_ValueError, "a core function's address is 0");
    core.publish = (exch_publish_fn)(uintptr_t)fp[0];
    core.version = (exch_version_fn)(uintptr_t)fp[1];
    core.removed = (exch_removed_fn)(uintptr_t)fp[2];
    core.note = (exch_note_fn)(uintptr_t)fp[3];
    Py_XSETREF(published_type, (PyTypeObject *)Py_NewRef(ptype));
    Py_RETURN_NONE;
}

static PyMethodDef publish_functions[] = {
    {"bind_exchange", bind_exchange, METH_VARARGS,
     "bind_exchange(publish, version, removed, note, published_type): wire up\n"
     "Exchange.publish's fast path (the addresses of exch_publish, exch_version,\n"
     "exch_removed and exch_note)"},
    {NULL},
};

/* Called once by the module's init: the type and bind_exchange(). */
int hot_publish_init(PyObject *m) {
    if ((s_publish_slow = PyUnicode_InternFromString("_publish_slow")) == NULL ||
        (s_published_removed = PyUnicode_InternFromString("_published_removed")) == NULL ||
        (s_missing = PyUnicode_InternFromString("missing")) == NULL ||
        (empty_tuple = PyTuple_New(0)) == NULL ||
        (empty_str = PyUnicode_FromStringAndSize("", 0)) == NULL)
        return -1;
    if (PyType_Ready(&PublisherType) < 0) return -1;
    if (PyModule_AddFunctions(m, publish_functions) < 0) return -1;
    return PyModule_AddObjectRef(m, "PublisherBase", (PyObject *)&PublisherType);
}
