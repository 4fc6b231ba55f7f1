/* lane.h -- the ready lane: messages that became ready in seq order, a FIFO beside the
 * ready heap (sched.c).
 *
 * The receiver takes new records in in ring order, which is seq order, and most of them
 * are ready as they are taken in. On the binary heap each would cost O(log ready) to push
 * and to pop, though they come sorted. So a message that becomes ready with a seq above
 * every seq on the lane is appended to the lane instead; any other (one woken from a key's
 * line, a redelivery, a delayed one whose time came: older seqs) goes on the heap. The
 * lane is sorted by construction and the heap is a heap, so the lowest-seq ready message
 * is the smaller of the two heads: sched_pop_ready compares them. O(1) per push and pop
 * on the lane. A paused key (hold.c) needs the heap's skip-the-held-back walk: the paused
 * path moves the lane onto the heap first (sched.c lane_merge), each entry once.
 *
 * The lane is a singly linked list through slot.next, from header.lane_head to
 * header.lane_tail. slot.next is free while a slot is READY: the free list holds only
 * FREE slots, and the delayed list (timers.c) takes a slot only after it was popped.
 *
 * Invariants: lane_count slots on the list, each READY, seqs strictly increasing,
 * lane_tail the last; ready_count == heap_count + lane_count. Receiver only, under rx_mu
 * with the header dirty: a receiver that dies half way leaves dirty set, and the rebuild
 * (rebuild.c) starts again from an empty lane. Every index read back is checked first.
 * Inline: these run once or twice per message handed out; sched.c and rebuild.c use them.
 */
#ifndef SHMCHAN_LANE_H
#define SHMCHAN_LANE_H
#include "core.h"

#define LANE_SLOT_OK(c, s) ((s) >= 1 && (s) <= (c)->cfg.max_messages)

static inline void lane_reset(shm_chan *c) {
    c->hdr->lane_head = c->hdr->lane_tail = NIL;
    c->hdr->lane_count = 0;
}

/* Append READY slot s if its seq is above the lane's last: 1 appended, 0 not (the heap
 * takes it), SHM_E_CORRUPT. */
static inline int lane_append(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    if (h->lane_count) {
        uint32_t t = h->lane_tail;
        if (!LANE_SLOT_OK(c, t) || h->lane_count >= c->cfg.max_messages) return SHM_E_CORRUPT;
        if (c->slots[t].seq >= c->slots[s].seq) return 0;
        c->slots[t].next = s;
    } else {
        h->lane_head = s;
    }
    c->slots[s].next = NIL;
    h->lane_tail = s;
    h->lane_count++;
    return 1;
}

/* The lane's first slot: NIL if the lane is empty, UINT32_MAX if the link is bad. */
static inline uint32_t lane_first(shm_chan *c) {
    shm_header *h = c->hdr;
    if (h->lane_count == 0) return NIL;
    uint32_t s = h->lane_head;
    if (!LANE_SLOT_OK(c, s) || SLOT_STATE(c->slots[s].state) != SLOT_READY) return UINT32_MAX;
    return s;
}

/* Take off the first slot s (from lane_first). Its link is checked when it is first. */
static inline void lane_drop_first(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    if (--h->lane_count == 0) {
        lane_reset(c);
        return;
    }
    h->lane_head = c->slots[s].next;
}

/* The self-check: the list holds lane_count READY slots in increasing seq, ending at
 * lane_tail. *count: slots found. SHM_OK or SHM_E_CORRUPT. */
static inline int lane_check(shm_chan *c, uint32_t *count) {
    shm_header *h = c->hdr;
    uint32_t n = 0, last = NIL;
    uint64_t seq = 0;
    for (uint32_t s = h->lane_count ? h->lane_head : NIL; n < h->lane_count; s = c->slots[s].next) {
        if (!LANE_SLOT_OK(c, s) || n >= c->cfg.max_messages) return SHM_E_CORRUPT;
        shm_slot *sl = &c->slots[s];
        if (SLOT_STATE(sl->state) != SLOT_READY || (n && sl->seq <= seq)) return SHM_E_CORRUPT;
        seq = sl->seq;
        last = s;
        n++;
    }
    *count = n;
    return last == (n ? h->lane_tail : NIL) ? SHM_OK : SHM_E_CORRUPT;
}

#endif
