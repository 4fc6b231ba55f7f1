/* compact.c -- no head-of-line blocking of space: sliding long-lived records forward.
 *
 * The ring frees space only at its head, in order. A message that stays in the channel
 * for long -- a handle held for hours, the messages parked behind it on its key
 * (window.c), a dead letter -- would pin the head and, with it, every byte behind it, even
 * once those bytes' messages are long released. So when the head is pinned and the ring is
 * more than half used, the receiver compacts (the sliding compaction of garbage
 * collectors, done one record at a time so that the ring stays whole at every store):
 *
 *     head                                                                   E
 *     | L1 | done | L2 | L3 | done | W | L4 | done ... done | done done done |
 *
 *  => | filler (DONE), W inside it                              | L1'| L2'| L3'| L4'|
 *                                                               ^ head, once past the filler
 *
 * The window. From head on, the receiver looks at the records up to scan_pos: everything
 * there is its own (taken in, parked, finished; producers write only past the tail). Each
 * record is one of:
 *   - finished (DONE, DISCARDED, CANCELLED): free space, once head passes it;
 *   - a move: a message that may go elsewhere -- taken in (waiting, ready, a dead letter),
 *     in flight without a zero-copy view, or parked in its keys' chains (no slot: its
 *     chains follow it, window_moved);
 *   - a soft wall, which stays where it is and which the moves may pass: a SKIP over an
 *     island's bytes (islands.c), an island made earlier, or a record pinned by a
 *     zero-copy view, which becomes an island when the window passes it. Only in a
 *     window that head reaches in the same call (everything from head to its first move
 *     finished or skipped): the filler over a wall is finished space to any later slide,
 *     which would copy onto the island bytes inside it, so head must pass it at once;
 *   - a hard wall, which nothing passes: a record being written (a placeholder), a message
 *     on its way back from its holder (released or nacked, not yet taken back), a soft
 *     wall in a window head does not reach, a pinned record when no island entry is
 *     left, anything unknown.
 * The window runs from its first move to an end E, and packing its moves, in order, at
 * the end of [first move, E) frees everything before them: one filler from the first move's
 * place to the first copy. E is the end of a finished run, chosen as far on as is useful
 * (the slide then frees a COMPACT_TARGET of the ring, and twice what it copies) within
 * bounds on the entries and the bytes copied. A hard wall ends the look if a window
 * before it works; otherwise a new window starts after it (the same when the bounds are
 * reached with nothing that works: the records before stay, and the next call finds the
 * space freed after them).
 *
 * The steps, for each move L at `at` (len bytes), last first; gap_end starts at E and is
 * where the previous copy starts:
 *   1. one DONE header at h1 covers [h1, gap_end) -- h1 = at + len, or, if pinned records
 *      or islands follow L directly, the end of them (their headers stay whole: the
 *      message is read and handed out from there). One store: the chain stays whole.
 *   2. L is copied to dst = gap_end - len, inside that finished record: invisible. The
 *      ring is mapped twice, so both are contiguous;
 *   3. its slot's pos is switched to the copy (release store); a parked record has none;
 *   4. one DONE header at `at` covers [at, dst): the chain now runs through the copy.
 * The room each step needs: dst >= h1 + REC_HDR, so that the copy overlaps neither L nor
 * the header of step 1; and no copy may land on a wall's bytes, so if the window has
 * walls every copy lies past the last one: E - (bytes moved) >= end of the last wall +
 * REC_HDR. For a move after the last wall the first condition reads: the finished bytes
 * after it up to E, less the moves after it, are at least len + REC_HDR. The look keeps
 * the smallest such margin over its moves (slack) as it goes, so each candidate E is
 * checked in O(1).
 * Then: the parked records' chains point at their copies (window_moved), ingest_pos moves
 * past the filler if it lay in the window, and head moves past the filler (release store).
 * Nothing may fail once the first byte has moved: the chains would name the old places,
 * now inside a filler or under another copy. So what window_moved needs (a place for
 * the parked records' key hashes, at most one per key of each: the look counts them) is
 * reserved before step 0, and a window whose reservation fails is not slid this time,
 * as when a view is taken meanwhile. Should window_moved still find a chain it cannot
 * follow, the receiver rebuilds its derived state from the ring at once (rebuild.c), as
 * a new receiver would; if that fails too, the header stays dirty and the operation
 * reports the channel corrupt.
 * The records' order in the ring (= their seq order, and a fifo chain's order) is kept.
 *
 * Islands made by the slide: a pinned record inside the window gets its island entry
 * before the first step (islands.c: entry first, then head passes it); the window is one
 * head reaches in the same call (above), so an island lies behind head once the call ends.
 *
 * Readers of a moved record are never exposed to reused bytes:
 *   - copies (payload, keys, dead letters) follow a seqlock: read pos, copy, and accept
 *     only if pos and the slot's state word are unchanged afterwards (shm_unmoved). A
 *     record's old bytes are overwritten (by a later step's copy, or after head passed
 *     them) only after its pos changed, with a release fence in between.
 *   - zero-copy views pin the record: a holder CASes slot.pin FREE -> VIEWED; the
 *     receiver moves an in-flight record only after CASing FREE -> MOVING, and puts FREE
 *     back when the copy and pos are in place. A pinned record is a wall (above); at
 *     head it becomes an island at once (islands.c).
 *   - parked records have no reader but the receiver (and inspectors, which retry on the
 *     receiver's seqlock: rx_begin / rx_end).
 * A receiver killed mid-compaction leaves the chain whole, holding exactly one copy of a
 * parked record, and every slot's pos on a whole copy: a moved message's old copy is
 * either still in the chain (then recovery skips it as stale: its slot points at the
 * other copy) or inside a filler. The chains, the links in parked records and ingest_pos
 * are receiver state that a rebuild makes anew from the ring (rebuild.c). An island
 * entry written before the fillers is kept by the rebuild (its slot is a live handle) and
 * passed by head as any island.
 *
 * Cost: a slide copies the live bytes of its window to free the finished bytes in it.
 * It runs only while the head is pinned and the ring is more than half used, or a sender
 * was refused or waits (its message may be larger than what is free); while free
 * space is plentiful and no sender waits for it, a slide that would free less than it
 * copies (or a sixteenth of the ring) waits for more to finish. A failed look is not
 * repeated until records finish, the record that ended it finishes, RECHECK_NS pass, or
 * a sender is refused (header.refusals, counted by ring.c's claim): a sender that found
 * the ring full gets a look at the next poll.
 */
