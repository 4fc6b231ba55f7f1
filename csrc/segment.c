/* segment.c -- laying out, creating, validating and mapping a channel's segment.
 *
 * The Python layer opens (or creates and sizes) the named shared memory object and
 * hands us its file descriptor. We compute the layout from the configuration, map
 * the segment with the ring mapped twice back to back (so a record that wraps past
 * the end of the ring reads as one contiguous run of bytes, as the BPF ring buffer
 * does with its data pages), and, when creating, initialize it and publish it by
 * storing the magic number last.
 *
 * Opening validates everything before trusting any of it: magic, layout version,
 * header size, every configuration field's range, and that the offsets stored in
 * the header equal the ones recomputed here; the file must be large enough. After
 * that the process works only from its own validated copy (shm_chan.cfg).
 *
 * Identity and removal. A name is only a name: it can be unlinked and given to a new
 * channel while processes still hold the old segment mapped. So the creator stores a
 * random 64-bit chan_id (and the create time) in the header; whoever caches an
 * attachment by name compares the id read through the name now (shm_read_identity, a
 * pread) with its own, and whoever unlinks a name first checks that it means the channel
 * they meant to remove. Removing a channel sets SHUTDOWN_REMOVED in header.shutdown
 * (shm_mark_removed*), which send_one (ring.c) already loads on every send: from then on
 * sends are refused with SHM_REMOVED at no extra cost, while the receiver drains.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

typedef struct {
    uint64_t producers_off, slots_off, nodes_off, keytab_off, heap_off, ring_off, total;
    uint32_t max_nodes, keytab_size;
} layout;

static uint64_t page_up(uint64_t n) { return (n + SHM_PAGE - 1) & ~(uint64_t)(SHM_PAGE - 1); }

static int config_ok(const shm_config *cfg) {
    if (cfg->capacity < 64 || cfg->capacity > (1ull << 44)) return 0;
    if (cfg->max_keys > SHM_MAX_KEYS_LIMIT) return 0;
    if (cfg->max_messages < 16 || cfg->max_messages > (1u << 24)) return 0;
    if (cfg->order > SHM_ORDER_EAGER) return 0;
    if (cfg->flags & ~(uint32_t)(SHM_CFG_RAW_ONLY | SHM_CFG_DURABLE | SHM_CFG_TEMPORARY)) return 0;
    if (cfg->max_producers < 1 || cfg->max_producers > 65536) return 0;
    if (cfg->handover_ns < 1000000ull || cfg->handover_ns > 3600000000000ull) return 0; /* 1 ms..1 h */
    return 1;
}

static void compute_layout(const shm_config *cfg, layout *L) {
    uint64_t off = page_up(sizeof(shm_header));
    L->producers_off = off;
    off = page_up(off + (uint64_t)cfg->max_producers * sizeof(shm_producer));
    L->slots_off = off;
    off = page_up(off + ((uint64_t)cfg->max_messages + 1) * sizeof(shm_slot));
    /* Two key nodes per message on average, and always room for one message with
     * every key it may carry; index 0 is unused. */
    L->max_nodes = 2 * cfg->max_messages + cfg->max_keys + 1;
    L->nodes_off = off;
    off = page_up(off + (uint64_t)L->max_nodes * sizeof(shm_node));
    /* At most max_nodes keys have a line or a holder at once; keep that load <= 1/2. A
     * quarter more may be keys of parked records only (window.c): at least 4096. Any
     * size will do (core.h key_home): a power of two would double it past a boundary,
     * and a default 1 GiB channel's 2 * max_nodes is just past 2^24 entries. */
    uint32_t ks = 2 * L->max_nodes;
    if (ks < 16384) ks = 16384;
    L->keytab_size = ks;
    L->keytab_off = off;
    off = page_up(off + (uint64_t)ks * sizeof(shm_key));
    L->heap_off = off;
    off = page_up(off + ((uint64_t)cfg->max_messages + 1) * sizeof(shm_ready));
    L->ring_off = off;
    L->total = off + page_up(cfg->capacity); /* the ring is whole pages: it is mapped twice */
}

