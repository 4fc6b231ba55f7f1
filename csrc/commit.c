/* commit.c -- backing the segment with memory as it is first used, never before.
 *
 * A channel's file (a /dev/shm object, or a regular file for path= channels) is sized
 * for its capacity and its largest tables, but made sparse: ftruncate allocates nothing.
 * A page of a shared mapping that is touched while the file has no block for it is
 * allocated by the fault, and on a full filesystem that fault is a SIGBUS. So nothing in
 * the segment is ever touched before it is *committed*: allocated with fallocate, which
 * says ENOSPC instead. Every region is committed as a prefix that only grows, and its
 * length is a mark in the header:
 *
 *   header, producer registry    all of it, at create (small, and scanned whole)
 *   ring_committed               ring bytes [0, n). Raised by any producer whose claim
 *                                reaches past it (ring.c claim), in chunks
 *   slots_committed              message table entries [0, n), and as many ready heap
 *   nodes_committed              entries; key nodes; key table entries. Raised by the
 *   keys_committed               receiver only, before its fresh marks (sched.c) or the
 *                                key table's size (sched.c key_grow) pass them, and
 *                                within the tables' budget (budget.c, invariant B)
 *
 * Protocol for a mark M (crash-safe without a lock):
 *   1. read M (acquire), and allocate [M, T) for some T > M with fallocate;
 *   2. raise M to T: for ring_committed a CAS loop that only ever increases it (release),
 *      for the receiver's marks a plain store (one writer).
 * Invariant C: every byte below M was allocated by a fallocate that returned success,
 * because whoever raised M to T allocated from an M' <= M onwards, and everything below
 * M' was allocated by induction. A process killed in step 1 leaves M as it was and maybe
 * some pages allocated above it: the next committer allocates them again (fallocate on
 * allocated pages succeeds and changes nothing). Nobody waits for anybody: two producers
 * may commit the same chunk at once, and the one that raises M second changes nothing.
 *
 * Readers stay below the marks: producers check their claim's extent against
 * ring_committed before they claim (ring.c); everything else in the ring lies between
 * head and the tail, which were claimed so. Table readers in other processes read
 * slots and nodes below the fresh marks (core.h slots_touched), which the receiver moves
 * only within committed entries, and the key table within header.keys_active
 * (keytab_view_size), which is never above keys_committed.
 *
 * Giving back: see commit_give_back below (a drained ring returns its idle tail).
 *
 * Running out: a commit that fails for lack of space returns SHM_FULL. A sender then
 * behaves as if the ring were full (it waits and retries up to its timeout); the
 * receiver, whose tables hold a first chunk from create on, keeps delivering, and when
 * the ring is empty it rewinds to offset 0 early (header.ring_short, ring.c
 * ring_rewind) so the committed part is used again. A table that cannot grow makes the
 * window full for that moment (sched_has_room).
 *
 * A filesystem without fallocate (EOPNOTSUPP) gets everything allocated at create,
 * and every mark set to its region's end: nothing is committed later.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>

#include "core.h"

#define RING_CHUNK_MIN (1ull << 20) /* ring commit steps: at least 1 MiB ...            */
#define RING_CHUNK_MAX (8ull << 20) /* ... a sixteenth of what is committed, at most 8 MiB */
#define TABLE_CHUNK (16u << 10)     /* table commit steps: 16 KiB, or an eighth of the table so far */

/* The ring part committed at create, and kept by a give-back: a first chunk. With the
 * tables' first chunks (TABLE_CHUNK each, KEYTAB_MIN keys) it keeps the tables within a
 * tenth of the committed ring from the start. */
static uint64_t ring_first(const shm_chan *c) { return c->cap < RING_CHUNK_MIN ? c->cap : RING_CHUNK_MIN; }

static uint64_t pg_up(uint64_t n) { return (n + SHM_PAGE - 1) & ~(uint64_t)(SHM_PAGE - 1); }
static uint64_t pg_down(uint64_t n) { return n & ~(uint64_t)(SHM_PAGE - 1); }
static uint64_t off_of(shm_chan *c, const void *p) { return (uint64_t)((const uint8_t *)p - c->base); }

