/* timers.c -- delays and time-to-live that keep per-key order.
 *
 * Two times can hold a message back, both CLOCK_REALTIME nanoseconds (0 = none), so that
 * a durable channel's file still means them after a reboot (a clock stepped back makes
 * a delay longer by the step, a clock stepped forward ends it sooner):
 *   due_ns     not handed out before this: a delayed send (send(delay=)), or a nack
 *              with a delay (nack(delay=)), counted from the nack;
 *   expire_ns  not handed out by this: it becomes a dead letter, reason "expired"
 *              (send(ttl=)). Once handed out, a message's ttl is over (it was delivered).
 *
 * Where the times live:
 *   - a send's times travel in its record, as a footer in the record's last 24 bytes
 *         u64 due_ns, u64 expire_ns, u32 0, u32 TIME_MAGIC
 *     and the record's flags say REC_F_TIMES (so a record without one costs nothing)
 *     after the payload (ring_validate_body accepts a record whose length is its body's
 *     plus this footer; the checksum of a durable record covers it). A record never has
 *     both this footer and an exchange's gate trailer: a send with times is not gated.
 *   - the receiver copies them into the message's slot when it takes the record in
 *     (timers_take_in), and from then on only the slot counts;
 *   - a nack's delay is written by the holder, in any process, into slot.nack_delay as
 *     one word (generation << 32) | milliseconds (shm_nack_delay), then nacks as any
 *     holder does (shm_release), so the word is stored before its nack CAS;
 *     the receiver reads it when it finishes the nack (handles_finish, after its acquire
 *     of the state word, which pairs with the holder's seq_cst CAS) and applies it only
 *     if the generation is the nacked one. A stale handle's word names an older
 *     generation and is ignored; one landing between a live holder's word and its CAS
 *     can at worst drop that delay (the message then comes back at once, in order),
 *     never give a delay to a message that was not nacked with one.
 *
 * Order: a message is taken into the window only when it heads every line it is in
 * (sched.c), so a message held back by a time keeps its keys: everything behind it on
 * any of its keys stays parked behind it until it is handed out (and released) or dies.
 * Other keys flow. This is the one rule that differs from a broker without keys, where a
 * deferred or requeued message lets the messages behind it pass.
 *
 * The check, in one place: the receiver's poll pops the lowest-seq ready message and
 * calls timers_gate before handing it out, only while header.timed (ready messages with
 * any time) is non-zero, so a channel that never uses a time pays one load per pop.
 *   expired  -> a dead letter at once (handles_dead_letter): its keys go to the next in
 *              line, it is never handed out;
 *   not due  -> the delayed list (linked through slot.next, unused while a slot is in use, from header.delayed_head), off the
 *              ready heap, still first in its lines;
 *   else     -> handed out; its times are cleared.
 * timers_sweep, at the start of each poll round while the delayed list is non-empty,
 * puts every delayed message whose due or expiry time has come back on the ready heap
 * (it keeps its seq: it goes out before everything sent after it that is ready), where
 * timers_gate decides again. header.next_due is the earliest due or expiry time on the
 * list: a sweep before it costs one clock read, and a receiver blocked in recv sleeps no
 * later than it (shm_timers_wait). A sweep walks the whole list: O(delayed) once per due
 * time, not per poll.
 *
 * A message waiting behind a held key is a parked record, not yet in the window: its ttl
 * is checked when it reaches the front of its lines, at the latest when the key frees.
 *
 * Everything here but shm_nack_delay, shm_timers_wait and the readers is receiver-only,
 * under rx_mu; the header's timer words are read by other processes only as hints (stats,
 * the receiver's sleep). A receiver killed mid-operation leaves the header dirty and the
 * rebuild (rebuild.c) takes the records in again: send times come back from the records;
 * a nack's delay, which lives only in its slot, is lost then (the message comes back at
 * once, in order, like any message that was not out).
 */
#include <time.h>

#include "core.h"

typedef struct {
    uint64_t due_ns, expire_ns;
    uint32_t zero, magic;
} shm_time_footer;
_Static_assert(sizeof(shm_time_footer) == TIME_FOOTER, "the time footer is 24 bytes");

#define SLOT_OK(c, s) ((s) >= 1 && (s) <= (c)->cfg.max_messages)

