/* window.c -- taking records in, and parking the ones that must wait.
 *
 * The scheduler (sched.c) works on the messages in its window: at most max_messages of
 * them have a slot in the message table. A message that must wait -- under fifo, one
 * of its keys has a line or earlier parked records; under eager, one of its keys is
 * held -- gets no slot. Its record is *parked* where it lies in the ring, linked into
 * per-key chains, so max_messages bounds what can run (ready, in flight, dead letters),
 * not what can be seen, and a long backlog costs nothing to a message that can go now:
 *
 *     head     ingest_pos                                   scan_pos
 *      |  done  | parked | taken | parked | parked | done |   not yet looked at ...
 *
 *   - scan_pos is the next record to look at. The receiver looks at each record once,
 *     as it arrives, and decides (decide): take it in (free to go), park it, or stop
 *     there (free to go, but the window is full: nothing more can run before a release;
 *     or it must wait, but parking it would take key entries past the tables' budget,
 *     budget.c). Parking is O(keys): an append to a chain per key, no slot needed.
 *   - Past a stopped scan, while nothing is ready, the look-ahead (lookahead.c) may take
 *     in a message on free keys *ahead of the scan*: it has a slot, and its record's slot
 *     field says so, like any record taken in. When the scan reaches it, it steps over it:
 *     window_taken (its slot is still in use) or, released since, DONE
 *     (lookahead_done_at). So records past scan_pos are not all untouched: some may be
 *     taken in, in flight or finished; none is parked, and none moves (compaction stays
 *     behind scan_pos).
 *   - A key's chain (shm_key.skip_head / skip_tail / skipped) lists parked records, linked
 *     through the records themselves (record links[i], core.h). Under fifo a parked
 *     record is in the chain of each of its keys, in ring order (= seq order), and a
 *     later record carrying any of those keys parks behind it: its place in line on all
 *     its keys at once, as the lock manager requires. Under eager it is in the chain of
 *     one key only, the held key it met, in the order it met it (eager promises no
 *     order across keys).
 *   - A record leaves its chains (wake) when the key it waits for frees up: under fifo
 *     when the key's line empties, it returns if it is first in the chain of each of its
 *     keys and none of them has a line; under eager the chain of the freed key is walked
 *     until a record takes the key, each record either taken in or moved to the chain of
 *     another held key it meets. sched.c pushes freed keys that have a chain on the wake
 *     list (header.wake_keys); each poll works it off before looking at new records, so
 *     a release costs O(keys of the next message), whatever is parked.
 *   - ingest_pos: every record before it is taken in or finished; it moves over them
 *     lazily, and head (ring.c) never passes it, so a parked record's bytes stay put.
 *
 * A key table entry is needed for each key with a chain. To keep the table's load below
 * three quarters whatever is parked, at most a quarter of its largest size may be
 * chain-only keys (and the table grows with them: sched.c sched_key_room)
 * (header.skip_keys), and the table grows for them only within the tables' budget
 * (budget.c, sched.c sched_park_room); a record that would need more stops the scan
 * until some leave, and the look-ahead finds what may go past it.
 *
 * Everything read from the ring is checked: a chain link must point forward into the
 * looked-at region at a committed, parked record that carries the chain's key.
 */
#include <stdlib.h>

#include "core.h"

#define INGEST_BATCH 1024u /* records looked at per call: bounds one call's work */
#define READY_AHEAD 256u   /* take new records in while fewer than this are ready */
#define READY_LOW 128u     /* ... once fewer than this are (window_ingest) */
#define WALK_BATCH 4096u   /* records ingest_pos moves over per call at most */

enum { ADMIT_TAKE, ADMIT_PARK, ADMIT_STOP };

static int finished_state(uint32_t st) {
    return st == REC_DONE || st == REC_DISCARDED || st == REC_CANCELLED || st == REC_SKIP;
}

/* Index of the first hash of r equal to hash (its link slot), or -1. */
static int link_index(const shm_record *r, uint64_t hash) {
    for (uint32_t i = 0; i < r->nkeys; i++)
        if (r->hashes[i] == hash) return (int)i;
    return -1;
}

/* The parked record at pos, checked: inside the looked-at region, committed (or being
 * written: a placeholder, whose fixed fields and hashes are complete), without a slot,
 * carrying hash. NULL if any of that is not so (corruption). */
static shm_record *parked_at(shm_chan *c, uint64_t pos, uint64_t hash, int *idx) {
    shm_header *h = c->hdr;
    if (pos < h->ingest_pos || pos >= h->scan_pos || (pos & 7u)) return NULL;
    shm_record *r = rec_at(c, pos);
    /* acquire: pairs with the producer's release of WRITING / COMMITTED (ring.c fill) */
    uint64_t meta = LOAD_ACQUIRE(&r->meta);
    uint64_t len = META_LEN(meta);
    uint32_t st = META_STATE(meta);
    if ((st != REC_COMMITTED && st != REC_WRITING) || len > h->scan_pos - pos || r->slot != NIL ||
        ring_validate_body(c, r, len) != SHM_OK)
        return NULL;
    *idx = link_index(r, hash);
    return *idx < 0 ? NULL : r;
}

