/* rebuild.c -- the receiver's derived state rebuilt after a receiver died inside an
 * operation.
 *
 * The next receiver takes the seat by CAS on the receiver word from the dead token. If
 * the dead one was between operations (dirty == 0) its state is whole and the new
 * receiver simply carries on; its handles are revoked like any dead holder's
 * (recovery.c). If it died inside an operation (dirty != 0), the scheduler's derived
 * state (key lines, free lists, ready queue, counters) is rebuilt from the facts that
 * every operation keeps whole:
 *   - the message table's handed-out slots (INFLIGHT, RELEASED, NACKED, DEAD): these
 *     are the handles that exist in the world, and keep their slot and generation;
 *   - the ring from head: every COMMITTED record not owned by such a slot is a message
 *     not yet handed out, and is taken in again in ring (= seq) order.
 * Handed-out messages are linked into their lines first, in seq order: under fifo every
 * earlier message on their keys was released before they went out, so they head their
 * lines, as before the crash.
 *
 * recovery_rebuild runs the steps below in order, under the receiver's lock, with
 * nobody else able to change the derived state (only the receiver does); each step
 * says what it leaves true for the next.
 */
#include <stdlib.h>

#include "core.h"
#include "lane.h"

typedef struct {
    uint64_t seq, pos;
    uint32_t slot;
} kept_t;

static int by_seq(const void *a, const void *b) {
    const kept_t *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static int by_pos(const void *a, const void *b) {
    const kept_t *x = a, *y = b;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Step 1: keep handed-out slots (relinked into the handed-out list), free the rest.
 * Restores: every touched slot is on exactly one of the free list and the handed-out
 * list, and every kept slot names a whole record (COMMITTED or DONE, its seq, within a
 * lap of head, or an island); kept[0..*nkept) lists them. Slots past the fresh mark
 * were never used (sched.c) and stay where they are. SHM_E_CORRUPT if a kept slot's
 * record is not whole. */
static int keep_handed_out(shm_chan *c, kept_t *kept, uint32_t *nkept, uint64_t *inflight,
                           uint64_t *dead) {
    shm_header *h = c->hdr;
    h->free_slots = NIL;
    h->handed_out = NIL;
    for (uint32_t s = slots_touched(c, h) - 1; s >= 1; s--) {
        shm_slot *sl = &c->slots[s];
        uint64_t w = LOAD_ACQUIRE(&sl->state); /* pairs with holders' CAS */
        uint32_t st = SLOT_STATE(w);
        int keep = st == SLOT_INFLIGHT || st == SLOT_RELEASED || st == SLOT_NACKED ||
                   st == SLOT_DEAD || st == SLOT_DISCARD;
        if (keep) {
            shm_record *r = rec_at(c, sl->pos);
            uint64_t meta = LOAD_ACQUIRE(&r->meta);
            uint32_t rs = META_STATE(meta);
            /* Behind head: an island (islands.c), which stays pinned where it is; or, if
             * its message was being finished, a record whose island was already given
             * back (ring_mark_done): its bytes are no longer ours, the slot only needs
             * freeing. */
            int island = sl->pos < h->head && island_find(c, sl->pos) >= 0;
            int behind = sl->pos < h->head && !island;
            if (behind && (st == SLOT_RELEASED || st == SLOT_DISCARD)) {
                STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(w) + 1, SLOT_FREE));
                if (st == SLOT_RELEASED) h->released++; /* counted after the free: see below */
                sl->next = h->free_slots;
                h->free_slots = s;
                continue;
            }
            /* a move in progress is void: the slot's pos is a whole copy */
            if (!island) sl->pin = PIN_FREE;
            if ((rs != REC_COMMITTED && rs != REC_DONE) || behind ||
                (sl->pos >= h->head && sl->pos - h->head >= c->cap) ||
                (island && rs != REC_COMMITTED) || /* an island may lie laps behind head */
                r->seq != sl->seq)
                return SHM_E_CORRUPT;
            if (rs == REC_DONE) { /* died between marking the record and freeing the slot */
                STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(w) + 1, SLOT_FREE));
                /* A release counts itself only after its slot is FREE (finish_released,
                 * release_many_rx), so one cut short here was not counted yet. */
                if (st == SLOT_RELEASED) h->released++;
                keep = 0;
            }
        } else if (st != SLOT_FREE) {
            /* waiting or ready: no handle exists; the record is taken in again below */
            STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(w) + 1, SLOT_FREE));
        }
        if (!keep) {
            sl->next = h->free_slots;
            h->free_slots = s;
            continue;
        }
        kept[(*nkept)++] = (kept_t){sl->seq, sl->pos, s};
        sl->out_prev = NIL; /* link at the front (as handles.c's out_link does) */
        sl->out_next = h->handed_out;
        if (h->handed_out != NIL) c->slots[h->handed_out].out_prev = s;
        h->handed_out = s;
        if (st == SLOT_DEAD || st == SLOT_DISCARD) (*dead)++;
        else (*inflight)++;
    }
    return SHM_OK;
}

