/* sched.c -- the key-locking scheduler: a deterministic lock manager in shared memory.
 *
 * Written only by the receiver process (under its process-local mutex), so nothing
 * here needs atomics except where a slot's state word is published to holders.
 *
 * Every key with messages in the window has an entry in an open-addressing table
 * (linear probing, deletion by backward shift: no tombstones, so lookups stay short)
 * holding its *line*: the window's messages carrying that key, in seq order, as a
 * singly linked list of nodes, one node per (message, distinct key hash).
 *
 * order="fifo" (the default) is the deterministic-lock-manager rule: a message may be
 * handed out when it is first in every line it is in. It stays first while in flight,
 * so "first in the line" also means "holds the key". slot.pending counts the lines in
 * which a message is not yet first; taking a message in appends it to each of its
 * lines (pending += lines that were not empty), and a release removes it from the front
 * of each of its lines and decrements pending of each new front; a front whose pending
 * reaches 0 joins the ready queue. Every step touches only the message's own keys:
 * O(keys), never O(messages waiting).
 *
 * order="eager" is key-message-channel's rule: a message may go as soon as none of its
 * keys is held. key.held names the holder.
 *
 * Messages that would wait are not taken in at all: the receiver parks their records in
 * per-key chains (window.c), so the window holds only messages that are ready, in flight
 * or dead letters, and under fifo every line has at most one node, its key's holder.
 * When a line empties (fifo) or a key is freed (eager) and the key has a parked chain,
 * the key goes on the wake list (window_wake_push), and the receiver's next poll looks
 * at the chain's first record: O(keys) per release, whatever is parked.
 *
 * Hash collisions: two different keys with one hash share a line. That can only add
 * waiting, never let conflicting messages run together. A message's own hashes are
 * de-duplicated before it joins any line, so it never waits behind itself.
 *
 * Indices read back from the segment are checked before use; a bad one is reported as
 * SHM_E_CORRUPT rather than followed.
 */
#include <stdlib.h>

#include "core.h"
#include "lane.h"

#define SLOT_OK(c, s) ((s) >= 1 && (s) <= (c)->cfg.max_messages)
#define NODE_OK(c, n) ((n) >= 1 && (n) < (c)->max_nodes)

/* Slots and nodes are handed out from their free lists, and when a list is empty from
 * the part of the table never used yet (fresh_*): a new channel writes nothing into its
 * tables, so creating one with millions of slots touches none of their pages, and a
 * channel whose window stays small keeps using the same few. */
void sched_init(shm_chan *c) {
    shm_header *h = c->hdr;
    h->free_slots = NIL;
    h->fresh_slots = 1;
    h->free_nodes = NIL;
    h->fresh_nodes = 1;
    h->ready_count = 0;
    h->heap_count = 0;
    lane_reset(c);
    h->handed_out = NIL;
}

/* ---- key table ------------------------------------------------------------------------- */
static inline int key_empty(const shm_key *k) {
    return k->head == NIL && k->held == NIL && k->skipped == 0;
}

/* Index of the entry for hash, or -1; *end: where the probe stopped (the empty entry an
 * insertion of hash would fill, if nothing is inserted or deleted meanwhile). */
static inline int64_t key_probe(shm_chan *c, uint64_t hash, uint32_t *end) {
    uint32_t i = key_home(c, hash);
    for (uint32_t probes = 0; probes < c->keytab_size; probes++) {
        shm_key *k = &c->keys[i];
        if (key_empty(k)) break;
        if (k->hash == hash) return i;
        i = key_next(c, i);
    }
    *end = i;
    return -1;
}

/* Index of the entry for hash, or -1. */
static int64_t key_find(shm_chan *c, uint64_t hash) {
    uint32_t end;
    return key_probe(c, hash, &end);
}

/* ---- the key table's size: grown with use --------------------------------------------
 * The table's region holds keytab_max entries (segment.c: enough at the most for every
 * node and parked key), but a hashed table touches pages all over its region, so only
 * its first keytab_size entries are in use: KEYTAB_MIN (keytab_first), doubled as keys
 * come (the last step stops at keytab_max). The keys in use are at most nodes_used (a key with a line or
 * a holder has a node) plus skip_keys (chain-only keys, window.c): the table doubles
 * before that bound passes half its size, so probes stay short.
 *
 * Growing is two steps. sched_key_room (from sched_has_room and window.c's park_room,
 * before a message's keys are inserted) commits the entries of the size the bound says
 * a message's keys may need (commit.c); if that fails, the window is full for
 * that moment. key_insert then rehashes (key_grow) when it is about to pass half, a
 * doubling at a time as far as is committed; so inserting never fails for lack of memory, and no entry
 * pointer is held across an insert by any caller (sched_key_get's contract).
 *
 * key_grow runs between rx_begin and rx_end like every table change: inspectors retry,
 * and a receiver killed in the middle leaves dirty set, so the next one rebuilds the
 * table (rebuild.c, sched_keys_reset) from the message table and the ring. */
static uint32_t keys_next_size(shm_chan *c) {
    uint64_t n = 2ull * c->keytab_size;
    return n > c->keytab_max ? c->keytab_max : (uint32_t)n;
}

static uint32_t keys_bound(shm_chan *c) { return c->hdr->nodes_used + c->hdr->skip_keys; }

/* The size that keeps the bound at most half the table with n more keys (key_insert
 * grows to it a doubling at a time). */
static uint32_t keys_size_for(shm_chan *c, uint32_t n) {
    uint64_t need = (uint64_t)keys_bound(c) + n, size = c->keytab_size;
    while (size < c->keytab_max && need > size / 2) size = 2 * size < c->keytab_max ? 2 * size : c->keytab_max;
    return (uint32_t)size;
}

int sched_key_room(shm_chan *c, uint32_t n) {
    if (c->keytab_size >= c->keytab_max) return 1; /* sized for the worst case (segment.c) */
    uint32_t size = keys_size_for(c, n);
    return size == c->keytab_size || commit_keys(c, size) == SHM_OK;
}