/* ---- chains -------------------------------------------------------------------------- */
static int chain_append(shm_chan *c, uint64_t hash, shm_record *r, uint64_t pos) {
    shm_key *k = sched_key_get(c, hash);
    int i = link_index(r, hash), ti;
    if (k == NULL || i < 0) return SHM_E_CORRUPT;
    if (k->skipped == 0) {
        k->skip_head = pos;
        c->hdr->skip_keys++;
    } else {
        shm_record *t = parked_at(c, k->skip_tail, hash, &ti);
        if (t == NULL || k->skip_tail == pos) return SHM_E_CORRUPT;
        rec_links(t, t->nkeys)[ti] = pos;
    }
    k->skip_tail = pos;
    k->skipped++;
    return SHM_OK;
}

/* r, at pos, leaves the chain of hash, which it heads. */
static int chain_pop(shm_chan *c, uint64_t hash, shm_record *r, uint64_t pos) {
    shm_key *k = sched_key_find(c, hash);
    int i = link_index(r, hash);
    if (k == NULL || i < 0 || k->skipped == 0 || k->skip_head != pos) return SHM_E_CORRUPT;
    if (--k->skipped == 0) {
        c->hdr->skip_keys--;
        sched_key_tidy(c, k);
        return SHM_OK;
    }
    uint64_t next = rec_links(r, r->nkeys)[i];
    /* fifo chains run forward in ring order; eager ones need not (a record moves to the
     * chain of the next held key it meets). parked_at checks the rest when followed. */
    if (next == pos || (c->cfg.order == SHM_ORDER_FIFO && next < pos)) return SHM_E_CORRUPT;
    k->skip_head = next;
    return SHM_OK;
}

/* Keys of r that have no table entry yet (parking would make one for each). */
static uint32_t new_keys(shm_chan *c, shm_record *r) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->nkeys; i++)
        if (rec_first_of_hash(r, i) && sched_key_find(c, r->hashes[i]) == NULL) n++;
    return n;
}

/* Tests only: chain-only keys at most, when fewer than a quarter of the table
 * (shm_test_park_keys), so that small tests meet a stopped scan (lookahead.c). */
static uint32_t park_keys_test; /* 0: no such bound */

int shm_test_park_keys(uint32_t keys) {
    __atomic_store_n(&park_keys_test, keys, __ATOMIC_RELAXED); /* as shm_test_keytab_first */
    return SHM_OK;
}

/* May r be parked without the key table growing past its share for chains? */
static int park_room(shm_chan *c, shm_record *r) {
    uint32_t n = new_keys(c, r), most = c->keytab_max / 4;
    uint32_t t = __atomic_load_n(&park_keys_test, __ATOMIC_RELAXED);
    if (UNLIKELY(t) && t < most) most = t;
    return c->hdr->skip_keys + n <= most && sched_park_room(c, n);
}

/* What to do with the record r at scan_pos (read-only: work_pending asks it too).
 * Under eager, *blocker is the held key it meets. */
static int decide(shm_chan *c, shm_record *r, uint64_t *blocker) {
    int fifo = c->cfg.order == SHM_ORDER_FIFO, parks = 0;
    for (uint32_t i = 0; i < r->nkeys && !parks; i++) {
        shm_key *k = sched_key_find(c, r->hashes[i]);
        if (k == NULL) continue;
        /* eager parks behind a chain too, not only behind a holder: between a release and
         * the wake of the key's chain (next poll), a newcomer on that key would otherwise
         * go before the messages parked there, and one producer's messages on one key
         * would come out of order (seen: 196 before 189 on key 0, one producer). */
        parks = fifo ? (k->head != NIL || k->skipped != 0) : (k->held != NIL || k->skipped != 0);
        if (parks) *blocker = r->hashes[i];
    }
    if (parks) return fifo && !park_room(c, r) ? ADMIT_STOP : ADMIT_PARK;
    /* delayed past now: not needed before its time, so only within the tables' budget
     * (lookahead.c looks past it and wakes the receiver when it falls due) */
    if (UNLIKELY(r->flags & REC_F_TIMES) && lookahead_not_due(r, META_LEN(LOAD_RELAXED(&r->meta))))
        return sched_has_room_ahead(c, r->nkeys) ? ADMIT_TAKE : ADMIT_STOP;
    return sched_has_room(c, r->nkeys) ? ADMIT_TAKE : ADMIT_STOP;
}

static int park(shm_chan *c, shm_record *r, uint64_t pos, uint64_t blocker) {
    int rc = SHM_OK;
    r->slot = NIL;
    if (c->cfg.order == SHM_ORDER_FIFO) {
        for (uint32_t i = 0; i < r->nkeys && rc == SHM_OK; i++)
            if (rec_first_of_hash(r, i)) rc = chain_append(c, r->hashes[i], r, pos);
    } else {
        rc = chain_append(c, blocker, r, pos);
    }
    if (rc == SHM_OK) c->hdr->skipped++;
    return rc;
}

/* A parked record r at pos leaves all its chains (it heads each) and is taken in. */
static int unpark_fifo(shm_chan *c, shm_record *r, uint64_t pos) {
    for (uint32_t i = 0; i < r->nkeys; i++) {
        if (!rec_first_of_hash(r, i)) continue;
        int rc = chain_pop(c, r->hashes[i], r, pos);
        if (rc) return rc;
    }
    uint32_t s;
    c->hdr->skipped--;
    return sched_take_in(c, r, pos, &s);
}

