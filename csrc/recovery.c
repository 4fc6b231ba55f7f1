/* recovery.c -- putting things right after a process dies.
 *
 * Three kinds of death reach this file; producers' deaths are handled in ring.c.
 *
 * Holder died, or overstayed its lease. The receiver's maintenance (driven from Python,
 * which decides liveness with psutil) lists the distinct holders of in-flight handles
 * (shm_holders), and passes back those found dead (shm_revoke). A revoked handle goes
 * the way of a nack: redelivered with attempt + 1 from the front of its lines (it never
 * left them, so its keys are never free in between), or, out of attempts, to the dead
 * letters. Revocation first moves the holder word from the dead token to REVOKED with a
 * CAS, so a hand-over racing with it (shm_handle_adopt) either wins, and the handle
 * stays, or loses and finds it revoked; then the state word moves INFLIGHT -> NACKED by
 * the same CAS a holder's nack uses, so a late release and the revocation cannot both
 * win. A late holder's release afterwards is a no-op: the redelivery has a new
 * generation. A handle in transit (pickled, not yet adopted: handles.c) is revoked the
 * same way once its hand-over deadline passes, whoever pickled it; its generation is
 * remembered in lost_gen so that a late unpickling is told so (SHM_LOST).
 *
 * Releaser died between its CAS and its push onto the release stack: its slot is
 * RELEASED (or NACKED) but nobody told the receiver. Maintenance finishes slots it found
 * in that state on two consecutive scans while the stack was empty.
 *
 * The machine rebooted (a file-backed channel, path=): every token in the file names a
 * process of the previous boot, and a process of this boot may by chance have the same
 * pid and start tick. shm_boot_check, run by whoever opens the file first in a new boot,
 * forgets them all: the receiver seat and producer registry are emptied, in-flight
 * handles are marked revoked (the next receiver redelivers them), and claims left open
 * in the ring are closed as discarded.
 *
 * Receiver died. The next receiver takes the seat by CAS on the receiver word from the
 * dead token. If the dead one was between operations (dirty == 0) its state is whole and
 * the new receiver simply carries on; its handles are revoked like any dead holder's.
 * If it died inside an operation, the scheduler's derived state (key lines, free lists,
 * ready queue, counters) is rebuilt from the facts that every operation keeps whole:
 *   - the message table's handed-out slots (INFLIGHT, RELEASED, NACKED, DEAD): these
 *     are the handles that exist in the world, and keep their slot and generation;
 *   - the ring from head: every COMMITTED record not owned by such a slot is a message
 *     not yet handed out, and is taken in again in ring (= seq) order.
 * Handed-out messages are linked into their lines first, in seq order: under fifo every
 * earlier message on their keys was released before they went out, so they head their
 * lines, as before the crash.
 */
#include <stdlib.h>

#include "core.h"


/* ---- holders ------------------------------------------------------------------------------
 * The receiver walks the handed-out list (handles.c): O(handles out), whatever the size of
 * the message table. Any other process (it cannot lock the list) scans the table. */
static void holder_note(shm_slot *sl, uint64_t *tokens, uint32_t max, uint32_t *count,
                        uint32_t *late, uint64_t now_ns) {
    /* acquire: pairs with hand_out's release store; holder was written before it. */
    if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) != SLOT_INFLIGHT) return;
    uint64_t dl = LOAD_ACQUIRE(&sl->deadline); /* pairs with shm_handle_extend */
    uint64_t t = LOAD_SEQCST(&sl->holder);      /* pairs with adopt / send's CAS */
    /* a revocation a dead receiver left half done counts as work to do */
    if ((dl && dl < now_ns) || t == HOLDER_REVOKED) (*late)++;
    if (t != HOLDER_REVOKED && (t & HOLDER_TRANSIT)) { /* in transit: only its deadline counts */
        if (LOAD_SEQCST(&sl->handover) < now_ns) (*late)++; /* pairs with shm_handle_send */
        return;
    }
    uint32_t i = 0;
    while (i < *count && tokens[i] != t) i++;
    if (i == *count && *count < max) tokens[(*count)++] = t;
}

