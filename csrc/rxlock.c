/* rxlock.c -- a self-test of the receiver's process-local lock (rxlock.h), for the tests:
 * threads of this process take the channel's own lock in turns and count under it.
 *
 * Each round reads the count, pauses a little and writes it back plus one, all while
 * holding the lock: two threads inside at once lose rounds, so the final count says
 * whether the lock excluded them. The pause widens that window so that a lock that does
 * not exclude is caught, and makes the threads meet at the lock, so that its sleeping
 * path (rx_lock_wait, the wake in rx_unlock) runs too.
 */
#include <pthread.h>
#include <stdlib.h>

#include "core.h"

typedef struct {
    shm_chan *c;
    uint32_t rounds;
    volatile uint64_t *count;
} lock_test;

static void *lock_rounds(void *arg) {
    lock_test *t = arg;
    for (uint32_t i = 0; i < t->rounds; i++) {
        rx_lock(&t->c->rx_mu);
        uint64_t n = *t->count;
        for (int spin = 0; spin < 64; spin++) CPU_RELAX();
        *t->count = n + 1;
        rx_unlock(&t->c->rx_mu);
    }
    return NULL;
}

int shm_test_rx_lock(shm_chan *c, uint32_t threads, uint32_t rounds, uint64_t *count) {
    if (threads == 0 || threads > 64) return SHM_E_INVALID;
    pthread_t tid[64];
    volatile uint64_t total = 0;
    lock_test t = {c, rounds, &total};
    uint32_t started = 0;
    for (; started < threads; started++)
        if (pthread_create(&tid[started], NULL, lock_rounds, &t) != 0) break;
    for (uint32_t i = 0; i < started; i++) pthread_join(tid[i], NULL);
    *count = total;
    return started == threads ? SHM_OK : SHM_E_NOMEM;
}
