/* handles.c -- the receiver's loop and the life of a handle.
 *
 * A handle is (slot, generation) in the message table. Its slot's state word is the one
 * piece of scheduler state other processes may change, and only from SLOT_INFLIGHT:
 *
 *     consumer:  READY --hand out--> INFLIGHT          (release store, holder set first)
 *     holder:    INFLIGHT --CAS--> RELEASED | NACKED   (any process holding the handle)
 *     consumer:  RELEASED --> FREE, generation + 1     (keys to the next in line)
 *                NACKED   --> READY (attempt + 1) or DEAD (out of attempts)
 *
 * The CAS compares the whole word, generation included, so a handle whose message was
 * already released or redelivered can never release anything: a second release, or a
 * stale one, finds another word and is a no-op (SHM_STALE).
 *
 * Releases in the receiver's own process are applied at once. Other processes push the
 * slot onto a push-only stack (release_stack, linked through slot.rel_next) that the
 * receiver takes whole with one exchange. Push-only plus take-all has no ABA problem:
 * a push's CAS succeeds only if the top is what the pusher linked below itself, and a
 * slot cannot be pushed again before the receiver has taken it (it stays RELEASED until
 * then). A releaser killed between its CAS and its push leaves a RELEASED slot that is
 * not on the stack; recovery finds such slots by scanning the table.
 *
 * The handed-out list: every slot whose state word another process may change (INFLIGHT,
 * RELEASED, NACKED, DEAD, DISCARD) is on one doubly linked list, headed by hdr.handed_out
 * and linked through slot.out_next / out_prev. Only the consumer links (hand_out) and
 * unlinks (handles_finish), under rx_mu with the header marked dirty, so a receiver that
 * dies half way leaves dirty set and recovery_rebuild relinks the list from the message
 * table. Upkeep (recovery.c: dead holders, leases, forgotten releases) walks this list,
 * so it costs O(handles out + dead letters), not O(max_messages).
 *
 * Wake-ups (an eventcount with one waiter): before blocking on its semaphore the
 * receiver stores rx_sleeping = 1 (seq_cst) and checks every source of work again;
 * producers and releasers publish their work, issue a seq_cst fence and, if they see
 * rx_sleeping, the one that CASes it back to 0 posts the semaphore. So there is no lost
 * wake-up, and no system call while the receiver is busy.
 */
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "peek.h"


static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- receiver ownership ----------------------------------------------------------------- */
int shm_rx_owner(shm_chan *c, uint64_t *owner) {
    *owner = LOAD_ACQUIRE(&c->hdr->receiver); /* pairs with the CAS in shm_rx_acquire */
    return SHM_OK;
}

/* Become the receiver if the current owner is expect_owner (0 = nobody; otherwise a
 * token the caller found dead). */
int shm_rx_acquire(shm_chan *c, uint64_t expect_owner) {
    if (c->is_rx) return SHM_BUSY;
    uint64_t expect = expect_owner;
    /* seq_cst: elects the receiver; pairs with other candidates' CAS and with the
     * release in shm_rx_release_ownership. */
    if (!CAS_SEQCST(&c->hdr->receiver, &expect, c->token)) return SHM_BUSY;
    c->is_rx = 1;
    /* Every record in the ring now was written before we took the seat: on a durable
     * channel, check their checksums as we meet them (crc32c.c). The head only grows. */
    c->verify_below = (c->cfg.flags & SHM_CFG_DURABLE) ? LOAD_ACQUIRE(&c->hdr->head) + c->cap : 0;
    /* Work-avoidance state of an earlier turn as receiver means nothing now (core.h). */
    c->done_count = c->compact_retry_at = c->compact_watch_end = c->compact_fail_ns = 0;
    c->compact_watch_hit = 0;
    c->refusals_seen = 0;
    ring_head_unknown(c);
    lookahead_reset(c); /* a new receiver starts with an empty look-ahead (lookahead.c) */
    /* The tables' committed marks and the key table's size (commit.c); a size no receiver
     * could have set calls for a rebuild, as a death mid-operation does. */
    if (commit_adopt(c)) STORE_RELAXED(&c->hdr->dirty, 1);
    if (LOAD_RELAXED(&c->hdr->dirty)) {
        /* The previous receiver died inside an operation: rebuild (rebuild.c). */
        rx_lock(&c->rx_mu);
        rx_begin(c);
        int rc = recovery_rebuild(c);
        if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
        rx_end(c);
        rx_unlock(&c->rx_mu);
        if (rc != SHM_OK) {
            uint64_t me = c->token;
            c->is_rx = 0;
            CAS_SEQCST(&c->hdr->receiver, &me, 0); /* give the seat back */
            return rc;
        }
    }
    STORE_RELAXED(&c->hdr->rx_sleeping, 0);
    return SHM_OK;
}

