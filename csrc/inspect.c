/* inspect.c -- the operators' view: held keys, the deepest lines, why a message waits.
 *
 * Read-only, from any process (the receiver's or not), while the receiver runs. Nothing
 * here takes a lock, writes the segment, or waits for another process without a bound,
 * so a dead process can never stall it and it can never stall the receiver.
 *
 * Consistency: a seqlock (as in the Linux kernel's seqcount). The receiver makes every
 * change to its tables between rx_begin() and rx_end() (core.h), which make the header's
 * `version` word odd, then even and larger. A reader here copies what it needs between
 * view_begin() (waits for an even version: a few pauses, then a bounded number of
 * sched_yield()s, for a receiver preempted mid-update on a busy machine) and view_ok()
 * (the version is unchanged), and retries a bounded number of times (VIEW_TRIES). Reads
 * are short -- one chunk of the key table, one step of a chain -- so a busy receiver,
 * whose updates are a few hundred ns apart, still leaves gaps to read in; if none comes
 * (or a receiver died mid-update and left the version odd), the last copy is used and
 * the answer is flagged `partial`. A reading that raced is never trusted for memory
 * safety either: every index, length and offset is checked before it is followed, and
 * every walk has a bound. The receiver pays two plain stores per operation, on a cache
 * line it already writes; nothing on its path waits for readers.
 *
 * Three things are validated without the seqlock, by their own words:
 *   - a slot's state word (generation + state) is re-read after its fields and its
 *     record's key blob were copied, and the copy is dropped if it changed or the
 *     record moved (the pattern of shm_unmoved; holders change state words without the
 *     receiver's seqlock);
 *   - ring records at or after ingest_pos are immutable once committed (only their slot
 *     field and DONE mark change), and their bytes are reused only after head passes
 *     them: a record is accepted only if head has not passed it after it was read.
 *
 * Costs, per call (none depends on how deep any line is):
 *   held   -- the receiver's handed-out list (handles.c): O(handles out + dead letters);
 *             under a receiver too busy for one seqlock read of it, the message table's
 *             state words: O(max_messages) 8-byte loads.
 *   lines  -- the key table, in chunks: O(key table), plus O(top) for the chosen lines.
 *             A line's depth is kept by the scheduler (shm_key.count: its nodes; plus
 *             shm_key.skipped: its messages left out of the window, window.c), so it is
 *             read, never counted.
 *   why    -- finding the message: O(max_messages) seq loads, or a walk of at most
 *             VIEW_WALK records of the ring from ingest_pos for a message outside the
 *             window; then O(keys) per step of the chain, at most `max` steps.
 */
#include <sched.h>
#include <stdlib.h>

#include "core.h"

#define VIEW_TRIES 64        /* seqlock retries per read                              */
#define VIEW_SPINS 256       /* pauses waiting for an even version, per try           */
#define VIEW_CHUNK 64        /* key table entries copied per seqlock read             */
#define VIEW_WALK 65536      /* ring records a why / head_seq walk looks at, at most  */

#define SLOT_OK(c, s) ((s) >= 1 && (s) <= (c)->cfg.max_messages)
#define NODE_OK(c, n) ((n) >= 1 && (n) < (c)->max_nodes)

/* ---- the seqlock's reader side ------------------------------------------------------- */
static uint64_t view_begin(shm_chan *c) {
    uint64_t v = 0;
    for (uint32_t i = 0; i < VIEW_SPINS; i++) {
        /* acquire: pairs with rx_end's release store (core.h): the tables it finished
         * are visible to the reads that follow. */
        v = LOAD_ACQUIRE(&c->hdr->version);
        if (!(v & 1u)) break;
        /* Odd: the receiver is in an update, which takes microseconds -- unless it was
         * preempted there; then give it the CPU (a bounded number of times). */
        if (i < VIEW_SPINS / 4) CPU_RELAX();
        else sched_yield();
    }
    return v;
}

static int view_ok(shm_chan *c, uint64_t v) {
    /* acquire fence: the reads above happen before the load below; pairs with rx_begin's
     * release fence (an update we overlapped has made the version odd by then). */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return !(v & 1u) && LOAD_RELAXED(&c->hdr->version) == v;
}

/* ---- small helpers -------------------------------------------------------------------- */
typedef struct {
    uint8_t *p;
    uint64_t cap, used;
} blob_buf;

/* The key table's size is the header's (the receiver grows it: sched.c), read inside the
 * caller's seqlock section, which a growth in between invalidates. */
static int64_t key_lookup(shm_chan *c, uint64_t hash) {
    uint32_t size = keytab_view_size(c);
    if (size == 0) return -1;
    uint32_t i = key_home_in(size, hash);
    for (uint32_t probes = 0; probes < size; probes++) {
        shm_key k = c->keys[i]; /* a copy: the entry may change under us */
        if (k.head == NIL && k.held == NIL && k.skipped == 0) return -1;
        if (k.hash == hash) return i;
        i = i + 1 >= size ? 0 : i + 1;
    }
    return -1;
}

static uint64_t age_since(uint64_t then) {
    uint64_t now = coarse_ns();
    return then && now > then ? now - then : 0;
}