int shm_layout_size(const shm_config *cfg, uint64_t *total_out) {
    if (!config_ok(cfg)) return SHM_E_INVALID;
    layout L;
    compute_layout(cfg, &L);
    *total_out = L.total;
    return SHM_OK;
}

/* Map meta + ring, then the ring again right after it. */
static int map_segment(int fd, const layout *L, uint64_t cap, uint8_t **base_out, uint64_t *len_out) {
    uint64_t len = L->ring_off + 2 * cap;
    void *area = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (area == MAP_FAILED) return SHM_E_SYS;
    uint8_t *base = area;
    if (mmap(base, L->total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED ||
        mmap(base + L->total, cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
             (off_t)L->ring_off) == MAP_FAILED) {
        int e = errno;
        munmap(area, len);
        errno = e;
        return SHM_E_SYS;
    }
    *base_out = base;
    *len_out = len;
    return SHM_OK;
}

static void bind(shm_chan *c, const layout *L) {
    c->hdr = (shm_header *)c->base;
    c->producers = (shm_producer *)(c->base + L->producers_off);
    c->slots = (shm_slot *)(c->base + L->slots_off);
    c->nodes = (shm_node *)(c->base + L->nodes_off);
    c->keys = (shm_key *)(c->base + L->keytab_off);
    c->heap = (shm_ready *)(c->base + L->heap_off);
    c->ring = c->base + L->ring_off;
    c->cap = page_up(c->cfg.capacity);
    c->cap_mask = (c->cap & (c->cap - 1)) == 0 ? c->cap - 1 : 0; /* see ring_at */
    c->limit = c->cfg.capacity;
    c->max_nodes = L->max_nodes;
    c->keytab_max = L->keytab_size;
    /* the key table's size in use starts small and grows (sched.c); a receiver takes the
     * current one from the header when it takes its seat (commit_adopt) */
    c->keytab_size = L->keytab_size < keytab_first() ? L->keytab_size : keytab_first();
}

/* A random non-zero id; getrandom() practically never fails, but if it does the clock,
 * the pid and the mapping's address still make a collision with the previous channel of
 * the same name vanishingly unlikely. */
static uint64_t new_chan_id(void) {
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        id = hash_bytes((const uint8_t *)&ts, sizeof ts) ^ ((uint64_t)getpid() << 32) ^
             (uint64_t)(uintptr_t)&id;
    }
    return id ? id : 1;
}

static void init_segment(shm_chan *c, const layout *L) {
    shm_header *h = c->hdr;
    /* The file is fresh (ftruncate zero-fills), so only non-zero fields are written. */
    h->layout_version = SHM_LAYOUT_VERSION;
    h->header_bytes = sizeof(shm_header);
    h->cfg = c->cfg;
    h->producers_off = L->producers_off;
    h->slots_off = L->slots_off;
    h->nodes_off = L->nodes_off;
    h->keytab_off = L->keytab_off;
    h->heap_off = L->heap_off;
    h->ring_off = L->ring_off;
    h->max_nodes = L->max_nodes;
    h->keytab_size = L->keytab_size;
    h->segment_size = L->total;
    h->chan_id = new_chan_id();
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    h->created_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    sched_init(c);
    ring_init(c);
    /* release: the segment is complete; pairs with the acquire load in shm_attach. */
    STORE_RELEASE(&h->magic, SHM_MAGIC);
}

/* Read the header of the file `fd` refers to with pread (no mapping): SHM_OK if it is a
 * complete channel of this layout version, SHM_EMPTY while its creator is still
 * initializing it, SHM_E_LAYOUT otherwise.
 * acquire-like: pread copies the header in one go, and the creator stored every other
 * field before it published the magic (release in init_segment), so the fields of a
 * header read with the right magic are final. */