#include <stdlib.h>

#include "core.h"

#define COMPACT_MAX 1024u       /* entries (moves and walls) a window first has room for */
#define COMPACT_VISITS 65536u   /* records one look visits at most, in a small ring     */
/* A slide freeing this much, and at least twice what it copies, looks no further: the
 * copying is what costs, so a long run of live records (a parked backlog) is slid past as
 * much finished space as the look finds, not moved again for every eighth of the ring. */
#define COMPACT_TARGET(c) ((c)->limit / 8)
#define COMPACT_BUDGET(c) ((c)->limit / 2)  /* the most one slide copies                  */

enum { E_MOVE, E_SKIP, E_PIN, E_ISLAND, E_HARD };

typedef struct {
    uint64_t pos, len;
    uint32_t slot; /* E_MOVE: the message's slot, NIL for a parked record */
    uint32_t kind; /* E_MOVE ... E_ISLAND */
} entry;

/* How far one look may go: every record the ring can hold (none is shorter than REC_BODY
 * but a SKIP, and a SKIP long enough to matter is longer), at least COMPACT_VISITS. A
 * fixed bound on the records a look visits, or on the entries of a window, would make a
 * run of parked records longer than it at head unmovable for ever -- every look starts
 * at head and would end inside the run -- and the ring would fill behind it with the
 * sender refused: a backlog of 100 000 small messages parked on one held key is such a
 * run. So a window may take in the whole run, and the entries grow to what it needs. */
static uint64_t compact_visits(const shm_chan *c) {
    uint64_t n = c->limit / REC_BODY;
    return n > COMPACT_VISITS ? n : COMPACT_VISITS;
}

/* The receiver's buffer for a window (process-local, compact_buf): compact_cap entries,
 * then compact_cap positions twice (the slide's parked records, old and new). */
static entry *buf_entries(shm_chan *c) { return (entry *)c->compact_buf; }
static uint64_t *buf_from(shm_chan *c) { return (uint64_t *)(buf_entries(c) + c->compact_cap); }
static uint64_t *buf_to(shm_chan *c) { return buf_from(c) + c->compact_cap; }

/* Room for entry n (entries [0, n) are kept): 1, or 0 if the buffer cannot grow -- the
 * window is full then, as at a fixed bound. Growing moves the buffer: re-read it. */