int shm_rx_release_ownership(shm_chan *c) {
    if (!c->is_rx) return SHM_OK;
    rx_lock(&c->rx_mu);
    uint64_t me = c->token;
    c->is_rx = 0;
    STORE_RELAXED(&c->hdr->rx_sleeping, 0);
    /* release: everything this receiver wrote is visible to the next; pairs with the CAS
     * in shm_rx_acquire. */
    __atomic_compare_exchange_n(&c->hdr->receiver, &me, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    rx_unlock(&c->rx_mu);
    return SHM_OK;
}

/* ---- the handed-out list (receiver only, under rx_mu) ----------------------------------- */
__attribute__((always_inline)) static inline void out_link(shm_chan *c, uint32_t s) {
    handles_out_link(c, s);
}

__attribute__((always_inline)) static inline void out_unlink(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    uint32_t next = sl->out_next, prev = sl->out_prev, m = c->cfg.max_messages;
    if (prev == NIL) {
        if (h->handed_out == s) h->handed_out = next;
    } else if (prev <= m) {
        c->slots[prev].out_next = next;
    }
    if (next != NIL && next <= m) c->slots[next].out_prev = prev;
    sl->out_next = sl->out_prev = NIL;
}

/* Walking the list: *next is the slot after s (NIL at the end; s == NIL gives the first).
 * Links come from shared memory: a link out of range is corruption, not a crash. */
int handed_out_next(shm_chan *c, uint32_t s, uint32_t *next) {
    uint32_t n = s == NIL ? c->hdr->handed_out : c->slots[s].out_next;
    if (n > c->cfg.max_messages) return SHM_E_CORRUPT;
    *next = n;
    return SHM_OK;
}

/* ---- finishing handles (receiver only, under rx_mu) ------------------------------------ */
/* slot_free but for the window count, which the caller keeps (a run's release counts its
 * messages once: see release_many_rx). */
__attribute__((always_inline)) static inline void slot_free_uncounted(shm_chan *c, uint32_t s) {
    shm_slot *sl = &c->slots[s];
    uint32_t gen = SLOT_GEN(sl->state) + 1;
    /* release: a holder's CAS against the old generation now fails; pairs with their
     * acquire in shm_release / shm_handle_info. */
    STORE_RELEASE(&sl->state, SLOT_WORD(gen, SLOT_FREE));
    window_unlink(c, s);
    sl->next = c->hdr->free_slots;
    c->hdr->free_slots = s;
}

/* Inline in the single release (finish_released): the call cost it about 15 instructions. */
__attribute__((always_inline)) static inline void free_slot(shm_chan *c, uint32_t s) {
    slot_free_uncounted(c, s);
    c->hdr->window--;
}

void slot_free(shm_chan *c, uint32_t s) { free_slot(c, s); }

/* s is RELEASED: its keys go to the next in line, its record is done, its slot free.
 * handles_finish reads the state word first; release_many_rx calls this directly, since
 * it made the CAS to RELEASED itself under rx_mu, and every path that finishes a slot
 * holds rx_mu (shm_release instead makes its CAS before taking the lock, and upkeep may
 * finish the slot in between, so it goes through handles_finish). Inlined: a call here
 * cost the single release 16 instructions. */
__attribute__((always_inline)) static inline int finish_released(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    h->inflight--;
    h->held_keys -= sl->nkeys;
    int rc = sched_release(c, s);
    if (rc) return rc;
    out_unlink(c, s);
    ring_mark_done(c, sl->pos);
    test_pause(SHM_PAUSE_RELEASE_ONE); /* rebuild.c counts the release: its record is done */
    free_slot(c, s);
    h->released++;
    return SHM_OK;
}

int handles_finish(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    /* acquire: pairs with the holder's CAS that moved the slot out of INFLIGHT. */
    uint64_t w = LOAD_ACQUIRE(&sl->state);
    uint32_t st = SLOT_STATE(w);
    if (st == SLOT_DISCARD) { /* a dropped dead letter: its keys went long ago */
        out_unlink(c, s);
        ring_mark_done(c, sl->pos);
        slot_free(c, s);
        h->dead_letters--;
        return SHM_OK;
    }
    if (st == SLOT_RELEASED) return finish_released(c, s);
    if (st != SLOT_NACKED) return SHM_OK; /* duplicate notice */
    h->inflight--;
    h->held_keys -= sl->nkeys;
    if (st == SLOT_NACKED && (c->cfg.max_attempts == 0 || sl->attempt < c->cfg.max_attempts)) {
        out_unlink(c, s);
        if (UNLIKELY(LOAD_RELAXED(&sl->nack_delay))) timers_requeued(c, s, SLOT_GEN(w));
        return sched_requeue(c, s);
    }
    int rc = sched_release(c, s);
    if (rc) return rc;
    /* Out of attempts: a dead letter. It keeps its slot and record, keys released, and
     * stays on the handed-out list (anyone may discard it). */
    c->keys_freed++; /* without a release: the look-ahead looks again (lookahead.c) */
    sl->dead_reason = SHM_DEAD_ATTEMPTS;
    STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(w), SLOT_DEAD)); /* see slot_free */
    h->dead_letters++;
    return SHM_OK;
}

/* A message that was not handed out (ready, first in its lines) dies (timers.c: its ttl
 * ran out): its keys go to the next in line, and it stays on the handed-out list as a
 * dead letter, like one out of attempts. */
int handles_dead_letter(shm_chan *c, uint32_t s, uint32_t reason) {
    shm_slot *sl = &c->slots[s];
    int rc = sched_release(c, s);
    if (rc) return rc;
    c->keys_freed++; /* as in handles_finish */
    sl->dead_reason = reason;
    c->hdr->queued_in_window--;
    STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(sl->state), SLOT_DEAD)); /* see slot_free */
    c->hdr->dead_letters++;
    out_link(c, s);
    return SHM_OK;
}

/* Take the whole release stack and finish every slot on it. */
int handles_drain(shm_chan *c) {
    if (LOAD_RELAXED(&c->hdr->release_stack) == NIL) return SHM_OK;
    /* acquire: pairs with the releasers' release CAS in push_release, so each pushed
     * slot's rel_next is visible. */
    uint64_t top = EXCHANGE_ACQREL(&c->hdr->release_stack, (uint64_t)NIL);
    uint32_t s = (uint32_t)top;
    for (uint32_t guard = 0; s != NIL && guard <= c->cfg.max_messages; guard++) {
        if (s > c->cfg.max_messages) return SHM_E_CORRUPT;
        uint32_t next = LOAD_RELAXED(&c->slots[s].rel_next);
        int rc = handles_finish(c, s);
        if (rc) return rc;
        s = next;
    }
    return SHM_OK;
}

