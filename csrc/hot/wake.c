/* wake.c -- the wake-ups: how a sleeping receiver or a sender waiting for space learns
 * that it should look again.
 *
 * Two kinds of sleeper, one protocol. The decision *whether* to wake is made in the core,
 * by an eventcount per side (csrc/handles.c for the receiver: rx_sleeping, csrc/ring.c for
 * senders waiting for space: space_waiters and the rationing rules); the core returns it as
 * a request, and this file carries it out:
 *
 *   synchronous sleepers block on the channel's two named POSIX semaphores (rx_sem, tx_sem)
 *   with the GIL released: one post per request (senders: rationed, see wake_sender).
 *
 *   asyncio waiters (shmchan/aio.py) do not block a thread each. One helper thread per
 *   process waits with futex_waitv on a 32-bit word per side in the header (rx_wake_seq,
 *   tx_wake_seq) of every channel awaited in the process, plus a private word of its own
 *   that says "the set changed". Every request adds one to its side's word and FUTEX_WAKEs
 *   it (a shared futex: the words live in the MAP_SHARED segment, /dev/shm or a durable
 *   file alike), but only while header.async_waiters says someone may be waiting: a
 *   channel nobody awaits pays no system call of its own, and nothing at all on the send
 *   and receive fast paths, which request no wake-up.
 *
 * No lost wake-up for an asyncio waiter. The waiter, in this order:
 *     1. async_waiters += 1                  (seq_cst; wake_py_async_waiting)
 *     2. W = the side's word                 (seq_cst; wake_py_word)
 *     3. arm as a synchronous sleeper would  (rx_sleeping = 1, or count in space_waiters,
 *        both seq_cst) and poll once more
 *     4. futex_waitv until the word is not W (the kernel compares under its bucket lock)
 * A waker that sees the arm (its CAS of rx_sleeping, or its load of space_waiters after
 * the consumer's fence) issues a seq_cst fence, loads async_waiters -- which then reads at
 * least the waiter's 1 -- and adds one to the word: after W was read, so either step 4
 * finds the word changed or the FUTEX_WAKE finds the waiter queued. A waker that does not
 * see the arm is one whose work the poll in step 3 sees.
 *
 * async_waiters is a count over all processes: a waiter killed while counted leaves it
 * too high, which costs each later request one futex system call (no lost wake-up, no
 * error). The words wrap; only "changed since W" matters.
 *
 * The semaphores and the words carry the same requests, so an asyncio waiter also leaves
 * posts in the semaphore: the receiver's (it is its only sleeper) is drained by the
 * asyncio receiver before each wait (wake_py_drain); the senders' is shared with
 * synchronous senders and left alone (an unconsumed post makes one sender poll once).
 */
#include "wake.h" /* first: Python.h sets the feature macros (sem_clockwait) */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449 /* Linux >= 5.16 */
#endif
#define WAIT_WORDS_MAX 127 /* futex_waitv takes 128 words: the private one and these */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int wake_open(wake_ends *w, const char *rx_name, const char *tx_name, const uint8_t *base,
              uint64_t size) {
    if (base == NULL || size < sizeof(shm_header)) {
        PyErr_Format(PyExc_ValueError, "a mapping too small for the header");
        return -1;
    }
    sem_t *rx = sem_open(rx_name, 0);
    if (rx == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, rx_name);
        return -1;
    }
    sem_t *tx = sem_open(tx_name, 0);
    if (tx == SEM_FAILED) {
        sem_close(rx);
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, tx_name);
        return -1;
    }
    wake_close(w);
    w->sem[WAKE_RX] = rx;
    w->sem[WAKE_TX] = tx;
    /* The words sit at fixed offsets of the header, inside the mapping (checked above). */
    shm_header *h = (shm_header *)(uintptr_t)base;
    w->seq[WAKE_RX] = &h->rx_wake_seq;
    w->seq[WAKE_TX] = &h->tx_wake_seq;
    w->async_waiters = &h->async_waiters;
    return 0;
}

