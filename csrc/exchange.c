/* exchange.c -- an exchange: bindings shared by every process, and publishes that reach
 * every matched channel or none (two-phase commit over gated ring records).
 *
 * One exchange is one shared segment of fixed size:
 *
 *   exch_header      identity (magic, kind, uid, name), the bindings' version and writer,
 *                    counters
 *   exch_binding[]   EXCH_MAX_BINDINGS entries: (channel, pattern, count)
 *   exch_txn[]       EXCH_MAX_TXNS transaction slots: the commit words of publishes
 *
 * Bindings. Changes are rare and made by any process, so they are serialized by a claim
 * word, `writer`, that names its holder (CAS 0 -> token): a process killed while holding
 * it is found dead by the next writer (the Python layer checks liveness) and replaced
 * (exch_writer_reap). An entry is written while FREE and published by one release store
 * of its state word (gen << 8 | BIND_USED); unbinding stores (gen + 1) << 8 | BIND_FREE.
 * After each change the writer bumps `version` (release). Readers copy each USED entry
 * and re-check its state word afterwards (a per-entry seqlock: a copy made while the
 * entry changed is dropped); they cache what they compiled from the table together with
 * the version they read *before* copying, so any change made after that read makes the
 * next publish re-read. A bind that returned is therefore seen by every publish that
 * starts after it, in every process.
 *
 * Publishing to n channels (exch_publish), all or nothing:
 *   1. take a transaction slot: CAS its owner word 0 -> our token (the claim names us),
 *      then its word (gen, 0, FREE) -> (gen + 1, 0, PENDING).
 *   2. for each channel, in the caller's order: append a GATED record (ring.c) whose
 *      trailer names (exchange name, uid, slot, gen), then count it in the word:
 *      (gen, k, PENDING) -> (gen, k + 1, PENDING). Full, stalled or an error on channel
 *      i: abort (below) and report i.
 *   3. commit: CAS (gen, n, PENDING) -> (gen, n, COMMITTED). This single store is the
 *      publish's linearization point: from here on every copy is delivered.
 *   4. settle each record GATED -> COMMITTED and count it down: (gen, k, st) ->
 *      (gen, k - 1, st), or (gen, 0, FREE) for the last; whoever frees the word then
 *      clears the owner word (release).
 *   Abort: CAS PENDING -> ABORTED, settle each record GATED -> CANCELLED, count down.
 *
 * Transaction word layout:  bits 63..32 generation, 31..8 gated records not yet
 * settled, 7..0 TXN_*. Every change is a CAS on the whole word, so a stale reference
 * (older generation) can never change or read a newer transaction.
 *
 * A publisher killed at any instruction leaves:
 *   - before 2's first record: a slot whose owner is dead and no record: reaped.
 *   - records in CLAIMED or WRITING: the ring's dead-claim path discards them.
 *   - GATED records and a PENDING word: a receiver that meets one (a stall naming the
 *     dead claimant) reads its gate (shm_gate_read), opens the exchange by name and asks
 *     exch_txn_outcome, which CASes PENDING -> ABORTED first: the publish can no longer
 *     commit, so discarding is right, in every channel alike. A record gated but not yet
 *     counted (killed between its GATED store and step 2's count) can only belong to an
 *     uncommitted publish: its word may be freed and reused before it is resolved, and
 *     a generation that does not match, or a FREE word, means "discard".
 *   - a COMMITTED word: every receiver delivers its copy (exch_txn_outcome says commit).
 *     The count still includes every unsettled record, so the word is not freed (and its
 *     generation not reused) before the last of them is settled.
 * Receivers settle (shm_gate_resolve) and then count down (exch_txn_settled). A receiver
 * killed between the two leaves the slot held forever: one slot of EXCH_MAX_TXNS lost.
 * So does a publisher killed in step 4 of a committed publish between settling a copy
 * and counting it down: the reaper cannot tell that copy from one still gated in a
 * channel, which must find the word COMMITTED. The same death in an aborted publish
 * frees the slot (exch_txn_reap).
 *
 * A live publisher is never resolved against: a receiver acts only when the claimant's
 * token is dead. A slow one is waited for, like any unfinished record.
 *
 * Removal. A receiver finds the commit word by the exchange's name (and uid), so the
 * word must stay reachable while a copy of a committed publish may still be gated, also
 * after the exchange's name was removed or given to a new exchange. Removing an exchange
 * (exch_retire, then the Python layer) therefore:
 *   1. stores `removed` (seq_cst), then CASes every PENDING word to ABORTED. A publisher
 *      CASes its word to PENDING (seq_cst) and then loads `removed` (seq_cst) before it
 *      writes any record: either it sees the flag and gives the slot back, or the
 *      remover sees PENDING and aborts it, and the publisher's commit CAS then fails.
 *      So once exch_retire returned, no publish of this exchange commits any more.
 *   2. the caller removes the name if no word is COMMITTED (every copy still gated
 *      then resolves to "discard", found or not); otherwise it renames the segment to a
 *      retired name made of the uid and the name, where receivers look when the name
 *      no longer leads to the uid. The retired name is removed by whoever settles the
 *      last committed copy (a receiver, or the publisher ending its step 4).
 * A record whose exchange is found under neither name belongs to a publish that was not
 * committed (a committed word with copies to settle keeps its slot held, so its segment
 * was retired, not removed) and is discarded.
 */
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"

