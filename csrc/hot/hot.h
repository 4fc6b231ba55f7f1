/* hot.h -- what the files of the _shmchan_hot extension share: the object structs of
 * its five types, the core's entry points (function pointers that bind() takes from the
 * loaded cffi module), the objects bind() hands over from Python, and the few helpers
 * more than one type calls.
 *
 * The extension makes each per-message call (send, recv, payload, release) a single C
 * call with no Python frame around it. Why it is not cffi like the rest: a cffi call
 * costs on the order of 100 ns before any work (argument conversion, errno save, GIL
 * release), and a Handle built in Python from the core's description costs several times
 * a whole message's budget at millions of messages per second.
 *
 * What the extension is not: it holds no shared-memory protocol. It calls the core only
 * through `hot_core` (so an instrumented build of the core, e.g. under AddressSanitizer,
 * is the one exercised here too), and it reads the segment only to copy a payload whose
 * offset and length the core validated, accepting the copy only if the core's seqlock
 * check (shm_unmoved, csrc/handles.c) says the record did not move meanwhile.
 *
 * Everything off the fast path -- a full channel, a pickled payload, an unusual key, a
 * closed object, maintenance, an error to raise -- is handed to a Python method of the
 * same object (`_send_slow`, `_recv_slow`, `_released`, ...), so each behaviour is
 * decided in one place, shmchan/channel.py, which subclasses each type here.
 *
 * Files, one per type: segment.c (SegmentBase, and the two named semaphores),
 * handle.c (HandleBase), batch.c (BatchBase), receiver.c (ReceiverBase), sender.c
 * (SenderBase), handover.c (hand_over / adopt_many), module.c (bind, module init);
 * subclass.c: what the Python subclasses take from their bases when they are made.
 * Names defined in one file and used in another start with hot_ (the type objects are
 * <Name>Type); the three small helpers of the per-message path are static inline here,
 * so each call still inlines; everything else is static to its file.
 */
#ifndef SHMCHAN_HOT_H
#define SHMCHAN_HOT_H

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
#include "wake.h"

/* ---------------------------------------------------------------------------------
 * the core's entry points, set once by bind() (module.c) from the loaded cffi module
 * --------------------------------------------------------------------------------- */
typedef int (*send_fn)(shm_chan *, uint32_t, const char *, uint64_t, const char *, uint32_t,
                       uint32_t, uint64_t *, shm_stall *, int *);
typedef int (*recv_fn)(shm_chan *, shm_msg *, uint32_t, uint32_t *, int, shm_stall *,
                       uint32_t *);
typedef int (*release_fn)(shm_chan *, uint32_t, uint32_t, int);
typedef int (*release_many_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t, int *);
typedef int (*unmoved_fn)(shm_chan *, uint32_t, uint64_t, uint64_t);
typedef uint32_t (*unmoved_many_fn)(shm_chan *, const shm_msg *, uint32_t);
typedef int (*release_msgs_fn)(shm_chan *, const shm_msg *, uint32_t, int *);
typedef int (*rx_spin_fn)(shm_chan *, uint32_t);
typedef int (*view_fn)(shm_chan *, uint32_t, uint32_t, shm_msg *);
typedef int (*send_many_handles_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t,
                                    int32_t *);
typedef double (*timers_wait_fn)(shm_chan *);
typedef int (*adopt_many_fn)(shm_chan *, const uint32_t *, const uint32_t *, uint32_t, uint64_t,
                             shm_msg *, int32_t *);
typedef int (*send_many_fn)(shm_chan *, uint32_t, const uint32_t *, const char *, uint64_t,
                            const uint64_t *, const char *, uint64_t, const uint32_t *,
                            const uint32_t *, uint64_t *, uint32_t *, shm_stall *, int *);

struct hot_core_fns {
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
    timers_wait_fn timers_wait; /* seconds to the next delayed message's time (timers.c) */
    unmoved_many_fn unmoved_many; /* unmoved for a batch: index of the first moved, or n */
    release_msgs_fn release_msgs; /* release_many for a batch's descriptions */
};
extern struct hot_core_fns hot_core;

