/* hotpath.c -- the per-message calls (send, recv, payload, release) as CPython types,
 * so that each one is a single C call with no Python frame around it.
 *
 * Why this is not cffi like the rest: a cffi call costs about 100 ns before any work
 * (argument conversion, errno save, GIL release) and a Handle built in Python from the
 * core's description cost about 1.4 us (measured). At millions of messages
 * per second that is the whole budget. Here `Receiver.recv` builds the Handle in C,
 * `Handle.payload` copies the bytes in C, `Handle.release` and `Sender.send` encode
 * and call straight into the core.
 *
 * What this file is not: it holds no shared-memory protocol. It calls the core through
 * function pointers that the Python layer takes from the cffi module it loaded (so an
 * instrumented build of the core, e.g. under AddressSanitizer, is the one exercised
 * here too), and it reads the segment only to copy a payload whose offset and length
 * the core validated, accepting the copy only if the core's seqlock check
 * (shm_unmoved, csrc/handles.c) says the record did not move meanwhile.
 *
 * Everything off the fast path -- a full channel, a pickled payload, an unusual key,
 * a closed object, maintenance, an error to raise -- is handed to a Python method of
 * the same object (`_send_slow`, `_recv_slow`, `_released`, ...), so each behaviour
 * is decided in one place, shmchan/channel.py. What C does besides calling the core:
 * post and wait on the channel's two named semaphores (sem_open'ed by name, the same
 * ones posix_ipc opened), with the GIL released while waiting.
 *
 * The classes here are bases: shmchan.channel subclasses each (Segment, Sender,
 * Receiver, Handle) and adds everything that is not per-message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "shmchan.h"

/* ---------------------------------------------------------------------------------
 * the core's entry points, set once by bind() from the loaded cffi module
 * --------------------------------------------------------------------------------- */
typedef int (*send_fn)(shm_chan *, uint32_t, const char *, uint64_t, const char *, uint32_t,
                       uint32_t, uint64_t *, shm_stall *, int *);
typedef int (*recv_fn)(shm_chan *, shm_msg *, uint32_t, uint32_t *, int, shm_stall *,
                       uint32_t *);
typedef int (*release_fn)(shm_chan *, uint32_t, uint32_t, int);
typedef int (*release_many_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t, int *);
typedef int (*unmoved_fn)(shm_chan *, uint32_t, uint64_t, uint64_t);
typedef int (*rx_spin_fn)(shm_chan *, uint32_t);
typedef int (*view_fn)(shm_chan *, uint32_t, uint32_t, shm_msg *);
typedef int (*send_many_handles_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t,
                                    int32_t *);
typedef int (*adopt_many_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t, uint64_t,
                             shm_msg *, int32_t *);
typedef int (*send_many_fn)(shm_chan *, uint32_t, const uint32_t *, const char *, uint64_t,
                            const uint64_t *, const char *, uint64_t, const uint32_t *,
                            const uint32_t *, uint64_t *, uint32_t *, shm_stall *, int *);

static struct {
    send_fn send;
    recv_fn recv;
    release_fn release;
    release_many_fn release_many;
    unmoved_fn unmoved;
    rx_spin_fn rx_spin;
    send_many_fn send_many;
    view_fn handle_view;
    send_many_handles_fn handle_send_many;
    adopt_many_fn handle_adopt_many;
} core;

static PyTypeObject *handle_type;   /* shmchan.Handle (a subclass of HandleBase)      */
static PyObject *encode_payload_fn; /* shmchan.codec.encode_payload, for pickling     */
static PyObject *encode_keys_fn;    /* shmchan.codec.encode_keys, for unusual keys    */
/* shmchan.InvalidArgument (a ValueError) and shmchan.UnsupportedType (a TypeError), for
 * the caller's mistakes found here; the builtins until bind() sets them */
static PyObject *exc_invalid, *exc_type;
#define EXC_INVALID (exc_invalid ? exc_invalid : PyExc_ValueError)
#define EXC_TYPE (exc_type ? exc_type : PyExc_TypeError)

/* interned names of the Python-side slow paths */
static PyObject *s_maintain, *s_send_slow, *s_recv_slow, *s_recv_many_slow, *s_release_many_slow,
    *s_released, *s_payload_slow, *s_data_slow, *s_keys_slow;

#define MAX_BATCH 65536u   /* messages one recv_many call takes at most */
#define SPIN_SECONDS 50e-6 /* longest spin before sleeping (as channel._SPIN_SECONDS) */
#define SPIN_PAUSES 500u   /* CPU pauses per spin round (as channel._SPIN_PAUSES)     */
#define KEY_BUF 2048u      /* key blob bytes the fast path encodes; longer -> Python */

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock time.monotonic() reads */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Keyword-aware parsing for METH_FASTCALL: fills out[0..nmax) from positional and
 * keyword arguments; out[] holds the defaults on entry. */
static int parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames, const char *const *names, int nreq, int nmax,
                      PyObject **out) {
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nmax,
                     nargs);
        return -1;
    }
    char given[8] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = args[i];
        given[i] = 1;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < nmax && PyUnicode_CompareWithASCIIString(kw, names[j]) != 0) j++;
        if (j == nmax) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname,
                         kw);
            return -1;
        }
        if (given[j]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[j]);
            return -1;
        }
        out[j] = args[nargs + k];
        given[j] = 1;
    }
    for (int j = 0; j < nreq; j++) {
        if (!given[j]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                         names[j]);
            return -1;
        }
    }
    return 0;
}

/* A timeout the fast path may ignore: None or a non-negative number. Anything else goes
 * to the slow path, which raises the right error. */
static int timeout_plain(PyObject *t) {
    if (t == Py_None) return 1;
    if (PyFloat_CheckExact(t)) return PyFloat_AS_DOUBLE(t) >= 0.0;
    if (PyLong_CheckExact(t)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return overflow > 0 || (overflow == 0 && v >= 0);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------
 * SegmentBase: one process's attachment, as the hot path needs it
 * --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    shm_chan *c;
    const uint8_t *base;  /* start of the mapping                                  */
    uint64_t size;        /* bytes mapped from base                                */
    uint32_t max_keys;
    char raw_only;        /* serializer="raw"                                      */
    char registered;      /* this process holds a producer registry entry; cleared
                             when the owning Channel is closed, so also "may send"  */
    long pid;             /* the process this attachment belongs to (fork check)   */
    PyObject *detached;   /* list [bool], True once the mapping is gone             */
    PyObject *mem;        /* read-only memoryview of the whole mapping (its owner)   */
    sem_t *rx_sem;        /* the receiver's semaphore, posted when a send wakes it  */
    sem_t *tx_sem;        /* the senders' semaphore (waiting for space)             */
    unsigned long long tx_posts; /* posts of tx_sem by wake_sender: a count for tests  */
} SegmentObject;

static PyTypeObject SegmentType;

static int seg_detached(SegmentObject *s) {
    PyObject *d = s->detached;
    return d == NULL || !PyList_Check(d) || PyList_GET_SIZE(d) < 1 ||
           PyList_GET_ITEM(d, 0) != Py_False;
}

#define WAKE_RX_BIT (1 << 8) /* shm_release's wake-up requests (csrc/handles.c) */
#define WAKE_TX_BIT (1 << 9)

/* Post n times (at most 64: each sleeper needs one, and more are only spurious). */
static void post_n(sem_t *sem, unsigned n) {
    for (unsigned i = 0; sem != NULL && i < n && i < 64; i++) sem_post(sem);
}

/* Wake one sender waiting for space, unless an earlier post is still unconsumed: that one
 * already makes a waiter look again (the rationing rule, csrc/ring.c). sem_getvalue reads
 * the count without a system call. */
static void wake_sender(SegmentObject *seg) {
    int v = 0;
    if (seg->tx_sem == NULL || (sem_getvalue(seg->tx_sem, &v) == 0 && v > 0)) return;
    sem_post(seg->tx_sem);
    seg->tx_posts++;
}

/* Post what a release asked for: bit 8 the receiver, bit 9 one sender. */
static void post_wakeups(SegmentObject *seg, int r) {
    if (r & WAKE_RX_BIT) post_n(seg->rx_sem, 1);
    if (r & WAKE_TX_BIT) wake_sender(seg);
}

static PyObject *Segment_bind(SegmentObject *self, PyObject *args) {
    unsigned long long ptr, base, size;
    unsigned int max_keys;
    int raw_only;
    PyObject *detached, *mem;
    const char *rx_name, *tx_name;
    if (!PyArg_ParseTuple(args, "KKKIpO!O!ss", &ptr, &base, &size, &max_keys, &raw_only,
                          &PyList_Type, &detached, &PyMemoryView_Type, &mem, &rx_name,
                          &tx_name))
        return NULL;
    if (core.send == NULL || handle_type == NULL)
        return PyErr_Format(PyExc_RuntimeError, "_shmchan_hot.bind() was not called");
    if (ptr == 0 || base == 0) return PyErr_Format(PyExc_ValueError, "NULL attachment");
    self->c = (shm_chan *)(uintptr_t)ptr;
    self->base = (const uint8_t *)(uintptr_t)base;
    self->size = size;
    self->max_keys = max_keys;
    self->raw_only = (char)raw_only;
    Py_XSETREF(self->detached, Py_NewRef(detached));
    Py_XSETREF(self->mem, Py_NewRef(mem));
    /* The same named semaphores the Python layer opened (the process shares one mapping
     * of each): a send that must wake the receiver posts without Python, and every wait
     * goes through Segment_wait. */
    sem_t *rx = sem_open(rx_name, 0);
    if (rx == SEM_FAILED) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, rx_name);
    sem_t *tx = sem_open(tx_name, 0);
    if (tx == SEM_FAILED) {
        sem_close(rx);
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, tx_name);
    }
    if (self->rx_sem) sem_close(self->rx_sem);
    if (self->tx_sem) sem_close(self->tx_sem);
    self->rx_sem = rx;
    self->tx_sem = tx;
    Py_RETURN_NONE;
}

