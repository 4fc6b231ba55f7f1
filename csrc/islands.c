/* islands.c -- records pinned by a zero-copy view: the ring flows around them.
 *
 * A handle's `data` is a memoryview straight into the ring, so its record may not move
 * until the handle is released (slot.pin, compact.c). Were head to wait for it, one view
 * held for long would stop the channel: head is where space is freed, and compaction
 * cannot slide a pinned record out of the way. Instead head passes it and the record
 * stays where it is, an *island*: the receiver notes it in a small table in the header,
 * and producers step over its bytes whenever the tail comes round to them again.
 *
 *     lap k:    head -> | P | ........ records ........ | tail
 *     lap k+1:  ... records | SKIP over ~~P~~ | records ...   (P's bytes untouched)
 *
 * The table (header.islands[SHM_ISLANDS]) is written only by the receiver. An entry is
 * (end, len) with end = pos + len, or end = 0 when free: the record at pos, len bytes long,
 * lives on although head has passed it. Positions are free-running and islands are made
 * at head, which only grows, so a re-used entry never shows an end it showed before:
 * readers check end before and after reading len (a seqlock on end, island_read).
 *
 * Receiver:
 *   make    (compact.c: island_make_at_head, when the record at head is in flight and
 *           pinned by a view, or in flight when space runs short and compaction cannot
 *           slide it; or a slide, for a pinned record its window passes) len, then
 *           end (release), then island_count (release);
 *           then head passes the record (ring_advance_head's release store of head, in
 *           the same call). So a producer that acquired a head beyond the island also
 *           sees its entry.
 *   remove  (ring_mark_done, when the message is finished: released, or a dead letter
 *           discarded) end = 0 (release), then island_count (release). From then on
 *           producers may reuse the bytes; one that read the entry before merely steps
 *           over free space once. A nacked island, or one whose holder died, stays: the
 *           message is handed out again from where it lies.
 *
 * Producer (ring.c claim), about to claim the tail at pos for n bytes: a claim must leave
 *   [pos, pos + n + REC_HDR) -- the record and the next tail's header -- clear of every
 *   island's bytes. Only islands that head has passed matter: one at ip >= head has its
 *   bytes in [head, tail) on this lap, and a whole ring after ip on the next, beyond
 *   anything a claim may reach (pos + n + REC_HDR <= head + capacity <= ip + ring size).
 *   If an island's bytes meet the claim, the producer claims pos all the same, for a SKIP
 *   record reaching to the end of the island (chained over islands that touch the next
 *   header: island_skip), and claims again from there. A SKIP is written like a
 *   cancelled claim -- claim, successor header, then its length and state; the seq passes
 *   on unchanged -- and its bytes after the header are never written: they are the
 *   island's. Invariant T of ring.c gains a clause: the tail's header never lies on an
 *   island (its predecessor checked; an island made later lies a whole ring behind).
 *   - A producer killed after its claim and before publishing the SKIP leaves a CLAIMED
 *     record; its repairer (shm_repair_claim) computes the skip again from the table (it
 *     can only have shrunk: islands are removed, and new ones lie behind), so the
 *     discard record it writes also ends beyond any island, inside the room the dead
 *     claimant checked.
 *   - A producer killed after publishing the SKIP left a finished record: nothing to do.
 * Receiver's intake (window.c) and head (ring.c) step over SKIP records; compaction
 * (compact.c) never copies anything into or over them: a SKIP is a wall, like a live
 * record that cannot move.
 *
 * Receiver killed: while making an island (entry written, head not yet past it), while
 * removing one, or between a release and freeing the slot -- the next receiver's rebuild
 * (rebuild.c, island_rebuild) keeps the entries whose record is still a message (a
 * handle holds it, or, behind head, it waits for its redelivery and is taken in again),
 * drops the rest, and recounts island_count and the byte counts. A dead viewer is a dead
 * holder: its message is redelivered from its island (rebuild.c), and the island goes
 * once that delivery is released.
 *
 * Accounting: stats' used_bytes counts live bytes -- head to tail, less the SKIP records
 * the receiver has seen in [head, scan_pos) (skip_bytes), plus the islands (island_bytes).
 *
 * Limits: at most SHM_ISLANDS islands at once. Past that a pinned record at head waits
 * there as before (the ring then fills behind it) until one of the views is released. A
 * record needs one contiguous run of free bytes: islands split the free space, so a
 * message larger than every run between them waits until one frees. Each island costs
 * producers one SKIP record per lap of the ring.
 */
#include "core.h"

/* Read entry i: 1 and (pos, len) if it holds an island. Bounds-checked: an entry no
 * correct receiver could have written is ignored. */
