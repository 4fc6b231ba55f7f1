/* lookahead.c -- finding a free message past the point where the scan stopped.
 *
 * The scan (window.c) looks at records in ring order and stops at one it may not take
 * in or park within the tables' budget (budget.c, invariant B): parking a record that
 * brings keys new to the key table costs an entry each, and past a tenth of the ring
 * the scan waits there. A message on free keys may lie behind that record, and messages
 * on free keys never wait for messages on other keys. So when the scan has stopped and
 * no message is ready (nothing to hand out: sched.c sched_tables_needed), the receiver
 * looks ahead of the scan, read-only, for one message that may go now:
 *
 *     ingest_pos        scan_pos (stopped)             pos
 *        | parked, taken |  counted  | taken | counted |  not looked at yet ...
 *
 *   - pos is the next record to look at, at or after scan_pos. The look-ahead keeps an
 *     exact count of the key hashes of the records in [scan_pos, pos) it passed without
 *     taking them (the map), and the records themselves in ring order (the queue).
 *   - A committed record at pos is taken in *ahead of the scan* (sched_take_in: a slot,
 *     ready like any message) if each of its hashes is absent from the map (no earlier
 *     record the scan has not passed carries it) and from the key table (no line, no
 *     holder, no parked chain: an entry that holds nothing is deleted at once, sched.c),
 *     none of its keys is paused (hold.c), it is due and not expired if it has times
 *     (timers.c: one not yet due, or expired, is left to the scan) and the window has
 *     room. That is the fifo rule: every earlier message on its keys has been handed out
 *     and released (those the scan passed are in the key table while they are not; those
 *     it has not, in the map). Under eager it is stricter than needed: only more waiting.
 *   - Every other record is passed: counted, if it is or will be a message (committed,
 *     being written, gated), or stepped over if finished. A record only claimed (its
 *     hashes are not published yet) or the tail stops the look-ahead until the next poll.
 *     A record passed is not looked at again in this pass (but see the restarts below).
 *   - One take per call, and only while nothing is ready: what the look-ahead takes in is
 *     a message handed out next, so its slot is the cost of a handle held (budget.c),
 *     not of a table filled ahead of need.
 *   - As scan_pos passes records, their entries leave the queue and their counts the
 *     map (trim, at each call): the map is always the keys of [scan_pos, pos) passed.
 *   - Delays: a record whose delay has not run out is left to the scan, which takes it in
 *     only within the tables' budget until then (window.c decide); the look-ahead counts
 *     it, and remembers the earliest such due time (next_due) and the due time of the
 *     record the scan stopped at (ahead_due, which bounds the receiver's sleep:
 *     shm_timers_wait): when it comes, the pass starts again. So a backlog of delayed
 *     messages on distinct keys stays within the budget too, and a message on free keys
 *     behind it goes at once.
 *   - A pass that reached the tail or its reach starts again from scan_pos, with an empty
 *     map, once a message has been released since it began (header.released), or has
 *     freed its keys without a release (a dead letter, a discarded placeholder:
 *     shm_chan.keys_freed), or a paused key it passed a record for is resumed: a record
 *     passed because its key was held -- say by the message the look-ahead took before
 *     it, on the same key -- may go now. So a sequence of messages on one free key
 *     behind the backlog keeps flowing, each as soon as the one before it is released,
 *     at the cost of one pass over the backlog within reach per such message; without a
 *     release nothing passed can have become free, and the look-ahead stays put.
 *
 * A record taken ahead is marked as any record taken in: its slot field names its slot
 * (the release store in sched_take_in). When the scan reaches it, window_taken
 * recognises it (the slot is still in use: in flight, ready again after a nack, a dead
 * letter) and steps over it, or it is DONE already (released) and the scan steps over
 * that (lookahead_done_at); ingest_pos and head follow the scan, so the record stays
 * where it is until then, and compaction (compact.c) moves only records behind
 * scan_pos. A receiver that dies leaves such slots handed out, as any: the next one
 * keeps them (rebuild.c recognises kept slots past where its walk stops, recovery.c
 * redelivers a dead holder's message, heading its lines: no earlier message shares a
 * key with it). A receiver starts with an empty look-ahead (lookahead_reset).
 *
 * Reach: at most LOOKAHEAD_RECORDS records and LOOKAHEAD_HASHES key hashes counted
 * beyond scan_pos, LOOKAHEAD_BATCH records looked at per call. Past the reach a free
 * message waits for the scan, that is for the keys of the backlog before it to free up.
 *
 * The state is the receiver process's own (heap memory, under rx_mu), not the
 * segment's: it costs /dev/shm nothing and a new receiver starts without it.
 * Everything read from the ring is checked as the scan checks it (ring_peek).
 */