/* Step 2: empty the key table and the nodes. Restores: no line, node, ready entry or
 * parked record exists; the window holds exactly the kept slots, and the counters say so
 * (inflight and dead_letters from step 1, nothing queued, no key held yet). */
static int reset_scheduler(shm_chan *c, uint32_t nkept, uint64_t inflight, uint64_t dead) {
    shm_header *h = c->hdr;
    if (sched_keys_reset(c) != SHM_OK) return SHM_FULL; /* the key table's first pages */
    h->free_nodes = NIL; /* every node is free: handed out from the start again */
    STORE_RELAXED(&h->fresh_nodes, 1); /* read by nodes_touched (core.h) */
    h->nodes_used = 0;
    h->ready_count = 0;
    h->heap_count = 0;
    lane_reset(c); /* the ready lane too (lane.h) */
    timers_reset(c); /* the delayed list is part of the ready messages (timers.c) */
    h->newest = h->oldest = NIL;
    h->skipped = 0;
    h->window = nkept;
    h->queued_in_window = 0;
    h->inflight = inflight;
    h->dead_letters = dead;
    h->held_keys = 0;
    return SHM_OK;
}

/* Step 3: handed-out messages rejoin their lines first, in seq order; then the islands
 * that wait for their redelivery (islands.c), older than anything after head.
 * Restores: every live handle heads its keys' lines (it held them before the crash) and
 * held_keys counts their keys; dead letters hold no keys; the island table keeps the
 * kept slots' islands, and a message waiting behind head for its redelivery is taken in
 * again before anything after head (it is older). */
static int relink_handed_out(shm_chan *c, kept_t *kept, uint32_t nkept) {
    shm_header *h = c->hdr;
    qsort(kept, nkept, sizeof *kept, by_seq);
    int rc = SHM_OK;
    for (uint32_t i = 0; i < nkept && rc == SHM_OK; i++) {
        shm_slot *sl = &c->slots[kept[i].slot];
        uint32_t st = SLOT_STATE(sl->state);
        if (st == SLOT_DEAD || st == SLOT_DISCARD) {
            sl->first_node = NIL;
            sl->nkeys = 0;
            continue;
        }
        window_link(c, kept[i].slot);
        rc = sched_relink(c, kept[i].slot, rec_at(c, sl->pos));
        h->held_keys += sl->nkeys;
    }
    if (rc == SHM_OK) {
        uint64_t *kept_pos = malloc(sizeof(uint64_t) * (nkept + 1));
        if (kept_pos == NULL) rc = SHM_E_NOMEM;
        for (uint32_t i = 0; kept_pos && i < nkept; i++) kept_pos[i] = kept[i].pos;
        if (kept_pos) rc = island_rebuild(c, kept_pos, nkept);
        free(kept_pos);
    }
    return rc;
}

/* Step 4a: the scan starts again at head. Restores: no wake-up list, no unfinished
 * record and no skipped key or byte is remembered (the walk of step 4b counts them
 * again); ingest_pos and scan_pos are at head. Runs whether or not step 3 succeeded. */
static void restart_scan(shm_chan *c) {
    shm_header *h = c->hdr;
    h->wake_n = 0;
    h->wake_overflow = 0;
    h->writing_n = 0; /* the scan finds unfinished records again */
    h->skip_keys = 0;
    h->ingest_pos = h->scan_pos = h->head;
    h->skip_bytes = 0; /* SKIP records in [head, scan_pos): counted again by the walk */
}

/* Step 4b: everything else in the ring is looked at again in ring order, as the scan
 * would (window.c): taken in or parked. Where the window is full the scan stops and the
 * receiver's polls go on from there; kept messages further on are recognised by their
 * slot (window_taken), and every other record there is made to look new (step 4c).
 * Restores: every committed record in [head, scan_pos) that no kept slot owns is in the
 * window (ready or parked on its keys) and counted in ingested once; a stale copy left
 * by a cut-short compaction is DONE. *end is where the walk stopped. */