/* Allocate file bytes [off, off + len): SHM_OK, SHM_FULL (no space: c->short_errno says
 * why), or SHM_E_SYS. */
static int alloc_range(shm_chan *c, uint64_t off, uint64_t len) {
    if (len == 0 || LOAD_RELAXED(&c->hdr->commit_all)) return SHM_OK; /* set at create */
    for (;;) {
        if (fallocate(c->fd, FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len) == 0) {
            c->short_errno = 0;
            return SHM_OK;
        }
        if (errno == EINTR) continue;
        if (errno == ENOSPC || errno == ENOMEM || errno == EDQUOT || errno == EFBIG) {
            c->short_errno = errno;
            return SHM_FULL;
        }
        return SHM_E_SYS;
    }
}

/* ---- tables (receiver) ----------------------------------------------------------------- */
/* Commit entries [0, need) of a table of `max` entries of `size` bytes at `base`, whose
 * mark is *mark; a chunk at a time. Also commits as many entries of `twin` (the ready heap
 * goes with the slots), if given. */
static int commit_table(shm_chan *c, const void *base, uint32_t size, uint32_t max, uint32_t *mark,
                        uint32_t need, const void *twin, uint32_t twin_size) {
    uint32_t cur = *mark; /* receiver-only */
    if (cur > max) cur = 0; /* a mark gone bad: commit again from the start (idempotent) */
    if (need <= cur) return SHM_OK;
    if (need > max) return SHM_FULL;
    uint64_t step = (uint64_t)cur * size / 8;
    if (step < TABLE_CHUNK) step = TABLE_CHUNK;
    uint64_t target = (uint64_t)cur + step / size;
    if (target < need) target = need;
    if (target > max) target = max;
    /* the tables' budget (budget.c, invariant B): a chunk if it fits, else what is needed */
    uint64_t others = budget_tables_now(c) - pg_up((uint64_t)cur * size) -
                      (twin ? pg_up((uint64_t)cur * twin_size) : 0);
    uint64_t with_need = others + pg_up((uint64_t)need * size) + (twin ? pg_up((uint64_t)need * twin_size) : 0);
    if (!budget_allows(c, with_need)) return SHM_FULL;
    if (!budget_allows(c, others + pg_up(target * size) + (twin ? pg_up(target * twin_size) : 0)))
        target = need;
    uint64_t off = off_of(c, base);
    uint64_t a = pg_down(off + (uint64_t)cur * size), b = pg_up(off + target * size);
    int rc = alloc_range(c, a, b - a);
    if (rc == SHM_FULL && target > need) { /* no room for a chunk: perhaps for what is needed */
        target = need;
        b = pg_up(off + target * size);
        rc = alloc_range(c, a, b - a);
    }
    if (rc == SHM_OK && twin) {
        uint64_t t = off_of(c, twin);
        uint64_t ta = pg_down(t + (uint64_t)cur * twin_size), tb = pg_up(t + target * twin_size);
        rc = alloc_range(c, ta, tb - ta);
    }
    if (rc) return rc;
    /* relaxed: written by the receiver only; other processes read it for stats alone */
    STORE_RELAXED(mark, (uint32_t)target);
    return SHM_OK;
}

int commit_slots(shm_chan *c, uint32_t n) {
    return commit_table(c, c->slots, sizeof(shm_slot), c->cfg.max_messages + 1,
                        &c->hdr->slots_committed, n, c->heap, sizeof(shm_ready));
}

int commit_nodes(shm_chan *c, uint32_t n) {
    return commit_table(c, c->nodes, sizeof(shm_node), c->max_nodes, &c->hdr->nodes_committed, n,
                        NULL, 0);
}