/* A committed record's immutable part, copied and checked. */
typedef struct {
    uint64_t pos, len, seq;
    uint32_t state, slot, nkeys, keys_len;
    uint64_t hashes[SHM_MAX_KEYS_LIMIT];
} rec_copy;

/* Copy the record at pos. SHM_OK (committed, checked), SHM_CLOSED (finished or dropped:
 * len set), SHM_EMPTY (the tail: seq is the next seq), SHM_STALLED (being written, no
 * length yet), SHM_STALE (head passed it while we read), SHM_E_CORRUPT. */
static int rec_read(shm_chan *c, uint64_t pos, rec_copy *rc) {
    shm_record *r = rec_at(c, pos);
    rc->pos = pos;
    uint64_t owner = LOAD_ACQUIRE(&r->owner); /* pairs with prepare_successor / claims */
    uint64_t meta = LOAD_ACQUIRE(&r->meta);   /* pairs with the commit's release store */
    rc->seq = LOAD_RELAXED(&r->seq);
    int out;
    if (owner == OWNER_EMPTY(pos)) {
        out = SHM_EMPTY;
    } else if (OWNER_IS_EMPTY(owner) || owner == 0) {
        out = SHM_E_CORRUPT;
    } else {
        rc->state = META_STATE(meta);
        rc->len = META_LEN(meta);
        if (rc->state == REC_CLAIMED) {
            out = SHM_STALLED;
        } else if (rc->len < REC_HDR || (rc->len & 7u) || rc->len > c->cap - REC_HDR) {
            out = SHM_E_CORRUPT;
        } else if (rc->state != REC_COMMITTED) {
            out = rc->state == REC_WRITING || rc->state == REC_GATED ? SHM_STALLED : SHM_CLOSED;
        } else {
            rc->slot = LOAD_RELAXED(&r->slot);
            rc->nkeys = r->nkeys;
            rc->keys_len = r->keys_len;
            uint64_t data_len = r->data_len;
            if (rc->len < REC_BODY || rc->nkeys > c->cfg.max_keys || rc->keys_len > rc->len ||
                data_len > rc->len || ring_validate_body(c, r, rc->len) != SHM_OK) {
                out = SHM_E_CORRUPT;
            } else {
                memcpy(rc->hashes, r->hashes, 8u * rc->nkeys);
                out = SHM_OK;
            }
        }
    }
    /* acquire fence: our reads of the record happen before the load of head; pairs with
     * ring_advance_head's release store, which precedes any reuse of these bytes. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (LOAD_RELAXED(&c->hdr->head) > pos) return SHM_STALE;
    return out;
}

static uint32_t hash_index(const uint64_t *hashes, uint32_t n, uint64_t hash) {
    for (uint32_t i = 0; i < n; i++)
        if (hashes[i] == hash) return i;
    return n;
}

/* Copy the key blob of the record at pos into b (v->blob_*), and find hash among its
 * keys. The caller validates afterwards that the record was not moved or reused. */
static int blob_copy(shm_chan *c, uint64_t pos, uint64_t seq, uint64_t hash, shm_view *v,
                     blob_buf *b) {
    if (pos & 7u) return SHM_E_CORRUPT;
    shm_record *r = rec_at(c, pos);
    uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the commit's release store */
    uint64_t len = META_LEN(meta);
    uint32_t st = META_STATE(meta);
    if ((st != REC_COMMITTED && st != REC_DONE) || len < REC_BODY || len > c->cap - REC_HDR)
        return SHM_STALE;
    uint32_t nkeys = r->nkeys, keys_len = r->keys_len;
    uint64_t data_len = r->data_len;
    if (r->seq != seq || nkeys > c->cfg.max_keys || keys_len > len || data_len > len ||
        ring_validate_body(c, r, len) != SHM_OK) /* (a gate trailer is allowed: ring.c) */
        return SHM_STALE;
    if (b->cap - b->used < keys_len) return SHM_FULL;
    uint64_t hashes[SHM_MAX_KEYS_LIMIT];
    memcpy(hashes, r->hashes, 8u * nkeys);
    memcpy(b->p + b->used, (uint8_t *)r + REC_BODY + 16u * nkeys, keys_len); /* past hashes, links */
    v->nkeys = nkeys;
    v->blob_off = b->used;
    v->blob_len = keys_len;
    v->hash = hash;
    v->key_index = hash_index(hashes, nkeys, hash);
    return SHM_OK;
}

/* Fill v from slot s as seen with state word w (seq, state, holder, attempt, age, keys).
 * SHM_STALE if the slot moved on while we read; the buffer is then left as it was. */
static int slot_view(shm_chan *c, uint32_t s, uint64_t w, uint64_t hash, shm_view *v,
                     blob_buf *b) {
    shm_slot *sl = &c->slots[s];
    uint64_t seq = LOAD_RELAXED(&sl->seq);
    uint64_t pos = LOAD_ACQUIRE(&sl->pos); /* pairs with compact.c's release store of pos */
    memset(v, 0, sizeof *v);
    v->seq = seq;
    switch (SLOT_STATE(w)) {
    case SLOT_WAITING: v->state = SHM_VIEW_WAITING; break;
    case SLOT_READY: case SLOT_NACKED: v->state = SHM_VIEW_READY; break;
    case SLOT_INFLIGHT: v->state = SHM_VIEW_INFLIGHT; break;
    case SLOT_RELEASED: v->state = SHM_VIEW_DELIVERED; break;
    case SLOT_DEAD: case SLOT_DISCARD: v->state = SHM_VIEW_DEAD; break;
    default: return SHM_STALE;
    }
    v->attempt = LOAD_RELAXED(&sl->attempt);
    if (v->state == SHM_VIEW_READY && LOAD_RELAXED(&sl->due_ns)) { /* timers.c */
        v->state = SHM_VIEW_DELAYED;
        v->due_ns = LOAD_RELAXED(&sl->due_ns);
    }
    if (v->state == SHM_VIEW_INFLIGHT) {
        v->holder = LOAD_ACQUIRE(&sl->holder); /* pairs with shm_handle_adopt's CAS */
        /* in transit (pickled, not yet adopted: handles.c): report who pickled it */
        if (v->holder != HOLDER_REVOKED) v->holder &= ~HOLDER_TRANSIT;
        v->age_ns = age_since(LOAD_RELAXED(&sl->handed_ns));
    }
    uint64_t used = b->used;
    int rc = blob_copy(c, pos, seq, hash, v, b);
    if (rc == SHM_OK) b->used += v->blob_len;
    /* the seqlock of a single slot: nothing we copied counts unless the slot still has
     * this state word and position (acquire fence: pairs with the writers' release
     * stores of state and pos, see shm_unmoved). */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (LOAD_RELAXED(&sl->state) != w || LOAD_RELAXED(&sl->pos) != pos) {
        b->used = used;
        return SHM_STALE;
    }
    if (rc != SHM_OK) b->used = used;
    return rc;
}

/* ---- held keys ------------------------------------------------------------------------ */
/* Add slot s to the held list if it is in flight: SHM_OK (added or not), SHM_FULL. */
static int held_add(shm_chan *c, uint32_t s, shm_view *out, uint32_t max, uint32_t *count,
                    blob_buf *b) {
    /* acquire: pairs with hand_out's release store of INFLIGHT (holder, seq, attempt and
     * handed_ns were written before it). */
    uint64_t w = LOAD_ACQUIRE(&c->slots[s].state);
    if (SLOT_STATE(w) != SLOT_INFLIGHT) return SHM_OK;
    if (*count >= max) return SHM_FULL;
    int rc = SHM_STALE;
    for (int tries = 0; tries < VIEW_TRIES && rc == SHM_STALE; tries++) {
        rc = slot_view(c, s, w, 0, &out[*count], b);
        if (rc == SHM_STALE) { /* moved, or moved on: look at its word again */
            w = LOAD_ACQUIRE(&c->slots[s].state);
            if (SLOT_STATE(w) != SLOT_INFLIGHT) break;
        }
    }
    if (rc == SHM_FULL) return SHM_FULL;
    if (rc == SHM_OK && out[*count].holder != HOLDER_REVOKED) (*count)++; /* else: gone */
    return SHM_OK;
}

/* In-flight slots are on the receiver's handed-out list (handles.c): walk it inside one
 * seqlock read, so the cost is O(handles out). Under a receiver too busy for that (or a
 * list that does not check out), scan the message table's state words instead. */
int shm_view_held(shm_chan *c, shm_view *out, uint32_t max, uint32_t *n, uint8_t *blob,
                  uint64_t blob_cap) {
    blob_buf b = {blob, blob_cap, 0};
    uint32_t count = 0;
    for (int tries = 0; tries < VIEW_TRIES; tries++) {
        uint64_t ver = view_begin(c);
        count = 0;
        b.used = 0;
        int rc = SHM_OK;
        uint32_t s = LOAD_RELAXED(&c->hdr->handed_out);
        for (uint32_t guard = 0; SLOT_OK(c, s) && rc == SHM_OK; guard++) {
            if (guard > c->cfg.max_messages) {
                rc = SHM_E_CORRUPT; /* a cycle: do not trust this reading */
                break;
            }
            rc = held_add(c, s, out, max, &count, &b);
            s = LOAD_RELAXED(&c->slots[s].out_next);
        }
        if (s != NIL && rc == SHM_OK) rc = SHM_E_CORRUPT; /* a link out of range */
        if (!view_ok(c, ver)) continue;
        if (rc == SHM_E_CORRUPT) break;
        *n = count;
        return rc;
    }
    count = 0;
    b.used = 0;
    for (uint32_t s = 1, used = slots_touched(c, c->hdr); s < used; s++) {
        if (held_add(c, s, out, max, &count, &b) == SHM_FULL) {
            *n = count;
            return SHM_FULL;
        }
    }
    *n = count;
    return SHM_OK;
}

/* ---- the deepest lines ---------------------------------------------------------------- */
/* Is the message of node nd handed out (so it does not count toward its line's depth)? */
static int node_handed_out(shm_chan *c, uint32_t nd) {
    if (!NODE_OK(c, nd)) return 0;
    uint32_t s = c->nodes[nd].slot;
    if (!SLOT_OK(c, s)) return 0;
    uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&c->slots[s].state)); /* pairs with holders' CAS */
    return st == SLOT_INFLIGHT || st == SLOT_RELEASED;
}