/* ---- waking parked records ------------------------------------------------------------- */
void window_wake_push(shm_chan *c, uint64_t hash) {
    shm_header *h = c->hdr;
    if (h->wake_n < SHM_WAKE_KEYS) h->wake_keys[h->wake_n++] = hash;
    else h->wake_overflow = 1; /* window_wake finds it by a scan of the key table */
}

/* The key with this hash may have freed up: let its chain move. Returns SHM_OK,
 * SHM_FULL (a record could go but the window is full: try again later) or an error.
 * *moved is set when a record was taken in. */
static int wake_key(shm_chan *c, uint64_t hash, int *moved) {
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    const uint64_t parked = c->hdr->skipped; /* each round takes one off the chain */
    for (uint64_t guard = 0; guard <= parked; guard++) {
        shm_key *k = sched_key_find(c, hash);
        if (k == NULL || k->skipped == 0) return SHM_OK;
        if (fifo ? k->head != NIL : k->held != NIL) return SHM_OK; /* still taken */
        int idx;
        uint64_t pos = k->skip_head;
        shm_record *r = parked_at(c, pos, hash, &idx);
        if (r == NULL) return SHM_E_CORRUPT;
        /* A placeholder still on the writing list is the writing pass's (window_writing),
         * also once committed: its producer may commit it after this poll's writing pass
         * and before this wake, and a record taken in here would stay on the list, be
         * handed out and released, and the next writing pass would find a finished
         * record there (ChannelCorrupted). The writing pass takes it in, or leaves it
         * parked for its keys' next wake, once it has left the list. */
        if (META_STATE(LOAD_ACQUIRE(&r->meta)) == REC_WRITING || window_is_writing(c, pos))
            return SHM_OK;
        if (fifo) {
            /* It goes if it heads the chain of each of its keys, none of which has a line;
             * otherwise the key it still waits for will wake it. */
            for (uint32_t i = 0; i < r->nkeys; i++) {
                shm_key *o = sched_key_find(c, r->hashes[i]);
                if (o == NULL || o->skipped == 0) return SHM_E_CORRUPT; /* it is in that chain */
                if (o->skip_head != pos || o->head != NIL) return SHM_OK;
            }
            if (!sched_has_room(c, r->nkeys)) return SHM_FULL;
            *moved = 1;
            return unpark_fifo(c, r, pos);
        }
        /* eager: the first record of the chain takes the key, or moves on to the chain of
         * another held key it meets; then the next one is looked at. */
        uint64_t blocker = 0;
        int parks = 0;
        for (uint32_t i = 0; i < r->nkeys && !parks; i++) {
            shm_key *o = sched_key_find(c, r->hashes[i]);
            parks = o != NULL && o->held != NIL;
            if (parks) blocker = r->hashes[i];
        }
        if (!parks && !sched_has_room(c, r->nkeys)) return SHM_FULL;
        int rc = chain_pop(c, hash, r, pos);
        if (rc) return rc;
        if (parks) {
            rc = chain_append(c, blocker, r, pos);
        } else {
            uint32_t s;
            c->hdr->skipped--;
            *moved = 1;
            rc = sched_take_in(c, r, pos, &s);
        }
        if (rc) return rc;
    }
    return SHM_E_CORRUPT; /* more records than are parked: a cycle */
}

/* Work off the wake list. After an overflow, every key with a chain is looked at. */
static int window_wake(shm_chan *c, int *moved) {
    shm_header *h = c->hdr;
    if (h->wake_overflow) {
        /* Collect first, then wake: waking may move entries of the table. */
        uint32_t size = c->keytab_size, n = 0;
        uint64_t *all = malloc(sizeof(uint64_t) * h->skip_keys + 8);
        if (all == NULL) return SHM_E_NOMEM;
        for (uint32_t i = 0; i < size && n < h->skip_keys; i++)
            if (c->keys[i].skipped) all[n++] = c->keys[i].hash;
        h->wake_overflow = 0;
        int rc = SHM_OK;
        for (uint32_t i = 0; i < n && rc == SHM_OK; i++) {
            rc = wake_key(c, all[i], moved);
            if (rc == SHM_FULL) { /* keep the rest for later */
                for (; i < n; i++) window_wake_push(c, all[i]);
                rc = SHM_OK;
            }
        }
        free(all);
        if (rc) return rc;
    }
    while (h->wake_n > 0) {
        if (h->wake_n > SHM_WAKE_KEYS) return SHM_E_CORRUPT;
        uint64_t hash = h->wake_keys[h->wake_n - 1];
        int rc = wake_key(c, hash, moved);
        if (rc == SHM_FULL) return SHM_OK; /* the window is full: the next release retries */
        if (rc) return rc;
        h->wake_n--;
    }
    return SHM_OK;
}

