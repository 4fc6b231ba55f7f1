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
 *   - Skipped records return (return_skipped) in order when they would be free to go at
 *     once, evicting the newest waiting message if need be, so the window fills with
 *     what can run. One that would only wait stays out, since waiting needs no slot --
 *     except while refilling a window that fell below a quarter full, up to half full
 *     (it joins its lines' tails, behind older messages only), so that a long backlog
 *     drains through the window in batches. A pass that brings nothing back is not
 *     repeated until something it depends on changes (window_ingest).
 * Each record is looked at a bounded number of times per eviction, and every step is
 * O(keys of the record): no step scans the backlog.
 *
 * Limits: a skipped record still occupies ring space, and head never passes ingest_pos,
 * so a skipped backlog pins the space behind it until it drains; order="eager" has no
 * lines to keep and stops at a full window as before.
 */
#include "core.h"

#define INGEST_BATCH 256u /* records looked at per poll: bounds one call's work */
#define READY_AHEAD 256u  /* take new records in while fewer than this are ready */
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
static int evict_newest(shm_chan *c, int *rc, uint64_t *evicted_pos) {
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
    *evicted_pos = pos;
    h->queued_in_window--;
    h->ingested--;
    h->skipped++;
    slot_free(c, s);
    if (pos < h->ingest_pos) h->ingest_pos = pos;
    return 1;
}

/* A small set of key hashes, local to one pass of return_skipped: the keys of skipped
 * records the pass has gone by (records after them that share a key must wait). */
#define PASSED_SLOTS 2048u
typedef struct {
    uint64_t h[PASSED_SLOTS]; /* 0 = empty (a real hash of 0 is stored as 1: it only errs
                                 toward treating a key as passed, i.e. waiting longer) */
    uint32_t n;
} passed_set;

static int passed_add(passed_set *p, uint64_t hash) {
    hash = hash ? hash : 1;
    if (p->n >= PASSED_SLOTS / 2) return 0; /* full: the caller stops its pass */
    uint32_t i = (uint32_t)hash & (PASSED_SLOTS - 1);
    while (p->h[i] && p->h[i] != hash) i = (i + 1) & (PASSED_SLOTS - 1);
    if (!p->h[i]) {
        p->h[i] = hash;
        p->n++;
    }
    return 1;
}

static int passed_has(const passed_set *p, uint64_t hash) {
    hash = hash ? hash : 1;
    uint32_t i = (uint32_t)hash & (PASSED_SLOTS - 1);
    while (p->h[i]) {
        if (p->h[i] == hash) return 1;
        i = (i + 1) & (PASSED_SLOTS - 1);
    }
    return 0;
}

static int passed_add_record(passed_set *p, shm_record *r, uint32_t max_keys) {
    for (uint32_t k = 0; k < r->nkeys && k < max_keys; k++)
        if (!passed_add(p, r->hashes[k])) return 0;
    return 1;
}

/* Phase 1: bring skipped records back. The pass walks the skipped region in order and
 * takes in each record that would be free to go at once -- none of its keys has a line,
 * and no skipped record before it (in the passed set) shares a key -- evicting the newest
 * waiting message if that is what it takes to make room. A record that would only wait
 * stays skipped (a waiting message needs no slot to keep its place), and its keys join
 * the passed set. So the window holds what can run, and a ready message is never left
 * behind a window full of waiting ones. ingest_pos moves over the taken-in prefix. */
static int return_skipped(shm_chan *c, uint32_t *took) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    passed_set passed;
    passed.n = 0;
    memset(passed.h, 0, sizeof passed.h);
    int prefix = 1; /* still in the run that ingest_pos may move over */
    uint64_t pos = h->ingest_pos;
    for (uint32_t i = 0; i < INGEST_BATCH && pos < h->scan_pos; i++) {
        shm_record *r = rec_at(c, pos);
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
        uint64_t len = META_LEN(meta);
        if (len < REC_HDR || (len & 7u) || len > h->scan_pos - pos) return SHM_E_CORRUPT;
        uint32_t st = META_STATE(meta);
        if (finished_state(st) || (st == REC_COMMITTED && r->slot != NIL)) {
            pos += len; /* finished, or taken in out of order */
            if (prefix) h->ingest_pos = pos;
            continue;
        }
        if (st != REC_COMMITTED || ring_validate_body(c, r, len)) return SHM_E_CORRUPT;
        int go = 1, waits = 0;
        for (uint32_t k = 0; k < r->nkeys && go; k++) {
            if (passed_has(&passed, r->hashes[k])) go = 0;
            else if (fifo && sched_key_has_line(c, r->hashes[k])) waits = 1;
        }
        /* It would wait behind messages taken in (appended to its lines' tails, so in
         * seq order): worth a slot only while refilling a low window. */
        if (go && waits && !(c->skip_filling && sched_has_spare_room(c, r->nkeys))) go = 0;
        if (!fifo && sched_is_held_key(c, r)) go = 0;
        int rc = SHM_OK;
        while (go && !sched_has_room(c, r->nkeys)) {
            uint64_t ev;
            if (!fifo || !evict_newest(c, &rc, &ev)) {
                go = 0;
                break;
            }
            if (ev < pos) { /* now a skipped record before r: it blocks those after it */
                prefix = 0;
                if (!passed_add_record(&passed, rec_at(c, ev), c->cfg.max_keys)) return rc;
            } /* else it lies ahead and this pass will look at it in turn */
        }
        if (rc) return rc;
        if (!go) {
            if (!passed_add_record(&passed, r, c->cfg.max_keys)) return SHM_OK;
            prefix = 0;
            pos += len;
            continue;
        }
        rc = sched_skip_count(c, r, -1);
        if (rc == SHM_OK) rc = take(c, r, pos);
        if (rc) return rc;
        (*took)++;
        h->skipped--;
        pos += len;
        if (prefix) h->ingest_pos = pos;
    }
    return SHM_OK;
}