void handles_push(shm_chan *c, uint32_t s) {
    uint64_t top = LOAD_RELAXED(&c->hdr->release_stack);
    do {
        STORE_RELAXED(&c->slots[s].rel_next, (uint32_t)top);
        /* release: pairs with the receiver's exchange in handles_drain (our rel_next and
         * the slot's RELEASED state are visible to it). */
    } while (!__atomic_compare_exchange_n(&c->hdr->release_stack, &top, (uint64_t)s, 1,
                                          __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
}

/* ---- the receiver's poll ------------------------------------------------------------------ */
/* Describe slot s's message from its record (validated), for the state word it has now.
 * Each field of the record is read once: the offsets handed out are computed from the
 * very values checked here, so a process scribbling on the record between two reads
 * cannot send a reader outside it. A record that is exactly its body (the common one)
 * needs no more than these checks; one with a trailer after its payload (a send's times,
 * a gate) also gets ring_validate_body's check of the trailer. */
__attribute__((always_inline)) static inline int fill(shm_chan *c, uint32_t s, uint32_t gen,
                                                      shm_msg *m) {
    shm_slot *sl = &c->slots[s];
    /* acquire: pairs with the consumer's release store of pos when it moves the record. */
    uint64_t pos = LOAD_ACQUIRE(&sl->pos);
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
    uint64_t len = META_LEN(meta), seq = LOAD_RELAXED(&sl->seq);
    /* relaxed: ordered after the acquire of meta above; only read once each (see above) */
    shm_body b = {LOAD_RELAXED(&r->kind), LOAD_RELAXED(&r->nkeys), LOAD_RELAXED(&r->keys_len),
                  LOAD_RELAXED(&r->data_len)};
    if (META_STATE(meta) != REC_COMMITTED || len < REC_BODY || len > c->cap - REC_HDR ||
        LOAD_RELAXED(&r->seq) != seq ||
        !rec_fields_ok(c, b.kind, b.nkeys, b.keys_len, b.data_len, len))
        return SHM_E_CORRUPT;
    uint64_t size = rec_size(b.nkeys, b.keys_len, b.data_len);
    if (size != len && (size > len || ring_validate_body(c, r, len) != SHM_OK))
        return SHM_E_CORRUPT;
    uint32_t attempt = sl->attempt;
    msg_describe(m, c, r, pos, s, gen, seq, attempt, &b, LOAD_ACQUIRE(&sl->state));
    return SHM_OK;
}

/* Hand out slot s (just popped from the ready heap), described in *m. A record that no
 * longer validates -- or, recovered from a durable channel's file, fails its checksum --
 * is not handed out: it goes back on the heap and every poll reports SHM_E_CORRUPT. */
static int hand_out(shm_chan *c, uint32_t s, shm_msg *m, uint64_t now) {
    shm_slot *sl = &c->slots[s];
    uint32_t gen = SLOT_GEN(sl->state);
    int rc = fill(c, s, gen, m); /* msg_fill, inline: the hand-out's call cost 20 instructions */
    if (rc == SHM_OK && sl->pos < c->verify_below &&
        !rec_checksum_ok(c, rec_at(c, sl->pos), META_LEN(rec_at(c, sl->pos)->meta)))
        rc = SHM_E_CORRUPT;
    if (rc != SHM_OK) {
        sched_unpop(c, s);
        return rc;
    }
    handles_mark_inflight(c, s, gen, now, c->cfg.lease_ns ? now_ns() + c->cfg.lease_ns : 0);
    m->attempt = sl->attempt;
    m->word = SLOT_WORD(gen, SLOT_INFLIGHT); /* nobody holds it yet: nobody changed it */
    return SHM_OK;
}

/* Is there anything a poll could act on right now? (the re-check before sleeping)
 * `shut_seen`: this poll already saw the shutdown, which wakes no one again. */
static int work_pending(shm_chan *c, int shut_seen) {
    shm_header *h = c->hdr;
    /* seq_cst loads after the seq_cst store of rx_sleeping: pair with the fences in
     * wake_receiver (ring.c) and shm_release. */
    if (LOAD_SEQCST(&h->release_stack) != NIL) return 1;
    if (!shut_seen && LOAD_SEQCST(&h->shutdown)) return 1;
    if (sched_has_ready(c)) return 1; /* not if all ready ones are paused (hold.c) */
    return window_has_work(c); /* records to look at, parked ones to wake */
}

/* Can a handed-out message still come back to the receiver? Any handle out in another
 * process can: its holder may die, or nack it (a handle in this process comes back only
 * if this process gives it back, and iterating keeps the last one alive meanwhile).
 * O(handles out), and only asked once the channel is shut down and drained. */
static int others_inflight(shm_chan *c) {
    if (c->hdr->inflight == 0) return 0;
    uint32_t s = NIL;
    for (uint32_t guard = 0; guard < c->cfg.max_messages; guard++) {
        if (handed_out_next(c, s, &s) != SHM_OK) return 1; /* corrupt: keep waiting */
        if (s == NIL) break;
        shm_slot *sl = &c->slots[s];
        uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&sl->state)); /* pairs with holders' CAS */
        if (st == SLOT_RELEASED || st == SLOT_NACKED) return 1; /* on its way back */
        /* acquire: pairs with shm_handle_adopt's CAS (a hand-over to another process) */
        if (st == SLOT_INFLIGHT && LOAD_ACQUIRE(&sl->holder) != c->token) return 1;
    }
    return 0;
}

/* Rounds a receive makes past what had arrived when it began, before it returns
 * SHM_AGAIN: new arrivals cannot keep one call from returning. */
#define RECV_EXTRA_ROUNDS 3