static int read_header(int fd, shm_header *hd) {
    ssize_t got = pread(fd, hd, sizeof *hd, 0);
    if (got < 0) return SHM_E_SYS;
    /* An empty file is a channel being created: its creator makes the name first (O_EXCL,
     * size 0), then sizes it (ftruncate: the whole size at once) and writes the header. */
    if (got == 0) return SHM_EMPTY;
    if ((size_t)got < sizeof *hd) return SHM_E_LAYOUT;
    /* The creator stores the magic last (init_segment): a header without it, whose
     * version is not yet written or is ours, is one being created. */
    if (hd->magic == 0 && (hd->layout_version == 0 || hd->layout_version == SHM_LAYOUT_VERSION))
        return SHM_EMPTY;
    if (hd->magic != SHM_MAGIC || hd->layout_version != SHM_LAYOUT_VERSION ||
        hd->header_bytes != sizeof(shm_header))
        return SHM_E_LAYOUT;
    return SHM_OK;
}

static int validate_header(shm_chan *c, int fd, layout *L) {
    shm_header hd;
    int rc = read_header(fd, &hd);
    if (rc) return rc;
    if (!config_ok(&hd.cfg)) return SHM_E_CORRUPT;
    c->cfg = hd.cfg;
    compute_layout(&c->cfg, L);
    if (hd.producers_off != L->producers_off || hd.slots_off != L->slots_off ||
        hd.nodes_off != L->nodes_off || hd.keytab_off != L->keytab_off || hd.heap_off != L->heap_off ||
        hd.ring_off != L->ring_off || hd.max_nodes != L->max_nodes ||
        hd.keytab_size != L->keytab_size || hd.segment_size != L->total)
        return SHM_E_CORRUPT;
    struct stat st;
    if (fstat(fd, &st) != 0) return SHM_E_SYS;
    if ((uint64_t)st.st_size < L->total) return SHM_E_CORRUPT;
    return SHM_OK;
}

int shm_attach(int fd, int create, const shm_config *cfg, uint64_t token, shm_chan **out) {
    if (token == 0 || token >= TOKEN_MAX) return SHM_E_INVALID;
    shm_chan *c = calloc(1, sizeof *c);
    if (!c) return SHM_E_NOMEM;
    layout L;
    int rc;
    if (create) {
        if (!config_ok(cfg)) {
            free(c);
            return SHM_E_INVALID;
        }
        c->cfg = *cfg;
        compute_layout(cfg, &L);
        struct stat st;
        if (fstat(fd, &st) != 0) rc = SHM_E_SYS;
        else if ((uint64_t)st.st_size < L.total) rc = SHM_E_INVALID;
        else rc = SHM_OK;
    } else {
        rc = validate_header(c, fd, &L);
    }
    c->fd = -1;
    if (rc == SHM_OK) rc = map_segment(fd, &L, page_up(c->cfg.capacity), &c->base, &c->map_len);
    if (rc == SHM_OK) {
        bind(c, &L);
        /* our own descriptor: the caller closes theirs, and commits need one (commit.c) */
        c->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (c->fd < 0) rc = SHM_E_SYS;
        else if (create) rc = commit_create(c, L.ring_off, L.slots_off);
        if (rc != SHM_OK) {
            int e = errno;
            if (c->fd >= 0) close(c->fd);
            munmap(c->base, c->map_len);
            errno = e;
        }
    }
    if (rc != SHM_OK) {
        int e = errno;
        free(c);
        errno = e;
        return rc;
    }
    c->token = token;
    rx_lock_init(&c->rx_mu);
    if (create) init_segment(c, &L);
    /* Map the start of the ring now (core.h RING_WARM): a channel's first messages, and
     * those of every lap after a rewind, land there without a page fault. A read populate
     * maps the file's pages writable (shmem keeps no dirty accounting) and does not dirty
     * a durable channel's file. Best effort: kernels before 5.14 say EINVAL. */
    (void)madvise(c->ring, (size_t)RING_WARM(c), MADV_POPULATE_READ);
    /* acquire: pairs with ring_advance_head; the release store pairs with claim's
     * acquire load of cached_head (ring.c). */
    STORE_RELEASE(&c->cached_head, LOAD_ACQUIRE(&c->hdr->head));
    *out = c;
    return SHM_OK;
}