#define EXCH_MAGIC 0x3148435845534853ull /* "SHSEXCH1" little-endian */

enum { BIND_FREE = 0, BIND_USED = 1 };
#define BIND_STATE(w) ((uint32_t)((w)&0xffu))
#define BIND_GEN(w) ((w) >> 8)
#define BIND_WORD(gen, st) (((uint64_t)(gen) << 8) | (uint64_t)(st))

enum { TXN_FREE = 0, TXN_PENDING = 1, TXN_COMMITTED = 2, TXN_ABORTED = 3 };
#define TXN_STATE(w) ((uint32_t)((w)&0xffu))
#define TXN_COUNT(w) ((uint32_t)(((w) >> 8) & 0xffffffu))
#define TXN_GEN(w) ((uint32_t)((w) >> 32))
#define TXN_WORD(gen, count, st) \
    (((uint64_t)(gen) << 32) | ((uint64_t)(count) << 8) | (uint64_t)(st))

typedef struct {
    uint64_t state; /* BIND_WORD(gen, BIND_*): USED entries are live bindings            */
    uint64_t count; /* messages routed through this binding (publishers add, relaxed)   */
    uint32_t chan_len, pat_len;
    char chan[SHM_GATE_NAME_MAX];
    char pat[EXCH_PATTERN_MAX];
    uint8_t pad[24];
} exch_binding_entry; /* 512 bytes */

typedef struct {
    uint64_t owner; /* token of the publisher holding the slot, 0 = free (CAS to claim)  */
    uint64_t word;  /* TXN_WORD(gen, unsettled records, TXN_*)                          */
    uint64_t pad[6];
} exch_txn; /* one cache line */

typedef struct {
    /* -- written once by the creator, before the magic is published -- */
    uint64_t magic;
    uint32_t layout_version; /* EXCH_LAYOUT_VERSION */
    uint32_t kind;           /* EXCH_KIND_* */
    uint64_t uid;            /* random: gate trailers name it, so a re-created exchange of
                                the same name is never taken for this one */
    uint64_t segment_size;
    uint32_t max_bindings, max_txns;
    uint32_t name_len, pad0;
    char name[SHM_GATE_NAME_MAX];
    /* -- the bindings' change protocol -- */
    _Alignas(SHM_CACHELINE) uint64_t version; /* bumped after every binding change     */
    uint64_t writer;                           /* token of the process changing them, 0 = none */
    uint64_t removed; /* 0, then 1 for good once exch_retire ran (see "Removal" above)   */
    /* -- counters (publishers add, relaxed) -- */
    _Alignas(SHM_CACHELINE) uint64_t published, routed, unroutable;
} exch_header;

struct shm_exch {
    uint8_t *base;
    uint64_t size;
    exch_header *hdr;
    exch_binding_entry *binds;
    exch_txn *txns;
    uint64_t token;
    uint32_t kind;
    uint64_t uid;
    shm_gate gate; /* name and uid, copied once; slot and gen set per publish */
};

static uint64_t binds_off(void) {
    return (sizeof(exch_header) + SHM_CACHELINE - 1) & ~(uint64_t)(SHM_CACHELINE - 1);
}
static uint64_t txns_off(void) {
    return binds_off() + (uint64_t)EXCH_MAX_BINDINGS * sizeof(exch_binding_entry);
}

/* Where the transaction slots begin in the segment (for tests that stage a slot). */
uint64_t exch_txns_offset(void) { return txns_off(); }

uint64_t exch_segment_size(void) {
    uint64_t n = txns_off() + (uint64_t)EXCH_MAX_TXNS * sizeof(exch_txn);
    return (n + SHM_PAGE - 1) & ~(uint64_t)(SHM_PAGE - 1);
}

