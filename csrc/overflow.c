/* overflow.c -- the shared words of a channel's overflow to disk (shmchan/overflow.py).
 *
 * A channel created with overflow=DIR spills to one append-only file in DIR when its ring
 * is full, instead of making senders wait. The file's format, its lock and the drain loop
 * are the Python layer's (shmchan/overflow.py, whose block comment has the whole
 * protocol); this file holds the words in the segment's header that every process must
 * agree on, so that the ring and the file stay one queue:
 *
 *   overflowing  1 from the moment an appender (holding the file's lock) is about to
 *                append, until the drainer (holding the lock) finds [head, tail) empty.
 *                While it is 1, send_one (ring.c) refuses every send FULL except the
 *                drainer's: a send that finds it set goes to the file too, behind every
 *                record there. So the ring order (seq) of all messages is their order of
 *                acceptance, file records included, and per-key FIFO and each producer's
 *                order follow from it unchanged.
 *   ovf_tail     the file offset just past the last whole record. Stored (release) only
 *                after the record's bytes were written: bytes past it belong to an
 *                appender that died mid-write, are never read, and are cut off by the
 *                next appender (under the lock) before it writes.
 *   ovf_head     the first record not yet taken back into the ring, advanced by the
 *                drainer after each record it sent into the ring: a receiver that dies
 *                between the two sends that one message again (at-least-once).
 *   counters     appended (appenders), drained and skipped (the drainer): the messages
 *                on disk are appended - drained - skipped.
 *
 * The drainer is the only process whose sends pass `overflowing` (and shutdown: what was
 * accepted into the file before a shutdown is still delivered). The receiver does not
 * report CLOSED while `overflowing` is set (handles.c), so it waits for the drain.
 *
 * Orderings:
 *   appender   overflowing = 1 (seq_cst) -> check shutdown (seq_cst) -> write -> tail
 *              (release). Dekker pair with shm_shutdown + the receiver's seq_cst load of
 *              overflowing: either the appender sees the shutdown and refuses, or the
 *              receiver sees overflowing and waits for the drain.
 *   drainer    ring commits -> overflowing = 0 (seq_cst): a sender whose acquire load in
 *              send_one reads 0 claims after the drained records (its seq is higher).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>

#include "core.h"

/* The creator, once, before handing the channel to anyone: the directory and limit. */
int shm_ovf_setup(shm_chan *c, const char *dir, uint32_t dir_len, uint64_t limit) {
    shm_header *h = c->hdr;
    if (dir_len == 0 || dir_len > SHM_OVF_DIR_MAX || limit == 0) return SHM_E_INVALID;
    if (LOAD_ACQUIRE(&h->ovf_dir_len) != 0) return SHM_E_INVALID; /* set once */
    memcpy(h->ovf_dir, dir, dir_len);
    STORE_RELAXED(&h->ovf_limit, limit);
    /* release: pairs with shm_ovf_read's acquire load; the directory and limit first. */
    STORE_RELEASE(&h->ovf_dir_len, dir_len);
    return SHM_OK;
}

/* Any process: the overflow's configuration (dir copied if dir_cap allows) and state.
 * dir_len 0: the channel has no overflow. */
int shm_ovf_read(shm_chan *c, shm_ovf_state *out, char *dir, uint32_t dir_cap) {
    shm_header *h = c->hdr;
    memset(out, 0, sizeof *out);
    uint32_t n = LOAD_ACQUIRE(&h->ovf_dir_len); /* pairs with shm_ovf_setup */
    if (n == 0) return SHM_OK;
    if (n > SHM_OVF_DIR_MAX) return SHM_E_CORRUPT;
    out->dir_len = n;
    if (dir && dir_cap >= n) memcpy(dir, h->ovf_dir, n);
    out->limit = LOAD_RELAXED(&h->ovf_limit);
    /* acquire: pairs with the drainer's release in shm_ovf_taken (then tail is at least
     * as new as the head it read) and with appenders' release in shm_ovf_published. */
    out->head = LOAD_ACQUIRE(&h->ovf_head);
    out->tail = LOAD_ACQUIRE(&h->ovf_tail);
    out->appended = LOAD_RELAXED(&h->ovf_appended);
    out->drained = LOAD_RELAXED(&h->ovf_drained);
    out->skipped = LOAD_RELAXED(&h->ovf_skipped);
    out->overflowing = LOAD_SEQCST(&h->overflowing); /* pairs with begin / finish */
    return SHM_OK;
}

/* An appender, holding the file's lock, before it writes: sends go to the file from now
 * on. SHM_CLOSED / SHM_REMOVED if the channel no longer takes sends (nothing written). */
