/* compact.c -- no head-of-line blocking of space: sliding long-lived records forward.
 *
 * The ring frees space only at its head, in order. A message that stays in the channel
 * for long -- a handle held for hours, a message waiting behind it on the same key, a
 * dead letter -- would pin the head and, with it, every byte behind it, even once those
 * bytes' messages are long released. So when the head is pinned and the ring is more
 * than half used, the receiver compacts (an idea from copying garbage collectors):
 *
 *     head                                                   end
 *     | L1 | done | L2 | L3 | done | ... | done done done done | (live, or ingest_pos)
 *       the block: live records and short finished     the gap G: a finished run
 *       runs between them                              >= longest Li + a header
 *
 *  => | filler (DONE)                                 | L1' | L2' | L3' |
 *                                                       ^ head after the filler is passed
 *
 * The live records Li are moved one at a time, last first, each to the end of the
 * finished stretch that follows it; that stretch starts as G and only grows (it takes in
 * the record's old place and the short runs before it), so no step needs more room than
 * one record plus a header, and long-lived records scattered among released ones --
 * dead letters every tenth message -- are gathered at the front of the free space
 * instead of each pinning the ring. One step, for the record L at `at`:
 *   1. one DONE header at at + len(L) covers everything up to the stretch's end (one
 *      store: the chain stays whole);
 *   2. L is copied to the end of that stretch (inside a finished record: invisible);
 *   3. its slot's pos is switched to the copy (release store);
 *   4. one DONE header at `at` covers [at, copy): the chain now runs through the copy.
 * Finally head moves past the filler (release store). Everything here lies before
 * ingest_pos, in space only the receiver writes, so producers are not involved, and the
 * records' order in the ring (= their seq order) is kept.
 *
 * When the slide finds nothing to do, the block at head -- live records up to the first
 * finished one, parked records (window.c) included -- is moved in one piece to the end of
 * the gap after it, if that gap is at least as large (try_compact): parked records have
 * no slot, and their key chains follow them as one block (window_moved). Everything up
 * to scan_pos is the receiver's alone.
 *
 * Readers of a moved record are never exposed to reused bytes:
 *   - copies (payload, keys, dead letters) follow a seqlock: read pos, copy, and accept
 *     only if pos and the slot's state word are unchanged afterwards (shm_unmoved). A
 *     record's old bytes are overwritten (by a later step's copy, or after head passed
 *     them) only after its pos changed, with a release fence in between.
 *   - zero-copy views pin the record: a holder CASes slot.pin FREE -> VIEWED; the
 *     receiver moves an in-flight record only after CASing FREE -> MOVING, and puts FREE
 *     back when the copy and pos are in place. A pinned record stops compaction at it;
 *     once it reaches head it becomes an island instead (islands.c): head passes it and
 *     it stays where it is. A SKIP record (the producers' step over an island's bytes)
 *     ends a gap, and nothing is ever copied into it; the records before it slide past
 *     it only when G takes all of them at once, and the fillers then cover it (its
 *     header is the ring's, the rest the island's: neither is read again). The block
 *     move below carries the block past skips the same way, into the finished run
 *     after the last of them.
 * A receiver killed mid-compaction leaves the chain whole and every slot's pos on a
 * whole copy: a moved record's old copy is either still in the chain (then recovery
 * skips it as stale: its slot points at the other copy) or inside a filler.
 *
 * Cost: a slide copies the live bytes of the block to free G. While free space is
 * plentiful and nobody waits for it, a slide waits for G to reach the block's size (or a
 * sixteenth of the ring), so each byte freed costs at most about one byte copied; when
 * space runs low any G that makes progress is used.
 */
#include "core.h"

#define COMPACT_MAX_RECORDS 1024u /* bound on one block, to bound one call's work */

/* Is the record at pos a message that may be moved now? Sets *slot (NIL for a record
 * parked in key chains: window_moved fixes its chains up). */
static int movable(shm_chan *c, uint64_t pos, uint64_t len, uint32_t *slot) {
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_RELAXED(&r->meta); /* consumer-owned: behind scan_pos */
    if (META_STATE(meta) != REC_COMMITTED || META_LEN(meta) != len || len < REC_BODY) return 0;
    uint32_t s = r->slot;
    if (s == NIL && window_parked_movable(c, pos)) {
        *slot = NIL;
        return 1;
    }
    if (s == NIL || s > c->cfg.max_messages) return 0;
    shm_slot *sl = &c->slots[s];
    if (LOAD_RELAXED(&sl->pos) != pos || sl->seq != r->seq) return 0;
    uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&sl->state)); /* pairs with holders' CAS */
    if (st == SLOT_INFLIGHT && LOAD_ACQUIRE(&sl->pin) != PIN_FREE) return 0;
    if (st != SLOT_WAITING && st != SLOT_READY && st != SLOT_INFLIGHT && st != SLOT_DEAD) return 0;
    *slot = s;
    return 1;
}

