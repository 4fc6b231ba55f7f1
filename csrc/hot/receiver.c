/* receiver.c -- ReceiverBase: recv, recv_many, recv_batch and release_many, the
 * per-message half of shmchan.Receiver.
 *
 * A receive polls the core once (shm_recv) and turns what it hands out into Handles;
 * messages the core handed out that cannot become Handles (out of memory) are given back
 * at once, so nothing stays held by this process unseen. Every receive blocks here, in
 * C (receive: spin, arm the eventcount, sleep on the receiver's semaphore), also those
 * that start in Python (Receiver._recv_slow, try_recv, ...: they check arguments and
 * call _receive); Python is called back only for the receiver's upkeep
 * (Receiver.maintain), a claimant's liveness (Receiver._stalled) and the errors.
 */
#include <sched.h>

#include "hot.h"

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
        int r = hot_core.release(seg->c, (uint32_t)msgs[i].slot, (uint32_t)msgs[i].gen, 1);
        if (r > 0) wake_requests(&seg->wk, r);
    }
}

/* Where one poll puts what the core says: the per-message fast path polls into the
 * receiver's own array with the GIL held (the call is short); receive() polls into a
 * buffer of its own with the GIL released meanwhile, as every call of the core from
 * Python does (the core has its own locks), so another thread may receive at the same
 * time. */
typedef struct {
    shm_msg *msgs;   /* room for the n messages asked for */
    shm_stall stall; /* the stuck claim, after SHM_STALLED */
    int nogil;
    int batch; /* poll_fast makes one Batch of what it got (recv_batch), not Handles */
    int own;   /* msgs is PyMem memory the Batch may take over (poll_fast sets it NULL) */
} pollbuf;

static int core_recv(SegmentObject *seg, pollbuf *pb, uint32_t n, uint32_t *got, int arm,
                     uint32_t *wake) {
    int rc;
    if (!pb->nogil) return hot_core.recv(seg->c, pb->msgs, n, got, arm, &pb->stall, wake);
    Py_BEGIN_ALLOW_THREADS
    rc = hot_core.recv(seg->c, pb->msgs, n, got, arm, &pb->stall, wake);
    Py_END_ALLOW_THREADS
    return rc;
}

/* One non-blocking poll of seg (the receiver's segment, referenced by the caller) for
 * up to n messages. Returns a new list (possibly empty) or NULL with an exception; on
 * failure nothing stays handed out. */