static int compact_room(shm_chan *c, uint32_t n) {
    if (n < c->compact_cap) return 1;
    uint64_t most = compact_visits(c);
    if (n >= most) return 0;
    uint64_t cap = c->compact_cap ? (uint64_t)c->compact_cap * 2 : COMPACT_MAX;
    if (cap > most) cap = most;
    void *b = malloc((size_t)cap * (sizeof(entry) + 2 * sizeof(uint64_t)));
    if (b == NULL) return 0;
    if (n) memcpy(b, c->compact_buf, (size_t)n * sizeof(entry));
    free(c->compact_buf);
    c->compact_buf = b;
    c->compact_cap = (uint32_t)cap;
    return 1;
}

void compact_free(shm_chan *c) {
    free(c->compact_buf);
    c->compact_buf = NULL;
    c->compact_cap = 0;
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

/* What the unfinished record at pos (len bytes, inside [head, scan_pos)) is to a window.
 * *slot is set for E_MOVE (NIL: parked). */
static int classify(shm_chan *c, uint64_t pos, uint64_t len, uint32_t *slot) {
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_RELAXED(&r->meta); /* consumer-owned: behind scan_pos */
    uint32_t st = META_STATE(meta);
    if (st == REC_SKIP) return E_SKIP;
    if (st != REC_COMMITTED || META_LEN(meta) != len || len < REC_BODY) return E_HARD;
    uint32_t s = r->slot;
    if (s == NIL) { /* parked, unless it is a placeholder still on the writing list */
        if (!window_parked_movable(c, pos)) return E_HARD;
        *slot = NIL;
        return E_MOVE;
    }
    if (s > c->cfg.max_messages) return E_HARD;
    shm_slot *sl = &c->slots[s];
    if (LOAD_RELAXED(&sl->pos) != pos || sl->seq != r->seq) return E_HARD;
    if (island_find(c, pos) >= 0) return E_ISLAND; /* made before head passed it (rebuild.c) */
    uint32_t state = SLOT_STATE(LOAD_ACQUIRE(&sl->state)); /* pairs with holders' CAS */
    *slot = s;
    if (state == SLOT_INFLIGHT) /* acquire: pairs with the holder's CAS in shm_handle_view */
        return LOAD_ACQUIRE(&sl->pin) == PIN_FREE ? E_MOVE : E_PIN;
    if (state == SLOT_WAITING || state == SLOT_READY || state == SLOT_DEAD) return E_MOVE;
    return E_HARD; /* released, nacked or discarded: taken back at the next poll */
}

/* A window that works: its first n entries, packed to end at `end`; `keys` hashes at
 * most for its parked records' chains (window_moved). */
typedef struct {
    uint32_t n;
    uint64_t end, moved, keys;
} cut;

/* Tests only (shm_test_compact_fail): make the next slide's reservation, or its
 * window_moved, fail. Read once per slide, never on a message's path. */
static int compact_fail_next;

int shm_test_compact_fail(int what) {
    /* relaxed: process-local, read by the receiver's next slide; pairs with nothing */
    return __atomic_exchange_n(&compact_fail_next, what, __ATOMIC_RELAXED);
}

/* The look: the window to slide, from head up to stop (scan_pos). *looked counts the
 * records visited, *watch is the record that ended the look (whose finishing may change
 * the answer). Fills the entries (buf_entries) and *clean (head reaches the window's
 * first move once the fillers are in: islands may be made in it). */
static cut look(shm_chan *c, uint64_t head, uint64_t stop, int *clean, uint32_t *looked,
                uint64_t *watch) {
    shm_header *h = c->hdr;
    uint32_t island_count = LOAD_RELAXED(&h->island_count); /* receiver-written: our own */
    uint32_t islands_free = island_count < SHM_ISLANDS ? SHM_ISLANDS - island_count : 0;
    uint32_t n = 0, moves = 0, pins = 0;
    uint64_t moved = 0, first = 0, wall_end = 0, keys = 0, pos = head;
    int64_t slack = INT64_MAX; /* min over the moves of (finished bytes after it) - its len */
    cut best = {0, 0, 0, 0};
    uint64_t visits = compact_visits(c);
    *clean = 1;
    if (!compact_room(c, 0)) return best; /* no memory for a window: no look */
    for (;;) {
        /* pos ends a finished run (or is where the look stopped): is it a window's end? */
        if (moves && slack >= (int64_t)REC_HDR && (wall_end == 0 || pos - moved >= wall_end + REC_HDR)) {
            best = (cut){n, pos, moved, keys};
            uint64_t freed = pos - moved - first;
            if (freed >= COMPACT_TARGET(c) && freed >= 2 * moved) break;
        }
        if (pos >= stop || *looked >= visits) break;
        (*looked)++;
        *watch = pos;
        uint64_t len = rec_len(c, pos);
        if (!len || len > stop - pos) break; /* corrupt: never move past it */
        if (finished(c, pos)) {
            if (moves) slack += (int64_t)len; /* finite once there is a move */
            pos += len;
            continue;
        }
        uint32_t s = NIL;
        int kind = classify(c, pos, len, &s);
        if (kind == E_SKIP && moves == 0) { /* before the window: head passes it */
            pos += len;
            continue;
        }
        /* A soft wall inside a window needs head to pass the filler over it at once: the
         * filler is finished space to later slides, which would copy onto the island
         * bytes inside it. And a new island needs a free entry. */
        if (kind != E_MOVE && (!*clean || (kind == E_PIN && pins >= islands_free))) kind = E_HARD;
        if ((kind == E_PIN || kind == E_ISLAND) && moves == 0) kind = E_HARD; /* see compact() */
        if (kind == E_MOVE && len > COMPACT_BUDGET(c)) kind = E_HARD;
        int full = !compact_room(c, n) || (kind == E_MOVE && moved + len > COMPACT_BUDGET(c));
        if (kind == E_HARD || full) {
            if (best.n) break; /* a window before it works: take that */
            /* a new window after the wall, or from this record on */
            n = moves = pins = 0;
            moved = first = wall_end = keys = 0;
            slack = INT64_MAX;
            *clean = 0;
            if (kind == E_HARD) pos += len;
            continue;
        }
        buf_entries(c)[n++] = (entry){pos, len, s, (uint32_t)kind};
        if (kind == E_MOVE) {
            if (moves++ == 0) first = pos;
            moved += len;
            if (-(int64_t)len < slack) slack = -(int64_t)len;
            if (s == NIL) { /* parked: its hashes, as window_moved reads them from the copy */
                uint32_t nk = rec_at(c, pos)->nkeys;
                keys += nk < c->cfg.max_keys ? nk : c->cfg.max_keys;
            }
        } else {
            pins += kind == E_PIN;
            wall_end = pos + len;
            slack += (int64_t)len; /* moves is > 0 here: slack is finite */
        }
        pos += len;
    }
    return best;
}

/* The slide: 1 slid; 0: cannot now; -1: can, but not worth it yet; SHM_E_CORRUPT: slid,
 * but the parked records' chains could be neither repaired nor rebuilt (header dirty). */
static int slide(shm_chan *c, uint64_t head, uint64_t stop, int urgent, uint32_t *looked,
                 uint64_t *watch) {
    shm_header *h = c->hdr;
    int clean;
    cut w = look(c, head, stop, &clean, looked, watch);
    if (w.n == 0) return 0;
    entry *e = buf_entries(c); /* the look is done: the buffer stays where it is */
    uint32_t n = w.n;
    uint64_t start = e[0].pos, freed = w.end - w.moved - start; /* a window starts with a move */
    /* A slide copies w.moved bytes to free `freed`: until space runs low or a sender
     * waits, wait for it to free as much as it copies (or a sixteenth of the ring). */
    uint64_t worth = w.moved < c->limit / 16 ? w.moved : c->limit / 16;
    if (freed < worth && !urgent) return -1; /* not yet: more must finish first */

    /* What window_moved needs, had before anything moves (see the top): without it the
     * window stays where it is this time, and the look is retried later as a failed one. */
    uint32_t parked = 0;
    for (uint32_t j = 0; j < n; j++) parked += e[j].kind == E_MOVE && e[j].slot == NIL;
    uint64_t *hashes = NULL;
    int fail = __atomic_load_n(&compact_fail_next, __ATOMIC_RELAXED); /* tests only */
    if (parked) {
        if (fail == SHM_TEST_COMPACT_RESERVE) {
            __atomic_store_n(&compact_fail_next, 0, __ATOMIC_RELAXED);
            return 0;
        }
        if (w.keys >= SIZE_MAX / sizeof(uint64_t)) return 0;
        hashes = malloc(sizeof(uint64_t) * ((size_t)w.keys + 1));
        if (hashes == NULL) return 0;
    }

    /* 0. in-flight moves: stop holders from taking views until we are done; then the
     * pinned records the window passes become islands (before any filler covers them) */
    uint32_t i = 0, made = 0;
    for (; i < n; i++) {
        if (e[i].kind != E_MOVE || e[i].slot == NIL) continue;
        shm_slot *sl = &c->slots[e[i].slot];
        if (SLOT_STATE(LOAD_ACQUIRE(&sl->state)) != SLOT_INFLIGHT) continue; /* pairs with holders' CAS */
        uint32_t free_ = PIN_FREE;
        /* seq_cst: pairs with the holder's CAS FREE -> VIEWED in shm_handle_view. */
        if (!CAS_SEQCST(&sl->pin, &free_, PIN_MOVING)) break;
    }
    int ok = i == n;
    for (uint32_t j = 0; ok && j < n; j++) {
        if (e[j].kind != E_PIN) continue;
        if (!island_add(c, e[j].pos, e[j].len)) ok = 0; /* counted in look(): cannot happen */
        else made++;
    }
    if (!ok) { /* someone took a view just now: undo and give up */
        for (uint32_t j = 0; j < n; j++) {
            if (e[j].kind == E_PIN && made) {
                island_remove(c, island_find(c, e[j].pos));
                made--;
            }
            if (e[j].kind != E_MOVE || e[j].slot == NIL) continue;
            shm_slot *sl = &c->slots[e[j].slot];
            if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE); /* pairs with shm_handle_view */
        }
        free(hashes);
        return 0;
    }

    /* 1-4 for each move, last first: each moves to the end of what follows it */
    uint64_t *old_parked = buf_from(c), *new_parked = buf_to(c), skips = 0; /* n <= compact_cap */
    uint32_t p = parked;
    uint64_t gap_end = w.end;
    for (uint32_t j = n; j-- > 0;) {
        if (e[j].kind == E_SKIP) skips += e[j].len;
        if (e[j].kind != E_MOVE) continue;
        uint64_t at = e[j].pos, len = e[j].len, h1 = at + len;
        for (uint32_t k = j + 1; k < n && e[k].pos == h1 && (e[k].kind == E_PIN || e[k].kind == E_ISLAND); k++)
            h1 += e[k].len; /* their headers stay whole */
        uint64_t dst = gap_end - len; /* >= h1 + REC_HDR: look() checked the room */
        /* 1. everything from h1 to gap_end becomes one finished record (one store: the
         * chain stays whole; receiver-only region behind scan_pos) */
        STORE_RELEASE(&rec_at(c, h1)->meta, META(gap_end - h1, REC_DONE));
        /* 2. the copy, inside that record */
        memcpy(ring_at(c, dst), ring_at(c, at), len);
        /* 3. switch the message over. release: pairs with readers' acquire of pos
         * (msg_fill) and the fence in shm_unmoved. */
        if (e[j].slot != NIL) {
            shm_slot *sl = &c->slots[e[j].slot];
            STORE_RELEASE(&sl->pos, dst);
            if (LOAD_RELAXED(&sl->pin) == PIN_MOVING) STORE_RELEASE(&sl->pin, PIN_FREE); /* pairs with shm_handle_view */
        } else {
            p--;
            old_parked[p] = at;
            new_parked[p] = dst;
        }
        /* 4. one store re-links the chain: [at, dst) is finished, then the copy */
        STORE_RELEASE(&rec_at(c, at)->meta, META(dst - at, REC_DONE));
        /* release fence: the next step's copy may overwrite this record's old bytes;
         * it is ordered after the pos store above. Pairs with the acquire fence in
         * shm_unmoved: a reader that copied any overwritten byte sees the new pos. */
        __atomic_thread_fence(__ATOMIC_RELEASE);
        gap_end = dst;
    }
    /* the skips in the window are inside the filler now, which head passes as finished */
    h->skip_bytes = h->skip_bytes >= skips ? h->skip_bytes - skips : 0;
    /* ingest_pos stays on a record boundary with only taken-in or finished records
     * before it: the first copy, if it lay in the window (or before it, in a window that
     * head reaches: only finished records there) */
    if ((h->ingest_pos >= start && h->ingest_pos < w.end) || (clean && h->ingest_pos < start))
        h->ingest_pos = gap_end;
    int rc = SHM_OK;
    if (parked) {
        if (fail == SHM_TEST_COMPACT_CHAINS) {
            __atomic_store_n(&compact_fail_next, 0, __ATOMIC_RELAXED);
            rc = SHM_E_CORRUPT;
        } else {
            rc = window_moved(c, old_parked, new_parked, parked, hashes, w.keys + 1);
        }
        free(hashes);
    }
    /* 5. free the space (release store of head inside): the ring is whole either way */
    ring_advance_head(c);
    if (rc != SHM_OK) {
        /* The chains are not whole. Rebuild them now, as a new receiver would (rebuild.c:
         * we hold rx_mu inside rx_begin, and the rebuild makes all the derived state anew
         * from the ring and the handed-out slots); its process-local caches first, as in
         * shm_rx_acquire. If even that fails, the header stays dirty for the next receiver
         * and the caller reports the error. */
        ring_head_unknown(c);
        lookahead_reset(c);
        if (recovery_rebuild(c) == SHM_OK) return 1;
        STORE_RELAXED(&h->dirty, 1);
        return SHM_E_CORRUPT;
    }
    return 1;
}