int exch_attach(int fd, int create, uint32_t kind, const char *name, uint32_t name_len,
                uint64_t uid, uint64_t token, shm_exch **out) {
    *out = NULL;
    if (token == 0 || token >= TOKEN_MAX) return SHM_E_INVALID;
    uint64_t size = exch_segment_size();
    struct stat st;
    if (fstat(fd, &st) != 0) return SHM_E_SYS;
    if (!create && st.st_size == 0) return SHM_EMPTY; /* its creator has yet to size it */
    if ((uint64_t)st.st_size < size) return create ? SHM_E_INVALID : SHM_E_LAYOUT;
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return SHM_E_SYS;
    shm_exch *x = calloc(1, sizeof *x);
    if (!x) {
        munmap(m, size);
        return SHM_E_NOMEM;
    }
    x->base = m;
    x->size = size;
    x->hdr = m;
    x->binds = (exch_binding_entry *)(x->base + binds_off());
    x->txns = (exch_txn *)(x->base + txns_off());
    x->token = token;
    exch_header *h = x->hdr;
    int rc = SHM_OK;
    if (create) {
        if (kind > EXCH_KIND_TOPIC || name_len == 0 || name_len > SHM_GATE_NAME_MAX || uid == 0) {
            rc = SHM_E_INVALID;
        } else {
            h->layout_version = EXCH_LAYOUT_VERSION;
            h->kind = kind;
            h->uid = uid;
            h->segment_size = size;
            h->max_bindings = EXCH_MAX_BINDINGS;
            h->max_txns = EXCH_MAX_TXNS;
            h->name_len = name_len;
            memcpy(h->name, name, name_len);
            /* release: the segment is complete; pairs with the acquire load below. */
            STORE_RELEASE(&h->magic, EXCH_MAGIC);
        }
    } else {
        uint64_t magic = LOAD_ACQUIRE(&h->magic); /* pairs with the creator's release */
        if (magic == 0) rc = SHM_EMPTY;           /* still being created: retry */
        else if (magic != EXCH_MAGIC || h->layout_version != EXCH_LAYOUT_VERSION ||
                 h->segment_size != size || h->max_bindings != EXCH_MAX_BINDINGS ||
                 h->max_txns != EXCH_MAX_TXNS || h->kind > EXCH_KIND_TOPIC || h->uid == 0 ||
                 h->name_len == 0 || h->name_len > SHM_GATE_NAME_MAX)
            rc = SHM_E_LAYOUT;
    }
    if (rc) {
        munmap(m, size);
        free(x);
        return rc;
    }
    /* a validated local copy of the identity: never re-read from the segment */
    x->kind = h->kind;
    x->uid = h->uid;
    x->gate.uid = h->uid;
    x->gate.name_len = h->name_len;
    memcpy(x->gate.name, h->name, h->name_len);
    *out = x;
    return SHM_OK;
}

void exch_detach(shm_exch *x) {
    if (!x) return;
    munmap(x->base, x->size);
    free(x);
}

int exch_set_identity(shm_exch *x, uint64_t token) {
    if (token == 0 || token >= TOKEN_MAX) return SHM_E_INVALID;
    x->token = token;
    return SHM_OK;
}

int exch_info(shm_exch *x, shm_exch_info *out) {
    exch_header *h = x->hdr;
    out->kind = x->kind;
    out->uid = x->uid;
    out->version = LOAD_ACQUIRE(&h->version); /* pairs with the writers' release bump */
    out->published = LOAD_RELAXED(&h->published);
    out->routed = LOAD_RELAXED(&h->routed);
    out->unroutable = LOAD_RELAXED(&h->unroutable);
    out->writer = LOAD_RELAXED(&h->writer);
    out->max_bindings = EXCH_MAX_BINDINGS;
    out->max_txns = EXCH_MAX_TXNS;
    uint32_t busy = 0, committed = 0;
    for (uint32_t i = 0; i < EXCH_MAX_TXNS; i++) {
        if (LOAD_RELAXED(&x->txns[i].owner)) busy++;
        /* acquire: pairs with the CASes on the word (a report, read once per slot) */
        if (TXN_STATE(LOAD_ACQUIRE(&x->txns[i].word)) == TXN_COMMITTED) committed++;
    }
    out->txns_busy = busy;
    out->txns_committed = committed;
    out->removed = LOAD_RELAXED(&h->removed) != 0; /* a report: no ordering needed */
    return SHM_OK;
}

uint64_t exch_version(shm_exch *x) {
    /* acquire: pairs with the release bump in unlock_writer; entries read after this are
     * at least as new as the change that made this version. */
    return LOAD_ACQUIRE(&x->hdr->version);
}

/* ---- bindings ------------------------------------------------------------------------ */