int shm_recv(shm_chan *c, shm_msg *out, uint32_t max, uint32_t *got, int arm_sleep,
             shm_stall *stall, uint32_t *wake_sender) {
    *got = 0;
    *wake_sender = 0;
    if (!c->is_rx) return SHM_E_INVALID;
    shm_header *h = c->hdr;
    rx_lock(&c->rx_mu);
    rx_begin(c);
    if (LOAD_RELAXED(&h->rx_sleeping)) STORE_RELAXED(&h->rx_sleeping, 0);
    int rc = SHM_OK, stalled = 0, moved = 0, shut_seen = 0;
    uint64_t now = 0; /* hand-out time, read once per call (coarse: a few ms) */
    /* Everything that arrived before this call is looked at in it: the receiver never
     * returns "empty" (and sleeps) while such records wait, and its caller's timeout
     * never cuts that work short. The tail hint that bounds it is read only when a round
     * found work but nothing to hand out (below), not on every call: it is the line every
     * send writes, and a receiver keeping up with its producers that read it per call
     * pulled it away from them once per message. Read later, it covers at
     * least what arrived before the call, and once read it stays fixed. */
    uint64_t arrived = 0;
    int have_arrived = 0;
    for (int extra = 0;;) {
        int progress = 0;
        rc = handles_drain(c);
        if (rc) break;
        /* New free-key records straight from their take-in to their hand-out (batchin.c);
         * the general take-in below only for what that left: a call that has what it
         * asked for does not take records ahead into the ready queue, which would send
         * the next call down the general path too. */
        rc = batchin_run(c, out, max, got, &now, &progress);
        if (rc) break;
        if (*got < max) rc = window_ingest(c, stall, &stalled, &progress);
        else rc = window_walk(c); /* but ingest_pos follows, so head can (window.c) */
        if (rc) break;
        if (UNLIKELY(h->delayed_count)) { /* delayed messages whose time came (timers.c) */
            rc = timers_sweep(c);
            if (rc) break;
        }
        while (*got < max) {
            uint32_t s = sched_pop_ready(c);
            if (s == NIL) break;
            if (s == UINT32_MAX) {
                rc = SHM_E_CORRUPT;
                break;
            }
            if (UNLIKELY(h->timed)) { /* a delay or ttl decides (timers.c) */
                int held = timers_gate(c, s);
                if (held < 0) rc = held;
                if (held < 0) break;
                if (held) continue;
            }
            if (!now) now = coarse_ns();
            rc = hand_out(c, s, &out[*got], now);
            if (rc) break;
            (*got)++;
        }
        if (rc) break;
        if (ring_head_may_move(c)) moved |= ring_advance_head(c); /* see ring.c */
        int slid = compact(c);
        if (UNLIKELY((moved |= slid) < 0)) { /* the header stays dirty: see compact */
            rc = SHM_E_CORRUPT;
            break;
        }
        /* A slide frees at most an eighth of the ring (compact.c): while a sender waits
         * for space, whose message may need more, the next slide is work this poll owes,
         * as for new records -- asleep, the receiver would slide once per wake-up and the
         * sender, refused again, wake nobody (relaxed: a hint, as in compact_look). */
        if (slid > 0 && LOAD_RELAXED(&h->space_waiters)) progress = 1;
        if (*got) break;
        if (stalled) {
            /* A record being claimed or written holds the scan. A caller about to sleep
             * on it announces the sleep as for an empty ring (below), so that the commit
             * that ends the stall posts it (wake_receiver): unannounced, it slept its
             * whole stall timeout (2 ms), and a free-key message right behind a backlog
             * waited that long. */
            rc = SHM_STALLED;
        } else {
            if (progress) { /* more to look at: go on, or let the caller call again */
                if (!have_arrived) {
                    arrived = LOAD_ACQUIRE(&h->tail_hint); /* pairs with hint_raise (ring.c) */
                    have_arrived = 1;
                }
                if (h->scan_pos < arrived || ++extra <= RECV_EXTRA_ROUNDS) continue;
                rc = SHM_AGAIN;
                break;
            }
            /* Nothing new: an empty ring far into its lap starts again at offset 0
             * (ring.c). It moved head: the waiter check after the loop must run (a sender
             * may have found the ring full while the skip was published and head not
             * yet past it). */
            moved |= ring_rewind(c);
            if (!moved) moved |= ring_give_back(c); /* a drained ring's idle memory */
            /* seq_cst: pairs with shm_shutdown, then the ring read in ingest: see
             * send_one. Closed once nothing is queued and no handle can come back
             * (others_inflight): until then the receiver waits, and a dead holder's
             * message is redelivered. */
            if (LOAD_SEQCST(&h->shutdown)) {
                /* Seen: the re-check before sleeping need not look for it again, also
                 * while messages are still queued (a release ahead of them posts us). */
                shut_seen = 1;
                /* seq_cst overflowing: pairs with shm_ovf_begin / shm_ovf_finish
                 * (overflow.c): what went to the overflow file is drained first */
                if (h->queued_in_window == 0 && h->ingest_pos == h->scan_pos &&
                    !LOAD_SEQCST(&h->overflowing) &&
                    LOAD_SEQCST(&rec_at(c, h->scan_pos)->owner) == OWNER_EMPTY(h->scan_pos) &&
                    !others_inflight(c)) {
                    rc = SHM_CLOSED;
                    break;
                }
            }
            rc = SHM_EMPTY;
        }
        if (!arm_sleep) break;
        /* seq_cst: the eventcount's "prepare to wait"; pairs with wakers' fences. */
        STORE_SEQCST(&h->rx_sleeping, 1);
        if (!work_pending(c, shut_seen)) break; /* asleep: a commit or release posts us */
        STORE_RELAXED(&h->rx_sleeping, 0);
        if (++extra > RECV_EXTRA_ROUNDS) { /* work came in meanwhile: look at it first */
            rc = SHM_AGAIN;
            break;
        }
        stalled = 0;
    }
    int idle = rc == SHM_EMPTY && arm_sleep; /* about to sleep: waiters must try now */
    if (moved || idle) {
        /* seq_cst fence: between our release store of head and the load of the waiter
         * count; pairs with the seq_cst add in shm_space_wait. */
        FENCE_SEQCST();
        *wake_sender = (uint32_t)space_wake_due(c, idle); /* the rationing rule: ring.c */
    }
    if (rc != SHM_E_CORRUPT) STORE_RELAXED(&h->dirty, 0);
    rx_end(c);
    rx_unlock(&c->rx_mu);
    return rc;
}

/* Busy-wait (without the lock) until a poll may hand something out, or `spins` pauses
 * pass: the receiver's short spin before it sleeps. It waits for the record at the scan
 * position to be finished (committed, or anything a poll steps over), for the oldest
 * placeholder's commit, or for a release. A record only claimed, or gated, is waited
 * through: a poll would only find it stalled again. One being written is waited through
 * for SPIN_WRITING pauses (a small message's copy), then handed to a poll, which looks
 * past it (a placeholder, window.c). Before, the spin ended at the claim, the poll found
 * the record stalled and the receiver slept on the semaphore: a receiver that kept up
 * with its producer caught it mid-write about once per hundred messages and ran at
 * half the rate of one that lagged. Watching a few words in our own cache
 * costs no bus traffic until a producer or releaser writes them. The positions are read
 * without the lock, as hints: rec_at masks any position into the ring. */
#define SPIN_WRITING 64u
int shm_rx_spin(shm_chan *c, uint32_t spins) {
    shm_header *h = c->hdr;
    uint64_t pos = LOAD_RELAXED(&h->scan_pos);
    shm_record *r = rec_at(c, pos);
    uint32_t nw = LOAD_RELAXED(&h->writing_n);
    shm_record *w = nw && nw <= SHM_WRITING_MAX ? rec_at(c, LOAD_RELAXED(&h->writing[0])) : NULL;
    for (uint32_t i = 0; i < spins; i++) {
        /* acquire: pairs with prepare_successor / claimants (owner) and, for meta, with
         * fill()'s release stores of WRITING and COMMITTED (ring.c). */
        if (LOAD_ACQUIRE(&r->owner) != OWNER_EMPTY(pos)) {
            uint32_t st = META_STATE(LOAD_ACQUIRE(&r->meta));
            if (st != REC_CLAIMED && st != REC_GATED && (st != REC_WRITING || i >= SPIN_WRITING))
                return SHM_OK;
        }
        /* acquire: pairs with the commit's release store of meta (ring.c fill) */
        if (w && META_STATE(LOAD_ACQUIRE(&w->meta)) != REC_WRITING) return SHM_OK;
        /* acquire: pairs with handles_push. */
        if (LOAD_ACQUIRE(&h->release_stack) != NIL) return SHM_OK;
        CPU_RELAX();
    }
    return SHM_EMPTY;
}