int shm_holders(shm_chan *c, uint64_t *tokens, uint32_t max, uint32_t *n, uint64_t now_ns,
                uint32_t *expired) {
    uint32_t count = 0, late = 0;
    int rc = SHM_OK;
    if (c->is_rx) {
        pthread_mutex_lock(&c->rx_mu);
        uint32_t s = NIL;
        for (uint32_t guard = 0; guard <= c->cfg.max_messages; guard++) {
            rc = handed_out_next(c, s, &s);
            if (rc || s == NIL) break;
            holder_note(&c->slots[s], tokens, max, &count, &late, now_ns);
        }
        pthread_mutex_unlock(&c->rx_mu);
    } else {
        for (uint32_t s = 1, used = slots_touched(c, c->hdr); s < used; s++)
            holder_note(&c->slots[s], tokens, max, &count, &late, now_ns);
    }
    *n = count;
    *expired = late;
    return rc;
}

static int in_set(const uint64_t *set, uint32_t n, uint64_t t) {
    for (uint32_t i = 0; i < n; i++)
        if (set[i] == t) return 1;
    return 0;
}

/* Revoke handles held by dead processes or past their lease; finish forgotten releases.
 * Walks the handed-out list (handles.c); finishing a slot may unlink it, so the next one
 * is read first. */
int shm_revoke(shm_chan *c, const uint64_t *dead, uint32_t ndead, uint64_t now_ns,
               uint32_t *revoked) {
    if (!c->is_rx) return SHM_E_INVALID;
    pthread_mutex_lock(&c->rx_mu);
    rx_begin(c);
    int rc = SHM_OK;
    uint32_t count = 0;
    int stack_empty = LOAD_ACQUIRE(&c->hdr->release_stack) == NIL; /* pairs with push_release */
    uint32_t s = NIL, next;
    rc = handed_out_next(c, NIL, &next);
    for (uint32_t guard = 0; rc == SHM_OK && next != NIL && guard <= c->cfg.max_messages;
         guard++) {
        s = next;
        rc = handed_out_next(c, s, &next);
        if (rc) break;
        shm_slot *sl = &c->slots[s];
        uint64_t w = LOAD_ACQUIRE(&sl->state); /* pairs with holders' CAS */
        uint32_t st = SLOT_STATE(w);
        if (st == SLOT_RELEASED || st == SLOT_NACKED || st == SLOT_DISCARD) {
            /* Seen in this state by the previous scan too, with nothing on the stack:
             * its releaser died before telling us. */
            if (stack_empty && sl->seen == SLOT_GEN(w) + 1) rc = handles_finish(c, s);
            else sl->seen = SLOT_GEN(w) + 1;
            continue;
        }
        if (st != SLOT_INFLIGHT) continue;
        /* seq_cst, holder then handover: pair with shm_handle_send's stores (deadline
         * first, then the TRANSIT bit), so a marked word comes with its deadline. */
        uint64_t holder = LOAD_SEQCST(&sl->holder);
        uint64_t dl = LOAD_ACQUIRE(&sl->deadline);   /* pairs with shm_handle_extend */
        int late = dl && dl < now_ns;
        int transit = (holder & HOLDER_TRANSIT) != 0 && holder != HOLDER_REVOKED;
        if (transit) late |= LOAD_SEQCST(&sl->handover) < now_ns; /* nobody adopted it in time */
        /* HOLDER_REVOKED while still INFLIGHT: a receiver died between the two CASes
         * below; finish its revocation. */
        if (holder != HOLDER_REVOKED) {
            if (!late && (transit || !in_set(dead, ndead, holder))) continue;
            /* seq_cst: fence off a concurrent hand-over; pairs with the CAS in adopt. */
            if (!CAS_SEQCST(&sl->holder, &holder, HOLDER_REVOKED)) continue;
            /* late adopters of this generation learn it was taken back (adopt reads it
             * after seeing the state CAS below) */
            if (transit) STORE_RELAXED(&sl->lost_gen, SLOT_GEN(w) + 1u); /* 0: none */
        }
        /* seq_cst: the same transition a nack makes; pairs with the holder's CAS. */
        if (!CAS_SEQCST(&sl->state, &w, SLOT_WORD(SLOT_GEN(w), SLOT_NACKED))) continue;
        rc = handles_finish(c, s);
        count++;
    }
    if (ring_advance_head(c) | compact(c)) FENCE_SEQCST(); /* pairs with shm_space_wait */
    if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
    rx_end(c);
    pthread_mutex_unlock(&c->rx_mu);
    *revoked = count;
    return rc;
}