void shm_detach(shm_chan *c) {
    if (!c) return;
    if (c->producer) shm_producer_detach(c);
    if (c->is_rx) shm_rx_release_ownership(c);
    lookahead_free(c);
    compact_free(c);
    munmap(c->base, c->map_len);
    if (c->fd >= 0) close(c->fd);
    free(c);
}

uint8_t *shm_base(shm_chan *c) { return c->base; }

/* Write the segment back to its file (durable channels): see README "Durability". */
int shm_sync(shm_chan *c) {
    uint64_t len = c->map_len - c->cap; /* the first mapping: meta + ring once */
    return msync(c->base, len, MS_SYNC) == 0 ? SHM_OK : SHM_E_SYS;
}
uint64_t shm_mapped_size(shm_chan *c) { return c->map_len; }

/* ---- identity and removal ----------------------------------------------------------- */
int shm_identity(shm_chan *c, uint64_t *chan_id, uint64_t *created_ns) {
    /* written before the magic was published (release), which shm_attach validated */
    *chan_id = c->hdr->chan_id;
    *created_ns = c->hdr->created_ns;
    return SHM_OK;
}

/* The id of the channel in the file `fd` refers to, read with pread (no mapping):
 * SHM_EMPTY while its creator is still initializing it, SHM_E_LAYOUT if it is not a
 * channel of this layout version. */
int shm_read_identity(int fd, uint64_t *chan_id) {
    shm_header hd;
    int rc = read_header(fd, &hd); /* the id it reads with the right magic is final */
    if (rc) return rc;
    *chan_id = hd.chan_id;
    return SHM_OK;
}

/* The configuration's flags (final once the magic is right, as the id) and, as a hint
 * (a pread is no atomic load), the receiver's token, of the segment open on fd. */
int shm_read_flags_fd(int fd, uint32_t *flags, uint64_t *receiver) {
    shm_header hd;
    int rc = read_header(fd, &hd);
    if (rc) return rc;
    *flags = hd.cfg.flags;
    *receiver = hd.receiver;
    return SHM_OK;
}

int shm_mark_removed(shm_chan *c) {
    /* seq_cst: as shm_shutdown (ring.c): pairs with send_one's loads of shutdown and the
     * receiver's load before it declares the channel drained. */
    __atomic_fetch_or(&c->hdr->shutdown, SHUTDOWN_REMOVED, __ATOMIC_SEQ_CST);
    return SHM_OK;
}

/* Mark the channel in file `fd` removed without attaching to it (the header page only).
 * expect_id != 0: only if it is that channel (SHM_STALE otherwise). */
int shm_mark_removed_fd(int fd, uint64_t expect_id) {
    uint64_t id = 0;
    int rc = shm_read_identity(fd, &id);
    if (rc != SHM_OK) return rc;
    if (expect_id != 0 && id != expect_id) return SHM_STALE;
    size_t len = (size_t)page_up(sizeof(shm_header));
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return SHM_E_SYS;
    shm_header *h = p;
    /* seq_cst: as shm_mark_removed. */
    if (h->chan_id == id) __atomic_fetch_or(&h->shutdown, SHUTDOWN_REMOVED, __ATOMIC_SEQ_CST);
    else rc = SHM_STALE; /* replaced between the read and the mapping (a file rewritten) */
    munmap(p, len);
    return rc;
}

int shm_removed(shm_chan *c) {
    /* acquire: pairs with the fetch-or in shm_mark_removed*. */
    return (LOAD_ACQUIRE(&c->hdr->shutdown) & SHUTDOWN_REMOVED) ? 1 : 0;
}

int shm_read_config(shm_chan *c, shm_config *out) {
    *out = c->cfg;
    return SHM_OK;
}

/* After fork() the child shares the mapping but is another process: new identity, no
 * registry entry, not the receiver, and a fresh process-local mutex (the parent may have
 * held it at the fork). */