/* ---- holders (any process) ------------------------------------------------------------ */
#define WAKE_RX (1 << 8) /* post the receiver's semaphore */
#define WAKE_TX (1 << 9) /* wake one sender waiting for space (ring.c's rationing) */

/* After a release applied in the receiver's own process (under rx_mu): is a thread of
 * this process asleep in recv? It announced the sleep (rx_sleeping = 1) under rx_mu as
 * well, before its last look, so the mutex orders that store before this load and no
 * fence is needed: either its last look saw what we just finished, or we see it asleep.
 * The CAS (seq_cst) decides between us and any other process that saw it asleep: one
 * post per sleep. */
int handles_rx_asleep(shm_chan *c) {
    uint32_t one = 1;
    return LOAD_RELAXED(&c->hdr->rx_sleeping) && CAS_SEQCST(&c->hdr->rx_sleeping, &one, 0);
}

int shm_release(shm_chan *c, uint32_t s, uint32_t gen, int nack) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    uint64_t expect = SLOT_WORD(gen, SLOT_INFLIGHT);
    /* seq_cst: exactly one transition out of INFLIGHT per generation; pairs with the
     * consumer's release store in hand_out (acquire side) and is ordered before the push
     * and the rx_sleeping check below. */
    if (!CAS_SEQCST(&sl->state, &expect, SLOT_WORD(gen, nack ? SLOT_NACKED : SLOT_RELEASED)))
        return SHM_STALE;
    if (c->is_rx) {
        int out = SHM_OK;
        rx_lock(&c->rx_mu);
        rx_begin(c);
        int rc = handles_finish(c, s);
        /* a nack, or a release finished meanwhile by upkeep, frees nothing: see ring.c */
        int slid = 0; /* < 0: the header stays dirty, see compact (core.h) */
        if (rc == SHM_OK &&
            ((ring_head_may_move(c) && ring_advance_head(c)) | (slid = compact(c)))) {
            /* the last message out of an empty ring (ring.c); before the fence, so that a
             * sender that starts waiting meanwhile is seen by the check below */
            ring_rewind(c);
            FENCE_SEQCST(); /* pairs with shm_space_wait, as in shm_recv */
            if (space_wake_due(c, 0)) out |= WAKE_TX;
        }
        if (UNLIKELY(slid < 0)) rc = SHM_E_CORRUPT;
        if (rc == SHM_OK) STORE_RELAXED(&c->hdr->dirty, 0);
        if (rc == SHM_OK && handles_rx_asleep(c)) out |= WAKE_RX;
        rx_end(c);
        rx_unlock(&c->rx_mu);
        return rc ? rc : out;
    }
    handles_push(c, s);
    /* seq_cst fence: pairs with the receiver's store of rx_sleeping and re-check. */
    FENCE_SEQCST();
    if (LOAD_RELAXED(&c->hdr->rx_sleeping)) {
        uint32_t one = 1;
        if (CAS_SEQCST(&c->hdr->rx_sleeping, &one, 0)) return WAKE_RX;
    }
    return SHM_OK;
}

/* A release run's chunk of slots mine[0..n) leaves the handed-out list and the window's
 * age list. A batch lies on each as stretches, usually one: taken in (age list, linked at
 * the newer end) and handed out (handed-out list, linked at the front) in the order it is
 * released. Each stretch is cut out with one relink of its two ends -- what unlinking its
 * members one by one leaves (out_unlink, window_unlink: the same checks of the links read)
 * -- and its members' own links are cleared. */
static void run_out_unlink(shm_chan *c, const uint32_t *mine, uint32_t n) {
    shm_header *h = c->hdr;
    uint32_t m = c->cfg.max_messages;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t first = mine[k]; /* the member farthest from the front */
        uint32_t next = c->slots[first].out_next;
        while (k + 1 < n && c->slots[mine[k]].out_prev == mine[k + 1]) {
            c->slots[mine[k]].out_next = c->slots[mine[k]].out_prev = NIL;
            k++;
        }
        uint32_t last = mine[k], prev = c->slots[last].out_prev; /* last: nearest the front */
        if (prev == NIL) {
            if (h->handed_out == last) h->handed_out = next;
        } else if (prev <= m) {
            c->slots[prev].out_next = next;
        }
        if (next != NIL && next <= m) c->slots[next].out_prev = prev;
        c->slots[last].out_next = c->slots[last].out_prev = NIL;
    }
}

static void run_window_unlink(shm_chan *c, const uint32_t *mine, uint32_t n) {
    shm_header *h = c->hdr;
    uint32_t m = c->cfg.max_messages;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t first = mine[k]; /* the oldest member */
        uint32_t older = c->slots[first].older;
        while (k + 1 < n && c->slots[mine[k]].newer == mine[k + 1]) {
            c->slots[mine[k]].newer = c->slots[mine[k]].older = NIL;
            k++;
        }
        uint32_t last = mine[k], newer = c->slots[last].newer;
        if (newer >= 1 && newer <= m) c->slots[newer].older = older;
        else if (h->newest == last) h->newest = older >= 1 && older <= m ? older : NIL;
        if (older >= 1 && older <= m) c->slots[older].newer = newer;
        else if (h->oldest == first) h->oldest = newer >= 1 && newer <= m ? newer : NIL;
        c->slots[last].newer = c->slots[last].older = NIL;
    }
}

/* The receiver's own releases, many at once: one lock, one head advance, and the header's
 * counts of what is in flight, the keys held and the window changed once for the run.
 * The messages go in chunks of RUN_CHUNK, each in passes: every message's CAS to
 * RELEASED; every one's keys to the next in line (sched_release_many, one call); the
 * chunk off the handed-out list (run_out_unlink); per message, its record done and then
 * its slot free (finish_released's order); the chunk off the age list (run_window_unlink).
 *
 * Those three counts, the key lines, the lists and the free lists are derived state: a
 * receiver killed in the middle of the run (between rx_begin and rx_end, so dirty is set)
 * leaves them behind the slots' states, and the next receiver rebuilds them from the
 * message table (rebuild.c). The facts it rebuilds from keep finish_released's order for
 * each message: its slot goes RELEASED (the CAS), then its record DONE, then its slot FREE,
 * so a receiver killed anywhere leaves each slot of the run INFLIGHT (not reached yet),
 * RELEASED with its record COMMITTED (kept, finished by recovery as a forgotten release),
 * RELEASED with its record DONE, or FREE with its record DONE (both freed): never FREE with
 * its record still COMMITTED, which the rebuild would take in again. Head moves only at
 * the end, over records already DONE. The released count moves with each message, as in
 * a single release (the rebuild counts one cut short between its DONE and its FREE). */