/* ---- placeholders: records looked at while their producer still writes them ------------------
 * A record in WRITING has its fixed fields and key hashes published (ring.c step 5). The
 * scan does not stop at it: under fifo it is parked like a waiting message (later messages
 * on its keys park behind it; it never goes while WRITING, wake_key), under eager it is
 * only remembered; either way its position goes on the writing list, which each poll
 * checks: committed, it may go (fifo: if it heads its chains and no key has a line;
 * eager: it is taken in or parked now); discarded (its producer died, shm_discard_dead), it leaves its chains. A frozen
 * producer thus holds up only the messages on its own keys. */
int window_is_writing(shm_chan *c, uint64_t pos) {
    shm_header *h = c->hdr;
    for (uint32_t i = 0; i < h->writing_n && i < SHM_WRITING_MAX; i++)
        if (h->writing[i] == pos) return 1;
    return 0;
}

/* Take the record r at pos out of the chains of its keys (fifo), wherever it is in them:
 * its producer died. Rare, so a walk from each chain's head is fine. */
static int unchain(shm_chan *c, shm_record *r, uint64_t pos) {
    for (uint32_t i = 0; i < r->nkeys; i++) {
        if (!rec_first_of_hash(r, i)) continue;
        uint64_t hash = r->hashes[i];
        shm_key *k = sched_key_find(c, hash);
        if (k == NULL || k->skipped == 0) return SHM_E_CORRUPT;
        int rc;
        if (k->skip_head == pos) {
            rc = chain_pop(c, hash, r, pos);
        } else {
            uint64_t prev = k->skip_head;
            rc = SHM_E_CORRUPT;
            for (uint32_t n = 1; n < k->skipped; n++) {
                int pi;
                shm_record *p = parked_at(c, prev, hash, &pi);
                if (p == NULL) break;
                uint64_t *plink = &rec_links(p, p->nkeys)[pi];
                if (*plink != pos) {
                    prev = *plink;
                    continue;
                }
                if (k->skip_tail == pos) k->skip_tail = prev;
                else *plink = rec_links(r, r->nkeys)[i];
                k->skipped--;
                rc = SHM_OK;
                break;
            }
        }
        if (rc) return rc;
        window_wake_push(c, hash); /* whoever was behind it may go */
    }
    c->keys_freed++; /* and what the look-ahead passed on its keys (lookahead.c) */
    c->hdr->skipped--;
    return SHM_OK;
}

/* The placeholder r at pos is being discarded (its producer died: shm_discard_dead): it
 * leaves the writing list and (fifo) its chains, waking whoever was behind it. */
int window_discard(shm_chan *c, shm_record *r, uint64_t pos) {
    shm_header *h = c->hdr;
    for (uint32_t i = 0; i < h->writing_n && i < SHM_WRITING_MAX; i++) {
        if (h->writing[i] != pos) continue;
        if (ring_validate_body(c, r, META_LEN(LOAD_ACQUIRE(&r->meta)))) return SHM_E_CORRUPT;
        int rc = c->cfg.order == SHM_ORDER_FIFO ? unchain(c, r, pos) : SHM_OK;
        if (rc) return rc;
        h->writing[i] = h->writing[--h->writing_n];
        h->discarded++;
        return SHM_OK;
    }
    return SHM_STALE;
}

/* One pass over the writing list; *promoted: some record left it, *unfinished: some record
 * was still WRITING when looked at. */
static int writing_pass(shm_chan *c, int *promoted, int *unfinished) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    for (uint32_t i = 0; i < h->writing_n;) {
        uint64_t pos = h->writing[i];
        shm_record *r = rec_at(c, pos);
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
        uint32_t st = META_STATE(meta);
        if (st == REC_WRITING) {
            *unfinished = 1;
            i++;
            continue;
        }
        if (pos < h->ingest_pos || pos >= h->scan_pos || ring_validate_body(c, r, META_LEN(meta)))
            return SHM_E_CORRUPT;
        int rc = SHM_OK;
        if (st == REC_COMMITTED) {
            if (fifo) {
                /* Parked already. It goes now if it heads the chain of each of its keys
                 * and none has a line (a wake of its keys while it was still being
                 * written left it there); otherwise a release ahead of it wakes it. */
                int go = 1;
                for (uint32_t k = 0; k < r->nkeys && go; k++) {
                    shm_key *o = sched_key_find(c, r->hashes[k]);
                    if (o == NULL || o->skipped == 0) return SHM_E_CORRUPT; /* in its chain */
                    go = o->skip_head == pos && o->head == NIL;
                }
                if (go && !sched_has_room(c, r->nkeys)) { /* look again next poll */
                    i++;
                    continue;
                }
                if (go) rc = unpark_fifo(c, r, pos);
            } else {
                rc = window_admit(c, r, pos);
                if (rc == SHM_FULL) { /* no room: look again next poll */
                    i++;
                    continue;
                }
            }
        } else {
            return SHM_E_CORRUPT;
        }
        if (rc) return rc;
        h->writing[i] = h->writing[--h->writing_n];
        *promoted = 1;
    }
    return SHM_OK;
}

/* Promote the placeholders whose producers committed them. The list is in no particular
 * order, and a producer may have several records on it (a batch claims ahead): a pass can
 * see a later record committed after it saw an earlier one of the same producer still
 * WRITING, though that one was committed first. So after a pass that promoted something
 * while something stayed WRITING, look again: the acquire of the later commit made the
 * earlier one visible, and both are in the ready heap (by seq) before anything is handed
 * out. Each further pass promotes at least one record or is the last. */