int shm_set_identity(shm_chan *c, uint64_t token) {
    if (token == 0 || token >= TOKEN_MAX) return SHM_E_INVALID;
    c->token = token;
    c->producer = 0;
    c->is_rx = 0;
    rx_lock_init(&c->rx_mu);
    return SHM_OK;
}

/* ---- producer registry ---------------------------------------------------------------- */
int shm_producer_attach(shm_chan *c) {
    if (c->producer) return SHM_OK;
    for (uint32_t i = 0; i < c->cfg.max_producers; i++) {
        uint64_t zero = 0;
        /* seq_cst: the registration, naming its owner; pairs with reap's CAS. */
        if (LOAD_RELAXED(&c->producers[i].owner) == 0 &&
            CAS_SEQCST(&c->producers[i].owner, &zero, c->token)) {
            /* Waits a thread began while its process detached from this entry: still
             * counted, and nobody else will take them out (ring.c). Normally none. */
            space_unwait_entry(c, &c->producers[i]);
            c->producer = i + 1;
            return SHM_OK;
        }
    }
    return SHM_FULL;
}

int shm_producer_detach(shm_chan *c) {
    if (!c->producer) return SHM_OK;
    /* Threads still waiting through this entry (a channel closed under them) count no
     * more: their own disarm finds the entry gone (ring.c). */
    space_unwait_entry(c, &c->producers[c->producer - 1]);
    uint64_t me = c->token;
    /* release: our last sent count is visible to whoever registers next; pairs with the
     * CAS in shm_producer_attach. */
    __atomic_compare_exchange_n(&c->producers[c->producer - 1].owner, &me, 0, 0, __ATOMIC_RELEASE,
                                __ATOMIC_RELAXED);
    c->producer = 0;
    return SHM_OK;
}

int shm_producer_slot_owner(shm_chan *c, uint32_t i, uint64_t *owner) {
    if (i >= c->cfg.max_producers) return SHM_E_INVALID;
    *owner = LOAD_ACQUIRE(&c->producers[i].owner); /* pairs with attach / detach */
    return SHM_OK;
}

/* Free the entry of a producer the caller found dead, undoing its waits (ring.c).
 *
 * Restartable: the reaper first marks the entry as its own (owner = its token | TOKEN_MAX,
 * never a producer's token), so that one reaper at a time takes the entry's waits out of
 * space_waiters, then frees it. A reaper killed in between leaves its mark; whoever finds
 * the mark's reaper dead passes the mark as dead_owner and finishes the reap (the waits
 * still in the entry are taken out then, see space_unwait_entry). Otherwise the entry
 * would never be reaped nor reused: a mark names no producer. */
int shm_producer_reap(shm_chan *c, uint32_t i, uint64_t dead_owner) {
    if (i >= c->cfg.max_producers || dead_owner == 0) return SHM_E_INVALID;
    shm_producer *p = &c->producers[i];
    uint64_t expect = dead_owner, mark = c->token | TOKEN_MAX;
    if (dead_owner == mark) return SHM_STALE; /* another thread of ours is reaping it */
    /* seq_cst: elects one reaper; pairs with the registering CAS in shm_producer_attach
     * and with other reapers' CAS (on the dead owner's token or a dead reaper's mark). */
    if (!CAS_SEQCST(&p->owner, &expect, mark)) return SHM_STALE;
    test_pause(SHM_PAUSE_PRODUCER_REAP);
    space_unwait_entry(c, p);
    /* release: the entry's waits are out before it is free; pairs with the CAS in
     * shm_producer_attach. */
    STORE_RELEASE(&p->owner, 0);
    return SHM_OK;
}