/* Messages carrying key k not yet handed out. fifo: the line holds every message taken
 * in with the key, the first possibly handed out; those parked out of the window
 * (window.c) count too. eager: the messages parked on this key (the holder is k.held). */
static uint64_t key_depth(shm_chan *c, const shm_key *k) {
    if (c->cfg.order != SHM_ORDER_FIFO) return (uint64_t)k->count + k->skipped;
    uint64_t d = (uint64_t)k->count + k->skipped;
    if (k->count && node_handed_out(c, k->head) && d) d--;
    return d;
}

/* Keep out[0..*n) sorted by depth, deepest first, at most top entries. */
static void top_insert(shm_view *out, uint32_t *n, uint32_t top, uint64_t hash, uint64_t depth) {
    for (uint32_t i = 0; i < *n; i++)
        if (out[i].hash == hash) return; /* seen twice: an entry moved during the scan */
    uint32_t i;
    if (*n == top) {
        if (out[top - 1].depth >= depth) return;
        i = top - 1;
    } else {
        i = (*n)++;
    }
    while (i > 0 && out[i - 1].depth < depth) {
        out[i] = out[i - 1];
        i--;
    }
    memset(&out[i], 0, sizeof out[i]);
    out[i].hash = hash;
    out[i].depth = depth;
}