/* The key table grows by whole sizes (sched.c key_grow): commit exactly n entries. */
int commit_keys(shm_chan *c, uint32_t n) {
    shm_header *h = c->hdr;
    uint32_t cur = h->keys_committed; /* receiver-only */
    if (cur > c->keytab_max) cur = 0;
    if (n <= cur) return SHM_OK;
    if (n > c->keytab_max) return SHM_FULL;
    /* the tables' budget (budget.c, invariant B) */
    if (!budget_allows(c, budget_tables_now(c) - pg_up((uint64_t)cur * sizeof(shm_key)) +
                              pg_up((uint64_t)n * sizeof(shm_key))))
        return SHM_FULL;
    uint64_t off = off_of(c, c->keys);
    uint64_t a = pg_down(off + (uint64_t)cur * sizeof(shm_key)), b = pg_up(off + (uint64_t)n * sizeof(shm_key));
    int rc = alloc_range(c, a, b - a);
    if (rc) return rc;
    STORE_RELAXED(&h->keys_committed, n); /* as in commit_table */
    return SHM_OK;
}

/* ---- ring (any producer, and the receiver) -------------------------------------------- */
/* Make ring bytes [pos, end) touchable: SHM_OK, SHM_FULL (no space now), SHM_E_SYS. */
int commit_ring(shm_chan *c, uint64_t pos, uint64_t end) {
    shm_header *h = c->hdr;
    uint64_t need = ring_need(c, pos, end);
    /* acquire: pairs with the release CAS below (another committer's): the pages below
     * the mark it raised were allocated before it raised it. */
    uint64_t cur = LOAD_ACQUIRE(&h->ring_committed);
    if (cur > c->cap) return SHM_E_CORRUPT;
    if (need <= cur) return SHM_OK;
    uint64_t step = cur / 16;
    if (step < RING_CHUNK_MIN) step = RING_CHUNK_MIN;
    if (step > RING_CHUNK_MAX) step = RING_CHUNK_MAX;
    uint64_t target = pg_up(cur + step > need ? cur + step : need);
    if (target > c->cap) target = c->cap;
    uint64_t off = off_of(c, c->ring);
    int rc = alloc_range(c, off + cur, target - cur);
    if (rc == SHM_FULL && target > pg_up(need)) { /* no room for a chunk: the record alone */
        target = pg_up(need) < c->cap ? pg_up(need) : c->cap;
        rc = alloc_range(c, off + cur, target - cur);
    }
    if (rc == SHM_FULL) {
        /* relaxed: a hint for the receiver's rewind (ring.c); a missed one waits for the
         * usual rewind point or the next failure */
        STORE_RELAXED(&h->ring_short, 1);
        return SHM_FULL;
    }
    if (rc) return rc;
    test_pause(SHM_PAUSE_RING_COMMIT);
    /* From the value we read only (invariant C: we allocated from there). release: our
     * fallocate happened before the raise; pairs with the acquire loads of ring_committed
     * here and in claim() (ring.c). If it moved: raised far enough by someone else, fine;
     * otherwise (lowered by a give-back, or raised less far) the caller looks again. */
    if (__atomic_compare_exchange_n(&h->ring_committed, &cur, target, 0, __ATOMIC_RELEASE,
                                    __ATOMIC_ACQUIRE))
        return SHM_OK;
    return cur >= target ? SHM_OK : SHM_AGAIN;
}

/* ---- giving back: a drained ring returns what it committed past its recent need ----
 * The receiver, polling with nothing to do, finds the ring empty and its committed part
 * much larger than a lap from the tail needs (commit_give_back_due). After SHRINK_IDLE_NS
 * of that, it claims the tail itself (ring.c ring_give_back), which stops every producer
 * short of the tail until it publishes the tail again, and between the two:
 *   1. lowers ring_committed to `keep` (seq_cst store);
 *   2. punches [keep, old mark) out of the file (fallocate PUNCH_HOLE).
 * Nothing reads or writes the ring past the tail, and no producer writes before it can
 * claim, which it does only past our record, after acquiring its publication: so it sees
 * the lowered mark and commits (allocates again) what it needs. A producer that was
 * committing beyond the old mark when we lowered it fails its raise (it raises only from
 * the value it read) and looks at the tail again, after us. A receiver killed in
 * between leaves a claim that is repaired like a dead producer's, with the mark lowered
 * or not and pages punched or not: either way every page below the mark is allocated,
 * since the mark is lowered before the punch. */