/* ---- statistics ------------------------------------------------------------------------ */
int shm_stats_read(shm_chan *c, shm_stats *o) {
    shm_header *h = c->hdr;
    memset(o, 0, sizeof *o);
    uint64_t sent = 0;
    for (uint32_t i = 0; i < c->cfg.max_producers; i++) sent += LOAD_RELAXED(&c->producers[i].sent);
    uint64_t head = LOAD_ACQUIRE(&h->head);      /* pairs with ring_advance_head */
    uint64_t tail = LOAD_ACQUIRE(&h->tail_hint); /* pairs with hint_raise */
    o->capacity = c->limit;
    /* Live bytes: head to tail, less the SKIP records over islands the receiver has seen
     * there, plus the islands head passed (islands.c). Receiver-written: a snapshot. */
    uint64_t span = tail > head ? tail - head : 0, skips = LOAD_RELAXED(&h->skip_bytes);
    o->used_bytes = (span > skips ? span - skips : 0) + LOAD_RELAXED(&h->island_bytes);
    if (o->used_bytes > c->limit) o->used_bytes = c->limit;
    /* Counters written by the consumer are read without synchronization: a snapshot. */
    uint64_t in_window = LOAD_RELAXED(&h->queued_in_window);
    uint64_t taken = LOAD_RELAXED(&h->ingested);
    /* Releases made in other processes reach the counters when the receiver next polls;
     * count the ones still on their way so the snapshot does not lag behind. */
    uint64_t released_pending = 0, nacked_pending = 0, keys_pending = 0, discard_pending = 0;
    for (uint32_t s = 1, used = slots_touched(c, h); s < used; s++) {
        uint32_t st = SLOT_STATE(LOAD_ACQUIRE(&c->slots[s].state)); /* pairs with holders' CAS */
        /* A dead letter dropped by shm_dead_discard leaves dead_letters when the receiver
         * reclaims it; it is no longer listed (shm_dead_list) from the moment of the CAS,
         * so count it out here too, or `stat` shows one figure above its own list. */
        if (st == SLOT_DISCARD) discard_pending++;
        if (st != SLOT_RELEASED && st != SLOT_NACKED) continue;
        if (st == SLOT_RELEASED) released_pending++;
        else nacked_pending++;
        keys_pending += c->slots[s].nkeys;
    }
    uint64_t inflight = LOAD_RELAXED(&h->inflight), held = LOAD_RELAXED(&h->held_keys);
    uint64_t pending = released_pending + nacked_pending;
    o->inflight = inflight > pending ? inflight - pending : 0;
    o->held_keys = held > keys_pending ? held - keys_pending : 0;
    o->queued = in_window + (sent > taken ? sent - taken : 0) + nacked_pending;
    uint64_t dead = LOAD_RELAXED(&h->dead_letters);
    o->dead_letters = dead > discard_pending ? dead - discard_pending : 0;
    o->sent = sent;
    o->delivered = LOAD_RELAXED(&h->delivered);
    o->released = LOAD_RELAXED(&h->released) + released_pending;
    o->redelivered = LOAD_RELAXED(&h->redelivered);
    o->discarded = LOAD_RELAXED(&h->discarded);
    o->window = LOAD_RELAXED(&h->window);
    o->segment_size = h->segment_size;
    o->shutdown = LOAD_ACQUIRE(&h->shutdown); /* pairs with shm_shutdown */
    o->order = c->cfg.order;
    o->max_keys = c->cfg.max_keys;
    o->max_messages = c->cfg.max_messages;
    o->max_attempts = c->cfg.max_attempts;
    o->max_producers = c->cfg.max_producers;
    o->lease_ns = c->cfg.lease_ns;
    o->flags = c->cfg.flags;
    o->layout_version = SHM_LAYOUT_VERSION;
    o->receiver = LOAD_ACQUIRE(&h->receiver); /* pairs with shm_rx_acquire */
    o->committed_bytes = commit_bytes(c);
    o->table_bytes = budget_tables_now(c);
    /* acquire: pairs with commit_ring's raise; a snapshot for people */
    uint64_t ring = LOAD_ACQUIRE(&h->ring_committed);
    o->ring_committed = ring < c->cap ? ring : c->cap;
    return SHM_OK;
}

/* ---- layout facts for tests and tools ---------------------------------------------------
 * Tests that scribble on a segment on purpose ask here where things are, instead of
 * hard-coding offsets that change with the layout. */
