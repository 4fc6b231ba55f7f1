/* segment.c -- SegmentBase: one process's attachment to a channel, as the hot path reads
 * it (the core's shm_chan, the mapping's base and size, the channel's settings), and its
 * ends of the channel's wake-ups (wake.c: the two named semaphores the synchronous
 * sleepers block on, the header's futex words an asyncio waiter waits on).
 *
 * Every wait goes through Segment_wait (or the receiver's wait in receiver.c) with the GIL
 * released; a signal ends a wait after its handler ran. The Sender, Receiver and Handle
 * objects hold a reference to their SegmentBase; `detached` says when the mapping is gone,
 * after which the futex words in it are forgotten (wake_unmapped).
 */
#include "hot.h"

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
    if (wake_open(&self->wk, rx_name, tx_name, self->base, size) < 0) return NULL;
    Py_RETURN_NONE;
}

/* wait(which, seconds): which 0 = the receiver's semaphore, 1 = the senders'. True if the
 * wait consumed a post. */
static PyObject *Segment_wait(SegmentObject *self, PyObject *args) {
    int which;
    double seconds;
    if (!PyArg_ParseTuple(args, "id", &which, &seconds)) return NULL;
    if (self->wk.sem[which & 1] == NULL)
        return PyErr_Format(PyExc_ValueError, "an unbound segment");
    int r = wake_sleep(&self->wk, which, monotonic() + (seconds > 0 ? fmin(seconds, 1e6) : 0.0));
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* post(which, n): post the receiver's (0) or the senders' (1) semaphore n times (at
 * most 64): the one place the Python layer wakes anyone. */
static PyObject *Segment_post(SegmentObject *self, PyObject *args) {
    int which;
    unsigned int n;
    if (!PyArg_ParseTuple(args, "iI", &which, &n)) return NULL;
    if (self->wk.sem[which & 1] == NULL)
        return PyErr_Format(PyExc_ValueError, "an unbound segment");
    if (seg_detached(self)) wake_unmapped(&self->wk);
    wake_post(&self->wk, which, n);
    Py_RETURN_NONE;
}

/* wake_sender(): wake one sender waiting for space, unless a post is still pending. */
static PyObject *Segment_wake_sender(SegmentObject *self, PyObject *unused) {
    if (self->wk.sem[WAKE_TX] == NULL)
        return PyErr_Format(PyExc_ValueError, "an unbound segment");
    if (seg_detached(self)) wake_unmapped(&self->wk);
    wake_sender(&self->wk);
    Py_RETURN_NONE;
}

/* The asyncio helper's calls (shmchan/aio.py; protocol in wake.c), refused once the
 * mapping is gone. */
static int seg_mapped(SegmentObject *self) {
    if (self->wk.seq[WAKE_RX] != NULL && !seg_detached(self)) return 1;
    PyErr_Format(PyExc_ValueError, "the channel's mapping is gone (closed)");
    return 0;
}

/* wake_word(which) -> (address, value): the side's futex word. */
static PyObject *Segment_wake_word(SegmentObject *self, PyObject *arg) {
    int which = PyLong_AsLong(arg) != 0;
    if (PyErr_Occurred() || !seg_mapped(self)) return NULL;
    return wake_py_word(&self->wk, which);
}

/* async_waiting(delta) -> count: count an asyncio wait in (delta >= 0) or out. */
static PyObject *Segment_async_waiting(SegmentObject *self, PyObject *arg) {
    long delta = PyLong_AsLong(arg);
    if (PyErr_Occurred() || !seg_mapped(self)) return NULL;
    return wake_py_async_waiting(&self->wk, delta >= 0 ? 1 : -1);
}

/* drain(which) -> n: take the posts pending on the side's semaphore. */
static PyObject *Segment_drain(SegmentObject *self, PyObject *arg) {
    int which = PyLong_AsLong(arg) != 0;
    if (PyErr_Occurred()) return NULL;
    return wake_py_drain(&self->wk, which);
}

static void Segment_dealloc(SegmentObject *self) {
    wake_close(&self->wk);
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
    {"wake_word", (PyCFunction)Segment_wake_word, METH_O,
     "wake_word(which) -> (address, value): the receiver's (0) or the senders' (1) futex\n"
     "word in the header, for an asyncio waiter (csrc/hot/wake.c)."},
    {"async_waiting", (PyCFunction)Segment_async_waiting, METH_O,
     "async_waiting(delta) -> count: count an asyncio wait in (delta >= 0) or out."},
    {"drain", (PyCFunction)Segment_drain, METH_O,
     "drain(which) -> n: take the posts pending on the receiver's (0) or the senders'\n"
     "(1) semaphore."},
    {"wait", (PyCFunction)Segment_wait, METH_VARARGS,
     "wait(which, seconds): sleep on the receiver's (0) or the senders' (1) semaphore\n"
     "until posted or seconds pass; True if it consumed a post. A signal handler's\n"
     "exception propagates."},
    {NULL},
};

static PyMemberDef Segment_members[] = {
    {"registered", T_BOOL, offsetof(SegmentObject, registered), 0,
     "this process holds a producer registry entry"},
    {"pid", T_LONG, offsetof(SegmentObject, pid), 0, "the process this attachment is for"},
    {"tx_posts", T_ULONGLONG, offsetof(SegmentObject, wk.tx_posts), READONLY,
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
