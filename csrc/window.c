/* window.c -- taking records into the scheduler, even when its window is full.
 *
 * The scheduler works on the messages in its window: at most max_messages of them have
 * a slot in the message table at once. A message waiting for a held key keeps its slot,
 * so a long enough backlog behind one hot key could fill the window and hide, behind
 * it, a message on a free key that the fifo rule says may go. Under order="fifo" the
 * receiver therefore takes records in *out of order* when it is safe:
 *
 *     head     ingest_pos                          scan_pos
 *      |  ...   | skipped | taken | skipped | done |   not yet looked at ...
 *
 *   - scan_pos is the next record to look at; ingest_pos the first one not taken in.
 *     Between them every record is either taken in (its slot names it), finished, or
 *     *skipped*: left out of the window, with each of its keys' `skipped` count raised.
 *   - A record at scan_pos carrying a key with skipped > 0 is skipped too: a message
 *     ahead of it on that key is not in the lines, so it must not join them yet.
 *     Any other record conflicts with no skipped message and is taken in at once, which
 *     gives the lines exactly the order taking everything in would have given.
 *   - When the window is full, the newest *waiting* message is *evicted*: it is last in
 *     each of its lines (sched_evict), so unlinking it undoes its taking in exactly; it
 *     becomes a skipped record. This makes room for the record at scan_pos, and repeats
 *     while there is a waiting message to evict.
 *   - Skipped records return, oldest first from ingest_pos, whenever there is room, at
 *     the start of each poll; a returned message may be evicted again by a newer record
 *     in the same poll, which then has made progress: no poll can loop.
 * Each record is looked at a bounded number of times per eviction, and every step is
 * O(keys of the record): no step scans the backlog.
 *
 * Limits: a skipped record still occupies ring space, and head never passes ingest_pos,
 * so a skipped backlog pins the space behind it until it drains; order="eager" has no
 * lines to keep and stops at a full window as before.
 */
#include "core.h"

#define INGEST_BATCH 256u /* records looked at per poll: bounds one call's work */
#define EVICT_SEARCH 1024u /* how far back past non-waiting messages eviction looks */

#define SLOT_OK(c, s) ((s) >= 1 && (s) <= (c)->cfg.max_messages)

void window_link(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    c->slots[s].newer = NIL;
    c->slots[s].older = h->newest;
    if (SLOT_OK(c, h->newest)) c->slots[h->newest].newer = s;
    else h->oldest = s;
    h->newest = s;
}

void window_unlink(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    uint32_t newer = c->slots[s].newer, older = c->slots[s].older;
    if (SLOT_OK(c, newer)) c->slots[newer].older = older;
    else if (h->newest == s) h->newest = SLOT_OK(c, older) ? older : NIL;
    if (SLOT_OK(c, older)) c->slots[older].newer = newer;
    else if (h->oldest == s) h->oldest = SLOT_OK(c, newer) ? newer : NIL;
    c->slots[s].newer = c->slots[s].older = NIL;
}

static int finished_state(uint32_t st) {
    return st == REC_DONE || st == REC_DISCARDED || st == REC_CANCELLED;
}

/* Take the record at pos into the window; it gets slot *s. */
static int take(shm_chan *c, shm_record *r, uint64_t pos) {
    uint32_t s;
    return sched_take_in(c, r, pos, &s);
}

/* Evict the newest waiting message. Those newer than it are ready, in flight or dead:
 * none shares a key with it (it would be behind it in that line, so waiting), so it is
 * last in each of its lines. Returns 1 if it evicted one. */
static int evict_newest(shm_chan *c, int *rc) {
    shm_header *h = c->hdr;
    uint32_t s = h->newest;
    for (uint32_t steps = 0; SLOT_OK(c, s) && steps < EVICT_SEARCH; steps++) {
        if (SLOT_STATE(c->slots[s].state) == SLOT_WAITING) break;
        s = c->slots[s].older;
    }
    if (!SLOT_OK(c, s) || SLOT_STATE(c->slots[s].state) != SLOT_WAITING) return 0;
    shm_slot *sl = &c->slots[s];
    uint64_t pos = sl->pos;
    int e = sched_evict(c, s);
    if (e == SHM_STALE) return 0;
    if (e) {
        *rc = e;
        return 0;
    }
    rec_at(c, pos)->slot = NIL; /* a skipped record again */
    h->queued_in_window--;
    h->ingested--;
    h->skipped++;
    slot_free(c, s);
    if (pos < h->ingest_pos) h->ingest_pos = pos;
    return 1;
}

/* Phase 1: bring skipped records back, in order, while there is room to spare. */
static int return_skipped(shm_chan *c) {
    shm_header *h = c->hdr;
    for (uint32_t i = 0; i < INGEST_BATCH && h->ingest_pos < h->scan_pos; i++) {
        uint64_t pos = h->ingest_pos;
        shm_record *r = rec_at(c, pos);
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
        uint64_t len = META_LEN(meta);
        if (len < REC_HDR || (len & 7u) || len > h->scan_pos - pos) return SHM_E_CORRUPT;
        uint32_t st = META_STATE(meta);
        if (finished_state(st) || (st == REC_COMMITTED && r->slot != NIL)) {
            h->ingest_pos = pos + len; /* finished, or taken in out of order */
            continue;
        }
        if (st != REC_COMMITTED || ring_validate_body(c, r, len)) return SHM_E_CORRUPT;
        if (!sched_has_room(c, r->nkeys)) break;
        int rc = sched_skip_count(c, r, -1);
        if (rc == SHM_OK) rc = take(c, r, pos);
        if (rc) return rc;
        h->skipped--;
        h->ingest_pos = pos + len;
    }
    return SHM_OK;
}

int window_ingest(shm_chan *c, shm_stall *stall, int *stalled) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    int rc = SHM_OK;
    if (h->ingest_pos < h->scan_pos) {
        rc = return_skipped(c);
        if (rc) return rc;
    }
    for (uint32_t i = 0; i < INGEST_BATCH; i++) {
        uint64_t pos = h->scan_pos, len;
        shm_record *r;
        rc = ring_peek(c, pos, &r, &len, stall);
        if (rc == SHM_EMPTY) return SHM_OK;
        if (rc == SHM_STALLED) {
            *stalled = 1;
            return SHM_OK;
        }
        int caught_up = h->ingest_pos == pos;
        if (rc == SHM_CLOSED) { /* discarded or cancelled: skip */
            if (META_STATE(LOAD_RELAXED(&r->meta)) == REC_DISCARDED) h->discarded++;
        } else if (rc) {
            return rc;
        } else if (!caught_up && sched_is_skipped_key(c, r)) {
            rc = sched_skip_count(c, r, +1); /* behind a skipped message on some key */
            if (rc) return rc;
            r->slot = NIL;
            h->skipped++;
        } else {
            while (!sched_has_room(c, r->nkeys)) {
                if (!fifo || !evict_newest(c, &rc)) {
                    /* Nothing to evict. rc is set only if the segment is corrupt */
                    return rc;
                }
                caught_up = h->ingest_pos == pos;
                if (!caught_up && sched_is_skipped_key(c, r)) break; /* evicted its elder */
            }
            if (!caught_up && sched_is_skipped_key(c, r)) {
                rc = sched_skip_count(c, r, +1);
                if (rc) return rc;
                r->slot = NIL;
                h->skipped++;
            } else {
                rc = take(c, r, pos);
                if (rc) return rc;
            }
        }
        h->scan_pos = pos + len;
        if (caught_up) h->ingest_pos = h->scan_pos;
    }
    return SHM_OK;
}