static int lock_writer(shm_exch *x, uint64_t *holder) {
    uint64_t expect = 0;
    /* seq_cst: the claim, naming us; pairs with other writers' CAS and with the release
     * store of 0 in unlock_writer (so we see every entry the last writer wrote). */
    if (CAS_SEQCST(&x->hdr->writer, &expect, x->token)) return SHM_OK;
    *holder = expect;
    return SHM_BUSY;
}

static void unlock_writer(shm_exch *x) {
    /* release: pairs with the acquire load in exch_version: readers that see the new
     * version see the entry's state word stored before it. */
    FETCH_ADD_SEQCST(&x->hdr->version, 1);
    /* release: pairs with the next writer's CAS in lock_writer. */
    STORE_RELEASE(&x->hdr->writer, 0);
}

int exch_writer_reap(shm_exch *x, uint64_t dead) {
    uint64_t expect = dead;
    if (dead == 0) return SHM_E_INVALID;
    /* seq_cst: pairs with lock_writer's CAS. A dead writer may have published an entry
     * without bumping the version: bump it for it. */
    if (!CAS_SEQCST(&x->hdr->writer, &expect, x->token)) return SHM_STALE;
    unlock_writer(x);
    return SHM_OK;
}

static int entry_is(exch_binding_entry *e, const char *chan, uint32_t chan_len, const char *pat,
                    uint32_t pat_len) {
    return BIND_STATE(e->state) == BIND_USED && e->chan_len == chan_len && e->pat_len == pat_len &&
           memcmp(e->chan, chan, chan_len) == 0 && memcmp(e->pat, pat, pat_len) == 0;
}

/* Add (chan, pat). SHM_OK: added; SHM_STALE: already there; SHM_FULL: no free entry;
 * SHM_BUSY: another process holds the writer word (*holder names it). */
int exch_bind(shm_exch *x, const char *chan, uint32_t chan_len, const char *pat, uint32_t pat_len,
              uint64_t *holder) {
    if (chan_len == 0 || chan_len > SHM_GATE_NAME_MAX || pat_len > EXCH_PATTERN_MAX)
        return SHM_E_INVALID;
    int rc = lock_writer(x, holder);
    if (rc) return rc;
    /* Entries change only under the writer word we hold: plain reads are current. */
    exch_binding_entry *free_e = NULL;
    rc = SHM_FULL;
    for (uint32_t i = 0; i < EXCH_MAX_BINDINGS; i++) {
        exch_binding_entry *e = &x->binds[i];
        if (entry_is(e, chan, chan_len, pat, pat_len)) {
            rc = SHM_STALE;
            break;
        }
        if (!free_e && BIND_STATE(e->state) != BIND_USED) free_e = e;
    }
    if (rc == SHM_FULL && free_e) {
        free_e->chan_len = chan_len;
        free_e->pat_len = pat_len;
        memcpy(free_e->chan, chan, chan_len);
        memcpy(free_e->pat, pat, pat_len);
        STORE_RELAXED(&free_e->count, 0);
        /* release: pairs with readers' acquire load of the state in exch_bindings: the
         * strings above are complete when USED is seen. */
        STORE_RELEASE(&free_e->state, BIND_WORD(BIND_GEN(free_e->state) + 1, BIND_USED));
        rc = SHM_OK;
    }
    unlock_writer(x);
    return rc;
}

/* Remove (chan, pat). SHM_OK, SHM_STALE (was not bound) or SHM_BUSY as for exch_bind. */
int exch_unbind(shm_exch *x, const char *chan, uint32_t chan_len, const char *pat,
                uint32_t pat_len, uint64_t *holder) {
    if (chan_len == 0 || chan_len > SHM_GATE_NAME_MAX || pat_len > EXCH_PATTERN_MAX)
        return SHM_E_INVALID;
    int rc = lock_writer(x, holder);
    if (rc) return rc;
    rc = SHM_STALE;
    for (uint32_t i = 0; i < EXCH_MAX_BINDINGS; i++) {
        exch_binding_entry *e = &x->binds[i];
        if (entry_is(e, chan, chan_len, pat, pat_len)) {
            /* release: pairs with readers' re-check of the state word */
            STORE_RELEASE(&e->state, BIND_WORD(BIND_GEN(e->state) + 1, BIND_FREE));
            rc = SHM_OK;
        }
    }
    unlock_writer(x);
    return rc;
}

/* Copy the live bindings into out[0..*n) (at most max); *version is the version read
 * before copying (cache the result under it). */