#include <stdlib.h>

#include "core.h"

#define LOOKAHEAD_RECORDS 65536u /* records counted past scan_pos, at most        */
#define LOOKAHEAD_HASHES 131072u /* key hashes counted past scan_pos, at most      */
#define LOOKAHEAD_BATCH 1024u    /* records looked at per call, at most           */

#define ENT_FIRST 1u  /* the first entry of its record                               */
#define ENT_NOHASH 2u /* a record without keys: counted as a record, no hash          */

typedef struct {
    uint64_t pos, hash;
    uint32_t flags, pad;
} la_entry;

typedef struct {
    uint64_t hash;
    uint64_t count; /* 0: an empty cell */
} la_cell;

struct shm_lookahead {
    uint64_t pos;      /* the next record to look at; valid while >= scan_pos          */
    uint32_t records;  /* records counted in [scan_pos, pos)                          */
    int no_room;       /* the last call found a free message but no room for it       */
    uint64_t released; /* header.released when this pass began at scan_pos           */
    uint64_t freed;    /* shm_chan.keys_freed then                                    */
    uint64_t held[SHM_HOLD_KEYS]; /* paused keys (folded hashes) of records this pass passed */
    uint32_t held_n;   /* ... in held[]; more than fit: SHM_HOLD_KEYS + 1              */
    uint64_t next_due; /* the earliest due time of a record counted while delayed, 0 none */
    uint64_t taken_end; /* the end of the last record taken in ahead of the scan        */
    la_entry *q;       /* the counted entries in ring order: a circular buffer        */
    uint32_t q_head, q_n, q_cap;
    la_cell *map;      /* hash -> count, open addressing, linear probing             */
    uint32_t map_size, map_used; /* a power of two (or 0), and the cells in use      */
};

/* ---- the map ------------------------------------------------------------------------- */
static uint32_t cell_home(const shm_lookahead *la, uint64_t hash) {
    return (uint32_t)((hash * 0x9e3779b97f4a7c15ull) >> 32) & (la->map_size - 1);
}

static la_cell *map_find(shm_lookahead *la, uint64_t hash) {
    if (la->map_size == 0) return NULL;
    for (uint32_t i = cell_home(la, hash), n = 0; n < la->map_size; n++) {
        la_cell *e = &la->map[i];
        if (e->count == 0) return NULL;
        if (e->hash == hash) return e;
        i = (i + 1) & (la->map_size - 1);
    }
    return NULL;
}

static int map_grow(shm_lookahead *la) {
    uint32_t size = la->map_size ? 2 * la->map_size : 1024u;
    la_cell *old = la->map, *map = calloc(size, sizeof *map);
    if (map == NULL) return SHM_E_NOMEM;
    uint32_t old_size = la->map_size;
    la->map = map;
    la->map_size = size;
    for (uint32_t j = 0; j < old_size; j++) {
        if (old[j].count == 0) continue;
        uint32_t i = cell_home(la, old[j].hash);
        while (map[i].count) i = (i + 1) & (size - 1);
        map[i] = old[j];
    }
    free(old);
    return SHM_OK;
}

static int map_add(shm_lookahead *la, uint64_t hash) {
    la_cell *e = map_find(la, hash);
    if (e) {
        e->count++;
        return SHM_OK;
    }
    if (2 * (la->map_used + 1) > la->map_size) {
        int rc = map_grow(la);
        if (rc) return rc;
    }
    uint32_t i = cell_home(la, hash);
    while (la->map[i].count) i = (i + 1) & (la->map_size - 1);
    la->map[i] = (la_cell){hash, 1};
    la->map_used++;
    return SHM_OK;
}

/* One count of hash leaves the map; an emptied cell is deleted by shifting back the
 * cells of its probe run (no tombstones, as in sched.c's key table). */
static void map_drop(shm_lookahead *la, uint64_t hash) {
    la_cell *e = map_find(la, hash);
    if (e == NULL || --e->count > 0) return;
    uint32_t mask = la->map_size - 1, i = (uint32_t)(e - la->map), j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (la->map[j].count == 0) break;
        uint32_t home = cell_home(la, la->map[j].hash);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        la->map[i] = la->map[j];
        i = j;
    }
    la->map[i].count = 0;
    la->map_used--;
}