#define SHRINK_IDLE_NS 1000000000ull /* a drained ring this long idle gives back its tail */

/* The tables give back with the ring, so that they stay within a tenth of it (budget.c):
 * when no node is in use and no key has a chain, every node is free and every key table
 * entry empty (a key with a line or a holder has a node: sched.c), so the node table
 * starts again from its first chunk and the key table from its first size, and what lay
 * past them is punched. The message table keeps its memory: a slot's generation is what
 * makes a stale handle harmless, and it must never start again. Receiver only, between
 * rx_begin and rx_end (handles.c's poll): inspectors retry, and a receiver killed here
 * leaves dirty set, so the next one rebuilds its tables from the marks it finds. Each
 * mark is lowered before its pages are punched, and the key table's size before its
 * mark (keytab_view_size reads the size within the mark). The punch itself waits for a
 * later idle poll, SHRINK_IDLE_NS on (punch_tables): an inspector in another process
 * that read the old size just before may still be reading entries past the new one, and
 * on a full filesystem touching a punched page there could fault. A receiver that dies
 * before the punch leaves those pages allocated above the marks, which invariant C
 * allows. */
static void give_back_range(shm_chan *c, int i, uint64_t a, uint64_t b) {
    if (b <= a) return;
    if (c->punch_end[i] == 0) c->punch_from[i] = a;
    if (a < c->punch_from[i]) c->punch_from[i] = a;
    if (b > c->punch_end[i]) c->punch_end[i] = b;
    c->punch_at = coarse_ns() + SHRINK_IDLE_NS;
}

/* The punches give_back_tables left for later, once due. Only ranges still above the
 * marks are punched (a table that grew again meanwhile keeps what it uses). */
static void punch_tables(shm_chan *c) {
    if (c->punch_at == 0 || coarse_ns() < c->punch_at) return;
    shm_header *h = c->hdr;
    uint64_t above[2] = {pg_up(off_of(c, c->nodes) + (uint64_t)h->nodes_committed * sizeof(shm_node)),
                         pg_up(off_of(c, c->keys) + (uint64_t)h->keys_committed * sizeof(shm_key))};
    for (int i = 0; i < 2; i++) {
        uint64_t a = c->punch_from[i] > above[i] ? c->punch_from[i] : above[i], b = c->punch_end[i];
        if (b > a) (void)fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a, (off_t)(b - a));
        c->punch_from[i] = c->punch_end[i] = 0;
    }
    c->punch_at = 0;
}

static void give_back_tables(shm_chan *c) {
    shm_header *h = c->hdr;
    if (h->nodes_used != 0 || h->skip_keys != 0) return;
    uint32_t first_nodes = TABLE_CHUNK / sizeof(shm_node);
    if (h->nodes_committed > first_nodes && h->nodes_committed <= c->max_nodes) {
        uint32_t n = h->nodes_committed;
        h->free_nodes = NIL;
        STORE_RELAXED(&h->fresh_nodes, 1); /* read by nodes_touched (core.h) */
        STORE_RELAXED(&h->nodes_committed, first_nodes); /* as in commit_table */
        uint64_t a = pg_up(off_of(c, c->nodes) + (uint64_t)first_nodes * sizeof(shm_node));
        uint64_t b = pg_up(off_of(c, c->nodes) + (uint64_t)n * sizeof(shm_node));
        give_back_range(c, 0, a, b);
    }
    uint32_t first_keys = KEYTAB_MIN;
    if (c->keytab_size > first_keys && first_keys < c->keytab_max && h->keys_committed <= c->keytab_max) {
        uint32_t k = h->keys_committed;
        memset(c->keys, 0, sizeof(shm_key) * (size_t)first_keys);
        c->keytab_size = first_keys;
        STORE_RELAXED(&h->keys_active, first_keys); /* as in sched.c key_grow */
        STORE_RELAXED(&h->keys_committed, first_keys);
        uint64_t a = pg_up(off_of(c, c->keys) + (uint64_t)first_keys * sizeof(shm_key));
        uint64_t b = pg_up(off_of(c, c->keys) + (uint64_t)k * sizeof(shm_key));
        give_back_range(c, 1, a, b);
    }
}