#define RUN_CHUNK 256u
/* Message i of a release call: from the arrays of slots and gens, or from msgs if given
 * (shm_release_msgs: a batch's descriptions, not copied into arrays first). */
__attribute__((always_inline)) static inline void run_item(const uint32_t *slots,
                                                           const uint32_t *gens,
                                                           const shm_msg *msgs, uint32_t i,
                                                           uint32_t *s, uint32_t *gen) {
    *s = msgs ? (uint32_t)msgs[i].slot : slots[i];
    *gen = msgs ? (uint32_t)msgs[i].gen : gens[i];
}

/* The finish pass's step for message s of a run (finish_released's order): its record
 * done, then its slot FREE at the front of *free_head (the chunk's free list, stored in the
 * header once per chunk). *run_end and *plain as in release_many_rx. pause, a constant:
 * the test's pause point between the two stores, where the chunk's messages before this
 * one are FREE but off the free list, this record is DONE with its slot RELEASED, the
 * rest are RELEASED with their records COMMITTED, and head has not moved. */
__attribute__((always_inline)) static inline void run_finish(shm_chan *c, uint32_t s, int pause,
                                                             uint64_t *run_end, uint64_t *plain,
                                                             uint32_t *free_head) {
    shm_slot *sl = &c->slots[s];
    uint64_t pos = sl->pos, len;
    if (LIKELY(ring_mark_done_plain(c, pos, &len))) {
        (*plain)++;
        /* a length head's walk would pass (ring.c len_ok), or the chain ends */
        int whole = len >= REC_HDR && (len & 7u) == 0 && len <= c->cap - REC_HDR;
        if (pos == *run_end) *run_end = whole ? pos + len : UINT64_MAX;
    } else { /* an island may be kept: the whole step, and head walks */
        ring_mark_done(c, pos);
        *run_end = UINT64_MAX;
    }
    if (pause) test_pause(SHM_PAUSE_RELEASE_DONE);
    /* slot_free_uncounted's steps, the free list's head kept by the caller for the chunk */
    uint32_t gen = SLOT_GEN(sl->state) + 1;
    STORE_RELEASE(&sl->state, SLOT_WORD(gen, SLOT_FREE)); /* see slot_free_uncounted */
    sl->next = *free_head;
    *free_head = s;
    c->hdr->released++;
}

__attribute__((always_inline)) static inline int release_many_rx(shm_chan *c,
                                                                 const uint32_t *slots,
                                                                 const uint32_t *gens,
                                                                 const shm_msg *msgs, uint32_t n,
                                                                 int *wake) {
    int rc = SHM_OK, broken = 0;
    rx_lock(&c->rx_mu);
    rx_begin(c);
    shm_header *h = c->hdr;
    uint32_t touched = slots_touched(c, h); /* fixed while we hold rx_mu */
    uint32_t mine[RUN_CHUNK];
    uint64_t cased = 0, freed = 0, keys = 0, plain = 0;
    /* [head, run_end): records this run marked done, one after another from head (none
     * kept as an island meanwhile); UINT64_MAX once that chain cannot grow. */
    uint64_t run_end = h->head;
    for (uint32_t at = 0; at < n && !broken; at += RUN_CHUNK) {
        uint32_t end = n - at < RUN_CHUNK ? n : at + RUN_CHUNK, m = 0;
        for (uint32_t i = at; i < end; i++) {
            uint32_t s, gen;
            run_item(slots, gens, msgs, i, &s, &gen);
            if (s == NIL || s >= touched) { /* never handed out */
                rc = SHM_E_INVALID;
                continue;
            }
            shm_slot *sl = &c->slots[s];
            uint64_t expect = SLOT_WORD(gen, SLOT_INFLIGHT);
            /* seq_cst: as in shm_release (one transition out of INFLIGHT per generation). */
            if (!CAS_SEQCST(&sl->state, &expect, SLOT_WORD(gen, SLOT_RELEASED)))
                continue; /* stale: a no-op */
            if (i == n / 2) test_pause(SHM_PAUSE_RELEASE_RUN);
            /* our CAS, under rx_mu: nobody finishes it but us (see finish_released) */
            keys += sl->nkeys; /* before sched_release_many empties it */
            mine[m++] = s;
        }
        cased += m;
        uint32_t ok;
        int r = sched_release_many(c, mine, m, &ok);
        if (r) { /* half done: leave the header dirty for the next receiver's rebuild */
            rc = r;
            broken = 1;
        }
        run_out_unlink(c, mine, ok);
        test_pause(SHM_PAUSE_RELEASE_KEYS); /* keys passed on, every record still COMMITTED */
        uint32_t free_head = h->free_slots, mid = ok / 2;
        /* the middle message apart, so that only it carries the test's pause point */
        for (uint32_t k = 0; k < mid; k++) run_finish(c, mine[k], 0, &run_end, &plain, &free_head);
        if (mid < ok) run_finish(c, mine[mid], 1, &run_end, &plain, &free_head);
        for (uint32_t k = mid + 1; k < ok; k++)
            run_finish(c, mine[k], 0, &run_end, &plain, &free_head);
        h->free_slots = free_head;
        run_window_unlink(c, mine, ok);
        freed += ok;
    }
    c->done_count += plain; /* ring_mark_done_plain's share of the bookkeeping, once */
    ring_head_unknown(c);
    h->inflight -= cased;
    h->held_keys -= keys;
    h->window -= (uint32_t)freed; /* a broken one kept its slot */
    int slid = 0; /* < 0: the header stays dirty, see compact (core.h) */
    if (!broken && (ring_advance_head_past(c, run_end) | (slid = compact(c)))) {
        ring_rewind(c); /* as in shm_release: before the fence */
        FENCE_SEQCST(); /* pairs with shm_space_wait, as in shm_recv */
        if (space_wake_due(c, 0)) *wake |= 2;
    }
    if (UNLIKELY(slid < 0)) {
        rc = SHM_E_CORRUPT;
        broken = 1;
    }
    if (!broken) STORE_RELAXED(&c->hdr->dirty, 0);
    if (!broken && handles_rx_asleep(c)) *wake |= 1;
    rx_end(c);
    rx_unlock(&c->rx_mu);
    return rc;
}

