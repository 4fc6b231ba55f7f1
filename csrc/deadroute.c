/* deadroute.c -- where a channel's dead letters go: the name of an exchange.
 *
 * A channel may name an exchange (shmchan.Exchange) to which its dead letters -- messages
 * out of attempts, or expired (timers.c) -- are published instead of being kept in the
 * dead-letter list. The publishing is done by the receiver's upkeep in Python
 * (shmchan/deadroute.py); the core only keeps the name, in the header, so that every
 * receiver of the channel, a restarted one too, and a durable channel reopened after a
 * reboot, routes them the same way.
 *
 * The name is written by any process (rarely: at create, or by route_dead_letters) and
 * read by the receiver, with a seqlock in one word:
 *     dlx_word = (version << 16) | name length      (version odd while being written)
 * A writer CASes the word from an even version to version + 1 (odd), writes the name,
 * then stores (version + 2, length) with release. A reader loads the word (acquire), copies
 * the name, loads the word again after an acquire fence, and keeps the copy only if both
 * loads are the same even word. A writer killed mid-way leaves the version odd: the next
 * writer takes it over (its CAS accepts an odd word older than a bound of tries), and
 * readers meanwhile see no route (SHM_BUSY), which keeps dead letters in the list --
 * nothing is lost. Nothing read here is trusted: the length is bounds-checked, and a name
 * that names no exchange is the Python side's to refuse.
 */
#include "core.h"

#define DLX_LEN(w) ((w)&0xffffu)
#define DLX_VER(w) ((w) >> 16)
#define DLX_TRIES 64

int shm_dead_route_set(shm_chan *c, const char *name, uint32_t name_len) {
    if (name_len > SHM_GATE_NAME_MAX) return SHM_E_INVALID;
    shm_header *h = c->hdr;
    uint32_t w = LOAD_ACQUIRE(&h->dlx_word); /* pairs with the release stores below */
    for (int tries = 0;; tries++) {
        /* an odd version is a writer mid-way: wait a little for it, then take over (it
         * may have died there) */
        if ((DLX_VER(w) & 1u) && tries < DLX_TRIES) {
            CPU_RELAX();
            w = LOAD_ACQUIRE(&h->dlx_word);
            continue;
        }
        uint32_t mine = ((DLX_VER(w) | 1u) + ((DLX_VER(w) & 1u) ? 2u : 0u)) & 0xffffu;
        /* seq_cst CAS: one writer at a time; pairs with other writers' CAS */
        if (CAS_SEQCST(&h->dlx_word, &w, mine << 16)) {
            memcpy(h->dlx_name, name, name_len);
            /* release: the name above is visible before the even version; pairs with the
             * readers' acquire loads in shm_dead_route_get */
            STORE_RELEASE(&h->dlx_word, (((mine + 1u) & 0xffffu) << 16) | name_len);
            return SHM_OK;
        }
        if (tries > 4 * DLX_TRIES) return SHM_BUSY;
    }
}

int shm_dead_route_get(shm_chan *c, char *name, uint32_t *name_len) {
    shm_header *h = c->hdr;
    for (int tries = 0; tries < DLX_TRIES; tries++) {
        uint32_t w = LOAD_ACQUIRE(&h->dlx_word); /* pairs with the writer's release store */
        if (DLX_VER(w) & 1u) {
            CPU_RELAX();
            continue;
        }
        uint32_t n = DLX_LEN(w);
        if (n > SHM_GATE_NAME_MAX) return SHM_E_CORRUPT;
        memcpy(name, h->dlx_name, n);
        /* acquire fence: the copy above is done before the word is read again; pairs with
         * the writer's CAS to an odd version before it changes the name */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (LOAD_RELAXED(&h->dlx_word) == w) {
            *name_len = n;
            return SHM_OK;
        }
    }
    return SHM_BUSY;
}