static int compact_run(shm_chan *c, uint64_t head, uint64_t stop, uint64_t tail);

/* compact (core.h) found at least a sixteenth of the ring in [head, scan_pos): a look
 * is worth it if head is pinned. (That test, first, also keeps a receiver that holds its
 * latest message off the producers' cache line below.) */
int compact_look(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t head = h->head, stop = h->scan_pos; /* everything looked at */
    if (head >= stop || stop - head < c->limit / 16) return 0;
    if (finished(c, head)) return 0; /* nothing pinned */
    /* Only now look at the producers' cache line. */
    uint64_t tail = LOAD_ACQUIRE(&h->tail_hint); /* pairs with hint_raise */
    /* At most half used, space is short only for a message larger than what is free: a
     * sender refused or waiting says so, and the finished space behind head is its too
     * (relaxed: hints, as in compact_run). Without this, a message over half the ring
     * waited for ever behind one small held handle at head. */
    if (tail - head <= c->limit / 2 && LOAD_RELAXED(&h->refusals) == c->refusals_seen &&
        !LOAD_RELAXED(&h->space_waiters))
        return 0;
    return compact_run(c, head, stop, tail);
}

/* compact_look's work once the ring is more than half used behind a pinned head. Apart,
 * so that the checks above, made at every poll while a backlog pins head, stay a leaf
 * call that saves no registers. */