static int release_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens,
                        const shm_msg *msgs, uint32_t n, int *wake) {
    *wake = 0;
    if (c->is_rx) return release_many_rx(c, slots, gens, msgs, n, wake);
    int rc = SHM_OK, rx = 0, tx = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s, gen;
        run_item(slots, gens, msgs, i, &s, &gen);
        int r = shm_release(c, s, gen, 0);
        if (r < 0) {
            rc = r;
            continue;
        }
        rx |= r & WAKE_RX;
        tx |= r & WAKE_TX;
    }
    *wake = (rx ? 1 : 0) | (tx ? 2 : 0); /* at most one sender per call, like shm_recv */
    return rc;
}

int shm_release_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens, uint32_t n,
                     int *wake) {
    return release_many(c, slots, gens, NULL, n, wake);
}

int shm_release_msgs(shm_chan *c, const shm_msg *msgs, uint32_t n, int *wake) {
    return release_many(c, NULL, NULL, msgs, n, wake);
}

/* fill, for the readers outside the poll (core.h) */
int msg_fill(shm_chan *c, uint32_t s, uint32_t gen, shm_msg *m) { return fill(c, s, gen, m); }

/* Describe a live handle. Bytes read at the offsets it gives are good only if
 * shm_unmoved() agrees afterwards (the record may be moved: compact.c). */
int shm_handle_info(shm_chan *c, uint32_t s, uint32_t gen, shm_msg *m) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    for (int tries = 0; tries < 1000; tries++) {
        /* acquire: pairs with hand_out's release store of INFLIGHT. */
        uint64_t w = LOAD_ACQUIRE(&sl->state);
        if (w != SLOT_WORD(gen, SLOT_INFLIGHT)) return SHM_STALE;
        uint64_t pos = LOAD_ACQUIRE(&sl->pos);
        int rc = msg_fill(c, s, gen, m);
        if (shm_unmoved(c, s, w, pos) != SHM_OK) continue; /* moved or finished: look again */
        return rc;
    }
    return SHM_BUSY;
}

/* Pin a live handle's record where it is and describe it: for zero-copy views. */
int shm_handle_view(shm_chan *c, uint32_t s, uint32_t gen, shm_msg *m) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    for (uint32_t spins = 0; spins < 1000000; spins++) {
        if (LOAD_ACQUIRE(&sl->state) != SLOT_WORD(gen, SLOT_INFLIGHT)) return SHM_STALE;
        uint32_t pin = LOAD_ACQUIRE(&sl->pin);
        if (pin == PIN_MOVING) { /* the consumer is moving it right now: microseconds */
            CPU_RELAX();
            continue;
        }
        /* seq_cst: pairs with the consumer's CAS FREE -> MOVING in compact.c: after this,
         * it never moves the record again. */
        if (pin == PIN_FREE && !CAS_SEQCST(&sl->pin, &pin, PIN_VIEWED)) continue;
        return shm_handle_info(c, s, gen, m);
    }
    return SHM_BUSY;
}

/* Seqlock check: bytes copied from the record at pos (for the state word `word`) are
 * good if the slot still has that word and position. */
int shm_unmoved(shm_chan *c, uint32_t s, uint64_t word, uint64_t pos) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    /* acquire fence: the caller's reads of the record happen before these loads; pairs
     * with the mover's release store of pos (which precedes any reuse of the old bytes). */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    shm_slot *sl = &c->slots[s];
    if (LOAD_RELAXED(&sl->pos) != pos || LOAD_RELAXED(&sl->state) != word) return SHM_STALE;
    return SHM_OK;
}

/* shm_unmoved for a batch's messages at once (Batch.joined): bytes copied from every
 * msgs[i]'s record before this call are good for each i below the count returned (the
 * index of the first message whose record moved or was finished, or n). One fence for
 * the run, then the same two loads per message as shm_unmoved. */
uint32_t shm_unmoved_many(shm_chan *c, const shm_msg *msgs, uint32_t n) {
    uint32_t touched = slots_touched(c, c->hdr);
    /* acquire fence: as in shm_unmoved, once for every copy made before the call. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = (uint32_t)msgs[i].slot;
        if (s == NIL || s >= touched) return i; /* never handed out */
        shm_slot *sl = &c->slots[s];
        if (LOAD_RELAXED(&sl->pos) != msgs[i].pos || LOAD_RELAXED(&sl->state) != msgs[i].word)
            return i;
    }
    return n;
}

/* ---- hand-over: a handle pickled to another process ----------------------------------
 * A handle in transit names nobody who can release it: the process that pickled it may
 * have dropped the pickle, and the one meant to unpickle it may die first. So pickling
 * bounds the trip (shm_handle_send):
 *
 *     holder word:  T (a token)  --pickle-->  T | TRANSIT, handover = now + handover_ns
 *                   T | TRANSIT  --adopt-->   U (the unpickling process's token)
 *                   T | TRANSIT  --revoke-->  REVOKED   (maintenance, once handover passed)
 *
 * Adoption and revocation are CASes on the holder word from the same value, so exactly
 * one wins: an adopter that loses finds REVOKED and reports SHM_LOST (the message is on
 * its way back, with attempt + 1); a revoker that loses finds a plain token and leaves
 * the handle to its new holder, whose death is then noticed as usual. The deadline is
 * raised before the TRANSIT bit is set, so whoever sees the bit sees a deadline at least
 * that new. Pickling an already pickled handle again only moves its deadline later.
 *
 * Generations. Pickling and adopting run in any process, so they can be late: checked
 * against generation g, then paused while the message is taken back and handed out again
 * as g + 1, often to the same process (a receiver that pickles its handles to workers),
 * so with the same holder word. A plain CAS of the holder word would then mark or take
 * the *new* handle. So both change the holder with one cas_pair over (state, holder),
 * expecting state = (g, INFLIGHT): a step for an old generation matches nothing. The
 * revoker needs no pair: it runs in the receiver, under rx_mu, and the generation only
 * changes there. Extending a lease is guarded the same way, with the pair (deadline,
 * lease_gen); hand_out stores lease_gen before deadline. A late handover deadline is
 * harmless: it is only ever raised, never lowered.
 *
 * A process killed at any instruction leaves either its token (not yet marked; the
 * handle is its own and goes back when it dies) or the marked word (taken back at the
 * deadline). */
