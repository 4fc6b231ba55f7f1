/* pause.c -- the tests' pause points (shmchan.h SHM_PAUSE_*), the lowest layer of the core.
 *
 * Process-local: a test arms one point (shm_test_pause_at), and the first thread to reach
 * it stops there until the test lets it go, so that a race can be staged instruction by
 * instruction. Unarmed, test_pause costs one relaxed load, inline (core.h); armed,
 * exactly one thread pauses per arming (the CAS that disarms decides which). Every
 * mechanism may call test_pause; it calls nothing of the core.
 */
#include <unistd.h>

#include "core.h"

int shm_pause_point; /* the armed point, 0 = none: test_pause (core.h) loads it inline */
static int pause_notify = -1, pause_wait = -1;

int shm_test_pause_at(int point, int notify_fd, int wait_fd) {
    pause_notify = notify_fd;
    pause_wait = wait_fd;
    /* release: pairs with the acquire CAS in test_pause_armed (the fds above are visible). */
    __atomic_store_n(&shm_pause_point, point, __ATOMIC_RELEASE);
    return SHM_OK;
}

void test_pause_armed(int point) {
    int p = point;
    /* acquire: pairs with the release store in shm_test_pause_at; one pause per arming. */
    if (!__atomic_compare_exchange_n(&shm_pause_point, &p, 0, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        return;
    char b = 0;
    if (write(pause_notify, &b, 1) != 1) return;
    if (read(pause_wait, &b, 1) != 1) return;
}