/* The oldest message with key `hash` that is not handed out, as of now: in its line, or
 * (all of them left out of the window) found by a walk of the ring from ingest_pos. */
/* v describes the record r at pos (not taken in), reached over `hash`: SHM_OK, SHM_FULL,
 * or SHM_STALE if head passed it while we copied (its bytes may be reused). */
static int parked_view(shm_chan *c, const rec_copy *r, uint64_t pos, uint64_t hash, shm_view *v,
                       blob_buf *b) {
    uint64_t depth = v->depth, used = b->used;
    memset(v, 0, sizeof *v);
    v->depth = depth;
    v->seq = r->seq;
    v->state = SHM_VIEW_QUEUED;
    int rc = blob_copy(c, pos, r->seq, hash, v, b);
    if (rc == SHM_OK) b->used += v->blob_len;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* as in rec_read */
    if (LOAD_RELAXED(&c->hdr->head) > pos) {
        b->used = used;
        return SHM_STALE;
    }
    return rc;
}

static int line_head(shm_chan *c, uint64_t hash, shm_view *v, blob_buf *b, uint32_t *partial) {
    uint64_t parked = UINT64_MAX; /* the first record of the key's chain (window.c) */
    for (int tries = 0; tries < VIEW_TRIES; tries++) {
        uint64_t ver = view_begin(c);
        int64_t ki = key_lookup(c, hash);
        if (ki < 0) {
            if (view_ok(c, ver)) break; /* no line: only messages not looked at yet */
            continue;
        }
        shm_key k = c->keys[ki];
        uint32_t nd = k.head;
        if (c->cfg.order == SHM_ORDER_FIFO && k.count && node_handed_out(c, nd))
            nd = NODE_OK(c, nd) ? c->nodes[nd].next : NIL;
        uint32_t s = NODE_OK(c, nd) ? c->nodes[nd].slot : NIL;
        if (!view_ok(c, ver)) continue;
        if (nd == NIL || !SLOT_OK(c, s)) { /* none in the window: its first parked record */
            if (k.skipped) parked = k.skip_head;
            break;
        }
        uint64_t w = LOAD_ACQUIRE(&c->slots[s].state); /* pairs with the receiver's stores */
        uint64_t depth = v->depth;
        int rc = slot_view(c, s, w, hash, v, b);
        v->depth = depth;
        if (rc == SHM_OK || rc == SHM_FULL) return rc;
    }
    if (parked != UINT64_MAX && !(parked & 7u)) {
        rec_copy r;
        if (rec_read(c, parked, &r) == SHM_OK && r.slot == NIL &&
            hash_index(r.hashes, r.nkeys, hash) < r.nkeys) {
            int rc = parked_view(c, &r, parked, hash, v, b);
            if (rc != SHM_STALE) return rc;
        }
    }
    /* Walk the records not taken in (parked, or not looked at yet) for the first that
     * carries the key. */
    uint64_t pos = LOAD_ACQUIRE(&c->hdr->ingest_pos); /* receiver-written: a hint to start */
    for (uint32_t i = 0; i < VIEW_WALK; i++) {
        rec_copy r;
        int rc = rec_read(c, pos, &r);
        if (rc == SHM_CLOSED) {
            pos += r.len;
            continue;
        }
        if (rc == SHM_EMPTY) return SHM_STALE; /* the tail: none left, the line emptied */
        if (rc != SHM_OK) break;
        if (r.slot == NIL && hash_index(r.hashes, r.nkeys, hash) < r.nkeys) {
            rc = parked_view(c, &r, pos, hash, v, b);
            if (rc == SHM_STALE) break;
            return rc;
        }
        pos += r.len;
    }
    *partial = 1;
    return SHM_STALE;
}

