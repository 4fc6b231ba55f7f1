/* wake.h -- the wake-ups one process's attachment posts and sleeps on (csrc/hot/wake.c). */
#ifndef SHMCHAN_WAKE_H
#define SHMCHAN_WAKE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <semaphore.h>
#include <stdint.h>

#define WAKE_RX 0 /* the receiver's side: rx_sem, header.rx_wake_seq */
#define WAKE_TX 1 /* the senders' side:   tx_sem, header.tx_wake_seq */

/* One attachment's ends of the wake-ups: the two named semaphores the synchronous
 * sleepers block on, and the header's futex words an asyncio waiter waits on. */
typedef struct {
    sem_t *sem[2];            /* [WAKE_RX], [WAKE_TX]; NULL until wake_open            */
    uint32_t *seq[2];         /* header.rx_wake_seq, header.tx_wake_seq                */
    uint32_t *async_waiters;  /* header.async_waiters                                  */
    unsigned long long tx_posts; /* posts of the senders' semaphore by wake_sender (tests) */
} wake_ends;

/* Open the named semaphores and find the futex words in the header mapped at base (size
 * bytes). Returns 0, or -1 with a Python exception set (nothing opened then). */
int wake_open(wake_ends *w, const char *rx_name, const char *tx_name, const uint8_t *base,
              uint64_t size);
void wake_close(wake_ends *w);
/* The mapping is gone: forget the futex words (the semaphores stay usable). */
void wake_unmapped(wake_ends *w);

/* Post side `which` n times (at most 64): the semaphore and, when an asyncio waiter may
 * wait, its futex word. */
void wake_post(wake_ends *w, int which, unsigned n);
/* Wake one sender waiting for space, rationed (csrc/ring.c). */
void wake_sender(wake_ends *w);
/* Post what a release asked for: bit 8 the receiver, bit 9 one sender. */
void wake_requests(wake_ends *w, int r);
/* Post what a release of many asked for (its *wake): bit 0 the receiver, bit 1 one sender. */
void wake_released(wake_ends *w, int wake);
/* Sleep on side which's semaphore until posted or deadline (CLOCK_MONOTONIC seconds),
 * GIL released. -1 with the exception of a signal handler that raised, else 0. */
int wake_sleep(wake_ends *w, int which, double deadline);

/* For the asyncio helper (shmchan/aio.py). */
PyObject *wake_py_word(wake_ends *w, int which);          /* (address, value)        */
PyObject *wake_py_async_waiting(wake_ends *w, int delta); /* the count after delta    */
PyObject *wake_py_drain(wake_ends *w, int which);         /* posts taken             */
extern PyMethodDef wake_module_methods[];                 /* wait_words, notify, ... */

#endif