static int island_read(shm_chan *c, uint32_t i, uint64_t *pos, uint64_t *len) {
    shm_island *e = &c->hdr->islands[i];
    for (int tries = 0; tries < 64; tries++) {
        uint64_t end = LOAD_ACQUIRE(&e->end); /* pairs with island_add's release store */
        if (end == 0) return 0;
        uint64_t l = LOAD_RELAXED(&e->len);
        /* acquire fence: the len read above happens before the re-check; pairs with the
         * release fence in island_add (a re-use writes len only after end = 0). */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (LOAD_RELAXED(&e->end) != end) continue; /* re-used while we read */
        if (l < REC_BODY || (l & 7u) || (end & 7u) || l > c->cap - REC_HDR || end < l) return 0;
        *pos = end - l;
        *len = l;
        return 1;
    }
    return 0; /* changing under us all along: a receiver cannot do that; ignore it */
}

/* Producers: does [a, b) meet an island's bytes? 0 if not; else the position where the
 * claim may resume -- the end of that island, chained past any island that meets the
 * header there -- and *first, where the first island met begins. The caller acquired a
 * head beyond every island that can concern it (see above). */
uint64_t island_skip(shm_chan *c, uint64_t a, uint64_t b, uint64_t *first_out) {
    /* acquire: pairs with the release stores of island_count (island_add / island_remove):
     * an island made before the head we acquired is counted, and a count of 0 after a
     * removal comes with the receiver's last reads of its bytes. */
    if (LOAD_ACQUIRE(&c->hdr->island_count) == 0) return 0;
    uint64_t skip = 0, cap = c->cap;
    *first_out = 0;
    for (uint32_t round = 0; round <= SHM_ISLANDS; round++) {
        uint64_t first = UINT64_MAX, first_end = 0;
        for (uint32_t i = 0; i < SHM_ISLANDS; i++) {
            uint64_t ip, il;
            if (!island_read(c, i, &ip, &il)) continue;
            /* The island's bytes in position space: the copy starting in [a, a + cap),
             * and the one a lap before it, which may reach over a. */
            uint64_t j = a + ((ip % cap) + cap - (a % cap)) % cap;
            uint64_t start, end;
            if (j + il > a + cap) {
                start = a;
                end = j + il - cap;
            } else if (j < b) {
                start = j;
                end = j + il;
            } else {
                continue;
            }
            if (start < first) {
                first = start;
                first_end = end;
            }
        }
        if (first == UINT64_MAX) return skip;
        if (round == 0) *first_out = first;
        skip = first_end; /* then the header at the island's end must be clear too */
        a = first_end;
        b = first_end + REC_HDR;
    }
    return skip;
}

/* Receiver: the entry holding the island at pos, or -1 (island_find in core.h asks first
 * whether there is any). */
int island_lookup(shm_chan *c, uint64_t pos) {
    shm_header *h = c->hdr;
    if (LOAD_RELAXED(&h->island_count) == 0) return -1; /* receiver-written: its own writes */
    for (uint32_t i = 0; i < SHM_ISLANDS; i++) {
        uint64_t end = LOAD_RELAXED(&h->islands[i].end), len = LOAD_RELAXED(&h->islands[i].len);
        if (end != 0 && end >= len && end - len == pos) return (int)i;
    }
    return -1;
}

/* Receiver: note the record at pos (len bytes) as an island. 0 if the table is full. */
int island_add(shm_chan *c, uint64_t pos, uint64_t len) {
    shm_header *h = c->hdr;
    if (island_find(c, pos) >= 0) return 1;
    for (uint32_t i = 0; i < SHM_ISLANDS; i++) {
        shm_island *e = &h->islands[i];
        if (LOAD_RELAXED(&e->end) != 0) continue;
        /* release fence: this entry's end = 0 (its removal) is ordered before the len
         * below; pairs with the acquire fence in island_read. */
        __atomic_thread_fence(__ATOMIC_RELEASE);
        STORE_RELAXED(&e->len, len);
        STORE_RELEASE(&e->end, pos + len); /* pairs with island_read's acquire load */
        /* release: pairs with the acquire load in island_skip; head is stored after it */
        STORE_RELEASE(&h->island_count, LOAD_RELAXED(&h->island_count) + 1);
        h->island_bytes += len;
        ring_head_unknown(c); /* head may pass it now */
        return 1;
    }
    return 0; /* table full */
}