/* ---- dead letters ---------------------------------------------------------------------------- */
/* List dead letters from slot index start on; *next is where to continue (0 = done). */
int shm_dead_list(shm_chan *c, uint32_t start, shm_msg *out, uint32_t max, uint32_t *n,
                  uint32_t *next) {
    uint32_t count = 0, s = start ? start : 1, used = slots_touched(c, c->hdr);
    for (; s < used && count < max; s++) {
        /* The receiver may move the record while we read it (compact.c): read again
         * until the slot's word and position held still around the read. */
        for (int tries = 0; tries < 1000; tries++) {
            uint64_t w = LOAD_ACQUIRE(&c->slots[s].state); /* pairs with handles_finish */
            if (SLOT_STATE(w) != SLOT_DEAD) break;
            uint64_t pos = LOAD_ACQUIRE(&c->slots[s].pos); /* pairs with compact's store */
            int rc = msg_fill(c, s, SLOT_GEN(w), &out[count]);
            int whole = 0;
            if (rc == SHM_OK) {
                shm_record *r = rec_at(c, out[count].pos);
                whole = rec_checksum_ok(c, r, META_LEN(LOAD_ACQUIRE(&r->meta)));
            }
            if (shm_unmoved(c, s, w, pos) != SHM_OK) continue; /* moved or dropped: again */
            if (whole) count++; /* a torn one is left out */
            break;
        }
    }
    *n = count;
    *next = s < used ? s : 0;
    return SHM_OK;
}

/* Anyone may drop a dead letter; the receiver reclaims its slot and record. */
int shm_dead_discard(shm_chan *c, uint32_t s, uint32_t gen, int *wake) {
    *wake = 0;
    if (s == NIL || s > c->cfg.max_messages) return SHM_E_INVALID;
    uint64_t expect = SLOT_WORD(gen, SLOT_DEAD);
    /* seq_cst: one discard per dead letter; pairs with the receiver's acquire in
     * handles_finish, and is ordered before the push. */
    if (!CAS_SEQCST(&c->slots[s].state, &expect, SLOT_WORD(gen, SLOT_DISCARD))) return SHM_STALE;
    if (c->is_rx) {
        pthread_mutex_lock(&c->rx_mu);
        rx_begin(c);
        int rc = handles_finish(c, s);
        ring_advance_head(c);
        if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
        if (rc == SHM_OK && handles_rx_asleep(c)) *wake |= 1; /* as in shm_release */
        rx_end(c);
        pthread_mutex_unlock(&c->rx_mu);
        return rc;
    }
    handles_push(c, s);
    FENCE_SEQCST(); /* pairs with the receiver's store of rx_sleeping and re-check */
    if (LOAD_RELAXED(&c->hdr->rx_sleeping)) {
        uint32_t one = 1;
        if (CAS_SEQCST(&c->hdr->rx_sleeping, &one, 0)) *wake |= 1;
    }
    return SHM_OK;
}

/* ---- a new boot ------------------------------------------------------------------------------ */
int shm_boot_check(shm_chan *c, uint64_t boot_id) {
    shm_header *h = c->hdr;
    uint64_t old = LOAD_ACQUIRE(&h->boot_id); /* pairs with the CAS below */
    if (old == boot_id) return SHM_OK;
    /* seq_cst: one process per boot does the reset. */
    if (!CAS_SEQCST(&h->boot_id, &old, boot_id)) return SHM_OK;
    STORE_SEQCST(&h->receiver, 0);
    STORE_RELAXED(&h->rx_sleeping, 0);
    STORE_RELAXED(&h->space_waiters, 0);
    for (uint32_t i = 0; i < c->cfg.max_producers; i++) {
        c->producers[i].waiting = 0;
        STORE_RELEASE(&c->producers[i].owner, 0); /* pairs with shm_producer_attach */
    }
    for (uint32_t s = 1, used = slots_touched(c, h); s < used; s++) {
        shm_slot *sl = &c->slots[s];
        if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) == SLOT_INFLIGHT)
            STORE_RELEASE(&sl->holder, HOLDER_REVOKED); /* shm_revoke finishes these */
        sl->pin = PIN_FREE;
    }
    /* Close the claims of the previous boot, from ingest_pos to the tail. */
    uint64_t pos = h->ingest_pos;
    for (uint64_t guard = 0; guard <= c->cap / REC_HDR; guard++) {
        shm_record *r = rec_at(c, pos);
        uint64_t owner = LOAD_ACQUIRE(&r->owner);
        if (owner == OWNER_EMPTY(pos) || OWNER_IS_EMPTY(owner) || owner == 0) break;
        uint64_t meta = LOAD_ACQUIRE(&r->meta);
        if (META_STATE(meta) == REC_CLAIMED) {
            shm_repair_claim(c, pos, OWNER_TOKEN(owner));
            meta = LOAD_ACQUIRE(&r->meta);
        } else if (META_STATE(meta) == REC_WRITING) {
            meta = META(META_LEN(meta), REC_DISCARDED);
            STORE_RELEASE(&r->meta, meta); /* pairs with ring_peek */
            /* it may be a placeholder in the receiver's lines (window.c): the next
             * receiver rebuilds them from the ring */
            STORE_RELAXED(&h->dirty, 1);
        }
        uint64_t len = META_LEN(meta);
        if (len < REC_HDR || (len & 7u) || len > c->cap - REC_HDR) break;
        pos += len;
    }
    return SHM_OK;
}