static int writing_promote(shm_chan *c, int *moved) {
    if (c->hdr->writing_n > SHM_WRITING_MAX) return SHM_E_CORRUPT;
    int promoted, unfinished;
    do {
        promoted = unfinished = 0;
        int rc = writing_pass(c, &promoted, &unfinished);
        if (rc) return rc;
        if (promoted) *moved = 1;
    } while (promoted && unfinished);
    return SHM_OK;
}

/* Every poll asks: with no placeholder (the common case) it is one test, inline (left to
 * the compiler, the call was made, and cost the single receive more than the test). */
__attribute__((always_inline)) static inline int window_writing(shm_chan *c, int *moved) {
    if (LIKELY(c->hdr->writing_n == 0)) return SHM_OK;
    return writing_promote(c, moved);
}

/* The record at scan_pos is being written: can the scan move past it (placeholder)?
 * Only a plain record: its length must be exactly what its published fixed fields give.
 * A record longer than that ends in a gate trailer (an exchange's publish, ring.c) that is
 * not written yet -- the bytes there may still hold an older lap's trailer, which would
 * pass ring_validate_body -- and it will end GATED, not COMMITTED: it stops the scan like
 * a claim (ring_peek's stall) and is settled through the exchange's gate. */
static int placeholder_ok(shm_chan *c, shm_record *r, uint64_t meta) {
    uint64_t len = META_LEN(meta);
    return META_STATE(meta) == REC_WRITING && c->hdr->writing_n < SHM_WRITING_MAX &&
           len >= REC_BODY && (len & 7u) == 0 && len <= c->cap - REC_HDR &&
           r->nkeys <= c->cfg.max_keys && len == rec_size(r->nkeys, r->keys_len, r->data_len) &&
           ring_validate_body(c, r, len) == SHM_OK;
}

/* ---- ingest_pos ---------------------------------------------------------------------------- */
/* Move ingest_pos over records taken in or finished, up to the first parked one.
 * *moved: the walk stopped at WALK_BATCH with more to walk, which is work the poll owes
 * (shm_recv goes on, as for new records): head never passes ingest_pos, so a receiver that
 * slept with the walk cut short freed one batch of ring space per wake-up, and a sender
 * waiting for that space waited through the receiver's upkeep periods. */
static int walk_ingest(shm_chan *c, int *moved) {
    shm_header *h = c->hdr;
    uint64_t pos = h->ingest_pos;
    uint32_t i = 0;
    for (; i < WALK_BATCH && pos < h->scan_pos; i++) {
        shm_record *r = rec_at(c, pos);
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
        uint64_t len = META_LEN(meta);
        if (len < REC_HDR || (len & 7u) || len > h->scan_pos - pos) return SHM_E_CORRUPT;
        uint32_t st = META_STATE(meta);
        if (finished_state(st)) ring_head_unknown(c); /* head may pass it now (ring.c) */
        else if (!(st == REC_COMMITTED && len >= REC_BODY && r->slot != NIL)) break; /* parked */
        pos += len;
    }
    if (i == WALK_BATCH && pos < h->scan_pos) *moved = 1;
    h->ingest_pos = pos;
    return SHM_OK;
}

/* ingest_pos's walk alone, for a poll that got what it asked for from the run
 * (batchin.c) and skips the rest of the take-in: head never passes ingest_pos, so a
 * walk cut short (WALK_BATCH) behind a woken parked record must go on at every poll,
 * or the records the run took in past it keep their ring space until a poll finds
 * nothing to take in. */
int window_walk(shm_chan *c) {
    int more = 0; /* the poll hands out what it got: its next call goes on */
    return c->hdr->ingest_pos != c->hdr->scan_pos ? walk_ingest(c, &more) : SHM_OK;
}

/* The rebuild (rebuild.c) hands records over in ring order, as the scan would. */
int window_admit(shm_chan *c, shm_record *r, uint64_t pos) {
    uint64_t blocker = 0;
    int d = decide(c, r, &blocker);
    if (d == ADMIT_STOP) return SHM_FULL;
    if (d == ADMIT_PARK) return park(c, r, pos, blocker);
    uint32_t s;
    return sched_take_in(c, r, pos, &s);
}

/* Is the committed record r at scan_pos free to go now (taken in, not parked or held
 * back by a full window)? The run path of a batch receive asks (batchin.c). */
int window_free_to_go(shm_chan *c, shm_record *r) {
    uint64_t blocker = 0;
    return decide(c, r, &blocker) == ADMIT_TAKE;
}