/* Sleep on a semaphore until it is posted or `deadline` (CLOCK_MONOTONIC seconds)
 * passes, with the GIL released. A signal ends the wait after its Python handler ran;
 * if the handler raised, returns -1 with that exception (as PEP 475 has system calls
 * do). 0 otherwise: the caller re-checks whatever it waits for either way. */
static int sem_sleep(sem_t *sem, double deadline) {
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    int r, err;
    Py_BEGIN_ALLOW_THREADS
    r = sem_clockwait(sem, CLOCK_MONOTONIC, &ts);
    err = errno;
    Py_END_ALLOW_THREADS
    if (r < 0 && err == EINTR && PyErr_CheckSignals() < 0) return -1;
    return 0;
}

/* wait(which, seconds): which 0 = the receiver's semaphore, 1 = the senders'. */
static PyObject *Segment_wait(SegmentObject *self, PyObject *args) {
    int which;
    double seconds;
    if (!PyArg_ParseTuple(args, "id", &which, &seconds)) return NULL;
    sem_t *sem = which ? self->tx_sem : self->rx_sem;
    if (sem == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    if (sem_sleep(sem, monotonic() + (seconds > 0 ? fmin(seconds, 1e6) : 0.0)) < 0) return NULL;
    Py_RETURN_NONE;
}

/* post(which, n): post the receiver's (0) or the senders' (1) semaphore n times (at
 * most 64): the one place the Python layer wakes anyone. */
static PyObject *Segment_post(SegmentObject *self, PyObject *args) {
    int which;
    unsigned int n;
    if (!PyArg_ParseTuple(args, "iI", &which, &n)) return NULL;
    sem_t *sem = which ? self->tx_sem : self->rx_sem;
    if (sem == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    post_n(sem, n);
    Py_RETURN_NONE;
}

/* wake_sender(): wake one sender waiting for space, unless a post is still pending. */
static PyObject *Segment_wake_sender(SegmentObject *self, PyObject *unused) {
    if (self->tx_sem == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    wake_sender(self);
    Py_RETURN_NONE;
}

static void Segment_dealloc(SegmentObject *self) {
    if (self->rx_sem) sem_close(self->rx_sem);
    if (self->tx_sem) sem_close(self->tx_sem);
    Py_CLEAR(self->detached);
    Py_CLEAR(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Segment_methods[] = {
    {"_bind", (PyCFunction)Segment_bind, METH_VARARGS,
     "_bind(ptr, base, size, max_keys, raw_only, detached, mem, rx_semaphore, tx_semaphore):\n"
     "what the hot path reads"},
    {"post", (PyCFunction)Segment_post, METH_VARARGS,
     "post(which, n): post the receiver's (0) or the senders' (1) semaphore n times\n"
     "(at most 64)."},
    {"wake_sender", (PyCFunction)Segment_wake_sender, METH_NOARGS,
     "wake_sender(): post the senders' semaphore once, unless a post is still pending."},
    {"wait", (PyCFunction)Segment_wait, METH_VARARGS,
     "wait(which, seconds): sleep on the receiver's (0) or the senders' (1) semaphore\n"
     "until posted or seconds pass; a signal handler's exception propagates."},
    {NULL},
};

static PyMemberDef Segment_members[] = {
    {"registered", T_BOOL, offsetof(SegmentObject, registered), 0,
     "this process holds a producer registry entry"},
    {"pid", T_LONG, offsetof(SegmentObject, pid), 0, "the process this attachment is for"},
    {"tx_posts", T_ULONGLONG, offsetof(SegmentObject, tx_posts), READONLY,
     "times this process woke a sender waiting for space (wake_sender)"},
    {NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.SegmentBase",
    .tp_basicsize = sizeof(SegmentObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "One process's attachment to a channel, as the hot path reads it.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Segment_dealloc,
    .tp_methods = Segment_methods,
    .tp_members = Segment_members,
};

/* Setter shared by Sender._seg and Receiver._seg: None or a SegmentBase. */
static int set_seg(SegmentObject **slot, PyObject *v) {
    if (v == NULL || v == Py_None) {
        Py_CLEAR(*slot);
        return 0;
    }
    if (!PyObject_TypeCheck(v, &SegmentType) || ((SegmentObject *)v)->c == NULL) {
        PyErr_SetString(PyExc_TypeError, "_seg must be a bound segment or None");
        return -1;
    }
    Py_XSETREF(*slot, (SegmentObject *)Py_NewRef(v));
    return 0;
}

static PyObject *get_seg(SegmentObject *s) { return Py_NewRef(s ? (PyObject *)s : Py_None); }

/* ---------------------------------------------------------------------------------
 * HandleBase: a message on loan
 * --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg;
    uint32_t slot, gen;     /* the handle's identity in the core                    */
    unsigned long long seq, attempt, kind, data_off, data_len, keys_off, keys_len, nkeys, pos,
        word;               /* the core's description (shm_msg), see shmchan.h       */
    PyObject *keys;         /* decoded keys, once asked for                          */
    PyObject *payload;      /* the payload object, once asked for                     */
    char done;              /* released, nacked or handed over as already gone       */
    long pid;               /* releases on collection only in this process; -1 after
                               it was pickled away (hand-over)                       */
} HandleObject;

static PyTypeObject HandleType;

static PyObject *make_handle(SegmentObject *seg, const shm_msg *m) {
    HandleObject *h = (HandleObject *)handle_type->tp_alloc(handle_type, 0);
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
static int release_core(HandleObject *h, int nack) {
    h->done = 1;
    SegmentObject *seg = h->seg;
    if (seg == NULL || seg_detached(seg)) return SHM_STALE; /* the mapping went first */
    int r = core.release(seg->c, h->slot, h->gen, nack);
    if (r <= 0) return r;
    post_wakeups(seg, r);
    return r & 0xFF;
}

/* Release (nack = 0) or give back (nack = 1) once. Returns a new bool reference (True if
 * this call released a current handle) or NULL with an exception set. */
static PyObject *handle_finish(HandleObject *h, int nack) {
    if (h->done) Py_RETURN_FALSE;
    int r = release_core(h, nack);
    if (r == SHM_OK) Py_RETURN_TRUE;
    if (r > 0) Py_RETURN_FALSE; /* stale: released, redelivered or revoked meanwhile */
    PyObject *code = PyLong_FromLong(r); /* an error: Handle._released raises it */
    if (code == NULL) return NULL;
    PyObject *res = PyObject_CallMethodOneArg((PyObject *)h, s_released, code);
    Py_DECREF(code);
    return res;
}

static void Handle_dealloc(PyObject *self) {
    HandleObject *h = (HandleObject *)self;
    /* Collected while held, in the process that holds it: release it. Nothing here runs
     * Python code (so no finalizer and no resurrection), and there is nobody to tell
     * about an error. A handle pickled away has pid -1; one inherited by a forked child
     * has the parent's pid, not the child's segment pid. */
    if (!h->done && h->seg != NULL && h->pid == h->seg->pid) (void)release_core(h, 0);
    Py_CLEAR(h->seg);
    Py_CLEAR(h->keys);
    Py_CLEAR(h->payload);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *Handle_release(HandleObject *h, PyObject *unused) {
    if (h->done) Py_RETURN_NONE;
    PyObject *res = handle_finish(h, 0);
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
        if (core.unmoved(seg->c, h->slot, h->word, h->pos) == SHM_OK) {
            h->payload = Py_NewRef(b);
            return b;
        }
        Py_DECREF(b);
    }
    PyObject *v = PyObject_CallMethodNoArgs((PyObject *)h, s_payload_slow);
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
        return PyObject_CallMethodNoArgs((PyObject *)h, s_data_slow);
    int rc = core.handle_view(seg->c, h->slot, h->gen, &m);
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

/* One key of a blob (codec.py's encoding: a tag byte and its body). Returns a new
 * reference, or NULL without an exception for what only codec.py decodes (or rejects):
 * ints of more than 8 bytes, unknown tags, bad UTF-8. */
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
    }
    if (k == NULL) PyErr_Clear();
    return k;
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
    if (core.unmoved(seg->c, h->slot, h->word, h->pos) != SHM_OK) goto slow; /* moved */
    t = PyTuple_New((Py_ssize_t)n);
    if (t == NULL) return NULL;
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        if (len - off < 2) goto slow;
        size_t size = (size_t)buf[off] | ((size_t)buf[off + 1] << 8);
        if (size == 0 || size > len - off - 2) goto slow;
        PyObject *k = key_decode(buf + off + 2, size);
        if (k == NULL) goto slow;
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, k);
        off += 2 + size;
    }
    if (off != len) goto slow;
    h->keys = Py_NewRef(t);
    return t;
slow:
    Py_XDECREF(t);
    t = PyObject_CallMethodNoArgs((PyObject *)h, s_keys_slow);
    if (t != NULL && h->keys == NULL) h->keys = Py_NewRef(t);
    return t;
}

static PyObject *Handle_get_seg(HandleObject *h, void *closure) { return get_seg(h->seg); }

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

static PyTypeObject HandleType = {
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
static PyObject *handles_from(PyObject *mod, PyObject *args) {
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
        PyObject *h = make_handle((SegmentObject *)seg, &m[made]);
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
            (void)release_core((HandleObject *)PyList_GET_ITEM(out, i), 1);
            continue;
        }
        int r = core.release(((SegmentObject *)seg)->c, (uint32_t)m[i].slot, (uint32_t)m[i].gen, 1);
        if (r > 0) post_wakeups((SegmentObject *)seg, r);
    }
    Py_XDECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------------------------
 * BatchBase: many messages on loan as one object (Receiver.recv_batch)
 *
 * A batch keeps the core's descriptions (shm_msg) of its messages in one C array and
 * creates a Python object for a message only when asked for one (payload(i), keys(i),
 * handle(i)); seqs, attempts and lengths come as memoryviews over one buffer each, and
 * joined() copies every payload into one bytes object. Its messages are released or
 * given back as a whole or in part, each exactly once, with one core call per call;
 * whatever is still held when the batch is collected (in the process that received
 * it) is released, as a Handle's message would be.
 * --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg;
    Py_ssize_t n;     /* messages                                                   */
    Py_ssize_t left;  /* of them not yet released, given back or handed to a Handle */
    long pid;         /* releases on collection only in this process                */
    shm_msg *msgs;    /* the core's descriptions                                    */
    char *done;       /* per message: released, given back or handed to a Handle    */
} BatchObject;

static PyTypeObject BatchType;
static PyTypeObject *batch_type = &BatchType; /* shmchan.Batch once bound */

static PyObject *batch_new(SegmentObject *seg, const shm_msg *msgs, Py_ssize_t n) {
    BatchObject *b = (BatchObject *)batch_type->tp_alloc(batch_type, 0);
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

/* Release (nack = 0) or give back (nack = 1) the listed messages that are still held;
 * idx NULL = all of them. Returns the core's status (errors < 0), wake-ups posted. */
static int batch_finish_core(BatchObject *b, const Py_ssize_t *idx, Py_ssize_t k, int nack) {
    SegmentObject *seg = b->seg;
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
            int r = core.release(seg->c, (uint32_t)b->msgs[i].slot, (uint32_t)b->msgs[i].gen,
                                 nack);
            if (r > 0) post_wakeups(seg, r);
            else if (r < 0) rc = r;
            continue;
        }
        slots[m] = (uint32_t)b->msgs[i].slot;
        gens[m] = (uint32_t)b->msgs[i].gen;
        m++;
    }
    if (m && !nack) {
        int wake = 0;
        rc = core.release_many(seg->c, slots, gens, m, &wake);
        if (wake & 1) post_n(seg->rx_sem, 1);
        if (wake & 2) wake_sender(seg);
    } else if (m) { /* nacks, one core call each (rare: a batch given back) */
        for (uint32_t j = 0; j < m; j++) {
            int r = core.release(seg->c, slots[j], gens[j], 1);
            if (r > 0) post_wakeups(seg, r);
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
    HandleObject *h = (HandleObject *)make_handle(b->seg, &b->msgs[i]);
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
        if (core.unmoved(seg->c, (uint32_t)m->slot, m->word, m->pos) == SHM_OK) return v;
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
    for (Py_ssize_t i = 0; i < b->n; i++) {
        shm_msg *m = &b->msgs[i];
        int ok = m->data_off <= seg->size && m->data_len <= seg->size - m->data_off;
        if (ok) {
            memcpy(p, seg->base + m->data_off, (size_t)m->data_len);
            ok = core.unmoved(seg->c, (uint32_t)m->slot, m->word, m->pos) == SHM_OK;
        }
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
    if (parse_args(fname, args, nargs, kwnames, names, 0, 1, a) < 0) return NULL;
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
    PyObject *h = make_handle(b->seg, &b->msgs[i]);
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

static PyTypeObject BatchType = {
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
static PyObject *batch_from_handles(PyObject *mod, PyObject *args) {
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
    PyObject *b = batch_new((SegmentObject *)seg, msgs, n);
    PyMem_Free(msgs);
    if (b == NULL) return NULL; /* the handles still hold their messages */
    for (Py_ssize_t i = 0; i < n; i++) ((HandleObject *)PyList_GET_ITEM(hs, i))->done = 1;
    return b;
}

/* ---------------------------------------------------------------------------------
 * ReceiverBase: recv, recv_many, release_many
 * --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg;       /* NULL once closed                                  */
    double next_maintenance;  /* time.monotonic() when recv() must run maintain()  */
    double spin;              /* seconds to spin before sleeping (adaptive, wait_for) */
    shm_msg *msgs;            /* the core's descriptions land here                */
    uint32_t nmsgs;
} ReceiverObject;

static int ensure_msgs(ReceiverObject *r, uint32_t n) {
    if (n <= r->nmsgs) return 0;
    shm_msg *m = PyMem_Realloc(r->msgs, (size_t)n * sizeof(shm_msg));
    if (m == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->msgs = m;
    r->nmsgs = n;
    return 0;
}


/* The core handed out msgs[from..got) but they cannot become Handles (out of memory):
 * give them back (as a nack: they are redelivered with attempt + 1) rather than leave
 * them held by this process, where nothing would ever release them. */
static void give_back(SegmentObject *seg, const shm_msg *msgs, uint32_t from, uint32_t got) {
    for (uint32_t i = from; i < got; i++) {
        int r = core.release(seg->c, (uint32_t)msgs[i].slot, (uint32_t)msgs[i].gen, 1);
        if (r > 0) post_wakeups(seg, r);
    }
}

/* One non-blocking poll of seg (the receiver's segment, referenced by the caller) for
 * up to n messages. Returns a new list (possibly empty) or NULL with an exception; on
 * failure nothing stays handed out. */
static PyObject *poll_fast(ReceiverObject *self, SegmentObject *seg, uint32_t n, int arm,
                           int *rc) {
    if (ensure_msgs(self, n) < 0) return NULL;
    uint32_t got = 0, wake = 0;
    shm_stall stall;
    *rc = core.recv(seg->c, self->msgs, n, &got, arm, &stall, &wake);
    if (wake) wake_sender(seg);
    PyObject *out = PyList_New(got);
    if (out == NULL) {
        give_back(seg, self->msgs, 0, got);
        return NULL;
    }
    for (uint32_t i = 0; i < got; i++) {
        PyObject *h = make_handle(seg, &self->msgs[i]);
        if (h == NULL) {
            give_back(seg, self->msgs, i, got);
            for (uint32_t j = 0; j < i; j++) /* made already: nack them too, then drop */
                release_core((HandleObject *)PyList_GET_ITEM(out, j), 1);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, h);
    }
    return out;
}

/* poll_fast for one message, without the list (a list per call would also feed the
 * cyclic garbage collector's allocation count). Returns a new Handle, or NULL: with
 * an exception set on error, without one if nothing was ready (*rc says why). */
static PyObject *poll_one(ReceiverObject *self, SegmentObject *seg, int arm, int *rc) {
    if (ensure_msgs(self, 1) < 0) return NULL;
    uint32_t got = 0, wake = 0;
    shm_stall stall;
    *rc = core.recv(seg->c, self->msgs, 1, &got, arm, &stall, &wake);
    if (wake) wake_sender(seg);
    if (!got) return NULL;
    PyObject *h = make_handle(seg, &self->msgs[0]);
    if (h == NULL) give_back(seg, self->msgs, 0, 1);
    return h;
}

/* recv's (and recv_many's) wait for the plain case, so that an idle receiver wakes
 * straight into C: the channel is empty (SHM_EMPTY) or upkeep is due before the first
 * poll (it runs first, below), and the deadline is not due. Same
 * protocol as Receiver._poll: spin a little, arm the eventcount (shm_recv with arm_sleep
 * re-checks after announcing the sleep), then sleep on the semaphore, until a post, the
 * deadline or the next maintenance; maintenance runs in place (Receiver.maintain) and
 * the wait goes on, so the wake-up after it is as quick as any. The GIL is released
 * while spinning and sleeping; the segment is held by a reference of our own, and if
 * another thread closed the receiver meanwhile, Receiver._poll takes over (and says so).
 *
 * The spin adapts, as adaptive mutexes do: it is worth its CPU only when messages come
 * within it. A spin that runs out halves the next one (down to none); a sleep that is
 * woken within SPIN_SECONDS restores it. So a busy receiver spins instead of paying a
 * wake-up per message, and a receiver idle between rare messages sleeps at once --
 * which also leaves its CPU free for the sender it is waiting for.
 * Returns a new Handle (for recv: n == 0) or a non-empty list of at most n of them (for
 * recv_many); or NULL with an exception (a signal handler raised); or NULL without one
 * when Receiver._poll must take over (any other status, closed, or time is up). */
static PyObject *wait_for(ReceiverObject *self, uint32_t n, double deadline) {
    SegmentObject *seg = self->seg;
    if (seg == NULL || seg->rx_sem == NULL) return NULL;
    Py_INCREF(seg);
    double spin_until = monotonic() + self->spin, stall_until = 0.0;
    int arm = 0, rc;
    PyObject *h = NULL;
    for (;;) {
        double now = monotonic();
        if (self->seg != seg || now >= deadline) break;
        if (now >= self->next_maintenance) {
            /* Upkeep in place (Receiver.maintain), then back to waiting here: a message
             * that comes after it is still handed out by this path, not Python's. */
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, s_maintain);
            if (r == NULL) break; /* its exception is ours */
            Py_DECREF(r);
            if (self->seg != seg || monotonic() >= self->next_maintenance) break;
            continue;
        }
        if (n == 0) {
            h = poll_one(self, seg, arm, &rc);
        } else {
            h = poll_fast(self, seg, n, arm, &rc);
            if (h != NULL && PyList_GET_SIZE(h) == 0) Py_CLEAR(h);
        }
        if (h != NULL || PyErr_Occurred()) break;
        if (rc == SHM_AGAIN) continue; /* records arrived meanwhile: look at them first */
        if (rc == SHM_STALLED && !arm) {
            /* Stalled on a record being claimed: its producer is most likely a few
             * instructions from committing it, so spin through the stall, for up to
             * SPIN_SECONDS from its start whatever the adaptive spin says (it may be
             * down to none).
             * Slept on instead, the commit had to post us: a receiver that kept up
             * with its producer ran at half the rate of one that lagged.
             * A stall that outlasts the spin goes to Receiver._poll, which sleeps on
             * it and sees to a dead claimant. */
            if (stall_until == 0.0) stall_until = now + SPIN_SECONDS;
            if (now >= stall_until) break;
            Py_BEGIN_ALLOW_THREADS
            core.rx_spin(seg->c, SPIN_PAUSES);
            Py_END_ALLOW_THREADS
            continue;
        }
        if (rc != SHM_EMPTY) break; /* else: still empty */
        stall_until = 0.0;          /* a later stall gets its own spin */
        if (!arm) {
            if (now < spin_until) {
                Py_BEGIN_ALLOW_THREADS
                core.rx_spin(seg->c, SPIN_PAUSES);
                Py_END_ALLOW_THREADS
            } else {
                self->spin = self->spin < 2e-6 ? 0.0 : self->spin / 2; /* it did not pay */
                arm = 1; /* poll once more with the sleep announced */
            }
            continue;
        }
        if (sem_sleep(seg->rx_sem, fmin(deadline, self->next_maintenance)) < 0) break;
        if (monotonic() - now < SPIN_SECONDS) self->spin = SPIN_SECONDS; /* woken soon */
    }
    Py_DECREF(seg);
    return h;
}

/* Is the one-poll fast path allowed: open, and maintenance not due? The coarse clock
 * (a few ms behind, no TSC read) is precise enough for a deadline 0.1 s away. */
static int fast_ok(ReceiverObject *self) {
    if (self->seg == NULL) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 < self->next_maintenance;
}

static PyObject *Receiver_recv(ReceiverObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"timeout"};
    PyObject *a[1] = {Py_None};
    if (parse_args("recv", args, nargs, kwnames, names, 0, 1, a) < 0) return NULL;
    PyObject *timeout = a[0];
    if (timeout_plain(timeout) && self->seg != NULL) {
        /* With upkeep due, no poll here: wait_for runs it first (its redeliveries go
         * before newer messages), then polls. The first recv after a pause longer than
         * the upkeep period so still wakes in C, not in Receiver._poll. */
        int rc = SHM_EMPTY;
        if (fast_ok(self)) {
            PyObject *h = poll_one(self, self->seg, 0, &rc);
            if (h != NULL || PyErr_Occurred()) return h;
            if (rc == SHM_AGAIN || rc == SHM_STALLED) rc = SHM_EMPTY; /* wait_for polls again */
        }
        double t = timeout == Py_None ? INFINITY : PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (rc == SHM_EMPTY && t > 0) {
            double deadline = monotonic() + t;
            PyObject *h = wait_for(self, 0, deadline);
            if (h != NULL || PyErr_Occurred()) return h;
            if (timeout != Py_None) /* the slow path gets what is left of the timeout */
                return PyObject_CallMethod((PyObject *)self, "_recv_slow", "d",
                                           fmax(0.0, deadline - monotonic()));
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_recv_slow, timeout);
}

static PyObject *Receiver_recv_many(ReceiverObject *self, PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"max_items", "timeout"};
    PyObject *a[2] = {NULL, Py_None};
    if (parse_args("recv_many", args, nargs, kwnames, names, 0, 2, a) < 0) return NULL;
    if (a[0] == NULL) a[0] = PyLong_FromLong(256);
    else Py_INCREF(a[0]);
    if (a[0] == NULL) return NULL;
    PyObject *res = NULL, *timeout = a[1];
    long n = PyLong_CheckExact(a[0]) ? PyLong_AsLong(a[0]) : -1;
    if (n == -1 && PyErr_Occurred()) PyErr_Clear(); /* huge: the slow path says why */
    if (n >= 1 && timeout_plain(timeout) && self->seg != NULL) {
        uint32_t want = n > (long)MAX_BATCH ? MAX_BATCH : (uint32_t)n;
        int rc = SHM_EMPTY;
        if (fast_ok(self)) { /* with upkeep due, wait_for runs it first (as in recv) */
            res = poll_fast(self, self->seg, want, 0, &rc);
            if (res == NULL || PyList_GET_SIZE(res)) goto out;
            Py_CLEAR(res);
            if (rc == SHM_AGAIN || rc == SHM_STALLED) rc = SHM_EMPTY; /* wait_for polls again */
        }
        double t = timeout == Py_None ? INFINITY : PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) goto out;
        if (rc == SHM_EMPTY && t > 0) {
            double deadline = monotonic() + t;
            res = wait_for(self, want, deadline);
            if (res != NULL || PyErr_Occurred()) goto out;
            if (timeout != Py_None) { /* the slow path gets what is left of the timeout */
                res = PyObject_CallMethod((PyObject *)self, "_recv_many_slow", "Od", a[0],
                                          fmax(0.0, deadline - monotonic()));
                goto out;
            }
        }
    }
    res = PyObject_CallMethodObjArgs((PyObject *)self, s_recv_many_slow, a[0], timeout, NULL);
out:
    Py_DECREF(a[0]);
    return res;
}

static PyObject *Receiver_release_many(ReceiverObject *self, PyObject *handles) {
    PyObject *seq = PySequence_Fast(handles, "release_many() takes an iterable of handles");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int fast = self->seg != NULL && !seg_detached(self->seg) && n <= (Py_ssize_t)MAX_BATCH;
    for (Py_ssize_t i = 0; fast && i < n; i++)
        fast = Py_TYPE(items[i]) == handle_type &&
               ((HandleObject *)items[i])->seg == self->seg;
    if (!fast) {
        PyObject *res = PyObject_CallMethodOneArg((PyObject *)self, s_release_many_slow, seq);
        Py_DECREF(seq);
        return res;
    }
    /* Our own reference: dropping seq below may free handles whose payloads run Python
     * code (__del__), which could close the receiver. */
    SegmentObject *seg = (SegmentObject *)Py_NewRef(self->seg);
    uint32_t stack_slots[256], stack_gens[256];
    uint32_t *slots = stack_slots, *gens = stack_gens;
    if (n > 256) {
        slots = PyMem_Malloc((size_t)n * sizeof(uint32_t));
        gens = PyMem_Malloc((size_t)n * sizeof(uint32_t));
        if (slots == NULL || gens == NULL) {
            PyMem_Free(slots == stack_slots ? NULL : slots);
            PyMem_Free(gens == stack_gens ? NULL : gens);
            Py_DECREF(seq);
            Py_DECREF(seg);
            return PyErr_NoMemory();
        }
    }
    uint32_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        HandleObject *h = (HandleObject *)items[i];
        if (h->done) continue;
        h->done = 1; /* each exactly once, also when a handle appears twice in the list */
        slots[k] = h->slot;
        gens[k] = h->gen;
        k++;
    }
    int wake = 0, rc = SHM_OK;
    if (k) rc = core.release_many(seg->c, slots, gens, k, &wake);
    if (slots != stack_slots) {
        PyMem_Free(slots);
        PyMem_Free(gens);
    }
    if (wake & 1) post_n(seg->rx_sem, 1);
    if (wake & 2) wake_sender(seg);
    Py_DECREF(seg);
    Py_DECREF(seq);
    if (rc >= 0) Py_RETURN_NONE;
    return PyObject_CallMethod((PyObject *)self, "_released_many", "i", rc);
}

static void Receiver_dealloc(ReceiverObject *self) {
    PyMem_Free(self->msgs);
    Py_CLEAR(self->seg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Receiver_get_seg(ReceiverObject *r, void *c) { return get_seg(r->seg); }
static int Receiver_set_seg(ReceiverObject *r, PyObject *v, void *c) { return set_seg(&r->seg, v); }

static PyGetSetDef Receiver_getset[] = {
    {"_seg", (getter)Receiver_get_seg, (setter)Receiver_set_seg, "None once closed", NULL},
    {NULL},
};

static PyMemberDef Receiver_members[] = {
    {"_next_maintenance", T_DOUBLE, offsetof(ReceiverObject, next_maintenance), 0,
     "time.monotonic() at which recv() runs maintain() again"},
    {NULL},
};

/* recv_batch(max_items=256, timeout=None) -> Batch: like recv_many, but the messages
 * come as one Batch object instead of a Handle each. The one-poll path is here; waiting
 * goes through Receiver._recv_batch_slow (recv_many, then the Handles become a Batch). */
static PyObject *Receiver_recv_batch(ReceiverObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"max_items", "timeout"};
    PyObject *a[2] = {NULL, Py_None};
    if (parse_args("recv_batch", args, nargs, kwnames, names, 0, 2, a) < 0) return NULL;
    long n = 256;
    if (a[0] != NULL) {
        n = PyLong_CheckExact(a[0]) ? PyLong_AsLong(a[0]) : -1;
        if (n == -1 && PyErr_Occurred()) PyErr_Clear(); /* huge: the slow path says why */
    }
    if (n >= 1 && timeout_plain(a[1]) && fast_ok(self)) {
        uint32_t want = n > (long)MAX_BATCH ? MAX_BATCH : (uint32_t)n;
        SegmentObject *seg = self->seg;
        if (ensure_msgs(self, want) < 0) return NULL;
        uint32_t got = 0, wake = 0;
        shm_stall stall;
        (void)core.recv(seg->c, self->msgs, want, &got, 0, &stall, &wake);
        if (wake) wake_sender(seg);
        if (got) {
            PyObject *b = batch_new(seg, self->msgs, got);
            if (b == NULL) give_back(seg, self->msgs, 0, got);
            return b;
        }
    }
    PyObject *mi = a[0] ? Py_NewRef(a[0]) : PyLong_FromLong(256);
    if (mi == NULL) return NULL;
    PyObject *res = PyObject_CallMethod((PyObject *)self, "_recv_batch_slow", "OO", mi, a[1]);
    Py_DECREF(mi);
    return res;
}

static PyMethodDef Receiver_methods[] = {
    {"recv", (PyCFunction)(void (*)(void))Receiver_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv(timeout=None) -> Handle: the next message free to go; blocks.\n\n"
     "Raises Empty on timeout, Closed once the channel is shut down and drained."},
    {"recv_many", (PyCFunction)(void (*)(void))Receiver_recv_many,
     METH_FASTCALL | METH_KEYWORDS,
     "recv_many(max_items=256, timeout=None) -> list[Handle]: up to max_items handles\n"
     "with one C call; at least one unless it raises Empty."},
    {"release_many", (PyCFunction)Receiver_release_many, METH_O,
     "release_many(handles): release several handles with one C call (each exactly once)."},
    {"recv_batch", (PyCFunction)(void (*)(void))Receiver_recv_batch,
     METH_FASTCALL | METH_KEYWORDS,
     "recv_batch(max_items=256, timeout=None) -> Batch: up to max_items messages as one\n"
     "object, no Python object per message; at least one unless it raises Empty."},
    {NULL},
};

static PyTypeObject ReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.ReceiverBase",
    .tp_basicsize = sizeof(ReceiverObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The per-message half of shmchan.Receiver.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Receiver_dealloc,
    .tp_methods = Receiver_methods,
    .tp_members = Receiver_members,
    .tp_getset = Receiver_getset,
};

/* ---------------------------------------------------------------------------------
 * keys: the common cases of shmchan/codec.py's encoding, byte for byte
 * --------------------------------------------------------------------------------- */
typedef struct {
    uint8_t buf[KEY_BUF];
    uint32_t len;                        /* bytes used                         */
    uint32_t n;                          /* distinct keys                      */
    uint32_t start[SHM_MAX_KEYS_LIMIT];  /* where each key's frame begins      */
} keyblob;

/* Append one key's frame (u16 LE length, tag, body), merging a duplicate. Returns 1 if
 * done, 0 if this key is not for the fast path (codec.py handles it and its errors). */
static int key_append(keyblob *kb, PyObject *k) {
    uint8_t num[8];
    const uint8_t *body;
    Py_ssize_t blen;
    uint8_t tag;
    if (PyUnicode_CheckExact(k)) {
        body = (const uint8_t *)PyUnicode_AsUTF8AndSize(k, &blen);
        if (body == NULL) { /* lone surrogates: codec.py passes them through */
            PyErr_Clear();
            return 0;
        }
        tag = 's';
    } else if (PyBytes_CheckExact(k)) {
        body = (const uint8_t *)PyBytes_AS_STRING(k);
        blen = PyBytes_GET_SIZE(k);
        tag = 'b';
    } else if (PyLong_CheckExact(k)) { /* exact: bool is not a key type */
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(k, &overflow);
        if (overflow) return 0;
        /* minimal two's complement, big-endian: bit length of v (or of -v-1) + sign bit */
        unsigned long long mag = v < 0 ? ~(unsigned long long)v : (unsigned long long)v;
        int bits = mag ? 64 - __builtin_clzll(mag) : 0;
        int nb = bits / 8 + 1;
        for (int i = 0; i < nb; i++) num[nb - 1 - i] = (uint8_t)((unsigned long long)v >> (8 * i));
        body = num;
        blen = nb;
        tag = 'i';
    } else {
        return 0;
    }
    size_t enc = 1 + (size_t)blen;
    if (enc > 0xFFFE || kb->len + 2 + enc > KEY_BUF) return 0;
    uint8_t *f = kb->buf + kb->len;
    f[0] = (uint8_t)(enc & 0xFF);
    f[1] = (uint8_t)(enc >> 8);
    f[2] = tag;
    memcpy(f + 3, body, (size_t)blen);
    for (uint32_t j = 0; j < kb->n; j++) {
        const uint8_t *g = kb->buf + kb->start[j];
        size_t glen = (size_t)g[0] | ((size_t)g[1] << 8);
        if (glen == enc && memcmp(g + 2, f + 2, enc) == 0) return 1; /* a duplicate */
    }
    if (kb->n == SHM_MAX_KEYS_LIMIT) return 0;
    kb->start[kb->n++] = kb->len;
    kb->len += (uint32_t)(2 + enc);
    return 1;
}

/* The blob for `keys` (None, one str/bytes/int, or a tuple or list of them). Returns 1
 * if encoded, 0 if codec.py must do it (other types, too many keys, errors). */
static int keys_encode(keyblob *kb, PyObject *keys, uint32_t max_keys) {
    kb->len = kb->n = 0;
    if (keys == Py_None) return 1;
    if (PyTuple_CheckExact(keys) || PyList_CheckExact(keys)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
        PyObject **items = PySequence_Fast_ITEMS(keys);
        for (Py_ssize_t i = 0; i < n; i++)
            if (!key_append(kb, items[i])) return 0;
    } else if (!key_append(kb, keys)) {
        return 0;
    }
    return kb->n <= max_keys;
}

/* ---------------------------------------------------------------------------------
 * SenderBase: send, and the packing half of send_many
 * --------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg; /* NULL once closed */
} SenderObject;

static PyObject *Sender_send(SenderObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    static const char *const names[] = {"obj", "keys", "timeout"};
    PyObject *a[3] = {NULL, NULL, Py_None};
    if (parse_args("send", args, nargs, kwnames, names, 1, 3, a) < 0) return NULL;
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
        int rc = core.send(seg->c, SHM_PAYLOAD_RAW, data, (uint64_t)len, (const char *)kb.buf,
                           kb.len, kb.n, &seq, &stall, &wake);
        if (rc == SHM_OK) {
            if (wake) post_n(seg->rx_sem, 1); /* the receiver sleeps */
            return PyLong_FromUnsignedLongLong(seq);
        }
        /* full, stalled or an error: nothing was sent; the slow path waits or raises */
    }
    PyObject *keys_arg = a[1] ? Py_NewRef(a[1]) : PyTuple_New(0);
    if (keys_arg == NULL) return NULL;
    PyObject *res =
        PyObject_CallMethodObjArgs((PyObject *)self, s_send_slow, a[0], keys_arg, a[2], NULL);
    Py_DECREF(keys_arg);
    return res;
}

/* A growable byte buffer for packing. */
typedef struct {
    char *p;
    size_t len, cap;
} gbuf;

static int gbuf_put(gbuf *b, const void *src, size_t n) {
    if (n > PY_SSIZE_T_MAX - b->len) {
        PyErr_SetString(EXC_INVALID, "send_many: the batch is too large for this process");
        return -1;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap = cap > PY_SSIZE_T_MAX / 2 ? b->len + n : cap * 2;
        char *p = PyMem_Realloc(b->p, cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

static PyObject *gbuf_bytes(gbuf *b) { return PyBytes_FromStringAndSize(b->p ? b->p : "", b->len); }

/* Append one payload (raw or through codec.encode_payload) to the batch. */
static int pack_payload(SegmentObject *seg, PyObject *obj, gbuf *kinds, gbuf *data, gbuf *lens) {
    uint32_t kind = SHM_PAYLOAD_RAW;
    PyObject *enc = NULL, *buf = obj;
    /* memoryviews too go through encode_payload, which refuses non-contiguous ones */
    if (!(PyBytes_Check(obj) || PyByteArray_Check(obj))) {
        enc = PyObject_CallFunction(encode_payload_fn, "OO", obj,
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
        PyObject *enc = PyObject_CallFunction(encode_keys_fn, "OI", keys, seg->max_keys);
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

/* A send_many batch packed as shm_send_many takes it: per message a kind (uint32), a
 * payload length (uint64), a key blob length and a key count (uint32 each), and the
 * payloads and key blobs back to back. */
typedef struct {
    Py_ssize_t n;
    gbuf kinds, data, lens, blob, klens, nkeys;
} packed;

static void packed_free(packed *p) {
    PyMem_Free(p->kinds.p);
    PyMem_Free(p->data.p);
    PyMem_Free(p->lens.p);
    PyMem_Free(p->blob.p);
    PyMem_Free(p->klens.p);
    PyMem_Free(p->nkeys.p);
}

/* Pack `items`; 0 on success, -1 with an exception (the buffers are freed either way by
 * packed_free). Works on a tuple copy: encoding may run Python code (pickling), which
 * must not be able to change the sequence under us. */
static int pack_items(SegmentObject *seg, PyObject *items, packed *p) {
    memset(p, 0, sizeof *p);
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
        if (rc == 0)
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
    PyObject *res = pack_items(seg, items, &p) == 0 ? packed_tuple(&p) : NULL;
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
    if (parse_args("send_many", args, nargs, kwnames, names, 1, 2, a) < 0) return NULL;
    SegmentObject *seg = self->seg;
    if (!(seg && seg->registered && timeout_plain(a[1])))
        return PyObject_CallMethod((PyObject *)self, "_send_many_slow", "OO", a[0], a[1]);
    Py_INCREF(seg); /* packing may run Python code, which may close the sender */
    packed p;
    if (pack_items(seg, a[0], &p) < 0) {
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
    int rc = core.send_many(seg->c, (uint32_t)p.n, (const uint32_t *)p.kinds.p,
                            p.data.p ? p.data.p : "", p.data.len, (const uint64_t *)p.lens.p,
                            p.blob.p ? p.blob.p : "", p.blob.len,
                            (const uint32_t *)p.klens.p, (const uint32_t *)p.nkeys.p, sq,
                            &done, &stall, &wake);
    if (wake) post_n(seg->rx_sem, 1); /* the receiver sleeps */
    if (rc == SHM_OK) {
        res = PyList_New(p.n);
        for (Py_ssize_t i = 0; res != NULL && i < p.n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(sq[i]);
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
    if (parse_args("send_batch", args, nargs, kwnames, names, 2, 4, a) < 0) return NULL;
    SegmentObject *seg = self->seg;
    if (seg == NULL) return PyObject_CallMethod((PyObject *)self, "_live", NULL);
    Py_buffer data, lv;
    if (PyObject_GetBuffer(a[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    int have_lv = 0;
    packed p;
    memset(&p, 0, sizeof p);
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
    uint32_t raw = SHM_PAYLOAD_RAW, none = 0;
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
    for (Py_ssize_t i = 0; i < p.n; i++) {
        if (gbuf_put(&p.kinds, &raw, sizeof raw) < 0) goto out;
        if (keyseq == NULL) {
            if (gbuf_put(&p.klens, &none, 4) < 0 || gbuf_put(&p.nkeys, &none, 4) < 0) goto out;
        } else if (pack_keys(seg, PySequence_Fast_GET_ITEM(keyseq, i), &kb, &p.blob, &p.klens,
                             &p.nkeys) < 0) {
            goto out;
        }
    }
    PyObject *seqs = PyByteArray_FromStringAndSize(NULL, p.n * (Py_ssize_t)sizeof(uint64_t));
    if (seqs == NULL) goto out;
    uint32_t done = 0;
    int rc = SHM_FULL;
    if (p.n && self->seg == seg && seg->registered && timeout_plain(a[3])) {
        shm_stall stall;
        int wake = 0;
        rc = core.send_many(seg->c, (uint32_t)p.n, (const uint32_t *)p.kinds.p,
                            data.len ? data.buf : "", (uint64_t)data.len, lens,
                            p.blob.p ? p.blob.p : "", p.blob.len, (const uint32_t *)p.klens.p,
                            (const uint32_t *)p.nkeys.p, (uint64_t *)PyByteArray_AS_STRING(seqs),
                            &done, &stall, &wake);
        if (wake) post_n(seg->rx_sem, 1); /* the receiver sleeps */
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

static PyObject *Sender_get_seg(SenderObject *s, void *c) { return get_seg(s->seg); }
static int Sender_set_seg(SenderObject *s, PyObject *v, void *c) { return set_seg(&s->seg, v); }

static PyGetSetDef Sender_getset[] = {
    {"_seg", (getter)Sender_get_seg, (setter)Sender_set_seg, "None once closed", NULL},
    {NULL},
};

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL | METH_KEYWORDS,
     "send(obj, keys=(), timeout=None) -> int: send one message; returns its sequence\n"
     "number. Blocks while the channel is full; with `timeout`, raises Full when it runs out."},
    {"send_many", (PyCFunction)(void (*)(void))Sender_send_many, METH_FASTCALL | METH_KEYWORDS,
     "send_many(items, timeout=None) -> list[int]: send (payload, keys) pairs in order\n"
     "with one C call per batch; returns their seqs."},
    {"send_batch", (PyCFunction)(void (*)(void))Sender_send_batch, METH_FASTCALL | METH_KEYWORDS,
     "send_batch(data, lengths, keys=None, timeout=None) -> memoryview of seqs: message i\n"
     "is the next lengths[i] bytes of data, with keys[i]; one C call, no object per message."},
    {"_pack", (PyCFunction)Sender_pack, METH_O,
     "_pack(items): the packed arrays of a send_many batch"},
    {NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_shmchan_hot.SenderBase",
    .tp_basicsize = sizeof(SenderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The per-message half of shmchan.Sender.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_getset = Sender_getset,
};

/* ---------------------------------------------------------------------------------
 * module
 * --------------------------------------------------------------------------------- */

/* bind(addresses, handle_type, encode_payload, encode_keys): `addresses` maps the core
 * functions' names to their addresses in the loaded cffi module. */
static PyObject *bind(PyObject *mod, PyObject *args) {
    PyObject *addrs, *htype, *encp, *enck, *btype = (PyObject *)&BatchType;
    PyObject *einv = NULL, *etype = NULL;
    if (!PyArg_ParseTuple(args, "O!O!OO|O!OO", &PyDict_Type, &addrs, &PyType_Type, &htype, &encp,
                          &enck, &PyType_Type, &btype, &einv, &etype))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)htype, &HandleType))
        return PyErr_Format(PyExc_TypeError, "handle type must subclass HandleBase");
    if (!PyType_IsSubtype((PyTypeObject *)btype, &BatchType))
        return PyErr_Format(PyExc_TypeError, "batch type must subclass BatchBase");
    static const char *const fnames[] = {"shm_send",    "shm_recv",    "shm_release",
                                         "shm_release_many", "shm_unmoved", "shm_rx_spin",
                                         "shm_send_many", "shm_handle_view",
                                         "shm_handle_send_many", "shm_handle_adopt_many"};
    void *fp[10];
    for (int i = 0; i < 10; i++) {
        PyObject *v = PyDict_GetItemString(addrs, fnames[i]);
        if (v == NULL) return PyErr_Format(PyExc_KeyError, "no address for %s", fnames[i]);
        fp[i] = PyLong_AsVoidPtr(v);
        if (fp[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s is NULL", fnames[i]);
            return NULL;
        }
    }
    core.send = (send_fn)fp[0];
    core.recv = (recv_fn)fp[1];
    core.release = (release_fn)fp[2];
    core.release_many = (release_many_fn)fp[3];
    core.unmoved = (unmoved_fn)fp[4];
    core.rx_spin = (rx_spin_fn)fp[5];
    core.send_many = (send_many_fn)fp[6];
    core.handle_view = (view_fn)fp[7];
    core.handle_send_many = (send_many_handles_fn)fp[8];
    core.handle_adopt_many = (adopt_many_fn)fp[9];
    Py_XSETREF(handle_type, (PyTypeObject *)Py_NewRef(htype));
    Py_INCREF(btype); /* held for good: the module's types outlive every batch */
    batch_type = (PyTypeObject *)btype;
    Py_XSETREF(encode_payload_fn, Py_NewRef(encp));
    Py_XSETREF(encode_keys_fn, Py_NewRef(enck));
    if (einv) Py_XSETREF(exc_invalid, Py_NewRef(einv)); /* kept when a re-bind omits them */
    if (etype) Py_XSETREF(exc_type, Py_NewRef(etype));
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------
 * hand-over of a batch of handles (shmchan.hand_over / shmchan.adopt)
 *
 * The batch twin of pickling handles one by one: one core call marks every handle in
 * transit (shm_handle_send_many) and one adopts them all on the other side
 * (shm_handle_adopt_many). What travels is (slot, gen) per handle, two uint32 each, in
 * this machine's byte order; the Python layer adds which channel they belong to.
 * --------------------------------------------------------------------------------- */

/* hand_over(seg, handles) -> (pairs, worst): marks the handles (all of `seg`) in
 * transit; they no longer release when collected here. `worst` is the first status
 * that is neither SHM_OK nor SHM_STALE (a stale handle travels as a no-op one), or 0. */
static PyObject *hand_over(PyObject *mod, PyObject *args) {
    PyObject *seg, *list;
    if (!PyArg_ParseTuple(args, "O!O!", &SegmentType, &seg, &PyList_Type, &list)) return NULL;
    SegmentObject *sg = (SegmentObject *)seg;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (sg->c == NULL || seg_detached(sg))
        return PyErr_Format(EXC_INVALID, "hand_over: the channel is closed in this process");
    if (n > (Py_ssize_t)MAX_BATCH)
        return PyErr_Format(EXC_INVALID, "hand_over: at most %u handles at once", MAX_BATCH);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (!PyObject_TypeCheck(o, &HandleType))
            return PyErr_Format(EXC_TYPE, "hand_over: not a Handle: %s", Py_TYPE(o)->tp_name);
        if (((HandleObject *)o)->seg != sg)
            return PyErr_Format(EXC_INVALID, "hand_over: handles of more than one channel");
    }
    PyObject *pairs = PyBytes_FromStringAndSize(NULL, n * 8);
    if (pairs == NULL) return NULL;
    uint32_t *mem = PyMem_Malloc((size_t)(n ? n : 1) * 3 * sizeof(uint32_t));
    if (mem == NULL) {
        Py_DECREF(pairs);
        return PyErr_NoMemory();
    }
    uint32_t *slots = mem, *gens = mem + n;
    int32_t *status = (int32_t *)(mem + 2 * n);
    char *out = PyBytes_AS_STRING(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        HandleObject *h = (HandleObject *)PyList_GET_ITEM(list, i);
        slots[i] = h->slot;
        gens[i] = h->gen;
        memcpy(out + 8 * i, &h->slot, 4);
        memcpy(out + 8 * i + 4, &h->gen, 4);
    }
    if (n) core.handle_send_many(sg->c, slots, gens, (uint32_t)n, status);
    int worst = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        HandleObject *h = (HandleObject *)PyList_GET_ITEM(list, i);
        h->pid = -1; /* handed over (or gone): never released by this process's GC */
        if (!worst && status[i] != SHM_OK && status[i] != SHM_STALE) worst = status[i];
    }
    PyMem_Free(mem);
    return Py_BuildValue("(Ni)", pairs, worst);
}

/* adopt_many(seg, pairs, token) -> (handles, worst): this process (token) adopts the
 * handles `pairs` names. A handle released, redelivered or taken back meanwhile comes
 * back as a no-op (released) Handle. `worst` is the first error status, or 0. */
static PyObject *adopt_many(PyObject *mod, PyObject *args) {
    PyObject *seg;
    Py_buffer buf;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "O!y*K", &SegmentType, &seg, &buf, &token)) return NULL;
    SegmentObject *sg = (SegmentObject *)seg;
    PyObject *res = NULL, *list = NULL;
    Py_ssize_t n = buf.len / 8;
    int adopted = 0; /* the core call was made: some messages may be ours now */
    uint32_t *mem = NULL;
    shm_msg *msgs = NULL;
    if (sg->c == NULL || seg_detached(sg)) {
        PyErr_Format(EXC_INVALID, "adopt: the channel is closed in this process");
        goto out;
    }
    if (buf.len % 8 || n > (Py_ssize_t)MAX_BATCH) {
        PyErr_Format(EXC_INVALID, "adopt: not a hand-over of at most %u handles", MAX_BATCH);
        goto out;
    }
    mem = PyMem_Malloc((size_t)(n ? n : 1) * 3 * sizeof(uint32_t));
    msgs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(shm_msg));
    if (mem == NULL || msgs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    uint32_t *slots = mem, *gens = mem + n;
    int32_t *status = (int32_t *)(mem + 2 * n);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(&slots[i], (const char *)buf.buf + 8 * i, 4);
        memcpy(&gens[i], (const char *)buf.buf + 8 * i + 4, 4);
    }
    if (n) core.handle_adopt_many(sg->c, slots, gens, (uint32_t)n, (uint64_t)token, msgs, status);
    adopted = 1;
    list = PyList_New(n);
    if (list == NULL) goto out;
    int worst = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* not ours: released, redelivered or taken back meanwhile, or never valid */
        int gone = status[i] == SHM_STALE || status[i] == SHM_LOST || status[i] == SHM_E_INVALID;
        if (status[i] != SHM_OK) { /* a handle that still says which slot it was */
            memset(&msgs[i], 0, sizeof(shm_msg));
            msgs[i].slot = slots[i];
            msgs[i].gen = gens[i];
            if (!worst && status[i] != SHM_STALE && status[i] != SHM_LOST) worst = status[i];
        }
        HandleObject *h = (HandleObject *)make_handle(sg, &msgs[i]);
        if (h == NULL) goto out;
        h->done = (char)gone; /* adopted but not described (an error): still ours to nack */
        PyList_SET_ITEM(list, i, (PyObject *)h);
    }
    res = Py_BuildValue("(Oi)", list, worst);
out:
    if (res == NULL && adopted) {
        /* Failed after the core adopted them (no memory for the list or a Handle): give
         * back every message this process now holds rather than drop it. A Handle
         * already made is marked done first, or collecting it would release (and so
         * lose) its message; one not made yet would stay held by this live process. */
        const uint32_t *sl = mem, *gn = mem + n;
        const int32_t *st = (const int32_t *)(mem + 2 * n);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (st[i] == SHM_STALE || st[i] == SHM_LOST || st[i] == SHM_E_INVALID)
                continue; /* not ours */
            if (list != NULL && PyList_GET_ITEM(list, i) != NULL)
                ((HandleObject *)PyList_GET_ITEM(list, i))->done = 1;
            int r = core.release(sg->c, sl[i], gn[i], 1);
            if (r > 0) post_wakeups(sg, r);
        }
    }
    Py_XDECREF(list);
    PyMem_Free(mem);
    PyMem_Free(msgs);
    PyBuffer_Release(&buf);
    return res;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(addresses, handle_type, encode_payload, encode_keys[, batch_type,\n"
     "invalid_argument, unsupported_type]): wire up the hot path"},
    {"handles_from", handles_from, METH_VARARGS,
     "handles_from(seg, address, n): Handles for n shm_msg structs at address"},
    {"batch_from_handles", batch_from_handles, METH_VARARGS,
     "batch_from_handles(seg, handles): a Batch taking over held Handles' messages"},
    {"hand_over", hand_over, METH_VARARGS,
     "hand_over(seg, handles) -> (pairs, worst): mark a batch of handles in transit"},
    {"adopt_many", adopt_many, METH_VARARGS,
     "adopt_many(seg, pairs, token) -> (handles, worst): adopt a batch handed over"},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_shmchan_hot",
    "shmchan's per-message calls (csrc/hotpath.c); private to shmchan.channel.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__shmchan_hot(void) {
    PyTypeObject *types[] = {&SegmentType, &HandleType, &ReceiverType, &SenderType, &BatchType};
    const char *tnames[] = {"SegmentBase", "HandleBase", "ReceiverBase", "SenderBase",
                            "BatchBase"};
    struct {
        PyObject **slot;
        const char *s;
    } strs[] = {
        {&s_maintain, "maintain"},
        {&s_send_slow, "_send_slow"},           {&s_recv_slow, "_recv_slow"},
        {&s_recv_many_slow, "_recv_many_slow"}, {&s_release_many_slow, "_release_many_slow"},
        {&s_released, "_released"},             {&s_payload_slow, "_payload_slow"},
        {&s_data_slow, "_data_slow"},         {&s_keys_slow, "_keys_slow"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        *strs[i].slot = PyUnicode_InternFromString(strs[i].s);
        if (*strs[i].slot == NULL) return NULL;
    }
    for (int i = 0; i < 5; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    for (int i = 0; i < 5; i++) {
        if (PyModule_AddObjectRef(m, tnames[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