/* ---- rebuilding the receiver's state --------------------------------------------------------- */
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

int recovery_rebuild(shm_chan *c) {
    shm_header *h = c->hdr;
    uint32_t m = c->cfg.max_messages;
    kept_t *kept = malloc(sizeof(kept_t) * (m + 1));
    if (!kept) return SHM_E_NOMEM;
    uint32_t nkept = 0;
    uint64_t inflight = 0, dead = 0;

    /* 1. keep handed-out slots (relinked into the handed-out list), free the rest; slots
     * past the fresh mark were never used (sched.c) and stay where they are */
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
                sl->next = h->free_slots;
                h->free_slots = s;
                continue;
            }
            /* a move in progress is void: the slot's pos is a whole copy */
            if (!island) sl->pin = PIN_FREE;
            if ((rs != REC_COMMITTED && rs != REC_DONE) || behind ||
                (sl->pos >= h->head && sl->pos - h->head >= c->cap) ||
                (island && rs != REC_COMMITTED) || /* an island may lie laps behind head */
                r->seq != sl->seq) {
                free(kept);
                return SHM_E_CORRUPT;
            }
            if (rs == REC_DONE) { /* died between marking the record and freeing the slot */
                STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(w) + 1, SLOT_FREE));
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
        kept[nkept++] = (kept_t){sl->seq, sl->pos, s};
        sl->out_prev = NIL; /* link at the front (as handles.c's out_link does) */
        sl->out_next = h->handed_out;
        if (h->handed_out != NIL) c->slots[h->handed_out].out_prev = s;
        h->handed_out = s;
        if (st == SLOT_DEAD || st == SLOT_DISCARD) dead++;
        else inflight++;
    }

    /* 2. empty key table and nodes */
    if (sched_keys_reset(c) != SHM_OK) {
        free(kept);
        return SHM_FULL;
    }
    h->free_nodes = NIL; /* every node is free: handed out from the start again */
    STORE_RELAXED(&h->fresh_nodes, 1); /* read by nodes_touched (core.h) */
    h->nodes_used = 0;
    h->ready_count = 0;
    h->newest = h->oldest = NIL;
    h->skipped = 0;
    h->window = nkept;
    h->queued_in_window = 0;
    h->inflight = inflight;
    h->dead_letters = dead;
    h->held_keys = 0;

    /* 3. handed-out messages rejoin their lines first, in seq order; then the islands
     * that wait for their redelivery (islands.c), older than anything after head */
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

    /* 4. everything else in the ring is looked at again in ring order, as the scan
     * would (window.c): taken in or parked. Where the window is full the scan stops and
     * the receiver's polls go on from there; kept messages further on are recognised
     * by their slot (window_taken), and every other record there is made to look new. */
    qsort(kept, nkept, sizeof *kept, by_pos);
    h->wake_n = 0;
    h->wake_overflow = 0;
    h->writing_n = 0; /* the scan finds unfinished records again */
    h->skip_keys = 0;
    h->ingest_pos = h->scan_pos = h->head;
    h->skip_bytes = 0; /* SKIP records in [head, scan_pos): counted again by the walk */
    uint64_t pos = h->head;
    uint32_t k = 0;
    int full = 0;
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
    free(kept);
    if (rc) return rc;
    /* Records from the tail of the scan on are looked at afresh (window.c). */
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
    /* ingest_pos: over what is taken in or finished, up to the first parked record */
    h->ingest_pos = h->head;

    /* 5. finish releases, nacks and discards that were in progress; what is on the
     * release stack is among them (acquire: pairs with the pushers' CAS) */
    EXCHANGE_ACQREL(&h->release_stack, (uint64_t)NIL);
    for (uint32_t s = 1, used = slots_touched(c, h); s < used && rc == SHM_OK; s++) {
        uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&c->slots[s].state));
        if (st == SLOT_RELEASED || st == SLOT_NACKED || st == SLOT_DISCARD) rc = handles_finish(c, s);
    }
    return rc;
}