/* ---- the queue ----------------------------------------------------------------------- */
static int q_push(shm_lookahead *la, uint64_t pos, uint64_t hash, uint32_t flags) {
    if (la->q_n == la->q_cap) {
        uint32_t cap = la->q_cap ? 2 * la->q_cap : 1024u;
        la_entry *q = malloc(sizeof *q * (size_t)cap);
        if (q == NULL) return SHM_E_NOMEM;
        for (uint32_t i = 0; i < la->q_n; i++) q[i] = la->q[(la->q_head + i) % la->q_cap];
        free(la->q);
        la->q = q;
        la->q_head = 0;
        la->q_cap = cap;
    }
    la->q[(la->q_head + la->q_n) % la->q_cap] = (la_entry){pos, hash, flags, 0};
    la->q_n++;
    return SHM_OK;
}

/* Drop what the scan has passed: entries before scan_pos. */
static void trim(shm_chan *c, shm_lookahead *la) {
    uint64_t scan = c->hdr->scan_pos;
    while (la->q_n > 0) {
        la_entry *e = &la->q[la->q_head];
        if (e->pos >= scan) break;
        if (!(e->flags & ENT_NOHASH)) map_drop(la, e->hash);
        if (e->flags & ENT_FIRST) la->records--;
        la->q_head = (la->q_head + 1) % la->q_cap;
        la->q_n--;
    }
    if (la->pos < scan) la->pos = scan; /* the queue is empty then: all of it was before */
}

/* Count the record r at pos (nkeys checked by the caller) as passed. */
static int count_record(shm_lookahead *la, const shm_record *r, uint64_t pos) {
    uint32_t flags = ENT_FIRST;
    int rc = SHM_OK;
    for (uint32_t i = 0; i < r->nkeys && rc == SHM_OK; i++) {
        if (!rec_first_of_hash(r, i)) continue;
        rc = q_push(la, pos, r->hashes[i], flags);
        if (rc == SHM_OK) rc = map_add(la, r->hashes[i]);
        flags = 0;
    }
    if (rc == SHM_OK && flags == ENT_FIRST) rc = q_push(la, pos, 0, ENT_FIRST | ENT_NOHASH);
    if (rc == SHM_OK) la->records++;
    return rc;
}

/* ---- times (timers.c) ---------------------------------------------------------------- */
/* The times in r's footer (timers.c), as timers_take_in will read them: 0 if it has none
 * that check out. len: its length, checked by the caller. */
static int rec_times(const shm_record *r, uint64_t len, uint64_t *due, uint64_t *expire) {
    uint64_t body = rec_size(r->nkeys, r->keys_len, r->data_len);
    if (!(r->flags & REC_F_TIMES) || !timers_trailer_ok(r, body, len)) return 0;
    const uint8_t *f = (const uint8_t *)r + len - TIME_FOOTER;
    memcpy(due, f, sizeof *due);
    memcpy(expire, f + 8, sizeof *expire);
    return 1;
}

static uint64_t realtime_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Is the committed record r (len bytes, checked) delayed past now? Its due time, or 0.
 * Such a record is not needed before then: the scan takes it in only within the tables'
 * budget (window.c decide), the look-ahead not at all until then. */
uint64_t lookahead_not_due(shm_record *r, uint64_t len) {
    uint64_t due, expire;
    if (!rec_times(r, len, &due, &expire) || due == 0) return 0;
    return due > realtime_now() ? due : 0;
}

/* A record with times: is it due and not expired? Anything else is left to the scan. */
static int due_now(shm_record *r, uint64_t len) {
    uint64_t due, expire, now = realtime_now();
    if (!rec_times(r, len, &due, &expire)) return 0;
    return due <= now && (expire == 0 || expire > now);
}

/* ---- the state's life ---------------------------------------------------------------- */
void lookahead_reset(shm_chan *c) {
    shm_lookahead *la = c->lookahead;
    if (la == NULL) return;
    free(la->q);
    free(la->map);
    memset(la, 0, sizeof *la); /* pos 0: the next call starts at scan_pos (trim) */
}

void lookahead_free(shm_chan *c) {
    lookahead_reset(c);
    free(c->lookahead);
    c->lookahead = NULL;
}

static shm_lookahead *state(shm_chan *c) {
    if (c->lookahead == NULL) c->lookahead = calloc(1, sizeof(shm_lookahead)); /* as reset */
    return c->lookahead;
}