static uint64_t rec_len(shm_chan *c, uint64_t pos) {
    uint64_t meta = LOAD_RELAXED(&rec_at(c, pos)->meta);
    uint64_t len = META_LEN(meta);
    return (len >= REC_HDR && (len & 7u) == 0 && len <= c->cap - REC_HDR) ? len : 0;
}

static int finished(shm_chan *c, uint64_t pos) {
    uint32_t st = META_STATE(LOAD_RELAXED(&rec_at(c, pos)->meta));
    return st == REC_DONE || st == REC_DISCARDED || st == REC_CANCELLED;
}

/* A SKIP record: its header is the ring's, the bytes after it an island's (islands.c). */
static int is_skip(shm_chan *c, uint64_t pos) {
    return META_STATE(LOAD_RELAXED(&rec_at(c, pos)->meta)) == REC_SKIP;
}

/* Does ingest_pos (window.c) lie strictly inside [from, to)? */
static int h_ingest_inside(shm_chan *c, uint64_t from, uint64_t to) {
    return c->hdr->ingest_pos > from && c->hdr->ingest_pos < to;
}

/* The gap G a slide needs. Each step moves one record to the end of the finished stretch
 * after it, which keeps a header in front, so G must hold the longest record plus a
 * header (the stretch only grows from step to step) -- unless a skip lies in the block:
 * a stretch across it holds island bytes that no copy may land on, so then G must hold
 * every copy at once. */
static uint64_t slide_room(uint64_t longest, uint64_t live, uint64_t skips) {
    return (skips ? live : longest) + REC_HDR;
}

/* The slide: one try at the records at head, up to stop (<= ingest_pos: every record
 * before it has a slot, so each one's pos is all that follows it); *looked counts the
 * records it visited, and *watch is the record that ended the look (whose finishing may
 * change the answer). 1: slid; 0: cannot now; -1: can, but not worth it yet. */