/* Rehash into the next size, in place (the old entries are copied out first). */
static int key_grow(shm_chan *c) {
    shm_header *h = c->hdr;
    uint32_t old = c->keytab_size, size = keys_next_size(c);
    if (size <= old || h->keys_committed < size) return SHM_FULL;
    shm_key *copy = malloc(sizeof(shm_key) * (size_t)old);
    if (copy == NULL) return SHM_E_NOMEM;
    memcpy(copy, c->keys, sizeof(shm_key) * (size_t)old);
    memset(c->keys, 0, sizeof(shm_key) * (size_t)size);
    c->keytab_size = size;
    STORE_RELAXED(&h->keys_active, size); /* read by keytab_view_size, under the seqlock */
    for (uint32_t j = 0; j < old; j++) {
        if (j == old / 2) test_pause(SHM_PAUSE_KEY_GROW);
        if (key_empty(&copy[j])) continue;
        uint32_t i = key_home(c, copy[j].hash);
        for (uint32_t probes = 0; probes < size && !key_empty(&c->keys[i]); probes++)
            i = key_next(c, i);
        c->keys[i] = copy[j];
    }
    free(copy);
    return SHM_OK;
}

/* Receiver rebuilding its tables (rebuild.c): empty, at the largest size already
 * committed that a receiver may have (commit_adopt's rule), at least KEYTAB_FLOOR entries.
 * SHM_FULL if not even those can be committed (they were at create: only a mark gone bad
 * gets here, and allocating again what is allocated succeeds). */
int sched_keys_reset(shm_chan *c) {
    shm_header *h = c->hdr;
    uint32_t k = h->keys_committed <= c->keytab_max ? h->keys_committed : 0, size = KEYTAB_FLOOR;
    if (k >= c->keytab_max) size = c->keytab_max;
    else
        while (2ull * size <= k) size *= 2;
    if (size > k && commit_keys(c, size) != SHM_OK) return SHM_FULL;
    c->keytab_size = size;
    STORE_RELAXED(&h->keys_active, size); /* as in key_grow */
    memset(c->keys, 0, sizeof(shm_key) * (size_t)size);
    return SHM_OK;
}

/* Index of the entry for hash, created empty-lined if absent; -1 if the table is full
 * (impossible by sizing unless the segment is corrupt). */
static int64_t key_insert(shm_chan *c, uint64_t hash) {
    /* a doubling at a time, as far as sched_key_room committed (it may take several
     * when one message brings many keys to a small table) */
    while (UNLIKELY(keys_bound(c) + 1 > c->keytab_size / 2) && c->keytab_size < c->keytab_max &&
           c->hdr->keys_committed >= keys_next_size(c) && key_find(c, hash) < 0) {
        int rc = key_grow(c);
        if (rc == SHM_E_NOMEM) return -1;
        if (rc) break;
    }
    uint32_t i = key_home(c, hash);
    for (uint32_t probes = 0; probes < c->keytab_size; probes++) {
        shm_key *k = &c->keys[i];
        if (key_empty(k)) {
            k->hash = hash;
            return i;
        }
        if (k->hash == hash) return i;
        i = key_next(c, i);
    }
    return -1;
}

/* Remove entry i (now empty) by shifting back the entries of its probe run. */
static void key_delete(shm_chan *c, uint32_t i) {
    uint32_t j = i;
    for (uint32_t probes = 0; probes < c->keytab_size; probes++) {
        j = key_next(c, j);
        shm_key *kj = &c->keys[j];
        if (key_empty(kj)) break;
        uint32_t home = key_home(c, kj->hash);
        /* kj may move to i if its home is not cyclically within (i, j]. */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        c->keys[i] = *kj;
        i = j;
    }
    c->keys[i].head = c->keys[i].tail = NIL;
    c->keys[i].held = NIL;
    c->keys[i].skipped = 0;
    c->keys[i].count = 0;
    c->keys[i].skip_head = c->keys[i].skip_tail = 0;
    c->keys[i].hash = 0;
}

/* For window.c: the entry of a key (NULL if none), the entry made if absent (NULL only if
 * the table is full), and dropping an entry that no longer holds anything. A pointer is
 * good only until the next deletion (entries shift back) or insertion (the table may
 * grow). Every entry that holds nothing is deleted at once: a probe run has no gaps. */
shm_key *sched_key_find(shm_chan *c, uint64_t hash) {
    int64_t k = key_find(c, hash);
    return k < 0 ? NULL : &c->keys[k];
}

shm_key *sched_key_get(shm_chan *c, uint64_t hash) {
    int64_t k = key_insert(c, hash);
    return k < 0 ? NULL : &c->keys[k];
}

/* k (from sched_key_find or sched_key_get) was just emptied: it leaves the table now.
 * By its place, not by a lookup: a lookup stops at the first entry that holds nothing,
 * so it would never find k, and k left in place would be such an entry in the middle of
 * a probe run, hiding every key placed past it (key_find would say "absent" for a key
 * that is held: ChannelCorrupted on its release, or worse, its messages let through). */
void sched_key_tidy(shm_chan *c, shm_key *k) {
    if (k < c->keys || k >= c->keys + c->keytab_size) return;
    if (key_empty(k)) key_delete(c, (uint32_t)(k - c->keys));
}

/* ---- the ready queue: a binary min-heap of slots by seq, and the lane -------------------
 * Messages free to go are handed out lowest seq first, whenever they became free: so a
 * producer's messages come out in the order it sent them whenever their keys allow, and
 * a nacked message (it keeps its seq) comes back before everything that was sent after
 * it. Those that become free in seq order (taken in as they arrive) go on the ready lane
 * (lane.h), O(1); the others on the heap, O(log ready) per push and pop; a pop takes the
 * lower seq of the two heads. Entries are checked as they are read. */
static int heap_push(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    uint32_t n = h->heap_count;
    if (n >= c->cfg.max_messages) return SHM_E_CORRUPT;
    uint64_t key = c->slots[s].seq;
    uint32_t i = n;
    while (i > 0) { /* sift up */
        uint32_t parent = (i - 1) / 2;
        if (c->heap[parent].seq <= key) break;
        c->heap[i] = c->heap[parent];
        i = parent;
    }
    c->heap[i] = (shm_ready){.seq = key, .slot = s};
    h->heap_count = n + 1;
    return SHM_OK;
}