static uint64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Does a record of body size `body` and length `len` end in a well-formed time footer? */
int timers_trailer_ok(const shm_record *r, uint64_t body, uint64_t len) {
    if (len != body + TIME_FOOTER) return 0;
    shm_time_footer f;
    memcpy(&f, (const uint8_t *)r + len - TIME_FOOTER, sizeof f);
    return f.magic == TIME_MAGIC && f.zero == 0;
}

/* Write the footer into a record of length n being filled (ring.c's fill). */
void timers_write_footer(shm_record *r, uint64_t n, uint64_t due_ns, uint64_t expire_ns) {
    shm_time_footer f = {due_ns, expire_ns, 0, TIME_MAGIC};
    memcpy((uint8_t *)r + n - TIME_FOOTER, &f, sizeof f);
}

/* A validated record (ring_peek) just taken into slot s, whose flags say REC_F_TIMES:
 * copy its times, if its footer is really there (the flag is a hint outside the durable
 * checksum; the footer's magic and place decide). A record without the flag costs its
 * caller one test of a word on the record's first cache line; its slot's time fields are
 * already 0 (invariant: non-zero only for a ready or delayed message with times, cleared
 * when it goes, dies, or the rebuild frees it). */
void timers_take_in(shm_chan *c, uint32_t s, shm_record *r) {
    uint64_t len = META_LEN(LOAD_RELAXED(&r->meta)); /* validated when it was peeked */
    uint64_t body = rec_size(r->nkeys, r->keys_len, r->data_len);
    if (LIKELY(len == body) || !timers_trailer_ok(r, body, len)) return;
    shm_slot *sl = &c->slots[s];
    shm_time_footer f;
    memcpy(&f, (const uint8_t *)r + len - TIME_FOOTER, sizeof f);
    sl->due_ns = f.due_ns;
    sl->expire_ns = f.expire_ns;
    if (f.due_ns || f.expire_ns) c->hdr->timed++;
}

static void clear_times(shm_chan *c, shm_slot *sl) {
    sl->due_ns = sl->expire_ns = 0;
    if (c->hdr->timed) c->hdr->timed--;
}

static uint64_t earliest(const shm_slot *sl) {
    return sl->expire_ns && sl->expire_ns < sl->due_ns ? sl->expire_ns : sl->due_ns;
}

/* Slot s was just popped from the ready heap: may it be handed out? 0: yes; 1: no, it is
 * delayed or dead now; < 0: corruption. Called only while header.timed != 0. */
int timers_gate(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    shm_slot *sl = &c->slots[s];
    if (!sl->due_ns && !sl->expire_ns) return 0;
    uint64_t now = realtime_ns();
    if (sl->expire_ns && now >= sl->expire_ns) {
        clear_times(c, sl);
        h->expired++;
        int rc = handles_dead_letter(c, s, SHM_DEAD_EXPIRED);
        return rc ? rc : 1;
    }
    if (sl->due_ns > now) {
        sl->next = h->delayed_head;
        h->delayed_head = s;
        h->delayed_count++;
        uint64_t at = earliest(sl);
        if (!h->next_due || at < h->next_due) h->next_due = at;
        return 1;
    }
    clear_times(c, sl);
    return 0;
}

/* Put the delayed messages whose time has come back on the ready heap. */
int timers_sweep(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t now = realtime_ns();
    if (now < h->next_due) return SHM_OK;
    uint32_t *link = &h->delayed_head, n = 0;
    uint64_t next = 0;
    for (uint32_t guard = 0; *link != NIL; guard++) {
        uint32_t s = *link;
        if (!SLOT_OK(c, s) || guard > c->cfg.max_messages) return SHM_E_CORRUPT;
        shm_slot *sl = &c->slots[s];
        uint64_t at = earliest(sl);
        if (at <= now) {
            *link = sl->next;
            int rc = sched_unpop(c, s); /* the ready heap, by its seq */
            if (rc) return rc;
            continue;
        }
        if (!next || at < next) next = at;
        n++;
        link = &sl->next;
    }
    h->delayed_count = n;
    h->next_due = next;
    return SHM_OK;
}