int exch_bindings(shm_exch *x, shm_binding *out, uint32_t max, uint32_t *n, uint64_t *version) {
    *version = exch_version(x);
    uint32_t k = 0;
    for (uint32_t i = 0; i < EXCH_MAX_BINDINGS && k < max; i++) {
        exch_binding_entry *e = &x->binds[i];
        uint64_t s1 = LOAD_ACQUIRE(&e->state); /* pairs with the writer's release store */
        if (BIND_STATE(s1) != BIND_USED) continue;
        shm_binding *b = &out[k];
        uint32_t cl = e->chan_len, pl = e->pat_len;
        if (cl == 0 || cl > SHM_GATE_NAME_MAX || pl > EXCH_PATTERN_MAX) continue; /* changing */
        memcpy(b->chan, e->chan, cl);
        memcpy(b->pat, e->pat, pl);
        b->chan_len = cl;
        b->pat_len = pl;
        b->index = i;
        b->count = LOAD_RELAXED(&e->count);
        /* acquire fence: the copies above happen before the re-read of the state word,
         * which pairs with the writer's release store when it frees or reuses the entry. */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (LOAD_RELAXED(&e->state) != s1) continue; /* changed while we copied: drop it */
        k++;
    }
    *n = k;
    return SHM_OK;
}

/* Count one publish: `copies` channels got it through the bindings idx[0..nb). */
int exch_note(shm_exch *x, const uint32_t *idx, uint32_t nb, uint64_t copies) {
    exch_header *h = x->hdr;
    FETCH_ADD_RELAXED(&h->published, 1); /* counters: no ordering needed */
    if (copies) FETCH_ADD_RELAXED(&h->routed, copies);
    else FETCH_ADD_RELAXED(&h->unroutable, 1);
    for (uint32_t i = 0; i < nb; i++)
        if (idx[i] < EXCH_MAX_BINDINGS) FETCH_ADD_RELAXED(&x->binds[idx[i]].count, 1);
    return SHM_OK;
}

/* ---- transactions -------------------------------------------------------------------- */

/* A slot whose owner is free-of-records can be reused: drop our claim (abort before any
 * record, or after settling them all). */
static void txn_end_empty(exch_txn *t, uint32_t gen, uint32_t st) {
    uint64_t w = TXN_WORD(gen, 0, st);
    /* seq_cst: pairs with receivers' CASes on the word. */
    if (CAS_SEQCST(&t->word, &w, TXN_WORD(gen, 0, TXN_FREE))) STORE_RELEASE(&t->owner, 0);
}

/* Take a free slot (step 1). SHM_BUSY if every slot is held. */
static int txn_begin(shm_exch *x, uint32_t *slot, uint32_t *gen) {
    uint32_t start = (uint32_t)(x->token ^ (x->token >> 40)) % EXCH_MAX_TXNS;
    for (uint32_t k = 0; k < EXCH_MAX_TXNS; k++) {
        uint32_t i = (start + k) % EXCH_MAX_TXNS;
        exch_txn *t = &x->txns[i];
        uint64_t expect = 0;
        if (LOAD_RELAXED(&t->owner) != 0) continue;
        /* seq_cst: the claim, naming us; pairs with other claimants' CAS and with the
         * release store of 0 in txn_count_down (the word we read next is FREE). */
        if (!CAS_SEQCST(&t->owner, &expect, x->token)) continue;
        uint64_t w = LOAD_ACQUIRE(&t->word); /* pairs with txn_count_down's CAS */
        if (TXN_STATE(w) != TXN_FREE) { /* cannot happen in a correct segment */
            STORE_RELEASE(&t->owner, 0);
            return SHM_E_CORRUPT;
        }
        uint32_t g = TXN_GEN(w) + 1;
        /* seq_cst: pairs with receivers' CAS in exch_txn_outcome. */
        if (!CAS_SEQCST(&t->word, &w, TXN_WORD(g, 0, TXN_PENDING))) {
            STORE_RELEASE(&t->owner, 0);
            return SHM_E_CORRUPT;
        }
        /* seq_cst: pairs with exch_retire's store of `removed` before its scan of the
         * words (see "Removal" at the top): one of us sees the other. */
        if (LOAD_SEQCST(&x->hdr->removed)) {
            txn_end_empty(t, g, TXN_PENDING);
            txn_end_empty(t, g, TXN_ABORTED); /* exch_retire aborted it first */
            return SHM_REMOVED;
        }
        *slot = i;
        *gen = g;
        return SHM_OK;
    }
    return SHM_BUSY;
}