uint64_t commit_give_back_due(shm_chan *c, uint64_t pos) {
    shm_header *h = c->hdr;
    if (LOAD_RELAXED(&h->commit_all)) return 0;
    punch_tables(c);
    uint64_t cm = LOAD_ACQUIRE(&h->ring_committed); /* pairs with commit_ring's raise */
    uint64_t keep = pg_up(pos % c->cap + REC_HDR + RING_CHUNK_MIN);
    if (keep < ring_first(c)) keep = ring_first(c);
    if (cm > c->cap || cm < keep + RING_CHUNK_MIN) { /* nothing worth giving back */
        c->shrink_since = 0;
        return 0;
    }
    uint64_t now = coarse_ns();
    if (c->shrink_since == 0 || c->shrink_pos != pos) { /* the ring moved: start again */
        c->shrink_since = now;
        c->shrink_pos = pos;
        return 0;
    }
    if (now - c->shrink_since < SHRINK_IDLE_NS) return 0;
    c->shrink_since = 0;
    return keep;
}

void commit_give_back(shm_chan *c, uint64_t keep) {
    shm_header *h = c->hdr;
    uint64_t cm = LOAD_ACQUIRE(&h->ring_committed); /* pairs with commit_ring's raise */
    if (cm <= keep || cm > c->cap) return;
    /* seq_cst: lowered before the punch below; a committer's raise from the old value
     * fails after this (commit_ring) */
    STORE_SEQCST(&h->ring_committed, keep);
    uint64_t off = off_of(c, c->ring);
    (void)fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(off + keep),
                    (off_t)(cm - keep)); /* best effort: a failure only keeps the memory */
    give_back_tables(c);
}

/* ---- create, adopt, report -------------------------------------------------------------- */
/* At create, before the segment is initialized: the header and registry, a first chunk
 * of each table, and the ring's first chunk (ring_first: it holds the first RING_WARM
 * bytes, which every attachment maps at once, segment.c). SHM_E_SYS with errno ENOSPC if even that does not fit. */
int commit_create(shm_chan *c, uint64_t ring_off, uint64_t producers_end) {
    shm_header *h = c->hdr;
    uint64_t total = ring_off + c->cap;
    if (fallocate(c->fd, FALLOC_FL_KEEP_SIZE, 0, (off_t)producers_end) != 0) {
        if (errno != EOPNOTSUPP) return SHM_E_SYS;
        /* No allocation by range on this filesystem: all of it now (glibc writes a byte per
         * block where the kernel cannot: fine here, nobody else has the file yet). */
        int e = posix_fallocate(c->fd, 0, (off_t)total);
        if (e) {
            errno = e;
            return SHM_E_SYS;
        }
        h->commit_all = 1;
        h->ring_committed = c->cap;
        h->slots_committed = c->cfg.max_messages + 1;
        h->nodes_committed = c->max_nodes;
        h->keys_committed = c->keytab_max;
        h->keys_active = c->keytab_size;
        return SHM_OK;
    }
    c->tables_need = 1; /* the first chunks: the budget's floor (budget.c) */
    int rc = commit_slots(c, 1);
    if (rc == SHM_OK) rc = commit_nodes(c, 1);
    if (rc == SHM_OK) rc = commit_keys(c, c->keytab_size);
    c->tables_need = 0;
    if (rc == SHM_OK) rc = alloc_range(c, ring_off, ring_first(c));
    if (rc == SHM_FULL) errno = c->short_errno;
    if (rc) return SHM_E_SYS;
    h->ring_committed = ring_first(c);
    h->keys_active = c->keytab_size;
    return SHM_OK;
}