static int ready_push(shm_chan *c, uint32_t s) {
    shm_header *h = c->hdr;
    if (h->ready_count >= c->cfg.max_messages) return SHM_E_CORRUPT;
    shm_slot *sl = &c->slots[s];
    /* release: holders reading a handle's slot (shm_handle_info) pair with their acquire
     * of the state word; READY is never shared, so relaxed would do, but keep one rule. */
    STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(sl->state), SLOT_READY));
    int rc = lane_append(c, s);
    if (rc == 0) rc = heap_push(c, s);
    if (rc < 0) return rc;
    h->ready_count++;
    return SHM_OK;
}

/* The paused path picks from the heap alone: the lane's entries move onto it first, each
 * once (they come back to the lane's speed only after the pause). */
static int lane_merge(shm_chan *c) {
    while (c->hdr->lane_count) {
        uint32_t s = lane_first(c);
        if (s == UINT32_MAX) return SHM_E_CORRUPT;
        lane_drop_first(c, s);
        if (heap_push(c, s)) return SHM_E_CORRUPT;
    }
    return SHM_OK;
}

/* Put back a slot just popped (hand_out could not hand it out). */
int sched_unpop(shm_chan *c, uint32_t s) { return ready_push(c, s); }

/* The heap index of the lowest-seq ready message that may be handed out now, or
 * heap_count if none may: the entries held back (hold.c: paused) are skipped. A
 * held-back entry's children are looked at, an allowed one's are not (their seqs are
 * higher), so this visits O(held back) entries: a depth-first walk with a small stack,
 * and a scan of the whole heap if that overflows. Indexes are checked by the caller. */
#define PICK_STACK 128u
static uint32_t ready_pick(shm_chan *c) {
    uint32_t n = c->hdr->heap_count, best = n;
    if (n > c->cfg.max_messages) return 0; /* the caller reports it */
    uint32_t stack[PICK_STACK], top = 0;
    stack[top++] = 0;
    while (top > 0) {
        uint32_t i = stack[--top];
        if (i >= n) continue;
        if (best < n && c->heap[i].seq >= c->heap[best].seq) continue;
        uint32_t s = c->heap[i].slot;
        if (!SLOT_OK(c, s) || !hold_blocks(c, s)) {
            best = i;
            continue;
        }
        if (top + 2 > PICK_STACK) { /* many held back: look at every entry */
            best = n;
            for (uint32_t j = 0; j < n; j++) {
                s = c->heap[j].slot;
                if ((best == n || c->heap[j].seq < c->heap[best].seq) &&
                    (!SLOT_OK(c, s) || !hold_blocks(c, s)))
                    best = j;
            }
            return best;
        }
        stack[top++] = 2 * i + 2;
        stack[top++] = 2 * i + 1;
    }
    return best;
}

/* Is there a ready message that may be handed out now? (the re-check before sleeping) */
int sched_has_ready(shm_chan *c) {
    if (c->hdr->ready_count == 0) return 0;
    if (LIKELY(!hold_any(c))) return 1;
    if (hold_channel(c)) return 0;
    if (lane_merge(c)) return 1; /* corrupt: let the poll say so */
    return ready_pick(c) < c->hdr->heap_count;
}

/* Place `last` in the hole at index i of a heap of n entries, moving it down. */
static inline void heap_sift_down(shm_chan *c, uint32_t i, uint32_t n, shm_ready last) {
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && c->heap[child + 1].seq < c->heap[child].seq) child++;
        if (c->heap[child].seq >= last.seq) break;
        c->heap[i] = c->heap[child];
        i = child;
    }
    c->heap[i] = last;
}

/* The paused path of sched_pop_ready: the lowest-seq entry that may go, taken out of
 * the middle of the heap (its place filled by the last entry, sifted up or down). */