/* CAS the slot's word from state `from` (same gen) to `to`, keeping the count. */
static int txn_move(exch_txn *t, uint32_t gen, uint32_t from, uint32_t to) {
    uint64_t w = LOAD_ACQUIRE(&t->word); /* pairs with the CASes below */
    for (;;) {
        if (TXN_GEN(w) != gen || TXN_STATE(w) != from) return SHM_STALE;
        /* seq_cst: every change of the word is one CAS; pairs with the other parties'
         * CASes (publisher, receivers resolving, reapers). */
        if (CAS_SEQCST(&t->word, &w, TXN_WORD(gen, TXN_COUNT(w), to))) return SHM_OK;
    }
}

/* Count one more gated record (step 2). */
static int txn_count_up(exch_txn *t, uint32_t gen) {
    uint64_t w = LOAD_ACQUIRE(&t->word); /* pairs with the CAS below */
    for (;;) {
        if (TXN_GEN(w) != gen || TXN_STATE(w) != TXN_PENDING || TXN_COUNT(w) >= 0xffffffu)
            return SHM_STALE;
        /* seq_cst: pairs with exch_txn_outcome's CAS: a record counted before the commit
         * is counted in the committed word. */
        if (CAS_SEQCST(&t->word, &w, TXN_WORD(gen, TXN_COUNT(w) + 1, TXN_PENDING))) return SHM_OK;
    }
}

/* One gated record of (slot, gen) was settled: count it down; the last frees the slot. */
static void txn_count_down(exch_txn *t, uint32_t gen) {
    uint64_t w = LOAD_ACQUIRE(&t->word); /* pairs with the CAS below */
    for (;;) {
        uint32_t st = TXN_STATE(w), n = TXN_COUNT(w);
        if (TXN_GEN(w) != gen || st == TXN_FREE || st == TXN_PENDING || n == 0) return;
        uint64_t next = n == 1 ? TXN_WORD(gen, 0, TXN_FREE) : TXN_WORD(gen, n - 1, st);
        /* seq_cst: pairs with the other settlers' CASes; one of them takes the count to 0 */
        if (CAS_SEQCST(&t->word, &w, next)) {
            /* release: pairs with txn_begin's CAS of the owner: the next publisher sees
             * the FREE word. */
            if (n == 1) STORE_RELEASE(&t->owner, 0);
            return;
        }
    }
}


/* Step 0: does channel c look as if it has room for a record of n bytes? Optimistic:
 * tail_hint never runs ahead of the tail and head only grows, so "no" is certain when it
 * is said and "yes" may still meet a full ring in step 2 (another producer took the room
 * meanwhile; then the publish aborts as usual). Islands are ignored for the same reason.
 * A rewind's SKIP at head that ends at a lap's end counts as passed, as claim() in ring.c
 * counts it. */
static int room_for(shm_chan *c, uint64_t n) {
    /* acquire: pairs with the consumer's release store of head (ring_advance_head). */
    uint64_t head = LOAD_ACQUIRE(&c->hdr->head);
    uint64_t tail = LOAD_ACQUIRE(&c->hdr->tail_hint); /* pairs with hint_raise (ring.c) */
    if (tail < head) tail = head;
    if (tail + n + REC_HDR <= head + c->limit) return 1;
    /* acquire: pairs with ring_rewind's release store of the SKIP's meta. */
    uint64_t hm = LOAD_ACQUIRE(&rec_at(c, head)->meta);
    uint64_t hl = META_LEN(hm);
    if (META_STATE(hm) == REC_SKIP && hl <= c->cap && (head + hl) % c->cap == 0)
        return tail + n + REC_HDR <= head + hl + c->limit;
    return 0;
}

/* Publish one message to chans[0..n) all or nothing (steps 1-4 above). On SHM_OK,
 * seqs_out[i] is its seq in chans[i] and wake_out[i] says whether to post that channel's
 * receiver. Otherwise nothing was published and *failed is the channel that refused
 * (SHM_FULL, SHM_STALLED with *stall, an error) or n (SHM_BUSY: no transaction slot). */