int shm_ovf_begin(shm_chan *c) {
    shm_header *h = c->hdr;
    if (LOAD_ACQUIRE(&h->ovf_dir_len) == 0) return SHM_E_INVALID;
    /* seq_cst: the Dekker pair described at the top (with shm_shutdown and the
     * receiver's load of overflowing in handles.c). */
    STORE_SEQCST(&h->overflowing, 1);
    uint32_t down = LOAD_SEQCST(&h->shutdown);
    if (down) return down & SHUTDOWN_REMOVED ? SHM_REMOVED : SHM_CLOSED;
    return SHM_OK;
}

/* An appender, holding the file's lock, after writing nmsgs whole records up to tail. */
int shm_ovf_published(shm_chan *c, uint64_t tail, uint64_t nmsgs) {
    shm_header *h = c->hdr;
    if (tail < LOAD_RELAXED(&h->ovf_tail)) return SHM_E_INVALID;
    /* relaxed: only appenders write it, one at a time under the file's lock */
    STORE_RELAXED(&h->ovf_appended, LOAD_RELAXED(&h->ovf_appended) + nmsgs);
    /* release: pairs with the drainer's acquire in shm_ovf_read: the bytes up to tail
     * were written before (a pwrite, visible through the page cache). */
    STORE_RELEASE(&h->ovf_tail, tail);
    return SHM_OK;
}

/* The drainer: records up to head are in the ring (nmsgs sent, nskipped corrupt). */
int shm_ovf_taken(shm_chan *c, uint64_t head, uint64_t nmsgs, uint64_t nskipped) {
    shm_header *h = c->hdr;
    if (head > LOAD_ACQUIRE(&h->ovf_tail) || head < LOAD_RELAXED(&h->ovf_head))
        return SHM_E_INVALID;
    /* relaxed: the drainer is their only writer (stats read them approximately) */
    STORE_RELAXED(&h->ovf_drained, LOAD_RELAXED(&h->ovf_drained) + nmsgs);
    STORE_RELAXED(&h->ovf_skipped, LOAD_RELAXED(&h->ovf_skipped) + nskipped);
    /* release: pairs with the acquire in shm_ovf_read (stats, appenders' limit check) */
    STORE_RELEASE(&h->ovf_head, head);
    return SHM_OK;
}

/* The drainer, holding the file's lock, with the file about to be truncated to 0: if
 * everything was taken back, start the file again and let sends into the ring.
 * SHM_OK when done, SHM_AGAIN if records remain (nothing changed). */
int shm_ovf_finish(shm_chan *c) {
    shm_header *h = c->hdr;
    if (LOAD_ACQUIRE(&h->ovf_head) != LOAD_ACQUIRE(&h->ovf_tail)) return SHM_AGAIN;
    /* relaxed: appenders, who read them, hold the lock we hold */
    STORE_RELAXED(&h->ovf_tail, 0);
    STORE_RELAXED(&h->ovf_head, 0);
    /* seq_cst: after the drained records' ring commits; pairs with send_one's acquire
     * load (a sender that reads 0 claims behind them) and with the receiver's seq_cst
     * load before it reports CLOSED. */
    STORE_SEQCST(&h->overflowing, 0);
    return SHM_OK;
}

/* Make this attachment the drainer's: its sends pass the overflowing and shutdown checks.
 * Process-local; only the receiver's process makes one (shmchan/overflow.py). */
int shm_ovf_drainer(shm_chan *c) {
    if (LOAD_ACQUIRE(&c->hdr->ovf_dir_len) == 0) return SHM_E_INVALID;
    c->ovf_drainer = 1;
    return SHM_OK;
}

/* The CRC-32C of a record (shmchan/overflow.py): of its header from byte 8 on, its key
 * blob and its payload, as if they were one buffer (none of them is copied). */
int shm_ovf_crc(const char *head, uint64_t nhead, const char *blob, uint64_t nblob,
                const char *data, uint64_t ndata, uint32_t *out) {
    uint32_t crc = crc32c(0, head, nhead);
    crc = crc32c(crc, blob, nblob);
    *out = crc32c(crc, data, ndata);
    return SHM_OK;
}

/* The drainer: give back the disk blocks of the records before `upto` that it has taken
 * back (a hole punched from 0, whole pages; offsets and the file's size are unchanged),
 * so a file that never quite drains does not keep every block it ever held.
 * SHM_E_SYS with errno set if the file system cannot (then the blocks wait for the
 * truncation when the file drains). */
int shm_ovf_punch(int fd, uint64_t upto) {
    upto &= ~(uint64_t)4095;
    if (upto == 0) return SHM_OK;
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)upto) != 0)
        return SHM_E_SYS;
    return SHM_OK;
}