/* Messages the receiver has not looked at yet (after scan_pos) are in no line: count them
 * per key with a bounded walk, into a small table local to the call. */
#define UNSEEN_SLOTS 4096u /* a power of two; filled at most half */
typedef struct {
    uint64_t hash;
    uint32_t count; /* 0: empty entry */
    uint32_t merged; /* the key table had a line for it */
} unseen_ent;

static unseen_ent *unseen_find(unseen_ent *t, uint64_t hash, int add, uint32_t *used) {
    uint32_t i = (uint32_t)(hash ^ (hash >> 32)) & (UNSEEN_SLOTS - 1);
    for (uint32_t probes = 0; probes < UNSEEN_SLOTS; probes++) {
        if (t[i].count == 0) {
            if (!add || *used >= UNSEEN_SLOTS / 2) return NULL;
            (*used)++;
            t[i].hash = hash;
            return &t[i];
        }
        if (t[i].hash == hash) return &t[i];
        i = (i + 1) & (UNSEEN_SLOTS - 1);
    }
    return NULL;
}

static void unseen_walk(shm_chan *c, unseen_ent *t, uint32_t *partial) {
    uint32_t used = 0;
    /* receiver-written, with plain stores (window.c, ring_rewind): only a hint of where to
     * start; every record read is checked against head (rec_read) */
    uint64_t pos = LOAD_ACQUIRE(&c->hdr->scan_pos);
    for (uint32_t i = 0;; i++) {
        rec_copy r;
        int rc = rec_read(c, pos, &r);
        if (rc == SHM_EMPTY) return; /* the tail: counted them all */
        if (i >= VIEW_WALK || rc == SHM_STALE || rc == SHM_E_CORRUPT || rc == SHM_STALLED) {
            *partial = 1; /* the bound, the receiver moving on, or a record being written */
            return;
        }
        if (rc == SHM_OK && r.slot == NIL) { /* (a slot: taken in ahead, lookahead.c) */
            for (uint32_t k = 0; k < r.nkeys; k++) {
                if (hash_index(r.hashes, k, r.hashes[k]) < k) continue; /* a duplicate */
                unseen_ent *e = unseen_find(t, r.hashes[k], 1, &used);
                if (e) e->count++;
                else *partial = 1;
            }
        }
        pos += r.len;
    }
}

static uint32_t unseen_count(unseen_ent *t, uint64_t hash, int merge) {
    uint32_t used = 0;
    unseen_ent *e = unseen_find(t, hash, 0, &used);
    if (!e) return 0;
    if (merge) e->merged = 1;
    return e->count;
}

int shm_view_lines(shm_chan *c, uint32_t top, shm_view *out, uint32_t *n, uint8_t *blob,
                   uint64_t blob_cap, uint32_t *partial) {
    *n = 0;
    *partial = 0;
    if (top == 0) return SHM_OK;
    if (top > SHM_VIEW_TOP_MAX) return SHM_E_INVALID;
    unseen_ent *unseen = calloc(UNSEEN_SLOTS, sizeof *unseen);
    if (!unseen) return SHM_E_NOMEM;
    uint64_t scan_before = LOAD_ACQUIRE(&c->hdr->scan_pos);
    unseen_walk(c, unseen, partial);
    uint32_t count = 0;
    shm_key chunk[VIEW_CHUNK];
    uint64_t depths[VIEW_CHUNK];
    uint32_t size = keytab_view_size(c); /* it only grows; chunks copied from the table as
                                          * it is then may miss keys moved by a growth */
    for (uint32_t start = 0; start < size; start += VIEW_CHUNK) {
        uint32_t m = size - start < VIEW_CHUNK ? size - start : VIEW_CHUNK;
        int ok = 0;
        for (int tries = 0; tries < VIEW_TRIES && !ok; tries++) {
            uint64_t ver = view_begin(c);
            memcpy(chunk, &c->keys[start], m * sizeof(shm_key));
            /* the exact depth (is the line's first message handed out?) only for entries
             * that could make the list: everything else costs one copy */
            for (uint32_t i = 0; i < m; i++) {
                shm_key *k = &chunk[i];
                depths[i] = 0;
                if (k->head == NIL && k->skipped == 0) continue;
                uint64_t more = unseen_count(unseen, k->hash, 0);
                uint64_t bound = (uint64_t)k->count + more +
                                 k->skipped;
                if (count == top && bound <= out[top - 1].depth) continue;
                depths[i] = key_depth(c, k) + more;
            }
            ok = view_ok(c, ver);
        }
        if (!ok) *partial = 1; /* used as read: checked, perhaps not current */
        for (uint32_t i = 0; i < m; i++) {
            if (chunk[i].head != NIL || chunk[i].skipped) unseen_count(unseen, chunk[i].hash, 1);
            if (depths[i] == 0) continue;
            if (count == top && depths[i] <= out[top - 1].depth) continue;
            top_insert(out, &count, top, chunk[i].hash, depths[i]);
        }
    }
    /* keys that only messages not looked at yet carry */
    for (uint32_t i = 0; i < UNSEEN_SLOTS; i++) {
        unseen_ent *e = &unseen[i];
        if (e->count == 0 || e->merged) continue;
        if (count == top && e->count <= out[top - 1].depth) continue;
        top_insert(out, &count, top, e->hash, e->count);
    }
    free(unseen);
    /* records taken in during the scan may have been counted twice */
    if (LOAD_ACQUIRE(&c->hdr->scan_pos) != scan_before) *partial = 1;
    /* the head (oldest not handed out) of each chosen line, with its key's value */
    blob_buf b = {blob, blob_cap, 0};
    uint32_t kept = 0;
    for (uint32_t i = 0; i < count; i++) {
        shm_view v = out[i];
        int rc = line_head(c, v.hash, &v, &b, partial);
        if (rc == SHM_FULL) {
            *n = kept;
            return SHM_FULL;
        }
        if (rc != SHM_OK) continue; /* emptied meanwhile, or not found: leave it out */
        v.depth = out[i].depth;
        v.hash = out[i].hash;
        out[kept++] = v;
    }
    *n = kept;
    return SHM_OK;
}