/* Would a poll make progress right now? (the receiver's re-check before it sleeps) */
int window_has_work(shm_chan *c) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    if ((h->wake_n || h->wake_overflow) && sched_has_room(c, c->cfg.max_keys)) return 1;
    for (uint32_t i = 0; i < h->writing_n && i < SHM_WRITING_MAX; i++) {
        /* seq_cst: as below, pairs with the fence in wake_receiver after a commit */
        shm_record *w = rec_at(c, h->writing[i]);
        if (META_STATE(LOAD_SEQCST(&w->meta)) == REC_WRITING) continue;
        /* Finished, but with no room for it it stays on the list (writing_pass), whatever
         * the order: not work until a release makes room, and that release posts us.
         * (Its key count is final once committed; clamped, as it is unchecked here.) */
        uint32_t nk = w->nkeys < c->cfg.max_keys ? w->nkeys : c->cfg.max_keys;
        if (!sched_has_room(c, nk)) continue;
        /* eager: one delayed past now waits for the budget like the scan's (decide) */
        uint64_t wl = META_LEN(LOAD_RELAXED(&w->meta));
        if (UNLIKELY(w->flags & REC_F_TIMES) && wl >= REC_BODY && wl <= c->cap - REC_HDR &&
            ring_validate_body(c, w, wl) == SHM_OK && lookahead_not_due(w, wl) &&
            !sched_has_room_ahead(c, nk))
            continue;
        return 1;
    }
    /* With READY_LOW or more ready the poll does not scan (window_ingest), so a new record
     * is no work: the ready ones are (work_pending), or, when all of them are held back
     * (hold.c: paused), the resume or a release that changes that posts us. */
    if (h->ready_count >= READY_LOW) return 0;
    shm_record *r = rec_at(c, h->scan_pos);
    /* seq_cst: after the receiver's seq_cst store of rx_sleeping; pairs with the fence in
     * wake_receiver (ring.c): either we see the commit or its producer sees us asleep. */
    uint64_t owner = LOAD_SEQCST(&r->owner);
    if (owner == OWNER_EMPTY(h->scan_pos)) return 0;
    uint64_t meta = LOAD_SEQCST(&r->meta);
    uint32_t st = META_STATE(meta);
    if (st == REC_CLAIMED || st == REC_GATED) return 0; /* a commit after it wakes us */
    if (st == REC_WRITING) /* a placeholder, if there is room for one */
        return placeholder_ok(c, r, meta) && (!fifo || park_room(c, r) || lookahead_has_work(c));
    if (st != REC_COMMITTED || h->ready_count >= READY_AHEAD) return 1; /* let the poll say */
    uint64_t len = META_LEN(meta), blocker;
    if (len < REC_BODY || len > c->cap - REC_HDR || ring_validate_body(c, r, len)) return 1;
    return decide(c, r, &blocker) != ADMIT_STOP || lookahead_has_work(c);
}

/* One intake step of the receiver's poll: wake parked records whose key freed up, look
 * at up to INGEST_BATCH new records, move ingest_pos. *moved: something changed.
 *
 * New records are looked at in batches: only once fewer than READY_LOW messages are
 * ready, and then until READY_AHEAD are. A receiver taking one message per poll so pays
 * the scan's set-up once per READY_AHEAD - READY_LOW messages rather than per message.
 * Holding the scan back reorders nothing: records not yet looked at come after every
 * record looked at in the ring, so in seq order (ring order is seq order), and the
 * ready heap hands out lowest seq first; parked records woken above and placeholders
 * are dealt with on every poll, as before. It delays no hand-out either: READY_LOW
 * messages are ready to go meanwhile, and an empty heap always scans. */
int window_ingest(shm_chan *c, shm_stall *stall, int *stalled, int *moved) {
    shm_header *h = c->hdr;
    int rc = window_writing(c, moved);
    test_pause(SHM_PAUSE_INGEST_WAKE); /* a placeholder may commit here (wake_key) */
    if (rc == SHM_OK) rc = window_wake(c, moved);
    if (rc) return rc;
    uint32_t batch = h->ready_count < READY_LOW ? INGEST_BATCH : 0;
    int stopped = 0; /* at a record that may go or park, but not now */
    for (uint32_t i = 0; i < batch && h->ready_count < READY_AHEAD; i++) {
        uint64_t pos = h->scan_pos, len;
        shm_record *r;
        rc = ring_peek(c, pos, &r, &len, stall);
        if (rc == SHM_EMPTY) break;
        if (rc == SHM_STALLED) {
            r = rec_at(c, pos);
            /* acquire: pairs with the producer's release of WRITING (ring.c fill) */
            uint64_t meta = LOAD_ACQUIRE(&r->meta);
            if (!placeholder_ok(c, r, meta)) { /* claimed, or too many unfinished */
                *stalled = 1;
                break;
            }
            len = META_LEN(meta);
            if (c->cfg.order == SHM_ORDER_FIFO) { /* it keeps its place on its keys */
                if (!park_room(c, r)) {
                    stopped = 1;
                    break;
                }
                rc = park(c, r, pos, 0);
                if (rc) return rc;
            }
            h->writing[h->writing_n++] = pos;
        } else if (rc == SHM_CLOSED) { /* discarded, cancelled, a skip: nothing to take in */
            uint32_t st = META_STATE(LOAD_RELAXED(&r->meta));
            if (st == REC_DISCARDED) h->discarded++;
            if (st == REC_SKIP) h->skip_bytes += len; /* an island's bytes (islands.c) */
        } else if (rc == SHM_E_CORRUPT && lookahead_done_at(c, pos, &len)) {
            /* taken in ahead of the scan and finished since (lookahead.c) */
        } else if (rc) {
            return rc;
        } else if (h->writing_n && (rc = window_writing(c, moved)) != SHM_OK) {
            return rc;
        } else if (!window_taken(c, r, pos)) {
            /* (Above: placeholders first. ring_peek's acquire of r's commit makes visible
             * every commit its producer made before it, so an earlier message of that
             * producer still on the writing list is promoted now, before r is taken in:
             * a producer's messages keep their order whenever their keys allow it, also
             * when one of them was first seen unfinished.) */
            uint64_t blocker = 0;
            int d = decide(c, r, &blocker);
            if (d == ADMIT_STOP) { /* the window is full: a release brings us back */
                stopped = 1;
                break;
            }
            uint32_t s;
            rc = d == ADMIT_PARK ? park(c, r, pos, blocker) : sched_take_in(c, r, pos, &s);
            if (rc) return rc;
        }
        h->scan_pos = pos + len;
        *moved = 1;
    }
    /* Nothing ready and the scan stopped: a free message may lie further on. */
    STORE_RELAXED(&c->ahead_due, 0); /* lookahead_run sets it again (shm_timers_wait) */
    if (stopped && (rc = lookahead_run(c, moved)) != SHM_OK) return rc;
    if (h->ingest_pos != h->scan_pos) return walk_ingest(c, moved);
    return SHM_OK;
}