/* set by bind() (module.c) */
extern PyTypeObject *hot_handle_type;   /* shmchan.Handle (a subclass of HandleBase)      */
extern PyTypeObject *hot_batch_type;    /* shmchan.Batch (BatchBase until bound)          */
extern PyObject *hot_encode_payload_fn; /* shmchan.codec.encode_payload, for pickling     */
extern PyObject *hot_encode_keys_fn;    /* shmchan.codec.encode_keys, for unusual keys    */
/* shmchan.InvalidArgument (a ValueError) and shmchan.UnsupportedType (a TypeError), for
 * the caller's mistakes found here; the builtins until bind() sets them */
extern PyObject *hot_exc_invalid, *hot_exc_type;
#define EXC_INVALID (hot_exc_invalid ? hot_exc_invalid : PyExc_ValueError)
#define EXC_TYPE (hot_exc_type ? hot_exc_type : PyExc_TypeError)

/* interned names of the Python-side slow paths (module.c) */
extern PyObject *hot_s_maintain, *hot_s_send_slow, *hot_s_recv_slow, *hot_s_recv_many_slow,
    *hot_s_release_many_slow, *hot_s_released, *hot_s_payload_slow, *hot_s_data_slow,
    *hot_s_keys_slow, *hot_s_live;

#define MAX_BATCH 65536u   /* messages one recv_many call takes at most */
#define SPIN_SECONDS 50e-6 /* longest spin before sleeping (the module's SPIN_SECONDS) */
#define SPIN_PAUSES 125u   /* CPU pauses per spin round (a few us), then a yield         */
#define STALL_SLEEP_SECONDS 0.002 /* a receiver's longest sleep behind a stuck claim      */
#define KEY_BUF 2048u      /* key blob bytes encoded on the stack; longer -> Python */

/* keys.c: a message's key blob being built (see keys.c for the encoding) */
typedef struct {
    uint8_t *buf;                       /* local, or a larger buffer (frame_keys)      */
    uint32_t cap, len;                  /* bytes of buf; bytes used                    */
    uint32_t n;                         /* distinct keys                               */
    size_t last;                        /* encoded size of the last key appended       */
    uint32_t start[SHM_MAX_KEYS_LIMIT]; /* where each key's frame begins               */
    uint8_t local[KEY_BUF];
} keyblob;
/* hot_key_append's results besides 1 (appended or merged) and -1 (an exception) */
#define KEY_NOT_A_KEY 0 /* not an exact str, bytes or int: codec.py decides       */
#define KEY_TOO_LONG 2  /* its encoding is longer than a u16 length can frame     */
#define KEY_NO_ROOM 3   /* buf is full                                             */
#define KEY_TOO_MANY 4  /* SHM_MAX_KEYS_LIMIT distinct keys already                */
void hot_keys_init(keyblob *kb);
int hot_key_append(keyblob *kb, PyObject *k);
int hot_key_single(keyblob *kb, PyObject *k); /* one key, common types: 1, or 0 */
size_t hot_key_write(uint8_t *f, size_t room, PyObject *k); /* framed, or 0 */
Py_ssize_t hot_keys_write_ints(uint8_t *out, size_t room, PyObject *const *keys, Py_ssize_t n,
                               uint32_t *klens, uint32_t *nkeys, size_t *used); /* int keys */
/* The n keys of a blob of len bytes, as a new tuple; NULL without an exception if the
 * blob is malformed, with one (MemoryError) if a key could not be made. */
PyObject *hot_keys_from_blob(const uint8_t *buf, size_t len, size_t n);
PyObject *hot_frame_keys(PyObject *mod, PyObject *keys);
PyObject *hot_decode_keys(PyObject *mod, PyObject *args);

/* ---------------------------------------------------------------------------------
 * the objects
 * --------------------------------------------------------------------------------- */
/* SegmentBase (segment.c): one process's attachment, as the hot path needs it */
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
    wake_ends wk;         /* its wake-ups: semaphores and futex words (wake.c)      */
} SegmentObject;

/* HandleBase (handle.c): a message on loan. A kept one is reused with only keys,
 * payload and done zeroed (handle_alloc): hot_make_handle writes every other field. */
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

/* BatchBase (batch.c): many messages on loan as one object */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg;
    Py_ssize_t n;     /* messages                                                   */
    Py_ssize_t left;  /* of them not yet released, given back or handed to a Handle */
    long pid;         /* releases on collection only in this process                */
    shm_msg *msgs;    /* the core's descriptions                                    */
    char *done;       /* per message: released, given back or handed to a Handle    */
} BatchObject;