static int lost_or_stale(shm_slot *sl, uint32_t gen) {
    /* relaxed: the caller's seq_cst (or acquire) load that found the state changed
     * orders this after the revoker's store of lost_gen, which precedes its state CAS. */
    return LOAD_RELAXED(&sl->lost_gen) == gen + 1u ? SHM_LOST : SHM_STALE;
}

static int handle_send(shm_chan *c, uint32_t s, uint32_t gen, uint64_t deadline) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    const uint64_t live = SLOT_WORD(gen, SLOT_INFLIGHT);
    if (LOAD_ACQUIRE(&sl->state) != live) return SHM_STALE; /* pairs with hand_out */
    test_pause(SHM_PAUSE_HANDOVER_SEND);
    /* Raise, never lower: we may be late, and a newer hand-over's deadline must not come
     * forward. seq_cst: before the TRANSIT bit below; pairs with the revoker's seq_cst
     * loads of holder then handover (shm_revoke, shm_holders). */
    uint64_t dl = LOAD_RELAXED(&sl->handover);
    while (dl < deadline && !CAS_SEQCST(&sl->handover, &dl, deadline)) {
    }
    uint64_t cur = LOAD_ACQUIRE(&sl->holder); /* pairs with adopt / revoke CASes */
    for (;;) {
        if (cur == HOLDER_REVOKED) return SHM_STALE;
        /* cas_pair (seq_cst): only while the slot still holds generation gen in flight.
         * Pairs with the pair CAS in shm_handle_adopt, the revoking CAS of holder in
         * shm_revoke, and the holders' CAS of state (release, nack). */
        if (cas_pair(&sl->state, live, cur, live, cur | HOLDER_TRANSIT)) return SHM_OK;
        if (LOAD_SEQCST(&sl->state) != live) return SHM_STALE;
        cur = LOAD_SEQCST(&sl->holder);
    }
}

int shm_handle_send(shm_chan *c, uint32_t s, uint32_t gen) {
    return handle_send(c, s, gen, now_ns() + c->cfg.handover_ns);
}

/* A batch in one call: each handle exactly as shm_handle_send, with one deadline for all
 * (the clock is read once). status[i] is handle i's status; returns SHM_OK. */
int shm_handle_send_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens, uint32_t n,
                         int32_t *status) {
    const uint64_t deadline = now_ns() + c->cfg.handover_ns;
    for (uint32_t i = 0; i < n; i++) status[i] = handle_send(c, slots[i], gens[i], deadline);
    return SHM_OK;
}

/* Adoption: the calling process (token) becomes the holder of a handle in transit.
 * SHM_STALE: the message was released or redelivered meanwhile (a no-op handle);
 * SHM_LOST: taken back at its deadline, or adopted by another process first. */
int shm_handle_adopt(shm_chan *c, uint32_t s, uint32_t gen, uint64_t token) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    const uint64_t live = SLOT_WORD(gen, SLOT_INFLIGHT);
    /* acquire: pairs with hand_out's release store and with the revoker's CAS, which
     * follows its store of lost_gen. */
    if (LOAD_ACQUIRE(&sl->state) != live) return lost_or_stale(sl, gen);
    test_pause(SHM_PAUSE_HANDOVER_ADOPT);
    uint64_t cur = LOAD_ACQUIRE(&sl->holder); /* pairs with shm_handle_send's pair CAS */
    for (;;) {
        if (cur == HOLDER_REVOKED || !(cur & HOLDER_TRANSIT)) {
            /* taken back, or adopted already (by us: the same pickle twice; or not). The
             * answer is about generation gen only if the slot still holds it: seq_cst,
             * pairs with the CASes that move the state on (release, nack, revoke). */
            if (LOAD_SEQCST(&sl->state) != live) return lost_or_stale(sl, gen);
            return cur == token ? SHM_OK : SHM_LOST;
        }
        /* cas_pair (seq_cst): pairs with the revoking CAS of holder in shm_revoke (one of
         * the two wins) and with shm_handle_send's pair CAS; a late adopter of an older
         * generation matches nothing. */
        if (cas_pair(&sl->state, live, cur, live, token)) return SHM_OK;
        if (LOAD_SEQCST(&sl->state) != live) return lost_or_stale(sl, gen);
        cur = LOAD_SEQCST(&sl->holder);
    }
}

/* A batch in one call: each handle exactly as shm_handle_adopt, then, once adopted,
 * described into out[i] as shm_handle_info does. status[i] is handle i's status (SHM_OK,
 * SHM_STALE, SHM_LOST, or an error); out[i] is filled only where it is SHM_OK. A process
 * killed part-way holds the handles adopted so far (they go back when it is seen dead)
 * and leaves the rest in transit (taken back at their deadline). Returns SHM_OK. */
int shm_handle_adopt_many(shm_chan *c, const uint32_t *slots, const uint32_t *gens, uint32_t n,
                          uint64_t token, shm_msg *out, int32_t *status) {
    for (uint32_t i = 0; i < n; i++) {
        int rc = shm_handle_adopt(c, slots[i], gens[i], token);
        if (rc == SHM_OK) rc = shm_handle_info(c, slots[i], gens[i], &out[i]);
        status[i] = rc;
    }
    return SHM_OK;
}

int shm_handle_extend(shm_chan *c, uint32_t s, uint32_t gen, uint64_t deadline_ns) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    shm_slot *sl = &c->slots[s];
    const uint64_t live = SLOT_WORD(gen, SLOT_INFLIGHT);
    if (LOAD_ACQUIRE(&sl->state) != live) return SHM_STALE; /* pairs with hand_out */
    test_pause(SHM_PAUSE_EXTEND);
    for (;;) {
        /* acquire, both: pair with hand_out's stores (lease_gen, then deadline). */
        uint64_t dl = LOAD_ACQUIRE(&sl->deadline);
        if (LOAD_ACQUIRE(&sl->lease_gen) != gen) return SHM_STALE; /* handed out again */
        /* cas_pair (seq_cst): the deadline of generation gen only; pairs with hand_out's
         * stores and with the lease check's acquire load of deadline (shm_holders,
         * shm_revoke). */
        if (cas_pair(&sl->deadline, dl, gen, deadline_ns, gen)) break;
    }
    if (LOAD_SEQCST(&sl->state) != live) return SHM_STALE; /* released or taken back meanwhile */
    return SHM_OK;
}