/* Is the reach spent? */
static int full(shm_chan *c, const shm_lookahead *la) {
    return la->records >= LOOKAHEAD_RECORDS || la->q_n + c->cfg.max_keys + 1 > LOOKAHEAD_HASHES;
}

/* Start a pass again at scan_pos with nothing counted (see the top). */
static void restart(shm_chan *c, shm_lookahead *la) {
    while (la->q_n > 0) {
        la_entry *e = &la->q[la->q_head];
        if (!(e->flags & ENT_NOHASH)) map_drop(la, e->hash);
        la->q_head = (la->q_head + 1) % la->q_cap;
        la->q_n--;
    }
    la->records = 0;
    la->pos = c->hdr->scan_pos;
    la->released = c->hdr->released;
    la->freed = c->keys_freed;
    la->next_due = 0;
    la->held_n = 0;
}

/* Was a paused key noted by this pass (free_to_go) resumed since? With more noted than
 * the list holds: as if one was, so the pass starts again once it ends. */
static int resumed(shm_chan *c, const shm_lookahead *la) {
    if (la->held_n > SHM_HOLD_KEYS) return 1; /* restarts, and notes them again */
    for (uint32_t i = 0; i < la->held_n; i++)
        if (!hold_key_paused(c, la->held[i])) return 1;
    return 0;
}

/* Has the pass reached the tail or its reach, with a release since it began (or keys
 * freed otherwise, or a key it passed a record for resumed)? */
static int stale(shm_chan *c, const shm_lookahead *la) {
    if (la->next_due && realtime_now() >= la->next_due) return 1; /* a delay ran out */
    if (la->released == c->hdr->released && la->freed == c->keys_freed &&
        !(UNLIKELY(la->held_n) && resumed(c, la)))
        return 0;
    if (full(c, la)) return 1;
    /* acquire / seq_cst as the caller's loads of the record at pos */
    return LOAD_SEQCST(&rec_at(c, la->pos)->owner) == OWNER_EMPTY(la->pos);
}

/* ---- looking ahead --------------------------------------------------------------------- */
/* May the committed record r (len bytes) go now, ahead of the scan? (see the top) A
 * record passed for a paused key notes that key (held): its resume makes the pass stale. */
static int free_to_go(shm_chan *c, shm_lookahead *la, shm_record *r, uint64_t len) {
    if ((r->flags & REC_F_TIMES) && !due_now(r, len)) return 0;
    for (uint32_t i = 0; i < r->nkeys; i++)
        if (map_find(la, r->hashes[i]) != NULL || sched_key_find(c, r->hashes[i]) != NULL)
            return 0;
    uint64_t paused = UNLIKELY(hold_any(c)) ? hold_record_key(c, r) : 0;
    if (paused == 0) return 1;
    uint32_t i = 0;
    while (i < la->held_n && i < SHM_HOLD_KEYS && la->held[i] != paused) i++;
    if (i < la->held_n && i < SHM_HOLD_KEYS) return 0; /* noted already */
    if (la->held_n < SHM_HOLD_KEYS) la->held[la->held_n++] = paused;
    else la->held_n = SHM_HOLD_KEYS + 1; /* no room: the pass starts again at its end */
    return 0;
}

/* The record at pos is finished (DONE: taken in ahead of the scan and released since, or
 * by an earlier receiver). *len: its length, checked. For the scan (window.c), which
 * steps over it. */
int lookahead_done_at(shm_chan *c, uint64_t pos, uint64_t *len) {
    uint64_t meta = LOAD_ACQUIRE(&rec_at(c, pos)->meta); /* pairs with ring_mark_done's */
    uint64_t l = META_LEN(meta);
    if (META_STATE(meta) != REC_DONE || l < REC_HDR || (l & 7u) || l > c->cap - REC_HDR) return 0;
    *len = l;
    return 1;
}

/* The scan stopped: look ahead for a message to take in (see the top). Only while
 * nothing is ready; *moved when the look-ahead moved or took a message in. */
