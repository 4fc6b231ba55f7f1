/* batchin.c -- a receive takes a run of new records in and hands them out in one pass.
 *
 * The general poll (handles.c shm_recv) first takes new records into the window until
 * READY_AHEAD messages are ready (window.c window_ingest), then pops the ready heap one
 * message at a time (sched.c): with a few hundred ready, every pop sifts the heap's last
 * entry down its whole height, and every message goes through the ready queue. A receive
 * (recv, recv_many, recv_batch) that finds nothing ready, nothing to wake and nothing
 * being written instead takes the records at scan_pos one at a time and hands each out
 * as it is taken in, and the record is looked at once while it is in the cache. A
 * single recv takes in one record: the consumer that releases each message before the
 * next recv finds its keys free again, and every message of such a stream skips the
 * ready queue.
 *
 * It is the general path's steps, in the same order, for the case where they cannot
 * interleave with anything else:
 *   - nothing is ready (ready_count 0) and nothing is paused (hold.c), so the message
 *     just taken in is the lowest seq that may go: the general path would hand it out
 *     next too. Records come in ring order, which is seq order. So the message skips
 *     the ready queue and goes straight from its take-in to its hand-out.
 *   - no key is on the wake list and no placeholder is on the writing list: no parked
 *     or unfinished record can become ready meanwhile (their keys' lines and chains make
 *     any new record on the same keys park, and the run stops at it).
 *   - no message has a delay or a ttl (timers.c), and the record carries none.
 * The run takes in only a message none of whose keys is in the key table (sched.c
 * sched_take_in_free: one probe per key, which the insertion reuses). It stops at the
 * first record that is not committed, is already in the window (after a rebuild or a
 * look-ahead), has a key in the table (it parks, or waits for a line) or finds no room,
 * and the general poll goes on from there: it parks, stalls and steps over records as
 * before.
 *
 * The tables' budget (budget.c) exempts a message taken in while none is ready: the
 * next one a receive can get. Here none is ever ready when the next record is looked
 * at, so the run keeps the budget itself: the first message of the call is taken in if
 * there is room for it, committing more if need be (as the general path does), and every
 * later one only if the tables already have room for it committed (sched.c counts that
 * room once for the run); otherwise it is left to the general poll, which applies the
 * budget as before. Every shared-memory effect is one the general path has (a take-in,
 * hand_out), so a receiver killed in the middle leaves what rebuild.c already handles.
 */
#include "core.h"
#include "peek.h"

/* Hand out slot s, just taken in from the record r at pos whose body fields peek_record
 * validated against its length a moment ago (*b, read from the record once: peek.h). The message
 * is described from those values (handles.c msg_fill reads and validates the record a
 * second time instead): each is bounded by the record's length. A committed record's
 * body never changes, so one that reads differently now was scribbled on since: it is
 * refused as corrupt, as msg_fill would refuse it, and it stays ready (sched_unpop, as
 * hand_out), so every poll reports it. Then the slot's hand-out (handles_mark_inflight,
 * as handles.c hand_out), but for the lease: its deadline counts from the run's start,
 * read once (*deadline, 0 until then), as its handed-out time does (now). */
static inline int run_hand_out(shm_chan *c, uint32_t s, shm_record *r, uint64_t pos,
                               const shm_body *b, shm_msg *m, uint64_t now,
                               uint64_t *deadline) {
    if (((r->kind ^ b->kind) | (r->nkeys ^ b->nkeys) | (r->keys_len ^ b->keys_len) |
         (r->data_len ^ b->data_len)) != 0) {
        sched_unpop(c, s);
        return SHM_E_CORRUPT;
    }
    shm_slot *sl = &c->slots[s];
    uint32_t gen = SLOT_GEN(sl->state);
    if (c->cfg.lease_ns && !*deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock hand_out's deadlines use */
        *deadline = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + c->cfg.lease_ns;
    }
    handles_mark_inflight(c, s, gen, now, c->cfg.lease_ns ? *deadline : 0);
    /* nobody holds it yet: nobody changed its state word */
    msg_describe(m, c, r, pos, s, gen, sl->seq, sl->attempt, b, SLOT_WORD(gen, SLOT_INFLIGHT));
    return SHM_OK;
}

/* The run's position, count and clock are kept in locals and stored back once: the
 * loop's stores into the segment could alias them, and the compiler would reload each
 * after every one. scan_pos is the receiver's alone (under rx_mu): it moves only here
 * during the run. */
int batchin_run(shm_chan *c, shm_msg *out, uint32_t max, uint32_t *got, uint64_t *now,
                int *moved) {
    shm_header *h = c->hdr;
    if (*got >= max || h->ready_count != 0 || h->wake_n || h->wake_overflow ||
        h->writing_n || h->timed || h->delayed_count || UNLIKELY(hold_any(c)))
        return SHM_OK;
    uint32_t room = SCHED_ROOM_UNKNOWN; /* the tables' room for the run (sched.c) */
    uint64_t deadline = 0;              /* the run's lease deadline (run_hand_out) */
    uint32_t n = *got;
    uint64_t t = *now, start = h->scan_pos, pos = start;
    int rc = SHM_OK;
    while (n < max) {
        uint64_t len;
        shm_record *r;
        shm_stall stall;
        shm_body b;
        /* as ring_peek; anything but a committed record is the general path's */
        if (peek_record(c, pos, &r, &len, &stall, &b) != SHM_OK) break;
        /* a record no slot names (NIL) is not in the window: the call is for the rest */
        if ((r->flags & REC_F_TIMES) || (r->slot != NIL && window_taken(c, r, pos))) break;
        uint32_t s;
        rc = sched_take_in_free(c, r, pos, b.nkeys, &room, &s);
        if (rc <= 0) break; /* 0: a key in the table, or no room: the general path decides */
        rc = SHM_OK;
        h->scan_pos = pos + len;
        /* Nothing parked before it: ingest_pos passes it now, as walk_ingest (window.c)
         * would pass a record taken in, so the poll does not walk the run again. */
        if (h->ingest_pos == pos) h->ingest_pos = pos + len;
        if (n == 1) test_pause(SHM_PAUSE_RUN_TAKEN); /* its slot FREE, the record its */
        else if (max == 1) test_pause(SHM_PAUSE_RECV_TAKEN); /* the same, for a recv */
        if (!t) t = coarse_ns();
        rc = run_hand_out(c, s, r, pos, &b, &out[n], t, &deadline);
        if (rc) break;
        n++;
        pos += len;
    }
    if (h->scan_pos != start) *moved = 1; /* something was taken in */
    *got = n;
    *now = t;
    return rc;
}