/* ---- why is a message waiting? -------------------------------------------------------- */
/* The message ahead of slot s on one of its keys (fifo), or the holder of one of its keys
 * (eager): *pred, *hash. Prefers one that is not itself waiting (the chain ends there),
 * then the oldest. SHM_EMPTY if s heads all its lines (it is not waiting any more). */
static int slot_pred(shm_chan *c, uint32_t s, uint32_t *pred, uint64_t *hash) {
    shm_slot *sl = &c->slots[s];
    uint32_t nd = sl->first_node, nkeys = sl->nkeys, best = NIL;
    uint64_t best_hash = 0, best_seq = UINT64_MAX;
    int best_waits = 1;
    if (nkeys > c->cfg.max_keys) return SHM_E_CORRUPT;
    for (uint32_t i = 0; i < nkeys; i++) {
        if (!NODE_OK(c, nd)) return SHM_E_CORRUPT;
        shm_node node = c->nodes[nd];
        uint32_t ps = NIL;
        if (c->cfg.order == SHM_ORDER_FIFO) {
            if (NODE_OK(c, node.prev)) ps = c->nodes[node.prev].slot;
        } else {
            int64_t ki = key_lookup(c, node.hash);
            if (ki >= 0) ps = c->keys[ki].held;
        }
        if (SLOT_OK(c, ps) && ps != s) {
            int waits = SLOT_STATE(LOAD_ACQUIRE(&c->slots[ps].state)) == SLOT_WAITING;
            uint64_t seq = c->slots[ps].seq;
            if (best == NIL || (best_waits && !waits) || (waits == best_waits && seq < best_seq)) {
                best = ps;
                best_hash = node.hash;
                best_seq = seq;
                best_waits = waits;
            }
        }
        nd = node.sibling;
    }
    if (best == NIL) return SHM_EMPTY;
    *pred = best;
    *hash = best_hash;
    return SHM_OK;
}

/* Find the window's slot holding seq: *slot and its state word, or SHM_EMPTY. */
static int find_slot(shm_chan *c, uint64_t seq, uint32_t *slot, uint64_t *word) {
    for (uint32_t s = 1, used = slots_touched(c, c->hdr); s < used; s++) {
        shm_slot *sl = &c->slots[s];
        if (LOAD_RELAXED(&sl->seq) != seq) continue;
        uint64_t w = LOAD_ACQUIRE(&sl->state); /* pairs with the receiver's and holders' stores */
        if (SLOT_STATE(w) == SLOT_FREE || LOAD_RELAXED(&sl->seq) != seq) continue;
        *slot = s;
        *word = w;
        return SHM_OK;
    }
    return SHM_EMPTY;
}

/* Walk the ring from ingest_pos for seq. SHM_OK: *r is its committed record. SHM_CLOSED
 * or SHM_EMPTY: it is not there, and *state says why (DELIVERED: finished, or before
 * ingest_pos and so no longer in the window; UNKNOWN: not sent yet, or its producer died).
 * SHM_BUSY: the walk's bound, or a record still being written, stopped it. With `want`,
 * also the last unfinished record before it carrying each of want's keys. */
typedef struct {
    uint64_t pos[SHM_MAX_KEYS_LIMIT]; /* UINT64_MAX: none */
    uint64_t seq[SHM_MAX_KEYS_LIMIT];
    uint32_t slot[SHM_MAX_KEYS_LIMIT];
} preds;