/* Is the committed record r at pos already in the window? The scan meets one that the
 * look-ahead took in before it (lookahead.c), or after a receiver's rebuild (rebuild.c):
 * a message handed out before the crash. */
int window_taken(shm_chan *c, shm_record *r, uint64_t pos) {
    uint32_t s = r->slot;
    if (s == NIL || s > c->cfg.max_messages) return 0;
    shm_slot *sl = &c->slots[s];
    return sl->pos == pos && sl->seq == r->seq && SLOT_STATE(sl->state) != SLOT_FREE;
}

/* ---- self-check (shm_check_scheduler, tests) ---------------------------------------------
 * Every chain is as long as its count says, ends at its tail and holds parked records
 * carrying its key (fifo: in ring order); the parked records between ingest_pos and
 * scan_pos are exactly the ones the chains count; and no chain that could move is
 * forgotten: its key is on the wake list. O(parked records), never on a hot path. */
static int waking(shm_chan *c, uint64_t hash) {
    shm_header *h = c->hdr;
    if (h->wake_overflow) return 1;
    for (uint32_t i = 0; i < h->wake_n && i < SHM_WAKE_KEYS; i++)
        if (h->wake_keys[i] == hash) return 1;
    return 0;
}

int window_check(shm_chan *c, uint32_t *what) {
    shm_header *h = c->hdr;
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    uint64_t links = 0, chain_keys = 0, parked = 0, parked_links = 0;
    for (uint32_t i = 0; i < c->keytab_size; i++) {
        shm_key *k = &c->keys[i];
        if (k->skipped == 0) continue;
        chain_keys++;
        uint64_t pos = k->skip_head, prev = 0;
        int idx;
        for (uint32_t n = 0; n < k->skipped; n++) {
            shm_record *r = parked_at(c, pos, k->hash, &idx);
            if (r == NULL) { *what = 20; return SHM_E_CORRUPT; }
            if (fifo && n > 0 && pos <= prev) { *what = 21; return SHM_E_CORRUPT; }
            prev = pos;
            if (n + 1 < k->skipped) pos = rec_links(r, r->nkeys)[idx];
        }
        if (pos != k->skip_tail) { *what = 22; return SHM_E_CORRUPT; }
        links += k->skipped;
        /* a chain whose key is free must be on the wake list, unless (fifo) its first
         * record still waits for another of its keys */
        int free_ = fifo ? k->head == NIL : k->held == NIL;
        if (free_ && !waking(c, k->hash)) {
            shm_record *r = parked_at(c, k->skip_head, k->hash, &idx);
            int could_go = META_STATE(LOAD_ACQUIRE(&r->meta)) == REC_COMMITTED, woken = 0;
            for (uint32_t j = 0; fifo && j < r->nkeys; j++) {
                shm_key *o = sched_key_find(c, r->hashes[j]);
                if (o == NULL || o->skip_head != k->skip_head || o->head != NIL) could_go = 0;
                woken |= waking(c, r->hashes[j]); /* waking any of its keys moves it */
            }
            if (woken) could_go = 0;
            if (could_go) { *what = 23; return SHM_E_CORRUPT; }
        }
    }
    if (chain_keys != h->skip_keys) { *what = 24; return SHM_E_CORRUPT; }
    for (uint64_t pos = h->ingest_pos, guard = 0; pos < h->scan_pos; guard++) {
        shm_record *r = rec_at(c, pos);
        uint64_t meta = LOAD_ACQUIRE(&r->meta); /* pairs with the producer's commit */
        uint64_t len = META_LEN(meta);
        if (len < REC_HDR || (len & 7u) || len > h->scan_pos - pos || guard > c->cap) {
            *what = 25;
            return SHM_E_CORRUPT;
        }
        uint32_t st = META_STATE(meta);
        int placeholder = window_is_writing(c, pos);
        if (fifo ? (st == REC_COMMITTED || st == REC_WRITING) && r->slot == NIL
                 : st == REC_COMMITTED && r->slot == NIL && !placeholder) {
            parked++;
            for (uint32_t j = 0; j < r->nkeys && j < c->cfg.max_keys; j++)
                parked_links += rec_first_of_hash(r, j);
        }
        pos += len;
    }
    if (parked != h->skipped || links != (fifo ? parked_links : parked)) {
        *what = 26;
        return SHM_E_CORRUPT;
    }
    return SHM_OK;
}