int exch_publish(shm_exch *x, shm_chan **chans, uint32_t n, uint32_t kind, const char *data,
                 uint64_t len, const char *keys, uint32_t keys_len, uint32_t nkeys,
                 uint64_t *seqs_out, int *wake_out, uint32_t *failed, shm_stall *stall) {
    uint64_t pos[EXCH_MAX_BINDINGS];
    *failed = n;
    if (n == 0 || n > EXCH_MAX_BINDINGS) return SHM_E_INVALID;
    for (uint32_t i = 0; i < n; i++) {
        wake_out[i] = 0;
        if (chans[i]->token != x->token) return SHM_E_INVALID; /* one identity per process */
    }
    /* 0. A channel without room refuses before any copy is written. Otherwise a publish
     * waiting for one full channel would write (and cancel) a copy in every channel
     * before it on each retry, filling them with cancelled copies their receivers have
     * to pass, and could report one of those as the full channel. */
    uint64_t body = len + align8(x->gate.name_len) + GATE_FOOTER; /* as send_one sizes it */
    for (uint32_t i = 0; i < n; i++) {
        if (nkeys > SHM_MAX_KEYS_LIMIT || body > chans[i]->limit) break; /* step 2 says why */
        if (!room_for(chans[i], rec_size(nkeys, keys_len, body))) {
            *failed = i;
            return SHM_FULL;
        }
    }
    uint32_t slot, gen;
    int rc = txn_begin(x, &slot, &gen);
    if (rc) return rc;
    exch_txn *t = &x->txns[slot];
    shm_gate gate = x->gate;
    gate.slot = slot;
    gate.gen = gen;
    uint32_t done = 0;
    for (; done < n; done++) {
        rc = ring_send_gated(chans[done], kind, (const uint8_t *)data, len, (const uint8_t *)keys,
                             keys_len, nkeys, &gate, &pos[done], &seqs_out[done], stall);
        if (rc) break;
        if (txn_count_up(t, gen)) { /* a reaper or exch_retire aborted us: cannot commit */
            ring_gate_settle(chans[done], pos[done], x->token, REC_CANCELLED, &wake_out[done]);
            rc = SHM_E_CORRUPT;
            break;
        }
        if (done == 0 && n > 1) test_pause(SHM_PAUSE_EXCH_GATED);
    }
    /* 3. the commit */
    if (rc == SHM_OK && txn_move(t, gen, TXN_PENDING, TXN_COMMITTED) != SHM_OK) rc = SHM_E_CORRUPT;
    /* Aborted by exch_retire, not by a reaper: the exchange was removed (*failed = n).
     * acquire: pairs with exch_retire's store, made before its abort CAS. */
    int retired = rc == SHM_E_CORRUPT && LOAD_ACQUIRE(&x->hdr->removed) != 0;
    if (retired) rc = SHM_REMOVED;
    uint32_t final = rc == SHM_OK ? REC_COMMITTED : REC_CANCELLED;
    if (rc != SHM_OK) {
        *failed = retired ? n : done;
        txn_move(t, gen, TXN_PENDING, TXN_ABORTED);
        if (done == 0) txn_end_empty(t, gen, TXN_ABORTED);
    }
    /* 4. settle every record and count it down (the last one frees the slot) */
    for (uint32_t i = 0; i < done; i++) {
        ring_gate_settle(chans[i], pos[i], x->token, final, &wake_out[i]);
        txn_count_down(t, gen);
        if (i == 0 && done > 1 && final == REC_COMMITTED) test_pause(SHM_PAUSE_EXCH_SETTLED);
    }
    return rc;
}

/* Receiver side: what did transaction (slot, gen) decide? The caller found one of its
 * records GATED with a dead claimant, dead_owner. *commit = 1: deliver; 0: discard. */
int exch_txn_outcome(shm_exch *x, uint32_t slot, uint32_t gen, uint64_t dead_owner, int *commit) {
    *commit = 0;
    if (slot >= EXCH_MAX_TXNS) return SHM_OK; /* not ours: discard */
    exch_txn *t = &x->txns[slot];
    uint64_t w = LOAD_ACQUIRE(&t->word); /* pairs with the publisher's CASes */
    for (;;) {
        if (TXN_GEN(w) != gen) return SHM_OK; /* freed: an uncounted, uncommitted record */
        uint32_t st = TXN_STATE(w);
        if (st == TXN_COMMITTED) {
            *commit = 1;
            return SHM_OK;
        }
        if (st != TXN_PENDING) return SHM_OK; /* ABORTED or FREE */
        /* PENDING: only its (dead) owner could still commit it. */
        if (LOAD_ACQUIRE(&t->owner) != dead_owner) return SHM_STALE; /* pairs with txn_begin */
        /* seq_cst: pairs with the publisher's commit CAS: exactly one of them wins. */
        if (CAS_SEQCST(&t->word, &w, TXN_WORD(gen, TXN_COUNT(w), TXN_ABORTED))) return SHM_OK;
    }
}

/* Receiver side: one record of (slot, gen) was settled (after shm_gate_resolve). */
int exch_txn_settled(shm_exch *x, uint32_t slot, uint32_t gen) {
    if (slot >= EXCH_MAX_TXNS) return SHM_E_INVALID;
    txn_count_down(&x->txns[slot], gen);
    return SHM_OK;
}

/* Slot i's transaction word (TXN_WORD: generation, copies not yet counted down, state),
 * for inspection and tests. */