static int ring_find(shm_chan *c, uint64_t seq, rec_copy *r, uint64_t *state, const rec_copy *want,
                     preds *p) {
    for (int tries = 0; tries < VIEW_TRIES; tries++) {
        if (p)
            for (uint32_t k = 0; k < SHM_MAX_KEYS_LIMIT; k++) p->pos[k] = UINT64_MAX;
        /* "Delivered" is concluded from what one walk read; a receiver that moved records
         * meanwhile (compaction slides them and moves ingest_pos past its filler) can make
         * that reading wrong, so it is trusted only if no update overlapped the walk:
         * otherwise the walk is tried again, and in the end the answer is partial. */
        uint64_t ver = view_begin(c);
        uint64_t pos = LOAD_ACQUIRE(&c->hdr->ingest_pos); /* a starting point; checked below */
        int rc = SHM_BUSY;
        for (uint32_t i = 0; i < VIEW_WALK; i++) {
            rc = rec_read(c, pos, r);
            if (rc == SHM_STALE || rc == SHM_E_CORRUPT) break; /* head moved on: again */
            if (rc == SHM_STALLED) return SHM_BUSY;
            if (i == 0 && seq < r->seq) {
                if (!view_ok(c, ver)) {
                    rc = SHM_STALE;
                    break;
                }
                *state = SHM_VIEW_DELIVERED; /* everything before ingest_pos was taken in */
                return SHM_EMPTY;
            }
            if (rc == SHM_EMPTY || r->seq > seq) {
                *state = SHM_VIEW_UNKNOWN; /* not sent yet, or its producer died */
                return SHM_EMPTY;
            }
            if (r->seq == seq) {
                if (rc == SHM_OK) return SHM_OK;
                if (r->state == REC_DONE) {
                    if (!view_ok(c, ver)) {
                        rc = SHM_STALE;
                        break;
                    }
                    *state = SHM_VIEW_DELIVERED;
                    return SHM_CLOSED;
                }
                /* a discarded claim passes its seq on to the next record: go on */
            } else if (rc == SHM_OK && p && want) {
                int gone = 0;
                if (SLOT_OK(c, r->slot)) {
                    uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&c->slots[r->slot].state)); /* holders' CAS */
                    gone = st == SLOT_DEAD || st == SLOT_DISCARD || st == SLOT_RELEASED;
                }
                for (uint32_t k = 0; k < want->nkeys && !gone; k++) {
                    if (hash_index(r->hashes, r->nkeys, want->hashes[k]) >= r->nkeys) continue;
                    p->pos[k] = pos;
                    p->seq[k] = r->seq;
                    p->slot[k] = r->slot;
                }
            }
            pos += r->len;
            rc = SHM_BUSY;
        }
        if (rc != SHM_STALE && rc != SHM_E_CORRUPT) return SHM_BUSY;
    }
    return SHM_BUSY;
}

/* One more entry of the chain: the message in slot s (state word w), reached over `hash`. */
static int chain_add(shm_chan *c, uint32_t s, uint64_t hash, shm_view *out, uint32_t *n,
                     blob_buf *b) {
    for (int tries = 0; tries < VIEW_TRIES; tries++) {
        uint64_t w = LOAD_ACQUIRE(&c->slots[s].state); /* pairs with the receiver's stores */
        int rc = slot_view(c, s, w, hash, &out[*n], b);
        if (rc == SHM_STALE) continue;
        if (rc == SHM_OK) (*n)++;
        return rc;
    }
    return SHM_STALE;
}