void island_remove(shm_chan *c, int i) {
    shm_header *h = c->hdr;
    if (i < 0 || i >= (int)SHM_ISLANDS) return;
    shm_island *e = &h->islands[i];
    uint64_t len = LOAD_RELAXED(&e->len);
    /* release: our reads of the record (and the holder's, ended by its release, which we
     * acquired) happen before producers may reuse its bytes; pairs with the acquire load
     * in island_read. */
    STORE_RELEASE(&e->end, 0);
    uint32_t n = LOAD_RELAXED(&h->island_count);
    /* release: pairs with the acquire load in island_skip (a claim that sees no island
     * left may write over these bytes) */
    if (n) STORE_RELEASE(&h->island_count, n - 1);
    h->island_bytes = h->island_bytes >= len ? h->island_bytes - len : 0;
}

/* Receiver: the record at head is in flight (viewed: and pinned by a zero-copy view):
 * make it an island and let head pass it. 1 if head moved. */
int island_make_at_head(shm_chan *c, uint64_t head, int viewed) {
    shm_record *r = rec_at(c, head);
    uint64_t meta = LOAD_RELAXED(&r->meta); /* consumer-owned: behind ingest_pos */
    uint64_t len = META_LEN(meta);
    if (META_STATE(meta) != REC_COMMITTED || len < REC_BODY || (len & 7u) ||
        len > c->cap - REC_HDR || head >= c->hdr->ingest_pos)
        return 0;
    uint32_t s = r->slot;
    if (s == NIL || s > c->cfg.max_messages) return 0;
    shm_slot *sl = &c->slots[s];
    if (LOAD_RELAXED(&sl->pos) != head || sl->seq != r->seq) return 0;
    /* acquire: pairs with the holder's CAS that moves the state out of INFLIGHT (any other
     * state at head is compaction's to move). */
    if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) != SLOT_INFLIGHT) return 0;
    /* acquire: pairs with the holder's CAS FREE -> VIEWED (shm_handle_view); a pin is
     * only undone when the message is handed out again, by us. */
    if (viewed && LOAD_ACQUIRE(&sl->pin) != PIN_VIEWED) return 0;
    if (!island_add(c, head, len)) return 0;
    return ring_advance_head(c); /* passes it: island_find says so */
}

/* Receiver's rebuild (rebuild.c), after it kept the handed-out slots (kept_pos: their
 * records' positions) and before it looks at the ring from head. Entries whose record
 * belongs to a kept slot stay. An entry behind head that no kept slot owns is a message
 * waiting for its redelivery (nacked, or its holder died): it is taken in again, here,
 * before anything after head (it is older). Everything else is dropped: an island made
 * by a receiver that died before head passed it is an ordinary record again. The
 * counts are made anew. Entries are checked like anything read from the segment. */
int island_rebuild(shm_chan *c, const uint64_t *kept_pos, uint32_t nkept) {
    shm_header *h = c->hdr;
    uint64_t order[SHM_ISLANDS];
    uint32_t norder = 0, count = 0;
    h->island_bytes = 0;
    /* release: pairs with island_skip's acquire load; it reads every entry meanwhile */
    STORE_RELEASE(&h->island_count, SHM_ISLANDS);
    for (uint32_t i = 0; i < SHM_ISLANDS; i++) {
        shm_island *e = &h->islands[i];
        uint64_t end = LOAD_RELAXED(&e->end), len = LOAD_RELAXED(&e->len);
        if (end == 0) continue;
        uint64_t pos = end - len;
        int ok = end >= len && len >= REC_BODY && (len & 7u) == 0 && len <= c->cap - REC_HDR &&
                 (pos & 7u) == 0;
        int kept = 0;
        for (uint32_t k = 0; ok && k < nkept && !kept; k++) kept = kept_pos[k] == pos;
        if (ok && !kept) {
            shm_record *r = rec_at(c, pos);
            uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
            /* behind head, by any number of laps: islands stay where they are */
            ok = pos < h->head && META_STATE(meta) == REC_COMMITTED &&
                 META_LEN(meta) == len && ring_validate_body(c, r, len) == SHM_OK;
            if (ok) { /* taken in again below, in ring (= seq) order */
                uint32_t j = norder++;
                while (j > 0 && order[j - 1] > pos) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = pos;
            }
        }
        if (!ok) {
            STORE_RELEASE(&e->end, 0); /* pairs with island_read */
            continue;
        }
        count++;
        h->island_bytes += len;
    }
    STORE_RELEASE(&h->island_count, count); /* pairs with island_skip */
    for (uint32_t i = 0; i < norder; i++) {
        shm_record *r = rec_at(c, order[i]);
        uint32_t s;
        /* it heads its lines (it was handed out before, and a nack keeps its place) */
        int rc = sched_take_in(c, r, order[i], &s);
        if (rc) return rc;
        if (h->ingested) h->ingested--; /* counted when it was first taken in */
    }
    return SHM_OK;
}