static int try_slide(shm_chan *c, uint64_t head, uint64_t stop, uint64_t tail,
                     uint32_t *looked, uint64_t *watch) {
    /* The block: live records from head on, with the short finished runs between them,
     * up to the first finished run G long enough to take the longest of them. */
    uint32_t slots[COMPACT_MAX_RECORDS];
    uint64_t poss[COMPACT_MAX_RECORDS], lens[COMPACT_MAX_RECORDS];
    uint64_t pos = head, live = 0, longest = 0, run = 0, run_start = head, skips = 0;
    uint32_t n = 0;
    while (pos < stop) {
        (*looked)++;
        *watch = pos;
        uint64_t len = rec_len(c, pos);
        if (!len || len > stop - pos) return 0;
        if (finished(c, pos)) {
            if (run == 0) run_start = pos;
            run += len;
            pos += len;
            continue;
        }
        if (n > 0 && run >= slide_room(longest, live, skips)) break; /* the gap G: [run_start, pos) */
        if (is_skip(c, pos)) {
            /* a step over an island's bytes (islands.c): no copy may land on them, so a
             * gap never spans one; the records before it may still slide past it (the
             * skip ends inside a filler), but only all of them into G at once */
            skips += len;
            run = 0;
        } else {
            if (n == COMPACT_MAX_RECORDS || !movable(c, pos, len, &slots[n]) || slots[n] == NIL)
                return 0;
            poss[n] = pos;
            lens[n++] = len;
            live += len;
            if (len > longest) longest = len;
            run = 0;
        }
        pos += len;
    }
    /* pos: where the gap ends (the next live record, a skip, or stop) */
    if (n == 0 || run < slide_room(longest, live, skips)) return 0;
    uint64_t gap = run, end = pos;
    (void)run_start;
    /* Each step moves one record to the end of the gap that follows it, which keeps a
     * header in front: G must hold the longest record plus a header (the gap only grows
     * from step to step). A gap smaller than the live bytes (each slide copies them all)
     * is worth a slide only once free space runs low or a sender waits for space; until
     * then let it grow, up to a sixteenth of the ring. */
    uint64_t worth = live < c->limit / 16 ? live : c->limit / 16;
    if (gap < worth && tail - head < c->limit - c->limit / 4 &&
        LOAD_RELAXED(&c->hdr->space_waiters) == 0) /* a hint: pairs with nothing */
        return -1; /* not yet: no failure, look again at the next call */

    /* 0. in-flight records: stop holders from taking views until we are done */
    uint32_t pinned = 0;
    for (; pinned < n; pinned++) {
        shm_slot *sl = &c->slots[slots[pinned]];
        if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) != SLOT_INFLIGHT) continue;
        uint32_t free_ = PIN_FREE;
        /* seq_cst: pairs with the holder's CAS FREE -> VIEWED in shm_handle_view. */
        if (!CAS_SEQCST(&sl->pin, &free_, PIN_MOVING)) break;
    }
    if (pinned < n) { /* someone took a view just now: undo and give up */
        for (uint32_t i = 0; i < pinned; i++) {
            shm_slot *sl = &c->slots[slots[i]];
            if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE);
        }
        return 0;
    }
    /* Last record first: each moves to the end of the gap that follows it. */
    uint64_t gap_end = end;
    for (uint32_t i = n; i-- > 0;) {
        uint64_t at = poss[i], after = at + lens[i];
        /* 1. what follows the record up to gap_end -- finished records, the previous
         * step's filler -- becomes one finished record (one store: the chain stays whole;
         * receiver-only region behind ingest_pos) */
        STORE_RELEASE(&rec_at(c, after)->meta, META(gap_end - after, REC_DONE));
        /* 2. the copy at the end of that record: invisible to the chain. dst >= after +
         * REC_HDR, so it overlaps neither the original nor that header; the ring is
         * mapped twice, so both are contiguous. */
        uint64_t dst = gap_end - lens[i];
        memcpy(ring_at(c, dst), ring_at(c, at), lens[i]);
        /* 3. switch the message over. release: pairs with readers' acquire of pos
         * (msg_fill) and the fence in shm_unmoved. */
        shm_slot *sl = &c->slots[slots[i]];
        STORE_RELEASE(&sl->pos, dst);
        if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE); /* pairs with shm_handle_view */
        /* 4. one store re-links the chain: [at, dst) is finished, then the copy */
        STORE_RELEASE(&rec_at(c, at)->meta, META(dst - at, REC_DONE));
        /* release fence: the next step's copy may overwrite this record's old bytes;
         * it is ordered after the pos store above. Pairs with the acquire fence in
         * shm_unmoved: a reader that copied any overwritten byte sees the new pos. */
        __atomic_thread_fence(__ATOMIC_RELEASE);
        gap_end = dst;
    }
    /* the skips in the block are inside fillers now, which head passes as finished */
    c->hdr->skip_bytes = c->hdr->skip_bytes >= skips ? c->hdr->skip_bytes - skips : 0;
    /* 5. free the space (release store of head inside) */
    ring_advance_head(c);
    return 1;
}

/* One try at the pinned block at head; *looked counts the records it visited, and
 * *watch is the record that ended the look (whose finishing may change the answer). */