void wake_close(wake_ends *w) {
    for (int i = 0; i < 2; i++) {
        if (w->sem[i]) sem_close(w->sem[i]);
        w->sem[i] = NULL;
        w->seq[i] = NULL;
    }
    w->async_waiters = NULL;
}

void wake_unmapped(wake_ends *w) {
    w->seq[WAKE_RX] = w->seq[WAKE_TX] = NULL;
    w->async_waiters = NULL;
}

/* The futex half of a request (see the top of this file). */
static void wake_async(wake_ends *w, int which) {
    uint32_t *word = w->seq[which];
    if (word == NULL) return;
    /* seq_cst fence: pairs with the waiter's seq_cst add of async_waiters (step 1), which
     * it made before arming: we saw the arm, so we see the count. */
    FENCE_SEQCST();
    if (LOAD_RELAXED(w->async_waiters) == 0) return; /* ordered by the fence */
    /* seq_cst: after the waiter's load of the word (step 2), which came before its arm;
     * pairs with that load and with the kernel's compare in futex_waitv (step 4). */
    FETCH_ADD_SEQCST(word, 1);
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void wake_post(wake_ends *w, int which, unsigned n) {
    sem_t *sem = w->sem[which & 1];
    for (unsigned i = 0; sem != NULL && i < n && i < 64; i++) sem_post(sem);
    if (n > 0) wake_async(w, which & 1);
}

/* Wake one sender waiting for space, unless an earlier post is still unconsumed: that one
 * already makes a waiter look again (the rationing rule, csrc/ring.c). sem_getvalue reads
 * the count without a system call. An asyncio sender does not consume posts, so its word
 * moves on every request, rationed or not. */
void wake_sender(wake_ends *w) {
    int v = 0;
    wake_async(w, WAKE_TX);
    if (w->sem[WAKE_TX] == NULL || (sem_getvalue(w->sem[WAKE_TX], &v) == 0 && v > 0)) return;
    sem_post(w->sem[WAKE_TX]);
    w->tx_posts++;
}

#define WAKE_RX_BIT (1 << 8) /* shm_release's wake-up requests (csrc/handles.c) */
#define WAKE_TX_BIT (1 << 9)

void wake_requests(wake_ends *w, int r) {
    if (r & WAKE_RX_BIT) wake_post(w, WAKE_RX, 1);
    if (r & WAKE_TX_BIT) wake_sender(w);
}

void wake_released(wake_ends *w, int wake) {
    if (wake & 1) wake_post(w, WAKE_RX, 1);
    if (wake & 2) wake_sender(w);
}

/* A signal ends the wait after its Python handler ran; if the handler raised, returns -1
 * with that exception (as PEP 475 has system calls do). Otherwise 1 if the wait consumed a
 * post, 0 if it ended without one: the caller re-checks whatever it waits for either way. */
int wake_sleep(wake_ends *w, int which, double deadline) {
    sem_t *sem = w->sem[which & 1];
    if (sem == NULL) return 0;
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    int r, err;
    Py_BEGIN_ALLOW_THREADS
    r = sem_clockwait(sem, CLOCK_MONOTONIC, &ts);
    err = errno;
    Py_END_ALLOW_THREADS
    if (r < 0 && err == EINTR && PyErr_CheckSignals() < 0) return -1;
    return r == 0;
}

/* ---- the asyncio side (shmchan/aio.py) ------------------------------------------------ */

PyObject *wake_py_word(wake_ends *w, int which) {
    uint32_t *word = w->seq[which & 1];
    if (word == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    /* seq_cst: step 2, after the add of async_waiters and before the arm; pairs with the
     * waker's seq_cst add in wake_async. */
    uint32_t v = LOAD_SEQCST(word);
    return Py_BuildValue("(KI)", (unsigned long long)(uintptr_t)word, (unsigned int)v);
}

PyObject *wake_py_async_waiting(wake_ends *w, int delta) {
    if (w->async_waiters == NULL) return PyErr_Format(PyExc_ValueError, "an unbound segment");
    uint32_t now;
    if (delta >= 0) {
        /* seq_cst: step 1; pairs with the fence in wake_async. */
        now = FETCH_ADD_SEQCST(w->async_waiters, 1) + 1;
    } else {
        /* seq_cst as well; stops at 0, so a count that went wrong heals (as
         * space_count_sub does, csrc/ring.c). */
        now = LOAD_RELAXED(w->async_waiters); /* only a first guess: the CAS checks it */
        while (!CAS_SEQCST(w->async_waiters, &now, now > 0 ? now - 1 : 0)) {
        }
        now = now > 0 ? now - 1 : 0;
    }
    return PyLong_FromUnsignedLong(now);
}

PyObject *wake_py_drain(wake_ends *w, int which) {
    sem_t *sem = w->sem[which & 1];
    long n = 0;
    while (sem != NULL && n < 1000000 && sem_trywait(sem) == 0) n++;
    return PyLong_FromLong(n);
}

/* The helper thread's "the set of words changed" word: private to this process. */
static uint32_t private_word;

/* wait_words(addresses, values, private_value, seconds) -> int: futex_waitv on each
 * address (a header word, while its mapping is held by the caller) expecting values[i],
 * and on the private word expecting private_value, for up to seconds, GIL released.
 * Returns the index of a word woken (0 = the private one, i + 1 = addresses[i]), or
 * -errno: -EAGAIN a word was not its expected value, -ETIMEDOUT, -EINTR, -EFAULT. */
static PyObject *wait_words(PyObject *mod, PyObject *args) {
    PyObject *addrs, *vals;
    unsigned int pv;
    double seconds;
    if (!PyArg_ParseTuple(args, "O!O!Id", &PyList_Type, &addrs, &PyList_Type, &vals, &pv,
                          &seconds))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(addrs);
    if (n != PyList_GET_SIZE(vals) || n > WAIT_WORDS_MAX)
        return PyErr_Format(PyExc_ValueError, "wait_words: at most %d words, one value each",
                            WAIT_WORDS_MAX);
    struct futex_waitv wv[WAIT_WORDS_MAX + 1];
    memset(wv, 0, sizeof wv);
    wv[0].uaddr = (uint64_t)(uintptr_t)&private_word;
    wv[0].val = pv;
    wv[0].flags = FUTEX_32 | FUTEX_PRIVATE_FLAG;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long a = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addrs, i));
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(vals, i));
        if (PyErr_Occurred()) return NULL;
        if (a == 0 || (a & 3)) return PyErr_Format(PyExc_ValueError, "a misaligned word");
        wv[i + 1].uaddr = a;
        wv[i + 1].val = (uint32_t)v;
        wv[i + 1].flags = FUTEX_32; /* shared: other processes wake it */
    }
    double deadline = monotonic_now() + (seconds > 0 ? (seconds < 1e6 ? seconds : 1e6) : 0.0);
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    long r;
    int err;
    Py_BEGIN_ALLOW_THREADS
    r = syscall(SYS_futex_waitv, wv, (unsigned)(n + 1), 0, &ts, CLOCK_MONOTONIC);
    err = errno;
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r >= 0 ? r : -err);
}

/* notify(): the set of words changed; wake the helper waiting in wait_words. */
static PyObject *notify(PyObject *mod, PyObject *unused) {
    /* seq_cst: pairs with the helper's load in private_value before it snapshots the set */
    FETCH_ADD_SEQCST(&private_word, 1);
    syscall(SYS_futex, &private_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    Py_RETURN_NONE;
}

/* private_value(): the private word now (taken before the helper reads the set). */
static PyObject *private_value(PyObject *mod, PyObject *unused) {
    return PyLong_FromUnsignedLong(LOAD_SEQCST(&private_word)); /* pairs with notify's add */
}

PyMethodDef wake_module_methods[] = {
    {"wait_words", wait_words, METH_VARARGS,
     "wait_words(addresses, values, private_value, seconds) -> index woken or -errno"},
    {"notify", notify, METH_NOARGS, "notify(): wake the helper waiting in wait_words"},
    {"private_value", private_value, METH_NOARGS, "private_value(): the helper's own word"},
    {NULL},
};