static __attribute__((noinline)) int compact_run(shm_chan *c, uint64_t head, uint64_t stop,
                                                 uint64_t tail) {
    shm_header *h = c->hdr;
    /* A record pinned by a zero-copy view at head cannot move: the ring flows around it
     * instead (islands.c). Head passes it; producers step over its bytes. */
    if (island_make_at_head(c, head, 1)) return 1;
    /* relaxed: a hint (pairs with nothing); a sender refused since the last look wants
     * one now, whatever the wait below says */
    uint32_t refusals = LOAD_RELAXED(&h->refusals);
    int refused = refusals != c->refusals_seen;
    c->refusals_seen = refusals;
    /* After a failed look, wait before the next: without this a long unfinished backlog
     * would be walked on every poll. Look again once the record that ended the look
     * finishes (ring_mark_done watches for it), or after a quarter as many records
     * finished as the look visited -- a few record visits per record finished; or once
     * RECHECK_NS pass (records can become movable without finishing: a nacked message
     * taken back, a placeholder committed); or when a sender was refused. */
    if (!refused && c->done_count < c->compact_retry_at && !c->compact_watch_hit &&
        coarse_ns() - c->compact_fail_ns < RECHECK_NS)
        return 0;
    /* space_waiters: a hint, pairs with nothing */
    int urgent = refused || tail - head >= c->limit - c->limit / 4 || LOAD_RELAXED(&h->space_waiters);
    uint32_t looked = 0;
    uint64_t watch = head;
    int slid = slide(c, head, stop, urgent, &looked, &watch);
    /* A buffer grown for a long run is given back at once: it is needed again only a
     * slide later, and the copying a slide does costs far more than the allocation. */
    if (c->compact_cap > COMPACT_MAX) compact_free(c);
    if (slid > 0 || slid == SHM_E_CORRUPT) return slid;
    /* Nothing could move the handle at head -- a pinned record right behind it with no
     * island entry left for it, or a record nothing passes: it stays where it is too, as
     * an island, once space runs short. */
    if (slid == 0 && urgent && island_make_at_head(c, head, 0)) return 1;
    /* Failed, or not worth it yet (slid < 0): either way, wait before the next look. */
    c->compact_retry_at = c->done_count + 1 + looked / 4;
    c->compact_watch_end = watch;
    c->compact_watch_hit = 0;
    c->compact_fail_ns = coarse_ns();
    return 0;
}
