/* segment.c -- SegmentBase: one process's attachment to a channel, as the hot path reads
 * it (the core's shm_chan, the mapping's base and size, the channel's settings), and the
 * channel's two named semaphores: the receiver's (posted when a send or release finds it
 * asleep) and the senders' (posted for one sender waiting for space).
 *
 * The semaphores are sem_open'ed by name, the same ones posix_ipc opened in the Python
 * layer, so a send that must wake the receiver posts without Python. Every wait goes
 * through Segment_wait (or the receiver's wait in receiver.c) with the GIL released; a
 * signal ends a wait after its handler ran. Posts are rationed: at most 64 at once (one
 * per sleeper is all that is needed), and a sender is woken only when no earlier post is
 * still unconsumed (the rationing rule, csrc/ring.c). The Sender, Receiver and Handle
 * objects hold a reference to their SegmentBase; `detached` says when the mapping is gone.
 */
#include "hot.h"

#define WAKE_RX_BIT (1 << 8) /* shm_release's wake-up requests (csrc/handles.c) */
#define WAKE_TX_BIT (1 << 9)

/* Post n times (at most 64: each sleeper needs one, and more are only spurious). */
void hot_post_n(sem_t *sem, unsigned n) {
    for (unsigned i = 0; sem != NULL && i < n && i < 64; i++) sem_post(sem);
}

/* Wake one sender waiting for space, unless an earlier post is still unconsumed: that one
 * already makes a waiter look again (the rationing rule, csrc/ring.c). sem_getvalue reads
 * the count without a system call. */
void hot_wake_sender(SegmentObject *seg) {
    int v = 0;
    if (seg->tx_sem == NULL || (sem_getvalue(seg->tx_sem, &v) == 0 && v > 0)) return;
    sem_post(seg->tx_sem);
    seg->tx_posts++;
}

/* Post what a release asked for: bit 8 the receiver, bit 9 one sender. */
void hot_post_wakeups(SegmentObject *seg, int r) {
    if (r & WAKE_RX_BIT) hot_post_n(seg->rx_sem, 1);
    if (r & WAKE_TX_BIT) hot_wake_sender(seg);
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
    if (hot_core.send == NULL || hot_handle_type == NULL)
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
int hot_sem_sleep(sem_t *sem, double deadline) {
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
    if (hot_sem_sleep(sem, monotonic() + (seconds > 0 ? fmin(seconds, 1e6) : 0.0)) < 0) return NULL;
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
    hot_post_n(sem, n);
    Py_RETURN_NONE;
}

/* wake_sender(): wake one sender waiting for space, unless a post is still pending. */
static PyObject *Segment_wake_sender(SegmentObject *self, PyObject *unused) {
    if (self->tx_sem == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    hot_wake_sender(self);
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

PyTypeObject SegmentType = {
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
int hot_set_seg(SegmentObject **slot, PyObject *v) {
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

PyObject *hot_get_seg(SegmentObject *s) { return Py_NewRef(s ? (PyObject *)s : Py_None); }