int window_ingest(shm_chan *c, shm_stall *stall, int *stalled) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    int rc = SHM_OK;
    /* A pass that brought nothing back gives the same answer until a line empties, a
     * record taken in out of order finishes, or the window runs low (c->skip_epoch):
     * until then, or RECHECK_NS, skip it. Refilling runs from a quarter of the window
     * to a half, so each pass of it takes in a whole batch. */
    if (h->ingest_pos < h->scan_pos) {
        if (!c->skip_filling && h->window < c->cfg.max_messages / 4) {
            c->skip_filling = 1;
            c->skip_epoch++;
        }
        if (c->skip_quiet == c->skip_epoch + 1 && coarse_ns() - c->skip_quiet_ns >= RECHECK_NS)
            c->skip_quiet = 0; /* quiet for long: look again anyway */
        if (c->skip_quiet != c->skip_epoch + 1) {
            uint64_t ingest_before = h->ingest_pos;
            uint32_t took = 0;
            rc = return_skipped(c, &took);
            if (rc) return rc;
            if (h->window >= c->cfg.max_messages / 2) c->skip_filling = 0;
            if (took == 0 && h->ingest_pos == ingest_before) {
                c->skip_quiet = c->skip_epoch + 1;
                c->skip_quiet_ns = coarse_ns();
            }
        }
    }
    /* New records are taken in only while few messages are ready to go: the receiver
     * needs lookahead to find messages on free keys, not a copy of the whole backlog in
     * its tables. With a long backlog on many keys, taking everything in would spread
     * each release's work (the next message in each line) over megabytes of nodes and
     * slots; this keeps it in cache. What is not taken in yet is newer than everything
     * ready, so lowest-seq-first is unchanged. */
    for (uint32_t i = 0; i < INGEST_BATCH && h->ready_count < READY_AHEAD; i++) {
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
            uint64_t ev;
            while (!sched_has_room(c, r->nkeys)) {
                if (!fifo || !evict_newest(c, &rc, &ev)) {
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