int shm_layout_fact(const char *name, uint64_t *out) {
    static const struct {
        const char *name;
        uint64_t value;
    } facts[] = {
        {"header.receiver", offsetof(shm_header, receiver)},
        {"header.dirty", offsetof(shm_header, dirty)},
        {"header.ready_count", offsetof(shm_header, ready_count)},
        {"header.heap_off", offsetof(shm_header, heap_off)},
        {"header.free_slots", offsetof(shm_header, free_slots)},
        {"header.free_nodes", offsetof(shm_header, free_nodes)},
        {"header.fresh_slots", offsetof(shm_header, fresh_slots)},
        {"header.fresh_nodes", offsetof(shm_header, fresh_nodes)},
        {"header.ingest_pos", offsetof(shm_header, ingest_pos)},
        {"header.scan_pos", offsetof(shm_header, scan_pos)},
        {"header.head", offsetof(shm_header, head)},
        {"header.rewinds", offsetof(shm_header, rewinds)},
        {"header.tail_hint", offsetof(shm_header, tail_hint)},
        {"header.rx_sleeping", offsetof(shm_header, rx_sleeping)},
        {"header.space_waiters", offsetof(shm_header, space_waiters)},
        {"header.rx_wake_seq", offsetof(shm_header, rx_wake_seq)},
        {"header.tx_wake_seq", offsetof(shm_header, tx_wake_seq)},
        {"header.async_waiters", offsetof(shm_header, async_waiters)},
        {"header.producers_off", offsetof(shm_header, producers_off)},
        {"producer.size", sizeof(shm_producer)},
        {"producer.owner", offsetof(shm_producer, owner)},
        {"producer.waiting", offsetof(shm_producer, waiting)},
        {"header.writing_n", offsetof(shm_header, writing_n)},
        {"header.max_messages", offsetof(shm_header, cfg) + offsetof(shm_config, max_messages)},
        {"header.slots_off", offsetof(shm_header, slots_off)},
        {"header.nodes_off", offsetof(shm_header, nodes_off)},
        {"header.keytab_off", offsetof(shm_header, keytab_off)},
        {"header.ring_off", offsetof(shm_header, ring_off)},
        {"header.max_nodes", offsetof(shm_header, max_nodes)},
        {"header.keytab_size", offsetof(shm_header, keytab_size)},
        {"header.keys_active", offsetof(shm_header, keys_active)},
        {"header.keys_committed", offsetof(shm_header, keys_committed)},
        {"header.slots_committed", offsetof(shm_header, slots_committed)},
        {"header.nodes_committed", offsetof(shm_header, nodes_committed)},
        {"header.ring_committed", offsetof(shm_header, ring_committed)},
        {"header.segment_size", offsetof(shm_header, segment_size)},
        {"header.max_producers", offsetof(shm_header, cfg) + offsetof(shm_config, max_producers)},
        {"header.size", sizeof(shm_header)},
        {"header.chan_id", offsetof(shm_header, chan_id)},
        {"header.shutdown", offsetof(shm_header, shutdown)},
        {"header.island_count", offsetof(shm_header, island_count)},
        {"header.islands", offsetof(shm_header, islands)},
        {"slot.size", sizeof(shm_slot)},
        {"slot.state", offsetof(shm_slot, state)},
        {"slot.holder", offsetof(shm_slot, holder)},
        {"slot.seq", offsetof(shm_slot, seq)},
        {"slot.pos", offsetof(shm_slot, pos)},
        {"slot.deadline", offsetof(shm_slot, deadline)},
        {"slot.lease_gen", offsetof(shm_slot, lease_gen)},
        {"node.size", sizeof(shm_node)},
        {"key.size", sizeof(shm_key)},
        {"key.tail", offsetof(shm_key, tail)},
        {"record.kind", offsetof(shm_record, kind)},
        {"record.meta", offsetof(shm_record, meta)},
        {"record.data_len", offsetof(shm_record, data_len)},
    };
    for (size_t i = 0; i < sizeof facts / sizeof facts[0]; i++) {
        if (strcmp(facts[i].name, name) == 0) {
            *out = facts[i].value;
            return SHM_OK;
        }
    }
    return SHM_E_INVALID;
}