/* ---- compaction (compact.c) -------------------------------------------------------------
 * A parked record may move: its place in its chains is its position, which window_moved
 * below points at the copy. A placeholder's position is on the writing list, which must
 * stay true, so it stays where it is. */
int window_parked_movable(shm_chan *c, uint64_t pos) {
    return pos >= c->hdr->ingest_pos && pos < c->hdr->scan_pos && !window_is_writing(c, pos);
}

/* Where the record that was at pos lies now: to[i] if pos == from[i]. *at is where to
 * look first, and is left just past the record found: a chain walked in ring order meets
 * the moved records of a run on its key one after the other, so the walk of a long run
 * costs no search per record. */
static uint64_t moved_pos(const uint64_t *from, const uint64_t *to, uint32_t n, uint64_t pos,
                          uint32_t *at) {
    uint32_t lo = *at;
    if (lo >= n || from[lo] != pos) {
        uint32_t hi = n; /* from[] ascends */
        lo = 0;
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (from[mid] < pos) lo = mid + 1;
            else hi = mid;
        }
        if (lo >= n || from[lo] != pos) return pos;
    }
    *at = lo + 1;
    return to[lo];
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Compaction moved the parked records at from[i] to to[i] (i < n; both ascending, order
 * kept; ingest_pos already at or before the first copy): point the chains of their keys
 * at the copies -- each key's first and last position, and the links of the records in
 * its chain. Each such chain is walked once from its first record; a fifo chain runs in
 * ring order, so its walk ends past the last copy, while an eager one is walked whole.
 * O(records in those chains). hashes has room for `room` entries, which compact.c
 * reserved before moving anything (at least one per key of each moved record), so that
 * nothing here allocates. SHM_E_CORRUPT if that room is short or a chain cannot be
 * followed (parked_at checks every step): compact.c then rebuilds the chains from the
 * ring (rebuild.c). */
int window_moved(shm_chan *c, const uint64_t *from, const uint64_t *to, uint32_t n,
                 uint64_t *hashes, uint64_t room) {
    int fifo = c->cfg.order == SHM_ORDER_FIFO;
    uint64_t nh = 0;
    for (uint32_t i = 0; i < n; i++) {
        shm_record *r = rec_at(c, to[i]); /* the copy, checked by compact.c's look */
        for (uint32_t j = 0; j < r->nkeys && j < c->cfg.max_keys; j++)
            /* a run of records on one key adds its hash once: less to sort */
            if (rec_first_of_hash(r, j) && (nh == 0 || hashes[nh - 1] != r->hashes[j])) {
                if (nh >= room) return SHM_E_CORRUPT; /* more keys than the look counted */
                hashes[nh++] = r->hashes[j];
            }
    }
    qsort(hashes, nh, sizeof *hashes, by_value);
    for (uint64_t i = 0; i < nh; i++) {
        if (i > 0 && hashes[i] == hashes[i - 1]) continue;
        uint64_t hash = hashes[i];
        shm_key *k = sched_key_find(c, hash);
        if (k == NULL || k->skipped == 0) continue; /* eager: not a chain this record is in */
        uint32_t at = 0;
        k->skip_tail = moved_pos(from, to, n, k->skip_tail, &at);
        at = 0;
        k->skip_head = moved_pos(from, to, n, k->skip_head, &at);
        uint64_t pos = k->skip_head;
        for (uint32_t m = 0; m + 1 < k->skipped; m++) {
            int idx;
            shm_record *r = parked_at(c, pos, hash, &idx);
            if (r == NULL) return SHM_E_CORRUPT;
            uint64_t *link = &rec_links(r, r->nkeys)[idx];
            *link = moved_pos(from, to, n, *link, &at);
            if (fifo && pos > to[n - 1]) break; /* the rest of the chain lies further on */
            pos = *link;
        }
    }
    return SHM_OK;
}

/* For the receiver's maintenance: the placeholders and their producers, whose liveness
 * the Python layer checks (a dead one's record is then discarded: shm_discard_dead). */
int shm_writing_list(shm_chan *c, uint64_t *pos, uint64_t *owner, uint32_t max, uint32_t *n) {
    *n = 0;
    if (!c->is_rx) return SHM_E_INVALID;
    rx_lock(&c->rx_mu);
    shm_header *h = c->hdr;
    for (uint32_t i = 0; i < h->writing_n && i < SHM_WRITING_MAX && *n < max; i++) {
        shm_record *r = rec_at(c, h->writing[i]);
        /* acquire: pairs with the claimant's CAS that named it */
        uint64_t o = LOAD_ACQUIRE(&r->owner);
        if (OWNER_IS_EMPTY(o) || META_STATE(LOAD_ACQUIRE(&r->meta)) != REC_WRITING) continue;
        pos[*n] = h->writing[i];
        owner[*n] = OWNER_TOKEN(o);
        (*n)++;
    }
    rx_unlock(&c->rx_mu);
    return SHM_OK;
}