static int retake_ring(shm_chan *c, kept_t *kept, uint32_t nkept, uint64_t *end) {
    shm_header *h = c->hdr;
    uint32_t m = c->cfg.max_messages;
    qsort(kept, nkept, sizeof *kept, by_pos);
    uint64_t pos = h->head;
    uint32_t k = 0;
    int full = 0, rc = SHM_OK;
    shm_stall stall;
    for (uint64_t guard = 0; rc == SHM_OK && guard <= c->cap / REC_HDR; guard++) {
        shm_record *r;
        uint64_t len;
        int p = ring_peek(c, pos, &r, &len, &stall);
        if (p == SHM_EMPTY || p == SHM_STALLED) break;
        if (p != SHM_OK && p != SHM_CLOSED) {
            /* DONE records (released out of order) have a valid length: skip them */
            uint64_t meta = LOAD_ACQUIRE(&rec_at(c, pos)->meta);
            if (META_STATE(meta) != REC_DONE || META_LEN(meta) < REC_HDR ||
                META_LEN(meta) > c->cap - REC_HDR) {
                rc = p;
                break;
            }
            len = META_LEN(meta);
            p = SHM_CLOSED;
        }
        if (p == SHM_OK) {
            while (k < nkept && kept[k].pos < pos) k++;
            /* A stale copy left by a compaction that was cut short: its slot is kept and
             * points at the other copy. */
            uint32_t rs = r->slot;
            int stale = rs >= 1 && rs <= m && c->slots[rs].seq == r->seq &&
                        c->slots[rs].pos != pos && SLOT_STATE(c->slots[rs].state) != SLOT_FREE;
            int is_kept = k < nkept && kept[k].pos == pos;
            if (stale) {
                ring_mark_done(c, pos); /* what the compaction would have covered */
            } else if (!is_kept) {
                if (rs != NIL && h->ingested) h->ingested--; /* counted when first taken in */
                r->slot = NIL;
                if (!full) {
                    int a = window_admit(c, r, pos);
                    if (a == SHM_FULL) full = 1;
                    else if (a) rc = a;
                }
            }
        }
        if (!full) {
            if (p == SHM_CLOSED && META_STATE(LOAD_RELAXED(&rec_at(c, pos)->meta)) == REC_SKIP)
                h->skip_bytes += len; /* an island's bytes (islands.c) */
            h->scan_pos = pos + len;
        }
        pos += len;
    }
    *end = pos;
    return rc;
}

/* Step 4c: records from where the walk stopped on are looked at afresh (window.c).
 * Restores: no committed record past the walk claims a slot unless that slot has taken
 * it (window_taken), and ingested does not count them. Stops at the first record not
 * yet committed or not whole. */
static void forget_tail(shm_chan *c, uint64_t pos) {
    shm_header *h = c->hdr;
    for (uint64_t guard = 0; guard <= c->cap / REC_HDR; guard++) {
        shm_record *r = rec_at(c, pos);
        uint64_t owner = LOAD_ACQUIRE(&r->owner);
        if (owner == OWNER_EMPTY(pos) || OWNER_IS_EMPTY(owner) || owner == 0) break;
        uint64_t meta = LOAD_ACQUIRE(&r->meta);
        uint64_t len = META_LEN(meta);
        if (META_STATE(meta) == REC_CLAIMED || len < REC_HDR || (len & 7u) || len > c->cap - REC_HDR)
            break;
        if (META_STATE(meta) == REC_COMMITTED && len >= REC_BODY && !window_taken(c, r, pos)) {
            if (r->slot != NIL && h->ingested) h->ingested--; /* taken in again later */
            r->slot = NIL;
        }
        pos += len;
    }
}

/* Step 5: finish releases, nacks and discards that were in progress; what is on the
 * release stack is among them (acquire: pairs with the pushers' CAS). Restores: no slot
 * is left RELEASED, NACKED or DISCARD with nobody to finish it, and the release stack
 * is empty. */
static int finish_in_progress(shm_chan *c) {
    shm_header *h = c->hdr;
    int rc = SHM_OK;
    EXCHANGE_ACQREL(&h->release_stack, (uint64_t)NIL);
    for (uint32_t s = 1, used = slots_touched(c, h); s < used && rc == SHM_OK; s++) {
        uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&c->slots[s].state));
        if (st == SLOT_RELEASED || st == SLOT_NACKED || st == SLOT_DISCARD) rc = handles_finish(c, s);
    }
    return rc;
}

int recovery_rebuild(shm_chan *c) {
    uint32_t m = c->cfg.max_messages;
    kept_t *kept = malloc(sizeof(kept_t) * (m + 1));
    if (!kept) return SHM_E_NOMEM;
    uint32_t nkept = 0;
    uint64_t inflight = 0, dead = 0;
    int rc = keep_handed_out(c, kept, &nkept, &inflight, &dead);
    if (rc) {
        free(kept);
        return rc;
    }
    if (reset_scheduler(c, nkept, inflight, dead) != SHM_OK) {
        free(kept);
        return SHM_FULL;
    }
    rc = relink_handed_out(c, kept, nkept);
    restart_scan(c);
    uint64_t pos = c->hdr->head;
    if (rc == SHM_OK) rc = retake_ring(c, kept, nkept, &pos);
    free(kept);
    if (rc) return rc;
    forget_tail(c, pos);
    /* ingest_pos: over what is taken in or finished, up to the first parked record */
    c->hdr->ingest_pos = c->hdr->head;
    return finish_in_progress(c);
}