int lookahead_run(shm_chan *c, int *moved) {
    if (!sched_tables_needed(c)) return SHM_OK;
    shm_lookahead *la = state(c);
    if (la == NULL) return SHM_E_NOMEM;
    trim(c, la);
    if (la->q_n == 0 && la->pos == c->hdr->scan_pos) {
        la->released = c->hdr->released;
        la->freed = c->keys_freed;
        la->next_due = 0;
        la->held_n = 0;
    } else if (stale(c, la)) {
        restart(c, la);
    }
    la->no_room = 0;
    for (uint32_t i = 0; i < LOOKAHEAD_BATCH && !full(c, la); i++) {
        uint64_t pos = la->pos, len;
        shm_record *r = rec_at(c, pos);
        shm_stall stall;
        int rc = ring_peek(c, pos, &r, &len, &stall);
        if (rc == SHM_EMPTY) break; /* the tail */
        if (rc == SHM_STALLED) {
            r = rec_at(c, pos);
            /* acquire: pairs with the producer's release of WRITING / GATED (ring.c fill) */
            uint64_t meta = LOAD_ACQUIRE(&r->meta);
            len = META_LEN(meta);
            if (META_STATE(meta) == REC_CLAIMED) break; /* its keys are not published yet */
            /* being written or gated: its fixed fields and hashes are final (ring.c) */
            if (len < REC_BODY || (len & 7u) || len > c->cap - REC_HDR ||
                r->nkeys > c->cfg.max_keys || REC_BODY + 16ull * r->nkeys > len)
                return SHM_E_CORRUPT;
            rc = count_record(la, r, pos);
        } else if (rc == SHM_CLOSED) { /* discarded, cancelled, a skip: nothing to count */
            rc = SHM_OK;
        } else if (rc == SHM_E_CORRUPT && lookahead_done_at(c, pos, &len)) {
            rc = SHM_OK; /* finished */
        } else if (rc) {
            return rc;
        } else if (window_taken(c, r, pos)) {
            /* taken in ahead already (by an earlier receiver): its keys are in the table */
        } else if (free_to_go(c, la, r, len)) {
            if (!sched_has_room(c, r->nkeys)) { /* the window is full: a release retries */
                la->no_room = 1;
                break;
            }
            uint32_t s;
            rc = sched_take_in(c, r, pos, &s);
            if (rc) return rc;
            la->pos = la->taken_end = pos + len;
            *moved = 1;
            break; /* a message is ready: the look-ahead is not needed any more */
        } else {
            uint64_t due = UNLIKELY(r->flags & REC_F_TIMES) ? lookahead_not_due(r, len) : 0;
            if (due && (!la->next_due || due < la->next_due)) la->next_due = due;
            rc = count_record(la, r, pos);
        }
        if (rc) return rc;
        la->pos = pos + len;
        *moved = 1;
    }
    /* When must a sleeping receiver look again? When the record the scan stopped at, or
     * one the look-ahead passed while it was delayed, falls due (shm_timers_wait). */
    uint64_t wake = la->next_due;
    shm_record *r = rec_at(c, c->hdr->scan_pos);
    /* acquire: pairs with the producer's commit (ring.c fill); checked as ring_peek does,
     * without a durable record's checksum (only its times are read, as a hint) */
    uint64_t meta = LOAD_ACQUIRE(&r->meta), len = META_LEN(meta);
    if (META_STATE(meta) == REC_COMMITTED && (r->flags & REC_F_TIMES) && len >= REC_BODY &&
        len <= c->cap - REC_HDR && ring_validate_body(c, r, len) == SHM_OK) {
        uint64_t due = lookahead_not_due(r, len);
        if (due && (!wake || due < wake)) wake = due;
    }
    STORE_RELAXED(&c->ahead_due, wake); /* read by shm_timers_wait, a hint */
    return SHM_OK;
}

/* Do records taken in ahead of the scan lie past it? (sched.c: their space waits for the
 * scan to pass them) */
int lookahead_ahead_of_scan(shm_chan *c) {
    return c->lookahead != NULL && c->lookahead->taken_end > c->hdr->scan_pos;
}

/* Would lookahead_run make progress now? (the receiver's re-check before it sleeps, when
 * the scan has stopped) */
int lookahead_has_work(shm_chan *c) {
    if (!sched_tables_needed(c)) return 0;
    shm_lookahead *la = c->lookahead;
    uint64_t pos = c->hdr->scan_pos;
    if (la != NULL) {
        trim(c, la);
        if (stale(c, la)) return 1;
        if (la->no_room || full(c, la)) return 0; /* a release posts us */
        pos = la->pos;
    }
    shm_record *r = rec_at(c, pos);
    /* seq_cst: as window_has_work's loads at scan_pos, pairs with the fence in
     * wake_receiver (ring.c): either we see the claim or commit, or its producer sees
     * us asleep. */
    if (LOAD_SEQCST(&r->owner) == OWNER_EMPTY(pos)) return 0;
    return META_STATE(LOAD_SEQCST(&r->meta)) != REC_CLAIMED; /* a commit wakes us */
}