static uint32_t ready_pop_allowed(shm_chan *c) {
    shm_header *h = c->hdr;
    if (hold_channel(c)) return NIL;
    if (lane_merge(c)) return UINT32_MAX;
    uint32_t n = h->heap_count;
    uint32_t at = ready_pick(c);
    if (at >= n) return NIL;
    if (!SLOT_OK(c, c->heap[at].slot)) return UINT32_MAX;
    uint32_t top = c->heap[at].slot;
    if (c->slots[top].seq != c->heap[at].seq || SLOT_STATE(c->slots[top].state) != SLOT_READY)
        return UINT32_MAX;
    shm_ready last = c->heap[--n];
    h->heap_count = n;
    h->ready_count--;
    if (at == n) return top; /* it was the last entry */
    uint32_t i = at;
    while (i > 0 && c->heap[(i - 1) / 2].seq > last.seq) { /* sift up */
        c->heap[i] = c->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap_sift_down(c, i, n, last);
    return top;
}

uint32_t sched_pop_ready(shm_chan *c) {
    shm_header *h = c->hdr;
    if (h->ready_count == 0) return NIL;
    /* Only the entry handed out is checked against the message table here; every slot
     * index is checked where it is used, and a wrong seq copy can only reorder. */
    uint32_t n = h->heap_count;
    if (n > c->cfg.max_messages || (uint64_t)n + h->lane_count != h->ready_count)
        return UINT32_MAX;
    /* Paused (hold.c): the lowest-seq message that may go instead of the top. One load
     * of a header word when nothing is paused. */
    if (UNLIKELY(hold_any(c))) return ready_pop_allowed(c);
    uint32_t first = lane_first(c);
    if (first == UINT32_MAX) return UINT32_MAX;
    if (first != NIL && (n == 0 || c->slots[first].seq < c->heap[0].seq)) {
        lane_drop_first(c, first);
        h->ready_count--;
        return first;
    }
    if (!SLOT_OK(c, c->heap[0].slot)) return UINT32_MAX;
    uint32_t top = c->heap[0].slot;
    if (c->slots[top].seq != c->heap[0].seq || SLOT_STATE(c->slots[top].state) != SLOT_READY)
        return UINT32_MAX;
    shm_ready last = c->heap[--n];
    h->heap_count = n;
    h->ready_count--;
    uint32_t i = 0;
    heap_sift_down(c, i, n, last);
    return top;
}

static inline uint32_t node_alloc(shm_chan *c) {
    shm_header *h = c->hdr;
    uint32_t n = h->free_nodes;
    if (n != NIL) {
        if (!NODE_OK(c, n)) return NIL;
        h->free_nodes = c->nodes[n].next;
    } else {
        n = h->fresh_nodes;
        if (!NODE_OK(c, n)) return NIL;
        STORE_RELAXED(&h->fresh_nodes, n + 1); /* read by nodes_touched (core.h) */
    }
    h->nodes_used++;
    return n;
}

static void node_free(shm_chan *c, uint32_t n) {
    c->nodes[n].next = c->hdr->free_nodes;
    c->hdr->free_nodes = n;
    c->hdr->nodes_used--;
}

static inline int line_append(shm_chan *c, shm_key *k, uint32_t n) {
    if (k->head != NIL && (!NODE_OK(c, k->head) || !NODE_OK(c, k->tail))) return SHM_E_CORRUPT;
    c->nodes[n].next = NIL;
    c->nodes[n].prev = k->head == NIL ? NIL : k->tail;
    if (k->head == NIL) k->head = n;
    else c->nodes[k->tail].next = n;
    k->tail = n;
    k->count++;
    return SHM_OK;
}

/* Room in the window for a message with nkeys keys: a slot, nodes and key entries, each
 * within what is committed (commit.c), committing more if need be. 0: the window is
 * full for now (at its size, or the filesystem gives no more, or the tables' budget is
 * spent and a message is still ready: budget.c). */
static int has_room(shm_chan *c, uint32_t nkeys);

/* Is there nothing to hand out, so that what the receiver takes in or parks next is
 * needed now, whatever the tables' budget (budget.c)? None is ready, or every ready one
 * is held back by a paused key (hold.c; a paused channel hands out nothing, so it keeps
 * the budget). */
int sched_tables_needed(shm_chan *c) {
    return c->hdr->ready_count == 0 ||
           (UNLIKELY(hold_any(c)) && !hold_channel(c) && !sched_has_ready(c));
}

int sched_has_room(shm_chan *c, uint32_t nkeys) {
    c->tables_need = sched_tables_needed(c);
    int ok = has_room(c, nkeys);
    c->tables_need = 0;
    return ok;
}

/* Room for a message not needed now (a delayed one, window.c decide): within the budget. */
int sched_has_room_ahead(shm_chan *c, uint32_t nkeys) { return has_room(c, nkeys); }

/* Is ring space held past a stopped scan that only parking can reclaim? Messages the
 * look-ahead took in lie there (released, or still out), and the ring is more than half
 * used, or a sender was refused or waits. */
static int space_short(shm_chan *c) {
    shm_header *h = c->hdr;
    if (!lookahead_ahead_of_scan(c)) return 0; /* nothing there but unscanned messages */
    /* relaxed: hints (producers write tail_hint, refusals and space_waiters); a stale
     * value only delays the exemption below to a later poll */
    uint64_t tail = LOAD_RELAXED(&h->tail_hint), head = h->head;
    return (tail > head && tail - head > c->limit / 2) ||
           LOAD_RELAXED(&h->refusals) != c->refusals_seen || LOAD_RELAXED(&h->space_waiters);
}

/* Key entries for a record parked with n keys new to the table (window.c park_room):
 * within the budget. A free message behind a record that may not park is found by the
 * look-ahead (lookahead.c) while nothing is ready. A record that brings new keys leaves
 * room in the table's size for one message of max_keys new keys, so that the message the
 * look-ahead takes in next does not double the table (a tenth of the ring's worth of
 * entries at once) for one key. One exemption: while messages the look-ahead took in
 * lie past the stopped scan and the ring is more than half used (space_short), parking
 * goes past the budget: their space cannot be reclaimed before the scan passes them
 * (compaction slides only records behind scan_pos, compact.c), and a sender must not wait
 * for a held key while there is space in aggregate. */
int sched_park_room(shm_chan *c, uint32_t n) {
    if (sched_key_room(c, n ? n + c->cfg.max_keys : 0)) return 1;
    if (!space_short(c)) return 0;
    c->tables_need = 1;
    int ok = sched_key_room(c, n);
    c->tables_need = 0;
    return ok;
}

/* has_room's tests; commit 0 answers them from what is committed already, and finds no
 * room where has_room would commit more (run_room counts the same for a run). */
static int room(shm_chan *c, uint32_t nkeys, int commit) {
    shm_header *h = c->hdr;
    if (h->free_slots == NIL) {
        if (!SLOT_OK(c, h->fresh_slots)) return 0;
        if (h->fresh_slots >= h->slots_committed &&
            (!commit || commit_slots(c, h->fresh_slots + 1) != SHM_OK))
            return 0;
    }
    if (c->max_nodes - 1 - h->nodes_used < nkeys) return 0;
    /* free nodes: the free list's (fresh_nodes - 1 - nodes_used) and the committed fresh
     * ones (nodes_committed - fresh_nodes) */
    if ((uint64_t)h->nodes_used + 1 + nkeys > h->nodes_committed &&
        (!commit || commit_nodes(c, h->nodes_used + 1 + nkeys) != SHM_OK))
        return 0;
    if (commit) return sched_key_room(c, nkeys);
    return c->keytab_size >= c->keytab_max || keys_size_for(c, nkeys) == c->keytab_size;
}

static int has_room(shm_chan *c, uint32_t nkeys) { return room(c, nkeys, 1); }

/* ---- eager helpers ------------------------------------------------------------------ */
/* Take every key of s (all free: window.c parks a message that meets a held key). */
static int eager_take(shm_chan *c, uint32_t s) {
    shm_slot *sl = &c->slots[s];
    uint32_t n = sl->first_node;
    for (uint32_t i = 0; i < sl->nkeys; i++) {
        if (!NODE_OK(c, n)) return SHM_E_CORRUPT;
        int64_t k = key_insert(c, c->nodes[n].hash);
        if (k < 0 || c->keys[k].held != NIL) return SHM_E_CORRUPT;
        c->keys[k].held = s;
        n = c->nodes[n].sibling;
    }
    return SHM_OK;
}

/* ---- taking a message in ----------------------------------------------------------- */
/* Give slot s one node per distinct key hash of record r; under fifo, append each node
 * to its key's line and count in pending the lines where s is not first. */
static int attach_keys(shm_chan *c, uint32_t s, shm_record *r) {
    shm_slot *sl = &c->slots[s];
    sl->first_node = NIL;
    sl->nkeys = 0;
    sl->pending = 0;
    uint32_t nkeys = r->nkeys;
    if (nkeys > c->cfg.max_keys) return SHM_E_CORRUPT;
    for (uint32_t i = 0; i < nkeys; i++) {
        if (!rec_first_of_hash(r, i)) continue;
        uint64_t hash = r->hashes[i];
        uint32_t n = node_alloc(c);
        if (n == NIL) return SHM_E_CORRUPT; /* sched_has_room said there was room */
        c->nodes[n].hash = hash;
        c->nodes[n].slot = s;
        c->nodes[n].sibling = sl->first_node;
        c->nodes[n].next = NIL;
        sl->first_node = n;
        sl->nkeys++;
        if (c->cfg.order == SHM_ORDER_FIFO) {
            int64_t k = key_insert(c, hash);
            if (k < 0) return SHM_E_CORRUPT;
            if (c->keys[k].head != NIL) sl->pending++;
            if (line_append(c, &c->keys[k], n)) return SHM_E_CORRUPT;
        }
    }
    return SHM_OK;
}

/* The first half of a take-in: a slot for the record at pos, in the window. */
static inline int take_slot(shm_chan *c, shm_record *r, uint64_t pos, uint32_t *slot_out) {
    shm_header *h = c->hdr;
    uint32_t s = h->free_slots;
    if (s != NIL) {
        if (!SLOT_OK(c, s)) return SHM_E_CORRUPT;
        h->free_slots = c->slots[s].next;
    } else {
        /* never used: its state word is SLOT_WORD(0, SLOT_FREE). The mark moves before the
         * slot's state is published (ready_push's release store, or hand_out's for a
         * message taken in by sched_take_in_free), so a receiver's rebuild
         * (rebuild.c), which looks only below the mark, sees every slot in use. */
        s = h->fresh_slots;
        if (!SLOT_OK(c, s)) return SHM_E_CORRUPT;
        STORE_RELAXED(&h->fresh_slots, s + 1); /* read by slots_touched (core.h) */
    }
    shm_slot *sl = &c->slots[s];
    h->window++;
    sl->seq = r->seq;
    sl->pos = pos;
    sl->attempt = 0;
    sl->deadline = 0;
    sl->holder = 0;
    sl->pin = PIN_FREE;
    window_link(c, s);
    *slot_out = s;
    return SHM_OK;
}

/* The last half: the message is counted and the record names its slot. */
static inline void take_done(shm_chan *c, shm_record *r, uint32_t s) {
    shm_header *h = c->hdr;
    h->queued_in_window++;
    h->ingested++;
    /* The record is ours now (compaction finds its slot through it). Last, and a release
     * store so the count above comes first: a receiver's rebuild takes a record with a
     * slot as counted in `ingested` (rebuild.c). Pairs with nothing across processes. */
    STORE_RELEASE(&r->slot, s);
}

int sched_take_in(shm_chan *c, shm_record *r, uint64_t pos, uint32_t *slot_out) {
    uint32_t s;
    int rc = take_slot(c, r, pos, &s);
    if (rc) return rc;
    shm_slot *sl = &c->slots[s];
    rc = attach_keys(c, s, r);
    if (rc) return rc;
    take_done(c, r, s);
    *slot_out = s;
    if (UNLIKELY(r->flags & REC_F_TIMES)) timers_take_in(c, s, r); /* delay, ttl (timers.c) */
    /* Only a message free to go is taken in (window.c): first in all its lines (fifo),
     * or none of its keys held (eager). Anything else is a scheduler bug or corruption. */
    if (c->cfg.order == SHM_ORDER_FIFO) return sl->pending == 0 ? ready_push(c, s) : SHM_E_CORRUPT;
    rc = eager_take(c, s);
    return rc ? rc : ready_push(c, s);
}

/* ---- taking in a message on free keys, to hand it out at once (batchin.c) ---------------
 * A receive of many messages takes a run of new records in and hands each out as it is
 * taken in (batchin.c). For a message none of whose keys is in the table -- nobody holds
 * them, no line or parked chain is on them: the common case -- the take-in is cut down
 * to what it changes, with the same effects in shared memory as sched_take_in followed by
 * the pop of the ready queue:
 *   - one probe per key. The probe that finds a key absent ends at the empty entry its
 *     insertion would fill (key_probe). Between that probe and the insertion only the
 *     message's own other keys are inserted (distinct hashes: rec_first_of_hash) and
 *     nothing is deleted, so every entry the probe passed still holds another key, and
 *     the insertion carries on from where the probe stopped. The one exception is a
 *     doubling of the table (key_insert's rule, tested the same way here): that key and
 *     the rest go through key_insert, which probes afresh.
 *   - the room test answered from what is committed (room(.., 0)); the first message of a
 *     receive asks sched_has_room instead, which may commit more, as decide() would.
 *   - no ready queue: the caller hands the message out at once (batchin.c), so its
 *     state goes FREE -> INFLIGHT with no READY between, and the queue it would have
 *     been the only entry of is not touched. A receiver killed between leaves dirty set
 *     and a FREE slot that the record names: the rebuild frees the slot and takes the
 *     record in again (window_taken: a FREE slot is not taken), as it does for a receiver
 *     killed inside sched_take_in before its ready_push. If the hand-out fails, its
 *     sched_unpop puts the message on the ready queue, as after a pop.
 * The caller has checked that nothing is ready or waking and the record carries no
 * times (batchin.c), so the message is the lowest seq that may go. */

/* attach_keys for the nkeys keys found absent, whose hashes hs[] the probes read from
 * the record: at[i] is where key i's probe stopped. */
static inline __attribute__((always_inline)) int attach_free_keys(shm_chan *c, uint32_t s,
                                                                   uint32_t nkeys,
                                                                   const uint64_t *hs,
                                                                   const uint32_t *at) {
    shm_slot *sl = &c->slots[s];
    int fifo = c->cfg.order == SHM_ORDER_FIFO, probed = 1;
    sl->first_node = NIL;
    sl->nkeys = 0;
    sl->pending = 0;
    for (uint32_t i = 0; i < nkeys; i++) {
        uint64_t hash = hs[i];
        int first = 1; /* a message counts each distinct hash once (rec_first_of_hash) */
        for (uint32_t j = 0; j < i; j++) first &= hs[j] != hash;
        if (!first) continue;
        uint32_t n = node_alloc(c);
        if (n == NIL) return SHM_E_CORRUPT; /* room() said there was room */
        c->nodes[n].hash = hash;
        c->nodes[n].slot = s;
        c->nodes[n].sibling = sl->first_node;
        sl->first_node = n;
        sl->nkeys++;
        int64_t k = -1;
        if (UNLIKELY(keys_bound(c) + 1 > c->keytab_size / 2) && c->keytab_size < c->keytab_max)
            probed = 0; /* key_insert may double the table: the probes' ends mean nothing */
        if (probed) {
            uint32_t j = at[i];
            for (uint32_t probes = 0; probes < c->keytab_size; probes++) {
                shm_key *e = &c->keys[j];
                if (key_empty(e)) {
                    e->hash = hash;
                    k = j;
                    break;
                }
                if (e->hash == hash) break; /* absent a moment ago: corrupt */
                j = key_next(c, j);
            }
        } else {
            k = key_insert(c, hash);
            if (k >= 0 && !key_empty(&c->keys[k])) k = -1; /* absent a moment ago */
        }
        if (k < 0) return SHM_E_CORRUPT;
        shm_key *key = &c->keys[k];
        if (fifo) {
            if (line_append(c, key, n)) return SHM_E_CORRUPT;
        } else {
            c->nodes[n].next = NIL;
            key->held = s;
        }
    }
    return SHM_OK;
}

/* room(.., 0)'s node and key-entry tests, counted once for a run: how many more nodes
 * the run may take (one per distinct key of a message) while each message it takes in
 * would pass them. Within the run only nodes_used changes what they test (by each
 * message's own nodes; a doubling of the key table only adds room), so passing
 * `nkeys <= *room` and then taking `nodes` off is the same as asking room() each time.
 * The slot test stays per message (free list or committed fresh slots). */
static uint32_t run_room(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t used = h->nodes_used, cap = c->max_nodes - 1;
    if ((uint64_t)h->nodes_committed < cap + 1)
        cap = h->nodes_committed ? h->nodes_committed - 1 : 0;
    uint64_t left = cap > used ? cap - used : 0;
    if (c->keytab_size < c->keytab_max) {
        uint64_t bound = keys_bound(c), half = c->keytab_size / 2;
        uint64_t keys = half > bound ? half - bound : 0;
        if (keys < left) left = keys;
    }
    /* below the *room_left markers (core.h) */
    return left >= SCHED_ROOM_UNCOUNTED ? SCHED_ROOM_UNCOUNTED - 1u : (uint32_t)left;
}

/* Take r in if none of its keys is in the table and there is room. nkeys: r's key count
 * as the caller validated it against r's length (peek.h), read from r once; its hashes
 * are read once too, by the probes (hs): every step below uses those copies, so the
 * probes and the insertions cover the same keys whatever a producer writes into the
 * record meanwhile. *room_left: the run's room (SCHED_ROOM_UNKNOWN before its first
 * message; SCHED_ROOM_UNCOUNTED after it until a second one comes: a single recv's run
 * of one does not count it). Returns 1 (taken in: *slot_out), 0 (a key is in the table,
 * or no room: the general path decides) or an error. */
static inline __attribute__((always_inline)) int take_in_free(shm_chan *c, shm_record *r,
                                                              uint64_t pos, uint32_t nkeys,
                                                              uint32_t *room_left,
                                                              uint32_t *slot_out) {
    shm_header *h = c->hdr;
    uint32_t at[SHM_MAX_KEYS_LIMIT];
    uint64_t hs[SHM_MAX_KEYS_LIMIT];
    if (nkeys > c->cfg.max_keys || nkeys > SHM_MAX_KEYS_LIMIT) return 0; /* the general path's */
    for (uint32_t i = 0; i < nkeys; i++) {
        hs[i] = r->hashes[i];
        if (key_probe(c, hs[i], &at[i]) >= 0) return 0;
    }
    int first = *room_left == SCHED_ROOM_UNKNOWN;
    if (first) { /* the first of a receive: as decide() asks, committing more if need be */
        if (!sched_has_room(c, nkeys)) return 0;
    } else {
        /* counted now, after the first message's take-in: the same count as right after
         * it (its hand-out changes no table) */
        if (*room_left == SCHED_ROOM_UNCOUNTED) *room_left = run_room(c);
        if (nkeys > *room_left ||
            (h->free_slots == NIL &&
             (!SLOT_OK(c, h->fresh_slots) || h->fresh_slots >= h->slots_committed)))
            return 0; /* room()'s tests */
    }
    uint32_t s;
    int rc = take_slot(c, r, pos, &s);
    if (rc == SHM_OK) rc = attach_free_keys(c, s, nkeys, hs, at);
    if (rc) return rc;
    take_done(c, r, s);
    if (first) *room_left = SCHED_ROOM_UNCOUNTED;
    else *room_left -= nkeys == 1 ? 1u : c->slots[s].nkeys; /* its nodes: at most nkeys */
    *slot_out = s;
    return 1;
}

/* A message with one key is the common case: take_in_free compiled for it has no loops. */
int sched_take_in_free(shm_chan *c, shm_record *r, uint64_t pos, uint32_t nkeys,
                       uint32_t *room_left, uint32_t *slot_out) {
    if (LIKELY(nkeys == 1)) return take_in_free(c, r, pos, 1, room_left, slot_out);
    return take_in_free(c, r, pos, nkeys, room_left, slot_out);
}

/* Recovery: a handed-out message rejoins its lines (it heads them) or retakes its keys. */
int sched_relink(shm_chan *c, uint32_t s, shm_record *r) {
    int rc = attach_keys(c, s, r);
    if (rc || c->cfg.order == SHM_ORDER_FIFO) return rc;
    return eager_take(c, s);
}

/* ---- letting go of a message's keys --------------------------------------------------- */
/* key_find for a key whose line node n must head: its index, or -1 if it is absent or n
 * is not first (both corrupt). The hash is compared first, so the entry sought is not
 * also tested for emptiness (an empty entry's hash is 0, and its head NIL: never n). */
__attribute__((always_inline)) static inline int64_t key_find_headed(shm_chan *c, uint64_t hash,
                                                                    uint32_t n) {
    uint32_t i = key_home(c, hash);
    for (uint32_t probes = 0; probes < c->keytab_size; probes++) {
        shm_key *k = &c->keys[i];
        if (k->hash == hash) return k->head == n ? (int64_t)i : -1;
        if (key_empty(k)) return -1;
        i = key_next(c, i);
    }
    return -1;
}

__attribute__((always_inline)) static inline int fifo_unlink(shm_chan *c, uint32_t s) {
    shm_slot *sl = &c->slots[s];
    uint32_t n = sl->first_node;
    for (uint32_t i = 0; i < sl->nkeys; i++) {
        if (!NODE_OK(c, n)) return SHM_E_CORRUPT;
        uint32_t sib = c->nodes[n].sibling;
        int64_t k = key_find_headed(c, c->nodes[n].hash, n);
        if (k < 0) return SHM_E_CORRUPT; /* absent, or n not first in line: it must be */
        shm_key *key = &c->keys[k];
        key->head = c->nodes[n].next;
        key->count--;
        if (key->head == NIL) {
            key->tail = NIL;
            if (key->skipped) window_wake_push(c, key->hash); /* its parked chain may move */
            else if (key_empty(key)) key_delete(c, (uint32_t)k);
        } else {
            if (!NODE_OK(c, key->head)) return SHM_E_CORRUPT;
            c->nodes[key->head].prev = NIL;
            uint32_t s2 = c->nodes[key->head].slot;
            if (!SLOT_OK(c, s2) || c->slots[s2].pending == 0) return SHM_E_CORRUPT;
            if (--c->slots[s2].pending == 0 && ready_push(c, s2)) return SHM_E_CORRUPT;
        }
        node_free(c, n);
        n = sib;
    }
    sl->first_node = NIL;
    sl->nkeys = 0;
    return SHM_OK;
}

static int eager_unlink(shm_chan *c, uint32_t s) {
    shm_slot *sl = &c->slots[s];
    uint32_t n = sl->first_node;
    for (uint32_t i = 0; i < sl->nkeys; i++) {
        if (!NODE_OK(c, n)) return SHM_E_CORRUPT;
        uint32_t sib = c->nodes[n].sibling;
        int64_t k = key_find(c, c->nodes[n].hash);
        if (k < 0 || c->keys[k].held != s) return SHM_E_CORRUPT;
        shm_key *key = &c->keys[k];
        key->held = NIL;
        if (key->skipped) window_wake_push(c, key->hash); /* its parked chain may move */
        else if (key_empty(key)) key_delete(c, (uint32_t)k);
        node_free(c, n);
        n = sib;
    }
    sl->first_node = NIL;
    sl->nkeys = 0;
    return SHM_OK;
}

/* s is finished (released, or dead-lettered): its keys go to the next in line. */
int sched_release(shm_chan *c, uint32_t s) {
    if (!SLOT_OK(c, s)) return SHM_E_CORRUPT;
    return c->cfg.order == SHM_ORDER_FIFO ? fifo_unlink(c, s) : eager_unlink(c, s);
}

/* sched_release for each of slots[0..n) in turn (a release run: handles.c), in one call.
 * Returns SHM_OK, or the first error with *done the slots whose keys went before it. */
int sched_release_many(shm_chan *c, const uint32_t *slots, uint32_t n, uint32_t *done) {
    int fifo = c->cfg.order == SHM_ORDER_FIFO, rc = SHM_OK;
    uint32_t i = 0;
    for (; i < n && rc == SHM_OK; i++) {
        uint32_t s = slots[i];
        if (!SLOT_OK(c, s)) rc = SHM_E_CORRUPT;
        else rc = fifo ? fifo_unlink(c, s) : eager_unlink(c, s);
    }
    *done = rc == SHM_OK ? n : i - 1;
    return rc;
}

/* s was given back: it keeps its place (first in its lines, or its eager keys) and goes
 * back on the ready heap (by its seq: ahead of everything sent after it) under a new
 * generation, so the handle that gave it back, or any stale copy of it, can never
 * release the redelivery. */
int sched_requeue(shm_chan *c, uint32_t s) {
    if (!SLOT_OK(c, s)) return SHM_E_CORRUPT;
    shm_slot *sl = &c->slots[s];
    /* release: pairs with holders' acquire/CAS of the state word (see ready_push). */
    STORE_RELEASE(&sl->state, SLOT_WORD(SLOT_GEN(sl->state) + 1, SLOT_READY));
    c->hdr->queued_in_window++;
    return ready_push(c, s);
}

/* ---- self-check ------------------------------------------------------------------------
 * Recompute what the incremental bookkeeping should say and compare (tests and the CLI's
 * `stat --check` use it). Receiver only; O(window), so never on a hot path.
 * Returns SHM_OK, or SHM_E_CORRUPT with *what set to a short reason code. */
int shm_check_scheduler(shm_chan *c, uint32_t *what) {
    if (!c->is_rx) return SHM_E_INVALID;
    rx_lock(&c->rx_mu);
    int rc = SHM_OK;
    *what = 0;
    uint32_t m = c->cfg.max_messages, used = slots_touched(c, c->hdr);
    /* fifo: each WAITING/READY/INFLIGHT message's pending equals the lines where it is not first */
    for (uint32_t s = 1; s < used && rc == SHM_OK; s++) {
        shm_slot *sl = &c->slots[s];
        uint32_t st = SLOT_STATE(sl->state);
        if (st == SLOT_FREE || st == SLOT_DEAD) continue;
        if (c->cfg.order != SHM_ORDER_FIFO) continue;
        uint32_t n = sl->first_node, notfirst = 0;
        for (uint32_t i = 0; i < sl->nkeys; i++) {
            if (!NODE_OK(c, n)) { rc = SHM_E_CORRUPT; *what = 1; break; }
            int64_t k = key_find(c, c->nodes[n].hash);
            if (k < 0) { rc = SHM_E_CORRUPT; *what = 2; break; }
            if (c->keys[k].head != n) notfirst++;
            n = c->nodes[n].sibling;
        }
        if (rc == SHM_OK && notfirst != sl->pending) { rc = SHM_E_CORRUPT; *what = 3; }
        if (rc == SHM_OK && st == SLOT_WAITING && sl->pending == 0) { rc = SHM_E_CORRUPT; *what = 4; }
    }
    /* the ready heap holds exactly the READY messages, each no earlier than its parent */
    uint32_t ready = 0, listed = c->hdr->heap_count, laned = 0;
    for (uint32_t s = 1; s < used; s++) ready += SLOT_STATE(c->slots[s].state) == SLOT_READY;
    for (uint32_t i = 0; i < listed && i < m && rc == SHM_OK; i++) {
        uint32_t s = c->heap[i].slot;
        if (!SLOT_OK(c, s) || SLOT_STATE(c->slots[s].state) != SLOT_READY) { rc = SHM_E_CORRUPT; *what = 10; }
        else if (c->heap[i].seq != c->slots[s].seq) { rc = SHM_E_CORRUPT; *what = 13; }
        else if (i > 0 && c->heap[(i - 1) / 2].seq > c->heap[i].seq) { rc = SHM_E_CORRUPT; *what = 12; }
    }
    /* ... and the delayed list (timers.c) the READY messages off the heap, each once */
    uint32_t delayed = 0;
    for (uint32_t s = c->hdr->delayed_head; s != NIL && rc == SHM_OK; s = c->slots[s].next) {
        if (!SLOT_OK(c, s) || delayed >= m || SLOT_STATE(c->slots[s].state) != SLOT_READY) {
            rc = SHM_E_CORRUPT;
            *what = 19;
            break;
        }
        delayed++;
    }
    if (rc == SHM_OK && delayed != c->hdr->delayed_count) { rc = SHM_E_CORRUPT; *what = 20; }
    /* ... and the lane (lane.h) the others, in seq order; the count is their sum */
    if (rc == SHM_OK && lane_check(c, &laned) != SHM_OK) { rc = SHM_E_CORRUPT; *what = 21; }
    if (rc == SHM_OK && listed + laned != c->hdr->ready_count) { rc = SHM_E_CORRUPT; *what = 22; }
    if (rc == SHM_OK && listed + laned + delayed != ready) { rc = SHM_E_CORRUPT; *what = 11; }
    /* the handed-out list holds exactly the slots out of the consumer's hands, each once,
     * with consistent back links */
    uint32_t out = 0, on_list = 0, prev = NIL;
    for (uint32_t s = 1; s < used; s++) {
        uint32_t st = SLOT_STATE(c->slots[s].state);
        out += st == SLOT_INFLIGHT || st == SLOT_RELEASED || st == SLOT_NACKED ||
               st == SLOT_DEAD || st == SLOT_DISCARD;
    }
    for (uint32_t s = c->hdr->handed_out; s != NIL && rc == SHM_OK; s = c->slots[s].out_next) {
        if (!SLOT_OK(c, s) || on_list > m || c->slots[s].out_prev != prev) { rc = SHM_E_CORRUPT; *what = 14; break; }
        uint32_t st = SLOT_STATE(c->slots[s].state);
        if (st != SLOT_INFLIGHT && st != SLOT_RELEASED && st != SLOT_NACKED && st != SLOT_DEAD &&
            st != SLOT_DISCARD) { rc = SHM_E_CORRUPT; *what = 15; break; }
        on_list++;
        prev = s;
    }
    if (rc == SHM_OK && on_list != out) { rc = SHM_E_CORRUPT; *what = 16; }
    if (rc == SHM_OK) rc = window_check(c, what); /* the parked records' chains */
    /* the key table: no entry that holds nothing is left with a key's hash (a gap in a
     * probe run, sched_key_tidy), and every key is found from its home */
    for (uint32_t k = 0; k < c->keytab_size && rc == SHM_OK; k++) {
        shm_key *key = &c->keys[k];
        if (key_empty(key)) {
            if (key->hash != 0) { rc = SHM_E_CORRUPT; *what = 17; }
        } else if (key_find(c, key->hash) != (int64_t)k) {
            rc = SHM_E_CORRUPT; *what = 18;
        }
    }
    /* every line's nodes belong to live messages, and the line is in seq order */
    for (uint32_t k = 0; k < c->keytab_size && rc == SHM_OK; k++) {
        shm_key *key = &c->keys[k];
        if (key_empty(key)) continue;
        uint32_t n = key->head, len = 0;
        uint64_t last = 0;
        for (uint32_t guard = 0; n != NIL; guard++, len++) {
            if (!NODE_OK(c, n) || guard > c->max_nodes) { rc = SHM_E_CORRUPT; *what = 5; break; }
            uint32_t s = c->nodes[n].slot;
            if (!SLOT_OK(c, s)) { rc = SHM_E_CORRUPT; *what = 6; break; }
            uint32_t st = SLOT_STATE(c->slots[s].state);
            if (st == SLOT_FREE || st == SLOT_DEAD) { rc = SHM_E_CORRUPT; *what = 7; break; }
            if (c->nodes[n].hash != key->hash) { rc = SHM_E_CORRUPT; *what = 8; break; }
            /* fifo lines are in seq order; eager wait lines are in order of arrival */
            if (c->cfg.order == SHM_ORDER_FIFO && c->slots[s].seq <= last) { rc = SHM_E_CORRUPT; *what = 9; break; }
            last = c->slots[s].seq;
            n = c->nodes[n].next;
        }
        /* the line's length, kept for inspect.c */
        if (rc == SHM_OK && len != key->count) { rc = SHM_E_CORRUPT; *what = 14; }
    }
    rx_unlock(&c->rx_mu);
    return rc;
}