int shm_view_why(shm_chan *c, uint64_t seq, shm_view *self, shm_view *out, uint32_t max,
                 uint32_t *n, uint8_t *blob, uint64_t blob_cap, uint32_t *partial) {
    blob_buf b = {blob, blob_cap, 0};
    *n = 0;
    *partial = 0;
    memset(self, 0, sizeof *self);
    self->seq = seq;
    self->state = SHM_VIEW_UNKNOWN;
    uint32_t s;
    uint64_t w;
    rec_copy r;
    int rc;
    if (seq == 0) return SHM_OK; /* seqs start at 1 */
    int located = 0;
    for (int look = 0; look < 3 && !located; look++) {
        if (find_slot(c, seq, &s, &w) == SHM_OK) {
            rc = SHM_STALE;
            for (int tries = 0; tries < VIEW_TRIES && rc == SHM_STALE; tries++) {
                rc = slot_view(c, s, w, 0, self, &b);
                w = LOAD_ACQUIRE(&c->slots[s].state); /* pairs with the receiver's stores */
                if (SLOT_STATE(w) == SLOT_FREE) break;
            }
            if (rc == SHM_FULL) return SHM_FULL;
            if (rc != SHM_OK) { /* it moved on while we looked: released, most likely */
                self->state = SHM_VIEW_DELIVERED;
                return SHM_OK;
            }
            located = 1;
            break;
        }
        /* Not in the window: finished, not sent, or left out of the window. */
        uint64_t state = SHM_VIEW_UNKNOWN;
        rc = ring_find(c, seq, &r, &state, NULL, NULL);
        if (rc == SHM_EMPTY || rc == SHM_CLOSED) {
            self->state = state;
            return SHM_OK;
        }
        if (rc != SHM_OK) break;
        if (SLOT_OK(c, r.slot)) continue; /* taken in meanwhile: look in the window again */
        self->state = SHM_VIEW_QUEUED;
        rc = blob_copy(c, r.pos, r.seq, 0, self, &b);
        if (rc == SHM_FULL) return rc;
        if (rc == SHM_OK) b.used += self->blob_len;
        s = NIL;
        located = 1;
    }
    if (!located) {
        self->state = SHM_VIEW_QUEUED; /* somewhere beyond the walk's bound */
        *partial = 1;
        return SHM_OK;
    }
    if (self->state != SHM_VIEW_WAITING && self->state != SHM_VIEW_QUEUED) return SHM_OK;

    /* The chain. A message outside the window waits behind the last earlier unfinished
     * record with one of its keys (found by a walk), or, if there is none, behind the
     * last message in the window with one of its keys (its line's tail: everything taken
     * in on a key precedes everything left out on it, window.c). */
    rec_copy cur = r;
    while (*n < max) {
        if (s == NIL) {
            preds p;
            uint64_t state;
            rec_copy want = cur;
            rc = ring_find(c, want.seq, &cur, &state, &want, &p);
            if (rc != SHM_OK) {
                *partial = 1;
                return SHM_OK;
            }
            uint32_t best = SHM_MAX_KEYS_LIMIT;
            for (uint32_t k = 0; k < cur.nkeys; k++)
                if (p.pos[k] != UINT64_MAX && (best == SHM_MAX_KEYS_LIMIT || p.seq[k] > p.seq[best]))
                    best = k;
            if (best < SHM_MAX_KEYS_LIMIT && !SLOT_OK(c, p.slot[best])) {
                /* ahead of it: another record outside the window */
                uint64_t used = b.used;
                shm_view *v = &out[*n];
                memset(v, 0, sizeof *v);
                v->seq = p.seq[best];
                v->state = SHM_VIEW_QUEUED;
                rc = blob_copy(c, p.pos[best], p.seq[best], want.hashes[best], v, &b);
                if (rc == SHM_FULL) return rc;
                if (rc != SHM_OK) {
                    b.used = used;
                    *partial = 1;
                    return SHM_OK;
                }
                b.used += v->blob_len;
                (*n)++;
                rc = ring_find(c, p.seq[best], &cur, &state, NULL, NULL);
                if (rc != SHM_OK) {
                    *partial = 1;
                    return SHM_OK;
                }
                continue;
            }
            uint32_t ps = NIL;
            uint64_t hash = 0;
            if (best < SHM_MAX_KEYS_LIMIT) {
                ps = p.slot[best];
                hash = want.hashes[best];
                if (LOAD_RELAXED(&c->slots[ps].seq) != p.seq[best]) { /* it moved on */
                    *partial = 1;
                    return SHM_OK;
                }
            } else {
                for (uint32_t k = 0; k < want.nkeys && ps == NIL; k++) {
                    uint32_t t = NIL;
                    int ok = 0;
                    for (int tries = 0; tries < VIEW_TRIES && !ok; tries++) {
                        uint64_t ver = view_begin(c);
                        int64_t ki = key_lookup(c, want.hashes[k]);
                        uint32_t tail = ki >= 0 ? c->keys[ki].tail : NIL;
                        uint32_t held = ki >= 0 ? c->keys[ki].held : NIL;
                        t = c->cfg.order == SHM_ORDER_FIFO
                                ? (ki >= 0 && c->keys[ki].head != NIL && NODE_OK(c, tail)
                                       ? c->nodes[tail].slot
                                       : NIL)
                                : held;
                        ok = view_ok(c, ver);
                    }
                    if (!ok) *partial = 1; /* the last reading, checked, perhaps not current */
                    if (SLOT_OK(c, t)) {
                        ps = t;
                        hash = want.hashes[k];
                    }
                }
            }
            if (ps == NIL) { /* nothing ahead of it: it goes as soon as the receiver looks */
                if (*n == 0) self->state = SHM_VIEW_READY;
                return SHM_OK;
            }
            rc = chain_add(c, ps, hash, out, n, &b);
            if (rc == SHM_FULL) return rc;
            if (rc != SHM_OK || out[*n - 1].state != SHM_VIEW_WAITING) return SHM_OK;
            s = ps;
            continue;
        }
        /* In the window: the message ahead of s on one of its keys. */
        uint32_t ps = NIL;
        uint64_t hash = 0;
        int found = 0;
        for (int tries = 0; tries < VIEW_TRIES; tries++) {
            uint64_t ver = view_begin(c);
            rc = slot_pred(c, s, &ps, &hash);
            if (view_ok(c, ver)) {
                found = 1;
                break;
            }
        }
        if (!found) *partial = 1;
        if (rc != SHM_OK) return SHM_OK; /* heads its lines: not waiting any more */
        rc = chain_add(c, ps, hash, out, n, &b);
        if (rc == SHM_FULL) return rc;
        if (rc != SHM_OK) {
            *partial = 1;
            return SHM_OK;
        }
        if (out[*n - 1].state != SHM_VIEW_WAITING) return SHM_OK;
        s = ps;
    }
    return SHM_OK;
}

/* ---- producers ------------------------------------------------------------------------ */
int shm_view_producers(shm_chan *c, uint64_t *tokens, uint64_t *sent, uint32_t max, uint32_t *n) {
    uint32_t count = 0;
    for (uint32_t i = 0; i < c->cfg.max_producers && count < max; i++) {
        /* acquire: pairs with the registering CAS in shm_producer_attach */
        uint64_t t = LOAD_ACQUIRE(&c->producers[i].owner);
        if (t == 0) continue;
        tokens[count] = t;
        sent[count] = LOAD_RELAXED(&c->producers[i].sent);
        count++;
    }
    *n = count;
    return SHM_OK;
}
