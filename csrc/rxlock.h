/* rxlock.h -- the receiver's process-local lock (shm_chan.rx_mu): one thread at a time in
 * consumer code.
 *
 * A mutex on a futex word, the three-state design of Drepper's "Futexes Are Tricky":
 *
 *     0  free
 *     1  held, nobody sleeping on it
 *     2  held, and a thread may be sleeping on it: its holder wakes one when it lets go
 *
 * lock:    CAS 0 -> 1 (acquire); taken: exchange in 2 (acquire) until it returned 0,
 *          sleeping on the word (FUTEX_WAIT, expecting 2) between the tries.
 * unlock:  exchange in 0 (release); if it was 2, FUTEX_WAKE one sleeper, which then takes
 *          the word with 2 (another thread may sleep still: it is woken in turn).
 *
 * Why not a pthread mutex: every receive and every release takes this lock. Uncontended,
 * lock and unlock here are one atomic each, as a default pthread mutex's are, without the
 * kind checks and owner bookkeeping around them (about 40 instructions a lock-unlock pair).
 * It is as correct for every caller, since all of them are threads of this process (a
 * thread releasing handles, the asyncio receive, an executor thread): the word lives in
 * the process's own heap (hence the private futex calls), never in shared memory, so
 * another process's death cannot leave it held, and a thread that dies holding it takes
 * its whole process along. After fork() the child starts with a free lock
 * (shm_set_identity): the parent's other threads do not exist there. Not recursive: a
 * thread never takes it twice (the default pthread mutex would deadlock there too).
 */
#ifndef SHMCHAN_RXLOCK_H
#define SHMCHAN_RXLOCK_H

#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint32_t word; /* 0 free, 1 held, 2 held and maybe slept on */
} rx_lock_t;

static inline void rx_lock_init(rx_lock_t *l) { __atomic_store_n(&l->word, 0, __ATOMIC_RELAXED); }

__attribute__((noinline, cold, unused)) static void rx_lock_wait(rx_lock_t *l, uint32_t seen) {
    /* acquire: as the fast path's CAS; pairs with the unlocking thread's release exchange */
    if (seen != 2) seen = __atomic_exchange_n(&l->word, 2, __ATOMIC_ACQUIRE);
    while (seen != 0) {
        /* sleeps only while the word is still 2: a wake between our exchange and this
         * call makes the kernel return at once (EAGAIN), and we try again */
        syscall(SYS_futex, &l->word, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
        seen = __atomic_exchange_n(&l->word, 2, __ATOMIC_ACQUIRE); /* as above */
    }
}

static inline void rx_lock(rx_lock_t *l) {
    uint32_t seen = 0;
    /* acquire: everything the previous holder wrote is visible; pairs with the release
     * exchange in rx_unlock */
    if (__builtin_expect(
            __atomic_compare_exchange_n(&l->word, &seen, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED), 1))
        return;
    rx_lock_wait(l, seen);
}

static inline void rx_unlock(rx_lock_t *l) {
    /* release: our writes are visible to the next holder; pairs with the acquire CAS or
     * exchange in rx_lock / rx_lock_wait */
    if (__builtin_expect(__atomic_exchange_n(&l->word, 0, __ATOMIC_RELEASE) == 2, 0))
        syscall(SYS_futex, &l->word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

#endif