static int try_compact(shm_chan *c, uint64_t head, uint64_t stop, uint32_t *looked,
                       uint64_t *watch) {
    /* the pinned block [head, head + block) */
    uint32_t slots[COMPACT_MAX_RECORDS];
    uint64_t lens[COMPACT_MAX_RECORDS];
    uint64_t pos = head, block = 0;
    uint32_t n = 0;
    while (pos < stop && n < COMPACT_MAX_RECORDS && !finished(c, pos) && !is_skip(c, pos)) {
        (*looked)++;
        *watch = pos;
        uint64_t len = rec_len(c, pos);
        if (!len || !movable(c, pos, len, &slots[n])) return 0;
        lens[n++] = len;
        pos += len;
        block += len;
    }
    *watch = pos;
    if (n == 0 || pos >= stop) return 0;
    /* the gap after it, [head + block, end): finished records, and skips over islands
     * (islands.c), which the filler covers; the copies go after the last skip */
    uint64_t gap = 0, end = pos, skips = 0;
    while (end < stop && (finished(c, end) || is_skip(c, end))) {
        (*looked)++;
        uint64_t len = rec_len(c, end);
        if (!len) return 0;
        if (is_skip(c, end)) {
            skips += len;
            gap = 0;
        } else {
            gap += len;
        }
        end += len;
    }
    *watch = end;
    /* The gap keeps its own header while the copies sit at its end: room for both. */
    if (gap < block + REC_HDR) return 0;
    /* ingest_pos must stay on a record boundary: not inside the filler */
    if (skips && h_ingest_inside(c, pos, end)) return 0;

    /* 0. in-flight records: stop holders from taking views until we are done */
    uint32_t pinned = 0;
    for (; pinned < n; pinned++) {
        if (slots[pinned] == NIL) continue; /* parked: no handle, no view */
        shm_slot *sl = &c->slots[slots[pinned]];
        if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) != SLOT_INFLIGHT) continue;
        uint32_t free_ = PIN_FREE;
        /* seq_cst: pairs with the holder's CAS FREE -> VIEWED in shm_handle_view. */
        if (!CAS_SEQCST(&sl->pin, &free_, PIN_MOVING)) break;
    }
    if (pinned < n) { /* someone took a view just now: undo and give up */
        for (uint32_t i = 0; i < pinned; i++) {
            if (slots[i] == NIL) continue;
            shm_slot *sl = &c->slots[slots[i]];
            if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE);
        }
        return 0;
    }
    /* 1. the gap becomes one finished record (one store: the chain stays whole) */
    shm_record *g = rec_at(c, head + block);
    STORE_RELEASE(&g->meta, META(end - head - block, REC_DONE)); /* receiver-only region; see below */
    /* 2. copies at the end of the gap, inside that record: invisible to the chain */
    uint64_t dst = end - block;
    memcpy(ring_at(c, dst), ring_at(c, head), block); /* contiguous: the ring is mapped twice */
    /* 3. switch each message over */
    uint64_t at = dst;
    window_moved(c, head, block, dst - head); /* parked records' chains follow them */
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i] == NIL) { /* parked */
            at += lens[i];
            continue;
        }
        shm_slot *sl = &c->slots[slots[i]];
        /* release: pairs with readers' acquire of pos (msg_fill) and the fence in
         * shm_unmoved; the old bytes are untouched until head passes them (step 5). */
        STORE_RELEASE(&sl->pos, at);
        if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE); /* pairs with shm_handle_view */
        at += lens[i];
    }
    /* 4. one store re-links the chain: filler [head, dst) then the copies */
    STORE_RELEASE(&rec_at(c, head)->meta, META(dst - head, REC_DONE));
    /* the skips passed are inside the filler now, which head passes as finished */
    c->hdr->skip_bytes = c->hdr->skip_bytes >= skips ? c->hdr->skip_bytes - skips : 0;
    /* 5. free the space (release store of head inside) */
    ring_advance_head(c);
    return 1;
}

int compact(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t head = h->head, stop = h->scan_pos; /* everything looked at */
    if (head >= stop || finished(c, head)) return 0; /* nothing pinned: the common case */
    /* Space can only be won inside [head, stop): below a sixteenth of the ring there is
     * too little to be worth it (and this keeps a receiver that holds its latest
     * message off the producers' cache line below). */
    if (stop - head < c->limit / 16) return 0;
    /* Only now look at the producers' cache line. */
    uint64_t tail = LOAD_ACQUIRE(&h->tail_hint); /* pairs with hint_raise */
    if (tail - head <= c->limit / 2) return 0;
    /* A record pinned by a zero-copy view at head cannot move: the ring flows around it
     * instead (islands.c). Head passes it; producers step over its bytes. */
    if (island_make_at_head(c, head, 1)) return 1;
    /* After a failed try, wait before the next: without this a long unfinished backlog
     * would be walked on every poll. Try again once the record that ended the look
     * finishes (the gap may now be long enough: ring_mark_done watches for it), or
     * after a quarter as many records finished as the try looked at -- a few record
     * visits per record finished. */
    /* RECHECK_NS passing also ends the wait: records can become movable without
     * finishing (a view dropped, a nacked message handed out). */
    if (c->done_count < c->compact_retry_at && !c->compact_watch_hit &&
        coarse_ns() - c->compact_fail_ns < RECHECK_NS)
        return 0;
    uint32_t looked = 0;
    uint64_t watch = head;
    /* First the slide, over what was taken in; then the whole block at head, which may
     * also carry parked records (their chains follow them: window_moved). */
    uint64_t taken = h->ingest_pos < stop ? h->ingest_pos : stop;
    int slid = try_slide(c, head, taken, tail, &looked, &watch);
    if (slid > 0) return 1;
    if (slid < 0) return 0; /* worth it soon: no wait before the next try */
    if (try_compact(c, head, stop, &looked, &watch)) return 1;
    /* Neither could move the handle at head -- a pinned record right behind it, or an
     * island's skip: it stays where it is too, as an island, once space runs short. */
    if ((tail - head >= c->limit - c->limit / 4 || LOAD_RELAXED(&h->space_waiters)) &&
        island_make_at_head(c, head, 0)) /* space_waiters: a hint, pairs with nothing */
        return 1;
    c->compact_retry_at = c->done_count + 1 + looked / 4;
    c->compact_watch_end = watch;
    c->compact_watch_hit = 0;
    c->compact_fail_ns = coarse_ns();
    return 0;
}
