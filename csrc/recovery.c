/* recovery.c -- putting things right after a process dies, in the receiver's routine
 * upkeep (every maintenance, about every 0.1 s) and on opening a channel.
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
 * Receiver died: the next receiver takes the seat; if the dead one died inside an operation
 * its derived state is rebuilt (rebuild.c).
 */
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
        rx_lock(&c->rx_mu);
        uint32_t s = NIL;
        for (uint32_t guard = 0; guard <= c->cfg.max_messages; guard++) {
            rc = handed_out_next(c, s, &s);
            if (rc || s == NIL) break;
            holder_note(&c->slots[s], tokens, max, &count, &late, now_ns);
        }
        rx_unlock(&c->rx_mu);
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
    rx_lock(&c->rx_mu);
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
    int slid; /* < 0: the header stays dirty, see compact (core.h) */
    if (ring_advance_head(c) | (slid = compact(c))) FENCE_SEQCST(); /* pairs with shm_space_wait */
    if (slid < 0) rc = SHM_E_CORRUPT;
    if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
    rx_end(c);
    rx_unlock(&c->rx_mu);
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
        rx_lock(&c->rx_mu);
        rx_begin(c);
        int rc = handles_finish(c, s);
        ring_advance_head(c);
        if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
        if (rc == SHM_OK && handles_rx_asleep(c)) *wake |= 1; /* as in shm_release */
        rx_end(c);
        rx_unlock(&c->rx_mu);
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
            /* its writer died before raising the tail hint past it (shm_discard_dead) */
            ring_hint_raise(c, pos + META_LEN(meta));
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