/* Slot s (nacked by the handle of generation gen) is about to go back on the ready heap:
 * apply the nack's delay, if its holder gave one. */
void timers_requeued(shm_chan *c, uint32_t s, uint32_t gen) {
    shm_slot *sl = &c->slots[s];
    /* relaxed: the caller's acquire load of the state word pairs with the holder's CAS,
     * which came after its store of this word (shm_nack_delay). */
    uint64_t w = LOAD_RELAXED(&sl->nack_delay);
    STORE_RELAXED(&sl->nack_delay, 0);
    uint32_t ms = (uint32_t)w;
    if ((uint32_t)(w >> 32) != gen || ms == 0) return;
    if (!sl->due_ns && !sl->expire_ns) c->hdr->timed++;
    sl->due_ns = realtime_ns() + (uint64_t)ms * 1000000ull;
}

/* The rebuild (rebuild.c) takes every waiting record in again: no delayed list, and no
 * slot keeps a time (the records give theirs back as they are taken in again). O(slots),
 * as the rebuild is. */
void timers_reset(shm_chan *c) {
    shm_header *h = c->hdr;
    for (uint32_t s = slots_touched(c, h) - 1; s >= 1; s--)
        c->slots[s].due_ns = c->slots[s].expire_ns = 0;
    h->timed = 0;
    h->delayed_count = 0;
    h->delayed_head = NIL;
    h->next_due = 0;
}

/* ---- any process ------------------------------------------------------------------------ */
int shm_nack_delay(shm_chan *c, uint32_t s, uint32_t gen, uint32_t delay_ms) {
    if (s == NIL || s >= slots_touched(c, c->hdr)) return SHM_E_INVALID; /* never handed out */
    /* relaxed: ordered before the nack's seq_cst CAS in shm_release, which the receiver's
     * acquire load of the state word pairs with (timers_requeued). */
    STORE_RELAXED(&c->slots[s].nack_delay, ((uint64_t)gen << 32) | delay_ms);
    return SHM_OK;
}

int shm_timer_stats_read(shm_chan *c, shm_timer_stats *out) {
    shm_header *h = c->hdr;
    /* relaxed: receiver-written counters, read as a snapshot (like shm_stats_read) */
    out->delayed = LOAD_RELAXED(&h->delayed_count);
    out->expired = LOAD_RELAXED(&h->expired);
    out->next_due = out->delayed ? LOAD_RELAXED(&h->next_due) : 0;
    return SHM_OK;
}

int shm_slot_timers(shm_chan *c, uint32_t s, uint64_t *due_ns, uint64_t *expire_ns,
                    uint32_t *dead_reason) {
    if (!SLOT_OK(c, s)) return SHM_E_INVALID;
    shm_slot *sl = &c->slots[s];
    /* relaxed: receiver-written; a reader in another process takes a snapshot, which the
     * caller checks against the slot's state word as inspect.c's readers do */
    *due_ns = LOAD_RELAXED(&sl->due_ns);
    *expire_ns = LOAD_RELAXED(&sl->expire_ns);
    *dead_reason = LOAD_RELAXED(&sl->dead_reason);
    return SHM_OK;
}

/* Seconds until the receiver must sweep the delayed list; < 0: nothing is delayed. Read
 * without the receiver's lock, as a hint for how long recv may sleep: a stale value
 * wakes it early (it sleeps again) or, at worst, as late as its next upkeep. */
double shm_timers_wait(shm_chan *c) {
    shm_header *h = c->hdr;
    /* relaxed: the receiver's own word, a hint like next_due. A delayed record left in
     * the ring past the tables' budget (lookahead.c) counts only while it is ahead: once
     * due, the poll that follows takes it in or a release does. */
    uint64_t ahead = LOAD_RELAXED(&c->ahead_due), now = realtime_ns();
    if (ahead <= now) ahead = 0;
    if (LIKELY(LOAD_RELAXED(&h->delayed_count) == 0) && LIKELY(!ahead)) return -1.0;
    uint64_t due = LOAD_RELAXED(&h->delayed_count) ? LOAD_RELAXED(&h->next_due) : 0;
    if (ahead && (!due || ahead < due)) due = ahead;
    if (!due) return -1.0;
    return due <= now ? 0.0 : (double)(due - now) * 1e-9;
}