/* ReceiverBase (receiver.c) */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg;       /* NULL once closed                                  */
    double next_maintenance;  /* time.monotonic() when recv() must run maintain()  */
    double spin;              /* seconds to spin before sleeping (adaptive, receive) */
    shm_msg *msgs;            /* the core's descriptions land here                */
    uint32_t nmsgs;
} ReceiverObject;

/* SenderBase (sender.c) */
typedef struct {
    PyObject_HEAD
    SegmentObject *seg; /* NULL once closed */
} SenderObject;

extern PyTypeObject SegmentType, HandleType, BatchType, ReceiverType, SenderType;

/* ---------------------------------------------------------------------------------
 * helpers shared by the types
 * --------------------------------------------------------------------------------- */
static inline double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock time.monotonic() reads */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A timeout the fast path may ignore: None or a non-negative number. Anything else goes
 * to the slow path, which raises the right error. */
static inline int timeout_plain(PyObject *t) {
    if (t == Py_None) return 1;
    if (PyFloat_CheckExact(t)) return PyFloat_AS_DOUBLE(t) >= 0.0;
    if (PyLong_CheckExact(t)) { /* any size; no conversion */
#if PY_VERSION_HEX < 0x030C0000
        return Py_SIZE(t) >= 0; /* before 3.12 an int's size carries its sign: no call */
#else
        return _PyLong_Sign(t) >= 0;
#endif
    }
    return 0;
}

/* Is the mapping gone (the owning Channel was closed in this process)? */
static inline int seg_detached(SegmentObject *s) {
    PyObject *d = s->detached;
    return d == NULL || !PyList_Check(d) || PyList_GET_SIZE(d) < 1 ||
           PyList_GET_ITEM(d, 0) != Py_False;
}

/* Keyword-aware parsing for METH_FASTCALL: fills out[0..nmax) from positional and
 * keyword arguments; out[] holds the defaults on entry. (module.c) */
int hot_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames, const char *const *names, int nreq, int nmax,
                   PyObject **out);

/* segment.c: getter and setter of Sender._seg, Receiver._seg and Handle._seg */
int hot_set_seg(SegmentObject **slot, PyObject *v);
PyObject *hot_get_seg(SegmentObject *s);

/* handle.c */
PyObject *hot_make_handle(SegmentObject *seg, const shm_msg *m);
int hot_release_core(HandleObject *h, int nack);
PyObject *hot_handles_from(PyObject *mod, PyObject *args);
void hot_handles_flush(void); /* frees the kept Handle memory (before bind changes the type) */

/* subclass.c: for a base's __init_subclass__ (see there). hot_subclass_args refuses
 * arguments (as object.__init_subclass__ does); hot_subclass_descriptors gives the
 * subclass its own copy of each base descriptor it does not override; hot_subclass_plain
 * gives a subclass that adds nothing to the object the base's uncollected memory and
 * `dealloc` (which must drop the object's type reference): 1 if it did, 0 if it could not. */
int hot_subclass_args(PyObject *cls, PyObject *args, PyObject *kwds);
int hot_subclass_descriptors(PyTypeObject *sub, PyTypeObject *base);
int hot_subclass_plain(PyTypeObject *sub, PyTypeObject *base, destructor dealloc);
/* The __init_subclass__ of a base whose subclasses take its descriptors as their own
 * (the base: the nearest C type above the subclass); HOT_INIT_SUBCLASS is its entry
 * in the base's method table. */
PyObject *hot_init_subclass(PyObject *cls, PyObject *args, PyObject *kwds);
#define HOT_INIT_SUBCLASS                                                                   \
    {"__init_subclass__", (PyCFunction)(void (*)(void))hot_init_subclass,                   \
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,                                             \
     "Give the subclass its own copies of this type's method and attribute descriptors."}

/* batch.c */
PyObject *hot_batch_new(SegmentObject *seg, const shm_msg *msgs, Py_ssize_t n);
PyObject *hot_batch_adopt(SegmentObject *seg, shm_msg **msgs, Py_ssize_t n, Py_ssize_t cap);
PyObject *hot_batch_from_handles(PyObject *mod, PyObject *args);

/* publish.c: PublisherBase and bind_exchange(), added to the module by its init */
int hot_publish_init(PyObject *m);

/* handover.c */
PyObject *hot_hand_over(PyObject *mod, PyObject *args);
PyObject *hot_adopt_many(PyObject *mod, PyObject *args);

#endif