static PyObject *poll_fast(SegmentObject *seg, pollbuf *pb, uint32_t n, int arm, int *rc) {
    uint32_t got = 0, wake = 0;
    *rc = core_recv(seg, pb, n, &got, arm, &wake);
    if (wake) wake_sender(&seg->wk);
    if (pb->batch && got) { /* no Python object per message */
        shm_msg *msgs = pb->msgs;
        PyObject *b = pb->own ? hot_batch_adopt(seg, &pb->msgs, got, n) : hot_batch_new(seg, msgs, got);
        if (b == NULL) give_back(seg, msgs, 0, got);
        return b;
    }
    PyObject *out = PyList_New(got);
    if (out == NULL) {
        give_back(seg, pb->msgs, 0, got);
        return NULL;
    }
    for (uint32_t i = 0; i < got; i++) {
        PyObject *h = hot_make_handle(seg, &pb->msgs[i]);
        if (h == NULL) {
            give_back(seg, pb->msgs, i, got);
            for (uint32_t j = 0; j < i; j++) /* made already: nack them too, then drop */
                hot_release_core((HandleObject *)PyList_GET_ITEM(out, j), 1);
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
static PyObject *poll_one(SegmentObject *seg, pollbuf *pb, int arm, int *rc) {
    uint32_t got = 0, wake = 0;
    *rc = core_recv(seg, pb, 1, &got, arm, &wake);
    if (wake) wake_sender(&seg->wk);
    if (!got) return NULL;
    PyObject *h = hot_make_handle(seg, &pb->msgs[0]);
    if (h == NULL) give_back(seg, pb->msgs, 0, 1);
    return h;
}

/* Python's say on a receive that cannot go on: Receiver._live raises Closed (or
 * WrongProcess) once the receiver was closed (maybe by another thread while we slept),
 * Receiver._nothing(rc) raises Empty (rc EMPTY: time is up), Closed (CLOSED: shut
 * down or removed, and drained) or the status's error. Always NULL. */
static PyObject *refuse(ReceiverObject *self, PyObject *name, int rc) {
    PyObject *r = name != NULL ? PyObject_CallMethodNoArgs((PyObject *)self, name)
                               : PyObject_CallMethod((PyObject *)self, "_nothing", "i", rc);
    if (r != NULL) { /* it did not raise: say so rather than return nothing */
        Py_DECREF(r);
        PyErr_Format(PyExc_SystemError, "Receiver.%s returned instead of raising",
                     name != NULL ? "_live" : "_nothing");
    }
    return NULL;
}

/* Receiving, in one place: the loop behind recv, recv_many, try_recv and the Python
 * slow paths. Polls the core for up to n messages (n == 0: one, returned as a Handle,
 * not a list) until something is handed out or `deadline` (CLOCK_MONOTONIC seconds, as
 * time.monotonic(); INFINITY: none) passes; block == 0 polls once and returns None (or
 * an empty list) if nothing is ready.
 *
 * Between polls: spin a little, arm the eventcount (shm_recv with arm_sleep re-checks
 * after announcing the sleep), then sleep on the receiver's semaphore until a post, the
 * deadline or the next upkeep; a stall (a claim ahead not yet committed) sleeps at most
 * STALL_SLEEP_SECONDS at a time. The GIL is released while spinning and sleeping; the
 * segment is held by a reference of our own. Python is called back only for what must
 * be Python:
 *   maintain()           the upkeep, when due (liveness through psutil, redeliveries), in
 *                        place: the wait goes on after it, as quick to wake as before;
 *   _stalled(pos, owner) a stall that outlasted its spin (or met by a non-blocking poll):
 *                        Python checks the claimant now and then, repairs a dead one's;
 *   _live(), _nothing(rc) the errors (see refuse).
 *
 * The spin adapts, as adaptive mutexes do: it is worth its CPU only when messages come
 * within it. A spin that runs out halves the next one (down to none); a sleep that is
 * woken within SPIN_SECONDS restores it. So a busy receiver spins instead of paying a
 * wake-up per message, and a receiver idle between rare messages sleeps at once --
 * which also leaves its CPU free for the sender it is waiting for. A stall is spun
 * through for up to SPIN_SECONDS from its start whatever the adaptive spin says: its
 * producer is most likely a few instructions from committing (slept on instead, the
 * commit had to post us: a receiver that kept up with its producer ran at half the rate
 * of one that lagged).
 * block: 1 waits as above; 0 polls once; RECEIVE_ARMED polls once with the sleep
 * announced (csrc/handles.c) and, finding nothing, returns with it still announced: the
 * asyncio receive (shmchan/aio.py) then waits on the futex word instead (csrc/hot/wake.c).
 * Returns a new reference, or NULL with an exception. */
#define RECEIVE_ARMED 2 /* receive()'s block: one poll that leaves the sleep announced */

/* One round of the spin, GIL released: SPIN_PAUSES pauses watching the ring, then, if
 * nothing came, a sched_yield. A sender that shares this CPU (a busy machine, a
 * container of one CPU, or the scheduler's choice) cannot send while we spin: yielded
 * to, it runs now instead of after the whole spin and the sleep that follows it, which
 * it would then have to post. With nothing else runnable here the yield returns at once
 * (well under a microsecond). */
static void spin_round(SegmentObject *seg) {
    Py_BEGIN_ALLOW_THREADS
    if (hot_core.rx_spin(seg->c, SPIN_PAUSES) != SHM_OK) sched_yield();
    Py_END_ALLOW_THREADS
}
#define AGAIN_ROUNDS 64 /* polls an armed poll makes while the core finds new work */
#define RECEIVE_BATCH 0x80000000u /* or'ed into receive()'s n: return one Batch (recv_batch) */

static PyObject *receive(ReceiverObject *self, uint32_t n, double deadline, int block) {
    SegmentObject *seg = self->seg;
    if (seg == NULL || seg->wk.sem[WAKE_RX] == NULL) return refuse(self, hot_s_live, 0); /* closed */
    PyObject *h = PyObject_CallMethodNoArgs((PyObject *)self, hot_s_live); /* WrongProcess */
    if (h == NULL) return NULL;
    Py_DECREF(h);
    h = NULL;
    int as_batch = (n & RECEIVE_BATCH) != 0;
    n &= ~RECEIVE_BATCH;
    shm_msg one;
    pollbuf pb = {.msgs = n <= 1 ? &one : PyMem_Malloc((size_t)n * sizeof(shm_msg)), .nogil = 1,
                  .batch = as_batch, .own = n > 1};
    if (pb.msgs == NULL) return PyErr_NoMemory();
    Py_INCREF(seg);
    double spin_until = monotonic() + self->spin, stall_until = 0.0;
    int armed_poll = block == RECEIVE_ARMED, arm = armed_poll, rc, agains = 0;
    if (armed_poll) block = 0;
    for (;;) {
        if (self->seg != seg) {
            h = refuse(self, hot_s_live, 0);
            break;
        }
        double now = monotonic();
        if (now >= self->next_maintenance) {
            /* Upkeep first: its redeliveries go before newer messages. */
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, hot_s_maintain);
            if (r == NULL) break; /* its exception is ours */
            Py_DECREF(r);
            if (self->seg != seg) continue;
        }
        if (n == 0) {
            h = poll_one(seg, &pb, arm, &rc);
        } else {
            h = poll_fast(seg, &pb, n, arm, &rc);
            if (h != NULL && PyList_CheckExact(h) && PyList_GET_SIZE(h) == 0) Py_CLEAR(h);
        }
        if (h != NULL || PyErr_Occurred()) break;
        if (rc == SHM_AGAIN) {
            /* Records arrived meanwhile: look at them before sleeping (the core did not
             * leave the sleep armed). Bounded, so that a core that keeps finding work it
             * does not hand out cannot hold a call: by the deadline, and for the armed
             * poll by AGAIN_ROUNDS (its caller polls again within its upkeep period). */
            if (block && monotonic() < deadline) continue;
            if (armed_poll && ++agains < AGAIN_ROUNDS) continue;
            rc = SHM_EMPTY;
        }
        if (rc == SHM_STALLED) {
            if (block && !arm) {
                if (stall_until == 0.0) stall_until = now + SPIN_SECONDS;
                if (now < stall_until) {
                    spin_round(seg);
                    continue;
                }
            }
            PyObject *r = PyObject_CallMethod((PyObject *)self, "_stalled", "KK",
                                              (unsigned long long)pb.stall.pos,
                                              (unsigned long long)pb.stall.owner);
            if (r == NULL) break;
            Py_DECREF(r);
        } else if (rc == SHM_EMPTY) {
            stall_until = 0.0; /* a later stall gets its own spin */
        } else {
            h = refuse(self, NULL, rc);
            break;
        }
        if (!block) {
            h = n == 0 ? Py_NewRef(Py_None) : PyList_New(0);
            break;
        }
        if (monotonic() >= deadline) {
            h = refuse(self, NULL, SHM_EMPTY);
            break;
        }
        if (!arm) {
            if (rc == SHM_EMPTY) {
                if (now < spin_until) {
                    spin_round(seg);
                    continue;
                }
                self->spin = self->spin < 2e-6 ? 0.0 : self->spin / 2; /* it did not pay */
            }
            arm = 1; /* poll once more with the sleep announced */
            continue;
        }
        double until = fmin(deadline, self->next_maintenance);
        double due = hot_core.timers_wait(seg->c); /* a delayed message's time (timers.c) */
        if (due >= 0.0) until = fmin(until, monotonic() + due);
        if (rc == SHM_STALLED) until = fmin(until, monotonic() + STALL_SLEEP_SECONDS);
        if (wake_sleep(&seg->wk, WAKE_RX, until) < 0) break;
        if (rc == SHM_EMPTY && monotonic() - now < SPIN_SECONDS)
            self->spin = SPIN_SECONDS; /* woken soon */
    }
    Py_DECREF(seg);
    if (pb.msgs != &one) PyMem_Free(pb.msgs); /* NULL if a Batch took it */
    return h;
}

/* The deadline of a plain timeout (None, or an int or float >= 0) from now. */
static int plain_deadline(PyObject *timeout, double *deadline) {
    double t = timeout == Py_None ? INFINITY : PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    *deadline = t == INFINITY ? INFINITY : monotonic() + t;
    return 0;
}

/* _receive(n, deadline, block): receive() for the Python slow paths, whose arguments
 * they checked (deadline: time.monotonic() value, or None: none; block 0, 1 or
 * RECEIVE_ARMED). */
static PyObject *Receiver_receive(ReceiverObject *self, PyObject *args) {
    unsigned int n;
    PyObject *dl;
    int block;
    if (!PyArg_ParseTuple(args, "IOi", &n, &dl, &block)) return NULL;
    if (block < 0 || block > RECEIVE_ARMED) return PyErr_Format(PyExc_ValueError, "block");
    double deadline = dl == Py_None ? INFINITY : PyFloat_AsDouble(dl);
    if (deadline == -1.0 && PyErr_Occurred()) return NULL;
    return receive(self, n > MAX_BATCH ? MAX_BATCH : n, deadline, block);
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
    if (kwnames == NULL && nargs <= 1) { /* recv() or recv(timeout): no parsing to do */
        if (nargs) a[0] = args[0];
    } else if (hot_parse_args("recv", args, nargs, kwnames, names, 0, 1, a) < 0) {
        return NULL;
    }
    PyObject *timeout = a[0];
    if (!timeout_plain(timeout) || self->seg == NULL) /* Python checks it, or says why */
        return PyObject_CallMethodOneArg((PyObject *)self, hot_s_recv_slow, timeout);
    /* With upkeep due, no poll here: receive() runs it first (its redeliveries go
     * before newer messages), then polls. */
    if (fast_ok(self)) {
        int rc;
        if (ensure_msgs(self, 1) < 0) return NULL;
        pollbuf pb = {.msgs = self->msgs, .nogil = 0};
        PyObject *h = poll_one(self->seg, &pb, 0, &rc);
        if (h != NULL || PyErr_Occurred()) return h;
    }
    double deadline;
    if (plain_deadline(timeout, &deadline) < 0) return NULL;
    return receive(self, 0, deadline, 1);
}

static PyObject *Receiver_recv_many(ReceiverObject *self, PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"max_items", "timeout"};
    PyObject *a[2] = {NULL, Py_None};
    if (kwnames == NULL && nargs <= 2) { /* positional only: no parsing to do */
        for (Py_ssize_t i = 0; i < nargs; i++) a[i] = args[i];
    } else if (hot_parse_args("recv_many", args, nargs, kwnames, names, 0, 2, a) < 0) {
        return NULL;
    }
    PyObject *timeout = a[1];
    long n = a[0] == NULL ? 256 : PyLong_CheckExact(a[0]) ? PyLong_AsLong(a[0]) : -1;
    if (n == -1 && PyErr_Occurred()) PyErr_Clear(); /* huge: the slow path says why */
    if (n < 1 || !timeout_plain(timeout) || self->seg == NULL) {
        PyObject *mi = a[0] ? Py_NewRef(a[0]) : PyLong_FromLong(256);
        if (mi == NULL) return NULL;
        PyObject *res =
            PyObject_CallMethodObjArgs((PyObject *)self, hot_s_recv_many_slow, mi, timeout, NULL);
        Py_DECREF(mi);
        return res;
    }
    uint32_t want = n > (long)MAX_BATCH ? MAX_BATCH : (uint32_t)n;
    if (fast_ok(self)) { /* with upkeep due, receive() runs it first (as in recv) */
        int rc;
        if (ensure_msgs(self, want) < 0) return NULL;
        pollbuf pb = {.msgs = self->msgs, .nogil = 0};
        PyObject *res = poll_fast(self->seg, &pb, want, 0, &rc);
        if (res == NULL || PyList_GET_SIZE(res)) return res;
        Py_DECREF(res);
    }
    double deadline;
    if (plain_deadline(timeout, &deadline) < 0) return NULL;
    return receive(self, want, deadline, 1);
}

static PyObject *Receiver_release_many(ReceiverObject *self, PyObject *handles) {
    PyObject *seq = PySequence_Fast(handles, "release_many() takes an iterable of handles");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int fast = self->seg != NULL && !seg_detached(self->seg) && n <= (Py_ssize_t)MAX_BATCH;
    for (Py_ssize_t i = 0; fast && i < n; i++)
        fast = Py_TYPE(items[i]) == hot_handle_type &&
               ((HandleObject *)items[i])->seg == self->seg;
    if (!fast) {
        PyObject *res = PyObject_CallMethodOneArg((PyObject *)self, hot_s_release_many_slow, seq);
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
    if (k) rc = hot_core.release_many(seg->c, slots, gens, k, &wake);
    if (slots != stack_slots) {
        PyMem_Free(slots);
        PyMem_Free(gens);
    }
    wake_released(&seg->wk, wake);
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

static PyObject *Receiver_get_seg(ReceiverObject *r, void *c) { return hot_get_seg(r->seg); }
static int Receiver_set_seg(ReceiverObject *r, PyObject *v, void *c) {
    return hot_set_seg(&r->seg, v);
}

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
 * come as one Batch object instead of a Handle each, also after a wait (receive() with
 * RECEIVE_BATCH). Arguments that need checking go through Receiver._recv_batch_slow
 * (recv_many, then the Handles become a Batch). */
static PyObject *Receiver_recv_batch(ReceiverObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"max_items", "timeout"};
    PyObject *a[2] = {NULL, Py_None};
    if (hot_parse_args("recv_batch", args, nargs, kwnames, names, 0, 2, a) < 0) return NULL;
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
        (void)hot_core.recv(seg->c, self->msgs, want, &got, 0, &stall, &wake);
        if (wake) wake_sender(&seg->wk);
        if (got) {
            shm_msg *msgs = self->msgs;
            PyObject *b = hot_batch_adopt(seg, &self->msgs, got, self->nmsgs);
            if (b == NULL) give_back(seg, msgs, 0, got);
            if (self->msgs == NULL) self->nmsgs = 0; /* the batch took the array */
            return b;
        }
    }
    if (n >= 1 && timeout_plain(a[1]) && self->seg != NULL) { /* wait, as recv_many does */
        double deadline;
        if (plain_deadline(a[1], &deadline) < 0) return NULL;
        uint32_t want = n > (long)MAX_BATCH ? MAX_BATCH : (uint32_t)n;
        return receive(self, want | RECEIVE_BATCH, deadline, 1);
    }
    PyObject *mi = a[0] ? Py_NewRef(a[0]) : PyLong_FromLong(256);
    if (mi == NULL) return NULL;
    PyObject *res = PyObject_CallMethod((PyObject *)self, "_recv_batch_slow", "OO", mi, a[1]);
    Py_DECREF(mi);
    return res;
}

static PyMethodDef Receiver_methods[] = {
    {"_receive", (PyCFunction)Receiver_receive, METH_VARARGS,
     "_receive(n, deadline, block): the receive loop for the Python slow paths"},
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
    HOT_INIT_SUBCLASS, /* shmchan.Receiver's rx.recv(): CPython's quick C call (subclass.c) */
    {NULL},
};

PyTypeObject ReceiverType = {
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