/* A receiver taking its seat: trust the table marks only as far as they are in range,
 * allocate below them again (a no-op where allocated: the marks are raised only after
 * success, but they are read from shared memory), and take the key table's size from the
 * header. 0 if all is well, 1 if the size is not one the receiver can have set: the
 * caller then rebuilds the tables (rebuild.c), which picks a size again. */
int commit_adopt(shm_chan *c) {
    shm_header *h = c->hdr;
    if (h->slots_committed > c->cfg.max_messages + 1 || h->slots_committed < 1) h->slots_committed = 0;
    if (h->nodes_committed > c->max_nodes || h->nodes_committed < 1) h->nodes_committed = 0;
    if (h->keys_committed > c->keytab_max) h->keys_committed = 0;
    uint32_t s = h->slots_committed, n = h->nodes_committed, k = h->keys_committed;
    h->slots_committed = h->nodes_committed = h->keys_committed = 0;
    c->tables_need = 1; /* committed before: only allocated again, whatever the budget */
    (void)commit_slots(c, s ? s : 1);
    (void)commit_nodes(c, n ? n : 1);
    (void)commit_keys(c, k);
    c->tables_need = 0;
    /* a size is a power of two from KEYTAB_FLOOR on (a first size doubled), or the most */
    uint32_t a = h->keys_active;
    int ok = a <= h->keys_committed && (a == c->keytab_max || (a >= KEYTAB_FLOOR && (a & (a - 1)) == 0));
    if (!ok) return 1;
    c->keytab_size = a;
    return 0;
}

/* The key table's first size for channels this process creates: KEYTAB_MIN, or what a
 * test set (shm_test_keytab_first), so that growth is exercised in small channels. */
static uint32_t keytab_first_test; /* 0: KEYTAB_MIN */

uint32_t keytab_first(void) {
    /* relaxed: set by a test before it creates channels, in the same thread */
    uint32_t n = __atomic_load_n(&keytab_first_test, __ATOMIC_RELAXED);
    return n ? n : KEYTAB_MIN;
}

int shm_test_keytab_first(uint32_t entries) {
    if (entries != 0 && (entries < KEYTAB_FLOOR || entries > KEYTAB_MIN || (entries & (entries - 1))))
        return SHM_E_INVALID;
    __atomic_store_n(&keytab_first_test, entries, __ATOMIC_RELAXED);
    return SHM_OK;
}

/* The key table size another process may read now (inspect.c), within what is committed;
 * 0 if the header makes no sense (nothing is read then). */
uint32_t keytab_view_size(shm_chan *c) {
    /* relaxed: read inside the inspectors' seqlock section, which validates the reading;
     * the size only grows, and the receiver commits entries before it raises it */
    uint32_t a = LOAD_RELAXED(&c->hdr->keys_active), k = LOAD_RELAXED(&c->hdr->keys_committed);
    return a <= k && a <= c->keytab_max ? a : 0;
}

/* Bytes of the segment backed by the file now, by the marks (a snapshot). */
uint64_t commit_bytes(shm_chan *c) {
    shm_header *h = c->hdr;
    uint64_t total = off_of(c, c->ring) + c->cap;
    if (LOAD_RELAXED(&h->commit_all)) return total;
    uint64_t s = LOAD_RELAXED(&h->slots_committed), n = LOAD_RELAXED(&h->nodes_committed);
    uint64_t k = LOAD_RELAXED(&h->keys_committed), r = LOAD_ACQUIRE(&h->ring_committed);
    if (s > c->cfg.max_messages + 1u) s = c->cfg.max_messages + 1u;
    if (n > c->max_nodes) n = c->max_nodes;
    if (k > c->keytab_max) k = c->keytab_max;
    if (r > c->cap) r = c->cap;
    return off_of(c, c->slots) + pg_up(s * sizeof(shm_slot)) + pg_up(s * sizeof(shm_ready)) +
           pg_up(n * sizeof(shm_node)) + pg_up(k * sizeof(shm_key)) + pg_up(r);
}

int shm_space_short(shm_chan *c) { return c->short_errno; }