int exch_txn_word(shm_exch *x, uint32_t i, uint64_t *word) {
    if (i >= EXCH_MAX_TXNS) return SHM_E_INVALID;
    *word = LOAD_ACQUIRE(&x->txns[i].word); /* pairs with the CASes on it */
    return SHM_OK;
}

/* Slot i's owner (0 = free), for the Python layer's liveness check. */
int exch_txn_owner(shm_exch *x, uint32_t i, uint64_t *owner) {
    if (i >= EXCH_MAX_TXNS) return SHM_E_INVALID;
    *owner = LOAD_ACQUIRE(&x->txns[i].owner); /* pairs with txn_begin / txn_count_down */
    return SHM_OK;
}

/* Slot i's owner `dead` is dead: abort its transaction if still PENDING, and free the
 * slot if no record of it is left to settle, or if it was aborted.
 * An aborted slot is freed whatever its count: every copy of an aborted publish is
 * discarded, and a copy still gated resolves to "discard" as well once the word is
 * freed or reused (a newer generation, or FREE: exch_txn_outcome), and its count-down
 * then touches nothing (txn_count_down checks the generation). Not freeing it leaked the
 * slot whenever the publisher died between cancelling a copy and counting it down
 * (exch_publish's step 4), which nobody else would count. A committed slot with copies
 * left is kept: a copy still gated must find the word COMMITTED (see the top). */
int exch_txn_reap(shm_exch *x, uint32_t i, uint64_t dead) {
    if (i >= EXCH_MAX_TXNS || dead == 0) return SHM_E_INVALID;
    exch_txn *t = &x->txns[i];
    if (LOAD_ACQUIRE(&t->owner) != dead) return SHM_STALE; /* pairs with txn_begin */
    uint64_t w = LOAD_ACQUIRE(&t->word);                   /* pairs with the CASes on it */
    uint32_t gen = TXN_GEN(w);
    if (TXN_STATE(w) == TXN_PENDING) {
        txn_move(t, gen, TXN_PENDING, TXN_ABORTED);
        w = LOAD_ACQUIRE(&t->word); /* pairs with txn_move's CAS */
    }
    if (TXN_GEN(w) != gen) return SHM_STALE; /* moved on meanwhile: look again later */
    if (TXN_STATE(w) == TXN_ABORTED && TXN_COUNT(w) != 0) {
        /* seq_cst: pairs with settlers' CASes in txn_count_down; losing to one of them
         * means the count moved: look again later. */
        if (!CAS_SEQCST(&t->word, &w, TXN_WORD(gen, 0, TXN_FREE))) return SHM_STALE;
        w = TXN_WORD(gen, 0, TXN_FREE);
    }
    if (TXN_COUNT(w) != 0) return SHM_STALE; /* committed copies left: keep it */
    if (TXN_STATE(w) != TXN_FREE) txn_end_empty(t, gen, TXN_STATE(w));
    /* died between claiming the owner word and the PENDING store, or after freeing the
     * word: the word is FREE; drop the claim. seq_cst: pairs with txn_begin's CAS. */
    uint64_t expect = dead;
    w = LOAD_ACQUIRE(&t->word);
    if (TXN_STATE(w) == TXN_FREE) CAS_SEQCST(&t->owner, &expect, 0);
    return SHM_OK;
}

/* Refuse every publish that has not committed yet, and every later one, for good
 * ("Removal" at the top). Afterwards no word becomes COMMITTED: exch_info's
 * txns_committed can only go down. */
int exch_retire(shm_exch *x) {
    /* seq_cst: pairs with txn_begin's load of `removed` after its PENDING CAS. */
    STORE_SEQCST(&x->hdr->removed, 1);
    for (uint32_t i = 0; i < EXCH_MAX_TXNS; i++) {
        exch_txn *t = &x->txns[i];
        uint64_t w = LOAD_SEQCST(&t->word); /* pairs with txn_begin's PENDING CAS */
        while (TXN_STATE(w) == TXN_PENDING) {
            /* seq_cst: pairs with the publisher's commit CAS: exactly one of them wins. */
            if (CAS_SEQCST(&t->word, &w, TXN_WORD(TXN_GEN(w), TXN_COUNT(w), TXN_ABORTED))) break;
        }
    }
    return SHM_OK;
}

/* 1 once exch_retire ran on this exchange (publishes are refused), else 0. */
int exch_removed(shm_exch *x) {
    /* acquire: pairs with exch_retire's store; a publisher that sees 1 after its publish
     * returned may find the retired name to remove ("Removal" at the top). */
    return LOAD_ACQUIRE(&x->hdr->removed) != 0;
}
